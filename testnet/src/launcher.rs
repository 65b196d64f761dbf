//! Starts N real `cannabis node` processes on loopback, each with its own data directory,
//! bootstrapped to the first; stops them; finds a running testnet again from its directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use cannabis_api::{ApiClient, NodeInfo};

/// How to start a testnet.
#[derive(Clone, Debug)]
pub struct TestnetOptions {
    /// The `cannabis` binary.
    pub binary: PathBuf,
    /// Directory holding `node-0`, `node-1`, ... and `testnet.json`.
    pub dir: PathBuf,
    /// Number of nodes.
    pub nodes: usize,
    /// How long each node may take to come up.
    pub ready_timeout: Duration,
}

/// One running node process.
pub struct NodeProc {
    /// Position in the testnet.
    pub index: usize,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// What it wrote to `node.json`.
    pub info: NodeInfo,
    /// Its API client.
    pub client: ApiClient,
    child: Option<Child>,
    args: Vec<String>,
}

/// `testnet.json`: what `cannabis testnet down` needs to stop a testnet.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    nodes: Vec<RecordNode>,
}

#[derive(Debug, Serialize, Deserialize)]
struct RecordNode {
    pid: u32,
    data_dir: PathBuf,
    api: String,
    peer_id: String,
    /// The node's command line after the binary (`testnet restart` starts it again so).
    #[serde(default)]
    args: Vec<String>,
}

/// A running testnet. Dropping it stops the nodes.
pub struct Testnet {
    /// Its directory.
    pub dir: PathBuf,
    /// The nodes, node 0 first.
    pub nodes: Vec<NodeProc>,
}

impl Testnet {
    /// Starts the nodes: node 0 first, then every other node bootstrapped to it.
    pub fn up(opts: &TestnetOptions) -> anyhow::Result<Testnet> {
        Self::up_with(opts, |_| {})
    }

    /// [`Testnet::up`], calling `ready(n)` each time `n` nodes are up (for progress).
    pub fn up_with(opts: &TestnetOptions, mut ready: impl FnMut(usize)) -> anyhow::Result<Testnet> {
        anyhow::ensure!(opts.nodes >= 1, "a testnet needs at least one node");
        fs::create_dir_all(&opts.dir)
            .with_context(|| format!("creating {}", opts.dir.display()))?;
        open_to_sandboxes(&opts.dir)?;
        let record = opts.dir.join("testnet.json");
        if record.exists() && !live_pids(&opts.dir)?.is_empty() {
            bail!(
                "a testnet is already running in {}; stop it with `cannabis testnet down --dir {}`",
                opts.dir.display(),
                opts.dir.display()
            );
        }
        let mut net = Testnet {
            dir: opts.dir.clone(),
            nodes: Vec::new(),
        };
        let fee_recipient = founder(opts)?;
        // Every node's keys at once: one `keys new` after another took a quarter of a
        // 100-node start, each slower than the last as the nodes already up took the CPU.
        make_keys(opts)?;
        let genesis = genesis(opts, &fee_recipient)?;
        let network = Network {
            genesis: fs::canonicalize(&genesis)
                .with_context(|| format!("finding {}", genesis.display()))?,
            fee_recipient,
        };
        // From here on, a failure stops what was started (dropping `net` stops its nodes).
        let first = spawn(opts, 0, None, &network)?;
        let bootstrap = dial_addr(&first.info)?;
        net.nodes.push(first);
        ready(net.nodes.len());
        // Start the rest together, then wait for each.
        let mut starting = Vec::new();
        let started = (1..opts.nodes).try_for_each(|i| {
            starting.push(start_process(opts, i, Some(&bootstrap), &network)?);
            anyhow::Ok(())
        });
        let mut starting = starting.into_iter().enumerate();
        let ready = started.and_then(|()| {
            for (i, (data_dir, child, args)) in starting.by_ref() {
                net.nodes.push(wait_ready(
                    i + 1,
                    data_dir,
                    child,
                    args,
                    opts.ready_timeout,
                )?);
                ready(net.nodes.len());
            }
            anyhow::Ok(())
        });
        if let Err(e) = ready {
            for (_, (_, mut child, _)) in starting {
                let _ = child.kill();
                let _ = child.wait();
            }
            return Err(e);
        }
        net.write_record()?;
        Ok(net)
    }

    /// How many of its nodes still run: those it started and those `testnet restart`
    /// started again (its children that ended are reaped).
    pub fn running(&mut self) -> usize {
        let mut children = 0;
        for n in &mut self.nodes {
            if let Some(c) = n.child.as_mut()
                && matches!(c.try_wait(), Ok(None))
            {
                children += 1;
            }
        }
        live_pids(&self.dir).map_or(children, |p| p.len().max(children))
    }

    fn write_record(&self) -> anyhow::Result<()> {
        let record = Record {
            nodes: self
                .nodes
                .iter()
                .map(|n| RecordNode {
                    pid: n.info.pid,
                    data_dir: n.data_dir.clone(),
                    api: n.info.api.clone().unwrap_or_default(),
                    peer_id: n.info.peer_id.clone(),
                    args: n.args.clone(),
                })
                .collect(),
        };
        let path = self.dir.join("testnet.json");
        fs::write(&path, serde_json::to_string_pretty(&record)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Waits until every node has probed its machine, holds every node's latest
    /// capability ad and has a gossip mesh: the network is connected end to end, and
    /// every node sees what every other offers.
    pub fn wait_converged(&self, timeout: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let n = self.nodes.len();
        loop {
            let mut done = true;
            for node in &self.nodes {
                let status = node.client.status()?;
                let meshed = n == 1 || status.mesh_peers.iter().all(|t| t.peers > 0);
                if status.ads < n || !meshed || status.probing {
                    done = false;
                    break;
                }
            }
            if done && self.latest_ads_everywhere()? {
                return Ok(started.elapsed());
            }
            if started.elapsed() > timeout {
                let seen: Vec<usize> = self
                    .nodes
                    .iter()
                    .map(|n| n.client.status().map(|s| s.ads).unwrap_or(0))
                    .collect();
                bail!(
                    "the testnet did not converge within {timeout:?}: ads seen per node {seen:?}"
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until every node's executor is open (a node whose executor did not open yet
    /// tries again by itself): what a benchmark that places work on every node needs.
    /// Fails after `timeout`, naming each node still without one and why.
    pub fn wait_executors(&self, timeout: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        loop {
            let mut missing = Vec::new();
            for (i, node) in self.nodes.iter().enumerate() {
                let executor = node.client.status()?.executor;
                if executor == "opening" || executor.starts_with("none:") {
                    missing.push(format!("node {i}: {executor}"));
                }
            }
            if missing.is_empty() {
                return Ok(started.elapsed());
            }
            if started.elapsed() > timeout {
                bail!(
                    "{} nodes have no executor after {timeout:?}: {}",
                    missing.len(),
                    missing.join("; ")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until the nodes together use less than `share` of the machine's cores over a
    /// second (their own CPU, from `/proc`), at most `within`: how long it took, and
    /// whether they got there. On a testnet every node shares the machine, so the gossip
    /// of one phase (100 nodes forwarding 20 offers keep two cores busy for seconds) would
    /// otherwise be measured as part of the next; on a real network each node has its own.
    pub fn wait_quiet(&self, share: f64, within: Duration) -> (Duration, bool) {
        let started = Instant::now();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100) as f64;
        let used = || -> u64 { self.nodes.iter().map(|n| cpu_ticks(n.info.pid)).sum() };
        let mut before = used();
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let now = used();
            let busy = now.saturating_sub(before) as f64 / ticks;
            if busy < share * cores {
                return (started.elapsed(), true);
            }
            if started.elapsed() >= within {
                return (started.elapsed(), false);
            }
            before = now;
        }
    }

    /// Whether every node holds every node's ad as that node last published it (a node
    /// seen only by the ad it sent before probing its machine is not seen yet).
    fn latest_ads_everywhere(&self) -> anyhow::Result<bool> {
        let views = self
            .nodes
            .iter()
            .map(|node| {
                let ads = node.client.ads()?;
                anyhow::Ok(
                    ads.into_iter()
                        .map(|a| (a.node, a.seq))
                        .collect::<std::collections::HashMap<_, _>>(),
                )
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(self.nodes.iter().zip(&views).all(|(node, own_view)| {
            let me = &node.info.address;
            own_view.get(me).is_some_and(|latest| {
                views
                    .iter()
                    .all(|view| view.get(me).is_some_and(|seq| seq >= latest))
            })
        }))
    }

    /// Stops every node: SIGTERM, then SIGKILL after five seconds.
    pub fn stop(&mut self) {
        // Nodes started again by `testnet restart` are not this process's children: they
        // are stopped through the record, as `testnet down` does.
        let _ = down(&self.dir);
        for node in &self.nodes {
            let _ = kill(Pid::from_raw(node.info.pid as i32), Signal::SIGTERM);
            let _ = kill(Pid::from_raw(node.info.pid as i32), Signal::SIGCONT);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for node in &mut self.nodes {
            if let Some(child) = node.child.as_mut() {
                loop {
                    match child.try_wait() {
                        Ok(Some(_)) | Err(_) => break,
                        Ok(None) if Instant::now() > deadline => {
                            let _ = child.kill();
                            let _ = child.wait();
                            break;
                        }
                        Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }
        }
        self.nodes.clear();
        let _ = fs::remove_file(self.dir.join("testnet.json"));
    }

    /// Resident memory of each node process, in KiB (from `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| rss_kib(n.info.pid)).collect()
    }

    /// Each node's resident and proportional memory (shared pages split among the
    /// processes that map them), KiB.
    pub fn memory_kib(&self) -> Vec<(u64, u64)> {
        self.nodes
            .iter()
            .map(|n| (rss_kib(n.info.pid), pss_kib(n.info.pid)))
            .collect()
    }
}

impl Drop for Testnet {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where to dial each node of the testnet running from `dir` (`/ip4/.../tcp/.../p2p/...`),
/// from the `node.json` each running node writes.
pub fn dial_addrs(dir: &Path) -> anyhow::Result<Vec<String>> {
    let path = dir.join("testnet.json");
    let text = fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {}: is a testnet running from {}?",
            path.display(),
            dir.display()
        )
    })?;
    let record: Record =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut addrs = Vec::new();
    for n in &record.nodes {
        let info_path = n.data_dir.join("node.json");
        let info: NodeInfo = serde_json::from_str(
            &fs::read_to_string(&info_path)
                .with_context(|| format!("reading {}", info_path.display()))?,
        )
        .with_context(|| format!("parsing {}", info_path.display()))?;
        addrs.push(dial_addr(&info)?);
    }
    Ok(addrs)
}

/// A node's TCP address with its peer id.
fn dial_addr(info: &NodeInfo) -> anyhow::Result<String> {
    let tcp = info
        .listen_addrs
        .iter()
        .find(|a| a.contains("/tcp/"))
        .with_context(|| format!("node {} listens on no TCP address", info.peer_id))?;
    Ok(format!("{tcp}/p2p/{}", info.peer_id))
}

/// Stops the testnet recorded in `dir` (from another process than the one that started
/// it). Returns how many nodes were signalled.
pub fn down(dir: &Path) -> anyhow::Result<usize> {
    let pids = live_pids(dir)?;
    terminate(&pids);
    let _ = fs::remove_file(dir.join("testnet.json"));
    Ok(pids.len())
}

/// Stops every node of the testnet in `dir`, those in its record (as [`down`] does) and
/// any started before the record was written (a testnet interrupted while it starts):
/// every process whose command line names a data directory under `dir`. Returns how many
/// were signalled.
pub fn stop_under(dir: &Path) -> usize {
    let recorded = down(dir).unwrap_or(0);
    let needle = format!("{}/node-", dir.display());
    let pids: Vec<u32> = fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                        String::from_utf8_lossy(&c)
                            .replace('\0', " ")
                            .contains(&needle)
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    terminate(&pids);
    recorded + pids.len()
}

/// SIGTERM to each of `pids` (and SIGCONT: a paused node takes the signal once it goes
/// on), then SIGKILL to those still running after five seconds.
fn terminate(pids: &[u32]) {
    for pid in pids {
        let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGTERM);
        let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGCONT);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && pids.iter().any(|p| alive(*p)) {
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in pids {
        if alive(*pid) {
            let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
        }
    }
}

/// A fault given to one node of a running testnet, by signal: what a crash, a hung
/// process or a machine put to sleep does to its peers (connections time out; leases lapse).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `SIGKILL`: gone at once, nothing flushed but what its store made durable.
    Kill,
    /// `SIGSTOP`: frozen, its sockets open and silent.
    Pause,
    /// `SIGCONT`: a paused node goes on.
    Resume,
}

/// Where a process of a testnet stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProcState {
    /// Running.
    Running,
    /// Stopped by `SIGSTOP` (`testnet pause`).
    Paused,
    /// Not running.
    Stopped,
}

/// One node of a recorded testnet, as `testnet status` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct NodeStatus {
    /// Its position.
    pub index: usize,
    /// Its process, while it runs.
    pub pid: Option<u32>,
    /// Running, paused or stopped.
    pub state: ProcState,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// Peers it is connected to (asked of a running node).
    pub peers: Option<usize>,
    /// The last ledger block it holds (asked of a running node).
    pub height: Option<u64>,
}

fn read_record(dir: &Path) -> anyhow::Result<Record> {
    let path = dir.join("testnet.json");
    let text = fs::read_to_string(&path).with_context(|| {
        format!(
            "no testnet is recorded in {} (start one with `cannabis testnet up --dir {}`)",
            dir.display(),
            dir.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The pid of `node` if it runs a node of this testnet (its command line names the data
/// directory, so a reused pid is never taken for it).
fn running_pid(node: &RecordNode) -> Option<u32> {
    fs::read(format!("/proc/{}/cmdline", node.pid))
        .ok()
        .filter(|c| {
            String::from_utf8_lossy(c)
                .replace('\0', " ")
                .contains(&*node.data_dir.to_string_lossy())
        })
        .map(|_| node.pid)
}

/// `R`, `S`, `T`, ... from `/proc/<pid>/stat`.
fn proc_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the state follows the last.
    stat.rsplit_once(") ")?.1.chars().next()
}

fn state_of(node: &RecordNode) -> ProcState {
    match running_pid(node).and_then(proc_state) {
        None | Some('Z' | 'X') => ProcState::Stopped,
        Some('T' | 't') => ProcState::Paused,
        Some(_) => ProcState::Running,
    }
}

fn node_of(record: &Record, dir: &Path, index: usize) -> anyhow::Result<usize> {
    anyhow::ensure!(
        index < record.nodes.len(),
        "the testnet in {} has nodes 0 to {}",
        dir.display(),
        record.nodes.len().saturating_sub(1)
    );
    Ok(index)
}

/// Gives node `index` of the testnet in `dir` a fault; returns its pid.
pub fn fault(dir: &Path, index: usize, fault: Fault) -> anyhow::Result<u32> {
    let record = read_record(dir)?;
    let node = &record.nodes[node_of(&record, dir, index)?];
    let Some(pid) = running_pid(node) else {
        bail!("node {index} is not running (start it with `cannabis testnet restart {index}`)");
    };
    let target = Pid::from_raw(pid as i32);
    match fault {
        Fault::Kill => {
            kill(target, Signal::SIGKILL).with_context(|| format!("killing node {index}"))?;
            let until = Instant::now() + Duration::from_secs(5);
            // Until the process is dead, not only its command line gone (it empties
            // while the kernel still tears the process down).
            while alive(pid) {
                anyhow::ensure!(Instant::now() < until, "node {index} did not die");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Fault::Pause => {
            kill(target, Signal::SIGSTOP).with_context(|| format!("pausing node {index}"))?;
            let until = Instant::now() + Duration::from_secs(5);
            while state_of(node) != ProcState::Paused {
                anyhow::ensure!(Instant::now() < until, "node {index} did not stop");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Fault::Resume => {
            kill(target, Signal::SIGCONT).with_context(|| format!("resuming node {index}"))?;
        }
    }
    Ok(pid)
}

/// Starts node `index` of the testnet in `dir` again, as it was started (stopping it
/// first if it runs), and waits until its API answers: its new pid is recorded.
pub fn restart(
    dir: &Path,
    binary: &Path,
    index: usize,
    timeout: Duration,
) -> anyhow::Result<NodeInfo> {
    let mut record = read_record(dir)?;
    let at = node_of(&record, dir, index)?;
    let node = &record.nodes[at];
    anyhow::ensure!(
        !node.args.is_empty(),
        "node {index}'s command line is not recorded (a testnet started by an older version)"
    );
    if let Some(pid) = running_pid(node) {
        let target = Pid::from_raw(pid as i32);
        let _ = kill(target, Signal::SIGCONT);
        let _ = kill(target, Signal::SIGTERM);
        let until = Instant::now() + Duration::from_secs(10);
        while state_of(node) != ProcState::Stopped && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50));
        }
        if state_of(node) != ProcState::Stopped {
            let _ = kill(target, Signal::SIGKILL);
        }
    }
    let data_dir = node.data_dir.clone();
    // The same port as before, as a node with a configured address has: its peers (and
    // the ledger's clients, when it is the sequencer) find it where they knew it.
    let mut args = node.args.clone();
    let port = NodeInfo::read(&data_dir).ok().and_then(|info| {
        info.listen_addrs.iter().find_map(|a| {
            a.strip_prefix("/ip4/127.0.0.1/tcp/")?
                .split('/')
                .next()?
                .parse::<u16>()
                .ok()
        })
    });
    if let Some(port) = port {
        for a in &mut args {
            if a == "/ip4/127.0.0.1/tcp/0" {
                *a = format!("/ip4/127.0.0.1/tcp/{port}");
            }
        }
    }
    let _ = fs::remove_file(data_dir.join("node.json"));
    let child =
        launch(binary, &data_dir, &args).with_context(|| format!("starting node {index}"))?;
    let started = wait_ready(index, data_dir, child, node.args.clone(), timeout)?;
    record.nodes[at].pid = started.info.pid;
    record.nodes[at].api = started.info.api.clone().unwrap_or_default();
    let path = dir.join("testnet.json");
    fs::write(&path, serde_json::to_string_pretty(&record)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(started.info)
}

/// Splits the testnet in `dir` into `groups` (every node in exactly one): each node
/// refuses the nodes of the other groups until [`heal`]. Enforced in the nodes
/// (connection gating by their swarm's block list), so it needs no privileges and holds
/// for every transport and relay alike.
pub fn partition(dir: &Path, groups: &[Vec<usize>]) -> anyhow::Result<()> {
    let record = read_record(dir)?;
    let n = record.nodes.len();
    anyhow::ensure!(groups.len() >= 2, "a partition needs at least two groups");
    let mut side = vec![None; n];
    for (g, group) in groups.iter().enumerate() {
        for &i in group {
            node_of(&record, dir, i)?;
            anyhow::ensure!(side[i].is_none(), "node {i} is named twice");
            side[i] = Some(g);
        }
    }
    if let Some(i) = side.iter().position(Option::is_none) {
        bail!("node {i} is in no group: name every node (one left out would bridge the sides)");
    }
    tell_partition(dir, &record, |i, j| side[i] != side[j])
}

/// Ends a [`partition`]: every node may connect to every other again (and dials them).
pub fn heal(dir: &Path) -> anyhow::Result<()> {
    let record = read_record(dir)?;
    tell_partition(dir, &record, |_, _| false)
}

/// Tells every node which others it refuses: node `i` refuses `j` when `cut(i, j)`.
fn tell_partition(
    dir: &Path,
    record: &Record,
    cut: impl Fn(usize, usize) -> bool,
) -> anyhow::Result<()> {
    for (i, node) in record.nodes.iter().enumerate() {
        match state_of(node) {
            ProcState::Running => {}
            other => bail!(
                "node {i} is {}: every node must run to take a partition (`cannabis testnet \
                 status --dir {}`)",
                if other == ProcState::Paused {
                    "paused"
                } else {
                    "stopped"
                },
                dir.display()
            ),
        }
    }
    for (i, node) in record.nodes.iter().enumerate() {
        let peers = record
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| cut(i, *j))
            .map(|(_, n)| n.peer_id.clone())
            .collect();
        ApiClient::from_data_dir(&node.data_dir)?
            .post::<_, cannabis_api::Partition>(
                "/v1/testnet/partition",
                &cannabis_api::Partition { peers },
            )
            .with_context(|| format!("telling node {i}"))?;
    }
    Ok(())
}

/// Makes node `index`'s TCP links slow and lossy: its inbound bytes held `delay_ms`, a
/// share `loss_ppm` (parts per million) of them a retransmission timeout more; both zero
/// for a plain link again. Enforced in the node, on a testnet only (see
/// `node/src/swarm/shaping.rs`).
pub fn slow(dir: &Path, index: usize, delay_ms: u64, loss_ppm: u32) -> anyhow::Result<()> {
    tell::<cannabis_api::Slow>(
        dir,
        index,
        "/v1/testnet/slow",
        &cannabis_api::Slow { delay_ms, loss_ppm },
    )
}

/// Makes node `index` of the testnet in `dir` deliver wrong outputs (`on`), as a worker
/// that fabricates results would, or right ones again. Enforced in the node: the first
/// byte of each output is flipped before it is hashed and sealed, so its signed manifest
/// pins the wrong bytes and only a check of the content (Freivalds' for a synthetic task,
/// a spot check's re-run for any other) finds it out.
pub fn corrupt(dir: &Path, index: usize, on: bool) -> anyhow::Result<()> {
    tell::<cannabis_api::Corrupt>(
        dir,
        index,
        "/v1/testnet/corrupt",
        &cannabis_api::Corrupt { on },
    )
}

/// Posts a testnet fault's `body` to `path` on running node `index` of the testnet in
/// `dir`.
fn tell<B: Serialize + serde::de::DeserializeOwned>(
    dir: &Path,
    index: usize,
    path: &str,
    body: &B,
) -> anyhow::Result<()> {
    let record = read_record(dir)?;
    node_of(&record, dir, index)?;
    let node = &record.nodes[index];
    anyhow::ensure!(
        state_of(node) == ProcState::Running,
        "node {index} is not running (`cannabis testnet status --dir {}`)",
        dir.display()
    );
    ApiClient::from_data_dir(&node.data_dir)?
        .post::<_, B>(path, body)
        .with_context(|| format!("telling node {index}"))?;
    Ok(())
}

/// Every node of the testnet in `dir`: its process and, for a running one, its peers and
/// ledger height.
pub fn status(dir: &Path) -> anyhow::Result<Vec<NodeStatus>> {
    let record = read_record(dir)?;
    Ok(record
        .nodes
        .iter()
        .enumerate()
        .map(|(index, n)| {
            let state = state_of(n);
            let client = (state == ProcState::Running)
                .then(|| ApiClient::from_data_dir(&n.data_dir).ok())
                .flatten();
            NodeStatus {
                index,
                pid: (state != ProcState::Stopped).then_some(n.pid),
                state,
                data_dir: n.data_dir.clone(),
                peers: client
                    .as_ref()
                    .and_then(|c| c.status().ok())
                    .map(|s| s.connected_peers),
                height: client
                    .as_ref()
                    .and_then(|c| c.ledger().ok())
                    .map(|l| l.height),
            }
        })
        .collect())
}

/// Pids from `testnet.json` that still run a node of this testnet (the command line names
/// the node's data directory, so a reused pid is never signalled).
fn live_pids(dir: &Path) -> anyhow::Result<Vec<u32>> {
    let path = dir.join("testnet.json");
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let record: Record =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(record.nodes.iter().filter_map(running_pid).collect())
}

/// Whether `pid` runs (a zombie, dead and not yet reaped by its parent, does not).
fn alive(pid: u32) -> bool {
    !matches!(proc_state(pid), None | Some('Z' | 'X'))
}

/// The user and system CPU time `pid` has used, in clock ticks (0 when it is gone).
fn cpu_ticks(pid: u32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // After the command name (in parentheses): state is field 3, utime 14, stime 15.
            let rest: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
            Some(rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    proc_kib(&format!("/proc/{pid}/status"), "VmRSS:")
}

fn pss_kib(pid: u32) -> u64 {
    proc_kib(&format!("/proc/{pid}/smaps_rollup"), "Pss:")
}

/// A `key: N kB` line of a `/proc` file, in KiB (0 when the process is gone).
fn proc_kib(path: &str, key: &str) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn spawn(
    opts: &TestnetOptions,
    index: usize,
    bootstrap: Option<&str>,
    network: &Network,
) -> anyhow::Result<NodeProc> {
    let (data_dir, child, args) = start_process(opts, index, bootstrap, network)?;
    wait_ready(index, data_dir, child, args, opts.ready_timeout)
}

/// Creates the keys of every node's data directory that has none, 16 at a time.
fn make_keys(opts: &TestnetOptions) -> anyhow::Result<()> {
    let missing: Vec<(usize, PathBuf)> = (0..opts.nodes)
        .map(|i| (i, opts.dir.join(format!("node-{i}"))))
        .filter(|(_, dir)| !has_keys(dir))
        .collect();
    for batch in missing.chunks(16) {
        let mut running = Vec::new();
        for (i, dir) in batch {
            let child = keys_new(&opts.binary, dir)?
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .with_context(|| format!("running {}", opts.binary.display()))?;
            running.push((*i, child));
        }
        for (i, child) in running {
            keys_made(&child.wait_with_output()?, &format!("node {i}"))?;
        }
    }
    Ok(())
}

/// Creates the keys of a data directory unless it has them.
fn ensure_keys(binary: &Path, data_dir: &Path, who: &str) -> anyhow::Result<()> {
    if has_keys(data_dir) {
        return Ok(());
    }
    let out = keys_new(binary, data_dir)?
        .output()
        .with_context(|| format!("running {}", binary.display()))?;
    keys_made(&out, who)
}

/// The nodes' executors run work as uids of their own (as root), which must reach the
/// nodes' data directories: the testnet's directory is made traversable (0711: nothing in
/// it can be listed), and an ancestor that other users cannot pass is named.
fn open_to_sandboxes(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o711))
        .with_context(|| format!("opening {} to the sandboxes", dir.display()))?;
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let abs = dir.canonicalize()?;
    let closed = abs
        .ancestors()
        .skip(1)
        .find(|a| fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 == 0));
    if let Some(closed) = closed {
        eprintln!(
            "warning: other users cannot pass {} (no o+x), so the nodes' executors cannot run work under {}: chmod o+x {} or choose a --dir elsewhere",
            closed.display(),
            dir.display(),
            closed.display()
        );
    }
    Ok(())
}

fn has_keys(data_dir: &Path) -> bool {
    data_dir.join("keys/node.key").exists()
}

/// `cannabis keys new` for `data_dir`, which it creates.
fn keys_new(binary: &Path, data_dir: &Path) -> anyhow::Result<Command> {
    fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let mut cmd = Command::new(binary);
    cmd.arg("--data-dir").arg(data_dir).args(["keys", "new"]);
    Ok(cmd)
}

fn keys_made(out: &std::process::Output, who: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        out.status.success(),
        "creating keys for {who}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The testnet's fee recipient: the address of the keys in `founder/`, made on the first
/// `up`. Every node's configuration pins it with the 1% rate, as a real network's does.
fn founder(opts: &TestnetOptions) -> anyhow::Result<String> {
    let dir = opts.dir.join("founder");
    ensure_keys(&opts.binary, &dir, "the testnet's fee recipient")?;
    address_in(&opts.binary, &dir, "the fee recipient")
}

/// The address of the keys in `data_dir`.
fn address_in(binary: &Path, data_dir: &Path, who: &str) -> anyhow::Result<String> {
    let out = Command::new(binary)
        .arg("--data-dir")
        .arg(data_dir)
        .args(["keys", "address"])
        .output()
        .with_context(|| format!("running {}", binary.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "reading {who}'s address: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// What each node of a testnet holds at genesis (base units).
pub const NODE_FUNDS: u64 = 1_000_000_000_000;

/// The testnet's genesis, written on the first `up` (`genesis.json`): node 0 sequences the
/// ledger and holds the faucet's account; every other node holds [`NODE_FUNDS`]; the founder's keys receive the 1% fee, resolve
/// disputes, and hold the founders' 1% of the supply, vesting over four years after a
/// one-year cliff; a tenth of the supply rewards valid proof-of-compute results.
fn genesis(opts: &TestnetOptions, founder: &str) -> anyhow::Result<PathBuf> {
    let path = opts.dir.join("genesis.json");
    if path.exists() {
        return Ok(path);
    }
    let sequencer: cannabis_protocol::Address =
        address_in(&opts.binary, &opts.dir.join("node-0"), "node 0")?
            .parse()
            .map_err(|e| anyhow::anyhow!("node 0's address: {e}"))?;
    let founder: cannabis_protocol::Address = founder
        .parse()
        .map_err(|e| anyhow::anyhow!("the founder's address: {e}"))?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    const SUPPLY: u64 = 1_000_000_000_000_000;
    const YEAR_MS: u64 = 365 * 24 * 3600 * 1000;
    // Every node starts funded (jobs lock their budgets, workers pay the network fees of
    // their commitments); node 0, the faucet, holds the rest of what is not the founders'
    // or the reward pool's.
    let each = (SUPPLY / 2 / opts.nodes.max(1) as u64).min(NODE_FUNDS);
    let mut accounts = Vec::with_capacity(opts.nodes);
    let mut rest = SUPPLY - SUPPLY / 100 - SUPPLY / 10;
    for i in 1..opts.nodes {
        let address = address_in(&opts.binary, &opts.dir.join(format!("node-{i}")), "a node")?
            .parse()
            .map_err(|e| anyhow::anyhow!("node {i}'s address: {e}"))?;
        accounts.push(cannabis_protocol::Allocation {
            address,
            amount: cannabis_protocol::Amount(each),
        });
        rest -= each;
    }
    // The founder's keys resolve disputes: they pay the network fee of a resolution from
    // spendable funds (their 1% of the supply is locked by its vesting).
    accounts.push(cannabis_protocol::Allocation {
        address: founder,
        amount: cannabis_protocol::Amount(each),
    });
    rest -= each;
    accounts.insert(
        0,
        cannabis_protocol::Allocation {
            address: sequencer,
            amount: cannabis_protocol::Amount(rest),
        },
    );
    let g = cannabis_protocol::Genesis {
        network: format!("cannabis-testnet-{now}"),
        time: cannabis_protocol::Timestamp(now),
        sequencer,
        fee: cannabis_protocol::FeeTerms::founder(founder),
        resolver: founder,
        min_gas_price: 1,
        supply: cannabis_protocol::Amount(SUPPLY),
        accounts,
        vesting: vec![cannabis_protocol::Vesting {
            address: founder,
            amount: cannabis_protocol::Amount(SUPPLY / 100),
            start: cannabis_protocol::Timestamp(now),
            cliff_ms: YEAR_MS,
            duration_ms: 4 * YEAR_MS,
        }],
        faucet: Some(cannabis_protocol::Faucet {
            address: sequencer,
            grant: cannabis_protocol::Amount(1_000_000_000),
        }),
        rewards: cannabis_protocol::Rewards {
            pool: cannabis_protocol::Amount(SUPPLY / 10),
            per_block: cannabis_protocol::Amount(1_000_000),
            seed_window: 64,
        },
        block_interval_ms: 100,
        max_block_txs: 5_000,
    };
    g.validate()?;
    fs::write(&path, serde_json::to_string_pretty(&g)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// What every node of a testnet shares: its fee recipient and its genesis.
struct Network {
    fee_recipient: String,
    genesis: PathBuf,
}

fn start_process(
    opts: &TestnetOptions,
    index: usize,
    bootstrap: Option<&str>,
    network: &Network,
) -> anyhow::Result<(PathBuf, Child, Vec<String>)> {
    let data_dir = opts.dir.join(format!("node-{index}"));
    ensure_keys(&opts.binary, &data_dir, &format!("node {index}"))?;
    let _ = fs::remove_file(data_dir.join("node.json"));
    let config = data_dir.join("node.toml");
    if !config.exists() {
        fs::write(&config, node_config(index, &network.fee_recipient))
            .with_context(|| format!("writing {}", config.display()))?;
    }
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let mut args: Vec<String> = vec!["--data-dir".into(), path(&data_dir)];
    args.extend(["node", "run", "--testnet", "--no-mdns"].map(String::from));
    args.extend(["--config".into(), path(&config)]);
    // TCP only: on loopback QUIC buys nothing, and a second transport doubles every
    // pair's connections (and each QUIC endpoint seeds its own entropy at start).
    args.extend(["--listen", "/ip4/127.0.0.1/tcp/0", "--api", "127.0.0.1:0"].map(String::from));
    args.extend(["--genesis".into(), path(&network.genesis)]);
    if index == 0 {
        // Node 0 sequences the ledger (the genesis names its key).
        args.push("--ledger".into());
    }
    if let Some(b) = bootstrap {
        args.extend(["--bootstrap".into(), b.to_string()]);
    }
    let child =
        launch(&opts.binary, &data_dir, &args).with_context(|| format!("starting node {index}"))?;
    Ok((data_dir, child, args))
}

/// Starts `binary args` as a node with its output appended to its `node.log`.
fn launch(binary: &Path, data_dir: &Path, args: &[String]) -> anyhow::Result<Child> {
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(data_dir.join("node.log"))
        .context("opening the node log")?;
    Ok(Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?)
}

/// The configuration of testnet node `index`: its workers differ, so that placement by
/// price and by capability shows. Prices spread over 600 to 2,400 base units a core-hour;
/// each node offers a quarter, half, three quarters or all of this machine's cores and
/// memory (through the executor's owner limits, which its ad follows). Its owner allows
/// requesters' own programs (a testnet is its owner's own machine). Every node pins the
/// testnet's fee terms: 1% to `fee_recipient`. Every fourth node (3, 7, ...) advertises a
/// `dev` attestation, insecure and for testnets only, so that jobs requiring confidential
/// execution have somewhere to go and are seen to go only there.
pub fn node_config(index: usize, fee_recipient: &str) -> String {
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    let memory_mib = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or(1024, |kib| kib / 1024);
    let share = [0.25, 0.5, 0.75, 1.0][index % 4];
    let cpu = (cores * share * 4.0).round().max(1.0) / 4.0;
    let memory = ((memory_mib as f64 * share) as u64).max(256);
    let cpu_price = 600 + 200 * ((index * 7) % 10);
    let memory_price = 50 + 10 * (index % 5);
    let attestation = if index % 4 == 3 {
        "# Insecure, testnets only: confidential jobs of this testnet may come here.\n\
         attestation = \"dev\"\n\n"
    } else {
        ""
    };
    format!(
        "# Written by `cannabis testnet up` for node {index}.\n{attestation}\
         [owner.prices]\ncpu_core_hour = {cpu_price}\nmemory_gib_hour = {memory_price}\n\n\
         [executor]\ncpu = {cpu}\nmemory = \"{memory}MiB\"\n\n\
         [worker]\ncustom_code = true\n\n\
         [gossip.fee]\nrate_bps = {}\nrecipient = \"{fee_recipient}\"\n",
        cannabis_protocol::FOUNDER_FEE_BPS
    )
}

fn wait_ready(
    index: usize,
    data_dir: PathBuf,
    mut child: Child,
    args: Vec<String>,
    timeout: Duration,
) -> anyhow::Result<NodeProc> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "node {index} exited with {status} while starting; see {}",
                data_dir.join("node.log").display()
            );
        }
        if let Ok(info) = NodeInfo::read(&data_dir)
            && info.api.is_some()
            && info.listen_addrs.iter().any(|a| a.contains("/tcp/"))
            && let Ok(client) = ApiClient::from_data_dir(&data_dir)
            && client.status().is_ok()
        {
            return Ok(NodeProc {
                index,
                data_dir,
                info,
                client,
                child: Some(child),
                args,
            });
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            bail!(
                "node {index} was not ready within {timeout:?}; see {}",
                data_dir.join("node.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_from_proc_and_a_gone_process_counts_nothing() {
        let me = std::process::id();
        let before = cpu_ticks(me);
        // Busy for at least 300 ms of wall time: the process gets some of it on any machine.
        let started = Instant::now();
        let mut x = 0u64;
        while started.elapsed() < Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        assert!(cpu_ticks(me) > before, "no CPU time counted while busy");
        // Beyond the largest pid Linux hands out.
        assert_eq!(cpu_ticks(u32::MAX), 0);
    }
}
