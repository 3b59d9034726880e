//! Devices assigned by Dynamic Resource Allocation, resolved on the node without the API
//! server: the kubelet names a claim's device by its driver, pool and device name (a
//! ResourceSlice's, not a GPU's) and by the CDI devices the driver prepared for it; the
//! node's CDI specs and the driver's MIG capability minors say which GPU or MIG device that
//! is.
//!
//! A claim's device resolves, first match wins, to:
//! 1. what its CDI devices' own edits name: `NVIDIA_VISIBLE_DEVICES` entries (UUIDs or
//!    indices), and device nodes: a MIG instance's `/dev/nvidia-caps/nvidia-cap<N>` (through
//!    [`MigMinors`]: its GPU's minor and instance IDs) rather than its parent's
//!    `/dev/nvidia<M>`, which a MIG device's spec lists too, else a whole GPU's
//!    `/dev/nvidia<M>` (its device minor);
//! 2. for NVIDIA's driver (`gpu.nvidia.com`), a whole GPU's device name `gpu-<N>`: the GPU
//!    whose device minor is `N` (the driver names GPUs by minor since its PR #428, not by
//!    NVML's index; the two differ where the driver numbered GPUs otherwise than the PCI
//!    order NVML follows). Its MIG devices' names (`gpu-<minor>-mig-<profile>-<profile
//!    ID>-<placement>`) carry no instance IDs: only their CDI specs resolve them;
//! 3. nothing: the assignment is exported by its driver, pool and device names.
//!
//! # Invariants
//! - Resolution reads files only (the CDI spec directories, `mig-minors`): no RBAC, no
//!   network; what it cannot resolve it reports unresolved, never guesses (a MIG device whose
//!   capability node `mig-minors` does not list is not taken for its parent GPU).

use std::path::{Path, PathBuf};

use super::cdi::{CdiSpecs, Edits};
use super::device_key::{DeviceKey, number, parse_id};
use super::nvidia_caps::MigMinors;

/// NVIDIA's DRA driver.
pub const NVIDIA_DRIVER: &str = "gpu.nvidia.com";

/// A device as a DRA driver's ResourceSlice names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DraDevice {
    /// The driver (`gpu.nvidia.com`).
    pub driver: String,
    /// Its pool (NVIDIA's: the node's name).
    pub pool: String,
    /// The device's name in the pool (NVIDIA's: `gpu-0`, `gpu-0-mig-…`).
    pub device: String,
}

/// Where a node keeps what resolves DRA devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFiles {
    /// CDI spec directories, in increasing priority.
    pub cdi_dirs: Vec<PathBuf>,
    /// The driver's `mig-minors` file.
    pub mig_minors: PathBuf,
}

impl Default for NodeFiles {
    fn default() -> Self {
        NodeFiles {
            cdi_dirs: super::cdi::DEFAULT_SPEC_DIRS.map(PathBuf::from).to_vec(),
            mig_minors: super::nvidia_caps::DEFAULT_PATH.into(),
        }
    }
}

/// The node's files, read again as they change.
pub struct NodeReader {
    specs: CdiSpecs,
    mig_minors: PathBuf,
}

impl NodeReader {
    /// A reader of `files`.
    pub fn new(files: NodeFiles) -> NodeReader {
        NodeReader {
            specs: CdiSpecs::new(files.cdi_dirs),
            mig_minors: files.mig_minors,
        }
    }

    /// What resolves devices now; the CDI spec files skipped, with their reasons.
    pub fn resolver(&mut self) -> (Resolver, Vec<(PathBuf, String)>) {
        let (cdi, skipped) = self.specs.devices();
        let resolver = Resolver {
            cdi,
            mig_minors: MigMinors::read(&self.mig_minors),
        };
        (resolver, skipped)
    }
}

/// The node's CDI devices and MIG capability minors at one moment.
#[derive(Debug, Default)]
pub struct Resolver {
    cdi: std::collections::HashMap<String, Edits>,
    mig_minors: MigMinors,
}

impl Resolver {
    /// A resolver of these CDI devices (qualified name → edits) and minors.
    pub fn new(cdi: std::collections::HashMap<String, Edits>, mig_minors: MigMinors) -> Self {
        Resolver { cdi, mig_minors }
    }

    /// The keys naming the node's device that a claim's device is (its driver's name for it,
    /// and the qualified names of the CDI devices prepared for it); empty when unresolved.
    pub fn resolve<'a>(
        &self,
        driver: &str,
        device: &str,
        cdi_devices: impl IntoIterator<Item = &'a str>,
    ) -> Vec<DeviceKey> {
        let mut keys: Vec<DeviceKey> = Vec::new();
        let (mut instances, mut minors, mut caps) = (Vec::new(), Vec::new(), 0);
        for edits in cdi_devices.into_iter().filter_map(|d| self.cdi.get(d)) {
            keys.extend(edits.env.iter().flat_map(|e| visible_devices(e)));
            for node in &edits.device_nodes {
                let path = Path::new(node.host_path());
                if let Some(cap) = minor_of(path, "/dev/nvidia-caps", "nvidia-cap") {
                    // MIG's config and monitor capabilities name no instance.
                    if !self.mig_minors.names_no_instance(cap) {
                        caps += 1;
                        instances.extend(self.mig_minors.get(cap));
                    }
                } else if let Some(minor) = minor_of(path, "/dev", "nvidia") {
                    minors.push(minor);
                }
            }
        }
        // A MIG device's spec lists its parent's node too: the instance names it. A compute
        // instance's node is more precise than its GPU instance's.
        let precise = instances.iter().any(|i| i.compute_instance.is_some());
        instances.retain(|i| !precise || i.compute_instance.is_some());
        // A capability node names a MIG instance: one `mig-minors` does not list leaves the
        // device unresolved, never its parent GPU.
        if caps == 0 {
            keys.extend(minors.into_iter().map(DeviceKey::Minor));
        } else {
            keys.extend(instances.into_iter().map(DeviceKey::Mig));
        }
        if keys.is_empty()
            && driver == NVIDIA_DRIVER
            && let Some(minor) = device.strip_prefix("gpu-").and_then(number)
        {
            keys.push(DeviceKey::Minor(minor));
        }
        let mut seen = std::collections::HashSet::new();
        keys.retain(|k| seen.insert(k.clone()));
        keys
    }
}

/// `<dir>/<prefix><N>` → `N`.
fn minor_of(path: &Path, dir: &str, prefix: &str) -> Option<u32> {
    if path.parent()? != Path::new(dir) {
        return None;
    }
    number(path.file_name()?.to_str()?.strip_prefix(prefix)?)
}

/// The devices an `NVIDIA_VISIBLE_DEVICES=…` entry names ([`parse_id`]; `all`, `none` and
/// `void` name none).
fn visible_devices(entry: &str) -> Vec<DeviceKey> {
    let Some(list) = entry.strip_prefix("NVIDIA_VISIBLE_DEVICES=") else {
        return Vec::new();
    };
    list.split(',')
        .filter_map(|id| parse_id(id.trim()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::cdi::DeviceNode;
    use super::super::device_key::DeviceIndex;
    use super::super::nvidia_caps::MigInstance;
    use super::*;

    /// A claim's device: its driver, its name, its CDI devices.
    fn claim<'a>(driver: &'a str, device: &'a str, cdi: &'a [&'a str]) -> Claim<'a> {
        (driver, device, cdi)
    }

    type Claim<'a> = (&'a str, &'a str, &'a [&'a str]);

    fn edits(env: &[&str], nodes: &[&str]) -> Edits {
        Edits {
            env: env.iter().map(|s| (*s).to_string()).collect(),
            device_nodes: nodes
                .iter()
                .map(|p| DeviceNode {
                    path: (*p).into(),
                    host_path: None,
                })
                .collect(),
        }
    }

    #[test]
    fn cdi_edits_names_and_minors_resolve_and_the_rest_does_not() {
        let cdi = [
            (
                "k8s.gpu.nvidia.com/claim=u1-gpu-1",
                edits(&[], &["/dev/nvidia1"]),
            ),
            (
                "k8s.gpu.nvidia.com/claim=u2-mig",
                edits(
                    &[],
                    &[
                        "/dev/nvidia0",
                        "/dev/nvidia-caps/nvidia-cap21",
                        "/dev/nvidia-caps/nvidia-cap22",
                    ],
                ),
            ),
            (
                "nvidia.com/gpu=uuid",
                edits(&["NVIDIA_VISIBLE_DEVICES=GPU-abc,3:1,void"], &[]),
            ),
            (
                "k8s.gpu.nvidia.com/claim=u3-ctl",
                edits(&[], &["/dev/nvidiactl"]),
            ),
            (
                "k8s.gpu.nvidia.com/claim=u4-mig-unlisted",
                edits(&[], &["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap99"]),
            ),
            // A management container's whole GPU, with MIG's config capability.
            (
                "k8s.gpu.nvidia.com/claim=u5-gpu-2",
                edits(&[], &["/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap1"]),
            ),
        ]
        .into_iter()
        .map(|(n, e)| (n.to_string(), e))
        .collect();
        let resolver = Resolver::new(
            cdi,
            MigMinors::parse("config 1\nmonitor 2\ngpu0/gi3/access 21\ngpu0/gi3/ci0/access 22\n"),
        );
        let r = |(driver, device, cdi): Claim<'_>| {
            resolver.resolve(driver, device, cdi.iter().copied())
        };
        assert_eq!(
            r(claim(
                NVIDIA_DRIVER,
                "gpu-1",
                &["k8s.gpu.nvidia.com/claim=u1-gpu-1"]
            )),
            [DeviceKey::Minor(1)]
        );
        assert_eq!(
            r(claim(
                NVIDIA_DRIVER,
                "gpu-2",
                &["k8s.gpu.nvidia.com/claim=u5-gpu-2"]
            )),
            [DeviceKey::Minor(2)]
        );
        assert_eq!(
            r(claim(
                NVIDIA_DRIVER,
                "gpu-0-mig-9-3-4",
                &["k8s.gpu.nvidia.com/claim=u2-mig"]
            )),
            [DeviceKey::Mig(MigInstance {
                gpu_minor: 0,
                gpu_instance: 3,
                compute_instance: Some(0)
            })]
        );
        assert_eq!(
            r(claim("other.example.com", "x", &["nvidia.com/gpu=uuid"])),
            [
                DeviceKey::Uuid("GPU-abc".into()),
                DeviceKey::Index(DeviceIndex::Mig(3, 1))
            ]
        );
        // No CDI device: NVIDIA's whole-GPU name is the device minor; its MIG names, another
        // driver's names and nodes that are no GPU's resolve to nothing.
        assert_eq!(r(claim(NVIDIA_DRIVER, "gpu-5", &[])), [DeviceKey::Minor(5)]);
        for unresolved in [
            claim(NVIDIA_DRIVER, "gpu-0-mig-1g10gb-0-0", &["missing=x"]),
            claim(NVIDIA_DRIVER, "gpu-+1", &[]),
            claim("dra.example.com", "gpu-2", &[]),
            claim(NVIDIA_DRIVER, "gpux", &["k8s.gpu.nvidia.com/claim=u3-ctl"]),
            // A MIG instance mig-minors does not list: not its parent GPU.
            claim(
                NVIDIA_DRIVER,
                "gpu-0-mig-1g10gb-19-0",
                &["k8s.gpu.nvidia.com/claim=u4-mig-unlisted"],
            ),
        ] {
            assert_eq!(r(unresolved), [], "{unresolved:?}");
        }
    }
}
