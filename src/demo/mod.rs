//! The demo: what `gpumem demo` and `gpumem simulate` run where no GPU is, and what the tests
//! drive the core and the agent with.
//!
//! - [`node`]: a simulated GPU node whose processes replay recordings (its NVML view, its
//!   kubelet), the agent's sources when there is no driver.
//! - [`workload`]: a synthetic training loop (with private pools, with IPC) over the core.
//!
//! Nothing in the agent's real path depends on this module (`tests/it/layout.rs` checks
//! telemetry's side); it depends on the telemetry's plain data (the node view it imitates),
//! the sources it publishes, replay, explain (where each recording peaks) and the planner
//! (its first process follows a plan).

pub mod node;
mod oom_job;
pub mod workload;

pub use node::{SimNode, SimNodeConfig, SimNodeError};
