//! `/metrics` on a testnet node, as Prometheus scrapes it: no token, the text format that
//! `promtool check metrics` accepts, and counters that move when messages flow.

use std::io::{Read as _, Write as _};
use std::path::Path;
use std::time::{Duration, Instant};

use super::testnet::Testnet;

/// `GET path` on the node's API without its token: status line and body.
fn get(data_dir: &Path, path: &str) -> (String, String) {
    let info = cannabis_api::NodeInfo::read(data_dir).unwrap();
    let mut s = std::net::TcpStream::connect(info.api.unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The value of the sample named `name` (with its labels, if any), from the text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn metrics_are_served_without_the_token_and_move_with_the_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let net = Testnet::up(&dir.path().join("net"), 3);
    let nodes = net.nodes();
    super::testnet::wait_for_workers(&nodes[0], 3);

    let (status, first) = get(&nodes[0], "/metrics");
    assert!(status.contains("200"), "{status}");
    assert_eq!(sample(&first, "cannabis_peers"), Some(2.0), "{first}");
    assert_eq!(sample(&first, "cannabis_ads"), Some(3.0), "{first}");
    let accepted = "cannabis_gossip_messages_received_total{verdict=\"accepted\"}";
    let before = sample(&first, accepted).unwrap_or(0.0);
    assert!(sample(&first, "cannabis_store_bytes").unwrap() > 0.0);
    // Every node wrote the ads it took: each write was timed.
    assert!(
        sample(&first, "cannabis_store_write_seconds_count").unwrap() > 0.0,
        "{first}"
    );
    assert!(
        sample(&first, "cannabis_store_write_seconds_sum").unwrap() > 0.0,
        "{first}"
    );
    // Everything else still needs the token.
    let (status, _) = get(&nodes[0], "/v1/status");
    assert!(status.contains("401"), "{status}");

    // An offer published elsewhere arrives by gossip: the counter moves.
    let file = dir.path().join("job.toml");
    std::fs::write(
        &file,
        "deadline = \"10m\"\nbid_window = \"5m\"\n[[task]]\nname = \"t\"\nbudget = 1000\n\
         [task.workload]\nadapter = \"synthetic\"\n",
    )
    .unwrap();
    let o = super::settle::cannabis(
        &nodes[1],
        &["job", "submit", file.to_str().unwrap(), "--yes"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let until = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let (_, text) = get(&nodes[0], "/metrics");
        if sample(&text, accepted).unwrap_or(0.0) > before
            && sample(&text, "cannabis_offers") == Some(1.0)
        {
            break text;
        }
        assert!(Instant::now() < until, "no gossip counted:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let (_, requester) = get(&nodes[1], "/metrics");
    assert_eq!(
        sample(
            &requester,
            "cannabis_gossip_messages_published_total{kind=\"offer\"}"
        ),
        Some(1.0),
        "{requester}"
    );
    assert_eq!(
        sample(&requester, "cannabis_jobs{state=\"open\"}"),
        Some(1.0),
        "{requester}"
    );

    // promtool, where Debian's prometheus package is installed (CI installs it).
    let Ok(mut check) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    else {
        eprintln!("skipped the promtool check: promtool is not installed (Debian: prometheus)");
        return;
    };
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    drop(net);
}
