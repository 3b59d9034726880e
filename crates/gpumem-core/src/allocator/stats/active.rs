//! `active` and `active_bytes`, kept as offsets from `allocation` and `allocated_bytes`.
//!
//! # Note [Active stats]
//! A block is active from its malloc until its free completes, and allocated until the user
//! frees it. The two differ only while a free waits on stream events, which training loops
//! rarely do; yet PyTorch updates both on every malloc and free. Here `active` is stored as
//! `allocation` plus an offset (current, allocated, freed), and its peaks on their own. A free
//! that completes at once changes neither offset, and a malloc only `allocation`. While
//! tracking is off, active's peak is the higher of its stored peak and allocation's. That is
//! exact: when tracking went off the offsets were zero and allocation's peaks at most active's
//! stored ones, and since then the two have moved together. Tracking goes on when an offset
//! becomes non-zero (a free that waits, or loaded stats), the stored peaks first made exact;
//! while it is on, each malloc also raises active's stored peaks. It goes off again, checked
//! at each completion, peak reset and load, once the offsets' currents are zero and
//! allocation's peaks are no higher than active's. `active_bytes` follows `allocated_bytes`
//! the same way.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use super::super::size::PoolKind;
use super::stat::{Stat, StatArray, StatValue, add};

/// `active` or `active_bytes` as an offset from its base, `allocation` or `allocated_bytes`
/// (Note [Active stats]).
#[derive(Debug, Default)]
pub(super) struct Derived {
    /// Per pool (small, large): this stat minus its base.
    current: [AtomicI64; 2],
    allocated: [AtomicI64; 2],
    freed: [AtomicI64; 2],
    /// Per pool, and of both together: the peaks, exact while tracking.
    peak: [AtomicI64; 2],
    all_peak: AtomicI64,
}

/// A pool kind's index in per-pool arrays (small, large), as [`StatArray`]'s buckets order them.
pub(in crate::allocator) fn slot(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

fn raise(cell: &AtomicI64, value: i64) {
    if value > cell.load(Relaxed) {
        cell.store(value, Relaxed);
    }
}

const POOLS: [PoolKind; 2] = [PoolKind::Small, PoolKind::Large];

impl Derived {
    /// The offsets and peaks that make `stat` from `base`.
    pub(super) fn between(stat: &StatArray, base: &StatArray) -> Derived {
        let d = Derived::default();
        for pool in POOLS {
            let (v, b, i) = (stat.pool(pool).get(), base.pool(pool).get(), slot(pool));
            d.current[i].store(v.current.wrapping_sub(b.current), Relaxed);
            d.allocated[i].store(v.allocated.wrapping_sub(b.allocated), Relaxed);
            d.freed[i].store(v.freed.wrapping_sub(b.freed), Relaxed);
            d.peak[i].store(v.peak, Relaxed);
        }
        d.all_peak.store(stat.all_peak.load(Relaxed), Relaxed);
        d
    }

    /// The stat itself, as a stat array of its own.
    pub(super) fn value(&self, base: &StatArray, tracking: bool) -> StatArray {
        let pool = |pool: PoolKind| {
            let (b, i) = (base.pool(pool).get(), slot(pool));
            let peak = self.peak[i].load(Relaxed);
            Stat::from_value(StatValue {
                current: b.current.wrapping_add(self.current[i].load(Relaxed)),
                peak: if tracking { peak } else { peak.max(b.peak) },
                allocated: b.allocated.wrapping_add(self.allocated[i].load(Relaxed)),
                freed: b.freed.wrapping_add(self.freed[i].load(Relaxed)),
            })
        };
        let all_peak = self.all_peak.load(Relaxed);
        StatArray {
            small_pool: pool(PoolKind::Small),
            large_pool: pool(PoolKind::Large),
            all_peak: AtomicI64::new(if tracking {
                all_peak
            } else {
                all_peak.max(base.all_peak.load(Relaxed))
            }),
        }
    }

    /// Whether the stat can follow its base: no offset in its current values, and the base's
    /// peaks no higher than the stored ones.
    pub(super) fn follows(&self, base: &StatArray) -> bool {
        POOLS.into_iter().all(|pool| {
            let i = slot(pool);
            self.current[i].load(Relaxed) == 0
                && base.pool(pool).peak.load(Relaxed) <= self.peak[i].load(Relaxed)
        }) && base.all_peak.load(Relaxed) <= self.all_peak.load(Relaxed)
    }

    /// Makes the stored peaks exact again as tracking starts (they may lag the base's).
    pub(super) fn settle_peaks(&self, base: &StatArray) {
        for pool in POOLS {
            raise(&self.peak[slot(pool)], base.pool(pool).peak.load(Relaxed));
        }
        raise(&self.all_peak, base.all_peak.load(Relaxed));
    }

    /// The stat's current values, per pool.
    pub(super) fn currents(&self, base: &StatArray) -> [i64; 2] {
        POOLS.map(|pool| {
            let offset = self.current[slot(pool)].load(Relaxed);
            base.pool(pool).current().wrapping_add(offset)
        })
    }

    /// Raises the stored peaks of `pool` and of both together after the base rose in `pool`
    /// (while tracking).
    pub(super) fn track_peaks(&self, base: &StatArray, pool: PoolKind) {
        let currents = self.currents(base);
        raise(&self.peak[slot(pool)], currents[slot(pool)]);
        raise(&self.all_peak, currents[0].wrapping_add(currents[1]));
    }

    /// A free of `amount` that waits: its base fell, the stat has not.
    pub(super) fn wait(&self, pool: PoolKind, amount: i64) {
        let i = slot(pool);
        add(&self.current[i], amount);
        add(&self.freed[i], -amount);
    }

    /// The waiting free of `amount` completed: the stat falls too.
    pub(super) fn complete(&self, pool: PoolKind, amount: i64) {
        self.wait(pool, -amount);
    }

    pub(super) fn reset_peak(&self, base: &StatArray) {
        let [small, large] = self.currents(base);
        self.peak[0].store(small, Relaxed);
        self.peak[1].store(large, Relaxed);
        self.all_peak.store(small.wrapping_add(large), Relaxed);
    }

    pub(super) fn reset_accumulated(&self) {
        for i in 0..2 {
            self.allocated[i].store(0, Relaxed);
            self.freed[i].store(0, Relaxed);
        }
    }

    pub(super) fn copy(&self) -> Derived {
        let copy =
            |cells: &[AtomicI64; 2]| cells.each_ref().map(|c| AtomicI64::new(c.load(Relaxed)));
        Derived {
            current: copy(&self.current),
            allocated: copy(&self.allocated),
            freed: copy(&self.freed),
            peak: copy(&self.peak),
            all_peak: AtomicI64::new(self.all_peak.load(Relaxed)),
        }
    }
}
