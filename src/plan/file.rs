//! The plan file (`gpumem plan -o`, `plan:PATH`): its envelope (format, version, where the
//! plan came from) and its JSON schema for the core's plan (which knows no file format), read
//! within [`MAX_PLAN_FILE_BYTES`] and validated.
//!
//! The schema: a region is `{"stream", "bytes"}`; an entry `{"size", "stream"}` with
//! `"offset"` where it has one and `"persistent": true` where it is; the envelope's
//! `"saved_bytes"` is optional; unknown fields are refused, in the envelope and in every
//! region and entry.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::allocator::{Plan, PlanEntry, PlanError, PlanMode, PlanRegion};
use crate::device::StreamId;

/// The schema of a region (serde's derive for the core's type).
#[derive(Serialize, Deserialize)]
#[serde(remote = "PlanRegion", deny_unknown_fields)]
struct RegionSchema {
    stream: StreamId,
    bytes: u64,
}

/// The schema of an entry.
#[derive(Serialize, Deserialize)]
#[serde(remote = "PlanEntry", deny_unknown_fields)]
struct EntrySchema {
    size: u64,
    stream: StreamId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    offset: Option<u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    persistent: bool,
}

/// The schema of the mode: `"whole"` (the default where absent) or `"paged"`.
#[derive(Serialize, Deserialize)]
#[serde(remote = "PlanMode", rename_all = "snake_case")]
enum ModeSchema {
    Whole,
    Paged,
}

/// A region as an element of the file's list.
#[derive(Serialize, Deserialize)]
struct Region(#[serde(with = "RegionSchema")] PlanRegion);

/// An entry as an element of the file's list.
#[derive(Serialize, Deserialize)]
struct Entry(#[serde(with = "EntrySchema")] PlanEntry);

impl From<PlanRegion> for Region {
    fn from(region: PlanRegion) -> Region {
        Region(region)
    }
}

impl From<PlanEntry> for Entry {
    fn from(entry: PlanEntry) -> Entry {
        Entry(entry)
    }
}

/// `items` written as a list of their schema `W`.
fn serialize_as<W, T, S>(items: &[T], serializer: S) -> Result<S::Ok, S::Error>
where
    W: Serialize + From<T>,
    T: Copy,
    S: Serializer,
{
    serializer.collect_seq(items.iter().map(|&item| W::from(item)))
}

/// A list read through its elements' schema `W`.
fn deserialize_as<'de, W, T, D>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    W: Deserialize<'de> + Into<T>,
    D: Deserializer<'de>,
{
    let items = Vec::<W>::deserialize(deserializer)?;
    Ok(items.into_iter().map(Into::into).collect())
}

impl From<Region> for PlanRegion {
    fn from(region: Region) -> PlanRegion {
        region.0
    }
}

impl From<Entry> for PlanEntry {
    fn from(entry: Entry) -> PlanEntry {
        entry.0
    }
}

/// `plan` as its file writes it (its regions, then its entries): `gpumem plan --json`'s
/// `plan`.
#[cfg(feature = "tools")]
pub(super) fn serialize_plan<S: Serializer>(plan: &Plan, serializer: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Body<'a> {
        #[serde(serialize_with = "serialize_as::<Region, _, _>")]
        regions: &'a [PlanRegion],
        #[serde(serialize_with = "serialize_as::<Entry, _, _>")]
        entries: &'a [PlanEntry],
        #[serde(with = "ModeSchema")]
        mode: PlanMode,
        #[serde(skip_serializing_if = "Option::is_none")]
        saved_bytes: Option<u64>,
    }
    Body {
        regions: &plan.regions,
        entries: &plan.entries,
        mode: plan.mode,
        saved_bytes: plan.saved_bytes,
    }
    .serialize(serializer)
}

/// The largest plan file read.
pub const MAX_PLAN_FILE_BYTES: u64 = 256 << 20;

/// The plan file's `format` field.
pub const PLAN_FORMAT: &str = "gpumem-plan";
/// The plan file's version this build reads and writes.
pub const PLAN_VERSION: u32 = 1;

/// A plan file (`gpumem plan -o`, `plan:PATH`): the [`Plan`] the allocator follows, with its
/// format, version and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    /// Always [`PLAN_FORMAT`].
    pub format: String,
    /// Always [`PLAN_VERSION`].
    pub version: u32,
    /// One region per stream.
    #[serde(
        serialize_with = "serialize_as::<Region, _, _>",
        deserialize_with = "deserialize_as::<Region, _, _>"
    )]
    pub regions: Vec<PlanRegion>,
    /// The iteration's allocations in order.
    #[serde(
        serialize_with = "serialize_as::<Entry, _, _>",
        deserialize_with = "deserialize_as::<Entry, _, _>"
    )]
    pub entries: Vec<PlanEntry>,
    /// How the regions and chunks hold memory (absent: whole segments).
    #[serde(with = "ModeSchema", default)]
    pub mode: PlanMode,
    /// Bytes the plan held less than the caching allocator where it was evaluated (absent:
    /// not known, and the caching allocator serves misses in its own segment sizes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_bytes: Option<u64>,
    /// Where the plan came from and what the planner found (informative only).
    #[serde(default)]
    pub source: Option<PlanSource>,
}

impl PlanFile {
    /// The file of `plan`, made from `source`.
    pub fn new(plan: &Plan, source: Option<PlanSource>) -> PlanFile {
        PlanFile {
            format: PLAN_FORMAT.to_string(),
            version: PLAN_VERSION,
            regions: plan.regions.clone(),
            entries: plan.entries.clone(),
            mode: plan.mode,
            saved_bytes: plan.saved_bytes,
            source,
        }
    }

    /// The plan the allocator follows.
    pub fn plan(&self) -> Plan {
        Plan {
            regions: self.regions.clone(),
            entries: self.entries.clone(),
            mode: self.mode,
            saved_bytes: self.saved_bytes,
        }
    }
}

/// What the planner found (informative: the allocator does not read it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanSource {
    /// The recording's file name.
    pub recording: String,
    /// The device whose trace was planned.
    pub device: u32,
    /// Index (among the trace's allocations) of the planned iteration's first allocation.
    pub first_allocation: usize,
    /// Allocations per iteration.
    pub period: usize,
    /// Iterations found in a row, the planned one included.
    pub iterations: usize,
    /// Trace events of the planned iteration: `[first, end)`.
    pub events: [usize; 2],
    /// Trace events the plan is evaluated on (the iterations after it): `[first, end)`.
    pub evaluated: [usize; 2],
    /// The most bytes the planned allocations hold at once: no placement needs less.
    pub lower_bound_bytes: u64,
    /// Bytes of the persistent allocations (they outlive an iteration: placed in chunks, some
    /// tried at an offset first).
    pub persistent_bytes: u64,
}

/// Why a plan file's text is not a plan to follow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanFormatError {
    /// Not JSON of the plan file's shape.
    #[error("not a gpumem plan: {0}")]
    Malformed(String),
    /// Another format or version.
    #[error(
        "a plan of format {format:?} version {version}; this build reads {PLAN_FORMAT:?} version {PLAN_VERSION}"
    )]
    Version {
        /// The file's format field.
        format: String,
        /// The file's version field.
        version: u32,
    },
    /// A `source` that contradicts itself (a window that ends before it starts).
    #[error("the plan's source: {0}")]
    Source(String),
    /// A plan the allocator cannot follow.
    #[error(transparent)]
    Invalid(#[from] PlanError),
}

/// Why a plan file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    /// It cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is larger than [`MAX_PLAN_FILE_BYTES`].
    #[error("{path}: larger than {MAX_PLAN_FILE_BYTES} bytes, not a plan")]
    TooLarge {
        /// The file.
        path: String,
    },
    /// It is not a valid plan.
    #[error("{path}: {source}")]
    Invalid {
        /// The file.
        path: String,
        /// Why.
        source: PlanFormatError,
    },
}

/// Reads and validates a plan file (at most [`MAX_PLAN_FILE_BYTES`]).
///
/// # Errors
/// A [`PlanFileError`] naming the file.
pub fn read_plan_file(path: &std::path::Path) -> Result<PlanFile, PlanFileError> {
    use crate::bounded_file::{ReadError, read};
    let name = path.display().to_string();
    let text = read(path, MAX_PLAN_FILE_BYTES).map_err(|e| match e {
        ReadError::Io(source) => PlanFileError::Io {
            path: name.clone(),
            source,
        },
        ReadError::TooLarge(_) => PlanFileError::TooLarge { path: name.clone() },
    })?;
    parse_plan(&text).map_err(|source| PlanFileError::Invalid { path: name, source })
}

/// Reads a plan file's JSON text, its plan validated ([`Plan::validate`]).
///
/// # Errors
/// A [`PlanFormatError`] saying what is wrong.
pub fn parse_plan(text: &str) -> Result<PlanFile, PlanFormatError> {
    let file: PlanFile =
        serde_json::from_str(text).map_err(|e| PlanFormatError::Malformed(e.to_string()))?;
    if file.format != PLAN_FORMAT || file.version != PLAN_VERSION {
        return Err(PlanFormatError::Version {
            format: file.format,
            version: file.version,
        });
    }
    if let Some(s) = &file.source {
        for (name, [from, to]) in [("events", s.events), ("evaluated", s.evaluated)] {
            if from > to {
                return Err(PlanFormatError::Source(format!(
                    "{name} [{from}, {to}] is reversed"
                )));
            }
        }
    }
    file.plan().validate()?;
    Ok(file)
}
