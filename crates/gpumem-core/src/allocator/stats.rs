//! The allocator's statistics, with PyTorch's names and update rules, published for lock-free
//! reads.
//!
//! Every counter is an atomic written by exactly one party, the allocator core, which holds
//! `&mut` access to its state whenever it writes; writers therefore use plain relaxed loads and
//! stores (no read-modify-write), which cost what plain fields cost. Readers (metrics
//! collectors, a scrape) clone the `Arc<DeviceStats>` once and read at any time without taking
//! the allocator's lock. A read is not atomic across fields: one taken during an update may
//! mix values from before and after it, and a `freed` total (derived from two fields, see
//! [`Stat`]) read so may be off by that update's amount. Reads under the lock, as
//! `memory_stats()` makes them, are exact.
//!
//! # Invariants
//! - Single writer: only the allocator that created a `DeviceStats` mutates it.
//! - For every stat array, `all` is `small_pool` + `large_pool` by construction (it is summed
//!   when read); its peak is the highest such sum.
//! - `peak >= current` for every stat; `allocated - freed == current` unless accumulated stats
//!   were reset.
//! - `active` and `active_bytes` are kept as offsets from `allocation` and `allocated_bytes`
//!   (Note [Active stats]). While `tracking` is off, the offsets' current values are zero and
//!   the bases' peaks were at most the stored ones when it went off; while it is on, the
//!   stored peaks are exact.
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

use std::collections::BTreeMap;
use std::sync::atomic::{
    AtomicBool, AtomicI64,
    Ordering::{Acquire, Relaxed, Release},
};

use super::size::PoolKind;

/// One statistic: current value, peak, and the totals added and removed.
///
/// The total removed is not stored: it is `allocated - current + removed_base`, and the base
/// changes only when the totals are reset or loaded. A decrease thus writes one value.
#[derive(Debug, Default)]
pub struct Stat {
    current: AtomicI64,
    peak: AtomicI64,
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

    fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }

    fn reset_accumulated(&self) {
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

    fn from_value(v: StatValue) -> Stat {
        Stat {
            current: AtomicI64::new(v.current),
            peak: AtomicI64::new(v.peak),
            allocated: AtomicI64::new(v.allocated),
            removed_base: AtomicI64::new(v.freed.wrapping_sub(v.allocated).wrapping_add(v.current)),
        }
    }

    fn copy(&self) -> Stat {
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
        let (this, other) = match pool {
            PoolKind::Small => (&self.small_pool, &self.large_pool),
            PoolKind::Large => (&self.large_pool, &self.small_pool),
        };
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

/// `active` or `active_bytes` as an offset from its base, `allocation` or `allocated_bytes`
/// (Note [Active stats]).
#[derive(Debug, Default)]
struct Derived {
    /// Per pool (small, large): this stat minus its base.
    current: [AtomicI64; 2],
    allocated: [AtomicI64; 2],
    freed: [AtomicI64; 2],
    /// Per pool, and of both together: the peaks, exact while tracking.
    peak: [AtomicI64; 2],
    all_peak: AtomicI64,
}

fn slot(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

#[inline]
fn add(cell: &AtomicI64, amount: i64) {
    // Totals can exceed i64 over a long enough run; like PyTorch's counters they wrap rather
    // than abort.
    cell.store(cell.load(Relaxed).wrapping_add(amount), Relaxed);
}

fn raise(cell: &AtomicI64, value: i64) {
    if value > cell.load(Relaxed) {
        cell.store(value, Relaxed);
    }
}

const POOLS: [PoolKind; 2] = [PoolKind::Small, PoolKind::Large];

impl Derived {
    /// The offsets and peaks that make `stat` from `base`.
    fn between(stat: &StatArray, base: &StatArray) -> Derived {
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
    fn value(&self, base: &StatArray, tracking: bool) -> StatArray {
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
    fn follows(&self, base: &StatArray) -> bool {
        POOLS.into_iter().all(|pool| {
            let i = slot(pool);
            self.current[i].load(Relaxed) == 0
                && base.pool(pool).peak.load(Relaxed) <= self.peak[i].load(Relaxed)
        }) && base.all_peak.load(Relaxed) <= self.all_peak.load(Relaxed)
    }

    /// Makes the stored peaks exact again as tracking starts (they may lag the base's).
    fn settle_peaks(&self, base: &StatArray) {
        for pool in POOLS {
            raise(&self.peak[slot(pool)], base.pool(pool).peak.load(Relaxed));
        }
        raise(&self.all_peak, base.all_peak.load(Relaxed));
    }

    /// The stat's current values, per pool.
    fn currents(&self, base: &StatArray) -> [i64; 2] {
        POOLS.map(|pool| {
            let offset = self.current[slot(pool)].load(Relaxed);
            base.pool(pool).current().wrapping_add(offset)
        })
    }

    /// Raises the stored peaks of `pool` and of both together after the base rose in `pool`
    /// (while tracking).
    fn track_peaks(&self, base: &StatArray, pool: PoolKind) {
        let currents = self.currents(base);
        raise(&self.peak[slot(pool)], currents[slot(pool)]);
        raise(&self.all_peak, currents[0].wrapping_add(currents[1]));
    }

    /// A free of `amount` that waits: its base fell, the stat has not.
    fn wait(&self, pool: PoolKind, amount: i64) {
        let i = slot(pool);
        add(&self.current[i], amount);
        add(&self.freed[i], -amount);
    }

    /// The waiting free of `amount` completed: the stat falls too.
    fn complete(&self, pool: PoolKind, amount: i64) {
        self.wait(pool, -amount);
    }

    fn reset_peak(&self, base: &StatArray) {
        let [small, large] = self.currents(base);
        self.peak[0].store(small, Relaxed);
        self.peak[1].store(large, Relaxed);
        self.all_peak.store(small.wrapping_add(large), Relaxed);
    }

    fn reset_accumulated(&self) {
        for i in 0..2 {
            self.allocated[i].store(0, Relaxed);
            self.freed[i].store(0, Relaxed);
        }
    }

    fn copy(&self) -> Derived {
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
    /// Allocated blocks (handed out, not yet freed by the user). `active` is kept as an offset
    /// from it: changing it directly changes `active` too.
    pub allocation: StatArray,
    /// Segments obtained from the driver.
    pub segment: StatArray,
    /// Blocks allocated or freed but waiting on stream events: [`DeviceStats::active`].
    active: Derived,
    /// Free blocks inside split segments (cannot be returned to the driver).
    pub inactive_split: StatArray,
    /// Bytes of allocated blocks. `active_bytes` is kept as an offset from it: changing it
    /// directly changes `active_bytes` too.
    pub allocated_bytes: StatArray,
    /// Bytes of segments obtained from the driver.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks: [`DeviceStats::active_bytes`].
    active_bytes: Derived,
    /// Whether a free waits on stream events, or `active*` cannot follow their bases for
    /// another reason: then every malloc raises their peaks (Note [Active stats]).
    tracking: AtomicBool,
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
    /// Requests refused before the driver was asked, as past the memory fraction
    /// (`throw_on_cudamalloc_oom`, 2.12+); not counted in `num_ooms`.
    pub num_oom_rejections: Counter,
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

    /// Active blocks (PyTorch's `active`): allocated, or freed and waiting on stream events.
    pub fn active(&self) -> StatArray {
        self.active
            .value(&self.allocation, self.tracking.load(Acquire))
    }

    /// Bytes of active blocks (PyTorch's `active_bytes`).
    pub fn active_bytes(&self) -> StatArray {
        self.active_bytes
            .value(&self.allocated_bytes, self.tracking.load(Acquire))
    }

    /// A block of `size` bytes was handed out for a request of `requested` bytes.
    #[inline]
    pub(crate) fn count_alloc(&self, kind: PoolKind, size: u64, requested: u64, oversize: bool) {
        self.allocation.increase(kind, 1);
        self.allocated_bytes.increase(kind, size);
        self.requested_bytes.increase(kind, requested);
        if oversize {
            self.oversize_allocations.increase(1);
        }
        if self.tracking.load(Relaxed) {
            self.track_active_peaks(kind);
        }
    }

    #[cold]
    fn track_active_peaks(&self, pool: PoolKind) {
        self.active.track_peaks(&self.allocation, pool);
        self.active_bytes.track_peaks(&self.allocated_bytes, pool);
    }

    /// The user freed a block of `size` bytes (for `requested` bytes) and the free completed
    /// at once: `active*` follow their bases.
    #[inline]
    pub(crate) fn count_free(&self, kind: PoolKind, size: u64, requested: u64, oversize: bool) {
        self.allocation.decrease(kind, 1);
        self.allocated_bytes.decrease(kind, size);
        self.requested_bytes.decrease(kind, requested);
        if oversize {
            self.oversize_allocations.decrease(1);
        }
    }

    /// The user freed a block of `size` bytes that waits on stream events: it stays active
    /// until [`DeviceStats::count_free_completed`].
    pub(crate) fn count_free_requested(&self, kind: PoolKind, size: u64, oversize: bool) {
        self.set_tracking(true);
        self.allocation.decrease(kind, 1);
        self.allocated_bytes.decrease(kind, size);
        self.active.wait(kind, 1);
        self.active_bytes.wait(kind, size as i64);
        if oversize {
            self.oversize_allocations.decrease(1);
        }
    }

    /// The waiting free of a block of `size` bytes (for `requested` bytes) completed.
    pub(crate) fn count_free_completed(&self, kind: PoolKind, size: u64, requested: u64) {
        self.active.complete(kind, 1);
        self.active_bytes.complete(kind, size as i64);
        self.requested_bytes.decrease(kind, requested);
        self.update_tracking();
    }

    /// Whether `active*` are tracked on their own (Note [Active stats]).
    pub(crate) fn tracks_active(&self) -> bool {
        self.tracking.load(Relaxed)
    }

    /// Tracking stays on exactly while `active*` cannot follow their bases.
    fn update_tracking(&self) {
        let follows = self.active.follows(&self.allocation)
            && self.active_bytes.follows(&self.allocated_bytes);
        self.set_tracking(!follows);
    }

    /// Turns tracking on or off; on, after making the stored peaks exact (they lag the bases'
    /// while it is off).
    fn set_tracking(&self, on: bool) {
        if on && !self.tracking.load(Relaxed) {
            self.active.settle_peaks(&self.allocation);
            self.active_bytes.settle_peaks(&self.allocated_bytes);
        }
        self.tracking.store(on, Release);
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
            tracking: AtomicBool::new(self.tracking.load(Relaxed)),
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
            num_oom_rejections: self.num_oom_rejections.copy(),
            num_sync_all_streams: self.num_sync_all_streams.copy(),
            num_device_alloc: self.num_device_alloc.copy(),
            num_device_free: self.num_device_free.copy(),
            num_plan_hits: self.num_plan_hits.copy(),
            num_plan_misses: self.num_plan_misses.copy(),
            max_split_size: self.max_split_size,
        }
    }

    /// The seven arrays stored as themselves.
    fn stored_arrays(&self) -> [&StatArray; 7] {
        [
            &self.allocation,
            &self.segment,
            &self.inactive_split,
            &self.allocated_bytes,
            &self.reserved_bytes,
            &self.inactive_split_bytes,
            &self.requested_bytes,
        ]
    }

    fn counters(&self) -> [(&'static str, &Counter); 6] {
        [
            ("num_alloc_retries", &self.num_alloc_retries),
            ("num_ooms", &self.num_ooms),
            ("num_oom_rejections", &self.num_oom_rejections),
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
        let (allocation, allocated_bytes) = (array("allocation"), array("allocated_bytes"));
        let active = Derived::between(&array("active"), &allocation);
        let active_bytes = Derived::between(&array("active_bytes"), &allocated_bytes);
        let stats = DeviceStats {
            active,
            active_bytes,
            tracking: AtomicBool::new(true),
            allocation,
            segment: array("segment"),
            inactive_split: array("inactive_split"),
            allocated_bytes,
            reserved_bytes: array("reserved_bytes"),
            inactive_split_bytes: array("inactive_split_bytes"),
            requested_bytes: array("requested_bytes"),
            oversize_allocations: Stat::from_value(value("oversize_allocations")),
            oversize_segments: Stat::from_value(value("oversize_segments")),
            num_alloc_retries: counter("num_alloc_retries"),
            num_ooms: counter("num_ooms"),
            num_oom_rejections: counter("num_oom_rejections"),
            num_sync_all_streams: counter("num_sync_all_streams"),
            num_device_alloc: counter("num_device_alloc"),
            num_device_free: counter("num_device_free"),
            num_plan_hits: Counter::default(),
            num_plan_misses: Counter::default(),
            max_split_size: map.get("max_split_size").copied().unwrap_or(-1),
        };
        stats.update_tracking();
        stats
    }

    /// `torch.cuda.memory_stats()`: the flat map with PyTorch's 123 keys (2.12's), sorted.
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
        let arrays = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active()),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes()),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        for (name, array) in arrays {
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
        for array in self.stored_arrays() {
            array.reset_peak();
        }
        self.active.reset_peak(&self.allocation);
        self.active_bytes.reset_peak(&self.allocated_bytes);
        self.update_tracking();
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    pub(crate) fn reset_accumulated(&self) {
        for array in self.stored_arrays() {
            array.reset_accumulated();
        }
        self.active.reset_accumulated();
        self.active_bytes.reset_accumulated();
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
    use proptest::prelude::*;

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

    /// One step of the model test: an index picks a live or waiting block where one is
    /// needed.
    #[derive(Debug, Clone)]
    enum Step {
        Alloc(bool, u64),
        FreeNow(usize),
        FreeWaiting(usize),
        Complete(usize),
        ResetPeak,
        ResetAccumulated,
        Reload,
        Copy,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (any::<bool>(), 1u64..4).prop_map(|(small, size)| Step::Alloc(small, size)),
            3 => any::<usize>().prop_map(Step::FreeNow),
            1 => any::<usize>().prop_map(Step::FreeWaiting),
            1 => any::<usize>().prop_map(Step::Complete),
            1 => Just(Step::ResetPeak),
            1 => Just(Step::ResetAccumulated),
            1 => Just(Step::Reload),
            1 => Just(Step::Copy),
        ]
    }

    /// The stats the model compares, by PyTorch's names, with those a malloc, a free and a
    /// completion change.
    const MODELLED: [&str; 5] = [
        "allocation",
        "active",
        "allocated_bytes",
        "active_bytes",
        "requested_bytes",
    ];

    /// A start state: each modelled stat's values per pool, and its `all` peak, arbitrary
    /// (a loaded file need not be consistent), or all zero.
    fn start() -> impl Strategy<Value = Option<Vec<([[i64; 4]; 2], i64)>>> {
        // Small values, so that waits and completions often bring loaded offsets to zero.
        let values = (
            [
                [-3i64..3, -3..3, -3..3, -3..3],
                [-3..3, -3..3, -3..3, -3..3],
            ],
            -3i64..3,
        );
        prop::option::of(prop::collection::vec(values, MODELLED.len()))
    }

    /// One operation on a single stat.
    #[derive(Debug, Clone)]
    enum StatOp {
        Increase(i64),
        Decrease(i64),
        ResetPeak,
        ResetAccumulated,
        Reload,
    }

    proptest! {
        /// A stat, whose `freed` is derived, reads as PyTorch's four stored values would, from
        /// any loaded start and through wrapping totals.
        #[test]
        fn stat_follows_the_stored_rule(
            start in any::<[i64; 4]>(),
            ops in prop::collection::vec(prop_oneof![
                4 => any::<i64>().prop_map(StatOp::Increase),
                4 => any::<i64>().prop_map(StatOp::Decrease),
                1 => Just(StatOp::ResetPeak),
                1 => Just(StatOp::ResetAccumulated),
                1 => Just(StatOp::Reload),
            ], 1..100),
        ) {
            let [current, peak, allocated, freed] = start;
            let mut want = StatValue { current, peak, allocated, freed };
            let mut stat = Stat::from_value(want);
            prop_assert_eq!(stat.get(), want);
            for op in ops {
                match op {
                    StatOp::Increase(amount) => {
                        stat.increase(amount);
                        want.current = want.current.wrapping_add(amount);
                        want.peak = want.peak.max(want.current);
                        want.allocated = want.allocated.wrapping_add(amount);
                    }
                    StatOp::Decrease(amount) => {
                        stat.decrease(amount);
                        want.current = want.current.wrapping_sub(amount);
                        want.freed = want.freed.wrapping_add(amount);
                    }
                    StatOp::ResetPeak => {
                        stat.reset_peak();
                        want.peak = want.current;
                    }
                    StatOp::ResetAccumulated => {
                        stat.reset_accumulated();
                        (want.allocated, want.freed) = (0, 0);
                    }
                    StatOp::Reload => stat = Stat::from_value(stat.get()),
                }
                prop_assert_eq!(stat.get(), want);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// After every step, `active*` read from their offsets (Note [Active stats]) and the
        /// stats beside them equal PyTorch's rule applied literally to stat arrays of their
        /// own, from a fresh start or from arbitrary loaded values.
        #[test]
        fn active_stats_follow_pytorchs_rule(
            start in start(),
            steps in prop::collection::vec(step(), 1..200),
        ) {
            let reference: Vec<StatArray> = match &start {
                None => (0..MODELLED.len()).map(|_| StatArray::default()).collect(),
                Some(values) => values
                    .iter()
                    .map(|(pools, all_peak)| {
                        let stat = |[current, peak, allocated, freed]: [i64; 4]| {
                            Stat::from_value(StatValue { current, peak, allocated, freed })
                        };
                        StatArray {
                            small_pool: stat(pools[0]),
                            large_pool: stat(pools[1]),
                            all_peak: AtomicI64::new(*all_peak),
                        }
                    })
                    .collect(),
            };
            let mut stats = match start {
                None => DeviceStats::new(-1),
                Some(_) => {
                    let mut map = BTreeMap::new();
                    for (name, array) in MODELLED.iter().zip(&reference) {
                        for (bucket, v) in array.buckets() {
                            for (field, value) in
                                [("current", v.current), ("peak", v.peak), ("allocated", v.allocated), ("freed", v.freed)]
                            {
                                map.insert(format!("{name}.{bucket}.{field}"), value);
                            }
                        }
                    }
                    DeviceStats::from_memory_stats(&map)
                }
            };
            let consistent = reference.iter().all(|a| a.buckets().iter().all(|(_, v)| *v == StatValue::default()));
            let [allocation, active, allocated_bytes, active_bytes, requested] = &reference[..] else {
                unreachable!("five modelled stats");
            };
            let (mut live, mut waiting) = (Vec::new(), Vec::new());
            for step in steps {
                match step {
                    Step::Alloc(small, size) => {
                        let pool = if small { PoolKind::Small } else { PoolKind::Large };
                        let asked = size / 2 + 1;
                        stats.count_alloc(pool, size, asked, false);
                        for (array, amount) in [(allocation, 1), (active, 1), (allocated_bytes, size), (active_bytes, size), (requested, asked)] {
                            array.increase(pool, amount);
                        }
                        live.push((pool, size, asked));
                    }
                    Step::FreeNow(i) if !live.is_empty() => {
                        let (pool, size, asked) = live.swap_remove(i % live.len());
                        stats.count_free(pool, size, asked, false);
                        for (array, amount) in [(allocation, 1), (active, 1), (allocated_bytes, size), (active_bytes, size), (requested, asked)] {
                            array.decrease(pool, amount);
                        }
                    }
                    Step::FreeWaiting(i) if !live.is_empty() => {
                        let (pool, size, asked) = live.swap_remove(i % live.len());
                        stats.count_free_requested(pool, size, false);
                        allocation.decrease(pool, 1);
                        allocated_bytes.decrease(pool, size);
                        waiting.push((pool, size, asked));
                    }
                    Step::Complete(i) if !waiting.is_empty() => {
                        let (pool, size, asked) = waiting.swap_remove(i % waiting.len());
                        stats.count_free_completed(pool, size, asked);
                        active.decrease(pool, 1);
                        active_bytes.decrease(pool, size);
                        requested.decrease(pool, asked);
                    }
                    Step::ResetPeak => {
                        stats.reset_peak();
                        reference.iter().for_each(StatArray::reset_peak);
                    }
                    Step::ResetAccumulated => {
                        stats.reset_accumulated();
                        reference.iter().for_each(StatArray::reset_accumulated);
                    }
                    Step::Reload => stats = DeviceStats::from_memory_stats(&stats.memory_stats()),
                    Step::Copy => stats = stats.copy(),
                    _ => {}
                }
                let got = [
                    stats.allocation.copy(),
                    stats.active(),
                    stats.allocated_bytes.copy(),
                    stats.active_bytes(),
                    stats.requested_bytes.copy(),
                ];
                for ((name, got), want) in MODELLED.iter().zip(&got).zip(&reference) {
                    prop_assert_eq!(got.buckets(), want.buckets(), "{}", name);
                }
                if consistent {
                    prop_assert_eq!(stats.tracking.load(Relaxed), !waiting.is_empty());
                }
            }
        }
    }

    /// Loaded stats whose offsets a wait brings to zero: after a peak reset tracking goes off,
    /// and the completion that turns it on again must first settle the peaks a malloc raised.
    #[test]
    fn tracking_resumed_by_a_completion_settles_the_peaks() {
        let map: BTreeMap<String, i64> = [
            ("allocation.small_pool.current", 2),
            ("active.small_pool.current", 1),
            ("allocated_bytes.small_pool.current", 200),
            ("active_bytes.small_pool.current", 100),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let stats = DeviceStats::from_memory_stats(&map);
        stats.count_free_requested(PoolKind::Small, 100, false);
        stats.reset_peak();
        assert!(
            !stats.tracking.load(Relaxed),
            "offsets are zero after the wait"
        );
        stats.count_alloc(PoolKind::Small, 300, 300, false);
        stats.count_free_completed(PoolKind::Small, 100, 300);
        // PyTorch's active stats saw 1 -> 2 (peak 2) and 100 -> 400 (peak 400), then fell.
        assert_eq!(stats.active().small_pool.get().peak, 2);
        assert_eq!(stats.active_bytes().small_pool.get().peak, 400);
        assert_eq!(stats.active_bytes().small_pool.current(), 300);
    }

    #[test]
    fn memory_stats_has_pytorchs_122_keys() {
        let stats = DeviceStats::new(-1);
        stats.allocated_bytes.increase(PoolKind::Small, 512);
        let m = stats.memory_stats();
        assert_eq!(m.len(), 123);
        assert_eq!(m["allocated_bytes.all.current"], 512);
        assert_eq!(m["allocated_bytes.small_pool.peak"], 512);
        assert_eq!(m["allocated_bytes.large_pool.current"], 0);
        assert_eq!(m["max_split_size"], -1);
        assert!(m.contains_key("oversize_segments.freed"));
        assert!(m.contains_key("num_sync_all_streams"));
    }
}
