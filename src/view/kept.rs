//! The recordings the agent keeps (`ingest::recordings`), opened in the view at
//! `/recordings/<id>/`, and, where it archives them, any archived recording of its cluster
//! at `/recordings/archive/<namespace>/<pod>/<name>/` (`archive`), one at a time.
//!
//! # Invariants (budgets)
//! - One recording is held in memory at a time, read within the store's reading budget
//!   (`RecordingLimits::read`); opening another drops the open one first. An archived one
//!   is fetched into memory first, at most the store's largest upload
//!   (`RecordingLimits::max_bytes_each`), and dropped once read.
//! - An archived recording is looked for only under the archive's prefix, in the agent's
//!   own cluster, by validated names (`archive::address`): nothing else in the bucket is
//!   read. It is served to whoever may see the kept ones (the page's credentials).
//! - The view keeps no replay cursor between requests, and the server runs one request at a
//!   time, opening included (`server::view`, one turn), each replay within the same budget
//!   (`Setup::max_memory_bytes`): the recording and one replay add at most twice the
//!   budget. Beside them: the view's bounded caches (a device's readings, 16 timelines of
//!   1000 points, 32 explanations) and an explanation's growth analysis, a few words per
//!   allocation of the trace (`explain::growth`).
//! - Alternating between two recordings reads each again on every switch (one open at a
//!   time): memory stays bounded, time does not shrink.
//! - A recording the store no longer keeps (evicted) is not served, even while it is open.

use std::sync::{Arc, Mutex, PoisonError};

use super::recording::{RecordingView, ViewError, ViewSource};
use crate::ingest::recordings::{RecordingStore, StoredRecording};
use crate::recording::{Recording, read_recording_with};
use crate::replay::Setup;

/// The store's recordings as views.
pub struct KeptViews {
    store: Arc<RecordingStore>,
    /// Where archived recordings are opened from, where the agent archives.
    #[cfg(feature = "archive")]
    archive: Option<Arc<crate::archive::uploader::Uploads>>,
    /// The open one, by id.
    open: Mutex<Option<(String, Arc<RecordingView>)>>,
}

impl KeptViews {
    /// Views of what `store` keeps.
    pub fn new(store: Arc<RecordingStore>) -> KeptViews {
        KeptViews {
            store,
            #[cfg(feature = "archive")]
            archive: None,
            open: Mutex::default(),
        }
    }

    /// These views, and those of the recordings `uploads` archived (by any agent of its
    /// cluster), by `<namespace>/<pod>/<name>`.
    #[cfg(feature = "archive")]
    pub fn with_archive(self, uploads: Arc<crate::archive::uploader::Uploads>) -> KeptViews {
        KeptViews {
            archive: Some(uploads),
            ..self
        }
    }

    /// The archived recording `id` (`<namespace>/<pod>/<name>`), read within the store's
    /// budgets. Blocking: called off the event loop, on the agent's runtime.
    #[cfg(feature = "archive")]
    fn archived(&self, id: &str) -> Result<(String, Recording), ViewError> {
        use crate::archive::address::RecordingKey;
        let not_found = || {
            ViewError::NotFound(format!(
                "the archive holds no recording {id} (GET /recordings/archive/<namespace>/<pod> opens a pod's newest)"
            ))
        };
        let Some(uploads) = &self.archive else {
            return Err(not_found());
        };
        let mut parts = id.splitn(3, '/');
        let (Some(namespace), Some(pod), Some(name)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(not_found());
        };
        let key =
            RecordingKey::named(uploads.cluster(), namespace, pod, name).ok_or_else(not_found)?;
        let archive = uploads.archive();
        let prefix = archive.url().prefix(namespace);
        let limits = self.store.limits();
        let fetched = tokio::runtime::Handle::try_current()
            .map_err(|e| ViewError::Unreadable(format!("the archive cannot be read here: {e}")))?
            .block_on(archive.get(&key.recording(&prefix), limits.max_bytes_each));
        let bytes = match fetched {
            Ok(bytes) => bytes,
            Err(crate::archive::ArchiveError::NotFound(_)) => return Err(not_found()),
            Err(e) => {
                return Err(ViewError::Unreadable(format!(
                    "the archive could not be read: {e}"
                )));
            }
        };
        let recording = crate::recording::parse_recording_with(&bytes, limits.read)
            .0
            .map_err(|e| {
                ViewError::Unreadable(format!("the archived recording cannot be read: {e}"))
            })?;
        Ok((format!("{namespace}/{pod} ({name}, archived)"), recording))
    }

    fn open(&self) -> std::sync::MutexGuard<'_, Option<(String, Arc<RecordingView>)>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The name a kept recording's page shows: its pod where known, its process.
fn name(kept: &StoredRecording) -> String {
    if kept.pod_name.is_empty() {
        format!("pid {} ({})", kept.pid, kept.id)
    } else {
        format!(
            "{}/{} (pid {}, {})",
            kept.pod_namespace, kept.pod_name, kept.pid, kept.id
        )
    }
}

impl ViewSource for KeptViews {
    fn view(&self, id: Option<&str>) -> Result<Arc<RecordingView>, ViewError> {
        // An archived recording's id has its namespace and pod; a kept one's is one segment.
        #[cfg(feature = "archive")]
        if let Some(id) = id.filter(|id| id.contains('/')) {
            {
                let open = self.open();
                if let Some((open_id, view)) = &*open
                    && open_id == id
                {
                    return Ok(Arc::clone(view));
                }
            }
            // Dropped before the next one is read: one recording in memory at a time.
            *self.open() = None;
            let (name, recording) = self.archived(id)?;
            return Ok(self.opened(id.to_string(), name, recording));
        }
        let not_found = || {
            ViewError::NotFound(format!(
                "this agent keeps no recording {} (GET /api/v1/recordings lists them)",
                id.unwrap_or("")
            ))
        };
        let kept = id.and_then(|id| self.store.get(id)).ok_or_else(not_found)?;
        let file = self.store.file(&kept.id).ok_or_else(not_found)?;
        {
            let mut open = self.open();
            match &*open {
                Some((open_id, view)) if *open_id == kept.id => return Ok(Arc::clone(view)),
                // Dropped before the next one is read: one recording in memory at a time.
                _ => *open = None,
            }
        }
        let read = self.store.limits().read;
        let recording = match read_recording_with(&file, read, &mut |_| {}) {
            Ok(recording) => recording,
            // Evicted while it was read.
            Err(_) if self.store.get(&kept.id).is_none() => return Err(not_found()),
            Err(e) => {
                return Err(ViewError::Unreadable(format!(
                    "the recording cannot be read again: {e}"
                )));
            }
        };
        Ok(self.opened(kept.id.clone(), name(&kept), recording))
    }
}

impl KeptViews {
    /// `recording`'s view, open under `id` until another is.
    fn opened(&self, id: String, name: String, recording: Recording) -> Arc<RecordingView> {
        let setup = Setup {
            max_memory_bytes: Some(self.store.limits().read.max_memory_bytes),
            ..Setup::default()
        };
        let view = Arc::new(RecordingView::new(Arc::new(recording), name, setup).with_cursors(0));
        *self.open() = Some((id, Arc::clone(&view)));
        view
    }
}
