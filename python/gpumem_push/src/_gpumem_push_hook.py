"""Imported by gpumem_push.pth when the interpreter starts: starts gpumem_push when the
environment sets GPUMEM_PUSH=1, and costs one environment lookup otherwise."""

import os as _os

if _os.environ.get("GPUMEM_PUSH", "").strip() not in ("", "0"):
    try:
        import gpumem_push as _gpumem_push

        _gpumem_push._autostart()
    except Exception as _error:  # never keep the interpreter from starting
        import sys as _sys

        _sys.stderr.write(f"gpumem_push: not started: {_error!r}\n")
