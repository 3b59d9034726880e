//! gpumem's core: PyTorch's CUDA caching allocator ([`allocator::CachingAllocator`]),
//! decision for decision in the release that made a recording, over a device trait
//! ([`device::Device`]) with a deterministic simulated GPU ([`device::SimDevice`]) that every
//! test runs on.
//!
//! - [`config`]: `PYTORCH_CUDA_ALLOC_CONF` parsing, per PyTorch release.
//! - [`allocator`]: the caching allocator, its statistics, snapshots and traces.
//! - [`device`]: the device trait, the simulated GPU and (feature `cuda`) the driver.
//! - [`shared`]: the thread-safe wrapper with lock-free statistics.
//!
//! The crate is pure logic: no I/O but the device's, no async, no metrics, JSON, HTTP or
//! command-line library; `scripts/check-layers` (in the test command) checks its
//! dependencies, and `tests/it/layout.rs` that no two of its files depend on each other.
//! Readers of recordings, the node agent and the tools live in the `gpumem` crate.

pub mod allocator;
pub mod config;
pub mod device;
pub mod shared;

pub use allocator::{AllocError, CachingAllocator};
pub use config::AllocatorConfig;
pub use device::{Device, DevicePtr, SimDevice, StreamId};
pub use shared::SharedAllocator;
