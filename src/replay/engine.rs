//! The stepper: turns recorded events back into the operations that caused them and drives
//! the core with them, one driving event (and its effects) at a time.
//!
//! # Note [Reading releases]
//! A recording does not say why segments were released right before an allocation: a
//! user's `empty_cache()`, or the allocator itself (garbage collection, oversize release, a
//! flush after the driver refused). Check mode tries the allocator's own reading first and
//! keeps it if it reproduces the recording, else replays an `empty_cache()`; releases
//! before an `oom` are always the failing allocation's flush. What-if mode follows the
//! readings a check pass found.
//!
//! # Note [Replaying pools]
//! A recording does not say when a capture or `use_mem_pool` routed requests to a private
//! pool, only which pool each event's block lies in (recorded, or inferred: Note [Inferred
//! pools]). Each request of a private pool is routed there alone, on its own stream, as a
//! `use_mem_pool` route (which from 2.13 on polls events and flushes as the default pool
//! does, so the recording's own completions and releases are followed); an `oom` of a
//! private pool with neither a completion nor a release before it runs as a capture, which
//! neither polls events nor flushes. A pool is referenced from its first event on, except
//! during a run of releases in which the recording frees or unmaps one of its segments: its
//! owners were gone then, so the flush gives back its unsplit cached memory (after the run
//! it is referenced again, as only the recording's releases say when it was freeable). A
//! pool's `no_split` is read off the final state (Note [Inferred pools]).
//!
//! # Invariants
//! - Every recorded address maps to at most one live pointer (`ptrs`), or is known to have
//!   failed in this replay (`failed`, what-if mode).
//! - A deferred free waits on a synthetic stream of its own, completed exactly where the
//!   recording completes the free.
//! - Address hints are cleared after every operation, so no hint outlives its event.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::allocator::size::{PoolKind, format_size};
use crate::allocator::{
    AllocError, CachingAllocator, PoolId, PoolOptions, RouteKind, StreamFilter, TraceAction,
    TraceEntry,
};
use crate::device::{DevicePtr, SimDevice, StreamId};
use crate::recording::Recording;
use crate::recording::event_pools::unsplit_pools;
use crate::replay::start_state::{StartSegment, start_state};

use super::order::{Derivation, RunReadings};
use super::report::{Compared, Divergence, SeriesPoint, describe};
use super::{Options, ReplayError, SYNTHETIC_STREAM_BASE, device_events};

pub(super) struct Engine<'a> {
    pub(super) events: &'a [TraceEntry],
    /// Index of the next event to replay.
    pub(super) position: usize,
    pub(super) start_segments: usize,
    pub(super) alloc: CachingAllocator<SimDevice>,
    pub(super) check: bool,
    /// Recorded address → the pointer the core returned for it.
    pub(super) ptrs: FxHashMap<u64, DevicePtr>,
    /// Recorded addresses whose allocation failed in this replay (what-if mode).
    pub(super) failed: FxHashSet<u64>,
    /// Blocks live at the start that a fresh start could not allocate (counted as OOMs; the
    /// statistics are reset when the trace starts).
    pub(super) start_ooms: u64,
    /// Recorded address of a deferred free → the stream its completion waits on.
    pub(super) deferred: FxHashMap<u64, StreamId>,
    pub(super) next_stream: u64,
    pub(super) compared: Compared,
    pub(super) divergence: Option<Divergence>,
    pub(super) series: Vec<SeriesPoint>,
    pub(super) series_every: usize,
    /// The replay's memory budget (`Setup::max_memory_bytes`).
    max_memory_bytes: Option<u64>,
    /// Where progress was last reported and the budget last checked: kept between calls,
    /// so that a replay advanced an operation at a time is checked as often.
    checked_at: usize,
    /// The most allocated and reserved bytes since the last series point.
    bucket: (u64, u64),
    /// Starts of the release runs that the allocator made inside a malloc (not a user's
    /// `empty_cache`): found in check mode, followed in what-if mode.
    pub(super) releases_in_malloc: FxHashMap<usize, ReleaseReading>,
    /// Check mode: when the recording placed a new expandable segment inside a range the
    /// simulated device had reserved, how far from that range's start: the recorded
    /// device's reservation size (see `capacity_for_reservation`).
    pub(super) reservation_spacing: Option<u64>,
    /// Where `events` starts in the device's trace (a window, `WhatIf::window`).
    first_event: usize,
    /// Replaying a window: frees of blocks allocated before it are skipped.
    windowed: bool,
    /// Check mode in a counter order: the start segments' order being read off the
    /// recording (Note [Finding the order]).
    pub(super) derivation: Option<Derivation>,
    /// What the core did at the divergence, where it did something.
    pub(super) diverged_as: Option<TraceEntry>,
    /// The free actions the recording left out (`skip_actions`).
    pub(super) skipped: Skipped,
    /// Tries of operations with releases left to this replay ([`RELEASE_TRIES`]).
    release_retries: usize,
    /// Where the allocator's own reading of the last release run first differed from the
    /// recording, and what the core did there (Note [Reading releases]).
    pub(super) reading_differed: Option<(usize, Option<TraceEntry>)>,
    /// The private pools the recording shows made with options (Note [Inferred pools]).
    pool_options: FxHashMap<PoolId, PoolOptions>,
}

/// How a run of releases before an allocation was read: by the allocator inside the
/// malloc (Note [Reading releases]); a run read as a user's `empty_cache` has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReleaseReading {
    /// The run's completed frees were done before the malloc polled events.
    InMalloc,
    /// The run's completed frees were waited for by the flush's synchronisation (so the
    /// malloc's first search could not reuse them).
    InMallocSynced,
}

/// The most times one run of releases is replayed while deriving the start segments' order.
const MAX_RELEASE_RETRIES: usize = 64;

/// The most operations with releases one replay runs (and clones its state for) while
/// deriving the start segments' order: past it, releases teach nothing more.
const RELEASE_TRIES: usize = 4096;

/// What the allocator may take for mapped pages ([`CachingAllocator::set_page_budget`]):
/// the replay's budget less the `other` bytes of its state, all of it in what-if mode; a
/// quarter in check mode, which holds up to three more copies of the allocator (with its
/// device) while it tries an operation again (`Saved`, and the readings of a release run).
fn page_allowance(budget: Option<u64>, other: u64, check: bool) -> Option<u64> {
    let left = budget?.saturating_sub(other);
    Some(if check { left / 4 } else { left })
}

/// The replay's error for an allocator's failure at event `index`: its memory budget where
/// mapping pages would pass it, else the failure before the trace (for the caller to name
/// otherwise).
fn budget_error(source: AllocError, budget: Option<u64>, index: usize) -> ReplayError {
    match (source, budget) {
        (AllocError::HostMemory { .. }, Some(budget)) => {
            ReplayError::MemoryBudget { budget, index }
        }
        (source, _) => ReplayError::BeforeTrace(source),
    }
}

/// The engine's state before an operation, to try it again (Note [Finding the order]).
struct Saved {
    alloc: CachingAllocator<SimDevice>,
    derivation: Option<Derivation>,
    ptrs: FxHashMap<u64, DevicePtr>,
    deferred: FxHashMap<u64, StreamId>,
    next_stream: u64,
    releases_in_malloc: FxHashMap<usize, ReleaseReading>,
    compared: Compared,
}

impl Saved {
    fn of(engine: &Engine<'_>) -> Saved {
        Saved {
            alloc: engine.alloc.clone(),
            derivation: engine.derivation.clone(),
            ptrs: engine.ptrs.clone(),
            deferred: engine.deferred.clone(),
            next_stream: engine.next_stream,
            releases_in_malloc: engine.releases_in_malloc.clone(),
            compared: engine.compared,
        }
    }

    /// Puts `engine` back as it was.
    fn restore(&self, engine: &mut Engine<'_>) {
        engine.alloc = self.alloc.clone();
        engine.ptrs = self.ptrs.clone();
        engine.deferred = self.deferred.clone();
        engine.next_stream = self.next_stream;
        engine.releases_in_malloc = self.releases_in_malloc.clone();
        engine.compared = self.compared;
        engine.divergence = None;
        engine.diverged_as = None;
        engine.reading_differed = None;
        engine.reservation_spacing = None;
        engine.derivation = self.derivation.clone();
    }
}

/// The actions of a device's trace that `_record_memory_history(skip_actions=...)` left out,
/// where the trace proves it. A window of a longer run may rightly lack any kind of entry, so
/// a kind counts as skipped only where the trace has none of it and one of its entries had to
/// be there: a free of a block inside a segment the trace allocated (its `alloc`), a
/// completion of a block the trace allocated (its `free_requested`), an address allocated
/// again after a free was requested (the `free_completed` between). Other skipped actions
/// leave no such proof (a trace may rightly hold no `segment_alloc` or `oom`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Skipped {
    /// No `free_requested`, though frees completed: each `free_completed` is the free.
    pub free_requested: bool,
    /// No `free_completed`, though frees were requested: each free completes at once.
    pub free_completed: bool,
}

impl Skipped {
    /// What `events` (a device's whole trace) left out.
    ///
    /// # Errors
    /// A reason when the trace cannot be replayed at all: it skipped the allocations.
    pub(super) fn of(events: &[TraceEntry]) -> Result<Skipped, String> {
        let (mut allocs, mut requested, mut completed) = (false, false, false);
        for e in events {
            match e.action {
                TraceAction::Alloc => allocs = true,
                TraceAction::FreeRequested => requested = true,
                TraceAction::FreeCompleted => completed = true,
                _ => {}
            }
        }
        let is_free =
            |a: TraceAction| matches!(a, TraceAction::FreeRequested | TraceAction::FreeCompleted);
        if !allocs {
            // Segments the trace allocated, by start: their ends.
            let mut segments: std::collections::BTreeMap<u64, u64> = Default::default();
            for e in events {
                let inside = |addr: u64| {
                    segments
                        .range(..=addr)
                        .next_back()
                        .is_some_and(|(_, &end)| addr < end)
                };
                if e.action == TraceAction::SegmentAlloc {
                    segments.insert(e.addr, e.addr.saturating_add(e.size));
                } else if is_free(e.action) && inside(e.addr) {
                    return Err(
                        "it frees blocks of segments it allocated but records no allocation: it was recorded with skip_actions leaving out `alloc`, and a replay needs every allocation".into(),
                    );
                }
            }
            return Ok(Skipped::default());
        }
        if requested && completed {
            // Both kinds are there: neither was skipped.
            return Ok(Skipped::default());
        }
        let mut allocated = rustc_hash::FxHashSet::default();
        let mut awaiting = rustc_hash::FxHashSet::default();
        let (mut free_requested, mut free_completed) = (false, false);
        for e in events {
            match e.action {
                TraceAction::Alloc => {
                    free_completed |= !completed && awaiting.contains(&e.addr);
                    allocated.insert(e.addr);
                }
                TraceAction::FreeRequested => {
                    awaiting.insert(e.addr);
                }
                TraceAction::FreeCompleted => {
                    free_requested |= !requested && allocated.contains(&e.addr);
                }
                _ => {}
            }
        }
        Ok(Skipped {
            free_requested,
            free_completed,
        })
    }

    /// Whether any action was skipped.
    pub(super) fn any(self) -> bool {
        self.free_requested || self.free_completed
    }

    /// Whether the core's own entries of `action` are left out of the comparison.
    pub(super) fn hides(self, action: TraceAction) -> bool {
        match action {
            TraceAction::FreeRequested => self.free_requested,
            TraceAction::FreeCompleted => self.free_completed,
            _ => false,
        }
    }

    /// Why the replay differs from a full one, if it does.
    pub(super) fn note(self) -> Option<&'static str> {
        if self.free_requested {
            Some(
                "the trace has no free_requested entries (recorded with skip_actions): each free_completed is replayed as a free that completes at once",
            )
        } else if self.free_completed {
            Some(
                "the trace has no free_completed entries (recorded with skip_actions): each free is replayed as completing at once, so a free that waited on another stream shows as a divergence",
            )
        } else {
            None
        }
    }
}

/// Whether `action` gives memory back to the driver (a release run's events).
fn is_release(action: TraceAction) -> bool {
    matches!(action, TraceAction::SegmentFree | TraceAction::SegmentUnmap)
}

/// Events that drive an operation; everything else is an effect of the next one.
fn is_driver(action: TraceAction, skipped: Skipped) -> bool {
    matches!(
        action,
        TraceAction::Alloc
            | TraceAction::Oom
            | TraceAction::Snapshot
            | TraceAction::FreeRequested
            | TraceAction::UserDefined
    ) || (action == TraceAction::FreeCompleted && skipped.free_requested)
}

impl<'a> Engine<'a> {
    /// Loads the start state of `options.device`'s trace into `alloc`, its segments in the
    /// order `start_order` gives (indices; by address without one, or where it does not fit).
    /// With `derive`, a check replay in a counter order collects the precedences that order
    /// the start segments.
    pub(super) fn start(
        recording: &'a Recording,
        options: &Options,
        mut alloc: CachingAllocator<SimDevice>,
        releases_in_malloc: FxHashMap<usize, ReleaseReading>,
        start_order: Option<&[usize]>,
        derive: bool,
    ) -> Result<Self, ReplayError> {
        let all = device_events(recording, options.device)?;
        let skipped = Skipped::of(all).map_err(|reason| ReplayError::SkippedActions {
            device: options.device,
            reason,
        })?;
        let window = options.window.clone().filter(|_| !options.check);
        let (events, first_event) = match &window {
            Some(w) => {
                let end = w.end.min(all.len());
                let start = w.start.min(end);
                (&all[start..end], start)
            }
            None => (all, 0),
        };
        let recorded_config = recording.config.clone().unwrap_or_default();
        let mut start = start_state(recording, options.device, &recorded_config)?;
        if window.is_some() {
            start.segments.clear();
            start.pending_frees.clear();
        }
        let no_split = PoolOptions {
            use_on_oom: false,
            no_split: true,
        };
        let pool_options: FxHashMap<PoolId, PoolOptions> =
            unsplit_pools(&recording.segments, options.device, &recorded_config)
                .into_iter()
                .map(|pool| (pool, no_split))
                .collect();
        let mut ptrs = FxHashMap::default();
        alloc.set_page_budget(page_allowance(options.max_memory_bytes, 0, options.check));
        let failed = if options.fresh_start && !options.check {
            Self::allocate_afresh(&start.segments, &mut alloc, &pool_options, &mut ptrs).map_err(
                |e| match e {
                    ReplayError::BeforeTrace(source) => {
                        budget_error(source, options.max_memory_bytes, first_event)
                    }
                    e => e,
                },
            )?
        } else {
            FxHashSet::default()
        };
        let restored = if options.fresh_start && !options.check {
            &[][..]
        } else {
            &start.segments[..]
        };
        let by_address: Vec<usize> = (0..restored.len()).collect();
        let order = start_order
            .filter(|o| o.len() == restored.len())
            .unwrap_or(&by_address);
        let derivation = (derive
            && options.check
            && alloc.fit_order() == crate::allocator::FitOrder::Counter
            && restored.len() > 1)
            .then(|| Derivation::new(restored.iter().map(|s| s.address).collect(), order));
        for segment in order.iter().filter_map(|&i| restored.get(i)) {
            // Check mode places segments where the recording did; what-if lets the device
            // choose (recorded addresses are mapped to the chosen ones either way).
            if options.check {
                alloc.device_mut().hint_addresses([segment.address]);
            }
            let base = referenced(&mut alloc, &pool_options, segment.pool_id)
                .and_then(|()| {
                    alloc.restore_segment(
                        segment.pool_id,
                        segment.stream,
                        segment.pool,
                        &segment.blocks,
                    )
                })
                .map_err(|source| ReplayError::StartSegment {
                    address: segment.address,
                    size: format_size(segment.size()),
                    source,
                })?;
            alloc.device_mut().clear_address_hints();
            let mut at = 0;
            for b in &segment.blocks {
                if b.allocated.is_some() {
                    ptrs.insert(segment.address + at, DevicePtr(base.0 + at));
                }
                at += b.size;
            }
        }
        // Frees requested before the trace and completed in it start out pending.
        let mut deferred = FxHashMap::default();
        let mut next_stream = SYNTHETIC_STREAM_BASE;
        for addr in &start.pending_frees {
            let Some(ptr) = ptrs.remove(addr) else {
                continue;
            };
            let stream = StreamId(next_stream);
            next_stream += 1;
            alloc.record_stream(ptr, stream);
            alloc.free(ptr).map_err(ReplayError::BeforeTrace)?;
            deferred.insert(*addr, stream);
        }
        if options.check {
            // Drained after every operation; the bound only guards against a runaway.
            alloc.record_history(Some(1 << 40));
        }
        Ok(Engine {
            events,
            position: 0,
            start_segments: start.segments.len(),
            alloc,
            check: options.check,
            ptrs,
            start_ooms: failed.len() as u64,
            failed,
            deferred,
            next_stream,
            compared: Compared::default(),
            divergence: None,
            series: Vec::new(),
            series_every: events
                .len()
                .checked_div(options.series_points)
                .map_or(usize::MAX, |every| every.max(1)),
            bucket: (0, 0),
            max_memory_bytes: options.max_memory_bytes,
            checked_at: 0,
            releases_in_malloc,
            reservation_spacing: None,
            first_event,
            windowed: window.is_some(),
            derivation,
            diverged_as: None,
            reading_differed: None,
            skipped,
            release_retries: RELEASE_TRIES,
            pool_options,
        })
    }

    /// Allocates the live blocks of the recorded start segments, in address order, on their
    /// streams; the recorded addresses map to the new blocks. Returns the addresses of blocks
    /// that did not fit (out of memory under this configuration), as the trace's own failed
    /// allocations are kept.
    fn allocate_afresh(
        segments: &[StartSegment],
        alloc: &mut CachingAllocator<SimDevice>,
        pool_options: &FxHashMap<PoolId, PoolOptions>,
        ptrs: &mut FxHashMap<u64, DevicePtr>,
    ) -> Result<FxHashSet<u64>, ReplayError> {
        let mut live: Vec<(u64, StreamId, u64, PoolId)> = Vec::new();
        for segment in segments {
            let mut at = segment.address;
            for b in &segment.blocks {
                if let Some(requested) = b.allocated {
                    live.push((at, segment.stream, requested, segment.pool_id));
                }
                at += b.size;
            }
        }
        live.sort_unstable();
        let mut failed = FxHashSet::default();
        for (addr, stream, requested, pool) in live {
            match in_pool(alloc, pool_options, pool, stream, RouteKind::MemPool, |a| {
                a.malloc(requested, stream)
            }) {
                Ok(ptr) => {
                    ptrs.insert(addr, ptr);
                }
                Err(e) if e.is_out_of_memory() => {
                    failed.insert(addr);
                }
                Err(source) => return Err(ReplayError::BeforeTrace(source)),
            }
        }
        Ok(failed)
    }

    pub(super) fn run(
        &mut self,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(), ReplayError> {
        self.advance(self.events.len(), progress)?;
        if self.series_every != usize::MAX {
            self.sample(self.events.len());
        }
        progress(self.events.len(), self.events.len());
        Ok(())
    }

    /// Replays events until `until` (or the first divergence).
    pub(super) fn advance(
        &mut self,
        until: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(), ReplayError> {
        const PROGRESS_EVERY: usize = 4096;
        let n = self.events.len();
        let until = until.min(n);
        let mut i = self.position;
        while i < until && self.divergence.is_none() {
            if i >= self.checked_at + PROGRESS_EVERY {
                progress(i, n);
                self.checked_at = i;
                self.check_memory(i)?;
            }
            let next = match self.events[i].action {
                TraceAction::FreeRequested => self.free(i)?,
                TraceAction::FreeCompleted if self.skipped.free_requested => self.free(i)?,
                TraceAction::UserDefined => i + 1,
                _ => self.operation(i)?,
            };
            if self.series_every != usize::MAX {
                let (allocated, reserved) = self.current();
                self.bucket = (self.bucket.0.max(allocated), self.bucket.1.max(reserved));
                if (i..next).any(|event| event % self.series_every == 0) {
                    self.sample(next - 1);
                }
            }
            i = next;
            self.position = i;
        }
        Ok(())
    }

    /// An error once the replay's state holds more than its budget; else the allocator may
    /// map pages with what is left of it (`page_allowance`).
    fn check_memory(&mut self, index: usize) -> Result<(), ReplayError> {
        let Some(budget) = self.max_memory_bytes else {
            return Ok(());
        };
        let entry = std::mem::size_of::<(u64, u64)>() + 1;
        let held = self.alloc.heap_bytes()
            + (self.ptrs.capacity() + self.deferred.capacity() + self.failed.capacity()) * entry
            + self.series.capacity() * std::mem::size_of::<SeriesPoint>();
        if held as u64 > budget {
            return Err(ReplayError::MemoryBudget { budget, index });
        }
        let other = held.saturating_sub(self.alloc.page_bytes()) as u64;
        self.alloc
            .set_page_budget(page_allowance(Some(budget), other, self.check));
        Ok(())
    }

    /// Allocated and reserved bytes now.
    fn current(&self) -> (u64, u64) {
        let stats = self.alloc.stats();
        (
            stats.allocated_bytes.all_current().max(0) as u64,
            stats.reserved_bytes.all_current().max(0) as u64,
        )
    }

    /// A series point at `event`: the most allocated and reserved since the previous one (so
    /// no peak between two points is lost), and the event's time where recorded.
    fn sample(&mut self, event: usize) {
        let (allocated, reserved) = self.current();
        let (most_allocated, most_reserved) = std::mem::take(&mut self.bucket);
        let time_us = self
            .events
            .get(event.min(self.events.len().saturating_sub(1)))
            .and_then(|e| e.time_us);
        self.series.push(SeriesPoint {
            event: self.first_event + event,
            allocated: allocated.max(most_allocated),
            reserved: reserved.max(most_reserved),
            time_us,
        });
    }

    fn fail(&self, index: usize, source: AllocError) -> ReplayError {
        let index = self.first_event + index;
        match budget_error(source, self.max_memory_bytes, index) {
            ReplayError::BeforeTrace(source) => ReplayError::Allocator { index, source },
            budget => budget,
        }
    }

    /// `free_requested` at `i` (with its `free_completed` right after, unless deferred); a
    /// lone `free_requested` or `free_completed` where the recording skipped the other.
    fn free(&mut self, i: usize) -> Result<usize, ReplayError> {
        let e = self.events[i];
        let completed_next = e.action == TraceAction::FreeRequested
            && self
                .events
                .get(i + 1)
                .is_some_and(|c| c.action == TraceAction::FreeCompleted && c.addr == e.addr);
        let immediate = completed_next || self.skipped.any();
        let end = i + 1 + usize::from(completed_next);
        let Some(ptr) = self.ptrs.remove(&e.addr) else {
            if self.failed.remove(&e.addr) || self.windowed {
                return Ok(end);
            }
            self.diverge(i, describe(&e), "no live block at that address".into());
            return Ok(end);
        };
        if !immediate {
            let stream = StreamId(self.next_stream);
            self.next_stream += 1;
            self.alloc.record_stream(ptr, stream);
            self.deferred.insert(e.addr, stream);
        }
        self.alloc.free(ptr).map_err(|err| self.fail(i, err))?;
        self.compare(i, end);
        Ok(end)
    }

    /// The effects starting at `i` and the operation that produced them. While the start
    /// segments' order is being derived, a run of releases that frees equal-size start
    /// segments in another order than the recording's says which was obtained first: the
    /// operation is tried again after each precedence it suggests (Note [Finding the order]).
    fn operation(&mut self, i: usize) -> Result<usize, ReplayError> {
        let releases = self.events[i..]
            .iter()
            .take_while(|e| !is_driver(e.action, self.skipped))
            .any(|e| e.action == TraceAction::SegmentFree);
        if self.derivation.is_none() || !releases || self.release_retries == 0 {
            return self.operation_once(i);
        }
        let saved = Saved::of(self);
        let mut readings = RunReadings::default();
        for _ in 0..MAX_RELEASE_RETRIES {
            // Each try clones the allocator back: the replay's tries are bounded in all.
            self.release_retries = self.release_retries.saturating_sub(1);
            let end = self.operation_once(i)?;
            let Some(d) = self.divergence.as_ref() else {
                self.settle_releases(&saved.alloc, i, end);
                return Ok(end);
            };
            // Where the release run went another way between two equal start segments: in
            // the reading that was kept, or in the allocator's own that was not.
            let derivation = self.derivation.as_ref().expect("deriving");
            let swapped = |(index, actual): (usize, Option<TraceEntry>)| {
                let expected = self.events.get(index)?;
                let actual = actual?;
                let releases = expected.action == TraceAction::SegmentFree
                    && actual.action == TraceAction::SegmentFree
                    && (actual.size, actual.stream) == (expected.size, expected.stream);
                releases.then_some(())?;
                let e = derivation.segment_at(expected.addr)?;
                Some((index, e, derivation.segment_at(actual.addr)?))
            };
            let Some((index, e, a)) = swapped((d.index, self.diverged_as))
                .or_else(|| self.reading_differed.and_then(swapped))
            else {
                return Ok(end);
            };
            let (first, chain) = self.equal_releases(index);
            let event = self.first_event + i;
            let applied = readings.next(first, &chain, e, a).into_iter().find(|next| {
                saved.restore(self);
                let derivation = self.derivation.as_mut().expect("deriving");
                next.edges()
                    .into_iter()
                    .all(|(x, y)| derivation.prefer(event, x, y, &mut self.alloc))
            });
            match applied {
                Some(next) => {
                    readings = next;
                    if self.release_retries == 0 {
                        break;
                    }
                }
                None => {
                    saved.restore(self);
                    return self.operation_once(i);
                }
            }
        }
        self.operation_once(i)
    }

    /// The recorded run of `segment_free` events around `index` of its size and stream: its
    /// first event, and its start segments in recorded order.
    fn equal_releases(&self, index: usize) -> (usize, Vec<u32>) {
        let e = self.events[index];
        let same = |x: &TraceEntry| {
            x.action == TraceAction::SegmentFree && (x.size, x.stream) == (e.size, e.stream)
        };
        let first = self.events[..index]
            .iter()
            .rposition(|x| !same(x))
            .map_or(0, |k| k + 1);
        let derivation = self.derivation.as_ref().expect("deriving");
        let chain = self.events[first..]
            .iter()
            .take_while(|x| same(x))
            .filter_map(|x| derivation.segment_at(x.addr))
            .collect();
        (first, chain)
    }

    /// Keeps what a release run `i..end` that reproduced the recording says of the start
    /// segments: how each released one stands to every equal whole free one (released or
    /// not) it was chosen among, as the order it reproduced under has them. `before` is the
    /// allocator before the run.
    fn settle_releases(&mut self, before: &CachingAllocator<SimDevice>, i: usize, end: usize) {
        let Some(derivation) = self.derivation.as_mut() else {
            return;
        };
        let released: Vec<u64> = self.events[i..end]
            .iter()
            .filter(|e| e.action == TraceAction::SegmentFree)
            .map(|e| e.addr)
            .collect();
        let whole_free: Vec<(u64, (u64, StreamId, PoolKind))> = before
            .segment_infos()
            .into_iter()
            .filter(|s| {
                !s.is_expandable
                    && s.blocks.len() == 1
                    && s.blocks[0].state == crate::allocator::BlockState::Inactive
            })
            .map(|s| (s.address, (s.total_size, s.stream, s.segment_type)))
            .collect();
        derivation.settle(&released, &whole_free);
    }

    /// The effects starting at `i` and the operation that produced them, once.
    fn operation_once(&mut self, i: usize) -> Result<usize, ReplayError> {
        self.reading_differed = None;
        let n = self.events.len();
        let j = (i..n)
            .find(|&k| is_driver(self.events[k].action, self.skipped))
            .unwrap_or(n);
        let driver = self
            .events
            .get(j)
            .filter(|d| {
                matches!(
                    d.action,
                    TraceAction::Alloc | TraceAction::Oom | TraceAction::Snapshot
                )
            })
            .copied();
        let end = if driver.is_some() { j + 1 } else { j };
        let effects = &self.events[i..j];
        let releases = effects.iter().any(|e| is_release(e.action));
        let completions = effects
            .iter()
            .any(|e| e.action == TraceAction::FreeCompleted);
        let malloc = driver.is_some_and(|d| d.action == TraceAction::Alloc);
        let oom = driver.is_some_and(|d| d.action == TraceAction::Oom);
        // An OOM that neither polled events nor flushed was a capture's (Note [Replaying
        // pools]).
        let kind = if oom && !releases && !completions {
            RouteKind::Capture
        } else {
            RouteKind::MemPool
        };
        // Note [Reading releases] (module doc): releases before an OOM are the failing malloc's own flush;
        // releases before a successful malloc are either a user's `empty_cache` or the
        // allocator's own (garbage collection, oversize release, a flush after the driver
        // said no); anything else is a flush. Check mode tries the allocator's readings
        // first and keeps the first that reproduces the recording; what-if mode reuses the
        // readings a check pass found.
        if releases && malloc {
            if self.check {
                let saved = (
                    self.alloc.clone(),
                    self.derivation.clone(),
                    self.deferred.clone(),
                );
                let mut readings = vec![ReleaseReading::InMalloc];
                if completions {
                    readings.push(ReleaseReading::InMallocSynced);
                }
                // Where the allocator's own (first) reading differed, for `operation`.
                let mut own_difference = None;
                for reading in readings {
                    self.perform(i, j, driver, false, kind, reading)?;
                    if self.reproduces(i, end) {
                        self.releases_in_malloc.insert(i, reading);
                        return Ok(end);
                    }
                    own_difference = own_difference.or(self.reading_differed);
                    (self.alloc, self.derivation, self.deferred) = saved.clone();
                    if let Some(d) = driver {
                        self.ptrs.remove(&d.addr);
                    }
                }
                self.perform(i, j, driver, true, kind, ReleaseReading::InMalloc)?;
                self.reading_differed = own_difference;
            } else {
                let reading = self
                    .releases_in_malloc
                    .get(&(self.first_event + i))
                    .copied();
                let flush = reading.is_none();
                let reading = reading.unwrap_or(ReleaseReading::InMalloc);
                self.perform(i, j, driver, flush, kind, reading)?;
            }
        } else {
            let flush = (releases && !oom) || (completions && !malloc && !oom);
            self.perform(i, j, driver, flush, kind, ReleaseReading::InMalloc)?;
        }
        self.compare(i, end);
        Ok(end.max(i + 1))
    }

    /// Runs the operation for effects `i..j` and `driver`, after a cache flush if `flush`; a
    /// private pool's request routed as `kind` (Note [Replaying pools]). The deferred frees
    /// that the recorded `free_completed` events among `i..j` complete are done before the
    /// operation, or, in the reading where the flush inside the malloc waited for them, left
    /// to its synchronisation (and done after it, for a what-if run whose malloc did not
    /// flush).
    fn perform(
        &mut self,
        i: usize,
        j: usize,
        driver: Option<TraceEntry>,
        flush: bool,
        kind: RouteKind,
        reading: ReleaseReading,
    ) -> Result<(), ReplayError> {
        let mut waited = Vec::new();
        for effect in &self.events[i..j] {
            if effect.action == TraceAction::FreeCompleted
                && let Some(stream) = self.deferred.remove(&effect.addr)
            {
                match reading {
                    ReleaseReading::InMalloc => self.alloc.device_mut().complete_stream(stream),
                    ReleaseReading::InMallocSynced => waited.push(stream),
                }
            }
        }
        // Pools whose segments the recording releases here had been released by their
        // owners (Note [Replaying pools]).
        let mut released: Vec<PoolId> = self.events[i..j]
            .iter()
            .filter(|e| is_release(e.action) && !e.pool.is_default())
            .map(|e| e.pool)
            .collect();
        released.sort_unstable();
        released.dedup();
        for &pool in &released {
            while self.alloc.pool_use_count(pool).is_some_and(|n| n > 0) {
                self.alloc
                    .release_pool(pool)
                    .map_err(|err| self.fail(i, err))?;
            }
        }
        if flush {
            self.alloc.empty_cache().map_err(|err| self.fail(i, err))?;
        }
        if self.check {
            // New segments, and the first map of a new expandable segment (its base), go
            // where the recording put them.
            let sim = self.alloc.device();
            let hints: Vec<u64> = self.events[i..j]
                .iter()
                .filter(|e| match e.action {
                    TraceAction::SegmentAlloc => true,
                    TraceAction::SegmentMap => !sim.is_reserved(e.addr),
                    _ => false,
                })
                .map(|e| e.addr)
                .collect();
            self.alloc.device_mut().hint_addresses(hints);
        }
        if let Some(d) = driver {
            self.drive(j, d, kind)?;
        }
        // Only the recording's releases say a pool was freeable: one that outlived this run
        // is referenced again until the next.
        for pool in released {
            if self.alloc.pool_use_count(pool) == Some(0) {
                add_use(&mut self.alloc, &self.pool_options, pool)
                    .map_err(|err| self.fail(i, err))?;
            }
        }
        self.alloc.device_mut().clear_address_hints();
        for stream in waited {
            self.alloc.device_mut().complete_stream(stream);
        }
        Ok(())
    }

    /// `op` on the allocator with the recorded request `d` routed to its pool as `kind`
    /// ([`in_pool`]).
    fn routed<T>(
        &mut self,
        d: TraceEntry,
        kind: RouteKind,
        op: impl FnOnce(&mut CachingAllocator<SimDevice>) -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        in_pool(
            &mut self.alloc,
            &self.pool_options,
            d.pool,
            d.stream,
            kind,
            op,
        )
    }

    /// Drives the recorded `d` at `j`; a private pool's request routed as `kind`.
    fn drive(&mut self, j: usize, d: TraceEntry, kind: RouteKind) -> Result<(), ReplayError> {
        let stream = d.stream;
        match d.action {
            TraceAction::Alloc => {
                if self.derivation.is_some() {
                    let ties = self
                        .routed(d, kind, |a| a.tied_best_fits(d.size, stream))
                        .map_err(|e| self.fail(j, e))?;
                    if let Some(derivation) = self.derivation.as_mut().filter(|_| ties.len() > 1) {
                        let event = self.first_event + j;
                        derivation.observe(event, &ties, d.addr, &mut self.alloc);
                    }
                }
                self.malloc(j, d, kind)?;
            }
            TraceAction::Oom => {
                if self.check {
                    self.alloc.device_mut().fail_all_allocations(true);
                }
                let result = self.routed(d, kind, |a| a.malloc(d.size, stream));
                self.alloc.device_mut().fail_all_allocations(false);
                match result {
                    // Under another configuration the request may fit: the program did not
                    // keep it, so neither does the replay.
                    Ok(ptr) => self.alloc.free(ptr).map_err(|e| self.fail(j, e))?,
                    Err(e) if e.is_out_of_memory() => {}
                    Err(e) => return Err(self.fail(j, e)),
                }
            }
            TraceAction::Snapshot => {
                self.alloc.snapshot();
            }
            _ => {}
        }
        Ok(())
    }

    /// The recorded allocation `d` at `j`, as a `malloc`.
    fn malloc(&mut self, j: usize, d: TraceEntry, kind: RouteKind) -> Result<(), ReplayError> {
        match self.routed(d, kind, |a| a.malloc(d.size, d.stream)) {
            Ok(ptr) => {
                self.ptrs.insert(d.addr, ptr);
            }
            Err(e) if e.is_out_of_memory() && !self.check => {
                self.failed.insert(d.addr);
            }
            Err(e) if e.is_out_of_memory() => {
                // The comparison reports it: the trace has an `oom` where `alloc` was.
            }
            Err(e) => return Err(self.fail(j, e)),
        }
        Ok(())
    }
}

/// Makes sure pool `pool` exists, referenced once and with its `options` if new
/// (Note [Replaying pools]).
fn referenced(
    alloc: &mut CachingAllocator<SimDevice>,
    options: &FxHashMap<PoolId, PoolOptions>,
    pool: PoolId,
) -> Result<(), AllocError> {
    if pool.is_default() || alloc.pool_use_count(pool).is_some() {
        return Ok(());
    }
    add_use(alloc, options, pool)
}

/// One use more of pool `pool`, made with its options if new.
fn add_use(
    alloc: &mut CachingAllocator<SimDevice>,
    options: &FxHashMap<PoolId, PoolOptions>,
    pool: PoolId,
) -> Result<(), AllocError> {
    alloc.create_pool(pool, options.get(&pool).copied().unwrap_or_default())
}

/// `op` with the requests on `stream` routed to `pool` as `kind`, where that is a private
/// pool, its use count unchanged (Note [Replaying pools]).
fn in_pool<T>(
    alloc: &mut CachingAllocator<SimDevice>,
    options: &FxHashMap<PoolId, PoolOptions>,
    pool: PoolId,
    stream: StreamId,
    kind: RouteKind,
    op: impl FnOnce(&mut CachingAllocator<SimDevice>) -> Result<T, AllocError>,
) -> Result<T, AllocError> {
    if pool.is_default() {
        return op(alloc);
    }
    referenced(alloc, options, pool)?;
    alloc.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![stream]), kind)?;
    // The route's use is given back before `op`: a pool the recording shows freeable stays
    // so during it.
    alloc.release_pool(pool)?;
    let result = op(alloc);
    alloc.end_allocate_to_pool(pool)?;
    result
}
