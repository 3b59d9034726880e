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

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::allocator::size::ROUND_LARGE;
use crate::allocator::{
    MAX_PLAN_ENTRIES, MAX_PLAN_STREAMS, Plan, PlanEntry, PlanError, PlanRegion, TraceEntry,
};
use crate::config::AllocatorConfig;
use crate::device::StreamId;
use crate::iterations::{Allocation, allocations, find_iteration, placeable};
pub use crate::iterations::{
    CANDIDATE_PERIODS, MAX_MULTIPLE, MAX_PERIOD, MAX_PLANNED_SIZE, SCAN_WORK,
};
use crate::rng::XorShift;

use crate::recording::Recording;
use crate::replay::{Mode, ReplayError, ReplayReport, Session, WhatIf};

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
    let traced: Vec<u32> = (0..recording.device_traces.len() as u32)
        .filter(|&d| !recording.device_traces[d as usize].is_empty())
        .collect();
    let covered = |device: u32| {
        let allocations = allocations(&recording.device_traces[device as usize], &config);
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

/// The plan of the iteration of `period` allocations from allocation `first` (of a trace of
/// `events` events), the most bytes its placed allocations hold at once, and its events.
fn plan_iteration(
    allocations: &[Allocation],
    first: usize,
    period: usize,
    events: usize,
) -> (Plan, u64, Range<usize>) {
    let iteration = &allocations[first..first + period];
    let (start, end) = (
        iteration[0].event,
        event_at(allocations, first + period, events),
    );
    let placement = place_iteration(iteration, start, end - start);
    let plan = Plan {
        regions: placement.regions,
        entries: iteration
            .iter()
            .zip(placement.offsets.iter().zip(&placement.tried))
            .map(|(a, (&offset, &tried))| PlanEntry {
                size: a.size,
                stream: a.stream,
                offset: offset.or(tried),
                // A stream left out of the plan: its allocations go to the caching allocator.
                persistent: offset.is_none() && placement.streams.binary_search(&a.stream).is_ok(),
            })
            .collect(),
    };
    debug_assert!(plan.validate().is_ok(), "{:?}", plan.validate());
    (plan, placement.lower_bound, start..end)
}

/// Whether persistent `a` is tried in the region first: its free completed within
/// [`BET_ITERATIONS`] iterations. A later instance that lives as long holds its range, making
/// the entries planned there misses, for that long at most, and the next instance finds the
/// range taken and goes to its chunk; a job whose every instance lives that long pays those
/// misses again every few iterations. One never freed, or freed later, is state: its chunk.
fn bet_on(a: &Allocation, length: usize) -> bool {
    a.freed
        .is_some_and(|f| f - a.event < BET_ITERATIONS.saturating_mul(length))
}

/// Where an iteration's allocations go.
struct Placement {
    regions: Vec<PlanRegion>,
    /// Per allocation: its offset when placeable.
    offsets: Vec<Option<u64>>,
    /// Per persistent allocation: the offset tried before its chunk, if any.
    tried: Vec<Option<u64>>,
    /// The streams planned ([`planned_streams`]), sorted.
    streams: Vec<StreamId>,
    lower_bound: u64,
}

/// One allocation to place: its size and its lifetime on the iteration's circle (one or two
/// half-open spans of events).
#[derive(Clone, Copy, Debug)]
struct Item {
    size: u64,
    spans: [(usize, usize); 2],
}

impl Item {
    /// Live from `from` to `to` (at most one iteration later) on a circle of `length`
    /// events: past the end, it wraps round to the start.
    fn on_circle(size: u64, from: usize, to: usize, length: usize) -> Item {
        let spans = if to <= length {
            [(from, to), (0, 0)]
        } else {
            [(from, length), (0, to - length)]
        };
        Item { size, spans }
    }

    fn overlaps(&self, other: &Item) -> bool {
        self.spans
            .iter()
            .any(|&(a, b)| a < b && other.spans.iter().any(|&(c, d)| c < d && a < d && c < b))
    }

    fn lifetime(&self) -> usize {
        self.spans.iter().map(|(a, b)| b - a).sum()
    }
}

/// The streams a plan gives a region and chunks: every stream of the iteration, or, past
/// [`MAX_PLAN_STREAMS`], those whose allocations take the most bytes (ties by stream), so
/// that the plan is one its reader accepts; the others' allocations go to the caching
/// allocator. Sorted by stream.
fn planned_streams(iteration: &[Allocation]) -> Vec<StreamId> {
    let mut bytes: FxHashMap<StreamId, u64> = FxHashMap::default();
    for a in iteration {
        *bytes.entry(a.stream).or_default() += a.size;
    }
    let mut streams: Vec<(StreamId, u64)> = bytes.into_iter().collect();
    streams.sort_unstable_by_key(|&(stream, b)| (std::cmp::Reverse(b), stream));
    streams.truncate(MAX_PLAN_STREAMS);
    let mut kept: Vec<StreamId> = streams.into_iter().map(|(s, _)| s).collect();
    kept.sort_unstable();
    kept
}

/// Places the iteration starting at event `start`, `length` events long.
fn place_iteration(iteration: &[Allocation], start: usize, length: usize) -> Placement {
    let mut offsets = vec![None; iteration.len()];
    let mut tried = vec![None; iteration.len()];
    let mut regions = Vec::new();
    let streams = planned_streams(iteration);
    let mut all_items = Vec::new();
    let mut try_work = 0u64;
    for &stream in &streams {
        let (indices, items): (Vec<usize>, Vec<Item>) = iteration
            .iter()
            .enumerate()
            .filter(|(_, a)| a.stream == stream && placeable(a, length))
            .map(|(i, a)| {
                let (from, to) = (a.event - start, a.freed.expect("placeable") - start);
                (i, Item::on_circle(a.size, from, to, length))
            })
            .unzip();
        if items.is_empty() {
            continue;
        }
        let (placed, top) = best_placement(&items);
        for (&i, &o) in indices.iter().zip(&placed) {
            offsets[i] = Some(o);
        }
        let bytes = top.div_ceil(ROUND_LARGE) * ROUND_LARGE;
        let persistent: Vec<(usize, usize, u64)> = iteration
            .iter()
            .enumerate()
            .filter(|(_, a)| a.stream == stream && !placeable(a, length) && bet_on(a, length))
            .map(|(i, a)| (i, a.event - start, a.size))
            .collect();
        for (i, o) in try_offsets(&items, &placed, bytes, length, &persistent, &mut try_work) {
            tried[i] = Some(o);
        }
        regions.push(PlanRegion { stream, bytes });
        all_items.extend(items);
    }
    Placement {
        regions,
        offsets,
        tried,
        streams,
        lower_bound: most_live(&all_items),
    }
}

/// Offsets in a region of `bytes` where persistent allocations (index, start, size) are
/// tried first: for each in turn, the place free for the longest stretch of the iteration's
/// circle from its start, among those free at its start (none if no place is). The stretch
/// is then taken as its lifetime, so later ones avoid it. A persistent allocation of the
/// planned iteration may live shorter in the next ones (the first iteration's often do):
/// then it costs no memory; one that lives past its stretch makes the entry planned there a
/// miss. At most [`TRY_WORK`] overlap tests in `work`, over every stream; the rest get no
/// offset.
fn try_offsets(
    items: &[Item],
    offsets: &[u64],
    bytes: u64,
    length: usize,
    persistent: &[(usize, usize, u64)],
    work: &mut u64,
) -> Vec<(usize, u64)> {
    let mut placed: Vec<(Item, u64)> = items.iter().copied().zip(offsets.iter().copied()).collect();
    let mut tried = Vec::new();
    for &(i, from, size) in persistent {
        // Candidate places: the region's start and the end of each placed range.
        let mut candidates: Vec<u64> = std::iter::once(0)
            .chain(placed.iter().map(|(it, o)| o + it.size))
            .filter(|&o| o + size <= bytes)
            .collect();
        candidates.sort_unstable();
        candidates.dedup();
        *work += (candidates.len() as u64).saturating_mul(placed.len() as u64);
        if *work > TRY_WORK {
            break;
        }
        // The stretch free at `o` from `from`: the wait, round the circle, until the first
        // span of a placed range overlapping it starts (0 if one is live at `from`).
        let stretch = |o: u64| {
            placed
                .iter()
                .filter(|(it, p)| *p < o + size && o < p + it.size)
                .flat_map(|(it, _)| it.spans.iter().filter(|(a, b)| a < b))
                .map(|&(a, b)| {
                    if a <= from && from < b {
                        0
                    } else {
                        (a + length - from) % length
                    }
                })
                .min()
                .unwrap_or(length)
        };
        let Some((o, wait)) = candidates
            .into_iter()
            .map(|o| (o, stretch(o)))
            .filter(|&(_, wait)| wait > 0)
            .max_by_key(|&(o, wait)| (wait, std::cmp::Reverse(o)))
        else {
            continue;
        };
        placed.push((Item::on_circle(size, from, from + wait, length), o));
        tried.push((i, o));
    }
    tried
}

/// The most bytes live at once.
fn most_live(items: &[Item]) -> u64 {
    let mut changes: Vec<(usize, i64)> = Vec::new();
    for item in items {
        for &(a, b) in item.spans.iter().filter(|(a, b)| a < b) {
            changes.push((a, item.size as i64));
            changes.push((b, -(item.size as i64)));
        }
    }
    // Ends before starts at the same event: half-open spans.
    changes.sort_unstable_by_key(|&(at, delta)| (at, delta));
    let (mut live, mut most) = (0i64, 0i64);
    for (_, delta) in changes {
        live += delta;
        most = most.max(live);
    }
    most as u64
}

/// The best of several greedy orders, then local search: (offsets, top).
fn best_placement(items: &[Item]) -> (Vec<u64>, u64) {
    let n = items.len();
    let by = |key: &dyn Fn(&Item) -> (u64, u64)| {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(key(&items[i])));
        order
    };
    let orders = [
        by(&|it| (it.size, it.lifetime() as u64)),
        by(&|it| (it.size.saturating_mul(it.lifetime() as u64), it.size)),
        by(&|it| (it.lifetime() as u64, it.size)),
        {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&i| items[i].spans[0].0);
            order
        },
    ];
    let mut work = 0u64;
    let mut best: Option<(Vec<u64>, u64, Vec<usize>, bool)> = None;
    for order in &orders {
        for best_fit in [false, true] {
            let (offsets, top) = greedy(items, order, best_fit, &mut work);
            if best.as_ref().is_none_or(|b| top < b.1) {
                best = Some((offsets, top, order.clone(), best_fit));
            }
        }
    }
    let (mut offsets, mut top, mut order, best_fit) = best.expect("four orders");
    let bound = most_live(items);
    // Local search from the best: move the item that sets the top to a random earlier
    // place in the order, or swap two random items; keep a move that does not raise the top
    // (plateaus are crossed), up to the rounds and the work budget.
    let mut rng = XorShift::new(0x5eed_0f91);
    for _ in 0..LOCAL_SEARCH_ROUNDS {
        if work > PLACEMENT_WORK || top == bound || n < 2 {
            break;
        }
        let mut next = order.clone();
        let critical = (0..n)
            .max_by_key(|&i| offsets[i] + items[i].size)
            .expect("n >= 2");
        let at = order.iter().position(|&i| i == critical).expect("in order");
        if at > 0 && rng.next_u64().is_multiple_of(2) {
            let moved = next.remove(at);
            next.insert((rng.next_u64() % at as u64) as usize, moved);
        } else {
            let (a, b) = (
                (rng.next_u64() % n as u64) as usize,
                (rng.next_u64() % n as u64) as usize,
            );
            next.swap(a, b);
        }
        let (o, t) = greedy(items, &next, best_fit, &mut work);
        if t <= top {
            (offsets, top, order) = (o, t, next);
        }
    }
    (offsets, top)
}

/// Places `items` in `order`, each at the lowest (or best-fitting) offset free over its
/// lifetime among those placed before it.
fn greedy(items: &[Item], order: &[usize], best_fit: bool, work: &mut u64) -> (Vec<u64>, u64) {
    let mut offsets = vec![0u64; items.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(items.len());
    let mut taken: Vec<(u64, u64)> = Vec::new();
    let mut top = 0u64;
    for &i in order {
        let item = &items[i];
        taken.clear();
        taken.extend(
            placed
                .iter()
                .filter(|&&j| item.overlaps(&items[j]))
                .map(|&j| (offsets[j], offsets[j] + items[j].size)),
        );
        *work += placed.len() as u64;
        taken.sort_unstable();
        let mut at = 0u64;
        let mut chosen: Option<(u64, u64)> = None;
        for &(a, b) in &taken {
            if a >= at + item.size {
                let gap = a - at;
                if !best_fit {
                    chosen = Some((at, gap));
                    break;
                }
                if chosen.is_none_or(|(_, g)| gap < g) {
                    chosen = Some((at, gap));
                }
            }
            at = at.max(b);
        }
        let offset = chosen.map_or(at, |(o, _)| o);
        offsets[i] = offset;
        top = top.max(offset + item.size);
        placed.push(i);
    }
    (offsets, top)
}

/// The largest plan file read.
pub const MAX_PLAN_FILE_BYTES: u64 = 256 << 20;

/// The plan file's `format` field.
pub const PLAN_FORMAT: &str = "gpumem-plan";
/// The plan file's version this build reads and writes.
pub const PLAN_VERSION: u32 = 1;

/// A plan file (`gpumem plan -o`, `plan:PATH`): the [`Plan`] the allocator follows, with its
/// format, version and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    /// Always [`PLAN_FORMAT`].
    pub format: String,
    /// Always [`PLAN_VERSION`].
    pub version: u32,
    /// One region per stream.
    pub regions: Vec<PlanRegion>,
    /// The iteration's allocations in order.
    pub entries: Vec<PlanEntry>,
    /// Where the plan came from and what the planner found (informative only).
    #[serde(default)]
    pub source: Option<PlanSource>,
}

impl PlanFile {
    /// The file of `plan`, made from `source`.
    pub fn new(plan: &Plan, source: Option<PlanSource>) -> PlanFile {
        PlanFile {
            format: PLAN_FORMAT.to_string(),
            version: PLAN_VERSION,
            regions: plan.regions.clone(),
            entries: plan.entries.clone(),
            source,
        }
    }

    /// The plan the allocator follows.
    pub fn plan(&self) -> Plan {
        Plan {
            regions: self.regions.clone(),
            entries: self.entries.clone(),
        }
    }
}

/// What the planner found (informative: the allocator does not read it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanSource {
    /// The recording's file name.
    pub recording: String,
    /// The device whose trace was planned.
    pub device: u32,
    /// Index (among the trace's allocations) of the planned iteration's first allocation.
    pub first_allocation: usize,
    /// Allocations per iteration.
    pub period: usize,
    /// Iterations found in a row, the planned one included.
    pub iterations: usize,
    /// Trace events of the planned iteration: `[first, end)`.
    pub events: [usize; 2],
    /// Trace events the plan is evaluated on (the iterations after it): `[first, end)`.
    pub evaluated: [usize; 2],
    /// The most bytes the planned allocations hold at once: no placement needs less.
    pub lower_bound_bytes: u64,
    /// Bytes of the persistent allocations (they outlive an iteration: placed in chunks, some
    /// tried at an offset first).
    pub persistent_bytes: u64,
}

/// Why a plan file's text is not a plan to follow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanFormatError {
    /// Not JSON of the plan file's shape.
    #[error("not a gpumem plan: {0}")]
    Malformed(String),
    /// Another format or version.
    #[error(
        "a plan of format {format:?} version {version}; this build reads {PLAN_FORMAT:?} version {PLAN_VERSION}"
    )]
    Version {
        /// The file's format field.
        format: String,
        /// The file's version field.
        version: u32,
    },
    /// A `source` that contradicts itself (a window that ends before it starts).
    #[error("the plan's source: {0}")]
    Source(String),
    /// A plan the allocator cannot follow.
    #[error(transparent)]
    Invalid(#[from] PlanError),
}

/// Why a plan file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    /// It cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is larger than [`MAX_PLAN_FILE_BYTES`].
    #[error("{path}: larger than {MAX_PLAN_FILE_BYTES} bytes, not a plan")]
    TooLarge {
        /// The file.
        path: String,
    },
    /// It is not a valid plan.
    #[error("{path}: {source}")]
    Invalid {
        /// The file.
        path: String,
        /// Why.
        source: PlanFormatError,
    },
}

/// Reads and validates a plan file (at most [`MAX_PLAN_FILE_BYTES`]).
///
/// # Errors
/// A [`PlanFileError`] naming the file.
pub fn read_plan_file(path: &std::path::Path) -> Result<PlanFile, PlanFileError> {
    use std::io::Read as _;
    let name = path.display().to_string();
    let io = |source| PlanFileError::Io {
        path: name.clone(),
        source,
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(MAX_PLAN_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_PLAN_FILE_BYTES {
        return Err(PlanFileError::TooLarge { path: name });
    }
    parse_plan(&text).map_err(|source| PlanFileError::Invalid { path: name, source })
}

/// Reads a plan file's JSON text, its plan validated ([`Plan::validate`]).
///
/// # Errors
/// A [`PlanFormatError`] saying what is wrong.
pub fn parse_plan(text: &str) -> Result<PlanFile, PlanFormatError> {
    let file: PlanFile =
        serde_json::from_str(text).map_err(|e| PlanFormatError::Malformed(e.to_string()))?;
    if file.format != PLAN_FORMAT || file.version != PLAN_VERSION {
        return Err(PlanFormatError::Version {
            format: file.format,
            version: file.version,
        });
    }
    if let Some(s) = &file.source {
        for (name, [from, to]) in [("events", s.events), ("evaluated", s.evaluated)] {
            if from > to {
                return Err(PlanFormatError::Source(format!(
                    "{name} [{from}, {to}] is reversed"
                )));
            }
        }
    }
    file.plan().validate()?;
    Ok(file)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn item(size: u64, spans: [(usize, usize); 2]) -> Item {
        Item { size, spans }
    }

    #[test]
    fn wrapped_lifetimes_overlap_both_ends() {
        let wrapped = item(512, [(8, 10), (0, 2)]);
        assert!(wrapped.overlaps(&item(512, [(1, 3), (0, 0)])));
        assert!(wrapped.overlaps(&item(512, [(9, 10), (0, 0)])));
        assert!(!wrapped.overlaps(&item(512, [(2, 8), (0, 0)])));
    }

    #[test]
    fn placement_never_overlaps_and_meets_the_bound_on_a_staircase() {
        // Sizes 1..=8 units, each live from its start to the end: the bound is their sum.
        let items: Vec<Item> = (1..=8u64)
            .map(|k| item(k * 512, [(k as usize, 20), (0, 0)]))
            .collect();
        let (offsets, top) = best_placement(&items);
        for i in 0..items.len() {
            for j in 0..i {
                if items[i].overlaps(&items[j]) {
                    let (a, b) = (offsets[i], offsets[i] + items[i].size);
                    let (c, d) = (offsets[j], offsets[j] + items[j].size);
                    assert!(b <= c || d <= a, "{i} and {j} overlap");
                }
            }
        }
        assert_eq!(top, most_live(&items));
    }
}
