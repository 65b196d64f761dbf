//! A deterministic simulation of the market: many simulated nodes, each running the real
//! market engine ([`cannabis_market::Market`], through the same in-memory driver the
//! market's own tests use), with virtual time, a network that delays, drops and duplicates
//! messages, workers that crash and come back from their stores, and a CPU model that
//! charges each node what the real node spends per message (see [`Costs`]).
//!
//! The same seed gives the same run, step for step (the numbers come from
//! `testkit::Rng`, SplitMix64 written out, so a seed survives dependency upgrades).
//!
//! Checked during the run: the same assignment and epoch is never countersigned by two
//! workers. Checked at the end: every job ended in a defined state, nothing is left
//! committed, and for every job `spent + refund == budget`.
//!
//! Two shortcuts keep 100,000 nodes within minutes, and neither changes what the engines
//! decide. An offer is handed only to the workers its bid call can draw (found on the
//! draw's ring, checked with the same pure function the engine uses; the engine decides
//! again): the others would only have stored it. Their cost of receiving it is charged as a
//! share of every node's CPU (`rate * offer_in`), instead of one event per node and offer.
//! A test runs a small network both ways and gets the same report.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::Arc;

use cannabis_market::job::{Early, JobState, LeaseConfig};
use cannabis_market::lease::AssignmentKey;
use cannabis_market::placement::{self, Candidate, Class};
use cannabis_market::quote::{self, WorkerPolicy};
use cannabis_market::testkit::net::{Envelope, Node};
use cannabis_market::testkit::{self, Machine, Rng};
use cannabis_market::{
    Command, CommandOk, Identity, Inbound, Input, MarketConfig, MarketEvent, Refusal, Signatures,
};
use cannabis_protocol::draw;
use cannabis_protocol::{
    Address, Amount, CapabilityAd, DeliveryIdentity, GpuVendor, JobOffer, Received, Timestamp,
    Uuid, message_id,
};
use serde::{Deserialize, Serialize};

/// What each kind of work costs a node's CPU, in microseconds, as measured on the real
/// code by `cannabis testnet calibrate` (which writes this as JSON).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Costs {
    /// Receiving a gossiped offer: decode, signature check, the engine's view and quote.
    pub offer_in_us: f64,
    /// Sizing an offer's bid calls and making it (the requester).
    pub submit_us: f64,
    /// Signing and encoding one directed message (bid, award, acceptance, renewal).
    pub sign_us: f64,
    /// Receiving a bid: decode, signature check, the engine's admission.
    pub bid_in_us: f64,
    /// Receiving any other directed message (award, acceptance, renewal, cancellation,
    /// decline): decode, signature check, the engine.
    pub directed_in_us: f64,
    /// Receiving an answer to a request.
    pub answer_in_us: f64,
    /// One durable write of a batch (the store's commit, with its fsync).
    pub persist_us: f64,
    /// Where the figures came from.
    pub measured: String,
}

impl Costs {
    /// The figures measured on this project's reference machine with `cannabis testnet
    /// calibrate` (see docs/benchmarks.md), shipped with the binary.
    pub fn calibrated() -> anyhow::Result<Costs> {
        Ok(serde_json::from_str(include_str!("../calibration.json"))?)
    }
}

/// The shape of the work offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Task graphs of up to three tasks, groups, GPUs, runs of seconds to minutes, a bid
    /// window of 10 s: the market's rules under stress.
    Mixed,
    /// Single tasks (a tenth groups of two), a bid window of 2 s with early placement, a
    /// deadline of 60 s, runs of 1 to 5 s, a lease per core: how many offers a second the
    /// network places.
    Capacity,
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Simulated nodes; each is a worker, and the first `requesters` also publish offers.
    pub nodes: usize,
    /// Offers published.
    pub offers: usize,
    /// Nodes that publish offers.
    pub requesters: usize,
    /// The seed.
    pub seed: u64,
    /// Offers are published over this much virtual time.
    pub span_ms: u64,
    /// Largest one-way message delay.
    pub max_delay_ms: u64,
    /// Percent of messages lost.
    pub drop_pct: u64,
    /// Percent of messages delivered twice.
    pub dup_pct: u64,
    /// Percent of leases whose worker crashes while running.
    pub crash_pct: u64,
    /// The work offered.
    pub workload: Workload,
    /// The CPU each kind of work costs (all zero: no CPU model).
    pub costs: Costs,
    /// Hand every offer to every node instead of to the workers its call can draw (to
    /// check that the shortcut changes nothing).
    pub full_delivery: bool,
    /// Compare the price of every `price_sample`-th placement with the placement on the
    /// bids of every matching worker (0: never).
    pub price_sample: usize,
    /// Topics offers travel on (see the node's `gossip.offer_shards`).
    pub offer_shards: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 500,
            offers: 200,
            requesters: 20,
            seed: 1,
            span_ms: 600_000,
            max_delay_ms: 2_000,
            drop_pct: 2,
            dup_pct: 2,
            crash_pct: 1,
            workload: Workload::Mixed,
            costs: Costs::default(),
            full_delivery: false,
            price_sample: 10,
            offer_shards: 1,
        }
    }
}

/// Percentiles of a distribution.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

fn spread(mut v: Vec<f64>) -> Spread {
    if v.is_empty() {
        return Spread::default();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Spread {
        p50: at(0.5),
        p99: at(0.99),
        max: v[v.len() - 1],
    }
}

/// What happened.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimReport {
    /// Nodes simulated.
    pub nodes: usize,
    /// Offers published.
    pub offers: usize,
    /// Offers published per second of virtual time.
    pub offer_rate: f64,
    /// Jobs whose first task held every lease before the deadline, as a share of offers.
    pub placed_share: f64,
    /// Jobs whose every task delivered.
    pub completed: usize,
    /// Jobs that failed (a task could not be placed or ran out of attempts or time).
    pub failed: usize,
    /// Jobs cancelled.
    pub cancelled: usize,
    /// Bids kept per offer by the requester.
    pub bids_per_offer: Spread,
    /// Bids sent.
    pub bids: u64,
    /// Signed declines sent.
    pub declines: u64,
    /// Awards sent.
    pub awards: u64,
    /// Leases that became current.
    pub leases: u64,
    /// Assignments retried with a new epoch.
    pub retries: u64,
    /// Calls widened for too few bids.
    pub widened: u64,
    /// Messages refused for a stale epoch.
    pub stale_refused: u64,
    /// Awards refused because the worker was busy.
    pub busy_refused: u64,
    /// Price of the chosen placement over the price of placement on every matching
    /// worker's bid (sampled).
    pub price_ratio: Spread,
    /// Placements compared for `price_ratio`.
    pub price_samples: usize,
    /// Submission to every rank of the first task leased, ms.
    pub placement_ms: Spread,
    /// Largest share of one node's CPU in use, averaged over the run.
    pub busiest_cpu: f64,
    /// Every node's CPU share taken by receiving offers.
    pub offer_cpu: f64,
    /// Offer shards.
    pub offer_shards: u32,
    /// The run was stopped because the nodes could not keep up (queues only grew).
    pub overloaded: bool,
    /// The share of the shards an offer reached, on average.
    pub offer_reach: f64,
    /// Messages sent.
    pub messages: u64,
    /// Messages lost.
    pub dropped: u64,
    /// Engine calls made.
    pub events: u64,
    /// Virtual time simulated, ms.
    pub virtual_ms: u64,
    /// Budget of all jobs.
    pub budget: u64,
    /// Paid for delivered work.
    pub spent: u64,
    /// Returned to requesters.
    pub refunded: u64,
}

/// Something for a node to take in.
enum Item {
    Envelope(Envelope),
    Submit(Box<cannabis_market::OfferTemplate>),
    Delivered {
        job: Uuid,
        key: AssignmentKey,
        epoch: u64,
    },
    Tick,
}

enum Event {
    /// An offer is submitted (template `.1`) on requester `.0`.
    Publish(usize, usize),
    /// Something reaches a node.
    Arrive(usize, Item),
    /// A node's CPU takes its inbox.
    Run(usize),
    /// A node's engine asked to be woken.
    Wake(usize),
    /// A running rank finished its work.
    Finish {
        worker: usize,
        job: Uuid,
        key: AssignmentKey,
        epoch: u64,
    },
    /// A crashed node comes back.
    Up(usize),
}

struct SimNode {
    node: Node,
    machine: Machine,
    inbox: VecDeque<Item>,
    /// CPU busy until (µs).
    free_at: u64,
    /// CPU time spent (µs).
    busy_us: f64,
    run_pending: bool,
    /// The wake its engine asked for last (stale heap entries are skipped).
    wake_at: Option<u64>,
    down: bool,
}

/// A violated invariant, with what was seen.
#[derive(Debug, thiserror::Error)]
#[error("invariant violated at {at} ms: {what}")]
pub struct Violation {
    /// Virtual time.
    pub at: u64,
    /// What.
    pub what: String,
}

const T0_MS: u64 = 1_800_000_000_000;
/// Events in flight beyond which a run counts as overloaded (and memory stays bounded).
const OVERLOAD_EVENTS: usize = 20_000_000;

/// How long the simulated ads live: the whole run.
const AD_TTL_MS: u64 = 30 * 86_400_000;
/// Most inputs a node takes in one turn (as the node's driver does).
const BATCH: usize = 64;

fn machine(rng: &mut Rng) -> Machine {
    let cores = [2, 4, 8, 16, 32, 64][rng.below(6) as usize];
    let gpus = match rng.below(10) {
        0..=4 => Vec::new(),
        5..=7 => vec![
            (GpuVendor::Nvidia, [16, 24, 48, 80][rng.below(4) as usize]);
            1 + rng.below(2) as usize
        ],
        _ => vec![(GpuVendor::Amd, [24, 64][rng.below(2) as usize])],
    };
    Machine {
        cores,
        memory_gib: u64::from(cores) * 4,
        gpus,
        torch: [None, Some("2.3.1"), Some("2.5.1")][rng.below(3) as usize],
        cpu_core_hour: 5 + rng.below(20),
        gpu_hour: 500 + rng.below(1500),
        dev_attested: false,
    }
}

struct Sim {
    config: SimConfig,
    rng: Rng,
    /// Virtual time, µs.
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: BTreeMap<u64, Event>,
    nodes: Vec<SimNode>,
    index: BTreeMap<Address, usize>,
    /// Workers by their place on the draw's ring.
    ring: Vec<(u64, usize)>,
    ads: Vec<Arc<Received<CapabilityAd>>>,
    templates: Vec<cannabis_market::OfferTemplate>,
    /// Requester of each job, and when it was submitted (µs).
    jobs: BTreeMap<Uuid, (usize, u64)>,
    /// When each job's first task held every lease (µs).
    placed: BTreeMap<Uuid, u64>,
    /// Which worker countersigned each (assignment, epoch).
    countersigned: BTreeMap<(AssignmentKey, u64), usize>,
    /// Offers as published (kept only with `full_delivery`, to check the shortcut).
    offers: BTreeMap<Uuid, Arc<Received<JobOffer>>>,
    price_ratios: Vec<f64>,
    /// Share of each node's CPU taken by receiving every offer (offers on one topic).
    background: f64,
    /// Sum over published offers of the share of shards they reached (with one shard,
    /// one per offer): a node receives that share of the network's offers.
    reach_sum: f64,
    reach_count: u64,
    /// Nothing happens after this (µs): every job's deadline has passed.
    horizon: u64,
    report: SimReport,
}

fn us(ms: u64) -> u64 {
    ms * 1000
}

impl Sim {
    fn new(config: SimConfig) -> Self {
        let mut rng = Rng(config.seed);
        let now = us(T0_MS);
        let t0 = Timestamp(T0_MS);
        // Mixed: a lease per eight cores, so workers fill up and refuse as busy. Capacity:
        // a lease per core, so the market, not the machines, is what runs out.
        let per_lease = match config.workload {
            Workload::Mixed => 8,
            Workload::Capacity => 1,
        };
        let market_config = |m: &Machine| MarketConfig {
            worker: WorkerPolicy {
                custom_code: true,
                max_leases: (m.cores / per_lease).max(1),
                ..WorkerPolicy::default()
            },
            leases: LeaseConfig::default(),
            signatures: Signatures::Assume,
            // Ads are made once and last the whole run. A simulated requester stands for
            // many real ones (it submits hundreds of jobs a second), so the per-signer
            // limits of a real node's view are lifted.
            view: cannabis_market::ViewConfig {
                max_ad_ttl_ms: AD_TTL_MS,
                max_offers_per_signer: usize::MAX,
                max_offer_bytes: usize::MAX,
                offer_rate: None,
                ..cannabis_market::ViewConfig::default()
            },
            fee: Some(testkit::fee_terms()),
            ..MarketConfig::default()
        };
        let mut nodes = Vec::with_capacity(config.nodes);
        let mut ads = Vec::with_capacity(config.nodes);
        for i in 0..config.nodes {
            let address = testkit::keys(i as u64 + 1).address();
            let m = machine(&mut rng);
            let mut ad = testkit::ad(address, &m, t0);
            ad.expires_at = Timestamp(T0_MS + AD_TTL_MS);
            // Some owners take only large jobs: they decline, with the reason.
            if rng.percent(10) {
                ad.prices.minimum_job = Amount(150_000);
            }
            let mut policy = market_config(&m);
            policy.worker.custom_code = rng.percent(70);
            let me = Identity {
                address,
                delivery: DeliveryIdentity::from_secret([2; 32]).recipient(),
            };
            let mut node = Node::new(policy, me, None, t0);
            node.publish_ad(t0, ad.clone());
            ads.push(Arc::new(Received::assumed(ad, address)));
            nodes.push(SimNode {
                node,
                machine: m,
                inbox: VecDeque::new(),
                free_at: now,
                busy_us: 0.0,
                run_pending: false,
                wake_at: None,
                down: false,
            });
        }
        // Every requester holds every ad (they are shared, not copied).
        for r in 0..config.requesters.min(config.nodes) {
            for ad in &ads {
                if ad.body.node != nodes[r].node.address() {
                    nodes[r].node.deliver(
                        t0,
                        Envelope::Ad {
                            from: ad.body.node,
                            item: ad.clone(),
                        },
                    );
                }
            }
            nodes[r].node.drain(t0);
        }
        let index = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.node.address(), i))
            .collect();
        let mut ring: Vec<(u64, usize)> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (draw::worker_point(&n.node.address()), i))
            .collect();
        ring.sort_unstable();
        let span_s = config.span_ms.max(1) as f64 / 1000.0;
        let rate = config.offers as f64 / span_s;
        let background = rate * config.costs.offer_in_us / 1e6;
        Self {
            rng,
            now,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            nodes,
            index,
            ring,
            ads,
            templates: Vec::new(),
            jobs: BTreeMap::new(),
            placed: BTreeMap::new(),
            countersigned: BTreeMap::new(),
            offers: BTreeMap::new(),
            price_ratios: Vec::new(),
            background,
            reach_sum: 0.0,
            reach_count: 0,
            horizon: us(T0_MS + config.span_ms + 3_600_000 + 60_000),
            report: SimReport {
                offer_rate: rate,
                offer_cpu: background,
                ..SimReport::default()
            },
            config,
        }
    }

    /// Share of a node's CPU taken by receiving offers: each receives those of its shard.
    fn offer_load(&self) -> f64 {
        self.background * self.offer_reach()
    }

    /// The share of the shards an offer reached so far, on average.
    fn offer_reach(&self) -> f64 {
        if self.reach_count == 0 {
            1.0
        } else {
            self.reach_sum / self.reach_count as f64
        }
    }

    fn at(&mut self, t: u64, e: Event) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.events.insert(self.seq, e);
    }

    fn violation(&self, what: String) -> Violation {
        Violation {
            at: self.now / 1000 - T0_MS,
            what,
        }
    }

    /// A one-way network delay, µs.
    fn delay(&mut self) -> u64 {
        us(1 + self.rng.below(self.config.max_delay_ms))
    }

    /// Sends `e` to `to` from time `from`: delayed, maybe lost, maybe duplicated.
    fn send(&mut self, from: u64, to: usize, e: Envelope) {
        self.report.messages += 1;
        if self.rng.percent(self.config.drop_pct) {
            self.report.dropped += 1;
            return;
        }
        if self.rng.percent(self.config.dup_pct) {
            let t = from + self.delay();
            self.at(t, Event::Arrive(to, Item::Envelope(e.clone())));
        }
        let t = from + self.delay();
        self.at(t, Event::Arrive(to, Item::Envelope(e)));
    }

    fn template(&mut self, j: usize) -> cannabis_market::OfferTemplate {
        let r = &mut self.rng;
        let mut tasks = Vec::new();
        let capacity = self.config.workload == Workload::Capacity;
        let n_tasks = if capacity { 1 } else { 1 + r.below(3) as usize };
        for t in 0..n_tasks {
            let gpus = u32::from(r.percent(30));
            let group = match (capacity, r.percent(if capacity { 10 } else { 20 })) {
                (_, false) => 1,
                (true, true) => 2,
                (false, true) => 2 + r.below(3) as u32,
            };
            let cores = [1, 2, 4, 8][r.below(4) as usize];
            let mut task = testkit::task(
                &format!("t{t}"),
                cores,
                gpus,
                if gpus > 0 {
                    [16, 24, 48][r.below(3) as usize]
                } else {
                    0
                },
                group,
                u64::from(group) * (2_000 + r.below(200_000)),
            );
            if t > 0 && r.percent(70) {
                task.depends_on = vec![t as u32 - 1];
            }
            tasks.push(task);
        }
        let mut t = if capacity {
            testkit::template(tasks, 2_000, 60_000)
        } else {
            testkit::template(tasks, 10_000, 3_600_000)
        };
        if capacity {
            t.early = Some(Early::FirstBids(4));
        }
        t.nonce = Some(Uuid::from_random({
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&(j as u64).to_le_bytes());
            b[8..].copy_from_slice(&self.config.seed.to_le_bytes());
            b
        }));
        t
    }

    /// The workers an offer is handed to: those its call can draw (every node with
    /// `full_delivery`).
    fn candidates(&self, item: &Received<JobOffer>) -> Vec<usize> {
        if self.config.full_delivery {
            let requester = self.index.get(&item.body.requester).copied();
            return (0..self.nodes.len())
                .filter(|&i| Some(i) != requester)
                .collect();
        }
        self.drawable(item)
    }

    /// The workers an offer's call can draw at any price: on the draw's ring, within the
    /// distance the largest weight reaches.
    fn drawable(&self, item: &Received<JobOffer>) -> Vec<usize> {
        let offer = &item.body;
        let requester = self.index.get(&offer.requester).copied();
        let mut out = Vec::new();
        for (t, call) in offer.calls.iter().enumerate() {
            if call.odds_ppb >= draw::ODDS_ONE {
                return (0..self.nodes.len())
                    .filter(|&i| Some(i) != requester)
                    .collect();
            }
            let p = draw::task_point(&offer.job_id, t as u32);
            let reach = draw::threshold(call.odds_ppb, draw::WEIGHT_MAX);
            let start = self.ring.partition_point(|(wp, _)| *wp < p);
            let n = self.ring.len();
            // A worker quotes its price for the time left to the deadline when it takes
            // the offer, at the latest when the bid window ends: the price for that
            // shortest time is the lowest it can quote, so the largest weight it can have.
            let spec = &offer.tasks[t];
            let shortest = offer.deadline.ms_since(offer.expires_at);
            let ref_reach = draw::threshold(call.odds_ppb, draw::WEIGHT_ONE);
            for k in 0..n {
                let (wp, i) = self.ring[(start + k) % n];
                let d = draw::distance(p, wp);
                if d >= reach {
                    break;
                }
                if Some(i) == requester {
                    continue;
                }
                let ad = &self.ads[i].body;
                // Drawn to bid at its lowest price, or to decline (at the reference).
                let bid = quote::price(&ad.prices, ad, spec, shortest).is_some_and(|low| {
                    d < draw::threshold(call.odds_ppb, draw::weight(low, call.ref_price))
                });
                if bid || d < ref_reach {
                    out.push(i);
                }
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Hands an item to a node: it waits in the inbox until the node's CPU takes it.
    fn arrive(&mut self, i: usize, item: Item) {
        if self.nodes[i].down {
            return;
        }
        self.nodes[i].inbox.push_back(item);
        if !self.nodes[i].run_pending {
            self.nodes[i].run_pending = true;
            let t = self.now.max(self.nodes[i].free_at);
            self.at(t, Event::Run(i));
        }
    }

    fn cost_of(&self, item: &Item) -> f64 {
        let c = &self.config.costs;
        match item {
            Item::Envelope(Envelope::Offer { .. } | Envelope::Ad { .. }) => c.offer_in_us,
            Item::Envelope(Envelope::Request { msg, .. }) if matches!(**msg, Inbound::Bid(_)) => {
                c.bid_in_us
            }
            Item::Envelope(Envelope::Request { .. }) => c.directed_in_us,
            Item::Envelope(Envelope::Response { .. }) => c.answer_in_us,
            Item::Submit(_) => c.submit_us,
            Item::Delivered { .. } => c.directed_in_us,
            Item::Tick => 0.0,
        }
    }

    /// A node's CPU takes what waits in its inbox (up to a batch), feeds its engine, and
    /// sends what the engine asks; it is busy for what that costs.
    fn run(&mut self, i: usize) -> Result<(), Violation> {
        self.nodes[i].run_pending = false;
        if self.nodes[i].down {
            self.nodes[i].inbox.clear();
            return Ok(());
        }
        let start = self.now.max(self.nodes[i].free_at);
        let mut work = 0.0;
        let mut n = 0;
        while n < BATCH {
            let Some(item) = self.nodes[i].inbox.pop_front() else {
                break;
            };
            n += 1;
            work += self.cost_of(&item);
            self.take(i, item, start)?;
        }
        let now_ts = Timestamp(start / 1000);
        let out = self.nodes[i].node.drain(now_ts);
        let persisted = std::mem::take(&mut self.nodes[i].node.store_writes);
        let c = &self.config.costs;
        work += persisted as f64 * c.persist_us;
        let signed = out
            .iter()
            .filter(|e| matches!(e, Envelope::Request { .. } | Envelope::Offer { .. }))
            .count();
        work += signed as f64 * c.sign_us;
        // The node's CPU is shared with receiving the network's offers (those of its shard).
        let share = (1.0 - self.offer_load()).max(1e-3);
        let elapsed = (work / share).ceil() as u64;
        let done = start + elapsed;
        self.nodes[i].free_at = done;
        self.nodes[i].busy_us += work;
        self.route(done, out)?;
        self.after(i)?;
        if !self.nodes[i].inbox.is_empty() {
            self.nodes[i].run_pending = true;
            self.at(done, Event::Run(i));
        }
        Ok(())
    }

    /// One item into node `i`'s engine at time `t`.
    fn take(&mut self, i: usize, item: Item, t: u64) -> Result<(), Violation> {
        self.report.events += 1;
        let now = Timestamp(t / 1000);
        match item {
            Item::Envelope(e) => self.nodes[i].node.deliver(now, e),
            Item::Tick => self.nodes[i].node.market.handle(now, Input::Tick),
            Item::Submit(template) => {
                let done = self.nodes[i].node.market.command(
                    now,
                    Command::Submit {
                        template: *template,
                        nonce: [0; 16],
                    },
                );
                match done {
                    Ok(CommandOk::Submitted { job, .. }) => {
                        self.jobs.insert(job, (i, t));
                    }
                    other => return Err(self.violation(format!("a submission failed: {other:?}"))),
                }
            }
            Item::Delivered { job, key, epoch } => {
                // The requester takes a delivery only for the current epoch: a stale one
                // is refused like any stale message.
                let done = self.nodes[i].node.market.command(
                    now,
                    Command::Delivered {
                        job,
                        task: key.1,
                        rank: key.2,
                        epoch,
                        outputs: Vec::new(),
                    },
                );
                if let Err(cannabis_market::CommandError::Refused(Refusal::StaleEpoch { .. })) =
                    done
                {
                    self.report.stale_refused += 1;
                }
            }
        }
        Ok(())
    }

    /// What node `i` sent, onto the network.
    fn route(&mut self, from: u64, out: Vec<Envelope>) -> Result<(), Violation> {
        for e in out {
            match &e {
                Envelope::Offer { item, .. } => {
                    let shards = self.config.offer_shards;
                    let reached = draw::offer_shards(&item.body, shards);
                    self.reach_sum += reached.len() as f64 / f64::from(shards.max(1));
                    self.reach_count += 1;
                    if self.config.full_delivery {
                        self.offers.insert(item.body.job_id, item.clone());
                    }
                    let to = self.candidates(item);
                    for w in to {
                        self.send(from, w, e.clone());
                    }
                }
                Envelope::Ad { .. } => {}
                Envelope::Request { to, .. } | Envelope::Response { to, .. } => {
                    if let Some(&w) = self.index.get(to) {
                        self.send(from, w, e);
                    }
                }
            }
        }
        Ok(())
    }

    /// After node `i` ran: what its engine reported, and when it wants waking.
    fn after(&mut self, i: usize) -> Result<(), Violation> {
        let events = std::mem::take(&mut self.nodes[i].node.events);
        for e in events {
            match e {
                MarketEvent::BidSent { job, .. } => {
                    self.report.bids += 1;
                    self.check_drawable(i, job)?;
                }
                MarketEvent::Declined { job, .. } => {
                    self.report.declines += 1;
                    self.check_drawable(i, job)?;
                }
                MarketEvent::Awarded { epoch, .. } => {
                    self.report.awards += 1;
                    if epoch > 1 {
                        self.report.retries += 1;
                    }
                }
                MarketEvent::Widened { .. } => self.report.widened += 1,
                MarketEvent::LeaseTaken { key, epoch } => self.lease_taken(i, key, epoch)?,
                MarketEvent::Refused { why, .. } => match why {
                    Refusal::StaleEpoch { .. } => self.report.stale_refused += 1,
                    Refusal::Busy { .. } | Refusal::Short { .. } => self.report.busy_refused += 1,
                    _ => {}
                },
                MarketEvent::TaskLeased { job, task: 0 } => self.placed(i, job),
                _ => {}
            }
        }
        // Wakes past the last deadline (the ads' expiry, weeks ahead) are never needed.
        let wake = self.nodes[i]
            .node
            .market
            .poll_timeout()
            .map(|t| us(t.0).max(self.nodes[i].free_at))
            .filter(|t| *t <= self.horizon);
        if wake != self.nodes[i].wake_at
            && let Some(t) = wake
        {
            self.nodes[i].wake_at = Some(t);
            self.at(t, Event::Wake(i));
        }
        Ok(())
    }

    fn lease_taken(&mut self, w: usize, key: AssignmentKey, epoch: u64) -> Result<(), Violation> {
        if let Some(&other) = self.countersigned.get(&(key, epoch))
            && other != w
        {
            return Err(self.violation(format!(
                "{key:?} epoch {epoch} countersigned by workers {other} and {w}"
            )));
        }
        self.countersigned.insert((key, epoch), w);
        self.report.leases += 1;
        let at = self.nodes[w].free_at;
        if self.rng.percent(self.config.crash_pct) {
            // The worker dies and restarts a few minutes later; its workload is lost and
            // its lease runs out while it is down.
            self.nodes[w].down = true;
            self.nodes[w].inbox.clear();
            let back = at + us(60_000 + self.rng.below(240_000));
            self.at(back, Event::Up(w));
        } else {
            let run = match self.config.workload {
                Workload::Mixed => 5_000 + self.rng.below(600_000),
                Workload::Capacity => 1_000 + self.rng.below(4_000),
            };
            self.at(
                at + us(run),
                Event::Finish {
                    worker: w,
                    job: key.0,
                    key,
                    epoch,
                },
            );
        }
        Ok(())
    }

    /// Job `job` of requester `r` has its first task running: when, and (sampled) its
    /// price against placement on every matching worker's bid.
    fn placed(&mut self, r: usize, job: Uuid) {
        if self.placed.contains_key(&job) {
            return;
        }
        self.placed.insert(job, self.nodes[r].free_at);
        let sample = self.config.price_sample;
        if sample == 0 || !self.placed.len().is_multiple_of(sample) {
            return;
        }
        let Some(j) = self.nodes[r].node.market.job(&job) else {
            return;
        };
        let price: u64 = j.tasks()[0].ranks().iter().map(|a| a.price.0).sum();
        let offer = j.offer().clone();
        if let Some(best) = self.best_price(&offer) {
            self.price_ratios.push(price as f64 / best.0.max(1) as f64);
        }
    }

    /// With every offer handed to every node, a worker that answers one must be among the
    /// workers the shortcut would have handed it to.
    fn check_drawable(&self, worker: usize, job: Uuid) -> Result<(), Violation> {
        if !self.config.full_delivery {
            return Ok(());
        }
        let Some(item) = self.offers.get(&job) else {
            return Ok(());
        };
        if self.drawable(item).contains(&worker) {
            Ok(())
        } else {
            Err(self.violation(format!(
                "worker {worker} answered job {job} outside the workers its call can draw"
            )))
        }
    }

    /// The price of placing an offer's first task on the bids of every worker that
    /// matches it and would bid (its owner's policy allowing), at the offer's issue time.
    fn best_price(&self, offer: &JobOffer) -> Option<Amount> {
        let spec = offer.tasks.first()?;
        let id = message_id(offer);
        let mut everyone = offer.clone();
        everyone.calls = vec![draw::BidCall::EVERYONE; everyone.tasks.len()];
        let ctx = cannabis_market::matching::Context {
            now: offer.issued_at,
            ..cannabis_market::matching::Context::default()
        };
        let terms = testkit::fee_terms();
        let candidates: Vec<Candidate> = self
            .nodes
            .iter()
            .zip(&self.ads)
            .filter(|(n, _)| n.node.address() != offer.requester)
            .filter_map(|(n, ad)| {
                let policy = WorkerPolicy {
                    custom_code: true,
                    max_leases: n.machine.cores,
                    ..WorkerPolicy::default()
                };
                match quote::answer(&policy, Some(&terms), &ad.body, &everyone, id, 0, &ctx)? {
                    quote::Answer::Bid(bid) => Some(Candidate {
                        id: message_id(&bid),
                        class: Class::of(spec, &ad.body),
                        bid,
                        strikes: 0,
                    }),
                    _ => None,
                }
            })
            .collect();
        let slots = placement::place(
            spec,
            &candidates,
            &Default::default(),
            spec.budget,
            offer.issued_at,
        )
        .ok()?;
        Amount::sum(slots.iter().map(|s| &s.price)).ok()
    }

    fn step(&mut self, e: Event) -> Result<(), Violation> {
        /// How long a user whose node is down waits before submitting again.
        const SUBMIT_RETRY_MS: u64 = 5_000;
        match e {
            Event::Publish(r, j) => {
                if self.nodes[r].down {
                    // The requester's node is down: its user is told so and submits again
                    // a little later (a crashed node comes back up).
                    self.at(self.now + us(SUBMIT_RETRY_MS), Event::Publish(r, j));
                    return Ok(());
                }
                let template = self.templates[j].clone();
                self.arrive(r, Item::Submit(Box::new(template)));
            }
            Event::Arrive(i, item) => self.arrive(i, item),
            Event::Run(i) => self.run(i)?,
            Event::Wake(i) => {
                if self.nodes[i].wake_at == Some(self.now) {
                    self.nodes[i].wake_at = None;
                    self.arrive(i, Item::Tick);
                }
            }
            Event::Finish {
                worker,
                job,
                key,
                epoch,
            } => {
                // A delivery counts only under a lease the worker still holds.
                let now = Timestamp(self.now / 1000);
                let current = !self.nodes[worker].down
                    && self.nodes[worker]
                        .node
                        .market
                        .leases()
                        .is_current(&key, epoch, now);
                if current && let Some(&(r, _)) = self.jobs.get(&job) {
                    let t = self.now + self.delay();
                    self.at(t, Event::Arrive(r, Item::Delivered { job, key, epoch }));
                }
            }
            Event::Up(i) => {
                let now = Timestamp(self.now / 1000);
                self.nodes[i].down = false;
                self.nodes[i].node.restart(now);
                self.nodes[i].wake_at = None;
                self.nodes[i].free_at = self.now;
                self.arrive(i, Item::Tick);
            }
        }
        Ok(())
    }

    fn run_all(mut self) -> Result<SimReport, Violation> {
        let requesters = self.config.requesters.clamp(1, self.nodes.len());
        for j in 0..self.config.offers {
            let template = self.template(j);
            self.templates.push(template);
            let t = us(T0_MS) + us(self.rng.below(self.config.span_ms.max(1)));
            self.at(t, Event::Publish(j % requesters, j));
        }
        // Bounded: every event is processed once, and the number of events is bounded by
        // the offers' deadlines (no job schedules anything after its deadline).
        let limit = 200_000_000u64;
        let mut steps = 0u64;
        while let Some(Reverse((t, seq))) = self.queue.pop() {
            steps += 1;
            if steps > limit {
                return Err(self.violation("the simulation did not settle".into()));
            }
            if self.queue.len() > OVERLOAD_EVENTS {
                // The nodes cannot keep up: the queues only grow. What is still waiting is
                // dropped; every job ends at its deadline, unplaced if it was not yet.
                self.report.overloaded = true;
                self.queue.clear();
                self.events.clear();
                break;
            }
            self.now = t;
            let Some(e) = self.events.remove(&seq) else {
                continue;
            };
            self.step(e)?;
        }
        self.finish()
    }

    fn finish(mut self) -> Result<SimReport, Violation> {
        let end = self.now;
        let mut r = std::mem::take(&mut self.report);
        r.nodes = self.config.nodes;
        r.offers = self.jobs.len();
        r.virtual_ms = end / 1000 - T0_MS;
        let mut bids = Vec::new();
        let mut placement_ms = Vec::new();
        let mut on_time = 0usize;
        for (&job_id, &(req, submitted)) in &self.jobs {
            let node = &mut self.nodes[req].node;
            let deadline = node
                .market
                .job(&job_id)
                .map(|j| j.offer().deadline)
                .unwrap_or_default();
            node.market
                .handle(Timestamp((end / 1000).max(deadline.0) + 1), Input::Tick);
            node.drain(Timestamp((end / 1000).max(deadline.0) + 1));
            let Some(job) = node.market.job(&job_id) else {
                return Err(Violation {
                    at: end / 1000 - T0_MS,
                    what: format!("job {job_id} is gone"),
                });
            };
            match job.state() {
                JobState::Completed => r.completed += 1,
                JobState::Failed => r.failed += 1,
                JobState::Cancelled => r.cancelled += 1,
                JobState::Open => {
                    return Err(Violation {
                        at: end / 1000 - T0_MS,
                        what: format!("job {job_id} still open after its deadline"),
                    });
                }
            }
            let spent: u64 = job.tasks().iter().map(|t| t.spent().0).sum();
            let committed: u64 = job.tasks().iter().map(|t| t.committed().0).sum();
            let refund = job.refund().map_err(|e| Violation {
                at: end / 1000 - T0_MS,
                what: format!("job {job_id}: {e}"),
            })?;
            if committed != 0 || spent + refund.0 != job.offer().budget.0 {
                return Err(Violation {
                    at: end / 1000 - T0_MS,
                    what: format!(
                        "job {job_id}: spent {spent} + refund {refund} != budget {}, {committed} committed",
                        job.offer().budget
                    ),
                });
            }
            r.budget += job.offer().budget.0;
            r.spent += spent;
            r.refunded += refund.0;
            bids.push(job.tasks()[0].bid_count() as f64);
            if let Some(&placed) = self.placed.get(&job_id) {
                placement_ms.push((placed - submitted) as f64 / 1000.0);
                if placed / 1000 <= deadline.0 {
                    on_time += 1;
                }
            }
        }
        r.placed_share = on_time as f64 / self.jobs.len().max(1) as f64;
        r.bids_per_offer = spread(bids);
        r.placement_ms = spread(placement_ms);
        r.price_samples = self.price_ratios.len();
        r.offer_shards = self.config.offer_shards;
        r.offer_reach = self.offer_reach();
        r.offer_cpu = self.offer_load();
        r.price_ratio = spread(std::mem::take(&mut self.price_ratios));
        let span = (end - us(T0_MS)).max(1) as f64;
        r.busiest_cpu = self
            .nodes
            .iter()
            .map(|n| n.busy_us / span + self.offer_load())
            .fold(0.0, f64::max);
        Ok(r)
    }
}

/// Runs the simulation.
pub fn run(config: SimConfig) -> Result<SimReport, Violation> {
    Sim::new(config).run_all()
}

impl SimConfig {
    /// The capacity workload: `rate` offers a second for `duration_s` seconds of virtual
    /// time on `nodes` nodes (one in fifty publishes, at most 200: each holds every ad),
    /// no losses or crashes, CPU charged with `costs`.
    pub fn capacity(nodes: usize, rate: f64, duration_s: u64, costs: Costs, seed: u64) -> Self {
        let shards = default_shards(nodes);
        Self {
            nodes,
            offers: (rate * duration_s as f64).round().max(1.0) as usize,
            requesters: (nodes / 50).clamp(1, 200),
            seed,
            span_ms: duration_s.max(1) * 1000,
            max_delay_ms: 50,
            drop_pct: 0,
            dup_pct: 0,
            crash_pct: 0,
            workload: Workload::Capacity,
            costs,
            full_delivery: false,
            price_sample: 0,
            offer_shards: shards,
        }
    }
}

/// The offer shards a network of `nodes` would use: the largest power of two at most
/// `nodes / 500` (at least 1), so each shard holds 500 to 1,000 workers.
pub fn default_shards(nodes: usize) -> u32 {
    let want = (nodes / 500).max(1) as u32;
    (1u32 << (31 - want.leading_zeros())).min(draw::MAX_SHARDS)
}

/// One rate tried by [`find_capacity`].
#[derive(Clone, Debug, Serialize)]
pub struct CapacityStep {
    /// Offers per second of virtual time.
    pub rate: f64,
    /// Share placed before the deadline.
    pub placed_share: f64,
    /// The run.
    pub report: SimReport,
    /// Wall time of the run, ms.
    pub wall_ms: u64,
}

/// Share of offers that must be placed before their deadline for a rate to count as
/// sustained.
pub const SUSTAINED: f64 = 0.95;

/// The highest rate (offers a second) that `nodes` nodes sustain: doubles from 500 until a
/// rate fails (or 64,000 passes), then halves the gap four times. Every run is reported.
/// A run publishes for `duration_s` seconds of virtual time, or less at high rates (at
/// most 60,000 offers, at least 4 s).
pub fn find_capacity(
    nodes: usize,
    duration_s: u64,
    costs: &Costs,
    adjust: &dyn Fn(&mut SimConfig),
    seed: u64,
    mut progress: impl FnMut(&CapacityStep),
) -> Result<Vec<CapacityStep>, Violation> {
    let mut steps = Vec::new();
    let mut try_rate = |rate: f64, steps: &mut Vec<CapacityStep>| -> Result<bool, Violation> {
        let started = std::time::Instant::now();
        // At most 60,000 offers a run (at least 4 s of virtual time), so a step at a high
        // rate costs no more wall time than one at the goal.
        let duration = duration_s.min((60_000.0 / rate).ceil() as u64).max(4);
        let mut config = SimConfig::capacity(nodes, rate, duration, costs.clone(), seed);
        adjust(&mut config);
        config.price_sample = (config.offers / 100).max(1);
        let report = run(config)?;
        let step = CapacityStep {
            rate,
            placed_share: report.placed_share,
            wall_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            report,
        };
        progress(&step);
        let ok = step.placed_share >= SUSTAINED;
        steps.push(step);
        Ok(ok)
    };
    let (mut good, mut bad) = (0.0f64, None);
    let mut rate = 500.0;
    while rate <= 64_000.0 {
        if try_rate(rate, &mut steps)? {
            good = rate;
            rate *= 2.0;
        } else {
            bad = Some(rate);
            break;
        }
    }
    if let Some(mut bad) = bad {
        for _ in 0..4 {
            let mid = ((good + bad) / 2.0).round();
            if try_rate(mid, &mut steps)? {
                good = mid;
            } else {
                bad = mid;
            }
        }
    }
    Ok(steps)
}

/// The highest rate of a [`find_capacity`] search that was sustained.
pub fn sustained(steps: &[CapacityStep]) -> Option<&CapacityStep> {
    steps
        .iter()
        .filter(|s| s.placed_share >= SUSTAINED)
        .max_by(|a, b| a.rate.total_cmp(&b.rate))
}

/// Placement figures: one offer against many ads.
#[derive(Clone, Debug, Serialize)]
pub struct PlacementFigures {
    /// Ads matched against.
    pub ads: usize,
    /// Ads that qualified (and bid).
    pub qualified: usize,
    /// Median time to match the task against every ad and explain the outcome, µs.
    pub match_us: u64,
    /// Median time to place the task (a group of 4) on the qualified bids, µs.
    pub place_us: u64,
    /// Repetitions.
    pub reps: usize,
}

/// Measures matching and placement of one group task of 4 against `ads` simulated ads.
pub fn placement_figures(ads: usize, reps: usize) -> PlacementFigures {
    use std::time::Instant;
    let mut rng = Rng(7);
    let now = Timestamp(T0_MS);
    let ads: Vec<CapabilityAd> = (0..ads)
        .map(|i| {
            testkit::ad(
                testkit::keys(i as u64 + 1).address(),
                &machine(&mut rng),
                now,
            )
        })
        .collect();
    let task = testkit::task("t", 4, 1, 24, 4, 4_000_000);
    let offer = testkit::offer(
        testkit::keys(0).address(),
        1,
        vec![task.clone()],
        now,
        10_000,
        3_600_000,
    );
    let offer_id = message_id(&offer);
    let ctx = cannabis_market::matching::Context {
        now,
        ..cannabis_market::matching::Context::default()
    };
    let candidates: Vec<Candidate> = ads
        .iter()
        .filter_map(|ad| {
            match quote::answer(
                &WorkerPolicy::default(),
                Some(&testkit::fee_terms()),
                ad,
                &offer,
                offer_id,
                0,
                &ctx,
            )? {
                quote::Answer::Bid(bid) => Some(Candidate {
                    id: message_id(&bid),
                    class: Class::of(&task, ad),
                    bid,
                    strikes: 0,
                }),
                _ => None,
            }
        })
        .collect();
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    let reps = reps.max(1);
    let mut match_us = Vec::with_capacity(reps);
    let mut place_us = Vec::with_capacity(reps);
    let mut qualified = 0;
    for _ in 0..reps {
        let t = Instant::now();
        let e = cannabis_market::matching::explain(&task, &ads, &ctx);
        match_us.push(t.elapsed().as_micros() as u64);
        qualified = e.qualified.len();
        let t = Instant::now();
        let placed = placement::place(
            &task,
            &candidates,
            &std::collections::BTreeSet::new(),
            task.budget,
            now,
        );
        place_us.push(t.elapsed().as_micros() as u64);
        std::hint::black_box(placed.ok());
    }
    PlacementFigures {
        ads: ads.len(),
        qualified,
        match_us: median(match_us),
        place_us: median(place_us),
        reps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_hundred_nodes_and_two_hundred_offers_keep_the_invariants() {
        let report = run(SimConfig::default()).unwrap();
        assert_eq!(report.nodes, 500);
        assert_eq!(report.offers, 200);
        assert_eq!(report.completed + report.failed + report.cancelled, 200);
        // The run exercised what it claims to: placements, crashes and retries, stale
        // epochs refused, busy workers, calls for bids again, lost messages. (Tasks whose
        // bids ran out used to fail here, 12 of 200 with this seed; called for again, they
        // are placed.)
        assert!(report.completed > 190, "{report:?}");
        assert!(report.stale_refused > 0, "{report:?}");
        assert!(report.busy_refused > 0, "{report:?}");
        assert!(report.widened > 0, "{report:?}");
        assert!(report.retries > 0, "{report:?}");
        assert!(report.dropped > 0, "{report:?}");
        assert!(report.declines > 0, "{report:?}");
        assert_eq!(report.spent + report.refunded, report.budget);
        // Bids per offer stay near the call's target, not near the number of workers.
        assert!(report.bids_per_offer.p99 <= 64.0, "{report:?}");
    }

    #[test]
    fn networks_get_a_shard_per_five_hundred_to_a_thousand_nodes() {
        assert_eq!(default_shards(10), 1);
        assert_eq!(default_shards(999), 1);
        assert_eq!(default_shards(1_000), 2);
        assert_eq!(default_shards(10_000), 16);
        assert_eq!(default_shards(100_000), 128);
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let small = SimConfig {
            nodes: 60,
            offers: 30,
            requesters: 5,
            ..SimConfig::default()
        };
        let a = run(small.clone()).unwrap();
        let b = run(small.clone()).unwrap();
        assert_eq!(a, b);
        let c = run(SimConfig { seed: 2, ..small }).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn only_workers_a_call_can_draw_answer_it() {
        // Every offer goes to every node; the run fails if a worker outside the shortcut's
        // set of candidates bids or declines.
        let full = run(SimConfig {
            nodes: 200,
            offers: 80,
            requesters: 8,
            full_delivery: true,
            price_sample: 0,
            ..SimConfig::default()
        })
        .unwrap();
        assert!(full.bids > 0 && full.completed > 0, "{full:?}");
    }
}
