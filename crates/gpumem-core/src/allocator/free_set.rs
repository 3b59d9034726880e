//! The ordered set of free blocks of one pool, keyed by (stream, size, tie-break).
//!
//! PyTorch keeps each pool's free blocks in a `std::set` ordered by stream, size and then its
//! release's tie-break (the address, a block counter, or a segment counter and the address:
//! `fit_order.rs`), and serves a request from the first element at or after `(stream, size)`.
//! Each entry carries its tie-break, computed by the allocator's order when the block entered
//! the set, so the set compares `size << 64 | tie` alike under every order. This set gives
//! exactly the same answers, faster: each stream has its own index of size classes
//! (eight classes per power of two, as TLSF spaces them), each class a vector sorted by
//! key, and a bitmap of the non-empty classes. A lookup binary-searches its class
//! and, when that holds nothing large enough, jumps with the bitmap to the first non-empty
//! larger class, whose smallest entry is the answer. Taking the best fit (malloc's lookup)
//! first looks at its class's smallest entry, which usually fits (the same sizes are asked
//! for again), and then needs no search.
//!
//! Classes are stored in descending order, smallest entry last: taking a class's smallest
//! entry, the usual best fit, then moves nothing. This matters when hundreds of equal-size
//! blocks share a class (whole cached 20 MiB segments after a backward pass): the first of
//! them in the order is taken from the end instead of shifting all the others.
//!
//! # Invariants
//! - Classes partition sizes monotonically: every size in class `c` is smaller than every
//!   size in class `c + 1`. Hence "first entry of the first non-empty class above" is the
//!   ordered successor.
//! - A class's bit is set in the bitmap iff its vector is non-empty.
//! - Within a class, entries are sorted by (size, tie), descending, and unique by it.
//! - A stream's bins hold a vector only for the classes it has used (`slot_of` says where),
//!   so a stream with a few free blocks costs about 2 KiB (its class table and its room in
//!   the list of streams), not a vector per class (over 10 KiB: a recording of 80 000
//!   streams once took 865 MB).
//! - A stream's bins are found by a scan among at most [`SCAN_STREAMS`] streams, else through
//!   a hash index, which always maps each stream to its position: constant time however
//!   many streams a recording invents. Iteration sorts the streams by handle, so it follows
//!   PyTorch's set order.
//! - Empty bins are dropped whenever the streams reach twice the number kept at the last drop
//!   (and at least [`SPARE_STREAMS`]): amortised constant work per new stream, and a job that
//!   creates streams in a loop does not grow the set without bound.

use rustc_hash::FxHashMap;

use crate::device::StreamId;

use super::block::BlockId;

/// Number of size classes: enough for any size a 64-bit count of 512-byte units can hold.
const CLASSES: usize = 8 * 53 + 8;
const BITMAP_WORDS: usize = CLASSES.div_ceil(64);
/// Streams whose bins are kept while empty. Below this many, bins are never dropped, so jobs
/// with a handful of streams never pay to rebuild them.
const SPARE_STREAMS: usize = 16;
/// The slot of a class without a vector: past any (there are at most [`CLASSES`]).
const NO_SLOT: u16 = u16::MAX;
/// Streams found by a scan (a job's handful); beyond it, by the hash index.
const SCAN_STREAMS: usize = 8;

/// One free block as the set sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct FreeEntry {
    /// Block size in bytes.
    pub size: u64,
    /// The tie-break among blocks of this size (`FitOrder::tie`).
    pub tie: u64,
    /// The block.
    pub id: BlockId,
}

impl FreeEntry {
    #[inline]
    fn key(&self) -> u128 {
        key(self.size, self.tie)
    }
}

/// (size, tie-break) as one number, in the same order: compared without a branch.
#[inline]
fn key(size: u64, tie: u64) -> u128 {
    (u128::from(size) << 64) | u128::from(tie)
}

/// The size class of a block size (a multiple of 512): linear below 4 KiB, then eight
/// classes per power of two.
fn class_of(size: u64) -> usize {
    // Without a branch (the pool's sizes alternate unpredictably): below 8 units the shift is
    // 0 and the class is the unit count; from 8 on, `units >> shift` is 8 plus the mantissa.
    let units = size >> 9;
    let shift = (units | 8).ilog2() - 3;
    8 * shift as usize + (units >> shift) as usize
}

/// Inserts `entry` into a class kept in descending order.
#[inline(never)]
fn insert_sorted(entries: &mut Vec<FreeEntry>, entry: FreeEntry) {
    let key = entry.key();
    let i = entries.partition_point(|e| e.key() > key);
    entries.insert(i, entry);
}

/// The free blocks of one stream.
#[derive(Debug, Clone)]
struct StreamBins {
    /// The classes holding entries.
    bitmap: [u64; BITMAP_WORDS],
    /// Each class's vector in `classes`; [`NO_SLOT`] for a class never used (a vector is
    /// kept once made: a class that empties is usually filled again, and keeps its room).
    slot_of: [u16; CLASSES],
    /// The used classes' entries, in the order the classes were first used.
    classes: Vec<Vec<FreeEntry>>,
}

impl StreamBins {
    fn new() -> Self {
        StreamBins {
            bitmap: [0; BITMAP_WORDS],
            slot_of: [NO_SLOT; CLASSES],
            classes: Vec::new(),
        }
    }

    /// `class`'s vector, if it has one (the bound check is the test: [`NO_SLOT`] is past
    /// any vector).
    #[inline]
    fn slot_if_any(&self, class: usize) -> Option<usize> {
        let slot = usize::from(self.slot_of[class]);
        (slot < self.classes.len()).then_some(slot)
    }

    /// `class`'s entries (none for a class never used).
    #[inline]
    fn class(&self, class: usize) -> &[FreeEntry] {
        self.classes
            .get(usize::from(self.slot_of[class]))
            .map_or(&[], Vec::as_slice)
    }

    /// The position of `class`'s vector, made where it has none yet.
    #[inline]
    fn slot(&mut self, class: usize) -> usize {
        self.slot_if_any(class)
            .unwrap_or_else(|| self.make_class(class))
    }

    #[cold]
    #[inline(never)]
    fn make_class(&mut self, class: usize) -> usize {
        // At most CLASSES vectors, below NO_SLOT.
        self.slot_of[class] = self.classes.len() as u16;
        self.classes.push(Vec::new());
        self.classes.len() - 1
    }

    /// The first non-empty class at or above `class`.
    fn next_class(&self, class: usize) -> Option<usize> {
        let mut word = class / 64;
        let mut bits = self.bitmap[word] & (u64::MAX << (class % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.bitmap.get(word)?;
        }
    }

    /// The last non-empty class strictly below `class`.
    fn prev_class(&self, class: usize) -> Option<usize> {
        if class == 0 {
            return None;
        }
        let last = class - 1;
        let mut word = last / 64;
        let mut bits = self.bitmap[word] & (u64::MAX >> (63 - last % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + 63 - bits.leading_zeros() as usize);
            }
            word = word.checked_sub(1)?;
            bits = self.bitmap[word];
        }
    }

    /// The first entry whose key is at least `key` (of a block of `size` bytes).
    fn lower_bound(&self, size: u64, key: u128) -> Option<FreeEntry> {
        let class = class_of(size);
        let entries = self.class(class);
        let at_least = entries.partition_point(|e| e.key() >= key);
        if at_least > 0 {
            return Some(entries[at_least - 1]);
        }
        let next = self.next_class(class + 1)?;
        self.class(next).last().copied()
    }

    /// The last entry whose key is below `key` (of a block of `size` bytes).
    fn prev_before(&self, size: u64, key: u128) -> Option<FreeEntry> {
        let class = class_of(size);
        let entries = self.class(class);
        let at_least = entries.partition_point(|e| e.key() >= key);
        if let Some(e) = entries.get(at_least) {
            return Some(*e);
        }
        let prev = self.prev_class(class)?;
        self.class(prev).first().copied()
    }

    #[inline]
    fn insert(&mut self, entry: FreeEntry) {
        let class = class_of(entry.size);
        let slot = self.slot(class);
        let entries = &mut self.classes[slot];
        // Most frees land at the end (an empty class, or below its smallest entry), in room
        // the class already has: that path is inlined; a search or a growth is not.
        if entries.len() < entries.capacity()
            && entries.last().is_none_or(|e| e.key() > entry.key())
        {
            entries.push(entry);
        } else {
            insert_sorted(entries, entry);
        }
        self.bitmap[class / 64] |= 1 << (class % 64);
    }

    /// Removes and returns the first entry at or after `(size, 0)` if `accept` takes it.
    fn take_lower_bound(
        &mut self,
        size: u64,
        accept: impl FnOnce(u64) -> bool,
    ) -> Option<FreeEntry> {
        let mut class = class_of(size);
        let entries: &[FreeEntry] = self.class(class);
        // Usually the class's smallest entry fits (a size asked for again): no search. When it
        // does not, a larger one of the class may; otherwise the next class's smallest does.
        if entries.last().is_none_or(|e| e.size < size) {
            let at_least = entries.partition_point(|e| e.size >= size);
            if at_least > 0 {
                // Not the last entry: the class keeps its bit.
                // A class with entries has a vector.
                let slot = usize::from(self.slot_of[class]);
                return accept(entries[at_least - 1].size)
                    .then(|| self.classes[slot].remove(at_least - 1));
            }
            class = self.next_class(class + 1)?;
        }
        // A class with entries has a vector (a class never used has neither).
        let slot = self.slot_if_any(class)?;
        let entries = &mut self.classes[slot];
        if !accept(entries.last()?.size) {
            return None;
        }
        let entry = entries.pop();
        self.clear_if_empty(class, slot);
        entry
    }

    fn remove(&mut self, size: u64, key: u128) -> bool {
        let class = class_of(size);
        let Some(slot) = self.slot_if_any(class) else {
            return false;
        };
        let entries = &mut self.classes[slot];
        // A split's remainder is usually still its class's smallest entry when it merges back.
        if entries.last().is_some_and(|e| e.key() == key) {
            entries.pop();
        } else {
            let i = entries.partition_point(|e| e.key() > key);
            if entries.get(i).is_none_or(|e| e.key() != key) {
                return false;
            }
            entries.remove(i);
        }
        self.clear_if_empty(class, slot);
        true
    }

    /// Clears the bit of `class` (at `slot`) if it holds nothing now, without a branch.
    #[inline]
    fn clear_if_empty(&mut self, class: usize, slot: usize) {
        let empty = u64::from(self.classes[slot].is_empty());
        self.bitmap[class / 64] &= !(empty << (class % 64));
    }

    /// Number of entries (counted, not kept: only checks and reports ask).
    fn len(&self) -> usize {
        self.classes.iter().map(Vec::len).sum()
    }

    /// Bytes its vectors hold (their headers and room), for memory budgets.
    fn heap_bytes(&self) -> usize {
        self.classes.capacity() * std::mem::size_of::<Vec<FreeEntry>>()
            + self
                .classes
                .iter()
                .map(|c| c.capacity() * std::mem::size_of::<FreeEntry>())
                .sum::<usize>()
    }

    /// Whether no class holds an entry.
    fn is_empty(&self) -> bool {
        self.bitmap.iter().all(|&word| word == 0)
    }

    /// Entries in ascending key order.
    fn iter(&self) -> impl DoubleEndedIterator<Item = &FreeEntry> {
        (0..CLASSES)
            .filter(|&c| self.bitmap[c / 64] & (1 << (c % 64)) != 0)
            .flat_map(|c| self.class(c).iter().rev())
    }
}

/// The free blocks of one pool, all streams. See the module documentation.
#[derive(Debug, Default, Clone)]
pub(crate) struct FreeSet {
    /// Each stream's bins, in the order the streams came (`iter` sorts them).
    streams: Vec<(StreamId, StreamBins)>,
    /// Each stream's position in `streams`.
    index: FxHashMap<StreamId, u32>,
    /// The number of streams at which empty bins are next dropped.
    prune_at: usize,
    /// Work done finding streams beyond the scan of a few (bounded by [`SCAN_STREAMS`], not
    /// counted): hash lookups, and bins looked at when empty ones are dropped (the scaling
    /// check's counter; a cell, as lookups only read).
    examined: std::cell::Cell<u64>,
}

impl FreeSet {
    /// Where `stream`'s bins are beyond a few streams (kept out of the scan's inlined path).
    #[inline(never)]
    fn indexed(&self, stream: StreamId) -> Option<usize> {
        self.examined.set(self.examined.get() + 1);
        self.index.get(&stream).map(|&i| i as usize)
    }

    /// Work done finding streams so far (see the field).
    pub fn examined(&self) -> u64 {
        self.examined.get()
    }

    /// Bytes the set holds on the heap: its bins' vectors and the index (estimated: a
    /// hash entry as its key and value).
    pub fn heap_bytes(&self) -> usize {
        self.streams.capacity() * std::mem::size_of::<(StreamId, StreamBins)>()
            + self.index.capacity() * (std::mem::size_of::<(StreamId, u32)>() + 1)
            + self
                .streams
                .iter()
                .map(|(_, bins)| bins.heap_bytes())
                .sum::<usize>()
    }

    /// `stream`'s bins: a scan for a job's few streams (cheaper than hashing), the index
    /// beyond. The scan yields the bins themselves, with no position to check again.
    #[inline]
    fn bins(&self, stream: StreamId) -> Option<&StreamBins> {
        if self.streams.len() <= SCAN_STREAMS {
            return self
                .streams
                .iter()
                .find_map(|(s, bins)| (*s == stream).then_some(bins));
        }
        Some(&self.streams[self.indexed(stream)?].1)
    }

    #[inline]
    fn bins_mut(&mut self, stream: StreamId) -> Option<&mut StreamBins> {
        if self.streams.len() <= SCAN_STREAMS {
            return self
                .streams
                .iter_mut()
                .find_map(|(s, bins)| (*s == stream).then_some(bins));
        }
        let i = self.indexed(stream)?;
        Some(&mut self.streams[i].1)
    }

    /// Number of free blocks (summed over the streams: the count is not kept twice).
    pub fn len(&self) -> usize {
        self.streams.iter().map(|(_, bins)| bins.len()).sum()
    }

    /// The first block of `stream` of `size` bytes or more in the set's order: the best fit
    /// PyTorch's `get_free_block` looks at.
    pub fn lower_bound(&self, stream: StreamId, size: u64) -> Option<FreeEntry> {
        self.at_or_after(stream, size, 0)
    }

    /// Takes the best fit out of the set if `accept(size)` agrees: [`FreeSet::lower_bound`]
    /// and [`FreeSet::remove`] in one search.
    pub fn take_lower_bound(
        &mut self,
        stream: StreamId,
        size: u64,
        accept: impl FnOnce(u64) -> bool,
    ) -> Option<FreeEntry> {
        self.bins_mut(stream)?.take_lower_bound(size, accept)
    }

    /// The first block of `stream` at or after (`size`, `tie`) in the set's order.
    pub fn at_or_after(&self, stream: StreamId, size: u64, tie: u64) -> Option<FreeEntry> {
        self.bins(stream)?.lower_bound(size, key(size, tie))
    }

    /// The block of `stream` just after `entry` in the set's order.
    pub fn next_after(&self, stream: StreamId, entry: &FreeEntry) -> Option<FreeEntry> {
        self.bins(stream)?.lower_bound(entry.size, entry.key() + 1)
    }

    /// The block of `stream` just before `entry` in the set's order.
    pub fn prev_before(&self, stream: StreamId, entry: &FreeEntry) -> Option<FreeEntry> {
        self.bins(stream)?.prev_before(entry.size, entry.key())
    }

    /// The last block of `stream` smaller than `size` bytes in the set's order.
    pub fn last_below(&self, stream: StreamId, size: u64) -> Option<FreeEntry> {
        self.bins(stream)?.prev_before(size, key(size, 0))
    }

    /// Adds a free block.
    #[inline]
    pub fn insert(&mut self, stream: StreamId, entry: FreeEntry) {
        match self.bins_mut(stream) {
            Some(bins) => bins.insert(entry),
            None => {
                let i = self.add_stream(stream);
                self.streams[i].1.insert(entry);
            }
        }
    }

    /// Makes bins for a stream that has none (rare: kept out of `insert`'s fast path), first
    /// dropping every empty one once the streams have doubled since the last drop (and are
    /// at least [`SPARE_STREAMS`]); returns their index.
    #[cold]
    #[inline(never)]
    fn add_stream(&mut self, stream: StreamId) -> usize {
        if self.streams.len() >= self.prune_at.max(SPARE_STREAMS) {
            self.examined
                .set(self.examined.get() + self.streams.len() as u64);
            self.streams.retain(|(_, bins)| !bins.is_empty());
            self.prune_at = 2 * self.streams.len();
            self.index = self
                .streams
                .iter()
                .enumerate()
                .map(|(i, (s, _))| (*s, i as u32))
                .collect();
        }
        let i = self.streams.len();
        self.streams.push((stream, StreamBins::new()));
        self.index.insert(stream, i as u32);
        i
    }

    /// Removes the block of `stream` with this size and tie-break; false if it is not here.
    pub fn remove(&mut self, stream: StreamId, size: u64, tie: u64) -> bool {
        let Some(bins) = self.bins_mut(stream) else {
            return false;
        };
        bins.remove(size, key(size, tie))
    }

    /// All free blocks in PyTorch's set order: by stream, then size, then the tie-break.
    pub fn iter(&self) -> impl Iterator<Item = (StreamId, FreeEntry)> + '_ {
        let mut order: Vec<&(StreamId, StreamBins)> = self.streams.iter().collect();
        order.sort_unstable_by_key(|(s, _)| *s);
        order
            .into_iter()
            .flat_map(|(s, bins)| bins.iter().map(move |e| (*s, *e)))
    }

    /// The largest free block of any stream.
    pub fn largest(&self) -> Option<FreeEntry> {
        self.streams
            .iter()
            .filter_map(|(_, bins)| bins.iter().next_back().copied())
            .max_by_key(|e| e.size)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;
    use crate::allocator::fit_order::FitOrder;

    #[test]
    fn classes_are_monotonic_and_in_range() {
        let mut last = 0;
        for units in 1..100_000u64 {
            let c = class_of(units * 512);
            assert!(c >= last, "class of {units} units");
            last = c;
        }
        assert!(class_of(!511) < CLASSES);
    }

    #[test]
    fn classes_follow_their_definition() {
        // Linear below 4 KiB, then eight classes per power of two, as the branchy form said.
        let reference = |units: u64| {
            if units < 8 {
                return units as usize;
            }
            let log2 = units.ilog2();
            8 * (log2 as usize - 2) + ((units >> (log2 - 3)) & 7) as usize
        };
        let big = (0..55).flat_map(|k| [(1u64 << k) - 1, 1 << k, (1 << k) + 1, 3 << k]);
        let largest = u64::MAX >> 9;
        for units in (0..70_000u64)
            .chain(big.filter(|&u| u <= largest))
            .chain([largest])
        {
            assert_eq!(class_of(units << 9), reference(units), "{units} units");
        }
    }

    fn entry(order: FitOrder, size: u64, counter: u32, ptr: u64, i: usize) -> FreeEntry {
        FreeEntry {
            size,
            tie: order.tie(counter, ptr),
            id: BlockId::new(i).expect("small"),
        }
    }

    #[test]
    fn streams_without_free_blocks_do_not_accumulate() {
        let mut set = FreeSet::default();
        for s in 0..1000 {
            let e = entry(FitOrder::Counter, 512, s as u32, 512 * (s + 1), s as usize);
            set.insert(StreamId(s), e);
            assert!(set.remove(StreamId(s), e.size, e.tie));
        }
        assert!(
            set.streams.len() <= SPARE_STREAMS,
            "{} bins kept",
            set.streams.len()
        );
        // Streams that still hold free blocks keep them, in order.
        let mut set = FreeSet::default();
        for s in 0..100 {
            set.insert(
                StreamId(99 - s),
                entry(FitOrder::Address, 512, 0, 512 * (s + 1), s as usize),
            );
        }
        assert_eq!(set.len(), 100);
        let streams: Vec<u64> = set.iter().map(|(s, _)| s.0).collect();
        assert_eq!(streams, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn equal_sizes_come_out_in_the_order_of_the_set() {
        let stream = StreamId(0);
        let segment = 20 << 20;
        // 300 whole 20 MiB segments freed in a scrambled address order; segment i was
        // obtained i-th, at a scrambled address.
        let ptr_of = |i: u64| (i * 7919 % 300 + 1) << 30;
        for order in [FitOrder::Address, FitOrder::BlockCounter, FitOrder::Counter] {
            let mut set = FreeSet::default();
            let mut model: Vec<(u64, u32)> = (0..300u64).map(|i| (ptr_of(i), i as u32)).collect();
            for &(ptr, counter) in model.iter().rev() {
                set.insert(
                    stream,
                    entry(order, segment, counter, ptr, counter as usize),
                );
            }
            match order {
                FitOrder::Address => model.sort_unstable(),
                _ => model.sort_unstable_by_key(|&(_, c)| c),
            }
            // Entries are named by their ids: their counters.
            let ids = |m: &[(u64, u32)]| m.iter().map(|&(_, c)| c as usize).collect::<Vec<_>>();
            let got: Vec<usize> = set.iter().map(|(_, e)| e.id.index()).collect();
            assert_eq!(got, ids(&model), "{order:?}");
            let at = |k: usize| entry(order, segment, model[k].1, model[k].0, 0);
            let id = |e: Option<FreeEntry>| e.map(|e| e.id.index());
            let want = |k: usize| Some(model[k].1 as usize);
            assert_eq!(id(set.prev_before(stream, &at(150))), want(149));
            assert!(set.remove(stream, segment, at(150).tie));
            assert_eq!(id(set.next_after(stream, &at(149))), want(151));
            model.remove(150);
            // A smaller request takes them in the set's order.
            for want in ids(&model) {
                let got = set.take_lower_bound(stream, 3 << 20, |_| true);
                assert_eq!(id(got), Some(want), "{order:?}");
            }
            assert_eq!(set.len(), 0);
            assert!(set.lower_bound(stream, 512).is_none());
        }
    }

    proptest! {
        /// The set answers exactly as an ordered set of (stream, size, address) would, or of
        /// (stream, size, counter, address) in the counter orders (whose counters here are
        /// unique per size and slot, as 2.12's block counter needs).
        #[test]
        fn matches_an_ordered_set(which in 0..3usize, ops in prop::collection::vec(
            (0u64..24, 1u64..40_000, 0u64..64, any::<bool>()), 1..400)) {
            let order = [FitOrder::Address, FitOrder::BlockCounter, FitOrder::Counter][which];
            let mut set = FreeSet::default();
            // Model entries: (stream, size, tie-break, ptr), the tie-break the counter (the
            // counter orders) or 0 (the address order), then the address.
            let mut model = BTreeSet::new();
            // Each entry's model key, by the id it was inserted with.
            let mut ptrs = std::collections::HashMap::new();
            let tie = |counter: u32| if order == FitOrder::Address { 0 } else { counter };
            for (i, (stream, units, slot, insert)) in ops.into_iter().enumerate() {
                // A third of the operations on two busy streams (many entries per class), the
                // rest on sixteen others: more than SPARE_STREAMS, so empty bins get dropped.
                let stream = StreamId(if stream < 8 { stream % 2 } else { stream });
                // Sizes cluster and spread: many equal sizes and a few huge ones.
                let size = if units % 7 == 0 { units << 20 } else { (units % 97 + 1) * 512 };
                let ptr = slot * (1 << 40) + size;
                // Counters unrelated to addresses: a slot's segment was obtained at any time.
                let counter = (slot * 37 % 64) as u32;
                let key = (stream, size, tie(counter), ptr);
                if insert && !model.contains(&key) {
                    model.insert(key);
                    ptrs.insert(i, key);
                    set.insert(stream, entry(order, size, counter, ptr, i));
                } else if !insert {
                    let want = model.remove(&key);
                    prop_assert_eq!(set.remove(stream, size, order.tie(counter, ptr)), want);
                }
                prop_assert_eq!(set.len(), model.len());
                let probe = (units % 200 + 1) * 512 * 64;
                let view = |e: FreeEntry| ptrs[&e.id.index()];
                let first = (stream, probe, 0, 0);
                let got = set.lower_bound(stream, probe).map(view);
                let want = model.range(first..).next().copied().filter(|k| k.0 == stream);
                prop_assert_eq!(got, want);
                if units % 5 == 0 {
                    let accept = units % 10 == 0;
                    let got = set.take_lower_bound(stream, probe, |_| accept).map(view);
                    prop_assert_eq!(got, want.filter(|_| accept));
                    if let Some(k) = got {
                        model.remove(&k);
                    }
                    prop_assert_eq!(set.len(), model.len());
                }
                if let Some(&k) = model.iter().find(|k| k.0 == stream) {
                    let at = entry(order, k.1, ((k.3 >> 40) * 37 % 64) as u32, k.3, 0);
                    let next = model.range((k.0, k.1, k.2, k.3 + 1)..).next().copied();
                    prop_assert_eq!(set.next_after(stream, &at).map(view), next.filter(|n| n.0 == stream));
                    let prev = model.range(..k).next_back().copied();
                    prop_assert_eq!(set.prev_before(stream, &at).map(view), prev.filter(|p| p.0 == stream));
                }
                let got = set.last_below(stream, probe).map(view);
                let want = model.range(..first).next_back().copied().filter(|k| k.0 == stream);
                prop_assert_eq!(got, want);
            }
            let listed: Vec<_> = set.iter().map(|(_, e)| ptrs[&e.id.index()]).collect();
            prop_assert_eq!(listed, model.iter().copied().collect::<Vec<_>>());
            let largest = set.largest().map(|e| e.size);
            prop_assert_eq!(largest, model.iter().map(|k| k.1).max());
        }
    }
}
