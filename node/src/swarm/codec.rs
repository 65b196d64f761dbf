//! The request-response codec of the directed protocols: a 4-byte big-endian length, then
//! the canonical CBOR of a protocol frame. The length is checked against the frame type's
//! size cap before a byte of the body is read, and the body must decode canonically.

use std::io;
use std::marker::PhantomData;

use cannabis_protocol::Wire;
use futures::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use libp2p::StreamProtocol;
use libp2p::request_response;

/// A codec for requests `Req` and responses `Resp`.
pub struct Codec<Req, Resp> {
    kinds: PhantomData<fn() -> (Req, Resp)>,
}

impl<Req, Resp> Default for Codec<Req, Resp> {
    fn default() -> Self {
        Self { kinds: PhantomData }
    }
}

impl<Req, Resp> Clone for Codec<Req, Resp> {
    fn clone(&self) -> Self {
        Self::default()
    }
}

/// Reads one length-prefixed frame of type `T`.
pub(crate) async fn read_frame<T: Wire, R: AsyncRead + Unpin>(io: &mut R) -> io::Result<T> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > T::MAX_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} of {len} bytes is over the {}-byte limit",
                T::KIND,
                T::MAX_SIZE
            ),
        ));
    }
    // Grown as bytes arrive, not allocated to the declared length: a peer that declares
    // 4 MiB and sends nothing costs nothing.
    let mut body = Vec::with_capacity(len.min(64 * 1024));
    io.take(len as u64).read_to_end(&mut body).await?;
    if body.len() != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    cannabis_protocol::decode(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Writes one length-prefixed frame (the canonical encoding of a value).
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    io: &mut W,
    body: Vec<u8>,
) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    io.write_all(&len.to_be_bytes()).await?;
    io.write_all(&body).await?;
    io.close().await
}

impl<Req, Resp> request_response::Codec for Codec<Req, Resp>
where
    Req: Wire + Send + 'static,
    Resp: Wire + Send + 'static,
{
    type Protocol = StreamProtocol;
    type Request = Req;
    type Response = Resp;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Req>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io).await
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Resp>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io).await
    }

    async fn write_request<T>(&mut self, _: &StreamProtocol, io: &mut T, req: Req) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, cannabis_protocol::encode(&req)).await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        resp: Resp,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, cannabis_protocol::encode(&resp)).await
    }
}
