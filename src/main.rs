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
    match cli::run(cli::Cli::parse()) {
        Ok(code) => code,
        // The reader of stdout went away (`gpumem simulate | head`): a normal end.
        Err(e) if cli::is_broken_pipe(e.as_ref()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumem: {e}");
            ExitCode::from(2)
        }
    }
}
