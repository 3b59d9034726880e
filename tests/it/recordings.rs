//! The agent keeps the recordings jobs upload at an OOM (issue 37): a real `gpumem serve` with
//! `--recordings-dir`, pushes and uploads over loopback HTTP. Kept, listed and counted; refused
//! with their reason when oversized, truncated, malformed, or not from a pushing process; the
//! store within its caps over a hundred jobs and across a restart. Loopback only.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::time::Duration;

use gpumem::allocator::TraceAction;
use gpumem::recording::parse_recording;

use crate::agent::{Reaper, free_port, http_get, spawn_serve, wait_for};
use crate::common::temp_dir;
use crate::explain::{fragment, recorded_json};
use crate::view::raw_get;

const MIB: u64 = 1 << 20;

pub(crate) fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("compresses");
    encoder.finish().expect("compresses")
}

/// A snapshot of gpumem's allocator ending in a fragmentation OOM, as JSON, and the index of
/// that OOM in its trace.
pub(crate) fn oom_recording() -> (Vec<u8>, usize) {
    let json = recorded_json(900 * MIB, 0, |a| {
        fragment(a);
    });
    let recording = parse_recording(&json).expect("reads");
    let oom = recording.device_traces[0]
        .iter()
        .rposition(|e| e.action == TraceAction::Oom)
        .expect("an OOM");
    (json, oom)
}

/// How a request's body is framed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Length {
    /// Its Content-Length.
    Own,
    /// A Content-Length of this many bytes, whatever the body is.
    Declared(usize),
    /// Chunked: no length said.
    Chunked,
}

/// One HTTP/1.1 request on a connection of its own (`Connection: close`): the status and body.
pub(crate) fn request(
    port: u16,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
    length: Length,
) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let framing = match length {
        Length::Own => format!("Content-Length: {}", body.len()),
        Length::Declared(n) => format!("Content-Length: {n}"),
        Length::Chunked => "Transfer-Encoding: chunked".to_string(),
    };
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n{framing}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).expect("writes");
    // A server that refuses before reading may close while the body is still going out.
    let _ = match length {
        Length::Chunked => body
            .chunks(16 * 1024)
            .try_for_each(|c| {
                stream.write_all(format!("{:x}\r\n", c.len()).as_bytes())?;
                stream.write_all(c)?;
                stream.write_all(b"\r\n")
            })
            .and_then(|()| stream.write_all(b"0\r\n\r\n")),
        _ => stream.write_all(body),
    };
    // A body shorter than its length ends with the connection's write side (hyper then
    // drops the connection: the refusal is counted, not answered).
    if matches!(length, Length::Declared(n) if n > body.len()) {
        let _ = stream.shutdown(Shutdown::Write);
    }
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

pub(crate) fn push(port: u16, pid: u32) {
    push_as(port, pid, 1, None);
}

/// A push of `pid`'s `seq`th, with its reason (`oom`, `exit`) where given.
fn push_as(port: u16, pid: u32, seq: u64, reason: Option<&str>) {
    let mut body = serde_json::json!({
        "pid": pid, "seq": seq,
        "devices": [{"index": 0, "uuid": "GPU-1", "stats": {"reserved_bytes.all.current": 2048}}]
    });
    if let Some(reason) = reason {
        body["reason"] = reason.into();
    }
    let body = body.to_string();
    let (status, answer) = request(
        port,
        "POST",
        "/api/v1/push",
        "application/json",
        body.as_bytes(),
        Length::Own,
    );
    assert_eq!(status, 202, "{answer}");
}

pub(crate) fn upload(port: u16, pid: u32, body: &[u8]) -> (u16, serde_json::Value) {
    let (status, answer) = request(
        port,
        "POST",
        &format!("/api/v1/recordings?pid={pid}"),
        "application/gzip",
        body,
        Length::Own,
    );
    (
        status,
        serde_json::from_str(&answer).unwrap_or_else(|_| serde_json::json!(answer)),
    )
}

pub(crate) fn listed(port: u16) -> Vec<serde_json::Value> {
    let body = http_get(port, "/api/v1/recordings").expect("lists");
    serde_json::from_str(&body).expect("JSON")
}

pub(crate) fn metric(port: u16, series: &str) -> f64 {
    let text = http_get(port, "/metrics").expect("scrapes");
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("reads")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// `gpumem serve` keeping recordings in `dir/store`, its log `dir/serve-<port>.log` and its
/// push socket beside it ([`socket_of`]).
pub(crate) fn agent(port: u16, dir: &Path, extra: &[&str]) -> Reaper {
    let store = dir.join("store");
    let mut args = keeping_in(&store);
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    spawn_serve(port, &dir.join(format!("serve-{port}.log")), None, &args)
}

/// The flags of an agent off a node (no kubelet) keeping recordings in `store`.
pub(crate) fn keeping_in(store: &Path) -> Vec<&std::ffi::OsStr> {
    vec![
        "--pod-resources-socket".as_ref(),
        "".as_ref(),
        "--kubelet-logs".as_ref(),
        "".as_ref(),
        "--recordings-dir".as_ref(),
        store.as_os_str(),
    ]
}

/// The push socket of the agent [`agent`] starts in `dir` on `port`.
pub(crate) fn socket_of(dir: &Path, port: u16) -> std::path::PathBuf {
    dir.join(format!("serve-{port}.log")).with_extension("sock")
}

/// A refused upload: what it is, its pid, content type, body and framing, and the status and
/// reason it is answered with.
type Case<'a> = (&'a str, u32, &'a str, &'a [u8], Length, u16, &'a str);

#[test]
fn recordings_are_kept_listed_and_refused_with_their_reasons() {
    let dir = temp_dir("recordings");
    let port = free_port();
    let _agent = agent(port, &dir, &["--recordings-max-bytes-each", "65536"]);
    let (json, oom) = oom_recording();
    let recording = gzip(&json);
    assert!(recording.len() < 65536, "{}", recording.len());
    push(port, 4242);

    let (status, stored) = upload(port, 4242, &recording);
    assert_eq!(status, 201, "{stored}");
    assert_eq!(stored["pid"], 4242);
    assert_eq!(stored["bytes"], recording.len());
    assert_eq!(
        (stored["device"].clone(), stored["oom_event"].clone()),
        (serde_json::json!(0), serde_json::json!(oom))
    );
    let list = listed(port);
    assert_eq!(list, vec![stored.clone()]);
    let id = stored["id"].as_str().expect("an id");
    let kept = std::fs::read(dir.join("store").join(format!("{id}.pickle.gz"))).expect("kept");
    assert_eq!(kept, recording, "stored as sent");

    // Refusals, each with its reason, none leaving a file behind.
    let half = &recording[..recording.len() / 2];
    let not_a_recording = gzip(b"hello");
    let too_long = vec![0x1f; 70_000];
    let gz = "application/gzip";
    let cases: [Case<'_>; 7] = [
        (
            "not from a pushing process",
            4243,
            gz,
            &recording,
            Length::Own,
            403,
            "forbidden",
        ),
        (
            "not gzip",
            4242,
            "application/json",
            &recording,
            Length::Own,
            403,
            "forbidden",
        ),
        (
            "declared too large",
            4242,
            gz,
            b"",
            Length::Declared(65537),
            413,
            "too_large",
        ),
        (
            "too large, undeclared",
            4242,
            gz,
            &too_long,
            Length::Chunked,
            413,
            "too_large",
        ),
        ("cut off", 4242, gz, half, Length::Own, 400, "truncated"),
        (
            "not a recording",
            4242,
            gz,
            &not_a_recording,
            Length::Own,
            400,
            "malformed",
        ),
        (
            "the body ends early",
            4242,
            gz,
            half,
            Length::Declared(recording.len()),
            400,
            "truncated",
        ),
    ];
    for (i, (what, pid, content_type, body, length, want, reason)) in cases.into_iter().enumerate()
    {
        // Each from a process of its own that pushed (a process uploads once a minute at
        // most); 4243 never pushes.
        let pid = if pid == 4242 {
            push(port, 4300 + i as u32);
            4300 + i as u32
        } else {
            pid
        };
        let (status, answer) = request(
            port,
            "POST",
            &format!("/api/v1/recordings?pid={pid}"),
            content_type,
            body,
            length,
        );
        if status == 0 && what == "the body ends early" {
            continue; // counted below
        }
        assert_eq!(status, want, "{what}: {answer}");
        let answer: serde_json::Value = serde_json::from_str(&answer).expect("JSON");
        assert_eq!(answer["reason"], reason, "{what}: {answer}");
    }
    // Twice from one process within a minute: the second is refused.
    let (status, answer) = upload(port, 4242, &recording);
    assert_eq!(
        (status, answer["reason"].clone()),
        (429, serde_json::json!("rate_limited")),
        "{answer}"
    );
    assert_eq!(listed(port).len(), 1);
    assert_eq!(
        files(&dir.join("store")).len(),
        2,
        "{:?}",
        files(&dir.join("store"))
    );
    for (reason, n) in [
        ("forbidden", 2.0),
        ("too_large", 2.0),
        ("truncated", 2.0),
        ("malformed", 1.0),
        ("rate_limited", 1.0),
    ] {
        let series = format!("gpumem_recordings_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(port, &series), n, "{series}");
    }
    assert_eq!(metric(port, "gpumem_recordings_stored"), 1.0);
    assert_eq!(
        metric(port, "gpumem_recordings_stored_bytes"),
        recording.len() as f64
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hundred_jobs_keep_the_store_within_its_caps() {
    let dir = temp_dir("recordings-caps");
    let (json, _) = oom_recording();
    let recording = gzip(&json);
    let size = recording.len();
    let port = free_port();
    let max_bytes = (7 * size + size / 2).to_string();
    let agent_process = agent(
        port,
        &dir,
        &[
            "--recordings-max-count",
            "10",
            "--recordings-max-bytes",
            &max_bytes,
            "--exited-grace",
            "0",
        ],
    );
    // Each job pushes, uploads its recording and exits, as a job dying of an OOM does.
    for pid in 5000..5100 {
        push(port, pid);
        let (status, answer) = upload(port, pid, &recording);
        assert_eq!(status, 201, "{pid}: {answer}");
        push_as(port, pid, 2, Some("exit"));
        // The agent tracks 64 TCP pushers at most: let the exited ones go (each second).
        if pid % 50 == 49 {
            let gone = wait_for(Duration::from_secs(10), || {
                (metric(port, "gpumem_ingest_tracked_processes") == 0.0).then_some(())
            });
            assert!(gone.is_some(), "exited jobs are still tracked");
        }
    }
    // The bytes bind before the count: the seven newest, oldest evicted.
    let pids: Vec<u64> = listed(port)
        .iter()
        .map(|r| r["pid"].as_u64().expect("pid"))
        .collect();
    assert_eq!(pids, (5093..5100).rev().collect::<Vec<u64>>());
    assert_eq!(files(&dir.join("store")).len(), 14);
    assert_eq!(
        metric(port, "gpumem_recordings_stored_bytes"),
        (7 * size) as f64
    );
    // Its peak memory, over a hundred uploads each read whole.
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", agent_process.0.id())).expect("status");
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM");
    assert!(peak_kib < 128 * 1024, "the agent peaked at {peak_kib} KiB");
    drop(agent_process);

    // A restart finds them, within its own caps: the five newest; the rest's files removed.
    std::fs::write(dir.join("store").join(".upload-1-2"), b"partial").expect("writes");
    std::fs::write(dir.join("store").join("notes.txt"), b"not the store's").expect("writes");
    let port = free_port();
    let _agent = agent(port, &dir, &["--recordings-max-count", "5"]);
    let pids: Vec<u64> = listed(port)
        .iter()
        .map(|r| r["pid"].as_u64().expect("pid"))
        .collect();
    assert_eq!(pids, (5095..5100).rev().collect::<Vec<u64>>());
    // The store's other files removed, a file of another name left alone.
    assert_eq!(
        files(&dir.join("store")).len(),
        11,
        "{:?}",
        files(&dir.join("store"))
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kept recordings open in the agent's view one at a time, are no longer served once evicted,
/// and follow the page's rule (`--ui off`: not served).
#[test]
fn kept_recordings_open_in_the_view_until_evicted() {
    let dir = temp_dir("recordings-view");
    let (json, oom) = oom_recording();
    let recording = gzip(&json);
    let port = free_port();
    let _agent = agent(
        port,
        &dir,
        // The default exit grace: the pushers' pids exist nowhere on this host, and with
        // none the agent may drop one between its push and its upload.
        &["--recordings-max-count", "2"],
    );
    let mut ids = Vec::new();
    for pid in [7001, 7002] {
        push(port, pid);
        let (status, answer) = upload(port, pid, &recording);
        assert_eq!(status, 201, "{answer}");
        ids.push(answer["id"].as_str().expect("id").to_string());
    }
    // Each opens in turn (one recording in memory at a time), and explains its OOM.
    for id in ids.iter().chain(ids.iter()) {
        let overview: serde_json::Value = serde_json::from_str(
            &http_get(port, &format!("/recordings/{id}/api/v1/recording")).expect("overview"),
        )
        .expect("JSON");
        assert_eq!(overview["devices"][0]["ooms"], serde_json::json!([oom]));
        let explained: serde_json::Value = serde_json::from_str(
            &http_get(
                port,
                &format!("/recordings/{id}/api/v1/explain?device=0&event={oom}"),
            )
            .expect("explains"),
        )
        .expect("JSON");
        assert_eq!(explained["request"]["event"], oom, "{explained}");
    }
    // A third upload evicts the first: it is no longer served, even though it was open.
    push(port, 7003);
    let (status, answer) = upload(port, 7003, &recording);
    assert_eq!(status, 201, "{answer}");
    let (status, _, body) = raw_get(
        port,
        &format!("/recordings/{}/api/v1/recording", ids[0]),
        "127.0.0.1",
        None,
    )
    .expect("answers");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("keeps no recording"), "{body}");

    // With the page off, so is the view (the listing's rule).
    let port = free_port();
    let _off = agent(port, &dir, &["--ui", "off"]);
    let (status, _, body) =
        raw_get(port, &format!("/recordings/{}/", ids[1]), "127.0.0.1", None).expect("answers");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("turned off"), "{body}");
}
