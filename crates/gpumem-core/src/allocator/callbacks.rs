//! Free-memory callbacks: memory held outside the allocator's caches that can be handed
//! back when a request finds no cached block (PyTorch's `FreeMemoryCallback` registry,
//! whose one user is `cuda_ipc_collect`: blocks kept alive for other processes until they
//! let go of them).
//!
//! A callback does not free anything itself: it returns the pointers it lets go of and the
//! core frees them after it returns. PyTorch's callback frees re-entrantly under a recursive
//! mutex; the core's `&mut self` and the shared wrapper's one mutex cannot take a free in
//! the middle of a malloc, and need not.
//!
//! # Invariants
//! - Callbacks run only on the slow path (no cached block fitted), in registration order,
//!   each once per request; the pool is searched again only if one of them gave memory back.
//! - A pointer a callback returns is freed as `free` would free it (events for its recorded
//!   streams included); one the allocator does not hold fails the request with
//!   [`AllocError::InvalidPointer`] after every other pointer was freed.

use std::fmt;
use std::sync::Arc;

use crate::device::{Device, DevicePtr, StreamId};

use super::block::BlockId;
use super::pool_id::PoolRef;
use super::{AllocError, CachingAllocator};

/// Something that holds allocations it can give back under memory pressure.
pub trait FreeMemoryCallback: Send + Sync {
    /// The pointers (from this allocator's `malloc`) it lets go of now; empty when none.
    fn release(&self) -> Vec<DevicePtr>;
}

/// The registered callbacks, in registration order.
#[derive(Clone, Default)]
pub(crate) struct Callbacks(Vec<Arc<dyn FreeMemoryCallback>>);

impl fmt::Debug for Callbacks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Callbacks({})", self.0.len())
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Registers a callback that the retry chain asks for memory before it obtains a new
    /// segment (Note [OOM retry chain]).
    pub fn register_free_memory_callback(&mut self, callback: Arc<dyn FreeMemoryCallback>) {
        self.callbacks.0.push(callback);
    }

    /// Step 2 of the retry chain: runs the callbacks, frees what they let go of, and, if
    /// any did, searches the pool again (`trigger_free_memory_callbacks` then
    /// `get_free_block`).
    pub(super) fn free_memory_then_search(
        &mut self,
        kind: PoolRef,
        stream: StreamId,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if self.callbacks.0.is_empty() {
            return Ok(None);
        }
        let callbacks = self.callbacks.clone();
        let (mut freed, mut first_error) = (false, None);
        for ptr in callbacks.0.iter().flat_map(|c| c.release()) {
            match self.free_unchecked(ptr) {
                Ok(()) => freed = true,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(freed
            .then(|| self.get_free_block(kind, stream, rounded))
            .flatten())
    }
}
