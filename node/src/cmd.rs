//! Subcommand implementations.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;

use crate::cli::{Cli, Command};

mod attack;

pub(crate) use attack::Kind as AttackKind;
mod calibrate;
mod demo;
mod exec;
mod job;
mod keys;
mod ledger;
mod market;
mod node;
mod probe;
mod supervisor;
mod testnet;

pub(crate) fn run(cli: Cli) -> anyhow::Result<()> {
    let data_dir = || data_dir(cli.data_dir.clone());
    match cli.command {
        Command::Node(c) => node::run(c, &data_dir()?, cli.log_format),
        Command::Market(c) => market::run(c, &data_dir()?),
        Command::Testnet(c) => testnet::run(c, cli.log_format),
        Command::Probe { config, format } => probe::probe(config.as_deref(), &data_dir()?, format),
        Command::Challenge {
            size,
            rounds,
            format,
        } => probe::challenge(size, rounds, format),
        Command::Keys(c) => keys::run(c, &data_dir()?),
        Command::Job(c) => job::run(c, data_dir),
        Command::Demo(args) => demo::run(&args),
        Command::Exec(c) => exec::run(c, data_dir),
        Command::Supervisor(c) => supervisor::run(c, cli.log_format),
        Command::Ledger(crate::cli::LedgerCommand::Bench {
            dir,
            txs,
            accounts,
            block_txs,
            results,
            format,
        }) => ledger::show(
            &ledger::bench(&dir, txs, accounts, block_txs, results)?,
            format.json,
        ),
        Command::Ledger(c @ crate::cli::LedgerCommand::Resolve { .. }) => {
            ledger::resolve(c, &data_dir()?)
        }
        Command::Ledger(c) => ledger::run(c, &data_dir()?),
        Command::Wallet(c) => ledger::wallet(c, &data_dir()?),
    }
}

/// `--data-dir`, else `$XDG_DATA_HOME/cannabis`, else `~/.local/share/cannabis`; made
/// absolute (the node hands paths under it to processes that start elsewhere).
fn data_dir(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = flag {
        return std::path::absolute(&dir).with_context(|| format!("--data-dir {}", dir.display()));
    }
    if let Some(xdg) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(xdg).join("cannabis"));
    }
    let home = std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .context("no --data-dir given and HOME is not set")?;
    Ok(PathBuf::from(home).join(".local/share/cannabis"))
}

/// Milliseconds since the Unix epoch, from the system clock.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
