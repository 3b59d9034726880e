//! Memory snapshots in PyTorch's schema (`torch.cuda.memory._snapshot()`), as plain data that
//! serializes with serde to the same JSON shape the PyTorch memory viewer reads.

use serde::Serialize;

use crate::config::AllocatorSettings;

use super::history::TraceEntry;

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

/// A stack frame (gpumem records none; the field keeps PyTorch's schema).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Frame {
    /// Source file.
    pub filename: String,
    /// Line number.
    pub line: u32,
    /// Function name.
    pub name: String,
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
    pub frames: Vec<Frame>,
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
    pub stream: u64,
    /// `"small"` or `"large"`.
    pub segment_type: &'static str,
    /// Private pool id; `(0, 0)` for the default pools.
    pub segment_pool_id: (u64, u64),
    /// Whether the segment is an expandable one.
    pub is_expandable: bool,
    /// Stack at segment creation (always empty).
    pub frames: Vec<Frame>,
    /// Blocks in address order.
    pub blocks: Vec<BlockInfo>,
}

/// The device a snapshot was taken on: not in PyTorch's snapshots, but needed to replay one
/// faithfully (OOMs, garbage collection and flushes depend on it).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SimulatedDeviceInfo {
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
    pub simulated_device: Option<SimulatedDeviceInfo>,
}
