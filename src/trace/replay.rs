//! Replaying one device's recorded trace through the allocator core.
//!
//! The recording lists what the allocator did; replay turns it back into what the program
//! asked for and asks the core again:
//! - `alloc` becomes a `malloc` of the requested size on the recorded stream;
//! - `free_requested` becomes a `free` (after a `record_stream` on a stream of its own when
//!   the recording completes that free later, so that it is deferred the same way);
//! - a deferred `free_completed` completes that stream's work, so the next `malloc` (or
//!   cache flush) completes the free where the recording did;
//! - a run of `segment_free` not followed by an `oom` becomes `empty_cache()`; before an
//!   `oom` it is the allocator's own flush inside the failing `malloc` (either reading yields
//!   the same blocks and events; these are the natural ones);
//! - `oom` becomes a `malloc` that the device refuses (in check mode);
//! - `snapshot` becomes a snapshot.
//!
//! In check mode the simulated device hands out the recorded segment addresses, and every
//! event the core emits is compared with the recording: the first difference is reported as
//! a [`Divergence`]. In what-if mode the core decides freely under another configuration,
//! and recorded addresses are mapped to the ones it chose.

use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

use crate::allocator::size::format_size;
use crate::allocator::{AllocError, CachingAllocator, TraceAction, TraceEntry};
use crate::config::AllocatorConfig;
use crate::device::{DevicePtr, SimConfig, SimDevice, StreamId};

use super::start_state::{StartSegment, start_state};
use super::{RecordedEvent, Recording};

/// The device memory assumed when neither the recording nor the user says: the 80 GiB of
/// the GPUs behind the shared recordings.
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

/// The largest simulated device: 64 PiB, far beyond any GPU, small enough that no byte
/// count derived from it overflows.
pub const MAX_CAPACITY: u64 = 1 << 56;

/// Streams invented to defer frees start here, far from real stream handles.
const SYNTHETIC_STREAM_BASE: u64 = 0xdefe_0000_0000_0000;

/// How to replay.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Which device's trace.
    pub device: u32,
    /// The configuration; `None` for the recorded one (or the default).
    pub config: Option<AllocatorConfig>,
    /// Device memory; `None` for the recorded device or [`DEFAULT_CAPACITY`].
    pub capacity: Option<u64>,
    /// Compare every decision with the recording (and answer as the recorded device did).
    pub check: bool,
    /// Number of (allocated, reserved) samples to keep for plots; 0 for none.
    pub series_points: usize,
    /// What-if only: start from the blocks live at the trace's start, allocated afresh (in
    /// address order) under the configuration, instead of from the recorded segments and
    /// their cache: what a job started under that configuration would hold there.
    pub fresh_start: bool,
}

/// Decisions compared with the recording, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Compared {
    /// `alloc` addresses.
    pub allocs: u64,
    /// `free_requested` and `free_completed` events.
    pub frees: u64,
    /// `segment_alloc` sizes and addresses.
    pub segment_allocs: u64,
    /// `segment_free` events, in burst order.
    pub segment_frees: u64,
    /// `segment_map` and `segment_unmap` ranges.
    pub segment_maps: u64,
    /// `oom` events.
    pub ooms: u64,
    /// `snapshot` markers (active bytes).
    pub snapshots: u64,
}

impl Compared {
    /// All decisions compared.
    pub fn total(&self) -> u64 {
        self.allocs
            + self.frees
            + self.segment_allocs
            + self.segment_frees
            + self.segment_maps
            + self.ooms
            + self.snapshots
    }
}

/// The first point where the core decided differently from the recording.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// Index of the recorded event in the device's trace.
    pub index: usize,
    /// The recorded event.
    pub expected: String,
    /// What the core did instead.
    pub actual: String,
    /// Recorded events around the divergence and the allocator's state.
    pub context: Vec<String>,
}

/// One sample of memory over the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SeriesPoint {
    /// Index of the recorded event.
    pub event: usize,
    /// Allocated bytes.
    pub allocated: u64,
    /// Reserved bytes.
    pub reserved: u64,
}

/// What a replay did.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// The configuration string replayed under.
    pub config: String,
    /// Recorded events processed.
    pub events: usize,
    /// Segments in the rebuilt start state.
    pub start_segments: usize,
    /// Peak allocated bytes (start state included).
    pub peak_allocated: u64,
    /// Peak reserved bytes (start state included).
    pub peak_reserved: u64,
    /// Driver allocations (`cudaMalloc` or page maps) during the trace.
    pub device_allocs: u64,
    /// Driver frees during the trace.
    pub device_frees: u64,
    /// Allocations that flushed the cache and retried.
    pub alloc_retries: u64,
    /// Allocations that failed.
    pub ooms: u64,
    /// Simulated time spent in driver calls during the trace, in nanoseconds.
    pub driver_time_ns: u64,
    /// Decisions compared (check mode).
    pub compared: Compared,
    /// The first divergence (check mode).
    pub divergence: Option<Divergence>,
    /// Memory over the trace, if asked for.
    pub series: Vec<SeriesPoint>,
}

impl ReplayReport {
    /// Peak reserved over peak allocated: what fragmentation and caching cost.
    pub fn reserved_ratio(&self) -> f64 {
        self.peak_reserved as f64 / self.peak_allocated.max(1) as f64
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
    StartState(String),
    /// The allocator failed other than by running out of memory.
    #[error("the allocator failed at event {index}: {source}")]
    Allocator {
        /// Index of the recorded event.
        index: usize,
        /// The error.
        source: AllocError,
    },
}

/// Replays one device's trace. See the module documentation.
///
/// # Errors
/// A [`ReplayError`] when the replay cannot run at all; a divergence is not an error but part
/// of the report.
pub fn replay(recording: &Recording, options: &ReplayOptions) -> Result<ReplayReport, ReplayError> {
    replay_with_progress(recording, options, &mut |_, _| {})
}

/// [`replay()`], calling `progress(events done, events in all)` every few thousand events.
///
/// # Errors
/// As [`replay()`].
pub fn replay_with_progress(
    recording: &Recording,
    options: &ReplayOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ReplayReport, ReplayError> {
    let readings = if options.check {
        Readings::default()
    } else {
        Readings::of(recording, options)?
    };
    replay_following(recording, options, &readings, progress)
}

/// How a recording's ambiguous release runs read (Note [Reading releases]): the readings that
/// reproduce it under its own configuration, which what-if replays follow. Found by one check
/// replay; compute them once for several what-if replays of the same device and capacity.
#[derive(Clone, Debug, Default)]
pub struct Readings {
    releases_in_malloc: FxHashSet<usize>,
}

impl Readings {
    /// The readings of `options.device`'s trace on `options.capacity`. A what-if capacity too
    /// small for the recording's own start falls back to the recorded device's: the readings
    /// describe the recording, not the what-if.
    ///
    /// # Errors
    /// As [`replay()`].
    pub fn of(recording: &Recording, options: &ReplayOptions) -> Result<Readings, ReplayError> {
        let check = ReplayOptions {
            config: None,
            check: true,
            series_points: 0,
            fresh_start: false,
            ..options.clone()
        };
        let found = match run_with(recording, &check, &mut |_, _| {}, FxHashSet::default()) {
            Err(ReplayError::StartState(_)) if check.capacity.is_some() => {
                let recorded = ReplayOptions {
                    capacity: None,
                    ..check
                };
                run_with(recording, &recorded, &mut |_, _| {}, FxHashSet::default())
            }
            other => other,
        };
        let (_, releases_in_malloc) = found?;
        Ok(Readings { releases_in_malloc })
    }
}

/// A replay that follows `readings` (ignored in check mode, which finds its own), calling
/// `progress` as [`replay_with_progress`] does.
///
/// # Errors
/// As [`replay()`].
pub fn replay_following(
    recording: &Recording,
    options: &ReplayOptions,
    readings: &Readings,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ReplayReport, ReplayError> {
    let releases = if options.check {
        FxHashSet::default()
    } else {
        readings.releases_in_malloc.clone()
    };
    let (report, _) = run_with(recording, options, progress, releases)?;
    Ok(report)
}

/// One replay following the given readings: the report and the readings found.
fn run_with(
    recording: &Recording,
    options: &ReplayOptions,
    progress: &mut dyn FnMut(usize, usize),
    releases_in_malloc: FxHashSet<usize>,
) -> Result<(ReplayReport, FxHashSet<usize>), ReplayError> {
    let events = device_events(recording, options.device)?;
    let recorded_config = recording.config.clone().unwrap_or_default();
    let config = options
        .config
        .clone()
        .unwrap_or_else(|| recorded_config.clone());
    let capacity = options
        .capacity
        .or(recording.simulated_device.map(|d| d.total_bytes))
        .unwrap_or(DEFAULT_CAPACITY)
        .min(MAX_CAPACITY);
    let mut sim = SimConfig {
        index: options.device,
        ..SimConfig::with_capacity(capacity)
    };
    if options.check {
        // Every placement is dictated by the recording: open the whole address space to it.
        sim.base_address = 1 << 21;
        sim.address_space = 1 << 56;
    }
    let mut alloc = CachingAllocator::new(SimDevice::new(sim), config.clone());
    if let Some(fraction) = recording.simulated_device.and_then(|d| d.memory_fraction) {
        alloc
            .set_memory_fraction(fraction)
            .map_err(|source| ReplayError::Allocator { index: 0, source })?;
    }
    let mut engine = Engine::start(recording, options, alloc, releases_in_malloc)?;
    // The report covers the trace: counters start at zero, peaks at the start state.
    engine.alloc.reset_accumulated_stats();
    engine.alloc.reset_peak_stats();
    let start_segments = engine.start_segments;
    let driver_time_before = engine.alloc.device().stats().driver_time_ns;
    engine.run(progress)?;

    let stats = engine.alloc.memory_stats();
    let get = |key: &str| stats.get(key).copied().unwrap_or(0).max(0) as u64;
    let report = ReplayReport {
        config: if config.last_settings.is_empty() {
            "(default)".to_string()
        } else {
            config.last_settings.clone()
        },
        events: events.len(),
        start_segments,
        peak_allocated: get("allocated_bytes.all.peak"),
        peak_reserved: get("reserved_bytes.all.peak"),
        device_allocs: get("num_device_alloc"),
        device_frees: get("num_device_free"),
        alloc_retries: get("num_alloc_retries"),
        ooms: get("num_ooms") + engine.start_ooms,
        driver_time_ns: engine.alloc.device().stats().driver_time_ns - driver_time_before,
        compared: engine.compared,
        divergence: engine.divergence,
        series: engine.series,
    };
    Ok((report, engine.releases_in_malloc))
}

fn device_events(recording: &Recording, device: u32) -> Result<&[RecordedEvent], ReplayError> {
    recording
        .device_traces
        .get(device as usize)
        .map(Vec::as_slice)
        .ok_or(ReplayError::NoSuchDevice {
            device,
            devices: recording.device_traces.len(),
        })
}

/// A what-if replay driven step by step, on an allocator the caller keeps: the demo's
/// simulated processes loop recordings at their recorded pace this way. Unlike [`replay()`],
/// it does not first look for the readings of ambiguous release runs: each run of releases
/// before an allocation is replayed as an `empty_cache()`.
pub struct Replayer<'a> {
    engine: Engine<'a>,
}

impl<'a> Replayer<'a> {
    /// Loads the recording's start state for `device` into `alloc` (which should hold no
    /// memory) and positions the replay at the first event. The allocator's statistics go on
    /// from where they were, as a process's do.
    ///
    /// # Errors
    /// [`ReplayError`] if the device has no trace or its start state cannot be rebuilt.
    pub fn new(
        recording: &'a Recording,
        device: u32,
        alloc: CachingAllocator<SimDevice>,
    ) -> Result<Self, ReplayError> {
        let options = ReplayOptions {
            device,
            ..ReplayOptions::default()
        };
        let engine = Engine::start(recording, &options, alloc, FxHashSet::default())?;
        Ok(Replayer { engine })
    }

    /// Replays the events before `event` that have not been replayed yet.
    ///
    /// # Errors
    /// [`ReplayError::Allocator`] when the allocator fails other than by running out of
    /// memory (out-of-memory is counted and replay goes on).
    pub fn advance_to(&mut self, event: usize) -> Result<(), ReplayError> {
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

    /// The allocator.
    pub fn allocator(&self) -> &CachingAllocator<SimDevice> {
        &self.engine.alloc
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
        self.engine.alloc.empty_cache().map_err(fail)?;
        Ok(self.engine.alloc)
    }
}

struct Engine<'a> {
    events: &'a [RecordedEvent],
    /// Index of the next event to replay.
    position: usize,
    start_segments: usize,
    alloc: CachingAllocator<SimDevice>,
    check: bool,
    /// Recorded address → the pointer the core returned for it.
    ptrs: FxHashMap<u64, DevicePtr>,
    /// Recorded addresses whose allocation failed in this replay (what-if mode).
    failed: FxHashSet<u64>,
    /// Blocks live at the start that a fresh start could not allocate (counted as OOMs; the
    /// statistics are reset when the trace starts).
    start_ooms: u64,
    /// Recorded address of a deferred free → the stream its completion waits on.
    deferred: FxHashMap<u64, StreamId>,
    next_stream: u64,
    compared: Compared,
    divergence: Option<Divergence>,
    series: Vec<SeriesPoint>,
    series_every: usize,
    /// Starts of the release runs that the allocator made inside a malloc (not a user's
    /// `empty_cache`): found in check mode, followed in what-if mode.
    releases_in_malloc: FxHashSet<usize>,
}

/// Events that drive an operation; everything else is an effect of the next one.
fn is_driver(action: TraceAction) -> bool {
    matches!(
        action,
        TraceAction::Alloc
            | TraceAction::Oom
            | TraceAction::Snapshot
            | TraceAction::FreeRequested
            | TraceAction::UserDefined
    )
}

fn describe(action: TraceAction, addr: u64, size: u64, stream: u64) -> String {
    let name = serde_json::to_value(action)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    match action {
        TraceAction::Oom => format!("oom of {size} bytes on stream {stream:#x}"),
        TraceAction::Snapshot => format!("snapshot with {size} active bytes"),
        _ => format!("{name} at {addr:#x} of {size} bytes on stream {stream:#x}"),
    }
}

fn describe_recorded(e: &RecordedEvent) -> String {
    describe(e.action, e.addr, e.size, e.stream)
}

fn describe_entry(e: &TraceEntry) -> String {
    describe(e.action, e.addr, e.size, e.stream)
}

impl<'a> Engine<'a> {
    /// Loads the start state of `options.device`'s trace into `alloc`.
    fn start(
        recording: &'a Recording,
        options: &ReplayOptions,
        mut alloc: CachingAllocator<SimDevice>,
        releases_in_malloc: FxHashSet<usize>,
    ) -> Result<Self, ReplayError> {
        let events = device_events(recording, options.device)?;
        let recorded_config = recording.config.clone().unwrap_or_default();
        let start = start_state(recording, options.device, &recorded_config)
            .map_err(ReplayError::StartState)?;
        let mut ptrs = FxHashMap::default();
        let failed = if options.fresh_start && !options.check {
            Self::allocate_afresh(&start.segments, &mut alloc, &mut ptrs)?
        } else {
            FxHashSet::default()
        };
        let restored = if options.fresh_start && !options.check {
            &[][..]
        } else {
            &start.segments[..]
        };
        for segment in restored {
            // Check mode places segments where the recording did; what-if lets the device
            // choose (recorded addresses are mapped to the chosen ones either way).
            if options.check {
                alloc.device_mut().hint_addresses([segment.address]);
            }
            let base = alloc
                .restore_segment(StreamId(segment.stream), segment.pool, &segment.blocks)
                .map_err(|e| {
                    ReplayError::StartState(format!(
                        "segment {:#x} of {} does not fit: {e}",
                        segment.address,
                        format_size(segment.size())
                    ))
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
            alloc
                .free(ptr)
                .map_err(|source| ReplayError::Allocator { index: 0, source })?;
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
            releases_in_malloc,
        })
    }

    /// Allocates the live blocks of the recorded start segments, in address order, on their
    /// streams; the recorded addresses map to the new blocks. Returns the addresses of blocks
    /// that did not fit (out of memory under this configuration), as the trace's own failed
    /// allocations are kept.
    fn allocate_afresh(
        segments: &[StartSegment],
        alloc: &mut CachingAllocator<SimDevice>,
        ptrs: &mut FxHashMap<u64, DevicePtr>,
    ) -> Result<FxHashSet<u64>, ReplayError> {
        let mut live: Vec<(u64, u64, u64)> = Vec::new();
        for segment in segments {
            let mut at = segment.address;
            for b in &segment.blocks {
                if let Some(requested) = b.allocated {
                    live.push((at, segment.stream, requested));
                }
                at += b.size;
            }
        }
        live.sort_unstable();
        let mut failed = FxHashSet::default();
        for (addr, stream, requested) in live {
            match alloc.malloc(requested, StreamId(stream)) {
                Ok(ptr) => {
                    ptrs.insert(addr, ptr);
                }
                Err(e) if e.is_out_of_memory() => {
                    failed.insert(addr);
                }
                Err(source) => return Err(ReplayError::Allocator { index: 0, source }),
            }
        }
        Ok(failed)
    }

    fn run(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<(), ReplayError> {
        self.advance(self.events.len(), progress)?;
        if self.series_every != usize::MAX {
            self.sample(self.events.len());
        }
        progress(self.events.len(), self.events.len());
        Ok(())
    }

    /// Replays events until `until` (or the first divergence).
    fn advance(
        &mut self,
        until: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(), ReplayError> {
        const PROGRESS_EVERY: usize = 4096;
        let n = self.events.len();
        let until = until.min(n);
        let mut i = self.position;
        let mut reported = i;
        while i < until && self.divergence.is_none() {
            if i >= reported + PROGRESS_EVERY {
                progress(i, n);
                reported = i;
            }
            let next = match self.events[i].action {
                TraceAction::FreeRequested => self.free(i)?,
                TraceAction::UserDefined => i + 1,
                _ => self.operation(i)?,
            };
            if self.series_every != usize::MAX {
                for event in i..next {
                    if event % self.series_every == 0 {
                        self.sample(event);
                    }
                }
            }
            i = next;
            self.position = i;
        }
        Ok(())
    }

    fn sample(&mut self, event: usize) {
        let stats = self.alloc.stats();
        self.series.push(SeriesPoint {
            event,
            allocated: stats.allocated_bytes.all_current().max(0) as u64,
            reserved: stats.reserved_bytes.all_current().max(0) as u64,
        });
    }

    fn fail(&self, index: usize, source: AllocError) -> ReplayError {
        ReplayError::Allocator { index, source }
    }

    /// `free_requested` at `i` (with its `free_completed` right after, unless deferred).
    fn free(&mut self, i: usize) -> Result<usize, ReplayError> {
        let e = self.events[i];
        let immediate = self
            .events
            .get(i + 1)
            .is_some_and(|c| c.action == TraceAction::FreeCompleted && c.addr == e.addr);
        let end = i + 1 + usize::from(immediate);
        let Some(ptr) = self.ptrs.remove(&e.addr) else {
            if self.failed.remove(&e.addr) {
                return Ok(end);
            }
            self.diverge(
                i,
                describe_recorded(&e),
                "no live block at that address".into(),
            );
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

    /// The effects starting at `i` and the operation that produced them.
    fn operation(&mut self, i: usize) -> Result<usize, ReplayError> {
        let n = self.events.len();
        let j = (i..n)
            .find(|&k| is_driver(self.events[k].action))
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
        for effect in effects {
            if effect.action == TraceAction::FreeCompleted
                && let Some(stream) = self.deferred.remove(&effect.addr)
            {
                self.alloc.device_mut().complete_stream(stream);
            }
        }
        let releases = effects.iter().any(|e| {
            matches!(
                e.action,
                TraceAction::SegmentFree | TraceAction::SegmentUnmap
            )
        });
        let completions = effects
            .iter()
            .any(|e| e.action == TraceAction::FreeCompleted);
        let malloc = driver.is_some_and(|d| d.action == TraceAction::Alloc);
        let oom = driver.is_some_and(|d| d.action == TraceAction::Oom);
        // Note [Reading releases]: releases before an OOM are the failing malloc's own flush;
        // releases before a successful malloc are either a user's `empty_cache` or the
        // allocator's own (garbage collection, oversize release, a flush after the driver
        // said no); anything else is a flush. Check mode tries the allocator's reading
        // first and keeps it if it reproduces the recording; what-if mode reuses the readings
        // a check pass found.
        if releases && malloc {
            if self.check {
                let saved = self.alloc.clone();
                self.perform(i, j, driver, false)?;
                if self.reproduces(i, end) {
                    self.releases_in_malloc.insert(i);
                    return Ok(end);
                }
                self.alloc = saved;
                if let Some(d) = driver {
                    self.ptrs.remove(&d.addr);
                }
                self.perform(i, j, driver, true)?;
            } else {
                let flush = !self.releases_in_malloc.contains(&i);
                self.perform(i, j, driver, flush)?;
            }
        } else {
            let flush = (releases && !oom) || (completions && !malloc && !oom);
            self.perform(i, j, driver, flush)?;
        }
        self.compare(i, end);
        Ok(end.max(i + 1))
    }

    /// Runs the operation for effects `i..j` and `driver`, after a cache flush if `flush`.
    fn perform(
        &mut self,
        i: usize,
        j: usize,
        driver: Option<RecordedEvent>,
        flush: bool,
    ) -> Result<(), ReplayError> {
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
            self.drive(j, d)?;
        }
        self.alloc.device_mut().clear_address_hints();
        Ok(())
    }

    /// Whether the core's events since the last comparison are exactly the recorded
    /// `start..end`; if so they are counted, else left for [`Engine::compare`].
    fn reproduces(&mut self, start: usize, end: usize) -> bool {
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

    fn drive(&mut self, j: usize, d: RecordedEvent) -> Result<(), ReplayError> {
        let stream = StreamId(d.stream);
        match d.action {
            TraceAction::Alloc => match self.alloc.malloc(d.size, stream) {
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
            },
            TraceAction::Oom => {
                if self.check {
                    self.alloc.device_mut().fail_all_allocations(true);
                }
                let result = self.alloc.malloc(d.size, stream);
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

    /// Compares what the core emitted with the recorded events `start..end`.
    fn compare(&mut self, start: usize, end: usize) {
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
                    let expected = x.map_or("nothing more".to_string(), describe_recorded);
                    let actual = a.map_or("nothing".to_string(), describe_entry);
                    self.diverge(index, expected, actual);
                    return;
                }
            }
        }
    }

    fn count(&mut self, action: TraceAction) {
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

    fn diverge(&mut self, index: usize, expected: String, actual: String) {
        if !self.check {
            return;
        }
        let from = index.saturating_sub(4);
        let to = (index + 3).min(self.events.len());
        let mut context: Vec<String> = (from..to)
            .map(|k| {
                let mark = if k == index { ">>" } else { "  " };
                format!("{mark} #{k}: {}", describe_recorded(&self.events[k]))
            })
            .collect();
        let recorded = self.events.get(index);
        if recorded.is_some_and(|e| {
            matches!(
                e.action,
                TraceAction::SegmentMap | TraceAction::SegmentAlloc
            )
        }) {
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
fn same(x: &RecordedEvent, a: &TraceEntry) -> bool {
    if x.action != a.action {
        return false;
    }
    match x.action {
        // The free device memory of an OOM depends on the device, not on the allocator.
        TraceAction::Oom | TraceAction::Snapshot => x.size == a.size,
        _ => x.addr == a.addr && x.size == a.size,
    }
}
