//! The allocators an agent exports, as plain data shared by whoever fills the list (the
//! simulated node, the PyTorch plug-in, the push ingest) and the collector that reads it.
//!
//! # Invariants
//! - A source's counters are read without any lock ([`DeviceStats`] are atomics); the list
//!   itself is swapped under one short lock, so a scrape sees each producer's whole update or
//!   none of it.
//! - [`AllocatorSources::replace`] changes only the sources of the kinds it names, so the
//!   ingest (PyTorch's and XLA's) never touches the agent's own allocators and the other way
//!   round.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use crate::allocator::breakdown::{Breakdown, Kind};
use crate::allocator::{DeviceStats, SegmentClass, SegmentInfo};

/// Whose counters a source carries: the `allocator` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllocatorKind {
    /// gpumem's own caching allocator (simulated node, PyTorch plug-in).
    Gpumem,
    /// PyTorch's allocator, as a job pushed its `memory_stats()`.
    Pytorch,
    /// XLA's allocator (a JAX job's), as the job pushed its devices' `memory_stats()`.
    Xla,
}

impl AllocatorKind {
    /// The `allocator` label value.
    pub fn label(self) -> &'static str {
        match self {
            AllocatorKind::Gpumem => "gpumem",
            AllocatorKind::Pytorch => "pytorch",
            AllocatorKind::Xla => "xla",
        }
    }
}

/// An allocator whose counters are exported: where it runs and its published statistics.
#[derive(Debug)]
pub struct AllocatorSource {
    /// GPU index as the source knows it (a pushed one is the job's CUDA ordinal; the
    /// collector replaces it by NVML's host index where the UUID is known).
    pub gpu: u32,
    /// GPU UUID.
    pub uuid: String,
    /// Process id.
    pub pid: u32,
    /// Whose counters.
    pub allocator: AllocatorKind,
    /// Allocator version.
    pub version: String,
    /// The configuration string in force.
    pub config: String,
    /// The counters, read without any lock.
    pub stats: Arc<DeviceStats>,
    /// Its cache's figures, as last published by the allocator's owner (a pushed process
    /// sends them with a push that carries a memory snapshot; they stand until the next);
    /// `None` while nobody has said, and then they are not exported.
    pub cache: Mutex<Option<Cache>>,
    /// Extra labels (a push's own, renamed where they collide, then pod_uid and
    /// container_id where the kernel named the process), added to each of its series.
    pub labels: Vec<(String, String)>,
    /// When the process last ran out of memory (Unix seconds), as far as the exporter saw.
    pub last_oom_unix_seconds: Option<f64>,
    /// The explanation of its last out-of-memory error, as its owner last published it (a
    /// pushed process with its OOM push, standing until the next; gpumem's own allocator from
    /// its out-of-memory error); `None` while nobody has said.
    pub last_oom: Mutex<Option<LastOom>>,
    /// Its segments, for a live segment map, where its owner holds the allocator.
    pub segments: SegmentsOnRequest,
    /// What XLA's allocator reports beyond its statistics, for an [`AllocatorKind::Xla`]
    /// source (`None` for the others).
    pub xla: Option<XlaFigures>,
    /// Of its reserved bytes, those whose physical memory a pool has unmapped (a sleeping
    /// vLLM or SGLang pool, as the job said): reserved, resident nowhere, left out of NVML's
    /// per-process figure. At most its reserved bytes.
    pub unmapped: u64,
    /// The limit a GPU-sharing layer enforces on its container on this device, where its
    /// owner said.
    pub memory_limit: Option<MemoryLimit>,
}

/// A device-memory limit a GPU-sharing layer (HAMi, volcano's vGPU) enforces on a container
/// on one device, from a variable it set in the container's environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    /// The limit.
    pub bytes: u64,
    /// The variable that set it (`CUDA_DEVICE_MEMORY_LIMIT_0`).
    pub variable: String,
}

/// What XLA's allocator reports (PJRT's `memory_stats()` of a JAX device) that its
/// [`DeviceStats`] do not carry: which of the contract's figures it has, and its limit.
/// Its statistics hold `bytes_in_use` and `peak_bytes_in_use` as allocated bytes, and
/// `pool_bytes` and `peak_pool_bytes` as reserved bytes, in the large pool's place (it has
/// one pool); the out-of-memory errors the hook counted as `num_ooms`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XlaFigures {
    /// Whether it reported `bytes_in_use` (its allocated bytes).
    pub has_in_use: bool,
    /// Whether it reported `peak_bytes_in_use`.
    pub has_peak_in_use: bool,
    /// Whether it reported `pool_bytes` (its reserved bytes).
    pub has_pool: bool,
    /// Whether it reported `peak_pool_bytes`.
    pub has_peak_pool: bool,
    /// Whether the hook counted its out-of-memory errors (`num_ooms`, on the job's first
    /// GPU).
    pub has_ooms: bool,
    /// `bytes_limit`: the most it may hold, where reported.
    pub limit: Option<u64>,
}

/// An allocator's segments, published by the allocator's owner when someone asks: a reader
/// [`request`](SegmentsOnRequest::request)s them and gets the latest list if it is fresh
/// (published within [`SEGMENTS_FRESH`]); the owner, on its own schedule (a refresh round,
/// between replay steps), sees that they were [`wanted`](SegmentsOnRequest::wanted) and
/// publishes a new list if it can take the allocator without waiting (else it asks itself
/// again for the next round). So nobody pays for the list while nobody looks, a reader never
/// holds up an allocation, and no reader is shown an old map as a current one.
#[derive(Debug, Default)]
pub struct SegmentsOnRequest {
    wanted: AtomicBool,
    latest: Mutex<Option<(Instant, Arc<Vec<SegmentInfo>>)>>,
}

/// How old a published list may be and still be served.
pub const SEGMENTS_FRESH: std::time::Duration = std::time::Duration::from_secs(5);

impl SegmentsOnRequest {
    /// Asks for a fresh list; the latest published one, if it is fresh.
    pub fn request(&self) -> Option<Arc<Vec<SegmentInfo>>> {
        self.wanted.store(true, Ordering::Relaxed);
        self.latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|(at, _)| at.elapsed() <= SEGMENTS_FRESH)
            .map(|(_, segments)| Arc::clone(segments))
    }

    /// Whether a reader asked since the last call (the owner's question).
    pub fn wanted(&self) -> bool {
        self.wanted.swap(false, Ordering::Relaxed)
    }

    /// Keeps the question for the owner's next round (it could not answer this one).
    pub fn ask_again(&self) {
        self.wanted.store(true, Ordering::Relaxed);
    }

    /// Publishes `segments`.
    pub fn publish(&self, segments: Vec<SegmentInfo>) {
        *self.latest.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((Instant::now(), Arc::new(segments)));
    }
}

/// The explanation of an out-of-memory error: where the device's memory was, the part most to
/// blame, and the sentence.
#[derive(Clone, Debug, PartialEq)]
pub struct LastOom {
    /// Where the memory was; it adds up to the device's total.
    pub breakdown: Breakdown,
    /// The part most to blame.
    pub kind: Kind,
    /// The explanation in one sentence.
    pub why: String,
    /// When it happened (Unix seconds), where its owner said (a pushed process says so in
    /// [`AllocatorSource::last_oom_unix_seconds`] instead).
    pub at_unix_seconds: Option<f64>,
}

impl From<&crate::allocator::OutOfMemory> for LastOom {
    fn from(oom: &crate::allocator::OutOfMemory) -> LastOom {
        LastOom {
            at_unix_seconds: None,
            breakdown: oom.accounting.breakdown.clone(),
            kind: oom
                .kinds
                .first()
                .copied()
                .unwrap_or(crate::allocator::breakdown::Kind::TooBig),
            why: oom.why.clone(),
        }
    }
}

impl AllocatorSource {
    /// A gpumem allocator this process holds, on GPU `gpu` (`uuid`) under `config`, with its
    /// statistics: nothing else published yet (no cached block, no classes, no OOM).
    pub fn of_gpumem(
        gpu: u32,
        uuid: String,
        pid: u32,
        config: String,
        stats: Arc<DeviceStats>,
    ) -> AllocatorSource {
        AllocatorSource {
            gpu,
            uuid,
            pid,
            allocator: AllocatorKind::Gpumem,
            version: env!("CARGO_PKG_VERSION").to_string(),
            config,
            stats,
            cache: Mutex::new(None),
            labels: Vec::new(),
            last_oom_unix_seconds: None,
            last_oom: Default::default(),
            segments: Default::default(),
            xla: None,
            unmapped: 0,
            memory_limit: None,
        }
    }

    /// An allocator as `process` pushed it on GPU `gpu` (`uuid`): PyTorch's, or XLA's
    /// where `xla` says what it reported; its statistics, its cache's figures where they
    /// stand, and its last OOM's explanation, where one stands.
    pub fn pushed(
        process: &Pusher,
        (gpu, uuid): (u32, String),
        stats: DeviceStats,
        xla: Option<XlaFigures>,
        cache: Option<Cache>,
        last_oom: Option<LastOom>,
    ) -> AllocatorSource {
        let (allocator, version, config) = match xla {
            Some(_) => (AllocatorKind::Xla, &process.xla.0, &process.xla.1),
            None => (AllocatorKind::Pytorch, &process.version, &process.config),
        };
        AllocatorSource {
            gpu,
            uuid,
            pid: process.pid,
            allocator,
            version: version.clone(),
            config: config.clone(),
            stats: Arc::new(stats),
            cache: Mutex::new(cache),
            labels: process.labels.clone(),
            last_oom_unix_seconds: process.last_oom_unix_seconds,
            last_oom: Mutex::new(last_oom),
            segments: Default::default(),
            xla,
            unmapped: 0,
            memory_limit: None,
        }
    }

    /// The cache's figures as last published, if they were.
    pub fn cache(&self) -> Option<Cache> {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Publishes the cache's figures, read now (its owner's call: an allocator this process
    /// holds, between its operations).
    pub fn publish_cache(&self, largest_free_block: u64, segments_by_size: Vec<SegmentClass>) {
        *self.cache.lock().unwrap_or_else(PoisonError::into_inner) = Some(Cache {
            largest_free_block,
            segments_by_size,
            read_at: Instant::now(),
        });
    }

    /// The explanation of its last OOM, as last published.
    pub fn last_oom(&self) -> Option<LastOom> {
        self.last_oom
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// What an allocator's cache held when it was read: what a request can be served from
/// without the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cache {
    /// The largest cached free block: the biggest request it can serve without the driver.
    pub largest_free_block: u64,
    /// Its segments by size class, sorted by size.
    pub segments_by_size: Vec<SegmentClass>,
    /// When it was read (a pushed snapshot: when the push carrying it was received).
    pub read_at: Instant,
}

/// What a pushing process says of itself, the same on each of its devices' sources.
#[derive(Clone, Debug, Default)]
pub struct Pusher {
    /// Its pid (the host's, where the kernel or the node named it).
    pub pid: u32,
    /// `torch.__version__`.
    pub version: String,
    /// `PYTORCH_CUDA_ALLOC_CONF`.
    pub config: String,
    /// `jax.__version__` and its XLA client's settings (`XLA_PYTHON_CLIENT_*`), for its XLA
    /// allocators.
    pub xla: (String, String),
    /// Its labels: the push's own, then its container's and pod's where named.
    pub labels: Vec<(String, String)>,
    /// When it last ran out of memory (Unix seconds), as far as the agent saw.
    pub last_oom_unix_seconds: Option<f64>,
}

/// The allocators exported by an agent; the list may change while it runs.
#[derive(Clone, Debug, Default)]
pub struct AllocatorSources(Arc<Mutex<Vec<Arc<AllocatorSource>>>>);

impl AllocatorSources {
    /// A list holding `sources`.
    pub fn new(sources: Vec<Arc<AllocatorSource>>) -> AllocatorSources {
        AllocatorSources(Arc::new(Mutex::new(sources)))
    }

    /// Adds one source.
    pub fn add(&self, source: Arc<AllocatorSource>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(source);
    }

    /// The sources now.
    pub fn snapshot(&self) -> Vec<Arc<AllocatorSource>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces every source of the `kinds` by `sources`, in one step.
    pub fn replace(&self, kinds: &[AllocatorKind], sources: Vec<Arc<AllocatorSource>>) {
        let mut list = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        list.retain(|s| !kinds.contains(&s.allocator));
        list.extend(sources);
    }
}

/// What the push ingest reports at a scrape, as plain data (the collector never calls into
/// the ingest).
#[derive(Clone, Debug, Default)]
pub struct IngestReport {
    /// (result, payloads): `accepted`, then each refusal reason.
    pub results: Vec<(&'static str, u64)>,
    /// The processes whose series are served, by pid.
    pub processes: Vec<PushedProcess>,
    /// Out-of-memory errors counted per pod and container, kept beyond the processes.
    pub pod_ooms: Vec<PodOoms>,
    /// The pinned host memory of the processes whose pushes report it, by pid.
    pub hosts: Vec<PushedHost>,
    /// The recordings jobs uploaded, where the agent keeps them.
    pub recordings: Option<RecordingsReport>,
}

/// What the agent's store of uploaded recordings holds (`ingest::recordings`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordingsReport {
    /// Recordings kept.
    pub stored: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Uploads refused, by reason (the ingest's refusal labels).
    pub refused: Vec<(&'static str, u64)>,
    /// What became of the recordings to archive, where the agent archives them.
    pub uploads: Option<UploadsReport>,
}

/// The archive's side of the recordings (`archive::uploader`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UploadsReport {
    /// Attempts to archive a recording, by result (`uploaded`, `failed`, `evicted`).
    pub results: Vec<(&'static str, u64)>,
    /// Recordings kept and not archived yet.
    pub pending: usize,
}

/// A pushed process's pinned host memory (PyTorch's `CachingHostAllocator`, read from
/// `torch.cuda.host_memory_stats()` under its 2.10+ key names). A figure the push did not
/// carry is `None` and is not exported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostPinned {
    /// Bytes of the pool's blocks, in use and cached (`allocated_bytes.current`).
    pub allocated_bytes: Option<u64>,
    /// Bytes of the blocks in use (`active_bytes.current`).
    pub active_bytes: Option<u64>,
    /// The pool's blocks, in use and cached (`allocations.current`).
    pub allocations: Option<u64>,
    /// Blocks in use (`active_requests.current`).
    pub active_requests: Option<u64>,
    /// Pinned allocations obtained from the driver, ever (`num_host_alloc`).
    pub host_allocs: Option<u64>,
    /// Pinned allocations given back to the driver, ever (`num_host_free`).
    pub host_frees: Option<u64>,
    /// Microseconds spent obtaining them (`host_alloc_time.total`).
    pub alloc_time_us: Option<u64>,
}

/// The pinned host memory of one pushed process, with the labels of its series.
#[derive(Clone, Debug)]
pub struct PushedHost {
    /// Its pid.
    pub pid: u32,
    /// Its labels, as on its allocator series (the push's own, then `pod_uid` and
    /// `container_id` where the kernel named the process).
    pub labels: Vec<(String, String)>,
    /// Its figures.
    pub pinned: HostPinned,
}

/// A process whose pushed series are served.
#[derive(Clone, Copy, Debug)]
pub struct PushedProcess {
    /// Its pid.
    pub pid: u32,
    /// When its last push was accepted.
    pub last_push: Instant,
}

/// The out-of-memory errors of one container, seen in its processes' pushes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodOoms {
    /// The pod's UID.
    pub pod_uid: String,
    /// The container's ID.
    pub container_id: String,
    /// OOMs counted since the agent first saw the container.
    pub ooms: u64,
}

/// Reads the push ingest's report, without waiting for the ingest.
pub type IngestReader = Arc<dyn Fn() -> IngestReport + Send + Sync>;
