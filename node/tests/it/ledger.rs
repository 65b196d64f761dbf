//! The embedded ledger on a testnet of real `cannabis` processes: the faucet and transfers
//! reach every node's ledger through blocks; a sequencer killed with SIGKILL right after it
//! acknowledged transactions loses none of them and goes on with a valid chain; a node
//! that was away catches up and checks every block it missed; a proof-of-compute result
//! is rewarded and its inclusion proof checks against its block's `compute_root`.

use std::path::Path;
use std::time::{Duration, Instant};

use cannabis_api::{ApiClient, Balance};

use super::testnet::{Restarted, Testnet};

fn client(dir: &Path) -> ApiClient {
    ApiClient::from_data_dir(dir).unwrap()
}

/// Waits up to `secs` for `what` to hold of `dir`'s view of account `who`.
fn wait_balance(dir: &Path, who: &str, secs: u64, what: impl Fn(&Balance) -> bool) -> Balance {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Ok(b) = client(dir).balance(Some(who))
            && what(&b)
        {
            return b;
        }
        assert!(
            Instant::now() < until,
            "waited {secs} s on {}: {:?}",
            dir.display(),
            client(dir).balance(Some(who))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn transfers_reach_every_node_and_a_killed_sequencer_loses_no_acknowledged_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let net = Testnet::up(&dir.path().join("net"), 3);
    let nodes = net.nodes();
    let addr = |i: usize| client(&nodes[i]).status().unwrap().address;
    let (a1, a2) = (addr(1), addr(2));
    let status = client(&nodes[1]).ledger().unwrap();
    assert!(!status.sequencing);
    assert!(client(&nodes[0]).ledger().unwrap().sequencing);
    let supply = status.supply;
    // What the genesis gave nodes 1 and 2.
    let f1 = client(&nodes[1]).balance(None).unwrap().balance.0;
    let f2 = client(&nodes[2]).balance(None).unwrap().balance.0;
    assert!(f1 > 0 && f2 > 0, "testnet nodes start funded");

    // The faucet: node 1 asks, and every node's ledger shows the grant.
    let granted = client(&nodes[1]).faucet().unwrap();
    assert_eq!(granted.from, status.sequencer);
    for n in &nodes {
        wait_balance(n, &a1, 20, |b| b.balance.0 == f1 + 1_000_000_000);
    }
    // A second grant within the minute is refused, with the reason.
    let again = client(&nodes[1]).faucet().unwrap_err();
    assert!(
        format!("{again:#}").contains("less than 60 s ago"),
        "{again:#}"
    );

    // A transfer: node 1 pays node 2; the network fee is charged apart.
    let sent = client(&nodes[1])
        .send(&a2, cannabis_protocol::Amount(250_000))
        .unwrap();
    assert_eq!(sent.fee.0, 21_000);
    for n in &nodes {
        wait_balance(n, &a2, 20, |b| b.balance.0 == f2 + 250_000);
        wait_balance(n, &a1, 20, |b| {
            b.balance.0 == f1 + 1_000_000_000 - 250_000 - 21_000 && b.nonce == 1
        });
    }
    // More than node 2 can spend: refused at once, and its nonce is not used.
    let over = client(&nodes[2])
        .send(&a1, cannabis_protocol::Amount(f2 * 10))
        .unwrap_err();
    assert!(format!("{over:#}").contains("spendable"), "{over:#}");
    assert_eq!(client(&nodes[2]).balance(None).unwrap().nonce, 0);

    // The very transaction sent again (its first answer lost on the way) is acknowledged
    // again, by the same id, and kept once; it does not cost its sender a refusal.
    let k = cannabis_protocol::Keypair::from_secret([7; 32]);
    let tx = cannabis_protocol::Transaction::new(
        k.address(),
        Some(a1.parse().unwrap()),
        cannabis_protocol::Amount(1),
        0,
        1,
        cannabis_protocol::TxPayload::Transfer,
    )
    .unwrap();
    let signed = cannabis_api::SubmitTx {
        tx: hex::encode(cannabis_protocol::Signed::sign(&k, &tx).to_bytes()),
    };
    let first = client(&nodes[1]).submit_tx(&signed).unwrap();
    let again = client(&nodes[1]).submit_tx(&signed).unwrap();
    assert_eq!(first.id, again.id);

    // Node 2 stops; transactions go on without it.
    let (pid2, cmd2) = net.process(2);
    kill(pid2);

    // Five transfers acknowledged, then the sequencer is killed at once.
    let before = client(&nodes[0]).ledger().unwrap().height;
    for i in 0..5u64 {
        client(&nodes[1])
            .send(&a2, cannabis_protocol::Amount(1_000 + i))
            .unwrap();
    }
    // It starts again where it listened (the others know it there).
    let listening = client(&nodes[0])
        .status()
        .unwrap()
        .listen_addrs
        .into_iter()
        .find(|a| a.starts_with("/ip4/127.0.0.1/tcp/"))
        .unwrap();
    let (pid0, mut cmd0) = net.process(0);
    kill(pid0);
    for arg in &mut cmd0 {
        if arg == "/ip4/127.0.0.1/tcp/0" {
            *arg = listening.clone();
        }
    }
    let sequencer = Restarted::start(&cmd0);
    // Every acknowledged transfer is in a block after the restart.
    let paid = f2 + 250_000 + (0..5).map(|i| 1_000 + i).sum::<u64>();
    let b = wait_balance(&nodes[1], &a2, 60, |b| b.balance.0 == paid);
    assert_eq!(b.height, client(&nodes[1]).ledger().unwrap().height);
    let after = client(&nodes[0]).ledger().unwrap();
    assert!(after.height > before);

    // Node 2 comes back and catches up: it asks for the blocks it missed and checks each.
    let back = Restarted::start(&cmd2);
    wait_balance(&nodes[2], &a2, 90, |b| b.balance.0 == paid);
    let tips: Vec<_> = (0..3)
        .map(|i| {
            let s = client(&nodes[i]).ledger().unwrap();
            (s.height, s.tip)
        })
        .collect();
    let top = tips.iter().map(|t| t.0).min().unwrap();
    for (i, n) in nodes.iter().enumerate() {
        let block = client(n).block(top).unwrap();
        assert_eq!(block.block.height, top, "node {i}");
    }
    assert_eq!(
        client(&nodes[0]).block(top).unwrap().block.hash,
        client(&nodes[2]).block(top).unwrap().block.hash,
        "one chain"
    );
    // Money is conserved on every node: the sequencer's account holds the rest.
    let seq = client(&nodes[0]).ledger().unwrap().sequencer;
    for n in &nodes {
        let total: u64 = [&seq, &a1, &a2]
            .iter()
            .map(|a| client(n).balance(Some(a)).unwrap().balance.0)
            .sum();
        let founder = client(n).ledger().unwrap().fee_recipient;
        let vesting = client(n).balance(Some(&founder)).unwrap().balance.0;
        let pool = client(n).ledger().unwrap().reward_pool.0;
        let _ = wait_balance(n, &a2, 30, |b| b.balance.0 == paid);
        assert_eq!(total + vesting + pool, supply.0, "{}", n.display());
    }

    // A proof-of-compute result: node 1 computes the task the newest block seeds for it;
    // the block that takes it pays it the block's reward (the only result: all of it).
    let before = client(&nodes[1]).balance(None).unwrap().balance.0;
    let computed = client(&nodes[1]).compute(32).unwrap();
    assert_eq!(computed.submitted.fee.0, 80_000, "SUBMIT_RESULT's gas");
    let rewarded = before - 80_000 + 1_000_000;
    for n in &nodes {
        let b = wait_balance(n, &a1, 30, |b| b.balance.0 == rewarded);
        assert_eq!(b.results, 1, "the result counts on node 1's rating");
    }
    // Its inclusion proof, from node 2, checked by node 0 against the block it holds.
    let proof = dir.path().join("proof.json");
    let out = cli(
        &nodes[2],
        &[
            "ledger",
            "prove",
            &computed.result_id,
            "--out",
            proof.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(
        &nodes[0],
        &["ledger", "verify-proof", proof.to_str().unwrap()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("is leaf 0 of 1"));
    // Another result id does not hold against that root.
    let text = std::fs::read_to_string(&proof).unwrap();
    let forged = text.replace(&computed.result_id, &"ab".repeat(32));
    std::fs::write(&proof, forged).unwrap();
    let out = cli(
        &nodes[0],
        &["ledger", "verify-proof", proof.to_str().unwrap()],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not hold"));
    drop(back);
    drop(sequencer);
}

fn cli(dir: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cannabis"))
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

fn kill(pid: i32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
}
