//! Why an allocation failed: the request, where the device's memory was at that moment,
//! which of those places kept the request from fitting, what pins the free memory (by the
//! recording's frames), which settings would have avoided it, from an exact replay of the
//! recording and what-if replays within the memory the job had, and whether memory grows
//! every iteration (`growth`): the cause that dominates (`Cause`).
//!
//! The replay stops just after the recording's `oom` entry (or after a chosen event), so the
//! allocator holds what PyTorch's held at the error, its cache already flushed. The memory
//! the job had is its reserved bytes plus the `oom` entry's `device_free`; the device's total
//! is the replay's capacity (`--capacity`, else the recording's device, else inferred from
//! expandable reservations), and what neither accounts for sat outside the allocator. Where
//! the total is only assumed (80 GiB), memory outside the allocator is unknown.
//!
//! Frees waiting on other streams' events are part of the breakdown, but rarely of an OOM's:
//! before failing, the allocator (as PyTorch's) synchronizes those events and frees the
//! blocks, so at an `oom` entry they are usually gone.
//!
//! # Invariants
//! - The breakdown adds up: requested, rounding, fragmented, other streams, other pools and
//!   pending stream frees make the reserved memory, and with free and outside the allocator
//!   (where the `oom` entry says how much was free) the device's total.
//! - Every figure of the moment is read from the replayed allocator's own snapshot; the
//!   growth's figures are read from the trace's allocations and frees up to the moment, and
//!   only its `fills_at_iteration` is a prediction (a linear one, `growth`).
//! - Candidate settings are tried only where one could help (the job had room for live
//!   tensors and the request beside what private pools (other than the request's) kept
//!   cached), each over the whole trace within the memory the job had, so a
//!   candidate without OOMs is one `gpumem replay --available --config` confirms.

pub(crate) mod block_stacks;
pub mod growth;
pub mod moment;
pub mod site;
pub mod text;

use serde::Serialize;

use crate::allocator::breakdown::{self, Accounting};
pub use crate::allocator::breakdown::{Breakdown, Kind};
use crate::allocator::size::{PoolKind, round_size};
use crate::allocator::{BlockState, PoolId, TraceAction};
use crate::device::StreamId;

pub use growth::{Growth, KeptGroup};
pub use moment::{At, Choice, choose, peak_reserved_event};

use crate::recording::Recording;
use crate::replay::{Divergence, Mode, OrderingReport, ReplayError, Session, WhatIf};

/// The failing (or, at another event, the last) request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Request {
    /// Index of the event in the device's trace (the trace's length at the snapshot).
    pub event: usize,
    /// No request was recorded up to this moment (a snapshot without a trace): this one is
    /// the smallest large request that the cached blocks of the stream holding the most
    /// memory could not serve, the first that would need the driver.
    pub hypothetical: bool,
    /// Bytes asked for.
    pub bytes: u64,
    /// Its rounded size, the pool that serves it (`"small"` or `"large"`) and its stream, as
    /// the accounting reads them (`rounded`, `pool` and `stream` in the JSON).
    #[serde(flatten)]
    pub wanted: breakdown::Request,
    /// The pool it went to: the default `(0, 0)`, or the private pool it was routed to (as
    /// recorded, or inferred: Note [Inferred pools]).
    pub pool_id: PoolId,
    /// What the recording says of the request beside its stack: its compile context, user
    /// metadata and forward frames, one line each (empty where it says nothing).
    pub context: Vec<String>,
}

/// The explanation of one moment of a recording.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    /// The device.
    pub device: u32,
    /// Why this device and moment, where they were chosen for the user
    /// ([`moment::choose`]): which device of several, or why not an OOM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chosen: Option<String>,
    /// The request at that moment.
    pub request: Request,
    /// The device's memory.
    pub total: u64,
    /// Whether `total` is known (given, recorded or inferred), not assumed: only then is
    /// memory outside the allocator known.
    pub total_known: bool,
    /// Reserved by the allocator.
    pub reserved: u64,
    /// Allocated by the allocator (requested plus rounding).
    pub allocated: u64,
    /// What the job had: reserved plus the device's free bytes (where recorded).
    pub available: Option<u64>,
    /// The largest cached free block the request could have used (its pool and stream).
    pub largest_free_block: u64,
    /// Segments of the request's pool and stream that hold free memory.
    pub segments_with_free: usize,
    /// Where the memory was.
    pub breakdown: Breakdown,
    /// Which part kept the request from fitting, most to blame first.
    pub kinds: Vec<Kind>,
    /// The explanation in one sentence.
    pub sentence: String,
    /// What pins the free memory: the live blocks in segments that hold free space, grouped
    /// by where they were allocated, the groups keeping the most free bytes first (at most
    /// [`PIN_GROUPS`]).
    pub pinning: Vec<PinGroup>,
    /// Where the replay first differed from the recording, if it did (the figures are then
    /// not the recording's).
    pub divergence: Option<Divergence>,
    /// The best-fit order replayed under and how it was found.
    pub ordering: Option<OrderingReport>,
    /// The private pools (CUDA graphs, MemPools) holding memory at that moment, most
    /// reserved first.
    pub private_pools: Vec<PrivatePool>,
    /// At an OOM that a setting might avoid: each candidate configuration, replayed over the
    /// whole trace within the memory the job had, those with no OOM first (least peak
    /// reserved first). Empty where no setting can help: live tensors and the request
    /// exceed what the job had, or the room was held outside the allocator or cached in
    /// private pools.
    pub candidates: Vec<Candidate>,
    /// The repeating iterations up to the moment and what each keeps past its end, where
    /// iterations repeat (`explain::growth`).
    pub growth: Option<Growth>,
    /// What dominates at the moment, where one thing does.
    pub cause: Option<Cause>,
    /// The cause in one sentence (empty where there is none).
    pub cause_sentence: String,
}

/// What dominates an OOM (or, at another moment, what the memory does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// A setting avoids the OOM: the memory was there, in pieces the request did not fit.
    Fragmentation,
    /// No setting avoids it, and the iterations keep memory past their ends that makes a
    /// tenth or more of what is live: the program must free what it keeps.
    Growth,
    /// No setting avoids it and nothing grows: what one moment needs exceeds what the job had.
    WorkingSet,
}

/// A private pool's memory at the moment explained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PrivatePool {
    /// Its id.
    pub id: PoolId,
    /// `graph`: a capture's own pool `(capture id, 0)`; `mem_pool`: `(0, id)`, a
    /// `torch.cuda.MemPool` or a `graph_pool_handle()` that captures share.
    pub kind: &'static str,
    /// Its segments (mapped runs of expandable ones).
    pub segments: usize,
    /// Their bytes.
    pub reserved: u64,
    /// Bytes cached free in them: no other pool's requests can use them, and `empty_cache()`
    /// frees them only once the pool's owner (the graph, the MemPool) is released, which a
    /// recording does not show.
    pub free: u64,
}

/// The private pools holding memory in `snapshot` on `device`, most reserved first.
fn private_pools(snapshot: &crate::allocator::Snapshot, device: u32) -> Vec<PrivatePool> {
    let mut pools: rustc_hash::FxHashMap<PoolId, PrivatePool> = Default::default();
    for s in snapshot.segments.iter() {
        if s.device != device || s.segment_pool_id.is_default() {
            continue;
        }
        let id = s.segment_pool_id;
        let pool = pools.entry(id).or_insert(PrivatePool {
            id,
            kind: if id.0 != 0 { "graph" } else { "mem_pool" },
            segments: 0,
            reserved: 0,
            free: 0,
        });
        pool.segments += 1;
        pool.reserved += s.total_size;
        pool.free += s
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::Inactive)
            .map(|b| b.size)
            .sum::<u64>();
    }
    let mut pools: Vec<PrivatePool> = pools.into_values().collect();
    pools.sort_by_key(|p| (std::cmp::Reverse(p.reserved), p.id));
    pools
}

/// A configuration tried against the recording.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Candidate {
    /// In `PYTORCH_CUDA_ALLOC_CONF` syntax.
    pub config: String,
    /// Out-of-memory errors replaying the whole trace under it, within the memory the job had.
    pub ooms: u64,
    /// Its peak reserved bytes.
    pub peak_reserved: u64,
}

/// The single settings tried: those that change how memory is split, merged and rounded.
/// `garbage_collection_threshold` is tried too where the recording has a memory fraction
/// ([`GC_CANDIDATES`]): PyTorch collects garbage only under one.
pub const CANDIDATES: &[&str] = &[
    "expandable_segments:True",
    "max_split_size_mb:32",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "max_split_size_mb:1024",
    "roundup_power2_divisions:2",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:8",
    "roundup_power2_divisions:16",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
];

/// Garbage-collection thresholds tried under a memory fraction.
pub const GC_CANDIDATES: &[&str] = &[
    "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:0.8",
];

/// How many of the best single settings (of different keys) are combined, in pairs and all
/// together.
pub const COMBINED: usize = 3;

/// The most pinning groups an explanation lists.
pub const PIN_GROUPS: usize = 10;

/// Live blocks allocated at one place in the program (their stacks' innermost own frame), in
/// segments that hold free space: while they live, those segments can be neither released
/// nor merged into larger free blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PinGroup {
    /// The stack's site (`site`): its innermost frame in the program's own code (a Python
    /// file outside torch), else its innermost Python frame, as `file:line in function` with
    /// the path normalised; for C++ frames only, the autograd node and operator; "(no stack
    /// recorded)" for blocks whose allocation the recording did not keep.
    pub frame: String,
    /// The frames of the first such block's stack, innermost first, as `file:line in
    /// function` (at most 8).
    pub frames: Vec<String>,
    /// Its live blocks in those segments.
    pub blocks: usize,
    /// Their bytes.
    pub live_bytes: u64,
    /// Free bytes of the segments they sit in (each segment counted once for the group).
    pub pinned_free_bytes: u64,
    /// The context of the first such block's allocation (compile context, user metadata,
    /// forward frames), one line each: which torch.compile graph or phase allocated it.
    pub context: Vec<String>,
}

/// Forward frames listed of a context.
const CONTEXT_FORWARD_FRAMES: usize = 8;

/// Why an explanation could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExplainError {
    /// The replay could not run.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// A candidate configuration does not parse (a defect of [`CANDIDATES`]).
    #[error("candidate configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    /// The recording has no `oom` entry.
    #[error("device {device}'s trace has no out-of-memory event; choose one with --at EVENT")]
    NoOom {
        /// The device.
        device: u32,
    },
    /// The event index is outside the trace.
    #[error("event {event} is outside device {device}'s trace of {events} events")]
    NoSuchEvent {
        /// The device.
        device: u32,
        /// The index asked for.
        event: usize,
        /// Events in the trace.
        events: usize,
    },
}

/// Explains `at` on the session's device (the session's memory, order and budget hold for
/// every replay it runs).
///
/// # Errors
/// [`ExplainError`] when there is nothing to explain or the replay cannot run.
pub fn explain(session: &Session, at: At) -> Result<Explanation, ExplainError> {
    explain_at(session, event_of(session.events(), session.device(), at)?)
}

/// The index of `at` in `device`'s trace `events` (its length for the state at the
/// snapshot).
///
/// # Errors
/// [`ExplainError::NoOom`] or [`ExplainError::NoSuchEvent`] when the trace has no such moment.
pub fn event_of(
    events: &[crate::allocator::TraceEntry],
    device: u32,
    at: At,
) -> Result<usize, ExplainError> {
    match at {
        At::FirstOom => events
            .iter()
            .position(|e| e.action == TraceAction::Oom)
            .ok_or(ExplainError::NoOom { device }),
        At::PeakReserved => peak_reserved_event(events).ok_or(ExplainError::NoSuchEvent {
            device,
            event: 0,
            events: 0,
        }),
        At::Event(i) if i < events.len() => Ok(i),
        At::Snapshot => Ok(events.len()),
        At::Event(event) => Err(ExplainError::NoSuchEvent {
            device,
            event,
            events: events.len(),
        }),
    }
}

/// Explains event `event` (which must be in the trace, or the trace's length for the state
/// at the snapshot) on the session's device, as [`explain`] does.
///
/// # Errors
/// [`ExplainError`] when the replay cannot run.
pub fn explain_at(session: &Session, event: usize) -> Result<Explanation, ExplainError> {
    let recording = session.recording();
    let device = session.device();
    let events = session.events();
    // The device's size: given or recorded, else as the check replays that found how the
    // recording reads settled it (inferred from expandable reservations where they could be,
    // else assumed).
    let (total, total_known) = session.capacity()?;
    let (mut alloc, divergence) = session.state_after(event)?;
    let config = alloc.config().clone();
    let entry = events.get(event).copied();
    let snapshot = alloc.snapshot();
    let upto = &events[..event.saturating_add(1).min(events.len())];
    let request = request_at(recording, device, events, event, &snapshot, &config);
    let wanted = request.wanted;
    let rounded = wanted.rounded;
    let mut accounting = Accounting::default();
    for segment in snapshot.segments.iter().filter(|s| s.device == device) {
        let blocks = segment
            .blocks
            .iter()
            .map(|b| (b.size, b.requested_size, b.state));
        let own_pool = segment.segment_pool_id == request.pool_id;
        accounting.add_segment(
            wanted,
            segment.stream,
            segment.segment_type,
            own_pool,
            blocks,
        );
    }
    let pinning = pinning(recording, device as usize, upto, &snapshot);
    let free = entry
        .filter(|e| e.action == TraceAction::Oom)
        .map(|e| e.addr);
    accounting.finish(free, total_known.then_some(total));
    let available = accounting.available();
    let kinds = accounting.kinds(wanted, total_known.then_some(total));
    let candidates = match available {
        // No setting reaches memory outside the allocator, nor a private pool's cache: a
        // setting can help only where the request fits beside live tensors without it.
        Some(available)
            if !matches!(kinds[0], Kind::TooBig | Kind::OutsideAllocator)
                && live_and_request(&accounting, rounded)
                    <= available.saturating_sub(accounting.breakdown.other_pools) =>
        {
            search_configurations(session, &WhatIf::default().within(Some(available)))?
        }
        _ => Vec::new(),
    };
    let sentence = accounting.sentence(wanted, kinds[0]);
    let at_oom = entry.is_some_and(|e| e.action == TraceAction::Oom);
    let memory = available.or(total_known.then_some(total));
    let growth = growth::growth(
        recording,
        device as usize,
        events,
        event,
        accounting.allocated,
        memory,
        &config,
    );
    let live = accounting.breakdown.requested + accounting.breakdown.rounding;
    let (cause, cause_sentence) = cause(
        at_oom,
        &candidates,
        growth.as_ref(),
        live,
        available.filter(|&a| live_and_request(&accounting, rounded) > a),
    );
    let Accounting {
        breakdown,
        reserved,
        allocated,
        largest_free_block,
        segments_with_free,
    } = accounting;
    Ok(Explanation {
        device,
        chosen: None,
        request,
        total,
        total_known,
        reserved,
        allocated,
        available,
        largest_free_block,
        segments_with_free,
        breakdown,
        kinds,
        sentence,
        pinning,
        divergence,
        ordering: session.ordering()?.cloned(),
        private_pools: private_pools(&snapshot, device),
        candidates,
        growth,
        cause,
        cause_sentence,
    })
}

/// What dominates, and its sentence: at an OOM, fragmentation where a candidate setting
/// avoids it, else growth where the iterations keep a tenth or more of what is `live`, else a
/// working set larger than the job had (`short_of`: what it had, where live tensors and the
/// request exceed it); at another moment, growth where the iterations keep memory.
fn cause(
    at_oom: bool,
    candidates: &[Candidate],
    growth: Option<&Growth>,
    live: u64,
    short_of: Option<u64>,
) -> (Option<Cause>, String) {
    use crate::allocator::size::format_size as f;
    let grows = growth.filter(|g| g.grows() && g.kept_bytes.saturating_mul(10) >= live);
    let fills = |g: &Growth| match (g.fills_at_iteration, g.fills_bytes) {
        (Some(k), Some(memory)) => {
            format!("; at that rate the {} fill in iteration {k}", f(memory))
        }
        _ => String::new(),
    };
    if let Some(avoids) = candidates.iter().find(|c| c.ooms == 0).filter(|_| at_oom) {
        let also = grows.map_or_else(String::new, |g| {
            format!(
                " The iterations also keep {} each past their ends{}.",
                f(g.kept_per_iteration),
                fills(g)
            )
        });
        let sentence = format!(
            "Fragmentation: {} avoids this OOM (the whole trace replayed under it, within the memory the job had).{also}",
            avoids.config
        );
        return (Some(Cause::Fragmentation), sentence);
    }
    if let Some(g) = grows {
        let from = g
            .kept_at
            .first()
            .map_or_else(String::new, |k| format!(", the most from {}", k.frame));
        let setting = if at_oom {
            " No allocator setting avoids that:"
        } else {
            ""
        };
        let sentence = format!(
            "Memory grows: each of {} iterations ({} allocations) kept {} ({} allocations) past its end{from}, {} of the {} live now{}.{setting} free what each iteration keeps, or keep less of it (outputs held with their graph, losses summed as tensors, caches that only grow; activations kept for the backward pass: activation checkpointing).",
            g.iterations,
            g.allocations_per_iteration,
            f(g.kept_per_iteration),
            g.kept_allocations_per_iteration,
            f(g.kept_bytes),
            f(live),
            fills(g),
        );
        return (Some(Cause::Growth), sentence);
    }
    match short_of.filter(|_| at_oom) {
        Some(had) => (
            Some(Cause::WorkingSet),
            format!(
                "The working set is larger than the {} the job had, and no iteration keeps memory that grows: fewer tensors live at once (a smaller batch, activation checkpointing, sharding) or a larger device.",
                f(had)
            ),
        ),
        None => (None, String::new()),
    }
}

/// The bytes live tensors hold (rounded) and the request needs.
fn live_and_request(accounting: &Accounting, rounded: u64) -> u64 {
    let b = &accounting.breakdown;
    b.requested + b.rounding + rounded
}

/// The request of the moment after `event`: at an OOM the failing one, at another event the
/// last allocation up to it, where there is none a hypothetical one.
fn request_at(
    recording: &Recording,
    device: u32,
    events: &[crate::allocator::TraceEntry],
    event: usize,
    snapshot: &crate::allocator::Snapshot,
    config: &crate::AllocatorConfig,
) -> Request {
    let upto = &events[..event.saturating_add(1).min(events.len())];
    let asked = upto
        .iter()
        .rposition(|e| matches!(e.action, TraceAction::Oom | TraceAction::Alloc));
    let Some(i) = asked else {
        return first_uncached_request(snapshot, config, device, event);
    };
    let e = events[i];
    let rounded = round_size(config, e.size);
    let context = recording
        .event_contexts
        .get(device as usize)
        .and_then(|c| c.get(i))
        .map_or_else(Vec::new, |&c| {
            recording.frames.describe_context(c, CONTEXT_FORWARD_FRAMES)
        });
    Request {
        event,
        hypothetical: false,
        bytes: e.size,
        wanted: breakdown::Request {
            rounded,
            pool: PoolKind::for_size(rounded),
            stream: e.stream,
        },
        pool_id: e.pool,
        context,
    }
}

/// The request of a moment without one (see [`Request::hypothetical`]): on the stream whose
/// segments hold the most, the smallest large request no cached block of its large pool
/// serves.
fn first_uncached_request(
    snapshot: &crate::allocator::Snapshot,
    config: &crate::AllocatorConfig,
    device: u32,
    event: usize,
) -> Request {
    let mut by_stream: rustc_hash::FxHashMap<StreamId, (u64, u64)> = Default::default();
    // A default request: a private pool's segments are not its to use.
    let default_pool =
        |s: &&crate::allocator::SegmentInfo| s.device == device && s.segment_pool_id.is_default();
    for segment in snapshot.segments.iter().filter(default_pool) {
        let (held, largest) = by_stream.entry(segment.stream).or_default();
        *held += segment.total_size;
        if segment.segment_type == PoolKind::Large {
            let free = segment
                .blocks
                .iter()
                .filter(|b| b.state == BlockState::Inactive);
            *largest = free.map(|b| b.size).fold(*largest, u64::max);
        }
    }
    let (stream, (_, largest)) = by_stream
        .into_iter()
        .max_by_key(|&(stream, (held, _))| (held, std::cmp::Reverse(stream)))
        .unwrap_or_default();
    // Above the small pool's sizes, and past the largest cached block.
    let bytes = largest.max(crate::allocator::size::SMALL_SIZE) + 1;
    let rounded = round_size(config, bytes);
    Request {
        event,
        hypothetical: true,
        bytes,
        wanted: breakdown::Request {
            rounded,
            pool: PoolKind::Large,
            stream,
        },
        pool_id: PoolId::DEFAULT,
        context: Vec::new(),
    }
}

/// The configuration search of an explanation: the whole trace replayed under each of
/// [`CANDIDATES`] (and [`GC_CANDIDATES`] where the recording has a memory fraction), then
/// under combinations of the [`COMBINED`] best of different keys, each a what-if of the
/// session like `base` (what the allocator may have, the window) under the candidate's
/// configuration: the candidates with the fewest OOMs and the least peak reserved first.
///
/// # Errors
/// An [`ExplainError`] when a replay cannot run.
pub fn search_configurations(
    session: &Session,
    base: &WhatIf,
) -> Result<Vec<Candidate>, ExplainError> {
    let recording = session.recording();
    let try_one = |conf: &str| -> Result<Candidate, ExplainError> {
        let what_if = base
            .clone()
            .under(Some(crate::AllocatorConfig::parse(conf)?));
        let report = session.replay(&Mode::WhatIf(what_if), 0, &mut |_, _| {})?;
        Ok(Candidate {
            config: conf.to_string(),
            ooms: report.ooms,
            peak_reserved: report.peak_reserved,
        })
    };
    let fraction = recording
        .simulated_device
        .and_then(|d| d.memory_fraction)
        .is_some_and(|f| f < 1.0);
    let singles: Vec<&str> = CANDIDATES
        .iter()
        .chain(GC_CANDIDATES.iter().filter(|_| fraction))
        .copied()
        .collect();
    let mut tried = singles
        .iter()
        .map(|conf| try_one(conf))
        .collect::<Result<Vec<_>, _>>()?;
    tried.sort_by_key(|c| (c.ooms, c.peak_reserved));
    // The best of each key, the best keys first.
    let key = |conf: &str| conf.split(':').next().unwrap_or_default().to_string();
    let mut best: Vec<&Candidate> = Vec::new();
    for c in &tried {
        if best.len() < COMBINED && best.iter().all(|b| key(&b.config) != key(&c.config)) {
            best.push(c);
        }
    }
    let mut combos: Vec<String> = Vec::new();
    for (i, a) in best.iter().enumerate() {
        for b in &best[i + 1..] {
            combos.push(format!("{},{}", a.config, b.config));
        }
    }
    if best.len() > 2 {
        let all: Vec<&str> = best.iter().map(|c| c.config.as_str()).collect();
        combos.push(all.join(","));
    }
    for conf in combos {
        tried.push(try_one(&conf)?);
    }
    tried.sort_by_key(|c| (c.ooms, c.peak_reserved));
    Ok(tried)
}

/// The pinning groups (see [`PinGroup`]) of the replayed state after `events`.
fn pinning(
    recording: &Recording,
    device: usize,
    events: &[crate::allocator::TraceEntry],
    snapshot: &crate::allocator::Snapshot,
) -> Vec<PinGroup> {
    use rustc_hash::FxHashMap;

    let stacks = block_stacks::BlockStacks::new(recording, device, events);
    // Grouped by the frame they are named by (stacks that differ only below it are one).
    let mut groups: FxHashMap<String, PinGroup> = FxHashMap::default();
    for segment in snapshot
        .segments
        .iter()
        .filter(|s| s.device as usize == device)
    {
        let free: u64 = segment
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::Inactive)
            .map(|b| b.size)
            .sum();
        if free == 0 {
            continue;
        }
        let mut counted = rustc_hash::FxHashSet::default();
        for block in segment
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
        {
            let named = group_of(recording, stacks.of(block.address));
            let key = named.frame.clone();
            // The group's context is its first block's, described once.
            let group = groups.entry(key.clone()).or_insert_with(|| PinGroup {
                context: recording
                    .frames
                    .describe_context(stacks.context_of(block.address), CONTEXT_FORWARD_FRAMES),
                ..named
            });
            group.blocks += 1;
            group.live_bytes += block.size;
            if counted.insert(key) {
                group.pinned_free_bytes += free;
            }
        }
    }
    let mut groups: Vec<PinGroup> = groups.into_values().collect();
    groups.sort_by(|a, b| {
        (b.pinned_free_bytes, b.live_bytes, &a.frame).cmp(&(
            a.pinned_free_bytes,
            a.live_bytes,
            &b.frame,
        ))
    });
    groups.truncate(PIN_GROUPS);
    groups
}

/// An empty group for `stack`, named by its frames.
fn group_of(recording: &Recording, stack: crate::recording::frames::StackId) -> PinGroup {
    PinGroup {
        frame: site::site_of(recording, stack),
        frames: site::example_frames(recording, stack),
        blocks: 0,
        live_bytes: 0,
        pinned_free_bytes: 0,
        context: Vec::new(),
    }
}
