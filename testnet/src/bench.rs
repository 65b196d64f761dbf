//! `cannabis testnet bench`: offer propagation over N real node processes on loopback,
//! with the direct request-response round trip measured in the same run as the baseline,
//! and each node's idle resident memory.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_market::api::OfferTemplate;
use cannabis_protocol::{AdapterKind, Amount, Digest, Requirements, Resources, TaskSpec, Workload};
use serde::Serialize;

use crate::launcher::{Testnet, TestnetOptions};
use crate::stats::{Summary, summarize};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The testnet to start.
    pub testnet: TestnetOptions,
    /// Offers to publish from node 0.
    pub offers: usize,
    /// Pause between offers.
    pub interval: Duration,
    /// Request-response round trips for the baseline.
    pub pings: u32,
}

/// The figures.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Nodes in the testnet.
    pub nodes: usize,
    /// Offers published.
    pub offers: usize,
    /// Time for the testnet to start and connect (every node holds every ad), ms.
    pub converge_ms: u64,
    /// Publish-to-receipt time over every (offer, receiving node) pair, µs.
    pub propagation_us: Summary,
    /// Receipts expected and seen.
    pub receipts_expected: usize,
    /// Receipts seen within the wait.
    pub receipts_seen: usize,
    /// Direct request-response round trip node 0 -> node 1, µs (the baseline).
    pub request_response_rtt_us: Summary,
    /// Idle resident memory per node, KiB: mean.
    pub rss_kib_mean: u64,
    /// Idle resident memory per node, KiB: largest.
    pub rss_kib_max: u64,
}

/// The offer the benchmark publishes: one small synthetic task.
pub fn bench_offer(k: usize) -> OfferTemplate {
    OfferTemplate {
        name: None,
        job_id: None,
        tasks: vec![TaskSpec {
            name: format!("bench-{k}"),
            workload: Workload {
                adapter: AdapterKind::Synthetic,
                digest: Digest::of(b"cannabis/synthetic/v1"),
                entrypoint: vec!["64".into()],
            },
            inputs: Vec::new(),
            outputs: Vec::new(),
            resources: Resources::default(),
            requirements: Requirements::default(),
            group_size: 1,
            depends_on: Vec::new(),
            budget: Amount(1_000),
        }],
        ttl_ms: 10 * 60_000,
        deadline_ms: 20 * 60_000,
        review_window_ms: 60 * 60_000,
        acceptance: Vec::new(),
        fee_recipient: None,
    }
}

/// Runs the benchmark.
pub fn run(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    anyhow::ensure!(
        opts.testnet.nodes >= 2,
        "the benchmark needs at least 2 nodes"
    );
    let started = Instant::now();
    let net = Testnet::up(&opts.testnet)?;
    let converge_timeout = Duration::from_secs(60 + 2 * opts.testnet.nodes as u64);
    net.wait_converged(converge_timeout)?;
    let converge_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    // Let start-up work settle before measuring memory and latency.
    std::thread::sleep(Duration::from_secs(2));
    let rss = net.rss_kib();

    let origin = &net.nodes[0];
    let ping = origin
        .client
        .ping(&net.nodes[1].info.peer_id, opts.pings)
        .context("measuring the request-response baseline")?;
    let mut rtt = ping.rtt_us;

    let mut published = Vec::new();
    for k in 0..opts.offers {
        let p = origin.client.publish_offer(&bench_offer(k))?;
        published.push((p.job_id, p.published_at_us));
        std::thread::sleep(opts.interval);
    }

    let expected = published.len() * (net.nodes.len() - 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut latencies;
    loop {
        latencies = Vec::new();
        for node in &net.nodes[1..] {
            let offers = node.client.offers()?;
            for (job, at) in &published {
                if let Some(o) = offers.iter().find(|o| &o.job_id == job) {
                    latencies.push(o.received_at_us.saturating_sub(*at));
                }
            }
        }
        if latencies.len() >= expected || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let seen = latencies.len();
    Ok(BenchReport {
        nodes: net.nodes.len(),
        offers: published.len(),
        converge_ms,
        propagation_us: summarize(&mut latencies).context("no offer reached any node")?,
        receipts_expected: expected,
        receipts_seen: seen,
        request_response_rtt_us: summarize(&mut rtt).context("no round trip measured")?,
        rss_kib_mean: rss.iter().sum::<u64>() / rss.len().max(1) as u64,
        rss_kib_max: rss.iter().copied().max().unwrap_or(0),
    })
}
