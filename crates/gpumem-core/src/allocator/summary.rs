//! `memory_summary()`: the statistics as PyTorch's 75-column text table.
//!
//! # Invariants
//! - Pure formatting of the statistics read once, in PyTorch's rows and layout; no state.

use std::fmt::Write;

use super::stats::{DeviceStats, StatArray, StatValue};

const WIDTH: usize = 75;

/// Byte cells: the unit steps up while the row's `all` value is at least 768 of it.
fn format_bytes(value: i64, reference: i64) -> String {
    const UNITS: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut value, mut reference, mut unit) = (value, reference as f64, 0);
    while unit + 1 < UNITS.len() && reference >= 768.0 * 1024.0 {
        value = value.div_euclid(1024);
        reference /= 1024.0;
        unit += 1;
    }
    format!("{value:6} {}", UNITS[unit])
}

/// Count cells: thousands and millions once the row's `all` value reaches 750 of them.
fn format_count(value: i64, reference: i64) -> String {
    const UNITS: [&str; 3] = [" ", "K", "M"];
    let (mut value, mut reference, mut unit) = (value, reference as f64, 0);
    while unit + 1 < UNITS.len() && reference >= 750.0 * 1000.0 {
        value = value.div_euclid(1000);
        reference /= 1000.0;
        unit += 1;
    }
    format!("{value:7} {} ", UNITS[unit])
}

type Formatter = fn(i64, i64) -> String;

fn row(out: &mut Vec<String>, name: &str, v: StatValue, r: StatValue, format: Formatter) {
    out.push(format!(
        " {name:<21} | {} | {} | {} | {} ",
        format(v.current, r.current),
        format(v.peak, r.peak),
        format(v.allocated, r.allocated),
        format(v.freed, r.freed),
    ));
}

/// Renders the table for device `device`.
pub(crate) fn memory_summary(device: u32, stats: &DeviceStats, abbreviated: bool) -> String {
    let rule = |c: &str| c.repeat(WIDTH);
    let mut lines = vec![
        rule("="),
        format!(
            "{:^WIDTH$}",
            format!("PyTorch CUDA memory summary, device ID {device}")
        ),
        rule("-"),
        format!(
            "{:^37}|{:^37}",
            format!("CUDA OOMs: {}", stats.num_ooms.get()),
            format!("cudaMalloc retries: {}", stats.num_alloc_retries.get()),
        ),
        rule("="),
        format!(
            " {:^21} | {:^10} | {:^10} | {:^10} | {:^10} ",
            "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
        ),
    ];
    let blocks: [(&str, &StatArray, Formatter); 9] = [
        ("Allocated memory", &stats.allocated_bytes, format_bytes),
        ("Active memory", &stats.active_bytes(), format_bytes),
        ("Requested memory", &stats.requested_bytes, format_bytes),
        ("GPU reserved memory", &stats.reserved_bytes, format_bytes),
        (
            "Non-releasable memory",
            &stats.inactive_split_bytes,
            format_bytes,
        ),
        ("Allocations", &stats.allocation, format_count),
        ("Active allocs", &stats.active(), format_count),
        ("GPU reserved segments", &stats.segment, format_count),
        ("Non-releasable allocs", &stats.inactive_split, format_count),
    ];
    for (name, array, format) in blocks {
        lines.push(rule("-"));
        let all = array.all();
        row(&mut lines, name, all, all, format);
        if !abbreviated {
            row(
                &mut lines,
                "      from large pool",
                array.large_pool.get(),
                all,
                format,
            );
            row(
                &mut lines,
                "      from small pool",
                array.small_pool.get(),
                all,
                format,
            );
        }
    }
    lines.push(rule("-"));
    for (name, stat) in [
        ("Oversize allocations", &stats.oversize_allocations),
        ("Oversize GPU segments", &stats.oversize_segments),
    ] {
        row(&mut lines, name, stat.get(), stat.get(), format_count);
    }
    lines.push(rule("="));
    let mut out = String::new();
    for line in lines {
        let _ = writeln!(out, "|{line}|");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::size::PoolKind;

    #[test]
    fn cells_choose_units_from_the_all_row() {
        assert_eq!(format_bytes(512, 512), "   512 B  ");
        assert_eq!(format_bytes(2 << 20, 2 << 20), "  2048 KiB");
        assert_eq!(format_bytes(1 << 30, 1 << 30), "  1024 MiB");
        assert_eq!(format_bytes(0, 1 << 30), "     0 MiB");
        assert_eq!(format_count(749_999, 749_999), " 749999   ");
        assert_eq!(format_count(750_000, 750_000), "    750 K ");
    }

    #[test]
    fn table_is_75_columns_with_every_row() {
        let stats = DeviceStats::new(-1);
        stats.allocated_bytes.increase(PoolKind::Small, 512);
        stats.num_ooms.bump();
        let text = memory_summary(3, &stats, false);
        for line in text.lines() {
            assert_eq!(line.chars().count(), WIDTH + 2, "{line:?}");
        }
        assert!(text.contains("PyTorch CUDA memory summary, device ID 3"));
        assert!(text.contains("CUDA OOMs: 1"));
        assert!(text.contains(
            "| Allocated memory      |    512 B   |    512 B   |    512 B   |      0 B   |"
        ));
        assert!(text.contains("|       from small pool |    512 B   |"));
        assert_eq!(text.lines().count(), 9 * 4 + 10);
        let short = memory_summary(0, &stats, true);
        assert!(!short.contains("from small pool"));
        assert!(short.contains("Oversize GPU segments"));
    }
}
