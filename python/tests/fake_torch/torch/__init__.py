"""A stand-in for PyTorch in the tests of gpumem_push and gpumem_torch (never the real thing).

It has the few calls those packages make, on simulated devices whose memory the test drives
through `torch._fake`: `allocate`, `free_all`, `reset_peak` and `oom` (which calls the
out-of-memory observers, as PyTorch's allocator does, then raises). Environment:
FAKE_TORCH_DEVICES (device count, 1), FAKE_TORCH_IMPORT_DELAY (seconds `import torch` takes,
halfway, with torch.cuda already importable), FAKE_TORCH_NO_OBSERVER=1 (a PyTorch without
_cuda_attach_out_of_memory_observer), FAKE_TORCH_BROKEN=memory_stats,memory_snapshot (those
raise). A call made while `import torch` is still running, or that PyTorch would refuse, is
listed in `torch._fake.violations`.
"""

import os as _os
import time as _time

__version__ = "2.5.1+fake"

from . import _fake  # noqa: E402
from . import _C  # noqa: E402
from . import cuda  # noqa: E402

if _os.environ.get("FAKE_TORCH_IMPORT_DELAY"):
    _time.sleep(float(_os.environ["FAKE_TORCH_IMPORT_DELAY"]))

_fake.imported = True
