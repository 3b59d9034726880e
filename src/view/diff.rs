//! The page of `gpumem diff --html` (and of the view's comparison with a what-if): the same
//! figures as its JSON, each in an element naming its JSON field (`cells`).
//!
//! # Invariants
//! - Every scalar of the comparison's JSON but the divergences' details and the sites'
//!   example stacks appears once as a `data-field`; strings also as the element's text.
//! - The two bars are drawn to one scale, the larger peak reserved filling the width, their
//!   parts in the order of the table below them.

use std::fmt::Write;

use crate::allocator::breakdown::Part;
use crate::allocator::size::format_size;
use crate::diff::text::PARTS;
use crate::diff::{Diff, Peak, Run, format_signed};

use super::cells::{bytes_cell, optional_text_cell, row, text_cell, value_cell};
use super::{escape, page};

/// The colours of the compared parts, in [`PARTS`]' order.
const COLOURS: [&str; PARTS.len()] = [
    "#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#ffbb78", "#9467bd",
];

/// The whole page of `diff`.
pub fn page_of(diff: &Diff) -> String {
    let mut b = String::new();
    let title = format!("gpumem diff: {} against {}", diff.b.name, diff.a.name);
    let _ = writeln!(b, "<h1>{}</h1>", escape(&title));
    let _ = writeln!(
        b,
        "<p data-field=\"sentence\" data-value=\"{0}\">{0}</p>",
        escape(&diff.sentence)
    );
    runs(&mut b, diff);
    bars(&mut b, diff);
    breakdown(&mut b, diff);
    sites(&mut b, diff);
    files(&mut b, diff);
    iterations(&mut b, diff);
    page(&title, &b)
}

/// A signed figure in bytes.
fn signed_cell(field: &str, bytes: i64) -> String {
    format!(
        "<td class=\"num\" data-field=\"{field}\" data-value=\"{bytes}\" title=\"{bytes} bytes\">{}</td>",
        format_signed(bytes)
    )
}

/// A number or null.
fn optional_cell(field: &str, value: Option<impl std::fmt::Display>) -> String {
    match value {
        Some(v) => value_cell(field, v),
        None => format!("<td class=\"num\" data-field=\"{field}\" data-value=\"null\">–</td>"),
    }
}

/// The two runs, field by field.
fn runs(b: &mut String, diff: &Diff) {
    let _ = writeln!(
        b,
        "<h2>The runs</h2>\n<table id=\"runs\"><tr><th></th><th>A</th><th>B</th></tr>"
    );
    let both = |b: &mut String, heading: &str, cell: &dyn Fn(&str, &Run) -> String| {
        row(
            b,
            heading,
            format!("{}{}", cell("a", &diff.a), cell("b", &diff.b)),
        );
    };
    both(b, "recording", &|s, r| {
        text_cell(&format!("{s}.name"), &r.name)
    });
    both(b, "device", &|s, r| {
        value_cell(&format!("{s}.device"), r.device)
    });
    both(b, "what-if", &|s, r| {
        value_cell(&format!("{s}.what_if"), r.what_if)
    });
    both(b, "configuration", &|s, r| {
        text_cell(&format!("{s}.config"), &r.config)
    });
    both(b, "best-fit order", &|s, r| {
        text_cell(&format!("{s}.ordering"), &r.ordering)
    });
    both(b, "events", &|s, r| {
        value_cell(&format!("{s}.events"), r.events)
    });
    let reserved: fn(&Run) -> Peak = |r| r.peak_reserved;
    let allocated: fn(&Run) -> Peak = |r| r.peak_allocated;
    for (name, field, peak) in [
        ("peak reserved", "peak_reserved", reserved),
        ("peak allocated", "peak_allocated", allocated),
    ] {
        let p = |s: &str, r: &Run| -> (String, Peak) { (format!("{s}.{field}"), peak(r)) };
        both(b, name, &|s, r| {
            let (f, p) = p(s, r);
            bytes_cell(&format!("{f}.bytes"), Some(p.bytes))
        });
        both(
            b,
            "&nbsp;after event (– at the trace's start)",
            &|s, r| {
                let (f, p) = p(s, r);
                optional_cell(&format!("{f}.event"), p.event)
            },
        );
        both(b, "&nbsp;in iteration (0-based)", &|s, r| {
            let (f, p) = p(s, r);
            optional_cell(&format!("{f}.iteration"), p.iteration)
        });
    }
    both(b, "allocated at the peak", &|s, r| {
        bytes_cell(&format!("{s}.allocated"), Some(r.allocated))
    });
    both(b, "main stream", &|s, r| {
        value_cell(&format!("{s}.main_stream"), r.main_stream)
    });
    both(b, "out-of-memory errors", &|s, r| {
        value_cell(&format!("{s}.ooms"), r.ooms)
    });
    both(b, "replay differed at event", &|s, r| match &r.divergence {
        Some(d) => value_cell(&format!("{s}.divergence.index"), d.index),
        None => optional_cell(&format!("{s}.divergence"), None::<usize>),
    });
    let _ = writeln!(b, "</table>");
}

/// The two breakdowns as bars to one scale.
fn bars(b: &mut String, diff: &Diff) {
    let scale = diff
        .a
        .peak_reserved
        .bytes
        .max(diff.b.peak_reserved.bytes)
        .max(1) as f64;
    let _ = writeln!(b, "<div id=\"bars\" style=\"margin-top:1em\">");
    for (label, run) in [("A", &diff.a), ("B", &diff.b)] {
        let _ = write!(
            b,
            "<div style=\"display:flex;align-items:center;margin:.2em 0\"><span style=\"width:1.5em\">{label}</span><div style=\"flex:1;display:flex;height:1.4em\">"
        );
        for ((part, name), colour) in PARTS.iter().zip(COLOURS) {
            let bytes = run.part(*part);
            let width = bytes as f64 / scale * 100.0;
            if width > 0.0 {
                let _ = write!(
                    b,
                    "<div class=\"part\" style=\"width:{width:.3}%;background:{colour}\" title=\"{name}: {}\"></div>",
                    format_size(bytes)
                );
            }
        }
        let _ = writeln!(b, "</div></div>");
    }
    let _ = writeln!(b, "</div>");
}

/// The breakdowns side by side, with the differences.
fn breakdown(b: &mut String, diff: &Diff) {
    let _ = writeln!(
        b,
        "<h2>At the peaks</h2>\n<table id=\"breakdown\"><tr><th></th><th>A</th><th>B</th><th>B − A</th></tr>"
    );
    for ((part, name), colour) in PARTS.iter().zip(COLOURS) {
        let (a, bb) = (diff.a.part(*part), diff.b.part(*part));
        let field = part.field();
        let difference = format!(
            "<td class=\"num\">{}</td>",
            format_signed(diff.part_difference(*part))
        );
        row(
            b,
            &format!("<span class=\"swatch\" style=\"background:{colour}\"></span>{name}"),
            format!(
                "{}{}{difference}",
                bytes_cell(&format!("a.breakdown.{field}"), Some(a)),
                bytes_cell(&format!("b.breakdown.{field}"), Some(bb)),
            ),
        );
        if *part == Part::Rounding {
            row(
                b,
                "= live tensors' blocks",
                format!(
                    "<td class=\"num\">{}</td><td class=\"num\">{}</td>{}",
                    format_size(diff.a.live_bytes()),
                    format_size(diff.b.live_bytes()),
                    signed_cell("live_difference", diff.live_difference)
                ),
            );
        }
    }
    // Not read at a peak (no OOM entry says what the device had free): shown as unknown.
    for part in [Part::Free, Part::OutsideAllocator] {
        let field = part.field();
        row(
            b,
            part.meaning(),
            format!(
                "{}{}<td></td>",
                bytes_cell(&format!("a.breakdown.{field}"), diff.a.breakdown.get(part)),
                bytes_cell(&format!("b.breakdown.{field}"), diff.b.breakdown.get(part)),
            ),
        );
    }
    row(
        b,
        "reserved",
        format!(
            "<td class=\"num\">{}</td><td class=\"num\">{}</td>{}",
            format_size(diff.a.peak_reserved.bytes),
            format_size(diff.b.peak_reserved.bytes),
            signed_cell("reserved_difference", diff.reserved_difference)
        ),
    );
    let _ = writeln!(b, "</table>");
}

/// The sites, the largest difference first.
fn sites(b: &mut String, diff: &Diff) {
    let share = diff.top_share.map_or_else(
        || "null".to_string(),
        |s| serde_json::to_string(&s).unwrap_or_else(|_| "null".into()),
    );
    let shown = diff.top_share.map_or_else(
        || "no site differs".to_string(),
        |s| format!("{:.1}%", s * 100.0),
    );
    let _ = writeln!(
        b,
        "<h2>Live tensors by site</h2>\n<p>The first {} sites carry <span data-field=\"top_share\" data-value=\"{share}\">{shown}</span> of the change (the sum of every site's difference, each counted positive).</p>",
        crate::diff::TOP_SITES
    );
    let _ = writeln!(
        b,
        "<table id=\"sites\"><tr><th>B − A</th><th>A</th><th>A requested</th><th>A tensors</th><th>B</th><th>B requested</th><th>B tensors</th><th>site</th></tr>"
    );
    for (k, s) in diff.sites.iter().enumerate() {
        let f = |x: &str| format!("sites.{k}.{x}");
        let frames: String = s
            .frames
            .iter()
            .map(|fr| format!("<li>{}</li>", escape(fr)))
            .collect();
        let site = escape(&s.site);
        let _ = writeln!(
            b,
            "<tr>{}{}{}{}{}{}{}<td><details data-field=\"{}\" data-value=\"{site}\"><summary>{site}</summary><ol>{frames}</ol></details></td></tr>",
            signed_cell(&f("difference"), s.difference),
            bytes_cell(&f("a.bytes"), Some(s.a.bytes)),
            bytes_cell(&f("a.requested"), Some(s.a.requested)),
            value_cell(&f("a.blocks"), s.a.blocks),
            bytes_cell(&f("b.bytes"), Some(s.b.bytes)),
            bytes_cell(&f("b.requested"), Some(s.b.requested)),
            value_cell(&f("b.blocks"), s.b.blocks),
            f("site"),
        );
    }
    if let Some(r) = diff.rest {
        let _ = writeln!(
            b,
            "<tr>{}{}<td></td><td></td>{}<td></td><td></td><td><span data-field=\"rest.sites\" data-value=\"{3}\">{3}</span> more sites, <span data-field=\"rest.differing\" data-value=\"{4}\">{4}</span> of which differ</td></tr>",
            signed_cell("rest.difference", r.difference),
            bytes_cell("rest.a", Some(r.a)),
            bytes_cell("rest.b", Some(r.b)),
            r.sites,
            r.differing,
        );
    }
    let _ = writeln!(b, "</table>");
}

/// The files matched across the runs.
fn files(b: &mut String, diff: &Diff) {
    if diff.files_matched.is_empty() {
        return;
    }
    let _ = writeln!(
        b,
        "<h2>Files matched across the runs</h2>\n<table id=\"files\"><tr><th>A</th><th>B</th></tr>"
    );
    for (k, m) in diff.files_matched.iter().enumerate() {
        let _ = writeln!(
            b,
            "<tr>{}{}</tr>",
            text_cell(&format!("files_matched.{k}.a"), &m.a),
            text_cell(&format!("files_matched.{k}.b"), &m.b)
        );
    }
    let _ = writeln!(b, "</table>");
}

/// The iterations side by side.
fn iterations(b: &mut String, diff: &Diff) {
    let _ = writeln!(b, "<h2>Iterations</h2>\n<table id=\"iteration-sources\">");
    for (s, run) in [("a", &diff.a), ("b", &diff.b)] {
        match &run.iterations {
            Some(i) => row(
                b,
                &format!("{} iterations from", s.to_uppercase()),
                format!(
                    "{}{}",
                    value_cell(&format!("{s}.iterations.count"), i.count),
                    text_cell(&format!("{s}.iterations.source"), i.source.label())
                ),
            ),
            None => row(
                b,
                &format!("{} iterations", s.to_uppercase()),
                optional_text_cell(&format!("{s}.iterations"), None),
            ),
        }
    }
    let _ = writeln!(b, "</table>");
    let rows = |r: &Run| r.iterations.as_ref().map_or(0, |i| i.listed.len());
    let n = rows(&diff.a).max(rows(&diff.b));
    if n == 0 {
        return;
    }
    let heads = "<th>step</th><th>first event</th><th>events</th><th>peak allocated</th><th>peak reserved</th><th>kept</th>";
    let _ = writeln!(
        b,
        "<table id=\"iterations\"><tr><th></th><th colspan=\"6\">A</th><th colspan=\"6\">B</th></tr><tr><th>iteration (0-based)</th>{heads}{heads}</tr>"
    );
    for k in 0..n {
        let mut cells = String::new();
        for (s, run) in [("a", &diff.a), ("b", &diff.b)] {
            match run.iterations.as_ref().and_then(|i| i.listed.get(k)) {
                Some(it) => {
                    let f = |x: &str| format!("{s}.iterations.listed.{k}.{x}");
                    cells.push_str(&optional_cell(&f("step"), it.step));
                    cells.push_str(&value_cell(&f("first_event"), it.first_event));
                    cells.push_str(&value_cell(&f("events"), it.events));
                    cells.push_str(&bytes_cell(&f("peak_allocated"), Some(it.peak_allocated)));
                    cells.push_str(&bytes_cell(&f("peak_reserved"), Some(it.peak_reserved)));
                    cells.push_str(&bytes_cell(&f("kept"), Some(it.kept)));
                }
                None => cells.push_str(&"<td></td>".repeat(6)),
            }
        }
        let _ = writeln!(b, "<tr><th>{k}</th>{cells}</tr>");
    }
    let _ = writeln!(b, "</table>");
}
