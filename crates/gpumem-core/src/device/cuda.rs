//! `CudaDevice`: the [`Device`] trait over the CUDA driver API (feature `cuda`), through
//! `cudarc`'s raw `sys`/`result` layers with the driver library loaded at run time: building
//! needs no CUDA toolkit, and a machine without a driver gets an error, never a panic.
//!
//! This is the crate's only `unsafe` code. The allocator owns every handle it receives (device
//! pointers, events, physical pages, address ranges) and gives each back exactly once, so
//! cudarc's owning wrappers, which free on drop, do not fit; raw handles are used instead.
//!
//! # Invariants
//! - Every driver call runs with the device's primary context current on the calling thread,
//!   and the thread's previous context is restored afterwards (`enter`), so the caller's
//!   current device (PyTorch's) never changes behind its back.
//! - No `sys` function is called unless the library was found (`is_culib_present`) and, for
//!   the virtual-memory calls, unless every symbol they need exists: cudarc panics on a missing
//!   symbol, so presence is checked first.

#![allow(unsafe_code)]

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::{Device, DeviceError, DevicePtr, EventId, MemInfo, PhysicalHandle, StreamId};

/// Symbols the virtual-memory methods use.
const VMM_SYMBOLS: [&str; 8] = [
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAllocationGranularity",
];

/// A CUDA GPU, through the driver API.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    device: sys::CUdevice,
    context: sys::CUcontext,
    virtual_memory: bool,
    granularity: u64,
}

// SAFETY: the handles are plain driver handles; the driver API is thread-safe, and every call
// makes the primary context current on the calling thread first.
unsafe impl Send for CudaDevice {}

fn driver_error(e: DriverError) -> DeviceError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return DeviceError::OutOfMemory;
    }
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    DeviceError::Driver(text)
}

fn check(status: sys::CUresult) -> Result<(), DeviceError> {
    status.result().map_err(driver_error)
}

fn has_symbol(name: &str) -> bool {
    // SAFETY: only called after `is_culib_present` returned true, so `culib` loads without
    // panicking; looking a symbol up does not call it.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` (its primary context).
    ///
    /// # Errors
    /// [`DeviceError::Driver`] saying the NVIDIA driver (libcuda) was not found, that no such
    /// GPU exists, or what the driver answered.
    pub fn new(ordinal: i32) -> Result<CudaDevice, DeviceError> {
        // SAFETY: `is_culib_present` only tries to dlopen the library; it never panics.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::Driver(
                "the NVIDIA driver was not found (libcuda.so could not be loaded)".into(),
            ));
        }
        result::init().map_err(driver_error)?;
        let count = result::device::get_count().map_err(driver_error)?;
        if ordinal < 0 || ordinal >= count {
            return Err(DeviceError::InvalidArgument(format!(
                "no CUDA device {ordinal}: the driver reports {count}"
            )));
        }
        let device = result::device::get(ordinal).map_err(driver_error)?;
        // SAFETY: `device` is a valid device handle from the driver; retaining its primary
        // context has no other precondition.
        let context = unsafe { result::primary_ctx::retain(device) }.map_err(driver_error)?;
        let mut cuda = CudaDevice {
            ordinal,
            device,
            context,
            virtual_memory: false,
            granularity: 2 << 20,
        };
        let context = cuda.enter()?;
        if VMM_SYMBOLS.iter().all(|s| has_symbol(s)) {
            let prop = cuda.allocation_prop();
            let mut granularity = 0usize;
            // SAFETY: both pointers point to live locals of the right types.
            let status = unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            };
            if check(status).is_ok() && granularity > 0 {
                cuda.virtual_memory = true;
                cuda.granularity = granularity as u64;
            }
        }
        drop(context);
        Ok(cuda)
    }

    /// The GPU's UUID in the `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` form NVML and DCGM use,
    /// so that the allocator's series join nvidia-smi's.
    ///
    /// # Errors
    /// What the driver answered.
    pub fn uuid(&self) -> Result<String, DeviceError> {
        let uuid = result::device::get_uuid(self.device).map_err(driver_error)?;
        let b: Vec<u8> = uuid.bytes.iter().map(|&c| c as u8).collect();
        let hex = |range: std::ops::Range<usize>| -> String {
            b[range].iter().map(|x| format!("{x:02x}")).collect()
        };
        Ok(format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        ))
    }

    /// Makes the primary context current on this thread until the guard drops, which puts
    /// the thread's previous context back.
    fn enter(&self) -> Result<ContextGuard, DeviceError> {
        let previous = result::ctx::get_current().map_err(driver_error)?;
        if previous == Some(self.context) {
            return Ok(ContextGuard { restore: None });
        }
        // SAFETY: the context was retained in `new` and is released only in `drop`.
        unsafe { result::ctx::set_current(self.context) }.map_err(driver_error)?;
        Ok(ContextGuard {
            restore: Some(previous.unwrap_or(std::ptr::null_mut())),
        })
    }

    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ordinal,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    fn event(event: EventId) -> sys::CUevent {
        event.0 as usize as sys::CUevent
    }

    fn stream(stream: StreamId) -> sys::CUstream {
        stream.0 as usize as sys::CUstream
    }
}

/// Restores a thread's previous CUDA context.
struct ContextGuard {
    restore: Option<sys::CUcontext>,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // SAFETY: `previous` was current on this thread a moment ago (or null, meaning
            // none); making it current again has no other precondition.
            let _ = unsafe { result::ctx::set_current(previous) };
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: `device`'s primary context was retained once in `new`.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

impl Device for CudaDevice {
    fn index(&self) -> u32 {
        self.ordinal as u32
    }

    fn malloc(&mut self, size: u64) -> Result<DevicePtr, DeviceError> {
        let _context = self.enter()?;
        // SAFETY: the context is current; the returned allocation is owned by the caller.
        let ptr = unsafe { result::malloc_sync(size as usize) }.map_err(driver_error)?;
        Ok(DevicePtr(ptr))
    }

    fn free(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `ptr` came from `malloc` on this device and is freed once (the allocator
        // releases a segment only when all its blocks are free).
        unsafe { result::free_sync(ptr.0) }.map_err(driver_error)
    }

    fn mem_get_info(&mut self) -> Result<MemInfo, DeviceError> {
        let _context = self.enter()?;
        let (free, total) = result::mem_get_info().map_err(driver_error)?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn create_event(&mut self) -> Result<EventId, DeviceError> {
        let _context = self.enter()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(driver_error)?;
        Ok(EventId(event as usize as u64))
    }

    fn record_event(&mut self, event: EventId, stream: StreamId) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: the event came from `create_event`; the stream handle is the caller's
        // (PyTorch's) live stream, as `record_stream` promised.
        unsafe { result::event::record(Self::event(event), Self::stream(stream)) }
            .map_err(driver_error)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, DeviceError> {
        let _context = self.enter()?;
        // SAFETY: the event came from `create_event` and has not been destroyed.
        match unsafe { result::event::query(Self::event(event)) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(driver_error(e)),
        }
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: as for `query_event`.
        unsafe { result::event::synchronize(Self::event(event)) }.map_err(driver_error)
    }

    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: the event came from `create_event` and is destroyed once.
        unsafe { result::event::destroy(Self::event(event)) }.map_err(driver_error)
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        result::ctx::synchronize().map_err(driver_error)
    }

    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: the stream handle is the caller's live stream.
        unsafe { result::stream::synchronize(Self::stream(stream)) }.map_err(driver_error)
    }

    fn time_us(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    }

    fn is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        let _context = self.enter()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream handle is the caller's (PyTorch's) live stream, as in
        // `record_event`; `status` is a valid place for the driver to write one enum value.
        check(unsafe { sys::cuStreamIsCapturing(Self::stream(stream), &mut status) })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn supports_virtual_memory(&self) -> bool {
        self.virtual_memory
    }

    fn page_granularity(&self) -> Result<u64, DeviceError> {
        if !self.virtual_memory {
            return Err(DeviceError::Unsupported("virtual memory management"));
        }
        Ok(self.granularity)
    }

    fn reserve_address_range(&mut self, size: u64) -> Result<DevicePtr, DeviceError> {
        self.page_granularity()?;
        let _context = self.enter()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the symbol exists (checked in `new`); `ptr` is a live local.
        check(unsafe { sys::cuMemAddressReserve(&mut ptr, size as usize, 0, 0, 0) })?;
        Ok(DevicePtr(ptr))
    }

    fn free_address_range(&mut self, ptr: DevicePtr, size: u64) -> Result<(), DeviceError> {
        self.page_granularity()?;
        let _context = self.enter()?;
        // SAFETY: the range came from `reserve_address_range` and holds no mappings any more.
        check(unsafe { sys::cuMemAddressFree(ptr.0, size as usize) })
    }

    fn create_physical_page(&mut self, size: u64) -> Result<PhysicalHandle, DeviceError> {
        self.page_granularity()?;
        let _context = self.enter()?;
        let prop = self.allocation_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the symbol exists; `handle` and `prop` are live locals.
        check(unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) })?;
        Ok(PhysicalHandle(handle))
    }

    fn release_physical_page(&mut self, handle: PhysicalHandle) -> Result<(), DeviceError> {
        self.page_granularity()?;
        let _context = self.enter()?;
        // SAFETY: the handle came from `create_physical_page` and is no longer mapped.
        check(unsafe { sys::cuMemRelease(handle.0) })
    }

    fn map(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
    ) -> Result<(), DeviceError> {
        self.page_granularity()?;
        let _context = self.enter()?;
        // SAFETY: `ptr..ptr+size` lies in a reserved range and is not mapped; the handle is a
        // live physical allocation of `size` bytes.
        check(unsafe { sys::cuMemMap(ptr.0, size as usize, 0, handle.0, 0) })?;
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ordinal,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range was just mapped; `access` is a live local describing one device.
        let granted = check(unsafe { sys::cuMemSetAccess(ptr.0, size as usize, &access, 1) });
        if let Err(e) = granted {
            // SAFETY: undoing the mapping made above.
            let _ = unsafe { sys::cuMemUnmap(ptr.0, size as usize) };
            return Err(e);
        }
        Ok(())
    }

    fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), DeviceError> {
        self.page_granularity()?;
        let _context = self.enter()?;
        // SAFETY: the range was mapped by `map` and no block in it is in use (the allocator
        // unmaps only whole free pages, after synchronising their stream).
        check(unsafe { sys::cuMemUnmap(ptr.0, size as usize) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_creation_fails_with_a_clear_message() {
        match CudaDevice::new(0) {
            Ok(device) => assert_eq!(device.index(), 0, "a GPU is present"),
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains("driver was not found")
                        || text.contains("no CUDA device")
                        || text.contains("CUDA"),
                    "{text}"
                );
            }
        }
    }
}
