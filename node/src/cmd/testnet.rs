//! `cannabis testnet`: local testnets of real node processes.

use std::time::Duration;

use anyhow::Context as _;
use cannabis_node::logging::LogFormat;
use cannabis_testnet::bench::{self, BenchOptions};
use cannabis_testnet::launcher::{self, Testnet, TestnetOptions};
use cannabis_testnet::sim;

use crate::cli::Format;
use crate::cli::{SimWorkload, TestnetCommand};
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
            let (runtime, mut int, mut term) = signals()?;
            out!("starting {nodes} nodes in {} ...", dir.display())?;
            // Progress on standard error while they start (none off a terminal).
            let bar = {
                use std::io::IsTerminal as _;
                if std::io::stderr().is_terminal() {
                    let bar = indicatif::ProgressBar::new(nodes as u64);
                    if let Ok(style) = indicatif::ProgressStyle::with_template(
                        "{spinner} {elapsed} [{bar:30}] {pos}/{len} nodes up",
                    ) {
                        bar.set_style(style.progress_chars("=> "));
                    }
                    bar.enable_steady_tick(Duration::from_millis(100));
                    bar
                } else {
                    indicatif::ProgressBar::hidden()
                }
            };
            let started = Testnet::up_with(&opts, |n| bar.set_position(n as u64));
            bar.finish_and_clear();
            let mut net = started?;
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
            // Until Ctrl-C, or until every node is gone (`testnet down` from another shell).
            let all_gone = runtime.block_on(async {
                let mut check = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tokio::select! {
                        _ = int.recv() => return false,
                        _ = term.recv() => return false,
                        _ = check.tick() => {
                            if net.running() == 0 {
                                return true;
                            }
                        }
                    }
                }
            });
            net.stop();
            if all_gone {
                out!("every node has stopped (testnet down?)")?;
            } else {
                out!("stopped")?;
            }
            Ok(())
        }
        TestnetCommand::Plot {
            out,
            sizes,
            offers,
            sim_nodes,
            dir,
            duration,
        } => plot(&binary, &out, &sizes, offers, &sim_nodes, duration, &dir),
        TestnetCommand::Demo { nodes, keep } => {
            use cannabis_testnet::demo::{self, DemoOptions};
            if let Some(k) = &keep {
                anyhow::ensure!(
                    !k.exists(),
                    "{} exists: --keep wants a new directory",
                    k.display()
                );
            }
            let dir = match &keep {
                Some(k) => k.clone(),
                None => std::env::temp_dir().join(format!("cannabis-demo-{}", std::process::id())),
            };
            let opts = DemoOptions {
                binary,
                dir: dir.clone(),
                nodes,
            };
            // Ctrl-C (or SIGTERM) stops the nodes and removes the files before exiting:
            // the steps run on this thread, the signals are awaited on another, which
            // alone ends the process once it has begun (a step failing as the nodes stop
            // waits for it here).
            let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            {
                let flag = interrupted.clone();
                let (dir, keep) = (dir.clone(), keep.is_some());
                let (runtime, mut int, mut term) = signals()?;
                std::thread::spawn(move || {
                    runtime.block_on(async {
                        tokio::select! {
                            _ = int.recv() => {}
                            _ = term.recv() => {}
                        }
                    });
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    launcher::stop_under(&dir.join("net"));
                    if !keep {
                        let _ = std::fs::remove_dir_all(&dir);
                    }
                    eprintln!("interrupted: every node of the demo stopped");
                    std::process::exit(130);
                });
            }
            let r = demo::run(&opts, &mut |line| {
                if !interrupted.load(std::sync::atomic::Ordering::SeqCst) {
                    let _ = out!("{line}");
                }
            });
            while interrupted.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::park();
            }
            if keep.is_none() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            let took = r?;
            let total: f64 = took.iter().map(Duration::as_secs_f64).sum();
            out!(
                "\nevery step happened ({} of {}) in {total:.0} s; every node stopped{}",
                took.len(),
                demo::STEPS.len(),
                if keep.is_some() {
                    format!(", files kept in {}", dir.display())
                } else {
                    ", files removed".into()
                }
            )?;
            Ok(())
        }
        TestnetCommand::Sim {
            nodes,
            offers,
            rate,
            duration,
            workload,
            cpu,
            costs,
            find_capacity,
            offer_shards,
            requesters,
            seed,
            placement_ads,
            format,
        } => {
            if let Some(s) = offer_shards {
                anyhow::ensure!(
                    s.is_power_of_two() && s <= cannabis_protocol::draw::MAX_SHARDS,
                    "--offer-shards must be a power of two from 1 to 1024"
                );
            }
            let costs = match (&costs, cpu || find_capacity) {
                (Some(path), _) => serde_json::from_slice(
                    &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
                )
                .with_context(|| format!("parsing {}", path.display()))?,
                (None, true) => sim::Costs::calibrated()?,
                (None, false) => sim::Costs::default(),
            };
            let adjust = |config: &mut sim::SimConfig| {
                if let Some(s) = offer_shards {
                    config.offer_shards = s;
                }
                if let Some(r) = requesters {
                    config.requesters = r.clamp(1, config.nodes);
                }
            };
            if find_capacity {
                return capacity(nodes, duration, &costs, &adjust, seed, &format);
            }
            let mut config = match (workload, rate) {
                (SimWorkload::Capacity, Some(rate)) => {
                    sim::SimConfig::capacity(nodes, rate, duration, costs, seed)
                }
                (SimWorkload::Capacity, None) => sim::SimConfig::capacity(
                    nodes,
                    offers as f64 / duration.max(1) as f64,
                    duration,
                    costs,
                    seed,
                ),
                (SimWorkload::Mixed, rate) => sim::SimConfig {
                    nodes,
                    offers: rate.map_or(offers, |r| (r * duration as f64).round() as usize),
                    span_ms: if rate.is_some() {
                        duration * 1000
                    } else {
                        sim::SimConfig::default().span_ms
                    },
                    seed,
                    requesters: (nodes / 25).max(1),
                    costs,
                    ..sim::SimConfig::default()
                },
            };
            adjust(&mut config);
            config.price_sample = (config.offers / 100).clamp(1, 10);
            let started = std::time::Instant::now();
            let report = sim::run(config)?;
            let wall = started.elapsed();
            let placement = (placement_ads > 0).then(|| sim::placement_figures(placement_ads, 21));
            if format.json {
                return output::json(&serde_json::json!({
                    "report": report,
                    "wall_ms": wall.as_millis() as u64,
                    "placement": placement,
                }));
            }
            print_sim(&report, wall)?;
            if let Some(placement) = placement {
                output::table(&[(
                    "placement",
                    format!(
                        "{} ads: match+explain {} us, place group of 4 on {} bids {} us (median of {})",
                        placement.ads,
                        placement.match_us,
                        placement.qualified,
                        placement.place_us,
                        placement.reps
                    ),
                )])?;
            }
            out!("invariants held")?;
            Ok(())
        }
        TestnetCommand::Calibrate { out, dir, format } => {
            let costs = crate::cmd::calibrate::run(&dir)?;
            std::fs::write(&out, serde_json::to_string_pretty(&costs)? + "\n")
                .with_context(|| format!("writing {}", out.display()))?;
            if format.json {
                return output::json(&costs);
            }
            output::table(&[
                (
                    "offer in (per node, real processes)",
                    format!("{:.1} us", costs.offer_in_us),
                ),
                ("offer submitted", format!("{:.1} us", costs.submit_us)),
                ("message signed", format!("{:.1} us", costs.sign_us)),
                ("bid in", format!("{:.1} us", costs.bid_in_us)),
                (
                    "other directed message in",
                    format!("{:.1} us", costs.directed_in_us),
                ),
                ("answer in", format!("{:.1} us", costs.answer_in_us)),
                ("durable write", format!("{:.1} us", costs.persist_us)),
                ("measured", costs.measured.clone()),
                ("written to", out.display().to_string()),
            ])?;
            Ok(())
        }
        TestnetCommand::Status { dir, format } => {
            let nodes = launcher::status(&dir)?;
            if format.json {
                return output::json(&nodes);
            }
            out!(
                "{:<6} {:<9} {:<8} {:>6} {:>7}  data dir",
                "node",
                "state",
                "pid",
                "peers",
                "height"
            )?;
            let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            for n in &nodes {
                let state = match n.state {
                    launcher::ProcState::Running => "running",
                    launcher::ProcState::Paused => "paused",
                    launcher::ProcState::Stopped => "stopped",
                };
                out!(
                    "{:<6} {:<9} {:<8} {:>6} {:>7}  {}",
                    n.index,
                    state,
                    or_dash(n.pid.map(|p| p.to_string())),
                    or_dash(n.peers.map(|p| p.to_string())),
                    or_dash(n.height.map(|h| h.to_string())),
                    n.data_dir.display()
                )?;
            }
            Ok(())
        }
        TestnetCommand::Kill { node, dir } => {
            let pid = launcher::fault(&dir, node, launcher::Fault::Kill)?;
            out!(
                "node {node} killed (pid {pid}); `cannabis testnet restart {node}` brings it back"
            )?;
            Ok(())
        }
        TestnetCommand::Pause { node, dir } => {
            let pid = launcher::fault(&dir, node, launcher::Fault::Pause)?;
            out!("node {node} paused (pid {pid}); `cannabis testnet resume {node}` lets it go on")?;
            Ok(())
        }
        TestnetCommand::Resume { node, dir } => {
            let pid = launcher::fault(&dir, node, launcher::Fault::Resume)?;
            out!("node {node} resumed (pid {pid})")?;
            Ok(())
        }
        TestnetCommand::Scenario { file, dir, format } => {
            use cannabis_testnet::scenario::{self, Scenario};
            let s = Scenario::load(&file)?;
            let base = file
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .to_path_buf();
            // A fresh testnet unless one is named; dropping it stops its nodes.
            let fresh = dir.is_none();
            let dir = dir.unwrap_or_else(|| {
                std::env::temp_dir().join(format!("cannabis-scenario-{}", std::process::id()))
            });
            let net = if fresh {
                if !format.json {
                    out!("starting {} nodes in {} ...", s.nodes, dir.display())?;
                }
                Some(Testnet::up(&TestnetOptions {
                    binary: binary.clone(),
                    dir: dir.clone(),
                    nodes: s.nodes,
                    ready_timeout: Duration::from_secs(30),
                })?)
            } else {
                None
            };
            let nodes: Vec<_> = launcher::status(&dir)?
                .into_iter()
                .map(|n| n.data_dir)
                .collect();
            if !format.json {
                out!("scenario {:?} on {} nodes", s.name, nodes.len())?;
            }
            let json = format.json;
            let report = scenario::run(&s, &base, &binary, &dir, nodes, |n, ok, what| {
                if !json {
                    let mark = if ok { "pass" } else { "FAIL" };
                    let _ = out!("  {mark}  {n:>2}. {what}");
                }
            });
            drop(net);
            if fresh {
                let _ = std::fs::remove_dir_all(&dir);
            }
            if json {
                output::json(&report)?;
            }
            let total = s.steps.len();
            let passed = report.steps.iter().filter(|s| s.1).count();
            anyhow::ensure!(
                report.passed() && report.steps.len() == total,
                "scenario {:?} failed: {passed} of {total} steps passed",
                s.name
            );
            if !json {
                out!("scenario {:?} passed: {total} steps", s.name)?;
            }
            Ok(())
        }
        TestnetCommand::Partition { groups, dir } => {
            let groups = groups
                .iter()
                .map(|g| {
                    g.split(',')
                        .map(|i| {
                            i.trim()
                                .parse::<usize>()
                                .with_context(|| format!("{g:?}: node indices, e.g. 0,1"))
                        })
                        .collect::<anyhow::Result<Vec<usize>>>()
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            launcher::partition(&dir, &groups)?;
            let sides: Vec<String> = groups
                .iter()
                .map(|g| {
                    g.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .collect();
            out!(
                "partitioned: {} (`cannabis testnet heal` ends it)",
                sides.join(" | ")
            )?;
            Ok(())
        }
        TestnetCommand::Corrupt { node, off, dir } => {
            launcher::corrupt(&dir, node, !off)?;
            if off {
                out!("node {node} delivers its real outputs again")?;
            } else {
                out!("node {node} now delivers wrong outputs (the first byte of each flipped)")?;
            }
            Ok(())
        }
        TestnetCommand::Slow {
            node,
            delay,
            loss,
            dir,
        } => {
            anyhow::ensure!(
                (0.0..=1.0).contains(&loss),
                "--loss is a share from 0 to 1 (0.05 is 5%)"
            );
            anyhow::ensure!(delay <= 60_000, "--delay is at most 60000 ms");
            launcher::slow(&dir, node, delay, (loss * 1e6).round() as u32)?;
            if delay == 0 && loss == 0.0 {
                out!("node {node}'s links are plain again")?;
            } else {
                out!(
                    "node {node} now receives every byte {delay} ms late, and {:.2}% of them \
                     a retransmission timeout later still",
                    loss * 100.0
                )?;
            }
            Ok(())
        }
        TestnetCommand::Heal { dir } => {
            launcher::heal(&dir)?;
            out!("healed: every node may connect to every other again")?;
            Ok(())
        }
        TestnetCommand::Restart { node, dir } => {
            let info = launcher::restart(&dir, &binary, node, Duration::from_secs(60))?;
            out!(
                "node {node} started again (pid {}, api {})",
                info.pid,
                info.api.as_deref().unwrap_or("-")
            )?;
            Ok(())
        }
        TestnetCommand::Down { dir } => {
            let n = launcher::down(&dir)?;
            out!("stopped {n} nodes of the testnet in {}", dir.display())?;
            Ok(())
        }
        TestnetCommand::Attack {
            targets,
            dir,
            seconds,
            only,
            format,
        } => {
            let targets = if targets.is_empty() {
                launcher::dial_addrs(&dir)?
                    .iter()
                    .map(|a| a.parse())
                    .collect::<Result<Vec<libp2p::Multiaddr>, _>>()?
            } else {
                targets
            };
            if !format.json {
                out!("attacking {} nodes for {seconds} s ...", targets.len())?;
            }
            let kinds = if only.is_empty() {
                super::attack::Kind::ALL.to_vec()
            } else {
                only
            };
            let r = super::attack::run(&targets, &kinds, Duration::from_secs(seconds))?;
            if format.json {
                return output::json(&r);
            }
            output::table(&[
                ("nodes attacked", r.targets.to_string()),
                ("ran", format!("{} ms", r.ran_ms)),
                ("valid offers flooded", r.offers_published.to_string()),
                (
                    "garbage and forged messages",
                    r.garbage_published.to_string(),
                ),
                (
                    "sync pages served / refused",
                    format!("{} / {}", r.sync_pages, r.sync_refused),
                ),
                (
                    "greedy challenges sent / proved",
                    format!("{} / {}", r.challenges_sent, r.challenges_proved),
                ),
                ("idle sockets opened", r.sockets_opened.to_string()),
                ("came back after being let go", r.redials.to_string()),
            ])?;
            Ok(())
        }
        TestnetCommand::Bench {
            nodes,
            offers,
            pings,
            dir,
            hostile,
            only,
            transfer_mib,
            channel_mib,
            all,
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
                hostile: hostile.then(|| {
                    only.iter()
                        .filter_map(clap::ValueEnum::to_possible_value)
                        .map(|v| v.get_name().to_string())
                        .collect()
                }),
                transfer_bytes: transfer_mib
                    .checked_mul(1 << 20)
                    .context("--transfer-mib is too large")?,
                channel_bytes: channel_mib
                    .checked_mul(1 << 20)
                    .context("--channel-mib is too large")?,
            };
            let r = bench::run(&opts)?;
            // The figures two other commands measure, each as it measures them, after the
            // testnet has stopped (they time the machine, which its nodes would share).
            let others = if all {
                Some(node_free_figures(&opts.testnet.binary, &opts.testnet.dir)?)
            } else {
                None
            };
            if format.json {
                let mut v = serde_json::to_value(&r)?;
                if let Some((sandbox, ledger)) = others {
                    v["sandbox"] = sandbox;
                    v["ledger"] = ledger;
                }
                return output::json(&v);
            }
            let ms = |us: u64| format!("{:.3} ms", us as f64 / 1e3);
            output::table(&[
                ("nodes", r.nodes.to_string()),
                ("offers", r.offers.to_string()),
                ("start and converge", format!("{} ms", r.converge_ms)),
                (
                    "offer propagation",
                    propagation(&r.propagation_us, r.receipts_seen, r.receipts_expected),
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
                        "group of {} placed early: submit to all leases {} ms ({} ms to the last needed bid, {} ms from it to every lease)",
                        r.job_group,
                        r.job_submit_to_leases_ms,
                        r.job_submit_to_placed_ms,
                        r.job_placed_to_leases_ms
                    ),
                ),
                (
                    "jobs run and delivered",
                    format!(
                        "{} single jobs placed on their first bid: submit to running p50 {} ms p99 {} ms; to delivered p50 {} ms p99 {} ms",
                        r.work_jobs,
                        r.work_submit_to_running_ms.p50,
                        r.work_submit_to_running_ms.p99,
                        r.work_submit_to_delivered_ms.p50,
                        r.work_submit_to_delivered_ms.p99
                    ),
                ),
                (
                    "encrypted transfer",
                    match (&r.transfer, &r.transfer_skipped) {
                        (Some(t), _) => format!(
                            "{} MiB output: run completed to delivered {} ms ({} ms from the manifest); plain age encryption {} ms; ratio {:.2}",
                            t.bytes >> 20,
                            t.completed_to_delivered_ms,
                            t.manifest_to_delivered_ms,
                            t.age_encrypt_ms,
                            t.ratio
                        ),
                        (None, why) => format!("skipped: {}", why.as_deref().unwrap_or("")),
                    },
                ),
                (
                    "group channel",
                    match (&r.channel, &r.channel_skipped) {
                        (Some(c), _) => format!(
                            "{} MiB: {:.0} MB/s against {:.0} MB/s direct (ratio {:.2}); one-byte round trip p50 {} us against {} us direct",
                            c.bytes >> 20,
                            c.channel_mb_s,
                            c.direct_mb_s,
                            c.ratio,
                            c.channel_rtt_us.p50,
                            c.direct_rtt_us.p50
                        ),
                        (None, why) => format!("skipped: {}", why.as_deref().unwrap_or("")),
                    },
                ),
                (
                    "idle memory per node",
                    format!(
                        "RSS mean {:.1} MiB max {:.1} MiB; PSS mean {:.1} MiB max {:.1} MiB; {:.0} connections",
                        r.rss_kib_mean as f64 / 1024.0,
                        r.rss_kib_max as f64 / 1024.0,
                        r.pss_kib_mean as f64 / 1024.0,
                        r.pss_kib_max as f64 / 1024.0,
                        r.peers_mean,
                    ),
                ),
                (
                    "waits for quiet",
                    format!(
                        "{} ms before the group, work, transfer and channel phases{}",
                        r.quiet_wait_ms
                            .iter()
                            .map(u64::to_string)
                            .collect::<Vec<_>>()
                            .join(", "),
                        if r.not_quiet.is_empty() {
                            String::new()
                        } else {
                            format!("; not quiet within 30 s: {}", r.not_quiet.join(", "))
                        }
                    ),
                ),
            ])?;
            if let Some(h) = &r.hostile {
                let a = &h.attacker;
                output::table(&[
                    (
                        "under attack",
                        format!(
                            "{} valid offers from one key, {} garbage and forged messages, \
                             {} sync pages, {} greedy challenges ({} proved), {} idle sockets",
                            a["offers_published"],
                            a["garbage_published"],
                            a["sync_pages"],
                            a["challenges_sent"],
                            a["challenges_proved"],
                            a["sockets_opened"]
                        ),
                    ),
                    (
                        "offer propagation",
                        format!(
                            "{}; p99 {:.2}x the calm run's",
                            propagation(&h.propagation_us, h.receipts_seen, h.receipts_expected),
                            h.p99_ratio
                        ),
                    ),
                    (
                        "memory",
                        format!(
                            "largest RSS {:.1} MiB before, {:.1} MiB under attack; at most {} \
                             of the flood's offers held by a node",
                            h.rss_kib_max_before as f64 / 1024.0,
                            h.rss_kib_max_during as f64 / 1024.0,
                            h.flood_offers_held_max
                        ),
                    ),
                    (
                        "honest view",
                        format!(
                            "{} of {} nodes hold every honest node's ad",
                            h.nodes_holding_every_ad, r.nodes
                        ),
                    ),
                ])?;
            }
            if let Some((sandbox, ledger)) = others {
                let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
                let b = &sandbox["back_to_back"];
                output::table(&[
                    (
                        "sandbox start",
                        format!(
                            "{:.2} ms against a plain spawn's {:.2} ms and bubblewrap's {} (medians of {}, back to back; `exec bench`)",
                            f(&b["ours"]),
                            f(&b["plain"]),
                            b["bwrap"]
                                .as_f64()
                                .map_or("- (not installed)".into(), |x| format!("{x:.2} ms")),
                            sandbox["runs"]
                        ),
                    ),
                    (
                        "ledger",
                        format!(
                            "{:.0} durable transactions/s ({} transfers in {} blocks; `ledger bench`)",
                            f(&ledger["tx_per_s"]),
                            ledger["txs"],
                            ledger["blocks"]
                        ),
                    ),
                ])?;
            }
            Ok(())
        }
    }
}

/// A runtime to await them on, and SIGINT and SIGTERM caught from now on (instead of
/// ending this process at once).
fn signals() -> anyhow::Result<(
    tokio::runtime::Runtime,
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
)> {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (int, term) = runtime.block_on(async {
        anyhow::Ok((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    Ok((runtime, int, term))
}

/// Publish-to-receipt times, µs, as a table cell.
fn propagation(s: &cannabis_testnet::stats::Summary, seen: usize, expected: usize) -> String {
    let ms = |us: u64| format!("{:.3} ms", us as f64 / 1e3);
    format!(
        "p50 {}  p99 {}  max {}  ({seen} of {expected} receipts)",
        ms(s.p50),
        ms(s.p99),
        ms(s.max)
    )
}

fn print_sim(report: &sim::SimReport, wall: Duration) -> anyhow::Result<()> {
    output::table(&[
        (
            "nodes / offers",
            format!(
                "{} / {} ({:.*} offers/s of virtual time)",
                report.nodes,
                report.offers,
                if report.offer_rate < 10.0 { 2 } else { 0 },
                report.offer_rate
            ),
        ),
        (
            "jobs",
            format!(
                "{} completed, {} failed, {} cancelled; {:.1}% placed before the deadline",
                report.completed,
                report.failed,
                report.cancelled,
                report.placed_share * 100.0
            ),
        ),
        (
            "bids per offer",
            format!(
                "p50 {:.0}, p99 {:.0}, max {:.0}",
                report.bids_per_offer.p50, report.bids_per_offer.p99, report.bids_per_offer.max
            ),
        ),
        (
            "price against all bids",
            if report.price_samples == 0 {
                "not sampled".to_string()
            } else {
                format!(
                    "p50 {:.3}x, p99 {:.3}x ({} placements)",
                    report.price_ratio.p50, report.price_ratio.p99, report.price_samples
                )
            },
        ),
        (
            "submit to leased",
            format!(
                "p50 {:.0} ms, p99 {:.0} ms",
                report.placement_ms.p50, report.placement_ms.p99
            ),
        ),
        (
            "bids / declines / awards",
            format!("{} / {} / {}", report.bids, report.declines, report.awards),
        ),
        (
            "leases / retries / widened",
            format!(
                "{} / {} / {}",
                report.leases, report.retries, report.widened
            ),
        ),
        (
            "refused",
            format!(
                "{} stale epochs, {} busy",
                report.stale_refused, report.busy_refused
            ),
        ),
        (
            "cpu",
            format!(
                "offers take {:.1}% of every node ({} offer shards, {:.1}% reached per offer); busiest node {:.1}%{}",
                report.offer_cpu * 100.0,
                report.offer_shards,
                report.offer_reach * 100.0,
                report.busiest_cpu * 100.0,
                if report.overloaded {
                    "; OVERLOADED, stopped"
                } else {
                    ""
                }
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
            "virtual / wall time",
            format!(
                "{:.1} min / {:.2} s ({} engine calls)",
                report.virtual_ms as f64 / 60_000.0,
                wall.as_secs_f64(),
                report.events
            ),
        ),
    ])?;
    Ok(())
}

/// `exec bench --json` and `ledger bench --json` (in `dir/ledger-bench`), run as their
/// own commands: the sandbox's start-up and the ledger's durable throughput.
fn node_free_figures(
    binary: &std::path::Path,
    dir: &std::path::Path,
) -> anyhow::Result<(serde_json::Value, serde_json::Value)> {
    let run = |args: &[&std::ffi::OsStr]| -> anyhow::Result<serde_json::Value> {
        let o = std::process::Command::new(binary)
            .args(args)
            .output()
            .context("running cannabis")?;
        anyhow::ensure!(
            o.status.success(),
            "cannabis {:?}: {}",
            args,
            String::from_utf8_lossy(&o.stderr).trim()
        );
        Ok(serde_json::from_slice(&o.stdout)?)
    };
    let sandbox = run(&["exec", "bench", "--json"].map(std::ffi::OsStr::new))?;
    let ledger_dir = dir.join("ledger-bench");
    let ledger = run(&[
        "ledger".as_ref(),
        "bench".as_ref(),
        "--json".as_ref(),
        "--dir".as_ref(),
        ledger_dir.as_os_str(),
    ])?;
    let _ = std::fs::remove_dir_all(&ledger_dir);
    Ok((sandbox, ledger))
}

/// `testnet plot`: propagation against testnet size and the simulator's capacity against
/// its number of nodes, as charts and data.
fn plot(
    binary: &std::path::Path,
    out_dir: &std::path::Path,
    sizes: &[usize],
    offers: usize,
    sim_nodes: &[usize],
    duration: u64,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    use cannabis_testnet::plot::{self, Chart, Series};
    anyhow::ensure!(
        sizes.iter().all(|n| *n >= 2),
        "each testnet size is at least 2"
    );
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut propagation = Vec::new();
    for &nodes in sizes {
        if dir.exists() {
            launcher::down(dir)?;
            std::fs::remove_dir_all(dir).with_context(|| format!("emptying {}", dir.display()))?;
        }
        out!("testnet of {nodes} nodes: {offers} offers ...")?;
        let r = bench::run(&BenchOptions {
            testnet: TestnetOptions {
                binary: binary.to_path_buf(),
                dir: dir.to_path_buf(),
                nodes,
                ready_timeout: Duration::from_secs(60),
            },
            offers,
            interval: Duration::from_millis(100),
            pings: 200,
            hostile: None,
            transfer_bytes: 0,
            channel_bytes: 0,
        })?;
        out!(
            "  propagation p50 {} p99 {}, request-response p50 {}, {} of {} receipts",
            ms(r.propagation_us.p50),
            ms(r.propagation_us.p99),
            ms(r.request_response_rtt_us.p50),
            r.receipts_seen,
            r.receipts_expected
        )?;
        propagation.push(serde_json::json!({
            "nodes": nodes,
            "propagation_us": r.propagation_us,
            "request_response_rtt_us": r.request_response_rtt_us,
            "receipts_seen": r.receipts_seen,
            "receipts_expected": r.receipts_expected,
        }));
    }
    if dir.exists() {
        let _ = std::fs::remove_dir_all(dir);
    }
    let point = |v: &serde_json::Value, key: &str, field: &str| {
        (
            v["nodes"].as_f64().unwrap_or_default(),
            v[key][field].as_f64().unwrap_or_default() / 1000.0,
        )
    };
    let series = |name: &str, key: &str, field: &str| Series {
        name: name.into(),
        points: propagation.iter().map(|v| point(v, key, field)).collect(),
    };
    let written = |name: &str, text: String| -> anyhow::Result<()> {
        let path = out_dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        out!("wrote {}", path.display())?;
        Ok(())
    };
    if !propagation.is_empty() {
        written(
            "propagation.svg",
            plot::svg(
                &Chart {
                    title: "Offer propagation on a loopback testnet of real processes".into(),
                    x_label: "node processes".into(),
                    y_label: "milliseconds".into(),
                    log_x: true,
                    log_y: true,
                },
                &[
                    series("propagation p99", "propagation_us", "p99"),
                    series("propagation p50", "propagation_us", "p50"),
                    series("direct round trip p50", "request_response_rtt_us", "p50"),
                ],
            ),
        )?;
    }
    let mut capacity = Vec::new();
    let costs = sim::Costs::calibrated()?;
    for &nodes in sim_nodes {
        out!("simulated market of {nodes} nodes: finding its capacity ...")?;
        let steps = sim::find_capacity(nodes, duration, &costs, &|_| {}, 1, |s| {
            let _ = out!(
                "  {:>8.0} offers/s: {:5.1}% placed ({:.1} s)",
                s.rate,
                s.placed_share * 100.0,
                s.wall_ms as f64 / 1000.0
            );
        })?;
        let rate = sim::sustained(&steps).map_or(0.0, |s| s.rate);
        out!("  {rate:.0} offers/s with at least 95% placed")?;
        capacity.push(serde_json::json!({ "nodes": nodes, "offers_per_s": rate }));
    }

    if !capacity.is_empty() {
        written(
            "sim-capacity.svg",
            plot::svg(
                &Chart {
                    title: "Offers per second the simulated market sustains (95% placed)".into(),
                    x_label: "nodes".into(),
                    y_label: "offers per second".into(),
                    log_x: true,
                    log_y: true,
                },
                &[Series {
                    name: "capacity".into(),
                    points: capacity
                        .iter()
                        .map(|v| {
                            (
                                v["nodes"].as_f64().unwrap_or_default(),
                                v["offers_per_s"].as_f64().unwrap_or_default(),
                            )
                        })
                        .collect(),
                }],
            ),
        )?;
    }
    written(
        "plots.json",
        serde_json::to_string_pretty(&serde_json::json!({
            "propagation": propagation,
            "capacity": capacity,
        }))?,
    )
}

fn ms(us: u64) -> String {
    format!("{:.2} ms", us as f64 / 1000.0)
}

/// `testnet sim --find-capacity`: the highest rate the network sustains.
fn capacity(
    nodes: usize,
    duration: u64,
    costs: &sim::Costs,
    adjust: &dyn Fn(&mut sim::SimConfig),
    seed: u64,
    format: &Format,
) -> anyhow::Result<()> {
    let json = format.json;
    let steps = sim::find_capacity(nodes, duration, costs, adjust, seed, |s| {
        if !json {
            let _ = out!(
                "{:>8.0} offers/s: {:5.1}% placed, bids/offer p50 {:.0} p99 {:.0}, busiest cpu {:.0}%, {:.1} s wall",
                s.rate,
                s.placed_share * 100.0,
                s.report.bids_per_offer.p50,
                s.report.bids_per_offer.p99,
                s.report.busiest_cpu * 100.0,
                s.wall_ms as f64 / 1000.0
            );
        }
    })?;
    let best = sim::sustained(&steps);
    if json {
        return output::json(&serde_json::json!({
            "nodes": nodes,
            "capacity": best.map(|s| s.rate),
            "steps": steps,
        }));
    }
    match best {
        Some(s) => {
            out!(
                "capacity: {:.0} offers/s on {nodes} nodes ({:.1}% placed before the deadline)",
                s.rate,
                s.placed_share * 100.0
            )?;
            print_sim(&s.report, Duration::from_millis(s.wall_ms))
        }
        None => Ok(out!("no rate tried was sustained")?),
    }
}
