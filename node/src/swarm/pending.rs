//! A cap on incoming connections still handshaking from one IP address. libp2p's own limit
//! is for all addresses together: without this, about 64 idle sockets that never start a
//! handshake, renewed as they time out, keep every other peer out.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::task::{Context, Poll};

use libp2p::core::Endpoint;
use libp2p::core::transport::PortUse;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{Multiaddr, PeerId};

/// Refuses an incoming connection while `max` others from its IP address are handshaking.
pub struct PendingPerIp {
    max: usize,
    by_connection: HashMap<ConnectionId, IpAddr>,
    per_ip: HashMap<IpAddr, usize>,
}

/// Too many handshakes from one address.
#[derive(Debug, thiserror::Error)]
#[error("{pending} connections from {ip} are still handshaking (at most {max})")]
pub(super) struct TooManyPending {
    ip: IpAddr,
    pending: usize,
    max: usize,
}

fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

impl PendingPerIp {
    /// At most `max` handshakes from one address at a time.
    pub fn new(max: u32) -> Self {
        Self {
            max: max.max(1) as usize,
            by_connection: HashMap::new(),
            per_ip: HashMap::new(),
        }
    }

    fn done(&mut self, id: ConnectionId) {
        if let Some(ip) = self.by_connection.remove(&id)
            && let Some(n) = self.per_ip.get_mut(&ip)
        {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }
}

impl NetworkBehaviour for PendingPerIp {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        _: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        let Some(ip) = ip_of(remote) else {
            return Ok(());
        };
        let pending = self.per_ip.get(&ip).copied().unwrap_or(0);
        if pending >= self.max {
            return Err(ConnectionDenied::new(TooManyPending {
                ip,
                pending,
                max: self.max,
            }));
        }
        *self.per_ip.entry(ip).or_default() += 1;
        self.by_connection.insert(connection_id, ip);
        Ok(())
    }

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.done(connection_id);
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm<'_>) {
        if let FromSwarm::ListenFailure(f) = event {
            self.done(f.connection_id);
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}
