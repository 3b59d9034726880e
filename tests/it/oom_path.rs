//! The path a real user walks: a job on a GPU node, with the push hook pip-installed and
//! switched on by environment variables only, runs out of memory and dies; the agent and a
//! real Prometheus with the shipped alert rules still show who, where and that it happened.
//!
//! The job is a real Python process in a fresh virtual environment (`pip install` of
//! `python/gpumem_push`, as a user would), with the stand-in torch of `python/tests`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use gpumem::allocator::breakdown::Breakdown;

use crate::browser::Browser;
use crate::view::raw_get;

use crate::agent::{
    Reaper, free_port, http_get, prometheus_query, spawn_prometheus_with_rules, spawn_serve,
    wait_for,
};

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh virtual environment with both packages pip-installed, made once per test run.
fn python_env() -> &'static Path {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        let venv = manifest().join("target/it-venv");
        let _ = std::fs::remove_dir_all(&venv);
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 runs");
        assert!(made.success(), "python3 -m venv");
        let python = venv.join("bin/python");
        let out = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg(manifest().join("python/gpumem_push"))
            .arg(manifest().join("python/gpumem_torch"))
            .env_remove("PYTHONPATH")
            .output()
            .expect("pip runs");
        assert!(
            out.status.success(),
            "pip install: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        venv
    })
}

/// A job in the virtual environment: `script` under the stand-in torch, with `env`.
fn spawn_job(script: &str, env: &[(&str, String)], log: &Path) -> Reaper {
    let mut command = Command::new(python_env().join("bin/python"));
    command
        .args(["-c", script])
        .current_dir(std::env::temp_dir())
        // Only the stand-in torch comes from a path; gpumem_push comes from the venv.
        .env("PYTHONPATH", manifest().join("python/tests/fake_torch"))
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log"));
    for (k, v) in env {
        command.env(k, v);
    }
    Reaper(command.spawn().expect("the job starts"))
}

/// `gpumem serve` with its push socket at `dir/push.sock` and its log at `dir/push.log`.
fn serve(port: u16, dir: &Path) -> Reaper {
    let off: [&std::ffi::OsStr; 2] = ["--pod-resources-socket".as_ref(), "".as_ref()];
    spawn_serve(port, &dir.join("push.log"), None, &off)
}

fn series_of<'a>(text: &'a str, metric: &str, pid: u32) -> Vec<&'a str> {
    let pid = format!("pid=\"{pid}\"");
    text.lines()
        .filter(|l| l.starts_with(metric) && l.contains(&pid))
        .collect()
}

/// The headline case, end to end: a job started before the agent is picked up; it runs out
/// of memory and dies of it; after it exited, the agent still serves its series and
/// Prometheus shows its OOM and the OOM alert with the job's labels.
#[test]
fn a_job_that_dies_of_an_oom_is_still_seen() {
    let dir = std::env::temp_dir().join(format!("gpumem-oom-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let socket = dir.join("push.sock");
    let go = dir.join("go");
    // The training script knows nothing of gpumem: it allocates, waits, and runs out of
    // memory (the stand-in raises torch.cuda.OutOfMemoryError after PyTorch's observers ran).
    let script = format!(
        r#"
import os, time, torch
torch._fake.allocate(0, 64 << 20)
torch._fake.pin(3 << 20)
deadline = time.time() + 120
while not os.path.exists({go:?}) and time.time() < deadline:
    time.sleep(0.05)
torch._fake.oom(0, 1 << 37)
"#,
        go = go.display().to_string()
    );
    let mut job = spawn_job(
        &script,
        &[
            ("GPUMEM_PUSH", "1".into()),
            ("GPUMEM_PUSH_SOCKET", socket.display().to_string()),
            ("GPUMEM_PUSH_INTERVAL", "0.5".into()),
            ("GPUMEM_PUSH_LABELS", "job=llama,team=nlp".into()),
        ],
        &dir.join("job.log"),
    );
    let pid = job.0.id();
    // The agent comes up after the job (a node reboot, an agent rollout).
    std::thread::sleep(Duration::from_millis(1500));
    let port = free_port();
    let _agent = serve(port, &dir);
    let seen = wait_for(Duration::from_secs(20), || {
        let text = http_get(port, "/metrics")?;
        (!series_of(&text, "gpumem_allocator_reserved_bytes{", pid).is_empty()).then_some(text)
    });
    let text = seen.unwrap_or_else(|| {
        panic!(
            "the job's series never appeared; job: {}",
            std::fs::read_to_string(dir.join("job.log")).unwrap_or_default()
        )
    });
    let reserved = series_of(&text, "gpumem_allocator_reserved_bytes{", pid);
    assert!(
        reserved
            .iter()
            .any(|l| l.contains(r#"exported_job="llama""#) && l.contains(r#"team="nlp""#)),
        "labels from GPUMEM_PUSH_LABELS, job exported beside the target's: {reserved:?}"
    );
    let rules = manifest().join("alerts/gpumem.rules.yml");
    let (_prometheus, prom_port) = spawn_prometheus_with_rules(&dir, port, Some(&rules));
    assert!(
        wait_for(Duration::from_secs(60), || {
            let r = prometheus_query(
                prom_port,
                &format!("gpumem_allocator_ooms_total{{pid=\"{pid}\"}}"),
            )?;
            (r.as_array()?.len() == 1).then_some(())
        })
        .is_some(),
        "Prometheus scrapes the job's series"
    );
    // Its pinned host memory (3 MiB pinned: one 4 MiB block), read back from Prometheus, and
    // the dashboards' pinned-memory panels have it.
    let pinned = prometheus_query(
        prom_port,
        &format!("gpumem_host_pinned_allocated_bytes{{pid=\"{pid}\"}}"),
    )
    .expect("query");
    assert_eq!(pinned[0]["value"][1], (4u32 << 20).to_string(), "{pinned}");
    assert_eq!(pinned[0]["metric"]["team"], "nlp", "{pinned}");
    let pid_label = pid.to_string();
    for (file, title, query) in crate::assets::dashboard_queries_of("gpumem_host_pinned_") {
        let rows = wait_for(Duration::from_secs(30), || {
            let r = prometheus_query(prom_port, &query)?;
            r.as_array()?
                .iter()
                .any(|row| row["metric"]["pid"] == pid_label.as_str())
                .then_some(())
        });
        assert!(
            rows.is_some(),
            "{file}: {title}: no pinned memory from {query}"
        );
    }

    // The job runs out of memory and dies of it.
    std::fs::write(&go, b"").expect("go");
    let status = wait_for(Duration::from_secs(30), || job.0.try_wait().ok().flatten())
        .expect("the job dies");
    let log = std::fs::read_to_string(dir.join("job.log")).unwrap_or_default();
    assert!(!status.success(), "{log}");
    assert!(log.contains("OutOfMemoryError"), "{log}");

    // After its exit, the agent still serves its last word.
    let text = http_get(port, "/metrics").expect("scrape");
    let ooms = series_of(&text, "gpumem_allocator_ooms_total{", pid);
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert!(ooms[0].ends_with(" 1"), "{ooms:?}");
    assert_eq!(
        series_of(&text, "gpumem_allocator_last_oom_timestamp_seconds{", pid).len(),
        1
    );
    // Its explanation: where the device's 80 GiB were, in parts that add up; 128 GiB asked.
    let parts = series_of(&text, "gpumem_oom_breakdown_bytes{", pid);
    let value = |kind: &str| -> f64 {
        parts
            .iter()
            .find(|l| l.contains(&format!("kind=\"{kind}\"")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {kind} part: {parts:?}"))
    };
    assert_eq!(parts.len(), Breakdown::PARTS, "{parts:?}");
    assert_eq!(value("allocated"), f64::from(64u32 << 20));
    assert_eq!(value("free"), (80u64 << 30) as f64 - f64::from(64u32 << 20));
    let sum: f64 = parts
        .iter()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(sum, (80u64 << 30) as f64, "{parts:?}");
    // Prometheus, scraping after the exit, has the OOM at 1 and the alert with the job's
    // labels: one per job, never naming its pid (a host process outside any pod and
    // without a run id is known by its node's target).
    let alert = wait_for(Duration::from_secs(60), || {
        let r = prometheus_query(
            prom_port,
            "ALERTS{alertname=\"GpumemOutOfMemory\",exported_job=\"llama\"}",
        )?;
        let first = r.as_array()?.first()?.clone();
        Some(first)
    })
    .unwrap_or_else(|| {
        panic!(
            "no OOM alert; agent log: {}",
            std::fs::read_to_string(dir.join("push.log")).unwrap_or_default()
        )
    });
    let labels = &alert["metric"];
    assert!(
        matches!(labels["alertstate"].as_str(), Some("pending" | "firing")),
        "{alert}"
    );
    assert_eq!(labels["exported_job"], "llama", "{alert}");
    assert_eq!(labels["team"], "nlp", "{alert}");
    assert_eq!(labels["severity"], "warning", "{alert}");
    assert_eq!(labels["job_key"], format!("127.0.0.1:{port}"), "{alert}");
    assert!(labels.get("pid").is_none(), "{alert}");
    let value = prometheus_query(
        prom_port,
        &format!("gpumem_allocator_ooms_total{{pid=\"{pid}\"}}"),
    )
    .expect("query");
    assert_eq!(value[0]["value"][1], "1", "{value}");
    // The dashboards' OOM panels have the job's breakdown, and the alert's description
    // lists it.
    for (file, title, query) in crate::assets::dashboard_queries_of("gpumem_oom_breakdown_bytes") {
        let rows = wait_for(Duration::from_secs(30), || {
            let r = prometheus_query(prom_port, &query)?;
            (r.as_array()?.len() == Breakdown::PARTS).then_some(r)
        });
        assert!(rows.is_some(), "{file}: {title}: no breakdown from {query}");
    }
    let description = wait_for(Duration::from_secs(30), || {
        let r = http_get(prom_port, "/api/v1/alerts")?;
        let v: serde_json::Value = serde_json::from_str(&r).ok()?;
        v["data"]["alerts"]
            .as_array()?
            .iter()
            .find(|a| a["labels"]["alertname"] == "GpumemOutOfMemory")
            .and_then(|a| a["annotations"]["description"].as_str().map(str::to_string))
            .filter(|d| d.contains("Where the device's memory was"))
    })
    .expect("the alert's description lists the breakdown");
    assert!(description.contains("allocated 64MiB"), "{description}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// torchrun on a four-GPU node (stand-in), two ranks each on its own device: exactly two
/// (pid, gpu) allocator series sets, each with its rank identity; no phantom devices.
#[test]
fn torchrun_ranks_export_only_the_devices_they_use() {
    let dir = std::env::temp_dir().join(format!("gpumem-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let socket = dir.join("push.sock");
    let port = free_port();
    let _agent = serve(port, &dir);
    let script = r#"
import os, time, torch
torch._fake.allocate(int(os.environ["LOCAL_RANK"]), 32 << 20)
time.sleep(60)
"#;
    let jobs: Vec<Reaper> = (0..2)
        .map(|rank| {
            spawn_job(
                script,
                &[
                    ("GPUMEM_PUSH", "1".into()),
                    ("GPUMEM_PUSH_SOCKET", socket.display().to_string()),
                    ("GPUMEM_PUSH_INTERVAL", "0.5".into()),
                    ("FAKE_TORCH_DEVICES", "4".into()),
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("TORCHELASTIC_RUN_ID", "run-7".into()),
                ],
                &dir.join(format!("rank{rank}.log")),
            )
        })
        .collect();
    let pids: Vec<u32> = jobs.iter().map(|j| j.0.id()).collect();
    let text = wait_for(Duration::from_secs(30), || {
        let text = http_get(port, "/metrics")?;
        pids.iter()
            .all(|&pid| !series_of(&text, "gpumem_allocator_reserved_bytes{", pid).is_empty())
            .then_some(text)
    })
    .expect("both ranks pushed");
    // One (pid, gpu) set per rank: the large pool's reserved bytes, one series each.
    let sets: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.starts_with("gpumem_allocator_reserved_bytes{")
                && l.contains(r#"allocator="pytorch""#)
                && l.contains(r#"pool="large""#)
        })
        .collect();
    assert_eq!(sets.len(), 2, "{sets:?}");
    for (rank, &pid) in pids.iter().enumerate() {
        let mine = series_of(&text, "gpumem_allocator_reserved_bytes{", pid);
        assert!(
            mine.iter().all(|l| {
                l.contains(&format!("rank=\"{rank}\""))
                    && l.contains(&format!("local_rank=\"{rank}\""))
                    && l.contains(r#"world_size="2""#)
                    && l.contains(r#"run_id="run-7""#)
                    && l.contains(&format!("gpu=\"{rank}\""))
            }),
            "rank {rank}: {mine:?}"
        );
    }
    drop(jobs);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 37, end to end: a pip-installed job with `GPUMEM_PUSH_HISTORY` dies of an OOM; the
/// agent keeps the recording its hook uploaded (history from CUDA's first allocation to the
/// OOM), lists it as the job's, and `gpumem explain` of the kept file explains that OOM.
#[test]
fn a_job_that_dies_of_an_oom_leaves_its_recording() {
    let dir = std::env::temp_dir().join(format!("gpumem-oom-rec-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let store = dir.join("store");
    let port = free_port();
    let extra: [&std::ffi::OsStr; 4] = [
        "--pod-resources-socket".as_ref(),
        "".as_ref(),
        "--recordings-dir".as_ref(),
        store.as_os_str(),
    ];
    let _agent = spawn_serve(port, &dir.join("push.log"), None, &extra);
    // The hook queues the history's start as soon as it sees torch; the script lets it, so
    // that the history begins with CUDA (a real job's first allocation comes later anyway).
    let script = r#"
import time, torch
deadline = time.time() + 20
while not torch._fake.queued and time.time() < deadline:
    time.sleep(0.02)
torch._fake.allocate(0, 64 << 20)
torch._fake.allocate(0, 12 << 20)  # segments PyTorch would make too: the replay is exact
while not torch._C._oom_observers and time.time() < deadline:
    time.sleep(0.02)
torch._fake.oom(0, 1 << 37)
"#;
    let mut job = spawn_job(
        script,
        &[
            ("GPUMEM_PUSH", "1".into()),
            (
                "GPUMEM_PUSH_SOCKET",
                dir.join("push.sock").display().to_string(),
            ),
            ("GPUMEM_PUSH_HISTORY", "1000".into()),
        ],
        &dir.join("job.log"),
    );
    let pid = job.0.id();
    let status = job.0.wait().expect("the job ends");
    assert!(!status.success(), "the job dies of its OOM");
    let listed = wait_for(Duration::from_secs(10), || {
        let list: serde_json::Value =
            serde_json::from_str(&http_get(port, "/api/v1/recordings")?).ok()?;
        (list.as_array()?.len() == 1).then_some(list)
    })
    .unwrap_or_else(|| {
        panic!(
            "no recording kept; job: {}; agent: {}",
            std::fs::read_to_string(dir.join("job.log")).unwrap_or_default(),
            std::fs::read_to_string(dir.join("push.log")).unwrap_or_default()
        )
    });
    let kept = &listed[0];
    assert_eq!(kept["pid"], pid, "{kept}");
    assert_eq!(kept["device"], 0, "{kept}");
    let oom_event = kept["oom_event"].as_u64().expect("the OOM was recorded");
    let file = store.join(format!("{}.pickle.gz", kept["id"].as_str().expect("id")));
    let explained = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .arg("explain")
        .arg(&file)
        .arg("--json")
        .output()
        .expect("explain runs");
    assert!(
        explained.status.success(),
        "{}",
        String::from_utf8_lossy(&explained.stderr)
    );
    let explanation: serde_json::Value = serde_json::from_slice(&explained.stdout).expect("JSON");
    assert_eq!(explanation["request"]["event"], oom_event, "{explanation}");
    assert_eq!(
        explanation["request"]["bytes"],
        1_u64 << 37,
        "{explanation}"
    );
    assert_eq!(explanation["device"], 0, "{explanation}");

    // The agent opens it: the live page links the process's last OOM to it, the alert's
    // address (by pid) leads there, and the view shows the explanation `gpumem explain`
    // gave, from the same JSON.
    let id = kept["id"].as_str().expect("id");
    let (status, head, _) =
        raw_get(port, &format!("/recordings/pid/{pid}"), "127.0.0.1", None).expect("answers");
    assert_eq!(status, 303, "{head}");
    let at = format!("{id}/#device=0&event={oom_event}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("location: ../{at}")),
        "{head}"
    );
    let served: serde_json::Value = serde_json::from_str(
        &http_get(
            port,
            &format!("/recordings/{id}/api/v1/explain?device=0&event={oom_event}"),
        )
        .expect("the agent explains the kept recording"),
    )
    .expect("JSON");
    assert_eq!(
        served, explanation,
        "the agent's view explains as `gpumem explain`"
    );
    for (path, status) in [
        ("/recordings/nothing-kept/api/v1/recording".to_string(), 404),
        (format!("/recordings/pid/{}", pid + 1), 404),
        (format!("/recordings/{id}"), 303),
        (
            format!("/recordings/{id}/api/v1/segments?device=0&event=99999999"),
            400,
        ),
    ] {
        let (got, head, body) = raw_get(port, &path, "127.0.0.1", None).expect("answers");
        assert_eq!(got, status, "{path}: {head}\n{body}");
    }
    // Another site's page cannot make the agent replay.
    let (got, _, _) = raw_get(
        port,
        &format!("/recordings/{id}/api/v1/timeline.svg?device=0"),
        "127.0.0.1",
        Some("http://evil.example"),
    )
    .expect("answers");
    assert_eq!(got, 403);

    let browser = Browser::start();
    browser.open(&format!("http://127.0.0.1:{port}/"));
    let link = wait_for(Duration::from_secs(20), || {
        let href = browser.eval(&format!(
            "const a = document.querySelector('tr[data-oom-of=\"{pid}\"] a.recording'); \
             return a ? a.href : null;"
        ));
        href.as_str().map(str::to_string)
    })
    .expect("the live page links the process's OOM to its recording");
    assert_eq!(link, format!("http://127.0.0.1:{port}/recordings/{at}"));
    // Followed as a user would (open waits for the page to load; a click would not).
    browser.open(&link);
    let shown = crate::view::shown_explanation(&browser);
    assert_eq!(shown["url"], link, "{shown}");
    assert_eq!(shown["sentence"], explanation["sentence"], "{shown}");
    assert_eq!(
        shown["event"],
        oom_event.to_string(),
        "opened at the OOM: {shown}"
    );
    assert_eq!(shown["parts"], 8, "{shown}");
    assert_eq!(shown["shown_error"], "", "{shown}");
    assert!(
        shown["blocks"].as_u64().is_some_and(|n| n >= 2),
        "the map: {shown}"
    );
    assert_eq!(browser.console_errors(), Vec::<String>::new());
    browser.screenshot("agent-recording.png");
    let _ = std::fs::remove_dir_all(&dir);
}
