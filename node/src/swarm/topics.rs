//! Gossip topics and the peer-scoring parameters, set deliberately (see docs/protocol.md,
//! "Network").

use std::collections::HashMap;
use std::time::Duration;

use libp2p::gossipsub::{self, IdentTopic, PeerScoreParams, PeerScoreThresholds, TopicScoreParams};

/// The gossip topics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Topic {
    /// Signed capability ads.
    Ads,
    /// Signed job offers, one topic per shard of the draw's ring (see docs/protocol.md,
    /// "Gossip topics").
    Offers {
        /// The shard.
        shard: u32,
    },
    /// Ledger blocks.
    Blocks,
}

/// The topics of a network with `shards` offer shards.
#[derive(Clone, Debug)]
pub struct Topics {
    shards: u32,
    by_hash: HashMap<gossipsub::TopicHash, Topic>,
}

impl Topics {
    /// The topics of a network whose offers travel on `shards` topics (a power of two, at
    /// most [`cannabis_protocol::draw::MAX_SHARDS`]).
    pub fn new(shards: u32) -> Self {
        let shards = shards.clamp(1, cannabis_protocol::draw::MAX_SHARDS);
        let mut t = Self {
            shards,
            by_hash: HashMap::new(),
        };
        let all = [Topic::Ads, Topic::Blocks]
            .into_iter()
            .chain((0..shards).map(|shard| Topic::Offers { shard }));
        for topic in all {
            t.by_hash.insert(t.ident(topic).hash(), topic);
        }
        t
    }

    /// Offer shards.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The topic's name on the wire.
    pub fn name(&self, topic: Topic) -> String {
        match topic {
            Topic::Ads => "cannabis/capability-ads/v1".into(),
            Topic::Offers { .. } if self.shards == 1 => "cannabis/job-offers/v1".into(),
            Topic::Offers { shard } => format!("cannabis/job-offers/v1/{}/{shard}", self.shards),
            Topic::Blocks => "cannabis/ledger-blocks/v1".into(),
        }
    }

    /// The gossipsub topic.
    pub fn ident(&self, topic: Topic) -> IdentTopic {
        IdentTopic::new(self.name(topic))
    }

    /// The topic a hash belongs to.
    pub fn from_hash(&self, hash: &gossipsub::TopicHash) -> Option<Topic> {
        self.by_hash.get(hash).copied()
    }

    /// The topics node `me` subscribes to: ads, blocks, and the offers of its own shard.
    pub fn own(&self, me: &cannabis_protocol::Address) -> [Topic; 3] {
        let point = cannabis_protocol::draw::worker_point(me);
        [
            Topic::Ads,
            Topic::Offers {
                shard: cannabis_protocol::draw::shard_of(point, self.shards),
            },
            Topic::Blocks,
        ]
    }

    /// The topics an offer is gossiped on: the shards its calls reach.
    pub fn of_offer(&self, offer: &cannabis_protocol::JobOffer) -> Vec<Topic> {
        cannabis_protocol::draw::offer_shards(offer, self.shards)
            .into_iter()
            .map(|shard| Topic::Offers { shard })
            .collect()
    }

    /// Every topic of the network.
    pub fn all(&self) -> impl Iterator<Item = (&gossipsub::TopicHash, &Topic)> {
        self.by_hash.iter()
    }
}

/// Below this score a peer is ignored: its gossip, its directed requests, its connections.
pub const GRAYLIST_THRESHOLD: f64 = -80.0;

/// Promises a peer may break before they count against it (P7): one heartbeat's worth of
/// asks.
const BEHAVIOUR_PENALTY_FREE: f64 = super::behaviour::CONTROL_IDS as f64;

/// Messages a peer may fail to take before they count against it (P8).
const SLOW_PEER_FREE: f64 = 50.0;

/// What the count of a peer's invalid messages keeps each second.
pub const INVALID_DECAY: f64 = 0.98;

/// What a peer's application penalty (P5) keeps each second: the same pace as P4.
pub const APP_DECAY: f64 = INVALID_DECAY;

/// Peer scoring. One invalid message (a forgery, garbage, an expired or oversized message)
/// costs -100, below the graylist threshold, so a peer that sends one is ignored until its
/// penalty decays: the count keeps 98% each second, so one offence keeps a peer graylisted
/// for about 5 s and below the publish threshold for about 17 s, and the penalty is the
/// square of the count, so a peer that keeps sending invalid messages, even one every few
/// seconds, stays graylisted. Honest peers never forward an invalid message, because every
/// node validates before forwarding.
pub fn peer_score(
    ip_colocation_threshold: f64,
    topics: &Topics,
) -> (PeerScoreParams, PeerScoreThresholds) {
    let topic = |weight: f64| TopicScoreParams {
        topic_weight: weight,
        // P1: a small bonus for staying in the mesh.
        time_in_mesh_weight: 0.01,
        time_in_mesh_quantum: Duration::from_secs(1),
        time_in_mesh_cap: 10.0,
        // P2: a bonus for delivering messages first.
        first_message_deliveries_weight: 1.0,
        first_message_deliveries_decay: 0.5,
        first_message_deliveries_cap: 50.0,
        // P3 and P3b off: these topics are quiet, so a delivery quota would punish
        // honest peers for the requesters' silence.
        mesh_message_deliveries_weight: 0.0,
        mesh_failure_penalty_weight: 0.0,
        // P4: invalid messages.
        invalid_message_deliveries_weight: -100.0,
        invalid_message_deliveries_decay: INVALID_DECAY,
        ..TopicScoreParams::default()
    };
    let params = PeerScoreParams {
        topics: topics
            .all()
            .map(|(hash, _)| (hash.clone(), topic(1.0)))
            .collect(),
        topic_score_cap: 100.0,
        // P5: the node's own verdicts on directed requests (undecodable, oversized).
        app_specific_weight: 1.0,
        // P6: many peers behind one IP. Local testnets put every node on 127.0.0.1 and
        // raise the threshold.
        ip_colocation_factor_weight: -10.0,
        ip_colocation_factor_threshold: ip_colocation_threshold,
        // P7: protocol misbehaviour: promises broken (messages offered in IHAVE and not
        // delivered within `IWANT_FOLLOWUP`) and GRAFTs during a backoff. An honest peer
        // that is busy (a bootstrap node that every new node talks to at once, on a loaded
        // machine) breaks a whole heartbeat's worth of promises at once, so one heartbeat's
        // worth (`CONTROL_IDS`) is free; past it each one costs its excess squared, so a
        // peer that keeps offering what it never sends is graylisted within a few
        // heartbeats. The count keeps 90% a second.
        behaviour_penalty_weight: -1.0,
        behaviour_penalty_threshold: BEHAVIOUR_PENALTY_FREE,
        behaviour_penalty_decay: 0.9,
        // P8: a peer that does not take what it is sent: its queue of 200 full, or a
        // message abandoned after `FORWARD_QUEUE` (our own, after gossipsub's 5 s). Past 50
        // such messages, -4 each, keeping 90% a second. A peer that stops reading
        // altogether is graylisted about 70 messages past its queue, and then
        // disconnected, instead of pinning the queue. The allowance is for a peer that is
        // only slow: a node whose own CPU is starved cannot send in time either, and that
        // is no fault of the peer's.
        slow_peer_weight: -4.0,
        slow_peer_threshold: SLOW_PEER_FREE,
        slow_peer_decay: 0.9,
        decay_interval: Duration::from_secs(1),
        decay_to_zero: 0.01,
        retain_score: Duration::from_secs(3600),
        ..PeerScoreParams::default()
    };
    let thresholds = PeerScoreThresholds {
        gossip_threshold: -10.0,
        publish_threshold: -50.0,
        graylist_threshold: GRAYLIST_THRESHOLD,
        accept_px_threshold: 10.0,
        opportunistic_graft_threshold: 5.0,
    };
    (params, thresholds)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What P7 or P8 takes from a peer's score, as gossipsub counts it: the excess of the
    /// count over its threshold, squared for P7, times the weight.
    fn penalty(count: f64, threshold: f64, weight: f64, squared: bool) -> f64 {
        let excess = (count - threshold).max(0.0);
        weight * if squared { excess * excess } else { excess }
    }

    /// A busy honest peer's burst costs it nothing; a peer that keeps misbehaving is
    /// graylisted within a few heartbeats.
    #[test]
    fn a_burst_is_forgiven_and_a_habit_is_not() {
        let (p, t) = peer_score(10.0, &Topics::new(1));
        let heartbeat = 0.7_f64;
        // P7: one heartbeat's worth of broken promises (every id asked for) is free.
        let burst = super::super::behaviour::CONTROL_IDS as f64;
        let free = penalty(
            burst,
            p.behaviour_penalty_threshold,
            p.behaviour_penalty_weight,
            true,
        );
        assert_eq!(free, 0.0);
        // A liar breaking every promise each heartbeat is graylisted by the third.
        let mut count = 0.0;
        let mut graylisted_at = None;
        for beat in 1..=10 {
            count = count * p.behaviour_penalty_decay.powf(heartbeat) + burst;
            let score = penalty(
                count,
                p.behaviour_penalty_threshold,
                p.behaviour_penalty_weight,
                true,
            );
            if score < t.graylist_threshold {
                graylisted_at = Some(beat);
                break;
            }
        }
        assert!(graylisted_at.is_some_and(|b| b <= 3), "{graylisted_at:?}");
        // P8: 50 messages not taken are free; a peer that takes none of the 750 a stalled
        // reader is sent in the hostile test is graylisted within 80 past its allowance.
        assert_eq!(
            penalty(50.0, p.slow_peer_threshold, p.slow_peer_weight, false),
            0.0
        );
        let at = (51..=750)
            .find(|n| {
                penalty(*n as f64, p.slow_peer_threshold, p.slow_peer_weight, false)
                    < t.graylist_threshold
            })
            .unwrap();
        assert!(at <= 80, "{at}");
    }
}
