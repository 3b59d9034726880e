//! Two runs compared (`gpumem diff A B`): why B peaks higher, or lower, than A. A run is a
//! recording replayed exactly, or a what-if of one under another configuration, each under
//! its own best-fit order (found from it) and on its own device's memory.
//!
//! Each run is read at its peak: the first moment its replay reserves the most, at the
//! trace's start (what the recording held when its trace began) or after an event.
//! There, the memory its live tensors hold (their blocks, rounding included: a what-if that
//! rounds otherwise differs there) is grouped by site (`explain::site`: the program's
//! own line, else torch's Python line, else the autograd node and operator) and set beside
//! the other run's; a site's file matches across the runs where the two differ only in the
//! directories above it (`files`). The parts of each run's reserved memory are set side by
//! side: what live tensors asked for and their rounding, and what the allocator holds beside
//! them (cached free memory, other streams' and private pools' caches, frees waiting on other
//! streams); and, where a run repeats iterations (the job's profiler steps, else the
//! repeating sequence found), each iteration's peaks and what it keeps past its end.
//!
//! # Invariants
//! - The difference adds up: the sites' differences (live blocks' bytes) plus the
//!   differences of the cached and pending parts are B's reserved bytes at its peak minus A's
//!   at its own ([`Diff::reserved_difference`]); the sites' requested bytes add up to the
//!   breakdown's `requested`.
//! - No live block is left out: one whose stack the recording did not keep is grouped with
//!   those of exactly its requested size.
//! - Peaks are read between the replay's operations (a rise and fall within one, which no
//!   recorded operation makes, would not be seen); an exact replay is read up to where it
//!   first differs from the recording, and no further.
//! - Sites are listed by the size of their difference, the largest first, then by the larger
//!   of their two figures and by name; [`Diff::top_share`] is the share of the sum of every
//!   site's absolute difference that the first [`TOP_SITES`] carry.
//! - A run's cached parts are read as for a request larger than any cached block on the stream
//!   holding the most of the default pool (its main stream): `breakdown.fragmented` is all
//!   the memory cached free on that stream, `breakdown.other_pools` the private pools'.
//!
//! # Budgets
//! - Each run is replayed twice beyond its session's own replays (the check replays that
//!   find how the recording reads; for a what-if of a recording with an OOM, the replay to
//!   it that finds the memory the job had): one pass through the trace for its peaks,
//!   operation by operation, and one to its peak. Each replay's state is held to the
//!   session's memory budget, checked every few thousand events.
//! - Beside it a run holds one entry per distinct site (at most [`MAX_DISTINCT_SITES`], each
//!   part of a site's name at most `site::MAX_SITE_PART_BYTES`), the trace's allocations
//!   twice (a few words each, as `explain`'s growth holds them) and one entry per iteration;
//!   finding the iterations makes at most `iterations::SCAN_WORK` comparisons.
//! - At most [`MAX_SITES`] sites are listed (the others summed in [`Diff::rest`]), their
//!   stacks alone described, and [`MAX_ITERATIONS`] iterations per run; files are matched
//!   within `files`' budget.

mod files;
pub mod text;

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::allocator::breakdown::{Accounting, Breakdown, Part, Request};
use crate::allocator::size::{PoolKind, format_size};
use crate::allocator::{BlockState, TraceEntry};
use crate::explain::block_stacks::BlockStacks;
use crate::explain::site::{NO_STACK, Site, example_frames, site};
use crate::iterations::{IterationSource, allocations};
use crate::recording::frames::StackId;
use crate::replay::{Divergence, Mode, ReplayError, Session};

/// The sites whose differences [`Diff::top_share`] measures.
pub const TOP_SITES: usize = 10;
/// The most sites listed; the others are summed in [`Diff::rest`].
pub const MAX_SITES: usize = 200;
/// The most iterations listed per run.
pub const MAX_ITERATIONS: usize = 64;
/// The most distinct sites a run's live tensors are grouped by; the blocks of any further
/// site are summed as [`MORE_SITES`].
pub const MAX_DISTINCT_SITES: usize = 1 << 16;
/// The site of the blocks past [`MAX_DISTINCT_SITES`].
pub const MORE_SITES: &str = "(more sites than gpumem keeps apart)";

/// One run to compare: a session on a recording's device and how to replay it.
pub struct RunSpec<'a> {
    /// What to call it (a file's name, with the configuration of a what-if).
    pub name: String,
    /// The session.
    pub session: &'a Session,
    /// An exact replay ([`Mode::CHECK`]) or a what-if.
    pub mode: Mode,
}

/// Two runs compared. See the module's documentation.
#[derive(Clone, Debug, Serialize)]
pub struct Diff {
    /// The first run.
    pub a: Run,
    /// The second run.
    pub b: Run,
    /// B's reserved bytes at its peak minus A's at its own.
    pub reserved_difference: i64,
    /// The bytes B's live tensors hold at its peak (rounded as its allocator rounds) minus
    /// A's at its own: the sum of the sites' differences.
    pub live_difference: i64,
    /// Live tensors by site at the peaks, the largest difference first (at most
    /// [`MAX_SITES`]).
    pub sites: Vec<SiteDiff>,
    /// The sites not listed, summed; absent where every site is listed (at most
    /// [`MAX_SITES`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rest: Option<Rest>,
    /// The share (0 to 1) of the sum of every site's absolute difference that the first
    /// [`TOP_SITES`] sites carry; `None` (null) where no site differs.
    pub top_share: Option<f64>,
    /// Files that differ only in the directories above them, matched as one file (A's name
    /// shown).
    pub files_matched: Vec<FileMatch>,
    /// The difference in one sentence.
    pub sentence: String,
}

/// A run at its peak.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// Its name.
    pub name: String,
    /// The device replayed.
    pub device: u32,
    /// Whether it is a what-if (the recording replayed under another configuration) rather
    /// than the recording replayed exactly.
    pub what_if: bool,
    /// The configuration replayed, in `PYTORCH_CUDA_ALLOC_CONF` syntax (`(default)`).
    pub config: String,
    /// The best-fit order replayed, and how it was found.
    pub ordering: String,
    /// Events in its trace.
    pub events: usize,
    /// The peak reserved bytes, and the first moment the replay held them: the moment the
    /// run is read at.
    pub peak_reserved: Peak,
    /// The peak allocated bytes (live and waiting-free blocks) and the first moment the
    /// replay held them.
    pub peak_allocated: Peak,
    /// Allocated bytes at the peak reserved.
    pub allocated: u64,
    /// Where the reserved memory was at the peak (see the module's invariants for how the
    /// cached parts are read).
    pub breakdown: Breakdown,
    /// The stream holding the most of the default pool at the peak.
    pub main_stream: u64,
    /// Out-of-memory errors in its replay (a what-if within the memory the job had can have
    /// them).
    pub ooms: u64,
    /// Where an exact replay first differed from the recording, if it did.
    pub divergence: Option<Divergence>,
    /// Its iterations, where it repeats.
    pub iterations: Option<RunIterations>,
}

impl Run {
    /// A part's bytes at the peak (the parts compared are always known).
    pub fn part(&self, part: Part) -> u64 {
        self.breakdown.get(part).unwrap_or(0)
    }

    /// The bytes live tensors' blocks hold at the peak: what they asked for and its rounding.
    pub fn live_bytes(&self) -> u64 {
        self.breakdown.requested + self.breakdown.rounding
    }
}

impl Diff {
    /// B's bytes of a part minus A's.
    pub fn part_difference(&self, part: Part) -> i64 {
        signed(self.b.part(part)) - signed(self.a.part(part))
    }
}

/// A peak: bytes and the event after which they were first held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Peak {
    /// The bytes.
    pub bytes: u64,
    /// The event; `None` at the trace's start, before its first event (the snapshot's
    /// state where there is no trace).
    pub event: Option<usize>,
    /// The iteration (0-based) the event lies in, where it lies in one.
    pub iteration: Option<usize>,
}

/// A run's iterations.
#[derive(Clone, Debug, Serialize)]
pub struct RunIterations {
    /// Where they came from: the job's profiler steps or the search.
    pub source: IterationSource,
    /// How many were found.
    pub count: usize,
    /// The first [`MAX_ITERATIONS`] of them.
    pub listed: Vec<IterationFigures>,
}

/// One iteration's figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct IterationFigures {
    /// Its step number (`ProfilerStep#N`), where the profiler named it.
    pub step: Option<u64>,
    /// Its first event.
    pub first_event: usize,
    /// Its events.
    pub events: usize,
    /// The most allocated during it.
    pub peak_allocated: u64,
    /// The most reserved during it.
    pub peak_reserved: u64,
    /// Bytes (rounded) of its allocations still live at its end.
    pub kept: u64,
}

/// Live tensors at one site in each run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SiteDiff {
    /// The site (A's file name where the files were matched).
    pub site: String,
    /// A's live tensors there.
    pub a: Live,
    /// B's.
    pub b: Live,
    /// B's live bytes minus A's.
    pub difference: i64,
    /// An example stack, innermost first (B's where B has one), as `file:line in function`
    /// (at most 8 frames).
    pub frames: Vec<String>,
}

/// Live tensors at a site.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Live {
    /// The bytes their blocks hold (rounded as the run's allocator rounds).
    pub bytes: u64,
    /// What they asked for.
    pub requested: u64,
    /// How many.
    pub blocks: usize,
}

/// The sites not listed, summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Rest {
    /// How many.
    pub sites: usize,
    /// How many of them differ.
    pub differing: usize,
    /// A's live bytes there.
    pub a: u64,
    /// B's.
    pub b: u64,
    /// B's minus A's.
    pub difference: i64,
}

/// A file of A's and one of B's matched as one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FileMatch {
    /// A's name for it.
    pub a: String,
    /// B's.
    pub b: String,
}

/// Compares `a` and `b` (see the module's documentation).
///
/// # Errors
/// A [`ReplayError`] when either run cannot be replayed.
pub fn diff(a: &RunSpec<'_>, b: &RunSpec<'_>) -> Result<Diff, ReplayError> {
    let (run_a, sites_a) = read_run(a)?;
    let (run_b, sites_b) = read_run(b)?;
    let files_matched = files::match_files(
        sites_a.keys().map(|s| s.file.as_str()),
        sites_b.keys().map(|s| s.file.as_str()),
    );
    // A matched file of B's is one A's run does not name: renamed, it meets no other of B's.
    let renamed: FxHashMap<&str, &str> = files_matched
        .iter()
        .map(|m| (m.b.as_str(), m.a.as_str()))
        .collect();
    let mut sites: FxHashMap<Site, (SiteLive, SiteLive)> = FxHashMap::default();
    for (s, live) in sites_a {
        sites.entry(s).or_default().0 = live;
    }
    for (mut s, live) in sites_b {
        if let Some(&name) = renamed.get(s.file.as_str()) {
            s.file = name.to_string();
        }
        sites.entry(s).or_default().1 = live;
    }
    let mut sites: Vec<(Site, SiteLive, SiteLive)> =
        sites.into_iter().map(|(s, (a, b))| (s, a, b)).collect();
    let difference = |a: &SiteLive, b: &SiteLive| signed(b.live.bytes) - signed(a.live.bytes);
    sites.sort_by(|x, y| {
        let key = |(_, a, b): &(Site, SiteLive, SiteLive)| {
            (
                difference(a, b).unsigned_abs(),
                a.live.bytes.max(b.live.bytes),
            )
        };
        key(y).cmp(&key(x)).then_with(|| x.0.cmp(&y.0))
    });
    let magnitude =
        |(_, a, b): &(Site, SiteLive, SiteLive)| u128::from(difference(a, b).unsigned_abs());
    let gross: u128 = sites.iter().map(magnitude).sum();
    let top: u128 = sites.iter().take(TOP_SITES).map(magnitude).sum();
    let top_share = (gross > 0).then(|| top as f64 / gross as f64);
    let live_difference = sites.iter().map(|(_, a, b)| difference(a, b)).sum();
    let rest = (sites.len() > MAX_SITES).then(|| {
        let unlisted = &sites[MAX_SITES..];
        let (a_bytes, b_bytes) = unlisted.iter().fold((0u64, 0u64), |(x, y), (_, a, b)| {
            (
                x.saturating_add(a.live.bytes),
                y.saturating_add(b.live.bytes),
            )
        });
        Rest {
            sites: unlisted.len(),
            differing: unlisted
                .iter()
                .filter(|(_, a, b)| difference(a, b) != 0)
                .count(),
            a: a_bytes,
            b: b_bytes,
            difference: signed(b_bytes) - signed(a_bytes),
        }
    });
    sites.truncate(MAX_SITES);
    // Only the listed sites' stacks are described.
    let frames =
        |spec: &RunSpec<'_>, stack: StackId| example_frames(spec.session.recording(), stack);
    let sites: Vec<SiteDiff> = sites
        .into_iter()
        .map(|(s, sa, sb)| SiteDiff {
            site: s.to_string(),
            difference: difference(&sa, &sb),
            frames: if sb.live.blocks > 0 {
                frames(b, sb.stack)
            } else {
                frames(a, sa.stack)
            },
            a: sa.live,
            b: sb.live,
        })
        .collect();
    let reserved_difference = signed(run_b.peak_reserved.bytes) - signed(run_a.peak_reserved.bytes);
    let sentence = sentence(
        &run_a,
        &run_b,
        reserved_difference,
        live_difference,
        sites.first(),
    );
    Ok(Diff {
        a: run_a,
        b: run_b,
        reserved_difference,
        live_difference,
        sites,
        rest,
        top_share,
        files_matched,
        sentence,
    })
}

/// Bytes as a signed figure (no device holds 2^63 bytes; larger saturate).
fn signed(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// A signed byte count as people read it: `+1.50 GiB`, `-512.00 KiB`, `0 B`.
pub fn format_signed(bytes: i64) -> String {
    let size = format_size(bytes.unsigned_abs());
    match bytes.signum() {
        1 => format!("+{size}"),
        -1 => format!("-{size}"),
        _ => size,
    }
}

/// The difference in one sentence.
fn sentence(a: &Run, b: &Run, reserved: i64, live: i64, first: Option<&SiteDiff>) -> String {
    let direction = match reserved.signum() {
        1 => format!(
            "B peaks {} higher than A",
            format_size(reserved.unsigned_abs())
        ),
        -1 => format!(
            "B peaks {} lower than A",
            format_size(reserved.unsigned_abs())
        ),
        _ => "B peaks as high as A".to_string(),
    };
    let beside = reserved - live;
    let mut s = format!(
        "{direction} ({} against {} reserved, each at its own peak): live tensors {} (rounding included), what the allocator holds beside them {}.",
        format_size(b.peak_reserved.bytes),
        format_size(a.peak_reserved.bytes),
        format_signed(live),
        format_signed(beside),
    );
    if let Some(site) = first.filter(|s| s.difference != 0) {
        s.push_str(&format!(
            " The largest difference is at {} ({}).",
            site.site,
            format_signed(site.difference)
        ));
    }
    s
}

/// A site's live tensors in one run and an example stack.
#[derive(Clone, Copy, Debug)]
struct SiteLive {
    live: Live,
    stack: StackId,
}

impl Default for SiteLive {
    /// None: the site is the other run's alone.
    fn default() -> Self {
        SiteLive {
            live: Live::default(),
            stack: StackId::EMPTY,
        }
    }
}

/// One run read at its peak, and its live tensors by site.
fn read_run(spec: &RunSpec<'_>) -> Result<(Run, FxHashMap<Site, SiteLive>), ReplayError> {
    let session = spec.session;
    let recording = session.recording();
    let device = session.device();
    let events = session.events();
    let mut cursor = session.cursor(&spec.mode)?;
    let config = cursor.allocator().config().clone();
    let spans = iteration_spans(session, &config);
    let pass = pass(&mut cursor, spans.as_ref().map(|s| s.spans.as_slice()))?;
    let moment = pass.reserved.1;

    let mut cursor = session.cursor(&spec.mode)?;
    let replayed = moment.map_or(0, |event| event + 1);
    cursor.advance_to(replayed)?;
    let held: FxHashMap<u64, u64> = cursor.held().map(|(recorded, p)| (p.0, recorded)).collect();
    let (alloc, _) = cursor.into_parts();
    let segments: Vec<_> = alloc
        .segment_infos()
        .into_iter()
        .filter(|s| s.device == device)
        .collect();

    // The main stream: the default pool's stream holding the most.
    let mut by_stream: FxHashMap<u64, u64> = FxHashMap::default();
    for s in segments.iter().filter(|s| s.segment_pool_id.is_default()) {
        *by_stream.entry(s.stream.0).or_default() += s.total_size;
    }
    let main_stream = by_stream
        .into_iter()
        .max_by_key(|&(stream, held)| (held, std::cmp::Reverse(stream)))
        .map_or(0, |(stream, _)| stream);
    let request = Request {
        rounded: u64::MAX,
        pool: PoolKind::Large,
        stream: crate::device::StreamId(main_stream),
    };
    let mut accounting = Accounting::default();
    let stacks = BlockStacks::new(
        recording,
        device as usize,
        &events[..replayed.min(events.len())],
    );
    let what_if = matches!(spec.mode, Mode::WhatIf(_));
    let mut sites: FxHashMap<Site, SiteLive> = FxHashMap::default();
    let mut site_of: FxHashMap<StackId, Site> = FxHashMap::default();
    for segment in &segments {
        let blocks = segment
            .blocks
            .iter()
            .map(|b| (b.size, b.requested_size, b.state));
        let own = segment.segment_pool_id.is_default();
        accounting.add_segment(request, segment.stream, segment.segment_type, own, blocks);
        for block in segment
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
        {
            let requested = block.requested_size.min(block.size);
            // A what-if's own addresses are not the recording's: only its map names a block.
            let recorded = held.get(&block.address).copied();
            let recorded = recorded.or((!what_if).then_some(block.address));
            let stack = recorded.map_or(StackId::EMPTY, |r| stacks.of(r));
            let key = if recording.frames.frames_of(stack).is_empty() {
                Site {
                    file: String::new(),
                    rest: format!(
                        "{NO_STACK}: tensors of {} ({requested} bytes)",
                        format_size(requested)
                    ),
                }
            } else if site_of.len() >= MAX_DISTINCT_SITES && !site_of.contains_key(&stack) {
                Site {
                    file: String::new(),
                    rest: MORE_SITES.to_string(),
                }
            } else {
                site_of
                    .entry(stack)
                    .or_insert_with(|| site(recording, stack))
                    .clone()
            };
            let entry = sites.entry(key).or_insert(SiteLive {
                stack,
                ..SiteLive::default()
            });
            entry.live.bytes = entry.live.bytes.saturating_add(block.size);
            entry.live.requested = entry.live.requested.saturating_add(requested);
            entry.live.blocks += 1;
        }
    }
    accounting.finish(None, None);

    let iteration_of = |event: Option<usize>| {
        let event = event?;
        let spans = &spans.as_ref()?.spans;
        let k = spans
            .partition_point(|s| s.first_event <= event)
            .checked_sub(1)?;
        (event < spans[k].first_event + spans[k].events).then_some(k)
    };
    let peak_reserved = Peak {
        bytes: pass.reserved.0,
        event: moment,
        iteration: iteration_of(moment),
    };
    let peak_allocated = Peak {
        bytes: pass.allocated.0,
        event: pass.allocated.1,
        iteration: iteration_of(pass.allocated.1),
    };
    let iterations = spans.map(|s| RunIterations {
        source: s.source,
        count: s.spans.len(),
        listed: s
            .spans
            .iter()
            .take(MAX_ITERATIONS)
            .zip(&pass.iterations)
            .map(
                |(span, &(peak_allocated, peak_reserved))| IterationFigures {
                    peak_allocated,
                    peak_reserved,
                    ..*span
                },
            )
            .collect(),
    });
    let config = crate::replay::config_label(&config);
    let ordering = session
        .ordering()?
        .map_or_else(|| "not established".to_string(), |o| o.sentence());
    let run = Run {
        name: spec.name.clone(),
        device,
        what_if,
        config,
        ordering,
        events: events.len(),
        peak_reserved,
        peak_allocated,
        allocated: accounting.allocated,
        breakdown: accounting.breakdown,
        main_stream,
        ooms: pass.ooms,
        divergence: pass.divergence,
        iterations,
    };
    Ok((run, sites))
}

/// A run's iterations as spans of events, with what each keeps (their peaks come from the
/// pass).
struct Spans {
    source: IterationSource,
    spans: Vec<IterationFigures>,
}

/// The iterations of the session's trace, allocations rounded under `config`.
fn iteration_spans(session: &Session, config: &crate::AllocatorConfig) -> Option<Spans> {
    let events: &[TraceEntry] = session.events();
    // Found under the recording's own rounding, so that a recording and its what-ifs are
    // split alike; what each iteration keeps is counted under the run's.
    let recorded = session.recording().config.clone().unwrap_or_default();
    let found_in = allocations(events, &recorded);
    let found =
        crate::iterations::of_recording(session.recording(), session.device(), events, &found_in)?;
    let event_at = |b: usize| found_in.get(b).map_or(events.len(), |a| a.event);
    let all = allocations(events, config);
    let spans = (0..found.count())
        .map(|k| {
            let (first, end) = (event_at(found.bounds[k]), event_at(found.bounds[k + 1]));
            let from = all.partition_point(|a| a.event < first);
            let to = all.partition_point(|a| a.event < end);
            let kept = all[from..to]
                .iter()
                .filter(|a| a.freed.is_none_or(|f| f >= end))
                .fold(0u64, |sum, a| sum.saturating_add(a.size));
            IterationFigures {
                step: found.step(k),
                first_event: first,
                events: end - first,
                peak_allocated: 0,
                peak_reserved: 0,
                kept,
            }
        })
        .collect();
    Some(Spans {
        source: found.source,
        spans,
    })
}

/// What one pass through a replay found.
struct Pass {
    /// The peak reserved and the first moment it was held (`None`: the trace's start).
    reserved: (u64, Option<usize>),
    /// The peak allocated, likewise.
    allocated: (u64, Option<usize>),
    /// Each listed iteration's peak (allocated, reserved).
    iterations: Vec<(u64, u64)>,
    /// Out-of-memory errors.
    ooms: u64,
    /// Where an exact replay first differed from the recording (the pass stopped there).
    divergence: Option<Divergence>,
}

/// One pass of `cursor` (at the trace's start) through the trace, operation by operation,
/// reading the allocator's statistics after each, up to the trace's end or where an exact
/// replay stopped, differing from the recording.
fn pass(
    cursor: &mut crate::replay::Cursor<'_>,
    spans: Option<&[IterationFigures]>,
) -> Result<Pass, ReplayError> {
    let spans = spans.unwrap_or_default();
    let listed = spans.len().min(MAX_ITERATIONS);
    let read = |c: &crate::replay::Cursor<'_>| {
        let s = c.allocator().stats();
        let bytes = |v: i64| u64::try_from(v).unwrap_or(0);
        (
            bytes(s.allocated_bytes.all_current()),
            bytes(s.reserved_bytes.all_current()),
        )
    };
    let (allocated, reserved) = read(cursor);
    let mut found = Pass {
        reserved: (reserved, None),
        allocated: (allocated, None),
        iterations: vec![(0, 0); listed],
        ooms: 0,
        divergence: None,
    };
    let mut k = 0;
    loop {
        let at = cursor.position();
        if at >= cursor.len() {
            break;
        }
        cursor.advance_to(at + 1)?;
        if cursor.position() == at || cursor.divergence().is_some() {
            // An exact replay stops where it differs from the recording; that state is not
            // the recording's.
            break;
        }
        let event = cursor.position() - 1;
        let (allocated, reserved) = read(cursor);
        if reserved > found.reserved.0 {
            found.reserved = (reserved, Some(event));
        }
        if allocated > found.allocated.0 {
            found.allocated = (allocated, Some(event));
        }
        // The listed iteration the event lies in (events only move forward).
        while k < listed && event >= spans[k].first_event + spans[k].events {
            k += 1;
        }
        if k < listed && event >= spans[k].first_event {
            let peak = &mut found.iterations[k];
            *peak = (peak.0.max(allocated), peak.1.max(reserved));
        }
    }
    found.ooms = u64::try_from(cursor.allocator().stats().num_ooms.get()).unwrap_or(0);
    found.divergence = cursor.divergence().cloned();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::replay::{Setup, WhatIf};

    const MIB: u64 = 1 << 20;

    /// Issue 61, item 2: a run's iterations are the job's profiler steps where it recorded
    /// them, each with its peak and what it keeps, in both runs of a pair.
    #[test]
    fn a_runs_iterations_are_its_profiler_steps() {
        let (recording, _) = crate::explain::growth::tests::stepped();
        let session = Session::new(Arc::new(recording), Setup::default()).expect("a session");
        let spec = |mode| RunSpec {
            name: "stepped".into(),
            session: &session,
            mode,
        };
        let expandable = crate::AllocatorConfig::parse("expandable_segments:True").expect("parses");
        // The hand-made trace records no segments: an exact replay stops at its first
        // allocation, and says so.
        let exact = diff(&spec(Mode::CHECK), &spec(Mode::CHECK)).expect("compares");
        assert_eq!(exact.a.divergence.as_ref().map(|d| d.index), Some(0));
        // Replayed as the recording's configuration and under another one.
        let d = diff(
            &spec(Mode::WhatIf(WhatIf::default())),
            &spec(Mode::WhatIf(WhatIf::default().under(Some(expandable)))),
        )
        .expect("compares");
        for run in [&d.a, &d.b] {
            let its = run.iterations.as_ref().expect("iterations");
            assert_eq!(its.source, IterationSource::ProfilerSteps);
            assert_eq!(its.count, 4);
            let steps: Vec<_> = its.listed.iter().map(|i| i.step).collect();
            assert_eq!(steps, [Some(5), Some(6), Some(7), Some(8)]);
            // The first keeps its optimizer state and its loss; the others their loss.
            let kept: Vec<_> = its.listed.iter().map(|i| i.kept).collect();
            assert_eq!(kept, [3 * MIB, 2 * MIB, 2 * MIB, 2 * MIB]);
            // What each step had live at once: what earlier steps kept, and its own.
            let peaks: Vec<_> = its.listed.iter().map(|i| i.peak_allocated / MIB).collect();
            assert_eq!(peaks, [27, 3 + 26, 5 + 30, 7 + 26]);
        }
        // The same program: nothing live differs at the peaks' sites.
        assert_eq!(d.a.breakdown.requested, d.b.breakdown.requested);
    }
}
