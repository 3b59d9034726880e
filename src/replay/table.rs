//! What `gpumem replay` prints, as text and as JSON, from one value per device: the fidelity
//! check's verdict ([`Checked`]) and the what-if table ([`Comparison`]: its rows under each
//! configuration).
//!
//! # Invariants
//! - Text and JSON are made from the same value, beside each other: a figure one shows, the
//!   other has.

use std::fmt::Write as _;
use std::ops::Range;

use serde_json::{Value, json};

use crate::allocator::size::format_size;

use super::ReplayReport;

/// One device's what-if replays: the recorded configuration's row first.
pub struct Comparison {
    /// The device.
    pub device: u32,
    /// The events every row replays, where not the whole trace (a plan's evaluation).
    pub window: Option<Range<usize>>,
    /// The device memory the allocator was given (`--available`), where it was.
    pub available: Option<u64>,
    /// Whether every row started from the live blocks allocated afresh.
    pub fresh_start: bool,
    /// The rows.
    pub rows: Vec<Row>,
}

/// A row of a [`Comparison`].
pub struct Row {
    /// What the row's notes are labelled with: `recorded`, or the configuration; `None` for
    /// a row whose notes are its configuration's (a plan's).
    pub label: Option<String>,
    /// Its replay.
    pub report: ReplayReport,
}

impl Comparison {
    /// The memory the allocator had: given, or what the job had at its OOM.
    fn available(&self) -> Option<u64> {
        let first = self.rows.first().map(|r| &r.report);
        self.available
            .or(first.and_then(|r| r.job_memory).map(|m| m.bytes()))
    }

    /// The device's part of `gpumem replay --json`.
    pub fn json(&self) -> Value {
        let available = self.available();
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|Row { report: r, .. }| {
                let mut row = json!({
                    "config": r.config,
                    "events": r.events,
                    "peak_allocated": r.peak_allocated,
                    "peak_reserved": r.peak_reserved,
                    "reserved_ratio": r.reserved_ratio(),
                    "device_allocs": r.device_allocs,
                    "device_frees": r.device_frees,
                    "alloc_retries": r.alloc_retries,
                    "ooms": r.ooms,
                    "plan_hits": r.plan_hits,
                    "plan_misses": r.plan_misses,
                    "driver_time_ns": r.driver_time_ns,
                    "driver_calls": r.driver_calls,
                    "capacity": r.capacity,
                    "capacity_inferred": r.capacity_inferred,
                    "notes": r.notes,
                    "available": available,
                    "ordering": r.ordering.ordering,
                    "ordering_source": r.ordering.ordering_source,
                    "counter_order": r.ordering.counter_order,
                });
                if let Some(memory) = r.job_memory {
                    row["job_memory"] = json!(memory);
                }
                row
            })
            .collect();
        json!({ "device": self.device, "events": self.window, "results": rows })
    }

    /// The device's part of `gpumem replay`'s table.
    pub fn text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = self.write_text(&mut out);
        out
    }

    fn write_text(&self, out: &mut String) -> std::fmt::Result {
        let Some(first) = self.rows.first().map(|r| &r.report) else {
            return Ok(());
        };
        writeln!(out, "device {}: {} events", self.device, first.events)?;
        writeln!(out, "best-fit order: {}", first.ordering.sentence())?;
        if let Some(w) = &self.window {
            writeln!(
                out,
                "every row replays events {}..{} from an empty allocator (the plan's evaluation)",
                w.start, w.end
            )?;
        }
        if first.capacity_inferred {
            writeln!(
                out,
                "device memory {}, inferred from the spacing of the recording's expandable reservations (--capacity overrides)",
                format_size(first.capacity)
            )?;
        }
        for row in &self.rows {
            let Some(label) = &row.label else { continue };
            for note in &row.report.notes {
                writeln!(out, "note ({label}): {note}")?;
            }
        }
        if let Some(available) = self.available {
            writeln!(
                out,
                "the allocator may have {} of the device's {} (the rest is held by others)",
                format_size(available.min(first.capacity)),
                format_size(first.capacity)
            )?;
        } else if let Some(m) = first.job_memory {
            writeln!(
                out,
                "the allocator may have {} of the device's {}: what the job had at its out-of-memory error (event {}: {} reserved plus {} the driver reported free); --available overrides",
                format_size(m.bytes().min(first.capacity)),
                format_size(first.capacity),
                m.event,
                format_size(m.reserved),
                format_size(m.device_free)
            )?;
        }
        if self.fresh_start && first.start_segments > 0 {
            writeln!(
                out,
                "each configuration starts from the blocks live at the trace's start, allocated afresh (the recording's {} start segments and their cache are set aside)",
                first.start_segments
            )?;
        }
        writeln!(
            out,
            "{:<40} {:>12} {:>12} {:>6} {:>8} {:>8} {:>8} {:>5} {:>12} {:>11} {:>8}",
            "config",
            "peak alloc",
            "peak resv",
            "ratio",
            "dev allc",
            "dev free",
            "retries",
            "OOMs",
            "driver calls",
            "driver ms",
            "× first"
        )?;
        for Row { report: r, .. } in &self.rows {
            writeln!(
                out,
                "{:<40} {:>12} {:>12} {:>6.3} {:>8} {:>8} {:>8} {:>5} {:>12} {:>11.3} {:>7.2}×",
                truncate(&r.config, 40),
                format_size(r.peak_allocated),
                format_size(r.peak_reserved),
                r.reserved_ratio(),
                r.device_allocs,
                r.device_frees,
                r.alloc_retries,
                r.ooms,
                r.driver_calls,
                r.driver_time_ns as f64 / 1e6,
                r.driver_time_ns as f64 / first.driver_time_ns.max(1) as f64
            )?;
        }
        let planned = self.rows.iter().map(|r| &r.report);
        if let Some(r) = planned
            .into_iter()
            .find(|r| r.plan_hits + r.plan_misses > 0)
        {
            writeln!(
                out,
                "the plan served {} requests from its regions and missed {}",
                r.plan_hits, r.plan_misses
            )?;
        }
        Ok(())
    }
}

/// One device's fidelity check.
pub struct Checked {
    /// The device.
    pub device: u32,
    /// Its check replay.
    pub report: ReplayReport,
}

impl Checked {
    /// The device's part of `gpumem replay --check --json`.
    pub fn json(&self) -> Value {
        let r = &self.report;
        json!({
            "device": self.device,
            "events": r.events,
            "capacity": r.capacity,
            "capacity_inferred": r.capacity_inferred,
            "notes": r.notes,
            "compared": r.compared,
            "divergence": r.divergence,
            "ordering": r.ordering.ordering,
            "ordering_source": r.ordering.ordering_source,
            "counter_order": r.ordering.counter_order,
            "guessed_segments": r.ordering.guessed_segments,
            "ordering_contradiction": r.ordering.contradiction,
        })
    }

    /// The device's lines of `gpumem replay --check`.
    pub fn text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = self.write_text(&mut out);
        out
    }

    fn write_text(&self, out: &mut String) -> std::fmt::Result {
        let (device, r) = (self.device, &self.report);
        if r.capacity_inferred {
            writeln!(
                out,
                "device {device}: device memory {} ({} bytes), inferred from the spacing of the recording's expandable reservations (--capacity overrides)",
                format_size(r.capacity),
                r.capacity
            )?;
        }
        writeln!(out, "device {device}: {}", r.ordering.sentence())?;
        for note in &r.notes {
            writeln!(out, "device {device}: note: {note}")?;
        }
        match &r.divergence {
            None => {
                let c = r.compared;
                writeln!(
                    out,
                    "device {device}: {} events match the recording ({} decisions: {} allocs, {} frees, {} segment allocs, {} segment frees, {} segment maps/unmaps, {} OOMs, {} snapshots; start state {} segments)",
                    r.events,
                    c.total(),
                    c.allocs,
                    c.frees,
                    c.segment_allocs,
                    c.segment_frees,
                    c.segment_maps,
                    c.ooms,
                    c.snapshots,
                    r.start_segments
                )?;
            }
            Some(d) => {
                writeln!(out, "device {device}: diverges at event {}", d.index)?;
                writeln!(out, "  expected: {}", d.expected)?;
                writeln!(out, "  actual:   {}", d.actual)?;
                for line in &d.context {
                    writeln!(out, "  {line}")?;
                }
            }
        }
        Ok(())
    }
}

/// `text` cut to `width` characters, an ellipsis last where it was cut.
fn truncate(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        text.to_string()
    } else {
        let cut: String = text.chars().take(width - 1).collect();
        format!("{cut}…")
    }
}
