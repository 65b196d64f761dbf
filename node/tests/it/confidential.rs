//! The confidential-execution gate on real `cannabis` processes: on a testnet a job that
//! requires confidential execution goes only to the node advertising a `dev` attestation
//! (node 3 of `testnet up`), which every view labels insecure; outside a testnet the `dev`
//! attestation is refused at start and such a job is refused with the reason.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use cannabis_api::ApiClient;
use cannabis_market::job::JobState;

use super::testnet::{Restarted, Testnet};

fn cannabis(data_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn client(dir: &Path) -> ApiClient {
    ApiClient::from_data_dir(dir).unwrap()
}

const JOB: &str = r#"
name = "secret"
deadline = "5m"
bid_window = "2s"
[[task]]
name = "secret"
budget = 300_000
[task.workload]
adapter = "synthetic"
entrypoint = ["64"]
[task.resources]
cpu = 0.25
memory = "256MiB"
storage = "16MiB"
[task.requirements]
confidential = true
"#;

#[test]
fn a_confidential_job_runs_only_on_the_dev_attested_node_of_a_testnet() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: leased work runs only where the executor is root");
        return;
    }
    let dir = super::exec::open_dir();
    let net = Testnet::up(&dir.path().join("net"), 4);
    let nodes = net.nodes();
    let requester = &nodes[0];
    let attested = client(&nodes[3]).status().unwrap().address;

    // Every worker's ad is known, and node 3's evidence is shown as what it is.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let ads = client(requester)
            .get::<Vec<cannabis_api::Ad>>("/v1/market/ads")
            .unwrap();
        let workers = ads.iter().filter(|a| a.cpu_cores > 0).count();
        if workers >= 3 && ads.iter().any(|a| a.node == attested && a.cpu_cores > 0) {
            let evidence: Vec<_> = ads.iter().filter(|a| a.attestation.is_some()).collect();
            assert_eq!(evidence.len(), 1, "{ads:#?}");
            assert_eq!(evidence[0].node, attested);
            assert_eq!(evidence[0].attestation_verdict, Some(Ok(())));
            break;
        }
        assert!(Instant::now() < until, "the ads did not arrive");
        std::thread::sleep(Duration::from_millis(200));
    }
    let o = cannabis(requester, &["market", "ads"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let shown = text(&o.stdout);
    assert!(
        shown.contains("attestation dev (INSECURE") && shown.contains("verifies here"),
        "{shown}"
    );

    // The job goes to node 3 alone, although cheaper workers match everything else.
    let file = dir.path().join("secret.toml");
    std::fs::write(&file, JOB).unwrap();
    let o = cannabis(
        requester,
        &["job", "submit", file.to_str().unwrap(), "--yes", "--json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let published: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = published["job_id"].as_str().unwrap().to_string();
    let until = Instant::now() + Duration::from_secs(90);
    let job = loop {
        let j = client(requester).job(&id).unwrap();
        if j.summary.state == JobState::Completed {
            break j;
        }
        assert!(
            Instant::now() < until && j.summary.state == JobState::Open,
            "{:#?}",
            j.history
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let task = &job.tasks[0];
    assert_eq!(task.ranks[0].worker.to_string(), attested);
    assert!(
        task.bids.iter().all(|(w, _)| *w == attested),
        "bids from {:?}",
        task.bids
    );
    assert!(task.delivered.iter().all(|o| o.fetched), "{task:#?}");
    let o = cannabis(requester, &["job", "status", &id]);
    assert!(
        text(&o.stdout).contains("requires confidential execution")
            && text(&o.stdout).contains("INSECURE"),
        "{}",
        text(&o.stdout)
    );
    // No other worker held a lease for it.
    for n in &nodes[1..3] {
        let leases = client(n).leases().unwrap();
        assert!(leases.iter().all(|l| l.job_id != id), "{leases:#?}");
    }
}

#[test]
fn outside_a_testnet_the_dev_attestation_confidential_jobs_and_testnet_faults_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fee = cannabis_market::testkit::fee_terms();
    let config = |attestation: &str| {
        format!(
            "{attestation}[gossip.fee]\nrate_bps = {}\nrecipient = \"{}\"\n",
            fee.rate_bps, fee.recipient
        )
    };
    let run = |data: &Path, file: &Path| -> Vec<String> {
        let mut args = vec![
            env!("CARGO_BIN_EXE_cannabis").to_string(),
            "--data-dir".into(),
        ];
        args.push(data.display().to_string());
        args.extend(
            [
                "node",
                "run",
                "--no-mdns",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
            ]
            .map(String::from),
        );
        args.extend(["--api", "127.0.0.1:0", "--config"].map(String::from));
        args.push(file.display().to_string());
        args
    };

    // A node that would advertise a dev attestation does not start.
    let dev = dir.path().join("dev.toml");
    std::fs::write(&dev, config("attestation = \"dev\"\n")).unwrap();
    let args = run(&dir.path().join("dev"), &dev);
    let o = Command::new(&args[0]).args(&args[1..]).output().unwrap();
    assert!(!o.status.success());
    let e = text(&o.stderr);
    assert!(e.contains("insecure") && e.contains("--testnet"), "{e}");

    // An ordinary node refuses a confidential job: no evidence can verify here.
    let plain = dir.path().join("plain.toml");
    std::fs::write(&plain, config("")).unwrap();
    let data = dir.path().join("plain");
    let _node = Restarted::start(&run(&data, &plain));
    let until = Instant::now() + Duration::from_secs(30);
    while ApiClient::from_data_dir(&data).is_err_and(|_| Instant::now() < until) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let file = dir.path().join("secret.toml");
    std::fs::write(&file, JOB).unwrap();
    let o = cannabis(&data, &["job", "submit", file.to_str().unwrap(), "--yes"]);
    assert!(!o.status.success(), "{}", text(&o.stdout));
    let e = text(&o.stderr);
    assert!(
        e.contains("task 0 requires confidential execution") && e.contains("testnets only"),
        "{e}"
    );
    assert!(client(&data).jobs().unwrap().is_empty());

    // The testnet's faults are refused by an ordinary node.
    let e = client(&data)
        .post::<_, cannabis_api::Corrupt>(
            "/v1/testnet/corrupt",
            &cannabis_api::Corrupt { on: true },
        )
        .unwrap_err();
    assert!(format!("{e:#}").contains("only a testnet node"), "{e:#}");
    let e = client(&data)
        .post::<_, cannabis_api::Partition>(
            "/v1/testnet/partition",
            &cannabis_api::Partition { peers: Vec::new() },
        )
        .unwrap_err();
    assert!(format!("{e:#}").contains("only a testnet node"), "{e:#}");
}
