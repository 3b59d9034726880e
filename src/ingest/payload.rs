//! The push payload: its wire schema and its validation, as pure functions (no clock, no
//! state, no I/O).
//!
//! A job posts, per device it has used, `torch.cuda.memory_stats()` (the flat dict) with its
//! pid, a sequence number, the device's UUID and optional labels:
//!
//! ```json
//! {"pid": 4242, "seq": 17, "reason": "oom", "last_oom_unix_seconds": 1764576000.5,
//!  "torch_version": "2.5.1", "alloc_conf": "", "alloc_conf_generic": "max_split_size_mb:64",
//!  "labels": {"job": "llama", "rank": "0"},
//!  "devices": [{"index": 0, "uuid": "GPU-…", "stats": {"reserved_bytes.all.current": 1024},
//!               "largest_free_block": 512,
//!               "segments_by_size": [{"size": 2097152, "segments": 1, "free_bytes": 512}],
//!               "oom": {"size": 2097152, "stream": 0, "device_total": 85899345920,
//!                       "device_free": 0, "pools": []}}]}
//! ```
//!
//! `oom` (on the device that ran out of memory, in an OOM push) is described in
//! [`super::oom`]. `unmapped_bytes`, where a pool of the job has given its physical memory back
//! while PyTorch still counts it reserved (vLLM's sleep mode, SGLang's torch_memory_saver
//! paused), is that part of the reserved bytes: never more than `reserved_bytes.all.current`.
//! `memory_limit` (`{"bytes": …, "variable": "CUDA_DEVICE_MEMORY_LIMIT_0"}`) is the limit a
//! GPU-sharing layer enforces on the job's container on that device, as the job read it from
//! the variable the layer set.
//!
//! A JAX job's GPU device says `"allocator": "xla"`: its `stats` are PJRT's
//! `memory_stats()` keys (and the hook's `num_ooms`), read by [`super::xla`], with no snapshot
//! fields and no `oom`; the push then names `jax_version` and `xla_conf` (the XLA client's
//! settings). One device may be listed once per allocator.
//!
//! `host`, where the job's torch has `torch.cuda.host_memory_stats()` and the job pinned
//! memory, holds its pinned host memory under PyTorch 2.10+'s key names (the hook renames
//! older releases' keys): `allocated_bytes.current` and `allocations.current` (the pool's
//! blocks, in use and cached), `active_bytes.current` and `active_requests.current` (in use),
//! `num_host_alloc`, `num_host_free` and `host_alloc_time.total` (microseconds). Other keys
//! are ignored.
//!
//! `alloc_conf` is `PYTORCH_CUDA_ALLOC_CONF`; `alloc_conf_generic`, sent where it is set and
//! differs, `PYTORCH_ALLOC_CONF`. The configuration exported is the one the job's release
//! reads ([`crate::config::settings_from_env`], the release from `torch_version`, the newest
//! where it names none gpumem knows).
//!
//! `last_oom_unix_seconds`, when the hook's OOM observer last fired, lets the agent tell an
//! OOM that happened while it ran from one it learns of later (after its own restart).
//! `reason` is absent on periodic pushes, `"oom"` on the push an out-of-memory error
//! triggers, `"exit"` on the last push at interpreter exit. Unknown statistics keys and
//! unknown top-level fields are ignored (newer hooks may send more).
//!
//! # Invariants (budgets)
//! - A payload is at most [`MAX_BODY_BYTES`]; it lists 1 to [`MAX_DEVICES`] distinct devices
//!   (by index and by UUID), each with at most [`MAX_STATS_KEYS`] statistics and
//!   [`MAX_CLASSES`] size classes; at most [`MAX_LABELS`] labels, names and values at most
//!   [`MAX_LABEL_NAME`] characters and [`MAX_TEXT`] bytes, [`MAX_LABEL_BYTES`] together, so
//!   one process's series are bounded ([`ValidPush::series`]) and so is each series' size;
//!   `host` has at most [`MAX_HOST_KEYS`] keys.
//! - Every figure is a whole number: byte figures below 2^60 ([`MAX_BYTES`]), counts below
//!   2^53 ([`MAX_COUNT`]), so the collector's sums of two pools cannot overflow and every
//!   value is exact as a float. Per pool, `allocated` and `active` never exceed `reserved`;
//!   pinned memory in use never exceeds its pool.
//! - Label values, UUIDs and texts are visible text ([`is_visible`]: letters and digits of
//!   any script, ASCII punctuation, inner spaces; `torch_version` and the configurations
//!   are trimmed of outer spaces first, as PyTorch reads them); no object lists a key twice.
//! - A pushed label never overwrites a label of the contract or of Prometheus's and
//!   Kubernetes's target labels: such a name is exported as `exported_<name>`, Prometheus's
//!   own convention; a name that is not a label name is refused.
//! - Every refusal names the key at fault and why.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::allocator::{DeviceStats, SegmentClass};
use crate::metrics::contract::CONTRACT;
use crate::sources::{HostPinned, LastOom, MemoryLimit, XlaFigures};
use crate::telemetry::uuid_body;

use super::limits::{
    HOST_SERIES, MAX_BODY_BYTES, MAX_BYTES, MAX_CLASSES, MAX_COUNT, MAX_DEVICES, MAX_HOST_KEYS,
    MAX_LABEL_BYTES, MAX_LABEL_NAME, MAX_LABELS, MAX_PID, MAX_STATS_KEYS, MAX_TEXT,
    OOM_BREAKDOWN_SERIES, SERIES_PER_DEVICE, bound_of,
};
use super::refusal::{Refusal, Rejected, invalid};

/// The labels that the targets of Prometheus's Kubernetes service discovery carry, which a
/// pushed label must not overwrite (with `honorLabels: true` it would).
pub const TARGET_LABELS: [&str; 9] = [
    "job",
    "instance",
    "namespace",
    "pod",
    "container",
    "node",
    "service",
    "endpoint",
    "cluster",
];

/// Why a push was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A periodic push.
    Interval,
    /// Right after an out-of-memory error.
    Oom,
    /// The process is exiting: its last push.
    Exit,
}

/// A JSON object read into a map, refusing a key given twice (serde would keep the last,
/// silently).
struct Unique<V>(BTreeMap<String, V>);

impl<V> Default for Unique<V> {
    fn default() -> Self {
        Unique(BTreeMap::new())
    }
}

impl<V> std::ops::Deref for Unique<V> {
    type Target = BTreeMap<String, V>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Unique<V> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Visit<V> {
            type Value = Unique<V>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object whose keys are distinct")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = BTreeMap::new();
                while let Some(key) = map.next_key::<String>()? {
                    if out.contains_key(&key) {
                        return Err(serde::de::Error::custom(format_args!(
                            "the key {:?} is given twice",
                            truncate(&key)
                        )));
                    }
                    let value = map.next_value()?;
                    out.insert(key, value);
                }
                Ok(Unique(out))
            }
        }
        deserializer.deserialize_map(Visit(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct Push {
    pid: u32,
    seq: u64,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    labels: Unique<String>,
    #[serde(default)]
    torch_version: Option<String>,
    #[serde(default)]
    alloc_conf: Option<String>,
    #[serde(default)]
    alloc_conf_generic: Option<String>,
    /// When the job's OOM observer last fired (Unix seconds), if it has.
    #[serde(default)]
    last_oom_unix_seconds: Option<f64>,
    /// The process's start time in clock ticks since boot (`/proc/self/stat`), by its own
    /// word: it tells apart processes that reuse a pid when the kernel does not name them.
    #[serde(default)]
    start_time: Option<u64>,
    /// `torch.cuda.host_memory_stats()`, under 2.10+'s key names.
    #[serde(default)]
    host: Option<Unique<serde_json::Value>>,
    /// `jax.__version__`, where the job pushes XLA's devices.
    #[serde(default)]
    jax_version: Option<String>,
    /// The XLA client's settings (`XLA_PYTHON_CLIENT_*=value`, comma-separated).
    #[serde(default)]
    xla_conf: Option<String>,
    devices: Vec<PushedDevice>,
}

#[derive(Deserialize)]
struct PushedDevice {
    index: u32,
    uuid: String,
    /// Whose: `pytorch` (the default) or `xla`.
    #[serde(default)]
    allocator: Option<String>,
    stats: Unique<serde_json::Value>,
    /// From a memory snapshot (the hook takes one on out-of-memory).
    #[serde(default)]
    largest_free_block: Option<u64>,
    /// From the same snapshot: its segments by size class.
    #[serde(default)]
    segments_by_size: Option<Vec<PushedClass>>,
    /// On the device that ran out of memory: the request and each pool's figures.
    #[serde(default)]
    oom: Option<super::oom::PushedOom>,
    /// Reserved bytes whose physical memory a pool has unmapped (a sleeping vLLM or SGLang
    /// pool): counted reserved, resident nowhere.
    #[serde(default)]
    unmapped_bytes: Option<u64>,
    /// The device-memory limit a GPU-sharing layer enforces on the process's container on
    /// this device, from the variable it set in the environment (HAMi's).
    #[serde(default)]
    memory_limit: Option<PushedLimit>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PushedLimit {
    bytes: u64,
    variable: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PushedClass {
    size: u64,
    segments: u64,
    free_bytes: u64,
}

/// A payload that passed every check, as plain data.
#[derive(Debug)]
pub struct ValidPush {
    /// The pid the payload names (the kernel's replaces it for a socket push).
    pub pid: u32,
    /// Its sequence number.
    pub seq: u64,
    /// Why it was sent.
    pub reason: Reason,
    /// `torch.__version__`.
    pub version: String,
    /// `PYTORCH_CUDA_ALLOC_CONF`.
    pub config: String,
    /// `jax.__version__` and the XLA client's settings, where it pushes XLA's devices.
    pub xla: (String, String),
    /// Its labels, renamed where they collide (sorted by pushed name).
    pub labels: Vec<(String, String)>,
    /// When the job last ran out of memory, by its own clock (Unix seconds).
    pub last_oom_unix_seconds: Option<f64>,
    /// Its start time, by its own word (clock ticks since boot).
    pub start_time: Option<u64>,
    /// Its devices.
    pub devices: Vec<ValidDevice>,
    /// Its pinned host memory, where it said.
    pub host: Option<HostPinned>,
}

/// One device of a valid push.
#[derive(Debug)]
pub struct ValidDevice {
    /// The job's CUDA ordinal.
    pub index: u32,
    /// The device's UUID.
    pub uuid: String,
    /// `memory_stats()` (XLA's in the contract's terms, [`super::xla`]).
    pub stats: DeviceStats,
    /// What XLA's allocator reported, where the device's allocator is XLA's.
    pub xla: Option<XlaFigures>,
    /// From a snapshot, with its size classes (XLA's: its largest free block, no classes).
    pub snapshot: Option<(u64, Vec<SegmentClass>)>,
    /// The explanation of the out-of-memory error this push reports, on the device that had it.
    pub last_oom: Option<LastOom>,
    /// Of its reserved bytes, those whose physical memory is unmapped (0 unless said).
    pub unmapped: u64,
    /// The limit a GPU-sharing layer enforces on its container here: bytes and the variable
    /// that set it, where the job said.
    pub memory_limit: Option<MemoryLimit>,
}

impl ValidPush {
    /// The series this push adds to a scrape: its devices', and the ingest's last-push age
    /// of the process.
    pub fn series(&self) -> usize {
        1 + self.host.map_or(0, |_| HOST_SERIES)
            + self
                .devices
                .iter()
                .map(|d| {
                    SERIES_PER_DEVICE
                        + 2 * d.snapshot.as_ref().map_or(0, |(_, c)| c.len())
                        + d.last_oom.as_ref().map_or(0, |_| OOM_BREAKDOWN_SERIES)
                })
                .sum::<usize>()
    }

    /// OOMs the process counted, over its devices.
    pub fn ooms(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.stats.num_ooms.get().max(0) as u64)
            .sum()
    }
}

/// The release a `torch.__version__` names (`2.5.1+cu121` is 2.5), if gpumem knows it.
fn release_of(version: &str) -> Option<crate::config::PyTorchVersion> {
    let mut parts = version.split(['.', '+']);
    let (major, minor) = (parts.next()?, parts.next()?);
    format!("{major}.{minor}").parse().ok()
}

/// Parses and checks a payload.
///
/// # Errors
/// A [`Rejected`] naming what is wrong.
pub fn validate(body: &[u8]) -> Result<ValidPush, Rejected> {
    if body.len() > MAX_BODY_BYTES {
        return Err(Rejected::new(
            Refusal::TooLarge,
            format!("the body exceeds {MAX_BODY_BYTES} bytes"),
        ));
    }
    let push: Push = serde_json::from_slice(body)
        .map_err(|e| Rejected::new(Refusal::Malformed, format!("not a push payload: {e}")))?;
    if push.pid == 0 || push.pid > MAX_PID {
        return Err(invalid(format!(
            "pid must be a process id (1 to {MAX_PID}), not {}",
            push.pid
        )));
    }
    let reason = match push.reason.as_deref() {
        None | Some("interval") => Reason::Interval,
        Some("oom") => Reason::Oom,
        Some("exit") => Reason::Exit,
        Some(other) => {
            return Err(invalid(format!(
                "reason must be \"interval\", \"oom\" or \"exit\", not {:?}",
                truncate(other)
            )));
        }
    };
    if push.devices.is_empty() || push.devices.len() > MAX_DEVICES {
        return Err(invalid(format!(
            "devices must list 1 to {MAX_DEVICES} devices, not {}",
            push.devices.len()
        )));
    }
    // Outer spaces are trimmed (a variable set to " expandable_segments:True" reads the
    // same to PyTorch), not refused: a hook that sent them whole loses no push.
    let trimmed = |t: Option<String>| t.map(|t| t.trim_matches(' ').to_string());
    let version = trimmed(push.torch_version).unwrap_or_default();
    text("torch_version", &version)?;
    let (cuda, generic) = (trimmed(push.alloc_conf), trimmed(push.alloc_conf_generic));
    text("alloc_conf", cuda.as_deref().unwrap_or_default())?;
    text("alloc_conf_generic", generic.as_deref().unwrap_or_default())?;
    let release = release_of(&version).unwrap_or_default();
    // Set but empty is set (PyTorch parses the empty string); absent is unset.
    let config = crate::config::settings_from_env(release, cuda.as_deref(), generic.as_deref())
        .0
        .unwrap_or_default()
        .to_string();
    let labels = labels(&push.labels)?;
    if let Some(t) = push.last_oom_unix_seconds
        && !(t.is_finite() && t >= 0.0)
    {
        return Err(invalid(format!(
            "last_oom_unix_seconds must be a time (seconds since 1970), not {t}"
        )));
    }
    let host = push.host.as_deref().map(host).transpose()?.flatten();
    let mut devices: Vec<ValidDevice> = Vec::with_capacity(push.devices.len());
    for device in &push.devices {
        let valid = self::device(device)?;
        // Spellings of one UUID (its case, a GPU- or MIG- prefix) are one device: the
        // collector places them alike. A process may push one device twice: once per
        // allocator (PyTorch's and XLA's).
        let body = uuid_body(&valid.uuid);
        if let Some(twin) = devices.iter().find(|d| {
            d.xla.is_some() == valid.xla.is_some()
                && (d.index == valid.index || uuid_body(&d.uuid) == body)
        }) {
            return Err(invalid(format!(
                "device {} ({}) is listed twice (as device {} ({}))",
                valid.index,
                truncate(&valid.uuid),
                twin.index,
                truncate(&twin.uuid)
            )));
        }
        devices.push(valid);
    }
    let jax_version = trimmed(push.jax_version).unwrap_or_default();
    text("jax_version", &jax_version)?;
    let xla_conf = trimmed(push.xla_conf).unwrap_or_default();
    text("xla_conf", &xla_conf)?;
    Ok(ValidPush {
        pid: push.pid,
        seq: push.seq,
        reason,
        version,
        config,
        xla: (jax_version, xla_conf),
        labels,
        last_oom_unix_seconds: push.last_oom_unix_seconds,
        start_time: push.start_time,
        devices,
        host,
    })
}

/// One device of a push, checked: its UUID, its statistics (PyTorch's, or XLA's through
/// [`super::xla`]), its snapshot and its OOM's figures (PyTorch's only).
fn device(device: &PushedDevice) -> Result<ValidDevice, Rejected> {
    let index = device.index;
    text("uuid", &device.uuid)?;
    if device.uuid.is_empty() {
        return Err(invalid(format!("device {index}: uuid is empty")));
    }
    let stats = statistics(device)?;
    match device.allocator.as_deref() {
        None | Some("pytorch") => {
            let snapshot = snapshot(device)?;
            let last_oom = device
                .oom
                .as_ref()
                .map(|oom| super::oom::explain(index, oom, stats.get("max_split_size").copied()))
                .transpose()?
                .flatten();
            let unmapped = device.unmapped_bytes.unwrap_or(0);
            let reserved = stats
                .get("reserved_bytes.all.current")
                .copied()
                .unwrap_or(0);
            if unmapped > reserved.max(0) as u64 {
                return Err(invalid(format!(
                    "device {index}: unmapped_bytes {unmapped} exceeds the {reserved} bytes \
                     reserved (reserved_bytes.all.current)"
                )));
            }
            Ok(ValidDevice {
                index,
                uuid: device.uuid.clone(),
                stats: DeviceStats::from_memory_stats(&stats),
                xla: None,
                snapshot,
                last_oom,
                unmapped,
                memory_limit: memory_limit(device)?,
            })
        }
        Some("xla") => {
            if device.largest_free_block.is_some()
                || device.segments_by_size.is_some()
                || device.oom.is_some()
                || device.unmapped_bytes.is_some()
                || device.memory_limit.is_some()
            {
                return Err(invalid(format!(
                    "device {index}: an xla allocator's figures are its statistics \
                     (largest_free_block_bytes among them): no snapshot, no oom object, \
                     no unmapped_bytes, no memory_limit (its PyTorch device's carries it)"
                )));
            }
            let (stats, reported, largest) = super::xla::figures(index, &stats)?;
            Ok(ValidDevice {
                index,
                uuid: device.uuid.clone(),
                stats,
                xla: Some(reported),
                snapshot: largest.map(|l| (l, Vec::new())),
                last_oom: None,
                unmapped: 0,
                memory_limit: None,
            })
        }
        Some(other) => Err(invalid(format!(
            "device {index}: allocator must be \"pytorch\" or \"xla\", not {:?}",
            truncate(other)
        ))),
    }
}

/// A device's `memory_limit`: 1 byte to below 2^60 (a limit of 0 limits nothing a ratio can
/// say), set by a variable whose name is an
/// environment variable's (`[A-Z0-9_]`, at most [`MAX_LABEL_NAME`] characters).
fn memory_limit(device: &PushedDevice) -> Result<Option<MemoryLimit>, Rejected> {
    let Some(limit) = &device.memory_limit else {
        return Ok(None);
    };
    let name = &limit.variable;
    let named = !name.is_empty()
        && name.len() <= MAX_LABEL_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if !named {
        return Err(invalid(format!(
            "device {}: memory_limit.variable {:?} is not a variable's name ([A-Z0-9_], at \
             most {MAX_LABEL_NAME} characters)",
            device.index,
            truncate(name)
        )));
    }
    if limit.bytes == 0 || limit.bytes >= MAX_BYTES as u64 {
        return Err(invalid(format!(
            "device {}: memory_limit.bytes {} is not between 1 and 2^60",
            device.index, limit.bytes
        )));
    }
    Ok(Some(MemoryLimit {
        bytes: limit.bytes,
        variable: name.clone(),
    }))
}

/// The keys of a push's `host` object that gpumem reads (PyTorch 2.10+'s names), in
/// [`HostPinned`]'s order.
pub const HOST_KEYS: [&str; HOST_SERIES] = [
    "allocated_bytes.current",
    "active_bytes.current",
    "allocations.current",
    "active_requests.current",
    "num_host_alloc",
    "num_host_free",
    "host_alloc_time.total",
];

/// The pinned host memory of a push's `host` object; `None` when it names no figure gpumem
/// exports.
fn host(pushed: &BTreeMap<String, serde_json::Value>) -> Result<Option<HostPinned>, Rejected> {
    if pushed.len() > MAX_HOST_KEYS {
        return Err(invalid(format!(
            "host: more than {MAX_HOST_KEYS} statistics"
        )));
    }
    let figure = |key: &str| -> Result<Option<u64>, Rejected> {
        let Some(value) = pushed.get(key) else {
            return Ok(None);
        };
        let (limit, unit) = bound_of(key);
        match value.as_u64() {
            Some(n) if n < limit as u64 => Ok(Some(n)),
            _ => Err(invalid(format!(
                "host: {key} must be a whole number from 0 below {unit}, not {}",
                truncate(&value.to_string())
            ))),
        }
    };
    let [
        allocated_bytes,
        active_bytes,
        allocations,
        active_requests,
        allocs,
        frees,
        time,
    ] = HOST_KEYS.map(figure);
    let pinned = HostPinned {
        allocated_bytes: allocated_bytes?,
        active_bytes: active_bytes?,
        allocations: allocations?,
        active_requests: active_requests?,
        host_allocs: allocs?,
        host_frees: frees?,
        alloc_time_us: time?,
    };
    for (part, whole, names) in [
        (
            pinned.active_bytes,
            pinned.allocated_bytes,
            ("active_bytes.current", "allocated_bytes.current"),
        ),
        (
            pinned.active_requests,
            pinned.allocations,
            ("active_requests.current", "allocations.current"),
        ),
    ] {
        if let (Some(part), Some(whole)) = (part, whole)
            && part > whole
        {
            return Err(invalid(format!(
                "host: {} ({part}) exceeds {} ({whole}): what is in use lies in the pool",
                names.0, names.1
            )));
        }
    }
    Ok((pinned != HostPinned::default()).then_some(pinned))
}

/// At most 64 characters of a client's string, for messages.
fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

/// Whether `value` is visible text: letters and digits of any script, ASCII punctuation and
/// symbols, and spaces between them (not first or last). So no control, format (bidirectional
/// overrides, zero-width characters, tags), separator or look-alike space reaches a label.
pub fn is_visible(value: &str) -> bool {
    !value.starts_with(' ')
        && !value.ends_with(' ')
        && value
            .chars()
            .all(|c| c == ' ' || c.is_ascii_graphic() || c.is_alphanumeric())
}

fn text(what: &str, value: &str) -> Result<(), Rejected> {
    if value.len() > MAX_TEXT || !is_visible(value) {
        return Err(invalid(format!(
            "{what} must be at most {MAX_TEXT} bytes of letters, digits, ASCII punctuation and inner spaces"
        )));
    }
    Ok(())
}

/// Whether `name` is a Prometheus label name (`[a-zA-Z_][a-zA-Z0-9_]*`).
pub fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Whether a pushed label `name` would collide with a label the agent or Prometheus sets: a
/// label of the metric contract, a target label, or one the agent adds to pushed series.
pub fn collides(name: &str) -> bool {
    TARGET_LABELS.contains(&name)
        || name == "le"
        || CONTRACT.iter().any(|def| def.labels.contains(&name))
}

/// A push's labels: valid names, bounded; colliding names exported as `exported_<name>`.
fn labels(pushed: &BTreeMap<String, String>) -> Result<Vec<(String, String)>, Rejected> {
    if pushed.len() > MAX_LABELS {
        return Err(invalid(format!(
            "at most {MAX_LABELS} labels, not {}",
            pushed.len()
        )));
    }
    let bytes: usize = pushed.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_LABEL_BYTES {
        return Err(invalid(format!(
            "labels take {bytes} bytes, names and values together; at most {MAX_LABEL_BYTES}"
        )));
    }
    let mut out: Vec<(String, String)> = Vec::with_capacity(pushed.len());
    for (name, value) in pushed {
        if name.len() > MAX_LABEL_NAME || !is_label_name(name) || name.starts_with("__") {
            return Err(invalid(format!(
                "label {:?} is not a label name (at most {MAX_LABEL_NAME} of [a-zA-Z0-9_], \
                 not starting with a digit or \"__\")",
                truncate(name)
            )));
        }
        text(&format!("label {name}"), value)?;
        let exported = if collides(name) {
            format!("exported_{name}")
        } else {
            name.clone()
        };
        if pushed.contains_key(&exported) && exported != *name {
            return Err(invalid(format!(
                "labels {name:?} and {exported:?} both given: {name:?} is exported as {exported:?}"
            )));
        }
        out.push((exported, value.clone()));
    }
    Ok(out)
}

/// A snapshot's largest free block and segments by size class: at most one class per power
/// of two, each consistent.
fn snapshot(device: &PushedDevice) -> Result<Option<(u64, Vec<SegmentClass>)>, Rejected> {
    let at = |message: String| invalid(format!("device {}: {message}", device.index));
    let (largest, pushed) = match (device.largest_free_block, &device.segments_by_size) {
        (None, None) => return Ok(None),
        (None, Some(_)) => {
            return Err(at(
                "segments_by_size comes from a snapshot, with its largest_free_block".into(),
            ));
        }
        (Some(largest), classes) => (largest, classes.as_deref().unwrap_or_default()),
    };
    if largest >= MAX_BYTES as u64 {
        return Err(at(format!(
            "largest_free_block {largest} is not below 2^60"
        )));
    }
    if pushed.len() > MAX_CLASSES {
        return Err(at(format!(
            "segments_by_size lists at most {MAX_CLASSES} classes"
        )));
    }
    let mut classes: Vec<SegmentClass> = Vec::with_capacity(pushed.len());
    for c in pushed {
        if !c.size.is_power_of_two() {
            return Err(at(format!(
                "segments_by_size: class size {} is not a power of two",
                c.size
            )));
        }
        if c.size >= MAX_BYTES as u64 || c.free_bytes >= MAX_BYTES as u64 {
            return Err(at(format!(
                "segments_by_size: class size {} or {} free bytes is not below 2^60",
                c.size, c.free_bytes
            )));
        }
        if c.segments >= MAX_COUNT as u64 {
            return Err(at(format!(
                "segments_by_size: {} segments is not below 2^53",
                c.segments
            )));
        }
        if c.segments
            .checked_mul(c.size)
            .is_none_or(|cap| c.free_bytes > cap)
        {
            return Err(at(format!(
                "segments_by_size: {} free bytes do not fit in {} segments of at most {} bytes",
                c.free_bytes, c.segments, c.size
            )));
        }
        if classes.iter().any(|k| k.size == c.size) {
            return Err(at(format!(
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
    Ok(Some((largest, classes)))
}

/// Statistics as integers, bounded: whole, not negative (but `max_split_size`, where -1
/// means unlimited), bytes below [`MAX_BYTES`], counts below [`MAX_COUNT`]; per pool,
/// allocated and active bytes within reserved bytes.
fn statistics(device: &PushedDevice) -> Result<BTreeMap<String, i64>, Rejected> {
    let index = device.index;
    if device.stats.len() > MAX_STATS_KEYS {
        return Err(invalid(format!(
            "device {index}: more than {MAX_STATS_KEYS} statistics"
        )));
    }
    let mut out = BTreeMap::new();
    for (key, value) in device.stats.iter() {
        text("a statistics key", key)?;
        let Some(number) = value.as_i64() else {
            return Err(invalid(format!(
                "device {index}: {key} must be an integer, not {}",
                truncate(&value.to_string())
            )));
        };
        let (limit, unit) = bound_of(key);
        if number >= limit {
            return Err(invalid(format!(
                "device {index}: {key} = {number} is not below {unit}"
            )));
        }
        if number < 0 && !(key == "max_split_size" && number == -1) {
            return Err(invalid(format!(
                "device {index}: {key} is negative ({number})"
            )));
        }
        out.insert(key.clone(), number);
    }
    for pool in ["all", "small_pool", "large_pool"] {
        let current = |stat: &str| out.get(&format!("{stat}.{pool}.current")).copied();
        let Some(reserved) = current("reserved_bytes") else {
            continue;
        };
        for part in ["allocated_bytes", "active_bytes"] {
            if let Some(value) = current(part)
                && value > reserved
            {
                return Err(invalid(format!(
                    "device {index}: {part}.{pool}.current ({value}) exceeds \
                     reserved_bytes.{pool}.current ({reserved})"
                )));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_stats(stats: serde_json::Value) -> Vec<u8> {
        serde_json::json!({"pid": 7, "seq": 1,
            "devices": [{"index": 0, "uuid": "GPU-a", "stats": stats}]})
        .to_string()
        .into_bytes()
    }

    fn with_labels(labels: serde_json::Value) -> Vec<u8> {
        serde_json::json!({"pid": 7, "seq": 1, "labels": labels,
            "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]})
        .to_string()
        .into_bytes()
    }

    fn refused(body: &[u8]) -> Rejected {
        validate(body).expect_err("refused")
    }

    #[test]
    fn figures_are_bounded_and_consistent() {
        let near_max = i64::MAX - 5;
        for (stats, key) in [
            (
                serde_json::json!({"reserved_bytes.all.current": near_max}),
                "reserved_bytes.all.current",
            ),
            (
                serde_json::json!({"reserved_bytes.large_pool.current": 1_i64 << 60}),
                "reserved_bytes.large_pool.current",
            ),
            (serde_json::json!({"num_ooms": 1_i64 << 53}), "num_ooms"),
            (
                serde_json::json!({"reserved_bytes.small_pool.current": 10,
                                   "allocated_bytes.small_pool.current": 11}),
                "allocated_bytes.small_pool.current",
            ),
            (
                serde_json::json!({"reserved_bytes.all.current": 10,
                                   "active_bytes.all.current": 20}),
                "active_bytes.all.current",
            ),
            (serde_json::json!({"max_split_size": -2}), "max_split_size"),
            (
                serde_json::json!({"num_alloc_retries": 18446744073709551615_u64}),
                "num_alloc_retries",
            ),
        ] {
            let err = refused(&with_stats(stats));
            assert_eq!(err.refusal, Refusal::Invalid, "{}", err.message);
            assert!(err.message.contains(key), "{key}: {}", err.message);
        }
        let ok = validate(&with_stats(serde_json::json!({
            "reserved_bytes.all.current": (1_i64 << 60) - 1,
            "allocated_bytes.all.current": 5, "max_split_size": -1,
            "num_ooms": (1_i64 << 53) - 1})))
        .expect("at the bounds");
        assert_eq!(ok.ooms(), (1 << 53) - 1);
    }

    #[test]
    fn colliding_labels_are_exported_and_invalid_names_refused() {
        for name in TARGET_LABELS
            .iter()
            .chain(&["gpu", "UUID", "pid", "pod_uid", "le"])
        {
            let push = validate(&with_labels(serde_json::json!({*name: "x"}))).expect("valid");
            assert_eq!(
                push.labels,
                [(format!("exported_{name}"), "x".to_string())],
                "{name}"
            );
        }
        let push = validate(&with_labels(
            serde_json::json!({"team": "nlp", "rank": "3"}),
        ))
        .expect("ok");
        assert_eq!(
            push.labels,
            [("rank".into(), "3".into()), ("team".into(), "nlp".into())]
        );
        let long = "a".repeat(MAX_LABEL_NAME + 1);
        for bad in ["", "1abc", "a-b", "__name__", "é", long.as_str()] {
            let err = refused(&with_labels(serde_json::json!({bad: "x"})));
            assert_eq!(err.refusal, Refusal::Invalid, "{bad:?}");
            assert!(err.message.contains("label"), "{}", err.message);
        }
        let err = refused(&with_labels(
            serde_json::json!({"job": "a", "exported_job": "b"}),
        ));
        assert!(err.message.contains("exported_job"), "{}", err.message);
        let err = refused(&with_labels(
            serde_json::json!({"team": "x".repeat(MAX_TEXT + 1)}),
        ));
        assert!(err.message.contains("label team"), "{}", err.message);
        let many: serde_json::Map<_, _> = (0..=MAX_LABELS)
            .map(|i| (format!("l{i}"), serde_json::json!("v")))
            .collect();
        let err = refused(&with_labels(serde_json::Value::Object(many)));
        assert!(err.message.contains("labels"), "{}", err.message);
        let heavy: serde_json::Map<_, _> = (0..5)
            .map(|i| (format!("l{i}"), serde_json::json!("v".repeat(MAX_TEXT))))
            .collect();
        let err = refused(&with_labels(serde_json::Value::Object(heavy)));
        assert!(err.message.contains("bytes"), "{}", err.message);
    }

    #[test]
    fn every_contract_label_collides() {
        // A label added to the contract is protected from pushes without another list.
        for def in CONTRACT {
            for label in def.labels {
                assert!(collides(label), "{} of {}", label, def.name);
            }
        }
        assert!(!collides("team") && !collides("rank"));
    }

    #[test]
    fn devices_are_distinct_and_bounded() {
        for devices in
            [
                serde_json::json!([{"index": 0, "uuid": "u", "stats": {}},
                               {"index": 0, "uuid": "u", "stats": {}}]),
                serde_json::json!([{"index": 0, "uuid": "u", "stats": {}},
                               {"index": 1, "uuid": "u", "stats": {}}]),
                serde_json::json!([{"index": 0, "uuid": "u", "stats": {}},
                               {"index": 0, "uuid": "v", "stats": {}}]),
                // One UUID spelled twice: placed alike, they would be one series twice.
                serde_json::json!([{"index": 0, "uuid": "GPU-ab", "stats": {}},
                               {"index": 1, "uuid": "MIG-AB", "stats": {}}]),
                serde_json::json!([]),
                serde_json::json!((0..=MAX_DEVICES)
                .map(|i| serde_json::json!({"index": i, "uuid": format!("u{i}"), "stats": {}}))
                .collect::<Vec<_>>()),
                serde_json::json!([{"index": 0, "uuid": "", "stats": {}}]),
            ]
        {
            let body = serde_json::json!({"pid": 7, "seq": 1, "devices": devices}).to_string();
            let err = refused(body.as_bytes());
            assert_eq!(err.refusal, Refusal::Invalid, "{}", err.message);
        }
    }

    /// Issue 34, case 14: "printable" excluded only control characters, so bidirectional
    /// overrides, zero-width and separator characters, tags and a UUID of spaces reached
    /// labels; a key given twice kept its last value silently.
    #[test]
    fn labels_and_uuids_are_visible_text_and_keys_distinct() {
        let with = |label: &str, uuid: &str| {
            serde_json::json!({"pid": 5, "seq": 1, "labels": {"job": label},
                "devices": [{"index": 0, "uuid": uuid, "stats": {}}]})
            .to_string()
        };
        for fine in ["llama-7b", "équipe nlp", "训练", "a/b:c@d+e=f", "x"] {
            validate(with(fine, "GPU-1").as_bytes()).expect(fine);
            validate(with("job", fine).as_bytes()).expect(fine);
        }
        for hostile in [
            "admin\u{202e}gnp.exe",
            "zero\u{200b}width",
            "line\u{2028}separator",
            "tag\u{e0041}",
            "no\u{a0}break",
            "   ",
            " padded",
            "padded ",
            "emoji\u{1f600}",
        ] {
            for body in [with(hostile, "GPU-1"), with("job", hostile)] {
                let refusal = refused(body.as_bytes());
                assert_eq!(refusal.refusal, Refusal::Invalid, "{hostile:?}");
                assert!(
                    refusal.message.contains("letters, digits"),
                    "{}",
                    refusal.message
                );
            }
        }
        // Outer spaces of the texts PyTorch reads are trimmed, not refused.
        let padded = serde_json::json!({"pid": 5, "seq": 1, "torch_version": " 2.5.1 ",
            "alloc_conf": " expandable_segments:True ",
            "devices": [{"index": 0, "uuid": "u", "stats": {}}]});
        validate(padded.to_string().as_bytes()).expect("trimmed");
        let twice = [
            r#"{"pid": 5, "seq": 1, "labels": {"job": "a", "job": "b"}, "devices": [{"index": 0, "uuid": "u", "stats": {}}]}"#,
            r#"{"pid": 5, "seq": 1, "devices": [{"index": 0, "uuid": "u", "stats": {"num_ooms": 1, "num_ooms": 0}}]}"#,
            r#"{"pid": 5, "seq": 1, "host": {"num_host_alloc": 1, "num_host_alloc": 2}, "devices": [{"index": 0, "uuid": "u", "stats": {}}]}"#,
            r#"{"pid": 5, "pid": 6, "seq": 1, "devices": [{"index": 0, "uuid": "u", "stats": {}}]}"#,
        ];
        for body in twice {
            let refusal = refused(body.as_bytes());
            assert_eq!(refusal.refusal, Refusal::Malformed, "{body}");
            assert!(
                refusal.message.contains("twice") || refusal.message.contains("duplicate"),
                "{}",
                refusal.message
            );
        }
    }

    #[test]
    fn reasons_and_pids() {
        let body = |pid: u64, reason: &str| {
            serde_json::json!({"pid": pid, "seq": 1, "reason": reason,
                "devices": [{"index": 0, "uuid": "u", "stats": {}}]})
            .to_string()
        };
        assert_eq!(
            validate(body(5, "oom").as_bytes()).expect("ok").reason,
            Reason::Oom
        );
        assert_eq!(
            validate(body(5, "exit").as_bytes()).expect("ok").reason,
            Reason::Exit
        );
        assert_eq!(
            refused(body(5, "panic").as_bytes()).refusal,
            Refusal::Invalid
        );
        assert_eq!(refused(body(0, "oom").as_bytes()).refusal, Refusal::Invalid);
        assert_eq!(
            refused(body(u64::from(MAX_PID) + 1, "oom").as_bytes()).refusal,
            Refusal::Invalid
        );
        assert_eq!(
            refused(body(1 << 40, "oom").as_bytes()).refusal,
            Refusal::Malformed
        );
    }

    #[test]
    fn the_configuration_exported_is_the_one_the_release_reads() {
        let config = |version: &str, cuda: Option<&str>, generic: Option<&str>| {
            let mut body = serde_json::json!({"pid": 7, "seq": 1, "torch_version": version,
                "devices": [{"index": 0, "uuid": "a", "stats": {}}]});
            if let Some(c) = cuda {
                body["alloc_conf"] = c.into();
            }
            if let Some(g) = generic {
                body["alloc_conf_generic"] = g.into();
            }
            validate(body.to_string().as_bytes()).expect("valid").config
        };
        let (cuda, generic) = ("expandable_segments:True", "max_split_size_mb:64");
        assert_eq!(config("2.12.0+cu128", Some(cuda), Some(generic)), cuda);
        assert_eq!(config("2.12.0", None, Some(generic)), generic);
        // Set but empty is set: it wins.
        assert_eq!(config("2.12.0", Some(""), Some(generic)), "");
        // 2.9's device allocator reads only the CUDA variable.
        assert_eq!(config("2.9.1", None, Some(generic)), "");
        assert_eq!(config("2.9.1", Some(cuda), Some(generic)), cuda);
        // An older hook's one field; a release gpumem does not know reads as the newest.
        assert_eq!(config("3.1.0", Some(cuda), None), cuda);
        assert_eq!(config("", None, Some(generic)), generic);
        assert!(release_of("2.15.0a0+git").is_some_and(|v| v.minor() == 15));
        assert_eq!(release_of("nightly"), None);
    }

    #[test]
    fn series_count_follows_the_snapshot() {
        let body = serde_json::json!({"pid": 7, "seq": 1, "devices": [
            {"index": 0, "uuid": "a", "stats": {}},
            {"index": 1, "uuid": "b", "stats": {}, "largest_free_block": 0,
             "segments_by_size": [{"size": 2, "segments": 1, "free_bytes": 0},
                                  {"size": 4, "segments": 1, "free_bytes": 0}]}]});
        let push = validate(body.to_string().as_bytes()).expect("valid");
        assert_eq!(push.series(), 1 + 2 * SERIES_PER_DEVICE + 4);
    }

    fn with_host(host: serde_json::Value) -> Vec<u8> {
        serde_json::json!({"pid": 7, "seq": 1, "host": host,
            "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn pinned_host_memory_is_read_bounded_and_consistent() {
        let push = validate(&with_host(serde_json::json!({
            "allocated_bytes.current": 4096, "active_bytes.current": 1024,
            "allocations.current": 2, "active_requests.current": 1, "num_host_alloc": 2,
            "num_host_free": 0, "host_alloc_time.total": 1500,
            "host_free_time.total": 7, "segment.current": 9})))
        .expect("valid; unknown keys ignored");
        let host = push.host.expect("pinned memory");
        assert_eq!(host.allocated_bytes, Some(4096));
        assert_eq!(host.active_requests, Some(1));
        assert_eq!(host.alloc_time_us, Some(1500));
        assert_eq!(push.series(), 1 + SERIES_PER_DEVICE + HOST_SERIES);
        // A figure it lacks stays unknown; no figure at all is no pinned memory.
        let push = validate(&with_host(serde_json::json!({"num_host_alloc": 3}))).expect("valid");
        assert_eq!(
            push.host.map(|h| (h.host_allocs, h.allocated_bytes)),
            Some((Some(3), None))
        );
        let push = validate(&with_host(serde_json::json!({"other": 1}))).expect("valid");
        assert!(push.host.is_none());
        assert_eq!(push.series(), 1 + SERIES_PER_DEVICE);
        for (host, key) in [
            (
                serde_json::json!({"allocated_bytes.current": -1}),
                "allocated_bytes.current",
            ),
            (serde_json::json!({"num_host_alloc": 1.5}), "num_host_alloc"),
            (serde_json::json!({"num_host_alloc": "1"}), "num_host_alloc"),
            (
                serde_json::json!({"allocated_bytes.current": 1_u64 << 60}),
                "2^60",
            ),
            (
                serde_json::json!({"host_alloc_time.total": 1_u64 << 53}),
                "host_alloc_time.total",
            ),
            (
                serde_json::json!({"allocated_bytes.current": 1, "active_bytes.current": 2}),
                "exceeds",
            ),
            (
                serde_json::json!({"allocations.current": 1, "active_requests.current": 2}),
                "exceeds",
            ),
        ] {
            let r = refused(&with_host(host.clone()));
            assert_eq!(r.refusal, Refusal::Invalid, "{host}");
            assert!(r.message.contains(key), "{host}: {}", r.message);
        }
        let many: serde_json::Map<String, serde_json::Value> = (0..=MAX_HOST_KEYS)
            .map(|i| (format!("k{i}"), serde_json::json!(0)))
            .collect();
        let r = refused(&with_host(serde_json::Value::Object(many)));
        assert!(r.message.contains("more than"), "{}", r.message);
        let r = refused(&with_host(serde_json::json!([1, 2])));
        assert_eq!(r.refusal, Refusal::Malformed);
    }

    #[test]
    fn an_xla_device_is_read_as_xla_reports_it_beside_pytorchs() {
        let body = serde_json::json!({"pid": 7, "seq": 1, "jax_version": " 0.10.2 ",
            "xla_conf": "XLA_PYTHON_CLIENT_MEM_FRACTION=.5",
            "devices": [
                {"index": 0, "uuid": "GPU-a", "stats": {"reserved_bytes.all.current": 4}},
                {"index": 0, "uuid": "GPU-a", "allocator": "xla",
                 "stats": {"bytes_in_use": 3, "pool_bytes": 10, "largest_free_block_bytes": 6,
                           "num_allocs": 9, "num_ooms": 1}}]});
        let push = validate(body.to_string().as_bytes()).expect("one device, two allocators");
        assert_eq!(push.xla.0, "0.10.2", "trimmed as torch_version is");
        assert_eq!(push.xla.1, "XLA_PYTHON_CLIENT_MEM_FRACTION=.5");
        let (torch, xla) = (&push.devices[0], &push.devices[1]);
        assert_eq!(torch.xla, None);
        let reported = xla.xla.expect("xla's");
        assert!(reported.has_pool && !reported.has_peak_pool && reported.has_ooms);
        assert_eq!(xla.stats.reserved_bytes.all_current(), 10);
        assert_eq!(
            xla.snapshot,
            Some((6, Vec::new())),
            "its largest free block"
        );
        assert_eq!(push.ooms(), 1);
    }

    #[test]
    fn an_xla_device_is_refused_for_what_xla_does_not_send() {
        let device = |extra: serde_json::Value| {
            let mut d = serde_json::json!({"index": 0, "uuid": "GPU-a", "allocator": "xla",
                                           "stats": {"bytes_in_use": 3}});
            d.as_object_mut()
                .expect("object")
                .extend(extra.as_object().expect("object").clone());
            d
        };
        let body = |devices: Vec<serde_json::Value>| {
            serde_json::json!({"pid": 7, "seq": 1, "devices": devices})
                .to_string()
                .into_bytes()
        };
        for (devices, why) in [
            (
                vec![device(serde_json::json!({"largest_free_block": 1}))],
                "no snapshot",
            ),
            (
                vec![device(serde_json::json!({"allocator": "tensorflow"}))],
                "\"pytorch\" or \"xla\"",
            ),
            (
                vec![
                    device(serde_json::json!({})),
                    device(serde_json::json!({"index": 1})),
                ],
                "listed twice",
            ),
            (
                vec![device(
                    serde_json::json!({"stats": {"bytes_in_use": 3, "pool_bytes": 2}}),
                )],
                "exceeds pool_bytes",
            ),
            (
                vec![device(serde_json::json!({"stats": {"bytes_in_use": -1}}))],
                "negative",
            ),
            (
                vec![device(serde_json::json!({"unmapped_bytes": 0}))],
                "no unmapped_bytes",
            ),
            (
                vec![device(
                    serde_json::json!({"memory_limit": {"bytes": 1, "variable": "V"}}),
                )],
                "no memory_limit",
            ),
        ] {
            let r = refused(&body(devices));
            assert_eq!(r.refusal, Refusal::Invalid, "{why}");
            assert!(r.message.contains(why), "{why}: {}", r.message);
        }
        let long = "x".repeat(200);
        let r = refused(
            serde_json::json!({"pid": 7, "seq": 1, "jax_version": long,
                "devices": [device(serde_json::json!({}))]})
            .to_string()
            .as_bytes(),
        );
        assert!(r.message.contains("jax_version"), "{}", r.message);
    }

    /// A sharing layer's limit: its bytes within bounds, its variable a variable's name.
    #[test]
    fn a_memory_limit_is_a_variables_positive_figure() {
        let body = |limit: serde_json::Value| {
            serde_json::json!({"pid": 7, "seq": 1, "devices": [{"index": 0, "uuid": "GPU-a",
                "stats": {}, "memory_limit": limit}]})
            .to_string()
            .into_bytes()
        };
        let ok = validate(&body(
            serde_json::json!({"bytes": 10u64 << 30, "variable": "CUDA_DEVICE_MEMORY_LIMIT_0"}),
        ))
        .expect("valid");
        assert_eq!(
            ok.devices[0].memory_limit,
            Some(MemoryLimit {
                bytes: 10 << 30,
                variable: "CUDA_DEVICE_MEMORY_LIMIT_0".into()
            })
        );
        for (limit, why) in [
            (
                serde_json::json!({"bytes": 0, "variable": "V"}),
                "between 1 and 2^60",
            ),
            (
                serde_json::json!({"bytes": 1u64 << 60, "variable": "V"}),
                "between 1 and 2^60",
            ),
            (
                serde_json::json!({"bytes": 1, "variable": "cuda_limit"}),
                "not a variable's name",
            ),
            (
                serde_json::json!({"bytes": 1, "variable": ""}),
                "not a variable's name",
            ),
            (
                serde_json::json!({"bytes": 1, "variable": "V".repeat(65)}),
                "not a variable's name",
            ),
        ] {
            let r = refused(&body(limit));
            assert_eq!(r.refusal, Refusal::Invalid, "{why}");
            assert!(r.message.contains(why), "{why}: {}", r.message);
        }
        let extra = refused(&body(
            serde_json::json!({"bytes": 1, "variable": "V", "extra": 1}),
        ));
        assert_eq!(extra.refusal, Refusal::Malformed);
        assert!(extra.message.contains("unknown field"), "{}", extra.message);
    }

    /// A sleeping pool's unmapped bytes are part of the reserved bytes: at most all of them.
    #[test]
    fn unmapped_bytes_are_within_the_reserved() {
        let body = |unmapped: u64| {
            serde_json::json!({"pid": 7, "seq": 1, "devices": [{"index": 0, "uuid": "GPU-a",
                "stats": {"reserved_bytes.all.current": 40, "reserved_bytes.large_pool.current": 40},
                "unmapped_bytes": unmapped}]})
            .to_string()
            .into_bytes()
        };
        let push = validate(&body(40)).expect("all of it asleep");
        assert_eq!(push.devices[0].unmapped, 40);
        let r = refused(&body(41));
        assert_eq!(r.refusal, Refusal::Invalid);
        assert!(
            r.message
                .contains("unmapped_bytes 41 exceeds the 40 bytes reserved"),
            "{}",
            r.message
        );
    }
}
