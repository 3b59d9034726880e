//! PyTorch's CUDA caching allocator design in C++17 (`src/pytorch_design.cpp`), behind a safe
//! handle: the peer of gpumem's core in `benches/allocator.rs`. It makes the decisions
//! gpumem makes on its simulated GPU (same rounding, pools, best fit, splits, merges, segment
//! sizes and addresses, statistics) with PyTorch's data structures and locks, so that the
//! benchmark prices the implementation, not different work; the benchmark checks that both
//! return the same addresses and statistics before it times them.
//!
//! Only benchmarks and tests depend on this crate, so gpumem's own builds compile no C++.
//! Not covered (the benchmark's recordings never need them): stream events, expandable
//! segments, garbage collection, and the release-and-retry path on out-of-memory.

use std::ffi::c_void;

// The C++ side's entry points (`src/pytorch_design.cpp`); every call below says why it is
// sound.
#[allow(unsafe_code)]
unsafe extern "C" {
    fn gpumem_baseline_new(capacity: u64, counter_order: i32) -> *mut c_void;
    fn gpumem_baseline_delete(allocator: *mut c_void);
    fn gpumem_baseline_malloc(allocator: *mut c_void, size: u64, stream: u64) -> u64;
    fn gpumem_baseline_free(allocator: *mut c_void, ptr: u64) -> i32;
    fn gpumem_baseline_stats(allocator: *mut c_void, out: *mut i64);
}

/// The names of the statistics, in the order [`PytorchDesign::stats`] gives them: PyTorch's
/// `memory_stats()` keys.
pub fn stat_names() -> Vec<String> {
    let mut names = Vec::new();
    for stat in [
        "allocation",
        "segment",
        "active",
        "inactive_split",
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
    ] {
        for pool in ["all", "small_pool", "large_pool"] {
            for field in ["current", "peak", "allocated", "freed"] {
                names.push(format!("{stat}.{pool}.{field}"));
            }
        }
    }
    for counter in [
        "num_device_alloc",
        "num_device_free",
        "num_ooms",
        "num_oom_rejections",
    ] {
        names.push(counter.into());
    }
    names
}

/// Statistics the C++ side reports.
const STATS: usize = 9 * 3 * 4 + 4;

/// One allocator of the C++ design on a simulated device.
pub struct PytorchDesign {
    raw: *mut c_void,
}

// SAFETY: the C++ allocator is not tied to the thread that made it, and it locks its own
// state (a recursive mutex and sharded mutexes, as PyTorch's); `raw` is owned by this handle
// alone, so moving the handle to another thread moves the only user of the pointer.
#[allow(unsafe_code)]
unsafe impl Send for PytorchDesign {}

#[allow(unsafe_code)] // calls into C++, each with its SAFETY comment
impl PytorchDesign {
    /// An allocator over a device of `capacity` bytes whose pools order free blocks by
    /// (stream, size, address), as PyTorch 2.11 and before.
    pub fn new(capacity: u64) -> PytorchDesign {
        PytorchDesign::with_counter_order(capacity, false)
    }

    /// An allocator over a device of `capacity` bytes; with `counter_order`, its pools order
    /// free blocks by (stream, size, segment counter, address), as PyTorch 2.13 and later.
    pub fn with_counter_order(capacity: u64, counter_order: bool) -> PytorchDesign {
        // SAFETY: the constructor takes plain integers and returns an owned pointer.
        let raw = unsafe { gpumem_baseline_new(capacity, i32::from(counter_order)) };
        assert!(!raw.is_null(), "the C++ allocator was created");
        PytorchDesign { raw }
    }

    /// Allocates `size` bytes on `stream`; its address, or `None` when the device is full.
    pub fn malloc(&mut self, size: u64, stream: u64) -> Option<u64> {
        // SAFETY: `raw` is live until drop, and the call only reads its arguments.
        let ptr = unsafe { gpumem_baseline_malloc(self.raw, size, stream) };
        (ptr != 0).then_some(ptr)
    }

    /// Frees the block at `ptr`; whether it was allocated.
    pub fn free(&mut self, ptr: u64) -> bool {
        // 0 is no block's address (the C++ table also refuses it).
        ptr != 0
            // SAFETY: `raw` is live until drop; an unknown address is refused, not
            // dereferenced.
            && unsafe { gpumem_baseline_free(self.raw, ptr) == 0 }
    }

    /// The statistics, named by [`stat_names`].
    pub fn stats(&self) -> Vec<i64> {
        let mut out = vec![0i64; STATS];
        // SAFETY: `out` holds exactly the STATS values the call writes.
        unsafe { gpumem_baseline_stats(self.raw, out.as_mut_ptr()) };
        out
    }
}

#[allow(unsafe_code)] // the C++ destructor
impl Drop for PytorchDesign {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `gpumem_baseline_new` and is deleted once.
        unsafe { gpumem_baseline_delete(self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_splits_merges_and_counts() {
        let mut a = PytorchDesign::new(1 << 30);
        let p = a.malloc(1000, 0).expect("fits");
        let q = a.malloc(1000, 0).expect("fits");
        assert_eq!(p, 0x7f00_0000_0000, "the simulated device's first address");
        assert_eq!(q, p + 1024, "split from the same 2 MiB small segment");
        assert!(a.free(p) && a.free(q));
        assert!(!a.free(q), "a second free is refused");
        assert!(!a.free(0) && !a.free(12345), "no block there");
        let names = stat_names();
        let stats = a.stats();
        let get = |key: &str| stats[names.iter().position(|n| n == key).expect(key)];
        assert_eq!(get("segment.all.current"), 1);
        assert_eq!(get("reserved_bytes.small_pool.current"), 2 << 20);
        assert_eq!(get("allocated_bytes.all.peak"), 2048);
        assert_eq!(get("requested_bytes.all.peak"), 2000);
        assert_eq!(get("inactive_split.all.current"), 0, "merged back whole");
        assert_eq!(get("num_device_alloc"), 1);
        assert!(a.malloc(2 << 30, 0).is_none(), "more than the device");
        assert!(a.malloc(u64::MAX - 100, 0).is_none(), "no overflow");
        assert!(a.malloc(0, 0).is_none());
        let stats = a.stats();
        let get = |key: &str| stats[names.iter().position(|n| n == key).expect(key)];
        assert_eq!(
            get("num_ooms"),
            2,
            "each refused request, not the empty one"
        );
        assert_eq!(
            get("num_oom_rejections"),
            0,
            "no memory fraction to refuse at"
        );
    }
}
