//! `gpumem diff`'s text: both peaks, the breakdown side by side, the sites with the largest
//! differences, and the iterations side by side.

use std::fmt::Write;

use crate::allocator::breakdown::Part;
use crate::allocator::size::format_size;

use super::{Diff, MAX_SITES, Peak, Run, TOP_SITES, format_signed};

/// The parts of the reserved memory compared, with what they are called here (the cached
/// parts as the module's invariants read them).
pub const PARTS: [(Part, &str); 6] = [
    (Part::Requested, "live tensors (requested)"),
    (Part::Rounding, "rounding of live tensors"),
    (Part::Fragmented, "cached free, main stream"),
    (Part::OtherStreams, "cached free, other streams"),
    (Part::OtherPools, "cached free, private pools"),
    (Part::PendingStreamFrees, "freed, waiting on other streams"),
];

/// The text of `diff`.
pub fn text(diff: &Diff) -> String {
    let mut t = String::new();
    for (label, run) in [("A", &diff.a), ("B", &diff.b)] {
        run_lines(&mut t, label, run);
    }
    let _ = writeln!(t, "\n{}\n", diff.sentence);

    let _ = writeln!(
        t,
        "At the peaks                            {:>12} {:>12} {:>12}",
        "A", "B", "B - A"
    );
    for (p, name) in PARTS {
        let _ = writeln!(
            t,
            "  {name:<37} {:>12} {:>12} {:>12}",
            format_size(diff.a.part(p)),
            format_size(diff.b.part(p)),
            format_signed(diff.part_difference(p))
        );
        if p == Part::Rounding {
            let _ = writeln!(
                t,
                "  {:<37} {:>12} {:>12} {:>12}",
                "= live tensors' blocks",
                format_size(diff.a.live_bytes()),
                format_size(diff.b.live_bytes()),
                format_signed(diff.live_difference)
            );
        }
    }
    let _ = writeln!(
        t,
        "  {:<37} {:>12} {:>12} {:>12}",
        "reserved",
        format_size(diff.a.peak_reserved.bytes),
        format_size(diff.b.peak_reserved.bytes),
        format_signed(diff.reserved_difference)
    );

    let shown = diff
        .sites
        .iter()
        .take(TOP_SITES)
        .filter(|s| s.difference != 0);
    let differing = diff.sites.iter().filter(|s| s.difference != 0).count()
        + diff.rest.map_or(0, |r| r.differing);
    let _ = writeln!(
        t,
        "\nLive tensors by site, the largest differences first ({differing} {} in all{}):",
        if differing == 1 {
            "site differs"
        } else {
            "sites differ"
        },
        diff.top_share.map_or_else(String::new, |share| format!(
            "; the first {TOP_SITES} carry {:.1}% of the change",
            share * 100.0
        ))
    );
    let _ = writeln!(t, "  {:>12} {:>12} {:>12}  site", "B - A", "A", "B");
    let mut any = false;
    for s in shown {
        any = true;
        let _ = writeln!(
            t,
            "  {:>12} {:>12} {:>12}  {}",
            format_signed(s.difference),
            format_size(s.a.bytes),
            format_size(s.b.bytes),
            s.site
        );
    }
    if !any {
        let _ = writeln!(t, "  (no site's live tensors differ)");
    }
    let more: usize = diff
        .sites
        .iter()
        .skip(TOP_SITES)
        .filter(|s| s.difference != 0)
        .count()
        + diff.rest.map_or(0, |r| r.differing);
    if more > 0 {
        let _ = writeln!(
            t,
            "  … and {more} more sites differ (--json lists the first {MAX_SITES})"
        );
    }
    if !diff.files_matched.is_empty() {
        let _ = writeln!(t, "\nFiles matched across the runs (A's name shown):");
        for m in &diff.files_matched {
            let _ = writeln!(t, "  {}  =  {}", m.a, m.b);
        }
    }
    iterations(&mut t, diff);
    t
}

/// A run's heading lines.
fn run_lines(t: &mut String, label: &str, run: &Run) {
    let kind = if run.what_if {
        "what-if under"
    } else {
        "replayed exactly, configuration"
    };
    let _ = writeln!(
        t,
        "{label}: {} (device {}, {} events; {kind} {})",
        run.name, run.device, run.events, run.config
    );
    let _ = writeln!(
        t,
        "   peak reserved {} {}; peak allocated {} {}",
        format_size(run.peak_reserved.bytes),
        where_(run, &run.peak_reserved),
        format_size(run.peak_allocated.bytes),
        where_(run, &run.peak_allocated),
    );
    let _ = writeln!(t, "   best-fit order: {}", run.ordering);
    if run.ooms > 0 {
        let _ = writeln!(t, "   out-of-memory errors in its replay: {}", run.ooms);
    }
    if let Some(d) = &run.divergence {
        let _ = writeln!(
            t,
            "   the replay differed from the recording at event {}: the figures are not the recording's",
            d.index
        );
    }
}

/// Where a peak was: its event and iteration.
fn where_(run: &Run, peak: &Peak) -> String {
    let Some(event) = peak.event else {
        return if run.events == 0 {
            "at the snapshot (no trace)".to_string()
        } else {
            "at the trace's start (held when it began)".to_string()
        };
    };
    let iteration = peak.iteration.and_then(|k| {
        let its = run.iterations.as_ref()?;
        Some(match its.listed.get(k).and_then(|f| f.step) {
            Some(step) => format!(", in ProfilerStep#{step}"),
            None => format!(", in iteration {} of {}", k + 1, its.count),
        })
    });
    format!("after event {event}{}", iteration.unwrap_or_default())
}

/// The iterations side by side.
fn iterations(t: &mut String, diff: &Diff) {
    let (a, b) = (&diff.a.iterations, &diff.b.iterations);
    if a.is_none() && b.is_none() {
        let _ = writeln!(t, "\nNeither run repeats iterations.");
        return;
    }
    let _ = writeln!(
        t,
        "\nIterations (peak allocated, peak reserved, kept past its end):"
    );
    for (label, its) in [("A", a), ("B", b)] {
        match its {
            Some(i) => {
                let _ = writeln!(
                    t,
                    "  {label}: {} iterations, from {}",
                    i.count,
                    match i.source {
                        crate::iterations::IterationSource::ProfilerSteps =>
                            "the job's profiler steps",
                        crate::iterations::IterationSource::Search =>
                            "the repeating sequence found",
                    }
                );
            }
            None => {
                let _ = writeln!(t, "  {label}: no repeating iterations");
            }
        }
    }
    let rows = |i: &Option<super::RunIterations>| i.as_ref().map_or(0, |i| i.listed.len());
    let _ = writeln!(
        t,
        "  {:>4}  {:>11} {:>11} {:>11}  {:>11} {:>11} {:>11}",
        "#", "A alloc", "A resv", "A kept", "B alloc", "B resv", "B kept"
    );
    let cells =
        |i: &Option<super::RunIterations>, k: usize| match i.as_ref().and_then(|i| i.listed.get(k))
        {
            Some(f) => format!(
                "{:>11} {:>11} {:>11}",
                format_size(f.peak_allocated),
                format_size(f.peak_reserved),
                format_size(f.kept)
            ),
            None => format!("{:>11} {:>11} {:>11}", "", "", ""),
        };
    for k in 0..rows(a).max(rows(b)) {
        let _ = writeln!(t, "  {:>4}  {}  {}", k + 1, cells(a, k), cells(b, k));
    }
}
