//! The `gpumem` command line: parse, dispatch, and turn errors into exit codes.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    match cli::run(cli::Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpumem: {e}");
            ExitCode::from(2)
        }
    }
}
