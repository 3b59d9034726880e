//! The `gpumem` command line: parse, dispatch, and turn errors into exit codes.

mod cli;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // What is still buffered is written before the exit, its failure reported.
    let flushed = |code| {
        use std::io::Write as _;
        std::io::stdout()
            .flush()
            .map_err(cli::stdout_error)
            .map(|()| code)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error>)
    };
    match cli::run(cli::Cli::parse()).and_then(flushed) {
        Ok(code) => code,
        // The reader of stdout went away (`gpumem simulate | head`): a normal end.
        Err(e) if cli::is_broken_pipe(e.as_ref()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumem: {e}");
            ExitCode::from(2)
        }
    }
}

/// Whether standard output was closed when the process started. Rust's runtime puts
/// /dev/null in its place before `main`, where nothing can tell it from a /dev/null given on
/// purpose; this probe runs before the runtime does, as an ELF constructor.
mod stdout_probe {
    use std::sync::atomic::{AtomicBool, Ordering};

    static CLOSED: AtomicBool = AtomicBool::new(false);

    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)] // a constructor entry, and one fcntl in it
    #[used]
    #[unsafe(link_section = ".init_array")]
    static PROBE: extern "C" fn() = probe;

    #[cfg(target_os = "linux")]
    extern "C" fn probe() {
        // SAFETY: F_GETFD only reads the descriptor's flags; it fails (EBADF) when closed.
        #[allow(unsafe_code)]
        let flags = unsafe { libc::fcntl(libc::STDOUT_FILENO, libc::F_GETFD) };
        CLOSED.store(flags == -1, Ordering::Relaxed);
    }

    /// Whether stdout was closed at the start (never, where the probe does not run).
    pub(crate) fn closed() -> bool {
        CLOSED.load(Ordering::Relaxed)
    }
}
