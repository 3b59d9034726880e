//! A job that plans itself on a real recording, with whole segments (the default configuration): see `recording/mod.rs`.

mod common;
mod recording;

#[test]
fn a_job_that_plans_itself_reaches_the_offline_plan_of_its_recording() {
    recording::plans_itself_under("");
}
