//! Stage 1 (the monitor) and stage 2 (pid 1 of the sandbox). Both are forked from the
//! zygote, one thread each for their whole lives: `unshare(CLONE_NEWUSER)` refuses a process
//! with threads, and so does our `fork`.

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd as _, BorrowedFd, IntoRawFd as _, OwnedFd};
use std::os::unix::fs::symlink;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use nix::sys::statvfs::{FsFlags, statvfs};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{Pid, pivot_root, sethostname};
use sha2::Digest as _;

use super::zygote::{Forked, fork_single_threaded, receive, send_with_fds};
use super::{
    ExitRecord, LogCount, OutputFile, SandboxSpec, ZYGOTE_ARG, files, filter, now_ms, paths,
};

/// Runs the sandbox zygote if this process was started as one and returns its exit code;
/// `None` for every other command line. Call it first thing in `main`, before any thread
/// starts: the zygote forks, and must have one thread to do so.
pub fn stage_main() -> Option<i32> {
    let arg = std::env::args_os().nth(1)?;
    if arg == ZYGOTE_ARG {
        Some(super::zygote::zygote_main())
    } else {
        None
    }
}

type R<T> = Result<T, String>;

trait Ctx<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> R<T>;
}

impl<T, E: std::fmt::Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: impl FnOnce() -> String) -> R<T> {
        self.map_err(|e| format!("{}: {e}", what()))
    }
}

// ---------------------------------------------------------------- stage 1

/// The monitor, forked by the zygote; `host` is its control socket to the host; `own_net`
/// says it is already in an empty network namespace of its own. It reads the spec, moves
/// itself into the attempt's cgroups while it still has the zygote's privileges, then
/// calls `become_sandbox_user` and sets the sandbox up. Returns the process's exit code.
pub(super) fn monitor_main(
    host: UnixStream,
    own_net: bool,
    become_sandbox_user: impl FnOnce() -> R<()>,
) -> i32 {
    let mut host_out = match host.try_clone() {
        Ok(h) => h,
        Err(e) => {
            eprintln!("sandbox: control socket: {e}");
            return 2;
        }
    };
    let mut host_in = BufReader::new(host);
    let mut line = String::new();
    if host_in.read_line(&mut line).is_err() || line.is_empty() {
        eprintln!("sandbox: no spec from the host");
        return 2;
    }
    let spec: SandboxSpec = match serde_json::from_str(&line) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("sandbox: bad spec: {e}");
            return 2;
        }
    };
    // Nothing starts before this process is in the attempt's cgroups (the host makes them
    // while this process starts, then sends their entry files). Moving itself is the cheap
    // move (see `JobCgroup::entry_files`); done before the namespaces, it is not kept
    // waiting behind them.
    line.clear();
    let _ = host_in.read_line(&mut line);
    let entered = line.trim_end().strip_prefix("enter ").map(|files| {
        serde_json::from_str::<Vec<PathBuf>>(files)
            .ctx(|| "bad cgroup list".into())
            .and_then(|files| super::cgroup::enter_self(&files).map_err(|e| e.to_string()))
    });
    if let Err(e) = become_sandbox_user() {
        eprintln!("sandbox: {e}");
        let _ = writeln!(host_out, "error {e}");
        return 2;
    }
    let outcome = match entered {
        None => Ok(ExitRecord {
            ended_by: Some("aborted before start".into()),
            ..ExitRecord::default()
        }),
        Some(Err(e)) => Err(format!("moving into the attempt's cgroups: {e}")),
        Some(Ok(())) => monitor(&spec, own_net, &mut host_in, &mut host_out),
    };
    let record = match outcome {
        Ok(record) => record,
        Err(e) => {
            eprintln!("sandbox: {e}");
            let _ = writeln!(host_out, "error {e}");
            ExitRecord {
                ended_by: Some(format!("sandbox set-up failed: {e}")),
                ..ExitRecord::default()
            }
        }
    };
    let code = match write_exit(&spec.attempt_dir, &record) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("sandbox: writing {}: {e}", files::EXIT);
            1
        }
    };
    // The host reads the end of the control socket as the end of this process: leave it
    // to the kernel to close, at exit, so that the host does not wake (and take this CPU)
    // while the exit is still under way.
    let _ = (host_in.into_inner().into_raw_fd(), host_out.into_raw_fd());
    code
}

fn monitor(
    spec: &SandboxSpec,
    own_net: bool,
    host_in: &mut BufReader<UnixStream>,
    host_out: &mut UnixStream,
) -> R<ExitRecord> {
    let dir = &spec.attempt_dir;
    let stdout_file = File::create(dir.join(files::STDOUT)).ctx(|| "creating stdout".into())?;
    let stderr_file = File::create(dir.join(files::STDERR)).ctx(|| "creating stderr".into())?;
    let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());

    // The monitor keeps the host's view of the filesystem: the mount namespace is pid 1's
    // alone, so that nothing is mounted twice and nothing is left to unmount here. The
    // network namespace, the costliest to make, was made ahead of need by the zygote's
    // child where it could (as root); else it is made here, owned by the new user namespace.
    let mut namespaces = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS;
    if !own_net {
        namespaces |= CloneFlags::CLONE_NEWNET;
    }
    unshare(namespaces).ctx(|| "unshare (user, pid, ipc, uts, net)".into())?;
    fs::write("/proc/self/setgroups", "deny").ctx(|| "writing setgroups".into())?;
    fs::write("/proc/self/uid_map", format!("0 {uid} 1")).ctx(|| "writing uid_map".into())?;
    fs::write("/proc/self/gid_map", format!("0 {gid} 1")).ctx(|| "writing gid_map".into())?;
    sethostname("cannabis").ctx(|| "sethostname".into())?;

    // Stage 2 becomes pid 1 of the new pid namespace: the first child forked after
    // `unshare(CLONE_NEWPID)`. A sequenced-packet socket pair carries control ("ready"
    // with the work directory attached, "go", "exit"); the command's output goes through
    // pipes we cap.
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .ctx(|| "socketpair".into())?;
    let cloexec = nix::fcntl::OFlag::O_CLOEXEC;
    let (out_read, out_write) = nix::unistd::pipe2(cloexec).ctx(|| "pipe".into())?;
    let (err_read, err_write) = nix::unistd::pipe2(cloexec).ctx(|| "pipe".into())?;
    let init = match fork_single_threaded()? {
        Forked::Child => {
            // Pid 1 keeps none of the monitor's descriptors. They are all close-on-exec
            // (the command never sees them); closing them here keeps pid 1 from holding
            // the host's socket and the log files for its whole life. This process ends in
            // `exit`, so the monitor's own handles to them are never dropped a second time.
            drop((ours, out_read, err_read, stdout_file, stderr_file));
            let _ = nix::unistd::close(host_out.as_raw_fd());
            let _ = nix::unistd::close(host_in.get_ref().as_raw_fd());
            std::process::exit(init_main(spec, theirs, out_write, err_write));
        }
        Forked::Parent(pid) => pid,
    };
    drop((theirs, out_write, err_write));
    let kill_init = |init: Pid| {
        let _ = kill(init, Signal::SIGKILL);
        let _ = wait_for(init);
    };
    let mut buf = vec![0u8; 4096];
    let (n, mut fds) = receive(ours.as_fd(), &mut buf).unwrap_or((0, Vec::new()));
    let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
    let (Some(ready), Some(work)) = (reply.strip_prefix("ready "), fds.pop()) else {
        kill_init(init);
        let why = reply.strip_prefix("error ").unwrap_or("pid 1 exited");
        return Err(format!("sandbox init: {why}"));
    };
    // The host inspects the running pid 1 before it lets the command start.
    writeln!(host_out, "ready {init} {ready}").ctx(|| "reporting ready".into())?;
    host_out.flush().ctx(|| "reporting ready".into())?;
    let mut go = String::new();
    let _ = host_in.read_line(&mut go);
    if go.trim_end() != "go" {
        kill_init(init);
        return Ok(ExitRecord {
            ended_by: Some("aborted before start".into()),
            ..ExitRecord::default()
        });
    }
    // After unshare(CLONE_NEWPID) this process cannot start threads: one poll loop copies
    // both logs, hears pid 1's report and enforces the lease. Everything that can fail is
    // set up before the command starts.
    let logs = Log::new(out_read, stdout_file, spec.log_cap)
        .and_then(|o| Ok([o, Log::new(err_read, stderr_file, spec.log_cap)?]));
    let mut logs = match logs {
        Ok(l) => l,
        Err(e) => {
            kill_init(init);
            return Err(e);
        }
    };
    let started_at_ms = now_ms();
    if let Err(e) = send_with_fds(ours.as_fd(), b"go", &[]) {
        kill_init(init);
        return Err(format!("starting the command: {e}"));
    }
    let _ = writeln!(host_out, "started");
    let mut ended_by = None;
    let mut next_lease_check = Instant::now();
    let mut report: Option<String> = None;
    let mut status = None;
    let mut drain_until: Option<Instant> = None;
    let mut log_buf = vec![0u8; 64 * 1024];
    let mut checkpoints = spec
        .checkpoint
        .as_ref()
        .and_then(|c| Checkpoints::new(dir, c));
    loop {
        let now = Instant::now();
        let wake = drain_until.unwrap_or(next_lease_check);
        let listen = report.is_none().then(|| ours.as_fd());
        let reported = poll_io(
            &mut logs,
            listen,
            wake.saturating_duration_since(now),
            &mut log_buf,
        );
        if reported {
            // Pid 1 sends its report and ends; or the socket closed because it ended.
            let n = receive(ours.as_fd(), &mut buf).map_or(0, |(n, _)| n);
            report = Some(String::from_utf8_lossy(&buf[..n]).into_owned());
            // Pid 1 is ending; its namespaces are torn down while this process copies the
            // outputs and ends too (the zygote, a subreaper, reaps it). Its status is only
            // needed when it ended without a report.
            if !report.as_deref().is_some_and(|r| r.starts_with("exit ")) {
                status = wait_for(init);
            }
            // Everything in the namespace dies with pid 1, so the pipes close; read what
            // is left, for a bounded time.
            drain_until = Some(Instant::now() + Duration::from_secs(2));
        }
        if let Some(until) = drain_until {
            if logs.iter().all(|l| !l.open) || Instant::now() >= until {
                break;
            }
            continue;
        }
        if Instant::now() >= next_lease_check {
            next_lease_check = Instant::now() + Duration::from_millis(200);
            if lease_expired(dir) && ended_by.is_none() {
                ended_by = Some("lease expired".into());
                let _ = kill(init, Signal::SIGKILL);
            }
            if let Some(c) = checkpoints.as_mut() {
                c.poll(&work);
            }
        }
    }
    let [stdout, stderr] = logs.map(Log::finish);
    let ended_at_ms = now_ms();
    // Pid 1 reports how the command ended; its own status says whether it was killed.
    let report = report.unwrap_or_default();
    let (mut code, mut signal) = (None, None);
    if let Some(rest) = report.trim_end().strip_prefix("exit ") {
        let mut it = rest.split_whitespace();
        match (it.next(), it.next().and_then(|v| v.parse::<i32>().ok())) {
            (Some("code"), v) => code = v,
            (Some("signal"), v) => signal = v,
            _ => {}
        }
    } else if let Some(status) = status {
        if let WaitStatus::Signaled(_, sig, _) = status {
            signal = Some(sig as i32);
        }
        if signal.is_none() && ended_by.is_none() {
            ended_by = Some(match report.trim_end().strip_prefix("error ") {
                Some(e) => format!("the command could not start: {e}"),
                None => "pid 1 ended without a report".into(),
            });
        }
    }
    let (outputs, refused_outputs) = copy_outputs(spec, &work);
    Ok(ExitRecord {
        started: true,
        code,
        signal,
        ended_by,
        stdout,
        stderr,
        outputs,
        refused_outputs,
        started_at_ms,
        ended_at_ms,
    })
}

fn lease_expired(dir: &Path) -> bool {
    match fs::read_to_string(dir.join(files::LEASE)) {
        Ok(text) => text
            .trim()
            .parse::<u64>()
            .is_ok_and(|until| now_ms() > until),
        // No readable lease: the host is gone or broken; stop.
        Err(_) => true,
    }
}

/// One of the command's output pipes, copied into a file up to a cap; the rest is read
/// and counted, so the command never blocks on a full pipe.
struct Log {
    pipe: std::os::fd::OwnedFd,
    file: File,
    cap: u64,
    count: LogCount,
    open: bool,
}

impl Log {
    fn new(pipe: impl Into<std::os::fd::OwnedFd>, file: File, cap: u64) -> R<Self> {
        let pipe = pipe.into();
        let flags =
            nix::fcntl::fcntl(&pipe, nix::fcntl::FcntlArg::F_GETFL).ctx(|| "fcntl".into())?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&pipe, nix::fcntl::FcntlArg::F_SETFL(flags)).ctx(|| "fcntl".into())?;
        Ok(Self {
            pipe,
            file,
            cap,
            count: LogCount::default(),
            open: true,
        })
    }

    /// Reads what is there now, a bounded amount at a time, so that a command that keeps
    /// the pipe full cannot keep the monitor from its other duties (the lease).
    fn drain(&mut self, buf: &mut [u8]) {
        for _ in 0..16 {
            if !self.open {
                return;
            }
            match nix::unistd::read(&self.pipe, buf) {
                Ok(0) => self.open = false,
                Ok(n) => {
                    let room = usize::try_from(self.cap.saturating_sub(self.count.kept))
                        .unwrap_or(usize::MAX);
                    let keep = n.min(room);
                    if keep > 0 && self.file.write_all(&buf[..keep]).is_ok() {
                        self.count.kept += keep as u64;
                    }
                    self.count.dropped += (n - keep) as u64;
                }
                Err(nix::errno::Errno::EAGAIN) => return,
                Err(nix::errno::Errno::EINTR) => {}
                Err(_) => self.open = false,
            }
        }
    }

    fn finish(self) -> LogCount {
        self.count
    }
}

/// Waits up to `timeout` for output on the open logs or for a message on `control`, and
/// copies the output that came through `buf`. Returns whether `control` has something to
/// read (or closed).
fn poll_io(
    logs: &mut [Log; 2],
    control: Option<BorrowedFd<'_>>,
    timeout: Duration,
    buf: &mut [u8],
) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let millis = u16::try_from(timeout.as_millis().max(1)).unwrap_or(u16::MAX);
    let (ready, control_ready) = {
        let mut fds: Vec<PollFd<'_>> = logs
            .iter()
            .filter(|l| l.open)
            .map(|l| PollFd::new(l.pipe.as_fd(), PollFlags::POLLIN))
            .collect();
        let logs_open = fds.len();
        if let Some(c) = control {
            fds.push(PollFd::new(c, PollFlags::POLLIN));
        }
        if fds.is_empty() {
            std::thread::sleep(Duration::from_millis(u64::from(millis)));
            return false;
        }
        let _ = poll(&mut fds, PollTimeout::from(millis));
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        let control_ready = control.is_some() && ready.get(logs_open).copied().unwrap_or(false);
        (ready, control_ready)
    };
    let mut it = ready.into_iter();
    for log in logs.iter_mut().filter(|l| l.open) {
        if it.next().unwrap_or(false) {
            log.drain(buf);
        }
    }
    control_ready
}

/// Waits for `pid` (a child of this process) to end.
fn wait_for(pid: Pid) -> Option<WaitStatus> {
    loop {
        match waitpid(pid, None) {
            Err(nix::errno::Errno::EINTR) => {}
            Ok(WaitStatus::StillAlive) => {}
            other => return other.ok(),
        }
    }
}

/// How often the monitor looks at the checkpoint file, and the least time between two
/// copies of it (a program that rewrites it constantly is copied this often, not more).
const CHECKPOINT_LOOK: Duration = Duration::from_secs(1);
const CHECKPOINT_EVERY: Duration = Duration::from_secs(2);

/// Seals the task's checkpoint file each time it changes while the command runs: the
/// file, opened beneath the work directory (no symbolic link followed), is encrypted with
/// age to the requester's recipient into `checkpoints/<seq>.age` as it is read, so its
/// plaintext never leaves the sandbox's memory-backed work directory; then
/// `checkpoints/latest.json` (written aside and renamed) names it with the plaintext's
/// size and SHA-256, and the copy before is removed. A file that changes while it is read
/// is sealed again at the next look; one that is not a regular file of one link within
/// its cap is left alone. A program writes its checkpoint aside and renames it into place,
/// so that no copy sees half of one.
struct Checkpoints {
    dir: PathBuf,
    name: String,
    cap: u64,
    to: age::x25519::Recipient,
    /// Inode, size and modification time of the file last sealed.
    last: Option<(u64, u64, i64, i64)>,
    seq: u64,
    next_look: Instant,
}

impl Checkpoints {
    fn new(attempt_dir: &Path, c: &super::CheckpointSpec) -> Option<Self> {
        let to = c.to.as_deref()?.parse::<age::x25519::Recipient>().ok()?;
        Some(Self {
            dir: attempt_dir.join(files::CHECKPOINTS),
            name: c.name.clone(),
            cap: c.cap,
            to,
            last: None,
            seq: 0,
            next_look: Instant::now() + CHECKPOINT_LOOK,
        })
    }

    fn poll(&mut self, work: &OwnedFd) {
        let now = Instant::now();
        if now < self.next_look {
            return;
        }
        self.next_look = now + CHECKPOINT_LOOK;
        let Ok(st) = nix::sys::stat::fstatat(
            work,
            self.name.as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) else {
            return;
        };
        let seen = (st.st_ino, st.st_size as u64, st.st_mtime, st.st_mtime_nsec);
        if self.last == Some(seen) {
            return;
        }
        let _ = fs::create_dir_all(&self.dir);
        let tmp = self.dir.join(".sealing");
        let seq = self.seq + 1;
        match self.seal(work, &tmp) {
            Ok(Some((size, sha256))) => {
                let latest = super::CheckpointCopy { seq, size, sha256 };
                let named = fs::rename(&tmp, self.dir.join(format!("{seq}.age"))).and_then(|()| {
                    let text = serde_json::to_vec(&latest).map_err(io::Error::other)?;
                    fs::write(self.dir.join(".latest"), text)?;
                    fs::rename(self.dir.join(".latest"), self.dir.join("latest.json"))
                });
                if named.is_err() {
                    return;
                }
                if self.seq > 0 {
                    let _ = fs::remove_file(self.dir.join(format!("{}.age", self.seq)));
                }
                self.seq = seq;
                self.last = Some(seen);
                self.next_look = now + CHECKPOINT_EVERY;
            }
            // Not one to seal (yet), or it changed while it was read: the next look.
            Ok(None) | Err(_) => {
                let _ = fs::remove_file(&tmp);
            }
        }
    }

    /// Encrypts the checkpoint into `out` as it reads it; its size and SHA-256 (hex), or
    /// `None` when it is not a regular file of one link within the cap, or changed while
    /// it was read.
    fn seal(&self, work: &OwnedFd, out: &Path) -> io::Result<Option<(u64, String)>> {
        use nix::fcntl::OFlag;
        crate::exec::plain_name(&self.name).map_err(io::Error::other)?;
        let fd = nix::fcntl::openat(
            work,
            self.name.as_str(),
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        let file = File::from(fd);
        let before = file.metadata()?;
        if !before.file_type().is_file()
            || std::os::unix::fs::MetadataExt::nlink(&before) > 1
            || before.len() > self.cap
        {
            return Ok(None);
        }
        let encryptor =
            age::Encryptor::with_recipients(std::iter::once(&self.to as &dyn age::Recipient))
                .map_err(io::Error::other)?;
        let mut w = encryptor.wrap_output(io::BufWriter::new(File::create(out)?))?;
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        let mut reader = (&file).take(self.cap.saturating_add(1));
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = reader.read(&mut buf)?;
            if n == 0 {
                break;
            }
            size += n as u64;
            hasher.update(&buf[..n]);
            w.write_all(&buf[..n])?;
        }
        w.finish()?.flush()?;
        let after = file.metadata()?;
        if size != before.len()
            || after.len() != before.len()
            || after.modified()? != before.modified()?
        {
            return Ok(None);
        }
        Ok(Some((size, hex(&hasher.finalize()))))
    }
}

/// Copies each declared output out of the work directory: a regular file (no symlink, no
/// device, no fifo) no larger than its cap.
fn copy_outputs(spec: &SandboxSpec, work: &OwnedFd) -> (Vec<OutputFile>, Vec<(String, String)>) {
    let out_dir = spec.attempt_dir.join(files::OUTPUTS);
    let mut copied = Vec::new();
    let mut refused = Vec::new();
    // All outputs together get no more disk than the work directory had.
    let mut budget = spec.work_bytes;
    for (name, cap) in &spec.outputs {
        match copy_output(work, name, &out_dir.join(name), (*cap).min(budget)) {
            Ok(Some(file)) => {
                budget = budget.saturating_sub(file.size);
                copied.push(OutputFile {
                    name: name.clone(),
                    ..file
                });
            }
            Ok(None) => refused.push((name.clone(), "not written".into())),
            Err(why) => refused.push((name.clone(), why)),
        }
    }
    (copied, refused)
}

fn copy_output(work: &OwnedFd, name: &str, to: &Path, cap: u64) -> R<Option<OutputFile>> {
    use nix::fcntl::OFlag;
    // Admission refused such names already; `openat` must never walk out of `/work`.
    crate::exec::plain_name(name)?;
    let file = match nix::fcntl::openat(
        work,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    ) {
        Ok(fd) => File::from(fd),
        Err(nix::errno::Errno::ENOENT) => return Ok(None),
        Err(nix::errno::Errno::ELOOP) => return Err("is a symbolic link".into()),
        Err(e) => return Err(e.to_string()),
    };
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.file_type().is_file() {
        return Err("is not a regular file".into());
    }
    if std::os::unix::fs::MetadataExt::nlink(&meta) > 1 {
        return Err("has other hard links".into());
    }
    if meta.len() > cap {
        return Err(format!(
            "{} bytes, over its cap of {cap} (its own, or what is left of the work directory's size)",
            meta.len()
        ));
    }
    let mut out = File::create(to).map_err(|e| e.to_string())?;
    let mut hasher = sha2::Sha256::new();
    let mut size = 0u64;
    let mut reader = file.take(cap.saturating_add(1));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        size += n as u64;
        if size > cap {
            drop(out);
            let _ = fs::remove_file(to);
            return Err(format!("grew past its cap of {cap} bytes"));
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| e.to_string())?;
    }
    Ok(Some(OutputFile {
        name: String::new(),
        size,
        sha256: hex(&hasher.finalize()),
    }))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `exit.json` atomically (written aside, then renamed). Not synced to disk: a
/// record lost to a power failure leaves the attempt `unknown`, which is the truth.
fn write_exit(dir: &Path, record: &ExitRecord) -> io::Result<()> {
    let tmp = dir.join(format!("{}.tmp", files::EXIT));
    let mut f = File::create(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(record).map_err(io::Error::other)?)?;
    drop(f);
    fs::rename(&tmp, dir.join(files::EXIT))
}

/// System paths bound read-only into the sandbox (where they exist).
const SYSTEM: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/lib32",
    "/libx32",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ssl",
    "/etc/localtime",
];

const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom"];

/// The root a sandbox's pid 1 enters, at `<attempt>/root`, in its own mount namespace:
/// the template's copy when the zygote made one for this program, else built here.
fn build_root(spec: &SandboxSpec) -> R<()> {
    let root = spec.attempt_dir.join(files::ROOT);
    propagation(MsFlags::MS_PRIVATE)?;
    match TEMPLATE.get() {
        // One recursive bind instead of some twenty mounts. The copies are locked: made
        // in a more privileged namespace, their read-only flags cannot be lifted here.
        Some((template, program)) if *program == spec.program => {
            mount(
                Some(template.as_path()),
                &root,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .ctx(|| format!("binding the root template {}", template.display()))?;
        }
        _ => build_base(&root, &spec.program)?,
    }
    attach_attempt(spec, &root)
}

/// Sets how mounts propagate (`MS_PRIVATE`, `MS_SLAVE`) for the whole tree of this mount
/// namespace.
fn propagation(kind: MsFlags) -> R<()> {
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | kind,
        None::<&str>,
    )
    .ctx(|| format!("setting the propagation of / to {kind:?}"))
}

/// The template root (see [`build_base`]), made once by the zygote in its own mount
/// namespace, with the program it holds.
static TEMPLATE: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();

/// In the zygote (root, before it forks anything): a mount namespace of its own (a slave of
/// the host's, so that later host mounts still show), and in it, on `at`, the part of every
/// sandbox's root that is the same for all of them, read-only. Every monitor it forks
/// inherits this namespace; each pid 1 binds the template onto its root. On failure the
/// sandboxes build their roots themselves.
pub(super) fn make_template(at: &Path) -> R<()> {
    let program = std::env::current_exe().ctx(|| "finding this program".into())?;
    unshare(CloneFlags::CLONE_NEWNS).ctx(|| "unshare (mount)".into())?;
    propagation(MsFlags::MS_SLAVE)?;
    fs::create_dir_all(at).ctx(|| format!("creating {}", at.display()))?;
    build_base(at, &program)?;
    remount_ro(at)?;
    let _ = TEMPLATE.set((at.to_path_buf(), program));
    Ok(())
}

/// The part of a root that is the same in every sandbox: a tmpfs with the mount points,
/// read-only binds of the system directories, a few `/etc` files, a minimal `/dev`, and
/// this program. Read-write until the caller remounts it.
fn build_base(root: &Path, program: &Path) -> R<()> {
    tmpfs(root, "size=4m,mode=0755", MsFlags::empty())?;
    for dir in [
        "proc",
        "dev",
        "work",
        "inputs",
        "bundle",
        "tmp",
        ".cannabis",
        "etc",
    ] {
        fs::create_dir_all(root.join(dir)).ctx(|| format!("creating /{dir}"))?;
    }
    // One look at the host's mounts: which of them lie below the system directories.
    let host_mounts = mount_points()?;
    for path in SYSTEM {
        let host = Path::new(path);
        let Ok(meta) = fs::symlink_metadata(host) else {
            continue;
        };
        let inside = root.join(&path[1..]);
        if meta.file_type().is_symlink() {
            let target = fs::read_link(host).ctx(|| format!("reading {path}"))?;
            symlink(&target, &inside).ctx(|| format!("linking {path}"))?;
        } else {
            bind(host, &inside, true, meta.is_dir())?;
            // A recursive bind brings the host's submounts (say a separate /usr/local)
            // along, writable: make each of them read-only too.
            for sub in host_mounts
                .iter()
                .filter(|m| m.starts_with(host) && *m != host)
            {
                if let Ok(rest) = sub.strip_prefix("/") {
                    remount_ro(&root.join(rest))?;
                }
            }
        }
    }
    let etc = root.join("etc");
    for (name, text) in [
        ("passwd", "root:x:0:0:sandbox:/work:/bin/sh\n"),
        ("group", "root:x:0:\n"),
        ("hosts", "127.0.0.1 localhost cannabis\n::1 localhost\n"),
        ("hostname", "cannabis\n"),
    ] {
        fs::write(etc.join(name), text).ctx(|| format!("writing /etc/{name}"))?;
    }
    build_dev(&root.join("dev"), &[])?;
    bind(program, &root.join(&paths::SELF[1..]), true, false)
}

/// `/dev`: a few harmless devices, `devices` (granted GPUs), the usual links, and the
/// mount point of `/dev/shm`; read-only.
fn build_dev(dev: &Path, devices: &[PathBuf]) -> R<()> {
    tmpfs(dev, "size=64k,mode=0755", MsFlags::MS_NOEXEC)?;
    for name in DEVICES {
        let host = Path::new("/dev").join(name);
        if host.exists() {
            bind(&host, &dev.join(name), false, false)?;
        }
    }
    for device in devices {
        let rel = device
            .strip_prefix("/dev")
            .map_err(|_| format!("device {} is not under /dev", device.display()))?;
        bind(device, &dev.join(rel), false, false)?;
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, dev.join(name)).ctx(|| format!("linking /dev/{name}"))?;
    }
    fs::create_dir(dev.join("shm")).ctx(|| "creating /dev/shm".into())?;
    remount_ro(dev)
}

/// What is the attempt's own in its root: the granted GPUs (a `/dev` of its own), a
/// bounded `/dev/shm`, the one writable directory (bounded in size; `/tmp` lives inside
/// it), and the staged inputs and bundle, read-only.
fn attach_attempt(spec: &SandboxSpec, root: &Path) -> R<()> {
    let dev = root.join("dev");
    if !spec.devices.is_empty() {
        build_dev(&dev, &spec.devices)?;
    }
    let shm = spec.work_bytes.clamp(4096, 64 << 20);
    tmpfs(
        &dev.join("shm"),
        &format!("size={shm},mode=0755"),
        MsFlags::MS_NOEXEC,
    )?;
    let work = root.join("work");
    let size = spec.work_bytes.max(4096);
    tmpfs(&work, &format!("size={size},mode=0755"), MsFlags::empty())?;
    fs::create_dir(work.join(".tmp")).ctx(|| "creating /work/.tmp".into())?;
    // A rank placed again finds its checkpoint where it left it.
    if let Some(c) = &spec.checkpoint {
        let resume = spec.attempt_dir.join(files::RESUME);
        if resume.exists() {
            crate::exec::plain_name(&c.name)?;
            fs::copy(&resume, work.join(&c.name)).ctx(|| format!("resuming from {}", c.name))?;
        }
    }
    bind(&work.join(".tmp"), &root.join("tmp"), false, true)?;
    bind(
        &spec.attempt_dir.join(files::INPUTS),
        &root.join("inputs"),
        true,
        true,
    )?;
    bind(
        &spec.attempt_dir.join(files::BUNDLE),
        &root.join("bundle"),
        true,
        true,
    )
}

/// Every mount point this process sees, from its mountinfo.
fn mount_points() -> R<Vec<PathBuf>> {
    let text = fs::read_to_string("/proc/self/mountinfo").ctx(|| "reading mountinfo".into())?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        // Octal escapes (`\\040` for a space) are left as they are: such a path does not
        // exist and the remount reports it.
        .map(PathBuf::from)
        .collect())
}

fn tmpfs(at: &Path, options: &str, extra: MsFlags) -> R<()> {
    mount(
        Some("tmpfs"),
        at,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | extra,
        Some(options),
    )
    .ctx(|| format!("mounting a tmpfs on {}", at.display()))
}

/// Binds `src` onto `dst` (creating `dst` as an empty directory or file).
fn bind(src: &Path, dst: &Path, read_only: bool, dir: bool) -> R<()> {
    if dir {
        fs::create_dir_all(dst).ctx(|| format!("creating {}", dst.display()))?;
    } else if !dst.exists() {
        if let Some(parent) = dst.parent() {
            fs::create_dir_all(parent).ctx(|| format!("creating {}", parent.display()))?;
        }
        File::create(dst).ctx(|| format!("creating {}", dst.display()))?;
    }
    mount(
        Some(src),
        dst,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .ctx(|| format!("binding {} to {}", src.display(), dst.display()))?;
    if read_only {
        remount_ro(dst)?;
    }
    Ok(())
}

/// Makes a mount read-only, keeping the flags the kernel locks in a user namespace.
fn remount_ro(at: &Path) -> R<()> {
    let st = statvfs(at).ctx(|| format!("statvfs {}", at.display()))?;
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    for (have, keep) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if st.flags().contains(have) {
            flags |= keep;
        }
    }
    mount(None::<&str>, at, None::<&str>, flags, None::<&str>)
        .ctx(|| format!("making {} read-only", at.display()))
}

// ---------------------------------------------------------------- stage 2

/// Pid 1 of the sandbox, forked by the monitor: builds the root in a mount namespace of
/// its own, confines itself, reports ready (handing the monitor the work directory, from
/// which it copies the declared outputs afterwards), and runs the command when told.
/// Returns the process's exit code.
fn init_main(spec: &SandboxSpec, control: OwnedFd, out: OwnedFd, err: OwnedFd) -> i32 {
    // If the monitor dies, so does the sandbox: nobody would enforce its lease.
    if nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).is_err() {
        return 2;
    }

    let say = |msg: &str| send_with_fds(control.as_fd(), msg.as_bytes(), &[]);
    let (layers, work) = match init_setup(spec) {
        Ok(done) => done,
        Err(e) => {
            let _ = say(&format!("error {e}"));
            return 2;
        }
    };
    let ready = format!("ready {layers}");
    if send_with_fds(control.as_fd(), ready.as_bytes(), &[work.as_raw_fd()]).is_err() {
        return 2;
    }
    drop(work);
    let mut go = [0u8; 16];
    match receive(control.as_fd(), &mut go) {
        Ok((n, _)) if &go[..n] == b"go" => {}
        _ => return 3,
    }
    let Some((program, args)) = spec.argv.split_first() else {
        let _ = say("error empty command");
        return 127;
    };
    let child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            let _ = say(&format!("error {program}: {e}"));
            return 127;
        }
    };
    let main = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    // As pid 1, reap every orphan until the command itself ends.
    let report = loop {
        match waitpid(None::<Pid>, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == main => break format!("code {code}"),
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == main => {
                break format!("signal {}", sig as i32);
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => break format!("lost {e}"),
        }
    };
    let _ = say(&format!("exit {report}"));
    // Exiting pid 1 kills everything the command left behind in the namespace.
    0
}

/// Builds the root in a new mount namespace, mounts `/proc`, enters the root, and
/// confines this process (and so the command). Returns the confinement layers as a
/// space-separated list, and the work directory, opened.
fn init_setup(spec: &SandboxSpec) -> R<(String, OwnedFd)> {
    let root: PathBuf = spec.attempt_dir.join(files::ROOT);
    // A mount namespace of pid 1's own, so that the monitor keeps the host's view. `/proc`
    // is mounted while the host's is still visible, as the kernel requires.
    unshare(CloneFlags::CLONE_NEWNS).ctx(|| "unshare (mount)".into())?;
    build_root(spec)?;
    mount(
        Some("proc"),
        &root.join("proc"),
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .ctx(|| "mounting /proc".into())?;
    remount_ro(&root)?;
    std::env::set_current_dir(&root).ctx(|| "entering the root".into())?;
    pivot_root(".", ".").ctx(|| "pivot_root".into())?;
    umount2(".", MntFlags::MNT_DETACH).ctx(|| "detaching the host root".into())?;
    std::env::set_current_dir("/").ctx(|| "chdir /".into())?;
    let work = nix::fcntl::open(
        paths::WORK,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .ctx(|| "opening /work".into())?;
    // Under memory pressure in the attempt's cgroup, the command (which inherits this)
    // goes first, not the monitor that records what happened. Written while this process
    // still owns its /proc files: an undumpable process forked from a binary executed
    // outside the namespace leaves them to the host's root.
    fs::write("/proc/self/oom_score_adj", "1000").ctx(|| "raising oom_score_adj".into())?;
    nix::sys::prctl::set_dumpable(false).ctx(|| "prctl(PR_SET_DUMPABLE)".into())?;
    let mut layers = vec!["rlimits"];
    filter::rlimits(&spec.rlimits)?;
    if spec.landlock && filter::landlock(&spec.devices, spec.loopback)? {
        layers.push("landlock");
    }
    nix::sys::prctl::set_no_new_privs().ctx(|| "prctl(PR_SET_NO_NEW_PRIVS)".into())?;
    filter::drop_capabilities()?;
    if spec.seccomp {
        filter::seccomp(spec.loopback)?;
        layers.push("seccomp");
    }
    Ok((layers.join(" "), work))
}
