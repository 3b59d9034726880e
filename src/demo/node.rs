//! A simulated GPU node for machines without GPUs (`gpumem demo`, tests).
//!
//! Each simulated GPU hosts a few simulated processes. Each process owns a caching allocator
//! on a simulated device and replays a real recorded trace (the licensed recordings bundled in
//! `data/traces`) at its recorded pace, in a loop; one replays gpumem's own training workload
//! with a captured CUDA graph and a MemPool instead, so that private pools are on show, and one
//! is a job that pushes as an unmodified PyTorch job does and runs out of memory every half
//! minute while its GPU shows memory free (`oom_job`), so that the pushed path, the OOM's
//! panels, explanation and alert are on show. The node's NVML
//! view is computed from them:
//! a process uses its allocator's reserved bytes plus a CUDA-context overhead outside the
//! allocator, and a GPU's used memory is the sum over its processes, so that
//! device used = Σ reserved + memory outside the allocator, as on a real node.
//!
//! # Invariants
//! - Every process's allocator holds at most its share of its GPU (capacity / processes,
//!   less the context), so the GPU's used memory never exceeds its capacity.
//! - The replay thread stops when the node is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::oom_job::{OomJob, PushSink};
use super::workload::{TrainingWorkload, finish_communication};
use crate::CachingAllocator;
use crate::allocator::size::format_size;
use crate::config::AllocatorConfig;
use crate::device::{SimConfig, SimDevice, simulated_uuid};
use crate::recording::{Recording, parse_recording};
use crate::replay::{Cursor, ReplayError};

use crate::sources::AllocatorSource;
use crate::telemetry::cgroup::{ContainerRef, Runtime};
use crate::telemetry::pod_names::{NameDirectory, PodNames};
use crate::telemetry::pod_resources::PodResources;
use crate::telemetry::pod_resources::api::{
    self, ContainerDevices, ContainerResources, ListPodResourcesResponse,
};
use crate::telemetry::{
    GpuSample, GpuSource, Heartbeat, Kubelet, MigSample, NodeSample, ProcessSample, SourceError,
    SourceReport,
};

/// The bundled recordings a simulated process replays (licensed for redistribution; see
/// `data/traces/README.md`).
pub const BUNDLED_TRACES: [(&str, &[u8]); 5] = [
    (
        "opt125m_zo_fedtrain",
        include_bytes!("../../data/traces/opt125m_zo_fedtrain_complete.noframes.json.gz"),
    ),
    (
        "cs336_lm_fwd_bwd_step",
        include_bytes!("../../data/traces/cs336_lm_fwd_bwd_step.noframes.json.gz"),
    ),
    (
        "cs336_lm_compiled_train",
        include_bytes!("../../data/traces/cs336_lm_compiled_train.noframes.json.gz"),
    ),
    (
        "cs336_lm_forward_bf16",
        include_bytes!("../../data/traces/cs336_lm_forward_bf16.noframes.json.gz"),
    ),
    (
        "cs336_attention_tiny",
        include_bytes!("../../data/traces/cs336_attention_tiny_complete.noframes.json.gz"),
    ),
];

/// The name of the recording a simulated process makes of gpumem's own workload with a
/// captured CUDA graph and a MemPool ([`TrainingWorkload::private_pools`]), replayed beside
/// the bundled ones.
pub const PRIVATE_POOLS_RECORDING: &str = "simulated_graph_and_mem_pool";

/// A small run of the training workload with private pools, recorded and read back (about
/// 700 events, made in a few milliseconds at start).
fn private_pools_recording() -> Result<Recording, SimNodeError> {
    let workload = TrainingWorkload {
        layers: 4,
        hidden: 1024,
        max_seq: 1024,
        steps: 8,
        private_pools: true,
        ..TrainingWorkload::default()
    };
    let mut alloc = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(16 << 30)),
        AllocatorConfig::default(),
    );
    alloc.record_history(Some(1 << 20));
    let fail = |e: &dyn std::fmt::Display| SimNodeError::Recording {
        recording: PRIVATE_POOLS_RECORDING,
        reason: e.to_string(),
    };
    workload
        .run(&mut alloc, finish_communication)
        .map_err(|e| fail(&e))?;
    alloc.empty_cache().map_err(|e| fail(&e))?;
    let json = serde_json::to_vec(&alloc.snapshot()).map_err(|e| fail(&e))?;
    parse_recording(&json).map_err(|e| fail(&e))
}

/// Bounds of the node's shape (each process holds an allocator and replays a recording).
const MAX_GPUS: u32 = 64;
const MAX_PROCESSES_PER_GPU: u32 = 64;

/// Why a simulated node could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimNodeError {
    /// A GPU count outside the bound.
    #[error("a simulated node has 1 to {MAX_GPUS} GPUs, not {0}")]
    Gpus(u32),
    /// A process count per GPU outside the bound.
    #[error("a simulated GPU runs 1 to {MAX_PROCESSES_PER_GPU} processes, not {0}")]
    Processes(u32),
    /// The shape leaves a process no memory.
    #[error(
        "a GPU of {} shared by {processes} processes leaves no memory after a {} context",
        format_size(*capacity),
        format_size(*context)
    )]
    NoMemory {
        /// Memory per GPU.
        capacity: u64,
        /// Processes per GPU.
        processes: u32,
        /// Memory each process uses outside its allocator.
        context: u64,
    },
    /// A recording the node replays could not be made, read or planned: a build defect.
    #[error("{recording}: {reason}")]
    Recording {
        /// The recording's name.
        recording: &'static str,
        /// What failed.
        reason: String,
    },
    /// The replay thread could not be started.
    #[error("cannot start the replay thread: {0}")]
    Thread(std::io::Error),
}

/// Pace for recordings without timestamps.
const EVENTS_PER_SECOND_UNTIMED: u64 = 2_000;
/// Pause between two runs of a recording.
const PAUSE_BETWEEN_RUNS: Duration = Duration::from_secs(1);
/// A process that fell behind catches up in chunks of this many events, reading the stop flag
/// between them, for at most [`ROUND_BUDGET`] a round: so the loop stops (and beats) promptly
/// whatever the pace.
const EVENTS_PER_CHUNK: usize = 2_000;
/// How long one process's catching up may take in one round.
const ROUND_BUDGET: Duration = Duration::from_millis(100);

/// Shape of the simulated node.
#[derive(Clone, Debug)]
pub struct SimNodeConfig {
    /// Number of GPUs.
    pub gpus: u32,
    /// Memory per GPU.
    pub capacity: u64,
    /// Processes per GPU.
    pub processes_per_gpu: u32,
    /// Memory each process uses outside its allocator (CUDA context, cuBLAS workspaces).
    pub context_overhead: u64,
    /// Memory the driver reserves on each GPU.
    pub driver_reserved: u64,
    /// Replay speed relative to the recordings' own pace; 0 holds each process where its
    /// recording reserved the most (a still picture).
    pub speed: f64,
    /// How often the replay thread advances the processes.
    pub tick: Duration,
    /// The allocator configuration of every process.
    pub config: AllocatorConfig,
    /// A memory limit for the last process of the last GPU, so that the node shows what
    /// memory pressure looks like (cache flushes and retries); `None` for none.
    pub tight_process_limit: Option<u64>,
    /// Whether the first GPU's last process (of two or more) is the job that runs out of
    /// memory (`demo::oom_job`) rather than a replay.
    pub oom_job: bool,
    /// Whether the last GPU of a node of two or more is in MIG mode, split into one MIG
    /// device per process, each holding the process's share of memory (a GPU instance of
    /// its own, as the device plugin's MIG resources give them), instead of time slices.
    pub mig_last_gpu: bool,
}

impl Default for SimNodeConfig {
    /// Two 80 GiB GPUs with three processes each.
    fn default() -> Self {
        SimNodeConfig {
            gpus: 2,
            capacity: 80 << 30,
            processes_per_gpu: 3,
            context_overhead: 512 << 20,
            driver_reserved: 512 << 20,
            speed: 1.0,
            tick: Duration::from_millis(100),
            config: AllocatorConfig::default(),
            // Just above what the opt125m recording needs at its peak: its allocator flushes
            // its cache and retries a few times per run, without running out.
            tight_process_limit: Some(1_879_048_192),
            oom_job: true,
            mig_last_gpu: true,
        }
    }
}

/// A simulated GPU node whose processes replay recordings on a thread of its own.
pub struct SimNode {
    config: SimNodeConfig,
    processes: Vec<Arc<AllocatorSource>>,
    /// Where the pushes of the job that runs out of memory go ([`PUSHED_PID`]: pushed, not
    /// held).
    sink: PushSink,
    stop: Arc<AtomicBool>,
    /// At speed 0: every process has reached its still picture.
    still: Arc<AtomicBool>,
    heartbeat: Heartbeat,
    thread: Option<JoinHandle<()>>,
}

/// The namespace of the simulated pods.
const SIM_NAMESPACE: &str = "demo";

/// The pod and container a simulated process runs in: one pod per process, each given a time
/// slice of its GPU, as a node sharing GPUs between jobs looks.
fn simulated_pod(pid: u32) -> (ContainerRef, String) {
    let container = ContainerRef {
        pod_uid: format!("5e1a7ed0-0000-4000-9000-{pid:012x}"),
        container_id: format!("{pid:064x}"),
        runtime: Runtime::Containerd,
    };
    (container, format!("train-{pid}"))
}

/// The pid of the simulated job that pushes: Linux's `PID_MAX_LIMIT` (2^22), the most a push
/// may name, which no process has (pids stay below `pid_max`), so no process of the host that
/// pushes to the demo can be taken for it.
pub const PUSHED_PID: u32 = 1 << 22;

/// The container of the simulated job that pushes ([`PUSHED_PID`]), as the kernel's cgroup
/// would name it; `None` for any other pid.
pub fn pushed_container(pid: u32) -> Option<ContainerRef> {
    (pid == PUSHED_PID).then(|| simulated_pod(pid).0)
}

/// The UUID of the simulated MIG device `index` of GPU `gpu`.
fn simulated_mig_uuid(gpu: u32, index: u32) -> String {
    format!("MIG-5e1a7ed0-0000-5000-8000-{gpu:06x}{index:06x}")
}

/// The profile nvidia-smi would name a GPU instance of `slices` of the seven compute slices
/// and `bytes` of memory.
fn mig_profile(slices: u32, bytes: u64) -> String {
    format!("{slices}g.{}gb", (bytes >> 30).max(1))
}

impl SimNodeConfig {
    /// The GPU in MIG mode, if any.
    fn mig_gpu(&self) -> Option<u32> {
        (self.mig_last_gpu && self.gpus >= 2).then(|| self.gpus - 1)
    }

    /// Each process's share of a GPU's memory (a MIG device's whole memory).
    fn share(&self) -> u64 {
        self.capacity.saturating_sub(self.driver_reserved) / u64::from(self.processes_per_gpu)
    }
}

/// One process's replay state, living on the replay thread.
struct Run<'a> {
    source: Arc<AllocatorSource>,
    recording: &'a Recording,
    /// Offset of each event from the first, in microseconds of the recording's clock.
    offsets: Vec<u64>,
    replayer: Option<Cursor<'a>>,
    spare: Option<CachingAllocator<SimDevice>>,
    started: Instant,
    finished_at: Option<Instant>,
    /// The event after which its recording reserved the most (where `--speed 0` holds it).
    peak: usize,
    /// The job that runs out of memory, in place of a replay.
    job: Option<OomJob>,
}

impl SimNode {
    /// Builds the node and starts replaying.
    ///
    /// # Errors
    /// A [`SimNodeError`]: a shape out of bounds or leaving a process no memory, or a bundled
    /// recording that cannot be read (a build defect).
    pub fn start(config: SimNodeConfig) -> Result<SimNode, SimNodeError> {
        if config.gpus == 0 || config.gpus > MAX_GPUS {
            return Err(SimNodeError::Gpus(config.gpus));
        }
        if config.processes_per_gpu == 0 || config.processes_per_gpu > MAX_PROCESSES_PER_GPU {
            return Err(SimNodeError::Processes(config.processes_per_gpu));
        }
        let processes_per_gpu = config.processes_per_gpu;
        let share = config.share();
        let limit = share
            .checked_sub(config.context_overhead)
            .filter(|&l| l > 0)
            .ok_or(SimNodeError::NoMemory {
                capacity: config.capacity,
                processes: processes_per_gpu,
                context: config.context_overhead,
            })?;
        let mut recordings: Vec<(&str, Recording)> = BUNDLED_TRACES
            .iter()
            .map(|&(name, bytes)| {
                parse_recording(bytes)
                    .map(|r| (name, r))
                    .map_err(|e| SimNodeError::Recording {
                        recording: name,
                        reason: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        // Before the tiniest recording, so that the default node (six processes) runs it.
        recordings.insert(
            recordings.len() - 1,
            (PRIVATE_POOLS_RECORDING, private_pools_recording()?),
        );
        let mut allocators = Vec::new();
        let mut processes = Vec::new();
        // The process that runs out of memory, by index, with its limit.
        let mut oom_job = None;
        let sink = PushSink::default();
        for gpu in 0..config.gpus {
            for k in 0..processes_per_gpu {
                let last = gpu + 1 == config.gpus && k + 1 == processes_per_gpu;
                let process_limit = match config.tight_process_limit {
                    Some(tight) if last => tight.min(limit),
                    _ => limit,
                };
                // A MIG device is a device of its own, of the instance's memory.
                let mig = config.mig_gpu() == Some(gpu);
                let capacity = if mig { share } else { config.capacity };
                let device = SimDevice::new(SimConfig {
                    index: gpu,
                    process_limit: Some(process_limit),
                    ..SimConfig::with_capacity(capacity)
                });
                let mut alloc = CachingAllocator::new(device, config.config.clone());
                // The tight process replays the recording its limit was chosen for.
                let which = if last {
                    0
                } else {
                    ((gpu * processes_per_gpu + k) as usize) % recordings.len()
                };
                // The node's first process follows a placement plan made from its recording
                // (as `gpumem plan` makes it): the plan's series and its savings on show.
                let mut settings = config.config.last_settings.clone();
                if gpu == 0 && k == 0 {
                    let (name, recording) = &recordings[which];
                    let fail = |e: &dyn std::fmt::Display| SimNodeError::Recording {
                        recording: name,
                        reason: e.to_string(),
                    };
                    let planned =
                        crate::plan::plan(recording, name, &crate::plan::PlanOptions::default())
                            .map_err(|e| fail(&e))?;
                    alloc
                        .set_plan(Arc::new(planned.plan))
                        .map_err(|e| fail(&e))?;
                    let plan = format!("plan:{name}.plan.json");
                    settings = if settings.is_empty() {
                        plan
                    } else {
                        format!("{settings},{plan}")
                    };
                }
                let uuid = if mig {
                    simulated_mig_uuid(gpu, k)
                } else {
                    simulated_uuid(gpu)
                };
                let pushes = config.oom_job && gpu == 0 && k + 1 == processes_per_gpu && k > 0;
                let pid = if pushes {
                    oom_job = Some((allocators.len(), process_limit));
                    PUSHED_PID
                } else {
                    10_000 + gpu * 100 + k
                };
                processes.push(Arc::new(AllocatorSource::of_gpumem(
                    gpu,
                    uuid,
                    pid,
                    settings,
                    Arc::clone(alloc.stats()),
                )));
                allocators.push((which, alloc));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let still = Arc::new(AtomicBool::new(false));
        let heartbeat = Heartbeat::new("sim-node", Heartbeat::allowance_for(config.tick));
        let thread = {
            let stop = Arc::clone(&stop);
            let still = Arc::clone(&still);
            let heartbeat = heartbeat.clone();
            let sources = processes.clone();
            let sink = Arc::clone(&sink);
            let (speed, tick) = (config.speed.max(0.0), config.tick);
            let recordings: Vec<Recording> = recordings.into_iter().map(|(_, r)| r).collect();
            std::thread::Builder::new()
                .name("gpumem-sim-node".into())
                .spawn(move || {
                    replay_loop(
                        recordings, allocators, oom_job, sink, sources, speed, tick, &stop, &still,
                        &heartbeat,
                    )
                })
                .map_err(SimNodeError::Thread)?
        };
        Ok(SimNode {
            config,
            processes,
            sink,
            stop,
            still,
            heartbeat,
            thread: Some(thread),
        })
    }

    /// At speed 0, whether every process has reached its still picture (replays catch up in
    /// rounds of bounded time, so a loaded machine takes a while); false at any other speed.
    pub fn is_still(&self) -> bool {
        self.still.load(Ordering::Acquire)
    }

    /// Beaten after every step of the replay thread (for `/healthz` and `/readyz`).
    pub fn heartbeat(&self) -> Heartbeat {
        self.heartbeat.clone()
    }

    /// The allocators the processes hold, for the allocator collector (the job that runs out
    /// of memory pushes its own, as a PyTorch job does: [`SimNode::push_to`]).
    pub fn allocator_sources(&self) -> Vec<Arc<AllocatorSource>> {
        self.processes
            .iter()
            .filter(|p| p.pid != PUSHED_PID)
            .cloned()
            .collect()
    }

    /// Sends the pushes of the job that runs out of memory to `push` (the agent's ingest; the
    /// first call only).
    pub fn push_to(&self, push: impl Fn(u32, &[u8]) + Send + Sync + 'static) {
        let _ = self.sink.set(Box::new(push));
    }

    /// What the kubelet of this simulated node says: each process's pod and container names,
    /// and each GPU's time slices (or MIG devices) assigned to them.
    pub fn kubelet(&self) -> Kubelet {
        let mut pods = Vec::new();
        let mut containers = Vec::new();
        let mut assigned = Vec::new();
        for p in &self.processes {
            let (container, pod) = simulated_pod(p.pid);
            pods.push((container.pod_uid, SIM_NAMESPACE.to_string(), pod.clone()));
            containers.push((container.container_id, "trainer".to_string()));
            assigned.push((p.uuid.clone(), pod));
        }
        let answer = ListPodResourcesResponse {
            pod_resources: assigned
                .iter()
                .enumerate()
                .map(|(i, (uuid, pod))| api::PodResources {
                    name: pod.clone(),
                    namespace: SIM_NAMESPACE.into(),
                    containers: vec![ContainerResources {
                        name: "trainer".into(),
                        devices: vec![if uuid.starts_with("MIG-") {
                            ContainerDevices {
                                resource_name: format!("nvidia.com/mig-{}", self.mig_profile()),
                                device_ids: vec![uuid.clone()],
                            }
                        } else {
                            ContainerDevices {
                                resource_name: "nvidia.com/gpu".into(),
                                device_ids: vec![format!("{uuid}::{i}")],
                            }
                        }],
                        dynamic_resources: Vec::new(),
                    }],
                })
                .collect(),
        };
        let resources = PodResources::new();
        resources.publish(&answer, 0.0);
        Kubelet {
            names: Some(PodNames::fixed(NameDirectory::from_names(pods, containers))),
            resources: Some(resources),
        }
    }

    /// The profile of the MIG devices of the GPU in MIG mode.
    fn mig_profile(&self) -> String {
        let slices = (7 / self.config.processes_per_gpu).max(1);
        mig_profile(slices, self.config.share())
    }

    /// A [`GpuSource`] giving the node's NVML view.
    pub fn gpu_source(&self) -> SimNodeSource {
        SimNodeSource {
            config: self.config.clone(),
            processes: self.processes.clone(),
        }
    }

    /// A reader of the node's NVML view computed when called. Reading costs next to nothing
    /// and needs no lock, so a scrape computes it directly: the device view then matches the
    /// allocator counters read in the same scrape (a real node's NVML is polled instead).
    pub fn report_reader(&self) -> impl Fn() -> Arc<SourceReport> + Send + Sync + 'static {
        let source = self.gpu_source();
        move || {
            let started = Instant::now();
            let sample = source.view();
            Arc::new(SourceReport::up(
                SIMULATED,
                Some(sample),
                started.elapsed().as_secs_f64(),
            ))
        }
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn offsets(recording: &Recording) -> Vec<u64> {
    let events = recording.trace(0);
    let first = events.iter().find_map(|e| e.time_us);
    events
        .iter()
        .enumerate()
        .map(|(k, e)| match (e.time_us, first) {
            (Some(t), Some(t0)) => t.saturating_sub(t0),
            _ => k as u64 * 1_000_000 / EVENTS_PER_SECOND_UNTIMED,
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn replay_loop(
    recordings: Vec<Recording>,
    allocators: Vec<(usize, CachingAllocator<SimDevice>)>,
    oom_job: Option<(usize, u64)>,
    sink: PushSink,
    sources: Vec<Arc<AllocatorSource>>,
    speed: f64,
    tick: Duration,
    stop: &AtomicBool,
    still: &AtomicBool,
    heartbeat: &Heartbeat,
) {
    let mut runs: Vec<Run<'_>> = allocators
        .into_iter()
        .zip(sources)
        .enumerate()
        .map(|(i, ((which, alloc), source))| {
            // The OOM job runs its own program on its allocator; the others replay.
            let (spare, job) = match oom_job {
                Some((at, limit)) if at == i => {
                    let job = OomJob::new(alloc, limit, Arc::clone(&source), Arc::clone(&sink));
                    (None, Some(job))
                }
                _ => (Some(alloc), None),
            };
            (which, source, spare, job)
        })
        .map(|(which, source, spare, job)| Run {
            source,
            recording: &recordings[which],
            offsets: offsets(&recordings[which]),
            replayer: None,
            spare,
            job,
            started: Instant::now(),
            finished_at: None,
            peak: crate::explain::peak_reserved_event(recordings[which].trace(0)).unwrap_or(0),
        })
        .collect();
    while !stop.load(Ordering::Relaxed) {
        let mut caught_up = true;
        for run in &mut runs {
            match step(run, speed, stop) {
                Ok(done) => caught_up &= done,
                Err(e) => {
                    tracing::warn!(pid = run.source.pid, error = %e, "simulated process stopped");
                    run.replayer = None;
                    run.spare = None;
                }
            }
        }
        if speed == 0.0 && caught_up {
            still.store(true, Ordering::Release);
        }
        heartbeat.beat();
        std::thread::sleep(tick);
    }
}

/// Advances one process to where its recording's clock says it should be; whether it got
/// there (the job that runs out of memory always does).
fn step(run: &mut Run<'_>, speed: f64, stop: &AtomicBool) -> Result<bool, ReplayError> {
    if let Some(job) = &mut run.job {
        job.step(speed);
        return Ok(true);
    }
    if run.replayer.is_none() {
        let Some(alloc) = run.spare.take() else {
            return Ok(true);
        };
        run.replayer = Some(Cursor::on(run.recording, 0, alloc)?);
        run.started = Instant::now();
        run.finished_at = None;
    }
    let replayer = run.replayer.as_mut().expect("started above");
    let due = if speed > 0.0 {
        let elapsed_us = (run.started.elapsed().as_secs_f64() * speed * 1e6) as u64;
        run.offsets.partition_point(|&t| t <= elapsed_us)
    } else {
        // A still picture: each process held where its recording reserved the most.
        run.peak + 1
    };
    let deadline = Instant::now() + ROUND_BUDGET;
    while replayer.position() < due && Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
        let chunk = due.min(replayer.position().saturating_add(EVENTS_PER_CHUNK));
        replayer.advance_to(chunk)?;
    }
    let arrived = replayer.position() >= due.min(replayer.len());
    let allocator = replayer.allocator();
    run.source
        .publish_cache(allocator.largest_free_block(), allocator.segments_by_size());
    if run.source.segments.wanted() {
        run.source.segments.publish(allocator.segment_infos());
    }
    if speed > 0.0 && replayer.position() >= replayer.len() {
        let finished = *run.finished_at.get_or_insert_with(Instant::now);
        if finished.elapsed() >= PAUSE_BETWEEN_RUNS {
            let replayer = run.replayer.take().expect("running");
            run.spare = Some(replayer.finish()?);
        }
    }
    Ok(arrived)
}

/// The NVML view of a [`SimNode`].
pub struct SimNodeSource {
    config: SimNodeConfig,
    processes: Vec<Arc<AllocatorSource>>,
}

/// The `source` label of the simulated node.
const SIMULATED: &str = "simulated";

impl GpuSource for SimNodeSource {
    fn name(&self) -> &'static str {
        SIMULATED
    }

    fn sample(&mut self) -> Result<NodeSample, SourceError> {
        Ok(self.view())
    }
}

impl SimNodeSource {
    /// The node as NVML would report it now.
    pub fn view(&self) -> NodeSample {
        let (context, share) = (self.config.context_overhead, self.config.share());
        let slices = (7 / self.config.processes_per_gpu).max(1);
        let gpus = (0..self.config.gpus)
            .map(|gpu| {
                let processes: Vec<ProcessSample> = self
                    .processes
                    .iter()
                    .filter(|p| p.gpu == gpu)
                    .map(|p| ProcessSample {
                        pid: p.pid,
                        name: "python".into(),
                        container: Some(simulated_pod(p.pid).0),
                        used: Some(p.stats.reserved_bytes.all_current().max(0) as u64 + context),
                    })
                    .collect();
                let used: u64 = processes.iter().filter_map(|p| p.used).sum();
                let (processes, mig) = if self.config.mig_gpu() == Some(gpu) {
                    // Each process on a MIG device of its own: NVML lists it there.
                    let mig = processes
                        .into_iter()
                        .zip(0..)
                        .map(|(p, index)| {
                            let used = p.used.unwrap_or(0).min(share);
                            MigSample {
                                index,
                                uuid: simulated_mig_uuid(gpu, index),
                                gpu_instance: index + 1,
                                compute_instance: 0,
                                profile: mig_profile(slices, share),
                                total: share,
                                used,
                                free: share - used,
                                processes: vec![p],
                            }
                        })
                        .collect();
                    (Vec::new(), mig)
                } else {
                    (processes, Vec::new())
                };
                GpuSample {
                    index: gpu,
                    uuid: simulated_uuid(gpu),
                    minor: Some(gpu),
                    model: "Simulated GPU".into(),
                    total: self.config.capacity,
                    used,
                    free: self
                        .config
                        .capacity
                        .saturating_sub(used + self.config.driver_reserved),
                    reserved: Some(self.config.driver_reserved),
                    processes,
                    mig,
                }
            })
            .collect();
        NodeSample {
            driver_version: "simulated".into(),
            simulated: true,
            gpus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::{PoolId, TraceAction};
    use crate::replay::{Session, Setup};

    #[test]
    fn the_private_pools_process_replays_both_pools_exactly() {
        let recording = private_pools_recording().expect("recorded");
        let events = &recording.device_traces[0];
        for pool in [PoolId(1, 0), PoolId(0, 1)] {
            assert!(
                events
                    .iter()
                    .any(|e| e.action == TraceAction::Alloc && e.pool == pool),
                "allocations in {pool}"
            );
        }
        let report = Session::new(std::sync::Arc::new(recording.clone()), Setup::default())
            .and_then(|s| s.check())
            .expect("replays");
        assert_eq!(report.divergence, None);
        assert_eq!(report.compared.total(), events.len() as u64);
        // The pools were released at the end and their cache flushed with it.
        assert!(
            events
                .last()
                .is_some_and(|e| e.action == TraceAction::SegmentFree)
        );
    }
}
