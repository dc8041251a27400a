//! [`StallLimited`]: a request body that fails once no data has come for the stall timeout.
//!
//! A request holds its place among `--max-concurrent-requests` (and its token's quota) from its
//! headers on, while its body is read (the places are taken before the body, so that what
//! requests hold in memory stays bounded). Neither hyper nor tonic bounds how long a body may
//! take: a client that declared a body and sent nothing more (a stalled upload, a host that lost
//! power, or on purpose) held its place for good, and as many of them filled every place of
//! both APIs. Wrapped in a [`StallLimited`], the body fails after `--stall-timeout-secs`
//! without a frame, or once it has come slower than [`BODY_RATE_FLOOR`] beyond a grace of the
//! stall timeout (a byte sent just within every timeout held the place for as long as the
//! sender liked); the request is answered with the error and its place is given back. Only
//! one-message bodies are limited: a stream's requests (`QueryStream`, `PublishEvents`) may
//! rightly stay quiet between messages.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Buf as _;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// The slowest a one-message body may come on average, beyond a grace of the stall timeout
/// from when it was first found waiting: 64 KiB/s (a body of the 8 MiB HTTP limit within the
/// grace and 128 s; a query of a few KiB within the grace).
pub(crate) const BODY_RATE_FLOOR: u64 = 64 << 10;

/// A boxed error, as the bodies of hyper, axum and tonic take them.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body that fails with `stalled(timeout)` once `timeout` has passed, with no frame ready,
/// since it was first found waiting or since its last frame after that; or once what it sent
/// since it was first found waiting averages under [`BODY_RATE_FLOOR`] beyond a grace of
/// `timeout` (its deadline is the earlier of the two).
///
/// The timer is made only when the body is first found waiting: a one-message request usually
/// arrives with its headers, and is read without one (a timer per query cost a registration in
/// tokio's timer wheel on the hot path).
pub(crate) struct StallLimited<B> {
    inner: B,
    timeout: Duration,
    /// Once the body was first found waiting (`None` until then): when that was, and when the
    /// body is taken for stalled (moved on at every frame).
    waiting: Option<(Instant, Pin<Box<tokio::time::Sleep>>)>,
    /// The data bytes read since it was first found waiting.
    received: u64,
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
            waiting: None,
            received: 0,
            stalled,
            failed: false,
        }
    }

    /// The deadline as of `now`, with the body first found waiting at `since`: the stall
    /// timeout from now, or the time by which what was received meets the rate floor beyond
    /// the grace, whichever comes first.
    fn deadline_at(timeout: Duration, received: u64, now: Instant, since: Instant) -> Instant {
        let floor =
            since + timeout + Duration::from_secs_f64(received as f64 / BODY_RATE_FLOOR as f64);
        (now + timeout).min(floor)
    }
}

/// The error of a stalled body, in words a person understands.
pub(crate) fn stalled_message(timeout: Duration) -> String {
    format!(
        "the request body stalled: no data for {} s (--stall-timeout-secs), or slower than \
         {} KiB/s beyond that long; send the body without pausing",
        timeout.as_secs_f64(),
        BODY_RATE_FLOOR >> 10
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
                if let Some((since, deadline)) = &mut this.waiting {
                    if let Some(Ok(frame)) = &frame
                        && let Some(data) = frame.data_ref()
                    {
                        let bytes = u64::try_from(data.remaining()).unwrap_or(u64::MAX);
                        this.received = this.received.saturating_add(bytes);
                    }
                    let next =
                        Self::deadline_at(this.timeout, this.received, Instant::now(), *since);
                    deadline.as_mut().reset(next);
                }
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending => {
                let (timeout, received) = (this.timeout, this.received);
                let (_, deadline) = this.waiting.get_or_insert_with(|| {
                    let now = Instant::now();
                    let first = Self::deadline_at(timeout, received, now, now);
                    (now, Box::pin(tokio::time::sleep_until(first)))
                });
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

    /// A body whose writer sends `frames` frames of `size` bytes, one every 200 ms, then stays
    /// silent for a minute (the sender kept open), read through a `StallLimited` of 1 s.
    fn paced_body(
        frames: usize,
        size: usize,
    ) -> (
        StallLimited<impl Body<Data = bytes::Bytes, Error = BoxError> + Unpin>,
        tokio::task::JoinHandle<()>,
    ) {
        let (sender, received) =
            tokio::sync::mpsc::channel::<Result<Frame<bytes::Bytes>, BoxError>>(4);
        let body =
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(received));
        let writer = tokio::spawn(async move {
            for _ in 0..frames {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let frame = Frame::data(bytes::Bytes::from(vec![b'x'; size]));
                if sender.send(Ok(frame)).await.is_err() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(sender);
        });
        (
            StallLimited::new(body, Duration::from_secs(1), stalled),
            writer,
        )
    }

    /// A body that keeps sending within the timeout, above the rate floor, is read whole, over
    /// three times the timeout; then, silent, it fails once the timeout passed without a frame.
    #[tokio::test(start_paused = true)]
    async fn a_body_fails_after_the_timeout_without_a_frame() {
        // 32 KiB every 200 ms: 160 KiB/s.
        let (mut limited, writer) = paced_body(15, 32 << 10);
        for _ in 0..15 {
            let frame = limited.frame().await.expect("a frame").expect("data");
            assert_eq!(frame.into_data().expect("data").len(), 32 << 10);
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

    /// A body that sends a byte within every timeout, far under the rate floor, fails once the
    /// grace has passed (it held its place for as long as its sender liked).
    #[tokio::test(start_paused = true)]
    async fn a_body_that_trickles_under_the_floor_fails_after_the_grace() {
        let started = Instant::now();
        // A byte every 200 ms for 6 s, then the body would end.
        let (mut limited, writer) = paced_body(30, 1);
        let mut read = 0;
        let error = loop {
            match limited.frame().await {
                Some(Ok(_)) => read += 1,
                Some(Err(error)) => break error,
                None => panic!("read whole ({read} frames): the trickle was not cut"),
            }
        };
        assert!(
            error.to_string().contains("slower than 64 KiB/s"),
            "{error}"
        );
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(1) && took < Duration::from_millis(1500),
            "cut after {took:?} and {read} frames, not at the grace's end"
        );
        writer.abort();
    }
}
