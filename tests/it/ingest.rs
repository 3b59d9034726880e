//! Statistics pushed by PyTorch jobs: `POST /api/v1/push` accepts them from this host only,
//! refuses bad payloads with a reason, stays bounded under a flood, and serves what was pushed
//! under the metric contract, value for value.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::ConnectInfo;
use gpumem::agent::Agent;
use gpumem::demo::workload::TrainingWorkload;
use gpumem::ingest::{IngestConfig, PushStore};
use gpumem::sources::AllocatorSources;
use gpumem::{AllocatorConfig, CachingAllocator, SimDevice};

fn agent(max_processes: usize) -> (axum::Router, Arc<PushStore>) {
    let config = IngestConfig {
        max_processes,
        max_tcp_processes: max_processes,
        // The process caps are under test here; the series budgets in tests/it/hostile.rs
        // and the ingest's unit tests.
        max_series: usize::MAX,
        max_tcp_series: usize::MAX,
        min_interval: std::time::Duration::ZERO,
        ..IngestConfig::default()
    };
    let agent = Agent::node(
        AllocatorSources::default(),
        Vec::new(),
        config,
        Default::default(),
    )
    .expect("registers");
    let store = Arc::clone(agent.ingest().expect("the agent ingests"));
    (agent.router(), store)
}

async fn post(
    router: &axum::Router,
    body: Vec<u8>,
    from: Option<&str>,
) -> (u16, serde_json::Value) {
    let mut request = axum::http::Request::post("/api/v1/push")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body))
        .expect("request");
    if let Some(addr) = from {
        let addr: SocketAddr = addr.parse().expect("address");
        request.extensions_mut().insert(ConnectInfo(addr));
    }
    let (status, _, body) = crate::agent::respond(router, request).await;
    (
        status,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    )
}

async fn scrape(router: &axum::Router) -> String {
    let request = axum::http::Request::get("/metrics")
        .body(axum::body::Body::empty())
        .expect("request");
    let (_, _, body) = crate::agent::respond(router, request).await;
    String::from_utf8_lossy(&body).into_owned()
}

/// Real statistics: gpumem's core running `steps` of a training workload on a simulated GPU,
/// `memory_stats()` after each; the allocator as it ends.
fn training_statistics(
    steps: u32,
) -> (
    CachingAllocator<SimDevice>,
    Vec<std::collections::BTreeMap<String, i64>>,
) {
    let mut alloc = CachingAllocator::new(
        SimDevice::with_capacity(80 << 30),
        AllocatorConfig::default(),
    );
    let workload = TrainingWorkload {
        steps,
        ..TrainingWorkload::default()
    };
    let mut sequence = Vec::new();
    workload
        .run(&mut alloc, |a| sequence.push(a.memory_stats()))
        .expect("runs");
    (alloc, sequence)
}

fn payload(pid: u32, seq: u64, stats: &std::collections::BTreeMap<String, i64>) -> Vec<u8> {
    serde_json::json!({
        "pid": pid, "seq": seq, "torch_version": "2.5.1", "alloc_conf": "expandable_segments:True",
        "devices": [{"index": 1, "uuid": "GPU-11111111-2222-3333-4444-555555555555", "stats": stats}]
    })
    .to_string()
    .into_bytes()
}

const LOCAL: Option<&str> = Some("127.0.0.1:40000");

/// The value of one series in an exposition.
fn value(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A job of PyTorch 2.12+ with `throw_on_cudamalloc_oom` pushes its refusals apart from its
/// OOMs; both reach their own counters.
#[tokio::test]
async fn pushed_oom_rejections_reach_their_counter() {
    let (router, _) = agent(16);
    let stats: std::collections::BTreeMap<String, i64> = [
        ("num_ooms".to_string(), 1),
        ("num_oom_rejections".to_string(), 3),
    ]
    .into();
    let (status, body) = post(&router, payload(4243, 1, &stats), LOCAL).await;
    assert_eq!(status, 202, "{body}");
    let text = scrape(&router).await;
    let labels =
        r#"gpu="1",UUID="GPU-11111111-2222-3333-4444-555555555555",pid="4243",allocator="pytorch""#;
    assert_eq!(
        value(
            &text,
            &format!("gpumem_allocator_oom_rejections_total{{{labels}}}")
        ),
        Some(3.0)
    );
    assert_eq!(
        value(&text, &format!("gpumem_allocator_ooms_total{{{labels}}}")),
        Some(1.0)
    );
}

#[tokio::test]
async fn pushed_statistics_round_trip_exactly() {
    let (router, _) = agent(16);
    // Real statistics: the core running a training workload on a simulated GPU.
    let (alloc, held) = training_statistics(3);
    for (seq, stats) in held.iter().enumerate() {
        let (status, body) = post(&router, payload(4242, seq as u64 + 1, stats), LOCAL).await;
        assert_eq!(status, 202, "{body}");
        let text = scrape(&router).await;
        let labels = r#"gpu="1",UUID="GPU-11111111-2222-3333-4444-555555555555",pid="4242",allocator="pytorch""#;
        for (metric, key) in [
            (
                "gpumem_allocator_allocated_bytes",
                "allocated_bytes.large_pool.current",
            ),
            (
                "gpumem_allocator_reserved_bytes",
                "reserved_bytes.large_pool.current",
            ),
            (
                "gpumem_allocator_active_bytes",
                "active_bytes.large_pool.current",
            ),
            (
                "gpumem_allocator_inactive_split_bytes",
                "inactive_split_bytes.large_pool.current",
            ),
            (
                "gpumem_allocator_requested_bytes",
                "requested_bytes.large_pool.current",
            ),
            ("gpumem_allocator_segments", "segment.large_pool.current"),
        ] {
            let series = format!("{metric}{{{labels},pool=\"large\"}}");
            assert_eq!(value(&text, &series), Some(stats[key] as f64), "{series}");
        }
        for (metric, key) in [
            (
                "gpumem_allocator_peak_allocated_bytes",
                "allocated_bytes.all.peak",
            ),
            (
                "gpumem_allocator_peak_reserved_bytes",
                "reserved_bytes.all.peak",
            ),
            ("gpumem_allocator_device_allocs_total", "num_device_alloc"),
            ("gpumem_allocator_alloc_retries_total", "num_alloc_retries"),
        ] {
            let series = format!("{metric}{{{labels}}}");
            assert_eq!(value(&text, &series), Some(stats[key] as f64), "{series}");
        }
        assert!(text.contains(r#"config="expandable_segments:True""#));
    }
    let text = scrape(&router).await;
    assert_eq!(value(&text, "gpumem_ingest_tracked_processes"), Some(1.0));
    assert_eq!(
        value(&text, r#"gpumem_ingest_payloads_total{result="accepted"}"#),
        Some(held.len() as f64)
    );
    // memory_stats() does not give the largest free block: no series, not a false 0 ...
    let largest = r#"gpumem_allocator_largest_free_block_bytes{gpu="1",UUID="GPU-11111111-2222-3333-4444-555555555555",pid="4242",allocator="pytorch"}"#;
    assert_eq!(value(&text, largest), None);
    // ... until a push carries it (the hook's out-of-memory push, from a snapshot); later
    // pushes without one keep it.
    let with_snapshot = serde_json::json!({
        "pid": 4242, "seq": held.len() + 1,
        "devices": [{"index": 1, "uuid": "GPU-11111111-2222-3333-4444-555555555555",
                     "stats": held.last().expect("stats"),
                     "largest_free_block": alloc.largest_free_block()}]
    });
    let (status, body) = post(&router, with_snapshot.to_string().into_bytes(), LOCAL).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(
        value(&scrape(&router).await, largest),
        Some(alloc.largest_free_block() as f64)
    );
    let (status, body) = post(
        &router,
        payload(4242, held.len() as u64 + 2, held.last().expect("stats")),
        LOCAL,
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(
        value(&scrape(&router).await, largest),
        Some(alloc.largest_free_block() as f64)
    );
}

#[tokio::test]
async fn bad_pushes_get_a_reason_and_change_nothing() {
    let (router, store) = agent(16);
    let stats: std::collections::BTreeMap<String, i64> =
        [("allocated_bytes.all.current".to_string(), 5)].into();
    assert_eq!(
        post(&router, payload(1, 1, &stats), None).await.0,
        403,
        "no peer"
    );
    assert_eq!(
        post(&router, payload(1, 1, &stats), Some("10.1.2.3:5000"))
            .await
            .0,
        403
    );
    for (body, status, reason) in [
        (b"{]".to_vec(), 400, "malformed"),
        (br#"{"pid": 1, "seq": "one", "devices": []}"#.to_vec(), 400, "malformed"),
        (
            serde_json::json!({"pid": 1, "seq": 1, "devices": [{"index": 0, "uuid": "GPU-x", "stats": {"reserved_bytes.all.current": -1}}]})
                .to_string()
                .into_bytes(),
            422,
            "invalid",
        ),
        (vec![b'x'; 10 << 20], 413, "too_large"),
    ] {
        let (got, body) = post(&router, body, LOCAL).await;
        assert_eq!(got, status, "{body}");
        assert_eq!(body["reason"], reason, "{body}");
        assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()), "{body}");
    }
    assert_eq!(store.tracked_processes(), 0);
    // A dual-stack listener sees IPv4 loopback as an IPv4-mapped address: still this host.
    assert_eq!(
        post(
            &router,
            payload(2, 1, &stats),
            Some("[::ffff:127.0.0.1]:5000")
        )
        .await
        .0,
        202
    );
    assert_eq!(
        post(
            &router,
            payload(3, 1, &stats),
            Some("[::ffff:10.1.2.3]:5000")
        )
        .await
        .0,
        403
    );
    // Two entries for one device would duplicate series: refused.
    let twice = serde_json::json!({"pid": 5, "seq": 1, "devices": [
        {"index": 0, "uuid": "u", "stats": {}}, {"index": 0, "uuid": "u", "stats": {}}]});
    let (got, body) = post(&router, twice.to_string().into_bytes(), LOCAL).await;
    assert_eq!(
        (got, body["reason"].as_str()),
        (422, Some("invalid")),
        "{body}"
    );
    assert_eq!(post(&router, payload(1, 2, &stats), LOCAL).await.0, 202);
    assert_eq!(
        post(&router, payload(1, 2, &stats), LOCAL).await.0,
        409,
        "stale"
    );
    let text = scrape(&router).await;
    assert_eq!(
        value(&text, r#"gpumem_ingest_payloads_total{result="malformed"}"#),
        Some(2.0)
    );
    assert_eq!(
        value(&text, r#"gpumem_ingest_payloads_total{result="too_large"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(&text, r#"gpumem_ingest_payloads_total{result="stale"}"#),
        Some(1.0)
    );
}

/// 10 000 fake pids, 32 at a time, against a cap of 1 000: the agent keeps 1 000, refuses the
/// rest with a reason, and a tracked process's pushes keep being accepted meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_processes_stays_bounded() {
    let (router, store) = agent(1000);
    let stats: std::collections::BTreeMap<String, i64> =
        [("allocated_bytes.large_pool.current".to_string(), 7)].into();
    assert_eq!(post(&router, payload(1, 1, &stats), LOCAL).await.0, 202);
    let mut refused = 0;
    let mut seq = 1;
    for chunk in (2..10_002u32).collect::<Vec<_>>().chunks(32) {
        let tasks: Vec<_> = chunk
            .iter()
            .map(|&pid| {
                let router = router.clone();
                let body = payload(pid, 1, &stats);
                tokio::spawn(async move { post(&router, body, LOCAL).await.0 })
            })
            .collect();
        for t in tasks {
            if t.await.expect("task") == 429 {
                refused += 1;
            }
        }
        seq += 1;
        assert_eq!(
            post(&router, payload(1, seq, &stats), LOCAL).await.0,
            202,
            "valid push kept"
        );
    }
    assert_eq!(store.tracked_processes(), 1000);
    assert_eq!(refused, 10_000 - 999);
    let counts: std::collections::BTreeMap<_, _> = store.counts().into_iter().collect();
    assert_eq!(counts["capacity"], 10_000 - 999);
}

/// The whole path: a real Python process runs `gpumem_push` (with a stand-in `torch` whose
/// `memory_stats()` replays statistics gpumem's core produced during a training workload),
/// pushing over `gpumem serve`'s Unix socket, scraped by a real Prometheus: the pushed series
/// carry the process's labels, its pid as the kernel names it, and the last values exactly.
#[test]
fn python_pushes_through_serve_to_prometheus() {
    use crate::agent::{Reaper, free_port, prometheus_query, spawn_serve, wait_for};
    use std::process::{Command, Stdio};
    use std::time::Duration;

    let dir = std::env::temp_dir().join(format!("gpumem-push-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (mut alloc, sequence) = training_statistics(4);
    let last = sequence.last().cloned().expect("steps");
    let stats_file = dir.join("stats.json");
    std::fs::write(&stats_file, serde_json::to_vec(&sequence).expect("json")).expect("write");
    // What torch.cuda.memory_snapshot() returns at the out-of-memory error: gpumem's own
    // snapshot, in PyTorch's format; the hook must push its largest free block and its
    // segments by size.
    let segments = alloc.snapshot().segments;
    let largest_free = segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == gpumem::allocator::BlockState::Inactive)
        .map(|b| b.size)
        .max()
        .expect("the workload leaves free blocks cached");
    let snapshot_file = dir.join("snapshot.json");
    std::fs::write(&snapshot_file, serde_json::to_vec(&segments).expect("json")).expect("write");

    let agent_port = free_port();
    let _agent = spawn_serve(agent_port, &dir.join("serve.log"), None, &[]);
    let script = r#"
import json, sys, time, types
sequence = json.load(open(sys.argv[1]))
calls = {"n": 0}
def memory_stats(index):
    i = min(calls["n"], len(sequence) - 1)
    calls["n"] += 1
    return sequence[i]
class Props:
    uuid = "11111111-2222-3333-4444-555555555555"
torch = types.ModuleType("torch")
torch.__version__ = "2.5.1"
snapshot = json.load(open(sys.argv[4]))
observers = []
torch.cuda = types.SimpleNamespace(
    is_initialized=lambda: True, device_count=lambda: 1,
    memory_stats=memory_stats, get_device_properties=lambda i: Props,
    memory_snapshot=lambda: snapshot)
torch._C = types.SimpleNamespace(_cuda_attach_out_of_memory_observer=observers.append)
sys.modules["torch"] = torch
sys.path.insert(0, sys.argv[3])
import gpumem_push, os
# Inside a container a job's own pid is its namespace's; the agent must not trust it.
os.getpid = lambda: 7
gpumem_push.start(url=sys.argv[2], interval=0.6, labels={"job": "llama", "rank": "3"})
deadline = time.time() + 30
while calls["n"] < len(sequence) + 2 and time.time() < deadline:
    time.sleep(0.1)
time.sleep(0.7)
# An out-of-memory error: pushed at once, with the snapshot's largest free block.
sent = gpumem_push.stats()["sent"]
observers[0](0, 1 << 40, 0, 0)
deadline = time.time() + 10
while gpumem_push.stats()["sent"] == sent and time.time() < deadline:
    time.sleep(0.05)
s = gpumem_push.stats()
print(json.dumps(s), flush=True)
# Stay alive (the agent ends a socket-attributed process's series when it exits) until the
# test closes stdin.
sys.stdin.read()
"#;
    let socket = dir.join("serve.sock");
    let mut child = Command::new("python3")
        .args(["-c", script])
        .arg(&stats_file)
        .arg(format!("unix:{}", socket.display()))
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/gpumem_push/src"))
        .arg(&snapshot_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let python_pid = child.id();
    let mut pushed = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
        &mut pushed,
    )
    .expect("python3 reports");
    let mut python = Reaper(child);
    let report: serde_json::Value = serde_json::from_str(&pushed).unwrap_or_else(|_| {
        let _ = python.0.kill();
        let mut err = String::new();
        let _ =
            std::io::Read::read_to_string(&mut python.0.stderr.take().expect("stderr"), &mut err);
        panic!("python3 did not report its pushes: {pushed}{err}")
    });
    assert!(
        report["sent"]
            .as_u64()
            .is_some_and(|n| n > sequence.len() as u64),
        "the periodic pushes and the out-of-memory one: {report}"
    );

    let (_prometheus, prom_port) = crate::agent::spawn_prometheus(&dir, agent_port);
    let query = r#"gpumem_allocator_allocated_bytes{allocator="pytorch",pool="large"}"#;
    let result = wait_for(Duration::from_secs(60), || {
        let r = prometheus_query(prom_port, query)?;
        r.as_array().is_some_and(|a| !a.is_empty()).then_some(r)
    })
    .expect("Prometheus has the pushed series");
    let series = &result[0];
    assert_eq!(series["metric"]["exported_job"], "llama", "{series}");
    assert_eq!(series["metric"]["rank"], "3", "{series}");
    assert_eq!(
        series["metric"]["pid"],
        python_pid.to_string(),
        "the socket's peer, not the payload's pid 7: {series}"
    );
    let age = prometheus_query(
        prom_port,
        &format!("gpumem_ingest_last_push_age_seconds{{pid=\"{python_pid}\"}}"),
    )
    .expect("query");
    let age: f64 = age[0]["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .expect("the pushing process has a last-push age");
    assert!((0.0..60.0).contains(&age), "{age}");
    assert_eq!(
        series["metric"]["UUID"],
        "GPU-11111111-2222-3333-4444-555555555555"
    );
    let value: f64 = series["value"][1]
        .as_str()
        .expect("value")
        .parse()
        .expect("number");
    assert_eq!(value, last["allocated_bytes.large_pool.current"] as f64);
    let largest = prometheus_query(
        prom_port,
        r#"gpumem_allocator_largest_free_block_bytes{allocator="pytorch"}"#,
    )
    .expect("query");
    assert_eq!(
        largest[0]["value"][1].as_str(),
        Some(largest_free.to_string().as_str()),
        "the out-of-memory push's largest free block: {largest} (the hook's counters: {report})"
    );
    // The hook's segments by size, counted from PyTorch's snapshot format in Python, equal
    // what gpumem's core counts from its own blocks.
    let by_size = |metric: &str| -> Vec<(u64, u64)> {
        let result = prometheus_query(prom_port, &format!(r#"{metric}{{allocator="pytorch"}}"#))
            .expect("query");
        let mut pairs: Vec<(u64, u64)> = result
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| {
                let size = r["metric"]["segment_size"].as_str()?.parse().ok()?;
                let value = r["value"][1].as_str()?.parse().ok()?;
                Some((size, value))
            })
            .collect();
        pairs.sort_unstable();
        pairs
    };
    let classes = alloc.segments_by_size();
    assert!(!classes.is_empty());
    assert_eq!(
        by_size("gpumem_allocator_segments_by_size"),
        classes
            .iter()
            .map(|c| (c.size, c.segments))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        by_size("gpumem_allocator_segment_free_bytes_by_size"),
        classes
            .iter()
            .map(|c| (c.size, c.free_bytes))
            .collect::<Vec<_>>()
    );
    let retries = prometheus_query(
        prom_port,
        r#"gpumem_allocator_peak_reserved_bytes{allocator="pytorch"}"#,
    )
    .expect("query");
    let peak: f64 = retries[0]["value"][1]
        .as_str()
        .expect("value")
        .parse()
        .expect("number");
    assert_eq!(peak, last["reserved_bytes.all.peak"] as f64);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The push socket replaces a stale socket from an earlier run but never another file, and
/// anyone on the node may connect to it.
#[tokio::test]
async fn the_push_socket_replaces_only_stale_sockets() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("gpumem-sock-{}", std::process::id()));
    let path = dir.join("run").join("push.sock");
    let first = gpumem::server::bind_unix(&path, std::time::Duration::ZERO)
        .await
        .expect("binds, creating its directory");
    let mode = std::fs::metadata(&path)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o666);
    drop(first);
    assert!(path.exists(), "a dropped listener leaves its socket file");
    let _second = gpumem::server::bind_unix(&path, std::time::Duration::ZERO)
        .await
        .expect("replaces the stale socket");
    let file = dir.join("run").join("data");
    std::fs::write(&file, b"keep me").expect("write");
    let refused = gpumem::server::bind_unix(&file, std::time::Duration::ZERO)
        .await
        .expect_err("not a socket");
    assert!(refused.to_string().contains("not a socket"), "{refused}");
    assert_eq!(std::fs::read(&file).expect("still there"), b"keep me");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One HTTP/1.1 POST to `/api/v1/push` on loopback; the status, or `None` when the agent
/// closed the connection first (it may, mid-way through an oversized body).
pub(crate) fn post_tcp(port: u16, body: &[u8]) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .ok()?;
    let head = format!(
        "POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).ok()?;
    // A refused oversized body may reset the connection; the status may still be readable.
    let _ = stream.write_all(body);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// The agent's peak resident memory (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// A real `gpumem serve` under a bounded, concurrent flood on loopback (10 MiB bodies,
/// malformed and ill-typed JSON, negative sizes, 10,000 fake pids) while one process keeps
/// pushing: every valid push is accepted, every bad one refused with a 4xx, and the agent's
/// peak memory stays under 64 MiB (half the chart's limit), even scraped with every process
/// tracked.
#[test]
fn a_loopback_flood_loses_no_valid_push_and_stays_bounded() {
    use crate::agent::{free_port, spawn_serve};
    use std::time::Duration;

    let dir = std::env::temp_dir().join(format!("gpumem-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let port = free_port();
    let agent = spawn_serve(port, &dir.join("serve.log"), None, &[]);
    let stats = |n: i64| -> std::collections::BTreeMap<String, i64> {
        [
            ("allocated_bytes.all.current".to_string(), n),
            ("reserved_bytes.large_pool.current".to_string(), n * 2),
            ("num_alloc_retries".to_string(), 1),
        ]
        .into()
    };
    assert_eq!(post_tcp(port, &payload(1, 1, &stats(1))), Some(202));
    let before = peak_rss_kib(agent.0.id());

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let valid = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut statuses = Vec::new();
            let mut seq = 1;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && statuses.len() < 100 {
                std::thread::sleep(Duration::from_millis(600));
                seq += 1;
                statuses.push(post_tcp(port, &payload(1, seq, &stats(seq as i64))));
            }
            statuses
        })
    };
    let flooders: Vec<_> = (0..4u32)
        .map(|t| {
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                for i in 0..2500u32 {
                    let body = match i % 500 {
                        0 => vec![b'{'; 10 << 20],
                        1 => b"{]".to_vec(),
                        2 => br#"{"pid": 5, "seq": "one", "devices": []}"#.to_vec(),
                        3 => serde_json::json!({"pid": 6, "seq": 1, "devices": [{"index": 0, "uuid": "GPU-x", "stats": {"allocated_bytes.all.current": -4}}]})
                            .to_string()
                            .into_bytes(),
                        _ => payload(1_000_000 + t * 10_000 + i, 1, &stats(1)),
                    };
                    statuses.push((i % 500, post_tcp(port, &body)));
                }
                statuses
            })
        })
        .collect();
    let mut fake_accepted = 0;
    for flooder in flooders {
        for (kind, status) in flooder.join().expect("flooder") {
            match kind {
                // An oversized body: 413, or the connection closed before the answer.
                0 => assert!(matches!(status, Some(413) | None), "{status:?}"),
                1..=3 => assert!(
                    status.is_some_and(|s| (400..500).contains(&s)),
                    "{kind}: {status:?}"
                ),
                _ => match status {
                    Some(202) => fake_accepted += 1,
                    Some(429) => {}
                    other => panic!("a fake pid got {other:?}"),
                },
            }
        }
    }
    let flooded = peak_rss_kib(agent.0.id());
    // A scrape with every tracked process, then the pusher's last pushes.
    let text = crate::agent::http_get(port, "/metrics").expect("scrape");
    // The fake pids come over TCP, which has a quota of its own below the process cap.
    let cap = IngestConfig::default().max_tcp_processes;
    assert!(
        text.contains(&format!("gpumem_ingest_tracked_processes {cap}\n")),
        "the cap"
    );
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses = valid.join().expect("pusher");
    assert!(statuses.len() >= 3, "the pusher pushed during the flood");
    assert!(
        statuses.iter().all(|s| *s == Some(202)),
        "every valid push accepted: {statuses:?}"
    );
    assert_eq!(fake_accepted, cap - 1, "the cap, less the real process");
    let after = peak_rss_kib(agent.0.id());
    eprintln!(
        "agent peak RSS: {before} KiB before, {flooded} KiB after the flood, {after} KiB after a full scrape"
    );
    assert!(after < 64 * 1024, "peak RSS {after} KiB");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The hook's list of names the agent exports as `exported_<name>` is the agent's: the
/// contract's labels, `le` and the target labels.
#[test]
fn the_hook_knows_which_labels_the_agent_renames() {
    use gpumem::ingest::payload::{TARGET_LABELS, collides};
    use gpumem::metrics::contract::CONTRACT;
    let hook = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("python/gpumem_push/src/gpumem_push/limits.py"),
    )
    .expect("the hook's source");
    let start = hook.find("COLLIDING = frozenset((").expect("COLLIDING");
    let end = start + hook[start..].find("))").expect("its end");
    let listed: std::collections::BTreeSet<&str> =
        hook[start..end].split('"').skip(1).step_by(2).collect();
    let mut agent: std::collections::BTreeSet<&str> = CONTRACT
        .iter()
        .flat_map(|d| d.labels.iter().copied())
        .collect();
    agent.extend(TARGET_LABELS);
    agent.insert("le");
    assert_eq!(listed, agent);
    assert!(listed.iter().all(|name| collides(name)));
}

/// The hook's copies of the agent's bounds agree with the agent's: a push the hook builds
/// within them is never refused for its size.
#[test]
fn the_hooks_copies_of_the_agents_bounds_agree() {
    use gpumem::ingest::IngestConfig;
    use gpumem::ingest::limits::{
        MAX_COUNT, MAX_DEVICES, MAX_LABEL_BYTES, MAX_LABEL_NAME, MAX_LABELS, MAX_STATS_KEYS,
        MAX_TEXT,
    };
    let hook = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("python/gpumem_push/src/gpumem_push/limits.py"),
    )
    .expect("the hook's source");
    // `NAME = 512`, `NAME = 1 << 53` or `NAME = 0.55`, a comment allowed after it.
    let value = |name: &str| -> f64 {
        let line = hook
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} = ")))
            .unwrap_or_else(|| panic!("the hook defines {name}"));
        let expr = line.split('#').next().expect("a value").trim();
        match expr.split_once("<<") {
            Some((a, b)) => {
                let (a, b): (u64, u32) = (
                    a.trim().parse().expect("int"),
                    b.trim().parse().expect("int"),
                );
                (a << b) as f64
            }
            None => expr.parse().unwrap_or_else(|_| panic!("{name} = {expr}")),
        }
    };
    // RANK_LABELS = (("rank", "RANK"), ...): the labels torchrun's variables add.
    let start = hook.find("RANK_LABELS = (").expect("RANK_LABELS");
    let end = start + hook[start..].find("))").expect("its end");
    let rank_labels = hook[start..end].matches("(\"").count();
    assert_eq!(rank_labels, 4, "rank, local_rank, world_size, run_id");
    assert_eq!(value("MAX_USER_LABELS") as usize + rank_labels, MAX_LABELS);
    for (hook_name, agent) in [
        ("MAX_LABEL_BYTES", MAX_LABEL_BYTES),
        ("MAX_NAME", MAX_LABEL_NAME),
        ("MAX_TEXT", MAX_TEXT),
        ("MAX_DEVICES", MAX_DEVICES),
        ("MAX_STATS_KEYS", MAX_STATS_KEYS),
        ("MAX_OOM_POOLS", gpumem::ingest::limits::MAX_POOLS),
    ] {
        assert_eq!(value(hook_name) as usize, agent, "{hook_name}");
    }
    assert!(
        value("MAX_HOST_FIGURE") <= MAX_COUNT as f64,
        "host figures within the agent's"
    );
    assert_eq!(value("MAX_BYTES"), gpumem::ingest::limits::MAX_BYTES as f64);
    assert_eq!(value("MAX_COUNT"), MAX_COUNT as f64);
    // The host figures it sends are those the agent reads.
    let start = hook.find("HOST_KEYS = (").expect("HOST_KEYS");
    let end = start + hook[start..].find(')').expect("its end");
    let sent: Vec<&str> = hook[start..end].split('"').skip(1).step_by(2).collect();
    assert_eq!(sent, gpumem::ingest::payload::HOST_KEYS);
    // Periodic pushes keep clear of the agent's rate limit.
    let limit = IngestConfig::default().min_interval.as_secs_f64();
    assert!(value("MIN_INTERVAL") >= limit);
    assert!(value("MIN_GAP") > limit);
}

/// The series budget counts what a scrape shows: a push whose devices have every optional
/// series (a snapshot's figures, the last OOM's time, a sharing layer's limit) yields exactly the series it is charged
/// for, so no series can get around the budget.
#[tokio::test]
async fn a_push_is_charged_the_series_it_shows() {
    let (router, _) = agent(4);
    let device = |i: u32| {
        serde_json::json!({"index": i, "uuid": format!("GPU-{i}"),
            "stats": {"num_ooms": 1, "reserved_bytes.all.current": 4096},
            "largest_free_block": 512, "unmapped_bytes": 1024,
            "memory_limit": {"bytes": 8192, "variable": "CUDA_DEVICE_MEMORY_LIMIT"},
            "segments_by_size": [{"size": 2048, "segments": 1, "free_bytes": 512},
                                 {"size": 4096, "segments": 1, "free_bytes": 0}]})
    };
    // Every pinned host figure too.
    let host = serde_json::json!({"allocated_bytes.current": 4096, "active_bytes.current": 1024,
        "allocations.current": 2, "active_requests.current": 1, "num_host_alloc": 2,
        "num_host_free": 0, "host_alloc_time.total": 1500});
    let body = serde_json::json!({"pid": 77, "seq": 1, "reason": "oom", "host": host,
        "devices": [device(0), device(1)]});
    let charged = gpumem::ingest::payload::validate(body.to_string().as_bytes())
        .expect("valid")
        .series();
    let (status, reply) = post(&router, body.to_string().into_bytes(), LOCAL).await;
    assert_eq!(status, 202, "{reply}");
    let text = scrape(&router).await;
    let shown = text
        .lines()
        .filter(|l| {
            [
                "gpumem_allocator_",
                "gpumem_ingest_",
                "gpumem_host_pinned_",
                "gpumem_process_memory_limit_",
            ]
            .iter()
            .any(|p| l.starts_with(p))
                && l.contains(r#"pid="77""#)
        })
        .count();
    assert_eq!(shown, charged, "{text}");
}

/// The hook's visible characters are the agent's, or fewer: every code point the hook's
/// `is_visible_char` accepts (run by python3 over all of Unicode) the agent accepts inside a
/// text, so a label the hook keeps is never refused.
#[test]
fn the_hooks_visible_characters_are_within_the_agents() {
    let script = r#"
import sys
sys.path.insert(0, sys.argv[1])
from gpumem_push.limits import is_visible_char
start = None
for cp in range(0x110001):
    ok = cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF and is_visible_char(chr(cp))
    if ok and start is None:
        start = cp
    elif not ok and start is not None:
        print(start, cp - 1)
        start = None
"#;
    let out = crate::common::succeeded(
        std::process::Command::new("python3")
            .args(["-c", script])
            .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/gpumem_push/src")),
    );
    let mut accepted = 0u32;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let (a, b) = line.split_once(' ').expect("a range");
        let (a, b): (u32, u32) = (a.parse().expect("int"), b.parse().expect("int"));
        for cp in a..=b {
            let c = char::from_u32(cp).expect("a scalar value");
            assert!(
                gpumem::ingest::payload::is_visible(&format!("a{c}a")),
                "the hook accepts U+{cp:04X}, the agent does not"
            );
            accepted += 1;
        }
    }
    // ASCII's 95 and the letters and digits of every script.
    assert!(accepted > 100_000, "{accepted}");
}
