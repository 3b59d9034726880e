"""What the push hook costs a training job on a real GPU (run by scripts/gpu-check.sh; issue 56).

Usage: gpu_push_cost.py <gpumem binary> <work directory>

Prints, each measured in a job of its own (the hook is one per process):
- a training loop's median step time with the hook off, on (pushing every 0.5 s: ten times
  the default rate), and on with the allocation history (GPUMEM_PUSH_HISTORY=on);
- in the job with the history on, PyTorch's snapshot calls: memory_snapshot() with the
  history and with include_traces=False (where this PyTorch takes it), and what the hook's
  cadence took (its periodic snapshots and their seconds);
- the time from an out-of-memory error to the agent listing the job's recording.
Exits non-zero where a job fails.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

gpumem, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)

# A job: a model's training steps, timed; its report on the last line.
JOB = r"""
import json, os, statistics, sys, time, torch
if os.environ.get("COST_HOOK") == "on":
    import gpumem_push
    gpumem_push.start(url=sys.argv[1], interval=0.5, labels={"job": "gpu-cost"})
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 1024)).cuda()
optimizer = torch.optim.AdamW(model.parameters())
def step():
    loss = model(torch.randn(512, 4096, device="cuda")).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
for _ in range(20):
    step()
torch.cuda.synchronize()
times = []
deadline = time.monotonic() + 8
while time.monotonic() < deadline:
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
report = {"steps": len(times), "median_ms": 1e3 * statistics.median(times)}
if os.environ.get("COST_HOOK") == "on":
    import inspect
    snapshot = torch.cuda.memory_snapshot
    takes = "include_traces" in inspect.signature(snapshot).parameters
    def timed(**kwargs):
        start = time.perf_counter()
        segments = snapshot(**kwargs)
        return 1e3 * (time.perf_counter() - start), len(segments)
    report["snapshot_ms"], report["segments"] = timed()
    if takes:
        report["snapshot_without_history_ms"], _ = timed(include_traces=False)
    report["hook"] = gpumem_push.stats()
print(json.dumps(report))
"""

# A job that records its history and runs out of memory; it prints the time of the error.
OOM = r"""
import sys, time, torch
x = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
time.sleep(1.5)  # the hook's thread sees CUDA, attaches its observer, starts the history
print("oom at", time.time(), flush=True)
torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
"""


def serve(port, socket, recordings=None):
    args = [gpumem, "serve", "--listen", f"127.0.0.1:{port}", "--interval", "0.5",
            "--push-socket", socket, "--pod-resources-socket", ""]
    if recordings:
        args += ["--recordings-dir", recordings]
    agent = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return agent
        except OSError:
            time.sleep(0.2)
    agent.kill()
    sys.exit("FAIL: gpumem serve did not answer /healthz within 15 s")


def job(code, env, *args):
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"FAIL: a job failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    socket = os.path.join(tempfile.mkdtemp(dir=work), "push.sock")
    recordings = os.path.join(work, "recordings")
    agent = serve(19431, socket, recordings)
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
        url = "unix:" + socket
        rows = []
        for name, extra in (("hook off", {}), ("hook on, every 0.5 s", {"COST_HOOK": "on"}),
                            ("hook on, with history", {"COST_HOOK": "on",
                                                       "GPUMEM_PUSH_HISTORY": "on"})):
            rows.append((name, job(JOB, dict(base, **extra), url)))
        off = rows[0][1]["median_ms"]
        print("| job | steps | median step ms | vs off |")
        print("|---|---|---|---|")
        for name, r in rows:
            print(f"| {name} | {r['steps']} | {r['median_ms']:.3f} | "
                  f"{100 * (r['median_ms'] / off - 1):+.2f} % |")
        for name, r in rows[1:]:
            hook = r["hook"]
            if not hook["sent"] or hook["errors"]:
                sys.exit(f"FAIL: {name}: the hook sent {hook['sent']} pushes, "
                         f"{hook['errors']} errors: {hook['last_error']}")
            print(f"{name}: memory_snapshot() {r['snapshot_ms']:.2f} ms over {r['segments']} "
                  f"segments; include_traces=False "
                  f"{r.get('snapshot_without_history_ms', float('nan')):.2f} ms; the hook's "
                  f"snapshots {json.dumps(hook['snapshots'])}; pushes sent {hook['sent']}, "
                  f"errors {hook['errors']}")

        # The time from an OOM to the agent listing the recording.
        env = dict(base, GPUMEM_PUSH="1", GPUMEM_PUSH_SOCKET=socket, GPUMEM_PUSH_INTERVAL="0.5",
                   GPUMEM_PUSH_HISTORY="on", GPUMEM_PUSH_LABELS="job=gpu-cost-oom")
        child = subprocess.Popen([sys.executable, "-c", OOM], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        oom_at = None
        for line in child.stdout:
            if line.startswith("oom at"):
                oom_at = float(line.split()[2])
                break
        listed = None
        deadline = time.time() + 30
        while oom_at is not None and time.time() < deadline:
            try:
                with urllib.request.urlopen("http://127.0.0.1:19431/api/v1/recordings",
                                            timeout=5) as r:
                    entries = json.loads(r.read())
            except OSError as error:
                sys.exit(f"FAIL: the agent's recordings could not be listed: {error!r}")
            entries = entries.get("recordings", entries) if isinstance(entries, dict) \
                else entries
            if any(e.get("pid") == child.pid for e in entries):
                listed = time.time()
                break
            time.sleep(0.05)
        child.wait(timeout=30)
        if oom_at is None or listed is None:
            sys.exit(f"FAIL: no recording listed for the OOM job (stderr:"
                     f" {child.stderr.read()[-2000:]})")
        print(f"from the OOM to the agent listing its recording: {listed - oom_at:.3f} s")
    finally:
        agent.kill()
        agent.wait()


main()
