//! What the collectors share to label a process: the pod NVML's view places it in, the pod's
//! names from the kubelet's log directories, and a MIG device's labels.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use crate::telemetry::cgroup::ContainerRef;
use crate::telemetry::pod_names::NameDirectory;
use crate::telemetry::{MigSample, SourceReport};

use super::contract::label;

/// The labels that name a MIG device, beside its parent's `gpu` and `UUID`.
pub(super) fn mig_labels(mig: &MigSample) -> [(String, String); 3] {
    [
        (label::GPU_I_ID.into(), mig.gpu_instance.to_string()),
        (label::GPU_I_PROFILE.into(), mig.profile.clone()),
        (label::MIG_UUID.into(), mig.uuid.clone()),
    ]
}

/// The pod and container names of this scrape, from the kubelet's log directories.
#[derive(Clone, Copy)]
pub(super) struct Names<'a>(pub Option<&'a NameDirectory>);

impl Names<'_> {
    /// (namespace, pod, container) of a pod UID and container ID, or empty strings.
    pub(super) fn of(&self, pod_uid: &str, container_id: &str) -> [String; 3] {
        self.0
            .and_then(|d| d.name(pod_uid, container_id))
            .map_or_else(Default::default, |n| [n.namespace, n.pod, n.container])
    }
}

/// A label's value in `labels`.
pub(super) fn value_of<'a>(labels: &'a [(String, String)], name: &str) -> Option<&'a str> {
    labels
        .iter()
        .find_map(|(k, v)| (k == name).then_some(v.as_str()))
}

/// The pod and container of each process NVML reports, by (GPU UUID, pid); a MIG device's
/// processes by their parent GPU's UUID.
pub(super) type ProcessPods<'a> = HashMap<(&'a str, u32), &'a ContainerRef>;

pub(super) fn process_pods(reports: &[Arc<SourceReport>]) -> ProcessPods<'_> {
    let mut pods = ProcessPods::new();
    for gpu in reports.iter().flat_map(|r| r.gpus()) {
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
pub(super) fn process_labels<'a>(
    own: &'a [(String, String)],
    nvml: Option<&ContainerRef>,
    names: Names<'_>,
) -> Cow<'a, [(String, String)]> {
    let mut labels = Cow::Borrowed(own);
    if value_of(own, label::POD_UID).is_none()
        && let Some(container) = nvml
    {
        let all = labels.to_mut();
        all.push((label::POD_UID.into(), container.pod_uid.clone()));
        all.push((label::CONTAINER_ID.into(), container.container_id.clone()));
    }
    let uid = value_of(&labels, label::POD_UID)
        .unwrap_or_default()
        .to_string();
    let id = value_of(&labels, label::CONTAINER_ID)
        .unwrap_or_default()
        .to_string();
    if let [namespace, pod, container] = names.of(&uid, &id)
        && !pod.is_empty()
    {
        // A push from the pod network names its pod already (the runtime said).
        for (name, value) in [
            (label::POD_NAMESPACE, namespace),
            (label::POD_NAME, pod),
            (label::CONTAINER_NAME, container),
        ] {
            if value_of(&labels, name).is_none() {
                labels.to_mut().push((name.into(), value));
            }
        }
    }
    labels
}
