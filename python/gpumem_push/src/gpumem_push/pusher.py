"""The pusher: one per process, its state behind one lock, its thread, the out-of-memory
observer and the exit push.

# Invariants
- At most one push is in flight (the send lock), so sequence numbers reach the agent in
  order; a push never raises into the job, and never waits longer than its timeout.
- A forked child starts inactive, with fresh locks: it pushes only if it calls start().
"""

import atexit
import enum
import math
import os
import sys
import threading
import time
import weakref

from . import cadence as _cadence
from . import config as _config
from . import history as _history
from . import readings, sharing, sleeping, transport, xla
from .limits import MAX_DEVICES, MIN_GAP

# Out-of-memory pushes from the failing thread at most this often; one more error within it is
# pushed by the thread, once the gap has passed (a loop retrying smaller batches stays cheap).
OOM_GAP = 1.0
# Seconds a push with a reason may take on the calling thread (the training thread at an
# out-of-memory error, the main thread at exit).
REASON_TIMEOUT = 1.0
PERIODIC_TIMEOUT = 2.0
# How often the thread looks for torch and initialised CUDA until the observer is attached.
POLL = 0.25


class Outcome(enum.Enum):
    """What became of one push."""

    SENT = "sent"
    EMPTY = "empty"        # nothing to push (not started, or no device used yet)
    BUSY = "busy"          # another push held the send lock past the wait
    EARLY = "early"        # less than the gap after the last push
    REFUSED = "refused"    # the agent answered with an error status
    DROPPED = "dropped"    # the agent could not be reached in time
    ERROR = "error"        # reading PyTorch's figures, or this module, failed


class Result:
    """An Outcome, with the agent's status where it refused."""

    __slots__ = ("outcome", "status")

    def __init__(self, outcome, status=None):
        self.outcome = outcome
        self.status = status

    @property
    def rate_limited(self):
        """The agent refused it for coming too soon after the last (HTTP 429)."""
        return self.outcome is Outcome.REFUSED and self.status == 429

    def __repr__(self):
        return f"Result({self.outcome.value}{'' if self.status is None else f', {self.status}'})"


def device_uuid(reported, environ):
    """The UUID NVML spells for a device torch reports as `reported` (PyTorch leaves out the
    prefix): `MIG-<uuid>` for a MIG instance the process was given by its MIG UUID
    (CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES lists `MIG-<uuid>`), else `GPU-<uuid>`."""
    for prefix in ("GPU-", "MIG-"):
        if reported.startswith(prefix):
            return reported
    migs = set()
    for variable in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        for entry in environ.get(variable, "").split(","):
            entry = entry.strip()
            if entry.startswith("MIG-"):
                migs.add(entry[len("MIG-"):].lower())
    return ("MIG-" if reported.lower() in migs else "GPU-") + reported


def _start_time():
    """This process's start time in clock ticks since boot (/proc/self/stat, field 22): with
    the pid, what tells this process apart from another that reuses its pid."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read(4096).decode("ascii", "replace")
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Pusher:
    """This process's pusher. The module's functions (start, stop, stats, settings) are its
    methods on the one instance."""

    def __init__(self):
        self._lock = threading.Lock()       # guards the fields below
        self._send_lock = threading.Lock()  # one push at a time: sequence numbers in order
        self._reset()
        self._observer_state = None  # None: not tried yet; True: attached; False: unavailable
        self._atexit = False
        self._xla_hooks = False  # whether the exception hooks that see XLA's OOMs are set
        self._exit_pushed = False
        if hasattr(os, "register_at_fork"):
            # Weakly: a Pusher let go of is not kept alive by the interpreter's fork hooks.
            ref = weakref.ref(self)

            def child():
                pusher = ref()
                if pusher is not None:
                    pusher._after_fork_in_child()

            os.register_at_fork(after_in_child=child)

    def _reset(self):
        self._start_time = _start_time()  # this process's: read again in a forked child
        self._thread = self._stop = self._wake = None
        self._explicit = {}          # the arguments given to start() (a later call's win)
        self._config = None          # config.Config: what start() settled on
        self._active = False         # between start() and stop()
        self._seq = 0
        self._sent = self._dropped = self._errors = 0
        self._last_error = None
        self._last_push = -math.inf  # monotonic time the last push attempt ended
        self._last_oom = -math.inf   # monotonic time of the last out-of-memory push
        self._last_oom_wall = None   # time.time() of the last out-of-memory error
        # (snapshot or None, whether to take one) for the thread to push with "oom"
        self._oom_pending = None
        self._used = set()           # device indices this process has used: pushed from then on
        self._uuids = {}
        self._warned = set()
        self._history = _history.History()  # a forked child's CUDA is not its parent's
        self._history_queued = False  # whether torch.cuda._lazy_call holds the history's start
        self._observer_seconds = None  # the last out-of-memory observer's wall time
        self._cadence = _cadence.Cadence()  # when a periodic snapshot may be taken
        self._xla_ooms = 0           # XLA out-of-memory errors the exception hooks saw

    def _after_fork_in_child(self):
        # Threads do not survive fork; a forked child (a DataLoader worker, say) does not push
        # unless it calls start() itself, and never sends its parent's exit push. The
        # observer and the exit hook stay registered, as they are.
        self._lock, self._send_lock = threading.Lock(), threading.Lock()
        self._reset()

    # -----------------------------------------------------------------------------------------
    # What it says of itself

    def stats(self):
        """Counters of this process's pushes: sent, dropped (the agent unreachable or
        refusing), errors (a failure reading PyTorch's figures or in this module), and the
        last error; the last out-of-memory observer's wall time on the failing thread
        (seconds), the memory snapshots taken (cadence.Cadence.stats) and the allocation
        history's recordings (history.History.stats)."""
        with self._lock:
            out = {"sent": self._sent, "dropped": self._dropped, "errors": self._errors,
                   "last_error": self._last_error, "observer_seconds": self._observer_seconds}
            recorder, cadence = self._history, self._cadence
        out["snapshots"] = cadence.stats()
        out["history"] = recorder.stats()
        return out

    def settings(self):
        """What start() settled on: url (resolved now), interval, labels; whether the thread
        runs, and whether the out-of-memory observer is attached."""
        with self._lock:
            config, thread = self._config, self._thread
            observer, used = self._observer_state, sorted(self._used)
        return {
            "running": bool(thread is not None and thread.is_alive()),
            "url": _config.resolve_url(config.url if config else None, self._warn),
            "interval": config.interval if config else None,
            "labels": dict(config.labels) if config else {},
            "oom_observer": bool(observer),
            "devices": used,
        }

    def _warn(self, message):
        """One line on stderr, once per process per message."""
        with self._lock:
            if message in self._warned:
                return
            self._warned.add(message)
        try:
            sys.stderr.write("gpumem_push: " + message + "\n")
            sys.stderr.flush()
        except Exception:
            pass

    def _error(self, error):
        with self._lock:
            self._errors += 1
            self._last_error = repr(error)

    def _drop(self, why):
        with self._lock:
            self._dropped += 1
            self._last_error = why

    # -----------------------------------------------------------------------------------------
    # One push

    def _uuid(self, torch, index):
        with self._lock:
            known = self._uuids.get(index)
        if known:
            return known
        try:
            uuid = device_uuid(str(torch.cuda.get_device_properties(index).uuid), os.environ)
        except Exception:  # older PyTorch: no uuid property
            uuid = f"GPU-index-{index}"
        uuid = _config.clean_text(uuid, "the device UUID", self._warn)
        with self._lock:
            self._uuids[index] = uuid
        return uuid

    def _devices(self, torch, snapshot=None):
        """The devices to push: those this process has used, ever (never initialising CUDA)."""
        cuda = torch.cuda
        if not cuda.is_initialized():
            return []
        sleeping.watch()
        unmapped = sleeping.unmapped_bytes()
        out = []
        for index in range(min(int(cuda.device_count()), MAX_DEVICES)):
            try:
                raw = cuda.memory_stats(index)
                if not raw:
                    continue
                with self._lock:
                    used = index in self._used
                if not used:
                    if not readings.is_used(raw):
                        continue
                    with self._lock:
                        self._used.add(index)
                device = {"index": index, "uuid": self._uuid(torch, index),
                          "stats": readings.clean_stats(raw)}
                limit = sharing.memory_limit(os.environ, index)
                if limit is not None:
                    device["memory_limit"] = limit
                if unmapped.get(index):
                    # Part of the reserved bytes, never more (the agent refuses more).
                    reserved = device["stats"].get("reserved_bytes.all.current", 0)
                    device["unmapped_bytes"] = min(unmapped[index], max(0, reserved))
            except Exception as error:  # one device's failure does not cost the others
                self._error(error)
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

    def _xla_devices(self, torch, room):
        """A JAX job's GPU devices (at most `room`), with their PJRT figures and the
        out-of-memory errors counted (on the first device: the error does not say which);
        [] where jax has not initialised its GPUs."""
        if xla.find_jax() is None:
            return []
        with self._lock:
            ooms = self._xla_ooms
        try:
            devices = xla.gpu_devices()[:max(room, 0)]
        except Exception as error:  # PyTorch's devices still go
            self._error(error)
            return []
        out = []
        for device in devices:
            try:
                figures = xla.stats(device)
                if figures is None:
                    continue
                hardware = getattr(device, "local_hardware_id", None)
                ordinal = int(device.id if hardware is None else hardware)
                uuid = None
                if torch is not None and torch.cuda.is_initialized() \
                        and ordinal < int(torch.cuda.device_count()):
                    uuid = self._uuid(torch, ordinal)  # the same CUDA ordinal, named by CUDA
                uuid = uuid or xla.visible_uuid(ordinal, os.environ)
                uuid = _config.clean_text(uuid or f"GPU-index-{ordinal}", "the device UUID",
                                          self._warn)
            except Exception as error:  # one device's failure does not cost the others
                self._error(error)
                continue
            if not out:
                figures["num_ooms"] = ooms
            out.append({"index": ordinal, "uuid": uuid, "allocator": "xla", "stats": figures})
        return out

    def push(self, torch, reason=None, timeout=PERIODIC_TIMEOUT, snapshot=None,
             lock_timeout=5.0, min_gap=None):
        """One push of the used devices, PyTorch's (where `torch`) and XLA's, with `reason`
        ("oom", "exit") or none. Never raises."""
        import json  # here, not at import: the hook imports this package at interpreter start

        if not self._send_lock.acquire(timeout=lock_timeout):
            self._drop(f"a {reason or 'periodic'} push waited for another one")
            return Result(Outcome.BUSY)
        try:
            with self._lock:
                config = self._config if self._active else None
                early = min_gap is not None and time.monotonic() - self._last_push < min_gap
                start_time = self._start_time
            if config is None:
                return Result(Outcome.EMPTY)
            if early:
                return Result(Outcome.EARLY)
            devices = self._devices(torch, snapshot) if torch is not None else []
            xla_devices = self._xla_devices(torch, MAX_DEVICES - len(devices))
            devices += xla_devices
            if not devices:
                return Result(Outcome.EMPTY)
            with self._lock:
                # Strictly increasing; from wall-clock milliseconds, so a restarted job whose
                # pid the agent still tracks is not refused as stale.
                self._seq = max(self._seq + 1, int(time.time() * 1000))
                seq = self._seq
            payload = {
                "pid": os.getpid(),
                "seq": seq,
                "labels": dict(config.labels),
                "devices": devices,
            }
            if torch is not None:
                payload["torch_version"] = _config.clean_text(
                    str(getattr(torch, "__version__", "")), "torch.__version__", self._warn)
                payload.update(_config.alloc_conf(self._warn))
                host = readings.host(torch, self._error)
                if host:
                    payload["host"] = host
            if xla_devices:
                jax = xla.find_jax()
                payload["jax_version"] = _config.clean_text(
                    str(getattr(jax, "__version__", "")), "jax.__version__", self._warn)
                payload["xla_conf"] = _config.clean_text(
                    xla.settings(os.environ), "XLA_PYTHON_CLIENT_*", self._warn)
            if start_time is not None:
                payload["start_time"] = start_time
            if reason:
                payload["reason"] = reason
            with self._lock:
                last_oom = self._last_oom_wall
            if last_oom is not None:
                # When it happened, by this node's clock: the agent tells an OOM it saw from
                # one it learns of after its own restart.
                payload["last_oom_unix_seconds"] = last_oom
            body = json.dumps(payload, separators=(",", ":")).encode()
            url = _config.resolve_url(config.url, self._warn)
            try:
                transport.send(url, body, timeout)
                with self._lock:
                    self._sent += 1
                return Result(Outcome.SENT)
            except transport.Refused as error:
                self._drop(f"{url}: {error}")
                return Result(Outcome.REFUSED, error.status)
            except Exception as error:  # unreachable, timed out, reset: the job goes on
                self._drop(f"{url}: {error!r}")
                return Result(Outcome.DROPPED)
            finally:
                with self._lock:
                    self._last_push = time.monotonic()
        except Exception as error:
            self._error(error)
            return Result(Outcome.ERROR)
        finally:
            self._send_lock.release()

    # -----------------------------------------------------------------------------------------
    # Out-of-memory observer, the thread, exit

    def _is_active(self):
        # A forked child starts inactive (_after_fork_in_child); the pid is not compared, as
        # os.getpid() may be wrapped (a container's namespace shims, the tests).
        with self._lock:
            return self._active

    def _wake_thread(self):
        with self._lock:
            wake = self._wake
        if wake is not None:
            wake.set()

    def _observe_oom(self, *args):
        """PyTorch's out-of-memory observer (device, requested, device allocated, device
        free): called on the failing thread before the error is raised. Its wall time is
        kept for stats()."""
        started = time.monotonic()
        try:
            self._observe(*args)
        finally:
            with self._lock:
                self._observer_seconds = time.monotonic() - started

    def _observe(self, *args):
        try:
            if not self._is_active():
                return
            torch = sys.modules.get("torch")
            now = time.monotonic()
            with self._lock:
                if args:
                    try:
                        self._used.add(int(args[0]))
                    except (TypeError, ValueError):
                        pass
                self._last_oom_wall = time.time()
                recent = now - self._last_oom < OOM_GAP
                if recent:
                    self._oom_pending = self._oom_pending or (None, True)
                else:
                    self._last_oom = now
            if recent:
                self._wake_thread()
                return
            snapshot = self._oom_summary(torch, readings.oom_request(torch, args))
            result = self.push(torch, "oom", REASON_TIMEOUT, snapshot,
                               lock_timeout=REASON_TIMEOUT)
            if result.rate_limited or result.outcome is Outcome.BUSY:
                with self._lock:  # the thread sends it once the agent's gap has passed
                    self._oom_pending = (snapshot, snapshot is None)
                self._wake_thread()
            # After the push, which names the process to the agent: the recording follows it,
            # unless the agent could not be reached just now (then it goes to the directory).
            with self._lock:
                config, recorder, start_time = self._config, self._history, self._start_time
            url = _config.resolve_url(config.url if config else None, self._warn)
            reachable = result.outcome not in (Outcome.DROPPED, Outcome.REFUSED)
            recorder.record(torch, url, os.getpid(), start_time, transport.send, self._warn,
                            send_to_agent=reachable)
        except Exception as error:
            self._error(error)

    def _oom_summary(self, torch, request=None):
        """The snapshot's summary at an out-of-memory error (None where it fails: pushed
        without the figures rather than with false ones), timed for the cadence."""
        return self._timed_summary("oom", lambda: readings.snapshot_summary(torch, request))

    def _periodic_summary(self, torch, now):
        """A snapshot's summary for a periodic push, where the cadence lets one be taken
        now; else None. Where the job's PyTorch cannot leave the allocation history out of a
        snapshot and the history is recorded (by this hook, or by the job: the snapshot shows
        it), periodic snapshots stop."""
        with self._lock:
            cadence, recorder = self._cadence, self._history
        if not cadence.due(now) or not torch.cuda.is_initialized():
            return None
        snapshot = getattr(torch.cuda, "memory_snapshot", None)
        if snapshot is None:
            cadence.turn_off("this PyTorch has no memory_snapshot")
            return None
        if not readings.takes_include_traces(snapshot) and recorder.state() == "on":
            cadence.turn_off("this PyTorch's snapshots copy the allocation history, which "
                             "GPUMEM_PUSH_HISTORY records")
            return None

        def read():
            segments, history = readings.periodic_segments(torch)
            if history:
                cadence.turn_off("this PyTorch's snapshots copy the allocation history, which "
                                 "the job records")
            return readings.summarize(segments)

        return self._timed_summary("periodic", read)

    def _timed_summary(self, kind, read):
        """`read()`'s summary (None where it fails), its time reported to the cadence as a
        snapshot of `kind`."""
        with self._lock:
            cadence = self._cadence
        started = time.monotonic()
        try:
            return read()
        except Exception as error:
            self._error(error)
            return None
        finally:
            end = time.monotonic()
            cadence.took(kind, end - started, end)

    def _watch_xla_errors(self):
        """Sets, once per process, the exception hooks that see XLA's out-of-memory errors
        (JAX has no observer): the interpreter's for the main thread and threading's for the
        others, each calling the one it replaces."""
        with self._lock:
            if self._xla_hooks:
                return
            self._xla_hooks = True
        # JAX's own exit handler (registered when jax was imported) drops its backends, and
        # handlers run last-registered first: registered again now, the exit push runs
        # before it and still finds the GPUs (_at_exit runs once).
        atexit.register(self._at_exit)
        previous, previous_thread = sys.excepthook, threading.excepthook

        def hook(kind, value, traceback):
            self._xla_error(value)
            previous(kind, value, traceback)

        def thread_hook(args):
            self._xla_error(args.exc_value)
            previous_thread(args)

        sys.excepthook, threading.excepthook = hook, thread_hook

    def _xla_error(self, error):
        """An uncaught exception: if XLA ran out of memory, counted and pushed at once (the
        process is most likely ending; its exit push follows)."""
        try:
            if not self._is_active() or not xla.is_out_of_memory(error):
                return
            now = time.monotonic()
            with self._lock:
                self._xla_ooms += 1
                self._last_oom_wall = time.time()
                recent = now - self._last_oom < OOM_GAP
                if not recent:
                    self._last_oom = now
            result = None
            if not recent:  # several threads dying at once: one push now, one after the gap
                result = self.push(readings.find_torch(), "oom", REASON_TIMEOUT,
                                   lock_timeout=REASON_TIMEOUT)
            if result is None or result.rate_limited or result.outcome is Outcome.BUSY:
                with self._lock:  # the thread sends it, without a PyTorch snapshot
                    self._oom_pending = self._oom_pending or (None, False)
                self._wake_thread()
        except Exception as failure:
            self._error(failure)

    def _attach_observer(self, torch):
        """Attaches the observer once per process, once CUDA is initialised (attaching needs
        it: PyTorch adds the observer to each device's allocator)."""
        with self._lock:
            if self._observer_state is not None:
                return
        if not torch.cuda.is_initialized():
            return
        attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer",
                         None)
        with self._lock:
            if self._observer_state is not None:
                return
            self._observer_state = False
        if attach is None:
            return
        try:
            attach(self._observe_oom)
            with self._lock:
                self._observer_state = True
        except Exception as error:
            self._error(error)

    def _start_history(self, torch):
        """Turns the allocation history on once CUDA is initialised: from CUDA's own lazy
        initialisation where PyTorch offers it (so the first allocations are recorded too),
        else from this thread once it sees CUDA initialised. Never initialises CUDA."""
        with self._lock:
            recorder, queued = self._history, self._history_queued
            self._history_queued = True
        if recorder.state() is not None:
            return
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if not queued and lazy_call is not None and not torch.cuda.is_initialized():
            # Runs while CUDA initialises (is_initialized() is still false then). PyTorch keeps
            # the queue across fork: in a child (whose recorder is a new one) it does nothing.
            pid = os.getpid()

            def start():
                if os.getpid() == pid and self._history is recorder:
                    recorder.enable(torch, self._warn, initialising=True)

            lazy_call(start)
            return
        recorder.enable(torch, self._warn)

    def _pending_oom(self, torch, now):
        """Sends an out-of-memory push the failing thread left to the thread."""
        with self._lock:
            pending = self._oom_pending
            due = pending is not None and now - self._last_oom >= OOM_GAP \
                and now - self._last_push >= MIN_GAP
            if due:
                self._oom_pending = None
                self._last_oom = now
        if not due:
            return
        snapshot, take = pending
        if snapshot is None and take and torch is not None and torch.cuda.is_initialized():
            snapshot = self._oom_summary(torch)
        self.push(torch, "oom", REASON_TIMEOUT, snapshot)

    def _run(self, stop, wake):
        next_push = time.monotonic()
        while not stop.is_set():
            try:
                with self._lock:
                    config = self._config
                    pending = self._oom_pending is not None
                interval = config.interval if config else _config.DEFAULT_INTERVAL
                torch = readings.find_torch()
                jax = xla.find_jax()
                now = time.monotonic()
                if jax is not None:
                    self._watch_xla_errors()
                if torch is not None:
                    self._attach_observer(torch)
                    self._start_history(torch)
                if torch is not None or jax is not None:
                    if pending:
                        self._pending_oom(torch, now)
                    if now >= next_push:
                        # The gap is checked under the send lock: an out-of-memory push on the
                        # training thread may have gone out just now.
                        with self._lock:
                            early = now - self._last_push < MIN_GAP
                        snapshot = None if early or torch is None \
                            else self._periodic_summary(torch, now)
                        result = self.push(torch, None, min(interval, PERIODIC_TIMEOUT),
                                           snapshot, min_gap=MIN_GAP)
                        if result.outcome is Outcome.EARLY:
                            with self._lock:
                                next_push = self._last_push + MIN_GAP
                        else:
                            next_push = time.monotonic() + interval
                elif now >= next_push:
                    next_push = now + interval
                with self._lock:
                    last_push = self._last_push
                    attached = self._observer_state is not None
                    pending = self._oom_pending is not None
                now = time.monotonic()
                wait = max(next_push, last_push + MIN_GAP) - now
                if not attached:
                    wait = min(wait, POLL)
                if pending:
                    wait = min(wait, 0.1)
                wake.wait(max(wait, 0.01))
                wake.clear()
            except Exception as error:  # never let the thread die on a surprise
                self._error(error)
                stop.wait(1.0)

    def _at_exit(self):
        """The last push, with "reason": "exit", at interpreter exit (not after stop()); once,
        though it may be registered twice."""
        with self._lock:
            if self._exit_pushed:
                return
            self._exit_pushed = True
        try:
            active = self._is_active()
            with self._lock:
                stop_event, wake = self._stop, self._wake
            if stop_event is not None:
                stop_event.set()
                wake.set()
            if not active:
                return
            torch = readings.find_torch()
            if torch is None and xla.find_jax() is None:
                return
            result = self.push(torch, "exit", REASON_TIMEOUT, lock_timeout=REASON_TIMEOUT)
            if result.rate_limited:  # the agent's gap: once more when it has passed
                with self._lock:
                    gap = MIN_GAP - (time.monotonic() - self._last_push)
                time.sleep(min(max(gap, 0.0), MIN_GAP))
                self.push(torch, "exit", REASON_TIMEOUT, lock_timeout=REASON_TIMEOUT)
        except Exception as error:
            self._error(error)

    # -----------------------------------------------------------------------------------------
    # Start and stop

    def start(self, url=None, interval=None, labels=None):
        """See the module's start()."""
        try:
            with self._lock:
                explicit = dict(self._explicit)
            for key, value in (("url", url), ("interval", interval), ("labels", labels)):
                if value is not None:
                    explicit[key] = value
            config = _config.Config.of(explicit, self._warn)
            history_settings = _history.Settings.from_environment(self._warn)
            with self._lock:
                self._explicit = explicit
                self._config = config
                self._history.configure(history_settings)
                self._active = True
                thread = self._thread
                if thread is not None and thread.is_alive() and not self._stop.is_set():
                    self._wake.set()
                    return thread
                stop_event, wake = threading.Event(), threading.Event()
                thread = threading.Thread(target=self._run, args=(stop_event, wake),
                                          name="gpumem-push", daemon=True)
                self._thread, self._stop, self._wake = thread, stop_event, wake
                register = not self._atexit
                self._atexit = True
            if register:
                atexit.register(self._at_exit)
            thread.start()
            return thread
        except Exception as error:
            self._error(error)
            self._warn(f"could not start: {error!r}")
            return None

    def stop(self):
        """See the module's stop()."""
        with self._lock:
            stop_event, wake = self._stop, self._wake
            self._active = False
        if stop_event is not None:
            stop_event.set()
            wake.set()
