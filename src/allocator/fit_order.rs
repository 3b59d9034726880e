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
//! The order is a value of the allocator, fixed when it is built; the free set is compiled
//! once for each order ([`Key`]) and picks one per operation, never per comparison.
//!
//! # Key layout and bounds
//! The free set compares a block by one 128-bit key, its order's [`Key::key`]:
//! - address order: `size << 64 | address` (no bound);
//! - block-counter order: `size << 64 | counter` (counters are unique per block);
//! - counter order: `size / 512 << 80 | counter << 48 | address / 512`, exact while sizes
//!   and addresses are multiples of 512 below [`MAX_ADDRESS`] (2^57 = 128 PiB: every GPU's
//!   virtual address space lies below it) and counters fit 32 bits.
//!
//! The core refuses a segment that ends above [`MAX_ADDRESS`] under every order (the memory
//! is given back), and renumbers its blocks' counters densely, in order, before the
//! sequence would pass `u32::MAX`: keys never wrap. (PyTorch's signed 32-bit counter would
//! wrap after 2^31 segments, or blocks in 2.12; no recording comes near that.)

use crate::config::PyTorchVersion;

/// The largest address a segment may end at: 2^57 (128 PiB).
pub const MAX_ADDRESS: u64 = 1 << 57;

/// How a pool orders free blocks of equal size. See the module documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FitOrder {
    /// (stream, size, address): PyTorch 2.0 to 2.11.
    Address,
    /// (stream, size, block counter): PyTorch 2.12.
    BlockCounter,
    /// (stream, size, segment counter, address): PyTorch 2.13 and later.
    #[default]
    Counter,
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
}

/// An order as a type: how a free block's (size, counter, address) becomes its key.
pub(crate) trait Key {
    /// The block's key: keys compare as the order compares blocks.
    fn key(size: u64, counter: u32, ptr: u64) -> u128;
}

/// [`FitOrder::Address`] as a type.
pub(crate) struct ByAddress;

/// [`FitOrder::BlockCounter`] as a type.
pub(crate) struct ByBlockCounter;

/// [`FitOrder::Counter`] as a type.
pub(crate) struct ByCounter;

impl Key for ByAddress {
    #[inline(always)]
    fn key(size: u64, _counter: u32, ptr: u64) -> u128 {
        (u128::from(size) << 64) | u128::from(ptr)
    }
}

impl Key for ByBlockCounter {
    #[inline(always)]
    fn key(size: u64, counter: u32, _ptr: u64) -> u128 {
        (u128::from(size) << 64) | u128::from(counter)
    }
}

impl Key for ByCounter {
    #[inline(always)]
    fn key(size: u64, counter: u32, ptr: u64) -> u128 {
        debug_assert!(size < MAX_ADDRESS && ptr < MAX_ADDRESS);
        // Built from its two 64-bit halves: no shift crosses them.
        let counter = u64::from(counter);
        let high = ((size >> 9) << 16) | (counter >> 16);
        let low = ((counter & 0xffff) << 48) | (ptr >> 9);
        (u128::from(high) << 64) | u128::from(low)
    }
}

/// Runs `$body` with `$k` the type of `$order`: one branch, then code compiled for that order.
macro_rules! by_order {
    ($order:expr, $k:ident => $body:expr) => {
        match $order {
            $crate::allocator::fit_order::FitOrder::Address => {
                type $k = $crate::allocator::fit_order::ByAddress;
                $body
            }
            $crate::allocator::fit_order::FitOrder::BlockCounter => {
                type $k = $crate::allocator::fit_order::ByBlockCounter;
                $body
            }
            $crate::allocator::fit_order::FitOrder::Counter => {
                type $k = $crate::allocator::fit_order::ByCounter;
                $body
            }
        }
    };
}
pub(crate) use by_order;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_keys_order_by_size_then_counter_then_address() {
        let top = MAX_ADDRESS - 512;
        let triples = [
            (512, 0, 0),
            (512, 0, top),
            (512, 1, 512),
            (512, u32::MAX, 0),
            (1024, 0, 0),
            (top, 0, 0),
            (top, u32::MAX, top),
        ];
        for pair in triples.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            assert!(
                ByCounter::key(a.0, a.1, a.2) < ByCounter::key(b.0, b.1, b.2),
                "{a:?} < {b:?}"
            );
        }
        // The address order ignores the counter, the block-counter order the address.
        assert!(ByAddress::key(512, 9, 512) < ByAddress::key(512, 0, 1024));
        assert!(ByBlockCounter::key(512, 0, 1024) < ByBlockCounter::key(512, 9, 512));
        assert!(ByBlockCounter::key(512, u32::MAX, 0) < ByBlockCounter::key(1024, 0, 0));
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
