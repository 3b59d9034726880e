//! Planned placement: following a plan made from a recording (`gpumem plan`).
//!
//! # Note [Planned placement]
//! Training iterations repeat, so the allocations of one iteration can be placed ahead of
//! time. A [`Plan`] lists the allocations of one iteration in order, each with its rounded
//! size, its stream and, where planned, an offset inside its stream's region: one segment
//! per stream, sized so that no two allocations live at once overlap (the planner's work).
//! At run time the allocator keeps a cursor into the plan:
//! - A request that matches the entry at the cursor, or one the job skipped a little
//!   before (it came out of order), or, the job having skipped some, one of the entries
//!   after the cursor ([`RESYNC_WINDOW`] in all), by rounded size and stream, is that entry.
//!   A request of a whole plan that matches none of them, on the stream of the entry at the
//!   cursor and from half to one and a half times its size (a tensor resized across its
//!   class), is that entry, and the cursor stays: had the job added the request, the entry's
//!   own comes next.
//!   Once the job has made a request out of order or skipped an entry (whole plans), an
//!   entry placed just before a persistent one of its size and stream is served as a
//!   persistent one, in a chunk whose size counts it: the follower cannot tell the two
//!   requests apart, and should the job make them the other way round (or skip the first),
//!   the tensor it keeps would sit in a range the plan reuses all iteration.
//!   Streams are matched by their handles as the allocator's callers give them: a plan
//!   made from one process matches another's default stream, not its side streams. A
//!   planned entry is served at its offset when that range of the region is free (a hit). A
//!   persistent entry (it outlived the planned iteration) goes to its offset when it has one,
//!   that range is free and the region can be obtained (the planner's bet that it lives
//!   shorter this time), else right after the last one, in a chunk of its stream: a segment
//!   the size of what the iteration's persistent entries from it on keep (all of them at the
//!   iteration's start), a new one (or one wholly free again) when the current is full.
//!   Either is a hit. An entry with neither goes to the caching allocator.
//! - Whole: a live job's requests are not quite the recorded ones, and a request the plan
//!   cannot put where it planned goes to a free range of its stream's region and chunks that
//!   holds it, the one the plan's next entries need last (`elsewhere.rs`), a hit all the
//!   same: it stays in the plan's memory instead of taking a segment of the caching
//!   allocator's beside it, and out of the way of the entries after it. A planned entry
//!   whose range is still taken may take any such range; a persistent entry whose current
//!   chunk is full (after a wholly free chunk), and a request that matches no entry (or
//!   comes while the plan waits for its first entry), only chunk space or a range of the
//!   region that no entry uses: a request whose lifetime the plan does not know may live
//!   on, and in a range an entry needs it would displace that entry in every later
//!   iteration.
//! - A request the plan's memory cannot hold (its region cannot be obtained and no free
//!   block takes it, or no chunk can be obtained; paged: also a request that matches no
//!   entry, or a planned one whose range is taken) is a miss: the caching allocator serves
//!   it, from segments outside the regions. A request that comes while the plan waits for
//!   its first entry is neither a hit nor a miss, wherever it goes. After [`LOST_AFTER`]
//!   requests in a row that match no entry the plan waits for a request that matches its
//!   first entry, and follows again from there.
//! - Where the plan knows what it saved ([`Plan::saved_bytes`]), the caching allocator's
//!   new large segments of the default pool (not expandable) take PyTorch's sizes while its
//!   memory outside the plan has grown by no more than that since the plan first began
//!   following (weights and a warm-up's cache come before), and the request rounded up to
//!   2 MiB past it, once the pool's whole free segments are given back (outside a capture):
//!   misses share a 20 MiB segment while the saving pays for it; past it, what the caching
//!   allocator holds beside the plan is what they use, no more.
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
//! **Whole** ([`PlanMode::Whole`], the default): a region or chunk is one segment of the
//! driver's, obtained at its first hit, so a steady iteration costs no driver call.
//!
//! **Paged** ([`PlanMode::Paged`], on a device with virtual memory): a region or chunk is a
//! reservation of address space, an expandable segment of the plan's own ([`PLAN_PAGE`]
//! pages), whose pages are mapped when a planned allocation first uses them; what the job
//! holds is what it uses, rounded to pages. A chunk spans 9/8 of the device (address space is not memory) and grows
//! page by page. A page a region or chunk needs is *lent* where the stream has one to spare,
//! before a new one is created: a chunk's free pages that the iteration's remaining
//! persistent entries will not bump into (memory the job freed), and, for a chunk, a
//! region's free pages that no entry of the iteration's rest uses (the kept memory takes
//! what the iteration freed, as the caching allocator lets it). A lent page is mapped at the
//! borrower's address (the plan's offsets are addresses) and stays mapped where it was,
//! unmapped to the allocator, until the next iteration begins (its first entry matched):
//! then, after one synchronisation of the stream, its old mappings are unmapped, and the
//! region maps a page there again at its next use. Unmaps happen only there and at cache
//! flushes, which unmap every free page and give back wholly unmapped reservations; none
//! while a graph capture is under way (the boundary's work waits for one outside it). A
//! range over a lent page still mapped is a miss. Statistics, the trace (`segment_map`,
//! `segment_unmap`) and snapshots count pages as for expandable segments: a lent page is
//! unmapped from its lender and mapped at its borrower when it is lent (the lender's old
//! mapping, which only the device still has, is not traced when it goes). [`PlanPaging`]
//! counts maps, lent and unmapped pages and synchronisations.
//!
//! Once per plan, at the boundary after the first iteration the plan served alone (no
//! request of the default pool went to the caching allocator), the caching allocator's
//! whole free segments of the default pool are given back, after waiting for pending frees:
//! a job that planned itself (`plan_record`) cached them before it followed the plan, and
//! no request of its iterations asks for them any more.
//!
//! # Invariants
//! - A plan is valid before the allocator follows it ([`Plan::validate`]): at most
//!   [`MAX_PLAN_ENTRIES`] entries, [`MAX_PLAN_STREAMS`] regions (one per stream) and as many
//!   streams with persistent entries,
//!   sizes and offsets multiples of 512, every planned range inside its stream's region.
//! - A held region is one segment of exactly its planned size whose free blocks are exactly
//!   the entries of its free map, under their addresses; none of them is in a pool.
//! - A block is tagged held (`Block::held`) iff it lies in a held region or chunk: the port
//!   (`pool.rs`) sends a free or unmapped block to the plan's maps by the tag alone.
//! - Following a plan panics nowhere: a step that finds the plan's record disagreeing with
//!   itself returns [`PlanError::Internal`].
//! - A region or chunk is given back only when it holds one free block spanning it (paged:
//!   one unmapped block).
//! - Paged: a page has a physical handle iff it lies in a mapped block (as for expandable
//!   segments); a lent page lies in an unmapped block of the segment it was lent from, and
//!   is lent only to the same stream.
//!
//! # Budgets
//! - Time: a request matches among at most 2 × [`RESYNC_WINDOW`] + 1 entries; one the plan
//!   cannot put where it planned scans the free blocks of its stream's region and chunks
//!   (each holds at most one more free block than live ones) and at most [`LOOKAHEAD`]
//!   entries, in O((blocks + entries) × log blocks), or (its lifetime unknown) the region's
//!   last uses, in O(blocks × log entries). A new segment of the caching allocator's past
//!   the plan's saving scans the default large pool's free blocks once. Setting a plan sorts
//!   its entries' ranges once (O(entries × log entries)).
//! - Host memory: the plan and its per-region tables (O(entries)), and per held region or
//!   chunk its maps of free, unmapped and lent blocks and pages, counted in the allocator's
//!   `heap_bytes` in constant time. A paged region or chunk is address space, whatever its
//!   size: only its mapped pages cost memory, and every map is first held to the page
//!   budget (`paging.rs`), so a region far larger than the device is no more than one
//!   reservation until it is used, and then fails early rather than mapping millions of
//!   pages.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::device::{Device, DevicePtr, StreamId};

use rustc_hash::FxHashSet;

use crate::allocator::block::{Block, BlockId};

mod elsewhere;
mod paging;
use crate::allocator::pool_id::{PoolRef, PoolSlot};
use crate::allocator::size::{self, MIN_BLOCK_SIZE, PoolKind};
use crate::allocator::{AllocError, CachingAllocator, TraceAction};
pub use elsewhere::LOOKAHEAD;
use paging::{HeldPages, last_uses};
pub use paging::{PLAN_PAGE, PlanPaging};

/// The most entries a plan may hold.
pub const MAX_PLAN_ENTRIES: usize = 1 << 20;
/// The most regions (streams) a plan may hold.
pub const MAX_PLAN_STREAMS: usize = 64;
/// The largest region: the largest device gpumem models.
pub const MAX_REGION_BYTES: u64 = crate::allocator::size::MAX_DEVICE_BYTES;
/// How many entries a request may match: the one expected and those after it (allocations
/// the job skipped); and how far back skipped entries are remembered (requests made out of
/// order).
pub const RESYNC_WINDOW: usize = 16;
/// Requests in a row that match no entry after which the plan waits for its first entry
/// again.
pub const LOST_AFTER: u32 = 16;

/// Whether a request of `size` on `stream` that matches no entry may be `entry` resized
/// across its rounded class: on its stream, between half and one and a half times its size.
fn resized(entry: &PlanEntry, size: u64, stream: StreamId) -> bool {
    entry.stream == stream
        && size >= entry.size / 2
        && size <= entry.size.saturating_add(entry.size / 2)
}

/// The entries placed in a region just before (on the iteration's circle) a persistent entry
/// of their size and stream, in order.
fn before_kept(entries: &[PlanEntry]) -> Vec<usize> {
    let n = entries.len();
    (0..n)
        .filter(|&j| {
            let (e, next) = (&entries[j], &entries[wrap(j + 1, n)]);
            n > 1
                && !e.persistent
                && e.offset.is_some()
                && next.persistent
                && (next.size, next.stream) == (e.size, e.stream)
        })
        .collect()
}

/// `j` on a circle of `n`, for `j` below `2n`.
fn wrap(j: usize, n: usize) -> usize {
    if j >= n { j - n } else { j }
}

/// The error of a step that finds the plan's record disagreeing with itself (`what`).
fn internal(what: &'static str) -> AllocError {
    AllocError::Plan(PlanError::Internal(what))
}

/// A placement plan: one iteration's allocations and where each goes. See the module
/// documentation. Its file (format, version, where it came from, the JSON schema) is
/// `gpumem::plan::PlanFile`: the core reads no file.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// One region per stream.
    pub regions: Vec<PlanRegion>,
    /// The iteration's allocations in order.
    pub entries: Vec<PlanEntry>,
    /// How its regions and chunks hold memory.
    pub mode: PlanMode,
    /// Bytes the plan held less than the caching allocator on the iterations it was
    /// evaluated on, where known: how much the caching allocator's memory beside it may grow
    /// in PyTorch's segment sizes, once it follows, before a new segment is only the request
    /// rounded up to 2 MiB (Note [Planned placement]).
    pub saved_bytes: Option<u64>,
}

/// How a plan's regions and chunks hold memory: the trade between driver work and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlanMode {
    /// Time first: each region or chunk is one segment, obtained whole at its first hit and
    /// kept until a cache flush, so a steady iteration makes no driver call after the first
    /// (the driver work of the caching allocator's segments, no more).
    #[default]
    Whole,
    /// Memory first: regions and chunks are address space whose pages are mapped at first
    /// use and lent between them (Note [Planned placement]); a page costs driver calls of
    /// its own. Whole on a device without virtual memory.
    Paged,
}

/// A stream's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanRegion {
    /// The stream, as the allocator's callers name it.
    pub stream: StreamId,
    /// Its size in bytes.
    pub bytes: u64,
}

/// One allocation of the iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanEntry {
    /// The request's size after rounding.
    pub size: u64,
    /// The stream it is made on.
    pub stream: StreamId,
    /// Its offset in the stream's region: where it goes when it is freed within an
    /// iteration, where it is tried first when persistent.
    pub offset: Option<u64>,
    /// It outlives an iteration: placed one after another in chunks of the stream (whole:
    /// each at most the size of an iteration's persistent entries), unless its offset is
    /// given and that range is free. An entry with neither goes to the caching allocator.
    pub persistent: bool,
}

/// Why a plan cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Something out of bounds or inconsistent, named.
    #[error("invalid plan: {0}")]
    Invalid(String),
    /// The allocator's record of the plan disagrees with itself (a bug in gpumem, reported
    /// instead of a panic; `check_invariants` names the first broken invariant).
    #[error("internal error following the plan: {0}")]
    Internal(&'static str),
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
    /// Bytes of device memory the regions and chunks hold now (their mapped pages, where
    /// they are paged).
    pub held_bytes: u64,
    /// Of those, the bytes of regions and chunks that hold a live (or pending) block.
    pub pinned_bytes: u64,
    /// Whether requests are matched from the cursor (else: waiting for the first entry).
    pub following: bool,
    /// Whether regions and chunks are paged (the plan asks for it and the device offers
    /// virtual memory).
    pub paged: bool,
    /// What paging did so far.
    pub paging: PlanPaging,
}

/// The allocator's side of a plan it follows.
#[derive(Debug, Clone)]
pub(in crate::allocator) struct Following {
    plan: Arc<Plan>,
    /// Per planned stream: its region's size and base while held.
    regions: Vec<(StreamId, u64, Option<u64>)>,
    /// Per region: the last entry of the iteration that uses each part of it, as a step
    /// function of the offset (`None`: no entry does), equal steps merged. Paged: where a
    /// region page lies past its last use, a chunk may borrow it until the iteration ends.
    /// Whole: a request of unknown lifetime takes only parts no entry uses.
    last_use: Vec<BTreeMap<u64, Option<usize>>>,
    /// Per stream with persistent entries: an iteration's persistent bytes, those of
    /// `before_kept` included (the most a whole plan's new chunk takes), and the chunk bumped
    /// now.
    chunks: Vec<(StreamId, u64, Option<u64>)>,
    /// Per chunk stream: (entry, bytes of the stream's persistent entries from it on, and
    /// with those of `before_kept`), for each persistent entry and each of `before_kept` in
    /// order: what the iteration's rest will bump (once disordered, the second).
    persistent_rest: Vec<Vec<(usize, u64, u64)>>,
    /// Every region and chunk held, by base.
    held: BTreeMap<u64, Held>,
    /// The entry the next request is expected to be.
    cursor: usize,
    /// Whole plans: entries of this iteration the job skipped (a request matched one after
    /// them), at most [`RESYNC_WINDOW`] before the last matched: a request made out of
    /// order may be one of them.
    skipped: Vec<usize>,
    /// Entries of the current iteration matched so far: the last one's index plus one.
    position: usize,
    /// Whether requests are being matched from the cursor (else: waiting for entry 0).
    following: bool,
    misses_in_row: u32,
    /// The entry at the cursor, where a request of another size took it (a tensor resized
    /// across its class) and the cursor stayed.
    resized: Option<usize>,
    /// Whole plans: the entries placed in a region just before a persistent one of their
    /// size and stream, in order (see `disordered`).
    before_kept: Vec<usize>,
    /// Whole plans: the job has made a request out of order, or skipped an entry, since the
    /// plan was set (Note [Planned placement]).
    disordered: bool,
    /// Requests of the default pool the caching allocator served since the iteration began
    /// (misses, entries left to it, requests while not following).
    served_outside: u64,
    /// Regions and chunks reserve address space and map pages on use.
    paged: bool,
    /// The segment counter when the plan was set: segments below it are the caching
    /// allocator's from before (whole plans put persistent entries in their free parts).
    counter_at_start: u32,
    /// The bytes the caching allocator held outside the plan when the plan first began
    /// following (the job's weights, its warm-up's cache): misses spend the plan's
    /// `saved_bytes` beyond them.
    outside_at_start: Option<u64>,
    paging: PlanPaging,
}

/// A region or chunk held from the driver.
#[derive(Debug, Clone)]
struct Held {
    bytes: u64,
    /// A region (else a chunk).
    region: bool,
    stream: StreamId,
    /// Its free mapped blocks by address.
    free: BTreeMap<u64, BlockId>,
    /// Where paged: its pages.
    paging: Option<HeldPages>,
}

impl Held {
    /// Whether no block of it is allocated: its free and unmapped blocks tile it.
    fn idle(&self, blocks: &slab::Slab<Block>) -> bool {
        let free: u64 = self.free.values().map(|id| blocks[id.index()].size).sum();
        free + self.unmapped_bytes(blocks) == self.bytes
    }

    /// Bytes of device memory it holds: all of it, or its mapped pages.
    fn mapped_bytes(&self, blocks: &slab::Slab<Block>) -> u64 {
        self.bytes - self.unmapped_bytes(blocks)
    }

    fn unmapped_bytes(&self, blocks: &slab::Slab<Block>) -> u64 {
        let unmapped = self.paging.iter().flat_map(|p| p.unmapped.values());
        unmapped.map(|id| blocks[id.index()].size).sum()
    }

    /// Of its free and unmapped blocks starting within `starts`, the last: (address, size).
    fn last_idle_block(
        &self,
        starts: impl std::ops::RangeBounds<u64> + Clone,
        blocks: &slab::Slab<Block>,
    ) -> Option<(u64, u64)> {
        let free = self.free.range(starts.clone()).next_back();
        let unmapped = (self.paging.as_ref()).and_then(|p| p.unmapped.range(starts).next_back());
        free.max(unmapped)
            .map(|(&ptr, id)| (ptr, blocks[id.index()].size))
    }

    /// Whether free and unmapped blocks cover `[from, to)`.
    fn range_free(&self, from: u64, to: u64, blocks: &slab::Slab<Block>) -> bool {
        let mut at = from;
        while at < to {
            match self.last_idle_block(..=at, blocks) {
                Some((ptr, size)) if ptr + size > at => at = ptr + size,
                _ => return false,
            }
        }
        true
    }

    /// Its first block (free or unmapped: only asked of an idle one).
    fn head(&self, base: u64) -> Option<BlockId> {
        let unmapped = self.paging.as_ref().and_then(|p| p.unmapped.get(&base));
        self.free.get(&base).or(unmapped).copied()
    }

    /// Where the run of free and unmapped blocks that ends it starts.
    fn tail_start(&self, base: u64, blocks: &slab::Slab<Block>) -> u64 {
        let mut at = base + self.bytes;
        while let Some((ptr, size)) = self.last_idle_block(..at, blocks) {
            if ptr + size != at {
                break;
            }
            at = ptr;
        }
        at
    }
}

/// What the plan says about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Host memory it holds, estimated in time independent of the blocks and pages: the
    /// plan (shared with its caller, counted here all the same), the per-region and
    /// per-chunk tables, the held regions and chunks, and their maps, which hold at most
    /// each of the allocator's `blocks` once, and lent pages among its `pages` once.
    pub(in crate::allocator) fn heap_bytes(&self, blocks: usize, pages: usize) -> usize {
        use std::mem::size_of;
        // B-tree entries twice over: nodes are half full at worst.
        let last_use: usize = self.last_use.iter().map(BTreeMap::len).sum();
        let rest: usize = self.persistent_rest.iter().map(Vec::capacity).sum();
        self.plan.entries.capacity() * size_of::<PlanEntry>()
            + self.plan.regions.capacity() * size_of::<PlanRegion>()
            + (self.regions.capacity() + self.chunks.capacity())
                * size_of::<(StreamId, u64, Option<u64>)>()
            + last_use * 2 * size_of::<(u64, Option<usize>)>()
            + rest * size_of::<(usize, u64, u64)>()
            + self.before_kept.capacity() * size_of::<usize>()
            + self.held.len() * 2 * size_of::<(u64, Held)>()
            + (blocks + pages) * 2 * size_of::<(u64, BlockId)>()
    }

    fn new(plan: Arc<Plan>, paged: bool, counter_at_start: u32) -> Following {
        let regions: Vec<(StreamId, u64, Option<u64>)> = plan
            .regions
            .iter()
            .map(|r| (r.stream, r.bytes, None))
            .collect();
        let last_use = regions
            .iter()
            .map(|r| last_uses(&plan.entries, r.0))
            .collect();
        let before_kept = if paged {
            Vec::new()
        } else {
            before_kept(&plan.entries)
        };
        // What goes to chunks: persistent entries, and those before one once disordered.
        let chunked = |j: usize| {
            let e = &plan.entries[j];
            (e.persistent || before_kept.binary_search(&j).is_ok()).then_some(e)
        };
        let mut chunks: Vec<(StreamId, u64, Option<u64>)> = Vec::new();
        for e in (0..plan.entries.len()).filter_map(chunked) {
            match chunks.iter_mut().find(|c| c.0 == e.stream) {
                Some(c) => c.1 = c.1.saturating_add(e.size),
                None => chunks.push((e.stream, e.size, None)),
            }
        }
        for c in &mut chunks {
            c.1 = size::round_to_large(c.1).min(MAX_REGION_BYTES);
        }
        let persistent_rest = chunks
            .iter()
            .map(|c| {
                let mut rest: Vec<(usize, u64, u64)> = Vec::new();
                let (mut bytes, mut with_before_kept) = (0u64, 0u64);
                for j in (0..plan.entries.len()).rev() {
                    let Some(e) = chunked(j).filter(|e| e.stream == c.0) else {
                        continue;
                    };
                    if e.persistent {
                        bytes = bytes.saturating_add(e.size);
                    }
                    with_before_kept = with_before_kept.saturating_add(e.size);
                    rest.push((j, bytes, with_before_kept));
                }
                rest.reverse();
                rest
            })
            .collect();
        Following {
            plan,
            regions,
            last_use,
            chunks,
            persistent_rest,
            held: BTreeMap::new(),
            cursor: 0,
            skipped: Vec::new(),
            position: 0,
            following: false,
            misses_in_row: 0,
            resized: None,
            before_kept,
            disordered: false,
            served_outside: 0,
            paged,
            counter_at_start,
            outside_at_start: None,
            paging: PlanPaging::default(),
        }
    }

    /// Region `r`: its stream, size and base where held.
    fn region_mut(&mut self, r: usize) -> Result<&mut (StreamId, u64, Option<u64>), AllocError> {
        let region = self.regions.get_mut(r);
        region.ok_or_else(|| internal("no such region"))
    }

    /// Chunk list `c`: its stream, size and current chunk's base.
    fn chunk_mut(&mut self, c: usize) -> Result<&mut (StreamId, u64, Option<u64>), AllocError> {
        let chunk = self.chunks.get_mut(c);
        chunk.ok_or_else(|| internal("no such chunk list"))
    }

    /// The held region or chunk at `base`.
    fn held(&self, base: u64) -> Result<&Held, AllocError> {
        let held = self.held.get(&base);
        held.ok_or_else(|| internal("no region or chunk held there"))
    }

    /// What the plan says about a request, and whether it begins an iteration.
    fn match_request(&mut self, size: u64, stream: StreamId) -> (Expect, bool) {
        let entries = &self.plan.entries;
        let n = entries.len();
        // The cursor is below n and the window at most n: `wrap` suffices.
        let matches = |j: usize| {
            let e = &entries[wrap(j, n)];
            e.size == size && e.stream == stream
        };
        let found = if !self.following {
            matches(0).then_some(0)
        } else if matches(self.cursor) {
            Some(self.cursor)
        } else {
            // A request made out of order: one of the entries skipped a little before (whole
            // plans only: a paged plan lends what the iteration's rest will not use, from the
            // last entry matched on).
            if !self.paged
                && let Some(k) = self.skipped.iter().position(|&j| matches(j))
            {
                let j = self.skipped.remove(k);
                self.misses_in_row = 0;
                self.disordered = true;
                return (self.expect(j, stream), false);
            }
            let later = (1..RESYNC_WINDOW.min(n))
                .map(|k| self.cursor + k)
                .find(|&j| matches(j));
            self.disordered |= later.is_some();
            later
        };
        let Some(unwrapped) = found else {
            if !self.following {
                return (Expect::Idle, false);
            }
            // A tensor resized across its class: the entry at the cursor, which stays there
            // (were the request one the job added, the entry's own would come next).
            if !self.paged && resized(&entries[self.cursor], size, stream) {
                self.misses_in_row = 0;
                self.resized = Some(self.cursor);
                return (self.expect(self.cursor, stream), false);
            }
            self.misses_in_row += 1;
            self.paging.unmatched += 1;
            if self.misses_in_row >= LOST_AFTER {
                self.paging.lost += 1;
                self.following = false;
                self.position = 0;
                self.skipped.clear();
            }
            return (Expect::Miss, false);
        };
        let j = wrap(unwrapped, n);
        let begins = !self.following || j < self.position;
        // Passed over: not one a resized request took.
        let resized = self.resized;
        let passed = |from: usize| (from..j).filter(move |&k| Some(k) != resized);
        if begins {
            // What the iteration before skipped is not this one's; this one's first entries,
            // passed over (its first request came late), are.
            self.skipped.clear();
            self.skipped.extend(passed(0));
        } else {
            // Remembered for a while: the job may make them a little later.
            self.skipped.extend(passed(self.cursor));
            let oldest = j.saturating_sub(RESYNC_WINDOW);
            self.skipped.retain(|&s| s >= oldest);
        }
        self.following = true;
        self.misses_in_row = 0;
        self.resized = None;
        self.cursor = wrap(j + 1, n);
        if self.cursor == 0 {
            // The iteration's last entry: what it skipped is not the next one's.
            self.skipped.clear();
        }
        self.position = j + 1;
        (self.expect(j, stream), begins)
    }

    /// What entry `j` says about a request on `stream`.
    fn expect(&self, j: usize, stream: StreamId) -> Expect {
        let Some(e) = self.plan.entries.get(j) else {
            return Expect::Miss;
        };
        // A validated plan has a region for every planned entry's stream and chunks for every
        // persistent one's; were one missing, the entry would go to the caching allocator.
        let at = e
            .offset
            .and_then(|offset| Some((self.region_of(stream)?, offset)));
        let chunk = self.chunks.iter().position(|c| c.0 == stream);
        if self.disordered
            && !e.persistent
            && let Some(chunk) = chunk
            && self.before_kept.binary_search(&j).is_ok()
        {
            return Expect::Persistent { tried: None, chunk };
        }
        match (e.persistent, chunk, at) {
            (true, Some(chunk), tried) => Expect::Persistent { tried, chunk },
            (false, _, Some((region, offset))) => Expect::Placed { region, offset },
            _ => Expect::Unplanned,
        }
    }

    /// Entry `j` of the circle, `j` below twice the entries (a cursor and a window, each
    /// below their count): no division on the hot path.
    fn entry(&self, j: usize) -> &PlanEntry {
        let entries = &self.plan.entries;
        &entries[wrap(j, entries.len())]
    }

    /// The region of `stream`, by index.
    fn region_of(&self, stream: StreamId) -> Option<usize> {
        self.regions.iter().position(|r| r.0 == stream)
    }

    /// Bytes of device memory its regions and chunks hold (their mapped pages, where paged).
    fn held_bytes(&self, blocks: &slab::Slab<Block>) -> u64 {
        self.held.values().map(|h| h.mapped_bytes(blocks)).sum()
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
        let paged = plan.mode == PlanMode::Paged
            && self.device.supports_virtual_memory()
            && self
                .device
                .page_granularity()
                .is_ok_and(|g| PLAN_PAGE.is_multiple_of(g));
        self.planned = Some(Box::new(Following::new(plan, paged, self.next_counter)));
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
        Some(PlanStatus {
            held_bytes: planned.held_bytes(&self.blocks),
            pinned_bytes: (planned.held.values())
                .filter(|h| !h.idle(&self.blocks))
                .map(|h| h.mapped_bytes(&self.blocks))
                .sum(),
            following: planned.following,
            paged: planned.paged,
            paging: planned.paging,
        })
    }

    /// Serves a rounded request from the plan when it expects it and can: `Ok(None)` sends
    /// it to the caching allocator. Out of line: `malloc` without a plan pays one test.
    #[inline(never)]
    pub(in crate::allocator) fn plan_malloc(
        &mut self,
        rounded: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let Some(planned) = self.planned.as_mut() else {
            return Ok(None);
        };
        let (expect, begins) = planned.match_request(rounded, stream);
        if begins && planned.outside_at_start.is_none() {
            let outside = self.outside_plan_bytes();
            self.planned_mut()?.outside_at_start = Some(outside);
        }
        let planned = self.planned_mut()?;
        if begins {
            let served_alone = planned.paging.iterations > 0 && planned.served_outside == 0;
            planned.paging.iterations += 1;
            planned.served_outside = 0;
            // Neither synchronisations nor frees while a capture is under way (Note [Private
            // pools]): lent pages stay lent (a range over one is a miss) until a boundary
            // outside it.
            if !self.capturing() {
                // The iteration before is over: what it lent is unmapped where it came from.
                self.unmap_stale_pages(&mut Vec::new())?;
                if served_alone && self.following()?.paging.cache_releases == 0 {
                    self.release_idle_cache()?;
                }
            }
        }
        let placed = match expect {
            Expect::Placed { region, offset } => {
                match self.place(region, offset, rounded, requested)? {
                    Some(ptr) => Some(ptr),
                    None => self.place_elsewhere(stream, rounded, requested, true)?,
                }
            }
            Expect::Persistent { tried, chunk } => {
                if let Some((region, offset)) = tried
                    && let Some(ptr) = self.place(region, offset, rounded, requested)?
                {
                    Some(ptr)
                } else {
                    self.bump(chunk, rounded, requested)?
                }
            }
            // Its lifetime unknown: only where the next entries will not need it, for it could
            // stay for good.
            Expect::Miss => self.place_elsewhere(stream, rounded, requested, false)?,
            // Not following: neither a hit nor a miss of the plan's, wherever it goes.
            Expect::Idle => {
                let placed = self.place_elsewhere(stream, rounded, requested, false)?;
                if placed.is_none() {
                    self.planned_mut()?.served_outside += 1;
                }
                return Ok(placed);
            }
            Expect::Unplanned => {
                self.planned_mut()?.served_outside += 1;
                return Ok(None);
            }
        };
        if placed.is_some() {
            self.stats.num_plan_hits.bump();
        } else {
            self.stats.num_plan_misses.bump();
            self.planned_mut()?.served_outside += 1;
        }
        Ok(placed)
    }

    /// The size of a new segment the caching allocator obtains for a rounded request of
    /// `pool` (`sized`: PyTorch's size) once a plan that knows what it saved has begun
    /// following (misses, entries left to the caching allocator, requests while the plan
    /// waits again): PyTorch's while the memory outside the plan has grown by no more than
    /// that saving since, else the request rounded up to 2 MiB, after the pool's whole free
    /// segments are given back (outside a capture). Misses share the caching allocator's
    /// large segments while the plan's saving pays for them; past it, the memory beside the
    /// plan is what its misses use, no more. The default pool's large segments only,
    /// expandable ones not.
    pub(in crate::allocator) fn segment_beside_plan(
        &mut self,
        pool: PoolRef,
        rounded: u64,
        sized: u64,
    ) -> Result<u64, AllocError> {
        let Some(planned) = self.planned.as_deref() else {
            return Ok(sized);
        };
        let (Some(saved), Some(before)) = (planned.plan.saved_bytes, planned.outside_at_start)
        else {
            return Ok(sized);
        };
        if !pool.owner.is_default() || pool.kind != PoolKind::Large || self.expandable_segments() {
            return Ok(sized);
        }
        let grown = self.outside_plan_bytes().saturating_sub(before);
        if grown.saturating_add(sized) <= saved {
            return Ok(sized);
        }
        // Past the saving, a whole free segment is memory held beyond what the caching
        // allocator alone would hold, and none holds this request on its stream (else no new
        // segment were asked for).
        if !self.capturing() {
            self.release_blocks(pool)?;
        }
        Ok(sized.min(size::round_to_large(rounded)))
    }

    /// Bytes the caching allocator holds outside the plan's regions and chunks.
    fn outside_plan_bytes(&self) -> u64 {
        let held = (self.planned.as_deref()).map_or(0, |planned| planned.held_bytes(&self.blocks));
        let reserved = self.stats.reserved_bytes.all_current().max(0) as u64;
        reserved.saturating_sub(held)
    }

    /// The plan followed: called only where one is (an error otherwise, never a panic).
    fn planned_mut(&mut self) -> Result<&mut Following, AllocError> {
        self.planned
            .as_deref_mut()
            .ok_or_else(|| internal("no plan is followed"))
    }

    fn following(&self) -> Result<&Following, AllocError> {
        self.planned
            .as_deref()
            .ok_or_else(|| internal("no plan is followed"))
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
        let (stream, bytes, base) = *self.planned_mut()?.region_mut(r)?;
        let base = match base {
            Some(base) => base,
            None => {
                let Some(base) = self.hold(stream, bytes, true)? else {
                    return Ok(None);
                };
                self.planned_mut()?.region_mut(r)?.2 = Some(base);
                base
            }
        };
        self.carve(base, base + offset, size, requested)
    }

    /// Whole plans, a request the plan cannot put where it planned: a free range of its
    /// stream's region and chunks that the plan's next entries need last, or (its lifetime
    /// not known) not at all (`elsewhere.rs`); `Ok(None)` if none holds it. A live job's
    /// requests are not quite the recorded ones: this keeps them in the plan's memory.
    fn place_elsewhere(
        &mut self,
        stream: StreamId,
        size: u64,
        requested: u64,
        lifetime_known: bool,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let following = self.following()?;
        if following.paged {
            return Ok(None);
        }
        let Some((ptr, base)) =
            following.displaced_range(stream, size, lifetime_known, &self.blocks, self.fit_order)
        else {
            return Ok(None);
        };
        let placed = self.carve(base, ptr, size, requested)?;
        if placed.is_some() {
            self.planned_mut()?.paging.placed_elsewhere += 1;
        }
        Ok(placed)
    }

    /// Allocates `size` bytes at the start of the free tail of the stream's current chunk,
    /// or of a wholly free chunk of the stream, or (whole plans) in a free range of its chunks
    /// or region that no entry of the plan uses (`elsewhere.rs`) or the caching
    /// allocator's cache from before the plan, or of a new chunk the size of the iteration's
    /// persistent entries still to come; `Ok(None)` if no chunk can be obtained.
    fn bump(
        &mut self,
        c: usize,
        size: u64,
        requested: u64,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let (stream, bytes, current) = *self.planned_mut()?.chunk_mut(c)?;
        if let Some(base) = current {
            let held = self.following()?.held(base)?;
            let tail = held.tail_start(base, &self.blocks);
            if base + held.bytes - tail >= size
                && let Some(ptr) = self.carve(base, tail, size, requested)?
            {
                return Ok(Some(ptr));
            }
        }
        let planned = self.following()?;
        // Of the wholly free chunks large enough, the first by the pools' tie-break: the lowest
        // address, or the oldest (PyTorch 2.12 and later).
        let order = self.fit_order;
        let reuse = planned
            .held
            .iter()
            .filter(|&(_, h)| {
                !h.region
                    && h.bytes >= size
                    && h.stream == stream
                    && h.paging.as_ref().is_none_or(|p| p.stale.is_empty())
                    && h.idle(&self.blocks)
            })
            .filter_map(|(&b, h)| Some((b, self.blocks.get(h.head(b)?.index())?.counter)))
            .min_by_key(|&(b, counter)| order.tie(counter, b))
            .map(|(b, _)| b);
        if let Some(base) = reuse
            && let Some(ptr) = self.carve(base, base, size, requested)?
        {
            self.planned_mut()?.chunk_mut(c)?.2 = Some(base);
            return Ok(Some(ptr));
        }
        // A hole in a chunk (a tensor that did not live on after all), or a range of the
        // region no entry uses, before new memory.
        if let Some(ptr) = self.place_elsewhere(stream, size, requested, false)? {
            return Ok(Some(ptr));
        }
        if let Some(id) = self.cached_from_before(stream, size)? {
            self.planned_mut()?.paging.from_cache += 1;
            return Ok(Some(self.serve_found_block(id, size, requested)));
        }
        // What the iteration's rest keeps, not a whole iteration's: a chunk filled early (by
        // requests the plan did not expect) costs no more than the entries still to come.
        let rest = self.following()?.persistent_to_come(c).min(bytes);
        let mut bytes = size::round_to_large(rest.max(size));
        if self.following()?.paged {
            // Address space is not memory: a paged chunk spans 9/8 of the device, as an
            // expandable segment does, and grows page by page for as long as the job keeps
            // memory, with one partly used page at its end.
            let total = self.device.mem_get_info()?.total;
            bytes = bytes.max((total / 8).saturating_mul(9).min(MAX_REGION_BYTES));
        }
        let Some(base) = self.hold(stream, bytes, false)? else {
            return Ok(None);
        };
        self.planned_mut()?.chunk_mut(c)?.2 = Some(base);
        self.carve(base, base, size, requested)
    }

    /// Whole plans, before a new chunk: the best-fitting block the caching allocator cached
    /// in a whole segment it obtained before the plan was set, taken out of its pool. A job
    /// that planned itself keeps those segments (they hold its weights too): their free
    /// parts take its kept memory instead of new chunks beside them.
    fn cached_from_before(
        &mut self,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let planned = self.following()?;
        if planned.paged || !self.expandable_segments.is_empty() {
            return Ok(None);
        }
        let before = planned.counter_at_start;
        let pool = PoolRef {
            owner: PoolSlot::DEFAULT,
            kind: PoolKind::for_size(size),
        };
        let Some(entry) = self.pool(pool).free.lower_bound(stream, size) else {
            return Ok(None);
        };
        let fits = size::fits(
            entry.size,
            size,
            self.config.max_split_size,
            self.config.max_non_split_rounding_size,
        );
        if !fits || self.block(entry.id).counter >= before {
            return Ok(None);
        }
        self.pool_mut(pool)
            .free
            .remove(stream, entry.size, entry.tie);
        Ok(Some(entry.id))
    }

    /// Obtains a region or chunk of `bytes` from the driver: one free block of a large-pool
    /// segment, or, paged, a reservation of address space as one unmapped block of an
    /// expandable segment; `Ok(None)` when the process limit or the driver says no.
    fn hold(
        &mut self,
        stream: StreamId,
        bytes: u64,
        region: bool,
    ) -> Result<Option<u64>, AllocError> {
        let (id, free, paging) = if self.following()?.paged {
            let Some((id, pages)) = self.reserve_pages(stream, bytes)? else {
                return Ok(None);
            };
            (id, BTreeMap::new(), Some(pages))
        } else {
            let pool = PoolRef::default_pool(PoolKind::Large);
            if !self.within_limit(bytes) {
                return Ok(None);
            }
            let Some(id) = self.new_segment(bytes, stream, pool)? else {
                return Ok(None);
            };
            (id, BTreeMap::from([(self.block(id).ptr, id)]), None)
        };
        // One block spans it: its size is the held size (paged: rounded up to pages). It and
        // every piece carved from it are the plan's.
        self.block_mut(id).hold_for_plan();
        let (ptr, bytes) = (self.block(id).ptr, self.block(id).size);
        let held = Held {
            bytes,
            region,
            stream,
            free,
            paging,
        };
        self.planned_mut()?.held.insert(ptr, held);
        Ok(Some(ptr))
    }

    /// Allocates `[addr, addr + size)` of the held segment at `base`, if free (paged: its
    /// pages are mapped then, and only then): split off in front and behind as needed, the
    /// statistics counted as `alloc_found_block` counts them.
    fn carve(
        &mut self,
        base: u64,
        addr: u64,
        size: u64,
        requested: u64,
    ) -> Result<Option<DevicePtr>, AllocError> {
        let free = self
            .following()?
            .held
            .get(&base)
            .is_some_and(|h| h.range_free(addr, addr + size, &self.blocks));
        if !free || !self.map_for(base, addr, size)? {
            return Ok(None);
        }
        let Some(held) = self.following()?.held.get(&base) else {
            return Ok(None);
        };
        let Some((&start, &id)) = held.free.range(..=addr).next_back() else {
            return Ok(None);
        };
        let block = self.block(id);
        if block.ptr + block.size < addr + size {
            return Ok(None);
        }
        let (was_split, whole) = (block.is_split(), block.size);
        let expandable = block.expandable.is_some();
        self.held_free_mut(base)?.remove(&start);
        let (mut pieces, mut piece_bytes) = (0i64, 0i64);
        let mut id = id;
        if addr > start {
            let front = self.split_front(id, addr - start);
            let bytes = self.block(front).size;
            self.held_free_mut(base)?.insert(start, front);
            pieces += 1;
            piece_bytes += bytes as i64;
        }
        if self.block(id).size > size {
            let taken = self.split_front(id, size);
            let (ptr, bytes) = (self.block(id).ptr, self.block(id).size);
            self.held_free_mut(base)?.insert(ptr, id);
            pieces += 1;
            piece_bytes += bytes as i64;
            id = taken;
        }
        let kind = PoolKind::Large;
        // Blocks of expandable segments never count as inactive splits.
        if !expandable {
            self.stats
                .inactive_split
                .update(kind, pieces - i64::from(was_split));
            self.stats
                .inactive_split_bytes
                .update(kind, piece_bytes - if was_split { whole as i64 } else { 0 });
        }
        let block = self.block_mut(id);
        block.set_allocated(true);
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
        Ok(Some(DevicePtr(addr)))
    }

    /// After the first iteration the plan served alone, gives back the caching allocator's
    /// whole free segments of the default pool (and its expandable segments' free pages),
    /// once: memory from before the plan was followed (a job that planned itself), which no
    /// request of the plan's iterations asks for. Nothing (not even a synchronisation) when
    /// there are none; a job whose later iterations go to the caching allocator again keeps
    /// its cache from then on, as PyTorch's would.
    fn release_idle_cache(&mut self) -> Result<(), AllocError> {
        let pools = [PoolKind::Large, PoolKind::Small].map(PoolRef::default_pool);
        let idle = pools.iter().any(|&pool| {
            self.pool(pool).free.iter().any(|(_, e)| {
                let b = self.block(e.id);
                match b.expandable {
                    Some(_) => self.holds_whole_page(e.id),
                    None => !b.is_split(),
                }
            })
        });
        if !idle {
            return Ok(());
        }
        // Counted first: a release that fails is not tried again.
        self.planned_mut()?.paging.cache_releases += 1;
        self.synchronize_and_free_events()?;
        for pool in pools {
            self.release_blocks(pool)?;
        }
        Ok(())
    }

    fn held_free_mut(&mut self, base: u64) -> Result<&mut BTreeMap<u64, BlockId>, AllocError> {
        let held = self.planned_mut()?.held.get_mut(&base);
        Ok(&mut held
            .ok_or_else(|| internal("no held region or chunk there"))?
            .free)
    }

    /// Gives back every wholly free region and chunk (at every cache flush: `empty_cache`,
    /// the retry chain's, and when the plan is replaced); paged, first unmaps the lent pages'
    /// old mappings and every free page of every region and chunk, live blocks or not.
    /// Whether any memory was given back.
    pub(in crate::allocator) fn give_back_plan_memory(&mut self) -> Result<bool, AllocError> {
        let Some(planned) = self.planned.as_ref() else {
            return Ok(false);
        };
        let reserved = self.total_allocated_memory;
        if planned.paged {
            let mut synced = Vec::new();
            self.unmap_stale_pages(&mut synced)?;
            let free: Vec<(StreamId, BlockId)> = self
                .following()?
                .held
                .values()
                .flat_map(|h| h.free.values().map(|&id| (h.stream, id)))
                .collect();
            for (stream, id) in free {
                if !synced.contains(&stream) {
                    self.device.synchronize_stream(stream)?;
                    synced.push(stream);
                    self.planned_mut()?.paging.synchronizations += 1;
                }
                let before = self.total_allocated_memory;
                self.unmap_block(id, true)?;
                let pages = (before - self.total_allocated_memory) / PLAN_PAGE;
                self.planned_mut()?.paging.pages_unmapped += pages;
            }
        }
        let idle: Vec<u64> = self
            .following()?
            .held
            .iter()
            .filter(|&(_, h)| {
                h.idle(&self.blocks) && (h.paging.is_none() || h.mapped_bytes(&self.blocks) == 0)
            })
            .map(|(&base, _)| base)
            .collect();
        for &base in &idle {
            let held = self.following()?.held(base)?;
            let id = held
                .head(base)
                .ok_or_else(|| internal("an idle region or chunk without a head block"))?;
            if held.paging.is_some() {
                // Wholly unmapped: its address range goes back.
                self.release_expandable_segment(id)?;
            } else {
                // As any whole free segment: its free-map entry goes with it.
                self.release_block(id)?;
            }
            let planned = self.planned_mut()?;
            planned.held.remove(&base);
            for r in planned.regions.iter_mut().chain(planned.chunks.iter_mut()) {
                if r.2 == Some(base) {
                    r.2 = None;
                }
            }
        }
        Ok(!idle.is_empty() || self.total_allocated_memory < reserved)
    }

    /// The base of the plan's region or chunk holding `ptr`, if it lies in one.
    pub(in crate::allocator) fn plan_segment_at(&self, ptr: u64) -> Option<u64> {
        self.planned.as_ref()?.held_at(ptr)
    }

    /// The address of a block the plan holds (`Block::held`), and its region or chunk.
    /// `None` only if the tag and the plan's map disagree, which `check_invariants` reports.
    fn held_of(&mut self, id: BlockId) -> Option<(u64, &mut Held)> {
        let ptr = self.block(id).ptr;
        let planned = self.planned.as_mut()?;
        let base = planned.held_at(ptr)?;
        planned.held.get_mut(&base).map(|held| (ptr, held))
    }

    /// Puts a free block the plan holds into its region's or chunk's map (`insert_free` for
    /// them).
    #[cold]
    pub(in crate::allocator) fn insert_held_free(&mut self, id: BlockId) {
        let found = self
            .held_of(id)
            .map(|(ptr, held)| held.free.insert(ptr, id));
        debug_assert!(found.is_some(), "a held block outside the plan's segments");
    }

    /// Takes a free block the plan holds out of its region's or chunk's map.
    #[cold]
    pub(in crate::allocator) fn remove_held_free(&mut self, id: BlockId) {
        let removed = self
            .held_of(id)
            .and_then(|(ptr, held)| held.free.remove(&ptr));
        debug_assert!(removed.is_some(), "a free plan block missing from its map");
    }

    /// For `check_invariants`: the blocks in the regions' and chunks' free and unmapped maps
    /// and how many are unmapped, after checking that each held one is one segment of its
    /// size whose maps hold blocks of its own under their addresses, and that lent pages lie
    /// in unmapped blocks; the first violation otherwise.
    pub(in crate::allocator) fn check_plan_segments(
        &self,
    ) -> Result<(FxHashSet<BlockId>, usize), String> {
        let mut ids = FxHashSet::default();
        let mut unmapped_count = 0;
        let Some(planned) = self.planned.as_ref() else {
            return Ok((ids, 0));
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
            if held.paging.as_ref().map(|p| p.segment) != self.block(head).expandable {
                return Err(format!(
                    "plan segment at {base:#x}: paged, or not, unlike its blocks"
                ));
            }
            let unmapped = held.paging.iter().flat_map(|p| &p.unmapped);
            for (mapped, (&ptr, &id)) in held
                .free
                .iter()
                .map(|e| (true, e))
                .chain(unmapped.map(|e| (false, e)))
            {
                let Some(b) = self.blocks.get(id.index()) else {
                    return Err(format!("plan free map names a removed block {ptr:#x}"));
                };
                if b.ptr != ptr
                    || !b.is_free()
                    || b.mapped() != mapped
                    || ptr - base >= held.bytes
                    || !ids.insert(id)
                {
                    return Err(format!(
                        "plan map entry {ptr:#x} is not a free (mapped={mapped}) block of its segment"
                    ));
                }
                unmapped_count += usize::from(!mapped);
            }
            for (paging, &page) in held
                .paging
                .iter()
                .flat_map(|p| p.stale.iter().map(move |s| (p, s)))
            {
                let within = paging
                    .unmapped
                    .range(..=page)
                    .next_back()
                    .is_some_and(|(&ptr, id)| page + PLAN_PAGE <= ptr + self.block(*id).size);
                if (page - base) % PLAN_PAGE != 0 || !within {
                    return Err(format!("lent page {page:#x} is not an unmapped page"));
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
        Ok((ids, unmapped_count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S0: StreamId = StreamId(0);
    const S1: StreamId = StreamId(1);

    fn entry(size: u64, stream: StreamId, offset: Option<u64>, persistent: bool) -> PlanEntry {
        PlanEntry {
            size,
            stream,
            offset,
            persistent,
        }
    }

    /// What a planned entry at `offset` of region 0 says.
    fn placed(offset: u64) -> Expect {
        Expect::Placed { region: 0, offset }
    }

    /// What an entry served in stream 0's chunk says: a persistent one with no offset, or one
    /// before a kept entry once the job is disordered.
    fn bumped() -> Expect {
        Expect::Persistent {
            tried: None,
            chunk: 0,
        }
    }

    /// A plan of `entries` with one 4 KiB region on stream 0, followed unpaged.
    fn following(entries: Vec<PlanEntry>) -> Following {
        let plan = Plan {
            regions: vec![PlanRegion {
                stream: S0,
                bytes: 4096,
            }],
            entries,
            mode: PlanMode::Whole,
            saved_bytes: None,
        };
        plan.validate().expect("a valid plan");
        Following::new(Arc::new(plan), false, 0)
    }

    /// Requests in turn, each with what the plan says and whether it begins an iteration.
    #[test]
    fn a_request_matches_the_entry_expected_or_one_a_little_after() {
        let mut following = following(vec![
            entry(512, S0, Some(0), false),
            entry(1024, S0, Some(512), false),
            entry(2048, S0, None, true),
            entry(512, S1, None, false),
        ]);
        let persistent = bumped();
        let steps = [
            // Nothing is followed until the first entry comes.
            ((1024, S0), (Expect::Idle, false)),
            ((512, S0), (placed(0), true)),
            ((1024, S0), (placed(512), false)),
            // The persistent entry skipped: the next matching one is taken.
            ((512, S1), (Expect::Unplanned, false)),
            // Another size on the stream: a miss, the cursor stays.
            ((4096, S0), (Expect::Miss, false)),
            // Back at the start: a new iteration.
            ((512, S0), (placed(0), true)),
            ((1024, S0), (placed(512), false)),
            ((2048, S0), (persistent, false)),
            // The same size on another stream is another request.
            ((1024, S1), (Expect::Miss, false)),
        ];
        for (i, ((size, stream), want)) in steps.into_iter().enumerate() {
            assert_eq!(following.match_request(size, stream), want, "step {i}");
        }
    }

    /// Requests made out of order match the entries they skipped, without moving the cursor
    /// or beginning an iteration; the entry at the cursor comes first, and skipped entries
    /// are forgotten [`RESYNC_WINDOW`] entries on.
    #[test]
    fn a_request_made_out_of_order_matches_the_entry_it_skipped() {
        let window = RESYNC_WINDOW as u64;
        let mut entries = vec![
            entry(512, S0, Some(0), false),
            entry(1024, S0, Some(512), false),
            entry(512, S0, Some(1536), false),
            entry(1024, S0, Some(2048), false),
        ];
        entries.extend((0..=window).map(|k| entry(4096 + 512 * k, S0, None, true)));
        entries.push(entry(1024, S0, Some(512), false));
        entries.push(entry(3072, S0, Some(0), false));
        let mut following = following(entries);
        let persistent = bumped();
        let steps = [
            ((512, S0), (placed(0), true)),
            // The third before the second.
            ((512, S0), (placed(1536), false)),
            // The fourth, of the second's size, is at the cursor: it comes first.
            ((1024, S0), (placed(2048), false)),
            // Then the second.
            ((1024, S0), (placed(512), false)),
            // The first persistent entry skipped.
            ((4096 + 512, S0), (persistent, false)),
        ];
        for (i, ((size, stream), want)) in steps.into_iter().enumerate() {
            assert_eq!(following.match_request(size, stream), want, "step {i}");
        }
        assert_eq!(following.skipped, vec![4]);
        for k in 2..=window {
            let got = following.match_request(4096 + 512 * k, S0);
            assert_eq!(got, (persistent, false), "persistent entry {k}");
        }
        assert_eq!(following.skipped, vec![4], "still within the window");
        assert_eq!(following.match_request(1024, S0), (placed(512), false));
        assert!(following.skipped.is_empty(), "forgotten past the window");
    }

    /// What the iteration's last entries skipped is forgotten when the cursor wraps: a
    /// request of a skipped entry's size is the next iteration's.
    #[test]
    fn skipped_entries_are_forgotten_at_the_iterations_end() {
        let mut following = following(vec![
            entry(512, S0, Some(0), false),
            entry(1024, S0, Some(512), false),
            entry(2048, S0, Some(1536), false),
        ]);
        assert_eq!(following.match_request(512, S0), (placed(0), true));
        assert_eq!(following.match_request(2048, S0), (placed(1536), false));
        assert!(following.skipped.is_empty(), "the last entry matched");
        assert_eq!(following.match_request(1024, S0), (placed(512), true));
    }

    /// An iteration whose first request comes after its second: the second begins the
    /// iteration, and the first, remembered as skipped, matches its own entry (it used to
    /// begin yet another iteration, and take a later entry of its size from the one meant
    /// for it, and so on down the iteration).
    #[test]
    fn an_iterations_first_request_made_late_matches_its_entry() {
        let mut following = following(vec![
            entry(512, S0, Some(0), false),
            entry(1024, S0, Some(512), false),
            entry(2048, S0, Some(1536), false),
        ]);
        for (i, (size, offset)) in [(512, 0), (1024, 512), (2048, 1536)]
            .into_iter()
            .enumerate()
        {
            let got = following.match_request(size, S0);
            assert_eq!(got, (placed(offset), i == 0), "entry {i}");
        }
        assert_eq!(following.match_request(1024, S0), (placed(512), true));
        assert_eq!(following.skipped, vec![0]);
        assert_eq!(following.match_request(512, S0), (placed(0), false));
        assert_eq!(following.match_request(2048, S0), (placed(1536), false));
        assert!(following.skipped.is_empty());
    }

    /// A request that matches no entry by size, within half the size of the entry at the
    /// cursor either way, is that entry (a tensor resized across its class) and the cursor
    /// stays: the next request may be the entry's own (the other was one the job added) or
    /// the next entry's, which then does not leave the entry behind as skipped. One further
    /// off is a miss.
    #[test]
    fn a_request_resized_across_its_class_takes_the_entry_at_the_cursor() {
        let mut following = following(vec![
            entry(512, S0, Some(0), false),
            entry(2048, S0, Some(512), false),
            entry(1024, S0, Some(2560), false),
        ]);
        assert_eq!(following.match_request(512, S0), (placed(0), true));
        assert_eq!(following.match_request(2560, S0), (placed(512), false));
        assert_eq!(following.match_request(1024, S0), (placed(2560), false));
        assert!(following.skipped.is_empty(), "{:?}", following.skipped);
        // The next iteration: a request the job added, of a size near the entry's, then the
        // entry's own.
        assert_eq!(following.match_request(512, S0), (placed(0), true));
        assert_eq!(following.match_request(1536, S0), (placed(512), false));
        assert_eq!(following.match_request(2048, S0), (placed(512), false));
        assert_eq!(following.match_request(4096, S0), (Expect::Miss, false));
        assert_eq!(following.match_request(1024, S0), (placed(2560), false));
        assert_eq!(following.paging.unmatched, 1);
    }

    /// An entry just before a persistent one of its size and stream is placed while the job
    /// makes its requests in order (one it does not know, or resized, is no disorder), and goes
    /// to a chunk once it has made one out of order (the two may then come the other way round,
    /// which no follower can see); the chunk's size counts it from then on.
    #[test]
    fn an_entry_before_a_kept_one_of_its_size_goes_to_a_chunk_once_the_job_is_disordered() {
        let mut following = following(vec![
            entry(512, S0, Some(0), false),
            entry(1024, S0, Some(512), false),
            entry(1024, S0, None, true),
            entry(512, S0, Some(1536), false),
            entry(2048, S0, Some(2048), false),
        ]);
        assert_eq!(following.before_kept, vec![1]);
        let persistent = bumped();
        assert_eq!(following.persistent_to_come(0), 1024);
        for added in [None, Some(8192), Some(1536)] {
            assert_eq!(following.match_request(512, S0).0, placed(0));
            if let Some(size) = added {
                following.match_request(size, S0);
            }
            assert_eq!(following.match_request(1024, S0).0, placed(512));
            assert_eq!(following.match_request(1024, S0).0, persistent);
            assert_eq!(following.match_request(512, S0).0, placed(1536));
            assert_eq!(following.match_request(2048, S0).0, placed(2048));
        }
        assert!(!following.disordered);
        // Entry 3's request before entry 1's: from now on entry 1 goes to the chunk.
        assert_eq!(following.match_request(512, S0).0, placed(0));
        assert_eq!(following.match_request(512, S0).0, placed(1536));
        assert_eq!(following.match_request(1024, S0).0, persistent);
        assert_eq!(following.match_request(1024, S0).0, persistent);
        assert_eq!(following.match_request(2048, S0).0, placed(2048));
        assert_eq!(following.match_request(512, S0).0, placed(0));
        assert_eq!(following.match_request(1024, S0).0, persistent);
        assert_eq!(following.persistent_to_come(0), 2048);
        // Paged plans lend pages by the plan's own lifetimes: none of this.
        let plan = Arc::clone(&following.plan);
        assert!(Following::new(plan, true, 0).before_kept.is_empty());
    }

    /// A followed plan given up after [`LOST_AFTER`] misses in a row waits for its first
    /// entry again.
    #[test]
    fn misses_in_a_row_lose_the_plan() {
        let mut following = following(vec![
            entry(512, S0, Some(0), false),
            entry(1024, S0, Some(512), false),
        ]);
        assert_eq!(following.match_request(512, S0).0, placed(0));
        for _ in 0..LOST_AFTER {
            assert_eq!(following.match_request(4096, S0).0, Expect::Miss);
        }
        assert_eq!(following.match_request(1024, S0).0, Expect::Idle);
        assert_eq!(following.match_request(512, S0), (placed(0), true));
    }
}
