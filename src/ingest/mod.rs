//! Allocator statistics pushed by unmodified PyTorch jobs (`POST /api/v1/push`).
//!
//! [`payload`] is the wire schema and its validation (pure), [`oom`] the figures of an
//! out-of-memory push and their explanation; [`store`] keeps the pushed
//! processes, bounded, and publishes them as allocator sources of kind `pytorch` for the one
//! collector. HTTP (status codes, body limits, who may push) is the server's.

pub mod oom;
pub mod payload;
pub mod store;

pub use payload::{MAX_BODY_BYTES, Reason, Refusal, Rejected};
pub use store::{IngestConfig, PushStore};

#[cfg(test)]
mod tests;
