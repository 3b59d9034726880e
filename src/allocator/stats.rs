//! The allocator's statistics, with PyTorch's names and update rules, published for lock-free
//! reads.
//!
//! Every counter is an atomic written by exactly one party, the allocator core, which holds
//! `&mut` access to its state whenever it writes; writers therefore use plain relaxed loads and
//! stores (no read-modify-write), which cost what plain fields cost. Readers (metrics
//! collectors, a scrape) clone the `Arc<DeviceStats>` once and read at any time without taking
//! the allocator's lock.
//!
//! # Invariants
//! - Single writer: only the allocator that created a `DeviceStats` mutates it.
//! - For every stat array, `all` is `small_pool` + `large_pool` by construction (it is summed
//!   when read); its peak is the highest such sum.
//! - `peak >= current` for every stat; `allocated - freed == current` unless accumulated stats
//!   were reset.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use super::size::PoolKind;

/// One statistic: current value, peak, and the totals added and removed.
#[derive(Debug, Default)]
pub struct Stat {
    current: AtomicI64,
    peak: AtomicI64,
    allocated: AtomicI64,
    freed: AtomicI64,
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
    #[inline]
    fn add(cell: &AtomicI64, amount: i64) {
        // Totals can exceed i64 over a long enough run; like PyTorch's counters they wrap
        // rather than abort.
        cell.store(cell.load(Relaxed).wrapping_add(amount), Relaxed);
    }

    #[inline]
    pub(crate) fn increase(&self, amount: i64) {
        let current = self.current.load(Relaxed).wrapping_add(amount);
        self.current.store(current, Relaxed);
        if current > self.peak.load(Relaxed) {
            self.peak.store(current, Relaxed);
        }
        Self::add(&self.allocated, amount);
    }

    #[inline]
    pub(crate) fn decrease(&self, amount: i64) {
        Self::add(&self.current, -amount);
        Self::add(&self.freed, amount);
    }

    fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }

    fn reset_accumulated(&self) {
        self.allocated.store(0, Relaxed);
        self.freed.store(0, Relaxed);
    }

    /// A copy of the four values.
    pub fn get(&self) -> StatValue {
        StatValue {
            current: self.current.load(Relaxed),
            peak: self.peak.load(Relaxed),
            allocated: self.allocated.load(Relaxed),
            freed: self.freed.load(Relaxed),
        }
    }

    /// The current value.
    pub fn current(&self) -> i64 {
        self.current.load(Relaxed)
    }

    fn from_value(v: StatValue) -> Stat {
        Stat {
            current: AtomicI64::new(v.current),
            peak: AtomicI64::new(v.peak),
            allocated: AtomicI64::new(v.allocated),
            freed: AtomicI64::new(v.freed),
        }
    }

    fn copy(&self) -> Stat {
        let v = self.get();
        Stat {
            current: AtomicI64::new(v.current),
            peak: AtomicI64::new(v.peak),
            allocated: AtomicI64::new(v.allocated),
            freed: AtomicI64::new(v.freed),
        }
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
    all_peak: AtomicI64,
}

impl StatArray {
    /// The bucket of one pool.
    #[inline]
    pub fn pool(&self, pool: PoolKind) -> &Stat {
        match pool {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
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
        self.pool(pool).increase(amount as i64);
        let all = self.all_current();
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

    fn copy(&self) -> StatArray {
        StatArray {
            small_pool: self.small_pool.copy(),
            large_pool: self.large_pool.copy(),
            all_peak: AtomicI64::new(self.all_peak.load(Relaxed)),
        }
    }

    fn reset_peak(&self) {
        self.small_pool.reset_peak();
        self.large_pool.reset_peak();
        self.all_peak.store(self.all_current(), Relaxed);
    }

    fn reset_accumulated(&self) {
        self.small_pool.reset_accumulated();
        self.large_pool.reset_accumulated();
    }

    /// (bucket name, value) for the three buckets, in PyTorch's order.
    fn buckets(&self) -> [(&'static str, StatValue); 3] {
        [
            ("all", self.all()),
            ("small_pool", self.small_pool.get()),
            ("large_pool", self.large_pool.get()),
        ]
    }
}

/// A monotonically increasing count (reset only by `reset_accumulated_stats`).
#[derive(Debug, Default)]
pub struct Counter(AtomicI64);

impl Counter {
    #[inline]
    pub(crate) fn bump(&self) {
        self.0.store(self.0.load(Relaxed).wrapping_add(1), Relaxed);
    }

    fn reset(&self) {
        self.0.store(0, Relaxed);
    }

    /// The count.
    pub fn get(&self) -> i64 {
        self.0.load(Relaxed)
    }

    fn copy(&self) -> Counter {
        Counter(AtomicI64::new(self.get()))
    }
}

/// All statistics of one device's allocator (PyTorch's `DeviceStats`).
#[derive(Debug, Default)]
pub struct DeviceStats {
    /// Allocated blocks (handed out, not yet freed by the user).
    pub allocation: StatArray,
    /// Segments obtained from the driver.
    pub segment: StatArray,
    /// Blocks allocated or freed but waiting on stream events.
    pub active: StatArray,
    /// Free blocks inside split segments (cannot be returned to the driver).
    pub inactive_split: StatArray,
    /// Bytes of allocated blocks.
    pub allocated_bytes: StatArray,
    /// Bytes of segments obtained from the driver.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes callers asked for, before rounding, of active blocks.
    pub requested_bytes: StatArray,
    /// Allocated blocks of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Allocations that had to flush the whole cache and retry.
    pub num_alloc_retries: Counter,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: Counter,
    /// Synchronisations of all pending stream events (each cache flush).
    pub num_sync_all_streams: Counter,
    /// Driver allocations (`cudaMalloc`, or an expandable-segment map).
    pub num_device_alloc: Counter,
    /// Driver frees (`cudaFree`, or an expandable-segment unmap).
    pub num_device_free: Counter,
    /// gpumem's own, outside PyTorch's map: requests a placement plan served from its
    /// region (Note [Planned placement] in `plan.rs`).
    pub num_plan_hits: Counter,
    /// gpumem's own: requests the plan expected but could not serve (another size or stream
    /// than planned, its range still taken, or no region), served by the caching allocator.
    pub num_plan_misses: Counter,
    /// `max_split_size` when the allocator was created (-1: unlimited).
    pub max_split_size: i64,
}

impl DeviceStats {
    pub(crate) fn new(max_split_size: i64) -> Self {
        DeviceStats {
            max_split_size,
            ..DeviceStats::default()
        }
    }

    /// A block of `size` bytes was handed out for a request of `requested` bytes.
    #[inline]
    pub(crate) fn count_alloc(&self, kind: PoolKind, size: u64, requested: u64, oversize: bool) {
        self.allocation.increase(kind, 1);
        self.allocated_bytes.increase(kind, size);
        self.active.increase(kind, 1);
        self.active_bytes.increase(kind, size);
        self.requested_bytes.increase(kind, requested);
        if oversize {
            self.oversize_allocations.increase(1);
        }
    }

    /// The user freed a block of `size` bytes; it stays active until its free completes.
    #[inline]
    pub(crate) fn count_free_requested(&self, kind: PoolKind, size: u64, oversize: bool) {
        self.allocation.decrease(kind, 1);
        self.allocated_bytes.decrease(kind, size);
        if oversize {
            self.oversize_allocations.decrease(1);
        }
    }

    /// The free of a block of `size` bytes (for `requested` bytes) completed.
    #[inline]
    pub(crate) fn count_free_completed(&self, kind: PoolKind, size: u64, requested: u64) {
        self.active.decrease(kind, 1);
        self.active_bytes.decrease(kind, size);
        self.requested_bytes.decrease(kind, requested);
    }

    /// A segment of `size` bytes was obtained from the driver.
    pub(crate) fn count_segment_alloc(&self, kind: PoolKind, size: u64, oversize: bool) {
        self.segment.increase(kind, 1);
        self.reserved_bytes.increase(kind, size);
        if oversize {
            self.oversize_segments.increase(1);
        }
        self.num_device_alloc.bump();
    }

    /// A segment of `size` bytes went back to the driver.
    pub(crate) fn count_segment_free(&self, kind: PoolKind, size: u64, oversize: bool) {
        self.segment.decrease(kind, 1);
        self.reserved_bytes.decrease(kind, size);
        if oversize {
            self.oversize_segments.decrease(1);
        }
        self.num_device_free.bump();
    }

    /// An independent copy of every value.
    pub(crate) fn copy(&self) -> DeviceStats {
        DeviceStats {
            allocation: self.allocation.copy(),
            segment: self.segment.copy(),
            active: self.active.copy(),
            inactive_split: self.inactive_split.copy(),
            allocated_bytes: self.allocated_bytes.copy(),
            reserved_bytes: self.reserved_bytes.copy(),
            active_bytes: self.active_bytes.copy(),
            inactive_split_bytes: self.inactive_split_bytes.copy(),
            requested_bytes: self.requested_bytes.copy(),
            oversize_allocations: self.oversize_allocations.copy(),
            oversize_segments: self.oversize_segments.copy(),
            num_alloc_retries: self.num_alloc_retries.copy(),
            num_ooms: self.num_ooms.copy(),
            num_sync_all_streams: self.num_sync_all_streams.copy(),
            num_device_alloc: self.num_device_alloc.copy(),
            num_device_free: self.num_device_free.copy(),
            num_plan_hits: self.num_plan_hits.copy(),
            num_plan_misses: self.num_plan_misses.copy(),
            max_split_size: self.max_split_size,
        }
    }

    fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    fn counters(&self) -> [(&'static str, &Counter); 5] {
        [
            ("num_alloc_retries", &self.num_alloc_retries),
            ("num_ooms", &self.num_ooms),
            ("num_sync_all_streams", &self.num_sync_all_streams),
            ("num_device_alloc", &self.num_device_alloc),
            ("num_device_free", &self.num_device_free),
        ]
    }

    /// The inverse of [`DeviceStats::memory_stats`]: statistics from PyTorch's flat map (as
    /// `torch.cuda.memory_stats()` returns it). Missing keys read as 0; unknown keys are
    /// ignored.
    pub fn from_memory_stats(map: &BTreeMap<String, i64>) -> DeviceStats {
        let get = |key: String| map.get(&key).copied().unwrap_or(0);
        let value = |prefix: &str| StatValue {
            current: get(format!("{prefix}.current")),
            peak: get(format!("{prefix}.peak")),
            allocated: get(format!("{prefix}.allocated")),
            freed: get(format!("{prefix}.freed")),
        };
        let array = |name: &str| StatArray {
            small_pool: Stat::from_value(value(&format!("{name}.small_pool"))),
            large_pool: Stat::from_value(value(&format!("{name}.large_pool"))),
            all_peak: AtomicI64::new(get(format!("{name}.all.peak"))),
        };
        let counter = |name: &str| Counter(AtomicI64::new(get(name.to_string())));
        DeviceStats {
            allocation: array("allocation"),
            segment: array("segment"),
            active: array("active"),
            inactive_split: array("inactive_split"),
            allocated_bytes: array("allocated_bytes"),
            reserved_bytes: array("reserved_bytes"),
            active_bytes: array("active_bytes"),
            inactive_split_bytes: array("inactive_split_bytes"),
            requested_bytes: array("requested_bytes"),
            oversize_allocations: Stat::from_value(value("oversize_allocations")),
            oversize_segments: Stat::from_value(value("oversize_segments")),
            num_alloc_retries: counter("num_alloc_retries"),
            num_ooms: counter("num_ooms"),
            num_sync_all_streams: counter("num_sync_all_streams"),
            num_device_alloc: counter("num_device_alloc"),
            num_device_free: counter("num_device_free"),
            num_plan_hits: Counter::default(),
            num_plan_misses: Counter::default(),
            max_split_size: map.get("max_split_size").copied().unwrap_or(-1),
        }
    }

    /// `torch.cuda.memory_stats()`: the flat map with PyTorch's 122 keys, sorted.
    pub fn memory_stats(&self) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        let mut put = |prefix: &str, v: StatValue| {
            for (field, value) in [
                ("current", v.current),
                ("peak", v.peak),
                ("allocated", v.allocated),
                ("freed", v.freed),
            ] {
                out.insert(format!("{prefix}.{field}"), value);
            }
        };
        for (name, array) in self.arrays() {
            for (bucket, value) in array.buckets() {
                put(&format!("{name}.{bucket}"), value);
            }
        }
        put("oversize_allocations", self.oversize_allocations.get());
        put("oversize_segments", self.oversize_segments.get());
        for (name, counter) in self.counters() {
            out.insert(name.to_string(), counter.get());
        }
        out.insert("max_split_size".to_string(), self.max_split_size);
        out
    }

    pub(crate) fn reset_peak(&self) {
        for (_, array) in self.arrays() {
            array.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    pub(crate) fn reset_accumulated(&self) {
        for (_, array) in self.arrays() {
            array.reset_accumulated();
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        for (_, counter) in self.counters() {
            counter.reset();
        }
        self.num_plan_hits.reset();
        self.num_plan_misses.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_rules() {
        let s = Stat::default();
        s.increase(10);
        s.decrease(4);
        s.increase(1);
        assert_eq!(
            s.get(),
            StatValue {
                current: 7,
                peak: 10,
                allocated: 11,
                freed: 4
            }
        );
        s.reset_peak();
        s.reset_accumulated();
        assert_eq!(
            s.get(),
            StatValue {
                current: 7,
                peak: 7,
                allocated: 0,
                freed: 0
            }
        );
    }

    #[test]
    fn memory_stats_round_trip() {
        let stats = DeviceStats::new(1 << 27);
        stats.allocated_bytes.increase(PoolKind::Small, 512);
        stats.allocated_bytes.increase(PoolKind::Large, 4 << 20);
        stats.allocated_bytes.decrease(PoolKind::Large, 1 << 20);
        stats.num_ooms.bump();
        stats.oversize_segments.increase(1);
        let map = stats.memory_stats();
        assert_eq!(DeviceStats::from_memory_stats(&map).memory_stats(), map);
    }

    #[test]
    fn memory_stats_has_pytorchs_122_keys() {
        let stats = DeviceStats::new(-1);
        stats.allocated_bytes.increase(PoolKind::Small, 512);
        let m = stats.memory_stats();
        assert_eq!(m.len(), 122);
        assert_eq!(m["allocated_bytes.all.current"], 512);
        assert_eq!(m["allocated_bytes.small_pool.peak"], 512);
        assert_eq!(m["allocated_bytes.large_pool.current"], 0);
        assert_eq!(m["max_split_size"], -1);
        assert!(m.contains_key("oversize_segments.freed"));
        assert!(m.contains_key("num_sync_all_streams"));
    }
}
