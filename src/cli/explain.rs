//! `gpumem explain`: why a recorded allocation failed, in figures and one sentence.

use std::process::ExitCode;

use gpumem::explain::{At, choose, explain};

use super::{CliResult, Path, RecordingArgs, out, outln};

#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    recording: RecordingArgs,
    /// The device whose trace to explain. Default: the first device that ran out of memory,
    /// else the first with a trace, else the first the snapshot holds segments of.
    #[arg(long)]
    device: Option<u32>,
    /// The moment: `oom` (the first out-of-memory error), `peak` (where the allocator reserved
    /// the most), `snapshot` (the state the snapshot holds) or an event's index in the trace.
    /// Default: `oom`, or `peak` when the trace has no OOM, or `snapshot` when there is no
    /// trace.
    #[arg(long, value_parser = parse_at)]
    at: Option<At>,
    /// Print every figure as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the explanation as a self-contained HTML page (no network needed to open
    /// it) to this file.
    #[arg(long, value_name = "FILE")]
    html: Option<Path>,
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
    let recording = args.recording.read()?;
    let choice = choose(&recording, args.device, args.at)
        .ok_or("the recording holds neither a trace nor segments of any device")?;
    let session = args.recording.session(&recording, choice.device)?;
    let mut e = explain(&session, choice.at)?;
    e.chosen = choice.sentence();
    let confirm = confirm_command(&args, &e);
    if let Some(file) = &args.html {
        let page = gpumem::view::explain::page_of(&args.recording.name(), &e, confirm.as_deref());
        super::write_output(file, page.as_bytes(), &[&args.recording.trace])?;
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&e)?)?;
    } else {
        out!("{}", gpumem::explain::text::text(&e, confirm.as_deref()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The replay that confirms the best candidate without OOMs, where there is one.
fn confirm_command(args: &Args, e: &gpumem::explain::Explanation) -> Option<String> {
    let available = e.available?;
    let best = e.candidates.iter().find(|c| c.ooms == 0)?;
    Some(format!(
        "gpumem replay {} --device {} --capacity {} --available {} --config {}",
        shell_quoted(&args.recording.trace.display().to_string()),
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
