//! Which free block a best fit takes among blocks of one size: the order of PyTorch's pools.
//!
//! PyTorch keeps each pool's free blocks in a `std::set` and `get_free_block` takes the
//! first block at or after (stream, size). Sizes and streams order every release alike;
//! among blocks of one size the comparator decides, and it changed:
//! - [`FitOrder::Address`], PyTorch 2.0 to 2.11: (stream, size, address). The block at the
//!   lowest address wins.
//! - [`FitOrder::BlockCounter`], PyTorch 2.12 (pytorch/pytorch#178362): (stream, size,
//!   counter), the counter taken by every new block: each segment, the front piece a split
//!   hands out, the unmapped rest of a mapping and the pieces an unmapping leaves. The block
//!   that kept its counter longest wins.
//! - [`FitOrder::Counter`], PyTorch 2.13 and later (pytorch/pytorch#183591):
//!   (stream, size, counter, address). The counter is taken when backing memory is obtained
//!   (each segment from the driver, each new expandable segment) and inherited by every block
//!   carved from it, so the block of the older segment wins.
//!
//! In PyTorch the counter is one process-wide 32-bit sequence starting at 0; per device
//! here, which orders one device's blocks alike. (Established from the released wheels'
//! `libc10_cuda.so`: 2.11.0 has `BlockComparatorSize`, 2.12.0 and 2.12.1
//! `BlockComparatorRegistrationCounter` incremented at every new block, 2.13.0 to 2.15.0
//! `BlockComparatorSizeCounterAddress` incremented only in `alloc_block`.)
//!
//! Driver addresses do not follow creation order (a freed range is handed out again), so the
//! two orders place blocks differently on real recordings.
//!
//! The order is a value of the allocator, fixed when it is built. It decides one number per
//! free block, its tie-break ([`FitOrder::tie`]), computed once when the block enters its
//! pool's free set; every comparison is then the same branch-free compare of
//! `size << 64 | tie` whatever the order, so no comparison depends on it.
//!
//! # Tie-break layout and bounds
//! - address order: the address (no bound);
//! - block-counter order: the counter (counters are unique per block);
//! - counter order: `counter << 40 | address / 512`, exact while addresses are multiples of 512
//!   below [`MAX_ADDRESS`] (2^49 = 512 TiB: every GPU's virtual address space lies below it,
//!   48-bit on x86-64 and Arm) and counters below [`SEGMENT_COUNTERS`] (2^24).
//!
//! In the counter order the core refuses a segment that ends above [`MAX_ADDRESS`] (the
//! memory is given back). It renumbers its counters densely, in order, before the sequence
//! would pass its limit (2^24 segments in the counter order, 2^32 blocks in the
//! block-counter order), and refuses a new segment only when the live ones alone would fill
//! the counters (16 million live segments of at least 2 MiB, 32 TiB, in the counter order).
//! Tie-breaks never wrap. (PyTorch's signed 32-bit counter would wrap after 2^31 segments,
//! or blocks in 2.12; no recording comes near that.)

use crate::config::PyTorchVersion;

/// The largest address a segment may end at: 2^49 (512 TiB).
pub const MAX_ADDRESS: u64 = 1 << 49;

/// Counters the counter order's tie-break holds: 2^24.
pub const SEGMENT_COUNTERS: u32 = 1 << 24;

/// How a pool orders free blocks of equal size. See the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FitOrder {
    /// (stream, size, address): PyTorch 2.0 to 2.11.
    Address,
    /// (stream, size, block counter): PyTorch 2.12.
    BlockCounter,
    /// (stream, size, segment counter, address): PyTorch 2.13 and later.
    Counter,
}

/// The order of the newest release gpumem follows.
impl Default for FitOrder {
    fn default() -> Self {
        FitOrder::of(PyTorchVersion::LATEST)
    }
}

impl FitOrder {
    /// The order of PyTorch `version`'s pools.
    pub fn of(version: PyTorchVersion) -> FitOrder {
        match version.minor() {
            ..=11 => FitOrder::Address,
            12 => FitOrder::BlockCounter,
            _ => FitOrder::Counter,
        }
    }

    /// `address`, `block_counter` or `counter`, as `--json` reports it.
    pub fn name(self) -> &'static str {
        match self {
            FitOrder::Address => "address",
            FitOrder::BlockCounter => "block_counter",
            FitOrder::Counter => "counter",
        }
    }

    /// The order in words.
    pub fn describe(self) -> &'static str {
        match self {
            FitOrder::Address => "the ordering of PyTorch 2.11 and before (address)",
            FitOrder::BlockCounter => "the ordering of PyTorch 2.12 (block counter)",
            FitOrder::Counter => "the PyTorch 2.13+ ordering (segment allocation counter)",
        }
    }

    /// Whether a block carved from another takes a counter of its own (else it inherits).
    pub fn pieces_take_counters(self) -> bool {
        self == FitOrder::BlockCounter
    }

    /// How many counters the order's tie-break holds: the sequence is renumbered before it
    /// reaches this.
    pub fn counter_limit(self) -> u32 {
        match self {
            FitOrder::Counter => SEGMENT_COUNTERS,
            FitOrder::Address | FitOrder::BlockCounter => u32::MAX,
        }
    }

    /// The tie-break of a free block with this counter and address: among blocks of one
    /// stream and size, the smaller comes first (layout and bounds in the module doc).
    #[inline(always)]
    pub fn tie(self, counter: u32, ptr: u64) -> u64 {
        match self {
            FitOrder::Address => ptr,
            FitOrder::BlockCounter => u64::from(counter),
            FitOrder::Counter => {
                debug_assert!(counter < SEGMENT_COUNTERS && ptr < MAX_ADDRESS);
                (u64::from(counter) << 40) | (ptr >> 9)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_order_as_each_release_compares() {
        let top = MAX_ADDRESS - 512;
        let last = SEGMENT_COUNTERS - 1;
        // The counter order: by counter, then address, over the whole bounded range.
        let pairs = [
            (0, 0),
            (0, 512),
            (0, top),
            (1, 0),
            (1, top),
            (last, 0),
            (last, top),
        ];
        for w in pairs.windows(2) {
            let (a, b) = (w[0], w[1]);
            let tie = |(c, p)| FitOrder::Counter.tie(c, p);
            assert!(tie(a) < tie(b), "{a:?} < {b:?}");
        }
        // The address order ignores the counter, the block-counter order the address.
        assert!(FitOrder::Address.tie(9, 512) < FitOrder::Address.tie(0, 1024));
        assert!(FitOrder::BlockCounter.tie(0, 1024) < FitOrder::BlockCounter.tie(9, 512));
        assert!(
            FitOrder::BlockCounter.tie(u32::MAX - 1, 0) < FitOrder::BlockCounter.tie(u32::MAX, 0)
        );
    }

    #[test]
    fn versions_map_to_orders() {
        let order = |minor| FitOrder::of(PyTorchVersion::new(2, minor).expect("valid"));
        assert_eq!(order(0), FitOrder::Address);
        assert_eq!(order(11), FitOrder::Address);
        assert_eq!(order(12), FitOrder::BlockCounter);
        assert_eq!(order(13), FitOrder::Counter);
        assert_eq!(order(15), FitOrder::Counter);
    }
}
