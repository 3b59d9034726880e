"""A placement plan on a real GPU (run by scripts/gpu-check.sh): the same training steps are
recorded under PyTorch's own allocator, planned with `gpumem plan`, then run again with gpumem
as the allocator following the plan; the plan's hits and misses come from its /metrics.

Usage: gpu_plan_check.py GPUMEM_BINARY WORK_DIR"""

import os
import subprocess
import sys
import time
import urllib.request

STEPS = 12


def train(torch):
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(STEPS):
        x = torch.randn(128, 2048, device="cuda")
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()


def record(snapshot):
    import torch

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    train(torch)
    torch.cuda.memory._dump_snapshot(snapshot)
    print(f"recorded under PyTorch's allocator: peak reserved "
          f"{torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")


def follow(plan, port):
    import gpumem_torch

    gpumem_torch.enable(conf=f"plan:{plan}", metrics_listen=f"127.0.0.1:{port}")
    import torch  # noqa: E402  (after enable)

    train(torch)
    time.sleep(1.5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("gpumem_allocator_plan_requests_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
        if line.startswith(("gpumem_allocator_peak_reserved_bytes", "gpumem_allocator_info")):
            print(line)
    print(f"following the plan: {counts}")
    assert counts.get("hit", 0) > 0, "the plan served requests on the GPU"


def main():
    if len(sys.argv) == 4:
        {"record": lambda: record(sys.argv[2]), "follow": lambda: follow(sys.argv[2], sys.argv[3])}[
            sys.argv[1]]()
        return
    gpumem, work = sys.argv[1], sys.argv[2]
    snapshot, plan = os.path.join(work, "snap.pickle"), os.path.join(work, "plan.json")
    subprocess.run([sys.executable, __file__, "record", snapshot, "-"], check=True)
    subprocess.run([gpumem, "plan", snapshot, "-o", plan], check=True)
    subprocess.run([sys.executable, __file__, "follow", plan, "19422"], check=True)


if __name__ == "__main__":
    main()
