"""torch._C: the out-of-memory observer list."""

import os as _os

from . import _fake

_oom_observers = []


def _cuda_attach_out_of_memory_observer(observer):
    _fake.check("_cuda_attach_out_of_memory_observer")
    if not _fake.initialized:
        # PyTorch adds the observer to each device's allocator, which exist only once CUDA
        # is initialised: attached earlier, it is silently lost.
        _fake.violations.append("observer attached before CUDA was initialised")
        return
    _oom_observers.append(observer)


if _os.environ.get("FAKE_TORCH_NO_OBSERVER") == "1":
    del _cuda_attach_out_of_memory_observer
