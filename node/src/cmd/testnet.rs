//! `cannabis testnet`: local testnets of real node processes.

use std::time::Duration;

use anyhow::Context as _;
use cannabis_node::logging::LogFormat;
use cannabis_testnet::bench::{self, BenchOptions};
use cannabis_testnet::launcher::{self, Testnet, TestnetOptions};
use cannabis_testnet::sim;

use crate::cli::TestnetCommand;
use crate::output::{self, out};

pub(super) fn run(command: TestnetCommand, _log: LogFormat) -> anyhow::Result<()> {
    let binary = std::env::current_exe().context("finding the cannabis binary")?;
    match command {
        TestnetCommand::Up { nodes, dir } => {
            let opts = TestnetOptions {
                binary,
                dir: dir.clone(),
                nodes,
                ready_timeout: Duration::from_secs(30),
            };
            // Signals are caught from the start: a Ctrl-C while the nodes start (or right
            // after the line that mentions it) must stop them, not kill this process alone.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (mut int, mut term) = runtime.block_on(async {
                use tokio::signal::unix::{SignalKind, signal};
                anyhow::Ok((
                    signal(SignalKind::interrupt())?,
                    signal(SignalKind::terminate())?,
                ))
            })?;
            out!("starting {nodes} nodes in {} ...", dir.display())?;
            let mut net = Testnet::up(&opts)?;
            out!("{:<6} {:<54} {:<22} data dir", "node", "peer id", "api")?;
            for n in &net.nodes {
                out!(
                    "{:<6} {:<54} {:<22} {}",
                    n.index,
                    n.info.peer_id,
                    n.info.api.as_deref().unwrap_or("-"),
                    n.data_dir.display()
                )?;
            }
            out!(
                "\nAsk any node with `cannabis --data-dir {}/node-0 node status`.\n\
                 Ctrl-C (or `cannabis testnet down --dir {}`) stops them all.",
                dir.display(),
                dir.display()
            )?;
            runtime.block_on(async {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            });
            net.stop();
            out!("stopped")?;
            Ok(())
        }
        TestnetCommand::Sim {
            nodes,
            offers,
            seed,
            placement_ads,
            format,
        } => {
            let config = sim::SimConfig {
                nodes,
                offers,
                seed,
                requesters: (nodes / 25).max(1),
                ..sim::SimConfig::default()
            };
            let started = std::time::Instant::now();
            let report = sim::run(config)?;
            let wall = started.elapsed();
            let placement = sim::placement_figures(placement_ads, 21);
            let offers_per_sec = report.offers as f64 / wall.as_secs_f64().max(1e-9);
            if format.json {
                return output::json(&serde_json::json!({
                    "report": report,
                    "wall_ms": wall.as_millis() as u64,
                    "offers_per_sec": offers_per_sec,
                    "placement": placement,
                }));
            }
            output::table(&[
                (
                    "nodes / offers",
                    format!("{} / {}", report.nodes, report.offers),
                ),
                (
                    "jobs",
                    format!(
                        "{} completed, {} failed, {} cancelled",
                        report.completed, report.failed, report.cancelled
                    ),
                ),
                (
                    "bids / declines / awards",
                    format!("{} / {} / {}", report.bids, report.declines, report.awards),
                ),
                (
                    "leases / retries",
                    format!("{} / {}", report.leases, report.retries),
                ),
                (
                    "refused",
                    format!(
                        "{} stale epochs, {} busy",
                        report.stale_refused, report.busy_refused
                    ),
                ),
                (
                    "messages",
                    format!("{} ({} lost)", report.messages, report.dropped),
                ),
                (
                    "money",
                    format!(
                        "budget {} = spent {} + refunded {}",
                        report.budget, report.spent, report.refunded
                    ),
                ),
                (
                    "virtual time",
                    format!("{:.1} min", report.virtual_ms as f64 / 60_000.0),
                ),
                (
                    "wall time",
                    format!(
                        "{:.2} s ({:.0} offers/s, {} events)",
                        wall.as_secs_f64(),
                        offers_per_sec,
                        report.events
                    ),
                ),
                (
                    "placement",
                    format!(
                        "{} ads: match+explain {} us, place group of 4 on {} bids {} us (median of {})",
                        placement.ads,
                        placement.match_us,
                        placement.qualified,
                        placement.place_us,
                        placement.reps
                    ),
                ),
                ("invariants", "held".to_string()),
            ])?;
            Ok(())
        }
        TestnetCommand::Down { dir } => {
            let n = launcher::down(&dir)?;
            out!("stopped {n} nodes of the testnet in {}", dir.display())?;
            Ok(())
        }
        TestnetCommand::Bench {
            nodes,
            offers,
            pings,
            dir,
            format,
        } => {
            if dir.exists() {
                launcher::down(&dir)?;
                std::fs::remove_dir_all(&dir)
                    .with_context(|| format!("emptying {}", dir.display()))?;
            }
            let opts = BenchOptions {
                testnet: TestnetOptions {
                    binary,
                    dir,
                    nodes,
                    ready_timeout: Duration::from_secs(60),
                },
                offers,
                interval: Duration::from_millis(100),
                pings,
            };
            let r = bench::run(&opts)?;
            if format.json {
                return output::json(&r);
            }
            let ms = |us: u64| format!("{:.3} ms", us as f64 / 1e3);
            output::table(&[
                ("nodes", r.nodes.to_string()),
                ("offers", r.offers.to_string()),
                ("start and converge", format!("{} ms", r.converge_ms)),
                (
                    "offer propagation",
                    format!(
                        "p50 {}  p99 {}  max {}  ({} of {} receipts)",
                        ms(r.propagation_us.p50),
                        ms(r.propagation_us.p99),
                        ms(r.propagation_us.max),
                        r.receipts_seen,
                        r.receipts_expected
                    ),
                ),
                (
                    "request-response rtt",
                    format!(
                        "p50 {}  p99 {}  max {}  ({} round trips)",
                        ms(r.request_response_rtt_us.p50),
                        ms(r.request_response_rtt_us.p99),
                        ms(r.request_response_rtt_us.max),
                        r.request_response_rtt_us.count
                    ),
                ),
                (
                    "propagation / rtt (p50)",
                    format!(
                        "{:.1}x",
                        r.propagation_us.p50 as f64 / r.request_response_rtt_us.p50.max(1) as f64
                    ),
                ),
                (
                    "job to every other node",
                    format!(
                        "group of {}: submit to all leases {} ms (bid window {} ms + {} ms placing and leasing)",
                        r.job_group,
                        r.job_submit_to_leases_ms,
                        r.job_bid_window_ms,
                        r.job_after_window_ms
                    ),
                ),
                (
                    "idle RSS per node",
                    format!(
                        "mean {} MiB  max {} MiB",
                        r.rss_kib_mean / 1024,
                        r.rss_kib_max / 1024
                    ),
                ),
            ])?;
            Ok(())
        }
    }
}
