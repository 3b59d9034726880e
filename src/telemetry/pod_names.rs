//! Pod and container names for the pod UIDs and container IDs a process's cgroup gives, from
//! the kubelet's log directories.
//!
//! The kubelet keeps every container's logs under `/var/log/pods/<namespace>_<pod>_<uid>/`
//! and links each as `/var/log/containers/<pod>_<namespace>_<container>-<container id>.log`.
//! Namespaces, pod names and container names are DNS labels or subdomains, which never hold
//! `_`, so both names split unambiguously. Only the names of entries are read, never a file.
//!
//! # Invariants
//! - A name comes only from an entry naming that exact UID or container ID: a process is
//!   never named after another pod.
//! - At most [`MAX_ENTRIES`] entries of each directory are read, parsed as they are listed (a
//!   node runs a few hundred containers at most); reaching the cap is logged.
//! - `containers/` is optional: without it, pods are named and containers are not.
//! - The directory is the last successful read; an unreadable directory reports the source
//!   down and the last read stands.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::SourceReport;
use super::latest::Latest;

/// Where the kubelet keeps pod logs.
pub const PODS_DIR: &str = "/var/log/pods";
/// Where the kubelet links container logs.
pub const CONTAINERS_DIR: &str = "/var/log/containers";
/// The `source` label of the directories' up and duration metrics.
pub const SOURCE: &str = "pod_logs";
/// Entries read from each directory at most.
pub const MAX_ENTRIES: usize = 10_000;

/// A process's pod and container, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodName {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub pod: String,
    /// The container's name in the pod spec; empty when its log link is not there.
    pub container: String,
}

/// Pod UID → (namespace, pod) and container ID → container name, from one read.
#[derive(Debug, Default)]
pub struct NameDirectory {
    pods: HashMap<String, (String, String)>,
    containers: HashMap<String, String>,
}

/// `<namespace>_<pod>_<uid>` → (uid, namespace, pod).
fn pod_entry(name: &str) -> Option<(&str, &str, &str)> {
    let mut parts = name.splitn(3, '_');
    let (namespace, pod, uid) = (parts.next()?, parts.next()?, parts.next()?);
    (!namespace.is_empty() && !pod.is_empty() && super::cgroup::is_pod_uid(uid))
        .then_some((uid, namespace, pod))
}

/// `<pod>_<namespace>_<container>-<64 hex>.log` → (container id, container).
fn container_entry(name: &str) -> Option<(&str, &str)> {
    let stem = name.strip_suffix(".log")?;
    let (rest, id) = stem.rsplit_once('-')?;
    if !super::cgroup::is_container_id(id) {
        return None;
    }
    let mut parts = rest.splitn(3, '_');
    let (_pod, _namespace, container) = (parts.next()?, parts.next()?, parts.next()?);
    (!container.is_empty() && !container.contains('_')).then_some((id, container))
}

/// A directory that could not be listed.
#[derive(Debug, thiserror::Error)]
#[error("cannot list {}: {source}", dir.display())]
pub struct ListError {
    /// The directory.
    pub dir: std::path::PathBuf,
    /// Why.
    pub source: std::io::Error,
}

/// Calls `each` with the name of every entry of `dir`, up to [`MAX_ENTRIES`].
fn for_each_entry(dir: &Path, mut each: impl FnMut(&str)) -> Result<(), ListError> {
    let context = |source| ListError {
        dir: dir.to_path_buf(),
        source,
    };
    for (seen, entry) in std::fs::read_dir(dir).map_err(context)?.enumerate() {
        if seen == MAX_ENTRIES {
            tracing::warn!(dir = %dir.display(), "more than {MAX_ENTRIES} entries; the rest are not read");
            break;
        }
        if let Some(name) = entry.map_err(context)?.file_name().to_str() {
            each(name);
        }
    }
    Ok(())
}

impl NameDirectory {
    /// Reads both directories.
    ///
    /// # Errors
    /// Why a directory could not be listed, naming it.
    pub fn read(pods_dir: &Path, containers_dir: &Path) -> Result<NameDirectory, ListError> {
        let mut directory = NameDirectory::default();
        for_each_entry(pods_dir, |name| {
            if let Some((uid, namespace, pod)) = pod_entry(name) {
                directory
                    .pods
                    .insert(uid.to_string(), (namespace.to_string(), pod.to_string()));
            }
        })?;
        if containers_dir.is_dir() {
            for_each_entry(containers_dir, |name| {
                if let Some((id, container)) = container_entry(name) {
                    directory
                        .containers
                        .insert(id.to_ascii_lowercase(), container.to_string());
                }
            })?;
        }
        Ok(directory)
    }

    /// A directory of these (uid, namespace, pod) and (container id, container) names.
    pub fn from_names(
        pods: impl IntoIterator<Item = (String, String, String)>,
        containers: impl IntoIterator<Item = (String, String)>,
    ) -> NameDirectory {
        NameDirectory {
            pods: pods
                .into_iter()
                .map(|(uid, namespace, pod)| (uid, (namespace, pod)))
                .collect(),
            containers: containers.into_iter().collect(),
        }
    }

    /// The names of the pod with this UID and of its container with this ID.
    pub fn name(&self, pod_uid: &str, container_id: &str) -> Option<PodName> {
        let (namespace, pod) = self.pods.get(pod_uid)?;
        Some(PodName {
            namespace: namespace.clone(),
            pod: pod.clone(),
            container: self
                .containers
                .get(container_id)
                .cloned()
                .unwrap_or_default(),
        })
    }

    /// Number of pods known.
    pub fn pods(&self) -> usize {
        self.pods.len()
    }
}

/// The last read of the log directories, refreshed by [`PodNames::refresh`].
#[derive(Clone)]
pub struct PodNames {
    pods_dir: PathBuf,
    containers_dir: PathBuf,
    latest: Latest<NameDirectory>,
}

impl PodNames {
    /// Names from these directories; nothing is read until the first refresh.
    pub fn new(pods_dir: PathBuf, containers_dir: PathBuf) -> Self {
        PodNames {
            pods_dir,
            containers_dir,
            latest: Latest::new(SOURCE, "the log directories have not been read yet"),
        }
    }

    /// Names that never change, reported up: a simulated node's (never refreshed).
    pub fn fixed(directory: NameDirectory) -> Self {
        let names = PodNames::new(PathBuf::new(), PathBuf::new());
        names.latest.up(directory, 0.0);
        names
    }

    /// The latest report (up or down, and why).
    pub fn report(&self) -> Arc<SourceReport> {
        self.latest.report()
    }

    /// The last successful read.
    pub fn directory(&self) -> Arc<NameDirectory> {
        self.latest.answer()
    }

    /// Reads the directories again and publishes the result, logging a change of state once.
    pub fn refresh(&self) {
        let started = Instant::now();
        let result = NameDirectory::read(&self.pods_dir, &self.containers_dir);
        let duration_seconds = started.elapsed().as_secs_f64();
        match result {
            Ok(directory) => {
                let pods = directory.pods();
                if self.latest.up(directory, duration_seconds) {
                    tracing::info!(pods, "pod names from the kubelet's log directories");
                }
            }
            Err(error) => {
                let reason = error.to_string();
                if self.latest.down(reason.clone(), duration_seconds) {
                    tracing::warn!(reason = %reason, "pod log directories unreadable; pods are named by UID only");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c30";

    #[test]
    fn entries_split_into_names() {
        assert_eq!(
            pod_entry(&format!("ml-team_train-0_{UID}")),
            Some((UID, "ml-team", "train-0"))
        );
        let id = "ab".repeat(32);
        assert_eq!(
            container_entry(&format!("train-0_ml-team_trainer-{id}.log")),
            Some((id.as_str(), "trainer"))
        );
        // Container names may hold dashes: the ID is what follows the last one.
        assert_eq!(
            container_entry(&format!("p_ns_nccl-proxy-{id}.log")),
            Some((id.as_str(), "nccl-proxy"))
        );
        for bad in [
            "kube-system_coredns".to_string(),
            format!("ns_pod_{}", &UID[1..]),
            format!("_pod_{UID}"),
        ] {
            assert_eq!(pod_entry(&bad), None, "{bad}");
        }
        for bad in [
            format!("p_ns_c-{}.log", &id[1..]),
            format!("p_ns_c-{id}.txt"),
            format!("p_ns_-{id}.log"),
            format!("p_ns-{id}.log"),
        ] {
            assert_eq!(container_entry(&bad), None, "{bad}");
        }
    }

    #[test]
    fn a_node_layout_names_its_processes() {
        let root = std::env::temp_dir().join(format!("gpumem-podnames-{}", std::process::id()));
        let (pods, containers) = (root.join("pods"), root.join("containers"));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(pods.join(format!("ml_train-0_{UID}/trainer"))).expect("dir");
        std::fs::create_dir_all(pods.join("not-a-pod")).expect("dir");
        std::fs::create_dir_all(&containers).expect("dir");
        let id = "cd".repeat(32);
        std::fs::write(containers.join(format!("train-0_ml_trainer-{id}.log")), b"").expect("file");
        let names = PodNames::new(pods.clone(), containers.clone());
        names.refresh();
        assert!(names.report().up);
        let d = names.directory();
        assert_eq!(
            d.name(UID, &id),
            Some(PodName {
                namespace: "ml".into(),
                pod: "train-0".into(),
                container: "trainer".into(),
            })
        );
        // A container whose link is gone still has its pod's names.
        assert_eq!(
            d.name(UID, &"ef".repeat(32)).map(|n| n.container),
            Some(String::new())
        );
        assert_eq!(d.name("0b7e9d14-2c3a-4f5b-8e6d-1a2b3c4d5e6f", &id), None);

        // Without containers/, pods are still named.
        std::fs::remove_dir_all(&containers).expect("remove");
        names.refresh();
        assert!(names.report().up);
        assert_eq!(
            names.directory().name(UID, &id).map(|n| n.pod),
            Some("train-0".into())
        );

        std::fs::remove_dir_all(&root).expect("cleanup");
        names.refresh();
        let report = names.report();
        assert!(!report.up);
        assert!(
            report.error.as_deref().is_some_and(|e| e.contains("pods")),
            "{report:?}"
        );
        assert!(
            names.directory().name(UID, &id).is_some(),
            "the last read stands"
        );
    }
}
