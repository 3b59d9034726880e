//! What the agent asks the kubelet, and how often: pod and container names from its log
//! directories, GPU assignments from its pod-resources API (feature `kubelet`).
//!
//! # Invariants
//! - The kubelet is asked at most once per [`KUBELET_MIN_INTERVAL`] (its pod-resources API
//!   is rate-limited), whatever the polling interval, and each question waits at most the
//!   interval or 5 s.
//! - A part whose directory is absent (not a Kubernetes node, or a path given empty) is
//!   never asked, so it reports nothing down.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::telemetry::dra::NodeFiles;
use crate::telemetry::pod_names::PodNames;
use crate::telemetry::pod_resources::PodResources;
use crate::telemetry::{Heartbeat, Kubelet};

/// The least time between two questions to the kubelet.
pub const KUBELET_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// The kubelet's parts this node has, refreshed on the agent's runtime.
pub struct KubeletWatch {
    /// What the collector and the page read.
    pub kubelet: Kubelet,
    socket: PathBuf,
    interval: Duration,
    /// Beats after every round.
    pub heartbeat: Heartbeat,
}

impl KubeletWatch {
    /// The parts of the kubelet this node has (`socket`: its pod-resources socket; `logs`:
    /// its log directory), asked every `interval`: on a Kubernetes node their directories
    /// exist (even while the kubelet restarts); elsewhere there is nothing to report down.
    /// DRA devices are resolved from `node_files`.
    pub fn new(
        socket: PathBuf,
        logs: &Path,
        node_files: NodeFiles,
        interval: Duration,
    ) -> KubeletWatch {
        let present = |path: &Path| !path.as_os_str().is_empty() && path.is_dir();
        // An empty path turns a part off (joined, it would name a relative directory).
        let names = (present(logs) && present(&logs.join("pods")))
            .then(|| PodNames::new(logs.join("pods"), logs.join("containers")));
        // Without the gRPC client (feature `kubelet`) it is never asked: not a part then.
        let resources = socket
            .parent()
            .is_some_and(|dir| {
                cfg!(feature = "kubelet") && !socket.as_os_str().is_empty() && present(dir)
            })
            .then(|| PodResources::with_node_files(node_files));
        if names.is_none() && resources.is_none() {
            tracing::info!("not a Kubernetes node: pods are named by UID only");
        }
        let interval = interval.max(KUBELET_MIN_INTERVAL);
        KubeletWatch {
            kubelet: Kubelet { names, resources },
            socket,
            interval,
            heartbeat: Heartbeat::new("kubelet", Heartbeat::allowance_for(interval)),
        }
    }

    /// Refreshes what the kubelet says every interval, forever.
    pub async fn run(self) {
        let timeout = self.interval.min(Duration::from_secs(5));
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if let Some(names) = &self.kubelet.names {
                // Listing two directories takes well under a millisecond.
                names.refresh();
            }
            #[cfg(feature = "kubelet")]
            if let Some(resources) = &self.kubelet.resources {
                resources.refresh(&self.socket, timeout).await;
            }
            #[cfg(not(feature = "kubelet"))]
            let _ = (&self.socket, timeout);
            self.heartbeat.beat();
        }
    }
}
