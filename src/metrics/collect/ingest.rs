//! The ingest's series: its results, its tracked processes and their last push's age, the
//! recordings it keeps, per-pod OOM counts, and each pushed process's pinned host memory.

use crate::sources::IngestReport;

use super::super::contract as c;
use super::super::names::{Names, ProcessPods, process_labels};
use super::Families;

/// Each pushed process's pinned host memory, labelled as its allocators are.
pub(super) fn collect_hosts(
    f: &mut Families,
    report: &IngestReport,
    pods: &ProcessPods<'_>,
    names: Names<'_>,
) {
    for h in &report.hosts {
        // Pinned memory belongs to no GPU: the process's pod from any GPU NVML saw it on.
        let nvml = pods
            .iter()
            .find_map(|(&(_, pid), &container)| (pid == h.pid).then_some(container));
        let extra = process_labels(&h.labels, nvml, names);
        let pid = h.pid.to_string();
        let p = &h.pinned;
        // (metric, figure, figures per metric unit): microseconds become seconds.
        for (def, value, per_unit) in [
            (&c::HOST_PINNED_ALLOCATED_BYTES, p.allocated_bytes, 1.0),
            (&c::HOST_PINNED_ACTIVE_BYTES, p.active_bytes, 1.0),
            (&c::HOST_PINNED_ALLOCATIONS, p.allocations, 1.0),
            (&c::HOST_PINNED_ACTIVE_REQUESTS, p.active_requests, 1.0),
            (&c::HOST_PINNED_ALLOCS, p.host_allocs, 1.0),
            (&c::HOST_PINNED_FREES, p.host_frees, 1.0),
            (&c::HOST_PINNED_ALLOC_SECONDS, p.alloc_time_us, 1e6),
        ] {
            if let Some(value) = value {
                f.of(def)
                    .push_with([&pid], extra.as_ref(), value as f64 / per_unit);
            }
        }
    }
}

/// The ingest's own series.
pub(super) fn collect(f: &mut Families, report: &IngestReport, names: Names<'_>) {
    for (result, count) in &report.results {
        f.of(&c::INGEST_PAYLOADS).push([result], *count as f64);
    }
    f.of(&c::INGEST_TRACKED)
        .push([], report.processes.len() as f64);
    for p in &report.processes {
        f.of(&c::INGEST_LAST_PUSH_AGE)
            .push([&p.pid.to_string()], p.last_push.elapsed().as_secs_f64());
    }
    if let Some(recordings) = &report.recordings {
        f.of(&c::RECORDINGS_STORED)
            .push([], recordings.stored as f64);
        f.of(&c::RECORDINGS_STORED_BYTES)
            .push([], recordings.bytes as f64);
        for (reason, n) in &recordings.refused {
            f.of(&c::RECORDINGS_REFUSED).push([reason], *n as f64);
        }
        if let Some(uploads) = &recordings.uploads {
            for (result, n) in &uploads.results {
                f.of(&c::RECORDINGS_UPLOADED).push([result], *n as f64);
            }
            f.of(&c::RECORDINGS_UPLOAD_PENDING)
                .push([], uploads.pending as f64);
        }
    }
    for pod in &report.pod_ooms {
        let [namespace, name, container] = names.of(&pod.pod_uid, &pod.container_id);
        f.of(&c::POD_OOMS).push(
            [
                &pod.pod_uid,
                &pod.container_id,
                &namespace,
                &name,
                &container,
            ],
            pod.ooms as f64,
        );
    }
}
