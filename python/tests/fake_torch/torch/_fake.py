"""The simulated devices behind the stand-in torch, and the test's handles on them."""

import os
import threading

MIB = 1 << 20
SEGMENT = 2 * MIB
TOTAL = 80 << 30  # each device's memory

lock = threading.RLock()
imported = False
initialized = False
device_count = int(os.environ.get("FAKE_TORCH_DEVICES", "1"))
broken = set(filter(None, os.environ.get("FAKE_TORCH_BROKEN", "").split(",")))
violations = []
allocator = None  # what change_current_allocator installed
# Per device: its segments ({"total_size", "blocks": [{"size", "state"}]}) and counters.
segments = [[] for _ in range(device_count)]
counters = [{"peak": 0, "ooms": 0, "allocs": 0, "frees": 0} for _ in range(device_count)]


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
    global initialized
    with lock:
        initialized = True


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
        blocks = [{"size": nbytes, "state": "active_allocated"}]
        if total > nbytes:
            blocks.append({"size": total - nbytes, "state": "inactive"})
        segments[device].append({"device": device, "total_size": total, "blocks": blocks,
                                 "allocated_size": nbytes, "segment_type": "large"})
        counters[device]["allocs"] += 1
        counters[device]["peak"] = max(counters[device]["peak"], reserved(device))


def free_all(device):
    """Frees and releases every segment of the device (empty_cache)."""
    with lock:
        counters[device]["frees"] += len(segments[device])
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
