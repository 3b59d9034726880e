//! The pool of each event in a trace that does not record it (PyTorch before 2.12 writes no
//! trace `pool_id`), read off the segments.
//!
//! # Note [Inferred pools]
//! A segment belongs to one pool for its whole life, and the final snapshot names the pool
//! of every segment still there (`segment_pool_id`). Walking the trace from last to first
//! with the segments of each moment (a `segment_alloc` removes its segment, a
//! `segment_free` brings it back, a `segment_map` takes its range out) gives every event
//! inside a surviving segment that segment's pool. An event in a segment released before
//! the snapshot cannot be placed this way (its pool died with it), nor can an `oom` (it has
//! no address): they are taken as the default pool's and counted as *assumed*, so a replay
//! can say which of its decisions rest on a guess. Only a device whose snapshot shows a
//! private pool is walked: without one, every event is the default pool's as recorded.
//!
//! A pool's options are not recorded in any release. `no_split` shows in the final state:
//! a live block of the pool from which the allocator would have split its request
//! ([`unsplit_pools`]); `use_on_oom` needs no option in replay, as a default request served
//! from such a pool is recorded in it and replays as a request routed there (the same block
//! is found either way).
//!
//! # Invariants
//! - The walk is linear in the trace, each step one ordered-map operation; it allocates no
//!   more than one entry per segment alive at some moment.
//! - An event whose pool was recorded is never changed.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::allocator::size::{ONE_EXABYTE, round_size, should_split};
use crate::allocator::{BlockState, PoolId, TraceAction, TraceEntry};
use crate::config::AllocatorConfig;

use super::RecordedSegment;

/// How a device's events got their pools, where the trace did not record them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct InferredPools {
    /// Events given the pool of the surviving segment they lie in.
    pub from_segments: usize,
    /// Events taken as the default pool's: in a segment released before the snapshot, the
    /// releases themselves, and `oom`s.
    pub assumed: usize,
    /// The first assumed event (its index in the device's trace).
    pub first_assumed: Option<usize>,
}

/// Sets the pool of every event of `events` (device `device`'s trace, without recorded pool
/// ids) from `segments`, the final state, where that shows a private pool on the device
/// (Note [Inferred pools]); `None` where it does not.
pub(super) fn infer(
    segments: &[RecordedSegment],
    device: u32,
    events: &mut [TraceEntry],
) -> Option<InferredPools> {
    let on_device = || segments.iter().filter(|s| s.device == device);
    if events.is_empty() || on_device().all(|s| s.pool_id.is_default()) {
        return None;
    }
    // Segment (or mapped range) start → its end and pool, where known.
    let mut live: BTreeMap<u64, (u64, Option<PoolId>)> = on_device()
        .map(|s| {
            let end = s.address.saturating_add(s.total_size);
            (s.address, (end, Some(s.pool_id)))
        })
        .collect();
    let mut inferred = InferredPools::default();
    for (index, e) in events.iter_mut().enumerate().rev() {
        let end = e.addr.saturating_add(e.size);
        let pool = match e.action {
            TraceAction::Snapshot | TraceAction::UserDefined => continue,
            TraceAction::Oom => None,
            TraceAction::SegmentFree => {
                live.insert(e.addr, (end, None));
                None
            }
            TraceAction::SegmentUnmap => {
                // The range was mapped before: its pool is its neighbours' only by chance.
                carve(&mut live, e.addr, end);
                live.insert(e.addr, (end, None));
                None
            }
            TraceAction::SegmentAlloc | TraceAction::SegmentMap => {
                let pool = pool_at(&live, e.addr);
                carve(&mut live, e.addr, end);
                pool
            }
            TraceAction::Alloc | TraceAction::FreeRequested | TraceAction::FreeCompleted => {
                pool_at(&live, e.addr)
            }
        };
        match pool {
            Some(pool) => {
                e.pool = pool;
                inferred.from_segments += 1;
            }
            None => {
                e.pool = PoolId::DEFAULT;
                inferred.assumed += 1;
                inferred.first_assumed = Some(index);
            }
        }
    }
    Some(inferred)
}

/// The private pools of `device` whose final state shows a live block that the allocator
/// under `config` would have split its request from: pools made with `no_split`.
pub fn unsplit_pools(
    segments: &[RecordedSegment],
    device: u32,
    config: &AllocatorConfig,
) -> Vec<PoolId> {
    let mut pools: Vec<PoolId> = segments
        .iter()
        .filter(|s| s.device == device && !s.pool_id.is_default())
        .filter(|s| {
            s.blocks.iter().any(|b| {
                // Sizes an allocator could hold (rounding a larger one would overflow).
                b.state != BlockState::Inactive
                    && b.requested_size < ONE_EXABYTE
                    && b.size >= b.requested_size
                    && should_split(
                        b.size,
                        round_size(config, b.requested_size).min(b.size),
                        s.pool,
                        s.is_expandable,
                        config.max_split_size,
                    )
            })
        })
        .map(|s| s.pool_id)
        .collect();
    pools.sort_unstable();
    pools.dedup();
    pools
}

/// The pool of the range holding `addr`, where one does and its pool is known.
fn pool_at(live: &BTreeMap<u64, (u64, Option<PoolId>)>, addr: u64) -> Option<PoolId> {
    let (_, &(end, pool)) = live.range(..=addr).next_back()?;
    (addr < end).then_some(pool)?
}

/// Takes `start..end` out of the ranges in `live`, keeping what lies on either side.
fn carve(live: &mut BTreeMap<u64, (u64, Option<PoolId>)>, start: u64, end: u64) {
    let overlapping: Vec<(u64, (u64, Option<PoolId>))> = live
        .range(..end)
        .rev()
        .take_while(|&(_, &(e, _))| e > start)
        .map(|(&s, &v)| (s, v))
        .collect();
    for (s, (e, pool)) in overlapping {
        live.remove(&s);
        if s < start {
            live.insert(s, (start, pool));
        }
        if e > end {
            live.insert(end, (e, pool));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::size::PoolKind;

    const GRAPH: PoolId = PoolId(7, 0);

    fn segment(address: u64, total_size: u64, pool_id: PoolId) -> RecordedSegment {
        RecordedSegment {
            device: 0,
            address,
            total_size,
            stream: crate::device::StreamId::DEFAULT,
            pool: PoolKind::Large,
            pool_id,
            is_expandable: false,
            blocks: Vec::new(),
        }
    }

    fn event(action: TraceAction, addr: u64, size: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: crate::device::StreamId::DEFAULT,
            time_us: None,
            pool: PoolId::DEFAULT,
        }
    }

    #[test]
    fn events_take_the_pool_of_the_segment_they_lie_in_at_their_moment() {
        use TraceAction::*;
        // 0x1000 is a graph pool's segment at the end; 0x9000 a default one. Before the
        // graph segment was obtained, a default segment at the same place was released.
        let segments = [
            segment(0x1000, 0x1000, GRAPH),
            segment(0x9000, 0x1000, PoolId::DEFAULT),
        ];
        let mut events = [
            event(Alloc, 0x1000, 8),
            event(FreeRequested, 0x1000, 8),
            event(SegmentFree, 0x1000, 0x1000),
            event(SegmentAlloc, 0x1000, 0x1000),
            event(Alloc, 0x1800, 8),
            event(Alloc, 0x9000, 8),
            event(Oom, 0, 1 << 40),
            event(Snapshot, 0, 0),
        ];
        let inferred = infer(&segments, 0, &mut events).expect("a private pool is shown");
        let pools: Vec<PoolId> = events.iter().map(|e| e.pool).collect();
        let d = PoolId::DEFAULT;
        assert_eq!(pools, [d, d, d, GRAPH, GRAPH, d, d, d]);
        // The first two lie in a segment released before the end; the OOM has no address.
        assert_eq!(
            inferred,
            InferredPools {
                from_segments: 3,
                assumed: 4,
                first_assumed: Some(0),
            }
        );
    }

    #[test]
    fn a_map_takes_its_range_out_of_a_mapped_run() {
        let mut live = BTreeMap::from([(0x1000, (0x5000, Some(GRAPH)))]);
        carve(&mut live, 0x2000, 0x3000);
        assert_eq!(pool_at(&live, 0x1fff), Some(GRAPH));
        assert_eq!(pool_at(&live, 0x2000), None);
        assert_eq!(pool_at(&live, 0x3000), Some(GRAPH));
        assert_eq!(live.len(), 2);
    }

    #[test]
    fn without_a_private_pool_in_the_snapshot_nothing_is_walked() {
        let segments = [segment(0x1000, 0x1000, PoolId::DEFAULT)];
        let mut events = [event(TraceAction::Alloc, 0x1000, 8)];
        assert_eq!(infer(&segments, 0, &mut events), None);
        assert_eq!(infer(&[segment(0, 1, GRAPH)], 1, &mut events), None);
    }
}
