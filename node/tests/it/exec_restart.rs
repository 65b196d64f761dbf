//! The attempt journal against a real `cannabis node run` killed with SIGKILL while an
//! attempt is preparing, running or being cleaned up: after the restart every attempt is
//! in a correct state and nothing runs twice. Also the owner's switch across a restart.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use cannabis_api::ApiClient;
use cannabis_protocol::{AdapterKind, Amount, Digest, Requirements, Resources, TaskSpec, Workload};
use cannabis_runtime::exec::{Attempt, AttemptRequest, AttemptState, Cleanup, Renewal};

use super::exec::{open_dir, wait_for};

struct Node {
    child: Child,
}

impl Node {
    fn start(dir: &Path, pause_at: Option<&str>) -> Self {
        let _ = std::fs::remove_file(dir.join("node.json"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cannabis"));
        cmd.arg("--data-dir")
            .arg(dir)
            .args([
                "node",
                "run",
                "--no-mdns",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            ])
            .args([
                "--api",
                "127.0.0.1:0",
                "--ceilings",
                "/nonexistent/ceilings.toml",
            ])
            .env_remove("CANNABIS_EXEC_PAUSE_AT")
            .stderr(std::process::Stdio::null());
        if let Some(at) = pause_at {
            cmd.env("CANNABIS_EXEC_PAUSE_AT", at);
        }
        let child = cmd.spawn().unwrap();
        wait_for(|| dir.join("node.json").exists() && ApiClient::from_data_dir(dir).is_ok());
        wait_for(|| {
            ApiClient::from_data_dir(dir)
                .and_then(|c| c.get::<serde_json::Value>("/v1/exec"))
                .is_ok()
        });
        Self { child }
    }

    fn kill(mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for Node {
    /// A clean stop at the end of a test (SIGTERM), so the node removes its cgroups.
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client(dir: &Path) -> ApiClient {
    ApiClient::from_data_dir(dir).unwrap()
}

fn attempt(dir: &Path, id: &str) -> Attempt {
    client(dir).get(&format!("/v1/exec/attempts/{id}")).unwrap()
}

fn stdout(dir: &Path, id: &str) -> String {
    let chunk: Result<cannabis_runtime::exec::Chunk, _> =
        client(dir).get(&format!("/v1/exec/attempts/{id}/output/stdout"));
    chunk.map_or(String::new(), |c| {
        String::from_utf8_lossy(&c.data).into_owned()
    })
}

fn wait_settled(dir: &Path, id: &str) -> Attempt {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let a = attempt(dir, id);
        if a.state.is_final() && a.cleanup != Cleanup::Pending {
            return a;
        }
        assert!(Instant::now() < deadline, "not settled: {a:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn submit(dir: &Path, id: &str, script: &str) -> Attempt {
    let src = dir.join(format!("src-{id}"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("run.sh"), script).unwrap();
    let tar = dir.join(format!("{id}.tar"));
    assert!(
        Command::new("tar")
            .arg("cf")
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg(".")
            .status()
            .unwrap()
            .success()
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let request = AttemptRequest {
        request_id: id.into(),
        task: TaskSpec {
            restarts: 0,
            name: "t".into(),
            workload: Workload {
                adapter: AdapterKind::Process,
                digest: Digest::of(&std::fs::read(&tar).unwrap()),
                entrypoint: vec!["sh".into(), "run.sh".into()],
            },
            inputs: Vec::new(),
            outputs: Vec::new(),
            resources: Resources {
                cpu_millicores: 500,
                memory_bytes: 128 << 20,
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
        },
        bundle: Some(tar),
        inputs: Vec::new(),
        seed: None,
        lease_until_ms: now + 15_000,
        renewal: Renewal::Local,
        env: Vec::new(),
        loopback: false,
        hold: false,
        resume: None,
        checkpoint_to: None,
    };
    client(dir).post("/v1/exec/attempts", &request).unwrap()
}

#[test]
fn killed_while_preparing_the_attempt_fails_without_ever_running() {
    let dir = open_dir();
    let node = Node::start(dir.path(), Some("preparing"));
    let a = submit(dir.path(), "prep", "echo RAN");
    wait_for(|| attempt(dir.path(), &a.id).state == AttemptState::Preparing);
    node.kill();
    let _node = Node::start(dir.path(), None);
    let a = wait_settled(dir.path(), &a.id);
    assert_eq!(a.state, AttemptState::Failed, "{a:#?}");
    assert!(
        a.reason.as_deref().unwrap().contains("never started"),
        "{a:#?}"
    );
    assert_eq!(a.cleanup, Cleanup::Released);
    assert!(a.exit.is_none());
    assert!(!stdout(dir.path(), &a.id).contains("RAN"));
}

#[test]
fn killed_while_running_the_work_is_found_again_and_runs_once() {
    let dir = open_dir();
    let node = Node::start(dir.path(), None);
    let a = submit(dir.path(), "run", "echo start; sleep 3; echo end");
    wait_for(|| stdout(dir.path(), &a.id).contains("start"));
    assert_eq!(attempt(dir.path(), &a.id).state, AttemptState::Running);
    node.kill();
    // The sandbox goes on under its lease while the executor is gone.
    let _node = Node::start(dir.path(), None);
    let a = wait_settled(dir.path(), &a.id);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(a.cleanup, Cleanup::Released);
    assert_eq!(
        stdout(dir.path(), &a.id),
        "start\nend\n",
        "ran exactly once"
    );
    let all: Vec<Attempt> = client(dir.path()).get("/v1/exec/attempts").unwrap();
    assert_eq!(all.len(), 1, "no second attempt");
    // Submitting the same request again returns it; it does not run again.
    let again = submit(dir.path(), "run", "echo start; sleep 3; echo end");
    assert_eq!(again.id, a.id);
    assert_eq!(again.state, AttemptState::Completed);
}

#[test]
fn a_sandbox_that_died_with_the_executor_is_unknown_and_not_retried() {
    let dir = open_dir();
    let node = Node::start(dir.path(), None);
    let a = submit(dir.path(), "lost", "echo start; sleep 600");
    wait_for(|| stdout(dir.path(), &a.id).contains("start"));
    let monitor = attempt(dir.path(), &a.id).monitor_pid.unwrap();
    node.kill();
    // The monitor dies too, before it can record anything; the sandbox goes with it.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(monitor as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _node = Node::start(dir.path(), None);
    let a = wait_settled(dir.path(), &a.id);
    assert_eq!(a.state, AttemptState::Unknown, "{a:#?}");
    assert_eq!(a.cleanup, Cleanup::Released, "tree confirmed empty: {a:#?}");
    let all: Vec<Attempt> = client(dir.path()).get("/v1/exec/attempts").unwrap();
    assert_eq!(all.len(), 1, "never retried automatically");
    // A retry is an explicit decision.
    let out = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(dir.path())
        .args(["node", "retry", &a.id])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all: Vec<Attempt> = client(dir.path()).get("/v1/exec/attempts").unwrap();
    assert_eq!(all.len(), 2);
    assert!(
        all.iter()
            .any(|x| x.retry_of.as_deref() == Some(a.id.as_str()))
    );
}

#[test]
fn killed_during_cleanup_the_outcome_is_kept_and_cleanup_finishes() {
    let dir = open_dir();
    let node = Node::start(dir.path(), Some("cleanup"));
    let a = submit(dir.path(), "clean", "echo done");
    wait_for(|| {
        let a = attempt(dir.path(), &a.id);
        a.state == AttemptState::Completed && a.history.iter().any(|h| h.1.starts_with("cleanup"))
    });
    node.kill();
    let _node = Node::start(dir.path(), None);
    let a = wait_settled(dir.path(), &a.id);
    assert_eq!(a.state, AttemptState::Completed, "{a:#?}");
    assert_eq!(a.cleanup, Cleanup::Released);
    assert_eq!(stdout(dir.path(), &a.id), "done\n");
}

#[test]
fn the_owners_switch_survives_a_node_restart() {
    let dir = open_dir();
    let node = Node::start(dir.path(), None);
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_cannabis"))
            .arg("--data-dir")
            .arg(dir.path())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(cli(&["node", "pause"]).contains("paused"));
    node.kill();
    let _node = Node::start(dir.path(), None);
    let jobs: serde_json::Value = serde_json::from_str(&cli(&["node", "jobs", "--json"])).unwrap();
    assert_eq!(jobs["executor"]["control"], "paused", "{jobs}");
    let refused = submit(dir.path(), "while-paused", "echo x");
    assert!(refused.refused);
    assert!(cli(&["node", "resume"]).contains("resumed"));
    let table = cli(&["node", "jobs"]);
    assert!(
        table.contains("failed (refused)") && table.contains("while-paused"),
        "{table}"
    );
}
