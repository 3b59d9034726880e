"""Helpers of the Python tests: a recording stand-in for the agent's push endpoint (over HTTP on
loopback and over a Unix socket) that applies the agent's rules to every payload, and child
Python processes that see the stand-in torch (tests/fake_torch) and never this checkout."""

import http.server
import json
import os
import re
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_TORCH = os.path.join(HERE, "fake_torch")
FAKE_JAX = os.path.join(HERE, "fake_jax")
REPO = os.path.dirname(os.path.dirname(HERE))

PUSH_KEYS = {"pid", "seq", "torch_version", "alloc_conf", "alloc_conf_generic", "labels",
             "devices", "reason", "last_oom_unix_seconds", "start_time", "host", "jax_version",
             "xla_conf"}
# The host figures the hook sends (it drops every other key of host_memory_stats()).
HOST_KEYS = {"allocated_bytes.current", "active_bytes.current", "allocations.current",
             "active_requests.current", "num_host_alloc", "num_host_free",
             "host_alloc_time.total"}
DEVICE_KEYS = {"index", "uuid", "allocator", "stats", "largest_free_block", "segments_by_size",
               "oom", "unmapped_bytes", "memory_limit"}
# PJRT's memory_stats() keys a JAX device's push carries, and the hook's OOM count.
XLA_STATS = {"num_allocs", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size",
             "bytes_limit", "bytes_reserved", "peak_bytes_reserved", "bytes_reservable_limit",
             "largest_free_block_bytes", "pool_bytes", "peak_pool_bytes", "num_ooms"}
OOM_KEYS = {"size", "stream", "device_total", "device_free", "pools"}
POOL_KEYS = {"pool", "stream", "allocated", "requested", "pending_free", "free", "largest_free",
             "segments_with_free"}
RANK_LABELS = {"rank", "local_rank", "world_size", "run_id"}
NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
MIN_INTERVAL = 0.5


def text_ok(value):
    return (isinstance(value, str) and len(value.encode()) <= 128
            and not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value))


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_payload(p):
    """Why the agent would refuse this payload (its shape and values), or None."""
    if not isinstance(p, dict):
        return "not an object"
    if set(p) - PUSH_KEYS:
        return f"unknown keys {sorted(set(p) - PUSH_KEYS)}"
    if not is_int(p.get("pid")) or p["pid"] <= 0 or not is_int(p.get("seq")) or p["seq"] <= 0:
        return "pid and seq must be positive integers"
    for key in ("torch_version", "alloc_conf", "alloc_conf_generic", "jax_version", "xla_conf"):
        if key in p and not text_ok(p[key]):
            return f"bad {key}"
    if "reason" in p and p["reason"] not in ("oom", "exit"):
        return f"unknown reason {p['reason']!r}"
    labels = p.get("labels", {})
    if not isinstance(labels, dict):
        return "labels must be an object"
    if len([n for n in labels if n not in RANK_LABELS]) > 8:
        return "more than 8 labels"
    if sum(len(n.encode()) + len(v.encode()) for n, v in labels.items()) > 512:
        return "labels take more than 512 bytes together"
    for name, value in labels.items():
        # Names the agent sets itself are exported as exported_<name>, not refused.
        if (not NAME.match(name) or name.startswith("__") or len(name) > 64
                or not text_ok(value)):
            return f"bad label {name!r}={value!r}"
    if "host" in p:
        host = p["host"]
        if not isinstance(host, dict) or not host or set(host) - HOST_KEYS:
            return f"bad host {host!r}"
        if any(not is_int(v) or not 0 <= v < 1 << 53 for v in host.values()):
            return f"bad host figure in {host!r}"
        for part, whole in (("active_bytes.current", "allocated_bytes.current"),
                            ("active_requests.current", "allocations.current")):
            if part in host and whole in host and host[part] > host[whole]:
                return f"host: {part} exceeds {whole}"
    devices = p.get("devices")
    if not isinstance(devices, list) or not 1 <= len(devices) <= 16:
        return "devices must list 1 to 16 devices"
    for field in ("index", "uuid"):
        kinds = [(d.get("allocator", "pytorch"), str(d.get(field)).lower().split("-", 1)[-1])
                 for d in devices if isinstance(d, dict)]
        if len(set(kinds)) != len(kinds):
            return f"a device listed twice under one allocator (by {field})"
    for d in devices:
        if not isinstance(d, dict) or set(d) - DEVICE_KEYS or not {"index", "uuid", "stats"} <= set(d):
            return f"bad device {d!r}"
        if not is_int(d["index"]) or d["index"] < 0 or not text_ok(d["uuid"]):
            return "bad device index or uuid"
        for key, value in d["stats"].items():
            if not text_ok(key) or not is_int(value) or (value < 0 and key != "max_split_size"):
                return f"bad statistic {key}={value!r}"
        if d.get("allocator", "pytorch") not in ("pytorch", "xla"):
            return f"bad allocator {d['allocator']!r}"
        if d.get("allocator") == "xla":
            st = d["stats"]
            if set(st) - XLA_STATS or set(d) - {"index", "uuid", "allocator", "stats"}:
                return f"bad xla device {d!r}"
            if st.get("bytes_in_use", 0) > st.get("pool_bytes", 1 << 62):
                return "xla: bytes_in_use exceeds pool_bytes"
        if "memory_limit" in d:
            limit = d["memory_limit"]
            if not isinstance(limit, dict) or set(limit) != {"bytes", "variable"} \
                    or not is_int(limit["bytes"]) or not 0 < limit["bytes"] < 1 << 60 \
                    or not isinstance(limit["variable"], str) \
                    or not re.fullmatch(r"[A-Z0-9_]{1,64}", limit["variable"]):
                return f"bad memory_limit {limit!r}"
        if "unmapped_bytes" in d:
            reserved = d["stats"].get("reserved_bytes.all.current", 0)
            if not is_int(d["unmapped_bytes"]) or not 0 <= d["unmapped_bytes"] <= reserved:
                return f"unmapped_bytes {d['unmapped_bytes']!r} not within the reserved {reserved}"
        if "segments_by_size" in d:
            if not is_int(d.get("largest_free_block")):
                return "segments_by_size without largest_free_block"
            sizes = set()
            for c in d["segments_by_size"]:
                if set(c) != {"size", "segments", "free_bytes"}:
                    return f"bad class {c!r}"
                size = c["size"]
                if size <= 0 or size & (size - 1) or size in sizes:
                    return f"bad class size {size}"
                if c["free_bytes"] > c["segments"] * size:
                    return f"class {size}: free bytes do not fit"
                sizes.add(size)
        if "oom" in d:
            problem = check_oom(d["oom"])
            if problem:
                return problem
    return None


def check_oom(oom):
    """Why the agent would refuse a device's out-of-memory figures, or None."""
    if not isinstance(oom, dict) or set(oom) != OOM_KEYS:
        return f"bad oom {oom!r}"
    if not all(is_int(oom[k]) and 0 <= oom[k] < 1 << 60 for k in OOM_KEYS - {"pools"}):
        return f"bad oom figures {oom!r}"
    pools = oom["pools"]
    if not isinstance(pools, list) or len(pools) > 64:
        return "oom pools must list at most 64 entries"
    seen = set()
    for p in pools:
        if (not isinstance(p, dict) or set(p) - {"private"} != POOL_KEYS
                or p["pool"] not in ("small", "large")
                or not isinstance(p.get("private", False), bool)):
            return f"bad oom pool {p!r}"
        key = (p["pool"], p["stream"], p.get("private", False))
        if key in seen:
            return f"oom pool listed twice {p!r}"
        seen.add(key)
        if p["requested"] > p["allocated"] or p["largest_free"] > p["free"]:
            return f"inconsistent oom pool {p!r}"
        if (p["segments_with_free"] == 0) != (p["free"] == 0):
            return f"oom pool segments with free do not match its free bytes {p!r}"
    return None


class Recorder:
    """Records every push it is sent, and answers as the agent would: 422 for a payload it
    would refuse, 409 for a sequence number not after the last accepted one of the pid, 429
    for a push without a reason less than 0.5 s after the pid's previous accepted push.
    `status` forces every answer (an agent refusing everything)."""

    def __init__(self, status=None):
        self.status = status
        self.pushes = []  # dicts: t, payload, status, error, transport, peer_pid
        self.cond = threading.Condition()
        self.last = {}  # pid: (seq, time)
        self.recordings = []  # dicts: path, content_type, body, peer_pid, status
        self.recording_status = None  # forces the answer to recordings alone
        self.recordings_busy = 0  # recordings answered "busy" (429) before the others

    def record(self, path, body, transport, peer_pid):
        now = time.monotonic()
        entry = {"t": now, "payload": None, "status": 200, "error": None,
                 "transport": transport, "peer_pid": peer_pid}
        try:
            payload = json.loads(body)
            entry["payload"] = payload
            problem = None if path == "/api/v1/push" else f"path {path}"
            problem = problem or check_payload(payload)
        except ValueError as error:
            problem = f"not JSON: {error}"
        with self.cond:
            if self.status is not None:
                entry["status"], entry["error"] = self.status, "refused on purpose"
            elif problem:
                entry["status"], entry["error"] = 422, problem
            else:
                pid = peer_pid or payload["pid"]
                seq, last = self.last.get(pid, (0, -1e9))
                if payload["seq"] <= seq:
                    entry["status"], entry["error"] = 409, f"seq {payload['seq']} <= {seq}"
                elif "reason" not in payload and now - last < MIN_INTERVAL:
                    entry["status"], entry["error"] = 429, f"{now - last:.3f} s after the last"
                else:
                    self.last[pid] = (payload["seq"], now)
            self.pushes.append(entry)
            self.cond.notify_all()
        return entry["status"], entry["error"] or "accepted"

    def accepted(self):
        with self.cond:
            return [e["payload"] for e in self.pushes if e["status"] == 200]

    def refused(self):
        with self.cond:
            return [e for e in self.pushes if e["status"] != 200]

    def wait_for(self, predicate, timeout):
        """Waits until predicate(accepted payloads) holds; returns whether it did."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                accepted = [e["payload"] for e in self.pushes if e["status"] == 200]
                if predicate(accepted):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)


    def record_recording(self, path, content_type, body, peer_pid):
        """An upload of a recording: kept as sent; 201, or the forced status."""
        with self.cond:
            busy = self.recordings_busy > 0
            self.recordings_busy -= busy
            status = 429 if busy else (self.status or self.recording_status
                                       or (201 if content_type == "application/gzip" else 403))
            self.recordings.append({"path": path, "content_type": content_type, "body": body,
                                    "peer_pid": peer_pid, "status": status})
            self.cond.notify_all()
        if busy:  # the agent's words when it receives two recordings already
            return status, "2 recordings are being received already; try again later"
        return status, "kept" if status == 201 else "refused"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        peer_pid = None
        if self.server.transport == "unix" and hasattr(socket, "SO_PEERCRED"):
            creds = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            struct.calcsize("3i"))
            peer_pid = struct.unpack("3i", creds)[0]
        if self.path.startswith("/api/v1/recordings"):
            status, message = self.server.recorder.record_recording(
                self.path, self.headers.get("Content-Type"), body, peer_pid)
        else:
            status, message = self.server.recorder.record(self.path, body,
                                                          self.server.transport, peer_pid)
        reply = json.dumps({"result": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


class _HttpServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    transport = "http"


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    transport = "unix"


class Agent:
    """A Recorder served over HTTP on 127.0.0.1 (path None) or a Unix socket (path)."""

    def __init__(self, recorder=None, path=None, port=0):
        self.recorder = recorder or Recorder()
        self.path = path
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.server = _UnixServer(path, _Handler)
            self.url = "unix:" + path
        else:
            self.server = _HttpServer(("127.0.0.1", port), _Handler)
            self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/push"
        self.server.recorder = self.recorder
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)


def child_env(tmp, **extra):
    """The environment of a child job: none of this process's gpumem, torchrun, XLA, device
    or proxy settings, the stand-in torch and jax on PYTHONPATH, no agent socket unless a
    test makes one, and a proxy that goes nowhere (pushes to the node's agent must never use
    one)."""
    drop = ("GPUMEM_", "PYTORCH_", "FAKE_TORCH_", "FAKE_JAX_", "XLA_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                    "TORCHELASTIC_RUN_ID", "PYTHONPATH",
                                                    "CUDA_VISIBLE_DEVICES",
                                                    "NVIDIA_VISIBLE_DEVICES")
           and k.lower() not in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")}
    env.update({
        "PYTHONPATH": os.pathsep.join((FAKE_TORCH, FAKE_JAX)),
        "PYTHONUNBUFFERED": "1",
        "GPUMEM_PUSH_SOCKET": os.path.join(tmp, "no-agent", "push.sock"),
        "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Child:
    """A child Python job running `code` (dedented) on `python` (this interpreter by default);
    its last stdout line is JSON."""

    def __init__(self, code, env, cwd, python=sys.executable):
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [python, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.process.pid

    def finish(self, timeout=20):
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            raise AssertionError(f"the child ran past {timeout} s; stderr:\n{err}")
        self.stdout, self.stderr, self.rc = out, err, self.process.returncode
        self.elapsed = time.monotonic() - self.started
        lines = out.strip().splitlines()
        try:
            self.result = json.loads(lines[-1]) if lines else None
        except ValueError:
            self.result = None
        return self


def tempdir(test):
    """A temporary directory removed after the test (short: Unix socket paths are)."""
    d = tempfile.TemporaryDirectory(prefix="gpumem-", dir="/tmp")
    test.addCleanup(d.cleanup)
    return d.name
