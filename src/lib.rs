//! gpumem makes GPU memory visible: where did the memory go when a training job dies with
//! "CUDA out of memory" while nvidia-smi still shows gigabytes free?
//!
//! Its foundation is the `gpumem-core` crate, re-exported here: a faithful implementation of
//! PyTorch's CUDA caching allocator ([`allocator::CachingAllocator`]) over a device trait
//! ([`device::Device`]), with a deterministic simulated GPU ([`device::SimDevice`]) that every
//! test runs on, `PYTORCH_CUDA_ALLOC_CONF` parsing ([`config`]) and the thread-safe wrapper
//! ([`shared`]). This crate holds what reads, serves and explains:
//!
//! - [`recording`]: reading PyTorch memory snapshots (pickle or JSON, gzipped or not) into a
//!   [`recording::Recording`], within stated limits.
//! - [`replay`]: a recording's trace run through the core, exactly or under other settings.
//! - [`explain`]: why an allocation failed (or what held memory at any moment).
//! - [`plan`]: placement plans made from a recording's repeating iteration, and evaluated.
//! - [`telemetry`]: where the node view comes from (NVML, or a simulated node).
//! - [`metrics`]: the metric contract and the collector that reads sources at scrape time.
//! - [`ingest`]: statistics pushed by unmodified PyTorch jobs.
//! - [`server`]: the `/metrics` endpoint and `gpumem view`'s (axum), the HTTP shell.
//! - [`agent`]: the node agent composed once (metrics, ingest, loops, listeners), for
//!   `gpumem serve`, `gpumem demo`, gpumem-torch's endpoint and the tests.
//! - [`view`]: pages and drawings: the explanation's page, the timeline, `gpumem view`'s
//!   segment maps and state.
//! - [`demo`]: the simulated node (`gpumem demo`) and the synthetic training workload.
//! - [`rng`]: the small deterministic generator runs repeat with.

pub use gpumem_core::{allocator, config, device, shared};

pub mod agent;
#[cfg(feature = "archive")]
pub mod archive;
pub mod bounded_file;
#[cfg(feature = "tools")]
pub mod demo;
#[cfg(feature = "tools")]
pub mod diff;
#[cfg(feature = "tools")]
pub mod explain;
pub mod ingest;
#[cfg(feature = "webhook")]
pub mod inject;
pub mod ipc;
pub mod iterations;
pub mod metrics;
pub mod ops;
pub mod plan;
#[cfg(feature = "tools")]
pub mod recording;
#[cfg(feature = "tools")]
pub mod replay;
pub mod rng;
pub mod server;
pub mod sources;
pub mod telemetry;
pub mod view;

pub use allocator::{AllocError, CachingAllocator};
pub use config::AllocatorConfig;
pub use device::{Device, DevicePtr, SimDevice, StreamId};
pub use shared::SharedAllocator;
