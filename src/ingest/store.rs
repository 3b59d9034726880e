//! The pushed processes: who they are, what they last said, and for how long it is served.
//!
//! A process is known by its pid and, where the kernel named it (a Unix-socket push), by its
//! start time from `/proc/<pid>/stat`: a new process that reuses a dead one's pid starts
//! afresh. Its series are published as [`AllocatorSource`]s of kind
//! [`AllocatorKind::Pytorch`], so the one collector serves them under the metric contract.
//!
//! # Lifecycle
//! A process is *live* until it is seen to end: its pid vanishes from `/proc` or changes
//! start time (kernel-named pids only: a payload's own pid may be another pid namespace's and
//! is never looked up), it sends its `"exit"` push, or it stays silent for `ttl`. Its last
//! series then stay for `exited_grace` (keep it at least two scrape intervals, so a job that
//! dies of an OOM is still scraped with its OOM), and go. A push that the kernel did not
//! attribute is known by its pid and the start time it gives, exactly, so two containers'
//! pid 1 do not merge into one process: while one is live the other is refused (`conflict`:
//! push over the socket instead), and a push without a start time is no job that gave one.
//! That word is unauthenticated (a local user can read a host job's start time in `/proc`):
//! loopback is for hosts without the socket, and its series and recordings are told apart
//! (the recordings' `loopback` tenant). Expiry runs on the agent's own tick
//! ([`PushStore::expire`]), not inside a scrape.
//!
//! # Invariants (budgets)
//! - At most `max_processes` processes are kept, live and ended together, of which at most
//!   `max_tcp_processes` pushed over TCP (so invented TCP pids cannot lock out socket
//!   pushers); their series together stay within `max_series`, the per-pod OOM counters
//!   included. Processes pushing over TCP hold at most `max_tcp_series` of them together
//!   and a quarter of that each, so the rest is always the socket pushers' (a job's first
//!   push, its OOM push) whatever TCP pushers invent. Processes of pods pushing from the pod
//!   network hold at most `max_pod_processes` and `max_pod_series` per pod and
//!   `max_pod_network_processes` and `max_pod_network_series` together (half the budget), so
//!   however many pods push, the socket's jobs keep the rest. When a cap is reached, ended
//!   processes are evicted first, oldest first; only then is a push refused.
//! - A pid the kernel attributed to a socket pusher is never written over TCP.
//! - Sequence numbers of a process only grow, by at most [`MAX_SEQ_JUMP`] a push.
//! - A process pushes at most once per `min_interval`, except its `"oom"` and `"exit"`
//!   pushes, which must get through: a token bucket of [`MAX_REASON_PUSHES`] such pushes
//!   past the limit, one given back every [`REASON_REFILL`].
//! - Per-pod OOM counters never decrease; one is dropped `oom_retention` after its last OOM,
//!   and at most `max_pods` are kept (the stalest evicted first).
//! - Every refusal has a reason, returned to the client and counted.

use std::collections::BTreeMap;
#[cfg(feature = "tools")]
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use rustc_hash::FxHashMap;

use crate::sources::{
    AllocatorKind, AllocatorSource, AllocatorSources, HostPinned, IngestReport, PodOoms,
    PushedHost, PushedProcess, UNKNOWN_SIZE,
};
use crate::telemetry::cgroup::{self, ContainerRef};
use crate::telemetry::pod_network::PodPeer;
use crate::telemetry::pod_processes::{self, NotInPod, PodProcess};
use crate::telemetry::process;

use super::limits::OOM_BREAKDOWN_SERIES;
use super::payload::{Reason, ValidPush, validate};
#[cfg(feature = "tools")]
use super::recordings::{RecordingStore, Tenant, Uploader};
use super::refusal::{Refusal, Rejected};

/// A pushing process as the kernel named it when it connected (`SO_PEERCRED`, in the agent's
/// pid namespace), with its start time as read when the agent accepted the connection. A
/// push must still come from that process: one whose pid has gone (or is another process's)
/// is refused. A child that inherited the connection pushes as its parent while the parent
/// lives: the parent handed it the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its pid.
    pub pid: u32,
    /// Its start time when it connected (`/proc/<pid>/stat`); `None` where nothing proves
    /// whose the pid was then (the process gone by the accept, or its handle says it has
    /// exited since): its pushes and uploads are refused.
    pub start_time: Option<u64>,
    /// Its user, where the kernel said (`SO_PEERCRED`): a host process's tenant.
    pub uid: Option<u32>,
}

impl Peer {
    /// The process `pid` is now (its user not said).
    pub fn now(pid: u32) -> Peer {
        Peer {
            pid,
            start_time: process::start_time(pid),
            uid: None,
        }
    }
}

/// Who sent a push, as the agent (not the payload) knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sender {
    /// A TCP peer on this host (loopback): the payload's pid and start time are its word.
    Unattributed,
    /// A process the kernel named (a Unix-socket peer).
    Process(Peer),
    /// A pod, by its address on the pod network: the payload's pid must be one of the pod's
    /// processes, in the pod's own pid namespace ([`pod_processes`]).
    Pod(PodPeer),
}

impl From<Option<Peer>> for Sender {
    fn from(peer: Option<Peer>) -> Sender {
        peer.map_or(Sender::Unattributed, Sender::Process)
    }
}

/// Who vouches for a tracked process's pid.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Origin {
    /// The kernel (a socket pusher): the pid is the sender's.
    Socket,
    /// The node, for a pod (by UID): the pid is a process of that pod.
    Pod(String),
    /// The payload (a loopback TCP pusher).
    Tcp,
}

impl Origin {
    /// The pid is a host pid, checked in `/proc`.
    fn host_pid(&self) -> bool {
        *self != Origin::Tcp
    }

    fn pod(&self) -> Option<&str> {
        match self {
            Origin::Pod(uid) => Some(uid),
            _ => None,
        }
    }
}

/// The largest step between two sequence numbers of one process.
pub const MAX_SEQ_JUMP: u64 = 1 << 20;
/// `"oom"` and `"exit"` pushes a process may send past the rate limit in a burst.
pub const MAX_REASON_PUSHES: u32 = 8;
/// How often one of those comes back to a process that spent it.
pub const REASON_REFILL: Duration = Duration::from_secs(60);

/// A process's urgent pushes past the rate limit, spent and not yet given back (a token
/// bucket of [`MAX_REASON_PUSHES`], refilled one per [`REASON_REFILL`]).
#[derive(Clone, Copy, Debug)]
struct Allowance {
    spent: u32,
    /// When the oldest spent one started coming back.
    since: Instant,
}

impl Allowance {
    fn new(now: Instant) -> Allowance {
        Allowance {
            spent: 0,
            since: now,
        }
    }

    /// The allowance at `now`: one spent push given back per whole [`REASON_REFILL`].
    fn at(self, now: Instant) -> Allowance {
        let elapsed = now.saturating_duration_since(self.since).as_nanos();
        let back = (elapsed / REASON_REFILL.as_nanos()).min(u128::from(self.spent)) as u32;
        if back == self.spent {
            return Allowance::new(now);
        }
        Allowance {
            spent: self.spent - back,
            since: self.since + REASON_REFILL * back,
        }
    }
}

/// Ingest settings.
#[derive(Clone, Copy, Debug)]
pub struct IngestConfig {
    /// A process silent for this long has ended.
    pub ttl: Duration,
    /// How long an ended process's last series are still served.
    pub exited_grace: Duration,
    /// Most processes kept at once (live and ended).
    pub max_processes: usize,
    /// Most of them pushing over TCP (unattributed).
    pub max_tcp_processes: usize,
    /// Most processes of one pod pushing from the pod network.
    pub max_pod_processes: usize,
    /// Most series those of one pod hold together.
    pub max_pod_series: usize,
    /// Most processes of all pods pushing from the pod network together.
    pub max_pod_network_processes: usize,
    /// Most series those hold together: the rest is the socket pushers'.
    pub max_pod_network_series: usize,
    /// Most series served for pushes, per-pod OOM counters included.
    pub max_series: usize,
    /// Most of them held by processes pushing over TCP, together; each such process holds
    /// at most a quarter of it ([`IngestConfig::tcp_process_series`]).
    pub max_tcp_series: usize,
    /// Least time between two accepted pushes of one process.
    pub min_interval: Duration,
    /// How long a pod's OOM count is kept after its last OOM.
    pub oom_retention: Duration,
    /// Most pods whose OOM counts are kept.
    pub max_pods: usize,
    /// The pod and container of a pid the kernel named (read from `/proc` by default).
    pub resolve: fn(u32) -> Option<ContainerRef>,
    /// The start time of a pid (clock ticks since boot, `/proc/<pid>/stat`), `None` when
    /// the pid does not exist.
    pub start_time: fn(u32) -> Option<u64>,
    /// The host process of a pod (by UID) with a container pid and, where given, a start
    /// time (read from `/proc` by default).
    pub pod_process: fn(&str, u32, Option<u64>) -> Result<PodProcess, NotInPod>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            ttl: Duration::from_secs(60),
            exited_grace: Duration::from_secs(120),
            // A node runs a few CUDA processes per GPU; a scrape of 256 pushed processes
            // stays within a few MiB (4096 took the agent to 88 MiB).
            max_processes: 256,
            max_tcp_processes: 64,
            // Ranks of a node's GPUs and their helpers; a pod's processes hold at most an
            // eighth of the series budget.
            max_pod_processes: 16,
            max_pod_series: 1_250,
            // Half of the processes and series: however many pods push, the socket's jobs
            // keep the other half.
            max_pod_network_processes: 128,
            max_pod_network_series: 5_000,
            // About 9 MB of exposition at worst (every label at its bound; measured in
            // tests/it/hostile.rs), a few hundred typical processes.
            max_series: 10_000,
            // A quarter; a process's share of it (625) is several times what a rank of one
            // GPU pushes (about 70 series).
            max_tcp_series: 2_500,
            min_interval: Duration::from_millis(500),
            oom_retention: Duration::from_secs(24 * 3600),
            max_pods: 1024,
            resolve: cgroup::container_of,
            start_time: process::start_time,
            pod_process: pod_processes::find,
        }
    }
}

impl IngestConfig {
    /// The series one process pushing over TCP may hold.
    pub fn tcp_process_series(&self) -> usize {
        self.max_tcp_series / 4
    }
}

struct Tracked {
    seq: u64,
    last: Instant,
    /// Who vouches for its pid (for all but TCP pushers, `/proc/<pid>` is this process).
    origin: Origin,
    /// Its start time, where the pid is a host pid and `/proc` said.
    start_time: Option<u64>,
    /// When it was seen to end.
    ended: Option<Instant>,
    allowance: Allowance,
    /// OOMs it counted at its last push, over its devices.
    ooms: u64,
    series: usize,
    sources: Vec<Arc<AllocatorSource>>,
    /// Its pinned host memory as its last push said (a push without it clears it).
    host: Option<HostPinned>,
}

impl Tracked {
    /// When it ended, or will have if it stays silent.
    fn end(&self, ttl: Duration) -> Instant {
        let silent = self.last + ttl;
        self.ended.map_or(silent, |ended| ended.min(silent))
    }
}

struct PodCount {
    ooms: u64,
    last: Instant,
    /// The last counted OOM's time, by the job's clock where it said.
    last_oom_unix: Option<f64>,
}

#[derive(Default)]
struct State {
    tracked: FxHashMap<u32, Tracked>,
    pods: BTreeMap<(String, String), PodCount>,
}

/// What the tracked processes hold, as the caps count it: of one pod's (the pushing pod's).
#[derive(Clone, Copy, Debug, Default)]
struct Load {
    processes: usize,
    series: usize,
    tcp: usize,
    tcp_series: usize,
    /// Of all pods' processes.
    network: usize,
    network_series: usize,
    pod: usize,
    pod_series: usize,
}

impl Load {
    /// One process of `origin` holding `series`, counted for `pod`'s quota where it is one
    /// of its processes.
    fn of(origin: &Origin, series: usize, pod: Option<&str>) -> Load {
        let tcp = usize::from(*origin == Origin::Tcp);
        let network = usize::from(origin.pod().is_some());
        let in_pod = usize::from(pod.is_some() && origin.pod() == pod);
        Load {
            processes: 1,
            series,
            tcp,
            tcp_series: tcp * series,
            network,
            network_series: network * series,
            pod: in_pod,
            pod_series: in_pod * series,
        }
    }

    /// The first cap exceeded, in the order refusals name them.
    fn over(&self, config: &IngestConfig) -> Option<Over> {
        [
            (self.series > config.max_series, Over::Series),
            (self.tcp_series > config.max_tcp_series, Over::TcpSeries),
            (
                self.network_series > config.max_pod_network_series,
                Over::NetworkSeries,
            ),
            (self.pod_series > config.max_pod_series, Over::PodSeries),
            (self.processes > config.max_processes, Over::Processes),
            (self.tcp > config.max_tcp_processes, Over::TcpProcesses),
            (
                self.network > config.max_pod_network_processes,
                Over::NetworkProcesses,
            ),
            (self.pod > config.max_pod_processes, Over::PodProcesses),
        ]
        .into_iter()
        .find_map(|(over, which)| over.then_some(which))
    }
}

impl std::ops::AddAssign for Load {
    fn add_assign(&mut self, other: Load) {
        self.processes += other.processes;
        self.series += other.series;
        self.tcp += other.tcp;
        self.tcp_series += other.tcp_series;
        self.network += other.network;
        self.network_series += other.network_series;
        self.pod += other.pod;
        self.pod_series += other.pod_series;
    }
}

impl std::ops::SubAssign for Load {
    fn sub_assign(&mut self, other: Load) {
        self.processes -= other.processes;
        self.series -= other.series;
        self.tcp -= other.tcp;
        self.tcp_series -= other.tcp_series;
        self.network -= other.network;
        self.network_series -= other.network_series;
        self.pod -= other.pod;
        self.pod_series -= other.pod_series;
    }
}

/// A cap a push would exceed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Over {
    Series,
    TcpSeries,
    NetworkSeries,
    PodSeries,
    Processes,
    TcpProcesses,
    NetworkProcesses,
    PodProcesses,
}

impl Over {
    /// The refusal of a push of `series` series (from `pod`, where it is one).
    fn refusal(self, config: &IngestConfig, series: usize, pod: Option<&str>) -> Rejected {
        let pod = pod.unwrap_or_default();
        let (refusal, message) = match self {
            Over::Series => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take the agent past its budget of {} pushed series",
                    config.max_series
                ),
            ),
            Over::TcpSeries => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take processes pushing over TCP past their share of {} series (push over the agent's socket)",
                    config.max_tcp_series
                ),
            ),
            Over::NetworkSeries => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take the pods pushing from the pod network past their share of {} series",
                    config.max_pod_network_series
                ),
            ),
            Over::PodSeries => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take pod {pod} past its share of {} series",
                    config.max_pod_series
                ),
            ),
            Over::Processes => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes, the most this agent keeps",
                    config.max_processes
                ),
            ),
            Over::TcpProcesses => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes pushing over TCP, the most this agent keeps",
                    config.max_tcp_processes
                ),
            ),
            Over::NetworkProcesses => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes pushing from the pod network, the most this agent keeps",
                    config.max_pod_network_processes
                ),
            ),
            Over::PodProcesses => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes of pod {pod}, the most this agent keeps of one pod",
                    config.max_pod_processes
                ),
            ),
        };
        Rejected::new(refusal, message)
    }
}

/// Refuses a pod's push whose labels name another pod or container than the node found
/// (`container`, the name, is not checked: the sandbox does not say it, and it names no
/// other pod).
fn check_identity(
    labels: &[(String, String)],
    pod: &PodPeer,
    container: &ContainerRef,
) -> Result<(), Rejected> {
    for (name, value) in labels {
        // A colliding name is exported as `exported_<name>`: still a claim.
        let base = name.strip_prefix("exported_").unwrap_or(name);
        let own = match base {
            "pod_uid" => &pod.uid,
            "namespace" | "pod_namespace" => &pod.namespace,
            "pod" | "pod_name" => &pod.name,
            "container_id" => &container.container_id,
            _ => continue,
        };
        if value != own {
            return Err(Rejected::new(
                Refusal::Forbidden,
                format!(
                    "label {name}={value:?} names another pod than the sender ({}/{}, uid {})",
                    pod.namespace, pod.name, pod.uid
                ),
            ));
        }
    }
    Ok(())
}

/// Who a push is from, as [`PushStore`]'s identification found it.
struct Identity {
    origin: Origin,
    /// Its start time: the kernel's or the node's where they said, else the payload's.
    start_time: Option<u64>,
    /// Its container, where the kernel or the node named it.
    container: Option<ContainerRef>,
    /// Its pod's namespace and name, where the pod network named it.
    pod_names: Option<(String, String)>,
}

/// What admitting a push found.
#[derive(Clone, Copy, Default)]
struct Admission {
    /// It is the tracked process's next push (else it starts a new entry).
    replaces: bool,
    /// It came too soon and uses the allowance of urgent pushes.
    urgent: bool,
}

/// The series that what an earlier push of `t` (a snapshot, an OOM's explanation) keeps
/// exporting adds: they count as much as what this push brings.
fn kept_series(t: &Tracked, push: &ValidPush) -> usize {
    push.devices
        .iter()
        .filter_map(|d| Some((d, t.sources.iter().find(|s| s.uuid == d.uuid)?)))
        .map(|(d, before)| {
            let classes = if d.snapshot.is_none() {
                2 * before
                    .segment_classes
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .len()
            } else {
                0
            };
            let explanation = d.last_oom.is_none()
                && before.last_oom().is_some()
                && before.stats.num_ooms.get() >= d.stats.num_ooms.get();
            classes + if explanation { OOM_BREAKDOWN_SERIES } else { 0 }
        })
        .sum()
}

/// A push's labels with its container's and pod's, where the kernel or the node named them.
fn labels_of(
    mut labels: Vec<(String, String)>,
    container: Option<&ContainerRef>,
    pod_names: Option<(String, String)>,
) -> Vec<(String, String)> {
    if let Some(c) = container {
        labels.push(("pod_uid".into(), c.pod_uid.clone()));
        labels.push(("container_id".into(), c.container_id.clone()));
    }
    if let Some((namespace, name)) = pod_names {
        labels.push(("pod_namespace".into(), namespace));
        labels.push(("pod_name".into(), name));
    }
    labels
}

/// The sources of a push's devices (taken out of it), with what `old`, its process's last
/// entry, keeps: a snapshot's figures stand until a later snapshot replaces them; an OOM's
/// explanation until the device's next OOM (explained or not).
fn pushed_sources(
    push: &mut ValidPush,
    old: Option<&Tracked>,
    labels: &[(String, String)],
    last_oom_at: Option<f64>,
) -> Vec<Arc<AllocatorSource>> {
    let pid = push.pid;
    std::mem::take(&mut push.devices)
        .into_iter()
        .map(|device| {
            let before = old.and_then(|t| t.sources.iter().find(|s| s.uuid == device.uuid));
            let last_oom = device.last_oom.or_else(|| {
                before
                    .filter(|s| s.stats.num_ooms.get() >= device.stats.num_ooms.get())
                    .and_then(|s| s.last_oom())
            });
            let kept = before.filter(|_| device.snapshot.is_none()).map(|s| {
                let classes = s
                    .segment_classes
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                (s.largest_free_block.load(Ordering::Relaxed), classes)
            });
            let (largest, classes) = device
                .snapshot
                .or(kept)
                .unwrap_or((UNKNOWN_SIZE, Vec::new()));
            Arc::new(AllocatorSource {
                gpu: device.index,
                uuid: device.uuid,
                pid,
                allocator: AllocatorKind::Pytorch,
                version: push.version.clone(),
                config: push.config.clone(),
                stats: Arc::new(device.stats),
                largest_free_block: Arc::new(AtomicU64::new(largest)),
                segment_classes: Mutex::new(classes),
                labels: labels.to_vec(),
                last_oom_unix_seconds: last_oom_at,
                last_oom: Mutex::new(last_oom),
                segments: Default::default(),
            })
        })
        .collect()
}

/// OOMs a push brings for its pod's count.
struct PodOom {
    /// Counted now and not at its last push.
    new_ooms: u64,
    /// The process is seen afresh (its entry had gone).
    fresh: bool,
    /// When the job dates its last OOM, by its own clock.
    dated: Option<f64>,
    /// When its last OOM is taken to be.
    last_oom_at: Option<f64>,
}

/// Adds a push's new OOMs to its container's pod count. A process seen afresh brings its
/// whole count again: the OOMs it dates to at or before the pod's last counted one were
/// counted then.
fn count_pod_ooms(
    pods: &mut BTreeMap<(String, String), PodCount>,
    c: &ContainerRef,
    oom: PodOom,
    now: Instant,
) {
    let key = (c.pod_uid.clone(), c.container_id.clone());
    let count = pods.entry(key).or_insert(PodCount {
        ooms: 0,
        last: now,
        last_oom_unix: None,
    });
    let recounted = oom.fresh
        && oom
            .dated
            .zip(count.last_oom_unix)
            .is_some_and(|(theirs, counted)| theirs <= counted);
    if !recounted {
        count.ooms += oom.new_ooms;
        count.last = now;
        count.last_oom_unix = oom.last_oom_at.or(count.last_oom_unix);
    }
}

/// The pushed processes and the ingest's own counters.
pub struct PushStore {
    config: IngestConfig,
    sources: AllocatorSources,
    state: Mutex<State>,
    /// When the store was made (Unix seconds).
    started_unix: f64,
    accepted: AtomicU64,
    refused: [AtomicU64; Refusal::ALL.len()],
    /// Where recordings its processes upload are kept, once the agent keeps them.
    #[cfg(feature = "tools")]
    recordings: OnceLock<Arc<RecordingStore>>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl PushStore {
    /// A store publishing into `sources` (the list the collector reads).
    pub fn new(config: IngestConfig, sources: AllocatorSources) -> PushStore {
        PushStore {
            config,
            sources,
            state: Mutex::new(State::default()),
            started_unix: unix_now(),
            accepted: AtomicU64::new(0),
            refused: Default::default(),
            #[cfg(feature = "tools")]
            recordings: OnceLock::new(),
        }
    }

    /// Keeps the recordings its processes upload in `store` (once; a second store is
    /// ignored).
    #[cfg(feature = "tools")]
    pub fn keep_recordings(&self, store: Arc<RecordingStore>) {
        let _ = self.recordings.set(store);
    }

    /// Where its processes' recordings are kept, where they are.
    #[cfg(feature = "tools")]
    pub fn recordings(&self) -> Option<&Arc<RecordingStore>> {
        self.recordings.get()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn refuse(&self, rejected: Rejected) -> Rejected {
        self.count_refusal(rejected.refusal);
        rejected
    }

    /// Counts a body refused before it reached the store (too large, truncated, forbidden).
    pub fn count_refusal(&self, refusal: Refusal) {
        let i = Refusal::ALL.iter().position(|r| *r == refusal).unwrap_or(0);
        self.refused[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Who an upload of a recording is from: a process this store tracks, known as its pushes
    /// are (the kernel's pid for a socket peer; a pod's process by the pid `pid` it has in the
    /// pod, told apart by `start_time`; from loopback, `pid` and `start_time` as given, which
    /// must be what its pushes said: a loopback sender naming only a pid is no other loopback
    /// job), with its tenant and the labels its pushes carry. A recording follows its
    /// process's pushes.
    ///
    /// # Errors
    /// A pid that is not the pod's (`not_in_pod`), or that has not pushed from there
    /// (`forbidden`).
    #[cfg(feature = "tools")]
    pub fn recording_owner(
        &self,
        sender: Sender,
        pid: u32,
        start_time: Option<u64>,
    ) -> Result<Uploader, Rejected> {
        // The uploader's start time: a process reusing a tracked pid is not it.
        let mut user = None;
        let (pid, origin, started) = match sender {
            Sender::Unattributed => (pid, Origin::Tcp, start_time),
            Sender::Process(peer) => {
                user = peer.uid;
                (peer.pid, Origin::Socket, peer.start_time)
            }
            Sender::Pod(pod) => {
                let found = (self.config.pod_process)(&pod.uid, pid, start_time)
                    .map_err(|e| Rejected::new(Refusal::NotInPod, e.to_string()))?;
                (found.pid, Origin::Pod(pod.uid), Some(found.start_time))
            }
        };
        let state = self.state();
        let tracked = state
            .tracked
            .get(&pid)
            .filter(|t| t.origin == origin && t.start_time == started);
        let Some(tracked) = tracked else {
            return Err(Rejected::new(
                Refusal::Forbidden,
                format!(
                    "pid {pid} (with start time {started:?}) has not pushed to this agent from there: a recording comes from a process that pushes, named as its pushes name it"
                ),
            ));
        };
        let labels = tracked
            .sources
            .first()
            .map(|s| s.labels.clone())
            .unwrap_or_default();
        // A socket peer shares with its pod (as from the pod network) or its user: a process
        // forking a crowd of pushers gains nothing.
        let pod_uid = labels
            .iter()
            .find_map(|(k, v)| (k == "pod_uid" && !v.is_empty()).then_some(v));
        let tenant = match (&origin, pod_uid, user) {
            (Origin::Socket, Some(pod), _) | (Origin::Pod(pod), ..) => Tenant::Pod(pod.clone()),
            (Origin::Socket, None, Some(uid)) => Tenant::User(uid),
            (Origin::Socket, None, None) => Tenant::Process(pid),
            (Origin::Tcp, ..) => Tenant::Loopback,
        };
        Ok(Uploader {
            pid,
            tenant,
            labels,
        })
    }

    /// Accepts a payload, or says why not.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push(&self, body: &[u8]) -> Result<(), Rejected> {
        self.push_from(body, None)
    }

    /// Accepts a payload from a process the kernel named (a Unix-socket peer): its pid
    /// replaces the payload's, which inside a container is the container's pid namespace's
    /// and so would not match the pids NVML reports. The pid must still be the process the
    /// connection was accepted from (its start time unchanged: see [`Peer`]), and its pod is
    /// read at each push.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push_from(&self, body: &[u8], peer: Option<Peer>) -> Result<(), Rejected> {
        self.push_at(body, peer, Instant::now())
            .map_err(|rejected| self.refuse(rejected))
    }

    /// Accepts a payload from a pod, known by its address on the pod network: the payload's
    /// pid must be one of the pod's processes in its own pid namespace (and its start time
    /// that process's), whose host pid replaces it; its labels may not name another pod.
    /// Reads `/proc` (a scan where the process is not known yet): call it off the async
    /// runtime.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push_from_pod(&self, body: &[u8], pod: PodPeer) -> Result<(), Rejected> {
        self.push_at(body, Sender::Pod(pod), Instant::now())
            .map_err(|rejected| self.refuse(rejected))
    }

    /// A push, in its phases: validate the body, identify the sender, admit it (order and
    /// rate), fit it in the budgets (evicting ended processes where that is enough), then
    /// track and publish it. A refusal at any phase changes nothing.
    pub(super) fn push_at(
        &self,
        body: &[u8],
        sender: impl Into<Sender>,
        now: Instant,
    ) -> Result<(), Rejected> {
        let mut push = validate(body)?;
        let who = self.identify(&mut push, sender.into())?;
        let mut state = self.state();
        let admitted = self.admit(&state, &push, &who.origin, who.start_time, now)?;
        let series = self.budget(&mut state, &push, &who.origin, admitted.replaces, now)?;
        self.track(&mut state, push, who, admitted, series, now);
        self.publish(&state);
        self.accepted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Who the pid is: a host pid with its start time from /proc and its container, or the
    /// payload's own word (which tells apart, say, two containers' pid 1). Replaces the
    /// payload's pid by the host's where the kernel or the node named it.
    fn identify(&self, push: &mut ValidPush, sender: Sender) -> Result<Identity, Rejected> {
        Ok(match sender {
            Sender::Unattributed => Identity {
                origin: Origin::Tcp,
                start_time: push.start_time,
                container: None,
                pod_names: None,
            },
            Sender::Process(peer) => {
                let now = (self.config.start_time)(peer.pid);
                // The connecting process exited (its connection inherited by a child, say):
                // its pid is no one's now, or another process's. Where its start time was not
                // read at the accept (it had gone by then), nothing proves whose the pid is.
                if peer.start_time.is_none() || now != peer.start_time {
                    return Err(Rejected::new(
                        Refusal::Forbidden,
                        format!(
                            "pid {} is no longer the process that opened this connection; connect again",
                            peer.pid
                        ),
                    ));
                }
                push.pid = peer.pid;
                Identity {
                    origin: Origin::Socket,
                    start_time: now,
                    container: (self.config.resolve)(peer.pid),
                    pod_names: None,
                }
            }
            Sender::Pod(pod) => {
                let found = (self.config.pod_process)(&pod.uid, push.pid, push.start_time)
                    .map_err(|e| Rejected::new(Refusal::NotInPod, e.to_string()))?;
                check_identity(&push.labels, &pod, &found.container)?;
                push.pid = found.pid;
                Identity {
                    origin: Origin::Pod(pod.uid),
                    start_time: Some(found.start_time),
                    container: Some(found.container),
                    // The runtime named the pod: its series need no kubelet directory for that.
                    pod_names: Some((pod.namespace, pod.name)),
                }
            }
        })
    }

    /// Whether a push from `origin` may write its pid's entry: not over a higher-ranked
    /// sender's, not over a live loopback job of another start time, and, from the same
    /// process, in order and not too often.
    fn admit(
        &self,
        state: &State,
        push: &ValidPush,
        origin: &Origin,
        start_time: Option<u64>,
        now: Instant,
    ) -> Result<Admission, Rejected> {
        let pid = push.pid;
        let mut admitted = Admission::default();
        let Some(t) = state.tracked.get(&pid) else {
            return Ok(admitted);
        };
        let same_process = t.origin == *origin && t.start_time == start_time;
        // The kernel's word stands over the node's (which proves a pod's process exists,
        // not that it pushed), and both over a payload's.
        let outranked = match (&t.origin, origin) {
            (Origin::Socket, Origin::Socket) => false,
            (Origin::Socket, _) => true,
            (Origin::Pod(_), Origin::Tcp) => true,
            _ => false,
        };
        if outranked {
            return Err(Rejected::new(
                Refusal::Conflict,
                format!(
                    "pid {pid} pushes over the agent's {}; pushes from {} cannot write it",
                    if t.origin == Origin::Socket {
                        "socket"
                    } else {
                        "pod network"
                    },
                    if *origin == Origin::Tcp {
                        "loopback"
                    } else {
                        "the pod network"
                    }
                ),
            ));
        }
        // A loopback pid and start time are the payload's word: another's cannot take a
        // live loopback job's series (another local user's, a stale pid's).
        if t.origin == Origin::Tcp
            && *origin == Origin::Tcp
            && !same_process
            && t.end(self.config.ttl) > now
        {
            // (Its start time is not said: not to help another guess it.)
            return Err(Rejected::new(
                Refusal::Conflict,
                format!(
                    "pid {pid} is a live loopback job's, of another start time; a push cannot replace it until it ends (its exit push, or {:?} of silence): push over the agent's socket",
                    self.config.ttl
                ),
            ));
        }
        if same_process {
            admitted.urgent = self.check_order(t, push, now)?;
            admitted.replaces = true;
        }
        // Otherwise a new process under a dead one's pid (or the kernel now names a pid
        // a TCP push claimed): it replaces the old entry.
        Ok(admitted)
    }

    /// The series the push will hold (its own and what its process's last push keeps
    /// exporting, where it `replaces` it), once room is made for them.
    fn budget(
        &self,
        state: &mut State,
        push: &ValidPush,
        origin: &Origin,
        replaces: bool,
        now: Instant,
    ) -> Result<usize, Rejected> {
        let old = state.tracked.get(&push.pid).filter(|_| replaces);
        let series = push.series() + old.map_or(0, |t| kept_series(t, push));
        self.make_room(state, push.pid, origin, series, now)?;
        Ok(series)
    }

    /// Tracks an admitted push holding `series` series: its sources, its OOMs (counted for
    /// its pod), its allowance and its end.
    fn track(
        &self,
        state: &mut State,
        mut push: ValidPush,
        who: Identity,
        admitted: Admission,
        series: usize,
        now: Instant,
    ) {
        let pid = push.pid;
        let old = state.tracked.get(&pid).filter(|_| admitted.replaces);
        let old_ooms = old.map_or(0, |t| t.ooms);
        let ooms = push.ooms().max(old_ooms);
        let new_ooms = ooms - old_ooms;
        let wall = unix_now();
        let last_oom_at = match push.last_oom_unix_seconds {
            // The job's own clock is the node's; never in the future.
            Some(t) => Some(t.min(wall)),
            None if new_ooms > 0 || push.reason == Reason::Oom => Some(wall),
            None => old
                .and_then(|t| t.sources.first())
                .and_then(|s| s.last_oom_unix_seconds),
        };
        let labels = labels_of(
            std::mem::take(&mut push.labels),
            who.container.as_ref(),
            who.pod_names,
        );
        let sources = pushed_sources(&mut push, old, &labels, last_oom_at);
        // Only pushes that needed the allowance use it up.
        let mut allowance = old.map_or(Allowance::new(now), |t| t.allowance.at(now));
        allowance.spent += u32::from(admitted.urgent);
        let ended = old
            .and_then(|t| t.ended)
            .or_else(|| (push.reason == Reason::Exit).then_some(now));
        let fresh = old.is_none();
        // OOMs the job dates to before this agent started were counted by its predecessor.
        let counted = push
            .last_oom_unix_seconds
            .is_none_or(|t| t >= self.started_unix);
        if new_ooms > 0
            && counted
            && let Some(c) = &who.container
        {
            let oom = PodOom {
                new_ooms,
                fresh,
                dated: push.last_oom_unix_seconds,
                last_oom_at,
            };
            count_pod_ooms(&mut state.pods, c, oom, now);
        }
        state.tracked.insert(
            pid,
            Tracked {
                seq: push.seq,
                last: now,
                origin: who.origin,
                start_time: who.start_time,
                ended,
                allowance,
                ooms,
                series,
                sources,
                host: push.host,
            },
        );
    }

    /// A push of a known process: after its last, not too far after, not too soon. `true`
    /// when it is an urgent push that came too soon and uses the allowance.
    fn check_order(&self, t: &Tracked, push: &ValidPush, now: Instant) -> Result<bool, Rejected> {
        let pid = push.pid;
        if push.seq <= t.seq {
            return Err(Rejected::new(
                Refusal::Stale,
                format!(
                    "seq {} is not after the last accepted seq {} of pid {pid}",
                    push.seq, t.seq
                ),
            ));
        }
        if push.seq - t.seq > MAX_SEQ_JUMP {
            return Err(Rejected::new(
                Refusal::Invalid,
                format!(
                    "seq {} jumps more than {MAX_SEQ_JUMP} past the last accepted seq {} of pid {pid}",
                    push.seq, t.seq
                ),
            ));
        }
        let soon = now.saturating_duration_since(t.last) < self.config.min_interval;
        if !soon {
            return Ok(false);
        }
        if push.reason != Reason::Interval && t.allowance.at(now).spent < MAX_REASON_PUSHES {
            return Ok(true);
        }
        Err(Rejected::new(
            Refusal::RateLimited,
            format!(
                "pid {pid} pushes more often than every {:?}",
                self.config.min_interval
            ),
        ))
    }

    /// Makes room for `pid`'s push holding `series` series (replacing its entry, if any):
    /// when a cap would be exceeded, evicts ended processes, oldest first, but only if that
    /// is enough; otherwise refuses and changes nothing.
    fn make_room(
        &self,
        state: &mut State,
        pid: u32,
        origin: &Origin,
        series: usize,
        now: Instant,
    ) -> Result<(), Rejected> {
        let config = &self.config;
        if *origin == Origin::Tcp && series > config.tcp_process_series() {
            return Err(Rejected::new(
                Refusal::SeriesBudget,
                format!(
                    "pid {pid} would hold {series} series; a process pushing over TCP holds at most {} (push over the agent's socket)",
                    config.tcp_process_series()
                ),
            ));
        }
        let pod = origin.pod();
        let mut load = Load::of(origin, series, pod);
        load.series += state.pods.len();
        for (&p, t) in &state.tracked {
            if p != pid {
                load += Load::of(&t.origin, t.series, pod);
            }
        }
        if load.over(config).is_none() {
            return Ok(());
        }
        let mut ended: Vec<(Instant, u32)> = state
            .tracked
            .iter()
            .filter(|&(&p, t)| p != pid && t.end(config.ttl) <= now)
            .map(|(&p, t)| (t.end(config.ttl), p))
            .collect();
        ended.sort_unstable();
        let mut evict = Vec::new();
        for (_, p) in ended {
            let Some(over) = load.over(config) else {
                break;
            };
            let t = &state.tracked[&p];
            let freed = Load::of(&t.origin, t.series, pod);
            // An ended process that frees nothing of what is short stays (an ended socket
            // pusher, while only TCP's share is short).
            let helps = match over {
                Over::Series | Over::Processes => true,
                Over::TcpSeries | Over::TcpProcesses => freed.tcp > 0,
                Over::NetworkSeries | Over::NetworkProcesses => freed.network > 0,
                Over::PodSeries | Over::PodProcesses => freed.pod > 0,
            };
            if helps {
                load -= freed;
                evict.push(p);
            }
        }
        if let Some(over) = load.over(config) {
            return Err(over.refusal(config, series, pod));
        }
        // The push is accepted and published right after: the evicted go with it.
        for p in evict {
            state.tracked.remove(&p);
        }
        Ok(())
    }

    /// Marks ended processes (vanished pids, silence), drops those past their grace period
    /// and pod OOM counts past their retention. The agent calls it on its own tick.
    pub fn expire(&self) {
        self.expire_at(Instant::now(), self.config.start_time);
    }

    pub(super) fn expire_at(&self, now: Instant, start_time: impl Fn(u32) -> Option<u64>) {
        let config = &self.config;
        let mut state = self.state();
        let before = state.tracked.len();
        for (&pid, t) in &mut state.tracked {
            if t.ended.is_none() && t.origin.host_pid() {
                let now_start = start_time(pid);
                let gone =
                    now_start.is_none() || (t.start_time.is_some() && now_start != t.start_time);
                if gone {
                    t.ended = Some(now);
                }
            }
        }
        // A live process (its end still ahead) stays whatever the grace: with a grace of 0,
        // `<` alone dropped live processes at every tick (a job between its push and its
        // upload among them).
        state.tracked.retain(|_, t| {
            let end = t.end(config.ttl);
            end > now || now.saturating_duration_since(end) < config.exited_grace
        });
        state
            .pods
            .retain(|_, p| now.saturating_duration_since(p.last) < config.oom_retention);
        while state.pods.len() > config.max_pods {
            let stalest = state
                .pods
                .iter()
                .min_by_key(|(_, p)| p.last)
                .map(|(k, _)| k.clone());
            if let Some(key) = stalest {
                state.pods.remove(&key);
            }
        }
        if state.tracked.len() != before {
            self.publish(&state);
        }
    }

    /// Replaces the pushed sources in the collector's list by the tracked ones.
    fn publish(&self, state: &State) {
        let mut pushed: Vec<_> = state
            .tracked
            .values()
            .flat_map(|t| t.sources.iter().cloned())
            .collect();
        pushed.sort_by_key(|s| (s.pid, s.gpu));
        self.sources.replace(AllocatorKind::Pytorch, pushed);
    }

    /// Processes kept now, live and ended.
    pub fn tracked_processes(&self) -> usize {
        self.state().tracked.len()
    }

    /// Series held by processes pushing over TCP.
    #[cfg(test)]
    pub(super) fn tcp_series(&self) -> usize {
        self.state()
            .tracked
            .values()
            .filter(|t| t.origin == Origin::Tcp)
            .map(|t| t.series)
            .sum()
    }

    /// (result label, count) for the ingest counter: `accepted`, then each refusal.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        let mut out = vec![("accepted", self.accepted.load(Ordering::Relaxed))];
        for (r, count) in Refusal::ALL.iter().zip(&self.refused) {
            out.push((r.label(), count.load(Ordering::Relaxed)));
        }
        out
    }

    /// What a scrape shows of the ingest.
    pub fn report(&self) -> IngestReport {
        let state = self.state();
        let mut processes: Vec<PushedProcess> = state
            .tracked
            .iter()
            .map(|(&pid, t)| PushedProcess {
                pid,
                last_push: t.last,
            })
            .collect();
        processes.sort_unstable_by_key(|p| p.pid);
        let pod_ooms = state
            .pods
            .iter()
            .map(|((pod_uid, container_id), p)| PodOoms {
                pod_uid: pod_uid.clone(),
                container_id: container_id.clone(),
                ooms: p.ooms,
            })
            .collect();
        let mut hosts: Vec<PushedHost> = state
            .tracked
            .iter()
            .filter_map(|(&pid, t)| {
                Some(PushedHost {
                    pid,
                    // A push lists at least one device, whose series carry its labels.
                    labels: t.sources.first()?.labels.clone(),
                    pinned: t.host?,
                })
            })
            .collect();
        hosts.sort_unstable_by_key(|h| h.pid);
        drop(state);
        IngestReport {
            results: self.counts(),
            processes,
            pod_ooms,
            hosts,
            #[cfg(feature = "tools")]
            recordings: self.recordings().map(|r| r.report()),
            #[cfg(not(feature = "tools"))]
            recordings: None,
        }
    }
}
