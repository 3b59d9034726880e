//! How an assignment names a device of the node, and every name a GPU or MIG device of the
//! node answers to: a device plugin's UUIDs and node indices, a DRA device's device minors
//! and MIG instances (resolved in [`super::dra`]). The directory of assignments
//! ([`super::pod_resources`]) joins the two by these keys.

use super::nvidia_caps::MigInstance;

/// A device's place on the node, as the device plugin's index strategy names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceIndex {
    /// A whole GPU: NVML's index.
    Gpu(u32),
    /// A MIG device: its parent's index and its own among the parent's.
    Mig(u32, u32),
}

/// One way an assignment names a device on the node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKey {
    /// A GPU's or MIG device's UUID (`GPU-…`, `MIG-…`).
    Uuid(String),
    /// Its node index.
    Index(DeviceIndex),
    /// A whole GPU's device minor (`/dev/nvidia<minor>`).
    Minor(u32),
    /// A MIG instance, by its GPU's minor (a GPU instance's node names every compute
    /// instance in it).
    Mig(MigInstance),
}

/// A decimal number of at most 10 digits, without sign, as device IDs and names write them.
pub fn number(s: &str) -> Option<u32> {
    (!s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// What a device ID names by itself: a GPU's or MIG device's UUID (`GPU-…`, `MIG-…`; a time
/// slice's `::<n>` dropped), a GPU's index (`3`) or a MIG device's (`3:1`); `None` for
/// anything else.
pub fn parse_id(id: &str) -> Option<DeviceKey> {
    let id = id.split_once("::").map_or(id, |(device, _)| device);
    if id.starts_with("GPU-") || id.starts_with("MIG-") {
        return Some(DeviceKey::Uuid(id.to_string()));
    }
    if let Some(gpu) = number(id) {
        return Some(DeviceKey::Index(DeviceIndex::Gpu(gpu)));
    }
    let (gpu, mig) = id.split_once(':')?;
    Some(DeviceKey::Index(DeviceIndex::Mig(
        number(gpu)?,
        number(mig)?,
    )))
}

/// A GPU or MIG device of the node, by every name an assignment may give it.
#[derive(Clone, Copy, Debug)]
pub struct NodeDevice<'a> {
    /// Its UUID.
    pub uuid: &'a str,
    /// Its index.
    pub index: DeviceIndex,
    /// Its GPU's device minor, where known.
    pub minor: Option<u32>,
    /// A MIG device's GPU and compute instance IDs.
    pub instance: Option<(u32, u32)>,
}

impl NodeDevice<'_> {
    /// The keys that name it.
    pub fn keys(&self) -> Vec<DeviceKey> {
        let mut keys = vec![
            DeviceKey::Uuid(self.uuid.to_string()),
            DeviceKey::Index(self.index),
        ];
        match (self.minor, self.instance) {
            (Some(gpu_minor), Some((gpu_instance, compute_instance))) => {
                for compute_instance in [Some(compute_instance), None] {
                    keys.push(DeviceKey::Mig(MigInstance {
                        gpu_minor,
                        gpu_instance,
                        compute_instance,
                    }));
                }
            }
            (Some(minor), None) => keys.push(DeviceKey::Minor(minor)),
            (None, _) => {}
        }
        keys
    }
}
