"""The simulated devices behind the stand-in torch, and the test's handles on them."""

import os
import threading
import time

MIB = 1 << 20
SEGMENT = 2 * MIB
TOTAL = 80 << 30  # each device's memory

lock = threading.RLock()
imported = False
initialized = False
device_count = int(os.environ.get("FAKE_TORCH_DEVICES", "1"))
broken = set(filter(None, os.environ.get("FAKE_TORCH_BROKEN", "").split(",")))
violations = []
snapshot_calls = []  # include_traces of each memory_snapshot call (None: not given)
# FAKE_TORCH_SNAPSHOT: "new" (2.11+: memory_snapshot takes include_traces) or "old" (it takes
# no argument and copies the history, as memory._snapshot() does); FAKE_TORCH_SNAPSHOT_SECONDS:
# how long each snapshot takes (a large job's, under the allocator's lock). Each snapshot's
# (start, end) in time.monotonic() is kept in snapshot_spans.
snapshot_kind = os.environ.get("FAKE_TORCH_SNAPSHOT", "new")
snapshot_seconds = float(os.environ.get("FAKE_TORCH_SNAPSHOT_SECONDS", "0"))
snapshot_spans = []
allocator = None  # what change_current_allocator installed
# Per device: its segments ({"total_size", "blocks": [{"size", "state"}]}) and counters.
segments = [[] for _ in range(device_count)]
counters = [{"peak": 0, "ooms": 0, "allocs": 0, "frees": 0} for _ in range(device_count)]
# The allocation history (torch.cuda.memory._record_memory_history): its settings while on,
# calls queued by torch.cuda._lazy_call until CUDA initialises, each device's trace and where
# its next segment goes. FAKE_TORCH_BACKEND names get_allocator_backend()'s answer.
history = None
initializing = False
queued = []
traces = [[] for _ in range(device_count)]
next_address = [0x7F0000000000 + (d << 40) for d in range(device_count)]
backend = os.environ.get("FAKE_TORCH_BACKEND", "native")
FRAMES = [{"filename": "train.py", "line": 42, "name": "step"},
          {"filename": "model.py", "line": 7, "name": "forward"}]


# Pinned host memory (the CachingHostAllocator): pool blocks of power-of-two sizes, each in use
# or cached. FAKE_TORCH_HOST_KEYS names host_memory_stats()'s key names: "new" (2.10+), "old"
# (2.7 to 2.9) or "none" (no host_memory_stats, before 2.7).
host_keys = os.environ.get("FAKE_TORCH_HOST_KEYS", "new")
# FAKE_TORCH_HOST_TORN=1: bytes in use read above the pool (a read without one lock).
host_torn = os.environ.get("FAKE_TORCH_HOST_TORN") == "1"
pinned = []  # [{"size", "active"}]
host_counts = {"allocs": 0, "frees": 0, "alloc_us": 0}


def check(call):
    """Records a call made while `import torch` is still running."""
    if not imported:
        violations.append(f"{call} called during `import torch`")
    if call in broken:
        raise RuntimeError(f"fake torch: {call} is broken on purpose")


def init():
    """CUDA's lazy initialisation: the queued calls run first, while is_initialized() is
    still false, as PyTorch runs them."""
    global initialized, initializing
    with lock:
        if initialized or initializing:
            return
        initializing = True
    try:
        while queued:
            queued.pop(0)()
    finally:
        with lock:
            initializing = False
            initialized = True


def snapshot(include_traces=True):
    """A snapshot of every segment, and each device's trace where `include_traces`; it takes
    snapshot_seconds."""
    start = time.monotonic()
    if snapshot_seconds:
        time.sleep(snapshot_seconds)
    with lock:
        out = {"segments": [dict(s, blocks=[dict(b) for b in s["blocks"]])
                            for device in segments for s in device],
               "device_traces": [list(t) if include_traces else [] for t in traces]}
    snapshot_spans.append((start, time.monotonic()))
    return out


def trace(device, action, addr, size):
    """One history entry, while history is on."""
    if history is not None:
        traces[device].append({"action": action, "addr": addr, "size": size, "stream": 0,
                               "time_us": int(time.time() * 1e6), "frames": list(FRAMES)})
        del traces[device][:-history["max_entries"]]


def reserved(device):
    return sum(s["total_size"] for s in segments[device])


def allocated(device):
    return sum(b["size"] for s in segments[device] for b in s["blocks"]
               if b["state"] == "active_allocated")


def allocate(device, nbytes):
    """One allocation in a new segment (a multiple of 2 MiB); initialises CUDA as PyTorch
    does on the first allocation."""
    init()
    with lock:
        total = max(SEGMENT, -(-nbytes // SEGMENT) * SEGMENT)
        address = next_address[device]
        next_address[device] += total
        blocks = [{"address": address, "size": nbytes, "requested_size": nbytes,
                   "state": "active_allocated", "frames": list(FRAMES)}]
        if total > nbytes:
            blocks.append({"address": address + nbytes, "size": total - nbytes,
                           "requested_size": 0, "state": "inactive", "frames": []})
        segments[device].append({"device": device, "address": address, "total_size": total,
                                 "blocks": blocks, "allocated_size": nbytes,
                                 "active_size": nbytes, "requested_size": nbytes, "stream": 0,
                                 "segment_type": "large"})
        trace(device, "segment_alloc", address, total)
        trace(device, "alloc", address, nbytes)
        counters[device]["allocs"] += 1
        counters[device]["peak"] = max(counters[device]["peak"], reserved(device))


def free_all(device):
    """Frees and releases every segment of the device (empty_cache)."""
    with lock:
        counters[device]["frees"] += len(segments[device])
        for segment in segments[device]:
            for block in segment["blocks"]:
                if block["state"] == "active_allocated":
                    trace(device, "free_requested", block["address"], block["size"])
                    trace(device, "free_completed", block["address"], block["size"])
            trace(device, "segment_free", segment["address"], segment["total_size"])
        segments[device].clear()


def reset_peak(device):
    with lock:
        counters[device]["peak"] = reserved(device)


def oom(device, nbytes):
    """An allocation that fails: the observers run on this thread, then the error is raised."""
    from . import _C, cuda
    init()
    with lock:
        counters[device]["ooms"] += 1
        trace(device, "oom", TOTAL - reserved(device), nbytes)
        observers = list(_C._oom_observers)
    for observer in observers:
        observer(device, nbytes, TOTAL, TOTAL - reserved(device))
    raise cuda.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {nbytes} bytes on device {device} (fake)")


def stats(device):
    """memory_stats(device): the flat dict of PyTorch's keys."""
    with lock:
        out = {}
        for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                     "requested_bytes", "allocation", "segment", "active", "inactive_split"):
            for pool in ("all", "large_pool", "small_pool"):
                for kind in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{kind}"] = 0
        c = counters[device]
        for pool in ("all", "large_pool"):
            out[f"reserved_bytes.{pool}.current"] = reserved(device)
            out[f"reserved_bytes.{pool}.peak"] = c["peak"]
            out[f"allocated_bytes.{pool}.current"] = allocated(device)
            out[f"active_bytes.{pool}.current"] = allocated(device)
            out[f"requested_bytes.{pool}.current"] = allocated(device)
            out[f"segment.{pool}.current"] = len(segments[device])
            out[f"allocation.{pool}.allocated"] = c["allocs"]
        out.update({"num_alloc_retries": 0, "num_ooms": c["ooms"], "num_sync_all_streams": 0,
                    "num_device_alloc": c["allocs"], "num_device_free": c["frees"],
                    "max_split_size": -1, "oversize_allocations.current": 0,
                    "oversize_segments.current": 0})
        return out


def pin(nbytes):
    """pin_memory(): a cached block of the power-of-two size, or a new one from the driver."""
    size = 1 << max(0, (nbytes - 1).bit_length())
    with lock:
        for block in pinned:
            if block["size"] == size and not block["active"]:
                block["active"] = True
                return
        pinned.append({"size": size, "active": True})
        host_counts["allocs"] += 1
        host_counts["alloc_us"] += 250


def unpin_all():
    """Every pinned tensor dropped: the blocks stay cached."""
    with lock:
        for block in pinned:
            block["active"] = False


def host_stats():
    """host_memory_stats(): the flat dict, under the key names host_keys selects."""
    with lock:
        pool = (len(pinned), sum(b["size"] for b in pinned))
        used = [b for b in pinned if b["active"]]
        active = (len(used), sum(b["size"] for b in used) + (pool[1] if host_torn else 0))
        counts = dict(host_counts)
    if not pinned and not counts["allocs"]:
        return {}
    if host_keys == "old":
        names = {"segment": pool[0], "reserved_bytes": pool[1],
                 "allocation": active[0], "allocated_bytes": active[1]}
    else:
        names = {"allocations": pool[0], "allocated_bytes": pool[1],
                 "active_requests": active[0], "active_bytes": active[1]}
    out = {}
    for name, value in names.items():
        for kind in ("current", "peak", "allocated", "freed"):
            out[f"{name}.{kind}"] = value if kind in ("current", "peak", "allocated") else 0
    out.update({"num_host_alloc": counts["allocs"], "num_host_free": counts["frees"]})
    for kind in ("total", "max", "min", "count", "avg"):
        out[f"host_alloc_time.{kind}"] = counts["alloc_us"] if kind == "total" else 0
        out[f"host_free_time.{kind}"] = 0
    return out
