//! [`OpeningDeadline`]: a connection whose opening bytes must arrive within a deadline.
//!
//! Neither hyper nor tonic sets a timer before a connection's first bytes: hyper reads the
//! HTTP/2 preface (and, on the HTTP port, the bytes that tell HTTP/1.1 from HTTP/2) for as long
//! as the client likes, and its timers — HTTP/1.1's header timeout, HTTP/2's keep-alive pings —
//! start only after them. A client that connected and sent nothing, or part of the preface,
//! held a task and a descriptor for good, however many connections it opened, before any token
//! was checked. Wrapped in an [`OpeningDeadline`], such a connection's next read fails with
//! `TimedOut` once the deadline has passed, and the server closes it.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// The HTTP/2 connection preface a client sends first (RFC 9113 §3.4): 24 bytes.
pub(crate) const HTTP2_PREFACE_BYTES: usize = 24;

/// A connection's IO whose reads fail with `TimedOut` unless its first `opening` bytes have
/// arrived within the deadline it was made with; after them it is `inner` unchanged.
///
/// Invariant: `deadline` is `Some` exactly while `opening` bytes are still awaited (`opening`
/// > 0); the timer is polled only while a read is pending, so it wakes the reader that waits.
pub(crate) struct OpeningDeadline<IO> {
    inner: IO,
    /// How many of the opening bytes are still to come.
    opening: usize,
    /// When the opening bytes are due; `None` once they have come.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<IO> OpeningDeadline<IO> {
    /// `inner`, whose first `opening` bytes are due within `within` from now.
    pub(crate) fn new(inner: IO, opening: usize, within: Duration) -> Self {
        Self {
            inner,
            opening,
            deadline: (opening > 0).then(|| Box::pin(tokio::time::sleep(within))),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for OpeningDeadline<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        let Some(deadline) = self.deadline.as_mut() else {
            return read;
        };
        if read.is_pending() {
            return match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the connection's opening bytes did not arrive in time",
                ))),
                Poll::Pending => Poll::Pending,
            };
        }
        let came = buf.filled().len() - before;
        self.opening = self.opening.saturating_sub(came);
        if self.opening == 0 {
            self.deadline = None;
        }
        read
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for OpeningDeadline<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected
    for OpeningDeadline<IO>
{
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    const WITHIN: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn a_connection_silent_past_the_deadline_fails_to_read() {
        let (client, server) = tokio::io::duplex(64);
        let mut server = OpeningDeadline::new(server, HTTP2_PREFACE_BYTES, WITHIN);
        let started = tokio::time::Instant::now();
        let mut buf = [0; 64];
        let error = server.read(&mut buf).await.expect_err("timed out");
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= WITHIN);
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn part_of_the_opening_does_not_stop_the_deadline() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut server = OpeningDeadline::new(server, HTTP2_PREFACE_BYTES, WITHIN);
        client.write_all(b"PRI * HTTP/2.0").await.expect("sent");
        let mut buf = [0; 64];
        assert_eq!(server.read(&mut buf).await.expect("part"), 14);
        let error = server.read(&mut buf).await.expect_err("timed out");
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_opening_a_connection_may_stay_quiet() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut server = OpeningDeadline::new(server, 3, WITHIN);
        client.write_all(b"abc").await.expect("sent");
        let mut buf = [0; 3];
        server.read_exact(&mut buf).await.expect("opening");
        let quiet = tokio::time::timeout(WITHIN * 4, server.read(&mut buf)).await;
        assert!(quiet.is_err(), "still waiting, not failed: {quiet:?}");
        client.write_all(b"d").await.expect("sent");
        assert_eq!(server.read(&mut buf).await.expect("later"), 1);
    }
}
