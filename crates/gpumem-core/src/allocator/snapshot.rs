//! Memory snapshots in PyTorch's schema (`torch.cuda.memory._snapshot()`), as plain data that
//! serializes with serde to the same JSON shape the PyTorch memory viewer reads, and the
//! builder that reads them off the allocator's blocks.
//!
//! # Invariants
//! - Segments are listed by address; an expandable segment shows as one segment per
//!   contiguous run of mapped blocks (as PyTorch shows it), and unmapped blocks never appear.
//! - A segment's `total_size` is the sum of its blocks; `allocated_size`, `active_size` and
//!   `requested_size` sum the allocated, active (allocated or pending) blocks.
//! - [`CachingAllocator::segments_by_size`] counts the same runs as the snapshot does.

use serde::Serialize;

use crate::config::AllocatorSettings;
use crate::device::{Device, StreamId};

use super::block::Block;
use super::history::{TraceAction, TraceEntry};
use super::size::PoolKind;
use super::{CachingAllocator, PoolId, summary};

/// The segments of one size class: sizes in `(size / 2, size]`, `size` a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentClass {
    /// The class's upper bound (bytes).
    pub size: u64,
    /// Segments in the class.
    pub segments: u64,
    /// Free (inactive) bytes in them: reserved memory that only requests up to the largest
    /// free block can use.
    pub free_bytes: u64,
}

/// Segments by size class, smallest class first, from each segment's `(total, free)` bytes.
pub fn segment_classes(segments: impl IntoIterator<Item = (u64, u64)>) -> Vec<SegmentClass> {
    let mut classes: Vec<SegmentClass> = Vec::new();
    for (total, free) in segments {
        let size = total.checked_next_power_of_two().unwrap_or(1 << 63);
        match classes.iter_mut().find(|c| c.size == size) {
            Some(class) => {
                class.segments += 1;
                class.free_bytes += free;
            }
            None => classes.push(SegmentClass {
                size,
                segments: 1,
                free_bytes: free,
            }),
        }
    }
    classes.sort_by_key(|c| c.size);
    classes
}

/// State of a block in a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Handed out.
    ActiveAllocated,
    /// Freed by the user, waiting on other streams.
    ActivePendingFree,
    /// Free.
    Inactive,
}

/// The stack frames of a segment or block: gpumem records none, so this serialises as
/// PyTorch's empty `frames` list (a recording's frames are the trace reader's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoFrames;

impl Serialize for NoFrames {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(std::iter::empty::<()>())
    }
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    /// Address.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Unrounded size of the last request served (stale for free blocks, 0 if never used).
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
    /// Stack at hand-out (always empty).
    pub frames: NoFrames,
}

/// One segment (for expandable segments: one contiguous mapped range).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentInfo {
    /// Device index.
    pub device: u32,
    /// Address of the first block.
    pub address: u64,
    /// Sum of block sizes.
    pub total_size: u64,
    /// Sum of allocated block sizes.
    pub allocated_size: u64,
    /// Sum of active (allocated or pending-free) block sizes.
    pub active_size: u64,
    /// Sum of requested sizes of active blocks.
    pub requested_size: u64,
    /// Stream of the first block.
    pub stream: StreamId,
    /// The pool's size class (`"small"` or `"large"`).
    pub segment_type: PoolKind,
    /// Private pool id; `(0, 0)` for the default pools.
    pub segment_pool_id: PoolId,
    /// Whether the segment is an expandable one.
    pub is_expandable: bool,
    /// Stack at segment creation (always empty).
    pub frames: NoFrames,
    /// Blocks in address order.
    pub blocks: Vec<BlockInfo>,
}

/// The device a snapshot was taken on: not in PyTorch's snapshots, but needed to replay one
/// faithfully (OOMs, garbage collection and flushes depend on it). gpumem's snapshots write
/// it; the trace reader reads it back where a file has it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SimulatedDevice {
    /// Device memory in bytes.
    pub total_bytes: u64,
    /// The per-process memory fraction, if one was set.
    pub memory_fraction: Option<f64>,
    /// The per-process limit in bytes, if one was set.
    pub allowed_memory_maximum: Option<u64>,
}

/// A whole snapshot.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshot {
    /// Segments sorted by address.
    pub segments: Vec<SegmentInfo>,
    /// One trace per device (this allocator's device only).
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The configuration in force.
    pub allocator_settings: AllocatorSettings,
    /// The device, when it could be queried.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulated_device: Option<SimulatedDevice>,
}

impl Block {
    /// The block's state as a snapshot shows it.
    pub(super) fn snapshot_state(&self) -> BlockState {
        if self.allocated() {
            BlockState::ActiveAllocated
        } else if self.is_pending_free() {
            BlockState::ActivePendingFree
        } else {
            BlockState::Inactive
        }
    }
}

impl<D: Device> CachingAllocator<D> {
    /// The contiguous mapped runs of blocks, segment by segment in address order: a plain
    /// segment is one run, an expandable segment one per run of mapped blocks.
    pub(super) fn mapped_runs(&self) -> Vec<Vec<&Block>> {
        let mut runs = Vec::new();
        for head in self.segment_heads() {
            let mut run = Vec::new();
            for (_, b) in self.segment_blocks(head) {
                if b.mapped() {
                    run.push(b);
                } else if !run.is_empty() {
                    runs.push(std::mem::take(&mut run));
                }
            }
            if !run.is_empty() {
                runs.push(run);
            }
        }
        runs
    }

    /// Segments by size class with their free bytes, as a snapshot would count them (an
    /// expandable segment counts once per contiguous mapped run).
    pub fn segments_by_size(&self) -> Vec<SegmentClass> {
        segment_classes(self.mapped_runs().into_iter().map(|run| {
            let total = run.iter().map(|b| b.size).sum();
            let free = run
                .iter()
                .filter(|b| b.snapshot_state() == BlockState::Inactive)
                .map(|b| b.size)
                .sum();
            (total, free)
        }))
    }

    /// The segments (a mapped run of an expandable segment counts as one) and their blocks,
    /// as [`CachingAllocator::snapshot`] lists them, without recording anything: what a live
    /// view reads.
    pub fn segment_infos(&self) -> Vec<SegmentInfo> {
        let device = self.device.index();
        self.mapped_runs()
            .into_iter()
            .map(|run| {
                let first = run[0];
                let mut segment = SegmentInfo {
                    device,
                    address: first.ptr,
                    total_size: 0,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    stream: first.stream,
                    segment_type: first.pool,
                    segment_pool_id: self.private.id_of(first.owner),
                    is_expandable: first.expandable.is_some(),
                    frames: NoFrames,
                    blocks: Vec::with_capacity(run.len()),
                };
                for b in run {
                    let state = b.snapshot_state();
                    segment.total_size += b.size;
                    if b.allocated() {
                        segment.allocated_size += b.size;
                    }
                    if state != BlockState::Inactive {
                        segment.active_size += b.size;
                        segment.requested_size += b.requested_size;
                    }
                    segment.blocks.push(BlockInfo {
                        address: b.ptr,
                        size: b.size,
                        requested_size: b.requested_size,
                        state,
                        frames: NoFrames,
                    });
                }
                segment
            })
            .collect()
    }

    /// The segments and blocks (`torch.cuda.memory_snapshot()`), plus the trace and the
    /// settings (`torch.cuda.memory._snapshot()`). Records a `snapshot` trace entry, which
    /// appears in the next snapshot's trace, as in PyTorch.
    pub fn snapshot(&mut self) -> Snapshot {
        let trace = self.history.entries();
        let segments = self.segment_infos();
        let active: u64 = segments.iter().map(|s| s.active_size).sum();
        self.record(
            TraceAction::Snapshot,
            0,
            active,
            StreamId::DEFAULT,
            super::PoolSlot::DEFAULT,
        );
        let simulated_device = self.device.mem_get_info().ok().map(|info| SimulatedDevice {
            total_bytes: info.total,
            memory_fraction: self.memory_fraction,
            allowed_memory_maximum: self.allowed_memory_maximum,
        });
        Snapshot {
            segments,
            device_traces: vec![trace],
            allocator_settings: self.config.settings(),
            simulated_device,
        }
    }

    /// `torch.cuda.memory_summary()`: PyTorch's text table of the statistics.
    pub fn memory_summary(&self, abbreviated: bool) -> String {
        summary::memory_summary(self.device.index(), &self.stats, abbreviated)
    }
}
