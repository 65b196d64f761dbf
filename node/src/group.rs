//! The group channel's I/O: the Noise handshake of [`cannabis_protocol::channel`] over a
//! byte stream between two ranks' nodes (a swarm stream, relayed where needed), and the
//! group's private network carried through it.
//!
//! Each rank's sandbox gets one network interface besides its own loopback,
//! [`groupnet::INTERFACE`], with its rank's address in the group's network
//! (`10.29.0.0/16`, rank `r` at `10.29.0.0 + r + 1`). The device's other end is a
//! descriptor its node holds: a packet the workload sends to another rank's address is
//! read there and sealed into the channel to that rank's node, which writes it into that
//! rank's sandbox. So every port of every rank reaches every other rank (PyTorch's store at
//! rank 0, gloo's and NCCL's mesh of connections between all ranks), and nothing else: a
//! packet to any other address goes nowhere, a packet that arrives is passed on only if it
//! comes from the rank at the channel's other end and is for this rank.
//!
//! One channel (one swarm stream, one handshake) joins each pair of ranks: the higher rank
//! opens it, the lower answers once its own sandbox is connected. The executor makes and
//! checks each rank's sandbox and holds it before its command starts. The gang start goes
//! through rank 0: every other rank opens its channel to rank 0 once prepared; when rank 0
//! holds one from every rank (each proved, through a handshake only that rank could
//! complete, that it is prepared) it releases its own rank and sends each the go, on which
//! each is released and opens its channels to the lower ranks above 0. No rank runs before
//! all can, and the start costs one channel per rank, not one per pair. A rank that gets
//! no go within [`GANG_START`] is stopped instead (and rank 0 without all its channels);
//! the requester re-places or refunds the task as for any failed run.
//!
//! Frames on the stream: a 2-byte big-endian length, then that many bytes (one Noise
//! message, at most 65,535). The first frame, in the clear, is the [`Opening`]: which group
//! attempt, which ranks. Each later message holds one IPv4 packet.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use cannabis_market::lease::AssignmentKey;
use cannabis_protocol::channel::{Channel, Handshake};
use cannabis_protocol::{Keypair, Rendezvous, Uuid};
use cannabis_runtime::groupnet::{self, ipv4_ends, rank_address, rank_of};
use futures::StreamExt as _;
use libp2p::{PeerId, StreamProtocol};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::mpsc;
use tokio_util::compat::FuturesAsyncReadCompatExt as _;
use tracing::{debug, info, warn};

/// Protocol id of a group channel's streams on the swarm.
pub const GROUP_PROTOCOL: StreamProtocol = StreamProtocol::new("/cannabis/group/2");

/// The port of rank 0's rendezvous service (PyTorch's `MASTER_PORT` default).
pub const RENDEZVOUS_PORT: u16 = 29_500;

/// The MTU of a rank's group interface: a packet is one channel message, so at most
/// [`cannabis_protocol::channel::MAX_PLAINTEXT`]; large, as on a loopback, so that bulk transfers cost few messages.
pub const MTU: u32 = 65_000;

/// How long a rank's node waits for the go (rank 0: for every rank's channel) before it stops
/// its held rank instead of starting it.
pub const GANG_START: Duration = Duration::from_secs(120);

/// How long the opener of a stream has for its opening and the handshake.
const OPENING_TIMEOUT: Duration = Duration::from_secs(10);

/// How soon a rank tries again to open its channel to a lower rank not yet prepared; the
/// pause doubles each time, up to [`LINK_RETRY_MAX`].
const LINK_RETRY: Duration = Duration::from_millis(200);
const LINK_RETRY_MAX: Duration = Duration::from_secs(2);

/// Packets waiting to be sealed into one channel; past that the router waits (the
/// sandbox's own sends then queue in its interface, and TCP there slows down).
const LINK_QUEUE: usize = 64;

/// Sealed packets written to a channel's stream at once: those waiting when the first is
/// sealed, up to this many bytes, in one write and one flush.
const LINK_BATCH: usize = 256 << 10;

/// Streams being opened or handshaken at once, from all peers together, each for at most
/// [`OPENING_TIMEOUT`].
const MAX_OPENING: usize = 64;

/// Of those, from one peer: a peer opening streams it never completes cannot hold the
/// slots every other rank's connections need.
const MAX_OPENING_PER_PEER: usize = 4;

/// What a rank's node does with its held sandbox once the gang start is decided: release
/// it (`Ok`) or stop it (`Err` with why). Given the executor request id.
pub type Starter = Arc<dyn Fn(String, Result<(), String>) + Send + Sync>;

/// The first frame of a channel stream, in the clear: which channel its opener wants.
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
}

impl Opening {
    /// Its length on the wire.
    pub const LEN: usize = 32;

    /// `id (16) || u64_le(epoch) || u32_le(from) || u32_le(to)`.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..16].copy_from_slice(&self.rendezvous.0);
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b[24..28].copy_from_slice(&self.from.to_le_bytes());
        b[28..32].copy_from_slice(&self.to.to_le_bytes());
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
        })
    }
}

/// Writes one frame.
async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, message: &[u8]) -> anyhow::Result<()> {
    let len = u16::try_from(message.len()).context("a channel message over 65,535 bytes")?;
    let mut frame = Vec::with_capacity(2 + message.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(message);
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

/// Seals `packet` into `channel` as one frame appended to `out` (its two-byte length,
/// then the message).
fn seal_frame(channel: &mut Channel, packet: &[u8], out: &mut Vec<u8>) -> anyhow::Result<()> {
    let at = out.len();
    out.extend_from_slice(&[0, 0]);
    let n = channel.seal_into(packet, out)?;
    let len = u16::try_from(n).context("a channel message over 65,535 bytes")?;
    out[at..at + 2].copy_from_slice(&len.to_be_bytes());
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

/// A rank's end of the group's network: its sandbox's interface (read: what the workload
/// sends; write: what it receives) and the channels to the other ranks.
pub struct Net {
    rank: u32,
    address: Ipv4Addr,
    device: AsyncFd<OwnedFd>,
    /// The packets waiting for each linked rank's channel.
    links: Mutex<HashMap<u32, mpsc::Sender<Vec<u8>>>>,
    /// Rank 0 said every rank is ready (a rank above 0 only).
    go: std::sync::atomic::AtomicBool,
    /// A channel came or went, or the go came.
    changed: tokio::sync::Notify,
}

impl Net {
    /// Rank `rank`'s end, with the interface's descriptor `device` (non-blocking; one
    /// packet per read and write).
    #[allow(unsafe_code)]
    pub fn new(rank: u32, device: OwnedFd) -> anyhow::Result<Arc<Self>> {
        // SAFETY: the `OwnedFd` is the descriptor's only owner and moves into the
        // `AsyncFd`, which deregisters it before it is closed: it stays the same open
        // file for as long as it is registered.
        let device = unsafe { AsyncFd::register(device) }
            .map_err(|e| anyhow::anyhow!("watching the group interface: {e}"))?;
        Ok(Arc::new(Self {
            rank,
            address: rank_address(rank).context("a rank beyond the group's network")?,
            device,
            links: Mutex::new(HashMap::new()),
            go: std::sync::atomic::AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
        }))
    }

    /// Whether rank 0 said every rank is ready.
    fn has_go(&self) -> bool {
        self.go.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Rank 0 tells every linked rank that every rank is ready: an empty message on each
    /// channel (a packet is never empty).
    fn send_go(&self) {
        for link in self.links().values() {
            let _ = link.try_send(Vec::new());
        }
    }

    /// Waits until `ready` holds (looked at whenever a channel comes or goes, or the go
    /// comes) or `deadline` passes: whether it held.
    async fn wait_until(
        &self,
        deadline: tokio::time::Instant,
        ready: impl Fn(&Self) -> bool,
    ) -> bool {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if ready(self) {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return ready(self);
            }
        }
    }

    fn links(&self) -> std::sync::MutexGuard<'_, HashMap<u32, mpsc::Sender<Vec<u8>>>> {
        self.links.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ranks with a channel up.
    pub fn linked(&self) -> Vec<u32> {
        let mut r: Vec<u32> = self.links().keys().copied().collect();
        r.sort_unstable();
        r
    }

    /// Writes one packet into the sandbox. A packet the interface cannot take now is
    /// dropped, as a full link drops it (the sender's TCP sends it again).
    fn deliver(&self, packet: &[u8]) {
        if let Err(e) = nix::unistd::write(self.device.get_ref(), packet) {
            debug!(error = %e, "a packet for the sandbox was dropped");
        }
    }

    /// Reads one packet the sandbox sent.
    async fn next_packet(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let mut ready = self.device.readable().await?;
            match ready
                .try_io(|fd| nix::unistd::read(fd.get_ref(), buf).map_err(std::io::Error::from))
            {
                Ok(r) => return r,
                Err(_would_block) => continue,
            }
        }
    }

    /// Passes each packet the sandbox sends to the channel of the rank it is addressed
    /// to; a packet for an address of no linked rank goes nowhere. Ends when the
    /// interface does.
    pub async fn route(self: Arc<Self>) {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match self.next_packet(&mut buf).await {
                Ok(0) => return,
                Ok(n) => n,
                Err(e) => {
                    warn!(rank = self.rank, error = %e, "the group interface failed");
                    return;
                }
            };
            let Some(to) = ipv4_ends(&buf[..n]).and_then(|(_, dst)| rank_of(dst)) else {
                continue;
            };
            let link = self.links().get(&to).cloned();
            if let Some(link) = link {
                // Waits while the channel is full; an ended channel refuses at once.
                let _ = link.send(buf[..n].to_vec()).await;
            }
        }
    }

    /// Carries packets between this rank's sandbox and rank `peer`'s through `channel`
    /// over `stream`, until either side ends it. Only packets from `peer`'s address to
    /// this rank's reach the sandbox.
    pub async fn link<S>(
        self: &Arc<Self>,
        peer: u32,
        channel: Channel,
        stream: S,
    ) -> anyhow::Result<()>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let from = rank_address(peer).context("a rank beyond the group's network")?;
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(LINK_QUEUE);
        {
            let mut links = self.links();
            anyhow::ensure!(
                !links.contains_key(&peer),
                "rank {peer} has a channel here already"
            );
            links.insert(peer, tx);
        }
        self.changed.notify_waiters();
        /// Takes the link out of the table when the link ends, however it ends.
        struct Unlink<'a>(&'a Net, u32);
        impl Drop for Unlink<'_> {
            fn drop(&mut self) {
                self.0.links().remove(&self.1);
                self.0.changed.notify_waiters();
            }
        }
        let _unlink = Unlink(self, peer);
        // One Noise state, two directions: sealing and opening use separate cipher
        // states, so each holds the lock only for one message.
        let channel = Mutex::new(channel);
        let lock = || {
            channel
                .lock()
                .map_err(|_| anyhow::anyhow!("the channel's state was poisoned"))
        };
        let (mut stream_r, mut stream_w) = tokio::io::split(stream);
        let out = async {
            let mut sent = 0u64;
            let mut frames = Vec::with_capacity(LINK_BATCH + 2 * MTU as usize);
            while let Some(packet) = rx.recv().await {
                frames.clear();
                seal_frame(&mut *lock()?, &packet, &mut frames)?;
                sent += 1;
                // Whatever else waits goes in the same write: one flush, not one a packet.
                while frames.len() < LINK_BATCH {
                    let Ok(packet) = rx.try_recv() else { break };
                    seal_frame(&mut *lock()?, &packet, &mut frames)?;
                    sent += 1;
                }
                stream_w.write_all(&frames).await?;
                stream_w.flush().await?;
            }
            anyhow::Ok(sent)
        };
        let back = async {
            let (mut got, mut refused) = (0u64, 0u64);
            while let Some(m) = read_frame(&mut stream_r).await? {
                let packet = lock()?.open(&m)?;
                if packet.is_empty() {
                    // Rank 0's go.
                    if peer == 0 {
                        self.go.store(true, std::sync::atomic::Ordering::SeqCst);
                        self.changed.notify_waiters();
                    }
                    continue;
                }
                match ipv4_ends(&packet) {
                    Some((src, dst)) if src == from && dst == self.address => {
                        self.deliver(&packet);
                        got += 1;
                    }
                    _ => refused += 1,
                }
            }
            if refused > 0 {
                debug!(peer, refused, "packets not from the channel's rank refused");
            }
            anyhow::Ok(got)
        };
        // Either direction's end is the link's: the other rank is gone.
        tokio::select! {
            r = out => debug!(peer, sent = r?, "group channel ended"),
            r = back => debug!(peer, got = r?, "group channel ended"),
        }
        Ok(())
    }
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
    /// The rank's end of the group's network, once its sandbox is made.
    net: Option<Arc<Net>>,
    /// The router, the channels this rank opens and the gang start's wait; aborting them
    /// ends every channel.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Member {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The group attempts this node holds ranks of, and their channels.
pub struct Groups {
    keys: Keypair,
    control: libp2p_stream::Control,
    starter: Starter,
    /// How long a rank waits for the others ([`GANG_START`]).
    gang_start: Duration,
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
    /// The groups of a node with `keys`, their streams on `control`; `starter` releases
    /// or stops a rank's held sandbox.
    pub fn new(keys: Keypair, control: libp2p_stream::Control, starter: Starter) -> Arc<Self> {
        Arc::new(Self {
            keys,
            control,
            starter,
            gang_start: GANG_START,
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
    /// per node: its rank, the group's size, rank 0's address in the group's network as
    /// the rendezvous, and the group's interface for the collectives' own connections.
    pub fn environment(rank: u32, rendezvous: &Rendezvous) -> Vec<(String, String)> {
        let world = rendezvous.roster.len();
        let master = rank_address(0).map_or_else(String::new, |a| a.to_string());
        [
            ("RANK", rank.to_string()),
            ("GROUP_RANK", rank.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("LOCAL_RANK", "0".to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("ROLE_WORLD_SIZE", world.to_string()),
            ("LOCAL_WORLD_SIZE", "1".to_string()),
            ("MASTER_ADDR", master),
            ("MASTER_PORT", RENDEZVOUS_PORT.to_string()),
            ("TORCHELASTIC_RUN_ID", rendezvous.id.to_string()),
            ("GLOO_SOCKET_IFNAME", groupnet::INTERFACE.to_string()),
            ("NCCL_SOCKET_IFNAME", groupnet::INTERFACE.to_string()),
            ("TP_SOCKET_IFNAME", groupnet::INTERFACE.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The other members of every group this node holds a rank of: the connections to
    /// them carry (or will carry) the groups' channels, and are kept while it lasts.
    pub fn peers(&self) -> std::collections::HashSet<PeerId> {
        let me = self.keys.address();
        self.members()
            .values()
            .flat_map(|m| m.rendezvous.roster.iter())
            .filter(|e| e.worker != me)
            .filter_map(|e| crate::swarm::peer_of(&e.worker))
            .collect()
    }

    /// This node holds rank `key.2`'s lease at `epoch` of the group attempt `rendezvous`:
    /// the rank's channels are known, its network is made once its sandbox is
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
        anyhow::ensure!(
            rendezvous.roster.len() as u64 <= u64::from(groupnet::MAX_RANKS),
            "a group of {} ranks: the group's network holds {}",
            rendezvous.roster.len(),
            groupnet::MAX_RANKS
        );
        let mut members = self.members();
        if members.contains_key(&(rendezvous.id, epoch)) {
            return Ok(());
        }
        info!(rendezvous = %rendezvous.id, epoch, rank, ranks = rendezvous.roster.len(), "group joined");
        members.insert(
            (rendezvous.id, epoch),
            Member {
                rendezvous: rendezvous.clone(),
                epoch,
                rank,
                request_id: request_id.to_owned(),
                key,
                net: None,
                tasks: Vec::new(),
            },
        );
        Ok(())
    }

    /// The sandbox of executor request `request_id` is made, held before its start, and
    /// `device` is its group interface (made by the executor in the sandbox's network
    /// namespace), or why there is none: the rank's router starts on the device, it opens
    /// its channels to the lower ranks (the higher ones open theirs to it), and once all
    /// are up the sandbox is released. Nothing for a request of no group, or one attached
    /// already (the device is closed, and the interface goes with it).
    pub fn attach(
        self: &Arc<Self>,
        request_id: &str,
        device: Result<OwnedFd, String>,
    ) -> anyhow::Result<()> {
        let Some((id, rank, ranks)) = self
            .members()
            .iter()
            .find(|(_, m)| m.request_id == request_id && m.net.is_none())
            .map(|(id, m)| (*id, m.rank, m.rendezvous.roster.len() as u32))
        else {
            return Ok(());
        };
        let made = device
            .map_err(|e| anyhow::anyhow!(e))
            .context("making the group interface in the sandbox")
            .and_then(|device| Net::new(rank, device));
        let net = match made {
            Ok(net) => net,
            Err(e) => {
                (self.starter)(request_id.to_owned(), Err(format!("{e:#}")));
                return Err(e);
            }
        };
        let mut tasks = vec![tokio::spawn(net.clone().route())];
        if rank > 0 {
            tasks.push(tokio::spawn(self.clone().dial(id, rank, 0, net.clone())));
        }
        tasks.push(tokio::spawn(self.clone().gang_start(
            request_id.to_owned(),
            id,
            net.clone(),
            ranks,
        )));
        let mut members = self.members();
        let Some(m) = members.get_mut(&id) else {
            // Left meanwhile: the tasks go.
            tasks.iter().for_each(tokio::task::JoinHandle::abort);
            return Ok(());
        };
        m.net = Some(net);
        m.tasks.extend(tasks);
        info!(rendezvous = %id.0, epoch = id.1, rank, "group interface made in the sandbox");
        Ok(())
    }

    /// The gang start of a held rank. Every rank above 0 opens its channel to rank 0
    /// once prepared; rank 0, once it holds a channel from every other rank, is released
    /// and sends each of them the go, on which each is released; then each rank opens its
    /// channels to the lower ranks above 0 (the rest of the mesh). A rank is stopped instead
    /// if the go (for rank 0: every channel) does not come within the gang start's wait.
    async fn gang_start(
        self: Arc<Self>,
        request_id: String,
        id: (Uuid, u64),
        net: Arc<Net>,
        ranks: u32,
    ) {
        let deadline = tokio::time::Instant::now() + self.gang_start;
        let others = ranks.saturating_sub(1) as usize;
        let ready = if net.rank == 0 {
            net.wait_until(deadline, |n| n.links().len() >= others)
                .await
        } else {
            net.wait_until(deadline, Net::has_go).await
        };
        if !ready {
            let why = if net.rank == 0 {
                let linked = net.linked();
                let missing: Vec<String> = (1..ranks)
                    .filter(|r| !linked.contains(r))
                    .map(|r| r.to_string())
                    .collect();
                format!(
                    "gang start: rank {} not ready within {:?}",
                    missing.join(", "),
                    self.gang_start
                )
            } else {
                format!(
                    "gang start: no word from rank 0 that every rank is ready within {:?}",
                    self.gang_start
                )
            };
            warn!(%request_id, rank = net.rank, %why, "the group does not start");
            (self.starter)(request_id, Err(why));
            return;
        }
        info!(%request_id, rank = net.rank, ranks, "every rank is ready: the group starts");
        if net.rank == 0 {
            net.send_go();
        }
        (self.starter)(request_id, Ok(()));
        // The rest of the mesh: every rank is prepared now, so each opens at once.
        let mut dials = tokio::task::JoinSet::new();
        for lower in 1..net.rank {
            dials.spawn(self.clone().dial(id, net.rank, lower, net.clone()));
        }
        while dials.join_next().await.is_some() {}
    }

    /// Opens this rank's channel to the lower rank `to`, trying again (at growing
    /// intervals) while that rank is not prepared, until the gang start's wait is over;
    /// then carries it until it ends.
    async fn dial(self: Arc<Self>, id: (Uuid, u64), from: u32, to: u32, net: Arc<Net>) {
        let opening = Opening {
            rendezvous: id.0,
            epoch: id.1,
            from,
            to,
        };
        let deadline = tokio::time::Instant::now() + self.gang_start;
        let mut pause = LINK_RETRY;
        loop {
            match self.open(opening).await {
                Ok((channel, stream)) => {
                    if let Err(e) = net.link(to, channel, stream).await {
                        debug!(to, error = %format!("{e:#}"), "group channel ended");
                    }
                    return;
                }
                Err(e) if tokio::time::Instant::now() + pause < deadline => {
                    debug!(to, error = %format!("{e:#}"), "group channel not open yet");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(LINK_RETRY_MAX);
                }
                Err(e) => {
                    warn!(to, error = %format!("{e:#}"), "group channel not opened");
                    return;
                }
            }
        }
    }

    /// The lease of executor request `request_id` ended: its group's channels close.
    pub fn leave(&self, request_id: &str) {
        for g in self.remove_where(|m| m.request_id == request_id) {
            info!(rendezvous = %g.rendezvous.id, epoch = g.epoch, rank = g.rank, "group left");
        }
    }

    /// Takes out the members `pred` picks (dropping one ends its channels).
    fn remove_where(&self, pred: impl Fn(&Member) -> bool) -> Vec<Member> {
        let mut m = self.members();
        let ids: Vec<_> = m.iter().filter(|(_, v)| pred(v)).map(|(k, _)| *k).collect();
        ids.into_iter().filter_map(|k| m.remove(&k)).collect()
    }

    /// The node stops: every group's channels close.
    pub fn close(&self) {
        let gone: Vec<Member> = self.members().drain().map(|(_, m)| m).collect();
        drop(gone);
    }

    /// Keeps only the group attempts whose lease `live` says still holds.
    pub fn retain(&self, live: impl Fn(&AssignmentKey, u64) -> bool) {
        for g in self.remove_where(|m| !live(&m.key, m.epoch)) {
            info!(rendezvous = %g.rendezvous.id, epoch = g.epoch, rank = g.rank, "group left: its lease ended");
        }
    }

    /// Opens a stream to the rank `opening` names and runs the handshake as its
    /// initiator.
    async fn open(
        &self,
        opening: Opening,
    ) -> anyhow::Result<(Channel, impl AsyncRead + AsyncWrite + Unpin + use<>)> {
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
        Ok((channel, stream))
    }

    /// A stream another node opened: its opening, the handshake as responder with the
    /// roster's member for the opener's rank (who must be the peer that opened it, and a
    /// higher rank), once this rank's sandbox is connected; then the channel carries the
    /// two ranks' packets until it ends or this rank leaves the group.
    async fn answer<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
        &self,
        peer: PeerId,
        mut stream: S,
        slot: OpeningSlot<'_>,
    ) -> anyhow::Result<()> {
        let (channel, opening, net) = tokio::time::timeout(OPENING_TIMEOUT, async {
            let first = read_frame(&mut stream)
                .await?
                .context("the stream closed before its opening")?;
            let opening = Opening::decode(&first)?;
            let (rendezvous, rank, net) = self
                .members()
                .get(&(opening.rendezvous, opening.epoch))
                .map(|m| (m.rendezvous.clone(), m.rank, m.net.clone()))
                .with_context(|| {
                    format!(
                        "no group attempt {} at epoch {} here",
                        opening.rendezvous, opening.epoch
                    )
                })?;
            anyhow::ensure!(opening.to == rank, "rank {} is not here", opening.to);
            anyhow::ensure!(
                opening.from > rank,
                "rank {} opens no channel to rank {rank}: the higher rank opens",
                opening.from
            );
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
            let net = net.with_context(|| format!("rank {rank} is not prepared yet"))?;
            let hs = Handshake::new(
                &self.keys,
                &opener,
                &rendezvous,
                opening.epoch,
                false,
                fresh()?,
            )?;
            let channel = establish(&mut stream, hs).await?;
            anyhow::Ok((channel, opening, net))
        })
        .await
        .context("the opening and handshake timed out")??;
        drop(slot);
        // The channel is the member's: its leaving ends it.
        let id = (opening.rendezvous, opening.epoch);
        let from = opening.from;
        let carried = net.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = carried.link(from, channel, stream).await {
                debug!(from, error = %format!("{e:#}"), "group channel ended");
            }
        });
        match self.members().get_mut(&id) {
            Some(m) if m.net.as_ref().is_some_and(|n| Arc::ptr_eq(n, &net)) => m.tasks.push(task),
            _ => task.abort(),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cannabis_protocol::{Keypair, Rendezvous, RosterEntry, Uuid};
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

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

    /// A stand-in for a rank's interface that keeps packets whole as the TUN device does:
    /// the node's end, and the sandbox's.
    fn device() -> (OwnedFd, std::os::unix::net::UnixDatagram) {
        let (node, sandbox) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        // A datagram socket's calls read and write a sequenced-packet one's whole packets.
        let sandbox = std::os::unix::net::UnixDatagram::from(sandbox);
        sandbox.set_nonblocking(false).unwrap();
        sandbox
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        (node, sandbox)
    }

    /// An IPv4 packet from rank `from` to rank `to` carrying `body`.
    fn packet(from: u32, to: u32, body: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 20];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&((20 + body.len()) as u16).to_be_bytes());
        p[12..16].copy_from_slice(&rank_address(from).unwrap().octets());
        p[16..20].copy_from_slice(&rank_address(to).unwrap().octets());
        p.extend_from_slice(body);
        p
    }

    async fn received(sandbox: &std::os::unix::net::UnixDatagram) -> Option<Vec<u8>> {
        let s = sandbox.try_clone().unwrap();
        tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; 1 << 16];
            s.recv(&mut buf).ok().map(|n| buf[..n].to_vec())
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn packets_between_two_ranks_cross_the_channel_and_nothing_else_does() {
        let (r0, r1) = (Keypair::from_secret([1; 32]), Keypair::from_secret([2; 32]));
        let g = group(&[&r0, &r1]);
        let ((d0, sandbox0), (d1, sandbox1)) = (device(), device());
        let (net0, net1) = (Net::new(0, d0).unwrap(), Net::new(1, d1).unwrap());
        tokio::spawn(net0.clone().route());
        tokio::spawn(net1.clone().route());
        // The swarm stream between the two nodes; rank 1 opens, rank 0 answers.
        let (mut a, mut b) = tokio::io::duplex(1 << 18);
        let (hs1, hs0) = (
            Handshake::new(&r1, &r0.address(), &g, 1, true, [8; 32]).unwrap(),
            Handshake::new(&r0, &r1.address(), &g, 1, false, [7; 32]).unwrap(),
        );
        let (c1, c0) = tokio::join!(establish(&mut a, hs1), establish(&mut b, hs0));
        let (n0, n1) = (net0.clone(), net1.clone());
        tokio::spawn(async move { n0.link(1, c0.unwrap(), b).await });
        tokio::spawn(async move { n1.link(0, c1.unwrap(), a).await });
        for _ in 0..100 {
            if net0.linked() == [1] && net1.linked() == [0] {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!((net0.linked(), net1.linked()), (vec![1], vec![0]));

        // Rank 1's workload sends to rank 0 (a large packet too), and rank 0 answers.
        for body in [&b"store.set"[..], &[9u8; 60_000][..]] {
            let p = packet(1, 0, body);
            sandbox1.send(&p).unwrap();
            assert_eq!(received(&sandbox0).await.as_deref(), Some(&p[..]));
        }
        let p = packet(0, 1, b"ok");
        sandbox0.send(&p).unwrap();
        assert_eq!(received(&sandbox1).await.as_deref(), Some(&p[..]));

        // To an address of no linked rank, or not of the group: nowhere.
        sandbox1.send(&packet(1, 5, b"x")).unwrap();
        let mut outside = packet(1, 0, b"x");
        outside[16..20].copy_from_slice(&[192, 168, 1, 1]);
        sandbox1.send(&outside).unwrap();
        sandbox1.send(b"not a packet").unwrap();
        // Claiming another rank's address: refused by rank 0's node.
        sandbox1.send(&packet(2, 0, b"spoofed")).unwrap();
        assert_eq!(received(&sandbox0).await, None, "a packet got through");
        // And the channel still carries the next honest one.
        let p = packet(1, 0, b"after");
        sandbox1.send(&p).unwrap();
        assert_eq!(received(&sandbox0).await.as_deref(), Some(&p[..]));
    }

    #[tokio::test]
    async fn a_second_channel_from_a_linked_rank_is_refused() {
        let (r0, r1) = (Keypair::from_secret([1; 32]), Keypair::from_secret([2; 32]));
        let g = group(&[&r0, &r1]);
        let (d0, _sandbox0) = device();
        let net0 = Net::new(0, d0).unwrap();
        let mut channels = Vec::new();
        for seed in [3u8, 5] {
            let (mut a, mut b) = tokio::io::duplex(1 << 16);
            let hs1 = Handshake::new(&r1, &r0.address(), &g, 1, true, [seed; 32]).unwrap();
            let hs0 = Handshake::new(&r0, &r1.address(), &g, 1, false, [seed + 1; 32]).unwrap();
            let (c1, c0) = tokio::join!(establish(&mut a, hs1), establish(&mut b, hs0));
            c1.unwrap();
            channels.push((c0.unwrap(), b, a));
        }
        let (c, b, _a) = channels.remove(0);
        let n0 = net0.clone();
        let first = tokio::spawn(async move { n0.link(1, c, b).await });
        for _ in 0..100 {
            if net0.linked() == [1] {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (c, b, _a2) = channels.remove(0);
        let e = net0.link(1, c, b).await.unwrap_err();
        assert!(format!("{e}").contains("already"), "{e}");
        assert_eq!(net0.linked(), [1], "the first channel stays");
        first.abort();
        let _ = first.await;
        assert!(
            net0.linked().is_empty(),
            "an ended channel leaves the table"
        );
    }

    #[tokio::test]
    async fn ranks_start_on_rank_0s_go_once_all_are_linked_and_are_stopped_when_one_never_comes() {
        type Decisions = Mutex<Vec<(String, Result<(), String>)>>;
        let decided: Arc<Decisions> = Arc::default();
        let seen = decided.clone();
        let mut groups = Groups::new(
            Keypair::from_secret([1; 32]),
            libp2p_stream::Behaviour::new().new_control(),
            Arc::new(move |id, outcome| seen.lock().unwrap().push((id, outcome))),
        );
        Arc::get_mut(&mut groups).unwrap().gang_start = Duration::from_millis(300);
        let (r0, r1) = (Keypair::from_secret([1; 32]), Keypair::from_secret([2; 32]));
        let g = group(&[&r0, &r1]);
        let id = (g.id, 1);
        let ((d0, _sandbox0), (d1, _sandbox1)) = (device(), device());
        let (net0, net1) = (Net::new(0, d0).unwrap(), Net::new(1, d1).unwrap());

        // Ranks 1 and 2 never come: rank 0 is stopped, with who was missing; rank 1 never
        // hears from rank 0 and is stopped too.
        groups
            .clone()
            .gang_start("lease/0".into(), id, net0.clone(), 3)
            .await;
        groups
            .clone()
            .gang_start("lease/1".into(), id, net1.clone(), 3)
            .await;
        let mut d = std::mem::take(&mut *decided.lock().unwrap());
        assert_eq!(
            d.remove(0),
            (
                "lease/0".to_string(),
                Err("gang start: rank 1, 2 not ready within 300ms".to_string())
            )
        );
        let (who, outcome) = d.remove(0);
        assert_eq!(who, "lease/1");
        assert!(outcome.unwrap_err().contains("no word from rank 0"));

        // A group of two with its channel up: rank 0 is released and sends the go, on
        // which rank 1 is released.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let hs1 = Handshake::new(&r1, &r0.address(), &g, 1, true, [8; 32]).unwrap();
        let hs0 = Handshake::new(&r0, &r1.address(), &g, 1, false, [7; 32]).unwrap();
        let (c1, c0) = tokio::join!(establish(&mut a, hs1), establish(&mut b, hs0));
        let (n0, n1) = (net0.clone(), net1.clone());
        let links = [
            tokio::spawn(async move { n0.link(1, c0.unwrap(), b).await }),
            tokio::spawn(async move { n1.link(0, c1.unwrap(), a).await }),
        ];
        let one = tokio::spawn(
            groups
                .clone()
                .gang_start("lease/b1".into(), id, net1.clone(), 2),
        );
        groups
            .clone()
            .gang_start("lease/b0".into(), id, net0, 2)
            .await;
        one.await.unwrap();
        let mut d = std::mem::take(&mut *decided.lock().unwrap());
        d.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(
            d,
            [
                ("lease/b0".to_string(), Ok(())),
                ("lease/b1".to_string(), Ok(()))
            ]
        );
        assert!(net1.has_go());
        links.iter().for_each(tokio::task::JoinHandle::abort);
    }

    #[test]
    fn the_peers_kept_are_the_other_members_of_the_groups_joined() {
        let (r0, r1, r2) = (
            Keypair::from_secret([1; 32]),
            Keypair::from_secret([2; 32]),
            Keypair::from_secret([3; 32]),
        );
        let groups = Groups::new(
            r1.clone(),
            libp2p_stream::Behaviour::new().new_control(),
            Arc::new(|_, _| {}),
        );
        assert!(groups.peers().is_empty());
        let g = group(&[&r0, &r1, &r2]);
        groups
            .join("lease/1", (Uuid::from_random([9; 16]), 0, 1), 1, &g)
            .unwrap();
        let peer = |k: &Keypair| crate::swarm::peer_of(&k.address()).unwrap();
        assert_eq!(
            groups.peers(),
            [peer(&r0), peer(&r2)].into_iter().collect(),
            "the other ranks, not this node"
        );
        groups.leave("lease/1");
        assert!(groups.peers().is_empty(), "a group left keeps no peer");
    }

    #[test]
    fn one_peer_holds_at_most_its_share_of_the_streams_in_their_opening() {
        let groups = Groups::new(
            Keypair::from_secret([1; 32]),
            libp2p_stream::Behaviour::new().new_control(),
            Arc::new(|_, _| {}),
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
        };
        let b = o.encode();
        assert_eq!(b.len(), Opening::LEN);
        assert_eq!(&b[16..24], &3u64.to_le_bytes());
        assert_eq!(&b[24..28], &2u32.to_le_bytes());
        assert_eq!(Opening::decode(&b).unwrap(), o);
        assert!(Opening::decode(&b[..31]).is_err());
        let mut long = b.to_vec();
        long.push(0);
        assert!(Opening::decode(&long).is_err());
    }

    #[tokio::test]
    async fn a_peer_outside_the_group_completes_no_handshake() {
        let (r0, r1, stranger) = (
            Keypair::from_secret([1; 32]),
            Keypair::from_secret([2; 32]),
            Keypair::from_secret([3; 32]),
        );
        let g = group(&[&r0, &r1]);
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        // Rank 0 expects rank 1 on this stream (its swarm connection says who dialled).
        let hs0 = Handshake::new(&r0, &r1.address(), &g, 1, false, [7; 32]).unwrap();
        let zero = tokio::spawn(async move { establish(&mut b, hs0).await });
        // The stranger, with a roster of its own naming it as rank 1.
        let mut forged = g.clone();
        forged.roster[1].worker = stranger.address();
        let hs = Handshake::new(&stranger, &r0.address(), &forged, 1, true, [9; 32]).unwrap();
        let _ = establish(&mut a, hs).await;
        drop(a);
        let e = zero.await.unwrap().unwrap_err();
        assert!(format!("{e:#}").contains("handshake"), "{e:#}");
    }
}
