//! Recordings: reading PyTorch memory snapshots. The analyses (`crate::replay`,
//! `crate::explain`, `crate::plan`) start from what this module reads and never reach into
//! how.
//!
//! A snapshot (`torch.cuda.memory._dump_snapshot`) holds the allocator's final `segments`
//! and, when history was recorded, each device's trace of events, each with its stack. It
//! arrives as a pickle or as the same schema in JSON, either optionally gzipped.
//! [`read_recording`] streams any of them once into a [`Recording`], stack frames interned
//! ([`Frames`]) and each event's pool inferred where the trace records none
//! ([`event_pools`]); [`state_summary`] describes the final state.
//!
//! # Invariants
//! - Reading never executes anything from the file. It streams the input through a fixed
//!   buffer, within [`ReadLimits`]: at most `max_input_bytes` of input (decompressed data
//!   included) and at most `max_memory_bytes` held while reading (see `pickle/mod.rs` for what
//!   counts), whatever the file says; time is linear in the decoded input.
//! - Every error names what was expected and where (byte offset, JSON line, or the path of
//!   the offending field).

mod doc;
pub mod event_pools;
pub mod frames;
mod input;
mod json;
mod memo;
mod pickle;
mod schema;
mod summary;

use std::io::Read;
use std::path::Path;

pub use crate::allocator::SimulatedDevice;
pub use frames::{Frame, FrameId, Frames, StackId, StringId};
pub use schema::{Annotation, Format, ProfilerStep, RecordedBlock, RecordedSegment, Recording};
pub use summary::state_summary;

/// The largest input accepted by default, compressed or not: real dumps with stacks reach
/// several GB (PyTorch's 100 000-entry ring buffer with C++ and Python frames).
pub const MAX_INPUT_BYTES: u64 = 16 << 30;

/// The most memory the reader may hold by default while reading.
pub const MAX_MEMORY_BYTES: u64 = 4 << 30;

/// What reading a recording may consume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadLimits {
    /// Bytes of input, decompressed data included.
    pub max_input_bytes: u64,
    /// Bytes held while reading: the decoded document, the pickle memo and stack.
    pub max_memory_bytes: u64,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            max_input_bytes: MAX_INPUT_BYTES,
            max_memory_bytes: MAX_MEMORY_BYTES,
        }
    }
}

/// What reading cost, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadCost {
    /// Decoded bytes read.
    pub input_bytes: u64,
    /// Work: opcodes (or JSON values) plus dict entries looked at.
    pub work: u64,
    /// The most bytes held while reading (the document, and a pickle's stack and memo), as
    /// accounted every 4 096 values and at the end.
    pub peak_bytes: u64,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The input (or its decompressed form) is larger than the input limit.
    #[error("the input exceeds {limit} bytes{}", if *.decompressed { " once decompressed" } else { "" })]
    TooLarge {
        /// The limit.
        limit: u64,
        /// Whether the limit was hit while decompressing.
        decompressed: bool,
    },
    /// Reading would hold more memory than the budget.
    #[error(
        "reading needs more than the memory budget of {limit} bytes (at byte {offset}); raise it with --max-memory-bytes if the machine has the memory"
    )]
    MemoryBudget {
        /// The budget.
        limit: u64,
        /// Decoded bytes read when it was crossed.
        offset: u64,
    },
    /// The gzip stream is corrupt.
    #[error("corrupt gzip data: {0}")]
    Gzip(String),
    /// The input is neither a pickle nor JSON.
    #[error(
        "not a PyTorch memory snapshot: expected a pickle (starting with 0x80) or JSON (starting with '{{' or '['), found {0}"
    )]
    UnknownFormat(String),
    /// The pickle is malformed or not plain data.
    #[error("pickle error at byte {offset}: {message}")]
    Pickle {
        /// Byte offset of the opcode at fault.
        offset: u64,
        /// What was wrong.
        message: String,
    },
    /// The JSON is malformed.
    #[error("JSON error: {0}")]
    Json(String),
    /// The document does not have the snapshot schema.
    #[error("at {path}: expected {expected}, found {found}")]
    Schema {
        /// Path of the offending field, such as `$.device_traces[0][15].size`.
        path: String,
        /// What the schema requires there.
        expected: String,
        /// What the file has.
        found: String,
    },
}

/// Reads a snapshot file (pickle or JSON, optionally gzipped) within the default limits.
///
/// # Errors
/// A [`TraceError`] saying what was expected and where.
pub fn read_recording(path: &Path) -> Result<Recording, TraceError> {
    read_recording_with(path, ReadLimits::default(), &mut |_| {})
}

/// Reads a snapshot file within `limits`, telling `progress` how many bytes of the file have
/// been read so far (about every MiB).
///
/// # Errors
/// A [`TraceError`] saying what was expected and where.
pub fn read_recording_with(
    path: &Path,
    limits: ReadLimits,
    progress: &mut dyn FnMut(u64),
) -> Result<Recording, TraceError> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    if size > limits.max_input_bytes {
        return Err(TraceError::TooLarge {
            limit: limits.max_input_bytes,
            decompressed: false,
        });
    }
    let counted = Counted {
        inner: file,
        read: 0,
        progress,
    };
    read_from(Box::new(counted), limits, Some(size)).0
}

/// Parses a snapshot from memory (pickle or JSON, optionally gzipped) within the default
/// limits.
///
/// # Errors
/// A [`TraceError`] saying what was expected and where.
pub fn parse_recording(bytes: &[u8]) -> Result<Recording, TraceError> {
    parse_recording_with(bytes, ReadLimits::default()).0
}

/// [`parse_recording`] with a smaller cap on the input and its decompressed form.
///
/// # Errors
/// A [`TraceError`] saying what was expected and where.
pub fn parse_recording_with_limit(bytes: &[u8], limit: u64) -> Result<Recording, TraceError> {
    let limits = ReadLimits {
        max_input_bytes: limit,
        ..ReadLimits::default()
    };
    parse_recording_with(bytes, limits).0
}

/// Parses a snapshot from memory within `limits`, saying what reading cost (also when it
/// failed).
pub fn parse_recording_with(
    bytes: &[u8],
    limits: ReadLimits,
) -> (Result<Recording, TraceError>, ReadCost) {
    if bytes.len() as u64 > limits.max_input_bytes {
        let err = TraceError::TooLarge {
            limit: limits.max_input_bytes,
            decompressed: false,
        };
        return (Err(err), ReadCost::default());
    }
    read_from(Box::new(bytes), limits, Some(bytes.len() as u64))
}

/// Streams a recording from `reader`.
fn read_from(
    reader: Box<dyn Read + '_>,
    limits: ReadLimits,
    size: Option<u64>,
) -> (Result<Recording, TraceError>, ReadCost) {
    let mut doc = doc::Doc::default();
    let mut cost = ReadCost::default();
    let decode_all = || {
        let mut input = input::Input::new(reader, limits.max_input_bytes, size)?;
        let decoded = decode(&mut input, &mut doc, limits.max_memory_bytes);
        cost.input_bytes = input.offset();
        decoded
    };
    let decoded = decode_all();
    cost.peak_bytes = doc.peak();
    let result = decoded.and_then(|()| schema::recording(&mut doc));
    cost.work = doc.work();
    (result, cost)
}

/// Decodes whichever format the input is.
fn decode(
    input: &mut input::Input<'_>,
    doc: &mut doc::Doc,
    max_memory: u64,
) -> Result<(), TraceError> {
    let mut skipped = 0u64;
    loop {
        match input.peek()? {
            // A pickle starts with its PROTO opcode; only JSON may start with whitespace.
            Some(0x80) if skipped == 0 => return pickle::decode(input, doc, max_memory),
            Some(b'{' | b'[') => return json::decode(input, doc, max_memory),
            Some(b) if b.is_ascii_whitespace() => {
                input.byte()?;
                skipped += 1;
            }
            Some(b) => {
                return Err(TraceError::UnknownFormat(format!(
                    "byte {b:#04x} after {skipped} bytes of whitespace"
                )));
            }
            None => return Err(TraceError::UnknownFormat("an empty input".into())),
        }
    }
}

/// A reader that reports how much it has read.
struct Counted<'p, R> {
    inner: R,
    read: u64,
    progress: &'p mut dyn FnMut(u64),
}

impl<R: Read> Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let before = self.read;
        self.read += n as u64;
        if before >> 20 != self.read >> 20 || n == 0 {
            (self.progress)(self.read);
        }
        Ok(n)
    }
}
