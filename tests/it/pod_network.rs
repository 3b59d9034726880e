//! Pushes from the pod network (issue 35): the agent attributes each to its pod by the
//! connection's peer address, through a stand-in container runtime serving the real
//! `runtime.v1` CRI API on a Unix socket, and ties the pushed pid to a host process of that
//! pod: processes started here in PID namespaces of their own, in cgroups named as the
//! kubelet names them (cgroupfs driver). Pods play on loopback addresses (127.0.0.2 and
//! 127.0.0.3); no traffic leaves loopback. Needs root, as CI runs.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use gpumem::telemetry::cri::api;
use tonic::codegen::http;

use crate::agent::{free_port, http_get, spawn_serve, wait_for};
use crate::common::temp_dir;
use crate::kubelet::StandIn;

/// The sandboxes the stand-in runtime lists (tests change them while it runs), and how often
/// it was asked each status.
#[derive(Clone, Default)]
pub(crate) struct Runtime {
    pub(crate) sandboxes: Arc<Mutex<Vec<api::PodSandboxStatus>>>,
    status_calls: Arc<AtomicUsize>,
}

struct List(Runtime);

impl tonic::server::UnaryService<api::ListPodSandboxRequest> for List {
    type Response = api::ListPodSandboxResponse;
    type Future = Ready<Result<tonic::Response<Self::Response>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<api::ListPodSandboxRequest>) -> Self::Future {
        // The agent asks for ready sandboxes only.
        let ready_only = request
            .get_ref()
            .filter
            .as_ref()
            .and_then(|f| f.state.as_ref())
            .is_some_and(|s| s.state == api::PodSandboxState::SandboxReady as i32);
        let sandboxes = self
            .0
            .sandboxes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let items = sandboxes
            .iter()
            .filter(|s| !ready_only || s.state == api::PodSandboxState::SandboxReady as i32)
            .map(|s| api::PodSandbox {
                id: s.id.clone(),
                metadata: s.metadata.clone(),
                state: s.state,
            })
            .collect();
        ready(Ok(tonic::Response::new(api::ListPodSandboxResponse {
            items,
        })))
    }
}

struct Status(Runtime);

impl tonic::server::UnaryService<api::PodSandboxStatusRequest> for Status {
    type Response = api::PodSandboxStatusResponse;
    type Future = Ready<Result<tonic::Response<Self::Response>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<api::PodSandboxStatusRequest>) -> Self::Future {
        self.0.status_calls.fetch_add(1, Ordering::Relaxed);
        let id = &request.get_ref().pod_sandbox_id;
        let sandboxes = self
            .0
            .sandboxes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        ready(match sandboxes.iter().find(|s| &s.id == id) {
            Some(status) => Ok(tonic::Response::new(api::PodSandboxStatusResponse {
                status: Some(status.clone()),
            })),
            None => Err(tonic::Status::not_found(format!("no sandbox {id}"))),
        })
    }
}

impl tonic::server::NamedService for Runtime {
    const NAME: &'static str = "runtime.v1.RuntimeService";
}

impl tower::Service<http::Request<tonic::body::Body>> for Runtime {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let runtime = self.clone();
        Box::pin(async move {
            Ok(match request.uri().path() {
                api::LIST_POD_SANDBOX => {
                    let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                    grpc.unary(List(runtime), request).await
                }
                api::POD_SANDBOX_STATUS => {
                    let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                    grpc.unary(Status(runtime), request).await
                }
                _ => tonic::Status::unimplemented("not served").into_http(),
            })
        })
    }
}

/// A ready sandbox of pod `name` (UID `uid`) at `ip`, in the node's network namespace where
/// `host_network`.
pub(crate) fn sandbox(
    uid: &str,
    name: &str,
    ip: &str,
    host_network: bool,
) -> api::PodSandboxStatus {
    api::PodSandboxStatus {
        id: format!("sandbox-{name}"),
        metadata: Some(api::PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: format!("team-{name}"),
            attempt: 0,
        }),
        state: api::PodSandboxState::SandboxReady as i32,
        network: Some(api::PodSandboxNetworkStatus {
            ip: ip.into(),
            additional_ips: Vec::new(),
        }),
        linux: Some(api::LinuxPodSandboxStatus {
            namespaces: Some(api::Namespace {
                options: Some(api::NamespaceOption {
                    network: if host_network {
                        api::NamespaceMode::Node as i32
                    } else {
                        api::NamespaceMode::Pod as i32
                    },
                    pid: api::NamespaceMode::Container as i32,
                }),
            }),
        }),
    }
}

/// A pod's container: processes in a PID namespace of their own and in the cgroup the
/// kubelet (cgroupfs driver) gives the container, `kubepods/besteffort/pod<uid>/<id>`.
pub(crate) struct Container {
    uid: String,
    id: String,
    cgroup: PathBuf,
    child: Child,
}

impl Container {
    /// `extra` sleeping processes besides the namespace's pid 1 (pids 2, 3, … inside).
    pub(crate) fn start(root: &Path, uid: &str, extra: usize) -> Container {
        let id = format!("{:0<64}", uid.replace('-', ""));
        let cgroup = root.join(format!("kubepods/besteffort/pod{uid}/{id}"));
        std::fs::create_dir_all(&cgroup).expect("makes the container's cgroup (root)");
        let inner = format!("{}exec sleep 60", "sleep 60 & ".repeat(extra));
        // The shell joins the cgroup first, so that every process of the namespace is in it.
        let child = Command::new("sh")
            .args([
                "-c",
                r#"echo $$ > "$1/cgroup.procs" && exec unshare --pid --fork --kill-child sh -c "$2""#,
                "sh",
            ])
            .arg(&cgroup)
            .arg(inner)
            .spawn()
            .expect("starts unshare");
        Container {
            uid: uid.into(),
            id,
            cgroup,
            child,
        }
    }

    /// (pid inside, host pid, start time) of each process, once all `count` are there.
    pub(crate) fn processes(&self, count: usize) -> Vec<(u32, u32, u64)> {
        let marker = format!("pod{}/{}", self.uid, self.id);
        wait_for(Duration::from_secs(10), || {
            let mut found = Vec::new();
            for entry in std::fs::read_dir("/proc").ok()?.flatten() {
                let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                    continue;
                };
                let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup"));
                if !cgroup.is_ok_and(|c| c.contains(&marker)) {
                    continue;
                }
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let inner = gpumem::telemetry::process::parse_namespace_pid(&status)?;
                // The shell that joined the cgroup and became unshare is in the host's
                // namespace only: not the container's.
                if status
                    .lines()
                    .any(|l| l.starts_with("NSpid:") && l.split_whitespace().count() == 2)
                {
                    continue;
                }
                let start = gpumem::telemetry::process::start_time(pid)?;
                found.push((inner, pid, start));
            }
            found.sort_unstable();
            (found.len() == count).then_some(found)
        })
        .unwrap_or_else(|| {
            panic!(
                "{count} processes in pod {} (PID namespaces need root)",
                self.uid
            )
        })
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        // unshare --kill-child takes the namespace's pid 1, and the namespace goes with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = wait_for(Duration::from_secs(5), || {
            std::fs::remove_dir(&self.cgroup).ok()
        });
        // The pod's, then besteffort and kubepods where this test made them (only an empty
        // cgroup is removed).
        for dir in self.cgroup.ancestors().skip(1).take(3) {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// `gpumem serve` on `port` attributing the pod network through the runtime on `socket`
/// (the kubelet's parts off), with `extra` arguments; its log in `log`.
pub(crate) fn pod_network_agent(
    port: u16,
    log: &Path,
    socket: &Path,
    extra: &[&str],
) -> crate::agent::Reaper {
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "--cri-socket".as_ref(),
        socket.as_os_str(),
        "--pod-resources-socket".as_ref(),
        "".as_ref(),
        "--kubelet-logs".as_ref(),
        "".as_ref(),
    ];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    spawn_serve(port, log, None, &args)
}

/// Whether this test runs as root, which PID namespaces and cgroups need (CI runs as root);
/// says so where it does not.
pub(crate) fn as_root() -> bool {
    let root = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:\t0\t")));
    if !root {
        eprintln!("skipped: PID namespaces and cgroups need root (CI runs as root)");
    }
    root
}

/// Where cgroups are made: the v1 `pids` hierarchy where mounted, else the unified one.
pub(crate) fn cgroup_root() -> PathBuf {
    let v1 = Path::new("/sys/fs/cgroup/pids");
    if v1.join("cgroup.procs").exists() {
        v1.to_path_buf()
    } else {
        PathBuf::from("/sys/fs/cgroup")
    }
}

/// Posts `body` to the agent on `port` from the loopback address `from`: (status, answer).
pub(crate) fn push_from(
    from: &str,
    port: u16,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    let local: SocketAddr = format!("{from}:0").parse().expect("address");
    socket
        .bind(&local.into())
        .expect("binds a loopback address");
    let agent: SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
    socket
        .connect_timeout(&agent.into(), Duration::from_secs(5))
        .expect("connects");
    let mut stream: TcpStream = socket.into();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let body = body.to_string();
    write!(
        stream,
        "POST /api/v1/push HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("sends");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("reads");
    let (head, answer) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, serde_json::from_str(answer).unwrap_or_default())
}

fn payload(pid: u32, seq: u64, start_time: u64, labels: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "pid": pid, "seq": seq, "start_time": start_time, "torch_version": "2.11.0",
        "labels": labels,
        "devices": [{"index": 0, "uuid": "GPU-5e0c", "stats": {
            "allocated_bytes.all.current": 1024, "reserved_bytes.all.current": 2048}}]
    })
}

/// The counter of refusals (or acceptances) of `result`.
fn count(metrics: &str, result: &str) -> f64 {
    let prefix = format!("gpumem_ingest_payloads_total{{result=\"{result}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

const UID_A: &str = "3f1c9a52-8d4e-4b7a-9e21-5c6d7f8a9b01";
const UID_B: &str = "7a2b3c4d-5e6f-4a8b-9c0d-1e2f3a4b5c6d";
const UID_HOST: &str = "0d1e2f3a-4b5c-4d6e-8f70-8192a3b4c5d6";

#[test]
fn pushes_from_the_pod_network_are_attributed_by_the_node() {
    if !as_root() {
        return;
    }
    let dir = temp_dir("pod-network");
    let socket = dir.join("cri.sock");
    let runtime = Runtime::default();
    *runtime.sandboxes.lock().expect("lock") = vec![
        sandbox(UID_A, "a", "127.0.0.2", false),
        sandbox(UID_B, "b", "127.0.0.3", false),
        sandbox(UID_HOST, "host", "127.0.0.6", true),
    ];
    let _cri = StandIn::serve(&socket, runtime.clone());
    let root = cgroup_root();
    let a = Container::start(&root, UID_A, 2);
    let b = Container::start(&root, UID_B, 0);
    let in_a = a.processes(3);
    let in_b = b.processes(1);
    assert_eq!(
        in_a.iter().map(|p| p.0).collect::<Vec<_>>(),
        [1, 2, 3],
        "pod a's pids inside its namespace"
    );
    assert_eq!(in_b[0].0, 1);

    let port = free_port();
    let log = dir.join("agent.log");
    let _agent = pod_network_agent(
        port,
        &log,
        &socket,
        &["--node-ip", "127.0.0.4", "--max-pod-processes", "2"],
    );
    let none = serde_json::json!({});

    // Each pod's pushes are its own, under the host pid of the process they name.
    let (a2_inner, a2_host, a2_start) = in_a[1];
    let (b1_inner, b1_host, b1_start) = in_b[0];
    let (status, answer) = push_from(
        "127.0.0.2",
        port,
        &payload(a2_inner, 1, a2_start, none.clone()),
    );
    assert_eq!(status, 202, "{answer}");
    let (status, answer) = push_from(
        "127.0.0.3",
        port,
        &payload(b1_inner, 1, b1_start, none.clone()),
    );
    assert_eq!(status, 202, "{answer}");
    let metrics = http_get(port, "/metrics").expect("scrape");
    let series_of = |pid: u32, uid: &str| {
        metrics.lines().any(|l| {
            l.starts_with("gpumem_allocator_allocated_bytes{")
                && l.contains(&format!("pid=\"{pid}\""))
                && l.contains(&format!("pod_uid=\"{uid}\""))
        })
    };
    assert!(
        series_of(a2_host, UID_A),
        "pod a's process by its host pid:\n{metrics}"
    );
    assert!(series_of(b1_host, UID_B), "pod b's process by its host pid");
    assert!(
        !metrics.contains(&format!("pid=\"{a2_inner}\"")),
        "never the pid inside"
    );

    // Pod b claiming pod a's pid 2 (with its start time), or pod a's labels.
    let (status, answer) = push_from("127.0.0.3", port, &payload(2, 1, a2_start, none.clone()));
    assert_eq!(
        (status, answer["reason"].as_str()),
        (403, Some("not_in_pod")),
        "{answer}"
    );
    let (status, answer) = push_from(
        "127.0.0.3",
        port,
        &payload(b1_inner, 2, b1_start, serde_json::json!({"pod_uid": UID_A})),
    );
    assert_eq!(
        (status, answer["reason"].as_str()),
        (403, Some("forbidden")),
        "{answer}"
    );

    // An unknown peer, the node's address, a host-network pod's.
    let (status, answer) = push_from("127.0.0.5", port, &payload(1, 1, 1, none.clone()));
    assert_eq!(
        (status, answer["reason"].as_str()),
        (403, Some("unknown_peer")),
        "{answer}"
    );
    for node in ["127.0.0.4", "127.0.0.6"] {
        let (status, answer) = push_from(node, port, &payload(1, 1, 1, none.clone()));
        assert_eq!(
            (status, answer["reason"].as_str()),
            (403, Some("peer_is_node")),
            "{node}: {answer}"
        );
    }

    // Pod a fills its quota of two processes; pod b's pushes are still accepted.
    let (inner, _, start) = in_a[0];
    let (status, answer) = push_from("127.0.0.2", port, &payload(inner, 1, start, none.clone()));
    assert_eq!(status, 202, "{answer}");
    let (inner, _, start) = in_a[2];
    let (status, answer) = push_from("127.0.0.2", port, &payload(inner, 1, start, none.clone()));
    assert_eq!(
        (status, answer["reason"].as_str()),
        (429, Some("capacity")),
        "{answer}"
    );
    std::thread::sleep(Duration::from_millis(600));
    let (status, answer) = push_from(
        "127.0.0.3",
        port,
        &payload(b1_inner, 3, b1_start, none.clone()),
    );
    assert_eq!(status, 202, "{answer}");

    let metrics = http_get(port, "/metrics").expect("scrape");
    assert_eq!(count(&metrics, "accepted"), 4.0);
    assert_eq!(count(&metrics, "not_in_pod"), 1.0);
    assert_eq!(count(&metrics, "forbidden"), 1.0);
    assert_eq!(count(&metrics, "unknown_peer"), 1.0);
    assert_eq!(count(&metrics, "peer_is_node"), 2.0);
    assert_eq!(count(&metrics, "capacity"), 1.0);
    // Statuses are cached by sandbox: each asked once, however many pushes.
    assert_eq!(runtime.status_calls.load(Ordering::Relaxed), 3);

    // Pod b's sandbox stops: its address is no one's within the list's age.
    runtime
        .sandboxes
        .lock()
        .expect("lock")
        .retain(|s| s.id != "sandbox-b");
    std::thread::sleep(Duration::from_millis(300));
    let (status, answer) = push_from("127.0.0.3", port, &payload(b1_inner, 4, b1_start, none));
    assert_eq!(
        (status, answer["reason"].as_str()),
        (403, Some("unknown_peer")),
        "{answer}"
    );
}
