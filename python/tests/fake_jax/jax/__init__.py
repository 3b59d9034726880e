"""A stand-in jax for gpumem_push's tests: local devices with PJRT's memory_stats(), created
when the job first asks for devices (JAX's backend initialisation, which preallocates GPU
memory: the hook must never cause it).

FAKE_JAX_GPUS: how many GPU devices (2); FAKE_JAX_PLATFORM: "gpu" (default) or "cpu";
FAKE_JAX_KEYS: "all" (PJRT's keys with pool_bytes) or "old" (without pool_bytes and
peak_pool_bytes). figures(i) is device i's memory_stats().
"""

import atexit
import os

from ._src import xla_bridge

# As jax does: at exit its backends are dropped (a handler registered at import).
atexit.register(xla_bridge._backends.clear)

__version__ = "0.10.2+fake"

GIB = 1 << 30


class XlaRuntimeError(RuntimeError):
    """jaxlib's error type for XLA's failures."""


def figures(index):
    """Device `index`'s memory_stats(): fixed figures the tests compare with."""
    out = {"num_allocs": 100 + index, "bytes_in_use": (3 + index) * GIB,
           "peak_bytes_in_use": (5 + index) * GIB, "largest_alloc_size": GIB,
           "bytes_limit": 60 * GIB, "bytes_reserved": 0, "peak_bytes_reserved": 0,
           "bytes_reservable_limit": 0, "largest_free_block_bytes": (50 - index) * GIB,
           "pool_bytes": 60 * GIB, "peak_pool_bytes": 60 * GIB}
    if os.environ.get("FAKE_JAX_KEYS") == "old":
        del out["pool_bytes"], out["peak_pool_bytes"]
    return out


class Device:
    def __init__(self, index, platform):
        self.id = index
        self.local_hardware_id = index if platform == "gpu" else None
        self.platform = platform

    def memory_stats(self):
        return figures(self.id) if self.platform == "gpu" else None


class Client:
    def __init__(self, platform, count):
        self._devices = [Device(i, platform) for i in range(count)]

    def local_devices(self):
        return list(self._devices)


def devices(backend=None):
    """Initialises the backends (once), as JAX does on first use."""
    if not xla_bridge._backends:
        platform = os.environ.get("FAKE_JAX_PLATFORM", "gpu")
        count = int(os.environ.get("FAKE_JAX_GPUS", "2")) if platform == "gpu" else 1
        xla_bridge._backends[platform] = Client(platform, count)
        xla_bridge.initialisations.append(platform)
    return [d for c in xla_bridge._backends.values() for d in c.local_devices()]


local_devices = devices


def out_of_memory(nbytes):
    """What XLA raises when an allocation does not fit."""
    raise XlaRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                          f"{nbytes} bytes.")
