//! Each allocator's series: its counters (a pushed process's or one this process holds),
//! placed where NVML reports its device (the snapshot's [`PlacedAllocator`]).

use std::time::Instant;

use crate::allocator::size::PoolKind;
use crate::sources::XlaFigures;

use super::super::contract as c;
use super::super::snapshot::{PlacedAllocator, oom_parts, ratio};
use super::Families;

/// An allocator's series, with its placed labels beyond the contract's, in a snapshot
/// taken at `taken`: a caching allocator's (gpumem's, PyTorch's) or XLA's, then what any
/// allocator's owner published (its cache, its last OOM) and its info series.
pub(super) fn collect(f: &mut Families, a: &PlacedAllocator, taken: Instant) {
    let s = &a.source;
    let (gpu, pid) = (a.gpu.to_string(), s.pid.to_string());
    let extra = a.labels.as_slice();
    let base = [
        gpu.as_str(),
        a.uuid.as_str(),
        pid.as_str(),
        s.allocator.label(),
    ];
    match s.xla {
        Some(xla) => xla_figures(f, a, base, xla),
        None => caching_figures(f, a, base),
    }
    let last_oom = a.last_oom();
    if let Some(t) = a.last_oom_at(last_oom.as_ref()) {
        f.of(&c::LAST_OOM_TIMESTAMP).push_with(base, extra, t);
    }
    for (kind, bytes) in last_oom.iter().flat_map(oom_parts) {
        let labels = [base[0], base[1], base[2], base[3], kind];
        f.of(&c::OOM_BREAKDOWN)
            .push_with(labels, extra, bytes as f64);
    }
    if let Some(limit) = &s.memory_limit {
        let labels = [base[0], base[1], base[2], limit.variable.as_str()];
        f.of(&c::MEMORY_LIMIT_BYTES)
            .push_with(labels, extra, limit.bytes as f64);
    }
    if let Some(cache) = &a.cache {
        f.of(&c::LARGEST_FREE_BLOCK)
            .push_with(base, extra, cache.largest_free_block as f64);
    }
    if let Some(age) = a.cache_age(taken) {
        f.of(&c::CACHE_AGE)
            .push_with(base, extra, age.as_secs_f64());
    }
    for class in a.cache.iter().flat_map(|c| &c.segments_by_size) {
        let size = class.size.to_string();
        let labels = [base[0], base[1], base[2], base[3], size.as_str()];
        f.of(&c::SEGMENTS_BY_SIZE)
            .push_with(labels, extra, class.segments as f64);
        f.of(&c::SEGMENT_FREE_BYTES_BY_SIZE)
            .push_with(labels, extra, class.free_bytes as f64);
    }
    f.of(&c::ALLOCATOR_INFO).push_with(
        [base[0], base[1], base[2], base[3], &s.version, &s.config],
        extra,
        1.0,
    );
}

/// A caching allocator's figures: per pool, and its counters.
fn caching_figures(f: &mut Families, a: &PlacedAllocator, base: [&str; 4]) {
    let (st, extra) = (&a.source.stats, a.labels.as_slice());
    let active_bytes = st.active_bytes();
    for pool in [PoolKind::Small, PoolKind::Large] {
        let labels = [base[0], base[1], base[2], base[3], pool.segment_type()];
        for (def, array) in [
            (&c::ALLOCATED_BYTES, &st.allocated_bytes),
            (&c::RESERVED_BYTES, &st.reserved_bytes),
            (&c::ACTIVE_BYTES, &active_bytes),
            (&c::INACTIVE_SPLIT_BYTES, &st.inactive_split_bytes),
            (&c::REQUESTED_BYTES, &st.requested_bytes),
            (&c::SEGMENTS, &st.segment),
        ] {
            f.of(def)
                .push_with(labels, extra, array.pool(pool).current() as f64);
        }
    }
    let allocated = st.allocated_bytes.all();
    let reserved = st.reserved_bytes.all();
    let inactive_split = st.inactive_split_bytes.all_current();
    for (def, value) in [
        (&c::PEAK_ALLOCATED_BYTES, allocated.peak as f64),
        (&c::PEAK_RESERVED_BYTES, reserved.peak as f64),
        (&c::UNMAPPED_BYTES, a.source.unmapped as f64),
        (&c::ALLOC_RETRIES, st.num_alloc_retries.get() as f64),
        (&c::OOMS, st.num_ooms.get() as f64),
        (&c::OOM_REJECTIONS, st.num_oom_rejections.get() as f64),
        (&c::DEVICE_ALLOCS, st.num_device_alloc.get() as f64),
        (&c::DEVICE_FREES, st.num_device_free.get() as f64),
        (&c::SYNC_ALL_STREAMS, st.num_sync_all_streams.get() as f64),
        (&c::FRAGMENTATION_RATIO, a.fragmentation()),
        (
            &c::INACTIVE_SPLIT_RATIO,
            ratio(inactive_split, reserved.current),
        ),
    ] {
        f.of(def).push_with(base, extra, value);
    }
    let (hits, misses) = (st.num_plan_hits.get(), st.num_plan_misses.get());
    if hits + misses > 0 {
        for (outcome, n) in [("hit", hits), ("miss", misses)] {
            let labels = [base[0], base[1], base[2], base[3], outcome];
            f.of(&c::PLAN_REQUESTS).push_with(labels, extra, n as f64);
        }
    }
}

/// XLA's figures, those it reported ([`crate::ingest::xla`]): its one pool as `pool="all"`.
/// Nothing of a caching allocator's that XLA's lacks (segments, retries, driver calls), and
/// no fragmentation ratio: its pool is preallocated, so what no tensor uses in it is
/// headroom, not fragmentation.
fn xla_figures(f: &mut Families, a: &PlacedAllocator, base: [&str; 4], xla: XlaFigures) {
    let (st, extra) = (&a.source.stats, a.labels.as_slice());
    let pooled = [base[0], base[1], base[2], base[3], XLA_POOL];
    if xla.has_in_use {
        f.of(&c::ALLOCATED_BYTES)
            .push_with(pooled, extra, a.allocated as f64);
    }
    if xla.has_pool {
        f.of(&c::RESERVED_BYTES)
            .push_with(pooled, extra, a.reserved as f64);
    }
    for (def, reported, value) in [
        (
            &c::PEAK_ALLOCATED_BYTES,
            xla.has_peak_in_use,
            st.allocated_bytes.all().peak as f64,
        ),
        (
            &c::PEAK_RESERVED_BYTES,
            xla.has_peak_pool,
            st.reserved_bytes.all().peak as f64,
        ),
        (&c::OOMS, xla.has_ooms, st.num_ooms.get() as f64),
        (
            &c::LIMIT_BYTES,
            xla.limit.is_some(),
            xla.limit.unwrap_or_default() as f64,
        ),
    ] {
        if reported {
            f.of(def).push_with(base, extra, value);
        }
    }
}

/// The `pool` label of an allocator with one pool for every size.
const XLA_POOL: &str = "all";
