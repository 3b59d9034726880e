"""Push a PyTorch (or JAX) job's allocator statistics to the gpumem agent on its node.

Without a line of code: install the package and set ``GPUMEM_PUSH=1`` in the job's
environment; ``gpumem_push.pth`` (installed into site-packages) then starts the pusher when the
interpreter starts. Or explicitly::

    import gpumem_push
    gpumem_push.start()            # before or after CUDA starts; never raises into training

A daemon thread posts, every ``interval`` seconds and for each CUDA device the process has
used, ``torch.cuda.memory_stats(device)`` with the pid, the device's UUID, a sequence number and
labels, to the agent's ``POST /api/v1/push``; where the job's torch has
``torch.cuda.host_memory_stats()`` and the job pinned memory, its pinned host memory too (key
names of releases before 2.10 renamed to 2.10's). It never imports torch itself: it waits until the
job has imported it, and reads devices only once PyTorch has initialised CUDA (it never
initialises CUDA). With its pushes go each device's largest free block and segments by size
class, from a memory snapshot without the allocation history (``include_traces=False``,
PyTorch 2.11+), taken as often as the pushes but spaced so that snapshots take at most 0.5 %
of the job's wall time (``cadence``); none where the job's PyTorch would copy a recorded
history into each. It attaches PyTorch's out-of-memory observer, which pushes at once, from
the failing thread, with those figures from a snapshot taken at the error (``"reason":
"oom"``). A last push at interpreter exit carries ``"reason": "exit"``.

A JAX job's GPUs are pushed too (``xla``): once the job has used JAX, each local GPU
device's ``memory_stats()`` goes with every push as allocator ``xla``, and XLA's
``RESOURCE_EXHAUSTED`` errors that reach the interpreter's exception hooks are counted and
pushed at once. It never imports jax nor initialises its backends.

The agent's Unix socket (``unix:/run/gpumem/push.sock``, used whenever it exists) lets the
agent name the pushing process itself, which a job in a container cannot: its own pid is its
container's, not the host's that nvidia-smi shows. The address is resolved again for every
push, so a job started before the agent, or running across an agent restart, is picked up
within one interval. When the agent cannot be reached, payloads are dropped and counted
(``stats()``), and the job goes on.

Environment (read by ``start()``; the hook calls ``start()`` with no arguments):

- ``GPUMEM_PUSH``: ``1`` starts the pusher at interpreter start.
- ``GPUMEM_PUSH_URL``: ``unix:<socket path>`` or an ``http://`` URL (the path defaults to
  ``/api/v1/push``); without it, the socket when it exists, else
  ``http://127.0.0.1:9417/api/v1/push``.
- ``GPUMEM_PUSH_SOCKET``: the socket looked for (``/run/gpumem/push.sock``).
- ``GPUMEM_PUSH_INTERVAL``: seconds between pushes, at least 0.5 (5 by default).
- ``GPUMEM_PUSH_LABELS``: ``name=value,name=value``; at most 8, checked with the agent's
  rules (a bad one is dropped with a warning on stderr). Under torchrun, ``rank``,
  ``local_rank``, ``world_size`` and ``run_id`` come from ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE`` and ``TORCHELASTIC_RUN_ID`` on top of those.

Only the standard library is used (and torch, once the job has imported it).

The package: ``limits`` (the agent's bounds, copied and checked against it), ``config`` (what
start() settles on), ``readings`` (what is read of PyTorch), ``xla`` (what is read of JAX),
``cadence`` (when a periodic snapshot may be taken), ``transport`` (one push sent), ``history`` (the allocation history
and its recording at an OOM), ``pusher`` (the ``Pusher``: state, thread, observer, exit push;
``Outcome`` of each push).
"""

import os

from .pusher import Outcome, Pusher, Result
from .sleeping import report_unmapped

__version__ = "0.1.0"
__all__ = ["start", "stop", "stats", "settings", "report_unmapped", "Pusher", "Outcome",
           "Result"]

_pusher = Pusher()  # registers its own fork handler


def start(url=None, interval=None, labels=None):
    """Starts pushing; returns the pushing thread (None if it could not start). Never raises.

    url: the agent's push endpoint, ``unix:<socket path>`` or an http URL (default
         GPUMEM_PUSH_URL, else unix:/run/gpumem/push.sock whenever it exists, else
         http://127.0.0.1:9417/api/v1/push).
    interval: seconds between pushes, at least 0.5 (default GPUMEM_PUSH_INTERVAL, else 5).
    labels: {name: value} (for example {"job": "llama"}), on top of GPUMEM_PUSH_LABELS.

    Once per process: a later call (GPUMEM_PUSH=1 started it, and the script calls start()
    too) returns the running thread, taking the arguments it gives in place of earlier ones.
    """
    return _pusher.start(url, interval, labels)


def stop():
    """Stops pushing (the thread ends after its current push); no exit push follows."""
    _pusher.stop()


def stats():
    """Counters of this process's pushes: sent, dropped (the agent unreachable or refusing),
    errors (a failure reading PyTorch's figures or in this module), and the last error; the
    memory snapshots taken (periodic, at OOMs), their seconds, and why periodic ones are off
    where they are; the allocation history's recordings."""
    return _pusher.stats()


def settings():
    """What start() settled on: url (resolved now), interval, labels; whether the thread runs,
    and whether the out-of-memory observer is attached."""
    return _pusher.settings()


def _autostart():
    """Called by the .pth hook at interpreter start: start() if GPUMEM_PUSH asks for it."""
    value = os.environ.get("GPUMEM_PUSH", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        start()
    elif value not in ("", "0", "false", "no", "off"):
        _pusher._warn(f"GPUMEM_PUSH={value!r} is neither 1 nor 0; not pushing")
