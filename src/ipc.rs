//! The producer's side of sharing device memory with other processes (PyTorch's
//! `CudaIPCSentData`, its shared reference counters and `CudaIPCSentDataLimbo`), outside the
//! allocator as in PyTorch.
//!
//! A producer that sends a block keeps it allocated until every consumer has let go of it.
//! Each sent block has a reference counter (a slot of a shared-memory file in PyTorch):
//! sending adds one, and a consumer's [`Received`] takes its one away when dropped. When the
//! producer's own storage dies while consumers still hold the block, the block goes to the
//! *limbo* instead of back to the allocator: it stays allocated (a snapshot shows it as
//! `active_allocated`, nothing marks it shared) until a collection finds its counter at zero.
//! Collections run where PyTorch runs them: on every release of a sent block
//! ([`IpcSender::release_storage`]), on request ([`IpcSender::collect`], `torch.cuda.ipc_collect`)
//! and inside the allocator's retry chain, as the free-memory callback `cuda_ipc_collect`
//! (register the sender with [`crate::allocator::CachingAllocator::register_free_memory_callback`]).
//!
//! The sender never frees anything itself: it returns the pointers to free, and its caller
//! (or, for the callback, the allocator) frees them.
//!
//! Not modelled: the interprocess event a producer records on send (a consumer waits on it
//! before reading), and what a consumer maps (see [`ShareableHandle::mapped_bytes`]; it is
//! not in the consumer's allocator, only in the device's use).
//!
//! # Invariants and budget
//! - A sent pointer is tracked from its first send until it is returned to be freed, in
//!   exactly one of two places: held by the producer, or in the limbo (a send or a release
//!   of a pointer already in the limbo adds no second entry).
//! - A pointer is returned to be freed once, and only when the producer released it and its
//!   counter is zero.
//! - The state holds one entry per sent pointer still allocated: it is bounded by the
//!   allocator's live blocks. A collection walks the limbo once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rustc_hash::FxHashMap;

use crate::allocator::{FreeMemoryCallback, ShareableHandle};
use crate::device::DevicePtr;

/// PyTorch warns once the limbo holds this many blocks (`CUDA_IPC_WARN_AFTER_X_BLOCKS_IN_LIMBO`).
pub const LIMBO_WARN_AFTER: usize = 1000;

/// The consumers' references to one sent block.
type Counter = Arc<AtomicU64>;

/// The blocks a producer sent and the limbo of those it let go while consumers hold them.
#[derive(Debug, Default)]
pub struct IpcSender {
    state: Mutex<SenderState>,
}

#[derive(Debug, Default)]
struct SenderState {
    /// Sent blocks the producer still holds, by address.
    held: FxHashMap<u64, Counter>,
    /// Sent blocks the producer let go of while a consumer held them.
    limbo: Vec<(DevicePtr, Counter)>,
}

/// A consumer's reference to a sent block: dropping it lets go of the block.
#[derive(Debug)]
pub struct Received {
    handle: ShareableHandle,
    counter: Counter,
}

impl Received {
    /// What the consumer opened.
    pub fn handle(&self) -> ShareableHandle {
        self.handle
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::AcqRel);
    }
}

impl IpcSender {
    /// A sender with nothing sent.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, SenderState> {
        // The state stays consistent at every step, so a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends the block at `ptr`, exported as `handle` (from
    /// [`crate::allocator::CachingAllocator::share_handle`]), to one consumer. A block already
    /// in the limbo (a consumer passing it on) keeps its one entry there, one reference more.
    pub fn send(&self, ptr: DevicePtr, handle: ShareableHandle) -> Received {
        let mut state = self.state();
        let in_limbo = state
            .limbo
            .iter()
            .find(|(p, _)| *p == ptr)
            .map(|(_, c)| Arc::clone(c));
        let counter = in_limbo.unwrap_or_else(|| Arc::clone(state.held.entry(ptr.0).or_default()));
        counter.fetch_add(1, Ordering::AcqRel);
        Received { handle, counter }
    }

    /// The producer's storage of `ptr` dies (`CudaIPCSentDataDelete`): returns what to free
    /// now. That is `ptr` itself unless a consumer holds it (then it waits in the limbo), and
    /// every limbo entry let go of since the last collection. A pointer never sent is
    /// returned as it is.
    pub fn release_storage(&self, ptr: DevicePtr) -> Vec<DevicePtr> {
        let mut state = self.state();
        let Some(counter) = state.held.remove(&ptr.0) else {
            // Released twice: it is in the limbo already, and stays there.
            if state.limbo.iter().any(|(p, _)| *p == ptr) {
                return Self::collect_in(&mut state);
            }
            return vec![ptr];
        };
        let mut free = Vec::new();
        if counter.load(Ordering::Acquire) == 0 {
            free.push(ptr);
        } else {
            state.limbo.push((ptr, counter));
        }
        free.extend(Self::collect_in(&mut state));
        free
    }

    /// Collects the limbo (`torch.cuda.ipc_collect`): the blocks no consumer holds any more,
    /// to free now.
    pub fn collect(&self) -> Vec<DevicePtr> {
        Self::collect_in(&mut self.state())
    }

    fn collect_in(state: &mut SenderState) -> Vec<DevicePtr> {
        let mut free = Vec::new();
        state.limbo.retain(|(ptr, counter)| {
            let held = counter.load(Ordering::Acquire) > 0;
            if !held {
                free.push(*ptr);
            }
            held
        });
        free
    }

    /// Blocks waiting in the limbo.
    pub fn limbo_len(&self) -> usize {
        self.state().limbo.len()
    }

    /// Whether the limbo is past PyTorch's warning threshold ([`LIMBO_WARN_AFTER`]).
    pub fn limbo_warns(&self) -> bool {
        self.limbo_len() > LIMBO_WARN_AFTER
    }
}

/// The retry chain's `cuda_ipc_collect`.
impl FreeMemoryCallback for IpcSender {
    fn release(&self) -> Vec<DevicePtr> {
        self.collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> ShareableHandle {
        ShareableHandle::Segment {
            base: DevicePtr(0x1000),
            size: 0x1000,
            offset: 0,
        }
    }

    #[test]
    fn a_block_no_consumer_holds_is_freed_at_once() {
        let sender = IpcSender::new();
        let received = sender.send(DevicePtr(0x1000), handle());
        drop(received);
        assert_eq!(
            sender.release_storage(DevicePtr(0x1000)),
            [DevicePtr(0x1000)]
        );
        assert_eq!(sender.limbo_len(), 0);
    }

    #[test]
    fn a_held_block_waits_in_the_limbo_until_every_consumer_lets_go() {
        let sender = IpcSender::new();
        let (a, b) = (
            sender.send(DevicePtr(0x1000), handle()),
            sender.send(DevicePtr(0x1000), handle()),
        );
        assert!(sender.release_storage(DevicePtr(0x1000)).is_empty());
        assert_eq!(sender.limbo_len(), 1);
        drop(a);
        assert!(sender.collect().is_empty(), "one consumer still holds it");
        drop(b);
        assert_eq!(sender.collect(), [DevicePtr(0x1000)]);
        assert!(sender.collect().is_empty(), "returned once");
    }

    #[test]
    fn a_block_in_the_limbo_is_never_listed_or_returned_twice() {
        let sender = IpcSender::new();
        let first = sender.send(DevicePtr(0x1000), handle());
        assert!(sender.release_storage(DevicePtr(0x1000)).is_empty());
        // Sent again from the limbo, and released again: still one entry.
        let second = sender.send(DevicePtr(0x1000), handle());
        assert!(sender.release_storage(DevicePtr(0x1000)).is_empty());
        assert_eq!(sender.limbo_len(), 1);
        drop(first);
        assert!(sender.collect().is_empty(), "the second consumer holds it");
        drop(second);
        assert_eq!(sender.collect(), [DevicePtr(0x1000)]);
        assert!(sender.collect().is_empty());
    }

    #[test]
    fn releasing_a_sent_block_collects_the_limbo_and_unsent_pointers_pass_through() {
        let sender = IpcSender::new();
        let first = sender.send(DevicePtr(0x1000), handle());
        let _second = sender.send(DevicePtr(0x2000), handle());
        assert!(sender.release_storage(DevicePtr(0x1000)).is_empty());
        drop(first);
        assert_eq!(
            sender.release_storage(DevicePtr(0x2000)),
            [DevicePtr(0x1000)]
        );
        assert_eq!(sender.limbo_len(), 1);
        assert_eq!(
            sender.release_storage(DevicePtr(0x3000)),
            [DevicePtr(0x3000)]
        );
        assert_eq!(
            FreeMemoryCallback::release(&sender),
            Vec::<DevicePtr>::new()
        );
    }
}
