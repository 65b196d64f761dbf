//! The capability ad tells the truth about work: a real `cannabis node run` offers only the
//! adapters its executor would take now (requesters' own programs only on the owner's
//! opt-in, nothing while paused), and a node with no executor offers no capacity until
//! its executor opens on a later try.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use cannabis_api::{Ad, ApiClient};
use cannabis_protocol::AdapterKind;

use super::exec::open_dir;
use super::supervisor::Proc;

/// Starts a node with `config` (TOML) and `ceilings`, and waits for its API.
fn start(dir: &Path, config: &str, ceilings: &Path) -> Proc {
    std::fs::write(dir.join("node.toml"), config).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(dir)
        .args([
            "node",
            "run",
            "--no-mdns",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ])
        .args(["--api", "127.0.0.1:0", "--config"])
        .arg(dir.join("node.toml"))
        .arg("--ceilings")
        .arg(ceilings)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let node = Proc(child);
    wait(|| dir.join("node.json").exists() && ApiClient::from_data_dir(dir).is_ok());
    node
}

fn wait(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The node's own ad, once it says what `done` wants (the newest one it holds).
fn own_ad(dir: &Path, done: impl Fn(&Ad) -> bool) -> Ad {
    let client = ApiClient::from_data_dir(dir).unwrap();
    let me = client.status().unwrap().address;
    let mut last = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ad = client
            .get::<Vec<Ad>>("/v1/market/ads")
            .unwrap()
            .into_iter()
            .find(|a| a.node == me);
        if let Some(ad) = ad {
            if done(&ad) {
                return ad;
            }
            last = Some(ad);
        }
        assert!(
            Instant::now() < deadline,
            "the ad never changed as expected: {last:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn control(dir: &Path, control: &str) {
    let _: serde_json::Value = ApiClient::from_data_dir(dir)
        .unwrap()
        .post(
            "/v1/exec/control",
            &serde_json::json!({ "control": control }),
        )
        .unwrap();
}

#[test]
fn the_ad_offers_only_the_work_the_executor_takes_now() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: custom code runs only where the executor is root");
        return;
    }
    let machine = Path::new("/nonexistent/ceilings.toml");

    // Defaults: the synthetic task only; requesters' programs are the owner's opt-in.
    let a = open_dir();
    let _node_a = start(a.path(), "", machine);
    let ad = own_ad(a.path(), |ad| ad.cpu_cores > 0);
    assert_eq!(ad.adapters, vec![AdapterKind::Synthetic]);
    // Paused: nothing offered; resumed: offered again. Each is a new ad.
    control(a.path(), "paused");
    let paused = own_ad(a.path(), |ad| ad.adapters.is_empty());
    assert!(paused.seq > ad.seq);
    control(a.path(), "active");
    let resumed = own_ad(a.path(), |ad| !ad.adapters.is_empty());
    assert_eq!(resumed.adapters, vec![AdapterKind::Synthetic]);

    // The owner opted in, and the executor (root, every layer) runs custom code.
    let b = open_dir();
    let _node_b = start(b.path(), "[worker]\ncustom_code = true\n", machine);
    let ad = own_ad(b.path(), |ad| ad.cpu_cores > 0);
    assert_eq!(ad.adapters, cannabis_node::exec::machine_adapters());
    assert!(
        ad.adapters
            .starts_with(&[AdapterKind::Process, AdapterKind::Synthetic])
    );

    // An owner limit under a whole core advertises no whole core: a task asking one would
    // be refused by admission, so the ad must not draw its bids. (It said 1 core.)
    let d = open_dir();
    let _node_d = start(d.path(), "[executor]\ncpu = 0.5\n", machine);
    let ad = own_ad(d.path(), |ad| !ad.adapters.is_empty());
    assert_eq!(ad.cpu_cores, 0, "{ad:#?}");

    // No executor (its ceilings file is broken): no capacity for work at all.
    let c = open_dir();
    let broken = c.path().join("ceilings.toml");
    std::fs::write(&broken, "cpu = \"many\"\n").unwrap();
    let _node_c = start(c.path(), "[worker]\ncustom_code = true\n", &broken);
    let client = ApiClient::from_data_dir(c.path()).unwrap();
    wait(|| {
        client
            .get::<serde_json::Value>("/v1/exec")
            .is_ok_and(|s| s["unavailable"].is_string())
    });
    let status = client.status().unwrap();
    assert!(status.executor.starts_with("none:"), "{}", status.executor);
    let ad = own_ad(c.path(), |_| true);
    assert!(ad.adapters.is_empty(), "{ad:#?}");
    assert_eq!(
        (ad.cpu_cores, ad.memory_bytes, ad.gpus),
        (0, 0, 0),
        "{ad:#?}"
    );

    // The administrator mends the file: the node tries its executor again by itself (5 s
    // after the failure, then less often), and offers work without a restart.
    std::fs::write(&broken, "cpu = 1\n").unwrap();
    let mended = own_ad(c.path(), |ad| !ad.adapters.is_empty());
    assert!(mended.seq > ad.seq);
    assert_eq!(mended.adapters, cannabis_node::exec::machine_adapters());
    assert_eq!(mended.cpu_cores, 1, "{mended:#?}");
    let status = client.status().unwrap();
    assert!(!status.executor.starts_with("none:"), "{}", status.executor);
}
