//! Allocator statistics pushed by unmodified PyTorch jobs (`POST /api/v1/push`).
//!
//! A job posts, per device, `torch.cuda.memory_stats()` (the flat dict) with its pid and the
//! device's UUID; the store validates it, turns it into the same [`AllocatorSource`] the
//! agent's own allocators publish (with `allocator="pytorch"`), so the one collector serves it
//! under the metric contract. Unknown statistics keys are ignored.
//!
//! # Invariants
//! - Memory is bounded whatever clients send: bodies are capped by the server
//!   ([`MAX_BODY_BYTES`]), every list and map in a payload is capped, and at most
//!   `max_processes` processes are tracked (pushes from others are refused and counted).
//! - A pushed process's largest free block and segments by size come only from a memory
//!   snapshot (the hook takes one at an out-of-memory error) and stand until the next; without
//!   one they are not exported.
//! - A process's series disappear `ttl` after its last accepted push, or at the first expiry
//!   after its pid vanishes from `/proc` when the kernel named that pid (a Unix-socket push;
//!   a payload's own pid may belong to another pid namespace and is never looked up).
//! - Every refusal has a reason, returned to the client and counted in
//!   `gpumem_ingest_payloads_total{result=<reason>}`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use serde::Deserialize;

use crate::allocator::DeviceStats;
use crate::metrics::AllocatorSources;
use crate::telemetry::cgroup::{self, ContainerRef};
use crate::telemetry::{AllocatorSource, SegmentClass, UNKNOWN_SIZE};

/// The largest payload accepted: a push of 16 devices' statistics is about 100 KiB.
pub const MAX_BODY_BYTES: usize = 512 * 1024;
const MAX_DEVICES: usize = 64;
const MAX_STATS_KEYS: usize = 1024;
const MAX_TEXT: usize = 256;
const MAX_LABELS: usize = 8;
/// Size classes are powers of two: 64 cover every `u64`.
const MAX_CLASSES: usize = 64;
/// Label names a push may not use: the contract's own, Prometheus's.
const RESERVED_LABELS: [&str; 16] = [
    "gpu",
    "UUID",
    "pid",
    "process",
    "pod_uid",
    "container_id",
    "pod_namespace",
    "pod_name",
    "container_name",
    "allocator",
    "pool",
    "segment_size",
    "version",
    "config",
    "instance",
    "le",
];

/// Why a payload was refused; the `result` label of the ingest counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Not JSON, or not the payload's shape.
    Malformed,
    /// The right shape with impossible values (negative sizes, a zero pid, ...).
    Invalid,
    /// Older than the last accepted push of the same process.
    Stale,
    /// The process pushes faster than the rate limit.
    RateLimited,
    /// Too many processes are tracked already.
    Capacity,
    /// The body exceeds [`MAX_BODY_BYTES`].
    TooLarge,
}

impl Refusal {
    /// All reasons, in the order the counter lists them.
    pub const ALL: [Refusal; 6] = [
        Refusal::Malformed,
        Refusal::Invalid,
        Refusal::Stale,
        Refusal::RateLimited,
        Refusal::Capacity,
        Refusal::TooLarge,
    ];

    /// The metric label and the error's kind.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::Invalid => "invalid",
            Refusal::Stale => "stale",
            Refusal::RateLimited => "rate_limited",
            Refusal::Capacity => "capacity",
            Refusal::TooLarge => "too_large",
        }
    }

    /// The HTTP status of the refusal.
    pub fn status(self) -> u16 {
        match self {
            Refusal::Malformed => 400,
            Refusal::Invalid => 422,
            Refusal::Stale => 409,
            Refusal::RateLimited | Refusal::Capacity => 429,
            Refusal::TooLarge => 413,
        }
    }
}

/// A refused payload: why, in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// The kind of refusal.
    pub refusal: Refusal,
    /// What was wrong.
    pub message: String,
}

#[derive(Deserialize)]
struct Push {
    pid: u32,
    seq: u64,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    torch_version: Option<String>,
    #[serde(default)]
    alloc_conf: Option<String>,
    devices: Vec<PushedDevice>,
}

#[derive(Deserialize)]
struct PushedDevice {
    index: u32,
    uuid: String,
    stats: BTreeMap<String, serde_json::Value>,
    /// From a memory snapshot (the hook takes one on out-of-memory).
    #[serde(default)]
    largest_free_block: Option<u64>,
    /// From the same snapshot: its segments by size class.
    #[serde(default)]
    segments_by_size: Option<Vec<PushedClass>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PushedClass {
    size: u64,
    segments: u64,
    free_bytes: u64,
}

/// Ingest settings.
#[derive(Clone, Copy, Debug)]
pub struct IngestConfig {
    /// How long a process's series live after its last push.
    pub ttl: Duration,
    /// Most processes tracked at once.
    pub max_processes: usize,
    /// Least time between two accepted pushes of one process.
    pub min_interval: Duration,
    /// The pod and container of a pid the kernel named (read from `/proc` by default).
    pub resolve: fn(u32) -> Option<ContainerRef>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            ttl: Duration::from_secs(60),
            // A node runs a few CUDA processes per GPU; a scrape of 256 pushed processes
            // stays within a few MiB (4096 took the agent to 88 MiB).
            max_processes: 256,
            min_interval: Duration::from_millis(500),
            resolve: cgroup::container_of,
        }
    }
}

struct Tracked {
    seq: u64,
    last: Instant,
    /// The kernel named the pid (so `/proc/<pid>` is this process).
    kernel_pid: bool,
    sources: Vec<Arc<AllocatorSource>>,
}

/// The pushed processes and the ingest's own counters.
pub struct PushStore {
    config: IngestConfig,
    sources: AllocatorSources,
    tracked: Mutex<FxHashMap<u32, Tracked>>,
    accepted: AtomicU64,
    refused: [AtomicU64; Refusal::ALL.len()],
}

fn invalid(message: impl Into<String>) -> Rejected {
    Rejected {
        refusal: Refusal::Invalid,
        message: message.into(),
    }
}

fn text(what: &str, value: &str) -> Result<(), Rejected> {
    if value.len() > MAX_TEXT || value.chars().any(char::is_control) {
        return Err(invalid(format!(
            "{what} must be at most {MAX_TEXT} printable characters"
        )));
    }
    Ok(())
}

/// Extra labels: a few, with Prometheus label names the contract does not use.
fn labels(labels: &BTreeMap<String, String>) -> Result<Vec<(String, String)>, Rejected> {
    if labels.len() > MAX_LABELS {
        return Err(invalid(format!("at most {MAX_LABELS} labels")));
    }
    for (name, value) in labels {
        let valid = name
            .chars()
            .enumerate()
            .all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
        if name.is_empty()
            || !valid
            || name.starts_with("__")
            || RESERVED_LABELS.contains(&name.as_str())
        {
            return Err(invalid(format!(
                "label {name:?} is not a free Prometheus label name"
            )));
        }
        text("a label value", value)?;
    }
    Ok(labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// A snapshot's segments by size class: at most one per power of two, each consistent.
fn pushed_classes(device: &PushedDevice) -> Result<Option<Vec<SegmentClass>>, Rejected> {
    let Some(pushed) = &device.segments_by_size else {
        return Ok(None);
    };
    if device.largest_free_block.is_none() {
        return Err(invalid(
            "segments_by_size comes from a snapshot, with its largest_free_block",
        ));
    }
    if pushed.len() > MAX_CLASSES {
        return Err(invalid(format!(
            "segments_by_size lists at most {MAX_CLASSES} classes"
        )));
    }
    let mut classes: Vec<SegmentClass> = Vec::with_capacity(pushed.len());
    for c in pushed {
        if !c.size.is_power_of_two() {
            return Err(invalid(format!(
                "segments_by_size: class size {} is not a power of two",
                c.size
            )));
        }
        if c.segments
            .checked_mul(c.size)
            .is_none_or(|cap| c.free_bytes > cap)
        {
            return Err(invalid(format!(
                "segments_by_size: {} free bytes do not fit in {} segments of at most {} bytes",
                c.free_bytes, c.segments, c.size
            )));
        }
        if classes.iter().any(|k| k.size == c.size) {
            return Err(invalid(format!(
                "segments_by_size: class size {} is listed twice",
                c.size
            )));
        }
        classes.push(SegmentClass {
            size: c.size,
            segments: c.segments,
            free_bytes: c.free_bytes,
        });
    }
    classes.sort_by_key(|c| c.size);
    Ok(Some(classes))
}

/// Statistics as integers: sizes and counts must be whole and, but for `max_split_size`
/// (-1 means unlimited), not negative.
fn statistics(device: &PushedDevice) -> Result<BTreeMap<String, i64>, Rejected> {
    if device.stats.len() > MAX_STATS_KEYS {
        return Err(invalid(format!(
            "device {}: more than {MAX_STATS_KEYS} statistics",
            device.index
        )));
    }
    let mut out = BTreeMap::new();
    for (key, value) in &device.stats {
        text("a statistics key", key)?;
        let Some(number) = value.as_i64() else {
            return Err(invalid(format!(
                "device {}: {key} must be an integer, not {value}",
                device.index
            )));
        };
        if number < 0 && key != "max_split_size" {
            return Err(invalid(format!(
                "device {}: {key} is negative ({number})",
                device.index
            )));
        }
        out.insert(key.clone(), number);
    }
    Ok(out)
}

impl PushStore {
    /// A store publishing into `sources` (the list the collector reads).
    pub fn new(config: IngestConfig, sources: AllocatorSources) -> PushStore {
        PushStore {
            config,
            sources,
            tracked: Mutex::new(FxHashMap::default()),
            accepted: AtomicU64::new(0),
            refused: Default::default(),
        }
    }

    fn refuse(&self, rejected: Rejected) -> Rejected {
        let i = Refusal::ALL
            .iter()
            .position(|r| *r == rejected.refusal)
            .unwrap_or(0);
        self.refused[i].fetch_add(1, Ordering::Relaxed);
        rejected
    }

    /// Counts a body refused before it reached the store (too large).
    pub fn count_refusal(&self, refusal: Refusal) {
        let _ = self.refuse(Rejected {
            refusal,
            message: String::new(),
        });
    }

    /// Accepts a payload, or says why not.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push(&self, body: &[u8]) -> Result<(), Rejected> {
        self.push_from(body, None)
    }

    /// Accepts a payload from a process the kernel named (a Unix-socket peer): its pid
    /// replaces the payload's, which inside a container is the container's pid namespace's
    /// and so would not match the pids NVML reports.
    ///
    /// # Errors
    /// A [`Rejected`] with the reason; nothing changes then.
    pub fn push_from(&self, body: &[u8], peer_pid: Option<u32>) -> Result<(), Rejected> {
        self.push_at(body, peer_pid, Instant::now())
            .map_err(|rejected| self.refuse(rejected))
    }

    fn push_at(&self, body: &[u8], peer_pid: Option<u32>, now: Instant) -> Result<(), Rejected> {
        if body.len() > MAX_BODY_BYTES {
            return Err(Rejected {
                refusal: Refusal::TooLarge,
                message: format!("the body exceeds {MAX_BODY_BYTES} bytes"),
            });
        }
        let mut push: Push = serde_json::from_slice(body).map_err(|e| Rejected {
            refusal: Refusal::Malformed,
            message: format!("not a push payload: {e}"),
        })?;
        if let Some(pid) = peer_pid {
            push.pid = pid;
        }
        if push.pid == 0 {
            return Err(invalid("pid must be a process id, not 0"));
        }
        if push.devices.is_empty() || push.devices.len() > MAX_DEVICES {
            return Err(invalid(format!(
                "devices must list 1 to {MAX_DEVICES} devices"
            )));
        }
        let version = push.torch_version.unwrap_or_default();
        let config = push.alloc_conf.unwrap_or_default();
        text("torch_version", &version)?;
        text("alloc_conf", &config)?;
        let mut extra = labels(&push.labels)?;
        // Only a pid the kernel named is this node's: attribute it to its pod.
        if let Some(c) = peer_pid.and_then(self.config.resolve) {
            extra.push(("pod_uid".into(), c.pod_uid));
            extra.push(("container_id".into(), c.container_id));
        }
        let mut sources = Vec::with_capacity(push.devices.len());
        for device in &push.devices {
            text("uuid", &device.uuid)?;
            let stats = statistics(device)?;
            let classes = pushed_classes(device)?;
            sources.push(AllocatorSource {
                gpu: device.index,
                uuid: device.uuid.clone(),
                pid: push.pid,
                allocator: "pytorch",
                version: version.clone(),
                config: config.clone(),
                stats: Arc::new(DeviceStats::from_memory_stats(&stats)),
                // memory_stats() does not say; a push carries it only with a snapshot.
                largest_free_block: Arc::new(AtomicU64::new(
                    device.largest_free_block.unwrap_or(UNKNOWN_SIZE),
                )),
                segment_classes: Mutex::new(classes.unwrap_or_default()),
                labels: extra.clone(),
            });
        }

        let mut tracked = self.tracked.lock().unwrap_or_else(PoisonError::into_inner);
        match tracked.get(&push.pid) {
            Some(t) if push.seq <= t.seq => {
                return Err(Rejected {
                    refusal: Refusal::Stale,
                    message: format!(
                        "seq {} is not after the last accepted seq {} of pid {}",
                        push.seq, t.seq, push.pid
                    ),
                });
            }
            Some(t) if now.duration_since(t.last) < self.config.min_interval => {
                return Err(Rejected {
                    refusal: Refusal::RateLimited,
                    message: format!(
                        "pid {} pushes more often than every {:?}",
                        push.pid, self.config.min_interval
                    ),
                });
            }
            None if tracked.len() >= self.config.max_processes => {
                return Err(Rejected {
                    refusal: Refusal::Capacity,
                    message: format!(
                        "already tracking {} processes, the most this agent keeps",
                        self.config.max_processes
                    ),
                });
            }
            _ => {}
        }
        // A snapshot's figures stand until a later snapshot replaces them.
        if let Some(previous) = tracked.get(&push.pid) {
            for source in &mut sources {
                if source.largest_free_block.load(Ordering::Relaxed) != UNKNOWN_SIZE {
                    continue;
                }
                if let Some(old) = previous.sources.iter().find(|o| o.gpu == source.gpu) {
                    let figure = old.largest_free_block.load(Ordering::Relaxed);
                    source.largest_free_block.store(figure, Ordering::Relaxed);
                    let classes = old
                        .segment_classes
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone();
                    *source
                        .segment_classes
                        .get_mut()
                        .unwrap_or_else(PoisonError::into_inner) = classes;
                }
            }
        }
        let sources = sources.into_iter().map(Arc::new).collect();
        tracked.insert(
            push.pid,
            Tracked {
                seq: push.seq,
                last: now,
                kernel_pid: peer_pid.is_some(),
                sources,
            },
        );
        self.publish(&tracked);
        self.accepted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Drops the processes that stopped pushing more than `ttl` ago, and those the kernel
    /// named whose pid is gone.
    pub fn expire(&self) {
        self.expire_at(Instant::now(), |pid| {
            std::path::Path::new(&format!("/proc/{pid}")).exists()
        });
    }

    fn expire_at(&self, now: Instant, alive: impl Fn(u32) -> bool) {
        let mut tracked = self.tracked.lock().unwrap_or_else(PoisonError::into_inner);
        let before = tracked.len();
        tracked.retain(|&pid, t| {
            now.duration_since(t.last) < self.config.ttl && (!t.kernel_pid || alive(pid))
        });
        if tracked.len() != before {
            self.publish(&tracked);
        }
    }

    /// Replaces the pushed sources in the collector's list by the tracked ones.
    fn publish(&self, tracked: &FxHashMap<u32, Tracked>) {
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        sources.retain(|s| s.allocator != "pytorch");
        let mut pushed: Vec<_> = tracked
            .values()
            .flat_map(|t| t.sources.iter().cloned())
            .collect();
        pushed.sort_by_key(|s| (s.pid, s.gpu));
        sources.extend(pushed);
    }

    /// Processes tracked now.
    pub fn tracked_processes(&self) -> usize {
        self.tracked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Each tracked pid and the time since its last accepted push, by pid.
    pub fn push_ages(&self) -> Vec<(u32, Duration)> {
        let now = Instant::now();
        let tracked = self.tracked.lock().unwrap_or_else(PoisonError::into_inner);
        let mut ages: Vec<_> = tracked
            .iter()
            .map(|(&pid, t)| (pid, now.duration_since(t.last)))
            .collect();
        ages.sort_unstable_by_key(|&(pid, _)| pid);
        ages
    }

    /// (result label, count) for the ingest counter: `accepted`, then each refusal.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        let mut out = vec![("accepted", self.accepted.load(Ordering::Relaxed))];
        for (r, count) in Refusal::ALL.iter().zip(&self.refused) {
            out.push((r.label(), count.load(Ordering::Relaxed)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::allocator_sources;

    fn payload(pid: u32, seq: u64, stats: serde_json::Value) -> Vec<u8> {
        serde_json::json!({
            "pid": pid, "seq": seq, "torch_version": "2.5.1",
            "devices": [{"index": 0, "uuid": "GPU-abc", "stats": stats}]
        })
        .to_string()
        .into_bytes()
    }

    fn store(max_processes: usize) -> (PushStore, AllocatorSources) {
        let sources = allocator_sources(Vec::new());
        let config = IngestConfig {
            max_processes,
            ..IngestConfig::default()
        };
        (PushStore::new(config, Arc::clone(&sources)), sources)
    }

    #[test]
    fn a_push_becomes_a_pytorch_allocator_source() {
        let (store, sources) = store(10);
        let stats = serde_json::json!({
            "allocated_bytes.large_pool.current": 4096, "reserved_bytes.large_pool.current": 8192,
            "num_ooms": 2, "some_future_key": 7
        });
        store.push(&payload(42, 1, stats)).expect("accepted");
        let list = sources.lock().expect("lock").clone();
        assert_eq!(list.len(), 1);
        let s = &list[0];
        assert_eq!(
            (s.pid, s.gpu, s.allocator, s.uuid.as_str()),
            (42, 0, "pytorch", "GPU-abc")
        );
        assert_eq!(s.stats.allocated_bytes.large_pool.current(), 4096);
        assert_eq!(s.stats.num_ooms.get(), 2);
        assert_eq!(store.tracked_processes(), 1);
    }

    #[test]
    fn refusals_say_why_and_are_counted() {
        let (store, _) = store(2);
        let ok = serde_json::json!({"allocated_bytes.all.current": 1});
        let cases: Vec<(Vec<u8>, Refusal)> = vec![
            (b"{not json".to_vec(), Refusal::Malformed),
            (
                br#"{"pid": "x", "seq": 1, "devices": []}"#.to_vec(),
                Refusal::Malformed,
            ),
            (payload(0, 1, ok.clone()), Refusal::Invalid),
            (
                payload(7, 1, serde_json::json!({"reserved_bytes.all.current": -5})),
                Refusal::Invalid,
            ),
            (
                payload(7, 1, serde_json::json!({"reserved_bytes.all.current": 1.5})),
                Refusal::Invalid,
            ),
            (vec![b' '; MAX_BODY_BYTES + 1], Refusal::TooLarge),
        ];
        for (body, refusal) in cases {
            let err = store.push(&body).expect_err("refused");
            assert_eq!(err.refusal, refusal, "{}", err.message);
            assert!(!err.message.is_empty());
        }
        store.push(&payload(7, 5, ok.clone())).expect("accepted");
        assert_eq!(
            store
                .push(&payload(7, 5, ok.clone()))
                .map_err(|e| e.refusal),
            Err(Refusal::Stale)
        );
        assert_eq!(
            store
                .push(&payload(7, 6, ok.clone()))
                .map_err(|e| e.refusal),
            Err(Refusal::RateLimited)
        );
        store
            .push(&payload(8, 1, ok.clone()))
            .expect("second process");
        assert_eq!(
            store.push(&payload(9, 1, ok)).map_err(|e| e.refusal),
            Err(Refusal::Capacity)
        );
        let counts: BTreeMap<_, _> = store.counts().into_iter().collect();
        assert_eq!(counts["accepted"], 2);
        assert_eq!(counts["malformed"], 2);
        assert_eq!(counts["invalid"], 3);
        assert_eq!(counts["too_large"], 1);
        assert_eq!(
            (counts["stale"], counts["rate_limited"], counts["capacity"]),
            (1, 1, 1)
        );
    }

    #[test]
    fn segments_by_size_are_checked_and_stand_until_the_next_snapshot() {
        let (store, sources) = store(4);
        let with = |seq: u64, classes: serde_json::Value| {
            serde_json::json!({
                "pid": 5, "seq": seq,
                "devices": [{"index": 0, "uuid": "GPU-a", "stats": {},
                             "largest_free_block": 1024, "segments_by_size": classes}]
            })
            .to_string()
            .into_bytes()
        };
        let mib = 1u64 << 20;
        let refused = [
            serde_json::json!([{"size": 3 * mib, "segments": 1, "free_bytes": 0}]),
            serde_json::json!([{"size": 2 * mib, "segments": 1, "free_bytes": 3 * mib}]),
            serde_json::json!([{"size": 1u64 << 63, "segments": 4, "free_bytes": 1}]),
            serde_json::json!([{"size": 2 * mib, "segments": 1, "free_bytes": 0},
                               {"size": 2 * mib, "segments": 2, "free_bytes": 0}]),
            serde_json::json!(
                (0..65)
                    .map(|i| serde_json::json!(
                {"size": 1u64 << (i % 64), "segments": 0, "free_bytes": 0}))
                    .collect::<Vec<_>>()
            ),
        ];
        for (seq, classes) in refused.into_iter().enumerate() {
            let err = store
                .push(&with(seq as u64 + 1, classes))
                .expect_err("refused");
            assert_eq!(err.refusal, Refusal::Invalid, "{}", err.message);
        }
        let negative = serde_json::json!([{"size": 2 * mib, "segments": -1, "free_bytes": 0}]);
        let err = store.push(&with(9, negative)).expect_err("refused");
        assert_eq!(err.refusal, Refusal::Malformed, "{}", err.message);
        // Without the snapshot's largest free block, classes are not a snapshot's.
        let orphan = serde_json::json!({
            "pid": 5, "seq": 10,
            "devices": [{"index": 0, "uuid": "GPU-a", "stats": {},
                         "segments_by_size": []}]
        });
        let err = store
            .push(orphan.to_string().as_bytes())
            .expect_err("refused");
        assert_eq!(err.refusal, Refusal::Invalid, "{}", err.message);

        let classes = serde_json::json!([
            {"size": 32 * mib, "segments": 2, "free_bytes": 17 * mib},
            {"size": 2 * mib, "segments": 1, "free_bytes": mib}]);
        let start = Instant::now();
        store
            .push_at(&with(11, classes), None, start)
            .expect("accepted");
        let expected = vec![
            SegmentClass {
                size: 2 * mib,
                segments: 1,
                free_bytes: mib,
            },
            SegmentClass {
                size: 32 * mib,
                segments: 2,
                free_bytes: 17 * mib,
            },
        ];
        let published = || {
            sources.lock().expect("lock")[0]
                .segment_classes
                .lock()
                .expect("lock")
                .clone()
        };
        assert_eq!(published(), expected, "sorted by size");
        // A later push without a snapshot keeps them.
        store
            .push_at(
                &payload(5, 12, serde_json::json!({})),
                None,
                start + Duration::from_secs(1),
            )
            .expect("accepted");
        assert_eq!(published(), expected);
    }

    #[test]
    fn silent_processes_expire() {
        let (store, sources) = store(10);
        let start = Instant::now();
        let ok = serde_json::json!({"allocated_bytes.all.current": 1});
        store
            .push_at(&payload(1, 1, ok.clone()), None, start)
            .expect("accepted");
        store
            .push_at(&payload(2, 1, ok), None, start + Duration::from_secs(50))
            .expect("accepted");
        store.expire_at(start + Duration::from_secs(70), |_| false);
        let pids: Vec<u32> = sources
            .lock()
            .expect("lock")
            .iter()
            .map(|s| s.pid)
            .collect();
        assert_eq!(pids, [2], "a payload's own pid is never looked up");
        assert_eq!(store.tracked_processes(), 1);
    }

    #[test]
    fn a_vanished_pid_named_by_the_kernel_expires_at_once() {
        let (store, sources) = store(10);
        let start = Instant::now();
        let ok = serde_json::json!({"allocated_bytes.all.current": 1});
        // Both payloads claim pid 1; the kernel says 40 and 41.
        store
            .push_at(&payload(1, 1, ok.clone()), Some(40), start)
            .expect("accepted");
        store
            .push_at(&payload(1, 1, ok), Some(41), start)
            .expect("accepted");
        let pids = || -> Vec<u32> {
            let sources = sources.lock().expect("lock");
            sources.iter().map(|s| s.pid).collect()
        };
        assert_eq!(pids(), [40, 41]);
        store.expire_at(start + Duration::from_secs(1), |pid| pid == 41);
        assert_eq!(pids(), [41]);
        assert_eq!(store.tracked_processes(), 1);
    }

    #[test]
    fn a_kernel_named_pid_carries_its_pod() {
        fn resolve(pid: u32) -> Option<ContainerRef> {
            (pid == 40).then(|| ContainerRef {
                pod_uid: "5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c30".into(),
                container_id: "ab".repeat(32),
                runtime: cgroup::Runtime::Containerd,
            })
        }
        let sources = allocator_sources(Vec::new());
        let store = PushStore::new(
            IngestConfig {
                resolve,
                ..IngestConfig::default()
            },
            Arc::clone(&sources),
        );
        let ok = serde_json::json!({"allocated_bytes.all.current": 1});
        let start = Instant::now();
        store
            .push_at(&payload(1, 1, ok.clone()), Some(40), start)
            .expect("accepted");
        // A payload's own pid 40 is not looked up: it may be another namespace's.
        store
            .push_at(
                &payload(40, 2, ok.clone()),
                None,
                start + Duration::from_secs(1),
            )
            .expect("accepted");
        let labels: Vec<(u32, Vec<String>)> = sources
            .lock()
            .expect("lock")
            .iter()
            .map(|s| (s.pid, s.labels.iter().map(|(k, _)| k.clone()).collect()))
            .collect();
        assert_eq!(labels.len(), 1, "both pushes are pid 40: {labels:?}");
        assert!(labels[0].1.is_empty(), "the later, unattributed push wins");
        store
            .push_at(
                &payload(40, 3, ok),
                Some(40),
                start + Duration::from_secs(2),
            )
            .expect("accepted");
        let sources = sources.lock().expect("lock");
        let pod: Vec<&str> = sources[0]
            .labels
            .iter()
            .map(|(k, v)| {
                if k == "pod_uid" {
                    v.as_str()
                } else {
                    k.as_str()
                }
            })
            .collect();
        assert_eq!(
            pod,
            ["5f0a3c2e-7b1d-4e8a-9c6f-2d4b8e1a7c30", "container_id"]
        );
        drop(sources);
        // A job cannot claim a pod.
        let spoof = serde_json::json!({
            "pid": 9, "seq": 1, "labels": {"pod_uid": "x"},
            "devices": [{"index": 0, "uuid": "GPU-abc", "stats": {}}]
        });
        let refused = store
            .push_at(spoof.to_string().as_bytes(), None, start)
            .expect_err("reserved");
        assert_eq!(refused.refusal, Refusal::Invalid);
    }
}
