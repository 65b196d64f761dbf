//! `cannabis node`: run a node, and ask a running one about itself.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use cannabis_api::ApiClient;
use cannabis_node::keystore::{self, KeyPaths};
use cannabis_node::logging::{self, LogFormat};
use cannabis_node::{NodeConfig, api};
use tracing::{info, warn};

use crate::cli::{NodeCommand, RunArgs};
use crate::output::{self, out};

pub(super) fn run(
    command: NodeCommand,
    data_dir: &Path,
    log_format: LogFormat,
) -> anyhow::Result<()> {
    match command {
        NodeCommand::Run(args) => run_node(&args, data_dir, log_format),
        NodeCommand::Status { format } => {
            let s = ApiClient::from_data_dir(data_dir)?.status()?;
            if format.json {
                return output::json(&s);
            }
            let mesh = s
                .mesh_peers
                .iter()
                .map(|t| format!("{} {}", t.topic, t.peers))
                .collect::<Vec<_>>()
                .join(", ");
            output::table(&[
                ("address", s.address.clone()),
                ("peer id", s.peer_id.clone()),
                ("listening", s.listen_addrs.join(" ")),
                ("connected peers", s.connected_peers.to_string()),
                (
                    "refused peers",
                    format!(
                        "{} (graylisted, refused until their score recovers)",
                        s.refused_peers
                    ),
                ),
                ("gossip mesh", mesh),
                ("capability ads", s.ads.to_string()),
                ("open offers", s.offers.to_string()),
                ("uptime", format!("{} s", s.uptime_secs)),
                ("version", s.version.clone()),
                ("executor", s.executor.clone()),
                (
                    "capabilities",
                    if s.probing {
                        "still probing this machine (its ad will change)".to_string()
                    } else {
                        "probed and advertised".to_string()
                    },
                ),
                (
                    "safe mode",
                    s.safe_mode.as_ref().map_or_else(
                        || "no".to_string(),
                        |why| format!("READ-ONLY: the store refused a write ({why})"),
                    ),
                ),
            ])?;
            Ok(())
        }
        NodeCommand::Peers { format } => {
            let peers = ApiClient::from_data_dir(data_dir)?.peers()?;
            if format.json {
                return output::json(&peers);
            }
            out!("{:<54} {:>8} {:>10}  address", "peer id", "score", "ping")?;
            for p in &peers {
                let ping = p
                    .ping_us
                    .map_or("-".to_string(), |us| format!("{:.2} ms", us as f64 / 1e3));
                out!(
                    "{:<54} {:>8.2} {:>10}  {}",
                    p.peer_id,
                    p.score,
                    ping,
                    p.address.as_deref().unwrap_or("-")
                )?;
            }
            out!("{} peers", peers.len())?;
            Ok(())
        }
        NodeCommand::Challenge(args) => {
            let r = ApiClient::from_data_dir(data_dir)?.challenge(&args.peer)?;
            if args.format.json {
                output::json(&r)?;
            } else {
                output::table(&[
                    ("peer", format!("{} ({})", r.peer_id, r.address)),
                    ("claim", format!("{} cores", r.claimed_cores)),
                    ("challenge", format!("n = {}, {} rounds", r.n, r.rounds)),
                    (
                        "answered in",
                        format!("{} ms (deadline {} ms)", r.took_ms, r.deadline_ms),
                    ),
                    ("verified in", format!("{} ms", r.verify_ms)),
                    (
                        "result",
                        match &r.failure {
                            None => "passed".to_string(),
                            Some(f) => format!("FAILED: {f}"),
                        },
                    ),
                ])?;
            }
            anyhow::ensure!(r.passed, "the peer failed the challenge");
            Ok(())
        }
        NodeCommand::Jobs { id, format } => super::exec::jobs(data_dir, id.as_deref(), format.json),
        NodeCommand::Dashboard { format } => {
            let info = cannabis_api::NodeInfo::read(data_dir)?;
            let api = info
                .api
                .context("the node's local API is not listening (node.json has no api)")?;
            let url = format!("http://{api}/ui/");
            let token = data_dir.join(api::TOKEN_FILE);
            if format.json {
                return output::json(&serde_json::json!({
                    "url": url,
                    "token_file": token,
                }));
            }
            out!("{url}")?;
            out!(
                "log in with the token in {} (only on this machine: the dashboard, like the \
                 API, listens on loopback)",
                token.display()
            )?;
            Ok(())
        }
        NodeCommand::Pause => {
            super::exec::control(data_dir, cannabis_runtime::exec::Control::Paused)
        }
        NodeCommand::Drain => {
            super::exec::control(data_dir, cannabis_runtime::exec::Control::Draining)
        }
        NodeCommand::Stop => {
            super::exec::control(data_dir, cannabis_runtime::exec::Control::Stopped)
        }
        NodeCommand::Resume => {
            super::exec::control(data_dir, cannabis_runtime::exec::Control::Active)
        }
        NodeCommand::Limits { file } => super::exec::limits(data_dir, &file),
        NodeCommand::Cancel { id } => super::exec::cancel(data_dir, &id),
        NodeCommand::Retry { id } => super::exec::retry(data_dir, &id),
        NodeCommand::Clear { id } => super::exec::clear(data_dir, &id),
        NodeCommand::Output {
            id,
            name,
            offset,
            to,
        } => super::exec::output(data_dir, &id, &name, offset, to.as_deref()),
        NodeCommand::Ping {
            peer,
            count,
            format,
        } => {
            let report = ApiClient::from_data_dir(data_dir)?.ping(&peer, count)?;
            if format.json {
                return output::json(&report);
            }
            let mut rtt = report.rtt_us.clone();
            let s =
                cannabis_testnet::stats::summarize(&mut rtt).context("no round trip measured")?;
            out!(
                "{} round trips to {}: p50 {} us, p99 {} us, max {} us",
                s.count,
                report.peer_id,
                s.p50,
                s.p99,
                s.max
            )?;
            Ok(())
        }
    }
}

fn run_node(args: &RunArgs, data_dir: &Path, log_format: LogFormat) -> anyhow::Result<()> {
    logging::init(log_format);
    let mut config = match &args.config {
        Some(path) => NodeConfig::from_file(path)?,
        None => NodeConfig::default(),
    };
    if !args.listen.is_empty() {
        config.listen = args.listen.clone();
    }
    config.bootstrap.extend(args.bootstrap.iter().cloned());
    if args.no_mdns {
        config.mdns = false;
    }
    if args.relay {
        config.relay_server = true;
    }
    if let Some(api) = args.api {
        config.api = api;
    }
    if args.testnet {
        config.testnet = true;
        config.gossip.ip_colocation_threshold = 10_000.0;
        config.limits.max_pending_per_ip = 10_000;
        // Many nodes starting on one machine handshake slowly.
        config.limits.handshake_timeout_secs = config.limits.handshake_timeout_secs.max(10);
    }
    config.ceilings = Some(args.ceilings.clone());
    if let Some(socket) = &args.supervisor {
        config.supervisor = Some(socket.clone());
    }
    if let Some(genesis) = &args.genesis {
        config.ledger.genesis = Some(genesis.clone());
    }
    if args.ledger {
        config.ledger.sequence = true;
    }
    config.check()?;
    config.check_attestation()?;
    if config.attestation.is_some() {
        warn!(
            "this node's ads carry a {} attestation: confidential jobs of this testnet may \
             come here, and nothing about them is protected",
            cannabis_market::attest::DEV_INSECURE
        );
    }

    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating the data directory {}", data_dir.display()))?;
    let paths = KeyPaths::new(data_dir);
    let keys = if paths.node.exists() {
        keystore::load(&paths)?
    } else {
        let keys = keystore::create(&paths, false, super::now_ms() / 1000)?;
        info!(address = %keys.signing.address(), dir = %paths.dir.display(), "created the node identity");
        keys
    };

    // One thread: the node's driver owns the swarm and the market, and nearly everything
    // else only asks it. A second worker thread bought nothing but cross-thread wake-ups
    // (a third of a node's CPU per gossiped offer, measured) and memory; blocking work
    // (probes, the executor, challenges) runs on the blocking pool.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let token = api::ensure_token(data_dir)?;
        let listener = api::bind(config.api).await?;
        let api_addr = listener.local_addr()?;
        let (handle, task) = cannabis_node::start(config, keys, data_dir, Some(api_addr)).await?;
        let server = api::serve(listener, handle.clone(), token);
        info!(api = %api_addr, data_dir = %data_dir.display(), "local API listening");
        wait_for_stop().await;
        info!("stopping");
        server.stop().await;
        drop(handle);
        if tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .is_err()
        {
            tracing::warn!("the node did not stop within 5 s");
        }
        let _ = std::fs::remove_file(data_dir.join("node.json"));
        anyhow::Ok(())
    })
}

/// Ctrl-C or SIGTERM.
async fn wait_for_stop() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
