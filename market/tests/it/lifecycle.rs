//! The market engine end to end, requester and workers together, every message signed and
//! checked: placement, leases with epochs, renewals, retries within the budget, group
//! ranks, cancellation and task graphs. Then property tests with random message orders,
//! duplicates, losses, delays, clock jumps and restarts from the store.

use cannabis_market::job::{
    Cancellation, Failure, Job, JobState, LeaseConfig, LeaseState, TaskStatus,
};
use cannabis_market::placement::Infeasible;
use cannabis_market::quote::WorkerPolicy;
use cannabis_market::testkit::net::{Envelope, Net, Node};
use cannabis_market::testkit::{self, Machine};
use cannabis_market::{
    Command, CommandError, Identity, Inbound, MarketConfig, MarketEvent, OutboundId, Refusal,
};
use cannabis_protocol::*;
use proptest::prelude::*;

pub(crate) const T0: Timestamp = Timestamp(1_000_000_000);
pub(crate) const WINDOW: u64 = 10_000;

struct World {
    net: Net,
    job: Uuid,
}

fn machine(n: u64) -> Machine {
    Machine {
        cores: 8,
        cpu_core_hour: 10 + n,
        ..Machine::default()
    }
}

pub(crate) fn identity(n: u64) -> Identity {
    Identity {
        address: testkit::keys(n).address(),
        delivery: DeliveryIdentity::from_secret([2; 32]).recipient(),
    }
}

pub(crate) fn config() -> MarketConfig {
    MarketConfig {
        worker: WorkerPolicy {
            max_leases: 16,
            ..WorkerPolicy::default()
        },
        fee: Some(testkit::fee_terms()),
        ..MarketConfig::default()
    }
}

/// A requester (node 0), `n` workers with distinct prices whose ads it holds, and one job
/// of `tasks` submitted at `T0`: the offer reached every worker and they answered.
fn world(n: u64, tasks: Vec<TaskSpec>) -> World {
    let nodes = (0..=n)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, machine);
    let job = submit(
        &mut net,
        testkit::template(tasks, WINDOW, 3_600_000),
        [7; 16],
    );
    net.settle(T0);
    World { net, job }
}

/// Nodes whose workers (all but node 0) published their ads (machine `machine(i)` for
/// node `i`) and every node heard them.
pub(crate) fn network(nodes: Vec<Node>, machine: impl Fn(u64) -> Machine) -> Net {
    let mut net = Net::new(nodes);
    for i in 1..net.nodes.len() {
        let a = net.nodes[i].address();
        let env = net.nodes[i].publish_ad(T0, testkit::ad(a, &machine(i as u64), T0));
        net.queue.extend(env);
    }
    net.settle(T0);
    net
}

/// Node 0 submits `template` at `T0`; its offer waits in the queue.
pub(crate) fn submit(
    net: &mut Net,
    template: cannabis_market::OfferTemplate,
    nonce: [u8; 16],
) -> Uuid {
    let ok = net.nodes[0]
        .market
        .command(T0, Command::Submit { template, nonce })
        .unwrap();
    let cannabis_market::CommandOk::Submitted { job, .. } = ok else {
        panic!("{ok:?}")
    };
    net.drain(0, T0);
    job
}

impl World {
    /// `worker` signs an acceptance of task 0, rank 0 at `epoch` naming an award the
    /// requester never sent, and sends it.
    fn accept_unsent_award(&mut self, worker: Address, epoch: u64, now: Timestamp) {
        let i = self
            .net
            .nodes
            .iter()
            .position(|n| n.address() == worker)
            .unwrap();
        let accept = LeaseAccept {
            award: Digest::of(b"an award nobody sent"),
            job_id: self.job,
            task: 0,
            rank: 0,
            worker,
            epoch,
            issued_at: now,
        };
        let requester = self.net.nodes[0].address();
        let signed = Signed::sign(&testkit::keys(i as u64), &accept);
        self.request(
            worker,
            requester,
            Inbound::Accept(signed.open().unwrap()),
            now,
        );
    }

    fn job(&self) -> &Job {
        self.net.nodes[0].market.job(&self.job).unwrap()
    }

    fn status(&self, task: usize) -> TaskStatus {
        self.job().tasks()[task].status().clone()
    }

    fn worker(&self, a: &Address) -> &Node {
        self.net.nodes.iter().find(|n| n.address() == *a).unwrap()
    }

    /// Awards in flight, in order.
    fn awards(&self) -> Vec<Award> {
        self.net
            .queue
            .iter()
            .filter_map(|e| match e {
                Envelope::Request { msg, .. } => match &**msg {
                    Inbound::Award(a) => Some(a.body.clone()),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }

    fn command(&mut self, now: Timestamp, c: Command) -> Result<(), CommandError> {
        let r = self.net.nodes[0].market.command(now, c).map(|_| ());
        self.net.drain(0, now);
        r
    }

    fn delivered(
        &mut self,
        now: Timestamp,
        task: u32,
        rank: u32,
        epoch: u64,
    ) -> Result<(), CommandError> {
        self.command(
            now,
            Command::Delivered {
                job: self.job,
                task,
                rank,
                epoch,
                outputs: Vec::new(),
            },
        )
    }

    fn failed(
        &mut self,
        now: Timestamp,
        task: u32,
        rank: u32,
        epoch: u64,
    ) -> Result<(), CommandError> {
        self.command(
            now,
            Command::RankFailed {
                job: self.job,
                task,
                rank,
                epoch,
                reason: "crashed".into(),
            },
        )
    }

    /// Delivers `msg` from `from` to `to` as a directed request, and everything it causes.
    fn request(&mut self, from: Address, to: Address, msg: Inbound, now: Timestamp) {
        self.net.queue.push(Envelope::Request {
            from,
            to,
            req: OutboundId(9_999),
            msg: Box::new(msg),
        });
        self.net.settle(now);
    }

    fn is_current(
        &self,
        worker: &Address,
        key: &(Uuid, u32, u32),
        epoch: u64,
        now: Timestamp,
    ) -> bool {
        self.worker(worker)
            .market
            .leases()
            .is_current(key, epoch, now)
    }
}

#[test]
fn a_job_is_placed_on_the_cheapest_bid_and_leased() {
    let mut w = world(5, vec![testkit::task("t", 2, 0, 0, 1, 100_000)]);
    assert_eq!(w.job().tasks()[0].bid_count(), 5, "every worker bid");
    w.net.tick(T0.plus_ms(WINDOW - 1));
    assert!(w.awards().is_empty(), "the bid window is open");
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    let awards = w.awards();
    let award = awards[0].clone();
    // Worker 1 has the lowest price.
    assert_eq!(award.worker, w.net.nodes[1].address());
    assert_eq!((award.rank, award.epoch), (0, 1));
    assert!(award.rendezvous.is_none());
    w.net.settle(now);
    assert_eq!(w.status(0), TaskStatus::Running);
    let key = (w.job, 0, 0);
    assert!(w.is_current(&award.worker, &key, 1, now));
    // Renewals keep it current past the first lease.
    let mut t = now;
    for _ in 0..10 {
        t = t.plus_ms(20_000);
        w.net.tick(t);
        w.net.settle(t);
        assert!(
            w.is_current(&award.worker, &key, 1, t),
            "lease lapsed at {t}"
        );
    }
    w.delivered(t, 0, 0, 1).unwrap();
    // The delivered lease is released at once: the worker's slot is free again.
    w.net.settle(t);
    assert!(w.net.queue.is_empty());
    assert!(!w.is_current(&award.worker, &key, 1, t));
    assert_eq!(w.job().state(), JobState::Completed);
    assert_eq!(w.job().tasks()[0].spent(), award.price);
    assert_eq!(w.job().refund().unwrap().0, 100_000 - award.price.0);
    // Every message was signed and checked: nobody refused anything.
    assert!(w.net.nodes.iter().all(|n| n.refusals.is_empty()));
}

#[test]
fn a_group_gets_ranks_and_a_shared_roster() {
    let mut w = world(5, vec![testkit::task("g", 1, 0, 0, 3, 300_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    let awards = w.awards();
    assert_eq!(awards.len(), 3);
    let roster = awards[0].rendezvous.clone().unwrap();
    for (i, a) in awards.iter().enumerate() {
        assert_eq!(a.rank, i as u32);
        assert_eq!(a.rendezvous.as_ref(), Some(&roster));
        assert_eq!(roster.roster[i].worker, a.worker);
    }
    // The three cheapest workers, cheapest first.
    let chosen: Vec<Address> = awards.iter().map(|a| a.worker).collect();
    let expected: Vec<Address> = (1..=3).map(|i| w.net.nodes[i].address()).collect();
    assert_eq!(chosen, expected);
    w.net.settle(now);
    assert_eq!(w.status(0), TaskStatus::Running);
    // Cancelling reaches every rank.
    w.command(now, Command::Cancel(w.job)).unwrap();
    let cancels = w
        .net
        .queue
        .iter()
        .filter(
            |e| matches!(e, Envelope::Request { msg, .. } if matches!(**msg, Inbound::Cancel(_))),
        )
        .count();
    assert_eq!(cancels, 3);
    w.net.settle(now);
    for (i, a) in chosen.iter().enumerate() {
        assert!(!w.is_current(a, &(w.job, 0, i as u32), 1, now));
    }
    assert_eq!(w.job().state(), JobState::Cancelled);
    assert_eq!(w.job().refund().unwrap(), Amount(300_000));
    // A second cancel is refused with the state.
    assert!(matches!(
        w.command(now, Command::Cancel(w.job)),
        Err(CommandError::JobOver { .. })
    ));
}

/// Renewals in the queue, by rank.
fn renewals(net: &Net) -> Vec<u32> {
    net.queue
        .iter()
        .filter_map(|e| match e {
            Envelope::Request { msg, .. } => match &**msg {
                Inbound::Renewal(r) => Some(r.body.rank),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn a_group_is_renewed_once_every_rank_holds_its_lease() {
    let mut w = world(5, vec![testkit::task("g", 1, 0, 0, 3, 300_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    assert_eq!(w.awards().len(), 3);
    // Ranks 0 and 1 countersign; rank 2's award is still on its way.
    let late = w.net.queue.remove(2);
    w.net.settle(now);
    assert_eq!(w.job().tasks()[0].ranks()[0].state, LeaseState::Current);
    assert_eq!(w.job().tasks()[0].ranks()[1].state, LeaseState::Current);
    assert_eq!(
        renewals(&w.net),
        Vec::<u32>::new(),
        "nothing renewed while the group assembles"
    );
    // Rank 2 countersigns: the three renewals go out together.
    w.net.queue.push(late);
    w.net.run(now, |_| false, 2);
    assert_eq!(w.status(0), TaskStatus::Running);
    assert_eq!(renewals(&w.net), vec![0, 1, 2]);
    w.net.settle(now);
    for r in w.job().tasks()[0].ranks() {
        assert!(r.expires_at > now.plus_ms(LeaseConfig::default().award_timeout_ms));
    }
}

#[test]
fn a_rank_waits_only_so_long_for_its_group_before_it_is_renewed() {
    let mut w = world(5, vec![testkit::task("g", 1, 0, 0, 3, 300_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    // Rank 2's award is lost; ranks 0 and 1 countersign.
    w.net.queue.remove(2);
    w.net.settle(now);
    let wake = now.plus_ms(cannabis_market::job::GROUP_RENEWAL_WAIT_MS);
    assert!(w.net.nodes[0].market.poll_timeout().unwrap() <= wake);
    w.net.tick(Timestamp(wake.0 - 1));
    assert_eq!(renewals(&w.net), Vec::<u32>::new());
    w.net.tick(wake);
    assert_eq!(
        renewals(&w.net),
        vec![0, 1],
        "renewed before the award's own expiry"
    );
    w.net.settle(wake);
    let award_expiry = now.plus_ms(LeaseConfig::default().award_timeout_ms);
    for r in &w.job().tasks()[0].ranks()[..2] {
        assert!(r.expires_at > award_expiry);
    }
}

#[test]
fn an_unanswered_award_is_retried_with_a_new_epoch_elsewhere() {
    let mut w = world(3, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    let lost = w.net.queue.remove(0);
    let Envelope::Request { msg, .. } = &lost else {
        panic!("{lost:?}")
    };
    let Inbound::Award(a1) = &**msg else {
        panic!("{lost:?}")
    };
    let a1 = a1.body.clone();
    // The worker never got it; after the award timeout the task goes elsewhere.
    let later = now.plus_ms(LeaseConfig::default().award_timeout_ms);
    w.net.nodes[0]
        .market
        .handle(later, cannabis_market::Input::Tick);
    w.net.drain(0, later);
    let a2 = w.awards()[0].clone();
    assert_ne!(a2.worker, a1.worker);
    assert_eq!(a2.epoch, 2, "a retry gets a new epoch");
    assert_eq!(w.job().tasks()[0].attempts(), 2);
    assert_eq!(w.job().tasks()[0].committed(), a2.price);
    // The lost award turns up late (still before its expiry on the first worker's clock):
    // that worker countersigns it, and the requester refuses the stale epoch.
    w.net.queue.insert(0, lost);
    w.net.deliver(0, now.plus_ms(1), false);
    w.net.settle(later);
    assert!(
        w.net.nodes[0]
            .refusals
            .contains(&Refusal::StaleEpoch { got: 1, current: 2 }),
        "{:?}",
        w.net.nodes[0].refusals
    );
    // So is a delivery report for it.
    assert!(matches!(
        w.delivered(later, 0, 0, 1),
        Err(CommandError::Refused(Refusal::StaleEpoch { .. }))
    ));
    assert!(w.is_current(&a2.worker, &(w.job, 0, 0), 2, later));
}

#[test]
fn a_worker_that_stops_acknowledging_renewals_loses_the_task() {
    let mut w = world(3, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    let first = w.awards()[0].clone();
    w.net.settle(now);
    assert_eq!(w.status(0), TaskStatus::Running);
    // From here the worker is gone: renewals are sent but never acknowledged.
    let gone = first.worker;
    let mut t = now;
    let mut moved = None;
    for _ in 0..100 {
        t = t.plus_ms(1_000);
        w.net.tick(t);
        moved = w.awards().into_iter().find(|a| a.epoch == 2);
        w.net
            .run(t, |e| e.to() == Some(gone) || e.from() == gone, 10_000);
        if moved.is_some() {
            break;
        }
    }
    let second = moved.expect("the task moved");
    assert_ne!(second.worker, first.worker);
    assert!(w.job().history().iter().any(|e| e.text.contains("expired")));
}

#[test]
fn retries_stop_at_the_attempt_limit() {
    // Five workers; each run fails after its lease became current; three failures allowed.
    let mut w = world(5, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    let mut now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    for attempt in 1..=3 {
        let award = w
            .awards()
            .first()
            .cloned()
            .unwrap_or_else(|| panic!("attempt {attempt}"));
        assert_eq!(award.epoch, attempt);
        w.net.settle(now);
        now = now.plus_ms(1000);
        w.failed(now, 0, 0, award.epoch).unwrap();
        assert!(w.job().used().unwrap() <= w.job().offer().budget);
    }
    assert_eq!(
        w.status(0),
        TaskStatus::Failed(Failure::GaveUp { failures: 3 })
    );
    assert_eq!(w.job().state(), JobState::Failed);
    assert_eq!(
        w.job().refund().unwrap(),
        Amount(100_000),
        "nothing delivered, nothing spent"
    );
}

#[test]
fn a_group_retry_must_fit_what_is_left_of_the_budget() {
    // A group of 2 with just enough budget for one run: rank 0 delivers and is paid, rank 1
    // fails, and re-placing both ranks would cost more than is left.
    let mut w = world(4, vec![testkit::task("g", 1, 0, 0, 2, 30)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    w.net.settle(now);
    assert_eq!(w.status(0), TaskStatus::Running);
    w.delivered(now, 0, 0, 1).unwrap();
    let paid = w.job().tasks()[0].spent();
    w.failed(now, 0, 1, 1).unwrap();
    assert!(
        matches!(
            w.status(0),
            TaskStatus::Failed(Failure::Unplaceable {
                why: Infeasible::OverBudget { .. },
                ..
            })
        ),
        "{:?}",
        w.status(0)
    );
    assert_eq!(w.job().tasks()[0].spent(), paid);
    assert_eq!(w.job().tasks()[0].committed(), Amount(0));
    assert_eq!(w.job().refund().unwrap().0, 30 - paid.0);
}

#[test]
fn nobody_matching_fails_with_the_reason() {
    // Needs a GPU; the simulated workers have none, so nobody bids.
    let mut w = world(4, vec![testkit::task("t", 1, 1, 24, 1, 100_000)]);
    w.net.tick(T0.plus_ms(WINDOW));
    assert_eq!(
        w.status(0),
        TaskStatus::Failed(Failure::Unplaceable {
            why: Infeasible::NoBids,
            declined: 0
        })
    );
    assert_eq!(
        w.status(0).to_string(),
        "failed: cannot be placed: no valid bids"
    );
    // A group larger than the compatible set also fails, with the sizes.
    let mut w = world(2, vec![testkit::task("g", 1, 0, 0, 3, 300_000)]);
    w.net.tick(T0.plus_ms(WINDOW));
    assert_eq!(
        w.status(0),
        TaskStatus::Failed(Failure::Unplaceable {
            why: Infeasible::TooFewCompatible {
                needed: 3,
                largest: 2
            },
            declined: 0
        })
    );
}

#[test]
fn prices_above_the_share_are_declined_with_a_reason() {
    let mut w = world(2, vec![testkit::task("t", 8, 0, 0, 1, 5)]);
    let declines = w.job().tasks()[0].declines().clone();
    assert_eq!(declines.len(), 2);
    assert!(
        declines
            .values()
            .all(|r| r.contains("above the task's budget"))
    );
    w.net.tick(T0.plus_ms(WINDOW));
    assert_eq!(
        w.status(0).to_string(),
        "failed: cannot be placed: no valid bids (2 declined)"
    );
}

#[test]
fn a_failed_task_stops_its_dependants_and_refunds_them() {
    let mut train = testkit::task("train", 1, 0, 0, 1, 100_000);
    let mut eval = testkit::task("eval", 1, 0, 0, 1, 50_000);
    let mut prep = testkit::task("prep", 1, 0, 0, 1, 20_000);
    prep.outputs = vec![OutputDecl {
        name: "shards.tar".into(),
        max_bytes: 1 << 30,
        rights: OutputRights::Exclusive,
    }];
    train.inputs = vec![TaskInput::FromTask {
        task: 0,
        output: "shards.tar".into(),
        name: "shards.tar".into(),
    }];
    train.depends_on = vec![0];
    eval.depends_on = vec![1];
    let mut w = world(3, vec![prep, train, eval]);
    assert_eq!(w.status(1), TaskStatus::Waiting);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    assert_eq!(w.awards().len(), 1, "only the first task is placed");
    w.net.settle(now);
    // prep delivers: train is placed at once (its window is over), with prep's output
    // pinned by digest in its award; eval waits.
    let shards = NamedDigest {
        name: "shards.tar".into(),
        digest: Digest([9; 32]),
    };
    w.command(
        now,
        Command::Delivered {
            job: w.job,
            task: 0,
            rank: 0,
            epoch: 1,
            outputs: vec![shards.clone()],
        },
    )
    .unwrap();
    let award = w.awards()[0].clone();
    assert_eq!(award.task, 1);
    assert_eq!(award.inputs, vec![shards]);
    assert_eq!(w.status(1), TaskStatus::Leasing);
    assert_eq!(w.status(2), TaskStatus::Waiting);
    w.net.settle(now);
    // train fails on every worker: it fails, eval is cancelled.
    let mut now = now;
    for _ in 0..3 {
        let Some(a) = w.job().tasks()[1].ranks().first().cloned() else {
            break;
        };
        if a.state != LeaseState::Current {
            break;
        }
        now = now.plus_ms(1000);
        w.failed(now, 1, 0, a.epoch).unwrap();
        w.net.settle(now);
    }
    assert!(matches!(w.status(1), TaskStatus::Failed(_)));
    assert_eq!(
        w.status(2),
        TaskStatus::Cancelled(Cancellation::DependencyFailed {
            task: "train".into()
        })
    );
    assert_eq!(w.job().state(), JobState::Failed);
    let prep_price = w.job().tasks()[0].spent();
    assert_eq!(w.job().refund().unwrap().0, 170_000 - prep_price.0);
}

#[test]
fn workers_refuse_stale_and_foreign_lease_messages() {
    let mut w = world(2, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    let award = w.awards()[0].clone();
    w.net.settle(now);
    let key = (w.job, 0, 0);
    let requester = testkit::keys(0);
    let worker = award.worker;
    let send = |w: &mut World, from: &Keypair, msg: Inbound| {
        w.request(from.address(), worker, msg, now);
    };
    let refusals = |w: &World| w.worker(&worker).refusals.clone();
    // The same award again (its answer was lost): taken as the first time, not refused.
    let before = refusals(&w).len();
    send(
        &mut w,
        &requester,
        Inbound::Award(Signed::sign(&requester, &award).open().unwrap()),
    );
    assert_eq!(refusals(&w).len(), before);
    // Another award at the same epoch: stale.
    let other = Award {
        expires_at: award.expires_at.plus_ms(1),
        ..award.clone()
    };
    send(
        &mut w,
        &requester,
        Inbound::Award(Signed::sign(&requester, &other).open().unwrap()),
    );
    assert_eq!(
        refusals(&w).last(),
        Some(&Refusal::StaleEpoch { got: 1, current: 1 })
    );
    // A renewal with another epoch.
    let renewal = LeaseRenewal {
        job_id: award.job_id,
        task: 0,
        rank: 0,
        requester: award.requester,
        worker,
        epoch: 7,
        issued_at: now,
        expires_at: now.plus_ms(999_999),
    };
    send(
        &mut w,
        &requester,
        Inbound::Renewal(Signed::sign(&requester, &renewal).open().unwrap()),
    );
    assert_eq!(
        refusals(&w).last(),
        Some(&Refusal::StaleEpoch { got: 7, current: 1 })
    );
    // An award above the quote.
    let mut dear = award.clone();
    dear.epoch = 5;
    dear.price = Amount(award.price.0 + 1);
    send(
        &mut w,
        &requester,
        Inbound::Award(Signed::sign(&requester, &dear).open().unwrap()),
    );
    assert!(matches!(
        refusals(&w).last(),
        Some(Refusal::AboveQuote { .. })
    ));
    // A renewal signed by the requester but sent by someone else: refused, penalized.
    let stranger = testkit::keys(99);
    send(
        &mut w,
        &stranger,
        Inbound::Renewal(Signed::sign(&requester, &renewal).open().unwrap()),
    );
    assert!(matches!(
        refusals(&w).last(),
        Some(Refusal::NotFromSigner { .. })
    ));
    assert_eq!(
        w.worker(&worker).penalized.last().map(|p| p.0),
        Some(stranger.address())
    );
    // A forged award (signed by the stranger, claiming to be the requester's) never opens;
    // one with a tampered signature is refused and penalized.
    let mut forged = dear.clone();
    forged.epoch = 9;
    forged.price = award.price;
    let (payload, signer, mut sig) = Signed::sign(&requester, &forged).into_parts();
    sig.0[5] ^= 1;
    let tampered = Signed::<Award>::from_parts(payload, signer, sig)
        .open()
        .unwrap();
    send(&mut w, &requester, Inbound::Award(tampered));
    assert!(matches!(
        refusals(&w).last(),
        Some(Refusal::BadSignature(_))
    ));
    assert!(w.is_current(&worker, &key, 1, now), "nothing changed");
    // A cancellation from someone else changes nothing.
    let cancel = Cancel {
        job_id: award.job_id,
        task: 0,
        rank: 0,
        requester: stranger.address(),
        worker,
        epoch: 1,
        reason: "no".into(),
        issued_at: now,
    };
    send(
        &mut w,
        &stranger,
        Inbound::Cancel(Signed::sign(&stranger, &cancel).open().unwrap()),
    );
    assert!(w.is_current(&worker, &key, 1, now));
    // Not renewed (the requester is gone): the lease runs out and the workload stops.
    let end = now.plus_ms(LeaseConfig::default().lease_ms);
    w.net.queue.clear();
    let i = w
        .net
        .nodes
        .iter()
        .position(|n| n.address() == worker)
        .unwrap();
    w.net.nodes[i]
        .market
        .handle(end, cannabis_market::Input::Tick);
    w.net.drain(i, end);
    assert!(!w.is_current(&worker, &key, 1, end));
    assert!(w.worker(&worker).events.iter().any(|e| matches!(
        e,
        MarketEvent::LeaseEnded { key: k, epoch: 1, .. } if *k == key
    )));
}

// ---- Property tests: random orders, duplicates, losses, delays, clock jumps, restarts. ----

#[derive(Clone, Debug)]
enum Step {
    /// Advance the clock.
    Wait(u64),
    /// Deliver the queued message at this index (modulo the queue).
    Deliver(usize),
    /// Deliver it and keep a copy (a duplicate).
    Duplicate(usize),
    /// Drop it (lost).
    Drop(usize),
    /// A rank with a current lease delivers.
    Finish(u8),
    /// A rank with a live lease fails.
    Fail(u8),
    /// The requester cancels.
    Cancel,
    /// A node crashes and comes back from its store.
    Restart(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u64..20_000).prop_map(Step::Wait),
        1 => (0u64..400_000).prop_map(Step::Wait),
        12 => any::<usize>().prop_map(Step::Deliver),
        2 => any::<usize>().prop_map(Step::Duplicate),
        1 => any::<usize>().prop_map(Step::Drop),
        3 => any::<u8>().prop_map(Step::Finish),
        1 => any::<u8>().prop_map(Step::Fail),
        1 => any::<u8>().prop_map(Step::Restart),
    ]
}

/// Steps, with a cancellation somewhere in a fifth of the runs.
fn steps() -> impl Strategy<Value = Vec<Step>> {
    (
        prop::collection::vec(step(), 1..160),
        prop::option::weighted(0.2, any::<prop::sample::Index>()),
    )
        .prop_map(|(mut steps, cancel)| {
            if let Some(at) = cancel {
                let i = at.index(steps.len() + 1);
                steps.insert(i, Step::Cancel);
            }
            steps
        })
}

fn check_invariants(w: &World, now: Timestamp) -> Result<(), TestCaseError> {
    let job = w.job();
    prop_assert!(job.used().unwrap() <= job.offer().budget, "over budget");
    for (i, t) in job.tasks().iter().enumerate() {
        prop_assert!(
            t.committed().0 + t.spent().0 <= t.budget().0,
            "task {i} over budget"
        );
        let live: u64 = t
            .ranks()
            .iter()
            .filter(|a| matches!(a.state, LeaseState::Offered | LeaseState::Current))
            .map(|a| a.price.0)
            .sum();
        prop_assert_eq!(live, t.committed().0, "committed matches the live leases");
        // Per assignment and epoch, at most one worker holds a current lease.
        for rank in 0..job.offer().tasks[i].group_size {
            let key = (job.id(), i as u32, rank);
            for epoch in 1..=8u64 {
                let holders = w.net.nodes[1..]
                    .iter()
                    .filter(|n| n.market.leases().is_current(&key, epoch, now))
                    .count();
                prop_assert!(
                    holders <= 1,
                    "{holders} current leases for {key:?} epoch {epoch}"
                );
            }
        }
    }
    Ok(())
}

fn run(steps: Vec<Step>, group: u32) -> Result<(), TestCaseError> {
    let mut second = testkit::task("b", 1, 0, 0, 1, 40_000);
    second.depends_on = vec![0];
    let mut w = world(6, vec![testkit::task("a", 1, 0, 0, group, 90_000), second]);
    let mut now = T0;
    for s in steps {
        match s {
            Step::Wait(ms) => {
                now = now.plus_ms(ms);
                w.net.tick(now);
                // After a tick, no engine asks to be woken in the past (the node sleeps
                // until then; a past time would spin it).
                for n in &w.net.nodes {
                    prop_assert!(
                        n.market.poll_timeout().is_none_or(|t| t > now),
                        "wake in the past"
                    );
                }
            }
            Step::Deliver(i) | Step::Duplicate(i) | Step::Drop(i) if !w.net.queue.is_empty() => {
                let at = i % w.net.queue.len();
                match s {
                    Step::Drop(_) => {
                        w.net.queue.remove(at);
                    }
                    _ => w.net.deliver(at, now, matches!(s, Step::Duplicate(_))),
                }
            }
            Step::Finish(r) | Step::Fail(r) => {
                let live: Vec<(u32, u32, u64)> = w
                    .job()
                    .tasks()
                    .iter()
                    .enumerate()
                    .flat_map(|(i, t)| {
                        t.ranks()
                            .iter()
                            .filter(|a| a.state == LeaseState::Current)
                            .map(move |a| (i as u32, a.rank, a.epoch))
                    })
                    .collect();
                if let Some(&(task, rank, epoch)) = live.get(r as usize % live.len().max(1)) {
                    if matches!(s, Step::Fail(_)) {
                        w.failed(now, task, rank, epoch).unwrap();
                    } else {
                        w.delivered(now, task, rank, epoch).unwrap();
                    }
                }
            }
            Step::Cancel if w.job().state() == JobState::Open => {
                w.command(now, Command::Cancel(w.job)).unwrap();
            }
            Step::Restart(n) => {
                let i = n as usize % w.net.nodes.len();
                w.net.nodes[i].restart(now);
                w.net.drain(i, now);
            }
            _ => {}
        }
        check_invariants(&w, now)?;
    }
    // Past the deadline every job has ended, in a defined state, within budget.
    let end = w.job().offer().deadline.plus_ms(1);
    w.net.tick(end);
    let job = w.job();
    prop_assert!(job.state() != JobState::Open, "{:?}", job.tasks());
    prop_assert!(job.tasks().iter().all(|t| t.status().is_final()));
    prop_assert!(job.tasks().iter().all(|t| t.committed() == Amount(0)));
    prop_assert!(
        job.refund().unwrap().0 + job.tasks().iter().map(|t| t.spent().0).sum::<u64>()
            == job.offer().budget.0
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn single_tasks_keep_the_invariants(steps in steps()) {
        run(steps, 1)?;
    }

    #[test]
    fn groups_keep_the_invariants(steps in steps()) {
        run(steps, 3)?;
    }
}

#[test]
fn a_worker_that_signs_two_bids_for_one_offer_is_caught_and_not_placed() {
    let mut w = world(3, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    let cheapest = w.net.nodes[1].address();
    let held = w.job().tasks()[0]
        .bids()
        .find(|c| c.bid.worker == cheapest)
        .expect("worker 1 bid")
        .bid
        .clone();
    // The same worker quotes the same version of the offer again, cheaper.
    let mut second = held.clone();
    second.price = Amount(held.price.0 - 1);
    second.issued_at = T0.plus_ms(1);
    let keys = testkit::keys(1);
    let requester = w.net.nodes[0].address();
    let msg = Inbound::Bid(Signed::sign(&keys, &second).open().unwrap());
    w.request(cheapest, requester, msg, T0.plus_ms(1));
    let node = &w.net.nodes[0];
    assert_eq!(node.refusals.last(), Some(&Refusal::Equivocation));
    assert!(
        node.penalized
            .iter()
            .any(|(who, why)| *who == cheapest && *why == Refusal::Equivocation)
    );
    // Both signed bids are kept, and anyone can check them.
    let evidence = w.job().evidence();
    assert_eq!(evidence.len(), 1);
    let e = &evidence[0];
    assert_eq!(e.worker, cheapest);
    assert_eq!(e.first.verify_from(&cheapest).unwrap().body, held);
    assert_eq!(e.second.verify_from(&cheapest).unwrap().body, second);
    // A conflicting bid in worker 2's name with a bad signature is no evidence: worker 2
    // keeps its bid.
    let next = w.net.nodes[2].address();
    let mut forged = w.job().tasks()[0]
        .bids()
        .find(|c| c.bid.worker == next)
        .unwrap()
        .bid
        .clone();
    forged.price = Amount(1);
    let (payload, signer, mut sig) = Signed::sign(&testkit::keys(2), &forged).into_parts();
    sig.0[0] ^= 1;
    let msg = Inbound::Bid(
        Signed::<Bid>::from_parts(payload, signer, sig)
            .open()
            .unwrap(),
    );
    w.request(next, requester, msg, T0.plus_ms(2));
    assert!(matches!(
        w.net.nodes[0].refusals.last(),
        Some(Refusal::BadSignature(_))
    ));
    assert_eq!(w.job().evidence().len(), 1);
    // The equivocating worker is not placed: the next cheapest is.
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    let award = w.awards()[0].clone();
    assert_eq!(award.worker, next);
}

#[test]
fn an_acceptance_of_an_award_never_sent_is_refused_and_penalized() {
    let mut w = world(2, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    let award = w.awards()[0].clone();
    let worker = award.worker;
    // The worker signs an acceptance of the right assignment and epoch, but of an award
    // the requester never sent.
    w.net.queue.clear();
    w.accept_unsent_award(worker, award.epoch, now);
    let requester = &w.net.nodes[0];
    assert_eq!(requester.refusals.last(), Some(&Refusal::NotTheAward));
    assert!(
        requester
            .penalized
            .iter()
            .any(|(who, why)| *who == worker && *why == Refusal::NotTheAward)
    );
}

#[test]
fn a_worker_that_signs_two_acceptances_of_one_epoch_is_caught() {
    let mut w = world(2, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    let now = T0.plus_ms(WINDOW);
    w.net.tick(now);
    w.net.settle(now);
    assert_eq!(w.status(0), TaskStatus::Running);
    let a = w.job().tasks()[0].ranks()[0].clone();
    let worker = a.worker;
    // Having countersigned the award, the worker signs another acceptance of the same
    // epoch naming an award that was never sent.
    w.accept_unsent_award(worker, a.epoch, now);
    assert_eq!(w.net.nodes[0].refusals.last(), Some(&Refusal::NotTheAward));
    let evidence = w.job().accept_evidence();
    assert_eq!(evidence.len(), 1, "{evidence:?}");
    let e = &evidence[0];
    assert_eq!(e.worker, worker);
    let (first, second) = (
        e.first.verify().unwrap().body,
        e.second.verify().unwrap().body,
    );
    assert_eq!((first.epoch, second.epoch), (a.epoch, a.epoch));
    assert_eq!(first.award, a.award);
    assert_ne!(first.award, second.award);
    // The lease it holds stands: the award sent was accepted.
    assert_eq!(w.status(0), TaskStatus::Running);
}
