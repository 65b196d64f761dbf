//! The executor: admission against the owner's limits (within the administrator's
//! ceilings), durable reservations, the attempt lifecycle (reserved, preparing, running,
//! then completed / failed / cancelled / unknown, then released or quarantined), owner
//! controls, and recovery after a restart. Every state change is written to the journal
//! before the effect it allows.
//!
//! Each active attempt has a driver thread. A restart of the executor is a lost
//! connection, not a lost job: a running sandbox keeps going under its lease file, and the
//! next executor finds it again through the journal, its cgroups and `exit.json`.

mod adapter;
mod attempt;
mod limits;
mod output;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cannabis_protocol::{AdapterKind, Digest, IsolationLayer, TaskInput};
use serde::{Deserialize, Serialize};

pub use adapter::{run_synthetic, torchrun_installed};
pub use attempt::{
    Attempt, AttemptRequest, AttemptState, Cleanup, Renewal, Reservation, SyntheticResult,
    WrongState,
};
pub use limits::{Ceilings, DEFAULT_CEILINGS, DEFAULT_SANDBOX_UID, Limits, LimitsFile};
pub use output::{Chunk, MAX_CHUNK, OutputError};

use crate::sandbox::{self, CgroupLimits, Cgroups, ExitRecord, SandboxSpec, files, now_ms};

/// Durable storage for the executor's records: the node's store. `put` must be durable
/// when it returns.
pub trait Journal: Send + Sync {
    /// Writes `value` under `key`.
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String>;
    /// Every record.
    fn all(&self) -> Result<Vec<(String, Vec<u8>)>, String>;
}

/// The owner's contribution switch.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Control {
    /// Taking and running work.
    Active,
    /// No new starts: admissions are refused and reserved work waits; running work goes on.
    Paused,
    /// Current work finishes; nothing new is taken.
    Draining,
    /// Current work was stopped (each stop recorded first); nothing new is taken.
    Stopped,
}

impl Control {
    /// The name people see.
    pub fn name(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Paused => "paused",
            Self::Draining => "draining",
            Self::Stopped => "stopped",
        }
    }
}

/// A leftover found at start-up with no journal record (an older executor's, or one whose
/// record was lost). Its outcome is unknown; it stays quarantined until the administrator
/// clears it after the idle and storage checks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Orphan {
    /// The attempt id its cgroup or directory carries.
    pub name: String,
    /// What was found.
    pub found: Vec<String>,
    /// When, milliseconds since the Unix epoch.
    pub found_at_ms: u64,
}

/// Executor settings.
#[derive(Clone, Debug)]
pub struct ExecutorConfig {
    /// Its directory (attempt directories live below); every ancestor must be
    /// traversable by the sandbox uids.
    pub dir: PathBuf,
    /// This binary (the sandbox stages re-execute it).
    pub program: PathBuf,
    /// The administrator's ceilings.
    pub ceilings: Ceilings,
    /// The owner's limits, within the ceilings.
    pub owner: Limits,
    /// Lease length the executor keeps for local runs, in milliseconds.
    pub local_lease_ms: u64,
    /// Cap on each of standard output and standard error, in bytes.
    pub log_cap: u64,
    /// The administrator-pinned NVIDIA CDI map: granted GPUs' device nodes come from it.
    pub cdi_map: Option<PathBuf>,
}

impl ExecutorConfig {
    /// Defaults for everything but the paths and limits.
    pub fn new(dir: PathBuf, program: PathBuf, ceilings: Ceilings, owner: Limits) -> Self {
        Self {
            dir,
            program,
            ceilings,
            owner,
            local_lease_ms: 15_000,
            log_cap: 16 << 20,
            cdi_map: None,
        }
    }
}

/// What went wrong talking to the executor.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The executor cannot run work on this machine.
    #[error("the executor is unavailable: {0}")]
    Unavailable(String),
    /// The journal could not be written or read; nothing was done.
    #[error("the attempt journal: {0}")]
    Journal(String),
    /// No such attempt.
    #[error("no attempt {0}")]
    NotFound(String),
    /// An illegal move.
    #[error(transparent)]
    WrongState(#[from] WrongState),
    /// A request that cannot be honoured.
    #[error("{0}")]
    Refused(String),
}

/// The executor; cheap to clone.
#[derive(Clone)]
pub struct Executor {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ExecutorConfig,
    journal: Arc<dyn Journal>,
    cgroups: Cgroups,
    cgroup_layers: Vec<IsolationLayer>,
    layers: Vec<IsolationLayer>,
    as_root: bool,
    /// Forks every sandbox's monitor; its zygote lives as long as the executor.
    launcher: sandbox::Launcher,
    state: Mutex<State>,
    shutdown: AtomicBool,
    pause_at: Option<String>,
    /// The attempts' driver threads, for [`Executor::shutdown_and_wait`].
    drivers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

struct State {
    attempts: BTreeMap<String, Attempt>,
    orphans: BTreeMap<String, Orphan>,
    control: Control,
    /// The owner's limits in force (within the ceilings).
    owner: Limits,
}

const CONTROL_KEY: &str = "control";
const OWNER_KEY: &str = "owner-limits";
const ATTEMPT_PREFIX: &str = "attempt/";
const ORPHAN_PREFIX: &str = "orphan/";

impl Executor {
    /// Opens the executor: checks that sandboxes can start here and which isolation layers
    /// actually apply (by starting one and looking at it), loads the journal, and resumes
    /// every attempt it holds (running ones are found again, or marked unknown).
    pub fn open(mut cfg: ExecutorConfig, journal: Arc<dyn Journal>) -> Result<Self, ExecError> {
        let as_root = nix::unistd::geteuid().is_root();
        // Every path under it is handed to processes that start in `/` (the zygote, the
        // sandboxes): a relative one would name nothing there.
        cfg.dir = std::path::absolute(&cfg.dir)
            .map_err(|e| ExecError::Unavailable(format!("{}: {e}", cfg.dir.display())))?;
        fs::create_dir_all(cfg.dir.join("attempts"))
            .map_err(|e| ExecError::Unavailable(format!("{}: {e}", cfg.dir.display())))?;
        if as_root {
            for dir in [cfg.dir.clone(), cfg.dir.join("attempts")] {
                fs::set_permissions(&dir, fs::Permissions::from_mode(0o711))
                    .map_err(|e| ExecError::Unavailable(format!("{}: {e}", dir.display())))?;
            }
            reachable(&cfg.dir)?;
            // The sandbox uid must be able to run this binary wherever it was built or
            // installed: a link (or copy) in the executor's directory, which also pins the
            // version running sandboxes use.
            cfg.program = pin_program(&cfg.program, &cfg.dir.join("bin"))?;
        }
        let name = hex_prefix(&Digest::of(cfg.dir.to_string_lossy().as_bytes()), 12);
        let cgroups = Cgroups::detect(&name);
        if !cgroups.is_usable() {
            return Err(ExecError::Unavailable(
                "no usable cgroup hierarchy: a sandbox's processes could not be tracked or killed as a whole"
                    .into(),
            ));
        }
        let mut cgroup_layers = Vec::new();
        if cgroups.memory() {
            cgroup_layers.push(IsolationLayer::CgroupMemory);
        }
        if cgroups.pids() {
            cgroup_layers.push(IsolationLayer::CgroupPids);
        }
        if cgroups.cpu() {
            cgroup_layers.push(IsolationLayer::CgroupCpu);
        }
        let pause_at = if cfg!(debug_assertions) {
            std::env::var("CANNABIS_EXEC_PAUSE_AT").ok()
        } else {
            None
        };
        let launcher = sandbox::Launcher::new(&cfg.program, &cfg.dir.join("template"));
        let owner = cfg.owner.clone();
        let mut inner = Inner {
            cfg,
            journal,
            cgroups,
            cgroup_layers,
            layers: Vec::new(),
            as_root,
            launcher,
            state: Mutex::new(State {
                attempts: BTreeMap::new(),
                orphans: BTreeMap::new(),
                control: Control::Active,
                owner,
            }),
            shutdown: AtomicBool::new(false),
            pause_at,
            drivers: Mutex::new(Vec::new()),
        };
        inner.layers = inner.probe_layers()?;
        let inner = Arc::new(inner);
        inner.load()?;
        let active: Vec<String> = inner
            .lock()
            .attempts
            .values()
            .filter(|a| a.cleanup == Cleanup::Pending)
            .map(|a| a.id.clone())
            .collect();
        for id in active {
            Inner::spawn_driver(&inner, id);
        }
        Ok(Self { inner })
    }

    /// The isolation layers this machine's sandbox was seen to enforce at start-up.
    pub fn layers(&self) -> &[IsolationLayer] {
        &self.inner.layers
    }

    /// A description of the cgroups in use.
    pub fn cgroups(&self) -> String {
        self.inner.cgroups.describe()
    }

    /// The owner's limits in force and the ceilings they sit under.
    pub fn limits(&self) -> (Limits, &Ceilings) {
        (self.inner.lock().owner.clone(), &self.inner.cfg.ceilings)
    }

    /// The owner's new limits, checked against the administrator's ceilings (a value
    /// above a ceiling is refused, and nothing changes). Journaled first; they hold
    /// across restarts. Work already admitted keeps what it holds.
    pub fn set_owner_limits(&self, file: &LimitsFile) -> Result<Limits, ExecError> {
        let inner = &self.inner;
        let limits = inner.cfg.ceilings.owner(file).map_err(ExecError::Refused)?;
        let mut st = inner.lock();
        let bytes = serde_json::to_vec(file).map_err(|e| ExecError::Journal(e.to_string()))?;
        inner
            .journal
            .put(OWNER_KEY, &bytes)
            .map_err(ExecError::Journal)?;
        st.owner = limits.clone();
        Ok(limits)
    }

    /// Capacity held now, summed over every attempt that holds some.
    pub fn reserved(&self) -> Reservation {
        sum_reserved(&self.inner.lock())
    }

    /// Admits a request or refuses it, durably either way, and returns its attempt. The
    /// same request id always returns the same attempt: a refused request stays refused
    /// and an admitted one never runs twice.
    pub fn submit(&self, request: AttemptRequest) -> Result<Attempt, ExecError> {
        let inner = &self.inner;
        let mut st = inner.lock();
        if let Some(a) = st
            .attempts
            .values()
            .find(|a| a.request.request_id == request.request_id)
        {
            return Ok(a.clone());
        }
        let now = now_ms();
        let id = format!(
            "a{}",
            hex_prefix(
                &Digest::of_parts(&[
                    request.request_id.as_bytes(),
                    &now.to_le_bytes(),
                    &(st.attempts.len() as u64).to_le_bytes(),
                ]),
                10
            )
        );
        let admitted = inner.admit(&st, &request);
        let lease_until_ms = request.lease_until_ms;
        let mut attempt = Attempt {
            id: id.clone(),
            request,
            state: AttemptState::Reserved,
            refused: false,
            reason: None,
            reservation: None,
            cleanup: Cleanup::Pending,
            cancel: None,
            layers: Vec::new(),
            monitor_pid: None,
            released: false,
            exit: None,
            usage: None,
            result: None,
            retry_of: None,
            lease_until_ms,
            history: Vec::new(),
        };
        match admitted {
            Ok(reservation) => {
                attempt.reservation = Some(reservation);
                attempt
                    .history
                    .push((now, "reserved: capacity held for this attempt".into()));
            }
            Err(why) => {
                attempt.state = AttemptState::Failed;
                attempt.refused = true;
                attempt.cleanup = Cleanup::Released;
                attempt.history.push((now, format!("refused: {why}")));
                attempt.reason = Some(why);
            }
        }
        inner.put_attempt(&attempt)?;
        st.attempts.insert(id.clone(), attempt.clone());
        drop(st);
        if !attempt.refused {
            Inner::spawn_driver(inner, id);
        }
        Ok(attempt)
    }

    /// A new attempt for the same task under a new request id, by an explicit decision;
    /// only for an attempt that ended failed, cancelled or unknown (never a refusal).
    pub fn retry(&self, id: &str, request_id: String) -> Result<Attempt, ExecError> {
        let old = self.get(id)?;
        if !matches!(
            old.state,
            AttemptState::Failed | AttemptState::Cancelled | AttemptState::Unknown
        ) || old.refused
        {
            return Err(ExecError::Refused(format!(
                "attempt {id} is {}; only a failed, cancelled or unknown attempt can be retried",
                old.status_line()
            )));
        }
        let mut request = old.request.clone();
        request.request_id = request_id;
        let now = now_ms();
        if request.renewal == Renewal::Local {
            request.lease_until_ms = now + self.inner.cfg.local_lease_ms;
        }
        let attempt = self.submit(request)?;
        if attempt.retry_of.is_none() && !attempt.refused {
            self.inner.update(&attempt.id, |a| {
                a.retry_of = Some(id.to_string());
                a.history.push((now, format!("retry of {id}")));
                Ok(())
            })?;
        }
        self.get(&attempt.id)
    }

    /// Records a stop, then acts: the whole process tree is killed at once. An attempt
    /// whose outcome is settled keeps it.
    pub fn stop(&self, id: &str, why: &str) -> Result<Attempt, ExecError> {
        let now = now_ms();
        let recorded = self.inner.update(id, |a| Ok(a.record_cancel(now, why)))?;
        if recorded {
            self.inner.cgroups.open(id).kill();
        }
        self.get(id)
    }

    /// Lets a held attempt's command start ([`AttemptRequest::hold`]); nothing for one
    /// that is not held or started already.
    pub fn release(&self, id: &str) -> Result<(), ExecError> {
        self.inner.update(id, |a| {
            a.released = true;
            Ok(())
        })
    }

    /// Moves an attempt's lease end (market renewals).
    pub fn renew(&self, id: &str, until_ms: u64) -> Result<(), ExecError> {
        self.inner.renew(id, until_ms).map(|_| ())
    }

    /// Sets the owner's switch; `Stopped` records a stop for every active attempt first.
    pub fn set_control(&self, control: Control) -> Result<(), ExecError> {
        let inner = &self.inner;
        {
            let mut st = inner.lock();
            let bytes =
                serde_json::to_vec(&control).map_err(|e| ExecError::Journal(e.to_string()))?;
            inner
                .journal
                .put(CONTROL_KEY, &bytes)
                .map_err(ExecError::Journal)?;
            st.control = control;
        }
        if control == Control::Stopped {
            let active: Vec<String> = inner
                .lock()
                .attempts
                .values()
                .filter(|a| !a.state.is_final())
                .map(|a| a.id.clone())
                .collect();
            for id in active {
                self.stop(&id, "stopped by the owner")?;
            }
        }
        Ok(())
    }

    /// The owner's switch.
    pub fn control(&self) -> Control {
        self.inner.lock().control
    }

    /// The adapters admission would take work for now: none unless the owner's switch is
    /// active; of the rest, those this executor implements, the owner allows, and this
    /// machine gives every layer they need (custom code also needs root). What the ad may
    /// offer.
    pub fn runnable_adapters(&self) -> Vec<AdapterKind> {
        self.inner.runnable(&self.inner.lock())
    }

    /// One attempt.
    pub fn get(&self, id: &str) -> Result<Attempt, ExecError> {
        self.inner
            .lock()
            .attempts
            .get(id)
            .cloned()
            .ok_or_else(|| ExecError::NotFound(id.to_string()))
    }

    /// Every attempt, oldest first.
    pub fn attempts(&self) -> Vec<Attempt> {
        let mut all: Vec<Attempt> = self.inner.lock().attempts.values().cloned().collect();
        all.sort_by_key(|a| a.history.first().map(|h| h.0));
        all
    }

    /// Leftovers found with no journal record.
    pub fn orphans(&self) -> Vec<Orphan> {
        self.inner.lock().orphans.values().cloned().collect()
    }

    /// The administrator's release of a quarantined attempt or a leftover, after checking
    /// independently that its process tree is empty and its storage is gone (removing
    /// what is left). Its outcome stays as it was.
    pub fn clear(&self, id: &str) -> Result<(), ExecError> {
        let inner = &self.inner;
        let orphan = inner.lock().orphans.contains_key(id);
        let quarantined = inner
            .lock()
            .attempts
            .get(id)
            .is_some_and(|a| matches!(a.cleanup, Cleanup::Quarantined { .. }));
        if !orphan && !quarantined {
            return Err(ExecError::Refused(format!(
                "{id} is neither quarantined nor a leftover"
            )));
        }
        inner.idle_and_clean(id).map_err(ExecError::Refused)?;
        if orphan {
            inner.journal_remove_orphan(id)?;
            inner.lock().orphans.remove(id);
        } else {
            let now = now_ms();
            inner.update(id, |a| {
                a.history.push((
                    now,
                    "cleared by the administrator after idle and storage checks".into(),
                ));
                a.release(now)
            })?;
        }
        Ok(())
    }

    /// Reads output `name` (stdout, stderr or a declared output) from `offset`; for a task
    /// with a checkpoint also `checkpoint/latest` (the newest copy sealed while it runs, a
    /// [`crate::sandbox::CheckpointCopy`] as JSON) and `checkpoint/<seq>` (that copy's age
    /// file, encrypted to [`AttemptRequest::checkpoint_to`]).
    pub fn read_output(
        &self,
        id: &str,
        name: &str,
        offset: u64,
        max: u64,
    ) -> Result<Chunk, ExecError> {
        let attempt = self.get(id)?;
        let declared: Vec<String> = adapter::adapter(attempt.request.task.workload.adapter)
            .and_then(|a| a.command(&attempt.request).ok())
            .map(|c| c.outputs.into_iter().map(|(n, _)| n).collect())
            .unwrap_or_default();
        output::read(
            &self.inner.attempt_dir(id),
            &attempt,
            &declared,
            name,
            offset,
            max,
        )
        .map_err(|e| ExecError::Refused(e.to_string()))
    }

    /// Blocks until the attempt is final and its cleanup has ended (or `timeout`).
    pub fn wait(&self, id: &str, timeout: Duration) -> Result<Attempt, ExecError> {
        let until = Instant::now() + timeout;
        loop {
            let a = self.get(id)?;
            if a.state.is_final() && a.cleanup != Cleanup::Pending {
                return Ok(a);
            }
            if Instant::now() >= until {
                return Ok(a);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Stops the drivers without touching running sandboxes (their lease files run out
    /// unless a next executor renews them).
    pub fn shutdown(&self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
    }

    /// [`Executor::shutdown`], then waits up to `timeout` for the drivers to return (they
    /// hold the journal: a process that opens it again must wait for them). Whether they
    /// all did.
    pub fn shutdown_and_wait(&self, timeout: Duration) -> bool {
        self.shutdown();
        let drivers =
            std::mem::take(&mut *self.inner.drivers.lock().unwrap_or_else(|p| p.into_inner()));
        let deadline = Instant::now() + timeout;
        for d in drivers {
            while !d.is_finished() {
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = d.join();
        }
        true
    }
}

fn sum_reserved(st: &State) -> Reservation {
    let mut sum = Reservation::default();
    for r in st
        .attempts
        .values()
        .filter(|a| a.holds_capacity())
        .filter_map(|a| a.reservation.as_ref())
    {
        sum.cpu_millicores += r.cpu_millicores;
        sum.memory_bytes += r.memory_bytes;
        sum.swap_bytes += r.swap_bytes;
        sum.processes += r.processes;
        sum.storage_bytes += r.storage_bytes;
        sum.gpus.extend(r.gpus.iter().cloned());
    }
    sum
}

fn hex_prefix(d: &Digest, n: usize) -> String {
    d.to_string().chars().take(n).collect()
}

/// Every ancestor of `dir` must let other users through, or the sandbox uid cannot reach
/// its attempt directory.
fn reachable(dir: &Path) -> Result<(), ExecError> {
    let blocked = dir.join("x").ancestors().skip(1).find_map(|a| {
        let mode = fs::metadata(a).ok()?.permissions().mode();
        (mode & 0o001 == 0).then(|| format!("{} (mode {:o})", a.display(), mode & 0o777))
    });
    match blocked {
        Some(b) => Err(ExecError::Unavailable(format!(
            "sandbox users cannot pass through {b} to reach {}; put the data directory where other users may traverse (chmod o+x) or choose another --data-dir",
            dir.display()
        ))),
        None => Ok(()),
    }
}

/// Hard-links `program` into `bin` (a copy across filesystems), readable and executable
/// by everyone, and returns the new path.
pub fn pin_program(program: &Path, bin: &Path) -> Result<PathBuf, ExecError> {
    let fail = |what: &str, e: std::io::Error| {
        ExecError::Unavailable(format!(
            "{what} {} into {}: {e}",
            program.display(),
            bin.display()
        ))
    };
    fs::create_dir_all(bin).map_err(|e| fail("pinning", e))?;
    fs::set_permissions(bin, fs::Permissions::from_mode(0o711)).map_err(|e| fail("pinning", e))?;
    let target = bin.join("cannabis");
    let tmp = bin.join(format!("cannabis.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&tmp);
    if fs::hard_link(program, &tmp).is_err() {
        fs::copy(program, &tmp).map_err(|e| fail("copying", e))?;
    }
    let mode = fs::metadata(&tmp)
        .map_err(|e| fail("pinning", e))?
        .permissions()
        .mode();
    if mode & 0o005 != 0o005 {
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
            .map_err(|e| fail("pinning", e))?;
    }
    fs::rename(&tmp, &target).map_err(|e| fail("pinning", e))?;
    Ok(target)
}

mod driver;

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attempt_dir(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("attempts").join(id)
    }

    fn put_attempt(&self, a: &Attempt) -> Result<(), ExecError> {
        let bytes = serde_json::to_vec(a).map_err(|e| ExecError::Journal(e.to_string()))?;
        self.journal
            .put(&format!("{ATTEMPT_PREFIX}{}", a.id), &bytes)
            .map_err(ExecError::Journal)
    }

    fn journal_remove_orphan(&self, name: &str) -> Result<(), ExecError> {
        // An empty value marks a cleared leftover.
        self.journal
            .put(&format!("{ORPHAN_PREFIX}{name}"), b"")
            .map_err(ExecError::Journal)
    }

    /// Applies `f` to a copy of the attempt, journals the copy, then makes it current.
    fn update<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut Attempt) -> Result<T, WrongState>,
    ) -> Result<T, ExecError> {
        let mut st = self.lock();
        let current = st
            .attempts
            .get(id)
            .ok_or_else(|| ExecError::NotFound(id.to_string()))?;
        let mut next = current.clone();
        let out = f(&mut next)?;
        if next != *current {
            self.put_attempt(&next)?;
            st.attempts.insert(id.to_string(), next);
        }
        Ok(out)
    }

    /// Moves the lease end forward (never back) in the journal, then in the lease file the
    /// sandbox enforces. Returns the lease end in force.
    fn renew(&self, id: &str, until_ms: u64) -> Result<u64, ExecError> {
        let until = self.update(id, |a| {
            a.lease_until_ms = a.lease_until_ms.max(until_ms);
            Ok(a.lease_until_ms)
        })?;
        let dir = self.attempt_dir(id);
        if dir.exists() {
            write_lease(&dir, until).map_err(|e| ExecError::Refused(e.to_string()))?;
        }
        Ok(until)
    }

    fn load(&self) -> Result<(), ExecError> {
        let records = self.journal.all().map_err(ExecError::Journal)?;
        let mut st = self.lock();
        let mut cleared = std::collections::BTreeSet::new();
        for (key, value) in records {
            if key == CONTROL_KEY {
                st.control = serde_json::from_slice(&value)
                    .map_err(|e| ExecError::Journal(format!("{key}: {e}")))?;
            } else if key == OWNER_KEY {
                let file: LimitsFile = serde_json::from_slice(&value)
                    .map_err(|e| ExecError::Journal(format!("{key}: {e}")))?;
                // Ceilings lowered since: the owner's limits from the configuration stand.
                match self.cfg.ceilings.owner(&file) {
                    Ok(limits) => st.owner = limits,
                    Err(e) => eprintln!("executor: the owner's saved limits are not applied: {e}"),
                }
            } else if let Some(id) = key.strip_prefix(ATTEMPT_PREFIX) {
                let a: Attempt = serde_json::from_slice(&value)
                    .map_err(|e| ExecError::Journal(format!("{key}: {e}")))?;
                st.attempts.insert(id.to_string(), a);
            } else if let Some(name) = key.strip_prefix(ORPHAN_PREFIX)
                && value.is_empty()
            {
                cleared.insert(name.to_string());
            } else if let Some(name) = key.strip_prefix(ORPHAN_PREFIX) {
                let o: Orphan = serde_json::from_slice(&value)
                    .map_err(|e| ExecError::Journal(format!("{key}: {e}")))?;
                st.orphans.insert(name.to_string(), o);
            }
        }
        // Leftovers nobody has a record of: their outcome is unknown and they stay
        // quarantined until cleared.
        let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for name in self.cgroups.existing() {
            found.entry(name).or_default().push("cgroup".into());
        }
        if let Ok(entries) = fs::read_dir(self.cfg.dir.join("attempts")) {
            for e in entries.flatten() {
                if let Ok(name) = e.file_name().into_string() {
                    found
                        .entry(name)
                        .or_default()
                        .push("attempt directory".into());
                }
            }
        }
        let now = now_ms();
        for (name, what) in found {
            if st.attempts.contains_key(&name)
                || st.orphans.contains_key(&name)
                || cleared.contains(&name)
            {
                continue;
            }
            let orphan = Orphan {
                name: name.clone(),
                found: what,
                found_at_ms: now,
            };
            let bytes =
                serde_json::to_vec(&orphan).map_err(|e| ExecError::Journal(e.to_string()))?;
            self.journal
                .put(&format!("{ORPHAN_PREFIX}{name}"), &bytes)
                .map_err(ExecError::Journal)?;
            st.orphans.insert(name, orphan);
        }
        Ok(())
    }

    fn spawn_driver(inner: &Arc<Self>, id: String) {
        let inner = Arc::clone(inner);
        let name = format!("attempt-{id}");
        let spawned = std::thread::Builder::new().name(name).spawn({
            let inner = Arc::clone(&inner);
            move || driver::drive(&inner, &id)
        });
        if let Ok(handle) = spawned {
            let mut drivers = inner.drivers.lock().unwrap_or_else(|p| p.into_inner());
            drivers.retain(|h| !h.is_finished());
            drivers.push(handle);
        }
    }

    /// The adapter for `kind`, if this executor implements it, the owner allows it, and
    /// this machine gives it every layer it needs; else why not.
    fn adapter_for(
        &self,
        owner: &Limits,
        kind: AdapterKind,
    ) -> Result<&'static dyn adapter::Adapter, String> {
        let Some(adapter) = adapter::adapter(kind) else {
            return Err(format!(
                "this executor has no {} adapter yet",
                kind_name(kind)
            ));
        };
        if !owner.adapters.contains(&kind) {
            return Err(format!(
                "the {} adapter is not allowed on this machine",
                kind_name(kind)
            ));
        }
        let custom = matches!(kind, AdapterKind::Process | AdapterKind::Torchrun);
        if custom && !owner.custom_code {
            return Err("custom code is not allowed on this machine".into());
        }
        if kind == AdapterKind::Torchrun && !adapter::torchrun_installed() {
            return Err("torchrun is not installed on this machine (PyTorch)".into());
        }
        for layer in adapter.isolation() {
            if !self.layers.contains(layer) {
                return Err(format!(
                    "the {} adapter needs {}, which this machine cannot provide",
                    kind_name(kind),
                    layer_name(*layer)
                ));
            }
        }
        if custom && !self.as_root {
            // Without root the sandbox runs as the node's own user, who owns node.key and
            // api.token: a program could read them through any gap in the other layers.
            return Err(
                "custom code runs only where the executor is root (a sandbox user of its own); \
                 as the node's user a program could reach the node's keys"
                    .into(),
            );
        }
        Ok(adapter)
    }

    /// See [`Executor::runnable_adapters`].
    fn runnable(&self, st: &State) -> Vec<AdapterKind> {
        if st.control != Control::Active {
            return Vec::new();
        }
        [
            AdapterKind::Process,
            AdapterKind::Synthetic,
            AdapterKind::Torchrun,
        ]
        .into_iter()
        .filter(|k| self.adapter_for(&st.owner, *k).is_ok())
        .collect()
    }

    /// Admission: the owner's switch, the adapter, the isolation the task requires, and
    /// every resource against the owner's limits and what is free now.
    fn admit(&self, st: &State, request: &AttemptRequest) -> Result<Reservation, String> {
        match st.control {
            Control::Active => {}
            Control::Paused => {
                return Err("paused by the owner: no new starts (cannabis node resume)".into());
            }
            Control::Draining => {
                return Err("draining: current work finishes, nothing new is taken".into());
            }
            Control::Stopped => return Err("stopped by the owner".into()),
        }
        let task = &request.task;
        let owner = &st.owner;
        let adapter = self.adapter_for(owner, task.workload.adapter)?;
        for layer in &task.requirements.isolation {
            if !self.layers.contains(layer) {
                return Err(format!(
                    "the task requires isolation {}, which this machine cannot provide",
                    layer_name(*layer)
                ));
            }
        }
        adapter.check(request)?;
        for o in &task.outputs {
            plain_name(&o.name).map_err(|e| format!("output {e}"))?;
        }
        match (&task.checkpoint, &request.resume) {
            (Some(c), _) => plain_name(&c.name).map_err(|e| format!("checkpoint {e}"))?,
            (None, Some(_)) => {
                return Err("a checkpoint to resume from, for a task that declares none".into());
            }
            (None, None) => {}
        }
        for input in &task.inputs {
            let name = input_name(input);
            plain_name(name).map_err(|e| format!("input {e}"))?;
            if !request.inputs.iter().any(|(n, _)| n == name) {
                return Err(format!("input {name:?} has no local file to stage"));
            }
        }
        let r = &task.resources;
        let used = sum_reserved(st);
        let check = |what: &str, asked: u64, limit: u64, used: u64, unit: &str| {
            if asked > limit {
                Err(format!(
                    "{what}: asks {asked}{unit}, this machine allows at most {limit}{unit}"
                ))
            } else if asked > limit.saturating_sub(used) {
                Err(format!(
                    "busy: {what} asks {asked}{unit}, {}{unit} free now",
                    limit.saturating_sub(used)
                ))
            } else {
                Ok(())
            }
        };
        let cpu = u64::from(r.cpu_millicores).max(1);
        check(
            "cpu",
            cpu,
            owner.cpu_millicores,
            used.cpu_millicores,
            " millicores",
        )?;
        check(
            "memory",
            r.memory_bytes,
            owner.memory_bytes,
            used.memory_bytes,
            " bytes",
        )?;
        check(
            "swap",
            r.swap_bytes,
            owner.swap_bytes,
            used.swap_bytes,
            " bytes",
        )?;
        let processes = u64::from(r.processes);
        check("processes", processes, owner.processes, used.processes, "")?;
        check(
            "storage",
            r.storage_bytes,
            owner.storage_bytes,
            used.storage_bytes,
            " bytes",
        )?;
        if r.memory_bytes == 0 || processes == 0 || r.storage_bytes == 0 {
            return Err("the task must ask for some memory, processes and storage".into());
        }
        if r.swap_bytes > 0 && !self.cgroups.swap_limit() {
            return Err(
                "swap cannot be limited on this machine (no memsw or memory.swap.max); ask for swap = 0"
                    .into(),
            );
        }
        let free_gpus: Vec<String> = owner
            .gpus
            .iter()
            .filter(|g| !used.gpus.contains(g))
            .cloned()
            .collect();
        let want = r.gpus as usize;
        if want > owner.gpus.len() {
            return Err(format!(
                "gpus: asks {want}, this machine allows at most {}",
                owner.gpus.len()
            ));
        }
        if want > free_gpus.len() {
            return Err(format!(
                "busy: gpus asks {want}, {} free now",
                free_gpus.len()
            ));
        }
        let uid = if self.as_root {
            let taken: Vec<u32> = st
                .attempts
                .values()
                .filter(|a| a.holds_capacity())
                .filter_map(|a| a.reservation.as_ref().map(|r| r.uid))
                .collect();
            let base = self.cfg.ceilings.sandbox_uid;
            (0..u32::MAX - base)
                .map(|k| base + k)
                .find(|u| !taken.contains(u))
                .ok_or("no sandbox uid left")?
        } else {
            nix::unistd::geteuid().as_raw()
        };
        Ok(Reservation {
            cpu_millicores: cpu,
            memory_bytes: r.memory_bytes,
            swap_bytes: r.swap_bytes,
            processes,
            storage_bytes: r.storage_bytes,
            gpus: free_gpus.into_iter().take(want).collect(),
            uid,
        })
    }

    /// Starts one sandbox, looks at it, and gives up before any command runs: the layers
    /// seen are the layers this machine advertises.
    fn probe_layers(&self) -> Result<Vec<IsolationLayer>, ExecError> {
        let dir = self.cfg.dir.join("probe");
        let _ = fs::remove_dir_all(&dir);
        let uid = if self.as_root {
            self.cfg.ceilings.sandbox_uid
        } else {
            nix::unistd::geteuid().as_raw()
        };
        let unavailable = |e: String| ExecError::Unavailable(format!("sandbox self-test: {e}"));
        driver::make_attempt_dir(&dir, self.as_root.then_some(uid)).map_err(unavailable)?;
        let name = "probe";
        let limits = CgroupLimits {
            memory_bytes: 64 << 20,
            swap_bytes: 0,
            processes: 16,
            cpu_millicores: 1000,
        };
        let cgroup = self
            .cgroups
            .create(name, &limits)
            .map_err(|e| unavailable(e.to_string()))?;
        let spec = SandboxSpec {
            attempt_dir: dir.clone(),
            uid,
            gid: uid,
            work_bytes: 1 << 20,
            argv: vec!["/bin/true".into()],
            env: Vec::new(),
            cwd: "/".into(),
            rlimits: sandbox::Rlimits {
                file_size: 1 << 20,
                open_files: 64,
                processes: self.as_root.then_some(16),
            },
            seccomp: true,
            landlock: true,
            outputs: Vec::new(),
            log_cap: 4096,
            program: self.cfg.program.clone(),
            devices: Vec::new(),
            loopback: false,
            checkpoint: None,
        };
        let result = (|| {
            write_lease(&dir, now_ms() + 30_000).map_err(|e| e.to_string())?;
            let ids = self.as_root.then_some((uid, uid));
            let mut launch = sandbox::launch(&self.launcher, &spec, ids, || ())
                .and_then(|(starting, ())| starting.enter(&cgroup))
                .map_err(|e| e.to_string())?;
            // Generous: on a machine busy starting (a 100-node testnet on two cores) a
            // working sandbox has taken over 10 s; the test is whether it works at all.
            let ready = launch.wait_ready(Duration::from_secs(30));
            let checked = ready
                .map_err(|e| e.to_string())
                .and_then(|(pid, reported)| {
                    sandbox::check_running(pid, &cgroup, &self.cgroup_layers, &reported)
                });
            launch.abort();
            checked
        })();
        let confirmed = cgroup.kill_and_confirm(Duration::from_secs(5));
        let _ = cgroup.remove();
        let _ = fs::remove_dir_all(&dir);
        let check = result.map_err(unavailable)?;
        if !confirmed {
            return Err(unavailable(
                "the self-test sandbox could not be killed".into(),
            ));
        }
        Ok(check.layers)
    }

    /// The administrator's checks before clearing: no process left in the attempt's
    /// cgroups, and its storage removed.
    fn idle_and_clean(&self, id: &str) -> Result<(), String> {
        let cg = self.cgroups.open(id);
        if !cg.kill_and_confirm(Duration::from_secs(5)) {
            return Err(format!(
                "processes are still in the cgroups of {id}: {:?}",
                cg.pids()
            ));
        }
        cg.remove().map_err(|e| e.to_string())?;
        driver::remove_storage(&self.attempt_dir(id)).map_err(|e| format!("storage: {e}"))
    }

    fn failpoint(&self, at: &str) {
        if self.pause_at.as_deref() == Some(at) {
            eprintln!("executor: paused at {at} (CANNABIS_EXEC_PAUSE_AT)");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
}

impl Drop for Inner {
    /// The last handle is gone and every driver has ended: the executor's own cgroup
    /// directories go too, unless an attempt's cgroup is still in them.
    fn drop(&mut self) {
        self.cgroups.remove_base();
    }
}

/// Writes the lease file atomically. The attempt directory belongs to the sandbox uid, so
/// nothing there is followed: the temporary file is created fresh (`O_EXCL`, no symlink)
/// under a unique name, and `rename` replaces the entry itself.
fn write_lease(dir: &Path, until_ms: u64) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{}.{}.{n}", files::LEASE, std::process::id()));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(until_ms.to_string().as_bytes())?;
    drop(f);
    fs::rename(&tmp, dir.join(files::LEASE))
}

/// Opens `rel` beneath the attempt directory `dir` for reading, refusing every symbolic
/// link on the way (the directory's content belongs to the sandbox uid).
pub(crate) fn open_beneath(dir: &Path, rel: &str) -> std::io::Result<fs::File> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
    let base = fs::File::open(dir)?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    let fd = openat2(&base, rel, how).map_err(std::io::Error::from)?;
    Ok(fs::File::from(fd))
}

fn input_name(input: &TaskInput) -> &str {
    match input {
        TaskInput::Staged(r) => &r.name,
        TaskInput::FromTask { name, .. } => name,
    }
}

/// A plain file name: no path, no `.` or `..`, not a log's name.
pub(crate) fn plain_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\0')
        || name == "stdout"
        || name == "stderr"
        || name.len() > 255
    {
        return Err(format!("name {name:?} is not a plain file name"));
    }
    Ok(())
}

/// An adapter's name as the job file writes it.
pub fn kind_name(kind: AdapterKind) -> &'static str {
    match kind {
        AdapterKind::Process => "process",
        AdapterKind::Synthetic => "synthetic",
        AdapterKind::Torchrun => "torchrun",
    }
}

/// A layer's name as job files and ads write it.
pub fn layer_name(layer: IsolationLayer) -> String {
    serde_json::to_value(layer)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{layer:?}"))
}

/// A readable summary of an exit record.
pub fn describe_exit(exit: &ExitRecord) -> String {
    match (exit.code, exit.signal, &exit.ended_by) {
        (_, _, Some(by)) => by.clone(),
        (Some(c), _, _) => format!("exit code {c}"),
        (_, Some(s), _) => format!("signal {s}"),
        _ => "no exit status".into(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use cannabis_protocol::{Amount, Requirements, Resources, TaskSpec, Workload};

    use super::*;

    pub(crate) fn task(adapter: AdapterKind) -> TaskSpec {
        TaskSpec {
            restarts: 0,
            name: "t".into(),
            workload: Workload {
                adapter,
                digest: Digest([0; 32]),
                entrypoint: Vec::new(),
            },
            inputs: Vec::new(),
            outputs: Vec::new(),
            resources: Resources {
                cpu_millicores: 1000,
                memory_bytes: 64 << 20,
                swap_bytes: 0,
                processes: 32,
                storage_bytes: 1 << 20,
                gpus: 0,
            },
            requirements: Requirements::default(),
            group_size: 1,
            depends_on: Vec::new(),
            budget: Amount(0),
            checkpoint: None,
        }
    }

    struct Memory(Mutex<BTreeMap<String, Vec<u8>>>);

    impl Journal for Memory {
        fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
            self.0.lock().unwrap().insert(key.into(), value.to_vec());
            Ok(())
        }
        fn all(&self) -> Result<Vec<(String, Vec<u8>)>, String> {
            Ok(self.0.lock().unwrap().clone().into_iter().collect())
        }
    }

    /// Admission alone, on an executor whose sandbox showed only some layers.
    fn inner(layers: Vec<IsolationLayer>) -> Inner {
        let machine = Limits {
            cpu_millicores: 2000,
            memory_bytes: 1 << 30,
            swap_bytes: 0,
            processes: 100,
            storage_bytes: 1 << 30,
            gpus: vec!["GPU-a".into()],
            adapters: vec![AdapterKind::Process, AdapterKind::Synthetic],
            custom_code: true,
        };
        let ceilings = Ceilings::load(Path::new("/nonexistent"), &machine).unwrap();
        Inner {
            cfg: ExecutorConfig::new("/x".into(), "/x".into(), ceilings, machine.clone()),
            journal: Arc::new(Memory(Mutex::new(BTreeMap::new()))),
            cgroups: Cgroups::default(),
            cgroup_layers: Vec::new(),
            layers,
            as_root: false,
            launcher: sandbox::Launcher::new(Path::new("/x"), Path::new("/x")),
            state: Mutex::new(State {
                attempts: BTreeMap::new(),
                orphans: BTreeMap::new(),
                control: Control::Active,
                owner: machine.clone(),
            }),
            shutdown: AtomicBool::new(false),
            pause_at: None,
            drivers: Mutex::new(Vec::new()),
        }
    }

    fn req(task: TaskSpec) -> AttemptRequest {
        AttemptRequest {
            request_id: "r".into(),
            task,
            bundle: Some("/b.tar".into()),
            inputs: Vec::new(),
            seed: Some(Digest([1; 32])),
            lease_until_ms: 0,
            renewal: Renewal::Local,
            env: Vec::new(),
            loopback: false,
            hold: false,
            resume: None,
            checkpoint_to: None,
        }
    }

    #[test]
    fn isolation_this_machine_cannot_provide_is_refused_with_the_reason() {
        let few = inner(vec![
            IsolationLayer::NetworkNamespace,
            IsolationLayer::NoPrivileges,
        ]);
        let st = few.lock();
        // The synthetic adapter needs only what is there.
        assert!(few.admit(&st, &req(task(AdapterKind::Synthetic))).is_ok());
        // A task that requires a missing layer is refused, naming it.
        let mut t = task(AdapterKind::Synthetic);
        t.requirements.isolation = vec![IsolationLayer::Landlock];
        let why = few.admit(&st, &req(t)).unwrap_err();
        assert!(why.contains("landlock"), "{why}");
        // The process adapter needs every namespace and seccomp.
        let mut t = task(AdapterKind::Process);
        t.workload.entrypoint = vec!["sh".into()];
        let why = few.admit(&st, &req(t)).unwrap_err();
        assert!(why.contains("process adapter needs"), "{why}");
    }

    #[test]
    fn custom_code_needs_every_limit_and_a_user_of_its_own() {
        let mut t = task(AdapterKind::Process);
        t.workload.entrypoint = vec!["sh".into()];
        let is_cgroup = |l: &IsolationLayer| {
            matches!(
                l,
                IsolationLayer::CgroupMemory
                    | IsolationLayer::CgroupPids
                    | IsolationLayer::CgroupCpu
            )
        };
        let namespaces: Vec<_> = adapter::PROCESS_LAYERS
            .iter()
            .copied()
            .filter(|l| !is_cgroup(l))
            .collect();
        // Every namespace, but no cgroup controllers (a host that did not delegate them):
        // a program could fork-bomb the machine or take its memory.
        let mut ex = inner(namespaces);
        ex.as_root = true;
        let why = ex.admit(&ex.lock(), &req(t.clone())).unwrap_err();
        assert!(why.contains("process adapter needs"), "{why}");
        // Every layer, as root: taken.
        let all = adapter::PROCESS_LAYERS.to_vec();
        let mut ex = inner(all);
        ex.as_root = true;
        assert!(ex.admit(&ex.lock(), &req(t.clone())).is_ok());
        // Every layer, but not root: the sandbox would be the node's own user.
        ex.as_root = false;
        let why = ex.admit(&ex.lock(), &req(t)).unwrap_err();
        assert!(why.contains("node's keys"), "{why}");
        // The synthetic task (this binary's own code) still runs without root.
        assert!(
            ex.admit(&ex.lock(), &req(task(AdapterKind::Synthetic)))
                .is_ok()
        );
    }

    #[test]
    fn only_what_admission_would_take_is_runnable() {
        let mut ex = inner(adapter::PROCESS_LAYERS.to_vec());
        ex.as_root = true;
        assert_eq!(
            ex.runnable(&ex.lock()),
            vec![AdapterKind::Process, AdapterKind::Synthetic]
        );
        // Not root: no custom code.
        ex.as_root = false;
        assert_eq!(ex.runnable(&ex.lock()), vec![AdapterKind::Synthetic]);
        // The owner forbids custom code, or paused the node: nothing of it, or nothing.
        ex.as_root = true;
        ex.lock().owner.custom_code = false;
        assert_eq!(ex.runnable(&ex.lock()), vec![AdapterKind::Synthetic]);
        ex.lock().control = Control::Paused;
        assert!(ex.runnable(&ex.lock()).is_empty());
    }

    #[test]
    fn admission_counts_what_is_held_and_hands_out_whole_gpus() {
        let ex = inner(vec![
            IsolationLayer::NetworkNamespace,
            IsolationLayer::NoPrivileges,
        ]);
        let mut st = ex.lock();
        let mut t = task(AdapterKind::Synthetic);
        t.resources.gpus = 1;
        t.resources.memory_bytes = 600 << 20;
        let r = ex.admit(&st, &req(t.clone())).unwrap();
        assert_eq!(r.gpus, ["GPU-a"]);
        let mut held = attempt::tests::attempt();
        held.reservation = Some(r);
        st.attempts.insert("a1".into(), held);
        let why = ex.admit(&st, &req(t.clone())).unwrap_err();
        assert!(why.starts_with("busy: memory"), "{why}");
        t.resources.memory_bytes = 1 << 20;
        let why = ex.admit(&st, &req(t.clone())).unwrap_err();
        assert!(why.contains("busy: gpus"), "{why}");
        t.resources.gpus = 2;
        let why = ex.admit(&st, &req(t)).unwrap_err();
        assert!(why.contains("at most 1"), "{why}");
    }

    #[test]
    fn names_must_be_plain() {
        for bad in ["", ".", "..", "a/b", "../x", "stdout", "stderr", "x\0y"] {
            assert!(plain_name(bad).is_err(), "{bad:?}");
        }
        for good in ["model.safetensors", "result.json", ".hidden", "a..b"] {
            assert!(plain_name(good).is_ok(), "{good:?}");
        }
    }
}
