"""torch.cuda.memory: the pluggable allocator."""

from .. import _fake


class CUDAPluggableAllocator:
    def __init__(self, path, alloc_fn_name, free_fn_name):
        self.path, self.alloc_fn_name, self.free_fn_name = path, alloc_fn_name, free_fn_name


def change_current_allocator(allocator):
    if _fake.initialized:
        raise RuntimeError("Can't swap an already initialized allocator")
    _fake.allocator = allocator
