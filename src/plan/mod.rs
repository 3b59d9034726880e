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
//! `mod.rs` holds the steps' orchestration and `plan_trace` (for jobs that plan themselves);
//! `placement.rs` step 3; `file.rs` the plan file; `evaluate.rs` step 4, the only file that
//! replays.
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

use std::ops::Range;

use serde::Serialize;

use crate::allocator::{MAX_PLAN_ENTRIES, Plan, TraceEntry};
use crate::config::AllocatorConfig;
use crate::iterations::{Allocation, allocations, find_iteration};
pub use crate::iterations::{
    CANDIDATE_PERIODS, MAX_MULTIPLE, MAX_PERIOD, MAX_PLANNED_SIZE, SCAN_WORK,
};

use crate::recording::Recording;
use crate::replay::ReplayError;

mod evaluate;
mod file;
mod placement;

pub use evaluate::{Evaluation, evaluate};
pub use file::{
    MAX_PLAN_FILE_BYTES, PLAN_FORMAT, PLAN_VERSION, PlanFile, PlanFileError, PlanFormatError,
    PlanSource, parse_plan, read_plan_file,
};
use placement::plan_iteration;

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

/// What to plan.
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    /// Which device's trace.
    pub device: u32,
    /// The configuration the plan is for (its rounding); `None` for the recorded one.
    pub config: Option<AllocatorConfig>,
    /// The trace events of the iteration to plan; `None` to find it.
    pub events: Option<Range<usize>>,
}

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
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// A plan and what the planner found.
#[derive(Clone, Debug, Serialize)]
pub struct Planned {
    /// The plan.
    pub plan: Plan,
    /// The recording's file name.
    pub recording: String,
    /// The device whose trace was planned.
    pub device: u32,
    /// The planned iteration: its first allocation and length (allocations), how many
    /// iterations ran in a row, its events.
    pub first_allocation: usize,
    /// Allocations per iteration.
    pub period: usize,
    /// Iterations found in a row (1 for a given range).
    pub iterations: usize,
    /// The planned iteration's events.
    pub events: Range<usize>,
    /// The events after it that the plan is evaluated on: the remaining iterations (for a
    /// given range: the rest of the trace).
    pub evaluated: Range<usize>,
    /// The regions' bytes together.
    pub region_bytes: u64,
    /// The most bytes the planned allocations hold at once.
    pub lower_bound_bytes: u64,
    /// Bytes of the persistent allocations (they outlive an iteration).
    pub persistent_bytes: u64,
}

impl Planned {
    /// The plan file `gpumem plan -o` writes: the plan, and where it came from.
    pub fn file(&self) -> PlanFile {
        let source = PlanSource {
            recording: self.recording.clone(),
            device: self.device,
            first_allocation: self.first_allocation,
            period: self.period,
            iterations: self.iterations,
            events: [self.events.start, self.events.end],
            evaluated: [self.evaluated.start, self.evaluated.end],
            lower_bound_bytes: self.lower_bound_bytes,
            persistent_bytes: self.persistent_bytes,
        };
        PlanFile::new(&self.plan, Some(source))
    }
}

/// Plans `options.device`'s trace of `recording` (`name` goes into the plan's source).
///
/// # Errors
/// A [`PlanningError`] when the device has no trace or no iteration is found.
pub fn plan(
    recording: &Recording,
    name: &str,
    options: &PlanOptions,
) -> Result<Planned, PlanningError> {
    let events = recording.device_traces.get(options.device as usize).ok_or(
        PlanningError::NoSuchDevice {
            device: options.device,
            devices: recording.device_traces.len(),
        },
    )?;
    let config = options
        .config
        .clone()
        .or_else(|| recording.config.clone())
        .unwrap_or_default();
    let allocations = allocations(events, &config);
    let (first, period, iterations) = match &options.events {
        Some(range) => {
            let first = allocations.partition_point(|a| a.event < range.start);
            let end = allocations.partition_point(|a| a.event < range.end);
            if end <= first {
                return Err(PlanningError::NoIteration(format!(
                    "events {}..{} hold no allocation",
                    range.start, range.end
                )));
            }
            if end - first > MAX_PERIOD {
                return Err(PlanningError::NoIteration(format!(
                    "events {}..{} hold {} allocations, at most {MAX_PERIOD} are planned",
                    range.start,
                    range.end,
                    end - first
                )));
            }
            (first, end - first, 1)
        }
        None => find_iteration(&allocations).ok_or_else(|| {
            PlanningError::NoIteration(format!(
                "no sequence of allocations repeats itself in device {}'s trace ({} allocations)",
                options.device,
                allocations.len()
            ))
        })?,
    };
    let (plan, lower_bound, planned) = plan_iteration(&allocations, first, period, events.len());
    let evaluated_end = if options.events.is_some() {
        events.len()
    } else {
        event_at(&allocations, first + period * iterations, events.len())
    };
    let persistent_bytes = plan
        .entries
        .iter()
        .filter(|e| e.persistent)
        .map(|e| e.size)
        .sum();
    Ok(Planned {
        region_bytes: plan.region_bytes(),
        plan,
        recording: name.to_string(),
        device: options.device,
        persistent_bytes,
        first_allocation: first,
        period,
        iterations,
        evaluated: planned.end..evaluated_end,
        events: planned,
        lower_bound_bytes: lower_bound,
    })
}

/// The device of `recording` a plan serves best, where the user named none, and why: the one
/// whose repeating iteration (under `config`, else the recorded configuration) covers the
/// most allocations, the lowest device on a tie; the first device with a trace where none
/// repeats (its planning then says why). `None` when no device has a trace. The reason is
/// given only where the recording has several devices with traces or not device 0.
pub fn best_device(
    recording: &Recording,
    config: Option<&AllocatorConfig>,
) -> Option<(u32, Option<String>)> {
    let config = config
        .cloned()
        .or_else(|| recording.config.clone())
        .unwrap_or_default();
    let traced: Vec<u32> = recording.traced_devices().collect();
    let covered = |device: u32| {
        let allocations = allocations(recording.trace(device), &config);
        find_iteration(&allocations).map(|(_, period, iterations)| (period, iterations))
    };
    let found: Vec<(u32, usize, usize)> = traced
        .iter()
        .filter_map(|&d| covered(d).map(|(p, n)| (d, p, n)))
        .collect();
    let best = found
        .iter()
        .max_by_key(|&&(d, period, iterations)| (period * iterations, std::cmp::Reverse(d)));
    let (device, why) = match best {
        Some(&(device, period, iterations)) => (
            device,
            format!(
                "device {device}: its trace repeats {iterations} iterations of {period} allocations, the most allocations a plan covers of the recording's {} devices with traces (--device plans another)",
                traced.len()
            ),
        ),
        None => {
            let device = *traced.first()?;
            (
                device,
                format!(
                    "device {device}: the first device with a trace (no device's allocations repeat)"
                ),
            )
        }
    };
    let say = traced.len() > 1 || device != 0;
    Some((device, say.then_some(why)))
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
