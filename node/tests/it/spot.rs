//! Spot checks on a testnet of real processes: a worker made to fabricate its outputs
//! (`cannabis testnet corrupt`) is caught by a re-run on two other workers, its delivery is
//! disputed, and once the resolver settles against it, the strike keeps the next job off it.

use std::process::Command;

use cannabis_market::job::JobState;
use cannabis_market::ledger::Stage;
use cannabis_market::spot::{RunResult, SpotVerdict};

use super::settle::{cannabis, client, stage, wait_job};

/// A process job of one task whose output depends only on its input: any honest worker
/// delivers the same bytes.
fn job_file(name: &str, spot_check: f64) -> String {
    format!(
        r#"
name = "{name}"
deadline = "10m"
bid_window = "10s"
review_window = "10m"
spot_check = {spot_check}

# Placed once every worker bid (the cheapest, the cheat, then gets it): with two honest
# workers only, a check that never met the cheat would pass.
[early]
first_bids = 3

[[task]]
name = "{name}"
budget = 300_000
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["sh", "upper.sh"]
[task.resources]
cpu = 1
memory = "256MiB"
storage = "16MiB"
[[task.inputs]]
name = "in.txt"
path = "in.txt"
[[task.outputs]]
name = "out.txt"
max_size = "1MiB"
"#
    )
}

#[test]
fn a_worker_fabricating_outputs_is_caught_by_the_spot_check_and_its_strike_moves_the_next_job() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: requesters' programs run only where the executor is root");
        return;
    }
    let dir = super::exec::open_dir();
    let net_dir = dir.path().join("net");
    let net = super::testnet::Testnet::up(&net_dir, 4);
    let nodes = net.nodes();
    // Node 0 (half a core: no worker for a one-core task) publishes; node 3 (the cheapest
    // worker, 800 a core-hour) fabricates; nodes 2 (1,400) and 1 (2,000) are honest.
    let requester = &nodes[0];
    let cheat = client(&nodes[3]).status().unwrap().address;
    let work = dir.path().join("job");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(
        work.join("upper.sh"),
        "tr a-z A-Z < \"$CANNABIS_INPUTS/in.txt\" > \"$CANNABIS_WORK/out.txt\"\n",
    )
    .unwrap();
    let ok = Command::new("tar")
        .arg("cf")
        .arg(work.join("bundle.tar"))
        .arg("-C")
        .arg(&work)
        .arg("upper.sh")
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar");
    std::fs::write(work.join("in.txt"), "checked twice\n".repeat(100)).unwrap();
    super::testnet::wait_for_workers(requester, 3);

    // Only a testnet node takes the fault, through the testnet's own command.
    let o = cannabis(
        &nodes[3],
        &[
            "testnet",
            "corrupt",
            "3",
            "--dir",
            net_dir.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let submit = |name: &str, spot: f64| {
        let path = work.join(format!("{name}.toml"));
        std::fs::write(&path, job_file(name, spot)).unwrap();
        let o = cannabis(
            requester,
            &["job", "submit", path.to_str().unwrap(), "--yes", "--json"],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["job_id"].as_str().unwrap().to_string()
    };

    // Every task is checked: the fabricated delivery disagrees with the check's run, a
    // third worker breaks the tie, and the delivery two others agree against is disputed.
    let id = submit("checked", 1.0);
    // The quote says what the checks cost, beyond the budget.
    let o = cannabis(
        requester,
        &[
            "job",
            "submit",
            work.join("checked.toml").to_str().unwrap(),
            "--dry-run",
        ],
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("spot checks: 100.0%") && text.contains("at most 600000"),
        "{text}"
    );
    let j = wait_job(requester, &id, 180, "the spot check's verdict", |j| {
        j.spot.checks.get(&0).is_some_and(|c| c.verdict.is_some())
    });
    let check = &j.spot.checks[&0];
    assert_eq!(check.runs.len(), 3, "{check:#?} {:#?}", j.history);
    let workers: Vec<String> = check
        .runs
        .iter()
        .map(|r| match &r.result {
            Some(RunResult::Delivered { worker, .. }) => worker.to_string(),
            other => panic!("a run did not deliver: {other:?}"),
        })
        .collect();
    assert!(
        workers[1] != workers[0] && workers[2] != workers[0] && workers[2] != workers[1],
        "each run on another worker: {workers:?}"
    );
    // The cheat is caught wherever it ran: the checked delivery (it asks least, so it
    // usually gets the job) or a check (when its bid came late to the checked job).
    let Some(SpotVerdict::Caught { run }) = check.verdict else {
        panic!("not caught: {check:#?} {:#?}", j.history);
    };
    let caught = &check.runs[run as usize];
    assert_eq!(workers[run as usize], cheat, "{check:#?}");
    let disputed = caught.job.to_string();
    assert_eq!(caught.task, 0);
    // The check jobs are ordinary jobs of the requester, each excluding the workers before.
    for r in &check.runs[1..] {
        let c = client(requester).job(&r.job.to_string()).unwrap();
        assert_eq!(c.spot.of.map(|o| o.job.to_string()), Some(id.clone()));
    }
    // The fabricated delivery is marked and disputed in its job: its price frozen,
    // nothing paid.
    let j = wait_job(requester, &disputed, 30, "the dispute", |j| {
        matches!(stage(j), Some(Stage::Disputed { .. }))
    });
    assert!(j.tasks[0].ranks[0].caught.is_some());
    let e = j.escrow.clone().unwrap();
    assert_eq!((e.paid_worker.0, e.paid_fee.0), (0, 0));
    let o = cannabis(requester, &["job", "status", &id]);
    let text = String::from_utf8_lossy(&o.stdout);
    let want = format!("spot check: run {run} caught");
    assert!(text.contains(&want), "{want:?} not in:\n{text}");
    let o = cannabis(requester, &["job", "status", &disputed]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("WRONG by spot check"), "{text}");

    // The resolver (the testnet's founder keys) rules against the worker: a strike.
    let o = cannabis(
        &net_dir.join("founder"),
        &[
            "ledger",
            "resolve",
            &disputed,
            "--award",
            "0",
            "--via",
            requester.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    wait_job(requester, &disputed, 30, "the resolution", |j| {
        j.escrow.as_ref().is_some_and(|e| e.is_closed())
    });
    let rating = client(requester).balance(Some(&cheat)).unwrap();
    assert!(rating.strikes >= 1, "{rating:?}");

    // The next job goes to an honest worker although the struck one bids least.
    let next = submit("after", 0.0);
    let j = wait_job(requester, &next, 60, "the next placement", |j| {
        !j.tasks[0].ranks.is_empty()
    });
    let bids = &j.tasks[0].bids;
    let chosen = j.tasks[0].ranks[0].worker.to_string();
    assert_ne!(chosen, cheat, "bids {bids:?}");
    let price_of = |w: &str| bids.iter().find(|(b, _)| b == w).map(|(_, p)| p.0);
    assert!(
        price_of(&cheat).expect("the struck worker bid again") < price_of(&chosen).unwrap(),
        "the struck worker was not the cheaper: {bids:?}"
    );
    wait_job(requester, &next, 60, "the next job's delivery", |j| {
        j.summary.state == JobState::Completed
    });
    assert!(j.spot.checks.is_empty(), "a rate of 0 checks nothing");
    drop(net);
}
