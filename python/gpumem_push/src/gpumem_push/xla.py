"""What the pusher reads of a JAX job: each local GPU device's `memory_stats()` (PJRT's keys,
which the agent maps onto its metric contract as allocator `xla`), never importing jax and
never initialising its backends (JAX preallocates most of each GPU when it does). Plain
readings; the pusher holds the state.

A device is named by NVML's UUID where the process's environment says which device its
CUDA ordinal (`local_hardware_id`) is: `CUDA_VISIBLE_DEVICES`, else the container's
`NVIDIA_VISIBLE_DEVICES`, listing UUIDs (`GPU-…`, `MIG-…`), or indices into a list of UUIDs;
or where the job's PyTorch has initialised CUDA and names the same ordinal. Otherwise it is
sent as `GPU-index-<ordinal>`, which the agent exports as it is, beside NVML's devices
rather than joined to one.

JAX has no out-of-memory observer: `is_out_of_memory` recognises the `RESOURCE_EXHAUSTED`
errors the interpreter's exception hooks see (uncaught, in the main thread or another);
errors the job catches are not seen.
"""

import sys

from .limits import MAX_BYTES, MAX_COUNT
from .readings import imported

# PJRT's memory_stats() keys (xla/stream_executor/allocator_stats.h, and pool_bytes /
# peak_pool_bytes of newer releases); each may be missing.
PJRT_KEYS = ("num_allocs", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size",
             "bytes_limit", "bytes_reserved", "peak_bytes_reserved", "bytes_reservable_limit",
             "largest_free_block_bytes", "pool_bytes", "peak_pool_bytes")
# The settings of JAX's GPU client that shape its allocator, sent as the allocator's
# configuration where set.
SETTINGS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR")
GPU_PLATFORMS = ("gpu", "cuda")
# How far an exception's causes and contexts are followed, looking for the XLA error.
MAX_CHAIN = 8


def find_jax():
    """The job's jax module once it has imported it completely, else None. Never imports."""
    return imported("jax")


def backends():
    """JAX's initialised backends by platform ({} before the job first uses JAX), or None
    where this JAX keeps them elsewhere."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    found = getattr(bridge, "_backends", None)
    return found if isinstance(found, dict) else None


def gpu_devices():
    """The job's local GPU devices, once JAX has initialised its backends (never
    initialising them); [] before, or where this JAX keeps them elsewhere."""
    out = []
    for backend in list((backends() or {}).values()):
        for device in backend.local_devices():
            if getattr(device, "platform", None) in GPU_PLATFORMS:
                out.append(device)
    return out


def stats(device):
    """The device's PJRT figures the agent reads, whole and not negative, without those one
    reading contradicts (the agent would refuse the whole push, PyTorch's devices with it);
    None where it has none (memory_stats() may return None, or raise on some backends)."""
    try:
        raw = device.memory_stats()
    except Exception:
        return None
    if not raw:
        return None
    out = {}
    for key in PJRT_KEYS:
        value = raw.get(key)
        if value is None or isinstance(value, bool):
            continue
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if number == value and 0 <= number < (MAX_BYTES if "bytes" in key else MAX_COUNT):
            out[key] = number
    in_use, pool = out.get("bytes_in_use"), out.get("pool_bytes")
    if in_use is not None and pool is not None and in_use > pool:
        del out["pool_bytes"]
        out.pop("peak_pool_bytes", None)
        pool = None
    largest = out.get("largest_free_block_bytes")
    if largest is not None and pool is not None and largest > pool - (in_use or 0):
        del out["largest_free_block_bytes"]
    for peak, current in (("peak_bytes_in_use", "bytes_in_use"),
                          ("peak_pool_bytes", "pool_bytes")):
        if peak in out and current in out and out[peak] < out[current]:
            del out[peak]
    return out or None


def settings(environ):
    """The XLA client's settings as one text: `NAME=value` for each that is set."""
    return ",".join(f"{name}={environ[name]}" for name in SETTINGS if name in environ)


def _entries(value):
    return [e.strip() for e in value.split(",") if e.strip()] if value is not None else None


def _is_uuid(entry):
    """A whole UUID (CUDA also takes a unique prefix, which names no device exactly)."""
    return entry.startswith(("GPU-", "MIG-")) and len(entry) == len("GPU-") + 36 \
        and "/" not in entry


def visible_uuid(ordinal, environ):
    """NVML's UUID of the device this process sees as CUDA ordinal `ordinal`, where
    `environ` says it; else None. CUDA_VISIBLE_DEVICES (UUIDs, which set the ordinals'
    order, or indices into the container's devices) wins over NVIDIA_VISIBLE_DEVICES (the
    container's devices, taken in the order it lists them: CUDA numbers them fastest first,
    then by PCI bus, which is that order on a node of one GPU model whose device plugin lists
    them by bus; a job that also imports PyTorch is named by PyTorch instead)."""
    nvidia = _entries(environ.get("NVIDIA_VISIBLE_DEVICES"))
    cuda = _entries(environ.get("CUDA_VISIBLE_DEVICES"))
    if cuda is not None:
        if not 0 <= ordinal < len(cuda):
            return None
        entry = cuda[ordinal]
        if _is_uuid(entry):
            return entry
        if not entry.isdigit() or nvidia is None:
            return None
        ordinal = int(entry)
    if nvidia is None or not 0 <= ordinal < len(nvidia):
        return None
    return nvidia[ordinal] if _is_uuid(nvidia[ordinal]) else None


def is_out_of_memory(error):
    """Whether `error` (or one of its causes) is XLA's out-of-memory error: an
    XlaRuntimeError (JaxRuntimeError in newer releases) saying RESOURCE_EXHAUSTED and out of
    memory (other exhausted resources are not memory)."""
    seen = 0
    while error is not None and seen < MAX_CHAIN:
        name = type(error).__name__
        text = str(error)[:200]
        if name in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in text \
                and "out of memory" in text.lower():
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False
