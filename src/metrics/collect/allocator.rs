//! Each allocator's series: its counters (a pushed process's or one this process holds),
//! placed where NVML reports its device.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::allocator::size::PoolKind;
use crate::sources::{AllocatorSource, UNKNOWN_SIZE};
use crate::telemetry::{MigSample, SourceReport, uuid_body};

use super::super::contract as c;
use super::Families;
use super::names::{Names, ProcessPods, mig_labels, process_labels};

/// `part / whole`, 0 for an empty whole; never negative, whatever a source reports.
fn ratio(part: i64, whole: i64) -> f64 {
    if whole <= 0 {
        0.0
    } else {
        part.max(0) as f64 / whole as f64
    }
}

/// Where a device lies on the node, as NVML reports it: its GPU's index and UUID, and the MIG
/// device when it is one.
#[derive(Clone, Copy)]
struct Place<'a> {
    index: u32,
    uuid: &'a str,
    mig: Option<&'a MigSample>,
}

/// Every GPU and MIG device NVML reports, by UUID and by the UUID's body. A pushed device's
/// index is the job's CUDA ordinal (in a container given host GPU 5 it says 0) and a MIG job's
/// hook may spell its device `GPU-…`, so pushed series take NVML's place.
pub(super) struct Places<'a> {
    exact: HashMap<&'a str, Place<'a>>,
    body: HashMap<String, Place<'a>>,
}

impl<'a> Places<'a> {
    pub(super) fn of(reports: &'a [Arc<SourceReport>]) -> Self {
        let mut places = Places {
            exact: HashMap::new(),
            body: HashMap::new(),
        };
        let gpus = reports
            .iter()
            .filter_map(|r| r.sample.as_ref())
            .flat_map(|node| &node.gpus);
        for gpu in gpus {
            for (mig, uuid, _) in gpu.devices() {
                let place = Place {
                    index: gpu.index,
                    uuid: &gpu.uuid,
                    mig,
                };
                places.exact.insert(uuid, place);
                places.body.insert(uuid_body(uuid), place);
            }
        }
        places
    }

    fn find(&self, uuid: &str) -> Option<Place<'a>> {
        self.exact
            .get(uuid)
            .or_else(|| self.body.get(&uuid_body(uuid)))
            .copied()
    }
}

/// An allocator's series. Its extra labels: its own (a push's job, rank, pod_uid and
/// container_id), the pod of its process as NVML's view gives it where the source says none,
/// the pod's names where known, and its MIG device's where it runs on one.
pub(super) fn collect(
    f: &mut Families,
    s: &AllocatorSource,
    pods: &ProcessPods<'_>,
    names: Names<'_>,
    places: &Places<'_>,
) {
    let place = places.find(&s.uuid);
    let (index, uuid) = place.map_or((s.gpu, s.uuid.as_str()), |p| (p.index, p.uuid));
    let (gpu, pid) = (index.to_string(), s.pid.to_string());
    let mut extra = process_labels(&s.labels, pods.get(&(uuid, s.pid)).copied(), names);
    if let Some(mig) = place.and_then(|p| p.mig) {
        extra.to_mut().extend(mig_labels(mig));
    }
    let extra = extra.as_ref();
    let base = [gpu.as_str(), uuid, pid.as_str(), s.allocator.label()];
    let st = &s.stats;
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
                .push_with(&labels, extra, array.pool(pool).current() as f64);
        }
    }
    let allocated = st.allocated_bytes.all();
    let reserved = st.reserved_bytes.all();
    let inactive_split = st.inactive_split_bytes.all_current();
    for (def, value) in [
        (&c::PEAK_ALLOCATED_BYTES, allocated.peak as f64),
        (&c::PEAK_RESERVED_BYTES, reserved.peak as f64),
        (&c::ALLOC_RETRIES, st.num_alloc_retries.get() as f64),
        (&c::OOMS, st.num_ooms.get() as f64),
        (&c::OOM_REJECTIONS, st.num_oom_rejections.get() as f64),
        (&c::DEVICE_ALLOCS, st.num_device_alloc.get() as f64),
        (&c::DEVICE_FREES, st.num_device_free.get() as f64),
        (&c::SYNC_ALL_STREAMS, st.num_sync_all_streams.get() as f64),
        (
            &c::FRAGMENTATION_RATIO,
            ratio(
                reserved.current.saturating_sub(allocated.current),
                reserved.current,
            ),
        ),
        (
            &c::INACTIVE_SPLIT_RATIO,
            ratio(inactive_split, reserved.current),
        ),
    ] {
        f.of(def).push_with(&base, extra, value);
    }
    let (hits, misses) = (st.num_plan_hits.get(), st.num_plan_misses.get());
    if hits + misses > 0 {
        for (outcome, n) in [("hit", hits), ("miss", misses)] {
            let labels = [base[0], base[1], base[2], base[3], outcome];
            f.of(&c::PLAN_REQUESTS).push_with(&labels, extra, n as f64);
        }
    }
    let last_oom = s.last_oom();
    // A push says when in its own field; an allocator this process holds with its OOM.
    let at = s
        .last_oom_unix_seconds
        .or_else(|| last_oom.as_ref().and_then(|o| o.at_unix_seconds));
    if let Some(t) = at {
        f.of(&c::LAST_OOM_TIMESTAMP).push_with(&base, extra, t);
    }
    if let Some(oom) = last_oom {
        for (field, _, bytes) in oom.breakdown.parts() {
            // The metric names live tensors' bytes `allocated` (the JSON's `requested`).
            let kind = if field == "requested" {
                "allocated"
            } else {
                field
            };
            if let Some(bytes) = bytes {
                let labels = [base[0], base[1], base[2], base[3], kind];
                f.of(&c::OOM_BREAKDOWN)
                    .push_with(&labels, extra, bytes as f64);
            }
        }
    }
    let largest = s.largest_free_block.load(Ordering::Relaxed);
    if largest != UNKNOWN_SIZE {
        f.of(&c::LARGEST_FREE_BLOCK)
            .push_with(&base, extra, largest as f64);
    }
    let classes = s
        .segment_classes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for class in classes {
        let size = class.size.to_string();
        let labels = [base[0], base[1], base[2], base[3], size.as_str()];
        f.of(&c::SEGMENTS_BY_SIZE)
            .push_with(&labels, extra, class.segments as f64);
        f.of(&c::SEGMENT_FREE_BYTES_BY_SIZE)
            .push_with(&labels, extra, class.free_bytes as f64);
    }
    f.of(&c::ALLOCATOR_INFO).push_with(
        &[base[0], base[1], base[2], base[3], &s.version, &s.config],
        extra,
        1.0,
    );
}
