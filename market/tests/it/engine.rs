//! The engine's own rules: bids per offer stay bounded however large the network, a worker
//! that bids without being drawn is refused and penalized, early placement, widening a
//! call that drew too few bids, and the fence (nothing commits before it is durable).

use std::collections::BTreeMap;
use std::sync::Arc;

use cannabis_market::fanin::{self, FaninConfig};
use cannabis_market::job::{Early, TaskStatus};
use cannabis_market::matching::Context;
use cannabis_market::quote;
use cannabis_market::testkit::net::{Envelope, Net, Node};
use cannabis_market::testkit::{self, Machine};
use cannabis_market::{
    Command, CommandError, CommandOk, Inbound, Market, MarketEvent, OfferTemplate, OutboundId,
    Output, Publish, RecordKey, Refusal, RunOrder, Signatures, Verdict, View, ViewConfig,
};
use cannabis_protocol::draw::{self, BidCall};
use cannabis_protocol::*;
use proptest::prelude::*;

use crate::lifecycle::{T0, WINDOW, config, identity, network, submit};

/// The bids an offer of `task` draws from `n` workers with random prices and shapes (a
/// third lack the cores), as a requester holding every ad sizes the call: how many bid,
/// and the cheapest drawn price against the cheapest of all.
fn draw_in_a_network(n: usize, seed: u64, task: &TaskSpec) -> (usize, u32, f64) {
    let mut rng = testkit::Rng(seed);
    let mut view = View::new(
        ViewConfig {
            max_ads: n + 1,
            ..ViewConfig::default()
        },
        Signatures::Assume,
    );
    let ads: Vec<CapabilityAd> = (0..n)
        .map(|i| {
            let m = Machine {
                cores: [2, 4, 8, 16][(rng.next() % 4) as usize],
                cpu_core_hour: 5 + rng.next() % 20,
                ..Machine::default()
            };
            let a = testkit::keys(seed.wrapping_mul(1_000_003) + i as u64 + 1).address();
            testkit::ad(a, &m, T0)
        })
        .collect();
    for ad in &ads {
        let item = Received::assumed(ad.clone(), ad.node);
        assert!(matches!(
            view.on_ad(Arc::new(item), T0, 0),
            Verdict::Accept(_)
        ));
    }
    let me = testkit::keys(0).address();
    let job = Uuid::from_random([seed as u8; 16]);
    let ctx = Context {
        now: T0,
        ..Context::default()
    };
    let config = FaninConfig::default();
    let call = fanin::size_call(&config, &view, &me, &job, task, 3_600_000, &ctx).call;
    let mut offer = testkit::offer(me, 1, vec![task.clone()], T0, WINDOW, 3_600_000);
    offer.job_id = job;
    offer.calls = vec![call];
    let id = message_id(&offer);
    let mut bids = 0;
    let mut cheapest_drawn = u64::MAX;
    let mut cheapest = u64::MAX;
    for ad in &ads {
        if let Some(p) = quote::price(&ad.prices, ad, task, 3_600_000)
            && cannabis_market::matching::unmet(task, ad, &ctx).is_empty()
        {
            cheapest = cheapest.min(p.0);
        }
        let policy = quote::WorkerPolicy::default();
        if let Some(quote::Answer::Bid(b)) = quote::answer(
            &policy,
            Some(&testkit::fee_terms()),
            ad,
            &offer,
            id,
            0,
            &ctx,
        ) {
            bids += 1;
            cheapest_drawn = cheapest_drawn.min(b.price.0);
        }
    }
    let ratio = cheapest_drawn as f64 / cheapest as f64;
    (bids, call.target, ratio)
}

proptest! {
    // The draw is random: a bound like "at least a quarter of the target" fails now and
    // then for a random network (once in a few hundred). A fixed seed makes the run the
    // same on every machine, so a failure means the sizing changed, not bad luck.
    #![proptest_config(ProptestConfig {
        cases: 10,
        rng_seed: proptest::test_runner::RngSeed::Fixed(20261203),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Bids per offer stay within a small multiple of the target at any network size.
    #[test]
    fn bids_per_offer_stay_bounded_at_any_size(
        exp in 1.0f64..5.0,
        seed in any::<u64>(),
        group in prop_oneof![Just(1u32), Just(4u32)],
    ) {
        let n = 10f64.powf(exp) as usize;
        let task = testkit::task("t", 4, 0, 0, group, 10_000_000);
        let (bids, target, ratio) = draw_in_a_network(n, seed, &task);
        let matching = n * 2 / 3;
        prop_assert!(bids <= 4 * target as usize, "{bids} bids for a target of {target} among {n} workers");
        if matching >= 4 * target as usize {
            prop_assert!(bids >= target as usize / 4, "{bids} bids for a target of {target} among {n} workers");
        }
        prop_assert!(ratio < 2.0, "the cheapest drawn bid is {ratio:.2}x the cheapest of all");
    }
}

#[test]
fn a_hundred_thousand_workers_draw_a_handful_of_bids() {
    let task = testkit::task("t", 4, 0, 0, 1, 10_000_000);
    let (bids, target, ratio) = draw_in_a_network(100_000, 42, &task);
    assert!(
        (2..=4 * target as usize).contains(&bids),
        "{bids} bids, target {target}"
    );
    assert!(
        ratio < 1.5,
        "cheapest drawn is {ratio:.2}x the cheapest of all"
    );
}

/// A requester and `n` workers, the job submitted but the offer not yet delivered.
fn world(n: u64, template: OfferTemplate) -> (Net, Uuid) {
    let nodes = (0..=n)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, |i| Machine {
        cpu_core_hour: 10 + i,
        ..Machine::default()
    });
    let job = submit(&mut net, template, [3; 16]);
    (net, job)
}

#[test]
fn a_worker_that_bids_without_being_drawn_is_refused_and_penalized() {
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let (mut net, job) = world(120, testkit::template(vec![task], WINDOW, 3_600_000));
    net.settle(T0);
    let j = net.nodes[0].market.job(&job).unwrap();
    let bids = j.tasks()[0].bid_count();
    let call = j.offer().calls[0];
    assert!(call.odds_ppb < draw::ODDS_ONE, "{call:?}");
    assert!(
        bids < 40,
        "{bids} of 120 workers bid for a target of {}",
        call.target
    );
    // A worker the call did not draw bids anyway.
    let offer = j.offer().clone();
    let offer_id = j.offer_id();
    let cheat = (1..=120u64)
        .map(testkit::keys)
        .find(|k| !draw::drawn(&call, &job, 0, &k.address(), Amount(1)))
        .expect("an undrawn worker");
    let bid = Bid {
        job_id: job,
        task: 0,
        offer: offer_id,
        worker: cheat.address(),
        price: Amount(1),
        earliest_start: T0,
        issued_at: T0.plus_ms(1),
        valid_until: offer.deadline,
    };
    net.queue.push(Envelope::Request {
        from: cheat.address(),
        to: net.nodes[0].address(),
        req: OutboundId(1),
        msg: Box::new(Inbound::Bid(Signed::sign(&cheat, &bid).open().unwrap())),
    });
    net.settle(T0);
    assert_eq!(net.nodes[0].refusals.last(), Some(&Refusal::NotDrawn));
    assert_eq!(
        net.nodes[0].penalized.last().map(|p| p.0),
        Some(cheat.address())
    );
    assert_eq!(
        net.nodes[0].market.job(&job).unwrap().tasks()[0].bid_count(),
        bids,
        "the bid was not kept"
    );
}

#[test]
fn a_price_cap_places_before_the_window_ends() {
    let task = testkit::task("t", 1, 0, 0, 2, 1_000_000);
    let mut template = testkit::template(vec![task], 60_000, 3_600_000);
    // Workers 1..=4 price 11..14 per core-hour: two are at or under 12.
    let cap = quote::price(
        &testkit::ad(
            testkit::keys(2).address(),
            &Machine {
                cpu_core_hour: 12,
                ..Machine::default()
            },
            T0,
        )
        .prices,
        &testkit::ad(testkit::keys(2).address(), &Machine::default(), T0),
        &template.tasks[0],
        3_600_000,
    )
    .unwrap();
    template.early = Some(Early::PriceAtMost(cap));
    let (mut net, job) = world(4, template);
    net.settle(T0);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_ne!(j.tasks()[0].status(), &TaskStatus::Bidding);
    let placed = &j.tasks()[0].ranks();
    assert_eq!(placed.len(), 2);
    assert!(placed.iter().all(|a| a.price <= cap));
    assert_eq!(j.tasks()[0].status(), &TaskStatus::Running);
    assert!(
        T0 < j.offer().expires_at,
        "placed well before the window ends"
    );
}

#[test]
fn first_bids_place_as_soon_as_they_are_in() {
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let mut template = testkit::template(vec![task], 60_000, 3_600_000);
    template.early = Some(Early::FirstBids(3));
    let (mut net, job) = world(5, template);
    // Deliver the offer, then only three bids.
    net.deliver(0, T0, false);
    let mut taken = 0;
    while taken < 3 {
        let at = net
            .queue
            .iter()
            .position(
                |e| matches!(e, Envelope::Request { msg, .. } if matches!(**msg, Inbound::Bid(_))),
            )
            .unwrap();
        net.deliver(at, T0, false);
        taken += 1;
        let placed = net.nodes[0].market.job(&job).unwrap().tasks()[0].attempts();
        assert_eq!(placed, u32::from(taken == 3), "placed after bid {taken}");
    }
}

/// Many workers, but only four have the 16 cores the task needs: a call sized on a small
/// sample where they are rare, and a job id whose first call (odds 1/20 at these sizes)
/// draws none of them. The job is published from node 0 with bid window `WINDOW`, placed
/// early when `early`.
fn a_job_the_first_draw_misses(early: bool) -> (Net, Uuid, Vec<Address>) {
    let mut requester = config();
    requester.fanin = FaninConfig {
        min_target: 1,
        per_rank: 1,
        sample: 10,
        ..FaninConfig::default()
    };
    let mut nodes = vec![Node::new(
        requester,
        identity(0),
        Some(testkit::keys(0)),
        T0,
    )];
    nodes
        .extend((1..=200u64).map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0)));
    let mut net = network(nodes, |i| Machine {
        cores: if i % 50 == 0 { 16 } else { 4 },
        ..Machine::default()
    });
    let task = testkit::task("big", 16, 0, 0, 1, 1_000_000);
    let big: Vec<Address> = (1..=4).map(|k| testkit::keys(k * 50).address()).collect();
    let first_odds = BidCall {
        target: 1,
        odds_ppb: 50_000_000,
        ref_price: Amount(0),
    };
    let nonce = (0..=255u8)
        .find(|n| {
            let id = Uuid::from_random([*n; 16]);
            big.iter()
                .all(|w| !draw::drawn(&first_odds, &id, 0, w, Amount(1)))
        })
        .unwrap();
    let mut template = testkit::template(vec![task], WINDOW, 3_600_000);
    if early {
        template.early = Some(Early::FirstBids(1));
    }
    let job = submit(&mut net, template, [nonce; 16]);
    net.settle(T0);
    (net, job, big)
}

/// Moves `net` on in steps of `step_ms` until the job's task is no longer bidding (at
/// most `steps` times), and checks that it then runs: the time reached.
fn until_running(net: &mut Net, job: &Uuid, step_ms: u64, steps: u32) -> Timestamp {
    let mut now = T0;
    for _ in 0..steps {
        let j = net.nodes[0].market.job(job).unwrap();
        if j.tasks()[0].status() != &TaskStatus::Bidding {
            break;
        }
        now = now.plus_ms(step_ms);
        net.tick(now);
        net.settle(now);
    }
    let j = net.nodes[0].market.job(job).unwrap();
    assert_eq!(
        j.tasks()[0].status(),
        &TaskStatus::Running,
        "{:?}",
        j.history()
    );
    now
}

#[test]
fn a_call_that_draws_too_few_bids_is_widened() {
    // The window ends and the offer goes out again with better odds until the task is
    // placed.
    let (mut net, job, big) = a_job_the_first_draw_misses(false);
    let first = net.nodes[0].market.job(&job).unwrap().offer().calls[0];
    until_running(&mut net, &job, WINDOW, 12);
    let j = net.nodes[0].market.job(&job).unwrap();
    let widened = net.nodes[0]
        .events
        .iter()
        .filter(|e| matches!(e, MarketEvent::Widened { .. }))
        .count();
    assert!(widened >= 1, "the first call ({first:?}) drew enough");
    assert!(j.offer().calls[0].odds_ppb > first.odds_ppb);
    assert!(j.offer().seq > 1, "a new version of the offer");
    // Only workers with 16 cores bid.
    assert!(j.tasks()[0].bids().all(|c| big.contains(&c.bid.worker)));
}

#[test]
fn an_early_job_whose_draw_misses_is_widened_without_waiting_for_its_window() {
    // Placed early, the job looks at its bids EARLY_LOOK_MS after each version: the
    // widened calls go out then, and it runs long before one window has passed.
    let (mut net, job, _) = a_job_the_first_draw_misses(true);
    let placed = until_running(&mut net, &job, 100, 200);
    let j = net.nodes[0].market.job(&job).unwrap();
    let waited = placed.ms_since(T0);
    assert!(
        (cannabis_market::job::EARLY_LOOK_MS..WINDOW).contains(&waited),
        "placed {waited} ms after publication (window {WINDOW} ms): {:?}",
        j.history()
    );
}

#[test]
fn nothing_that_commits_leaves_before_it_is_durable() {
    let mut m = Market::new(config(), identity(0), T0);
    let task = testkit::task("t", 1, 0, 0, 1, 1_000);
    let ok = m
        .command(
            T0,
            Command::Submit {
                template: testkit::template(vec![task], WINDOW, 3_600_000),
                nonce: [1; 16],
            },
        )
        .unwrap();
    let CommandOk::Submitted { job, .. } = ok else {
        panic!()
    };
    let Some(Output::Persist { batch, ops }) = m.poll_output() else {
        panic!("the job is persisted first")
    };
    assert!(ops.iter().any(|op| matches!(
        op,
        cannabis_market::RecordOp::Put(cannabis_market::Record::Job(j)) if j.id() == job
    )));
    assert!(m.poll_output().is_none(), "the offer waits for the write");
    m.persisted(batch);
    assert!(matches!(
        m.poll_output(),
        Some(Output::Publish(Publish::Offer(o))) if o.job_id == job
    ));
    assert!(m.poll_output().is_none());
    // Time never goes back, and the next wake is not in the past.
    m.handle(Timestamp(T0.0 - 5_000), cannabis_market::Input::Tick);
    assert_eq!(m.now(), T0);
    assert!(m.poll_timeout().is_some_and(|t| t > T0));
}

#[test]
fn offers_carry_a_call_per_task_and_any_node_checks_it() {
    let call = BidCall {
        target: 8,
        odds_ppb: 1_000,
        ref_price: Amount(100),
    };
    let mut offer = testkit::offer(
        testkit::keys(0).address(),
        1,
        vec![testkit::task("t", 1, 0, 0, 1, 10)],
        T0,
        WINDOW,
        3_600_000,
    );
    offer.calls = vec![call, call];
    let err = Signed::sign(&testkit::keys(0), &offer)
        .verify()
        .unwrap_err();
    assert!(err.to_string().contains("calls"), "{err}");
    offer.calls = vec![BidCall {
        odds_ppb: 0,
        ..call
    }];
    assert!(Signed::sign(&testkit::keys(0), &offer).verify().is_err());
}

/// Node 0 submits one job of `task` (the usual window and deadline); its offer waits in
/// the queue.
fn submit_task(net: &mut Net, task: TaskSpec, nonce: [u8; 16]) -> Uuid {
    submit(net, testkit::template(vec![task], WINDOW, 3_600_000), nonce)
}

/// Node 0 submits two jobs, both bid on by node 1, a worker allowed one lease.
fn two_jobs_for_one_slot() -> (Net, Uuid, Uuid) {
    let mut one = config();
    one.worker.max_leases = 1;
    let nodes = vec![
        Node::new(config(), identity(0), Some(testkit::keys(0)), T0),
        Node::new(one, identity(1), Some(testkit::keys(1)), T0),
    ];
    let mut net = network(nodes, |_| Machine::default());
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let template = || testkit::template(vec![task.clone()], WINDOW, 3_600_000);
    let a = submit(&mut net, template(), [1; 16]);
    let b = submit(&mut net, template(), [2; 16]);
    net.settle(T0);
    (net, a, b)
}

#[test]
fn a_full_worker_stops_quoting_and_refuses_awards_as_busy() {
    // One worker, allowed one lease, bids on two jobs while it holds none; both are awarded
    // to it: it takes one and refuses the other as busy; a third job draws no quote.
    let (mut net, a, b) = two_jobs_for_one_slot();
    for job in [a, b] {
        assert_eq!(
            net.nodes[0].market.job(&job).unwrap().tasks()[0].bid_count(),
            1
        );
    }
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    assert!(
        net.nodes[1]
            .refusals
            .iter()
            .any(|r| matches!(r, Refusal::Busy { held: 1 })),
        "{:?}",
        net.nodes[1].refusals
    );
    let status = |net: &Net, j: &Uuid| {
        net.nodes[0].market.job(j).unwrap().tasks()[0]
            .status()
            .clone()
    };
    let (running, waiting) = if status(&net, &a) == TaskStatus::Running {
        (a, b)
    } else {
        (b, a)
    };
    assert_eq!(status(&net, &running), TaskStatus::Running);
    assert_eq!(net.nodes[1].market.leases().live_count(end), 1);
    // The refused job does not fail: its bids are called for again, with a longer window.
    assert_eq!(status(&net, &waiting), TaskStatus::Bidding);
    let history = |net: &Net, j: &Uuid| {
        net.nodes[0]
            .market
            .job(j)
            .unwrap()
            .history()
            .iter()
            .map(|e| e.text.clone())
            .collect::<Vec<_>>()
    };
    assert!(
        history(&net, &waiting)
            .iter()
            .any(|t| t.starts_with("no bids left: bids called for again (1 of 5, a 20 s window")),
        "{:?}",
        history(&net, &waiting)
    );
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let c = submit_task(&mut net, task, [3; 16]);
    net.settle(end);
    assert_eq!(
        net.nodes[0].market.job(&c).unwrap().tasks()[0].bid_count(),
        0,
        "a full worker does not quote"
    );
    // The running job ends: the worker, free again, quotes at once on the offers it stayed
    // silent on while full (the job called for again, and the third job), and the job
    // called for again is placed at once, without waiting out its window.
    net.nodes[0]
        .market
        .command(end, Command::Cancel(running))
        .unwrap();
    net.drain(0, end);
    net.settle(end);
    assert_eq!(
        net.nodes[0].market.job(&c).unwrap().tasks()[0].bid_count(),
        1,
        "a worker free again quotes on what it stayed silent on"
    );
    assert_eq!(
        status(&net, &waiting),
        TaskStatus::Running,
        "{:?}",
        history(&net, &waiting)
    );
    let recall = end.plus_ms(2 * WINDOW);
    net.tick(recall);
    net.settle(recall);
    assert_eq!(
        status(&net, &waiting),
        TaskStatus::Running,
        "{:?}",
        history(&net, &waiting)
    );
    let j = net.nodes[0].market.job(&waiting).unwrap();
    assert_eq!(j.tasks()[0].ranks()[0].epoch, 2);
    assert!(j.offer().expires_at > end, "placed before the window ended");
}

#[test]
fn a_worker_whose_leases_hold_its_cores_stops_quoting_and_refuses_awards_as_busy() {
    // One worker with one core, allowed four leases, bids on two one-core jobs while it
    // holds none; both are awarded to it: it takes one and refuses the other, whose core
    // the first holds (its executor would refuse the run); a third job draws no quote.
    let nodes = vec![
        Node::new(config(), identity(0), Some(testkit::keys(0)), T0),
        Node::new(config(), identity(1), Some(testkit::keys(1)), T0),
    ];
    let mut net = network(nodes, |i| Machine {
        cores: if i == 1 { 1 } else { 8 },
        ..Machine::default()
    });
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let a = submit_task(&mut net, task.clone(), [1; 16]);
    let b = submit_task(&mut net, task.clone(), [2; 16]);
    net.settle(T0);
    let bids = |net: &Net, j: &Uuid| net.nodes[0].market.job(j).unwrap().tasks()[0].bid_count();
    assert_eq!((bids(&net, &a), bids(&net, &b)), (1, 1));
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    assert!(
        net.nodes[1].refusals.iter().any(|r| matches!(
            r,
            Refusal::Short {
                what: "millicores",
                asked: 1000,
                free: 0
            }
        )),
        "{:?}",
        net.nodes[1].refusals
    );
    let status = |net: &Net, j: &Uuid| {
        net.nodes[0].market.job(j).unwrap().tasks()[0]
            .status()
            .clone()
    };
    let running = if status(&net, &a) == TaskStatus::Running {
        a
    } else {
        b
    };
    assert_eq!(status(&net, &running), TaskStatus::Running);
    assert_eq!(net.nodes[1].market.leases().live_count(end), 1);
    // A task asking for less than a millicore still holds one: no quote.
    let mut small = task.clone();
    small.resources.cpu_millicores = 0;
    let c = submit_task(&mut net, small, [3; 16]);
    net.settle(end);
    assert_eq!(
        bids(&net, &c),
        0,
        "a worker whose core is held does not quote"
    );
    // The running job ends: the worker quotes at once on what it stayed silent on.
    net.nodes[0]
        .market
        .command(end, Command::Cancel(running))
        .unwrap();
    net.drain(0, end);
    net.settle(end);
    assert_eq!(
        bids(&net, &c),
        1,
        "a worker free again quotes on what it stayed silent on"
    );
}

#[test]
fn a_worker_counts_what_its_executor_admits_not_its_ads_whole_cores() {
    // A worker allowed a quarter core advertises 0 whole cores, so only tasks asking for
    // no CPU match its ad. Told what its executor admits (250 millicores), it quotes on
    // one (which holds a millicore there); counting its ad's 0 cores it would not.
    let nodes = vec![
        Node::new(config(), identity(0), Some(testkit::keys(0)), T0),
        Node::new(config(), identity(1), Some(testkit::keys(1)), T0),
    ];
    let mut net = network(nodes, |i| Machine {
        cores: if i == 1 { 0 } else { 8 },
        ..Machine::default()
    });
    let capacity = cannabis_market::Capacity {
        cpu_millicores: 250,
        memory_bytes: 32 << 30,
        storage_bytes: 500 << 30,
        gpus: 0,
    };
    net.nodes[1]
        .market
        .command(T0, Command::Capacity(capacity))
        .unwrap();
    let mut jobs = Vec::new();
    for (k, millicores) in [0u32, 250, 251].into_iter().enumerate() {
        let mut task = testkit::task("t", 0, 0, 0, 1, 1_000_000);
        task.resources.cpu_millicores = millicores;
        jobs.push(submit_task(&mut net, task, [k as u8 + 1; 16]));
    }
    net.settle(T0);
    let bids: Vec<usize> = jobs
        .iter()
        .map(|j| net.nodes[0].market.job(j).unwrap().tasks()[0].bid_count())
        .collect();
    assert_eq!(bids, [1, 0, 0]);
}

#[test]
fn a_task_whose_bids_keep_running_out_fails_after_its_last_call() {
    // The only worker refuses every award as busy (it holds a lease of another job that
    // never ends): the job is called for again five times, each window twice the last,
    // and then fails saying why.
    let (mut net, a, b) = two_jobs_for_one_slot();
    let mut now = T0;
    let mut windows = Vec::new();
    for _ in 0..80 {
        now = now.plus_ms(WINDOW);
        net.tick(now);
        net.settle(now);
        let waiting = [a, b]
            .into_iter()
            .find(|j| {
                net.nodes[0].market.job(j).unwrap().tasks()[0].status() != &TaskStatus::Running
            })
            .unwrap();
        let j = net.nodes[0].market.job(&waiting).unwrap();
        let w = j.offer().expires_at.ms_since(j.offer().issued_at);
        if windows.last() != Some(&w) {
            windows.push(w);
        }
        if j.tasks()[0].status().is_final() {
            assert_eq!(
                j.tasks()[0].status().to_string(),
                "failed: cannot be placed: no valid bids"
            );
            assert_eq!(
                j.history()
                    .iter()
                    .filter(|e| e.text.starts_with("no bids left"))
                    .count(),
                5
            );
            assert_eq!(
                windows,
                [2 * WINDOW, 4 * WINDOW, 8 * WINDOW, 16 * WINDOW, 32 * WINDOW]
            );
            return;
        }
    }
    panic!("the job never failed: {:?}", windows);
}

#[test]
fn offers_carry_the_networks_fee_terms_and_workers_decline_others() {
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let template = || testkit::template(vec![task.clone()], WINDOW, 3_600_000);
    // A requester whose network pins no fee terms publishes nothing.
    let mut none = config();
    none.fee = None;
    let mut m = Market::new(none.clone(), identity(0), T0);
    let err = m
        .command(
            T0,
            Command::Submit {
                template: template(),
                nonce: [1; 16],
            },
        )
        .unwrap_err();
    assert!(matches!(err, CommandError::NoFeeTerms), "{err}");
    assert!(m.poll_output().is_none());
    // Worker 1 pins the requester's terms, worker 2 others (no fee, to the requester's
    // own pocket), worker 3 none.
    let mut other = config();
    other.fee = Some(FeeTerms {
        rate_bps: 0,
        recipient: testkit::keys(0).address(),
    });
    let nodes = vec![
        Node::new(config(), identity(0), Some(testkit::keys(0)), T0),
        Node::new(config(), identity(1), Some(testkit::keys(1)), T0),
        Node::new(other, identity(2), Some(testkit::keys(2)), T0),
        Node::new(none, identity(3), Some(testkit::keys(3)), T0),
    ];
    let mut net = network(nodes, |_| Machine::default());
    let job = submit(&mut net, template(), [1; 16]);
    net.settle(T0);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(j.offer().fee, testkit::fee_terms());
    let t = &j.tasks()[0];
    let bidders: Vec<Address> = t.bids().map(|c| c.bid.worker).collect();
    assert_eq!(bidders, vec![testkit::keys(1).address()]);
    let declines = t.declines();
    assert_eq!(declines.len(), 2, "{declines:?}");
    let by_2 = &declines[&testkit::keys(2).address()];
    assert!(by_2.contains("are not the network's"), "{by_2}");
    let by_3 = &declines[&testkit::keys(3).address()];
    assert!(by_3.contains("pins no fee terms"), "{by_3}");
}

#[test]
fn a_requester_past_the_offer_rate_is_told_before_anything_is_kept() {
    // Every node takes 256 of one requester's offers at once: the requester's own node
    // refuses the next at submission, saying why, instead of keeping a job whose offer
    // every node would drop.
    let nodes = vec![Node::new(config(), identity(0), Some(testkit::keys(0)), T0)];
    let mut net = network(nodes, |_| Machine::default());
    let task = testkit::task("t", 1, 0, 0, 1, 1_000);
    let template = || testkit::template(vec![task.clone()], WINDOW, 3_600_000);
    for i in 0..256u32 {
        let mut nonce = [0; 16];
        nonce[..4].copy_from_slice(&i.to_le_bytes());
        submit(&mut net, template(), nonce);
    }
    let jobs = net.nodes[0].market.jobs().count();
    let err = net.nodes[0]
        .market
        .command(
            T0,
            Command::Submit {
                template: template(),
                nonce: [0xff; 16],
            },
        )
        .unwrap_err();
    assert!(matches!(err, CommandError::OverRate(_)), "{err}");
    assert!(err.to_string().contains("a minute"), "{err}");
    assert_eq!(net.nodes[0].market.jobs().count(), jobs);
    // A second later there is room for one more (1,200 a minute).
    let later = T0.plus_ms(1_000);
    assert!(
        net.nodes[0]
            .market
            .command(
                later,
                Command::Submit {
                    template: template(),
                    nonce: [0xfe; 16],
                },
            )
            .is_ok()
    );
}

#[test]
fn a_lease_runs_its_task_on_the_executor_and_its_end_stops_it() {
    let nodes = vec![
        Node::new(config(), identity(0), Some(testkit::keys(0)), T0),
        Node::new(config(), identity(1), Some(testkit::keys(1)), T0),
    ];
    let mut net = network(nodes, |_| Machine::default());
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let template = || testkit::template(vec![task.clone()], WINDOW, 3_600_000);
    let job = submit(&mut net, template(), [1; 16]);
    net.settle(T0);
    assert!(net.nodes[1].runs.is_empty(), "nothing runs before an award");
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    let key = (job, 0, 0);
    let id = RunOrder::request_id(&key, 1);
    // The award made a lease: the worker's executor is asked to run the task as the
    // offer published it, under a request id of the assignment and epoch.
    let Some(RunOrder::Start {
        request_id,
        key: k,
        epoch: 1,
        task: Some(t),
        until,
        ..
    }) = net.nodes[1].runs.first()
    else {
        panic!("{:?}", net.nodes[1].runs)
    };
    assert_eq!((request_id, *k), (&id, key));
    assert_eq!(**t, task);
    let first_until = *until;
    let lease = net.nodes[1].market.leases().get(&key).unwrap().clone();
    assert!(net.nodes[1].store.contains_key(&RecordKey::Lease(key)));
    // A single worker's lease is renewed as soon as it is countersigned: the executor's
    // lease end follows.
    assert_eq!(
        net.nodes[1].runs.last(),
        Some(&RunOrder::Renew {
            request_id: id.clone(),
            until: lease.expires_at
        })
    );
    assert!(lease.expires_at > first_until);

    // The executor says the work runs: the requester is told, signed, and keeps it as the
    // rank's progress.
    net.nodes[1]
        .market
        .command(
            end,
            Command::Ran {
                request_id: id.clone(),
                stage: RunStage::Running,
                detail: String::new(),
            },
        )
        .unwrap();
    net.tick(end);
    net.settle(end);
    let rank = |net: &Net| {
        net.nodes[0].market.job(&job).unwrap().tasks()[0].ranks()[0]
            .progress
            .clone()
    };
    assert_eq!(rank(&net).map(|p| p.stage), Some(RunStage::Running));

    // A renewal moves the executor's lease end with the market lease's.
    let renew_at = Timestamp(lease.expires_at.0 - (config().leases.renew_margin_ms - 1));
    net.tick(renew_at);
    net.settle(renew_at);
    let renewed = net.nodes[1].market.leases().get(&key).unwrap().expires_at;
    assert!(renewed > lease.expires_at);
    assert_eq!(
        net.nodes[1].runs.last(),
        Some(&RunOrder::Renew {
            request_id: id.clone(),
            until: renewed
        })
    );

    // A restart of the worker asks again (the executor finds the attempt by its id).
    net.nodes[1].restart(renew_at);
    let before = net.nodes[1].runs.len();
    net.tick(renew_at);
    net.settle(renew_at);
    assert!(net.nodes[1].runs.len() > before);
    assert!(matches!(
        &net.nodes[1].runs[before],
        RunOrder::Start { request_id, .. } if *request_id == id
    ));

    // The requester cancels: the worker's attempt is stopped.
    net.nodes[0]
        .market
        .command(renew_at, Command::Cancel(job))
        .unwrap();
    net.tick(renew_at);
    net.settle(renew_at);
    assert!(
        matches!(
            net.nodes[1].runs.last(),
            Some(RunOrder::Stop { request_id, why }) if *request_id == id && why.contains("cancelled")
        ),
        "{:?}",
        net.nodes[1].runs
    );
    // The attempt of an ended lease reports nothing.
    let stale = net.nodes[1].market.command(
        renew_at,
        Command::Ran {
            request_id: id.clone(),
            stage: RunStage::Completed,
            detail: String::new(),
        },
    );
    assert!(
        matches!(stale, Err(CommandError::Refused(Refusal::LeaseEnded))),
        "{stale:?}"
    );
    net.tick(renew_at);
    net.settle(renew_at);
    assert_eq!(rank(&net).map(|p| p.stage), Some(RunStage::Running));
}

#[test]
fn a_run_its_worker_reports_failed_is_placed_again_on_another() {
    let (mut net, job, end) = leased(3, testkit::task("t", 1, 0, 0, 1, 1_000_000));
    let first = net.nodes[0].market.job(&job).unwrap().tasks()[0].ranks()[0].clone();
    assert_eq!(first.epoch, 1);
    let w = (1..3)
        .find(|&i| net.nodes[i].address() == first.worker)
        .unwrap();
    // The executor refused it (say, a sandbox layer went missing): the worker says so.
    net.nodes[w]
        .market
        .command(
            end,
            Command::Ran {
                request_id: RunOrder::request_id(&(job, 0, 0), 1),
                stage: RunStage::Refused,
                detail: "the process adapter needs cgroup-pids".into(),
            },
        )
        .unwrap();
    net.tick(end);
    net.settle(end);
    let j = net.nodes[0].market.job(&job).unwrap();
    let again = &j.tasks()[0].ranks()[0];
    assert_eq!(again.epoch, 2, "{:?}", j.history());
    assert_ne!(again.worker, first.worker);
    assert!(
        j.history().iter().any(|e| e
            .text
            .contains("refused: the process adapter needs cgroup-pids")),
        "{:?}",
        j.history()
    );
    // The first worker's attempt was told to stop; the second one runs epoch 2.
    assert!(net.nodes[w].runs.iter().any(
        |o| matches!(o, RunOrder::Stop { request_id, .. } if *request_id == RunOrder::request_id(&(job, 0, 0), 1))
    ));
    let other = 3 - w;
    assert!(
        net.nodes[other]
            .runs
            .iter()
            .any(|o| matches!(o, RunOrder::Start { epoch: 2, .. }))
    );
}

#[test]
fn a_worker_whose_bid_was_refused_bids_again_when_the_bids_are_called_for_again() {
    // Node 2's ad has not reached the requester yet: its bid is refused and it forgets
    // it. Node 1 is placed and its run fails; with no bids left the requester calls for
    // them again, and node 2, its ad now held, bids on that version and is placed.
    let nodes = (0..3)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = Net::new(nodes);
    let machine = Machine::default();
    let one = net.nodes[1].address();
    let late = net.nodes[2].address();
    let env = net.nodes[1].publish_ad(T0, testkit::ad(one, &machine, T0));
    net.queue.extend(env);
    let held_back = net.nodes[2]
        .publish_ad(T0, testkit::ad(late, &machine, T0))
        .unwrap();
    net.settle(T0);
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let job = submit_task(&mut net, task, [1; 16]);
    net.settle(T0);
    assert!(
        net.nodes[2].events.iter().any(|e| matches!(
            e,
            MarketEvent::Answered { what: "bid", result: Ok(cannabis_market::Answer::Refused(why)), .. }
                if why.contains("ad")
        )),
        "{:?}",
        net.nodes[2].events
    );
    assert!(
        net.nodes[2].market.leases().bid_for(&job, 0).is_none(),
        "a refused bid is forgotten"
    );
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(j.tasks()[0].ranks()[0].worker, one, "{:?}", j.history());
    net.queue.push(held_back);
    net.settle(end);
    first_run_fails_on_node_1(&mut net, job, end);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(
        *j.tasks()[0].status(),
        TaskStatus::Running,
        "{:?}",
        j.history()
    );
    placed_again_after_one_call(&net, job, late);
}

#[test]
fn a_worker_whose_bid_never_arrived_bids_again_when_the_bids_are_called_for_again() {
    // Node 2's bid is lost on the way and never answered, so node 2 still holds it. Node 1
    // is placed and its run fails; with no bids left the requester calls for them again,
    // and node 2 bids on that version (a bid held for an earlier version is no reason to
    // stay silent) and is placed. Before, it stayed silent on every later version and the
    // task failed after its last call (seen in CI: the paused-worker scenario).
    let nodes = (0..3)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, |_| Machine::default());
    let late = net.nodes[2].address();
    let one = net.nodes[1].address();
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let job = submit_task(&mut net, task, [1; 16]);
    let lost = |e: &Envelope| {
        matches!(e, Envelope::Request { from, msg, .. }
            if *from == late && matches!(**msg, Inbound::Bid(_)))
    };
    net.run(T0, lost, 100_000);
    assert!(
        net.nodes[2].market.leases().bid_for(&job, 0).is_some(),
        "node 2 holds the bid that never arrived"
    );
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(j.tasks()[0].ranks()[0].worker, one, "{:?}", j.history());
    first_run_fails_on_node_1(&mut net, job, end);
    placed_again_after_one_call(&net, job, late);
}

#[test]
fn a_task_no_bid_reached_in_its_window_calls_for_bids_again_when_workers_qualify() {
    // The only worker's bid never arrives within the window (on a busy network it comes
    // late). The requester knows the worker qualifies, so it calls for bids again instead
    // of failing, and the worker's bid on the new version places the task. Before, the task
    // failed at the window's end: "cannot be placed: no valid bids" (seen in CI).
    let nodes = (0..2)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, |_| Machine::default());
    let worker = net.nodes[1].address();
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let job = submit_task(&mut net, task, [1; 16]);
    let lost = |e: &Envelope| {
        matches!(e, Envelope::Request { from, msg, .. }
            if *from == worker && matches!(**msg, Inbound::Bid(_)))
    };
    net.run(T0, lost, 100_000);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    let j = net.nodes[0].market.job(&job).unwrap();
    let placed = &j.tasks()[0].ranks()[0];
    assert_eq!(
        (placed.epoch, placed.worker),
        (1, worker),
        "{:?}",
        j.history()
    );
    assert!(
        j.history().iter().any(|e| e.text.starts_with(
            "no whole placement in the window: bids called for again (1 of 5, a 20 s window"
        )),
        "{:?}",
        j.history()
    );
}

#[test]
fn a_worker_that_declined_bids_on_a_later_version_that_now_fits() {
    // Node 2 takes runs of at most 3,595 s: at submission the job may run 3,600 s, so it
    // declines. Node 1's bid places the job at once (early placement); its run fails 6 s
    // later, while the first version of the offer still holds, and the bids are called
    // for again. By then the job may run 3,594 s: node 2 bids and is placed. Before, a
    // worker that declined a task stayed silent on every later version while an earlier
    // one was live, and the task failed after its last call.
    let nodes = (0..3)
        .map(|i| {
            let mut c = config();
            if i == 2 {
                c.worker.max_duration_ms = Some(3_595_000);
            }
            Node::new(c, identity(i), Some(testkit::keys(i)), T0)
        })
        .collect();
    let mut net = network(nodes, |_| Machine::default());
    let two = net.nodes[2].address();
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let mut template = testkit::template(vec![task], WINDOW, 3_600_000);
    template.early = Some(Early::FirstBids(1));
    let job = submit(&mut net, template, [1; 16]);
    net.settle(T0);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(j.tasks()[0].ranks()[0].worker, net.nodes[1].address());
    let declines = j.tasks()[0].declines();
    assert!(
        declines[&two].contains("this worker takes at most 3595 s"),
        "{declines:?}"
    );
    let failed = T0.plus_ms(6_000);
    assert!(failed < j.offer().expires_at);
    first_run_fails_on_node_1(&mut net, job, failed);
    placed_again_after_one_call(&net, job, two);
}

#[test]
fn a_group_rank_prepares_its_work_only_once_the_group_is_whole() {
    // A group of two: node 2's acceptance is lost. Node 1 holds its lease, but its work is
    // not started until the first renewal, which the requester sends when the group is
    // whole or, as here, once it stopped waiting for it.
    let nodes = (0..3)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, |_| Machine::default());
    let task = testkit::task("g", 1, 0, 0, 2, 1_000_000);
    let job = submit_task(&mut net, task, [1; 16]);
    net.settle(T0);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    let late = net.nodes[2].address();
    let lost = |e: &Envelope| {
        matches!(e, Envelope::Request { from, msg, .. }
            if *from == late && matches!(**msg, Inbound::Accept(_)))
    };
    net.run(end, lost, 100_000);
    for i in [1, 2] {
        let leases = net.nodes[i].market.leases();
        let (_, lease) = leases.iter().next().expect("a lease");
        assert!(lease.is_live() && lease.assembling);
        assert!(
            net.nodes[i].runs.is_empty(),
            "node {i} started before its group was whole: {:?}",
            net.nodes[i].runs
        );
    }
    let waited = end.plus_ms(cannabis_market::job::GROUP_RENEWAL_WAIT_MS);
    net.tick(waited);
    net.run(waited, lost, 100_000);
    let rank = net.nodes[1]
        .market
        .leases()
        .iter()
        .next()
        .map(|(k, l)| (*k, l.clone()))
        .unwrap();
    assert!(!rank.1.assembling);
    assert!(
        matches!(
            net.nodes[1].runs.as_slice(),
            [RunOrder::Start { request_id, until, group: Some(_), .. }]
                if *request_id == RunOrder::request_id(&rank.0, 1) && *until == rank.1.expires_at
        ),
        "{:?}",
        net.nodes[1].runs
    );
    assert!(
        net.nodes[2].runs.is_empty(),
        "its acceptance never arrived: no renewal"
    );
    assert_eq!(rank.0.0, job);
}

/// `n` nodes, node 0 submitting one job of `task`, run until its bid window closed and
/// it was placed and leased: the network, the job and that time.
fn leased(n: u64, task: TaskSpec) -> (Net, Uuid, Timestamp) {
    let nodes = (0..n)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = network(nodes, |_| Machine::default());
    let job = submit_task(&mut net, task, [1; 16]);
    net.settle(T0);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    (net, job, end)
}

/// An output entry as a worker seals it (the digests stand for real ones).
fn sealed(name: &str, size: u64) -> OutputDigest {
    OutputDigest {
        name: name.into(),
        digest: Digest::of(name.as_bytes()),
        size_bytes: size,
        cipher_size: size + 200,
        cipher_root: Digest::of(b"root"),
    }
}

#[test]
fn a_rank_placed_again_resumes_from_the_checkpoint_its_last_worker_sent() {
    let mut task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    task.checkpoint = Some(OutputDecl {
        name: "state".into(),
        max_bytes: 1000,
        rights: OutputRights::Exclusive,
    });
    let (mut net, job, end) = leased(3, task);
    let first = net.nodes[0].market.job(&job).unwrap().tasks()[0].ranks()[0].clone();
    let w = (1..3)
        .find(|&i| net.nodes[i].address() == first.worker)
        .unwrap();
    let id = RunOrder::request_id(&(job, 0, 0), 1);
    let sealed_as = |w: usize, net: &mut Net, seq: u64, c: OutputDigest| {
        let r = net.nodes[w].market.command(
            end,
            Command::CheckpointSealed {
                request_id: id.clone(),
                seq,
                checkpoint: c,
            },
        );
        net.drain(w, end);
        r
    };
    // The worker's attempt has a new checkpoint, sealed: the requester is told, signed,
    // and fetches it.
    sealed_as(w, &mut net, 1, sealed("state", 100)).unwrap();
    net.settle(end);
    let fetches = |net: &Net| net.nodes[0].checkpoint_fetches.clone();
    assert_eq!(fetches(&net).len(), 1);
    let note = &fetches(&net)[0];
    assert_eq!((note.seq, note.epoch, note.worker), (1, 1, first.worker));
    // One named otherwise than the task declares, or over its cap, is refused.
    sealed_as(w, &mut net, 2, sealed("other", 100)).unwrap();
    sealed_as(w, &mut net, 3, sealed("state", 1001)).unwrap();
    net.settle(end);
    assert_eq!(fetches(&net).len(), 1);
    let refused = |net: &Net| {
        net.nodes[0]
            .refusals
            .iter()
            .filter(|r| matches!(r, Refusal::BadManifest(_)))
            .count()
    };
    assert_eq!(refused(&net), 2, "{:?}", net.nodes[0].refusals);
    // Fetched and checked: the requester keeps it. The same note again is not fetched
    // again, and an older one than the one kept is not kept.
    let kept = |seq: u64| Command::CheckpointKept {
        job,
        task: 0,
        rank: 0,
        epoch: 1,
        seq,
        digest: Digest::of(b"state"),
        size_bytes: 100,
    };
    net.nodes[0].market.command(end, kept(1)).unwrap();
    net.drain(0, end);
    sealed_as(w, &mut net, 1, sealed("state", 100)).unwrap();
    net.settle(end);
    assert_eq!(fetches(&net).len(), 1);
    let held = net.nodes[0].market.job(&job).unwrap().tasks()[0]
        .checkpoints()
        .clone();
    assert_eq!(held.get(&0).map(|k| (k.epoch, k.seq)), Some((1, 1)));
    // The run fails: the rank is placed again, on the other worker, whose award pins
    // the checkpoint kept; its executor is asked to resume from it.
    net.nodes[w]
        .market
        .command(
            end,
            Command::Ran {
                request_id: id.clone(),
                stage: RunStage::Failed,
                detail: "the machine went away".into(),
            },
        )
        .unwrap();
    net.tick(end);
    net.settle(end);
    let j = net.nodes[0].market.job(&job).unwrap();
    let again = &j.tasks()[0].ranks()[0];
    assert_eq!(again.epoch, 2, "{:?}", j.history());
    let pin = Resume {
        digest: Digest::of(b"state"),
        size_bytes: 100,
    };
    assert_eq!(again.resume, Some(pin.clone()));
    let other = 3 - w;
    assert!(
        net.nodes[other].runs.iter().any(|o| matches!(
            o,
            RunOrder::Start { epoch: 2, resume: Some(r), .. } if **r == pin
        )),
        "{:?}",
        net.nodes[other].runs
    );
    // The first worker's attempt, a stale epoch now, sends no note.
    let stale = sealed_as(w, &mut net, 4, sealed("state", 100));
    assert!(
        matches!(stale, Err(CommandError::Refused(Refusal::LeaseEnded))),
        "{stale:?}"
    );
}

#[test]
fn a_completed_run_delivers_a_manifest_its_requester_fetches_and_then_the_task_is_done() {
    let mut task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    task.outputs.push(OutputDecl {
        name: "out.bin".into(),
        max_bytes: 1000,
        rights: OutputRights::Exclusive,
    });
    let (mut net, job, end) = leased(2, task);
    let key = (job, 0, 0);
    let id = RunOrder::request_id(&key, 1);
    // The run order names the requester and its offer's recipient.
    assert!(net.nodes[1].runs.iter().any(|o| matches!(o,
        RunOrder::Start { request_id, requester, deliver_to: Some(_), .. }
            if *request_id == id && *requester == net.nodes[0].address())));
    let prepared = |outputs: Vec<OutputDigest>| Command::Prepared {
        request_id: id.clone(),
        outputs,
        usage: ResourceUsage::default(),
        exit_code: Some(0),
        hardware: "test".into(),
    };

    // A manifest that breaks the terms (a missing output, one over its cap) is refused
    // and nothing is fetched.
    for bad in [
        vec![sealed("out.bin", 10), sealed(SYNTHETIC_RESULT, 10)],
        vec![
            sealed("out.bin", 1001),
            sealed(SYNTHETIC_RESULT, 10),
            sealed(SYNTHETIC_PRODUCT, 10),
        ],
        vec![
            sealed("other", 10),
            sealed(SYNTHETIC_RESULT, 10),
            sealed(SYNTHETIC_PRODUCT, 10),
        ],
    ] {
        net.nodes[1].market.command(end, prepared(bad)).unwrap();
        net.tick(end);
        net.settle(end);
        assert!(net.nodes[0].fetches.is_empty());
        assert!(
            net.nodes[0]
                .refusals
                .iter()
                .any(|r| matches!(r, Refusal::BadManifest(_))),
            "{:?}",
            net.nodes[0].refusals
        );
    }

    let good = vec![
        sealed("out.bin", 10),
        sealed(SYNTHETIC_RESULT, 10),
        sealed(SYNTHETIC_PRODUCT, 10),
    ];
    net.nodes[1]
        .market
        .command(end, prepared(good.clone()))
        .unwrap();
    net.tick(end);
    net.settle(end);
    assert_eq!(net.nodes[0].fetches.len(), 1);
    let manifest = net.nodes[0].fetches[0].clone().open().unwrap().body;
    assert_eq!(manifest.outputs, good);
    assert_eq!(manifest.epoch, 1);
    assert_eq!(manifest.exit_code, Some(0));
    // The same manifest again (a worker restarted) is taken without a second fetch.
    net.nodes[1]
        .market
        .command(end, prepared(good.clone()))
        .unwrap();
    net.tick(end);
    net.settle(end);
    assert_eq!(net.nodes[0].fetches.len(), 1);
    // A restart of the requester before the outputs arrived fetches them again.
    net.nodes[0].restart(end);
    net.nodes[0].drain(end);
    assert_eq!(net.nodes[0].fetches.len(), 2);

    // Fetched and checked: the rank is done, and so is the task.
    net.nodes[0]
        .market
        .command(
            end,
            Command::Delivered {
                job,
                task: 0,
                rank: 0,
                epoch: 1,
                outputs: good
                    .iter()
                    .map(|o| NamedDigest {
                        name: o.name.clone(),
                        digest: o.digest,
                    })
                    .collect(),
            },
        )
        .unwrap();
    net.tick(end);
    net.settle(end);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(
        *j.tasks()[0].status(),
        TaskStatus::Done,
        "{:?}",
        j.history()
    );
}

#[test]
fn a_stale_epochs_attempt_delivers_nothing() {
    let (mut net, job, end) = leased(2, testkit::task("t", 1, 0, 0, 1, 1_000_000));
    net.nodes[0]
        .market
        .command(end, Command::Cancel(job))
        .unwrap();
    net.tick(end);
    net.settle(end);
    let late = net.nodes[1].market.command(
        end,
        Command::Prepared {
            request_id: RunOrder::request_id(&(job, 0, 0), 1),
            outputs: vec![sealed(SYNTHETIC_RESULT, 10)],
            usage: ResourceUsage::default(),
            exit_code: None,
            hardware: String::new(),
        },
    );
    assert!(
        matches!(late, Err(CommandError::Refused(Refusal::LeaseEnded))),
        "{late:?}"
    );
    net.tick(end);
    net.settle(end);
    assert!(net.nodes[0].fetches.is_empty());
}

/// Strikes on the ledger weigh in placement: a struck worker's bid counts at its price
/// times one more than its strikes, whether the strike was known before the bid or comes
/// while the bid is held; a clean worker's dearer bid wins.
#[test]
fn a_struck_worker_is_passed_over_for_a_clean_one_unless_it_bids_under_half() {
    for told_before in [true, false] {
        let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
        let nodes = (0..=2)
            .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
            .collect();
        let mut net = network(nodes, |i| Machine {
            cpu_core_hour: [0, 10, 15][i as usize],
            ..Machine::default()
        });
        let (cheap, clean) = (net.nodes[1].address(), net.nodes[2].address());
        let strike = Command::Strikes([(cheap, 1)].into());
        if told_before {
            net.nodes[0].market.command(T0, strike.clone()).unwrap();
        }
        let job = submit_task(&mut net, task, [9; 16]);
        net.settle(T0);
        if !told_before {
            net.nodes[0].market.command(T0, strike).unwrap();
        }
        let prices: BTreeMap<Address, Amount> = net.nodes[0].market.job(&job).unwrap().tasks()[0]
            .bids()
            .map(|c| (c.bid.worker, c.bid.price))
            .collect();
        assert!(prices[&cheap] < prices[&clean], "{prices:?}");
        assert!(prices[&clean].0 < 2 * prices[&cheap].0, "{prices:?}");
        let end = T0.plus_ms(WINDOW);
        net.tick(end);
        net.settle(end);
        let j = net.nodes[0].market.job(&job).unwrap();
        let rank = &j.tasks()[0].ranks()[0];
        assert_eq!(rank.worker, clean, "{:#?}", j.history());
        assert_eq!(rank.price, prices[&clean]);
        assert_eq!(net.nodes[0].market.strikes_of(&cheap), 1);
        if told_before {
            assert!(
                j.history()
                    .iter()
                    .any(|e| e.text.contains("(1 strikes: weighed as")),
                "{:#?}",
                j.history()
            );
        }
    }
}

/// A bid whose connection closed before an answer came is sent again while it is valid,
/// at most three sends in all; then the worker is told it was not delivered. (One
/// dropped connection left a 99-rank group one bid short on a 100-node testnet.)
#[test]
fn a_bid_whose_connection_drops_is_sent_again_while_valid() {
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let (mut net, job) = world(1, testkit::template(vec![task], WINDOW, 3_600_000));
    // Everything but the worker's bids is delivered; each bid is lost.
    lost_on_every_send(&mut net, 1, T0, "bid", |m| matches!(m, Inbound::Bid(_)));
    assert!(net.nodes[1].events.iter().any(|e| matches!(
        e,
        MarketEvent::Answered {
            what: "bid",
            result: Err(_),
            ..
        }
    )));
    assert_eq!(
        net.nodes[0].market.job(&job).unwrap().tasks()[0].bid_count(),
        0
    );
}

#[test]
fn a_lease_acceptance_whose_connection_drops_is_sent_again_while_the_lease_holds() {
    // A dropped connection lost a rank's acceptance and with it a 99-rank group on a
    // 100-node testnet: the requester never heard that rank and the award ran out.
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let (mut net, job) = world(1, testkit::template(vec![task], WINDOW, 3_600_000));
    net.settle(T0);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    lost_on_every_send(&mut net, 1, end, "acceptance", |m| {
        matches!(m, Inbound::Accept(_))
    });
    // The requester never heard it: the rank is still only awarded.
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(
        j.tasks()[0].ranks()[0].state,
        cannabis_market::job::LeaseState::Offered
    );
}

#[test]
fn an_award_whose_connection_drops_is_sent_again_while_it_may_be_countersigned() {
    // A 99-rank group on a 100-node testnet lost eleven awards at once with their
    // connections: those ranks never heard of them, and the group waited until the awards
    // ran out.
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let (mut net, job) = world(1, testkit::template(vec![task], WINDOW, 3_600_000));
    net.settle(T0);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    lost_on_every_send(&mut net, 0, end, "award", |m| {
        matches!(m, Inbound::Award(_))
    });
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(
        j.tasks()[0].ranks()[0].state,
        cannabis_market::job::LeaseState::Offered
    );
    assert!(net.nodes[1].market.leases().iter().next().is_none());
}

#[test]
fn an_award_that_arrives_twice_is_countersigned_again_and_taken_once() {
    // The award got through but its answer did not: the requester sends it again, and
    // the worker, which holds the lease already, answers it as the first time, where it
    // used to refuse it as a stale epoch.
    let task = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    let (mut net, job) = world(1, testkit::template(vec![task], WINDOW, 3_600_000));
    net.settle(T0);
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    let at = net
        .queue
        .iter()
        .position(
            |e| matches!(e, Envelope::Request { msg, .. } if matches!(**msg, Inbound::Award(_))),
        )
        .expect("an award in flight");
    net.deliver(at, end, true);
    net.settle(end);
    let refused = |net: &Net| {
        net.nodes[1]
            .events
            .iter()
            .filter(|e| matches!(e, MarketEvent::Refused { .. }))
            .count()
    };
    let taken = |net: &Net| {
        net.nodes[1]
            .events
            .iter()
            .filter(|e| matches!(e, MarketEvent::LeaseTaken { .. }))
            .count()
    };
    assert_eq!((refused(&net), taken(&net)), (0, 1));
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(
        j.tasks()[0].ranks()[0].state,
        cannabis_market::job::LeaseState::Current,
        "{:#?}",
        j.history()
    );
    assert_eq!(net.nodes[1].market.leases().iter().count(), 1);
}

/// Task 0 of `job` is held by `worker` at epoch 2, after the requester called for bids
/// again once.
fn placed_again_after_one_call(net: &Net, job: Uuid, worker: Address) {
    let j = net.nodes[0].market.job(&job).unwrap();
    let again = &j.tasks()[0].ranks()[0];
    assert_eq!(
        (again.epoch, again.worker),
        (2, worker),
        "{:?}",
        j.history()
    );
    assert!(
        j.history().iter().any(|e| e
            .text
            .starts_with("no bids left: bids called for again (1 of 5")),
        "{:?}",
        j.history()
    );
}

/// Node 1's run of the first attempt (epoch 1) of task 0 of `job` fails at `now`, and the
/// network takes what follows.
fn first_run_fails_on_node_1(net: &mut Net, job: Uuid, now: Timestamp) {
    net.nodes[1]
        .market
        .command(
            now,
            Command::Ran {
                request_id: RunOrder::request_id(&(job, 0, 0), 1),
                stage: RunStage::Failed,
                detail: "exit status 1".into(),
            },
        )
        .unwrap();
    net.drain(1, now);
    net.settle(now);
}

/// Delivers everything in flight at `now` but node `from`'s requests that `lost` picks,
/// each of which gets no answer (its connection closed): node `from` sends one, sends it
/// again twice, and then no more.
fn lost_on_every_send(
    net: &mut Net,
    from: usize,
    now: Timestamp,
    what: &str,
    lost: impl Fn(&Inbound) -> bool,
) {
    let worker = net.nodes[from].address();
    let sends = |net: &mut Net| -> Vec<OutboundId> {
        let mut taken = Vec::new();
        let mut n = 0;
        while !net.queue.is_empty() && n < 10_000 {
            n += 1;
            match &net.queue[0] {
                Envelope::Request { from, req, msg, .. } if *from == worker && lost(msg) => {
                    taken.push(*req);
                    net.queue.remove(0);
                }
                _ => net.deliver(0, now, false),
            }
        }
        taken
    };
    let mut sent = sends(net);
    assert_eq!(sent.len(), 1, "one {what} sent");
    for send in 2..=4 {
        net.nodes[from].market.handle(
            now,
            cannabis_market::Input::Response {
                req: sent[0],
                result: Err("Connection was closed before a response was received".into()),
            },
        );
        net.drain(from, now);
        sent = sends(net);
        if send == 4 {
            assert!(sent.is_empty(), "the {what} was sent a fourth time");
        } else {
            assert_eq!(sent.len(), 1, "send {send}: the {what} went out again");
        }
    }
}
