//! The agent's collector: allocator counters and the node view, read at scrape time.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};

use crate::allocator::size::PoolKind;
use crate::sources::{AllocatorSource, AllocatorSources, IngestReader, IngestReport, UNKNOWN_SIZE};
use crate::telemetry::cgroup::ContainerRef;
use crate::telemetry::pod_names::{NameDirectory, PodNames};
use crate::telemetry::pod_resources::{DeviceIndex, PodDirectory, PodResources};
use crate::telemetry::{Kubelet, MigSample, SourceReport, uuid_body};

use super::contract::{self as c, CONTRACT, Kind, MetricDef};

/// Reads the latest report of a polled source, without waiting for the source.
pub type ReportReader = Box<dyn Fn() -> Arc<SourceReport> + Send + Sync>;

/// Series of one metric, gathered during a scrape.
struct Family {
    def: &'static MetricDef,
    metrics: Vec<proto::Metric>,
}

fn pair(name: &str, value: &str) -> LabelPair {
    let mut pair = LabelPair::default();
    pair.set_name(name.to_string());
    pair.set_value(value.to_string());
    pair
}

impl Family {
    fn push(&mut self, values: &[&str], value: f64) {
        self.push_with(values, &[], value);
    }

    /// A series with the contract's labels, then `extra` ones.
    fn push_with(&mut self, values: &[&str], extra: &[(String, String)], value: f64) {
        debug_assert_eq!(values.len(), self.def.labels.len(), "{}", self.def.name);
        let labels = self
            .def
            .labels
            .iter()
            .zip(values)
            .map(|(name, value)| pair(name, value))
            .chain(extra.iter().map(|(name, value)| pair(name, value)))
            .collect();
        let mut metric = proto::Metric::default();
        metric.set_label(labels);
        match self.def.kind {
            Kind::Gauge => {
                let mut g = proto::Gauge::default();
                g.set_value(value);
                metric.set_gauge(g);
            }
            Kind::Counter => {
                let mut k = proto::Counter::default();
                k.set_value(value);
                metric.set_counter(k);
            }
        }
        self.metrics.push(metric);
    }

    fn into_family(self) -> Option<MetricFamily> {
        if self.metrics.is_empty() {
            return None;
        }
        let mut family = MetricFamily::default();
        family.set_name(self.def.name.to_string());
        family.set_help(self.def.help.to_string());
        family.set_field_type(match self.def.kind {
            Kind::Gauge => MetricType::GAUGE,
            Kind::Counter => MetricType::COUNTER,
        });
        family.set_metric(self.metrics);
        Some(family)
    }
}

/// All the agent's metrics, from allocator sources and polled node sources.
pub struct AgentCollector {
    descs: Vec<Desc>,
    allocators: AllocatorSources,
    reports: Vec<ReportReader>,
    ingest: Option<IngestReader>,
    kubelet: Kubelet,
}

/// Builds the collector's descriptors once.
fn descs() -> Vec<Desc> {
    CONTRACT
        .iter()
        .map(|d| {
            Desc::new(
                d.name.to_string(),
                d.help.to_string(),
                d.labels.iter().map(|l| (*l).to_string()).collect(),
                Default::default(),
            )
            .expect("the contract's names and labels are valid")
        })
        .collect()
}

impl AgentCollector {
    /// A collector over these sources; the `kubelet`'s parts, where given, name pods and
    /// list GPU assignments (each reported as a source of its own).
    pub fn new(
        allocators: AllocatorSources,
        reports: Vec<ReportReader>,
        ingest: Option<IngestReader>,
        kubelet: Kubelet,
    ) -> Self {
        AgentCollector {
            descs: descs(),
            allocators,
            reports,
            ingest,
            kubelet,
        }
    }
}

/// Families by contract position, so collection code names them by constant.
struct Families(Vec<Family>);

impl Families {
    fn new() -> Self {
        Families(
            CONTRACT
                .iter()
                .map(|&def| Family {
                    def,
                    metrics: Vec::new(),
                })
                .collect(),
        )
    }

    fn of(&mut self, def: &MetricDef) -> &mut Family {
        self.0
            .iter_mut()
            .find(|f| f.def.name == def.name)
            .expect("every metric of the contract has a family")
    }
}

/// `part / whole`, 0 for an empty whole; never negative, whatever a source reports.
fn ratio(part: i64, whole: i64) -> f64 {
    if whole <= 0 {
        0.0
    } else {
        part.max(0) as f64 / whole as f64
    }
}

/// Where a device lies on the node, as NVML reports it: its GPU's index and UUID, and the MIG
/// device when it is one.
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
        let gpus = reports
            .iter()
            .filter_map(|r| r.sample.as_ref())
            .flat_map(|node| &node.gpus);
        for gpu in gpus {
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

/// The labels that name a MIG device, beside its parent's `gpu` and `UUID`.
fn mig_labels(mig: &MigSample) -> [(String, String); 3] {
    [
        ("GPU_I_ID".into(), mig.gpu_instance.to_string()),
        ("GPU_I_PROFILE".into(), mig.profile.clone()),
        ("mig_uuid".into(), mig.uuid.clone()),
    ]
}

/// The pod and container names of this scrape, from the kubelet's log directories.
#[derive(Clone, Copy)]
struct Names<'a>(Option<&'a NameDirectory>);

impl Names<'_> {
    /// (namespace, pod, container) of a pod UID and container ID, or empty strings.
    fn of(&self, pod_uid: &str, container_id: &str) -> [String; 3] {
        self.0
            .and_then(|d| d.name(pod_uid, container_id))
            .map_or_else(Default::default, |n| [n.namespace, n.pod, n.container])
    }
}

fn label<'a>(labels: &'a [(String, String)], name: &str) -> Option<&'a str> {
    labels
        .iter()
        .find_map(|(k, v)| (k == name).then_some(v.as_str()))
}

/// The pod and container of each process NVML reports, by (GPU UUID, pid); a MIG device's
/// processes by their parent GPU's UUID.
type ProcessPods<'a> = HashMap<(&'a str, u32), &'a ContainerRef>;

fn process_pods(reports: &[Arc<SourceReport>]) -> ProcessPods<'_> {
    let mut pods = ProcessPods::new();
    for gpu in reports
        .iter()
        .filter_map(|r| r.sample.as_ref())
        .flat_map(|node| &node.gpus)
    {
        for p in gpu.devices().flat_map(|(_, _, processes)| processes) {
            if let Some(container) = &p.container {
                pods.insert((gpu.uuid.as_str(), p.pid), container);
            }
        }
    }
    pods
}

/// A process's extra labels: its own, then the pod NVML's view places it in (`nvml`) where
/// it names none, and the pod's names where known.
fn process_labels<'a>(
    own: &'a [(String, String)],
    nvml: Option<&ContainerRef>,
    names: Names<'_>,
) -> Cow<'a, [(String, String)]> {
    let mut labels = Cow::Borrowed(own);
    if label(own, "pod_uid").is_none()
        && let Some(container) = nvml
    {
        let all = labels.to_mut();
        all.push(("pod_uid".into(), container.pod_uid.clone()));
        all.push(("container_id".into(), container.container_id.clone()));
    }
    let uid = label(&labels, "pod_uid").unwrap_or_default().to_string();
    let id = label(&labels, "container_id")
        .unwrap_or_default()
        .to_string();
    if let [namespace, pod, container] = names.of(&uid, &id)
        && !pod.is_empty()
    {
        // A push from the pod network names its pod already (the runtime said).
        for (name, value) in [
            ("pod_namespace", namespace),
            ("pod_name", pod),
            ("container_name", container),
        ] {
            if label(&labels, name).is_none() {
                labels.to_mut().push((name.into(), value));
            }
        }
    }
    labels
}

/// An allocator's series. Its extra labels: its own (a push's job, rank, pod_uid and
/// container_id), the pod of its process as NVML's view gives it where the source says none,
/// the pod's names where known, and its MIG device's where it runs on one.
fn collect_allocator(
    f: &mut Families,
    s: &AllocatorSource,
    pods: &ProcessPods<'_>,
    names: Names<'_>,
    places: &Places<'_>,
) {
    let place = places.find(&s.uuid);
    let (index, uuid) = place.map_or((s.gpu, s.uuid.as_str()), |p| (p.index, p.uuid));
    let (gpu, pid) = (index.to_string(), s.pid.to_string());
    let mut extra = process_labels(&s.labels, pods.get(&(uuid, s.pid)).copied(), names);
    if let Some(mig) = place.and_then(|p| p.mig) {
        extra.to_mut().extend(mig_labels(mig));
    }
    let extra = extra.as_ref();
    let base = [gpu.as_str(), uuid, pid.as_str(), s.allocator.label()];
    let st = &s.stats;
    let active_bytes = st.active_bytes();
    for pool in [PoolKind::Small, PoolKind::Large] {
        let labels = [base[0], base[1], base[2], base[3], pool.segment_type()];
        for (def, array) in [
            (&c::ALLOCATED_BYTES, &st.allocated_bytes),
            (&c::RESERVED_BYTES, &st.reserved_bytes),
            (&c::ACTIVE_BYTES, &active_bytes),
            (&c::INACTIVE_SPLIT_BYTES, &st.inactive_split_bytes),
            (&c::REQUESTED_BYTES, &st.requested_bytes),
            (&c::SEGMENTS, &st.segment),
        ] {
            f.of(def)
                .push_with(&labels, extra, array.pool(pool).current() as f64);
        }
    }
    let allocated = st.allocated_bytes.all();
    let reserved = st.reserved_bytes.all();
    let inactive_split = st.inactive_split_bytes.all_current();
    for (def, value) in [
        (&c::PEAK_ALLOCATED_BYTES, allocated.peak as f64),
        (&c::PEAK_RESERVED_BYTES, reserved.peak as f64),
        (&c::ALLOC_RETRIES, st.num_alloc_retries.get() as f64),
        (&c::OOMS, st.num_ooms.get() as f64),
        (&c::OOM_REJECTIONS, st.num_oom_rejections.get() as f64),
        (&c::DEVICE_ALLOCS, st.num_device_alloc.get() as f64),
        (&c::DEVICE_FREES, st.num_device_free.get() as f64),
        (&c::SYNC_ALL_STREAMS, st.num_sync_all_streams.get() as f64),
        (
            &c::FRAGMENTATION_RATIO,
            ratio(
                reserved.current.saturating_sub(allocated.current),
                reserved.current,
            ),
        ),
        (
            &c::INACTIVE_SPLIT_RATIO,
            ratio(inactive_split, reserved.current),
        ),
    ] {
        f.of(def).push_with(&base, extra, value);
    }
    let (hits, misses) = (st.num_plan_hits.get(), st.num_plan_misses.get());
    if hits + misses > 0 {
        for (outcome, n) in [("hit", hits), ("miss", misses)] {
            let labels = [base[0], base[1], base[2], base[3], outcome];
            f.of(&c::PLAN_REQUESTS).push_with(&labels, extra, n as f64);
        }
    }
    let last_oom = s.last_oom();
    // A push says when in its own field; an allocator this process holds with its OOM.
    let at = s
        .last_oom_unix_seconds
        .or_else(|| last_oom.as_ref().and_then(|o| o.at_unix_seconds));
    if let Some(t) = at {
        f.of(&c::LAST_OOM_TIMESTAMP).push_with(&base, extra, t);
    }
    if let Some(oom) = last_oom {
        for (field, _, bytes) in oom.breakdown.parts() {
            // The metric names live tensors' bytes `allocated` (the JSON's `requested`).
            let kind = if field == "requested" {
                "allocated"
            } else {
                field
            };
            if let Some(bytes) = bytes {
                let labels = [base[0], base[1], base[2], base[3], kind];
                f.of(&c::OOM_BREAKDOWN)
                    .push_with(&labels, extra, bytes as f64);
            }
        }
    }
    let largest = s.largest_free_block.load(Ordering::Relaxed);
    if largest != UNKNOWN_SIZE {
        f.of(&c::LARGEST_FREE_BLOCK)
            .push_with(&base, extra, largest as f64);
    }
    let classes = s
        .segment_classes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    for class in classes {
        let size = class.size.to_string();
        let labels = [base[0], base[1], base[2], base[3], size.as_str()];
        f.of(&c::SEGMENTS_BY_SIZE)
            .push_with(&labels, extra, class.segments as f64);
        f.of(&c::SEGMENT_FREE_BYTES_BY_SIZE)
            .push_with(&labels, extra, class.free_bytes as f64);
    }
    f.of(&c::ALLOCATOR_INFO).push_with(
        &[base[0], base[1], base[2], base[3], &s.version, &s.config],
        extra,
        1.0,
    );
}

fn collect_report(
    f: &mut Families,
    report: &SourceReport,
    names: Names<'_>,
    assigned: Option<&PodDirectory>,
) {
    f.of(&c::SOURCE_UP)
        .push(&[report.source], if report.up { 1.0 } else { 0.0 });
    f.of(&c::COLLECT_DURATION)
        .push(&[report.source], report.duration_seconds);
    let Some(node) = &report.sample else {
        return;
    };
    let simulated = if node.simulated { "true" } else { "false" };
    for gpu in &node.gpus {
        let index = gpu.index.to_string();
        let labels = [index.as_str(), gpu.uuid.as_str()];
        f.of(&c::DEVICE_TOTAL).push(&labels, gpu.total as f64);
        f.of(&c::DEVICE_USED).push(&labels, gpu.used as f64);
        f.of(&c::DEVICE_FREE).push(&labels, gpu.free as f64);
        if let Some(reserved) = gpu.reserved {
            f.of(&c::DEVICE_RESERVED).push(&labels, reserved as f64);
        }
        f.of(&c::DEVICE_INFO).push(
            &[
                &index,
                &gpu.uuid,
                &gpu.model,
                &node.driver_version,
                simulated,
            ],
            1.0,
        );
        for (mig, uuid, processes) in gpu.devices() {
            let at = mig.map_or(DeviceIndex::Gpu(gpu.index), |mig| {
                DeviceIndex::Mig(gpu.index, mig.index)
            });
            let named = mig.map(mig_labels);
            let extra: &[(String, String)] = named.as_ref().map_or(&[], |l| l.as_slice());
            // The contract's MIG labels are these three, in this order.
            if let (Some(mig), Some([(_, gpu_instance), (_, profile), (_, mig_uuid)])) =
                (mig, &named)
            {
                let labels = [
                    index.as_str(),
                    gpu.uuid.as_str(),
                    gpu_instance,
                    profile,
                    mig_uuid,
                ];
                f.of(&c::MIG_TOTAL).push(&labels, mig.total as f64);
                f.of(&c::MIG_USED).push(&labels, mig.used as f64);
                f.of(&c::MIG_FREE).push(&labels, mig.free as f64);
            }
            for holder in assigned
                .map(|d| d.holders(uuid, Some(at)))
                .unwrap_or_default()
            {
                f.of(&c::GPU_ASSIGNED).push_with(
                    &[
                        &index,
                        &gpu.uuid,
                        &holder.namespace,
                        &holder.pod,
                        &holder.container,
                    ],
                    extra,
                    1.0,
                );
            }
            for p in processes {
                let Some(used) = p.used else { continue };
                let pid = p.pid.to_string();
                let (pod_uid, container_id) = p
                    .container
                    .as_ref()
                    .map_or(("", ""), |c| (c.pod_uid.as_str(), c.container_id.as_str()));
                let [namespace, pod, container] = names.of(pod_uid, container_id);
                f.of(&c::PROCESS_USED).push_with(
                    &[
                        &index,
                        &gpu.uuid,
                        &pid,
                        &p.name,
                        pod_uid,
                        container_id,
                        &namespace,
                        &pod,
                        &container,
                    ],
                    extra,
                    used as f64,
                );
            }
        }
    }
}

/// Each pushed process's pinned host memory, labelled as its allocators are.
fn collect_hosts(
    f: &mut Families,
    report: &IngestReport,
    pods: &ProcessPods<'_>,
    names: Names<'_>,
) {
    for h in &report.hosts {
        // Pinned memory belongs to no GPU: the process's pod from any GPU NVML saw it on.
        let nvml = pods
            .iter()
            .find_map(|(&(_, pid), &container)| (pid == h.pid).then_some(container));
        let extra = process_labels(&h.labels, nvml, names);
        let pid = h.pid.to_string();
        let p = &h.pinned;
        // (metric, figure, figures per metric unit): microseconds become seconds.
        for (def, value, per_unit) in [
            (&c::HOST_PINNED_ALLOCATED_BYTES, p.allocated_bytes, 1.0),
            (&c::HOST_PINNED_ACTIVE_BYTES, p.active_bytes, 1.0),
            (&c::HOST_PINNED_ALLOCATIONS, p.allocations, 1.0),
            (&c::HOST_PINNED_ACTIVE_REQUESTS, p.active_requests, 1.0),
            (&c::HOST_PINNED_ALLOCS, p.host_allocs, 1.0),
            (&c::HOST_PINNED_FREES, p.host_frees, 1.0),
            (&c::HOST_PINNED_ALLOC_SECONDS, p.alloc_time_us, 1e6),
        ] {
            if let Some(value) = value {
                f.of(def)
                    .push_with(&[&pid], extra.as_ref(), value as f64 / per_unit);
            }
        }
    }
}

fn collect_ingest(f: &mut Families, report: &IngestReport, names: Names<'_>) {
    for (result, count) in &report.results {
        f.of(&c::INGEST_PAYLOADS).push(&[result], *count as f64);
    }
    f.of(&c::INGEST_TRACKED)
        .push(&[], report.processes.len() as f64);
    for p in &report.processes {
        f.of(&c::INGEST_LAST_PUSH_AGE)
            .push(&[&p.pid.to_string()], p.last_push.elapsed().as_secs_f64());
    }
    if let Some(recordings) = &report.recordings {
        f.of(&c::RECORDINGS_STORED)
            .push(&[], recordings.stored as f64);
        f.of(&c::RECORDINGS_STORED_BYTES)
            .push(&[], recordings.bytes as f64);
        for (reason, n) in &recordings.refused {
            f.of(&c::RECORDINGS_REFUSED).push(&[reason], *n as f64);
        }
    }
    for pod in &report.pod_ooms {
        let [namespace, name, container] = names.of(&pod.pod_uid, &pod.container_id);
        f.of(&c::POD_OOMS).push(
            &[
                &pod.pod_uid,
                &pod.container_id,
                &namespace,
                &name,
                &container,
            ],
            pod.ooms as f64,
        );
    }
}

impl Collector for AgentCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut f = Families::new();
        let started = Instant::now();
        let allocators = self.allocators.snapshot();
        let reports: Vec<_> = self.reports.iter().map(|read| read()).collect();
        let pods = process_pods(&reports);
        let places = Places::of(&reports);
        let directory = self.kubelet.names.as_ref().map(PodNames::directory);
        let names = Names(directory.as_deref());
        let assigned = self.kubelet.resources.as_ref().map(PodResources::directory);
        for source in &allocators {
            collect_allocator(&mut f, source, &pods, names, &places);
        }
        if !allocators.is_empty() {
            f.of(&c::SOURCE_UP).push(&["allocator"], 1.0);
            f.of(&c::COLLECT_DURATION)
                .push(&["allocator"], started.elapsed().as_secs_f64());
        }
        for report in &reports {
            collect_report(&mut f, report, names, assigned.as_deref());
        }
        let kubelet_reports = [
            self.kubelet.names.as_ref().map(PodNames::report),
            self.kubelet.resources.as_ref().map(PodResources::report),
        ];
        for report in kubelet_reports.into_iter().flatten() {
            collect_report(&mut f, &report, names, None);
        }
        if let Some(read) = &self.ingest {
            let report = read();
            collect_ingest(&mut f, &report, names);
            collect_hosts(&mut f, &report, &pods, names);
        }
        f.of(&c::BUILD_INFO).push(&[env!("CARGO_PKG_VERSION")], 1.0);
        f.0.into_iter().filter_map(Family::into_family).collect()
    }
}
