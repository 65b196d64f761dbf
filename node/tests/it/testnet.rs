//! A testnet of real `cannabis` processes for tests, started as a user starts one
//! (`cannabis testnet up`), and a node process started again after it was killed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `cannabis testnet up` in the background, taken down when dropped.
pub(crate) struct Testnet {
    pub(crate) dir: PathBuf,
    up: std::process::Child,
}

impl Testnet {
    pub(crate) fn up(dir: &Path, nodes: u32) -> Self {
        Self::up_in(Path::new("."), dir, nodes)
    }

    /// [`Testnet::up`] run from `cwd` (`dir` may be relative to it).
    pub(crate) fn up_in(cwd: &Path, dir: &Path, nodes: u32) -> Self {
        use std::io::{BufRead as _, BufReader};
        let mut up = Command::new(env!("CARGO_BIN_EXE_cannabis"))
            .args(["testnet", "up", "--nodes", &nodes.to_string(), "--dir"])
            .arg(dir)
            .current_dir(cwd)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        for line in BufReader::new(up.stdout.take().unwrap()).lines() {
            if line.unwrap().contains("Ctrl-C") {
                break;
            }
        }
        Self {
            dir: cwd.join(dir),
            up,
        }
    }

    /// Each node's data dir, in order.
    pub(crate) fn nodes(&self) -> Vec<PathBuf> {
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(self.dir.join("testnet.json")).unwrap())
                .unwrap();
        record["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["data_dir"].as_str().unwrap().into())
            .collect()
    }
}

/// Waits (up to a minute) until `node` knows the ads of `n` nodes that take work: a job
/// published before then may find no worker.
pub(crate) fn wait_for_workers(node: &Path, n: usize) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while cannabis_api::ApiClient::from_data_dir(node)
        .unwrap()
        .get::<Vec<cannabis_api::Ad>>("/v1/market/ads")
        .map_or(0, |a| a.iter().filter(|a| !a.adapters.is_empty()).count())
        < n
    {
        assert!(std::time::Instant::now() < until, "the ads did not arrive");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

impl Drop for Testnet {
    fn drop(&mut self) {
        let _ = Command::new(env!("CARGO_BIN_EXE_cannabis"))
            .args(["testnet", "down", "--dir"])
            .arg(&self.dir)
            .output();
        let _ = self.up.kill();
        let _ = self.up.wait();
    }
}

impl Testnet {
    /// Node `index`'s pid and command line (to kill it and start it again as it was).
    pub(crate) fn process(&self, index: usize) -> (i32, Vec<String>) {
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(self.dir.join("testnet.json")).unwrap())
                .unwrap();
        let pid = record["nodes"][index]["pid"].as_u64().unwrap() as i32;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
            .unwrap()
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        (pid, cmdline)
    }
}

/// A node process started again (after it was killed), stopped when dropped.
pub(crate) struct Restarted(std::process::Child);

impl Drop for Restarted {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

impl Restarted {
    /// Starts `cmdline` again, its output discarded.
    pub(crate) fn start(cmdline: &[String]) -> Self {
        Restarted(
            Command::new(&cmdline[0])
                .args(&cmdline[1..])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        )
    }
}

/// A testnet started in a relative directory, as the testnet guide's `--dir .testnet`:
/// its nodes take work. (Their executors once looked for their pinned binary by a path
/// relative to `/`, where the sandbox zygote starts, and every node advertised nothing.)
#[test]
fn a_testnet_in_a_relative_directory_takes_work() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: the nodes' executors run sandboxes only as root");
        return;
    }
    let dir = super::exec::open_dir();
    let net = Testnet::up_in(dir.path(), Path::new("relative"), 2);
    wait_for_workers(&net.dir.join("node-0"), 2);
}
