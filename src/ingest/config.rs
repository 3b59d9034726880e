//! The ingest's settings: its caps, its lifetimes, and how it reads `/proc` (functions, so
//! that tests and the demo name their own processes).

use std::time::Duration;

use crate::telemetry::cgroup::{self, ContainerRef};
use crate::telemetry::pod_processes::{self, NotInPod, PodProcess};
use crate::telemetry::process;

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
