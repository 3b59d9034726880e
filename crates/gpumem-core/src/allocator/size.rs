//! Size policy as pure functions: request rounding, pool choice, segment sizes, which cached
//! block may serve a request and whether it is split, and the human-readable sizes of
//! PyTorch's messages.
//!
//! # Invariants
//! - Every rounded size is a positive multiple of [`MIN_BLOCK_SIZE`] at or above the request.
//! - A split always leaves a remainder of at least [`MIN_BLOCK_SIZE`] bytes.

use crate::config::AllocatorConfig;

/// Every block is a multiple of this many bytes (`kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Rounded requests up to this size go to the small pool (`kSmallSize`).
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool (`kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`] (`kLargeBuffer`) and the default
/// slack an oversize request may waste when it reuses a cached oversize block; from 2.11 both
/// are configurable (`large_segment_size_mb`, `max_non_split_rounding_mb`).
pub const LARGE_BUFFER: u64 = crate::config::DEFAULT_LARGE_SEGMENT_SIZE;
/// Large requests of at least this size get a segment of their own size (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Granularity of segments for requests of [`MIN_LARGE_ALLOC`] and more (`kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 << 20;
/// Requests of this size or more fail at once: no device has an exabyte.
pub const ONE_EXABYTE: u64 = 1 << 60;
/// The largest device gpumem models (a simulated one, a replay's, a plan's region): 64 PiB,
/// far beyond any GPU, small enough that no byte count derived from it overflows.
pub const MAX_DEVICE_BYTES: u64 = 1 << 56;

/// Which of the two default pools a block belongs to; `"small"` or `"large"` in JSON.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum PoolKind {
    /// Rounded sizes up to 1 MiB, in 2 MiB segments.
    Small = 0,
    /// Everything larger.
    Large = 1,
}

impl std::fmt::Display for PoolKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.segment_type())
    }
}

impl PoolKind {
    /// 0 for the small pool, 1 for the large: an index into a pair, so that choosing by
    /// kind (which alternates unpredictably on the hot path) needs no branch.
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }

    /// The pool for a rounded request size.
    pub fn for_size(rounded: u64) -> PoolKind {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// PyTorch's name of the pool in stats keys (`small_pool` / `large_pool`).
    pub fn stat_name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }

    /// The snapshot `segment_type` (`small` / `large`).
    pub fn segment_type(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// Rounds a request as `round_size` does: to 512 bytes, or to the next of `d` divisions of its
/// power-of-two interval when `roundup_power2_divisions` gives `d > 1` for it.
pub fn round_size(config: &AllocatorConfig, size: u64) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let divisions = config.divisions_for(size);
    if divisions > 1 && size > MIN_BLOCK_SIZE.saturating_mul(divisions) {
        return roundup_power2_next_division(size, divisions);
    }
    size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
}

/// The next multiple of `floor_pow2(size) / divisions` at or above `size`.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << size.ilog2();
    let step = floor >> divisions.ilog2();
    if step == 0 {
        return floor * 2;
    }
    let truncated = size & !(step - 1);
    if truncated == size {
        size
    } else {
        truncated + step
    }
}

/// `bytes` rounded up to a multiple of 2 MiB ([`ROUND_LARGE`]), the granularity of large
/// segments (saturating).
pub fn round_to_large(bytes: u64) -> u64 {
    bytes.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
}

/// Size of a new segment for a rounded request (`get_allocation_size`): 2 MiB for the small
/// pool, `large_segment_size` (20 MiB unless configured) up to 10 MiB, else the request
/// rounded up to 2 MiB.
pub fn allocation_size(config: &AllocatorConfig, rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        config.large_segment_size
    } else {
        round_to_large(rounded)
    }
}

/// The physical page of an expandable segment of `pool`: 2 MiB in the small pool,
/// `large_segment_size` in the large one, rounded up to a multiple of 2 MiB (physical
/// memory comes in those; PyTorch's `cuMemCreate` would refuse a size that is not one).
pub fn expandable_page_size(config: &AllocatorConfig, pool: PoolKind) -> u64 {
    match pool {
        PoolKind::Small => SMALL_BUFFER,
        PoolKind::Large => config.large_segment_size.next_multiple_of(SMALL_BUFFER),
    }
}

/// Whether a cached free block of `found` bytes may serve a rounded request of `size` bytes
/// (the `max_split_size` rules of `get_free_block`): a normal request never takes an oversize
/// block; an oversize request takes one only if it wastes less than `max_non_split_rounding`
/// ([`LARGE_BUFFER`] unless configured).
pub fn fits(found: u64, size: u64, max_split_size: u64, max_non_split_rounding: u64) -> bool {
    if size < max_split_size {
        found < max_split_size
    } else {
        found < size.saturating_add(max_non_split_rounding)
    }
}

/// Whether a found block of `block_size` bytes is split for a rounded request of `size`
/// bytes (`should_split`). Small-pool blocks split when at least [`MIN_BLOCK_SIZE`] would
/// remain; large-pool blocks when the request is not oversize and more than [`SMALL_SIZE`]
/// would remain. Quirk kept from PyTorch: with expandable segments in effect every block
/// follows the small-pool rule, not only blocks of expandable segments.
pub fn should_split(
    block_size: u64,
    size: u64,
    pool: PoolKind,
    expandable_segments: bool,
    max_split_size: u64,
) -> bool {
    let remaining = block_size - size;
    if pool == PoolKind::Small || expandable_segments {
        remaining >= MIN_BLOCK_SIZE
    } else {
        size < max_split_size && remaining > SMALL_SIZE
    }
}

/// Formats a byte count as PyTorch's OOM messages do: "1024 bytes", "1.00 KiB", "2.00 MiB",
/// "1.00 GiB" (two decimals, switching unit only above 1024 of the smaller one).
pub fn format_size(bytes: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes <= KIB {
        format!("{bytes} bytes")
    } else if bytes <= MIB {
        format!("{:.2} KiB", bytes as f64 / KIB as f64)
    } else if bytes <= GIB {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_pool_kind_is_written_by_its_segment_type() {
        for kind in [PoolKind::Small, PoolKind::Large] {
            let json = serde_json::to_value(kind).expect("serialises");
            assert_eq!(json, kind.segment_type());
            assert_eq!(serde_json::from_value::<PoolKind>(json).ok(), Some(kind));
        }
    }

    #[test]
    fn rounding_and_classification_table() {
        let c = AllocatorConfig::default();
        // request → (rounded, pool, new segment size): scenario 4 (`tests/it/scenarios.rs`).
        for (req, rounded, pool, seg) in [
            (1, 512, PoolKind::Small, 2 * MIB),
            (511, 512, PoolKind::Small, 2 * MIB),
            (513, 1024, PoolKind::Small, 2 * MIB),
            (MIB, MIB, PoolKind::Small, 2 * MIB),
            (MIB + 1, 1_049_088, PoolKind::Large, 20 * MIB),
            (9 * MIB, 9 * MIB, PoolKind::Large, 20 * MIB),
            (10 * MIB - 1, 10 * MIB, PoolKind::Large, 10 * MIB),
            (10 * MIB, 10 * MIB, PoolKind::Large, 10 * MIB),
            (10 * MIB + 1, 10_486_272, PoolKind::Large, 12 * MIB),
            (11 * MIB, 11 * MIB, PoolKind::Large, 12 * MIB),
        ] {
            let r = round_size(&c, req);
            assert_eq!(r, rounded, "round_size({req})");
            assert_eq!(PoolKind::for_size(r), pool, "pool of {req}");
            assert_eq!(allocation_size(&c, r), seg, "segment for {req}");
        }
    }

    #[test]
    fn power2_divisions_single_value() {
        // Scenario 15 (`tests/it/scenarios.rs`).
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").expect("valid");
        for (req, want) in [
            (1200, 1536),
            (2048, 2048),
            (2049, 2560),
            (5000, 5120),
            (4096, 4096),
            (3_145_729, 3_670_016),
            (1_048_577, 1_310_720),
        ] {
            assert_eq!(round_size(&c, req), want, "round_size({req})");
        }
        assert_eq!(
            PoolKind::for_size(round_size(&c, 1_048_577)),
            PoolKind::Large
        );
    }

    #[test]
    fn power2_divisions_list_quirk() {
        // Scenario 16 (`tests/it/scenarios.rs`): up to 2.9, 1100 MiB falls in the 1 GiB interval, which `>` set to
        // 8; from 2.10 `>` leaves that interval its 4 divisions.
        let list = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]";
        let old = AllocatorConfig::parse_for(
            list,
            crate::config::Syntax::PyTorch,
            crate::config::PyTorchVersion::new(2, 9).expect("known"),
        )
        .expect("valid");
        let new = AllocatorConfig::parse(list).expect("valid");
        for (req, want_old, want_new) in [
            (300 * MIB, 300 * MIB, 300 * MIB),
            (600 * MIB, 768 * MIB, 768 * MIB),
            (1100 * MIB, 1152 * MIB, 1280 * MIB),
            (1536 * MIB, 1536 * MIB, 1536 * MIB),
            (2100 * MIB, 2304 * MIB, 2304 * MIB),
        ] {
            assert_eq!(round_size(&old, req), want_old, "2.9: {} MiB", req / MIB);
            assert_eq!(round_size(&new, req), want_new, "2.15: {} MiB", req / MIB);
        }
    }

    #[test]
    fn huge_divisions_do_not_overflow() {
        let c = AllocatorConfig {
            roundup_power2_divisions: [1 << 62; 16],
            ..AllocatorConfig::default()
        };
        assert_eq!(
            round_size(&c, 5000),
            5120,
            "no division fits: plain 512-byte rounding"
        );
    }

    #[test]
    fn fit_rule_table() {
        const UNLIMITED: u64 = u64::MAX;
        // (found, request, max_split_size) → may serve
        for (found, size, max_split, want) in [
            (4 * MIB, 2 * MIB, UNLIMITED, true),
            (200 * MIB, 2 * MIB, 100 * MIB, false), // normal request, oversize block
            (99 * MIB, 2 * MIB, 100 * MIB, true),
            (100 * MIB, 100 * MIB, 100 * MIB, true), // oversize request, exact fit
            (119 * MIB, 100 * MIB, 100 * MIB, true), // wastes 19 MiB < 20 MiB
            (120 * MIB, 100 * MIB, 100 * MIB, false), // wastes exactly LARGE_BUFFER
            (u64::MAX, u64::MAX - 1, 100 * MIB, false), // saturates, no overflow
        ] {
            assert_eq!(
                fits(found, size, max_split, LARGE_BUFFER),
                want,
                "fits({found}, {size}, {max_split})"
            );
        }
    }

    #[test]
    fn split_rule_table() {
        const UNLIMITED: u64 = u64::MAX;
        use PoolKind::{Large, Small};
        // (block, request, pool, expandable, max_split_size) → split
        for (block, size, pool, expandable, max_split, want) in [
            (2 * MIB, 2 * MIB - 512, Small, false, UNLIMITED, true), // 512 B remain
            (2 * MIB, 2 * MIB - 511, Small, false, UNLIMITED, false),
            (2 * MIB, 2 * MIB, Small, false, UNLIMITED, false),
            (20 * MIB, 19 * MIB, Large, false, UNLIMITED, false), // exactly 1 MiB remains
            (20 * MIB, 19 * MIB - 512, Large, false, UNLIMITED, true),
            (20 * MIB, 19 * MIB, Large, true, UNLIMITED, true), // expandable: small rule
            (400 * MIB, 200 * MIB, Large, false, 100 * MIB, false), // oversize request
            (400 * MIB, 200 * MIB, Large, true, 100 * MIB, true),
            (400 * MIB, 50 * MIB, Large, false, 100 * MIB, true),
        ] {
            assert_eq!(
                should_split(block, size, pool, expandable, max_split),
                want,
                "should_split({block}, {size}, {pool:?}, {expandable}, {max_split})"
            );
        }
    }

    #[test]
    fn format_size_table() {
        for (bytes, want) in [
            (0, "0 bytes"),
            (1024, "1024 bytes"),
            (1025, "1.00 KiB"),
            (1_048_576, "1024.00 KiB"),
            (2_097_152, "2.00 MiB"),
            (1 << 30, "1024.00 MiB"),
            ((1 << 30) + 1, "1.00 GiB"),
        ] {
            assert_eq!(format_size(bytes), want);
        }
    }
}
