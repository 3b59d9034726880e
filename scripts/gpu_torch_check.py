"""A few training steps with gpumem as PyTorch's allocator; prints the allocator's /metrics
beside NVML's used memory for this process (run by scripts/gpu-check.sh)."""

import os
import subprocess
import time
import urllib.request

import gpumem_torch

gpumem_torch.enable(conf="expandable_segments:False", metrics_listen="127.0.0.1:19418")

import torch  # noqa: E402  (after enable: the allocator must be swapped before CUDA starts)

model = torch.nn.Sequential(
    torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
).cuda()
optimizer = torch.optim.AdamW(model.parameters())
started = time.time()
for _ in range(20):
    x = torch.randn(256, 4096, device="cuda")
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.cuda.synchronize()
print(f"20 training steps in {time.time() - started:.2f} s, loss {loss.item():.4f}")
time.sleep(1.5)
text = urllib.request.urlopen("http://127.0.0.1:19418/metrics", timeout=5).read().decode()
for line in text.splitlines():
    if line.startswith(("gpumem_allocator_reserved_bytes", "gpumem_allocator_allocated_bytes")):
        print(line)
reserved = sum(
    float(line.rsplit(" ", 1)[1])
    for line in text.splitlines()
    if line.startswith("gpumem_allocator_reserved_bytes")
)
smi = subprocess.run(
    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
    capture_output=True, text=True, check=False,
).stdout
used = [int(u) for p, u in (l.split(", ") for l in smi.strip().splitlines() if l) if int(p) == os.getpid()]
print(f"allocator reserved {reserved / 2**20:.0f} MiB; NVML used by this process {used[0] if used else 'n/a'} MiB")
assert reserved > 0, "the allocator served PyTorch"
if used:
    assert used[0] * 2**20 >= reserved, "NVML sees at least what the allocator reserved"

# A CUDA graph capture: PyTorch's pluggable interface cannot route it to a private pool, so
# gpumem refuses the capture's allocations (an out-of-memory error, its reason on stderr)
# rather than hand the graph's memory to other tensors afterwards.
static = torch.randn(256, 4096, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph, stream=side):
        captured = model(static)
    raise SystemExit("a graph captured on gpumem's allocator: its memory is not kept apart")
except (torch.OutOfMemoryError, RuntimeError) as e:
    print(f"graph capture refused as expected: {type(e).__name__}")
torch.cuda.synchronize()
x = torch.randn(256, 4096, device="cuda")
print(f"after the refused capture, a training step still runs: {model(x).sum().item():.2f}")
