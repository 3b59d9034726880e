//! Where the device view comes from: NVML on a real node (the demo's simulated node, in
//! [`crate::demo`], is another [`GpuSource`]).
//!
//! A [`GpuSource`] answers one question, "what does the node look like now?", with a
//! [`NodeSample`] of plain data: per GPU its identity, total/used/free/reserved memory and the
//! processes using it, and in MIG mode its MIG devices with theirs. A [`Poller`] asks on its own thread at a fixed interval and publishes
//! the latest answer, so a slow or hung source never delays a scrape.
//!
//! # Invariants
//! - A failed sample is data, not a crash: the poller publishes `up = false` with the reason,
//!   logs it once per change, and keeps asking.

pub mod cdi;
pub mod cgroup;
#[cfg(feature = "kubelet")]
pub mod cri;
pub mod device_key;
pub mod dra;
#[cfg(feature = "kubelet")]
pub mod grpc;
mod heartbeat;
mod latest;
pub mod nvidia_caps;
mod nvml;
pub mod pod_names;
pub mod pod_network;
pub mod pod_processes;
pub mod pod_resources;
mod poller;
pub mod process;

pub use heartbeat::{Health, Heartbeat, Unhealthy};
pub use nvml::NvmlSource;
pub use poller::{Poller, SourceReport};

/// One process using a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessSample {
    /// Process id (in the agent's PID namespace).
    pub pid: u32,
    /// Process name (`/proc/<pid>/comm`), or empty when unknown.
    pub name: String,
    /// Bytes of device memory it uses, when the driver reports it.
    pub used: Option<u64>,
    /// Its Kubernetes pod and container, when it runs in one.
    pub container: Option<cgroup::ContainerRef>,
}

/// One GPU as nvidia-smi sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSample {
    /// Index (as `nvidia-smi` numbers it).
    pub index: u32,
    /// UUID, spelled `GPU-…` as DCGM spells it.
    pub uuid: String,
    /// Its device minor (`/dev/nvidia<minor>`), where the driver says (DRA's CDI specs and
    /// MIG capability minors name GPUs by it).
    pub minor: Option<u32>,
    /// Model name.
    pub model: String,
    /// Device memory.
    pub total: u64,
    /// Memory in use.
    pub used: u64,
    /// Memory free.
    pub free: u64,
    /// Memory the driver reserves for itself, where it reports it.
    pub reserved: Option<u64>,
    /// Processes using the GPU (in MIG mode with MIG devices, none: each lists its own).
    pub processes: Vec<ProcessSample>,
    /// Its MIG devices, when MIG mode is on (else none).
    pub mig: Vec<MigSample>,
}

impl GpuSample {
    /// The devices processes run on: the whole GPU, then each MIG device (with its UUID and
    /// processes; in MIG mode the whole GPU lists none).
    pub fn devices(&self) -> impl Iterator<Item = (Option<&MigSample>, &str, &[ProcessSample])> {
        let whole = (None, self.uuid.as_str(), self.processes.as_slice());
        let migs = self
            .mig
            .iter()
            .map(|mig| (Some(mig), mig.uuid.as_str(), mig.processes.as_slice()));
        std::iter::once(whole).chain(migs)
    }
}

/// One MIG device: a compute instance of a GPU instance of a GPU in MIG mode, the unit a
/// container is given. Several compute instances of one GPU instance share its memory, so
/// each reports the same figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigSample {
    /// Its index among the parent's MIG devices (NVML's handle index; the device plugin's
    /// `<gpu>:<index>` under its index strategy).
    pub index: u32,
    /// Its UUID, spelled `MIG-…`.
    pub uuid: String,
    /// The GPU instance's ID (dcgm-exporter's `GPU_I_ID`).
    pub gpu_instance: u32,
    /// The compute instance's ID in it.
    pub compute_instance: u32,
    /// The GPU instance's profile, as nvidia-smi names it (`1g.10gb`; dcgm-exporter's
    /// `GPU_I_PROFILE`).
    pub profile: String,
    /// The GPU instance's memory.
    pub total: u64,
    /// Memory in use in it.
    pub used: u64,
    /// Memory free in it.
    pub free: u64,
    /// Processes using it.
    pub processes: Vec<ProcessSample>,
}

impl MigSample {
    /// The GPU instance's profile in a MIG device's name as NVML gives it (`NVIDIA
    /// A100-SXM4-40GB MIG 1g.5gb` → `1g.5gb`; a compute instance of part of it, `MIG
    /// 1c.3g.20gb`, → `3g.20gb`, as dcgm-exporter names it); empty when the name has no `MIG`
    /// word.
    pub fn profile_of(name: &str) -> String {
        let Some((_, profile)) = name.rsplit_once(" MIG ") else {
            return String::new();
        };
        let profile = profile.trim();
        let compute_part = profile
            .split_once("c.")
            .filter(|(slices, _)| !slices.is_empty() && slices.bytes().all(|b| b.is_ascii_digit()));
        compute_part.map_or(profile, |(_, rest)| rest).to_string()
    }
}

/// A device UUID without its `GPU-` or `MIG-` prefix, in lower case: PyTorch reports a
/// device's UUID without prefix, so a job's hook may have spelled a MIG device `GPU-…`.
pub fn uuid_body(uuid: &str) -> String {
    uuid.strip_prefix("GPU-")
        .or_else(|| uuid.strip_prefix("MIG-"))
        .unwrap_or(uuid)
        .to_ascii_lowercase()
}

/// A whole node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeSample {
    /// Driver version.
    pub driver_version: String,
    /// Whether the GPUs are simulated.
    pub simulated: bool,
    /// The GPUs.
    pub gpus: Vec<GpuSample>,
}

/// What the agent learns from the kubelet on a Kubernetes node, each part where available.
#[derive(Clone, Default)]
pub struct Kubelet {
    /// Pod and container names, from its log directories.
    pub names: Option<pod_names::PodNames>,
    /// GPU assignments, from its pod-resources API.
    pub resources: Option<pod_resources::PodResources>,
}

/// A source of node samples.
pub trait GpuSource: Send {
    /// The `source` label of its metrics (`nvml`, `simulated`).
    fn name(&self) -> &'static str;

    /// Reads the node now.
    ///
    /// # Errors
    /// Why the node could not be read (library missing, driver not loaded, GPU lost...).
    fn sample(&mut self) -> Result<NodeSample, SourceError>;
}

/// Why a [`GpuSource`] could not read the node; its text is the source's reported reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// NVML's library (`libnvidia-ml.so.1`) could not be loaded: no driver on this node, or
    /// the container was not given it.
    #[error("the NVML library (libnvidia-ml.so.1) could not be loaded: {0}")]
    LibraryMissing(String),
    /// The library loaded, the kernel driver is not.
    #[error("the NVIDIA driver is not loaded")]
    DriverNotLoaded,
    /// A GPU fell off the bus (Xid 79) or is otherwise lost.
    #[error("a GPU has fallen off the bus or is otherwise lost")]
    GpuLost,
    /// Any other failure of the source, as it describes it.
    #[error("{source_name} failed: {reason}")]
    Failed {
        /// The source (`NVML`).
        source_name: &'static str,
        /// Its own description.
        reason: String,
    },
}
