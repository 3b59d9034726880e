//! The caching allocator core: PyTorch's `DeviceCachingAllocator`, over any [`Device`].
//!
//! Requests are rounded (512 B, or power-of-two divisions), routed to the small (≤ 1 MiB) or
//! large pool, and served from the best-fitting cached free block of the same stream; only
//! when none fits does the allocator ask the driver for a new segment (2 MiB, 20 MiB, or the
//! request rounded to 2 MiB). Blocks are split on hand-out and merged with free neighbours
//! on free; memory goes back to the driver only as whole free segments.
//!
//! The core is pure and synchronous: `&mut self` methods, no I/O, no locks, no clock of its
//! own, no metrics library. [`crate::shared::SharedAllocator`] adds the one mutex; statistics
//! are published through [`DeviceStats`] for lock-free reads.
//!
//! # Note [Stream-ordered reuse]
//! A block freed while other streams may still use it (`record_stream`) cannot be reused at
//! once. Its free records one event per such stream and the block stays *pending*; each
//! `malloc` first polls the oldest events of every stream (`process_events`) and completes
//! the frees whose events have all completed. A full cache flush waits for all of them.
//!
//! # Note [OOM retry chain]
//! When no cached block fits, `malloc` tries, in PyTorch's order: garbage collection (when a
//! memory fraction and `garbage_collection_threshold` are set), a new segment, releasing
//! cached oversize blocks (when `max_split_size` is set) and a new segment, flushing the whole
//! cache and a last new segment (counted in `num_alloc_retries`). Only then does it fail with
//! [`AllocError::OutOfMemory`] (counted in `num_ooms`).
//!
//! # Note [Drop]
//! Dropping the allocator gives the device back everything it holds: it waits for the device,
//! destroys its events, frees every segment and unmaps, releases and unreserves every
//! expandable segment, live blocks included (as a pool allocator's destruction does: pointers
//! still held dangle). Driver errors are ignored then, as nothing could report them; a device
//! that has vanished has nothing left to return.
//!
//! # Invariants
//! Checked by [`CachingAllocator::check_invariants`] (see `invariants.rs`) after every
//! operation in tests:
//! - blocks of a segment tile it, links agree both ways, segments do not overlap;
//! - no two adjacent free blocks are left unmerged;
//! - every free block is in exactly its own pool's free set under its own key, and nothing
//!   else is;
//! - the live map holds exactly the allocated blocks, the stream-use table exactly the blocks
//!   flagged as having stream uses;
//! - every statistic equals what the blocks add up to, and the driver holds exactly the
//!   reserved bytes.

mod block;
mod error;
mod expandable;
mod free_set;
mod history;
mod invariants;
mod restore;
pub mod size;
mod snapshot;
mod stats;
mod summary;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use rustc_hash::FxHashMap;
use slab::Slab;

use crate::config::{AllocatorConfig, max_split_size_stat};
use crate::device::{Device, DeviceError, DevicePtr, EventId, StreamId};

use block::{Block, BlockId};
pub use error::{AllocError, OutOfMemory};
use expandable::ExpandableSegment;
use free_set::{FreeEntry, FreeSet};
use history::History;
pub use history::{TraceAction, TraceEntry};
pub use restore::RestoredBlock;
use size::{LARGE_BUFFER, MIN_BLOCK_SIZE, ONE_EXABYTE, PoolKind, SMALL_SIZE};
pub use snapshot::{
    BlockInfo, BlockState, Frame, SegmentClass, SegmentInfo, SimulatedDeviceInfo, Snapshot,
    segment_classes,
};
pub use stats::{Counter, DeviceStats, Stat, StatArray, StatValue};

/// A pool of cached free blocks (PyTorch's `BlockPool`).
#[derive(Debug, Default, Clone)]
struct BlockPool {
    free: FreeSet,
    /// Unmapped blocks of expandable segments, by (stream, address).
    unmapped: BTreeMap<(StreamId, u64), BlockId>,
    /// Lookups since creation, counted only while garbage collection is enabled; a block's
    /// age is this minus its `gc_count_base`.
    get_free_blocks_call_count: u64,
}

/// Stream events that must complete before a pending block's free completes.
type EventQueue = VecDeque<(EventId, BlockId)>;

/// PyTorch's caching allocator for one device. See the module documentation.
#[derive(Debug)]
pub struct CachingAllocator<D: Device> {
    device: D,
    config: AllocatorConfig,
    blocks: Slab<Block>,
    small: BlockPool,
    large: BlockPool,
    /// Allocated blocks by address (PyTorch's top-level pointer map).
    live: FxHashMap<u64, BlockId>,
    /// The streams other than its own that used a block (`record_stream`), until its free
    /// records events for them: exactly the blocks whose `has_stream_uses` is set.
    stream_uses: FxHashMap<BlockId, Vec<StreamId>>,
    /// Per stream, the events of pending frees in recording order.
    pending_events: Vec<(StreamId, EventQueue)>,
    /// Completed events kept for reuse: creating one is a driver call.
    event_pool: Vec<EventId>,
    stats: Arc<DeviceStats>,
    /// Bytes currently obtained from the driver.
    total_allocated_memory: u64,
    /// The per-process limit once a memory fraction is set, and the fraction.
    allowed_memory_maximum: Option<u64>,
    memory_fraction: Option<f64>,
    history: History,
    /// Expandable segments (Note [Expandable segments]).
    expandable_segments: Slab<ExpandableSegment>,
    /// Whether `max_split_size` changed after blocks were counted as oversize: the oversize
    /// stats then follow PyTorch's (drifting) arithmetic and cannot be checked exactly.
    max_split_size_changed: bool,
}

/// A clone is an independent allocator in the same state, statistics included (copied into
/// a new [`DeviceStats`], not shared): replay uses it to try one reading of a recording and
/// fall back to another.
impl<D: Device + Clone> Clone for CachingAllocator<D> {
    fn clone(&self) -> Self {
        CachingAllocator {
            device: self.device.clone(),
            config: self.config.clone(),
            blocks: self.blocks.clone(),
            small: self.small.clone(),
            large: self.large.clone(),
            live: self.live.clone(),
            stream_uses: self.stream_uses.clone(),
            pending_events: self.pending_events.clone(),
            event_pool: self.event_pool.clone(),
            stats: Arc::new(self.stats.copy()),
            total_allocated_memory: self.total_allocated_memory,
            allowed_memory_maximum: self.allowed_memory_maximum,
            memory_fraction: self.memory_fraction,
            history: self.history.clone(),
            expandable_segments: self.expandable_segments.clone(),
            max_split_size_changed: self.max_split_size_changed,
        }
    }
}

/// See Note [Drop].
impl<D: Device> Drop for CachingAllocator<D> {
    fn drop(&mut self) {
        let device = &mut self.device;
        let _ = device.synchronize();
        let pending = self.pending_events.drain(..).flat_map(|(_, queue)| queue);
        for event in pending
            .map(|(event, _)| event)
            .chain(self.event_pool.drain(..))
        {
            let _ = device.destroy_event(event);
        }
        for (_, block) in &self.blocks {
            if block.prev.is_none() && block.expandable.is_none() {
                let _ = device.free(DevicePtr(block.ptr));
            }
        }
        for (_, segment) in &self.expandable_segments {
            segment.release_all(device);
        }
    }
}

impl<D: Device> CachingAllocator<D> {
    /// An allocator over `device` with `config`.
    pub fn new(device: D, config: AllocatorConfig) -> Self {
        let stats = Arc::new(DeviceStats::new(max_split_size_stat(config.max_split_size)));
        CachingAllocator {
            device,
            config,
            blocks: Slab::new(),
            small: BlockPool::default(),
            large: BlockPool::default(),
            live: FxHashMap::default(),
            stream_uses: FxHashMap::default(),
            pending_events: Vec::new(),
            event_pool: Vec::new(),
            stats,
            total_allocated_memory: 0,
            allowed_memory_maximum: None,
            memory_fraction: None,
            history: History::default(),
            expandable_segments: Slab::new(),
            max_split_size_changed: false,
        }
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device, mutably (a simulated device's events are completed through it).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The configuration in force.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// The statistics, shared: clone the `Arc` to read them without access to the allocator.
    pub fn stats(&self) -> &Arc<DeviceStats> {
        &self.stats
    }

    /// `torch.cuda.memory_stats()` for this device.
    pub fn memory_stats(&self) -> std::collections::BTreeMap<String, i64> {
        self.stats.memory_stats()
    }

    /// Bytes currently obtained from the driver.
    pub fn total_allocated_memory(&self) -> u64 {
        self.total_allocated_memory
    }

    /// The per-process limit, once [`CachingAllocator::set_memory_fraction`] was called.
    pub fn allowed_memory_maximum(&self) -> Option<u64> {
        self.allowed_memory_maximum
    }

    /// Whether expandable segments are in effect: asked for and offered by the device with
    /// a page granularity that divides the 2 MiB pages (the option is ignored otherwise, as
    /// PyTorch ignores it on devices without virtual memory).
    fn expandable_segments(&self) -> bool {
        self.config.expandable_segments
            && self.device.supports_virtual_memory()
            && self
                .device
                .page_granularity()
                .is_ok_and(|g| size::SMALL_BUFFER.is_multiple_of(g))
    }

    fn gc_enabled(&self) -> bool {
        self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    fn pool_mut(&mut self, kind: PoolKind) -> &mut BlockPool {
        match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    fn pool(&self, kind: PoolKind) -> &BlockPool {
        match kind {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id.index()]
    }

    fn block_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id.index()]
    }

    fn new_block(&mut self, block: Block) -> BlockId {
        let key = self.blocks.insert(block);
        BlockId::new(key).expect("fewer than 2^32 - 1 blocks")
    }

    fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        if self.history.is_enabled() {
            let time_us = self.device.time_us();
            self.history.record(TraceEntry {
                action,
                addr,
                size,
                stream: stream.0,
                time_us,
            });
        }
    }

    /// Turns trace recording on, keeping the newest `max_entries` entries, or off (`None`),
    /// which clears the trace (`_record_memory_history`).
    pub fn record_history(&mut self, max_entries: Option<usize>) {
        self.history.set(max_entries);
    }

    /// The recorded trace, oldest first.
    pub fn trace(&self) -> Vec<TraceEntry> {
        self.history.entries()
    }

    /// Removes and returns the recorded trace, oldest first (recording stays on).
    pub fn take_trace(&mut self) -> Vec<TraceEntry> {
        self.history.take()
    }

    // ---------------------------------------------------------------------------------------
    // Allocation

    /// Allocates `size` bytes for use on `stream` (PyTorch's `malloc`). Zero bytes give the
    /// null pointer and touch nothing.
    ///
    /// # Errors
    /// [`AllocError::OutOfMemory`] when every step of the retry chain failed (see
    /// Note [OOM retry chain]); [`AllocError::TooLarge`] for 1 EiB or more;
    /// [`AllocError::Device`] when the driver fails otherwise.
    pub fn malloc(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        if size == 0 {
            return Ok(DevicePtr::NULL);
        }
        if size >= ONE_EXABYTE {
            return Err(AllocError::TooLarge(size));
        }
        self.process_events()?;
        let rounded = size::round_size(&self.config, size);
        let kind = PoolKind::for_size(rounded);
        let segment_size = size::allocation_size(rounded);
        let mut found = self.get_free_block(kind, stream, rounded);
        if found.is_none() {
            found = self.allocate_segment_with_retries(kind, stream, rounded, segment_size)?;
        }
        let Some(id) = found else {
            return Err(self.out_of_memory(rounded, segment_size, stream)?);
        };
        let split = self.should_split(id, rounded);
        Ok(self.alloc_found_block(id, rounded, size, split))
    }

    /// The slow path of `malloc`: Note [OOM retry chain].
    fn allocate_segment_with_retries(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        rounded: u64,
        segment_size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if self.gc_enabled() {
            self.garbage_collect()?;
        }
        if let Some(id) = self.alloc_block(kind, stream, rounded, segment_size, false)? {
            return Ok(Some(id));
        }
        if self.release_available_cached_blocks(kind, stream, rounded)?
            && let Some(id) = self.alloc_block(kind, stream, rounded, segment_size, false)?
        {
            return Ok(Some(id));
        }
        self.release_cached_blocks()?;
        self.alloc_block(kind, stream, rounded, segment_size, true)
    }

    /// The best-fitting cached block of `stream` for a rounded request, taken out of its
    /// pool (`get_free_block`). Only the best fit is considered: the `max_split_size` rules
    /// may refuse it, and then nothing is returned.
    fn get_free_block(&mut self, kind: PoolKind, stream: StreamId, size: u64) -> Option<BlockId> {
        let gc = self.gc_enabled();
        let max_split = self.config.max_split_size;
        // A normal request never takes an oversize block; an oversize request takes one only
        // if it wastes less than LARGE_BUFFER.
        let accept = |found: u64| {
            if size < max_split {
                found < max_split
            } else {
                found < size.saturating_add(LARGE_BUFFER)
            }
        };
        let no_expandable = self.expandable_segments.is_empty();
        let pool = self.pool_mut(kind);
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        if no_expandable {
            return pool
                .free
                .take_lower_bound(stream, size, accept)
                .map(|entry| entry.id);
        }
        let entry = self.best_fit_with_expandable(kind, stream, size)?;
        if !accept(entry.size) {
            return None;
        }
        self.pool_mut(kind)
            .free
            .remove(stream, entry.size, entry.ptr);
        Some(entry.id)
    }

    /// Best fit when expandable segments exist. With the option on, an expandable block
    /// counts as the size it could grow to, so a block that cannot grow is preferred; with
    /// the option off, expandable blocks are passed over.
    fn best_fit_with_expandable(
        &self,
        kind: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Option<FreeEntry> {
        let free = &self.pool(kind).free;
        let mut entry = free.lower_bound(stream, size)?;
        if self.block(entry.id).expandable.is_none() {
            return Some(entry);
        }
        if self.expandable_segments() {
            while self.block(entry.id).expandable.is_some() {
                let Some(next) = free.next_after(stream, entry.size, entry.ptr) else {
                    break;
                };
                if self.expandable_size(next.id) >= self.expandable_size(entry.id) {
                    break;
                }
                entry = next;
            }
        } else {
            while self.block(entry.id).expandable.is_some() {
                entry = free.next_after(stream, entry.size, entry.ptr)?;
            }
        }
        Some(entry)
    }

    /// Obtains a new segment from the driver (`alloc_block`). `Ok(None)` means out of memory
    /// (the process limit or the driver said no); other driver errors are returned.
    fn alloc_block(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        rounded: u64,
        segment_size: u64,
        retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if retry {
            self.stats.num_alloc_retries.bump();
        }
        // Quirk kept from PyTorch: with expandable segments the limit is checked against the
        // segment size too, though only the missing pages get mapped.
        if let Some(max) = self.allowed_memory_maximum
            && self.total_allocated_memory + segment_size > max
        {
            return Ok(None);
        }
        if self.expandable_segments() {
            return self.try_allocate_expandable_block(kind, stream, rounded);
        }
        let ptr = match self.device.malloc(segment_size) {
            Ok(ptr) => ptr,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        self.total_allocated_memory += segment_size;
        let id = self.new_block(Block::segment(ptr.0, segment_size, stream, kind));
        self.stats.segment.increase(kind, 1);
        self.stats.reserved_bytes.increase(kind, segment_size);
        if segment_size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc.bump();
        self.record(TraceAction::SegmentAlloc, ptr.0, segment_size, stream);
        Ok(Some(id))
    }

    /// Whether to split a found block for a rounded request (`should_split`).
    fn should_split(&self, id: BlockId, size: u64) -> bool {
        let block = self.block(id);
        let remaining = block.size - size;
        // Quirk kept from PyTorch: the expandable-segments option relaxes the rule for every
        // block, not only for blocks of expandable segments.
        if block.pool == PoolKind::Small || self.expandable_segments() {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// Hands out a block, splitting off its tail when `split` (`alloc_found_block`).
    fn alloc_found_block(
        &mut self,
        mut id: BlockId,
        size: u64,
        requested: u64,
        split: bool,
    ) -> DevicePtr {
        let block = self.block(id);
        let (kind, stream, was_split) = (block.pool, block.stream, block.is_split());
        let expandable = block.expandable;
        // Free blocks of expandable segments never count as inactive splits.
        let counts_split = expandable.is_none();
        if split {
            let front = self.split_front(id, size);
            let remaining = self.block(id).size;
            self.insert_free(id);
            if counts_split && was_split {
                self.stats.inactive_split_bytes.decrease(kind, size);
            } else if counts_split {
                self.stats.inactive_split_bytes.increase(kind, remaining);
                self.stats.inactive_split.increase(kind, 1);
            }
            id = front;
        } else if was_split && counts_split {
            let block_size = self.block(id).size;
            self.stats.inactive_split_bytes.decrease(kind, block_size);
            self.stats.inactive_split.decrease(kind, 1);
        }
        let block = self.block_mut(id);
        block.allocated = true;
        block.requested_size = requested;
        let (ptr, block_size) = (block.ptr, block.size);
        self.record(TraceAction::Alloc, ptr, requested, stream);
        self.live.insert(ptr, id);
        let stats = &self.stats;
        stats.allocation.increase(kind, 1);
        stats.allocated_bytes.increase(kind, block_size);
        stats.active.increase(kind, 1);
        stats.active_bytes.increase(kind, block_size);
        stats.requested_bytes.increase(kind, requested);
        if block_size >= self.config.max_split_size {
            stats.oversize_allocations.increase(1);
        }
        DevicePtr(ptr)
    }

    /// Carves the first `size` bytes of block `id` into a new block just before it (same
    /// stream, pool and segment) and returns it; `id` keeps the rest. Neither is put in a set.
    fn split_front(&mut self, id: BlockId, size: u64) -> BlockId {
        let b = self.block(id);
        let (ptr, stream, kind, prev, expandable) = (b.ptr, b.stream, b.pool, b.prev, b.expandable);
        let front = self.new_block(Block {
            prev,
            next: Some(id),
            expandable,
            ..Block::segment(ptr, size, stream, kind)
        });
        if let Some(p) = prev {
            self.block_mut(p).next = Some(front);
        }
        let rest = self.block_mut(id);
        rest.prev = Some(front);
        rest.ptr += size;
        rest.size -= size;
        front
    }

    /// Puts a free block into its pool's free set, stamping its GC age base.
    fn insert_free(&mut self, id: BlockId) {
        let block = self.block(id);
        let (kind, stream) = (block.pool, block.stream);
        let entry = FreeEntry {
            size: block.size,
            ptr: block.ptr,
            id,
        };
        let pool = self.pool_mut(kind);
        let base = pool.get_free_blocks_call_count;
        pool.free.insert(stream, entry);
        self.block_mut(id).gc_count_base = base;
    }

    fn remove_free(&mut self, id: BlockId) {
        let block = self.block(id);
        let (kind, stream, size, ptr) = (block.pool, block.stream, block.size, block.ptr);
        let removed = self.pool_mut(kind).free.remove(stream, size, ptr);
        debug_assert!(removed, "free block {ptr:#x} missing from its pool");
    }

    /// The out-of-memory error, after recording it (trace entry, `num_ooms`).
    fn out_of_memory(
        &mut self,
        rounded: u64,
        segment_size: u64,
        stream: StreamId,
    ) -> Result<AllocError, AllocError> {
        let info = self.device.mem_get_info()?;
        self.record(TraceAction::Oom, info.free, rounded, stream);
        self.stats.num_ooms.bump();
        let allocated = self.stats.allocated_bytes.all_current().max(0) as u64;
        let reserved = self.stats.reserved_bytes.all_current().max(0) as u64;
        Ok(AllocError::OutOfMemory(Box::new(OutOfMemory {
            device: self.device.index(),
            tried_to_allocate: segment_size,
            total: info.total,
            free: info.free,
            allowed: self.allowed_memory_maximum,
            allocated,
            reserved_unallocated: reserved.saturating_sub(allocated),
        })))
    }

    // ---------------------------------------------------------------------------------------
    // Free

    /// Frees a pointer from [`CachingAllocator::malloc`]. Null is a no-op. If other streams
    /// used the block, its reuse waits on their events (Note [Stream-ordered reuse]).
    ///
    /// # Errors
    /// [`AllocError::InvalidPointer`] for a pointer that is not live;
    /// [`AllocError::Device`] if events could not be recorded and the device could not be
    /// synchronised instead (the block is then kept out of reuse).
    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        if ptr.is_null() {
            return Ok(());
        }
        let id = self
            .live
            .remove(&ptr.0)
            .ok_or(AllocError::InvalidPointer(ptr))?;
        let block = self.block_mut(id);
        block.allocated = false;
        let (kind, size, requested, stream) =
            (block.pool, block.size, block.requested_size, block.stream);
        let has_uses = block.has_stream_uses;
        self.stats.allocation.decrease(kind, 1);
        self.stats.allocated_bytes.decrease(kind, size);
        self.record(TraceAction::FreeRequested, ptr.0, requested, stream);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        if has_uses {
            self.insert_events(id)
        } else {
            self.free_block(id);
            Ok(())
        }
    }

    /// Marks a live block as used by `stream`, so that its reuse after free waits for the
    /// work queued on `stream` (`recordStream`). Ignored for null, for pointers this
    /// allocator does not hold, and for the block's own stream.
    pub fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) {
        let Some(&id) = self.live.get(&ptr.0) else {
            return;
        };
        if self.block(id).stream == stream {
            return;
        }
        let uses = self.stream_uses.entry(id).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
        self.block_mut(id).has_stream_uses = true;
    }

    /// Records one event per stream that used a freed block (`insert_events`). If the device
    /// cannot record them, waiting for the whole device is just as safe, so the free
    /// completes after a synchronisation.
    fn insert_events(&mut self, id: BlockId) -> Result<(), AllocError> {
        let streams = self.stream_uses.remove(&id).unwrap_or_default();
        self.block_mut(id).has_stream_uses = false;
        for (i, &stream) in streams.iter().enumerate() {
            let event = match self.event_pool.pop() {
                Some(e) => Ok(e),
                None => self.device.create_event(),
            };
            let recorded = event.and_then(|e| self.device.record_event(e, stream).map(|()| e));
            match recorded {
                Ok(event) => {
                    self.block_mut(id).event_count += 1;
                    self.queue_of(stream).push_back((event, id));
                }
                Err(_) => return self.free_after_synchronize(id, &streams[i..]),
            }
        }
        Ok(())
    }

    /// Event recording failed: wait for the whole device, then complete the free. If even
    /// that fails, the streams not yet covered stay on the block, which keeps it out of reuse.
    fn free_after_synchronize(
        &mut self,
        id: BlockId,
        uncovered: &[StreamId],
    ) -> Result<(), AllocError> {
        if let Err(e) = self.device.synchronize() {
            self.stream_uses.insert(id, uncovered.to_vec());
            self.block_mut(id).has_stream_uses = true;
            return Err(AllocError::Device(e));
        }
        if self.block(id).event_count == 0 {
            self.free_block(id);
        }
        Ok(())
    }

    fn queue_of(&mut self, stream: StreamId) -> &mut EventQueue {
        let i = match self.pending_events.iter().position(|(s, _)| *s == stream) {
            Some(i) => i,
            None => {
                self.pending_events.push((stream, VecDeque::new()));
                self.pending_events.len() - 1
            }
        };
        &mut self.pending_events[i].1
    }

    /// An event of block `id` completed: when it was the last, and no stream use is left
    /// unrecorded (see `free_after_synchronize`), the free completes.
    fn event_completed(&mut self, event: EventId, id: BlockId) {
        self.event_pool.push(event);
        let block = self.block_mut(id);
        block.event_count = block.event_count.saturating_sub(1);
        if block.event_count == 0 && !block.has_stream_uses {
            self.free_block(id);
        }
    }

    /// Completes the frees whose events have completed, looking at each stream's oldest
    /// events only (`process_events`).
    fn process_events(&mut self) -> Result<(), AllocError> {
        let mut i = 0;
        while i < self.pending_events.len() {
            while let Some(&(event, id)) = self.pending_events[i].1.front() {
                if !self.device.query_event(event)? {
                    break;
                }
                self.pending_events[i].1.pop_front();
                self.event_completed(event, id);
            }
            if self.pending_events[i].1.is_empty() {
                self.pending_events.remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Waits for every pending event and completes those frees
    /// (`synchronize_and_free_events`).
    fn synchronize_and_free_events(&mut self) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams.bump();
        while let Some((_, queue)) = self.pending_events.first_mut() {
            let Some(&(event, id)) = queue.front() else {
                self.pending_events.remove(0);
                continue;
            };
            self.device.synchronize_event(event)?;
            self.pending_events[0].1.pop_front();
            self.event_completed(event, id);
        }
        Ok(())
    }

    /// Makes a block free: merges it with free neighbours and puts it in its pool
    /// (`free_block`).
    fn free_block(&mut self, id: BlockId) {
        let block = self.block(id);
        let (kind, stream, ptr, requested) =
            (block.pool, block.stream, block.ptr, block.requested_size);
        let original_size = block.size;
        let (prev, next) = (block.prev, block.next);
        self.record(TraceAction::FreeCompleted, ptr, requested, stream);
        let mut split_count: i64 = 0;
        let mut split_bytes: i64 = 0;
        for neighbour in [prev, next].into_iter().flatten() {
            let merged = self.try_merge(id, neighbour);
            if merged > 0 {
                split_count -= 1;
                split_bytes -= merged as i64;
            }
        }
        self.insert_free(id);
        let block = self.block(id);
        if block.is_split() {
            split_count += 1;
            split_bytes += block.size as i64;
        }
        let counts_split = block.expandable.is_none();
        let stats = &self.stats;
        if counts_split {
            stats.inactive_split.update(kind, split_count);
            stats.inactive_split_bytes.update(kind, split_bytes);
        }
        stats.active.decrease(kind, 1);
        stats.active_bytes.decrease(kind, original_size);
        stats.requested_bytes.decrease(kind, requested);
    }

    /// Absorbs the free neighbour `src` into `dst`; returns the bytes absorbed, 0 if `src`
    /// is not free (`try_merge`).
    fn try_merge(&mut self, dst: BlockId, src: BlockId) -> u64 {
        let s = self.block(src);
        if !s.is_free() || s.mapped != self.block(dst).mapped {
            return 0;
        }
        let (src_size, src_ptr, src_prev, src_next) = (s.size, s.ptr, s.prev, s.next);
        if s.mapped {
            self.remove_free(src);
        } else {
            let (kind, key) = (s.pool, (s.stream, s.ptr));
            self.pool_mut(kind).unmapped.remove(&key);
        }
        if self.block(dst).prev == Some(src) {
            let d = self.block_mut(dst);
            d.ptr = src_ptr;
            d.prev = src_prev;
            if let Some(p) = src_prev {
                self.block_mut(p).next = Some(dst);
            }
        } else {
            self.block_mut(dst).next = src_next;
            if let Some(n) = src_next {
                self.block_mut(n).prev = Some(dst);
            }
        }
        self.block_mut(dst).size += src_size;
        self.blocks.remove(src.index());
        src_size
    }

    // ---------------------------------------------------------------------------------------
    // Releasing memory

    /// Returns every whole cached segment to the driver, after waiting for pending frees
    /// (`empty_cache`, PyTorch's `release_cached_blocks`).
    ///
    /// # Errors
    /// [`AllocError::Device`] if the driver fails; what was released before stays released.
    pub fn empty_cache(&mut self) -> Result<(), AllocError> {
        self.release_cached_blocks()
    }

    fn release_cached_blocks(&mut self) -> Result<(), AllocError> {
        self.synchronize_and_free_events()?;
        self.release_blocks(PoolKind::Large)?;
        self.release_blocks(PoolKind::Small)
    }

    /// Releases the whole free segments of a pool, in the pool's order, then unmaps the
    /// whole free pages of its expandable segments (`release_blocks`).
    fn release_blocks(&mut self, kind: PoolKind) -> Result<(), AllocError> {
        let free: Vec<BlockId> = self.pool(kind).free.iter().map(|(_, e)| e.id).collect();
        let mut to_unmap = Vec::new();
        for id in free {
            let block = self.block(id);
            if block.expandable.is_some() {
                to_unmap.push(id);
            } else if !block.is_split() {
                self.release_block(id)?;
            }
        }
        for id in to_unmap {
            self.unmap_block(id)?;
        }
        // Segments left wholly unmapped give their address range back, including one whose
        // first mapping failed (PyTorch keeps those reserved).
        let empty: Vec<BlockId> = self
            .pool(kind)
            .unmapped
            .values()
            .copied()
            .filter(|&id| !self.block(id).is_split())
            .collect();
        for id in empty {
            self.release_expandable_segment(id)?;
        }
        Ok(())
    }

    /// Returns a whole free segment to the driver (`release_block`).
    fn release_block(&mut self, id: BlockId) -> Result<(), AllocError> {
        let block = self.block(id);
        debug_assert!(block.is_free() && !block.is_split());
        let (kind, stream, ptr, size) = (block.pool, block.stream, block.ptr, block.size);
        self.device.free(DevicePtr(ptr))?;
        self.stats.num_device_free.bump();
        self.record(TraceAction::SegmentFree, ptr, size, stream);
        self.total_allocated_memory -= size;
        self.stats.segment.decrease(kind, 1);
        self.stats.reserved_bytes.decrease(kind, size);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.remove_free(id);
        self.blocks.remove(id.index());
        Ok(())
    }

    /// Frees cached oversize blocks of the request's pool and stream, without synchronising
    /// (`release_available_cached_blocks`): the smallest single block of at least
    /// `max(size, max_split_size)`, or else oversize blocks from the largest down until that
    /// much is released. Only whole segments are released (a deviation that matters only
    /// after `max_split_size` was lowered at run time); expandable blocks are skipped.
    fn release_available_cached_blocks(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        size: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let key = size.max(max_split);
        let free = &self.pool(kind).free;
        let releasable = |b: &Block| !b.is_split() && b.expandable.is_none();
        if let Some(entry) = free.lower_bound(stream, key)
            && self.block(entry.id).expandable.is_none()
        {
            if !releasable(self.block(entry.id)) {
                return Ok(false);
            }
            self.release_block(entry.id)?;
            return Ok(true);
        }
        let mut cursor = free.prev_before(stream, key, 0);
        let mut released = 0;
        while let Some(entry) = cursor {
            if released >= key || entry.size < max_split {
                break;
            }
            cursor = self
                .pool(kind)
                .free
                .prev_before(stream, entry.size, entry.ptr);
            if releasable(self.block(entry.id)) {
                self.release_block(entry.id)?;
                released += entry.size;
            }
        }
        Ok(released >= key)
    }

    /// Releases unsplit cached large blocks, oldest first, until the reserved memory is back
    /// under `garbage_collection_threshold` × the allowed memory (`garbage_collect_cached_blocks`).
    /// Ages count large-pool lookups since a block was cached; each pass frees every block at
    /// least as old as the average, and passes repeat while they free something.
    fn garbage_collect(&mut self) -> Result<(), AllocError> {
        let Some(allowed) = self.allowed_memory_maximum else {
            return Ok(());
        };
        let limit = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        if self.total_allocated_memory <= limit {
            return Ok(());
        }
        let target = self.total_allocated_memory - limit;
        let now = self.large.get_free_blocks_call_count;
        let age = |b: &Block| (now - b.gc_count_base) as f64;
        let (mut total_age, mut count) = self
            .large
            .free
            .iter()
            .map(|(_, e)| self.block(e.id))
            .filter(|b| !b.is_split() && b.expandable.is_none())
            .fold((0.0, 0u64), |(sum, n), b| (sum + age(b), n + 1));
        let mut reclaimed = 0;
        let mut freed_any = true;
        while reclaimed < target && freed_any && count > 0 {
            let average = total_age / count as f64;
            freed_any = false;
            let candidates: Vec<FreeEntry> = self.large.free.iter().map(|(_, e)| e).collect();
            for entry in candidates {
                let block = self.block(entry.id);
                if !block.is_split() && block.expandable.is_none() && age(block) >= average {
                    let block_age = age(block);
                    self.release_block(entry.id)?;
                    freed_any = true;
                    reclaimed += entry.size;
                    total_age -= block_age;
                    count -= 1;
                }
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Settings and queries

    /// Limits this process to `fraction` of the device's memory
    /// (`set_per_process_memory_fraction`); also enables garbage collection.
    ///
    /// # Errors
    /// [`AllocError::InvalidFraction`] outside `[0, 1]`; [`AllocError::Device`] if the
    /// device cannot report its memory.
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidFraction(fraction));
        }
        let total = self.device.mem_get_info()?.total;
        self.allowed_memory_maximum = Some((fraction * total as f64) as u64);
        self.memory_fraction = Some(fraction);
        Ok(())
    }

    /// Applies a `PYTORCH_CUDA_ALLOC_CONF` string at run time (`_set_allocator_settings`).
    /// `memory_stats()["max_split_size"]` keeps the value from creation, as in PyTorch.
    ///
    /// # Errors
    /// [`AllocError::Config`] naming the bad option; nothing changes then.
    pub fn set_allocator_settings(&mut self, settings: &str) -> Result<(), AllocError> {
        let before = self.config.max_split_size;
        self.config.apply(settings)?;
        self.max_split_size_changed |= self.config.max_split_size != before;
        Ok(())
    }

    /// `reset_peak_memory_stats`: every peak becomes the current value.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// `reset_accumulated_memory_stats`: totals and event counters go to zero.
    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// The largest cached free block in either pool: the biggest request that can be served
    /// without the driver (`cacheInfo`, without its driver fallback).
    pub fn largest_free_block(&self) -> u64 {
        [&self.small, &self.large]
            .iter()
            .filter_map(|p| p.free.largest())
            .map(|e| e.size)
            .max()
            .unwrap_or(0)
    }

    /// Segments by size class with their free bytes, as a snapshot would count them (an
    /// expandable segment counts once per contiguous mapped run).
    pub fn segments_by_size(&self) -> Vec<SegmentClass> {
        let mut runs = Vec::new();
        for head in self.segment_heads() {
            let mut run: Option<(u64, u64)> = None;
            for (_, b) in self.segment_blocks(head) {
                if !b.mapped {
                    runs.extend(run.take());
                    continue;
                }
                let (total, free) = run.get_or_insert((0, 0));
                *total += b.size;
                if !b.allocated && !b.is_pending_free() {
                    *free += b.size;
                }
            }
            runs.extend(run);
        }
        segment_classes(runs)
    }

    /// The size of the live block at `ptr` (after rounding and splitting), if `ptr` is live.
    pub fn block_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.live.get(&ptr.0).map(|&id| self.block(id).size)
    }

    /// Segment head blocks, by address.
    fn segment_heads(&self) -> Vec<BlockId> {
        let mut heads: Vec<(u64, BlockId)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.prev.is_none())
            .filter_map(|(k, b)| Some((b.ptr, BlockId::new(k)?)))
            .collect();
        heads.sort_unstable();
        heads.into_iter().map(|(_, id)| id).collect()
    }

    /// The blocks of the segment starting at `head`, in address order.
    fn segment_blocks(&self, head: BlockId) -> impl Iterator<Item = (BlockId, &Block)> + '_ {
        std::iter::successors(Some(head), |&id| self.block(id).next).map(|id| (id, self.block(id)))
    }

    /// The segments and blocks (`torch.cuda.memory_snapshot()`), plus the trace and the
    /// settings (`torch.cuda.memory._snapshot()`). Records a `snapshot` trace entry, which
    /// appears in the next snapshot's trace, as in PyTorch.
    pub fn snapshot(&mut self) -> Snapshot {
        let device = self.device.index();
        let trace = self.history.entries();
        let mut segments = Vec::new();
        for head in self.segment_heads() {
            // An expandable segment shows as one segment per contiguous mapped run.
            let mut current: Option<SegmentInfo> = None;
            for (_, b) in self.segment_blocks(head) {
                if !b.mapped {
                    segments.extend(current.take());
                    continue;
                }
                let segment = current.get_or_insert_with(|| SegmentInfo {
                    device,
                    address: b.ptr,
                    total_size: 0,
                    allocated_size: 0,
                    active_size: 0,
                    requested_size: 0,
                    stream: b.stream.0,
                    segment_type: b.pool.segment_type(),
                    segment_pool_id: (0, 0),
                    is_expandable: b.expandable.is_some(),
                    frames: Vec::new(),
                    blocks: Vec::new(),
                });
                let state = if b.allocated {
                    BlockState::ActiveAllocated
                } else if b.is_pending_free() {
                    BlockState::ActivePendingFree
                } else {
                    BlockState::Inactive
                };
                segment.total_size += b.size;
                if b.allocated {
                    segment.allocated_size += b.size;
                }
                if state != BlockState::Inactive {
                    segment.active_size += b.size;
                    segment.requested_size += b.requested_size;
                }
                segment.blocks.push(BlockInfo {
                    address: b.ptr,
                    size: b.size,
                    requested_size: b.requested_size,
                    state,
                    frames: Vec::new(),
                });
            }
            segments.extend(current);
        }
        let active: u64 = segments.iter().map(|s| s.active_size).sum();
        self.record(TraceAction::Snapshot, 0, active, StreamId::DEFAULT);
        let simulated_device = self
            .device
            .mem_get_info()
            .ok()
            .map(|info| SimulatedDeviceInfo {
                total_bytes: info.total,
                memory_fraction: self.memory_fraction,
                allowed_memory_maximum: self.allowed_memory_maximum,
            });
        Snapshot {
            segments,
            device_traces: vec![trace],
            allocator_settings: self.config.settings(),
            simulated_device,
        }
    }

    /// `torch.cuda.memory_summary()`: PyTorch's text table of the statistics.
    pub fn memory_summary(&self, abbreviated: bool) -> String {
        summary::memory_summary(self.device.index(), &self.stats, abbreviated)
    }
}
