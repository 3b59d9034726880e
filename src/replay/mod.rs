//! Replaying one device's recorded trace through the allocator core.
//!
//! The recording lists what the allocator did; replay turns it back into what the program
//! asked for and asks the core again:
//! - `alloc` becomes a `malloc` of the requested size on the recorded stream;
//! - `free_requested` becomes a `free` (after a `record_stream` on a stream of its own when
//!   the recording completes that free later, so that it is deferred the same way);
//! - a deferred `free_completed` completes that stream's work, so the next `malloc` (or
//!   cache flush) completes the free where the recording did;
//! - a run of `segment_free` before an `oom` is the failing `malloc`'s own flush; before a
//!   successful `alloc` it is either a user's `empty_cache()` or the allocator's own release
//!   (the two readings can leave different blocks and events, see Note [Reading releases]
//!   in `engine.rs`); anywhere else it is `empty_cache()`;
//! - `oom` becomes a `malloc` that the device refuses (in check mode);
//! - `snapshot` becomes a snapshot.
//!
//! In check mode the simulated device hands out the recorded segment addresses, and every
//! event the core emits is compared with the recording: the first difference is reported as
//! a [`Divergence`]. In what-if mode the core decides freely under another configuration,
//! and recorded addresses are mapped to the ones it chose.
//!
//! `session.rs` holds the entry point, a [`Session`] per recording and device (its
//! [`Setup`], the [`Mode`] of each replay, the readings its replays share); `mod.rs` the
//! errors, the resolved options of one replay, the check runs and the step-by-step
//! [`Cursor`] (on its own allocator or the caller's); `report.rs` what a replay reports;
//! `engine.rs` the stepper that turns recorded events into operations; `compare.rs` the
//! comparison with the recording; `order.rs` which best-fit order a recording was made in;
//! `start_state.rs` the allocator's state at a mid-run trace's first event.
//!
//! # Invariants
//! - Replay drives the core only through its public operations (plus `restore_segment` for
//!   the start state); it compares only what the core records in its own trace.
//! - In check mode the first difference stops the comparison; nothing after it is counted.
//! - Errors are the replay's (no trace, a start state that cannot be rebuilt, the allocator
//!   failing other than by running out of memory); a divergence is part of the report.
//!
//! # Budgets
//! - Memory: the replay's own state (the allocator's bookkeeping, the replay's maps and
//!   series) is held to [`Setup::max_memory_bytes`], by default the reader's
//!   [`MAX_MEMORY_BYTES`] (4 GiB), checked every few thousand events: past it the replay
//!   stops with [`ReplayError::MemoryBudget`]. `explain` and the view hold every replay they
//!   run to the same budget.
//! - Time: each event costs the core's work for one operation; neither the number of streams
//!   (the free set finds a stream's bins in constant time) nor the number of frees waiting
//!   on their synthetic streams (a poll queries only the streams that progressed) multiplies
//!   it.

mod compare;
pub mod costs;
mod engine;
mod order;
mod report;
mod session;
pub mod start_state;
pub mod table;

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::allocator::size::{PoolKind, SMALL_BUFFER, expandable_page_size};
use crate::allocator::{AllocError, CachingAllocator, FitOrder, Plan, TraceEntry};
use crate::config::AllocatorConfig;
use crate::device::{DriverCosts, SimConfig, SimDevice};

use crate::recording::event_pools::InferredPools;
use crate::recording::{MAX_MEMORY_BYTES, Recording};
use engine::{Engine, ReleaseReading};
pub use order::OrderingReport;
use order::{Derivation, Found};
pub use report::{Compared, Divergence, ReplayReport, SeriesPoint};
pub use session::{JobMemory, Mode, Session, Setup, WhatIf};
use start_state::StartStateError;

/// The device memory assumed when neither the recording nor the user says: the 80 GiB of
/// the GPUs behind the shared recordings.
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

/// The largest simulated device ([`crate::allocator::size::MAX_DEVICE_BYTES`]).
pub const MAX_CAPACITY: u64 = crate::allocator::size::MAX_DEVICE_BYTES;

/// Streams invented to defer frees start here, far from real stream handles.
const SYNTHETIC_STREAM_BASE: u64 = 0xdefe_0000_0000_0000;
/// How one replay runs: a [`Session`]'s setup and a [`Mode`], resolved (what-if-only
/// fields are unset in check mode).
#[derive(Clone, Debug)]
pub(super) struct Options {
    pub(super) device: u32,
    pub(super) config: Option<AllocatorConfig>,
    pub(super) capacity: Option<u64>,
    pub(super) check: bool,
    pub(super) series_points: usize,
    pub(super) fresh_start: bool,
    pub(super) available: Option<u64>,
    pub(super) window: Option<std::ops::Range<usize>>,
    pub(super) plan: Option<Arc<Plan>>,
    pub(super) order: Option<FitOrder>,
    pub(super) max_memory_bytes: Option<u64>,
    pub(super) costs: Arc<DriverCosts>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            device: 0,
            config: None,
            capacity: None,
            check: false,
            series_points: 0,
            fresh_start: false,
            available: None,
            window: None,
            plan: None,
            order: None,
            max_memory_bytes: Some(MAX_MEMORY_BYTES),
            costs: Arc::default(),
        }
    }
}
/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The recording has no trace for the device.
    #[error("the recording has no trace for device {device} ({devices} device traces)")]
    NoSuchDevice {
        /// The device asked for.
        device: u32,
        /// Device traces in the recording.
        devices: usize,
    },
    /// The state at the start of the trace cannot be rebuilt.
    #[error("cannot rebuild the state at the start of the trace: {0}")]
    StartState(#[from] StartStateError),
    /// A segment of the start state does not fit on the simulated device.
    #[error(
        "cannot rebuild the state at the start of the trace: segment {address:#x} of {size} does not fit: {source}"
    )]
    StartSegment {
        /// The recorded segment's address.
        address: u64,
        /// Its size, in words.
        size: String,
        /// Why.
        source: AllocError,
    },
    /// The allocator failed while setting up, before the trace's first event.
    #[error("the allocator failed before the trace's first event: {0}")]
    BeforeTrace(AllocError),
    /// The trace left out actions a replay cannot do without (`skip_actions`).
    #[error("device {device}'s trace cannot be replayed: {reason}")]
    SkippedActions {
        /// The device.
        device: u32,
        /// Which actions are missing and why they are needed.
        reason: String,
    },
    /// The allocator failed other than by running out of memory.
    #[error("the allocator failed at event {index}: {source}")]
    Allocator {
        /// Index of the recorded event.
        index: usize,
        /// The error.
        source: AllocError,
    },
    /// The replay's state grew past its memory budget.
    #[error(
        "the replay needs more than the memory budget of {budget} bytes (at event {index}); raise it with --max-memory-bytes if the machine has the memory"
    )]
    MemoryBudget {
        /// The budget.
        budget: u64,
        /// The event at which it was found exceeded.
        index: usize,
    },
    /// A [`Cursor`] on a caller's allocator was asked to go back: only a cursor that made
    /// its own allocator can start again.
    #[error("a replay on the caller's allocator cannot go back from event {position} to {target}")]
    Rewind {
        /// Events replayed so far.
        position: usize,
        /// The position asked for.
        target: usize,
    },
}

/// What one replay found.
struct Run {
    report: ReplayReport,
    /// The readings of ambiguous release runs it found (check mode).
    releases_in_malloc: FxHashMap<usize, ReleaseReading>,
    /// See `Engine::reservation_spacing`.
    reservation_spacing: Option<u64>,
    /// The order followed, and what is known of the start segments' order.
    found: Found,
    /// The precedences a check replay in the counter order collected.
    derivation: Option<Derivation>,
}

/// A check replay, in the order `options.order` names or, without one, in the order that
/// reproduces the recording (Note [Finding the order]); its report says which.
fn check_run(
    recording: &Recording,
    options: &Options,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Run, ReplayError> {
    let mut run = match options.order {
        Some(order) => {
            let mut run = check_in(recording, options, order, progress)?;
            run.found.report.ordering_source = "flag";
            run
        }
        None => find_order(recording, options, progress)?,
    };
    run.report.ordering = run.found.report.clone();
    Ok(run)
}

/// The check replay of the first order that reproduces the recording, of the candidates in
/// turn (Note [Finding the order]).
fn find_order(
    recording: &Recording,
    options: &Options,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Run, ReplayError> {
    let [first, second, third] = order::candidates(recording.trace_pool_ids);
    // An order that cannot even start (a start segment beyond what it orders) reproduces
    // nothing; the first order's error stands only if none runs.
    let first_run = check_in(recording, options, first, progress);
    if let Ok(run) = &first_run
        && run.report.divergence.is_none()
    {
        // Does the other of the two main orders reproduce it too?
        let other = if first == FitOrder::Address {
            FitOrder::Counter
        } else {
            FitOrder::Address
        };
        let Ok(again) = check_in(recording, options, other, progress) else {
            return first_run;
        };
        if again.report.divergence.is_some() {
            return first_run;
        }
        let mut both = if again.found.order == FitOrder::Counter {
            again
        } else {
            first_run?
        };
        both.found.report.ordering = "both".to_string();
        return Ok(both);
    }
    let mut shown = first_run;
    for order in [second, third] {
        match check_in(recording, options, order, progress) {
            Ok(again) if again.report.divergence.is_none() => return Ok(again),
            Ok(again) if shown.is_err() => shown = Ok(again),
            _ => {}
        }
    }
    shown
}

/// A check replay in `order`: for the counter order of a recording that starts with two
/// segments or more, one replay collects the precedences between them and, where it had to
/// reorder them, one more verifies the order derived.
fn check_in(
    recording: &Recording,
    options: &Options,
    order: FitOrder,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Run, ReplayError> {
    let mut found = Found::named(order);
    let mut run = check_on_capacity(recording, options, progress, &found)?;
    let starts = run.report.start_segments;
    let report = &mut found.report;
    report.counter_order = match order {
        FitOrder::Address => None,
        _ if starts == 0 || (starts == 1 && order == FitOrder::Counter) => Some("known"),
        FitOrder::BlockCounter => {
            // Every start block's counter is guessed, by address.
            report.guessed_segments = start_addresses(recording, options)?;
            Some("partly_guessed")
        }
        FitOrder::Counter => Some("derived"),
    };
    if let Some(derivation) = run.derivation.take() {
        match derivation.finish() {
            Ok((start_order, guessed)) => {
                if !guessed.is_empty() {
                    report.counter_order = Some("partly_guessed");
                }
                report.guessed_segments = guessed;
                found.start_order = Some(start_order);
                if derivation.reordered {
                    run = check_on_capacity(recording, options, progress, &found)?;
                }
            }
            Err(why) => {
                report.counter_order = None;
                report.contradiction = Some(why);
            }
        }
    }
    found.report.reproduces = Some(run.report.divergence.is_none());
    run.found = found;
    Ok(run)
}

/// The start segments' addresses of `options.device`'s trace, in address order.
fn start_addresses(recording: &Recording, options: &Options) -> Result<Vec<u64>, ReplayError> {
    let config = recording.config.clone().unwrap_or_default();
    let start = start_state::start_state(recording, options.device, &config)?;
    Ok(start.segments.iter().map(|s| s.address).collect())
}

/// A check replay in `found`'s order (collecting precedences between the start segments in
/// the counter order while their order is unknown). Where neither the user nor the
/// recording gives the device's memory and the recording placed a second expandable
/// reservation inside the simulated device's first, the spacing of the two is the recorded
/// device's reservation size: the device memory it implies is replayed again, and the
/// report says it was inferred.
fn check_on_capacity(
    recording: &Recording,
    options: &Options,
    progress: &mut dyn FnMut(usize, usize),
    found: &Found,
) -> Result<Run, ReplayError> {
    let mut run = run_with(recording, options, progress, FxHashMap::default(), found)?;
    let unknown = options.capacity.is_none() && recording.simulated_device.is_none();
    let Some(spacing) = run.reservation_spacing.filter(|_| unknown) else {
        return Ok(run);
    };
    let config = replayed_config(recording, options);
    if config.reserve_set() {
        run.report.notes.push(
            "the device's memory was not inferred from the expandable reservations: the recording sets an expandable_segments_reserve key, so a reservation does not measure the device (give --capacity)".into(),
        );
        return Ok(run);
    }
    let inferred = Options {
        capacity: Some(capacity_for_reservation(
            spacing,
            expandable_page_size(&config, PoolKind::Large),
        )),
        ..options.clone()
    };
    let mut again = run_with(recording, &inferred, progress, FxHashMap::default(), found)?;
    again.report.capacity_inferred = true;
    Ok(again)
}

/// The configuration a replay runs under: the what-if one, else the recorded one.
/// A configuration as reports name it: its settings, or `(default)`.
pub fn config_label(config: &AllocatorConfig) -> String {
    if config.last_settings.is_empty() {
        "(default)".to_string()
    } else {
        config.last_settings.clone()
    }
}

fn replayed_config(recording: &Recording, options: &Options) -> AllocatorConfig {
    options
        .config
        .clone()
        .or_else(|| recording.config.clone())
        .unwrap_or_default()
}

/// How the pools of a trace that records none were found, in a sentence.
fn pools_note(inferred: InferredPools) -> String {
    let read = format!(
        "the trace records no pools (PyTorch before 2.12): {} events took the pool of the segment they lie in",
        inferred.from_segments
    );
    match inferred.first_assumed {
        Some(first) => format!(
            "{read}; {} (the first is #{first}) lie in segments released before the snapshot or are OOMs, and were replayed in the default pool",
            inferred.assumed
        ),
        None => read,
    }
}

/// What a replay under `config` cannot follow, in sentences (`ReplayReport::notes`).
fn settings_notes(recording: &Recording, config: &AllocatorConfig, recorded: bool) -> Vec<String> {
    let mut notes = Vec::new();
    if recorded {
        notes.extend(
            recording
                .settings_problems
                .iter()
                .map(|p| format!("the recorded settings string's option was skipped: {p}")),
        );
    }
    notes.extend(config.ignored.iter().cloned());
    if !config.expandable_segments_reserve_by_class.is_empty() {
        let reserve = config
            .expandable_segments_reserve
            .map_or("the default reserve (9/8 of the device)".to_string(), |r| {
                format!("the global reserve {r}")
            });
        notes.push(format!(
            "expandable_segments_reserve_by_class is set, but which class each stream had is set at run time and not recorded: every expandable segment replayed with {reserve}"
        ));
    }
    notes
}

/// The largest device memory whose expandable reservation is `reservation` bytes: a
/// reservation is 9/8 of the device's memory rounded up to whole pages (2 MiB, or the large
/// pool's `large_page`, `large_segment_size`, of which `reservation` is then a multiple).
pub fn capacity_for_reservation(reservation: u64, large_page: u64) -> u64 {
    let page = if reservation.is_multiple_of(large_page.max(1)) {
        large_page.max(1)
    } else {
        SMALL_BUFFER
    };
    let reserves = |c: u64| c.saturating_add(c / 8).div_ceil(page).saturating_mul(page);
    // c + c/8 <= reservation, largest such c: start just below and step up.
    let mut c = (reservation / 9).saturating_mul(8);
    while reserves(c + 1) <= reservation && c < MAX_CAPACITY {
        c += 1;
    }
    c.min(MAX_CAPACITY)
}

/// A replay driven step by step: the one stepper of the web view (any event, through
/// [`Session::cursor`]) and of the demo's simulated processes (a recording looped on their
/// own allocator at its recorded pace, through [`Cursor::on`]).
///
/// A session's cursor owns its allocator and moves to any event: forward by replaying on,
/// backward by starting again. A check cursor follows the recording exactly; a what-if one
/// follows the session's readings. A cursor made by [`Cursor::on`] replays on the caller's
/// allocator, forward only, and hands it back with [`Cursor::finish`].
pub struct Cursor<'a> {
    recording: &'a Recording,
    /// How to start again; `None` on a caller's allocator.
    restart: Option<Restart>,
    engine: Engine<'a>,
    /// The last position asked for: the engine stands at the first operation boundary at or
    /// after it, which is where a fresh replay to any event from here to there stands too.
    requested: usize,
}

/// What a cursor that owns its allocator starts again from.
struct Restart {
    options: Options,
    releases: FxHashMap<usize, ReleaseReading>,
    found: Found,
}

impl<'a> Cursor<'a> {
    /// A cursor before the first event of `options.device`'s trace, following `releases`
    /// (what-if) in `found`'s order.
    fn new(
        recording: &'a Recording,
        options: Options,
        releases: FxHashMap<usize, ReleaseReading>,
        found: Found,
    ) -> Result<Cursor<'a>, ReplayError> {
        let (engine, _) = engine_for(recording, &options, releases.clone(), &found)?;
        Ok(Cursor {
            recording,
            restart: Some(Restart {
                options,
                releases,
                found,
            }),
            engine,
            requested: 0,
        })
    }

    /// The allocator where the cursor stands, and where the replay first differed from the
    /// recording, if it did (check replays).
    pub fn into_parts(self) -> (CachingAllocator<SimDevice>, Option<Divergence>) {
        (self.engine.alloc, self.engine.divergence)
    }

    /// A what-if cursor on `alloc` (which should hold no memory) at the first event of
    /// `device`'s trace, its start state loaded. The allocator's statistics go on from where
    /// they were, as a process's do. Unlike a session's, it does not first look for the
    /// readings of ambiguous release runs: each run of releases before an allocation is
    /// replayed as an `empty_cache()`.
    ///
    /// # Errors
    /// [`ReplayError`] if the device has no trace or its start state cannot be rebuilt.
    pub fn on(
        recording: &'a Recording,
        device: u32,
        alloc: CachingAllocator<SimDevice>,
    ) -> Result<Self, ReplayError> {
        let options = Options {
            device,
            ..Options::default()
        };
        let engine = Engine::start(
            recording,
            &options,
            alloc,
            FxHashMap::default(),
            None,
            false,
        )?;
        Ok(Cursor {
            recording,
            restart: None,
            engine,
            requested: 0,
        })
    }

    /// Moves to just after event `event` (an `oom` entry: with the failing allocation's
    /// cache flushed).
    ///
    /// # Errors
    /// As [`Session::replay`]; [`ReplayError::Rewind`] backward on a caller's allocator.
    pub fn seek(&mut self, event: usize) -> Result<(), ReplayError> {
        self.advance_to(event.saturating_add(1))
    }

    /// Replays the events before `event` that have not been replayed yet, starting again
    /// first where the cursor went past it. An operation's events go together (a malloc and
    /// the segment it obtained), so the position may end a few events past `event`; asking
    /// again for any event up to that position is then no move at all.
    ///
    /// # Errors
    /// [`ReplayError::Allocator`] when the allocator fails other than by running out of
    /// memory (out-of-memory is counted and replay goes on); [`ReplayError::Rewind`] backward
    /// on a caller's allocator.
    pub fn advance_to(&mut self, event: usize) -> Result<(), ReplayError> {
        if event < self.requested {
            let Some(restart) = &self.restart else {
                return Err(ReplayError::Rewind {
                    position: self.engine.position,
                    target: event,
                });
            };
            let releases = restart.releases.clone();
            self.engine = engine_for(self.recording, &restart.options, releases, &restart.found)?.0;
        }
        self.requested = event;
        self.engine.advance(event, &mut |_, _| {})
    }

    /// Events replayed so far.
    pub fn position(&self) -> usize {
        self.engine.position
    }

    /// Events in the trace.
    pub fn len(&self) -> usize {
        self.engine.events.len()
    }

    /// Whether the trace is empty.
    pub fn is_empty(&self) -> bool {
        self.engine.events.is_empty()
    }

    /// The allocator as the replay has it now.
    pub fn allocator(&self) -> &CachingAllocator<SimDevice> {
        &self.engine.alloc
    }

    /// The blocks the program holds where the cursor stands: each one's recorded address and
    /// the pointer the replay gave it (the same in a check replay; a what-if's own). Blocks
    /// freed but waiting on other streams are not held.
    pub fn held(&self) -> impl Iterator<Item = (u64, crate::device::DevicePtr)> + '_ {
        self.engine
            .ptrs
            .iter()
            .map(|(&recorded, &ptr)| (recorded, ptr))
    }

    /// Where the replay first differed from the recording, if it did (check replays).
    pub fn divergence(&self) -> Option<&Divergence> {
        self.engine.divergence.as_ref()
    }

    /// Frees everything the replay still holds, returns all cached memory to the device and
    /// hands the allocator back, ready for another run.
    ///
    /// # Errors
    /// [`ReplayError::Allocator`] if the allocator fails.
    pub fn finish(mut self) -> Result<CachingAllocator<SimDevice>, ReplayError> {
        let index = self.engine.position;
        let fail = |source| ReplayError::Allocator { index, source };
        for stream in std::mem::take(&mut self.engine.deferred).into_values() {
            self.engine.alloc.device_mut().complete_stream(stream);
        }
        for (_, ptr) in self.engine.ptrs.drain() {
            self.engine.alloc.free(ptr).map_err(fail)?;
        }
        // The run's private pools go with it: freeable, their segments flushed below.
        let alloc = &mut self.engine.alloc;
        for pool in alloc.private_pools() {
            while alloc.pool_use_count(pool).is_some_and(|n| n > 0) {
                alloc.release_pool(pool).map_err(fail)?;
            }
        }
        alloc.empty_cache().map_err(fail)?;
        Ok(self.engine.alloc)
    }
}

/// The engine of one replay, at the trace's start, in `found`'s order, with its
/// configuration.
fn engine_for<'a>(
    recording: &'a Recording,
    options: &Options,
    releases_in_malloc: FxHashMap<usize, ReleaseReading>,
    found: &Found,
) -> Result<(Engine<'a>, AllocatorConfig), ReplayError> {
    let config = replayed_config(recording, options);
    let capacity = options
        .capacity
        .or(recording.simulated_device.map(|d| d.total_bytes))
        .unwrap_or(DEFAULT_CAPACITY)
        .min(MAX_CAPACITY);
    let mut sim = SimConfig {
        index: options.device,
        costs: Arc::clone(&options.costs),
        ..SimConfig::with_capacity(capacity)
    };
    if options.check {
        // Every placement is dictated by the recording: open the whole address space to it.
        sim.base_address = 1 << 21;
        sim.address_space = MAX_CAPACITY;
    } else if let Some(available) = options.available {
        sim.other_process_bytes = capacity.saturating_sub(available);
    }
    let mut alloc =
        CachingAllocator::with_fit_order(SimDevice::new(sim), config.clone(), found.order);
    if let Some(plan) = &options.plan {
        alloc
            .set_plan(plan.clone())
            .map_err(ReplayError::BeforeTrace)?;
    }
    if let Some(fraction) = recording.simulated_device.and_then(|d| d.memory_fraction) {
        alloc
            .set_memory_fraction(fraction)
            .map_err(ReplayError::BeforeTrace)?;
    }
    let start_order = found.start_order.as_deref();
    let engine = Engine::start(
        recording,
        options,
        alloc,
        releases_in_malloc,
        start_order,
        start_order.is_none(),
    )?;
    Ok((engine, config))
}

/// One replay following the given readings.
fn run_with(
    recording: &Recording,
    options: &Options,
    progress: &mut dyn FnMut(usize, usize),
    releases_in_malloc: FxHashMap<usize, ReleaseReading>,
    found: &Found,
) -> Result<Run, ReplayError> {
    let (mut engine, config) = engine_for(recording, options, releases_in_malloc, found)?;
    let capacity = engine.alloc.device().config().capacity;
    // The report covers the trace: counters start at zero, peaks at the start state.
    engine.alloc.reset_accumulated_stats();
    engine.alloc.reset_peak_stats();
    let start_segments = engine.start_segments;
    let driver_before = engine.alloc.device().stats();
    engine.run(progress)?;

    let stats = engine.alloc.stats();
    let count = |value: i64| value.max(0) as u64;
    let peak_allocated = count(stats.allocated_bytes.all().peak);
    let peak_reserved = count(stats.reserved_bytes.all().peak);
    let device_allocs = count(stats.num_device_alloc.get());
    let device_frees = count(stats.num_device_free.get());
    let alloc_retries = count(stats.num_alloc_retries.get());
    let ooms = count(stats.num_ooms.get()) + engine.start_ooms;
    let plan_hits = count(stats.num_plan_hits.get());
    let plan_misses = count(stats.num_plan_misses.get());
    let inferred_pools = recording
        .inferred_pools
        .get(options.device as usize)
        .copied()
        .flatten();
    let report = ReplayReport {
        config: config_label(&config),
        events: engine.events.len(),
        start_segments,
        peak_allocated,
        peak_reserved,
        device_allocs,
        device_frees,
        alloc_retries,
        ooms,
        plan_hits,
        plan_misses,
        plan_paging: engine.alloc.plan_status().map(|s| s.paging),
        driver_time_ns: engine.alloc.device().stats().driver_time_ns - driver_before.driver_time_ns,
        driver_calls: engine.alloc.device().stats().driver_calls() - driver_before.driver_calls(),
        compared: engine.compared,
        divergence: engine.divergence,
        series: engine.series,
        capacity,
        capacity_inferred: false,
        job_memory: None,
        notes: settings_notes(recording, &config, options.config.is_none())
            .into_iter()
            .chain(engine.skipped.note().map(str::to_string))
            .chain(inferred_pools.map(pools_note))
            .collect(),
        ordering: found.report.clone(),
        inferred_pools,
    };
    Ok(Run {
        report,
        releases_in_malloc: engine.releases_in_malloc,
        reservation_spacing: engine.reservation_spacing,
        found: found.clone(),
        derivation: engine.derivation,
    })
}

/// The trace of `device`: empty for a device whose segments a snapshot without traces
/// (`include_traces=False`) holds.
pub(super) fn device_events(
    recording: &Recording,
    device: u32,
) -> Result<&[TraceEntry], ReplayError> {
    match recording.device_traces.get(device as usize) {
        Some(events) => Ok(events),
        None if recording.segments.iter().any(|s| s.device == device) => Ok(&[]),
        None => Err(ReplayError::NoSuchDevice {
            device,
            devices: recording.device_traces.len(),
        }),
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::size::LARGE_BUFFER;

    /// A cursor moved one operation at a time (as `diff` moves it) is held to the replay's
    /// memory budget as one moved at once is: the check is kept between calls.
    #[test]
    fn a_cursor_stepped_an_operation_at_a_time_keeps_its_memory_budget() {
        let mut events = Vec::new();
        for i in 0..2_000u64 {
            let (stream, addr) = (i * 7919 % 1_000_003 + 1, 0x7f00_0000_0000 + i * (2 << 20));
            for action in ["segment_alloc", "alloc", "free_requested", "free_completed"] {
                let size = if action == "segment_alloc" {
                    2 << 20
                } else {
                    512
                };
                events.push(serde_json::json!({"action": action, "addr": addr, "size": size, "stream": stream}));
            }
        }
        let doc = serde_json::json!({"segments": [], "device_traces": [events]});
        let recording =
            crate::recording::parse_recording(doc.to_string().as_bytes()).expect("reads");
        let options = |budget| Options {
            capacity: Some(1 << 46),
            check: true,
            max_memory_bytes: budget,
            ..Options::default()
        };
        let step_through = |budget| -> Result<usize, ReplayError> {
            let found = Found::named(FitOrder::default());
            let mut cursor = Cursor::new(&recording, options(budget), FxHashMap::default(), found)?;
            let mut steps = 0;
            while cursor.position() < cursor.len() {
                cursor.advance_to(cursor.position() + 1)?;
                steps += 1;
            }
            Ok(steps)
        };
        assert!(step_through(None).is_ok_and(|steps| steps >= 2_000));
        let err = step_through(Some(1 << 20)).expect_err("bounded");
        assert!(
            matches!(err, ReplayError::MemoryBudget { budget, .. } if budget == 1 << 20),
            "{err}"
        );
    }

    #[test]
    fn the_inferred_capacity_is_the_largest_that_reserves_the_spacing() {
        let reserves = |c: u64, page: u64| (c + c / 8).div_ceil(page) * page;
        const TWELVE: u64 = 12 << 20;
        for (spacing, page, large) in [
            (95_630_131_200, LARGE_BUFFER, LARGE_BUFFER),
            (
                4560 * LARGE_BUFFER + SMALL_BUFFER,
                SMALL_BUFFER,
                LARGE_BUFFER,
            ),
            (9 * SMALL_BUFFER, SMALL_BUFFER, LARGE_BUFFER),
            // large_segment_size_mb:12: the large pool's reservations are in 12 MiB pages.
            (7600 * TWELVE, TWELVE, TWELVE),
        ] {
            let c = capacity_for_reservation(spacing, large);
            assert_eq!(reserves(c, page), spacing, "{spacing}");
            assert!(reserves(c + 1, page) > spacing, "{spacing}: the largest");
        }
        assert_eq!(
            capacity_for_reservation(u64::MAX, LARGE_BUFFER),
            MAX_CAPACITY
        );
    }
}
