//! `cannabis supervisor bench`: what the supervisor's socket adds to an admission and to an
//! output read, against the same executor called in-process, in the same run.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_node::store::Store;
use cannabis_node::supervisor::{Supervisor, SupervisorClient, SupervisorConfig};
use cannabis_protocol::{AdapterKind, Amount, Digest, Requirements, Resources, TaskSpec, Workload};
use cannabis_runtime::exec::{AttemptRequest, Chunk, LimitsFile, Renewal};
use serde::Serialize;

use crate::output::{self, out};

/// Bytes the benchmark's task writes to its standard output.
const OUTPUT: u64 = 4 << 20;
/// Read sizes measured.
const READS: [u64; 2] = [64 << 10, 1 << 20];

#[derive(Serialize)]
struct PathFigures {
    admit_ms: f64,
    read_64k_ms: f64,
    read_1m_ms: f64,
}

#[derive(Serialize)]
struct Figures {
    runs: u32,
    in_process: PathFigures,
    socket: PathFigures,
    added_admit_ms: f64,
    added_read_64k_ms: f64,
    added_read_1m_ms: f64,
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

pub(super) fn run(runs: u32, json: bool) -> anyhow::Result<()> {
    anyhow::ensure!(runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the benchmark runs custom code in sandboxes with uids of their own: run it as root"
    );
    let scratch = tempfile::Builder::new()
        .prefix("cannabis-supervisor-bench-")
        .tempdir()
        .context("creating a scratch directory")?;
    let dir = scratch.path();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    let journal = Arc::new(Store::open(&dir.join("journal.redb"))?);
    let machine = cannabis_node::exec::machine_limits(dir, Vec::new());
    let ex = cannabis_node::exec::open(
        &dir.join("exec"),
        &machine,
        Path::new("/nonexistent/ceilings.toml"),
        &LimitsFile::default(),
        None,
        journal,
        None,
    )
    .map_err(|e| anyhow::anyhow!("the executor cannot run here: {e}"))?;
    let socket = dir.join("supervisor.sock");
    let supervisor = Arc::new(Supervisor::new(
        SupervisorConfig {
            socket: socket.clone(),
            dir: dir.join("supervisor"),
            node_uid: 65534,
            node_gid: 65534,
        },
        ex.clone(),
    )?);
    let listener = supervisor.bind()?;
    std::thread::spawn(move || supervisor.serve(&listener));
    let client = SupervisorClient::new(&socket);

    let bundle = dir.join("bundle.tar");
    let src = dir.join("src");
    std::fs::create_dir_all(&src)?;
    std::fs::write(
        src.join("run.sh"),
        format!("head -c {OUTPUT} /dev/zero | tr '\\0' x\n"),
    )?;
    let ok = Command::new("tar")
        .arg("cf")
        .arg(&bundle)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()?
        .success();
    anyhow::ensure!(ok, "tar failed");
    let digest = Digest::of(&std::fs::read(&bundle)?);

    let mut admits = [Vec::new(), Vec::new()];
    let mut reads: [[Vec<Duration>; 2]; 2] = Default::default();
    if !json {
        out!("{runs} admissions and output reads per path ...")?;
    }
    for i in 0..runs {
        // Alternate which path goes first, so neither always runs on a warmer machine.
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for path in order {
            let request = request(&format!("bench-{i}-{path}"), &bundle, digest);
            let t = Instant::now();
            let attempt = if path == 0 {
                ex.submit(request)?
            } else {
                client.submit(request)?
            };
            admits[path].push(t.elapsed());
            anyhow::ensure!(!attempt.refused, "refused: {:?}", attempt.reason);
            let done = ex.wait(&attempt.id, Duration::from_secs(60))?;
            anyhow::ensure!(done.state.is_final(), "the task did not finish");
            for (k, size) in READS.iter().enumerate() {
                let mut offset = 0;
                while offset < OUTPUT {
                    let t = Instant::now();
                    let chunk: Chunk = if path == 0 {
                        ex.read_output(&attempt.id, "stdout", offset, *size)?
                    } else {
                        client.read_output(&attempt.id, "stdout", offset, *size)?
                    };
                    reads[path][k].push(t.elapsed());
                    anyhow::ensure!(chunk.next_offset > offset, "no progress reading");
                    offset = chunk.next_offset;
                }
            }
        }
    }
    ex.shutdown();
    let [local_reads, socket_reads] = reads;
    let [local_admits, socket_admits] = admits;
    let figures = |admits: Vec<Duration>, reads: [Vec<Duration>; 2]| {
        let [r64, r1m] = reads;
        PathFigures {
            admit_ms: median(admits),
            read_64k_ms: median(r64),
            read_1m_ms: median(r1m),
        }
    };
    let local = figures(local_admits, local_reads);
    let sock = figures(socket_admits, socket_reads);
    let f = Figures {
        runs,
        added_admit_ms: sock.admit_ms - local.admit_ms,
        added_read_64k_ms: sock.read_64k_ms - local.read_64k_ms,
        added_read_1m_ms: sock.read_1m_ms - local.read_1m_ms,
        in_process: local,
        socket: sock,
    };
    if json {
        return output::json(&f);
    }
    out!("median, milliseconds      in-process    socket     added")?;
    for (what, a, b) in [
        (
            "admission (tar bundle)",
            f.in_process.admit_ms,
            f.socket.admit_ms,
        ),
        (
            "output read, 64 KiB",
            f.in_process.read_64k_ms,
            f.socket.read_64k_ms,
        ),
        (
            "output read, 1 MiB",
            f.in_process.read_1m_ms,
            f.socket.read_1m_ms,
        ),
    ] {
        out!("{what:<24} {a:>10.3} {b:>9.3} {:>9.3}", b - a)?;
    }
    Ok(())
}

fn request(id: &str, bundle: &Path, digest: Digest) -> AttemptRequest {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    AttemptRequest {
        request_id: id.into(),
        task: TaskSpec {
            restarts: 0,
            name: "bench".into(),
            workload: Workload {
                adapter: AdapterKind::Process,
                digest,
                entrypoint: vec!["sh".into(), "run.sh".into()],
            },
            inputs: Vec::new(),
            outputs: Vec::new(),
            resources: Resources {
                cpu_millicores: 500,
                memory_bytes: 128 << 20,
                swap_bytes: 0,
                processes: 32,
                storage_bytes: 64 << 20,
                gpus: 0,
            },
            requirements: Requirements::default(),
            group_size: 1,
            depends_on: Vec::new(),
            budget: Amount(0),
            checkpoint: None,
        },
        bundle: Some(bundle.to_path_buf()),
        inputs: Vec::new(),
        seed: None,
        lease_until_ms: now + 60_000,
        renewal: Renewal::Local,
        env: Vec::new(),
        loopback: false,
        hold: false,
        resume: None,
        checkpoint_to: None,
    }
}
