//! Allocator statistics pushed by unmodified PyTorch jobs (`POST /api/v1/push`).
//!
//! [`payload`] is the wire schema and its validation (pure), [`oom`] the figures of an
//! out-of-memory push and their explanation, both within the budgets of [`limits`] and
//! refusing with [`refusal`]'s types (two leaves); [`store`] keeps the pushed processes,
//! bounded, and publishes them as allocator sources of kind `pytorch` for the one collector,
//! taking each push through its phases (validate, attribute, admit, budget, publish: one file
//! each, under [`config`]'s settings); [`recordings`] keeps the recordings its processes
//! upload at an OOM. HTTP (status codes, body limits, who may push) is the server's.

mod admission;
mod attribution;
mod budget;
pub mod config;
pub mod limits;
pub mod oom;
pub mod payload;
mod publish;
#[cfg(feature = "tools")]
pub mod recordings;
pub mod refusal;
pub mod store;

pub use config::IngestConfig;
pub use limits::MAX_BODY_BYTES;
pub use payload::Reason;
#[cfg(feature = "tools")]
pub use recordings::{RecordingLimits, RecordingStore};
pub use refusal::{Refusal, Rejected};
pub use store::{Peer, PushStore, Sender};

#[cfg(test)]
mod tests;
