//! A recording as `gpumem view` serves it: its devices and their moments of interest, the
//! timeline of a device under one or two configurations, the segment map at any event, the
//! explanation of an event, and the recording compared with a what-if at their peaks
//! (`diff`). Synchronous; the server calls it off its event loop.
//!
//! The recorded configuration is replayed as the fidelity check does (every address as
//! recorded); a what-if configuration follows the check's readings. One cursor per device
//! and configuration stays where the last map left it, so moving the slider forward replays
//! only the events in between (backward starts again). Requests for one cursor wait for each
//! other; those for other cursors, timelines and explanations do not (the caches are locked
//! only to look up and insert).
//!
//! # Invariants (budgets)
//! - A configuration string is at most [`MAX_CONFIG_BYTES`] and must parse; an event index
//!   must lie in the device's trace: anything else is a [`ViewError::BadRequest`].
//! - At most [`RecordingView::with_cursors`] cursors ([`MAX_CURSORS`] by default),
//!   [`MAX_TIMELINES`] timelines, [`MAX_EXPLANATIONS`] explanations and [`MAX_DIFFS`]
//!   comparisons are kept (the least
//!   recently used go first), and one session per device, so memory does not grow
//!   with requests; each replay's own state is held to the view's `--max-memory-bytes`
//!   (`Setup::max_memory_bytes`), a kept cursor's too.
//! - The browser gets down-sampled series ([`SERIES_POINTS`] a run) and one event's map at a
//!   time, never the recording.

use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;

use crate::AllocatorConfig;
use crate::allocator::size::format_size;
use crate::allocator::{TraceAction, TraceEntry};
use crate::diff::{Diff, RunSpec};
use crate::explain::block_stacks::BlockStacks;
use crate::explain::{
    ExplainError, Explanation, choose, event_of, explain_at, peak_reserved_event,
};
use crate::recording::Recording;
use crate::recording::frames::{ContextId, StackId};
use crate::replay::{Cursor, Mode, ReplayError, ReplayReport, Session, Setup, WhatIf};

use super::segments::{self, MAX_FRAMES, Provenance, SegmentMap};
use super::timeline::{self, Run};

/// Bytes of a what-if configuration string.
pub const MAX_CONFIG_BYTES: usize = 512;
/// Cursors kept (device × configuration).
pub const MAX_CURSORS: usize = 4;
/// Timelines kept.
pub const MAX_TIMELINES: usize = 16;
/// Explanations kept.
pub const MAX_EXPLANATIONS: usize = 32;
/// Comparisons with a what-if kept.
pub const MAX_DIFFS: usize = 8;
/// Points of a timeline run.
pub const SERIES_POINTS: usize = 1000;

/// Why a view request failed.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The request names something that is not there or does not parse.
    #[error("{0}")]
    BadRequest(String),
    /// The recording asked for is not kept (or no longer).
    #[error("{0}")]
    NotFound(String),
    /// The recording asked for could not be read again.
    #[error("{0}")]
    Unreadable(String),
    /// The replay could not run.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The explanation could not be made.
    #[error(transparent)]
    Explain(#[from] ExplainError),
    /// The exact replay differed from the recording before the event asked for: the state
    /// there would not be the recording's.
    #[error(
        "the replay differed from the recording at event {0}; `gpumem replay --check` shows where"
    )]
    Diverged(usize),
}

/// Where a request's recording comes from.
pub trait ViewSource: Send + Sync + 'static {
    /// The view of recording `id` (`None` where the routes name none), opened where needed:
    /// it may read a file, so it is called off the event loop, in a replay's turn.
    ///
    /// # Errors
    /// [`ViewError::NotFound`] for an unknown recording, or why it could not be opened.
    fn view(&self, id: Option<&str>) -> Result<Arc<RecordingView>, ViewError>;
}

/// `gpumem view`'s one recording.
impl ViewSource for Arc<RecordingView> {
    fn view(&self, _: Option<&str>) -> Result<Arc<RecordingView>, ViewError> {
        Ok(Arc::clone(self))
    }
}

/// A device of the recording, and its moments of interest.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceOverview {
    /// The device.
    pub device: u32,
    /// Events in its trace.
    pub events: usize,
    /// The `oom` entries' indices.
    pub ooms: Vec<usize>,
    /// The event after which reserved memory peaked.
    pub peak: Option<usize>,
}

/// The moment the page opens at: the one `gpumem explain` explains when given no device and
/// no moment (`explain::choose`).
#[derive(Clone, Debug, Serialize)]
pub struct FirstMoment {
    /// The device.
    pub device: u32,
    /// The event (0 for a device without a trace: the state the snapshot holds).
    pub event: usize,
    /// Why this device, where the recording names several.
    pub why: Option<String>,
}

/// What the page shows first.
#[derive(Clone, Debug, Serialize)]
pub struct Overview {
    /// The recording's file name.
    pub name: String,
    /// The configuration it was recorded under.
    pub config: String,
    /// Its devices with a trace.
    pub devices: Vec<DeviceOverview>,
    /// Where the page opens.
    pub first: Option<FirstMoment>,
}

type Key = (u32, Option<String>);
/// Values by key, the least recently used first; the lock is held only to look up and to
/// insert, never while a value is computed.
type Cache<K, V> = Mutex<Vec<(K, Arc<V>)>>;

self_cell::self_cell!(
    /// A replay cursor with the session it borrows, so that a view owns both.
    struct OwnedCursor {
        owner: Arc<Session>,
        #[covariant]
        dependent: Cursor,
    }
);

/// A recording being viewed.
pub struct RecordingView {
    recording: Arc<Recording>,
    name: String,
    /// What every replay of the view shares but the device: the device's memory (`None`: the
    /// recording's, else inferred, else 80 GiB), the best-fit order asked for (`None`: found
    /// in the recording) and the memory budget.
    setup: Setup,
    /// One session per device, found once: how its trace reads.
    sessions: Cache<u32, Session>,
    cursors: Cache<Key, Mutex<OwnedCursor>>,
    /// Cursors kept between requests.
    max_cursors: usize,
    timelines: Cache<Key, ReplayReport>,
    explanations: Cache<(u32, usize), Explanation>,
    diffs: Cache<Key, Diff>,
}

/// The value of `key`, moved to the back (the most recently used).
fn cached<K: PartialEq, V>(cache: &Cache<K, V>, key: &K) -> Option<Arc<V>> {
    let mut list = cache.lock().unwrap_or_else(PoisonError::into_inner);
    let at = list.iter().position(|(k, _)| k == key)?;
    let entry = list.remove(at);
    let value = Arc::clone(&entry.1);
    list.push(entry);
    Some(value)
}

/// Keeps `value` under `key` (or the value another request kept meanwhile), dropping the
/// least recently used beyond `max`; the value kept.
fn keep<K: PartialEq, V>(cache: &Cache<K, V>, key: K, value: Arc<V>, max: usize) -> Arc<V> {
    let mut list = cache.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, kept)) = list.iter().find(|(k, _)| *k == key) {
        return Arc::clone(kept);
    }
    list.push((key, Arc::clone(&value)));
    if list.len() > max {
        let excess = list.len() - max;
        list.drain(..excess);
    }
    value
}

impl RecordingView {
    /// A view of `recording`, named `name`, whose replays take `setup`'s memory, order and
    /// budget (on each device the recording has).
    pub fn new(recording: Arc<Recording>, name: String, setup: Setup) -> Self {
        RecordingView {
            recording,
            name,
            setup,
            sessions: Mutex::default(),
            cursors: Mutex::default(),
            max_cursors: MAX_CURSORS,
            timelines: Mutex::default(),
            explanations: Mutex::default(),
            diffs: Mutex::default(),
        }
    }

    /// The view keeping at most `max` cursors between requests (0: every segment map
    /// replays from the trace's start, and no replay state outlives its request).
    #[must_use]
    pub fn with_cursors(self, max: usize) -> Self {
        RecordingView {
            max_cursors: max,
            ..self
        }
    }

    /// The devices and their moments.
    pub fn overview(&self) -> Overview {
        let devices = self
            .recording
            .devices()
            .into_iter()
            .filter_map(|d| Some((d, self.trace(d)?)))
            .map(|(d, t)| DeviceOverview {
                device: d,
                events: t.len(),
                ooms: t
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.action == TraceAction::Oom)
                    .map(|(i, _)| i)
                    .collect(),
                peak: peak_reserved_event(t),
            })
            .collect();
        Overview {
            name: self.name.clone(),
            config: self
                .recording
                .config
                .as_ref()
                .map(|c| c.last_settings.clone())
                .unwrap_or_default(),
            devices,
            first: self.first(),
        }
    }

    /// Where the page opens: the moment `explain` would choose.
    fn first(&self) -> Option<FirstMoment> {
        let choice = choose(&self.recording, None, None)?;
        let trace = self.recording.trace(choice.device);
        Some(FirstMoment {
            device: choice.device,
            // A device without a trace has one moment, the snapshot: event 0 (its length).
            event: event_of(trace, choice.device, choice.at).unwrap_or(0),
            why: choice.device_why,
        })
    }

    /// `device`'s trace: empty for a device a snapshot without traces holds segments of
    /// (its one moment is the snapshot, event 0); `None` for a device it says nothing of.
    fn trace(&self, device: u32) -> Option<&[TraceEntry]> {
        let trace = self.recording.trace(device);
        let has_segments = self.recording.segments.iter().any(|s| s.device == device);
        (!trace.is_empty() || has_segments).then_some(trace)
    }

    fn events(&self, device: u32) -> Result<usize, ViewError> {
        self.trace(device).map(<[TraceEntry]>::len).ok_or_else(|| {
            ViewError::BadRequest(format!(
                "device {device} has neither a trace nor segments in this recording"
            ))
        })
    }

    fn event(&self, device: u32, event: usize) -> Result<usize, ViewError> {
        let events = self.events(device)?;
        // Without a trace, event 0 is the snapshot.
        if event < events.max(1) {
            Ok(event)
        } else {
            Err(ViewError::BadRequest(format!(
                "event {event} is outside device {device}'s trace of {events} events"
            )))
        }
    }

    /// The replay mode of `config`: `None` as recorded, checked; else a what-if under it.
    fn mode(config: Option<&str>) -> Result<Mode, ViewError> {
        match config {
            None => Ok(Mode::CHECK),
            Some(text) if text.len() > MAX_CONFIG_BYTES => Err(ViewError::BadRequest(format!(
                "a configuration is at most {MAX_CONFIG_BYTES} bytes"
            ))),
            Some(text) => {
                let config = AllocatorConfig::parse(text)
                    .map_err(|e| ViewError::BadRequest(format!("configuration: {e}")))?;
                Ok(Mode::WhatIf(WhatIf::default().under(Some(config))))
            }
        }
    }

    /// The session of `device` (made on first use; how its trace reads is found once).
    fn session(&self, device: u32) -> Result<Arc<Session>, ViewError> {
        if let Some(session) = cached(&self.sessions, &device) {
            return Ok(session);
        }
        let setup = self.setup.clone().on_device(device);
        let session = Arc::new(Session::new(Arc::clone(&self.recording), setup)?);
        Ok(keep(&self.sessions, device, session, usize::MAX))
    }

    fn run(&self, device: u32, config: Option<&str>) -> Result<Arc<ReplayReport>, ViewError> {
        let key: Key = (device, config.map(str::to_string));
        if let Some(r) = cached(&self.timelines, &key) {
            return Ok(r);
        }
        let mode = Self::mode(config)?;
        let report = self
            .session(device)?
            .replay(&mode, SERIES_POINTS, &mut |_, _| {})?;
        Ok(keep(&self.timelines, key, Arc::new(report), MAX_TIMELINES))
    }

    /// The timeline of `device` as recorded and, where given, under `what_if`, as SVG over
    /// events.
    ///
    /// # Errors
    /// [`ViewError`] for a device without a trace, a bad configuration or a replay failure.
    pub fn timeline(&self, device: u32, what_if: Option<&str>) -> Result<String, ViewError> {
        self.events(device)?;
        let recorded = self.run(device, None)?;
        let other = what_if.map(|c| self.run(device, Some(c))).transpose()?;
        let recorded_name = match recorded.config.as_str() {
            "(default)" => "as recorded".to_string(),
            config => format!("as recorded: {config}"),
        };
        // A what-if of a recording with an OOM ran within what the job had there: its name
        // says so.
        let other_name =
            other
                .as_ref()
                .zip(what_if)
                .map(|(report, config)| match report.job_memory {
                    Some(m) => format!(
                        "{config}, within the {} the job had at its OOM",
                        format_size(m.bytes())
                    ),
                    None => config.to_string(),
                });
        let mut runs = vec![Run {
            name: &recorded_name,
            points: &recorded.series,
        }];
        if let (Some(report), Some(name)) = (&other, &other_name) {
            runs.push(Run {
                name,
                points: &report.series,
            });
        }
        Ok(timeline::svg_by_event(
            &format!("{}, device {device}", self.name),
            &runs,
        ))
    }

    /// The segment map of `device` just after `event`, as recorded or under `what_if`.
    ///
    /// # Errors
    /// As [`RecordingView::timeline`], and for an event outside the trace.
    pub fn segments(
        &self,
        device: u32,
        event: usize,
        what_if: Option<&str>,
    ) -> Result<SegmentMap, ViewError> {
        let event = self.event(device, event)?;
        let key: Key = (device, what_if.map(str::to_string));
        let mode = Self::mode(what_if)?;
        let cursor = match cached(&self.cursors, &key) {
            Some(cursor) => cursor,
            None => {
                let cursor = self.cursor(device, &mode)?;
                keep(
                    &self.cursors,
                    key,
                    Arc::new(Mutex::new(cursor)),
                    self.max_cursors,
                )
            }
        };
        // Only this cursor's requests wait for its replay.
        let mut cursor = match cursor.lock() {
            Ok(guard) => guard,
            Err(poisoned) => {
                // A replay that panicked midway left the cursor anywhere: start it again.
                let mut guard = poisoned.into_inner();
                *guard = self.cursor(device, &mode)?;
                cursor.clear_poison();
                guard
            }
        };
        let segments = cursor.with_dependent_mut(|_, cursor| {
            cursor.seek(event)?;
            if let Some(d) = cursor.divergence().filter(|d| d.index <= event) {
                return Err(ViewError::Diverged(d.index));
            }
            // Read without recording a `snapshot` entry: the check compares the core's own
            // trace.
            Ok(cursor.allocator().segment_infos())
        })?;
        // A what-if replay places blocks at its own addresses: the recording's stacks are
        // named by the recorded ones.
        let stacks = what_if
            .is_none()
            .then(|| RecordedStacks::new(&self.recording, device, event));
        let provenance = stacks.as_ref().map(|s| s as &dyn Provenance);
        Ok(segments::map(&segments, device, Some(event), provenance))
    }

    /// A cursor before the first event of `device`, replaying in `mode`.
    fn cursor(&self, device: u32, mode: &Mode) -> Result<OwnedCursor, ViewError> {
        Ok(OwnedCursor::try_new(self.session(device)?, |session| {
            session.cursor(mode)
        })?)
    }

    /// The explanation of `device`'s event `event`.
    ///
    /// # Errors
    /// As [`RecordingView::segments`].
    pub fn explain(&self, device: u32, event: usize) -> Result<Arc<Explanation>, ViewError> {
        let event = self.event(device, event)?;
        if let Some(e) = cached(&self.explanations, &(device, event)) {
            return Ok(e);
        }
        // The device's session: the same memory and order as `explain` uses.
        let e = Arc::new(explain_at(&*self.session(device)?, event)?);
        Ok(keep(
            &self.explanations,
            (device, event),
            e,
            MAX_EXPLANATIONS,
        ))
    }

    /// `device`'s recording compared with its what-if under `config`, each at its peak
    /// (`gpumem diff --config`).
    ///
    /// # Errors
    /// [`ViewError`] for a device without a trace, a missing or bad configuration or a replay
    /// failure.
    pub fn diff(&self, device: u32, config: Option<&str>) -> Result<Arc<Diff>, ViewError> {
        self.events(device)?;
        let Some(text) = config else {
            return Err(ViewError::BadRequest(
                "a comparison needs a what-if configuration (config=…)".into(),
            ));
        };
        let key: Key = (device, Some(text.to_string()));
        if let Some(d) = cached(&self.diffs, &key) {
            return Ok(d);
        }
        let mode = Self::mode(config)?;
        let session = self.session(device)?;
        let recorded = RunSpec {
            name: self.name.clone(),
            session: &session,
            mode: Mode::CHECK,
        };
        let what_if = RunSpec {
            name: format!("{} ({text})", self.name),
            session: &session,
            mode,
        };
        let d = Arc::new(crate::diff::diff(&recorded, &what_if)?);
        Ok(keep(&self.diffs, key, d, MAX_DIFFS))
    }
}

/// The stacks that allocated the blocks live just after an event of a recording, for the
/// segment map (a key packs the stack's and the context's ids).
struct RecordedStacks<'a> {
    recording: &'a Recording,
    stacks: BlockStacks,
}

impl<'a> RecordedStacks<'a> {
    fn new(recording: &'a Recording, device: u32, event: usize) -> RecordedStacks<'a> {
        let trace = recording.trace(device);
        let events = &trace[..(event + 1).min(trace.len())];
        let stacks = BlockStacks::new(recording, device as usize, events);
        RecordedStacks { recording, stacks }
    }
}

impl Provenance for RecordedStacks<'_> {
    fn key_of(&self, address: u64) -> Option<u64> {
        let (stack, context) = (self.stacks.of(address), self.stacks.context_of(address));
        if self.recording.frames.frames_of(stack).is_empty() && context == ContextId::NONE {
            return None;
        }
        Some(u64::from(stack.0) << 32 | u64::from(context.0))
    }

    fn describe(&self, key: u64) -> Vec<String> {
        let (stack, context) = (StackId((key >> 32) as u32), ContextId(key as u32));
        let frames = &self.recording.frames;
        let mut lines = frames.describe_context(context, MAX_FRAMES);
        let stack = frames.frames_of(stack).iter().take(MAX_FRAMES);
        lines.extend(stack.map(|&id| frames.describe(id)));
        lines
    }
}
