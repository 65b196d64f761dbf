//! A slow, lossy link, for testnets (`cannabis testnet slow`): every TCP connection's
//! inbound bytes are held before the node reads them.
//!
//! The kernel's traffic shaping (`tc netem`) would be the usual tool, but it needs a kernel
//! module that many machines (containers, CI runners) lack, and root. This works wherever
//! the node runs, holds for every connection of the node (dialled or accepted, existing or
//! new), and costs nothing when off. What it models:
//! - **delay**: each chunk of bytes read from the socket becomes readable `delay` after it
//!   arrived, so every round trip through the node grows by `delay` (as netem's delay on
//!   one side of a link does);
//! - **loss**: over TCP a lost segment is a late one: the sender retransmits it after its
//!   retransmission timeout, and everything behind it waits. So a chunk is "lost" with
//!   probability `loss` and held a further [`RETRANSMIT`] (or twice the delay, if longer),
//!   with every later chunk kept behind it: latency spikes and head-of-line stalls, never
//!   missing bytes (which TCP never shows its reader either).
//!
//! Chunks are what one read of the socket returns (up to [`CHUNK`] bytes), not packets;
//! at most [`MAX_HELD`] bytes are held per connection, after which the socket is not read
//! (backpressure reaches the sender through TCP's window).

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};

/// What a lost chunk costs beyond the delay: Linux's least retransmission timeout.
pub const RETRANSMIT: Duration = Duration::from_millis(200);
/// The most one read of the socket takes.
pub const CHUNK: usize = 16 * 1024;
/// The most bytes held per connection.
pub const MAX_HELD: usize = 4 << 20;

/// The node's link settings, shared by every connection (changed at any time).
#[derive(Clone, Debug, Default)]
pub struct Shaping(Arc<Settings>);

#[derive(Debug, Default)]
struct Settings {
    delay_ms: AtomicU64,
    /// Loss in parts per million.
    loss_ppm: AtomicU32,
}

impl Shaping {
    /// Sets the delay and the loss (parts per million, at most 1,000,000); zero for both
    /// is a plain link.
    pub fn set(&self, delay: Duration, loss_ppm: u32) {
        self.0
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
        self.0
            .loss_ppm
            .store(loss_ppm.min(1_000_000), Ordering::Relaxed);
    }

    /// The delay and the loss in parts per million.
    pub fn get(&self) -> (Duration, u32) {
        (
            Duration::from_millis(self.0.delay_ms.load(Ordering::Relaxed)),
            self.0.loss_ppm.load(Ordering::Relaxed),
        )
    }

    /// `stream`, shaped by these settings.
    pub fn wrap<S>(&self, stream: S) -> Shaped<S> {
        let mut seed = [0u8; 8];
        // A poor seed only makes the losses predictable: nothing depends on them.
        let _ = getrandom::getrandom(&mut seed);
        Shaped {
            inner: stream,
            shaping: self.clone(),
            held: VecDeque::new(),
            held_bytes: 0,
            sleep: None,
            eof: false,
            rng: u64::from_le_bytes(seed) | 1,
        }
    }
}

/// A stream whose inbound bytes are held as its [`Shaping`] says.
pub struct Shaped<S> {
    inner: S,
    shaping: Shaping,
    /// Chunks read from the socket: when each becomes readable, its bytes, how many of
    /// them were read already.
    held: VecDeque<(Instant, Vec<u8>, usize)>,
    held_bytes: usize,
    sleep: Option<Pin<Box<Sleep>>>,
    eof: bool,
    rng: u64,
}

impl<S> Shaped<S> {
    /// Whether a chunk is lost (xorshift64: a fast, good-enough draw).
    fn lost(&mut self, loss_ppm: u32) -> bool {
        if loss_ppm == 0 {
            return false;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % 1_000_000 < u64::from(loss_ppm)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Shaped<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let (delay, loss_ppm) = this.shaping.get();
        if delay.is_zero() && loss_ppm == 0 && this.held.is_empty() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        // Take in what has arrived, each chunk stamped with when it may be read.
        while !this.eof && this.held_bytes < MAX_HELD {
            let mut chunk = vec![0u8; CHUNK];
            match Pin::new(&mut this.inner).poll_read(cx, &mut chunk) {
                Poll::Ready(Ok(0)) => this.eof = true,
                Poll::Ready(Ok(n)) => {
                    chunk.truncate(n);
                    let mut at = Instant::now() + delay;
                    if this.lost(loss_ppm) {
                        at += RETRANSMIT.max(2 * delay);
                    }
                    // In order: nothing overtakes a chunk held for its retransmission.
                    if let Some((last, ..)) = this.held.back() {
                        at = at.max(*last);
                    }
                    this.held_bytes += n;
                    this.held.push_back((at, chunk, 0));
                }
                // An error ends the stream at once: nothing to hold it for.
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
        loop {
            let Some((at, chunk, read)) = this.held.front_mut() else {
                return if this.eof {
                    Poll::Ready(Ok(0))
                } else {
                    Poll::Pending
                };
            };
            if *at <= Instant::now() {
                let n = (chunk.len() - *read).min(buf.len());
                buf[..n].copy_from_slice(&chunk[*read..*read + n]);
                *read += n;
                if *read == chunk.len() {
                    this.held_bytes -= chunk.len();
                    this.held.pop_front();
                }
                this.sleep = None;
                return Poll::Ready(Ok(n));
            }
            let at = *at;
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
            if sleep.deadline() != at {
                sleep.as_mut().reset(at);
            }
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Shaped<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A connected pair of in-memory streams: what one writes, the other reads.
    fn pair() -> (
        tokio_util::compat::Compat<tokio::io::DuplexStream>,
        tokio_util::compat::Compat<tokio::io::DuplexStream>,
    ) {
        use tokio_util::compat::TokioAsyncReadCompatExt as _;
        let (a, b) = tokio::io::duplex(1 << 20);
        (a.compat(), b.compat())
    }

    // Real time: each check is a lower bound (held at least so long), which a busy
    // machine cannot break.

    #[tokio::test]
    async fn bytes_are_held_for_the_delay_and_come_in_order() {
        let shaping = Shaping::default();
        shaping.set(Duration::from_millis(300), 0);
        let (mut tx, rx) = pair();
        let mut rx = shaping.wrap(rx);
        let start = Instant::now();
        tx.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        rx.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        assert!(start.elapsed() >= Duration::from_millis(300));
        // Off: what is sent next passes straight through (nothing is held).
        shaping.set(Duration::ZERO, 0);
        tx.write_all(b"again").await.unwrap();
        rx.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"again");
        assert!(rx.held.is_empty());
    }

    #[tokio::test]
    async fn a_lost_chunk_arrives_a_retransmission_later_and_nothing_overtakes_it() {
        let shaping = Shaping::default();
        shaping.set(Duration::from_millis(10), 1_000_000);
        let (mut tx, rx) = pair();
        let mut rx = shaping.wrap(rx);
        let start = Instant::now();
        tx.write_all(b"one").await.unwrap();
        let mut got = [0u8; 3];
        let mut read = rx.read(&mut got);
        // Taken in (and lost) on the first poll; then the link is clean.
        assert!(futures::poll!(&mut read).is_pending());
        shaping.set(Duration::from_millis(10), 0);
        assert_eq!(read.await.unwrap(), 3);
        assert_eq!(&got, b"one");
        assert!(start.elapsed() >= Duration::from_millis(10) + RETRANSMIT);
        tx.write_all(b"two").await.unwrap();
        rx.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"two");
    }

    #[tokio::test]
    async fn the_end_of_the_stream_comes_after_the_held_bytes() {
        let shaping = Shaping::default();
        shaping.set(Duration::from_millis(50), 0);
        let (mut tx, rx) = pair();
        let mut rx = shaping.wrap(rx);
        tx.write_all(b"last words").await.unwrap();
        tx.close().await.unwrap();
        drop(tx);
        let mut all = Vec::new();
        rx.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"last words");
    }
}
