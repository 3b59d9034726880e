//! Which containers the kubelet assigned each GPU, from its pod-resources API.
//!
//! `PodResourcesLister.List` (gRPC over `/var/lib/kubelet/pod-resources/kubelet.sock`) names,
//! for every container, the devices device plugins gave it: for NVIDIA's plugin, GPU UUIDs
//! (`GPU-…`, `GPU-…::<n>` for a time slice) or node indices, and MIG devices' UUIDs
//! (`MIG-…`, under `nvidia.com/gpu` or `nvidia.com/mig-<profile>`) or `<gpu>:<mig>`
//! indices; and the devices its DRA claims were allocated (`dynamic_resources`), by driver,
//! pool and device name, resolved on the node by [`super::dra`]. The agent exports the
//! assignment beside NVML's view, so a GPU assigned to one pod but used by another's
//! processes, or assigned and idle, shows. (Processes are named from their own cgroups,
//! never from this.)
//!
//! # Invariants
//! - A device's holders are listed without repeats (a container through one claim once); a
//!   time-sliced or shared GPU has several.
//! - Every DRA device is kept: one that resolves to no device of the node is placed on none
//!   ([`PodDirectory::place`]), to be listed by its driver, pool and device names.
//! - The directory is the last successful answer; while the kubelet does not answer, the
//!   source is reported down and the last directory stands. Answers are bounded by the gRPC
//!   decoder's 4 MiB limit.

use std::collections::{HashMap, HashSet};
#[cfg(feature = "kubelet")]
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
#[cfg(feature = "kubelet")]
use std::time::{Duration, Instant};

pub use super::device_key::{DeviceIndex, DeviceKey};
use super::device_key::{NodeDevice, parse_id};
use super::dra::{DraDevice, NodeFiles, NodeReader, Resolver};
#[cfg(feature = "kubelet")]
use super::grpc::{self, GrpcError};
use super::latest::Latest;
use super::{GpuSample, MigSample, SourceReport};

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
        /// Devices given to it through DRA claims (stable in Kubernetes 1.36).
        #[prost(message, repeated, tag = "5")]
        pub dynamic_resources: Vec<DynamicResource>,
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

    /// `DynamicResource`: one claim of the container's (its `class_name = 1` was removed).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DynamicResource {
        /// The ResourceClaim's name.
        #[prost(string, tag = "2")]
        pub claim_name: String,
        /// Its namespace.
        #[prost(string, tag = "3")]
        pub claim_namespace: String,
        /// The devices allocated to it.
        #[prost(message, repeated, tag = "4")]
        pub claim_resources: Vec<ClaimResource>,
    }

    /// `ClaimResource`: one allocated device.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ClaimResource {
        /// The CDI devices the driver prepared for it.
        #[prost(message, repeated, tag = "1")]
        pub cdi_devices: Vec<CdiDevice>,
        /// The DRA driver (`gpu.nvidia.com`).
        #[prost(string, tag = "2")]
        pub driver_name: String,
        /// The ResourceSlice pool.
        #[prost(string, tag = "3")]
        pub pool_name: String,
        /// The device's name in the pool.
        #[prost(string, tag = "4")]
        pub device_name: String,
    }

    /// `CDIDevice`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CdiDevice {
        /// Fully qualified: `vendor/class=name`.
        #[prost(string, tag = "1")]
        pub name: String,
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

/// An assignment where it is on the node.
#[derive(Clone, Copy, Debug)]
pub struct Placed<'a> {
    /// Its GPU and, for a MIG device, the MIG device; none for a DRA device that names no
    /// device of the node.
    pub on: Option<(&'a GpuSample, Option<&'a MigSample>)>,
    /// The assignment.
    pub assignment: &'a Assignment,
}

/// The DRA claim a device was assigned through.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DraClaim {
    /// The ResourceClaim's namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The device, as its driver names it.
    pub device: DraDevice,
}

/// One device given to one container.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Assignment {
    /// The container.
    pub holder: PodContainer,
    /// The claim, for a device assigned through DRA (none for a device plugin's).
    pub dra: Option<DraClaim>,
    /// The keys naming the device on the node (none: a DRA device left unresolved).
    keys: Vec<DeviceKey>,
}

/// Who holds each device, from one `List` answer.
#[derive(Debug, Default)]
pub struct PodDirectory {
    /// Without repeats.
    assignments: Vec<Assignment>,
    /// Each key → the assignments naming it.
    by_key: HashMap<DeviceKey, Vec<usize>>,
}

impl PodDirectory {
    /// The directory of one answer, its DRA devices resolved by `resolver`.
    pub fn from_list(list: &api::ListPodResourcesResponse, resolver: &Resolver) -> Self {
        let mut directory = PodDirectory::default();
        let mut seen = HashSet::new();
        let mut add = |holder: PodContainer, dra: Option<DraClaim>, keys: Vec<DeviceKey>| {
            let assignment = Assignment { holder, dra, keys };
            if seen.insert(assignment.clone()) {
                directory.add(assignment);
            }
        };
        for pod in &list.pod_resources {
            for container in &pod.containers {
                let holder = PodContainer {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                };
                for devices in &container.devices {
                    for id in &devices.device_ids {
                        if let Some(key) = device_key(&devices.resource_name, id) {
                            add(holder.clone(), None, vec![key]);
                        }
                    }
                }
                for claim in &container.dynamic_resources {
                    for device in &claim.claim_resources {
                        let dra = DraClaim {
                            namespace: claim.claim_namespace.clone(),
                            name: claim.claim_name.clone(),
                            device: DraDevice {
                                driver: device.driver_name.clone(),
                                pool: device.pool_name.clone(),
                                device: device.device_name.clone(),
                            },
                        };
                        let cdi = device.cdi_devices.iter().map(|d| d.name.as_str());
                        let keys = resolver.resolve(&device.driver_name, &device.device_name, cdi);
                        add(holder.clone(), Some(dra), keys);
                    }
                }
            }
        }
        directory
    }

    /// Adds an assignment (not there yet).
    fn add(&mut self, assignment: Assignment) {
        let at = self.assignments.len();
        for key in &assignment.keys {
            self.by_key.entry(key.clone()).or_default().push(at);
        }
        self.assignments.push(assignment);
    }

    /// Each assignment where it is among `gpus`: on a GPU or one of its MIG devices, each
    /// container and claim once per device; then the DRA assignments that name none of them
    /// (unresolved, or resolved to a device the node does not list), on no GPU.
    pub fn place<'a>(&'a self, gpus: impl IntoIterator<Item = &'a GpuSample>) -> Vec<Placed<'a>> {
        let mut placed = Vec::new();
        let mut on_node: HashSet<DeviceKey> = HashSet::new();
        for gpu in gpus {
            for (mig, uuid, _) in gpu.devices() {
                let device = NodeDevice {
                    uuid,
                    index: mig.map_or(DeviceIndex::Gpu(gpu.index), |m| {
                        DeviceIndex::Mig(gpu.index, m.index)
                    }),
                    minor: gpu.minor,
                    instance: mig.map(|m| (m.gpu_instance, m.compute_instance)),
                };
                let keys = device.keys();
                for assignment in self.holders(&keys) {
                    placed.push(Placed {
                        on: Some((gpu, mig)),
                        assignment,
                    });
                }
                on_node.extend(keys);
            }
        }
        let elsewhere = self
            .assignments
            .iter()
            .filter(|a| a.dra.is_some() && !a.keys.iter().any(|k| on_node.contains(k)));
        placed.extend(elsewhere.map(|assignment| Placed {
            on: None,
            assignment,
        }));
        placed
    }

    /// The assignments of the device of the node these keys name (each container and claim
    /// once).
    fn holders(&self, keys: &[DeviceKey]) -> Vec<&Assignment> {
        let mut all: Vec<&Assignment> = Vec::new();
        let mut seen = HashSet::new();
        for key in keys {
            for &at in self.by_key.get(key).map(Vec::as_slice).unwrap_or_default() {
                let a = &self.assignments[at];
                if seen.insert((&a.holder, &a.dra)) {
                    all.push(a);
                }
            }
        }
        all
    }

    /// Whether the kubelet named no device at all.
    pub fn is_empty(&self) -> bool {
        self.assignments.is_empty()
    }
}

/// The directory key of a device plugin's device ID ([`parse_id`]): a UUID under any
/// resource, an index only under NVIDIA's (a GPU's under `nvidia.com/gpu`, a MIG device's
/// under it or `nvidia.com/mig-<profile>`); `None` for devices that are not GPUs.
fn device_key(resource: &str, id: &str) -> Option<DeviceKey> {
    let (gpus, migs) = (resource == NVIDIA_GPU, resource.starts_with(NVIDIA_MIG));
    match parse_id(id)? {
        key @ DeviceKey::Uuid(_) => Some(key),
        key @ DeviceKey::Index(DeviceIndex::Gpu(_)) if gpus => Some(key),
        key @ DeviceKey::Index(DeviceIndex::Mig(..)) if gpus || migs => Some(key),
        _ => None,
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
    /// What resolves DRA devices (read only for answers that have some).
    node: Arc<Mutex<NodeReader>>,
}

impl Default for PodResources {
    fn default() -> Self {
        PodResources::new()
    }
}

impl PodResources {
    /// No answer yet: down, with an empty directory; DRA devices resolved from the node's
    /// default CDI directories and `mig-minors`.
    pub fn new() -> Self {
        PodResources::with_node_files(NodeFiles::default())
    }

    /// As [`PodResources::new`], DRA devices resolved from `files`.
    pub fn with_node_files(files: NodeFiles) -> Self {
        PodResources {
            latest: Latest::new(SOURCE, "the kubelet has not been asked yet"),
            node: Arc::new(Mutex::new(NodeReader::new(files))),
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
            // The node's CDI specs are files: read off the agent's runtime.
            Ok(answer) => {
                let me = self.clone();
                let read =
                    tokio::task::spawn_blocking(move || me.publish(&answer, duration_seconds));
                if let Err(e) = read.await {
                    tracing::warn!(error = %e, "resolving the kubelet's answer failed");
                }
            }
            Err(error) => {
                let reason = error.to_string();
                if self.latest.down(reason.clone(), duration_seconds) {
                    tracing::warn!(reason = %reason, "kubelet pod resources are down; GPU assignments are not refreshed");
                }
            }
        }
    }

    /// Publishes an answer of the kubelet's, obtained in `duration_seconds`; its DRA devices
    /// are resolved from the node's files as they are now.
    pub fn publish(&self, answer: &api::ListPodResourcesResponse, duration_seconds: f64) {
        let dra = answer
            .pod_resources
            .iter()
            .flat_map(|p| &p.containers)
            .any(|c| !c.dynamic_resources.is_empty());
        let resolver = if dra {
            let mut node = self.node.lock().unwrap_or_else(PoisonError::into_inner);
            let (resolver, skipped) = node.resolver();
            for (path, reason) in skipped {
                tracing::debug!(path = %path.display(), %reason, "a CDI spec was skipped");
            }
            resolver
        } else {
            Resolver::default()
        };
        if self
            .latest
            .up(PodDirectory::from_list(answer, &resolver), duration_seconds)
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
                    dynamic_resources: Vec::new(),
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
        PodDirectory::from_list(
            &ListPodResourcesResponse {
                pod_resources: pods,
            },
            &Resolver::default(),
        )
    }

    /// The containers holding the device with this UUID and index (no minor).
    fn held<'a>(
        d: &'a PodDirectory,
        uuid: &str,
        index: Option<DeviceIndex>,
    ) -> Vec<&'a PodContainer> {
        let device = NodeDevice {
            uuid,
            // An index no answer names stands for "none".
            index: index.unwrap_or(DeviceIndex::Gpu(u32::MAX)),
            minor: None,
            instance: None,
        };
        d.holders(&device.keys())
            .into_iter()
            .map(|a| &a.holder)
            .collect()
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
            held(&d, "GPU-aaa", Some(DeviceIndex::Gpu(0))),
            vec![&trainer]
        );
        assert_eq!(held(&d, "GPU-bbb", None), vec![&trainer]);
        // Time slices of one GPU: each container once.
        assert_eq!(
            held(&d, "GPU-ccc", Some(DeviceIndex::Gpu(2))),
            vec![
                &holder("ml", "infer", "server"),
                &holder("ml", "infer-2", "server")
            ]
        );
        // The index strategy, and only for nvidia.com/gpu.
        assert_eq!(
            held(&d, "GPU-ddd", Some(DeviceIndex::Gpu(3))),
            vec![&holder("batch", "job", "main")]
        );
        assert!(held(&d, "GPU-eee", Some(DeviceIndex::Gpu(4))).is_empty());
        assert!(held(&d, "GPU-unknown", None).is_empty());
        assert_eq!(
            held(&d, "MIG-111", Some(DeviceIndex::Mig(0, 0))),
            vec![&holder("ml", "small", "a")]
        );
        assert_eq!(held(&d, "MIG-222", None), vec![&holder("ml", "mixed", "b")]);
        assert_eq!(
            held(&d, "MIG-333", Some(DeviceIndex::Mig(5, 1))),
            vec![&holder("ml", "indexed", "c")]
        );
        // A MIG index is not a GPU's, nor is a bare number of a MIG resource: GPUs 5 and 6
        // are nobody's.
        assert!(held(&d, "GPU-fff", Some(DeviceIndex::Gpu(5))).is_empty());
        assert!(held(&d, "GPU-ggg", Some(DeviceIndex::Gpu(6))).is_empty());
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
