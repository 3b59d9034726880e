//! The agent's archiving: each recording it keeps (`ingest::recordings`, the spool) goes to
//! the archive with its sidecar, oldest first, on the agent's runtime.
//!
//! # Invariants
//! - The queue is the spool itself: what is kept and not archived yet
//!   (`RecordingStore::unarchived`), so it is bounded by the spool's caps, survives a
//!   restart of the agent's container, and nothing leaves the spool but by its caps (an
//!   eviction before archiving is counted `evicted`; one during the recording's upload,
//!   only once the upload ends without archiving it). A recording is marked archived in its
//!   metadata file only once its object and then its sidecar are written: a listing that
//!   finds a sidecar finds its recording.
//! - A recording is filed under its pod's namespace and name: as its upload named them, else
//!   as the kubelet's log directories name its pod's UID. While they name no pod of that UID
//!   yet, it waits, at most [`NAME_WAIT`] after it was kept; then, as a process in no known
//!   pod is, it goes under `_host` and this node's name.
//! - One recording is in memory at a time (at most the spool's largest upload).
//! - A recording that fails is counted `failed` and the pass goes on with the others (one
//!   tenant's refused prefix does not hold the rest back); after a pass with a failure the
//!   next waits [`FIRST_BACKOFF`], doubled after each such pass up to [`MAX_BACKOFF`], or
//!   until a new recording is kept; a pass without one resets it. Without news the spool is
//!   looked at again every [`RECHECK`].
//! - Told to stop, the uploader abandons the pass under way (what it was writing is written
//!   again) and, within the grace it was given from that moment, archives what is left,
//!   retrying, until the agent's listeners have stopped (an upload they were still reading
//!   is archived too) and nothing is left. What is left after the grace stays in the spool:
//!   for the next agent on the node where the spool outlives the pod (a `hostPath`), lost
//!   with an `emptyDir`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::address::{HOST, RecordingKey};
use super::sidecar::Sidecar;
use super::{Archive, ArchiveError};
use crate::ingest::recordings::{RecordingStore, StoredRecording, UploadResult};
use crate::telemetry::pod_names::PodNames;

/// The wait after a first failure.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// How often the spool is looked at without news.
pub const RECHECK: Duration = Duration::from_secs(60);
/// How long a recording whose pod is known by UID only waits for the pod's names.
pub const NAME_WAIT: Duration = Duration::from_secs(120);
/// How often a recording waiting for its pod's names is looked at again.
const NAME_RECHECK: Duration = Duration::from_secs(5);
/// The longest wait between two attempts while stopping.
const STOPPING_BACKOFF: Duration = Duration::from_secs(1);

/// The archiving of one spool.
pub struct Uploads {
    archive: Archive,
    spool: Arc<RecordingStore>,
    cluster: String,
    node: String,
    names: Option<PodNames>,
    wake: tokio::sync::Notify,
}

impl std::fmt::Debug for Uploads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uploads")
            .field("archive", &self.archive)
            .field("cluster", &self.cluster)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// What a pass did with the recordings waiting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Pass {
    failed: usize,
    waiting: usize,
}

impl Uploads {
    /// Archives what `spool` keeps into `archive`, filed under `cluster` and, for processes
    /// in no known pod, `node`.
    ///
    /// # Errors
    /// A cluster or node name that is not a key's segment (`address::valid_segment`).
    pub fn new(
        archive: Archive,
        spool: Arc<RecordingStore>,
        cluster: String,
        node: String,
    ) -> Result<Uploads, String> {
        for (what, name) in [("cluster", &cluster), ("node", &node)] {
            if !super::address::valid_segment(name) {
                return Err(format!(
                    "the {what} name {name:?} is not 1 to 253 letters, digits, '-', '_' and '.'"
                ));
            }
        }
        spool.archive();
        Ok(Uploads {
            archive,
            spool,
            cluster,
            node,
            names: None,
            wake: tokio::sync::Notify::new(),
        })
    }

    /// Names the pods of recordings whose upload did not (a socket pusher's: its pod's UID
    /// only) from `names`, the kubelet's log directories.
    pub fn with_names(self, names: Option<PodNames>) -> Uploads {
        Uploads { names, ..self }
    }

    /// The archive.
    pub fn archive(&self) -> &Archive {
        &self.archive
    }

    /// The cluster its recordings are filed under.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// Says that the spool holds a new recording.
    pub fn poke(&self) {
        self.wake.notify_one();
    }

    /// Archives the spool until `stop` says so, then what is left within `grace` (from
    /// then), until `listening` says the listeners have stopped and nothing is left.
    pub async fn run(
        self: Arc<Self>,
        mut stop: watch::Receiver<bool>,
        mut listening: watch::Receiver<bool>,
        grace: Duration,
    ) {
        let mut backoff: Option<Duration> = None;
        loop {
            let pass = tokio::select! {
                pass = self.pass(true) => pass,
                _ = stop.wait_for(|&stopped| stopped) => break,
            };
            let wait = if pass.failed > 0 {
                let next = backoff.map_or(FIRST_BACKOFF, |b| (b * 2).min(MAX_BACKOFF));
                *backoff.insert(next)
            } else {
                backoff = None;
                if pass.waiting > 0 {
                    NAME_RECHECK
                } else {
                    RECHECK
                }
            };
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(wait) => {}
                _ = stop.wait_for(|&stopped| stopped) => break,
            }
        }
        let left = self.spool.unarchived().len();
        tracing::info!(
            left,
            ?grace,
            "archiving the recordings left before stopping"
        );
        let drained = tokio::time::timeout(grace, async {
            loop {
                // No more waiting for pods' names: under the node rather than lost.
                let pass = self.pass(false).await;
                // A sender gone (the agent's run dropped) counts as stopped listeners.
                let stopped = *listening.borrow_and_update() || listening.has_changed().is_err();
                if pass == Pass::default() && stopped && self.spool.unarchived().is_empty() {
                    return;
                }
                tokio::select! {
                    () = tokio::time::sleep(STOPPING_BACKOFF) => {}
                    () = self.wake.notified() => {}
                    _ = listening.changed(), if !stopped => {}
                }
            }
        })
        .await;
        if drained.is_err() {
            let left = self.spool.unarchived().len();
            tracing::warn!(
                left,
                "stopped with recordings not archived; they stay in the spool"
            );
        }
    }

    /// Archives each recording not archived yet, oldest first, going on past failures;
    /// `patient`, a recording may wait for its pod's names.
    async fn pass(&self, patient: bool) -> Pass {
        let mut pass = Pass::default();
        // Impatient, every wait is over.
        let now = if patient {
            crate::ingest::recordings::unix_now()
        } else {
            f64::INFINITY
        };
        for kept in self.spool.unarchived() {
            let Some(key) = self.key_for(&kept, now) else {
                pass.waiting += 1;
                continue;
            };
            self.spool.begin_upload(&kept.id);
            match self.upload(&kept, &key).await {
                Ok(Some(address)) => {
                    self.spool.end_upload(Some(UploadResult::Uploaded));
                    if let Err(e) = self.spool.archived(&kept.id, &address) {
                        // Noted in memory all the same: not archived again by this agent.
                        tracing::warn!(id = kept.id, error = %e, "could not note an archived recording");
                    }
                    tracing::info!(id = kept.id, address, "recording archived");
                }
                // Evicted before it was read (counted by the spool).
                Ok(None) => self.spool.end_upload(None),
                Err(e) => {
                    self.spool.end_upload(Some(UploadResult::Failed));
                    tracing::warn!(id = kept.id, error = %e, "could not archive a recording");
                    pass.failed += 1;
                }
            }
        }
        pass
    }

    /// Where `kept` is filed (see the module's invariants), `None` while it waits for its
    /// pod's names; `now` in Unix seconds.
    fn key_for(&self, kept: &StoredRecording, now: f64) -> Option<RecordingKey> {
        let named = (!kept.pod_name.is_empty())
            .then(|| (kept.pod_namespace.clone(), kept.pod_name.clone()))
            .or_else(|| {
                let directory = self.names.as_ref()?.directory();
                let name = directory.name(&kept.pod_uid, &kept.container_id)?;
                Some((name.namespace, name.pod))
            });
        let (namespace, pod) = match named {
            Some(named) => named,
            None if !kept.pod_uid.is_empty()
                && self.names.is_some()
                && now - kept.time < NAME_WAIT.as_secs_f64() =>
            {
                return None;
            }
            None => (HOST.to_string(), self.node.clone()),
        };
        RecordingKey::new(
            &self.cluster,
            &namespace,
            &pod,
            &self.node,
            kept.time,
            kept.pid,
        )
    }

    /// Writes `kept` under `key` and then its sidecar; its address, or `None` where it was
    /// evicted.
    async fn upload(
        &self,
        kept: &StoredRecording,
        key: &RecordingKey,
    ) -> Result<Option<String>, ArchiveError> {
        let Some(file) = self.spool.file(&kept.id) else {
            return Ok(None);
        };
        let bytes = match tokio::fs::read(&file).await {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let prefix = self.archive.url().prefix(&key.namespace);
        let path = key.recording(&prefix);
        let address = self.archive.url().object_url(&path);
        self.archive.put(&path, bytes).await?;
        let sidecar = Sidecar::of(kept, key, address.clone(), &self.node);
        let json = serde_json::to_vec(&sidecar).map_err(std::io::Error::from)?;
        self.archive.put(&key.sidecar(&prefix), json).await?;
        Ok(Some(address))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::pod_names::NameDirectory;

    fn kept(namespace: &str, pod: &str, pod_uid: &str, time: f64) -> StoredRecording {
        StoredRecording {
            id: "1".into(),
            pid: 42,
            pod_uid: pod_uid.into(),
            container_id: String::new(),
            pod_namespace: namespace.into(),
            pod_name: pod.into(),
            container_name: String::new(),
            device: None,
            time,
            bytes: 1,
            oom_event: None,
            tenant: None,
            oom: None,
            pytorch_version: String::new(),
            allocator_settings: String::new(),
            archived: None,
        }
    }

    /// Issue 60 (review): a socket pusher's recording names its pod by UID only; it is
    /// filed under its pod's names from the kubelet's log directories, waits for them a
    /// while, and only then goes under its node.
    #[test]
    fn recordings_are_filed_under_their_pods_names() {
        let dir = std::env::temp_dir().join(format!("gpumem-uploads-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let spool =
            Arc::new(RecordingStore::open(dir.clone(), Default::default()).expect("a spool"));
        let archive = Archive::open(
            "file:///nowhere".parse().expect("a URL"),
            super::super::Credentials::Environment,
        )
        .expect("opens");
        let uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let names = PodNames::fixed(NameDirectory::from_names(
            [(
                uid.to_string(),
                "team-a".to_string(),
                "trainer-0".to_string(),
            )],
            [],
        ));
        let uploads = Uploads::new(archive, spool, "prod".into(), "node-1".into())
            .expect("valid names")
            .with_names(Some(names));
        let filed = |kept: &StoredRecording, now: f64| {
            uploads
                .key_for(kept, now)
                .map(|k| format!("{}/{}", k.namespace, k.pod))
        };
        assert_eq!(
            filed(&kept("ml", "job-0", "", 0.0), 0.0).as_deref(),
            Some("ml/job-0"),
            "as uploaded"
        );
        assert_eq!(
            filed(&kept("", "", uid, 0.0), 1.0).as_deref(),
            Some("team-a/trainer-0"),
            "by its pod's UID"
        );
        let unknown = "11111111-2222-3333-4444-555555555555";
        assert_eq!(
            filed(&kept("", "", unknown, 0.0), 10.0),
            None,
            "waits for the names"
        );
        assert_eq!(
            filed(&kept("", "", unknown, 0.0), NAME_WAIT.as_secs_f64() + 1.0).as_deref(),
            Some("_host/node-1"),
            "then under its node"
        );
        assert_eq!(
            filed(&kept("", "", "", 0.0), 0.0).as_deref(),
            Some("_host/node-1"),
            "no pod"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
