//! What the kubelet tells the agent: pod and container names from a node's log directories
//! (laid out here as the kubelet lays them out), and GPU assignments from a stand-in kubelet
//! serving the real gRPC service (`v1.PodResourcesLister/List`) on a Unix socket.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::common::temp_dir;
use gpumem::agent::Agent;
use gpumem::ingest::IngestConfig;
use gpumem::ingest::store::Peer;
use gpumem::metrics::{Format, ReportReader};
use gpumem::sources::AllocatorSources;
use gpumem::telemetry::cgroup::{ContainerRef, Runtime};
use gpumem::telemetry::dra::NodeFiles;
use gpumem::telemetry::pod_names::PodNames;
use gpumem::telemetry::pod_resources::PodResources;
use gpumem::telemetry::pod_resources::api::{
    CdiDevice, ClaimResource, ContainerDevices, ContainerResources, DynamicResource,
    ListPodResourcesRequest, ListPodResourcesResponse, PodResources as PodEntry,
};
use gpumem::telemetry::{GpuSample, Kubelet, MigSample, NodeSample, ProcessSample, SourceReport};
use tonic::codegen::http;

use crate::agent::{free_port, http_get, spawn_serve, wait_for};

/// The pods a stand-in kubelet lists; tests change them while it runs.
type Answer = Arc<Mutex<ListPodResourcesResponse>>;

#[derive(Clone)]
struct Lister {
    answer: Answer,
}

impl tonic::server::NamedService for Lister {
    const NAME: &'static str = "v1.PodResourcesLister";
}

struct List(Answer);

impl tonic::server::UnaryService<ListPodResourcesRequest> for List {
    type Response = ListPodResourcesResponse;
    type Future = Ready<Result<tonic::Response<Self::Response>, tonic::Status>>;

    fn call(&mut self, _: tonic::Request<ListPodResourcesRequest>) -> Self::Future {
        let answer = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        ready(Ok(tonic::Response::new(answer)))
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for Lister {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let answer = Arc::clone(&self.answer);
        Box::pin(async move {
            if request.uri().path() != "/v1.PodResourcesLister/List" {
                return Ok(tonic::Status::unimplemented("not served").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(List(answer), request).await)
        })
    }
}

/// A stand-in daemon serving a gRPC `service` (the kubelet's, the container runtime's) on
/// `socket` until dropped.
pub(crate) struct StandIn {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StandIn {
    pub(crate) fn serve<S>(socket: &Path, service: S) -> StandIn
    where
        S: tower::Service<
                http::Request<tonic::body::Body>,
                Response = http::Response<tonic::body::Body>,
                Error = Infallible,
            > + tonic::server::NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        let _ = std::fs::remove_file(socket);
        let listener = std::os::unix::net::UnixListener::bind(socket).expect("binds the socket");
        listener.set_nonblocking(true).expect("non-blocking");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::UnixListener::from_std(listener).expect("listener");
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let _ = tonic::transport::Server::builder()
                    .serve_with_incoming_shutdown(service, incoming, async {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        StandIn {
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// A kubelet serving `answer`.
    fn start(socket: &Path, answer: Answer) -> StandIn {
        StandIn::serve(socket, Lister { answer })
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn pod(namespace: &str, name: &str, container: &str, gpus: &[&str]) -> PodEntry {
    PodEntry {
        name: name.into(),
        namespace: namespace.into(),
        containers: vec![ContainerResources {
            name: container.into(),
            devices: vec![ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: gpus.iter().map(|g| (*g).to_string()).collect(),
            }],
            dynamic_resources: Vec::new(),
        }],
    }
}

const TRAIN_UID: &str = "5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c30";
const INFER_UID: &str = "0b7e9d14-2c3a-4f5b-8e6d-1a2b3c4d5e6f";
const DEBUG_UID: &str = "9c1d2e3f-4a5b-4c6d-8e7f-0a1b2c3d4e5f";

fn container_id(uid: &str) -> String {
    // One container per pod here: its ID derived from the pod's UID.
    format!("{:0<64}", uid.replace('-', ""))
}

fn in_pod(uid: &str) -> Option<ContainerRef> {
    Some(ContainerRef {
        pod_uid: uid.into(),
        container_id: container_id(uid),
        runtime: Runtime::Containerd,
    })
}

/// The training process: this test's own pid, so that the ingest sees it alive in `/proc`.
fn trainer() -> u32 {
    std::process::id()
}

/// Resolves the training process to its pod, as its cgroup would.
fn resolve(pid: u32) -> Option<ContainerRef> {
    (pid == trainer()).then(|| in_pod(TRAIN_UID)).flatten()
}

/// A node's log directories as the kubelet lays them out: `pods/<ns>_<pod>_<uid>/<container>/`
/// and `containers/<pod>_<ns>_<container>-<id>.log`.
fn log_dirs(root: &Path, pods: &[(&str, &str, &str, &str)]) -> PodNames {
    let (pods_dir, containers_dir) = (root.join("pods"), root.join("containers"));
    std::fs::create_dir_all(&containers_dir).expect("containers dir");
    for (namespace, pod, container, uid) in pods {
        std::fs::create_dir_all(pods_dir.join(format!("{namespace}_{pod}_{uid}/{container}")))
            .expect("pod dir");
        let link = format!("{pod}_{namespace}_{container}-{}.log", container_id(uid));
        std::fs::write(containers_dir.join(link), b"").expect("link");
    }
    PodNames::new(pods_dir, containers_dir)
}

/// NVML's view: GPU 0 (assigned to the training pod) runs its process, a host process, and a
/// debug pod's process that was never assigned a GPU; GPU 1 is time-sliced between two
/// inference pods, one process of which is seen.
fn node_report() -> ReportReader {
    let process = |pid, container| ProcessSample {
        pid,
        name: "python".into(),
        used: Some(1 << 30),
        container,
    };
    nvml(vec![
        h100(
            0,
            0,
            4 << 30,
            vec![
                process(trainer(), in_pod(TRAIN_UID)),
                process(17, None),
                process(23, in_pod(DEBUG_UID)),
            ],
            Vec::new(),
        ),
        h100(
            1,
            1,
            4 << 30,
            vec![process(5151, in_pod(INFER_UID))],
            Vec::new(),
        ),
    ])
}

/// An 80 GiB H100 as NVML reports it (`GPU-<index>aaa`, its device minor), `used` bytes in
/// use, its processes (none of its own in MIG mode) and MIG devices.
fn h100(
    index: u32,
    minor: u32,
    used: u64,
    processes: Vec<ProcessSample>,
    mig: Vec<MigSample>,
) -> GpuSample {
    GpuSample {
        index,
        uuid: format!("GPU-{index}aaa"),
        minor: Some(minor),
        model: "H100".into(),
        total: 80 << 30,
        used,
        free: (80 << 30) - used,
        reserved: None,
        processes,
        mig,
    }
}

/// A MIG device (compute instance 0) of GPU instance `gpu_instance`, `used` of its `total`
/// bytes in use.
fn mig_device(
    (index, uuid): (u32, &str),
    gpu_instance: u32,
    (profile, total): (&str, u64),
    used: u64,
    processes: Vec<ProcessSample>,
) -> MigSample {
    MigSample {
        index,
        uuid: uuid.into(),
        gpu_instance,
        compute_instance: 0,
        profile: profile.into(),
        total,
        used,
        free: total - used,
        processes,
    }
}

/// NVML's answer for these GPUs, up, as the agent reads a polled source.
fn nvml(gpus: Vec<GpuSample>) -> ReportReader {
    let report = Arc::new(SourceReport {
        source: "nvml",
        up: true,
        sample: Some(NodeSample {
            driver_version: "550.54.15".into(),
            simulated: false,
            gpus,
        }),
        error: None,
        duration_seconds: 0.001,
    });
    Box::new(move || Arc::clone(&report))
}

fn line<'a>(text: &'a str, metric: &str, needle: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(metric) && l.contains(needle))
        .unwrap_or_else(|| panic!("no {metric} series with {needle}:\n{text}"))
}

fn names(namespace: &str, pod: &str, container: &str) -> String {
    format!(r#"pod_namespace="{namespace}",pod_name="{pod}",container_name="{container}""#)
}

/// A stand-in kubelet answering `answer` at `socket`, and the agent's view of it after one
/// refresh, asked from a runtime with a worker of its own (as the agent's is always running:
/// the client's connection tasks finish between two refreshes), which later refreshes use.
fn kubelet_answering(
    socket: &Path,
    answer: Answer,
) -> (StandIn, PodResources, tokio::runtime::Runtime) {
    kubelet_answering_with(socket, answer, PodResources::new())
}

/// As [`kubelet_answering`], asked by `resources`.
fn kubelet_answering_with(
    socket: &Path,
    answer: Answer,
    resources: PodResources,
) -> (StandIn, PodResources, tokio::runtime::Runtime) {
    let kubelet = StandIn::start(socket, answer);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(resources.refresh(socket, Duration::from_secs(5)));
    assert!(resources.report().up, "{:?}", resources.report().error);
    (kubelet, resources, runtime)
}

/// The agent over `report`, with the kubelet's names (and assignments, where given), its
/// processes placed in pods as `resolve` says.
fn named_agent(report: ReportReader, names: PodNames, resources: Option<PodResources>) -> Agent {
    Agent::node(
        AllocatorSources::default(),
        vec![report],
        IngestConfig {
            resolve,
            ..IngestConfig::default()
        },
        Kubelet {
            names: Some(names),
            resources,
        },
    )
    .expect("registers")
}

#[test]
fn processes_and_pushes_are_named_and_assignments_listed() {
    let dir = temp_dir("kubelet-join");
    let socket = dir.join("kubelet.sock");
    let answer: Answer = Arc::new(Mutex::new(ListPodResourcesResponse {
        pod_resources: vec![
            pod("ml", "train-0", "trainer", &["GPU-0aaa"]),
            pod("ml", "infer-a", "server", &["GPU-1aaa::0"]),
            pod("ml", "infer-b", "server", &["GPU-1aaa::1"]),
        ],
    }));
    let (kubelet, resources, runtime) = kubelet_answering(&socket, Arc::clone(&answer));
    let pod_names = log_dirs(
        &dir.join("log"),
        &[
            ("ml", "train-0", "trainer", TRAIN_UID),
            ("ml", "infer-b", "server", INFER_UID),
            ("tools", "debug", "shell", DEBUG_UID),
        ],
    );
    pod_names.refresh();

    let agent = named_agent(node_report(), pod_names, Some(resources.clone()));
    let store = agent.ingest().expect("ingest");
    let push = serde_json::json!({
        "pid": 1, "seq": 1,
        "devices": [{"index": 0, "uuid": "GPU-0aaa", "stats": {"allocated_bytes.all.current": 1024}}],
    });
    store
        .push_from(push.to_string().as_bytes(), Some(Peer::now(trainer())))
        .expect("accepted");

    let me = format!(r#"pid="{}""#, trainer());
    let text = agent.state.metrics.encode(Format::Text);
    let trainer_names = names("ml", "train-0", "trainer");
    assert!(
        line(&text, "gpumem_process_used_bytes", &me).contains(&trainer_names),
        "{text}"
    );
    // NVML's series carry the cgroup's pod UID and container ID (what kube-state-metrics'
    // kube_pod_info{uid} joins on), and the names.
    let trainer_line = line(&text, "gpumem_process_used_bytes", &me);
    assert!(
        trainer_line.contains(&format!(r#"pod_uid="{TRAIN_UID}""#))
            && trainer_line.contains(&format!(r#"container_id="{}""#, container_id(TRAIN_UID))),
        "{trainer_line}"
    );
    // Each process by its own pod, whoever the GPU was assigned to; a host process unnamed.
    assert!(
        line(&text, "gpumem_process_used_bytes", r#"pid="23""#)
            .contains(&names("tools", "debug", "shell"))
    );
    assert!(
        line(&text, "gpumem_process_used_bytes", r#"pid="5151""#)
            .contains(&names("ml", "infer-b", "server"))
    );
    let host = line(&text, "gpumem_process_used_bytes", r#"pid="17""#);
    assert!(
        host.contains(r#"pod_uid="",container_id="""#) && host.contains(&names("", "", "")),
        "{host}"
    );
    // The pushed statistics of the trainer carry the same names.
    let pushed = line(&text, "gpumem_allocator_allocated_bytes", &me);
    assert!(
        pushed.contains(&format!(r#"pod_uid="{TRAIN_UID}""#)) && pushed.contains(&trainer_names),
        "{pushed}"
    );
    // The assignments, one series per container holding a GPU.
    let assigned: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("gpumem_gpu_assigned_info{"))
        .collect();
    assert_eq!(assigned.len(), 3, "{assigned:?}");
    assert!(line(&text, "gpumem_gpu_assigned_info", r#"gpu="0""#).contains(&trainer_names));
    for pod in ["infer-a", "infer-b"] {
        assert!(
            assigned
                .iter()
                .any(|l| l.contains(r#"gpu="1""#) && l.contains(&names("ml", pod, "server"))),
            "{assigned:?}"
        );
    }
    assert!(text.contains("gpumem_source_up{source=\"pod_resources\"} 1"));
    assert!(text.contains("gpumem_source_up{source=\"pod_logs\"} 1"));

    // The kubelet stops answering: its source is down, its last answer stands.
    drop(kubelet);
    runtime.block_on(resources.refresh(&socket, Duration::from_secs(2)));
    let report = resources.report();
    assert!(!report.up);
    assert!(
        report
            .error
            .as_deref()
            .is_some_and(|e| e.contains("kubelet.sock")),
        "{report:?}"
    );
    let text = agent.state.metrics.encode(Format::Text);
    assert!(text.contains("gpumem_source_up{source=\"pod_resources\"} 0"));
    assert!(line(&text, "gpumem_gpu_assigned_info", r#"gpu="0""#).contains(&trainer_names));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two pods time-slicing GPU 0 (the trainer's and a debug pod's), the trainer's under a
/// HAMi limit its hook pushed: each process is charged to its own pod, and the limit is
/// exported for the trainer's container only, beside its use.
#[test]
fn a_shared_gpus_limit_is_exported_for_its_own_pod() {
    let dir = temp_dir("kubelet-limit");
    let pod_names = log_dirs(
        &dir.join("log"),
        &[
            ("ml", "train-0", "trainer", TRAIN_UID),
            ("tools", "debug", "shell", DEBUG_UID),
        ],
    );
    pod_names.refresh();
    let agent = named_agent(node_report(), pod_names, None);
    let store = agent.ingest().expect("ingest");
    let push = serde_json::json!({
        "pid": 1, "seq": 1,
        "devices": [{"index": 0, "uuid": "GPU-0aaa",
                     "stats": {"reserved_bytes.all.current": 1024},
                     "memory_limit": {"bytes": 10u64 << 30, "variable": "CUDA_DEVICE_MEMORY_LIMIT_0"}}],
    });
    store
        .push_from(push.to_string().as_bytes(), Some(Peer::now(trainer())))
        .expect("accepted");
    let text = agent.state.metrics.encode(Format::Text);
    let me = format!(r#"pid="{}""#, trainer());
    let limits: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("gpumem_process_memory_limit_bytes{"))
        .collect();
    assert_eq!(limits.len(), 1, "{limits:?}");
    let limit = limits[0];
    assert!(
        limit.contains(r#"gpu="0",UUID="GPU-0aaa""#)
            && limit.contains(&me)
            && limit.contains(r#"variable="CUDA_DEVICE_MEMORY_LIMIT_0""#)
            && limit.contains(&format!(r#"container_id="{}""#, container_id(TRAIN_UID)))
            && limit.contains(&names("ml", "train-0", "trainer"))
            && limit.ends_with(&format!(" {}", 10u64 << 30)),
        "{limit}"
    );
    // Each pod's use is its own: the trainer's process and the debug pod's, on one GPU.
    assert!(
        line(&text, "gpumem_process_used_bytes", &me).contains(&names("ml", "train-0", "trainer"))
    );
    assert!(
        line(&text, "gpumem_process_used_bytes", r#"pid="23""#)
            .contains(&names("tools", "debug", "shell"))
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `gpumem serve` asks the kubelet at the socket it is given and reads the log directories,
/// reports both up, and the kubelet down once it goes; where neither exists there is no such
/// source at all.
#[test]
fn serve_reports_the_kubelet_up_and_down() {
    let dir = temp_dir("kubelet-serve");
    let socket = dir.join("kubelet.sock");
    let answer: Answer = Arc::new(Mutex::new(ListPodResourcesResponse {
        pod_resources: vec![pod("ml", "train-0", "trainer", &["GPU-0aaa"])],
    }));
    let kubelet = StandIn::start(&socket, answer);
    let _ = log_dirs(&dir.join("log"), &[("ml", "train-0", "trainer", TRAIN_UID)]);
    let port = free_port();
    let _serve = spawn_serve(
        port,
        &dir.join("serve.log"),
        None,
        &[
            "--pod-resources-socket".as_ref(),
            socket.as_os_str(),
            "--kubelet-logs".as_ref(),
            dir.join("log").as_os_str(),
        ],
    );
    let up = [
        "gpumem_source_up{source=\"pod_resources\"} 1",
        "gpumem_source_up{source=\"pod_logs\"} 1",
    ];
    let seen = wait_for(Duration::from_secs(20), || {
        http_get(port, "/metrics").filter(|m| up.iter().all(|u| m.contains(u)))
    });
    assert!(seen.is_some(), "the kubelet is never reported up");
    drop(kubelet);
    let down = "gpumem_source_up{source=\"pod_resources\"} 0";
    let seen = wait_for(Duration::from_secs(20), || {
        http_get(port, "/metrics").filter(|m| m.contains(down))
    });
    assert!(seen.is_some(), "the kubelet is never reported down");
    let log = std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default();
    assert_eq!(
        log.matches("kubelet pod resources are down").count(),
        1,
        "logged once:\n{log}"
    );

    let port = free_port();
    let absent = dir.join("absent");
    let _serve = spawn_serve(
        port,
        &dir.join("serve-2.log"),
        None,
        &[
            "--pod-resources-socket".as_ref(),
            absent.join("kubelet.sock").as_os_str(),
            "--kubelet-logs".as_ref(),
            absent.as_os_str(),
        ],
    );
    let metrics = http_get(port, "/metrics").expect("metrics");
    assert!(!metrics.contains("source=\"pod_resources\""), "{metrics}");
    assert!(!metrics.contains("source=\"pod_logs\""), "{metrics}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// In a container given host GPU 1, the job's CUDA ordinal is 0; its pushed series take NVML's
/// host index by UUID, so they join NVML's series `on (gpu, UUID, pid)`. A UUID NVML does not
/// list keeps the pushed index.
#[test]
fn a_container_ordinal_joins_nvml_by_uuid() {
    let agent = Agent::node(
        AllocatorSources::default(),
        vec![node_report()],
        IngestConfig::default(),
        Kubelet::default(),
    )
    .expect("registers");
    let store = agent.ingest().expect("ingest");
    let push = serde_json::json!({
        "pid": 5151, "seq": 1,
        "devices": [
            {"index": 0, "uuid": "GPU-1aaa", "stats": {"reserved_bytes.all.current": 2048}},
            {"index": 3, "uuid": "GPU-unknown", "stats": {"reserved_bytes.all.current": 4096}},
        ],
    });
    store.push(push.to_string().as_bytes()).expect("accepted");
    let text = agent.state.metrics.encode(Format::Text);
    let pushed = |uuid: &str| -> Vec<String> {
        text.lines()
            .filter(|l| {
                l.starts_with("gpumem_allocator_reserved_bytes{")
                    && l.contains(&format!("UUID=\"{uuid}\""))
            })
            .map(str::to_string)
            .collect()
    };
    let on_host = pushed("GPU-1aaa");
    assert!(!on_host.is_empty());
    assert!(
        on_host.iter().all(|l| l.contains(r#"gpu="1""#)),
        "NVML's index: {on_host:?}"
    );
    let nvml = line(&text, "gpumem_process_used_bytes", r#"pid="5151""#);
    assert!(
        nvml.contains(r#"gpu="1""#) && nvml.contains(r#"UUID="GPU-1aaa""#),
        "{nvml}"
    );
    let unknown = pushed("GPU-unknown");
    assert!(
        !unknown.is_empty() && unknown.iter().all(|l| l.contains(r#"gpu="3""#)),
        "the pushed index where NVML does not know the UUID: {unknown:?}"
    );
}

/// A stand-in NVML inventory with GPU 0 in MIG mode, split into a 3g.40gb and a 1g.10gb GPU
/// instance, each running a process in a pod; GPU 1 whole.
fn mig_node_report() -> ReportReader {
    let process = |pid, container| ProcessSample {
        pid,
        name: "python".into(),
        used: Some(3 << 30),
        container,
    };
    let migs = vec![
        mig_device(
            (0, MIG_A),
            2,
            ("3g.40gb", 40 << 30),
            3 << 30,
            vec![process(trainer(), in_pod(TRAIN_UID))],
        ),
        mig_device(
            (1, MIG_B),
            9,
            ("1g.10gb", 10 << 30),
            3 << 30,
            vec![process(4242, in_pod(INFER_UID))],
        ),
    ];
    nvml(vec![
        h100(0, 0, 6 << 30, Vec::new(), migs),
        h100(1, 1, 0, Vec::new(), Vec::new()),
    ])
}

const MIG_A: &str = "MIG-4b6c2f1e-8d3a-5e7b-9c0d-1e2f3a4b5c6d";
const MIG_B: &str = "MIG-7a8b9c0d-1e2f-5a3b-8c4d-5e6f7a8b9c0d";

/// Each MIG device's memory, processes and assignment carry their parent's `gpu` and `UUID`
/// and the instance's labels; pushes from MIG jobs, spelled `MIG-…` by the hook or `GPU-…` by
/// an older one, take the same place, so they join NVML's series on (gpu, UUID, pid).
#[test]
fn mig_devices_processes_pushes_and_assignments_join() {
    let dir = temp_dir("kubelet-mig");
    let socket = dir.join("kubelet.sock");
    let mig_pod = |name: &str, resource: &str, id: &str| PodEntry {
        name: name.into(),
        namespace: "ml".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: vec![id.into()],
            }],
            dynamic_resources: Vec::new(),
        }],
    };
    let answer: Answer = Arc::new(Mutex::new(ListPodResourcesResponse {
        pod_resources: vec![
            // The device plugin's mixed strategy by UUID, and its index strategy.
            mig_pod("train-0", "nvidia.com/mig-3g.40gb", MIG_A),
            mig_pod("infer-b", "nvidia.com/mig-1g.10gb", "0:1"),
        ],
    }));
    let (_kubelet, resources, _runtime) = kubelet_answering(&socket, answer);
    let pod_names = log_dirs(
        &dir.join("log"),
        &[
            ("ml", "train-0", "trainer", TRAIN_UID),
            ("ml", "infer-b", "server", INFER_UID),
        ],
    );
    pod_names.refresh();
    let agent = named_agent(mig_node_report(), pod_names, Some(resources));
    let store = agent.ingest().expect("ingest");
    // The trainer's hook saw MIG_A in NVIDIA_VISIBLE_DEVICES; the server's older hook spelled
    // its device GPU-, in upper case, as torch's UUID with the prefix added.
    let body_b = MIG_B.trim_start_matches("MIG-").to_ascii_uppercase();
    for (pid, uuid) in [
        (trainer(), MIG_A.to_string()),
        (4242, format!("GPU-{body_b}")),
    ] {
        let push = serde_json::json!({
            "pid": pid, "seq": 1,
            "devices": [{"index": 0, "uuid": uuid, "stats": {"reserved_bytes.all.current": 2_i64 << 30}}],
        });
        let peer = (pid == trainer()).then(|| Peer::now(pid));
        store
            .push_from(push.to_string().as_bytes(), peer)
            .expect("accepted");
    }
    let text = agent.state.metrics.encode(Format::Text);
    let instance = |gi: &str, profile: &str, uuid: &str| {
        format!(r#"GPU_I_ID="{gi}",GPU_I_PROFILE="{profile}",mig_uuid="{uuid}""#)
    };
    let (a, b) = (
        instance("2", "3g.40gb", MIG_A),
        instance("9", "1g.10gb", MIG_B),
    );
    // Each instance's memory, under its parent.
    for (metric, value) in [
        ("gpumem_mig_total_bytes", 40u64 << 30),
        ("gpumem_mig_used_bytes", 3 << 30),
        ("gpumem_mig_free_bytes", 37 << 30),
    ] {
        let series = format!(r#"{metric}{{gpu="0",UUID="GPU-0aaa",{a}}} {value}"#);
        assert!(text.lines().any(|l| l == series), "{series}\n{text}");
    }
    assert!(line(&text, "gpumem_mig_total_bytes", MIG_B).contains(r#"GPU_I_ID="9""#));
    // No instance of the whole GPU.
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("gpumem_mig_") && l.contains("GPU-1aaa"))
    );
    // Processes: by parent, with their instance, named by their pods.
    let me = format!(r#"pid="{}""#, trainer());
    for (pid, labels, pod) in [
        (me.as_str(), &a, "train-0"),
        (r#"pid="4242""#, &b, "infer-b"),
    ] {
        let process = line(&text, "gpumem_process_used_bytes", pid);
        assert!(
            process.contains(r#"gpu="0",UUID="GPU-0aaa""#)
                && process.contains(labels.as_str())
                && process.contains(&format!(r#"pod_name="{pod}""#)),
            "{process}"
        );
        // The push joins: the same gpu, UUID and pid, the same instance.
        let pushed = line(&text, "gpumem_allocator_reserved_bytes", pid);
        assert!(
            pushed.contains(r#"gpu="0",UUID="GPU-0aaa""#) && pushed.contains(labels.as_str()),
            "{pushed}"
        );
    }
    let trainer_pushed = line(&text, "gpumem_allocator_reserved_bytes", &me);
    assert!(
        trainer_pushed.contains(&names("ml", "train-0", "trainer")),
        "{trainer_pushed}"
    );
    // The assignments: by UUID and by index, each to its instance.
    let assigned: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("gpumem_gpu_assigned_info{"))
        .collect();
    assert_eq!(assigned.len(), 2, "{assigned:?}");
    for (labels, pod) in [(&a, "train-0"), (&b, "infer-b")] {
        assert!(
            assigned
                .iter()
                .any(|l| l.contains(r#"gpu="0",UUID="GPU-0aaa""#)
                    && l.contains(&format!(r#"pod_name="{pod}""#))
                    && l.contains(labels.as_str())),
            "{pod}: {assigned:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node as NVIDIA's DRA driver prepares it: GPU 0 in MIG mode (instances 2 and 9), and
/// GPUs whose device minors differ from NVML's indices (index 1 is `/dev/nvidia3`, index 3
/// `/dev/nvidia1`), as the driver names GPUs by minor.
fn dra_node_report() -> ReportReader {
    let mig = |index, uuid, gpu_instance| {
        mig_device(
            (index, uuid),
            gpu_instance,
            ("1g.10gb", 10 << 30),
            0,
            Vec::new(),
        )
    };
    nvml(vec![
        h100(
            0,
            0,
            0,
            Vec::new(),
            vec![mig(0, MIG_A, 2), mig(1, MIG_B, 9)],
        ),
        h100(1, 3, 0, Vec::new(), Vec::new()),
        h100(2, 2, 0, Vec::new(), Vec::new()),
        h100(3, 1, 0, Vec::new(), Vec::new()),
    ])
}

/// A pod whose one container holds one DRA claim of one device.
fn claim_pod(name: &str, claim: &str, driver: &str, device: &str, cdi: &[&str]) -> PodEntry {
    PodEntry {
        name: name.into(),
        namespace: "ml".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: Vec::new(),
            dynamic_resources: vec![DynamicResource {
                claim_name: claim.into(),
                claim_namespace: "ml".into(),
                claim_resources: vec![ClaimResource {
                    cdi_devices: cdi
                        .iter()
                        .map(|n| CdiDevice { name: (*n).into() })
                        .collect(),
                    driver_name: driver.into(),
                    pool_name: "node-a".into(),
                    device_name: device.into(),
                }],
            }],
        }],
    }
}

/// DRA claims on one node beside a device plugin's pod: whole GPUs through the per-claim CDI
/// specs NVIDIA's driver writes (device minor, not NVML's index) or by their `gpu-<minor>`
/// names alone, a MIG device through its capability nodes and `mig-minors`, an unknown
/// driver's device and one naming no GPU of the node by their names; the plugin's pod as
/// before.
#[test]
fn dra_claims_name_their_gpus_and_mig_devices_beside_the_device_plugin() {
    let dir = temp_dir("kubelet-dra");
    let (etc_cdi, run_cdi) = (dir.join("etc-cdi"), dir.join("run-cdi"));
    for d in [&etc_cdi, &run_cdi] {
        std::fs::create_dir_all(d).expect("cdi dir");
    }
    let (whole, small) = (
        "6a1f0c2e-0d8b-4c55-9f1e-3b8f7c2d1e00",
        "c8593c85-440d-4156-b199-aea592ff83df",
    );
    // As the driver writes them: one spec per claim, the devices named after the claim's
    // UID, the common edits (NVIDIA_VISIBLE_DEVICES=void, control nodes) at the spec level.
    let common = "containerEdits:\n  env: [NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64, NVIDIA_VISIBLE_DEVICES=void]\n  deviceNodes:\n  - path: /dev/nvidiactl\n  - path: /dev/nvidia-uvm\n";
    std::fs::write(
        run_cdi.join(format!("k8s.gpu.nvidia.com-claim_{whole}.yaml")),
        format!(
            "cdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices:\n- name: {whole}-gpu-3\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia3\n    - path: /dev/dri/card4\n{common}"
        ),
    )
    .expect("spec");
    std::fs::write(
        run_cdi.join(format!("k8s.gpu.nvidia.com-claim_{small}.yaml")),
        format!(
            "cdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices:\n- name: {small}-gpu-0-mig-1g10gb-19-6\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n    - {{path: /dev/nvidia-caps/nvidia-cap102, type: c, major: 239, minor: 102}}\n    - {{path: /dev/nvidia-caps/nvidia-cap103, type: c, major: 239, minor: 103}}\n{common}"
        ),
    )
    .expect("spec");
    let mig_minors = dir.join("mig-minors");
    std::fs::write(
        &mig_minors,
        "config 1\nmonitor 2\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\ngpu0/gi9/access 102\ngpu0/gi9/ci0/access 103\n",
    )
    .expect("mig-minors");

    let socket = dir.join("kubelet.sock");
    let answer: Answer = Arc::new(Mutex::new(ListPodResourcesResponse {
        pod_resources: vec![
            claim_pod(
                "train-0",
                "train-gpu",
                "gpu.nvidia.com",
                "gpu-3",
                &[&format!("k8s.gpu.nvidia.com/claim={whole}-gpu-3")],
            ),
            claim_pod(
                "infer-b",
                "small-mig",
                "gpu.nvidia.com",
                "gpu-0-mig-1g10gb-19-6",
                &[&format!(
                    "k8s.gpu.nvidia.com/claim={small}-gpu-0-mig-1g10gb-19-6"
                )],
            ),
            // No spec on the node for it: its name alone.
            claim_pod("bare", "plain", "gpu.nvidia.com", "gpu-1", &[]),
            claim_pod(
                "accel",
                "fpga",
                "accel.example.com",
                "accel-0",
                &["example.com/accel=accel-0"],
            ),
            claim_pod("ghost", "gone", "gpu.nvidia.com", "gpu-9", &[]),
            pod("ml", "legacy", "main", &["GPU-2aaa"]),
        ],
    }));
    let resources = PodResources::with_node_files(NodeFiles {
        cdi_dirs: vec![etc_cdi, run_cdi],
        mig_minors,
    });
    let (_kubelet, resources, _runtime) = kubelet_answering_with(&socket, answer, resources);
    let pod_names = log_dirs(&dir.join("log"), &[]);
    pod_names.refresh();
    let agent = named_agent(dra_node_report(), pod_names, Some(resources));
    let text = agent.state.metrics.encode(Format::Text);
    let assigned: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("gpumem_gpu_assigned_info{"))
        .collect();
    assert_eq!(assigned.len(), 6, "{assigned:?}");
    let of = |pod: &str| {
        let needle = format!(r#"pod_name="{pod}""#);
        assigned
            .iter()
            .find(|l| l.contains(&needle))
            .copied()
            .unwrap_or_else(|| panic!("no assignment of {pod}: {assigned:?}"))
    };
    let claim = |name: &str, driver: &str, device: &str| {
        format!(
            r#"claim_namespace="ml",claim_name="{name}",dra_driver="{driver}",dra_pool="node-a",dra_device="{device}""#
        )
    };
    // The whole GPU by its spec's /dev/nvidia3: NVML's index 1, not 3.
    let train = of("train-0");
    assert!(
        train.starts_with(r#"gpumem_gpu_assigned_info{gpu="1",UUID="GPU-1aaa","#)
            && train.contains(&claim("train-gpu", "gpu.nvidia.com", "gpu-3")),
        "{train}"
    );
    // The MIG device by its compute instance's capability node: instance 9, MIG_B.
    let infer = of("infer-b");
    assert!(
        infer.starts_with(r#"gpumem_gpu_assigned_info{gpu="0",UUID="GPU-0aaa","#)
            && infer.contains(&format!(
                r#"GPU_I_ID="9",GPU_I_PROFILE="1g.10gb",mig_uuid="{MIG_B}""#
            ))
            && infer.contains(&claim(
                "small-mig",
                "gpu.nvidia.com",
                "gpu-0-mig-1g10gb-19-6"
            )),
        "{infer}"
    );
    assert!(!assigned.iter().any(|l| l.contains(MIG_A)), "{assigned:?}");
    // By name alone: gpu-1 is minor 1, NVML's index 3.
    assert!(
        of("bare").starts_with(r#"gpumem_gpu_assigned_info{gpu="3",UUID="GPU-3aaa","#),
        "{}",
        of("bare")
    );
    // Unresolved, and resolved to no GPU of the node: by their names.
    for (pod, name, driver, device) in [
        ("accel", "fpga", "accel.example.com", "accel-0"),
        ("ghost", "gone", "gpu.nvidia.com", "gpu-9"),
    ] {
        let line = of(pod);
        assert!(
            line.starts_with(r#"gpumem_gpu_assigned_info{gpu="",UUID="","#)
                && line.contains(&claim(name, driver, device)),
            "{line}"
        );
    }
    // The device plugin's pod: the same series as before DRA (Prometheus drops labels
    // whose value is empty).
    let legacy: Vec<&str> = of("legacy")
        .trim_start_matches("gpumem_gpu_assigned_info{")
        .split(',')
        .filter(|l| !l.contains(r#"="""#))
        .collect();
    assert_eq!(
        legacy.join(","),
        r#"gpu="2",UUID="GPU-2aaa",pod_namespace="ml",pod_name="legacy",container_name="main""#,
        "{}",
        of("legacy")
    );
    assert!(of("legacy").ends_with(" 1"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A recording uploaded over the socket by a process in a pod is listed with the pod's names
/// from the kubelet's log directories (the upload itself names only the pod's UID).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recordings_are_listed_with_their_pods_names() {
    use axum::extract::ConnectInfo;
    use gpumem::ingest::{RecordingLimits, RecordingStore};
    use gpumem::server::UnixPeer;
    use std::io::Write;

    let dir = temp_dir("kubelet-recordings");
    let pod_names = log_dirs(&dir.join("log"), &[("ml", "train-0", "trainer", TRAIN_UID)]);
    pod_names.refresh();
    let agent = named_agent(node_report(), pod_names, None);
    let store = agent.ingest().cloned().expect("ingest");
    let kept = RecordingStore::open(dir.join("store"), RecordingLimits::default()).expect("opens");
    store.keep_recordings(Arc::new(kept));
    let push = serde_json::json!({
        "pid": 1, "seq": 1,
        "devices": [{"index": 0, "uuid": "GPU-0aaa", "stats": {"reserved_bytes.all.current": 1024}}],
    });
    store
        .push_from(push.to_string().as_bytes(), Some(Peer::now(trainer())))
        .expect("accepted");
    let json = crate::explain::recorded_json(900 << 20, 0, |a| {
        crate::explain::fragment(a);
    });
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&json).expect("compresses");
    let body = gz.finish().expect("compresses");
    let router = agent.router();
    let mut upload = http::Request::post("/api/v1/recordings")
        .header("host", "127.0.0.1")
        .header("content-type", "application/gzip")
        .header("content-length", body.len())
        .body(axum::body::Body::from(body))
        .expect("request");
    upload
        .extensions_mut()
        .insert(ConnectInfo(UnixPeer::without_handle(Some(Peer::now(
            trainer(),
        )))));
    let (status, _, answer) = crate::agent::respond(&router, upload).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&answer));
    // The upload knows the pod's UID and container ID only.
    let stored: serde_json::Value = serde_json::from_slice(&answer).expect("JSON");
    assert_eq!(
        (stored["pod_uid"].as_str(), stored["pod_name"].as_str()),
        (Some(TRAIN_UID), Some(""))
    );
    let list = http::Request::get("/api/v1/recordings")
        .header("host", "127.0.0.1")
        .body(axum::body::Body::empty())
        .expect("request");
    let (status, _, listed) = crate::agent::respond(&router, list).await;
    assert_eq!(status, 200);
    let listed: serde_json::Value = serde_json::from_slice(&listed).expect("JSON");
    let names = (
        listed[0]["pod_namespace"].as_str(),
        listed[0]["pod_name"].as_str(),
        listed[0]["container_name"].as_str(),
    );
    assert_eq!(
        names,
        (Some("ml"), Some("train-0"), Some("trainer")),
        "{listed}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
