//! A replay session: one device of one recording, on one device memory, in one best-fit
//! order, within one memory budget ([`Setup`]), and what replays of it share: how the
//! recording reads ([`Readings`], found once by check replays), the memory the job had at
//! its first OOM, and the device memory replays run on. Every replay of the tools (`explain`,
//! `plan`, the view, the CLI) goes through a session: a check, a what-if, the state after an
//! event, or a cursor that moves through the trace.
//!
//! # Invariants
//! - What a session finds (readings, the job's memory) depends only on its recording and
//!   setup, so it is found at most once per session (twice at worst when two threads ask at
//!   once: both find the same) and every replay of the session follows the same readings.
//! - A what-if without an `available` of its own, on a recording with an OOM, replays within
//!   the memory the job had there ([`JobMemory`], read as `explain` reads it), and its report
//!   says so (`ReplayReport::job_memory`).

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::AllocatorConfig;
use crate::allocator::{CachingAllocator, FitOrder, Plan, TraceAction};
use crate::device::{DriverCosts, SimDevice};
use crate::recording::{MAX_MEMORY_BYTES, Recording};

use super::engine::ReleaseReading;
use super::order::Found;
use super::{
    Cursor, DEFAULT_CAPACITY, Divergence, MAX_CAPACITY, Options, OrderingReport, ReplayError,
    ReplayReport, Run, check_run, device_events, run_with,
};

/// What every replay of a session shares.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Which device's trace.
    pub device: u32,
    /// Device memory; `None` for the recorded device, else inferred from expandable
    /// reservations, else [`DEFAULT_CAPACITY`].
    pub capacity: Option<u64>,
    /// The best-fit order of the release that made the recording (`--pytorch`); `None`: the
    /// order found in the recording (Note [Finding the order]).
    pub order: Option<FitOrder>,
    /// The most memory each replay's state may hold (the allocator's bookkeeping and the
    /// replay's maps, estimated every few thousand events); `None`: no bound. By default the
    /// reader's default budget ([`MAX_MEMORY_BYTES`]).
    pub max_memory_bytes: Option<u64>,
    /// What each driver call costs the replays' clock (`--costs`; by default an H200's,
    /// [`DriverCosts::default`]).
    pub costs: Arc<DriverCosts>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            device: 0,
            capacity: None,
            order: None,
            max_memory_bytes: Some(MAX_MEMORY_BYTES),
            costs: Arc::default(),
        }
    }
}

impl Setup {
    /// The default setup on `device`.
    pub fn device(device: u32) -> Self {
        Setup::default().on_device(device)
    }

    /// This setup on `device`.
    #[must_use]
    pub fn on_device(self, device: u32) -> Self {
        Setup { device, ..self }
    }
}

/// How to replay.
#[derive(Clone, Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "a mode is made once per replay, which costs far more than its size"
)]
pub enum Mode {
    /// Compare every decision with the recording (the device answers as the recorded one
    /// did), following `plan`: the plan a recorded gpumem job followed (Note [Planned
    /// placement]).
    Check {
        /// The plan the recorded job followed.
        plan: Option<Arc<Plan>>,
    },
    /// Let the core decide freely, following how the recording reads.
    WhatIf(WhatIf),
}

impl Mode {
    /// A check without a plan.
    pub const CHECK: Mode = Mode::Check { plan: None };
}

/// A what-if replay: what the core decides on its own.
#[derive(Clone, Debug, Default)]
pub struct WhatIf {
    /// The configuration; `None` for the recorded one (or the default).
    pub config: Option<AllocatorConfig>,
    /// Start from the blocks live at the trace's start, allocated afresh (in address order)
    /// under the configuration, instead of from the recorded segments and their cache: what
    /// a job started under that configuration would hold there.
    pub fresh_start: bool,
    /// The device memory the allocator may have, the rest held by others (other processes,
    /// the CUDA context, libraries); `None`: what the job had at its first OOM where the
    /// recording has one ([`JobMemory`]), else all of it.
    pub available: Option<u64>,
    /// Replay just these events of the trace, from an empty allocator (no start state);
    /// frees of blocks allocated before them are skipped. How a plan is evaluated on the
    /// iterations it was not made from.
    pub window: Option<Range<usize>>,
    /// Follow this placement plan (Note [Planned placement]), a policy to evaluate.
    pub plan: Option<Arc<Plan>>,
}

impl WhatIf {
    /// Under `config` (`None`: the recorded one).
    #[must_use]
    pub fn under(self, config: Option<AllocatorConfig>) -> Self {
        WhatIf { config, ..self }
    }

    /// Within `available` bytes of the device (`None`: see [`WhatIf::available`]).
    #[must_use]
    pub fn within(self, available: Option<u64>) -> Self {
        WhatIf { available, ..self }
    }

    /// On `window`'s events only (`None`: the whole trace).
    #[must_use]
    pub fn on_events(self, window: Option<Range<usize>>) -> Self {
        WhatIf { window, ..self }
    }

    /// Following `plan`.
    #[must_use]
    pub fn following(self, plan: Option<Arc<Plan>>) -> Self {
        WhatIf { plan, ..self }
    }

    /// Starting afresh (see [`WhatIf::fresh_start`]).
    #[must_use]
    pub fn starting_afresh(self, fresh_start: bool) -> Self {
        WhatIf {
            fresh_start,
            ..self
        }
    }
}

/// The memory a job had when it ran out: its reserved bytes after the failing allocation's
/// flush, plus the bytes the driver said were free (the `oom` entry's `device_free`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct JobMemory {
    /// The first `oom` entry's index in the device's trace.
    pub event: usize,
    /// Reserved bytes there.
    pub reserved: u64,
    /// Free bytes the driver reported there.
    pub device_free: u64,
}

impl JobMemory {
    /// What the job had: reserved plus free.
    pub fn bytes(&self) -> u64 {
        self.reserved.saturating_add(self.device_free)
    }
}

/// How a recording reads: its ambiguous release runs (Note [Reading releases]) and its
/// best-fit order (Note [Finding the order]), as they reproduce it under its own
/// configuration; what-if replays follow them. Found by check replays.
#[derive(Clone, Debug, Default)]
pub(super) struct Readings {
    pub(super) releases_in_malloc: FxHashMap<usize, ReleaseReading>,
    /// The device memory inferred by the check replay, where it had to infer it.
    pub(super) inferred_capacity: Option<u64>,
    /// The order found, with the start segments' order; `None` before a check replay.
    pub(super) found: Option<Found>,
}

impl Readings {
    /// The readings of `options.device`'s trace on `options.capacity`. A capacity too small
    /// for the recording's own start falls back to the recorded device's: the readings
    /// describe the recording, not the what-if.
    fn of(recording: &Recording, options: &Options) -> Result<Readings, ReplayError> {
        let check = Options {
            check: true,
            ..options.clone()
        };
        let found = match check_run(recording, &check, &mut |_, _| {}) {
            Err(ReplayError::StartState(_) | ReplayError::StartSegment { .. })
                if check.capacity.is_some() =>
            {
                let recorded = Options {
                    capacity: None,
                    ..check
                };
                check_run(recording, &recorded, &mut |_, _| {})
            }
            other => other,
        };
        Ok(Readings::found_by(&found?))
    }

    /// How a check run of the recording (under its own configuration) read it.
    fn found_by(run: &Run) -> Readings {
        Readings {
            releases_in_malloc: run.releases_in_malloc.clone(),
            inferred_capacity: run.report.capacity_inferred.then_some(run.report.capacity),
            found: Some(run.found.clone()),
        }
    }

    /// The order to follow: the one `options` names (with the start order found for it, if
    /// the readings were found in it), else the one found, else PyTorch 2.15's.
    pub(super) fn found_or(&self, options: &Options) -> Found {
        match (&self.found, options.order) {
            (Some(found), None) => found.clone(),
            (Some(found), Some(order)) if found.order == order => found.clone(),
            (_, Some(order)) => {
                let mut named = Found::named(order);
                named.report.ordering_source = "flag";
                named
            }
            (None, None) => Found::named(FitOrder::default()),
        }
    }
}

/// One device of one recording being replayed. See the module documentation.
pub struct Session {
    recording: Arc<Recording>,
    setup: Setup,
    readings: OnceLock<Readings>,
    job_memory: OnceLock<Option<JobMemory>>,
}

impl Session {
    /// A session on `setup.device` of `recording`.
    ///
    /// # Errors
    /// [`ReplayError::NoSuchDevice`] when the recording has neither a trace nor segments for
    /// the device.
    pub fn new(recording: Arc<Recording>, setup: Setup) -> Result<Session, ReplayError> {
        device_events(&recording, setup.device)?;
        Ok(Session {
            recording,
            setup,
            readings: OnceLock::new(),
            job_memory: OnceLock::new(),
        })
    }

    /// The recording.
    pub fn recording(&self) -> &Recording {
        &self.recording
    }

    /// The device.
    pub fn device(&self) -> u32 {
        self.setup.device
    }

    /// What the session's replays share.
    pub fn setup(&self) -> &Setup {
        &self.setup
    }

    /// The device's trace (empty for a device a snapshot without traces holds segments of).
    pub fn events(&self) -> &[crate::allocator::TraceEntry] {
        self.recording.trace(self.setup.device)
    }

    /// A replay in `mode`, keeping `series_points` (allocated, reserved) samples for plots,
    /// calling `progress(events done, events in all)` every few thousand events.
    ///
    /// # Errors
    /// A [`ReplayError`] when the replay cannot run at all; a divergence is not an error but
    /// part of the report.
    pub fn replay(
        &self,
        mode: &Mode,
        series_points: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<ReplayReport, ReplayError> {
        if let Mode::Check { plan } = mode {
            let options = Options {
                series_points,
                ..self.options(mode)?
            };
            let run = check_run(&self.recording, &options, progress)?;
            if plan.is_none() && self.readings.get().is_none() {
                // The check of the recording as it is read is the readings' own replay.
                let _ = self.readings.set(Readings::found_by(&run));
            }
            return Ok(run.report);
        }
        let (followed, releases, found) = self.following(mode)?;
        let followed = Options {
            series_points,
            ..followed
        };
        let mut run = run_with(&self.recording, &followed, progress, releases, &found)?;
        run.report.capacity_inferred =
            self.setup.capacity.is_none() && self.readings()?.inferred_capacity.is_some();
        if let Mode::WhatIf(WhatIf {
            available: None, ..
        }) = mode
        {
            run.report.job_memory = self.job_memory()?;
        }
        Ok(run.report)
    }

    /// A check replay of the whole trace, without series.
    ///
    /// # Errors
    /// As [`Session::replay`].
    pub fn check(&self) -> Result<ReplayReport, ReplayError> {
        self.replay(&Mode::CHECK, 0, &mut |_, _| {})
    }

    /// The options of a replay in `mode`.
    fn options(&self, mode: &Mode) -> Result<Options, ReplayError> {
        let base = Options {
            device: self.setup.device,
            capacity: self.setup.capacity,
            order: self.setup.order,
            max_memory_bytes: self.setup.max_memory_bytes,
            costs: Arc::clone(&self.setup.costs),
            ..Options::default()
        };
        Ok(match mode {
            Mode::Check { plan } => Options {
                check: true,
                plan: plan.clone(),
                ..base
            },
            Mode::WhatIf(w) => Options {
                config: w.config.clone(),
                fresh_start: w.fresh_start,
                available: match w.available {
                    Some(available) => Some(available),
                    None => self.job_memory()?.map(|m| m.bytes()),
                },
                window: w.window.clone(),
                plan: w.plan.clone(),
                ..base
            },
        })
    }

    /// How the recording reads, found by check replays on first use.
    fn readings(&self) -> Result<&Readings, ReplayError> {
        if let Some(readings) = self.readings.get() {
            return Ok(readings);
        }
        let base = self.options(&Mode::CHECK)?;
        let found = Readings::of(&self.recording, &base)?;
        Ok(self.readings.get_or_init(|| found))
    }

    /// How the best-fit order was found (check replays run on first use).
    ///
    /// # Errors
    /// As [`Session::replay`].
    pub fn ordering(&self) -> Result<Option<&OrderingReport>, ReplayError> {
        Ok(self.readings()?.found.as_ref().map(|f| &f.report))
    }

    /// The device memory replays run on, and whether it is known (given, recorded, or
    /// inferred by the check replays from expandable reservations) rather than assumed
    /// ([`DEFAULT_CAPACITY`]).
    ///
    /// # Errors
    /// As [`Session::replay`] (the check replays may run to infer it).
    pub fn capacity(&self) -> Result<(u64, bool), ReplayError> {
        let given = self
            .setup
            .capacity
            .or(self.recording.simulated_device.map(|d| d.total_bytes))
            .map(|c| c.min(MAX_CAPACITY));
        Ok(match given.or(self.readings()?.inferred_capacity) {
            Some(known) => (known, true),
            None => (DEFAULT_CAPACITY, false),
        })
    }

    /// The memory the job had at its first OOM, where the trace has one: read after an exact
    /// replay to it, as `explain` reads it.
    ///
    /// # Errors
    /// As [`Session::replay`].
    pub fn job_memory(&self) -> Result<Option<JobMemory>, ReplayError> {
        if let Some(memory) = self.job_memory.get() {
            return Ok(*memory);
        }
        let events = self.events();
        let memory = match events.iter().position(|e| e.action == TraceAction::Oom) {
            None => None,
            Some(event) => {
                let (alloc, _) = self.state_after(event)?;
                Some(JobMemory {
                    event,
                    reserved: alloc.segment_infos().iter().map(|s| s.total_size).sum(),
                    device_free: events[event].addr,
                })
            }
        };
        Ok(*self.job_memory.get_or_init(|| memory))
    }

    /// The allocator as an exact (check) replay leaves it just after event `stop`: at an
    /// `oom` entry, the state the failing allocation left (its cache flushed), which is what
    /// PyTorch's own snapshot at the error shows. Also says where the replay first differed
    /// from the recording, if it did before `stop`.
    ///
    /// # Errors
    /// As [`Session::replay`].
    pub fn state_after(
        &self,
        stop: usize,
    ) -> Result<(CachingAllocator<SimDevice>, Option<Divergence>), ReplayError> {
        let mut cursor = self.cursor(&Mode::CHECK)?;
        cursor.seek(stop)?;
        Ok(cursor.into_parts())
    }

    /// A cursor before the first event, replaying in `mode` (series and fresh starts are not
    /// a cursor's business: ignored).
    ///
    /// # Errors
    /// As [`Session::replay`].
    pub fn cursor(&self, mode: &Mode) -> Result<Cursor<'_>, ReplayError> {
        let (options, releases, found) = self.following(mode)?;
        let options = Options {
            fresh_start: false,
            ..options
        };
        Cursor::new(&self.recording, options, releases, found)
    }

    /// A replay in `mode` that follows the readings (a what-if, or a cursor of either mode):
    /// its options on the device's memory (inferred where the readings had to), the release
    /// runs it follows (none in check mode, which finds its own) and its order.
    fn following(
        &self,
        mode: &Mode,
    ) -> Result<(Options, FxHashMap<usize, ReleaseReading>, Found), ReplayError> {
        let readings = self.readings()?;
        let options = Options {
            capacity: self.setup.capacity.or(readings.inferred_capacity),
            ..self.options(mode)?
        };
        let releases = if options.check {
            FxHashMap::default()
        } else {
            readings.releases_in_malloc.clone()
        };
        let found = readings.found_or(&options);
        Ok((options, releases, found))
    }
}
