//! Blocks: contiguous pieces of a segment, kept in a host-side arena and linked by id.
//!
//! # Invariants
//! - The blocks of one segment tile it exactly: `prev.ptr + prev.size == ptr` and the links
//!   agree both ways. A block with neither `prev` nor `next` is a whole segment.
//! - A block is in exactly one of three states: allocated (handed out); pending free (not
//!   allocated, waiting on `event_count > 0` events or holding stream uses it could not
//!   record); free (neither, and then it sits in its pool's free set, or in its pool's
//!   unmapped set if it is an unmapped part of an expandable segment; in a plan's region or
//!   chunk, in the plan's own maps instead).
//! - A block is tagged `held` iff it lies in a plan's region or chunk: the tag is set on the
//!   segment's one block when the plan obtains it and inherited by every piece split off.
//! - Only blocks of expandable segments are ever unmapped; unmapped blocks are free.
//! - Sizes and addresses are multiples of 512.

use std::num::NonZeroU32;

use crate::device::{Device, StreamId};

use super::CachingAllocator;
use super::pool_id::{PoolRef, PoolSlot};
use super::size::PoolKind;

/// Index of a block in the allocator's arena, stored plus one so that `Option<BlockId>` takes
/// four bytes (the neighbour links must fit the block's first cache line).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub(crate) struct BlockId(NonZeroU32);

impl BlockId {
    /// The id of arena slot `index`; `None` from 2^32 - 1 slots on.
    pub fn new(index: usize) -> Option<BlockId> {
        let stored = u32::try_from(index).ok()?.checked_add(1)?;
        NonZeroU32::new(stored).map(BlockId)
    }

    pub fn index(self) -> usize {
        (self.0.get() - 1) as usize
    }
}

/// Index of an expandable segment in the allocator's segment table, stored plus one so that
/// `Option<SegmentId>` takes four bytes (room in the block's cache line for its counter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub(crate) struct SegmentId(NonZeroU32);

impl SegmentId {
    /// The id of table slot `index`; `None` from 2^32 - 1 slots on.
    pub fn new(index: usize) -> Option<SegmentId> {
        let stored = u32::try_from(index).ok()?.checked_add(1)?;
        NonZeroU32::new(stored).map(SegmentId)
    }

    pub fn index(self) -> usize {
        (self.0.get() - 1) as usize
    }
}

/// A block (PyTorch's `Block`).
///
/// One cache line: the arena is walked at random (neighbours, the free set's picks), so a
/// block costs one miss. The streams that used a block (`record_stream`) are rare and live in
/// the allocator's side table; the block only says whether it has any.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub(crate) struct Block {
    /// Device address.
    pub ptr: u64,
    /// Size in bytes.
    pub size: u64,
    /// The stream the block was allocated on; it is reused only on that stream.
    pub stream: StreamId,
    /// The unrounded size of the last request this block served (kept after free).
    pub requested_size: u64,
    /// The pool's `get_free_blocks_call_count` when the block last entered the free set.
    pub gc_count_base: u64,
    /// Neighbour below in the same segment.
    pub prev: Option<BlockId>,
    /// Neighbour above in the same segment.
    pub next: Option<BlockId>,
    /// Outstanding events that must complete before the block can be reused (one per stream
    /// that used it; a free used by more streams than this counts waits for the device).
    pub event_count: u16,
    /// The private pool that owns the block, or the default pools.
    pub owner: PoolSlot,
    /// The expandable segment the block lies in, if any.
    pub expandable: Option<SegmentId>,
    /// The segment counter: taken when the block's segment was obtained, inherited by every
    /// block carved from it (the tie-break of [`super::fit_order::FitOrder::Counter`]).
    pub counter: u32,
    /// The size class of the pool that owns the block.
    pub pool: PoolKind,
    /// Allocated, mapped, used by other streams, held by a plan: see the accessors.
    pub flags: Flags,
}

/// A block's yes-or-no facts, a bit each (the block fills its cache line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Flags(u8);

impl Flags {
    const ALLOCATED: u8 = 1;
    const MAPPED: u8 = 2;
    const STREAM_USES: u8 = 4;
    const HELD: u8 = 8;

    /// A free block backed by physical memory (every block outside expandable segments).
    pub const MAPPED_FREE: Flags = Flags(Flags::MAPPED);
    /// A free block of an expandable segment without physical memory.
    pub const UNMAPPED_FREE: Flags = Flags(0);

    /// These flags, with `bit` set to `on`.
    #[inline]
    const fn with(self, bit: u8, on: bool) -> Flags {
        if on {
            Flags(self.0 | bit)
        } else {
            Flags(self.0 & !bit)
        }
    }

    /// These flags, allocated or not.
    pub const fn allocated(self, on: bool) -> Flags {
        self.with(Flags::ALLOCATED, on)
    }

    /// These flags, held by a plan or not.
    pub const fn held(self, on: bool) -> Flags {
        self.with(Flags::HELD, on)
    }
}

impl Block {
    /// A whole, unsplit, free segment (or a piece of one, with its segment's counter).
    pub fn segment(ptr: u64, size: u64, stream: StreamId, pool: PoolRef, counter: u32) -> Block {
        Block {
            counter,
            ptr,
            size,
            requested_size: 0,
            stream,
            pool: pool.kind,
            owner: pool.owner,
            flags: Flags::MAPPED_FREE,
            prev: None,
            next: None,
            event_count: 0,
            gc_count_base: 0,
            expandable: None,
        }
    }

    /// The block pool that owns the block.
    pub fn pool_ref(&self) -> PoolRef {
        PoolRef {
            owner: self.owner,
            kind: self.pool,
        }
    }

    /// Handed out to a caller.
    #[inline]
    pub fn allocated(&self) -> bool {
        self.flags.0 & Flags::ALLOCATED != 0
    }

    #[inline]
    pub fn set_allocated(&mut self, on: bool) {
        self.flags = self.flags.allocated(on);
    }

    /// Backed by physical memory (always true outside expandable segments).
    #[inline]
    pub fn mapped(&self) -> bool {
        self.flags.0 & Flags::MAPPED != 0
    }

    #[inline]
    pub fn set_mapped(&mut self, on: bool) {
        self.flags = self.flags.with(Flags::MAPPED, on);
    }

    /// Streams other than `stream` used the block and are not yet covered by events: the
    /// allocator's `stream_uses` table lists them.
    #[inline]
    pub fn has_stream_uses(&self) -> bool {
        self.flags.0 & Flags::STREAM_USES != 0
    }

    #[inline]
    pub fn set_stream_uses(&mut self, on: bool) {
        self.flags = self.flags.with(Flags::STREAM_USES, on);
    }

    /// Part of a plan's region or chunk (Note [Planned placement]): its free parts are the
    /// plan's, in the plan's own maps, never in a pool's sets. Inherited by every piece of
    /// the segment.
    #[inline]
    pub fn held(&self) -> bool {
        self.flags.0 & Flags::HELD != 0
    }

    /// Marks a region's or chunk's block as the plan's.
    pub fn hold_for_plan(&mut self) {
        self.flags = self.flags.held(true);
    }

    /// Part of a segment that also holds other blocks.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }

    /// Freed by the user but waiting on other streams.
    pub fn is_pending_free(&self) -> bool {
        !self.allocated() && (self.event_count > 0 || self.has_stream_uses())
    }

    /// Neither allocated nor pending. A free block is in its pool's free set when mapped and
    /// in its pool's unmapped set otherwise (PyTorch's "allocatable").
    pub fn is_free(&self) -> bool {
        // One test of both bits.
        self.flags.0 & (Flags::ALLOCATED | Flags::STREAM_USES) == 0 && self.event_count == 0
    }
}

/// The arena: blocks by id, and the walk over segments.
impl<D: Device> CachingAllocator<D> {
    pub(super) fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id.index()]
    }

    pub(super) fn block_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id.index()]
    }

    pub(super) fn new_block(&mut self, block: Block) -> BlockId {
        let key = self.blocks.insert(block);
        BlockId::new(key).expect("fewer than 2^32 - 1 blocks")
    }

    /// Segment head blocks, by address.
    pub(super) fn segment_heads(&self) -> Vec<BlockId> {
        let mut heads: Vec<(u64, BlockId)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.prev.is_none())
            .filter_map(|(k, b)| Some((b.ptr, BlockId::new(k)?)))
            .collect();
        heads.sort_unstable();
        heads.into_iter().map(|(_, id)| id).collect()
    }

    /// The blocks of the segment starting at `head`, in address order.
    pub(super) fn segment_blocks(
        &self,
        head: BlockId,
    ) -> impl Iterator<Item = (BlockId, &Block)> + '_ {
        std::iter::successors(Some(head), |&id| self.block(id).next).map(|id| (id, self.block(id)))
    }
}

// The one cache line `Block`'s documentation promises.
const _: () = assert!(std::mem::size_of::<Block>() == 64);
