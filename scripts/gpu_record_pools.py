"""Recordings with private pools, made by PyTorch's own allocator on a real GPU (run by
scripts/gpu-check.sh): a CUDA graph captured and replayed, a MemPool with use_on_oom serving a
default request, a graph pool shared by two captures, and an OOM inside a graph pool under
set_per_process_memory_fraction. Each snapshot is checked with `gpumem replay --check` and
explained with `gpumem explain`; the snapshots stay in OUT_DIR (small ones can become
fixtures). Exits 1 if a recording does not replay exactly.

    python3 scripts/gpu_record_pools.py GPUMEM_BIN OUT_DIR
"""

import inspect
import os
import subprocess
import sys

import torch

MIB = 1 << 20
gpumem, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
total = torch.cuda.get_device_properties(0).total_memory
print(f"torch {torch.__version__}, device memory {total / 2**30:.1f} GiB")


def model():
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)
    ).cuda()


def warm_up(net, x):
    """Runs `net` a few times on a side stream, as capture needs before it starts."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            net(x)
    torch.cuda.current_stream().wait_stream(side)


def limit_to(extra):
    """Lets the process reserve `extra` bytes more than it holds now."""
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, (torch.cuda.memory_reserved() + extra) / total)
    )


def graph_capture(alive):
    net, x = model(), torch.randn(64, 1024, device="cuda")
    warm_up(net, x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = net(x)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
    torch.cuda.synchronize()
    alive.extend([net, x, graph, y])


def mem_pool_use_on_oom(alive):
    if "use_on_oom" not in inspect.signature(torch.cuda.MemPool).parameters:
        print("this torch's MemPool has no use_on_oom: recorded without it")
        pool = torch.cuda.MemPool()
    else:
        pool = torch.cuda.MemPool(use_on_oom=True)
    with torch.cuda.use_mem_pool(pool):
        scratch = torch.empty(120 * MIB, dtype=torch.uint8, device="cuda")
        del scratch
    limit_to(200 * MIB)
    try:
        # A 20 MiB segment of the default pool, then a request only the pool's cache serves.
        small = torch.empty(10 * MIB, dtype=torch.uint8, device="cuda")
        big = torch.empty(100 * MIB, dtype=torch.uint8, device="cuda")
        alive.extend([pool, small, big])
    except torch.OutOfMemoryError as e:
        print(f"use_on_oom did not serve the default request: {str(e).splitlines()[0]}")
        alive.append(pool)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def shared_graph_pool(alive):
    net, x = model(), torch.randn(64, 1024, device="cuda")
    warm_up(net, x)
    handle = torch.cuda.graph_pool_handle()
    first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(first, pool=handle):
        y = net(x)
    with torch.cuda.graph(second, pool=handle):
        z = net(y)
    for _ in range(3):
        first.replay()
        second.replay()
    torch.cuda.synchronize()
    alive.extend([net, x, first, second, y, z])


def graph_pool_oom(alive):
    net, x = model(), torch.randn(64, 1024, device="cuda")
    warm_up(net, x)
    limit_to(64 * MIB)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            y = net(x)
            too_big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
            alive.append(too_big)
        print("the capture did not run out of memory")
    except torch.OutOfMemoryError as e:
        print(f"out of memory inside the capture, as meant: {str(e).splitlines()[0]}")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.synchronize()
    alive.extend([net, x, graph])


def record(name, body):
    """Runs `body` with history recorded and dumps the snapshot while what it made lives."""
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    alive = []
    try:
        body(alive)
    finally:
        path = os.path.join(out, f"{name}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        alive.clear()
        torch.cuda.synchronize()
    return path


failed = []
for name, body in [
    ("graph_capture", graph_capture),
    ("mem_pool_use_on_oom", mem_pool_use_on_oom),
    ("shared_graph_pool", shared_graph_pool),
    ("graph_pool_oom", graph_pool_oom),
]:
    path = record(name, body)
    print(f"\n== {name}: {os.path.getsize(path)} bytes")
    check = subprocess.run(
        [gpumem, "replay", "--check", "--capacity", str(total), path],
        capture_output=True, text=True, check=False,
    )
    print((check.stdout + check.stderr).strip())
    if check.returncode != 0:
        failed.append(name)
    explained = subprocess.run(
        [gpumem, "explain", "--capacity", str(total), path],
        capture_output=True, text=True, check=False,
    )
    print("\n".join((explained.stdout + explained.stderr).strip().splitlines()[:24]))

if failed:
    sys.exit(f"not replayed exactly: {', '.join(failed)}")
print("\nevery recording with private pools replays exactly")
