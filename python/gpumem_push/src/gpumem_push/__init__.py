"""Push a PyTorch job's allocator statistics to the gpumem agent on its node.

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
initialises CUDA). Then it attaches PyTorch's out-of-memory observer, which pushes at once, from
the failing thread, with each device's largest free block and segments by size class from a
memory snapshot taken at the error (``"reason": "oom"``). A last push at interpreter exit
carries ``"reason": "exit"``.

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
"""

import atexit
import math
import os
import re
import sys
import threading
import time

__version__ = "0.1.0"
__all__ = ["start", "stop", "stats", "settings"]

DEFAULT_SOCKET = "/run/gpumem/push.sock"
DEFAULT_URL = "http://127.0.0.1:9417/api/v1/push"
PUSH_PATH = "/api/v1/push"
DEFAULT_INTERVAL = 5.0
MIN_INTERVAL = 0.5
# The agent refuses a process's pushes less than 0.5 s apart (but for a few with a reason):
# periodic pushes keep this far from the previous push of any kind.
MIN_GAP = 0.55
# Out-of-memory pushes from the failing thread at most this often; one more error within it is
# pushed by the thread, once the gap has passed (a loop retrying smaller batches stays cheap).
OOM_GAP = 1.0
# Seconds a push with a reason may take on the calling thread (the training thread at an
# out-of-memory error, the main thread at exit).
REASON_TIMEOUT = 1.0
PERIODIC_TIMEOUT = 2.0
# How often the thread looks for torch and initialised CUDA until the observer is attached.
POLL = 0.25

# The agent's bounds (src/ingest/limits.rs; tests/it/ingest.rs checks these copies against
# them). Names it sets itself are accepted: the agent exports them as exported_<name>.
# The names the agent exports as exported_<name>: the metric contract's labels, Prometheus's
# `le` and the target labels of Kubernetes service discovery (tests/it/ingest.rs checks this
# list against the agent's).
COLLIDING = frozenset((
    "UUID", "allocator", "config", "container_id", "container_name", "driver_version", "gpu",
    "kind", "model", "outcome", "pid", "pod_name", "pod_namespace", "pod_uid", "pool", "process",
    "result",
    "segment_size", "simulated", "source", "version", "le",
    "job", "instance", "namespace", "pod", "container", "node", "service", "endpoint",
    "cluster",
))
MAX_USER_LABELS = 8
MAX_LABEL_BYTES = 512  # names and values together, rank labels included
MAX_NAME = 64
MAX_TEXT = 128  # bytes of UTF-8, as the agent counts
MAX_DEVICES = 16
MAX_STATS_KEYS = 512
# Labels added under torchrun / torchelastic, from these variables where set.
RANK_LABELS = (("rank", "RANK"), ("local_rank", "LOCAL_RANK"), ("world_size", "WORLD_SIZE"),
               ("run_id", "TORCHELASTIC_RUN_ID"))
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

_lock = threading.Lock()       # guards _state
_send_lock = threading.Lock()  # one push at a time, so sequence numbers arrive in order
_state = {}


def _start_time():
    """This process's start time in clock ticks since boot (/proc/self/stat, field 22): with
    the pid, what tells this process apart from another that reuses its pid."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read(4096).decode("ascii", "replace")
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _fresh_state():
    return {
        "start_time": _start_time(),  # this process's: read again in a forked child
        "thread": None, "stop": None, "wake": None,
        "explicit": {},          # the arguments given to start() (a later call's win)
        "config": None,          # {"url", "interval", "labels"}: what start() settled on
        "active": False,         # between start() and stop()
        "seq": 0, "sent": 0, "dropped": 0, "errors": 0, "last_error": None,
        "last_push": -math.inf,  # monotonic time the last push attempt ended
        "last_oom": -math.inf,   # monotonic time of the last out-of-memory push
        "last_oom_wall": None,   # time.time() of the last out-of-memory error
        "oom_pending": None,     # (snapshot or None) for the thread to push with "oom"
        "used": set(),           # device indices this process has used: pushed from then on
        "uuids": {},
        "observer": None,        # None: not tried yet; True: attached; False: unavailable
        "atexit": False,
        "warned": set(),
    }


_state.update(_fresh_state())


def _after_fork_in_child():
    # Threads do not survive fork; a forked child (a DataLoader worker, say) does not push
    # unless it calls start() itself, and never sends its parent's exit push.
    global _lock, _send_lock
    _lock, _send_lock = threading.Lock(), threading.Lock()
    observer, atexit_done = _state["observer"], _state["atexit"]
    _state.clear()
    _state.update(_fresh_state())
    _state["observer"], _state["atexit"] = observer, atexit_done


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def stats():
    """Counters of this process's pushes: sent, dropped (the agent unreachable or refusing),
    errors (a failure reading PyTorch's figures or in this module), and the last error."""
    with _lock:
        return {k: _state[k] for k in ("sent", "dropped", "errors", "last_error")}


def settings():
    """What start() settled on: url (resolved now), interval, labels; whether the thread runs,
    and whether the out-of-memory observer is attached."""
    with _lock:
        config = _state["config"]
        thread = _state["thread"]
        observer = _state["observer"]
        used = sorted(_state["used"])
    return {
        "running": bool(thread is not None and thread.is_alive()),
        "url": _resolve_url(config["url"] if config else None),
        "interval": config["interval"] if config else None,
        "labels": dict(config["labels"]) if config else {},
        "oom_observer": bool(observer),
        "devices": used,
    }


# ---------------------------------------------------------------------------------------------
# Settings and their checks


def _warn(message):
    """One line on stderr, once per process per message."""
    with _lock:
        if message in _state["warned"]:
            return
        _state["warned"].add(message)
    try:
        sys.stderr.write("gpumem_push: " + message + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def _error(error):
    with _lock:
        _state["errors"] += 1
        _state["last_error"] = repr(error)


def _text_problem(value):
    """Why the agent would refuse this text (None if it would not): at most 128 bytes of
    UTF-8, no control characters."""
    if len(value.encode("utf-8", "surrogatepass")) > MAX_TEXT:
        return f"longer than {MAX_TEXT} bytes"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value):
        return "with control characters"
    return None


def _alloc_conf():
    """The allocator's settings variables as the agent needs them to tell which one the job's
    release reads: `PYTORCH_CUDA_ALLOC_CONF` as `alloc_conf` where it is set, and
    `PYTORCH_ALLOC_CONF` as `alloc_conf_generic` where it is set and says something else
    (from 2.10 the CUDA variable wins; up to 2.9 the device allocator reads only the CUDA
    one)."""
    cuda = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    generic = os.environ.get("PYTORCH_ALLOC_CONF")
    out = {}
    # Set but empty is set: PyTorch parses the empty string, and the CUDA variable wins.
    if cuda is not None:
        out["alloc_conf"] = _clean_text(cuda, "PYTORCH_CUDA_ALLOC_CONF")
    if generic is not None and generic != cuda:
        out["alloc_conf_generic"] = _clean_text(generic, "PYTORCH_ALLOC_CONF")
    return out


def _clean_text(value, what):
    """Text the agent accepts: control characters removed, cut to 128 bytes (with a warning);
    a torch_version or alloc_conf it would refuse would lose every push."""
    if _text_problem(value) is None:
        return value
    cleaned = "".join(c for c in value if not (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F))
    data = cleaned.encode("utf-8", "surrogatepass")[:MAX_TEXT]
    cleaned = data.decode("utf-8", "ignore")
    _warn(f"{what} is not at most {MAX_TEXT} printable bytes; sending {cleaned!r}")
    return cleaned


def _label_problem(name, value):
    if not _NAME.match(name):
        return "is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)"
    if name.startswith("__"):
        return "starts with __ (reserved by Prometheus)"
    if len(name) > MAX_NAME:
        return f"is longer than {MAX_NAME} characters"
    problem = _text_problem(value)
    return f"has a value {problem}" if problem else None


def _env_labels():
    """(name, value) pairs from GPUMEM_PUSH_LABELS=name=value,name=value."""
    out = []
    for item in os.environ.get("GPUMEM_PUSH_LABELS", "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep:
            _warn(f"GPUMEM_PUSH_LABELS: {item.strip()!r} is not name=value; dropped")
            continue
        out.append((name.strip(), value.strip()))
    return out


def _labels(explicit):
    """The labels pushed: GPUMEM_PUSH_LABELS, then start()'s (which win on a name), checked
    with the agent's rules, at most 8; then the torchrun rank labels not given already."""
    merged = {}
    for name, value in _env_labels():
        merged[name] = value
    if explicit:
        try:
            items = list(explicit.items())
        except Exception:
            _warn(f"labels must be a dict of name to value, not {type(explicit).__name__}; "
                  "ignored")
            items = []
        for name, value in items:
            merged[str(name)] = value if isinstance(value, str) else str(value)
    # The rank labels first: they identify the process, and count in the byte total.
    ranks = {}
    for name, variable in RANK_LABELS:
        value = os.environ.get(variable)
        if value is None or name in merged:
            continue
        problem = _label_problem(name, value)
        if problem:
            _warn(f"label {name!r} (from {variable}) {problem}; dropped")
        else:
            ranks[name] = value
    used = sum(_size(n, v) for n, v in ranks.items())
    labels = {}
    for name, value in merged.items():
        problem = _label_problem(name, value)
        # The agent exports a colliding name as exported_<name>: both given would clash.
        base = name[len("exported_"):] if name.startswith("exported_") else None
        if not problem and base in COLLIDING and base in merged:
            problem = f"clashes with {base!r}, which the agent exports as {name!r}"
        if problem:
            _warn(f"label {name!r} {problem}; dropped")
        elif len(labels) >= MAX_USER_LABELS:
            _warn(f"label {name!r} is past the {MAX_USER_LABELS} labels allowed; dropped")
        elif used + _size(name, value) > MAX_LABEL_BYTES:
            _warn(f"label {name!r} is past the {MAX_LABEL_BYTES} bytes the labels may take "
                  "together; dropped")
        else:
            labels[name] = value
            used += _size(name, value)
    labels.update(ranks)
    return labels


def _size(name, value):
    return len(name.encode()) + len(value.encode("utf-8", "surrogatepass"))


def _interval(explicit):
    if explicit is not None:
        value, source = explicit, "interval"
    elif os.environ.get("GPUMEM_PUSH_INTERVAL", "").strip():
        value, source = os.environ["GPUMEM_PUSH_INTERVAL"].strip(), "GPUMEM_PUSH_INTERVAL"
    else:
        return DEFAULT_INTERVAL
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < MIN_INTERVAL:
        _warn(f"{source}={value!r} is not a number of seconds of at least {MIN_INTERVAL}; "
              f"pushing every {DEFAULT_INTERVAL:g} s")
        return DEFAULT_INTERVAL
    return seconds


def _check_url(url, source):
    """The URL as sent to, or None (with a warning) if it is neither unix:<path> nor http."""
    url = url.strip()
    if url.startswith("unix:"):
        if len(url) > len("unix:"):
            return url
    else:
        from urllib.parse import urlsplit
        try:
            parts = urlsplit(url)
            if parts.scheme in ("http", "https") and parts.hostname:
                parts.port  # noqa: B018 (raises on a bad port)
                if parts.path in ("", "/"):
                    url = url.rstrip("/") + PUSH_PATH
                return url
        except ValueError:
            pass
    _warn(f"{source}={url!r} is neither unix:<socket path> nor an http URL; ignored")
    return None


def _resolve_url(explicit):
    """Where the next push goes: start()'s url, else GPUMEM_PUSH_URL, else the agent's socket
    if it exists now, else its loopback HTTP address. Asked again for every push."""
    if explicit:
        return explicit
    env = os.environ.get("GPUMEM_PUSH_URL", "")
    if env.strip():
        url = _check_url(env, "GPUMEM_PUSH_URL")
        if url:
            return url
    path = os.environ.get("GPUMEM_PUSH_SOCKET") or DEFAULT_SOCKET
    if os.path.exists(path):
        return "unix:" + path
    return DEFAULT_URL


# ---------------------------------------------------------------------------------------------
# Reading PyTorch


def _torch():
    """The job's torch module once it has imported it completely, else None. Never imports."""
    module = sys.modules.get("torch")
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None  # the job's `import torch` is still running
    cuda = module.__dict__.get("cuda")
    if cuda is None or not hasattr(cuda, "is_initialized"):
        return None  # not PyTorch (a namespace package called torch, say)
    return module


MAX_OOM_POOLS = 64  # (pool, stream, private) entries in an out-of-memory push (the agent's bound, checked)


def _snapshot_summary(torch, request=None):
    """{device index: {"largest": largest free block, "classes": {size class: [segments, free
    bytes]}, "pools": {(pool, stream, private): figures}}} from a memory snapshot; a segment's class is
    the power of two at or above its size. With `request` (the observer's device, size,
    total and free, and the failing thread's stream), the failing device's entry also gets
    the "oom" object the agent explains."""
    summary = {}
    for segment in torch.cuda.memory_snapshot():
        device = int(segment.get("device", 0))
        entry = summary.setdefault(device, {"largest": 0, "classes": {}, "pools": {}})
        blocks = segment.get("blocks", ())
        free = [int(b.get("size", 0)) for b in blocks if b.get("state") == "inactive"]
        total = int(segment.get("total_size", 0))
        if total > 0:
            count = entry["classes"].setdefault(1 << (total - 1).bit_length(), [0, 0])
            count[0] += 1
            count[1] += sum(free)
        entry["largest"] = max([entry["largest"]] + free)
        pool = "small" if segment.get("segment_type") == "small" else "large"
        # A private pool's (CUDA graph, MemPool) free bytes serve only its own requests.
        private = tuple(segment.get("segment_pool_id") or (0, 0)) != (0, 0)
        figures = entry["pools"].setdefault(
            (pool, int(segment.get("stream", 0) or 0), private),
            {"allocated": 0, "requested": 0, "pending_free": 0, "free": 0, "largest_free": 0,
             "segments_with_free": 0})
        for b in blocks:
            size, state = int(b.get("size", 0)), b.get("state")
            if state == "active_allocated":
                figures["allocated"] += size
                figures["requested"] += min(size, int(b.get("requested_size", size)))
            elif state == "active_pending_free":
                figures["pending_free"] += size
            elif state == "inactive":
                figures["free"] += size
                figures["largest_free"] = max(figures["largest_free"], size)
        figures["segments_with_free"] += 1 if free and sum(free) > 0 else 0
    if request is not None:
        device, size, device_total, device_free, stream = request
        entry = summary.setdefault(device, {"largest": 0, "classes": {}, "pools": {}})
        reserved = sum(f["allocated"] + f["pending_free"] + f["free"]
                       for f in entry["pools"].values())
        # Figures that cannot add up (a device smaller than what is reserved on it) explain
        # nothing; the agent would refuse the whole push for them.
        if reserved <= device_total:
            entry["oom"] = {"size": size, "stream": stream, "device_total": device_total,
                            "device_free": device_free,
                            "pools": _oom_pools(entry["pools"], stream)}
    return summary


def _oom_pools(pools, stream):
    """The (pool, stream, private) figures as the agent takes them: the request's stream's
    default pools first, then the others by reserved bytes; past the agent's bound, the rest
    are added into the last kept entry of another stream that is as private as they are
    (memory the request could not use either way, counted where it belongs). A private
    pool's entry says so (only then: an agent from before private pools refuses the key)."""
    def reserved(item):
        f = item[1]
        return f["allocated"] + f["pending_free"] + f["free"]
    ordered = sorted(pools.items(),
                     key=lambda item: (item[0][1] != stream or item[0][2], -reserved(item)))

    def home(key, private):
        """Whether entry `key` can take the rest of kind `private`: as private, and another
        stream's (the request's own stream's default pools would count it as usable)."""
        return key[2] == private and (private or key[1] != stream)

    if len(ordered) <= MAX_OOM_POOLS:
        kept, rest = ordered, []
    else:
        # Two places are held back for a home of each kind the rest holds, if the entries
        # before lack one; the others go to the next entries in order.
        kept, rest = ordered[:MAX_OOM_POOLS - 2], ordered[MAX_OOM_POOLS - 2:]
        for private in (False, True):
            if (any(k[2] == private for k, _ in rest)
                    and not any(home(k, private) for k, _ in kept)):
                at = next(i for i, (k, _) in enumerate(rest) if home(k, private))
                kept.append(rest.pop(at))
        while len(kept) < MAX_OOM_POOLS:
            kept.append(rest.pop(0))
    out = [dict(f, pool=pool, stream=s, **({"private": True} if private else {}))
           for (pool, s, private), f in kept]
    for (_, _, private), f in rest:
        last = next(e for e in reversed(out)
                    if home((e["pool"], e["stream"], e.get("private", False)), private))
        for key in ("allocated", "requested", "pending_free", "free", "segments_with_free"):
            last[key] += f[key]
        last["largest_free"] = max(last["largest_free"], f["largest_free"])
    return out


def _is_used(stats):
    return any(int(stats.get(key, 0) or 0) > 0
               for key in ("reserved_bytes.all.current", "reserved_bytes.all.peak", "num_ooms"))


def _clean_stats(stats):
    """Integer statistics the agent accepts (it refuses a whole push for one bad value)."""
    out = {}
    for key, value in stats.items():
        if len(out) >= MAX_STATS_KEYS:
            break
        if not isinstance(key, str) or _text_problem(key) or isinstance(value, bool):
            continue
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if number != value or (number < 0 and key != "max_split_size"):
            continue
        out[key] = number
    return out


# host_memory_stats(): the figures sent, under PyTorch 2.10+'s names (#164412). From about 2.7
# to 2.9 the pool's blocks were `segment`/`reserved_bytes` and those in use
# `allocation`/`allocated_bytes`: those are renamed; every other key is dropped.
HOST_KEYS = ("allocated_bytes.current", "active_bytes.current", "allocations.current",
             "active_requests.current", "num_host_alloc", "num_host_free",
             "host_alloc_time.total")
OLD_HOST_KEYS = {"reserved_bytes.current": "allocated_bytes.current",
                 "allocated_bytes.current": "active_bytes.current",
                 "segment.current": "allocations.current",
                 "allocation.current": "active_requests.current"}
MAX_HOST_FIGURE = 1 << 53


def _host(torch):
    """The pinned host memory to push, or None: where this torch has host_memory_stats() and
    the job has pinned memory (never initialising CUDA)."""
    cuda = torch.cuda
    read = getattr(cuda, "host_memory_stats", None)
    if read is None or not cuda.is_initialized():
        return None
    try:
        raw = read()
    except Exception as error:
        _error(error)
        return None
    if not raw:
        return None
    old = "active_bytes.current" not in raw and "reserved_bytes.current" in raw
    out = {}
    for key, value in raw.items():
        name = OLD_HOST_KEYS.get(key, key) if old else key
        if name not in HOST_KEYS or isinstance(value, bool):
            continue
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if number == value and 0 <= number < MAX_HOST_FIGURE:
            out[name] = number
    if not out.get("num_host_alloc") and not out.get("allocated_bytes.current"):
        return None  # the job never pinned memory: no series for it
    # PyTorch reads these without one lock: a figure in use above its pool is a torn read,
    # which the agent would refuse with the whole push. It is left out of this one.
    for part, whole in (("active_bytes.current", "allocated_bytes.current"),
                        ("active_requests.current", "allocations.current")):
        if out.get(part, 0) > out.get(whole, out.get(part, 0)):
            del out[part]
    return out


def _uuid(torch, index):
    with _lock:
        known = _state["uuids"].get(index)
    if known:
        return known
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
    except Exception:  # older PyTorch: no uuid property
        uuid = f"GPU-index-{index}"
    uuid = _clean_text(uuid, "the device UUID")
    with _lock:
        _state["uuids"][index] = uuid
    return uuid


def _devices(torch, snapshot=None):
    """The devices to push: those this process has used, ever (never initialising CUDA)."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return []
    out = []
    for index in range(min(int(cuda.device_count()), MAX_DEVICES)):
        try:
            raw = cuda.memory_stats(index)
            if not raw:
                continue
            with _lock:
                used = index in _state["used"]
            if not used:
                if not _is_used(raw):
                    continue
                with _lock:
                    _state["used"].add(index)
            device = {"index": index, "uuid": _uuid(torch, index), "stats": _clean_stats(raw)}
        except Exception as error:  # one device's failure does not cost the others
            _error(error)
            continue
        if snapshot is not None:
            entry = snapshot.get(index, {"largest": 0, "classes": {}})
            device["largest_free_block"] = entry["largest"]
            device["segments_by_size"] = [
                {"size": size, "segments": n, "free_bytes": free}
                for size, (n, free) in sorted(entry["classes"].items())]
            if "oom" in entry:
                device["oom"] = entry["oom"]
        out.append(device)
    return out


# ---------------------------------------------------------------------------------------------
# Sending


class _Refused(Exception):
    """The agent answered with an error status."""

    def __init__(self, status, message):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _send(url, body, timeout):
    import http.client
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    if url.startswith("unix:"):
        import socket

        class UnixConnection(http.client.HTTPConnection):
            def connect(self):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                try:
                    sock.connect(url[len("unix:"):])
                except OSError:
                    sock.close()
                    raise
                self.sock = sock

        connection = UnixConnection("localhost", timeout=timeout)
        path = PUSH_PATH
    else:
        # http.client, not urllib: an HTTP_PROXY set for the job must not carry node-local
        # pushes away.
        from urllib.parse import urlsplit
        parts = urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=timeout)
        path = parts.path + ("?" + parts.query if parts.query else "")
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        reply = response.read(4096)
        if response.status >= 300:
            raise _Refused(response.status, reply[:300].decode("utf-8", "replace").strip())
    finally:
        connection.close()


def _push(torch, reason=None, timeout=PERIODIC_TIMEOUT, snapshot=None, lock_timeout=5.0,
          min_gap=None):
    """One push of the used devices. Returns "sent", "empty" (nothing to push), "busy",
    "early" (less than min_gap after the last push), "refused:<status>", "dropped" or
    "error". Never raises."""
    import json
    if not _send_lock.acquire(timeout=lock_timeout):
        with _lock:
            _state["dropped"] += 1
            _state["last_error"] = f"a {reason or 'periodic'} push waited for another one"
        return "busy"
    try:
        with _lock:
            config = _state["config"] if _state["active"] else None
            early = min_gap is not None and time.monotonic() - _state["last_push"] < min_gap
            start_time = _state["start_time"]
        if config is None:
            return "empty"
        if early:
            return "early"
        devices = _devices(torch, snapshot)
        if not devices:
            return "empty"
        with _lock:
            # Strictly increasing; from wall-clock milliseconds, so a restarted job whose pid
            # the agent still tracks is not refused as stale.
            _state["seq"] = max(_state["seq"] + 1, int(time.time() * 1000))
            seq = _state["seq"]
        payload = {
            "pid": os.getpid(),
            "seq": seq,
            "torch_version": _clean_text(str(getattr(torch, "__version__", "")),
                                         "torch.__version__"),
            "labels": dict(config["labels"]),
            "devices": devices,
        }
        payload.update(_alloc_conf())
        host = _host(torch)
        if host:
            payload["host"] = host
        if start_time is not None:
            payload["start_time"] = start_time
        if reason:
            payload["reason"] = reason
        with _lock:
            last_oom = _state["last_oom_wall"]
        if last_oom is not None:
            # When it happened, by this node's clock: the agent tells an OOM it saw from one
            # it learns of after its own restart.
            payload["last_oom_unix_seconds"] = last_oom
        body = json.dumps(payload, separators=(",", ":")).encode()
        url = _resolve_url(config["url"])
        try:
            _send(url, body, timeout)
            with _lock:
                _state["sent"] += 1
            return "sent"
        except _Refused as error:
            with _lock:
                _state["dropped"] += 1
                _state["last_error"] = f"{url}: {error}"
            return f"refused:{error.status}"
        except Exception as error:  # unreachable, timed out, reset: the job goes on
            with _lock:
                _state["dropped"] += 1
                _state["last_error"] = f"{url}: {error!r}"
            return "dropped"
        finally:
            with _lock:
                _state["last_push"] = time.monotonic()
    except Exception as error:
        _error(error)
        return "error"
    finally:
        _send_lock.release()


# ---------------------------------------------------------------------------------------------
# Out-of-memory observer, the thread, exit


def _active():
    # A forked child starts inactive (_after_fork_in_child); the pid is not compared, as
    # os.getpid() may be wrapped (a container's namespace shims, the tests).
    with _lock:
        return _state["active"]


def _wake():
    with _lock:
        wake = _state["wake"]
    if wake is not None:
        wake.set()


def _observer(*args):
    """PyTorch's out-of-memory observer (device, requested, device allocated, device free):
    called on the failing thread before the error is raised."""
    try:
        if not _active():
            return
        torch = sys.modules.get("torch")
        now = time.monotonic()
        with _lock:
            if args:
                try:
                    _state["used"].add(int(args[0]))
                except (TypeError, ValueError):
                    pass
            _state["last_oom_wall"] = time.time()
            recent = now - _state["last_oom"] < OOM_GAP
            if recent:
                _state["oom_pending"] = _state["oom_pending"] or (None,)
            else:
                _state["last_oom"] = now
        if recent:
            _wake()
            return
        try:
            snapshot = _snapshot_summary(torch, _oom_request(torch, args))
        except Exception as error:
            snapshot = None  # pushed without the figures rather than with false ones
            _error(error)
        result = _push(torch, "oom", REASON_TIMEOUT, snapshot, lock_timeout=REASON_TIMEOUT)
        if result in ("refused:429", "busy"):
            with _lock:  # the thread sends it once the agent's gap has passed
                _state["oom_pending"] = (snapshot,)
            _wake()
    except Exception as error:
        _error(error)


def _oom_request(torch, args):
    """(device, size, total, free, stream) of the failing allocation, from the observer's
    arguments (device, the size it tried to obtain, the device's total or the limit of a
    memory fraction, the device's free bytes) and the failing thread's current stream; None
    when the arguments are not four whole numbers."""
    if len(args) != 4 or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0
                                 for a in args):
        return None
    device, size, total, free = args
    try:
        stream = int(torch.cuda.current_stream(device).cuda_stream)
    except Exception:  # no current stream to ask for: the default stream's id
        stream = 0
    return device, size, total, free, max(stream, 0)


def _attach_observer(torch):
    """Attaches the observer once per process, once CUDA is initialised (attaching needs it:
    PyTorch adds the observer to each device's allocator)."""
    with _lock:
        if _state["observer"] is not None:
            return
    if not torch.cuda.is_initialized():
        return
    attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    with _lock:
        if _state["observer"] is not None:
            return
        _state["observer"] = False
    if attach is None:
        return
    try:
        attach(_observer)
        with _lock:
            _state["observer"] = True
    except Exception as error:
        _error(error)


def _pending_oom(torch, now):
    """Sends an out-of-memory push the failing thread left to the thread."""
    with _lock:
        pending = _state["oom_pending"]
        due = pending is not None and now - _state["last_oom"] >= OOM_GAP \
            and now - _state["last_push"] >= MIN_GAP
        if due:
            _state["oom_pending"] = None
            _state["last_oom"] = now
    if not due:
        return
    snapshot = pending[0]
    if snapshot is None:
        try:
            snapshot = _snapshot_summary(torch)
        except Exception as error:
            _error(error)
    _push(torch, "oom", REASON_TIMEOUT, snapshot)


def _run(stop, wake):
    next_push = time.monotonic()
    while not stop.is_set():
        try:
            with _lock:
                config = _state["config"]
                pending = _state["oom_pending"] is not None
            interval = config["interval"] if config else DEFAULT_INTERVAL
            torch = _torch()
            now = time.monotonic()
            if torch is not None:
                _attach_observer(torch)
                if pending:
                    _pending_oom(torch, now)
                if now >= next_push:
                    # The gap is checked under the send lock: an out-of-memory push on the
                    # training thread may have gone out just now.
                    result = _push(torch, None, min(interval, PERIODIC_TIMEOUT), min_gap=MIN_GAP)
                    if result == "early":
                        with _lock:
                            next_push = _state["last_push"] + MIN_GAP
                    else:
                        next_push = time.monotonic() + interval
            elif now >= next_push:
                next_push = now + interval
            with _lock:
                last_push = _state["last_push"]
                attached = _state["observer"] is not None
                pending = _state["oom_pending"] is not None
            now = time.monotonic()
            wait = max(next_push, last_push + MIN_GAP) - now
            if not attached:
                wait = min(wait, POLL)
            if pending:
                wait = min(wait, 0.1)
            wake.wait(max(wait, 0.01))
            wake.clear()
        except Exception as error:  # never let the thread die on a surprise
            _error(error)
            stop.wait(1.0)


def _at_exit():
    """The last push, with "reason": "exit", at interpreter exit (not after stop())."""
    try:
        active = _active()
        with _lock:
            stop_event, wake = _state["stop"], _state["wake"]
        if stop_event is not None:
            stop_event.set()
            wake.set()
        if not active:
            return
        torch = _torch()
        if torch is None:
            return
        result = _push(torch, "exit", REASON_TIMEOUT, lock_timeout=REASON_TIMEOUT)
        if result == "refused:429":  # the agent's gap: once more when it has passed
            with _lock:
                gap = MIN_GAP - (time.monotonic() - _state["last_push"])
            time.sleep(min(max(gap, 0.0), MIN_GAP))
            _push(torch, "exit", REASON_TIMEOUT, lock_timeout=REASON_TIMEOUT)
    except Exception as error:
        _error(error)


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
    try:
        with _lock:
            explicit = dict(_state["explicit"])
        for key, value in (("url", url), ("interval", interval), ("labels", labels)):
            if value is not None:
                explicit[key] = value
        config = {
            "url": _check_url(str(explicit["url"]), "url") if explicit.get("url") else None,
            "interval": _interval(explicit.get("interval")),
            "labels": _labels(explicit.get("labels")),
        }
        with _lock:
            _state["explicit"] = explicit
            _state["config"] = config
            _state["active"] = True
            thread = _state["thread"]
            if thread is not None and thread.is_alive() and not _state["stop"].is_set():
                _state["wake"].set()
                return thread
            stop_event, wake = threading.Event(), threading.Event()
            thread = threading.Thread(target=_run, args=(stop_event, wake),
                                      name="gpumem-push", daemon=True)
            _state["thread"], _state["stop"], _state["wake"] = thread, stop_event, wake
            register = not _state["atexit"]
            _state["atexit"] = True
        if register:
            atexit.register(_at_exit)
        thread.start()
        return thread
    except Exception as error:
        _error(error)
        _warn(f"could not start: {error!r}")
        return None


def stop():
    """Stops pushing (the thread ends after its current push); no exit push follows."""
    with _lock:
        stop_event, wake = _state["stop"], _state["wake"]
        _state["active"] = False
    if stop_event is not None:
        stop_event.set()
        wake.set()


def _autostart():
    """Called by the .pth hook at interpreter start: start() if GPUMEM_PUSH asks for it."""
    value = os.environ.get("GPUMEM_PUSH", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        start()
    elif value not in ("", "0", "false", "no", "off"):
        _warn(f"GPUMEM_PUSH={value!r} is neither 1 nor 0; not pushing")
