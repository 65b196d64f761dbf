//! `cannabis ledger`: the embedded ledger's figures.
//!
//! `bench` measures what a sequencer sustains: signed transfers from many accounts are
//! checked (signatures on every core), ordered into blocks by [`Ledger::propose`], sealed,
//! applied, and each block is committed durably to a redb file (one fsync per block) before
//! the next starts. Apart, it times computing and checking `compute_root` over 100,000
//! proof-of-compute results against one SHA-256 pass over the same bytes.

use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;
use cannabis_market::ledger::Ledger;
use cannabis_protocol::{
    Allocation, Amount, Block, ComputeResult, Digest, FeeTerms, Genesis, Keypair, Rewards, Signed,
    Timestamp, Transaction, TxPayload, Uuid, Verified, merkle,
};
use redb::{Database, TableDefinition};
use serde::Serialize;
use sha2::Digest as _;

use crate::cli::{LedgerCommand, WalletCommand};
use crate::output::{self, out};

const BLOCKS: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("blocks");

/// What the bench found.
#[derive(Debug, Serialize)]
pub(crate) struct LedgerBench {
    /// Transactions committed.
    pub txs: usize,
    /// Blocks they took.
    pub blocks: u64,
    /// Wall time from the first signature check to the last block's commit.
    pub ms: f64,
    /// Transactions committed durably per second.
    pub tx_per_s: f64,
    /// Of which: checking signatures (both cores), proposing and applying, committing.
    pub verify_ms: f64,
    pub apply_ms: f64,
    pub commit_ms: f64,
    /// Compute results in the `compute_root` figure.
    pub results: usize,
    /// Bytes of their encodings.
    pub result_bytes: usize,
    /// Computing the results' ids and their root, and checking it, from the results.
    pub compute_root_ms: f64,
    /// Re-encoding the results canonically (their ids are over these bytes).
    pub encode_ms: f64,
    /// One SHA-256 over the same bytes.
    pub sha256_ms: f64,
    /// `sha256_ms / compute_root_ms`.
    pub ratio: f64,
}

fn key(i: u64) -> Keypair {
    let mut s = [0x1e_u8; 32];
    s[..8].copy_from_slice(&i.to_le_bytes());
    Keypair::from_secret(s)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Runs the bench in `dir` (emptied first).
pub(crate) fn bench(
    dir: &Path,
    txs: usize,
    accounts: usize,
    block_txs: u32,
    results: usize,
) -> anyhow::Result<LedgerBench> {
    anyhow::ensure!(
        accounts >= 1 && block_txs >= 1,
        "--accounts and --block-txs must be at least 1"
    );
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let now = Timestamp(crate::cmd::now_ms());
    let sequencer = key(u64::MAX);
    let senders: Vec<Keypair> = (0..accounts as u64).map(key).collect();
    let each = Amount(1_000_000_000);
    let genesis = Genesis {
        network: "ledger-bench".into(),
        time: now,
        sequencer: sequencer.address(),
        fee: FeeTerms::founder(key(u64::MAX - 1).address()),
        resolver: key(u64::MAX - 2).address(),
        min_gas_price: 1,
        supply: Amount(each.0 * accounts as u64 + 1_000),
        accounts: senders
            .iter()
            .map(|k| Allocation {
                address: k.address(),
                amount: each,
            })
            .collect(),
        vesting: Vec::new(),
        faucet: None,
        rewards: Rewards {
            pool: Amount(1_000),
            per_block: Amount(10),
            seed_window: 16,
        },
        block_interval_ms: 100,
        max_block_txs: block_txs,
    };
    let mut ledger = Ledger::new(genesis)?;

    // Signed ahead (the wallets' work, not the sequencer's), as wire bytes.
    let wire: Vec<Vec<u8>> = (0..txs)
        .map(|i| {
            let from = &senders[i % accounts];
            let to = senders[(i + 1) % accounts].address();
            let nonce = (i / accounts) as u64;
            let tx = Transaction::new(
                from.address(),
                Some(to),
                Amount(1),
                nonce,
                1,
                TxPayload::Transfer,
            )?;
            Ok(Signed::sign(from, &tx).to_bytes())
        })
        .collect::<anyhow::Result<_>>()?;

    let db = Database::create(dir.join("ledger.redb"))?;
    let (mut verify_ms, mut apply_ms, mut commit_ms) = (0.0, 0.0, 0.0);
    let started = Instant::now();
    let mut blocks = 0u64;
    let mut carry = Vec::new();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for chunk in wire.chunks(block_txs as usize) {
        // What arrived: decoded and checked on every core.
        let t = Instant::now();
        let per = chunk.len().div_ceil(threads);
        let checked: Vec<(Signed<Transaction>, Transaction)> = std::thread::scope(|s| {
            let parts: Vec<_> = chunk
                .chunks(per.max(1))
                .map(|part| {
                    s.spawn(move || {
                        part.iter()
                            .map(|b| {
                                let signed = Signed::<Transaction>::from_bytes(b)?;
                                let body = signed.verify()?.body;
                                Ok((signed, body))
                            })
                            .collect::<anyhow::Result<Vec<_>>>()
                    })
                })
                .collect();
            parts
                .into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| anyhow::anyhow!("a checking thread panicked"))?
                })
                .collect::<anyhow::Result<Vec<Vec<_>>>>()
                .map(|v| v.into_iter().flatten().collect())
        })?;
        verify_ms += ms(t);

        // What did not fit in the last block (the 1 MiB cap) goes first.
        let mut candidates = std::mem::take(&mut carry);
        candidates.extend(checked);
        carry = seal(
            &mut ledger,
            &db,
            candidates,
            &mut blocks,
            &mut apply_ms,
            &mut commit_ms,
        )?;
    }
    while !carry.is_empty() {
        let candidates = std::mem::take(&mut carry);
        carry = seal(
            &mut ledger,
            &db,
            candidates,
            &mut blocks,
            &mut apply_ms,
            &mut commit_ms,
        )?;
    }
    let total_ms = ms(started);
    anyhow::ensure!(
        ledger.total() == u128::from(ledger.genesis().supply.0),
        "money was not conserved"
    );

    // compute_root over `results` results, against one SHA-256 pass over their bytes.
    let workers: Vec<Keypair> = (0..16).map(|i| key(1_000_000 + i)).collect();
    let list: Vec<ComputeResult> = (0..results)
        .map(|i| {
            let w = &workers[i % workers.len()];
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&(i as u64).to_le_bytes());
            ComputeResult::signed(
                w,
                Uuid::from_random(id),
                Digest::of(&id),
                None,
                Some(i as u64),
            )
        })
        .collect();
    // The header's root, as the sequencer made it.
    let header_root = merkle::root(&list.iter().map(|r| r.id().0).collect::<Vec<_>>());
    // The validator's side: the results' canonical bytes (re-encoded from the decoded
    // block: timed apart), their ids, the root over them, compared with the header's.
    let t = Instant::now();
    let encoded: Vec<Vec<u8>> = list.iter().map(cannabis_protocol::encode).collect();
    let encode_ms = ms(t);
    let result_bytes = encoded.iter().map(Vec::len).sum();
    let t = Instant::now();
    let ids: Vec<[u8; 32]> = encoded.iter().map(|b| Digest::of(b).0).collect();
    let checked = merkle::root(&ids) == header_root;
    let compute_root_ms = ms(t);
    anyhow::ensure!(checked, "the root did not check");
    let t = Instant::now();
    let mut raw = sha2::Sha256::new();
    for b in &encoded {
        raw.update(b);
    }
    let sha = raw.finalize();
    let sha256_ms = ms(t);
    anyhow::ensure!(
        sha.as_slice() != header_root.0,
        "unreachable: a root is not a plain hash"
    );

    Ok(LedgerBench {
        txs,
        blocks,
        ms: total_ms,
        tx_per_s: txs as f64 / (total_ms / 1e3),
        verify_ms,
        apply_ms,
        commit_ms,
        results,
        result_bytes,
        encode_ms,
        compute_root_ms,
        sha256_ms,
        ratio: sha256_ms / compute_root_ms,
    })
}

/// One block of the sequencer's: proposed from `candidates`, sealed, applied, committed
/// (one fsync). Returns what waits for the next block.
fn seal(
    ledger: &mut Ledger,
    db: &Database,
    candidates: Vec<(Signed<Transaction>, Transaction)>,
    blocks: &mut u64,
    apply_ms: &mut f64,
    commit_ms: &mut f64,
) -> anyhow::Result<Vec<(Signed<Transaction>, Transaction)>> {
    let t = Instant::now();
    let at = Timestamp(ledger.time().0 + 1);
    let sequencer = key(u64::MAX);
    let p = ledger.propose(at, candidates);
    anyhow::ensure!(
        p.refused.is_empty(),
        "the bench's transactions should all apply: {:?}",
        p.refused.first().map(|(_, e)| e.to_string())
    );
    let block = Block::build(&sequencer, p.header.height, p.header.prev_hash, at, p.txs)?;
    let header = Verified {
        signer: sequencer.address(),
        body: p.header,
        id: block.hash(),
    };
    let bodies: Vec<Transaction> = block
        .txs
        .iter()
        .map(|s| cannabis_protocol::decode::<Transaction>(s.payload()))
        .collect::<Result<_, _>>()?;
    let refs: Vec<&Transaction> = bodies.iter().collect();
    ledger.apply_verified(&header, &refs, at)?;
    *apply_ms += ms(t);

    let t = Instant::now();
    let bytes = cannabis_protocol::encode(&block);
    anyhow::ensure!(
        bytes.len() <= <Block as cannabis_protocol::Wire>::MAX_SIZE,
        "a block of {} bytes is over the wire cap",
        bytes.len()
    );
    let w = db.begin_write()?;
    {
        let mut table = w.open_table(BLOCKS)?;
        table.insert(header.body.height, bytes.as_slice())?;
    }
    w.commit()?;
    *commit_ms += ms(t);
    *blocks += 1;
    Ok(p.waiting)
}

/// Prints the bench's figures.
pub(crate) fn show(b: &LedgerBench, json: bool) -> anyhow::Result<()> {
    if json {
        return output::json(b);
    }
    output::table(&[
        (
            "transactions committed",
            format!("{} in {} blocks, {:.0} ms", b.txs, b.blocks, b.ms),
        ),
        ("durable throughput", format!("{:.0} tx/s", b.tx_per_s)),
        (
            "of which",
            format!(
                "signatures {:.0} ms, propose and apply {:.0} ms, commits {:.0} ms",
                b.verify_ms, b.apply_ms, b.commit_ms
            ),
        ),
        (
            "compute_root",
            format!(
                "{} results ({} bytes): {:.1} ms, SHA-256 of the same bytes {:.1} ms, ratio {:.2} (re-encoding them: {:.1} ms)",
                b.results, b.result_bytes, b.compute_root_ms, b.sha256_ms, b.ratio, b.encode_ms
            ),
        ),
    ])?;
    Ok(())
}

/// `cannabis ledger status|blocks|block`.
pub(crate) fn run(command: LedgerCommand, data_dir: &Path) -> anyhow::Result<()> {
    let client = cannabis_api::ApiClient::from_data_dir(data_dir)?;
    match command {
        LedgerCommand::Status { format } => {
            let s = client.ledger()?;
            if format.json {
                return output::json(&s);
            }
            output::table(&[
                ("network", format!("{} (genesis {})", s.network, s.genesis)),
                ("height", format!("{} (tip {})", s.height, s.tip)),
                (
                    "sequencer",
                    format!(
                        "{}{}",
                        s.sequencer,
                        if s.sequencing { " (this node)" } else { "" }
                    ),
                ),
                ("waiting", s.waiting.to_string()),
                ("supply", s.supply.to_string()),
                (
                    "fee terms",
                    format!(
                        "{} to {}",
                        crate::cmd::job::percent(s.fee_rate_bps),
                        s.fee_recipient
                    ),
                ),
                ("resolver", s.resolver),
                ("faucet", s.faucet.unwrap_or_else(|| "none".into())),
                ("reward pool", s.reward_pool.to_string()),
            ])?;
            Ok(())
        }
        LedgerCommand::Blocks { limit, format } => {
            let blocks = client.blocks(limit)?;
            if format.json {
                return output::json(&blocks);
            }
            out!(
                "{:>8} {:>5} {:>7}  {:<66}",
                "height",
                "txs",
                "results",
                "hash"
            )?;
            for b in &blocks {
                out!(
                    "{:>8} {:>5} {:>7}  {}",
                    b.height,
                    b.txs,
                    b.compute_count,
                    b.hash
                )?;
            }
            Ok(())
        }
        LedgerCommand::Block { height, format } => {
            let b = client.block(height)?;
            if format.json {
                return output::json(&b);
            }
            output::table(&[
                ("height", b.block.height.to_string()),
                ("hash", b.block.hash.clone()),
                ("parent", b.block.prev_hash.clone()),
                ("time (ms)", b.block.time_ms.to_string()),
                (
                    "compute_root",
                    format!(
                        "{} ({} results)",
                        b.block.compute_root, b.block.compute_count
                    ),
                ),
            ])?;
            for t in &b.transactions {
                out!(
                    "  {} {:<14} {} -> {} amount {} fee {} nonce {}",
                    t.id,
                    t.kind,
                    t.from,
                    t.to.as_deref().unwrap_or("-"),
                    t.amount,
                    t.fee,
                    t.nonce
                )?;
            }
            Ok(())
        }
        LedgerCommand::Compute { size, wait, format } => {
            let c = client.compute(size)?;
            let included = wait > 0
                && wait_in_block(
                    &client,
                    &c.submitted.from,
                    c.submitted.nonce,
                    wait,
                    format.json,
                )?;
            if format.json {
                #[derive(Serialize)]
                struct Out<'a> {
                    #[serde(flatten)]
                    computed: &'a cannabis_api::Computed,
                    in_block: bool,
                }
                return output::json(&Out {
                    computed: &c,
                    in_block: included,
                });
            }
            out!(
                "computed the {n} x {n} task of block {} in {} ms: result {} (id {})",
                c.seed_height,
                c.ms,
                c.result_hash,
                c.result_id,
                n = c.n
            )?;
            report(&c.submitted, wait, included, false)
        }
        LedgerCommand::Prove { result, out } => {
            let proof = client.prove(&result)?;
            let text = serde_json::to_string_pretty(&proof)? + "\n";
            match out {
                Some(path) => std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => out!("{}", text.trim_end())?,
            }
            Ok(())
        }
        LedgerCommand::VerifyProof { file } => {
            let text =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let proof: cannabis_api::ResultProof = serde_json::from_slice(&text)
                .with_context(|| format!("{} is not a result proof", file.display()))?;
            let block = client.block(proof.height)?.block;
            anyhow::ensure!(
                block.hash == proof.block_hash,
                "block {} here is {}, not {}: another chain",
                proof.height,
                block.hash,
                proof.block_hash
            );
            let parse = |s: &str| -> anyhow::Result<Digest> {
                s.parse().map_err(|e| anyhow::anyhow!("{s:?}: {e}"))
            };
            let root = parse(&block.compute_root)?;
            let leaf = parse(&proof.result_id)?;
            let inclusion = merkle::InclusionProof {
                index: proof.index,
                tree_size: u64::from(block.compute_count),
                path: proof
                    .path
                    .iter()
                    .map(|p| parse(p))
                    .collect::<anyhow::Result<_>>()?,
            };
            inclusion
                .verify(&leaf.0, &root)
                .map_err(|e| anyhow::anyhow!("the proof does not hold: {e}"))?;
            out!(
                "result {} is leaf {} of {} in the compute_root {} of block {} ({})",
                proof.result_id,
                proof.index,
                block.compute_count,
                block.compute_root,
                proof.height,
                block.hash
            )?;
            Ok(())
        }
        LedgerCommand::Tx { id, format } => {
            let t = client.tx(&id)?;
            if format.json {
                return output::json(&t);
            }
            output::table(&[
                ("transaction", t.tx.id.clone()),
                ("type", t.tx.kind.clone()),
                ("from", format!("{} (nonce {})", t.tx.from, t.tx.nonce)),
                ("to", t.tx.to.clone().unwrap_or_else(|| "-".into())),
                ("amount", t.tx.amount.to_string()),
                ("network fee", t.tx.fee.to_string()),
                (
                    "in block",
                    format!("{} ({}), position {}", t.height, t.block_hash, t.index),
                ),
            ])?;
            Ok(())
        }
        LedgerCommand::Bench { .. } | LedgerCommand::Resolve { .. } => {
            unreachable!("handled by the caller")
        }
    }
}

/// `cannabis ledger resolve`: the resolver's `ESCROW_SETTLE` (`dispute-resolved`) for a
/// disputed assignment, signed with the keys in `data_dir` and submitted through the node
/// at `via`.
pub(crate) fn resolve(command: LedgerCommand, data_dir: &Path) -> anyhow::Result<()> {
    let LedgerCommand::Resolve {
        job,
        task,
        rank,
        award,
        via,
        wait,
        format,
    } = command
    else {
        unreachable!("called for resolve only")
    };
    let keys = cannabis_node::keystore::load(&cannabis_node::keystore::KeyPaths::new(data_dir))
        .with_context(|| format!("the resolver's keys in {}", data_dir.display()))?;
    let me = keys.signing.address();
    let client = cannabis_api::ApiClient::from_data_dir(&via)
        .with_context(|| format!("the node to submit through, at {}", via.display()))?;
    let status = client.ledger()?;
    anyhow::ensure!(
        status.resolver == me.to_string(),
        "{me} is not this network's resolver ({}): run this with the resolver's --data-dir",
        status.resolver
    );
    let escrow = client.escrow(&job)?;
    let a = escrow
        .assignments
        .get(&(task, rank))
        .with_context(|| format!("job {job}'s escrow has no task {task} rank {rank}"))?;
    anyhow::ensure!(
        matches!(a.stage, cannabis_market::ledger::Stage::Disputed { .. }),
        "task {task} rank {rank} of job {job} is not disputed ({:?})",
        a.stage
    );
    anyhow::ensure!(
        award <= a.price,
        "the award {award} is more than the agreed price {}",
        a.price
    );
    let account = client.balance(Some(&me.to_string()))?;
    let gas = status
        .min_gas_price
        .max(1)
        .saturating_mul(cannabis_protocol::TxType::EscrowSettle.gas_limit());
    anyhow::ensure!(
        account.spendable.0 >= gas,
        "the resolver's account {me} has {} spendable, less than the network fee {gas}",
        account.spendable
    );
    let nonce = account.nonce;
    let tx = Transaction::new(
        me,
        None,
        Amount::ZERO,
        nonce,
        status.min_gas_price.max(1),
        TxPayload::EscrowSettle(cannabis_protocol::EscrowSettle {
            job_id: escrow.job_id,
            task,
            rank,
            epoch: a.epoch,
            outcome: cannabis_protocol::Outcome::DisputeResolved { award },
        }),
    )?;
    let signed = Signed::sign(&keys.signing, &tx);
    let submitted = client.submit_tx(&cannabis_api::SubmitTx {
        tx: hex::encode(signed.to_bytes()),
    })?;
    let included = wait > 0 && wait_in_block(&client, &me.to_string(), nonce, wait, format.json)?;
    if format.json {
        return output::json(&serde_json::json!({
            "submitted": submitted,
            "in_block": included,
        }));
    }
    out!(
        "resolved task {task} rank {rank} of job {job}: {award} of {} to the worker side \
         (transaction {}, network fee {}){}",
        a.price,
        submitted.id,
        submitted.fee,
        if included { ", in a block" } else { "" }
    )?;
    Ok(())
}

/// Waits up to `secs` for the node's account nonce to pass `nonce` (a block holds the
/// transaction): whether it did.
fn wait_in_block(
    client: &cannabis_api::ApiClient,
    address: &str,
    nonce: u64,
    secs: u64,
    quiet: bool,
) -> anyhow::Result<bool> {
    let until = Instant::now() + std::time::Duration::from_secs(secs);
    let bar = crate::output::spinner(quiet);
    bar.set_message(format!(
        "waiting for a block to hold transaction {nonce} of {address}"
    ));
    loop {
        let b = client.balance(Some(address))?;
        if b.nonce > nonce {
            bar.finish_and_clear();
            return Ok(true);
        }
        if Instant::now() >= until {
            bar.finish_and_clear();
            return Ok(false);
        }
        bar.tick();
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `cannabis wallet balance|send|faucet`.
pub(crate) fn wallet(command: WalletCommand, data_dir: &Path) -> anyhow::Result<()> {
    let client = cannabis_api::ApiClient::from_data_dir(data_dir)?;
    match command {
        WalletCommand::Balance { address, format } => {
            let b = client.balance(address.as_deref())?;
            if format.json {
                return output::json(&b);
            }
            output::table(&[
                ("account", b.address),
                ("balance", b.balance.to_string()),
                ("spendable", b.spendable.to_string()),
                ("vesting", b.vesting.to_string()),
                ("next nonce", b.nonce.to_string()),
                ("as of block", b.height.to_string()),
                (
                    "as a worker",
                    format!(
                        "{} results taken, {} assignments paid, {} strikes",
                        b.results, b.paid, b.strikes
                    ),
                ),
            ])?;
            Ok(())
        }
        WalletCommand::Send {
            to,
            amount,
            wait,
            format,
        } => {
            let s = client.send(&to, amount)?;
            let included = wait > 0 && wait_in_block(&client, &s.from, s.nonce, wait, format.json)?;
            report(&s, wait, included, format.json)
        }
        WalletCommand::Faucet { wait, format } => {
            let me = client.balance(None)?;
            let s = client.faucet()?;
            let included = if wait > 0 {
                let until = Instant::now() + std::time::Duration::from_secs(wait);
                let bar = output::spinner(format.json);
                bar.set_message("waiting for a block to hold the faucet's grant");
                let held = loop {
                    let b = client.balance(None)?;
                    if b.balance > me.balance {
                        break true;
                    }
                    if Instant::now() >= until {
                        break false;
                    }
                    bar.tick();
                    std::thread::sleep(std::time::Duration::from_millis(100));
                };
                bar.finish_and_clear();
                held
            } else {
                false
            };
            report(&s, wait, included, format.json)
        }
    }
}

fn report(
    s: &cannabis_api::Submitted,
    wait: u64,
    included: bool,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        #[derive(Serialize)]
        struct Out<'a> {
            #[serde(flatten)]
            submitted: &'a cannabis_api::Submitted,
            in_block: bool,
        }
        return output::json(&Out {
            submitted: s,
            in_block: included,
        });
    }
    out!(
        "transaction {} kept by the sequencer (network fee {})",
        s.id,
        s.fee
    )?;
    if included {
        out!("in a block")?;
    } else if wait > 0 {
        anyhow::bail!(
            "not in a block after {wait} s; `cannabis ledger blocks` shows what the ledger took"
        );
    }
    Ok(())
}
