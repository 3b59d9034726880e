"""gpumem's injected hook: Python imports this module at start when its directory is on
PYTHONPATH (the volume gpumem's admission webhook adds to an opted-in pod), so a job whose
image never installed gpumem_push pushes all the same.

It runs the wheel's own start-up hook (_gpumem_push_hook, beside it: it starts gpumem_push
when GPUMEM_PUSH asks for it), then the image's own sitecustomize, which this module shadows,
so the image behaves as before. An error in either is written to stderr and never keeps the
interpreter from starting."""

import os as _os
import sys as _sys


def _run_shadowed():
    """Runs the next `sitecustomize` on sys.path after this directory, if there is one, and
    leaves it as the `sitecustomize` module."""
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        # This directory again under another spelling (a symbolic link): not the image's.
        if spec.origin and _os.path.exists(spec.origin) and _os.path.samefile(spec.origin, __file__):
            return
        module = importlib.util.module_from_spec(spec)
        _sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as error:
        # As Python's own site module does for a failing sitecustomize.
        _sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                          f"{type(error).__name__}: {error}\n")


try:
    import _gpumem_push_hook  # noqa: F401  (starts the pusher; never raises)
except Exception as _error:
    _sys.stderr.write(f"gpumem_push: not started: {_error!r}\n")
_run_shadowed()
