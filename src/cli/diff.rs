//! `gpumem diff`: why one run peaks higher than another.

use std::process::ExitCode;

use gpumem::diff::{RunSpec, diff};
use gpumem::replay::{Mode, WhatIf};

use super::{CliResult, Path, RecordingArgs, out, outln, parenthesised};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// A: the first run's recording, and how both runs' replays are set up.
    #[command(flatten)]
    a: RecordingArgs,
    /// B: the second run's recording (a file or a store's address). Default: A's own, which
    /// `--config` then replays under another configuration.
    #[arg(value_name = "B")]
    b: Option<Path>,
    /// Replay B under this configuration (`PYTORCH_CUDA_ALLOC_CONF` syntax), a what-if of
    /// B's recording (of A's where no B is named), within the memory that job had at its
    /// first OOM where it ran out.
    #[arg(long)]
    config: Option<String>,
    /// The device of each recording to compare. Default: for each, the device `explain`
    /// would choose (the first that ran out of memory, else the first with a trace).
    #[arg(long)]
    device: Option<u32>,
    /// Print every figure as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the comparison as a self-contained HTML page to this file.
    #[arg(long, value_name = "FILE")]
    html: Option<Path>,
}

pub(crate) fn run(args: Args) -> CliResult {
    if args.b.is_none() && args.config.is_none() {
        return Err(
            "name B's recording, or a --config under which A's is replayed as B (a what-if)".into(),
        );
    }
    let config = args
        .config
        .as_deref()
        .map(|text| args.a.pytorch.config(text))
        .transpose()?;
    let device_of = |r: &gpumem::recording::Recording, which: &str| {
        gpumem::explain::choose(r, args.device, None)
            .map(|c| c.device)
            .ok_or_else(|| {
                format!("{which}'s recording holds neither a trace nor segments of any device")
            })
    };
    let recording_a = args.a.read()?;
    let session_a = args
        .a
        .session(&recording_a, device_of(&recording_a, "A")?)?;
    // B on A's own recording shares A's session: how the recording reads is found once.
    let session_b = match &args.b {
        Some(path) => {
            let recording_b = args.a.read_other(path)?;
            Some(
                args.a
                    .session(&recording_b, device_of(&recording_b, "B")?)?,
            )
        }
        None => None,
    };
    let session_b = session_b.as_ref().unwrap_or(&session_a);
    let name_b = args.b.as_deref().map_or_else(|| args.a.name(), super::name);
    let (mode_b, name_b) = match (&config, &args.config) {
        (Some(config), Some(text)) => (
            Mode::WhatIf(WhatIf::default().under(Some(config.clone()))),
            format!("{name_b} {}", parenthesised(text)),
        ),
        _ => (Mode::CHECK, name_b),
    };
    let a = RunSpec {
        name: args.a.name(),
        session: &session_a,
        mode: Mode::CHECK,
    };
    let b = RunSpec {
        name: name_b,
        session: session_b,
        mode: mode_b,
    };
    let d = diff(&a, &b)?;
    if let Some(file) = &args.html {
        let page = gpumem::view::diff::page_of(&d);
        let mut inputs: Vec<&std::path::Path> = vec![&args.a.trace];
        inputs.extend(args.b.as_deref());
        super::write_output(file, page.as_bytes(), &inputs)?;
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&d)?)?;
    } else {
        out!("{}", gpumem::diff::text::text(&d))?;
    }
    Ok(ExitCode::SUCCESS)
}
