//! `gpumem plan`: a placement plan from a recording, evaluated on the iterations it was not
//! made from.

use std::ops::Range;
use std::process::ExitCode;
use std::sync::Arc;

use gpumem::allocator::PlanMode;
use gpumem::allocator::size::format_size;
use gpumem::explain::search_configurations;
use gpumem::plan::{Evaluation, PlanOptions, Planned, best_device, evaluate, plan};
use gpumem::replay::{Mode, WhatIf};

use super::{CliResult, Path, RecordingArgs, outln, parenthesised};

#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    recording: RecordingArgs,
    /// The device whose trace to plan. Default: the device whose repeating iteration covers
    /// the most allocations (device 0 with `--events`).
    #[arg(long)]
    device: Option<u32>,
    /// Plan these trace events (`FIRST..END`) instead of the repeating iteration found.
    #[arg(long, value_parser = parse_range, value_name = "FIRST..END")]
    events: Option<Range<usize>>,
    /// The configuration the job runs with (PYTORCH_CUDA_ALLOC_CONF syntax; its rounding
    /// shapes the plan); default: the recorded one.
    #[arg(long, value_name = "CONF")]
    config: Option<String>,
    /// Write the plan here (JSON), for `GPUMEM_ALLOC_CONF=plan:PATH` or `replay --plan`.
    #[arg(short, long, value_name = "PLAN.json")]
    output: Option<Path>,
    /// Also evaluate `expandable_segments:True` and the best configuration `explain`'s
    /// search finds, on the same events.
    #[arg(long)]
    compare: bool,
    /// How the plan's regions hold memory: `whole` (time first: one segment each, the
    /// caching allocator's driver work) or `paged` (memory first: 2 MiB pages mapped at first
    /// use and lent, each a driver call of its own). `--compare` evaluates the other too.
    #[arg(long, default_value = "whole", value_parser = parse_mode())]
    mode: PlanMode,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// The modes by their names on the command line.
const MODES: [(&str, PlanMode); 2] = [("whole", PlanMode::Whole), ("paged", PlanMode::Paged)];

fn parse_mode() -> impl clap::builder::TypedValueParser<Value = PlanMode> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(MODES.map(|(name, _)| name)).map(|name| {
        MODES
            .iter()
            .find(|m| m.0 == name)
            .map_or(PlanMode::Whole, |m| m.1)
    })
}

fn mode_name(mode: PlanMode) -> &'static str {
    MODES.iter().find(|m| m.1 == mode).map_or("whole", |m| m.0)
}

fn parse_range(text: &str) -> Result<Range<usize>, String> {
    let (a, b) = text
        .split_once("..")
        .ok_or_else(|| format!("{text:?} is not FIRST..END"))?;
    let (a, b): (usize, usize) = (
        a.trim()
            .parse()
            .map_err(|_| format!("{a:?} is not an event index"))?,
        b.trim()
            .parse()
            .map_err(|_| format!("{b:?} is not an event index"))?,
    );
    if a >= b {
        return Err(format!("{text:?} is empty"));
    }
    Ok(a..b)
}

/// A configuration's row beside the plan.
#[derive(serde::Serialize)]
struct Row {
    config: String,
    peak_allocated: u64,
    peak_reserved: u64,
    ooms: u64,
    driver_calls: u64,
    driver_time_ns: u64,
}

impl Row {
    fn of(config: &str, r: &gpumem::replay::ReplayReport) -> Row {
        Row {
            config: config.to_string(),
            peak_allocated: r.peak_allocated,
            peak_reserved: r.peak_reserved,
            ooms: r.ooms,
            driver_calls: r.driver_calls,
            driver_time_ns: r.driver_time_ns,
        }
    }
}

pub(crate) fn run(args: Args) -> CliResult {
    let recording = args.recording.read()?;
    let pytorch = &args.recording.pytorch;
    let config = args
        .config
        .as_deref()
        .map(|c| pytorch.config(c))
        .transpose()?;
    let (device, chosen) = match args.device {
        Some(device) => (device, None),
        // Events named are device 0's unless it is named.
        None if args.events.is_some() => (0, None),
        None => best_device(&recording, config.as_ref()).unwrap_or((0, None)),
    };
    let options = PlanOptions {
        device,
        config: config.clone(),
        events: args.events.clone(),
        mode: args.mode,
    };
    let mut planned = plan(&recording, &args.recording.name(), &options)?;
    let shared = Arc::new(planned.plan.clone());
    // Single iteration (or nothing after it): the plan on its own events is the offline
    // bound, labelled as such.
    let offline = planned.evaluated.is_empty();
    let window = if offline {
        planned.events.clone()
    } else {
        planned.evaluated.clone()
    };
    // The session reads the trace's release runs once; every replay below follows it.
    let session = args.recording.session(&recording, device)?;
    let evaluation = evaluate(&session, config.clone(), &shared, window.clone())?;
    let mut rows = Vec::new();
    if args.compare {
        let within = WhatIf::default().on_events(Some(window));
        let candidates = search_configurations(&session, &within)?;
        let replay_row = |conf: &str| -> Result<Row, Box<dyn std::error::Error>> {
            let what_if = within.clone().under(Some(pytorch.config(conf)?));
            let r = session.replay(&Mode::WhatIf(what_if), 0, &mut |_, _| {})?;
            Ok(Row::of(conf, &r))
        };
        rows.push(replay_row("expandable_segments:True")?);
        // (Its best may be the row above.)
        if let Some(best) = candidates
            .first()
            .filter(|b| b.config != "expandable_segments:True")
        {
            rows.push(replay_row(&best.config)?);
        }
        // The plan in the other mode, on the same events.
        let mode = match args.mode {
            PlanMode::Whole => PlanMode::Paged,
            PlanMode::Paged => PlanMode::Whole,
        };
        let name = format!("planned, {0} (--mode {0})", mode_name(mode));
        let other = Arc::new(gpumem::allocator::Plan {
            mode,
            ..planned.plan.clone()
        });
        let r = evaluate(&session, config.clone(), &other, evaluation.events.clone())?;
        rows.push(Row::of(&name, &r.planned));
    }
    // What the plan saved, for the file: its misses may take the caching allocator's segment
    // sizes within it (every row above followed it without).
    planned.plan.saved_bytes = Some(evaluation.saved_bytes());
    if let Some(path) = &args.output {
        let text = serde_json::to_string_pretty(&planned.file())?;
        super::write_output(path, (text + "\n").as_bytes(), &[&args.recording.trace])?;
    }
    if args.json {
        let mut json = serde_json::json!({
            "plan": planned,
            "offline_bound": offline,
            "evaluation": evaluation,
            "compare": rows,
        });
        if let Some(why) = &chosen {
            json["chosen"] = serde_json::json!(why);
        }
        outln!("{}", serde_json::to_string_pretty(&json)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(why) = &chosen {
        outln!("{why}")?;
    }
    outln!(
        "driver time priced by the {} table (--costs)",
        args.recording.costs.gpu
    )?;
    print_text(&planned, &evaluation, offline, &rows)?;
    if let Some(path) = &args.output {
        outln!("wrote {}", path.display())?;
    }
    Ok(ExitCode::SUCCESS)
}

fn print_text(
    planned: &Planned,
    evaluation: &Evaluation,
    offline: bool,
    rows: &[Row],
) -> std::io::Result<()> {
    let found = match (planned.source, planned.step) {
        (Some(_), Some(step)) => format!("the job's profiler step ProfilerStep#{step}"),
        (Some(_), None) => "repeating allocations".to_string(),
        (None, _) => "the events given".to_string(),
    };
    outln!(
        "iteration ({found}): {} allocations from allocation {} (events {}..{}), {} in a row",
        planned.period,
        planned.first_allocation,
        planned.events.start,
        planned.events.end,
        planned.iterations
    )?;
    for r in &planned.plan.regions {
        outln!("region on stream {:#x}: {}", r.stream, format_size(r.bytes))?;
    }
    let persistent = planned.persistent_bytes;
    let persistent_count = planned.plan.entries.iter().filter(|e| e.persistent).count();
    let tried = planned
        .plan
        .entries
        .iter()
        .filter(|e| e.persistent && e.offset.is_some())
        .count();
    outln!(
        "lower bound (most bytes live at once): {}; the regions are {:.3}× it; {persistent_count} allocations ({}) outlive an iteration: persistent, placed in chunks ({tried} of them tried in a region first)",
        format_size(planned.lower_bound_bytes),
        planned.region_bytes as f64 / planned.lower_bound_bytes.max(1) as f64,
        format_size(persistent)
    )?;
    let what = if offline {
        "the planned iteration itself (offline bound: one iteration only, nothing after it to evaluate on)"
    } else {
        "the iterations after the planned one"
    };
    outln!(
        "evaluated on events {}..{}, {what}, from an empty allocator:",
        evaluation.events.start,
        evaluation.events.end
    )?;
    outln!(
        "  {:<40} {:>14} {:>14} {:>7} {:>5} {:>13} {:>8} {:>16} {:>8}",
        "",
        "peak allocated",
        "peak reserved",
        "ratio",
        "OOMs",
        "driver calls",
        "ratio",
        "driver time",
        "ratio"
    )?;
    let d = Row::of(
        &format!("recorded {}", parenthesised(&evaluation.default.config)),
        &evaluation.default,
    );
    let line = |r: &Row| {
        outln!(
            "  {:<40} {:>14} {:>14} {:>6.3}× {:>5} {:>13} {:>7.2}× {:>13.3} ms {:>7.2}×",
            r.config,
            format_size(r.peak_allocated),
            format_size(r.peak_reserved),
            r.peak_reserved as f64 / r.peak_allocated.max(1) as f64,
            r.ooms,
            r.driver_calls,
            r.driver_calls as f64 / d.driver_calls.max(1) as f64,
            r.driver_time_ns as f64 / 1e6,
            r.driver_time_ns as f64 / d.driver_time_ns.max(1) as f64,
        )
    };
    line(&d)?;
    for r in rows {
        line(r)?;
    }
    let p = &evaluation.planned;
    line(&Row::of(
        &format!("planned, {}", mode_name(planned.plan.mode)),
        p,
    ))?;
    outln!(
        "  plan: {} requests served from the regions, {} misses",
        p.plan_hits,
        p.plan_misses
    )?;
    if let Some(paging) = p.plan_paging.filter(|g| g.maps > 0) {
        let per = |n: u64| n as f64 / paging.iterations.max(1) as f64;
        outln!(
            "  paged: {} iterations begun; per iteration {:.1} maps ({:.1} pages, {:.1} of them lent), {:.1} pages unmapped, {:.1} stream synchronisations",
            paging.iterations,
            per(paging.maps),
            per(paging.pages_mapped),
            per(paging.pages_lent),
            per(paging.pages_unmapped),
            per(paging.synchronizations)
        )?;
    }
    if let Some(paging) = p.plan_paging.filter(|g| g.cache_releases > 0) {
        outln!(
            "  the caching allocator's idle segments given back {} time(s) after an iteration the plan served alone",
            paging.cache_releases
        )?;
    }
    Ok(())
}
