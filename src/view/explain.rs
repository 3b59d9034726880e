//! The page of `gpumem explain --html`: the same figures as its JSON, each in an element that
//! names its JSON field (`data-field`, a dotted path such as `breakdown.fragmented` or
//! `candidates.0.ooms`) and holds its exact value (`data-value`, the JSON scalar as text), so
//! that a reader (and the browser test) can check the page against the JSON.
//!
//! # Invariants
//! - Every scalar of the explanation's JSON but the divergence's details and the pinning
//!   groups' frame lists appears once as a `data-field`; strings also as the element's text.
//! - The breakdown bar's parts are drawn to scale of what they add up to (the device's total
//!   where known, else the reserved memory), in the order of the table below it.

use std::fmt::Write;

use crate::allocator::PoolId;
use crate::allocator::breakdown::Breakdown;
use crate::allocator::size::format_size;
use crate::explain::Explanation;

use super::cells::{bytes_cell, optional_text_cell, row, text_cell, value_cell};
use super::{escape, page};

/// The colours of the breakdown's parts, in [`Breakdown::parts`](crate::allocator::breakdown::Breakdown::parts)'s order.
const COLOURS: [&str; Breakdown::PARTS] = [
    "#1f77b4", "#aec7e8", "#d62728", "#ff9896", "#ffbb78", "#9467bd", "#2ca02c", "#7f7f7f",
];

/// A pool id, `(a, b)`: each part its own figure (the JSON's two-element list).
fn pool_id_cell(field: &str, id: PoolId) -> String {
    format!(
        "<td class=\"num\">(<span data-field=\"{field}.0\" data-value=\"{0}\">{0}</span>, <span data-field=\"{field}.1\" data-value=\"{1}\">{1}</span>)</td>",
        id.0, id.1
    )
}

/// The best-fit order the figures were replayed under, and how it was found.
fn ordering(b: &mut String, e: &Explanation) {
    let Some(o) = &e.ordering else {
        let _ = writeln!(
            b,
            "<p data-field=\"ordering\" data-value=\"null\">The best-fit order was not established.</p>"
        );
        return;
    };
    let _ = writeln!(
        b,
        "<h2>Best-fit order</h2>\n<p>{}</p>\n<table id=\"ordering\">",
        escape(&o.sentence())
    );
    row(
        b,
        "replayed under",
        text_cell("ordering.replayed", o.replayed.name()),
    );
    row(b, "ordering", text_cell("ordering.ordering", &o.ordering));
    row(
        b,
        "found from",
        text_cell("ordering.ordering_source", o.ordering_source),
    );
    row(
        b,
        "counter order",
        optional_text_cell("ordering.counter_order", o.counter_order),
    );
    row(
        b,
        "reproduces",
        match o.reproduces {
            Some(r) => value_cell("ordering.reproduces", r),
            None => optional_text_cell("ordering.reproduces", None),
        },
    );
    row(
        b,
        "contradiction",
        optional_text_cell("ordering.contradiction", o.contradiction.as_deref()),
    );
    for (i, address) in o.guessed_segments.iter().enumerate() {
        row(
            b,
            "placed by address",
            value_cell(&format!("ordering.guessed_segments.{i}"), address),
        );
    }
    let _ = writeln!(b, "</table>");
}

/// The page for `e`, titled by `name` (the recording's file name). `confirm`, where given, is
/// the command that confirms the best candidate.
pub fn page_of(name: &str, e: &Explanation, confirm: Option<&str>) -> String {
    let mut b = String::new();
    heading(&mut b, e, name);
    request(&mut b, e);
    private_pools(&mut b, e);
    ordering(&mut b, e);
    device(&mut b, e);
    breakdown(&mut b, e);
    candidates(&mut b, e, confirm);
    growth(&mut b, e);
    pinning(&mut b, e);
    let _ = writeln!(
        b,
        "<p><small>gpumem explain {}</small></p>",
        env!("CARGO_PKG_VERSION")
    );
    page(&format!("gpumem explain: {name}"), &b)
}

/// The title, the sentences, the divergence and what is to blame.
fn heading(b: &mut String, e: &Explanation, name: &str) {
    let r = &e.request;
    // Only an `oom` entry records the device's free memory.
    let (what, at) = if e.available.is_some() {
        ("Why", "ran out of memory at")
    } else {
        ("The memory of", "after")
    };
    let moment = if r.hypothetical {
        "at the snapshot".to_string()
    } else {
        format!("{at} event {}", r.event)
    };
    let _ = writeln!(
        b,
        "<h1>{what} device <span data-field=\"device\" data-value=\"{0}\">{0}</span> {moment}: {1}</h1>",
        e.device,
        escape(name)
    );
    if let Some(chosen) = &e.chosen {
        let chosen = escape(chosen);
        let _ = writeln!(
            b,
            "<p class=\"note\" data-field=\"chosen\" data-value=\"{chosen}\">{chosen}</p>"
        );
    }
    let sentence = escape(&e.sentence);
    let _ = writeln!(
        b,
        "<p id=\"sentence\" data-field=\"sentence\" data-value=\"{sentence}\"><strong>{sentence}</strong></p>"
    );
    match e.cause {
        Some(cause) => {
            let name = serde_json::to_value(cause)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            let said = escape(&e.cause_sentence);
            let _ = writeln!(
                b,
                "<p id=\"cause\"><span class=\"cause\" data-field=\"cause\" data-value=\"{name}\">{name}</span>: <span data-field=\"cause_sentence\" data-value=\"{said}\">{said}</span></p>"
            );
        }
        None => {
            let _ = writeln!(
                b,
                "<p data-field=\"cause\" data-value=\"null\">Neither fragmentation, growth nor the working set dominates.</p><p hidden data-field=\"cause_sentence\" data-value=\"\"></p>"
            );
        }
    }
    match &e.divergence {
        Some(d) => {
            let _ = writeln!(
                b,
                "<p class=\"note\" data-field=\"divergence.index\" data-value=\"{0}\">The replay differed from the recording at event {0}: these figures are the replay's.</p>",
                d.index
            );
        }
        None => {
            let _ = writeln!(
                b,
                "<p data-field=\"divergence\" data-value=\"null\">The replay made every decision the recording shows, up to this moment.</p>"
            );
        }
    }
    let kinds: Vec<String> = e
        .kinds
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let name = serde_json::to_value(k)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            format!("<li data-field=\"kinds.{i}\" data-value=\"{name}\">{name}</li>")
        })
        .collect();
    let _ = writeln!(
        b,
        "<h2>To blame, most first</h2>\n<ol id=\"kinds\">{}</ol>",
        kinds.join("")
    );
}

/// The request at that moment.
fn request(b: &mut String, e: &Explanation) {
    let r = &e.request;
    let _ = writeln!(b, "<h2>The request</h2>");
    if r.hypothetical {
        let _ = writeln!(
            b,
            "<p class=\"note\">No request was recorded: this is the smallest large request the cached blocks of the stream holding the most memory could not serve.</p>"
        );
    }
    let _ = writeln!(b, "<table id=\"request\">");
    row(b, "event", value_cell("request.event", r.event));
    row(
        b,
        "hypothetical",
        value_cell("request.hypothetical", r.hypothetical),
    );
    row(b, "asked", bytes_cell("request.bytes", Some(r.bytes)));
    row(
        b,
        "rounded",
        bytes_cell("request.rounded", Some(r.wanted.rounded)),
    );
    row(
        b,
        "pool",
        text_cell("request.pool", r.wanted.pool.segment_type()),
    );
    row(b, "pool id", pool_id_cell("request.pool_id", r.pool_id));
    row(b, "stream", value_cell("request.stream", r.wanted.stream));
    for (i, line) in r.context.iter().enumerate() {
        row(
            b,
            "context",
            text_cell(&format!("request.context.{i}"), line),
        );
    }
    let _ = writeln!(b, "</table>");
}

/// The private pools' memory.
fn private_pools(b: &mut String, e: &Explanation) {
    if e.private_pools.is_empty() {
        let _ = writeln!(b, "<p>No private pool held memory.</p>");
    } else {
        let _ = writeln!(
            b,
            "<h2>Private pools</h2>\n<p class=\"note\">Memory of CUDA graphs' and MemPools' pools: only their own requests use it, and <code>empty_cache()</code> frees it only once the pool's owner (the graph, the MemPool) is released, which a recording does not show.</p>\n<table id=\"private-pools\"><tr><th>pool</th><th>kind</th><th>segments</th><th>reserved</th><th>cached free</th></tr>"
        );
        for (i, p) in e.private_pools.iter().enumerate() {
            let at = |name: &str| format!("private_pools.{i}.{name}");
            let _ = writeln!(
                b,
                "<tr>{}{}{}{}{}</tr>",
                pool_id_cell(&at("id"), p.id),
                text_cell(&at("kind"), p.kind),
                value_cell(&at("segments"), p.segments),
                bytes_cell(&at("reserved"), Some(p.reserved)),
                bytes_cell(&at("free"), Some(p.free)),
            );
        }
        let _ = writeln!(b, "</table>");
    }
}

/// The device's figures at that moment.
fn device(b: &mut String, e: &Explanation) {
    let _ = writeln!(
        b,
        "<h2>The device at that moment</h2>\n<table id=\"device\">"
    );
    let total = if e.total_known {
        "total"
    } else {
        "total (assumed: not recorded; --capacity gives it)"
    };
    row(b, total, bytes_cell("total", Some(e.total)));
    row(b, "total known", value_cell("total_known", e.total_known));
    for (field, label, value) in [
        ("reserved", "reserved by the allocator", Some(e.reserved)),
        ("allocated", "allocated", Some(e.allocated)),
        (
            "available",
            "what the job had (reserved + free)",
            e.available,
        ),
        (
            "largest_free_block",
            "largest free block the request could use",
            Some(e.largest_free_block),
        ),
    ] {
        row(b, label, bytes_cell(field, value));
    }
    row(
        b,
        "segments with free memory",
        value_cell("segments_with_free", e.segments_with_free),
    );
    let _ = writeln!(b, "</table>");
}

/// Where the memory was: the bar and its table.
fn breakdown(b: &mut String, e: &Explanation) {
    let parts = breakdown_parts(e);
    let _ = writeln!(b, "<h2>Where the memory was</h2>");
    b.push_str(&bar(&parts));
    let _ = writeln!(b, "<table id=\"breakdown\">");
    for (field, label, colour, bytes) in &parts {
        let _ = writeln!(
            b,
            "<tr><th><span class=\"swatch\" style=\"background:{colour}\"></span>{label}</th>{}</tr>",
            bytes_cell(&format!("breakdown.{field}"), *bytes)
        );
    }
    let _ = writeln!(b, "</table>");
}

/// The settings tried, and the command that confirms the best.
fn candidates(b: &mut String, e: &Explanation, confirm: Option<&str>) {
    if !e.candidates.is_empty() {
        let _ = writeln!(
            b,
            "<h2>What would have avoided it</h2>\n<p>The whole trace replayed under each setting, within the memory the job had.</p>\n<table id=\"candidates\"><tr><th>configuration</th><th>OOMs</th><th>peak reserved</th></tr>"
        );
        for (i, c) in e.candidates.iter().enumerate() {
            let _ = writeln!(
                b,
                "<tr>{}{}{}</tr>",
                text_cell(&format!("candidates.{i}.config"), &c.config),
                value_cell(&format!("candidates.{i}.ooms"), c.ooms),
                bytes_cell(
                    &format!("candidates.{i}.peak_reserved"),
                    Some(c.peak_reserved)
                )
            );
        }
        let _ = writeln!(b, "</table>");
        match confirm {
            Some(command) => {
                let _ = writeln!(
                    b,
                    "<p>Confirm: <code id=\"confirm\">{}</code></p>",
                    escape(command)
                );
            }
            None => {
                let _ = writeln!(b, "<p>None of these settings avoids it.</p>");
            }
        }
    }
}

/// What pins the free memory.
fn pinning(b: &mut String, e: &Explanation) {
    if !e.pinning.is_empty() {
        let _ = writeln!(
            b,
            "<h2>What pins the free memory</h2>\n<p>Live blocks in segments that hold free space, by where they were allocated.</p>\n<table id=\"pinning\"><tr><th>allocated at</th><th>blocks</th><th>live</th><th>free pinned</th></tr>"
        );
        for (i, g) in e.pinning.iter().enumerate() {
            let frame = escape(&g.frame);
            let context = g
                .context
                .iter()
                .enumerate()
                .map(|(k, c)| {
                    let c = escape(c);
                    format!(
                        "<li class=\"context\" data-field=\"pinning.{i}.context.{k}\" data-value=\"{c}\">{c}</li>"
                    )
                })
                .collect::<String>();
            let stack = g
                .frames
                .iter()
                .map(|f| format!("<li>{}</li>", escape(f)))
                .collect::<String>();
            let stack = format!("{context}{stack}");
            let _ = writeln!(
                b,
                "<tr><td data-field=\"pinning.{i}.frame\" data-value=\"{frame}\"><details><summary>{frame}</summary><ol>{stack}</ol></details></td>{}{}{}</tr>",
                value_cell(&format!("pinning.{i}.blocks"), g.blocks),
                bytes_cell(&format!("pinning.{i}.live_bytes"), Some(g.live_bytes)),
                bytes_cell(
                    &format!("pinning.{i}.pinned_free_bytes"),
                    Some(g.pinned_free_bytes)
                )
            );
        }
        let _ = writeln!(b, "</table>");
    }
}

/// The repeating iterations and what each keeps past its end.
fn growth(b: &mut String, e: &Explanation) {
    let Some(g) = &e.growth else {
        let _ = writeln!(
            b,
            "<p data-field=\"growth\" data-value=\"null\">No sequence of allocations repeats before this moment: no iterations to compare.</p>"
        );
        return;
    };
    let _ = writeln!(
        b,
        "<h2>Growth: what each iteration keeps</h2>\n<table id=\"growth\">"
    );
    row(
        b,
        "iterations in a row",
        value_cell("growth.iterations", g.iterations),
    );
    row(
        b,
        "found from",
        text_cell("growth.source", g.source.label()),
    );
    if let Some(step) = g.first_step {
        row(
            b,
            "first profiler step (ProfilerStep#N)",
            value_cell("growth.first_step", step),
        );
    }
    row(
        b,
        "allocations each",
        value_cell(
            "growth.allocations_per_iteration",
            g.allocations_per_iteration,
        ),
    );
    row(
        b,
        "first event",
        value_cell("growth.first_event", g.first_event),
    );
    row(
        b,
        "events each (mean)",
        value_cell("growth.events_per_iteration", g.events_per_iteration),
    );
    row(
        b,
        "kept past its end, each (median)",
        bytes_cell("growth.kept_per_iteration", Some(g.kept_per_iteration)),
    );
    row(
        b,
        "allocations kept, each (median)",
        value_cell(
            "growth.kept_allocations_per_iteration",
            g.kept_allocations_per_iteration,
        ),
    );
    row(
        b,
        "iterations that keep memory",
        value_cell("growth.iterations_keeping", g.iterations_keeping),
    );
    row(
        b,
        "kept in all, live now",
        bytes_cell("growth.kept_bytes", Some(g.kept_bytes)),
    );
    row(
        b,
        "most an iteration needs beyond its start",
        bytes_cell("growth.iteration_peak_bytes", Some(g.iteration_peak_bytes)),
    );
    row(
        b,
        "memory that fills",
        bytes_cell("growth.fills_bytes", g.fills_bytes),
    );
    row(
        b,
        "fills in iteration",
        match g.fills_at_iteration {
            Some(k) => value_cell("growth.fills_at_iteration", k),
            None => {
                let why = if g.fills_bytes.is_none() {
                    "unknown (the memory is not known)"
                } else {
                    "none: the iterations do not grow"
                };
                format!(
                    "<td data-field=\"growth.fills_at_iteration\" data-value=\"null\">{why}</td>"
                )
            }
        },
    );
    let _ = writeln!(b, "</table>");
    if g.kept_at.is_empty() {
        return;
    }
    let _ = writeln!(
        b,
        "<table id=\"kept\"><tr><th>kept memory allocated at</th><th>allocations</th><th>bytes</th></tr>"
    );
    for (i, k) in g.kept_at.iter().enumerate() {
        let frame = escape(&k.frame);
        let stack = k
            .frames
            .iter()
            .map(|f| format!("<li>{}</li>", escape(f)))
            .collect::<String>();
        let _ = writeln!(
            b,
            "<tr><td data-field=\"growth.kept_at.{i}.frame\" data-value=\"{frame}\"><details><summary>{frame}</summary><ol>{stack}</ol></details></td>{}{}</tr>",
            value_cell(&format!("growth.kept_at.{i}.allocations"), k.allocations),
            bytes_cell(&format!("growth.kept_at.{i}.bytes"), Some(k.bytes))
        );
    }
    let _ = writeln!(b, "</table>");
}

/// The breakdown's parts in table order: JSON field, label, colour, bytes (`None` where
/// unknown).
fn breakdown_parts(
    e: &Explanation,
) -> Vec<(&'static str, &'static str, &'static str, Option<u64>)> {
    e.breakdown
        .parts()
        .into_iter()
        .zip(COLOURS)
        .map(|((part, bytes), colour)| (part.field(), part.meaning(), colour, bytes))
        .collect()
}

/// A horizontal bar of the known parts, each to scale, with its label on hover.
fn bar(parts: &[(&str, &str, &str, Option<u64>)]) -> String {
    const WIDTH: f64 = 900.0;
    let sum: u64 = parts.iter().filter_map(|p| p.3).sum();
    let mut out = format!(
        "<svg id=\"bar\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"28\" role=\"img\" aria-label=\"where the memory was\">"
    );
    let mut x = 0.0;
    for &(field, label, colour, bytes) in parts {
        let Some(bytes) = bytes.filter(|&b| b > 0) else {
            continue;
        };
        let w = WIDTH * bytes as f64 / sum.max(1) as f64;
        let _ = write!(
            out,
            "<rect data-part=\"{field}\" x=\"{x:.2}\" y=\"0\" width=\"{w:.2}\" height=\"28\" fill=\"{colour}\"><title>{label}: {}</title></rect>",
            format_size(bytes)
        );
        x += w;
    }
    out.push_str("</svg>\n");
    out
}
