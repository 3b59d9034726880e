//! `gpumem demo` and `gpumem serve`: the node agent, on a simulated node or on real GPUs.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::builder::ValueParser;
use gpumem::AllocatorConfig;
use gpumem::demo::{SimNode, SimNodeConfig};
use gpumem::ingest::{IngestConfig, RecordingLimits, RecordingStore};
use gpumem::metrics::ReportReader;
use gpumem::server::web_config::WebConfig;
use gpumem::server::{
    AppState, HttpLimits, agent_state, app, bind, bind_unix, push_app, serve, serve_tls,
    serve_unix, shutdown_signal,
};
use gpumem::sources::AllocatorSources;
use gpumem::telemetry::Kubelet;
use gpumem::telemetry::pod_names::PodNames;
use gpumem::telemetry::pod_network::PodNetwork;
use gpumem::telemetry::pod_resources::{self, PodResources};
use gpumem::telemetry::{Heartbeat, NvmlSource, Poller};

use super::{CliResult, parse_bytes};

/// The agent's port: clear of DCGM (9400), node_exporter (9100) and the other GPU exporters.
const DEFAULT_LISTEN: &str = "127.0.0.1:9417";
/// Where jobs on the node push their statistics (the chart shares this directory with them).
const DEFAULT_PUSH_SOCKET: &str = "/run/gpumem/push.sock";

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to serve /metrics on (the chart sets 0.0.0.0:9417).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// Seconds between NVML polls.
    #[arg(long, default_value_t = 5.0, value_parser = parse_interval)]
    interval: f64,
    /// Unix socket for pushes from jobs on this node, attributed to the connecting pid;
    /// an empty value turns it off (pushes are still accepted from loopback).
    #[arg(long, default_value = DEFAULT_PUSH_SOCKET, value_parser = ValueParser::os_string())]
    push_socket: OsString,
    /// The kubelet's pod-resources socket, asked which containers each GPU is assigned to;
    /// skipped where its directory does not exist, an empty value turns it off.
    #[arg(long, default_value = pod_resources::DEFAULT_SOCKET, value_parser = ValueParser::os_string())]
    pod_resources_socket: OsString,
    /// The node's log directory, whose `pods/` and `containers/` entries name the pods and
    /// containers of processes; skipped where `pods/` does not exist, an empty value turns it
    /// off.
    #[arg(long, default_value = "/var/log", value_parser = ValueParser::os_string())]
    kubelet_logs: OsString,
    /// Seconds a pushing process's last series stay after it exits or falls silent (keep it
    /// at least two scrape intervals, so that a job that dies of an OOM is still scraped).
    #[arg(long, default_value_t = 120.0, value_parser = parse_grace)]
    exited_grace: f64,
    /// Pushed series that processes pushing over TCP may hold together (each a quarter of
    /// it), of the 10 000 the agent serves: the rest is kept for pushes over the socket.
    #[arg(long, default_value_t = 2_500, value_parser = clap::value_parser!(u32).range(4..=10_000))]
    max_tcp_series: u32,
    /// The container runtime's CRI socket (containerd's /run/containerd/containerd.sock,
    /// CRI-O's /var/run/crio/crio.sock): pushes from pods on this node are then accepted over
    /// TCP and attributed to their pod by the connection's address. Off by default: whoever
    /// holds this socket holds the node.
    #[arg(long, value_name = "SOCKET", value_parser = ValueParser::os_string())]
    cri_socket: Option<OsString>,
    /// An address of this node (repeatable; the chart passes the pod's status.hostIP): a push
    /// from it names no pod and is refused (`peer_is_node`).
    #[arg(long = "node-ip", value_name = "IP")]
    node_ip: Vec<std::net::IpAddr>,
    /// Processes of one pod that may push from the pod network at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    max_pod_processes: u32,
    /// Keep the recordings jobs upload at an OOM (POST /api/v1/recordings) in this directory
    /// (created if missing; never the push socket's RAM-backed one). Off when not given.
    #[arg(long, value_name = "DIR")]
    recordings_dir: Option<PathBuf>,
    /// The largest recording accepted, as sent (gzipped).
    #[arg(long, default_value_t = RecordingLimits::default().max_bytes_each, value_parser = clap::value_parser!(u64).range(1024..=(4 << 30)))]
    recordings_max_bytes_each: u64,
    /// Bytes of all recordings kept; the oldest are evicted.
    #[arg(long, default_value_t = RecordingLimits::default().max_bytes, value_parser = clap::value_parser!(u64).range(1024..=(1 << 40)))]
    recordings_max_bytes: u64,
    /// Recordings kept; the oldest are evicted.
    #[arg(long, default_value_t = RecordingLimits::default().max_count as u32, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    recordings_max_count: u32,
    /// Memory the agent may hold while reading one upload (one at a time); the view of a
    /// kept recording (/recordings/<id>/) holds one recording read within it and runs one
    /// replay at a time within it.
    #[arg(long, default_value_t = RecordingLimits::default().read.max_memory_bytes, value_parser = clap::value_parser!(u64).range((1 << 20)..=(64 << 30)))]
    recordings_max_memory_bytes: u64,
    /// A web configuration file in the Prometheus exporter-toolkit's format: TLS
    /// (tls_server_config, the certificate re-read when it changes) and authentication (basic
    /// with basic_auth_users, bcrypt hashes; bearer with gpumem's bearer_auth_tokens_file) for
    /// /metrics, the page and its APIs; pushes and probes need no credentials.
    #[arg(long, value_name = "FILE")]
    web_config_file: Option<PathBuf>,
    /// Also take pushes, and only pushes, over plain HTTP on this address (for jobs on the pod
    /// network where --listen serves TLS).
    #[arg(long, value_name = "ADDRESS")]
    push_listen: Option<SocketAddr>,
    /// Seconds to wait for another agent still answering on the push socket to go before
    /// taking the socket over (an update that starts the new agent before stopping the old,
    /// or a second agent started by mistake).
    #[arg(long, default_value_t = 30.0, value_parser = parse_grace)]
    socket_wait: f64,
    #[command(flatten)]
    http: HttpArgs,
}

/// The HTTP limits (see `gpumem::server::HttpLimits`).
#[derive(clap::Args)]
pub(crate) struct HttpArgs {
    /// Seconds a client has to send a request's headers, from connecting or from the
    /// previous response (idle keep-alive connections close after it).
    #[arg(long, default_value_t = 10.0, value_parser = parse_timeout)]
    header_timeout: f64,
    /// Seconds a push's body has to arrive.
    #[arg(long, default_value_t = 10.0, value_parser = parse_timeout)]
    body_timeout: f64,
    /// Seconds a client may leave a response unread before its connection is closed.
    #[arg(long, default_value_t = 10.0, value_parser = parse_timeout)]
    send_timeout: f64,
    /// Connections served at once, per listener; a new one is always accepted, closing the
    /// one that read or wrote nothing for the longest.
    #[arg(long, default_value_t = 384, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_connections: u32,
    /// Seconds given to the requests in flight at shutdown.
    #[arg(long, default_value_t = 5.0, value_parser = parse_timeout)]
    shutdown_timeout: f64,
    /// The live page at / and its APIs (/api/v1/node, /api/v1/segments), which show pids, pod
    /// names and configurations: `auto` serves them where the agent listens on loopback only
    /// or asks for credentials (--web-config-file with users or tokens), `on` or `off`.
    #[arg(long, value_enum, default_value_t = Ui::Auto)]
    ui: Ui,
    /// A DNS name the agent also answers to (repeatable), for example its Service's when
    /// Prometheus scrapes through it; IP addresses and the loopback names always are.
    /// Requests naming anything else (DNS rebinding) get 421.
    #[arg(long = "allow-host", value_name = "NAME", value_parser = parse_host_name)]
    allow_host: Vec<String>,
}

/// Whether the agent serves its page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Ui {
    Auto,
    On,
    Off,
}

impl Ui {
    /// Whether the page is served by an agent on `listen`, authenticating or not.
    fn serves(self, listen: SocketAddr, authenticates: bool) -> bool {
        match self {
            Ui::On => true,
            Ui::Off => false,
            Ui::Auto => listen.ip().is_loopback() || authenticates,
        }
    }
}

impl HttpArgs {
    fn limits(&self) -> HttpLimits {
        HttpLimits {
            header_timeout: Duration::from_secs_f64(self.header_timeout),
            send_timeout: Duration::from_secs_f64(self.send_timeout),
            max_connections: self.max_connections as usize,
            shutdown_timeout: Duration::from_secs_f64(self.shutdown_timeout),
        }
    }
}

/// A DNS name as `Host` carries it: letters, digits, `-` and `.`, no port, no trailing dot.
fn parse_host_name(text: &str) -> Result<String, String> {
    let ok = !text.is_empty()
        && text.len() <= 253
        && !text.starts_with('.')
        && !text.ends_with('.')
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if ok {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not a DNS name (letters, digits, '-' and '.'; no port, no trailing dot)"
        ))
    }
}

fn parse_timeout(text: &str) -> Result<f64, String> {
    number_in(text, 0.05, 3600.0, "a timeout", Some("seconds"))
}

fn parse_grace(text: &str) -> Result<f64, String> {
    number_in(text, 0.0, 86_400.0, "the grace period", Some("seconds"))
}

/// How long the container runtime has to answer one call.
const CRI_TIMEOUT: Duration = Duration::from_secs(2);

/// How often ended pushing processes are looked for.
const EXPIRY_TICK: Duration = Duration::from_secs(1);

/// The least time between two questions to the kubelet (its pod-resources API is
/// rate-limited), whatever the polling interval.
const KUBELET_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// What the agent asks the kubelet, and how often (on the agent's runtime).
struct KubeletWatch {
    kubelet: Kubelet,
    socket: PathBuf,
    interval: Duration,
    heartbeat: Heartbeat,
}

impl KubeletWatch {
    /// The parts of the kubelet this node has: on a Kubernetes node its directories exist
    /// (even while the kubelet restarts); elsewhere there is nothing to report down.
    fn new(socket: PathBuf, logs: PathBuf, interval: f64) -> KubeletWatch {
        let present = |path: &Path| !path.as_os_str().is_empty() && path.is_dir();
        // An empty path turns a part off (joined, it would name a relative directory).
        let names = (present(&logs) && present(&logs.join("pods")))
            .then(|| PodNames::new(logs.join("pods"), logs.join("containers")));
        let resources = socket
            .parent()
            .is_some_and(|dir| !socket.as_os_str().is_empty() && present(dir))
            .then(PodResources::new);
        if names.is_none() && resources.is_none() {
            tracing::info!("not a Kubernetes node: pods are named by UID only");
        }
        let interval = Duration::from_secs_f64(interval).max(KUBELET_MIN_INTERVAL);
        KubeletWatch {
            kubelet: Kubelet { names, resources },
            socket,
            interval,
            heartbeat: Heartbeat::new("kubelet", Heartbeat::allowance_for(interval)),
        }
    }

    /// Refreshes what the kubelet says every interval, forever.
    async fn run(self) {
        let timeout = self.interval.min(Duration::from_secs(5));
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if let Some(names) = &self.kubelet.names {
                // Listing two directories takes well under a millisecond.
                names.refresh();
            }
            if let Some(resources) = &self.kubelet.resources {
                resources.refresh(&self.socket, timeout).await;
            }
            self.heartbeat.beat();
        }
    }
}

#[derive(clap::Args)]
pub(crate) struct DemoArgs {
    /// Address to serve /metrics on.
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// Seconds between two steps of the simulated processes' replay.
    #[arg(long, default_value_t = 0.1, value_parser = parse_interval)]
    interval: f64,
    /// Simulated GPUs.
    #[arg(long, default_value_t = 2)]
    gpus: u32,
    /// Memory per simulated GPU (bytes, or with a KiB/MiB/GiB suffix).
    #[arg(long, default_value = "80GiB", value_parser = parse_bytes)]
    capacity: u64,
    /// Simulated processes per GPU, each replaying a recorded training or inference trace.
    #[arg(long, default_value_t = 3)]
    processes_per_gpu: u32,
    /// Replay speed relative to the recordings' own pace; 0 holds each simulated process where
    /// its recording reserved the most (a still picture, for screenshots and tests).
    #[arg(long, default_value_t = 1.0, value_parser = parse_speed)]
    speed: f64,
    /// Allocator settings of the simulated processes (PYTORCH_CUDA_ALLOC_CONF syntax).
    #[arg(long, default_value = "")]
    config: String,
    #[command(flatten)]
    http: HttpArgs,
}

fn parse_speed(text: &str) -> Result<f64, String> {
    match number_in(text, 0.0, 10_000.0, "the speed", None)? {
        s if s > 0.0 && s < 0.001 => Err(format!(
            "the speed is 0 (held) or between 0.001 and 10000, not {text}"
        )),
        s => Ok(s),
    }
}

fn parse_interval(text: &str) -> Result<f64, String> {
    number_in(text, 0.01, 3600.0, "the interval", Some("seconds"))
}

/// `text` as a number in `[low, high]` (NaN and infinities are not), in `unit` where it has
/// one, or why not.
fn number_in(
    text: &str,
    low: f64,
    high: f64,
    what: &str,
    unit: Option<&str>,
) -> Result<f64, String> {
    let (of, unit) = unit.map_or((String::new(), String::new()), |u| {
        (format!(" of {u}"), format!(" {u}"))
    });
    let value: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number{of}"))?;
    if !(low..=high).contains(&value) {
        return Err(format!("{what} must be between {low} and {high}{unit}"));
    }
    Ok(value)
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    // One thread: scrapes are short and serial, and the agent should stay small on a GPU
    // node (sources are polled on threads of their own).
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// Where and how the agent serves.
struct Listen {
    address: SocketAddr,
    /// TLS on `address`, where configured.
    tls: Option<Arc<rustls::ServerConfig>>,
    /// A plain-HTTP listener for pushes only.
    push_address: Option<SocketAddr>,
    push_socket: Option<PathBuf>,
    socket_wait: Duration,
    limits: HttpLimits,
}

fn run_server(listen: Listen, kubelet: Option<KubeletWatch>, state: AppState) -> CliResult {
    runtime()?.block_on(async move {
        if let Some(watch) = kubelet {
            tokio::spawn(watch.run());
        }
        if let Some(store) = state.ingest.clone() {
            // Ended processes go on the agent's own tick, whether or not anyone scrapes.
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(EXPIRY_TICK);
                loop {
                    ticks.tick().await;
                    store.expire();
                }
            });
        }
        let listener = bind(listen.address).await?;
        let push_listener = match listen.push_address {
            Some(address) => Some(bind(address).await?),
            None => None,
        };
        let push_router = push_app(state.clone());
        let router = app(state);
        // The socket is optional: without it, pushes still come over loopback.
        let unix = match listen.push_socket {
            Some(path) => match bind_unix(&path, listen.socket_wait).await {
                Ok(listener) => Some(listener),
                Err(e) => {
                    tracing::warn!(error = %e, "no push socket");
                    eprintln!("gpumem: warning: {e}; pushes are accepted from loopback only");
                    None
                }
            },
            None => None,
        };
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let signal = async move {
            shutdown_signal().await;
            let _ = stop.send(true);
        };
        let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|&stopped| stopped).await;
        };
        tokio::spawn(signal);
        let limits = listen.limits;
        let tcp = async {
            match listen.tls {
                Some(tls) => {
                    serve_tls(
                        listener,
                        tls,
                        router.clone(),
                        limits,
                        until_stopped(stopped.clone()),
                    )
                    .await;
                }
                None => {
                    serve(
                        listener,
                        router.clone(),
                        limits,
                        until_stopped(stopped.clone()),
                    )
                    .await;
                }
            }
        };
        let pushes = async {
            if let Some(listener) = push_listener {
                serve(
                    listener,
                    push_router.clone(),
                    limits,
                    until_stopped(stopped.clone()),
                )
                .await;
            }
        };
        // Pods that mount the socket are tenants, not scrapers: it takes pushes, uploads and
        // probes only, never /metrics or the page (every tenant's pods and labels).
        let socket = async {
            if let Some(listener) = unix {
                serve_unix(
                    listener,
                    push_router.clone(),
                    limits,
                    until_stopped(stopped.clone()),
                )
                .await;
            }
        };
        tokio::join!(tcp, pushes, socket);
        Ok::<(), std::io::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn serve_command(args: ServeArgs) -> CliResult {
    let poller = Poller::start(
        Box::new(NvmlSource::new()),
        Duration::from_secs_f64(args.interval),
    );
    let reader: ReportReader = Box::new(poller.reader());
    let watch = KubeletWatch::new(
        args.pod_resources_socket.into(),
        args.kubelet_logs.into(),
        args.interval,
    );
    let ingest = IngestConfig {
        exited_grace: Duration::from_secs_f64(args.exited_grace),
        max_tcp_series: args.max_tcp_series as usize,
        max_pod_processes: args.max_pod_processes as usize,
        ..IngestConfig::default()
    };
    let mut state = agent_state(
        AllocatorSources::default(),
        vec![reader],
        ingest,
        watch.kubelet.clone(),
    )?;
    let web = match &args.web_config_file {
        Some(path) => WebConfig::load(path)?,
        None => WebConfig::default(),
    };
    state.auth = web.auth;
    if let (Some(dir), Some(store)) = (args.recordings_dir, &state.ingest) {
        let defaults = RecordingLimits::default();
        let limits = RecordingLimits {
            max_bytes_each: args.recordings_max_bytes_each,
            max_bytes: args.recordings_max_bytes,
            max_count: args.recordings_max_count as usize,
            read: gpumem::recording::ReadLimits {
                max_memory_bytes: args.recordings_max_memory_bytes,
                ..defaults.read
            },
        };
        let recordings = RecordingStore::open(dir.clone(), limits)
            .map_err(|e| format!("--recordings-dir {}: {e}", dir.display()))?;
        tracing::info!(dir = ?dir, kept = recordings.list().len(), "recordings uploaded at an OOM are kept");
        store.keep_recordings(Arc::new(recordings));
    }
    state.body_timeout = Duration::from_secs_f64(args.http.body_timeout);
    state.ui = args.http.ui.serves(args.listen, state.authenticates());
    state.hosts = gpumem::server::hosts::AgentHosts::new(&args.http.allow_host);
    state.health.watch(poller.heartbeat());
    state.health.watch(watch.heartbeat.clone());
    // An empty value turns it off, as for the other sockets.
    state.pod_network = args
        .cri_socket
        .filter(|socket| !socket.is_empty())
        .map(|socket| {
            tracing::info!(socket = ?socket, "pushes from the pod network are attributed through the container runtime");
            Arc::new(PodNetwork::new(socket.into(), args.node_ip, CRI_TIMEOUT))
        });
    let listen = Listen {
        address: args.listen,
        tls: web.tls.map(|tls| tls.server_config("agent")).transpose()?,
        push_address: args.push_listen,
        // Empty turns a socket off (clap's path parser would refuse an empty value).
        push_socket: Some(PathBuf::from(args.push_socket)).filter(|p| !p.as_os_str().is_empty()),
        socket_wait: Duration::from_secs_f64(args.socket_wait),
        limits: args.http.limits(),
    };
    run_server(listen, Some(watch), state)
}

/// The demo's recordings directory, removed when the demo ends.
struct DemoRecordings(PathBuf);

impl DemoRecordings {
    /// A new directory of its own under the temporary directory (only its user's: never one
    /// that exists already, which another user could have put there).
    fn make() -> std::io::Result<DemoRecordings> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "gpumem-demo-recordings-{}-{nanos:x}",
            std::process::id()
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(DemoRecordings(dir))
    }
}

impl Drop for DemoRecordings {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn demo_command(args: DemoArgs) -> CliResult {
    let node = SimNode::start(SimNodeConfig {
        gpus: args.gpus,
        capacity: args.capacity,
        processes_per_gpu: args.processes_per_gpu,
        speed: args.speed,
        tick: Duration::from_secs_f64(args.interval),
        config: AllocatorConfig::parse(&args.config)?,
        ..SimNodeConfig::default()
    })?;
    tracing::info!(
        gpus = args.gpus,
        processes_per_gpu = args.processes_per_gpu,
        "simulated node replaying recorded traces"
    );
    let reader: ReportReader = Box::new(node.report_reader());
    let mut state = agent_state(
        AllocatorSources::new(node.allocator_sources()),
        vec![reader],
        IngestConfig {
            // The simulated job that pushes is in its simulated pod.
            resolve: |pid| {
                gpumem::demo::node::pushed_container(pid)
                    .or_else(|| gpumem::telemetry::cgroup::container_of(pid))
            },
            // It started with the node (and does not exist on this host).
            start_time: |pid| match gpumem::demo::node::pushed_container(pid) {
                Some(_) => Some(0),
                None => gpumem::telemetry::process::start_time(pid),
            },
            ..IngestConfig::default()
        },
        node.kubelet(),
    )?;
    if let Some(store) = &state.ingest {
        // As over the push socket: the kernel would name the pid.
        let store = Arc::clone(store);
        node.push_to(move |pid, body| {
            // Its pods started with the node: their start time is 0 (above).
            let peer = gpumem::ingest::store::Peer {
                pid,
                start_time: Some(0),
                uid: None,
            };
            if let Err(e) = store.push_from(body, Some(peer)) {
                tracing::warn!(error = %e.message, "the simulated job's push was refused");
            }
        });
    }
    // Jobs pushing to the demo from this host may upload their recordings too: kept in a
    // directory of its own, removed at exit.
    let recordings = DemoRecordings::make()?;
    if let Some(store) = &state.ingest {
        let kept = RecordingStore::open(recordings.0.clone(), RecordingLimits::default())?;
        store.keep_recordings(Arc::new(kept));
    }
    state.body_timeout = Duration::from_secs_f64(args.http.body_timeout);
    state.ui = args.http.ui.serves(args.listen, false);
    state.hosts = gpumem::server::hosts::AgentHosts::new(&args.http.allow_host);
    state.health.watch(node.heartbeat());
    let listen = Listen {
        address: args.listen,
        tls: None,
        push_address: None,
        push_socket: None,
        socket_wait: Duration::ZERO,
        limits: args.http.limits(),
    };
    let result = run_server(listen, None, state);
    drop(node);
    result
}

#[cfg(test)]
mod ui_tests {
    use super::Ui;

    /// The page shows pids, pod names and configurations: by default only on loopback or
    /// behind credentials.
    #[test]
    fn the_page_is_off_beyond_loopback_without_credentials() {
        let loopback = "127.0.0.1:9417".parse().expect("address");
        let everywhere = "0.0.0.0:9417".parse().expect("address");
        let v6 = "[::1]:9417".parse().expect("address");
        assert!(Ui::Auto.serves(loopback, false));
        assert!(Ui::Auto.serves(v6, false));
        assert!(!Ui::Auto.serves(everywhere, false));
        assert!(Ui::Auto.serves(everywhere, true));
        assert!(Ui::On.serves(everywhere, false));
        assert!(!Ui::Off.serves(loopback, true));
    }
}
