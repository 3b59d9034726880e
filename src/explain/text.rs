//! An explanation in words: what `gpumem explain` prints, from the same [`Explanation`] that
//! its JSON (serde) and its page (`view::explain`) are made of.

use std::fmt::Write as _;

use crate::allocator::size::format_size;

use super::Explanation;

/// The explanation `e` as text, ending with the command that confirms its best candidate
/// (`confirm`, where there is one).
pub fn text(e: &Explanation, confirm: Option<&str>) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_text(&mut out, e, confirm);
    out
}

fn write_text(out: &mut String, e: &Explanation, confirm: Option<&str>) -> std::fmt::Result {
    if let Some(chosen) = &e.chosen {
        writeln!(out, "{chosen}")?;
    }
    let f = format_size;
    let r = &e.request;
    if r.hypothetical {
        writeln!(
            out,
            "device {}, at the snapshot: no request recorded; the smallest large request its cache could not serve on stream {:#x} is {} ({} rounded)",
            e.device,
            r.wanted.stream,
            f(r.bytes),
            f(r.wanted.rounded)
        )?;
    } else {
        writeln!(
            out,
            "device {}, event {}: a request of {} ({} rounded, {} pool, stream {:#x})",
            e.device,
            r.event,
            f(r.bytes),
            f(r.wanted.rounded),
            r.wanted.pool,
            r.wanted.stream
        )?;
        if !r.pool_id.is_default() {
            writeln!(out, "  routed to private pool {}", r.pool_id)?;
        }
    }
    for line in &r.context {
        writeln!(out, "  {line}")?;
    }
    writeln!(out, "{}", e.sentence)?;
    if !e.cause_sentence.is_empty() {
        writeln!(out, "{}", e.cause_sentence)?;
    }
    if let Some(d) = &e.divergence {
        writeln!(
            out,
            "warning: the replay differed from the recording at event {}; these figures are the replay's",
            d.index
        )?;
    }
    write_memory(out, e)?;
    write_remedies(out, e, confirm)
}

/// Where the memory was: the private pools, the breakdown, the reserved figures.
fn write_memory(out: &mut String, e: &Explanation) -> std::fmt::Result {
    let f = format_size;
    if !e.private_pools.is_empty() {
        writeln!(
            out,
            "\nprivate pools (only their own requests use them; empty_cache() frees their cache only once the graph or MemPool owning them is released, which a recording does not show):"
        )?;
        for p in &e.private_pools {
            let kind = if p.kind == "graph" {
                "a CUDA graph's own pool"
            } else {
                "a MemPool or shared graph pool"
            };
            writeln!(
                out,
                "  pool {} ({kind}): {} in {} segments, {} cached free",
                p.id,
                f(p.reserved),
                p.segments,
                f(p.free)
            )?;
        }
    }
    let b = &e.breakdown;
    if e.total_known {
        writeln!(out, "\nwhere the device's {} were:", f(e.total))?;
    } else {
        writeln!(
            out,
            "\nwhere the memory was (the device's size is not recorded: --capacity gives it, and with it what sat outside the allocator):"
        )?;
    }
    let width = b
        .parts()
        .iter()
        .map(|p| p.0.meaning().len())
        .max()
        .unwrap_or(0);
    for (part, bytes) in b.parts() {
        let bytes = bytes.map_or_else(|| "unknown".to_string(), f);
        let label = part.meaning();
        writeln!(out, "  {label:<width$} {bytes:>12}")?;
    }
    writeln!(
        out,
        "\nreserved {}, allocated {}, largest usable free block {} ({} segments with free memory)",
        f(e.reserved),
        f(e.allocated),
        f(e.largest_free_block),
        e.segments_with_free
    )?;
    Ok(())
}

/// What would have avoided it, what grows, what pins the free memory.
fn write_remedies(out: &mut String, e: &Explanation, confirm: Option<&str>) -> std::fmt::Result {
    let f = format_size;
    if let Some(available) = e.available.filter(|_| !e.candidates.is_empty()) {
        writeln!(
            out,
            "\nwhat would have avoided it (the whole trace replayed under each setting, within the {} the job had):",
            f(available)
        )?;
        for c in &e.candidates {
            let verdict = if c.ooms == 0 {
                "no OOM".to_string()
            } else {
                format!("{} OOMs", c.ooms)
            };
            writeln!(
                out,
                "  {:<52} {:>9}, peak reserved {:>11}",
                c.config,
                verdict,
                f(c.peak_reserved)
            )?;
        }
        if let Some(command) = confirm {
            writeln!(out, "confirm: {command}")?;
        } else {
            writeln!(out, "none of these settings avoids it")?;
        }
    }
    if let Some(g) = &e.growth {
        let (found, per) = match g.first_step {
            Some(step) => (
                format!("the job's profiler steps from ProfilerStep#{step}"),
                "about ",
            ),
            None => ("repeating allocations".to_string(), ""),
        };
        writeln!(
            out,
            "\niterations ({found}): {} of {per}{} allocations from event {} (about {} events each); {} of them keep memory past their end, {} ({} allocations) each (median), {} in all",
            g.iterations,
            g.allocations_per_iteration,
            g.first_event,
            g.events_per_iteration,
            g.iterations_keeping,
            f(g.kept_per_iteration),
            g.kept_allocations_per_iteration,
            f(g.kept_bytes)
        )?;
        for k in &g.kept_at {
            writeln!(
                out,
                "  {:>12} kept by {} allocations from {}",
                f(k.bytes),
                k.allocations,
                k.frame
            )?;
        }
    }
    if !e.pinning.is_empty() {
        writeln!(
            out,
            "\nwhat pins the free memory (live blocks in segments with free space, by where they were allocated):"
        )?;
        for g in &e.pinning {
            writeln!(
                out,
                "  {:>12} free pinned by {} blocks ({}) from {}",
                f(g.pinned_free_bytes),
                g.blocks,
                f(g.live_bytes),
                g.frame
            )?;
            for line in &g.context {
                writeln!(out, "  {:>12} {line}", "")?;
            }
        }
    }
    Ok(())
}
