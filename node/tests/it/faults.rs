//! Fault injection on a testnet of real processes, as a researcher drives it from another
//! shell: `cannabis testnet status|kill|restart|pause|resume`, each seen to take effect.

use std::path::Path;
use std::time::{Duration, Instant};

use super::settle::{cannabis, client};
use super::testnet::Testnet;

/// `testnet status --json`: each node's state and pid.
fn status(dir: &Path, net: &Path) -> Vec<(String, Option<u32>)> {
    let o = cannabis(
        dir,
        &[
            "testnet",
            "status",
            "--json",
            "--dir",
            net.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["state"].as_str().unwrap().to_string(),
                n["pid"].as_u64().map(|p| p as u32),
            )
        })
        .collect()
}

fn testnet(dir: &Path, net: &Path, args: &[&str]) -> String {
    let mut all = vec!["testnet"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--dir", net.to_str().unwrap()]);
    let o = cannabis(dir, &all);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Waits up to 30 s for node `at` to be connected to `peers` peers.
fn wait_peers(at: &Path, peers: usize) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let n = client(at).status().map(|s| s.connected_peers).unwrap_or(0);
        if n == peers {
            return;
        }
        assert!(Instant::now() < until, "{n} peers, not {peers}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

#[test]
fn kill_restart_pause_and_resume_each_take_effect() {
    let dir = tempfile::tempdir().unwrap();
    let net_dir = dir.path().join("net");
    let net = Testnet::up(&net_dir, 3);
    let nodes = net.nodes();
    let cli = dir.path().join("cli");
    wait_peers(&nodes[0], 2);
    let before = status(&cli, &net_dir);
    assert!(
        before.iter().all(|(s, p)| s == "running" && p.is_some()),
        "{before:?}"
    );
    let text = testnet(&cli, &net_dir, &["status"]);
    assert!(text.contains("running"), "{text}");

    // Killed: the process is gone, and its peers lose it.
    let killed = before[2].1.unwrap();
    let out = testnet(&cli, &net_dir, &["kill", "2"]);
    assert!(out.contains("node 2 killed"), "{out}");
    assert!(matches!(process_state(killed), None | Some('Z')));
    assert_eq!(status(&cli, &net_dir)[2], ("stopped".into(), None));
    wait_peers(&nodes[0], 1);
    // Nothing to kill, pause or resume now: a clear error.
    let o = cannabis(
        &cli,
        &["testnet", "kill", "2", "--dir", net_dir.to_str().unwrap()],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not running"));
    let o = cannabis(
        &cli,
        &["testnet", "kill", "9", "--dir", net_dir.to_str().unwrap()],
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("nodes 0 to 2"));

    // Restarted: a new process, from its own store, back in the network.
    let out = testnet(&cli, &net_dir, &["restart", "2"]);
    assert!(out.contains("node 2 started again"), "{out}");
    let now = status(&cli, &net_dir);
    let restarted = now[2].1.unwrap();
    assert_eq!(now[2].0, "running");
    assert_ne!(restarted, killed);
    wait_peers(&nodes[0], 2);
    wait_peers(&nodes[2], 2);

    // Paused: frozen (stopped by the kernel), then going on again.
    let paused = now[1].1.unwrap();
    testnet(&cli, &net_dir, &["pause", "1"]);
    assert_eq!(process_state(paused), Some('T'));
    assert_eq!(status(&cli, &net_dir)[1].0, "paused");
    testnet(&cli, &net_dir, &["resume", "1"]);
    assert_ne!(process_state(paused), Some('T'));
    assert_eq!(status(&cli, &net_dir)[1].0, "running");
    assert!(client(&nodes[1]).status().is_ok());

    // `testnet down` stops every node, the restarted one (no child of `testnet up`) too.
    testnet(&cli, &net_dir, &["down"]);
    let until = Instant::now() + Duration::from_secs(10);
    while matches!(process_state(restarted), Some(s) if s != 'Z') {
        assert!(Instant::now() < until, "the restarted node still runs");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(net);
}

fn sees_offer(node: &Path, job: &str) -> bool {
    client(node)
        .get::<Vec<cannabis_api::Offer>>("/v1/market/offers")
        .is_ok_and(|o| o.iter().any(|o| o.job_id == job))
}

/// A partition stops connections and gossip across it, and healing restores both.
#[test]
fn a_partition_stops_gossip_across_it_and_heal_restores_it() {
    let dir = tempfile::tempdir().unwrap();
    let net_dir = dir.path().join("net");
    let net = Testnet::up(&net_dir, 4);
    let nodes = net.nodes();
    let cli = dir.path().join("cli");
    wait_peers(&nodes[0], 3);
    wait_peers(&nodes[3], 3);

    let out = testnet(&cli, &net_dir, &["partition", "0,1", "2,3"]);
    assert!(out.contains("0,1 | 2,3"), "{out}");
    for n in &nodes {
        wait_peers(n, 1);
    }
    // Every node named once, every node up: clear errors otherwise.
    let o = cannabis(
        &cli,
        &[
            "testnet",
            "partition",
            "0,1",
            "2",
            "--dir",
            net_dir.to_str().unwrap(),
        ],
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("node 3 is in no group"));

    // An offer published on one side reaches that side only (its bid window outlasts
    // the test: an expired offer is dropped, and would not cross anyway).
    let file = dir.path().join("job.toml");
    std::fs::write(
        &file,
        "deadline = \"10m\"\nbid_window = \"5m\"\n[[task]]\nname = \"t\"\nbudget = 1000\n\
         [task.workload]\nadapter = \"synthetic\"\n",
    )
    .unwrap();
    let o = cannabis(
        &nodes[1],
        &["job", "submit", file.to_str().unwrap(), "--yes", "--json"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let published: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let job = published["job_id"].as_str().unwrap().to_string();
    let until = Instant::now() + Duration::from_secs(30);
    while !sees_offer(&nodes[0], &job) {
        assert!(
            Instant::now() < until,
            "the offer did not reach its own side"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !sees_offer(&nodes[2], &job),
        "the offer crossed the partition"
    );
    assert!(
        !sees_offer(&nodes[3], &job),
        "the offer crossed the partition"
    );

    // Healed: connected again, and the other side catches up on the offer.
    testnet(&cli, &net_dir, &["heal"]);
    for n in &nodes {
        wait_peers(n, 3);
    }
    let until = Instant::now() + Duration::from_secs(30);
    while !(sees_offer(&nodes[2], &job) && sees_offer(&nodes[3], &job)) {
        assert!(
            Instant::now() < until,
            "the offer did not cross once healed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(net);
}

/// Round trips from `from` to `to`'s node, µs, sorted.
fn pings(from: &Path, to: &Path, count: u32) -> Vec<u64> {
    let peer = client(to).status().unwrap().peer_id;
    let mut rtt = client(from).ping(&peer, count).unwrap().rtt_us;
    assert_eq!(rtt.len(), count as usize);
    rtt.sort_unstable();
    rtt
}

#[test]
fn slow_delays_and_loses_a_nodes_traffic_until_made_plain_again() {
    let dir = tempfile::tempdir().unwrap();
    let net_dir = dir.path().join("net");
    let net = Testnet::up(&net_dir, 3);
    let nodes = net.nodes();
    let cli = dir.path().join("cli");
    wait_peers(&nodes[0], 2);
    let plain = pings(&nodes[0], &nodes[1], 5);

    let out = testnet(&cli, &net_dir, &["slow", "1", "--delay", "300"]);
    assert!(out.contains("300 ms late"), "{out}");
    // Every round trip through node 1 now takes the delay more, on the connection it
    // already had.
    let slowed = pings(&nodes[0], &nodes[1], 5);
    assert!(slowed[0] >= 300_000, "plain {plain:?}, slowed {slowed:?}");
    // Node 2's links are untouched.
    let other = pings(&nodes[0], &nodes[2], 5);
    assert!(other[2] < 300_000, "{other:?}");

    // Half the data lost: some round trips wait a retransmission timeout.
    testnet(&cli, &net_dir, &["slow", "1", "--loss", "0.5"]);
    let lossy = pings(&nodes[0], &nodes[1], 20);
    assert!(lossy[19] >= 200_000, "{lossy:?}");

    testnet(
        &cli,
        &net_dir,
        &["slow", "1", "--delay", "0", "--loss", "0"],
    );
    let again = pings(&nodes[0], &nodes[1], 5);
    assert!(again[2] < 150_000, "plain again: {again:?}");

    // A share outside 0..1 is refused before anything changes.
    let o = cannabis(
        &cli,
        &[
            "testnet",
            "slow",
            "1",
            "--loss",
            "5",
            "--dir",
            net_dir.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("from 0 to 1"));
}
