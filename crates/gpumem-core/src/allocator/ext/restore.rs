//! Recreating a segment with a given layout: the start state of a recording that began
//! mid-run, loaded into the core before its trace is replayed.
//!
//! # Invariants
//! - A restored segment satisfies every allocator invariant at once: adjacent free space is
//!   merged, allocated blocks are live, statistics count the blocks as if allocated one by
//!   one; nothing is recorded in the trace.
//! - A layout that cannot exist (a zero or unaligned block, an exabyte) is refused before the
//!   device is asked for anything.

use crate::device::{Device, DevicePtr, StreamId};

use crate::allocator::block::{Block, BlockId, Flags};
use crate::allocator::pool_id::{PoolId, PoolRef, PoolSlot};
use crate::allocator::private_pool::PoolOptions;
use crate::allocator::size::{MIN_BLOCK_SIZE, ONE_EXABYTE, PoolKind};
use crate::allocator::{AllocError, CachingAllocator};

/// One block of a segment to restore, in address order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoredBlock {
    /// Size in bytes (a multiple of 512).
    pub size: u64,
    /// `Some(requested bytes)` for a live (allocated) block, `None` for free space.
    pub allocated: Option<u64>,
}

impl<D: Device> CachingAllocator<D> {
    /// Obtains a segment from the device and lays it out as `blocks` say: allocated blocks
    /// become live, adjacent free space merges into free blocks. Statistics count it as if
    /// the blocks had been allocated one by one; no trace entries are recorded. The segment
    /// takes the next counter: restore segments in the order they were obtained.
    ///
    /// # Errors
    /// [`AllocError::Device`] if the device cannot provide the segment;
    /// [`AllocError::InvalidLayout`] if a block size is not a positive multiple of 512.
    pub fn restore_segment(
        &mut self,
        pool_id: PoolId,
        stream: StreamId,
        kind: PoolKind,
        blocks: &[RestoredBlock],
    ) -> Result<DevicePtr, AllocError> {
        let size = blocks
            .iter()
            .try_fold(0u64, |sum, b| sum.checked_add(b.size))
            .filter(|&size| size < ONE_EXABYTE)
            .ok_or_else(|| {
                AllocError::InvalidLayout("the blocks add up to an exabyte or more".into())
            })?;
        if let Some(b) = blocks
            .iter()
            .find(|b| b.size == 0 || !b.size.is_multiple_of(MIN_BLOCK_SIZE))
        {
            return Err(AllocError::InvalidLayout(format!(
                "block of {} bytes is not a positive multiple of {MIN_BLOCK_SIZE}",
                b.size
            )));
        }
        if size == 0 {
            return Err(AllocError::InvalidLayout("a segment needs blocks".into()));
        }
        // A private pool the recording shows is held (its use count is not recorded).
        let owner = match self.private.slot_of(pool_id) {
            _ if pool_id.is_default() => PoolSlot::DEFAULT,
            Some(slot) => slot,
            None => self
                .private
                .create_or_incref(pool_id, PoolOptions::default())?,
        };
        let pool = PoolRef { owner, kind };
        let base = self.device.malloc(size)?;
        if let Err(e) = self.admit_segment(base.0, size) {
            let _ = self.device.free(base);
            return Err(e);
        }
        self.total_allocated_memory += size;
        self.count_pool_segment(owner, 1);
        let counter = self.take_counter();
        let max_split = self.config.max_split_size;
        self.stats
            .count_segment_alloc(kind, size, size >= max_split);

        // Merge runs of free space first, so that no two free blocks end up adjacent.
        let mut merged: Vec<RestoredBlock> = Vec::with_capacity(blocks.len());
        for &b in blocks {
            match merged.last_mut() {
                Some(last) if last.allocated.is_none() && b.allocated.is_none() => {
                    last.size += b.size;
                }
                _ => merged.push(b),
            }
        }
        let split = merged.len() > 1;
        let mut ptr = base.0;
        let mut prev: Option<BlockId> = None;
        let mut free = Vec::new();
        for (i, b) in merged.into_iter().enumerate() {
            // In the block-counter order every block has its own, in address order here.
            let counter = if i == 0 {
                counter
            } else {
                self.piece_counter(counter)
            };
            let id = self.new_block(Block {
                prev,
                requested_size: b.allocated.unwrap_or(0),
                flags: Flags::MAPPED_FREE.allocated(b.allocated.is_some()),
                ..Block::segment(ptr, b.size, stream, pool, counter)
            });
            if let Some(p) = prev {
                self.block_mut(p).next = Some(id);
            }
            match b.allocated {
                Some(requested) => {
                    self.live.insert(ptr, id, &self.blocks);
                    self.stats
                        .count_alloc(kind, b.size, requested, b.size >= max_split);
                }
                None => {
                    free.push(id);
                    if split {
                        self.stats.inactive_split.increase(kind, 1);
                        self.stats.inactive_split_bytes.increase(kind, b.size);
                    }
                }
            }
            ptr += b.size;
            prev = Some(id);
        }
        // Free blocks go into the pool once their links are final.
        for id in free {
            self.insert_free(id);
        }
        self.checked("restore_segment", Ok(base))
    }
}
