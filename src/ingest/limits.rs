//! The budgets of a push: what one payload may hold, and the series it adds. A leaf of the
//! ingest (it names nothing else of it): validation ([`super::payload`], [`super::oom`]) and
//! the store read them, and the push hook's copies are checked against them.

/// The largest payload accepted: a push of 16 devices' statistics is about 100 KiB.
pub const MAX_BODY_BYTES: usize = 512 * 1024;
/// Devices in one push: more than any node has GPUs.
pub const MAX_DEVICES: usize = 16;
/// Statistics keys per device (PyTorch's `memory_stats()` has about 120).
pub const MAX_STATS_KEYS: usize = 512;
/// Bytes (UTF-8) of a text field or label value.
pub const MAX_TEXT: usize = 128;
/// Characters of a label name.
pub const MAX_LABEL_NAME: usize = 64;
/// Labels a push may carry: a job's own and the four of torchrun's rank identity.
pub const MAX_LABELS: usize = 12;
/// Bytes of a push's labels together, names and values: they are copied onto every series
/// of the process.
pub const MAX_LABEL_BYTES: usize = 512;
/// Keys of a push's `host` object (PyTorch's `host_memory_stats()` has about 40).
pub const MAX_HOST_KEYS: usize = 64;
/// Series of a process's pinned host memory: one per figure.
pub const HOST_SERIES: usize = 7;
/// Size classes are powers of two: 64 cover every `u64`.
pub const MAX_CLASSES: usize = 64;
/// Byte figures are below this: an exabyte, the request size the allocator refuses outright.
pub const MAX_BYTES: i64 = crate::allocator::size::ONE_EXABYTE as i64;
/// Counts are below this: exact as a float.
pub const MAX_COUNT: i64 = 1 << 53;
/// The largest pid Linux hands out (`PID_MAX_LIMIT`).
pub const MAX_PID: u32 = 1 << 22;
/// Series of one device without size classes: six per pool, eleven per device, the largest
/// free block and its age, the last OOM's time, the memory limit and the info series.
pub(super) const SERIES_PER_DEVICE: usize = 2 * 6 + 11 + 5;
/// Series of a device's OOM explanation: one per part of the breakdown.
pub const OOM_BREAKDOWN_SERIES: usize = 7;
/// (pool, stream) entries in one OOM push: both pools on 32 streams.
pub const MAX_POOLS: usize = 64;

/// The bound of a pushed figure named `key`, and how to say it: bytes below [`MAX_BYTES`],
/// counts (and microseconds) below [`MAX_COUNT`].
pub fn bound_of(key: &str) -> (i64, &'static str) {
    if key.contains("bytes") || key == "max_split_size" {
        (MAX_BYTES, "2^60 bytes")
    } else {
        (MAX_COUNT, "2^53")
    }
}
