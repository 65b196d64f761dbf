//! The job and lease state machines, requester and workers together: placement, leases
//! with epochs, renewals, retries within the budget, group ranks, cancellation and task
//! graphs. Then property tests with random message orders, duplicates, delays and clock
//! jumps.

use cannabis_market::job::{Action, Job, JobState, LeaseConfig, LeaseState, TaskStatus};
use cannabis_market::lease::Leases;
use cannabis_market::matching::Context;
use cannabis_market::placement::Class;
use cannabis_market::quote::{self, Answer, WorkerPolicy};
use cannabis_market::testkit::{self, Machine};
use cannabis_protocol::*;
use proptest::prelude::*;

const T0: Timestamp = Timestamp(1_000_000_000);

struct World {
    job: Job,
    workers: Vec<(Address, CapabilityAd, Leases)>,
}

fn machine(n: u64) -> Machine {
    Machine {
        cores: 8,
        cpu_core_hour: 10 + n,
        ..Machine::default()
    }
}

/// A requester, `n` workers with distinct prices, and one offer of `tasks`.
fn world(n: u64, tasks: Vec<TaskSpec>) -> World {
    let requester = testkit::keys(0).address();
    let offer = testkit::offer(requester, 1, tasks, T0, 10_000, 3_600_000);
    let id = message_id(&offer);
    let job = Job::new(offer, id, LeaseConfig::default(), T0);
    let workers = (1..=n)
        .map(|i| {
            let a = testkit::keys(i).address();
            (a, testkit::ad(a, &machine(i), T0), Leases::new(a))
        })
        .collect();
    World { job, workers }
}

impl World {
    /// Every worker answers every task; bids go to the job.
    fn bid_all(&mut self, now: Timestamp) {
        let ctx = Context {
            now,
            ..Context::default()
        };
        for (_, ad, leases) in &mut self.workers {
            for t in 0..self.job.offer.tasks.len() as u32 {
                let policy = WorkerPolicy::default();
                match quote::answer(&policy, ad, &self.job.offer, self.job.offer_id, t, &ctx) {
                    Some(Answer::Bid(bid)) => {
                        let id = message_id(&bid);
                        leases.on_bid_sent(id, bid.clone(), self.job.offer.requester);
                        let class = Class::of(&self.job.offer.tasks[t as usize], ad);
                        self.job.on_bid(bid, id, class, now).unwrap();
                    }
                    Some(Answer::Decline(d)) => self.job.on_decline(d, now).unwrap(),
                    _ => {}
                }
            }
        }
    }

    fn worker(&mut self, a: &Address) -> &mut Leases {
        &mut self.workers.iter_mut().find(|w| w.0 == *a).unwrap().2
    }

    /// Delivers actions to workers; returns the countersignatures produced.
    fn deliver(&mut self, actions: Vec<Action>, now: Timestamp) -> Vec<LeaseAccept> {
        let mut accepts = Vec::new();
        for a in actions {
            match a {
                Action::Award(award) => {
                    let id = message_id(&award);
                    if let Ok((acc, _)) = self.worker(&award.worker).on_award(&award, id, now) {
                        accepts.push(acc);
                    }
                }
                Action::Renew(r) => {
                    if self.worker(&r.worker).on_renewal(&r, now).is_ok() {
                        let _ = self
                            .job
                            .on_renewed(r.task, r.rank, r.epoch, r.expires_at, now);
                    }
                }
                Action::Cancel { to, cancel } => {
                    for w in to {
                        self.worker(&w).on_cancel(&cancel, now);
                    }
                }
            }
        }
        accepts
    }

    /// Runs awards and acceptances to a fixed point at `now`.
    fn settle(&mut self, mut actions: Vec<Action>, now: Timestamp) {
        for _ in 0..10 {
            let accepts = self.deliver(actions, now);
            actions = Vec::new();
            for acc in accepts {
                actions.extend(self.job.on_accept(&acc, now).unwrap());
            }
            if actions.is_empty() {
                return;
            }
        }
    }
}

#[test]
fn a_job_is_placed_on_the_cheapest_bid_and_leased() {
    let mut w = world(5, vec![testkit::task("t", 2, 0, 0, 1, 100_000)]);
    w.bid_all(T0);
    assert!(
        w.job.tick(T0.plus_ms(9_999)).is_empty(),
        "the bid window is open"
    );
    let now = T0.plus_ms(10_000);
    let actions = w.job.tick(now);
    let Action::Award(award) = actions[0].clone() else {
        panic!("{actions:?}")
    };
    // Worker 1 has the lowest price.
    assert_eq!(award.worker, w.workers[0].0);
    assert_eq!((award.rank, award.epoch), (0, 1));
    assert!(award.rendezvous.is_none());
    w.settle(actions, now);
    assert_eq!(w.job.tasks[0].status, TaskStatus::Running);
    let key = (w.job.id(), 0, 0);
    assert!(w.workers[0].2.is_current(&key, 1, now));
    // Renewals keep it current past the first lease.
    let mut t = now;
    for _ in 0..10 {
        t = t.plus_ms(20_000);
        let a = w.job.tick(t);
        w.deliver(a, t);
        assert!(w.workers[0].2.is_current(&key, 1, t), "lease lapsed at {t}");
    }
    let a = w.job.on_delivered(0, 0, 1, &[], t).unwrap();
    assert!(a.is_empty());
    assert_eq!(w.job.state(), JobState::Completed);
    assert_eq!(w.job.tasks[0].spent, award.price);
    assert_eq!(w.job.refund().0, 100_000 - award.price.0);
}

#[test]
fn a_group_gets_ranks_and_a_shared_roster() {
    let mut w = world(5, vec![testkit::task("g", 1, 0, 0, 3, 300_000)]);
    w.bid_all(T0);
    let now = T0.plus_ms(10_000);
    let actions = w.job.tick(now);
    let awards: Vec<&Award> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Award(a) => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(awards.len(), 3);
    let roster = awards[0].rendezvous.clone().unwrap();
    for (i, a) in awards.iter().enumerate() {
        assert_eq!(a.rank, i as u32);
        assert_eq!(a.rendezvous.as_ref(), Some(&roster));
        assert_eq!(roster.roster[i].worker, a.worker);
    }
    // The three cheapest workers, cheapest first.
    let chosen: Vec<Address> = awards.iter().map(|a| a.worker).collect();
    let expected: Vec<Address> = w.workers[..3].iter().map(|w| w.0).collect();
    assert_eq!(chosen, expected);
    w.settle(actions, now);
    assert_eq!(w.job.tasks[0].status, TaskStatus::Running);
    // Cancelling reaches every rank.
    let actions = w.job.cancel("changed my mind", now);
    let Action::Cancel { to, .. } = &actions[0] else {
        panic!()
    };
    assert_eq!(to.len(), 3);
    w.deliver(actions, now);
    for (i, (_, _, leases)) in w.workers[..3].iter().enumerate() {
        assert!(!leases.is_current(&(w.job.id(), 0, i as u32), 1, now));
    }
    assert_eq!(w.job.state(), JobState::Cancelled);
    assert_eq!(w.job.refund(), Amount(300_000));
}

#[test]
fn an_unanswered_award_is_retried_with_a_new_epoch_elsewhere() {
    let mut w = world(3, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    w.bid_all(T0);
    let now = T0.plus_ms(10_000);
    let first = w.job.tick(now);
    let Action::Award(a1) = &first[0] else {
        panic!()
    };
    // The worker never answers; after the award timeout the task goes elsewhere.
    let later = now.plus_ms(LeaseConfig::default().award_timeout_ms);
    let actions = w.job.tick(later);
    let a2 = actions
        .iter()
        .find_map(|a| match a {
            Action::Award(a) => Some(a.clone()),
            _ => None,
        })
        .unwrap();
    assert_ne!(a2.worker, a1.worker);
    assert_eq!(a2.epoch, 2, "a retry gets a new epoch");
    assert_eq!(w.job.tasks[0].attempts, 2);
    assert_eq!(w.job.tasks[0].committed, a2.price);
    // The first worker's late countersignature carries a stale epoch and is refused.
    let id = message_id(a1);
    let (late, _) = w.worker(&a1.worker).on_award(a1, id, now).unwrap();
    let err = w.job.on_accept(&late, later).unwrap_err();
    assert!(err.contains("stale epoch"), "{err}");
    // So is a delivery report for it.
    assert!(w.job.on_delivered(0, 0, 1, &[], later).is_err());
}

#[test]
fn a_worker_that_stops_acknowledging_renewals_loses_the_task() {
    let mut w = world(3, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    w.bid_all(T0);
    let now = T0.plus_ms(10_000);
    let actions = w.job.tick(now);
    let Action::Award(first) = actions[0].clone() else {
        panic!()
    };
    w.settle(actions, now);
    assert_eq!(w.job.tasks[0].status, TaskStatus::Running);
    // From here the worker is gone: renewals are sent but never acknowledged.
    let mut t = now;
    let mut moved = None;
    for _ in 0..100 {
        t = t.plus_ms(1_000);
        for a in w.job.tick(t) {
            if let Action::Award(a) = a {
                moved = Some(a);
            }
        }
        if moved.is_some() {
            break;
        }
    }
    let second = moved.expect("the task moved");
    assert_ne!(second.worker, first.worker);
    assert_eq!(second.epoch, 2);
    assert!(w.job.history.iter().any(|e| e.text.contains("expired")));
}

#[test]
fn retries_stop_at_the_attempt_limit() {
    // Five workers; each run fails after its lease became current; three failures allowed.
    let mut w = world(5, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    w.bid_all(T0);
    let mut now = T0.plus_ms(10_000);
    let mut actions = w.job.tick(now);
    for attempt in 1..=3 {
        let award = actions
            .iter()
            .find_map(|a| match a {
                Action::Award(a) => Some(a.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("attempt {attempt}: {actions:?}"));
        assert_eq!(award.epoch, attempt);
        w.settle(actions, now);
        now = now.plus_ms(1000);
        actions = w.job.on_failed(0, 0, award.epoch, "crashed", now).unwrap();
        assert!(w.job.used() <= w.job.offer.budget);
    }
    assert_eq!(
        w.job.tasks[0].status,
        TaskStatus::Failed("gave up after 3 failed runs".into())
    );
    assert_eq!(w.job.state(), JobState::Failed);
    assert_eq!(
        w.job.refund(),
        Amount(100_000),
        "nothing delivered, nothing spent"
    );
}

#[test]
fn a_group_retry_must_fit_what_is_left_of_the_budget() {
    // A group of 2 with just enough budget for one run: rank 0 delivers and is paid, rank 1
    // fails, and re-placing both ranks would cost more than is left.
    let mut w = world(4, vec![testkit::task("g", 1, 0, 0, 2, 30)]);
    w.bid_all(T0);
    let now = T0.plus_ms(10_000);
    let actions = w.job.tick(now);
    w.settle(actions, now);
    assert_eq!(w.job.tasks[0].status, TaskStatus::Running);
    w.job.on_delivered(0, 0, 1, &[], now).unwrap();
    let paid = w.job.tasks[0].spent;
    w.job.on_failed(0, 1, 1, "crashed", now).unwrap();
    let TaskStatus::Failed(why) = &w.job.tasks[0].status else {
        panic!("{:?}", w.job.tasks[0].status)
    };
    assert!(why.contains("left in the budget"), "{why}");
    assert_eq!(w.job.tasks[0].spent, paid);
    assert_eq!(w.job.tasks[0].committed, Amount(0));
    assert_eq!(w.job.refund().0, 30 - paid.0);
}

#[test]
fn nobody_matching_fails_with_the_reason() {
    // Needs a GPU; the simulated workers have none, so nobody bids.
    let mut w = world(4, vec![testkit::task("t", 1, 1, 24, 1, 100_000)]);
    w.bid_all(T0);
    w.job.tick(T0.plus_ms(10_000));
    assert_eq!(
        w.job.tasks[0].status,
        TaskStatus::Failed("cannot be placed: no valid bids".into())
    );
    // A group larger than the compatible set also fails, with the sizes.
    let mut w = world(2, vec![testkit::task("g", 1, 0, 0, 3, 300_000)]);
    w.bid_all(T0);
    w.job.tick(T0.plus_ms(10_000));
    let TaskStatus::Failed(why) = &w.job.tasks[0].status else {
        panic!()
    };
    assert!(why.contains("largest compatible set has 2"), "{why}");
}

#[test]
fn prices_above_the_share_are_declined_with_a_reason() {
    let mut w = world(2, vec![testkit::task("t", 8, 0, 0, 1, 5)]);
    w.bid_all(T0);
    let declines = &w.job.tasks[0].declines;
    assert_eq!(declines.len(), 2);
    assert!(
        declines
            .values()
            .all(|r| r.contains("above the task's budget"))
    );
    w.job.tick(T0.plus_ms(10_000));
    let TaskStatus::Failed(why) = &w.job.tasks[0].status else {
        panic!()
    };
    assert!(why.contains("2 declined"), "{why}");
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
    assert_eq!(w.job.tasks[1].status, TaskStatus::Waiting);
    w.bid_all(T0);
    let now = T0.plus_ms(10_000);
    let actions = w.job.tick(now);
    assert_eq!(
        actions.len(),
        1,
        "only the first task is placed: {actions:?}"
    );
    w.settle(actions, now);
    // prep delivers: train is placed at once (its window is over), with prep's output
    // pinned by digest in its award; eval waits.
    let shards = NamedDigest {
        name: "shards.tar".into(),
        digest: Digest([9; 32]),
    };
    let actions = w
        .job
        .on_delivered(0, 0, 1, std::slice::from_ref(&shards), now)
        .unwrap();
    let Some(Action::Award(award)) = actions.first() else {
        panic!("{actions:?}")
    };
    assert_eq!(award.task, 1);
    assert_eq!(award.inputs, vec![shards]);
    assert_eq!(w.job.tasks[1].status, TaskStatus::Leasing);
    assert_eq!(w.job.tasks[2].status, TaskStatus::Waiting);
    w.settle(actions, now);
    // train fails on every worker: it fails, eval is cancelled.
    let mut now = now;
    for _ in 0..3 {
        let Some(a) = w.job.tasks[1].ranks.first().cloned() else {
            break;
        };
        if a.state != LeaseState::Current {
            break;
        }
        now = now.plus_ms(1000);
        let actions = w
            .job
            .on_failed(1, 0, a.epoch, "out of memory", now)
            .unwrap();
        w.settle(actions, now);
    }
    assert!(matches!(w.job.tasks[1].status, TaskStatus::Failed(_)));
    assert!(
        matches!(&w.job.tasks[2].status, TaskStatus::Cancelled(r) if r.contains("train")),
        "{:?}",
        w.job.tasks[2].status
    );
    assert_eq!(w.job.state(), JobState::Failed);
    let prep_price = w.job.tasks[0].spent;
    assert_eq!(w.job.refund().0, 170_000 - prep_price.0);
}

#[test]
fn workers_refuse_stale_and_foreign_lease_messages() {
    let mut w = world(2, vec![testkit::task("t", 1, 0, 0, 1, 100_000)]);
    w.bid_all(T0);
    let now = T0.plus_ms(10_000);
    let actions = w.job.tick(now);
    let Action::Award(award) = actions[0].clone() else {
        panic!()
    };
    w.settle(actions, now);
    let key = (w.job.id(), 0, 0);
    let leases = w.worker(&award.worker);
    // The same award again: stale.
    let err = leases
        .on_award(&award, message_id(&award), now)
        .unwrap_err();
    assert!(err.contains("stale epoch"), "{err}");
    // A renewal with another epoch.
    let renewal = LeaseRenewal {
        job_id: award.job_id,
        task: 0,
        rank: 0,
        requester: award.requester,
        worker: award.worker,
        epoch: 7,
        issued_at: now,
        expires_at: now.plus_ms(999_999),
    };
    assert!(
        leases
            .on_renewal(&renewal, now)
            .unwrap_err()
            .contains("stale epoch")
    );
    // An award above the quote.
    let mut dear = award.clone();
    dear.epoch = 5;
    dear.price = Amount(award.price.0 + 1);
    assert!(
        leases
            .on_award(&dear, message_id(&dear), now)
            .unwrap_err()
            .contains("above the quote")
    );
    // A cancellation from someone else changes nothing.
    let stranger = Cancel {
        job_id: award.job_id,
        requester: testkit::keys(99).address(),
        task: None,
        reason: "no".into(),
        issued_at: now,
    };
    assert!(leases.on_cancel(&stranger, now).is_empty());
    assert!(leases.is_current(&key, 1, now));
    // Not renewed: the lease runs out and the workload stops.
    let end = now.plus_ms(LeaseConfig::default().lease_ms);
    let stopped = leases.tick(end);
    assert_eq!(stopped.len(), 1);
    assert!(!leases.is_current(&key, 1, end));
}

// ---- Property tests: random orders, duplicates, delays, clock jumps. ----

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

#[derive(Clone, Debug)]
enum Msg {
    ToWorker(Action),
    ToRequester(LeaseAccept),
    Renewed(LeaseRenewal),
}

fn check_invariants(w: &World, now: Timestamp) -> Result<(), TestCaseError> {
    let job = &w.job;
    prop_assert!(
        job.used() <= job.offer.budget,
        "used {} > budget",
        job.used()
    );
    for (i, t) in job.tasks.iter().enumerate() {
        prop_assert!(
            t.committed.0 + t.spent.0 <= t.budget.0,
            "task {i} over budget"
        );
        let live: u64 = t
            .ranks
            .iter()
            .filter(|a| matches!(a.state, LeaseState::Offered | LeaseState::Current))
            .map(|a| a.price.0)
            .sum();
        prop_assert_eq!(live, t.committed.0, "committed matches the live leases");
        // Per assignment and epoch, at most one worker holds a current lease.
        for rank in 0..job.offer.tasks[i].group_size {
            let key = (job.id(), i as u32, rank);
            for epoch in 1..=8u64 {
                let holders = w
                    .workers
                    .iter()
                    .filter(|(_, _, l)| l.is_current(&key, epoch, now))
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
    w.bid_all(now);
    let mut queue: Vec<Msg> = Vec::new();
    for s in steps {
        match s {
            Step::Wait(ms) => {
                now = now.plus_ms(ms);
                for (_, _, l) in &mut w.workers {
                    l.tick(now);
                }
                queue.extend(w.job.tick(now).into_iter().map(Msg::ToWorker));
                // After a tick, the job never asks to be woken in the past (the node
                // sleeps until then; a past time would spin it).
                prop_assert!(
                    w.job.next_wake().is_none_or(|t| t > now),
                    "wake in the past"
                );
            }
            Step::Deliver(i) | Step::Duplicate(i) | Step::Drop(i) if !queue.is_empty() => {
                let at = i % queue.len();
                let msg = if matches!(s, Step::Duplicate(_)) {
                    queue[at].clone()
                } else {
                    queue.remove(at)
                };
                if matches!(s, Step::Drop(_)) {
                    continue;
                }
                match msg {
                    Msg::ToWorker(Action::Renew(r)) => {
                        if w.worker(&r.worker).on_renewal(&r, now).is_ok() {
                            queue.push(Msg::Renewed(r));
                        }
                    }
                    Msg::Renewed(r) => {
                        let _ = w.job.on_renewed(r.task, r.rank, r.epoch, r.expires_at, now);
                    }
                    Msg::ToWorker(a) => {
                        for acc in w.deliver(vec![a], now) {
                            queue.push(Msg::ToRequester(acc));
                        }
                    }
                    Msg::ToRequester(acc) => {
                        if let Ok(actions) = w.job.on_accept(&acc, now) {
                            queue.extend(actions.into_iter().map(Msg::ToWorker));
                        }
                    }
                }
            }
            Step::Finish(r) | Step::Fail(r) => {
                let live: Vec<(u32, u32, u64)> = w
                    .job
                    .tasks
                    .iter()
                    .enumerate()
                    .flat_map(|(i, t)| {
                        t.ranks
                            .iter()
                            .filter(|a| a.state == LeaseState::Current)
                            .map(move |a| (i as u32, a.rank, a.epoch))
                    })
                    .collect();
                if let Some(&(task, rank, epoch)) = live.get(r as usize % live.len().max(1)) {
                    let actions = if matches!(s, Step::Fail(_)) {
                        w.job.on_failed(task, rank, epoch, "crashed", now)
                    } else {
                        w.job.on_delivered(task, rank, epoch, &[], now)
                    };
                    queue.extend(actions.unwrap().into_iter().map(Msg::ToWorker));
                }
            }
            Step::Cancel if w.job.state() == JobState::Open => {
                queue.extend(w.job.cancel("test", now).into_iter().map(Msg::ToWorker));
            }
            _ => {}
        }
        check_invariants(&w, now)?;
    }
    // Past the deadline every job has ended, in a defined state, within budget.
    let end = w.job.offer.deadline.plus_ms(1);
    w.job.tick(end);
    prop_assert!(w.job.state() != JobState::Open, "{:?}", w.job.tasks);
    prop_assert!(w.job.tasks.iter().all(|t| t.status.is_final()));
    prop_assert!(w.job.tasks.iter().all(|t| t.committed == Amount(0)));
    prop_assert!(
        w.job.refund().0 + w.job.tasks.iter().map(|t| t.spent.0).sum::<u64>()
            == w.job.offer.budget.0
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
