//! The recordings the agent keeps (`ingest::recordings`), opened in the view at
//! `/recordings/<id>/`, one at a time.
//!
//! # Invariants (budgets)
//! - One recording is held in memory at a time, read within the store's reading budget
//!   (`RecordingLimits::read`); opening another drops the open one first.
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
use crate::recording::read_recording_with;
use crate::replay::Setup;

/// The store's recordings as views.
pub struct KeptViews {
    store: Arc<RecordingStore>,
    /// The open one, by id.
    open: Mutex<Option<(String, Arc<RecordingView>)>>,
}

impl KeptViews {
    /// Views of what `store` keeps.
    pub fn new(store: Arc<RecordingStore>) -> KeptViews {
        KeptViews {
            store,
            open: Mutex::default(),
        }
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
        let setup = Setup {
            max_memory_bytes: Some(read.max_memory_bytes),
            ..Setup::default()
        };
        let view =
            Arc::new(RecordingView::new(Arc::new(recording), name(&kept), setup).with_cursors(0));
        *self.open() = Some((kept.id, Arc::clone(&view)));
        Ok(view)
    }
}
