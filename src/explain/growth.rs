//! Growth told apart from fragmentation: the repeating iterations of a trace up to a moment,
//! what each keeps past its end (its allocations still live at the moment), where that was
//! allocated, and, at that rate, the iteration in which the memory the job had fills.
//!
//! An iteration that keeps memory is the commonest reason memory "grows every step": outputs
//! kept with their graph, losses summed as tensors, caches that are never cleared. No allocator
//! setting avoids it; the program must free what it keeps.
//!
//! # Invariants
//! - Only complete iterations before the moment count, found as the planner finds them
//!   (`iterations`: the job's profiler steps where it recorded them, else the longest run
//!   of a repeating sequence of allocations, within its scan budget); the moment's own,
//!   unfinished iteration is left out. [`Growth::source`] says which.
//! - Memory grows where more than half the iterations keep some. The rate is the median of
//!   what the iterations kept, leaving out the first where there are
//!   three or more (a first step that creates optimizer state keeps it once, not every step).
//! - The fill prediction adds the rate per iteration to the live memory at the last complete
//!   iteration's start, plus the most any iteration needed beyond its start, against the
//!   memory the job had (else the device's known size); it is absent where nothing grows
//!   ([`Growth::grows`]) or neither is known, and never names an iteration that completed.
//! - At most [`GROWTH_GROUPS`] groups of frames are listed. The analysis holds a few words per
//!   allocation of the trace up to the moment (its allocations, their frees, the period
//!   search's tokens) beside the replay's budget, and the period search makes at most
//!   `iterations::SCAN_WORK` comparisons.

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::allocator::TraceEntry;
use crate::config::AllocatorConfig;
use crate::iterations::{Allocation, IterationSource, allocations};
use crate::recording::Recording;
use crate::recording::frames::StackId;

/// The most groups of frames a growth lists.
pub const GROWTH_GROUPS: usize = 8;

/// The repeating iterations up to a moment and what they keep.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Growth {
    /// Complete iterations in a row before the moment.
    pub iterations: usize,
    /// Allocations each makes (on average, where the profiler's steps differ).
    pub allocations_per_iteration: usize,
    /// Where the iterations came from: the job's profiler steps, or the search.
    pub source: IterationSource,
    /// The first iteration's step number (`ProfilerStep#N`), where the profiler named them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_step: Option<u64>,
    /// The event the first starts at.
    pub first_event: usize,
    /// Events an iteration takes, on average.
    pub events_per_iteration: usize,
    /// Bytes (rounded) an iteration keeps past its end: the median over the iterations (the
    /// first left out where there are three or more); 0 where they keep nothing.
    pub kept_per_iteration: u64,
    /// Allocations an iteration keeps (the median, as the bytes).
    pub kept_allocations_per_iteration: usize,
    /// Iterations that keep anything.
    pub iterations_keeping: usize,
    /// Bytes all the iterations kept, live at the moment.
    pub kept_bytes: u64,
    /// Where the kept memory was allocated, the most bytes first.
    pub kept_at: Vec<KeptGroup>,
    /// The most any iteration had live beyond what was live at its start.
    pub iteration_peak_bytes: u64,
    /// At the rate kept, the iteration (counting the first found as 1) in which live memory
    /// and an iteration's need exceed `fills_bytes`; absent where nothing grows or the
    /// memory is unknown.
    pub fills_at_iteration: Option<u64>,
    /// The memory that fills: what the job had at the OOM, else the device's known size.
    pub fills_bytes: Option<u64>,
}

/// Kept memory allocated at one place in the program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeptGroup {
    /// The allocations' site, as the pinning groups name it (`site`).
    pub frame: String,
    /// The first such allocation's stack, innermost first (at most 8 frames).
    pub frames: Vec<String>,
    /// Allocations kept from there, over all iterations.
    pub allocations: usize,
    /// Their bytes.
    pub bytes: u64,
}

impl Growth {
    /// Whether the iterations keep memory: more than half of them (two at least) keep some,
    /// at a median rate above zero (a loop that frees every other allocation keeps no rate).
    pub fn grows(&self) -> bool {
        grows(
            self.iterations,
            self.iterations_keeping,
            self.kept_per_iteration,
        )
    }
}

/// The growth of device `device`'s trace `events` up to event `moment` (kept: live just after
/// it), `allocated` bytes live then; `None` where no iteration repeats before it.
pub(crate) fn growth(
    recording: &Recording,
    device: usize,
    events: &[TraceEntry],
    moment: usize,
    allocated: u64,
    fills_bytes: Option<u64>,
    config: &AllocatorConfig,
) -> Option<Growth> {
    let upto = &events[..moment.saturating_add(1).min(events.len())];
    let all = allocations(upto, config);
    let found = crate::iterations::of_recording(recording, device as u32, upto, &all)?;
    // The event at allocation bound `b` (the moment's end past the last allocation).
    let event_at = |b: usize| all.get(b).map_or(upto.len(), |a| a.event);
    // The last found iteration may be the moment's own, unfinished: only those that ended
    // (the next allocation came) before the moment count; the profiler's steps are
    // complete as found.
    let complete = match found.source {
        IterationSource::ProfilerSteps => found.count(),
        IterationSource::Search => (0..found.count())
            .take_while(|&k| all.get(found.bounds[k + 1]).is_some())
            .count(),
    };
    if complete < 2 {
        return None;
    }
    let kept = |a: &&Allocation| a.freed.is_none_or(|f| f > moment);
    let iteration = |k: usize| &all[found.range(k)];
    let kept_by: Vec<(u64, usize)> = (0..complete)
        .map(|k| {
            let kept: Vec<&Allocation> = iteration(k).iter().filter(kept).collect();
            let bytes = kept.iter().fold(0u64, |sum, a| sum.saturating_add(a.size));
            (bytes, kept.len())
        })
        .collect();
    let counted = if complete >= 3 {
        &kept_by[1..]
    } else {
        &kept_by[..]
    };
    let (kept_per_iteration, kept_allocations_per_iteration) = median(counted);
    let kept_bytes = kept_by
        .iter()
        .fold(0u64, |sum, &(b, _)| sum.saturating_add(b));
    let iterations_keeping = kept_by.iter().filter(|&&(b, _)| b > 0).count();
    let grows = grows(complete, iterations_keeping, kept_per_iteration);

    // Live bytes through the iterations, relative to the trace's start (blocks live before
    // it are a constant, found from what the moment held): at each iteration's start, and the
    // most any complete iteration had beyond its start.
    let starts: Vec<usize> = (0..=complete).map(|k| event_at(found.bounds[k])).collect();
    let mut deltas: Vec<(usize, i128)> = all
        .iter()
        .map(|a| (a.event, i128::from(a.size)))
        .chain(all.iter().filter_map(|a| {
            a.freed
                .filter(|&f| f <= moment)
                .map(|f| (f, -i128::from(a.size)))
        }))
        .collect();
    deltas.sort_unstable_by_key(|&(event, _)| event);
    let (mut live, mut passed, mut peak) = (0i128, 0usize, 0u64);
    let mut at_start = vec![0i128; complete + 1];
    for (event, delta) in deltas {
        while passed <= complete && starts[passed] <= event {
            at_start[passed] = live;
            passed += 1;
        }
        live += delta;
        // Within complete iteration `passed - 1`.
        if (1..=complete).contains(&passed) {
            peak = peak.max(bytes(live - at_start[passed - 1]));
        }
    }
    let before_trace = i128::from(allocated) - live;
    let last = complete - 1;
    let fills_at_iteration = fills_bytes.filter(|_| grows).map(|memory| {
        // Iteration `last + n` (0-based) starts with `n` more iterations' keep than
        // `last` did; the first whose need no longer fits fills the memory.
        let start_live = bytes(before_trace + at_start[last]);
        let n = match memory.checked_sub(start_live.saturating_add(peak)) {
            Some(room) => room / kept_per_iteration + 1,
            None => 0,
        };
        // Never an iteration that already completed.
        (last as u64 + n + 1).max(complete as u64 + 1)
    });

    let (first, end) = (found.bounds[0], found.bounds[complete]);
    let events_per_iteration = (starts[complete] - starts[0]) / complete;
    Some(Growth {
        iterations: complete,
        allocations_per_iteration: (end - first) / complete,
        source: found.source,
        first_step: found.first_step,
        first_event: starts[0],
        events_per_iteration,
        kept_per_iteration,
        kept_allocations_per_iteration,
        iterations_keeping,
        kept_bytes,
        kept_at: kept_groups(recording, device, &all[first..end], moment),
        iteration_peak_bytes: peak,
        fills_at_iteration,
        fills_bytes,
    })
}

/// [`Growth::grows`] of its figures.
fn grows(iterations: usize, keeping: usize, rate: u64) -> bool {
    keeping >= 2 && keeping * 2 > iterations && rate > 0
}

/// A sum of sizes as bytes: 0 below, `u64::MAX` above (a hostile trace's sums).
fn bytes(sum: i128) -> u64 {
    u64::try_from(sum.max(0)).unwrap_or(u64::MAX)
}

/// The median of (bytes, allocations) by bytes.
fn median(values: &[(u64, usize)]) -> (u64, usize) {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted.get(sorted.len() / 2).copied().unwrap_or_default()
}

/// The kept allocations of `iterations` grouped by frame, the most bytes first.
fn kept_groups(
    recording: &Recording,
    device: usize,
    iterations: &[Allocation],
    moment: usize,
) -> Vec<KeptGroup> {
    let stacks = recording.event_stacks.get(device);
    let mut groups: FxHashMap<String, KeptGroup> = FxHashMap::default();
    // Each stack named once: a recording's allocations share a few hundred stacks.
    let mut frames: FxHashMap<StackId, String> = FxHashMap::default();
    for a in iterations
        .iter()
        .filter(|a| a.freed.is_none_or(|f| f > moment))
    {
        let stack = stacks
            .and_then(|s| s.get(a.event))
            .copied()
            .unwrap_or(StackId::EMPTY);
        let frame = frames.entry(stack).or_insert_with(|| {
            let named = super::group_of(recording, stack);
            let frame = named.frame.clone();
            groups.entry(frame.clone()).or_insert(KeptGroup {
                frame: named.frame,
                frames: named.frames,
                allocations: 0,
                bytes: 0,
            });
            frame
        });
        let Some(group) = groups.get_mut(frame.as_str()) else {
            continue;
        };
        group.allocations += 1;
        group.bytes = group.bytes.saturating_add(a.size);
    }
    let mut groups: Vec<KeptGroup> = groups.into_values().collect();
    groups.sort_by(|a, b| (b.bytes, &a.frame).cmp(&(a.bytes, &b.frame)));
    groups.truncate(GROWTH_GROUPS);
    groups
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::iterations::{IterationSource, allocations, of_recording};

    const MIB: u64 = 1 << 20;

    /// A hand-made recording of four profiler steps on device 0: the first makes optimizer
    /// state (1 MiB, kept); each makes and frees 8 and 16 MiB, and keeps 2 MiB (a loss summed
    /// as a tensor); the third also makes a 4 MiB scratch. So the steps differ in length, and
    /// the allocations alone repeat in no sequence as long as a step.
    pub(crate) fn stepped() -> (crate::recording::Recording, Vec<usize>) {
        let mut events = Vec::new();
        let mut annotations = Vec::new();
        let mut bounds = vec![0usize];
        let mut allocations = 0usize;
        let mut addr = 0x7f00_0000_0000u64;
        for step in 0..4u64 {
            let t0 = 1_000_000 + step * 10_000;
            annotations.push(serde_json::json!({"stage": "START", "name": format!("ProfilerStep#{}", step + 5), "device": 0, "time_us": t0}));
            let mut sizes = vec![8 * MIB, 16 * MIB, 2 * MIB];
            if step == 0 {
                sizes.insert(0, MIB);
            }
            if step == 2 {
                sizes.push(4 * MIB);
            }
            let mut t = t0 + 10;
            let mut freed = Vec::new();
            for size in sizes {
                addr += 64 * MIB;
                events.push(serde_json::json!({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t}));
                allocations += 1;
                if size != MIB && size != 2 * MIB {
                    freed.push((addr, size));
                }
                t += 10;
            }
            for (a, size) in freed {
                for action in ["free_requested", "free_completed"] {
                    events.push(serde_json::json!({"action": action, "addr": a, "size": size, "stream": 0, "time_us": t}));
                }
                t += 10;
            }
            annotations.push(serde_json::json!({"stage": "END", "name": format!("ProfilerStep#{}", step + 5), "device": 0, "time_us": t}));
            bounds.push(allocations);
        }
        // Something after the last step's end: it is complete. An annotation of another
        // device, one of another name and a malformed one are skipped.
        events.push(serde_json::json!({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 2_000_000}));
        annotations.push(serde_json::json!({"stage": "START", "name": "ProfilerStep#1", "device": 1, "time_us": 1}));
        annotations.push(serde_json::json!({"stage": "START", "name": "forward", "device": 0, "time_us": 1_000_005}));
        annotations.push(serde_json::json!({"stage": 3, "name": "ProfilerStep#9"}));
        let doc = serde_json::json!({"segments": [], "device_traces": [events], "external_annotations": annotations});
        let recording =
            crate::recording::parse_recording(doc.to_string().as_bytes()).expect("reads");
        (recording, bounds)
    }

    /// Issue 61, item 2: a recording with `ProfilerStep#N` annotations is split on them.
    #[test]
    fn a_recording_with_profiler_steps_is_split_on_them() {
        let (recording, bounds) = stepped();
        assert_eq!(recording.annotations.len(), 10, "the malformed one skipped");
        let steps = recording.profiler_steps(0);
        assert_eq!(
            steps.iter().map(|s| s.number).collect::<Vec<_>>(),
            [5, 6, 7, 8]
        );
        let events = recording.trace(0);
        let all = allocations(events, &AllocatorConfig::default());
        let found = of_recording(&recording, 0, events, &all).expect("iterations");
        assert_eq!(found.source, IterationSource::ProfilerSteps);
        assert_eq!(found.first_step, Some(5));
        assert_eq!(found.bounds, bounds);
        // Cut before the last step ends: three complete steps.
        let last_end = steps[3].end_us.expect("an end");
        let cut = events
            .iter()
            .position(|e| e.time_us >= Some(last_end))
            .expect("an event");
        let upto = &events[..cut];
        let some = allocations(upto, &AllocatorConfig::default());
        let partial = of_recording(&recording, 0, upto, &some).expect("iterations");
        assert_eq!(partial.bounds, bounds[..4]);
        // Without annotations, the search finds no step-long iteration.
        let bare = crate::recording::Recording {
            annotations: Vec::new(),
            ..recording.clone()
        };
        let searched = of_recording(&bare, 0, events, &all);
        assert!(
            searched
                .as_ref()
                .is_none_or(|s| s.source == IterationSource::Search && s.bounds != bounds),
            "{searched:?}"
        );
        // Explain's growth uses the steps and tells the 2 MiB kept per step.
        let moment = events.len() - 1;
        let growth = growth(
            &recording,
            0,
            events,
            moment,
            9 * MIB,
            None,
            &AllocatorConfig::default(),
        )
        .expect("a growth");
        assert_eq!(growth.source, IterationSource::ProfilerSteps);
        assert_eq!((growth.iterations, growth.first_step), (4, Some(5)));
        assert_eq!(growth.kept_per_iteration, 2 * MIB);
        assert!(growth.grows());
    }
}
