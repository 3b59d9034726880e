"""Push a PyTorch job's allocator statistics to the gpumem agent on its node.

    import gpumem_push
    gpumem_push.start()            # before or after CUDA starts; never raises into training

A daemon thread posts, every `interval` seconds and for each CUDA device PyTorch has used,
`torch.cuda.memory_stats(device)` with the pid, the device's UUID, a sequence number and
optional labels, to the agent's `POST /api/v1/push`. An out-of-memory error is pushed at once,
with each device's largest free block and segments by size class from a memory snapshot taken
when it happened.
The agent's Unix socket (`unix:/run/gpumem/push.sock`, used when it exists) lets the agent
name the pushing process itself, which a job in a container cannot: its own pid is its
container's, not the host's that nvidia-smi shows.
Only the standard library is used (and torch, at run time). Nothing here initialises CUDA:
devices are read only once PyTorch has initialised it. When the agent cannot be reached,
payloads are dropped and counted (`stats()`), and the job goes on.
"""

import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

__all__ = ["start", "stop", "stats"]

DEFAULT_SOCKET = "/run/gpumem/push.sock"
DEFAULT_URL = "http://127.0.0.1:9417/api/v1/push"
PUSH_PATH = "/api/v1/push"
# The agent refuses a process's pushes less than 0.5 s apart.
MIN_GAP = 0.55

_lock = threading.Lock()
_state = {"thread": None, "stop": None, "wake": None, "seq": 0, "sent": 0, "dropped": 0,
          "errors": 0, "last_error": None, "oom_snapshot": None}


def stats():
    """Counters of this process's pushes: sent, dropped (agent unreachable or refusing)."""
    with _lock:
        return {k: _state[k] for k in ("sent", "dropped", "errors", "last_error")}


def _snapshot_summary(torch):
    """{device index: (largest free block, {size class: [segments, free bytes]})} from a
    memory snapshot; a segment's class is the power of two at or above its size."""
    summary = {}
    for segment in torch.cuda.memory_snapshot():
        device = int(segment.get("device", 0))
        largest, classes = summary.setdefault(device, (0, {}))
        free = [int(b.get("size", 0)) for b in segment.get("blocks", ())
                if b.get("state") == "inactive"]
        total = int(segment.get("total_size", 0))
        if total > 0:
            count = classes.setdefault(1 << (total - 1).bit_length(), [0, 0])
            count[0] += 1
            count[1] += sum(free)
        summary[device] = (max([largest] + free), classes)
    return summary


def _devices(torch, snapshot=None):
    if not torch.cuda.is_initialized():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(index)
        if not stats:
            continue
        try:
            uuid = "GPU-" + str(torch.cuda.get_device_properties(index).uuid)
        except Exception:  # older PyTorch: no uuid property
            uuid = f"GPU-index-{index}"
        device = {"index": index, "uuid": uuid, "stats": {k: int(v) for k, v in stats.items()}}
        if snapshot is not None:
            largest, classes = snapshot.get(index, (0, {}))
            device["largest_free_block"] = largest
            device["segments_by_size"] = [
                {"size": size, "segments": n, "free_bytes": free}
                for size, (n, free) in sorted(classes.items())]
        out.append(device)
    return out


def _payload(torch, labels, snapshot=None):
    with _lock:
        _state["seq"] += 1
        seq = _state["seq"]
    return {
        "pid": os.getpid(),
        "seq": seq,
        "torch_version": str(getattr(torch, "__version__", "")),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "labels": dict(labels or {}),
        "devices": _devices(torch, snapshot),
    }


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket."""

    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _send(url, body, timeout):
    headers = {"Content-Type": "application/json"}
    if url.startswith("unix:"):
        connection = _UnixConnection(url[len("unix:"):], timeout)
        try:
            connection.request("POST", PUSH_PATH, body=body, headers=headers)
            response = connection.getresponse()
            reply = response.read()
            if response.status >= 400:
                raise ValueError(f"HTTP {response.status}: {reply[:200].decode(errors='replace')}")
        finally:
            connection.close()
        return
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


def _post(url, payload, timeout):
    if not payload["devices"]:
        return
    try:
        _send(url, json.dumps(payload).encode(), timeout)
        with _lock:
            _state["sent"] += 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
        with _lock:
            _state["dropped"] += 1
            _state["last_error"] = str(error)


def _run(url, interval, labels, stop, wake):
    import torch
    last = 0.0
    while True:
        wake.wait(interval)  # every interval, or at once after an out-of-memory error
        wake.clear()
        if stop.is_set():
            return
        with _lock:
            snapshot, _state["oom_snapshot"] = _state["oom_snapshot"], None
        gap = time.monotonic() - last
        if gap < MIN_GAP:
            time.sleep(MIN_GAP - gap)
        try:
            _post(url, _payload(torch, labels, snapshot), timeout=min(interval, 2.0))
        except Exception as error:  # never let the thread die on a surprise
            with _lock:
                _state["errors"] += 1
                _state["last_error"] = repr(error)
        last = time.monotonic()


def _observe_oom(wake):
    import torch
    attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return

    def observer(device, alloc, device_alloc, device_free):
        # The snapshot is taken now, while the failed request's state is intact; the push
        # thread sends it (sending here could break the agent's rate limit).
        try:
            snapshot = _snapshot_summary(torch)
        except Exception as error:
            snapshot = None  # pushed without the figures rather than with false ones
            with _lock:
                _state["errors"] += 1
                _state["last_error"] = repr(error)
        with _lock:
            _state["oom_snapshot"] = snapshot
        wake.set()

    try:
        attach(observer)
    except Exception:
        pass


def _default_url():
    return "unix:" + DEFAULT_SOCKET if os.path.exists(DEFAULT_SOCKET) else DEFAULT_URL


def start(url=None, interval=5.0, labels=None):
    """Starts pushing (once per process; later calls return the running thread).

    url: the agent's push endpoint, `unix:<socket path>` or an http URL (default
         GPUMEM_PUSH_URL, else unix:/run/gpumem/push.sock where it exists, else
         http://127.0.0.1:9417/api/v1/push).
    interval: seconds between pushes.
    labels: optional {name: value} (for example {"job": "llama", "rank": "0"}).
    """
    url = url or os.environ.get("GPUMEM_PUSH_URL") or _default_url()
    with _lock:
        if _state["thread"] is not None and _state["thread"].is_alive():
            return _state["thread"]
        stop, wake = threading.Event(), threading.Event()
        thread = threading.Thread(target=_run, args=(url, float(interval), labels, stop, wake),
                                  name="gpumem-push", daemon=True)
        _state["thread"], _state["stop"], _state["wake"] = thread, stop, wake
    _observe_oom(wake)
    thread.start()
    return thread


def stop():
    """Stops pushing (the thread ends after its current push)."""
    with _lock:
        stop_event, wake = _state["stop"], _state["wake"]
    if stop_event is not None:
        stop_event.set()
        wake.set()
