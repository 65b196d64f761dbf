//! `cannabis testnet bench`: offer propagation over N real node processes on loopback,
//! with the direct request-response round trip measured in the same run as the baseline,
//! and each node's idle resident memory.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_api::OfferTemplate;
use cannabis_protocol::{AdapterKind, Amount, Digest, Requirements, Resources, TaskSpec, Workload};
use serde::Serialize;

use crate::launcher::{Testnet, TestnetOptions};
use crate::stats::{Summary, summarize};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The testnet to start.
    pub testnet: TestnetOptions,
    /// Offers to publish from node 0.
    pub offers: usize,
    /// Pause between offers.
    pub interval: Duration,
    /// Request-response round trips for the baseline.
    pub pings: u32,
    /// Then publish the offers again while `cannabis testnet attack` runs against every
    /// node, and compare: the attacks to run (empty: all of them), or `None` for no attack.
    pub hostile: Option<Vec<String>>,
    /// Size of the encrypted-transfer phase's output, bytes (0: no such phase).
    pub transfer_bytes: u64,
    /// Bytes the group-channel phase sends through a group's channel (0: no such phase).
    pub channel_bytes: u64,
}

/// A group's channel against a direct loopback TCP connection, in the same run: the same
/// Python client and server (`bench_channel.py`), one through the channel from rank 1's
/// sandbox to rank 0's, the other on the host.
#[derive(Clone, Debug, Serialize)]
pub struct ChannelReport {
    /// Bytes sent each way measured.
    pub bytes: u64,
    /// Throughput through the channel, MB/s (10^6 bytes).
    pub channel_mb_s: f64,
    /// Throughput over the direct connection, MB/s.
    pub direct_mb_s: f64,
    /// Channel against direct throughput (goal: at least 0.5).
    pub ratio: f64,
    /// One-byte round trips through the channel, µs.
    pub channel_rtt_us: Summary,
    /// One-byte round trips over the direct connection, µs.
    pub direct_rtt_us: Summary,
}

/// One process job whose output is `bytes` random bytes, delivered encrypted over loopback,
/// against plain age encryption of the same bytes in the same run.
#[derive(Clone, Debug, Serialize)]
pub struct TransferReport {
    /// Size of the output, bytes.
    pub bytes: u64,
    /// From the requester hearing the run completed to the output fetched, decrypted and
    /// checked there: the worker sealing it (age encryption, its Merkle leaves), the
    /// transfer, and the requester's checks and decryption, ms.
    pub completed_to_delivered_ms: u64,
    /// Of which from the manifest's arrival (sealing done) to the task done, ms.
    pub manifest_to_delivered_ms: u64,
    /// Plain age encryption of the same bytes, file to file, as the `age` tool does it, in
    /// the benchmark's own process, ms.
    pub age_encrypt_ms: u64,
    /// `age_encrypt_ms / completed_to_delivered_ms`: the encrypted transfer's throughput
    /// relative to plain age encryption.
    pub ratio: f64,
}

/// The same offers published while an attacker runs against every node.
#[derive(Clone, Debug, Serialize)]
pub struct HostileReport {
    /// Publish-to-receipt time under attack, µs.
    pub propagation_us: Summary,
    /// Receipts expected and seen under attack.
    pub receipts_expected: usize,
    /// Receipts seen within the wait.
    pub receipts_seen: usize,
    /// p99 under attack over p99 without it (the same run).
    pub p99_ratio: f64,
    /// Largest resident memory of a node before the attack, KiB.
    pub rss_kib_max_before: u64,
    /// Largest resident memory of a node at the end of the attack, KiB.
    pub rss_kib_max_during: u64,
    /// Most of the flood's offers one node held.
    pub flood_offers_held_max: usize,
    /// Nodes still holding every node's ad after the attack.
    pub nodes_holding_every_ad: usize,
    /// What the attacker did (`cannabis testnet attack --json`).
    pub attacker: serde_json::Value,
}

/// The figures.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Nodes in the testnet.
    pub nodes: usize,
    /// Offers published.
    pub offers: usize,
    /// Time for the testnet to start and connect (every node holds every ad), ms.
    pub converge_ms: u64,
    /// Publish-to-receipt time over every (offer, receiving node) pair, µs.
    pub propagation_us: Summary,
    /// Receipts expected and seen.
    pub receipts_expected: usize,
    /// Receipts seen within the wait.
    pub receipts_seen: usize,
    /// Direct request-response round trip node 0 -> node 1, µs (the baseline).
    pub request_response_rtt_us: Summary,
    /// Idle resident memory per node, KiB: mean. It counts the binary's pages, which
    /// every node on the machine shares.
    pub rss_kib_mean: u64,
    /// Idle resident memory per node, KiB: largest.
    pub rss_kib_max: u64,
    /// Idle proportional memory per node (shared pages split among their users), KiB:
    /// mean. What one more node costs the machine.
    pub pss_kib_mean: u64,
    /// Idle proportional memory per node, KiB: largest.
    pub pss_kib_max: u64,
    /// Open connections per node when idle: mean.
    pub peers_mean: f64,
    /// The job submitted from node 0 to every other node as one group, placed early (as
    /// soon as a bid from every rank is in): its size.
    pub job_group: u32,
    /// From publishing the job to its placement (the last needed bid), ms (node 0's clock,
    /// from the job's own history).
    pub job_submit_to_placed_ms: u64,
    /// From placement (the last needed bid's arrival) to every rank holding a
    /// countersigned lease: awards, countersignatures, one durable write per burst.
    pub job_placed_to_leases_ms: u64,
    /// From publishing the job to every rank holding a countersigned lease, ms.
    pub job_submit_to_leases_ms: u64,
    /// Single synthetic jobs placed on their first bid, one after another.
    pub work_jobs: usize,
    /// From an offer's publication to its worker reporting the run started (or, for a run
    /// shorter than the pause between the worker's looks, completed) (ms).
    pub work_submit_to_running_ms: Summary,
    /// From an offer's publication to its outputs fetched, checked and the task done (ms).
    pub work_submit_to_delivered_ms: Summary,
    /// The encrypted transfer (`--transfer-mib`), unless skipped.
    pub transfer: Option<TransferReport>,
    /// Why the transfer phase did not run, when it did not.
    pub transfer_skipped: Option<String>,
    /// The group channel against direct TCP (`--channel-mib`), unless skipped.
    pub channel: Option<ChannelReport>,
    /// Why the channel phase did not run, when it did not.
    pub channel_skipped: Option<String>,
    /// The run under attack (`--hostile`).
    pub hostile: Option<HostileReport>,
    /// How long each timed phase (group, work, transfer, channel) waited for the nodes to
    /// go quiet after the one before (their CPU together under a quarter of the machine),
    /// ms, in order; a phase that started without it is named in `not_quiet`.
    pub quiet_wait_ms: Vec<u64>,
    /// The timed phases that began while the nodes were still busy after 30 s.
    pub not_quiet: Vec<String>,
}

/// How busy the nodes together may be, as a share of the machine's cores, for a timed
/// phase to begin: idle, 100 nodes on two cores use about a tenth of them.
const QUIET_SHARE: f64 = 0.25;

/// How long a timed phase waits for quiet at most.
const QUIET_WITHIN: Duration = Duration::from_secs(30);

/// Bid window of the benchmark's job: long, since it is placed as soon as its bids are in.
const JOB_BID_WINDOW_MS: u64 = 30_000;

/// How long after the last trim of connections memory is read: one node upkeep and a
/// second.
const IDLE_SETTLE: Duration = Duration::from_secs(11);

/// How a benchmark group job went, ms: (group, submit to placed, placed to leases).
fn time_job(net: &Testnet) -> anyhow::Result<(u32, u64, u64)> {
    let group = u32::try_from(net.nodes.len() - 1)?;
    let mut t = bench_offer(0);
    t.name = Some("bench-group".into());
    // What every node admits (a quarter core is 0 whole cores), so each can take a rank.
    t.tasks[0].resources = Resources {
        memory_bytes: 128 << 20,
        processes: 64,
        storage_bytes: 16 << 20,
        ..Resources::default()
    };
    t.tasks[0].group_size = group;
    t.tasks[0].budget = Amount(1_000_000 * u64::from(group));
    t.ttl_ms = JOB_BID_WINDOW_MS;
    t.deadline_ms = 600_000;
    t.early = Some(cannabis_market::job::Early::FirstBids(group));
    // The last node asks, as a requester on a real network would: not node 0, which
    // sequences the testnet's ledger and makes the block of the group's escrow
    // assignments at the same moment (node 0 takes a rank like every other node).
    let origin = &net.nodes.last().context("no nodes")?.client;
    let job = origin.submit_job(&t)?;
    // Polled by its summary until its task is past leasing: the detail of a 99-rank job
    // is half a megabyte of JSON, which the requester would make every poll on the
    // cores that the work being measured needs. The times come from its history, once.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let summary = origin
            .jobs()?
            .into_iter()
            .find(|j| j.job_id == job.job_id)
            .context("the benchmark job is not listed")?;
        let task = summary.tasks.first().map_or("", String::as_str);
        if !matches!(task, "waiting" | "bidding" | "leasing") {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the benchmark job's leases: not within 60 s ({task})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, at) = await_events(
        origin,
        &job.job_id,
        &[
            &["offer published"],
            &["placed (attempt 1)"],
            &["every rank holds"],
        ],
        Duration::from_secs(60),
        "the benchmark job's leases",
    )?;
    Ok((group, at[1].ms_since(at[0]), at[2].ms_since(at[1])))
}

/// Polls `client`'s job `job_id` until its history holds each of `events` (each given as
/// alternatives: the first line that contains any of them): their times, and the job
/// then. Fails when the task fails, or after `within`.
fn await_events(
    client: &cannabis_api::ApiClient,
    job_id: &str,
    events: &[&[&str]],
    within: Duration,
    what: &str,
) -> anyhow::Result<(cannabis_api::JobDetail, Vec<cannabis_protocol::Timestamp>)> {
    let deadline = Instant::now() + within;
    loop {
        let detail = client.job(job_id)?;
        let at: Option<Vec<_>> = events
            .iter()
            .map(|any| {
                any.iter().find_map(|text| {
                    detail
                        .history
                        .iter()
                        .find(|e| e.text.contains(text))
                        .map(|e| e.at)
                })
            })
            .collect();
        if let Some(at) = at {
            return Ok((detail, at));
        }
        if let status @ cannabis_market::job::TaskStatus::Failed(_) = &detail.tasks[0].status {
            anyhow::bail!("{what}: the job {status}");
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{what}: not within {} s",
            within.as_secs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The offer the benchmark publishes: one small synthetic task.
pub fn bench_offer(k: usize) -> OfferTemplate {
    OfferTemplate {
        name: None,
        nonce: None,
        tasks: vec![TaskSpec {
            restarts: 0,
            name: format!("bench-{k}"),
            workload: Workload {
                adapter: AdapterKind::Synthetic,
                digest: Digest::of(b"cannabis/synthetic/v1"),
                entrypoint: vec!["64".into()],
            },
            inputs: Vec::new(),
            outputs: Vec::new(),
            resources: Resources::default(),
            requirements: Requirements::default(),
            group_size: 1,
            depends_on: Vec::new(),
            budget: Amount(1_000),
            checkpoint: None,
        }],
        ttl_ms: 10 * 60_000,
        deadline_ms: 20 * 60_000,
        review_window_ms: 60 * 60_000,
        acceptance: Vec::new(),
        evaluation: None,
        early: None,
        spot_check_ppm: 0,
    }
}

/// How many jobs the work phase runs.
const WORK_JOBS: usize = 20;

/// Runs `WORK_JOBS` single synthetic jobs from node 0, each placed on its first bid, one
/// after another: publication to running, and to delivered, from the job's own history.
fn time_work(net: &Testnet) -> anyhow::Result<(Vec<u64>, Vec<u64>)> {
    let origin = &net.nodes[0].client;
    let (mut running, mut delivered) = (Vec::new(), Vec::new());
    for k in 0..WORK_JOBS {
        let mut t = bench_offer(2_000_000 + k);
        t.name = Some(format!("bench-work-{k}"));
        t.tasks[0].resources = Resources {
            cpu_millicores: 1000,
            memory_bytes: 256 << 20,
            swap_bytes: 0,
            processes: 64,
            storage_bytes: 16 << 20,
            gpus: 0,
        };
        t.tasks[0].budget = Amount(1_000_000);
        t.ttl_ms = JOB_BID_WINDOW_MS;
        t.deadline_ms = 600_000;
        t.early = Some(cannabis_market::job::Early::FirstBids(1));
        let job = origin.submit_job(&t)?;
        // A stage shorter than the pause between the worker's looks may go unreported: a run
        // reported completed without "running" started no later than that.
        let (_, at) = await_events(
            origin,
            &job.job_id,
            &[
                &["offer published"],
                &["): running", "): completed"],
                &["task done"],
            ],
            Duration::from_secs(60),
            &format!("benchmark job {k}"),
        )?;
        running.push(at[1].ms_since(at[0]));
        delivered.push(at[2].ms_since(at[0]));
    }
    Ok((running, delivered))
}

/// The program of the transfer phase's job: `bytes` random bytes into its output.
fn transfer_bundle(bytes: u64) -> anyhow::Result<Vec<u8>> {
    let script = format!("head -c {bytes} /dev/urandom > \"$CANNABIS_WORK/blob.bin\"\n");
    bundle_of(&[("run.sh", script.as_bytes())])
}

/// A program bundle (a tar file) holding `files`, by name.
fn bundle_of(files: &[(&str, &[u8])]) -> anyhow::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut header = tar::Header::new_ustar();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, name, *data)?;
    }
    Ok(tar.into_inner()?)
}

/// Puts `bundle` where `job submit` keeps a bundle for workers to fetch, on node 0: its
/// digest, which the offer pins.
fn stage_bundle(net: &Testnet, bundle: &[u8]) -> anyhow::Result<Digest> {
    let digest = Digest::of(bundle);
    let packages = net.nodes[0].data_dir.join("packages");
    std::fs::create_dir_all(&packages)?;
    std::fs::write(packages.join(digest.to_string()), bundle)?;
    Ok(digest)
}

/// Runs one process job from node 0 whose output is `bytes` random bytes, and times its
/// delivery from the job's own history; then encrypts the delivered bytes with plain age
/// here, file to file, as the baseline.
fn time_transfer(net: &Testnet, bytes: u64) -> anyhow::Result<TransferReport> {
    let origin = &net.nodes[0];
    let digest = stage_bundle(net, &transfer_bundle(bytes)?)?;
    let mut t = bench_offer(3_000_000);
    t.name = Some("bench-transfer".into());
    t.tasks[0].workload = Workload {
        adapter: AdapterKind::Process,
        digest,
        entrypoint: vec!["sh".into(), "run.sh".into()],
    };
    t.tasks[0].outputs = vec![cannabis_protocol::OutputDecl {
        name: "blob.bin".into(),
        max_bytes: bytes,
        rights: cannabis_protocol::OutputRights::Exclusive,
    }];
    // The work directory is a tmpfs: the output counts against the memory too.
    t.tasks[0].resources = Resources {
        cpu_millicores: 1000,
        memory_bytes: bytes + (128 << 20),
        swap_bytes: 0,
        processes: 64,
        storage_bytes: bytes + (16 << 20),
        gpus: 0,
    };
    t.tasks[0].budget = Amount(1_000_000);
    t.ttl_ms = JOB_BID_WINDOW_MS;
    t.deadline_ms = 600_000;
    t.early = Some(cannabis_market::job::Early::FirstBids(1));
    let job = origin.client.submit_job(&t)?;
    let (detail, at) = await_events(
        &origin.client,
        &job.job_id,
        &[&["): completed"], &["delivered a manifest"], &["task done"]],
        Duration::from_secs(300),
        "the transfer benchmark's job",
    )?;
    let (completed, manifest, done) = (at[0], at[1], at[2]);
    let out = detail.tasks[0]
        .delivered
        .iter()
        .find(|o| o.name == "blob.bin" && o.fetched)
        .context("the job is done but its output is not here")?;
    anyhow::ensure!(
        out.size_bytes == bytes,
        "the output has {} bytes, not {bytes}",
        out.size_bytes
    );
    let plain = std::path::PathBuf::from(&out.path);
    let sealed = net.dir.join("baseline.age");
    let age_encrypt_ms = age_encrypt(&plain, &sealed)?;
    let _ = std::fs::remove_file(&sealed);
    let completed_to_delivered_ms = done.ms_since(completed);
    Ok(TransferReport {
        bytes,
        completed_to_delivered_ms,
        manifest_to_delivered_ms: done.ms_since(manifest),
        age_encrypt_ms,
        ratio: age_encrypt_ms as f64 / completed_to_delivered_ms.max(1) as f64,
    })
}

/// The channel benchmark's program: rank 0 serves, rank 1 measures (see its header).
const CHANNEL_PROGRAM: &str = include_str!("bench_channel.py");

/// One-byte round trips each way of the channel benchmark measures.
const CHANNEL_ROUNDS: u32 = 200;

/// What `bench_channel.py client` writes.
#[derive(serde::Deserialize)]
struct ChannelRun {
    bytes: u64,
    seconds: f64,
    rtt_us: Vec<u64>,
}

/// Runs a group job of two ranks from node 0 whose rank 1 measures its channel to rank 0,
/// then the same client and server over loopback here.
fn time_channel(net: &Testnet, bytes: u64) -> anyhow::Result<ChannelReport> {
    let origin = &net.nodes[0];
    let digest = stage_bundle(
        net,
        &bundle_of(&[("bench_channel.py", CHANNEL_PROGRAM.as_bytes())])?,
    )?;
    let mut t = bench_offer(4_000_000);
    t.name = Some("bench-channel".into());
    t.tasks[0].workload = Workload {
        adapter: AdapterKind::Process,
        digest,
        entrypoint: vec![
            "python3".into(),
            "bench_channel.py".into(),
            bytes.to_string(),
            CHANNEL_ROUNDS.to_string(),
        ],
    };
    t.tasks[0].outputs = vec![cannabis_protocol::OutputDecl {
        name: "channel.json".into(),
        max_bytes: 64 << 10,
        rights: cannabis_protocol::OutputRights::Exclusive,
    }];
    t.tasks[0].resources = Resources {
        cpu_millicores: 1000,
        memory_bytes: 256 << 20,
        swap_bytes: 0,
        processes: 64,
        storage_bytes: 16 << 20,
        gpus: 0,
    };
    t.tasks[0].group_size = 2;
    t.tasks[0].budget = Amount(2_000_000);
    t.ttl_ms = JOB_BID_WINDOW_MS;
    t.deadline_ms = 600_000;
    t.early = Some(cannabis_market::job::Early::FirstBids(2));
    let job = origin.client.submit_job(&t)?;
    let (detail, _) = await_events(
        &origin.client,
        &job.job_id,
        &[&["task done"]],
        Duration::from_secs(300),
        "the channel benchmark's job",
    )?;
    let out = detail.tasks[0]
        .delivered
        .iter()
        .find(|o| o.rank == 1 && o.name == "channel.json" && o.fetched)
        .context("the job is done but rank 1's measurement is not here")?;
    let through: ChannelRun =
        serde_json::from_slice(&std::fs::read(&out.path)?).context("rank 1's measurement")?;
    let direct = direct_channel_run(&net.dir, bytes)?;
    let mb_s = |r: &ChannelRun| r.bytes as f64 / r.seconds.max(1e-9) / 1e6;
    let (channel_mb_s, direct_mb_s) = (mb_s(&through), mb_s(&direct));
    let (mut a, mut b) = (through.rtt_us, direct.rtt_us);
    Ok(ChannelReport {
        bytes,
        channel_mb_s,
        direct_mb_s,
        ratio: channel_mb_s / direct_mb_s.max(1e-9),
        channel_rtt_us: summarize(&mut a).context("no round trip through the channel")?,
        direct_rtt_us: summarize(&mut b).context("no direct round trip")?,
    })
}

/// The channel benchmark's client and server on this machine's loopback, directly.
fn direct_channel_run(dir: &std::path::Path, bytes: u64) -> anyhow::Result<ChannelRun> {
    use std::io::BufRead as _;
    let script = dir.join("bench_channel.py");
    std::fs::write(&script, CHANNEL_PROGRAM)?;
    let mut server = std::process::Command::new("python3")
        .arg(&script)
        .arg("serve")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting python3 for the direct baseline")?;
    let mut port = String::new();
    std::io::BufReader::new(server.stdout.take().context("the server's output")?)
        .read_line(&mut port)?;
    let out = dir.join("channel-direct.json");
    let ok = std::process::Command::new("python3")
        .arg(&script)
        .args(["client", "127.0.0.1", port.trim()])
        .arg(bytes.to_string())
        .arg(CHANNEL_ROUNDS.to_string())
        .arg(&out)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        // A server whose client never came would wait for it for good.
        let _ = server.kill();
    }
    let _ = server.wait();
    anyhow::ensure!(ok, "the direct baseline's client failed");
    Ok(serde_json::from_slice(&std::fs::read(&out)?)?)
}

/// Encrypts `from` into `to` with age to a fresh X25519 recipient, as `age -r` does: ms.
fn age_encrypt(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<u64> {
    use std::io::Write as _;
    let recipient = age::x25519::Identity::generate().to_public();
    let started = Instant::now();
    let mut src = std::io::BufReader::new(std::fs::File::open(from)?);
    let dst = std::io::BufWriter::new(std::fs::File::create(to)?);
    let encryptor =
        age::Encryptor::with_recipients(std::iter::once(&recipient as &dyn age::Recipient))?;
    let mut w = encryptor.wrap_output(dst)?;
    std::io::copy(&mut src, &mut w)?;
    w.finish()?.flush()?;
    Ok(u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX))
}

/// Runs the benchmark.
pub fn run(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    anyhow::ensure!(
        opts.testnet.nodes >= 2,
        "the benchmark needs at least 2 nodes"
    );
    let started = Instant::now();
    let net = Testnet::up(&opts.testnet)?;
    let converge_timeout = Duration::from_secs(60 + 2 * opts.testnet.nodes as u64);
    net.wait_converged(converge_timeout)?;
    let converge_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    // Every node takes a rank of the group job: a node whose executor's self-test was too
    // slow while 100 nodes started tries again by itself, and its new ad must be
    // everywhere before the job is offered.
    if net.wait_executors(Duration::ZERO).is_err() {
        net.wait_executors(Duration::from_secs(120))?;
        net.wait_converged(converge_timeout)?;
    }
    let converged = Instant::now();
    // Let start-up work settle before measuring latency.
    std::thread::sleep(Duration::from_secs(2));

    let origin = &net.nodes[0];
    let ping = origin
        .client
        .ping(&net.nodes[1].info.peer_id, opts.pings)
        .context("measuring the request-response baseline")?;
    let mut rtt = ping.rtt_us;

    let (mut latencies, expected) = propagation(&net, opts, 0)?;
    let seen = latencies.len();
    let mut quiet_wait_ms = Vec::new();
    let mut not_quiet = Vec::new();
    let mut settle = |phase: &str| {
        let (took, quiet) = net.wait_quiet(QUIET_SHARE, QUIET_WITHIN);
        quiet_wait_ms.push(u64::try_from(took.as_millis()).unwrap_or(u64::MAX));
        if !quiet {
            not_quiet.push(phase.to_string());
        }
    };
    settle("group");
    let (job_group, placed_ms, leases_ms) = time_job(&net)?;
    settle("work");
    let (mut running, mut delivered) = time_work(&net)?;

    // Idle: after the work, once the nodes have let go of the connections start-up made
    // beyond the twice-their-aim they keep (a node keeps each connection 30 s, then trims
    // every 10 s). A small testnet never has that many, and is measured at once.
    const KEPT: usize = 32;
    let idle_by = converged + Duration::from_secs(45);
    let peers = loop {
        let mut peers = Vec::with_capacity(net.nodes.len());
        for node in &net.nodes {
            peers.push(node.client.status()?.connected_peers);
        }
        if peers.iter().all(|&p| p <= KEPT) || Instant::now() >= idle_by {
            break peers;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    // Then one upkeep more (every 10 s): a node gives the memory of the connections it
    // closed back to the system at its next upkeep, and idle is after that.
    std::thread::sleep(IDLE_SETTLE);
    let memory = net.memory_kib();
    let rss: Vec<u64> = memory.iter().map(|m| m.0).collect();
    let pss: Vec<u64> = memory.iter().map(|m| m.1).collect();
    let peers: usize = peers.iter().sum();
    let propagation_us = summarize(&mut latencies).context("no offer reached any node")?;
    // After the idle figures, which it would disturb.
    let (transfer, transfer_skipped) = if opts.transfer_bytes == 0 {
        (None, Some("not asked for (--transfer-mib 0)".to_string()))
    } else if !nix::unistd::geteuid().is_root() {
        let why = "requesters' programs run only where the executor is root";
        (None, Some(why.to_string()))
    } else {
        settle("transfer");
        (Some(time_transfer(&net, opts.transfer_bytes)?), None)
    };
    let (channel, channel_skipped) = if opts.channel_bytes == 0 {
        (None, Some("not asked for (--channel-mib 0)".to_string()))
    } else if !nix::unistd::geteuid().is_root() {
        let why = "requesters' programs run only where the executor is root";
        (None, Some(why.to_string()))
    } else if !std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        (None, Some("python3 is not installed".to_string()))
    } else if net.nodes.len() < 3 {
        (
            None,
            Some("a group of two workers needs three nodes".to_string()),
        )
    } else {
        settle("channel");
        (Some(time_channel(&net, opts.channel_bytes)?), None)
    };
    let hostile = match &opts.hostile {
        Some(only) => Some(under_attack(&net, opts, only, &propagation_us)?),
        None => None,
    };
    Ok(BenchReport {
        transfer,
        transfer_skipped,
        channel,
        channel_skipped,
        hostile,
        quiet_wait_ms,
        not_quiet,
        job_group,
        job_submit_to_placed_ms: placed_ms,
        job_placed_to_leases_ms: leases_ms,
        job_submit_to_leases_ms: placed_ms + leases_ms,
        work_jobs: running.len(),
        work_submit_to_running_ms: summarize(&mut running).context("no job ran")?,
        work_submit_to_delivered_ms: summarize(&mut delivered).context("no job delivered")?,
        nodes: net.nodes.len(),
        offers: opts.offers,
        converge_ms,
        propagation_us,
        receipts_expected: expected,
        receipts_seen: seen,
        request_response_rtt_us: summarize(&mut rtt).context("no round trip measured")?,
        rss_kib_mean: rss.iter().sum::<u64>() / rss.len().max(1) as u64,
        rss_kib_max: rss.iter().copied().max().unwrap_or(0),
        pss_kib_mean: pss.iter().sum::<u64>() / pss.len().max(1) as u64,
        pss_kib_max: pss.iter().copied().max().unwrap_or(0),
        peers_mean: peers as f64 / net.nodes.len().max(1) as f64,
    })
}

/// Publishes the benchmark's offers from node 0 (numbered from `first`) and waits until
/// every other node holds them, or 30 s: the publish-to-receipt times, and how many
/// receipts were expected.
fn propagation(
    net: &Testnet,
    opts: &BenchOptions,
    first: usize,
) -> anyhow::Result<(Vec<u64>, usize)> {
    let origin = &net.nodes[0];
    let mut published = Vec::new();
    for k in first..first + opts.offers {
        let p = origin.client.publish_offer(&bench_offer(k))?;
        published.push((p.job_id, p.published_at_us));
        std::thread::sleep(opts.interval);
    }
    let expected = published.len() * (net.nodes.len() - 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut latencies = Vec::new();
        for node in &net.nodes[1..] {
            let offers = node.client.offers()?;
            for (job, at) in &published {
                if let Some(o) = offers.iter().find(|o| &o.job_id == job) {
                    latencies.push(o.received_at_us.saturating_sub(*at));
                }
            }
        }
        if latencies.len() >= expected || Instant::now() > deadline {
            return Ok((latencies, expected));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Seconds the attacker runs before the offers are published again.
const ATTACK_WARMUP: Duration = Duration::from_secs(5);

/// The offers again, while `cannabis testnet attack` runs against every node.
fn under_attack(
    net: &Testnet,
    opts: &BenchOptions,
    only: &[String],
    calm: &Summary,
) -> anyhow::Result<HostileReport> {
    let rss_before = net.rss_kib().into_iter().max().unwrap_or(0);
    // Long enough to cover the warm-up, the publishing and the wait for receipts.
    let seconds =
        ATTACK_WARMUP.as_secs() + (opts.interval * u32::try_from(opts.offers)?).as_secs() + 15;
    let mut attacker = std::process::Command::new(&opts.testnet.binary);
    attacker.args([
        "testnet",
        "attack",
        "--json",
        "--seconds",
        &seconds.to_string(),
    ]);
    if !only.is_empty() {
        attacker.arg(format!("--only={}", only.join(",")));
    }
    let attacker = attacker
        .arg("--dir")
        .arg(&net.dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting the attacker")?;
    std::thread::sleep(ATTACK_WARMUP);
    let measured = propagation(net, opts, 1_000_000);
    let rss_during = net.rss_kib().into_iter().max().unwrap_or(0);
    let out = attacker
        .wait_with_output()
        .context("waiting for the attacker")?;
    anyhow::ensure!(
        out.status.success(),
        "the attacker failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (mut latencies, expected) = measured?;
    let seen = latencies.len();
    let attacker: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("reading the attacker's report")?;
    let honest: std::collections::BTreeSet<String> =
        net.nodes.iter().map(|n| n.info.address.clone()).collect();
    let mut flood_max = 0;
    let mut holding = 0;
    for node in &net.nodes {
        let offers = node.client.offers()?;
        flood_max = flood_max.max(
            offers
                .iter()
                .filter(|o| !honest.contains(&o.requester))
                .count(),
        );
        let ads = node.client.ads()?;
        holding += usize::from(honest.iter().all(|a| ads.iter().any(|ad| &ad.node == a)));
    }
    let propagation_us =
        summarize(&mut latencies).context("no offer reached any node under attack")?;
    Ok(HostileReport {
        p99_ratio: propagation_us.p99 as f64 / calm.p99.max(1) as f64,
        propagation_us,
        receipts_expected: expected,
        receipts_seen: seen,
        rss_kib_max_before: rss_before,
        rss_kib_max_during: rss_during,
        flood_offers_held_max: flood_max,
        nodes_holding_every_ad: holding,
        attacker,
    })
}
