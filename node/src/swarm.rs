//! The libp2p side of the node: the behaviour, the directed protocols' codec, the topics.

mod behaviour;
mod codec;
mod pending;
pub use pending::PendingPerIp;
pub mod shaping;
mod topics;

pub use behaviour::{
    Behaviour, BehaviourEvent, CHALLENGE_PROTOCOL, IDENTIFY_PROTOCOL, KAD_PROTOCOL,
    LEDGER_PROTOCOL, MARKET_PROTOCOL, MAX_TRANSMIT_SIZE, SYNC_PROTOCOL, TRANSFER_PROTOCOL,
    address_of, peer_of,
};
pub use codec::Codec;
pub use topics::{APP_DECAY, GRAYLIST_THRESHOLD, INVALID_DECAY, Topic, Topics, peer_score};

use std::time::Duration;

use libp2p::{Swarm, identity, noise, tcp, yamux};

use crate::config::NodeConfig;

/// Builds the swarm: TCP (through `shaping`: a plain link unless a testnet fault slows
/// it) and QUIC, Noise, Yamux, DNS, relay client, and the behaviour.
pub fn build(
    key: identity::Keypair,
    config: &NodeConfig,
    shaping: &shaping::Shaping,
) -> anyhow::Result<Swarm<Behaviour>> {
    use libp2p::Transport as _;
    let idle = Duration::from_secs(config.limits.idle_connection_timeout_secs);
    let shaping = shaping.clone();
    let swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_quic()
        // TCP as `with_tcp` makes it, each socket wrapped first.
        .with_other_transport(|key| {
            let noise = noise::Config::new(key)
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
            Ok(
                tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
                    .map(move |stream, _| shaping.wrap(stream))
                    .upgrade(libp2p::core::upgrade::Version::V1Lazy)
                    .authenticate(noise)
                    .multiplex(yamux::Config::default()),
            )
        })?
        .with_dns()?
        .with_relay_client(noise::Config::new, yamux::Config::default)?
        .with_behaviour(|key, relay_client| Behaviour::new(key, relay_client, config))
        .map_err(|e| anyhow::anyhow!("building the swarm behaviour: {e}"))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
        // A connection that has not finished its handshake by then is dropped: idle
        // sockets cannot hold the handshake slots for long.
        .with_connection_timeout(Duration::from_secs(config.limits.handshake_timeout_secs))
        .build();
    Ok(swarm)
}
