//! The NVIDIA driver's capability devices for MIG (`/proc/driver/nvidia-caps/mig-minors`):
//! which `/dev/nvidia-caps/nvidia-cap<N>` grants access to which GPU instance or compute
//! instance. A container given a MIG device gets the two access nodes of its instance, so
//! the minor of a node names the instance: `gpu<G>/gi<I>/access <N>` is GPU instance `I` of
//! the GPU whose device minor is `G` (its `/dev/nvidia<G>`), `gpu<G>/gi<I>/ci<C>/access <N>`
//! compute instance `C` in it. (`config` and `monitor` lines name no instance.)
//!
//! # Budgets
//! - The file is read up to [`MAX_BYTES`]; lines that do not parse are skipped.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::Path;

/// Where the driver lists them.
pub const DEFAULT_PATH: &str = "/proc/driver/nvidia-caps/mig-minors";
/// The most of the file read (a node of 8 GPUs with every instance lists under 40 KiB).
pub const MAX_BYTES: u64 = 1 << 20;

/// A MIG instance a capability device grants access to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MigInstance {
    /// The parent GPU's device minor (`/dev/nvidia<minor>`).
    pub gpu_minor: u32,
    /// The GPU instance's ID.
    pub gpu_instance: u32,
    /// The compute instance's ID, for a compute instance's node.
    pub compute_instance: Option<u32>,
}

/// Capability device minor → the instance it grants access to, and the minors of the
/// capabilities that name no instance (`config`, `monitor`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigMinors {
    instances: HashMap<u32, MigInstance>,
    others: HashSet<u32>,
}

impl MigMinors {
    /// The file at `path`; none where it is absent (no MIG-capable driver) or unreadable.
    pub fn read(path: &Path) -> MigMinors {
        let mut text = String::new();
        let read =
            std::fs::File::open(path).and_then(|f| f.take(MAX_BYTES).read_to_string(&mut text));
        match read {
            Ok(_) => MigMinors::parse(&text),
            Err(_) => MigMinors::default(),
        }
    }

    /// The file's text.
    pub fn parse(text: &str) -> MigMinors {
        let mut minors = MigMinors::default();
        for line in text.lines() {
            let Some((name, minor)) = line.trim().split_once(char::is_whitespace) else {
                continue;
            };
            let Ok(minor) = minor.trim().parse::<u32>() else {
                continue;
            };
            match instance_of(name) {
                Some(instance) => {
                    minors.instances.insert(minor, instance);
                }
                None if matches!(name, "config" | "monitor") => {
                    minors.others.insert(minor);
                }
                None => {}
            }
        }
        minors
    }

    /// The instance `/dev/nvidia-caps/nvidia-cap<minor>` grants access to.
    pub fn get(&self, minor: u32) -> Option<MigInstance> {
        self.instances.get(&minor).copied()
    }

    /// Whether `/dev/nvidia-caps/nvidia-cap<minor>` is MIG's `config` or `monitor`
    /// capability, which names no instance.
    pub fn names_no_instance(&self, minor: u32) -> bool {
        self.others.contains(&minor)
    }
}

/// `gpu<G>/gi<I>/access` or `gpu<G>/gi<I>/ci<C>/access`.
fn instance_of(name: &str) -> Option<MigInstance> {
    let number = |part: &str, prefix: &str| part.strip_prefix(prefix)?.parse::<u32>().ok();
    let parts: Vec<&str> = name.split('/').collect();
    match parts.as_slice() {
        [gpu, gi, "access"] => Some(MigInstance {
            gpu_minor: number(gpu, "gpu")?,
            gpu_instance: number(gi, "gi")?,
            compute_instance: None,
        }),
        [gpu, gi, ci, "access"] => Some(MigInstance {
            gpu_minor: number(gpu, "gpu")?,
            gpu_instance: number(gi, "gi")?,
            compute_instance: Some(number(ci, "ci")?),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_lines_name_instances_and_the_rest_is_skipped() {
        let minors = MigMinors::parse(
            "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n\
             gpu2/gi7/access 66\ngpu2/gi7/ci1/access 68\ngpu1/gi1/ci/access 9\n\
             gpu1/gi1/access x\n garbage\n\n",
        );
        assert_eq!(
            minors.get(66),
            Some(MigInstance {
                gpu_minor: 2,
                gpu_instance: 7,
                compute_instance: None
            })
        );
        assert_eq!(
            minors.get(68),
            Some(MigInstance {
                gpu_minor: 2,
                gpu_instance: 7,
                compute_instance: Some(1)
            })
        );
        assert_eq!(minors.get(4).and_then(|m| m.compute_instance), Some(0));
        for none in [1, 2, 9] {
            assert_eq!(minors.get(none), None);
        }
        assert!(minors.names_no_instance(1) && minors.names_no_instance(2));
        assert!(!minors.names_no_instance(9) && !minors.names_no_instance(66));
        assert_eq!(
            MigMinors::read(Path::new("/nonexistent/mig-minors")),
            MigMinors::default()
        );
    }
}
