//! Planned placement: following a plan made from a recording (`gpumem plan`).
//!
//! # Note [Planned placement]
//! Training iterations repeat, so the allocations of one iteration can be placed ahead of
//! time. A [`Plan`] lists the allocations of one iteration in order, each with its rounded
//! size, its stream and, where planned, an offset inside its stream's region: one segment
//! per stream, sized so that no two allocations live at once overlap (the planner's work).
//! At run time the allocator keeps a cursor into the plan:
//! - A request that matches the entry at the cursor or, the job having skipped some, one of
//!   the entries after it ([`RESYNC_WINDOW`] in all), by rounded size and stream, is that
//!   entry. Streams are matched by their handles as the allocator's callers give them: a
//!   plan made from one process matches another's default stream, not its side streams. A
//!   planned entry is served at its offset when that range of the region is free (a hit). A
//!   persistent entry (it outlived the planned iteration) goes to its offset when it has one,
//!   that range is free and the region can be obtained (the planner's bet that it lives
//!   shorter this time), else right after the last one, in a chunk of its stream: a segment
//!   the size of one iteration's persistent entries, a new one (or one wholly free again)
//!   when the current is full. Either is a hit. An entry with neither goes to the caching
//!   allocator.
//! - A request that matches none of them, or a planned (not persistent) one whose range is
//!   still taken or whose region cannot be obtained, or a persistent one for which no chunk
//!   can be obtained, is a miss: the caching allocator serves it, from segments
//!   outside the regions. After [`LOST_AFTER`] misses in a row the plan waits for a request
//!   that matches its first entry, and follows again from there.
//! - A region is obtained from the driver at its first hit and kept while it holds live
//!   blocks. Every cache flush (`empty_cache`, and the OOM retry chain's before its last
//!   attempt) gives back the regions and chunks that hold none, so the plan never costs a
//!   request that only their memory would have let through; a region is obtained again at
//!   its next hit.
//!
//! Region and chunk blocks are ordinary blocks of large-pool segments, so statistics, the
//! trace, snapshots and `check_invariants` see them as any other; their free parts are kept
//! out of the pools' free sets (the caching allocator never carves them), in their own maps.
//! Reuse of a range stays on one stream (each stream has its own region), which keeps the
//! stream-ordered reuse of Note [Stream-ordered reuse].
//!
//! # Invariants
//! - A plan is valid before the allocator follows it ([`Plan::validate`]): at most
//!   [`MAX_PLAN_ENTRIES`] entries, [`MAX_PLAN_STREAMS`] regions (one per stream) and as many
//!   streams with persistent entries,
//!   sizes and offsets multiples of 512, every planned range inside its stream's region.
//! - A held region is one segment of exactly its planned size whose free blocks are exactly
//!   the entries of its free map, under their addresses; none of them is in a pool.
//! - A region or chunk is given back only when it holds one free block spanning it.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::device::{Device, DevicePtr, StreamId};

use rustc_hash::FxHashSet;

use super::block::{Block, BlockId};
use super::pool_id::{PoolRef, PoolSlot};
use super::size::{MIN_BLOCK_SIZE, PoolKind, ROUND_LARGE};
use super::{AllocError, CachingAllocator, TraceAction};

/// The most entries a plan may hold.
pub const MAX_PLAN_ENTRIES: usize = 1 << 20;
/// The most regions (streams) a plan may hold.
pub const MAX_PLAN_STREAMS: usize = 64;
/// The largest region: the largest device gpumem models.
pub const MAX_REGION_BYTES: u64 = super::size::MAX_DEVICE_BYTES;
/// How many entries a request may match: the one expected and those after it (allocations
/// the job skipped).
pub const RESYNC_WINDOW: usize = 16;
/// Misses in a row after which the plan waits for its first entry again.
pub const LOST_AFTER: u32 = 16;

/// A placement plan: one iteration's allocations and where each goes. See the module
/// documentation.
/// Its file (format, version, where it came from) is `gpumem::plan::PlanFile`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// One region per stream.
    pub regions: Vec<PlanRegion>,
    /// The iteration's allocations in order.
    pub entries: Vec<PlanEntry>,
}

/// A stream's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRegion {
    /// The stream, as the allocator's callers name it.
    pub stream: StreamId,
    /// Its size in bytes.
    pub bytes: u64,
}

/// One allocation of the iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanEntry {
    /// The request's size after rounding.
    pub size: u64,
    /// The stream it is made on.
    pub stream: StreamId,
    /// Its offset in the stream's region: where it goes when it is freed within an
    /// iteration, where it is tried first when persistent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// It outlives an iteration: placed one after another in chunks of the stream (each
    /// the size of an iteration's persistent entries), unless its offset is given and that
    /// range is free. An entry with neither goes to the caching allocator.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub persistent: bool,
}

/// Why a plan cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Something out of bounds or inconsistent, named.
    #[error("invalid plan: {0}")]
    Invalid(String),
}

impl Plan {
    /// Checks the invariants of the module documentation.
    ///
    /// # Errors
    /// A [`PlanError`] naming the first entry or region at fault.
    pub fn validate(&self) -> Result<(), PlanError> {
        let invalid = |s: String| Err(PlanError::Invalid(s));
        if self.entries.len() > MAX_PLAN_ENTRIES {
            return invalid(format!(
                "{} entries, at most {MAX_PLAN_ENTRIES}",
                self.entries.len()
            ));
        }
        if self.entries.is_empty() {
            return invalid("no entries".into());
        }
        if self.regions.len() > MAX_PLAN_STREAMS {
            return invalid(format!(
                "{} regions, at most {MAX_PLAN_STREAMS}",
                self.regions.len()
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if r.bytes == 0 || r.bytes % MIN_BLOCK_SIZE != 0 || r.bytes > MAX_REGION_BYTES {
                return invalid(format!(
                    "region {i} (stream {}): {} bytes, not a positive multiple of 512 up to 2^56",
                    r.stream, r.bytes
                ));
            }
            if self.regions[..i].iter().any(|o| o.stream == r.stream) {
                return invalid(format!("two regions for stream {}", r.stream));
            }
        }
        let mut persistent_streams: Vec<StreamId> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            if e.persistent && !persistent_streams.contains(&e.stream) {
                if persistent_streams.len() == MAX_PLAN_STREAMS {
                    return invalid(format!(
                        "entry {i}: persistent entries on more than {MAX_PLAN_STREAMS} streams"
                    ));
                }
                persistent_streams.push(e.stream);
            }
            if e.size == 0 || e.size % MIN_BLOCK_SIZE != 0 || e.size > MAX_REGION_BYTES {
                return invalid(format!(
                    "entry {i}: size {} is not a positive multiple of 512 up to 2^56",
                    e.size
                ));
            }
            let Some(offset) = e.offset else { continue };
            let Some(region) = self.region_of(e.stream) else {
                return invalid(format!("entry {i}: no region for stream {}", e.stream));
            };
            if offset % MIN_BLOCK_SIZE != 0 || offset.saturating_add(e.size) > region.bytes {
                return invalid(format!(
                    "entry {i}: [{offset}, +{}) is not a 512-aligned range inside its region of {} bytes",
                    e.size, region.bytes
                ));
            }
        }
        Ok(())
    }

    fn region_of(&self, stream: StreamId) -> Option<&PlanRegion> {
        self.regions.iter().find(|r| r.stream == stream)
    }

    /// Bytes of every region together: what the plan reserves when all are held.
    pub fn region_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.bytes).sum()
    }
}

/// How a followed plan stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanStatus {
    /// Bytes of the regions and chunks held from the driver now.
    pub held_bytes: u64,
    /// Of those, the bytes of regions and chunks that hold a live (or pending) block.
    pub pinned_bytes: u64,
    /// Whether requests are matched from the cursor (else: waiting for the first entry).
    pub following: bool,
}

/// The allocator's side of a plan it follows.
#[derive(Debug, Clone)]
pub(super) struct Following {
    plan: Arc<Plan>,
    /// Per planned stream: its region's size and base while held.
    regions: Vec<(StreamId, u64, Option<u64>)>,
    /// Per stream with persistent entries: a chunk's size and the chunk bumped now.
    chunks: Vec<(StreamId, u64, Option<u64>)>,
    /// Every region and chunk held, by base.
    held: BTreeMap<u64, Held>,
    /// The entry the next request is expected to be.
    cursor: usize,
    /// Whether requests are being matched from the cursor (else: waiting for entry 0).
    following: bool,
    misses_in_row: u32,
}

/// A region or chunk held from the driver.
#[derive(Debug, Clone)]
struct Held {
    bytes: u64,
    /// A region (else a chunk).
    region: bool,
    /// Its free blocks by address.
    free: BTreeMap<u64, BlockId>,
}

impl Held {
    /// Whether one free block spans it.
    fn wholly_free(&self, base: u64, blocks: &slab::Slab<Block>) -> bool {
        self.free
            .first_key_value()
            .is_some_and(|(&ptr, id)| ptr == base && blocks[id.index()].size == self.bytes)
    }
}

/// What the plan says about a request.
enum Expect {
    /// At `offset` in the region of `regions[region]`.
    Placed { region: usize, offset: u64 },
    /// At `tried` (region, offset) if that range is free, else bumped into a chunk of
    /// `chunks[chunk]`.
    Persistent {
        tried: Option<(usize, u64)>,
        chunk: usize,
    },
    /// An entry the plan leaves to the caching allocator.
    Unplanned,
    /// The plan expected something else.
    Miss,
    /// Not following (waiting for the first entry).
    Idle,
}

impl Following {
    fn new(plan: Arc<Plan>) -> Following {
        let regions = plan
            .regions
            .iter()
            .map(|r| (r.stream, r.bytes, None))
            .collect();
        let mut chunks: Vec<(StreamId, u64, Option<u64>)> = Vec::new();
        for e in plan.entries.iter().filter(|e| e.persistent) {
            match chunks.iter_mut().find(|c| c.0 == e.stream) {
                Some(c) => c.1 = c.1.saturating_add(e.size),
                None => chunks.push((e.stream, e.size, None)),
            }
        }
        for c in &mut chunks {
            c.1 =
                c.1.div_ceil(ROUND_LARGE)
                    .saturating_mul(ROUND_LARGE)
                    .min(MAX_REGION_BYTES);
        }
        Following {
            plan,
            regions,
            chunks,
            held: BTreeMap::new(),
            cursor: 0,
            following: false,
            misses_in_row: 0,
        }
    }

    fn expect(&mut self, size: u64, stream: StreamId) -> Expect {
        let entries = &self.plan.entries;
        let matches = |e: &PlanEntry| e.size == size && e.stream == stream;
        let found = if self.following {
            (0..RESYNC_WINDOW.min(entries.len()))
                .map(|k| (self.cursor + k) % entries.len())
                .find(|&j| matches(&entries[j]))
        } else {
            matches(&entries[0]).then_some(0)
        };
        let Some(j) = found else {
            if !self.following {
                return Expect::Idle;
            }
            self.misses_in_row += 1;
            if self.misses_in_row >= LOST_AFTER {
                self.following = false;
            }
            return Expect::Miss;
        };
        self.following = true;
        self.misses_in_row = 0;
        self.cursor = (j + 1) % entries.len();
        let e = &entries[j];
        let at = e.offset.map(|offset| {
            let r = self.regions.iter().position(|r| r.0 == stream);
            (
                r.expect("validated: a planned entry's stream has a region"),
                offset,
            )
        });
        if e.persistent {
            let chunk = self.chunks.iter().position(|c| c.0 == stream);
            return Expect::Persistent {
                tried: at,
                chunk: chunk.expect("a persistent entry's stream has chunks"),
            };
        }
        match at {
            Some((region, offset)) => Expect::Placed { region, offset },
            None => Expect::Unplanned,
        }
    }

    /// The base of the region or chunk holding `ptr`.
    fn held_at(&self, ptr: u64) -> Option<u64> {
        let (&base, held) = self.held.range(..=ptr).next_back()?;
        (ptr - base < held.bytes).then_some(base)
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Follows `plan` from the next request on (Note [Planned placement]), instead of any
    /// plan before it, whose regions and chunks must hold no live block (they are given
    /// back).
    ///
    /// # Errors
    /// [`AllocError::Plan`] for an invalid plan or while an earlier plan's region or chunk
    /// holds live blocks (the earlier plan stays, its wholly free memory given back);
    /// [`AllocError::Device`] if one cannot be given back.
    pub fn set_plan(&mut self, plan: Arc<Plan>) -> Result<(), AllocError> {
        plan.validate()?;
        self.give_back_all_plan_memory()?;
        self.planned = Some(Box::new(Following::new(plan)));
        self.checked("set_plan", Ok(()))
    }

    /// Stops following the plan and gives its regions and chunks back.
    ///
    /// # Errors
    /// [`AllocError::Plan`] while one holds live blocks (the plan stays, its wholly free
    /// memory given back); [`AllocError::Device`] if one cannot be given back.
    pub fn clear_plan(&mut self) -> Result<(), AllocError> {
        self.give_back_all_plan_memory()?;
        self.planned = None;
        self.checked("clear_plan", Ok(()))
    }

    /// Gives back the plan's wholly free regions and chunks; refuses if any is left (it
    /// holds live blocks), as replacing or dropping the plan needs.
    fn give_back_all_plan_memory(&mut self) -> Result<(), AllocError> {
        self.give_back_plan_memory()?;
        if self.planned.as_ref().is_some_and(|p| !p.held.is_empty()) {
            return Err(AllocError::Plan(PlanError::Invalid(
                "a region or chunk of the plan followed now still holds live blocks".into(),
            )));
        }
        Ok(())
    }

    /// The plan followed, if any.
    pub fn plan(&self) -> Option<&Plan> {
        self.planned.as_ref().map(|p| &*p.plan)
    }

    /// How the plan stands, if one is followed.
    pub fn plan_status(&self) -> Option<PlanStatus> {
        let planned = self.planned.as_ref()?;
        let held = planned.held.iter();
        Some(PlanStatus {
            held_bytes: held.clone().map(|(_, h)| h.bytes).sum(),
            pinned_bytes: held
                .filter(|&(&base, h)| !h.wholly_free(base, &self.blocks))
                .map(|(_, h)| h.bytes)
                .sum(),
            following: planned.following,
        })
    }

    /// Serves a rounded request from the plan when it expects it and can: `Ok(None)` sends
    /// it to the caching allocator. Out of line: `malloc` without a plan pays one test.
    #[inline(never)]
    pub(super) fn plan_malloc(
        &mut self,
        rounded: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let Some(planned) = self.planned.as_mut() else {
            return Ok(None);
        };
        let placed = match planned.expect(rounded, stream) {
            Expect::Placed { region, offset } => self.place(region, offset, rounded, requested)?,
            Expect::Persistent { tried, chunk } => {
                if let Some((region, offset)) = tried
                    && let Some(ptr) = self.place(region, offset, rounded, requested)?
                {
                    Some(ptr)
                } else {
                    self.bump(chunk, rounded, requested)?
                }
            }
            Expect::Miss => None,
            Expect::Unplanned | Expect::Idle => return Ok(None),
        };
        if placed.is_some() {
            self.stats.num_plan_hits.bump();
        } else {
            self.stats.num_plan_misses.bump();
        }
        Ok(placed)
    }

    fn planned_mut(&mut self) -> &mut Following {
        self.planned.as_mut().expect("a plan is followed")
    }

    /// Allocates `[offset, offset + size)` of region `r`, obtaining the region first if it
    /// is not held; `Ok(None)` if the range is taken or the region cannot be obtained.
    fn place(
        &mut self,
        r: usize,
        offset: u64,
        size: u64,
        requested: u64,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let (stream, bytes, base) = self.planned_mut().regions[r];
        let base = match base {
            Some(base) => base,
            None => {
                let Some(base) = self.hold(stream, bytes, true)? else {
                    return Ok(None);
                };
                self.planned_mut().regions[r].2 = Some(base);
                base
            }
        };
        Ok(self.carve(base, base + offset, size, requested))
    }

    /// Allocates `size` bytes at the start of the free tail of the stream's current chunk,
    /// or of a wholly free chunk of the stream, or of a new chunk; `Ok(None)` if no chunk can
    /// be obtained.
    fn bump(
        &mut self,
        c: usize,
        size: u64,
        requested: u64,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let (stream, bytes, current) = self.planned_mut().chunks[c];
        if let Some(base) = current {
            let held = &self.planned_mut().held[&base];
            let end = base + held.bytes;
            if let Some((&ptr, &id)) = held.free.last_key_value()
                && ptr + self.block(id).size == end
                && end - ptr >= size
            {
                return Ok(self.carve(base, ptr, size, requested));
            }
        }
        let planned = self.planned.as_ref().expect("a plan is followed");
        // Of the wholly free chunks large enough, the first by the pools' tie-break: the lowest
        // address, or the oldest (PyTorch 2.12 and later).
        let order = self.fit_order;
        let reuse = planned
            .held
            .iter()
            .filter(|&(&b, h)| {
                !h.region
                    && h.bytes >= size
                    && h.wholly_free(b, &self.blocks)
                    && self.blocks[h.free[&b].index()].stream == stream
            })
            .min_by_key(|&(&b, h)| order.tie(self.blocks[h.free[&b].index()].counter, b))
            .map(|(&b, _)| b);
        let base = match reuse {
            Some(base) => base,
            None => match self.hold(
                stream,
                bytes.max(size.div_ceil(ROUND_LARGE) * ROUND_LARGE),
                false,
            )? {
                Some(base) => base,
                None => return Ok(None),
            },
        };
        self.planned_mut().chunks[c].2 = Some(base);
        Ok(self.carve(base, base, size, requested))
    }

    /// Obtains a region or chunk of `bytes` from the driver, as one free block of a
    /// large-pool segment; `Ok(None)` when the process limit or the driver says no.
    fn hold(
        &mut self,
        stream: StreamId,
        bytes: u64,
        region: bool,
    ) -> Result<Option<u64>, AllocError> {
        if !self.within_limit(bytes) {
            return Ok(None);
        }
        let Some(id) = self.new_segment(bytes, stream, PoolRef::default_pool(PoolKind::Large))?
        else {
            return Ok(None);
        };
        let ptr = self.block(id).ptr;
        let free = BTreeMap::from([(ptr, id)]);
        self.planned_mut().held.insert(
            ptr,
            Held {
                bytes,
                region,
                free,
            },
        );
        Ok(Some(ptr))
    }

    /// Allocates `[addr, addr + size)` of the held segment at `base`, if a free block holds
    /// it: split off in front and behind as needed, the statistics counted as
    /// `alloc_found_block` counts them.
    fn carve(&mut self, base: u64, addr: u64, size: u64, requested: u64) -> Option<DevicePtr> {
        let free = &self.planned_mut().held.get(&base)?.free;
        let (&start, &id) = free.range(..=addr).next_back()?;
        let block = self.block(id);
        if block.ptr + block.size < addr + size {
            return None;
        }
        let (was_split, whole) = (block.is_split(), block.size);
        self.held_free_mut(base).remove(&start);
        let (mut pieces, mut piece_bytes) = (0i64, 0i64);
        let mut id = id;
        if addr > start {
            let front = self.split_front(id, addr - start);
            let bytes = self.block(front).size;
            self.held_free_mut(base).insert(start, front);
            pieces += 1;
            piece_bytes += bytes as i64;
        }
        if self.block(id).size > size {
            let taken = self.split_front(id, size);
            let (ptr, bytes) = (self.block(id).ptr, self.block(id).size);
            self.held_free_mut(base).insert(ptr, id);
            pieces += 1;
            piece_bytes += bytes as i64;
            id = taken;
        }
        let kind = PoolKind::Large;
        self.stats
            .inactive_split
            .update(kind, pieces - i64::from(was_split));
        self.stats
            .inactive_split_bytes
            .update(kind, piece_bytes - if was_split { whole as i64 } else { 0 });
        let block = self.block_mut(id);
        block.allocated = true;
        block.requested_size = requested;
        let stream = block.stream;
        self.record(
            TraceAction::Alloc,
            addr,
            requested,
            stream,
            PoolSlot::DEFAULT,
        );
        self.live.insert(addr, id, &self.blocks);
        let oversize = size >= self.config.max_split_size;
        self.stats.count_alloc(kind, size, requested, oversize);
        Some(DevicePtr(addr))
    }

    fn held_free_mut(&mut self, base: u64) -> &mut BTreeMap<u64, BlockId> {
        &mut self
            .planned_mut()
            .held
            .get_mut(&base)
            .expect("a held region or chunk")
            .free
    }

    /// Gives back every wholly free region and chunk (at every cache flush: `empty_cache`,
    /// the retry chain's, and when the plan is replaced); whether any was given back.
    pub(super) fn give_back_plan_memory(&mut self) -> Result<bool, AllocError> {
        let Some(planned) = self.planned.as_ref() else {
            return Ok(false);
        };
        let free: Vec<u64> = planned
            .held
            .iter()
            .filter(|&(&base, h)| h.wholly_free(base, &self.blocks))
            .map(|(&base, _)| base)
            .collect();
        for &base in &free {
            let id = self.planned_mut().held[&base].free[&base];
            // As any whole free segment: its free-map entry goes with it.
            self.release_block(id)?;
            let planned = self.planned_mut();
            planned.held.remove(&base);
            for r in planned.regions.iter_mut().chain(planned.chunks.iter_mut()) {
                if r.2 == Some(base) {
                    r.2 = None;
                }
            }
        }
        Ok(!free.is_empty())
    }

    /// The base of the plan's region or chunk holding `ptr`, if it lies in one.
    #[inline]
    pub(super) fn plan_segment_at(&self, ptr: u64) -> Option<u64> {
        self.planned.as_ref()?.held_at(ptr)
    }

    /// Puts a free block into its region's or chunk's map (`insert_free` for them).
    #[cold]
    pub(super) fn insert_held_free(&mut self, base: u64, id: BlockId) {
        let ptr = self.block(id).ptr;
        self.held_free_mut(base).insert(ptr, id);
    }

    /// Takes a free block out of its region's or chunk's map.
    #[cold]
    pub(super) fn remove_held_free(&mut self, base: u64, id: BlockId) {
        let ptr = self.block(id).ptr;
        let removed = self.held_free_mut(base).remove(&ptr);
        debug_assert!(removed.is_some(), "free plan block {ptr:#x} missing");
    }

    /// For `check_invariants`: the blocks in the regions' and chunks' free maps, after
    /// checking that each held one is one segment of its size whose map holds free blocks
    /// of its own under their addresses; the first violation otherwise.
    pub(super) fn check_plan_segments(&self) -> Result<FxHashSet<BlockId>, String> {
        let mut ids = FxHashSet::default();
        let Some(planned) = self.planned.as_ref() else {
            return Ok(ids);
        };
        let heads = self.segment_heads();
        for (&base, held) in &planned.held {
            let Some(&head) = heads.iter().find(|&&h| self.block(h).ptr == base) else {
                return Err(format!("plan segment at {base:#x} is not a segment"));
            };
            let size: u64 = self.segment_blocks(head).map(|(_, b)| b.size).sum();
            if size != held.bytes {
                return Err(format!(
                    "plan segment at {base:#x} spans {size} bytes, held {}",
                    held.bytes
                ));
            }
            for (&ptr, &id) in &held.free {
                let Some(b) = self.blocks.get(id.index()) else {
                    return Err(format!("plan free map names a removed block {ptr:#x}"));
                };
                if b.ptr != ptr || !b.is_free() || ptr - base >= held.bytes || !ids.insert(id) {
                    return Err(format!(
                        "plan free map entry {ptr:#x} is not a free block of its segment"
                    ));
                }
            }
        }
        for (stream, _, base) in planned.regions.iter().chain(&planned.chunks) {
            if let Some(base) = base
                && !planned.held.contains_key(base)
            {
                return Err(format!("stream {:#x}: names {base:#x}, not held", stream.0));
            }
        }
        Ok(ids)
    }
}
