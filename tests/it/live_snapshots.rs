//! A pushing job that never runs out of memory, on the Python tests' stand-in torch
//! (`python/tests/fake_torch`, which records each `memory_snapshot` call), through
//! `gpumem serve`: within two pushes of its allocations, the agent exports its largest free
//! block and segments by size, with their age; no snapshot copied the allocation history;
//! an older PyTorch's `memory_snapshot`, which takes no `include_traces`, works too.

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

/// Runs `job` under `snapshot_kind` ("new": 2.11+'s signature; "old": without
/// `include_traces`) against a fresh agent; returns the job's report, the agent's
/// exposition read right after it, and the job's pid.
fn pushed_with(snapshot_kind: &str, job: &str) -> (serde_json::Value, String, u32) {
    let dir = std::env::temp_dir().join(format!(
        "gpumem-live-{snapshot_kind}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let port = free_port();
    let _agent = spawn_serve(port, &dir.join("serve.log"), None, &[]);
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let path = std::env::join_paths([
        python.join("tests/fake_torch"),
        python.join("gpumem_push/src"),
    ])
    .expect("paths");
    let mut child = Command::new("python3")
        .args(["-c", job])
        .arg(format!("unix:{}", dir.join("serve.sock").display()))
        .env("PYTHONPATH", path)
        .env("FAKE_TORCH_SNAPSHOT", snapshot_kind)
        .env_remove("GPUMEM_PUSH")
        .env_remove("GPUMEM_PUSH_HISTORY")
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
    let (report, exposition, pid) = pushed_with("new", JOB);
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
    let (report, exposition, pid) = pushed_with("old", &job);
    assert_live(&exposition, pid);
    assert_eq!(report["stats"]["snapshots"]["off"], serde_json::Value::Null);
    assert_eq!(report["stats"]["errors"], 0, "{report}");
}
