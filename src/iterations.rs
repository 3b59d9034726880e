//! The repeating iterations of a trace: its allocations of the default pool (each with its
//! rounded size, stream, event and the event its free completed), and the longest run of a
//! sequence of them that repeats itself. The planner places one such iteration (`plan`);
//! `explain` tells what each keeps past its end (`explain::growth`).
//!
//! Every period up to [`MAX_PERIOD`] allocations is tried (for traces too long for
//! [`SCAN_WORK`], the [`CANDIDATE_PERIODS`] most frequent distances between consecutive equal
//! (rounded size, stream) pairs and their multiples up to [`MAX_MULTIPLE`]), each at its
//! longest run of the sequence repeating itself. A period needs two iterations in a row; the
//! one kept maximises the allocations its run covers times the share of its first iteration's
//! bytes that are placeable (freed within an iteration), the shortest on a tie.
//!
//! A recording whose profiler named the job's iterations (`ProfilerStep#N` annotations) is
//! split on them instead (`of_recording`, with the `tools` feature): each step runs from its
//! `START` to the next step's (the last to its `END`), its allocations those whose events
//! happened then; two complete steps with allocations at least, else the search is used.
//!
//! # Budgets
//! - Periods up to [`MAX_PERIOD`] allocations; the search makes at most [`SCAN_WORK`] token
//!   comparisons, or O(allocations × candidates) beyond.
//! - Allocations of [`MAX_PLANNED_SIZE`] or more are left out (the trace's sizes are any
//!   u64), so every sum of sizes stays far from overflowing.

use rustc_hash::FxHashMap;

use crate::allocator::size::round_size;
use crate::allocator::{TraceAction, TraceEntry};
use crate::config::AllocatorConfig;
use crate::device::StreamId;

/// The longest iteration, in allocations.
pub const MAX_PERIOD: usize = 8192;
/// Token comparisons the period search may make to try every period; longer traces try
/// only [`CANDIDATE_PERIODS`] common distances and their multiples.
pub const SCAN_WORK: u64 = 1 << 31;
/// Distances between equal allocations tried as periods (long traces).
pub const CANDIDATE_PERIODS: usize = 32;
/// Multiples of each candidate tried too.
pub const MAX_MULTIPLE: usize = 8;
/// Allocations this large or larger are left out: no device holds one, and the sums of an
/// iteration's sizes stay below [`crate::allocator::MAX_REGION_BYTES`].
pub const MAX_PLANNED_SIZE: u64 = 1 << 43;
/// One allocation of the trace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Allocation {
    /// Its event in the trace.
    pub event: usize,
    /// Its size, rounded as the allocator rounds it.
    pub size: u64,
    /// Its stream.
    pub stream: StreamId,
    /// The event at which its free completed.
    pub freed: Option<usize>,
}

/// The trace's allocations of the default pool, in order, with the events their frees
/// completed. A private pool's (CUDA graph, MemPool) are left to the caching allocator: a
/// plan serves only requests no pool routes elsewhere.
pub(crate) fn allocations(events: &[TraceEntry], config: &AllocatorConfig) -> Vec<Allocation> {
    let mut out: Vec<Allocation> = Vec::new();
    let mut live: FxHashMap<u64, usize> = FxHashMap::default();
    for (i, e) in events.iter().enumerate() {
        match e.action {
            TraceAction::Alloc if e.size < MAX_PLANNED_SIZE && e.pool.is_default() => {
                live.insert(e.addr, out.len());
                out.push(Allocation {
                    event: i,
                    size: round_size(config, e.size),
                    stream: e.stream,
                    freed: None,
                });
            }
            TraceAction::FreeCompleted => {
                if let Some(k) = live.remove(&e.addr) {
                    out[k].freed = Some(i);
                }
            }
            _ => {}
        }
    }
    out
}

/// Whether `a` (made `event` events into an iteration of `length` events) repeats in place.
pub(crate) fn placeable(a: &Allocation, length: usize) -> bool {
    a.freed.is_some_and(|f| f - a.event < length)
}

#[cfg(feature = "tools")]
/// Where a trace's iterations came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IterationSource {
    /// The job's profiler (`ProfilerStep#N` annotations).
    ProfilerSteps,
    /// The longest repeating sequence of allocations.
    Search,
}

#[cfg(feature = "tools")]
impl IterationSource {
    /// Its name in JSON.
    pub fn label(self) -> &'static str {
        match self {
            IterationSource::ProfilerSteps => "profiler_steps",
            IterationSource::Search => "search",
        }
    }
}

#[cfg(feature = "tools")]
/// A trace's iterations in a row: the index (in its allocations) of each one's first
/// allocation, then the end of the last; at least two iterations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Iterations {
    /// `bounds[k]..bounds[k + 1]` are iteration `k`'s allocations.
    pub bounds: Vec<usize>,
    /// Where they came from.
    pub source: IterationSource,
    /// The first one's step number, where the profiler named them.
    pub first_step: Option<u64>,
}

#[cfg(feature = "tools")]
impl Iterations {
    /// How many.
    pub fn count(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Iteration `k`'s step number (`ProfilerStep#N`), counting on from the first's, where
    /// the profiler named them and the number does not overflow.
    pub fn step(&self, k: usize) -> Option<u64> {
        self.first_step?.checked_add(u64::try_from(k).ok()?)
    }

    /// Iteration `k`'s allocations.
    pub fn range(&self, k: usize) -> std::ops::Range<usize> {
        self.bounds[k]..self.bounds[k + 1]
    }

    /// The search's iterations of `allocations`.
    pub fn searched(allocations: &[Allocation]) -> Option<Iterations> {
        let (first, period, count) = find_iteration(allocations)?;
        Some(Iterations {
            bounds: (0..=count).map(|k| first + k * period).collect(),
            source: IterationSource::Search,
            first_step: None,
        })
    }
}

/// The iterations of device `device`'s trace `events` (whose allocations are `allocations`,
/// possibly a prefix's): the profiler's steps where it named at least two complete ones with
/// allocations, else the search's.
#[cfg(feature = "tools")]
pub(crate) fn of_recording(
    recording: &crate::recording::Recording,
    device: u32,
    events: &[TraceEntry],
    allocations: &[Allocation],
) -> Option<Iterations> {
    profiler_steps(recording, device, events, allocations)
        .or_else(|| Iterations::searched(allocations))
}

/// The profiler's steps as iterations (see [`of_recording`]).
#[cfg(feature = "tools")]
fn profiler_steps(
    recording: &crate::recording::Recording,
    device: u32,
    events: &[TraceEntry],
    allocations: &[Allocation],
) -> Option<Iterations> {
    let steps = recording.profiler_steps(device);
    // Each allocation's time; every one needs one to be placed in a step.
    let times: Vec<u64> = allocations
        .iter()
        .map(|a| events.get(a.event)?.time_us)
        .collect::<Option<_>>()?;
    // A step is complete once the trace (up to where it is read) passed its end.
    let last_time = events.iter().rev().find_map(|e| e.time_us)?;
    // The first allocation at or after `t` (times run forward in a device's trace).
    let at = |t: u64| times.partition_point(|&time| time < t);
    let mut bounds = Vec::new();
    let mut first_step = None;
    for (k, step) in steps.iter().enumerate() {
        let start = step.start_us?;
        // A step ends where the next starts, the last at its END.
        let end = match steps.get(k + 1) {
            Some(next) => next.start_us?,
            None => step.end_us?,
        };
        if end > last_time || end < start {
            break;
        }
        if bounds.is_empty() {
            first_step = Some(step.number);
            bounds.push(at(start));
        }
        bounds.push(at(end));
    }
    let iterations = bounds.len().checked_sub(1)?;
    let with_allocations = bounds.windows(2).filter(|w| w[1] > w[0]).count();
    (iterations >= 2 && with_allocations >= 2).then_some(Iterations {
        bounds,
        source: IterationSource::ProfilerSteps,
        first_step,
    })
}

/// The repeating iteration: (first allocation, period, iterations in a row).
pub(crate) fn find_iteration(allocations: &[Allocation]) -> Option<(usize, usize, usize)> {
    let n = allocations.len();
    // Each (rounded size, stream) as a small id: the scans compare four bytes.
    let mut ids: FxHashMap<(u64, StreamId), u32> = FxHashMap::default();
    let tokens: Vec<u32> = allocations
        .iter()
        .map(|a| {
            let next = ids.len() as u32;
            *ids.entry((a.size, a.stream)).or_insert(next)
        })
        .collect();
    let longest_period = MAX_PERIOD.min(n / 2);
    let candidates: Vec<usize> = if (n as u64).saturating_mul(longest_period as u64) <= SCAN_WORK {
        (1..=longest_period).collect()
    } else {
        common_distances(&tokens)
    };
    let mut best: Option<(f64, (usize, usize, usize))> = None;
    for p in candidates {
        let (mut run, mut longest, mut longest_start) = (0usize, 0usize, 0usize);
        for (i, (a, b)) in tokens.iter().zip(&tokens[p..]).enumerate() {
            if a == b {
                run += 1;
                if run > longest {
                    longest = run;
                    longest_start = i + 1 - run;
                }
            } else {
                run = 0;
            }
        }
        let iterations = (longest + p) / p;
        if iterations < 2 {
            continue;
        }
        let first = longest_start;
        let iteration = &allocations[first..first + p];
        let length =
            allocations.get(first + p).map_or(usize::MAX, |a| a.event) - iteration[0].event;
        let total: u64 = iteration.iter().map(|a| a.size).sum();
        let placeable_bytes: u64 = iteration
            .iter()
            .filter(|a| placeable(a, length))
            .map(|a| a.size)
            .sum();
        let share = placeable_bytes as f64 / total.max(1) as f64;
        let covered = iterations * p;
        let score = share * covered as f64;
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, (first, p, iterations)));
        }
    }
    best.map(|(_, found)| found)
}

/// Candidate periods for long traces: the most frequent distances between consecutive equal
/// tokens and their multiples.
fn common_distances(tokens: &[u32]) -> Vec<usize> {
    let mut last: FxHashMap<u32, usize> = FxHashMap::default();
    let mut distances: FxHashMap<usize, u32> = FxHashMap::default();
    for (i, &t) in tokens.iter().enumerate() {
        if let Some(j) = last.insert(t, i)
            && i - j <= MAX_PERIOD
        {
            *distances.entry(i - j).or_default() += 1;
        }
    }
    let mut common: Vec<(usize, u32)> = distances.into_iter().collect();
    common.sort_unstable_by_key(|&(d, count)| (std::cmp::Reverse(count), d));
    let mut candidates: Vec<usize> = common
        .iter()
        .take(CANDIDATE_PERIODS)
        .flat_map(|&(d, _)| (1..=MAX_MULTIPLE).map(move |m| d * m))
        .filter(|&p| p <= MAX_PERIOD && 2 * p <= tokens.len())
        .collect();
    candidates.sort_unstable();
    candidates.dedup();
    candidates
}
