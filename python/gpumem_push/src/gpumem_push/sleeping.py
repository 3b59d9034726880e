"""Memory a pool of the job holds reserved but not resident.

vLLM's sleep mode (``vllm.device_allocator.cumem.CuMemAllocator``) and SGLang's
torch_memory_saver allocate a MemPool's segments through a pluggable allocator over
cuMemCreate/cuMemMap. Asleep (paused), they unmap the physical memory, keeping what they need in
host memory, while PyTorch still counts the segments reserved: nvidia-smi then charges the
process less than its allocator reserves. The hook pushes that part as ``unmapped_bytes``, so
the agent tells memory held elsewhere on the device from memory held nowhere.

Neither stack says whether it sleeps. vLLM's allocator keeps its allocations in
``pointer_to_data`` (pointer → data whose ``handle`` starts with the device and the size, and
whose ``tag`` names it); the hook wraps the allocator's public ``sleep`` and ``wake_up`` once
the module is imported (it checks at every push; a sleep before that is seen from the next one
on) and keeps the allocations a ``sleep`` unmapped until a ``wake_up`` maps them again. Other
stacks (torch_memory_saver's ``pause``/``resume``, an allocator of the job's own) say it with
``gpumem_push.report_unmapped(device, nbytes)``. Nothing here imports either stack.
"""

import os
import sys
import threading

VLLM_MODULE = "vllm.device_allocator.cumem"
_WRAPPED = "_gpumem_push_wrapped"

_lock = threading.Lock()
# vLLM's allocations unmapped by a sleep: pointer -> (device, bytes).
_asleep = {}
# What the job reported itself: device -> bytes.
_reported = {}
# The vLLM allocators seen sleeping, whose allocations are read again at each push.
_allocators = []


def _after_fork_in_child():
    # A fork while another thread held the lock would leave the child's copy held forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def report_unmapped(device, nbytes):
    """Says that `nbytes` of the memory PyTorch counts reserved on CUDA device `device` (its
    ordinal in this process) are unmapped now (0: none); replaces the last figure."""
    device, nbytes = int(device), max(0, int(nbytes))
    with _lock:
        if nbytes:
            _reported[device] = nbytes
        else:
            _reported.pop(device, None)


def watch(modules=None):
    """Wraps vLLM's allocator once its module is imported; cheap when it is not, or done."""
    module = (sys.modules if modules is None else modules).get(VLLM_MODULE)
    allocator = getattr(module, "CuMemAllocator", None)
    if allocator is None or getattr(allocator, _WRAPPED, False):
        return
    sleep, wake_up = getattr(allocator, "sleep", None), getattr(allocator, "wake_up", None)
    if not callable(sleep) or not callable(wake_up):
        return

    def sleeping(self, *args, **kwargs):
        result = sleep(self, *args, **kwargs)
        with _lock:
            for pointer, data in _allocations(self):
                placed = _device_and_size(data)
                if placed is not None:
                    _asleep[pointer] = placed
            if self not in _allocators:
                _allocators.append(self)
        return result

    def waking(self, *args, **kwargs):
        result = wake_up(self, *args, **kwargs)
        tags = args[0] if args else kwargs.get("tags")
        with _lock:
            for pointer, data in _allocations(self):
                if tags is None or getattr(data, "tag", None) in tags:
                    _asleep.pop(pointer, None)
        return result

    sleeping.__wrapped__, waking.__wrapped__ = sleep, wake_up
    allocator.sleep, allocator.wake_up = sleeping, waking
    setattr(allocator, _WRAPPED, True)


def _allocations(allocator):
    """(pointer, data) of a vLLM allocator's allocations, as a list (never raises)."""
    try:
        return list(getattr(allocator, "pointer_to_data", {}).items())
    except Exception:  # another thread changing it, or another shape
        return []


def _device_and_size(data):
    """(device, bytes) from an allocation's handle (device, aligned size, address, handle)."""
    try:
        device, size = data.handle[0], data.handle[1]
        return int(device), int(size)
    except Exception:
        return None


def unmapped_bytes():
    """Device -> bytes unmapped now: vLLM's sleeping allocations that still exist, and what
    the job reported."""
    with _lock:
        live = set()
        for allocator in _allocators:
            live.update(pointer for pointer, _ in _allocations(allocator))
        for pointer in [p for p in _asleep if p not in live]:
            del _asleep[pointer]  # freed since: no longer reserved either
        out = dict(_reported)
        for device, size in _asleep.values():
            out[device] = out.get(device, 0) + size
    return out
