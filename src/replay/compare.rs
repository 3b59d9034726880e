//! Comparing what the core did with the recording (check mode): event by event, a batch of
//! frees completed together as a set, the first difference reported with its context.
//!
//! # Invariants
//! - A snapshot event matches on its size alone, an OOM on its size and pool (its `addr`
//!   is the driver's free bytes, which depend on the device, not on the allocator); every
//!   other event on action, address, size and pool (recorded, or inferred: Note [Inferred
//!   pools]).
//! - Each matched event is counted once, in its kind's `Compared` field.
//! - A batch of `free_completed` events matches when it holds the same (address, size,
//!   stream) members, in any order; every other event matches only in order.

use crate::allocator::size::format_size;
use crate::allocator::{TraceAction, TraceEntry};

use super::engine::Engine;
use super::report::{Divergence, describe};

impl Engine<'_> {
    /// The core's trace entries since the last comparison, less the actions the recording
    /// skipped.
    fn core_entries(&mut self) -> Vec<crate::allocator::TraceEntry> {
        let mut entries = self.alloc.take_trace();
        if self.skipped.any() {
            entries.retain(|e| !self.skipped.hides(e.action));
        }
        entries
    }

    /// Whether the core's events since the last comparison are exactly the recorded
    /// `start..end`; if so they are counted, else left for [`Engine::compare`] (where they
    /// first differed is kept in `reading_differed`).
    pub(super) fn reproduces(&mut self, start: usize, end: usize) -> bool {
        let actual = self.core_entries();
        let expected = &self.events[start..end];
        let difference = first_difference(expected, &actual);
        if difference.is_none() {
            for x in expected {
                self.count(x.action);
            }
        }
        self.reading_differed = difference.map(|k| (start + k, actual.get(k).copied()));
        difference.is_none()
    }

    /// Compares what the core emitted with the recorded events `start..end`.
    pub(super) fn compare(&mut self, start: usize, end: usize) {
        if !self.check || self.divergence.is_some() {
            return;
        }
        let actual = self.core_entries();
        let expected = &self.events[start..end];
        match first_difference(expected, &actual) {
            None => {
                for x in expected {
                    self.count(x.action);
                }
            }
            Some(k) => {
                for x in &expected[..k] {
                    self.count(x.action);
                }
                let index = start + k.min(expected.len());
                let expected = expected.get(k).map_or("nothing more".to_string(), describe);
                self.diverged_as = actual.get(k).copied();
                let actual = actual.get(k).map_or("nothing".to_string(), describe);
                self.diverge(index, expected, actual);
            }
        }
    }

    pub(super) fn count(&mut self, action: TraceAction) {
        let c = &mut self.compared;
        match action {
            TraceAction::Alloc => c.allocs += 1,
            TraceAction::FreeRequested | TraceAction::FreeCompleted => c.frees += 1,
            TraceAction::SegmentAlloc => c.segment_allocs += 1,
            TraceAction::SegmentFree => c.segment_frees += 1,
            TraceAction::SegmentMap | TraceAction::SegmentUnmap => c.segment_maps += 1,
            TraceAction::Oom => c.ooms += 1,
            TraceAction::Snapshot => c.snapshots += 1,
            TraceAction::UserDefined => {}
        }
    }

    pub(super) fn diverge(&mut self, index: usize, expected: String, actual: String) {
        if !self.check {
            return;
        }
        let from = index.saturating_sub(4);
        let to = (index + 3).min(self.events.len());
        let mut context: Vec<String> = (from..to)
            .map(|k| {
                let mark = if k == index { ">>" } else { "  " };
                format!("{mark} #{k}: {}", describe(&self.events[k]))
            })
            .collect();
        let recorded = self.events.get(index);
        if let Some(e) = recorded.filter(|e| {
            matches!(
                e.action,
                TraceAction::SegmentMap | TraceAction::SegmentAlloc
            )
        }) {
            self.reservation_spacing = self
                .alloc
                .device()
                .reservation_at(e.addr)
                .map(|(start, _)| e.addr - start)
                .filter(|&spacing| spacing > 0);
            context.push(format!(
                "hint: segments are placed where the recording put them; if that place is taken by the address range reserved for an expandable segment, the simulated device ({}) is larger than the recorded one: pass --capacity with the recorded device's memory",
                format_size(self.alloc.device().config().capacity)
            ));
        }
        let stats = self.alloc.stats();
        context.push(format!(
            "allocator: {} allocated, {} reserved in {} segments, largest free block {}",
            format_size(stats.allocated_bytes.all_current().max(0) as u64),
            format_size(stats.reserved_bytes.all_current().max(0) as u64),
            stats.segment.all_current(),
            format_size(self.alloc.largest_free_block()),
        ));
        self.divergence = Some(Divergence {
            index,
            expected,
            actual,
            context,
        });
    }
}

/// Where the core's events first differ from the recorded ones, `None` if they do not.
/// A run of `free_completed` events is a batch completed together (one `process_events`, or
/// the synchronisation before a release): PyTorch lists it in its hash map's order over
/// streams, which a recording cannot reveal, so a batch matches as a set (every member once,
/// nothing else); everything else matches in order.
fn first_difference(expected: &[TraceEntry], actual: &[TraceEntry]) -> Option<usize> {
    let completed = |e: &TraceEntry| e.action == TraceAction::FreeCompleted;
    let mut k = 0;
    while k < expected.len().max(actual.len()) {
        let (Some(x), Some(a)) = (expected.get(k), actual.get(k)) else {
            return Some(k);
        };
        if completed(x) && completed(a) {
            let run =
                |events: &[TraceEntry]| events[k..].iter().take_while(|e| completed(e)).count();
            let (n, m) = (run(expected), run(actual));
            let key = |e: &TraceEntry| (e.addr, e.size, e.stream);
            let mut left: Vec<_> = actual[k..k + m].iter().map(key).collect();
            for (i, x) in expected[k..k + n].iter().enumerate() {
                match left.iter().position(|&a| a == key(x)) {
                    Some(p) => {
                        left.swap_remove(p);
                    }
                    None => return Some(k + i),
                }
            }
            if !left.is_empty() {
                return Some(k + n);
            }
            k += n;
            continue;
        }
        if !same(x, a) {
            return Some(k);
        }
        k += 1;
    }
    None
}

/// Whether the core's event is the recorded one.
fn same(x: &TraceEntry, a: &TraceEntry) -> bool {
    if x.action != a.action {
        return false;
    }
    match x.action {
        // A snapshot's pool is the one it was asked for, not a decision.
        TraceAction::Snapshot => x.size == a.size,
        // The free device memory of an OOM depends on the device, not on the allocator.
        TraceAction::Oom => x.size == a.size && x.pool == a.pool,
        _ => x.addr == a.addr && x.size == a.size && x.pool == a.pool,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(action: TraceAction, addr: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size: 512,
            stream: crate::device::StreamId::DEFAULT,
            time_us: None,
            pool: crate::allocator::PoolId::DEFAULT,
        }
    }

    #[test]
    fn a_batch_of_completed_frees_matches_as_a_set() {
        use TraceAction::{Alloc, FreeCompleted as Done, SegmentFree};
        let recorded = [e(Done, 3), e(Done, 1), e(Done, 2), e(Alloc, 9)];
        let ours = [e(Done, 1), e(Done, 2), e(Done, 3), e(Alloc, 9)];
        assert_eq!(first_difference(&recorded, &ours), None);
        // A member missing, one too many, or another member: a difference.
        let missing = [e(Done, 1), e(Done, 2), e(Alloc, 9)];
        assert_eq!(
            first_difference(&recorded, &missing),
            Some(0),
            "3 is missing"
        );
        let extra = [e(Done, 1), e(Done, 2), e(Done, 3), e(Done, 4), e(Alloc, 9)];
        assert_eq!(first_difference(&recorded, &extra), Some(3));
        let other = [e(Done, 1), e(Done, 2), e(Done, 4), e(Alloc, 9)];
        assert_eq!(first_difference(&recorded, &other), Some(0));
        // Anything else keeps its order.
        let releases = [e(SegmentFree, 1), e(SegmentFree, 2)];
        let swapped = [e(SegmentFree, 2), e(SegmentFree, 1)];
        assert_eq!(first_difference(&releases, &swapped), Some(0));
        assert_eq!(first_difference(&releases, &releases[..1]), Some(1));
    }
}
