//! Adapters: how a kind of workload becomes a sandboxed command. They share one contract:
//! the executor stages, starts, observes and stops every kind alike; an adapter says what
//! isolation it needs, what to run, which outputs it declares, and how to read its result.

use std::path::Path;

use cannabis_protocol::{AdapterKind, Digest, IsolationLayer};

use super::attempt::{AttemptRequest, SyntheticResult};
use crate::sandbox::{files, paths};

/// What an adapter runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Command {
    pub(crate) argv: Vec<String>,
    pub(crate) cwd: String,
    /// Declared outputs with their size caps.
    pub(crate) outputs: Vec<(String, u64)>,
}

/// The contract every adapter keeps.
pub(crate) trait Adapter: Sync {
    /// Layers it cannot run without.
    fn isolation(&self) -> &'static [IsolationLayer];
    /// Checks the request before anything is reserved.
    fn check(&self, request: &AttemptRequest) -> Result<(), String>;
    /// Whether the request carries a bundle to verify and unpack.
    fn needs_bundle(&self) -> bool;
    /// The command, its working directory and its outputs.
    fn command(&self, request: &AttemptRequest) -> Result<Command, String>;
    /// Reads the adapter's own result from the copied outputs (beneath the attempt
    /// directory `dir`), once the command exited 0.
    fn interpret(
        &self,
        request: &AttemptRequest,
        outputs: &Path,
    ) -> Result<Option<SyntheticResult>, String>;
}

/// The adapter for `kind`, if this executor has one.
pub(crate) fn adapter(kind: AdapterKind) -> Option<&'static dyn Adapter> {
    match kind {
        AdapterKind::Process => Some(&Process),
        AdapterKind::Synthetic => Some(&Synthetic),
        AdapterKind::Torchrun => Some(&Torchrun),
    }
}

/// The environment every command gets (and nothing of the host's).
pub(crate) fn base_env() -> Vec<(String, String)> {
    [
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", paths::WORK),
        ("TMPDIR", "/tmp"),
        ("LANG", "C.UTF-8"),
        ("CANNABIS_WORK", paths::WORK),
        ("CANNABIS_INPUTS", paths::INPUTS),
        ("CANNABIS_BUNDLE", paths::BUNDLE),
        ("PYTHONDONTWRITEBYTECODE", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// A requester's program bundle (a tar file pinned by digest) run with its entrypoint, in
/// the bundle directory; outputs are written to `$CANNABIS_WORK/<name>`.
struct Process;

/// What a requester's own program runs only inside: every namespace, seccomp, a bounded
/// work directory, and the memory, process-count and CPU limits of its cgroup (without
/// them one program could fork-bomb the machine or exhaust its memory).
pub(crate) const PROCESS_LAYERS: &[IsolationLayer] = &[
    IsolationLayer::UserNamespace,
    IsolationLayer::MountNamespace,
    IsolationLayer::PidNamespace,
    IsolationLayer::NetworkNamespace,
    IsolationLayer::IpcUtsNamespace,
    IsolationLayer::NoPrivileges,
    IsolationLayer::Seccomp,
    IsolationLayer::BoundedWorkdir,
    IsolationLayer::CgroupMemory,
    IsolationLayer::CgroupPids,
    IsolationLayer::CgroupCpu,
];

impl Adapter for Process {
    fn isolation(&self) -> &'static [IsolationLayer] {
        PROCESS_LAYERS
    }

    fn check(&self, request: &AttemptRequest) -> Result<(), String> {
        check_program("process", "an entrypoint", request)
    }

    fn needs_bundle(&self) -> bool {
        true
    }

    fn command(&self, request: &AttemptRequest) -> Result<Command, String> {
        Ok(Command {
            argv: with_restarts(request, request.task.workload.entrypoint.clone()),
            cwd: paths::BUNDLE.into(),
            outputs: declared_outputs(request),
        })
    }

    fn interpret(&self, _: &AttemptRequest, _: &Path) -> Result<Option<SyntheticResult>, String> {
        Ok(None)
    }
}

/// Where the sandbox looks for `torchrun` (its `PATH`, whose directories it binds from
/// the host read-only).
const TORCHRUN: &[&str] = &["/usr/local/bin/torchrun", "/usr/bin/torchrun"];

/// Whether this machine has `torchrun` where a sandbox finds it: only then does the
/// executor take `torchrun` work.
pub fn torchrun_installed() -> bool {
    TORCHRUN.iter().any(|p| Path::new(p).is_file())
}

/// One rank of a PyTorch job started with `torchrun`, one process per node: the bundle
/// holds the training script, `entrypoint` is the script and its arguments (as torchrun
/// takes them). The rank, the group's size and rank 0's rendezvous come from the
/// environment the node sets for a group's rank (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `MASTER_PORT`); without them it is a group of one on the sandbox's loopback. The
/// rendezvous is torchrun's static one (rank 0's agent hosts the store the workers share);
/// torchrun restarts nothing itself (the task's terms decide restarts), and its logs go to
/// `$TMPDIR/torchrun`, inside the work directory. A task that allows restarts runs under
/// the restart supervisor, which gives each round its own port (torchrun reads it from
/// `PET_MASTER_PORT`).
struct Torchrun;

impl Adapter for Torchrun {
    fn isolation(&self) -> &'static [IsolationLayer] {
        PROCESS_LAYERS
    }

    fn check(&self, request: &AttemptRequest) -> Result<(), String> {
        check_program(
            "torchrun",
            "an entrypoint: the training script and its arguments",
            request,
        )
    }

    fn needs_bundle(&self) -> bool {
        true
    }

    fn command(&self, request: &AttemptRequest) -> Result<Command, String> {
        let env = |name: &str| {
            request
                .env
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let world = env("WORLD_SIZE").unwrap_or_else(|| "1".into());
        let rank = env("RANK").unwrap_or_else(|| "0".into());
        for (name, v) in [("WORLD_SIZE", &world), ("RANK", &rank)] {
            v.parse::<u32>()
                .map_err(|_| format!("{name} {v:?} is not a number"))?;
        }
        let master = env("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let mut argv: Vec<String> = [
            "torchrun",
            "--nnodes",
            &world,
            "--node_rank",
            &rank,
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            "static",
            "--master_addr",
            &master,
            "--max_restarts",
            "0",
            // Python 3.11's torchrun needs its workers' output redirected to files (and
            // copied to its own) to run at all.
            "--redirects",
            "1",
            "--tee",
            "1",
            "--log_dir",
            "/tmp/torchrun",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        if request.task.restarts == 0 {
            // The round's port comes from the restart supervisor otherwise.
            let port = env("MASTER_PORT").unwrap_or_else(|| "29500".into());
            argv.extend(["--master_port".to_string(), port]);
        }
        argv.extend(request.task.workload.entrypoint.iter().cloned());
        Ok(Command {
            argv: with_restarts(request, argv),
            cwd: paths::BUNDLE.into(),
            outputs: declared_outputs(request),
        })
    }

    fn interpret(&self, _: &AttemptRequest, _: &Path) -> Result<Option<SyntheticResult>, String> {
        Ok(None)
    }
}

/// `argv` under the restart supervisor (`cannabis exec rank`, see
/// [`crate::restart`]) when the task allows restarts; else as it is.
fn with_restarts(request: &AttemptRequest, argv: Vec<String>) -> Vec<String> {
    if request.task.restarts == 0 {
        return argv;
    }
    let mut wrapped = vec![
        paths::SELF.to_string(),
        "exec".into(),
        "rank".into(),
        "--restarts".into(),
        request.task.restarts.to_string(),
        "--".into(),
    ];
    wrapped.extend(argv);
    wrapped
}

/// A requester's program: an entrypoint (`what` says which) and the bundle it is in.
fn check_program(adapter: &str, what: &str, request: &AttemptRequest) -> Result<(), String> {
    if request.task.workload.entrypoint.is_empty() {
        return Err(format!("the {adapter} adapter needs {what}"));
    }
    if request.bundle.is_none() {
        return Err(format!("the {adapter} adapter needs the program bundle"));
    }
    Ok(())
}

/// The task's declared outputs with their size caps.
fn declared_outputs(request: &AttemptRequest) -> Vec<(String, u64)> {
    request
        .task
        .outputs
        .iter()
        .map(|o| (o.name.clone(), o.max_bytes))
        .collect()
}

/// The synthetic proof-of-compute task ([`cannabis_protocol::synthetic`]): this binary,
/// inside the sandbox, multiplies the seeded matrices and writes `result.json`.
struct Synthetic;

/// The synthetic task's result file and its product.
pub(crate) use cannabis_protocol::{SYNTHETIC_PRODUCT, SYNTHETIC_RESULT};

/// The dimension a synthetic task asks for: `entrypoint = ["<n>"]`, or the default.
pub(crate) fn synthetic_n(request: &AttemptRequest) -> Result<u32, String> {
    request.task.synthetic_n()
}

impl Adapter for Synthetic {
    fn isolation(&self) -> &'static [IsolationLayer] {
        &[
            IsolationLayer::NetworkNamespace,
            IsolationLayer::NoPrivileges,
        ]
    }

    fn check(&self, request: &AttemptRequest) -> Result<(), String> {
        if request.seed.is_none() {
            return Err("the synthetic adapter needs a seed".into());
        }
        synthetic_n(request).map(|_| ())
    }

    fn needs_bundle(&self) -> bool {
        false
    }

    fn command(&self, request: &AttemptRequest) -> Result<Command, String> {
        let seed = request.seed.ok_or("the synthetic adapter needs a seed")?;
        let n = synthetic_n(request)?;
        Ok(Command {
            argv: vec![
                paths::SELF.into(),
                "exec".into(),
                "synthetic".into(),
                "--seed".into(),
                seed.to_string(),
                "--size".into(),
                n.to_string(),
                "--out".into(),
                format!("{}/{SYNTHETIC_RESULT}", paths::WORK),
                "--product".into(),
                format!("{}/{SYNTHETIC_PRODUCT}", paths::WORK),
            ],
            cwd: paths::WORK.into(),
            outputs: vec![
                (SYNTHETIC_RESULT.into(), 4096),
                (SYNTHETIC_PRODUCT.into(), 4 * u64::from(n).pow(2)),
            ],
        })
    }

    fn interpret(
        &self,
        request: &AttemptRequest,
        outputs: &Path,
    ) -> Result<Option<SyntheticResult>, String> {
        // `outputs` is the attempt directory; the file is read beneath it.
        let mut text = String::new();
        super::open_beneath(outputs, &format!("{}/{SYNTHETIC_RESULT}", files::OUTPUTS))
            .and_then(|f| {
                std::io::Read::read_to_string(&mut std::io::Read::take(f, 4096), &mut text)
            })
            .map_err(|e| format!("reading {SYNTHETIC_RESULT}: {e}"))?;
        let result: SyntheticResult = serde_json::from_str(&text)
            .map_err(|e| format!("{SYNTHETIC_RESULT} is not a synthetic result: {e}"))?;
        if Some(result.seed) != request.seed || result.n != synthetic_n(request)? {
            return Err(format!("{SYNTHETIC_RESULT} answers another task"));
        }
        Ok(Some(result))
    }
}

/// Runs the synthetic task here (the command inside the sandbox): returns the result and
/// the product's bytes (its entries as little-endian `i32`, row-major).
pub fn run_synthetic(seed: Digest, n: u32) -> Result<(SyntheticResult, Vec<u8>), String> {
    let task =
        cannabis_protocol::synthetic::SyntheticTask::new(seed, n).map_err(|e| e.to_string())?;
    let c = task.compute();
    let result = SyntheticResult {
        seed,
        n,
        result_hash: cannabis_protocol::synthetic::result_hash(&c),
    };
    Ok((result, c.iter().flat_map(|x| x.to_le_bytes()).collect()))
}
