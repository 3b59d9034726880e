//! The metric contract: every name, type, label set and help text that dashboards, alerts and
//! the chart rely on. Change them only together with those; `docs/metrics.md` is written from
//! it ([`reference_page`], checked current by the tests) and `tests/golden/metric-types.txt`
//! fixes every name and type.

/// Prometheus metric type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A value that goes up and down.
    Gauge,
    /// A monotonically increasing count (names end in `_total`).
    Counter,
}

/// One metric of the contract, as listed ([`CONTRACT`]).
#[derive(Debug)]
pub struct MetricDef {
    /// Full name.
    pub name: &'static str,
    /// HELP text.
    pub help: &'static str,
    /// Type.
    pub kind: Kind,
    /// Label names, in the order collectors give their values.
    pub labels: &'static [&'static str],
}

/// One metric of the contract with its `N` label names: a series gives exactly `N` values, in
/// their order (the collectors' `Families::of` takes `[&str; N]`), so a value cannot go
/// unpaired. It reads as its [`MetricDef`].
#[derive(Debug)]
pub struct Metric<const N: usize>(MetricDef);

impl<const N: usize> std::ops::Deref for Metric<N> {
    type Target = MetricDef;

    fn deref(&self) -> &MetricDef {
        &self.0
    }
}

/// Label names the agent writes beside the contract's, where known: a process's pod and
/// container (from the cgroup, or the pod network), the pod's names (the kubelet's log
/// directories), and a MIG device's (dcgm-exporter's spellings).
pub mod label {
    /// The pod's UID.
    pub const POD_UID: &str = "pod_uid";
    /// The container's 64-hex ID.
    pub const CONTAINER_ID: &str = "container_id";
    /// The pod's namespace.
    pub const POD_NAMESPACE: &str = "pod_namespace";
    /// The pod's name.
    pub const POD_NAME: &str = "pod_name";
    /// The container's name.
    pub const CONTAINER_NAME: &str = "container_name";
    /// A MIG device's GPU instance ID.
    pub const GPU_I_ID: &str = "GPU_I_ID";
    /// A MIG device's GPU instance profile.
    pub const GPU_I_PROFILE: &str = "GPU_I_PROFILE";
    /// A MIG device's UUID.
    pub const MIG_UUID: &str = "mig_uuid";
}

const NONE: &[&str] = &[];
const ALLOCATOR: &[&str] = &["gpu", "UUID", "pid", "allocator"];
const ALLOCATOR_POOL: &[&str] = &["gpu", "UUID", "pid", "allocator", "pool"];
const ALLOCATOR_SIZE: &[&str] = &["gpu", "UUID", "pid", "allocator", "segment_size"];
const ALLOCATOR_KIND: &[&str] = &["gpu", "UUID", "pid", "allocator", "kind"];
const DEVICE: &[&str] = &["gpu", "UUID"];
const MIG: &[&str] = &[
    "gpu",
    "UUID",
    label::GPU_I_ID,
    label::GPU_I_PROFILE,
    label::MIG_UUID,
];

macro_rules! metric {
    ($id:ident, $name:literal, $kind:ident, $labels:expr, $help:literal) => {
        #[doc = concat!("`", $name, "`")]
        pub const $id: Metric<{ $labels.len() }> = Metric(MetricDef {
            name: $name,
            help: $help,
            kind: Kind::$kind,
            labels: $labels,
        });
    };
}

metric!(
    ALLOCATED_BYTES,
    "gpumem_allocator_allocated_bytes",
    Gauge,
    ALLOCATOR_POOL,
    "Bytes in blocks the caching allocator has handed out (PyTorch allocated_bytes.<pool>.current)."
);
metric!(
    RESERVED_BYTES,
    "gpumem_allocator_reserved_bytes",
    Gauge,
    ALLOCATOR_POOL,
    "Bytes in segments the caching allocator obtained from the driver (PyTorch reserved_bytes)."
);
metric!(
    ACTIVE_BYTES,
    "gpumem_allocator_active_bytes",
    Gauge,
    ALLOCATOR_POOL,
    "Bytes allocated plus bytes freed but still waiting on other streams (PyTorch active_bytes)."
);
metric!(
    INACTIVE_SPLIT_BYTES,
    "gpumem_allocator_inactive_split_bytes",
    Gauge,
    ALLOCATOR_POOL,
    "Free bytes inside split segments, which cannot be returned to the driver: external fragmentation."
);
metric!(
    REQUESTED_BYTES,
    "gpumem_allocator_requested_bytes",
    Gauge,
    ALLOCATOR_POOL,
    "Bytes callers asked for, before rounding; allocated minus requested is the rounding loss."
);
metric!(
    PEAK_ALLOCATED_BYTES,
    "gpumem_allocator_peak_allocated_bytes",
    Gauge,
    ALLOCATOR,
    "Highest allocated bytes since start or the last peak reset (torch.cuda.max_memory_allocated)."
);
metric!(
    PEAK_RESERVED_BYTES,
    "gpumem_allocator_peak_reserved_bytes",
    Gauge,
    ALLOCATOR,
    "Highest reserved bytes since start or the last peak reset (torch.cuda.max_memory_reserved)."
);
metric!(
    MEMORY_LIMIT_BYTES,
    "gpumem_process_memory_limit_bytes",
    Gauge,
    &["gpu", "UUID", "pid", "variable"],
    "The device-memory limit a GPU-sharing layer (HAMi, volcano's vGPU) enforces on the process's container on this GPU, as the push hook read it from the variable the layer set in the container's environment (variable: CUDA_DEVICE_MEMORY_LIMIT_<i>, or CUDA_DEVICE_MEMORY_LIMIT for every device); with the process's pod labels. Compare it with the container's gpumem_process_used_bytes on the GPU."
);
metric!(
    UNMAPPED_BYTES,
    "gpumem_allocator_unmapped_bytes",
    Gauge,
    ALLOCATOR,
    "Of the reserved bytes, those whose physical memory a pool of the job has unmapped while the caching allocator still counts them reserved (vLLM's sleep mode, SGLang's torch_memory_saver paused, as the push hook reports them; 0 otherwise): resident nowhere, left out of NVML's per-process figure. What the process holds on the device is reserved minus these."
);
metric!(
    SEGMENTS,
    "gpumem_allocator_segments",
    Gauge,
    ALLOCATOR_POOL,
    "Segments the caching allocator holds (expandable segments are not counted)."
);
metric!(
    ALLOC_RETRIES,
    "gpumem_allocator_alloc_retries_total",
    Counter,
    ALLOCATOR,
    "Allocations that had to flush the whole cache and retry (num_alloc_retries); rising means memory pressure."
);
metric!(
    PLAN_REQUESTS,
    "gpumem_allocator_plan_requests_total",
    Counter,
    &["gpu", "UUID", "pid", "allocator", "outcome"],
    "Requests while an allocator follows a placement plan (plan:PATH): outcome hit (served from the plan's regions and chunks) or miss (the caching allocator served it). Only for allocators that follow a plan."
);
metric!(
    OOMS,
    "gpumem_allocator_ooms_total",
    Counter,
    ALLOCATOR,
    "Allocations that failed with CUDA out of memory (num_ooms)."
);
metric!(
    OOM_REJECTIONS,
    "gpumem_allocator_oom_rejections_total",
    Counter,
    ALLOCATOR,
    "Requests refused before the driver was asked, as past the per-process memory fraction (num_oom_rejections; throw_on_cudamalloc_oom, PyTorch 2.12+); not counted in the OOMs."
);
metric!(
    DEVICE_ALLOCS,
    "gpumem_allocator_device_allocs_total",
    Counter,
    ALLOCATOR,
    "cudaMalloc calls (or expandable-segment page maps) made by the allocator."
);
metric!(
    DEVICE_FREES,
    "gpumem_allocator_device_frees_total",
    Counter,
    ALLOCATOR,
    "cudaFree calls (or expandable-segment page unmaps) made by the allocator."
);
metric!(
    SYNC_ALL_STREAMS,
    "gpumem_allocator_sync_all_streams_total",
    Counter,
    ALLOCATOR,
    "Device-wide synchronisations caused by cache flushes (num_sync_all_streams)."
);
metric!(
    FRAGMENTATION_RATIO,
    "gpumem_allocator_fragmentation_ratio",
    Gauge,
    ALLOCATOR,
    "(reserved - allocated) / reserved: the share of reserved memory no tensor uses; 0 when nothing is reserved."
);
metric!(
    INACTIVE_SPLIT_RATIO,
    "gpumem_allocator_inactive_split_ratio",
    Gauge,
    ALLOCATOR,
    "inactive split bytes / reserved bytes: the share of reserved memory stranded in split segments."
);
metric!(
    LARGEST_FREE_BLOCK,
    "gpumem_allocator_largest_free_block_bytes",
    Gauge,
    ALLOCATOR,
    "Largest cached free block: the biggest request the allocator can serve without the driver (for pushed PyTorch processes: as of their last memory snapshot, periodic or at an out-of-memory error; its age is gpumem_allocator_cache_age_seconds)."
);
metric!(
    SEGMENTS_BY_SIZE,
    "gpumem_allocator_segments_by_size",
    Gauge,
    ALLOCATOR_SIZE,
    "Segments whose size is in (segment_size/2, segment_size] (for pushed PyTorch processes: in their last memory snapshot)."
);
metric!(
    SEGMENT_FREE_BYTES_BY_SIZE,
    "gpumem_allocator_segment_free_bytes_by_size",
    Gauge,
    ALLOCATOR_SIZE,
    "Free bytes cached in the segments of each size class: reserved memory only requests up to the largest free block can use."
);
metric!(
    CACHE_AGE,
    "gpumem_allocator_cache_age_seconds",
    Gauge,
    ALLOCATOR,
    "Seconds since the largest free block and segments by size were read: for a pushed process, since the agent received the push carrying its last memory snapshot (the hook takes them periodically where the job's PyTorch makes them cheap, and at each out-of-memory error); absent while none was read."
);
metric!(
    LIMIT_BYTES,
    "gpumem_allocator_limit_bytes",
    Gauge,
    ALLOCATOR,
    "The most the allocator may hold, where it reports a limit (XLA's bytes_limit: its preallocated region, or what XLA_PYTHON_CLIENT_MEM_FRACTION allows)."
);
metric!(
    ALLOCATOR_INFO,
    "gpumem_allocator_info",
    Gauge,
    &["gpu", "UUID", "pid", "allocator", "version", "config"],
    "The allocator and its configuration (PYTORCH_CUDA_ALLOC_CONF syntax); always 1."
);
metric!(
    DEVICE_TOTAL,
    "gpumem_device_total_bytes",
    Gauge,
    DEVICE,
    "Device memory, as NVML (nvidia-smi) reports it."
);
metric!(
    DEVICE_USED,
    "gpumem_device_used_bytes",
    Gauge,
    DEVICE,
    "Device memory in use by all processes, as NVML (nvidia-smi) reports it."
);
metric!(
    DEVICE_FREE,
    "gpumem_device_free_bytes",
    Gauge,
    DEVICE,
    "Device memory free, as NVML (nvidia-smi) reports it."
);
metric!(
    DEVICE_RESERVED,
    "gpumem_device_reserved_bytes",
    Gauge,
    DEVICE,
    "Device memory the driver reserves for itself, as NVML reports it."
);
metric!(
    MIG_TOTAL,
    "gpumem_mig_total_bytes",
    Gauge,
    MIG,
    "Memory of a MIG device's GPU instance, as NVML reports it; gpu and UUID name the parent GPU, GPU_I_ID and GPU_I_PROFILE the instance (as dcgm-exporter labels them), mig_uuid the MIG device. Compute instances of one GPU instance share its memory and report the same figures."
);
metric!(
    MIG_USED,
    "gpumem_mig_used_bytes",
    Gauge,
    MIG,
    "Memory in use in a MIG device's GPU instance, as NVML reports it (labels as gpumem_mig_total_bytes)."
);
metric!(
    MIG_FREE,
    "gpumem_mig_free_bytes",
    Gauge,
    MIG,
    "Memory free in a MIG device's GPU instance, as NVML reports it (labels as gpumem_mig_total_bytes)."
);
metric!(
    PROCESS_USED,
    "gpumem_process_used_bytes",
    Gauge,
    &[
        "gpu",
        "UUID",
        "pid",
        "process",
        "pod_uid",
        "container_id",
        "pod_namespace",
        "pod_name",
        "container_name",
    ],
    "Device memory a process uses, as NVML reports it (its allocator's reserved bytes plus CUDA context, NCCL and library workspaces); pod_uid and container_id name its Kubernetes pod and container, empty outside one; pod_namespace, pod_name and container_name name them, from the kubelet's log directories, where the agent can read them. A process on a MIG device also carries GPU_I_ID, GPU_I_PROFILE and mig_uuid (gpu and UUID name the parent GPU), as do its allocator's series."
);
metric!(
    GPU_ASSIGNED,
    "gpumem_gpu_assigned_info",
    Gauge,
    &[
        "gpu",
        "UUID",
        "pod_namespace",
        "pod_name",
        "container_name",
        "claim_namespace",
        "claim_name",
        "dra_driver",
        "dra_pool",
        "dra_device",
    ],
    "1 for each container the kubelet assigned the GPU to (pod-resources API; a time-sliced GPU lists several); a MIG device's also carry GPU_I_ID, GPU_I_PROFILE and mig_uuid. A device assigned through Dynamic Resource Allocation carries its ResourceClaim (claim_namespace, claim_name) and its driver, pool and device names (dra_driver, dra_pool, dra_device; empty for a device plugin's); one the agent cannot resolve to a GPU of the node has gpu and UUID empty."
);
metric!(
    DEVICE_INFO,
    "gpumem_device_info",
    Gauge,
    &["gpu", "UUID", "model", "driver_version", "simulated"],
    "GPU identity; always 1. simulated=\"true\" for the simulated node of gpumem demo."
);
metric!(
    SOURCE_UP,
    "gpumem_source_up",
    Gauge,
    &["source"],
    "1 when the source (nvml, simulated, allocator, pod_logs, pod_resources) was read successfully at the last attempt, else 0."
);
metric!(
    COLLECT_DURATION,
    "gpumem_collect_duration_seconds",
    Gauge,
    &["source"],
    "How long the last read of the source took."
);
metric!(
    INGEST_PAYLOADS,
    "gpumem_ingest_payloads_total",
    Counter,
    &["result"],
    "Pushed statistics payloads, by result: accepted, or why they were refused (malformed, truncated, invalid, stale, rate_limited, capacity, series_budget, conflict, too_large, forbidden, unknown_peer, peer_is_node, not_in_pod)."
);
metric!(
    INGEST_TRACKED,
    "gpumem_ingest_tracked_processes",
    Gauge,
    NONE,
    "Processes whose pushed statistics the agent currently serves."
);
metric!(
    RECORDINGS_STORED,
    "gpumem_recordings_stored",
    Gauge,
    NONE,
    "Recordings (memory snapshots jobs uploaded at an OOM) the agent keeps (GET /api/v1/recordings lists them)."
);
metric!(
    RECORDINGS_STORED_BYTES,
    "gpumem_recordings_stored_bytes",
    Gauge,
    NONE,
    "Bytes of the recordings the agent keeps, as stored (gzipped)."
);
metric!(
    RECORDINGS_REFUSED,
    "gpumem_recordings_refused_total",
    Counter,
    &["reason"],
    "Recording uploads refused, by reason (too_large, truncated, malformed, forbidden, not_in_pod, rate_limited, capacity, ...)."
);
metric!(
    RECORDINGS_UPLOADED,
    "gpumem_recordings_uploaded_total",
    Counter,
    &["result"],
    "Attempts to archive a kept recording in object storage (--recordings-url), by result: uploaded, failed (tried again with backoff), evicted (left the spool by its caps before it was archived: lost). Absent where the agent archives nothing."
);
metric!(
    RECORDINGS_UPLOAD_PENDING,
    "gpumem_recordings_upload_pending",
    Gauge,
    NONE,
    "Kept recordings not archived yet (the spool's queue). Absent where the agent archives nothing."
);
metric!(
    INGEST_LAST_PUSH_AGE,
    "gpumem_ingest_last_push_age_seconds",
    Gauge,
    &["pid"],
    "Seconds since the process's last accepted push (a job that stopped pushing grows old here before its series expire)."
);
metric!(
    OOM_BREAKDOWN,
    "gpumem_oom_breakdown_bytes",
    Gauge,
    ALLOCATOR_KIND,
    "Where the device's memory was at the process's last out-of-memory error, in parts that add up to the device's total (kind: allocated, rounding, fragmented, other_streams, other_pools, pending_stream_frees, free, outside_allocator); kept with the process's series, until its next OOM."
);
metric!(
    LAST_OOM_TIMESTAMP,
    "gpumem_allocator_last_oom_timestamp_seconds",
    Gauge,
    ALLOCATOR,
    "When the process last ran out of memory (Unix seconds), by the job's OOM observer or the agent's receipt of a grown num_ooms; kept while the process's series are, exit grace included."
);
metric!(
    POD_OOMS,
    "gpumem_pod_ooms_total",
    Counter,
    &[
        "pod_uid",
        "container_id",
        "pod_namespace",
        "pod_name",
        "container_name",
    ],
    "Out-of-memory errors in the container's processes (attributed over the push socket) since the agent first saw the container; kept for the retention period after its last OOM, beyond the processes."
);
metric!(
    BUILD_INFO,
    "gpumem_build_info",
    Gauge,
    &["version"],
    "gpumem's version; always 1."
);

metric!(
    HOST_PINNED_ALLOCATED_BYTES,
    "gpumem_host_pinned_allocated_bytes",
    Gauge,
    &["pid"],
    "Pinned host memory PyTorch's host allocator holds, blocks in use and cached (host_memory_stats allocated_bytes.current; blocks are rounded up to powers of two and kept cached for reuse)."
);
metric!(
    HOST_PINNED_ACTIVE_BYTES,
    "gpumem_host_pinned_active_bytes",
    Gauge,
    &["pid"],
    "Pinned host memory in use: blocks handed out, or freed and waiting on their streams (host_memory_stats active_bytes.current)."
);
metric!(
    HOST_PINNED_ALLOCATIONS,
    "gpumem_host_pinned_allocations",
    Gauge,
    &["pid"],
    "Blocks PyTorch's host allocator holds, in use and cached (host_memory_stats allocations.current)."
);
metric!(
    HOST_PINNED_ACTIVE_REQUESTS,
    "gpumem_host_pinned_active_requests",
    Gauge,
    &["pid"],
    "Pinned blocks in use (host_memory_stats active_requests.current)."
);
metric!(
    HOST_PINNED_ALLOCS,
    "gpumem_host_pinned_allocs_total",
    Counter,
    &["pid"],
    "Pinned allocations obtained from the driver, cudaHostAlloc or cudaHostRegister (host_memory_stats num_host_alloc)."
);
metric!(
    HOST_PINNED_FREES,
    "gpumem_host_pinned_frees_total",
    Counter,
    &["pid"],
    "Pinned allocations given back to the driver (host_memory_stats num_host_free)."
);
metric!(
    HOST_PINNED_ALLOC_SECONDS,
    "gpumem_host_pinned_alloc_seconds_total",
    Counter,
    &["pid"],
    "Seconds spent obtaining pinned memory from the driver (host_memory_stats host_alloc_time.total, from microseconds): page pinning stalls the host thread."
);

/// Every metric of the contract.
pub const CONTRACT: [&MetricDef; 56] = [
    &ALLOCATED_BYTES.0,
    &RESERVED_BYTES.0,
    &ACTIVE_BYTES.0,
    &INACTIVE_SPLIT_BYTES.0,
    &REQUESTED_BYTES.0,
    &PEAK_ALLOCATED_BYTES.0,
    &PEAK_RESERVED_BYTES.0,
    &UNMAPPED_BYTES.0,
    &MEMORY_LIMIT_BYTES.0,
    &SEGMENTS.0,
    &ALLOC_RETRIES.0,
    &PLAN_REQUESTS.0,
    &OOMS.0,
    &OOM_REJECTIONS.0,
    &DEVICE_ALLOCS.0,
    &DEVICE_FREES.0,
    &SYNC_ALL_STREAMS.0,
    &FRAGMENTATION_RATIO.0,
    &INACTIVE_SPLIT_RATIO.0,
    &LARGEST_FREE_BLOCK.0,
    &SEGMENTS_BY_SIZE.0,
    &SEGMENT_FREE_BYTES_BY_SIZE.0,
    &CACHE_AGE.0,
    &LIMIT_BYTES.0,
    &ALLOCATOR_INFO.0,
    &LAST_OOM_TIMESTAMP.0,
    &OOM_BREAKDOWN.0,
    &DEVICE_TOTAL.0,
    &DEVICE_USED.0,
    &DEVICE_FREE.0,
    &DEVICE_RESERVED.0,
    &MIG_TOTAL.0,
    &MIG_USED.0,
    &MIG_FREE.0,
    &PROCESS_USED.0,
    &GPU_ASSIGNED.0,
    &DEVICE_INFO.0,
    &SOURCE_UP.0,
    &COLLECT_DURATION.0,
    &INGEST_PAYLOADS.0,
    &INGEST_TRACKED.0,
    &RECORDINGS_STORED.0,
    &RECORDINGS_STORED_BYTES.0,
    &RECORDINGS_REFUSED.0,
    &RECORDINGS_UPLOADED.0,
    &RECORDINGS_UPLOAD_PENDING.0,
    &INGEST_LAST_PUSH_AGE.0,
    &POD_OOMS.0,
    &HOST_PINNED_ALLOCATED_BYTES.0,
    &HOST_PINNED_ACTIVE_BYTES.0,
    &HOST_PINNED_ALLOCATIONS.0,
    &HOST_PINNED_ACTIVE_REQUESTS.0,
    &HOST_PINNED_ALLOCS.0,
    &HOST_PINNED_FREES.0,
    &HOST_PINNED_ALLOC_SECONDS.0,
    &BUILD_INFO.0,
];

/// The contract as the Markdown page `docs/metrics.md`: every family with its type, labels and
/// help, in the contract's order.
pub fn reference_page() -> String {
    let mut page = String::from(
        "# The metric contract\n\n\
         Written from `src/metrics/contract.rs` (`GPUMEM_BLESS=1 cargo test --test it docs` \
         writes it again; the tests fail while it differs). Every series of an allocator also \
         carries, where known, the pod labels `pod_uid`, `container_id`, `pod_namespace`, \
         `pod_name` and `container_name`, a pushing job's own labels, and on a MIG device \
         `GPU_I_ID`, `GPU_I_PROFILE` and `mig_uuid`; Prometheus adds its target labels. \
         `allocator` is `gpumem` (gpumem's own), `pytorch` (a pushing PyTorch job's) or `xla` \
         (a pushing JAX job's: only the figures XLA reports, its one pool as `pool=\"all\"`; \
         see docs/jobs.md); `pool` is otherwise `small` or `large`.\n\n\
         | name | type | labels | meaning |\n|---|---|---|---|\n",
    );
    for def in CONTRACT {
        let kind = match def.kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        };
        let labels = def
            .labels
            .iter()
            .map(|l| format!("`{l}`"))
            .collect::<Vec<_>>()
            .join(", ");
        let help = def.help.replace('|', "\\|");
        page.push_str(&format!(
            "| `{}` | {kind} | {labels} | {help} |\n",
            def.name
        ));
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        let mut names: Vec<_> = CONTRACT.iter().map(|d| d.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CONTRACT.len(), "names are unique");
        for d in CONTRACT {
            assert!(d.name.starts_with("gpumem_"), "{}", d.name);
            assert_eq!(
                d.kind == Kind::Counter,
                d.name.ends_with("_total"),
                "{}",
                d.name
            );
            assert!(!d.help.is_empty());
        }
    }
}
