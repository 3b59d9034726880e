//! One scrape's reading of the node, typed, rendered twice: as the exposition
//! (`collect/`) and as the live page (`view::node`). Each request takes its own snapshot;
//! within one, the page shows what the exposition exports, computed by the same functions
//! here (`tests/it/node_view.rs` checks it value for value on a still node).
//!
//! # Invariants
//! - A snapshot reads the allocator sources' list, each polled source's latest report, the
//!   kubelet's parts and the ingest's report once, when it is taken; never a source itself,
//!   never an allocator's lock. An allocator's reserved and allocated bytes and its cache's
//!   figures are read then too (the page's figures agree with each other); its other
//!   counters are read, lock-free, when the exposition renders them.
//! - An allocator is placed where NVML reports its device ([`PlacedAllocator`]: NVML's index
//!   and UUID of its GPU, and its MIG device), else where it says; its labels are its own,
//!   then its pod as NVML's view gives it where it names none, the pod's names where known,
//!   and its MIG device's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::allocator::breakdown::Part;
use crate::sources::{AllocatorSource, Cache, IngestReport, LastOom};
use crate::telemetry::pod_names::NameDirectory;
use crate::telemetry::pod_resources::PodDirectory;
use crate::telemetry::{GpuSample, MigSample, SourceReport, uuid_body};

use super::contract::label;
use super::names::{Names, mig_labels, process_labels, process_pods, value_of};

/// What one scrape reads.
pub struct NodeSnapshot {
    /// When it was taken: what the cache figures' age is counted to.
    pub taken: Instant,
    /// How long reading the allocators' list and the polled sources' reports, and placing
    /// the allocators, took (part of the `allocator` source's collection time).
    pub placing: Duration,
    /// The allocators exported, placed.
    pub allocators: Vec<PlacedAllocator>,
    /// The polled sources' latest reports (NVML's, or the simulated node's).
    pub reports: Vec<Arc<SourceReport>>,
    /// The kubelet's parts' reports (its log directories, its pod-resources API), where read.
    pub kubelet_reports: Vec<Arc<SourceReport>>,
    /// The ingest's report, where the agent takes pushes.
    pub ingest: Option<IngestReport>,
    /// Pod and container names, where the kubelet's log directories are read.
    pub names: Option<Arc<NameDirectory>>,
    /// The pods the kubelet assigned each device, where its pod-resources API is read.
    pub assigned: Option<Arc<PodDirectory>>,
}

/// The MIG device an allocator runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigPlace {
    /// Its GPU instance's ID (`GPU_I_ID`).
    pub gpu_instance: u32,
    /// Its GPU instance's profile (`GPU_I_PROFILE`).
    pub profile: String,
    /// Its UUID (`mig_uuid`).
    pub uuid: String,
}

/// A pod's names, as the kubelet's log directories (or a pod-network push) give them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodName {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub pod: String,
    /// The container's name.
    pub container: String,
}

/// An allocator, placed on the node.
pub struct PlacedAllocator {
    /// Its source (counters and what its owner published).
    pub source: Arc<AllocatorSource>,
    /// Its GPU's index (NVML's, where NVML lists its device).
    pub gpu: u32,
    /// Its GPU's UUID (NVML's spelling, where NVML lists its device).
    pub uuid: String,
    /// Its MIG device, where it runs on one.
    pub mig: Option<MigPlace>,
    /// Its pod's names, each empty where not known.
    pub pod: PodName,
    /// Reserved bytes over its pools, when the snapshot was taken.
    pub reserved: i64,
    /// Allocated bytes over its pools, then.
    pub allocated: i64,
    /// Its cache's figures as last published, read then.
    pub cache: Option<Cache>,
    /// Its series' labels beyond the contract's: see the module's invariants.
    pub labels: Vec<(String, String)>,
}

/// `part / whole`, 0 for an empty whole; never negative, whatever a source reports.
pub fn ratio(part: i64, whole: i64) -> f64 {
    if whole <= 0 {
        0.0
    } else {
        part.max(0) as f64 / whole as f64
    }
}

impl PlacedAllocator {
    /// Reserved but unallocated, as a share of reserved.
    pub fn fragmentation(&self) -> f64 {
        ratio(self.reserved.saturating_sub(self.allocated), self.reserved)
    }

    /// The largest cached free block, where its owner said.
    pub fn largest_free_block(&self) -> Option<u64> {
        self.cache.as_ref().map(|c| c.largest_free_block)
    }

    /// How old its cache's figures were at `now`, where its owner published them.
    pub fn cache_age(&self, now: Instant) -> Option<Duration> {
        self.cache
            .as_ref()
            .map(|c| now.saturating_duration_since(c.read_at))
    }

    /// Its last OOM's explanation, where its owner published one.
    pub fn last_oom(&self) -> Option<LastOom> {
        self.source.last_oom()
    }

    /// When it last ran out of memory (Unix seconds): a push says so in its own field, an
    /// allocator this process holds with its OOM.
    pub fn last_oom_at(&self, last_oom: Option<&LastOom>) -> Option<f64> {
        self.source
            .last_oom_unix_seconds
            .or_else(|| last_oom.and_then(|o| o.at_unix_seconds))
    }
}

/// Where the memory was at an OOM, by the exposition's `kind`: the breakdown's parts that
/// were measured (live tensors' bytes are `allocated`, the JSON's `requested`).
pub fn oom_parts(oom: &LastOom) -> impl Iterator<Item = (&'static str, u64)> {
    oom.breakdown
        .parts()
        .into_iter()
        .filter_map(|(part, bytes)| {
            let kind = match part {
                Part::Requested => "allocated",
                other => other.field(),
            };
            Some((kind, bytes?))
        })
}

/// Where a device lies on the node, as NVML reports it.
#[derive(Clone, Copy)]
struct Place<'a> {
    index: u32,
    uuid: &'a str,
    mig: Option<&'a MigSample>,
}

/// Every GPU and MIG device NVML reports, by UUID and by the UUID's body. A pushed device's
/// index is the job's CUDA ordinal (in a container given host GPU 5 it says 0) and a MIG job's
/// hook may spell its device `GPU-…`, so pushed series take NVML's place.
struct Places<'a> {
    exact: HashMap<&'a str, Place<'a>>,
    body: HashMap<String, Place<'a>>,
}

impl<'a> Places<'a> {
    fn of(reports: &'a [Arc<SourceReport>]) -> Self {
        let mut places = Places {
            exact: HashMap::new(),
            body: HashMap::new(),
        };
        for gpu in reports.iter().flat_map(|r| r.gpus()) {
            for (mig, uuid, _) in gpu.devices() {
                let place = Place {
                    index: gpu.index,
                    uuid: &gpu.uuid,
                    mig,
                };
                places.exact.insert(uuid, place);
                places.body.insert(uuid_body(uuid), place);
            }
        }
        places
    }

    fn find(&self, uuid: &str) -> Option<Place<'a>> {
        self.exact
            .get(uuid)
            .or_else(|| self.body.get(&uuid_body(uuid)))
            .copied()
    }
}

impl NodeSnapshot {
    /// A snapshot of the allocator `sources` and the polled sources' `reports`, read from
    /// `started`, with the kubelet's parts (`names`, `assigned`); the kubelet's reports and the
    /// ingest's are the caller's to add.
    pub fn new(
        started: Instant,
        sources: &[Arc<AllocatorSource>],
        reports: Vec<Arc<SourceReport>>,
        kubelet: (Option<Arc<NameDirectory>>, Option<Arc<PodDirectory>>),
    ) -> NodeSnapshot {
        let (names, assigned) = kubelet;
        let allocators = {
            let pods = process_pods(&reports);
            let places = Places::of(&reports);
            let named = Names(names.as_deref());
            sources
                .iter()
                .map(|s| {
                    let place = places.find(&s.uuid);
                    let (gpu, uuid) = place.map_or((s.gpu, s.uuid.as_str()), |p| (p.index, p.uuid));
                    let nvml = pods.get(&(uuid, s.pid)).copied();
                    let mut labels = process_labels(&s.labels, nvml, named).into_owned();
                    let mig = place.and_then(|p| p.mig);
                    if let Some(mig) = mig {
                        labels.extend(mig_labels(mig));
                    }
                    let of = |name| value_of(&labels, name).unwrap_or_default().to_string();
                    let pod = PodName {
                        namespace: of(label::POD_NAMESPACE),
                        pod: of(label::POD_NAME),
                        container: of(label::CONTAINER_NAME),
                    };
                    PlacedAllocator {
                        reserved: s.stats.reserved_bytes.all_current(),
                        allocated: s.stats.allocated_bytes.all_current(),
                        cache: s.cache(),
                        source: Arc::clone(s),
                        gpu,
                        uuid: uuid.to_string(),
                        mig: mig.map(|m| MigPlace {
                            gpu_instance: m.gpu_instance,
                            profile: m.profile.clone(),
                            uuid: m.uuid.clone(),
                        }),
                        pod,
                        labels,
                    }
                })
                .collect()
        };
        NodeSnapshot {
            taken: started,
            placing: started.elapsed(),
            allocators,
            reports,
            kubelet_reports: Vec::new(),
            ingest: None,
            names,
            assigned,
        }
    }

    /// The GPUs its polled sources report.
    pub fn gpus(&self) -> impl Iterator<Item = &GpuSample> {
        self.reports.iter().flat_map(|r| r.gpus())
    }

    /// The pod and container names of this snapshot.
    pub(super) fn names(&self) -> Names<'_> {
        Names(self.names.as_deref())
    }
}
