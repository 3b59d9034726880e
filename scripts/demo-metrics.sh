#!/bin/bash
# demo-metrics.sh GPUMEM [PORT]: the demo's /metrics as a still picture (--speed 0: each
# simulated process held where its recording reserved the most; the simulated pids are
# fixed), with the values that follow the clock masked, so that two builds' outputs can be
# compared with diff. Prints the exposition on stdout.
set -euo pipefail
bin=$1
port=${2:-19477}
"$bin" demo --speed 0 --listen "127.0.0.1:$port" >/dev/null 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do
    curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break
    sleep 0.2
done
# The pushed job's OOM push comes within its first seconds.
sleep 6
curl -sf "http://127.0.0.1:$port/metrics" | sed -E \
    -e 's/^((gpumem_allocator_last_oom_timestamp_seconds|gpumem_allocator_cache_age_seconds|gpumem_collect_duration_seconds|gpumem_ingest_last_push_age_seconds|gpumem_ingest_payloads_total\{result="accepted"\})(\{[^}]*\})?) .*/\1 X/'
