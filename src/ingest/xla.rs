//! XLA's allocator as a JAX job pushes it: each GPU device's `memory_stats()` (PJRT's keys),
//! in the contract's terms. Pure: the payload's validation calls it on statistics already
//! bounded (whole, not negative, bytes below 2^60).
//!
//! | PJRT's key | exported as |
//! |---|---|
//! | `bytes_in_use` | allocated bytes (`pool="all"`: XLA's allocator has one pool) |
//! | `peak_bytes_in_use` | peak allocated bytes |
//! | `pool_bytes` | reserved bytes (the allocator's region: under preallocation, 75 to 90 % of the GPU) |
//! | `peak_pool_bytes` | peak reserved bytes |
//! | `largest_free_block_bytes` | the largest free block |
//! | `bytes_limit` | the allocator's limit |
//! | `num_ooms` (the hook's count of `RESOURCE_EXHAUSTED` errors, not PJRT's) | OOMs |
//!
//! Each may be missing (PJRT leaves out what an allocator does not track; the hook counts
//! OOMs on the job's first GPU only); what is missing is not exported. `num_allocs`, `largest_alloc_size`, `bytes_reserved`,
//! `peak_bytes_reserved` and `bytes_reservable_limit` are accepted and not exported.
//!
//! # Invariants
//! - What one reading says adds up: bytes in use within the pool, the largest free block
//!   within what the pool has free, the peaks at or above the current figures; a reading
//!   that does not is refused, naming the keys.

use std::collections::BTreeMap;

use crate::allocator::DeviceStats;
use crate::sources::XlaFigures;

use super::refusal::{Rejected, invalid};

/// The keys read.
const IN_USE: &str = "bytes_in_use";
const PEAK_IN_USE: &str = "peak_bytes_in_use";
const POOL: &str = "pool_bytes";
const PEAK_POOL: &str = "peak_pool_bytes";
const LARGEST_FREE: &str = "largest_free_block_bytes";
const LIMIT: &str = "bytes_limit";
const OOMS: &str = "num_ooms";

/// Device `index`'s XLA statistics as the contract's: the statistics (allocated and
/// reserved bytes in the large pool's place), what XLA reported of the contract's figures,
/// and its largest free block where reported.
///
/// # Errors
/// A [`Rejected`] naming the figures that do not add up.
pub fn figures(
    index: u32,
    stats: &BTreeMap<String, i64>,
) -> Result<(DeviceStats, XlaFigures, Option<u64>), Rejected> {
    let get = |key: &str| stats.get(key).copied();
    let in_use = get(IN_USE);
    let pool = get(POOL);
    let largest = get(LARGEST_FREE);
    let exceeds = |part: &str, value: i64, whole: &str, of: i64| {
        invalid(format!(
            "device {index}: {part} ({value}) exceeds {whole} ({of})"
        ))
    };
    if let (Some(used), Some(pool)) = (in_use, pool)
        && used > pool
    {
        return Err(exceeds(IN_USE, used, POOL, pool));
    }
    if let (Some(largest), Some(pool)) = (largest, pool) {
        let free = pool - in_use.unwrap_or(0);
        if largest > free {
            return Err(exceeds(
                LARGEST_FREE,
                largest,
                "pool_bytes - bytes_in_use",
                free,
            ));
        }
    }
    for (peak, current) in [(PEAK_IN_USE, IN_USE), (PEAK_POOL, POOL)] {
        if let (Some(p), Some(c)) = (get(peak), get(current))
            && p < c
        {
            return Err(invalid(format!(
                "device {index}: {peak} ({p}) is below {current} ({c})"
            )));
        }
    }
    let mut mapped = BTreeMap::new();
    for (from, to) in [
        (IN_USE, &["allocated_bytes.large_pool.current"][..]),
        (
            PEAK_IN_USE,
            &[
                "allocated_bytes.large_pool.peak",
                "allocated_bytes.all.peak",
            ],
        ),
        (POOL, &["reserved_bytes.large_pool.current"]),
        (
            PEAK_POOL,
            &["reserved_bytes.large_pool.peak", "reserved_bytes.all.peak"],
        ),
        (OOMS, &[OOMS]),
    ] {
        if let Some(value) = get(from) {
            mapped.extend(to.iter().map(|key| (key.to_string(), value)));
        }
    }
    let reported = XlaFigures {
        has_in_use: in_use.is_some(),
        has_peak_in_use: get(PEAK_IN_USE).is_some(),
        has_pool: pool.is_some(),
        has_peak_pool: get(PEAK_POOL).is_some(),
        has_ooms: get(OOMS).is_some(),
        limit: get(LIMIT).map(|l| l as u64),
    };
    Ok((
        DeviceStats::from_memory_stats(&mapped),
        reported,
        largest.map(|l| l as u64),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(pairs: &[(&str, i64)]) -> BTreeMap<String, i64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn pjrt_keys_become_the_contracts_figures() {
        let gib = 1_i64 << 30;
        let (st, reported, largest) = figures(
            0,
            &stats(&[
                (IN_USE, 3 * gib),
                (PEAK_IN_USE, 5 * gib),
                (POOL, 60 * gib),
                (PEAK_POOL, 60 * gib),
                (LARGEST_FREE, 50 * gib),
                (LIMIT, 60 * gib),
                ("num_allocs", 1234),
                (OOMS, 2),
            ]),
        )
        .expect("adds up");
        assert_eq!(st.allocated_bytes.all_current(), 3 * gib);
        assert_eq!(st.allocated_bytes.all().peak, 5 * gib);
        assert_eq!(st.reserved_bytes.all_current(), 60 * gib);
        assert_eq!(st.reserved_bytes.all().peak, 60 * gib);
        assert_eq!(st.num_ooms.get(), 2);
        assert_eq!(
            reported,
            XlaFigures {
                has_in_use: true,
                has_peak_in_use: true,
                has_pool: true,
                has_peak_pool: true,
                has_ooms: true,
                limit: Some(60 << 30)
            }
        );
        assert_eq!(largest, Some(50 << 30));
    }

    #[test]
    fn what_is_missing_is_said_so() {
        let (st, reported, largest) = figures(0, &stats(&[(IN_USE, 7)])).expect("ok");
        assert_eq!(st.allocated_bytes.all_current(), 7);
        assert_eq!(
            reported,
            XlaFigures {
                has_in_use: true,
                ..XlaFigures::default()
            },
            "no peak, no pool, no OOM count, no limit: each said missing"
        );
        assert_eq!(largest, None);
    }

    #[test]
    fn figures_that_do_not_add_up_are_refused() {
        for (pairs, key) in [
            (vec![(IN_USE, 11), (POOL, 10)], IN_USE),
            (
                vec![(IN_USE, 4), (POOL, 10), (LARGEST_FREE, 7)],
                LARGEST_FREE,
            ),
            (vec![(IN_USE, 4), (PEAK_IN_USE, 3)], PEAK_IN_USE),
            (vec![(POOL, 4), (PEAK_POOL, 3)], PEAK_POOL),
        ] {
            let err = figures(3, &stats(&pairs)).expect_err("refused");
            assert!(err.message.contains(key), "{}", err.message);
            assert!(err.message.contains("device 3"), "{}", err.message);
        }
    }
}
