//! Comparing what the core did with the recording (check mode): event by event, the first
//! difference reported with its context.
//!
//! # Invariants
//! - An OOM or snapshot event matches on its size alone (an OOM's `addr` is the driver's
//!   free bytes, which depend on the device, not on the allocator); every other event on
//!   action, address and size.
//! - Each matched event is counted once, in its kind's `Compared` field.

use crate::allocator::size::format_size;
use crate::allocator::{TraceAction, TraceEntry};

use super::engine::Engine;
use super::report::{Divergence, describe};

impl Engine<'_> {
    /// Whether the core's events since the last comparison are exactly the recorded
    /// `start..end`; if so they are counted, else left for [`Engine::compare`].
    pub(super) fn reproduces(&mut self, start: usize, end: usize) -> bool {
        let actual = self.alloc.take_trace();
        let expected = &self.events[start..end];
        let matches =
            actual.len() == expected.len() && expected.iter().zip(&actual).all(|(x, a)| same(x, a));
        if matches {
            for x in expected {
                self.count(x.action);
            }
        }
        matches
    }

    /// Compares what the core emitted with the recorded events `start..end`.
    pub(super) fn compare(&mut self, start: usize, end: usize) {
        if !self.check || self.divergence.is_some() {
            return;
        }
        let actual = self.alloc.take_trace();
        let expected = &self.events[start..end];
        for k in 0..expected.len().max(actual.len()) {
            match (expected.get(k), actual.get(k)) {
                (Some(x), Some(a)) if same(x, a) => self.count(x.action),
                (x, a) => {
                    let index = start + k.min(expected.len());
                    let expected = x.map_or("nothing more".to_string(), describe);
                    let actual = a.map_or("nothing".to_string(), describe);
                    self.diverge(index, expected, actual);
                    return;
                }
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

/// Whether the core's event is the recorded one.
fn same(x: &TraceEntry, a: &TraceEntry) -> bool {
    if x.action != a.action {
        return false;
    }
    match x.action {
        // The free device memory of an OOM depends on the device, not on the allocator.
        TraceAction::Oom | TraceAction::Snapshot => x.size == a.size,
        _ => x.addr == a.addr && x.size == a.size,
    }
}
