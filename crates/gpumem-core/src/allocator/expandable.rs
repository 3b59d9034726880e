//! Expandable segments: large reserved address ranges of a (stream, pool), private pools
//! included, backed by
//! physical pages mapped as the pool grows and unmapped when memory is released
//! (`expandable_segments:True`).
//!
//! # Note [Expandable segments]
//! A new segment reserves 9/8 of the device's memory (or `expandable_segments_reserve`) in
//! address space, rounded up to whole pages (2 MiB pages for the small pool,
//! `large_segment_size`, 20 MiB by default, for the large pool), and starts as one
//! unmapped block. An allocation that no cached block fits grows the lowest-addressed unmapped
//! area of its stream that, together with the free block just before it, is large enough:
//! it maps the pages it needs and merges them into that free block, so free space at the end
//! of a segment grows instead of stranding a new segment. `empty_cache` unmaps every whole free
//! page, holes in the middle included; a segment whose blocks are all unmapped gives its
//! address range back.
//!
//! Blocks of an expandable segment tile its whole range; mapped and unmapped blocks alternate
//! with free neighbours merged. Expandable blocks never count in `segment` or
//! `inactive_split*`; `reserved_bytes` follows the mapped bytes; each map counts in
//! `num_device_alloc`, each unmap in `num_device_free`.
//!
//! # Invariants
//! - A page has a physical handle iff it lies inside a mapped block.
//! - Unmapped blocks start and end on page boundaries, and sit in their pool's unmapped set
//!   (a plan's paged regions and chunks: in the plan's own map, Note [Planned placement]).

use std::collections::BTreeMap;

use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, StreamId};

use super::block::{Block, BlockId, Flags, SegmentId};
use super::pool_id::PoolRef;
use super::size::{self, SMALL_BUFFER};
use super::{AllocError, CachingAllocator, TraceAction};

/// One reserved address range and the physical pages mapped into it.
#[derive(Debug, Clone)]
pub(crate) struct ExpandableSegment {
    /// Start of the reserved range.
    pub ptr: u64,
    /// Size of the reserved range.
    pub size: u64,
    /// Size of each physical page.
    pub page_size: u64,
    /// The stream whose pool owns the segment (synchronised before pages are unmapped).
    pub stream: StreamId,
    /// Page index → handle, for the mapped pages (sparse: a reservation can span far more
    /// pages than are ever mapped).
    pub handles: BTreeMap<usize, PhysicalHandle>,
}

/// What an unmap achieved: `[start, start + size)` is no longer mapped. `error` is set when
/// the driver failed part-way; the pages before the failure are unmapped all the same.
struct Unmapped {
    start: u64,
    size: u64,
    error: Option<DeviceError>,
}

impl ExpandableSegment {
    /// Index of the page that contains `addr`.
    fn page_floor(&self, addr: u64) -> usize {
        ((addr - self.ptr) / self.page_size) as usize
    }

    /// Index of the first page starting at or after `addr`.
    fn page_ceil(&self, addr: u64) -> usize {
        (addr - self.ptr).div_ceil(self.page_size) as usize
    }

    fn page_addr(&self, page: usize) -> u64 {
        self.ptr + page as u64 * self.page_size
    }

    /// Unmaps and releases every mapped page and frees the reserved range, ignoring driver
    /// errors (Note [Drop]).
    pub(super) fn release_all<D: Device>(&self, device: &mut D) {
        for (&page, &handle) in &self.handles {
            let _ = device.unmap(DevicePtr(self.page_addr(page)), self.page_size);
            let _ = device.release_physical_page(handle);
        }
        let _ = device.free_address_range(DevicePtr(self.ptr), self.size);
    }

    /// Maps the pages covering `[ptr, ptr + size)` (`ptr` is page-aligned). Returns the bytes
    /// mapped, or 0 when the device is out of memory; every page created for this call is
    /// released again on any failure.
    fn map<D: Device>(&mut self, device: &mut D, ptr: u64, size: u64) -> Result<u64, DeviceError> {
        let (begin, end) = (self.page_floor(ptr), self.page_ceil(ptr + size));
        // Grown as pages are created: the device may refuse long before `end`.
        let mut created = Vec::with_capacity((end - begin).min(1024));
        let mut failure = None;
        for _ in begin..end {
            match device.create_physical_page(self.page_size) {
                Ok(handle) => created.push(handle),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none()
            && let Err(e) = self.map_handles(device, self.page_addr(begin), &created)
        {
            failure = Some(e);
        }
        if let Some(error) = failure {
            // Cleanup is best effort: the error that matters is the one that stopped us.
            for handle in created {
                let _ = device.release_physical_page(handle);
            }
            return match error {
                DeviceError::OutOfMemory => Ok(0),
                e => Err(e),
            };
        }
        Ok((end - begin) as u64 * self.page_size)
    }

    /// Maps `handles`, one page each, from the page-aligned `ptr` on, and keeps them; on a
    /// failure the pages mapped by this call are unmapped again and none is kept.
    pub(super) fn map_handles<D: Device>(
        &mut self,
        device: &mut D,
        ptr: u64,
        handles: &[PhysicalHandle],
    ) -> Result<(), DeviceError> {
        let begin = self.page_floor(ptr);
        for (i, &handle) in handles.iter().enumerate() {
            if let Err(e) = device.map(DevicePtr(self.page_addr(begin + i)), self.page_size, handle)
            {
                for j in 0..i {
                    let _ = device.unmap(DevicePtr(self.page_addr(begin + j)), self.page_size);
                }
                return Err(e);
            }
        }
        for (i, &handle) in handles.iter().enumerate() {
            self.handles.insert(begin + i, handle);
        }
        Ok(())
    }

    /// Takes the handle of the page at `ptr` away from this segment without a driver call:
    /// the page stays mapped here until the caller unmaps it (a plan's lent pages, Note
    /// [Planned placement]).
    pub(super) fn detach(&mut self, ptr: u64) -> Option<PhysicalHandle> {
        self.handles.remove(&self.page_floor(ptr))
    }

    /// Gives the page at `ptr`, still mapped there, its handle back (undoes [`Self::detach`]).
    pub(super) fn attach(&mut self, ptr: u64, handle: PhysicalHandle) {
        self.handles.insert(self.page_floor(ptr), handle);
    }

    /// Unmaps and releases every whole page inside `[ptr, ptr + size)`, after the segment's
    /// stream has finished with them (`synced`: the caller has waited for it already).
    fn unmap<D: Device>(&mut self, device: &mut D, ptr: u64, size: u64, synced: bool) -> Unmapped {
        let (begin, end) = (self.page_ceil(ptr), self.page_floor(ptr + size));
        let start = self.page_addr(begin);
        let mut outcome = Unmapped {
            start,
            size: 0,
            error: None,
        };
        if begin >= end {
            return outcome;
        }
        if !synced && let Err(e) = device.synchronize_stream(self.stream) {
            outcome.error = Some(e);
            return outcome;
        }
        for page in begin..end {
            let Some(&handle) = self.handles.get(&page) else {
                continue;
            };
            let result = device
                .unmap(DevicePtr(self.page_addr(page)), self.page_size)
                .and_then(|()| device.release_physical_page(handle));
            if let Err(e) = result {
                outcome.error = Some(e);
                break;
            }
            self.handles.remove(&page);
            outcome.size += self.page_size;
        }
        outcome
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Whether expandable segments are in effect: asked for and offered by the device with
    /// a page granularity that divides the 2 MiB pages (the option is ignored otherwise, as
    /// PyTorch ignores it on devices without virtual memory).
    pub(super) fn expandable_segments(&self) -> bool {
        self.config.expandable_segments
            && self.device.supports_virtual_memory()
            && self
                .device
                .page_granularity()
                .is_ok_and(|g| SMALL_BUFFER.is_multiple_of(g))
    }

    /// Whether a block can take part in an expandable allocation: free (or unmapped).
    fn allocatable(&self, id: Option<BlockId>) -> bool {
        id.is_some_and(|id| self.block(id).is_free())
    }

    /// A block's size counting the unmapped area right after it, which it could grow into.
    pub(super) fn expandable_size(&self, id: BlockId) -> u64 {
        let b = self.block(id);
        let growth = b
            .next
            .map(|n| self.block(n))
            .filter(|n| !n.mapped())
            .map_or(0, |n| n.size);
        b.size + growth
    }

    /// Serves a rounded request from expandable segments, mapping pages as needed
    /// (`try_allocate_expandable_block`). `Ok(None)` means out of memory.
    pub(super) fn try_allocate_expandable_block(
        &mut self,
        kind: PoolRef,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let Some(mut candidate) = self.find_expandable_block(kind, stream, size)? else {
            return Ok(None);
        };
        // The candidate starts a run of free and unmapped blocks of at least `size` bytes.
        if !self.block(candidate).mapped() {
            let first = self.block(candidate).size.min(size);
            if !self.map_block(candidate, first)? {
                return Ok(None);
            }
        }
        while self.block(candidate).size < size {
            let remaining = size - self.block(candidate).size;
            let Some(next) = self.block(candidate).next else {
                return Ok(None);
            };
            let next_size = self.block(next).size;
            if !self.map_block(next, remaining.min(next_size))? {
                return Ok(None);
            }
            // Mapping merged the candidate into `next`.
            candidate = next;
        }
        self.remove_free(candidate);
        Ok(Some(candidate))
    }

    /// The lowest-addressed place of this stream's expandable segments with room for `size`
    /// bytes, or a new segment (`find_expandable_block`). `Ok(None)` when no address space is
    /// left.
    fn find_expandable_block(
        &mut self,
        kind: PoolRef,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let unmapped: Vec<BlockId> = self
            .pool(kind)
            .unmapped
            .range((stream, 0)..)
            .take_while(|((s, _), _)| *s == stream)
            .map(|(_, &id)| id)
            .collect();
        for mut c in unmapped {
            let prev = self.block(c).prev;
            if self.allocatable(prev) {
                c = prev.expect("allocatable implies present");
            }
            let (mut bytes, mut cursor) = (0, Some(c));
            while bytes < size && self.allocatable(cursor) {
                let b = self.block(cursor.expect("allocatable implies present"));
                bytes += b.size;
                cursor = b.next;
            }
            if bytes >= size {
                return Ok(Some(c));
            }
        }
        self.new_expandable_segment(kind, stream, size)
    }

    /// Reserves a new expandable segment, as one unmapped block: 9/8 of the device's memory
    /// (or `expandable_segments_reserve`) in whole pages of 2 MiB (small pool) or
    /// `large_segment_size`. `Ok(None)` when that cannot hold `needed` bytes (a reserve set
    /// too small fails the request as out of memory, as PyTorch's does).
    fn new_expandable_segment(
        &mut self,
        kind: PoolRef,
        stream: StreamId,
        needed: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let page_size = size::expandable_page_size(&self.config, kind.kind);
        let total = self.device.mem_get_info()?.total;
        let pages = self.config.expandable_reserve(total).div_ceil(page_size);
        let size = pages.saturating_mul(page_size);
        if size < needed {
            return Ok(None);
        }
        let ptr = match self.device.reserve_address_range(size) {
            Ok(ptr) => ptr.0,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let id = self.expandable_block(ptr, size, page_size, stream, kind)?;
        self.insert_unmapped(id);
        Ok(Some(id))
    }

    /// Makes the reserved range `[ptr, ptr + size)` an expandable segment of `page_size`
    /// pages, as one unmapped block (not yet in an unmapped set), counted as a segment of
    /// its pool; the range is freed again if the allocator cannot take another segment.
    pub(super) fn expandable_block(
        &mut self,
        ptr: u64,
        size: u64,
        page_size: u64,
        stream: StreamId,
        kind: PoolRef,
    ) -> Result<BlockId, AllocError> {
        if let Err(e) = self.admit_segment(ptr, size) {
            let _ = self.device.free_address_range(DevicePtr(ptr), size);
            return Err(e);
        }
        let counter = self.take_counter();
        let segment = self.expandable_segments.insert(ExpandableSegment {
            ptr,
            size,
            page_size,
            stream,
            handles: BTreeMap::new(),
        });
        let segment = SegmentId::new(segment).expect("fewer than 2^32 segments");
        let id = self.new_block(Block {
            flags: Flags::UNMAPPED_FREE,
            expandable: Some(segment),
            ..Block::segment(ptr, size, stream, kind, counter)
        });
        self.count_pool_segment(kind.owner, 1);
        Ok(id)
    }

    /// Maps the first `size` bytes (rounded up to pages) of an unmapped block and merges them
    /// with free mapped neighbours (`map_block`). `Ok(false)` when out of memory.
    fn map_block(&mut self, id: BlockId, size: u64) -> Result<bool, AllocError> {
        let b = self.block(id);
        debug_assert!(!b.mapped() && size <= b.size);
        let ptr = b.ptr;
        let segment = b.expandable.expect("only expandable blocks are unmapped");
        let seg = &self.expandable_segments[segment.index()];
        let page_size = seg.page_size;
        self.admit_pages((seg.page_ceil(ptr + size) - seg.page_floor(ptr)) as u64)?;
        let mapped = self.expandable_segments[segment.index()].map(&mut self.device, ptr, size)?;
        if mapped == 0 {
            return Ok(false);
        }
        self.mapped_pages += (mapped / page_size) as usize;
        self.adopt_mapping(id, mapped);
        Ok(true)
    }

    /// Makes the first `mapped` bytes of unmapped block `id`, whose pages the driver has just
    /// mapped, a free mapped block merged with its free mapped neighbours: the block surgery,
    /// statistics and trace of a map.
    pub(super) fn adopt_mapping(&mut self, id: BlockId, mapped: u64) {
        let b = self.block(id);
        let (ptr, block_size, stream, kind) = (b.ptr, b.size, b.stream, b.pool_ref());
        let (counter, held) = (b.counter, b.held());
        let segment = b.expandable.expect("only expandable blocks are unmapped");
        self.remove_unmapped(id);
        self.block_mut(id).set_mapped(true);
        if mapped < block_size {
            // The rest stays unmapped, as a block of its own right after this one.
            let next = self.block(id).next;
            let counter = self.piece_counter(counter);
            let rest = self.new_block(Block {
                flags: Flags::UNMAPPED_FREE.held(held),
                expandable: Some(segment),
                prev: Some(id),
                next,
                ..Block::segment(ptr + mapped, block_size - mapped, stream, kind, counter)
            });
            if let Some(n) = next {
                self.block_mut(n).prev = Some(rest);
            }
            let b = self.block_mut(id);
            b.next = Some(rest);
            b.size = mapped;
            self.insert_unmapped(rest);
        }
        let (prev, next) = (self.block(id).prev, self.block(id).next);
        for neighbour in [prev, next].into_iter().flatten() {
            self.try_merge(id, neighbour);
        }
        self.insert_free(id);
        self.total_allocated_memory += mapped;
        self.stats.reserved_bytes.increase(kind.kind, mapped);
        self.stats.num_device_alloc.bump();
        self.record(TraceAction::SegmentMap, ptr, mapped, stream, kind.owner);
    }

    /// Whether a mapped block of an expandable segment covers a whole page.
    pub(super) fn holds_whole_page(&self, id: BlockId) -> bool {
        let b = self.block(id);
        let Some(segment) = b.expandable else {
            return false;
        };
        let seg = &self.expandable_segments[segment.index()];
        b.mapped() && seg.page_ceil(b.ptr) < seg.page_floor(b.ptr + b.size)
    }

    /// Unmaps the whole free pages of a free mapped block (`unmap_block`); partial pages at
    /// either end stay mapped as free blocks of their own.
    /// (`synced`: the caller has synchronised the segment's stream already.)
    pub(super) fn unmap_block(&mut self, id: BlockId, synced: bool) -> Result<(), AllocError> {
        let b = self.block(id);
        let (ptr, size) = (b.ptr, b.size);
        let segment = b.expandable.expect("only expandable blocks are unmapped");
        let seg = &mut self.expandable_segments[segment.index()];
        let done = seg.unmap(&mut self.device, ptr, size, synced);
        self.mapped_pages -= (done.size / seg.page_size) as usize;
        if done.size > 0 {
            self.mark_unmapped(id, done.start, done.size);
        }
        match done.error {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Makes the whole pages `[start, start + size)` of free mapped block `id`, no longer
    /// mapped for the allocator, an unmapped block merged with its unmapped neighbours (the
    /// parts of `id` around it stay free and mapped): the block surgery, statistics and
    /// trace of an unmap.
    pub(super) fn mark_unmapped(&mut self, id: BlockId, start: u64, size: u64) {
        let b = self.block(id);
        let (ptr, stream, kind) = (b.ptr, b.stream, b.pool_ref());
        self.remove_free(id);
        let before = start - ptr;
        if before > 0 {
            let front = self.split_front(id, before);
            self.insert_free(front);
        }
        let after = self.block(id).size - size;
        if after > 0 {
            self.split_off_back(id, after);
        }
        self.block_mut(id).set_mapped(false);
        let (prev, next) = (self.block(id).prev, self.block(id).next);
        for neighbour in [prev, next].into_iter().flatten() {
            self.try_merge(id, neighbour);
        }
        self.insert_unmapped(id);
        self.total_allocated_memory -= size;
        self.stats.reserved_bytes.decrease(kind.kind, size);
        self.stats.num_device_free.bump();
        self.record(TraceAction::SegmentUnmap, start, size, stream, kind.owner);
    }

    /// Splits the last `size` bytes of block `id` off as a free mapped block after it.
    fn split_off_back(&mut self, id: BlockId, size: u64) {
        let b = self.block(id);
        let (end, stream, kind, next, segment) =
            (b.ptr + b.size, b.stream, b.pool_ref(), b.next, b.expandable);
        let (counter, held) = (b.counter, b.held());
        let counter = self.piece_counter(counter);
        let back = self.new_block(Block {
            prev: Some(id),
            next,
            expandable: segment,
            flags: Flags::MAPPED_FREE.held(held),
            ..Block::segment(end - size, size, stream, kind, counter)
        });
        if let Some(n) = next {
            self.block_mut(n).prev = Some(back);
        }
        let b = self.block_mut(id);
        b.next = Some(back);
        b.size -= size;
        self.insert_free(back);
    }

    /// Gives an expandable segment's address range back once its only block is unmapped
    /// (`release_expandable_segment`).
    pub(super) fn release_expandable_segment(&mut self, id: BlockId) -> Result<(), AllocError> {
        let b = self.block(id);
        let (ptr, kind) = (b.ptr, b.pool_ref());
        let segment = b.expandable.expect("expandable block");
        let size = self.expandable_segments[segment.index()].size;
        debug_assert!(!b.mapped() && !b.is_split() && b.size == size);
        self.device.free_address_range(DevicePtr(ptr), size)?;
        self.expandable_segments.remove(segment.index());
        self.remove_unmapped(id);
        self.blocks.remove(id.index());
        self.count_pool_segment(kind.owner, -1);
        Ok(())
    }

    /// Checks the pages of every expandable segment against its blocks.
    pub(super) fn check_expandable_pages(&self, head: BlockId) -> Result<(), String> {
        let Some(segment) = self.block(head).expandable else {
            return Ok(());
        };
        let seg = &self.expandable_segments[segment.index()];
        if self.block(head).ptr != seg.ptr {
            return Err(format!(
                "expandable segment {:#x}: head block elsewhere",
                seg.ptr
            ));
        }
        let mut end = seg.ptr;
        for (id, b) in self.segment_blocks(head) {
            if b.expandable != Some(segment) {
                return Err(format!("block {:#x} belongs to another segment", b.ptr));
            }
            let (first, last) = (seg.page_floor(b.ptr), seg.page_ceil(b.ptr + b.size));
            if b.mapped() {
                if seg.handles.range(first..last).count() != last - first {
                    return Err(format!("mapped block {:#x} covers an unmapped page", b.ptr));
                }
            } else {
                let aligned = (b.ptr - seg.ptr).is_multiple_of(seg.page_size)
                    && (b.ptr + b.size - seg.ptr).is_multiple_of(seg.page_size);
                if !aligned || seg.handles.range(first..last).next().is_some() {
                    return Err(format!("unmapped block {:#x} covers a mapped page", b.ptr));
                }
                if !self.in_unmapped_set(id) {
                    return Err(format!(
                        "unmapped block {:#x} not in its unmapped set",
                        b.ptr
                    ));
                }
            }
            end = b.ptr + b.size;
        }
        if end != seg.ptr + seg.size {
            return Err(format!(
                "expandable segment {:#x}: blocks do not tile it",
                seg.ptr
            ));
        }
        Ok(())
    }
}
