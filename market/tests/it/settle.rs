//! The engine with settlement: no award before the budget's lock is in a block, each award
//! assigned in the escrow, the worker's delivery committed, the requester's accept or
//! dispute carried out; every order signed and applied by a real `Ledger`, as a node does.

use std::collections::HashMap;

use cannabis_market::job::{Escrowed, Failure, JobState, ProductVerdict, TaskStatus};
use cannabis_market::ledger::{Ledger, Stage};
use cannabis_market::testkit::net::{Net, Node};
use cannabis_market::testkit::{self, Machine};
use cannabis_market::{Command, MarketConfig, MarketEvent, RunOrder, Settle};
use cannabis_protocol::*;

use crate::lifecycle::{T0, WINDOW, identity, network, submit};

const PRICE_BUDGET: u64 = 1_000_000;
const SEQUENCER: u64 = 0x5e9;
const RESOLVER: u64 = 0x7e5;

fn settled_config() -> MarketConfig {
    MarketConfig {
        resolver: Some(testkit::keys(RESOLVER).address()),
        ..crate::lifecycle::config()
    }
}

/// A ledger whose genesis funds node 0 (the requester) with `requester_funds` and node 1
/// (the worker) with enough for its network fees.
fn ledger(requester_funds: u64) -> Ledger {
    let supply = 10_000_000_000;
    let worker_funds = 1_000_000;
    Ledger::new(Genesis {
        network: "settle-tests".into(),
        time: Timestamp(T0.0 - 1_000),
        sequencer: testkit::keys(SEQUENCER).address(),
        fee: testkit::fee_terms(),
        resolver: testkit::keys(RESOLVER).address(),
        min_gas_price: 1,
        supply: Amount(supply),
        accounts: vec![
            Allocation {
                address: testkit::keys(0).address(),
                amount: Amount(requester_funds),
            },
            Allocation {
                address: testkit::keys(1).address(),
                amount: Amount(worker_funds),
            },
            Allocation {
                address: testkit::keys(SEQUENCER).address(),
                amount: Amount(supply - requester_funds - worker_funds),
            },
        ],
        vesting: Vec::new(),
        faucet: None,
        rewards: Rewards {
            pool: Amount(0),
            per_block: Amount(0),
            seed_window: 4,
        },
        block_interval_ms: 100,
        max_block_txs: 1_000,
    })
    .unwrap()
}

/// A node's driver for settlement: signs each order as a transaction of that node's and
/// puts it in the next block.
struct Chain {
    ledger: Ledger,
    nonces: HashMap<Address, u64>,
}

impl Chain {
    /// Signs and applies, in one block at `now`, what the nodes asked of settlement;
    /// returns what the block left out.
    fn block(&mut self, net: &mut Net, now: Timestamp) -> Vec<String> {
        let mut txs = Vec::new();
        for (i, node) in net.nodes.iter_mut().enumerate() {
            let keys = testkit::keys(i as u64);
            for order in node.settles.drain(..) {
                let (amount, payload) = order.into_payload();
                let nonce = self.nonces.entry(keys.address()).or_default();
                let tx =
                    Transaction::new(keys.address(), None, amount, *nonce, 1, payload).unwrap();
                *nonce += 1;
                txs.push((Signed::sign(&keys, &tx), tx));
            }
        }
        let proposal = self.ledger.propose(now, txs);
        let block = Block::build(
            &testkit::keys(SEQUENCER),
            self.ledger.height() + 1,
            self.ledger.tip(),
            now,
            proposal.txs,
        )
        .unwrap();
        self.ledger.apply_block(&block, now).unwrap();
        for (s, _) in &proposal.refused {
            // A refused transaction leaves its nonce unused.
            let tx = s.verify().unwrap().body;
            self.nonces.insert(tx.from_address, tx.nonce);
        }
        proposal
            .refused
            .iter()
            .map(|(_, why)| why.to_string())
            .collect()
    }

    fn balance(&self, a: &Address) -> u64 {
        self.ledger.account(a).balance.0
    }
}

/// A requester (node 0) with `funds` and one worker; one job of one rank submitted at T0
/// and its bid window ended.
fn world(funds: u64) -> (Net, Chain, Uuid, Timestamp) {
    world_evaluated(funds, None)
}

/// [`world`] for a job with `evaluation` terms.
fn world_evaluated(
    funds: u64,
    evaluation: Option<(Vec<AcceptanceMetric>, EvaluationTerms)>,
) -> (Net, Chain, Uuid, Timestamp) {
    let nodes = (0..2)
        .map(|i| Node::new(settled_config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, |_| Machine::default());
    let mut template = testkit::template(
        vec![testkit::task("t", 1, 0, 0, 1, PRICE_BUDGET)],
        WINDOW,
        3_600_000,
    );
    if let Some((acceptance, terms)) = evaluation {
        template.acceptance = acceptance;
        template.evaluation = Some(terms);
    }
    let job = submit(&mut net, template, [7; 16]);
    net.settle(T0);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    let chain = Chain {
        ledger: ledger(funds),
        nonces: HashMap::new(),
    };
    (net, chain, job, end)
}

/// Drains every node (what the commands caused) and delivers it all at `now`.
fn step(net: &mut Net, now: Timestamp) {
    net.drain_all(now);
    net.settle(now);
}

/// The outputs every (synthetic) run here delivers: its result and its product.
fn results() -> Vec<OutputDigest> {
    [(SYNTHETIC_RESULT, 32), (SYNTHETIC_PRODUCT, 4096)]
        .into_iter()
        .map(|(name, size)| OutputDigest {
            name: name.into(),
            digest: Digest::of(name.as_bytes()),
            size_bytes: size,
            cipher_size: size + 200,
            cipher_root: Digest::of(b"root"),
        })
        .collect()
}

/// The worker's attempt `id` completed with [`result`]: its manifest goes out.
fn prepared(net: &mut Net, id: String, now: Timestamp) {
    net.nodes[1]
        .market
        .command(
            now,
            Command::Prepared {
                request_id: id,
                outputs: results(),
                usage: ResourceUsage::default(),
                exit_code: Some(0),
                hardware: "test".into(),
            },
        )
        .unwrap();
    step(net, now);
}

/// The requester fetched and checked rank 0's outputs (epoch 1).
fn fetched(net: &mut Net, job: Uuid, now: Timestamp) {
    net.nodes[0]
        .market
        .command(
            now,
            Command::Delivered {
                job,
                task: 0,
                rank: 0,
                epoch: 1,
                outputs: results()
                    .into_iter()
                    .map(|r| NamedDigest {
                        name: r.name,
                        digest: r.digest,
                    })
                    .collect(),
            },
        )
        .unwrap();
}

fn awarded(net: &Net) -> bool {
    net.nodes[0]
        .events
        .iter()
        .any(|e| matches!(e, MarketEvent::Awarded { .. }))
}

#[test]
fn the_ranks_of_a_group_awarded_together_are_assigned_in_one_transaction() {
    let (net, orders) = group_assigned(3);
    let workers: Vec<Address> = (1..4).map(|i| net.nodes[i].address()).collect();
    match orders.as_slice() {
        [Settle::AssignMany(many)] => {
            let ranks: Vec<(u32, u32, u64)> = many
                .assignments
                .iter()
                .map(|a| (a.task, a.rank, a.epoch))
                .collect();
            assert_eq!(ranks, [(0, 0, 1), (0, 1, 1), (0, 2, 1)]);
            let mut named: Vec<Address> = many.assignments.iter().map(|a| a.worker).collect();
            named.sort();
            let mut expected = workers.clone();
            expected.sort();
            assert_eq!(named, expected);
        }
        other => panic!("one transaction for the group's three awards: {other:?}"),
    }
}

#[test]
fn a_group_larger_than_one_transaction_holds_is_assigned_in_several() {
    let (_, orders) = group_assigned(60);
    let sizes: Vec<usize> = orders
        .iter()
        .map(|o| match o {
            Settle::AssignMany(many) => many.assignments.len(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        sizes,
        [
            cannabis_protocol::MAX_ASSIGNED,
            60 - cannabis_protocol::MAX_ASSIGNED
        ]
    );
}

/// A job of one task of `group` ranks, placed on `group` workers once its lock is in a
/// block: the requester's settlement orders for the awards, which a block then applies
/// (every rank assigned in the escrow).
fn group_assigned(group: u32) -> (Net, Vec<Settle>) {
    let nodes = (0..=u64::from(group))
        .map(|i| Node::new(settled_config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, |_| Machine::default());
    let template = testkit::template(
        vec![testkit::task(
            "t",
            1,
            0,
            0,
            group,
            u64::from(group) * PRICE_BUDGET,
        )],
        WINDOW,
        3_600_000,
    );
    let job = submit(&mut net, template, [8; 16]);
    net.settle(T0);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    let mut chain = Chain {
        ledger: ledger(1_000_000_000),
        nonces: HashMap::new(),
    };
    assert!(chain.block(&mut net, end).is_empty());
    net.nodes[0]
        .market
        .command(end, Command::Locked { job, refused: None })
        .unwrap();
    step(&mut net, end);
    let orders = net.nodes[0].settles.clone();
    assert!(chain.block(&mut net, end).is_empty());
    let e = chain.ledger.escrow(&job).unwrap();
    assert_eq!(e.assignments.len(), group as usize);
    (net, orders)
}

#[test]
fn no_award_before_the_lock_and_an_accepted_delivery_pays_worker_and_fee() {
    let (mut net, mut chain, job, end) = world(100_000_000);
    // The bid window ended with a bid in hand, but the lock is not in a block: no award.
    assert!(matches!(
        net.nodes[0].settles.as_slice(),
        [Settle::Lock(l)] if l.job_id == job && l.amount == Amount(PRICE_BUDGET)
    ));
    assert!(!awarded(&net), "{:?}", net.nodes[0].events);
    assert_eq!(
        *net.nodes[0].market.job(&job).unwrap().escrow(),
        Escrowed::Locking
    );
    let before = chain.balance(&net.nodes[0].address());
    assert!(chain.block(&mut net, end).is_empty());
    assert!(chain.ledger.escrow(&job).is_some());
    let gas = TxType::EscrowLock.gas_limit();
    assert_eq!(
        chain.balance(&net.nodes[0].address()),
        before - PRICE_BUDGET - gas
    );

    // Locked: the task is placed, and the award is assigned in the escrow.
    net.nodes[0]
        .market
        .command(end, Command::Locked { job, refused: None })
        .unwrap();
    step(&mut net, end);
    assert!(
        awarded(&net),
        "{:#?}",
        net.nodes[0].market.job(&job).unwrap().history()
    );
    let price = match net.nodes[0].settles.as_slice() {
        [Settle::Assign(a)] => {
            assert_eq!((a.task, a.rank, a.epoch), (0, 0, 1));
            assert_eq!(a.worker, net.nodes[1].address());
            a.price
        }
        other => panic!("{other:?}"),
    };
    assert!(chain.block(&mut net, end).is_empty());

    // The worker runs it and delivers: its delivery is committed.
    let id = RunOrder::request_id(&(job, 0, 0), 1);
    assert!(net.nodes[1].runs.iter().any(|o| matches!(o,
        RunOrder::Start { request_id, .. } if *request_id == id)));
    prepared(&mut net, id, end);
    let manifest = net.nodes[0].fetches[0].clone().open().unwrap();
    assert!(matches!(
        net.nodes[1].settles.as_slice(),
        [Settle::Commit(c)] if c.manifest == manifest.id && c.epoch == 1
    ));
    assert!(chain.block(&mut net, end).is_empty());
    assert!(matches!(
        chain.ledger.escrow(&job).unwrap().assignments[&(0, 0)].stage,
        Stage::Delivered { .. }
    ));

    // Nothing delivered to the requester yet: nothing to accept.
    fetched(&mut net, job, end);
    step(&mut net, end);
    assert_eq!(
        net.nodes[0].market.job(&job).unwrap().state(),
        JobState::Completed
    );

    // Accepted: the worker is paid the price less the 1% fee, the fee goes to the pinned
    // recipient, the rest of the lock comes back.
    let (requester, worker) = (net.nodes[0].address(), net.nodes[1].address());
    let recipient = testkit::fee_terms().recipient;
    let (r0, w0, f0) = (
        chain.balance(&requester),
        chain.balance(&worker),
        chain.balance(&recipient),
    );
    net.nodes[0]
        .market
        .command(
            end,
            Command::Accept {
                job,
                part_ppm: PPM_DENOMINATOR,
            },
        )
        .unwrap();
    step(&mut net, end);
    assert!(matches!(
        net.nodes[0].settles.as_slice(),
        [Settle::Accept(s)] if s.outcome == Outcome::Accepted && s.epoch == 1
    ));
    assert!(chain.block(&mut net, end).is_empty());
    let fee = fee_on(price, 100).unwrap().0;
    assert_eq!(fee, price.0 / 100);
    let gas = TxType::EscrowSettle.gas_limit();
    assert_eq!(chain.balance(&worker), w0 + price.0 - fee);
    assert_eq!(chain.balance(&recipient), f0 + fee);
    assert_eq!(
        chain.balance(&requester),
        r0 + (PRICE_BUDGET - price.0) - gas
    );
    let e = chain.ledger.escrow(&job).unwrap();
    assert_eq!(
        e.paid_worker.0 + e.paid_fee.0 + e.refunded.unwrap().0,
        e.locked.0
    );
    // The escrow as the API shows it: JSON, its assignments a list of entries.
    let json = serde_json::to_value(e).unwrap();
    assert_eq!(json["assignments"][0]["task"], 0);
    assert_eq!(json["assignments"][0]["stage"]["state"], "settled");
    let back: cannabis_market::ledger::Escrow = serde_json::from_value(json).unwrap();
    assert_eq!(&back, e);

    // Asking again moves nothing: the ledger refuses a second settlement.
    net.nodes[0]
        .market
        .command(
            end,
            Command::Accept {
                job,
                part_ppm: PPM_DENOMINATOR,
            },
        )
        .unwrap();
    step(&mut net, end);
    assert_eq!(chain.block(&mut net, end).len(), 1);
    assert_eq!(chain.balance(&worker), w0 + price.0 - fee);
}

#[test]
fn a_lock_refused_fails_the_job_without_an_award() {
    // The requester cannot pay its budget.
    let (mut net, mut chain, job, end) = world(1_000);
    let refused = chain.block(&mut net, end);
    assert_eq!(refused.len(), 1, "{refused:?}");
    net.nodes[0]
        .market
        .command(
            end,
            Command::Locked {
                job,
                refused: Some(refused[0].clone()),
            },
        )
        .unwrap();
    step(&mut net, end);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(j.state(), JobState::Failed);
    assert!(matches!(
        j.tasks()[0].status(),
        TaskStatus::Failed(Failure::NotLocked(_))
    ));
    assert!(!awarded(&net));
    assert!(net.nodes[1].runs.is_empty());
}

#[test]
fn a_dispute_freezes_the_money_past_the_review_window() {
    let (mut net, mut chain, job, end) = world(100_000_000);
    chain.block(&mut net, end);
    net.nodes[0]
        .market
        .command(end, Command::Locked { job, refused: None })
        .unwrap();
    step(&mut net, end);
    chain.block(&mut net, end);
    let id = RunOrder::request_id(&(job, 0, 0), 1);
    prepared(&mut net, id, end);
    chain.block(&mut net, end);
    // Before the delivery is checked there is nothing to dispute.
    let early = net.nodes[0].market.command(
        end,
        Command::Dispute {
            job,
            reason: "wrong".into(),
        },
    );
    assert!(early.is_err(), "{early:?}");
    fetched(&mut net, job, end);
    net.nodes[0]
        .market
        .command(
            end,
            Command::Dispute {
                job,
                reason: "the loss did not fall".into(),
            },
        )
        .unwrap();
    step(&mut net, end);
    assert!(matches!(
        net.nodes[0].settles.as_slice(),
        [Settle::Dispute(s)] if s.epoch == 1
    ));
    assert!(chain.block(&mut net, end).is_empty());
    let worker = net.nodes[1].address();
    let w0 = chain.balance(&worker);
    // Long past the review window: still frozen, nothing paid.
    let later = end.plus_ms(10 * 60_000);
    chain.block(&mut net, later);
    let e = chain.ledger.escrow(&job).unwrap();
    assert!(matches!(
        e.assignments[&(0, 0)].stage,
        Stage::Disputed { .. }
    ));
    assert_eq!(chain.balance(&worker), w0);
    assert!(
        net.nodes[0]
            .market
            .job(&job)
            .unwrap()
            .history()
            .iter()
            .any(|h| h.text.contains("the loss did not fall"))
    );
}

#[test]
fn a_restart_while_locking_asks_for_the_lock_again() {
    let (mut net, _chain, job, end) = world(100_000_000);
    net.nodes[0].settles.clear();
    net.nodes[0].restart(end);
    net.nodes[0].drain(end);
    assert!(matches!(
        net.nodes[0].settles.as_slice(),
        [Settle::Lock(l)] if l.job_id == job
    ));
}

/// Locks, runs and fetches rank 0 of a synthetic job; returns the check the engine asked
/// for.
fn delivered_and_checking(
    net: &mut Net,
    chain: &mut Chain,
    job: Uuid,
    end: Timestamp,
) -> cannabis_market::ProductCheck {
    chain.block(net, end);
    net.nodes[0]
        .market
        .command(end, Command::Locked { job, refused: None })
        .unwrap();
    step(net, end);
    chain.block(net, end);
    prepared(net, RunOrder::request_id(&(job, 0, 0), 1), end);
    chain.block(net, end);
    assert!(
        net.nodes[0].checks.is_empty(),
        "nothing to check before the fetch"
    );
    fetched(net, job, end);
    step(net, end);
    let award = net.nodes[0].market.job(&job).unwrap().tasks()[0].ranks()[0].award;
    match net.nodes[0].checks.as_slice() {
        [c] => {
            assert_eq!((c.job, c.task, c.rank, c.epoch), (job, 0, 0, 1));
            assert_eq!(c.seed, RunOrder::seed(&award));
            assert_eq!(c.n, SYNTHETIC_DEFAULT_N);
            c.clone()
        }
        other => panic!("one check expected, got {other:?}"),
    }
}

/// A delivered synthetic product that fails its check is disputed at once: the review
/// window never pays for it, and a repeated verdict changes nothing.
#[test]
fn a_wrong_synthetic_product_is_disputed_and_never_paid() {
    let (mut net, mut chain, job, end) = world(100_000_000);
    let check = delivered_and_checking(&mut net, &mut chain, job, end);
    net.nodes[0].settles.clear();
    let verdict = || Command::ProductChecked {
        job,
        task: 0,
        rank: 0,
        epoch: check.epoch,
        verdict: ProductVerdict::Failed("the product is not A * B (Freivalds' check)".into()),
    };
    net.nodes[0].market.command(end, verdict()).unwrap();
    step(&mut net, end);
    assert!(matches!(
        net.nodes[0].settles.as_slice(),
        [Settle::Dispute(s)] if (s.task, s.rank, s.epoch) == (0, 0, 1)
    ));
    net.nodes[0].market.command(end, verdict()).unwrap();
    step(&mut net, end);
    assert_eq!(
        net.nodes[0].settles.len(),
        1,
        "a repeated verdict disputes again"
    );
    assert!(chain.block(&mut net, end).is_empty());
    let worker = net.nodes[1].address();
    let before = chain.balance(&worker);
    chain.block(&mut net, end.plus_ms(3 * 3_600_000));
    assert!(matches!(
        chain.ledger.escrow(&job).unwrap().assignments[&(0, 0)].stage,
        Stage::Disputed { .. }
    ));
    assert_eq!(chain.balance(&worker), before, "paid for a wrong product");
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(
        j.tasks()[0].ranks()[0].product,
        Some(ProductVerdict::Failed(
            "the product is not A * B (Freivalds' check)".into()
        ))
    );
    assert!(
        j.history()
            .iter()
            .any(|h| h.text.contains("product is wrong"))
    );
}

/// A product that passes is noted and waits for the requester (or the review window); a
/// restart before the verdict asks for the check again, and not after it.
#[test]
fn a_checked_product_is_noted_and_a_restart_checks_again_until_then() {
    let (mut net, mut chain, job, end) = world(100_000_000);
    let check = delivered_and_checking(&mut net, &mut chain, job, end);
    net.nodes[0].checks.clear();
    net.nodes[0].restart(end);
    net.nodes[0].drain(end);
    assert_eq!(net.nodes[0].checks, vec![check.clone()]);
    net.nodes[0].settles.clear();
    net.nodes[0]
        .market
        .command(
            end,
            Command::ProductChecked {
                job,
                task: 0,
                rank: 0,
                epoch: 1,
                verdict: ProductVerdict::Passed,
            },
        )
        .unwrap();
    step(&mut net, end);
    assert!(
        net.nodes[0].settles.is_empty(),
        "a pass settles nothing by itself"
    );
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(
        j.tasks()[0].ranks()[0].product,
        Some(ProductVerdict::Passed)
    );
    assert!(
        j.history()
            .iter()
            .any(|h| h.text.contains("product checked"))
    );
    net.nodes[0].checks.clear();
    net.nodes[0].restart(end);
    net.nodes[0].drain(end);
    assert!(
        net.nodes[0].checks.is_empty(),
        "checked again after its verdict"
    );
}

fn evaluation_terms(confirm: bool) -> (Vec<AcceptanceMetric>, EvaluationTerms) {
    (
        vec![AcceptanceMetric {
            name: "accuracy".into(),
            comparison: Comparison::AtLeast,
            threshold: Fixed(900_000),
            baseline: None,
        }],
        EvaluationTerms {
            evaluator: Digest::of(b"evaluator"),
            entrypoint: vec!["sh".into(), "evaluate.sh".into()],
            held_out: vec![NamedDigest {
                name: "heldout.bin".into(),
                digest: Digest::of(b"held out"),
            }],
            configuration: Vec::new(),
            limits: EvaluationLimits {
                wall_ms: 60_000,
                memory_bytes: 1 << 30,
                max_input_bytes: 1 << 30,
            },
            artifacts: Vec::new(),
            confirm,
        },
    )
}

/// The requester's signed report of evaluation `run` of `order`, with `outcome`.
fn report(
    signer: u64,
    order: &cannabis_market::EvaluationOrder,
    outcome: EvaluationOutcome,
) -> Box<Signed<Evaluation>> {
    let value = if outcome == EvaluationOutcome::Passed {
        950_000
    } else {
        500_000
    };
    let (criteria, _) = judge(
        &evaluation_terms(false).0,
        &[MetricValue {
            name: "accuracy".into(),
            value: Fixed(value),
        }],
    );
    Box::new(Signed::sign(
        &testkit::keys(signer),
        &Evaluation {
            job_id: order.job,
            requester: testkit::keys(signer).address(),
            evaluator: order.terms.evaluator,
            held_out: order.terms.held_out.clone(),
            deliveries: order.deliveries.iter().map(|(d, _)| *d).collect(),
            inputs: Vec::new(),
            metrics: Vec::new(),
            criteria,
            outcome,
            reason: "the test says so".into(),
            issued_at: T0,
        },
    ))
}

/// The evaluation asked for once every task delivered, again after a restart until its
/// report is kept, and not after; a report of another run or another signer changes
/// nothing; a failed report disputes, and a pass of a run by hand accepts.
#[test]
fn an_evaluation_disputes_a_failure_and_accepts_a_pass() {
    let (mut net, mut chain, job, end) =
        world_evaluated(100_000_000, Some(evaluation_terms(false)));
    delivered_and_checking(&mut net, &mut chain, job, end);
    let order = match net.nodes[0].evaluations.as_slice() {
        [o] => o.clone(),
        other => panic!("one evaluation expected, got {other:?}"),
    };
    assert_eq!((order.job, order.run), (job, 1));
    assert_eq!(order.deliveries.len(), 1);
    assert_eq!(
        (order.deliveries[0].0.task, order.deliveries[0].0.epoch),
        (0, 1)
    );
    assert_eq!(order.deliveries[0].1, results());
    net.nodes[0].evaluations.clear();
    net.nodes[0].restart(end);
    net.nodes[0].drain(end);
    assert_eq!(net.nodes[0].evaluations, vec![order.clone()]);

    net.nodes[0].settles.clear();
    let evaluated = |run: u32, report| Command::Evaluated { job, run, report };
    // Another run's report, or one the requester did not sign: nothing moves.
    net.nodes[0]
        .market
        .command(
            end,
            evaluated(2, report(0, &order, EvaluationOutcome::Failed)),
        )
        .unwrap();
    assert!(
        net.nodes[0]
            .market
            .command(
                end,
                evaluated(1, report(1, &order, EvaluationOutcome::Passed))
            )
            .is_err()
    );
    step(&mut net, end);
    assert!(
        net.nodes[0].settles.is_empty(),
        "{:?}",
        net.nodes[0].settles
    );

    net.nodes[0]
        .market
        .command(
            end,
            evaluated(1, report(0, &order, EvaluationOutcome::Failed)),
        )
        .unwrap();
    step(&mut net, end);
    assert!(matches!(
        net.nodes[0].settles.as_slice(),
        [Settle::Dispute(s)] if (s.task, s.rank, s.epoch) == (0, 0, 1)
    ));
    let j = net.nodes[0].market.job(&job).unwrap();
    assert!(
        j.history()
            .iter()
            .any(|h| h.text.starts_with("disputed") && h.text.contains("evaluation run 1")),
        "{:#?}",
        j.history()
    );
    net.nodes[0].evaluations.clear();
    net.nodes[0].restart(end);
    net.nodes[0].drain(end);
    assert!(
        net.nodes[0].evaluations.is_empty(),
        "asked again after its report"
    );

    // By hand: a new run, whose pass accepts.
    net.nodes[0].settles.clear();
    net.nodes[0]
        .market
        .command(end, Command::Evaluate(job))
        .unwrap();
    step(&mut net, end);
    let again = net.nodes[0].evaluations.last().unwrap().clone();
    assert_eq!(again.run, 2);
    net.nodes[0]
        .market
        .command(
            end,
            evaluated(2, report(0, &again, EvaluationOutcome::Passed)),
        )
        .unwrap();
    step(&mut net, end);
    assert!(matches!(
        net.nodes[0].settles.as_slice(),
        [Settle::Accept(s)] if s.outcome == Outcome::Accepted
    ));
}

/// Terms that ask for the requester's confirmation: a pass settles nothing by itself; a
/// job without terms cannot be evaluated by hand.
#[test]
fn a_pass_waits_for_confirmation_when_the_terms_say_so() {
    let (mut net, mut chain, job, end) = world_evaluated(100_000_000, Some(evaluation_terms(true)));
    delivered_and_checking(&mut net, &mut chain, job, end);
    let order = net.nodes[0].evaluations[0].clone();
    net.nodes[0].settles.clear();
    net.nodes[0]
        .market
        .command(
            end,
            Command::Evaluated {
                job,
                run: 1,
                report: report(0, &order, EvaluationOutcome::Passed),
            },
        )
        .unwrap();
    step(&mut net, end);
    assert!(net.nodes[0].settles.is_empty());
    let j = net.nodes[0].market.job(&job).unwrap();
    assert!(j.history().iter().any(|h| h.text.contains("confirmation")));

    let (mut net, _chain, job, end) = world(100_000_000);
    assert!(matches!(
        net.nodes[0].market.command(end, Command::Evaluate(job)),
        Err(cannabis_market::CommandError::NoEvaluation(_))
    ));
    net.nodes[0].drain(end);
    assert!(net.nodes[0].evaluations.is_empty());
}
