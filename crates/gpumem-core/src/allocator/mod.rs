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
//! This file holds the allocator's state, its public operations and the retry chain; each
//! of PyTorch's concepts has a file of its own: `pool.rs` (pools, `get_free_block`),
//! `pool_id.rs` (which pool: ids, the slot a block carries),
//! `private_pool.rs` (Note [Private pools]: CUDA graphs' pools and MemPools),
//! `split.rs` (split and merge), `events.rs` (Note [Stream-ordered reuse]), `release.rs`
//! (release and garbage collection), `expandable.rs`, `plan/` (Note [Planned placement];
//! `paging.rs` pages its regions), `snapshot.rs`, `size.rs` (the pure size, fit and split
//! rules), `stats/`, `ipc.rs` (Note [IPC handles]: what sharing a block with another process
//! exports).
//!
//! # Note [OOM retry chain]
//! When no cached block fits, `malloc` tries, in PyTorch's order (2.11 to 2.15): the
//! free-memory callbacks and, if they gave memory back, the pool again (`callbacks.rs`);
//! garbage collection (when a memory fraction and `garbage_collection_threshold` are set); a
//! new segment; for a default-pool request, the cached blocks of the private pools marked
//! `use_on_oom` (no new segment for them); releasing cached oversize blocks (when
//! `max_split_size` is set) and a new segment; unless a capture is under way, flushing the
//! whole cache (the regions and chunks of a plan that hold no live block with it, and the
//! freeable private pools) and a last new segment (counted in `num_alloc_retries`). Only then
//! does it fail with [`AllocError::OutOfMemory`] (counted in `num_ooms`).
//!
//! With `throw_on_cudamalloc_oom:True` and a memory fraction, a new segment past the limit
//! is refused before the driver is asked: the request fails at once, skipping the later
//! steps, counted in `num_oom_rejections` and not in `num_ooms`, with no `oom` trace entry
//! (PyTorch 2.12+ throws from `alloc_block`, so its OOM bookkeeping in `malloc` never runs;
//! the callbacks and garbage collection have run by then).
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
//!   reserved bytes;
//! - the count of mapped pages is the expandable segments' page handles together.
//!
//! # Budgets
//! - Host memory: [`CachingAllocator::heap_bytes`] estimates the bookkeeping in time
//!   independent of the blocks and pages. Mapping pages costs host memory per page (here and
//!   in a simulated device), and one request may map as many as the device holds: with a
//!   page budget ([`CachingAllocator::set_page_budget`]) a map whose pages would take
//!   [`CachingAllocator::page_bytes`] past it fails with [`AllocError::HostMemory`] before
//!   any page is created, so that a simulated device of any size is mapped within a
//!   replay's memory budget.

mod block;
mod callbacks;
mod error;
mod events;
mod expandable;
mod ext;
pub mod fit_order;
mod free_set;
mod history;
mod invariants;
mod ipc;
mod live;
mod pool;
mod pool_id;
mod private_pool;
mod release;
pub mod size;
mod snapshot;
mod split;
mod stats;
mod summary;

use std::sync::Arc;

use rustc_hash::FxHashMap;
use slab::Slab;

use crate::config::{AllocatorConfig, max_split_size_stat};
use crate::device::{Device, DeviceError, DevicePtr, EventId, StreamId};

use block::{Block, BlockId};
use callbacks::Callbacks;
pub use callbacks::FreeMemoryCallback;
pub use error::{AllocError, OutOfMemory};
use events::PendingEvents;
use expandable::ExpandableSegment;
pub use ext::breakdown;
use ext::plan::Following;
pub use ext::plan::{
    LOOKAHEAD, LOST_AFTER, MAX_PLAN_ENTRIES, MAX_PLAN_STREAMS, MAX_REGION_BYTES, PLAN_PAGE, Plan,
    PlanEntry, PlanError, PlanMode, PlanPaging, PlanRegion, PlanStatus, RESYNC_WINDOW,
};
pub use ext::restore::RestoredBlock;
pub use fit_order::{FitOrder, MAX_ADDRESS, SEGMENT_COUNTERS};
use history::History;
pub use history::{TraceAction, TraceEntry};
pub use invariants::InvariantViolation;
pub use ipc::ShareableHandle;
use live::LiveMap;
use pool::PoolPair;
pub use pool_id::PoolId;
use pool_id::{PoolRef, PoolSlot};
use private_pool::PrivatePools;
pub use private_pool::{MAX_PRIVATE_POOLS, PoolError, PoolOptions, RouteKind, StreamFilter};
use size::{ONE_EXABYTE, PoolKind};
pub use snapshot::{
    BlockInfo, BlockState, NoFrames, SegmentClass, SegmentInfo, SimulatedDevice, Snapshot,
    segment_classes,
};
pub use stats::{Counter, DeviceStats, Stat, StatArray, StatValue};

/// Host memory one mapped page's handle takes in an expandable segment's map (a B-tree
/// entry, its nodes half full at worst).
const PAGE_HANDLE_BYTES: usize = 2 * std::mem::size_of::<(usize, crate::device::PhysicalHandle)>();

/// Host memory a map is charged per page before it is made ([`CachingAllocator::set_page_budget`]):
/// the handle kept, the device's page and mapping, and the lists a map builds on the way.
pub const NEW_PAGE_BYTES: u64 = 256;

/// PyTorch's caching allocator for one device. See the module documentation.
#[derive(Debug)]
pub struct CachingAllocator<D: Device> {
    device: D,
    config: AllocatorConfig,
    blocks: Slab<Block>,
    /// The default pools.
    pools: PoolPair,
    /// Allocated blocks by address (PyTorch's top-level pointer map).
    live: LiveMap,
    /// The streams other than its own that used a block (`record_stream`), until its free
    /// records events for them: exactly the blocks whose `has_stream_uses` is set.
    stream_uses: FxHashMap<BlockId, Vec<StreamId>>,
    /// Per stream, the events of pending frees in recording order.
    pending_events: PendingEvents,
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
    /// Page handles the expandable segments (the plan's included) hold, all together.
    mapped_pages: usize,
    /// The most host memory mapped pages' bookkeeping may take ([`Self::set_page_budget`]).
    page_budget: Option<u64>,
    /// Whether `max_split_size` changed after blocks were counted as oversize: the oversize
    /// stats then follow PyTorch's (drifting) arithmetic and cannot be checked exactly.
    max_split_size_changed: bool,
    /// The placement plan followed, if any (Note [Planned placement]); boxed, so that an
    /// allocator without one keeps its hot fields as compact as before.
    planned: Option<Box<Following>>,
    /// The counter the next segment takes (PyTorch's process-wide sequence; per device here,
    /// which orders one device's segments alike). See `fit_order.rs`.
    next_counter: u32,
    /// How free blocks of equal size are ordered.
    fit_order: FitOrder,
    /// Asked for memory before a new segment is obtained (`callbacks.rs`).
    callbacks: Callbacks,
    /// Private pools and the routes into them (Note [Private pools]).
    private: PrivatePools,
    /// Frees used by other streams whose events wait until no capture is under way.
    deferred: Vec<BlockId>,
    /// Per block, the streams that used it while a capture was under way: their uses were
    /// captured, not run, so no event waits for them.
    capture_uses: FxHashMap<BlockId, Vec<StreamId>>,
}

/// A clone is an independent allocator in the same state, statistics included (copied into
/// a new [`DeviceStats`], not shared), without the free-memory callbacks (they hand out the
/// pointers of one allocator): replay uses it to try one reading of a recording and fall
/// back to another.
impl<D: Device + Clone> Clone for CachingAllocator<D> {
    fn clone(&self) -> Self {
        CachingAllocator {
            device: self.device.clone(),
            config: self.config.clone(),
            blocks: self.blocks.clone(),
            pools: self.pools.clone(),
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
            mapped_pages: self.mapped_pages,
            page_budget: self.page_budget,
            max_split_size_changed: self.max_split_size_changed,
            planned: self.planned.clone(),
            next_counter: self.next_counter,
            fit_order: self.fit_order,
            callbacks: Callbacks::default(),
            private: self.private.clone(),
            deferred: self.deferred.clone(),
            capture_uses: self.capture_uses.clone(),
        }
    }
}

/// See Note [Drop].
impl<D: Device> Drop for CachingAllocator<D> {
    fn drop(&mut self) {
        let device = &mut self.device;
        let _ = device.synchronize();
        // A plan's lent pages are mapped twice until then: their old mappings go first.
        for page in self.planned.iter().flat_map(|p| p.stale_pages()) {
            let _ = device.unmap(DevicePtr(page), ext::plan::PLAN_PAGE);
        }
        for event in self.pending_events.drain().chain(self.event_pool.drain(..)) {
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
    /// An allocator over `device` with `config`, ordering free blocks as the configured
    /// PyTorch release does (`pytorch:MAJOR.MINOR`, 2.15 by default).
    pub fn new(device: D, config: AllocatorConfig) -> Self {
        let order = FitOrder::of(config.pytorch);
        Self::with_fit_order(device, config, order)
    }

    /// An allocator over `device` with `config` whose pools order free blocks in `order`,
    /// whatever release the configuration names (replay uses the order a recording shows).
    pub fn with_fit_order(device: D, config: AllocatorConfig, order: FitOrder) -> Self {
        let stats = Arc::new(DeviceStats::new(max_split_size_stat(config.max_split_size)));
        let mut allocator = CachingAllocator {
            device,
            config,
            blocks: Slab::new(),
            pools: PoolPair::default(),
            live: LiveMap::default(),
            stream_uses: FxHashMap::default(),
            pending_events: PendingEvents::default(),
            event_pool: Vec::new(),
            stats,
            total_allocated_memory: 0,
            allowed_memory_maximum: None,
            memory_fraction: None,
            history: History::default(),
            expandable_segments: Slab::new(),
            mapped_pages: 0,
            page_budget: None,
            max_split_size_changed: false,
            planned: None,
            next_counter: 0,
            fit_order: order,
            callbacks: Callbacks::default(),
            private: PrivatePools::default(),
            deferred: Vec::new(),
            capture_uses: FxHashMap::default(),
        };
        if allocator.config.per_process_memory_fraction < 1.0 {
            allocator.limit_from_config();
        }
        allocator
    }

    /// How the pools order free blocks of equal size.
    pub fn fit_order(&self) -> FitOrder {
        self.fit_order
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

    /// Work the pools' free sets did finding streams' bins (stream entries scanned or
    /// hashed, bins looked at when empty ones are dropped): constant per operation whatever
    /// the number of streams, which the scaling tests check by this count.
    pub fn stream_lookups(&self) -> u64 {
        self.all_pools().map(|(_, pool)| pool.free.examined()).sum()
    }

    /// Bytes the allocator's bookkeeping holds on the heap, estimated from what grows with
    /// a workload: the block arena, the free sets (with each stream's bins), the live map,
    /// the streams recorded per block, the expandable segments, a followed plan's maps, and
    /// the mapped pages' bookkeeping with the device's ([`Self::page_bytes`]). A replay of a
    /// hostile recording is bounded by it.
    pub fn heap_bytes(&self) -> usize {
        let free_sets: usize = self
            .all_pools()
            .map(|(_, pool)| pool.free.heap_bytes())
            .sum();
        let planned = self
            .planned
            .as_ref()
            .map_or(0, |p| p.heap_bytes(self.blocks.len(), self.mapped_pages));
        self.blocks.capacity() * std::mem::size_of::<Block>()
            + free_sets
            + self.live.len() * 2 * std::mem::size_of::<u32>()
            + self.stream_uses.len() * 2 * std::mem::size_of::<(BlockId, Vec<StreamId>)>()
            + self.pending_events.heap_bytes()
            + self.expandable_segments.capacity() * std::mem::size_of::<ExpandableSegment>()
            + planned
            + self.page_bytes()
    }

    /// Host memory that mapped pages take, in constant time: the expandable segments' page
    /// handles and the device's own bookkeeping ([`Device::host_bytes`]; a simulated device
    /// keeps a page and a mapping for each).
    pub fn page_bytes(&self) -> usize {
        self.mapped_pages * PAGE_HANDLE_BYTES + self.device.host_bytes()
    }

    /// Sets the most host memory [`Self::page_bytes`] may reach by mapping pages: a map that
    /// would pass it (counting [`NEW_PAGE_BYTES`] for each page it maps) fails with
    /// [`AllocError::HostMemory`] before any page is created. `None` (the default): no
    /// bound but the device's memory. A replay holds a simulated device of any size to its
    /// memory budget this way: a single request may otherwise map millions of pages.
    pub fn set_page_budget(&mut self, budget: Option<u64>) {
        self.page_budget = budget;
    }

    /// Refuses a map of `pages` pages that would take [`Self::page_bytes`] past the page
    /// budget.
    fn admit_pages(&self, pages: u64) -> Result<(), AllocError> {
        let Some(budget) = self.page_budget else {
            return Ok(());
        };
        let after = (self.page_bytes() as u64).saturating_add(pages.saturating_mul(NEW_PAGE_BYTES));
        if after > budget {
            return Err(AllocError::HostMemory { pages, budget });
        }
        Ok(())
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

    fn record(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        owner: PoolSlot,
    ) {
        if self.history.is_enabled() {
            let time_us = self.device.time_us();
            let pool = self.private.id_of(owner);
            self.history.record(TraceEntry {
                action,
                addr,
                size,
                stream,
                time_us: Some(time_us),
                pool,
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

    /// How many trace entries are recorded now.
    pub fn trace_len(&self) -> usize {
        self.history.len()
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
    #[inline]
    pub fn malloc(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        let result = self.malloc_unchecked(size, stream);
        self.checked("malloc", result)
    }

    #[inline(always)]
    fn malloc_unchecked(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        if size == 0 {
            return Ok(DevicePtr::NULL);
        }
        if size >= ONE_EXABYTE {
            return Err(AllocError::TooLarge(size));
        }
        // Routed before events are processed, which never change routes: both read them once.
        let owner = self.private.route(stream);
        if !self.capturing() {
            self.process_events()?;
        }
        let rounded = size::round_size(&self.config, size);
        if owner.is_default()
            && self.planned.is_some()
            && let Some(ptr) = self.plan_malloc(rounded, size, stream)?
        {
            return Ok(ptr);
        }
        let pool = PoolRef {
            owner,
            kind: PoolKind::for_size(rounded),
        };
        let id = match self.get_free_block(pool, stream, rounded) {
            Some(id) => id,
            None => match self.free_memory_then_search(pool, stream, rounded)? {
                Some(id) => id,
                None => self.allocate_segment_with_retries(pool, stream, rounded)?,
            },
        };
        Ok(self.serve_found_block(id, rounded, size))
    }

    /// Hands out found block `id` for a rounded request, split where its pool's rules say.
    fn serve_found_block(&mut self, id: BlockId, rounded: u64, size: u64) -> DevicePtr {
        let block = self.block(id);
        // The block may come from a `use_on_oom` pool: its own pool's rules apply.
        let no_split = !block.owner.is_default() && self.private.get(block.owner).options.no_split;
        let split = !no_split
            && size::should_split(
                block.size,
                rounded,
                block.pool,
                self.expandable_segments(),
                self.config.max_split_size,
            );
        self.alloc_found_block(id, rounded, size, split)
    }

    /// Whether a capture is under way, as the configured release counts them
    /// (Note [Private pools]).
    #[inline]
    fn capturing(&self) -> bool {
        self.private.capturing(self.config.pytorch.minor())
    }

    /// The slow path of `malloc`, when no cached block fits: Note [OOM retry chain].
    fn allocate_segment_with_retries(
        &mut self,
        pool: PoolRef,
        stream: StreamId,
        rounded: u64,
    ) -> Result<BlockId, AllocError> {
        let sized = size::allocation_size(&self.config, rounded);
        let segment_size = self.segment_beside_plan(pool, rounded, sized)?;
        if self.gc_enabled() {
            self.garbage_collect()?;
        }
        if let Some(id) = self.alloc_block(pool, stream, rounded, segment_size, false)? {
            return Ok(id);
        }
        if pool.owner.is_default()
            && !self.private.is_empty()
            && let Some(id) = self.search_use_on_oom_pools(pool.kind, stream, rounded)
        {
            return Ok(id);
        }
        if self.release_available_cached_blocks(pool, stream, rounded)?
            && let Some(id) = self.alloc_block(pool, stream, rounded, segment_size, false)?
        {
            return Ok(id);
        }
        if !self.capturing() {
            self.release_cached_blocks()?;
            if let Some(id) = self.alloc_block(pool, stream, rounded, segment_size, true)? {
                return Ok(id);
            }
        }
        Err(self.out_of_memory(rounded, segment_size, stream, pool.owner)?)
    }

    /// The cached blocks of the `use_on_oom` pools, searched for a default-pool request
    /// (`try_mempool_fallback`): the first pool with a fit serves it.
    fn search_use_on_oom_pools(
        &mut self,
        kind: PoolKind,
        stream: StreamId,
        rounded: u64,
    ) -> Option<BlockId> {
        self.private
            .use_on_oom()
            .into_iter()
            .find_map(|owner| self.get_free_block(PoolRef { owner, kind }, stream, rounded))
    }

    /// Obtains a new segment from the driver (`alloc_block`). `Ok(None)` means out of memory
    /// (the process limit or the driver said no); other driver errors are returned.
    fn alloc_block(
        &mut self,
        pool: PoolRef,
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
        if !self.within_limit(segment_size) {
            if self.config.throw_on_cudamalloc_oom {
                // Refused before the driver is asked; the rest of the chain is skipped.
                return Err(self.rejection(rounded, segment_size, stream, pool.owner)?);
            }
            return Ok(None);
        }
        if self.expandable_segments() {
            return self.try_allocate_expandable_block(pool, stream, rounded);
        }
        self.new_segment(segment_size, stream, pool)
    }

    /// Whether `bytes` more fit under the process limit (a memory fraction), if one is set.
    fn within_limit(&self, bytes: u64) -> bool {
        self.allowed_memory_maximum
            .is_none_or(|max| self.total_allocated_memory + bytes <= max)
    }

    /// A new segment of `size` bytes from the driver (`cudaMalloc`) as one free block,
    /// counted and recorded; `Ok(None)` when the driver is out of memory.
    fn new_segment(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: PoolRef,
    ) -> Result<Option<BlockId>, AllocError> {
        let ptr = match self.device.malloc(size) {
            Ok(ptr) => ptr,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if let Err(e) = self.admit_segment(ptr.0, size) {
            let _ = self.device.free(ptr);
            return Err(e);
        }
        self.total_allocated_memory += size;
        let counter = self.take_counter();
        let id = self.new_block(Block::segment(ptr.0, size, stream, pool, counter));
        self.count_pool_segment(pool.owner, 1);
        let oversize = size >= self.config.max_split_size;
        self.stats.count_segment_alloc(pool.kind, size, oversize);
        self.record(TraceAction::SegmentAlloc, ptr.0, size, stream, pool.owner);
        Ok(Some(id))
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
    #[inline]
    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        let result = self.free_unchecked(ptr);
        self.checked("free", result)
    }

    #[inline(always)]
    fn free_unchecked(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        if ptr.is_null() {
            return Ok(());
        }
        // Not `ok_or`: an error built eagerly is dropped on every valid free.
        let Some(id) = self.live.remove(ptr.0, &self.blocks) else {
            return Err(AllocError::InvalidPointer(ptr));
        };
        let block = self.block_mut(id);
        block.set_allocated(false);
        let (kind, size, requested, stream, owner) = (
            block.pool,
            block.size,
            block.requested_size,
            block.stream,
            block.owner,
        );
        let has_uses = block.has_stream_uses();
        let oversize = size >= self.config.max_split_size;
        self.record(TraceAction::FreeRequested, ptr.0, requested, stream, owner);
        if has_uses {
            self.stats.count_free_requested(kind, size, oversize);
            if self.capturing() {
                // No event can be recorded for a captured stream: Note [Private pools].
                self.deferred.push(id);
                return Ok(());
            }
            if !self.capture_uses.is_empty() {
                self.capture_uses.remove(&id);
            }
            self.insert_events(id)
        } else {
            self.stats.count_free(kind, size, requested, oversize);
            self.free_block(id);
            Ok(())
        }
    }

    // ---------------------------------------------------------------------------------------
    // Releasing memory

    /// Returns every whole cached segment to the driver, after waiting for pending frees
    /// (`empty_cache`, PyTorch's `release_cached_blocks`).
    ///
    /// # Errors
    /// [`AllocError::Device`] if the driver fails; what was released before stays released.
    pub fn empty_cache(&mut self) -> Result<(), AllocError> {
        let result = self.release_cached_blocks();
        self.checked("empty_cache", result)
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

    /// Installs the limit of `per_process_memory_fraction` (PyTorch's constructor does, for
    /// a fraction below 1). A device that cannot report its memory leaves no limit: every
    /// later request would fail on that device anyway.
    fn limit_from_config(&mut self) {
        let _ = self.set_memory_fraction(self.config.per_process_memory_fraction);
    }

    /// Applies a `PYTORCH_CUDA_ALLOC_CONF` string at run time (`_set_allocator_settings`).
    /// `memory_stats()["max_split_size"]` keeps the value from creation, as in PyTorch.
    ///
    /// # Errors
    /// [`AllocError::Config`] naming the bad option; nothing changes then.
    pub fn set_allocator_settings(&mut self, settings: &str) -> Result<(), AllocError> {
        let before = self.config.clone();
        self.config.apply(settings)?;
        let split_changed = self.config.max_split_size != before.max_split_size;
        let fraction = self.config.per_process_memory_fraction;
        if fraction != before.per_process_memory_fraction {
            // As the constructor: a fraction of 1 sets no limit.
            if fraction < 1.0 {
                if let Err(e) = self.set_memory_fraction(fraction) {
                    self.config = before;
                    return Err(e);
                }
            } else {
                self.allowed_memory_maximum = None;
                self.memory_fraction = None;
            }
        }
        self.max_split_size_changed |= split_changed;
        self.checked("set_allocator_settings", Ok(()))
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
        [PoolKind::Small, PoolKind::Large]
            .into_iter()
            .filter_map(|kind| self.pools.get(kind).free.largest())
            .map(|e| e.size)
            .max()
            .unwrap_or(0)
    }

    /// The counter for a new segment (or piece). Before the sequence would reach the order's
    /// limit, the counters are renumbered densely in their order, so that tie-breaks never
    /// wrap (`fit_order.rs`); [`Self::admit_segment`] keeps room for that.
    fn take_counter(&mut self) -> u32 {
        if self.next_counter >= self.fit_order.counter_limit() - 1 {
            self.renumber_counters();
        }
        let counter = self.next_counter;
        self.next_counter += 1;
        counter
    }

    /// The counter of a block carved from one whose counter is `parent`: its own in the
    /// block-counter order, else inherited.
    pub(super) fn piece_counter(&mut self, parent: u32) -> u32 {
        if self.fit_order().pieces_take_counters() {
            self.take_counter()
        } else {
            parent
        }
    }

    /// Refuses a new segment at `ptr` of `size` bytes that the order cannot number or place
    /// (`fit_order.rs`): when the segments live (blocks, in the block-counter order, where
    /// each has a counter) alone would fill its counters, 16 million segments of 2 MiB or
    /// more in the counter order, which no device holds; or, in the counter order, when it
    /// ends above [`MAX_ADDRESS`].
    fn admit_segment(&self, ptr: u64, size: u64) -> Result<(), AllocError> {
        let live = match self.fit_order {
            FitOrder::Counter => {
                self.stats.segment.all_current().max(0) as usize + self.expandable_segments.len()
            }
            _ => self.blocks.len(),
        };
        if live + 2 >= self.fit_order.counter_limit() as usize {
            return Err(AllocError::TooManySegments(live));
        }
        if self.fit_order != FitOrder::Counter {
            return Ok(());
        }
        match ptr.checked_add(size) {
            Some(end) if end <= MAX_ADDRESS => Ok(()),
            _ => Err(AllocError::BeyondAddressBound { ptr, size }),
        }
    }

    /// Gives the blocks counters 0, 1, ... in the order of their current ones, and puts
    /// every free block back under its new key.
    #[cold]
    fn renumber_counters(&mut self) {
        let mut counters: Vec<u32> = self.blocks.iter().map(|(_, b)| b.counter).collect();
        counters.sort_unstable();
        counters.dedup();
        self.rekey(|c| counters.partition_point(|&x| x < c) as u32);
        self.next_counter = counters.len() as u32;
    }

    /// Changes every block's counter by `new` (which must keep distinct counters distinct
    /// and below `next_counter`), putting every free block back under its new key with the
    /// garbage-collection age it had.
    fn rekey(&mut self, new: impl Fn(u32) -> u32) {
        let free: Vec<(BlockId, u64)> = self
            .all_pools()
            .flat_map(|(_, p)| p.free.iter().map(|(_, e)| e.id))
            .map(|id| (id, self.block(id).gc_count_base))
            .collect();
        for &(id, _) in &free {
            self.remove_free(id);
        }
        for (_, block) in &mut self.blocks {
            block.counter = new(block.counter);
        }
        for (id, age_base) in free {
            self.insert_free(id);
            self.block_mut(id).gc_count_base = age_base;
        }
    }

    /// Reorders the first `new_of.len()` counters: counter `c` becomes `new_of[c]`, which
    /// must be a permutation of `0..new_of.len()`. Replay uses it to put the segments of a
    /// recording's start state in the order the recording shows they were obtained.
    ///
    /// # Errors
    /// [`AllocError::InvalidLayout`] if `new_of` is not such a permutation; nothing changes.
    pub fn permute_counters(&mut self, new_of: &[u32]) -> Result<(), AllocError> {
        let n = new_of.len();
        let mut seen = vec![false; n];
        let valid = n <= self.next_counter as usize
            && new_of
                .iter()
                .all(|&c| (c as usize) < n && !std::mem::replace(&mut seen[c as usize], true));
        if !valid {
            return Err(AllocError::InvalidLayout(
                "a counter order must be a permutation of the first counters".into(),
            ));
        }
        self.rekey(|c| new_of.get(c as usize).copied().unwrap_or(c));
        self.checked("permute_counters", Ok(()))
    }

    /// The cached blocks a request of `size` bytes on `stream` would choose among, once the
    /// frees whose events completed are done (as `malloc` first does): those of its pool and
    /// stream whose size is the best fit's, as (address, counter), the first of each counter
    /// only (the only one the counter order can take of it), in the pools' order. Empty when
    /// none fits, and when expandable segments or a plan take part in the choice. Replay
    /// reads off which of them a recording took.
    ///
    /// # Errors
    /// [`AllocError::Device`] if the events of pending frees cannot be queried.
    pub fn tied_best_fits(
        &mut self,
        size: u64,
        stream: StreamId,
    ) -> Result<Vec<(u64, u32)>, AllocError> {
        self.process_events()?;
        if !self.expandable_segments.is_empty() || self.planned.is_some() {
            return Ok(Vec::new());
        }
        let rounded = size::round_size(&self.config, size);
        let free = &self
            .pool(PoolRef {
                owner: self.private.route(stream),
                kind: PoolKind::for_size(rounded),
            })
            .free;
        let Some(best) = free.lower_bound(stream, rounded) else {
            return Ok(Vec::new());
        };
        let order = self.fit_order;
        let mut ties = Vec::new();
        let mut next = Some(best);
        while let Some(entry) = next.filter(|e| e.size == best.size) {
            let block = self.block(entry.id);
            ties.push((block.ptr, block.counter));
            // In the counter order, on to the next counter's first block.
            next = match order {
                FitOrder::Counter => (block.counter + 1 < SEGMENT_COUNTERS)
                    .then(|| free.at_or_after(stream, best.size, order.tie(block.counter + 1, 0)))
                    .flatten(),
                _ => free.next_after(stream, &entry),
            };
        }
        Ok(ties)
    }

    /// Moves the counter sequence on to `next` (tests of the renumbering): never back, and
    /// never past the order's limit.
    #[doc(hidden)]
    pub fn set_next_counter(&mut self, next: u32) {
        let limit = self.fit_order.counter_limit() - 1;
        self.next_counter = next.max(self.next_counter).min(limit);
    }

    /// The size of the live block at `ptr` (after rounding and splitting), if `ptr` is live.
    pub fn block_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.live
            .get(ptr.0, &self.blocks)
            .map(|id| self.block(id).size)
    }
}
