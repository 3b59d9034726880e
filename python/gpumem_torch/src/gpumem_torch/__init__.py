"""gpumem's caching allocator as PyTorch's CUDA allocator.

    import gpumem_torch
    gpumem_torch.enable(conf="expandable_segments:True", metrics_listen="127.0.0.1:9418")
    import torch  # ... then use CUDA as usual

`enable()` must run before anything initialises CUDA: PyTorch only accepts a new allocator
before its first CUDA allocation.

This package is pure Python and its wheel does not bundle the shared library
`libgpumem_torch.so` (which must match the node's gpumem build, and is built by
`cargo build --release -p gpumem-torch`). `find_library()` looks, in order, at
`GPUMEM_TORCH_LIB` (a path; when set, nothing else is tried), beside this package, and at the
container image's install location `/usr/lib/gpumem/libgpumem_torch.so`.
"""

import os
from pathlib import Path

__version__ = "0.1.0"
__all__ = ["enable", "find_library", "LIBRARY", "IMAGE_LIBRARY"]

LIBRARY = "libgpumem_torch.so"
# Where the gpumem container image installs the library.
IMAGE_LIBRARY = "/usr/lib/gpumem/" + LIBRARY
BUILD_HINT = "build it with `cargo build --release -p gpumem-torch`"


def find_library():
    """Path of libgpumem_torch.so, or FileNotFoundError saying where it was looked for."""
    explicit = os.environ.get("GPUMEM_TORCH_LIB", "")
    if explicit:
        # A path given on purpose that is wrong is an error, not a reason to load another.
        path = Path(explicit)
        if path.is_file():
            return str(path)
        raise FileNotFoundError(
            f"gpumem: GPUMEM_TORCH_LIB={explicit} is not a file; looked in: {path}"
        )
    candidates = [Path(__file__).resolve().parent / LIBRARY, Path(IMAGE_LIBRARY)]
    for path in candidates:
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"gpumem: {LIBRARY} not found (the gpumem-torch wheel does not bundle it); {BUILD_HINT} "
        "and set GPUMEM_TORCH_LIB to its path, or copy it beside this package. Looked in: "
        + ", ".join(str(p) for p in candidates)
        + " (GPUMEM_TORCH_LIB is not set)"
    )


def enable(conf=None, metrics_listen=None, library=None):
    """Makes gpumem PyTorch's CUDA allocator.

    conf: allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax (GPUMEM_ALLOC_CONF).
    metrics_listen: address for the in-process /metrics server, e.g. "127.0.0.1:9418".
    library: path of libgpumem_torch.so (found by find_library() when omitted).
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
