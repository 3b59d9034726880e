//! Prometheus metrics: the contract (`contract.rs`), one typed [`snapshot::NodeSnapshot`] per
//! scrape, and the one collector that takes it and renders it (`collect/`; `names.rs` labels
//! a process by its pod and MIG device).
//!
//! The collector (`AgentCollector`) keeps no figures: it holds its sources (the allocators'
//! list, a reader per polled source, the ingest's report, the kubelet's parts) and reads each
//! allocator's published counters (never its lock), the latest report of each polled source
//! (never the source itself), the ingest's report and the kubelet's latest answers.

mod collect;
pub mod contract;
mod names;
pub mod openmetrics;
pub mod snapshot;

use std::sync::Arc;

use prometheus::{Encoder, Registry, TextEncoder};

pub use collect::{AgentCollector, ReportReader};

use crate::sources::{AllocatorSources, IngestReader};
use crate::telemetry::Kubelet;

/// Everything `/metrics` serves.
pub struct Metrics {
    registry: Registry,
    collector: Arc<AgentCollector>,
}

/// The collector as the registry holds it, shared with [`Metrics::snapshot`].
struct Registered(Arc<AgentCollector>);

impl prometheus::core::Collector for Registered {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.0.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.0.collect()
    }
}

impl Metrics {
    /// A registry with the collector over `allocators`, `reports` (one reader per polled
    /// source), the push ingest's report where the agent takes pushes, and what the kubelet says
    /// (pod names, GPU assignments).
    ///
    /// # Errors
    /// A registration error, which only a collector defect can cause.
    pub fn new(
        allocators: AllocatorSources,
        reports: Vec<ReportReader>,
        ingest: Option<IngestReader>,
        kubelet: Kubelet,
    ) -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let collector = Arc::new(AgentCollector::new(allocators, reports, ingest, kubelet));
        registry.register(Box::new(Registered(Arc::clone(&collector))))?;
        Ok(Metrics {
            registry,
            collector,
        })
    }

    /// What one scrape reads, typed: the live page is drawn from it.
    pub fn snapshot(&self) -> snapshot::NodeSnapshot {
        self.collector.snapshot()
    }

    /// The exposition of every metric in `format`.
    pub fn encode(&self, format: Format) -> String {
        let families = self.registry.gather();
        match format {
            Format::Text => {
                let mut buffer = Vec::with_capacity(64 * 1024);
                if let Err(e) = TextEncoder::new().encode(&families, &mut buffer) {
                    tracing::error!(error = %e, "encoding metrics failed");
                }
                String::from_utf8(buffer).unwrap_or_default()
            }
            Format::OpenMetrics => openmetrics::encode(&families).unwrap_or_else(|e| {
                tracing::error!(error = %e, "encoding metrics failed");
                "# EOF\n".to_string()
            }),
        }
    }
}

/// The exposition formats `/metrics` serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus's text format 0.0.4.
    Text,
    /// OpenMetrics 1.0 text ([`openmetrics`]).
    OpenMetrics,
}

impl Format {
    /// The Content-Type of an exposition in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => openmetrics::CONTENT_TYPE,
        }
    }
}
