//! A recording's plan: which device to plan, its iteration found (or named) in that device's
//! trace, placed, and the events the evaluation replays (steps 1–3 of the module doc, for a
//! recording; `plan_trace` does the same for a job's own trace).

use std::ops::Range;

use serde::Serialize;

use crate::allocator::{Plan, PlanMode};
use crate::config::AllocatorConfig;
use crate::iterations::{IterationSource, allocations, find_iteration};
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
    /// Where the iterations came from: the job's profiler steps (the second of three or
    /// more is planned: a job's first step often differs), the search, or `None` for a
    /// given range.
    pub source: Option<IterationSource>,
    /// The planned step's number (`ProfilerStep#N`), where the profiler named them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
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
    let mut source = None;
    let mut step = None;
    // The allocation after the last iteration found (the steps' may differ in length).
    let mut found_end = None;
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
        None => {
            let found =
                crate::iterations::of_recording(recording, options.device, events, &allocations)
                    .ok_or_else(|| {
                        PlanningError::NoIteration(format!(
                            "no sequence of allocations repeats itself in device {}'s trace ({} allocations)",
                            options.device,
                            allocations.len()
                        ))
                    })?;
            // Of three steps or more, the second: a job's first often differs.
            let k =
                usize::from(found.count() >= 3 && found.source == IterationSource::ProfilerSteps);
            let planned = found.range(k);
            if planned.len() > MAX_PERIOD || planned.is_empty() {
                return Err(PlanningError::NoIteration(format!(
                    "the profiler's step {} holds {} allocations: 1 to {MAX_PERIOD} are planned",
                    found.step(k).unwrap_or_default(),
                    planned.len()
                )));
            }
            source = Some(found.source);
            step = found.step(k);
            found_end = found.bounds.last().copied();
            (planned.start, planned.len(), found.count() - k)
        }
    };
    let (mut plan, lower_bound, planned) =
        plan_iteration(&allocations, first, period, events.len());
    plan.mode = options.mode;
    let evaluated_end = if options.events.is_some() {
        events.len()
    } else {
        let end = found_end.unwrap_or(first + period * iterations);
        event_at(&allocations, end, events.len())
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
        source,
        step,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 61, item 2: the planner plans the job's own profiler step (the second of
    /// three or more) and says so.
    #[test]
    fn the_second_profiler_step_is_planned() {
        let (recording, bounds) = crate::explain::growth::tests::stepped();
        let planned = plan(&recording, "stepped", &PlanOptions::default()).expect("plans");
        assert_eq!(planned.source, Some(IterationSource::ProfilerSteps));
        assert_eq!(planned.step, Some(6));
        assert_eq!(
            (planned.first_allocation, planned.period, planned.iterations),
            (bounds[1], bounds[2] - bounds[1], 3)
        );
        let events = recording.trace(0);
        let all = allocations(events, &AllocatorConfig::default());
        assert_eq!(planned.events.start, all[bounds[1]].event);
        assert_eq!(
            planned.evaluated.end,
            events.len(),
            "to the last step's end"
        );
    }
}
