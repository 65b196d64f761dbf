//! The embedded ledger: escrow paths with their balances, timeouts that settle by
//! themselves, the block checks every node runs, vesting, rewards; and a property test over
//! random sequences of escrow events, timeouts, duplicates and stale epochs.

use cannabis_market::ledger::{BlockRefusal, Ledger, LedgerEvent, Stage, TxRefusal, Why};
use cannabis_protocol::{
    Address, Allocation, Amount, Assigned, Block, ComputeResult, Digest, EscrowAssign,
    EscrowAssignMany, EscrowCancel, EscrowLock, EscrowSettle, Faucet, FeeTerms, Genesis, Keypair,
    Outcome, ResultCommit, Rewards, Signed, Timestamp, Transaction, TxPayload, Uuid, Vesting,
    fee_on,
};
use proptest::prelude::*;

const GAS_PRICE: u64 = 1;
const START: u64 = 1_000_000;
const WINDOW_MS: u64 = 10_000;
const DEADLINE_MS: u64 = 60_000;

fn key(i: u16) -> Keypair {
    let mut s = [0u8; 32];
    s[..2].copy_from_slice(&i.to_le_bytes());
    s[31] = 0x1e;
    Keypair::from_secret(s)
}

/// A network: its keys, its ledger, and the nonces the test's senders are at.
struct Net {
    sequencer: Keypair,
    requester: Keypair,
    workers: Vec<Keypair>,
    founder: Keypair,
    resolver: Keypair,
    ledger: Ledger,
    now: Timestamp,
    nonces: std::collections::HashMap<Address, u64>,
}

fn genesis(
    sequencer: &Keypair,
    requester: &Keypair,
    founder: &Keypair,
    resolver: &Keypair,
) -> Genesis {
    Genesis {
        network: "ledger-tests".into(),
        time: Timestamp(START),
        sequencer: sequencer.address(),
        fee: FeeTerms::founder(founder.address()),
        resolver: resolver.address(),
        min_gas_price: GAS_PRICE,
        supply: Amount(10_000_000_000),
        accounts: vec![Allocation {
            address: requester.address(),
            amount: Amount(9_799_000_000),
        }],
        vesting: vec![Vesting {
            address: founder.address(),
            amount: Amount(100_000_000),
            start: Timestamp(START),
            cliff_ms: 100_000,
            duration_ms: 1_000_000,
        }],
        faucet: Some(Faucet {
            address: requester.address(),
            grant: Amount(1_000_000),
        }),
        rewards: Rewards {
            pool: Amount(101_000_000),
            per_block: Amount(1_000),
            seed_window: 4,
        },
        block_interval_ms: 100,
        max_block_txs: 10_000,
    }
}

impl Net {
    fn new() -> Self {
        let (sequencer, requester, founder, resolver) = (key(1), key(2), key(3), key(4));
        let g = genesis(&sequencer, &requester, &founder, &resolver);
        Self {
            ledger: Ledger::new(g).unwrap(),
            workers: (10..14).map(key).collect(),
            sequencer,
            requester,
            founder,
            resolver,
            now: Timestamp(START),
            nonces: Default::default(),
        }
    }

    fn supply(&self) -> u128 {
        u128::from(self.ledger.genesis().supply.0)
    }

    fn tx(
        &mut self,
        who: &Keypair,
        amount: u64,
        to: Option<Address>,
        payload: TxPayload,
    ) -> Signed<Transaction> {
        let nonce = self.nonces.entry(who.address()).or_default();
        let tx = Transaction::new(
            who.address(),
            to,
            Amount(amount),
            *nonce,
            GAS_PRICE,
            payload,
        )
        .unwrap();
        *nonce += 1;
        Signed::sign(who, &tx)
    }

    /// Makes, signs and applies a block of `txs` at `now`, as the sequencer would.
    fn block(&mut self, txs: Vec<Signed<Transaction>>) -> Result<Vec<LedgerEvent>, BlockRefusal> {
        let block = self.build(&self.sequencer, txs);
        self.ledger.apply_block(&block, self.now).map(|a| a.events)
    }

    fn build(&self, signer: &Keypair, txs: Vec<Signed<Transaction>>) -> Block {
        let txs = txs.into_iter().map(|s| {
            let t = s
                .verify()
                .map(|v| v.body)
                .unwrap_or_else(|_| cannabis_protocol::decode::<Transaction>(s.payload()).unwrap());
            (s, t)
        });
        Block::build(
            signer,
            self.ledger.height() + 1,
            self.ledger.tip(),
            self.now,
            txs.collect(),
        )
        .unwrap()
    }

    fn lock(&mut self, job: Uuid, budget: u64, ranks: u32) -> Signed<Transaction> {
        let lock = EscrowLock {
            job_id: job,
            offer: Digest::of(job.0.as_slice()),
            amount: Amount(budget),
            fee: self.ledger.genesis().fee.clone(),
            deadline: self.now.plus_ms(DEADLINE_MS),
            review_window_ms: WINDOW_MS,
            resolver: self.resolver.address(),
            ranks,
        };
        let r = self.requester.clone();
        self.tx(&r, budget, None, TxPayload::EscrowLock(lock))
    }

    fn assign(
        &mut self,
        job: Uuid,
        rank: u32,
        worker: usize,
        epoch: u64,
        price: u64,
    ) -> Signed<Transaction> {
        let a = EscrowAssign {
            job_id: job,
            task: 0,
            rank,
            worker: self.workers[worker].address(),
            epoch,
            price: Amount(price),
        };
        let r = self.requester.clone();
        self.tx(&r, 0, None, TxPayload::EscrowAssign(a))
    }

    /// One `ESCROW_ASSIGN_MANY` of task 0 at epoch 1: `(rank, worker, price)` each.
    fn assign_many(&mut self, job: Uuid, ranks: &[(u32, usize, u64)]) -> Signed<Transaction> {
        let many = EscrowAssignMany {
            job_id: job,
            assignments: ranks
                .iter()
                .map(|&(rank, worker, price)| Assigned {
                    task: 0,
                    rank,
                    worker: self.workers[worker].address(),
                    epoch: 1,
                    price: Amount(price),
                })
                .collect(),
        };
        let r = self.requester.clone();
        self.tx(&r, 0, None, TxPayload::EscrowAssignMany(many))
    }

    fn commit(&mut self, job: Uuid, rank: u32, worker: usize, epoch: u64) -> Signed<Transaction> {
        let c = ResultCommit {
            job_id: job,
            task: 0,
            rank,
            epoch,
            manifest: Digest::of(b"manifest"),
        };
        let w = self.workers[worker].clone();
        self.tx(&w, 0, None, TxPayload::ResultCommit(c))
    }

    fn settle(
        &mut self,
        by: &Keypair,
        job: Uuid,
        rank: u32,
        epoch: u64,
        outcome: Outcome,
    ) -> Signed<Transaction> {
        let s = EscrowSettle {
            job_id: job,
            task: 0,
            rank,
            epoch,
            outcome,
        };
        self.tx(by, 0, None, TxPayload::EscrowSettle(s))
    }

    fn dispute(&mut self, job: Uuid, rank: u32, epoch: u64) -> Signed<Transaction> {
        let s = EscrowSettle {
            job_id: job,
            task: 0,
            rank,
            epoch,
            outcome: Outcome::Rejected,
        };
        let r = self.requester.clone();
        self.tx(&r, 0, None, TxPayload::EscrowDispute(s))
    }

    fn balance(&self, k: &Keypair) -> u64 {
        self.ledger.account(&k.address()).balance.0
    }

    /// Funds the workers (for their network fees) from the requester.
    fn fund_workers(&mut self) {
        let txs: Vec<_> = (0..self.workers.len())
            .map(|i| {
                let (r, to) = (self.requester.clone(), self.workers[i].address());
                self.tx(&r, 10_000_000, Some(to), TxPayload::Transfer)
            })
            .collect();
        self.block(txs).unwrap();
    }
}

fn job(i: u8) -> Uuid {
    Uuid::from_random([i; 16])
}

#[test]
fn accepted_work_pays_the_worker_share_and_the_pinned_fee_and_refunds_the_rest() {
    let mut n = Net::new();
    n.fund_workers();
    let (requester, founder) = (n.requester.clone(), n.founder.clone());
    let before = (
        n.balance(&requester),
        n.balance(&n.workers[0].clone()),
        n.balance(&founder),
    );
    let j = job(1);
    let txs = vec![n.lock(j, 1_000_000, 1), n.assign(j, 0, 0, 1, 800_000)];
    n.block(txs).unwrap();
    let commit = n.commit(j, 0, 0, 1);
    n.block(vec![commit]).unwrap();
    let accept = n.settle(&requester, j, 0, 1, Outcome::Accepted);
    let events = n.block(vec![accept]).unwrap();
    let e = n.ledger.escrow(&j).unwrap();
    assert_eq!(
        e.refunded,
        Some(Amount(200_000)),
        "closed once its one rank settled"
    );
    assert_eq!(
        (e.paid_worker, e.paid_fee),
        (Amount(792_000), Amount(8_000))
    );
    let worker = n.workers[0].clone();
    // Network fees: the requester paid three transactions, the worker one.
    let gas = |k: usize| (k as u64) * 60_000 * GAS_PRICE;
    assert_eq!(
        n.balance(&requester),
        before.0 - 1_000_000 - gas(3) + 200_000
    );
    assert_eq!(n.balance(&worker), before.1 + 792_000 - gas(1));
    assert_eq!(n.balance(&founder), before.2 + 8_000);
    let moved: Vec<(Why, u64)> = events
        .iter()
        .filter_map(|e| match e {
            LedgerEvent::Escrow { movement, .. } => Some((movement.why, movement.amount.0)),
            _ => None,
        })
        .collect();
    assert_eq!(
        moved,
        [
            (Why::WorkerShare, 792_000),
            (Why::Fee, 8_000),
            (Why::Refund, 200_000)
        ]
    );
    assert_eq!(n.ledger.total(), n.supply());
    assert_eq!(n.ledger.rating(&worker.address()).paid, 1);
}

#[test]
fn an_undisputed_delivery_is_paid_when_its_window_ends_even_if_the_requester_is_silent() {
    let mut n = Net::new();
    n.fund_workers();
    let j = job(2);
    let txs = vec![n.lock(j, 500, 1), n.assign(j, 0, 1, 1, 500)];
    n.block(txs).unwrap();
    let commit = n.commit(j, 0, 1, 1);
    n.block(vec![commit]).unwrap();
    let worker = n.workers[1].clone();
    let before = n.balance(&worker);
    n.now = n.now.plus_ms(WINDOW_MS - 1);
    n.block(vec![]).unwrap();
    assert_eq!(n.balance(&worker), before, "not before the window ends");
    assert_eq!(n.ledger.next_due(), Some(n.now.plus_ms(1)));
    n.now = n.now.plus_ms(1);
    n.block(vec![]).unwrap();
    assert_eq!(n.balance(&worker), before + 495);
    let e = n.ledger.escrow(&j).unwrap();
    assert!(matches!(
        e.assignments[&(0, 0)].stage,
        Stage::Settled {
            outcome: Outcome::ReviewWindowElapsed,
            ..
        }
    ));
    assert_eq!(e.refunded, Some(Amount(0)));
}

#[test]
fn a_dispute_freezes_the_money_until_the_resolver_settles_it() {
    let mut n = Net::new();
    n.fund_workers();
    let j = job(3);
    let txs = vec![n.lock(j, 1_000, 1), n.assign(j, 0, 2, 1, 1_000)];
    n.block(txs).unwrap();
    let commit = n.commit(j, 0, 2, 1);
    n.block(vec![commit]).unwrap();
    let dispute = n.dispute(j, 0, 1);
    n.block(vec![dispute]).unwrap();
    // Past the window and the deadline: nothing moves while the dispute stands.
    n.now = n.now.plus_ms(DEADLINE_MS * 2);
    let requester = n.requester.clone();
    let (r0, w0) = (n.balance(&requester), n.balance(&n.workers[2].clone()));
    n.block(vec![]).unwrap();
    assert_eq!(n.ledger.escrow(&j).unwrap().refunded, None);
    assert_eq!(n.balance(&requester), r0);
    // Neither the requester's nor the worker's word settles it: only the resolver's.
    let by_worker = {
        let w = n.workers[2].clone();
        n.settle(
            &w,
            j,
            0,
            1,
            Outcome::DisputeResolved {
                award: Amount(1_000),
            },
        )
    };
    assert!(matches!(
        n.block(vec![by_worker]),
        Err(BlockRefusal::Tx {
            refusal: TxRefusal::Escrow(_),
            ..
        })
    ));
    n.nonces.insert(n.workers[2].address(), 1);
    n.resolver_funds();
    let resolver = n.resolver.clone();
    let resolve = n.settle(
        &resolver,
        j,
        0,
        1,
        Outcome::DisputeResolved { award: Amount(300) },
    );
    n.block(vec![resolve]).unwrap();
    assert_eq!(n.balance(&n.workers[2].clone()), w0 + 297);
    assert_eq!(n.balance(&requester), r0 - 1_000_000 - 21_000 + 700);
    assert_eq!(n.ledger.rating(&n.workers[2].address()).strikes, 1);
    assert_eq!(n.ledger.total(), n.supply());
}

impl Net {
    fn resolver_funds(&mut self) {
        let (r, to) = (self.requester.clone(), self.resolver.address());
        let t = self.tx(&r, 1_000_000, Some(to), TxPayload::Transfer);
        self.block(vec![t]).unwrap();
    }
}

#[test]
fn a_missed_deadline_refunds_in_full_and_a_late_delivery_is_refused() {
    let mut n = Net::new();
    n.fund_workers();
    let j = job(4);
    let txs = vec![
        n.lock(j, 1_000, 2),
        n.assign(j, 0, 0, 1, 400),
        n.assign(j, 1, 1, 1, 400),
    ];
    n.block(txs).unwrap();
    let requester = n.requester.clone();
    let before = n.balance(&requester);
    n.now = n.now.plus_ms(DEADLINE_MS);
    let late = n.commit(j, 0, 0, 1);
    assert!(matches!(
        n.block(vec![late]),
        Err(BlockRefusal::Tx {
            refusal: TxRefusal::Escrow(_),
            ..
        })
    ));
    n.block(vec![]).unwrap();
    assert_eq!(n.ledger.escrow(&j).unwrap().refunded, Some(Amount(1_000)));
    assert_eq!(n.balance(&requester), before + 1_000, "refunds earn no fee");
}

#[test]
fn a_lock_with_other_fee_terms_or_resolver_is_refused() {
    let mut n = Net::new();
    let good = n.lock(job(5), 1_000, 1).verify().unwrap().body;
    let with = |change: &dyn Fn(&mut EscrowLock)| {
        let mut tx = good.clone();
        if let TxPayload::EscrowLock(lock) = &mut tx.payload {
            change(lock);
        }
        tx
    };
    let own_fee = with(&|l| l.fee.recipient = key(2).address());
    let err = n
        .block(vec![Signed::sign(&n.requester, &own_fee)])
        .unwrap_err();
    assert!(err.to_string().contains("not the network's"), "{err}");
    let own_resolver = with(&|l| l.resolver = key(2).address());
    let err = n
        .block(vec![Signed::sign(&n.requester, &own_resolver)])
        .unwrap_err();
    assert!(err.to_string().contains("resolver"), "{err}");
    n.block(vec![Signed::sign(&n.requester, &good)]).unwrap();
}

#[test]
fn a_stale_epoch_moves_no_money_and_a_newer_one_replaces_an_undelivered_assignment() {
    let mut n = Net::new();
    n.fund_workers();
    let j = job(6);
    let txs = vec![n.lock(j, 1_000, 1), n.assign(j, 0, 0, 1, 600)];
    n.block(txs).unwrap();
    // The lease moved to worker 1 at epoch 2 (the first lapsed).
    let again = n.assign(j, 0, 1, 2, 900);
    n.block(vec![again]).unwrap();
    let stale = n.commit(j, 0, 0, 1);
    let err = n.block(vec![stale]).unwrap_err();
    assert!(err.to_string().contains("stale epoch 1"), "{err}");
    n.nonces.insert(n.workers[0].address(), 0);
    let older = n.assign(j, 0, 0, 1, 10);
    assert!(
        n.block(vec![older])
            .unwrap_err()
            .to_string()
            .contains("stale epoch")
    );
    n.nonces.insert(
        n.requester.address(),
        n.ledger.account(&n.requester.address()).nonce,
    );
    let commit = n.commit(j, 0, 1, 2);
    n.block(vec![commit]).unwrap();
    // Delivered: it cannot be replaced before it settles.
    let replace = n.assign(j, 0, 0, 3, 100);
    assert!(
        n.block(vec![replace])
            .unwrap_err()
            .to_string()
            .contains("delivered")
    );
}

#[test]
fn prices_beyond_the_lock_are_refused() {
    let mut n = Net::new();
    let j = job(7);
    let txs = vec![n.lock(j, 1_000, 2), n.assign(j, 0, 0, 1, 600)];
    n.block(txs).unwrap();
    let over = n.assign(j, 1, 1, 1, 401);
    let err = n.block(vec![over]).unwrap_err();
    assert!(
        err.to_string()
            .contains("over what is left of the lock (400)"),
        "{err}"
    );
}

#[test]
fn a_group_is_assigned_in_one_transaction_whole_or_not_at_all() {
    let mut n = Net::new();
    let requester = n.requester.clone();
    let before = n.balance(&requester);
    let j = job(9);
    let lock = n.lock(j, 1_000, 3);
    let many = n.assign_many(j, &[(0, 0, 300), (1, 1, 300), (2, 2, 300)]);
    n.block(vec![lock, many]).unwrap();
    let e = n.ledger.escrow(&j).unwrap();
    let assigned: Vec<(u32, Address, u64)> = e
        .assignments
        .iter()
        .map(|((_, rank), a)| (*rank, a.worker, a.epoch))
        .collect();
    let expected: Vec<(u32, Address, u64)> = (0..3)
        .map(|r| (r, n.workers[r as usize].address(), 1))
        .collect();
    assert_eq!(assigned, expected);
    // The three ranks cost one transaction's network fee: the lock's and this one's.
    assert_eq!(
        n.balance(&requester),
        before - 1_000 - 2 * 60_000 * GAS_PRICE
    );

    // One assignment beyond the lock refuses the whole transaction: none of it is kept.
    let k = job(10);
    let lock = n.lock(k, 1_000, 3);
    n.block(vec![lock]).unwrap();
    let over = n.assign_many(k, &[(0, 0, 500), (1, 1, 501)]);
    let err = n.block(vec![over]).unwrap_err();
    assert!(
        err.to_string().contains("over what is left of the lock"),
        "{err}"
    );
    assert!(n.ledger.escrow(&k).unwrap().assignments.is_empty());
    // Nor one naming a rank twice.
    let twice = n.assign_many(k, &[(0, 0, 100), (0, 1, 100)]);
    assert!(n.block(vec![twice]).is_err());
    assert!(n.ledger.escrow(&k).unwrap().assignments.is_empty());
    assert_eq!(n.ledger.total(), n.supply());
}

#[test]
fn the_network_fee_quoted_for_a_group_is_what_settling_it_costs() {
    // Lock, the three ranks' assignments in one transaction, and three acceptances: five
    // transactions, which is what the quote (`Ledger::settlement_gas`) must say. It said
    // seven (an assignment per rank) once groups were assigned together.
    let mut n = Net::new();
    n.fund_workers();
    let requester = n.requester.clone();
    let before = n.balance(&requester);
    let j = job(11);
    let lock = n.lock(j, 900, 3);
    let many = n.assign_many(j, &[(0, 0, 300), (1, 1, 300), (2, 2, 300)]);
    n.block(vec![lock, many]).unwrap();
    let commits = (0..3).map(|r| n.commit(j, r, r as usize, 1)).collect();
    n.block(commits).unwrap();
    let settles = (0..3)
        .map(|r| n.settle(&requester, j, r, 1, Outcome::Accepted))
        .collect();
    n.block(settles).unwrap();
    let e = n.ledger.escrow(&j).unwrap();
    assert_eq!(e.paid_worker.0 + e.paid_fee.0, 900);
    let refunded = e.refunded.map_or(0, |a| a.0);
    let fees = before - n.balance(&requester) - 900 + refunded;
    assert_eq!(fees, Ledger::settlement_gas([3]) * GAS_PRICE);
    // A single rank takes a plain assignment; a group of 99 two of the batched ones.
    assert_eq!(Ledger::settlement_gas([1]), 3 * 60_000);
    assert_eq!(Ledger::settlement_gas([99]), (1 + 2 + 99) * 60_000);
    assert_eq!(
        Ledger::settlement_gas([1, 56, 57]),
        (1 + 1 + 1 + 2 + 114) * 60_000
    );
}

#[test]
fn cancel_refunds_what_no_delivery_holds() {
    let mut n = Net::new();
    n.fund_workers();
    let j = job(8);
    let txs = vec![
        n.lock(j, 1_000, 2),
        n.assign(j, 0, 0, 1, 500),
        n.assign(j, 1, 1, 1, 500),
    ];
    n.block(txs).unwrap();
    let commit = n.commit(j, 1, 1, 1);
    n.block(vec![commit]).unwrap();
    let requester = n.requester.clone();
    let cancel = n.tx(
        &requester,
        0,
        None,
        TxPayload::EscrowCancel(EscrowCancel { job_id: j }),
    );
    n.block(vec![cancel]).unwrap();
    let e = n.ledger.escrow(&j).unwrap();
    assert_eq!(e.refunded, None, "the delivered rank still has its window");
    assert!(matches!(
        e.assignments[&(0, 0)].stage,
        Stage::Settled {
            outcome: Outcome::Cancelled,
            ..
        }
    ));
    let accept = n.settle(
        &requester,
        j,
        1,
        1,
        Outcome::PartiallyAccepted {
            accepted_ppm: 500_000,
        },
    );
    n.block(vec![accept]).unwrap();
    let e = n.ledger.escrow(&j).unwrap();
    assert_eq!(
        (e.paid_worker, e.paid_fee, e.refunded),
        (Amount(248), Amount(2), Some(Amount(750)))
    );
}

#[test]
fn founders_tokens_are_spendable_only_as_they_vest() {
    let mut n = Net::new();
    let founder = n.founder.clone();
    let to = n.requester.address();
    let early = n.tx(&founder, 1, Some(to), TxPayload::Transfer);
    let err = n.block(vec![early]).unwrap_err();
    assert!(err.to_string().contains("still vesting"), "{err}");
    n.nonces.insert(founder.address(), 0);
    // Halfway: half of it vested (50,000,000), less the network fee.
    n.now = Timestamp(START + 500_000);
    let half = n.tx(&founder, 50_000_000 - 21_000, Some(to), TxPayload::Transfer);
    n.block(vec![half]).unwrap();
    let more = n.tx(&founder, 1, Some(to), TxPayload::Transfer);
    assert!(n.block(vec![more]).is_err());
    assert_eq!(n.ledger.total(), n.supply());
}

fn result_for(n: &Net, worker: &Keypair, height: u64) -> Signed<Transaction> {
    let hash = n.ledger.recent_hash(height).unwrap();
    let r = ComputeResult::signed(
        worker,
        Ledger::seed_task_id(&hash),
        Digest::of(b"c"),
        None,
        Some(height),
    );
    Signed::sign(
        worker,
        &Transaction::submit_result(r, 0, GAS_PRICE).unwrap(),
    )
}

#[test]
fn results_seeded_by_a_recent_block_earn_the_pool_once_per_worker_and_block() {
    let mut n = Net::new();
    n.fund_workers();
    let (w0, w1, w2) = (
        n.workers[0].clone(),
        n.workers[1].clone(),
        n.workers[2].clone(),
    );
    let (b0, b1) = (n.balance(&w0), n.balance(&w1));
    let txs = vec![
        result_for(&n, &w0, 1),
        result_for(&n, &w1, 1),
        result_for(&n, &w2, 1),
    ];
    let events = n.block(txs).unwrap();
    let gas = 80_000 * GAS_PRICE;
    assert_eq!(
        n.balance(&w0),
        b0 - gas + 333,
        "1,000 per block shared by three, rounded down"
    );
    assert_eq!(n.balance(&w1), b1 - gas + 333);
    assert_eq!(events.len(), 3);
    assert_eq!(n.ledger.pool().0, 101_000_000 - 999);
    assert_eq!(n.ledger.rating(&w0.address()).results, 1);
    // A second result for the same seed block: refused.
    let again = {
        let hash = n.ledger.recent_hash(1).unwrap();
        let r = ComputeResult::signed(
            &w0,
            Ledger::seed_task_id(&hash),
            Digest::of(b"d"),
            None,
            Some(1),
        );
        Signed::sign(&w0, &Transaction::submit_result(r, 1, GAS_PRICE).unwrap())
    };
    assert!(
        n.block(vec![again])
            .unwrap_err()
            .to_string()
            .contains("already has a result")
    );
    // A task that is not the block's: refused.
    let forged = {
        let r = ComputeResult::signed(
            &w0,
            Uuid::from_random([9; 16]),
            Digest::of(b"d"),
            None,
            Some(2),
        );
        Signed::sign(&w0, &Transaction::submit_result(r, 1, GAS_PRICE).unwrap())
    };
    assert!(
        n.block(vec![forged])
            .unwrap_err()
            .to_string()
            .contains("not the task")
    );
    // Out of the seed window (4 blocks): refused.
    for _ in 0..4 {
        n.block(vec![]).unwrap();
    }
    assert_eq!(n.ledger.recent_hash(1), None);
    assert_eq!(n.ledger.total(), n.supply());
}

/// Every block check: each bad block is refused and the ledger is as it was.
#[test]
fn bad_blocks_are_refused_and_change_nothing() {
    let mut n = Net::new();
    n.fund_workers();
    let snapshot = |n: &Net| {
        (
            n.ledger.height(),
            n.ledger.tip(),
            n.ledger.total(),
            n.ledger.account(&n.requester.address()),
        )
    };
    let before = snapshot(&n);
    let requester = n.requester.clone();
    let to = n.workers[0].address();

    // A wrong compute_root: the sequencer signs a header whose root is not its results'.
    let w0 = n.workers[0].clone();
    let good = n.build(&n.sequencer, vec![result_for(&n, &w0, 1)]);
    let mut header = good.header.verify().unwrap().body;
    header.compute_root = Digest::of(b"not the root");
    let bad = Block {
        header: Signed::sign(&n.sequencer, &header),
        txs: good.txs.clone(),
    };
    assert!(matches!(
        n.ledger.apply_block(&bad, n.now),
        Err(BlockRefusal::Block(_))
    ));

    // A forged transaction: signed by another key than its sender.
    let tx = Transaction::new(
        requester.address(),
        Some(to),
        Amount(5),
        1,
        GAS_PRICE,
        TxPayload::Transfer,
    )
    .unwrap();
    let forged = n.build(&n.sequencer, vec![Signed::sign(&w0, &tx)]);
    assert!(matches!(
        n.ledger.apply_block(&forged, n.now),
        Err(BlockRefusal::Block(_))
    ));

    // A replayed nonce: the funding transfer of worker 0 again.
    let replay = {
        let t = Transaction::new(
            requester.address(),
            Some(to),
            Amount(10_000_000),
            0,
            GAS_PRICE,
            TxPayload::Transfer,
        )
        .unwrap();
        n.build(&n.sequencer, vec![Signed::sign(&requester, &t)])
    };
    assert!(matches!(
        n.ledger.apply_block(&replay, n.now),
        Err(BlockRefusal::Tx {
            refusal: TxRefusal::Nonce {
                expected: 4,
                got: 0
            },
            ..
        })
    ));

    // A result whose worker_address is not the sender.
    let theirs = {
        let hash = n.ledger.recent_hash(1).unwrap();
        let r = ComputeResult::signed(
            &w0,
            Ledger::seed_task_id(&hash),
            Digest::of(b"c"),
            None,
            Some(1),
        );
        let mut t = Transaction::submit_result(r, 4, GAS_PRICE).unwrap();
        t.from_address = requester.address();
        n.build(&n.sequencer, vec![Signed::sign(&requester, &t)])
    };
    assert!(matches!(
        n.ledger.apply_block(&theirs, n.now),
        Err(BlockRefusal::Block(_))
    ));

    // A spend beyond the balance.
    let balance = n.balance(&requester);
    let over = {
        let t = Transaction::new(
            requester.address(),
            Some(to),
            Amount(balance),
            4,
            GAS_PRICE,
            TxPayload::Transfer,
        )
        .unwrap();
        n.build(&n.sequencer, vec![Signed::sign(&requester, &t)])
    };
    assert!(matches!(
        n.ledger.apply_block(&over, n.now),
        Err(BlockRefusal::Tx {
            refusal: TxRefusal::Funds { .. },
            ..
        })
    ));

    // A block from a key that is not the sequencer.
    let stranger = n.build(&requester, vec![]);
    assert!(matches!(
        n.ledger.apply_block(&stranger, n.now),
        Err(BlockRefusal::NotSequencer(_))
    ));

    // The wrong parent, the wrong height, a time from the future.
    let mut orphan = n.build(&n.sequencer, vec![]);
    let mut h = orphan.header.verify().unwrap().body;
    h.prev_hash = Digest::of(b"elsewhere");
    orphan.header = Signed::sign(&n.sequencer, &h);
    assert!(matches!(
        n.ledger.apply_block(&orphan, n.now),
        Err(BlockRefusal::Parent { .. })
    ));
    h.prev_hash = n.ledger.tip();
    h.height += 1;
    orphan.header = Signed::sign(&n.sequencer, &h);
    assert!(matches!(
        n.ledger.apply_block(&orphan, n.now),
        Err(BlockRefusal::Height { .. })
    ));
    let ahead = n.build(&n.sequencer, vec![]);
    assert!(matches!(
        n.ledger.apply_block(&ahead, Timestamp(n.now.0 - 30_001)),
        Err(BlockRefusal::Time { .. })
    ));

    // One bad transaction among good ones refuses the whole block.
    let t1 = Transaction::new(
        requester.address(),
        Some(to),
        Amount(5),
        4,
        GAS_PRICE,
        TxPayload::Transfer,
    )
    .unwrap();
    let t2 = Transaction::new(
        requester.address(),
        Some(to),
        Amount(5),
        4,
        GAS_PRICE,
        TxPayload::Transfer,
    )
    .unwrap();
    let mixed = n.build(
        &n.sequencer,
        vec![Signed::sign(&requester, &t1), Signed::sign(&requester, &t2)],
    );
    assert!(matches!(
        n.ledger.apply_block(&mixed, n.now),
        Err(BlockRefusal::Tx { index: 1, .. })
    ));

    assert_eq!(snapshot(&n), before);
    // And the good block still applies.
    n.ledger.apply_block(&good, n.now).unwrap();
}

#[test]
fn the_sequencer_proposes_what_applies_in_nonce_order_and_leaves_the_rest() {
    let mut n = Net::new();
    let requester = n.requester.clone();
    let to = n.workers[0].address();
    let t = |nonce: u64, amount: u64| {
        let t = Transaction::new(
            requester.address(),
            Some(to),
            Amount(amount),
            nonce,
            GAS_PRICE,
            TxPayload::Transfer,
        )
        .unwrap();
        (Signed::sign(&requester, &t), t)
    };
    // Arrived out of order, one unaffordable, one waiting for a missing nonce.
    let candidates = vec![t(1, 10), t(0, 10), t(2, u64::MAX / 2), t(4, 10)];
    let p = n.ledger.propose(n.now, candidates);
    let nonces: Vec<u64> = p.txs.iter().map(|(_, t)| t.nonce).collect();
    assert_eq!(nonces, [0, 1]);
    assert_eq!(p.refused.len(), 1);
    assert_eq!(p.waiting.len(), 1);
    let block = Block::build(
        &n.sequencer,
        p.header.height,
        p.header.prev_hash,
        p.header.timestamp,
        p.txs,
    )
    .unwrap();
    assert_eq!(block.header.verify().unwrap().body, p.header);
    n.ledger.apply_block(&block, n.now).unwrap();
    assert_eq!(n.ledger.account(&to).balance, Amount(20));
}

// ---- The property: random escrow events, timeouts, duplicates and stale epochs. ----

/// One event. Most pick their target among the assignments where it makes sense (by
/// `pick`), so that every stage is reached; `stale` sends it at an older epoch instead,
/// and `Wait` lets time pass (windows end, deadlines fall).
#[derive(Clone, Debug)]
enum Step {
    Lock {
        budget: u64,
        ranks: u32,
    },
    Assign {
        pick: usize,
        stale: bool,
        worker: usize,
        share: u64,
    },
    Commit {
        pick: usize,
        stale: bool,
    },
    Dispute {
        pick: usize,
        stale: bool,
    },
    Accept {
        pick: usize,
        stale: bool,
        ppm: Option<u32>,
    },
    CancelRank {
        pick: usize,
        stale: bool,
    },
    Resolve {
        pick: usize,
        stale: bool,
        award: u64,
    },
    CancelJob {
        pick: usize,
    },
    Wait {
        ms: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let pick = 0usize..8;
    prop_oneof![
        1 => (1u64..2_000_000, 1u32..4).prop_map(|(budget, ranks)| Step::Lock { budget, ranks }),
        3 => (pick.clone(), proptest::bool::weighted(0.15), 0usize..4, 0u64..=120)
            .prop_map(|(pick, stale, worker, share)| Step::Assign { pick, stale, worker, share }),
        3 => (pick.clone(), proptest::bool::weighted(0.15)).prop_map(|(pick, stale)| Step::Commit { pick, stale }),
        2 => (pick.clone(), proptest::bool::weighted(0.15)).prop_map(|(pick, stale)| Step::Dispute { pick, stale }),
        2 => (pick.clone(), proptest::bool::weighted(0.15), proptest::option::of(0u32..=1_000_000))
            .prop_map(|(pick, stale, ppm)| Step::Accept { pick, stale, ppm }),
        1 => (pick.clone(), proptest::bool::weighted(0.15)).prop_map(|(pick, stale)| Step::CancelRank { pick, stale }),
        2 => (pick.clone(), proptest::bool::weighted(0.15), 0u64..1_200_000)
            .prop_map(|(pick, stale, award)| Step::Resolve { pick, stale, award }),
        1 => pick.clone().prop_map(|pick| Step::CancelJob { pick }),
        2 => (0u64..25_000).prop_map(|ms| Step::Wait { ms }),
    ]
}

impl Net {
    /// The assignments whose stage `keep` likes, as (job, rank, worker, epoch, price).
    fn assignments(&self, keep: impl Fn(&Stage) -> bool) -> Vec<(Uuid, u32, usize, u64, u64)> {
        let mut out = Vec::new();
        for e in self.ledger.escrows().values() {
            for ((_, rank), a) in &e.assignments {
                if keep(&a.stage) {
                    let w = self
                        .workers
                        .iter()
                        .position(|k| k.address() == a.worker)
                        .unwrap();
                    out.push((e.job_id, *rank, w, a.epoch, a.price.0));
                }
            }
        }
        out
    }

    fn step_tx(&mut self, s: &Step, jobs: &mut u8) -> Option<Signed<Transaction>> {
        let requester = self.requester.clone();
        let resolver = self.resolver.clone();
        let chosen = |list: Vec<(Uuid, u32, usize, u64, u64)>, pick: usize, stale: bool| {
            let n = list.len();
            (n > 0).then(|| {
                let (j, rank, w, epoch, price) = list[pick % n];
                (j, rank, w, if stale { epoch - 1 } else { epoch }, price)
            })
        };
        Some(match *s {
            Step::Lock { budget, ranks } => {
                *jobs += 1;
                self.lock(job(*jobs), budget, ranks)
            }
            Step::Assign {
                pick,
                stale,
                worker,
                share,
            } => {
                // A rank of an open escrow: a new one, or the next epoch of one assigned.
                let open: Vec<_> = self
                    .ledger
                    .escrows()
                    .values()
                    .filter(|e| !e.is_closed())
                    .cloned()
                    .collect();
                if open.is_empty() {
                    return None;
                }
                let e = &open[pick % open.len()];
                let rank = (pick as u32 / 2) % e.ranks.max(1);
                let epoch = e
                    .assignments
                    .get(&(0, rank))
                    .map_or(1, |a| a.epoch + u64::from(!stale));
                let price = e.locked.0 / u64::from(e.ranks) * share / 100;
                self.assign(e.job_id, rank, worker, epoch, price)
            }
            Step::Commit { pick, stale } => {
                let (j, rank, w, epoch, _) =
                    chosen(self.assignments(|s| *s == Stage::Assigned), pick, stale)?;
                self.commit(j, rank, w, epoch)
            }
            Step::Dispute { pick, stale } => {
                let (j, rank, _, epoch, _) = chosen(
                    self.assignments(|s| matches!(s, Stage::Delivered { .. })),
                    pick,
                    stale,
                )?;
                self.dispute(j, rank, epoch)
            }
            Step::Accept { pick, stale, ppm } => {
                let list = self
                    .assignments(|s| matches!(s, Stage::Delivered { .. } | Stage::Disputed { .. }));
                let (j, rank, _, epoch, _) = chosen(list, pick, stale)?;
                let o = ppm.map_or(Outcome::Accepted, |accepted_ppm| {
                    Outcome::PartiallyAccepted { accepted_ppm }
                });
                self.settle(&requester, j, rank, epoch, o)
            }
            Step::CancelRank { pick, stale } => {
                let (j, rank, _, epoch, _) =
                    chosen(self.assignments(|s| *s == Stage::Assigned), pick, stale)?;
                self.settle(&requester, j, rank, epoch, Outcome::Cancelled)
            }
            Step::Resolve { pick, stale, award } => {
                let list = self.assignments(|s| matches!(s, Stage::Disputed { .. }));
                let (j, rank, _, epoch, _) = chosen(list, pick, stale)?;
                self.settle(
                    &resolver,
                    j,
                    rank,
                    epoch,
                    Outcome::DisputeResolved {
                        award: Amount(award),
                    },
                )
            }
            Step::CancelJob { pick } => {
                let jobs: Vec<Uuid> = self.ledger.escrows().keys().copied().collect();
                if jobs.is_empty() {
                    return None;
                }
                let j = jobs[pick % jobs.len()];
                self.tx(
                    &requester,
                    0,
                    None,
                    TxPayload::EscrowCancel(EscrowCancel { job_id: j }),
                )
            }
            Step::Wait { .. } => return None,
        })
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Whatever happens, in whatever order, repeated or stale: money is conserved, every
    /// closed escrow balances exactly, fees are the floor rule on what was paid (none on
    /// refunds), nothing is paid twice, and a refused transaction (a duplicate, a stale
    /// epoch, one out of turn) changes nothing.
    #[test]
    fn escrow_paths_always_balance(steps in proptest::collection::vec(step(), 1..60)) {
        let mut n = Net::new();
        n.fund_workers();
        n.resolver_funds();
        let mut paid_out: std::collections::HashMap<(Uuid, u32), u64> = Default::default();
        let mut jobs = 0u8;
        for s in &steps {
            if let Step::Wait { ms } = s {
                n.now = n.now.plus_ms(*ms);
            }
            let tx = n.step_tx(s, &mut jobs);
            let before = (n.ledger.total(), n.ledger.escrows().clone(), n.ledger.height());
            // The same transaction twice: the second is a replay and must not apply.
            let txs: Vec<_> = tx.into_iter().collect();
            match n.block(txs.clone()) {
                Ok(events) => {
                    for e in &events {
                        if let LedgerEvent::Escrow { job_id, movement } = e
                            && movement.why != Why::Refund
                        {
                            // Settlement events name no rank: count per job and check
                            // against what the escrow says it paid.
                            *paid_out.entry((*job_id, 0)).or_default() += movement.amount.0;
                        }
                    }
                    if !txs.is_empty() {
                        let replay = n.build(&n.sequencer, txs.clone());
                        prop_assert!(n.ledger.apply_block(&replay, n.now).is_err(), "a replay applied");
                    }
                }
                Err(BlockRefusal::Tx { .. }) => {
                    prop_assert_eq!(n.ledger.height(), before.2);
                    prop_assert_eq!(n.ledger.escrows(), &before.1);
                    // The refused transaction's nonce was not used.
                    if let Some(t) = txs.first() {
                        let t = t.verify().unwrap().body;
                        n.nonces.insert(t.from_address, t.nonce);
                    }
                }
                Err(other) => return Err(TestCaseError::fail(format!("{other}"))),
            }
            prop_assert_eq!(n.ledger.total(), n.supply());
            for e in n.ledger.escrows().values() {
                let mut worker = 0u64;
                let mut fee = 0u64;
                for a in e.assignments.values() {
                    if let Stage::Settled { worker_paid, fee_paid, .. } = a.stage {
                        let paid = worker_paid.0 + fee_paid.0;
                        prop_assert!(paid <= a.price.0, "paid over the price");
                        prop_assert_eq!(fee_paid, fee_on(Amount(paid), e.fee.rate_bps).unwrap());
                        worker += worker_paid.0;
                        fee += fee_paid.0;
                    }
                }
                // Only the latest epoch of each rank is kept; a replaced one paid nothing.
                prop_assert_eq!(Amount(worker), e.paid_worker);
                prop_assert_eq!(Amount(fee), e.paid_fee);
                prop_assert_eq!(paid_out.get(&(e.job_id, 0)).copied().unwrap_or(0), worker + fee);
                match e.refunded {
                    Some(r) => prop_assert_eq!(
                        u128::from(e.paid_worker.0) + u128::from(e.paid_fee.0) + u128::from(r.0),
                        u128::from(e.locked.0)
                    ),
                    None => prop_assert!(e.paid_worker.0 + e.paid_fee.0 <= e.locked.0),
                }
            }
        }
        // In the end every escrow closes by itself once its deadline passes, unless a
        // dispute still stands.
        n.now = n.now.plus_ms(DEADLINE_MS + WINDOW_MS);
        n.block(vec![]).unwrap();
        for e in n.ledger.escrows().values() {
            let disputed = e.assignments.values().any(|a| matches!(a.stage, Stage::Disputed { .. }));
            prop_assert_eq!(e.is_closed(), !disputed);
        }
        prop_assert_eq!(n.ledger.total(), n.supply());
    }
}

#[test]
fn a_proposed_block_stays_within_the_block_wire_cap() {
    let mut n = Net::new();
    let senders: Vec<Keypair> = (100..140).map(key).collect();
    let fund: Vec<_> = senders
        .iter()
        .map(|k| {
            let r = n.requester.clone();
            n.tx(&r, 10_000_000, Some(k.address()), TxPayload::Transfer)
        })
        .collect();
    n.block(fund).unwrap();
    let to = n.workers[0].address();
    let candidates: Vec<_> = (0..5_000u64)
        .map(|i| {
            let k = &senders[(i % 40) as usize];
            let t = Transaction::new(
                k.address(),
                Some(to),
                Amount(1),
                i / 40,
                GAS_PRICE,
                TxPayload::Transfer,
            )
            .unwrap();
            (Signed::sign(k, &t), t)
        })
        .collect();
    let p = n.ledger.propose(n.now, candidates);
    assert!(
        !p.waiting.is_empty(),
        "5,000 transfers do not fit in one block"
    );
    assert!(p.refused.is_empty());
    let taken = p.txs.len();
    let block = Block::build(
        &n.sequencer,
        p.header.height,
        p.header.prev_hash,
        p.header.timestamp,
        p.txs,
    )
    .unwrap();
    let wire = cannabis_protocol::encode(&block);
    assert!(
        wire.len() <= <Block as cannabis_protocol::Wire>::MAX_SIZE,
        "{} bytes",
        wire.len()
    );
    assert!(
        wire.len() > <Block as cannabis_protocol::Wire>::MAX_SIZE * 9 / 10,
        "{} bytes for {taken}",
        wire.len()
    );
    // It decodes on the other side, and applies.
    let back: Block = cannabis_protocol::decode(&wire).unwrap();
    n.ledger.apply_block(&back, n.now).unwrap();
}
