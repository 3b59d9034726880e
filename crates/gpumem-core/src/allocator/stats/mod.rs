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
//! The pieces: `stat` (one statistic, its per-pool array, a counter), `active` (`active` and
//! `active_bytes` kept as offsets: Note [Active stats]), `memory_stats` (PyTorch's flat map,
//! both ways); this file holds [`DeviceStats`] and its one counting helper per event.

mod active;
mod memory_stats;
mod stat;

use std::sync::atomic::{
    AtomicBool,
    Ordering::{Acquire, Relaxed, Release},
};

use super::size::PoolKind;
use active::Derived;
pub(super) use active::slot;
pub use stat::{Counter, Stat, StatArray, StatValue};

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
    /// gpumem's own, outside PyTorch's map: requests a followed placement plan served from
    /// its regions and chunks (Note [Planned placement] in `ext/plan/mod.rs`).
    pub num_plan_hits: Counter,
    /// gpumem's own: requests a followed plan could not serve (no free block of its memory
    /// held them, or no region could be obtained), served by the caching allocator.
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
    use std::collections::BTreeMap;
    use std::sync::atomic::AtomicI64;

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
