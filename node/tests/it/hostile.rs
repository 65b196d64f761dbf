//! A hostile peer: garbage, oversized messages, forged signatures, forged authors, replays
//! and expired messages on gossip, and oversized or undecodable directed requests. It is
//! rejected, its score drops, honest traffic still flows and no node crashes.

use std::io;
use std::time::Duration;

use cannabis_node::swarm::{MARKET_PROTOCOL, Topic, Topics};
use cannabis_protocol::{CapabilityAd, Keypair, Signed, Timestamp};
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
}

fn hostile_swarm() -> libp2p::Swarm<Hostile> {
    libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|key: &identity::Keypair| {
            let config = gossipsub::ConfigBuilder::default()
                .validation_mode(gossipsub::ValidationMode::Permissive)
                .max_transmit_size(4 << 20)
                .heartbeat_interval(Duration::from_millis(200))
                .build()
                .unwrap();
            Hostile {
                gossipsub: gossipsub::Behaviour::new(
                    gossipsub::MessageAuthenticity::Signed(key.clone()),
                    config,
                )
                .unwrap(),
                rr: request_response::Behaviour::with_codec(
                    RawCodec,
                    [(MARKET_PROTOCOL, request_response::ProtocolSupport::Outbound)],
                    request_response::Config::default(),
                ),
            }
        })
        .unwrap()
        .build()
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

    let mut hostile = hostile_swarm();
    let hostile_id = *hostile.local_peer_id();
    let topics = Topics::new(1);
    let offers = Topic::Offers { shard: 0 };
    for t in [Topic::Ads, offers] {
        hostile
            .behaviour_mut()
            .gossipsub
            .subscribe(&topics.ident(t))
            .unwrap();
    }
    hostile.dial(a.addr.clone()).unwrap();
    // Drive the hostile swarm until node A has subscribed it to both topics.
    let mut subscribed = 0;
    tokio::time::timeout(Duration::from_secs(10), async {
        while subscribed < 2 {
            if let SwarmEvent::Behaviour(HostileEvent::Gossipsub(gossipsub::Event::Subscribed {
                ..
            })) = hostile.select_next_some().await
            {
                subscribed += 1;
            }
        }
    })
    .await
    .expect("node A subscribed to the hostile peer's topics");

    let now = now_ms();
    let stranger = Keypair::from_secret([77; 32]);
    let mut forged_sig = ad(&stranger, now, now + 60_000);
    let last = forged_sig.len() - 1;
    forged_sig[last] ^= 0x01;
    let attacks: Vec<(&str, Topic, Vec<u8>)> = vec![
        ("garbage", offers, b"definitely not cbor".to_vec()),
        ("oversized", Topic::Ads, vec![0x82; 100 * 1024]),
        ("forged signature", Topic::Ads, forged_sig),
        // Validly signed by someone else, published by the hostile peer.
        (
            "forged author",
            Topic::Ads,
            ad(&stranger, now, now + 60_000),
        ),
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
                    if let Some(p) = peers.iter().find(|p| p.peer_id == hostile_id.to_string())
                        && p.score < 0.0
                    {
                        return p.score;
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
                .all(|ad| ad.node != stranger.address().to_string()),
            "a forged ad got in"
        );
        assert_eq!(n.handle.offers().await.unwrap().len(), 0);
    }

    // Honest traffic still flows, both ways.
    let offer = b.handle.publish_offer(net::offer(60_000)).await.unwrap();
    wait_for(
        Duration::from_secs(10),
        "node A to see the honest offer",
        || async {
            a.handle
                .offers()
                .await
                .ok()?
                .iter()
                .any(|o| o.job_id == offer.job_id)
                .then_some(())
        },
    )
    .await;
    let ping = b.handle.ping(a.handle.peer_id(), 3).await.unwrap();
    assert_eq!(ping.rtt_us.len(), 3);
    assert!(a.handle.status().await.is_ok());

    drop(hostile);
    b.stop().await;
    a.stop().await;
}
