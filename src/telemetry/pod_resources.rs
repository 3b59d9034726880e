//! Which containers the kubelet assigned each GPU, from its pod-resources API.
//!
//! `PodResourcesLister.List` (gRPC over `/var/lib/kubelet/pod-resources/kubelet.sock`) names,
//! for every container, the devices device plugins gave it: for NVIDIA's plugin, GPU UUIDs
//! (`GPU-…`, `GPU-…::<n>` for a time slice) or node indices, and MIG devices' UUIDs
//! (`MIG-…`, under `nvidia.com/gpu` or `nvidia.com/mig-<profile>`) or `<gpu>:<mig>` indices. The agent exports the assignment
//! beside NVML's view, so a GPU assigned to one pod but used by another's processes, or
//! assigned and idle, shows. (Processes are named from their own cgroups, never from this.)
//!
//! # Invariants
//! - A GPU's holders are listed without repeats; a time-sliced or shared GPU has several.
//! - The directory is the last successful answer; while the kubelet does not answer, the
//!   source is reported down and the last directory stands. Answers are bounded by the gRPC
//!   decoder's 4 MiB limit.

use std::collections::HashMap;
#[cfg(feature = "kubelet")]
use std::path::Path;
use std::sync::Arc;
#[cfg(feature = "kubelet")]
use std::time::{Duration, Instant};

use super::SourceReport;
#[cfg(feature = "kubelet")]
use super::grpc::{self, GrpcError};
use super::latest::Latest;

/// The kubelet's socket on a node.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// The resource whose device IDs may be node indices (the device plugin's index strategy:
/// `<gpu>` for a GPU, `<gpu>:<mig>` for a MIG device under the single strategy).
const NVIDIA_GPU: &str = "nvidia.com/gpu";
/// The prefix of the device plugin's MIG resources under its mixed strategy
/// (`nvidia.com/mig-1g.10gb`); under the single strategy they are `nvidia.com/gpu`.
const NVIDIA_MIG: &str = "nvidia.com/mig-";
/// The `source` label of the kubelet's up and duration metrics.
pub const SOURCE: &str = "pod_resources";

/// The messages of `k8s.io/kubelet/pkg/apis/podresources/v1`, as far as gpumem reads them
/// (other fields are skipped by the decoder).
pub mod api {
    /// `ListPodResourcesRequest`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ListPodResourcesRequest {}

    /// `ListPodResourcesResponse`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ListPodResourcesResponse {
        /// Every pod on the node.
        #[prost(message, repeated, tag = "1")]
        pub pod_resources: Vec<PodResources>,
    }

    /// `PodResources`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodResources {
        /// Pod name.
        #[prost(string, tag = "1")]
        pub name: String,
        /// Pod namespace.
        #[prost(string, tag = "2")]
        pub namespace: String,
        /// Its containers.
        #[prost(message, repeated, tag = "3")]
        pub containers: Vec<ContainerResources>,
    }

    /// `ContainerResources`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerResources {
        /// Container name.
        #[prost(string, tag = "1")]
        pub name: String,
        /// Devices given to it by device plugins.
        #[prost(message, repeated, tag = "2")]
        pub devices: Vec<ContainerDevices>,
    }

    /// `ContainerDevices`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerDevices {
        /// Extended resource name, e.g. `nvidia.com/gpu`.
        #[prost(string, tag = "1")]
        pub resource_name: String,
        /// The plugin's device IDs.
        #[prost(string, repeated, tag = "2")]
        pub device_ids: Vec<String>,
    }

    /// The method's gRPC path.
    pub const LIST_PATH: &str = "/v1.PodResourcesLister/List";
}

/// A container the kubelet gave a device to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodContainer {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub pod: String,
    /// The container's name in the pod spec.
    pub container: String,
}

/// A device's place on the node, as the device plugin's index strategy names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceIndex {
    /// A whole GPU: NVML's index.
    Gpu(u32),
    /// A MIG device: its parent's index and its own among the parent's.
    Mig(u32, u32),
}

impl DeviceIndex {
    fn key(self) -> String {
        match self {
            DeviceIndex::Gpu(i) => format!("#{i}"),
            DeviceIndex::Mig(gpu, mig) => format!("#{gpu}:{mig}"),
        }
    }
}

/// Who holds each device, from one `List` answer.
#[derive(Debug, Default)]
pub struct PodDirectory {
    /// GPU UUID (or `#<index>` under the index strategy) → its holders, without repeats.
    holders: HashMap<String, Vec<PodContainer>>,
}

impl PodDirectory {
    /// The directory of one answer.
    pub fn from_list(list: &api::ListPodResourcesResponse) -> Self {
        let mut holders: HashMap<String, Vec<PodContainer>> = HashMap::new();
        for pod in &list.pod_resources {
            for container in &pod.containers {
                let holder = PodContainer {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                };
                for devices in &container.devices {
                    for id in &devices.device_ids {
                        let Some(key) = device_key(&devices.resource_name, id) else {
                            continue;
                        };
                        let list = holders.entry(key).or_default();
                        if !list.contains(&holder) {
                            list.push(holder.clone());
                        }
                    }
                }
            }
        }
        PodDirectory { holders }
    }

    /// The containers holding the GPU with this UUID and node index, or the MIG device with
    /// this UUID and `<gpu>:<mig>` index.
    pub fn holders(&self, uuid: &str, index: Option<DeviceIndex>) -> Vec<&PodContainer> {
        let by_uuid = self
            .holders
            .get(uuid)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let by_index = index
            .and_then(|i| self.holders.get(&i.key()))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let mut all: Vec<&PodContainer> = Vec::new();
        for holder in by_uuid.iter().chain(by_index) {
            if !all.contains(&holder) {
                all.push(holder);
            }
        }
        all
    }

    /// Whether the kubelet named no device at all.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }
}

/// The directory key of a device ID: the GPU's or MIG device's UUID (a time slice's `::<n>`
/// dropped), or under the index strategy `#<index>` for a GPU and `#<gpu>:<mig>` for a MIG
/// device; `None` for devices that are not GPUs.
fn device_key(resource: &str, id: &str) -> Option<String> {
    let id = id.split_once("::").map_or(id, |(gpu, _)| gpu);
    let number = |s: &str| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit());
    let (gpus, migs) = (resource == NVIDIA_GPU, resource.starts_with(NVIDIA_MIG));
    if id.starts_with("GPU-") || id.starts_with("MIG-") {
        Some(id.to_string())
    } else if gpus && number(id) {
        id.parse::<u32>().ok().map(|i| format!("#{i}"))
    } else if (gpus || migs)
        && let Some((gpu, mig)) = id.split_once(':')
        && number(gpu)
        && number(mig)
    {
        Some(format!(
            "#{}:{}",
            gpu.parse::<u32>().ok()?,
            mig.parse::<u32>().ok()?
        ))
    } else {
        None
    }
}

/// Asks the kubelet once.
///
/// # Errors
/// Why there is no answer: no socket, a refused connection, a gRPC status, a timeout.
#[cfg(feature = "kubelet")]
pub async fn list(
    socket: &Path,
    timeout: Duration,
) -> Result<api::ListPodResourcesResponse, GrpcError> {
    let channel = grpc::connect(socket, timeout).await?;
    grpc::unary(channel, api::LIST_PATH, api::ListPodResourcesRequest {}).await
}

/// The kubelet's latest answer, refreshed by [`PodResources::refresh`].
#[derive(Clone)]
pub struct PodResources {
    latest: Latest<PodDirectory>,
}

impl Default for PodResources {
    fn default() -> Self {
        PodResources::new()
    }
}

impl PodResources {
    /// No answer yet: down, with an empty directory.
    pub fn new() -> Self {
        PodResources {
            latest: Latest::new(SOURCE, "the kubelet has not been asked yet"),
        }
    }

    /// The latest report (up or down, and why).
    pub fn report(&self) -> Arc<SourceReport> {
        self.latest.report()
    }

    /// The last successful answer's directory.
    pub fn directory(&self) -> Arc<PodDirectory> {
        self.latest.answer()
    }

    /// Asks the kubelet once and publishes the answer, logging a change of state once.
    #[cfg(feature = "kubelet")]
    pub async fn refresh(&self, socket: &Path, timeout: Duration) {
        let started = Instant::now();
        let result = list(socket, timeout).await;
        let duration_seconds = started.elapsed().as_secs_f64();
        match result {
            Ok(answer) => self.publish(&answer, duration_seconds),
            Err(error) => {
                let reason = error.to_string();
                if self.latest.down(reason.clone(), duration_seconds) {
                    tracing::warn!(reason = %reason, "kubelet pod resources are down; GPU assignments are not refreshed");
                }
            }
        }
    }

    /// Publishes an answer of the kubelet's, obtained in `duration_seconds`.
    pub fn publish(&self, answer: &api::ListPodResourcesResponse, duration_seconds: f64) {
        if self
            .latest
            .up(PodDirectory::from_list(answer), duration_seconds)
        {
            tracing::info!(
                pods = answer.pod_resources.len(),
                "kubelet pod resources are up"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::api::{ContainerDevices, ContainerResources, ListPodResourcesResponse};
    use super::*;

    fn pod(ns: &str, name: &str, containers: &[(&str, &str, &[&str])]) -> api::PodResources {
        api::PodResources {
            name: name.into(),
            namespace: ns.into(),
            containers: containers
                .iter()
                .map(|(c, resource, ids)| ContainerResources {
                    name: (*c).into(),
                    devices: vec![ContainerDevices {
                        resource_name: (*resource).into(),
                        device_ids: ids.iter().map(|s| (*s).to_string()).collect(),
                    }],
                })
                .collect(),
        }
    }
    fn holder(ns: &str, pod: &str, c: &str) -> PodContainer {
        PodContainer {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
        }
    }

    fn directory(pods: Vec<api::PodResources>) -> PodDirectory {
        PodDirectory::from_list(&ListPodResourcesResponse {
            pod_resources: pods,
        })
    }

    #[test]
    fn uuids_time_slices_and_indices_find_their_holders() {
        let d = directory(vec![
            pod(
                "ml",
                "train-0",
                &[("trainer", NVIDIA_GPU, &["GPU-aaa", "GPU-bbb"])],
            ),
            pod(
                "ml",
                "infer",
                &[("server", NVIDIA_GPU, &["GPU-ccc::0", "GPU-ccc::1"])],
            ),
            pod("ml", "infer-2", &[("server", NVIDIA_GPU, &["GPU-ccc::2"])]),
            pod("batch", "job", &[("main", NVIDIA_GPU, &["3"])]),
            pod(
                "net",
                "sriov",
                &[("app", "intel.com/sriov", &["0000:3b:02.1", "4", "5:1"])],
            ),
            // MIG devices: by UUID under the single strategy (nvidia.com/gpu) or the mixed
            // one (nvidia.com/mig-<profile>), time-sliced, or by <gpu>:<mig> index.
            pod("ml", "small", &[("a", NVIDIA_GPU, &["MIG-111"])]),
            pod(
                "ml",
                "mixed",
                &[("b", "nvidia.com/mig-1g.10gb", &["MIG-222::0"])],
            ),
            pod(
                "ml",
                "indexed",
                &[("c", "nvidia.com/mig-2g.20gb", &["5:1"])],
            ),
        ]);
        let trainer = holder("ml", "train-0", "trainer");
        assert_eq!(
            d.holders("GPU-aaa", Some(DeviceIndex::Gpu(0))),
            vec![&trainer]
        );
        assert_eq!(d.holders("GPU-bbb", None), vec![&trainer]);
        // Time slices of one GPU: each container once.
        assert_eq!(
            d.holders("GPU-ccc", Some(DeviceIndex::Gpu(2))),
            vec![
                &holder("ml", "infer", "server"),
                &holder("ml", "infer-2", "server")
            ]
        );
        // The index strategy, and only for nvidia.com/gpu.
        assert_eq!(
            d.holders("GPU-ddd", Some(DeviceIndex::Gpu(3))),
            vec![&holder("batch", "job", "main")]
        );
        assert!(d.holders("GPU-eee", Some(DeviceIndex::Gpu(4))).is_empty());
        assert!(d.holders("GPU-unknown", None).is_empty());
        assert_eq!(
            d.holders("MIG-111", Some(DeviceIndex::Mig(0, 0))),
            vec![&holder("ml", "small", "a")]
        );
        assert_eq!(
            d.holders("MIG-222", None),
            vec![&holder("ml", "mixed", "b")]
        );
        assert_eq!(
            d.holders("MIG-333", Some(DeviceIndex::Mig(5, 1))),
            vec![&holder("ml", "indexed", "c")]
        );
        // A MIG index is not a GPU's, nor is a bare number of a MIG resource: GPUs 5 and 6
        // are nobody's.
        assert!(d.holders("GPU-fff", Some(DeviceIndex::Gpu(5))).is_empty());
        assert!(d.holders("GPU-ggg", Some(DeviceIndex::Gpu(6))).is_empty());
    }

    #[test]
    fn unknown_fields_are_skipped_and_garbage_is_an_error() {
        use prost::Message;
        // A real answer carries cpu_ids (3), memory (4) and topology (3 in devices).
        let mut bytes = ListPodResourcesResponse {
            pod_resources: vec![pod("ml", "p", &[("c", NVIDIA_GPU, &["GPU-a"])])],
        }
        .encode_to_vec();
        bytes.extend_from_slice(&[0x1a, 0x00]); // an empty field 3 at the top level
        let decoded = ListPodResourcesResponse::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(decoded.pod_resources.len(), 1);
        assert!(ListPodResourcesResponse::decode(&[0x0a, 0xff, 0xff][..]).is_err());
    }

    #[cfg(feature = "kubelet")]
    #[tokio::test]
    async fn a_missing_socket_is_reported_down_with_the_path() {
        let pods = PodResources::new();
        let path = Path::new("/nonexistent/kubelet.sock");
        pods.refresh(path, Duration::from_millis(500)).await;
        let report = pods.report();
        assert!(!report.up);
        let error = report.error.as_deref().unwrap_or_default();
        assert!(error.contains("/nonexistent/kubelet.sock"), "{error}");
        assert!(pods.directory().is_empty());
    }
}
