//! The sandbox: a workload on the shared kernel, confined by the kernel.
//!
//! Four processes take part, all of them this binary:
//!
//! 0. The host (the executor) asks the zygote for a monitor, creates the attempt's cgroups
//!    meanwhile, and sends the monitor the [`SandboxSpec`] and the cgroups' entry files
//!    over their control socket.
//! 1. The zygote (`cannabis __sandbox-zygote`, started once per executor, one thread) forks
//!    each monitor (a spare ahead of need, already in an empty network namespace when the
//!    zygote is root) and reaps it, and any pid 1 that outlives it, when they end. Forking a
//!    small process is ten times cheaper than executing this large binary again.
//! 2. The monitor (stage 1) moves itself into the attempt's cgroups while it still has the
//!    zygote's privileges, becomes the sandbox's unprivileged host uid, creates new user,
//!    pid, ipc and uts namespaces (and net, if it has none yet) and maps uid 0 inside to
//!    its own unprivileged uid outside. It forks stage 2, copies the workload's standard
//!    output and error into capped files, enforces the lease file (an expired lease kills
//!    the sandbox), copies the declared outputs out of the work directory and writes
//!    `exit.json`.
//! 3. Stage 2 (pid 1 of the new pid namespace) builds the sandbox root in a mount namespace
//!    of its own: a read-only tmpfs holding read-only binds of the system directories (the
//!    zygote's template), the staged inputs and the bundle, a size-limited tmpfs work
//!    directory, and a minimal `/dev`. It mounts `/proc`, pivots into the root, sets
//!    rlimits, applies Landlock, sets `no_new_privs`, drops every capability (bounding set
//!    included) and installs the seccomp filter. It then reports ready; the host inspects
//!    the running process (namespaces, credentials, seccomp, cgroups) and only after that
//!    does stage 2 start the workload's command. When the workload exits, pid 1 exits and
//!    the kernel kills whatever the workload left behind in the namespace.
//!
//! The only `unsafe` is in [`zygote`]: the `fork` of a process checked to have one thread,
//! and adopting descriptors received over the zygote's socket. No `pre_exec`.

mod cgroup;
mod check;
mod filter;
mod host;
mod stage;
mod zygote;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use cgroup::{CgroupError, CgroupLimits, CgroupUsage, Cgroups, JobCgroup};
pub use check::{SandboxCheck, check_running};
pub use host::{Launch, LaunchError, Starting, launch};
pub use stage::stage_main;
pub use zygote::Launcher;

/// The first argument that makes this binary the sandbox zygote.
pub const ZYGOTE_ARG: &str = "__sandbox-zygote";

/// Files stage 1 keeps in the attempt directory.
pub mod files {
    /// The lease deadline, milliseconds since the Unix epoch, as decimal text.
    pub const LEASE: &str = "lease";
    /// What stage 1 observed, JSON ([`super::ExitRecord`]).
    pub const EXIT: &str = "exit.json";
    /// The workload's standard output (capped).
    pub const STDOUT: &str = "stdout";
    /// The workload's standard error (capped).
    pub const STDERR: &str = "stderr";
    /// The sandbox's own diagnostics.
    pub const SANDBOX_LOG: &str = "sandbox.log";
    /// Declared outputs copied out of the work directory.
    pub const OUTPUTS: &str = "outputs";
    /// The sandbox root's mount point.
    pub const ROOT: &str = "root";
    /// Staged inputs.
    pub const INPUTS: &str = "inputs";
    /// The unpacked bundle.
    pub const BUNDLE: &str = "bundle";
    /// Sealed copies of the task's checkpoint file, taken while the workload runs:
    /// `<seq>.age` files (encrypted to the requester) and `latest.json`
    /// ([`super::CheckpointCopy`]) naming the newest.
    pub const CHECKPOINTS: &str = "checkpoints";
    /// The checkpoint a rank placed again resumes from, put in the work directory under
    /// the task's checkpoint name before the command starts.
    pub const RESUME: &str = "resume";
}

/// The newest checkpoint sealed out of a running sandbox: `checkpoints/latest.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CheckpointCopy {
    /// Counts the copies of this attempt from 1; the copy is `checkpoints/<seq>.age`.
    pub seq: u64,
    /// Its plaintext's size in bytes.
    pub size: u64,
    /// Its plaintext's SHA-256, lowercase hex.
    pub sha256: String,
}

/// Where things are inside the sandbox.
pub mod paths {
    /// The writable work directory (a size-limited tmpfs).
    pub const WORK: &str = "/work";
    /// Staged inputs, read-only.
    pub const INPUTS: &str = "/inputs";
    /// The workload bundle, read-only; the command's working directory.
    pub const BUNDLE: &str = "/bundle";
    /// This binary, read-only (the synthetic adapter runs it).
    pub const SELF: &str = "/.cannabis/cannabis";
    /// Readable (and executable) beneath these, under Landlock.
    pub(crate) const READ_ONLY: &[&str] = &[
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib64",
        "/lib32",
        "/libx32",
        "/etc",
        "/inputs",
        "/bundle",
        "/.cannabis",
        "/proc",
        "/dev/random",
        "/dev/urandom",
    ];
    /// Writable beneath these, under Landlock.
    pub(crate) const READ_WRITE: &[&str] = &["/work", "/tmp", "/dev/shm"];
}

/// Everything stage 1 needs, sent by the host on stage 1's standard input.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// The attempt directory on the host (owned by the sandbox uid).
    pub attempt_dir: PathBuf,
    /// Host uid the sandbox runs as (uid 0 inside maps to it).
    pub uid: u32,
    /// Host gid the sandbox runs as.
    pub gid: u32,
    /// Size of the work directory in bytes.
    pub work_bytes: u64,
    /// The command, its first element looked up in `PATH` unless it holds a `/`.
    pub argv: Vec<String>,
    /// The whole environment of the command.
    pub env: Vec<(String, String)>,
    /// The command's working directory inside the sandbox.
    pub cwd: String,
    /// Resource limits set with `setrlimit`.
    pub rlimits: Rlimits,
    /// Whether to install the seccomp filter.
    pub seccomp: bool,
    /// Whether to apply Landlock rules.
    pub landlock: bool,
    /// Declared outputs (file names in the work directory) with their size caps.
    pub outputs: Vec<(String, u64)>,
    /// Cap on each of standard output and standard error, in bytes.
    pub log_cap: u64,
    /// This binary on the host, bound read-only into the sandbox.
    pub program: PathBuf,
    /// Device nodes bound into `/dev` (whole GPUs).
    pub devices: Vec<PathBuf>,
    /// Whether the workload may use TCP and UDP sockets: on its network namespace's own
    /// loopback, the only interface it has (a group's rank meets the others there,
    /// through its node). Otherwise only Unix sockets.
    #[serde(default)]
    pub loopback: bool,
    /// The task's checkpoint file in the work directory: sealed (into `checkpoints/`)
    /// each time it changes while the command runs.
    #[serde(default)]
    pub checkpoint: Option<CheckpointSpec>,
}

/// What the monitor seals of the work directory while the command runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointSpec {
    /// The file's name in the work directory.
    pub name: String,
    /// Its size cap.
    pub cap: u64,
    /// The age recipient (`age1...`) each copy is encrypted to; `None`: no copies are
    /// taken (a checkpoint to resume from is still put in place).
    pub to: Option<String>,
}

/// The rlimits of the workload.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Rlimits {
    /// Largest file the workload can write (`RLIMIT_FSIZE`).
    pub file_size: u64,
    /// Open files (`RLIMIT_NOFILE`).
    pub open_files: u64,
    /// Processes of the sandbox uid (`RLIMIT_NPROC`); `None` when the uid is shared.
    pub processes: Option<u64>,
}

/// What stage 1 observed, written once to `exit.json` in the attempt directory.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitRecord {
    /// Whether the workload's command was started.
    pub started: bool,
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal that ended it, if any.
    pub signal: Option<i32>,
    /// Why stage 1 ended the sandbox itself: `lease expired`, `aborted before start`, or a
    /// set-up error.
    pub ended_by: Option<String>,
    /// Bytes of standard output kept, and dropped beyond the cap.
    pub stdout: LogCount,
    /// Bytes of standard error kept, and dropped beyond the cap.
    pub stderr: LogCount,
    /// Declared outputs copied out, in declaration order.
    pub outputs: Vec<OutputFile>,
    /// Declared outputs that were not copied, with the reason.
    pub refused_outputs: Vec<(String, String)>,
    /// When the workload started and ended, milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// See `started_at_ms`.
    pub ended_at_ms: u64,
}

/// Bytes kept and dropped of a capped log.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct LogCount {
    /// Bytes written to the file.
    pub kept: u64,
    /// Bytes read and thrown away beyond the cap.
    pub dropped: u64,
}

/// A declared output copied out of the work directory.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct OutputFile {
    /// Its declared name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the content, lowercase hex.
    pub sha256: String,
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
