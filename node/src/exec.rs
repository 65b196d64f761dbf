//! The node's side of the executor: the machine's capacity, the administrator's ceilings,
//! the owner's limits, the journal in the node's store, and [`ExecutorHandle`], which runs
//! work either in this process or through a root supervisor (`crate::supervisor`).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cannabis_protocol::{AdapterKind, IsolationLayer};
use cannabis_runtime::exec::{
    Attempt, AttemptRequest, Ceilings, Chunk, Control, DEFAULT_CEILINGS, ExecError, Executor,
    ExecutorConfig, Journal, Limits, LimitsFile, Orphan,
};

use crate::supervisor::{ExecutorStatus, Request, SupervisorClient};

/// The smallest MTU a group interface may have (IPv4's least).
const MIN_MTU: u32 = 576;
/// The largest.
const MAX_MTU: u32 = 65_535;

/// Makes attempt `id`'s group interface with rank `rank`'s address in its sandbox's
/// network namespace ([`cannabis_runtime::groupnet::make_interface`]): only for an
/// attempt admitted as a group's rank (held, with TCP on its loopback) at that very rank,
/// whose sandbox is made and not ended. The namespace is found from the attempt's own
/// monitor as the executor recorded it, never from anything the caller names; the kernel
/// allows one such device per sandbox while its descriptor is open. Needs root.
pub fn group_interface(ex: &Executor, id: &str, rank: u32, mtu: u32) -> Result<OwnedFd, ExecError> {
    if !(MIN_MTU..=MAX_MTU).contains(&mtu) {
        return Err(ExecError::Refused(format!(
            "an MTU of {mtu}: it must be {MIN_MTU} to {MAX_MTU}"
        )));
    }
    let a = ex.get(id)?;
    if !(a.request.hold && a.request.loopback) {
        return Err(ExecError::Refused(format!(
            "attempt {id} is not a group's rank"
        )));
    }
    let admitted = a
        .request
        .env
        .iter()
        .find(|(k, _)| k == "RANK")
        .map(|(_, v)| v.as_str());
    if admitted != Some(rank.to_string().as_str()) {
        return Err(ExecError::Refused(format!(
            "attempt {id} was admitted as rank {}, not {rank}",
            admitted.unwrap_or("(none)")
        )));
    }
    if a.state.is_final() {
        return Err(ExecError::Refused(format!(
            "attempt {id} is {}",
            a.state.name()
        )));
    }
    let pid = a
        .monitor_pid
        .ok_or_else(|| ExecError::Refused(format!("attempt {id} has no sandbox yet")))?;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).map_err(|e| {
        ExecError::Unavailable(format!(
            "the network namespace of attempt {id}'s sandbox: {e}"
        ))
    })?;
    cannabis_runtime::groupnet::make_interface(&ns, rank, mtu).map_err(|e| {
        ExecError::Unavailable(format!(
            "making the group interface in attempt {id}'s sandbox: {e}"
        ))
    })
}

/// Processes the machine offers when nothing else says.
const DEFAULT_PROCESSES: u64 = 4096;

/// What this machine has: every core, memory, swap, the free storage under `data_dir`,
/// its GPUs, and every adapter this executor implements.
pub fn machine_limits(data_dir: &Path, gpus: Vec<String>) -> Limits {
    let host = cannabis_runtime::probe::host(data_dir);
    Limits {
        cpu_millicores: u64::from(host.hardware.cpu_cores.max(1)) * 1000,
        memory_bytes: host.hardware.memory_bytes,
        swap_bytes: host.hardware.swap_bytes,
        processes: DEFAULT_PROCESSES,
        storage_bytes: host.hardware.storage_bytes,
        gpus,
        adapters: machine_adapters(),
        custom_code: true,
    }
}

/// The ceilings file: the given path, else the default.
pub fn ceilings_path(flag: Option<&Path>) -> PathBuf {
    flag.map_or_else(|| PathBuf::from(DEFAULT_CEILINGS), Path::to_path_buf)
}

/// Every adapter this executor implements that this machine can run: `torchrun` only
/// where PyTorch's launcher is installed.
pub fn machine_adapters() -> Vec<AdapterKind> {
    let mut a = vec![AdapterKind::Process, AdapterKind::Synthetic];
    if cannabis_runtime::exec::torchrun_installed() {
        a.push(AdapterKind::Torchrun);
    }
    a
}

/// Opens an executor under `dir` with the ceilings at `ceilings` and the owner's limits.
/// `cdi_map` is the owner's pinned NVIDIA CDI map, from which granted GPUs' device nodes
/// come. Sandboxes re-execute `program` (this binary when `None`).
pub fn open(
    dir: &Path,
    machine: &Limits,
    ceilings: &Path,
    owner: &LimitsFile,
    cdi_map: Option<&Path>,
    journal: Arc<dyn Journal>,
    program: Option<&Path>,
) -> Result<Executor, String> {
    let ceilings = Ceilings::load(ceilings, machine)?;
    let owner = ceilings.owner(owner)?;
    let program = match program {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe().map_err(|e| format!("finding this binary: {e}"))?,
    };
    let mut cfg = ExecutorConfig::new(dir.to_path_buf(), program, ceilings, owner);
    cfg.cdi_map = cdi_map.map(Path::to_path_buf);
    Executor::open(cfg, journal).map_err(|e| e.to_string())
}

/// Where this node's work runs: its own executor in this process, or a root supervisor's
/// through its socket. Every call blocks (run it off the async threads).
#[derive(Clone)]
pub enum ExecutorHandle {
    /// The executor in this process (testnets, root-run single-user setups).
    Local(Executor),
    /// The supervisor's, with what it said when the node connected.
    Supervised(Arc<Supervised>),
}

/// A supervisor the node talks to, and what it last said about itself.
pub struct Supervised {
    /// The socket client.
    pub client: SupervisorClient,
    /// The supervisor's state when last asked (for the ad, which must not block).
    pub seen: std::sync::Mutex<ExecutorStatus>,
    /// Whether the supervisor is root and this node is not: the network-facing process
    /// has no privileges, and workloads get uids of their own.
    pub separated: bool,
}

/// How the node runs work, as its status, logs and ad say.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", tag = "mode")]
pub enum ExecMode {
    /// The executor runs in the node's own process.
    InProcess,
    /// A supervisor runs it; the node talks to it over `socket`.
    Supervisor {
        /// The supervisor's socket.
        socket: PathBuf,
        /// Whether the supervisor is root and the node is not.
        separated: bool,
    },
}

impl ExecMode {
    /// In words, for logs and the CLI.
    pub fn describe(&self) -> String {
        match self {
            Self::InProcess => "in-process executor".into(),
            Self::Supervisor { socket, separated } => format!(
                "supervisor at {}{}",
                socket.display(),
                if *separated {
                    " (root; this node unprivileged)"
                } else {
                    " (not privilege-separated)"
                }
            ),
        }
    }
}

impl ExecutorHandle {
    /// Connects to the supervisor at `socket` and asks its state; the owner's `[executor]`
    /// limits from the node's configuration, when set, are asked for (the supervisor
    /// checks them against its ceilings).
    pub fn supervised(socket: &Path, owner: &LimitsFile) -> Result<Self, String> {
        let client = SupervisorClient::new(socket);
        let mut seen = client.status().map_err(|e| e.to_string())?;
        if *owner != LimitsFile::default() {
            match client.call::<Limits>(
                &crate::supervisor::Request::SetLimits {
                    limits: owner.clone(),
                },
                &[],
            ) {
                Ok(limits) => seen.limits = limits,
                Err(e) => tracing::warn!(reason = %e, "the supervisor kept its limits"),
            }
        }
        let supervisor_root = client.supervisor_uid().map_err(|e| e.to_string())? == 0;
        let separated = supervisor_root && !nix::unistd::geteuid().is_root();
        Ok(Self::Supervised(Arc::new(Supervised {
            client,
            seen: std::sync::Mutex::new(seen),
            separated,
        })))
    }

    /// Where work runs.
    pub fn mode(&self) -> ExecMode {
        match self {
            Self::Local(_) => ExecMode::InProcess,
            Self::Supervised(s) => ExecMode::Supervisor {
                socket: s.client.socket().to_path_buf(),
                separated: s.separated,
            },
        }
    }

    fn seen(s: &Supervised) -> std::sync::MutexGuard<'_, ExecutorStatus> {
        s.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Isolation layers in effect (the supervisor's as last seen); with a root supervisor
    /// and an unprivileged node, privilege separation too.
    pub fn layers(&self) -> Vec<IsolationLayer> {
        match self {
            Self::Local(ex) => ex.layers().to_vec(),
            Self::Supervised(s) => {
                let mut layers = Self::seen(s).layers.clone();
                if s.separated {
                    layers.push(IsolationLayer::PrivilegeSeparated);
                }
                layers
            }
        }
    }

    /// The adapters the executor would take work for now (the supervisor's as last
    /// seen): none while the owner's switch is not active.
    pub fn adapters(&self) -> Vec<AdapterKind> {
        match self {
            Self::Local(ex) => ex.runnable_adapters(),
            Self::Supervised(s) => Self::seen(s).adapters.clone(),
        }
    }

    /// The owner's limits in force (the supervisor's as last seen).
    pub fn limits(&self) -> Limits {
        match self {
            Self::Local(ex) => ex.limits().0,
            Self::Supervised(s) => Self::seen(s).limits.clone(),
        }
    }

    /// The executor's state now (with privilege separation among the layers, as the ad
    /// says it).
    pub fn info(&self) -> Result<ExecutorStatus, ExecError> {
        match self {
            Self::Local(ex) => Ok(ExecutorStatus::of(ex)),
            Self::Supervised(s) => {
                let mut st = s.client.status()?;
                *Self::seen(s) = st.clone();
                st.layers = self.layers();
                Ok(st)
            }
        }
    }

    /// Admits a request (see [`Executor::submit`]).
    pub fn submit(&self, request: AttemptRequest) -> Result<Attempt, ExecError> {
        match self {
            Self::Local(ex) => ex.submit(request),
            Self::Supervised(s) => s.client.submit(request),
        }
    }

    /// One attempt.
    pub fn get(&self, id: &str) -> Result<Attempt, ExecError> {
        self.ask(|ex| ex.get(id), || Request::Get { id: id.into() })
    }

    /// Every attempt.
    pub fn attempts(&self) -> Result<Vec<Attempt>, ExecError> {
        self.ask(|ex| Ok(ex.attempts()), || Request::Attempts)
    }

    /// Leftovers with no journal record.
    pub fn orphans(&self) -> Result<Vec<Orphan>, ExecError> {
        self.ask(|ex| Ok(ex.orphans()), || Request::Orphans)
    }

    /// Stops an attempt.
    pub fn stop(&self, id: &str, why: &str) -> Result<Attempt, ExecError> {
        self.ask(
            |ex| ex.stop(id, why),
            || Request::Stop {
                id: id.into(),
                why: why.into(),
            },
        )
    }

    /// Moves an attempt's lease end.
    pub fn renew(&self, id: &str, until_ms: u64) -> Result<(), ExecError> {
        self.ask(
            |ex| ex.renew(id, until_ms),
            || Request::Renew {
                id: id.into(),
                until_ms,
            },
        )
    }

    /// Lets a held attempt's command start.
    pub fn release(&self, id: &str) -> Result<(), ExecError> {
        self.ask(|ex| ex.release(id), || Request::Release { id: id.into() })
    }

    /// Makes held attempt `id`'s group interface, rank `rank`'s with `mtu`, in its
    /// sandbox's network namespace, and hands over the device (a supervisor's, which is
    /// root, as a descriptor over its socket).
    pub fn interface(&self, id: &str, rank: u32, mtu: u32) -> Result<OwnedFd, ExecError> {
        match self {
            Self::Local(ex) => group_interface(ex, id, rank, mtu),
            Self::Supervised(s) => s.client.interface(id, rank, mtu),
        }
    }

    /// Runs a failed attempt again.
    pub fn retry(&self, id: &str, request_id: String) -> Result<Attempt, ExecError> {
        match self {
            Self::Local(ex) => ex.retry(id, request_id),
            Self::Supervised(s) => s.client.call(
                &Request::Retry {
                    id: id.into(),
                    request_id,
                },
                &[],
            ),
        }
    }

    /// The administrator's clear (a supervisor takes it only from root).
    pub fn clear(&self, id: &str) -> Result<(), ExecError> {
        self.ask(|ex| ex.clear(id), || Request::Clear { id: id.into() })
    }

    /// Sets the owner's switch.
    pub fn set_control(&self, control: Control) -> Result<(), ExecError> {
        self.ask(
            |ex| ex.set_control(control),
            || Request::SetControl { control },
        )?;
        // What the ad offers follows the switch.
        let _ = self.info();
        Ok(())
    }

    /// Sets the owner's limits, within the ceilings.
    pub fn set_owner_limits(&self, limits: &LimitsFile) -> Result<Limits, ExecError> {
        let set = self.ask(
            |ex| ex.set_owner_limits(limits),
            || Request::SetLimits {
                limits: limits.clone(),
            },
        )?;
        let _ = self.info();
        Ok(set)
    }

    /// Reads an output.
    pub fn read_output(
        &self,
        id: &str,
        name: &str,
        offset: u64,
        max: u64,
    ) -> Result<Chunk, ExecError> {
        match self {
            Self::Local(ex) => ex.read_output(id, name, offset, max),
            Self::Supervised(s) => s.client.read_output(id, name, offset, max),
        }
    }

    /// One call, in process or through the socket.
    fn ask<T: serde::de::DeserializeOwned>(
        &self,
        local: impl FnOnce(&Executor) -> Result<T, ExecError>,
        remote: impl FnOnce() -> Request,
    ) -> Result<T, ExecError> {
        match self {
            Self::Local(ex) => local(ex),
            Self::Supervised(s) => s.client.call(&remote(), &[]),
        }
    }
}
