//! A requester's program runs on a contributor's machine and its outputs come back, on a
//! testnet of real `cannabis` processes: the bundle and input travel to the worker
//! encrypted, the run happens in the worker's sandbox, the outputs travel back encrypted
//! with a signed manifest, and a second task consumes the first one's output.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use cannabis_api::{ApiClient, JobDetail};

use super::testnet::{Restarted, Testnet};

fn cannabis(data_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .output()
        .unwrap()
}

pub(crate) fn tar(dir: &Path, files: &[(&str, &str)]) -> std::path::PathBuf {
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

const PAIR: &str = r#"
name = "pair"
deadline = "10m"
bid_window = "2s"

[early]
first_bids = 2

[[task]]
name = "pair"
budget = 600_000
group_size = 2
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["sh", "who.sh"]
[task.resources]
cpu = 1
memory = "256MiB"
storage = "16MiB"
[[task.outputs]]
name = "who.txt"
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
            (
                "who.sh",
                "echo \"$CANNABIS_ATTEMPT\" > \"$CANNABIS_WORK/who.txt\"\n",
            ),
        ],
    );
    let text = "hello from the requester\n".repeat(1000);
    std::fs::write(work.join("in.txt"), &text).unwrap();
    std::fs::write(work.join("job.toml"), JOB).unwrap();

    // The workers' ads must be known before the job is published.
    super::testnet::wait_for_workers(requester, 3);
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
    // The manifest carries what the worker's cgroups counted for the run.
    let ran = &done.tasks[0].delivered[0];
    assert!(ran.peak_memory_bytes > 0, "peak memory counted: {ran:?}");
    assert!(ran.cpu_ms <= ran.wall_ms + 1_000, "{ran:?}");
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

    // A group of two: each rank runs on its own worker and delivers its own part, which
    // `job results --wait` keeps apart.
    std::fs::write(work.join("pair.toml"), PAIR).unwrap();
    let o = cannabis(
        requester,
        &[
            "job",
            "submit",
            work.join("pair.toml").to_str().unwrap(),
            "--yes",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let published: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let pair = published["job_id"].as_str().unwrap().to_string();
    let parts = dir.path().join("pair");
    let o = cannabis(
        requester,
        &[
            "job",
            "results",
            &pair,
            "--out",
            parts.to_str().unwrap(),
            "--wait",
            "--json",
        ],
    );
    assert!(
        o.status.success(),
        "{}: {:#?}",
        String::from_utf8_lossy(&o.stderr),
        job(requester, &pair).history
    );
    let who: Vec<String> = (0..2)
        .map(|r| std::fs::read_to_string(parts.join(format!("rank-{r}/who.txt"))).unwrap())
        .collect();
    assert_ne!(who[0], who[1], "each rank's own attempt wrote its part");
    let workers: std::collections::BTreeSet<String> = job(requester, &pair).tasks[0]
        .ranks
        .iter()
        .map(|r| r.worker.to_string())
        .collect();
    assert_eq!(workers.len(), 2, "two workers ran the group");

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

/// A node process started again from the command line it had.
fn wait_job(
    dir: &Path,
    id: &str,
    what: &str,
    secs: u64,
    done: impl Fn(&JobDetail) -> bool,
) -> JobDetail {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let j = job(dir, id);
        if done(&j) {
            return j;
        }
        assert!(Instant::now() < deadline, "{what}: {:#?}", j.history);
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A testnet of three real nodes, and the job its node 0 submitted once it knew of three
/// workers.
struct OneJob {
    _dir: tempfile::TempDir,
    net: Testnet,
    requester: std::path::PathBuf,
    id: String,
}

/// Starts [`OneJob`]: one `process` task named `name` running `sh <first file>` from a
/// bundle of `files`, with `extra` lines in its `[[task]]` table; `None` (saying why)
/// where requesters' programs cannot run here.
fn one_job(name: &str, files: &[(&str, &str)], extra: &str) -> Option<OneJob> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: requesters' programs run only where the executor is root");
        return None;
    }
    let dir = super::exec::open_dir();
    let net = Testnet::up(&dir.path().join("net"), 3);
    let requester = net.nodes()[0].clone();
    let work = dir.path().join("job");
    std::fs::create_dir_all(&work).unwrap();
    tar(&work, files);
    let script = files[0].0;
    std::fs::write(
        work.join("job.toml"),
        format!(
            r#"
name = "{name}"
budget = 300_000
deadline = "10m"
bid_window = "2s"
[[task]]
name = "{name}"
{extra}
[task.workload]
adapter = "process"
bundle = "bundle.tar"
entrypoint = ["sh", "{script}"]
[task.resources]
cpu = 1
memory = "128MiB"
storage = "8MiB"
[[task.outputs]]
name = "out.txt"
max_size = "1KiB"
"#
        ),
    )
    .unwrap();
    super::testnet::wait_for_workers(&requester, 3);
    let id = super::settle::submit_file(&requester, &work.join("job.toml"));
    Some(OneJob {
        _dir: dir,
        net,
        requester,
        id,
    })
}

/// SIGKILLs the testnet's node with market address `address`; returns its data dir and
/// the command line it was started with.
fn kill_node(
    net: &Testnet,
    address: &cannabis_protocol::Address,
) -> (std::path::PathBuf, Vec<String>) {
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(net.dir.join("testnet.json")).unwrap())
            .unwrap();
    let (dir, pid) = record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                std::path::PathBuf::from(n["data_dir"].as_str().unwrap()),
                n["pid"].as_u64().unwrap() as i32,
            )
        })
        .find(|(d, _)| {
            ApiClient::from_data_dir(d)
                .and_then(|c| c.status())
                .is_ok_and(|s| s.address == address.to_string())
        })
        .expect("the worker is a node of the testnet");
    let cmdline: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    (dir, cmdline)
}

#[test]
fn a_rank_whose_worker_is_killed_resumes_on_the_next_from_the_checkpoint_it_sent() {
    // Counts to 20, a second a step, keeping the count in its checkpoint (written aside
    // and renamed into place); a run placed again goes on from the count it finds.
    let Some(OneJob {
        _dir,
        net,
        requester,
        id,
    }) = one_job(
        "count",
        &[(
            "count.sh",
            r#"n=0
if [ -f "$CANNABIS_WORK/count" ]; then n=$(cat "$CANNABIS_WORK/count"); echo "resumed at $n" >> "$CANNABIS_WORK/out.txt"; fi
while [ "$n" -lt 20 ]; do
  n=$((n + 1))
  echo "$n" > "$CANNABIS_WORK/.count"; mv "$CANNABIS_WORK/.count" "$CANNABIS_WORK/count"
  sleep 1
done
echo "counted to $n" >> "$CANNABIS_WORK/out.txt"
"#,
        )],
        "checkpoint = { name = \"count\", max_size = \"1KiB\" }",
    )
    else {
        return;
    };
    let requester = &requester;
    // The requester keeps a checkpoint of the running rank (a count of a few at least).
    let kept = wait_job(requester, &id, "a checkpoint kept", 90, |j| {
        j.tasks[0].checkpoints.get(&0).is_some_and(|c| c.seq >= 3)
    });
    let first = kept.tasks[0].ranks[0].clone();
    assert_eq!(first.epoch, 1);
    kill_node(&net, &first.worker);
    let replaced = wait_job(requester, &id, "the task to be placed again", 150, |j| {
        j.tasks[0].ranks.first().is_some_and(|r| r.epoch >= 2)
    });
    let again = &replaced.tasks[0].ranks[0];
    assert_ne!(again.worker, first.worker);
    let pinned = again
        .resume
        .clone()
        .expect("the award pins the checkpoint kept");
    let held = &replaced.tasks[0].checkpoints[&0];
    assert_eq!(pinned.digest, held.digest);
    let done = wait_job(requester, &id, "the job to complete", 120, |j| {
        j.summary.state != cannabis_market::job::JobState::Open
    });
    assert_eq!(
        done.summary.state,
        cannabis_market::job::JobState::Completed,
        "{:#?}",
        done.history
    );
    // The delivered output says where the rank went on from: the count its checkpoint held.
    let out = std::fs::read_to_string(
        requester
            .join("results")
            .join(&id)
            .join("0")
            .join("0")
            .join("out.txt"),
    )
    .unwrap();
    let resumed: u32 = out
        .lines()
        .find_map(|l| l.strip_prefix("resumed at "))
        .unwrap_or_else(|| panic!("not resumed: {out}"))
        .parse()
        .unwrap();
    assert!(resumed >= 3, "{out}");
    assert!(out.ends_with("counted to 20\n"), "{out}");
}

#[test]
fn a_worker_killed_mid_run_is_replaced_and_after_a_restart_neither_runs_nor_delivers_its_stale_epoch()
 {
    // Longer than an award's 15 s expiry: the run lasts only if the renewal that comes
    // while the worker fetches the bundle reaches its executor.
    let Some(OneJob {
        _dir,
        net,
        requester,
        id,
    }) = one_job(
        "slow",
        &[(
            "slow.sh",
            "sleep 18\necho done > \"$CANNABIS_WORK/out.txt\"\n",
        )],
        "",
    )
    else {
        return;
    };
    let requester = &requester;
    let running = wait_job(requester, &id, "the work to run", 60, |j| {
        j.tasks[0].ranks.first().is_some_and(|r| {
            r.progress
                .as_ref()
                .is_some_and(|p| p.stage == cannabis_protocol::RunStage::Running)
        })
    });
    let first = running.tasks[0].ranks[0].clone();
    assert_eq!(first.epoch, 1);

    // SIGKILL the worker in the middle of the run, keeping how it was started.
    let (worker_dir, cmdline) = kill_node(&net, &first.worker);

    // Its lease lapses; the task is placed again, with a new epoch, on another worker.
    let replaced = wait_job(requester, &id, "the task to be placed again", 150, |j| {
        j.tasks[0].ranks.first().is_some_and(|r| r.epoch >= 2)
    });
    assert_ne!(replaced.tasks[0].ranks[0].worker, first.worker);

    // The killed worker starts again with the same data dir.
    let restarted = Restarted::start(&cmdline);
    let done = wait_job(requester, &id, "the job to complete", 120, |j| {
        j.summary.state != cannabis_market::job::JobState::Open
    });
    assert_eq!(
        done.summary.state,
        cannabis_market::job::JobState::Completed,
        "{:#?}",
        done.history
    );
    assert!(done.tasks[0].ranks[0].epoch >= 2);
    // Nothing of epoch 1 was delivered.
    assert!(
        !done
            .history
            .iter()
            .any(|e| e.text.contains("(epoch 1) delivered")),
        "{:#?}",
        done.history
    );
    // The restarted worker ran its stale attempt at most once and has it over.
    let deadline = Instant::now() + Duration::from_secs(30);
    let stale = format!("lease/{id}/0/0/1");
    loop {
        let attempts: Option<Vec<serde_json::Value>> = ApiClient::from_data_dir(&worker_dir)
            .ok()
            .and_then(|c| c.get("/v1/exec/attempts").ok());
        if let Some(attempts) = attempts {
            let mine: Vec<_> = attempts
                .iter()
                .filter(|a| a["request"]["request_id"] == stale.as_str())
                .collect();
            assert!(mine.len() <= 1, "{mine:#?}");
            let over = mine.iter().all(|a| {
                !matches!(
                    a["state"].as_str(),
                    Some("running" | "preparing" | "reserved")
                )
            });
            if over {
                assert!(
                    !attempts
                        .iter()
                        .any(|a| a["request"]["request_id"]
                            .as_str()
                            .is_some_and(|r| r.starts_with(&format!("lease/{id}/0/0/"))
                                && !r.ends_with("/1"))),
                    "the restarted worker ran another epoch: {attempts:#?}"
                );
                break;
            }
        }
        assert!(Instant::now() < deadline, "the stale attempt did not end");
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(restarted);
}

mod transfer {
    //! The transfer path on real files and real age encryption, with the faults a network
    //! causes (a connection cut, a corrupted chunk) injected where the chunks travel.

    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex};

    use cannabis_node::delivery::{
        Check, Expect, FetchError, PackageServe, fetch, fetch_object, open_checked, seal_bytes_to,
        serve_package,
    };
    use cannabis_protocol::{
        DeliveryIdentity, Digest, ObjectKind, ObjectRef, TRANSFER_CHUNK, TransferRequest,
        TransferResponse, Uuid,
    };

    /// Deterministic bytes that do not compress.
    fn bytes(n: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn object() -> ObjectRef {
        ObjectRef {
            job_id: Uuid([7; 16]),
            task: 0,
            rank: 0,
            epoch: 1,
            kind: ObjectKind::Bundle,
            name: "bundle".into(),
        }
    }

    /// A requester's package store holding `data`, served to `to`'s recipient.
    fn package(dir: &Path, data: &[u8], to: &DeliveryIdentity) -> PackageServe {
        let source = dir.join("package");
        std::fs::write(&source, data).unwrap();
        PackageServe {
            request_id: "lease/x/0/0/1".into(),
            source,
            digest: Digest::of(data),
            to: to.recipient(),
        }
    }

    /// What the fetcher asked, and which faults to cause.
    #[derive(Default)]
    struct Wire {
        asked: Vec<u64>,
        cut_at_request: Vec<usize>,
        corrupt_once: Vec<u64>,
    }

    /// A requester serving one package from `served` (its sealed copies' folder).
    struct Server {
        served: PathBuf,
        p: PackageServe,
        lock: std::sync::Mutex<()>,
        trees: cannabis_node::delivery::Trees,
    }

    impl Server {
        fn new(dir: &Path, p: PackageServe) -> Self {
            Self {
                served: dir.join("served"),
                p,
                lock: std::sync::Mutex::new(()),
                trees: Default::default(),
            }
        }

        fn serve(&self, req: &TransferRequest) -> TransferResponse {
            serve_package(&self.served, &self.p, req, &self.lock, &self.trees)
        }
    }

    type Answer =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<TransferResponse, String>>>>;

    /// The fetcher's transport to `server` through `wire`: each request is recorded, and
    /// cut or its chunk corrupted as `wire` says.
    fn wired<'a>(
        wire: &'a Arc<Mutex<Wire>>,
        server: &'a Server,
    ) -> impl Fn(TransferRequest) -> Answer + 'a {
        move |req: TransferRequest| {
            let wire = wire.clone();
            let response = server.serve(&req);
            Box::pin(async move {
                let mut w = wire.lock().unwrap();
                w.asked.push(req.index);
                let n = w.asked.len();
                if w.cut_at_request.contains(&n) {
                    return Err("connection closed".to_string());
                }
                let mut response = response;
                if let Some(at) = w.corrupt_once.iter().position(|&i| i == req.index) {
                    w.corrupt_once.remove(at);
                    if let TransferResponse::Chunk { data, .. } = &mut response {
                        data[1000] ^= 0xff;
                    }
                }
                Ok(response)
            })
        }
    }

    #[tokio::test]
    async fn a_64_mib_package_cut_twice_resumes_from_the_right_chunks_and_arrives_whole() {
        let dir = tempfile::tempdir().unwrap();
        let worker = DeliveryIdentity::from_secret([3; 32]);
        let data = bytes(64 << 20);
        let server = Server::new(dir.path(), package(dir.path(), &data, &worker));
        let wire = Arc::new(Mutex::new(Wire {
            cut_at_request: vec![40, 170],
            corrupt_once: vec![100],
            ..Wire::default()
        }));
        let ask = wired(&wire, &server);
        let part = dir.path().join("fetch").join("bundle.age.part");
        let expect = Expect {
            known: None,
            max_plain: 65 << 20,
        };
        // Each try: the chunks kept when it began (checked, written, and their leaves
        // listed beside the part file), and the first chunk it asked for.
        let mut tries = Vec::new();
        let whole = loop {
            let kept = std::fs::metadata(part.with_extension("kept")).map_or(0, |m| m.len()) / 32;
            let asked_before = wire.lock().unwrap().asked.len();
            let result = fetch_object(&part, &object(), expect, &ask, &mut |_, _| {}).await;
            tries.push((kept, wire.lock().unwrap().asked[asked_before]));
            match result {
                Ok(w) => break w,
                Err(FetchError::Transient(_)) => {}
                Err(e) => panic!("{e}"),
            }
            assert!(tries.len() < 5, "no progress");
        };
        // Two cuts, three tries; each resumed try started at the first chunk not kept,
        // and kept what came before the cut.
        assert_eq!(tries.len(), 3, "{tries:?}");
        assert_eq!(tries[0], (0, 0));
        for &(kept, first) in &tries[1..] {
            assert!(kept > 0, "{tries:?}");
            assert_eq!(kept, first, "{tries:?}");
        }
        assert!(tries[2].0 > tries[1].0, "{tries:?}");
        let asked = wire.lock().unwrap().asked.clone();
        let chunks = (std::fs::metadata(&whole).unwrap().len()).div_ceil(TRANSFER_CHUNK);
        // Every chunk was asked for; at most the window (16) again per cut and after the
        // corrupted one, and that one again.
        assert!(
            asked.len() as u64 <= chunks + 3 * 16 + 1,
            "{} requests for {chunks} chunks",
            asked.len()
        );
        assert!(asked.iter().filter(|&&i| i == 100).count() >= 2);
        let out = dir.path().join("bundle.tar");
        let check = Check {
            name: "bundle".into(),
            digest: Digest::of(&data),
            size: Some(data.len() as u64),
            max: data.len() as u64,
            content_rules: false,
        };
        open_checked(&whole, &out, check, &worker).await.unwrap();
        assert_eq!(Digest::of(&std::fs::read(&out).unwrap()), Digest::of(&data));
    }

    fn sealed(dir: &Path, data: &[u8], to: &DeliveryIdentity) -> PathBuf {
        let path = dir.join("x.age");
        let mut f = std::fs::File::create(&path).unwrap();
        seal_bytes_to(data, &to.recipient(), &mut f).unwrap();
        path
    }

    async fn open(path: &Path, digest: Digest, id: &DeliveryIdentity) -> Result<(), String> {
        let check = Check {
            name: "x".into(),
            digest,
            size: None,
            max: 1 << 20,
            content_rules: true,
        };
        open_checked(path, &path.with_extension("out"), check, id)
            .await
            .map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn tampered_ciphertext_the_wrong_recipient_and_a_digest_mismatch_are_each_refused() {
        let dir = tempfile::tempdir().unwrap();
        let me = DeliveryIdentity::from_secret([1; 32]);
        let other = DeliveryIdentity::from_secret([2; 32]);
        let data = bytes(200_000);
        let good = Digest::of(&data);

        let p = sealed(dir.path(), &data, &other);
        let e = open(&p, good, &me).await.unwrap_err();
        assert!(
            e.contains("cannot be decrypted with this node's identity"),
            "{e}"
        );

        let p = sealed(dir.path(), &data, &me);
        let mut bytes_on_disk = std::fs::read(&p).unwrap();
        let mid = bytes_on_disk.len() / 2;
        bytes_on_disk[mid] ^= 1;
        std::fs::write(&p, &bytes_on_disk).unwrap();
        let e = open(&p, good, &me).await.unwrap_err();
        assert!(e.contains("tampered or truncated"), "{e}");

        let p = sealed(dir.path(), &data, &me);
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len - 100)
            .unwrap();
        let e = open(&p, good, &me).await.unwrap_err();
        assert!(e.contains("tampered or truncated"), "{e}");

        let p = sealed(dir.path(), &data, &me);
        let e = open(&p, Digest::of(b"other"), &me).await.unwrap_err();
        assert!(e.contains("pinned"), "{e}");
        // A refusal leaves nothing behind: no output, no checking file.
        assert!(!p.with_extension("out").exists());
        assert!(!p.with_extension("checking").exists());

        let p = sealed(dir.path(), &data, &me);
        open(&p, good, &me).await.unwrap();
        assert_eq!(std::fs::read(p.with_extension("out")).unwrap(), data);
    }

    #[tokio::test]
    async fn a_resumed_fetch_keeps_only_the_chunks_that_still_match() {
        // The part file is not synced: after a machine crash its tail may be torn. The
        // resumed fetch hashes what was kept again and asks again from the first chunk
        // that does not match.
        let dir = tempfile::tempdir().unwrap();
        let worker = DeliveryIdentity::from_secret([3; 32]);
        let data = bytes(4 << 20);
        let server = Server::new(dir.path(), package(dir.path(), &data, &worker));
        let wire = Arc::new(Mutex::new(Wire {
            cut_at_request: vec![12],
            ..Wire::default()
        }));
        let ask = wired(&wire, &server);
        let part = dir.path().join("fetch").join("bundle.age.part");
        let expect = Expect {
            known: None,
            max_plain: 5 << 20,
        };
        let r = fetch_object(&part, &object(), expect, &ask, &mut |_, _| {}).await;
        assert!(matches!(r, Err(FetchError::Transient(_))), "{r:?}");
        let kept = std::fs::metadata(&part).unwrap().len() / TRANSFER_CHUNK;
        assert!(kept >= 6, "{kept} chunks kept");
        // Chunk 4 torn on disk.
        let mut torn = std::fs::read(&part).unwrap();
        torn[4 * TRANSFER_CHUNK as usize + 17] ^= 0x55;
        std::fs::write(&part, torn).unwrap();
        let before = wire.lock().unwrap().asked.len();
        let whole = fetch_object(&part, &object(), expect, &ask, &mut |_, _| {})
            .await
            .unwrap();
        assert_eq!(
            wire.lock().unwrap().asked[before],
            4,
            "asked again from chunk 4"
        );
        let out = dir.path().join("bundle.tar");
        let check = Check {
            name: "bundle".into(),
            digest: Digest::of(&data),
            size: Some(data.len() as u64),
            max: 5 << 20,
            content_rules: false,
        };
        open_checked(&whole, &out, check, &worker).await.unwrap();
        assert!(std::fs::read(&out).unwrap() == data);
    }

    /// A delivery of one output, `data` sealed to `requester`, as its worker would sign
    /// it; the chunks come from `p` (the same file, as a package is served).
    fn manifest(data: &[u8], size: u64, root: Digest) -> cannabis_protocol::DeliveryManifest {
        cannabis_protocol::DeliveryManifest {
            job_id: Uuid([7; 16]),
            task: 0,
            rank: 0,
            epoch: 1,
            worker: cannabis_market::testkit::keys(1).address(),
            requester: cannabis_market::testkit::keys(2).address(),
            adapter: cannabis_protocol::AdapterKind::Process,
            bundle: Digest([1; 32]),
            inputs: Vec::new(),
            exit_code: Some(0),
            outputs: vec![cannabis_protocol::OutputDigest {
                name: "blob.bin".into(),
                digest: Digest::of(data),
                size_bytes: data.len() as u64,
                cipher_size: size,
                cipher_root: root,
            }],
            configuration: Vec::new(),
            datasets: Vec::new(),
            models: Vec::new(),
            dependencies: Vec::new(),
            hardware: String::new(),
            usage: Default::default(),
            evaluation: None,
            issued_at: cannabis_protocol::Timestamp(0),
        }
    }

    #[tokio::test]
    async fn an_output_opened_while_it_arrives_survives_cuts_and_a_lost_fetch_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let requester = DeliveryIdentity::from_secret([5; 32]);
        let data = bytes(16 << 20);
        let server = Server::new(dir.path(), package(dir.path(), &data, &requester));
        // What the fetch will ask for (the package file stands for the sealed output).
        let first = TransferRequest {
            object: ObjectRef {
                kind: ObjectKind::Output,
                name: "blob.bin".into(),
                ..object()
            },
            index: 0,
        };
        let TransferResponse::Chunk { size, root, .. } = server.serve(&first) else {
            panic!("not served")
        };
        let m = manifest(&data, size, root);
        let ours = dir.path().join("requester");
        let kept = cannabis_node::delivery::rank_dir(&ours, &m.job_id, 0, 0).join("blob.bin");
        // A fetch whose connection goes for good after 20 chunks: nothing is opened.
        let gone = Arc::new(Mutex::new(Wire {
            cut_at_request: (21..10_000).collect(),
            ..Wire::default()
        }));
        let r = fetch(&ours, &requester, &m, wired(&gone, &server), |_, _| {}).await;
        assert!(matches!(r, Err(FetchError::Transient(_))), "{r:?}");
        assert!(!kept.exists());
        assert!(!kept.with_extension("checking").exists());
        // Then two more tries, the first cut again: the last resumes and opens it whole.
        let wire = Arc::new(Mutex::new(Wire {
            cut_at_request: vec![15],
            ..Wire::default()
        }));
        let ask = wired(&wire, &server);
        let r = fetch(&ours, &requester, &m, &ask, |_, _| {}).await;
        assert!(matches!(r, Err(FetchError::Transient(_))), "{r:?}");
        let got = fetch(&ours, &requester, &m, &ask, |_, _| {}).await.unwrap();
        assert_eq!(got[0].digest, Digest::of(&data));
        assert!(
            std::fs::read(&kept).unwrap() == data,
            "the bytes kept are the output"
        );
        // Resumed: the chunks kept by the first tries were not asked for again.
        let chunks = size.div_ceil(TRANSFER_CHUNK) as usize;
        assert!(
            wire.lock().unwrap().asked.len() < chunks,
            "{:?}",
            wire.lock().unwrap().asked
        );
    }

    #[tokio::test]
    async fn an_oversize_package_is_refused_before_its_chunks_are_taken() {
        let dir = tempfile::tempdir().unwrap();
        let worker = DeliveryIdentity::from_secret([3; 32]);
        let data = bytes(3 << 20);
        let server = Server::new(dir.path(), package(dir.path(), &data, &worker));
        let asked = Mutex::new(0);
        let ask = |req: TransferRequest| {
            *asked.lock().unwrap() += 1;
            let r = server.serve(&req);
            async move { Ok(r) }
        };
        let part = dir.path().join("f").join("bundle.age.part");
        let expect = Expect {
            known: None,
            max_plain: 1 << 20,
        };
        let e = fetch_object(&part, &object(), expect, &ask, &mut |_, _| {})
            .await
            .unwrap_err();
        assert!(matches!(e, FetchError::Bad(_)), "{e}");
        assert!(e.to_string().contains("over what"), "{e}");
        assert_eq!(*asked.lock().unwrap(), 1);
    }

    /// Debian's `age` decrypts what the node encrypts, and the other way round.
    #[tokio::test]
    async fn the_age_tool_and_the_node_read_each_others_files() {
        if std::process::Command::new("age")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("skipped: the age command is not installed (apt-get install age)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let id = DeliveryIdentity::from_secret([9; 32]);
        let id_file = dir.path().join("key.txt");
        std::fs::write(&id_file, format!("{}\n", &*id.to_age_string())).unwrap();
        let data = bytes(300_000);

        let ours = sealed(dir.path(), &data, &id);
        let o = std::process::Command::new("age")
            .arg("-d")
            .arg("-i")
            .arg(&id_file)
            .arg(&ours)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, data);

        let plain = dir.path().join("plain");
        std::fs::write(&plain, &data).unwrap();
        let theirs = dir.path().join("theirs.age");
        let o = std::process::Command::new("age")
            .arg("-r")
            .arg(id.recipient().to_string())
            .arg("-o")
            .arg(&theirs)
            .arg(&plain)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        open(&theirs, Digest::of(&data), &id).await.unwrap();
        assert_eq!(std::fs::read(theirs.with_extension("out")).unwrap(), data);
    }
}
