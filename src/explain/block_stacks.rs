//! Which stack allocated each block live at a moment of a recording: its allocation in the
//! trace up to that moment, else (a block live since before the trace began) the stack the
//! recording's final segments keep for it, where the block survived to the end; and the
//! context of that allocation (compile context, user metadata, forward frames), which only
//! trace entries carry.
//!
//! # Invariants
//! - A block freed in the trace (its `free_completed`) before the moment has no stack from
//!   the trace; an address reused later takes the stack of its latest allocation.
//! - The final segments name a block only if its address is allocated nowhere in the trace:
//!   otherwise the block there at the end may be a later allocation at the same address.
//! - Blocks the recording says nothing of get [`StackId::EMPTY`].

use rustc_hash::FxHashMap;

use crate::allocator::{TraceAction, TraceEntry};
use crate::recording::Recording;
use crate::recording::frames::{ContextId, StackId};

/// The allocating stacks of the live blocks after `events` (a prefix of a device's trace).
pub struct BlockStacks {
    live: FxHashMap<u64, (StackId, ContextId)>,
    at_end: FxHashMap<u64, StackId>,
}

impl BlockStacks {
    /// The stacks of device `device`'s blocks live after `events`.
    pub fn new(recording: &Recording, device: usize, events: &[TraceEntry]) -> BlockStacks {
        let stacks = recording.event_stacks.get(device);
        let contexts = recording.event_contexts.get(device);
        let mut live: FxHashMap<u64, (StackId, ContextId)> = FxHashMap::default();
        for (i, e) in events.iter().enumerate() {
            match e.action {
                TraceAction::Alloc => {
                    let stack = stacks.and_then(|s| s.get(i)).copied();
                    let context = contexts.and_then(|c| c.get(i)).copied();
                    live.insert(
                        e.addr,
                        (
                            stack.unwrap_or(StackId::EMPTY),
                            context.unwrap_or(ContextId::NONE),
                        ),
                    );
                }
                TraceAction::FreeCompleted => {
                    live.remove(&e.addr);
                }
                _ => {}
            }
        }
        let allocated_in_trace: rustc_hash::FxHashSet<u64> = recording
            .trace(device as u32)
            .iter()
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
            .map(|&(stack, _)| stack)
            .or_else(|| self.at_end.get(&address).copied())
            .unwrap_or(StackId::EMPTY)
    }

    /// The context of the allocation of the live block at `address` (none for a block the
    /// trace did not allocate).
    pub fn context_of(&self, address: u64) -> ContextId {
        self.live
            .get(&address)
            .map_or(ContextId::NONE, |&(_, context)| context)
    }
}
