//! Placement (the dynamic storage allocation problem): an iteration's allocations placed per
//! stream at the lowest offset free over their lifetime, in several orders, then improved
//! by local search (step 3 of the module documentation of `plan`).

use std::ops::Range;

use rustc_hash::FxHashMap;

use crate::allocator::size::round_to_large;
use crate::allocator::{MAX_PLAN_STREAMS, Plan, PlanEntry, PlanMode, PlanRegion};
use crate::device::StreamId;
use crate::iterations::{Allocation, placeable};
use crate::rng::XorShift;

use super::{BET_ITERATIONS, LOCAL_SEARCH_ROUNDS, PLACEMENT_WORK, TRY_WORK, event_at};

/// The plan of the iteration of `period` allocations from allocation `first` (of a trace of
/// `events` events), the most bytes its placed allocations hold at once, and its events.
pub(super) fn plan_iteration(
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
        mode: PlanMode::default(),
        saved_bytes: None,
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
        let bytes = round_to_large(top);
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
