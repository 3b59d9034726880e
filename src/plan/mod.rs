//! The planner (`gpumem plan`): a placement plan from a recording, and its honest evaluation.
//!
//! 1. **Allocations.** Each `alloc` of the device's trace, with its rounded size (under the
//!    configuration planned for), its stream, its event and the event its free completed.
//! 2. **The iteration.** Every period up to [`MAX_PERIOD`] allocations is tried (for traces
//!    too long for [`SCAN_WORK`], the [`CANDIDATE_PERIODS`] most frequent distances between
//!    consecutive equal (rounded size, stream) pairs and their multiples up to
//!    [`MAX_MULTIPLE`]), each at its longest run of the sequence repeating itself. A period
//!    needs two iterations in a row; the one kept maximises the allocations its run covers
//!    times the share of its first iteration's bytes that are placeable, the shortest on a
//!    tie. An allocation is placeable when its free completes less than one iteration (in
//!    events) after it was made: then it repeats in the same place every iteration; the
//!    others are persistent (bumped into chunks, some tried in the region first: step 3).
//!    `--events A..B` names the iteration instead.
//! 3. **Placement** (the dynamic storage allocation problem), per stream (at most
//!    `MAX_PLAN_STREAMS`, those whose allocations take the most bytes; the others' allocations
//!    are left to the caching allocator, so that the plan's reader takes every plan): lifetimes are
//!    taken on the iteration's circle (an allocation freed in the next iteration wraps round),
//!    and allocations are placed one by one at the lowest offset free over their lifetime,
//!    in several orders (by size, by size × lifetime, by lifetime, by start), first and best
//!    fit, then improved by local search (random moves of the order: the allocation that
//!    sets the top ahead, or two swapped; kept unless the top rises). The lower bound is the
//!    most bytes live at once. A persistent allocation freed within [`BET_ITERATIONS`]
//!    iterations is then given the place in its region free longest from its start
//!    (`try_offsets`): tried before its chunk, for the instances that live shorter (the
//!    first iteration's output held on to is the common case).
//! 4. **Evaluation** ([`evaluate`]): the iterations after the planned one are replayed from
//!    an empty allocator under the recorded configuration, and again following the plan;
//!    both peaks come from that window alone.
//!
//! `mod.rs` holds `plan_trace` (for jobs that plan themselves: what gpumem-torch links);
//! `placement.rs` step 3; `file.rs` the plan file; `recorded.rs` steps 1–3 for a recording
//! and the choice of its device; `evaluate.rs` step 4, the only file that replays. The last
//! two read recordings and replay, so they come with the `tools` feature only.
//!
//! # Budgets
//! - Periods up to [`MAX_PERIOD`] allocations; the search makes at most [`SCAN_WORK`] token
//!   comparisons, or O(allocations × candidates) beyond.
//! - Placement is O(period²) per order and round; local search stops after
//!   [`LOCAL_SEARCH_ROUNDS`] rounds or once [`PLACEMENT_WORK`] overlap tests were spent;
//!   choosing where persistent allocations are tried stops after [`TRY_WORK`].
//! - Allocations of [`MAX_PLANNED_SIZE`] or more are left out (the trace's sizes are any
//!   u64), so every sum of sizes stays far from overflowing.
//! - Plan files are read up to [`MAX_PLAN_FILE_BYTES`], then validated
//!   ([`Plan::validate`]).
//! - Memory: every replay of the evaluation is held to the caller's
//!   session's `Setup::max_memory_bytes` (`gpumem plan --max-memory-bytes`), the plan's paged
//!   regions and chunks and the simulated device's pages included: a region far larger than
//!   the device is address space until it is used, and mapping its pages stops with
//!   [`ReplayError::MemoryBudget`] before they would pass the budget.

use crate::allocator::{MAX_PLAN_ENTRIES, Plan, TraceEntry};
use crate::config::AllocatorConfig;
use crate::iterations::{Allocation, allocations, find_iteration};
pub use crate::iterations::{
    CANDIDATE_PERIODS, MAX_MULTIPLE, MAX_PERIOD, MAX_PLANNED_SIZE, SCAN_WORK,
};
#[cfg(feature = "tools")]
use crate::replay::ReplayError;

#[cfg(feature = "tools")]
mod evaluate;
mod file;
mod placement;
#[cfg(feature = "tools")]
mod recorded;

#[cfg(feature = "tools")]
pub use evaluate::{Evaluation, evaluate};
pub use file::{
    MAX_PLAN_FILE_BYTES, PLAN_FORMAT, PLAN_VERSION, PlanFile, PlanFileError, PlanFormatError,
    PlanSource, parse_plan, read_plan_file,
};
use placement::plan_iteration;
#[cfg(feature = "tools")]
pub use recorded::{PlanOptions, Planned, best_device, plan};

/// Rounds of local search at most.
pub const LOCAL_SEARCH_ROUNDS: usize = 400;
/// Overlap tests after which the local search stops (the first greedy passes included; they
/// alone are at most 8 × [`MAX_PERIOD`]² / 2).
pub const PLACEMENT_WORK: u64 = 400_000_000;
/// Iterations within which a persistent allocation's free must complete for it to be tried
/// in the region first (`bet_on`).
pub const BET_ITERATIONS: usize = 3;
/// Overlap tests spent choosing where persistent allocations are tried first.
pub const TRY_WORK: u64 = 200_000_000;

const _: () = assert!(MAX_PERIOD <= MAX_PLAN_ENTRIES);

/// Why no plan could be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanningError {
    /// The recording has no trace for the device.
    #[error("the recording has no trace for device {device} ({devices} device traces)")]
    NoSuchDevice {
        /// The device asked for.
        device: u32,
        /// Device traces in the recording.
        devices: usize,
    },
    /// No allocation sequence repeats itself (or the given range holds no allocation).
    #[error("{0}")]
    NoIteration(String),
    /// The replay for the evaluation failed.
    #[cfg(feature = "tools")]
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// Plans the repeating iteration of a trace a job recorded itself (`plan_record:N`: the
/// core's own trace, rounded under `config`), as [`plan`] plans a recording's.
///
/// # Errors
/// [`PlanningError::NoIteration`] when no sequence of allocations repeats itself.
pub fn plan_trace(events: &[TraceEntry], config: &AllocatorConfig) -> Result<Plan, PlanningError> {
    let allocations = allocations(events, config);
    let (first, period, _) = find_iteration(&allocations).ok_or_else(|| {
        PlanningError::NoIteration(format!(
            "no sequence of allocations repeats itself in the {} events recorded ({} allocations)",
            events.len(),
            allocations.len()
        ))
    })?;
    Ok(plan_iteration(&allocations, first, period, events.len()).0)
}

/// The event of allocation `k`, or the end of a trace of `events` events past the last.
fn event_at(allocations: &[Allocation], k: usize, events: usize) -> usize {
    allocations.get(k).map_or(events, |a| a.event)
}
