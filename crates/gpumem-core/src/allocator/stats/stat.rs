//! One statistic ([`Stat`]: current, peak, allocated, freed), the same kept per pool
//! ([`StatArray`], whose `all` bucket is summed when read), and a [`Counter`].
//!
//! # Invariants
//! - `peak >= current`; `allocated - freed == current` unless accumulated totals were reset.
//! - A [`StatArray`]'s `all` is `small_pool` + `large_pool`; its stored peak is the highest
//!   such sum.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use super::super::size::PoolKind;

#[inline]
pub(super) fn add(cell: &AtomicI64, amount: i64) {
    // Totals can exceed i64 over a long enough run; like PyTorch's counters they wrap rather
    // than abort.
    cell.store(cell.load(Relaxed).wrapping_add(amount), Relaxed);
}

/// One statistic: current value, peak, and the totals added and removed.
///
/// The total removed is not stored: it is `allocated - current + removed_base`, and the base
/// changes only when the totals are reset or loaded. A decrease thus writes one value.
#[derive(Debug, Default)]
pub struct Stat {
    current: AtomicI64,
    /// Read by the active stats' peak rule (Note [Active stats]).
    pub(super) peak: AtomicI64,
    allocated: AtomicI64,
    /// `freed - allocated + current`, constant between resets.
    removed_base: AtomicI64,
}

/// A plain copy of a [`Stat`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatValue {
    /// Value now.
    pub current: i64,
    /// Highest value since creation or the last peak reset.
    pub peak: i64,
    /// Sum of increases since creation or the last accumulated reset.
    pub allocated: i64,
    /// Sum of decreases since creation or the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    /// Adds `amount`; returns the new current value.
    #[inline]
    pub(crate) fn increase(&self, amount: i64) -> i64 {
        let current = self.current.load(Relaxed).wrapping_add(amount);
        self.current.store(current, Relaxed);
        if current > self.peak.load(Relaxed) {
            self.peak.store(current, Relaxed);
        }
        add(&self.allocated, amount);
        current
    }

    #[inline]
    pub(crate) fn decrease(&self, amount: i64) {
        add(&self.current, -amount);
    }

    pub(super) fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }

    pub(super) fn reset_accumulated(&self) {
        self.allocated.store(0, Relaxed);
        self.removed_base.store(self.current.load(Relaxed), Relaxed);
    }

    /// A copy of the four values.
    pub fn get(&self) -> StatValue {
        let (current, allocated) = (self.current.load(Relaxed), self.allocated.load(Relaxed));
        StatValue {
            current,
            peak: self.peak.load(Relaxed),
            allocated,
            freed: allocated
                .wrapping_sub(current)
                .wrapping_add(self.removed_base.load(Relaxed)),
        }
    }

    /// The current value.
    pub fn current(&self) -> i64 {
        self.current.load(Relaxed)
    }

    pub(super) fn from_value(v: StatValue) -> Stat {
        Stat {
            current: AtomicI64::new(v.current),
            peak: AtomicI64::new(v.peak),
            allocated: AtomicI64::new(v.allocated),
            removed_base: AtomicI64::new(v.freed.wrapping_sub(v.allocated).wrapping_add(v.current)),
        }
    }

    pub(super) fn copy(&self) -> Stat {
        Stat::from_value(self.get())
    }
}

/// A stat kept for each pool, and for both together.
///
/// The `all` bucket is derived when read (current, allocated and freed are sums of the two
/// pools); only its peak, which no sum of the pools' peaks gives, is tracked. This halves the
/// work of every update on the allocation hot path.
#[derive(Debug, Default)]
pub struct StatArray {
    /// The small pool.
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
    /// Highest value of small + large current.
    pub(super) all_peak: AtomicI64,
}

impl StatArray {
    /// The bucket of one pool.
    #[inline]
    pub fn pool(&self, pool: PoolKind) -> &Stat {
        [&self.small_pool, &self.large_pool][pool.index()]
    }

    /// Both pools together.
    pub fn all(&self) -> StatValue {
        let (s, l) = (self.small_pool.get(), self.large_pool.get());
        StatValue {
            current: s.current.wrapping_add(l.current),
            peak: self.all_peak.load(Relaxed),
            allocated: s.allocated.wrapping_add(l.allocated),
            freed: s.freed.wrapping_add(l.freed),
        }
    }

    /// The current value of both pools together.
    pub fn all_current(&self) -> i64 {
        self.small_pool
            .current()
            .wrapping_add(self.large_pool.current())
    }

    #[inline]
    pub(crate) fn increase(&self, pool: PoolKind, amount: u64) {
        let pools = [&self.small_pool, &self.large_pool];
        let (this, other) = (pools[pool.index()], pools[1 - pool.index()]);
        // The sum from the value just computed, not reloaded from the store just made.
        let all = this
            .increase(amount as i64)
            .wrapping_add(other.current.load(Relaxed));
        if all > self.all_peak.load(Relaxed) {
            self.all_peak.store(all, Relaxed);
        }
    }

    #[inline]
    pub(crate) fn decrease(&self, pool: PoolKind, amount: u64) {
        self.pool(pool).decrease(amount as i64);
    }

    #[inline]
    pub(crate) fn update(&self, pool: PoolKind, delta: i64) {
        if delta > 0 {
            self.increase(pool, delta as u64);
        } else if delta < 0 {
            self.decrease(pool, delta.unsigned_abs());
        }
    }

    pub(super) fn copy(&self) -> StatArray {
        StatArray {
            small_pool: self.small_pool.copy(),
            large_pool: self.large_pool.copy(),
            all_peak: AtomicI64::new(self.all_peak.load(Relaxed)),
        }
    }

    pub(super) fn reset_peak(&self) {
        self.small_pool.reset_peak();
        self.large_pool.reset_peak();
        self.all_peak.store(self.all_current(), Relaxed);
    }

    pub(super) fn reset_accumulated(&self) {
        self.small_pool.reset_accumulated();
        self.large_pool.reset_accumulated();
    }

    /// (bucket name, value) for the three buckets, in PyTorch's order.
    pub(super) fn buckets(&self) -> [(&'static str, StatValue); 3] {
        [
            ("all", self.all()),
            ("small_pool", self.small_pool.get()),
            ("large_pool", self.large_pool.get()),
        ]
    }
}

/// A monotonically increasing count (reset only by `reset_accumulated_stats`).
#[derive(Debug, Default)]
pub struct Counter(pub(super) AtomicI64);

impl Counter {
    #[inline]
    pub(crate) fn bump(&self) {
        self.0.store(self.0.load(Relaxed).wrapping_add(1), Relaxed);
    }

    pub(super) fn reset(&self) {
        self.0.store(0, Relaxed);
    }

    /// The count.
    pub fn get(&self) -> i64 {
        self.0.load(Relaxed)
    }

    pub(super) fn copy(&self) -> Counter {
        Counter(AtomicI64::new(self.get()))
    }
}
