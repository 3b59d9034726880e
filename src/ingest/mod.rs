//! Allocator statistics pushed by unmodified PyTorch and JAX jobs (`POST /api/v1/push`).
//!
//! [`payload`] is the wire schema and its validation (pure), [`xla`] a JAX job's devices in
//! the contract's terms, [`oom`] the figures of an out-of-memory push and their
//! explanation, all within the budgets of [`limits`] and refusing with [`refusal`]'s types
//! (two leaves); [`store`] keeps the pushed processes, bounded, and publishes them as
//! allocator sources of kind `pytorch` or `xla` for the one collector, taking each push
//! through its phases (validate, attribute, admit, budget, publish: one file each, under
//! [`config`]'s settings); [`recordings`] keeps the recordings its processes upload at an
//! OOM. HTTP (status codes, body limits, who may push) is the server's.

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
pub mod xla;

pub use config::IngestConfig;
pub use limits::MAX_BODY_BYTES;
pub use payload::Reason;
#[cfg(feature = "tools")]
pub use recordings::{RecordingLimits, RecordingStore};
pub use refusal::{Refusal, Rejected};
pub use store::{Peer, PushStore, Sender};

#[cfg(test)]
mod tests;
