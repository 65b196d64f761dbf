//! The command line: one binary, a subcommand for each thing a user does.

use std::path::PathBuf;

use cannabis_protocol::Amount;
use clap::{Args, Parser, Subcommand};

/// A peer-to-peer compute market node: contribute idle GPUs and CPUs, publish budgeted
/// jobs, run local testnets.
#[derive(Debug, Parser)]
#[command(name = "cannabis", version, propagate_version = true)]
pub(crate) struct Cli {
    /// Where the node keeps its keys and records. Default: $XDG_DATA_HOME/cannabis or
    /// ~/.local/share/cannabis.
    #[arg(long, global = true, env = "CANNABIS_DATA_DIR", value_name = "DIR")]
    pub(crate) data_dir: Option<PathBuf>,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create and inspect this node's identity keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Work with jobs: see what a budget pays before publishing.
    #[command(subcommand)]
    Job(JobCommand),
    /// Walk one job through the whole protocol in-process and show every step.
    Demo(DemoArgs),
}

#[derive(Debug, Subcommand)]
pub(crate) enum KeysCommand {
    /// Create the node's signing key and delivery (age) key in the data directory.
    New {
        /// Replace existing keys. The old files are kept beside the new ones, renamed with
        /// a `.replaced-<unix time>` suffix.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        format: Format,
    },
    /// Show the node's address, delivery recipient and key files.
    Show {
        #[command(flatten)]
        format: Format,
    },
    /// Print the node's `cpc1...` address alone.
    Address,
}

#[derive(Debug, Subcommand)]
pub(crate) enum JobCommand {
    /// Show what a total budget pays: the worker share and the 1% service fee.
    Quote {
        /// Total budget in integer base units, fee included (digits, `_` allowed).
        budget: Amount,
        /// Fee rate in basis points (100 = 1%, the founder fee).
        #[arg(long, default_value_t = cannabis_protocol::FOUNDER_FEE_BPS, value_name = "BPS")]
        fee_bps: u16,
        #[command(flatten)]
        format: Format,
    },
}

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Matrix size of the synthetic proof-of-compute task the demo worker runs.
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub(crate) size: u32,
    #[command(flatten)]
    pub(crate) format: Format,
}

/// Output format flag shared by the commands that print data.
#[derive(Debug, Args, Clone, Copy)]
pub(crate) struct Format {
    /// Print JSON instead of a table, for scripts.
    #[arg(long)]
    pub(crate) json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
