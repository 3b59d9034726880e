"""What the push hook's own work costs a job: per periodic push (with a memory snapshot's
summary) and per out-of-memory error (history off and on), against a stand-in PyTorch whose
snapshot has a realistic shape (1 000 and 10 000 segments of one to eight blocks, the blocks
with and without eight Python frames each, as `_record_memory_history(stacks="python")`
leaves them).

What is measured, per operation, as the median of its runs (and the least CPU time: on a
shared machine the median carries other tenants' interference):
- cpu: the calling thread's CPU time (time.thread_time), the hook's Python work and its send,
  with no other thread running;
- wall: the operation's elapsed time, likewise;
- gil: the time another Python thread lost while the operation ran beside it (a thread
  counting in a loop, against its rate alone): the time the hook held the interpreter's lock,
  and so the time a training thread would wait for it.
The agent is a stand-in in another process (its CPU is not counted) that answers 200 to
every POST. PyTorch's own share (building the snapshot in C++ under the allocator's lock and
converting it to Python objects) is not here: the stand-in hands over a prebuilt list. That
share the hook times in the job itself (`cadence`), and the GPU check measures.

Run with the hook installed (scripts/test-python runs it once, with --quick):

    python python/benches/push_cost.py [--quick]
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types

MIB = 1 << 20
TARGET_MS = 2.0  # a periodic push at 1 000 segments, the hook's Python CPU

# The stand-in agent: answers 200 to every request, in a process of its own.
SERVER = r"""
import socket, sys, os
path = sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(64)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(body) < length:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        body += chunk
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    conn.close()
"""

FRAMES = [{"filename": f"/opt/venv/lib/python3.11/site-packages/model/layer{i}.py",
           "line": 100 + i, "name": f"forward_{i}"} for i in range(8)]


def stats_dict():
    """memory_stats() as PyTorch returns it: about 130 keys."""
    out = {}
    for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                 "requested_bytes", "allocation", "segment", "active", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{pool}.{kind}"] = 0
    for pool in ("all", "large_pool"):
        out[f"reserved_bytes.{pool}.current"] = 60 << 30
        out[f"reserved_bytes.{pool}.peak"] = 62 << 30
        out[f"allocated_bytes.{pool}.current"] = 50 << 30
        out[f"active_bytes.{pool}.current"] = 50 << 30
    out.update({"num_alloc_retries": 3, "num_ooms": 0, "num_sync_all_streams": 0,
                "num_device_alloc": 900, "num_device_free": 12, "max_split_size": -1,
                "oversize_allocations.current": 0, "oversize_segments.current": 0})
    return out


def segments(count, frames):
    """`count` segments as a training job's cache holds them (a fixed pseudo-random draw):
    a small-pool segment of 2 MiB in ten, large ones of 20 MiB to 1 GiB, each split in one to
    eight blocks, in use (60 %), free (30 %) or freed and waiting on a stream (10 %)."""
    draw = random.Random(56)
    out = []
    address = 0x7F0000000000
    for _ in range(count):
        small = draw.random() < 0.1
        total = 2 * MIB if small else draw.choice((20, 40, 64, 128, 256, 1024)) * MIB
        cuts = sorted(draw.sample(range(1, total // 512), draw.randint(0, 7)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [total // 512])]
        blocks = []
        at, allocated, active = address, 0, 0
        for size in sizes:
            size *= 512
            roll = draw.random()
            state = ("active_allocated" if roll < 0.6 else "inactive" if roll < 0.9
                     else "active_pending_free")
            allocated += size if state == "active_allocated" else 0
            active += size if state != "inactive" else 0
            blocks.append({"address": at, "size": size, "requested_size": size - 256,
                           "state": state, "frames": list(frames) if frames else []})
            at += size
        out.append({"device": 0, "address": address, "total_size": total,
                    "allocated_size": allocated, "active_size": active,
                    "requested_size": max(allocated - 256, 0), "stream": 0,
                    "segment_type": "small" if small else "large",
                    "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                    "blocks": blocks})
        address += total
    return out


def trace(entries):
    """A history of `entries` allocator events, each with eight frames."""
    return [{"action": "alloc" if i % 2 == 0 else "free_completed", "addr": 0x7F0000000000 + i,
             "size": 4 * MIB, "stream": 0, "time_us": 1_700_000_000_000_000 + i,
             "frames": FRAMES} for i in range(entries)]


def stand_in_torch(snapshot_segments, history):
    """A torch with one initialised device whose snapshot is `snapshot_segments` (prebuilt:
    PyTorch's share is not measured) and whose history is `history`."""
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0"

    class Props:
        uuid = "6a1f0e2c-0000-4000-8000-000000000000"

    stats = stats_dict()

    def memory_snapshot(mempool_id=None, include_traces=True):
        return snapshot_segments

    memory = types.SimpleNamespace(
        _snapshot=lambda device=None: {"segments": snapshot_segments,
                                       "device_traces": [history]},
        _record_memory_history=lambda *a, **k: None,
        get_allocator_backend=lambda: "native")
    torch.cuda = types.SimpleNamespace(
        is_initialized=lambda: True, device_count=lambda: 1,
        memory_stats=lambda index=None: stats, get_device_properties=lambda i: Props,
        memory_snapshot=memory_snapshot, memory=memory,
        current_stream=lambda device=None: types.SimpleNamespace(cuda_stream=0))
    torch._C = types.SimpleNamespace(_cuda_attach_out_of_memory_observer=lambda f: None)
    return torch


class Victim:
    """A thread counting in a loop while it is not paused: what it does not count while an
    operation runs is the time the operation held the interpreter's lock."""

    def __init__(self):
        self.count = 0
        self.counting = threading.Event()
        self.running = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while self.running:
            if not self.counting.is_set():
                self.counting.wait(0.05)
                continue
            self.count += 1


def measure(operation, runs, victim):
    """Median (cpu, gil, wall) seconds of `operation` over `runs`, and the least cpu: cpu and
    wall with no other thread running, gil over as many runs beside the counting thread."""
    cpu, wall, gil = [], [], []
    for _ in range(runs):
        c0, w0 = time.thread_time(), time.perf_counter()
        operation()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    victim.counting.set()
    try:
        for _ in range(runs):
            # The counting thread's rate alone, just before: 20 ms of it counting.
            t0, n0 = time.perf_counter(), victim.count
            time.sleep(0.02)
            t1, n1 = time.perf_counter(), victim.count
            rate = (n1 - n0) / (t1 - t0)
            operation()
            t2, n2 = time.perf_counter(), victim.count
            if rate > 0:  # the counting thread ran in its window (else: no reading)
                gil.append(max(0.0, (t2 - t1) - (n2 - n1) / rate))
    finally:
        victim.counting.clear()
    return (statistics.median(cpu), min(cpu), statistics.median(gil) if gil else float("nan"),
            statistics.median(wall))


def pace():
    """The least CPU time of three loops of 10^6 integer additions: how fast this machine
    runs Python now, to scale the figures by."""
    best = float("inf")
    for _ in range(3):
        start, total = time.thread_time(), 0
        for i in range(1_000_000):
            total += i
        best = min(best, time.thread_time() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few runs (the test command's)")
    args = parser.parse_args()

    import gpumem_push
    from gpumem_push import history as _history
    from gpumem_push import readings, transport
    from gpumem_push.config import Config
    from gpumem_push.pusher import Pusher

    tmp = tempfile.mkdtemp(prefix="gpumem-bench-")
    path = os.path.join(tmp, "agent.sock")
    server = subprocess.Popen([sys.executable, "-c", SERVER, path], stdout=subprocess.PIPE,
                              text=True)
    try:
        server.stdout.readline()
        url = f"unix:{path}"
        warn = lambda message: None  # noqa: E731
        victim = Victim()
        runs = {1000: 5 if args.quick else 40, 10000: 3 if args.quick else 10}
        history_entries = 20_000  # GPUMEM_PUSH_HISTORY=on
        rows = []
        for count in (1000, 10000):
            for frames in (False, True):
                snapshot = segments(count, FRAMES if frames else None)
                torch = stand_in_torch(snapshot, trace(history_entries))
                pusher = Pusher()
                pusher._config = Config.of({"url": url, "interval": 3600.0}, warn)
                pusher._active = True

                def periodic():
                    segs, _ = readings.periodic_segments(torch)
                    summary = readings.summarize(segs)
                    result = pusher.push(torch, None, snapshot=summary)
                    assert result.outcome.value == "sent", result

                def oom():
                    request = readings.oom_request(torch, (0, 8 << 30, 80 << 30, 0))
                    summary = readings.snapshot_summary(torch, request)
                    result = pusher.push(torch, "oom", snapshot=summary)
                    assert result.outcome.value == "sent", result

                recorder = _history.History()
                recorder.configure(_history.Settings(history_entries, 0.0, None))
                recorder.enable(torch, warn)

                def oom_with_history():
                    oom()
                    outcome = recorder.record(torch, url, os.getpid(), None, transport.send,
                                              warn)
                    assert outcome == "sent", (outcome, recorder.stats())

                n = runs[count]
                cases = [("periodic push", periodic, n), ("OOM push", oom, n),
                         (f"OOM push + recording ({history_entries} entries)",
                          oom_with_history, max(2, n // 4))]
                for name, operation, k in cases:
                    operation()  # warm: imports, first connection
                    cpu, least, gil, wall = measure(operation, k, victim)
                    rows.append((name, count, "8" if frames else "0", cpu, least, gil, wall))
        victim.running = False
    finally:
        server.kill()
        server.wait()
        try:
            os.unlink(path)
            os.rmdir(tmp)
        except OSError:
            pass

    print(f"gpumem_push {gpumem_push.__version__}, Python {sys.version.split()[0]}; "
          f"medians{' (--quick: few runs)' if args.quick else ''}; this machine's pace: "
          f"10^6 Python additions in {pace() * 1e3:.0f} ms of CPU")
    print()
    print("| operation | segments | frames per block | cpu ms | least cpu ms | gil ms | wall ms |")
    print("|---|---|---|---|---|---|---|")
    for name, count, frames, cpu, least, gil, wall in rows:
        print(f"| {name} | {count} | {frames} | {cpu * 1e3:.2f} | {least * 1e3:.2f} | "
              f"{gil * 1e3:.2f} | {wall * 1e3:.2f} |")
    periodic = [(cpu, least) for name, count, _, cpu, least, _, _ in rows
                if name == "periodic push" and count == 1000]
    print()
    print(f"periodic push at 1 000 segments: {max(c for c, _ in periodic) * 1e3:.2f} ms of CPU "
          f"(median; least {max(m for _, m in periodic) * 1e3:.2f} ms; target: at most "
          f"{TARGET_MS:g} ms)")


if __name__ == "__main__":
    main()
