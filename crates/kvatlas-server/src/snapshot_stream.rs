//! Streaming a whole-state read's answer as chunks of bytes: the native snapshot (`snapshot`)
//! of a server's indexes for `GET /snapshot` and the gRPC `Snapshot` RPC, and Dynamo's `/dump`.
//! A blocking task writes the answer into a bounded channel of 1 MiB chunks; for a snapshot it
//! takes one index's image at a time, so at most one index's cut and a few chunks are in
//! memory, whatever the size of the whole.
//!
//! The task holds the answer's places (`Held`: its place among the whole-state reads, its
//! request's place among the concurrent requests and its token's) until it ends: it ends when
//! the answer is written, when the reader goes away, when the reader takes no chunk for the
//! stall timeout (`Limits::stall_timeout`), or when the time the answer has waited for its
//! reader exceeds twice the stall timeout plus the time the bytes taken earn at
//! [`MIN_READ_RATE`] (the time spent producing the answer is not counted). A reader that
//! stalls, or that trickles (a chunk every 29 s held a place for hours), therefore cannot hold
//! a place for ever; what it later reads ends with an error, never as a clean but cut answer.

use std::io::{self, Write};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::Stream;

use crate::registry::{IndexKey, Registry};
use crate::served_index::unix_micros_now;
use crate::snapshot::Writer;
use crate::state::{DumpPermit, Permit};

/// Bytes per chunk.
pub(crate) const CHUNK: usize = 1 << 20;
/// Chunks buffered between the encoder and the network.
const IN_FLIGHT: usize = 4;
/// The slowest a reader may take a whole-state answer on average, beyond a grace of twice the
/// stall timeout (256 KiB/s, 2 Mbit/s: a 1 GiB snapshot in 68 minutes).
pub(crate) const MIN_READ_RATE: u64 = 256 << 10;

/// How a snapshot's writing ended: `None` until it ended; then `Ok` or the reason it stopped.
type Outcome = Arc<Mutex<Option<Result<(), String>>>>;

/// The places a streamed answer holds until its writing ends.
#[derive(Debug)]
pub(crate) struct Held {
    /// Its place among the whole-state reads.
    pub(crate) dump: DumpPermit,
    /// Its request's place among the concurrent requests, and its token's (`None`: the
    /// request holds none, or another owner keeps it).
    pub(crate) request: Option<Permit>,
}

/// Writes into the channel in pieces of at most `chunk` bytes; fails once the receiver is gone,
/// has taken nothing for `stall`, or the time spent waiting for it exceeds twice `stall` plus
/// the time its bytes earn at `min_rate` bytes per second.
pub(crate) struct ChannelWriter {
    tx: mpsc::Sender<Bytes>,
    buf: Vec<u8>,
    chunk: usize,
    stall: Duration,
    runtime: tokio::runtime::Handle,
    /// The time spent waiting for the reader (in sends; the time spent producing the answer
    /// is not the reader's).
    waited: Duration,
    /// Bytes the reader has taken (sent into the channel).
    sent: u64,
    min_rate: u64,
}

impl ChannelWriter {
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(self.chunk),
        ));
        let length = chunk.len() as u64;
        // What the reader has taken earns it time beyond twice `stall` (a reader that takes
        // nothing meets the stall deadline first, and is told so).
        let earned = Duration::from_secs_f64(self.sent as f64 / self.min_rate.max(1) as f64);
        let now = tokio::time::Instant::now();
        let rate_deadline = now + (2 * self.stall + earned).saturating_sub(self.waited);
        let stall_deadline = now + self.stall;
        let sent = self.runtime.block_on(tokio::time::timeout_at(
            rate_deadline.min(stall_deadline),
            self.tx.send(chunk),
        ));
        self.waited += now.elapsed();
        match sent {
            Ok(Ok(())) => {
                self.sent += length;
                Ok(())
            }
            Err(_) if rate_deadline < stall_deadline => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the reader took {} bytes while the answer waited {:.1?} for it, under {} \
                     KiB/s: the answer was abandoned and its places (among the whole-state \
                     reads and the concurrent requests) freed; read faster",
                    self.sent,
                    self.waited,
                    self.min_rate >> 10
                ),
            )),
            Ok(Err(_)) => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the reader went away",
            )),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the reader took nothing for {} s (the stall timeout): the answer was \
                     abandoned and its places (among the whole-state reads and the concurrent \
                     requests) freed; read faster or raise --stall-timeout-secs",
                    self.stall.as_secs_f64()
                ),
            )),
        }
    }
}

impl Write for ChannelWriter {
    /// Takes what fits in the current chunk (`write_all` comes back for the rest), so every
    /// chunk is at most `chunk` bytes. Between calls, `buf` holds less than a chunk.
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let taken = (self.chunk - self.buf.len()).min(data.len());
        self.buf.extend_from_slice(&data[..taken]);
        if self.buf.len() >= self.chunk {
            self.send()?;
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

/// The chunks of one answer. Ends cleanly only after the last chunk of an answer written
/// whole; otherwise its last item is the error that stopped the writing.
pub(crate) struct SnapshotStream {
    chunks: mpsc::Receiver<Bytes>,
    outcome: Outcome,
    ended: bool,
}

impl std::fmt::Debug for SnapshotStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStream")
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl Stream for SnapshotStream {
    type Item = io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.chunks.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(chunk)) => Poll::Ready(Some(Ok(chunk))),
            Poll::Ready(None) => {
                self.ended = true;
                // Every sender is gone, and the writer sets the outcome before its last one
                // goes: `None` here means the task died without setting it (a panic).
                let outcome = self.outcome.lock().take();
                Poll::Ready(match outcome {
                    Some(Ok(())) => None,
                    Some(Err(reason)) => Some(Err(io::Error::other(reason))),
                    None => Some(Err(io::Error::other(
                        "the task writing the answer ended without finishing it",
                    ))),
                })
            }
        }
    }
}

/// The snapshot of every index, as a stream of chunks; `held` is held until the writing ends.
pub(crate) fn stream(registry: Arc<Registry>, held: Held, stall: Duration) -> SnapshotStream {
    stream_filtered(registry, |_| true, held, stall)
}

/// [`stream`] of the indexes `include` accepts.
pub(crate) fn stream_filtered(
    registry: Arc<Registry>,
    include: impl Fn(&IndexKey) -> bool + Send + 'static,
    held: Held,
    stall: Duration,
) -> SnapshotStream {
    stream_in_chunks(registry, include, held, stall, CHUNK, MIN_READ_RATE)
}

/// [`stream_filtered`] in chunks of `chunk` bytes, read at `min_rate` at least (tests use
/// small ones).
fn stream_in_chunks(
    registry: Arc<Registry>,
    include: impl Fn(&IndexKey) -> bool + Send + 'static,
    held: Held,
    stall: Duration,
    chunk: usize,
    min_rate: u64,
) -> SnapshotStream {
    let write = move |sink: &mut ChannelWriter| {
        let mut writer = Writer::new(sink, unix_micros_now())?;
        for entry in registry.all() {
            if include(&entry.key) {
                writer.index(&entry.image())?;
            }
        }
        writer.finish()?;
        Ok::<_, crate::snapshot::SnapshotError>(())
    };
    stream_written_at(
        move |sink| write(sink).map_err(|error| error.to_string()),
        held,
        stall,
        chunk,
        min_rate,
    )
}

/// The answer `write` writes, as a stream of chunks of at most `chunk` bytes, written by a
/// blocking task that holds `held` until the writing ends (written whole, failed, the reader
/// gone, stalled for `stall`, or slower than [`MIN_READ_RATE`] after it).
pub(crate) fn stream_written(
    write: impl FnOnce(&mut ChannelWriter) -> Result<(), String> + Send + 'static,
    held: Held,
    stall: Duration,
    chunk: usize,
) -> SnapshotStream {
    stream_written_at(write, held, stall, chunk, MIN_READ_RATE)
}

/// [`stream_written`] with the reader's minimum rate `min_rate`.
fn stream_written_at(
    write: impl FnOnce(&mut ChannelWriter) -> Result<(), String> + Send + 'static,
    held: Held,
    stall: Duration,
    chunk: usize,
    min_rate: u64,
) -> SnapshotStream {
    let (tx, rx) = mpsc::channel(IN_FLIGHT);
    let outcome: Outcome = Arc::default();
    let written_outcome = Arc::clone(&outcome);
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        // Dropped last, after the outcome is set: the reader sees the end only then.
        let last_sender = tx.clone();
        let mut sink = ChannelWriter {
            tx,
            buf: Vec::with_capacity(chunk),
            chunk,
            stall,
            runtime,
            waited: Duration::ZERO,
            sent: 0,
            min_rate,
        };
        let written =
            write(&mut sink).and_then(|()| sink.flush().map_err(|error| error.to_string()));
        if let Err(error) = &written {
            tracing::warn!("a whole-state read stopped: {error}");
        }
        *written_outcome.lock() = Some(written);
        // The places are freed here, whether or not the reader ever takes what is buffered:
        // the request's first, so whoever finds the whole-state place free finds it free too.
        let Held { dump, request } = held;
        drop(request);
        drop(dump);
        drop(last_sender);
    });
    SnapshotStream {
        chunks: rx,
        outcome,
        ended: false,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use kvatlas_hash::{BlockSize, LocalBlockHash};
    use kvatlas_index::{
        ExternalBlockHash, Snapshot, SnapshotBlock, Tier, TierSet, Worker, WorkerSnapshot,
    };
    use tokio_stream::StreamExt as _;

    use super::*;
    use crate::config::{IndexSettings, Limits};
    use crate::registry::DEFAULT_TENANT;
    use crate::snapshot::IndexImage;
    use crate::state::State;

    /// A server state whose one index holds `blocks` blocks of one rank.
    fn state_holding(blocks: u64) -> Arc<State> {
        let registry = Arc::new(Registry::new(IndexSettings::default(), Limits::default()));
        let image = IndexImage {
            key: IndexKey::new("m", DEFAULT_TENANT),
            block_size: BlockSize::new(16).expect("16"),
            capacity: None,
            feeds: Vec::new(),
            marks: BTreeMap::new(),
            snapshot: Snapshot {
                workers: vec![WorkerSnapshot {
                    worker: Worker::new(7, 0),
                    blocks: (1..=blocks)
                        .map(|i| SnapshotBlock {
                            external: ExternalBlockHash::new(i),
                            local: LocalBlockHash::new(i * 31),
                            parent: (i > 1).then(|| ExternalBlockHash::new(i - 1)),
                            tiers: TierSet::only(Tier::Device),
                        })
                        .collect(),
                }],
            },
        };
        registry
            .restore_images(&[image], None)
            .expect("the image is restored");
        Arc::new(State::new(registry, Limits::default(), None, 0))
    }

    /// The snapshot of every index of `state` in 256-byte chunks: far more than the channel
    /// buffers.
    fn in_small_chunks(
        state: &State,
        held: Held,
        stall: Duration,
        min_rate: u64,
    ) -> SnapshotStream {
        stream_in_chunks(
            Arc::clone(&state.registry),
            |_| true,
            held,
            stall,
            256,
            min_rate,
        )
    }

    /// Every item of a stream: the bytes before the first error, and that error.
    async fn drain(mut stream: SnapshotStream) -> (Vec<u8>, Option<io::Error>) {
        let mut bytes = Vec::new();
        while let Some(item) = stream.next().await {
            match item {
                Ok(chunk) => bytes.extend_from_slice(&chunk),
                Err(error) => return (bytes, Some(error)),
            }
        }
        (bytes, None)
    }

    /// Two snapshot streams nobody reads hold both places among the whole-state reads only
    /// until the stall timeout: then their places are freed, and what they still yield ends
    /// with the error naming the stall, not with a clean end (a reader must not take a cut
    /// snapshot for a whole one). Their requests' places, and their token's, are freed with
    /// them. A stream that is read is written whole and reads back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_reader_loses_its_place_and_its_snapshot_ends_in_an_error() {
        let state = state_holding(5_000);
        let stall = Duration::from_millis(300);
        let mut caller = crate::auth::Caller::anonymous();
        let quota = Arc::new(crate::auth::RequestQuota::new(
            crate::state::MAX_CONCURRENT_DUMPS,
        ));
        caller.quota = Some(Arc::clone(&quota));
        let in_flight = || state.metrics.in_flight().held();
        // 256-byte chunks: the snapshot is far more than the channel buffers.
        let stalled: Vec<SnapshotStream> = (0..crate::state::MAX_CONCURRENT_DUMPS)
            .map(|_| {
                let request = state.admit_request(&caller).expect("a request's place");
                let held = state
                    .admit_dump("Snapshot", Some(request))
                    .expect("a place");
                in_small_chunks(&state, held, stall, MIN_READ_RATE)
            })
            .collect();
        assert!(
            state.admit_dump("/snapshot", None).is_err(),
            "both places are held while the readers have not stalled for long"
        );
        assert!(
            state.admit_request(&caller).is_err(),
            "the token's quota is held while the readers have not stalled for long"
        );
        assert_eq!(in_flight(), crate::state::MAX_CONCURRENT_DUMPS);
        let deadline = Instant::now() + Duration::from_secs(20);
        let held = loop {
            if let Ok(held) = state.admit_dump("/snapshot", None) {
                break held;
            }
            assert!(
                Instant::now() < deadline,
                "the stalled reads still hold their places"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        while in_flight() > 0 {
            assert!(
                Instant::now() < deadline,
                "the stalled reads still hold their requests' places"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let permits: Vec<_> = (0..crate::state::MAX_CONCURRENT_DUMPS)
            .map(|_| {
                state
                    .admit_request(&caller)
                    .expect("the token's places are free again")
            })
            .collect();
        drop(permits);
        for stream in stalled {
            let (bytes, error) = drain(stream).await;
            let error = error.expect("a stalled read ends in an error");
            assert!(error.to_string().contains("stall timeout"), "{error}");
            assert!(
                crate::snapshot::read(bytes.as_slice()).is_err(),
                "what was buffered is not a whole snapshot"
            );
        }

        let read = in_small_chunks(&state, held, stall, MIN_READ_RATE);
        let (bytes, error) = drain(read).await;
        assert!(error.is_none(), "{error:?}");
        let (_, images) = crate::snapshot::read(bytes.as_slice()).expect("a whole snapshot");
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].snapshot.blocks(), 5_000);
        assert_eq!(
            images[0].snapshot,
            state.registry.all()[0].image().snapshot,
            "the snapshot read back is the index's"
        );
    }

    /// The time spent producing an answer (an index's image taken, encoded) is not the
    /// reader's: an answer whose first chunk comes after three times the stall timeout, read
    /// at once, ends whole (the rate's clock started with the answer, and such an answer was
    /// cut at its first full buffer).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_time_spent_producing_an_answer_is_not_the_readers() {
        let state = state_holding(1);
        let stall = Duration::from_millis(200);
        let held = state.admit_dump("Snapshot", None).expect("a place");
        let answer = stream_written_at(
            move |sink| {
                std::thread::sleep(3 * stall);
                for _ in 0..8 {
                    sink.write_all(&[7; 256]).map_err(|e| e.to_string())?;
                }
                Ok(())
            },
            held,
            stall,
            256,
            1 << 20,
        );
        // Read once the buffer is full: the answer waits for the reader briefly.
        tokio::time::sleep(3 * stall + Duration::from_millis(100)).await;
        let (bytes, error) = drain(answer).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(bytes.len(), 8 * 256);
    }

    /// A reader that never stalls but takes a chunk only now and then (here 256 bytes every
    /// 50 ms, about 5 KiB/s, against a minimum of 20 KiB/s) loses the answer once it has waited
    /// for it beyond twice the stall timeout and what its bytes earn: its place is freed and what it
    /// reads ends in an error naming the rate. (A chunk every 29 s held a place for hours.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_slower_than_the_minimum_rate_loses_its_place() {
        let state = state_holding(5_000);
        let stall = Duration::from_millis(300);
        let held = state.admit_dump("Snapshot", None).expect("a place");
        // The other place is taken: only the trickling reader's, freed, lets another in.
        let _other = state.admit_dump("Snapshot", None).expect("the other place");
        assert!(state.admit_dump("/snapshot", None).is_err(), "both held");
        let mut trickle = in_small_chunks(&state, held, stall, 20 << 10);
        let started = Instant::now();
        let error = loop {
            match trickle.next().await {
                Some(Ok(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                Some(Err(error)) => break error,
                None => panic!("a trickling reader was sent the whole answer"),
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "still reading after 20 s"
            );
        };
        assert!(error.to_string().contains("KiB/s"), "{error}");
        state
            .admit_dump("/snapshot", None)
            .expect("its place is free again");
    }
}
