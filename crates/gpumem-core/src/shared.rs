//! `SharedAllocator`: the caching allocator made safe to call from many threads.
//!
//! The core takes `&mut self`; this wrapper adds exactly one mutex per device around it, as
//! PyTorch holds one mutex per device allocator. Statistics do not need the mutex: the
//! [`DeviceStats`] behind [`SharedAllocator::stats`] are published atomics, so a metrics
//! scrape never waits for (or delays) an allocation.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::allocator::{AllocError, CachingAllocator, DeviceStats};
use crate::device::{Device, DevicePtr, StreamId};

/// A [`CachingAllocator`] behind one mutex, with lock-free statistics.
#[derive(Debug)]
pub struct SharedAllocator<D: Device> {
    inner: Mutex<CachingAllocator<D>>,
    stats: Arc<DeviceStats>,
}

impl<D: Device> SharedAllocator<D> {
    /// Wraps an allocator.
    pub fn new(allocator: CachingAllocator<D>) -> Self {
        let stats = Arc::clone(allocator.stats());
        SharedAllocator {
            inner: Mutex::new(allocator),
            stats,
        }
    }

    fn lock(&self) -> MutexGuard<'_, CachingAllocator<D>> {
        // A panic inside the lock (a defect: the core does not panic on input) poisons it;
        // the state is still served, and callers that must not trust it check `is_poisoned`.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a panic happened while the allocator was locked: its state may be half
    /// updated, and a careful caller stops using it.
    pub fn is_poisoned(&self) -> bool {
        self.inner.is_poisoned()
    }

    /// See [`CachingAllocator::malloc`].
    ///
    /// # Errors
    /// As [`CachingAllocator::malloc`].
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        self.lock().malloc(size, stream)
    }

    /// See [`CachingAllocator::free`].
    ///
    /// # Errors
    /// As [`CachingAllocator::free`].
    pub fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.lock().free(ptr)
    }

    /// See [`CachingAllocator::record_stream`].
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) {
        self.lock().record_stream(ptr, stream);
    }

    /// See [`CachingAllocator::empty_cache`].
    ///
    /// # Errors
    /// As [`CachingAllocator::empty_cache`].
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        self.lock().empty_cache()
    }

    /// The statistics, readable without the lock.
    pub fn stats(&self) -> &Arc<DeviceStats> {
        &self.stats
    }

    /// Runs `f` with the allocator locked, for everything else (snapshots, settings).
    pub fn with<R>(&self, f: impl FnOnce(&mut CachingAllocator<D>) -> R) -> R {
        f(&mut self.lock())
    }

    /// Runs `f` with the allocator if no other thread holds it now; `None` otherwise. For
    /// observers (a metrics refresher) that must never make an allocation wait.
    pub fn try_with<R>(&self, f: impl FnOnce(&mut CachingAllocator<D>) -> R) -> Option<R> {
        match self.inner.try_lock() {
            Ok(mut guard) => Some(f(&mut guard)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(f(&mut p.into_inner())),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The allocator, unwrapped.
    pub fn into_inner(self) -> CachingAllocator<D> {
        self.inner
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
