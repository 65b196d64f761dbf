//! The confidential-execution gate: a task that requires it goes only to workers whose
//! evidence verifies (on a testnet, a `dev` attestation bound to the worker's key), and
//! where no evidence can verify it is refused before anything is published.

use cannabis_market::attest::{AttestationPolicy, dev_attestation};
use cannabis_market::testkit::net::{Net, Node};
use cannabis_market::testkit::{self, Machine};
use cannabis_market::{Command, CommandError, MarketConfig};
use cannabis_protocol::*;

use crate::lifecycle::{T0, WINDOW, config, identity};

/// A requester (node 0) and six workers: 1 to 3 cheap and without evidence, 4 carrying a
/// copy of 5's dev attestation, 5 and 6 dev-attested (6 the cheaper of the two).
fn world(policy: AttestationPolicy) -> Net {
    let config = MarketConfig {
        attestation: policy,
        ..config()
    };
    let nodes = (0..=6)
        .map(|i| Node::new(config.clone(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    let mut net = Net::new(nodes);
    for i in 1..=6u64 {
        let address = net.nodes[i as usize].address();
        let machine = Machine {
            cpu_core_hour: [0, 1, 2, 3, 4, 60, 50][i as usize],
            dev_attested: i >= 5,
            ..Machine::default()
        };
        let mut ad = testkit::ad(address, &machine, T0);
        if i == 4 {
            ad.attestation = Some(dev_attestation(&net.nodes[5].address()));
        }
        let env = net.nodes[i as usize].publish_ad(T0, ad);
        net.queue.extend(env);
    }
    net.settle(T0);
    net
}

fn confidential_task() -> TaskSpec {
    let mut task = testkit::task("secret", 1, 0, 0, 1, 1_000_000);
    task.requirements.confidential = true;
    task
}

#[test]
fn on_a_testnet_a_confidential_task_draws_bids_and_a_lease_only_from_attested_workers() {
    let mut net = world(AttestationPolicy::testnet());
    let ok = net.nodes[0]
        .market
        .command(
            T0,
            Command::Submit {
                template: testkit::template(vec![confidential_task()], WINDOW, 3_600_000),
                nonce: [1; 16],
            },
        )
        .unwrap();
    let cannabis_market::CommandOk::Submitted { job, .. } = ok else {
        panic!("{ok:?}")
    };
    net.drain(0, T0);
    net.settle(T0);
    let attested = [net.nodes[5].address(), net.nodes[6].address()];
    let j = net.nodes[0].market.job(&job).unwrap();
    let bidders: Vec<Address> = j.tasks()[0].bids().map(|c| c.bid.worker).collect();
    assert!(!bidders.is_empty());
    assert!(
        bidders.iter().all(|w| attested.contains(w)),
        "bids from {bidders:?}; only {attested:?} verify"
    );
    let end = T0.plus_ms(WINDOW);
    net.tick(end);
    net.settle(end);
    let j = net.nodes[0].market.job(&job).unwrap();
    let ranks = j.tasks()[0].ranks();
    assert_eq!(ranks.len(), 1, "{:#?}", j.history());
    // The cheapest attested worker, not the cheaper hosts without evidence (nor the one
    // carrying another's).
    assert_eq!(ranks[0].worker, attested[1], "{:#?}", j.history());

    // The same job without the requirement goes to the cheapest worker of all.
    let mut open = confidential_task();
    open.requirements.confidential = false;
    let ok = net.nodes[0]
        .market
        .command(
            end,
            Command::Submit {
                template: testkit::template(vec![open], WINDOW, 3_600_000),
                nonce: [2; 16],
            },
        )
        .unwrap();
    let cannabis_market::CommandOk::Submitted { job, .. } = ok else {
        panic!("{ok:?}")
    };
    net.drain(0, end);
    net.settle(end);
    let later = end.plus_ms(WINDOW);
    net.tick(later);
    net.settle(later);
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(j.tasks()[0].ranks()[0].worker, net.nodes[1].address());
}

#[test]
fn where_no_evidence_can_verify_a_confidential_job_is_refused_with_the_reason() {
    let mut net = world(AttestationPolicy::default());
    let refused = net.nodes[0].market.command(
        T0,
        Command::Submit {
            template: testkit::template(
                vec![
                    testkit::task("open", 1, 0, 0, 1, 1_000),
                    confidential_task(),
                ],
                WINDOW,
                3_600_000,
            ),
            nonce: [1; 16],
        },
    );
    let e = match refused {
        Err(e @ CommandError::NoConfidentialVerifier { task: 1, .. }) => e.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(
        e.contains("task 1 requires confidential execution") && e.contains("testnets only"),
        "{e}"
    );
    // Nothing was kept or sent: no job, no offer in anyone's view.
    net.drain(0, T0);
    net.settle(T0);
    assert_eq!(net.nodes[0].market.jobs().count(), 0);
    assert!(net.nodes.iter().all(|n| n.market.view().offer_count() == 0));
}
