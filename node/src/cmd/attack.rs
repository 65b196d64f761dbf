//! `cannabis testnet attack`: one hostile party against a local testnet's nodes, several
//! attacks at once, for a fixed time. It is how `testnet bench --hostile` measures what an
//! attacker costs honest traffic, and how a researcher can try a defence by hand. It
//! speaks the protocol as an attacker would (valid messages where that hurts most), and
//! takes only loopback targets: it is a testnet tool.
//!
//! The attacks, each from a key of its own (so that one being graylisted does not end the
//! others):
//! - **flood**: valid signed offers from one key, as many new job ids as it can, and new
//!   versions of one offer;
//! - **garbage**: undecodable bytes and forged signatures on the ads and offers topics;
//! - **asker**: sync pages without end (every page of ads and offers, again and again) and
//!   capability challenges of hours of work, to every node;
//! - **sockets**: TCP connections that never start a handshake, reopened as the nodes drop
//!   them.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cannabis_node::keystore::random_bytes;
use cannabis_node::swarm::{CHALLENGE_PROTOCOL, Codec, SYNC_PROTOCOL, Topic, Topics};
use cannabis_protocol::{
    CapabilityAd, ChallengeRequest, ChallengeResponse, Digest, Keypair, Signed, SyncRequest,
    SyncResponse, Timestamp,
};
use futures::StreamExt as _;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, gossipsub, identity, noise, request_response, tcp, yamux};
use serde::Serialize;

/// What the attack did.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct AttackReport {
    /// Nodes attacked.
    pub(crate) targets: usize,
    /// How long it ran, ms.
    pub(crate) ran_ms: u64,
    /// Valid offers the flood key published (new job ids and new versions).
    pub(crate) offers_published: u64,
    /// Garbage and forged messages published.
    pub(crate) garbage_published: u64,
    /// Sync pages the nodes served.
    pub(crate) sync_pages: u64,
    /// Sync requests refused or failed.
    pub(crate) sync_refused: u64,
    /// Greedy challenges sent.
    pub(crate) challenges_sent: u64,
    /// Of those, answered with a proof (not refused).
    pub(crate) challenges_proved: u64,
    /// Idle sockets opened (reopened ones included).
    pub(crate) sockets_opened: u64,
    /// Times the flood or garbage key came back after a node let it go.
    pub(crate) redials: u64,
}

#[derive(NetworkBehaviour)]
struct Attacker {
    gossipsub: gossipsub::Behaviour,
    sync: request_response::Behaviour<Codec<SyncRequest, SyncResponse>>,
    challenge: request_response::Behaviour<Codec<ChallengeRequest, ChallengeResponse>>,
}

fn swarm(secret: [u8; 32]) -> anyhow::Result<Swarm<Attacker>> {
    let mut bytes = secret;
    let key = identity::Keypair::ed25519_from_bytes(&mut bytes)?;
    Ok(libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )?
        .with_behaviour(|_: &identity::Keypair| {
            // Anonymous, as the network's messages are: a signed one is refused unread.
            let config = gossipsub::ConfigBuilder::default()
                .validation_mode(gossipsub::ValidationMode::Anonymous)
                // Anonymous messages have no author and sequence number: ids by content.
                .message_id_fn(|m: &gossipsub::Message| {
                    gossipsub::MessageId::from(Digest::of(&m.data).0.to_vec())
                })
                .max_transmit_size(2 << 20)
                .heartbeat_interval(Duration::from_millis(500))
                .build()?;
            let rr = || request_response::Config::default().with_request_timeout(CHALLENGE_WAIT);
            Ok(Attacker {
                gossipsub: gossipsub::Behaviour::new(
                    gossipsub::MessageAuthenticity::Anonymous,
                    config,
                )?,
                sync: request_response::Behaviour::new(
                    [(SYNC_PROTOCOL, request_response::ProtocolSupport::Outbound)],
                    rr(),
                ),
                challenge: request_response::Behaviour::new(
                    [(
                        CHALLENGE_PROTOCOL,
                        request_response::ProtocolSupport::Outbound,
                    )],
                    rr(),
                ),
            })
        })?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build())
}

/// How long a greedy challenge is waited for.
const CHALLENGE_WAIT: Duration = Duration::from_secs(30);

/// Idle sockets held open to each node.
const SOCKETS_PER_NODE: usize = 64;

/// One node under attack.
struct Target {
    addr: Multiaddr,
    peer: PeerId,
    socket: SocketAddr,
}

fn target(addr: &Multiaddr) -> anyhow::Result<Target> {
    let mut ip = None;
    let mut port = None;
    let mut peer = None;
    for p in addr {
        match p {
            Protocol::Ip4(a) => ip = Some(std::net::IpAddr::V4(a)),
            Protocol::Ip6(a) => ip = Some(std::net::IpAddr::V6(a)),
            Protocol::Tcp(p) => port = Some(p),
            Protocol::P2p(id) => peer = Some(id),
            _ => {}
        }
    }
    let (Some(ip), Some(port), Some(peer)) = (ip, port, peer) else {
        anyhow::bail!("{addr}: a target is /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID");
    };
    anyhow::ensure!(
        ip.is_loopback(),
        "{addr}: only nodes on this machine (loopback) can be attacked"
    );
    Ok(Target {
        addr: addr.clone(),
        peer,
        socket: SocketAddr::new(ip, port),
    })
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One kind of attack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
    /// Valid offers from one key, new ones and new versions, as fast as it can.
    Flood,
    /// Undecodable bytes and forged signatures on gossip.
    Garbage,
    /// Sync pages without end.
    Sync,
    /// Capability challenges of hours of work.
    Challenge,
    /// TCP connections that never start a handshake.
    Sockets,
}

impl Kind {
    /// Every kind.
    pub(crate) const ALL: [Kind; 5] = [
        Kind::Flood,
        Kind::Garbage,
        Kind::Sync,
        Kind::Challenge,
        Kind::Sockets,
    ];
}

/// Runs the attacks `kinds` against `targets` for `duration`, then reports.
pub(crate) fn run(
    targets: &[Multiaddr],
    kinds: &[Kind],
    duration: Duration,
) -> anyhow::Result<AttackReport> {
    anyhow::ensure!(!targets.is_empty(), "name at least one --target");
    let targets: Vec<Target> = targets.iter().map(target).collect::<Result<_, _>>()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(attack(&targets, kinds, duration))
}

async fn attack(
    targets: &[Target],
    kinds: &[Kind],
    duration: Duration,
) -> anyhow::Result<AttackReport> {
    let started = Instant::now();
    let until = started + duration;
    let mut report = AttackReport {
        targets: targets.len(),
        ..AttackReport::default()
    };
    let flood_secret = *random_bytes::<32>()?;
    let flood_keys = Keypair::from_secret(flood_secret);
    let mut flood = swarm(flood_secret)?;
    let mut garbage = swarm(*random_bytes::<32>()?)?;
    let mut asker = swarm(*random_bytes::<32>()?)?;
    let topics = Topics::new(1);
    let offers = topics.ident(Topic::Offers { shard: 0 });
    let ads = topics.ident(Topic::Ads);
    // Not subscribed: publishing reaches every node subscribed to the topic (flood
    // publishing), and the nodes forward nothing back to the attacker.
    for t in targets {
        for s in [&mut flood, &mut garbage, &mut asker] {
            s.dial(t.addr.clone())?;
        }
    }
    let mut sockets = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut job = 0u64;
    let t0 = Timestamp(now_ms());
    let task = cannabis_market::testkit::task("flood", 1, 0, 0, 1, 1_000);
    let mut stranger_seq = 0u64;
    let stranger = Keypair::from_secret(*random_bytes::<32>()?);
    // Sync cursors per node: the next request, and whether one is in flight.
    let mut cursor: BTreeMap<PeerId, SyncRequest> = BTreeMap::new();
    let mut in_flight: HashSet<PeerId> = HashSet::new();
    let mut connected: HashSet<PeerId> = HashSet::new();
    let mut last_challenge = Instant::now() - Duration::from_secs(10);
    let mut redial_flood: HashSet<PeerId> = HashSet::new();
    let mut redial_garbage: HashSet<PeerId> = HashSet::new();
    while Instant::now() < until {
        tokio::select! {
            _ = tick.tick() => {
                for (swarm, redial) in [(&mut flood, &mut redial_flood), (&mut garbage, &mut redial_garbage)] {
                    for peer in redial.drain() {
                        if let Some(t) = targets.iter().find(|t| t.peer == peer) {
                            report.redials += 1;
                            let _ = swarm.dial(t.addr.clone());
                        }
                    }
                }
                if kinds.contains(&Kind::Flood) {
                    let g = &mut flood.behaviour_mut().gossipsub;
                    report.offers_published += publish_flood(g, &offers, &flood_keys, &task, t0, &mut job);
                }
                if kinds.contains(&Kind::Garbage) {
                    let g = &mut garbage.behaviour_mut().gossipsub;
                    report.garbage_published += publish_garbage(g, &offers, &ads, &stranger, &mut stranger_seq)?;
                }
                // Sync pages without end, from every node at once.
                for t in targets.iter().filter(|_| kinds.contains(&Kind::Sync)) {
                    if connected.contains(&t.peer) && !in_flight.contains(&t.peer) {
                        let req = cursor.get(&t.peer).cloned().unwrap_or(SyncRequest::Ads { after: None });
                        asker.behaviour_mut().sync.send_request(&t.peer, req);
                        in_flight.insert(t.peer);
                    }
                }
                // A challenge of hours of work to every node, once a second.
                if kinds.contains(&Kind::Challenge) && last_challenge.elapsed() >= Duration::from_secs(1) {
                    last_challenge = Instant::now();
                    for t in targets.iter().filter(|t| connected.contains(&t.peer)) {
                        asker.behaviour_mut().challenge.send_request(&t.peer, ChallengeRequest {
                            seed: Digest::of(&random_bytes::<32>()?[..]),
                            n: 2048,
                            rounds: 4096,
                        });
                        report.challenges_sent += 1;
                    }
                }
                // Idle sockets: hold SOCKETS_PER_NODE to each node; reopen what closed.
                sockets.retain(|s: &tokio::net::TcpStream| match s.try_read(&mut [0u8; 64]) {
                    Ok(0) => false,
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                });
                let want = if kinds.contains(&Kind::Sockets) { SOCKETS_PER_NODE * targets.len() } else { 0 };
                let mut opened = 0;
                while sockets.len() < want && opened < 16 {
                    let t = &targets[sockets.len() % targets.len()];
                    if let Ok(Ok(s)) = tokio::time::timeout(
                        Duration::from_millis(200),
                        tokio::net::TcpStream::connect(t.socket),
                    ).await {
                        sockets.push(s);
                        report.sockets_opened += 1;
                    }
                    opened += 1;
                }
            }
            // Dropped (graylisted, most likely): come back at the next tick.
            e = flood.select_next_some() => {
                if let Some(peer) = lost(&e) {
                    redial_flood.insert(peer);
                }
            }
            e = garbage.select_next_some() => {
                if let Some(peer) = lost(&e) {
                    redial_garbage.insert(peer);
                }
            }
            e = asker.select_next_some() => match e {
                SwarmEvent::ConnectionEstablished { peer_id, .. } => {
                    connected.insert(peer_id);
                }
                SwarmEvent::ConnectionClosed { peer_id, num_established: 0, .. } => {
                    connected.remove(&peer_id);
                    in_flight.remove(&peer_id);
                    // Come back: a graylisted attacker is let go and tries again.
                    if let Some(t) = targets.iter().find(|t| t.peer == peer_id) {
                        let _ = asker.dial(t.addr.clone());
                    }
                }
                SwarmEvent::Behaviour(AttackerEvent::Sync(request_response::Event::Message {
                    peer,
                    message: request_response::Message::Response { response, .. },
                    ..
                })) => {
                    in_flight.remove(&peer);
                    report.sync_pages += 1;
                    let next = match cursor.get(&peer) {
                        None | Some(SyncRequest::Ads { .. }) => match response.ads.last() {
                            Some(last) if response.more => SyncRequest::Ads {
                                after: last.signer().ok(),
                            },
                            _ => SyncRequest::Offers { after: None },
                        },
                        Some(SyncRequest::Offers { .. }) => match response.offers.last() {
                            Some(last) if response.more => SyncRequest::Offers {
                                after: last.clone().open().ok().map(|o| o.body.job_id),
                            },
                            // From the start again, forever.
                            _ => SyncRequest::Ads { after: None },
                        },
                    };
                    cursor.insert(peer, next);
                }
                SwarmEvent::Behaviour(AttackerEvent::Sync(request_response::Event::OutboundFailure {
                    peer, ..
                })) => {
                    in_flight.remove(&peer);
                    report.sync_refused += 1;
                }
                SwarmEvent::Behaviour(AttackerEvent::Challenge(request_response::Event::Message {
                    message: request_response::Message::Response { response, .. },
                    ..
                })) => {
                    if matches!(response, ChallengeResponse::Answer { .. }) {
                        report.challenges_proved += 1;
                    }
                }
                _ => {}
            },
        }
    }
    report.ran_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    Ok(report)
}

/// One tick of the flood from `keys`: ten offers with new job ids and a new version of
/// offer 1 (200 and 20 a second). How many went out.
fn publish_flood(
    g: &mut gossipsub::Behaviour,
    topic: &gossipsub::IdentTopic,
    keys: &Keypair,
    task: &cannabis_protocol::TaskSpec,
    t0: Timestamp,
    tick: &mut u64,
) -> u64 {
    let offer = |job: u64, seq: u64| {
        let mut o = cannabis_market::testkit::offer(
            keys.address(),
            job,
            vec![task.clone()],
            t0,
            600_000,
            1_200_000,
        );
        o.seq = seq;
        Signed::sign(keys, &o).to_bytes()
    };
    *tick += 1;
    let new = (0..10).map(|k| offer(1_000 + *tick * 10 + k, 1));
    new.chain([offer(1, *tick + 1)])
        .map(|bytes| u64::from(g.publish(topic.clone(), bytes).is_ok()))
        .sum()
}

/// One tick of garbage: bytes that decode as nothing on the offers topic, and an ad of
/// `stranger` whose signature is broken. How many went out.
fn publish_garbage(
    g: &mut gossipsub::Behaviour,
    offers: &gossipsub::IdentTopic,
    ads: &gossipsub::IdentTopic,
    stranger: &Keypair,
    seq: &mut u64,
) -> anyhow::Result<u64> {
    let junk = random_bytes::<64>()?.to_vec();
    *seq += 1;
    let mut forged = Signed::sign(stranger, &ad(stranger, *seq)).to_bytes();
    if let Some(b) = forged.last_mut() {
        *b ^= 1;
    }
    Ok(u64::from(g.publish(offers.clone(), junk).is_ok())
        + u64::from(g.publish(ads.clone(), forged).is_ok()))
}

/// The node a swarm event says the attacker lost (or failed to reach again).
fn lost(e: &SwarmEvent<AttackerEvent>) -> Option<PeerId> {
    match e {
        SwarmEvent::ConnectionClosed {
            peer_id,
            num_established: 0,
            ..
        } => Some(*peer_id),
        SwarmEvent::OutgoingConnectionError {
            peer_id: Some(p), ..
        } => Some(*p),
        _ => None,
    }
}

/// A plausible capability ad of `keys`, numbered `seq`.
fn ad(keys: &Keypair, seq: u64) -> CapabilityAd {
    let now = Timestamp(now_ms());
    let mut ad = cannabis_market::testkit::ad(
        keys.address(),
        &cannabis_market::testkit::Machine::default(),
        now,
    );
    ad.seq = seq;
    ad
}
