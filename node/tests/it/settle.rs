//! Settlement on a testnet of real `cannabis` processes, driven as a requester drives it
//! (`cannabis job submit|accept|dispute`): the budget is locked before any award; an
//! accepted delivery pays the worker its price less the 1% fee, the fee to the pinned
//! recipient and the rest back to the requester (balances before and after); an
//! undisputed delivery is paid when its review window ends; a dispute freezes the money
//! until the network's resolver settles it; a job whose deadline passes gets its budget
//! back in full; an offer on other fee terms than the network's is declined.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use cannabis_api::{ApiClient, JobDetail};
use cannabis_market::job::{Escrowed, JobState};
use cannabis_market::ledger::{Escrow, Stage};
use cannabis_protocol::{Outcome, TxType};

use super::testnet::Testnet;

pub(crate) fn cannabis(data_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .output()
        .unwrap()
}

/// Submits the job file at `job` from the node at `requester`, confirmed; its id.
pub(crate) fn submit_file(requester: &Path, job: &Path) -> String {
    let o = cannabis(
        requester,
        &["job", "submit", job.to_str().unwrap(), "--yes", "--json"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_string()
}

pub(crate) fn client(dir: &Path) -> ApiClient {
    ApiClient::from_data_dir(dir).unwrap()
}

fn balance(dir: &Path, who: &str) -> u64 {
    client(dir).balance(Some(who)).unwrap().balance.0
}

/// A synthetic job of one rank: its budget, review window and deadline, and the product
/// size it runs (larger runs longer).
fn job_file(name: &str, review: &str, deadline: &str, size: u32) -> String {
    format!(
        r#"
name = "{name}"
deadline = "{deadline}"
bid_window = "2s"
review_window = "{review}"
[[task]]
name = "{name}"
budget = 300_000
[task.workload]
adapter = "synthetic"
entrypoint = ["{size}"]
[task.resources]
cpu = 1
memory = "512MiB"
storage = "16MiB"
"#
    )
}

/// Publishes `file` from `node` with `cannabis job submit --yes`: its job id.
fn submit(node: &Path, dir: &Path, name: &str, file: &str) -> String {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, file).unwrap();
    submit_file(node, &path)
}

/// Waits up to `secs` for `what` to hold of the job (as `node` sees it).
pub(crate) fn wait_job(
    node: &Path,
    id: &str,
    secs: u64,
    what: &str,
    done: impl Fn(&JobDetail) -> bool,
) -> JobDetail {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        let j = client(node).job(id).unwrap();
        if done(&j) {
            return j;
        }
        assert!(
            Instant::now() < until,
            "waited {secs} s for {what}: escrow {:#?}, history {:#?}",
            j.escrow,
            j.history
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn closed(j: &JobDetail) -> bool {
    j.escrow.as_ref().is_some_and(Escrow::is_closed)
}

pub(crate) fn stage(j: &JobDetail) -> Option<Stage> {
    j.escrow
        .as_ref()
        .and_then(|e| e.assignments.get(&(0, 0)))
        .map(|a| a.stage.clone())
}

#[test]
fn jobs_lock_before_award_and_settle_by_acceptance_window_dispute_and_deadline() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: leased work runs only where the executor is root");
        return;
    }
    let dir = super::exec::open_dir();
    let net = Testnet::up(&dir.path().join("net"), 4);
    let nodes = net.nodes();
    // Node 1 is the requester: not the sequencer (its transactions travel to node 0) and
    // collecting no network fees, so its balance moves only by its own jobs.
    let requester = &nodes[1];
    let me = client(requester).status().unwrap().address;
    let ledger = client(requester).ledger().unwrap();
    let recipient = ledger.fee_recipient.clone();
    assert_eq!(ledger.fee_rate_bps, 100);
    let work = dir.path().join("jobs");
    std::fs::create_dir_all(&work).unwrap();

    // The workers' ads must be known before the job is published.
    super::testnet::wait_for_workers(requester, 3);

    // The quote a requester sees before publishing names the network fee and the window.
    let quote_file = work.join("quote.toml");
    std::fs::write(&quote_file, job_file("quote", "90s", "5m", 64)).unwrap();
    let o = cannabis(
        requester,
        &["job", "submit", quote_file.to_str().unwrap(), "--dry-run"],
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for want in ["network fee", "review window", "90 s", &recipient, "1.00%"] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }

    // 1. Lock, deliver, accept: the worker gets its price less the fee, the recipient the
    // fee, the requester the rest of its budget back.
    let r0 = balance(requester, &me);
    let f0 = balance(requester, &recipient);
    let before: std::collections::HashMap<String, u64> = nodes
        .iter()
        .map(|n| {
            let a = client(n).status().unwrap().address;
            let b = balance(requester, &a);
            (a, b)
        })
        .collect();
    let id = submit(
        requester,
        &work,
        "accepted",
        &job_file("accepted", "10m", "5m", 64),
    );
    let j = wait_job(requester, &id, 120, "delivery", |j| {
        j.summary.state == JobState::Completed && matches!(stage(j), Some(Stage::Delivered { .. }))
    });
    assert_eq!(j.escrowed, Escrowed::Locked);
    // The requester checked the delivered product without recomputing it.
    let j = wait_job(requester, &id, 30, "the product's check", |j| {
        j.tasks[0].ranks[0].product.is_some()
    });
    assert_eq!(
        j.tasks[0].ranks[0].product,
        Some(cannabis_market::job::ProductVerdict::Passed)
    );
    let o = cannabis(requester, &["job", "status", &id]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("product checked"), "{text}");
    let history = |j: &JobDetail| j.history.iter().map(|e| e.text.clone()).collect::<Vec<_>>();
    let h = history(&j);
    let locked_at = h
        .iter()
        .position(|t| t == "budget locked in escrow")
        .unwrap();
    let placed_at = h.iter().position(|t| t.starts_with("placed")).unwrap();
    assert!(locked_at < placed_at, "no award before the lock: {h:#?}");
    let worker = j.tasks[0].ranks[0].worker.to_string();
    let price = j.tasks[0].ranks[0].price.0;
    let w0 = before[&worker];
    let o = cannabis(requester, &["job", "accept", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j = wait_job(requester, &id, 30, "the acceptance to settle", closed);
    let e = j.escrow.clone().unwrap();
    let fee = price / 100;
    assert_eq!(e.paid_fee.0, fee);
    assert_eq!(e.paid_worker.0, price - fee);
    assert_eq!(e.refunded.unwrap().0, 300_000 - price);
    assert_eq!(
        e.paid_worker.0 + e.paid_fee.0 + e.refunded.unwrap().0,
        e.locked.0
    );
    assert!(matches!(
        stage(&j),
        Some(Stage::Settled {
            outcome: Outcome::Accepted,
            ..
        })
    ));
    // Balances as the requester's node sees them: exact, the network fees apart.
    let gas = TxType::EscrowLock.gas_limit()
        + TxType::EscrowAssign.gas_limit()
        + TxType::EscrowSettle.gas_limit();
    assert_eq!(balance(requester, &me), r0 - price - gas);
    assert_eq!(balance(requester, &recipient), f0 + fee);
    let sequencer = client(requester).ledger().unwrap().sequencer;
    if worker != sequencer {
        // It paid the network fee of its commitment (the sequencer collects fees).
        assert_eq!(
            balance(requester, &worker),
            w0 + price - fee - TxType::ResultCommit.gas_limit()
        );
    }
    let o = cannabis(requester, &["job", "status", &id]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("escrow: 300000 locked, closed"), "{text}");

    // 2, 3, 4 together: a delivery nobody judges, one disputed, one past its deadline.
    let silent = submit(
        requester,
        &work,
        "silent",
        &job_file("silent", "4s", "5m", 64),
    );
    let disputed = submit(
        requester,
        &work,
        "disputed",
        &job_file("disputed", "8s", "5m", 64),
    );

    // A product of 4096 runs for many seconds on one core: past an 8 s deadline. (Its
    // cancel at the deadline is not sent: the escrow's own timeout refunds it, and a
    // cancel racing that timeout would be dropped and hold the requester's next
    // transactions, such as the lock of the job after the strike below.)
    let late = submit(
        requester,
        &work,
        "late",
        &job_file("late", "1m", "8s", 4096),
    );

    // The requester goes quiet: the worker is paid when the window ends.
    let j = wait_job(requester, &silent, 120, "the window to pay", closed);
    assert!(matches!(
        stage(&j),
        Some(Stage::Settled {
            outcome: Outcome::ReviewWindowElapsed,
            ..
        })
    ));
    let e = j.escrow.unwrap();
    assert!(e.paid_worker.0 > 0 && e.paid_fee.0 == (e.paid_worker.0 + e.paid_fee.0) / 100);

    // A dispute inside the window freezes the money well past the window's end.
    wait_job(requester, &disputed, 120, "the delivery", |j| {
        matches!(stage(j), Some(Stage::Delivered { .. })) && j.summary.state == JobState::Completed
    });
    let o = cannabis(
        requester,
        &[
            "job",
            "dispute",
            &disputed,
            "--reason",
            "the loss did not fall",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    wait_job(requester, &disputed, 30, "the dispute", |j| {
        matches!(stage(j), Some(Stage::Disputed { .. }))
    });
    std::thread::sleep(Duration::from_secs(10));
    let j = client(requester).job(&disputed).unwrap();
    assert!(
        matches!(stage(&j), Some(Stage::Disputed { .. })),
        "{:?}",
        j.escrow
    );
    let e = j.escrow.unwrap();
    assert_eq!((e.paid_worker.0, e.paid_fee.0, e.refunded), (0, 0, None));
    assert!(
        j.history
            .iter()
            .any(|h| h.text.contains("the loss did not fall")),
        "{:#?}",
        j.history
    );

    // The resolver (the testnet's founder keys) settles it: half the price to the worker
    // side, the rest back to the requester, and a strike on the worker's rating.
    let a = e.assignments[&(0, 0)].clone();
    let half = a.price.0 / 2;
    let founder = net.dir.join("founder");
    let o = cannabis(
        &founder,
        &[
            "ledger",
            "resolve",
            &disputed,
            "--award",
            &half.to_string(),
            "--via",
            requester.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j = wait_job(requester, &disputed, 30, "the resolution", closed);
    let e = j.escrow.unwrap();
    assert_eq!(e.paid_worker.0 + e.paid_fee.0, half);
    assert_eq!(e.paid_fee.0, half / 100);
    assert_eq!(e.refunded.unwrap().0, e.locked.0 - half);
    let rating = client(requester)
        .balance(Some(&a.worker.to_string()))
        .unwrap();
    assert!(rating.strikes >= 1, "{rating:?}");
    // Placement weighs the strike: the next job goes to a clean worker although the struck
    // one bids less (a strike doubles a bid's weight).
    let struck = a.worker.to_string();
    let next = submit(
        requester,
        &work,
        "after-strike",
        &job_file("after-strike", "10m", "5m", 64),
    );
    let j = wait_job(requester, &next, 60, "the next placement", |j| {
        !j.tasks[0].ranks.is_empty()
    });
    let bids = &j.tasks[0].bids;
    let price_of = |w: &str| bids.iter().find(|(b, _)| b == w).map(|(_, p)| p.0);
    let struck_bid = price_of(&struck).expect("the struck worker bid again");
    let chosen = j.tasks[0].ranks[0].worker.to_string();
    assert_ne!(chosen, struck, "bids {bids:?}");
    assert!(
        struck_bid < price_of(&chosen).unwrap(),
        "the struck worker was not the cheaper: {bids:?}"
    );
    assert!(
        j.history
            .iter()
            .any(|e| e.text.contains("strikes: weighed as")),
        "{:#?}",
        j.history
    );
    wait_job(requester, &next, 60, "the next job's delivery", |j| {
        j.summary.state == JobState::Completed
    });
    // Only the resolver may: the requester's own keys are refused.
    let o = cannabis(
        requester,
        &[
            "ledger",
            "resolve",
            &disputed,
            "--award",
            "1",
            "--via",
            requester.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not this network's resolver"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // Past its deadline undelivered: the whole budget comes back, no fee.
    let j = wait_job(requester, &late, 120, "the late job's refund", closed);
    assert_eq!(j.summary.state, JobState::Failed);
    let e = j.escrow.unwrap();
    assert_eq!((e.paid_worker.0, e.paid_fee.0), (0, 0));
    assert_eq!(e.refunded, Some(e.locked));

    // Every node's ledger agrees on the fee recipient's balance.
    let fees = balance(requester, &recipient);
    for n in &nodes {
        let until = Instant::now() + Duration::from_secs(20);
        while balance(n, &recipient) != fees {
            assert!(Instant::now() < until, "{} disagrees", n.display());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    // A requester outside the network's terms (no genesis, the 1% to its own address)
    // gets no bids: every worker declines, naming the fee terms.
    let outsider = dir.path().join("outsider");
    let o = cannabis(&outsider, &["keys", "new"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pocket = String::from_utf8(cannabis(&outsider, &["keys", "address"]).stdout).unwrap();
    let pocket = pocket.trim();
    let config = outsider.join("node.toml");
    std::fs::write(
        &config,
        format!("[gossip.fee]\nrate_bps = 100\nrecipient = \"{pocket}\"\n"),
    )
    .unwrap();
    let first = client(&nodes[0]).status().unwrap();
    let tcp = first
        .listen_addrs
        .iter()
        .find(|a| a.starts_with("/ip4/127.0.0.1/tcp/"))
        .unwrap();
    let bootstrap = format!("{tcp}/p2p/{}", first.peer_id);
    let args: Vec<String> = [
        env!("CARGO_BIN_EXE_cannabis"),
        "--data-dir",
        outsider.to_str().unwrap(),
        "node",
        "run",
        "--testnet",
        "--no-mdns",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--api",
        "127.0.0.1:0",
        "--bootstrap",
        &bootstrap,
        "--config",
        config.to_str().unwrap(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let _outsider_node = super::testnet::Restarted::start(&args);
    let until = Instant::now() + Duration::from_secs(60);
    while ApiClient::from_data_dir(&outsider)
        .and_then(|c| c.get::<Vec<cannabis_api::Ad>>("/v1/market/ads"))
        .map_or(0, |a| a.iter().filter(|a| !a.adapters.is_empty()).count())
        < 3
    {
        assert!(Instant::now() < until, "the outsider heard no ads");
        std::thread::sleep(Duration::from_millis(200));
    }
    let id = submit(
        &outsider,
        &work,
        "outsider",
        &job_file("outsider", "1m", "5m", 64),
    );
    let j = wait_job(&outsider, &id, 60, "the outsider's job to fail", |j| {
        j.summary.state == JobState::Failed
    });
    assert_eq!(j.escrowed, Escrowed::Unsettled);
    let t = &j.tasks[0];
    assert!(t.bids.is_empty(), "{:?}", t.bids);
    assert!(
        !t.declines.is_empty()
            && t.declines
                .iter()
                .all(|(_, why)| why.contains("fee terms") && why.contains(pocket)),
        "{:?} {:#?}",
        t.declines,
        j.history
    );
    drop(net);
}

#[test]
fn a_requester_locks_more_budgets_at_once_than_the_sequencer_holds_for_one_sender() {
    // The sequencer holds 64 waiting transactions per sender and refuses the rest: a
    // requester (not the sequencer) with 80 locks to send keeps no more than 48 at the
    // sequencer and sends the rest as blocks take them. Before, the 65th and later were
    // refused and their jobs failed.
    let dir = tempfile::tempdir().unwrap();
    let net_dir = dir.path().join("net");
    let net = Testnet::up(&net_dir, 2);
    let nodes = net.nodes();
    let requester = ApiClient::from_data_dir(&nodes[1]).unwrap();
    // The sequencer (node 0) is down while the jobs are submitted: their locks cannot be
    // delivered, and all are due together once it is back.
    let testnet = |what: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_cannabis"))
            .args(["testnet", what, "0", "--dir", net_dir.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    testnet("kill");
    let ids: Vec<String> = (0..80)
        .map(|k| {
            let mut t = cannabis_testnet::bench::bench_offer(k);
            t.name = Some(format!("lock-{k}"));
            requester.submit_job(&t).unwrap().job_id
        })
        .collect();
    testnet("restart");
    let until = Instant::now() + Duration::from_secs(90);
    loop {
        let jobs: Vec<JobDetail> = ids.iter().map(|id| requester.job(id).unwrap()).collect();
        for j in &jobs {
            assert_ne!(
                j.summary.state,
                JobState::Failed,
                "{}: {:#?}",
                j.summary.job_id,
                j.history
            );
        }
        let locked = jobs
            .iter()
            .filter(|j| j.escrowed == Escrowed::Locked)
            .count();
        if locked == ids.len() {
            break;
        }
        assert!(
            Instant::now() < until,
            "{locked} of {} budgets locked after 90 s",
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
