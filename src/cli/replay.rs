//! `gpumem replay`: the fidelity check and the what-if table.

use std::io::IsTerminal;
use std::process::ExitCode;

use std::sync::Arc;

use gpumem::AllocatorConfig;
use gpumem::config::Syntax;
use gpumem::plan::read_plan_file;
use gpumem::recording::{Recording, state_summary};
use gpumem::replay::table::{Checked, Comparison, Row};
use gpumem::replay::{Mode, ReplayReport, Session, WhatIf};

use super::{CliResult, Path, RecordingArgs, out, outln, parse_bytes};

#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    recording: RecordingArgs,
    /// Replay only this device's trace (default: every device with a trace).
    #[arg(long)]
    device: Option<u32>,
    /// Compare every decision with the recording; exit 1 at the first divergence.
    #[arg(long)]
    check: bool,
    /// Another configuration to compare (PYTORCH_CUDA_ALLOC_CONF syntax); repeatable.
    #[arg(long = "config", value_name = "CONF")]
    configs: Vec<String>,
    /// Start each comparison from the blocks live at the trace's start, allocated afresh under
    /// its configuration, not from the recorded segments and cache (for traces that begin
    /// mid-run, whose recorded cache would otherwise decide every configuration's peak).
    #[arg(long, conflicts_with = "check")]
    fresh_start: bool,
    /// The device memory the job's allocator may have (bytes, or with a KiB/MiB/GiB
    /// suffix), the rest of the device held by others. Each what-if row replays within it.
    /// Default: on a recording with an OOM, what the job had there (its reserved bytes plus
    /// the `oom` entry's `device_free`), else the whole device.
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
}

pub(crate) fn run(args: Args) -> CliResult {
    let recording = args.recording.read()?;
    let plan_file = args.plan.as_deref().map(read_plan_file).transpose()?;
    let source = plan_file.as_ref().and_then(|f| f.source.as_ref());
    let plan = plan_file.as_ref().map(|f| Arc::new(f.plan()));
    let devices: Vec<u32> = match args.device.or_else(|| source.map(|s| s.device)) {
        Some(d) => vec![d],
        None => recording.traced_devices().collect(),
    };
    if devices.is_empty() {
        out!("{}", state_summary(&recording))?;
        if args.check || !args.configs.is_empty() {
            eprintln!("gpumem: the recording has no trace to replay");
            return Ok(ExitCode::from(1));
        }
        return Ok(ExitCode::SUCCESS);
    }
    if args.check {
        return check(&args, &recording, &devices, plan);
    }
    let mut configs: Vec<Option<AllocatorConfig>> = vec![None];
    for c in &args.configs {
        configs.push(Some(args.recording.pytorch.config(c)?));
    }
    let tables = devices
        .iter()
        .map(|&device| comparison(&args, &recording, device, &configs, plan.as_ref(), source))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = &args.plot {
        write_plot(&args, path, &tables)?;
    }
    if args.json {
        let json: Vec<_> = tables.iter().map(Comparison::json).collect();
        outln!("{}", serde_json::to_string_pretty(&json)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    out!("{}", state_summary(&recording))?;
    for table in &tables {
        out!("{}", table.text())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `device`'s what-if rows: one per configuration (the recorded one first), and one that
/// follows the plan where one was given.
fn comparison(
    args: &Args,
    recording: &Arc<Recording>,
    device: u32,
    configs: &[Option<AllocatorConfig>],
    plan: Option<&Arc<gpumem::allocator::Plan>>,
    source: Option<&gpumem::plan::PlanSource>,
) -> Result<Comparison, Box<dyn std::error::Error>> {
    let session = args.recording.session(recording, device)?;
    // A plan made from this recording is evaluated on what it was not made from.
    let window = plan
        .map(|_| {
            plan_window(
                source,
                &args.recording.name(),
                device,
                session.events().len(),
            )
        })
        .transpose()?;
    let mut rows = Vec::new();
    for config in configs {
        let label = config
            .as_ref()
            .map_or("recorded".to_string(), |c| c.last_settings.clone());
        let what_if = args
            .what_if()
            .under(config.clone())
            .on_events(window.clone());
        let report = replay_shown(&session, &Mode::WhatIf(what_if), args.series())?;
        rows.push(Row {
            label: Some(label),
            report,
        });
    }
    if let Some(plan) = plan {
        let what_if = args
            .what_if()
            .starting_afresh(false)
            .on_events(window.clone())
            .following(Some(Arc::clone(plan)));
        let mut report = replay_shown(&session, &Mode::WhatIf(what_if), args.series())?;
        report.config = format!("planned {}", super::parenthesised(&report.config));
        rows.push(Row {
            label: None,
            report,
        });
    }
    Ok(Comparison {
        device,
        window,
        available: args.available,
        fresh_start: args.fresh_start,
        rows,
    })
}

impl Args {
    /// What every what-if row shares.
    fn what_if(&self) -> WhatIf {
        WhatIf::default()
            .starting_afresh(self.fresh_start)
            .within(self.available)
    }

    /// Samples kept per replay: for the plot, where one is asked for.
    fn series(&self) -> usize {
        if self.plot.is_some() { 1000 } else { 0 }
    }
}

/// The chart of every row's reserved and allocated bytes.
fn write_plot(args: &Args, path: &std::path::Path, tables: &[Comparison]) -> std::io::Result<()> {
    let several = tables.len() > 1;
    let names: Vec<String> = tables
        .iter()
        .flat_map(|t| {
            t.rows.iter().map(move |r| {
                let config = if r.report.config.is_empty() {
                    "(default)"
                } else {
                    &r.report.config
                };
                if several {
                    format!("device {}, {config}", t.device)
                } else {
                    config.to_string()
                }
            })
        })
        .collect();
    let runs: Vec<gpumem::view::timeline::Run<'_>> = tables
        .iter()
        .flat_map(|t| t.rows.iter())
        .zip(&names)
        .map(|(r, name)| gpumem::view::timeline::Run {
            name,
            points: &r.report.series,
        })
        .collect();
    let svg = gpumem::view::timeline::svg(&args.recording.name(), &runs);
    let inputs: Vec<&std::path::Path> = std::iter::once(args.recording.trace.as_path())
        .chain(args.plan.as_deref())
        .collect();
    super::write_output(path, svg.as_bytes(), &inputs)
}

/// Traces at least this long get a progress bar (when stderr is a terminal).
const PROGRESS_MIN_EVENTS: usize = 100_000;

/// Replays with a progress bar on stderr for long traces, when stderr is a terminal.
fn replay_shown(
    session: &Session,
    mode: &Mode,
    series_points: usize,
) -> Result<ReplayReport, gpumem::replay::ReplayError> {
    let events = session.events().len();
    let bar = (events >= PROGRESS_MIN_EVENTS && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new(events as u64);
        bar.set_message(format!("device {}", session.device()));
        bar
    });
    let mut progress = |done: usize, _: usize| {
        if let Some(bar) = &bar {
            bar.set_position(done as u64);
        }
    };
    let result = session.replay(mode, series_points, &mut progress);
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    result
}

fn check(
    args: &Args,
    recording: &Arc<Recording>,
    devices: &[u32],
    plan: Option<Arc<gpumem::allocator::Plan>>,
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
        let session = args.recording.session(recording, device)?;
        let mode = Mode::Check { plan: plan.clone() };
        let report = replay_shown(&session, &mode, 0)?;
        all.push(Checked { device, report });
    }
    if args.json {
        let json: Vec<_> = all.iter().map(Checked::json).collect();
        outln!("{}", serde_json::to_string_pretty(&json)?)?;
    } else {
        for checked in &all {
            out!("{}", checked.text())?;
        }
    }
    let failed = all.iter().any(|c| c.report.divergence.is_some());
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
