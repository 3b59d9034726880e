//! `gpumem explain`: why a recorded allocation failed, in figures and one sentence.

use std::process::ExitCode;

use gpumem::allocator::size::format_size;
use gpumem::explain::{At, explain};
use gpumem::replay::ReplayOptions;

use super::{CliResult, Path, ReadArgs, outln, parse_bytes};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// The snapshot: `torch.cuda.memory._dump_snapshot` pickle, or the same schema as JSON,
    /// optionally gzipped.
    trace: Path,
    /// The device whose trace to explain.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// The moment: `oom` (the first out-of-memory error), `peak` (where the allocator reserved
    /// the most), `snapshot` (the state the snapshot holds) or an event's index in the trace.
    /// Default: `oom`, or `peak` when the trace has no OOM, or `snapshot` when there is no
    /// trace.
    #[arg(long, value_parser = parse_at)]
    at: Option<At>,
    /// Device memory (bytes, or with a KiB/MiB/GiB suffix); default: the recorded device,
    /// else inferred from expandable reservations, else 80 GiB.
    #[arg(long, value_parser = parse_bytes)]
    capacity: Option<u64>,
    /// Print every figure as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the explanation as a self-contained HTML page (no network needed to open
    /// it) to this file.
    #[arg(long, value_name = "FILE")]
    html: Option<Path>,
    #[command(flatten)]
    pytorch: super::PyTorchArg,
    #[command(flatten)]
    read: ReadArgs,
}

fn parse_at(text: &str) -> Result<At, String> {
    match text {
        "oom" => Ok(At::FirstOom),
        "peak" => Ok(At::PeakReserved),
        "snapshot" => Ok(At::Snapshot),
        n => n
            .parse()
            .map(At::Event)
            .map_err(|_| format!("{n:?} is neither `oom`, `peak`, `snapshot` nor an event index")),
    }
}

pub(crate) fn run(args: Args) -> CliResult {
    let recording = args.read.read(&args.trace)?;
    let options = ReplayOptions {
        device: args.device,
        capacity: args.capacity,
        order: args.pytorch.order(),
        max_memory_bytes: Some(args.read.max_memory_bytes()),
        ..ReplayOptions::default()
    };
    let traceless = recording
        .device_traces
        .get(args.device as usize)
        .is_none_or(Vec::is_empty);
    let e = match args.at {
        Some(at) => explain(&recording, at, &options)?,
        None if traceless => {
            outln!("no trace recorded: the state the snapshot holds")?;
            explain(&recording, At::Snapshot, &options)?
        }
        None => match explain(&recording, At::FirstOom, &options) {
            Err(gpumem::explain::ExplainError::NoOom { .. }) => {
                outln!("no out-of-memory error in the trace: the moment of peak reserved memory")?;
                explain(&recording, At::PeakReserved, &options)?
            }
            other => other?,
        },
    };
    let confirm = confirm_command(&args, &e);
    if let Some(file) = &args.html {
        let name = super::file_name(&args.trace);
        let page = gpumem::view::explain::page_of(&name, &e, confirm.as_deref());
        super::write_output(file, page.as_bytes(), &[&args.trace])?;
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&e)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let f = format_size;
    let r = &e.request;
    if r.hypothetical {
        outln!(
            "device {}, at the snapshot: no request recorded; the smallest large request its cache could not serve on stream {:#x} is {} ({} rounded)",
            e.device,
            r.wanted.stream,
            f(r.bytes),
            f(r.wanted.rounded)
        )?;
    } else {
        outln!(
            "device {}, event {}: a request of {} ({} rounded, {} pool, stream {:#x})",
            e.device,
            r.event,
            f(r.bytes),
            f(r.wanted.rounded),
            r.wanted.pool,
            r.wanted.stream
        )?;
        if !r.pool_id.is_default() {
            outln!("  routed to private pool {}", r.pool_id)?;
        }
    }
    for line in &r.context {
        outln!("  {line}")?;
    }
    outln!("{}", e.sentence)?;
    if !e.cause_sentence.is_empty() {
        outln!("{}", e.cause_sentence)?;
    }
    if let Some(d) = &e.divergence {
        outln!(
            "warning: the replay differed from the recording at event {}; these figures are the replay's",
            d.index
        )?;
    }
    if !e.private_pools.is_empty() {
        outln!(
            "\nprivate pools (only their own requests use them; empty_cache() frees their cache only once the graph or MemPool owning them is released, which a recording does not show):"
        )?;
        for p in &e.private_pools {
            let kind = if p.kind == "graph" {
                "a CUDA graph's own pool"
            } else {
                "a MemPool or shared graph pool"
            };
            outln!(
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
        outln!("\nwhere the device's {} were:", f(e.total))?;
    } else {
        outln!(
            "\nwhere the memory was (the device's size is not recorded: --capacity gives it, and with it what sat outside the allocator):"
        )?;
    }
    let width = b.parts().iter().map(|p| p.1.len()).max().unwrap_or(0);
    let row = |name: &str, bytes: Option<u64>| match bytes {
        Some(v) => outln!("  {name:<width$} {:>12}", f(v)),
        None => outln!("  {name:<width$} {:>12}", "unknown"),
    };
    for (_, label, bytes) in b.parts() {
        row(label, bytes)?;
    }
    outln!(
        "\nreserved {}, allocated {}, largest usable free block {} ({} segments with free memory)",
        f(e.reserved),
        f(e.allocated),
        f(e.largest_free_block),
        e.segments_with_free
    )?;
    if let Some(available) = e.available.filter(|_| !e.candidates.is_empty()) {
        outln!(
            "\nwhat would have avoided it (the whole trace replayed under each setting, within the {} the job had):",
            f(available)
        )?;
        for c in &e.candidates {
            let verdict = if c.ooms == 0 {
                "no OOM".to_string()
            } else {
                format!("{} OOMs", c.ooms)
            };
            outln!(
                "  {:<52} {:>9}, peak reserved {:>11}",
                c.config,
                verdict,
                f(c.peak_reserved)
            )?;
        }
        if let Some(command) = &confirm {
            outln!("confirm: {command}")?;
        } else {
            outln!("none of these settings avoids it")?;
        }
    }
    if let Some(g) = &e.growth {
        outln!(
            "\nrepeating iterations: {} of {} allocations from event {} (about {} events each); {} of them keep memory past their end, {} ({} allocations) each (median), {} in all",
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
            outln!(
                "  {:>12} kept by {} allocations from {}",
                f(k.bytes),
                k.allocations,
                k.frame
            )?;
        }
    }
    if !e.pinning.is_empty() {
        outln!(
            "\nwhat pins the free memory (live blocks in segments with free space, by where they were allocated):"
        )?;
        for g in &e.pinning {
            outln!(
                "  {:>12} free pinned by {} blocks ({}) from {}",
                f(g.pinned_free_bytes),
                g.blocks,
                f(g.live_bytes),
                g.frame
            )?;
            for line in &g.context {
                outln!("  {:>12} {line}", "")?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The replay that confirms the best candidate without OOMs, where there is one.
fn confirm_command(args: &Args, e: &gpumem::explain::Explanation) -> Option<String> {
    let available = e.available?;
    let best = e.candidates.iter().find(|c| c.ooms == 0)?;
    Some(format!(
        "gpumem replay {} --device {} --capacity {} --available {} --config {}",
        shell_quoted(&args.trace.display().to_string()),
        e.device,
        e.total,
        available,
        shell_quoted(&best.config)
    ))
}

/// `text` as one word for a POSIX shell: as it is where that is safe, else single-quoted.
fn shell_quoted(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-:,=+@%".contains(&b));
    if plain {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::shell_quoted;

    #[test]
    fn words_are_quoted_only_where_a_shell_would_split_or_expand_them() {
        assert_eq!(shell_quoted("/t/a.pickle"), "/t/a.pickle");
        assert_eq!(
            shell_quoted("expandable_segments:True,max_split_size_mb:128"),
            "expandable_segments:True,max_split_size_mb:128"
        );
        assert_eq!(shell_quoted("my trace <1>.json"), "'my trace <1>.json'");
        assert_eq!(shell_quoted("it's"), r"'it'\''s'");
        assert_eq!(shell_quoted(""), "''");
    }
}
