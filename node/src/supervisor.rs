//! The privileged supervisor: a root process that owns the executor (the administrator's
//! ceilings, admission, the journal, the zygote and the sandboxes, GPUs and the CDI map),
//! so that the network-facing node can run as an ordinary user.
//!
//! The two talk over a local Unix socket. Every frame is a 4-byte big-endian length and a
//! JSON body (at most [`MAX_FRAME`] bytes). The supervisor learns who is calling from the
//! kernel (`SO_PEERCRED`), never from the frame: the configured node user may use every
//! operation the node needs (admit, renew, stop, status, bounded output reads, the owner's
//! switch and limits, a group rank's network device), root may also clear quarantined
//! work, and anyone else is refused.
//! Files an admission names (the bundle, staged inputs) travel as open file descriptors
//! (`SCM_RIGHTS`) that the caller opened with its own rights: the supervisor never opens a
//! path on the node's behalf, and copies what it was handed into its own spool, bounded.
//!
//! There is no operation that changes the ceilings. The owner's limits change only through
//! an owner command, and the executor checks them against the ceilings.

use std::fs;
use std::io::{self, IoSlice, IoSliceMut, Read as _, Write as _};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cannabis_protocol::{AdapterKind, IsolationLayer};
use cannabis_runtime::exec::{
    Attempt, AttemptRequest, Chunk, Cleanup, Control, ExecError, Executor, Limits, LimitsFile,
    MAX_CHUNK, Reservation,
};
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, getsockopt, recvmsg, sendmsg, sockopt,
};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

/// Where the supervisor listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/cannabis/supervisor.sock";
/// The supervisor's own directory (journal, attempts, spool) unless told otherwise.
pub const DEFAULT_DIR: &str = "/var/lib/cannabis/supervisor";
/// The largest frame either side reads: an output chunk of [`MAX_CHUNK`] bytes as hex,
/// with room for the rest of the reply.
pub const MAX_FRAME: usize = 2 * MAX_CHUNK as usize + (64 << 10);
/// The most file descriptors one admission may hand over (the bundle and its inputs).
pub const MAX_FDS: usize = 64;
/// Connections served at once; more are told the supervisor is busy.
const MAX_CLIENTS: usize = 32;
/// A connection that sends nothing for this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// One operation, as the caller asks it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// The supervisor's state: limits, layers, the owner's switch, capacity held.
    Status,
    /// Admit an attempt. Its bundle, inputs and checkpoint to resume from come as file
    /// descriptors, in this order: the bundle (when `bundle` is set), then each input of
    /// `inputs`, then the checkpoint (when `resume` is set); the paths in the request are
    /// only names.
    Submit {
        /// The request.
        request: Box<AttemptRequest>,
    },
    /// One attempt.
    Get {
        /// Its id.
        id: String,
    },
    /// Every attempt.
    Attempts,
    /// Leftovers found with no journal record.
    Orphans,
    /// Stop an attempt (the stop is recorded first).
    Stop {
        /// Its id.
        id: String,
        /// Why, for its history.
        why: String,
    },
    /// Move an attempt's lease end (renewals by the lease holder).
    Renew {
        /// Its id.
        id: String,
        /// The new end, milliseconds since the Unix epoch.
        until_ms: u64,
    },
    /// Let a held attempt's command start (a group's rank, once the group is ready).
    Release {
        /// Its id.
        id: String,
    },
    /// Make a held attempt's group interface in its sandbox's network namespace (which
    /// takes root) and hand over the device: the reply comes with its descriptor
    /// (`SCM_RIGHTS`). Only for an attempt admitted as a group's rank (held, with TCP on
    /// its loopback) at that rank, whose sandbox is made and not ended; the kernel allows
    /// one such device per sandbox while its descriptor is open.
    Interface {
        /// The attempt.
        id: String,
        /// Its rank: the address the device gets, as the attempt's `RANK`.
        rank: u32,
        /// The device's MTU.
        mtu: u32,
    },
    /// Run a failed attempt again, by the owner's decision.
    Retry {
        /// The failed attempt.
        id: String,
        /// The new attempt's request id.
        request_id: String,
    },
    /// Release a quarantined attempt or a leftover (root only: the administrator's).
    Clear {
        /// Its id.
        id: String,
    },
    /// Set the owner's switch.
    SetControl {
        /// The switch.
        control: Control,
    },
    /// Set the owner's limits (each within the ceilings, or nothing changes).
    SetLimits {
        /// The limits.
        limits: LimitsFile,
    },
    /// Read an output from an offset, at most `max` bytes (capped at [`MAX_CHUNK`]). The
    /// reply's `data` is empty: the bytes follow in a frame of their own, as they are.
    Output {
        /// The attempt.
        id: String,
        /// `stdout`, `stderr` or a declared output.
        name: String,
        /// Where to start.
        offset: u64,
        /// At most this many bytes.
        max: u64,
    },
}

/// An executor's state: what [`Request::Status`] returns, and what the node shows of its
/// own executor.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ExecutorStatus {
    /// The owner's switch.
    pub control: Control,
    /// Isolation layers seen in effect at start-up.
    pub layers: Vec<IsolationLayer>,
    /// The cgroups in use.
    pub cgroups: String,
    /// The owner's limits in force.
    pub limits: Limits,
    /// Where the ceilings came from (`None`: the machine is the ceiling).
    pub ceilings: Option<PathBuf>,
    /// Capacity held now.
    pub reserved: Reservation,
    /// Whether the executor runs as root (workloads then get uids of their own).
    pub as_root: bool,
    /// The version of the process running it.
    pub version: String,
    /// The adapters it would take work for now (none while the owner's switch is not
    /// active): what the node's ad may offer.
    #[serde(default)]
    pub adapters: Vec<AdapterKind>,
}

impl ExecutorStatus {
    /// The state of `ex`, run by this process.
    pub fn of(ex: &Executor) -> Self {
        let (limits, ceilings) = ex.limits();
        Self {
            control: ex.control(),
            layers: ex.layers().to_vec(),
            cgroups: ex.cgroups(),
            limits,
            ceilings: ceilings.source.clone(),
            reserved: ex.reserved(),
            as_root: nix::unistd::geteuid().is_root(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            adapters: ex.runnable_adapters(),
        }
    }
}

/// What went wrong, as the reply carries it.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// No such attempt.
    NotFound,
    /// An illegal move, or a request that cannot be honoured.
    Refused,
    /// The executor cannot run work on this machine.
    Unavailable,
    /// The journal could not be written or read.
    Journal,
    /// The caller may not use this operation (or the socket).
    NotAllowed,
    /// The frame was not a request this supervisor understands.
    BadRequest,
    /// Too many connections at once.
    Busy,
}

/// A failed operation.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct WireError {
    /// What kind.
    pub kind: ErrorKind,
    /// Why, for people.
    pub message: String,
}

/// A reply: the operation's value, or why it failed.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Reply {
    Ok(serde_json::Value),
    Err(WireError),
}

impl WireError {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl From<ExecError> for WireError {
    fn from(e: ExecError) -> Self {
        let kind = match &e {
            ExecError::NotFound(_) => ErrorKind::NotFound,
            ExecError::WrongState(_) | ExecError::Refused(_) => ErrorKind::Refused,
            ExecError::Unavailable(_) => ErrorKind::Unavailable,
            ExecError::Journal(_) => ErrorKind::Journal,
        };
        let message = match e {
            ExecError::NotFound(id) => id,
            other => other.to_string(),
        };
        Self { kind, message }
    }
}

impl From<WireError> for ExecError {
    fn from(e: WireError) -> Self {
        match e.kind {
            ErrorKind::NotFound => Self::NotFound(e.message),
            ErrorKind::Unavailable => Self::Unavailable(format!("the supervisor: {}", e.message)),
            ErrorKind::Journal => Self::Journal(e.message),
            ErrorKind::Refused
            | ErrorKind::NotAllowed
            | ErrorKind::BadRequest
            | ErrorKind::Busy => Self::Refused(format!("the supervisor: {}", e.message)),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Frames

/// Writes one frame, handing `fds` over with its first byte.
fn write_frame(stream: &UnixStream, body: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a frame of {} bytes is over {MAX_FRAME}", body.len()),
        ));
    }
    let len = u32::try_from(body.len()).map_err(io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(body);
    let mut sent = 0;
    if !fds.is_empty() {
        let iov = [IoSlice::new(&frame)];
        let cmsg = [ControlMessage::ScmRights(fds)];
        sent = sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
            .map_err(io::Error::from)?;
    }
    let mut w = stream;
    w.write_all(&frame[sent..])?;
    w.flush()
}

/// Reads one frame and the file descriptors that came with it (at most [`MAX_FDS`]; more
/// is an error, and every one received is closed).
fn read_frame(stream: &UnixStream) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut head = [0u8; 4];
    let mut fds = Vec::new();
    let got = {
        let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
        let mut iov = [IoSliceMut::new(&mut head)];
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(received) = c {
                for fd in received {
                    // SAFETY: the kernel just installed `fd` in this process for this
                    // message; nothing else owns it.
                    #[allow(unsafe_code)]
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more than {MAX_FDS} file descriptors in one frame"),
            ));
        }
        msg.bytes
    };
    if got == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let mut r = stream;
    r.read_exact(&mut head[got..])?;
    let len = u32::from_be_bytes(head) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes is over {MAX_FRAME}"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok((body, fds))
}

// ---------------------------------------------------------------------------------------
// Server

/// Who may do what on the socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Caller {
    /// Root: every operation, `Clear` included.
    Administrator,
    /// The configured node user: everything the node needs.
    Node,
}

/// Settings of `cannabis supervisor run`.
#[derive(Clone, Debug)]
pub struct SupervisorConfig {
    /// The socket to listen on.
    pub socket: PathBuf,
    /// The supervisor's own directory.
    pub dir: PathBuf,
    /// The node's user id: the one unprivileged caller allowed.
    pub node_uid: u32,
    /// The node's group id: the socket's group.
    pub node_gid: u32,
}

/// A running supervisor: the executor it owns and who may call it.
pub struct Supervisor {
    cfg: SupervisorConfig,
    executor: Executor,
    clients: Arc<AtomicUsize>,
    /// Held while a spool directory is filled or the spool swept.
    spool_lock: Mutex<()>,
}

impl Supervisor {
    /// A supervisor for `executor`. It checks that the node's uid is not one the
    /// sandboxes use.
    pub fn new(cfg: SupervisorConfig, executor: Executor) -> anyhow::Result<Self> {
        let (_, ceilings) = executor.limits();
        if cfg.node_uid == 0 {
            anyhow::bail!("the node user must not be root: that is what the supervisor is for");
        }
        if cfg.node_uid >= ceilings.sandbox_uid {
            anyhow::bail!(
                "the node user's uid {} is in the sandboxes' range (from {}): workloads could run as the node",
                cfg.node_uid,
                ceilings.sandbox_uid
            );
        }
        fs::create_dir_all(cfg.dir.join("spool"))?;
        fs::set_permissions(cfg.dir.join("spool"), fs::Permissions::from_mode(0o700))?;
        Ok(Self {
            cfg,
            executor,
            clients: Arc::new(AtomicUsize::new(0)),
            spool_lock: Mutex::new(()),
        })
    }

    /// Binds the socket: its directory made if missing, a stale socket file replaced
    /// (never a live one, nor anything that is not a socket), the file owned by root and
    /// the node's group, mode 0660.
    pub fn bind(&self) -> anyhow::Result<UnixListener> {
        let path = &self.cfg.socket;
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        match fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                if UnixStream::connect(path).is_ok() {
                    anyhow::bail!("another supervisor is listening on {}", path.display());
                }
                fs::remove_file(path)?;
            }
            Ok(_) => anyhow::bail!("{} exists and is not a socket", path.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        let listener = UnixListener::bind(path)?;
        std::os::unix::fs::chown(path, Some(0), Some(self.cfg.node_gid)).or_else(|e| {
            // Not root (a test, or a single-user setup): the peer check still holds.
            if nix::unistd::geteuid().is_root() {
                Err(e)
            } else {
                Ok(())
            }
        })?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o660))?;
        Ok(listener)
    }

    /// Serves connections until the listener fails; each gets a thread of its own.
    pub fn serve(self: &Arc<Self>, listener: &UnixListener) -> anyhow::Result<()> {
        self.sweep_spool();
        let sweeper = Arc::clone(self);
        std::thread::Builder::new()
            .name("spool-sweep".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_secs(30));
                    sweeper.sweep_spool();
                }
            })?;
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "accepting a connection");
                    continue;
                }
            };
            let me = Arc::clone(self);
            if me.clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                me.clients.fetch_sub(1, Ordering::SeqCst);
                let e = WireError::new(ErrorKind::Busy, "too many connections at once");
                let _ = reply(&stream, Err(e));
                continue;
            }
            let spawned = std::thread::Builder::new()
                .name("supervisor-client".into())
                .spawn(move || {
                    me.serve_one(&stream);
                    me.clients.fetch_sub(1, Ordering::SeqCst);
                });
            if let Err(e) = spawned {
                self.clients.fetch_sub(1, Ordering::SeqCst);
                warn!(error = %e, "cannot start a connection thread");
            }
        }
        Ok(())
    }

    /// Who is calling: root, the node user, or nobody allowed.
    fn caller(&self, stream: &UnixStream) -> Result<Caller, WireError> {
        let cred = getsockopt(stream, sockopt::PeerCredentials).map_err(|e| {
            WireError::new(ErrorKind::NotAllowed, format!("no peer credentials: {e}"))
        })?;
        match cred.uid() {
            0 => Ok(Caller::Administrator),
            uid if uid == self.cfg.node_uid => Ok(Caller::Node),
            uid => Err(WireError::new(
                ErrorKind::NotAllowed,
                format!("uid {uid} may not use this supervisor (only the node's user and root)"),
            )),
        }
    }

    fn serve_one(&self, stream: &UnixStream) {
        let caller = match self.caller(stream) {
            Ok(c) => c,
            Err(e) => {
                warn!(reason = %e, "refused a connection");
                let _ = reply(stream, Err(e));
                return;
            }
        };
        let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
        loop {
            let (body, fds) = match read_frame(stream) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return,
                Err(e) => {
                    let _ = reply(
                        stream,
                        Err(WireError::new(ErrorKind::BadRequest, e.to_string())),
                    );
                    return;
                }
            };
            let answer = match serde_json::from_slice::<Request>(&body) {
                Ok(Request::Output {
                    id,
                    name,
                    offset,
                    max,
                }) => {
                    // The bytes follow the reply in a frame of their own, as they are.
                    match self
                        .executor
                        .read_output(&id, &name, offset, max.min(MAX_CHUNK))
                    {
                        Ok(mut chunk) => {
                            let data = std::mem::take(&mut chunk.data);
                            let sent = to_value(chunk)
                                .map_err(|e| WireError::new(ErrorKind::Unavailable, e.to_string()))
                                .map(|v| reply(stream, Ok(v)));
                            match sent {
                                Ok(Ok(())) => write_frame(stream, &data, &[]),
                                Ok(Err(e)) => Err(e),
                                Err(e) => reply(stream, Err(e)),
                            }
                        }
                        Err(e) => reply(stream, Err(e.into())),
                    }
                }
                Ok(Request::Interface { id, rank, mtu }) if fds.is_empty() => {
                    // The device goes with the reply, as a descriptor.
                    match crate::exec::group_interface(&self.executor, &id, rank, mtu) {
                        Ok(device) => {
                            info!(attempt = %id, rank, "group interface made in the sandbox");
                            reply_with(stream, Ok(serde_json::Value::Null), &[device.as_raw_fd()])
                        }
                        Err(e) => reply(stream, Err(e.into())),
                    }
                }
                Ok(request) => reply(stream, self.handle(caller, request, fds)),
                Err(e) => reply(
                    stream,
                    Err(WireError::new(
                        ErrorKind::BadRequest,
                        format!("not a request this supervisor knows: {e}"),
                    )),
                ),
            };
            if answer.is_err() {
                return;
            }
        }
    }

    /// Carries out one request.
    fn handle(
        &self,
        caller: Caller,
        request: Request,
        fds: Vec<OwnedFd>,
    ) -> Result<serde_json::Value, WireError> {
        let ex = &self.executor;
        if !fds.is_empty() && !matches!(request, Request::Submit { .. }) {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                "file descriptors come only with an admission",
            ));
        }
        let value = match request {
            Request::Status => to_value(ExecutorStatus::of(ex)),
            Request::Submit { request } => to_value(self.submit(*request, fds)?),
            Request::Get { id } => to_value(ex.get(&id)?),
            Request::Attempts => to_value(ex.attempts()),
            Request::Orphans => to_value(ex.orphans()),
            Request::Stop { id, why } => to_value(ex.stop(&id, &why)?),
            Request::Renew { id, until_ms } => to_value(ex.renew(&id, until_ms)?),
            Request::Release { id } => to_value(ex.release(&id)?),
            Request::Retry { id, request_id } => to_value(ex.retry(&id, request_id)?),
            Request::Clear { id } => {
                if caller != Caller::Administrator {
                    return Err(WireError::new(
                        ErrorKind::NotAllowed,
                        "clearing is the administrator's: run `cannabis supervisor clear` as root",
                    ));
                }
                to_value(ex.clear(&id)?)
            }
            Request::SetControl { control } => {
                ex.set_control(control)?;
                info!(control = control.name(), ?caller, "the owner's switch set");
                to_value(())
            }
            Request::SetLimits { limits } => {
                let set = ex.set_owner_limits(&limits)?;
                info!(?caller, limits = ?set, "the owner's limits set");
                to_value(set)
            }
            Request::Output { .. } | Request::Interface { .. } => {
                return Err(WireError::new(
                    ErrorKind::BadRequest,
                    "output reads and interfaces are served apart, with no descriptors",
                ));
            }
        };
        value.map_err(|e| WireError::new(ErrorKind::Unavailable, e.to_string()))
    }

    /// Admits a request whose files came as descriptors: each is copied into a spool
    /// directory of this admission (bounded by the owner's storage limit), and the
    /// request names those copies.
    fn submit(&self, mut request: AttemptRequest, fds: Vec<OwnedFd>) -> Result<Attempt, WireError> {
        let wanted = usize::from(request.bundle.is_some())
            + request.inputs.len()
            + usize::from(request.resume.is_some());
        if fds.len() != wanted {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                format!(
                    "the admission names {wanted} files and came with {} descriptors",
                    fds.len()
                ),
            ));
        }
        if wanted == 0 {
            return Ok(self.executor.submit(request)?);
        }
        let (limits, _) = self.executor.limits();
        let _guard = self.spool_lock.lock().unwrap_or_else(|p| p.into_inner());
        let spool = self.cfg.dir.join("spool").join(spool_name());
        fs::create_dir(&spool).map_err(|e| unavailable(&spool, &e))?;
        let copied = (|| {
            let mut fds = fds.into_iter();
            let mut budget = limits.storage_bytes;
            if request.bundle.is_some()
                && let Some(fd) = fds.next()
            {
                let to = spool.join("bundle");
                budget -= spool_copy(fd, &to, budget)?;
                request.bundle = Some(to);
            }
            for (k, (_, path)) in request.inputs.iter_mut().enumerate() {
                let Some(fd) = fds.next() else { break };
                let to = spool.join(format!("input-{k}"));
                budget -= spool_copy(fd, &to, budget)?;
                *path = to;
            }
            if request.resume.is_some()
                && let Some(fd) = fds.next()
            {
                let to = spool.join("resume");
                spool_copy(fd, &to, budget)?;
                request.resume = Some(to);
            }
            Ok::<(), WireError>(())
        })();
        let result = copied.and_then(|()| Ok(self.executor.submit(request)?));
        let referenced = result.as_ref().is_ok_and(|a| {
            a.request
                .bundle
                .as_ref()
                .is_some_and(|b| b.starts_with(&spool))
                || a.request.inputs.iter().any(|(_, p)| p.starts_with(&spool))
                || a.request
                    .resume
                    .as_ref()
                    .is_some_and(|r| r.starts_with(&spool))
        });
        if !referenced {
            // Refused, or the same request id admitted before (with its own spool).
            let _ = fs::remove_dir_all(&spool);
        }
        result
    }

    /// Removes spool directories no attempt still needs: an attempt that is released
    /// (its work done and its capacity given back) needs none, and neither does its
    /// retry, which the owner decides only for one that failed (its files are gone then,
    /// and the retry says so).
    fn sweep_spool(&self) {
        let _guard = self.spool_lock.lock().unwrap_or_else(|p| p.into_inner());
        let keep: Vec<PathBuf> = self
            .executor
            .attempts()
            .into_iter()
            .filter(|a| a.cleanup == Cleanup::Pending)
            .flat_map(|a| {
                a.request
                    .bundle
                    .into_iter()
                    .chain(a.request.inputs.into_iter().map(|(_, p)| p))
                    .chain(a.request.resume)
                    .collect::<Vec<_>>()
            })
            .collect();
        let Ok(entries) = fs::read_dir(self.cfg.dir.join("spool")) else {
            return;
        };
        for e in entries.flatten() {
            let dir = e.path();
            if !keep.iter().any(|p| p.starts_with(&dir)) {
                let _ = fs::remove_dir_all(&dir);
            }
        }
    }
}

fn to_value<T: Serialize>(v: T) -> serde_json::Result<serde_json::Value> {
    serde_json::to_value(v)
}

fn unavailable(path: &Path, e: &io::Error) -> WireError {
    WireError::new(ErrorKind::Unavailable, format!("{}: {e}", path.display()))
}

/// A fresh spool directory name.
fn spool_name() -> String {
    let mut bytes = [0u8; 8];
    let _ = getrandom::getrandom(&mut bytes);
    hex::encode(bytes)
}

/// Copies what `fd` reads into `to` (a new file), at most `budget` bytes; returns the size.
fn spool_copy(fd: OwnedFd, to: &Path, budget: u64) -> Result<u64, WireError> {
    let from = fs::File::from(fd);
    let meta = from.metadata().map_err(|e| unavailable(to, &e))?;
    if !meta.is_file() {
        return Err(WireError::new(
            ErrorKind::BadRequest,
            "a file handed over is not a regular file",
        ));
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(|e| unavailable(to, &e))?;
    let n = io::copy(&mut (&from).take(budget.saturating_add(1)), &mut file)
        .map_err(|e| unavailable(to, &e))?;
    if n > budget {
        return Err(WireError::new(
            ErrorKind::Refused,
            format!(
                "the files handed over are larger than the owner's storage limit of {budget} bytes left"
            ),
        ));
    }
    file.sync_all().map_err(|e| unavailable(to, &e))?;
    Ok(n)
}

/// Sends a request and reads its reply (with the descriptors that came with it), and the
/// raw bytes after a successful output read when `bytes` is given.
fn round_trip(
    stream: &UnixStream,
    body: &[u8],
    fds: &[RawFd],
    bytes: Option<&mut Vec<u8>>,
) -> io::Result<(Reply, Vec<OwnedFd>)> {
    if let Err(sent) = write_frame(stream, body, fds) {
        // A supervisor that refuses the caller answers at once and closes: a request
        // written after that fails, and the answer waiting in the socket says why.
        if !matches!(
            sent.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        ) {
            return Err(sent);
        }
        let (reply, _) = read_frame(stream).map_err(|_| sent)?;
        let reply = serde_json::from_slice(&reply)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        return Ok((reply, Vec::new()));
    }
    let (reply, handed) = read_frame(stream)?;
    let reply: Reply = serde_json::from_slice(&reply)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if let (Reply::Ok(_), Some(bytes)) = (&reply, bytes) {
        *bytes = read_frame(stream)?.0;
    }
    Ok((reply, handed))
}

fn reply(stream: &UnixStream, answer: Result<serde_json::Value, WireError>) -> io::Result<()> {
    reply_with(stream, answer, &[])
}

/// A reply that hands `fds` over with it.
fn reply_with(
    stream: &UnixStream,
    answer: Result<serde_json::Value, WireError>,
    fds: &[RawFd],
) -> io::Result<()> {
    let reply = match answer {
        Ok(v) => Reply::Ok(v),
        Err(e) => Reply::Err(e),
    };
    let body = serde_json::to_vec(&reply).map_err(io::Error::other)?;
    write_frame(stream, &body, fds)
}

// ---------------------------------------------------------------------------------------
// Client

/// The node's (or an owner command's) side of the socket: one connection, made again
/// once when it breaks (a supervisor restart).
pub struct SupervisorClient {
    socket: PathBuf,
    conn: Mutex<Option<UnixStream>>,
}

impl SupervisorClient {
    /// A client of the supervisor at `socket`; connects on first use.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            conn: Mutex::new(None),
        }
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The uid the supervisor runs as, from the kernel (`SO_PEERCRED`).
    pub fn supervisor_uid(&self) -> Result<u32, ExecError> {
        let stream = self.connect()?;
        let cred = getsockopt(&stream, sockopt::PeerCredentials)
            .map_err(|e| ExecError::Unavailable(format!("no peer credentials: {e}")))?;
        Ok(cred.uid())
    }

    fn connect(&self) -> Result<UnixStream, ExecError> {
        UnixStream::connect(&self.socket).map_err(|e| {
            ExecError::Unavailable(format!("the supervisor at {}: {e}", self.socket.display()))
        })
    }

    /// Sends one request (with `fds` for an admission) and decodes its reply.
    pub fn call<T: serde::de::DeserializeOwned>(
        &self,
        request: &Request,
        fds: &[RawFd],
    ) -> Result<T, ExecError> {
        if matches!(request, Request::Output { .. }) {
            return Err(ExecError::Refused(
                "output reads go through SupervisorClient::read_output".into(),
            ));
        }
        self.exchange(request, fds, None).map(|(v, _)| v)
    }

    /// Makes attempt `id`'s group interface, rank `rank`'s, in its sandbox
    /// ([`Request::Interface`]): the device's descriptor.
    pub fn interface(&self, id: &str, rank: u32, mtu: u32) -> Result<OwnedFd, ExecError> {
        let request = Request::Interface {
            id: id.into(),
            rank,
            mtu,
        };
        let ((), mut handed) = self.exchange(&request, &[], None)?;
        if handed.len() != 1 {
            return Err(ExecError::Unavailable(format!(
                "the supervisor made the interface but handed over {} descriptors",
                handed.len()
            )));
        }
        Ok(handed.remove(0))
    }

    /// One request and its reply, and the descriptors that came with it; `bytes` takes
    /// the frame of raw bytes that follows a successful output read.
    fn exchange<T: serde::de::DeserializeOwned>(
        &self,
        request: &Request,
        fds: &[RawFd],
        mut bytes: Option<&mut Vec<u8>>,
    ) -> Result<(T, Vec<OwnedFd>), ExecError> {
        let body = serde_json::to_vec(request).map_err(|e| ExecError::Refused(e.to_string()))?;
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        // A connection that broke since its last use (a supervisor restart) gets the
        // request once more on a fresh one. Every operation may be repeated: an admission
        // by its request id, the rest by what they set.
        for again in [false, true] {
            let reused = conn.is_some();
            let stream = match conn.take() {
                Some(s) => s,
                None => self.connect()?,
            };
            match round_trip(&stream, &body, fds, bytes.as_deref_mut()) {
                Ok((reply, handed)) => {
                    *conn = Some(stream);
                    return match reply {
                        Reply::Ok(v) => {
                            serde_json::from_value(v).map(|v| (v, handed)).map_err(|e| {
                                ExecError::Unavailable(format!("the supervisor's answer: {e}"))
                            })
                        }
                        Reply::Err(e) => Err(e.into()),
                    };
                }
                Err(_) if reused && !again => {}
                Err(e) => {
                    return Err(ExecError::Unavailable(format!(
                        "the supervisor at {}: {e}",
                        self.socket.display()
                    )));
                }
            }
        }
        Err(ExecError::Unavailable(
            "the supervisor: no connection".into(),
        ))
    }

    /// Reads an output from `offset`, at most `max` bytes.
    pub fn read_output(
        &self,
        id: &str,
        name: &str,
        offset: u64,
        max: u64,
    ) -> Result<Chunk, ExecError> {
        let request = Request::Output {
            id: id.into(),
            name: name.into(),
            offset,
            max,
        };
        let mut data = Vec::new();
        let (mut chunk, _): (Chunk, _) = self.exchange(&request, &[], Some(&mut data))?;
        chunk.data = data;
        Ok(chunk)
    }

    /// The supervisor's state.
    pub fn status(&self) -> Result<ExecutorStatus, ExecError> {
        self.call(&Request::Status, &[])
    }

    /// Admits a request: its bundle and inputs are opened here, with this process's
    /// rights, and handed over as descriptors.
    pub fn submit(&self, request: AttemptRequest) -> Result<Attempt, ExecError> {
        let open = |p: &Path| {
            fs::File::open(p)
                .map_err(|e| ExecError::Refused(format!("opening {}: {e}", p.display())))
        };
        let mut files = Vec::new();
        if let Some(b) = &request.bundle {
            files.push(open(b)?);
        }
        for (_, p) in &request.inputs {
            files.push(open(p)?);
        }
        if let Some(r) = &request.resume {
            files.push(open(r)?);
        }
        if files.len() > MAX_FDS {
            return Err(ExecError::Refused(format!(
                "at most {} inputs can be handed to the supervisor",
                MAX_FDS - 1
            )));
        }
        let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        self.call(
            &Request::Submit {
                request: Box::new(request),
            },
            &fds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A supervisor that refuses a caller answers and closes before the request is
    /// written; the caller gets that answer, not the broken pipe.
    #[test]
    fn a_refusal_sent_before_the_request_is_read_reaches_the_caller() {
        let (client, server) = UnixStream::pair().unwrap();
        let refused = WireError::new(ErrorKind::NotAllowed, "uid 7 may not use this supervisor");
        reply(&server, Err(refused)).unwrap();
        drop(server);
        let (answer, _) = round_trip(&client, br#"{"op":"status"}"#, &[], None).unwrap();
        match answer {
            Reply::Err(e) => assert!(e.message.contains("may not use"), "{e:?}"),
            Reply::Ok(v) => panic!("refused, yet {v}"),
        }
    }
}
