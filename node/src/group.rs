//! The group channel's I/O: the Noise handshake of [`cannabis_protocol::channel`] over a
//! byte stream between two ranks' nodes (a swarm stream, relayed where needed), and the
//! forwarding of one local connection through it.
//!
//! The shape torchrun needs: rank 0 hosts the rendezvous (PyTorch's TCPStore) and the
//! other ranks reach it, and each other's collectives, only through the channel. Each
//! connection a rank's workload opens to its local endpoint becomes one stream to rank 0's
//! node, with a handshake of its own; rank 0's node connects it to the service in its
//! sandbox. A peer that fails the handshake reaches nothing.
//!
//! Frames on the stream: a 2-byte big-endian length, then that many bytes (one Noise
//! message, at most 65,535). The first frame, in the clear, is the [`Opening`]: which
//! group attempt, which ranks, which port.
//!
//! On a node, [`Groups`] keeps the group attempts whose leases it holds. Once a rank's
//! sandbox runs, its node reaches into the sandbox's own network namespace (only a
//! loopback interface, which nothing outside the sandbox can reach): for a rank above 0 it
//! listens on `127.0.0.1:29500` there (`MASTER_PORT`) and carries each connection to rank
//! 0's node; rank 0's node connects what arrives for a port to that port on its sandbox's
//! loopback, where the workload's service (PyTorch's store) listens. Nothing listens on a
//! network interface of the machine.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use cannabis_market::lease::AssignmentKey;
use cannabis_protocol::channel::{Channel, Handshake, MAX_PLAINTEXT};
use cannabis_protocol::{Keypair, Rendezvous, Uuid};
use futures::StreamExt as _;
use libp2p::{PeerId, StreamProtocol};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio_util::compat::FuturesAsyncReadCompatExt as _;
use tracing::{debug, info, warn};

/// Protocol id of a group channel's streams on the swarm.
pub const GROUP_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/group/1");

/// The port of rank 0's rendezvous service (PyTorch's `MASTER_PORT` default): the
/// endpoint every rank above 0 is given.
pub const RENDEZVOUS_PORT: u16 = 29_500;

/// How long the opener of a stream has for its opening and the handshake.
const OPENING_TIMEOUT: Duration = Duration::from_secs(10);

/// Streams being opened or handshaken at once, from all peers together, each for at most
/// [`OPENING_TIMEOUT`].
const MAX_OPENING: usize = 64;

/// Of those, from one peer: a peer opening streams it never completes cannot hold the
/// slots every other rank's connections need.
const MAX_OPENING_PER_PEER: usize = 4;

/// The first frame of a channel stream, in the clear: what its opener wants to reach.
/// Nothing in it is trusted until the handshake (whose keys the rendezvous names)
/// completes: it only says which handshake to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opening {
    /// The group attempt.
    pub rendezvous: Uuid,
    /// Its epoch.
    pub epoch: u64,
    /// The opener's rank.
    pub from: u32,
    /// The rank it wants to reach.
    pub to: u32,
    /// The port of that rank's service.
    pub port: u16,
}

impl Opening {
    /// Its length on the wire.
    pub const LEN: usize = 34;

    /// `id (16) || u64_le(epoch) || u32_le(from) || u32_le(to) || u16_le(port)`.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..16].copy_from_slice(&self.rendezvous.0);
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b[24..28].copy_from_slice(&self.from.to_le_bytes());
        b[28..32].copy_from_slice(&self.to.to_le_bytes());
        b[32..34].copy_from_slice(&self.port.to_le_bytes());
        b
    }

    /// The opening in `b`, which must be exactly [`Opening::LEN`] bytes.
    pub fn decode(b: &[u8]) -> anyhow::Result<Self> {
        let b: &[u8; Self::LEN] = b
            .try_into()
            .map_err(|_| anyhow::anyhow!("an opening of {} bytes, not {}", b.len(), Self::LEN))?;
        let mut id = [0u8; 16];
        id.copy_from_slice(&b[..16]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut epoch = [0u8; 8];
        epoch.copy_from_slice(&b[16..24]);
        Ok(Self {
            rendezvous: Uuid(id),
            epoch: u64::from_le_bytes(epoch),
            from: u32_at(24),
            to: u32_at(28),
            port: u16::from_le_bytes([b[32], b[33]]),
        })
    }
}

/// Writes one frame.
async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, message: &[u8]) -> anyhow::Result<()> {
    let len = u16::try_from(message.len()).context("a channel message over 65,535 bytes")?;
    w.write_all(&len.to_be_bytes()).await?;
    w.write_all(message).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame; `None` at a clean end of the stream.
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> anyhow::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 2];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    // At most MAX_MESSAGE: the length is two bytes.
    let len = usize::from(u16::from_be_bytes(len));
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    Ok(Some(buf))
}

/// Runs `handshake` over `stream` to its end: the established channel, or why not.
pub async fn establish<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    mut handshake: Handshake,
) -> anyhow::Result<Channel> {
    while !handshake.is_finished() {
        if handshake.is_my_turn() {
            let m = handshake.write()?;
            write_frame(stream, &m).await?;
        } else {
            let m = read_frame(stream)
                .await?
                .context("the peer closed the stream during the handshake")?;
            handshake
                .read(&m)
                .with_context(|| format!("handshake with {}", handshake.peer()))?;
        }
    }
    Ok(handshake.finish()?)
}

/// Carries `local` (a connection of the workload's, or to the service in rank 0's
/// sandbox) through `channel` over `stream`, both ways, until either side closes. Each
/// message holds at most [`MAX_PLAINTEXT`] bytes; a message that fails to open ends it.
/// The bytes carried each way.
pub async fn forward<S, L>(channel: Channel, stream: S, local: L) -> anyhow::Result<(u64, u64)>
where
    S: AsyncRead + AsyncWrite + Unpin,
    L: AsyncRead + AsyncWrite + Unpin,
{
    // One Noise state, two directions: sealing and opening use separate cipher states,
    // so each holds the lock only for one message.
    let channel = Arc::new(Mutex::new(channel));
    fn lock(c: &Mutex<Channel>) -> anyhow::Result<std::sync::MutexGuard<'_, Channel>> {
        c.lock()
            .map_err(|_| anyhow::anyhow!("the channel's state was poisoned"))
    }
    let (mut stream_r, mut stream_w) = tokio::io::split(stream);
    let (mut local_r, mut local_w) = tokio::io::split(local);
    let out = async {
        let mut buf = vec![0u8; MAX_PLAINTEXT];
        let mut sent = 0u64;
        loop {
            let n = local_r.read(&mut buf).await?;
            if n == 0 {
                stream_w.shutdown().await?;
                return anyhow::Ok(sent);
            }
            let sealed = lock(&channel)?.seal(&buf[..n])?;
            write_frame(&mut stream_w, &sealed).await?;
            sent += n as u64;
        }
    };
    let back = async {
        let mut got = 0u64;
        while let Some(m) = read_frame(&mut stream_r).await? {
            let plain = lock(&channel)?.open(&m)?;
            local_w.write_all(&plain).await?;
            got += plain.len() as u64;
        }
        local_w.shutdown().await?;
        anyhow::Ok(got)
    };
    let (sent, got) = tokio::try_join!(out, back)?;
    Ok((sent, got))
}

/// Fresh randomness for a handshake's ephemeral key.
fn fresh() -> anyhow::Result<[u8; 32]> {
    let mut r = [0u8; 32];
    getrandom::getrandom(&mut r).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
    Ok(r)
}

/// One group attempt this node holds a rank of.
struct Member {
    rendezvous: Rendezvous,
    epoch: u64,
    rank: u32,
    /// The lease's executor request id.
    request_id: String,
    key: AssignmentKey,
    /// The network namespace of the rank's sandbox, once it runs: where its endpoint
    /// listens (a rank above 0) or its service is reached (rank 0).
    sandbox: Option<Arc<std::fs::File>>,
    /// The endpoints' listeners; each holds the connections it carries, so aborting it
    /// ends them.
    listeners: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Member {
    fn drop(&mut self) {
        for l in &self.listeners {
            l.abort();
        }
    }
}

/// Runs `f` on a thread of its own inside the network namespace `ns` (a socket made there
/// stays there): the node's own threads never change namespace.
fn in_namespace<T: Send>(
    ns: &std::fs::File,
    f: impl FnOnce() -> std::io::Result<T> + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .context("entering the sandbox's network namespace")?;
            Ok(f()?)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("a thread in the sandbox's network namespace panicked"))?
    })
}

/// The loopback address of a sandbox at `port`.
fn loopback(port: u16) -> std::net::SocketAddr {
    (std::net::Ipv4Addr::LOCALHOST, port).into()
}

/// The group attempts this node holds ranks of, and their channels.
pub struct Groups {
    keys: Keypair,
    control: libp2p_stream::Control,
    members: Mutex<HashMap<(Uuid, u64), Member>>,
    opening: Arc<tokio::sync::Semaphore>,
    /// Streams in their opening, by peer.
    opening_by_peer: Mutex<HashMap<PeerId, usize>>,
}

/// A stream's place among those in their opening: given back when dropped.
struct OpeningSlot<'a> {
    groups: &'a Groups,
    peer: PeerId,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for OpeningSlot<'_> {
    fn drop(&mut self) {
        let mut by_peer = self
            .groups
            .opening_by_peer
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                by_peer.remove(&self.peer);
            }
        }
    }
}

impl Groups {
    /// The groups of a node with `keys`, their streams on `control`.
    pub fn new(keys: Keypair, control: libp2p_stream::Control) -> Arc<Self> {
        Arc::new(Self {
            keys,
            control,
            members: Mutex::new(HashMap::new()),
            opening: Arc::new(tokio::sync::Semaphore::new(MAX_OPENING)),
            opening_by_peer: Mutex::new(HashMap::new()),
        })
    }

    /// A place for a stream of `peer` in its opening, unless that peer or every peer
    /// together holds as many as they may.
    fn opening_slot(&self, peer: PeerId) -> Option<OpeningSlot<'_>> {
        let mut by_peer = self
            .opening_by_peer
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if by_peer
            .get(&peer)
            .is_some_and(|&n| n >= MAX_OPENING_PER_PEER)
        {
            return None;
        }
        // Counted only once granted: a refused peer leaves nothing behind.
        let permit = self.opening.clone().try_acquire_owned().ok()?;
        *by_peer.entry(peer).or_default() += 1;
        Some(OpeningSlot {
            groups: self,
            peer,
            _permit: permit,
        })
    }

    fn members(&self) -> std::sync::MutexGuard<'_, HashMap<(Uuid, u64), Member>> {
        self.members.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the streams other ranks open to this node, until the node stops.
    pub fn serve(self: &Arc<Self>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let mut incoming = self
            .control
            .clone()
            .accept(GROUP_PROTOCOL)
            .map_err(|e| anyhow::anyhow!("group streams: {e}"))?;
        let groups = Arc::downgrade(self);
        Ok(tokio::spawn(async move {
            while let Some((peer, stream)) = incoming.next().await {
                let Some(g) = groups.upgrade() else { return };
                tokio::spawn(async move {
                    let Some(slot) = g.opening_slot(peer) else {
                        debug!(%peer, "group stream refused: too many being opened");
                        return;
                    };
                    if let Err(e) = g.answer(peer, stream.compat(), slot).await {
                        warn!(%peer, error = %format!("{e:#}"), "group stream refused");
                    }
                });
            }
        }))
    }

    /// The environment a rank's workload gets, as torchrun would set it for one process
    /// per node: its rank, the group's size, and rank 0's rendezvous at the sandbox's own
    /// loopback (which the channel forwards).
    pub fn environment(rank: u32, rendezvous: &Rendezvous) -> Vec<(String, String)> {
        let world = rendezvous.roster.len();
        [
            ("RANK", rank.to_string()),
            ("GROUP_RANK", rank.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("LOCAL_RANK", "0".to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("ROLE_WORLD_SIZE", world.to_string()),
            ("LOCAL_WORLD_SIZE", "1".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", RENDEZVOUS_PORT.to_string()),
            ("TORCHELASTIC_RUN_ID", rendezvous.id.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// This node holds rank `key.2`'s lease at `epoch` of the group attempt `rendezvous`:
    /// the rank's channel is known, its endpoints open once its sandbox runs
    /// ([`Groups::attach`]). Joining again changes nothing.
    pub fn join(
        &self,
        request_id: &str,
        key: AssignmentKey,
        epoch: u64,
        rendezvous: &Rendezvous,
    ) -> anyhow::Result<()> {
        let me = self.keys.address();
        let rank = rendezvous
            .roster
            .iter()
            .find(|e| e.worker == me)
            .map(|e| e.rank)
            .context("this node is not in the group's roster")?;
        let mut members = self.members();
        if members.contains_key(&(rendezvous.id, epoch)) {
            return Ok(());
        }
        info!(rendezvous = %rendezvous.id, epoch, rank, ranks = rendezvous.roster.len(), "group channel open");
        members.insert(
            (rendezvous.id, epoch),
            Member {
                rendezvous: rendezvous.clone(),
                epoch,
                rank,
                request_id: request_id.to_owned(),
                key,
                sandbox: None,
                listeners: Vec::new(),
            },
        );
        Ok(())
    }

    /// The sandbox of executor request `request_id` runs as process `pid` (inside its
    /// network namespace): a rank above 0 gets its endpoint there, `127.0.0.1` at rank 0's
    /// rendezvous port, and rank 0's service becomes reachable. Nothing for a request of
    /// no group, or one attached already.
    pub fn attach(self: &Arc<Self>, request_id: &str, pid: u32) -> anyhow::Result<()> {
        let Some((id, rank, rendezvous)) = self
            .members()
            .iter()
            .find(|(_, m)| m.request_id == request_id && m.sandbox.is_none())
            .map(|(id, m)| (*id, m.rank, m.rendezvous.id))
        else {
            return Ok(());
        };
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
            .with_context(|| format!("the network namespace of sandbox process {pid}"))?;
        let mut listeners = Vec::new();
        if rank != 0 {
            let listener = in_namespace(&ns, || {
                let l = std::net::TcpListener::bind(loopback(RENDEZVOUS_PORT))?;
                l.set_nonblocking(true)?;
                Ok(l)
            })?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let opening = Opening {
                rendezvous,
                epoch: id.1,
                from: rank,
                to: 0,
                port: RENDEZVOUS_PORT,
            };
            listeners.push(tokio::spawn(self.clone().carry(listener, opening)));
        }
        let mut members = self.members();
        let Some(m) = members.get_mut(&id) else {
            // Left meanwhile: the listeners go.
            listeners.iter().for_each(tokio::task::JoinHandle::abort);
            return Ok(());
        };
        m.sandbox = Some(Arc::new(ns));
        m.listeners.extend(listeners);
        info!(%rendezvous, epoch = id.1, rank, "group channel reaches the sandbox");
        Ok(())
    }

    /// The lease of executor request `request_id` ended: its group's endpoints close and
    /// every connection through them ends.
    pub fn leave(&self, request_id: &str) {
        for g in self.remove_where(|m| m.request_id == request_id) {
            info!(rendezvous = %g.rendezvous.id, epoch = g.epoch, rank = g.rank, "group channel closed");
        }
    }

    /// Takes out the members `pred` picks (dropping one closes its endpoints).
    fn remove_where(&self, pred: impl Fn(&Member) -> bool) -> Vec<Member> {
        let mut m = self.members();
        let ids: Vec<_> = m.iter().filter(|(_, v)| pred(v)).map(|(k, _)| *k).collect();
        ids.into_iter().filter_map(|k| m.remove(&k)).collect()
    }

    /// The node stops: every group's endpoints close.
    pub fn close(&self) {
        let gone: Vec<Member> = self.members().drain().map(|(_, m)| m).collect();
        drop(gone);
    }

    /// Keeps only the group attempts whose lease `live` says still holds.
    pub fn retain(&self, live: impl Fn(&AssignmentKey, u64) -> bool) {
        for g in self.remove_where(|m| !live(&m.key, m.epoch)) {
            info!(rendezvous = %g.rendezvous.id, epoch = g.epoch, rank = g.rank, "group channel closed: its lease ended");
        }
    }

    /// Carries each connection to `listener` to the rank the opening names.
    async fn carry(self: Arc<Self>, listener: tokio::net::TcpListener, opening: Opening) {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((local, _)) => {
                        let g = self.clone();
                        connections.spawn(async move {
                            match g.open(opening, local).await {
                                Ok((up, down)) => debug!(to = opening.to, port = opening.port, up, down, "group connection ended"),
                                Err(e) => warn!(to = opening.to, port = opening.port, error = %format!("{e:#}"), "group connection failed"),
                            }
                        });
                    }
                    Err(e) => {
                        warn!(error = %e, "group endpoint failed");
                        return;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    }

    /// Opens a stream to the rank `opening` names, runs the handshake as its initiator
    /// and forwards `local` through the channel.
    async fn open<L: AsyncRead + AsyncWrite + Unpin>(
        &self,
        opening: Opening,
        local: L,
    ) -> anyhow::Result<(u64, u64)> {
        let rendezvous = self
            .members()
            .get(&(opening.rendezvous, opening.epoch))
            .map(|m| m.rendezvous.clone())
            .context("the group attempt ended")?;
        let target = rendezvous
            .roster
            .iter()
            .find(|e| e.rank == opening.to)
            .context("no such rank")?
            .worker;
        let peer = crate::swarm::peer_of(&target).context("a rank's address is no key")?;
        let hs = Handshake::new(
            &self.keys,
            &target,
            &rendezvous,
            opening.epoch,
            true,
            fresh()?,
        )?;
        let mut stream = self
            .control
            .clone()
            .open_stream(peer, GROUP_PROTOCOL)
            .await
            .with_context(|| format!("opening a stream to rank {}", opening.to))?
            .compat();
        let channel = tokio::time::timeout(OPENING_TIMEOUT, async {
            write_frame(&mut stream, &opening.encode()).await?;
            establish(&mut stream, hs).await
        })
        .await
        .context("the handshake timed out")??;
        forward(channel, stream, local).await
    }

    /// A stream another node opened: its opening, the handshake as responder with the
    /// roster's member for the opener's rank (who must be the peer that opened it), then
    /// the connection to the service on the opening's port in this rank's sandbox.
    async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        peer: PeerId,
        mut stream: S,
        slot: OpeningSlot<'_>,
    ) -> anyhow::Result<()> {
        let (channel, opening) = tokio::time::timeout(OPENING_TIMEOUT, async {
            let first = read_frame(&mut stream)
                .await?
                .context("the stream closed before its opening")?;
            let opening = Opening::decode(&first)?;
            let (rendezvous, rank) = self
                .members()
                .get(&(opening.rendezvous, opening.epoch))
                .map(|m| (m.rendezvous.clone(), m.rank))
                .with_context(|| {
                    format!(
                        "no group attempt {} at epoch {} here",
                        opening.rendezvous, opening.epoch
                    )
                })?;
            anyhow::ensure!(opening.to == rank, "rank {} is not here", opening.to);
            let opener = rendezvous
                .roster
                .iter()
                .find(|e| e.rank == opening.from)
                .context("no such rank")?
                .worker;
            anyhow::ensure!(
                crate::swarm::peer_of(&opener) == Some(peer),
                "rank {} is not this peer",
                opening.from
            );
            let hs = Handshake::new(
                &self.keys,
                &opener,
                &rendezvous,
                opening.epoch,
                false,
                fresh()?,
            )?;
            let channel = establish(&mut stream, hs).await?;
            anyhow::Ok((channel, opening))
        })
        .await
        .context("the opening and handshake timed out")??;
        drop(slot);
        let sandbox = self
            .members()
            .get(&(opening.rendezvous, opening.epoch))
            .and_then(|m| m.sandbox.clone())
            .context("this rank's sandbox is not running")?;
        let port = opening.port;
        let local = tokio::task::spawn_blocking(move || {
            in_namespace(&sandbox, || {
                let s = std::net::TcpStream::connect(loopback(port))?;
                s.set_nonblocking(true)?;
                Ok(s)
            })
        })
        .await?
        .with_context(|| format!("no service on port {port} in the sandbox"))?;
        let local = tokio::net::TcpStream::from_std(local)?;
        let (up, down) = forward(channel, stream, local).await?;
        debug!(
            from = opening.from,
            port, up, down, "group connection served"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cannabis_protocol::{Keypair, Rendezvous, RosterEntry, Uuid};
    use tokio::net::{TcpListener, TcpStream};

    fn group(members: &[&Keypair]) -> Rendezvous {
        Rendezvous {
            id: Uuid::from_random([4; 16]),
            roster: members
                .iter()
                .enumerate()
                .map(|(i, k)| RosterEntry {
                    rank: i as u32,
                    worker: k.address(),
                })
                .collect(),
        }
    }

    /// Rank 0's side of one stream: the handshake with the rank that opened it, then the
    /// connection to `service`.
    async fn rank0(
        keys: Keypair,
        peer: cannabis_protocol::Address,
        g: Rendezvous,
        mut stream: tokio::io::DuplexStream,
        service: std::net::SocketAddr,
    ) -> anyhow::Result<(u64, u64)> {
        let hs = Handshake::new(&keys, &peer, &g, 1, false, [7; 32])?;
        let channel = establish(&mut stream, hs).await?;
        let local = TcpStream::connect(service).await?;
        forward(channel, stream, local).await
    }

    #[tokio::test]
    async fn a_ranks_connection_reaches_the_service_of_rank_0_through_the_channel() {
        let (r0, r1) = (Keypair::from_secret([1; 32]), Keypair::from_secret([2; 32]));
        let g = group(&[&r0, &r1]);
        // The service in rank 0's sandbox (PyTorch's store, here an echo that upper-cases).
        let service = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let service_addr = service.local_addr().unwrap();
        let served = tokio::spawn(async move {
            let (mut s, _) = service.accept().await.unwrap();
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.unwrap();
            s.write_all(&buf.to_ascii_uppercase()).await.unwrap();
            s.shutdown().await.unwrap();
            buf.len()
        });
        // The swarm stream between the two nodes.
        let (a, b) = tokio::io::duplex(1 << 16);
        let zero = tokio::spawn(rank0(r0.clone(), r1.address(), g.clone(), b, service_addr));
        // Rank 1's workload connects to its local endpoint: one side of a socket pair.
        let (workload, endpoint) = tokio::io::duplex(1 << 16);
        let one = tokio::spawn(async move {
            let mut a = a;
            let hs = Handshake::new(&r1, &r0.address(), &g, 1, true, [8; 32])?;
            let channel = establish(&mut a, hs).await?;
            forward(channel, a, endpoint).await
        });
        let (mut wr, mut ww) = tokio::io::split(workload);
        // More than one message's worth, to cross several frames.
        let sent = b"store.set(key, value) ".repeat(10_000);
        ww.write_all(&sent).await.unwrap();
        ww.shutdown().await.unwrap();
        let mut back = Vec::new();
        wr.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, sent.to_ascii_uppercase());
        assert_eq!(served.await.unwrap(), sent.len());
        let (up, down) = one.await.unwrap().unwrap();
        assert_eq!((up, down), (sent.len() as u64, sent.len() as u64));
        zero.await.unwrap().unwrap();
    }

    #[test]
    fn one_peer_holds_at_most_its_share_of_the_streams_in_their_opening() {
        let groups = Groups::new(
            Keypair::from_secret([1; 32]),
            libp2p_stream::Behaviour::new().new_control(),
        );
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut held: Vec<_> = (0..MAX_OPENING_PER_PEER)
            .map(|_| groups.opening_slot(a).expect("within the peer's share"))
            .collect();
        assert!(groups.opening_slot(a).is_none(), "past the peer's share");
        assert!(
            groups.opening_slot(b).is_some(),
            "another peer still gets one"
        );
        held.pop();
        assert!(
            groups.opening_slot(a).is_some(),
            "a slot given back is free again"
        );
        drop(held);
        // And all peers together hold at most MAX_OPENING.
        let many: Vec<_> = (0..MAX_OPENING)
            .map(|_| {
                groups
                    .opening_slot(PeerId::random())
                    .expect("within the total")
            })
            .collect();
        assert!(
            groups.opening_slot(PeerId::random()).is_none(),
            "past the total"
        );
        drop(many);
        assert!(groups.opening_by_peer.lock().unwrap().is_empty());
    }

    #[test]
    fn an_opening_reads_back_as_written_and_only_at_its_length() {
        let o = Opening {
            rendezvous: Uuid::from_random([9; 16]),
            epoch: 3,
            from: 2,
            to: 0,
            port: RENDEZVOUS_PORT,
        };
        let b = o.encode();
        assert_eq!(b.len(), Opening::LEN);
        assert_eq!(&b[16..24], &3u64.to_le_bytes());
        assert_eq!(&b[32..], &29_500u16.to_le_bytes());
        assert_eq!(Opening::decode(&b).unwrap(), o);
        assert!(Opening::decode(&b[..33]).is_err());
        let mut long = b.to_vec();
        long.push(0);
        assert!(Opening::decode(&long).is_err());
    }

    #[tokio::test]
    async fn a_peer_outside_the_group_reaches_nothing() {
        let (r0, r1, stranger) = (
            Keypair::from_secret([1; 32]),
            Keypair::from_secret([2; 32]),
            Keypair::from_secret([3; 32]),
        );
        let g = group(&[&r0, &r1]);
        let service = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let service_addr = service.local_addr().unwrap();
        let (a, b) = tokio::io::duplex(1 << 16);
        // Rank 0 expects rank 1 on this stream (its swarm connection says who dialled).
        let zero = tokio::spawn(rank0(r0.clone(), r1.address(), g.clone(), b, service_addr));
        // The stranger, with a roster of its own naming it as rank 1.
        let mut forged = g.clone();
        forged.roster[1].worker = stranger.address();
        let mut a = a;
        let hs = Handshake::new(&stranger, &r0.address(), &forged, 1, true, [9; 32]).unwrap();
        let _ = establish(&mut a, hs).await;
        drop(a);
        let e = zero.await.unwrap().unwrap_err();
        assert!(format!("{e:#}").contains("handshake"), "{e:#}");
        // Nothing connected to the service.
        let accepted =
            tokio::time::timeout(std::time::Duration::from_millis(200), service.accept()).await;
        assert!(accepted.is_err(), "the service saw a connection");
    }
}
