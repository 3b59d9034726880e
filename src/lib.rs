//! gpumem makes GPU memory visible: where did the memory go when a training job dies with
//! "CUDA out of memory" while nvidia-smi still shows gigabytes free?
//!
//! Its foundation is a faithful implementation of PyTorch's CUDA caching allocator
//! ([`allocator::CachingAllocator`]) over a device trait ([`device::Device`]), with a
//! deterministic simulated GPU ([`device::SimDevice`]) that every test runs on.
//!
//! - [`config`]: `PYTORCH_CUDA_ALLOC_CONF` parsing.
//! - [`allocator`]: the caching allocator core, its statistics, snapshots and traces.
//! - [`device`]: the device trait and the simulated GPU.
//! - [`shared`]: the thread-safe wrapper with lock-free statistics.
//! - [`trace`]: reading PyTorch memory snapshots and replaying their traces.
//! - [`telemetry`]: where the node view comes from (NVML, or a simulated node).
//! - [`metrics`]: the metric contract and the collector that reads sources at scrape time.
//! - [`ingest`]: statistics pushed by unmodified PyTorch jobs.
//! - [`server`]: the `/metrics` endpoint and `gpumem view`'s (axum).
//! - [`view`]: pages and drawings: the explanation's page, the timeline, `gpumem view`'s
//!   segment maps and state.
//! - [`workload`]: a synthetic training workload that exercises the core.

pub mod allocator;
pub mod config;
pub mod device;
pub mod ingest;
pub mod ipc;
pub mod metrics;
pub mod ops;
pub mod server;
pub mod shared;
pub mod sources;
pub mod telemetry;
pub mod trace;
pub mod view;
pub mod workload;

pub use allocator::{AllocError, CachingAllocator};
pub use config::AllocatorConfig;
pub use device::{Device, DevicePtr, SimDevice, StreamId};
pub use shared::SharedAllocator;
