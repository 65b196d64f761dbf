//! Real swarms on loopback: gossip reaches every node, late joiners catch up through sync,
//! expiry is everywhere, bids reach the requester, and a restart keeps the live market.

use std::time::Duration;

use cannabis_protocol::{Bid, Keypair, MarketRequest, MarketResponse, Signed, Timestamp};

use crate::net::{self, TestNode, wait_for};

async fn sees_offer(node: &TestNode, job: &str) -> bool {
    node.handle
        .offers()
        .await
        .map(|o| o.iter().any(|o| o.job_id == job))
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_share_ads_and_offers_and_a_late_node_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let first = net::start(&dir.path().join("n0"), None).await;
    let mut nodes = vec![first];
    for i in 1..5 {
        let boot = nodes[0].addr.clone();
        nodes.push(net::start(&dir.path().join(format!("n{i}")), Some(&boot)).await);
    }
    let refs: Vec<&TestNode> = nodes.iter().collect();
    // Every node's own capability ad reached every node.
    net::wait_converged(&refs, 5).await;

    // An offer published on node 3 reaches all the others.
    let published = nodes[3]
        .handle
        .publish_offer(net::offer(4_000))
        .await
        .unwrap();
    for (i, n) in nodes.iter().enumerate() {
        wait_for(
            Duration::from_secs(10),
            &format!("node {i} to see the offer"),
            || async { sees_offer(n, &published.job_id).await.then_some(()) },
        )
        .await;
    }
    let long = nodes[1]
        .handle
        .publish_offer(net::offer(120_000))
        .await
        .unwrap();

    // A node started later (bootstrapped to node 2) learns the live offers through sync.
    let late = net::start(&dir.path().join("late"), Some(&nodes[2].addr)).await;
    wait_for(
        Duration::from_secs(10),
        "the late node to learn the live offers",
        || async {
            (sees_offer(&late, &published.job_id).await && sees_offer(&late, &long.job_id).await)
                .then_some(())
        },
    )
    .await;
    let late_ads = late.handle.status().await.unwrap().ads;
    assert!(late_ads >= 5, "late node holds {late_ads} ads");

    // The short offer expires everywhere (4 s after it was made); the long one stays.
    for (i, n) in nodes.iter().chain([&late]).enumerate() {
        wait_for(
            Duration::from_secs(10),
            &format!("node {i} to drop the expired offer"),
            || async { (!sees_offer(n, &published.job_id).await).then_some(()) },
        )
        .await;
        assert!(
            sees_offer(n, &long.job_id).await,
            "node {i} lost the live offer"
        );
    }

    late.stop().await;
    for n in nodes {
        n.stop().await;
    }
}

fn bid(worker: &Keypair, job: &str, offer_id: &str, task: u32) -> Signed<Bid> {
    let now = Timestamp(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
    );
    // Issued a moment ahead, so it is newer than the bid the worker's node made itself.
    let issued = now.plus_ms(1_000);
    Signed::sign(
        worker,
        &Bid {
            job_id: job.parse().unwrap(),
            task,
            offer: offer_id.parse().unwrap(),
            worker: worker.address(),
            price: cannabis_protocol::Amount(900),
            earliest_start: issued,
            issued_at: issued,
            valid_until: now.plus_ms(60_000),
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bid_reaches_the_requester_and_bad_bids_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let requester = net::start(&dir.path().join("req"), None).await;
    let worker = net::start(&dir.path().join("work"), Some(&requester.addr)).await;
    net::wait_converged(&[&requester, &worker], 2).await;
    let offer = requester
        .handle
        .publish_offer(net::offer(60_000))
        .await
        .unwrap();
    wait_for(
        Duration::from_secs(10),
        "the worker to see the offer",
        || async { sees_offer(&worker, &offer.job_id).await.then_some(()) },
    )
    .await;

    let worker_keys = cannabis_node::keystore::load(&cannabis_node::keystore::KeyPaths::new(
        &dir.path().join("work"),
    ))
    .unwrap()
    .signing;
    let good = bid(&worker_keys, &offer.job_id, &offer.id, 0);
    let answer = worker
        .handle
        .market(requester.handle.peer_id(), MarketRequest::Bid(good.clone()))
        .await
        .unwrap();
    assert_eq!(answer, MarketResponse::Ack);
    // The worker's node also bid by itself when it saw the offer (it matches the task);
    // one bid per worker and task is kept: the newer, ours.
    let bids = requester.handle.bids().await.unwrap();
    assert_eq!(bids.len(), 1, "{bids:?}");
    assert_eq!(bids[0].worker, worker_keys.address().to_string());
    assert_eq!(bids[0].id, good.id().to_string());
    // The same bid again (a worker sends it again when its connection dropped) is
    // acknowledged and changes nothing; an older one is refused.
    let again = worker
        .handle
        .market(requester.handle.peer_id(), MarketRequest::Bid(good.clone()))
        .await
        .unwrap();
    assert_eq!(again, MarketResponse::Ack);
    let bids = requester.handle.bids().await.unwrap();
    assert_eq!(bids.len(), 1, "{bids:?}");
    assert_eq!(bids[0].id, good.id().to_string());
    let mut older = good.verify().unwrap().body;
    older.issued_at = Timestamp(older.issued_at.0 - 500);
    older.price = cannabis_protocol::Amount(800);
    match worker
        .handle
        .market(
            requester.handle.peer_id(),
            MarketRequest::Bid(Signed::sign(&worker_keys, &older)),
        )
        .await
        .unwrap()
    {
        MarketResponse::Refused { reason } => assert!(reason.contains("newer bid"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }

    // A bid for a task the offer does not have, and one for an unknown job.
    let no_task = bid(&worker_keys, &offer.job_id, &offer.id, 7);
    let unknown = bid(
        &worker_keys,
        "550e8400-e29b-41d4-a716-446655440000",
        &offer.id,
        0,
    );
    for (b, why) in [(no_task, "no task 7"), (unknown, "no open offer")] {
        match worker
            .handle
            .market(requester.handle.peer_id(), MarketRequest::Bid(b))
            .await
            .unwrap()
        {
            MarketResponse::Refused { reason } => assert!(reason.contains(why), "{reason}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    // A bid to a node that did not publish the offer is refused too; so is a bid sent by
    // another peer than its signer.
    let requester_keys = cannabis_node::keystore::load(&cannabis_node::keystore::KeyPaths::new(
        &dir.path().join("req"),
    ))
    .unwrap()
    .signing;
    for (b, why) in [
        (
            bid(&requester_keys, &offer.job_id, &offer.id, 0),
            "not this node's",
        ),
        (bid(&worker_keys, &offer.job_id, &offer.id, 0), "signed by"),
    ] {
        match requester
            .handle
            .market(worker.handle.peer_id(), MarketRequest::Bid(b))
            .await
            .unwrap()
        {
            MarketResponse::Refused { reason } => assert!(reason.contains(why), "{reason}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    assert_eq!(requester.handle.bids().await.unwrap().len(), 1);

    // Round trips of the market protocol.
    let ping = worker
        .handle
        .ping(requester.handle.peer_id(), 5)
        .await
        .unwrap();
    assert_eq!(ping.rtt_us.len(), 5);

    worker.stop().await;
    requester.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_live_market() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node");
    let node = net::start(&path, None).await;
    let kept = node
        .handle
        .publish_offer(net::offer(120_000))
        .await
        .unwrap();
    let gone = node.handle.publish_offer(net::offer(1_500)).await.unwrap();
    // Its own ad goes out once the machine is probed (and the next moment's changes
    // are in it).
    let h = node.handle.clone();
    net::wait_for(Duration::from_secs(10), "its own ad", || {
        let h = h.clone();
        async move { (h.status().await.ok()?.ads >= 1).then_some(()) }
    })
    .await;
    drop(h);
    node.stop().await;
    tokio::time::sleep(Duration::from_millis(1_600)).await;

    let node = net::start(&path, None).await;
    let offers = node.handle.offers().await.unwrap();
    let ids: Vec<&str> = offers.iter().map(|o| o.job_id.as_str()).collect();
    assert!(ids.contains(&kept.job_id.as_str()), "{ids:?}");
    assert!(
        !ids.contains(&gone.job_id.as_str()),
        "an expired offer came back: {ids:?}"
    );
    // Its own ad came back too, and a new one supersedes it.
    assert!(node.handle.status().await.unwrap().ads >= 1);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_requesters_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node");
    let node = net::start(&path, None).await;
    let mut t = net::offer(60_000);
    t.name = Some("kept".into());
    let job = node.handle.submit_job(t).await.unwrap();
    node.stop().await;

    let node = net::start(&path, None).await;
    let jobs = node.handle.jobs().await.unwrap();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0].job_id, job.job_id);
    assert_eq!(jobs[0].name, "kept");
    assert_eq!(jobs[0].tasks, vec!["bidding".to_string()]);
    let detail = node.handle.job(job.job_id.parse().unwrap()).await.unwrap();
    assert!(detail.history[0].text.contains("offer published"));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_connect_over_quic() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = net::config(None);
    config.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
    let a = net::start_with(&dir.path().join("a"), config.clone()).await;
    assert!(a.addr.to_string().contains("/quic-v1/"), "{}", a.addr);
    config.bootstrap = vec![a.addr.clone()];
    let b = net::start_with(&dir.path().join("b"), config).await;
    net::wait_converged(&[&a, &b], 2).await;
    let peers = b.handle.peers().await.unwrap();
    assert!(
        peers
            .iter()
            .any(|p| p.addrs.iter().any(|a| a.contains("/quic-v1"))),
        "{peers:?}"
    );
    b.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reachable_only_through_a_relay_is_reached() {
    let dir = tempfile::tempdir().unwrap();
    // The relay.
    let mut config = net::config(None);
    config.relay_server = true;
    let relay = net::start_with(&dir.path().join("relay"), config).await;
    // A node that listens only through the relay (as a node behind NAT would).
    let mut config = net::config(None);
    config.listen = vec![format!("{}/p2p-circuit", relay.addr).parse().unwrap()];
    let hidden = net::start_with(&dir.path().join("hidden"), config).await;
    assert!(
        hidden.addr.to_string().contains("/p2p-circuit"),
        "{}",
        hidden.addr
    );
    // A node that knows only the relayed address.
    let mut config = net::config(None);
    config.bootstrap = vec![hidden.addr.clone()];
    let dialer = net::start_with(&dir.path().join("dialer"), config).await;
    let hidden_id = hidden.handle.peer_id().to_string();
    wait_for(
        Duration::from_secs(15),
        "the dialer to reach the hidden node",
        || async {
            dialer
                .handle
                .peers()
                .await
                .ok()?
                .iter()
                .any(|p| p.peer_id == hidden_id)
                .then_some(())
        },
    )
    .await;
    // And the market works across it.
    let offer = hidden
        .handle
        .publish_offer(net::offer(60_000))
        .await
        .unwrap();
    wait_for(
        Duration::from_secs(15),
        "the dialer to get the hidden node's offer",
        || async { sees_offer(&dialer, &offer.job_id).await.then_some(()) },
    )
    .await;
    dialer.stop().await;
    hidden.stop().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_ad_follows_the_owners_settings() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("node.toml");
    let write = |price: u64| {
        std::fs::write(&file, format!("[owner.prices]\ncpu_core_hour = {price}\n")).unwrap();
    };
    write(5);
    let mut config = cannabis_node::NodeConfig::from_file(&file).unwrap();
    let base = net::config(None);
    config.listen = base.listen;
    config.mdns = false;
    let node = net::start_with(&dir.path().join("n"), config).await;
    node.handle.publish_ad().await.unwrap();
    let price = |node: &TestNode| {
        let h = node.handle.clone();
        async move { h.ads().await.unwrap()[0].prices.cpu_core_hour.0 }
    };
    assert_eq!(price(&node).await, 5);
    write(9);
    node.handle.publish_ad().await.unwrap();
    assert_eq!(price(&node).await, 9);
    // A broken file keeps the last good settings.
    std::fs::write(&file, "[owner.prices]\ncpu_core_hour = \"lots\"\n").unwrap();
    node.handle.publish_ad().await.unwrap();
    assert_eq!(price(&node).await, 9);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_challenges_a_peer_over_the_network() {
    let dir = tempfile::tempdir().unwrap();
    // A small challenge with a generous deadline: this test is about the exchange, not the
    // speed of a debug build on a loaded machine (the deadline rule has its own tests).
    let mut config = net::config(None);
    config.challenge.size = 128;
    config.challenge.target_ms = 50;
    config.challenge.min_deadline_ms = 60_000;
    let a = net::start_with(&dir.path().join("a"), config).await;
    let b = net::start(&dir.path().join("b"), Some(&a.addr)).await;
    let c = net::start(&dir.path().join("c"), Some(&a.addr)).await;
    net::wait_converged(&[&a, &b, &c], 3).await;
    let report = a.handle.challenge(b.handle.peer_id()).await.unwrap();
    assert!(report.passed, "{report:?}");
    assert_eq!(report.address, b.handle.address().to_string());
    assert_eq!(report.n, 128);
    assert!(report.rounds >= 1);
    assert!(report.took_ms <= report.deadline_ms);
    // The verifier remembers the pass next to the peer's ad.
    let ads = a.handle.ads().await.unwrap();
    let ad = ads.iter().find(|ad| ad.node == report.address).unwrap();
    assert!(ad.challenge_passed_at_ms.is_some());
    // The worker got a pass signed by the verifier and carries it in its next ad, so a node
    // that set no challenge sees it too.
    let verifier = a.handle.address().to_string();
    let worker = report.address.clone();
    let pass_seen = |node: &TestNode| {
        let (h, verifier, worker) = (node.handle.clone(), verifier.clone(), worker.clone());
        net::wait_for(
            Duration::from_secs(30),
            "the pass in the worker's ad",
            move || {
                let (h, verifier, worker) = (h.clone(), verifier.clone(), worker.clone());
                async move {
                    let ads = h.ads().await.ok()?;
                    let ad = ads.into_iter().find(|ad| ad.node == worker)?;
                    ad.challenge_passes
                        .iter()
                        .any(|p| p.verifier == verifier)
                        .then_some(ad)
                }
            },
        )
    };
    let seen = pass_seen(&c).await;
    assert_eq!(seen.challenge_passes[0].n, 128);
    assert!(
        seen.challenge_passed_at_ms.is_none(),
        "c set no challenge itself"
    );
    assert!(seen.newest_pass_at_ms.is_some());
    // A pass for a challenge the worker never answered is refused.
    let forged = cannabis_protocol::ChallengePass {
        verifier: c.handle.address(),
        worker: b.handle.address(),
        seed: cannabis_protocol::Digest([1; 32]),
        n: 128,
        rounds: 1,
        claimed_cores: 64,
        took_ms: 1,
        deadline_ms: 1,
        passed_at: cannabis_protocol::Timestamp(1),
    };
    let c_keys = cannabis_node::keystore::load(&cannabis_node::keystore::KeyPaths::new(
        &dir.path().join("c"),
    ))
    .unwrap();
    // C reaches B directly (it may know B only through A's gossip so far).
    c.handle.dial(b.addr.clone()).await.unwrap();
    let b_peer = b.handle.peer_id().to_string();
    wait_for(Duration::from_secs(10), "C to connect to B", || async {
        let peers = c.handle.peers().await.ok()?;
        peers.iter().any(|p| p.peer_id == b_peer).then_some(())
    })
    .await;
    let answer = c
        .handle
        .market(
            b.handle.peer_id(),
            MarketRequest::ChallengePass(Signed::sign(&c_keys.signing, &forged)),
        )
        .await
        .unwrap();
    assert!(
        matches!(&answer, MarketResponse::Refused { reason } if reason.contains("no such challenge")),
        "{answer:?}"
    );
    // A peer without an ad cannot be checked against a claim.
    let unknown = libp2p::PeerId::random();
    let err = a.handle.challenge(unknown).await.unwrap_err().to_string();
    assert!(err.contains("no capability ad"), "{err}");
    // The worker keeps its pass across a restart.
    b.stop().await;
    let b = net::start(&dir.path().join("b"), None).await;
    b.handle.publish_ad().await.unwrap();
    let own = b.handle.ads().await.unwrap();
    let own = own.iter().find(|ad| ad.node == worker).unwrap();
    assert_eq!(own.challenge_passes.len(), 1, "{own:?}");
    b.stop().await;
    c.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_offers_reach_every_worker_their_calls_can_draw() {
    // Four offer shards: each node listens to its own shard's topic only, and an offer
    // whose call reaches everyone is gossiped on all four.
    let dir = tempfile::tempdir().unwrap();
    let config = |bootstrap: Option<&libp2p::Multiaddr>| {
        let mut c = net::config(bootstrap);
        c.gossip.offer_shards = 4;
        c
    };
    let first = net::start_with(&dir.path().join("n0"), config(None)).await;
    let mut nodes = vec![first];
    for i in 1..6 {
        let n = net::start_with(
            &dir.path().join(format!("n{i}")),
            config(Some(&nodes[0].addr)),
        )
        .await;
        nodes.push(n);
    }
    for n in &nodes {
        let h = n.handle.clone();
        wait_for(Duration::from_secs(30), "every ad", || {
            let h = h.clone();
            async move { (h.status().await.ok()?.ads >= 6).then_some(()) }
        })
        .await;
        let status = n.handle.status().await.unwrap();
        let offer_topics: Vec<&str> = status
            .mesh_peers
            .iter()
            .map(|t| t.topic.as_str())
            .filter(|t| t.starts_with("cannabis/job-offers/v1/4/"))
            .collect();
        assert_eq!(offer_topics.len(), 1, "{status:?}");
    }
    let job = nodes[0]
        .handle
        .submit_job(net::offer(60_000))
        .await
        .unwrap();
    let id: cannabis_protocol::Uuid = job.job_id.parse().unwrap();
    let h = nodes[0].handle.clone();
    let detail = wait_for(Duration::from_secs(30), "a bid from every worker", || {
        let h = h.clone();
        async move { h.job(id).await.ok().filter(|j| j.tasks[0].bids.len() == 5) }
    })
    .await;
    drop(h);
    assert_eq!(detail.tasks[0].bids.len(), 5);
    for n in nodes {
        n.stop().await;
    }
}

/// A node asks its first three peers for the live market when it starts; what gossip sent
/// meanwhile it may have missed. Here its first three peers know nothing, and the fourth,
/// met after them, holds an offer published before: the node learns it only from the
/// catch-up sync it makes ten seconds after its start (before, from nobody: offers are not
/// published twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_catches_up_on_what_its_first_peers_did_not_have() {
    let dir = tempfile::tempdir().unwrap();
    let holder = net::start(&dir.path().join("holder"), None).await;
    let offer = holder
        .handle
        .publish_offer(net::offer(300_000))
        .await
        .unwrap();
    let mut empty = Vec::new();
    for i in 0..3 {
        empty.push(net::start(&dir.path().join(format!("empty-{i}")), None).await);
    }
    let node = net::start(&dir.path().join("node"), None).await;
    for e in &empty {
        node.handle.dial(e.addr.clone()).await.unwrap();
    }
    let h = node.handle.clone();
    net::wait_for(Duration::from_secs(10), "three peers", || {
        let h = h.clone();
        async move { (h.status().await.ok()?.connected_peers >= 3).then_some(()) }
    })
    .await;
    node.handle.dial(holder.addr.clone()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let has = |offers: &[cannabis_api::Offer]| offers.iter().any(|o| o.job_id == offer.job_id);
    assert!(
        !has(&node.handle.offers().await.unwrap()),
        "the offer arrived before any catch-up: this test no longer tests catching up"
    );
    net::wait_for(
        Duration::from_secs(20),
        "the offer, from a catch-up sync",
        || {
            let h = h.clone();
            async move { has(&h.offers().await.ok()?).then_some(()) }
        },
    )
    .await;
    drop(h);
    node.stop().await;
    for e in empty {
        e.stop().await;
    }
    holder.stop().await;
}

/// What a node tells a peer about itself over identify, read off the wire, against
/// docs/protocol.md: the protocol version, the agent, and every protocol it lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identify_says_what_the_spec_says() {
    use futures::StreamExt as _;
    use libp2p::swarm::SwarmEvent;
    use libp2p::{identify, noise, tcp, yamux};

    let dir = tempfile::tempdir().unwrap();
    let node = net::start(&dir.path().join("n"), None).await;
    let mut probe = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|key| {
            identify::Behaviour::new(identify::Config::new("probe/1".into(), key.public()))
        })
        .unwrap()
        .build();
    probe.dial(node.addr.clone()).unwrap();
    let info = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let SwarmEvent::Behaviour(identify::Event::Received { info, .. }) =
                probe.select_next_some().await
            {
                return info;
            }
        }
    })
    .await
    .expect("the node identified itself");
    let spec = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/protocol.md"),
    )
    .unwrap();
    assert_eq!(info.protocol_version, "/cannabis/id/1.0.0");
    assert!(
        info.agent_version.starts_with("cannabis/"),
        "{}",
        info.agent_version
    );
    assert!(spec.contains("`protocolVersion` field is `/cannabis/id/1.0.0`"));
    let listed: Vec<String> = info.protocols.iter().map(ToString::to_string).collect();
    assert!(listed.iter().any(|p| p == "/ipfs/id/1.0.0"), "{listed:?}");
    for p in &listed {
        assert!(
            spec.contains(&format!("`{p}`")),
            "the node speaks {p}, which docs/protocol.md does not name"
        );
    }
    drop(probe);
    node.stop().await;
}
