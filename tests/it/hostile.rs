//! The agent and the CLI under hostile and unlucky input: each case a reproducer of a way the
//! agent used to misbehave, asserting the behaviour it has now (status, reason, counter, exit).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::ffi::OsStr;

use crate::agent::{Reaper, free_port, http_get, spawn_serve, wait_for};
use crate::common::{succeeded, temp_dir};

/// `gpumem serve` on loopback with `extra` arguments, its push socket in `dir`.
fn serve(dir: &Path, port: u16, extra: &[&str]) -> Reaper {
    let mut args: Vec<&OsStr> = vec!["--pod-resources-socket".as_ref(), "".as_ref()];
    args.extend(extra.iter().map(OsStr::new));
    spawn_serve(port, &dir.join("push.log"), None, &args)
}

/// Sends `request` raw; the response, or what arrived before the agent closed.
fn raw(port: u16, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = stream.write_all(request);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    String::from_utf8_lossy(&response).into_owned()
}

fn status(response: &str) -> Option<u16> {
    response.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

fn push_request(content_type: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

const PUSH: &str = r#"{"pid": 4242, "seq": 1, "devices": [{"index": 0, "uuid": "GPU-a", "stats": {"reserved_bytes.all.current": 1}}]}"#;

fn counter(port: u16, result: &str) -> f64 {
    let text = http_get(port, "/metrics").expect("scrape");
    let series = format!("gpumem_ingest_payloads_total{{result=\"{result}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {series}"))
}

/// Cross-site pushes (a web page's "simple request"), bodies declared or sent too large, a
/// truncated body and a bad chunk: each refused with its own reason and status, counted.
#[test]
fn hostile_requests_are_refused_with_their_reason() {
    let dir = temp_dir("hostile-http");
    let port = free_port();
    let _agent = serve(&dir, port, &["--body-timeout", "1"]);
    for (request, code, reason) in [
        (push_request("text/plain", "", PUSH), 403, "forbidden"),
        (
            push_request("application/json", "Origin: http://evil.example\r\n", PUSH),
            403,
            "forbidden",
        ),
    ] {
        let response = raw(port, &request);
        assert_eq!(status(&response), Some(code), "{response}");
        assert!(response.contains(reason), "{response}");
    }
    assert_eq!(counter(port, "forbidden"), 2.0);

    // A declared 10 GB body is refused at once, without reading it.
    let started = Instant::now();
    let response = raw(
        port,
        b"POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n{",
    );
    assert_eq!(status(&response), Some(413), "{response}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // Expect: 100-continue over the limit: no "100 Continue", the refusal.
    let response = raw(
        port,
        b"POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1048576\r\nExpect: 100-continue\r\n\r\n",
    );
    assert!(!response.contains("100 Continue"), "{response}");
    assert_eq!(status(&response), Some(413), "{response}");
    assert_eq!(counter(port, "too_large"), 2.0);

    // A body shorter than declared, then silence: truncated (400), not "too large".
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream
        .write_all(b"POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pid\"")
        .expect("write");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response);
    assert_eq!(status(&response), Some(400), "{response}");
    assert!(response.contains("truncated"), "{response}");
    assert_eq!(counter(port, "truncated"), 1.0);
    // A broken chunk size.
    let response = raw(
        port,
        b"POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    );
    assert_eq!(status(&response), Some(400), "{response}");
    assert_eq!(counter(port, "truncated"), 2.0, "the bad chunk too");
    assert_eq!(
        counter(port, "too_large"),
        2.0,
        "a bad body is not counted as too large"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Slow and idle clients hold a connection only as long as the header timeout; with many of
/// them open, `/healthz` still answers, and SIGTERM ends the agent within its bound even
/// with a request half sent, removing the push socket.
#[test]
fn slow_clients_cannot_hold_the_agent() {
    let dir = temp_dir("hostile-slow");
    let port = free_port();
    let mut agent = serve(
        &dir,
        port,
        &[
            "--header-timeout",
            "0.5",
            "--max-connections",
            "32",
            "--shutdown-timeout",
            "1",
        ],
    );
    // Partial headers: closed by the agent after the header timeout.
    let mut partial = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    partial
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .expect("write");
    partial
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let started = Instant::now();
    let mut buf = Vec::new();
    let _ = partial.read_to_end(&mut buf);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "closed after {:?}",
        started.elapsed()
    );
    // An idle keep-alive connection after a response: closed too.
    let mut idle = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("write");
    idle.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let started = Instant::now();
    let mut buf = Vec::new();
    let _ = idle.read_to_end(&mut buf);
    assert!(String::from_utf8_lossy(&buf).contains("200 OK"));
    assert!(started.elapsed() < Duration::from_secs(4), "idle closed");

    // 100 idle connections against a cap of 32: /healthz keeps answering.
    let crowd: Vec<TcpStream> = (0..100)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(crowd.len() >= 90);
    for _ in 0..5 {
        let started = Instant::now();
        assert!(http_get(port, "/healthz").is_some(), "healthz answers");
        assert!(started.elapsed() < Duration::from_secs(4));
        std::thread::sleep(Duration::from_millis(300));
    }
    drop(crowd);

    // A request half sent, then SIGTERM: the agent ends within its shutdown bound.
    let mut half = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    half.write_all(b"POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        .expect("write");
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let term = Command::new("kill")
        .args(["-TERM", &agent.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    let exited = wait_for(Duration::from_secs(10), || {
        agent.0.try_wait().ok().flatten()
    });
    let exited = exited.expect("the agent exits on SIGTERM");
    assert!(exited.success(), "{exited:?}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(
        !dir.join("push.sock").exists(),
        "the socket file is removed"
    );
    drop(half);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A second agent on a live agent's socket waits for it instead of stealing it: when the
/// first stops during the wait, the second binds without a takeover.
#[test]
fn a_second_agent_waits_for_the_first_to_leave_the_socket() {
    let dir = temp_dir("hostile-socket");
    let (a_port, b_port) = (free_port(), free_port());
    let mut first = serve(&dir, a_port, &[]);
    let mut second = Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["serve", "--listen", &format!("127.0.0.1:{b_port}")])
            .args(["--interval", "0.5", "--pod-resources-socket", ""])
            .arg("--push-socket")
            .arg(dir.join("push.sock"))
            .args(["--socket-wait", "20"])
            .stderr(std::fs::File::create(dir.join("second.log")).expect("log"))
            .spawn()
            .expect("starts"),
    );
    // While the first answers, the second does not take the socket.
    std::thread::sleep(Duration::from_millis(1500));
    let second_log = || std::fs::read_to_string(dir.join("second.log")).unwrap_or_default();
    assert!(
        !second_log().contains("accepting pushes"),
        "{}",
        second_log()
    );
    assert!(first.0.try_wait().expect("status").is_none());
    // The first leaves (a rolling update's old pod); the second binds at once.
    let _ = Command::new("kill")
        .args(["-TERM", &first.0.id().to_string()])
        .status();
    let _ = wait_for(Duration::from_secs(10), || {
        first.0.try_wait().ok().flatten()
    });
    assert!(
        wait_for(Duration::from_secs(10), || second_log()
            .contains("accepting pushes")
            .then_some(()))
        .is_some(),
        "{}",
        second_log()
    );
    assert!(
        !second_log().contains("taking the socket over"),
        "{}",
        second_log()
    );
    assert!(wait_for(Duration::from_secs(10), || http_get(b_port, "/healthz")).is_some());
    assert!(second.0.try_wait().expect("status").is_none());
    // The first agent, gone, left the second's socket in place.
    assert!(std::os::unix::net::UnixStream::connect(dir.join("push.sock")).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A live agent that never leaves: the second takes over after its bounded wait, saying so.
#[test]
fn a_socket_is_taken_over_after_the_wait_with_a_warning() {
    let dir = temp_dir("hostile-takeover");
    let (a_port, b_port) = (free_port(), free_port());
    let mut first = serve(&dir, a_port, &[]);
    let _second = Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["serve", "--listen", &format!("127.0.0.1:{b_port}")])
            .args(["--interval", "0.5", "--pod-resources-socket", ""])
            .arg("--push-socket")
            .arg(dir.join("push.sock"))
            .args(["--socket-wait", "1"])
            .stderr(std::fs::File::create(dir.join("second.log")).expect("log"))
            .spawn()
            .expect("starts"),
    );
    let log = wait_for(Duration::from_secs(15), || {
        let log = std::fs::read_to_string(dir.join("second.log")).ok()?;
        log.contains("accepting pushes").then_some(log)
    })
    .expect("the second agent binds after its wait");
    assert!(log.contains("taking the socket over"), "{log}");
    // The first agent's exit does not remove the socket the second now owns.
    let _ = Command::new("kill")
        .args(["-TERM", &first.0.id().to_string()])
        .status();
    assert!(
        wait_for(Duration::from_secs(10), || first
            .0
            .try_wait()
            .ok()
            .flatten())
        .is_some()
    );
    assert!(
        std::os::unix::net::UnixStream::connect(dir.join("push.sock")).is_ok(),
        "the second agent still answers on its socket"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every command that prints and exits ends normally when its stdout is closed.
#[test]
fn a_closed_stdout_is_a_normal_end() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/traces")
        .read_dir()
        .expect("bundled traces")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "gz"))
        .expect("a bundled trace");
    let trace = trace.display().to_string();
    let commands: Vec<Vec<&str>> = vec![
        vec!["simulate", "--steps", "2"],
        vec!["simulate", "--steps", "2", "--json"],
        vec!["replay", &trace],
        vec!["replay", &trace, "--check"],
        vec!["replay", &trace, "--json"],
        vec!["replay", &trace, "--config", "expandable_segments:True"],
        vec!["--help"],
        vec!["replay", "--help"],
    ];
    for args in commands {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starts");
        // The reader goes away before the command writes.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("ends");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked") && out.status.code() != Some(101),
            "{args:?}: {:?} {stderr}",
            out.status
        );
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "{args:?}: {:?} {stderr}",
            out.status
        );
    }
}

/// Numeric options out of range are refused with a message, not accepted.
#[test]
fn bad_numbers_are_refused() {
    for args in [
        vec!["demo", "--speed", "nan"],
        vec!["demo", "--speed=-5"],
        vec!["demo", "--speed", "inf"],
        vec!["demo", "--speed", "0.0001"],
        vec!["serve", "--header-timeout", "0"],
        vec!["serve", "--exited-grace=-1"],
        vec!["serve", "--max-connections", "0"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(&args)
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("between")
                || stderr.contains("not a number")
                || stderr.contains("is not in"),
            "{args:?}: refused by the range check, not as an unknown argument: {stderr}"
        );
    }
}

/// A write into a missing directory names the path.
#[test]
fn file_errors_name_the_path() {
    let missing = std::env::temp_dir().join("gpumem-no-such-dir/snap.json");
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["simulate", "--steps", "1", "--snapshot"])
        .arg(&missing)
        .stdout(Stdio::null())
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&missing.display().to_string()), "{stderr}");
}

/// Peak resident memory of a process (VmHWM), in KiB.
pub(crate) fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .expect("VmHWM")
}

fn post(port: u16, body: &[u8]) -> Option<u16> {
    let mut head = format!(
        "POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    head.extend_from_slice(body);
    status(&raw(port, &head))
}

/// Pushes the worst valid payloads over TCP (every label and text at its bound, every device
/// and size class) until the agent's series budget refuses more (TCP's share of it, with
/// `--max-tcp-series`); the processes accepted.
fn fill_with_worst_pushes(port: u16) -> u32 {
    const MIB: u64 = 1 << 20;
    // Eight labels of 64 bytes: the 512 bytes a push may carry.
    let labels: serde_json::Map<String, serde_json::Value> = (0..8)
        .map(|i| (format!("l{i}_{}", "n".repeat(16)), "v".repeat(44).into()))
        .collect();
    let text = "t".repeat(128);
    let stats: serde_json::Map<String, serde_json::Value> = [
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
    ]
    .iter()
    .flat_map(|stat| {
        ["all", "small_pool", "large_pool"]
            .into_iter()
            .flat_map(move |pool| {
                ["current", "peak", "allocated", "freed"]
                    .into_iter()
                    .map(move |kind| {
                        (
                            format!("{stat}.{pool}.{kind}"),
                            serde_json::json!((1u64 << 59) - 1),
                        )
                    })
            })
    })
    .chain(
        [
            "num_ooms",
            "num_alloc_retries",
            "num_device_alloc",
            "num_device_free",
            "num_sync_all_streams",
        ]
        .map(|k| (k.to_string(), serde_json::json!((1u64 << 53) - 1))),
    )
    .collect();
    let device = |i: u32, classes: bool| {
        let mut d = serde_json::json!({
            "index": i, "uuid": format!("GPU-{i:02}-{}", "u".repeat(120)), "stats": stats,
        });
        if classes {
            d["largest_free_block"] = serde_json::json!(MIB);
            // Every class below 2^60: the most a device can list.
            d["segments_by_size"] = (0..60)
                .map(|b| serde_json::json!({"size": 1u64 << b, "segments": 1, "free_bytes": 0}))
                .collect();
        }
        d
    };
    let push = |pid: u32, devices: Vec<serde_json::Value>| {
        serde_json::json!({"pid": pid, "seq": 1, "labels": labels, "torch_version": text,
                           "alloc_conf": text, "devices": devices})
        .to_string()
        .into_bytes()
    };
    let mut pid = 4_000_000;
    let mut accepted = 0;
    let mut refused_budget = false;
    // Whole worst pushes (16 devices, 64 classes each), then single devices to fill up.
    for heavy in [true, false] {
        loop {
            let devices = if heavy {
                (0..16).map(|i| device(i, true)).collect()
            } else {
                vec![device(0, false)]
            };
            pid += 1;
            match post(port, &push(pid, devices)) {
                Some(202) => accepted += 1,
                Some(429) => {
                    refused_budget = true;
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
            assert!(accepted < 1000, "the budget binds");
        }
    }
    assert!(refused_budget && accepted > 0);
    accepted
}

/// The worst a local client can do to a scrape with valid pushes: the budget filled with the
/// worst pushes, then slow scrapers holding their bodies. The scrape stays within the
/// documented budget (about 9 MB) and the agent within the chart's memory limit.
#[test]
fn worst_valid_pushes_stay_within_the_scrape_budget() {
    let dir = temp_dir("hostile-budget");
    let port = free_port();
    let agent = serve(
        &dir,
        port,
        &["--send-timeout", "2", "--max-tcp-series", "10000"],
    );
    let before = peak_rss_kib(agent.0.id());
    let accepted = fill_with_worst_pushes(port);
    assert!(counter(port, "series_budget") >= 2.0);
    let body = http_get(port, "/metrics").expect("scrape");
    let series = body.lines().filter(|l| !l.starts_with('#')).count();
    // Twelve slow scrapers that never read: four hold a body each, the others wait.
    let slow: Vec<TcpStream> = (0..12)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connects");
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                .expect("write");
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // They are cut off after the send timeout; scrapes go on.
    let started = Instant::now();
    let again = wait_for(Duration::from_secs(20), || http_get(port, "/metrics"));
    assert!(again.is_some(), "a scrape gets through the slow ones");
    let waited = started.elapsed();
    let peak = peak_rss_kib(agent.0.id());
    drop(slow);
    eprintln!(
        "worst valid pushes: {accepted} processes, {series} series, a {:.1} MB scrape; agent peak RSS {} KiB idle, {} KiB with twelve slow scrapers (next scrape after {waited:?})",
        body.len() as f64 / 1e6,
        before,
        peak
    );
    assert!(
        body.len() < 12_000_000,
        "the scrape budget: {} bytes",
        body.len()
    );
    assert!(peak < 128 * 1024, "the chart's 128 MiB limit: {peak} KiB");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A huge memory fraction is refused in a line, not 300 digits.
#[test]
fn a_huge_memory_fraction_is_refused_briefly() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["simulate", "--steps", "1", "--memory-fraction", "1e300"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("1e300") && stderr.len() < 200, "{stderr}");
}

/// `demo` ends on SIGTERM within its shutdown bound too, with a request half sent.
#[test]
fn demo_ends_on_sigterm_with_a_request_half_sent() {
    let port = free_port();
    let mut demo = Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["demo", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--shutdown-timeout", "1"])
            .stderr(Stdio::null())
            .spawn()
            .expect("demo starts"),
    );
    assert!(wait_for(Duration::from_secs(20), || http_get(port, "/healthz")).is_some());
    let mut half = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .expect("write");
    let started = Instant::now();
    let term = Command::new("kill")
        .args(["-TERM", &demo.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    let exited = wait_for(Duration::from_secs(10), || demo.0.try_wait().ok().flatten())
        .expect("demo exits on SIGTERM");
    assert!(exited.success(), "{exited:?}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    drop(half);
}

/// Outputs are written whole and only where they were asked for: an output path that is a
/// symbolic link is refused and its target left alone, an output onto the input recording
/// is refused and the recording left alone, and a written output leaves no temporary file
/// behind.
#[test]
fn outputs_never_go_through_a_link_or_onto_an_input() {
    let dir = temp_dir("cli-outputs");
    let trace = dir.join("trace.json.gz");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("data/traces/cs336_attention_tiny_complete.noframes.json.gz"),
        &trace,
    )
    .expect("copied");
    let original = std::fs::read(&trace).expect("read");
    let gpumem = env!("CARGO_BIN_EXE_gpumem");
    let run = |args: &[&OsStr]| Command::new(gpumem).args(args).output().expect("runs");
    let os = |s: &str| OsStr::new(s).to_owned();
    let explain_html = |page: &Path| {
        let mut command = Command::new(gpumem);
        command
            .args(["explain".as_ref(), trace.as_os_str()])
            .args(["--at", "peak", "--html"])
            .arg(page);
        command
    };

    // A link at the output path: refused, its target untouched.
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, "keep me").expect("write");
    let link = dir.join("why.html");
    std::os::unix::fs::symlink(&victim, &link).expect("link");
    let out = explain_html(&link).output().expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("symbolic link"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&victim).expect("read"), "keep me");

    // The plan onto its own recording: refused, the recording intact.
    let out = run(&[&os("plan"), trace.as_os_str(), &os("-o"), trace.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is the input"), "{stderr}");
    assert_eq!(std::fs::read(&trace).expect("read"), original);
    // A comparison's page onto its second recording: refused too.
    let other = dir.join("other.json.gz");
    std::fs::copy(&trace, &other).expect("copied");
    let out = run(&[
        &os("diff"),
        trace.as_os_str(),
        other.as_os_str(),
        &os("--html"),
        other.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is the input"), "{stderr}");
    assert_eq!(std::fs::read(&other).expect("read"), original);

    // A plain output: written whole, nothing left beside it.
    let page = dir.join("page.html");
    succeeded(&mut explain_html(&page));
    assert!(
        std::fs::read_to_string(&page)
            .expect("written")
            .contains("</html>")
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .expect("listed")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // A device is written in place, never renamed over.
    succeeded(&mut explain_html(Path::new("/dev/null")));
    use std::os::unix::fs::FileTypeExt as _;
    assert!(
        std::fs::metadata("/dev/null")
            .expect("there")
            .file_type()
            .is_char_device()
    );
    // A replaced file keeps its permissions.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&page, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    succeeded(&mut explain_html(&page));
    let mode = std::fs::metadata(&page)
        .expect("there")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let _ = std::fs::remove_dir_all(&dir);
}

/// DNS rebinding: a request naming the agent by a name it was not given gets 421 on every
/// route that shows data (pids, pod names, configurations, series), while addresses, the
/// loopback names and `--allow-host` names are answered, and the probes answer whatever the
/// `Host`.
#[test]
fn the_agent_answers_only_to_its_addresses_and_names() {
    let port = free_port();
    let log = std::env::temp_dir().join(format!("gpumem-hosts-{port}.log"));
    let _serve = spawn_serve(
        port,
        &log,
        None,
        &[
            OsStr::new("--allow-host"),
            OsStr::new("gpumem.monitoring.svc"),
        ],
    );
    let status = |path: &str, host: &str| -> u16 {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        )
        .expect("sent");
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).expect("a status line");
        String::from_utf8_lossy(&head[9..12])
            .parse()
            .expect("a status")
    };
    for path in ["/metrics", "/api/v1/node", "/api/v1/segments?pid=1", "/"] {
        for host in [
            "evil.example",
            &format!("evil.example:{port}"),
            "127.0.0.1.nip.io",
        ] {
            assert_eq!(status(path, host), 421, "{path} {host}");
        }
        for host in [
            format!("127.0.0.1:{port}"),
            format!("[::1]:{port}"),
            "10.20.30.40:9417".to_string(),
            format!("localhost:{port}"),
            "gpumem.monitoring.svc:9417".to_string(),
        ] {
            assert_ne!(status(path, &host), 421, "{path} {host}");
        }
    }
    assert_eq!(status("/metrics", "10.20.30.40:9417"), 200);
    for probe in ["/healthz", "/readyz"] {
        assert_ne!(status(probe, "evil.example"), 421, "{probe}");
    }
    // A name given with a port or a trailing dot would never match: refused at start.
    for bad in ["gpumem.svc:9417", "gpumem.svc.", "gpumem/x", ""] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["serve", "--allow-host", bad])
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("is not a DNS name"), "{bad:?}: {stderr}");
    }
    let _ = std::fs::remove_file(&log);
}

/// Raises this process's open-files limit to at least `n` (within the hard limit): the
/// crowds below hold thousands of connections.
#[allow(unsafe_code)]
fn raise_open_files(n: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the struct passed, nothing else.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < n {
            limit.rlim_cur = n.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
    assert!(
        limit.rlim_cur >= n,
        "the hard open-files limit ({}) is below {n}",
        limit.rlim_max
    );
}

/// A stand-in torch and the real hook (`python/gpumem_push`) pushing over `socket` every
/// 0.5 s for `seconds`, then an out-of-memory error; prints the hook's counters.
const HOOK: &str = r#"
import json, sys, time, types
class Props:
    uuid = "11111111-2222-3333-4444-555555555555"
observers = []
torch = types.ModuleType("torch")
torch.__version__ = "2.5.1"
torch.cuda = types.SimpleNamespace(
    is_initialized=lambda: True, device_count=lambda: 1,
    memory_stats=lambda i: {"reserved_bytes.all.current": 1 << 30, "num_ooms": len(observers[1:])},
    get_device_properties=lambda i: Props, memory_snapshot=lambda: [])
torch._C = types.SimpleNamespace(_cuda_attach_out_of_memory_observer=observers.append)
sys.modules["torch"] = torch
sys.path.insert(0, sys.argv[2])
import gpumem_push
gpumem_push.start(url=sys.argv[1], interval=0.5)
time.sleep(float(sys.argv[3]))
sent = gpumem_push.stats()["sent"]
observers.append(None)
observers[0](0, 1 << 40, 0, 0)
deadline = time.time() + 10
while gpumem_push.stats()["sent"] == sent and time.time() < deadline:
    time.sleep(0.05)
print(json.dumps(gpumem_push.stats()), flush=True)
"#;

/// Issue 34, cases 1 to 4: idle crowds on both listeners made `/healthz` and OOM pushes wait
/// for many seconds; withheld push bodies held every push slot (a real hook lost all its
/// pushes); scrapers that never read held every scrape slot. Now the least recently
/// progressed connection makes room, and a stalled slot holder loses its slot: the probe,
/// the hook and real scrapes get through while the attack goes on.
#[test]
fn crowds_withheld_bodies_and_unread_scrapes_keep_nobody_out() {
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    raise_open_files(4096);
    let dir = temp_dir("hostile-crowds");
    let port = free_port();
    // TCP may fill all but the socket's last 400 series (a TCP process 2 400 of them).
    let _agent = serve(&dir, port, &["--max-tcp-series", "9600"]);
    let socket = dir.join("push.log").with_extension("sock");
    // A scrape of megabytes: one nobody reads stalls with most of it in the agent.
    fill_with_worst_pushes(port);
    let scrape = http_get(port, "/metrics").expect("scrape");
    assert!(scrape.len() > 5_000_000, "{} bytes", scrape.len());

    // The attack: pushes whose body stops after 17 KiB (past what is read without a slot),
    // on both listeners, renewed every 100 ms; 32 scrapes nobody reads, 4 of them renewed
    // every 500 ms.
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let attack = {
        let stop = std::sync::Arc::clone(&stop);
        let socket = socket.clone();
        std::thread::spawn(move || {
            let mut head = b"POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n".to_vec();
            head.resize(head.len() + 17 * 1024, b' ');
            let head = &head;
            let mut tcp = std::collections::VecDeque::new();
            let mut unix = std::collections::VecDeque::new();
            let mut unread = std::collections::VecDeque::new();
            let started = Instant::now();
            let mut round = 0;
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(60) {
                round += 1;
                for _ in 0..8 {
                    if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                        let _ = s.write_all(head);
                        tcp.push_back(s);
                    }
                    if let Ok(mut s) = UnixStream::connect(&socket) {
                        let _ = s.write_all(head);
                        unix.push_back(s);
                    }
                }
                let renewed = if round == 1 {
                    32
                } else if round % 5 == 0 {
                    4
                } else {
                    0
                };
                for _ in 0..renewed {
                    if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
                        unread.push_back(s);
                    }
                }
                while tcp.len() > 24 {
                    tcp.pop_front();
                }
                while unix.len() > 24 {
                    unix.pop_front();
                }
                while unread.len() > 32 {
                    unread.pop_front();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(500));

    // The real hook over the socket, meanwhile: every push sent, none dropped.
    let hook = Command::new("python3")
        .args(["-c", HOOK])
        .arg(format!("unix:{}", socket.display()))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/gpumem_push/src"))
        .arg("3")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut hook = Reaper(hook);
    // Real scrapes and the live page's view, meanwhile.
    for path in ["/metrics", "/api/v1/node", "/metrics"] {
        let started = Instant::now();
        let body = http_get(port, path);
        assert!(body.is_some_and(|b| !b.is_empty()), "{path} answers");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{path} after {:?}",
            started.elapsed()
        );
    }
    // Pushes past 16 KiB (they need a slot) from other processes, meanwhile: each accepted
    // within 2 s.
    let stats: serde_json::Map<String, serde_json::Value> = (0..480)
        .map(|i| (format!("custom_statistic_{i:04}.current"), 1.into()))
        .collect();
    let large = serde_json::json!({"pid": 1, "seq": 1,
        "devices": [{"index": 0, "uuid": "GPU-large", "stats": stats}]})
    .to_string();
    assert!(large.len() > 16 * 1024, "{} bytes", large.len());
    let large_file = dir.join("large.json");
    std::fs::write(&large_file, &large).expect("written");
    let send = r#"
import socket, sys, time
body = open(sys.argv[2], "rb").read()
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
started = time.monotonic()
s.connect(sys.argv[1])
s.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
status = s.recv(12).decode()
print(status, time.monotonic() - started)
"#;
    for _ in 0..3 {
        let out = crate::common::succeeded(
            Command::new("python3")
                .args(["-c", send])
                .arg(&socket)
                .arg(&large_file),
        );
        let said = String::from_utf8_lossy(&out.stdout);
        let (status, took) = said.trim().rsplit_once(' ').expect("status and time");
        assert_eq!(status, "HTTP/1.1 202", "{said}");
        let took: f64 = took.parse().expect("seconds");
        assert!(took < 2.0, "a large push took {took} s");
    }
    let mut stdout = String::new();
    let _ = hook
        .0
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut stdout);
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|_| {
        let mut err = String::new();
        let _ = hook
            .0
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut err);
        panic!("the hook did not report: {stdout}{err}")
    });
    stop.store(true, Ordering::Relaxed);
    attack.join().expect("the attack ends");
    assert_eq!(report["dropped"], 0, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    assert!(
        report["sent"].as_u64().is_some_and(|n| n >= 5),
        "the periodic pushes and the OOM push: {report}"
    );

    // Idle crowds: 2 000 TCP and 1 000 socket connections that send nothing.
    let idle_tcp: Vec<TcpStream> = (0..2000)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    let idle_unix: Vec<UnixStream> = (0..1000)
        .filter_map(|_| UnixStream::connect(&socket).ok())
        .collect();
    assert!(idle_tcp.len() >= 1900 && idle_unix.len() >= 900);
    let mut slowest = (Duration::ZERO, Duration::ZERO);
    for seq in 1..=5u64 {
        let started = Instant::now();
        assert!(http_get(port, "/healthz").is_some(), "healthz answers");
        let health = started.elapsed();
        // An OOM push over the socket, attributed to this process.
        let started = Instant::now();
        let body = format!(
            r#"{{"pid": 1, "seq": {seq}, "reason": "oom", "devices": [{{"index": 0, "uuid": "GPU-a", "stats": {{"num_ooms": {seq}}}}}]}}"#
        );
        let mut stream = UnixStream::connect(&socket).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        stream
            .write_all(&push_request("application/json", "", &body))
            .expect("sent");
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        let oom = started.elapsed();
        assert_eq!(status(&response), Some(202), "{response}");
        assert!(
            health < Duration::from_secs(1) && oom < Duration::from_secs(1),
            "healthz after {health:?}, the OOM push after {oom:?}"
        );
        slowest = (slowest.0.max(health), slowest.1.max(oom));
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "under {} idle TCP and {} idle socket connections: slowest healthz {:?}, slowest OOM push {:?}; the hook under the attack: {report}",
        idle_tcp.len(),
        idle_unix.len(),
        slowest.0,
        slowest.1
    );
    drop((idle_tcp, idle_unix));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 34, case 6: a process that connects to the push socket, forks and exits left a
/// connection whose pushes the agent accepted in the dead pid's name. Now a push must come
/// from the process that connected: the child's push over the inherited connection is
/// refused, and its own connection is accepted under its own pid.
#[test]
fn a_connection_outliving_its_process_cannot_push() {
    let dir = temp_dir("hostile-fork");
    let port = free_port();
    let _agent = serve(&dir, port, &[]);
    let socket = dir.join("push.log").with_extension("sock");
    // The parent connects and forks; the child waits until the parent is reaped, then
    // pushes over the parent's connection, then over one of its own.
    let script = r#"
import os, socket, sys, time
def push(sock, seq):
    body = ('{"pid": 1, "seq": %d, "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]}' % seq).encode()
    sock.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    reply = b""
    while chunk := sock.recv(4096):
        reply += chunk
    return reply.split(b"\r\n", 1)[0].decode() + " " + reply.rsplit(b"\r\n", 1)[-1].decode()
inherited = socket.socket(socket.AF_UNIX)
inherited.connect(sys.argv[1])
parent = os.getpid()
if os.fork():
    os._exit(0)
deadline = time.time() + 10
while time.time() < deadline:
    try:
        os.kill(parent, 0)
        time.sleep(0.05)
    except ProcessLookupError:
        break
print(push(inherited, 1), flush=True)
own = socket.socket(socket.AF_UNIX)
own.connect(sys.argv[1])
print(os.getpid(), push(own, 2), flush=True)
"#;
    let mut parent = Command::new("python3")
        .args(["-c", script])
        .arg(&socket)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut stdout = parent.stdout.take().expect("stdout");
    // Reaped: the parent's pid is no one's now.
    assert!(parent.wait().expect("the parent exits").success());
    let mut said = String::new();
    stdout
        .read_to_string(&mut said)
        .expect("the child's report");
    let mut lines = said.lines();
    let inherited = lines.next().unwrap_or_default();
    assert!(
        inherited.starts_with("HTTP/1.1 403") && inherited.contains("no longer the process"),
        "{said}"
    );
    let own = lines.next().unwrap_or_default();
    let (child, own) = own.split_once(' ').unwrap_or_default();
    assert!(own.starts_with("HTTP/1.1 202"), "{said}");
    let metrics = http_get(port, "/metrics").expect("scrape");
    assert!(
        metrics.contains(&format!("pid=\"{child}\"")),
        "the child's own pid"
    );
    assert!(counter(port, "forbidden") >= 1.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 34, case 8: jobs mounted the agent's directory read-write, so one could put its own
/// socket at the agent's path and receive the real hook's pushes. The agent makes the
/// directory its own (`0755`), and a job reaches the socket through a read-only mount,
/// where it can push but neither remove the socket nor bind another (checked in a user and
/// mount namespace of the test's own: no privilege needed).
#[test]
fn jobs_push_through_a_read_only_mount_and_cannot_replace_the_socket() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("hostile-readonly");
    let port = free_port();
    let sockets = dir.join("run");
    let _agent = Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--pod-resources-socket", ""])
            .arg("--push-socket")
            .arg(sockets.join("push.sock"))
            .stderr(Stdio::null())
            .spawn()
            .expect("starts"),
    );
    assert!(wait_for(Duration::from_secs(20), || http_get(port, "/healthz")).is_some());
    let mode = std::fs::metadata(&sockets)
        .expect("made")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755, "only the agent writes there: {mode:o}");
    let job = dir.join("job");
    std::fs::create_dir_all(&job).expect("mount point");
    let script = r#"
import errno, os, socket, sys
path = os.path.join(sys.argv[1], "push.sock")
body = b'{"pid": 1, "seq": 1, "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]}'
s = socket.socket(socket.AF_UNIX)
s.connect(path)
s.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
print(s.recv(12).decode())
for attempt in ("unlink", "bind"):
    try:
        if attempt == "unlink":
            os.unlink(path)
        else:
            socket.socket(socket.AF_UNIX).bind(os.path.join(sys.argv[1], "rogue.sock"))
        print(attempt, "succeeded")
    except OSError as e:
        print(attempt, errno.errorcode[e.errno])
"#;
    let out = Command::new("unshare")
        .args(["--map-root-user", "--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && exec python3 -c "$3" "$2""#)
        .args([OsStr::new("sh"), sockets.as_os_str(), job.as_os_str()])
        .arg(script)
        .output()
        .expect("unshare runs");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "a user and mount namespace of the test's own: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("HTTP/1.1 202"), "{said}");
    assert!(said.contains("unlink EROFS"), "{said}");
    assert!(said.contains("bind EROFS"), "{said}");
    assert!(sockets.join("push.sock").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 53, item 12: a command whose results cannot be written fails, naming stdout: a
/// full device (ENOSPC), and a stdout closed before the start (which Rust's runtime fills
/// with /dev/null, so that every write succeeded and the command exited 0). A reader that
/// goes away stays a normal end (`a_closed_stdout_is_a_normal_end`).
#[test]
fn results_that_cannot_be_written_are_an_error() {
    let traces = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/traces");
    let oom = traces.join("state_oldformat_flexgen_opt1p3b_oom.noframes.json.gz");
    let tiny = traces.join("cs336_attention_tiny_complete.noframes.json.gz");
    let (oom, tiny) = (oom.display().to_string(), tiny.display().to_string());
    let commands: Vec<Vec<&str>> = vec![
        vec!["explain", &oom],
        vec!["explain", &oom, "--json"],
        vec!["replay", &oom],
        vec!["replay", &oom, "--json"],
        vec!["plan", &tiny],
        vec!["plan", &tiny, "--json"],
        vec!["diff", &oom, &tiny],
        vec![
            "diff",
            &tiny,
            "--config",
            "expandable_segments:True",
            "--json",
        ],
        vec!["simulate", "--steps", "2"],
    ];
    for args in &commands {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(args)
            .stdout(Stdio::from(full))
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} > /dev/full: {stderr}");
        assert!(
            stderr.contains("cannot write the results to stdout: No space left on device"),
            "{args:?}: {stderr}"
        );
        let out = Command::new("sh")
            .arg("-c")
            .arg(r#"exec "$0" "$@" >&-"#)
            .arg(env!("CARGO_BIN_EXE_gpumem"))
            .args(args)
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} >&-: {stderr}");
        assert!(
            stderr.contains("cannot write the results to stdout: it is closed"),
            "{args:?}: {stderr}"
        );
    }
    // Output thrown away on purpose is not a failure.
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["explain", &oom])
        .stdout(Stdio::null())
        .output()
        .expect("runs");
    assert!(out.status.success(), "{out:?}");
}
