//! The timeline of a replay: allocated and reserved bytes over a trace, one pair of lines per
//! run, the fragmentation band (reserved but not allocated) shaded between them. Used by
//! `gpumem replay --plot` and by the web view.
//!
//! # Invariants
//! - Both axes are labelled and carry ticks at round values: bytes in binary units (powers of
//!   two of KiB, MiB, GiB, ...), events or seconds (where every point has a time) at 1, 2 or
//!   5 times a power of ten.
//! - The legend sits below the x axis, outside the plotting area, so it never covers data.
//! - Every label from the caller (the title, the runs' names) is escaped.

use std::fmt::Write;

use crate::replay::SeriesPoint;

use super::escape;

const WIDTH: f64 = 960.0;
const PLOT_HEIGHT: f64 = 400.0;
const LEFT: f64 = 84.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 44.0;
const AXIS_BELOW: f64 = 44.0;
const LEGEND_ROW: f64 = 20.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// One run on the timeline: its name and its points.
pub struct Run<'a> {
    /// Shown in the legend (a configuration, a device).
    pub name: &'a str,
    /// Its series, in event order.
    pub points: &'a [SeriesPoint],
}

/// The SVG of `runs` under `title`, over time where every point has one, else over events.
pub fn svg(title: &str, runs: &[Run<'_>]) -> String {
    draw(title, runs, true)
}

/// The SVG of `runs` under `title` over events (the web view's slider moves along them). The
/// root element says where the axis lies: `data-left` and `data-width` (pixels) span events 0
/// to `data-xmax`.
pub fn svg_by_event(title: &str, runs: &[Run<'_>]) -> String {
    draw(title, runs, false)
}

fn draw(title: &str, runs: &[Run<'_>], by_time: bool) -> String {
    let timed = by_time
        && runs
            .iter()
            .all(|r| !r.points.is_empty() && r.points.iter().all(|p| p.time_us.is_some()));
    let start = runs
        .iter()
        .flat_map(|r| r.points.iter().filter_map(|p| p.time_us))
        .min()
        .unwrap_or(0);
    let x_of = |p: &SeriesPoint| -> f64 {
        if timed {
            p.time_us.unwrap_or(start).saturating_sub(start) as f64 / 1e6
        } else {
            p.event as f64
        }
    };
    let x_max = runs
        .iter()
        .flat_map(|r| r.points.iter().map(x_of))
        .fold(0.0f64, f64::max);
    let y_max = runs
        .iter()
        .flat_map(|r| r.points.iter().map(|p| p.reserved.max(p.allocated)))
        .max()
        .unwrap_or(0);
    let (x_step, x_top) = decimal_ticks(x_max);
    let (y_step, y_top) = binary_ticks(y_max);
    let plot_w = WIDTH - LEFT - RIGHT;
    let bottom = TOP + PLOT_HEIGHT;
    let height = bottom + AXIS_BELOW + LEGEND_ROW * runs.len() as f64 + 12.0;
    let x = |v: f64| LEFT + plot_w * v / x_top;
    let y = |v: u64| bottom - PLOT_HEIGHT * v as f64 / y_top as f64;

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12" data-left="{LEFT}" data-width="{plot_w}" data-xmax="{x_top}" data-top="{TOP}" data-height="{PLOT_HEIGHT}">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><title>{0}</title><text id="title" x="{LEFT}" y="24" font-size="15">{0}</text>"#,
        escape(title)
    );
    let _ = writeln!(
        out,
        r##"<rect id="plot" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{PLOT_HEIGHT}" fill="none" stroke="#444"/>"##
    );
    // Ticks and grid lines.
    let mut v = 0u64;
    while v <= y_top {
        let yy = y(v);
        let _ = writeln!(
            out,
            r##"<g class="ytick"><line x1="{LEFT}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e4e4e4"/><text x="{}" y="{:.1}" text-anchor="end">{}</text></g>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            yy + 4.0,
            binary_label(v)
        );
        v += y_step;
    }
    let ticks = (x_top / x_step).round() as usize;
    for i in 0..=ticks {
        let value = x_step * i as f64;
        let xx = x(value);
        let _ = writeln!(
            out,
            r##"<g class="xtick"><line x1="{xx:.1}" x2="{xx:.1}" y1="{TOP}" y2="{bottom}" stroke="#f0f0f0"/><text x="{xx:.1}" y="{}" text-anchor="middle">{}</text></g>"##,
            bottom + 16.0,
            decimal_label(value)
        );
    }
    let _ = writeln!(
        out,
        r#"<text id="xlabel" x="{}" y="{}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        bottom + 34.0,
        if timed { "time (s)" } else { "event" }
    );
    let _ = writeln!(
        out,
        r#"<text id="ylabel" transform="translate(16 {}) rotate(-90)" text-anchor="middle">bytes</text>"#,
        TOP + PLOT_HEIGHT / 2.0
    );
    // The data: the bands first, then reserved (solid) and allocated (dashed) over them.
    let mut bands = String::new();
    let mut lines = String::new();
    for (i, run) in runs.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let line = |pick: fn(&SeriesPoint) -> u64| -> Vec<String> {
            run.points
                .iter()
                .map(|p| format!("{:.1},{:.1}", x(x_of(p)), y(pick(p))))
                .collect()
        };
        let reserved = line(|p| p.reserved);
        let mut allocated = line(|p| p.allocated);
        let _ = writeln!(
            lines,
            r#"<polyline class="line reserved" points="{}" stroke="{colour}" fill="none" stroke-width="1.5"/>"#,
            reserved.join(" ")
        );
        let _ = writeln!(
            lines,
            r#"<polyline class="line allocated" points="{}" stroke="{colour}" fill="none" stroke-width="1.5" stroke-dasharray="4 3"/>"#,
            allocated.join(" ")
        );
        allocated.reverse();
        let _ = writeln!(
            bands,
            r#"<polygon class="band" points="{} {}" fill="{colour}" fill-opacity="0.15" stroke="none"/>"#,
            reserved.join(" "),
            allocated.join(" ")
        );
        let ly = bottom + AXIS_BELOW + LEGEND_ROW * i as f64 + 8.0;
        let _ = writeln!(
            lines,
            r##"<g class="legend"><line x1="{LEFT}" x2="{}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="2"/><line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="2" stroke-dasharray="4 3"/><rect x="{}" y="{}" width="18" height="10" fill="{colour}" fill-opacity="0.15"/><text x="{}" y="{}">{}: reserved (solid), allocated (dashed), reserved but unallocated (shaded)</text></g>"##,
            LEFT + 18.0,
            LEFT + 24.0,
            LEFT + 42.0,
            LEFT + 48.0,
            ly - 5.0,
            LEFT + 72.0,
            ly + 4.0,
            escape(run.name)
        );
    }
    out.push_str(&bands);
    out.push_str(&lines);
    out.push_str("</svg>\n");
    out
}

/// A tick step of 1, 2 or 5 times a power of ten giving at most 8 ticks to cover `max`, and
/// the axis's end (a whole number of steps, at least one).
fn decimal_ticks(max: f64) -> (f64, f64) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 8.0;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * power);
    (step, (max / step).ceil().max(1.0) * step)
}

/// A tick step that is a power of two bytes giving 4 to 8 ticks to cover `max`, and the
/// axis's end.
fn binary_ticks(max: u64) -> (u64, u64) {
    let max = max.max(1);
    let mut step = 1u64;
    while max.div_ceil(step) > 8 {
        step *= 2;
    }
    (step, max.div_ceil(step) * step)
}

/// `bytes` in the largest binary unit that keeps it at least one, with at most two decimals.
fn binary_label(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let value = bytes as f64 / (1u64 << (10 * unit)) as f64;
    let text = format!("{value:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} {}", UNITS[unit])
}

/// A tick value: whole where it is whole, else with the decimals a 1-2-5 step needs.
fn decimal_label(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{}", value as i64)
    } else {
        let text = format!("{value:.6}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_ticks_are_powers_of_two_and_cover_the_maximum() {
        for max in [1u64, 1000, 3 << 30, (80 << 30) + 1, 23_297_261_568] {
            let (step, top) = binary_ticks(max);
            assert!(step.is_power_of_two());
            assert!(top >= max && top - max < step, "{max}: {step} {top}");
            assert!(
                top / step <= 8 && (max < 4 || top / step >= 4),
                "{max}: {}",
                top / step
            );
        }
        assert_eq!(binary_label(0), "0 B");
        assert_eq!(binary_label(512 << 20), "512 MiB");
        assert_eq!(binary_label(3 << 29), "1.5 GiB");
        assert_eq!(binary_label(24 << 30), "24 GiB");
    }

    #[test]
    fn event_ticks_are_round() {
        assert_eq!(decimal_ticks(1117.0), (200.0, 1200.0));
        assert_eq!(decimal_ticks(0.0), (0.2, 1.0));
        let (step, top) = decimal_ticks(3.7);
        assert_eq!((step, top), (0.5, 4.0));
        assert_eq!(decimal_label(0.5), "0.5");
        assert_eq!(decimal_label(1200.0), "1200");
    }

    #[test]
    fn names_are_escaped_and_the_legend_is_below_the_plot() {
        let points = [
            SeriesPoint {
                event: 0,
                allocated: 1,
                reserved: 2,
                time_us: None,
            },
            SeriesPoint {
                event: 10,
                allocated: 3 << 20,
                reserved: 4 << 20,
                time_us: None,
            },
        ];
        let svg = svg(
            "a<b>.pickle",
            &[Run {
                name: "<script>",
                points: &points,
            }],
        );
        assert!(svg.contains("a&lt;b&gt;.pickle") && svg.contains("&lt;script&gt;"));
        assert!(!svg.contains("<script>"));
        assert!(svg.contains(">event<") && svg.contains("class=\"band\""));
    }
}
