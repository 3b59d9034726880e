//! `gpumem demo` and `gpumem serve`: the node agent, on a simulated node or on real GPUs.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::builder::ValueParser;
use gpumem::AllocatorConfig;
use gpumem::agent::{Agent, KubeletWatch, Listen};
use gpumem::archive::uploader::Uploads;
use gpumem::archive::{Archive, Credentials};
use gpumem::demo::{SimNode, SimNodeConfig};
use gpumem::ingest::{IngestConfig, RecordingLimits, RecordingStore};
use gpumem::metrics::ReportReader;
use gpumem::server::HttpLimits;
use gpumem::server::web_config::WebConfig;
use gpumem::sources::AllocatorSources;
use gpumem::telemetry::dra::NodeFiles;
use gpumem::telemetry::pod_network::PodNetwork;
use gpumem::telemetry::{NvmlSource, Poller};
use gpumem::telemetry::{cdi, nvidia_caps, pod_resources};

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
    /// Directories of the node's CDI specs, in increasing priority (comma-separated; an empty
    /// value reads none): they resolve devices assigned through DRA claims to their GPUs and
    /// MIG devices.
    #[arg(long, value_delimiter = ',', default_values = cdi::DEFAULT_SPEC_DIRS)]
    cdi_spec_dirs: Vec<PathBuf>,
    /// The NVIDIA driver's MIG capability minors, which resolve a DRA claim's MIG device.
    #[arg(long, default_value = nvidia_caps::DEFAULT_PATH)]
    mig_minors: PathBuf,
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
    /// Archive each kept recording, with a JSON sidecar, in object storage: s3://bucket/prefix
    /// (S3 or an S3-compatible store at AWS_ENDPOINT_URL), gs://, az:// or file://; a prefix
    /// segment {namespace} stands for each recording's namespace. Credentials come from the
    /// environment (workload identity, or a Secret's variables). Needs --recordings-dir, the
    /// spool: nothing leaves it before it is archived, but by its caps.
    #[arg(long, value_name = "URL", requires = "recordings_dir")]
    recordings_url: Option<gpumem::archive::ArchiveUrl>,
    /// The cluster's name, under which this agent files the recordings it archives and its
    /// view finds archived ones (the same for every agent of the cluster).
    #[arg(long, default_value = "default", value_parser = parse_segment)]
    cluster: String,
    /// This node's name, under which recordings of processes in no known pod are archived
    /// (the chart passes spec.nodeName). Default: the host's name.
    #[arg(long, value_parser = parse_segment)]
    node_name: Option<String>,
    /// Seconds the archiving goes on after the stop signal (SIGTERM), for recordings not yet
    /// archived; keep the pod's termination grace period longer than this plus
    /// --shutdown-timeout.
    #[arg(long, default_value_t = 20.0, value_parser = parse_grace)]
    recordings_upload_grace: f64,
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

/// A name that may be a segment of an archived recording's key (a cluster's, a node's).
fn parse_segment(text: &str) -> Result<String, String> {
    if gpumem::archive::address::valid_segment(text) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not 1 to 253 letters, digits, '-', '_' and '.'"
        ))
    }
}

/// The host's name, as the kernel has it.
fn host_name() -> Result<String, String> {
    let name = gpumem::bounded_file::read(Path::new("/proc/sys/kernel/hostname"), 256)
        .map_err(|e| format!("the host's name (give --node-name): {e}"))?;
    parse_segment(name.trim()).map_err(|e| format!("the host's name (give --node-name): {e}"))
}

fn parse_timeout(text: &str) -> Result<f64, String> {
    number_in(text, 0.05, 3600.0, "a timeout", Some("seconds"))
}

fn parse_grace(text: &str) -> Result<f64, String> {
    number_in(text, 0.0, 86_400.0, "the grace period", Some("seconds"))
}

/// How long the container runtime has to answer one call.
const CRI_TIMEOUT: Duration = Duration::from_secs(2);

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

pub(crate) fn serve_command(args: ServeArgs) -> CliResult {
    let poller = Poller::start(
        Box::new(NvmlSource::new()),
        Duration::from_secs_f64(args.interval),
    );
    let reader: ReportReader = Box::new(poller.reader());
    let watch = KubeletWatch::new(
        args.pod_resources_socket.into(),
        Path::new(&args.kubelet_logs),
        NodeFiles {
            cdi_dirs: (args.cdi_spec_dirs.into_iter())
                .filter(|d| !d.as_os_str().is_empty())
                .collect(),
            mig_minors: args.mig_minors,
        },
        Duration::from_secs_f64(args.interval),
    );
    let ingest = IngestConfig {
        exited_grace: Duration::from_secs_f64(args.exited_grace),
        max_tcp_series: args.max_tcp_series as usize,
        max_pod_processes: args.max_pod_processes as usize,
        ..IngestConfig::default()
    };
    let mut agent = Agent::watching(AllocatorSources::default(), vec![reader], ingest, watch)?;
    let web = match &args.web_config_file {
        Some(path) => WebConfig::load(path)?,
        None => WebConfig::default(),
    };
    if let (Some(dir), Some(store)) = (args.recordings_dir, agent.ingest()) {
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
        let recordings = Arc::new(recordings);
        store.keep_recordings(Arc::clone(&recordings));
        if let Some(url) = args.recordings_url {
            let node = match args.node_name {
                Some(node) => node,
                None => host_name()?,
            };
            let archive = Archive::open(url.clone(), Credentials::Environment)
                .map_err(|e| format!("--recordings-url {url}: {e}"))?;
            let uploads = Uploads::new(archive, recordings, args.cluster, node)
                .map_err(|e| format!("--recordings-url {url}: {e}"))?;
            tracing::info!(%url, cluster = uploads.cluster(), "kept recordings are archived");
            let grace = Duration::from_secs_f64(args.recordings_upload_grace);
            agent.archive(uploads, grace);
        }
    }
    agent.watch(poller.heartbeat());
    let state = &mut agent.state;
    state.auth = web.auth;
    state.body_timeout = Duration::from_secs_f64(args.http.body_timeout);
    state.ui = args.http.ui.serves(args.listen, state.authenticates());
    state.hosts = gpumem::server::hosts::AgentHosts::new(&args.http.allow_host);
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
    agent.run_until_signalled(listen)?;
    Ok(ExitCode::SUCCESS)
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
    let mut agent = Agent::simulated(
        &node,
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
    )?;
    if let Some(store) = agent.ingest() {
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
    // directory of its own, and archived beside it as into a bucket (file://), removed at
    // exit.
    let recordings = DemoRecordings::make()?;
    if let Some(store) = agent.ingest() {
        let kept = Arc::new(RecordingStore::open(
            recordings.0.join("spool"),
            RecordingLimits::default(),
        )?);
        store.keep_recordings(Arc::clone(&kept));
        let archived = format!("file://{}", recordings.0.join("archive").display());
        let uploads = archived
            .parse::<gpumem::archive::ArchiveUrl>()
            .and_then(|url| Archive::open(url, Credentials::Environment).map_err(|e| e.to_string()))
            .and_then(|archive| Uploads::new(archive, kept, "demo".into(), "demo-node".into()));
        match uploads {
            Ok(uploads) => agent.archive(uploads, Duration::from_secs(2)),
            Err(e) => tracing::warn!(error = %e, "the demo archives no recordings"),
        }
    }
    let state = &mut agent.state;
    state.body_timeout = Duration::from_secs_f64(args.http.body_timeout);
    state.ui = args.http.ui.serves(args.listen, false);
    state.hosts = gpumem::server::hosts::AgentHosts::new(&args.http.allow_host);
    let listen = Listen {
        limits: args.http.limits(),
        ..Listen::on(args.listen)
    };
    let result = agent.run_until_signalled(listen);
    drop(node);
    result?;
    Ok(ExitCode::SUCCESS)
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
