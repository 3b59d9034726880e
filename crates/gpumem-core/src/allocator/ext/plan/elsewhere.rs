//! Where a whole plan puts a request it cannot put where it planned (Note [Planned
//! placement], in the parent module): a range of its stream's plan memory chosen to stand in
//! the way of the plan's own entries as late as possible.
//!
//! A live job's requests are not quite the recorded ones (made out of order, resized, added),
//! and one placed in a range the next entries were planned into displaces them in turn: a
//! cascade that ends with entries no free block holds. The candidates are the start of every
//! free block of the stream's region and chunks that holds the request, and in the region
//! also the end of each. Of the free tail of the chunk being bumped, only its end: the
//! iteration's kept entries fill that tail from the front, and a request at its start would
//! send them to a new chunk and leave the tail behind it unused. Each candidate is ranked by
//! the first of the next [`LOOKAHEAD`] entries whose planned range it overlaps (none, in a
//! chunk: entries are planned in regions only), the latest first, then the smallest block,
//! then the pools' tie-break (the lowest address, or the oldest).
//!
//! A request whose lifetime the plan does not know (it matched no entry, it is kept past
//! the iteration, or it came while the plan waits for its first entry) may live on, and in
//! a range an entry needs it would displace that entry in every iteration after: it takes
//! only chunk space and ranges of the region that no entry of the plan uses
//! (`Following::last_use`), ranked by block and tie-break alone.
//!
//! # Invariants
//! - A candidate lies inside one free block of a region or chunk of the request's stream.
//! - Nothing is changed: the caller carves the range chosen.
//!
//! # Budgets
//! - Time: O((C + L) log C) for C free blocks of the stream's region and chunks and the
//!   L ≤ [`LOOKAHEAD`] entries looked at: each entry finds the candidates it overlaps by
//!   binary search, and each candidate is marked once (those marked are skipped over,
//!   pointers halved as they are followed); the search stops once every candidate in the
//!   region has a next use. A request of unknown lifetime looks at no entry: O(C log E) for
//!   the E steps of the region's last uses.
//! - Memory: three vectors of at most 2C + 1 items, dropped at return.

use std::cmp::Reverse;

use crate::allocator::FitOrder;
use crate::allocator::block::Block;
use crate::device::StreamId;

use super::Following;

/// How many entries after the cursor a request placed elsewhere looks at for the plan's
/// next use of a range.
pub const LOOKAHEAD: usize = 512;

/// A place a request could go.
struct Candidate {
    /// The first entry (from the cursor) whose planned range it overlaps, if any.
    next_use: Option<usize>,
    /// The free block's size and tie-break.
    block: u64,
    tie: u64,
    addr: u64,
    /// The region or chunk holding it.
    base: u64,
}

impl Following {
    /// The range of `size` bytes a request the plan cannot put where it planned goes to, as
    /// the module documentation ranks them: (address, base of the region or chunk); `None`
    /// if no free block of the stream's region and chunks holds it (where its lifetime is
    /// not known, none that no entry of the plan uses).
    pub(super) fn displaced_range(
        &self,
        stream: StreamId,
        size: u64,
        lifetime_known: bool,
        blocks: &slab::Slab<Block>,
        order: FitOrder,
    ) -> Option<(u64, u64)> {
        let r = self.region_of(stream);
        let region = r.and_then(|r| self.regions[r].2);
        // The stream's current chunk: requests to come bump into its free tail from the front.
        let bumped = (self.chunks.iter()).find_map(|chunk| chunk.2.filter(|_| chunk.0 == stream));
        let mut candidates = Vec::new();
        // Candidates in the region, by offset (free blocks are disjoint and by address, and
        // a block's start comes before its end): (offset, index in `candidates`).
        let mut by_offset: Vec<(u64, usize)> = Vec::new();
        for (&base, held) in &self.held {
            if held.stream != stream || (held.region && Some(base) != region) {
                continue;
            }
            for (&addr, id) in &held.free {
                let Some(b) = blocks.get(id.index()).filter(|b| b.size >= size) else {
                    continue;
                };
                let tie = order.tie(b.counter, b.ptr);
                let ends = [addr, addr + b.size - size];
                let count = if held.region && b.size > size { 2 } else { 1 };
                // The current chunk's tail only at its end, where bumps reach last.
                let tail = Some(base) == bumped && addr + b.size == base + held.bytes;
                let ends = if tail { &ends[1..] } else { &ends[..count] };
                for &at in ends {
                    if held.region {
                        let unused = || r.is_some_and(|r| self.no_entry_uses(r, at - base, size));
                        if !lifetime_known && !unused() {
                            continue;
                        }
                        by_offset.push((at - base, candidates.len()));
                    }
                    candidates.push(Candidate {
                        next_use: None,
                        block: b.size,
                        tie,
                        addr: at,
                        base,
                    });
                }
            }
        }
        if lifetime_known {
            self.next_uses(stream, size, &by_offset, &mut candidates);
        }
        let best = candidates
            .iter()
            .min_by_key(|c| (c.next_use.map(Reverse), c.block, c.tie, c.addr))?;
        Some((best.addr, best.base))
    }

    /// Whether no entry's planned range overlaps `[offset, offset + size)` of region `r`.
    fn no_entry_uses(&self, r: usize, offset: u64, size: u64) -> bool {
        self.last_uses_over(r, offset, offset + size)
            .is_some_and(|mut uses| uses.all(|last| last.is_none()))
    }

    /// Sets each region candidate's next use: the first of the entries to come (at most
    /// [`LOOKAHEAD`], around the iteration's end; from the first while the plan waits for
    /// it) on `stream` whose planned range overlaps `size` bytes from its offset.
    fn next_uses(
        &self,
        stream: StreamId,
        size: u64,
        by_offset: &[(u64, usize)],
        candidates: &mut [Candidate],
    ) {
        let n = self.plan.entries.len();
        let start = if self.following { self.cursor } else { 0 };
        // `unmarked[i]`: a candidate at or after `i` in `by_offset` that may have no next use
        // yet (`by_offset.len()`: none), so that each is marked once.
        let mut unmarked: Vec<usize> = (0..=by_offset.len()).collect();
        let mut open = by_offset.len();
        for k in 0..LOOKAHEAD.min(n) {
            if open == 0 {
                break;
            }
            let e = self.entry(start + k);
            let Some(offset) = e.offset.filter(|_| e.stream == stream) else {
                continue;
            };
            // Candidates are `size` long: those overlapping [offset, offset + e.size) start
            // after offset - size and before its end.
            let from = by_offset.partition_point(|&(at, _)| at + size <= offset);
            let to = by_offset.partition_point(|&(at, _)| at < offset + e.size);
            let mut i = first_unmarked(&mut unmarked, from);
            while i < to {
                candidates[by_offset[i].1].next_use = Some(k);
                unmarked[i] = i + 1;
                open -= 1;
                i = first_unmarked(&mut unmarked, i + 1);
            }
        }
    }
}

/// The first unmarked candidate at or after `i`, halving the path there.
fn first_unmarked(unmarked: &mut [usize], mut i: usize) -> usize {
    while unmarked[i] != i {
        unmarked[i] = unmarked[unmarked[i]];
        i = unmarked[i];
    }
    i
}
