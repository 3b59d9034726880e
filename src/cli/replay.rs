//! `gpumem replay`: the fidelity check and the what-if table.

use std::io::IsTerminal;
use std::process::ExitCode;

use gpumem::AllocatorConfig;
use gpumem::allocator::size::format_size;
use gpumem::config::Syntax;
use gpumem::recording::{Recording, state_summary};
use gpumem::replay::{
    Readings, ReplayOptions, ReplayReport, replay_following, replay_with_progress,
};

use super::{CliResult, Path, ReadArgs, out, outln, parse_bytes};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// The snapshot: `torch.cuda.memory._dump_snapshot` pickle, or the same schema as JSON,
    /// optionally gzipped.
    trace: Path,
    /// Replay only this device's trace (default: every device with a trace).
    #[arg(long)]
    device: Option<u32>,
    /// Compare every decision with the recording; exit 1 at the first divergence.
    #[arg(long)]
    check: bool,
    /// Another configuration to compare (PYTORCH_CUDA_ALLOC_CONF syntax); repeatable.
    #[arg(long = "config", value_name = "CONF")]
    configs: Vec<String>,
    /// Device memory (bytes, or with a KiB/MiB/GiB suffix); default: the recorded device, or
    /// 80 GiB.
    #[arg(long, value_parser = parse_bytes)]
    capacity: Option<u64>,
    /// Start each comparison from the blocks live at the trace's start, allocated afresh under
    /// its configuration, not from the recorded segments and cache (for traces that begin
    /// mid-run, whose recorded cache would otherwise decide every configuration's peak).
    #[arg(long, conflicts_with = "check")]
    fresh_start: bool,
    /// The device memory the job's allocator may have (bytes, or with a KiB/MiB/GiB
    /// suffix), the rest of the device held by others: at an OOM, its reserved bytes plus the
    /// `oom` entry's `device_free`. Each what-if row replays within it.
    #[arg(long, value_parser = parse_bytes, conflicts_with = "check")]
    available: Option<u64>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Add a row that follows this placement plan (`gpumem plan -o`). Every row then replays
    /// from an empty allocator, on the events the plan was not made from when it was made
    /// from this recording (the rest of its iterations), else on the whole trace. With
    /// `--check`: the plan a gpumem job followed, to check its recording (made from the
    /// job's start: a plan's cursor is not part of a snapshot).
    #[arg(long, value_name = "PLAN.json")]
    plan: Option<Path>,
    /// Write an SVG chart of reserved and allocated bytes over the trace.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<Path>,
    #[command(flatten)]
    pytorch: super::PyTorchArg,
    #[command(flatten)]
    read: ReadArgs,
}

pub(crate) fn run(args: Args) -> CliResult {
    let recording = args.read.read(&args.trace)?;
    let plan_file = args
        .plan
        .as_deref()
        .map(gpumem::plan::read_plan_file)
        .transpose()?;
    let source = plan_file.as_ref().and_then(|f| f.source.as_ref());
    let plan = plan_file.as_ref().map(|f| std::sync::Arc::new(f.plan()));
    let device = args.device.or_else(|| source.map(|s| s.device));
    let devices: Vec<u32> = match device {
        Some(d) => vec![d],
        None => recording
            .device_traces
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(d, _)| d as u32)
            .collect(),
    };
    if devices.is_empty() {
        out!("{}", state_summary(&recording))?;
        if args.check || !args.configs.is_empty() {
            eprintln!("gpumem: the recording has no trace to replay");
            return Ok(ExitCode::from(1));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut configs: Vec<Option<AllocatorConfig>> = vec![None];
    for c in &args.configs {
        configs.push(Some(args.pytorch.config(c)?));
    }
    if args.check {
        return check(&args, &recording, &devices, plan);
    }
    let mut results = Vec::new();
    let mut windows = Vec::new();
    let name = super::file_name(&args.trace);
    for &device in &devices {
        let events = recording
            .device_traces
            .get(device as usize)
            .map_or(0, Vec::len);
        // A plan made from this recording is evaluated on what it was not made from.
        let window = plan
            .as_ref()
            .map(|_| plan_window(source, &name, device, events))
            .transpose()?;
        let mut reports = Vec::new();
        // One check replay finds how the trace's release runs read; every row follows it.
        let mut readings = None;
        for config in &configs {
            let options = ReplayOptions {
                device,
                config: config.clone(),
                capacity: args.capacity,
                check: false,
                series_points: if args.plot.is_some() { 1000 } else { 0 },
                fresh_start: args.fresh_start,
                available: args.available,
                window: window.clone(),
                order: args.pytorch.order(),
                max_memory_bytes: Some(args.read.max_memory_bytes()),
                ..ReplayOptions::default()
            };
            let readings = match &readings {
                Some(r) => r,
                None => readings.insert(Readings::of(&recording, &options)?),
            };
            reports.push(replay_shown(&recording, &options, Some(readings))?);
        }
        if let (Some(plan), Some(readings)) = (&plan, &readings) {
            let options = ReplayOptions {
                device,
                capacity: args.capacity,
                series_points: if args.plot.is_some() { 1000 } else { 0 },
                available: args.available,
                window: window.clone(),
                plan: Some(plan.clone()),
                order: args.pytorch.order(),
                max_memory_bytes: Some(args.read.max_memory_bytes()),
                ..ReplayOptions::default()
            };
            let mut report = replay_shown(&recording, &options, Some(readings))?;
            report.config = format!("planned {}", super::parenthesised(&report.config));
            reports.push(report);
        }
        windows.push(window);
        results.push((device, reports));
    }
    if let Some(path) = &args.plot {
        let several = results.len() > 1;
        let names: Vec<String> = results
            .iter()
            .flat_map(|(device, reports)| {
                reports.iter().map(move |r| {
                    let config = if r.config.is_empty() {
                        "(default)"
                    } else {
                        &r.config
                    };
                    if several {
                        format!("device {device}, {config}")
                    } else {
                        config.to_string()
                    }
                })
            })
            .collect();
        let runs: Vec<gpumem::view::timeline::Run<'_>> = results
            .iter()
            .flat_map(|(_, reports)| reports.iter())
            .zip(&names)
            .map(|(r, name)| gpumem::view::timeline::Run {
                name,
                points: &r.series,
            })
            .collect();
        let title = super::file_name(&args.trace);
        let svg = gpumem::view::timeline::svg(&title, &runs);
        let inputs: Vec<&std::path::Path> = std::iter::once(args.trace.as_path())
            .chain(args.plan.as_deref())
            .collect();
        super::write_output(path, svg.as_bytes(), &inputs)?;
    }
    if args.json {
        let json: Vec<_> = results
            .iter()
            .zip(&windows)
            .map(|((device, reports), window)| {
                let rows: Vec<_> = reports
                    .iter()
                    .map(|r| {
                        serde_json::json!({
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
                            "capacity": r.capacity,
                            "capacity_inferred": r.capacity_inferred,
                            "notes": r.notes,
                            "available": args.available,
                            "ordering": r.ordering.ordering,
                            "ordering_source": r.ordering.ordering_source,
                            "counter_order": r.ordering.counter_order,
                        })
                    })
                    .collect();
                serde_json::json!({ "device": device, "events": window, "results": rows })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&json)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    out!("{}", state_summary(&recording))?;
    for ((device, reports), window) in results.iter().zip(&windows) {
        outln!("device {device}: {} events", reports[0].events)?;
        outln!("best-fit order: {}", reports[0].ordering.sentence())?;
        if let Some(w) = window {
            outln!(
                "every row replays events {}..{} from an empty allocator (the plan's evaluation)",
                w.start,
                w.end
            )?;
        }
        if reports[0].capacity_inferred {
            outln!(
                "device memory {}, inferred from the spacing of the recording's expandable reservations (--capacity overrides)",
                format_size(reports[0].capacity)
            )?;
        }
        for (report, config) in reports.iter().zip(&configs) {
            let row = config
                .as_ref()
                .map_or("recorded", |c| c.last_settings.as_str());
            for note in &report.notes {
                outln!("note ({row}): {note}")?;
            }
        }
        if let Some(available) = args.available {
            outln!(
                "the allocator may have {} of the device's {} (the rest is held by others)",
                format_size(available.min(reports[0].capacity)),
                format_size(reports[0].capacity)
            )?;
        }
        if args.fresh_start && reports[0].start_segments > 0 {
            outln!(
                "each configuration starts from the blocks live at the trace's start, allocated afresh (the recording's {} start segments and their cache are set aside)",
                reports[0].start_segments
            )?;
        }
        outln!(
            "{:<40} {:>12} {:>12} {:>6} {:>8} {:>8} {:>8} {:>5} {:>11}",
            "config",
            "peak alloc",
            "peak resv",
            "ratio",
            "dev allc",
            "dev free",
            "retries",
            "OOMs",
            "driver ms"
        )?;
        for r in reports {
            outln!(
                "{:<40} {:>12} {:>12} {:>6.3} {:>8} {:>8} {:>8} {:>5} {:>11.3}",
                truncate(&r.config, 40),
                format_size(r.peak_allocated),
                format_size(r.peak_reserved),
                r.reserved_ratio(),
                r.device_allocs,
                r.device_frees,
                r.alloc_retries,
                r.ooms,
                r.driver_time_ns as f64 / 1e6
            )?;
        }
        if let Some(r) = reports.iter().find(|r| r.plan_hits + r.plan_misses > 0) {
            outln!(
                "the plan served {} requests from its regions and missed {}",
                r.plan_hits,
                r.plan_misses
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Traces at least this long get a progress bar (when stderr is a terminal).
const PROGRESS_MIN_EVENTS: usize = 100_000;

/// Replays with a progress bar on stderr for long traces, when stderr is a terminal.
/// `readings` given, the replay follows them; otherwise it finds its own.
fn replay_shown(
    recording: &Recording,
    options: &ReplayOptions,
    readings: Option<&Readings>,
) -> Result<ReplayReport, gpumem::replay::ReplayError> {
    let events = recording
        .device_traces
        .get(options.device as usize)
        .map_or(0, Vec::len);
    let bar = (events >= PROGRESS_MIN_EVENTS && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new(events as u64);
        bar.set_message(format!("device {}", options.device));
        bar
    });
    let mut progress = |done: usize, _: usize| {
        if let Some(bar) = &bar {
            bar.set_position(done as u64);
        }
    };
    let result = match readings {
        Some(readings) => replay_following(recording, options, readings, &mut progress),
        None => replay_with_progress(recording, options, &mut progress),
    };
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    result
}

fn truncate(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        text.to_string()
    } else {
        let cut: String = text.chars().take(width - 1).collect();
        format!("{cut}…")
    }
}

fn check(
    args: &Args,
    recording: &Recording,
    devices: &[u32],
    plan: Option<std::sync::Arc<gpumem::allocator::Plan>>,
) -> CliResult {
    let recorded = recording
        .config
        .as_ref()
        .and_then(|c| AllocatorConfig::parse_as(&c.last_settings, Syntax::Gpumem).ok());
    let recorded_plan = recorded.as_ref().and_then(|c| c.plan.clone());
    if let (Some(path), None) = (&recorded_plan, &plan) {
        eprintln!(
            "gpumem: the recorded job followed the placement plan {path}; pass it with --plan to check its decisions"
        );
    }
    if let Some(n) = recorded.and_then(|c| c.plan_record) {
        eprintln!(
            "gpumem: the recorded job planned itself (plan_record:{n}) and followed that plan from a moment its planner chose; the recording does not keep the plan, so its decisions from then on cannot be checked"
        );
    }
    let mut all = Vec::new();
    for &device in devices {
        let options = ReplayOptions {
            device,
            config: None,
            capacity: args.capacity,
            check: true,
            series_points: 0,
            fresh_start: false,
            available: None,
            plan: plan.clone(),
            order: args.pytorch.order(),
            max_memory_bytes: Some(args.read.max_memory_bytes()),
            ..ReplayOptions::default()
        };
        let report = replay_shown(recording, &options, None)?;
        all.push((device, report));
    }
    if args.json {
        let json: Vec<_> = all
            .iter()
            .map(|(device, r)| {
                serde_json::json!({
                    "device": device,
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
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&json)?)?;
    }
    let mut failed = false;
    for (device, r) in &all {
        if r.capacity_inferred && !args.json {
            outln!(
                "device {device}: device memory {} ({} bytes), inferred from the spacing of the recording's expandable reservations (--capacity overrides)",
                format_size(r.capacity),
                r.capacity
            )?;
        }
        if !args.json {
            outln!("device {device}: {}", r.ordering.sentence())?;
            for note in &r.notes {
                outln!("device {device}: note: {note}")?;
            }
        }
        match &r.divergence {
            None => {
                if !args.json {
                    let c = r.compared;
                    outln!(
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
            }
            Some(d) => {
                failed = true;
                if !args.json {
                    outln!("device {device}: diverges at event {}", d.index)?;
                    outln!("  expected: {}", d.expected)?;
                    outln!("  actual:   {}", d.actual)?;
                    for line in &d.context {
                        outln!("  {line}")?;
                    }
                }
            }
        }
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The events a plan is evaluated on: for a plan made from this recording's device, as
/// `gpumem plan` evaluates it (the iterations after the planned one, or the planned one
/// itself where none follow), else the whole trace.
fn plan_window(
    source: Option<&gpumem::plan::PlanSource>,
    name: &str,
    device: u32,
    events: usize,
) -> Result<std::ops::Range<usize>, String> {
    match source {
        Some(s) if s.recording == name && s.device == device => {
            let [from, to] = if s.evaluated[0] < s.evaluated[1] {
                s.evaluated
            } else {
                s.events
            };
            if to > events || from >= to {
                return Err(format!(
                    "the plan is evaluated on events {from}..{to} of device {device}, whose trace holds {events}: not this recording"
                ));
            }
            Ok(from..to)
        }
        _ => Ok(0..events),
    }
}
