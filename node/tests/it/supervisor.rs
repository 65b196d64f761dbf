//! Privilege separation for real: `cannabis supervisor run` as root and `cannabis node run`
//! as an unprivileged user the test makes, talking over the supervisor's socket. Work runs
//! in the sandbox under a uid of its own and cannot read the node's key; the node cannot
//! raise a ceiling; other local users cannot use the socket; a killed node finds its
//! running attempt again, and a killed supervisor recovers from its journal.
//!
//! Needs root (to make users and to be the supervisor): skipped otherwise, with the reason.

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cannabis_api::ApiClient;
use cannabis_runtime::exec::{Attempt, AttemptState, Cleanup};

use super::exec::{script_request, wait_for};

/// The node's test user, and a second user in the node's group (so that only the peer
/// check, not the socket's file mode, keeps it out).
const NODE_USER: &str = "cannabis-test-node";
const OTHER_USER: &str = "cannabis-test-other";

struct Users {
    node: (u32, u32),
    other: (u32, u32),
    /// This binary, copied where the test users can run it.
    bin: PathBuf,
}

/// Makes the test users (once per run; kept, as a CI machine is thrown away) and a copy of
/// the binary they can reach. `None` (with the reason printed) when not root.
fn users() -> Option<&'static Users> {
    static USERS: OnceLock<Option<Users>> = OnceLock::new();
    USERS
        .get_or_init(|| {
            if !nix::unistd::geteuid().is_root() {
                eprintln!("skipped: privilege separation needs root (to make users and run the supervisor)");
                return None;
            }
            let ids = |name: &str| {
                nix::unistd::User::from_name(name)
                    .unwrap()
                    .map(|u| (u.uid.as_raw(), u.gid.as_raw()))
            };
            if ids(NODE_USER).is_none() {
                let ok = Command::new("useradd")
                    .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", NODE_USER])
                    .status()
                    .unwrap()
                    .success();
                assert!(ok || ids(NODE_USER).is_some(), "useradd {NODE_USER}");
            }
            if ids(OTHER_USER).is_none() {
                let ok = Command::new("useradd")
                    .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--groups", NODE_USER, OTHER_USER])
                    .status()
                    .unwrap()
                    .success();
                assert!(ok || ids(OTHER_USER).is_some(), "useradd {OTHER_USER}");
            }
            // One place shared by every test process (nextest runs each test in its own),
            // replaced by a rename so that a process already running the old file is not
            // disturbed: a directory per process would leave a copy of the binary behind
            // for every test, half a gigabyte each in a debug build.
            let dir = std::env::temp_dir().join("cannabis-supervisor-test");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
            let staged = dir.join(format!("cannabis.{}", std::process::id()));
            let _ = std::fs::remove_file(&staged);
            if std::fs::hard_link(env!("CARGO_BIN_EXE_cannabis"), &staged).is_err() {
                std::fs::copy(env!("CARGO_BIN_EXE_cannabis"), &staged).unwrap();
            }
            std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755)).unwrap();
            let bin = dir.join("cannabis");
            std::fs::rename(&staged, &bin).unwrap();
            // A rename between two links to one file does nothing: drop the staged link.
            let _ = std::fs::remove_file(&staged);
            Some(Users {
                node: ids(NODE_USER).unwrap(),
                other: ids(OTHER_USER).unwrap(),
                bin,
            })
        })
        .as_ref()
}

/// A test's directory: traversable by everyone, the node's data directory owned by the
/// node user.
struct Dirs {
    root: tempfile::TempDir,
}

impl Dirs {
    fn new(users: &Users) -> Self {
        let root = tempfile::tempdir().unwrap();
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let node = root.path().join("node");
        std::fs::create_dir(&node).unwrap();
        std::os::unix::fs::chown(&node, Some(users.node.0), Some(users.node.1)).unwrap();
        std::fs::write(
            root.path().join("ceilings.toml"),
            "cpu = 1\nmemory = \"1GiB\"\nprocesses = 512\nstorage = \"2GiB\"\n",
        )
        .unwrap();
        Self { root }
    }
    fn socket(&self) -> PathBuf {
        self.root.path().join("run").join("supervisor.sock")
    }
    fn node(&self) -> PathBuf {
        self.root.path().join("node")
    }
}

/// A child process stopped with SIGTERM (then SIGKILL) when dropped.
pub(crate) struct Proc(pub(crate) Child);

impl Proc {
    fn kill(mut self) {
        self.0.kill().unwrap(); // SIGKILL
        self.0.wait().unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn supervisor(users: &Users, dirs: &Dirs) -> Proc {
    let _ = std::fs::remove_file(dirs.socket());
    let child = Command::new(&users.bin)
        .args(["supervisor", "run", "--node-user", NODE_USER, "--socket"])
        .arg(dirs.socket())
        .arg("--dir")
        .arg(dirs.root.path().join("supervisor"))
        .arg("--ceilings")
        .arg(dirs.root.path().join("ceilings.toml"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(|| std::os::unix::net::UnixStream::connect(dirs.socket()).is_ok());
    Proc(child)
}

fn node(users: &Users, dirs: &Dirs) -> Proc {
    let args = ["node", "run", "--no-mdns"].map(String::from);
    node_with(users, dirs, &args)
}

/// The node of `dirs` as the node user, with `args` (a `node run` command line without
/// its listen, API and supervisor settings), once its executor answers.
fn node_with(users: &Users, dirs: &Dirs, args: &[String]) -> Proc {
    let dir = dirs.node();
    let _ = std::fs::remove_file(dir.join("node.json"));
    let child = as_user(users, users.node, false)
        .arg("--data-dir")
        .arg(&dir)
        .args(args)
        .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--api", "127.0.0.1:0"])
        .arg("--supervisor")
        .arg(dirs.socket())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(|| dir.join("node.json").exists() && ApiClient::from_data_dir(&dir).is_ok());
    wait_for(|| {
        ApiClient::from_data_dir(&dir)
            .and_then(|c| c.get::<serde_json::Value>("/v1/exec"))
            .is_ok_and(|s| s["unavailable"].is_null())
    });
    Proc(child)
}

/// This binary as `uid:gid`, with no supplementary groups (or the user's own from
/// `/etc/group` with `init_groups`).
fn as_user(users: &Users, ids: (u32, u32), init_groups: bool) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={}", ids.0))
        .arg(format!("--regid={}", ids.1))
        .arg(if init_groups {
            "--init-groups"
        } else {
            "--clear-groups"
        })
        .arg(&users.bin);
    cmd
}

/// Runs this binary as `uid:gid` with `args`.
fn run_as(users: &Users, ids: (u32, u32), args: &[&str]) -> Output {
    as_user(users, ids, false).args(args).output().unwrap()
}

fn client(dirs: &Dirs) -> ApiClient {
    ApiClient::from_data_dir(&dirs.node()).unwrap()
}

/// Submits a process task running `script` through the node's API; the bundle is a file
/// only the node user can read (the node hands it to the supervisor as a descriptor).
fn submit(users: &Users, dirs: &Dirs, id: &str, script: &str) -> Attempt {
    client(dirs)
        .post("/v1/exec/attempts", &request_of(users, dirs, id, script))
        .unwrap()
}

/// A process task running `script`, whose bundle only the node user can read.
fn request_of(
    users: &Users,
    dirs: &Dirs,
    id: &str,
    script: &str,
) -> cannabis_runtime::exec::AttemptRequest {
    let mut request = script_request(dirs.root.path(), id, script);
    request.task.resources.cpu_millicores = 500;
    node_only(users, request.bundle.as_ref().unwrap());
    request
}

/// Makes `file` the node user's, readable by it alone.
fn node_only(users: &Users, file: &std::path::Path) {
    std::os::unix::fs::chown(file, Some(users.node.0), Some(users.node.1)).unwrap();
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn attempt(dirs: &Dirs, id: &str) -> Attempt {
    client(dirs)
        .get(&format!("/v1/exec/attempts/{id}"))
        .unwrap()
}

fn settled(dirs: &Dirs, id: &str) -> Attempt {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(a) = client(dirs).get::<Attempt>(&format!("/v1/exec/attempts/{id}"))
            && a.state.is_final()
            && a.cleanup != Cleanup::Pending
        {
            return a;
        }
        assert!(
            Instant::now() < deadline,
            "not settled: {:#?}",
            client(dirs).get::<serde_json::Value>(&format!("/v1/exec/attempts/{id}"))
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stdout(dirs: &Dirs, id: &str) -> String {
    let chunk: cannabis_runtime::exec::Chunk = client(dirs)
        .get(&format!("/v1/exec/attempts/{id}/output/stdout"))
        .unwrap();
    String::from_utf8_lossy(&chunk.data).into_owned()
}

#[test]
fn an_unprivileged_node_runs_work_in_the_sandbox_of_a_root_supervisor() {
    let Some(users) = users() else { return };
    let dirs = Dirs::new(users);
    let _sup = supervisor(users, &dirs);
    let _node = node(users, &dirs);

    // The node says where its work runs, and claims privilege separation: the kernel
    // says its supervisor is root and it is not.
    let status: serde_json::Value = client(&dirs).get("/v1/exec").unwrap();
    assert_eq!(status["mode"]["mode"], "supervisor", "{status:#}");
    assert_eq!(status["mode"]["separated"], true, "{status:#}");
    let layers = status["layers"].as_array().unwrap();
    assert!(
        layers.iter().any(|l| l == "privilege-separated"),
        "{status:#}"
    );
    let node_status = client(&dirs).status().unwrap();
    assert!(
        node_status.executor.contains("supervisor at")
            && node_status.executor.contains("unprivileged"),
        "{}",
        node_status.executor
    );
    // The supervisor's ceilings bound what the node offers.
    assert_eq!(status["limits"]["cpu_millicores"], 1000, "{status:#}");
    wait_for(|| {
        client(&dirs)
            .get::<Vec<cannabis_api::Ad>>("/v1/market/ads")
            .is_ok_and(|ads| {
                ads.iter().any(|a| {
                    a.isolation
                        .contains(&cannabis_protocol::IsolationLayer::PrivilegeSeparated)
                })
            })
    });

    // The owner's command goes through the node to the supervisor, which checks it
    // against the ceilings.
    let data_dir = dirs.node().display().to_string();
    for (name, text, ok) in [
        ("up.toml", "cpu = 4\n", false),
        ("down.toml", "cpu = 0.75\n", true),
    ] {
        let file = dirs.root.path().join(name);
        std::fs::write(&file, text).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let out = run_as(
            users,
            users.node,
            &[
                "--data-dir",
                &data_dir,
                "node",
                "limits",
                &file.display().to_string(),
            ],
        );
        assert_eq!(
            out.status.success(),
            ok,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let status: serde_json::Value = client(&dirs).get("/v1/exec").unwrap();
    assert_eq!(status["limits"]["cpu_millicores"], 750, "{status:#}");

    // The workload runs under a uid of its own and cannot read the node's key or token,
    // wherever it looks for them.
    let key = dirs.node().join("keys").join("node.key");
    let token = dirs.node().join("api.token");
    assert!(key.exists() && token.exists());
    let script = format!(
        "for f in {} {} /proc/1/root{} ; do cat \"$f\" >/dev/null 2>&1 && echo \"READ $f\" || echo \"DENIED $f\"; done\necho uid $(id -u)\n",
        key.display(),
        token.display(),
        key.display()
    );
    let a = submit(users, &dirs, "keys", &script);
    assert!(!a.refused, "{a:#?}");
    let a = settled(&dirs, &a.id);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    let uid = a.reservation.as_ref().unwrap().uid;
    assert_ne!(uid, users.node.0, "the workload ran as the node's user");
    assert_ne!(uid, 0, "the workload ran as root");
    let out = stdout(&dirs, &a.id);
    assert!(!out.contains("READ"), "the workload read a secret: {out}");
    assert_eq!(out.matches("DENIED").count(), 3, "{out}");
    let key_bytes = std::fs::read(&key).unwrap();
    assert!(
        !out.as_bytes()
            .windows(8)
            .any(|w| key_bytes.windows(8).any(|k| k == w)),
        "the key's bytes are in the output"
    );
    // The bundle was handed over as a descriptor: the node user could read it, and the
    // supervisor never opened the node's path itself...
    assert!(
        a.request
            .bundle
            .as_ref()
            .unwrap()
            .starts_with(dirs.root.path().join("supervisor").join("spool"))
    );
    // ...so a file only root can read cannot be made a bundle through the node.
    let secret = dirs.root.path().join("root-only.tar");
    std::fs::copy(dirs.root.path().join("bundle-keys.tar"), &secret).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut request = a.request.clone();
    request.request_id = "root-only".into();
    request.bundle = Some(secret.clone());
    let err = client(&dirs)
        .post::<_, Attempt>("/v1/exec/attempts", &request)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Permission denied"), "{err}");

    // A checkpoint to resume from travels the same way: one the node user can read is
    // in the work directory when the workload starts; one only root can read cannot be
    // named.
    let kept = dirs.root.path().join("kept-count");
    std::fs::write(&kept, "7").unwrap();
    node_only(users, &kept);
    let mut request = request_of(users, &dirs, "resumed", "cat \"$CANNABIS_WORK/count\"\n");
    request.task.checkpoint = Some(cannabis_protocol::OutputDecl {
        name: "count".into(),
        max_bytes: 100,
        rights: cannabis_protocol::OutputRights::Exclusive,
    });
    request.resume = Some(kept);
    let a: Attempt = client(&dirs).post("/v1/exec/attempts", &request).unwrap();
    assert!(!a.refused, "{a:#?}");
    let a = settled(&dirs, &a.id);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(stdout(&dirs, &a.id), "7");
    assert!(
        a.request
            .resume
            .as_ref()
            .unwrap()
            .starts_with(dirs.root.path().join("supervisor").join("spool"))
    );
    let root_only = dirs.root.path().join("root-only-count");
    std::fs::write(&root_only, "8").unwrap();
    std::fs::set_permissions(&root_only, std::fs::Permissions::from_mode(0o600)).unwrap();
    request.request_id = "resume-root-only".into();
    request.resume = Some(root_only);
    let err = client(&dirs)
        .post::<_, Attempt>("/v1/exec/attempts", &request)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Permission denied"), "{err}");
}

#[test]
fn the_node_cannot_raise_a_ceiling_and_no_other_user_can_use_the_socket() {
    let Some(users) = users() else { return };
    let dirs = Dirs::new(users);
    let _sup = supervisor(users, &dirs);
    let socket = dirs.socket().display().to_string();
    let write = |name: &str, text: &str| {
        let p = dirs.root.path().join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        p.display().to_string()
    };

    // Above a ceiling: refused, and nothing changes.
    let higher = write("higher.toml", "cpu = 2\n");
    let out = run_as(
        users,
        users.node,
        &["supervisor", "limits", &higher, "--socket", &socket],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not allowed by") || err.contains("above"),
        "{err}"
    );
    let custom = write("custom.toml", "custom_code = true\nmemory = \"4GiB\"\n");
    let out = run_as(
        users,
        users.node,
        &["supervisor", "limits", &custom, "--socket", &socket],
    );
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let status = run_as(
        users,
        users.node,
        &["supervisor", "status", "--json", "--socket", &socket],
    );
    assert!(status.status.success());
    let st: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(st["limits"]["cpu_millicores"], 1000);
    assert_eq!(st["limits"]["memory_bytes"], 1u64 << 30);

    // Within them: the owner's command takes effect.
    let lower = write("lower.toml", "cpu = 0.5\n");
    let out = run_as(
        users,
        users.node,
        &[
            "supervisor",
            "limits",
            &lower,
            "--socket",
            &socket,
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let set: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(set["cpu_millicores"], 500);

    // The owner's limits hold across a restart of the supervisor.
    drop(_sup);
    let _sup = supervisor(users, &dirs);
    let status = run_as(
        users,
        users.node,
        &["supervisor", "status", "--json", "--socket", &socket],
    );
    let st: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(st["limits"]["cpu_millicores"], 500, "{st}");

    // Clearing is the administrator's.
    let out = run_as(
        users,
        users.node,
        &["supervisor", "clear", "nothing", "--socket", &socket],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("administrator"));

    // Another user cannot connect (the socket is root's and the node group's, 0660)...
    let out = run_as(
        users,
        users.other,
        &["supervisor", "status", "--socket", &socket],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Permission denied"), "{err}");
    // ...and one in the node's group, whom the socket's mode lets connect, is refused by
    // the peer check.
    let out = as_user(users, users.other, true)
        .args(["supervisor", "status", "--socket", &socket])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("may not use this supervisor"), "{err}");

    // No operation touches the ceilings: one that names them is not a request.
    use std::io::{Read as _, Write as _};
    let mut s = std::os::unix::net::UnixStream::connect(dirs.socket()).unwrap();
    let body = br#"{"op":"set-ceilings","cpu":64}"#;
    s.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut reply = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut reply).unwrap();
    let reply: serde_json::Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(reply["err"]["kind"], "bad-request", "{reply}");
}

#[test]
fn a_killed_node_finds_its_running_attempt_again_and_a_killed_supervisor_recovers() {
    let Some(users) = users() else { return };
    let dirs = Dirs::new(users);
    let sup = supervisor(users, &dirs);
    let node1 = node(users, &dirs);
    let a = submit(users, &dirs, "long", "sleep 4\necho finished\n");
    assert!(!a.refused, "{a:#?}");
    wait_for(|| attempt(&dirs, &a.id).state == AttemptState::Running);

    // The node dies: the attempt goes on under the supervisor, and the next node sees it.
    node1.kill();
    let _node2 = node(users, &dirs);
    let a = attempt(&dirs, &a.id);
    assert!(
        matches!(a.state, AttemptState::Running | AttemptState::Completed),
        "{a:#?}"
    );

    // The supervisor dies mid-run: its next start finds the attempt through its journal,
    // and it runs once.
    let b = submit(
        users,
        &dirs,
        "again",
        "sleep 3\necho once >> /tmp/count\ncat /tmp/count\n",
    );
    assert!(!b.refused, "{b:#?}");
    wait_for(|| attempt(&dirs, &b.id).state == AttemptState::Running);
    sup.kill();
    let _sup2 = supervisor(users, &dirs);
    let a = settled(&dirs, &a.id);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(stdout(&dirs, &a.id).trim(), "finished");
    let b = settled(&dirs, &b.id);
    assert_eq!(b.state, AttemptState::Completed, "{b:#?}");
    assert_eq!(stdout(&dirs, &b.id).trim(), "once", "ran more than once");
}

/// A group job's two ranks on two unprivileged nodes, each with a root supervisor of its
/// own: each supervisor makes its rank's group interface in the sandbox (which takes
/// root) and hands the device to its node, whose channel carries the ranks' all-reduce.
/// (An unprivileged node once tried to enter the sandbox's namespace itself, was refused,
/// and every rank failed: "making the group interface in the sandbox".)
#[test]
fn a_group_runs_on_unprivileged_nodes_whose_supervisors_make_their_interfaces() {
    let Some(users) = users() else { return };
    let dir = super::exec::open_dir();
    // Node 0 sequences the ledger and publishes the job; paused, it takes no work (and
    // advertises none).
    let net = super::testnet::Testnet::up(&dir.path().join("net"), 1);
    let requester = net.nodes()[0].clone();
    let data_dir = requester.display().to_string();
    let paused = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .args(["--data-dir", &data_dir, "node", "pause"])
        .output()
        .unwrap();
    assert!(
        paused.status.success(),
        "{}",
        String::from_utf8_lossy(&paused.stderr)
    );

    // Two workers joining the testnet as its own nodes join it, each run by the node
    // user with a supervisor: the testnet's genesis, fee terms and prices, its node 0 to
    // dial first, custom code allowed, and the supervisor's ceilings as its limits.
    let (_, cmdline) = net.process(0);
    let at = |flag: &str| {
        let i = cmdline.iter().position(|a| a == flag).unwrap();
        cmdline[i + 1].clone()
    };
    let genesis = at("--genesis");
    let config = std::fs::read_to_string(at("--config")).unwrap();
    let config: String = config
        .split("\n\n")
        .filter(|section| !section.starts_with("[executor]"))
        .collect::<Vec<_>>()
        .join("\n\n");
    let zero = client_of(&requester).status().unwrap();
    let bootstrap = format!(
        "{}/p2p/{}",
        zero.listen_addrs
            .iter()
            .find(|a| a.contains("/tcp/"))
            .unwrap(),
        zero.peer_id
    );
    let workers: Vec<(Dirs, Proc, Proc)> = (0..2)
        .map(|_| {
            let dirs = Dirs::new(users);
            let file = dirs.root.path().join("node.toml");
            std::fs::write(&file, &config).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            let sup = supervisor(users, &dirs);
            let args: Vec<String> = ["node", "run", "--testnet", "--no-mdns", "--config"]
                .map(String::from)
                .into_iter()
                .chain([
                    file.display().to_string(),
                    "--genesis".into(),
                    genesis.clone(),
                ])
                .chain(["--bootstrap".into(), bootstrap.clone()])
                .collect();
            let node = node_with(users, &dirs, &args);
            (dirs, sup, node)
        })
        .collect();
    super::testnet::wait_for_workers(&requester, 2);

    let job = super::group::JOB.replace("group_size = 3", "group_size = 2");
    let id = super::group::submit_bundle(&requester, &dir.path().join("job"), &job, PROGRAM);
    let done = super::group::completed(&requester, &id, 180);
    assert_eq!(
        super::group::sums(&done),
        [
            "rank 0 of 2: 30 over ['cnb0', 'lo']",
            "rank 1 of 2: 30 over ['cnb0', 'lo']"
        ],
        "each rank's output"
    );
    // Each rank ran on one of the supervised workers, and each supervisor made one
    // interface: the job's one rank on it.
    let addresses: Vec<String> = workers
        .iter()
        .map(|(dirs, ..)| client(dirs).status().unwrap().address.to_string())
        .collect();
    let mut ran: Vec<String> = done.tasks[0]
        .ranks
        .iter()
        .map(|r| r.worker.to_string())
        .collect();
    ran.sort();
    let mut expected = addresses.clone();
    expected.sort();
    assert_eq!(ran, expected, "the ranks' workers");

    // The supervisor makes an interface only for a group's rank, at its own rank, in a
    // sandbox that is there.
    for (dirs, ..) in &workers {
        let attempts: Vec<Attempt> = client(dirs).get("/v1/exec/attempts").unwrap();
        let rank = attempts
            .iter()
            .find(|a| a.request.hold)
            .expect("the supervisor ran a held rank");
        let own: u32 = rank
            .request
            .env
            .iter()
            .find(|(k, _)| k == "RANK")
            .unwrap()
            .1
            .parse()
            .unwrap();
        let sup = cannabis_node::supervisor::SupervisorClient::new(dirs.socket());
        let other = sup
            .interface(&rank.id, own + 1, 65_000)
            .unwrap_err()
            .to_string();
        assert!(other.contains("admitted as rank"), "{other}");
        let ended = sup
            .interface(&rank.id, own, 65_000)
            .unwrap_err()
            .to_string();
        assert!(ended.contains("is completed"), "{ended}");
    }
}

/// Each rank's value is 10 times its rank plus one; each lists its interfaces.
const PROGRAM: &str = r#"
import os, socket
from sum import all_reduce_sum

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
total = all_reduce_sum(10 * (rank + 1))
names = sorted(n for _, n in socket.if_nameindex())
with open(os.path.join(os.environ["CANNABIS_WORK"], "sum.txt"), "w") as f:
    f.write(f"rank {rank} of {world}: {total} over {names}\n")
"#;

fn client_of(dir: &std::path::Path) -> ApiClient {
    ApiClient::from_data_dir(dir).unwrap()
}
