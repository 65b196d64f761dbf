//! A hostile peer: garbage, oversized messages, forged signatures, forged authors, replays
//! and expired messages on gossip, and oversized or undecodable directed requests; bad
//! ledger blocks. It is rejected, its score drops, honest traffic still flows and no node
//! crashes.

use std::io;
use std::time::Duration;

use cannabis_node::swarm::{
    CHALLENGE_PROTOCOL, Codec, LEDGER_PROTOCOL, MARKET_PROTOCOL, SYNC_PROTOCOL, Topic, Topics,
};
use cannabis_protocol::challenge::Claim;
use cannabis_protocol::{
    CapabilityAd, ChallengeRequest, ChallengeResponse, Digest, Keypair, LedgerRequest,
    LedgerResponse, Signed, SyncRequest, SyncResponse, Timestamp,
};
use futures::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, StreamExt as _};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{StreamProtocol, gossipsub, identity, noise, request_response, tcp, yamux};
use proptest::strategy::{Strategy as _, ValueTree as _};

use crate::net::{self, wait_for};

/// Writes and reads raw bytes: the hostile peer frames requests itself.
#[derive(Clone, Default)]
struct RawCodec;

impl request_response::Codec for RawCodec {
    type Protocol = StreamProtocol;
    type Request = Vec<u8>;
    type Response = Vec<u8>;

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<Vec<u8>> {
        let mut v = Vec::new();
        io.take(1 << 20).read_to_end(&mut v).await?;
        Ok(v)
    }
    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<Vec<u8>> {
        let mut v = Vec::new();
        io.take(1 << 20).read_to_end(&mut v).await?;
        if v.is_empty() {
            // The node closed the stream without an answer: the request was refused.
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(v)
    }
    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: Vec<u8>,
    ) -> io::Result<()> {
        io.write_all(&req).await?;
        io.close().await
    }
    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        resp: Vec<u8>,
    ) -> io::Result<()> {
        io.write_all(&resp).await?;
        io.close().await
    }
}

#[derive(NetworkBehaviour)]
struct Hostile {
    gossipsub: gossipsub::Behaviour,
    rr: request_response::Behaviour<RawCodec>,
    challenge: request_response::Behaviour<Codec<ChallengeRequest, ChallengeResponse>>,
    sync: request_response::Behaviour<Codec<SyncRequest, SyncResponse>>,
    ledger: request_response::Behaviour<Codec<LedgerRequest, LedgerResponse>>,
}

fn hostile_swarm() -> libp2p::Swarm<Hostile> {
    hostile_swarm_with(rand_secret())
}

fn rand_secret() -> [u8; 32] {
    *identity::Keypair::generate_ed25519()
        .try_into_ed25519()
        .unwrap()
        .secret()
        .as_ref()
        .first_chunk::<32>()
        .unwrap()
}

/// A hostile swarm whose identity is the ed25519 key of `secret` (the same key signs its
/// market messages: `Keypair::from_secret(secret)`). Its gossip is anonymous, as every
/// node's is.
fn hostile_swarm_with(secret: [u8; 32]) -> libp2p::Swarm<Hostile> {
    build_hostile(secret, false)
}

/// A hostile swarm; with `signed`, its gossip messages carry gossipsub's author, sequence
/// number and signature, which the network's messages never carry.
fn build_hostile(secret: [u8; 32], signed: bool) -> libp2p::Swarm<Hostile> {
    let mut bytes = secret;
    let key = identity::Keypair::ed25519_from_bytes(&mut bytes).unwrap();
    libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|key: &identity::Keypair| {
            let config = gossipsub::ConfigBuilder::default()
                .validation_mode(gossipsub::ValidationMode::None)
                // Anonymous messages have no author and sequence number: ids by content.
                .message_id_fn(|m: &gossipsub::Message| {
                    gossipsub::MessageId::from(Digest::of(&m.data).0.to_vec())
                })
                .max_transmit_size(4 << 20)
                .heartbeat_interval(Duration::from_millis(200))
                .build()
                .unwrap();
            let authenticity = if signed {
                gossipsub::MessageAuthenticity::Signed(key.clone())
            } else {
                gossipsub::MessageAuthenticity::Anonymous
            };
            Hostile {
                gossipsub: gossipsub::Behaviour::new(authenticity, config).unwrap(),
                rr: request_response::Behaviour::with_codec(
                    RawCodec,
                    [(MARKET_PROTOCOL, request_response::ProtocolSupport::Outbound)],
                    request_response::Config::default(),
                ),
                challenge: request_response::Behaviour::new(
                    [(
                        CHALLENGE_PROTOCOL,
                        request_response::ProtocolSupport::Outbound,
                    )],
                    request_response::Config::default(),
                ),
                sync: request_response::Behaviour::new(
                    [(SYNC_PROTOCOL, request_response::ProtocolSupport::Full)],
                    request_response::Config::default(),
                ),
                ledger: request_response::Behaviour::new(
                    [(LEDGER_PROTOCOL, request_response::ProtocolSupport::Outbound)],
                    request_response::Config::default(),
                ),
            }
        })
        .unwrap()
        .build()
}

/// Publishes an honest offer from `from` and waits until `to` holds it.
async fn an_honest_offer_reaches(from: &net::TestNode, to: &net::TestNode) {
    let offer = from.handle.publish_offer(net::offer(60_000)).await.unwrap();
    wait_for(
        Duration::from_secs(10),
        "the honest offer to arrive",
        || async {
            to.handle
                .offers()
                .await
                .ok()?
                .iter()
                .any(|o| o.job_id == offer.job_id)
                .then_some(())
        },
    )
    .await;
}

/// A capability ad with arbitrary content, re-dated and signed by `keys`.
fn ad(keys: &Keypair, issued_at: u64, expires_at: u64) -> Vec<u8> {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut ad = proptest::arbitrary::any::<CapabilityAd>()
        .new_tree(&mut runner)
        .unwrap()
        .current();
    ad.node = keys.address();
    ad.issued_at = Timestamp(issued_at);
    ad.expires_at = Timestamp(expires_at);
    ad.hardware.gpus.truncate(1);
    ad.runtimes.truncate(1);
    ad.prices.gpu_hour.truncate(1);
    ad.attestation = None;
    ad.challenges.clear();
    Signed::sign(keys, &ad).to_bytes()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_peer_is_rejected_and_honest_traffic_flows() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let b = net::start(&dir.path().join("b"), Some(&a.addr)).await;
    net::wait_converged(&[&a, &b], 2).await;

    let mut hostile = subscribed_hostile(&a, rand_secret()).await;
    let hostile_id = *hostile.local_peer_id();
    let topics = Topics::new(1);
    let offers = Topic::Offers { shard: 0 };
    let now = now_ms();
    let stranger = Keypair::from_secret([77; 32]);
    let mut forged_sig = ad(&stranger, now, now + 60_000);
    let last = forged_sig.len() - 1;
    forged_sig[last] ^= 0x01;
    let attacks: Vec<(&str, Topic, Vec<u8>)> = vec![
        ("garbage", offers, b"definitely not cbor".to_vec()),
        ("oversized", Topic::Ads, vec![0x82; 100 * 1024]),
        ("forged signature", Topic::Ads, forged_sig),
        (
            "expired",
            Topic::Ads,
            ad(&stranger, now - 120_000, now - 60_000),
        ),
    ];
    for (what, topic, bytes) in attacks {
        hostile
            .behaviour_mut()
            .gossipsub
            .publish(topics.ident(topic), bytes)
            .unwrap_or_else(|e| panic!("publishing {what}: {e}"));
    }
    // A message carrying gossipsub's author, sequence number and signature (the network's
    // never do, and nobody checks them) is invalid however valid its envelope: a sender
    // cannot make nodes check a signature of its choosing on every hop.
    let signer_secret = rand_secret();
    let mut signing = subscribed(&a, build_hostile(signer_secret, true)).await;
    let signing_id = *signing.local_peer_id();
    let own = Keypair::from_secret(signer_secret);
    signing
        .behaviour_mut()
        .gossipsub
        .publish(topics.ident(Topic::Ads), ad(&own, now, now + 60_000))
        .unwrap();
    drive_for(&mut signing, 2_000).await;
    let peers = a.handle.peers().await.unwrap();
    let score = peers
        .iter()
        .find(|p| p.peer_id == signing_id.to_string())
        .map_or(f64::NEG_INFINITY, |p| p.score);
    assert!(score < 0.0, "the signing peer's score is {score}");
    drop(signing);
    // Oversized and undecodable directed requests.
    let oversized = {
        let mut v = u32::MAX.to_be_bytes().to_vec();
        v.extend_from_slice(&[0u8; 64]);
        v
    };
    let undecodable = {
        let mut v = 5u32.to_be_bytes().to_vec();
        v.extend_from_slice(b"\xff\xff\xff\xff\xff");
        v
    };
    let a_peer = a.handle.peer_id();
    hostile.behaviour_mut().rr.send_request(&a_peer, oversized);
    hostile
        .behaviour_mut()
        .rr
        .send_request(&a_peer, undecodable);
    let mut failures = 0;
    tokio::time::timeout(Duration::from_secs(15), async {
        while failures < 2 {
            match hostile.select_next_some().await {
                SwarmEvent::Behaviour(HostileEvent::Rr(
                    request_response::Event::OutboundFailure { .. },
                )) => failures += 1,
                SwarmEvent::Behaviour(HostileEvent::Rr(request_response::Event::Message {
                    ..
                })) => {
                    panic!("node A answered a malformed request")
                }
                _ => {}
            }
        }
    })
    .await
    .expect("both malformed requests were refused");

    // Node A scored the hostile peer down; keep driving the hostile swarm meanwhile.
    let score = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            tokio::select! {
                _ = hostile.select_next_some() => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    let peers = a.handle.peers().await.unwrap();
                    match peers.iter().find(|p| p.peer_id == hostile_id.to_string()) {
                        Some(p) if p.score < 0.0 => return p.score,
                        // Graylisted and already disconnected by the node's upkeep.
                        None => return f64::NEG_INFINITY,
                        Some(_) => {}
                    }
                }
            }
        }
    })
    .await
    .expect("the hostile peer's score dropped below zero");
    assert!(score < 0.0);

    // Nothing the hostile peer sent entered the market view of either node.
    for n in [&a, &b] {
        let ads = n.handle.ads().await.unwrap();
        assert!(
            ads.iter()
                .all(|ad| ad.node != stranger.address().to_string()
                    && ad.node != own.address().to_string()),
            "a forged or gossipsub-signed ad got in"
        );
        assert_eq!(n.handle.offers().await.unwrap().len(), 0);
    }

    // Honest traffic still flows, both ways.
    an_honest_offer_reaches(&b, &a).await;
    let ping = b.handle.ping(a.handle.peer_id(), 3).await.unwrap();
    assert_eq!(ping.rtt_us.len(), 3);
    assert!(a.handle.status().await.is_ok());

    drop(hostile);
    b.stop().await;
    a.stop().await;
}

/// Drives `hostile` until `pick` takes one of its events, for at most `secs`.
async fn drive_until<T>(
    hostile: &mut libp2p::Swarm<Hostile>,
    secs: u64,
    what: &str,
    mut pick: impl FnMut(SwarmEvent<HostileEvent>) -> Option<T>,
) -> T {
    tokio::time::timeout(Duration::from_secs(secs), async {
        loop {
            if let Some(v) = pick(hostile.select_next_some().await) {
                return v;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// Drives `hostile` for `ms` milliseconds, whatever happens.
async fn drive_for(hostile: &mut libp2p::Swarm<Hostile>, ms: u64) {
    let _ = tokio::time::timeout(Duration::from_millis(ms), async {
        loop {
            hostile.select_next_some().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_challenge_is_sized_to_the_claim_and_stops_when_the_verifier_goes() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    // An honest verifier with small challenges and a generous deadline.
    let mut config = net::config(Some(&a.addr));
    config.challenge.size = 64;
    config.challenge.target_ms = 20;
    config.challenge.min_deadline_ms = 60_000;
    let b = net::start_with(&dir.path().join("b"), config).await;
    let a_addr = a.handle.address().to_string();
    let cores = wait_for(Duration::from_secs(30), "b to hold a's ad", || async {
        let ads = b.handle.ads().await.ok()?;
        ads.iter()
            .find(|ad| ad.node == a_addr)
            .map(|ad| ad.cpu_cores)
    })
    .await;

    let mut hostile = hostile_swarm();
    hostile.dial(a.addr.clone()).unwrap();
    let a_peer = a.handle.peer_id();
    // Hours of work on every core, in a 100-byte request: refused at once.
    hostile.behaviour_mut().challenge.send_request(
        &a_peer,
        ChallengeRequest {
            seed: Digest::of(b"greedy"),
            n: 2048,
            rounds: 4096,
        },
    );
    let refused = drive_until(&mut hostile, 10, "an answer", |e| match e {
        SwarmEvent::Behaviour(HostileEvent::Challenge(request_response::Event::Message {
            message: request_response::Message::Response { response, .. },
            ..
        })) => Some(response),
        _ => None,
    })
    .await;
    assert!(
        matches!(&refused, ChallengeResponse::Refused { reason } if reason.contains("more than")),
        "{refused:?}"
    );

    // The most the claim allows (seconds on every core), and then the verifier leaves:
    // the proof stops, and the honest verifier is not kept waiting behind it.
    let n = 256u32;
    let rounds = Claim { cpu_cores: cores }.max_prover_ops() / (2 * u128::from(n).pow(3));
    let rounds = u32::try_from(rounds).unwrap().min(4096);
    hostile.behaviour_mut().challenge.send_request(
        &a_peer,
        ChallengeRequest {
            seed: Digest::of(b"then leave"),
            n,
            rounds,
        },
    );
    drive_for(&mut hostile, 300).await;
    drop(hostile);
    let mut tries = 0;
    let report = wait_for(Duration::from_secs(3), "a to answer b", || {
        tries += 1;
        let b = b.handle.clone();
        async move {
            let r = b.challenge(a_peer).await.ok()?;
            (!r.failure.as_deref().is_some_and(|f| f.contains("busy"))).then_some(r)
        }
    })
    .await;
    assert!(report.passed, "after {tries} tries: {report:?}");
    // One answer per peer per window.
    let again = b.handle.challenge(a_peer).await.unwrap();
    assert!(
        again
            .failure
            .as_deref()
            .is_some_and(|f| f.contains("one challenge per peer")),
        "{again:?}"
    );
    b.stop().await;
    a.stop().await;
}

/// Serves node `a`'s sync requests from `page(request, n)` (`n` counts the ads requests so
/// far) for `secs`, and says how many ads pages `a` asked for in its first run (a later
/// catch-up sync starts a new one).
async fn serve_sync(
    hostile: &mut libp2p::Swarm<Hostile>,
    secs: u64,
    mut page: impl FnMut(&SyncRequest, usize) -> SyncResponse,
) -> usize {
    let mut asked = 0;
    let mut first_run = None;
    let _ = tokio::time::timeout(Duration::from_secs(secs), async {
        loop {
            if let SwarmEvent::Behaviour(HostileEvent::Sync(request_response::Event::Message {
                message:
                    request_response::Message::Request {
                        request, channel, ..
                    },
                ..
            })) = hostile.select_next_some().await
            {
                if let SyncRequest::Ads { after } = &request {
                    if after.is_none() && asked > 0 && first_run.is_none() {
                        first_run = Some(asked);
                    }
                    asked += 1;
                }
                let answer = page(&request, asked);
                let _ = hostile.behaviour_mut().sync.send_response(channel, answer);
            }
        }
    })
    .await;
    first_run.unwrap_or(asked)
}

fn empty_page() -> SyncResponse {
    SyncResponse {
        ads: Vec::new(),
        offers: Vec::new(),
        more: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_stops_when_the_cursor_does_not_move_and_at_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let now = now_ms();
    // Keys in address order: a page's ads must ascend.
    let mut keys: Vec<Keypair> = (0..160u8)
        .map(|i| Keypair::from_secret([i.wrapping_add(1); 32]))
        .collect();
    keys.sort_by_key(|k| k.address());
    let signed =
        |k: &Keypair| Signed::<CapabilityAd>::from_bytes(&ad(k, now, now + 600_000)).unwrap();

    // The same page of ads, "more to come", forever.
    let same: Vec<_> = keys[..3].iter().map(signed).collect();
    let mut hostile = hostile_swarm();
    let hostile_id = *hostile.local_peer_id();
    hostile.dial(a.addr.clone()).unwrap();
    let asked = serve_sync(&mut hostile, 4, |req, _| match req {
        SyncRequest::Ads { .. } => SyncResponse {
            ads: same.clone(),
            offers: Vec::new(),
            more: true,
        },
        SyncRequest::Offers { .. } => empty_page(),
    })
    .await;
    assert_eq!(
        asked, 2,
        "the node asked again although the cursor did not move"
    );
    let peers = a.handle.peers().await.unwrap();
    let score = peers
        .iter()
        .find(|p| p.peer_id == hostile_id.to_string())
        .map(|p| p.score);
    assert!(score.is_some_and(|s| s < 0.0), "score {score:?}");
    assert!(
        a.handle.ads().await.unwrap().len() >= 3,
        "the first page was taken"
    );
    drop(hostile);

    // New ads on every page, in order, "more to come", forever: the run stops at its
    // page bound.
    let fresh: Vec<_> = keys[3..].iter().map(signed).collect();
    let mut hostile = hostile_swarm();
    hostile.dial(a.addr.clone()).unwrap();
    let asked = serve_sync(&mut hostile, 8, |req, n| match req {
        SyncRequest::Ads { .. } => SyncResponse {
            ads: fresh.get(n - 1).cloned().into_iter().collect(),
            offers: Vec::new(),
            more: true,
        },
        SyncRequest::Offers { .. } => empty_page(),
    })
    .await;
    assert_eq!(asked, 128, "pages asked of an endless sync");
    drop(hostile);
    a.stop().await;
}

/// A hostile swarm subscribed to ads and offers, connected to `node` and seen subscribed.
async fn subscribed_hostile(node: &net::TestNode, secret: [u8; 32]) -> libp2p::Swarm<Hostile> {
    subscribed(node, hostile_swarm_with(secret)).await
}

/// `hostile`, subscribed to ads and offers, connected to `node` and seen subscribed.
async fn subscribed(
    node: &net::TestNode,
    mut hostile: libp2p::Swarm<Hostile>,
) -> libp2p::Swarm<Hostile> {
    let topics = Topics::new(1);
    for t in [Topic::Ads, Topic::Offers { shard: 0 }] {
        hostile
            .behaviour_mut()
            .gossipsub
            .subscribe(&topics.ident(t))
            .unwrap();
    }
    connected(node, hostile).await
}

/// `hostile` connected to `node` and seen subscribed to ads and offers (it need not
/// subscribe itself to publish there).
async fn connected(
    node: &net::TestNode,
    mut hostile: libp2p::Swarm<Hostile>,
) -> libp2p::Swarm<Hostile> {
    hostile.dial(node.addr.clone()).unwrap();
    let mut subscribed = 0;
    drive_until(&mut hostile, 10, "the node to subscribe", |e| {
        if let SwarmEvent::Behaviour(HostileEvent::Gossipsub(gossipsub::Event::Subscribed {
            ..
        })) = e
        {
            subscribed += 1;
        }
        (subscribed >= 2).then_some(())
    })
    .await;
    hostile
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_cannot_flood_the_view_with_offers_or_updates() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let b = net::start(&dir.path().join("b"), Some(&a.addr)).await;
    net::wait_converged(&[&a, &b], 2).await;
    // The hostile peer publishes as itself: its libp2p key is its market key.
    let secret = [66; 32];
    let mut hostile = subscribed_hostile(&a, secret).await;
    let keys = Keypair::from_secret(secret);
    let topic = Topics::new(1).ident(Topic::Offers { shard: 0 });
    let now = Timestamp(now_ms());
    let task = cannabis_market::testkit::task("t", 1, 0, 0, 1, 1_000);
    let offer = |job: u64, seq: u64| {
        let mut o = cannabis_market::testkit::offer(
            keys.address(),
            job,
            vec![task.clone()],
            now,
            600_000,
            1_200_000,
        );
        o.seq = seq;
        Signed::sign(&keys, &o).to_bytes()
    };
    // 400 new offers at once, then 300 new versions of one, as fast as it can.
    let started = std::time::Instant::now();
    let mut sent = 0;
    for job in 1..=400 {
        sent += usize::from(
            hostile
                .behaviour_mut()
                .gossipsub
                .publish(topic.clone(), offer(job, 1))
                .is_ok(),
        );
    }
    for seq in 2..=301 {
        sent += usize::from(
            hostile
                .behaviour_mut()
                .gossipsub
                .publish(topic.clone(), offer(1, seq))
                .is_ok(),
        );
    }
    assert!(sent > 600, "only {sent} published");
    drive_for(&mut hostile, 3_000).await;
    let hostile_address = keys.address().to_string();
    let held = |offers: Vec<cannabis_api::Offer>| {
        offers
            .iter()
            .filter(|o| o.requester == hostile_address)
            .count()
    };
    let on_a = held(a.handle.offers().await.unwrap());
    let on_b = held(b.handle.offers().await.unwrap());
    // The burst of one signer (256) and what its rate (20/s) added meanwhile, on A and on
    // B behind it; of the 300 updates, as few.
    let bound = 256 + 20 * (started.elapsed().as_secs() as usize + 1);
    assert!(
        (200..=bound).contains(&on_a),
        "A holds {on_a} of the flood (bound {bound})"
    );
    assert!(on_b <= bound, "B holds {on_b} of the flood (bound {bound})");
    // A counts the flood's source against it (it sent hundreds past its signer's rate);
    // B does not count A, which relayed only what it took.
    let hostile_id = hostile.local_peer_id().to_string();
    let score_on = |peers: Vec<cannabis_api::Peer>, id: &str| {
        peers
            .iter()
            .find(|p| p.peer_id == id)
            .map_or(f64::NEG_INFINITY, |p| p.score)
    };
    let on_a = score_on(a.handle.peers().await.unwrap(), &hostile_id);
    assert!(on_a < -50.0, "the flood's source scores {on_a} on A");
    let a_on_b = score_on(
        b.handle.peers().await.unwrap(),
        &a.handle.peer_id().to_string(),
    );
    assert!(a_on_b >= 0.0, "the honest relay scores {a_on_b} on B");
    // Honest offers still reach every node.
    an_honest_offer_reaches(&b, &a).await;
    drop(hostile);
    b.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_can_take_a_requesters_job_id_first() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let b = net::start(&dir.path().join("b"), Some(&a.addr)).await;
    net::wait_converged(&[&a, &b], 2).await;
    let secret = [67; 32];
    let mut hostile = subscribed_hostile(&a, secret).await;
    let keys = Keypair::from_secret(secret);
    // The hostile peer knows (or guesses) the job id B's next offer will have, and gossips
    // an offer of its own under that id first.
    let nonce = cannabis_protocol::Uuid::from_random([5; 16]);
    let taken = cannabis_protocol::job_id_of(&b.handle.address(), &nonce);
    let now = Timestamp(now_ms());
    let mut squat = cannabis_market::testkit::offer(
        keys.address(),
        1,
        vec![cannabis_market::testkit::task("t", 1, 0, 0, 1, 1_000)],
        now,
        600_000,
        1_200_000,
    );
    squat.job_id = taken;
    let topic = Topics::new(1).ident(Topic::Offers { shard: 0 });
    hostile
        .behaviour_mut()
        .gossipsub
        .publish(topic, Signed::sign(&keys, &squat).to_bytes())
        .unwrap();
    drive_for(&mut hostile, 1_000).await;
    assert!(
        a.handle.offers().await.unwrap().is_empty(),
        "an offer under someone else's job id got in"
    );
    // B's offer with that id reaches A.
    let mut template = net::offer(60_000);
    template.nonce = Some(nonce);
    let published = b.handle.publish_offer(template).await.unwrap();
    assert_eq!(published.job_id, taken.to_string());
    wait_for(Duration::from_secs(10), "A to see B's offer", || async {
        let offers = a.handle.offers().await.ok()?;
        offers
            .iter()
            .any(|o| o.job_id == published.job_id && o.requester == b.handle.address().to_string())
            .then_some(())
    })
    .await;
    drop(hostile);
    b.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_keeps_sending_invalid_messages_stays_penalized() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let mut hostile = subscribed_hostile(&a, rand_secret()).await;
    let hostile_id = hostile.local_peer_id().to_string();
    let topic = Topics::new(1).ident(Topic::Offers { shard: 0 });
    // One invalid message every two seconds: before each next one, the peer's score on A
    // is still below the publish threshold (-50), or A has disconnected it as graylisted.
    // (With a count that lost 70% a second, it was back near 0 within two.)
    let mut scores = Vec::new();
    for i in 0..8u8 {
        let garbage = format!("not an offer {i}").into_bytes();
        let _ = hostile
            .behaviour_mut()
            .gossipsub
            .publish(topic.clone(), garbage);
        drive_for(&mut hostile, 2_000).await;
        let peers = a.handle.peers().await.unwrap();
        let score = peers
            .iter()
            .find(|p| p.peer_id == hostile_id)
            .map_or(f64::NEG_INFINITY, |p| p.score);
        scores.push(score);
    }
    assert!(scores.iter().all(|s| *s < -50.0), "scores {scores:?}");
    // A graylisted peer does not stay connected: A's upkeep (every 10 s) let it go.
    assert_eq!(scores.last(), Some(&f64::NEG_INFINITY), "scores {scores:?}");
    // Nor does it get back in: each time it dials again, A refuses the connection as soon
    // as the handshake names the peer, before gossipsub (or any other protocol) starts on
    // it, so A never tells it what A subscribes to.
    let (mut connected, mut closed, mut told) = (0, 0, 0);
    for _ in 0..5 {
        hostile.dial(a.addr.clone()).unwrap();
        let _ = tokio::time::timeout(Duration::from_millis(1_000), async {
            loop {
                match hostile.select_next_some().await {
                    SwarmEvent::ConnectionEstablished { .. } => connected += 1,
                    SwarmEvent::ConnectionClosed { .. } => closed += 1,
                    SwarmEvent::Behaviour(HostileEvent::Gossipsub(
                        gossipsub::Event::Subscribed { .. },
                    )) => told += 1,
                    _ => {}
                }
            }
        })
        .await;
    }
    assert_eq!(
        told, 0,
        "A told a graylisted peer its subscriptions ({connected} connections, {closed} closed)"
    );
    assert_eq!(
        connected, closed,
        "A kept a graylisted peer's connection open"
    );
    assert_eq!(a.handle.status().await.unwrap().refused_peers, 1);
    drop(hostile);
    a.stop().await;
}

/// A peer is let go the moment its score falls below the graylist threshold, not at the
/// node's next upkeep (every 10 s, so up to 10 s later): one invalid message, and its
/// connection closes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_is_let_go_the_moment_it_is_graylisted() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let mut hostile = subscribed_hostile(&a, rand_secret()).await;
    let topic = Topics::new(1).ident(Topic::Offers { shard: 0 });
    hostile
        .behaviour_mut()
        .gossipsub
        .publish(topic, b"not an offer".to_vec())
        .unwrap();
    drive_until(&mut hostile, 2, "A to let the peer go", |e| {
        matches!(e, SwarmEvent::ConnectionClosed { .. }).then_some(())
    })
    .await;
    assert_eq!(a.handle.status().await.unwrap().refused_peers, 1);
    drop(hostile);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_asking_for_sync_pages_without_end_is_served_its_allowance() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let a_addr = a.handle.address().to_string();
    wait_for(Duration::from_secs(30), "A's own ad", || async {
        let ads = a.handle.ads().await.ok()?;
        ads.iter().any(|ad| ad.node == a_addr).then_some(())
    })
    .await;
    let mut hostile = hostile_swarm();
    hostile.dial(a.addr.clone()).unwrap();
    let a_peer = a.handle.peer_id();
    drive_for(&mut hostile, 500).await;
    // 300 requests for the first page, in waves of 50, as fast as it can.
    let (mut full, mut empty, mut failed) = (0, 0, 0);
    for _ in 0..6 {
        for _ in 0..50 {
            hostile
                .behaviour_mut()
                .sync
                .send_request(&a_peer, SyncRequest::Ads { after: None });
        }
        let mut answered = 0;
        let _ = tokio::time::timeout(Duration::from_secs(20), async {
            while answered < 50 {
                match hostile.select_next_some().await {
                    SwarmEvent::Behaviour(HostileEvent::Sync(
                        request_response::Event::Message {
                            message: request_response::Message::Response { response, .. },
                            ..
                        },
                    )) => {
                        answered += 1;
                        if response.ads.is_empty() {
                            empty += 1;
                        } else {
                            full += 1;
                        }
                    }
                    SwarmEvent::Behaviour(HostileEvent::Sync(
                        request_response::Event::OutboundFailure { .. },
                    )) => {
                        answered += 1;
                        failed += 1;
                    }
                    _ => {}
                }
            }
        })
        .await;
    }
    // The burst (160) and what the rate (30 a minute) adds in the seconds this takes.
    assert!(
        (160..=175).contains(&full),
        "{full} pages encoded, {empty} empty"
    );
    drop(hostile);
    a.stop().await;
}

/// The port node `n` listens on over TCP.
fn tcp_port(n: &net::TestNode) -> u16 {
    n.addr
        .iter()
        .find_map(|p| match p {
            libp2p::multiaddr::Protocol::Tcp(port) => Some(port),
            _ => None,
        })
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_from_one_address_cannot_lock_out_honest_peers() {
    let dir = tempfile::tempdir().unwrap();
    // The default per-address limit (tests raise it: every test node is on 127.0.0.1).
    let mut config = net::config(None);
    config.limits.max_pending_per_ip = cannabis_node::NodeConfig::default()
        .limits
        .max_pending_per_ip;
    let a = net::start_with(&dir.path().join("a"), config).await;
    let target: std::net::SocketAddr = ([127, 0, 0, 1], tcp_port(&a)).into();
    // 100 sockets from 127.0.0.2 that never start a handshake, renewed as A drops them,
    // for as long as the test runs.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attacker = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                while held.len() < 100 {
                    let s = tokio::net::TcpSocket::new_v4().unwrap();
                    s.bind(([127, 0, 0, 2], 0).into()).unwrap();
                    match s.connect(target).await {
                        Ok(c) => held.push(c),
                        Err(_) => break,
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                // Drop the ones A closed; the next round opens new ones.
                let mut alive = Vec::new();
                for c in held.drain(..) {
                    let mut buf = [0u8; 1];
                    match c.try_read(&mut buf) {
                        Ok(0) => {}
                        _ => alive.push(c),
                    }
                }
                held = alive;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    // An honest node joins through A while the sockets are held.
    let b = net::start(&dir.path().join("b"), Some(&a.addr)).await;
    let b_peer = b.handle.peer_id().to_string();
    wait_for(Duration::from_secs(10), "A to accept B", || async {
        let peers = a.handle.peers().await.ok()?;
        peers.iter().any(|p| p.peer_id == b_peer).then_some(())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = attacker.await;
    b.stop().await;
    a.stop().await;
}

/// (It runs alone: `.config/nextest.toml`. With other tests beside it on two cores, the
/// 37 MB it makes the nodes push took longer than its minute.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_is_penalized_and_let_go() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let b = net::start(&dir.path().join("b"), Some(&a.addr)).await;
    let c = net::start(&dir.path().join("c"), Some(&a.addr)).await;
    net::wait_converged(&[&a, &b, &c], 3).await;
    let hostile = subscribed_hostile(&a, rand_secret()).await;
    let hostile_id = hostile.local_peer_id().to_string();
    // From here on the hostile swarm is never polled: soon it reads nothing.
    // A, B and C publish 250 offers each, of about 50 KiB (37 MB in all, well past what
    // the sockets between A and the peer hold), which A sends on.
    for k in 0..250 {
        for n in [&a, &b, &c] {
            let mut t = cannabis_testnet::bench::bench_offer(k);
            t.tasks[0].workload.entrypoint.push("x".repeat(50_000));
            n.handle.publish_offer(t).await.unwrap();
        }
    }
    // The peer is penalized for what it did not take, then disconnected.
    let outcome = wait_for(
        Duration::from_secs(60),
        "A to let the slow peer go",
        || async {
            let peers = a.handle.peers().await.ok()?;
            match peers.iter().find(|p| p.peer_id == hostile_id) {
                None => Some(f64::NEG_INFINITY),
                Some(p) if p.score < -80.0 => Some(p.score),
                Some(_) => None,
            }
        },
    )
    .await;
    assert!(outcome < -80.0);
    drop(hostile);
    c.stop().await;
    b.stop().await;
    a.stop().await;
}

/// A peer that is honest but slow (a busy machine that reads in bursts, pausing for
/// seconds between them) is kept, and gets every offer: what is forwarded to it waits in
/// its queue for it instead of being abandoned and counted against it. With gossipsub's
/// default of 1 s for a forwarded message to wait, the node abandoned most of them and
/// graylisted the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_reads_slowly_is_kept_and_gets_every_offer() {
    const ROUNDS: usize = 5;
    const PER_ROUND: usize = 30;
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let b = net::start(&dir.path().join("b"), Some(&a.addr)).await;
    net::wait_converged(&[&a, &b], 2).await;
    let mut slow = subscribed_hostile(&a, rand_secret()).await;
    let slow_id = slow.local_peer_id().to_string();
    let offers = Topics::new(1).ident(Topic::Offers { shard: 0 }).hash();
    let mut got = std::collections::HashSet::new();
    let read = async |slow: &mut libp2p::Swarm<Hostile>,
                      got: &mut std::collections::HashSet<Vec<u8>>,
                      ms: u64| {
        let _ = tokio::time::timeout(Duration::from_millis(ms), async {
            loop {
                if let SwarmEvent::Behaviour(HostileEvent::Gossipsub(gossipsub::Event::Message {
                    message,
                    ..
                })) = slow.select_next_some().await
                    && message.topic == offers
                {
                    got.insert(message.data);
                }
            }
        })
        .await;
    };
    // A few heartbeats, for the peer to join A's mesh.
    read(&mut slow, &mut got, 2_000).await;
    // B publishes; A forwards to the peer, which reads for a second and a half, then
    // pauses for two and a half, and again (about 1.5 MB a round).
    for round in 0..ROUNDS {
        for k in 0..PER_ROUND {
            let mut t = cannabis_testnet::bench::bench_offer(round * PER_ROUND + k);
            t.tasks[0].workload.entrypoint.push("x".repeat(50_000));
            b.handle.publish_offer(t).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        read(&mut slow, &mut got, 1_500).await;
    }
    let all = ROUNDS * PER_ROUND;
    for _ in 0..20 {
        if got.len() >= all {
            break;
        }
        read(&mut slow, &mut got, 1_000).await;
    }
    let peers = a.handle.peers().await.unwrap();
    let kept = peers.iter().find(|p| p.peer_id == slow_id);
    assert!(
        kept.is_some_and(|p| p.score > -10.0),
        "A let the slow peer go or penalized it: {kept:?}"
    );
    assert_eq!(
        got.len(),
        all,
        "the slow peer got {} of {all} offers",
        got.len()
    );
    drop(slow);
    b.stop().await;
    a.stop().await;
}

/// A requester whose offers name other fee terms than the network's (here the 1% goes to
/// an address of its choosing) gets no bids: every worker declines with a signed reason
/// that names the terms, and the job fails saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_with_other_fee_terms_than_the_networks_is_declined() {
    use cannabis_market::job::JobState;

    let dir = tempfile::tempdir().unwrap();
    let worker = net::start(&dir.path().join("worker"), None).await;
    let mut c = net::config(Some(&worker.addr));
    let pocket = cannabis_market::testkit::keys(0xbad).address();
    c.gossip.fee = Some(cannabis_protocol::FeeTerms::founder(pocket));
    let requester = net::start_with(&dir.path().join("requester"), c).await;
    net::wait_converged(&[&worker, &requester], 2).await;
    let job = requester
        .handle
        .submit_job(crate::market::template(&crate::market::job_file(
            "own-fee", 1, "",
        )))
        .await
        .unwrap();
    let done = crate::market::wait_state(&requester, &job.job_id, "the job to fail", |j| {
        j.summary.state == JobState::Failed
    })
    .await;
    let t = &done.tasks[0];
    assert!(t.bids.is_empty(), "{:?}", t.bids);
    let me = worker.handle.address().to_string();
    let (_, why) = t
        .declines
        .iter()
        .find(|(w, _)| *w == me)
        .unwrap_or_else(|| panic!("no decline from the worker: {:?}", t.declines));
    assert!(
        why.contains("fee terms") && why.contains(&pocket.to_string()),
        "{why}"
    );
    assert!(t.status.to_string().contains("1 declined"), "{}", t.status);
    worker.stop().await;
    requester.stop().await;
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// Offers of 50 KB from two keys, 400 in all (20 MB): the node holds them, and once they
/// expire the memory they took goes back to the system (glibc keeps what is freed for the
/// program's next allocations: the process stayed at its peak, +171 MB, after every offer
/// was gone; the node now gives it back at its next upkeep). RSS is the test process's,
/// which holds the publishing swarms too: they are gone by then as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_of_expired_offers_is_given_back() {
    let dir = tempfile::tempdir().unwrap();
    let a = net::start(&dir.path().join("a"), None).await;
    let secrets: Vec<[u8; 32]> = (0..2u8).map(|i| [90 + i; 32]).collect();
    let mut swarms = Vec::new();
    // Not subscribed: they publish, and take nothing back that they would have to read.
    for s in &secrets {
        swarms.push(connected(&a, hostile_swarm_with(*s)).await);
    }
    let base = rss_kib();
    let topic = Topics::new(1).ident(Topic::Offers { shard: 0 });
    let now = Timestamp(now_ms());
    for (k, (s, h)) in secrets.iter().zip(swarms.iter_mut()).enumerate() {
        let keys = Keypair::from_secret(*s);
        for job in 0..200u64 {
            let mut task = cannabis_market::testkit::task("t", 1, 0, 0, 1, 1_000);
            task.workload.entrypoint = vec![format!("{k}-{job}-{}", "x".repeat(50_000))];
            let o = cannabis_market::testkit::offer(
                keys.address(),
                job + 1,
                vec![task],
                now,
                12_000,
                1_200_000,
            );
            h.behaviour_mut()
                .gossipsub
                .publish(topic.clone(), Signed::sign(&keys, &o).to_bytes())
                .unwrap();
            if job % 20 == 0 {
                drive_for(h, 50).await;
            }
        }
        drive_for(h, 500).await;
    }
    let h = a.handle.clone();
    wait_for(
        Duration::from_secs(10),
        "the node to hold the offers",
        || {
            let h = h.clone();
            async move { (h.offers().await.ok()?.len() == 400).then_some(()) }
        },
    )
    .await;
    let peak = rss_kib().saturating_sub(base);
    assert!(peak > 20_000, "the offers took {peak} KiB");
    drop(swarms);
    wait_for(Duration::from_secs(30), "the offers to expire", || {
        let h = h.clone();
        async move { h.offers().await.ok()?.is_empty().then_some(()) }
    })
    .await;
    // An upkeep (every 10 s) gives the memory back: waited for up to two of them, since a
    // loaded machine may run one late.
    let until = tokio::time::Instant::now() + Duration::from_secs(25);
    let after = loop {
        let after = rss_kib().saturating_sub(base);
        if after < peak / 2 || tokio::time::Instant::now() > until {
            break after;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        after < peak / 2,
        "{after} KiB still held of a peak of {peak} KiB after every offer expired"
    );
    drop(h);
    a.stop().await;
}

/// A peer asking for blocks without end gets its allowance (32 at once, then 60 a minute),
/// then refusals: each answer may read 4 MiB from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_asking_for_blocks_without_end_is_served_its_allowance() {
    let dir = tempfile::tempdir().unwrap();
    let genesis = dir.path().join("genesis.json");
    let seq = Keypair::from_secret([0x5e; 32]).address();
    let g = cannabis_protocol::Genesis {
        network: "hostile".into(),
        time: Timestamp(now_ms()),
        sequencer: seq,
        fee: cannabis_protocol::FeeTerms::founder(seq),
        resolver: seq,
        min_gas_price: 1,
        supply: cannabis_protocol::Amount(1_000),
        accounts: vec![cannabis_protocol::Allocation {
            address: seq,
            amount: cannabis_protocol::Amount(1_000),
        }],
        vesting: Vec::new(),
        faucet: None,
        rewards: cannabis_protocol::Rewards {
            pool: cannabis_protocol::Amount(0),
            per_block: cannabis_protocol::Amount(0),
            seed_window: 8,
        },
        block_interval_ms: 100,
        max_block_txs: 100,
    };
    std::fs::write(&genesis, serde_json::to_string(&g).unwrap()).unwrap();
    let mut config = net::config(None);
    config.ledger.genesis = Some(genesis);
    config.gossip.fee = None;
    let a = net::start_with(&dir.path().join("a"), config).await;
    let mut hostile = hostile_swarm();
    hostile.dial(a.addr.clone()).unwrap();
    let a_peer = a.handle.peer_id();
    drive_for(&mut hostile, 500).await;
    for _ in 0..50 {
        hostile
            .behaviour_mut()
            .ledger
            .send_request(&a_peer, LedgerRequest::Blocks { from: 1, max: 64 });
    }
    let (mut served, mut refused, mut answered) = (0, 0, 0);
    let _ = tokio::time::timeout(Duration::from_secs(20), async {
        while answered < 50 {
            if let SwarmEvent::Behaviour(HostileEvent::Ledger(request_response::Event::Message {
                message: request_response::Message::Response { response, .. },
                ..
            })) = hostile.select_next_some().await
            {
                answered += 1;
                match response {
                    LedgerResponse::Blocks(b) => {
                        assert!(b.is_empty(), "no block was made");
                        served += 1;
                    }
                    LedgerResponse::Refused { reason } => {
                        assert!(reason.contains("too many ledger requests"), "{reason}");
                        refused += 1;
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    })
    .await;
    assert_eq!(answered, 50, "{served} served, {refused} refused");
    // The burst, and what the rate adds in the moment this takes.
    assert!(
        (32..=34).contains(&served),
        "{served} served, {refused} refused"
    );
    // Not the sequencer: a transaction is refused with where to send it.
    let k = Keypair::from_secret([1; 32]);
    let tx = cannabis_protocol::Transaction::new(
        k.address(),
        Some(seq),
        cannabis_protocol::Amount(1),
        0,
        1,
        cannabis_protocol::TxPayload::Transfer,
    )
    .unwrap();
    hostile
        .behaviour_mut()
        .ledger
        .send_request(&a_peer, LedgerRequest::Submit(Signed::sign(&k, &tx)));
    let answer = drive_until(&mut hostile, 10, "the answer", |e| match e {
        SwarmEvent::Behaviour(HostileEvent::Ledger(request_response::Event::Message {
            message: request_response::Message::Response { response, .. },
            ..
        })) => Some(response),
        _ => None,
    })
    .await;
    assert!(
        matches!(&answer, LedgerResponse::Refused { reason } if reason.contains(&format!("its sequencer is {seq}"))),
        "{answer:?}"
    );
}

/// A genesis for one in-process node: `seq` sequences and holds `funds`, `k` holds
/// `k_funds`.
fn small_genesis(seq: &Keypair, k: &Keypair, k_funds: u64) -> cannabis_protocol::Genesis {
    use cannabis_protocol::{Allocation, Amount, FeeTerms, Genesis, Rewards};
    Genesis {
        network: "hostile-blocks".into(),
        time: Timestamp(now_ms()),
        sequencer: seq.address(),
        fee: FeeTerms::founder(seq.address()),
        resolver: seq.address(),
        min_gas_price: 1,
        supply: Amount(10_000_000 + k_funds),
        accounts: vec![
            Allocation {
                address: seq.address(),
                amount: Amount(10_000_000),
            },
            Allocation {
                address: k.address(),
                amount: Amount(k_funds),
            },
        ],
        vesting: Vec::new(),
        faucet: None,
        rewards: Rewards {
            pool: Amount(0),
            per_block: Amount(0),
            seed_window: 8,
        },
        block_interval_ms: 100,
        max_block_txs: 100,
    }
}

/// A block of `txs` signed by `signer` on top of (`height - 1`, `prev`).
fn block_of(
    signer: &Keypair,
    height: u64,
    prev: Digest,
    txs: Vec<Signed<cannabis_protocol::Transaction>>,
) -> cannabis_protocol::Block {
    let txs = txs
        .into_iter()
        .map(|s| {
            let t = cannabis_protocol::decode(s.payload()).unwrap();
            (s, t)
        })
        .collect();
    cannabis_protocol::Block::build(signer, height, prev, Timestamp(now_ms()), txs).unwrap()
}

/// Every bad block a peer gossips is refused by a validating node and changes nothing: a
/// wrong `compute_root`, a forged transaction, a replayed nonce, a result whose
/// `worker_address` is not its sender, a spend beyond the balance, a block from a key that
/// is not the sequencer's. The sequencer's good blocks are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_every_bad_block_a_peer_gossips() {
    use cannabis_protocol::{Amount, ComputeResult, Transaction, TxPayload};

    let dir = tempfile::tempdir().unwrap();
    let seq = Keypair::from_secret([0x5e; 32]);
    let k = Keypair::from_secret([0x6b; 32]);
    let g = small_genesis(&seq, &k, 1_000_000);
    let genesis = dir.path().join("genesis.json");
    std::fs::write(&genesis, serde_json::to_string(&g).unwrap()).unwrap();
    let mut config = net::config(None);
    config.ledger.genesis = Some(genesis);
    config.gossip.fee = None;
    let a = net::start_with(&dir.path().join("a"), config).await;
    let topics = Topics::new(1);
    let topic = topics.ident(Topic::Blocks);
    let transfer = |from: &Keypair, amount: u64, nonce: u64| {
        let t = Transaction::new(
            from.address(),
            Some(seq.address()),
            Amount(amount),
            nonce,
            1,
            TxPayload::Transfer,
        )
        .unwrap();
        Signed::sign(from, &t)
    };
    let height = |a: &net::TestNode| {
        let h = a.handle.clone();
        async move { h.ledger().await.unwrap().height }
    };
    let k_balance = |a: &net::TestNode| {
        let h = a.handle.clone();
        let who = k.address();
        async move { h.balance(Some(who)).await.unwrap().balance.0 }
    };

    // The sequencer's block 1 (k pays 10): taken.
    let mut hostile = connected(&a, hostile_swarm()).await;
    let first_tx = transfer(&k, 10, 0);
    let one = block_of(&seq, 1, g.id(), vec![first_tx.clone()]);
    let publish = |h: &mut libp2p::Swarm<Hostile>, b: &cannabis_protocol::Block| {
        let _ = h
            .behaviour_mut()
            .gossipsub
            .publish(topic.clone(), cannabis_protocol::encode(b));
    };
    publish(&mut hostile, &one);
    wait_for(Duration::from_secs(10), "block 1", || async {
        (height(&a).await == 1).then_some(())
    })
    .await;
    let after_one = k_balance(&a).await;
    assert_eq!(after_one, 1_000_000 - 10 - 21_000);

    // Bad blocks at height 2, each from a fresh peer (a rejected message costs its
    // sender): none applies.
    let tip = one.hash();
    let good = block_of(&seq, 2, tip, vec![transfer(&k, 5, 1)]);
    let mut wrong_root = good.clone();
    let mut header = good.header.verify().unwrap().body;
    header.compute_root = Digest::of(b"not the root");
    wrong_root.header = Signed::sign(&seq, &header);
    let forged = {
        let t = Transaction::new(
            k.address(),
            Some(seq.address()),
            Amount(5),
            1,
            1,
            TxPayload::Transfer,
        )
        .unwrap();
        block_of(&seq, 2, tip, vec![Signed::sign(&seq, &t)])
    };
    let replayed = block_of(&seq, 2, tip, vec![first_tx]);
    let not_theirs = {
        let r = ComputeResult::signed(
            &seq,
            cannabis_market::ledger::Ledger::seed_task_id(&tip),
            Digest::of(b"c"),
            None,
            Some(1),
        );
        let mut t = Transaction::submit_result(r, 1, 1).unwrap();
        t.from_address = k.address();
        block_of(&seq, 2, tip, vec![Signed::sign(&k, &t)])
    };
    let beyond = block_of(&seq, 2, tip, vec![transfer(&k, after_one, 1)]);
    let stranger = block_of(&k, 2, tip, vec![transfer(&k, 5, 1)]);
    let a_peer = a.handle.peer_id();
    let bad_blocks = [
        ("a wrong compute_root", wrong_root),
        ("a forged transaction", forged),
        ("a replayed nonce", replayed),
        ("a result from another worker", not_theirs),
        ("a spend beyond the balance", beyond),
        ("a block from a stranger", stranger),
    ];
    for (what, bad) in bad_blocks {
        let mut h = connected(&a, hostile_swarm()).await;
        publish(&mut h, &bad);
        drive_for(&mut h, 500).await;
        // Judged and refused: its sender's score fell, or it was let go.
        let id = h.local_peer_id().to_string();
        let score = a
            .handle
            .peers()
            .await
            .unwrap()
            .iter()
            .find(|p| p.peer_id == id)
            .map(|p| p.score);
        assert!(
            !h.is_connected(&a_peer) || score.is_some_and(|s| s < 0.0),
            "{what}: its sender still scores {score:?}"
        );
        assert_eq!(height(&a).await, 1, "{what} was taken");
    }
    assert_eq!(k_balance(&a).await, after_one);

    // The sequencer's good block 2 is still taken.
    publish(&mut hostile, &good);
    wait_for(Duration::from_secs(10), "block 2", || async {
        (height(&a).await == 2).then_some(())
    })
    .await;
    assert_eq!(k_balance(&a).await, after_one - 5 - 21_000);
    a.stop().await;
}
