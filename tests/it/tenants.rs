//! Issue 53 (hardening, round 3): no local process or tenant can cost a job its OOM
//! recording, read other tenants' series, forge a job's series or reset its requests. Each
//! test reproduces an attack or fault the hostile probe found against a real `gpumem serve`
//! (loopback and its push socket; one test in a pid namespace of its own) and asserts what
//! the agent does now.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use crate::agent::{free_port, http_get, wait_for};
use crate::common::temp_dir;
use crate::hostile::peak_rss_kib;
use crate::recordings::{agent, gzip, listed, metric, oom_recording, socket_of};

/// A job as the push hook is one: it pushes over the socket (the kernel names it), then, told
/// to, uploads its recording, trying again while the agent says "being received" (as
/// `gpumem_push.history` does, within its 10 s), and prints the answer.
const JOB: &str = r#"
import json, os, socket, sys, time
path, recording = sys.argv[1], sys.argv[2]
def request(method, target, ctype, body):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(path)
    try:
        s.sendall(("%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (method, target, ctype, len(body))).encode() + body)
    except BrokenPipeError:
        pass  # answered before the body was read: the answer waits to be read
    reply = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
    head, _, rest = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest.decode(errors="replace").replace("\n", " ")
push = json.dumps({"pid": os.getpid(), "seq": 1, "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]}).encode()
status, answer = request("POST", "/api/v1/push", "application/json", push)
print("pushed", os.getpid(), status, answer, flush=True)
sys.stdin.readline()
body = open(recording, "rb").read()
deadline = time.monotonic() + 10
while True:
    status, answer = request("POST", "/api/v1/recordings", "application/gzip", body)
    if status == 429 and "being received" in answer and time.monotonic() < deadline:
        time.sleep(0.25)
        continue
    break
print(status, answer, flush=True)
"#;

/// A job process (see [`JOB`]) that has pushed.
struct Job {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pid: u32,
}

impl Job {
    fn start(socket: &Path, recording: &Path) -> Job {
        let mut child = Command::new("python3")
            .args(["-c", JOB])
            .arg(socket)
            .arg(recording)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("the job says it pushed");
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words.get(2), Some(&"202"), "the job's push: {line}");
        let pid = words[1].parse().expect("a pid");
        Job {
            child,
            stdin,
            stdout,
            pid,
        }
    }

    fn go(&mut self) {
        self.stdin.write_all(b"go\n").expect("tells the job");
    }

    /// The upload's status and answer.
    fn answer(mut self) -> (u16, String) {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("the job's answer");
        let _ = self.child.wait();
        let (status, answer) = line.trim().split_once(' ').unwrap_or(("0", &line));
        (status.parse().unwrap_or(0), answer.to_string())
    }
}

/// One HTTP/1.1 request over loopback TCP (`Connection: close`): its status and body.
fn tcp(port: u16, method: &str, target: &str, content_type: &str, body: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let head = format!(
        "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
    answer_of(&mut stream)
}

/// The status and body of the response on `stream`, read to its end.
fn answer_of(stream: &mut impl Read) -> (u16, String) {
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

/// A loopback push of `pid` (its `seq`th), with its start time where given.
fn loopback_push(port: u16, pid: u32, seq: u64, start_time: Option<u64>) -> (u16, String) {
    let mut body = serde_json::json!({
        "pid": pid, "seq": seq,
        "devices": [{"index": 0, "uuid": "GPU-a", "stats": {"reserved_bytes.all.current": 2048}}]
    });
    if let Some(start_time) = start_time {
        body["start_time"] = start_time.into();
    }
    tcp(
        port,
        "POST",
        "/api/v1/push",
        "application/json",
        body.to_string().as_bytes(),
    )
}

/// The gzipped OOM recording, written to `dir/recording.gz`.
fn recording_file(dir: &Path) -> (PathBuf, Vec<u8>) {
    let body = gzip(&oom_recording().0);
    let path = dir.join("recording.gz");
    std::fs::write(&path, &body).expect("writes");
    (path, body)
}

/// An upload of `pid` that declares 16 MiB and sends one byte every half second: the answer
/// it got, and how long after it began.
fn trickle(port: u16, pid: u32) -> std::thread::JoinHandle<(u16, String, Duration)> {
    std::thread::spawn(move || {
        let began = Instant::now();
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let head = format!(
            "POST /api/v1/recordings?pid={pid} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/gzip\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            16 << 20
        );
        stream.write_all(head.as_bytes()).expect("writes");
        let mut response = Vec::new();
        // At most 40 bytes over 20 s; the answer ends it.
        for _ in 0..40 {
            if stream.write_all(b"\x1f").is_err() {
                break;
            }
            let mut chunk = [0; 4096];
            match stream.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    response.extend_from_slice(&chunk[..n]);
                    break;
                }
                Err(_) => {}
            }
        }
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let (status, body) = {
            let _ = stream.read_to_end(&mut response);
            answer_of(&mut response.as_slice())
        };
        (status, body, began.elapsed())
    })
}

/// Items 1 and 2: two trickled uploads from a process that pushed (invented loopback pids)
/// held both places for a minute and dropped every real OOM recording; and three ranks
/// failing together lost the third (its retry refused as "less than 60s ago"). Now loopback
/// is one tenant with one place, a trickle is cut off as stalled, the ranks (one tenant: one
/// user's processes) take turns, and every rank's recording is kept; no refusal counts as
/// `rate_limited`.
#[test]
fn trickled_uploads_and_ranks_failing_together_lose_no_recording() {
    let dir = temp_dir("tenants-trickle");
    let port = free_port();
    let _agent = agent(port, &dir, &[]);
    let (recording, _) = recording_file(&dir);
    for pid in [900, 901] {
        assert_eq!(loopback_push(port, pid, 1, None).0, 202);
    }
    let mut ranks: Vec<Job> = (0..3)
        .map(|_| Job::start(&socket_of(&dir, port), &recording))
        .collect();
    let trickles = [trickle(port, 900), trickle(port, 901)];
    // One trickle holds loopback's place (its upload is on disk) before the ranks fail.
    let store = dir.join("store");
    let holding = wait_for(Duration::from_secs(10), || {
        std::fs::read_dir(&store)
            .ok()?
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".upload-"))
            .then_some(())
    });
    assert!(holding.is_some(), "a trickle holds a place");
    for rank in &mut ranks {
        rank.go();
    }
    let pids: Vec<u32> = ranks.iter().map(|r| r.pid).collect();
    for rank in ranks {
        let (status, answer) = rank.answer();
        assert_eq!(status, 201, "{answer}");
    }
    let kept: Vec<u64> = listed(port)
        .iter()
        .map(|r| r["pid"].as_u64().expect("pid"))
        .collect();
    for pid in pids {
        assert!(kept.contains(&u64::from(pid)), "{pid} in {kept:?}");
    }
    // One trickle had loopback's place and was cut off as stalled, long before the upload
    // timeout; the other was told to try again.
    let mut answers: Vec<(u16, String, Duration)> = trickles
        .into_iter()
        .map(|t| t.join().expect("joins"))
        .collect();
    answers.sort_by_key(|a| a.0);
    let (cut, busy) = (&answers[0], &answers[1]);
    assert_eq!(cut.0, 400, "{cut:?}");
    assert!(cut.1.contains("stalled"), "{cut:?}");
    assert!(cut.2 < Duration::from_secs(15), "{cut:?}");
    assert_eq!(busy.0, 429, "{busy:?}");
    assert!(busy.1.contains("being received"), "{busy:?}");
    assert_eq!(
        metric(
            port,
            "gpumem_recordings_refused_total{reason=\"rate_limited\"}"
        ),
        0.0
    );
    assert!(metric(port, "gpumem_recordings_refused_total{reason=\"capacity\"}") >= 1.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 3: a received upload freed its place before it was read, and reads are one at a
/// time, so uploads that are slow to read (16 MiB of empty gzip members each), sent one
/// after another under invented pids, piled up on disk past the chart's `emptyDir` (704 MiB
/// from 44 pids). Now an upload holds its place until it is read: the store's directory
/// never holds more than two uploads.
#[test]
fn uploads_slow_to_read_do_not_pile_up_on_disk() {
    let dir = temp_dir("tenants-pile");
    let port = free_port();
    let _agent = agent(port, &dir, &[]);
    let empty = {
        let encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.finish().expect("an empty member")
    };
    let body: Vec<u8> = empty
        .iter()
        .copied()
        .cycle()
        .take((16 << 20) / empty.len() * empty.len())
        .collect();
    let body = std::sync::Arc::new(body);
    let pids: Vec<u32> = (7000..7016).collect();
    for &pid in &pids {
        assert_eq!(loopback_push(port, pid, 1, None).0, 202);
    }
    let store = dir.join("store");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (store, done) = (store.clone(), std::sync::Arc::clone(&done));
        std::thread::spawn(move || {
            let mut most = (0usize, 0u64);
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let uploads: Vec<u64> = std::fs::read_dir(&store)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(".upload-"))
                    .filter_map(|e| e.metadata().ok().map(|m| m.len()))
                    .collect();
                most = (most.0.max(uploads.len()), most.1.max(uploads.iter().sum()));
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };
    // Four senders, each taking the next pid whenever its upload was answered, for 8 s.
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let until = Instant::now() + Duration::from_secs(8);
    let senders: Vec<_> = (0..4)
        .map(|_| {
            let (body, next, pids) = (
                std::sync::Arc::clone(&body),
                std::sync::Arc::clone(&next),
                pids.clone(),
            );
            std::thread::spawn(move || {
                let mut answers = Vec::new();
                while Instant::now() < until {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(pid) = pids.get(i) else { break };
                    let target = format!("/api/v1/recordings?pid={pid}");
                    answers.push(expecting(port, &target, &body));
                }
                answers
            })
        })
        .collect();
    let answers: Vec<(u16, String)> = senders
        .into_iter()
        .flat_map(|s| s.join().expect("joins"))
        .collect();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (files, bytes) = watcher.join().expect("joins");
    assert!(files <= 2, "{files} uploads on disk at once");
    assert!(
        bytes <= 2 * (16 << 20),
        "{bytes} bytes of uploads on disk at once"
    );
    // Each was read and refused, or refused at once for want of a place: none waited.
    for (status, answer) in &answers {
        assert!(
            *status == 400 || (*status == 429 && answer.contains("being received")),
            "{status} {answer}"
        );
    }
    assert!(answers.iter().any(|a| a.0 == 400), "at least one was read");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Items 4 and 6: invented loopback pids, one small recording each, evicted a job's
/// recording (all 100 kept were the attacker's); a loopback upload naming no start time was
/// taken as a loopback job's; and an upload under a dead socket job's pid took its link
/// over. Now loopback is one tenant evicting its own, its uploads must name the start time
/// its pushes did, and a job the kernel named keeps its link.
#[test]
fn invented_pids_cannot_evict_or_take_over_a_jobs_recording() {
    let dir = temp_dir("tenants-evict");
    let port = free_port();
    let _agent = agent(
        port,
        &dir,
        &["--recordings-max-count", "5", "--exited-grace", "0.5"],
    );
    let (recording, body) = recording_file(&dir);
    let mut job = Job::start(&socket_of(&dir, port), &recording);
    job.go();
    let job_pid = job.pid;
    let (status, answer) = job.answer();
    assert_eq!(status, 201, "{answer}");
    for pid in 9000..9020 {
        assert_eq!(loopback_push(port, pid, 1, None).0, 202);
        let target = format!("/api/v1/recordings?pid={pid}");
        let (status, answer) = tcp(port, "POST", &target, "application/gzip", &body);
        assert_eq!(status, 201, "{answer}");
    }
    let kept: Vec<u64> = listed(port)
        .iter()
        .map(|r| r["pid"].as_u64().expect("pid"))
        .collect();
    assert_eq!(kept.len(), 5);
    assert!(kept.contains(&u64::from(job_pid)), "{kept:?}");

    // A loopback job that gave its start time: an upload naming none, or another, is not its.
    assert_eq!(loopback_push(port, 9100, 1, Some(777)).0, 202);
    for target in [
        "/api/v1/recordings?pid=9100",
        "/api/v1/recordings?pid=9100&start_time=778",
    ] {
        let (status, answer) = tcp(port, "POST", target, "application/gzip", &body);
        assert_eq!(status, 403, "{target}: {answer}");
    }
    let own = "/api/v1/recordings?pid=9100&start_time=777";
    let (status, answer) = tcp(port, "POST", own, "application/gzip", &body);
    assert_eq!(status, 201, "the job's own: {answer}");

    // The socket job has gone and its entry expired: its pid is free on loopback, and an
    // upload under it is kept, but the job's link stays the job's.
    let free = wait_for(Duration::from_secs(20), || {
        (loopback_push(port, job_pid, 1, None).0 == 202).then_some(())
    });
    assert!(free.is_some(), "the dead job's pid is free on loopback");
    let target = format!("/api/v1/recordings?pid={job_pid}");
    let (status, answer) = tcp(port, "POST", &target, "application/gzip", &body);
    assert_eq!(status, 201, "{answer}");
    let listed = listed(port);
    let id_of = |loopback: bool| {
        listed
            .iter()
            .find(|r| r["pid"] == job_pid && (r["tenant"] == "loopback") == loopback)
            .and_then(|r| r["id"].as_str())
            .map(str::to_string)
            .unwrap_or_else(|| panic!("a recording of {job_pid}: {listed:?}"))
    };
    let job_id = id_of(false);
    id_of(true);
    let (status, location) = redirect(port, &format!("/recordings/pid/{job_pid}"));
    assert_eq!(status, 303);
    assert!(location.contains(&job_id), "{location} is not {job_id}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An upload over loopback TCP that sends its body only once the agent asks for it
/// (`Expect: 100-continue`), so a refusal before the body is read is always heard.
fn expecting(port: u16, target: &str, body: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let head = format!(
        "POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/gzip\r\nContent-Length: {}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("writes");
    let mut first = Vec::new();
    let mut byte = [0; 1];
    while !first.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
        first.push(byte[0]);
    }
    if !first.starts_with(b"HTTP/1.1 100") {
        let (status, answer) = answer_of(&mut first.as_slice());
        let mut rest = String::new();
        let _ = stream.read_to_string(&mut rest);
        return (status, answer + &rest);
    }
    let _ = stream.write_all(body);
    answer_of(&mut stream)
}

/// The status and `Location` of a GET.
fn redirect(port: u16, target: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("writes");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let location = response
        .lines()
        .find_map(|l| l.strip_prefix("location: "))
        .unwrap_or_default()
        .to_string();
    (status, location)
}

/// One HTTP/1.1 GET over the push socket: its status.
fn socket_get(socket: &Path, target: &str) -> u16 {
    let mut stream = UnixStream::connect(socket).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("writes");
    answer_of(&mut stream).0
}

/// Item 5: every pod that mounts the push socket could read `/metrics` (every tenant's pods
/// and labels), the page and the recordings through it, past the NetworkPolicy. Now the
/// socket takes pushes, uploads and probes only.
#[test]
fn the_push_socket_serves_pushes_uploads_and_probes_only() {
    let dir = temp_dir("tenants-socket");
    let port = free_port();
    let _agent = agent(port, &dir, &["--ui", "on"]);
    let socket = socket_of(&dir, port);
    assert_eq!(socket_get(&socket, "/healthz"), 200);
    for target in [
        "/metrics",
        "/",
        "/api/v1/node",
        "/api/v1/recordings",
        "/recordings/pid/1",
        "/assets/agent.js",
    ] {
        let status = socket_get(&socket, target);
        assert!(
            matches!(status, 404 | 405),
            "{target} over the socket: {status}"
        );
    }
    assert!(
        http_get(port, "/metrics").is_some(),
        "TCP still serves /metrics"
    );
    // A push over the socket is still taken.
    let (recording, _) = recording_file(&dir);
    let job = Job::start(&socket, &recording);
    drop(job);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 7 (loopback): another local user's loopback push naming a live loopback job's pid
/// with another start time, or none, replaced the job's series. Now it is refused while the
/// job lives, and the job goes on pushing.
#[test]
fn a_loopback_push_cannot_take_a_live_loopback_jobs_pid() {
    let dir = temp_dir("tenants-loopback");
    let port = free_port();
    let _agent = agent(port, &dir, &[]);
    assert_eq!(loopback_push(port, 4321, 1, Some(5000)).0, 202);
    for start_time in [Some(5001), None] {
        let (status, answer) = loopback_push(port, 4321, 2, start_time);
        assert_eq!(status, 409, "{start_time:?}: {answer}");
        assert!(answer.contains("live loopback job"), "{answer}");
    }
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(loopback_push(port, 4321, 2, Some(5000)).0, 202);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The churn test's job: it sends its OOM push's head and half its body, says so, waits to
/// be told, sends the rest and prints the answer's status line (or "reset"). Run as root, it
/// becomes user `argv[2]` first (where that is not empty).
const SLOW_OOM_PUSH: &str = r#"
import json, os, socket, sys
if sys.argv[2]:
    os.setuid(int(sys.argv[2]))
body = json.dumps({"pid": os.getpid(), "seq": 1, "reason": "oom", "devices": [{"index": 0, "uuid": "GPU-a", "stats": {"num_ooms": 1}}]}).encode()
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
s.connect(sys.argv[1])
s.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:20])
print("sent", flush=True)
sys.stdin.readline()
try:
    s.sendall(body[20:])
    reply = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        reply += chunk
    print(reply.split(b"\r\n", 1)[0].decode() or "closed", flush=True)
except OSError as e:
    print("reset", e, flush=True)
"#;

/// Runs [`SLOW_OOM_PUSH`] as `user` (or as this process's) while this process churns 400
/// connections to the socket, 40 held at a time, each sending `crowd_sends` first: the job's
/// status line.
fn oom_push_beside_a_crowd(socket: &Path, user: &str, crowd_sends: &[u8]) -> String {
    let mut job = Command::new("python3")
        .args(["-c", SLOW_OOM_PUSH])
        .arg(socket)
        .arg(user)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut stdin = job.stdin.take().expect("stdin");
    let mut stdout = BufReader::new(job.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("the job sent half");
    assert_eq!(line.trim(), "sent", "{line}");
    std::thread::sleep(Duration::from_millis(100));
    let mut held = std::collections::VecDeque::new();
    for _ in 0..400 {
        if let Ok(mut conn) = UnixStream::connect(socket) {
            let _ = conn.write_all(crowd_sends);
            held.push_back(conn);
        }
        if held.len() > 40 {
            held.pop_front();
        }
    }
    stdin.write_all(b"go\n").expect("tells the job");
    line.clear();
    stdout.read_line(&mut line).expect("the job's answer");
    let _ = job.wait();
    line
}

/// Item 8: with 1 000 connections churning from another process, an OOM push being read was
/// reset (the listener evicted the connection that progressed least recently, and a request
/// being handled makes none). Now a full listener evicts connections not serving a request
/// first, and those of the owner (a pod, a host user) holding most: an idle crowd of the
/// job's own user, or a crowd of another user with requests of its own in flight, cannot
/// reset the job's push.
#[test]
fn a_churning_crowd_cannot_reset_another_process_push() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("tenants-churn");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let port = free_port();
    let _agent = agent(port, &dir, &["--max-connections", "16"]);
    let socket = socket_of(&dir, port);
    // An idle crowd of the job's own user: the request in flight stays.
    let status = oom_push_beside_a_crowd(&socket, "", b"");
    assert!(
        status.starts_with("HTTP/1.1 202"),
        "beside an idle crowd: {status}"
    );
    // A crowd whose connections each have a push in flight (a head, its body withheld), and
    // the job another user: the crowd's owner holds most and gives way.
    let root = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m));
    if root.is_ok_and(|uid| uid == 0) {
        let head = b"POST /api/v1/push HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n";
        let status = oom_push_beside_a_crowd(&socket, "65534", head);
        assert!(
            status.starts_with("HTTP/1.1 202"),
            "beside a busy crowd: {status}"
        );
    } else {
        eprintln!("not root: the job cannot become another user; the busy crowd's case is not run");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Item 7 (the socket): a child connected and exited before the agent read its start time
/// (here the agent is stopped meanwhile); a new process reused its pid (in a pid namespace
/// of the test's own: never the host's pids); the stale connection then pushed as the new
/// process, whose own pushes got 409. Now the connecting process's handle (`SO_PEERPIDFD`)
/// or its start time at the accept proves whose the pid is, and what cannot be proved is
/// refused.
#[test]
fn a_stale_connection_cannot_speak_for_a_reused_pid() {
    let dir = temp_dir("tenants-pidns");
    let port = free_port();
    let script = r#"
import json, os, signal, socket, subprocess, sys, time
gpumem, dir, port = sys.argv[1], sys.argv[2], sys.argv[3]
path = os.path.join(dir, "ns.sock")
log = open(os.path.join(dir, "ns-agent.log"), "w")
agent = subprocess.Popen([gpumem, "serve", "--listen", "127.0.0.1:" + port, "--interval", "0.2",
    "--push-socket", path, "--pod-resources-socket", "", "--kubelet-logs", ""], stderr=log)
def push(sock, pid, seq):
    body = json.dumps({"pid": pid, "seq": seq, "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]}).encode()
    sock.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    reply = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    return reply.split(b"\r\n", 1)[0].decode() + " " + reply.rsplit(b"\r\n", 1)[-1].decode()
REUSER = """
import json, os, socket, sys
sys.stdin.readline()
body = json.dumps({"pid": os.getpid(), "seq": 1, "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]}).encode()
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"POST /api/v1/push HTTP/1.1\\r\\nHost: localhost\\r\\nContent-Type: application/json\\r\\nConnection: close\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
reply = b""
while True:
    chunk = s.recv(4096)
    if not chunk:
        break
    reply += chunk
print(reply.split(b"\\r\\n", 1)[0].decode(), flush=True)
"""
deadline = time.time() + 20
while time.time() < deadline:
    try:
        probe = socket.socket(socket.AF_UNIX); probe.connect(path); probe.close(); break
    except OSError:
        time.sleep(0.05)
os.kill(agent.pid, signal.SIGSTOP)
go_r, go_w = os.pipe()
out_r, out_w = os.pipe()
child = os.fork()
if child == 0:
    stale = socket.socket(socket.AF_UNIX)
    stale.connect(path)
    if os.fork() == 0:
        os.close(go_w); os.close(out_r)
        os.read(go_r, 1)
        os.write(out_w, push(stale, os.getpid(), 1).encode())
        os._exit(0)
    os._exit(0)
os.waitpid(child, 0)
os.close(go_r); os.close(out_w)
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(child - 1))
reuser = subprocess.Popen([sys.executable, "-c", REUSER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
os.kill(agent.pid, signal.SIGCONT)
time.sleep(0.3)
os.write(go_w, b"x")
stale_answer = b""
while True:
    chunk = os.read(out_r, 4096)
    if not chunk:
        break
    stale_answer += chunk
reuser.stdin.write(b"go\n")
reuser.stdin.flush()
own_answer = reuser.stdout.readline().decode().strip()
reuser.wait()
print(json.dumps({"child": child, "reuser": reuser.pid, "stale": stale_answer.decode(), "own": own_answer}), flush=True)
agent.terminate()
agent.wait()
"#;
    let output = Command::new("unshare")
        .args([
            "--user",
            "--map-root-user",
            "--pid",
            "--fork",
            "--mount-proc",
        ])
        .args(["python3", "-c", script, env!("CARGO_BIN_EXE_gpumem")])
        .arg(&dir)
        .arg(port.to_string())
        .output()
        .expect("unshare runs");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "a pid namespace of the test's own (unshare --user --pid): {said} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(said.trim()).expect("the report");
    assert_eq!(
        report["child"], report["reuser"],
        "the pid was reused: {report}"
    );
    let stale = report["stale"].as_str().unwrap_or_default();
    assert!(
        stale.starts_with("HTTP/1.1 403") && stale.contains("no longer the process"),
        "{report}"
    );
    let own = report["own"].as_str().unwrap_or_default();
    assert!(
        own.starts_with("HTTP/1.1 202"),
        "the new process's own push: {report}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A gzipped recording that the reader cannot read within its 64 MiB budget: 200 000 events,
/// each with a frame of its own.
fn budget_breaker() -> Vec<u8> {
    let events: Vec<serde_json::Value> = (0..200_000u64)
        .map(|i| {
            serde_json::json!({
                "action": "alloc", "addr": 4096 * i, "size": 512, "stream": 0, "time_us": i,
                "frames": [{"filename": format!("f{i:08}{}", "x".repeat(40)), "line": i, "name": format!("n{i}")}]
            })
        })
        .collect();
    let json = serde_json::json!({"segments": [], "device_traces": [events]});
    gzip(json.to_string().as_bytes())
}

/// Item 12: uploads that each take the reader to its budget ratcheted the agent up (90 MiB
/// after one, 309 MiB after six rounds of two at once, measured): each read ran on whichever
/// of the runtime's blocking threads, each with a heap arena of its own. Now every upload is
/// read on the store's one reading thread, and the peak stays where one upload put it.
#[test]
fn hostile_uploads_do_not_ratchet_the_agent_up() {
    let dir = temp_dir("tenants-ratchet");
    let port = free_port();
    let agent_process = agent(port, &dir, &[]);
    let pid = agent_process.0.id();
    let body = budget_breaker();
    let recording = dir.join("breaker.gz");
    std::fs::write(&recording, &body).expect("writes");
    let loopback = |n: u32| {
        assert_eq!(loopback_push(port, n, 1, None).0, 202);
        let target = format!("/api/v1/recordings?pid={n}");
        tcp(port, "POST", &target, "application/gzip", &body)
    };
    let (status, answer) = loopback(9500);
    assert_eq!(status, 413, "{answer}");
    let after_one = peak_rss_kib(pid) >> 10;
    // Six rounds of two at once: one over loopback, one from a job over the socket.
    for round in 0..6 {
        let mut job = Job::start(&socket_of(&dir, port), &recording);
        job.go();
        let (status, answer) = loopback(9501 + round);
        assert_eq!(status, 413, "{answer}");
        let (status, answer) = job.answer();
        assert_eq!(status, 413, "{answer}");
    }
    let after_all = peak_rss_kib(pid) >> 10;
    assert!(
        after_all <= after_one + 32,
        "the agent peaked at {after_one} MiB after one upload, {after_all} MiB after thirteen"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
