//! Block pools (PyTorch's `BlockPool`) and the search for a cached block (`get_free_block`).
//!
//! Each allocator has two default pools, small and large, and each private pool two of its
//! own (Note [Private pools]), held as a [`PoolPair`] indexed by kind: which pool a request
//! or block belongs to alternates unpredictably, and an index costs no branch to mispredict. A pool holds its free mapped blocks in a [`FreeSet`] ordered
//! by stream, size and the allocator's tie-break ([`FitOrder`](super::FitOrder)), and the
//! unmapped blocks of its expandable segments by (stream, address). A request is served by
//! the best fit of its own stream only: the first block at or above its rounded size in that
//! order, which the `max_split_size` rules ([`size::fits`]) may still refuse.
//!
//! # Invariants
//! - A block is in its pool's free set iff it is free, mapped and outside a plan's regions and
//!   chunks (a block the plan holds, `Block::held`, sits in the plan's own maps:
//!   `ext/plan/`), under its own current
//!   (stream, size, tie-break) key; in its pool's unmapped set iff it is free and unmapped.
//! - `get_free_blocks_call_count` only grows, and only while garbage collection is enabled;
//!   every block in the free set has `gc_count_base` at most that count.

use std::collections::BTreeMap;

use slab::Slab;

use crate::device::{Device, StreamId};

use super::CachingAllocator;
use super::block::{Block, BlockId};
use super::free_set::{FreeEntry, FreeSet};
use super::pool_id::{PoolRef, PoolSlot};
use super::size::{self, PoolKind};

/// A pool of cached free blocks (PyTorch's `BlockPool`).
#[derive(Debug, Default, Clone)]
pub(super) struct BlockPool {
    pub free: FreeSet,
    /// Unmapped blocks of expandable segments, by (stream, address).
    pub unmapped: BTreeMap<(StreamId, u64), BlockId>,
    /// Lookups since creation, counted only while garbage collection is enabled; a block's
    /// age is this minus its `gc_count_base`.
    pub get_free_blocks_call_count: u64,
}

/// A small and a large pool (an allocator's default pools, or a private pool's), chosen by
/// [`PoolKind::index`] without a branch.
#[derive(Debug, Default, Clone)]
pub(super) struct PoolPair([BlockPool; 2]);

impl PoolPair {
    #[inline]
    pub fn get(&self, kind: PoolKind) -> &BlockPool {
        &self.0[kind.index()]
    }

    #[inline]
    pub fn get_mut(&mut self, kind: PoolKind) -> &mut BlockPool {
        &mut self.0[kind.index()]
    }
}

impl<D: Device> CachingAllocator<D> {
    #[inline]
    pub(super) fn pool_mut(&mut self, pool: PoolRef) -> &mut BlockPool {
        if !pool.owner.is_default() {
            return self.private.get_mut(pool.owner).pools.get_mut(pool.kind);
        }
        self.pools.get_mut(pool.kind)
    }

    /// A pool and the block arena together (disjoint fields), so that a caller holding a
    /// block finds its pool once.
    #[inline]
    fn pool_and_blocks(&mut self, pool: PoolRef) -> (&mut BlockPool, &mut Slab<Block>) {
        let blocks = &mut self.blocks;
        if !pool.owner.is_default() {
            return (
                self.private.get_mut(pool.owner).pools.get_mut(pool.kind),
                blocks,
            );
        }
        (self.pools.get_mut(pool.kind), blocks)
    }

    #[inline]
    pub(super) fn pool(&self, pool: PoolRef) -> &BlockPool {
        if !pool.owner.is_default() {
            return self.private.get(pool.owner).pools.get(pool.kind);
        }
        self.pools.get(pool.kind)
    }

    /// Every block pool: the default ones, then each private pool's.
    pub(super) fn all_pools(&self) -> impl Iterator<Item = (PoolRef, &BlockPool)> {
        let owners = std::iter::once(PoolSlot::DEFAULT).chain(self.private.iter().map(|(s, _)| s));
        owners.flat_map(move |owner| {
            [PoolKind::Small, PoolKind::Large].map(|kind| {
                let pool = PoolRef { owner, kind };
                (pool, self.pool(pool))
            })
        })
    }

    /// The best-fitting cached block of `stream` for a rounded request, taken out of its
    /// pool (`get_free_block`). Only the best fit is considered: the `max_split_size` rules
    /// may refuse it, and then nothing is returned.
    pub(super) fn get_free_block(
        &mut self,
        kind: PoolRef,
        stream: StreamId,
        size: u64,
    ) -> Option<BlockId> {
        let gc = self.gc_enabled();
        let (max_split, slack) = (
            self.config.max_split_size,
            self.config.max_non_split_rounding_size,
        );
        let accept = |found: u64| size::fits(found, size, max_split, slack);
        let no_expandable = self.expandable_segments.is_empty();
        let pool = self.pool_mut(kind);
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        if no_expandable {
            return pool
                .free
                .take_lower_bound(stream, size, accept)
                .map(|entry| entry.id);
        }
        let entry = self.best_fit_with_expandable(kind, stream, size)?;
        if !accept(entry.size) {
            return None;
        }
        self.pool_mut(kind)
            .free
            .remove(stream, entry.size, entry.tie);
        Some(entry.id)
    }

    /// Best fit when expandable segments exist. With the option on, an expandable block
    /// counts as the size it could grow to, so a block that cannot grow is preferred; with
    /// the option off, expandable blocks are passed over.
    fn best_fit_with_expandable(
        &self,
        kind: PoolRef,
        stream: StreamId,
        size: u64,
    ) -> Option<FreeEntry> {
        let free = &self.pool(kind).free;
        let mut entry = free.lower_bound(stream, size)?;
        if self.block(entry.id).expandable.is_none() {
            return Some(entry);
        }
        if self.expandable_segments() {
            while self.block(entry.id).expandable.is_some() {
                let Some(next) = free.next_after(stream, &entry) else {
                    break;
                };
                if self.expandable_size(next.id) >= self.expandable_size(entry.id) {
                    break;
                }
                entry = next;
            }
        } else {
            while self.block(entry.id).expandable.is_some() {
                entry = free.next_after(stream, &entry)?;
            }
        }
        Some(entry)
    }

    /// Puts a free block into its pool's free set, stamping its GC age base.
    #[inline]
    pub(super) fn insert_free(&mut self, id: BlockId) {
        let block = self.block(id);
        if block.held() {
            return self.insert_held_free(id);
        }
        let kind = block.pool_ref();
        let order = self.fit_order;
        // The pool is found once, for its count and its set.
        let (pool, blocks) = self.pool_and_blocks(kind);
        let block = &mut blocks[id.index()];
        block.gc_count_base = pool.get_free_blocks_call_count;
        let entry = FreeEntry {
            size: block.size,
            tie: order.tie(block.counter, block.ptr),
            id,
        };
        pool.free.insert(block.stream, entry);
    }

    /// Puts an unmapped block into its pool's unmapped set, or its plan segment's map.
    pub(super) fn insert_unmapped(&mut self, id: BlockId) {
        let b = self.block(id);
        let (kind, key) = (b.pool_ref(), (b.stream, b.ptr));
        if b.held() {
            return self.insert_held_unmapped(id);
        }
        self.pool_mut(kind).unmapped.insert(key, id);
    }

    /// Takes an unmapped block out of its pool's unmapped set, or its plan segment's map.
    pub(super) fn remove_unmapped(&mut self, id: BlockId) {
        let b = self.block(id);
        let (kind, key) = (b.pool_ref(), (b.stream, b.ptr));
        if b.held() {
            return self.remove_held_unmapped(id);
        }
        let removed = self.pool_mut(kind).unmapped.remove(&key);
        debug_assert!(removed.is_some(), "unmapped block {:#x} missing", key.1);
    }

    /// Whether an unmapped block is where [`Self::insert_unmapped`] puts it.
    pub(super) fn in_unmapped_set(&self, id: BlockId) -> bool {
        let b = self.block(id);
        if b.held() {
            return self.held_unmapped_has(id);
        }
        self.pool(b.pool_ref()).unmapped.get(&(b.stream, b.ptr)) == Some(&id)
    }

    /// Takes a free block out of its pool's free set (its key must be current).
    #[inline(always)]
    pub(super) fn remove_free(&mut self, id: BlockId) {
        let block = self.block(id);
        if block.held() {
            return self.remove_held_free(id);
        }
        let (kind, stream, size, ptr) = (block.pool_ref(), block.stream, block.size, block.ptr);
        let tie = self.fit_order.tie(block.counter, ptr);
        let removed = self.pool_mut(kind).free.remove(stream, size, tie);
        debug_assert!(removed, "free block {ptr:#x} missing from its pool");
    }
}
