//! Which stack allocated each block live at a moment of a recording: its allocation in the
//! trace up to that moment, else (a block live since before the trace began) the stack the
//! recording's final segments keep for it, where the block survived to the end.
//!
//! # Invariants
//! - A block freed in the trace (its `free_completed`) before the moment has no stack from
//!   the trace; an address reused later takes the stack of its latest allocation.
//! - The final segments name a block only if its address is allocated nowhere in the trace:
//!   otherwise the block there at the end may be a later allocation at the same address.
//! - Blocks the recording says nothing of get [`StackId::EMPTY`].

use rustc_hash::FxHashMap;

use super::Recording;
use super::frames::StackId;
use crate::allocator::{TraceAction, TraceEntry};

/// The allocating stacks of the live blocks after `events` (a prefix of a device's trace).
pub struct BlockStacks {
    live: FxHashMap<u64, StackId>,
    at_end: FxHashMap<u64, StackId>,
}

impl BlockStacks {
    /// The stacks of device `device`'s blocks live after `events`.
    pub fn new(recording: &Recording, device: usize, events: &[TraceEntry]) -> BlockStacks {
        let stacks = recording.event_stacks.get(device);
        let mut live: FxHashMap<u64, StackId> = FxHashMap::default();
        for (i, e) in events.iter().enumerate() {
            match e.action {
                TraceAction::Alloc => {
                    let stack = stacks.and_then(|s| s.get(i)).copied();
                    live.insert(e.addr, stack.unwrap_or(StackId::EMPTY));
                }
                TraceAction::FreeCompleted => {
                    live.remove(&e.addr);
                }
                _ => {}
            }
        }
        let allocated_in_trace: rustc_hash::FxHashSet<u64> = recording
            .device_traces
            .get(device)
            .into_iter()
            .flatten()
            .filter(|e| e.action == TraceAction::Alloc)
            .map(|e| e.addr)
            .collect();
        let at_end = recording
            .segments
            .iter()
            .filter(|s| s.device as usize == device)
            .flat_map(|s| s.blocks.iter().map(|b| (b.address, b.stack)))
            .filter(|(address, _)| !allocated_in_trace.contains(address))
            .collect();
        BlockStacks { live, at_end }
    }

    /// The stack that allocated the live block at `address`.
    pub fn of(&self, address: u64) -> StackId {
        self.live
            .get(&address)
            .or_else(|| self.at_end.get(&address))
            .copied()
            .unwrap_or(StackId::EMPTY)
    }
}
