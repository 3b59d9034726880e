"""The failing job's last moments: PyTorch's allocation history, turned on at a bounded cost
(GPUMEM_PUSH_HISTORY), and its snapshot sent to the agent at an out-of-memory error
(POST /api/v1/recordings), gzipped, within a size and a time cap.

Settings (read at start()):
- GPUMEM_PUSH_HISTORY: the history's entries, 100 to 100 000 (`on`: 20 000); unset, empty or
  0: off. Each entry is an allocator event with its Python stack: PyTorch keeps at most this
  many, about 0.5 to 2 kB each with their frames (a real recording of 19 464 entries with
  stacks is 3.7 MB pickled, 229 kB gzipped).
- GPUMEM_PUSH_HISTORY_INTERVAL: seconds between two recordings of one process (600): OOM
  observers also fire for OOMs a program catches (autotuners, vLLM's memory profiling).
- GPUMEM_PUSH_HISTORY_DIR: where a recording the agent could not take is written instead.

# Invariants
- History is turned on only once CUDA is initialised (`_record_memory_history` initialises
  CUDA itself, which would break fork-based data loaders), and only under PyTorch's native
  allocator (`cudaMallocAsync` records no history; gpumem_torch jobs send gpumem's own).
- A recording costs the failing thread the snapshot, its pickling and gzipping (about a
  second for 100 000 entries), then its upload: sent only if RECORDING_SECONDS are not spent
  by then, each network step (connecting, sending, the answer) within what is left of them
  (so at worst three times that), and not at all where the agent just failed to take the
  out-of-memory push. It is at most MAX_BYTES gzipped (the agent's default cap), else
  dropped or written to the directory; it never raises into the job.
"""

import math
import os
import threading
import time

DEFAULT_ENTRIES = 20_000
MIN_ENTRIES = 100
MAX_ENTRIES = 100_000
DEFAULT_INTERVAL = 600.0
MAX_BYTES = 16 << 20
RECORDING_SECONDS = 10.0
RECORDINGS_PATH = "/api/v1/recordings"
RETRY_WAIT = 0.25


class Settings:
    """What GPUMEM_PUSH_HISTORY* say: entries (0: off), interval (seconds), directory."""

    __slots__ = ("entries", "interval", "directory")

    def __init__(self, entries, interval, directory):
        self.entries, self.interval, self.directory = entries, interval, directory

    @classmethod
    def from_environment(cls, warn):
        raw = os.environ.get("GPUMEM_PUSH_HISTORY", "").strip().lower()
        entries = 0
        if raw in ("on", "true", "yes"):
            entries = DEFAULT_ENTRIES
        elif raw not in ("", "0", "off", "false", "no"):
            try:
                entries = int(raw)
            except ValueError:
                warn(f"GPUMEM_PUSH_HISTORY={raw!r} is not a number of entries; history is off")
            if entries and not MIN_ENTRIES <= entries <= MAX_ENTRIES:
                clamped = min(max(entries, MIN_ENTRIES), MAX_ENTRIES)
                warn(f"GPUMEM_PUSH_HISTORY={entries} is outside {MIN_ENTRIES} to {MAX_ENTRIES}; "
                     f"keeping {clamped}")
                entries = clamped
        interval = DEFAULT_INTERVAL
        raw_interval = os.environ.get("GPUMEM_PUSH_HISTORY_INTERVAL", "").strip()
        if raw_interval:
            try:
                interval = float(raw_interval)
                if not math.isfinite(interval) or interval < 0:
                    raise ValueError
            except ValueError:
                warn(f"GPUMEM_PUSH_HISTORY_INTERVAL={raw_interval!r} is not a number of "
                     f"seconds; keeping {DEFAULT_INTERVAL:g}")
                interval = DEFAULT_INTERVAL
        directory = os.environ.get("GPUMEM_PUSH_HISTORY_DIR", "").strip() or None
        return cls(entries, interval, directory)


def recordings_url(push_url):
    """Where recordings go, beside pushes: the agent's socket, or the push URL's
    /api/v1/push made /api/v1/recordings."""
    if push_url.startswith("unix:"):
        return push_url
    base, sep, _ = push_url.rpartition("/api/v1/push")
    return (base if sep else push_url.rstrip("/")) + RECORDINGS_PATH


class History:
    """This process's history: whether it was turned on, and its recordings' counters."""

    def __init__(self):
        self._lock = threading.Lock()
        self.settings = None
        self._state = None       # None: not tried; "on"; or why it is off
        self._last = -math.inf   # monotonic time of the last recording
        self._counts = {"sent": 0, "saved": 0, "dropped": 0, "skipped": 0}
        self._last_seconds = None
        self._last_error = None

    def configure(self, settings):
        with self._lock:
            self.settings = settings

    def state(self):
        """`on`, why it is off, or None (not tried yet)."""
        with self._lock:
            return self._state

    def stats(self):
        """Recordings sent, saved to the directory, dropped, skipped (within the interval),
        the last one's seconds on the failing thread, and the last failure."""
        with self._lock:
            return dict(self._counts, seconds=self._last_seconds, last_error=self._last_error,
                        state=self._state)

    def enable(self, torch, warn, initialising=False):
        """Turns PyTorch's history on, once, where settings ask for it, CUDA is initialised
        (or `initialising`: called from CUDA's lazy initialisation) and the allocator is the
        native one. Never raises; never initialises CUDA."""
        with self._lock:
            settings = self.settings
            if self._state is not None or settings is None or not settings.entries:
                return
            self._state = "starting"
        state = "on"
        try:
            cuda = torch.cuda
            if not initialising and not cuda.is_initialized():
                with self._lock:
                    self._state = None  # asked again once it is
                return
            backend = getattr(cuda.memory, "get_allocator_backend", lambda: "native")()
            record = getattr(cuda.memory, "_record_memory_history", None)
            if backend != "native":
                state = f"off: the {backend} allocator keeps no history"
            elif record is None:
                state = "off: this PyTorch cannot record history"
            else:
                try:
                    record(enabled="all", context="all", stacks="python",
                           max_entries=settings.entries)
                except TypeError:  # PyTorch 2.0's signature
                    record(True, trace_alloc_max_entries=settings.entries,
                           trace_alloc_record_context=True)
        except Exception as error:
            state = f"off: {error!r}"
        with self._lock:
            self._state = state
        if state != "on":
            warn(f"allocation history is {state}")

    def record(self, torch, push_url, pid, start_time, send, warn, send_to_agent=True):
        """At an out-of-memory error, on the failing thread: the snapshot, gzipped, sent to
        the agent (`send(url, body, timeout, path, content_type)`; not where `send_to_agent`
        is false: the agent was just unreachable), else written to the directory; at most
        once per interval. Returns what became of it."""
        started = time.monotonic()
        with self._lock:
            settings = self.settings
            if self._state != "on" or settings is None:
                return None
            if started - self._last < settings.interval:
                self._counts["skipped"] += 1
                return "skipped"
            self._last = started
        outcome, error = "dropped", None
        body = None
        try:
            import gzip
            import pickle
            snapshot = torch.cuda.memory._snapshot()
            body = gzip.compress(pickle.dumps(snapshot, protocol=4), compresslevel=1)
            if len(body) > MAX_BYTES:
                raise ValueError(f"the recording is {len(body)} bytes gzipped, over {MAX_BYTES}")
            if not send_to_agent:
                raise ConnectionError("the agent did not take the out-of-memory push")
            left = RECORDING_SECONDS - (time.monotonic() - started)
            if left <= 0:
                raise TimeoutError(f"taking the snapshot used its {RECORDING_SECONDS:g} s")
            url = recordings_url(push_url)
            if url.startswith("unix:"):
                path = RECORDINGS_PATH
            else:
                from urllib.parse import urlsplit
                path = urlsplit(url).path
            query = f"?pid={pid}" + (f"&start_time={start_time}" if start_time else "")
            while True:
                try:
                    send(url, body, left, path + query, "application/gzip")
                    break
                except Exception as busy:
                    # The agent receives one recording at a time per pod or host user, three
                    # in all (all ranks of a job may fail together): asked to wait, the upload
                    # is tried again in the time left.
                    # (The agent's words for it, src/ingest/recordings.rs: not its refusal of a
                    # second recording of this process within a minute, which waiting for
                    # cannot cure.)
                    left = RECORDING_SECONDS - (time.monotonic() - started)
                    if getattr(busy, "status", None) != 429 or "being received" not in str(busy) \
                            or left <= RETRY_WAIT:
                        raise
                    time.sleep(RETRY_WAIT)
                    left -= RETRY_WAIT
            outcome = "sent"
        except Exception as error_:
            error = f"{error_!r}"
            if body is not None and len(body) <= MAX_BYTES and settings.directory:
                try:
                    path = os.path.join(settings.directory,
                                        f"gpumem-{pid}-{int(time.time())}.pickle.gz")
                    os.makedirs(settings.directory, exist_ok=True)
                    with open(path, "xb") as f:
                        f.write(body)
                    outcome = "saved"
                except Exception as save_error:
                    error = f"{error}; and writing it: {save_error!r}"
        seconds = time.monotonic() - started
        with self._lock:
            self._counts[outcome] += 1
            self._last_seconds = seconds
            if error:
                self._last_error = error
        if error:
            warn(f"the recording at the out-of-memory error was {outcome}: {error}")
        return outcome
