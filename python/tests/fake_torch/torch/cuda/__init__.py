"""torch.cuda: what gpumem_push and gpumem_torch call."""

from .. import _fake
from . import memory  # noqa: F401


class OutOfMemoryError(RuntimeError):
    pass


class _Uuid:
    def __init__(self, index):
        self.index = index

    def __str__(self):
        return f"6a1f0e2c-0000-4000-8000-{self.index:012d}"


class _Properties:
    def __init__(self, index):
        self.name = "Fake GPU"
        self.total_memory = 80 * (1 << 30)
        self.uuid = _Uuid(index)


def is_initialized():
    _fake.check("is_initialized")
    return _fake.initialized


def init():
    _fake.init()


def _lazy_call(callable):
    """Runs `callable` now if CUDA is initialised, else when it initialises."""
    with _fake.lock:
        if not _fake.initialized:
            _fake.queued.append(callable)
            return
    callable()


def device_count():
    _fake.check("device_count")
    return _fake.device_count


def _index(device):
    index = 0 if device is None else int(device)
    if not 0 <= index < _fake.device_count:
        raise RuntimeError(f"invalid device ordinal {index}")
    return index


def memory_stats(device=None):
    _fake.check("memory_stats")
    if not _fake.initialized:
        return {}
    return _fake.stats(_index(device))


def host_memory_stats():
    _fake.check("host_memory_stats")
    if not _fake.initialized:
        return {}
    return _fake.host_stats()


if _fake.host_keys == "none":
    del host_memory_stats


def get_device_properties(device):
    _fake.check("get_device_properties")
    _fake.init()  # PyTorch's lazy init
    return _Properties(_index(device))


def memory_snapshot(mempool_id=None, include_traces=True):
    """As PyTorch 2.11 and later: `include_traces=False` leaves the history out (the stand-in
    records what each call asked for)."""
    _fake.snapshot_calls.append(include_traces)
    _fake.check("memory_snapshot")
    if not _fake.initialized:
        _fake.violations.append("memory_snapshot before CUDA was initialised")
        return []
    return _fake.snapshot(include_traces)["segments"]


def _old_memory_snapshot():
    """As PyTorch 2.10 and before: no arguments; the whole snapshot, history included, is
    taken for its segments."""
    _fake.snapshot_calls.append(None)
    _fake.check("memory_snapshot")
    return memory._snapshot()["segments"]


if _fake.snapshot_kind == "old":
    memory_snapshot = _old_memory_snapshot  # noqa: F811
