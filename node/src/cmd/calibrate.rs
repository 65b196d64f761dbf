//! `cannabis testnet calibrate`: what the real node spends per message, for the
//! simulator's CPU model.
//!
//! Receiving a gossiped offer is measured on real node processes: four nodes on loopback,
//! one publishes offers nobody matches, and the others' CPU time (user + system, from
//! `/proc`) per offer, less what they spend idle, is the cost of receiving, checking,
//! storing and forwarding one offer through libp2p. The rest is measured in this process
//! on the same code the node runs: the wire frames, signatures, the market engine, and a
//! durable write of the node's store.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_market::fanin::FaninConfig;
use cannabis_market::testkit::{self, Machine};
use cannabis_market::{
    Answer, Command, Heard, Identity, Inbound, InboundId, Input, Market, MarketConfig, Origin,
    OutboundId, Output, Record, RecordOp,
};
use cannabis_node::store::Store;
use cannabis_protocol::{
    Amount, Bid, Cancel, DeliveryIdentity, Keypair, MarketRequest, Signed, Timestamp,
};
use cannabis_testnet::launcher::{Testnet, TestnetOptions};
use cannabis_testnet::sim::Costs;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Drains an engine as a node would, acknowledging writes at once (their cost is
/// measured on its own).
fn drain(m: &mut Market) {
    while let Some(o) = m.poll_output() {
        if let Output::Persist { batch, .. } = o {
            m.persisted(batch);
        }
    }
}

fn identity(k: &Keypair) -> Identity {
    Identity {
        address: k.address(),
        delivery: DeliveryIdentity::from_secret([3; 32]).recipient(),
    }
}

/// Measures every cost; the transport part starts a short testnet under `dir`.
pub(crate) fn run(dir: &Path) -> anyhow::Result<Costs> {
    let now = Timestamp(u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?);
    const WORKERS: u64 = 2_000;
    let requester = testkit::keys(0);
    // A requester that calls every worker, and keeps every bid.
    let config = MarketConfig {
        fanin: FaninConfig {
            min_target: 1_000_000,
            keep_factor: 1,
            ..FaninConfig::default()
        },
        fee: Some(testkit::fee_terms()),
        ..MarketConfig::default()
    };
    let mut market = Market::new(config, identity(&requester), now);
    let workers: Vec<Keypair> = (1..=WORKERS).map(testkit::keys).collect();
    for w in &workers {
        let ad = testkit::ad(w.address(), &Machine::default(), now);
        let item = Signed::sign(w, &ad).open()?;
        market.handle(
            now,
            Input::Ad(Heard {
                origin: Origin::Sync(cannabis_market::SyncId(0)),
                received_us: 0,
                item: std::sync::Arc::new(item),
            }),
        );
    }
    drain(&mut market);

    // Submitting an offer: sizing its call on the view, making it.
    let task = testkit::task("calibrate", 1, 0, 0, 1, 100_000_000);
    let mut submit = Vec::new();
    let mut job = None;
    for i in 0..200u8 {
        let t0 = Instant::now();
        let ok = market.command(
            now,
            Command::Submit {
                template: testkit::template(vec![task.clone()], 600_000, 3_600_000),
                nonce: [i; 16],
            },
        )?;
        let mut offer = None;
        while let Some(o) = market.poll_output() {
            match o {
                Output::Persist { batch, .. } => market.persisted(batch),
                Output::Publish(cannabis_market::Publish::Offer(body)) => offer = Some(body),
                _ => {}
            }
        }
        submit.push(micros(t0.elapsed()));
        if let (
            None,
            cannabis_market::CommandOk::Submitted {
                job: id,
                offer: oid,
            },
        ) = (&job, ok)
        {
            job = Some((id, oid, offer.context("no offer published")?));
        }
    }
    let (job_id, offer_id, offer) = job.context("no job")?;
    let signed = Signed::sign(&requester, &offer);
    market.command(now, Command::KeepOwnOffer(signed.open()?, 0))?;
    drain(&mut market);

    // Signing one directed message and encoding its frame.
    let bid = |w: &Keypair, i: u64| Bid {
        job_id,
        task: 0,
        offer: offer_id,
        worker: w.address(),
        price: Amount(100 + i),
        earliest_start: now,
        issued_at: now,
        valid_until: now.plus_ms(600_000),
    };
    let mut sign = Vec::new();
    let mut frames = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        let body = bid(w, i as u64);
        let t0 = Instant::now();
        let frame = cannabis_protocol::encode(&MarketRequest::Bid(Signed::sign(w, &body)));
        sign.push(micros(t0.elapsed()));
        frames.push(frame);
    }

    // Receiving a bid: the frame decoded, opened, and the engine's admission (the
    // signature included).
    let mut bid_in = Vec::new();
    for (i, (frame, w)) in frames.iter().zip(&workers).enumerate() {
        let t0 = Instant::now();
        let MarketRequest::Bid(s) = cannabis_protocol::decode::<MarketRequest>(frame)? else {
            anyhow::bail!("not a bid frame");
        };
        market.handle(
            now,
            Input::Request {
                req: InboundId(i as u64),
                from: w.address(),
                msg: Inbound::Bid(s.open()?),
            },
        );
        drain(&mut market);
        bid_in.push(micros(t0.elapsed()));
    }
    let kept = market
        .job(&job_id)
        .map(|j| j.tasks()[0].bid_count())
        .unwrap_or(0);
    anyhow::ensure!(
        kept == workers.len(),
        "the calibration's bids were not all taken ({kept} of {})",
        workers.len()
    );

    // Receiving another directed message (a cancellation, on a worker).
    let worker = &workers[0];
    let mut on_worker = Market::new(MarketConfig::default(), identity(worker), now);
    let mut directed_in = Vec::new();
    for i in 0..2_000u64 {
        let cancel = Cancel {
            job_id,
            task: 0,
            rank: 0,
            requester: requester.address(),
            worker: worker.address(),
            epoch: 1,
            reason: "calibration".into(),
            issued_at: now.plus_ms(i),
        };
        let frame =
            cannabis_protocol::encode(&MarketRequest::Cancel(Signed::sign(&requester, &cancel)));
        let t0 = Instant::now();
        let MarketRequest::Cancel(s) = cannabis_protocol::decode::<MarketRequest>(&frame)? else {
            anyhow::bail!("not a cancel frame");
        };
        on_worker.handle(
            now,
            Input::Request {
                req: InboundId(i),
                from: requester.address(),
                msg: Inbound::Cancel(s.open()?),
            },
        );
        drain(&mut on_worker);
        directed_in.push(micros(t0.elapsed()));
    }

    // Receiving an answer.
    let mut answer_in = Vec::new();
    for i in 0..2_000u64 {
        let t0 = Instant::now();
        on_worker.handle(
            now,
            Input::Response {
                req: OutboundId(i),
                result: Ok(Answer::Ack),
            },
        );
        drain(&mut on_worker);
        answer_in.push(micros(t0.elapsed()));
    }

    // One durable write of the store: a job with its bids.
    let tmp = tempfile::tempdir()?;
    let store = Store::open(&tmp.path().join("node.redb"))?;
    let record = market
        .job(&job_id)
        .map(|j| Record::Job(Box::new(j.clone())))
        .context("no job")?;
    let mut persist = Vec::new();
    for _ in 0..100 {
        let t0 = Instant::now();
        store.apply(&[RecordOp::Put(record.clone())], &requester.address())?;
        persist.push(micros(t0.elapsed()));
    }

    let offer_in_us = offer_in_processes(dir)?;
    Ok(Costs {
        offer_in_us,
        submit_us: median(submit),
        sign_us: median(sign),
        bid_in_us: median(bid_in),
        directed_in_us: median(directed_in),
        answer_in_us: median(answer_in),
        persist_us: median(persist),
        measured: format!(
            "cannabis testnet calibrate, {} build, {} cores, {}",
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model()
        ),
    })
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// User + system CPU time of a process, in seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest)
        .context("a /proc stat line without a command")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of the line (utime, stime) are 12 and 13 after the command.
    let utime: f64 = fields.get(11).context("no utime")?.parse()?;
    let stime: f64 = fields.get(12).context("no stime")?.parse()?;
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100) as f64;
    Ok((utime + stime) / tick)
}

/// CPU per offer received by a real node: four nodes, node 0 publishes offers nobody
/// matches (so nobody bids), the three others' CPU time is read before and after.
fn offer_in_processes(dir: &Path) -> anyhow::Result<f64> {
    let _ = std::fs::remove_dir_all(dir);
    let opts = TestnetOptions {
        binary: std::env::current_exe().context("finding this binary")?,
        dir: dir.to_path_buf(),
        nodes: 4,
        ready_timeout: Duration::from_secs(60),
    };
    let net = Testnet::up(&opts)?;
    net.wait_converged(Duration::from_secs(60))?;
    std::thread::sleep(Duration::from_secs(3));
    let receivers: Vec<u32> = net.nodes[1..].iter().map(|n| n.info.pid).collect();
    let cpu = || -> anyhow::Result<f64> { receivers.iter().map(|p| cpu_seconds(*p)).sum() };
    // What they spend idle, over the same kind of span.
    let (idle_start, t0) = (cpu()?, Instant::now());
    std::thread::sleep(Duration::from_secs(3));
    let idle_rate = (cpu()? - idle_start) / t0.elapsed().as_secs_f64();
    const OFFERS: usize = 2_000;
    let mut template = cannabis_testnet::bench::bench_offer(0);
    // A GPU nobody has: every node checks, keeps and forwards the offer; nobody bids.
    template.tasks[0].resources.gpus = 1;
    let origin = &net.nodes[0].client;
    let (start, t0) = (cpu()?, Instant::now());
    // Published from four threads at once, so the offers arrive as a stream (as under
    // load), not one by one.
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let mut template = template.clone();
                s.spawn(move || -> anyhow::Result<()> {
                    for k in (t..OFFERS).step_by(4) {
                        template.tasks[0].name = format!("calibrate-{k}");
                        origin.publish_offer(&template)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow::anyhow!("a publishing thread panicked"))??;
        }
        Ok(())
    })?;
    // Until every receiver holds every offer (asked sparingly: the answer is small).
    let deadline = Instant::now() + Duration::from_secs(60);
    for node in &net.nodes[1..] {
        while node.client.status()?.offers < OFFERS {
            anyhow::ensure!(Instant::now() < deadline, "the offers did not arrive");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let spent = cpu()? - start - idle_rate * t0.elapsed().as_secs_f64();
    drop(net);
    let _ = std::fs::remove_dir_all(dir);
    Ok((spent / (receivers.len() * OFFERS) as f64 * 1e6).max(0.0))
}
