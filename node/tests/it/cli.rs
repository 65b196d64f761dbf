//! The CLI end to end: keys, quotes, the demo, errors and help.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Output};

fn cannabis(data_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env_remove("CANNABIS_DATA_DIR")
        .output()
        .expect("the cannabis binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn keys_new_show_and_address_agree() {
    let dir = tempfile::tempdir().unwrap();
    let made = cannabis(dir.path(), &["keys", "new", "--json"]);
    assert!(made.status.success(), "{}", stderr(&made));
    let made: serde_json::Value = serde_json::from_slice(&made.stdout).unwrap();
    let address = made["address"].as_str().unwrap().to_string();
    assert!(address.starts_with("cpc1"), "{address}");
    assert!(
        made["delivery_recipient"]
            .as_str()
            .unwrap()
            .starts_with("age1")
    );

    let keys = dir.path().join("keys");
    assert_eq!(mode(&keys), 0o700);
    assert_eq!(mode(&keys.join("node.key")), 0o600);
    assert_eq!(mode(&keys.join("delivery.age")), 0o600);
    assert_eq!(std::fs::metadata(keys.join("node.key")).unwrap().len(), 32);
    let age = std::fs::read_to_string(keys.join("delivery.age")).unwrap();
    assert!(
        age.lines().any(|l| l.starts_with("AGE-SECRET-KEY-1")),
        "{age}"
    );

    let shown = cannabis(dir.path(), &["keys", "show", "--json"]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown, made);

    let addr = cannabis(dir.path(), &["keys", "address"]);
    assert_eq!(stdout(&addr).trim(), address);

    let table = cannabis(dir.path(), &["keys", "show"]);
    assert!(stdout(&table).contains(&address));
}

/// The operator guide's backup and restore, command for command: the keys archived with
/// their modes and unpacked into a fresh data directory give the same address, and the
/// node accepts them (it refuses keys others can read).
#[test]
fn the_guides_backup_and_restore_keep_the_nodes_identity() {
    let dir = tempfile::tempdir().unwrap();
    let old = dir.path().join("old");
    assert!(cannabis(&old, &["keys", "new"]).status.success());
    let address = stdout(&cannabis(&old, &["keys", "address"]));
    let archive = dir.path().join("cannabis-keys.tar");
    let ok = std::process::Command::new("tar")
        .arg("-C")
        .arg(&old)
        .arg("-cpf")
        .arg(&archive)
        .arg("keys")
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar -cpf");
    let new = dir.path().join("new");
    std::fs::create_dir_all(&new).unwrap();
    let ok = std::process::Command::new("tar")
        .arg("-C")
        .arg(&new)
        .arg("-xpf")
        .arg(&archive)
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar -xpf");
    assert_eq!(mode(&new.join("keys")), 0o700);
    assert_eq!(mode(&new.join("keys/node.key")), 0o600);
    let restored = cannabis(&new, &["keys", "address"]);
    assert!(restored.status.success(), "{}", stderr(&restored));
    assert_eq!(stdout(&restored), address);
    let shown = cannabis(&new, &["keys", "show", "--json"]);
    let old_shown = cannabis(&old, &["keys", "show", "--json"]);
    let field = |o: &std::process::Output, k: &str| {
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()[k].clone()
    };
    assert_eq!(
        field(&shown, "delivery_recipient"),
        field(&old_shown, "delivery_recipient")
    );
}

#[test]
fn existing_keys_are_never_silently_replaced() {
    let dir = tempfile::tempdir().unwrap();
    assert!(cannabis(dir.path(), &["keys", "new"]).status.success());
    let first = stdout(&cannabis(dir.path(), &["keys", "address"]));

    let again = cannabis(dir.path(), &["keys", "new"]);
    assert!(!again.status.success());
    assert!(stderr(&again).contains("--force"), "{}", stderr(&again));
    assert_eq!(stdout(&cannabis(dir.path(), &["keys", "address"])), first);

    let forced = cannabis(dir.path(), &["keys", "new", "--force"]);
    assert!(forced.status.success(), "{}", stderr(&forced));
    assert_ne!(stdout(&cannabis(dir.path(), &["keys", "address"])), first);
    // The old key is kept aside, not deleted.
    let kept: Vec<_> = std::fs::read_dir(dir.path().join("keys"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("node.key.replaced-"))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
}

#[test]
fn a_key_others_can_read_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    assert!(cannabis(dir.path(), &["keys", "new"]).status.success());
    let key = dir.path().join("keys/node.key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = cannabis(dir.path(), &["keys", "show"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("0644") && err.contains("chmod 600"), "{err}");
}

#[test]
fn a_key_of_the_wrong_length_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    assert!(cannabis(dir.path(), &["keys", "new"]).status.success());
    let key = dir.path().join("keys/node.key");
    std::fs::write(&key, [7u8; 31]).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let o = cannabis(dir.path(), &["keys", "address"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("exactly 32 bytes, found 31"), "{err}");
    assert!(err.contains("node.key"), "{err}");
}

#[test]
fn missing_keys_say_how_to_create_them() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(dir.path(), &["keys", "show"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannabis keys new"), "{}", stderr(&o));
}

#[test]
fn job_quote_shows_budget_share_and_fee() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(dir.path(), &["job", "quote", "1_000_001", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let q: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(q["total"], 1_000_001);
    assert_eq!(q["worker_share"], 990_001);
    assert_eq!(q["fee"], 10_000);
    assert_eq!(q["fee_rate_bps"], 100);

    let table = stdout(&cannabis(dir.path(), &["job", "quote", "100"]));
    assert!(
        table.contains("total budget") && table.contains("1.00%"),
        "{table}"
    );

    // A leading '-' is taken for a flag by the parser; it fails all the same.
    assert!(
        !cannabis(dir.path(), &["job", "quote", "-3"])
            .status
            .success()
    );
    for bad in ["12.5", "lots", "18446744073709551616", "1e6"] {
        let o = cannabis(dir.path(), &["job", "quote", bad]);
        assert!(!o.status.success(), "{bad} accepted");
        assert!(stderr(&o).contains("base units"), "{}", stderr(&o));
    }
    let o = cannabis(dir.path(), &["job", "quote", "100", "--fee-bps", "10001"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("10000 bps"), "{}", stderr(&o));
}

#[test]
fn ledger_bench_commits_every_transaction_in_durable_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = dir.path().join("bench");
    let args = [
        "ledger",
        "bench",
        "--txs",
        "1200",
        "--accounts",
        "40",
        "--block-txs",
        "500",
        "--results",
        "300",
        "--json",
        "--dir",
    ];
    let mut args: Vec<&str> = args.to_vec();
    args.push(blocks.to_str().unwrap());
    let o = cannabis(dir.path(), &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let b: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(b["txs"], 1200);
    assert_eq!(b["blocks"], 3, "500 a block: {b}");
    assert_eq!(b["results"], 300);
    assert!(b["tx_per_s"].as_f64().unwrap() > 0.0, "{b}");
    // The blocks are in the file, committed.
    assert!(std::fs::metadata(blocks.join("ledger.redb")).unwrap().len() > 1200 * 100);
    let bad = cannabis(
        dir.path(),
        &[
            "ledger",
            "bench",
            "--accounts",
            "0",
            "--dir",
            blocks.to_str().unwrap(),
        ],
    );
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("--accounts"), "{}", stderr(&bad));
}

#[test]
fn demo_walks_a_job_through_the_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(dir.path(), &["demo", "--size", "32", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = s["settlements"].as_array().unwrap();
    assert_eq!(rows.len(), 7);
    for r in rows {
        let sum = r["worker_paid"].as_u64().unwrap()
            + r["fee_paid"].as_u64().unwrap()
            + r["refunded"].as_u64().unwrap();
        assert_eq!(sum, r["locked"].as_u64().unwrap(), "{r}");
    }
    assert!(s["result_hash"].as_str().unwrap().starts_with("0x"));
    // The price is the worker engine's own quote: its sheet's 800,000 a core-hour, for
    // the task's one core until its deadline an hour away.
    assert_eq!(s["price"].as_u64(), Some(800_000), "{s}");

    let human = cannabis(dir.path(), &["demo", "--size", "16"]);
    assert!(human.status.success(), "{}", stderr(&human));
    assert!(stdout(&human).contains("Every path balances"));
    assert!(
        stdout(&human).contains("before the bid window ends"),
        "{}",
        stdout(&human)
    );
}

#[test]
fn version_and_help_on_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let v = cannabis(dir.path(), &["--version"]);
    assert_eq!(
        stdout(&v).trim(),
        format!("cannabis {}", env!("CARGO_PKG_VERSION"))
    );
    for cmd in [
        vec![],
        vec!["node"],
        vec!["node", "run"],
        vec!["node", "status"],
        vec!["node", "peers"],
        vec!["node", "ping"],
        vec!["market"],
        vec!["market", "ads"],
        vec!["market", "offers"],
        vec!["market", "bids"],
        vec!["market", "leases"],
        vec!["testnet"],
        vec!["testnet", "up"],
        vec!["testnet", "down"],
        vec!["testnet", "bench"],
        vec!["testnet", "attack"],
        vec!["testnet", "sim"],
        vec!["keys"],
        vec!["keys", "new"],
        vec!["keys", "show"],
        vec!["keys", "address"],
        vec!["job"],
        vec!["job", "quote"],
        vec!["job", "submit"],
        vec!["job", "status"],
        vec!["job", "list"],
        vec!["job", "cancel"],
        vec!["demo"],
    ] {
        let mut args = cmd.clone();
        args.push("--help");
        let o = cannabis(dir.path(), &args);
        assert!(o.status.success(), "{cmd:?}: {}", stderr(&o));
        let text = stdout(&o);
        assert!(text.contains("Usage: cannabis"), "{cmd:?}: {text}");
    }
}

#[test]
fn unknown_commands_fail_with_usage() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(dir.path(), &["frobnicate"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("Usage"), "{}", stderr(&o));
}

/// What Ctrl-C in a terminal sends.
fn interrupt(child: &std::process::Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
}

fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

fn node_pids(dir: &Path) -> Vec<u32> {
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("testnet.json")).unwrap()).unwrap();
    record["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["pid"].as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn testnet_up_runs_real_nodes_and_down_and_ctrl_c_stop_them() {
    use std::io::{BufRead as _, BufReader};
    // Reachable by the nodes' sandbox uids (tempdirs are 0700).
    let dir = super::exec::open_dir();
    let net = dir.path().join("net");
    let up = || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cannabis"))
            .args(["testnet", "up", "--nodes", "3", "--dir"])
            .arg(&net)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut apis = 0;
        for line in lines.by_ref() {
            let line = line.unwrap();
            if line.contains("127.0.0.1:") {
                apis += 1;
            }
            if line.contains("Ctrl-C") {
                break;
            }
        }
        assert_eq!(apis, 3, "testnet up printed {apis} API addresses");
        child
    };

    // Up: three processes whose APIs answer and which find each other.
    let mut child = up();
    let pids = node_pids(&net);
    assert_eq!(pids.len(), 3);
    assert!(pids.iter().all(|p| pid_alive(*p)));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let o = cannabis(&net.join("node-2"), &["market", "ads", "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let ads: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        if ads.as_array().unwrap().len() == 3 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node 2 never saw 3 ads: {ads}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let status = cannabis(&net.join("node-1"), &["node", "status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert!(status["connected_peers"].as_u64().unwrap() >= 1, "{status}");

    // Down, from another process, stops every node.
    let down = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .args(["testnet", "down", "--dir"])
        .arg(&net)
        .output()
        .unwrap();
    assert!(down.status.success(), "{}", stderr(&down));
    assert!(
        stdout(&down).contains("stopped 3 nodes"),
        "{}",
        stdout(&down)
    );
    assert!(
        pids.iter().all(|p| !pid_alive(*p)),
        "nodes survived testnet down"
    );
    // `testnet up` sees its nodes gone and ends by itself.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let ended = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "testnet up kept running after testnet down"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(ended.success());

    // Ctrl-C on `testnet up` stops its nodes too.
    let mut child = up();
    let pids = node_pids(&net);
    interrupt(&child);
    assert!(child.wait().unwrap().success());
    assert!(pids.iter().all(|p| !pid_alive(*p)), "nodes survived Ctrl-C");
    assert!(!net.join("testnet.json").exists());
}

#[test]
fn node_commands_without_a_running_node_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(dir.path(), &["node", "status"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannabis node run"), "{}", stderr(&o));
}

/// Waits for the `node.json` a node writes once its swarm listens.
fn wait_node_json(data_dir: &Path) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Ok(text) = std::fs::read_to_string(data_dir.join("node.json"))
            && let Ok(info) = serde_json::from_str::<serde_json::Value>(&text)
        {
            return info;
        }
        assert!(std::time::Instant::now() < deadline, "no node.json");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn node_run_logs_json_and_stops_cleanly_on_sigterm() {
    use std::io::{BufRead as _, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(dir.path())
        .args(["--log-format", "json", "node", "run", "--no-mdns"])
        .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--api", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut started = None;
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        let entry: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if entry["fields"]["message"] == "node started" {
            started = Some(entry.clone());
        }
        if entry["fields"]["message"] == "local API listening" {
            break;
        }
    }
    let started = started.expect("a 'node started' line");
    wait_node_json(dir.path());
    assert!(
        started["fields"]["peer_id"]
            .as_str()
            .unwrap()
            .starts_with("12D3Koo"),
        "{started}"
    );
    // The identity was created on first run, and the CLI finds the running node.
    let status = cannabis(dir.path(), &["node", "status", "--json"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["peer_id"], started["fields"]["peer_id"]);
    assert_eq!(
        std::fs::metadata(dir.path().join("api.token"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
    assert!(!dir.path().join("node.json").exists());
}

#[test]
fn the_local_api_refuses_requests_without_the_token() {
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(dir.path())
        .args([
            "node",
            "run",
            "--no-mdns",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ])
        .args(["--api", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        if line.unwrap().contains("local API listening") {
            break;
        }
    }
    let info = wait_node_json(dir.path());
    let api = info["api"].as_str().unwrap();
    for auth in ["", "Authorization: Bearer wrong\r\n"] {
        let mut s = std::net::TcpStream::connect(api).unwrap();
        write!(
            s,
            "GET /v1/status HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }
    // A non-loopback API address is refused before anything starts.
    let o = cannabis(dir.path(), &["node", "run", "--api", "0.0.0.0:4999"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("loopback"), "{}", stderr(&o));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
fn probe_reports_a_complete_machine() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        "[owner]\nallowed_gpus = [\"GPU-0000\"]\n[owner.network]\nupload_bytes_per_sec = 1000000\n\
         [owner.prices]\ncpu_core_hour = 7\n",
    )
    .unwrap();
    let o = cannabis(
        dir.path(),
        &["probe", "--json", "--config", config.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(p["hardware"]["cpu_cores"].as_u64().unwrap() >= 1);
    assert!(p["hardware"]["memory_bytes"].as_u64().unwrap() > 0);
    assert!(p["hardware"]["storage_bytes"].as_u64().unwrap() > 0);
    assert!(!p["os"]["kernel"].as_str().unwrap().is_empty());
    // No NVIDIA driver here is a normal answer, and then no GPU is listed.
    let status = p["gpus"]["status"].as_str().unwrap();
    assert!(
        ["no-driver", "devices", "failed"].contains(&status),
        "{status}"
    );
    if status != "devices" {
        assert_eq!(p["hardware"]["gpus"].as_array().unwrap().len(), 0);
    }
    assert_eq!(p["network"]["upload_bytes_per_sec"], 1_000_000);
    assert_eq!(p["prices"]["cpu_core_hour"], 7);
    assert_eq!(p["kernel"].as_array().unwrap().len(), 6);
    let table = cannabis(dir.path(), &["probe"]);
    assert!(table.status.success(), "{}", stderr(&table));
    assert!(stdout(&table).contains("gpus"), "{}", stdout(&table));
}

#[test]
fn challenge_runs_proves_and_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(
        dir.path(),
        &["challenge", "--size", "64", "--rounds", "4", "--json"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["n"], 64);
    assert_eq!(r["rounds"], 4);
    assert_eq!(r["passed"], true);
    let bad = cannabis(dir.path(), &["challenge", "--size", "0"]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("outside"), "{}", stderr(&bad));
}

#[test]
fn job_submit_quotes_explains_publishes_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    // Both nodes pin the same network fee terms, as every node of a network does.
    let network = dir.path().join("network.toml");
    std::fs::write(
        &network,
        format!(
            "[gossip.fee]\nrate_bps = 100\nrecipient = \"{}\"\n",
            cannabis_market::testkit::fee_terms().recipient
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(dir.path())
        .args(["node", "run", "--no-mdns", "--config"])
        .arg(&network)
        .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--api", "127.0.0.1:0"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let info = wait_node_json(dir.path());
    // A second node, the only worker the first one can know (a node does not bid on its
    // own offers, so its own ad does not count).
    // Reachable by its sandbox uids (tempdirs are 0700), or it has no executor and bids
    // on nothing.
    let worker_dir = super::exec::open_dir();
    let bootstrap = format!(
        "{}/p2p/{}",
        info["listen_addrs"][0].as_str().unwrap(),
        info["peer_id"].as_str().unwrap()
    );
    let mut worker = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(worker_dir.path())
        .args([
            "node",
            "run",
            "--no-mdns",
            "--bootstrap",
            &bootstrap,
            "--config",
        ])
        .arg(&network)
        .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--api", "127.0.0.1:0"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/examples");
    let spec = format!("{examples}/synthetic.toml");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let ads = cannabis(dir.path(), &["market", "ads", "--json"]);
        if stdout(&ads).matches("cpc1").count() >= 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the worker's ad did not arrive"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let dry = cannabis(dir.path(), &["job", "submit", &spec, "--dry-run"]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let text = stdout(&dry);
    assert!(
        text.contains("total budget") && text.contains("200000"),
        "{text}"
    );
    assert!(
        text.contains("service fee") && text.contains("2000"),
        "{text}"
    );
    assert!(text.contains("1 of 1 known workers qualify"), "{text}");
    // The GPU example: nobody here has one, and the dry run says which requirement.
    let bundle = dir.path().join("train-bundle.tar");
    std::fs::write(&bundle, b"bundle").unwrap();
    std::fs::write(dir.path().join("eval-bundle.tar"), b"evaluator").unwrap();
    std::fs::write(dir.path().join("test.bin"), b"held out").unwrap();
    let train = dir.path().join("train.toml");
    std::fs::copy(format!("{examples}/train.toml"), &train).unwrap();
    let dry = cannabis(
        dir.path(),
        &["job", "submit", train.to_str().unwrap(), "--dry-run"],
    );
    assert!(dry.status.success(), "{}", stderr(&dry));
    let text = stdout(&dry);
    assert!(text.contains("0 of 1 known workers qualify"), "{text}");
    assert!(text.contains("GPU memory >= 24 GiB: 1 excluded"), "{text}");
    // The job's evaluation is told before it is published.
    assert!(
        text.contains("evaluated on this node once delivered: python3 evaluate.py on 1 held-out")
            && text.contains("waits for `cannabis job accept`"),
        "{text}"
    );
    // A bad file names the field.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "deadline = \"soon\"\n[[task]]\nname = \"t\"\n[task.workload]\nadapter = \"synthetic\"\n",
    )
    .unwrap();
    let o = cannabis(
        dir.path(),
        &["job", "submit", bad.to_str().unwrap(), "--yes"],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("deadline"), "{}", stderr(&o));
    // Without --yes and with no answer on stdin, nothing is published.
    let o = cannabis(dir.path(), &["job", "submit", &spec]);
    assert!(stdout(&o).contains("not published"), "{}", stdout(&o));
    // Published for real, then listed and reported.
    let o = cannabis(dir.path(), &["job", "submit", &spec, "--yes", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let job: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = job["job_id"].as_str().unwrap();
    let list = stdout(&cannabis(dir.path(), &["job", "list"]));
    assert!(
        list.contains(id) && list.contains("synthetic-check"),
        "{list}"
    );
    let status = cannabis(dir.path(), &["job", "status", id]);
    assert!(status.status.success(), "{}", stderr(&status));
    assert!(stdout(&status).contains("bidding"), "{}", stdout(&status));
    let o = cannabis(dir.path(), &["job", "status", "not-a-job"]);
    assert!(!o.status.success());
    // Before delivery, results name the rank that has not delivered...
    let out = dir.path().join("results");
    let results = |id: &str, wait: bool| {
        let mut args = vec![
            "job",
            "results",
            id,
            "--out",
            out.to_str().unwrap(),
            "--json",
        ];
        if wait {
            args.push("--wait");
        }
        cannabis(dir.path(), &args)
    };
    let o = results(id, false);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not delivered yet: task 0 (matmul) rank 0"),
        "{}",
        stderr(&o)
    );
    // ...and with --wait they wait through the bid window, the run and the delivery.
    let o = results(id, true);
    assert!(o.status.success(), "{}", stderr(&o));
    let written: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // The synthetic task delivers its result and its product.
    let names: Vec<&str> = written
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["result.json", "product.i32"], "{written}");
    for o in written.as_array().unwrap() {
        assert!(Path::new(o["path"].as_str().unwrap()).is_file(), "{o}");
    }
    // A job that ends without delivering ends the wait with the reason.
    let o = cannabis(dir.path(), &["job", "submit", &spec, "--yes", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let job: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cancelled = job["job_id"].as_str().unwrap();
    let o = cannabis(dir.path(), &["job", "cancel", cancelled]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = results(cancelled, true);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("Cancelled and will not deliver task 0 (matmul) rank 0"),
        "{}",
        stderr(&o)
    );
    for c in [&mut worker, &mut child] {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert!(c.wait().unwrap().success());
    }
}

#[test]
fn exec_run_runs_a_job_file_in_the_sandbox_and_signs_the_result() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(dir.path(), &["keys", "new"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let address = stdout(&cannabis(dir.path(), &["keys", "address"]))
        .trim()
        .to_string();
    let job = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/examples/synthetic.toml"
    );
    let out_dir = dir.path().join("out");
    let o = cannabis(
        dir.path(),
        &[
            "exec",
            "run",
            job,
            "--json",
            "--out",
            out_dir.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["attempt"]["state"], "completed", "{v}");
    assert_eq!(v["attempt"]["cleanup"], "released", "{v}");
    let result: cannabis_protocol::ComputeResult =
        serde_json::from_value(v["compute_result"].clone()).unwrap();
    result.verify().unwrap();
    assert_eq!(result.worker_address.to_string(), address);
    assert_eq!(
        result.result_hash.to_string(),
        v["attempt"]["result"]["result_hash"].as_str().unwrap()
    );
    let id = v["attempt"]["id"].as_str().unwrap();
    assert!(out_dir.join(id).join("result.json").exists());

    // A job whose bundle does not match fails with the reason, and nothing runs.
    let job = dir.path().join("bad.toml");
    std::fs::write(dir.path().join("b.tar"), b"not what was pinned").unwrap();
    std::fs::write(
        &job,
        "name = \"x\"\nbudget = 1000\ndeadline = \"1h\"\n[[task]]\nname = \"t\"\n[task.workload]\nadapter = \"process\"\ndigest = \"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\"\nentrypoint = [\"sh\"]\n",
    )
    .unwrap();
    let o = cannabis(dir.path(), &["exec", "run", job.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("pinned by digest only"),
        "{}",
        stderr(&o)
    );
}

/// The hostile benchmark on real processes: a testnet, its offers, then the same offers
/// while `testnet attack` runs every attack at once against every node. What must hold
/// whatever the machine's speed: every honest offer still reaches every node, no greedy
/// challenge is proved, no node holds more of the flood than its signer's rate allows, and
/// every node still holds every honest node's ad. (Latency figures belong to
/// docs/benchmarks.md, not to a test.)
#[test]
fn a_hostile_bench_attacks_real_nodes_and_honest_offers_still_arrive() {
    // Reachable by the nodes' sandbox uids (tempdirs are 0700).
    let dir = super::exec::open_dir();
    let net = dir.path().join("net");
    let o = cannabis(
        dir.path(),
        &[
            "testnet",
            "bench",
            "--nodes",
            "4",
            "--offers",
            "10",
            "--pings",
            "10",
            "--hostile",
            "--transfer-mib",
            "8",
            "--channel-mib",
            "4",
            "--json",
            "--dir",
            net.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // Every job of the work phase ran and delivered.
    assert_eq!(r["work_jobs"], 20, "{r}");
    assert_eq!(r["work_submit_to_delivered_ms"]["count"], 20, "{r}");
    // The transfer phase's output came back whole, and both sides were timed.
    if nix::unistd::geteuid().is_root() {
        let t = &r["transfer"];
        assert_eq!(t["bytes"], 8 << 20, "{r}");
        assert!(t["completed_to_delivered_ms"].as_u64().unwrap() > 0, "{t}");
        assert!(t["ratio"].as_f64().unwrap() > 0.0, "{t}");
    } else {
        assert!(r["transfer_skipped"].is_string(), "{r}");
    }
    // The group channel carried its bytes, and the direct baseline ran beside it.
    if nix::unistd::geteuid().is_root() {
        let c = &r["channel"];
        assert_eq!(c["bytes"], 4 << 20, "{r}");
        assert!(c["channel_mb_s"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["direct_mb_s"].as_f64().unwrap() > 0.0, "{c}");
        assert_eq!(c["channel_rtt_us"]["count"], 200, "{c}");
    } else {
        assert!(r["channel_skipped"].is_string(), "{r}");
    }
    let h = &r["hostile"];
    assert_eq!(h["receipts_seen"], h["receipts_expected"], "{h}");
    assert_eq!(h["receipts_expected"], 30);
    assert_eq!(h["nodes_holding_every_ad"], 4, "{h}");
    let a = &h["attacker"];
    assert_eq!(a["targets"], 4);
    for what in [
        "offers_published",
        "garbage_published",
        "sync_pages",
        "challenges_sent",
        "sockets_opened",
    ] {
        assert!(
            a[what].as_u64().unwrap() > 0,
            "the attacker did no {what}: {a}"
        );
    }
    assert_eq!(a["challenges_proved"], 0, "{a}");
    // The signer's burst (256) and its rate (20 a second) over the attack's 21 s.
    let held = h["flood_offers_held_max"].as_u64().unwrap();
    assert!(held <= 256 + 20 * 21, "a node held {held} of the flood");
    // No node (nor the attacker) left behind.
    let mine = net.to_string_lossy().into_owned();
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&mine))
        .collect();
    assert!(left.is_empty(), "left running: {left:?}");
}

#[test]
fn testnet_attack_takes_only_loopback_targets() {
    let dir = tempfile::tempdir().unwrap();
    let o = cannabis(
        dir.path(),
        &[
            "testnet",
            "attack",
            "--seconds",
            "1",
            "--target",
            "/ip4/192.0.2.7/tcp/4001/p2p/12D3KooWPFp93FuYJKk92KBy3otqfHV4pP41jkRQdRx8E56KE2qm",
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("loopback"), "{}", stderr(&o));
    let o = cannabis(
        dir.path(),
        &["testnet", "attack", "--dir", "no-such-testnet"],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("is a testnet running"),
        "{}",
        stderr(&o)
    );
}
