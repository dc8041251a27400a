//! [`StallLimited`]: a request body that fails once no data has come for the stall timeout.
//!
//! A request holds its place among `--max-concurrent-requests` (and its token's quota) from its
//! headers on, while its body is read (the places are taken before the body, so that what
//! requests hold in memory stays bounded). Neither hyper nor tonic bounds how long a body may
//! take: a client that declared a body and sent nothing more (a stalled upload, a host that lost
//! power, or on purpose) held its place for good, and as many of them filled every place of
//! both APIs. Wrapped in a [`StallLimited`], the body fails after `--stall-timeout-secs`
//! without a frame; the request is answered with the error and its place is given back. Only
//! one-message bodies are limited: a stream's requests (`QueryStream`, `PublishEvents`) may
//! rightly stay quiet between messages.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};

/// A boxed error, as the bodies of hyper, axum and tonic take them.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body that fails with `stalled(timeout)` once `timeout` has passed, with no frame ready,
/// since it was first found waiting or since its last frame after that.
///
/// The timer is made only when the body is first found waiting: a one-message request usually
/// arrives with its headers, and is read without one (a timer per query cost a registration in
/// tokio's timer wheel on the hot path).
pub(crate) struct StallLimited<B> {
    inner: B,
    timeout: Duration,
    /// When the body is taken for stalled (`None` until it first waits); moved on at every
    /// frame.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    stalled: fn(Duration) -> BoxError,
    /// The error was reported: the body ends.
    failed: bool,
}

impl<B> StallLimited<B> {
    /// `inner`, failing with `stalled(timeout)` after `timeout` without a frame. Read inside a
    /// tokio runtime (its timer).
    pub(crate) fn new(inner: B, timeout: Duration, stalled: fn(Duration) -> BoxError) -> Self {
        Self {
            inner,
            timeout,
            deadline: None,
            stalled,
            failed: false,
        }
    }
}

/// The error of a stalled body, in words a person understands.
pub(crate) fn stalled_message(timeout: Duration) -> String {
    format!(
        "the request body stalled: no data for {} s (--stall-timeout-secs); send the body \
         without pausing",
        timeout.as_secs_f64()
    )
}

impl<B> Body for StallLimited<B>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        // `StallLimited` is `Unpin`: `B` is, and the timer is boxed.
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some(deadline) = &mut this.deadline {
                    deadline
                        .as_mut()
                        .reset(tokio::time::Instant::now() + this.timeout);
                }
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending => {
                let timeout = this.timeout;
                let deadline = this
                    .deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if deadline.as_mut().poll(cx).is_ready() {
                    this.failed = true;
                    return Poll::Ready(Some(Err((this.stalled)(this.timeout))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;

    fn stalled(timeout: Duration) -> BoxError {
        stalled_message(timeout).into()
    }

    /// A body that sends a frame then nothing fails once the timeout passed without a frame;
    /// a body that keeps sending within the timeout is read whole.
    #[tokio::test]
    async fn a_body_fails_after_the_timeout_without_a_frame() {
        let (sender, frames) =
            tokio::sync::mpsc::channel::<Result<Frame<bytes::Bytes>, BoxError>>(4);
        let body =
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(frames));
        let mut limited = StallLimited::new(body, Duration::from_secs(1), stalled);
        let writer = tokio::spawn(async move {
            // Each frame within the timeout of the one before, three times the timeout in all.
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let frame = Frame::data(bytes::Bytes::from_static(b"x"));
                sender.send(Ok(frame)).await.expect("sent");
            }
            // Then silence, the sender kept open.
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(sender);
        });
        for _ in 0..6 {
            let frame = limited.frame().await.expect("a frame").expect("data");
            assert_eq!(frame.into_data().expect("data"), &b"x"[..]);
        }
        let error = limited
            .frame()
            .await
            .expect("an error")
            .expect_err("stalled");
        assert!(error.to_string().contains("no data for 1 s"), "{error}");
        assert!(limited.frame().await.is_none(), "ends after the error");
        writer.abort();
    }
}
