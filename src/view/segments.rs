//! The segment map: every segment of a device at one moment, its blocks in address order with
//! their sizes and states, and (at a moment of a recording) the stacks that allocated the
//! live ones; and the largest live blocks. Plain data (serde) that the web pages draw: the
//! view of a recording, and the agent's live page for allocators its process holds.
//!
//! # Invariants (budgets)
//! - At most [`MAX_SEGMENTS`] segments and [`MAX_BLOCKS`] blocks are listed (in address
//!   order); `segments_total` and `blocks_total` say how many there were, so the page can say
//!   what it left out. Stacks are listed once each and referred to by index, each at most
//!   [`MAX_FRAMES`] frames, innermost first, after the lines of the allocation's context
//!   (compile context, user metadata, at most [`MAX_FRAMES`] forward frames).
//! - A block's state is one of `allocated`, `pending_free` (freed, waiting on other streams'
//!   events), `inactive_split` (free, in a segment split around other blocks) or `free` (a
//!   segment that is one free block); blocks tile their segment (offsets from its address).

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::allocator::size::PoolKind;
use crate::allocator::{BlockState, PoolId, SegmentInfo};
use crate::device::StreamId;

/// Segments listed in one map.
pub const MAX_SEGMENTS: usize = 4096;
/// Blocks listed in one map.
pub const MAX_BLOCKS: usize = 65_536;
/// Frames listed of a stack.
pub const MAX_FRAMES: usize = 8;
/// Live blocks in the largest-allocations list.
pub const TOP_BLOCKS: usize = 20;

/// One device's segments at one moment.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SegmentMap {
    /// The moment of a recording: just after this event (`None` for a live allocator).
    pub event: Option<usize>,
    /// Reserved bytes (all segments, listed or not).
    pub reserved: u64,
    /// Allocated bytes (live and pending-free blocks).
    pub allocated: u64,
    /// Segments there were.
    pub segments_total: usize,
    /// Blocks there were.
    pub blocks_total: usize,
    /// The segments listed, in address order.
    pub segments: Vec<MapSegment>,
    /// The largest live blocks, largest first (at most [`TOP_BLOCKS`]).
    pub top: Vec<TopBlock>,
    /// The stacks blocks refer to, innermost frame first, as `file:line in function`.
    pub stacks: Vec<Vec<String>>,
}

/// A segment (a mapped run of an expandable one counts as one).
#[derive(Clone, Debug, Serialize)]
pub struct MapSegment {
    /// Its address.
    pub address: u64,
    /// Its bytes.
    pub size: u64,
    /// The stream whose pool holds it.
    pub stream: StreamId,
    /// Its pool's size class (`"small"` or `"large"`).
    pub pool: PoolKind,
    /// Its pool: `(0, 0)` the default, else a private pool (CUDA graph, MemPool).
    pub pool_id: PoolId,
    /// Its blocks, in address order.
    pub blocks: Vec<MapBlock>,
}

/// A block of a segment.
#[derive(Clone, Debug, Serialize)]
pub struct MapBlock {
    /// From the segment's address.
    pub offset: u64,
    /// Its bytes.
    pub size: u64,
    /// What the caller asked for (live blocks).
    pub requested: u64,
    /// See the module's invariants.
    pub state: &'static str,
    /// Index into [`SegmentMap::stacks`] of the stack that allocated it, where known.
    pub stack: Option<usize>,
}

/// A live block among the largest.
#[derive(Clone, Debug, Serialize)]
pub struct TopBlock {
    /// Its address.
    pub address: u64,
    /// Its bytes.
    pub size: u64,
    /// What the caller asked for.
    pub requested: u64,
    /// Index into [`SegmentMap::stacks`], where known.
    pub stack: Option<usize>,
}

/// Who allocated a map's blocks: a recording's stacks (`view::recording`), or nothing known
/// (a live allocator's map).
pub trait Provenance {
    /// A key equal for the blocks allocated from the same stack and context, for the block
    /// at `address`; `None` where nothing is known of it.
    fn key_of(&self, address: u64) -> Option<u64>;
    /// The lines naming the stack of `key`: its context first, then at most [`MAX_FRAMES`]
    /// frames, innermost first.
    fn describe(&self, key: u64) -> Vec<String>;
}

/// The map of `device`'s `segments`, taken just after `event` of a recording where it is
/// one; with `provenance`, the stacks that allocated their blocks.
pub fn map(
    segments: &[SegmentInfo],
    device: u32,
    event: Option<usize>,
    provenance: Option<&dyn Provenance>,
) -> SegmentMap {
    let mut out = SegmentMap {
        event,
        ..SegmentMap::default()
    };
    // Each stack is listed once; blocks refer to it by index.
    let mut stack_index: FxHashMap<u64, usize> = FxHashMap::default();
    let mut index_of = |address: u64, out: &mut SegmentMap| -> Option<usize> {
        let provenance = provenance?;
        let key = provenance.key_of(address)?;
        Some(*stack_index.entry(key).or_insert_with(|| {
            out.stacks.push(provenance.describe(key));
            out.stacks.len() - 1
        }))
    };
    let mut live: Vec<(u64, u64, u64)> = Vec::new();
    let mut segments: Vec<_> = segments.iter().filter(|s| s.device == device).collect();
    segments.sort_by_key(|s| s.address);
    for segment in segments {
        out.segments_total += 1;
        out.blocks_total += segment.blocks.len();
        let split = segment.blocks.len() > 1;
        let mut blocks = Vec::new();
        let listed = out.segments.len() < MAX_SEGMENTS && out.blocks_total <= MAX_BLOCKS;
        for b in &segment.blocks {
            out.reserved += b.size;
            let state = match b.state {
                BlockState::ActiveAllocated => "allocated",
                BlockState::ActivePendingFree => "pending_free",
                BlockState::Inactive if split => "inactive_split",
                BlockState::Inactive => "free",
            };
            if b.state != BlockState::Inactive {
                out.allocated += b.size;
            }
            if b.state == BlockState::ActiveAllocated {
                live.push((b.size, b.address, b.requested_size));
            }
            if listed {
                let stack = if b.state == BlockState::Inactive {
                    None
                } else {
                    index_of(b.address, &mut out)
                };
                blocks.push(MapBlock {
                    offset: b.address - segment.address,
                    size: b.size,
                    requested: b.requested_size.min(b.size),
                    state,
                    stack,
                });
            }
        }
        if listed {
            out.segments.push(MapSegment {
                address: segment.address,
                size: segment.total_size,
                stream: segment.stream,
                pool: segment.segment_type,
                pool_id: segment.segment_pool_id,
                blocks,
            });
        }
    }
    live.sort_by(|a, b| b.cmp(a));
    for &(size, address, requested) in live.iter().take(TOP_BLOCKS) {
        let stack = index_of(address, &mut out);
        out.top.push(TopBlock {
            address,
            size,
            requested: requested.min(size),
            stack,
        });
    }
    out
}
