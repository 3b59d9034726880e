//! A recording's plan: which device to plan, its iteration found (or named) in that device's
//! trace, placed, and the events the evaluation replays (steps 1–3 of the module doc, for a
//! recording; `plan_trace` does the same for a job's own trace).

use std::ops::Range;

use serde::Serialize;

use crate::allocator::{Plan, PlanMode};
use crate::config::AllocatorConfig;
use crate::iterations::{allocations, find_iteration};
use crate::recording::Recording;

use super::placement::plan_iteration;
use super::{MAX_PERIOD, PlanFile, PlanSource, PlanningError, event_at};

/// What to plan.
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    /// Which device's trace.
    pub device: u32,
    /// The configuration the plan is for (its rounding); `None` for the recorded one.
    pub config: Option<AllocatorConfig>,
    /// The trace events of the iteration to plan; `None` to find it.
    pub events: Option<Range<usize>>,
    /// How its regions and chunks hold memory.
    pub mode: PlanMode,
}

/// A plan and what the planner found.
#[derive(Clone, Debug, Serialize)]
pub struct Planned {
    /// The plan.
    #[serde(serialize_with = "super::file::serialize_plan")]
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
    let (mut plan, lower_bound, planned) =
        plan_iteration(&allocations, first, period, events.len());
    plan.mode = options.mode;
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
