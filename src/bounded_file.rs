//! A file read whole within a byte budget: the files the agent and the tools are pointed at
//! (the web configuration, plan and cost files, the node's CDI specs) cost at most their
//! budget to read, however large (or endless) the file is.

use std::io::Read;
use std::path::Path;

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// It could not be opened or read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// It holds more than the budget (bytes).
    #[error("larger than {0} bytes")]
    TooLarge(u64),
}

/// The text of the file at `path`, if it holds at most `limit` bytes (one byte more is read
/// to tell).
///
/// # Errors
/// [`ReadError::Io`], or [`ReadError::TooLarge`] past `limit`.
pub fn read(path: &Path, limit: u64) -> Result<String, ReadError> {
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(ReadError::TooLarge(limit));
    }
    Ok(text)
}
