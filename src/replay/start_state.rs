//! The allocator state at the start of a trace that began mid-run, rebuilt from the final
//! segments and the trace read backwards.
//!
//! Walking the events from last to first undoes them: an `alloc` makes its block not yet
//! live, a `free_requested` makes it live again, a `segment_alloc` removes its segment, a
//! `segment_free` restores it. What remains is the set of segments and live blocks at the
//! first event. Blocks known only from their request get the size the allocator would have
//! given them: the request rounded, plus, in the large pool, any gap of at most 1 MiB before
//! the next live block (a large-pool remainder that small is never split off, so it cannot be
//! a free block). Every other gap is one free block.

use std::collections::BTreeMap;

use crate::allocator::size::{ONE_EXABYTE, PoolKind, SMALL_BUFFER, SMALL_SIZE, round_size};
use crate::allocator::{BlockState, PoolId, RestoredBlock, TraceAction};
use crate::config::AllocatorConfig;
use crate::device::StreamId;

use crate::recording::Recording;

/// A segment as it was when the trace started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartSegment {
    /// Base address.
    pub address: u64,
    /// Stream handle.
    pub stream: StreamId,
    /// Pool kind.
    pub pool: PoolKind,
    /// Its pool (a private one's segments are restored into it).
    pub pool_id: PoolId,
    /// Blocks in address order; they add up to the segment size.
    pub blocks: Vec<RestoredBlock>,
}

impl StartSegment {
    /// Segment size.
    pub fn size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }
}

/// The state at the start of a trace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StartState {
    /// Segments and their blocks.
    pub segments: Vec<StartSegment>,
    /// Addresses of blocks whose free was requested before the trace and completes in it:
    /// they start out allocated and must be freed (deferred) before the trace is replayed.
    pub pending_frees: Vec<u64>,
}

/// A block live at the start: its size if the final state knows it, and its request.
#[derive(Clone, Copy, Debug)]
struct LiveBlock {
    size: Option<u64>,
    requested: u64,
}

/// Why a recording's start state cannot be rebuilt.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StartStateError {
    /// Expandable memory mapped before the trace.
    #[error(
        "the trace starts with {mapped} bytes mapped in expandable segments; rebuilding such a start state is not supported"
    )]
    ExpandableMapped {
        /// Bytes mapped at the start (as the trace's maps and unmaps account for them).
        mapped: i128,
    },
    /// A segment whose end is beyond any address.
    #[error("segment {address:#x} of {size} bytes is impossible")]
    ImpossibleSegment {
        /// Its address.
        address: u64,
        /// Its size.
        size: u64,
    },
    /// Two segments overlap.
    #[error("segment {address:#x} overlaps the one before it")]
    OverlappingSegments {
        /// The later segment's address.
        address: u64,
    },
    /// Two live blocks overlap.
    #[error("live blocks overlap at {address:#x}")]
    OverlappingBlocks {
        /// Where.
        address: u64,
    },
    /// A live block of an exabyte or more.
    #[error("live block {address:#x} is impossibly large")]
    ImpossibleBlock {
        /// Its address.
        address: u64,
    },
    /// A live block that runs into the next one or past its segment.
    #[error("live block {address:#x} of {size} bytes runs into {next:#x}")]
    BlockRunsOver {
        /// Its address.
        address: u64,
        /// Its size.
        size: u64,
        /// Where the next block or the segment's end is.
        next: u64,
    },
    /// Live blocks outside every segment.
    #[error("{count} live blocks lie outside every segment")]
    OutsideSegments {
        /// How many.
        count: usize,
    },
}

/// Rebuilds the state at the first event of `device`'s trace.
///
/// # Errors
/// A [`StartStateError`] when the recording cannot describe a consistent start.
pub fn start_state(
    recording: &Recording,
    device: u32,
    config: &AllocatorConfig,
) -> Result<StartState, StartStateError> {
    let mut segments: BTreeMap<u64, (u64, StreamId, PoolKind, PoolId)> = BTreeMap::new();
    let mut live: BTreeMap<u64, LiveBlock> = BTreeMap::new();
    // Bytes mapped into expandable segments; walking back over their maps and unmaps must
    // bring this to zero (a trace that starts with expandable memory mapped is not rebuilt).
    let mut mapped: i128 = 0;
    let mut expandable_live: Vec<u64> = Vec::new();
    // Blocks the snapshot shows freed but waiting on other streams' events, by address.
    let mut pending_at_end: BTreeMap<u64, u64> = BTreeMap::new();
    let events = recording.trace(device);
    for seg in recording.segments.iter().filter(|s| s.device == device) {
        if seg.is_expandable {
            mapped += i128::from(seg.total_size);
            expandable_live.extend(
                seg.blocks
                    .iter()
                    .filter(|b| b.state != BlockState::Inactive)
                    .map(|b| b.address),
            );
        } else {
            segments.insert(
                seg.address,
                (seg.total_size, seg.stream, seg.pool, seg.pool_id),
            );
        }
        for b in &seg.blocks {
            if b.state == BlockState::ActivePendingFree {
                pending_at_end.insert(b.address, b.requested_size);
            }
            if b.state != BlockState::Inactive {
                live.insert(
                    b.address,
                    LiveBlock {
                        size: Some(b.size),
                        requested: b.requested_size,
                    },
                );
            }
        }
    }
    // Completions seen (walking back) whose request has not been seen yet.
    let mut awaiting_request: BTreeMap<u64, u64> = BTreeMap::new();
    for e in events.iter().rev() {
        match e.action {
            TraceAction::Alloc => {
                live.remove(&e.addr);
                pending_at_end.remove(&e.addr);
                // A completion of a block the trace allocated is no start state's, even where
                // the trace skipped its request (`skip_actions`).
                awaiting_request.remove(&e.addr);
            }
            TraceAction::FreeCompleted => {
                awaiting_request.insert(e.addr, e.size);
                pending_at_end.remove(&e.addr);
            }
            TraceAction::FreeRequested => {
                awaiting_request.remove(&e.addr);
                pending_at_end.remove(&e.addr);
                live.insert(
                    e.addr,
                    LiveBlock {
                        size: None,
                        requested: e.size,
                    },
                );
            }
            TraceAction::SegmentAlloc => {
                segments.remove(&e.addr);
            }
            TraceAction::SegmentFree => {
                let pool = if e.size == SMALL_BUFFER {
                    PoolKind::Small
                } else {
                    PoolKind::Large
                };
                // Its pool as recorded, or as inferred (Note [Inferred pools]).
                segments.insert(e.addr, (e.size, e.stream, pool, e.pool));
            }
            TraceAction::SegmentMap => mapped -= i128::from(e.size),
            TraceAction::SegmentUnmap => mapped += i128::from(e.size),
            _ => {}
        }
    }

    // A block pending at the end that the trace never allocates nor frees (the walk back
    // left it) was pending at the start too: its free was requested before the trace and
    // never completed in it.
    awaiting_request.extend(pending_at_end);
    // A completion without its request: the block was pending at the start, so occupied.
    for (&addr, &requested) in &awaiting_request {
        live.insert(
            addr,
            LiveBlock {
                size: None,
                requested,
            },
        );
    }
    if mapped != 0 || expandable_live.iter().any(|a| live.contains_key(a)) {
        return Err(StartStateError::ExpandableMapped { mapped });
    }
    let mut out = Vec::with_capacity(segments.len());
    let mut previous_end = 0;
    for (&address, &(size, stream, pool, pool_id)) in &segments {
        let end = address
            .checked_add(size)
            .filter(|_| size < ONE_EXABYTE)
            .ok_or(StartStateError::ImpossibleSegment { address, size })?;
        if address < previous_end {
            return Err(StartStateError::OverlappingSegments { address });
        }
        previous_end = end;
        let inside: Vec<(u64, LiveBlock)> =
            live.range(address..end).map(|(&a, &b)| (a, b)).collect();
        let mut blocks = Vec::new();
        let mut at = address;
        for (i, &(addr, block)) in inside.iter().enumerate() {
            if addr < at {
                return Err(StartStateError::OverlappingBlocks { address: addr });
            }
            if addr > at {
                blocks.push(RestoredBlock {
                    size: addr - at,
                    allocated: None,
                });
            }
            let next = inside.get(i + 1).map_or(end, |&(a, _)| a);
            if block.size.unwrap_or(block.requested) >= ONE_EXABYTE {
                return Err(StartStateError::ImpossibleBlock { address: addr });
            }
            let size = match block.size {
                Some(size) => size,
                None => {
                    let rounded = round_size(config, block.requested);
                    let gap = next.saturating_sub(addr.saturating_add(rounded));
                    if pool == PoolKind::Large && gap <= SMALL_SIZE {
                        rounded + gap
                    } else {
                        rounded
                    }
                }
            };
            if addr.saturating_add(size) > next {
                return Err(StartStateError::BlockRunsOver {
                    address: addr,
                    size,
                    next,
                });
            }
            blocks.push(RestoredBlock {
                size,
                allocated: Some(block.requested),
            });
            at = addr + size;
        }
        if at < end {
            blocks.push(RestoredBlock {
                size: end - at,
                allocated: None,
            });
        }
        out.push(StartSegment {
            address,
            stream,
            pool,
            pool_id,
            blocks,
        });
    }
    let placed: usize = out
        .iter()
        .map(|s| s.blocks.iter().filter(|b| b.allocated.is_some()).count())
        .sum();
    if placed != live.len() {
        return Err(StartStateError::OutsideSegments {
            count: live.len().abs_diff(placed),
        });
    }
    Ok(StartState {
        segments: out,
        pending_frees: awaiting_request.into_keys().collect(),
    })
}
