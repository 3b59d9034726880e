"""A CUDA tensor shared with a child process, recorded by PyTorch's own allocator on a real GPU
(run by scripts/gpu-check.sh): the producer allocates, shares one tensor through
torch.multiprocessing (CUDA IPC), drops its own reference while the child still holds it (the
block waits in the producer's limbo), lets the child release it, and allocates again. It
prints NVML's per-process usage of producer and consumer beside both allocators' figures
while the child holds the tensor (imported memory is in neither consumer figure), records the
producer's snapshot and checks it with `gpumem replay --check`. Exits 1 if it does not replay
exactly.

    python3 scripts/gpu_record_ipc.py GPUMEM_BIN OUT_DIR
"""

import os
import subprocess
import sys

import torch
import torch.multiprocessing as mp

MIB = 1 << 20


def nvml_used():
    """pid -> MiB used on the GPU, as nvidia-smi reports it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        print(f"nvidia-smi: {e}")
        return {}
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        used[int(pid)] = int(mib)
    return used


def figures(who):
    s = torch.cuda.memory_stats()
    return (f"{who}: reserved {s.get('reserved_bytes.all.current', 0) / MIB:.0f} MiB, "
            f"allocated {s.get('allocated_bytes.all.current', 0) / MIB:.0f} MiB")


def consumer(queue, held, release, report):
    tensor = queue.get()
    torch.cuda.synchronize()
    report.put((os.getpid(), figures("consumer"), float(tensor[0].item())))
    held.set()
    release.wait(60)
    del tensor
    torch.cuda.synchronize()
    report.put(figures("consumer after releasing"))


def main():
    gpumem, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"torch {torch.__version__}, device memory {total / 2**30:.1f} GiB")
    ctx = mp.get_context("spawn")
    queue, report = ctx.Queue(), ctx.Queue()
    held, release = ctx.Event(), ctx.Event()
    # A daemon: a failure below does not wait for the consumer.
    child = ctx.Process(target=consumer, args=(queue, held, release, report), daemon=True)
    child.start()

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    keep = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
    shared = torch.full((64 * MIB // 4,), 7.0, device="cuda")
    queue.put(shared)
    if not held.wait(120):
        sys.exit("the consumer never received the tensor")
    consumer_pid, consumer_figures, value = report.get(timeout=30)
    del shared  # the producer lets go: the block waits in the limbo
    used = nvml_used()
    print(f"consumer read {value}; {consumer_figures}")
    print(figures("producer (tensor in limbo)"))
    print(f"NVML: producer {used.get(os.getpid(), '?')} MiB, consumer {used.get(consumer_pid, '?')} MiB")
    release.set()
    print(report.get(timeout=60))
    child.join(60)
    torch.cuda.ipc_collect()
    again = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print(figures("producer after collecting and allocating again"))
    path = os.path.join(out, "ipc_producer.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    del keep, again
    check = subprocess.run([gpumem, "replay", "--check", "--capacity", str(total), path],
                           capture_output=True, text=True, check=False)
    print((check.stdout + check.stderr).strip())
    if check.returncode != 0:
        sys.exit("the producer's recording does not replay exactly")
    print("the producer's recording with a shared tensor replays exactly")


if __name__ == "__main__":
    main()
