//! An SVG chart of allocated and reserved bytes over a replayed trace, one pair of lines per
//! configuration.

use std::fmt::Write;

use super::replay::ReplayReport;
use crate::view::escape;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 480.0;
const MARGIN: f64 = 60.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// Renders the series of `reports` (which must have been replayed with series points).
pub fn svg(title: &str, reports: &[ReplayReport]) -> String {
    let max_event = reports
        .iter()
        .flat_map(|r| r.series.iter().map(|p| p.event))
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let max_bytes = reports
        .iter()
        .flat_map(|r| r.series.iter().map(|p| p.reserved.max(p.allocated)))
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let x = |event: usize| MARGIN + (WIDTH - 2.0 * MARGIN) * event as f64 / max_event;
    let y = |bytes: u64| HEIGHT - MARGIN - (HEIGHT - 2.0 * MARGIN) * bytes as f64 / max_bytes;
    let gib = max_bytes / f64::from(1u32 << 30);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{MARGIN}" y="24" font-size="15">{}</text>"#,
        escape(title)
    );
    let (left, right, top, bottom) = (MARGIN, WIDTH - MARGIN, MARGIN, HEIGHT - MARGIN);
    let _ = writeln!(
        out,
        r##"<path d="M{left},{top} L{left},{bottom} L{right},{bottom}" stroke="#444" fill="none"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="{left}" y="{}" text-anchor="middle">{gib:.2} GiB</text>"#,
        top - 8.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{right}" y="{}" text-anchor="end">event {}</text>"#,
        bottom + 20.0,
        max_event as u64
    );
    for (i, report) in reports.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        for (dashed, pick) in [(false, true), (true, false)] {
            let points: Vec<String> = report
                .series
                .iter()
                .map(|p| {
                    let bytes = if pick { p.reserved } else { p.allocated };
                    format!("{:.1},{:.1}", x(p.event), y(bytes))
                })
                .collect();
            let dash = if dashed {
                r#" stroke-dasharray="4 3""#
            } else {
                ""
            };
            let _ = writeln!(
                out,
                r#"<polyline points="{}" stroke="{colour}" fill="none" stroke-width="1.5"{dash}/>"#,
                points.join(" ")
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" fill="{colour}">{} — reserved (solid), allocated (dashed)</text>"#,
            left + 10.0,
            top + 16.0 * (i as f64 + 1.0),
            escape(&report.config)
        );
    }
    out.push_str("</svg>\n");
    out
}
