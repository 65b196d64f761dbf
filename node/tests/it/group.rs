//! A group's private channel between real `cannabis` processes: the ranks of a group job,
//! each in its own sandbox, reach rank 0's service through the swarm, and a peer outside
//! the roster reaches nothing.

use std::time::Duration;

use futures::{AsyncReadExt as _, AsyncWriteExt as _, StreamExt as _};
use libp2p::{Multiaddr, PeerId, identity, noise, tcp, yamux};

use super::settle::{client, wait_job};
use super::testnet::{Testnet, wait_for_workers};

pub(crate) const JOB: &str = r#"
name = "all-reduce"
deadline = "10m"
bid_window = "5s"

[early]
first_bids = 3

[[task]]
name = "sum"
budget = 900_000
group_size = 3
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["python3", "allreduce.py"]
[task.resources]
cpu = 1
memory = "128MiB"
storage = "8MiB"
[[task.outputs]]
name = "sum.txt"
max_size = "1KiB"
"#;

/// A sum all-reduce over rank 0's rendezvous with nothing but Python's standard library
/// (the demo's `testnet/demo/sum.py`): `all_reduce_sum(value, hold)`.
const SUM: &str = include_str!("../../../testnet/demo/sum.py");

/// Each rank's value is 10 times its rank plus one; rank 0 holds its service open a
/// little, for the stranger. Each rank also lists its interfaces, and ranks 1 and 2 meet
/// directly (rank 2 connects to a port of rank 1's).
const PROGRAM: &str = r#"
import os, socket, time
from sum import all_reduce_sum

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
total = all_reduce_sum(10 * (rank + 1), hold=8)
names = sorted(n for _, n in socket.if_nameindex())
# Ranks 1 and 2 also meet directly, without rank 0 (the group's mesh).
mesh = "-"
if rank == 1:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("10.29.0.2", 29601))
    srv.listen(1)
    c, _ = srv.accept()
    c.sendall(b"mesh")
    c.close()
    mesh = "served"
elif rank == 2:
    deadline = time.time() + 60
    while True:
        try:
            s = socket.create_connection(("10.29.0.2", 29601), timeout=10)
            mesh = s.recv(4).decode()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
with open(os.path.join(os.environ["CANNABIS_WORK"], "sum.txt"), "w") as f:
    f.write(f"rank {rank} of {world}: {total} over {names}, {mesh}\n")
"#;

/// A testnet of `nodes` real processes whose node 0 submits `job`, the bundle holding
/// `program` as `allreduce.py`: the testnet (stopped when dropped) and the job's id.
fn submit_group(dir: &std::path::Path, nodes: u32, job: &str, program: &str) -> (Testnet, String) {
    let net = Testnet::up(&dir.join("net"), nodes);
    let requester = net.nodes()[0].clone();
    wait_for_workers(&requester, nodes as usize);
    let id = submit_bundle(&requester, &dir.join("job"), job, program);
    (net, id)
}

/// Submits `job` from `requester`, its bundle holding `program` as `allreduce.py` (and
/// [`SUM`] as `sum.py`), made in `work`: the job's id.
pub(crate) fn submit_bundle(
    requester: &std::path::Path,
    work: &std::path::Path,
    job: &str,
    program: &str,
) -> String {
    std::fs::create_dir_all(work).unwrap();
    super::delivery::tar(work, &[("allreduce.py", program), ("sum.py", SUM)]);
    std::fs::write(work.join("job.toml"), job).unwrap();
    super::settle::submit_file(requester, &work.join("job.toml"))
}

/// Waits (up to `secs`) for job `id` of `requester` to end, and checks that it completed
/// (its history, if not).
pub(crate) fn completed(
    requester: &std::path::Path,
    id: &str,
    secs: u64,
) -> cannabis_api::JobDetail {
    let done = wait_job(requester, id, secs, "the job to finish", |j| {
        j.summary.state != cannabis_market::job::JobState::Open
    });
    assert_eq!(
        done.summary.state,
        cannabis_market::job::JobState::Completed,
        "{:#?}",
        done.history
    );
    done
}

/// Each rank's `sum.txt` as delivered, sorted.
pub(crate) fn sums(done: &cannabis_api::JobDetail) -> Vec<String> {
    let mut sums: Vec<String> = done.tasks[0]
        .delivered
        .iter()
        .filter(|o| o.name == "sum.txt" && o.fetched)
        .map(|o| std::fs::read_to_string(&o.path).unwrap().trim().to_string())
        .collect();
    sums.sort();
    sums
}

#[test]
fn three_ranks_sum_through_the_channel_and_a_stranger_reaches_nothing() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: requesters' programs run only where the executor is root");
        return;
    }
    let dir = super::exec::open_dir();
    // Node 0 (a quarter of the machine: no whole core) publishes; 1 to 3 work.
    let (net, id) = submit_group(dir.path(), 4, JOB, PROGRAM);
    let nodes = net.nodes();
    let requester = &nodes[0];

    // While rank 0 still serves: a stranger (a fresh key, not in the roster) opens a
    // group stream to rank 0's node naming the group attempt, as rank 1.
    let running = wait_job(requester, &id, 120, "the three ranks to run", |j| {
        j.tasks[0].ranks.len() == 3
            && j.tasks[0].ranks.iter().all(|r| {
                r.progress.as_ref().is_some_and(|p| {
                    matches!(
                        p.stage,
                        cannabis_protocol::RunStage::Running
                            | cannabis_protocol::RunStage::Completed
                    )
                })
            })
    });
    // The ranks' endpoints live in their sandboxes' own network namespaces: nothing of
    // the group listens on the machine's loopback (the port is free here), nor anywhere
    // else.
    drop(
        std::net::TcpListener::bind("127.0.0.1:29500")
            .expect("the rendezvous port is taken on the machine's own loopback"),
    );
    let zero = running.tasks[0]
        .ranks
        .iter()
        .find(|r| r.rank == 0)
        .unwrap()
        .worker
        .to_string();
    let zero = nodes
        .iter()
        .find(|d| client(d).status().unwrap().address == zero)
        .expect("rank 0's worker is a node of the testnet");
    let held = client(zero).leases().unwrap();
    let lease = held
        .iter()
        .find(|l| l.job_id == id)
        .expect("rank 0's node holds the lease");
    let rendezvous = lease
        .lease
        .rendezvous
        .as_ref()
        .expect("a group lease names its rendezvous");
    let status = client(zero).status().unwrap();
    let target: PeerId = status.peer_id.parse().unwrap();
    let addr: Multiaddr = status
        .listen_addrs
        .iter()
        .find(|a| a.contains("/tcp/"))
        .unwrap()
        .parse()
        .unwrap();
    let got = tokio::runtime::Runtime::new().unwrap().block_on(stranger(
        target,
        addr,
        rendezvous.id,
        lease.lease.epoch,
    ));
    assert_eq!(got, 0, "the stranger's stream carried {got} bytes back");

    // Every rank's output shows the sum of the three values.
    let done = completed(requester, &id, 120);
    assert_eq!(
        sums(&done),
        [
            "rank 0 of 3: 60 over ['cnb0', 'lo'], -",
            "rank 1 of 3: 60 over ['cnb0', 'lo'], served",
            "rank 2 of 3: 60 over ['cnb0', 'lo'], mesh"
        ],
        "each rank's output"
    );
    // The three awards were bound in the escrow by one transaction of the requester's.
    let api = client(requester);
    let me = api.status().unwrap().address;
    let mut assigning = Vec::new();
    for b in api.blocks(1_000).unwrap() {
        for tx in api.block(b.height).unwrap().transactions {
            if tx.from == me && tx.kind.starts_with("ESCROW_ASSIGN") {
                assigning.push(tx.kind);
            }
        }
    }
    assert_eq!(assigning, ["ESCROW_ASSIGN_MANY"]);
    let escrow = api.escrow(&id).unwrap();
    let mut assigned: Vec<(u32, String, u64)> = escrow
        .assignments
        .iter()
        .map(|((_, rank), a)| (*rank, a.worker.to_string(), a.epoch))
        .collect();
    assigned.sort();
    let mut ranks: Vec<(u32, String, u64)> = done.tasks[0]
        .ranks
        .iter()
        .map(|r| (r.rank, r.worker.to_string(), r.epoch))
        .collect();
    ranks.sort();
    assert_eq!(assigned, ranks);
    // The stranger's try is in rank 0's node's log, refused.
    let log = std::fs::read_to_string(zero.join("node.log")).unwrap_or_default();
    assert!(
        log.contains("group stream refused") && log.contains("is not this peer"),
        "rank 0's node did not say it refused the stranger"
    );
}

/// Opens a group stream as a stranger and sends an opening as rank 1 and a handshake
/// message; the bytes that came back before the stream ended.
async fn stranger(
    target: PeerId,
    addr: Multiaddr,
    rendezvous: cannabis_protocol::Uuid,
    epoch: u64,
) -> usize {
    let mut swarm =
        libp2p::SwarmBuilder::with_existing_identity(identity::Keypair::generate_ed25519())
            .with_tokio()
            .with_tcp(
                tcp::Config::default(),
                noise::Config::new,
                yamux::Config::default,
            )
            .unwrap()
            .with_behaviour(|_| libp2p_stream::Behaviour::new())
            .unwrap()
            .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(30)))
            .build();
    let mut control = swarm.behaviour().new_control();
    swarm
        .dial(addr.with(libp2p::multiaddr::Protocol::P2p(target)))
        .unwrap();
    tokio::spawn(async move {
        loop {
            swarm.select_next_some().await;
        }
    });
    let mut stream = tokio::time::timeout(
        Duration::from_secs(10),
        control.open_stream(target, cannabis_node::group::GROUP_PROTOCOL),
    )
    .await
    .expect("opening the stream timed out")
    .expect("the node takes group streams");
    let opening = cannabis_node::group::Opening {
        rendezvous,
        epoch,
        from: 1,
        to: 0,
    }
    .encode();
    let mut frame = (opening.len() as u16).to_be_bytes().to_vec();
    frame.extend_from_slice(&opening);
    // What a first handshake message looks like in size (psk, e, es, ss: 32 + 48 + 16).
    frame.extend_from_slice(&96u16.to_be_bytes());
    frame.extend_from_slice(&[7u8; 96]);
    let _ = stream.write_all(&frame).await;
    let _ = stream.flush().await;
    let mut back = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut back)).await;
    back.len()
}

const TORCH_JOB: &str = r#"
name = "torch-all-reduce"
deadline = "10m"
bid_window = "5s"

[early]
first_bids = 2

[[task]]
name = "sum"
budget = 900_000
group_size = 2
restarts = 1
[task.workload]
adapter = "torchrun"
bundle = "bundle.tar"
entrypoint = ["allreduce.py"]
[task.resources]
cpu = 1
memory = "2GiB"
storage = "64MiB"
[[task.outputs]]
name = "sum.txt"
max_size = "1KiB"
"#;

/// A gloo all-reduce with PyTorch itself: the store at rank 0 and gloo's own connections
/// between the ranks both go through the group's channel. Rank 1's worker is killed in
/// the first round, after a first all-reduce: torchrun ends, and both ranks start again
/// under the task's restart budget (torchrun's port then comes from `PET_MASTER_PORT`).
const TORCH_PROGRAM: &str = r#"
import os, torch, torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ["CANNABIS_RESTART"])
small = torch.tensor([10.0 * (rank + 1)])
dist.all_reduce(small)
if rank == 1 and restart == 0:
    os.kill(os.getpid(), 9)
big = torch.ones(1 << 20) * (rank + 1)
dist.all_reduce(big)
with open(os.path.join(os.environ["CANNABIS_WORK"], "sum.txt"), "w") as f:
    f.write(f"rank {rank} of {world}, round {restart}: {small.item():.0f} {big.sum().item():.0f}\n")
dist.destroy_process_group()
"#;

/// Whether the machine's Python has PyTorch with gloo (what the sandbox's `torchrun`
/// runs).
fn has_torch() -> bool {
    cannabis_runtime::exec::torchrun_installed()
        && std::process::Command::new("/usr/bin/python3")
            .args([
                "-c",
                "import torch.distributed as d; assert d.is_gloo_available()",
            ])
            .output()
            .is_ok_and(|o| o.status.success())
}

#[test]
fn two_ranks_all_reduce_with_torchrun_and_gloo_through_the_channel() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: requesters' programs run only where the executor is root");
        return;
    }
    if !has_torch() {
        eprintln!("skipped: PyTorch (torchrun, gloo) is not installed (Debian: python3-torch)");
        return;
    }
    let dir = super::exec::open_dir();
    let (net, id) = submit_group(dir.path(), 3, TORCH_JOB, TORCH_PROGRAM);
    let nodes = net.nodes();
    let requester = &nodes[0];
    let done = wait_job(requester, &id, 240, "the job to finish", |j| {
        j.summary.state != cannabis_market::job::JobState::Open
    });
    let logs: String = nodes
        .iter()
        .map(|n| std::fs::read_to_string(n.join("node.log")).unwrap_or_default())
        .collect();
    assert_eq!(
        done.summary.state,
        cannabis_market::job::JobState::Completed,
        "{:#?}\n{}",
        done.history,
        &logs[logs.len().saturating_sub(20_000)..]
    );
    assert_eq!(
        sums(&done),
        [
            "rank 0 of 2, round 1: 30 3145728",
            "rank 1 of 2, round 1: 30 3145728"
        ],
        "each rank's output"
    );
    // `job results` puts each rank's part in a folder of its own.
    let out = dir.path().join("results");
    let o = super::settle::cannabis(
        requester,
        &["job", "results", &id, "--out", out.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for rank in [0, 1] {
        let part = std::fs::read_to_string(out.join(format!("rank-{rank}/sum.txt"))).unwrap();
        assert!(part.starts_with(&format!("rank {rank} of 2")), "{part}");
    }
}

/// A two-rank job that may restart once: `{mode}` is `once` (rank 1 is killed at step 3 of
/// the first round only) or `always` (at its first step of every round).
fn restart_job(mode: &str) -> String {
    format!(
        r#"
name = "restarts-{mode}"
deadline = "10m"
bid_window = "5s"

[early]
first_bids = 2

[[task]]
name = "steps"
budget = 900_000
group_size = 2
restarts = 1
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["python3", "allreduce.py", "{mode}"]
[task.resources]
cpu = 1
memory = "128MiB"
storage = "8MiB"
[[task.outputs]]
name = "sum.txt"
max_size = "1KiB"
"#
    )
}

/// Counts to 6 steps, a checkpoint in the work directory after each; rank 1 is killed
/// (SIGKILL) as the job file says. Then the ranks sum their steps with [`SUM`].
const RESTART_PROGRAM: &str = r#"
import os, sys, time
from sum import all_reduce_sum

rank = int(os.environ["RANK"])
restart = int(os.environ["CANNABIS_RESTART"])
work = os.environ["CANNABIS_WORK"]
ck = os.path.join(work, "step")
step = int(open(ck).read()) if os.path.exists(ck) else 0
resumed = step
while step < 6:
    time.sleep(0.3)
    step += 1
    with open(ck + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(ck + ".tmp", ck)
    if rank == 1 and (step == 3 and restart == 0 or sys.argv[1] == "always"):
        os.kill(os.getpid(), 9)
total = all_reduce_sum(step)
with open(os.path.join(work, "sum.txt"), "w") as f:
    f.write(f"rank {rank}: round {restart}, resumed at {resumed}, total {total}\n")
"#;

#[test]
fn a_killed_rank_restarts_every_rank_from_its_checkpoint_and_past_the_budget_the_job_says_why() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: requesters' programs run only where the executor is root");
        return;
    }
    let dir = super::exec::open_dir();
    let (net, once) = submit_group(dir.path(), 3, &restart_job("once"), RESTART_PROGRAM);
    let requester = net.nodes()[0].clone();
    let done = completed(&requester, &once, 180);
    let sums = sums(&done);
    assert_eq!(sums.len(), 2, "{sums:?}");
    // Rank 0 was stopped wherever it was and resumed from its own checkpoint; rank 1
    // from the step it was killed at. Both counted to 6.
    assert!(
        sums[0].starts_with("rank 0: round 1, resumed at ") && sums[0].ends_with("total 12"),
        "{sums:?}"
    );
    assert_eq!(sums[1], "rank 1: round 1, resumed at 3, total 12");

    // Killed in every round: after the one restart, every rank gives up, and the job
    // says why.
    let always = submit_bundle(
        &requester,
        &dir.path().join("always"),
        &restart_job("always"),
        RESTART_PROGRAM,
    );
    // Waited to its end (each of its attempts gives up alike), so that none of its
    // sandboxes outlives the testnet.
    let failed = wait_job(&requester, &always, 180, "the job to end", |j| {
        j.summary.state != cannabis_market::job::JobState::Open
    });
    assert_eq!(failed.summary.state, cannabis_market::job::JobState::Failed);
    let history: Vec<&str> = failed.history.iter().map(|h| h.text.as_str()).collect();
    let history = history.join("\n");
    assert!(
        history.contains("the restart budget is spent (1 restart): rank 1 ended with signal 9"),
        "{history}"
    );
}
