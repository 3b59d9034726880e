//! Recordings jobs upload at an out-of-memory error (`POST /api/v1/recordings`), kept on
//! disk within caps and listed (`GET /api/v1/recordings`), so that the operator can open the
//! failing job's last moments.
//!
//! An upload is a PyTorch memory snapshot (`torch.cuda.memory._snapshot()`, pickled) sent
//! gzipped by a process this agent tracks: the server attributes it as it attributes pushes,
//! and the process must have pushed (its pod and labels are the upload's). The body is
//! streamed to a temporary file in the store's directory (never held whole), read once with
//! the recording reader (which tells a malformed or truncated file from a recording and
//! finds its OOM), then renamed into the store, the oldest recordings evicted to make room.
//!
//! # Invariants (budgets)
//! - An upload is at most [`RecordingLimits::max_bytes_each`] bytes as sent (a declared
//!   larger one is refused unread, a longer one when it crosses the cap) and decompresses to
//!   at most [`RecordingLimits::read`]'s input bound; at most [`MAX_UPLOADS`] bodies are
//!   received at once (others are refused as `rate_limited`), each within [`UPLOAD_TIMEOUT`].
//! - One upload is read at a time, within [`RecordingLimits::read`]'s memory budget.
//! - At most [`RecordingLimits::max_count`] recordings and [`RecordingLimits::max_bytes`]
//!   bytes are kept: a new one evicts the oldest until it fits.
//! - The store's files are `<id>.pickle.gz` and its `<id>.json`, and uploads in flight
//!   (`.upload-*`). At start, valid pairs are listed again (oldest evicted past the caps) and
//!   the store's other files (a partial upload, half a pair) removed; files of other names are
//!   left alone.
//! - One process (by pid) uploads at most once per [`MIN_UPLOAD_GAP`] (`rate_limited`): its
//!   hook records at most once per ten minutes, and a pusher cannot evict the other jobs'
//!   recordings by uploading in a loop under one pid.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::refusal::{Refusal, Rejected};
use crate::allocator::TraceAction;
use crate::recording::{ReadLimits, TraceError, read_recording_with};
use crate::sources::RecordingsReport;

/// Uploads received at once.
pub const MAX_UPLOADS: usize = 2;
/// The longest an upload's body may take.
pub const UPLOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// The least time between two uploads of one process.
pub const MIN_UPLOAD_GAP: Duration = Duration::from_secs(60);
/// Processes whose last upload is remembered for the gap.
const MAX_REMEMBERED: usize = 4096;
/// The extension of a stored recording.
const RECORDING: &str = "pickle.gz";
/// The prefix of an upload in flight.
const UPLOADING: &str = ".upload-";

/// What the store keeps and reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordingLimits {
    /// The largest upload, as sent (gzipped).
    pub max_bytes_each: u64,
    /// Bytes of all recordings kept.
    pub max_bytes: u64,
    /// Recordings kept.
    pub max_count: usize,
    /// Reading an upload: its decompressed size and the memory the reader may hold.
    pub read: ReadLimits,
}

impl Default for RecordingLimits {
    /// 16 MiB each, 1 GiB and 100 in all; read within 256 MiB decompressed and 64 MiB of
    /// memory. Measured: a real recording of 19 464 events with stacks
    /// (`cs336_lm_fwd_bwd_step`) is 3.7 MB pickled, 229 kB gzipped, read within a 7 MiB
    /// budget (not 6), and read and replayed within 16 MB resident; at that rate (about
    /// 370 bytes an event) PyTorch's 100 000-entry history cap needs about 37 MiB.
    fn default() -> Self {
        RecordingLimits {
            max_bytes_each: 16 << 20,
            max_bytes: 1 << 30,
            max_count: 100,
            read: ReadLimits {
                max_input_bytes: 256 << 20,
                max_memory_bytes: 64 << 20,
            },
        }
    }
}

/// A stored recording, as `GET /api/v1/recordings` lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredRecording {
    /// Its name in the store (`[0-9a-f-]`).
    pub id: String,
    /// The process that sent it (the host's pid).
    pub pid: u32,
    /// Its pod's UID, container ID and names, where known (empty otherwise).
    pub pod_uid: String,
    /// The container's ID.
    pub container_id: String,
    /// The pod's namespace.
    pub pod_namespace: String,
    /// The pod's name.
    pub pod_name: String,
    /// The container's name.
    pub container_name: String,
    /// The device of its last OOM (the index of its trace), where it has one.
    pub device: Option<usize>,
    /// When it was stored, in seconds since the Unix epoch.
    pub time: f64,
    /// Its size as stored (gzipped).
    pub bytes: u64,
    /// The index of its last OOM event in that device's trace, where it recorded one.
    pub oom_event: Option<usize>,
}

/// Who an upload is from: a tracked process and the labels its pushes carry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    /// The host's pid.
    pub pid: u32,
    /// Its labels (`pod_uid`, `container_id`, `pod_namespace`, `pod_name`, `container_name`
    /// are read from them).
    pub labels: Vec<(String, String)>,
}

/// The recordings kept in one directory.
#[derive(Debug)]
pub struct RecordingStore {
    dir: PathBuf,
    limits: RecordingLimits,
    /// Oldest first.
    kept: Mutex<VecDeque<StoredRecording>>,
    refused: Arc<Refused>,
    uploads: Arc<tokio::sync::Semaphore>,
    /// Held while an upload is read.
    reading: Mutex<()>,
    /// When each process last began an upload.
    last_upload: Mutex<HashMap<u32, Instant>>,
    next: AtomicU64,
}

/// Uploads refused, by reason.
#[derive(Debug, Default)]
struct Refused(Mutex<HashMap<Refusal, u64>>);

impl Refused {
    fn count(&self, refusal: Refusal) {
        *self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(refusal)
            .or_default() += 1;
    }
}

/// A place to receive one upload: its temporary file (removed if dropped unfinished) and the
/// permit that counts it among the uploads in flight. Dropped neither finished nor refused
/// (its connection went while the body was read), it counts as `truncated`.
#[derive(Debug)]
pub struct Upload {
    path: PathBuf,
    settled: bool,
    refused: Arc<Refused>,
    /// Held while the body is received.
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Upload {
    /// The temporary file to write the body to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The body is on disk: another upload may be received while this one waits to be read.
    pub fn received(&mut self) {
        self.permit = None;
    }

    /// Refuses the upload: counted, its file removed.
    pub fn refuse(mut self, rejected: Rejected) -> Rejected {
        self.settled = true;
        self.refused.count(rejected.refusal);
        rejected
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if !self.settled {
            self.refused.count(Refusal::Truncated);
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A recording's metadata file, at most 64 KiB (it is a few hundred bytes).
fn read_meta(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(64 * 1024)
        .read_to_string(&mut text)?;
    Ok(text)
}

fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

impl RecordingStore {
    /// The store in `dir` (created if missing), listing what it held before within `limits`.
    ///
    /// # Errors
    /// The directory cannot be created or read.
    pub fn open(dir: PathBuf, limits: RecordingLimits) -> std::io::Result<RecordingStore> {
        std::fs::create_dir_all(&dir)?;
        let mut kept = Vec::new();
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            files.push(name.clone());
            if let Some(id) = name.strip_suffix(".json")
                && valid_id(id)
                && let Ok(text) = read_meta(&entry.path())
                && let Ok(stored) = serde_json::from_str::<StoredRecording>(&text)
                && stored.id == id
                && std::fs::metadata(dir.join(format!("{id}.{RECORDING}")))
                    .is_ok_and(|m| m.len() == stored.bytes)
            {
                kept.push(stored);
            }
        }
        kept.sort_by(|a, b| a.time.total_cmp(&b.time));
        let known: std::collections::HashSet<String> = kept
            .iter()
            .flat_map(|r| [format!("{}.json", r.id), format!("{}.{RECORDING}", r.id)])
            .collect();
        // Only what the store could have written: the directory may hold other files.
        let ours = |name: &str| {
            name.starts_with(UPLOADING)
                || name
                    .strip_suffix(".json")
                    .or_else(|| name.strip_suffix(&format!(".{RECORDING}")))
                    .is_some_and(valid_id)
        };
        for name in files.iter().filter(|n| ours(n) && !known.contains(*n)) {
            let _ = std::fs::remove_file(dir.join(name));
        }
        let store = RecordingStore {
            dir,
            limits,
            kept: Mutex::new(kept.into()),
            refused: Arc::default(),
            uploads: Arc::new(tokio::sync::Semaphore::new(MAX_UPLOADS)),
            reading: Mutex::new(()),
            last_upload: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        };
        let evicted = store.evict(&mut store.kept(), 0);
        for old in evicted {
            store.remove(&old);
        }
        Ok(store)
    }

    /// Its limits.
    pub fn limits(&self) -> RecordingLimits {
        self.limits
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, VecDeque<StoredRecording>> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts an upload refused before it began and gives it back.
    pub fn refuse(&self, rejected: Rejected) -> Rejected {
        self.refused.count(rejected.refusal);
        rejected
    }

    /// A place for one more upload of process `pid`, or `rate_limited` while [`MAX_UPLOADS`]
    /// are being received or where `pid` began one within [`MIN_UPLOAD_GAP`].
    ///
    /// # Errors
    /// Too many uploads at once, or too soon for this process.
    pub fn begin(&self, pid: u32) -> Result<Upload, Rejected> {
        {
            let mut last = self
                .last_upload
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            if last.get(&pid).is_some_and(|&t| now - t < MIN_UPLOAD_GAP) {
                return Err(self.refuse(Rejected::new(
                    Refusal::RateLimited,
                    format!("pid {pid} sent a recording less than {MIN_UPLOAD_GAP:?} ago"),
                )));
            }
            if last.len() >= MAX_REMEMBERED {
                last.retain(|_, t| now - *t < MIN_UPLOAD_GAP);
            }
            if last.len() < MAX_REMEMBERED {
                last.insert(pid, now);
            }
        }
        let permit = Arc::clone(&self.uploads).try_acquire_owned().map_err(|_| {
            self.refuse(Rejected::new(
                Refusal::RateLimited,
                format!("{MAX_UPLOADS} recordings are being received already; try again later"),
            ))
        })?;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(Upload {
            path: self
                .dir
                .join(format!("{UPLOADING}{}-{n}", std::process::id())),
            settled: false,
            refused: Arc::clone(&self.refused),
            permit: Some(permit),
        })
    }

    /// Reads the upload written to `upload`'s file (`bytes` long), and keeps it as `owner`'s,
    /// evicting the oldest recordings to make room. Blocking: call it off the async runtime.
    ///
    /// # Errors
    /// An upload that is not a recording (`malformed`), ends early (`truncated`), holds more
    /// than the reader may read (`too_large`), or cannot be stored.
    pub fn finish(
        &self,
        mut upload: Upload,
        bytes: u64,
        owner: &Owner,
    ) -> Result<StoredRecording, Rejected> {
        let read = {
            let _one_at_a_time = self.reading.lock().unwrap_or_else(PoisonError::into_inner);
            read_recording_with(&upload.path, self.limits.read, &mut |_| {})
        };
        let recording = match read {
            Ok(recording) => recording,
            Err(e) => return Err(upload.refuse(unreadable(&e))),
        };
        // The last OOM: the device whose trace has the latest one, by time.
        let oom = recording
            .device_traces
            .iter()
            .enumerate()
            .filter_map(|(device, trace)| {
                let (i, entry) = trace
                    .iter()
                    .enumerate()
                    .rfind(|(_, e)| e.action == TraceAction::Oom)?;
                Some((device, i, entry.time_us))
            })
            .max_by_key(|&(_, _, time)| time);
        let label = |name: &str| {
            owner
                .labels
                .iter()
                .find_map(|(k, v)| (k == name).then(|| v.clone()))
                .unwrap_or_default()
        };
        let time = unix_now();
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let stored = StoredRecording {
            id: format!("{:x}-{:x}-{n:x}", (time * 1e6) as u64, owner.pid),
            pid: owner.pid,
            pod_uid: label("pod_uid"),
            container_id: label("container_id"),
            pod_namespace: label("pod_namespace"),
            pod_name: label("pod_name"),
            container_name: label("container_name"),
            device: oom.map(|(device, _, _)| device),
            time,
            bytes,
            oom_event: oom.map(|(_, i, _)| i),
        };
        if bytes > self.limits.max_bytes {
            return Err(upload.refuse(Rejected::new(
                Refusal::TooLarge,
                format!(
                    "the recording's {bytes} bytes exceed what the agent keeps in all ({})",
                    self.limits.max_bytes
                ),
            )));
        }
        // Written before anything is evicted: a failed write loses nothing kept.
        let meta = self.dir.join(format!("{}.json", stored.id));
        let written = serde_json::to_vec(&stored)
            .map_err(std::io::Error::from)
            .and_then(|json| std::fs::write(&meta, json))
            .and_then(|()| {
                std::fs::rename(
                    &upload.path,
                    self.dir.join(format!("{}.{RECORDING}", stored.id)),
                )
            });
        if let Err(e) = written {
            let _ = std::fs::remove_file(&meta);
            return Err(upload.refuse(Rejected::new(
                Refusal::Capacity,
                format!("the recording could not be stored: {e}"),
            )));
        }
        upload.settled = true;
        let mut kept = self.kept();
        let evicted = self.evict(&mut kept, bytes);
        kept.push_back(stored.clone());
        drop(kept);
        for old in evicted {
            self.remove(&old);
        }
        Ok(stored)
    }

    /// Takes the oldest recordings off the list until one of `incoming` bytes fits; their
    /// files are the caller's to remove ([`RecordingStore::remove`]), outside the lock.
    fn evict(&self, kept: &mut VecDeque<StoredRecording>, incoming: u64) -> Vec<StoredRecording> {
        let mut evicted = Vec::new();
        let room = |kept: &VecDeque<StoredRecording>| {
            let count = kept.len() + usize::from(incoming > 0);
            let bytes: u64 = kept.iter().map(|r| r.bytes).sum::<u64>() + incoming;
            count <= self.limits.max_count && bytes <= self.limits.max_bytes
        };
        while !room(kept) {
            let Some(oldest) = kept.pop_front() else {
                break;
            };
            evicted.push(oldest);
        }
        evicted
    }

    /// Removes a recording's files.
    fn remove(&self, recording: &StoredRecording) {
        for name in [
            format!("{}.{RECORDING}", recording.id),
            format!("{}.json", recording.id),
        ] {
            let _ = std::fs::remove_file(self.dir.join(name));
        }
    }

    /// The recordings kept, newest first.
    pub fn list(&self) -> Vec<StoredRecording> {
        self.kept().iter().rev().cloned().collect()
    }

    /// What the store knows of recording `id`, where it keeps one.
    pub fn get(&self, id: &str) -> Option<StoredRecording> {
        self.kept().iter().find(|r| r.id == id).cloned()
    }

    /// The file of recording `id`, where the store keeps one.
    pub fn file(&self, id: &str) -> Option<PathBuf> {
        (valid_id(id) && self.kept().iter().any(|r| r.id == id))
            .then(|| self.dir.join(format!("{id}.{RECORDING}")))
    }

    /// What it holds and what it refused.
    pub fn report(&self) -> RecordingsReport {
        let kept = self.kept();
        let refused = self
            .refused
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        RecordingsReport {
            stored: kept.len(),
            bytes: kept.iter().map(|r| r.bytes).sum(),
            // Every reason, from 0: a rate over the counter works from the first refusal.
            refused: Refusal::ALL
                .iter()
                .map(|r| (r.label(), refused.get(r).copied().unwrap_or(0)))
                .collect(),
        }
    }
}

/// Why an upload that was received whole could not be read as a recording: `truncated` where
/// its data ends early (a gzip stream, a pickle before its STOP, JSON before its end: the job
/// was cut off while writing), `too_large` past the reader's bounds, else `malformed`.
fn unreadable(e: &TraceError) -> Rejected {
    let ends_early = match e {
        TraceError::Gzip(m) => m.contains("incomplete") || m.contains("unexpected end"),
        TraceError::Pickle { message, .. } => message.starts_with("truncated"),
        TraceError::Json(m) => m.contains("EOF while parsing"),
        _ => false,
    };
    let refusal = match e {
        TraceError::TooLarge { .. } | TraceError::MemoryBudget { .. } => Refusal::TooLarge,
        _ if ends_early => Refusal::Truncated,
        _ => Refusal::Malformed,
    };
    Rejected::new(refusal, format!("not a readable recording: {e}"))
}
