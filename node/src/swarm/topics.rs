//! Gossip topics and the peer-scoring parameters, set deliberately (see docs/protocol.md,
//! "Network").

use std::collections::HashMap;
use std::time::Duration;

use libp2p::gossipsub::{self, IdentTopic, PeerScoreParams, PeerScoreThresholds, TopicScoreParams};

/// The gossip topics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topic {
    /// Signed capability ads.
    Ads,
    /// Signed job offers.
    Offers,
    /// Ledger blocks.
    Blocks,
}

impl Topic {
    /// Every topic a node subscribes to.
    pub const ALL: [Topic; 3] = [Topic::Ads, Topic::Offers, Topic::Blocks];

    /// The topic's name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Topic::Ads => "cannabis/capability-ads/v1",
            Topic::Offers => "cannabis/job-offers/v1",
            Topic::Blocks => "cannabis/ledger-blocks/v1",
        }
    }

    /// The gossipsub topic.
    pub fn ident(self) -> IdentTopic {
        IdentTopic::new(self.name())
    }

    /// The topic a hash belongs to.
    pub fn from_hash(hash: &gossipsub::TopicHash) -> Option<Topic> {
        Topic::ALL.into_iter().find(|t| t.ident().hash() == *hash)
    }
}

/// Peer scoring. One invalid message (a forgery, garbage, an expired or oversized message)
/// costs -100, below the graylist threshold, so a peer that sends one is ignored until its
/// penalty decays (to 30% each second, to zero within about 10 s for a single offence,
/// longer for repeated ones: the penalty is the square of the count). Honest peers never
/// forward an invalid message, because every node validates before forwarding.
pub fn peer_score(ip_colocation_threshold: f64) -> (PeerScoreParams, PeerScoreThresholds) {
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
        invalid_message_deliveries_decay: 0.3,
        ..TopicScoreParams::default()
    };
    let mut topics = HashMap::new();
    topics.insert(super::topics::Topic::Ads.ident().hash(), topic(1.0));
    topics.insert(super::topics::Topic::Offers.ident().hash(), topic(1.0));
    topics.insert(super::topics::Topic::Blocks.ident().hash(), topic(1.0));
    let params = PeerScoreParams {
        topics,
        topic_score_cap: 100.0,
        // P5: the node's own verdicts on directed requests (undecodable, oversized).
        app_specific_weight: 1.0,
        // P6: many peers behind one IP. Local testnets put every node on 127.0.0.1 and
        // raise the threshold.
        ip_colocation_factor_weight: -10.0,
        ip_colocation_factor_threshold: ip_colocation_threshold,
        // P7: protocol misbehaviour (broken promises, GRAFT floods).
        behaviour_penalty_weight: -10.0,
        behaviour_penalty_threshold: 6.0,
        behaviour_penalty_decay: 0.9,
        decay_interval: Duration::from_secs(1),
        decay_to_zero: 0.01,
        retain_score: Duration::from_secs(3600),
        ..PeerScoreParams::default()
    };
    let thresholds = PeerScoreThresholds {
        gossip_threshold: -10.0,
        publish_threshold: -50.0,
        graylist_threshold: -80.0,
        accept_px_threshold: 10.0,
        opportunistic_graft_threshold: 5.0,
    };
    (params, thresholds)
}
