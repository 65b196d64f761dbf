//! A requester's program runs on a contributor's machine and its outputs come back, on a
//! testnet of real `cannabis` processes: the bundle and input travel to the worker
//! encrypted, the run happens in the worker's sandbox, the outputs travel back encrypted
//! with a signed manifest, and a second task consumes the first one's output.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use cannabis_api::{ApiClient, JobDetail};

fn cannabis(data_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .output()
        .unwrap()
}

/// `cannabis testnet up` in the background, taken down when dropped.
struct Testnet {
    dir: std::path::PathBuf,
    up: std::process::Child,
}

impl Testnet {
    fn up(dir: &Path, nodes: u32) -> Self {
        use std::io::{BufRead as _, BufReader};
        let mut up = Command::new(env!("CARGO_BIN_EXE_cannabis"))
            .args(["testnet", "up", "--nodes", &nodes.to_string(), "--dir"])
            .arg(dir)
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
            dir: dir.to_path_buf(),
            up,
        }
    }

    /// Each node's data dir, in order.
    fn nodes(&self) -> Vec<std::path::PathBuf> {
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

fn tar(dir: &Path, files: &[(&str, &str)]) -> std::path::PathBuf {
    let src = dir.join("bundle");
    std::fs::create_dir_all(&src).unwrap();
    for (name, text) in files {
        std::fs::write(src.join(name), text).unwrap();
    }
    let tar = dir.join("bundle.tar");
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
    tar
}

fn job(dir: &Path, id: &str) -> JobDetail {
    ApiClient::from_data_dir(dir).unwrap().job(id).unwrap()
}

const JOB: &str = r#"
name = "upper-then-count"
deadline = "10m"
bid_window = "2s"

[[task]]
name = "upper"
budget = 300_000
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["sh", "upper.sh"]
[task.resources]
cpu = 1
memory = "256MiB"
storage = "16MiB"
[[task.inputs]]
name = "in.txt"
path = "in.txt"
[[task.outputs]]
name = "out.txt"
max_size = "1MiB"

[[task]]
name = "count"
budget = 300_000
depends_on = ["upper"]
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["sh", "count.sh"]
[task.resources]
cpu = 1
memory = "256MiB"
storage = "16MiB"
[[task.inputs]]
name = "up.txt"
from = "upper:out.txt"
[[task.outputs]]
name = "count.txt"
max_size = "4KiB"
"#;

#[test]
fn a_process_job_and_its_dependant_run_on_workers_and_their_outputs_come_back() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: requesters' programs run only where the executor is root");
        return;
    }
    // Reachable by the nodes' sandbox uids (tempdirs are 0700).
    let dir = super::exec::open_dir();
    let net = Testnet::up(&dir.path().join("net"), 3);
    let nodes = net.nodes();
    let requester = &nodes[0];

    let work = dir.path().join("job");
    std::fs::create_dir_all(&work).unwrap();
    tar(
        &work,
        &[
            (
                "upper.sh",
                "tr a-z A-Z < \"$CANNABIS_INPUTS/in.txt\" > \"$CANNABIS_WORK/out.txt\"\n",
            ),
            (
                "count.sh",
                "wc -c < \"$CANNABIS_INPUTS/up.txt\" | tr -d ' ' > \"$CANNABIS_WORK/count.txt\"\n",
            ),
        ],
    );
    let text = "hello from the requester\n".repeat(1000);
    std::fs::write(work.join("in.txt"), &text).unwrap();
    std::fs::write(work.join("job.toml"), JOB).unwrap();

    // The workers' ads must be known before the job is published.
    let deadline = Instant::now() + Duration::from_secs(60);
    while ApiClient::from_data_dir(requester)
        .unwrap()
        .get::<Vec<cannabis_api::Ad>>("/v1/market/ads")
        .map_or(0, |a| a.iter().filter(|a| !a.adapters.is_empty()).count())
        < 3
    {
        assert!(Instant::now() < deadline, "the ads did not arrive");
        std::thread::sleep(Duration::from_millis(200));
    }
    let o = cannabis(
        requester,
        &[
            "job",
            "submit",
            work.join("job.toml").to_str().unwrap(),
            "--yes",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let published: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = published["job_id"].as_str().unwrap().to_string();

    let deadline = Instant::now() + Duration::from_secs(120);
    let done = loop {
        let j = job(requester, &id);
        if j.summary.state != cannabis_market::job::JobState::Open {
            break j;
        }
        assert!(
            Instant::now() < deadline,
            "the job did not finish: {:#?}",
            j.history
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(
        done.summary.state,
        cannabis_market::job::JobState::Completed,
        "{:#?}",
        done.history
    );

    // `job results` writes both tasks' outputs, each checked against its signed digest.
    let out = dir.path().join("results");
    let o = cannabis(
        requester,
        &[
            "job",
            "results",
            &id,
            "--out",
            out.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let upper = std::fs::read_to_string(out.join("upper/out.txt")).unwrap();
    assert_eq!(upper, text.to_uppercase());
    let count = std::fs::read_to_string(out.join("count/count.txt")).unwrap();
    assert_eq!(count.trim(), text.len().to_string());
    let manifest_digest = &done.tasks[0].delivered[0].digest;
    assert_eq!(
        &cannabis_protocol::Digest::of(upper.as_bytes()).to_string(),
        manifest_digest
    );

    // The worker of the first task ran it exactly once.
    let worker = done.tasks[0].ranks[0].worker.to_string();
    let worker_dir = nodes
        .iter()
        .find(|d| {
            ApiClient::from_data_dir(d)
                .and_then(|c| c.status())
                .is_ok_and(|s| s.address == worker)
        })
        .expect("the worker is a node of the testnet");
    let attempts: Vec<serde_json::Value> = ApiClient::from_data_dir(worker_dir)
        .unwrap()
        .get("/v1/exec/attempts")
        .unwrap();
    let ran = attempts
        .iter()
        .filter(|a| {
            a["request"]["request_id"]
                .as_str()
                .is_some_and(|r| r.starts_with(&format!("lease/{id}/0/")))
        })
        .count();
    assert_eq!(ran, 1, "{attempts:#?}");
    // Nothing of the packages' plaintext is left on the worker.
    let staging = worker_dir.join("staging");
    let left = std::fs::read_dir(&staging).map_or(0, |d| d.count());
    assert_eq!(left, 0, "staging left behind in {}", staging.display());

    // A job whose package the requester does not hold is refused before publication.
    std::fs::write(
        work.join("pinned.toml"),
        JOB.replace(
            "bundle = \"bundle.tar\"",
            &format!("digest = \"{}\"", "ab".repeat(32)),
        ),
    )
    .unwrap();
    let o = cannabis(
        requester,
        &[
            "job",
            "submit",
            work.join("pinned.toml").to_str().unwrap(),
            "--yes",
        ],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("holds no copy"), "{err}");
}
