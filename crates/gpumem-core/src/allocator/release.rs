//! Giving memory back to the driver: the cache flush (`release_cached_blocks`), the release
//! of cached oversize blocks (`release_available_cached_blocks`) and garbage collection
//! (`garbage_collect_cached_blocks`); a followed plan also gives back the default pools'
//! idle segments once (`release_idle_cache`), and the default large pool's whole free
//! segments before a new one past its saving (`segment_beside_plan`, Note [Planned
//! placement]).
//!
//! # Invariants
//! - Only whole free segments are freed; of expandable segments only whole free pages are
//!   unmapped, and a segment gives its address range back only once wholly unmapped.
//! - A flush first completes every pending free (it waits on their events), so nothing that
//!   other streams may still use is released.
//! - Garbage collection runs only with a memory fraction and a positive threshold, and frees
//!   only unsplit, non-expandable large-pool blocks.

use crate::device::{Device, DevicePtr, StreamId};

use super::block::{Block, BlockId};
use super::free_set::FreeEntry;
use super::pool_id::PoolRef;
use super::size::PoolKind;
use super::{AllocError, CachingAllocator, TraceAction};

impl<D: Device> CachingAllocator<D> {
    /// Whether garbage collection is enabled: a memory fraction is set and so is
    /// `garbage_collection_threshold`.
    pub(super) fn gc_enabled(&self) -> bool {
        self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    /// Waits for every pending free, then releases the whole free segments of the default
    /// pools, of the freeable private pools (forgetting those left without segments) and
    /// the plan's memory without live blocks.
    pub(super) fn release_cached_blocks(&mut self) -> Result<(), AllocError> {
        self.synchronize_and_free_events()?;
        self.release_blocks(PoolRef::default_pool(PoolKind::Large))?;
        self.release_blocks(PoolRef::default_pool(PoolKind::Small))?;
        for owner in self.private.freeable() {
            for kind in [PoolKind::Small, PoolKind::Large] {
                self.release_blocks(PoolRef { owner, kind })?;
            }
            self.private.forget_if_empty(owner);
        }
        self.give_back_plan_memory()?;
        Ok(())
    }

    /// Releases the whole free segments of a pool, in the pool's order, then unmaps the
    /// whole free pages of its expandable segments (`release_blocks`).
    pub(super) fn release_blocks(&mut self, kind: PoolRef) -> Result<(), AllocError> {
        let free: Vec<BlockId> = self.pool(kind).free.iter().map(|(_, e)| e.id).collect();
        let mut to_unmap = Vec::new();
        for id in free {
            let block = self.block(id);
            if block.expandable.is_some() {
                to_unmap.push(id);
            } else if !block.is_split() {
                self.release_block(id)?;
            }
        }
        for id in to_unmap {
            self.unmap_block(id, false)?;
        }
        // Segments left wholly unmapped give their address range back, including one whose
        // first mapping failed (PyTorch keeps those reserved).
        let empty: Vec<BlockId> = self
            .pool(kind)
            .unmapped
            .values()
            .copied()
            .filter(|&id| !self.block(id).is_split())
            .collect();
        for id in empty {
            self.release_expandable_segment(id)?;
        }
        Ok(())
    }

    /// Returns a whole free segment to the driver (`release_block`).
    pub(super) fn release_block(&mut self, id: BlockId) -> Result<(), AllocError> {
        let block = self.block(id);
        debug_assert!(block.is_free() && !block.is_split());
        let (pool, stream, ptr, size) = (block.pool_ref(), block.stream, block.ptr, block.size);
        self.device.free(DevicePtr(ptr))?;
        self.record(TraceAction::SegmentFree, ptr, size, stream, pool.owner);
        self.total_allocated_memory -= size;
        let oversize = size >= self.config.max_split_size;
        self.stats.count_segment_free(pool.kind, size, oversize);
        self.remove_free(id);
        self.blocks.remove(id.index());
        self.count_pool_segment(pool.owner, -1);
        Ok(())
    }

    /// Frees cached oversize blocks of the request's pool and stream, without synchronising
    /// (`release_available_cached_blocks`): the smallest single block of at least
    /// `max(size, max_split_size)`, or else oversize blocks from the largest down until that
    /// much is released. Only whole segments are released (a deviation that matters only
    /// after `max_split_size` was lowered at run time); expandable blocks are skipped.
    pub(super) fn release_available_cached_blocks(
        &mut self,
        kind: PoolRef,
        stream: StreamId,
        size: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let key = size.max(max_split);
        let free = &self.pool(kind).free;
        let releasable = |b: &Block| !b.is_split() && b.expandable.is_none();
        if let Some(entry) = free.lower_bound(stream, key)
            && self.block(entry.id).expandable.is_none()
        {
            if !releasable(self.block(entry.id)) {
                return Ok(false);
            }
            self.release_block(entry.id)?;
            return Ok(true);
        }
        let mut cursor = free.last_below(stream, key);
        let mut released = 0;
        while let Some(entry) = cursor {
            if released >= key || entry.size < max_split {
                break;
            }
            cursor = self.pool(kind).free.prev_before(stream, &entry);
            if releasable(self.block(entry.id)) {
                self.release_block(entry.id)?;
                released += entry.size;
            }
        }
        Ok(released >= key)
    }

    /// Releases unsplit cached large blocks, oldest first, until the reserved memory is back
    /// under `garbage_collection_threshold` × the allowed memory (`garbage_collect_cached_blocks`).
    /// Ages count large-pool lookups since a block was cached; each pass frees every block at
    /// least as old as the average, and passes repeat while they free something.
    pub(super) fn garbage_collect(&mut self) -> Result<(), AllocError> {
        let Some(allowed) = self.allowed_memory_maximum else {
            return Ok(());
        };
        let limit = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        if self.total_allocated_memory <= limit {
            return Ok(());
        }
        let target = self.total_allocated_memory - limit;
        let large = self.pools.get(PoolKind::Large);
        let now = large.get_free_blocks_call_count;
        let age = |b: &Block| (now - b.gc_count_base) as f64;
        let (mut total_age, mut count) = large
            .free
            .iter()
            .map(|(_, e)| self.block(e.id))
            .filter(|b| !b.is_split() && b.expandable.is_none())
            .fold((0.0, 0u64), |(sum, n), b| (sum + age(b), n + 1));
        let mut reclaimed = 0;
        let mut freed_any = true;
        while reclaimed < target && freed_any && count > 0 {
            let average = total_age / count as f64;
            freed_any = false;
            let candidates: Vec<FreeEntry> = self
                .pools
                .get(PoolKind::Large)
                .free
                .iter()
                .map(|(_, e)| e)
                .collect();
            for entry in candidates {
                let block = self.block(entry.id);
                if !block.is_split() && block.expandable.is_none() && age(block) >= average {
                    let block_age = age(block);
                    self.release_block(entry.id)?;
                    freed_any = true;
                    reclaimed += entry.size;
                    total_age -= block_age;
                    count -= 1;
                }
            }
        }
        Ok(())
    }
}
