#!/usr/bin/env python3
"""Writes gpumem's Grafana dashboards (dashboards/*.json and the chart's byte-identical copies
in helm/gpumem/files/dashboards/) from the definitions below; `--check` only compares and
exits non-zero when a file is stale. Python's standard library only.

Every panel query uses only the metric contract (tests/it/assets.rs checks it, and checks each
panel's unit against its query's), and returns data from a real Prometheus scraping the demo
(tests/it/agent.rs)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DS = {"type": "prometheus", "uid": "${datasource}"}
GPU = 'cluster=~"$cluster", instance=~"$node", gpu=~"$gpu"'
POD = GPU + ', pod_namespace=~"$namespace", pod_name=~"$pod"'
# Per-process series of no GPU (pinned host memory).
HOST = 'cluster=~"$cluster", instance=~"$node", pod_namespace=~"$namespace", pod_name=~"$pod"'
LINKS = [{"title": "gpumem", "type": "dashboards", "tags": ["gpumem"], "asDropdown": False,
          "includeVars": True, "keepTime": True}]


def variable(name, label, query):
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
            "current": {"text": "All", "value": "$__all"}, "options": []}


VARIABLES = [
    {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
     "current": {}, "hide": 0, "refresh": 1, "options": []},
    variable("cluster", "Cluster", "label_values(gpumem_build_info, cluster)"),
    variable("node", "Node", 'label_values(gpumem_build_info{cluster=~"$cluster"}, instance)'),
    variable("gpu", "GPU",
             'label_values(gpumem_device_info{cluster=~"$cluster", instance=~"$node"}, gpu)'),
    variable("namespace", "Namespace",
             'label_values(gpumem_process_used_bytes{cluster=~"$cluster", instance=~"$node"}, '
             'pod_namespace)'),
    variable("pod", "Pod",
             'label_values(gpumem_process_used_bytes{cluster=~"$cluster", instance=~"$node", '
             'pod_namespace=~"$namespace"}, pod_name)'),
]

# OOMs as annotations: the part-1 timestamp of each process's last OOM, placed at that time.
OOM_ANNOTATION = {
    "name": "OOMs", "datasource": DS, "enable": True, "iconColor": "red",
    "expr": "max by (instance, gpu, pid, pod_namespace, pod_name) "
            f"(gpumem_allocator_last_oom_timestamp_seconds{{{POD}}}) * 1000",
    "useValueForTime": True, "step": "60s",
    "titleFormat": "OOM: {{pod_namespace}}/{{pod_name}} pid {{pid}}",
    "textFormat": "node {{instance}}, GPU {{gpu}}",
}


def target(ref, expr, legend=None, table=False):
    t = {"datasource": DS, "expr": expr, "refId": ref}
    if legend is not None:
        t["legendFormat"] = legend
    if table:
        t.update(instant=True, format="table")
    return t


def panel(kind, title, description, pos, targets, unit=None, **extra):
    p = {"type": kind, "title": title, "description": description, "datasource": DS,
         "gridPos": dict(zip("xywh", pos)), "targets": targets,
         "fieldConfig": {"defaults": {} if unit is None else {"unit": unit}, "overrides": []},
         "options": {}}
    p.update(extra)
    return p


def timeseries(title, description, pos, targets, unit, stacked=False):
    p = panel("timeseries", title, description, pos, targets, unit)
    p["fieldConfig"]["defaults"]["custom"] = {
        "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
        "fillOpacity": 60 if stacked else 0, "lineWidth": 1}
    p["options"] = {"legend": {"displayMode": "table", "placement": "bottom"},
                    "tooltip": {"mode": "multi", "sort": "none"}}
    return p


def stat(title, description, pos, expr, legend, unit, steps):
    p = panel("stat", title, description, pos, [target("A", expr, legend)], unit)
    p["fieldConfig"]["defaults"]["thresholds"] = {
        "mode": "absolute",
        "steps": [{"color": color, "value": value} for value, color in steps]}
    p["options"] = {"colorMode": "background", "graphMode": "area", "reduceOptions": {
        "calcs": ["lastNotNull"], "fields": "", "values": False}}
    return p


def table(title, description, pos, targets, unit, columns, names, sort=None, labels_only=False):
    """A table of instant queries merged on their labels: `columns` orders the fields,
    `names` renames them ("Value #A" is target A's value; a single query's is "Value").
    `labels_only` hides the value (an info metric's 1)."""
    if len(targets) == 1:
        columns = ["Value" if c == "Value #A" else c for c in columns]
        names = {("Value" if k == "Value #A" else k): v for k, v in names.items()}
    p = panel("table", title, description, pos, targets, unit)
    hidden = {"Time": True, "Value": True} if labels_only else {"Time": True}
    p["transformations"] = [
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {
            "excludeByName": hidden,
            "indexByName": {c: i for i, c in enumerate(columns)},
            "renameByName": names}},
    ]
    if sort:
        p["options"] = {"sortBy": [{"displayName": sort, "desc": True}]}
    return p


def by(labels, metric, selector):
    return f"sum by ({labels}) ({metric}{{{selector}}})"


IG = "instance, gpu"


def resident(labels, selector):
    """What the caching allocators hold on the device, by `labels`: reserved, less what a
    sleeping pool unmapped (XLA's allocators have no such part)."""
    reserved = by(labels, "gpumem_allocator_reserved_bytes", selector)
    return f"({reserved} - {by(labels, 'gpumem_allocator_unmapped_bytes', selector)} or {reserved})"


def outside(labels, selector):
    """Per process (then summed by `labels`): NVML's figure beyond what its allocator holds
    resident, never below 0."""
    proc = "instance, gpu, UUID, pid"
    return (f"sum by ({labels}) (clamp_min({by(proc, 'gpumem_process_used_bytes', selector)} "
            f"- on ({proc}) group_left () {resident(proc, selector)}, 0))")


def lineup():
    """nvidia-smi's view of one GPU split into what holds it; the stacked bands meet the
    total: allocated + reserved-unallocated + outside + other processes = what processes use,
    plus memory nvidia-smi counts used but charges to no process, the driver's reservation,
    and free."""
    proc = "instance, gpu, UUID, pid"
    alloc = by(proc, "gpumem_allocator_allocated_bytes", GPU)
    held = resident(proc, GPU)
    total = by(IG, "gpumem_device_total_bytes", GPU)
    zero = f"0 * {total}"
    procs = by(IG, "gpumem_process_used_bytes", GPU)
    targets = [
        # Per process, as the page draws it: allocated bytes within what is resident (a
        # sleeping pool's blocks stay allocated in PyTorch's count while their memory is
        # unmapped), the rest of the resident memory unallocated.
        target("A", f"sum by ({IG}) (({alloc} <= {held}) or {held})", "allocated"),
        target("B", f"sum by ({IG}) (clamp_min({held} - {alloc}, 0))",
               "reserved but unallocated"),
        target("C", outside(IG, GPU), "outside the allocator"),
        target("D", f"sum by ({IG}) (gpumem_process_used_bytes{{{GPU}}} unless on (instance, gpu, "
                    f"UUID, pid) gpumem_allocator_reserved_bytes) or {zero}", "other processes"),
        target("E", f"clamp_min({by(IG, 'gpumem_device_used_bytes', GPU)} - ({procs} or {zero}), 0)",
               "used, no process charged"),
        target("F", by(IG, "gpumem_device_reserved_bytes", GPU), "driver reserved"),
        target("G", by(IG, "gpumem_device_free_bytes", GPU), "free"),
        target("H", by(IG, "gpumem_device_used_bytes", GPU), "used (nvidia-smi)"),
        target("I", total, "total"),
        target("J", by(IG, "gpumem_allocator_unmapped_bytes", GPU), "reserved, not resident"),
    ]
    p = timeseries(
        "Line-up: $node GPU $gpu",
        "What nvidia-smi shows for this GPU, split into what holds it. Stacked: tensors the "
        "caching allocators have handed out (allocated), memory they keep reserved but unused "
        "(cache and fragmentation), memory their processes hold outside the allocator (CUDA "
        "context, NCCL, cuBLAS workspaces), other processes, memory nvidia-smi counts used but "
        "charges to no process, the driver's reservation and free: together the total (line). "
        "Reserved memory a sleeping pool (vLLM, SGLang) unmapped is not on the device: its own "
        "line, 'reserved, not resident', outside the stack. "
        "A thick 'reserved but unallocated' band with OOMs means fragmentation: try "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. A thick 'outside the allocator' band "
        "is invisible to torch.cuda.memory_stats().",
        (0, 47, 12, 10), targets, "bytes", stacked=True)
    p.update(repeat="gpu", repeatDirection="h", maxPerRow=2)
    line = [{"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
            {"id": "custom.fillOpacity", "value": 0}, {"id": "custom.lineWidth", "value": 2}]
    p["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byFrameRefID", "options": ref}, "properties": line}
        for ref in "HIJ"]
    return p


def overview():
    pods = "instance, pod_namespace, pod_name"
    proc = "instance, gpu, pid, pod_namespace, pod_name, container_name"
    panels = [
        stat("Device memory used",
             "Share of the selected GPUs' memory that nvidia-smi shows used. Near full is normal "
             "for a training job; it matters with retries or OOMs beside it.",
             (0, 0, 4, 5),
             f"sum(gpumem_device_used_bytes{{{GPU}}}) / sum(gpumem_device_total_bytes{{{GPU}}})",
             "used", "percentunit", [(None, "green"), (0.85, "yellow"), (0.95, "red")]),
        stat("Reserved but unallocated",
             "Share of the memory the caching allocators reserve that holds no tensor, weighted "
             "by size (so small processes do not dominate). High on a nearly full GPU means "
             "fragmentation: see the Fragmentation runbook.",
             (4, 0, 4, 5),
             f"(sum(gpumem_allocator_reserved_bytes{{{POD}}}) - "
             f"sum(gpumem_allocator_allocated_bytes{{{POD}}})) / "
             f"sum(gpumem_allocator_reserved_bytes{{{POD}}})",
             "unallocated", "percentunit", [(None, "green"), (0.3, "yellow"), (0.5, "red")]),
        stat("Outside the allocators",
             "Memory nvidia-smi charges to processes with a caching allocator beyond what it "
             "holds resident (reserved, less what a sleeping pool unmapped): CUDA context, NCCL "
             "buffers, cuBLAS and cuDNN workspaces.",
             (8, 0, 4, 5),
             f"sum({outside('instance, gpu, UUID, pid', POD)})",
             "outside", "bytes", [(None, "green"), (8 * 2**30, "yellow")]),
        stat("Alloc retries per second",
             "Allocations that had to flush the whole cache and retry. Anything above zero for "
             "long means the job runs at the edge of memory; an OOM is often next.",
             (12, 0, 4, 5),
             f"sum(rate(gpumem_allocator_alloc_retries_total{{{POD}}}[$__rate_interval]))",
             "retries/s", "ops", [(None, "green"), (0.001, "orange")]),
        stat("OOMs (24 h)",
             "Allocations that failed with CUDA out of memory in the last 24 hours (red marks on "
             "the line-ups). Look at the line-up at those moments to tell fragmentation from a "
             "full device.",
             (16, 0, 4, 5),
             f"sum(increase(gpumem_allocator_ooms_total{{{POD}}}[24h]))",
             "OOMs", "short", [(None, "green"), (1, "red")]),
        stat("Sources up",
             "1 when the agent read the source at its last attempt. NVML at 0 means no "
             "nvidia-smi view: see the agent's log.",
             (20, 0, 4, 5),
             f'min by (source) (gpumem_source_up{{cluster=~"$cluster", instance=~"$node"}})',
             "{{source}}", "none", [(None, "red"), (1, "green")]),
        table("Top pods by reserved but unallocated",
              "The ten pods whose caching allocators hold the most memory that no tensor uses: "
              "where emptying the cache, expandable segments or a smaller batch frees the most.",
              (0, 5, 12, 8),
              [target("A", f"topk(10, {by(pods, 'gpumem_allocator_reserved_bytes', POD)} - "
                           f"{by(pods, 'gpumem_allocator_allocated_bytes', POD)})", table=True)],
              "bytes", ["instance", "pod_namespace", "pod_name", "Value #A"],
              {"instance": "node", "pod_namespace": "namespace", "pod_name": "pod",
               "Value #A": "reserved but unallocated"}, sort="reserved but unallocated"),
        table("Top pods by alloc retries per second",
              "The ten pods whose allocators flush their caches and retry most often: the jobs "
              "closest to an OOM.",
              (12, 5, 12, 8),
              [target("A", f"topk(10, sum by ({pods}) (rate(gpumem_allocator_alloc_retries_total"
                           f"{{{POD}}}[$__rate_interval])))", table=True)],
              "ops", ["instance", "pod_namespace", "pod_name", "Value #A"],
              {"instance": "node", "pod_namespace": "namespace", "pod_name": "pod",
               "Value #A": "retries/s"}, sort="retries/s"),
        table("Processes",
              "Per process, with its node, pod and container: memory nvidia-smi charges it with, "
              "what its caching allocator reserves and has allocated, what of the reserved a "
              "sleeping pool unmapped (not resident), and the rest (outside the allocator). Namespace, pod and container come from the kubelet's log directories "
              "where the agent can tie a process's cgroup to its pod.",
              (0, 13, 24, 9),
              [target("A", by(proc, "gpumem_process_used_bytes", POD), table=True),
               target("B", by(proc, "gpumem_allocator_reserved_bytes", POD), table=True),
               target("C", by(proc, "gpumem_allocator_allocated_bytes", POD), table=True),
               target("D", f"clamp_min({by(proc, 'gpumem_process_used_bytes', POD)} - on "
                           f"(instance, gpu, pid) group_left () "
                           f"{resident('instance, gpu, pid', POD)}, 0)", table=True),
               target("E", by(proc, "gpumem_allocator_unmapped_bytes", POD), table=True)],
              "bytes",
              ["instance", "gpu", "pid", "pod_namespace", "pod_name", "container_name",
               "Value #A", "Value #B", "Value #C", "Value #E", "Value #D"],
              {"instance": "node", "pod_namespace": "namespace", "pod_name": "pod",
               "container_name": "container", "Value #A": "used (nvidia-smi)",
               "Value #B": "reserved", "Value #C": "allocated",
               "Value #E": "reserved, not resident", "Value #D": "outside the allocator"},
              sort="used (nvidia-smi)"),
        table("GPU assignments",
              "The containers the kubelet assigned each GPU to (its pod-resources API; a "
              "time-sliced GPU lists several), by a device plugin or through a DRA claim (claim "
              "and DRA device set; a DRA device the agent cannot place on a GPU of the node has "
              "no gpu). Compare with the Processes table: a pod using a GPU it was not "
              "assigned, or an assigned GPU with no process, shows here.",
              (0, 22, 24, 8),
              [target("A", "max by (instance, gpu, mig_uuid, pod_namespace, pod_name, "
                           "container_name, claim_name, dra_driver, dra_pool, dra_device) "
                           f"(gpumem_gpu_assigned_info{{{POD}}})", table=True)],
              None, ["instance", "gpu", "mig_uuid", "pod_namespace", "pod_name", "container_name",
                     "claim_name", "dra_driver", "dra_pool", "dra_device"],
              {"instance": "node", "mig_uuid": "MIG device", "pod_namespace": "namespace",
               "pod_name": "pod", "container_name": "container", "claim_name": "claim",
               "dra_driver": "DRA driver", "dra_pool": "DRA pool", "dra_device": "DRA device"},
              labels_only=True),
        table("Last OOM: where the memory was",
              "Per process that pushed its figures with an out-of-memory error (gpumem_push), "
              "where its device's memory was at that moment, in parts that add up to the "
              "device: allocated (live tensors as requested), rounding, fragmented (cached, in "
              "pieces too small or in the other pool), other_streams, other_pools (cached in "
              "CUDA graphs' and MemPools' private pools), pending_stream_frees, "
              "free, outside_allocator. Large fragmented or other_streams beside the request "
              "means a setting can help: run gpumem explain on a memory snapshot.",
              (0, 30, 24, 8),
              [target("A", "max by (instance, pod_namespace, pod_name, pid, gpu, kind) "
                           f"(gpumem_oom_breakdown_bytes{{{POD}}})", table=True)],
              "bytes", ["instance", "pod_namespace", "pod_name", "pid", "gpu", "kind", "Value #A"],
              {"instance": "node", "pod_namespace": "namespace", "pod_name": "pod",
               "Value #A": "bytes"}, sort="bytes"),
        timeseries("Recordings kept and not archived yet",
                   "Memory snapshots jobs uploaded at an OOM (gpumem_push) that the agents keep, "
                   "and those not archived in object storage yet (--recordings-url). A count "
                   "not archived that only grows means the archive is unreachable or refuses "
                   "the agent: see the GpumemRecordingUploadsFailing runbook.",
                   (0, 38, 12, 8),
                   [target("A", 'sum by (instance) (gpumem_recordings_stored{cluster=~"$cluster", '
                                'instance=~"$node"})', "{{instance}} kept"),
                    target("B", 'sum by (instance) (gpumem_recordings_upload_pending'
                                '{cluster=~"$cluster", instance=~"$node"})',
                           "{{instance}} not archived yet")], "short"),
        timeseries("Archive attempts per second by result",
                   "Kept recordings written to object storage (uploaded), failed (tried again "
                   "with backoff), or evicted: they left the spool by its caps before they were "
                   "archived, and are lost.",
                   (12, 38, 12, 8),
                   [target("A", 'sum by (instance, result) (rate(gpumem_recordings_uploaded_total'
                                '{cluster=~"$cluster", instance=~"$node"}[$__rate_interval]))',
                           "{{instance}} {{result}}")], "ops"),
        {"type": "row", "title": "Node $node", "collapsed": False, "repeat": "node",
         "gridPos": {"x": 0, "y": 46, "w": 24, "h": 1}, "panels": []},
        lineup(),
    ]
    return dashboard("gpumem-overview", "gpumem / Overview",
                     "GPU memory as nvidia-smi sees it, lined up against what the caching "
                     "allocators hold: per GPU, per pod, per process.", panels)


def allocator():
    per = "instance, gpu, pid"
    legend = "{{instance}} GPU {{gpu}} pid {{pid}}"
    panels = [
        timeseries("Reserved and allocated by pool",
                   "The small pool (requests up to 1 MiB, 2 MiB segments) and the large pool. A "
                   "small pool that reserves far more than it allocates holds many half-used "
                   "2 MiB segments.", (0, 0, 12, 8),
                   [target("A", by(per + ", pool", "gpumem_allocator_reserved_bytes", POD),
                           legend + " {{pool}} reserved"),
                    target("B", by(per + ", pool", "gpumem_allocator_allocated_bytes", POD),
                           legend + " {{pool}} allocated")], "bytes"),
        timeseries("Alloc retries per second by pod",
                   "Allocations that flushed the cache and retried, per pod and process: which "
                   "job runs at the edge of its memory.", (12, 0, 12, 8),
                   [target("A", "sum by (pod_namespace, pod_name, instance, gpu, pid) "
                                f"(rate(gpumem_allocator_alloc_retries_total{{{POD}}}"
                                "[$__rate_interval]))",
                           "{{pod_namespace}}/{{pod_name}} pid {{pid}}")], "ops"),
        timeseries("Inactive split bytes",
                   "Free memory inside segments that also hold live blocks: it cannot be "
                   "returned to the driver and only fits requests smaller than the pieces. "
                   "Growth here is external fragmentation; expandable_segments:True avoids it.",
                   (0, 8, 12, 8),
                   [target("A", by(per, "gpumem_allocator_inactive_split_bytes", POD), legend)],
                   "bytes"),
        timeseries("Inactive split share of reserved",
                   "Inactive split bytes as a share of what the allocator reserves (0 to 100 %): "
                   "the part of the cache that only small requests can use.", (12, 8, 12, 8),
                   [target("A", f"max by ({per}) (gpumem_allocator_inactive_split_ratio{{{POD}}})",
                           legend)], "percentunit"),
        timeseries("Segments",
                   "Segments (cudaMalloc allocations) held, by pool. Many segments with a high "
                   "fragmentation ratio mean the cache is split into pieces no request fits.",
                   (0, 16, 12, 8),
                   [target("A", by(per + ", pool", "gpumem_allocator_segments", POD),
                           legend + " {{pool}}")], "short"),
        timeseries("Largest free block and requested bytes",
                   "The largest cached free block is the biggest request the allocator can serve "
                   "without the driver. When it falls below the size of the job's large tensors, "
                   "each of them forces a cudaMalloc (and, near the limit, a cache flush). For "
                   "PyTorch processes that push, as of their last memory snapshot "
                   "(gpumem_allocator_cache_age_seconds says how old).",
                   (12, 16, 12, 8),
                   [target("A", f"max by ({per}) (gpumem_allocator_largest_free_block_bytes{{{POD}}})",
                           legend + " largest free block"),
                    target("B", by(per, "gpumem_allocator_requested_bytes", POD),
                           legend + " requested")], "bytes"),
        timeseries("Driver allocations and frees",
                   "cudaMalloc and cudaFree calls (page maps and unmaps with expandable segments) "
                   "per second. In a steady training loop both should be near zero; a steady rate "
                   "means the cache does not hold what each step needs.", (0, 24, 12, 8),
                   [target("A", f"sum by ({per}) (rate(gpumem_allocator_device_allocs_total"
                                f"{{{POD}}}[$__rate_interval]))", legend + " allocs"),
                    target("B", f"sum by ({per}) (rate(gpumem_allocator_device_frees_total"
                                f"{{{POD}}}[$__rate_interval]))", legend + " frees")], "ops"),
        timeseries("Device-wide synchronisations",
                   "Cache flushes that waited for every stream (empty_cache, or a flush before a "
                   "retry). Each stalls the GPU; frequent ones cost throughput.", (12, 24, 12, 8),
                   [target("A", f"sum by ({per}) (rate(gpumem_allocator_sync_all_streams_total"
                                f"{{{POD}}}[$__rate_interval]))", legend)], "ops"),
        timeseries("Peaks",
                   "Peak allocated and reserved bytes since the process started (or last reset "
                   "its peaks). Their ratio is what caching and fragmentation cost at the worst "
                   "moment.", (0, 32, 12, 8),
                   [target("A", f"max by ({per}) (gpumem_allocator_peak_allocated_bytes{{{POD}}})",
                           legend + " peak allocated"),
                    target("B", f"max by ({per}) (gpumem_allocator_peak_reserved_bytes{{{POD}}})",
                           legend + " peak reserved")], "bytes"),
        table("Allocator configuration",
              "Which allocator each process runs and its configuration (PYTORCH_CUDA_ALLOC_CONF "
              "syntax), to relate the curves above to the settings in force.", (12, 32, 12, 8),
              [target("A", f"max by ({per}, allocator, version, config) "
                           f"(gpumem_allocator_info{{{POD}}})", table=True)], None,
              ["instance", "gpu", "pid", "allocator", "version", "config"],
              {"instance": "node"}, labels_only=True),
        table("Segments by size",
              "Segments per size class (sizes in (class/2, class]) and the free bytes cached in "
              "them, per process; for PyTorch processes that push, as of their last memory "
              "snapshot (periodic, or at an out-of-memory error). Many segments with free bytes but a small largest free "
              "block is fragmentation: expandable_segments:True lets one segment grow instead.",
              (0, 40, 24, 8),
              [target("A", by(per + ", segment_size", "gpumem_allocator_segments_by_size", POD),
                      table=True),
               target("B", by(per + ", segment_size",
                              "gpumem_allocator_segment_free_bytes_by_size", POD), table=True)],
              None, ["instance", "gpu", "pid", "segment_size", "Value #A", "Value #B"],
              {"instance": "node", "segment_size": "segment size", "Value #A": "segments",
               "Value #B": "free bytes"}, sort="free bytes"),
        timeseries("Placement plan: hits and misses",
                   "For processes that follow a placement plan (plan:PATH, made by gpumem plan "
                   "from a recording): requests served in the plan's memory (hits) and "
                   "requests the caching allocator served, no free block of the plan's holding "
                   "them (misses). "
                   "Misses that keep rising mean the job no longer runs the planned iteration: "
                   "make a new plan from a recent recording.", (0, 48, 24, 8),
                   [target("A", f"sum by ({per}, outcome) (rate(gpumem_allocator_plan_requests_total"
                                f"{{{POD}}}[$__rate_interval]))", legend + " {{outcome}}")],
                   "ops"),
        timeseries("Pinned host memory",
                   "Host memory PyTorch's pinned allocator (pin_memory, non_blocking copies) "
                   "holds per process, for jobs that push: its pool (blocks in use and cached, "
                   "rounded up to powers of two and kept cached for reuse) and what is in use. "
                   "A pool that keeps growing while the part in use does not is the rounding "
                   "and caching that leads to host OOMs on data-loading-heavy jobs.",
                   (0, 56, 12, 8),
                   [target("A", f"sum by (instance, pid) (gpumem_host_pinned_allocated_bytes"
                                f"{{{HOST}}})", "{{instance}} pid {{pid}} pool"),
                    target("B", f"sum by (instance, pid) (gpumem_host_pinned_active_bytes"
                                f"{{{HOST}}})", "{{instance}} pid {{pid}} in use")], "bytes"),
        timeseries("Pinned allocations from the driver",
                   "cudaHostAlloc (or cudaHostRegister) calls per second. A steady rate means "
                   "the pinned pool's power-of-two buckets do not hold what the loader asks "
                   "for.", (12, 56, 6, 8),
                   [target("A", "sum by (instance, pid) (rate(gpumem_host_pinned_allocs_total"
                                f"{{{HOST}}}[$__rate_interval]))", "{{instance}} pid {{pid}}")],
                   "ops"),
        timeseries("Time spent pinning",
                   "The share of each second a process spent obtaining pinned memory from the "
                   "driver: pinning pages stalls the calling thread (a loader worker, or the "
                   "training loop itself).", (18, 56, 6, 8),
                   [target("A", "sum by (instance, pid) (rate("
                                f"gpumem_host_pinned_alloc_seconds_total{{{HOST}}}"
                                "[$__rate_interval]))", "{{instance}} pid {{pid}}")],
                   "percentunit"),
    ]
    sizes = panels[10]
    sizes["transformations"].insert(1, {"id": "convertFieldType", "options": {"conversions": [
        {"targetField": "segment_size", "destinationType": "number"}]}})
    sizes["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": unit}]}
        for name, unit in [("segment size", "bytes"), ("free bytes", "bytes"), ("segments", "short")]]
    return dashboard("gpumem-allocator", "gpumem / Allocator internals",
                     "Inside each process's caching allocator: pools, fragmentation, segments, "
                     "driver calls and retries.", panels)


def dashboard(uid, title, description, panels):
    for i, p in enumerate(panels, 1):
        p["id"] = i
    return {"uid": uid, "title": title, "description": description,
            "tags": ["gpumem", "gpu", "memory"], "timezone": "browser", "schemaVersion": 39,
            "version": 1, "editable": True, "refresh": "30s",
            "time": {"from": "now-6h", "to": "now"}, "links": LINKS,
            "templating": {"list": VARIABLES},
            "annotations": {"list": [OOM_ANNOTATION]}, "panels": panels}


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for name, board in [("gpumem-overview.json", overview()),
                        ("gpumem-allocator.json", allocator())]:
        text = json.dumps(board, indent=2) + "\n"
        for directory in [ROOT / "dashboards", ROOT / "helm/gpumem/files/dashboards"]:
            path = directory / name
            if check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path.relative_to(ROOT)))
            else:
                path.write_text(text)
    if stale:
        sys.exit(f"stale dashboards (run scripts/dashboards.py): {', '.join(stale)}")


if __name__ == "__main__":
    main()
