//! Subcommands: `demo` and `serve` (the agent), `simulate` (a training loop on a simulated
//! GPU), `replay` (recorded traces: fidelity check and what-if comparison), `explain`,
//! `diff`, `view` and `plan` (on recordings, local or archived), `recordings` (the archive's listing),
//! `webhook` and `copy-hook` (injecting the push hook into pods).

mod agent;
mod diff;
mod explain;
mod plan;
mod recordings;
mod replay;
mod simulate;
mod view;
mod webhook;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Errors reach `main` as boxed errors with a readable message.
pub(crate) type CliResult = Result<ExitCode, Box<dyn std::error::Error>>;

/// `print!` that returns the write's error instead of panicking, naming stdout
/// ([`stdout_error`]): a reader gone away (`gpumem … | head`) ends the command normally (see
/// `main`); any other failure, a full device or a closed stdout, is the command's error.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        $crate::cli::stdout()
            .and_then(|mut out| write!(out, $($arg)*))
            .map_err($crate::cli::stdout_error)
    }};
}

/// `println!` that returns the write's error instead of panicking, as [`out!`].
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        $crate::cli::stdout()
            .and_then(|mut out| writeln!(out, $($arg)*))
            .map_err($crate::cli::stdout_error)
    }};
}

/// Standard output, locked, for a command's results; an error when the process started with
/// it closed. Rust's runtime opens /dev/null in place of a closed descriptor before `main`,
/// so every write would succeed and be lost: the command would seem to have printed.
pub(crate) fn stdout() -> std::io::Result<std::io::StdoutLock<'static>> {
    if crate::stdout_probe::closed() {
        return Err(std::io::Error::other("it is closed"));
    }
    Ok(std::io::stdout().lock())
}

/// A failed write of the results, naming stdout; its kind is kept, so that a reader gone away
/// ([`is_broken_pipe`]) stays a normal end.
pub(crate) fn stdout_error(e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("cannot write the results to stdout: {e}"))
}

pub(crate) use {out, outln};

/// A recording's name as pages and charts title it: its file name (the path where it has none).
pub(crate) fn file_name(path: &std::path::Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// A configuration as a row's label adds it: `(default)` as it is, another in parentheses.
pub(crate) fn parenthesised(config: &str) -> String {
    if config.starts_with('(') {
        config.to_string()
    } else {
        format!("({config})")
    }
}

/// A file error that names the file.
pub(crate) fn file_error(path: &std::path::Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Writes an output file whole: into a new temporary file beside `path` (its permissions
/// where it replaces one), then renamed onto it, so that a reader never sees half a file and
/// a symbolic link put at `path` is replaced, never written through. Refused when `path` is
/// a symbolic link now, or is one of `inputs` (`plan rec.json -o rec.json` would replace the
/// recording with its plan). A device or pipe (`/dev/null`) is written as it is.
pub(crate) fn write_output(
    path: &std::path::Path,
    bytes: &[u8],
    inputs: &[&std::path::Path],
) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::MetadataExt as _;
    let refuse = |why: String| {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{}: {why}", path.display()),
        ))
    };
    let existing = std::fs::symlink_metadata(path).ok();
    if let Some(meta) = &existing {
        if meta.file_type().is_symlink() {
            return refuse("is a symbolic link: not written through (name its target)".into());
        }
        for input in inputs {
            if std::fs::metadata(input)
                .is_ok_and(|i| (i.dev(), i.ino()) == (meta.dev(), meta.ino()))
            {
                return refuse(format!("is the input {}: not overwritten", input.display()));
            }
        }
        if !meta.is_file() && !meta.is_dir() {
            // A device, pipe or socket: written in place (renaming over it would replace it).
            return std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .and_then(|mut f| f.write_all(bytes))
                .map_err(|e| file_error(path, e));
        }
    }
    let Some(name) = path.file_name() else {
        return refuse("names no file".into());
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    // A name no other process picks (pid and clock), tried afresh if taken; only a file this
    // call created is ever removed.
    let mut created = None;
    for attempt in 0..16u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mut temporary = std::ffi::OsString::from(".");
        temporary.push(name);
        temporary.push(format!(".{}.{nanos:x}.{attempt}.tmp", std::process::id()));
        let temporary = dir.join(temporary);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary)
        {
            Ok(file) => {
                created = Some((temporary, file));
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(file_error(path, e)),
        }
    }
    let Some((temporary, mut file)) = created else {
        return refuse("no temporary file could be created beside it".into());
    };
    let written = file
        .write_all(bytes)
        .and_then(|()| match &existing {
            Some(meta) => file.set_permissions(meta.permissions()),
            None => Ok(()),
        })
        .and_then(|()| std::fs::rename(&temporary, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written.map_err(|e| file_error(path, e))
}

/// Whether `error` is a write to a closed pipe (the reader went away: a normal end).
pub(crate) fn is_broken_pipe(error: &(dyn std::error::Error + 'static)) -> bool {
    error
        .downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// GPU memory, made visible: PyTorch's caching allocator on a simulated or real GPU.
#[derive(Parser)]
#[command(version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve /metrics for a simulated GPU node (no driver needed): simulated GPUs whose
    /// processes replay real recorded traces through the allocator.
    Demo(agent::DemoArgs),
    /// Serve /metrics on a GPU node: NVML's device and per-process view.
    Serve(Box<agent::ServeArgs>),
    /// Run a synthetic transformer training loop through the allocator on a simulated GPU and
    /// print what the allocator did (PyTorch's memory_summary and the key figures).
    Simulate(simulate::Args),
    /// Replay a recorded PyTorch memory snapshot (pickle or JSON, optionally gzipped): check
    /// that gpumem decides exactly as PyTorch did, or compare configurations on it.
    Replay(replay::Args),
    /// Explain an out-of-memory error of a recording: the request, where the device's memory
    /// was, and which part kept the request from fitting.
    Explain(explain::Args),
    /// Compare two runs (two recordings, or a recording and a what-if of it): both peaks,
    /// the difference by source line, what each allocator adds, the iterations side by side.
    Diff(diff::Args),
    /// Open a recording in the browser: its timeline, the segment map at any event, the
    /// explanation of each OOM, and a what-if configuration beside the recorded one.
    View(view::Args),
    /// Plan where a recording's repeating iteration places its allocations (within a few
    /// percent of the bytes live at once), write the plan, and evaluate it against the
    /// recorded configuration on the iterations it was not made from.
    Plan(plan::Args),
    /// Recordings archived in object storage by the agents (--recordings-url): list them.
    #[command(subcommand)]
    Recordings(recordings::Command),
    /// Serve the mutating admission webhook (HTTPS) that injects the push hook into pods
    /// labelled gpumem.io/inject=true: no gpumem_push in their image, no host path.
    Webhook(webhook::Args),
    /// Copy the push hook's directory into a pod's volume (the injected init container).
    CopyHook(webhook::CopyArgs),
}

pub(crate) fn run(cli: Cli) -> CliResult {
    match cli.command {
        Command::Demo(args) => agent::demo_command(args),
        Command::Serve(args) => agent::serve_command(*args),
        Command::Simulate(args) => simulate::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Explain(args) => explain::run(args),
        Command::Diff(args) => diff::run(args),
        Command::View(args) => view::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Recordings(command) => recordings::run(command),
        Command::Webhook(args) => webhook::run(args),
        Command::CopyHook(args) => webhook::copy_hook(args),
    }
}

/// The PyTorch release whose decisions to follow: `--pytorch MAJOR.MINOR`.
#[derive(clap::Args)]
pub(crate) struct PyTorchArg {
    /// The PyTorch release that made the recording (2.0 to 2.15): replay follows its
    /// best-fit order. Default: the order found from the recording itself.
    #[arg(long, value_name = "MAJOR.MINOR")]
    pytorch: Option<gpumem::config::PyTorchVersion>,
}

impl PyTorchArg {
    /// The best-fit order asked for, if one was.
    pub(crate) fn order(&self) -> Option<gpumem::allocator::FitOrder> {
        self.pytorch.map(gpumem::allocator::FitOrder::of)
    }

    /// A `--config` string checked against this release's keys and rules (the newest
    /// release's when none was named).
    pub(crate) fn config(
        &self,
        text: &str,
    ) -> Result<gpumem::AllocatorConfig, gpumem::config::ConfigError> {
        gpumem::AllocatorConfig::parse_for(
            text,
            gpumem::config::Syntax::PyTorch,
            self.pytorch.unwrap_or_default(),
        )
    }
}

/// A recording and how its replays run: what `replay`, `explain`, `plan` and `view` share.
#[derive(clap::Args)]
pub(crate) struct RecordingArgs {
    /// The snapshot: `torch.cuda.memory._dump_snapshot` pickle, or the same schema as JSON,
    /// optionally gzipped; a file, or an object in a store (s3://bucket/key, gs://, az://,
    /// file://: an archived recording or its sidecar), fetched with the environment's
    /// credentials or the AWS CLI's profile.
    pub(crate) trace: Path,
    /// Device memory (bytes, or with a KiB/MiB/GiB suffix); default: the recorded device,
    /// else inferred from expandable reservations, else 80 GiB.
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) capacity: Option<u64>,
    #[command(flatten)]
    pub(crate) pytorch: PyTorchArg,
    #[command(flatten)]
    pub(crate) read: ReadArgs,
    /// What each driver call costs the replays' clock: `h200` (measured; the default),
    /// `public` (public figures only), or a cost table file (`gpumem-costs`, as
    /// scripts/gpu-check.sh writes it).
    #[arg(long, value_name = "TABLE", value_parser = parse_costs, default_value = "h200")]
    pub(crate) costs: std::sync::Arc<gpumem::device::DriverCosts>,
}

fn parse_costs(text: &str) -> Result<std::sync::Arc<gpumem::device::DriverCosts>, String> {
    gpumem::replay::costs::read_costs(text)
        .map(std::sync::Arc::new)
        .map_err(|e| e.to_string())
}

impl RecordingArgs {
    /// Reads the recording within the limits (see [`ReadArgs::read`]).
    pub(crate) fn read(
        &self,
    ) -> Result<std::sync::Arc<gpumem::recording::Recording>, Box<dyn std::error::Error>> {
        self.read_other(&self.trace)
    }

    /// Reads another recording (a file or a store's address) as this one is read.
    pub(crate) fn read_other(
        &self,
        trace: &std::path::Path,
    ) -> Result<std::sync::Arc<gpumem::recording::Recording>, Box<dyn std::error::Error>> {
        let Some(address) = address(trace) else {
            return Ok(std::sync::Arc::new(self.read.read(trace)?));
        };
        // Within the same input bound as a local file; removed once read.
        let fetched = gpumem::archive::fetch(address, self.read.max_input_bytes)?;
        Ok(std::sync::Arc::new(self.read.read(fetched.path())?))
    }

    /// What the replays of `device` share: the memory, order and budget asked for.
    pub(crate) fn setup(&self, device: u32) -> gpumem::replay::Setup {
        gpumem::replay::Setup {
            device,
            capacity: self.capacity,
            order: self.pytorch.order(),
            max_memory_bytes: Some(self.read.max_memory_bytes()),
            costs: std::sync::Arc::clone(&self.costs),
        }
    }

    /// A session on `device` of `recording`.
    pub(crate) fn session(
        &self,
        recording: &std::sync::Arc<gpumem::recording::Recording>,
        device: u32,
    ) -> Result<gpumem::replay::Session, gpumem::replay::ReplayError> {
        gpumem::replay::Session::new(std::sync::Arc::clone(recording), self.setup(device))
    }

    /// The recording's name as pages and charts title it (an archived one's address).
    pub(crate) fn name(&self) -> String {
        name(&self.trace)
    }
}

/// The store's address a recording was given as, where it was.
fn address(trace: &std::path::Path) -> Option<&str> {
    let text = trace.to_str()?;
    gpumem::archive::address::object_address(text).map(|_| text)
}

/// A recording's name as pages and charts title it: an archived one's address, else its file
/// name.
pub(crate) fn name(trace: &std::path::Path) -> String {
    match address(trace) {
        Some(address) => address.to_string(),
        None => file_name(trace),
    }
}

/// How a recording is read: the limits every command that reads one shares.
#[derive(clap::Args)]
pub(crate) struct ReadArgs {
    /// The largest recording read (bytes, or with a KiB/MiB/GiB suffix), decompressed data
    /// included.
    #[arg(long, value_parser = parse_bytes, default_value = "16GiB", value_name = "BYTES")]
    max_input_bytes: u64,
    /// The most memory reading may hold (the decoded document, interned frames, the pickle's
    /// memo), and each replay's own state may hold then (`replay`, `explain`, `plan`,
    /// `view`); a recording that needs more is refused, saying where.
    #[arg(long, value_parser = parse_bytes, default_value = "4GiB", value_name = "BYTES")]
    max_memory_bytes: u64,
}

/// Files from this size on get a progress bar while they are read (on a terminal).
const READ_PROGRESS_MIN_BYTES: u64 = 64 << 20;

impl ReadArgs {
    /// The memory budget, which a replay's own state is held to as well.
    pub(crate) fn max_memory_bytes(&self) -> u64 {
        self.max_memory_bytes
    }

    /// Reads `path` within the limits, with a progress bar on stderr for a large file when
    /// stderr is a terminal.
    pub(crate) fn read(
        &self,
        path: &std::path::Path,
    ) -> Result<gpumem::recording::Recording, gpumem::recording::TraceError> {
        let limits = gpumem::recording::ReadLimits {
            max_input_bytes: self.max_input_bytes,
            max_memory_bytes: self.max_memory_bytes,
        };
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        let bar = (size >= READ_PROGRESS_MIN_BYTES
            && std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .then(|| {
            let bar = indicatif::ProgressBar::new(size);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "reading {bar:40} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        });
        let result = gpumem::recording::read_recording_with(path, limits, &mut |read| {
            if let Some(bar) = &bar {
                bar.set_position(read);
            }
        });
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        result
    }
}

/// Parses a byte count: a plain number, or one with a KiB/MiB/GiB/TiB suffix (also K/M/G/T).
pub(crate) fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" | "KB" => 10,
        "M" | "MiB" | "MB" => 20,
        "G" | "GiB" | "GB" => 30,
        "T" | "TiB" | "TB" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} (use bytes, KiB, MiB, GiB or TiB)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("{text:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// A path argument.
pub(crate) type Path = PathBuf;

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    /// A command carrying the read arguments, to read their defaults.
    #[derive(Parser)]
    struct Reads {
        #[command(flatten)]
        read: super::ReadArgs,
    }

    #[test]
    fn the_read_limits_default_to_the_readers_own() {
        Reads::command().debug_assert();
        let defaults = Reads::parse_from(["reads"]).read;
        assert_eq!(defaults.max_input_bytes, gpumem::recording::MAX_INPUT_BYTES);
        assert_eq!(
            defaults.max_memory_bytes,
            gpumem::recording::MAX_MEMORY_BYTES
        );
    }
}
