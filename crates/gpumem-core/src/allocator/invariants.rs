//! `check_invariants()`: a full scan that recomputes everything the allocator keeps
//! incrementally and compares; it costs O(blocks).
//!
//! With the cargo feature `invariants` (which the test command turns on), the core runs it
//! itself after every mutating public operation and panics, naming the operation, at the
//! first broken invariant: every test, replay and fuzz run is then checked at each step.
//! Without the feature the hook compiles to nothing.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::device::{Device, StreamId};

use super::CachingAllocator;
use super::block::{Block, BlockId};
use super::pool_id::PoolSlot;
use super::size::MIN_BLOCK_SIZE;
use super::stats::{StatArray, slot};

/// Per-pool sums of what the blocks hold.
#[derive(Default, Clone, Copy)]
struct Sums {
    allocation: i64,
    allocated_bytes: i64,
    active: i64,
    active_bytes: i64,
    requested_bytes: i64,
    segment: i64,
    reserved_bytes: i64,
    inactive_split: i64,
    inactive_split_bytes: i64,
}

fn check_array(name: &str, array: &StatArray, small: i64, large: i64) -> Result<(), String> {
    let (all, s, l) = (array.all(), array.small_pool.get(), array.large_pool.get());
    if (s.current, l.current, all.current) != (small, large, small + large) {
        return Err(format!(
            "{name}: stats say all/small/large = {}/{}/{}, blocks add up to {}/{small}/{large}",
            all.current,
            s.current,
            l.current,
            small + large
        ));
    }
    for (bucket, v) in [("all", all), ("small_pool", s), ("large_pool", l)] {
        if v.peak < v.current {
            return Err(format!(
                "{name}.{bucket}: peak {} < current {}",
                v.peak, v.current
            ));
        }
    }
    Ok(())
}

/// An invariant of the allocator that does not hold: a defect, described.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvariantViolation(pub String);

impl<D: Device> CachingAllocator<D> {
    /// After the mutating operation `op`: with the feature `invariants`, panics if an
    /// invariant broke; passes `result` through.
    #[inline(always)]
    pub(super) fn checked<T>(&self, op: &str, result: T) -> T {
        #[cfg(feature = "invariants")]
        if let Err(broken) = self.check_invariants() {
            panic!("allocator invariant broken after {op}: {broken}");
        }
        #[cfg(not(feature = "invariants"))]
        let _ = op;
        result
    }

    /// Verifies every structural and accounting invariant (see the module documentation of
    /// [`crate::allocator`]); returns the first violation found.
    ///
    /// # Errors
    /// [`InvariantViolation`]: the first broken invariant, described.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.first_violation().map_err(InvariantViolation)
    }

    /// Each family of invariants in turn, in the order of ARCHITECTURE.md's list; the first
    /// violation found. The free sets are read before any segment is walked; the later
    /// families walk segments only once tiling has held (a broken link cannot loop them).
    fn first_violation(&self) -> Result<(), String> {
        self.check_free_sets()?;
        let heads = self.check_tiling_and_counters()?;
        self.check_live_map_and_events()?;
        self.check_private_pools(&heads)?;
        self.check_statistics(&heads)?;
        self.check_expandable_segments(&heads)?;
        self.check_plan(&heads)
    }

    /// Every block of the arena with its id, in the arena's order (no link followed).
    fn arena_blocks(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.blocks
            .iter()
            .filter_map(|(k, b)| Some((BlockId::new(k)?, b)))
    }

    /// Every block of every segment, segment by segment in address order.
    fn segmented_blocks<'a>(
        &'a self,
        heads: &'a [BlockId],
    ) -> impl Iterator<Item = (BlockId, &'a super::block::Block)> {
        heads.iter().flat_map(|&head| self.segment_blocks(head))
    }

    /// The free sets: each iterates in the allocator's order, each entry agrees with its block
    /// and appears once, and a block is in its pool's free set iff it is free, mapped and
    /// outside a plan's regions and chunks.
    fn check_free_sets(&self) -> Result<(), String> {
        let mut in_free_sets: FxHashSet<BlockId> = FxHashSet::default();
        for (kind, pool) in self.all_pools() {
            let mut last: Option<(StreamId, u64, u64)> = None;
            for (stream, e) in pool.free.iter() {
                let Some(b) = self.blocks.get(e.id.index()) else {
                    return Err(format!("free set entry {:?} names a removed block", e.id));
                };
                let key = (stream, e.size, e.tie);
                if last.is_some_and(|last| last >= key) {
                    return Err(format!("free set entry {:#x} is out of order", b.ptr));
                }
                last = Some(key);
                let entry = (kind, stream, e.size, e.tie);
                let tie = self.fit_order.tie(b.counter, b.ptr);
                if (b.pool_ref(), b.stream, b.size, tie) != entry {
                    return Err(format!(
                        "free set entry {:#x} disagrees with its block",
                        b.ptr
                    ));
                }
                if !in_free_sets.insert(e.id) {
                    return Err(format!("block {:#x} is in the free sets twice", b.ptr));
                }
            }
        }
        for (id, b) in self.arena_blocks() {
            let free = b.is_free();
            let in_set = in_free_sets.contains(&id);
            let in_region = self.plan_segment_at(b.ptr).is_some();
            if (free && b.mapped() && !in_region) != in_set {
                return Err(format!(
                    "block {:#x}: free={free} but in its pool's free set={in_set}",
                    b.ptr
                ));
            }
        }
        let free_count: usize = self.all_pools().map(|(_, p)| p.free.len()).sum();
        if free_count != in_free_sets.len() {
            return Err(format!(
                "free sets count {free_count} entries but hold {}",
                in_free_sets.len()
            ));
        }
        Ok(())
    }

    /// Tiling and counters: segments never overlap; the blocks of a segment tile it exactly,
    /// 512-aligned, with agreeing links and their segment's pool, stream and kind; no two
    /// adjacent free blocks are left unmerged; every block is reachable from a segment; the
    /// segment counters are distinct, below the next one and inherited as the order says.
    /// Returns the segments' heads in address order.
    fn check_tiling_and_counters(&self) -> Result<Vec<BlockId>, String> {
        let mut seen: FxHashSet<BlockId> = FxHashSet::default();
        let mut last_end = 0u64;
        let mut counters: FxHashSet<u32> = FxHashSet::default();
        // Counters are taken from the sequence and distinct per segment, inherited by every
        // block of it (per block in the block-counter order).
        let per_block = self.fit_order.pieces_take_counters();
        let heads = self.segment_heads();
        for &head in &heads {
            let first = self.block(head);
            if first.ptr < last_end {
                return Err(format!(
                    "segment at {:#x} overlaps the previous one",
                    first.ptr
                ));
            }
            let (kind, stream) = (first.pool, first.stream);
            let expandable = first.expandable.is_some();
            let mut expected_ptr = first.ptr;
            let mut prev: Option<BlockId> = None;
            // The previous block's (free, mapped) state: free neighbours merge when both
            // are mapped or both unmapped.
            let mut prev_state = (false, true);
            for (id, b) in self.segment_blocks(head) {
                seen.insert(id);
                let own = if per_block || id == head {
                    b.counter < self.next_counter && counters.insert(b.counter)
                } else {
                    b.counter == first.counter
                };
                if !own {
                    return Err(format!(
                        "block {:#x}: counter {} is not its own (next {})",
                        b.ptr, b.counter, self.next_counter
                    ));
                }
                if b.prev != prev {
                    return Err(format!("block {:#x}: prev link disagrees", b.ptr));
                }
                if let Some(p) = prev
                    && self.block(p).next != Some(id)
                {
                    return Err(format!("block {:#x}: next link disagrees", b.ptr));
                }
                if b.ptr != expected_ptr {
                    return Err(format!("block {:#x}: expected at {expected_ptr:#x}", b.ptr));
                }
                if b.size == 0 || b.size % MIN_BLOCK_SIZE != 0 || b.ptr % MIN_BLOCK_SIZE != 0 {
                    return Err(format!(
                        "block {:#x}: size {} not 512-aligned",
                        b.ptr, b.size
                    ));
                }
                if b.pool != kind || b.stream != stream || b.expandable.is_some() != expandable {
                    return Err(format!(
                        "block {:#x}: pool or stream differs from its segment",
                        b.ptr
                    ));
                }
                let free = b.is_free();
                if free && prev_state == (true, b.mapped()) {
                    return Err(format!(
                        "block {:#x}: two adjacent free blocks unmerged",
                        b.ptr
                    ));
                }
                expected_ptr = b.ptr + b.size;
                prev = Some(id);
                prev_state = (free, b.mapped());
            }
            last_end = expected_ptr;
        }
        if seen.len() != self.blocks.len() {
            return Err(format!(
                "{} blocks in the arena, {} reachable from segments",
                self.blocks.len(),
                seen.len()
            ));
        }
        Ok(heads)
    }

    /// The live map and events: the live map holds exactly the allocated blocks, the
    /// stream-use table exactly the blocks flagged as having uses, and the queued events
    /// equal the blocks' event counts.
    fn check_live_map_and_events(&self) -> Result<(), String> {
        for (id, b) in self.arena_blocks() {
            let uses = self.stream_uses.get(&id).is_some_and(|u| !u.is_empty());
            if b.has_stream_uses() != uses {
                return Err(format!(
                    "block {:#x}: has_stream_uses={} but listed uses={uses}",
                    b.ptr,
                    b.has_stream_uses()
                ));
            }
            let live = self.live.get(b.ptr, &self.blocks) == Some(id);
            if b.allocated() != live {
                return Err(format!(
                    "block {:#x}: allocated={} but live={live}",
                    b.ptr,
                    b.allocated()
                ));
            }
        }
        if self.live.len() != self.blocks.iter().filter(|(_, b)| b.allocated()).count() {
            return Err("the live map holds blocks that are not allocated".into());
        }
        let with_uses = self
            .blocks
            .iter()
            .filter(|(_, b)| b.has_stream_uses())
            .count();
        if self.stream_uses.len() != with_uses {
            return Err("the stream-use table lists blocks that have none".into());
        }
        let pending = self.pending_events.len();
        let counted: u64 = self
            .blocks
            .iter()
            .map(|(_, b)| u64::from(b.event_count))
            .sum();
        if pending as u64 != counted {
            return Err(format!("{pending} queued events, blocks wait on {counted}"));
        }
        Ok(())
    }

    /// Statistics: whether active stats are tracked, the bytes the driver holds, and every
    /// statistic against what the blocks add up to, per pool and in total.
    fn check_statistics(&self, heads: &[BlockId]) -> Result<(), String> {
        let mut sums = [Sums::default(); 2];
        let mut reserved_total = 0u64;
        let mut oversize_allocations = 0i64;
        let mut oversize_segments = 0i64;
        let max_split = self.config.max_split_size;
        for &head in heads {
            let first = self.block(head);
            let expandable = first.expandable.is_some();
            let s = &mut sums[slot(first.pool)];
            let mut segment_size = 0;
            for (_, b) in self.segment_blocks(head) {
                if b.allocated() {
                    s.allocation += 1;
                    s.allocated_bytes += b.size as i64;
                    if b.size >= max_split {
                        oversize_allocations += 1;
                    }
                }
                if !b.is_free() {
                    s.active += 1;
                    s.active_bytes += b.size as i64;
                    s.requested_bytes += b.requested_size as i64;
                } else if b.is_split() && !expandable {
                    s.inactive_split += 1;
                    s.inactive_split_bytes += b.size as i64;
                }
                if b.mapped() {
                    segment_size += b.size;
                }
            }
            s.reserved_bytes += segment_size as i64;
            reserved_total += segment_size;
            // Expandable segments count in reserved bytes (mapped) but not as segments.
            if !expandable {
                s.segment += 1;
                if segment_size >= max_split {
                    oversize_segments += 1;
                }
            }
        }
        // The allocator's own stats start at zero, so they track `active*` exactly while a
        // free waits (Note [Active stats]).
        let waiting = self.blocks.iter().any(|(_, b)| b.is_pending_free());
        if self.stats.tracks_active() != waiting {
            return Err(format!(
                "active stats tracked: {}, frees waiting: {waiting}",
                self.stats.tracks_active()
            ));
        }
        if reserved_total != self.total_allocated_memory {
            return Err(format!(
                "segments add up to {reserved_total} bytes, total_allocated_memory is {}",
                self.total_allocated_memory
            ));
        }
        self.check_stat_arrays(sums)?;
        if !self.max_split_size_changed {
            let st = &self.stats;
            let (a, s) = (
                st.oversize_allocations.current(),
                st.oversize_segments.current(),
            );
            if (a, s) != (oversize_allocations, oversize_segments) {
                return Err(format!(
                    "oversize allocations/segments: stats {a}/{s}, blocks {oversize_allocations}/{oversize_segments}"
                ));
            }
        }
        Ok(())
    }

    /// Each per-pool statistic against the blocks' sums (small, large).
    fn check_stat_arrays(&self, [sm, lg]: [Sums; 2]) -> Result<(), String> {
        let st = &self.stats;
        let arrays: [(&str, &StatArray, i64, i64); 9] = [
            ("allocation", &st.allocation, sm.allocation, lg.allocation),
            (
                "allocated_bytes",
                &st.allocated_bytes,
                sm.allocated_bytes,
                lg.allocated_bytes,
            ),
            ("active", &st.active(), sm.active, lg.active),
            (
                "active_bytes",
                &st.active_bytes(),
                sm.active_bytes,
                lg.active_bytes,
            ),
            (
                "requested_bytes",
                &st.requested_bytes,
                sm.requested_bytes,
                lg.requested_bytes,
            ),
            ("segment", &st.segment, sm.segment, lg.segment),
            (
                "reserved_bytes",
                &st.reserved_bytes,
                sm.reserved_bytes,
                lg.reserved_bytes,
            ),
            (
                "inactive_split",
                &st.inactive_split,
                sm.inactive_split,
                lg.inactive_split,
            ),
            (
                "inactive_split_bytes",
                &st.inactive_split_bytes,
                sm.inactive_split_bytes,
                lg.inactive_split_bytes,
            ),
        ];
        for (name, array, small, large) in arrays {
            check_array(name, array, small, large)?;
        }
        Ok(())
    }

    /// Expandable segments: as many page handles as pages counted as mapped, each segment's
    /// pages (`check_expandable_pages`), only free blocks of expandable segments unmapped, and
    /// every expandable segment reachable.
    fn check_expandable_segments(&self, heads: &[BlockId]) -> Result<(), String> {
        let handles: usize = self
            .expandable_segments
            .iter()
            .map(|(_, s)| s.handles.len())
            .sum();
        if handles != self.mapped_pages {
            return Err(format!(
                "{handles} page handles, {} pages counted as mapped",
                self.mapped_pages
            ));
        }
        for &head in heads {
            self.check_expandable_pages(head)?;
        }
        for (_, b) in self.segmented_blocks(heads) {
            if !b.mapped() && (b.expandable.is_none() || !b.is_free()) {
                return Err(format!(
                    "block {:#x}: unmapped but not a free expandable block",
                    b.ptr
                ));
            }
        }
        let expandable_heads = heads
            .iter()
            .filter(|&&h| self.block(h).expandable.is_some())
            .count();
        if expandable_heads != self.expandable_segments.len() {
            return Err(format!(
                "{} expandable segments, {expandable_heads} reachable",
                self.expandable_segments.len()
            ));
        }
        Ok(())
    }

    /// The plan: its held segments (`check_plan_segments`); a block is tagged held iff it lies
    /// in a region or chunk, and in a plan's map iff it is free there; the unmapped sets (the pools' and the plan's) hold
    /// exactly the unmapped blocks.
    fn check_plan(&self, heads: &[BlockId]) -> Result<(), String> {
        let (in_plan, plan_unmapped) = self.check_plan_segments()?;
        let mut unmapped_blocks = 0usize;
        for (id, b) in self.segmented_blocks(heads) {
            let free = b.is_free();
            let in_region = self.plan_segment_at(b.ptr).is_some();
            if b.held() != in_region {
                return Err(format!(
                    "block {:#x}: held by the plan={} but in a plan's region or chunk={in_region}",
                    b.ptr,
                    b.held()
                ));
            }
            if (free && in_region) != in_plan.contains(&id) {
                return Err(format!(
                    "block {:#x}: free={free} in a plan's region or chunk, but not in its map",
                    b.ptr
                ));
            }
            unmapped_blocks += usize::from(!b.mapped());
        }
        let unmapped_entries: usize = self
            .all_pools()
            .map(|(_, p)| p.unmapped.len())
            .sum::<usize>()
            + plan_unmapped;
        if unmapped_entries != unmapped_blocks {
            return Err(format!(
                "unmapped sets hold {unmapped_entries} entries for {unmapped_blocks} unmapped blocks"
            ));
        }
        Ok(())
    }

    /// Note [Private pools]'s invariants: the pool table, each pool's segment count, one
    /// owner per segment, and the frees deferred by a capture.
    fn check_private_pools(&self, heads: &[BlockId]) -> Result<(), String> {
        self.private.check()?;
        let mut segments: FxHashMap<PoolSlot, u32> = FxHashMap::default();
        for &head in heads {
            let owner = self.block(head).owner;
            if self.segment_blocks(head).any(|(_, b)| b.owner != owner) {
                return Err(format!(
                    "segment {:#x} has blocks of two pools",
                    self.block(head).ptr
                ));
            }
            if !owner.is_default() {
                *segments.entry(owner).or_default() += 1;
            }
        }
        for (slot, pool) in self.private.iter() {
            let held = segments.remove(&slot).unwrap_or(0);
            if pool.segments != held {
                return Err(format!(
                    "pool {} counts {} segments but owns {held}",
                    pool.id, pool.segments
                ));
            }
        }
        if let Some(slot) = segments.keys().next() {
            return Err(format!(
                "blocks name pool slot {slot:?}, which does not exist"
            ));
        }
        for &id in &self.deferred {
            let b = self.block(id);
            if b.allocated() || !b.has_stream_uses() || b.event_count > 0 {
                return Err(format!(
                    "deferred free {:#x} is not a pending free without events",
                    b.ptr
                ));
            }
        }
        for id in self.capture_uses.keys() {
            if !self.blocks.contains(id.index())
                || !(self.block(*id).allocated() || self.deferred.contains(id))
            {
                return Err("captured stream uses name a block neither live nor deferred".into());
            }
        }
        Ok(())
    }
}
