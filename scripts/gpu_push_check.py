"""Unmodified PyTorch pushing to `gpumem serve` on a real GPU (run by scripts/gpu-check.sh).

Usage: gpu_push_check.py <push socket> <agent port>

Trains a few steps with PyTorch's own allocator, provokes an out-of-memory error, and checks
the agent's /metrics against torch.cuda.memory_stats(): the pushed figures, the segments by
size of the out-of-memory snapshot, and that the pushed UUID is NVML's (the line-up join).
Exits non-zero on the first mismatch.
"""

import os
import sys
import time
import urllib.request

socket_path, port = sys.argv[1], int(sys.argv[2])

import torch  # noqa: E402

import gpumem_push  # noqa: E402

gpumem_push.start(url="unix:" + socket_path, interval=0.6, labels={"job": "gpu-check"})
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 1024)).cuda()
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(10):
    loss = model(torch.randn(256, 4096, device="cuda")).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.cuda.synchronize()
sent = gpumem_push.stats()["sent"]
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: out of memory
    sys.exit("FAIL: a 1 PiB allocation succeeded")
except torch.cuda.OutOfMemoryError:
    pass
deadline = time.time() + 10
while gpumem_push.stats()["sent"] <= sent + 1 and time.time() < deadline:
    time.sleep(0.1)
print("pushes:", gpumem_push.stats())
time.sleep(0.3)
stats = torch.cuda.memory_stats(0)
snapshot = torch.cuda.memory_snapshot()
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
pid = str(os.getpid())


def series(name):
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") and f'pid="{pid}"' in line:
            labels, value = line.rsplit(" ", 1)
            out.append((labels, float(value)))
    return out


failures = []


def expect(what, got, want):
    print(f"{what}: agent {got}, PyTorch {want}")
    if got != want:
        failures.append(what)


allocated = sum(v for _, v in series("gpumem_allocator_allocated_bytes"))
expect("allocated bytes", allocated, float(stats["allocated_bytes.all.current"]))
expect("OOMs", sum(v for _, v in series("gpumem_allocator_ooms_total")),
       float(stats["num_ooms"]))
segments = sum(v for _, v in series("gpumem_allocator_segments_by_size"))
expect("segments by size (sum)", segments, float(len(snapshot)))
free = sum(v for _, v in series("gpumem_allocator_segment_free_bytes_by_size"))
inactive = sum(b["size"] for s in snapshot for b in s["blocks"] if b["state"] == "inactive")
expect("free bytes by size (sum)", free, float(inactive))
largest = series("gpumem_allocator_largest_free_block_bytes")
expect("largest free block series", len(largest), 1)
uuids = {l.split('UUID="')[1].split('"')[0] for l, _ in series("gpumem_allocator_allocated_bytes")}
nvml = {l.split('UUID="')[1].split('"')[0] for l in text.splitlines()
        if l.startswith("gpumem_device_total_bytes{")}
print("pushed UUIDs", uuids, "NVML UUIDs", nvml)
if not uuids or not uuids <= nvml:
    failures.append("the pushed UUID is not NVML's")
used = series("gpumem_process_used_bytes")
print("NVML's line for this process:", used or "none (the driver lists no processes here)")
if failures:
    sys.exit("FAIL: " + ", ".join(failures))
print("push check passed")
