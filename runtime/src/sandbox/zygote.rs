//! The zygote: a process of this binary, started once per executor, with one thread for
//! its whole life, that forks each sandbox's monitor; the monitor forks the sandbox's pid 1
//! the same way.
//!
//! Executing this binary costs about 2 ms (it is large: relocations and page faults), and
//! a sandbox used to execute it twice. A fork of a small single-threaded process costs a
//! tenth of that. This module holds the workspace's only `fork`, and the only adoption of
//! descriptors received from another process; both are checked where they happen.
//!
//! The channel between the host and the zygote is a `SOCK_SEQPACKET` pair (one message per
//! request, never merged). A request is `monitor` or `monitor <uid> <gid>`, carrying two
//! descriptors: the monitor's end of its control socket to the host and the attempt's
//! `sandbox.log`. The reply is `pid <n>` or `error <why>`. The zygote reaps the monitors
//! it forked as soon as they end (a `signalfd` for `SIGCHLD`), and, as a child subreaper,
//! the sandboxes' pid 1s that outlive their monitor by the moment their namespaces take to
//! be torn down; it exits when the host closes the channel (monitors that are running keep
//! running: they never depended on it).
//!
//! It keeps one spare monitor forked ahead of need (when no sandbox is being served, or
//! after 5 ms idle), so that a request costs a message instead of a fork; as root the spare
//! also makes the sandbox's empty network namespace then. As root the zygote also mounts,
//! in a mount namespace of its own, the part of the root every sandbox shares (see
//! `stage::make_template`), and compiles the seccomp filter once.
#![allow(unsafe_code)]

use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{
    AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, recvmsg,
    sendmsg, socketpair,
};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid};

use super::{LaunchError, ZYGOTE_ARG};

/// Which side of a fork this is.
pub(super) enum Forked {
    /// The new process.
    Child,
    /// The old one; the new process's pid.
    Parent(Pid),
}

/// Forks this process, which must have exactly one thread.
pub(super) fn fork_single_threaded() -> Result<Forked, String> {
    let threads = threads()?;
    if threads != 1 {
        return Err(format!("refusing to fork a process with {threads} threads"));
    }
    // SAFETY: the danger of `fork` is a child that inherits locks (the allocator's,
    // stdio's, the environment's) held at that instant by other threads, which do not
    // exist in the child. This process has one thread (checked just above; only this
    // thread could start another, and it is here), so nothing is held by anyone else and
    // the child is a whole, consistent copy that may do anything the parent could.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => Ok(Forked::Child),
        Ok(nix::unistd::ForkResult::Parent { child }) => Ok(Forked::Parent(child)),
        Err(e) => Err(format!("fork: {e}")),
    }
}

/// Threads of this process, from `/proc/self/status`.
fn threads() -> Result<usize, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("reading /proc/self/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| "no thread count in /proc/self/status".to_string())
}

/// Starts sandbox monitors through a zygote of `program`, started on first use and again
/// whenever it is found gone. Safe to share between threads: requests are serialised.
#[derive(Debug)]
pub struct Launcher {
    program: PathBuf,
    template: PathBuf,
    zygote: Mutex<Option<Zygote>>,
}

#[derive(Debug)]
struct Zygote {
    child: Option<Child>,
    channel: OwnedFd,
}

impl Drop for Zygote {
    /// Closing the channel ends the zygote; it is reaped without blocking the caller.
    fn drop(&mut self) {
        let _ =
            nix::sys::socket::shutdown(self.channel.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(mut child) = self.child.take() {
            std::thread::spawn(move || {
                let _ = child.wait();
            });
        }
    }
}

impl Launcher {
    /// A launcher for `program` (this binary, as the sandbox uid can execute it). When run
    /// as root, the zygote mounts the part of the root every sandbox shares on `template`
    /// (an empty directory the sandbox uid can reach), in a mount namespace of its own:
    /// the host sees nothing there. Starts nothing yet.
    pub fn new(program: &Path, template: &Path) -> Self {
        Self {
            program: program.to_path_buf(),
            template: template.to_path_buf(),
            zygote: Mutex::new(None),
        }
    }

    /// Starts the zygote now, so that the first sandbox does not wait for it, and returns
    /// once it answers.
    pub fn start(&self) -> Result<(), LaunchError> {
        let mut slot = self.zygote.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(self.spawn()?);
        }
        let answered = slot
            .as_ref()
            .map(|z| ask(&z.channel, b"ping", &[], &mut || {}));
        match answered {
            Some(Ok(reply)) if reply == "pong" => Ok(()),
            Some(Ok(reply)) => Err(LaunchError::Setup(format!(
                "the sandbox zygote answered {reply:?}"
            ))),
            Some(Err(e)) => {
                *slot = None;
                Err(LaunchError::Io(e))
            }
            None => Err(LaunchError::Setup("no sandbox zygote".into())),
        }
    }

    fn spawn(&self) -> Result<Zygote, LaunchError> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| LaunchError::Io(e.into()))?;
        let child = Command::new(&self.program)
            .arg(ZYGOTE_ARG)
            .arg(&self.template)
            .env_clear()
            .current_dir("/")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .spawn()
            .map_err(|source| LaunchError::Spawn {
                program: self.program.display().to_string(),
                source,
            })?;
        Ok(Zygote {
            child: Some(child),
            channel: ours,
        })
    }

    /// Forks a monitor that runs as `ids` (uid, gid) when given, talks to the host over
    /// `control` and writes its diagnostics to `log`. Returns its pid. `meanwhile` runs
    /// once, while the zygote serves the request; it has run whenever this returns `Ok`.
    /// A zygote found gone is started again once.
    pub(super) fn fork_monitor(
        &self,
        ids: Option<(u32, u32)>,
        control: &OwnedFd,
        log: &File,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<u32, LaunchError> {
        let request = match ids {
            Some((uid, gid)) => format!("monitor {uid} {gid}"),
            None => "monitor".to_string(),
        };
        let fds = [control.as_raw_fd(), log.as_raw_fd()];
        let mut slot = self.zygote.lock().unwrap_or_else(|p| p.into_inner());
        let mut ran = false;
        let mut once = || {
            if !std::mem::replace(&mut ran, true) {
                meanwhile();
            }
        };
        let mut last = None;
        for _ in 0..2 {
            if slot.is_none() {
                *slot = Some(self.spawn()?);
            }
            let Some(zygote) = slot.as_ref() else {
                continue;
            };
            match ask(&zygote.channel, request.as_bytes(), &fds, &mut once) {
                Ok(reply) => {
                    return if let Some(pid) = reply.strip_prefix("pid ") {
                        pid.parse().map_err(|_| {
                            LaunchError::Setup(format!("bad reply from the zygote: {reply:?}"))
                        })
                    } else {
                        let why = reply.strip_prefix("error ").unwrap_or(&reply);
                        Err(LaunchError::Setup(format!("forking the monitor: {why}")))
                    };
                }
                // The zygote is gone (killed, or it failed): start a new one.
                Err(e) => {
                    last = Some(e);
                    *slot = None;
                }
            }
        }
        Err(LaunchError::Io(last.unwrap_or_else(|| {
            std::io::Error::other("the zygote did not answer")
        })))
    }
}

/// Sends one request with its descriptors, runs `meanwhile`, and waits for the one reply.
fn ask(
    channel: &OwnedFd,
    request: &[u8],
    fds: &[RawFd],
    meanwhile: &mut dyn FnMut(),
) -> std::io::Result<String> {
    send_with_fds(channel.as_fd(), request, fds)?;
    meanwhile();
    let mut buf = [0u8; 512];
    let n = loop {
        match nix::sys::socket::recv(channel.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            Err(Errno::EINTR) => continue,
            other => break other?,
        }
    };
    if n == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the zygote exited",
        ));
    }
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// The zygote's main loop; returns its exit code when the host closes the channel.
pub(super) fn zygote_main() -> i32 {
    let channel = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("sandbox zygote: no channel: {e}");
            return 2;
        }
    };
    // Descriptor 0 would keep the channel open in every monitor: point it at /dev/null.
    match File::open("/dev/null") {
        Ok(null) if nix::unistd::dup2_stdin(&null).is_ok() => {}
        _ => {
            eprintln!("sandbox zygote: cannot replace its standard input");
            return 2;
        }
    }
    // Every sandbox installs the same seccomp filters: compile them once, here. And as root,
    // mount the part of the root they all share, once.
    super::filter::prepare_seccomp();
    if nix::unistd::geteuid().is_root()
        && let Some(template) = std::env::args_os().nth(2)
        && let Err(e) = super::stage::make_template(Path::new(&template))
    {
        eprintln!("sandbox zygote: no root template ({e}); each sandbox builds its root");
    }
    let mut sigchld = SigSet::empty();
    sigchld.add(Signal::SIGCHLD);
    let ended = sigchld.thread_block().and_then(|()| {
        SignalFd::with_flags(&sigchld, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
    });
    let ended = match ended {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("sandbox zygote: signalfd: {e}");
            return 2;
        }
    };
    let mut buf = [0u8; 512];
    // A monitor forked ahead of need: a request then costs a message, not a fork (nor a
    // network namespace). A new spare is forked when no sandbox is being served, or else
    // once the zygote has been idle for a moment: never in a starting sandbox's way.
    let mut spare: Option<(Pid, OwnedFd)> = None;
    // Monitors handed a request and not yet reaped. A monitor may end before its pid 1
    // (see `stage::monitor`): as a subreaper the zygote reaps those too.
    let mut serving: Vec<Pid> = Vec::new();
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        eprintln!("sandbox zygote: prctl(PR_SET_CHILD_SUBREAPER): {e}");
        return 2;
    }
    loop {
        let request = {
            let mut ready = [
                PollFd::new(channel.as_fd(), PollFlags::POLLIN),
                PollFd::new(ended.as_fd(), PollFlags::POLLIN),
            ];
            let wait = if spare.is_some() {
                PollTimeout::NONE
            } else if serving.is_empty() {
                PollTimeout::ZERO
            } else {
                PollTimeout::from(5u8)
            };
            match poll(&mut ready, wait) {
                Ok(0) => {
                    spare = match fork_spare(&channel, &ended, &sigchld) {
                        Ok(s) => Some(s),
                        Err(e) => {
                            eprintln!("sandbox zygote: {e}");
                            return 1;
                        }
                    };
                    continue;
                }
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    eprintln!("sandbox zygote: poll: {e}");
                    return 1;
                }
            }
            ready[0].revents().is_some_and(|r| !r.is_empty())
        };
        // Signals of the same kind merge: read them all, then reap every ended child.
        while let Ok(Some(_)) = ended.read_signal() {}
        for pid in reap() {
            if spare.as_ref().is_some_and(|(p, _)| *p == pid) {
                spare = None;
            }
            serving.retain(|p| *p != pid);
        }
        if !request {
            continue;
        }
        let (n, fds) = match receive(channel.as_fd(), &mut buf) {
            Ok(got) => got,
            Err(Errno::EINTR) => continue,
            Err(e) => {
                eprintln!("sandbox zygote: receiving: {e}");
                return 1;
            }
        };
        if n == 0 {
            return 0;
        }
        let request = String::from_utf8_lossy(&buf[..n]).into_owned();
        let reply = match parse(&request, fds) {
            Err(_) if request == "ping" => "pong".to_string(),
            Err(why) => format!("error {why}"),
            Ok((ids, control, log)) => {
                // The spare, if it is still there to take it; else a fork now.
                let handed = spare.take().and_then(|(pid, to_spare)| {
                    let fds = [control.as_raw_fd(), log.as_raw_fd()];
                    send_with_fds(to_spare.as_fd(), request.as_bytes(), &fds)
                        .ok()
                        .map(|()| pid)
                });
                match handed {
                    Some(pid) => {
                        serving.push(pid);
                        format!("pid {pid}")
                    }
                    None => match fork_single_threaded() {
                        Ok(Forked::Child) => {
                            drop((channel, ended));
                            if sigchld.thread_unblock().is_err() {
                                std::process::exit(2);
                            }
                            let own_net = make_network_namespace();
                            std::process::exit(monitor_child(ids, own_net, control, log));
                        }
                        Ok(Forked::Parent(pid)) => {
                            serving.push(pid);
                            format!("pid {pid}")
                        }
                        Err(e) => format!("error {e}"),
                    },
                }
            }
        };
        if send_with_fds(channel.as_fd(), reply.as_bytes(), &[]).is_err() {
            return 0;
        }
    }
}

/// Forks a spare monitor: it waits for the request it will serve (as the zygote received
/// it, descriptors included) on a socket of its own, and ends if the zygote goes away.
fn fork_spare(
    channel: &OwnedFd,
    ended: &SignalFd,
    sigchld: &SigSet,
) -> Result<(Pid, OwnedFd), String> {
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| format!("socketpair: {e}"))?;
    match fork_single_threaded()? {
        Forked::Child => {
            // The zygote's channel and signal descriptor are not this process's to keep.
            let _ = nix::unistd::close(channel.as_raw_fd());
            let _ = nix::unistd::close(ended.as_raw_fd());
            drop(ours);
            if sigchld.thread_unblock().is_err() {
                std::process::exit(2);
            }
            let own_net = make_network_namespace();
            let mut buf = [0u8; 512];
            let code = match receive(theirs.as_fd(), &mut buf) {
                Ok((n, fds)) if n > 0 => {
                    let request = String::from_utf8_lossy(&buf[..n]).into_owned();
                    match parse(&request, fds) {
                        Ok((ids, control, log)) => {
                            drop(theirs);
                            monitor_child(ids, own_net, control, log)
                        }
                        Err(_) => 2,
                    }
                }
                _ => 0,
            };
            std::process::exit(code);
        }
        Forked::Parent(pid) => Ok((pid, ours)),
    }
}

/// Sends one message on a socket with `fds` attached.
pub(super) fn send_with_fds(socket: BorrowedFd<'_>, msg: &[u8], fds: &[RawFd]) -> nix::Result<()> {
    let rights = [ControlMessage::ScmRights(fds)];
    sendmsg::<()>(
        socket.as_raw_fd(),
        &[IoSlice::new(msg)],
        if fds.is_empty() { &[] } else { &rights },
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map(|_| ())
}

/// Receives one message and the descriptors it carries (close-on-exec, at most four).
pub(super) fn receive(
    channel: BorrowedFd<'_>,
    buf: &mut [u8],
) -> nix::Result<(usize, Vec<OwnedFd>)> {
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        channel.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: the kernel has just installed these descriptors in this process's
            // table for this message; nothing else in the process knows or owns them, so
            // each is adopted exactly once.
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok((msg.bytes, fds))
}

type Request = (Option<(Uid, Gid)>, OwnedFd, OwnedFd);

fn parse(request: &str, fds: Vec<OwnedFd>) -> Result<Request, String> {
    let mut words = request.split_whitespace();
    if words.next() != Some("monitor") {
        return Err(format!("unknown request {request:?}"));
    }
    let ids = match (words.next(), words.next()) {
        (None, None) => None,
        (Some(uid), Some(gid)) => {
            let uid: u32 = uid.parse().map_err(|_| format!("bad uid {uid:?}"))?;
            let gid: u32 = gid.parse().map_err(|_| format!("bad gid {gid:?}"))?;
            Some((Uid::from_raw(uid), Gid::from_raw(gid)))
        }
        _ => return Err(format!("bad request {request:?}")),
    };
    let [control, log]: [OwnedFd; 2] = fds
        .try_into()
        .map_err(|fds: Vec<OwnedFd>| format!("{} descriptors, not 2", fds.len()))?;
    Ok((ids, control, log))
}

/// Reaps every child that has ended (monitors, and the pid 1s that outlived their monitor
/// and were handed to this subreaper), without waiting; returns their pids.
fn reap() -> Vec<Pid> {
    let mut ended = Vec::new();
    loop {
        match waitpid(None::<Pid>, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return ended,
            Ok(status) => ended.extend(status.pid()),
        }
    }
}

/// In the forked child: run the monitor, which becomes the sandbox uid once it is in the
/// attempt's cgroups.
fn monitor_child(ids: Option<(Uid, Gid)>, own_net: bool, control: OwnedFd, log: OwnedFd) -> i32 {
    if nix::unistd::dup2_stderr(&log).is_err() {
        return 2;
    }
    drop(log);
    super::stage::monitor_main(UnixStream::from(control), own_net, move || become_user(ids))
}

/// Puts this process (a monitor to be) into a new, empty network namespace, when it is
/// root: the costliest namespace to make (~0.5 ms, most of a sandbox's kernel set-up), made
/// here ahead of need for a spare. Owned by the host's user namespace, it is one the
/// sandbox cannot configure at all. `false` when not made: the monitor then makes one in
/// its own user namespace.
fn make_network_namespace() -> bool {
    nix::unistd::geteuid().is_root()
        && unshare(CloneFlags::CLONE_NEWNET).is_ok()
        && loopback_up().is_ok()
}

/// Brings up the new namespace's loopback interface (down in a new namespace): the
/// sandbox then has `127.0.0.1` and `::1` to itself. A group's rank also gets the group's
/// interface there, made by its node (`cannabis_runtime::groupnet`); others get nothing
/// more.
fn loopback_up() -> Result<(), nix::Error> {
    use std::os::fd::AsRawFd as _;
    let sock = crate::groupnet::config_socket()?;
    // SAFETY: `ifreq` is plain data (zeroes are a valid value); the name is NUL-terminated
    // within its 16 bytes; both ioctls read and write only the `ifreq` passed, on a socket
    // this function owns.
    unsafe {
        let mut req: libc::ifreq = std::mem::zeroed();
        for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *d = *s as libc::c_char;
        }
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(nix::Error::last());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(nix::Error::last());
        }
    }
    Ok(())
}

/// Becomes `ids` (uid, gid) with no supplementary groups, when given.
fn become_user(ids: Option<(Uid, Gid)>) -> Result<(), String> {
    let Some((uid, gid)) = ids else {
        return Ok(());
    };
    nix::unistd::setgroups(&[])
        .and_then(|()| nix::unistd::setresgid(gid, gid, gid))
        .and_then(|()| nix::unistd::setresuid(uid, uid, uid))
        .map_err(|e| format!("becoming uid {uid}: {e}"))?;
    // A change of uid makes the process undumpable, which leaves its /proc files to root;
    // the monitor writes its own uid_map there.
    nix::sys::prctl::set_dumpable(true).map_err(|e| format!("prctl(PR_SET_DUMPABLE): {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_with_threads_is_never_forked() {
        // The test harness runs this on a thread of its own, next to the main thread.
        let other =
            std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_millis(200)));
        match fork_single_threaded() {
            Err(why) => assert!(why.contains("threads"), "{why}"),
            Ok(Forked::Child) => std::process::exit(1),
            Ok(Forked::Parent(_)) => panic!("forked a process with several threads"),
        }
        let _ = other.join();
    }

    #[test]
    fn requests_are_checked_before_anything_is_forked() {
        let fds = || -> Vec<OwnedFd> {
            let (a, b) = UnixStream::pair().unwrap();
            vec![a.into(), b.into()]
        };
        assert!(parse("monitor", fds()).unwrap().0.is_none());
        let (ids, _, _) = parse("monitor 1900000000 1900000001", fds()).unwrap();
        assert_eq!(
            ids,
            Some((Uid::from_raw(1_900_000_000), Gid::from_raw(1_900_000_001)))
        );
        assert!(
            parse("monitor 5", fds())
                .unwrap_err()
                .contains("bad request")
        );
        assert!(parse("monitor x 5", fds()).unwrap_err().contains("bad uid"));
        assert!(
            parse("spawn /bin/sh", fds())
                .unwrap_err()
                .contains("unknown request")
        );
        assert!(
            parse("monitor", Vec::new())
                .unwrap_err()
                .contains("0 descriptors")
        );
    }
}
