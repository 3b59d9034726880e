//! The agent's collector: allocator counters and the node view, read at scrape time, one
//! file per source as node_exporter's collectors are: `allocator.rs` (each allocator's
//! counters, pushed or held), `node.rs` (a polled source's report: NVML or the simulated
//! node, the kubelet's parts), `ingest.rs` (the ingest's counters and pushed processes'
//! pinned host memory), each over one [`NodeSnapshot`] (`metrics/snapshot.rs`).
//!
//! # Invariants
//! - A series' label values are the contract's labels for its metric, in order, then extra
//!   labels: [`Families::of`] takes a [`Metric<N>`] and its series `[&str; N]`, so the count
//!   is checked where the code is compiled.
//! - A family without series is not exported; every contract metric has one family.
//! - A scrape reads each allocator's published counters (never its lock), each polled
//!   source's latest report (never the source), the ingest's report and the kubelet's latest
//!   answers, once each.

mod allocator;
mod ingest;
mod node;

use std::sync::Arc;
use std::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};

use crate::sources::{AllocatorSources, IngestReader};
use crate::telemetry::pod_names::PodNames;
use crate::telemetry::pod_resources::PodResources;
use crate::telemetry::{Kubelet, SourceReport};

use super::contract::{self as c, CONTRACT, Kind, Metric, MetricDef};
use super::names::process_pods;
use super::snapshot::NodeSnapshot;

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

/// Where series of a metric with `N` labels go: each gives `N` values, paired with the
/// contract's label names in order.
pub(super) struct Series<'a, const N: usize>(&'a mut Family);

impl<const N: usize> Series<'_, N> {
    /// A series with the contract's labels.
    pub(super) fn push(self, values: [&str; N], value: f64) {
        self.0.push(&values, &[], value);
    }

    /// A series with the contract's labels, then `extra` ones.
    pub(super) fn push_with(self, values: [&str; N], extra: &[(String, String)], value: f64) {
        self.0.push(&values, extra, value);
    }
}

impl Family {
    /// A series: `values` are as many as the contract's labels ([`Series`] holds it).
    fn push(&mut self, values: &[&str], extra: &[(String, String)], value: f64) {
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
pub(super) struct Families(Vec<Family>);

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

    pub(super) fn of<const N: usize>(&mut self, metric: &Metric<N>) -> Series<'_, N> {
        let family = self
            .0
            .iter_mut()
            .find(|f| f.def.name == metric.name)
            .expect("every metric of the contract has a family");
        Series(family)
    }
}

impl Collector for AgentCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        render(&self.snapshot())
    }
}

impl AgentCollector {
    /// What one scrape reads, typed: the page is drawn from it as the exposition is.
    pub fn snapshot(&self) -> NodeSnapshot {
        let started = Instant::now();
        let sources = self.allocators.snapshot();
        let reports: Vec<_> = self.reports.iter().map(|read| read()).collect();
        let names = self.kubelet.names.as_ref();
        let resources = self.kubelet.resources.as_ref();
        let kubelet = (
            names.map(PodNames::directory),
            resources.map(PodResources::directory),
        );
        let mut snapshot = NodeSnapshot::new(started, &sources, reports, kubelet);
        snapshot.kubelet_reports = [
            names.map(PodNames::report),
            resources.map(PodResources::report),
        ]
        .into_iter()
        .flatten()
        .collect();
        snapshot.ingest = self.ingest.as_ref().map(|read| read());
        snapshot
    }
}

/// The families of a snapshot, every contract metric with series.
fn render(snapshot: &NodeSnapshot) -> Vec<MetricFamily> {
    let mut f = Families::new();
    let names = snapshot.names();
    let started = Instant::now();
    for allocator in &snapshot.allocators {
        allocator::collect(&mut f, allocator, snapshot.taken);
    }
    if !snapshot.allocators.is_empty() {
        let seconds = (snapshot.placing + started.elapsed()).as_secs_f64();
        f.of(&c::SOURCE_UP).push(["allocator"], 1.0);
        f.of(&c::COLLECT_DURATION).push(["allocator"], seconds);
    }
    for report in &snapshot.reports {
        node::collect(&mut f, report, names, snapshot.assigned.as_deref());
    }
    for report in &snapshot.kubelet_reports {
        node::collect(&mut f, report, names, None);
    }
    if let Some(report) = &snapshot.ingest {
        ingest::collect(&mut f, report, names);
        let pods = process_pods(&snapshot.reports);
        ingest::collect_hosts(&mut f, report, &pods, names);
    }
    f.of(&c::BUILD_INFO).push([env!("CARGO_PKG_VERSION")], 1.0);
    f.0.into_iter().filter_map(Family::into_family).collect()
}
