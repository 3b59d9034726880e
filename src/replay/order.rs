//! Which best-fit order reproduces a recording, and the order in which the segments of its
//! start state were obtained.
//!
//! # Note [Finding the order]
//! Releases of PyTorch order equal-size free blocks differently ([`FitOrder`]), and a
//! recording does not say which release made it. A check replay first tries the order its
//! own fields suggest, then the others where it diverges ([`candidates`]: trace entries with
//! `pool_id` come from 2.12 or later, so the 2.13+ order, then 2.12's, then the address
//! order; otherwise the address order of 2.11 and before, then the 2.13+ one, then 2.12's).
//! When the first reproduces the recording the other of address and counter is tried too,
//! so that the report can say both do; what-if replays then use the counter order.
//! `--pytorch` names the order instead.
//!
//! The counter order needs the order in which segments were obtained. Those the trace
//! creates follow its events, but a recording that starts mid-run lists its first segments
//! by address. Every allocation that chose among equal-size free blocks of two of those
//! segments says which was obtained first, and so does every run of releases that freed
//! equal-size segments of them in an order of its own (a flush and garbage collection go up
//! the pool's order, the release of oversize blocks down it: the engine tries the one
//! precedence, then the other, on that operation alone). [`Derivation`] collects these
//! precedences in one replay (reordering the replay's counters as they arrive, so that the
//! replay keeps following the recording), orders the segments topologically (unconstrained
//! ones by address, and reported as guessed), and one more replay verifies the order. A
//! cycle, or an allocation that took a block of a newer segment over an equal one of an
//! older, means the counter order cannot reproduce the recording. In 2.12's block-counter order every block
//! has its own counter: a start state's blocks are numbered by address, as guessed.
//!
//! # Invariants
//! - At most two replays per order tried, one that collects precedences and one that
//!   verifies (each run twice where the device's memory is inferred from expandable
//!   reservations); a run of releases is retried on its operation alone, at most 64 times,
//!   and a replay tries at most 4 096 operations with releases in all (each try clones the
//!   allocator's state), after which releases teach the derivation nothing more.
//! - `rank_of` and `idx_of` are inverse permutations; the replay's counter of start segment
//!   `i` (by address) is `rank_of[i]`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

use crate::allocator::{CachingAllocator, FitOrder};
use crate::device::SimDevice;

/// How the order of a replay was chosen and what it knows of the segments' counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OrderingReport {
    /// The order the replay followed.
    #[serde(serialize_with = "order_name")]
    pub replayed: FitOrder,
    /// `address`, `block_counter`, `counter`, or `both` when the address and the counter
    /// orders both reproduce the recording (check replays); the order followed otherwise.
    pub ordering: String,
    /// `found` (from the recording) or `flag` (`--pytorch`).
    pub ordering_source: &'static str,
    /// What is known of the order the segments were obtained in (counter orders only):
    /// `known` (the trace creates every segment, or one existed before it), `derived` (from
    /// the recording's own choices), `partly_guessed` (some start segments ordered by
    /// address for lack of evidence).
    pub counter_order: Option<&'static str>,
    /// The start segments whose place in the counter order was guessed (by address).
    pub guessed_segments: Vec<u64>,
    /// Whether the order reproduces the recording; `None` where no check replay said.
    pub reproduces: Option<bool>,
    /// Why the counter order cannot reproduce the recording, where its choices showed it.
    pub contradiction: Option<String>,
}

fn order_name<S: serde::Serializer>(order: &FitOrder, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(order.name())
}

impl OrderingReport {
    /// The finding in one sentence.
    pub fn sentence(&self) -> String {
        let source = if self.ordering_source == "flag" {
            "as --pytorch asked"
        } else {
            "found from the recording"
        };
        let mut s = match (self.ordering.as_str(), self.reproduces) {
            ("both", _) => format!(
                "both orderings reproduce this recording (address, of PyTorch 2.11 and before, and segment counter, of 2.13+); what-if replays use {}",
                self.replayed.describe()
            ),
            (_, Some(true)) => format!(
                "{} reproduces this recording ({source})",
                self.replayed.describe()
            ),
            (_, None) => format!("replayed under {} ({source})", self.replayed.describe()),
            (_, Some(false)) => format!(
                "no ordering reproduces this recording; shown under {} ({source})",
                self.replayed.describe()
            ),
        };
        match self.counter_order {
            Some("partly_guessed") => s.push_str(&format!(
                "; {} start segments' place in the counter order guessed by address",
                self.guessed_segments.len()
            )),
            Some("derived") => {
                s.push_str("; the start segments' order derived from the recording's choices")
            }
            _ => {}
        }
        s
    }
}

/// The order a replay follows and, for a counter order, the order in which the start
/// state's segments are restored (indices into them; `None`: by address).
#[derive(Clone, Debug, Default)]
pub(crate) struct Found {
    pub order: FitOrder,
    pub start_order: Option<Vec<usize>>,
    pub report: OrderingReport,
}

impl Found {
    /// `order`, before any replay said more: found unless the caller says otherwise.
    pub fn named(order: FitOrder) -> Found {
        Found {
            order,
            start_order: None,
            report: OrderingReport {
                replayed: order,
                ordering: order.name().to_string(),
                ordering_source: "found",
                ..OrderingReport::default()
            },
        }
    }
}

/// Precedences between start segments read off a recording's choices. See the module
/// documentation.
#[derive(Clone, Debug)]
pub(super) struct Derivation {
    /// Start segment addresses, by index (the tie-break of the topological order).
    addresses: Vec<u64>,
    /// Start segment indices, by address.
    by_address: FxHashMap<u64, u32>,
    rank_of: Vec<u32>,
    idx_of: Vec<u32>,
    /// (earlier, later), as start segment indices.
    edges: FxHashSet<(u32, u32)>,
    /// Whether the replay's counters were reordered (the collecting replay then needs a
    /// verifying one).
    pub reordered: bool,
    /// Why the counter order cannot reproduce the recording, once known.
    pub contradiction: Option<String>,
}

impl Derivation {
    /// Start segments at `addresses`, restored in the order `restored` (indices).
    pub fn new(addresses: Vec<u64>, restored: &[usize]) -> Self {
        let n = addresses.len();
        let mut rank_of = vec![0; n];
        let mut idx_of = vec![0; n];
        for (rank, &i) in restored.iter().enumerate() {
            rank_of[i] = rank as u32;
            idx_of[rank] = i as u32;
        }
        Derivation {
            by_address: addresses
                .iter()
                .enumerate()
                .map(|(i, &a)| (a, i as u32))
                .collect(),
            addresses,
            rank_of,
            idx_of,
            edges: FxHashSet::default(),
            reordered: false,
            contradiction: None,
        }
    }

    /// An allocation at event `event` took the block at `chosen` among `ties` (address,
    /// counter) of equal size: records what that says, and reorders `alloc`'s counters if
    /// it would have taken another.
    pub fn observe(
        &mut self,
        event: usize,
        ties: &[(u64, u32)],
        chosen: u64,
        alloc: &mut CachingAllocator<SimDevice>,
    ) {
        if self.contradiction.is_some() {
            return;
        }
        let n = self.rank_of.len() as u32;
        let Some(&(_, counter)) = ties.iter().find(|t| t.0 == chosen) else {
            return;
        };
        if counter >= n {
            if ties.iter().any(|t| t.1 < n) {
                self.contradiction = Some(format!(
                    "event {event} took a block of a segment the trace created over an equal one of an older segment"
                ));
            }
            return;
        }
        if ties.iter().any(|t| t.1 == counter && t.0 < chosen) {
            self.contradiction = Some(format!(
                "event {event} took a block above an equal free one of the same segment"
            ));
            return;
        }
        let a = self.idx_of[counter as usize];
        for &(_, c) in ties.iter().filter(|t| t.1 < n && t.1 != counter) {
            self.edges.insert((a, self.idx_of[c as usize]));
        }
        if ties.iter().any(|t| t.1 < counter) {
            self.rerank(event, alloc);
        }
    }

    /// Keeps what a release run that reproduced the recording says of the start segments:
    /// per kind (size, stream and pool) among `whole_free` (address, kind), the order of
    /// those it `released` as the current order has them, and, where the run took all of
    /// them above every other one of the kind (a walk down the pools' order) or below (a
    /// pick up it), that too. Runs that took them out of order (garbage collection, by age)
    /// say nothing of the others. Linear in the run and the free segments.
    pub fn settle<K: PartialEq>(&mut self, released: &[u64], whole_free: &[(u64, K)]) {
        let released: FxHashSet<u64> = released.iter().copied().collect();
        let mut kinds: Vec<&K> = Vec::new();
        for (address, kind) in whole_free {
            if released.contains(address) && !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        for kind in kinds {
            let (mut taken, mut rest): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
            for (address, _) in whole_free.iter().filter(|(_, k)| k == kind) {
                if let Some(i) = self.segment_at(*address) {
                    if released.contains(address) {
                        taken.push(i);
                    } else {
                        rest.push(i);
                    }
                }
            }
            taken.sort_unstable_by_key(|&i| self.rank_of[i as usize]);
            for w in taken.windows(2) {
                self.edges.insert((w[0], w[1]));
            }
            let (Some(&low), Some(&high)) = (taken.first(), taken.last()) else {
                continue;
            };
            let rank = |i: u32| self.rank_of[i as usize];
            let edges: Vec<(u32, u32)> = if rest.iter().all(|&u| rank(u) < rank(low)) {
                rest.iter().map(|&u| (u, low)).collect()
            } else if rest.iter().all(|&u| rank(u) > rank(high)) {
                rest.iter().map(|&u| (high, u)).collect()
            } else {
                Vec::new()
            };
            self.edges.extend(edges);
        }
    }

    /// The start segment at `address`, if one starts there.
    pub fn segment_at(&self, address: u64) -> Option<u32> {
        self.by_address.get(&address).copied()
    }

    /// Records that start segment `earlier` was obtained before `later` (a release run's
    /// order says so) and reorders `alloc`'s counters to agree; false if that contradicts
    /// what is known (the precedence is then not kept).
    pub fn prefer(
        &mut self,
        event: usize,
        earlier: u32,
        later: u32,
        alloc: &mut CachingAllocator<SimDevice>,
    ) -> bool {
        if self.contradiction.is_some() || self.edges.contains(&(later, earlier)) {
            return false;
        }
        self.edges.insert((earlier, later));
        let Some(order) = self.topological() else {
            self.edges.remove(&(earlier, later));
            return false;
        };
        self.apply(event, &order, alloc);
        self.contradiction.is_none()
    }

    /// Puts `alloc`'s start segments in an order every precedence holds in.
    fn rerank(&mut self, event: usize, alloc: &mut CachingAllocator<SimDevice>) {
        match self.topological() {
            Some(order) => self.apply(event, &order, alloc),
            None => {
                self.contradiction = Some(format!(
                    "event {event}: the recording's choices between its first segments contradict each other"
                ));
            }
        }
    }

    /// Gives `alloc`'s start segments counters in `order` (start segment indices).
    fn apply(&mut self, event: usize, order: &[usize], alloc: &mut CachingAllocator<SimDevice>) {
        let mut new_of = vec![0u32; order.len()];
        for (rank, &i) in order.iter().enumerate() {
            new_of[self.rank_of[i] as usize] = rank as u32;
        }
        if let Err(e) = alloc.permute_counters(&new_of) {
            self.contradiction = Some(format!("event {event}: {e}"));
            return;
        }
        for (rank, &i) in order.iter().enumerate() {
            self.rank_of[i] = rank as u32;
            self.idx_of[rank] = i as u32;
        }
        self.reordered = true;
    }

    /// The start segments in an order every precedence holds in, unconstrained ones by
    /// address; `None` if the precedences form a cycle.
    fn topological(&self) -> Option<Vec<usize>> {
        let n = self.addresses.len();
        let mut after: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut before = vec![0usize; n];
        for &(a, b) in &self.edges {
            after[a as usize].push(b);
            before[b as usize] += 1;
        }
        let mut ready: BinaryHeap<Reverse<(u64, usize)>> = (0..n)
            .filter(|&i| before[i] == 0)
            .map(|i| Reverse((self.addresses[i], i)))
            .collect();
        let mut order = Vec::with_capacity(n);
        while let Some(Reverse((_, i))) = ready.pop() {
            order.push(i);
            for &j in &after[i] {
                let j = j as usize;
                before[j] -= 1;
                if before[j] == 0 {
                    ready.push(Reverse((self.addresses[j], j)));
                }
            }
        }
        (order.len() == n).then_some(order)
    }

    /// The derived order and the addresses of the segments no precedence placed; `Err`
    /// with the reason when the counter order cannot reproduce the recording.
    pub fn finish(&self) -> Result<(Vec<usize>, Vec<u64>), String> {
        if let Some(why) = &self.contradiction {
            return Err(why.clone());
        }
        let order = self
            .topological()
            .ok_or("the recording's choices between its first segments contradict each other")?;
        let mut placed = vec![false; self.addresses.len()];
        for &(a, b) in &self.edges {
            placed[a as usize] = true;
            placed[b as usize] = true;
        }
        let guessed = if self.addresses.len() > 1 {
            order
                .iter()
                .filter(|&&i| !placed[i])
                .map(|&i| self.addresses[i])
                .collect()
        } else {
            Vec::new()
        };
        Ok((order, guessed))
    }
}

/// How the recorded runs of equal releases of one operation are read while it is retried:
/// each run went up the pool's order (a flush, garbage collection, the oversize release's
/// single pick: the recorded segment first) or down it (the oversize release's walk: the
/// recorded segment last), with the precedences that reading implies.
#[derive(Clone, Debug, Default)]
pub(super) struct RunReadings {
    taken: Vec<RunReading>,
    /// Readings begun, per run and direction: each at most once.
    tried: FxHashSet<(usize, bool)>,
}

/// One run's reading: (its first event, down the order, its precedences).
type RunReading = (usize, bool, Vec<(u32, u32)>);

impl RunReadings {
    /// The readings to try after the run starting at `first` (its start segments `chain`, in
    /// recorded order) released `a` where the recording released `e`: the direction this
    /// run was taken in so far with the new pair, then the other; none when both were tried.
    pub fn next(&self, first: usize, chain: &[u32], e: u32, a: u32) -> Vec<RunReadings> {
        let known = self.taken.iter().position(|t| t.0 == first);
        let directions = match known.map(|k| self.taken[k].1) {
            Some(down) => [down, !down],
            None => [false, true],
        };
        let mut readings = Vec::new();
        for down in directions {
            let pair = if down { (a, e) } else { (e, a) };
            let mut next = self.clone();
            let mut edges: Vec<(u32, u32)> = match known.filter(|&k| self.taken[k].1 == down) {
                // Taken this way already: only a new pair is progress.
                Some(k) if self.taken[k].2.contains(&pair) => continue,
                Some(k) => self.taken[k].2.clone(),
                None if next.tried.insert((first, down)) => {
                    let mut chain = chain.to_vec();
                    if down {
                        chain.reverse();
                    }
                    chain.windows(2).map(|w| (w[0], w[1])).collect()
                }
                None => continue,
            };
            edges.push(pair);
            next.taken.retain(|t| t.0 != first);
            next.taken.push((first, down, edges));
            readings.push(next);
        }
        readings
    }

    /// Every precedence taken.
    pub fn edges(&self) -> Vec<(u32, u32)> {
        self.taken
            .iter()
            .flat_map(|t| t.2.iter().copied())
            .collect()
    }
}

/// The orders to try on a recording, most likely first (Note [Finding the order]).
pub(super) fn candidates(has_pool_ids: bool) -> [FitOrder; 3] {
    if has_pool_ids {
        [FitOrder::Counter, FitOrder::BlockCounter, FitOrder::Address]
    } else {
        [FitOrder::Address, FitOrder::Counter, FitOrder::BlockCounter]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn derivation(edges: &[(u32, u32)]) -> Derivation {
        let mut d = Derivation::new(vec![0x3000, 0x1000, 0x2000, 0x4000], &[0, 1, 2, 3]);
        d.edges.extend(edges.iter().copied());
        d
    }

    #[test]
    fn precedences_order_the_segments_and_the_rest_go_by_address() {
        // 3 before 0; 1 and 2 unconstrained: by address 1 (0x1000), 2 (0x2000), then 3 and
        // 0 in their precedence, though 0's address is lower.
        let (order, guessed) = derivation(&[(3, 0)]).finish().expect("acyclic");
        assert_eq!(order, vec![1, 2, 3, 0]);
        assert_eq!(guessed, vec![0x1000, 0x2000]);
    }

    #[test]
    fn a_cycle_means_the_counter_order_cannot_reproduce() {
        assert!(derivation(&[(0, 1), (1, 2), (2, 0)]).finish().is_err());
    }
}
