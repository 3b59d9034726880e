//! Handing out and taking back blocks: splitting a found block (`alloc_found_block`) and
//! merging a freed one with its free neighbours (`free_block`, `try_merge_blocks`).
//!
//! # Invariants
//! - A split keeps the segment tiled: the front piece takes the block's place in the links
//!   and the rest starts where it ends.
//! - After `free_block`, neither neighbour of the freed block is free and mapped alike
//!   (merging is eager), so no two adjacent free blocks of one kind exist.
//! - `inactive_split*` count the free blocks of split non-expandable segments, updated by
//!   the net change of each operation.

use crate::device::{Device, DevicePtr};

use super::block::{Block, BlockId, Flags};
use super::{CachingAllocator, TraceAction};

impl<D: Device> CachingAllocator<D> {
    /// Hands out a block, splitting off its tail when `split` (`alloc_found_block`).
    // Inlined into `malloc`, as `free_block` into `free`.
    #[inline(always)]
    pub(super) fn alloc_found_block(
        &mut self,
        mut id: BlockId,
        size: u64,
        requested: u64,
        split: bool,
    ) -> DevicePtr {
        let block = self.block(id);
        let (kind, stream, was_split) = (block.pool, block.stream, block.is_split());
        let (ptr, found_size, expandable, owner) =
            (block.ptr, block.size, block.expandable, block.owner);
        // Free blocks of expandable segments never count as inactive splits.
        let counts_split = expandable.is_none();
        // Sizes and the address follow from what was read here, not from reloading the
        // stores the split makes.
        let block_size = if split { size } else { found_size };
        if split {
            let front = self.split_front(id, size);
            let remaining = found_size - size;
            self.insert_free(id);
            if counts_split && was_split {
                self.stats.inactive_split_bytes.decrease(kind, size);
            } else if counts_split {
                self.stats.inactive_split_bytes.increase(kind, remaining);
                self.stats.inactive_split.increase(kind, 1);
            }
            id = front;
        } else if was_split && counts_split {
            self.stats.inactive_split_bytes.decrease(kind, found_size);
            self.stats.inactive_split.decrease(kind, 1);
        }
        let block = self.block_mut(id);
        block.set_allocated(true);
        block.requested_size = requested;
        self.record(TraceAction::Alloc, ptr, requested, stream, owner);
        self.live.insert(ptr, id, &self.blocks);
        let oversize = block_size >= self.config.max_split_size;
        self.stats
            .count_alloc(kind, block_size, requested, oversize);
        DevicePtr(ptr)
    }

    /// Carves the first `size` bytes of block `id` into a new block just before it (same
    /// stream, pool and segment) and returns it; `id` keeps the rest. Neither is put in a set.
    pub(super) fn split_front(&mut self, id: BlockId, size: u64) -> BlockId {
        let b = self.block(id);
        let (ptr, stream, kind, prev, expandable) =
            (b.ptr, b.stream, b.pool_ref(), b.prev, b.expandable);
        let (counter, held) = (b.counter, b.held());
        let counter = self.piece_counter(counter);
        let front = self.new_block(Block {
            prev,
            next: Some(id),
            expandable,
            flags: Flags::MAPPED_FREE.held(held),
            ..Block::segment(ptr, size, stream, kind, counter)
        });
        if let Some(p) = prev {
            self.block_mut(p).next = Some(front);
        }
        let rest = self.block_mut(id);
        rest.prev = Some(front);
        rest.ptr += size;
        rest.size -= size;
        front
    }

    /// Makes a block free: merges it with free neighbours and puts it in its pool
    /// (`free_block`). Its caller counts the free (`count_free`, or `count_free_completed`
    /// for one that waited on events).
    // Inlined into `free`: the call's register saves and restores cost about 2 % of the
    // recorded benchmark's time.
    #[inline(always)]
    pub(super) fn free_block(&mut self, id: BlockId) {
        let block = self.block(id);
        let (kind, stream, ptr, requested, owner) = (
            block.pool,
            block.stream,
            block.ptr,
            block.requested_size,
            block.owner,
        );
        let (prev, next) = (block.prev, block.next);
        self.record(TraceAction::FreeCompleted, ptr, requested, stream, owner);
        let mut split_count: i64 = 0;
        let mut split_bytes: i64 = 0;
        // Written out rather than a loop over both: the loop kept its array on the stack.
        if let Some(p) = prev
            && self.mergeable(id, p)
        {
            split_count -= 1;
            split_bytes -= self.merge(id, p) as i64;
        }
        if let Some(n) = next
            && self.mergeable(id, n)
        {
            split_count -= 1;
            split_bytes -= self.merge(id, n) as i64;
        }
        self.insert_free(id);
        let block = self.block(id);
        if block.is_split() {
            split_count += 1;
            split_bytes += block.size as i64;
        }
        // Free blocks of expandable segments never count as inactive splits.
        if block.expandable.is_none() {
            self.stats.inactive_split.update(kind, split_count);
            self.stats.inactive_split_bytes.update(kind, split_bytes);
        }
    }

    /// Whether `dst` can absorb its neighbour `src`: `src` is free and mapped as `dst` is.
    /// `free_block` checks it before `merge`; `try_merge` checks it itself.
    #[inline]
    fn mergeable(&self, dst: BlockId, src: BlockId) -> bool {
        let s = self.block(src);
        s.is_free() && s.mapped() == self.block(dst).mapped()
    }

    /// Absorbs the free neighbour `src` into `dst`; returns the bytes absorbed, 0 unless
    /// [`Self::mergeable`] (`try_merge`).
    pub(super) fn try_merge(&mut self, dst: BlockId, src: BlockId) -> u64 {
        if self.mergeable(dst, src) {
            self.merge(dst, src)
        } else {
            0
        }
    }

    /// Absorbs `src` into `dst`, which [`Self::mergeable`] allows; returns the bytes absorbed.
    // Inlined into `free_block` for the same reason.
    #[inline(always)]
    fn merge(&mut self, dst: BlockId, src: BlockId) -> u64 {
        debug_assert!(self.mergeable(dst, src));
        let s = self.block(src);
        let (src_size, src_ptr, src_prev, src_next) = (s.size, s.ptr, s.prev, s.next);
        if s.mapped() {
            self.remove_free(src);
        } else {
            self.remove_unmapped(src);
        }
        if self.block(dst).prev == Some(src) {
            let d = self.block_mut(dst);
            d.ptr = src_ptr;
            d.prev = src_prev;
            if let Some(p) = src_prev {
                self.block_mut(p).next = Some(dst);
            }
        } else {
            self.block_mut(dst).next = src_next;
            if let Some(n) = src_next {
                self.block_mut(n).prev = Some(dst);
            }
        }
        self.block_mut(dst).size += src_size;
        self.blocks.remove(src.index());
        src_size
    }
}
