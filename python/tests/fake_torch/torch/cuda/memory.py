"""torch.cuda.memory: the pluggable allocator."""

from .. import _fake


class CUDAPluggableAllocator:
    def __init__(self, path, alloc_fn_name, free_fn_name):
        self.path, self.alloc_fn_name, self.free_fn_name = path, alloc_fn_name, free_fn_name


def change_current_allocator(allocator):
    if _fake.initialized:
        raise RuntimeError("Can't swap an already initialized allocator")
    _fake.allocator = allocator


def get_allocator_backend():
    return _fake.backend


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=1 << 62,
                           device=None):
    _fake.check("_record_memory_history")
    if not (_fake.initialized or _fake.initializing):
        # PyTorch initialises CUDA here: in a process that forks its data loaders, too early.
        _fake.violations.append("_record_memory_history before CUDA was initialised")
    with _fake.lock:
        _fake.history = None if enabled is None else {
            "enabled": enabled, "context": context, "stacks": stacks, "max_entries": max_entries}


def _snapshot(device=None):
    """PyTorch's snapshot: every segment with its blocks, and each device's trace."""
    _fake.check("_snapshot")
    return _fake.snapshot()
