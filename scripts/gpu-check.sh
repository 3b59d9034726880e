#!/usr/bin/env bash
# GPU checks for a machine with one NVIDIA GPU (under 5 minutes). Run from the repository root:
#
#   ./scripts/gpu-check.sh                       # builds first (needs cargo)
#   GPUMEM_BIN_DIR=dir ./scripts/gpu-check.sh    # uses dir/gpumem, dir/it (the integration
#                                                # tests, feature cuda), dir/libgpumem_torch.so
#
# Output, in order:
#   1. "== build": the library, the agent and libgpumem_torch.so built with the `cuda` feature.
#   2. "== core on the GPU": the GPU tests of tests/it/gpu.rs, which the normal test command
#      skips: the specification's scenarios on real cudaMalloc, a free deferred behind real work
#      on a second stream, expandable segments mapping real pages, and this GPU's driver-cost
#      table (issue 57): every call the simulated clock prices, measured at 2 MiB, 20 MiB and
#      1 GiB where it has a size, printed and written to target/gpu-costs.json (the
#      `gpumem-costs` format `--costs` reads; docs/planning.md), then a line
#      "GPU timings: cudaMalloc(2 MiB) …, cudaFree …, create+map+set access of a 20 MiB page …,
#      cache hit (malloc+free of 4 MiB) …".
#      "== plans priced by this GPU": `gpumem plan --compare --costs target/gpu-costs.json` on
#      the bundled cs336_lm_compiled_train: driver calls and time of the recorded
#      configuration, of whole and of paged plans, under the measured table.
#   3. "== agent": `gpumem serve` for two seconds: gpumem_source_up{source="nvml"} must be 1,
#      and the NVML device totals are printed.
#   4. "== installing gpumem_push and gpumem_torch into a virtual environment" (only where
#      `import torch` finds CUDA): pip installs python/gpumem_push and python/gpumem_torch into
#      target/gpu-check-venv, which sees the machine's torch; the next two steps run in it.
#      "== PyTorch with gpumem as its allocator": a few
#      training steps of a small model with gpumem as the pluggable allocator, then the
#      allocator's /metrics beside NVML's used memory for this process, then a CUDA graph
#      capture, which gpumem must refuse (it cannot keep a graph's memory apart).
#      "== recordings with private pools …": scripts/gpu_record_pools.py records, with
#      PyTorch's own allocator, a graph capture and its replays, a MemPool with use_on_oom, a
#      graph pool shared by two captures and an OOM inside a graph pool, then runs
#      `gpumem replay --check` and `gpumem explain` on each.
#      "== a tensor shared with another process …": scripts/gpu_record_ipc.py shares a tensor
#      with a child over CUDA IPC, prints NVML's per-process usage of both beside both
#      allocators' figures while the child holds it, and checks the producer's recording
#      (its block waiting in the limbo, collected, the memory reused) with `replay --check`.
#      "== a placement plan …": the same kind of training steps recorded under PyTorch's own
#      allocator, `gpumem plan` on the recording, and the steps again with gpumem following the
#      plan (GPUMEM_ALLOC_CONF=plan:PATH): its /metrics must count plan hits.
#   5. "== PyTorch pushing to the agent" (likewise): PyTorch's own allocator with gpumem_push,
#      an out-of-memory error, and the agent's figures checked against memory_stats().
#      "== the push hook's cost …": scripts/gpu_push_cost.py: a training loop's median step
#      time with the hook off, on (every 0.5 s) and on with the history, PyTorch's snapshot
#      with and without the history, the hook's own snapshots, and the seconds from an OOM to
#      the agent listing its recording (issue 56).
#   6. "== an unmodified job, the hook switched on by GPUMEM_PUSH=1, dies of an OOM":
#      scripts/gpu_oom_job.py (no gpumem import) started before `gpumem serve`; after it died
#      of torch.OutOfMemoryError, the agent still serves its ooms_total (1), its last OOM's time
#      and its reserved bytes, labelled exported_job="gpu-check-oom".
#   A final "GPU checks passed" line, or the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

bin="${GPUMEM_BIN_DIR:-}"
if [[ -z "$bin" ]]; then
    step "build"
    cargo build --release --features cuda
    cargo build --release -p gpumem-torch
    bin=target/gpu-check
    mkdir -p "$bin"
    cp target/release/gpumem target/release/libgpumem_torch.so "$bin/"
    # The integration tests' executable, by its target's name (cargo lists the agent's too, in
    # no fixed order).
    cp "$(cargo test --release --features cuda --test it --no-run --message-format=json \
        | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "it"][-1])')" "$bin/it"
fi
bin="$(cd "$bin" && pwd)"

step "core on the GPU"
export GPUMEM_COSTS_OUT="$PWD/target/gpu-costs.json"
mkdir -p target
"$bin/it" gpu --ignored --nocapture --test-threads 1

step "plans priced by this GPU"
"$bin/gpumem" plan data/traces/cs336_lm_compiled_train.noframes.json.gz --compare \
    --costs "$GPUMEM_COSTS_OUT"

step "agent"
"$bin/gpumem" serve --listen 127.0.0.1:19417 --interval 0.5 --push-socket "" 2>/dev/null &
agent=$!
trap 'kill $agent 2>/dev/null || true' EXIT
sleep 2
curl -s 127.0.0.1:19417/metrics | grep -E '^gpumem_(source_up|device_(total|used|free)_bytes)'
curl -s 127.0.0.1:19417/metrics | grep -q 'gpumem_source_up{source="nvml"} 1'
kill $agent

if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    step "installing gpumem_push and gpumem_torch into a virtual environment"
    # --system-site-packages: the machine's torch stays visible. A GPU machine may reach no
    # package index: pip then builds with the setuptools already there, where it can.
    venv=target/gpu-check-venv
    clean() {
        rm -rf python/gpumem_push/build python/gpumem_torch/build \
            python/gpumem_push/src/*.egg-info python/gpumem_torch/src/*.egg-info
    }
    rm -rf "$venv"
    clean
    python3 -m venv --system-site-packages "$venv"
    # --system-site-packages reaches the base interpreter's packages only: where torch lives
    # in a virtual environment of its own (python3 is that environment's), its site-packages
    # are added to the new one's path, after the new one's own.
    python3 -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
        > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-check-parent.pth"
    offline=()
    if "$venv/bin/python" -c '
import sys, setuptools
try:
    import setuptools.command.bdist_wheel  # setuptools >= 70.1
except ImportError:
    import wheel.bdist_wheel
sys.exit(0 if int(setuptools.__version__.split(".")[0]) >= 61 else 1)' 2>/dev/null; then
        offline=(--no-build-isolation)
    fi
    env -u PYTHONPATH "$venv/bin/python" -m pip install --quiet ${offline[@]+"${offline[@]}"} \
        ./python/gpumem_push ./python/gpumem_torch
    clean
    python="$PWD/$venv/bin/python"

    step "PyTorch with gpumem as its allocator"
    GPUMEM_TORCH_LIB="$bin/libgpumem_torch.so" "$python" scripts/gpu_torch_check.py

    step "recordings with private pools (graphs, a MemPool, a shared graph pool, an OOM in a graph pool): replayed and explained"
    "$python" scripts/gpu_record_pools.py "$bin/gpumem" "$(mktemp -d)"
    step "a tensor shared with another process (CUDA IPC), recorded by PyTorch's own allocator"
    "$python" scripts/gpu_record_ipc.py "$bin/gpumem" "$(mktemp -d)"

    step "a placement plan: recorded under PyTorch's allocator, planned, followed by gpumem's"
    GPUMEM_TORCH_LIB="$bin/libgpumem_torch.so" "$python" scripts/gpu_plan_check.py \
        "$bin/gpumem" "$(mktemp -d)"

    step "PyTorch pushing to the agent"
    socket="$(mktemp -d)/push.sock"
    "$bin/gpumem" serve --listen 127.0.0.1:19419 --interval 0.5 --push-socket "$socket" \
        --pod-resources-socket "" 2>/dev/null &
    pushed=$!
    trap 'kill $agent $pushed 2>/dev/null || true' EXIT
    sleep 1
    "$python" scripts/gpu_push_check.py "$socket" 19419
    kill $pushed

    step "the push hook's cost: a training step with the hook off, on and with history; its snapshots; an OOM's recording reaching the agent"
    "$python" scripts/gpu_push_cost.py "$bin/gpumem" "$(mktemp -d)"

    step "an unmodified job, the hook switched on by GPUMEM_PUSH=1, dies of an OOM"
    socket="$(mktemp -d)/push.sock"
    GPUMEM_PUSH=1 GPUMEM_PUSH_SOCKET="$socket" GPUMEM_PUSH_INTERVAL=0.5 \
        GPUMEM_PUSH_LABELS=job=gpu-check-oom "$python" scripts/gpu_oom_job.py \
        >"$socket.job.log" 2>&1 &
    job=$!
    # The agent starts after the job, as after a node reboot.
    sleep 1.5
    "$bin/gpumem" serve --listen 127.0.0.1:19421 --interval 0.5 --push-socket "$socket" \
        --pod-resources-socket "" 2>/dev/null &
    oom_agent=$!
    trap 'kill $agent $pushed $oom_agent $job 2>/dev/null || true' EXIT
    if wait $job; then
        echo "the job did not die of its OOM" >&2; cat "$socket.job.log" >&2; exit 1
    fi
    grep -q OutOfMemoryError "$socket.job.log" || { cat "$socket.job.log" >&2; exit 1; }
    sleep 1
    scrape=$(curl -s 127.0.0.1:19421/metrics)
    echo "$scrape" | grep -E "^gpumem_allocator_(ooms_total|last_oom_timestamp_seconds|reserved_bytes)\{.*pid=\"$job\"" \
        | grep 'exported_job="gpu-check-oom"'
    echo "$scrape" | grep -E "^gpumem_allocator_ooms_total\{.*pid=\"$job\".* 1$" >/dev/null \
        || { echo "the dead job's OOM is not served" >&2; exit 1; }
    echo "$scrape" | grep -E "^gpumem_process_used_bytes" || true
    kill $oom_agent
else
    step "PyTorch with gpumem as its allocator: skipped (no PyTorch with CUDA)"
fi
echo "GPU checks passed"
