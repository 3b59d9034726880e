//! Paged regions and chunks (Note [Planned placement], in the parent module): on a device
//! with virtual memory a region or chunk is an expandable segment of the plan's own whose
//! [`PLAN_PAGE`] pages are mapped at first use and lent between a stream's regions and
//! chunks within an iteration; a lent page's old mapping goes at the next iteration
//! boundary, after one synchronisation of its stream.
//!
//! # Invariants
//! - A page has a physical handle iff it lies in a mapped block (as for expandable
//!   segments); a lent page lies in an unmapped block of the segment it was lent from, is
//!   still mapped there on the device, and was lent to the same stream.
//! - A page is lent only while nothing of the iteration's rest will use it: a region's past
//!   its last entry, a chunk's outside what its remaining persistent entries will bump
//!   into, never one of the range being mapped.
//!
//! # Budgets
//! - Finding pages to lend walks the stream's free mapped pages: O(those pages) per map.
//! - New pages are asked of the device's free memory before any is created, so a plan's
//!   range larger than the device costs one query, not a page per byte; and of the page
//!   budget (`CachingAllocator::set_page_budget`) before any is lent or created, so that
//!   one larger than the host memory a replay may use fails at once
//!   ([`AllocError::HostMemory`]) rather than after mapping millions of pages.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, StreamId};

use super::{Following, PlanEntry, internal};
use crate::allocator::block::{BlockId, SegmentId};
use crate::allocator::pool_id::PoolRef;
use crate::allocator::size::PoolKind;
use crate::allocator::{AllocError, CachingAllocator};

/// What a followed plan did so far (Note [Planned placement]); the page counts (`maps` on)
/// are zero where unpaged, `from_cache` and `placed_elsewhere` where paged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PlanPaging {
    /// Iterations begun: the plan's first entry matched at the start or after the last.
    pub iterations: u64,
    /// Times the caching allocator's idle memory was given back after an iteration the
    /// plan served alone.
    pub cache_releases: u64,
    /// Whole plans: persistent entries served from a block the caching allocator had
    /// cached, before a new chunk.
    pub from_cache: u64,
    /// Whole plans: requests served from another free block of their stream's region or
    /// chunks than planned (a range taken, no entry matched, a chunk full).
    pub placed_elsewhere: u64,
    /// Requests that matched none of the entries expected while the plan was followed.
    pub unmatched: u64,
    /// Times the plan lost its place ([`super::LOST_AFTER`] unmatched requests in a row)
    /// and waited for its first entry again.
    pub lost: u64,
    /// Map operations: one per range of pages mapped at once into a region or chunk.
    pub maps: u64,
    /// Pages mapped, lent ones included.
    pub pages_mapped: u64,
    /// Of those, pages lent by another region or chunk of the stream (no new memory).
    pub pages_lent: u64,
    /// Pages unmapped: lent pages' old mappings, and free pages at cache flushes.
    pub pages_unmapped: u64,
    /// Stream synchronisations the plan caused (before unmapping).
    pub synchronizations: u64,
}

/// The page of a paged region or chunk: the driver's granularity.
pub const PLAN_PAGE: u64 = 2 << 20;

/// The pages of a paged region or chunk: an expandable segment of the plan's own.
#[derive(Debug, Clone)]
pub(super) struct HeldPages {
    pub(super) segment: SegmentId,
    /// Its unmapped blocks by address.
    pub(super) unmapped: BTreeMap<u64, BlockId>,
    /// Pages lent to another region or chunk and still mapped here: they lie in unmapped
    /// blocks and are unmapped from here at the next iteration boundary or flush.
    pub(super) stale: BTreeSet<u64>,
}

/// The last entry using each part of a stream's region: the step function of
/// [`Following::last_use`], built by a sweep over the entries' ranges (O(n log n)).
pub(super) fn last_uses(entries: &[PlanEntry], stream: StreamId) -> BTreeMap<u64, Option<usize>> {
    let mut edges: Vec<(u64, bool, usize)> = Vec::new();
    for (j, e) in entries.iter().enumerate() {
        if let Some(offset) = e.offset.filter(|_| e.stream == stream) {
            edges.push((offset, true, j));
            edges.push((offset + e.size, false, j));
        }
    }
    edges.sort_unstable();
    let mut live: BTreeMap<usize, u32> = BTreeMap::new();
    let mut steps = BTreeMap::from([(0, None)]);
    let mut i = 0;
    while i < edges.len() {
        let at = edges[i].0;
        while i < edges.len() && edges[i].0 == at {
            let (_, start, j) = edges[i];
            if start {
                *live.entry(j).or_default() += 1;
            } else if let Some(n) = live.get_mut(&j) {
                *n -= 1;
                if *n == 0 {
                    live.remove(&j);
                }
            }
            i += 1;
        }
        let last = live.last_key_value().map(|(&j, _)| j);
        if steps.range(..=at).next_back().map(|(_, &v)| v) != Some(last) {
            steps.insert(at, last);
        }
    }
    steps
}

impl Following {
    /// Whether no entry of the iteration's rest uses the page at offset `page` of region
    /// `r`: the current entry's position is past the last use of every part of it.
    pub(super) fn past_last_use(&self, r: usize, page: u64) -> bool {
        self.following
            && self
                .last_uses_over(r, page, page + PLAN_PAGE)
                .is_some_and(|mut uses| uses.all(|last| last.is_none_or(|j| j < self.position)))
    }

    /// The last uses over `[from, to)` of region `r` (`to` past `from`): the step of
    /// [`Following::last_use`] where it starts and every step inside; `None` for no region.
    pub(super) fn last_uses_over(
        &self,
        r: usize,
        from: u64,
        to: u64,
    ) -> Option<impl Iterator<Item = Option<usize>> + '_> {
        let steps = self.last_use.get(r)?;
        let first = steps.range(..=from).next_back().map(|(_, &v)| v);
        let within = steps.range(from + 1..to).map(|(_, &v)| v);
        Some(first.into_iter().chain(within))
    }

    /// Bytes the iteration's rest will bump into chunk `c` (all of it while not following).
    pub(super) fn persistent_to_come(&self, c: usize) -> u64 {
        let rest = &self.persistent_rest[c];
        // The current entry (the one being placed) is still to come.
        let from = if self.following {
            self.position.saturating_sub(1)
        } else {
            0
        };
        let i = rest.partition_point(|&(j, ..)| j < from);
        match rest.get(i) {
            Some(&(_, _, with_before_kept)) if self.disordered => with_before_kept,
            Some(&(_, bytes, _)) => bytes,
            None => 0,
        }
    }

    /// The pages of the paged region or chunk at `base`.
    pub(super) fn paging_mut(&mut self, base: u64) -> Result<&mut HeldPages, AllocError> {
        let held = self.held.get_mut(&base);
        held.and_then(|h| h.paging.as_mut())
            .ok_or_else(|| internal("no paged region or chunk there"))
    }

    /// The addresses of every lent page still mapped where it was lent from.
    pub(in crate::allocator) fn stale_pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.held
            .values()
            .filter_map(|h| h.paging.as_ref())
            .flat_map(|p| p.stale.iter().copied())
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Reserves a paged region or chunk of `bytes` (rounded up to pages): one unmapped block
    /// of an expandable segment of the plan's own, and its pages (none mapped yet);
    /// `Ok(None)` when the address space cannot be reserved, for whatever reason the driver
    /// gives (a plan's region may be far larger than the device: its requests then go to the
    /// caching allocator as misses).
    pub(super) fn reserve_pages(
        &mut self,
        stream: StreamId,
        bytes: u64,
    ) -> Result<Option<(BlockId, HeldPages)>, AllocError> {
        let bytes = bytes.div_ceil(PLAN_PAGE).saturating_mul(PLAN_PAGE);
        let Ok(ptr) = self.device.reserve_address_range(bytes) else {
            return Ok(None);
        };
        let pool = PoolRef::default_pool(PoolKind::Large);
        let id = self.expandable_block(ptr.0, bytes, PLAN_PAGE, stream, pool)?;
        let pages = HeldPages {
            segment: self
                .block(id)
                .expandable
                .ok_or_else(|| internal("a reservation's block outside an expandable segment"))?,
            unmapped: BTreeMap::from([(ptr.0, id)]),
            stale: BTreeSet::new(),
        };
        Ok(Some((id, pages)))
    }

    /// Maps the unmapped pages of `[addr, addr + size)` in the held segment at `base`, if it
    /// is paged: lent pages of the stream first (the dead pages of its chunks; for a chunk,
    /// also its regions' pages past their last use), new ones for the rest. `Ok(false)`
    /// when a page there is lent and still mapped, or memory for the new pages is refused.
    /// On a driver error the failed range's pages go back where they came from (ranges
    /// mapped before it stay mapped) and no page is lost.
    pub(super) fn map_for(&mut self, base: u64, addr: u64, size: u64) -> Result<bool, AllocError> {
        let Some(held) = self.following()?.held.get(&base) else {
            return Ok(false);
        };
        let Some(paging) = &held.paging else {
            return Ok(true);
        };
        let (region, stream, segment) = (held.region, held.stream, paging.segment);
        let start = base + (addr - base) / PLAN_PAGE * PLAN_PAGE;
        let end =
            (base + (addr + size - base).div_ceil(PLAN_PAGE) * PLAN_PAGE).min(base + held.bytes);
        if paging.stale.range(start..end).next().is_some() {
            return Ok(false);
        }
        // The unmapped parts of [start, end), by address.
        let first = paging.unmapped.range(..start).next_back().into_iter();
        let ranges: Vec<(u64, u64)> = first
            .chain(paging.unmapped.range(start..end))
            .map(|(&ptr, id)| (ptr.max(start), (ptr + self.block(*id).size).min(end)))
            .filter(|(from, to)| from < to)
            .collect();
        let needed: u64 = ranges
            .iter()
            .map(|(from, to)| (to - from) / PLAN_PAGE)
            .sum();
        if needed == 0 {
            return Ok(true);
        }
        // Before any page is lent or created: a hostile plan's range may span millions.
        self.admit_pages(needed)?;
        let spares = self.spare_pages(stream, !region, needed, (base, start..end));
        let fresh = needed - spares.len() as u64;
        // Asked before any page is created: a hostile plan's range may span far more pages
        // than the device has.
        if fresh > 0
            && (!self.within_limit(fresh * PLAN_PAGE)
                || fresh.saturating_mul(PLAN_PAGE) > self.device.mem_get_info()?.free)
        {
            return Ok(false);
        }
        // Each page with where it was lent from, if it was.
        let mut pages: Vec<(PhysicalHandle, Option<(u64, u64)>)> = Vec::new();
        for _ in 0..fresh {
            match self.device.create_physical_page(PLAN_PAGE) {
                Ok(handle) => pages.push((handle, None)),
                Err(e) => {
                    for (handle, _) in pages {
                        let _ = self.device.release_physical_page(handle);
                    }
                    return match e {
                        DeviceError::OutOfMemory => Ok(false),
                        e => Err(e.into()),
                    };
                }
            }
        }
        for (lender, page) in spares {
            let handle = self.lend(lender, page)?;
            pages.push((handle, Some((lender, page))));
        }
        let mut pages = pages.into_iter();
        for (from, to) in ranges {
            let taken: Vec<_> = pages
                .by_ref()
                .take(((to - from) / PLAN_PAGE) as usize)
                .collect();
            let handles: Vec<PhysicalHandle> = taken.iter().map(|&(h, _)| h).collect();
            let id = self.unmapped_from(base, from)?;
            let seg = &mut self.expandable_segments[segment.index()];
            if let Err(e) = seg.map_handles(&mut self.device, from, &handles) {
                self.merge_unmapped(id);
                // Every page goes back; the first failure to take one back is the answer.
                let mut failed = None;
                for (handle, lender) in taken.into_iter().chain(pages) {
                    match lender {
                        Some((lender, page)) => {
                            if let Err(e) = self.reattach(lender, page, handle) {
                                failed.get_or_insert(e);
                            }
                        }
                        None => {
                            let _ = self.device.release_physical_page(handle);
                        }
                    }
                }
                return Err(failed.unwrap_or(e.into()));
            }
            self.mapped_pages += handles.len();
            self.adopt_mapping(id, to - from);
            let paging = &mut self.planned_mut()?.paging;
            paging.maps += 1;
            paging.pages_mapped += taken.len() as u64;
            paging.pages_lent += taken.iter().filter(|(_, lender)| lender.is_some()).count() as u64;
        }
        Ok(true)
    }

    /// Merges unmapped block `id` of a paged segment with its unmapped neighbours again.
    fn merge_unmapped(&mut self, id: BlockId) {
        self.remove_unmapped(id);
        let (prev, next) = (self.block(id).prev, self.block(id).next);
        for neighbour in [prev, next].into_iter().flatten() {
            self.try_merge(id, neighbour);
        }
        self.insert_unmapped(id);
    }

    /// Takes back a page lent from `page` of the paged segment at `base` (still mapped there):
    /// the undoing of [`Self::lend`] when the borrower could not map it.
    fn reattach(&mut self, base: u64, page: u64, handle: PhysicalHandle) -> Result<(), AllocError> {
        let paging = self.planned_mut()?.paging_mut(base)?;
        paging.stale.remove(&page);
        let segment = paging.segment;
        self.expandable_segments[segment.index()].attach(page, handle);
        self.mapped_pages += 1;
        let id = self.unmapped_from(base, page)?;
        self.adopt_mapping(id, PLAN_PAGE);
        Ok(())
    }

    /// The unmapped block of the paged segment at `base` that starts at `from`, split off
    /// the unmapped block holding it if need be.
    fn unmapped_from(&mut self, base: u64, from: u64) -> Result<BlockId, AllocError> {
        let unmapped = &self.planned_mut()?.paging_mut(base)?.unmapped;
        let (&ptr, &id) = unmapped
            .range(..=from)
            .next_back()
            .ok_or_else(|| internal("no unmapped block holds the range"))?;
        if ptr == from {
            return Ok(id);
        }
        self.remove_unmapped(id);
        let front = self.split_front(id, from - ptr);
        self.block_mut(front).set_mapped(false);
        self.insert_unmapped(front);
        self.insert_unmapped(id);
        Ok(id)
    }

    /// Up to `want` whole free mapped pages of `stream`'s paged regions and chunks that can
    /// be lent: pages of chunks the iteration's rest will not bump into (freed persistent
    /// memory, and a current chunk's free tail beyond what is still to come), then, for a
    /// chunk (`to_chunk`), region pages past their last use in this iteration; never one of
    /// the `borrower`'s (base, range). As (base, page address). O(the stream's free mapped
    /// pages).
    fn spare_pages(
        &self,
        stream: StreamId,
        to_chunk: bool,
        want: u64,
        borrower: (u64, std::ops::Range<u64>),
    ) -> Vec<(u64, u64)> {
        let Some(planned) = self.planned.as_ref() else {
            return Vec::new();
        };
        let mut spares = Vec::new();
        for regions in [false, true] {
            if regions && !to_chunk {
                break;
            }
            for (&base, held) in &planned.held {
                if held.region != regions || held.stream != stream || held.paging.is_none() {
                    continue;
                }
                let region = planned.regions.iter().position(|r| r.2 == Some(base));
                // A current chunk keeps what the iteration's rest will bump into.
                let kept = match planned.chunks.iter().position(|c| c.2 == Some(base)) {
                    Some(c) => {
                        let tail = held.tail_start(base, &self.blocks);
                        tail..tail.saturating_add(planned.persistent_to_come(c))
                    }
                    None => 0..0,
                };
                for (&ptr, &id) in &held.free {
                    let end = ptr + self.block(id).size;
                    let mut page = base + (ptr - base).div_ceil(PLAN_PAGE) * PLAN_PAGE;
                    while page + PLAN_PAGE <= end {
                        let lendable = !(base == borrower.0 && borrower.1.contains(&page))
                            && match region {
                                Some(r) => planned.past_last_use(r, page - base),
                                None => page + PLAN_PAGE <= kept.start || page >= kept.end,
                            };
                        if lendable {
                            spares.push((base, page));
                            if spares.len() as u64 == want {
                                return spares;
                            }
                        }
                        page += PLAN_PAGE;
                    }
                }
            }
        }
        spares
    }

    /// Lends the free mapped page at `page` of the paged segment at `base`: its handle, to
    /// be mapped elsewhere. The page is unmapped to the allocator from now on and stays
    /// mapped on the device until [`Self::unmap_stale_pages`].
    fn lend(&mut self, base: u64, page: u64) -> Result<PhysicalHandle, AllocError> {
        let held = self.following()?.held.get(&base);
        let held = held.ok_or_else(|| internal("no region or chunk lends there"))?;
        let segment = held
            .paging
            .as_ref()
            .ok_or_else(|| internal("a lender not paged"))?
            .segment;
        let free = held.free.range(..=page).next_back();
        let (_, &id) = free.ok_or_else(|| internal("no free block holds a spare page"))?;
        let handle = self.expandable_segments[segment.index()]
            .detach(page)
            .ok_or_else(|| internal("a mapped page without a handle"))?;
        self.mapped_pages -= 1;
        self.mark_unmapped(id, page, PLAN_PAGE);
        self.planned_mut()?.paging_mut(base)?.stale.insert(page);
        Ok(handle)
    }

    /// Unmaps every lent page where it was lent from, after synchronising its stream
    /// (unless `synced` lists it already; the streams synchronised are added).
    pub(super) fn unmap_stale_pages(
        &mut self,
        synced: &mut Vec<StreamId>,
    ) -> Result<(), AllocError> {
        let Some(planned) = self.planned.as_mut() else {
            return Ok(());
        };
        for held in planned.held.values_mut() {
            let Some(paging) = held.paging.as_mut() else {
                continue;
            };
            while let Some(&page) = paging.stale.first() {
                if !synced.contains(&held.stream) {
                    self.device.synchronize_stream(held.stream)?;
                    synced.push(held.stream);
                    planned.paging.synchronizations += 1;
                }
                self.device.unmap(DevicePtr(page), PLAN_PAGE)?;
                paging.stale.remove(&page);
                planned.paging.pages_unmapped += 1;
            }
        }
        Ok(())
    }

    /// Puts an unmapped block the plan holds into its paged region's or chunk's map.
    #[cold]
    pub(in crate::allocator) fn insert_held_unmapped(&mut self, id: BlockId) {
        let found = self
            .held_pages(id)
            .map(|(ptr, pages)| pages.unmapped.insert(ptr, id));
        debug_assert!(
            found.is_some(),
            "an unmapped held block outside the plan's paged segments"
        );
    }

    /// Takes an unmapped block the plan holds out of its paged region's or chunk's map.
    #[cold]
    pub(in crate::allocator) fn remove_held_unmapped(&mut self, id: BlockId) {
        let removed = self
            .held_pages(id)
            .and_then(|(ptr, pages)| pages.unmapped.remove(&ptr));
        debug_assert!(
            removed.is_some(),
            "an unmapped plan block missing from its map"
        );
    }

    /// Whether an unmapped block the plan holds is in its paged region's or chunk's map.
    pub(in crate::allocator) fn held_unmapped_has(&self, id: BlockId) -> bool {
        let ptr = self.block(id).ptr;
        let planned = self.planned.as_ref();
        let held = planned.and_then(|p| p.held.get(&p.held_at(ptr)?));
        let pages = held.and_then(|h| h.paging.as_ref());
        pages.is_some_and(|p| p.unmapped.get(&ptr) == Some(&id))
    }

    /// The address of a block the plan holds, and its region's or chunk's pages.
    fn held_pages(&mut self, id: BlockId) -> Option<(u64, &mut HeldPages)> {
        let (ptr, held) = self.held_of(id)?;
        Some((ptr, held.paging.as_mut()?))
    }
}
