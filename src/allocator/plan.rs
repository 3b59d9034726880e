//! Planned placement: following a plan made from a recording (`gpumem plan`).
//!
//! # Note [Planned placement]
//! Training iterations repeat, so the allocations of one iteration can be placed ahead of
//! time. A [`Plan`] lists the allocations of one iteration in order, each with its rounded
//! size, its stream and, where planned, an offset inside its stream's region: one segment
//! per stream, sized so that no two allocations live at once overlap (the planner's work).
//! At run time the allocator keeps a cursor into the plan:
//! - A request that matches the entry at the cursor, or one of the next
//!   [`RESYNC_WINDOW`] entries (by rounded size and stream), is that entry. A planned entry
//!   is served at its offset when that range of the region is free (a hit); an entry the
//!   plan leaves out (it lives longer than an iteration) goes to the caching allocator.
//! - A request that matches none of them, or whose range is still taken, or for which the
//!   region cannot be obtained, is a miss: the caching allocator serves it, from segments
//!   outside the regions. After [`LOST_AFTER`] misses in a row the plan waits for a request
//!   that matches its first entry, and follows again from there.
//! - A region is obtained from the driver at its first hit and kept (an `empty_cache` keeps
//!   it). The OOM retry chain gives back every region that holds no live block before its
//!   last attempt, so the plan never costs a request that only the region's memory would
//!   have let through; a region is obtained again at its next hit.
//!
//! Region blocks are ordinary blocks of a large-pool segment, so statistics, the trace,
//! snapshots and `check_invariants` see them as any other; their free parts are kept out of
//! the pools' free sets (the caching allocator never carves them), in the region's own map.
//! Reuse of a range stays on one stream (each stream has its own region), which keeps the
//! stream-ordered reuse of Note [Stream-ordered reuse].
//!
//! # Invariants
//! - A plan is valid before the allocator follows it ([`Plan::validate`]): at most
//!   [`MAX_PLAN_ENTRIES`] entries and [`MAX_PLAN_STREAMS`] regions, one region per stream,
//!   sizes and offsets multiples of 512, every planned range inside its stream's region.
//! - A held region is one segment of exactly its planned size whose free blocks are exactly
//!   the entries of its free map, under their addresses; none of them is in a pool.
//! - A region is given back only when it holds one free block spanning it.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::device::{Device, DeviceError, DevicePtr, StreamId};

use super::block::{Block, BlockId};
use super::size::{MIN_BLOCK_SIZE, PoolKind};
use super::{AllocError, CachingAllocator, TraceAction};

/// The most entries a plan may hold.
pub const MAX_PLAN_ENTRIES: usize = 1 << 20;
/// The most regions (streams) a plan may hold.
pub const MAX_PLAN_STREAMS: usize = 64;
/// The largest region: 64 PiB, as the largest simulated device.
pub const MAX_REGION_BYTES: u64 = 1 << 56;
/// How many entries past the cursor a request may match (allocations the job skipped).
pub const RESYNC_WINDOW: usize = 16;
/// Misses in a row after which the plan waits for its first entry again.
pub const LOST_AFTER: u32 = 16;

/// The plan file's `format` field.
pub const PLAN_FORMAT: &str = "gpumem-plan";
/// The plan file's version this build reads and writes.
pub const PLAN_VERSION: u32 = 1;

/// A placement plan: one iteration's allocations and where each goes. See the module
/// documentation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Always [`PLAN_FORMAT`].
    pub format: String,
    /// Always [`PLAN_VERSION`].
    pub version: u32,
    /// One region per stream.
    pub regions: Vec<PlanRegion>,
    /// The iteration's allocations in order.
    pub entries: Vec<PlanEntry>,
    /// Where the plan came from and what the planner found (informative only).
    #[serde(default)]
    pub source: Option<PlanSource>,
}

/// A stream's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRegion {
    /// The stream, as the allocator's callers name it.
    pub stream: u64,
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
    pub stream: u64,
    /// Its offset in the stream's region; `None` for an allocation the caching allocator
    /// serves (it outlives an iteration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

/// What the planner found (informative: the allocator does not read it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanSource {
    /// The recording's file name.
    pub recording: String,
    /// The device whose trace was planned.
    pub device: u32,
    /// Index (among the trace's allocations) of the planned iteration's first allocation.
    pub first_allocation: usize,
    /// Allocations per iteration.
    pub period: usize,
    /// Iterations found in a row, the planned one included.
    pub iterations: usize,
    /// Trace events of the planned iteration: `[first, end)`.
    pub events: [usize; 2],
    /// Trace events the plan is evaluated on (the iterations after it): `[first, end)`.
    pub evaluated: [usize; 2],
    /// The most bytes the planned allocations hold at once: no placement needs less.
    pub lower_bound_bytes: u64,
    /// Bytes of the allocations left to the caching allocator (they outlive an iteration).
    pub unplanned_bytes: u64,
}

/// Why a plan cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Not JSON of the plan's shape.
    #[error("not a gpumem plan: {0}")]
    Malformed(String),
    /// Another format or version.
    #[error(
        "a plan of format {format:?} version {version}; this build reads {PLAN_FORMAT:?} version {PLAN_VERSION}"
    )]
    Version {
        /// The file's format field.
        format: String,
        /// The file's version field.
        version: u32,
    },
    /// Something out of bounds or inconsistent, named.
    #[error("invalid plan: {0}")]
    Invalid(String),
}

impl Plan {
    /// Reads a plan from its JSON text and validates it.
    ///
    /// # Errors
    /// A [`PlanError`] saying what is wrong.
    pub fn from_json(text: &str) -> Result<Plan, PlanError> {
        let plan: Plan =
            serde_json::from_str(text).map_err(|e| PlanError::Malformed(e.to_string()))?;
        plan.validate()?;
        Ok(plan)
    }

    /// Checks the invariants of the module documentation.
    ///
    /// # Errors
    /// A [`PlanError`] naming the first entry or region at fault.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.format != PLAN_FORMAT || self.version != PLAN_VERSION {
            return Err(PlanError::Version {
                format: self.format.clone(),
                version: self.version,
            });
        }
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
        for (i, e) in self.entries.iter().enumerate() {
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

    fn region_of(&self, stream: u64) -> Option<&PlanRegion> {
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
    /// Bytes of the regions held from the driver now.
    pub held_bytes: u64,
    /// Whether requests are matched from the cursor (else: waiting for the first entry).
    pub following: bool,
}

/// The allocator's side of a plan it follows.
#[derive(Debug, Clone)]
pub(super) struct Planned {
    plan: Arc<Plan>,
    regions: Vec<HeldRegion>,
    /// The entry the next request is expected to be.
    cursor: usize,
    /// Whether requests are being matched from the cursor (else: waiting for entry 0).
    following: bool,
    misses_in_row: u32,
}

#[derive(Debug, Clone)]
struct HeldRegion {
    stream: StreamId,
    bytes: u64,
    /// The segment's address while it is held.
    base: Option<u64>,
    /// Its free blocks by address.
    free: BTreeMap<u64, BlockId>,
}

/// What the plan says about a request.
enum Expect {
    /// Entry `offset` of region `region`.
    Placed { region: usize, offset: u64 },
    /// An entry the plan leaves to the caching allocator.
    Unplanned,
    /// The plan expected something else.
    Miss,
    /// Not following (waiting for the first entry).
    Idle,
}

impl Planned {
    fn expect(&mut self, size: u64, stream: StreamId) -> Expect {
        let entries = &self.plan.entries;
        let matches = |e: &PlanEntry| e.size == size && e.stream == stream.0;
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
        match entries[j].offset {
            Some(offset) => Expect::Placed {
                region: self
                    .regions
                    .iter()
                    .position(|r| r.stream == stream)
                    .expect("validated: a planned entry's stream has a region"),
                offset,
            },
            None => Expect::Unplanned,
        }
    }

    fn region_at(&self, ptr: u64) -> Option<usize> {
        self.regions
            .iter()
            .position(|r| r.base.is_some_and(|b| ptr.wrapping_sub(b) < r.bytes))
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Follows `plan` from the next request on (Note [Planned placement]), instead of any
    /// plan before it, whose regions must hold no live block (they are given back).
    ///
    /// # Errors
    /// [`AllocError::Plan`] for an invalid plan or while an earlier plan's region holds
    /// live blocks; [`AllocError::Device`] if a region cannot be given back.
    pub fn set_plan(&mut self, plan: Arc<Plan>) -> Result<(), AllocError> {
        plan.validate()?;
        self.release_unused_plan_regions()?;
        if self.planned_regions().iter().any(|r| r.base.is_some()) {
            return Err(AllocError::Plan(PlanError::Invalid(
                "a region of the plan followed now still holds live blocks".into(),
            )));
        }
        let regions = plan
            .regions
            .iter()
            .map(|r| HeldRegion {
                stream: StreamId(r.stream),
                bytes: r.bytes,
                base: None,
                free: BTreeMap::new(),
            })
            .collect();
        self.planned = Some(Planned {
            plan,
            regions,
            cursor: 0,
            following: false,
            misses_in_row: 0,
        });
        self.checked("set_plan", Ok(()))
    }

    /// Stops following the plan and gives its regions back.
    ///
    /// # Errors
    /// [`AllocError::Plan`] while a region holds live blocks (nothing changes then);
    /// [`AllocError::Device`] if a region cannot be given back.
    pub fn clear_plan(&mut self) -> Result<(), AllocError> {
        self.release_unused_plan_regions()?;
        if self.planned_regions().iter().any(|r| r.base.is_some()) {
            return Err(AllocError::Plan(PlanError::Invalid(
                "a region of the plan still holds live blocks".into(),
            )));
        }
        self.planned = None;
        self.checked("clear_plan", Ok(()))
    }

    /// The plan followed, if any.
    pub fn plan(&self) -> Option<&Plan> {
        self.planned.as_ref().map(|p| &*p.plan)
    }

    /// How the plan stands, if one is followed.
    pub fn plan_status(&self) -> Option<PlanStatus> {
        let planned = self.planned.as_ref()?;
        Some(PlanStatus {
            held_bytes: planned
                .regions
                .iter()
                .filter(|r| r.base.is_some())
                .map(|r| r.bytes)
                .sum(),
            following: planned.following,
        })
    }

    /// Serves a rounded request from the plan when it expects it and can: `Ok(None)` sends
    /// it to the caching allocator.
    pub(super) fn plan_malloc(
        &mut self,
        rounded: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let Some(planned) = self.planned.as_mut() else {
            return Ok(None);
        };
        let (region, offset) = match planned.expect(rounded, stream) {
            Expect::Placed { region, offset } => (region, offset),
            Expect::Miss => {
                self.stats.num_plan_misses.bump();
                return Ok(None);
            }
            Expect::Unplanned | Expect::Idle => return Ok(None),
        };
        let placed = self.place(region, offset, rounded, requested)?;
        if placed.is_some() {
            self.stats.num_plan_hits.bump();
        } else {
            self.stats.num_plan_misses.bump();
        }
        Ok(placed)
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
        let Some(base) = self.hold_region(r)? else {
            return Ok(None);
        };
        let addr = base + offset;
        let region = &self.planned_regions()[r];
        let Some((_, &id)) = region.free.range(..=addr).next_back() else {
            return Ok(None);
        };
        let block = self.block(id);
        if block.ptr + block.size < addr + size {
            return Ok(None);
        }
        let (was_split, whole, start) = (block.is_split(), block.size, block.ptr);
        self.region_free_mut(r).remove(&start);
        let (mut pieces, mut piece_bytes) = (0i64, 0i64);
        let mut id = id;
        if addr > start {
            let front = self.split_front(id, addr - start);
            let (ptr, bytes) = (self.block(front).ptr, self.block(front).size);
            self.region_free_mut(r).insert(ptr, front);
            pieces += 1;
            piece_bytes += bytes as i64;
        }
        if self.block(id).size > size {
            let taken = self.split_front(id, size);
            let (ptr, bytes) = (self.block(id).ptr, self.block(id).size);
            self.region_free_mut(r).insert(ptr, id);
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
        self.record(TraceAction::Alloc, addr, requested, stream);
        self.live.insert(addr, id);
        let oversize = size >= self.config.max_split_size;
        self.stats.count_alloc(kind, size, requested, oversize);
        Ok(Some(DevicePtr(addr)))
    }

    /// Region `r`'s address, obtaining it from the driver if it is not held; `Ok(None)` when
    /// the process limit or the driver says no.
    fn hold_region(&mut self, r: usize) -> Result<Option<u64>, AllocError> {
        let region = &self.planned_regions()[r];
        if let Some(base) = region.base {
            return Ok(Some(base));
        }
        let (bytes, stream) = (region.bytes, region.stream);
        if let Some(max) = self.allowed_memory_maximum
            && self.total_allocated_memory + bytes > max
        {
            return Ok(None);
        }
        let ptr = match self.device.malloc(bytes) {
            Ok(ptr) => ptr.0,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        self.total_allocated_memory += bytes;
        let kind = PoolKind::Large;
        let id = self.new_block(Block::segment(ptr, bytes, stream, kind));
        self.stats
            .count_segment_alloc(kind, bytes, bytes >= self.config.max_split_size);
        self.record(TraceAction::SegmentAlloc, ptr, bytes, stream);
        let region = &mut self.planned.as_mut().expect("a plan is followed").regions[r];
        region.base = Some(ptr);
        region.free.insert(ptr, id);
        Ok(Some(ptr))
    }

    /// Gives back every held region with no live block; whether any was given back.
    pub(super) fn release_unused_plan_regions(&mut self) -> Result<bool, AllocError> {
        let mut released = false;
        for r in 0..self.planned_regions().len() {
            let region = &self.planned_regions()[r];
            let (Some(base), Some((_, &id))) = (region.base, region.free.first_key_value()) else {
                continue;
            };
            let block = self.block(id);
            if block.ptr != base || block.is_split() {
                continue;
            }
            let (size, stream) = (block.size, block.stream);
            self.device.free(DevicePtr(base))?;
            self.record(TraceAction::SegmentFree, base, size, stream);
            self.total_allocated_memory -= size;
            self.stats.count_segment_free(
                PoolKind::Large,
                size,
                size >= self.config.max_split_size,
            );
            self.blocks.remove(id.index());
            let region = &mut self.planned.as_mut().expect("a plan is followed").regions[r];
            region.base = None;
            region.free.clear();
            released = true;
        }
        Ok(released)
    }

    fn planned_regions(&self) -> &[HeldRegion] {
        self.planned.as_ref().map_or(&[], |p| &p.regions)
    }

    fn region_free_mut(&mut self, r: usize) -> &mut BTreeMap<u64, BlockId> {
        &mut self.planned.as_mut().expect("a plan is followed").regions[r].free
    }

    /// The region holding the block at `ptr`, if it lies in one.
    #[inline]
    pub(super) fn plan_region_at(&self, ptr: u64) -> Option<usize> {
        self.planned.as_ref()?.region_at(ptr)
    }

    /// Puts a free region block into its region's map (`insert_free` for regions).
    pub(super) fn insert_region_free(&mut self, r: usize, id: BlockId) {
        let ptr = self.block(id).ptr;
        self.region_free_mut(r).insert(ptr, id);
    }

    /// Takes a free region block out of its region's map.
    pub(super) fn remove_region_free(&mut self, r: usize, id: BlockId) {
        let ptr = self.block(id).ptr;
        let removed = self.region_free_mut(r).remove(&ptr);
        debug_assert!(removed.is_some(), "free region block {ptr:#x} missing");
    }

    /// For `check_invariants`: whether `id` is in a region's free map under its address, and
    /// how many entries the maps hold; or the first held region that is not one segment of
    /// its size.
    pub(super) fn check_plan_regions(&self) -> Result<(FxHashSetIds, usize), String> {
        let mut ids = FxHashSetIds::default();
        let mut count = 0;
        for region in self.planned_regions() {
            let Some(base) = region.base else {
                if !region.free.is_empty() {
                    return Err("a region not held has free blocks".into());
                }
                continue;
            };
            let Some(head) = self
                .segment_heads()
                .into_iter()
                .find(|&h| self.block(h).ptr == base)
            else {
                return Err(format!("region at {base:#x} is not a segment"));
            };
            let size: u64 = self.segment_blocks(head).map(|(_, b)| b.size).sum();
            if size != region.bytes {
                return Err(format!(
                    "region at {base:#x} spans {size} bytes, planned {}",
                    region.bytes
                ));
            }
            for (&ptr, &id) in &region.free {
                let Some(b) = self.blocks.get(id.index()) else {
                    return Err(format!("region free map names a removed block {ptr:#x}"));
                };
                if b.ptr != ptr || !b.is_free() || ptr.wrapping_sub(base) >= region.bytes {
                    return Err(format!(
                        "region free map entry {ptr:#x} is not a free block of its region"
                    ));
                }
                ids.insert(id);
                count += 1;
            }
        }
        Ok((ids, count))
    }
}

pub(super) type FxHashSetIds = rustc_hash::FxHashSet<BlockId>;
