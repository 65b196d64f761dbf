//! `cannabis demo`: one job through the whole protocol, in-process, with every message
//! signed, sent as wire bytes, decoded and verified by its receiver, and the money split
//! checked for every outcome. Nothing here is simulated output: each line is the result of
//! the real protocol code.

use std::time::Instant;

use anyhow::{Context as _, ensure};
use cannabis_protocol::{
    AdapterKind, Amount, Award, Bid, Block, CapabilityAd, ComputeResult, Digest, EscrowLock,
    FeeTerms, Hardware, JobOffer, Keypair, LeaseAccept, Message, NetworkLimits, OsInfo, Outcome,
    PriceSheet, Quote, Requirements, Resources, Signed, Split, TaskSpec, Timestamp, Transaction,
    TxPayload, Uuid, Verified, Workload, merkle, synthetic::SyntheticTask,
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

    // 2. The worker advertises.
    let worker_delivery = cannabis_protocol::DeliveryIdentity::from_secret(*random_bytes::<32>()?);
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
            memory_bytes: 0,
            swap_bytes: 0,
            storage_bytes: 0,
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
        prices: PriceSheet::default(),
        attestation: None,
        challenges: Vec::new(),
    };
    let (ad, ad_len) = transmit(&worker, &ad)?;
    step(
        2,
        "capability ad",
        format!(
            "{ad_len} bytes, signature verified, {} cores, adapter synthetic",
            ad.body.hardware.cpu_cores
        ),
    )?;

    // 3. The requester offers a budgeted synthetic task.
    let budget = Amount(1_000_000);
    let quote = Quote::for_budget(budget, cannabis_protocol::FOUNDER_FEE_BPS)?;
    let requester_delivery =
        cannabis_protocol::DeliveryIdentity::from_secret(*random_bytes::<32>()?);
    let offer = JobOffer {
        job_id: Uuid::from_random(*random_bytes::<16>()?),
        requester: requester.address(),
        seq: 1,
        issued_at: now,
        expires_at: now.plus_ms(60_000),
        deadline: now.plus_ms(3_600_000),
        delivery: requester_delivery.recipient(),
        budget,
        fee: FeeTerms::founder(founder.address()),
        review_window_ms: 86_400_000,
        acceptance: Vec::new(),
        tasks: vec![TaskSpec {
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
        }],
        calls: vec![cannabis_protocol::BidCall::EVERYONE],
    };
    let (offer, offer_len) = transmit(&requester, &offer)?;
    step(
        3,
        "job offer",
        format!(
            "{offer_len} bytes; budget {} = worker share {} + fee {} ({})",
            quote.total,
            quote.worker_share,
            quote.fee,
            super::job::percent(quote.fee_rate_bps)
        ),
    )?;

    // 4. The worker bids.
    let price = Amount(800_000);
    let bid = Bid {
        job_id: offer.body.job_id,
        task: 0,
        offer: offer.id,
        worker: worker.address(),
        price,
        earliest_start: now,
        issued_at: now,
        valid_until: now.plus_ms(60_000),
    };
    let (bid, bid_len) = transmit(&worker, &bid)?;
    step(
        4,
        "bid",
        format!("{bid_len} bytes; price {price}, signature verified"),
    )?;

    // A tampered copy of the bid is refused.
    let mut forged = Signed::sign(&worker, &bid.body).to_bytes();
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

    // 5. Award and countersigned lease.
    let award = Award {
        job_id: offer.body.job_id,
        task: 0,
        rank: 0,
        requester: requester.address(),
        worker: worker.address(),
        epoch: 1,
        bid: bid.id,
        price,
        issued_at: now,
        expires_at: now.plus_ms(30_000),
        renew_every_ms: 10_000,
        rendezvous: None,
        inputs: Vec::new(),
    };
    let (award, _) = transmit(&requester, &award)?;
    let accept = LeaseAccept {
        award: award.id,
        job_id: award.body.job_id,
        task: 0,
        rank: 0,
        worker: worker.address(),
        epoch: award.body.epoch,
        issued_at: now,
    };
    let (accept, _) = transmit(&worker, &accept)?;
    ensure!(
        accept.body.award == award.id,
        "lease accept names another award"
    );
    step(
        5,
        "lease",
        format!("epoch {} granted and countersigned", accept.body.epoch),
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
