//! Recordings jobs upload at an out-of-memory error (`POST /api/v1/recordings`), kept on
//! disk within caps and listed (`GET /api/v1/recordings`), so that the operator can open the
//! failing job's last moments.
//!
//! An upload is a PyTorch memory snapshot (`torch.cuda.memory._snapshot()`, pickled) sent
//! gzipped by a process this agent tracks: the server attributes it as it attributes pushes,
//! and the process must have pushed (its pod and labels are the upload's). The body is
//! streamed to a temporary file in the store's directory (never held whole), read once with
//! the recording reader (which tells a malformed or truncated file from a recording and
//! finds its OOM), then renamed into the store, recordings evicted to make room.
//!
//! Places and room are shared out per [`Tenant`], whoever vouches for the uploader: a pod
//! (`pod:<uid>`: its processes over the socket, by their cgroup, or from the pod network, as
//! the container runtime names it), a user's processes on the host (`uid:<uid>`, over the
//! socket), or every loopback TCP sender together (`loopback`: their pids are their own word,
//! so inventing pids gains nothing). Forking a crowd of uploaders gains a tenant nothing.
//!
//! # Invariants (budgets)
//! - An upload is at most [`RecordingLimits::max_bytes_each`] bytes as sent (a declared
//!   larger one is refused unread, a longer one when it crosses the cap) and decompresses to
//!   at most [`RecordingLimits::read`]'s input bound.
//! - At most [`MAX_UPLOADS`] uploads hold a place at once, from the body's first byte until
//!   it is read and kept or refused, and at most one per tenant: others are refused at once
//!   as `capacity` ("being received already": the hook tries again for 10 s). So the
//!   store's directory never holds more than its kept bytes and [`MAX_UPLOADS`] ×
//!   [`RecordingLimits::max_bytes_each`] (the chart's `emptyDir` limit is sized so), and
//!   keeping a job's upload out takes three tenants at once (a pod, its user's other
//!   processes on the host, loopback).
//! - A body must bring [`UPLOAD_MIN_PROGRESS`] bytes in every [`UPLOAD_WINDOW`] (or end
//!   within it), and arrive whole within [`UPLOAD_TIMEOUT`]; a trickled or withheld one is
//!   cut off as `truncated` and frees its place. So a tenant holds a place at most
//!   [`UPLOAD_TIMEOUT`] and one reading at a time per pid per [`MIN_UPLOAD_GAP`].
//! - One upload is read at a time, on the store's own reading thread (one heap arena,
//!   however many uploads came), within [`RecordingLimits::read`]'s memory budget.
//! - At most [`RecordingLimits::max_count`] recordings and [`RecordingLimits::max_bytes`]
//!   bytes are kept: past the count, the oldest recording of the tenant keeping the most
//!   goes; past the bytes, the oldest of the tenant keeping the most bytes (ties: the oldest
//!   recording). A tenant inventing pids evicts its own recordings, not a job's.
//! - The store's directory is `0700` and its files `0600` (recordings hold source lines and
//!   tensor sizes). They are `<id>.pickle.gz` and its `<id>.json`, and uploads in flight
//!   (`.upload-*`). At start, valid pairs are listed again (evicted past the caps) and the
//!   store's other files (a partial upload, half a pair) removed; files of other names are
//!   left alone.
//! - Where recordings are archived too (`archive::uploader`, [`RecordingStore::archive`]),
//!   this directory is the spool: a recording leaves it only when evicted by the caps above
//!   (counted as `evicted` if it was not archived yet), and its metadata file says where it
//!   was archived once it is, so an agent restarted with recordings still to archive
//!   archives them.
//! - One process (by tenant and pid) uploads at most once per [`MIN_UPLOAD_GAP`]
//!   (`rate_limited`), stamped only when its upload gets a place: its hook records at most once per ten
//!   minutes, and a rank told to try again is not then refused for trying.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::refusal::{Refusal, Rejected};
use crate::allocator::TraceAction;
use crate::metrics::contract;
use crate::recording::{ReadLimits, TraceError, read_recording_with};
use crate::sources::{RecordingsReport, UploadsReport};

/// Uploads holding a place at once (received, waiting to be read, or being read).
pub const MAX_UPLOADS: usize = 3;
/// Uploads one tenant holds a place for at once.
pub const MAX_UPLOADS_PER_TENANT: usize = 1;
/// The longest an upload's body may take: shorter than the hook's 10 s for a whole
/// recording, so a place held by the slowest body allowed frees before a waiting job gives
/// up. A hook on this node sends 16 MiB in well under a second.
pub const UPLOAD_TIMEOUT: Duration = Duration::from_secs(8);
/// The window in which a body must bring [`UPLOAD_MIN_PROGRESS`] bytes (or end).
pub const UPLOAD_WINDOW: Duration = Duration::from_secs(2);
/// The least a body must bring per [`UPLOAD_WINDOW`]: cuts a trickle off early, yet leaves
/// room for an agent descheduled for a while on a loaded node (the socket's buffer fills
/// meanwhile, and is read when it runs again).
pub const UPLOAD_MIN_PROGRESS: u64 = 1 << 20;
/// The least time between two uploads of one process.
pub const MIN_UPLOAD_GAP: Duration = Duration::from_secs(60);
/// Processes whose last upload is remembered for the gap.
const MAX_REMEMBERED: usize = 4096;
/// The extension of a stored recording.
const RECORDING: &str = "pickle.gz";
/// The prefix of an upload in flight.
const UPLOADING: &str = ".upload-";
/// Who vouches for an uploader, and so shares places and room with it: see the module
/// documentation. Written `pod:<uid>`, `uid:<uid>`, `pid:<pid>` or `loopback`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Tenant {
    /// A pod: its processes over the socket (the kernel named them, their cgroup the pod)
    /// and from the pod network (the container runtime named it).
    Pod(String),
    /// A user's processes on the host, over the socket.
    User(u32),
    /// One process, where nothing else is known of it (a recording kept by an earlier
    /// release).
    Process(u32),
    /// Every loopback TCP sender together: their pids are their own word.
    Loopback,
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tenant::Pod(uid) => write!(f, "pod:{uid}"),
            Tenant::User(uid) => write!(f, "uid:{uid}"),
            Tenant::Process(pid) => write!(f, "pid:{pid}"),
            Tenant::Loopback => f.write_str("loopback"),
        }
    }
}

impl From<Tenant> for String {
    fn from(tenant: Tenant) -> String {
        tenant.to_string()
    }
}

impl TryFrom<String> for Tenant {
    type Error = String;

    fn try_from(text: String) -> Result<Tenant, String> {
        let number = |n: &str| n.parse().map_err(|_| format!("not a tenant: {text:?}"));
        match text.split_once(':') {
            Some(("pod", uid)) if !uid.is_empty() => Ok(Tenant::Pod(uid.to_string())),
            Some(("uid", uid)) => number(uid).map(Tenant::User),
            Some(("pid", pid)) => number(pid).map(Tenant::Process),
            None if text == "loopback" => Ok(Tenant::Loopback),
            _ => Err(format!("not a tenant: {text:?}")),
        }
    }
}

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
    /// Who vouched for its uploader; a recording kept by an earlier release has none and
    /// counts as its pid's.
    #[serde(default)]
    pub tenant: Option<Tenant>,
    /// Its last OOM's figures, read from the recording.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom: Option<OomFigures>,
    /// `torch.__version__` as the process pushed it (empty where unknown).
    #[serde(default)]
    pub pytorch_version: String,
    /// `PYTORCH_CUDA_ALLOC_CONF` as the process pushed it.
    #[serde(default)]
    pub allocator_settings: String,
    /// Its object's address where it has been archived (`archive`), `None` until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archived: Option<String>,
}

/// A recording's last OOM, as its trace and final state say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomFigures {
    /// The bytes the failed request asked for.
    pub requested_bytes: u64,
    /// The driver's free bytes at the OOM (PyTorch's `device_free`).
    pub device_free_bytes: u64,
    /// Bytes the allocator reserved on that device in the recording's final state (taken
    /// just after the OOM).
    pub reserved_bytes: u64,
    /// Bytes of blocks allocated then (handed out or waiting on other streams).
    pub allocated_bytes: u64,
}

/// Who an upload is from: a tracked process, who vouches for it, and the labels its pushes
/// carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Uploader {
    /// The host's pid.
    pub pid: u32,
    /// Who vouches for the pid: places and room are shared out among tenants.
    pub tenant: Tenant,
    /// Its labels (`pod_uid`, `container_id`, `pod_namespace`, `pod_name`, `container_name`
    /// are read from them).
    pub labels: Vec<(String, String)>,
    /// `torch.__version__`, as it pushed it.
    pub pytorch_version: String,
    /// `PYTORCH_CUDA_ALLOC_CONF`, as it pushed it.
    pub allocator_settings: String,
}

/// The recordings kept in one directory.
#[derive(Debug)]
pub struct RecordingStore {
    dir: PathBuf,
    limits: RecordingLimits,
    /// Oldest first.
    kept: Mutex<VecDeque<StoredRecording>>,
    refused: Arc<Refused>,
    uploads: Arc<Mutex<Places>>,
    /// Reads uploads, one at a time.
    reader: Reader,
    next: AtomicU64,
    /// What became of the recordings to archive, where they are archived.
    archiving: Mutex<Option<Archiving>>,
    /// Recordings not archived that the caps evicted when the store was opened.
    evicted_at_open: AtomicU64,
}

/// The archive's results so far, by [`UploadResult`], and the upload under way.
#[derive(Debug, Default)]
struct Archiving {
    results: [u64; UploadResult::ALL.len()],
    /// The recording being uploaded, and whether the caps evicted it meanwhile: its loss is
    /// counted only once its upload ends without archiving it.
    uploading: Option<(String, bool)>,
}

impl Archiving {
    fn count(&mut self, result: UploadResult) {
        self.results[result as usize] += 1;
    }
}

/// What became of an attempt to archive a recording (`gpumem_recordings_uploaded_total`'s
/// `result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UploadResult {
    /// Archived: the recording and its sidecar are in the store.
    Uploaded,
    /// The store refused it or could not be reached: tried again later.
    Failed,
    /// Evicted from the spool by its caps before it was archived: lost.
    Evicted,
}

impl UploadResult {
    /// Every result, in the order reports list them.
    pub const ALL: [UploadResult; 3] = [
        UploadResult::Uploaded,
        UploadResult::Failed,
        UploadResult::Evicted,
    ];

    /// Its label value.
    pub fn label(self) -> &'static str {
        match self {
            UploadResult::Uploaded => "uploaded",
            UploadResult::Failed => "failed",
            UploadResult::Evicted => "evicted",
        }
    }
}

/// The uploads holding a place, by tenant, and when each process last got one.
#[derive(Debug, Default)]
struct Places {
    held: HashMap<Tenant, usize>,
    /// By tenant and pid: a loopback sender naming a job's pid stamps no minute of the job's.
    last_upload: HashMap<(Tenant, u32), Instant>,
}

impl Places {
    fn total(&self) -> usize {
        self.held.values().sum()
    }
}

/// An upload's place, given back when dropped.
#[derive(Debug)]
struct Place {
    places: Arc<Mutex<Places>>,
    tenant: Tenant,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut places = self.places.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = places.held.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                places.held.remove(&self.tenant);
            }
        }
    }
}

/// Where an upload's last OOM is: its device, that trace's index and its figures, where it
/// has one.
type OomAt = Option<(usize, usize, OomFigures)>;

/// A reading to do: the file, its limits, and where the answer goes.
type ReadJob = (
    PathBuf,
    ReadLimits,
    std::sync::mpsc::SyncSender<Result<OomAt, Rejected>>,
);

/// The store's reading thread: every upload is read there, one at a time, so what reading
/// allocates stays in one heap arena (reads on the runtime's blocking threads, each with an
/// arena of its own, ratcheted the agent's memory up). A reading that panics is answered as
/// a refusal and the thread goes on.
#[derive(Debug)]
struct Reader(Option<std::sync::mpsc::Sender<ReadJob>>);

impl Reader {
    fn new() -> Reader {
        let (jobs, queue) = std::sync::mpsc::channel::<ReadJob>();
        let spawned = std::thread::Builder::new()
            .name("gpumem-recordings".into())
            .spawn(move || {
                for (path, limits, answer) in queue {
                    let _ = answer.send(read_safely(&path, limits));
                }
            });
        Reader(spawned.is_ok().then_some(jobs))
    }

    /// Reads `path` on the thread (inline where it could not be started).
    fn read(&self, path: &Path, limits: ReadLimits) -> Result<OomAt, Rejected> {
        let Some(jobs) = &self.0 else {
            return read_safely(path, limits);
        };
        let (answer, answered) = std::sync::mpsc::sync_channel(1);
        jobs.send((path.to_path_buf(), limits, answer))
            .ok()
            .and_then(|()| answered.recv().ok())
            .unwrap_or_else(|| {
                Err(Rejected::new(
                    Refusal::Capacity,
                    "the agent's reader of recordings has stopped",
                ))
            })
    }
}

/// [`last_oom`], its errors and panics as refusals.
fn read_safely(path: &Path, limits: ReadLimits) -> Result<OomAt, Rejected> {
    match std::panic::catch_unwind(|| last_oom(path, limits)) {
        Ok(read) => read.map_err(|e| unreadable(&e)),
        Err(_) => Err(Rejected::new(
            Refusal::Malformed,
            "not a readable recording: the reader failed on it",
        )),
    }
}

/// Reads the recording at `path`: the device whose trace has the latest OOM, by time, its
/// index there and its figures.
fn last_oom(path: &Path, limits: ReadLimits) -> Result<OomAt, TraceError> {
    use crate::allocator::BlockState;
    let recording = read_recording_with(path, limits, &mut |_| {})?;
    let Some((device, i, entry)) = recording
        .device_traces
        .iter()
        .enumerate()
        .filter_map(|(device, trace)| {
            let (i, entry) = trace
                .iter()
                .enumerate()
                .rfind(|(_, e)| e.action == TraceAction::Oom)?;
            Some((device, i, *entry))
        })
        .max_by_key(|(_, _, entry)| entry.time_us)
    else {
        return Ok(None);
    };
    let segments = recording
        .segments
        .iter()
        .filter(|s| s.device as usize == device);
    let (mut reserved_bytes, mut allocated_bytes) = (0u64, 0u64);
    for segment in segments {
        reserved_bytes = reserved_bytes.saturating_add(segment.total_size);
        let allocated = segment
            .blocks
            .iter()
            .filter(|b| b.state != BlockState::Inactive)
            .map(|b| b.size);
        allocated_bytes = allocated_bytes.saturating_add(allocated.sum());
    }
    let figures = OomFigures {
        requested_bytes: entry.size,
        device_free_bytes: entry.addr,
        reserved_bytes,
        allocated_bytes,
    };
    Ok(Some((device, i, figures)))
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
/// place that counts it among the uploads in flight. Dropped neither finished nor refused
/// (its connection went while the body was read), it counts as `truncated`.
#[derive(Debug)]
pub struct Upload {
    path: PathBuf,
    settled: bool,
    refused: Arc<Refused>,
    /// Held until the upload is kept or refused: a body on disk still takes room.
    _place: Place,
}

impl Upload {
    /// The temporary file to write the body to (create it with [`Upload::create`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the temporary file, readable by the agent only.
    ///
    /// # Errors
    /// The file cannot be created.
    pub fn create(&self) -> std::io::Result<std::fs::File> {
        private_file(&self.path)
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

/// The time now, in Unix seconds.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Creates `path` (truncating it), readable and writable by the agent only.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

/// Makes `dir` (created if missing) the agent's own: `0700`.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Whose a recording is, for the store's shares: its tenant, or its pid's where an earlier
/// release kept it without one.
fn tenant_of(recording: &StoredRecording) -> Tenant {
    recording
        .tenant
        .clone()
        .unwrap_or(Tenant::Process(recording.pid))
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
        use std::os::unix::fs::PermissionsExt;
        private_dir(&dir)?;
        let mut kept = Vec::new();
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            files.push(name.clone());
            if let Some(id) = name.strip_suffix(".json")
                && valid_id(id)
                // A metadata file is a few hundred bytes: a larger one is not the store's.
                && let Ok(text) = crate::bounded_file::read(&entry.path(), 64 * 1024)
                && let Ok(stored) = serde_json::from_str::<StoredRecording>(&text)
                && stored.id == id
                && std::fs::metadata(dir.join(format!("{id}.{RECORDING}")))
                    .is_ok_and(|m| m.len() == stored.bytes)
            {
                // An earlier release left them readable by all.
                for name in [format!("{id}.{RECORDING}"), name.clone()] {
                    let _ = std::fs::set_permissions(
                        dir.join(name),
                        std::fs::Permissions::from_mode(0o600),
                    );
                }
                kept.push(StoredRecording {
                    tenant: Some(tenant_of(&stored)),
                    ..stored
                });
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
            uploads: Arc::default(),
            reader: Reader::new(),
            next: AtomicU64::new(0),
            archiving: Mutex::default(),
            evicted_at_open: AtomicU64::new(0),
        };
        let evicted = store.evict(&mut store.kept(), None);
        // Not archived and gone: counted as lost once the store is known to be a spool.
        let unarchived = evicted.iter().filter(|r| r.archived.is_none()).count();
        store
            .evicted_at_open
            .store(unarchived as u64, Ordering::Relaxed);
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

    /// A place for one more upload from `uploader`, or why not: [`MAX_UPLOADS`] hold one, or
    /// [`MAX_UPLOADS_PER_TENANT`] of its tenant's (`capacity`: try again shortly); or its
    /// process got one within [`MIN_UPLOAD_GAP`] (`rate_limited`).
    ///
    /// # Errors
    /// No place now, or too soon for this process.
    pub fn begin(&self, uploader: &Uploader) -> Result<Upload, Rejected> {
        let pid = uploader.pid;
        let mut places = self.uploads.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let key = (uploader.tenant.clone(), pid);
        if places
            .last_upload
            .get(&key)
            .is_some_and(|&t| now - t < MIN_UPLOAD_GAP)
        {
            return Err(self.refuse(Rejected::new(
                Refusal::RateLimited,
                format!("pid {pid} sent a recording less than {MIN_UPLOAD_GAP:?} ago"),
            )));
        }
        // (The hook tries again on "being received": keep the words.)
        if places.total() >= MAX_UPLOADS {
            return Err(self.refuse(Rejected::new(
                Refusal::Capacity,
                format!("{MAX_UPLOADS} recordings are being received already; try again shortly"),
            )));
        }
        let held = places.held.get(&uploader.tenant).copied().unwrap_or(0);
        if held >= MAX_UPLOADS_PER_TENANT {
            return Err(self.refuse(Rejected::new(
                Refusal::Capacity,
                format!(
                    "a recording from {} is being received already; try again shortly",
                    uploader.tenant
                ),
            )));
        }
        *places.held.entry(uploader.tenant.clone()).or_default() += 1;
        if places.last_upload.len() >= MAX_REMEMBERED {
            places.last_upload.retain(|_, t| now - *t < MIN_UPLOAD_GAP);
        }
        // Still full (a flood of invented pids): the oldest stamp gives way, so no stamp is
        // ever skipped.
        if places.last_upload.len() >= MAX_REMEMBERED
            && let Some(oldest) = places
                .last_upload
                .iter()
                .min_by_key(|(_, t)| **t)
                .map(|(k, _)| k.clone())
        {
            places.last_upload.remove(&oldest);
        }
        places.last_upload.insert(key, now);
        drop(places);
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(Upload {
            path: self
                .dir
                .join(format!("{UPLOADING}{}-{n}", std::process::id())),
            settled: false,
            refused: Arc::clone(&self.refused),
            _place: Place {
                places: Arc::clone(&self.uploads),
                tenant: uploader.tenant.clone(),
            },
        })
    }

    /// Reads the upload written to `upload`'s file (`bytes` long), and keeps it as
    /// `uploader`'s, evicting recordings to make room (see the module documentation for
    /// which). Blocking: call it off the async runtime.
    ///
    /// # Errors
    /// An upload that is not a recording (`malformed`), ends early (`truncated`), holds more
    /// than the reader may read (`too_large`), or cannot be stored.
    pub fn finish(
        &self,
        mut upload: Upload,
        bytes: u64,
        uploader: &Uploader,
    ) -> Result<StoredRecording, Rejected> {
        let oom = match self.reader.read(&upload.path, self.limits.read) {
            Ok(oom) => oom,
            Err(rejected) => return Err(upload.refuse(rejected)),
        };
        let label = |name: &str| {
            uploader
                .labels
                .iter()
                .find_map(|(k, v)| (k == name).then(|| v.clone()))
                .unwrap_or_default()
        };
        let time = unix_now();
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let stored = StoredRecording {
            id: format!("{:x}-{:x}-{n:x}", (time * 1e6) as u64, uploader.pid),
            pid: uploader.pid,
            pod_uid: label(contract::label::POD_UID),
            container_id: label(contract::label::CONTAINER_ID),
            pod_namespace: label(contract::label::POD_NAMESPACE),
            pod_name: label(contract::label::POD_NAME),
            container_name: label(contract::label::CONTAINER_NAME),
            device: oom.map(|(device, ..)| device),
            time,
            bytes,
            oom_event: oom.map(|(_, i, _)| i),
            tenant: Some(uploader.tenant.clone()),
            oom: oom.map(|(.., figures)| figures),
            pytorch_version: uploader.pytorch_version.clone(),
            allocator_settings: uploader.allocator_settings.clone(),
            archived: None,
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
            .and_then(|json| std::io::Write::write_all(&mut private_file(&meta)?, &json))
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
        let evicted = self.evict(&mut kept, Some(&stored));
        kept.push_back(stored.clone());
        drop(kept);
        for old in evicted {
            self.remove(&old);
        }
        Ok(stored)
    }

    /// Takes recordings off the list until `incoming` fits (see the module documentation for
    /// which go); their files are the caller's to remove ([`RecordingStore::remove`]), outside
    /// the lock.
    fn evict(
        &self,
        kept: &mut VecDeque<StoredRecording>,
        incoming: Option<&StoredRecording>,
    ) -> Vec<StoredRecording> {
        let mut evicted = Vec::new();
        loop {
            let count = kept.len() + usize::from(incoming.is_some());
            let bytes: u64 =
                kept.iter().map(|r| r.bytes).sum::<u64>() + incoming.map_or(0, |r| r.bytes);
            // What each tenant keeps (the incoming recording counted as its tenant's), and by
            // which measure the share is taken.
            let by_bytes = if count > self.limits.max_count {
                false
            } else if bytes > self.limits.max_bytes {
                true
            } else {
                break;
            };
            let mut shares: HashMap<Tenant, (usize, u64)> = HashMap::new();
            for r in kept.iter().chain(incoming) {
                let share = shares.entry(tenant_of(r)).or_default();
                share.0 += 1;
                share.1 += r.bytes;
            }
            let share = |r: &StoredRecording| {
                let (n, b) = shares.get(&tenant_of(r)).copied().unwrap_or_default();
                if by_bytes { b } else { n as u64 }
            };
            // Oldest first: the first of the largest share is its tenant's oldest, and among
            // equal shares the oldest recording.
            let Some(victim) = kept
                .iter()
                .enumerate()
                .rev()
                .max_by_key(|(_, r)| share(r))
                .map(|(i, _)| i)
            else {
                break;
            };
            evicted.extend(kept.remove(victim));
        }
        evicted
    }

    /// Removes a recording's files (counted as `evicted` where it was to be archived and was
    /// not yet; while it is being uploaded, once that upload ends without archiving it).
    fn remove(&self, recording: &StoredRecording) {
        if recording.archived.is_none()
            && let Some(archiving) = &mut *self.archiving()
        {
            match &mut archiving.uploading {
                Some((id, evicted)) if *id == recording.id => *evicted = true,
                _ => archiving.count(UploadResult::Evicted),
            }
        }
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

    fn archiving(&self) -> std::sync::MutexGuard<'_, Option<Archiving>> {
        self.archiving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes this directory the spool of an archive: its recordings are to be archived, and
    /// the report counts what became of them.
    pub fn archive(&self) {
        self.archiving().get_or_insert_with(|| {
            let mut archiving = Archiving::default();
            archiving.results[UploadResult::Evicted as usize] =
                self.evicted_at_open.load(Ordering::Relaxed);
            archiving
        });
    }

    /// The recordings not archived yet, oldest first.
    pub fn unarchived(&self) -> Vec<StoredRecording> {
        self.kept()
            .iter()
            .filter(|r| r.archived.is_none())
            .cloned()
            .collect()
    }

    /// Notes that recording `id` is being uploaded (an upload abandoned before it ended is
    /// ended here: lost, where it was evicted meanwhile).
    pub fn begin_upload(&self, id: &str) {
        if let Some(archiving) = &mut *self.archiving() {
            if let Some((_, true)) = archiving.uploading.take() {
                archiving.count(UploadResult::Evicted);
            }
            archiving.uploading = Some((id.to_string(), false));
        }
    }

    /// Counts the end of the upload under way: `Uploaded` or `Failed`, or `None` where its
    /// recording was gone before it was read. A recording the caps evicted meanwhile is
    /// counted `evicted` too unless it was archived: it is not tried again.
    pub fn end_upload(&self, result: Option<UploadResult>) {
        if let Some(archiving) = &mut *self.archiving() {
            let evicted = archiving.uploading.take().is_some_and(|(_, e)| e);
            if let Some(result) = result {
                archiving.count(result);
            }
            if evicted && result != Some(UploadResult::Uploaded) {
                archiving.count(UploadResult::Evicted);
            }
        }
    }

    /// Notes that recording `id` was archived at `address`: in the list, and in its metadata
    /// file (written whole, then renamed over the old). A recording evicted meanwhile is left
    /// gone.
    ///
    /// # Errors
    /// The metadata file cannot be written (the list has the note all the same: a restarted
    /// agent would archive it again).
    pub fn archived(&self, id: &str, address: &str) -> std::io::Result<()> {
        let mut kept = self.kept();
        let Some(recording) = kept.iter_mut().find(|r| r.id == id) else {
            return Ok(());
        };
        let updated = StoredRecording {
            archived: Some(address.to_string()),
            ..recording.clone()
        };
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let temporary = self
            .dir
            .join(format!("{UPLOADING}{}-{n}", std::process::id()));
        let written = serde_json::to_vec(&updated)
            .map_err(std::io::Error::from)
            .and_then(|json| std::io::Write::write_all(&mut private_file(&temporary)?, &json))
            .and_then(|()| std::fs::rename(&temporary, self.dir.join(format!("{id}.json"))));
        if written.is_err() {
            let _ = std::fs::remove_file(&temporary);
        }
        // Noted in memory whatever the file says: this agent does not archive it again.
        *recording = updated;
        written
    }

    /// What it holds and what it refused.
    pub fn report(&self) -> RecordingsReport {
        let kept = self.kept();
        // Counted in place: a scrape copies no recording's entry.
        let pending = kept.iter().filter(|r| r.archived.is_none()).count();
        let uploads = self.archiving().as_ref().map(|archiving| UploadsReport {
            results: UploadResult::ALL
                .iter()
                .map(|r| (r.label(), archiving.results[*r as usize]))
                .collect(),
            pending,
        });
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
            uploads,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A store in a directory of its own.
    fn store(name: &str, max_count: usize, max_bytes: u64) -> (PathBuf, RecordingStore) {
        let dir =
            std::env::temp_dir().join(format!("gpumem-recordings-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let limits = RecordingLimits {
            max_count,
            max_bytes,
            ..RecordingLimits::default()
        };
        let store = RecordingStore::open(dir.clone(), limits).expect("opens");
        (dir, store)
    }

    fn owner(pid: u32, tenant: Tenant) -> Uploader {
        Uploader {
            pid,
            tenant,
            labels: Vec::new(),
            pytorch_version: String::new(),
            allocator_settings: String::new(),
        }
    }

    /// An upload of a small readable recording from `owner`, kept or refused.
    fn upload(store: &RecordingStore, owner: &Uploader) -> Result<StoredRecording, Rejected> {
        use std::io::Write;
        let upload = store.begin(owner)?;
        let mut gz = flate2::write::GzEncoder::new(
            upload.create().expect("creates"),
            flate2::Compression::fast(),
        );
        gz.write_all(br#"{"segments": [], "device_traces": [[]]}"#)
            .expect("writes");
        gz.finish().expect("finishes");
        let bytes = std::fs::metadata(upload.path()).expect("written").len();
        store.finish(upload, bytes, owner)
    }

    /// Issue 53, items 1 to 3: a place is held from the first byte until the upload is read,
    /// one per tenant and three in all; a refusal for want of a place is `capacity` (the hook
    /// tries again), and only a granted place stamps the process's minute.
    #[test]
    fn places_are_shared_out_per_tenant_and_held_until_read() {
        let (dir, store) = store("places", 100, 1 << 30);
        let loopback = owner(100, Tenant::Loopback);
        let first = store.begin(&loopback).expect("a place");
        // Received, not read yet: the place stays taken.
        std::fs::write(first.path(), b"received").expect("writes");
        let invented = store
            .begin(&owner(101, Tenant::Loopback))
            .expect_err("one per tenant");
        assert_eq!(invented.refusal, Refusal::Capacity, "{}", invented.message);
        assert!(
            invented.message.contains("being received"),
            "{}",
            invented.message
        );
        // Ranks of one pod: one place for the pod; a user's process on the host takes the
        // last; then none is left for anyone.
        let pod = || Tenant::Pod("train-0".into());
        let rank0 = store.begin(&owner(7, pod())).expect("the pod's place");
        let rank1 = store.begin(&owner(8, pod())).expect_err("one per tenant");
        assert_eq!(rank1.refusal, Refusal::Capacity);
        assert!(
            rank1.message.contains("being received"),
            "{}",
            rank1.message
        );
        let _host = store
            .begin(&owner(9, Tenant::User(1000)))
            .expect("the last place");
        let other = store
            .begin(&owner(10, Tenant::User(1001)))
            .expect_err("three in all");
        assert_eq!(other.refusal, Refusal::Capacity);
        assert!(
            other.message.contains("being received"),
            "{}",
            other.message
        );
        // The second rank tries again once its pod's place is free: not refused for trying.
        drop(rank0);
        assert!(store.begin(&owner(8, pod())).is_ok());
        // The invented pid likewise, once its tenant's place is free; the first pid not.
        drop(first);
        assert!(store.begin(&owner(101, Tenant::Loopback)).is_ok());
        let again = store
            .begin(&loopback)
            .expect_err("stamped when it got its place");
        assert_eq!(again.refusal, Refusal::RateLimited);
        assert!(
            !std::fs::read_dir(&dir).expect("lists").any(|e| e
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .starts_with(UPLOADING)),
            "an upload dropped unfinished leaves no file"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 53, item 4: a tenant inventing pids evicts its own recordings, never a job's,
    /// by count and by bytes; and the files are the agent's only.
    #[test]
    fn a_tenant_inventing_pids_evicts_its_own() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, store) = store("tenants", 5, 1 << 30);
        let job = upload(&store, &owner(7, Tenant::Process(7))).expect("kept");
        for pid in 100..164 {
            upload(&store, &owner(pid, Tenant::Loopback)).expect("kept");
        }
        let kept: Vec<u32> = store.list().iter().map(|r| r.pid).collect();
        assert_eq!(kept, [163, 162, 161, 160, 7]);
        // By bytes: room for three; the job's stays.
        let size = job.bytes;
        let (dir2, bytes) = store_with_room("tenant-bytes", 3 * size);
        upload(&bytes, &owner(7, Tenant::Process(7))).expect("kept");
        for pid in 100..110 {
            upload(&bytes, &owner(pid, Tenant::Loopback)).expect("kept");
        }
        let kept: Vec<u32> = bytes.list().iter().map(|r| r.pid).collect();
        assert_eq!(kept, [109, 108, 7]);
        // Equal shares: the oldest recording goes, whoever's.
        upload(&bytes, &owner(9, Tenant::Process(9))).expect("kept");
        upload(&bytes, &owner(10, Tenant::Process(10))).expect("kept");
        let kept: Vec<u32> = bytes.list().iter().map(|r| r.pid).collect();
        assert_eq!(kept, [10, 9, 109]);
        // Private: the directory 0700, its files 0600.
        let mode = |p: &Path| std::fs::metadata(p).expect("exists").permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        for entry in std::fs::read_dir(&dir).expect("lists") {
            assert_eq!(mode(&entry.expect("entry").path()), 0o600);
        }
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&dir2);
    }

    fn store_with_room(name: &str, max_bytes: u64) -> (PathBuf, RecordingStore) {
        store(name, 100, max_bytes)
    }

    /// Issue 60: as a spool, the store counts what became of its recordings, notes each
    /// one's archive in its metadata (found again after a restart), and counts a recording
    /// evicted before it was archived as lost.
    #[test]
    fn a_spool_remembers_what_it_archived_and_counts_what_it_lost() {
        let counts = |store: &RecordingStore| {
            let uploads = store.report().uploads.expect("archiving");
            (uploads.results, uploads.pending)
        };
        let (dir, store) = store("spool", 2, 1 << 30);
        assert_eq!(store.report().uploads, None, "not a spool until archiving");
        store.archive();
        let first = upload(&store, &owner(1, Tenant::Process(1))).expect("kept");
        let second = upload(&store, &owner(2, Tenant::Process(2))).expect("kept");
        let ids = |list: Vec<StoredRecording>| list.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(
            ids(store.unarchived()),
            [first.id.clone(), second.id.clone()]
        );
        store.begin_upload(&first.id);
        store.end_upload(Some(UploadResult::Failed));
        store.begin_upload(&first.id);
        store.end_upload(Some(UploadResult::Uploaded));
        store
            .archived(&first.id, "s3://b/k.pickle.gz")
            .expect("noted");
        assert_eq!(ids(store.unarchived()), std::slice::from_ref(&second.id));
        assert_eq!(
            counts(&store),
            (vec![("uploaded", 1), ("failed", 1), ("evicted", 0)], 1)
        );
        // Reopened (an agent restarted): the note is in the metadata file.
        drop(store);
        let reopened = RecordingStore::open(
            dir.clone(),
            RecordingLimits {
                max_count: 2,
                ..RecordingLimits::default()
            },
        )
        .expect("reopens");
        reopened.archive();
        let kept = reopened.get(&first.id).expect("kept");
        assert_eq!(kept.archived.as_deref(), Some("s3://b/k.pickle.gz"));
        assert_eq!(ids(reopened.unarchived()), std::slice::from_ref(&second.id));
        // Past the count: the oldest goes. Archived, it is no loss; the next one is.
        upload(&reopened, &owner(3, Tenant::Process(3))).expect("kept");
        assert_eq!(counts(&reopened).0[2], ("evicted", 0));
        upload(&reopened, &owner(4, Tenant::Process(4))).expect("kept");
        assert_eq!(counts(&reopened).0[2], ("evicted", 1));
        // Evicted while it was being uploaded: archived all the same, no loss; evicted while
        // an upload failed, or before it was read, lost.
        let pid = std::cell::Cell::new(100);
        let evicted_during = |result: Option<UploadResult>| {
            let oldest = reopened.unarchived().remove(0);
            reopened.begin_upload(&oldest.id);
            pid.set(pid.get() + 1);
            upload(&reopened, &owner(pid.get(), Tenant::Process(pid.get()))).expect("kept");
            assert!(reopened.get(&oldest.id).is_none(), "evicted by the count");
            let before = counts(&reopened).0;
            reopened.end_upload(result);
            let after = counts(&reopened).0;
            (0..3).map(|k| after[k].1 - before[k].1).collect::<Vec<_>>()
        };
        assert_eq!(evicted_during(Some(UploadResult::Uploaded)), [1, 0, 0]);
        assert_eq!(evicted_during(Some(UploadResult::Failed)), [0, 1, 1]);
        assert_eq!(evicted_during(None), [0, 0, 1]);
        assert_eq!(counts(&reopened).1, 2);
        // A recording evicted meanwhile is not noted again.
        reopened
            .archived(&second.id, "s3://b/gone.pickle.gz")
            .expect("nothing to note");
        assert!(reopened.get(&second.id).is_none());
        // Opened again under a lower cap: what it evicts unarchived is lost too.
        drop(reopened);
        let smaller = RecordingStore::open(
            dir.clone(),
            RecordingLimits {
                max_count: 1,
                ..RecordingLimits::default()
            },
        )
        .expect("reopens");
        smaller.archive();
        assert_eq!(
            counts(&smaller),
            (vec![("uploaded", 0), ("failed", 0), ("evicted", 1)], 1)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
