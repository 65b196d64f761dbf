//! Stage 1 (the monitor) and stage 2 (pid 1 of the sandbox). Both run in a fresh process of
//! this binary, single-threaded until they say otherwise: `unshare(CLONE_NEWUSER)` refuses a
//! process with threads.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, symlink};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::statvfs::{FsFlags, statvfs};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{Pid, pivot_root, sethostname};
use sha2::Digest as _;

use super::{
    ExitRecord, LogCount, OutputFile, STAGE1_ARG, STAGE2_ARG, SandboxSpec, files, filter, now_ms,
    paths,
};

/// Runs a sandbox stage if this process was started as one and returns its exit code;
/// `None` for every other command line. Call it first thing in `main`, before any thread
/// starts.
pub fn stage_main() -> Option<i32> {
    let arg = std::env::args_os().nth(1)?;
    if arg == STAGE1_ARG {
        Some(stage1())
    } else if arg == STAGE2_ARG {
        Some(stage2())
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

fn stage1() -> i32 {
    let mut host_in = BufReader::new(io::stdin());
    let mut line = String::new();
    // Blocks until the host has put this process into the attempt's cgroups.
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
    let mut host_out = io::stdout();
    let record = match monitor(&spec, &mut host_in, &mut host_out) {
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
    match write_exit(&spec.attempt_dir, &record) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("sandbox: writing {}: {e}", files::EXIT);
            1
        }
    }
}

fn monitor(
    spec: &SandboxSpec,
    host_in: &mut impl BufRead,
    host_out: &mut impl Write,
) -> R<ExitRecord> {
    let dir = &spec.attempt_dir;
    let stdout_file = File::create(dir.join(files::STDOUT)).ctx(|| "creating stdout".into())?;
    let stderr_file = File::create(dir.join(files::STDERR)).ctx(|| "creating stderr".into())?;
    let (uid, gid) = (nix::unistd::geteuid(), nix::unistd::getegid());

    unshare(
        CloneFlags::CLONE_NEWUSER
            | CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWPID
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS,
    )
    .ctx(|| "unshare (user, mount, pid, net, ipc, uts)".into())?;
    fs::write("/proc/self/setgroups", "deny").ctx(|| "writing setgroups".into())?;
    fs::write("/proc/self/uid_map", format!("0 {uid} 1")).ctx(|| "writing uid_map".into())?;
    fs::write("/proc/self/gid_map", format!("0 {gid} 1")).ctx(|| "writing gid_map".into())?;
    sethostname("cannabis").ctx(|| "sethostname".into())?;
    build_root(spec)?;

    // Stage 2 becomes pid 1 of the new pid namespace. Its standard input is a socket pair
    // for control ("spec", "ready", "go", "exit"); its output goes through pipes we cap.
    let (ours, theirs) = UnixStream::pair().ctx(|| "socketpair".into())?;
    let mut init = Command::new(&spec.program)
        .arg0("cannabis")
        .arg(STAGE2_ARG)
        .env_clear()
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ctx(|| format!("starting {}", spec.program.display()))?;
    let kill_init = |init: &mut Child| {
        let _ = init.kill();
        let _ = init.wait();
    };
    let mut ctl_out = ours.try_clone().ctx(|| "socket".into())?;
    let mut ctl_in = BufReader::new(ours);
    let spec_line = serde_json::to_string(spec).ctx(|| "spec".into())?;
    if let Err(e) = writeln!(ctl_out, "{spec_line}") {
        kill_init(&mut init);
        return Err(format!("sending the spec to pid 1: {e}"));
    }
    let mut reply = String::new();
    let _ = ctl_in.read_line(&mut reply);
    let Some(ready) = reply.trim_end().strip_prefix("ready ") else {
        kill_init(&mut init);
        let why = reply
            .trim_end()
            .strip_prefix("error ")
            .unwrap_or("pid 1 exited");
        return Err(format!("sandbox init: {why}"));
    };
    // The host inspects the running pid 1 before it lets the command start.
    writeln!(host_out, "ready {} {ready}", init.id()).ctx(|| "reporting ready".into())?;
    host_out.flush().ctx(|| "reporting ready".into())?;
    let mut go = String::new();
    let _ = host_in.read_line(&mut go);
    if go.trim_end() != "go" {
        kill_init(&mut init);
        return Ok(ExitRecord {
            ended_by: Some("aborted before start".into()),
            ..ExitRecord::default()
        });
    }
    // After unshare(CLONE_NEWPID) this process cannot start threads: one poll loop copies
    // both logs, watches pid 1 and enforces the lease. Everything that can fail is set up
    // before the command starts.
    let pipes = (init.stdout.take(), init.stderr.take());
    let (Some(out_pipe), Some(err_pipe)) = pipes else {
        kill_init(&mut init);
        return Err("no output pipes".into());
    };
    let logs = Log::new(out_pipe, stdout_file, spec.log_cap)
        .and_then(|o| Ok([o, Log::new(err_pipe, stderr_file, spec.log_cap)?]));
    let mut logs = match logs {
        Ok(l) => l,
        Err(e) => {
            kill_init(&mut init);
            return Err(e);
        }
    };
    let started_at_ms = now_ms();
    if let Err(e) = writeln!(ctl_out, "go") {
        kill_init(&mut init);
        return Err(format!("starting the command: {e}"));
    }
    let _ = writeln!(host_out, "started");
    let mut ended_by = None;
    let mut next_lease_check = Instant::now();
    let mut status = None;
    let mut drain_until: Option<Instant> = None;
    loop {
        poll_logs(&mut logs);
        if status.is_none() {
            match init.try_wait() {
                Ok(Some(s)) => status = Some(s),
                Ok(None) => {}
                Err(e) => {
                    ended_by = Some(format!("waiting for pid 1: {e}"));
                    let _ = init.kill();
                    break;
                }
            }
        }
        if status.is_some() {
            // Everything in the namespace dies with pid 1, so the pipes close; read what
            // is left, for a bounded time.
            let until = *drain_until.get_or_insert_with(|| Instant::now() + Duration::from_secs(2));
            if logs.iter().all(|l| !l.open) || Instant::now() >= until {
                break;
            }
            continue;
        }
        if Instant::now() >= next_lease_check {
            next_lease_check = Instant::now() + Duration::from_millis(200);
            if lease_expired(dir) && ended_by.is_none() {
                ended_by = Some("lease expired".into());
                let _ = init.kill();
            }
        }
    }
    let [stdout, stderr] = logs.map(Log::finish);
    let ended_at_ms = now_ms();
    // Pid 1 reports how the command ended; its own status says whether it was killed.
    let mut report = String::new();
    let _ = ctl_in.read_line(&mut report);
    let (mut code, mut signal) = (None, None);
    if let Some(rest) = report.trim_end().strip_prefix("exit ") {
        let mut it = rest.split_whitespace();
        match (it.next(), it.next().and_then(|v| v.parse::<i32>().ok())) {
            (Some("code"), v) => code = v,
            (Some("signal"), v) => signal = v,
            _ => {}
        }
    } else if let Some(status) = status {
        use std::os::unix::process::ExitStatusExt as _;
        signal = status.signal();
        if signal.is_none() && ended_by.is_none() {
            ended_by = Some(match report.trim_end().strip_prefix("error ") {
                Some(e) => format!("the command could not start: {e}"),
                None => "pid 1 ended without a report".into(),
            });
        }
    }
    let (outputs, refused_outputs) = copy_outputs(spec);
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

/// Waits up to 20 ms for output on the open logs and copies what came.
fn poll_logs(logs: &mut [Log; 2]) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut buf = vec![0u8; 64 * 1024];
    let ready: Vec<bool> = {
        let mut fds: Vec<PollFd<'_>> = logs
            .iter()
            .filter(|l| l.open)
            .map(|l| PollFd::new(l.pipe.as_fd(), PollFlags::POLLIN))
            .collect();
        if fds.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
            return;
        }
        let _ = poll(&mut fds, PollTimeout::from(20u8));
        fds.iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect()
    };
    let mut it = ready.into_iter();
    for log in logs.iter_mut().filter(|l| l.open) {
        if it.next().unwrap_or(false) {
            log.drain(&mut buf);
        }
    }
}

/// Copies each declared output out of the work directory: a regular file (no symlink, no
/// device, no fifo) no larger than its cap.
fn copy_outputs(spec: &SandboxSpec) -> (Vec<OutputFile>, Vec<(String, String)>) {
    let work = spec.attempt_dir.join(files::ROOT).join("work");
    let out_dir = spec.attempt_dir.join(files::OUTPUTS);
    let mut copied = Vec::new();
    let mut refused = Vec::new();
    // All outputs together get no more disk than the work directory had.
    let mut budget = spec.work_bytes;
    for (name, cap) in &spec.outputs {
        match copy_output(&work.join(name), &out_dir.join(name), (*cap).min(budget)) {
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

fn copy_output(from: &Path, to: &Path, cap: u64) -> R<Option<OutputFile>> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(from)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err("is a symbolic link".into());
        }
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

fn build_root(spec: &SandboxSpec) -> R<()> {
    let root = spec.attempt_dir.join(files::ROOT);
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .ctx(|| "making / private".into())?;
    tmpfs(&root, "size=4m,mode=0755", MsFlags::empty())?;
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
            for sub in submounts(&inside)? {
                remount_ro(&sub)?;
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

    // /dev: a few harmless devices, the granted GPUs, and the usual links.
    let dev = root.join("dev");
    tmpfs(&dev, "size=64k,mode=0755", MsFlags::MS_NOEXEC)?;
    for name in DEVICES {
        let host = Path::new("/dev").join(name);
        if host.exists() {
            bind(&host, &dev.join(name), false, false)?;
        }
    }
    for device in &spec.devices {
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
    let shm = spec.work_bytes.clamp(4096, 64 << 20);
    tmpfs(
        &dev.join("shm"),
        &format!("size={shm},mode=0755"),
        MsFlags::MS_NOEXEC,
    )?;
    remount_ro(&dev)?;

    // The one writable directory, bounded in size; /tmp lives inside it.
    let work = root.join("work");
    let size = spec.work_bytes.max(4096);
    tmpfs(&work, &format!("size={size},mode=0755"), MsFlags::empty())?;
    fs::create_dir(work.join(".tmp")).ctx(|| "creating /work/.tmp".into())?;
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
    )?;
    bind(&spec.program, &root.join(&paths::SELF[1..]), true, false)?;
    Ok(())
}

/// Mount points strictly below `dir`, from this process's mountinfo.
fn submounts(dir: &Path) -> R<Vec<PathBuf>> {
    let text = fs::read_to_string("/proc/self/mountinfo").ctx(|| "reading mountinfo".into())?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        // Octal escapes (`\\040` for a space) are left as they are: such a path does not
        // exist and the remount reports it.
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir) && p != dir)
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

fn stage2() -> i32 {
    // If the monitor dies, so does the sandbox: nobody would enforce its lease.
    if nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).is_err() {
        return 2;
    }
    let Ok(fd) = io::stdin().as_fd().try_clone_to_owned() else {
        return 2;
    };
    let ctl = UnixStream::from(fd);
    let Ok(mut ctl_out) = ctl.try_clone() else {
        return 2;
    };
    let mut ctl_in = BufReader::new(ctl);
    let mut line = String::new();
    if ctl_in.read_line(&mut line).is_err() {
        return 2;
    }
    let spec: SandboxSpec = match serde_json::from_str(&line) {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(ctl_out, "error bad spec: {e}");
            return 2;
        }
    };
    let layers = match init_setup(&spec) {
        Ok(layers) => layers,
        Err(e) => {
            let _ = writeln!(ctl_out, "error {e}");
            return 2;
        }
    };
    if writeln!(ctl_out, "ready {layers}").is_err() {
        return 2;
    }
    let mut go = String::new();
    if ctl_in.read_line(&mut go).is_err() || go.trim_end() != "go" {
        return 3;
    }
    let Some((program, args)) = spec.argv.split_first() else {
        let _ = writeln!(ctl_out, "error empty command");
        return 127;
    };
    let child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(ctl_out, "error {program}: {e}");
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
    let _ = writeln!(ctl_out, "exit {report}");
    // Exiting pid 1 kills everything the command left behind in the namespace.
    0
}

/// Mounts `/proc`, enters the root, and confines this process (and so the command).
/// Returns the confinement layers as a space-separated list.
fn init_setup(spec: &SandboxSpec) -> R<String> {
    let root: PathBuf = spec.attempt_dir.join(files::ROOT);
    // A mount namespace of our own, so that pivoting leaves stage 1's view alone. `/proc`
    // is mounted while the host's is still visible, as the kernel requires.
    unshare(CloneFlags::CLONE_NEWNS).ctx(|| "unshare (mount)".into())?;
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
    nix::sys::prctl::set_dumpable(false).ctx(|| "prctl(PR_SET_DUMPABLE)".into())?;

    // Under memory pressure in the attempt's cgroup, the command (which inherits this)
    // goes first, not the monitor that records what happened.
    fs::write("/proc/self/oom_score_adj", "1000").ctx(|| "raising oom_score_adj".into())?;
    let mut layers = vec!["rlimits"];
    filter::rlimits(&spec.rlimits)?;
    if spec.landlock && filter::landlock(&spec.devices)? {
        layers.push("landlock");
    }
    nix::sys::prctl::set_no_new_privs().ctx(|| "prctl(PR_SET_NO_NEW_PRIVS)".into())?;
    filter::drop_capabilities()?;
    if spec.seccomp {
        filter::seccomp()?;
        layers.push("seccomp");
    }
    Ok(layers.join(" "))
}
