//! One thread per active attempt walks it through its states. Each step journals the
//! state first, then acts.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cannabis_protocol::{Digest, TaskInput};
use sha2::Digest as _;

use super::adapter::{self, base_env};
use super::attempt::{Attempt, AttemptState, Cleanup, Renewal, SyntheticResult};
use super::{ExecError, Inner, input_name, write_lease};
use crate::sandbox::{self, CgroupLimits, ExitRecord, SandboxSpec, files, now_ms};

/// The stop reason of an expired lease (the sandbox's monitor writes the same words).
const LEASE_EXPIRED: &str = "lease expired";

/// Walks attempt `id` until its cleanup has ended (or the executor shuts down).
pub(super) fn drive(inner: &Inner, id: &str) {
    loop {
        if inner.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let Some(a) = inner.lock().attempts.get(id).cloned() else {
            return;
        };
        let step = match a.state {
            AttemptState::Reserved => reserved(inner, &a),
            // Only seen after a restart: the command was never started (running is
            // journaled before the start), so nothing ran.
            AttemptState::Preparing => inner.update(id, |a| {
                a.finish(
                    now_ms(),
                    AttemptState::Failed,
                    Some(
                        "the executor restarted during preparation; the command never started"
                            .into(),
                    ),
                )
            }),
            AttemptState::Running => monitor(inner, &a),
            _ if a.cleanup == Cleanup::Pending => cleanup(inner, &a),
            _ => return,
        };
        if let Err(e) = step {
            eprintln!("executor: attempt {id}: {e}");
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

fn reserved(inner: &Inner, a: &Attempt) -> Result<(), ExecError> {
    let now = now_ms();
    if a.cancel.is_some() {
        return inner.update(&a.id, |a| {
            a.finish(
                now,
                AttemptState::Cancelled,
                Some("stopped before it started".into()),
            )
        });
    }
    if now > a.lease_until_ms && a.request.renewal == Renewal::External {
        return inner.update(&a.id, |a| {
            a.finish(
                now,
                AttemptState::Failed,
                Some("the lease expired before the start".into()),
            )
        });
    }
    if inner.lock().control == super::Control::Paused {
        std::thread::sleep(Duration::from_millis(100));
        return Ok(());
    }
    inner.update(&a.id, |a| a.to_preparing(now))?;
    inner.failpoint("preparing");
    if let Err(why) = prepare_and_start(inner, a) {
        let outcome = if inner
            .lock()
            .attempts
            .get(&a.id)
            .is_some_and(|a| a.cancel.is_some())
        {
            AttemptState::Cancelled
        } else {
            AttemptState::Failed
        };
        inner.update(&a.id, |a| {
            if a.state.is_final() {
                return Ok(());
            }
            a.finish(now_ms(), outcome, Some(why))
        })?;
    }
    Ok(())
}

/// Stages everything, starts the sandbox, checks it, journals `running`, then lets the
/// command start.
fn prepare_and_start(inner: &Inner, a: &Attempt) -> Result<(), String> {
    let dir = inner.attempt_dir(&a.id);
    let reservation = a.reservation.clone().ok_or("no reservation")?;
    let uid = reservation.uid;
    let as_uid = inner.as_root.then_some(uid);
    let request = &a.request;
    let kind = request.task.workload.adapter;
    let adapter = adapter::adapter(kind).ok_or("no adapter")?;
    let command = adapter.command(request)?;
    make_attempt_dir(&dir, as_uid)?;
    let mut needed: u64 = request
        .task
        .inputs
        .iter()
        .map(|i| match i {
            TaskInput::Staged(r) => r.size_bytes,
            TaskInput::FromTask { .. } => 0,
        })
        .sum();
    if let Some(b) = &request.bundle {
        needed += fs::metadata(b).map(|m| m.len()).unwrap_or(0) * 2;
    }
    // Two sealed copies of the checkpoint at most (the newest, and one being sealed), and
    // the one it resumes from.
    if let Some(c) = &request.task.checkpoint {
        let cap = c.max_bytes.min(request.task.resources.storage_bytes);
        needed += cannabis_protocol::max_cipher_size(cap) * 2;
    }
    if let Some(r) = &request.resume {
        needed += fs::metadata(r).map(|m| m.len()).unwrap_or(0);
    }
    let free = nix::sys::statvfs::statvfs(&dir)
        .map(|s| s.blocks_available().saturating_mul(s.fragment_size()))
        .map_err(|e| format!("checking free disk: {e}"))?;
    if needed.saturating_add(64 << 20) > free {
        return Err(format!(
            "not enough disk to stage this attempt: needs {needed} bytes, {free} free"
        ));
    }
    if adapter.needs_bundle() {
        let bundle = request.bundle.as_ref().ok_or("no bundle")?;
        stage_bundle(
            bundle,
            &request.task.workload.digest,
            &dir.join(files::BUNDLE),
        )?;
    }
    for input in &request.task.inputs {
        let name = input_name(input);
        let (_, path) = request
            .inputs
            .iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| format!("input {name:?} has no local file"))?;
        let dest = dir.join(files::INPUTS).join(name);
        let (digest, size) =
            copy_hashed(path, &dest).map_err(|e| format!("staging input {name:?}: {e}"))?;
        if let TaskInput::Staged(r) = input
            && (digest != r.digest || size != r.size_bytes)
        {
            return Err(format!(
                "input {name:?} does not match its pin: expected {} ({} bytes), staged {digest} ({size} bytes)",
                r.digest, r.size_bytes
            ));
        }
    }
    if let Some(resume) = &request.resume {
        copy_hashed(resume, &dir.join(files::RESUME))
            .map_err(|e| format!("staging the checkpoint to resume from: {e}"))?;
    }
    if let Some(uid) = as_uid {
        chown_tree(&dir, uid)
            .map_err(|e| format!("handing the attempt directory to uid {uid}: {e}"))?;
    }
    // A local run's lease starts now (staging may have taken a while); a market lease is
    // whatever it was last renewed to.
    let local = request.renewal == Renewal::Local;
    let lease = if local {
        now_ms() + inner.cfg.local_lease_ms
    } else {
        0
    };
    let until = inner.renew(&a.id, lease).map_err(|e| e.to_string())?;
    write_lease(&dir, until).map_err(|e| format!("writing the lease: {e}"))?;

    let devices = if reservation.gpus.is_empty() {
        Vec::new()
    } else {
        let map = inner.cfg.cdi_map.as_ref().ok_or(
            "GPUs are handed to sandboxes through the pinned CDI map, and none is set (owner.cdi_map)",
        )?;
        crate::cdi::device_nodes(map, &reservation.gpus).map_err(|e| e.to_string())?
    };
    let mut env = base_env();
    env.push(("CANNABIS_ATTEMPT".into(), a.id.clone()));
    for (name, value) in &request.env {
        let plain = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !plain || name.starts_with("CANNABIS_") || env.iter().any(|(n, _)| n == name) {
            return Err(format!(
                "environment variable {name:?}: not a plain name, or one the executor sets"
            ));
        }
        if value.contains('\0') {
            return Err(format!("environment variable {name:?}: a NUL in its value"));
        }
        env.push((name.clone(), value.clone()));
    }
    if !reservation.gpus.is_empty() {
        env.push(("NVIDIA_VISIBLE_DEVICES".into(), reservation.gpus.join(",")));
    }
    let spec = SandboxSpec {
        attempt_dir: dir.clone(),
        uid,
        gid: uid,
        work_bytes: reservation.storage_bytes,
        argv: command.argv,
        env,
        cwd: command.cwd,
        rlimits: sandbox::Rlimits {
            file_size: reservation.storage_bytes,
            open_files: 1024,
            processes: inner.as_root.then_some(reservation.processes),
        },
        seccomp: true,
        landlock: inner
            .layers
            .contains(&cannabis_protocol::IsolationLayer::Landlock),
        outputs: command.outputs,
        log_cap: inner.cfg.log_cap,
        program: inner.cfg.program.clone(),
        devices,
        loopback: request.loopback,
        checkpoint: request
            .task
            .checkpoint
            .as_ref()
            .map(|c| sandbox::CheckpointSpec {
                name: c.name.clone(),
                cap: c.max_bytes.min(reservation.storage_bytes),
                to: request.checkpoint_to.clone(),
            }),
    };
    // The cgroups are made while the zygote hands out the monitor; the monitor starts
    // nothing before it is inside them.
    let limits = CgroupLimits {
        memory_bytes: reservation.memory_bytes,
        swap_bytes: reservation.swap_bytes,
        processes: reservation.processes,
        cpu_millicores: reservation.cpu_millicores,
    };
    let (starting, cgroup) =
        sandbox::launch(&inner.launcher, &spec, as_uid.map(|u| (u, u)), || {
            inner.cgroups.create(&a.id, &limits)
        })
        .map_err(|e| e.to_string())?;
    // A monitor that is never told to enter ends when `starting` is dropped.
    let cgroup = cgroup.map_err(|e| e.to_string())?;
    let mut launch = starting.enter(&cgroup).map_err(|e| e.to_string())?;
    let checked = launch
        .wait_ready(Duration::from_secs(15))
        .map_err(|e| e.to_string())
        .and_then(|(pid, reported)| {
            sandbox::check_running(pid, &cgroup, &inner.cgroup_layers, &reported)
        });
    let check = match checked {
        Ok(c) => c,
        Err(e) => {
            launch.abort();
            return Err(e);
        }
    };
    let mut required: Vec<_> = adapter.isolation().to_vec();
    required.extend(request.task.requirements.isolation.iter().copied());
    if let Some(missing) = required.iter().find(|l| !check.layers.contains(l)) {
        launch.abort();
        return Err(format!(
            "required isolation {} is not in effect on the running sandbox",
            super::layer_name(*missing)
        ));
    }
    let monitor_pid = launch.monitor_pid();
    if request.hold {
        let held = inner
            .update(&a.id, |a| {
                a.monitor_pid = Some(monitor_pid);
                Ok(())
            })
            .map_err(|e| e.to_string())
            .and_then(|()| hold(inner, &a.id));
        if let Err(e) = held {
            launch.abort();
            return Err(e);
        }
    }
    let now = now_ms();
    let running = inner.update(&a.id, |a| {
        a.monitor_pid = Some(monitor_pid);
        a.to_running(now, check.layers.clone())
    });
    if let Err(e) = running {
        launch.abort();
        return Err(e.to_string());
    }
    inner.failpoint("running");
    // From here on the outcome is the monitor's to decide, from `exit.json` and the
    // cgroups: a `go` that got lost is recorded there as "aborted before start".
    if let Err(e) = launch.go() {
        eprintln!("executor: attempt {}: starting the command: {e}", a.id);
    }
    Ok(())
}

/// How often a held attempt looks whether it was released.
const HOLD_POLL: Duration = Duration::from_millis(20);

/// Waits, with the sandbox made and its command not started, until the attempt is
/// released; an error if it is stopped, its lease ends or the executor shuts down first.
fn hold(inner: &Inner, id: &str) -> Result<(), String> {
    loop {
        if inner.shutdown.load(Ordering::SeqCst) {
            return Err("the executor shut down before the held command started".into());
        }
        let (cancel, released, lease_until_ms) = inner
            .lock()
            .attempts
            .get(id)
            .map(|a| (a.cancel.clone(), a.released, a.lease_until_ms))
            .ok_or("the attempt is gone")?;
        if let Some((_, why)) = cancel {
            return Err(format!("stopped while held before its start: {why}"));
        }
        if released {
            return Ok(());
        }
        if now_ms() > lease_until_ms {
            return Err("the lease expired while the command was held before its start".into());
        }
        std::thread::sleep(HOLD_POLL);
    }
}

/// Watches a running attempt until its outcome is known.
fn monitor(inner: &Inner, a: &Attempt) -> Result<(), ExecError> {
    let id = &a.id;
    let dir = inner.attempt_dir(id);
    let cgroup = inner.cgroups.open(id);
    let mut killed = false;
    let mut empty_since: Option<Instant> = None;
    let mut exit_since: Option<Instant> = None;
    loop {
        if inner.shutdown.load(Ordering::SeqCst) {
            return Ok(());
        }
        let Some(a) = inner.lock().attempts.get(id).cloned() else {
            return Ok(());
        };
        if a.state != AttemptState::Running {
            return Ok(());
        }
        let now = now_ms();
        let lease_ms = inner.cfg.local_lease_ms;
        if a.request.renewal == Renewal::Local && a.lease_until_ms < now + lease_ms / 2 {
            inner.renew(id, now + lease_ms)?;
            continue;
        }
        if a.cancel.is_none() && now > a.lease_until_ms {
            inner.update(id, |a| Ok(a.record_cancel(now, LEASE_EXPIRED)))?;
            continue;
        }
        if a.cancel.is_some() && !killed {
            cgroup.kill();
            killed = true;
        }
        let empty = cgroup.is_empty();
        let exit = read_exit(&dir);
        let settled = match &exit {
            // The monitor wrote its record; give it a moment to exit.
            Some(_) => {
                empty
                    || exit_since.get_or_insert_with(Instant::now).elapsed()
                        > Duration::from_secs(2)
            }
            None if empty => {
                empty_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_millis(300)
            }
            None => {
                empty_since = None;
                false
            }
        };
        if settled {
            let oom = cgroup.oom_killed();
            let usage = cgroup.usage();
            let (outcome, reason, result) = outcome(inner, &a, exit.as_ref(), oom);
            return inner.update(id, |a| {
                a.exit = exit.clone();
                a.usage = Some(usage);
                a.result = result.clone();
                a.finish(now_ms(), outcome, reason.clone())
            });
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The outcome from what the sandbox recorded (if anything) and whether a stop was
/// recorded before.
fn outcome(
    inner: &Inner,
    a: &Attempt,
    exit: Option<&ExitRecord>,
    oom: bool,
) -> (AttemptState, Option<String>, Option<SyntheticResult>) {
    let oom_note = if oom { " (memory limit reached)" } else { "" };
    let stopped = |why: &str| {
        if why == LEASE_EXPIRED {
            (
                AttemptState::Failed,
                Some("the lease expired; the command was stopped locally".to_string()),
                None,
            )
        } else {
            (AttemptState::Cancelled, Some(why.to_string()), None)
        }
    };
    let Some(exit) = exit else {
        return match &a.cancel {
            Some((_, why)) => stopped(why),
            None if oom => (
                AttemptState::Failed,
                Some("memory limit reached: the kernel killed the sandbox".into()),
                None,
            ),
            None => (
                AttemptState::Unknown,
                Some(format!(
                    "the sandbox ended without a record of how; not retried automatically{}",
                    sandbox_log_tail(&inner.attempt_dir(&a.id))
                )),
                None,
            ),
        };
    };
    let clean = exit.started
        && exit.ended_by.is_none()
        && exit.code == Some(0)
        && exit.refused_outputs.is_empty();
    if let Some((at, why)) = &a.cancel {
        // A completion observed before the stop stays a completion.
        if !(clean && exit.ended_at_ms <= *at) {
            return stopped(why);
        }
    }
    if !exit.started {
        let why = exit
            .ended_by
            .clone()
            .unwrap_or_else(|| "the command never started".into());
        return (AttemptState::Failed, Some(why), None);
    }
    if let Some(by) = &exit.ended_by {
        let why = if by == LEASE_EXPIRED {
            "the lease expired; the sandbox stopped the command".to_string()
        } else {
            by.clone()
        };
        return (AttemptState::Failed, Some(why), None);
    }
    if let Some(s) = exit.signal {
        return (
            AttemptState::Failed,
            Some(format!(
                "killed by signal {s}{oom_note}{}",
                stderr_tail(&inner.attempt_dir(&a.id))
            )),
            None,
        );
    }
    match exit.code {
        Some(0) => {}
        Some(c) => {
            return (
                AttemptState::Failed,
                Some(format!(
                    "exit code {c}{oom_note}{}",
                    stderr_tail(&inner.attempt_dir(&a.id))
                )),
                None,
            );
        }
        None => return (AttemptState::Failed, Some("no exit status".into()), None),
    }
    if let Some((name, why)) = exit.refused_outputs.first() {
        return (
            AttemptState::Failed,
            Some(format!("output {name:?}: {why}")),
            None,
        );
    }
    let interpreted = adapter::adapter(a.request.task.workload.adapter)
        .ok_or_else(|| "no adapter".to_string())
        .and_then(|ad| ad.interpret(&a.request, &inner.attempt_dir(&a.id)));
    match interpreted {
        Ok(result) => (AttemptState::Completed, None, result),
        Err(why) => (AttemptState::Failed, Some(why), None),
    }
}

/// Kills what is left, confirms the tree empty, removes cgroups and storage; releases the
/// reservation only if all of that is confirmed, else quarantines it.
fn cleanup(inner: &Inner, a: &Attempt) -> Result<(), ExecError> {
    let id = &a.id;
    if a.reservation.is_none() {
        return inner.update(id, |a| a.release(now_ms()));
    }
    let now = now_ms();
    inner.update(id, |a| {
        if !a.history.last().is_some_and(|h| h.1.starts_with("cleanup")) {
            a.history.push((
                now,
                "cleanup: killing what is left, removing storage".into(),
            ));
        }
        Ok(())
    })?;
    inner.failpoint("cleanup");
    let cgroup = inner.cgroups.open(id);
    let why = if !cgroup.kill_and_confirm(Duration::from_secs(5)) {
        Some(format!(
            "processes still in the cgroup after kill: {:?}",
            cgroup.pids()
        ))
    } else if let Err(e) = cgroup.remove() {
        Some(e.to_string())
    } else if let Err(e) = remove_storage(&inner.attempt_dir(id)) {
        Some(format!("storage not removed: {e}"))
    } else {
        None
    };
    let now = now_ms();
    inner.update(id, |a| match why.clone() {
        None => a.release(now),
        Some(why) => a.quarantine(now, why),
    })
}

/// The last line the sandbox monitor logged, as `" (sandbox: ...)"`, or nothing.
fn sandbox_log_tail(dir: &Path) -> String {
    last_line(dir, files::SANDBOX_LOG, |l| l.starts_with("note: run with"))
        .map_or_else(String::new, |l| format!(" (sandbox: {l})"))
}

/// The last line the command wrote on its standard error, as `": ..."`, or nothing: why
/// it failed, in its own words.
fn stderr_tail(dir: &Path) -> String {
    last_line(dir, files::STDERR, |_| false).map_or_else(String::new, |l| format!(": {l}"))
}

/// The last non-empty line of the last 64 KiB of `name` beneath the attempt directory
/// `dir`, unless `skip` says to look further back: trimmed, without control characters,
/// at most 300 characters.
fn last_line(dir: &Path, name: &str, skip: impl Fn(&str) -> bool) -> Option<String> {
    use std::io::{Seek as _, SeekFrom};
    const TAIL: u64 = 64 * 1024;
    let mut bytes = Vec::new();
    if let Ok(mut f) = super::open_beneath(dir, name) {
        let len = f.metadata().map_or(0, |m| m.len());
        if f.seek(SeekFrom::Start(len.saturating_sub(TAIL))).is_ok() {
            let _ = f.take(TAIL).read_to_end(&mut bytes);
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty() && !skip(l))
        .map(|l| l.chars().filter(|c| !c.is_control()).take(300).collect())
}

fn read_exit(dir: &Path) -> Option<ExitRecord> {
    let mut bytes = Vec::new();
    super::open_beneath(dir, files::EXIT)
        .ok()?
        .take(1 << 20)
        .read_to_end(&mut bytes)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Creates an attempt directory with its parts, owned by the sandbox uid when given.
pub(super) fn make_attempt_dir(dir: &Path, uid: Option<u32>) -> Result<(), String> {
    for sub in [
        "",
        files::INPUTS,
        files::BUNDLE,
        files::OUTPUTS,
        files::ROOT,
    ] {
        let d = dir.join(sub);
        fs::create_dir_all(&d).map_err(|e| format!("creating {}: {e}", d.display()))?;
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", d.display()))?;
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    if let Some(uid) = uid {
        chown_tree(dir, uid).map_err(|e| format!("chown {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Removes what the attempt used for work (staged inputs, the bundle, the root mount
/// point, the checkpoint's copies and the one it resumed from); keeps the logs, `exit.json` and the copied outputs.
pub(super) fn remove_storage(dir: &Path) -> io::Result<()> {
    for sub in [
        files::INPUTS,
        files::BUNDLE,
        files::ROOT,
        files::CHECKPOINTS,
    ] {
        match fs::remove_dir_all(dir.join(sub)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    match fs::remove_file(dir.join(files::RESUME)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn chown_tree(path: &Path, uid: u32) -> io::Result<()> {
    let id = Some(nix::unistd::Uid::from_raw(uid));
    let gid = Some(nix::unistd::Gid::from_raw(uid));
    nix::unistd::fchownat(
        nix::fcntl::AT_FDCWD,
        path,
        id,
        gid,
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(io::Error::from)?;
    if fs::symlink_metadata(path)?.is_dir() {
        for entry in fs::read_dir(path)? {
            chown_tree(&entry?.path(), uid)?;
        }
    }
    Ok(())
}

/// Copies `from` to `to`, returning the SHA-256 and size of what was copied.
fn copy_hashed(from: &Path, to: &Path) -> io::Result<(Digest, u64)> {
    let mut src = File::open(from)?;
    let mut dst = File::create(to)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut size = 0u64;
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
        size += n as u64;
    }
    dst.sync_all()?;
    Ok((Digest(h.finalize().into()), size))
}

/// Checks the bundle against its digest, then unpacks it (a tar file) into `into`. The
/// digest is checked on the file as read, before a single entry is unpacked.
fn stage_bundle(bundle: &Path, digest: &Digest, into: &Path) -> Result<(), String> {
    let mut f =
        File::open(bundle).map_err(|e| format!("opening the bundle {}: {e}", bundle.display()))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("reading the bundle: {e}"))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let got = Digest(h.finalize().into());
    if got != *digest {
        return Err(format!(
            "the bundle's digest is {got}, the task pins {digest}: refusing to run it"
        ));
    }
    // Unpack from a private copy so that the file cannot change between check and use.
    let copy = into.with_extension("tar");
    let (again, _) = copy_hashed(bundle, &copy).map_err(|e| format!("copying the bundle: {e}"))?;
    if again != *digest {
        let _ = fs::remove_file(&copy);
        return Err("the bundle changed while it was being staged".into());
    }
    let file = File::open(&copy).map_err(|e| e.to_string())?;
    let mut archive = tar::Archive::new(file);
    archive.set_preserve_permissions(false);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(false);
    let result = archive
        .unpack(into)
        .map_err(|e| format!("unpacking the bundle: {e}"));
    let _ = fs::remove_file(&copy);
    result
}
