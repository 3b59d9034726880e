"""gpumem's caching allocator as PyTorch's CUDA allocator.

    import gpumem_torch
    gpumem_torch.enable(conf="expandable_segments:True", metrics_listen="127.0.0.1:9418")
    import torch  # ... then use CUDA as usual

`enable()` must run before anything initialises CUDA: PyTorch only accepts a new allocator
before its first CUDA allocation. The shared library is found through `GPUMEM_TORCH_LIB`,
next to this package, or in a gpumem checkout's `target/release`.
"""

import os
from pathlib import Path

__all__ = ["enable", "find_library"]

LIBRARY = "libgpumem_torch.so"


def find_library():
    """Path of libgpumem_torch.so, or FileNotFoundError saying where it was looked for."""
    candidates = []
    if os.environ.get("GPUMEM_TORCH_LIB"):
        candidates.append(Path(os.environ["GPUMEM_TORCH_LIB"]))
    here = Path(__file__).resolve().parent
    candidates.append(here / LIBRARY)
    candidates.append(here.parent.parent / "target" / "release" / LIBRARY)
    for path in candidates:
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        "gpumem: libgpumem_torch.so not found; build it with "
        "`cargo build --release -p gpumem-torch` or set GPUMEM_TORCH_LIB. Looked in: "
        + ", ".join(str(p) for p in candidates)
    )


def enable(conf=None, metrics_listen=None, library=None):
    """Makes gpumem PyTorch's CUDA allocator.

    conf: allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax (GPUMEM_ALLOC_CONF).
    metrics_listen: address for the in-process /metrics server, e.g. "127.0.0.1:9418".
    library: path of libgpumem_torch.so (found automatically when omitted).
    Returns the CUDAPluggableAllocator.
    """
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "gpumem: CUDA is already initialised; call gpumem_torch.enable() before the first "
            "CUDA operation (PyTorch cannot change its allocator afterwards)"
        )
    path = library or find_library()
    if not Path(path).is_file():
        raise FileNotFoundError(f"gpumem: {path} does not exist")
    if conf is not None:
        os.environ["GPUMEM_ALLOC_CONF"] = conf
    if metrics_listen is not None:
        os.environ["GPUMEM_METRICS_LISTEN"] = metrics_listen
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "gpumem_alloc", "gpumem_free")
    torch.cuda.memory.change_current_allocator(allocator)
    return allocator
