//! `cannabis`: the one binary of the peer-to-peer compute market.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod cmd;
mod output;

fn main() -> ExitCode {
    // The sandbox's own stages re-execute this binary; they must run before anything
    // starts a thread.
    if let Some(code) = cannabis_runtime::sandbox::stage_main() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = cli::Cli::parse();
    match cmd::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if output::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole cause chain: "loading key: reading /x: not found".
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
