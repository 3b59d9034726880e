//! `torch.cuda.memory_stats()`: PyTorch's flat map of a device's statistics, made from
//! [`DeviceStats`] and read back into one (a pushed job's figures, a recording's).
//!
//! # Invariants
//! - The map has PyTorch's keys (123, 2.12's), sorted; reading it back gives the same map.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64};

use super::DeviceStats;
use super::active::Derived;
use super::stat::{Counter, Stat, StatArray, StatValue};

impl DeviceStats {
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
}
