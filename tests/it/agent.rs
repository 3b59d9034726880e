//! The agent: the metric contract on /metrics for a simulated node, promtool's verdict on a
//! scrape, `gpumem serve` without a driver, and a real Prometheus scraping `gpumem demo`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpumem::demo::{SimNode, SimNodeConfig};
use std::sync::Arc;

use gpumem::agent::Agent;
use gpumem::ingest::{IngestConfig, RecordingLimits, RecordingStore};
use gpumem::metrics::contract::CONTRACT;
use gpumem::server::EXPOSITION_CONTENT_TYPE;
use gpumem::telemetry::cgroup::{ContainerRef, Runtime};
use gpumem::telemetry::{Heartbeat, Poller};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The ingest's settings where pid 77, when the kernel names it, runs in a pod (its OOMs
/// count for the pod) and every pid is alive (no such process need exist here).
pub(crate) fn pid_77_in_a_pod() -> IngestConfig {
    fn in_pod(pid: u32) -> Option<ContainerRef> {
        (pid == 77).then(|| ContainerRef {
            pod_uid: "5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c30".into(),
            container_id: "ab".repeat(32),
            runtime: Runtime::Containerd,
        })
    }
    fn alive(_: u32) -> Option<u64> {
        Some(1)
    }
    IngestConfig {
        resolve: in_pod,
        start_time: alive,
        ..IngestConfig::default()
    }
}

/// A simulated node running fast, with its metrics.
fn demo_metrics() -> (SimNode, Poller, Agent) {
    // The demo reads the node's view at scrape time; the poller (NVML's path) is used by
    // the line-up test.
    let node = SimNode::start(SimNodeConfig {
        speed: 50.0,
        tick: Duration::from_millis(10),
        ..SimNodeConfig::default()
    })
    .expect("starts");
    let poller = Poller::start(Box::new(node.gpu_source()), Duration::from_millis(20));
    let mut agent = Agent::simulated(&node, pid_77_in_a_pod()).expect("registers");
    // It keeps recordings and counts their archiving, as `gpumem demo` does.
    let recordings = RecordingStore::open(
        crate::common::temp_dir("demo-recordings"),
        RecordingLimits::default(),
    )
    .expect("opens");
    recordings.archive();
    if let Some(store) = agent.ingest() {
        store.keep_recordings(Arc::new(recordings));
    }
    agent.watch(poller.heartbeat());
    // Let the processes replay a while, so that every series has moved.
    std::thread::sleep(Duration::from_millis(400));
    (node, poller, agent)
}

/// Sends `request` to `router` in-process: status, content type and the whole body.
pub(crate) async fn respond(
    router: &axum::Router,
    request: axum::http::Request<axum::body::Body>,
) -> (u16, String, axum::body::Bytes) {
    let response = router.clone().oneshot(request).await.expect("responds");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, content_type, body)
}

pub(crate) async fn get(router: axum::Router, path: &str) -> (u16, String, String) {
    let request = axum::http::Request::get(path)
        .body(axum::body::Body::empty())
        .expect("request");
    let (status, content_type, body) = respond(&router, request).await;
    (
        status,
        content_type,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// The `# TYPE` lines of an exposition, sorted: the shape the contract fixes.
fn types(exposition: &str) -> String {
    let mut lines: Vec<&str> = exposition
        .lines()
        .filter(|l| l.starts_with("# TYPE "))
        .collect();
    lines.sort_unstable();
    lines.join("\n") + "\n"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_the_whole_contract() {
    let (_node, _poller, agent) = demo_metrics();
    // One pushed process that ran out of memory in a pod under a sharing layer's limit, so
    // that the ingest's per-process and per-pod series exist too, and a JAX job's.
    agent
        .ingest()
        .expect("the agent ingests")
        .push_from(
            br#"{"pid": 1, "seq": 1, "reason": "oom", "host": {"allocated_bytes.current": 4096, "active_bytes.current": 1024, "allocations.current": 2, "active_requests.current": 1, "num_host_alloc": 2, "num_host_free": 0, "host_alloc_time.total": 1500}, "devices": [{"index": 0, "uuid": "GPU-0", "stats": {"allocated_bytes.all.current": 512, "reserved_bytes.all.current": 1024, "num_ooms": 1}, "memory_limit": {"bytes": 8192, "variable": "CUDA_DEVICE_MEMORY_LIMIT"}, "oom": {"size": 4194304, "stream": 0, "device_total": 8192, "device_free": 0, "pools": [{"pool": "large", "stream": 0, "allocated": 512, "requested": 500, "pending_free": 0, "free": 512, "largest_free": 512, "segments_with_free": 1}]}}]}"#,
            // Connected as `alive` says it started.
            Some(gpumem::ingest::store::Peer {
                pid: 77,
                start_time: Some(1),
                uid: None,
            }),
        )
        .expect("accepted");
    // And a JAX job's GPU (XLA's figures; its limit only XLA reports).
    agent
        .ingest()
        .expect("the agent ingests")
        .push_from(
            br#"{"pid": 2, "seq": 1, "jax_version": "0.10.2", "devices": [{"index": 0, "uuid": "GPU-1", "allocator": "xla", "stats": {"bytes_in_use": 512, "pool_bytes": 4096, "peak_pool_bytes": 4096, "bytes_limit": 4096, "largest_free_block_bytes": 2048}}]}"#,
            None,
        )
        .expect("accepted");
    let router = agent.router();
    // The simulated processes run on threads of their own: on a loaded machine the planned one
    // may not have served a request yet. Scrape until every contract metric is there, for at
    // most 10 s (the check below names what is still missing then).
    let has = |body: &str, name: &str| {
        body.lines().any(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
    };
    let mut scrape = get(router.clone(), "/metrics").await;
    for _ in 0..500 {
        if CONTRACT.iter().all(|def| has(&scrape.2, def.name)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        scrape = get(router.clone(), "/metrics").await;
    }
    let (status, content_type, body) = scrape;
    assert_eq!(status, 200);
    assert!(body.contains(r#"gpumem_ingest_last_push_age_seconds{pid="77"}"#));
    // Pinned host memory per process, its time in seconds.
    assert!(
        body.lines().any(
            |l| l.starts_with(r#"gpumem_host_pinned_alloc_seconds_total{pid="77""#)
                && l.ends_with(" 0.0015")
        ),
        "{body}"
    );
    // The live page's API: the pushed process in the table with its OOM's breakdown, which
    // adds up to the device its observer named.
    let (status, _, api) = get(router.clone(), "/api/v1/node").await;
    assert_eq!(status, 200);
    let node: serde_json::Value = serde_json::from_str(&api).expect("json");
    let pushed = node["processes"]
        .as_array()
        .and_then(|p| p.iter().find(|r| r["pid"] == "77"))
        .unwrap_or_else(|| panic!("the pushed process: {node}"));
    assert_eq!(pushed["allocator"], "pytorch");
    assert_eq!(pushed["ooms"], 1.0);
    let breakdown = pushed["oom_breakdown"].as_object().expect("a breakdown");
    assert_eq!(
        breakdown.len(),
        gpumem::allocator::breakdown::Breakdown::PARTS,
        "{breakdown:?}"
    );
    assert_eq!(breakdown["fragmented"], 512.0);
    let sum: f64 = breakdown
        .values()
        .filter_map(serde_json::Value::as_f64)
        .sum();
    assert_eq!(sum, 8192.0, "{breakdown:?}");
    // With its sentence: 4 MiB asked of a device of 8 KiB.
    assert!(
        pushed["oom_why"]
            .as_str()
            .is_some_and(|w| w.starts_with("No allocator setting avoids this")),
        "{pushed}"
    );
    assert_eq!(content_type, EXPOSITION_CONTENT_TYPE);
    for def in CONTRACT {
        assert!(has(&body, def.name), "{} missing from the scrape", def.name);
    }
    assert!(body.contains(r#"simulated="true""#));
    // The simulated processes run in pods: NVML's series and their allocators' carry the names.
    let named = r#"pod_namespace="demo",pod_name="train-10000",container_name="trainer""#;
    for metric in [
        "gpumem_process_used_bytes{",
        "gpumem_allocator_reserved_bytes{",
    ] {
        assert!(
            body.lines()
                .any(|l| l.starts_with(metric) && l.contains(named)),
            "{metric} without the pod's names"
        );
    }
    assert!(body.contains("gpumem_gpu_assigned_info{"));
    assert!(body.contains(r#"gpumem_source_up{source="simulated"} 1"#));
    assert!(body.contains(r#"gpumem_source_up{source="allocator"} 1"#));
    // The golden file fixes every metric's name and type.
    let golden = manifest().join("tests/golden/metric-types.txt");
    let expected = std::fs::read_to_string(&golden).unwrap_or_default();
    if std::env::var_os("GPUMEM_BLESS").is_some() {
        std::fs::write(&golden, types(&body)).expect("bless");
    } else {
        assert_eq!(
            types(&body),
            expected,
            "run with GPUMEM_BLESS=1 to accept a contract change"
        );
    }
    // promtool's verdict on the exposition.
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is installed (scripts/test-all installs Debian's prometheus package)");
    promtool
        .stdin
        .take()
        .expect("stdin")
        .write_all(body.as_bytes())
        .expect("write");
    let out = promtool.wait_with_output().expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let (status, _, body) = get(router.clone(), "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, _, body) = get(router.clone(), "/readyz").await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    // The live page, its script and its policy (the page is tested in a browser by view.rs).
    let (status, _, body) = get(router.clone(), "/").await;
    assert_eq!(status, 200);
    assert!(body.contains(r#"href="metrics""#) && body.contains("assets/agent.js"));
    let (status, content_type, _) = get(router.clone(), "/assets/agent.js").await;
    assert_eq!(
        (status, content_type.as_str()),
        (200, "text/javascript; charset=utf-8")
    );
    let (status, _, _) = get(router, "/nope").await;
    assert_eq!(status, 404);
}

/// A loop that never finishes its first round: not ready, and once past its allowance not
/// live either, each saying which loop.
#[tokio::test]
async fn a_stalled_loop_fails_the_probes_by_name() {
    let (_node, _poller, mut agent) = demo_metrics();
    let stuck = Heartbeat::new("nvml", Duration::from_millis(50));
    agent.watch(stuck);
    let router = agent.router();
    let (status, _, body) = get(router.clone(), "/readyz").await;
    assert_eq!(
        (status, body.as_str()),
        (503, "first collection not done: nvml\n")
    );
    let (status, _, _) = get(router.clone(), "/healthz").await;
    assert_eq!(status, 200, "within its allowance");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _, body) = get(router, "/healthz").await;
    assert_eq!(status, 503);
    assert!(body.starts_with("nvml: no round finished for"), "{body}");
}

#[test]
fn the_line_up_holds_on_the_simulated_node() {
    let (node, poller, _metrics) = demo_metrics();
    assert!(poller.latest().up, "the polled view is up too");
    let read = node.report_reader();
    for _ in 0..20 {
        // Allocator counters first, then the device view, as a scrape reads them.
        let reserved: Vec<i64> = (0..2)
            .map(|gpu| {
                node.allocator_sources()
                    .iter()
                    .filter(|p| p.gpu == gpu)
                    .map(|p| p.stats.reserved_bytes.all_current())
                    .sum()
            })
            .collect();
        let report = read();
        let sample = report.sample.as_ref().expect("simulated node is up");
        // The last GPU is in MIG mode: its processes are its MIG devices'.
        assert!(sample.gpus[1].processes.is_empty() && sample.gpus[1].mig.len() == 3);
        for gpu in &sample.gpus {
            let on_migs = gpu.mig.iter().flat_map(|m| &m.processes);
            let processes: u64 = gpu
                .processes
                .iter()
                .chain(on_migs)
                .filter_map(|p| p.used)
                .sum();
            assert_eq!(gpu.used, processes, "device used is the processes' sum");
            let migs: u64 = gpu.mig.iter().map(|m| m.total).sum();
            assert!(migs + gpu.reserved.unwrap_or(0) <= gpu.total);
            for mig in &gpu.mig {
                assert_eq!(mig.used + mig.free, mig.total, "{mig:?}");
            }
            assert!(
                (reserved[gpu.index as usize] as u64) < gpu.used,
                "memory outside the allocator exists"
            );
            assert!(gpu.used + gpu.free + gpu.reserved.unwrap_or(0) <= gpu.total);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Starts `gpumem serve` on `port`, polling every 0.2 s, its log in `log` and its push socket
/// beside it (`log` with the extension `sock`), with `extra` arguments; returns once it
/// answers `/healthz`.
pub(crate) fn spawn_serve(
    port: u16,
    log: &Path,
    library_path: Option<&Path>,
    extra: &[&std::ffi::OsStr],
) -> Reaper {
    spawn_serve_with_env(port, log, library_path, extra, &[])
}

/// [`spawn_serve`] with `env` added to its environment.
pub(crate) fn spawn_serve_with_env(
    port: u16,
    log: &Path,
    library_path: Option<&Path>,
    extra: &[&std::ffi::OsStr],
    env: &[(&str, String)],
) -> Reaper {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpumem"));
    command.envs(env.iter().map(|(k, v)| (k, v)));
    command
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--interval",
            "0.2",
            "--push-socket",
        ])
        .arg(log.with_extension("sock"))
        .args(extra)
        .stderr(std::fs::File::create(log).expect("log file"));
    if let Some(dir) = library_path {
        command.env("LD_LIBRARY_PATH", dir);
    }
    let serve = Reaper(command.spawn().expect("starts"));
    if wait_for(Duration::from_secs(20), || http_get(port, "/healthz")).is_none() {
        panic!(
            "gpumem serve does not answer: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    serve
}

/// A free loopback port (bound and released: another process could take it, which would
/// fail the test loudly rather than silently).
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A plain HTTP/1.0 GET on loopback (no chunked encoding to undo); `None` until the server
/// answers 200.
pub(crate) fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?;
    (status == "200").then(|| body.to_string())
}

/// Polls `probe` every 100 ms for at most `limit`.
pub(crate) fn wait_for<T>(limit: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(value) = probe() {
            return Some(value);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

/// Kills the child when the test ends, however it ends.
pub(crate) struct Reaper(pub(crate) Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_without_a_driver_reports_nvml_down_and_keeps_serving() {
    let port = free_port();
    let log = std::env::temp_dir().join(format!("gpumem-serve-{port}.log"));
    let mut child = spawn_serve(port, &log, None, &[]);
    let body = wait_for(Duration::from_secs(20), || http_get(port, "/metrics"))
        .expect("serve answers /metrics");
    if body.contains(r#"gpumem_source_up{source="nvml"} 1"#) {
        eprintln!("an NVIDIA driver is present: NVML is up");
    } else {
        assert!(
            body.contains(r#"gpumem_source_up{source="nvml"} 0"#),
            "{body}"
        );
        assert!(body.contains("gpumem_build_info"));
        let log_text = std::fs::read_to_string(&log).expect("log");
        assert!(log_text.contains("source is down"), "{log_text}");
        assert!(
            log_text.contains("NVML") || log_text.contains("driver"),
            "{log_text}"
        );
        assert_eq!(log_text.matches("source is down").count(), 1, "logged once");
    }
    // Still serving after several polls, live and ready with NVML down (a driverless node
    // must not be restarted forever); then SIGTERM shuts it down cleanly.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(http_get(port, "/healthz").as_deref(), Some("ok\n"));
    assert_eq!(http_get(port, "/readyz").as_deref(), Some("ready\n"));
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let exited = wait_for(Duration::from_secs(10), || {
        child.0.try_wait().ok().flatten()
    })
    .expect("exits after SIGTERM");
    assert!(exited.success(), "{exited:?}");
    let _ = std::fs::remove_file(log);
}

/// An empty path turns that part off (the chart passes `""` when a feature is off), even
/// where the working directory holds a `pods/` directory.
#[test]
fn serve_turns_sockets_off_with_empty_values() {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("gpumem-serve-off-{port}"));
    std::fs::create_dir_all(dir.join("pods")).expect("scratch dir");
    let log = dir.join("serve.log");
    let _child = Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .current_dir(&dir)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--push-socket", "", "--pod-resources-socket", ""])
            .args(["--kubelet-logs", ""])
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("starts"),
    );
    let answered = wait_for(Duration::from_secs(20), || http_get(port, "/healthz"));
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(answered.is_some(), "serve does not answer: {log_text}");
    assert!(!log_text.contains("accepting pushes"), "{log_text}");
    let metrics = http_get(port, "/metrics").expect("metrics");
    assert!(!metrics.contains(r#"source="pod_resources""#));
    assert!(!metrics.contains(r#"source="pod_logs""#));
    let _ = std::fs::remove_dir_all(dir);
}

/// An NVML library that loads but whose init fails as a machine without a loaded driver
/// answers (`NVML_ERROR_DRIVER_NOT_LOADED`): serve must report why and keep serving.
#[test]
fn serve_reports_a_failed_nvml_init() {
    let dir = crate::common::temp_dir("nvml-stub");
    let source = dir.join("stub.c");
    std::fs::write(
        &source,
        "int nvmlInit_v2(void) { return 9; }\n\
         int nvmlInitWithFlags(unsigned int f) { return 9; }\n\
         int nvmlShutdown(void) { return 0; }\n\
         const char *nvmlErrorString(int r) { return \"Driver Not Loaded\"; }\n",
    )
    .expect("stub source");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libnvidia-ml.so.1"))
        .arg(&source)
        .status()
        .expect("a C compiler (gcc) is installed");
    assert!(built.success());
    let port = free_port();
    let log = dir.join("serve.log");
    let _child = spawn_serve(port, &log, Some(&dir), &[]);
    let body = wait_for(Duration::from_secs(20), || http_get(port, "/metrics"))
        .expect("serve answers /metrics");
    assert!(
        body.contains(r#"gpumem_source_up{source="nvml"} 0"#),
        "{body}"
    );
    let log_text = std::fs::read_to_string(&log).expect("log");
    assert!(
        log_text.contains("the NVIDIA driver is not loaded"),
        "{log_text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// What Debian's Prometheus (2.42) sends with every scrape.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// The series of an exposition (each sample line's name and labels), sorted.
fn series(exposition: &str) -> Vec<String> {
    let mut out: Vec<String> = exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(series, _)| series.to_string()))
        .collect();
    out.sort_unstable();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrape_answers_in_the_format_and_encoding_asked_for() {
    let (_node, _poller, agent) = demo_metrics();
    let router = agent.router();
    let scrape = |accept: Option<&'static str>, encoding: Option<&'static str>| {
        let router = router.clone();
        async move {
            let mut request = axum::http::Request::get("/metrics");
            if let Some(accept) = accept {
                request = request.header("accept", accept);
            }
            if let Some(encoding) = encoding {
                request = request.header("accept-encoding", encoding);
            }
            let request = request.body(axum::body::Body::empty()).expect("request");
            let response = router.oneshot(request).await.expect("responds");
            let headers = response.headers().clone();
            let body = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            (headers, body)
        }
    };
    let header = |headers: &axum::http::HeaderMap, name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    // As Prometheus asks: OpenMetrics, gzipped.
    let (headers, zipped) = scrape(Some(PROMETHEUS_ACCEPT), Some("gzip")).await;
    assert_eq!(
        header(&headers, "content-type"),
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert_eq!(header(&headers, "content-encoding"), "gzip");
    assert_eq!(header(&headers, "vary"), "accept-encoding");
    let mut om = String::new();
    flate2::read::GzDecoder::new(&zipped[..])
        .read_to_string(&mut om)
        .expect("a gzip body");
    assert!(
        zipped.len() * 5 < om.len(),
        "{} of {}",
        zipped.len(),
        om.len()
    );
    assert!(
        om.ends_with("\n# EOF\n"),
        "{}",
        &om[om.len().saturating_sub(200)..]
    );
    // Plain text by default, uncompressed.
    let (headers, text) = scrape(None, None).await;
    assert_eq!(header(&headers, "content-type"), EXPOSITION_CONTENT_TYPE);
    assert_eq!(header(&headers, "content-encoding"), "");
    let text = String::from_utf8(text.to_vec()).expect("utf-8");
    assert!(!text.contains("# EOF"));
    // The same series under the same names in both (the demo moves, so values may differ).
    assert_eq!(series(&om), series(&text));
    // Counter families lose `_total` in their TYPE line only; the build, allocator, device and
    // assignment families are `info` ones.
    let mut families = 0;
    for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (name, kind) = line.split_once(' ').expect("a TYPE line");
        let expected = match (
            kind,
            name.strip_suffix("_total"),
            name.strip_suffix("_info"),
        ) {
            ("counter", Some(family), _) => format!("# TYPE {family} counter\n"),
            ("gauge", _, Some(family)) => format!("# TYPE {family} info\n"),
            _ => format!("# TYPE {name} {kind}\n"),
        };
        assert!(om.contains(&expected), "{expected} missing");
        families += 1;
    }
    assert!(families > 30, "{families} families");
    assert!(om.contains("# TYPE gpumem_build info\n"));
    // A weight of zero is a refusal.
    let (headers, _) = scrape(Some("text/plain"), Some("gzip;q=0, identity")).await;
    assert_eq!(header(&headers, "content-encoding"), "");
}

/// A TCP relay from a port of its own to `upstream`, keeping the first bytes of every
/// response (their headers); it serves until the process ends, a thread per direction and
/// connection (a scraper keeps one connection).
fn relay(upstream: u16) -> (u16, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let port = listener.local_addr().expect("address").port();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = Arc::clone(&seen);
    std::thread::spawn(move || {
        for client in listener.incoming().take(64).flatten() {
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            let (Ok(mut client_in), Ok(mut server_out)) = (client.try_clone(), server.try_clone())
            else {
                continue;
            };
            std::thread::spawn(move || std::io::copy(&mut client_in, &mut server_out));
            let (mut server_in, mut client_out) = (server, client);
            let kept = Arc::clone(&kept);
            std::thread::spawn(move || {
                let mut buffer = [0u8; 64 * 1024];
                while let Ok(n) = server_in.read(&mut buffer) {
                    if n == 0 || client_out.write_all(&buffer[..n]).is_err() {
                        break;
                    }
                    let head = String::from_utf8_lossy(&buffer[..n.min(512)]).into_owned();
                    if head.starts_with("HTTP/") {
                        kept.lock().expect("lock").push(head);
                    }
                }
            });
        }
    });
    (port, seen)
}

#[test]
fn a_real_prometheus_scrapes_gzipped_openmetrics() {
    let dir = crate::common::temp_dir("prom-om");
    let (_agent, agent_port) = crate::view::spawn_demo(&[], &dir.join("demo.log"));
    let (relay_port, responses) = relay(agent_port);
    let (_prometheus, prom_port) = spawn_prometheus(&dir, relay_port);
    let up = wait_for(Duration::from_secs(60), || {
        let up = prometheus_query(prom_port, "up{job=\"gpumem\"}")?;
        let samples = prometheus_query(prom_port, "scrape_samples_scraped{job=\"gpumem\"}")?;
        let samples: f64 = samples[0]["value"][1].as_str()?.parse().ok()?;
        (up[0]["value"][1] == "1" && samples > 100.0).then_some(samples)
    });
    assert!(
        up.is_some(),
        "Prometheus scraped the demo through the relay"
    );
    // What the agent answered Prometheus: gzipped OpenMetrics.
    let answers = responses.lock().expect("lock").clone();
    let scrape = answers
        .iter()
        .find(|h| h.starts_with("HTTP/1.1 200"))
        .unwrap_or_else(|| panic!("no scrape answered: {answers:?}"));
    let scrape = scrape.to_ascii_lowercase();
    assert!(
        scrape.contains("content-type: application/openmetrics-text; version=1.0.0")
            && scrape.contains("content-encoding: gzip"),
        "{scrape}"
    );
    // And Prometheus read it as OpenMetrics: the metadata of an info family and a counter's
    // are under their OpenMetrics family names.
    let metadata = |family: &str| -> Option<String> {
        let body = http_get(prom_port, &format!("/api/v1/metadata?metric={family}"))?;
        let json: serde_json::Value = serde_json::from_str(&body).ok()?;
        json["data"][family][0]["type"].as_str().map(str::to_string)
    };
    let kinds = wait_for(Duration::from_secs(20), || {
        Some((
            metadata("gpumem_build")?,
            metadata("gpumem_allocator_ooms")?,
        ))
    });
    assert_eq!(
        kinds,
        Some(("info".to_string(), "counter".to_string())),
        "metadata as OpenMetrics names it"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

pub(crate) fn prometheus_query(port: u16, query: &str) -> Option<serde_json::Value> {
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let body = http_get(port, &format!("/api/v1/query?query={encoded}"))?;
    let json: serde_json::Value = serde_json::from_str(&body).ok()?;
    (json["status"] == "success").then(|| json["data"]["result"].clone())
}

/// Starts a real Prometheus (data and config in `dir`) scraping the agent on `agent_port`
/// every second; returns it and its port.
pub(crate) fn spawn_prometheus(dir: &Path, agent_port: u16) -> (Reaper, u16) {
    spawn_prometheus_with_rules(dir, agent_port, None)
}

/// A real Prometheus scraping the agent every second, evaluating `rules` (a rule file) where
/// given.
pub(crate) fn spawn_prometheus_with_rules(
    dir: &Path,
    agent_port: u16,
    rules: Option<&Path>,
) -> (Reaper, u16) {
    spawn_prometheus_alerting(dir, agent_port, rules, None)
}

/// A real Prometheus scraping the agent every second, evaluating `rules` where given and
/// sending its alerts to the Alertmanager on `alertmanager_port` where given.
pub(crate) fn spawn_prometheus_alerting(
    dir: &Path,
    agent_port: u16,
    rules: Option<&Path>,
    alertmanager_port: Option<u16>,
) -> (Reaper, u16) {
    let rule_files = rules.map_or(String::new(), |r| {
        format!("rule_files:\n  - '{}'\n", r.display())
    });
    let alerting = alertmanager_port.map_or(String::new(), |port| {
        format!("alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['127.0.0.1:{port}']\n")
    });
    spawn_prometheus_configured(
        dir,
        &format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n{rule_files}{alerting}scrape_configs:\n  - job_name: gpumem\n    static_configs:\n      - targets: ['127.0.0.1:{agent_port}']\n"
        ),
    )
}

/// A real Prometheus with the configuration `config` (written, with its data, in `dir`);
/// returns it and its port.
pub(crate) fn spawn_prometheus_configured(dir: &Path, config: &str) -> (Reaper, u16) {
    let prom_port = free_port();
    let path = dir.join("prometheus.yml");
    std::fs::write(&path, config).expect("config");
    let prometheus = Reaper(
        Command::new("prometheus")
            .arg(format!("--config.file={}", path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus is installed (scripts/test-all installs Debian's package)"),
    );
    (prometheus, prom_port)
}

#[test]
fn a_real_prometheus_scrapes_the_demo() {
    let agent_port = free_port();
    let dir: PathBuf = std::env::temp_dir().join(format!("gpumem-prom-{agent_port}"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let _agent = Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args([
                "demo",
                "--listen",
                &format!("127.0.0.1:{agent_port}"),
                "--interval",
                "0.2",
                "--speed",
                "20",
            ])
            .stderr(Stdio::null())
            .spawn()
            .expect("demo starts"),
    );
    // A JAX job pushing over loopback as the hook does, once a second until the agent stops
    // answering (at most 150 times): the series only XLA's allocator has (its limit) are
    // scraped too. The demo has no JAX job of its own, and NVML's simulated view does not
    // list this one: its pool is smaller than the CUDA contexts, so the line-up below holds.
    let _jax = std::thread::spawn(move || {
        let mut answered = false;
        for seq in 1..=150u64 {
            let body = serde_json::json!({"pid": 424_242, "seq": seq, "jax_version": "0.10.2",
                "devices": [{"index": 0, "uuid": gpumem::device::simulated_uuid(0),
                             "allocator": "xla",
                             "stats": {"bytes_in_use": 16u64 << 20, "pool_bytes": 64u64 << 20,
                                       "peak_pool_bytes": 64u64 << 20, "bytes_limit": 64u64 << 20,
                                       "largest_free_block_bytes": 32u64 << 20}}]});
            match crate::ingest::post_tcp(agent_port, body.to_string().as_bytes()) {
                Some(_) => answered = true,
                None if answered => break,
                None => {}
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("alerts/gpumem.rules.yml");
    let (_prometheus, prom_port) = spawn_prometheus_with_rules(&dir, agent_port, Some(&rules));
    // Two scrapes of the agent, at most a minute.
    let scraped = wait_for(Duration::from_secs(60), || {
        let result = prometheus_query(prom_port, "count_over_time(up{job=\"gpumem\"}[1m])")?;
        let count: f64 = result[0]["value"][1].as_str()?.parse().ok()?;
        let up = prometheus_query(prom_port, "up{job=\"gpumem\"}")?;
        (count >= 2.0 && up[0]["value"][1] == "1").then_some(())
    });
    assert!(scraped.is_some(), "Prometheus scraped the demo twice");
    // Every metric of the contract, and every dashboard panel's query with its variables set
    // to "All", returns data (the pushed path's, the OOM's and pinned memory's from the
    // demo's job that pushes as PyTorch's hook does and runs out of memory). The simulated
    // processes catch up with their recordings a slice at a time, so on a loaded machine some
    // series (the planned process's) appear a few scrapes later: wait for them, within a
    // bound.
    let mut queries: Vec<(String, String)> = CONTRACT
        .into_iter()
        .map(|def| (def.name.to_string(), def.name.to_string()))
        .collect();
    queries.extend(crate::assets::dashboard_expressions().into_iter().map(
        |(file, title, expr)| {
            let query = crate::assets::substitute(&expr);
            (format!("{file}: {title}: {query}"), query)
        },
    ));
    let missing = || -> Vec<String> {
        queries
            .iter()
            .filter(|(_, query)| {
                prometheus_query(prom_port, query)
                    .is_none_or(|r| r.as_array().is_none_or(Vec::is_empty))
            })
            .map(|(what, _)| what.clone())
            .collect()
    };
    let mut last = Vec::new();
    let complete = wait_for(Duration::from_secs(90), || {
        last = missing();
        last.is_empty().then_some(())
    });
    assert!(complete.is_some(), "no data within 90 s for {last:#?}");
    // The simulated node's processes run in pods the agent names.
    let named = prometheus_query(prom_port, r#"gpumem_process_used_bytes{pod_name!=""}"#)
        .expect("query answers");
    assert!(
        named.as_array().is_some_and(|r| !r.is_empty()),
        "no named process: {named}"
    );
    // The demo's job ran out of memory: its alert is pending or firing.
    let alert = wait_for(Duration::from_secs(60), || {
        let alerts = prometheus_query(prom_port, r#"ALERTS{alertname="GpumemOutOfMemory"}"#)?;
        alerts.as_array().filter(|a| !a.is_empty()).cloned()
    });
    assert!(alert.is_some(), "the OOM alert neither pends nor fires");
    // Annotation queries are valid.
    for (file, name, expr) in crate::assets::annotation_expressions() {
        let query = crate::assets::substitute(&expr);
        assert!(
            prometheus_query(prom_port, &query).is_some(),
            "{file}: annotation {name}: query failed: {query}"
        );
    }
    let lineup = prometheus_query(
        prom_port,
        "sum by (gpu) (gpumem_allocator_reserved_bytes) < sum by (gpu) (gpumem_device_used_bytes)",
    )
    .expect("query answers");
    assert_eq!(
        lineup.as_array().map(Vec::len),
        Some(2),
        "reserved is below device used on both simulated GPUs: {lineup}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
