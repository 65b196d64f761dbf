//! The executor for real: the sandbox (this binary's stages), cgroups, the node's store as
//! the journal. Escapes that must fail, limits, stops, owner controls, durable refusals,
//! output reads, and the synthetic task.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use cannabis_node::store::Store;
use cannabis_protocol::{
    AdapterKind, Amount, Digest, InputRef, OutputDecl, OutputRights, Requirements, Resources,
    TaskInput, TaskSpec, Workload,
};
use cannabis_runtime::exec::{
    Attempt, AttemptRequest, AttemptState, Ceilings, Cleanup, Control, Executor, ExecutorConfig,
    LimitsFile, Renewal,
};

/// A directory sandbox uids can reach (tempdirs are 0700).
pub(crate) fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    dir
}

struct Setup {
    dir: tempfile::TempDir,
    ex: Executor,
}

fn config(dir: &Path, owner: &LimitsFile) -> ExecutorConfig {
    let machine = cannabis_node::exec::machine_limits(dir, vec![]);
    let ceilings = Ceilings::load(Path::new("/nonexistent/ceilings.toml"), &machine).unwrap();
    let owner = ceilings.owner(owner).unwrap();
    let mut cfg = ExecutorConfig::new(
        dir.join("exec"),
        PathBuf::from(env!("CARGO_BIN_EXE_cannabis")),
        ceilings,
        owner,
    );
    cfg.log_cap = 64 * 1024;
    cfg
}

fn open_executor(dir: &Path, store: &Arc<Store>) -> Executor {
    Executor::open(config(dir, &LimitsFile::default()), store.clone()).unwrap()
}

fn setup() -> Setup {
    let dir = open_dir();
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    let ex = open_executor(dir.path(), &store);
    Setup { dir, ex }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn task(adapter: AdapterKind, entrypoint: &[&str]) -> TaskSpec {
    TaskSpec {
        restarts: 0,
        name: "t".into(),
        workload: Workload {
            adapter,
            digest: Digest([0; 32]),
            entrypoint: entrypoint.iter().map(|s| s.to_string()).collect(),
        },
        inputs: Vec::new(),
        outputs: Vec::new(),
        resources: Resources {
            cpu_millicores: 1000,
            memory_bytes: 256 << 20,
            swap_bytes: 0,
            processes: 64,
            storage_bytes: 4 << 20,
            gpus: 0,
        },
        requirements: Requirements::default(),
        group_size: 1,
        depends_on: Vec::new(),
        budget: Amount(0),
        checkpoint: None,
    }
}

/// A bundle (a tar file) holding `run.sh` with `script`, and a process task running it.
pub(crate) fn script_request(dir: &Path, id: &str, script: &str) -> AttemptRequest {
    let src = dir.join(format!("bundle-{id}"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("run.sh"), script).unwrap();
    let tar = dir.join(format!("bundle-{id}.tar"));
    let ok = Command::new("tar")
        .arg("cf")
        .arg(&tar)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar");
    let mut t = task(AdapterKind::Process, &["sh", "run.sh"]);
    t.workload.digest = Digest::of(&std::fs::read(&tar).unwrap());
    request(id, t, Some(tar))
}

fn request(id: &str, task: TaskSpec, bundle: Option<PathBuf>) -> AttemptRequest {
    AttemptRequest {
        request_id: id.into(),
        task,
        bundle,
        inputs: Vec::new(),
        seed: Some(Digest::of(id.as_bytes())),
        lease_until_ms: now_ms() + 15_000,
        renewal: Renewal::Local,
        env: Vec::new(),
        loopback: false,
        hold: false,
        resume: None,
        checkpoint_to: None,
    }
}

fn run(ex: &Executor, req: AttemptRequest) -> Attempt {
    let a = ex.submit(req).unwrap();
    let a = ex.wait(&a.id, Duration::from_secs(60)).unwrap();
    assert!(a.state.is_final(), "not final: {a:#?}");
    a
}

fn read_all(ex: &Executor, id: &str, name: &str) -> String {
    try_read_all(ex, id, name).unwrap()
}

fn try_read_all(ex: &Executor, id: &str, name: &str) -> Result<String, String> {
    try_read_bytes(ex, id, name).map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn try_read_bytes(ex: &Executor, id: &str, name: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut offset = 0;
    loop {
        let c = ex
            .read_output(id, name, offset, 1 << 20)
            .map_err(|e| e.to_string())?;
        out.extend_from_slice(&c.data);
        offset = c.next_offset;
        if c.data.is_empty() {
            return Ok(out);
        }
    }
}

fn has_python() -> bool {
    Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn the_sandbox_enforces_every_layer_and_a_command_completes() {
    let s = setup();
    let has = |layer: &str| {
        s.ex.layers()
            .iter()
            .any(|l| cannabis_runtime::exec::layer_name(*l) == layer)
    };
    for layer in [
        "user-namespace",
        "mount-namespace",
        "pid-namespace",
        "network-namespace",
        "ipc-uts-namespace",
        "no-privileges",
        "seccomp",
        "bounded-workdir",
        "rlimits",
    ] {
        assert!(has(layer), "{layer} missing from {:?}", s.ex.layers());
    }
    // A cgroup layer is advertised only if the host found the probe's pid 1 inside the
    // attempt's cgroup (the monitor moves itself in before it forks anything).
    let described = s.ex.cgroups();
    for (controller, layer) in [
        ("memory", "cgroup-memory"),
        ("pids", "cgroup-pids"),
        ("cpu", "cgroup-cpu"),
    ] {
        if described
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|w| w == controller)
        {
            assert!(
                has(layer),
                "{layer} missing from {:?} with cgroups {described}",
                s.ex.layers()
            );
        }
    }
    let mut req = script_request(
        s.dir.path(),
        "hello",
        "echo hello; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; echo out > $CANNABIS_WORK/result.txt",
    );
    req.task.outputs.push(OutputDecl {
        name: "result.txt".into(),
        max_bytes: 100,
        rights: OutputRights::Exclusive,
    });
    let a = run(&s.ex, req);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(a.cleanup, Cleanup::Released);
    let out = read_all(&s.ex, &a.id, "stdout");
    assert!(out.starts_with("hello\n"), "{out}");
    assert!(out.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    assert!(out.contains("Seccomp:\t2"), "{out}");
    assert_eq!(read_all(&s.ex, &a.id, "result.txt"), "out\n");
    assert_eq!(s.ex.reserved().memory_bytes, 0, "capacity released");
}

#[test]
fn writing_outside_the_work_dir_fails() {
    let s = setup();
    let a = run(
        &s.ex,
        script_request(
            s.dir.path(),
            "write",
            "for p in /x /etc/x /bundle/x /inputs/x /usr/x /proc/x /.cannabis/x; do \
               if echo x > $p 2>/dev/null; then echo \"WROTE $p\"; else echo \"refused $p\"; fi; done; \
             echo ok > /work/fine && echo ok > /tmp/fine && echo wrote-work",
        ),
    );
    let out = read_all(&s.ex, &a.id, "stdout");
    assert!(!out.contains("WROTE"), "{out}");
    assert_eq!(out.matches("refused").count(), 7, "{out}");
    assert!(out.contains("wrote-work"), "{out}");
}

#[test]
fn reading_a_file_that_is_not_an_input_fails() {
    let s = setup();
    // A file on the host, readable by everyone, outside the inputs.
    let secret = s.dir.path().join("secret.txt");
    std::fs::write(&secret, "host secret").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let store_file = s.dir.path().join("node.redb");
    let script = format!(
        "for p in {} {} /etc/shadow /root/.bashrc /proc/1/environ; do \
           if cat $p >/dev/null 2>&1; then echo \"READ $p\"; else echo \"refused $p\"; fi; done; \
         cat /inputs/data.txt",
        secret.display(),
        store_file.display()
    );
    let mut req = script_request(s.dir.path(), "read", &script);
    let input = s.dir.path().join("data.txt");
    std::fs::write(&input, "the input").unwrap();
    req.task.inputs.push(TaskInput::Staged(InputRef {
        name: "data.txt".into(),
        digest: Digest::of(b"the input"),
        size_bytes: 9,
    }));
    req.inputs.push(("data.txt".into(), input));
    let a = run(&s.ex, req);
    let out = read_all(&s.ex, &a.id, "stdout");
    assert!(!out.contains("READ"), "{out}");
    assert_eq!(out.matches("refused").count(), 5, "{out}");
    assert!(
        out.ends_with("the input"),
        "the staged input is readable: {out}"
    );
}

#[test]
fn tcp_and_udp_sockets_are_refused() {
    if !has_python() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    let s = setup();
    let a = run(
        &s.ex,
        script_request(
            s.dir.path(),
            "net",
            concat!(
                "python3 - <<'EOF'\n",
                "import socket\n",
                "for name, fam, kind in [('tcp4', socket.AF_INET, socket.SOCK_STREAM), ('udp4', socket.AF_INET, socket.SOCK_DGRAM), ('tcp6', socket.AF_INET6, socket.SOCK_STREAM), ('udp6', socket.AF_INET6, socket.SOCK_DGRAM), ('raw', socket.AF_PACKET, socket.SOCK_RAW)]:\n",
                "    try:\n",
                "        s = socket.socket(fam, kind)\n",
                "        s.connect(('127.0.0.1', 9) if fam == socket.AF_INET else ('::1', 9))\n",
                "        print('OPEN', name)\n",
                "    except Exception as e:\n",
                "        print('refused', name, type(e).__name__)\n",
                "EOF\n",
            ),
        ),
    );
    let out = read_all(&s.ex, &a.id, "stdout");
    assert!(!out.contains("OPEN"), "{out}");
    assert_eq!(out.matches("refused").count(), 5, "{out}");
    assert!(out.contains("refused tcp4 PermissionError"), "{out}");
}

#[test]
fn a_callers_environment_reaches_the_workload_but_cannot_replace_the_executors() {
    let s = setup();
    let mut req = script_request(
        s.dir.path(),
        "env",
        "echo \"rank=$RANK world=$WORLD_SIZE\"\n",
    );
    req.env = vec![
        ("RANK".into(), "2".into()),
        ("WORLD_SIZE".into(), "3".into()),
    ];
    let a = run(&s.ex, req);
    assert_eq!(read_all(&s.ex, &a.id, "stdout"), "rank=2 world=3\n");
    for bad in ["CANNABIS_WORK", "PATH", "A=B", "", "1X"] {
        let mut req = script_request(s.dir.path(), &format!("bad-env-{}", bad.len()), "true\n");
        req.env = vec![(bad.into(), "x".into())];
        let a = run(&s.ex, req);
        assert_eq!(a.state, AttemptState::Failed, "{bad:?}: {a:#?}");
        assert!(
            a.reason
                .as_deref()
                .unwrap_or("")
                .contains("environment variable"),
            "{bad:?}: {:?}",
            a.reason
        );
    }
}

/// Waits until the held attempt `id` has its sandbox (a monitor pid), still preparing.
fn wait_held(ex: &Executor, id: &str) -> Attempt {
    for _ in 0..500 {
        let a = ex.get(id).unwrap();
        if a.monitor_pid.is_some() || a.state.is_final() {
            return a;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("attempt {id} never got its sandbox");
}

#[test]
fn a_held_sandbox_starts_only_when_released_and_one_stopped_while_held_never_starts() {
    let s = setup();
    let mut req = script_request(s.dir.path(), "held", "echo started\n");
    req.hold = true;
    let a = s.ex.submit(req).unwrap();
    let held = wait_held(&s.ex, &a.id);
    assert_eq!(held.state, AttemptState::Preparing, "{held:#?}");
    std::thread::sleep(Duration::from_millis(500));
    let still = s.ex.get(&a.id).unwrap();
    assert_eq!(
        still.state,
        AttemptState::Preparing,
        "it started unreleased"
    );
    assert_eq!(
        read_all(&s.ex, &a.id, "stdout"),
        "",
        "the command ran unreleased"
    );
    s.ex.release(&a.id).unwrap();
    let a = s.ex.wait(&a.id, Duration::from_secs(60)).unwrap();
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(read_all(&s.ex, &a.id, "stdout"), "started\n");

    let mut req = script_request(s.dir.path(), "held-stopped", "echo started\n");
    req.hold = true;
    let a = s.ex.submit(req).unwrap();
    wait_held(&s.ex, &a.id);
    s.ex.stop(&a.id, "gang start: rank 1 not ready within 120s")
        .unwrap();
    let a = s.ex.wait(&a.id, Duration::from_secs(60)).unwrap();
    assert_eq!(a.state, AttemptState::Cancelled, "{a:#?}");
    let reason = a.reason.clone().unwrap_or_default();
    assert!(
        reason.contains("stopped while held") && reason.contains("rank 1 not ready"),
        "{reason}"
    );
    assert!(!a.exit.as_ref().is_some_and(|e| e.started), "{a:#?}");
}

#[test]
fn a_loopback_sandbox_has_tcp_on_its_own_loopback_and_no_other_interface() {
    if !has_python() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: a sandbox's own loopback is brought up by a root executor");
        return;
    }
    let s = setup();
    // What a group's rank 0 does (a TCP service on 127.0.0.1) and a packet socket, which
    // stays refused.
    let mut req = script_request(
        s.dir.path(),
        "loopback",
        concat!(
            "python3 - <<'EOF'\n",
            "import socket\n",
            "names = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]\n",
            "print('interfaces', sorted(names))\n",
            "print('ifnames', sorted(n for _, n in socket.if_nameindex()))\n",
            "srv = socket.socket(); srv.bind(('127.0.0.1', 29500)); srv.listen(1)\n",
            "c = socket.create_connection(('127.0.0.1', 29500)); a, _ = srv.accept()\n",
            "c.sendall(b'ping'); print('tcp', a.recv(4).decode())\n",
            "try:\n",
            "    socket.socket(socket.AF_PACKET, socket.SOCK_RAW); print('OPEN raw')\n",
            "except Exception as e:\n",
            "    print('refused raw', type(e).__name__)\n",
            "EOF\n",
        ),
    );
    req.loopback = true;
    let a = run(&s.ex, req);
    let out = read_all(&s.ex, &a.id, "stdout");
    let err = read_all(&s.ex, &a.id, "stderr");
    assert!(out.contains("interfaces ['lo']"), "{out}{err}");
    // Routing netlink (how a program lists its interfaces) works there too.
    assert!(out.contains("ifnames ['lo']"), "{out}{err}");
    assert!(out.contains("tcp ping"), "{out}");
    assert!(out.contains("refused raw"), "{out}");
}

#[test]
fn the_seccomp_filter_refuses_namespaces_clone3_and_x32_but_not_fork() {
    if !has_python() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    // Call numbers that differ between architectures are only tried on x86-64.
    let x86_64 = if cfg!(target_arch = "x86_64") {
        concat!(
            "call('clone-newuser', 56, 0x10000000 | 17, 0, 0, 0, 0)\n",
            "call('x32-getpid', 0x40000000 | 39)\n",
        )
    } else {
        ""
    };
    let script = format!(
        concat!(
            "python3 - <<'EOF'\n",
            "import ctypes, os, socket\n",
            "libc = ctypes.CDLL(None, use_errno=True)\n",
            "def call(name, *args):\n",
            "    r = libc.syscall(*args)\n",
            "    print(name, r, ctypes.get_errno() if r < 0 else 0)\n",
            "r = libc.unshare(0x10000000)\n",
            "print('unshare', r, ctypes.get_errno())\n",
            "call('clone3', 435, None, 0)\n",
            "{}",
            "socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()\n",
            "print('unix-socket ok')\n",
            "pid = os.fork()\n",
            "if pid == 0:\n",
            "    os._exit(7)\n",
            "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n",
            "EOF\n",
        ),
        x86_64
    );
    let s = setup();
    let a = run(&s.ex, script_request(s.dir.path(), "seccomp", &script));
    let out = read_all(&s.ex, &a.id, "stdout");
    assert_eq!(a.state, AttemptState::Completed, "{a:#?} {out}");
    assert!(
        out.contains("unshare -1 1\n"),
        "unshare must get EPERM: {out}"
    );
    assert!(
        out.contains("clone3 -1 38\n"),
        "clone3 must get ENOSYS: {out}"
    );
    if cfg!(target_arch = "x86_64") {
        assert!(out.contains("clone-newuser -1 1\n"), "{out}");
        assert!(
            out.contains("x32-getpid -1 1\n"),
            "x32 calls must get EPERM: {out}"
        );
    }
    assert!(out.contains("unix-socket ok"), "{out}");
    assert!(out.contains("fork 7"), "a plain fork works: {out}");
}

#[test]
fn exceeding_memory_gets_the_command_killed() {
    if !has_python() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    let s = setup();
    let mut req = script_request(
        s.dir.path(),
        "mem",
        "python3 -c \"x = bytearray(300 * 1024 * 1024); x[::4096] = b'1' * len(x[::4096]); print('ALLOCATED')\"",
    );
    req.task.resources.memory_bytes = 64 << 20;
    let a = run(&s.ex, req);
    assert_eq!(a.state, AttemptState::Failed, "{a:#?}");
    assert!(!read_all(&s.ex, &a.id, "stdout").contains("ALLOCATED"));
    let reason = a.reason.unwrap_or_default();
    assert!(
        reason.contains("memory limit reached") || reason.contains("MemoryError"),
        "{reason}"
    );
    assert_eq!(a.cleanup, Cleanup::Released);
}

#[test]
fn cpu_time_and_peak_memory_are_counted_by_the_cgroups() {
    let s = setup();
    // A busy shell loop for CPU time, and a 24 MiB string held in a shell variable.
    let req = script_request(
        s.dir.path(),
        "usage",
        "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; \
         x=$(head -c 25165824 /dev/zero | tr '\\0' a); echo ${#x}",
    );
    let a = run(&s.ex, req);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(read_all(&s.ex, &a.id, "stdout").trim(), "25165824");
    let usage = a.usage.expect("usage is read when the attempt ends");
    let cpu_ms = usage.cpu_ms.expect("this host counts CPU time");
    let exit = a.exit.as_ref().unwrap();
    let wall_ms = exit.ended_at_ms - exit.started_at_ms;
    // One core's quota: CPU time is real and no more than the wall time allows.
    assert!(cpu_ms >= 100, "cpu {cpu_ms} ms");
    assert!(
        cpu_ms <= wall_ms + 200,
        "cpu {cpu_ms} ms over wall {wall_ms} ms"
    );
    let peak = usage.peak_memory_bytes.expect("this host counts memory");
    assert!(peak >= 24 << 20, "peak {peak} bytes");
    assert!(peak <= 256 << 20, "peak {peak} bytes over the limit");
}

#[test]
fn a_fork_bomb_is_contained_and_cleaned_up() {
    let s = setup();
    let mut req = script_request(
        s.dir.path(),
        "bomb",
        "bomb() { bomb | bomb & }; bomb; sleep 2; echo after",
    );
    req.task.resources.processes = 32;
    let a = run(&s.ex, req);
    assert_eq!(a.cleanup, Cleanup::Released, "tree confirmed empty: {a:#?}");
    let err = read_all(&s.ex, &a.id, "stderr");
    assert!(
        err.contains("fork") || err.contains("Resource temporarily unavailable"),
        "forks were refused: {err}"
    );
    // The host is fine: a fresh attempt runs.
    let b = run(
        &s.ex,
        script_request(s.dir.path(), "after-bomb", "echo fine"),
    );
    assert_eq!(b.state, AttemptState::Completed);
}

#[test]
fn exceeding_the_work_dir_size_fails() {
    let s = setup();
    let mut req = script_request(
        s.dir.path(),
        "disk",
        // Files each under the file-size rlimit: only the work directory's size stops them.
        "for i in 1 2 3 4; do dd if=/dev/zero of=$CANNABIS_WORK/f$i bs=1M count=1 || exit 1; done; echo FILLED",
    );
    req.task.resources.storage_bytes = 2 << 20;
    let a = run(&s.ex, req);
    assert_eq!(
        a.state,
        AttemptState::Failed,
        "{a:#?}\n{}",
        read_all(&s.ex, &a.id, "stderr")
    );
    assert!(!read_all(&s.ex, &a.id, "stdout").contains("FILLED"));
    let err = read_all(&s.ex, &a.id, "stderr");
    assert!(err.contains("No space left on device"), "{err}");
}

#[test]
fn an_output_bomb_is_capped() {
    let s = setup();
    let mut req = script_request(
        s.dir.path(),
        "outbomb",
        "head -c 3000000 /dev/zero; head -c 5000 /dev/zero > $CANNABIS_WORK/o.bin",
    );
    req.task.outputs.push(OutputDecl {
        name: "o.bin".into(),
        max_bytes: 1000,
        rights: OutputRights::Exclusive,
    });
    let a = run(&s.ex, req);
    let exit = a.exit.clone().unwrap();
    assert_eq!(exit.stdout.kept, 64 * 1024, "kept up to the cap");
    assert_eq!(exit.stdout.kept + exit.stdout.dropped, 3_000_000);
    assert_eq!(
        a.state,
        AttemptState::Failed,
        "an oversized output fails: {a:#?}"
    );
    assert!(a.reason.unwrap().contains("o.bin"));
    assert!(
        s.ex.read_output(&a.id, "o.bin", 0, 10).is_err(),
        "never copied"
    );
}

#[test]
fn a_stop_kills_the_tree_and_nothing_runs_past_it() {
    let s = setup();
    let a =
        s.ex.submit(script_request(
            s.dir.path(),
            "long",
            "echo started; sleep 600 & sleep 600; echo PAST",
        ))
        .unwrap();
    wait_for(|| try_read_all(&s.ex, &a.id, "stdout").is_ok_and(|o| o.contains("started")));
    let stopped = s.ex.stop(&a.id, "stopped by the owner").unwrap();
    assert!(stopped.cancel.is_some(), "recorded before acting");
    let a = s.ex.wait(&a.id, Duration::from_secs(20)).unwrap();
    assert_eq!(a.state, AttemptState::Cancelled, "{a:#?}");
    assert_eq!(a.cleanup, Cleanup::Released);
    assert!(!read_all(&s.ex, &a.id, "stdout").contains("PAST"));
    // A stop after the outcome keeps it.
    let again = s.ex.stop(&a.id, "late").unwrap();
    assert_eq!(again.state, AttemptState::Cancelled);
    assert_eq!(again.history.len(), a.history.len());
}

#[test]
fn a_daemonized_grandchild_is_killed_and_cleanup_confirmed() {
    let s = setup();
    let marker = "cannabis-daemon-marker-7f3a";
    let a = run(
        &s.ex,
        script_request(
            s.dir.path(),
            "daemon",
            &format!(
                "setsid sh -c 'exec -a {marker} sleep 600' </dev/null >/dev/null 2>&1 & echo spawned"
            ),
        ),
    );
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(a.cleanup, Cleanup::Released, "{a:#?}");
    let left = Command::new("pgrep")
        .arg("-f")
        .arg(marker)
        .output()
        .unwrap();
    assert!(
        left.stdout.is_empty(),
        "the grandchild survived: {}",
        String::from_utf8_lossy(&left.stdout)
    );
}

#[test]
fn stop_after_completion_keeps_completed() {
    let s = setup();
    let a = run(&s.ex, script_request(s.dir.path(), "done", "echo done"));
    assert_eq!(a.state, AttemptState::Completed);
    let b = s.ex.stop(&a.id, "too late").unwrap();
    assert_eq!(b.state, AttemptState::Completed);
    assert_eq!(b.cancel, None);
}

#[test]
fn a_refused_request_stays_refused_even_after_resume_and_restart() {
    let dir = open_dir();
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    let ex = open_executor(dir.path(), &store);
    ex.set_control(Control::Paused).unwrap();
    let req = script_request(dir.path(), "paused-req", "echo RAN > $CANNABIS_WORK/x");
    let refused = ex.submit(req.clone()).unwrap();
    assert!(refused.refused);
    assert_eq!(refused.state, AttemptState::Failed);
    assert!(
        refused.reason.as_deref().unwrap().contains("paused"),
        "{refused:#?}"
    );
    ex.set_control(Control::Active).unwrap();
    let again = ex.submit(req.clone()).unwrap();
    assert_eq!(
        again.id, refused.id,
        "the same request gets the same attempt"
    );
    assert!(again.refused);
    // Too big for the machine: refused, and that too survives a restart.
    let mut huge = script_request(dir.path(), "huge", "echo RAN");
    huge.task.resources.memory_bytes = u64::MAX / 2;
    let big = ex.submit(huge.clone()).unwrap();
    assert!(
        big.reason.as_deref().unwrap().contains("memory: asks"),
        "{big:#?}"
    );
    ex.shutdown();
    drop(ex);
    let ex = open_executor(dir.path(), &store);
    for (r, id) in [(req, &refused.id), (huge, &big.id)] {
        let a = ex.submit(r).unwrap();
        assert_eq!(&a.id, id);
        assert!(a.refused);
        assert!(a.exit.is_none(), "never ran");
    }
    // Retrying a refusal is not allowed either.
    assert!(ex.retry(&refused.id, "new".into()).is_err());
}

#[test]
fn pause_drain_stop_and_resume_hold_across_a_restart() {
    let dir = open_dir();
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    let ex = open_executor(dir.path(), &store);
    // Drain: running work finishes, nothing new is taken.
    let running = ex
        .submit(script_request(
            dir.path(),
            "drain-1",
            "sleep 1; echo finished",
        ))
        .unwrap();
    ex.set_control(Control::Draining).unwrap();
    let refused = ex
        .submit(script_request(dir.path(), "drain-2", "echo x"))
        .unwrap();
    assert!(refused.reason.as_deref().unwrap().contains("draining"));
    let done = ex.wait(&running.id, Duration::from_secs(30)).unwrap();
    assert_eq!(done.state, AttemptState::Completed, "drain lets it finish");

    // Stop: recorded, then killed; survives a restart.
    ex.set_control(Control::Active).unwrap();
    let long = ex
        .submit(script_request(dir.path(), "stop-1", "echo up; sleep 600"))
        .unwrap();
    wait_for(|| try_read_all(&ex, &long.id, "stdout").is_ok_and(|o| o.contains("up")));
    ex.set_control(Control::Stopped).unwrap();
    let stopped = ex.wait(&long.id, Duration::from_secs(20)).unwrap();
    assert_eq!(stopped.state, AttemptState::Cancelled);
    ex.shutdown();
    drop(ex);
    let ex = open_executor(dir.path(), &store);
    assert_eq!(ex.control(), Control::Stopped, "kept across the restart");
    assert!(
        ex.submit(script_request(dir.path(), "stop-2", "echo x"))
            .unwrap()
            .refused
    );

    // Pause: admissions refused, running work goes on; resume takes work again.
    ex.set_control(Control::Paused).unwrap();
    ex.shutdown();
    drop(ex);
    let ex = open_executor(dir.path(), &store);
    assert_eq!(ex.control(), Control::Paused);
    ex.set_control(Control::Active).unwrap();
    let ok = run(&ex, script_request(dir.path(), "resumed", "echo ok"));
    assert_eq!(ok.state, AttemptState::Completed);
}

#[test]
fn output_reads_resume_at_offsets_and_refuse_everything_undeclared() {
    let s = setup();
    let mut req = script_request(
        s.dir.path(),
        "outputs",
        "seq 1 10000; printf hello > $CANNABIS_WORK/a.txt; ln -s /etc/passwd $CANNABIS_WORK/link; printf secret > $CANNABIS_WORK/undeclared",
    );
    for name in ["a.txt", "link"] {
        req.task.outputs.push(OutputDecl {
            name: name.into(),
            max_bytes: 1000,
            rights: OutputRights::Exclusive,
        });
    }
    let a = run(&s.ex, req);
    // stdout in small chunks, resumed at each offset, equals the whole.
    let whole = read_all(&s.ex, &a.id, "stdout");
    let mut pieces = Vec::new();
    let mut offset = 0;
    loop {
        let c = s.ex.read_output(&a.id, "stdout", offset, 777).unwrap();
        assert!(c.data.len() <= 777);
        assert_eq!(c.offset, offset);
        pieces.extend_from_slice(&c.data);
        offset = c.next_offset;
        if c.eof {
            break;
        }
    }
    assert_eq!(String::from_utf8(pieces).unwrap(), whole);
    assert!(whole.ends_with("10000\n"));
    let tail = s.ex.read_output(&a.id, "stdout", 4, 3).unwrap();
    assert_eq!(tail.data, b"3\n4", "from byte 4 of 1\\n2\\n3\\n4\\n");
    assert_eq!(read_all(&s.ex, &a.id, "a.txt"), "hello");
    for bad in [
        "undeclared",
        "../exit.json",
        "/etc/passwd",
        "outputs/a.txt",
        "lease",
        "sandbox.log",
        "a.txt/../../lease",
        "",
    ] {
        let e = s.ex.read_output(&a.id, bad, 0, 10).unwrap_err().to_string();
        assert!(e.contains("not an output"), "{bad:?}: {e}");
    }
    // A symlink output is refused when copied out, so it cannot be read either.
    assert!(
        a.exit
            .as_ref()
            .unwrap()
            .refused_outputs
            .iter()
            .any(|(n, why)| n == "link" && why.contains("symbolic link")),
        "{a:#?}"
    );
    assert!(s.ex.read_output(&a.id, "link", 0, 10).is_err());
}

#[test]
fn a_checkpoint_is_copied_out_each_time_it_changes_and_a_resumed_run_finds_it() {
    let s = setup();
    // Writes its state aside and renames it into place, as a checkpoint must be written.
    let script = r#"
if [ -f "$CANNABIS_WORK/state" ]; then echo "resumed at $(cat "$CANNABIS_WORK/state")"; fi
for n in 1 2; do
  echo "step $n" > "$CANNABIS_WORK/.state"; mv "$CANNABIS_WORK/.state" "$CANNABIS_WORK/state"
  sleep 1.5
done
sleep 2
"#;
    let checkpoint = OutputDecl {
        name: "state".into(),
        max_bytes: 1000,
        rights: OutputRights::Exclusive,
    };
    let requester = cannabis_protocol::DeliveryIdentity::from_secret([9; 32]);
    let mut req = script_request(s.dir.path(), "ckpt", script);
    req.task.checkpoint = Some(checkpoint.clone());
    req.checkpoint_to = Some(requester.recipient().to_string());
    let a = s.ex.submit(req).unwrap();
    // Each copy is sealed to the requester as it is read: only its key opens it.
    let open = |sealed: &[u8]| -> Vec<u8> {
        use std::io::Read as _;
        use std::str::FromStr as _;
        let id = age::x25519::Identity::from_str(&requester.to_age_string()).unwrap();
        let d = age::Decryptor::new(sealed).unwrap();
        let mut r = d
            .decrypt(std::iter::once(&id as &dyn age::Identity))
            .unwrap();
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        out
    };
    // While it runs, the newest copy is named by checkpoint/latest; the one before it
    // is removed once a newer one is sealed.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (copy, data) = loop {
        if let Ok(text) = try_read_all(&s.ex, &a.id, "checkpoint/latest") {
            let copy: cannabis_runtime::sandbox::CheckpointCopy =
                serde_json::from_str(&text).unwrap();
            if let Ok(sealed) = try_read_bytes(&s.ex, &a.id, &format!("checkpoint/{}", copy.seq)) {
                assert!(!sealed.windows(6).any(|w| w == b"step 1"), "sealed");
                let data = open(&sealed);
                if data == b"step 2\n" {
                    break (copy, data);
                }
            }
        }
        assert!(std::time::Instant::now() < deadline, "no copy of step 2");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(copy.seq >= 2, "{copy:?}");
    assert_eq!(copy.size, data.len() as u64);
    assert_eq!(copy.sha256, Digest::of(&data).to_string());
    assert!(try_read_all(&s.ex, &a.id, &format!("checkpoint/{}", copy.seq - 1)).is_err());
    let a = s.ex.wait(&a.id, Duration::from_secs(30)).unwrap();
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    // Its copies go with the attempt's other working files once it is over.
    let e = s.ex.read_output(&a.id, "checkpoint/latest", 0, 10);
    assert!(e.is_err(), "{e:?}");

    // Placed again: the checkpoint it resumes from is in its work directory.
    let kept = s.dir.path().join("kept-state");
    std::fs::write(&kept, "2").unwrap();
    let mut req = script_request(s.dir.path(), "ckpt-resumed", script);
    req.task.checkpoint = Some(checkpoint);
    req.resume = Some(kept.clone());
    let a = run(&s.ex, req);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    let out = read_all(&s.ex, &a.id, "stdout");
    assert!(out.starts_with("resumed at 2\n"), "{out}");
    // A checkpoint to resume from, for a task that declares none, is refused.
    let mut req = script_request(s.dir.path(), "ckpt-none", script);
    req.resume = Some(kept);
    let a = s.ex.submit(req).unwrap();
    assert!(a.refused, "{a:#?}");
    assert!(
        a.reason.as_deref().unwrap_or("").contains("declares none"),
        "{a:#?}"
    );
}

#[test]
fn a_bundle_or_input_that_does_not_match_its_digest_never_runs() {
    let s = setup();
    let mut req = script_request(s.dir.path(), "bad-bundle", "echo RAN");
    req.task.workload.digest = Digest::of(b"something else");
    let a = run(&s.ex, req);
    assert_eq!(a.state, AttemptState::Failed);
    assert!(a.reason.as_deref().unwrap().contains("digest"), "{a:#?}");
    assert!(a.exit.is_none(), "nothing started");

    let mut req = script_request(s.dir.path(), "bad-input", "echo RAN");
    let input = s.dir.path().join("in.bin");
    std::fs::write(&input, "tampered").unwrap();
    req.task.inputs.push(TaskInput::Staged(InputRef {
        name: "in.bin".into(),
        digest: Digest::of(b"original"),
        size_bytes: 8,
    }));
    req.inputs.push(("in.bin".into(), input));
    let a = run(&s.ex, req);
    assert_eq!(a.state, AttemptState::Failed);
    assert!(
        a.reason
            .as_deref()
            .unwrap()
            .contains("does not match its pin"),
        "{a:#?}"
    );
}

#[test]
fn owner_settings_and_adapters_are_enforced_at_admission() {
    let dir = open_dir();
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    let owner = LimitsFile::parse("custom_code = false\nmemory = \"128MiB\"").unwrap();
    let ex = Executor::open(config(dir.path(), &owner), store).unwrap();
    let a = ex
        .submit(script_request(dir.path(), "custom", "echo x"))
        .unwrap();
    assert!(
        a.reason.as_deref().unwrap().contains("custom code"),
        "{a:#?}"
    );
    let mut t = task(AdapterKind::Synthetic, &["64"]);
    t.resources.memory_bytes = 256 << 20;
    let a = ex.submit(request("big-synth", t, None)).unwrap();
    assert!(a.reason.as_deref().unwrap().contains("at most"), "{a:#?}");
    let a = ex
        .submit(request("torch", task(AdapterKind::Torchrun, &["x"]), None))
        .unwrap();
    assert!(a.refused);
    // Owner settings above the ceilings are an error naming both.
    let machine = cannabis_node::exec::machine_limits(dir.path(), vec![]);
    let ceilings = Ceilings::load(Path::new("/nonexistent"), &machine).unwrap();
    let err = ceilings
        .owner(&LimitsFile::parse("processes = 999999999").unwrap())
        .unwrap_err();
    assert!(err.contains("processes") && err.contains("above"), "{err}");
}

#[test]
fn the_synthetic_task_gives_the_same_hash_for_the_same_seed_only() {
    let s = setup();
    let synth = |id: &str, seed: &[u8]| {
        let mut r = request(id, task(AdapterKind::Synthetic, &["96"]), None);
        r.seed = Some(Digest::of(seed));
        let a = run(&s.ex, r);
        assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
        a.result.unwrap()
    };
    let one = synth("s1", b"seed-a");
    let two = synth("s2", b"seed-a");
    let other = synth("s3", b"seed-b");
    assert_eq!(one.result_hash, two.result_hash);
    assert_ne!(one.result_hash, other.result_hash);
    // Run inside the sandbox, the hash equals the reference computation here.
    let reference = cannabis_protocol::synthetic::SyntheticTask::new(Digest::of(b"seed-a"), 96)
        .unwrap()
        .run();
    assert_eq!(one.result_hash, reference);
}

pub(crate) fn wait_for(mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[test]
fn an_expired_lease_stops_the_workload() {
    let s = setup();
    let mut req = script_request(s.dir.path(), "lease", "echo up; sleep 600; echo PAST");
    req.renewal = Renewal::External;
    req.lease_until_ms = now_ms() + 1500;
    let a = run(&s.ex, req);
    assert_eq!(a.state, AttemptState::Failed, "{a:#?}");
    assert!(
        a.reason.as_deref().unwrap().contains("lease expired"),
        "{a:#?}"
    );
    assert_eq!(a.cleanup, Cleanup::Released);
    assert!(!read_all(&s.ex, &a.id, "stdout").contains("PAST"));
}

#[test]
fn renewals_keep_it_running_and_the_sandbox_enforces_the_lease_without_the_executor() {
    let dir = open_dir();
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    let ex = open_executor(dir.path(), &store);
    let mut req = script_request(dir.path(), "renewed", "echo up; sleep 600; echo PAST");
    req.renewal = Renewal::External;
    req.lease_until_ms = now_ms() + 1500;
    let a = ex.submit(req).unwrap();
    // Renewed past the first deadline, it keeps running.
    wait_for(|| try_read_all(&ex, &a.id, "stdout").is_ok_and(|o| o.contains("up")));
    ex.renew(&a.id, now_ms() + 2500).unwrap();
    std::thread::sleep(Duration::from_millis(1800));
    assert_eq!(ex.get(&a.id).unwrap().state, AttemptState::Running);
    // The executor goes away; nobody renews; the sandbox stops the command by itself.
    ex.shutdown();
    drop(ex);
    let exit = dir
        .path()
        .join("exec/attempts")
        .join(&a.id)
        .join("exit.json");
    wait_for(|| exit.exists());
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&exit).unwrap()).unwrap();
    assert_eq!(record["ended_by"], "lease expired", "{record}");
    // The next executor reads what happened.
    let ex = open_executor(dir.path(), &store);
    let a = ex.wait(&a.id, Duration::from_secs(20)).unwrap();
    assert_eq!(a.state, AttemptState::Failed, "{a:#?}");
    assert!(a.reason.as_deref().unwrap().contains("lease expired"));
    assert_eq!(a.cleanup, Cleanup::Released);
}

#[test]
fn unconfirmed_cleanup_quarantines_until_the_administrator_clears_it() {
    let s = setup();
    let mut req = script_request(s.dir.path(), "stuck", "sleep 1; echo done");
    let input = s.dir.path().join("data.txt");
    std::fs::write(&input, "x").unwrap();
    req.task.inputs.push(TaskInput::Staged(InputRef {
        name: "data.txt".into(),
        digest: Digest::of(b"x"),
        size_bytes: 1,
    }));
    req.inputs.push(("data.txt".into(), input));
    let a = s.ex.submit(req).unwrap();
    let staged = s
        .dir
        .path()
        .join("exec/attempts")
        .join(&a.id)
        .join("inputs/data.txt");
    wait_for(|| s.ex.get(&a.id).unwrap().state == AttemptState::Running);
    // A file that cannot be removed: the storage cannot be confirmed clean.
    let immutable = Command::new("chattr").arg("+i").arg(&staged).status();
    if !immutable.is_ok_and(|s| s.success()) {
        eprintln!("skipped: chattr +i does not work on this filesystem");
        return;
    }
    let a = s.ex.wait(&a.id, Duration::from_secs(30)).unwrap();
    let unlock = || {
        let _ = Command::new("chattr").arg("-i").arg(&staged).status();
    };
    assert_eq!(a.state, AttemptState::Completed, "the outcome stands");
    assert!(
        matches!(&a.cleanup, Cleanup::Quarantined { why } if why.contains("storage")),
        "{a:#?}"
    );
    assert!(
        s.ex.reserved().memory_bytes > 0,
        "quarantine keeps the capacity"
    );
    let refused = s.ex.clear(&a.id);
    assert!(
        refused.is_err(),
        "the storage check fails while the file stays"
    );
    unlock();
    s.ex.clear(&a.id).unwrap();
    let a = s.ex.get(&a.id).unwrap();
    assert_eq!(a.cleanup, Cleanup::Released);
    assert_eq!(a.state, AttemptState::Completed);
    assert_eq!(s.ex.reserved().memory_bytes, 0);
}

#[test]
fn leftovers_without_a_record_are_unknown_until_cleared() {
    let dir = open_dir();
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    // What an older executor might have left: an attempt directory nobody recorded.
    let left = dir.path().join("exec/attempts/aold1234567");
    std::fs::create_dir_all(left.join("inputs")).unwrap();
    std::fs::write(left.join("inputs/x"), "x").unwrap();
    let ex = open_executor(dir.path(), &store);
    let orphans = ex.orphans();
    assert_eq!(orphans.len(), 1, "{orphans:?}");
    assert_eq!(orphans[0].name, "aold1234567");
    assert!(orphans[0].found.iter().any(|f| f.contains("directory")));
    // Still there after a restart, until cleared.
    ex.shutdown();
    drop(ex);
    let ex = open_executor(dir.path(), &store);
    assert_eq!(ex.orphans().len(), 1);
    ex.clear("aold1234567").unwrap();
    assert!(ex.orphans().is_empty());
    assert!(!left.join("inputs").exists(), "storage removed");
    assert!(ex.clear("aold1234567").is_err(), "nothing left to clear");
    ex.shutdown();
    drop(ex);
    let ex = open_executor(dir.path(), &store);
    assert!(ex.orphans().is_empty(), "cleared stays cleared");
}

#[test]
fn outputs_cannot_take_more_disk_than_the_work_directory() {
    let s = setup();
    let mut req = script_request(
        s.dir.path(),
        "sparse",
        "cd $CANNABIS_WORK; for f in s1 s2 s3; do truncate -s 3M $f; done; \
         echo x > h1; ln h1 h2",
    );
    for name in ["s1", "s2", "s3", "h1", "h2"] {
        req.task.outputs.push(OutputDecl {
            name: name.into(),
            max_bytes: 8 << 20,
            rights: OutputRights::Exclusive,
        });
    }
    let a = run(&s.ex, req);
    let exit = a.exit.clone().unwrap();
    let copied: Vec<&str> = exit.outputs.iter().map(|o| o.name.as_str()).collect();
    // Sparse files cost nothing in the tmpfs but would be real bytes on the host's disk:
    // together they get no more than the 4 MiB work directory.
    assert_eq!(copied, ["s1"], "{exit:#?}");
    let why = |n: &str| {
        exit.refused_outputs
            .iter()
            .find(|(name, _)| name == n)
            .map(|(_, why)| why.clone())
            .unwrap_or_default()
    };
    assert!(why("s2").contains("work directory"), "{exit:#?}");
    assert!(why("h1").contains("hard links"), "{exit:#?}");
    assert_eq!(a.state, AttemptState::Failed);
}
