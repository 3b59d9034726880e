//! Where a device's memory is at one moment, in parts that add up, and which part kept a
//! request from fitting. The out-of-memory error computes it from the allocator's own blocks
//! when an allocation fails (only then: the hot path never pays for it); `gpumem explain`
//! computes it from a replayed snapshot. One accounting, so the two always agree.
//!
//! # Invariants
//! - requested + rounding + fragmented + other streams + other pools + pending stream frees
//!   is the reserved memory; with free and outside the allocator (where known) it is the
//!   device's total.

use serde::Serialize;

use crate::device::StreamId;

use crate::allocator::size::{PoolKind, format_size};
use crate::allocator::snapshot::BlockState;

/// Where the device's memory was, in bytes; the parts add up (see the module's invariants).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    /// What live tensors asked for.
    pub requested: u64,
    /// What rounding added to them.
    pub rounding: u64,
    /// Cached and free in the request's pool and stream, in blocks smaller than it (and in
    /// the other pool, which it cannot use).
    pub fragmented: u64,
    /// Cached and free, but in pools of other streams.
    pub other_streams: u64,
    /// Cached and free, but in pools the request could not use: private pools (CUDA graphs,
    /// MemPools) for a default-pool request, every other pool for a request routed to a
    /// private one.
    pub other_pools: u64,
    /// Freed by the program, waiting on other streams' events (`record_stream`).
    pub pending_stream_frees: u64,
    /// Free on the device, as the `oom` entry recorded it.
    pub free: Option<u64>,
    /// Held outside the allocator: other processes, the CUDA context, libraries.
    pub outside_allocator: Option<u64>,
}

/// A part of a [`Breakdown`], in the order they are shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// What live tensors asked for.
    Requested,
    /// What rounding added to them.
    Rounding,
    /// Cached and free, too small for the request.
    Fragmented,
    /// Cached and free, in other streams' pools.
    OtherStreams,
    /// Cached and free, in pools the request could not use.
    OtherPools,
    /// Freed, waiting on other streams.
    PendingStreamFrees,
    /// Free on the device.
    Free,
    /// Held outside the allocator.
    OutsideAllocator,
}

impl Part {
    /// Every part, in the order they are shown.
    pub const ALL: [Part; 8] = [
        Part::Requested,
        Part::Rounding,
        Part::Fragmented,
        Part::OtherStreams,
        Part::OtherPools,
        Part::PendingStreamFrees,
        Part::Free,
        Part::OutsideAllocator,
    ];

    /// Its field in the breakdown's JSON.
    pub fn field(self) -> &'static str {
        match self {
            Part::Requested => "requested",
            Part::Rounding => "rounding",
            Part::Fragmented => "fragmented",
            Part::OtherStreams => "other_streams",
            Part::OtherPools => "other_pools",
            Part::PendingStreamFrees => "pending_stream_frees",
            Part::Free => "free",
            Part::OutsideAllocator => "outside_allocator",
        }
    }

    /// What it holds, in words.
    pub fn meaning(self) -> &'static str {
        match self {
            Part::Requested => "live tensors (requested)",
            Part::Rounding => "rounding of live tensors",
            Part::Fragmented => "cached, free, too small for the request",
            Part::OtherStreams => "cached, free, other streams' pools",
            Part::OtherPools => "cached, free, other pools (CUDA graphs, MemPools)",
            Part::PendingStreamFrees => "freed, waiting on other streams (record_stream)",
            Part::Free => "free on the device",
            Part::OutsideAllocator => "outside the allocator",
        }
    }
}

impl Breakdown {
    /// How many parts there are.
    pub const PARTS: usize = Part::ALL.len();

    /// A part's bytes, `None` where unknown (the device's free memory and what sat outside
    /// the allocator, where the device's size was not recorded).
    pub fn get(&self, part: Part) -> Option<u64> {
        match part {
            Part::Requested => Some(self.requested),
            Part::Rounding => Some(self.rounding),
            Part::Fragmented => Some(self.fragmented),
            Part::OtherStreams => Some(self.other_streams),
            Part::OtherPools => Some(self.other_pools),
            Part::PendingStreamFrees => Some(self.pending_stream_frees),
            Part::Free => self.free,
            Part::OutsideAllocator => self.outside_allocator,
        }
    }

    /// The parts in the order they are shown, with their bytes.
    pub fn parts(&self) -> [(Part, Option<u64>); Self::PARTS] {
        Part::ALL.map(|part| (part, self.get(part)))
    }
}

/// Which part kept the request from fitting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Live tensors and the request need more than the job had: no allocator setting helps.
    TooBig,
    /// Enough was cached, in pieces too small.
    Fragmentation,
    /// Memory freed by the program waited on other streams.
    PendingStreamFrees,
    /// Enough was cached, on other streams.
    OtherStreams,
    /// Enough was cached, in other pools (a CUDA graph's, a MemPool's).
    OtherPools,
    /// Memory outside the allocator made the difference.
    OutsideAllocator,
}

/// The request an accounting is about: its rounded size, pool and stream (the part of a
/// request that the accounting reads; `explain`'s request carries it with the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Request {
    /// Bytes after rounding.
    pub rounded: u64,
    /// The pool that serves it.
    pub pool: PoolKind,
    /// The stream it was asked on.
    pub stream: StreamId,
}

/// The breakdown of the segments, and what the request could have used of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accounting {
    /// Where the memory was.
    pub breakdown: Breakdown,
    /// Reserved: every segment's bytes.
    pub reserved: u64,
    /// Allocated: live and pending-free blocks.
    pub allocated: u64,
    /// The largest free block of the request's pool and stream.
    pub largest_free_block: u64,
    /// Segments of the request's pool and stream that hold free memory.
    pub segments_with_free: usize,
}

/// One segment's (or a pool's, on one stream) memory by state, in bytes: what the
/// accounting needs of it. A job that pushes its figures at an OOM sends these per pool and
/// stream, summed over its snapshot's segments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolFigures {
    /// Live blocks' bytes.
    pub allocated: u64,
    /// What the live blocks asked for (at most `allocated`).
    pub requested: u64,
    /// Blocks freed by the program, waiting on other streams' events.
    pub pending_free: u64,
    /// Cached free bytes.
    pub free: u64,
    /// The largest of the free blocks (at most `free`).
    pub largest_free: u64,
    /// Segments that hold free bytes.
    pub segments_with_free: usize,
}

impl PoolFigures {
    /// The figures of one segment's blocks: (size, requested size, state) each.
    pub fn of_blocks(blocks: impl IntoIterator<Item = (u64, u64, BlockState)>) -> PoolFigures {
        let mut f = PoolFigures::default();
        for (size, requested, state) in blocks {
            match state {
                BlockState::ActiveAllocated => {
                    f.allocated += size;
                    f.requested += requested.min(size);
                }
                BlockState::ActivePendingFree => f.pending_free += size,
                BlockState::Inactive => {
                    f.free += size;
                    f.largest_free = f.largest_free.max(size);
                }
            }
        }
        f.segments_with_free = usize::from(f.free > 0);
        f
    }

    /// Adds `other`'s figures (more segments of the same pool and stream).
    pub fn add(&mut self, other: &PoolFigures) {
        self.allocated += other.allocated;
        self.requested += other.requested;
        self.pending_free += other.pending_free;
        self.free += other.free;
        self.largest_free = self.largest_free.max(other.largest_free);
        self.segments_with_free += other.segments_with_free;
    }
}

impl Accounting {
    /// Adds one segment (or mapped run) on `stream` of kind `pool`, in the request's own
    /// pool (the default pool or the private one it was routed to) or not: its blocks'
    /// sizes, requested sizes and states.
    pub fn add_segment(
        &mut self,
        request: Request,
        stream: StreamId,
        pool: PoolKind,
        own_pool: bool,
        blocks: impl IntoIterator<Item = (u64, u64, BlockState)>,
    ) {
        self.add(
            request,
            stream,
            pool,
            own_pool,
            &PoolFigures::of_blocks(blocks),
        );
    }

    /// Adds the figures of segments on `stream` of kind `pool`, in the request's own pool or
    /// not.
    pub fn add(
        &mut self,
        request: Request,
        stream: StreamId,
        pool: PoolKind,
        own_pool: bool,
        f: &PoolFigures,
    ) {
        let same_stream = stream == request.stream;
        let usable = own_pool && same_stream && pool == request.pool;
        let b = &mut self.breakdown;
        let requested = f.requested.min(f.allocated);
        self.reserved += f.allocated + f.pending_free + f.free;
        self.allocated += f.allocated + f.pending_free;
        b.requested += requested;
        b.rounding += f.allocated - requested;
        b.pending_stream_frees += f.pending_free;
        if !own_pool {
            b.other_pools += f.free;
        } else if same_stream {
            b.fragmented += f.free;
        } else {
            b.other_streams += f.free;
        }
        if usable {
            self.largest_free_block = self.largest_free_block.max(f.largest_free);
            self.segments_with_free += f.segments_with_free;
        }
    }

    /// Completes the breakdown with the device's free bytes (where known) and its total
    /// (where known): what sat outside the allocator is what neither accounts for.
    pub fn finish(&mut self, free: Option<u64>, total: Option<u64>) {
        self.breakdown.free = free;
        self.breakdown.outside_allocator = match (free, total) {
            (Some(free), Some(total)) => Some(total.saturating_sub(self.reserved + free)),
            _ => None,
        };
    }

    /// Completes the accounting of a request that failed on a device of `total` bytes (the
    /// limit of a memory fraction, where one is set) of which the driver reported `free`:
    /// free is capped at what the reserved memory leaves of the total, so the parts add up to
    /// it. The parts to blame, most first, and the sentence.
    pub fn blame(&mut self, request: Request, free: u64, total: u64) -> (Vec<Kind>, String) {
        let free = free.min(total.saturating_sub(self.reserved));
        self.finish(Some(free), Some(total));
        let kinds = self.kinds(request, Some(total));
        let why = self.sentence(request, kinds[0]);
        (kinds, why)
    }

    /// What the job had: reserved plus free, where free is known.
    pub fn available(&self) -> Option<u64> {
        self.breakdown.free.map(|f| self.reserved + f)
    }

    /// The parts to blame for `request`, most first: when live tensors and the request exceed
    /// what the job had, the memory outside the allocator if the device could have held them,
    /// else too big; otherwise the cached parts that would have made room, largest first.
    pub fn kinds(&self, request: Request, total: Option<u64>) -> Vec<Kind> {
        kinds(&self.breakdown, request.rounded, self.available(), total)
    }

    /// The explanation in one sentence, blaming `kind`.
    pub fn sentence(&self, request: Request, kind: Kind) -> String {
        sentence(
            &self.breakdown,
            request,
            self.reserved,
            self.largest_free_block,
            self.segments_with_free,
            self.available(),
            kind,
        )
    }
}

/// The parts to blame, most first. When live tensors and the request exceed what the job
/// had: the memory outside the allocator if the device could have held them, else nothing
/// helps (too big). Otherwise the cached parts that, given back, would have made room,
/// largest first.
fn kinds(b: &Breakdown, rounded: u64, available: Option<u64>, total: Option<u64>) -> Vec<Kind> {
    let need = b.requested + b.rounding + rounded;
    if let Some(available) = available
        && need > available
    {
        return match total {
            Some(total) if need <= total => vec![Kind::OutsideAllocator],
            _ => vec![Kind::TooBig],
        };
    }
    let mut parts = vec![
        (b.fragmented, Kind::Fragmentation),
        (b.pending_stream_frees, Kind::PendingStreamFrees),
        (b.other_streams, Kind::OtherStreams),
        (b.other_pools, Kind::OtherPools),
    ];
    parts.retain(|&(bytes, _)| bytes > 0);
    parts.sort_by_key(|&(bytes, _)| std::cmp::Reverse(bytes));
    let mut kinds: Vec<Kind> = parts.into_iter().map(|(_, k)| k).collect();
    if kinds.is_empty() {
        kinds.push(Kind::TooBig);
    }
    kinds
}

fn sentence(
    b: &Breakdown,
    request: Request,
    reserved: u64,
    largest: u64,
    split_segments: usize,
    available: Option<u64>,
    kind: Kind,
) -> String {
    let f = format_size;
    let live = b.requested + b.rounding;
    match kind {
        Kind::TooBig => match available {
            // Nothing cached could have served it, yet the device had room when the error
            // was recorded: the driver refused memory that was in use at that moment.
            Some(a) if live + request.rounded <= a => format!(
                "Nothing cached could serve the {} request and the driver refused it, although {} were free on the device when the error was recorded: memory held outside the allocator at that moment (another process, a library) was released since.",
                f(request.rounded),
                f(b.free.unwrap_or(0))
            ),
            Some(a) => format!(
                "No allocator setting avoids this: {} live plus the {} request exceed the {} the job had (reserved {} plus {} free on the device).",
                f(live),
                f(request.rounded),
                f(a),
                f(reserved),
                f(b.free.unwrap_or(0))
            ),
            None => format!(
                "{} live plus the {} request need more than the allocator could get.",
                f(live),
                f(request.rounded)
            ),
        },
        Kind::Fragmentation => format!(
            "{} were cached but the largest free block the {} request could use was {}: {} sit in {} {} split around live blocks.",
            f(b.fragmented),
            f(request.rounded),
            f(largest),
            f(b.fragmented),
            split_segments,
            if split_segments == 1 {
                "segment"
            } else {
                "segments"
            }
        ),
        Kind::PendingStreamFrees => format!(
            "{} freed by the program were still waiting on other streams' work (record_stream) when the {} request came.",
            f(b.pending_stream_frees),
            f(request.rounded)
        ),
        Kind::OtherStreams => format!(
            "{} were cached free, but in other streams' pools, which the {} request on stream {:#x} cannot use.",
            f(b.other_streams),
            f(request.rounded),
            request.stream
        ),
        Kind::OtherPools => format!(
            "{} were cached free, but in pools the {} request could not use: a CUDA graph's or a MemPool's private pool serves only its own requests, and empty_cache() frees its cache only once its owner (the graph, the MemPool) is released (a request routed to a private pool cannot use the default pool's cache either).",
            f(b.other_pools),
            f(request.rounded)
        ),
        Kind::OutsideAllocator => format!(
            "{} of the device were held outside the allocator (other processes, the CUDA context, libraries): the job had {}, and {} live plus the {} request would have fit on the device without them.",
            f(b.outside_allocator.unwrap_or(0)),
            f(available.unwrap_or(0)),
            f(live),
            f(request.rounded)
        ),
    }
}
