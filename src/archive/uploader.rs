//! The agent's archiving: each recording it keeps (`ingest::recordings`, the spool) goes to
//! the archive with its sidecar, oldest first, on the agent's runtime.
//!
//! # Invariants
//! - The queue is the spool itself: what is kept and not archived yet
//!   (`RecordingStore::unarchived`), so it is bounded by the spool's caps, survives a
//!   restart, and nothing leaves the spool but by its caps (an eviction before archiving is
//!   counted `evicted`). A recording is marked archived in its metadata file only once its
//!   object and then its sidecar are written: a listing that finds a sidecar finds its
//!   recording.
//! - One recording is in memory at a time (at most the spool's largest upload).
//! - A failed attempt is counted `failed` and ends the pass; the next waits
//!   [`FIRST_BACKOFF`], doubled after each failure up to [`MAX_BACKOFF`], whatever arrives
//!   meanwhile; a pass that succeeds resets it. Without news the spool is looked at again
//!   every [`RECHECK`].
//! - Told to stop, the uploader goes on archiving what is left, retrying, for at most the
//!   grace it was given (the chart's `terminationGracePeriodSeconds` leaves room for it),
//!   then stops: what is left stays in the spool for the next agent on this node.

use std::sync::Arc;
use std::time::Duration;

use super::address::RecordingKey;
use super::sidecar::Sidecar;
use super::{Archive, ArchiveError};
use crate::ingest::recordings::{RecordingStore, StoredRecording, UploadResult};

/// The wait after a first failure.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// How often the spool is looked at without news.
pub const RECHECK: Duration = Duration::from_secs(60);
/// The longest wait between two attempts while stopping.
const STOPPING_BACKOFF: Duration = Duration::from_secs(2);

/// The archiving of one spool.
#[derive(Debug)]
pub struct Uploads {
    archive: Archive,
    spool: Arc<RecordingStore>,
    cluster: String,
    node: String,
    wake: tokio::sync::Notify,
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
            wake: tokio::sync::Notify::new(),
        })
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

    /// Archives the spool until `stop` says so, then what is left within `grace`.
    pub async fn run(
        self: Arc<Self>,
        mut stop: tokio::sync::watch::Receiver<bool>,
        grace: Duration,
    ) {
        let mut backoff: Option<Duration> = None;
        loop {
            if *stop.borrow() {
                break;
            }
            let wait = match self.pass().await {
                Ok(()) => {
                    backoff = None;
                    RECHECK
                }
                Err(()) => {
                    let next = backoff.map_or(FIRST_BACKOFF, |b| (b * 2).min(MAX_BACKOFF));
                    *backoff.insert(next)
                }
            };
            let backing_off = backoff.is_some();
            tokio::select! {
                () = self.wake.notified(), if !backing_off => {}
                () = tokio::time::sleep(wait) => {}
                _ = stop.wait_for(|&stopped| stopped) => break,
            }
        }
        let left = self.spool.unarchived().len();
        if left > 0 {
            tracing::info!(
                left,
                ?grace,
                "archiving the recordings left before stopping"
            );
        }
        let drained = tokio::time::timeout(grace, async {
            let mut wait = FIRST_BACKOFF.min(STOPPING_BACKOFF);
            while self.pass().await.is_err() {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(STOPPING_BACKOFF);
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

    /// Archives each recording not archived yet, oldest first; stops at the first failure.
    async fn pass(&self) -> Result<(), ()> {
        for kept in self.spool.unarchived() {
            match self.upload(&kept).await {
                Ok(Some(address)) => {
                    self.spool.count_upload(UploadResult::Uploaded);
                    if let Err(e) = self.spool.archived(&kept.id, &address) {
                        // Archived all the same; a restart would archive it again.
                        tracing::warn!(id = kept.id, error = %e, "could not note an archived recording");
                    }
                    tracing::info!(id = kept.id, address, "recording archived");
                }
                // Evicted meanwhile (counted by the spool).
                Ok(None) => {}
                Err(e) => {
                    self.spool.count_upload(UploadResult::Failed);
                    tracing::warn!(id = kept.id, error = %e, "could not archive a recording");
                    return Err(());
                }
            }
        }
        Ok(())
    }

    /// Writes `kept` and then its sidecar; its address, or `None` where it was evicted.
    async fn upload(&self, kept: &StoredRecording) -> Result<Option<String>, ArchiveError> {
        let Some(file) = self.spool.file(&kept.id) else {
            return Ok(None);
        };
        let bytes = match tokio::fs::read(&file).await {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let key = RecordingKey::new(
            &self.cluster,
            &kept.pod_namespace,
            &kept.pod_name,
            &self.node,
            kept.time,
            kept.pid,
        )
        .ok_or_else(|| ArchiveError::Address(format!("no key for recording {}", kept.id)))?;
        let prefix = self.archive.url().prefix(&key.namespace);
        let path = key.recording(&prefix);
        let address = self.archive.url().object_url(&path);
        self.archive.put(&path, bytes).await?;
        let sidecar = Sidecar::of(kept, &key, address.clone(), &self.node);
        let json = serde_json::to_vec(&sidecar).map_err(std::io::Error::from)?;
        self.archive.put(&key.sidecar(&prefix), json).await?;
        Ok(Some(address))
    }
}
