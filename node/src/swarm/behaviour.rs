//! The node's libp2p behaviour: everything the swarm speaks, in one place.

use std::time::Duration;

use cannabis_protocol::{
    ChallengeRequest, ChallengeResponse, LedgerRequest, LedgerResponse, MarketRequest,
    MarketResponse, SyncRequest, SyncResponse, TransferRequest, TransferResponse, Wire as _,
};
use libp2p::swarm::NetworkBehaviour;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::{
    PeerId, StreamProtocol, allow_block_list, autonat, connection_limits, dcutr, gossipsub,
    identify, identity, kad, mdns, ping, relay, request_response,
};

use super::codec::Codec;
use super::topics;
use crate::config::NodeConfig;

/// Protocol id of the market protocol (bids, awards, leases, cancellation, ping).
pub const MARKET_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/market/1");
/// Protocol id of the sync protocol (a late joiner's copy of the live market).
pub const SYNC_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/sync/1");
/// Protocol id of the transfer protocol (a lease's objects, one checked chunk at a time).
pub const TRANSFER_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/transfer/1");
/// Protocol id of the ledger protocol (transactions to the sequencer, blocks to catch up).
pub const LEDGER_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/ledger/1");
/// Protocol id of the capability challenge.
pub const CHALLENGE_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/challenge/2");
/// A challenge is sized to about two seconds of work with three times that as deadline;
/// the transport timeout leaves room for large answers on slow links.
const CHALLENGE_TIMEOUT: Duration = Duration::from_secs(120);
/// Kademlia protocol name (our own, not the IPFS DHT).
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/kad/1.0.0");
/// Identify protocol version.
pub const IDENTIFY_PROTOCOL: &str = "/cannabis/id/1.0.0";

/// Largest gossip message: the biggest gossiped type (a block) plus its envelope.
pub const MAX_TRANSMIT_SIZE: usize =
    cannabis_protocol::Block::MAX_SIZE + cannabis_protocol::ENVELOPE_OVERHEAD + 1024;

/// Everything the swarm speaks.
#[derive(NetworkBehaviour)]
pub struct Behaviour {
    /// Graylisted peers: a connection to one is refused as soon as its handshake names it,
    /// before any other protocol starts on it (the service keeps the list).
    pub(crate) blocked: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    pub(crate) pending: super::pending::PendingPerIp,
    pub(crate) limits: connection_limits::Behaviour,
    pub(crate) gossipsub: gossipsub::Behaviour<gossipsub::IdentityTransform, SubscriptionFilter>,
    pub(crate) kad: kad::Behaviour<kad::store::MemoryStore>,
    pub(crate) identify: identify::Behaviour,
    pub(crate) ping: ping::Behaviour,
    pub(crate) mdns: Toggle<mdns::tokio::Behaviour>,
    pub(crate) autonat: Toggle<autonat::Behaviour>,
    pub(crate) relay_client: relay::client::Behaviour,
    pub(crate) relay_server: Toggle<relay::Behaviour>,
    pub(crate) dcutr: dcutr::Behaviour,
    pub(crate) market: request_response::Behaviour<Codec<MarketRequest, MarketResponse>>,
    pub(crate) sync: request_response::Behaviour<Codec<SyncRequest, SyncResponse>>,
    pub(crate) challenge: request_response::Behaviour<Codec<ChallengeRequest, ChallengeResponse>>,
    pub(crate) transfer: request_response::Behaviour<Codec<TransferRequest, TransferResponse>>,
    pub(crate) ledger: request_response::Behaviour<Codec<LedgerRequest, LedgerResponse>>,
    /// Raw streams: a group's private channel (`crate::group`).
    pub(crate) streams: libp2p_stream::Behaviour,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which subscriptions of a peer the node keeps track of: only its own network's topics,
/// and no more than there are (a peer subscribing to 100,000 topics costs nothing).
pub(crate) type SubscriptionFilter =
    gossipsub::MaxCountSubscriptionFilter<gossipsub::WhitelistSubscriptionFilter>;

fn subscription_filter(topics: &topics::Topics) -> SubscriptionFilter {
    let known: std::collections::HashSet<_> = topics.all().map(|(h, _)| h.clone()).collect();
    let n = known.len();
    gossipsub::MaxCountSubscriptionFilter {
        filter: gossipsub::WhitelistSubscriptionFilter(known),
        max_subscribed_topics: n,
        max_subscriptions_per_request: 2 * n,
    }
}

impl Behaviour {
    pub(crate) fn new(
        key: &identity::Keypair,
        relay_client: relay::client::Behaviour,
        config: &NodeConfig,
    ) -> Result<Self, BoxError> {
        let peer_id = key.public().to_peer_id();
        let limits = connection_limits::ConnectionLimits::default()
            .with_max_established(Some(config.limits.max_established))
            // A quarter of the slots stay for this node's own dials: inbound connections
            // alone cannot cut it off from the peers it chooses.
            .with_max_established_incoming(Some(
                config.limits.max_established - config.limits.max_established / 4,
            ))
            .with_max_established_per_peer(Some(config.limits.max_established_per_peer))
            .with_max_pending_incoming(Some(config.limits.max_pending_incoming))
            .with_max_pending_outgoing(Some(config.limits.max_pending_outgoing));

        // Every gossiped payload is a signed envelope the market checks, so gossipsub's own
        // author, sequence number and signature would say nothing more, and checking a
        // signature a sender chose to attach would be work any peer could make every node
        // do for every message and every duplicate: messages carry none, and one carrying
        // any is invalid (see gossip_config).
        let topics = topics::Topics::new(config.gossip.offer_shards);
        let mut gossipsub = gossipsub::Behaviour::new_with_subscription_filter(
            gossipsub::MessageAuthenticity::Anonymous,
            gossip_config(config, &topics)?,
            subscription_filter(&topics),
        )?;
        let (params, thresholds) =
            topics::peer_score(config.gossip.ip_colocation_threshold, &topics);
        gossipsub.with_peer_score(params, thresholds)?;
        let me = address_of(&peer_id).ok_or("the node's key is not an ed25519 key")?;
        for topic in topics.own(&me) {
            gossipsub.subscribe(&topics.ident(topic))?;
        }

        // Lookups ask 8 peers, not 20: a node needs a handful of connections for gossip,
        // and every peer a lookup asks is a connection (see `trim_connections`). Buckets
        // hold 8 peers too: libp2p-kad makes all 256 buckets with room for their size up
        // front, and at 20 that was 1.6 MiB of every idle node's heap for peers a lookup
        // of 8 never asks.
        let eight = std::num::NonZeroUsize::MIN.saturating_add(7);
        let mut kad_config = kad::Config::new(KAD_PROTOCOL);
        kad_config.set_replication_factor(eight);
        kad_config.set_kbucket_size(eight);
        let mut kad =
            kad::Behaviour::with_config(peer_id, kad::store::MemoryStore::new(peer_id), kad_config);
        kad.set_mode(Some(kad::Mode::Server));

        let identify = identify::Behaviour::new(
            identify::Config::new(IDENTIFY_PROTOCOL.into(), key.public())
                .with_agent_version(format!("cannabis/{}", env!("CARGO_PKG_VERSION"))),
        );
        let mdns = if config.mdns {
            Some(mdns::tokio::Behaviour::new(
                mdns::Config::default(),
                peer_id,
            )?)
        } else {
            None
        };
        let loopback_only = !config.listen.is_empty()
            && config.listen.iter().all(|a| {
                a.iter().any(|p| match p {
                    libp2p::multiaddr::Protocol::Ip4(ip) => ip.is_loopback(),
                    libp2p::multiaddr::Protocol::Ip6(ip) => ip.is_loopback(),
                    _ => false,
                })
            });
        let relay_server = config
            .relay_server
            .then(|| relay::Behaviour::new(peer_id, relay::Config::default()));
        let rr_config = request_response::Config::default()
            .with_request_timeout(Duration::from_secs(config.limits.request_timeout_secs));
        Ok(Self {
            blocked: allow_block_list::Behaviour::default(),
            pending: super::pending::PendingPerIp::new(config.limits.max_pending_per_ip),
            limits: connection_limits::Behaviour::new(limits),
            gossipsub,
            kad,
            identify,
            ping: ping::Behaviour::new(ping::Config::new()),
            mdns: mdns.into(),
            // AutoNAT asks peers to dial this node back to learn whether it is reachable:
            // pointless (and a connection per probe) when it listens on loopback only.
            autonat: (!loopback_only)
                .then(|| autonat::Behaviour::new(peer_id, autonat::Config::default()))
                .into(),
            relay_client,
            relay_server: relay_server.into(),
            dcutr: dcutr::Behaviour::new(peer_id),
            market: request_response::Behaviour::with_codec(
                Codec::default(),
                [(MARKET_PROTOCOL, request_response::ProtocolSupport::Full)],
                rr_config.clone(),
            ),
            sync: request_response::Behaviour::with_codec(
                Codec::default(),
                [(SYNC_PROTOCOL, request_response::ProtocolSupport::Full)],
                rr_config,
            ),
            challenge: request_response::Behaviour::with_codec(
                Codec::default(),
                [(CHALLENGE_PROTOCOL, request_response::ProtocolSupport::Full)],
                request_response::Config::default().with_request_timeout(CHALLENGE_TIMEOUT),
            ),
            // A few chunks in flight per fetch; a chunk (256 KiB) that takes longer than
            // this is asked for again.
            transfer: request_response::Behaviour::with_codec(
                Codec::default(),
                [(TRANSFER_PROTOCOL, request_response::ProtocolSupport::Full)],
                request_response::Config::default()
                    .with_request_timeout(Duration::from_secs(30))
                    .with_max_concurrent_streams(64),
            ),
            ledger: request_response::Behaviour::with_codec(
                Codec::default(),
                [(LEDGER_PROTOCOL, request_response::ProtocolSupport::Full)],
                request_response::Config::default().with_request_timeout(Duration::from_secs(10)),
            ),
            streams: libp2p_stream::Behaviour::new(),
        })
    }
}

/// The largest control message gossipsub reads (IHAVE, IWANT, IDONTWANT, GRAFT, PRUNE): a
/// peer whose control message is bigger is not read any more. Ours must stay under it.
const CONTROL_MESSAGE_CAP: usize = 16 * 1024;

/// Messages queued for one peer (see `gossip_config`).
const SEND_QUEUE: usize = 200;

/// Message ids one control message of ours names at most, and the most messages the node
/// asks one peer for in a heartbeat (gossipsub uses one setting for both). Each id is 32
/// bytes (SHA-256) and 2 of protobuf framing, so 64 are far under the cap. And 64 leaves
/// most of the peer's queue for us to its mesh traffic: a peer asked for more than it can
/// queue (466 at first) drops some, and each one it drops is a promise broken, which
/// gossipsub counts against it squared (P7). On a 100-node testnet starting on two cores,
/// nodes graylisted their busy bootstrap peer that way and never converged.
pub(super) const CONTROL_IDS: usize = 64;

/// How long a message forwarded to a peer (on from the mesh, or asked for in an IWANT)
/// waits in its queue before it is abandoned, and counted against the peer (P8).
/// Gossipsub's default is 1 s. On a loaded node the sender's own turn to write can take
/// longer than that: a bootstrap node on a 100-node testnet starting on two cores
/// abandoned dozens of messages to each of its honest peers and graylisted them all. Offers
/// and ads live for minutes, so a message a few seconds late is still worth sending.
const FORWARD_QUEUE: Duration = Duration::from_secs(5);

/// How long the node waits for a message it asked for (IWANT) before the peer that offered
/// it has broken its promise (P7). Longer than `FORWARD_QUEUE`, so that a peer whose
/// answer is still queued in time is not blamed.
const IWANT_FOLLOWUP: Duration = Duration::from_secs(8);

/// Room for gossipsub's own fields around a payload (topic name, author, sequence number).
const GOSSIP_FIELDS: usize = 512;

/// The largest message each topic carries: its kind's cap and the envelope. A bigger one
/// is an invalid message (it counts against the peer's score), not a silent drop.
fn topic_cap(topic: topics::Topic) -> usize {
    use cannabis_protocol::{Block, CapabilityAd, ENVELOPE_OVERHEAD, JobOffer, Wire as _};
    let kind = match topic {
        topics::Topic::Ads => CapabilityAd::MAX_SIZE + ENVELOPE_OVERHEAD,
        topics::Topic::Offers { .. } => JobOffer::MAX_SIZE + ENVELOPE_OVERHEAD,
        topics::Topic::Blocks => Block::MAX_SIZE + ENVELOPE_OVERHEAD,
    };
    kind + GOSSIP_FIELDS
}

fn gossip_config(
    config: &NodeConfig,
    topics: &topics::Topics,
) -> Result<gossipsub::Config, BoxError> {
    // Mesh sizes: checked here because the builder does not check
    // mesh_outbound_min <= mesh_n_low <= mesh_n <= mesh_n_high.
    let (outbound_min, low, n, high) = (2, 4, 6, 12);
    if !(outbound_min <= low && low <= n && n <= high) {
        return Err("gossip mesh sizes out of order".into());
    }
    let mut builder = gossipsub::ConfigBuilder::default();
    for (hash, topic) in topics.all() {
        builder.max_transmit_size_for_topic(topic_cap(*topic), hash.clone());
    }
    Ok(builder
        // Messages queued for one peer: a peer that stops reading holds at most this many
        // (each within its topic's cap: at most 12 MiB of offers), and each one refused
        // past them counts against it (P8).
        .connection_handler_queue_len(SEND_QUEUE)
        // gossipsub's default is 5,000 ids in one IHAVE or IWANT (160 KiB: a peer would
        // stop reading us); see `CONTROL_IDS`.
        .max_control_messages_sent(CONTROL_IDS)
        .max_control_message_size(CONTROL_MESSAGE_CAP)
        .forward_queue_duration(FORWARD_QUEUE)
        .iwant_followup_time(IWANT_FOLLOWUP)
        .heartbeat_interval(Duration::from_millis(config.gossip.heartbeat_millis))
        .validation_mode(gossipsub::ValidationMode::Anonymous)
        .validate_messages()
        // The topic is part of the id: an offer gossiped on several shards' topics is one
        // message per topic.
        .message_id_fn(|m: &gossipsub::Message| {
            let id =
                cannabis_protocol::Digest::of_parts(&[m.topic.as_str().as_bytes(), &[0], &m.data]);
            gossipsub::MessageId::from(id.0.to_vec())
        })
        .max_transmit_size(MAX_TRANSMIT_SIZE)
        .flood_publish(true)
        .duplicate_cache_time(Duration::from_secs(120))
        .mesh_outbound_min(outbound_min)
        .mesh_n_low(low)
        .mesh_n(n)
        .mesh_n_high(high)
        .build()?)
}

/// The address of a peer whose key is an ed25519 key (every cannabis node's is).
pub fn address_of(peer: &PeerId) -> Option<cannabis_protocol::Address> {
    let mh: &libp2p::multihash::Multihash<64> = peer.as_ref();
    if mh.code() != 0 {
        return None;
    }
    let key = identity::PublicKey::try_decode_protobuf(mh.digest()).ok()?;
    let key = key.try_into_ed25519().ok()?;
    cannabis_protocol::Address::from_public_key(key.to_bytes()).ok()
}

/// The peer id of a node address.
pub fn peer_of(address: &cannabis_protocol::Address) -> Option<PeerId> {
    let key = identity::ed25519::PublicKey::try_from_bytes(address.public_key()).ok()?;
    Some(identity::PublicKey::from(key).to_peer_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every control message the node sends fits what a peer reads (16 KiB): the ids it
    /// names, their framing, the longest topic name and the envelope; and the messages it
    /// asks a peer for at once fit what the peer queues for it.
    #[test]
    fn the_nodes_own_control_messages_fit_what_peers_read() {
        let config = NodeConfig::default();
        let topics = topics::Topics::new(cannabis_protocol::draw::MAX_SHARDS);
        let g = gossip_config(&config, &topics).unwrap();
        let longest_topic = topics.all().map(|(h, _)| h.as_str().len()).max().unwrap();
        let ids = g.max_control_messages_sent();
        assert!(ids >= 32, "{ids} ids a heartbeat are too few to gossip");
        // What the node asks a peer for in one heartbeat fits the peer's queue for it,
        // with room for the peer's mesh traffic to it: else an honest peer breaks promises.
        assert!(
            ids <= g.connection_handler_queue_len() / 2,
            "the node asks a peer for {ids} messages a heartbeat, and a peer queues {}",
            g.connection_handler_queue_len()
        );
        // A peer whose answer to an IWANT is still queued, within its time, has not
        // broken its promise yet.
        assert!(g.iwant_followup_time() > g.forward_queue_duration());
        let biggest = ids * (32 + 2) + longest_topic + 64;
        assert!(
            biggest <= g.max_control_message_size() && biggest <= CONTROL_MESSAGE_CAP,
            "a control message of ours may be {biggest} bytes"
        );
    }
}
