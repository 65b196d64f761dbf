//! The market end to end on a real swarm of five nodes on loopback: a job is submitted on
//! one node, the others bid, the requester places it and the workers countersign leases;
//! a group of three gets ranks 0..2 on three distinct workers; a job nobody matches fails
//! with the requirement that excluded them.

use std::time::Duration;

use cannabis_api::{JobDetail, OfferTemplate};
use cannabis_market::job::{JobState, LeaseState, TaskStatus};
use cannabis_market::spec::JobSpec;

use crate::net::{self, TestNode, wait_for};

pub(crate) fn template(spec: &str) -> OfferTemplate {
    JobSpec::parse(spec)
        .unwrap()
        .resolve(|_| Err::<_, ()>(()))
        .unwrap()
}

pub(crate) fn job_file(name: &str, group: u32, extra: &str) -> String {
    format!(
        r#"
name = "{name}"
budget = 300_000
deadline = "10m"
bid_window = "2s"
[[task]]
name = "{name}"
group_size = {group}
[task.workload]
adapter = "synthetic"
[task.resources]
cpu = 1
memory = "64MiB"
storage = "16MiB"
{extra}
"#
    )
}

pub(crate) async fn wait_state(
    node: &TestNode,
    id: &str,
    what: &str,
    done: fn(&JobDetail) -> bool,
) -> JobDetail {
    let h = node.handle.clone();
    let id: cannabis_protocol::Uuid = id.parse().unwrap();
    wait_for(Duration::from_secs(60), what, || {
        let h = h.clone();
        async move { h.job(id).await.ok().filter(done) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_placed_and_leased_across_five_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let first = net::start(&dir.path().join("n0"), None).await;
    let mut nodes = vec![first];
    for i in 1..5 {
        let n = net::start(&dir.path().join(format!("n{i}")), Some(&nodes[0].addr)).await;
        nodes.push(n);
    }
    let refs: Vec<&TestNode> = nodes.iter().collect();
    net::wait_converged(&refs, 5).await;
    let requester = &nodes[0];
    let workers: Vec<String> = nodes[1..]
        .iter()
        .map(|n| n.handle.address().to_string())
        .collect();

    // A single-worker job: placed on one of the four workers, leased at epoch 1.
    let single = requester
        .handle
        // Long enough (a 4096 product) to still run when it is cancelled below.
        .submit_job(template(
            &job_file("single", 1, "")
                .replace(
                    "adapter = \"synthetic\"",
                    "adapter = \"synthetic\"\nentrypoint = [\"4096\"]",
                )
                .replace("memory = \"64MiB\"", "memory = \"512MiB\""),
        ))
        .await
        .unwrap();
    let job = wait_state(requester, &single.job_id, "the single job to run", |j| {
        j.tasks[0].status == TaskStatus::Running
    })
    .await;
    let t = &job.tasks[0];
    assert_eq!(t.bids.len(), 4, "every other node bid: {:?}", t.bids);
    assert_eq!(t.ranks.len(), 1);
    assert_eq!(t.ranks[0].state, LeaseState::Current);
    assert_eq!(t.ranks[0].epoch, 1);
    assert!(workers.contains(&t.ranks[0].worker.to_string()));
    assert!(job.history.iter().any(|e| e.text.contains("leased to")));

    // A group of three: ranks 0, 1, 2 on three distinct workers.
    let group = requester
        .handle
        .submit_job(template(&job_file("group", 3, "")))
        .await
        .unwrap();
    let job = wait_state(requester, &group.job_id, "the group to run", |j| {
        j.tasks[0].status == TaskStatus::Running
    })
    .await;
    let ranks = &job.tasks[0].ranks;
    assert_eq!(
        ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    let mut distinct: Vec<String> = ranks.iter().map(|r| r.worker.to_string()).collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3);
    assert!(ranks.iter().all(|r| r.state == LeaseState::Current));

    // Nobody has a GPU: the dry run says so, and the live job fails saying so.
    let gpu = template(&job_file(
        "gpu",
        1,
        "gpus = 1\n[task.requirements]\ngpu_memory = \"24GiB\"\n",
    ));
    let explained = requester.handle.explain(gpu.clone()).await.unwrap();
    let e = &explained[0].explanation;
    // The requester's own ad does not count: a node does not bid on its own offers.
    assert_eq!(e.considered, 4);
    assert!(e.qualified.is_empty());
    let lines: Vec<(String, usize)> = e
        .excluded
        .iter()
        .map(|x| (x.text.clone(), x.excluded))
        .collect();
    assert!(
        lines.contains(&("allowed GPUs >= 1".to_string(), 4)),
        "{lines:?}"
    );
    assert!(
        lines.contains(&("GPU memory >= 24 GiB".to_string(), 4)),
        "{lines:?}"
    );
    let nobody = requester.handle.submit_job(gpu).await.unwrap();
    let job = wait_state(requester, &nobody.job_id, "the GPU job to fail", |j| {
        j.summary.state == JobState::Failed
    })
    .await;
    let t = &job.tasks[0];
    assert_eq!(
        t.status.to_string(),
        "failed: cannot be placed: no valid bids"
    );
    let why = t
        .explanation
        .as_ref()
        .expect("an explanation for a job with no bids");
    assert!(
        why.excluded
            .iter()
            .any(|x| x.text == "GPU memory >= 24 GiB")
    );

    // The worker holds the lease the requester sees, at the same epoch.
    let single_job = requester
        .handle
        .job(single.job_id.parse().unwrap())
        .await
        .unwrap();
    let leased = &single_job.tasks[0].ranks[0];
    let worker = nodes
        .iter()
        .find(|n| n.handle.address() == leased.worker)
        .unwrap();
    let held = worker.handle.leases().await.unwrap();
    let lease = held.iter().find(|l| l.job_id == single.job_id).unwrap();
    assert!(lease.lease.is_live());
    assert_eq!(lease.lease.epoch, leased.epoch);
    // Cancelling the single job reaches its worker; it is over for everyone.
    let id: cannabis_protocol::Uuid = single.job_id.parse().unwrap();
    let cancelled = requester.handle.cancel_job(id).await.unwrap();
    assert_eq!(cancelled.state, JobState::Cancelled);
    let h = worker.handle.clone();
    let job_id = single.job_id.clone();
    wait_for(
        Duration::from_secs(10),
        "the worker to learn of the cancellation",
        || {
            let (h, job_id) = (h.clone(), job_id.clone());
            async move {
                let held = h.leases().await.ok()?;
                let l = held.into_iter().find(|l| l.job_id == job_id)?;
                (!l.lease.is_live()).then_some(l)
            }
        },
    )
    .await;
    drop(h);
    assert_eq!(requester.handle.jobs().await.unwrap().len(), 3);

    for n in nodes {
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restart_keeps_its_bids_and_leases() {
    let dir = tempfile::tempdir().unwrap();
    let requester = net::start(&dir.path().join("req"), None).await;
    let worker = net::start(&dir.path().join("work"), Some(&requester.addr)).await;
    net::wait_converged(&[&requester, &worker], 2).await;
    let job = requester
        .handle
        .submit_job(template(&job_file("kept", 1, "")))
        .await
        .unwrap();
    let detail = wait_state(&requester, &job.job_id, "the job to run", |j| {
        j.tasks[0].status == TaskStatus::Running
    })
    .await;
    let epoch = detail.tasks[0].ranks[0].epoch;
    worker.stop().await;

    let worker = net::start(&dir.path().join("work"), Some(&requester.addr)).await;
    let held = worker.handle.leases().await.unwrap();
    let lease = held
        .iter()
        .find(|l| l.job_id == job.job_id)
        .expect("the lease survived the restart");
    assert_eq!(lease.lease.epoch, epoch);
    worker.stop().await;
    requester.stop().await;
}

/// The worker's executor attempt for an assignment's request id, once `done` holds.
async fn worker_attempt(
    worker: &TestNode,
    request_id: &str,
    what: &str,
    done: fn(&cannabis_runtime::exec::Attempt) -> bool,
) -> cannabis_runtime::exec::Attempt {
    let h = worker.handle.clone();
    let request_id = request_id.to_string();
    wait_for(Duration::from_secs(60), what, || {
        let h = h.clone();
        let request_id = request_id.clone();
        async move {
            let ex = h.executor().await.ok()?;
            let all = tokio::task::spawn_blocking(move || ex.attempts())
                .await
                .ok()?
                .ok()?;
            all.into_iter()
                .find(|a| a.request.request_id == request_id)
                .filter(done)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_work_runs_on_the_workers_executor_and_a_cancel_stops_it() {
    use cannabis_runtime::exec::AttemptState;
    let dir = tempfile::tempdir().unwrap();
    let requester = net::start(&dir.path().join("r"), None).await;
    let worker = net::start(&dir.path().join("w"), Some(&requester.addr)).await;
    net::wait_converged(&[&requester, &worker], 2).await;

    // A synthetic task: placed, leased, and run by the worker's executor under a request
    // id of the assignment and its epoch, to completion.
    let quick = requester
        .handle
        .submit_job(template(&job_file("quick", 1, "")))
        .await
        .unwrap();
    wait_state(&requester, &quick.job_id, "the job to be leased", |j| {
        j.tasks[0].status == TaskStatus::Running
    })
    .await;
    let id = format!("lease/{}/0/0/1", quick.job_id);
    let a = worker_attempt(&worker, &id, "the leased work to complete", |a| {
        a.state.is_final()
    })
    .await;
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(a.request.renewal, cannabis_runtime::exec::Renewal::External);
    let result = a.result.as_ref().expect("a synthetic result");
    assert_eq!(result.n, 256);
    // Its stages reached the requester, signed: the rank's progress and the job's history.
    let job = wait_state(&requester, &quick.job_id, "the report of completion", |j| {
        j.tasks[0].ranks[0]
            .progress
            .as_ref()
            .is_some_and(|p| p.stage == cannabis_protocol::RunStage::Completed)
    })
    .await;
    assert!(
        job.history
            .iter()
            .any(|e| e.text.contains("(epoch 1): completed")),
        "{:?}",
        job.history
    );
    // Its result came back: sealed to the requester, fetched in checked chunks,
    // decrypted, its digest matching the signed manifest; the job is complete.
    let job = wait_state(&requester, &quick.job_id, "the job to complete", |j| {
        j.summary.state == cannabis_market::job::JobState::Completed
    })
    .await;
    let out = &job.tasks[0].delivered;
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out[0].name, "result.json");
    assert!(out.iter().all(|o| o.fetched), "{out:?}");
    // The product itself came back too: 256 x 256 little-endian i32 whose SHA-256 is
    // the result hash, so the requester can check it without recomputing it.
    assert_eq!(out[1].name, cannabis_protocol::SYNTHETIC_PRODUCT);
    let product = std::fs::read(&out[1].path).unwrap();
    assert_eq!(product.len(), 4 * 256 * 256);
    assert_eq!(cannabis_protocol::Digest::of(&product), result.result_hash);
    let bytes = std::fs::read(&out[0].path).unwrap();
    assert_eq!(
        cannabis_protocol::Digest::of(&bytes).to_string(),
        out[0].digest
    );
    let text = String::from_utf8(bytes).unwrap();
    assert!(
        text.contains(&result.result_hash.to_string()),
        "{text} should name {}",
        result.result_hash
    );
    assert!(
        job.tasks[0].spent > cannabis_protocol::Amount::ZERO,
        "{:?}",
        job.tasks[0]
    );

    // A long one: the requester's cancel reaches the worker, which stops it.
    let long = r#"
name = "long"
budget = 300_000
deadline = "10m"
bid_window = "2s"
[[task]]
name = "long"
[task.workload]
adapter = "synthetic"
entrypoint = ["4096"]
[task.resources]
cpu = 1
memory = "512MiB"
storage = "16MiB"
"#;
    let long = requester.handle.submit_job(template(long)).await.unwrap();
    let id = format!("lease/{}/0/0/1", long.job_id);
    worker_attempt(&worker, &id, "the long work to run", |a| {
        a.state == AttemptState::Running
    })
    .await;
    requester
        .handle
        .cancel_job(long.job_id.parse().unwrap())
        .await
        .unwrap();
    let a = worker_attempt(&worker, &id, "the long work to stop", |a| {
        a.state.is_final()
    })
    .await;
    assert_eq!(a.state, AttemptState::Cancelled, "{a:#?}");
    assert!(
        a.cancel
            .as_ref()
            .is_some_and(|(_, why)| why.contains("cancelled")),
        "{a:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leaseholder_fetches_packages_and_only_the_requester_fetches_outputs() {
    use cannabis_protocol::{ObjectKind, ObjectRef, TransferRequest, TransferResponse};
    let dir = tempfile::tempdir().unwrap();
    let requester = net::start(&dir.path().join("r"), None).await;
    let a = net::start(&dir.path().join("a"), Some(&requester.addr)).await;
    let b = net::start(&dir.path().join("b"), Some(&requester.addr)).await;
    net::wait_converged(&[&requester, &a, &b], 3).await;
    let quick = requester
        .handle
        .submit_job(template(&job_file("quick", 1, "")))
        .await
        .unwrap();
    let job = wait_state(&requester, &quick.job_id, "the rank to deliver", |j| {
        !j.tasks[0].delivered.is_empty()
    })
    .await;
    let worker_address = job.tasks[0].ranks[0].worker.to_string();
    let peer = |n: &TestNode| {
        let h = n.handle.clone();
        async move {
            let s = h.status().await.unwrap();
            (s.address, s.peer_id.parse::<libp2p::PeerId>().unwrap())
        }
    };
    let (_, requester_peer) = peer(&requester).await;
    let (a_address, a_peer) = peer(&a).await;
    let (_, b_peer) = peer(&b).await;
    let (worker, stranger) = if a_address == worker_address {
        ((&a, a_peer), (&b, b_peer))
    } else {
        ((&b, b_peer), (&a, a_peer))
    };
    let object = |kind, name: &str, epoch| TransferRequest {
        object: ObjectRef {
            job_id: quick.job_id.parse().unwrap(),
            task: 0,
            rank: 0,
            epoch,
            kind,
            name: name.into(),
        },
        index: 0,
    };
    let refused = |r: TransferResponse| match r {
        TransferResponse::Refused { reason } => reason,
        other => panic!("served: {other:?}"),
    };
    // A node without the lease gets none of the task's packages.
    let r = stranger
        .0
        .handle
        .transfer(requester_peer, object(ObjectKind::Bundle, "bundle", 1))
        .await
        .unwrap();
    assert!(refused(r).contains("hold no lease"));
    // Nor does the leaseholder for another epoch.
    let r = worker
        .0
        .handle
        .transfer(requester_peer, object(ObjectKind::Input, "x", 2))
        .await
        .unwrap();
    assert!(refused(r).contains("hold no lease"));
    // Outputs go to the requester only: another node asking the worker is refused.
    let r = stranger
        .0
        .handle
        .transfer(worker.1, object(ObjectKind::Output, "result.json", 1))
        .await
        .unwrap();
    // Refused from what the worker holds in memory, before anything is read from disk.
    let why = refused(r);
    assert!(why.contains("here for you"), "{why}");
    // The requester itself, for another epoch than the lease's, is refused too.
    let r = requester
        .handle
        .transfer(worker.1, object(ObjectKind::Output, "result.json", 2))
        .await
        .unwrap();
    let why = refused(r);
    assert!(why.contains("the lease is at epoch 1"), "{why}");
    // At the lease's epoch it passes those checks: served, or, once the requester has its
    // outputs and ended the lease (reason delivered), no longer there.
    let r = requester
        .handle
        .transfer(worker.1, object(ObjectKind::Output, "result.json", 1))
        .await
        .unwrap();
    match r {
        TransferResponse::Chunk { index: 0, .. } => {}
        TransferResponse::Refused { reason } => {
            assert!(reason.ends_with("at epoch 1 here"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}
