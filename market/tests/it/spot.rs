//! Spot checks in the engine, sans-IO: a drawn delivery is re-run by a check job that
//! excludes its worker, a disagreement brings a tie-break on a third worker, the run the
//! two others agree against is marked wrong, and all of it survives a restart of the
//! requester.

use cannabis_market::job::LeaseState;
use cannabis_market::spot::{RunResult, SpotVerdict};
use cannabis_market::testkit::net::{Net, Node};
use cannabis_market::testkit::{self, Machine};
use cannabis_market::{Command, MarketConfig, RunOrder};
use cannabis_protocol::*;

use crate::lifecycle::{T0, WINDOW, identity, network};

fn config() -> MarketConfig {
    MarketConfig {
        worker: cannabis_market::quote::WorkerPolicy {
            max_leases: 16,
            custom_code: true,
            ..Default::default()
        },
        fee: Some(testkit::fee_terms()),
        spot_secret: [3; 32],
        ..MarketConfig::default()
    }
}

/// A requester (node 0) and three workers, the cheapest first.
fn net() -> Net {
    let nodes = (0..4)
        .map(|i| Node::new(config(), identity(i), Some(testkit::keys(i)), T0))
        .collect();
    network(nodes, |n| Machine {
        cores: 8,
        cpu_core_hour: 10 + n,
        ..Machine::default()
    })
}

fn task() -> TaskSpec {
    let mut t = testkit::task("t", 1, 0, 0, 1, 1_000_000);
    t.workload.adapter = AdapterKind::Process;
    t.workload.entrypoint = vec!["sh".into(), "run.sh".into()];
    t.outputs.push(OutputDecl {
        name: "out.bin".into(),
        max_bytes: 1000,
        rights: OutputRights::Exclusive,
    });
    t
}

/// Places `job` (its window over at `at`), has its worker deliver `digest`, and the
/// requester take the delivery: the worker's index.
fn deliver(net: &mut Net, job: Uuid, at: Timestamp, digest: Digest) -> usize {
    net.tick(at);
    net.settle(at);
    let id = RunOrder::request_id(&(job, 0, 0), 1);
    let worker = (1..net.nodes.len())
        .find(|&i| {
            net.nodes[i]
                .runs
                .iter()
                .any(|o| matches!(o, RunOrder::Start { request_id, .. } if *request_id == id))
        })
        .unwrap_or_else(|| {
            panic!(
                "job {job} was not placed: {:?}",
                net.nodes[0].market.job(&job).map(|j| j.history().to_vec())
            )
        });
    let sealed = OutputDigest {
        name: "out.bin".into(),
        digest,
        size_bytes: 10,
        cipher_size: 210,
        cipher_root: Digest::of(b"root"),
    };
    net.nodes[worker]
        .market
        .command(
            at,
            Command::Prepared {
                request_id: id,
                outputs: vec![sealed],
                usage: ResourceUsage::default(),
                exit_code: Some(0),
                hardware: "test".into(),
            },
        )
        .unwrap();
    net.tick(at);
    net.settle(at);
    net.nodes[0]
        .market
        .command(
            at,
            Command::Delivered {
                job,
                task: 0,
                rank: 0,
                epoch: 1,
                outputs: vec![NamedDigest {
                    name: "out.bin".into(),
                    digest,
                }],
            },
        )
        .unwrap();
    net.drain(0, at);
    net.settle(at);
    worker
}

/// The check job of run `run` of job `of`'s task 0.
fn check_job(net: &Net, of: Uuid, run: usize) -> Uuid {
    let j = net.nodes[0].market.job(&of).unwrap();
    j.spot().checks[&0].runs[run].job
}

#[test]
fn a_fabricated_delivery_is_rerun_twice_and_caught_and_the_check_survives_a_restart() {
    let mut net = net();
    let mut template = testkit::template(vec![task()], WINDOW, 3_600_000);
    template.spot_check_ppm = cannabis_market::spot::PPM;
    let job = crate::lifecycle::submit(&mut net, template, [4; 16]);
    net.settle(T0);
    let (good, bad) = (Digest([1; 32]), Digest([2; 32]));

    // The cheapest worker takes the job and delivers fabricated bytes.
    let mut at = T0.plus_ms(WINDOW);
    let cheat = deliver(&mut net, job, at, bad);
    let check = check_job(&net, job, 1);
    {
        let c = net.nodes[0].market.job(&check).unwrap();
        let of = c.spot().of.unwrap();
        assert_eq!((of.job, of.task, of.run), (job, 0, 1));
        assert_eq!(c.offer().tasks[0].workload, task().workload);
    }

    // The requester restarts with the check under way: its record holds it.
    net.nodes[0].restart(at);
    net.drain(0, at);
    net.settle(at);
    assert!(net.nodes[0].market.job(&job).unwrap().spot().pending(0));

    // The check runs elsewhere and disagrees: a tie-break excludes both workers.
    at = at.plus_ms(WINDOW + 1);
    let second = deliver(&mut net, check, at, good);
    assert_ne!(second, cheat, "a check never goes to the worker it checks");
    let tie = check_job(&net, job, 2);
    at = at.plus_ms(WINDOW + 1);
    let third = deliver(&mut net, tie, at, good);
    assert!(
        third != cheat && third != second,
        "{cheat} {second} {third}"
    );

    // The two honest runs agree against the fabricated one: it is caught.
    let j = net.nodes[0].market.job(&job).unwrap();
    let c = &j.spot().checks[&0];
    assert_eq!(c.verdict, Some(SpotVerdict::Caught { run: 0 }), "{c:#?}");
    let workers: Vec<_> = c
        .runs
        .iter()
        .map(|r| match &r.result {
            Some(RunResult::Delivered { worker, .. }) => *worker,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(workers[0], net.nodes[cheat].address());
    let a = &j.tasks()[0].ranks()[0];
    assert_eq!(a.state, LeaseState::Done);
    assert!(a.found_wrong() && a.caught.as_ref().unwrap().contains("spot check"));
    // The honest check runs are not marked.
    for run in [check, tie] {
        let r = &net.nodes[0].market.job(&run).unwrap().tasks()[0].ranks()[0];
        assert!(!r.found_wrong());
    }
    assert!(
        j.history()
            .iter()
            .any(|e| e.text.contains("spot check caught")),
        "{:#?}",
        j.history()
    );
}

#[test]
fn equal_outputs_pass_and_a_rate_of_zero_checks_nothing() {
    let mut net = net();
    let mut template = testkit::template(vec![task()], WINDOW, 3_600_000);
    template.spot_check_ppm = cannabis_market::spot::PPM;
    let job = crate::lifecycle::submit(&mut net, template, [5; 16]);
    net.settle(T0);
    let mut at = T0.plus_ms(WINDOW);
    deliver(&mut net, job, at, Digest([1; 32]));
    let check = check_job(&net, job, 1);
    at = at.plus_ms(WINDOW + 1);
    deliver(&mut net, check, at, Digest([1; 32]));
    let j = net.nodes[0].market.job(&job).unwrap();
    assert_eq!(j.spot().checks[&0].verdict, Some(SpotVerdict::Agreed));
    assert_eq!(j.spot().checks[&0].runs.len(), 2, "no tie-break");
    assert!(!j.tasks()[0].ranks()[0].found_wrong());

    let template = testkit::template(vec![task()], WINDOW, 3_600_000);
    let plain = {
        let ok = net.nodes[0]
            .market
            .command(
                at,
                Command::Submit {
                    template,
                    nonce: [6; 16],
                },
            )
            .unwrap();
        let cannabis_market::CommandOk::Submitted { job, .. } = ok else {
            panic!("{ok:?}")
        };
        job
    };
    net.drain(0, at);
    net.settle(at);
    let jobs_before = net.nodes[0].market.jobs().count();
    deliver(&mut net, plain, at.plus_ms(WINDOW + 1), Digest([9; 32]));
    assert!(
        net.nodes[0]
            .market
            .job(&plain)
            .unwrap()
            .spot()
            .checks
            .is_empty()
    );
    assert_eq!(net.nodes[0].market.jobs().count(), jobs_before);
}
