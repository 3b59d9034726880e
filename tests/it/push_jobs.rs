//! Pushing jobs on the Python tests' stand-ins (`python/tests/fake_torch`, which records each
//! `memory_snapshot` call, and `fake_jax`, with PJRT's `memory_stats()`), through
//! `gpumem serve`, read on its `/metrics`:
//! - a PyTorch job that never runs out of memory: within two pushes of its allocations, its
//!   largest free block and segments by size, with their age; no snapshot copied the
//!   allocation history; an older PyTorch's `memory_snapshot`, which takes no
//!   `include_traces`, works too;
//! - a JAX job on two GPUs named by `NVIDIA_VISIBLE_DEVICES`: XLA's figures under those
//!   UUIDs, as allocator `xla`, and nothing a caching allocator has that XLA's lacks.

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::agent::{Reaper, free_port, http_get, spawn_serve};

const MIB: u64 = 1 << 20;

/// The job: the hook started first, then a 3 MiB and a 5 MiB tensor (a 4 MiB and a 6 MiB
/// segment, 1 MiB free in each) while it records its allocation history; it reports once
/// two pushes have followed them, and stays alive until the test closes its stdin.
const JOB: &str = r#"
import json, sys, time, torch
import gpumem_push
gpumem_push.start(url=sys.argv[1], interval=0.5)
torch._fake.allocate(0, 3 << 20)
torch._fake.allocate(0, 5 << 20)
torch.cuda.memory._record_memory_history(max_entries=1000)
sent = gpumem_push.stats()["sent"]
deadline = time.monotonic() + 20
while gpumem_push.stats()["sent"] < sent + 2 and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"stats": gpumem_push.stats(), "calls": torch._fake.snapshot_calls}), flush=True)
sys.stdin.read()
"#;

/// The value of the one series of `metric` whose labels include `labels`.
fn value(exposition: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    let mut found = exposition.lines().filter(|l| {
        l.strip_prefix(metric)
            .is_some_and(|rest| rest.starts_with('{'))
            && labels.iter().all(|label| l.contains(label))
    });
    let line = found.next()?;
    assert!(
        found.next().is_none(),
        "{metric} {labels:?}: more than one series"
    );
    line.rsplit_once(' ')?.1.parse().ok()
}

/// Runs `job` (its first argument the agent's push URL; its first stdout line its report)
/// with `env` against a fresh agent; returns the job's report, the agent's exposition read
/// right after it, and the job's pid.
fn pushed_with(env: &[(&str, &str)], job: &str) -> (serde_json::Value, String, u32) {
    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let run = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("gpumem-jobs-{}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let port = free_port();
    let _agent = spawn_serve(port, &dir.join("serve.log"), None, &[]);
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let path = std::env::join_paths([
        python.join("tests/fake_torch"),
        python.join("tests/fake_jax"),
        python.join("gpumem_push/src"),
    ])
    .expect("paths");
    let mut command = Command::new("python3");
    for name in [
        "GPUMEM_PUSH",
        "GPUMEM_PUSH_HISTORY",
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
    ] {
        command.env_remove(name);
    }
    let mut child = command
        .args(["-c", job])
        .arg(format!("unix:{}", dir.join("serve.sock").display()))
        .env("PYTHONPATH", path)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let pid = child.id();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the job reports");
    let job = Reaper(child);
    let exposition = http_get(port, "/metrics").expect("the agent answers");
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
    let report = serde_json::from_str(&line)
        .unwrap_or_else(|_| panic!("the job did not report (stdout: {line:?})"));
    (report, exposition, pid)
}

fn assert_live(exposition: &str, pid: u32) {
    let pid = format!("pid=\"{pid}\"");
    let of = |metric: &str, extra: &[&str]| {
        let labels: Vec<&str> = [pid.as_str(), "allocator=\"pytorch\""]
            .into_iter()
            .chain(extra.iter().copied())
            .collect();
        value(exposition, metric, &labels)
    };
    assert_eq!(
        of("gpumem_allocator_largest_free_block_bytes", &[]),
        Some(MIB as f64),
        "{exposition}"
    );
    for size in [4 * MIB, 8 * MIB] {
        let class = format!("segment_size=\"{size}\"");
        assert_eq!(
            of("gpumem_allocator_segments_by_size", &[&class]),
            Some(1.0)
        );
        assert_eq!(
            of("gpumem_allocator_segment_free_bytes_by_size", &[&class]),
            Some(MIB as f64)
        );
    }
    let age = of("gpumem_allocator_cache_age_seconds", &[]).expect("their age");
    assert!((0.0..30.0).contains(&age), "{age}");
}

#[test]
fn a_job_that_never_runs_out_of_memory_shows_its_free_blocks() {
    let (report, exposition, pid) = pushed_with(&[("FAKE_TORCH_SNAPSHOT", "new")], JOB);
    assert_live(&exposition, pid);
    let calls = report["calls"].as_array().expect("calls");
    assert!(!calls.is_empty(), "{report}");
    assert!(
        calls.iter().all(|c| c == &serde_json::Value::Bool(false)),
        "every snapshot without the history: {report}"
    );
    assert_eq!(report["stats"]["snapshots"]["off"], serde_json::Value::Null);
    assert_eq!(report["stats"]["errors"], 0, "{report}");
}

#[test]
fn an_older_pytorchs_snapshot_gives_them_too() {
    // It records no history here: a snapshot costs what memory_snapshot() does.
    let job = JOB.replace(
        "torch.cuda.memory._record_memory_history(max_entries=1000)\n",
        "",
    );
    assert_ne!(job, JOB);
    let (report, exposition, pid) = pushed_with(&[("FAKE_TORCH_SNAPSHOT", "old")], &job);
    assert_live(&exposition, pid);
    assert_eq!(report["stats"]["snapshots"]["off"], serde_json::Value::Null);
    assert_eq!(report["stats"]["errors"], 0, "{report}");
}

/// A JAX job: two GPUs' figures pushed, reported once two pushes went.
const JAX_JOB: &str = r#"
import json, sys, time, jax
import gpumem_push
gpumem_push.start(url=sys.argv[1], interval=0.5)
jax.devices()
deadline = time.monotonic() + 20
while gpumem_push.stats()["sent"] < 2 and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"stats": gpumem_push.stats(),
                  "figures": [jax.figures(i) for i in range(2)]}), flush=True)
sys.stdin.read()
"#;

#[test]
fn a_jax_jobs_gpus_are_exported_as_xla_reports_them() {
    let uuids = [
        "GPU-11111111-2222-3333-4444-555555555555",
        "GPU-66666666-7777-8888-9999-000000000000",
    ];
    let visible = uuids.join(",");
    let env = [
        ("NVIDIA_VISIBLE_DEVICES", visible.as_str()),
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "true"),
    ];
    let (report, exposition, pid) = pushed_with(&env, JAX_JOB);
    assert_eq!(report["stats"]["errors"], 0, "{report}");
    let pid = format!("pid=\"{pid}\"");
    for (index, uuid) in uuids.iter().enumerate() {
        let figures = &report["figures"][index];
        let figure = |key: &str| figures[key].as_f64().expect(key);
        let at = format!("UUID=\"{uuid}\"");
        let of = |metric: &str, extra: &[&str]| {
            let labels: Vec<&str> = [pid.as_str(), at.as_str(), "allocator=\"xla\""]
                .into_iter()
                .chain(extra.iter().copied())
                .collect();
            value(&exposition, metric, &labels)
        };
        let pool = ["pool=\"all\""];
        for (metric, extra, key) in [
            (
                "gpumem_allocator_allocated_bytes",
                &pool[..],
                "bytes_in_use",
            ),
            ("gpumem_allocator_reserved_bytes", &pool[..], "pool_bytes"),
            (
                "gpumem_allocator_peak_allocated_bytes",
                &[][..],
                "peak_bytes_in_use",
            ),
            (
                "gpumem_allocator_peak_reserved_bytes",
                &[][..],
                "peak_pool_bytes",
            ),
            (
                "gpumem_allocator_largest_free_block_bytes",
                &[][..],
                "largest_free_block_bytes",
            ),
            ("gpumem_allocator_limit_bytes", &[][..], "bytes_limit"),
        ] {
            assert_eq!(of(metric, extra), Some(figure(key)), "{metric} of {uuid}");
        }
        // The hook's OOM count goes on the job's first GPU (XLA's error names none).
        let ooms = (index == 0).then_some(0.0);
        assert_eq!(of("gpumem_allocator_ooms_total", &[]), ooms);
        let info = of(
            "gpumem_allocator_info",
            &[
                "version=\"0.10.2+fake\"",
                "config=\"XLA_PYTHON_CLIENT_PREALLOCATE=true\"",
            ],
        );
        assert_eq!(info, Some(1.0));
    }
    // What XLA's allocator has no figure for is absent, not zero.
    for metric in [
        "gpumem_allocator_segments{",
        "gpumem_allocator_alloc_retries_total{",
        "gpumem_allocator_device_allocs_total{",
        "gpumem_allocator_inactive_split_bytes{",
        "gpumem_allocator_fragmentation_ratio{",
        "gpumem_allocator_segments_by_size{",
    ] {
        assert!(
            !exposition
                .lines()
                .any(|l| l.starts_with(metric) && l.contains("allocator=\"xla\"")),
            "{metric} for xla"
        );
    }
}
