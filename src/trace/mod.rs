//! Recorded allocator traces: reading PyTorch memory snapshots and replaying them.
//!
//! A snapshot (`torch.cuda.memory._dump_snapshot`) holds the allocator's final `segments`
//! and, when history was recorded, each device's trace of events. It arrives as a pickle or
//! as the same schema in JSON, either optionally gzipped. [`read_recording`] turns any of
//! them into a [`Recording`]; [`replay()`] runs a device's trace through the allocator core.
//!
//! # Invariants
//! - Reading never executes anything from the file and never allocates more than the
//!   (bounded) input size justifies: inputs, decompressed data included, are capped at
//!   [`MAX_INPUT_BYTES`].
//! - Every error names what was expected and where (byte offset, JSON line, or the path of
//!   the offending field).

mod doc;
mod pickle;
pub mod plot;
pub mod replay;
mod schema;
pub mod start_state;
mod summary;

use std::io::Read;
use std::path::Path;

pub use crate::allocator::SimulatedDevice;
pub use replay::{
    Divergence, Readings, ReplayError, ReplayOptions, ReplayReport, replay, replay_following,
    replay_with_progress,
};
pub use schema::{Format, RecordedBlock, RecordedSegment, Recording};
pub use summary::state_summary;

/// The largest input accepted, compressed or not: far above any real snapshot (the largest
/// known is a few MiB), far below what would exhaust a machine.
pub const MAX_INPUT_BYTES: u64 = 1 << 30;

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
    /// The input (or its decompressed form) is larger than [`MAX_INPUT_BYTES`].
    #[error("the input exceeds {limit} bytes{}", if *.decompressed { " once decompressed" } else { "" })]
    TooLarge {
        /// The limit.
        limit: u64,
        /// Whether the limit was hit while decompressing.
        decompressed: bool,
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
        offset: usize,
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

/// Reads a snapshot file: pickle or JSON, optionally gzipped.
///
/// # Errors
/// A [`TraceError`] saying what was expected and where.
pub fn read_recording(path: &Path) -> Result<Recording, TraceError> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(MAX_INPUT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    parse_recording(&bytes)
}

/// Parses a snapshot from memory: pickle or JSON, optionally gzipped.
///
/// # Errors
/// A [`TraceError`] saying what was expected and where.
pub fn parse_recording(bytes: &[u8]) -> Result<Recording, TraceError> {
    parse_recording_with_limit(bytes, MAX_INPUT_BYTES)
}

/// [`parse_recording`] with a smaller cap on the input and its decompressed form.
///
/// # Errors
/// A [`TraceError`] saying what was expected and where.
pub fn parse_recording_with_limit(bytes: &[u8], limit: u64) -> Result<Recording, TraceError> {
    if bytes.len() as u64 > limit {
        return Err(TraceError::TooLarge {
            limit,
            decompressed: false,
        });
    }
    let inflated;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        inflated = gunzip(bytes, limit)?;
        &inflated[..]
    } else {
        bytes
    };
    let doc = match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        // A pickle starts with its PROTO opcode; only JSON may start with whitespace.
        Some(0x80) if bytes[0] == 0x80 => pickle::decode(bytes)?,
        Some(b'{' | b'[') => {
            let json: serde_json::Value =
                serde_json::from_slice(bytes).map_err(|e| TraceError::Json(e.to_string()))?;
            doc::Doc::from_json(&json)
        }
        Some(b) => {
            return Err(TraceError::UnknownFormat(format!(
                "byte {b:#04x} after {} bytes of whitespace",
                bytes.iter().take_while(|b| b.is_ascii_whitespace()).count()
            )));
        }
        None => return Err(TraceError::UnknownFormat("an empty input".into())),
    };
    schema::recording(&doc)
}

/// Decompresses gzip data, refusing to produce more than `limit` bytes.
fn gunzip(bytes: &[u8], limit: u64) -> Result<Vec<u8>, TraceError> {
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes)
        .take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| TraceError::Gzip(e.to_string()))?;
    if out.len() as u64 > limit {
        return Err(TraceError::TooLarge {
            limit,
            decompressed: true,
        });
    }
    Ok(out)
}
