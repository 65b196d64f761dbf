//! `cannabis demo`: one job through the whole protocol, in-process, with every message
//! signed, sent as wire bytes, decoded and verified by its receiver, and the money split
//! checked for every outcome. The market part is two `Market` engines (the one every node
//! and the simulator run), a requester's and a worker's, talking over that wire. Nothing
//! here is simulated output: each line is the result of the real protocol code.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, ensure};
use cannabis_market::job::Early;
use cannabis_market::testkit::net::{Envelope, Node};
use cannabis_market::{
    Command as MarketCommand, CommandOk, Identity, Inbound, MarketConfig, MarketEvent,
    OfferTemplate,
};
use cannabis_protocol::{
    AdapterKind, Amount, Award, Bid, Block, CapabilityAd, ComputeResult, Digest, EscrowLock,
    Hardware, JobOffer, Keypair, LeaseAccept, Message, NetworkLimits, OsInfo, Outcome, PriceSheet,
    Quote, Received, Requirements, Resources, Signed, Split, TaskSpec, Timestamp, Transaction,
    TxPayload, Verified, Workload, merkle, synthetic::SyntheticTask,
};
use serde::Serialize;

use crate::cli::DemoArgs;
use crate::output::{self, out};
use cannabis_node::keystore::random_bytes;

#[derive(Serialize)]
struct Summary {
    requester: String,
    worker: String,
    sequencer: String,
    job_id: String,
    budget: Amount,
    price: Amount,
    quote: Quote,
    synthetic_size: u32,
    result_hash: String,
    block_hash: String,
    compute_root: String,
    settlements: Vec<SettlementRow>,
}

#[derive(Serialize)]
struct SettlementRow {
    outcome: String,
    #[serde(flatten)]
    split: Split,
}

/// Sends `body` as its signer would, and receives it as its peer would: wire bytes in,
/// verified message out.
fn transmit<T: Message>(signer: &Keypair, body: &T) -> anyhow::Result<(Verified<T>, usize)> {
    let wire = Signed::sign(signer, body).to_bytes();
    let verified = Signed::<T>::from_bytes(&wire)
        .map(|s| s.verify())
        .with_context(|| format!("decoding the {}", T::KIND))?
        .with_context(|| format!("verifying the {}", T::KIND))?;
    Ok((verified, wire.len()))
}

/// The wire between the two engines: what is in flight, what crossed (kind and bytes),
/// and the messages the later steps name.
#[derive(Default)]
struct Wire {
    queue: VecDeque<Envelope>,
    crossed: Vec<(&'static str, usize)>,
    offer: Option<Received<JobOffer>>,
    bid: Option<Received<Bid>>,
    award: Option<Received<Award>>,
    accept: Option<Received<LeaseAccept>>,
}

/// Encodes a signed message as its sender would and decodes it as its receiver would.
fn over_the_wire<T: Message>(item: &Received<T>) -> anyhow::Result<(Received<T>, usize)> {
    let bytes = item.signed().to_bytes();
    let received = Signed::<T>::from_bytes(&bytes)
        .with_context(|| format!("decoding the {}", T::KIND))?
        .open()
        .with_context(|| format!("opening the {}", T::KIND))?;
    received
        .check_signature()
        .with_context(|| format!("verifying the {}", T::KIND))?;
    Ok((received, bytes.len()))
}

impl Wire {
    /// Delivers everything in flight, and what it causes, to the other engine.
    fn run(
        &mut self,
        requester: &mut Node,
        worker: &mut Node,
        now: Timestamp,
    ) -> anyhow::Result<()> {
        // Bounded: one job between two nodes is a handful of messages.
        for _ in 0..64 {
            let Some(envelope) = self.queue.pop_front() else {
                return Ok(());
            };
            let envelope = self.carry(envelope)?;
            let receiver = if envelope.from() == requester.address() {
                &mut *worker
            } else {
                &mut *requester
            };
            receiver.deliver(now, envelope);
            let out = receiver.drain(now);
            self.queue.extend(out);
        }
        anyhow::bail!("the engines kept talking past 64 messages")
    }

    /// Carries one envelope as bytes, noting what crossed.
    fn carry(&mut self, envelope: Envelope) -> anyhow::Result<Envelope> {
        Ok(match envelope {
            Envelope::Ad { from, item } => {
                let (item, n) = over_the_wire(&item)?;
                self.crossed.push(("capability ad", n));
                Envelope::Ad {
                    from,
                    item: Arc::new(item),
                }
            }
            Envelope::Offer { from, item } => {
                let (item, n) = over_the_wire(&item)?;
                self.crossed.push(("job offer", n));
                self.offer = Some(item.clone());
                Envelope::Offer {
                    from,
                    item: Arc::new(item),
                }
            }
            Envelope::Request { from, to, req, msg } => {
                let msg = match *msg {
                    Inbound::Bid(m) => {
                        let (m, n) = over_the_wire(&m)?;
                        self.crossed.push(("bid", n));
                        self.bid = Some(m.clone());
                        Inbound::Bid(m)
                    }
                    Inbound::Award(m) => {
                        let (m, n) = over_the_wire(&m)?;
                        self.crossed.push(("award", n));
                        self.award = Some(m.clone());
                        Inbound::Award(m)
                    }
                    Inbound::Accept(m) => {
                        let (m, n) = over_the_wire(&m)?;
                        self.crossed.push(("lease accept", n));
                        self.accept = Some(m.clone());
                        Inbound::Accept(m)
                    }
                    other => other,
                };
                Envelope::Request {
                    from,
                    to,
                    req,
                    msg: Box::new(msg),
                }
            }
            response @ Envelope::Response { .. } => response,
        })
    }

    /// The size of the last message of `kind` that crossed.
    fn bytes(&self, kind: &str) -> anyhow::Result<usize> {
        self.crossed
            .iter()
            .rev()
            .find(|(k, _)| *k == kind)
            .map(|(_, n)| *n)
            .with_context(|| format!("no {kind} crossed the wire"))
    }
}

fn key() -> anyhow::Result<Keypair> {
    Ok(Keypair::from_secret(*random_bytes::<32>()?))
}

pub(super) fn run(args: &DemoArgs) -> anyhow::Result<()> {
    let human = !args.format.json;
    let step = |n: u32, what: &str, detail: String| -> std::io::Result<()> {
        if !human {
            return Ok(());
        }
        let n = if what.is_empty() {
            "   ".to_string()
        } else {
            format!("{n:>2}.")
        };
        out!("{n} {what:<16} {detail}")
    };
    if human {
        out!("One job through the cannabis protocol, in-process.\n")?;
    }
    let now = Timestamp(super::now_ms());
    let requester = key()?;
    let worker = key()?;
    let sequencer = key()?;
    let founder = key()?;
    step(
        1,
        "identities",
        format!("requester {}", requester.address()),
    )?;
    step(1, "", format!("worker    {}", worker.address()))?;
    step(1, "", format!("sequencer {}", sequencer.address()))?;

    // 2-5. The market: the requester's and the worker's engines (the `Market` every node
    // runs), with every message they send signed, carried as wire bytes, decoded and
    // checked by the other.
    let market_config = MarketConfig {
        fee: Some(cannabis_protocol::FeeTerms::founder(founder.address())),
        ..MarketConfig::default()
    };
    let mut requester_node = Node::new(
        market_config.clone(),
        Identity {
            address: requester.address(),
            delivery: cannabis_protocol::DeliveryIdentity::from_secret(*random_bytes::<32>()?)
                .recipient(),
        },
        Some(requester.clone()),
        now,
    );
    let worker_delivery = cannabis_protocol::DeliveryIdentity::from_secret(*random_bytes::<32>()?);
    let mut worker_node = Node::new(
        market_config,
        Identity {
            address: worker.address(),
            delivery: worker_delivery.recipient(),
        },
        Some(worker.clone()),
        now,
    );

    // 2. The worker advertises: one core, priced 800,000 a core-hour.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let ad = CapabilityAd {
        node: worker.address(),
        seq: 1,
        issued_at: now,
        expires_at: now.plus_ms(10 * 60_000),
        delivery: worker_delivery.recipient(),
        hardware: Hardware {
            cpu_model: String::new(),
            cpu_cores: cores,
            memory_bytes: 1 << 30,
            swap_bytes: 0,
            storage_bytes: 1 << 30,
            gpus: Vec::new(),
        },
        os: OsInfo {
            name: std::env::consts::OS.into(),
            kernel: String::new(),
        },
        runtimes: Vec::new(),
        adapters: vec![AdapterKind::Synthetic],
        collectives: Vec::new(),
        isolation: Vec::new(),
        network: NetworkLimits::default(),
        prices: PriceSheet {
            cpu_core_hour: Amount(800_000),
            ..PriceSheet::default()
        },
        attestation: None,
        challenges: Vec::new(),
    };
    let mut wire = Wire::default();
    let published = worker_node
        .publish_ad(now, ad)
        .context("the worker's engine did not keep its own ad")?;
    wire.queue.push_back(published);
    wire.run(&mut requester_node, &mut worker_node, now)?;
    let ad_len = wire.bytes("capability ad")?;
    step(
        2,
        "capability ad",
        format!("{ad_len} bytes, signature verified, {cores} cores, adapter synthetic"),
    )?;

    // 3. The requester submits a budgeted synthetic task; its engine publishes the offer,
    // placed as soon as one valid bid is in.
    let budget = Amount(1_000_000);
    let quote = Quote::for_budget(budget, cannabis_protocol::FOUNDER_FEE_BPS)?;
    let template = OfferTemplate {
        name: Some("demo".into()),
        nonce: None,
        tasks: vec![TaskSpec {
            restarts: 0,
            name: "proof-of-compute".into(),
            workload: Workload {
                adapter: AdapterKind::Synthetic,
                digest: Digest::of(b"cannabis/synthetic/v1"),
                entrypoint: vec![args.size.to_string()],
            },
            inputs: Vec::new(),
            outputs: Vec::new(),
            resources: Resources {
                cpu_millicores: 1000,
                ..Resources::default()
            },
            requirements: Requirements::default(),
            group_size: 1,
            depends_on: Vec::new(),
            budget,
            checkpoint: None,
        }],
        ttl_ms: 60_000,
        deadline_ms: 3_600_000,
        review_window_ms: 86_400_000,
        acceptance: Vec::new(),
        evaluation: None,
        early: Some(Early::FirstBids(1)),
        spot_check_ppm: 0,
    };
    let submitted = requester_node
        .market
        .command(
            now,
            MarketCommand::Submit {
                template,
                nonce: *random_bytes::<16>()?,
            },
        )
        .map_err(|e| anyhow::anyhow!("the requester's engine refused the job: {e}"))?;
    let CommandOk::Submitted { job: job_id, .. } = submitted else {
        anyhow::bail!("the requester's engine answered {submitted:?} to a submission");
    };
    wire.queue.extend(requester_node.drain(now));
    wire.run(&mut requester_node, &mut worker_node, now)?;
    let offer = wire.offer.clone().context("no offer was published")?;
    step(
        3,
        "job offer",
        format!(
            "{} bytes; budget {} = worker share {} + fee {} ({})",
            wire.bytes("job offer")?,
            quote.total,
            quote.worker_share,
            quote.fee,
            super::job::percent(quote.fee_rate_bps)
        ),
    )?;

    // 4. The worker's engine quoted and bid; the requester's took the bid.
    let bid = wire.bid.clone().context("the worker did not bid")?;
    let price = bid.body.price;
    step(
        4,
        "bid",
        format!(
            "{} bytes; price {price} (800,000 a core-hour, one core, one hour), signature verified",
            wire.bytes("bid")?
        ),
    )?;
    // A tampered copy of the bid is refused.
    let mut forged = bid.signed().to_bytes();
    let last = forged.len() - 1;
    forged[last] ^= 1;
    let refusal = match Signed::<Bid>::from_bytes(&forged).map(|s| s.verify()) {
        Ok(Ok(_)) => anyhow::bail!("a tampered bid verified"),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    step(
        4,
        "",
        format!("a copy with one flipped bit is refused: {refusal}"),
    )?;

    // 5. Placed at once (the first valid bid was enough): award and countersigned lease.
    let award = wire.award.clone().context("the requester did not award")?;
    let accept = wire
        .accept
        .clone()
        .context("the worker did not countersign")?;
    ensure!(
        accept.body.award == award.id,
        "lease accept names another award"
    );
    let leased = requester_node
        .events
        .iter()
        .any(|e| matches!(e, MarketEvent::TaskLeased { job, .. } if *job == job_id));
    ensure!(leased, "the requester's engine did not record the lease");
    step(
        5,
        "lease",
        format!(
            "epoch {} awarded ({} bytes) and countersigned ({} bytes), before the bid window ends",
            award.body.epoch,
            wire.bytes("award")?,
            wire.bytes("lease accept")?
        ),
    )?;
    // 6. The escrow lock and the genesis block the synthetic seed derives from.
    let lock = Transaction::new(
        requester.address(),
        None,
        budget,
        0,
        1000,
        TxPayload::EscrowLock(EscrowLock {
            job_id: offer.body.job_id,
            offer: offer.id,
            amount: budget,
            fee: offer.body.fee.clone(),
            deadline: offer.body.deadline,
            review_window_ms: offer.body.review_window_ms,
            resolver: sequencer.address(),
            ranks: 1,
        }),
    )?;
    let genesis = Block::build(
        &sequencer,
        0,
        Digest([0; 32]),
        now,
        vec![(Signed::sign(&requester, &lock), lock)],
    )?;
    genesis.verify()?;
    step(
        6,
        "escrow lock",
        format!("budget {budget} locked in block 0 ({})", genesis.hash()),
    )?;

    // 7. The worker computes the seeded task.
    let task = SyntheticTask::for_block(&genesis.hash(), &worker.address(), args.size)?;
    let started = Instant::now();
    let result_hash = task.run();
    let took = started.elapsed();
    step(
        7,
        "compute",
        format!(
            "synthetic {n}x{n} int8 matrix product in {:.1} ms, result hash {}",
            took.as_secs_f64() * 1e3,
            result_hash.to_0x(),
            n = args.size
        ),
    )?;

    // 8. SUBMIT_RESULT goes into block 1; anyone can check it.
    let result = ComputeResult::signed(&worker, offer.body.job_id, result_hash, None, Some(1));
    let submit = Transaction::submit_result(result.clone(), 0, 1000)?;
    let (submit_v, _) = transmit(&worker, &submit)?;
    let block = Block::build(
        &sequencer,
        1,
        genesis.hash(),
        now,
        vec![(Signed::sign(&worker, &submit), submit_v.body)],
    )?;
    let block: Block = cannabis_protocol::decode(&cannabis_protocol::encode(&block))?;
    let (header, _) = block.verify()?;
    let proof = merkle::prove(&[result.id().0], 0).context("proof for the only leaf")?;
    Block::proves_compute_result(&header.body, &result.id(), &proof)?;
    ensure!(
        SyntheticTask::for_block(&genesis.hash(), &result.worker_address, args.size)?.run()
            == result.result_hash,
        "recomputing the synthetic task gave another hash"
    );
    step(
        8,
        "submit result",
        format!(
            "SUBMIT_RESULT (gas {}) in block 1, compute_root {}",
            cannabis_protocol::SUBMIT_RESULT_GAS_LIMIT,
            header.body.compute_root
        ),
    )?;
    step(
        8,
        "",
        "inclusion proof verified; recomputed result hash matches".into(),
    )?;

    // 9. Settlement for every outcome.
    let outcomes = [
        ("accepted", Outcome::Accepted),
        ("review window elapsed", Outcome::ReviewWindowElapsed),
        (
            "partially accepted 50%",
            Outcome::PartiallyAccepted {
                accepted_ppm: 500_000,
            },
        ),
        ("rejected", Outcome::Rejected),
        ("cancelled", Outcome::Cancelled),
        ("expired", Outcome::Expired),
        (
            "dispute resolved 300000",
            Outcome::DisputeResolved {
                award: Amount(300_000),
            },
        ),
    ];
    let mut settlements = Vec::new();
    for (name, outcome) in outcomes {
        let split = Split::settle(budget, price, outcome, offer.body.fee.rate_bps)?;
        ensure!(split.balances(), "{name} does not balance");
        step(
            9,
            if settlements.is_empty() {
                "settlement"
            } else {
                ""
            },
            format!(
                "{name:<24} worker {:>7} + fee {:>5} + refund {:>7} = locked {}",
                split.worker_paid, split.fee_paid, split.refunded, split.locked
            ),
        )?;
        settlements.push(SettlementRow {
            outcome: name.into(),
            split,
        });
    }
    if human {
        out!("\nEvery path balances: worker + fee + refund == locked.")?;
        return Ok(());
    }
    output::json(&Summary {
        requester: requester.address().to_string(),
        worker: worker.address().to_string(),
        sequencer: sequencer.address().to_string(),
        job_id: offer.body.job_id.to_string(),
        budget,
        price,
        quote,
        synthetic_size: args.size,
        result_hash: result_hash.to_0x(),
        block_hash: block.hash().to_string(),
        compute_root: header.body.compute_root.to_string(),
        settlements,
    })
}
