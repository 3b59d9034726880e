//! A plan's honest evaluation (step 4 of the module documentation of `plan`): the events it
//! was not made from, replayed from an empty allocator under the configuration and again
//! following the plan.

use std::ops::Range;

use serde::Serialize;

use crate::allocator::Plan;
use crate::config::AllocatorConfig;
use crate::replay::{Mode, ReplayError, ReplayReport, Session, WhatIf};

/// A plan's evaluation on the events it was not made from.
#[derive(Clone, Debug, Serialize)]
pub struct Evaluation {
    /// The events replayed.
    pub events: Range<usize>,
    /// Under the recorded configuration.
    pub default: ReplayReport,
    /// Following the plan (same configuration).
    pub planned: ReplayReport,
}

impl Evaluation {
    /// Bytes the plan held less than the caching allocator at their peaks (what
    /// [`Plan::saved_bytes`] records).
    pub fn saved_bytes(&self) -> u64 {
        (self.default.peak_reserved).saturating_sub(self.planned.peak_reserved)
    }
}

/// Replays `window` of the session's trace from an empty allocator, under `config` (`None`:
/// the recorded configuration) and then following `plan` (each a what-if of the session:
/// on a recording with an OOM, within the memory the job had).
///
/// # Errors
/// A [`ReplayError`] when a replay cannot run, [`ReplayError::MemoryBudget`] among them.
pub fn evaluate(
    session: &Session,
    config: Option<AllocatorConfig>,
    plan: &std::sync::Arc<Plan>,
    window: Range<usize>,
) -> Result<Evaluation, ReplayError> {
    let default = WhatIf::default()
        .under(config)
        .on_events(Some(window.clone()));
    let planned = default.clone().following(Some(plan.clone()));
    Ok(Evaluation {
        events: window,
        default: session.replay(&Mode::WhatIf(default), 0, &mut |_, _| {})?,
        planned: session.replay(&Mode::WhatIf(planned), 0, &mut |_, _| {})?,
    })
}
