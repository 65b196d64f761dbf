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
//! message, at most 65,535).

use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use cannabis_protocol::channel::{Channel, Handshake, MAX_PLAINTEXT};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

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
