//! What the allocator core needs from a GPU, and the GPUs that provide it.
//!
//! The [`Device`] trait is the whole contract between the caching allocator and the driver:
//! segment allocation (`cudaMalloc` / `cudaFree`), memory queries (`cudaMemGetInfo`), events
//! (create, record on a stream, query, synchronize) and, for expandable segments, the virtual
//! memory calls (reserve an address range, create physical pages, map, unmap, release).
//!
//! Implementations:
//! - [`SimDevice`]: a deterministic simulated GPU; the default, and what tests use.
//! - `CudaDevice` (feature `cuda`): a real GPU through the CUDA driver API.
//!
//! # Invariants
//! - An out-of-memory answer from the driver is [`DeviceError::OutOfMemory`] and nothing else,
//!   because the core treats it as recoverable (flush the cache and retry) and every other
//!   error as fatal for the request.
//! - Device memory is never dereferenced by anything in this crate: a [`DevicePtr`] is a number.

mod costs;
#[cfg(feature = "cuda")]
mod cuda;
mod sim;

pub use costs::{Call, CallCost, CostsError, DriverCosts, MAX_COST_NS, MAX_POINTS, Source};
#[cfg(feature = "cuda")]
pub use cuda::CudaDevice;
pub use sim::{SimConfig, SimDevice, SimStats, simulated_uuid};

use std::fmt;

/// A device address. `DevicePtr::NULL` is what a zero-byte allocation returns.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null device pointer.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// Whether this is the null pointer.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A stream, identified by its raw handle (`cudaStream_t` as an integer; 0 is the default
/// stream). Pools order free blocks by this number first, as PyTorch orders them by the
/// stream handle.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Debug,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
#[repr(transparent)]
pub struct StreamId(pub u64);

impl std::fmt::LowerHex for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl StreamId {
    /// The legacy default stream.
    pub const DEFAULT: StreamId = StreamId(0);
}

/// An event handle created by [`Device::create_event`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[repr(transparent)]
pub struct EventId(pub u64);

/// A physical memory handle created by [`Device::create_physical_page`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[repr(transparent)]
pub struct PhysicalHandle(pub u64);

/// Free and total device memory, as `cudaMemGetInfo` reports them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MemInfo {
    /// Bytes the driver could still hand out on this device (all processes counted).
    pub free: u64,
    /// Bytes of memory on the device.
    pub total: u64,
}

/// A driver failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The driver has no memory for the request (`cudaErrorMemoryAllocation`).
    #[error("the device is out of memory")]
    OutOfMemory,
    /// The device does not offer an operation (for example virtual memory management).
    #[error("the device does not support {0}")]
    Unsupported(&'static str),
    /// A handle or address the device does not know.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Any other driver error, with the driver's own words.
    #[error("driver error: {0}")]
    Driver(String),
}

/// What the caching allocator needs from a GPU.
///
/// Every method may fail; the core never panics on a device error. The virtual-memory methods
/// have default bodies that report [`DeviceError::Unsupported`], so a device without virtual
/// memory management implements only the first group.
pub trait Device {
    /// The device index (`cudaGetDevice`), used in messages and snapshots.
    fn index(&self) -> u32;

    /// Allocates a segment of `size` bytes (`cudaMalloc`). Implies a device-wide
    /// synchronisation on real GPUs.
    fn malloc(&mut self, size: u64) -> Result<DevicePtr, DeviceError>;

    /// Frees a segment obtained from [`Device::malloc`] (`cudaFree`).
    fn free(&mut self, ptr: DevicePtr) -> Result<(), DeviceError>;

    /// Free and total memory of the device (`cudaMemGetInfo`).
    fn mem_get_info(&mut self) -> Result<MemInfo, DeviceError>;

    /// Creates an event with timing disabled.
    fn create_event(&mut self) -> Result<EventId, DeviceError>;

    /// Records `event` on `stream`: it completes once all work queued on the stream so far has.
    fn record_event(&mut self, event: EventId, stream: StreamId) -> Result<(), DeviceError>;

    /// Whether `event` has completed (`cudaEventQuery`: `Ok(false)` means not ready).
    fn query_event(&mut self, event: EventId) -> Result<bool, DeviceError>;

    /// Blocks until `event` has completed.
    fn synchronize_event(&mut self, event: EventId) -> Result<(), DeviceError>;

    /// Destroys an event.
    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError>;

    /// Blocks until all work on every stream of the device has completed.
    fn synchronize(&mut self) -> Result<(), DeviceError>;

    /// Blocks until all work queued on `stream` has completed.
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError>;

    /// Microseconds since the Unix epoch as this device's clock reads them; trace entries carry
    /// it as `time_us`.
    fn time_us(&self) -> u64;

    /// Whether `stream` is being captured into a CUDA graph (`cuStreamIsCapturing`: active
    /// or invalidated). The core never asks: routing a capture's requests is its caller's
    /// business (Note [Private pools]); a caller that cannot route them asks, to refuse them.
    fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError>;

    /// The streams whose work completed since the last call, for a device on which work
    /// completes only when told (the simulated GPU): a poll of pending events then queries
    /// those streams alone. `None` where work completes by itself (a real GPU) or every
    /// stream may have progressed: every stream with pending events is polled. The call
    /// consumes the list: only the allocator that owns the device may make it (a caller
    /// holding the device for other reasons must not, or completed frees wait for the next
    /// poll of every stream).
    fn take_completed_streams(&mut self) -> Option<Vec<StreamId>> {
        None
    }

    /// `n` event queries were left out because [`Device::take_completed_streams`] showed
    /// they would find nothing new. A simulated device charges its clock for them all the
    /// same, so that its time stays what PyTorch's polling of every stream costs.
    fn skip_event_queries(&mut self, _n: usize) {}

    /// Whether the virtual-memory methods below work (the CUDA VMM API).
    fn supports_virtual_memory(&self) -> bool {
        false
    }

    /// The granularity of physical pages and mappings, in bytes.
    fn page_granularity(&self) -> Result<u64, DeviceError> {
        Err(DeviceError::Unsupported("virtual memory management"))
    }

    /// Reserves `size` bytes of address space (`cuMemAddressReserve`); no memory is used.
    fn reserve_address_range(&mut self, _size: u64) -> Result<DevicePtr, DeviceError> {
        Err(DeviceError::Unsupported("virtual memory management"))
    }

    /// Frees an address range from [`Device::reserve_address_range`] (`cuMemAddressFree`).
    fn free_address_range(&mut self, _ptr: DevicePtr, _size: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("virtual memory management"))
    }

    /// Creates a physical allocation of `size` bytes (`cuMemCreate`); it counts against the
    /// device's memory from now on.
    fn create_physical_page(&mut self, _size: u64) -> Result<PhysicalHandle, DeviceError> {
        Err(DeviceError::Unsupported("virtual memory management"))
    }

    /// Releases a physical allocation (`cuMemRelease`).
    fn release_physical_page(&mut self, _handle: PhysicalHandle) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("virtual memory management"))
    }

    /// Maps a physical allocation at `ptr` and grants read/write access (`cuMemMap` followed by
    /// `cuMemSetAccess`).
    fn map(
        &mut self,
        _ptr: DevicePtr,
        _size: u64,
        _handle: PhysicalHandle,
    ) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("virtual memory management"))
    }

    /// Unmaps `[ptr, ptr + size)` (`cuMemUnmap`).
    fn unmap(&mut self, _ptr: DevicePtr, _size: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("virtual memory management"))
    }

    /// Host memory the device's own bookkeeping holds, estimated in constant time: a
    /// simulated device's maps of pages, mappings and reservations grow with what it is asked
    /// to map (a replay's memory budget counts them); 0 for a real GPU, whose driver keeps
    /// its own.
    fn host_bytes(&self) -> usize {
        0
    }
}

/// A device lent to an allocator: the caller keeps it, and can look at it once the allocator
/// is dropped (tests do, to check that everything came back).
impl<D: Device + ?Sized> Device for &mut D {
    fn index(&self) -> u32 {
        (**self).index()
    }
    fn malloc(&mut self, size: u64) -> Result<DevicePtr, DeviceError> {
        (**self).malloc(size)
    }
    fn free(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        (**self).free(ptr)
    }
    fn mem_get_info(&mut self) -> Result<MemInfo, DeviceError> {
        (**self).mem_get_info()
    }
    fn create_event(&mut self) -> Result<EventId, DeviceError> {
        (**self).create_event()
    }
    fn record_event(&mut self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        (**self).record_event(event, stream)
    }
    fn query_event(&mut self, event: EventId) -> Result<bool, DeviceError> {
        (**self).query_event(event)
    }
    fn synchronize_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        (**self).synchronize_event(event)
    }
    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        (**self).destroy_event(event)
    }
    fn synchronize(&mut self) -> Result<(), DeviceError> {
        (**self).synchronize()
    }
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        (**self).synchronize_stream(stream)
    }
    fn time_us(&self) -> u64 {
        (**self).time_us()
    }
    fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        (**self).is_capturing(stream)
    }
    fn take_completed_streams(&mut self) -> Option<Vec<StreamId>> {
        (**self).take_completed_streams()
    }
    fn skip_event_queries(&mut self, n: usize) {
        (**self).skip_event_queries(n)
    }
    fn supports_virtual_memory(&self) -> bool {
        (**self).supports_virtual_memory()
    }
    fn page_granularity(&self) -> Result<u64, DeviceError> {
        (**self).page_granularity()
    }
    fn reserve_address_range(&mut self, size: u64) -> Result<DevicePtr, DeviceError> {
        (**self).reserve_address_range(size)
    }
    fn free_address_range(&mut self, ptr: DevicePtr, size: u64) -> Result<(), DeviceError> {
        (**self).free_address_range(ptr, size)
    }
    fn create_physical_page(&mut self, size: u64) -> Result<PhysicalHandle, DeviceError> {
        (**self).create_physical_page(size)
    }
    fn release_physical_page(&mut self, handle: PhysicalHandle) -> Result<(), DeviceError> {
        (**self).release_physical_page(handle)
    }
    fn map(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
    ) -> Result<(), DeviceError> {
        (**self).map(ptr, size, handle)
    }
    fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), DeviceError> {
        (**self).unmap(ptr, size)
    }
    fn host_bytes(&self) -> usize {
        (**self).host_bytes()
    }
}
