"""The device-memory limit a GPU-sharing layer enforces on this process's container.

HAMi (and volcano's vGPU, which uses HAMi-core) puts several pods on one GPU and caps each
container's device memory through variables its device plugin sets in the container's
environment: ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` for the container's CUDA device ``i``, else
``CUDA_DEVICE_MEMORY_LIMIT`` for every device; a number of bytes, or with a ``k``, ``m`` or
``g`` suffix (KiB, MiB, GiB; either case). The agent runs without the capability to read other
processes' environments, so the hook reads its own and pushes the limit of each device with
its statistics. A value that does not parse is left out, never guessed.
"""

import re

from .limits import MAX_BYTES

VARIABLE = "CUDA_DEVICE_MEMORY_LIMIT"
_VALUE = re.compile(r"\s*(\d{1,19})\s*([kKmMgG]?)\s*")
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse(value):
    """Bytes of a limit's value (``40960m``, ``8g``, ``1073741824``), or None."""
    match = _VALUE.fullmatch(value or "")
    if match is None:
        return None
    n = int(match.group(1)) * _SCALE[match.group(2).lower()]
    return n if 0 < n < MAX_BYTES else None


def memory_limit(environ, ordinal):
    """{"bytes", "variable"} of the limit on CUDA device `ordinal` (this process's numbering),
    or None where no variable sets one (the device's own variable first)."""
    for name in (f"{VARIABLE}_{int(ordinal)}", VARIABLE):
        if name in environ:
            n = parse(environ[name])
            return None if n is None else {"bytes": n, "variable": name}
    return None
