//! A simulated fleet of inference engines that behave like vLLM on the wire.
//!
//! The mock engines of [`crate::engine`] (per-worker LRU caches fed the Mooncake trace) decide
//! what each worker stores and evicts; this module turns their events into what a fleet of vLLM
//! engines publishes and serves it over real sockets:
//!
//! - **Batches.** Each request's events become one vLLM batch of its worker
//!   (`[ts, [events…], dp_rank]`, msgpack, block size [`BLOCK_TOKENS`]; a `BlockStored` carries
//!   each block's 16 token ids, [`crate::trace::block_tokens`] of its trace id, and one
//!   `BlockRemoved` per evicted block, as vLLM emits them). Sequence numbers count each worker's
//!   batches from 0.
//! - **Timing.** A batch is due at its request's trace timestamp, the trace's span rescaled onto
//!   a chosen window; batches due at the same instant go in trace order.
//! - **Sockets.** Per worker an XPUB (a PUB that also reports its subscribers, so publishing
//!   starts only once the indexer under test listens to every engine: nothing is lost to ZMQ's
//!   slow-joiner window) sending `[topic, seq (8 bytes big-endian), payload]`, and a ROUTER that
//!   serves replays from any sequence number as vLLM's replay socket does.
//! - **Quiesce marker.** After its last batch every worker publishes one more: a single
//!   [`marker_tokens`] block. Each worker's batches are applied in order by any correct indexer,
//!   so once a query for the marker shows every worker, everything before it has been applied.
//!
//! Same trace, same configuration, same window: the same bytes at the same offsets.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvatlas_events::{Converter, DropCounters, EngineKind, Source};
use kvatlas_hash::{BlockHasher, BlockSize, LocalBlockHash};
use kvatlas_index::{
    ExternalBlockHash, KvIndex, Mutation, ReferenceIndex, StoredBlock, Tier, Worker,
};
use rustc_hash::FxHashMap;

use crate::engine::Stream;
use crate::ingest::{self, INGEST_BLOCK_TOKENS};
use crate::trace::{TraceRequest, block_tokens};

/// Tokens per block on the wire (vLLM's default; one trace block is one block).
pub const BLOCK_TOKENS: u32 = INGEST_BLOCK_TOKENS;
/// The topic every engine publishes on (vLLM's default).
pub const TOPIC: &[u8] = b"kv-events";
/// The trace id whose tokens form the quiesce marker block (no trace block uses it).
const MARKER_ID: u64 = 1 << 50;
/// The engine hash of the marker block (the same on every worker: same tokens, same hash).
const MARKER_HASH: u64 = 0x6d61_726b_6572_0001;

/// The tokens of the quiesce marker block.
pub fn marker_tokens() -> Vec<u32> {
    let mut tokens = Vec::new();
    block_tokens(MARKER_ID, BLOCK_TOKENS as usize, &mut tokens);
    tokens
}

/// One batch on the publishing schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    /// When it is due, from the start of publishing.
    pub at: Duration,
    /// The worker that publishes it.
    pub worker: u32,
    /// Its sequence number (index into that worker's batches).
    pub seq: u64,
    /// The trace request that caused it (`None` for the quiesce marker).
    pub request: Option<usize>,
    /// Whether it stores blocks.
    pub stores: bool,
}

/// The fleet's whole output, encoded: what every worker publishes and when.
#[derive(Debug, Clone)]
pub struct FleetStream {
    /// Workers (ids `0..workers`, dp rank 0 each).
    pub workers: u32,
    /// Per worker, its batches' payloads by sequence number (the marker last).
    pub batches: Vec<Vec<Vec<u8>>>,
    /// Every batch, in publishing order (the markers last).
    pub schedule: Vec<Scheduled>,
    /// The window the trace's span was rescaled to.
    pub window: Duration,
    /// vLLM events published (a `BlockStored` per stored run, a `BlockRemoved` per block).
    pub events: u64,
    /// Blocks stored, over all `BlockStored` events.
    pub blocks_stored: u64,
    /// Payload bytes published.
    pub bytes: u64,
}

impl FleetStream {
    /// Encodes `stream` (generated from `trace` with `block_tokens` = [`BLOCK_TOKENS`] and
    /// token-hashed local hashes) for publishing over `window`.
    ///
    /// # Errors
    /// If a stored block's local hash is not the hash of any trace block's tokens (the stream
    /// was not generated from `trace` with 16-token blocks).
    pub fn build(stream: &Stream, trace: &[TraceRequest], window: Duration) -> Result<Self> {
        let hasher = BlockHasher::new(BLOCK_TOKENS).context("block size")?;
        let mut id_of_local = FxHashMap::<u64, u64>::default();
        let mut tokens = Vec::new();
        for request in trace {
            for &id in &request.hash_ids {
                tokens.clear();
                block_tokens(id, BLOCK_TOKENS as usize, &mut tokens);
                if let Some(local) = hasher.local_hashes(&tokens).next() {
                    id_of_local.insert(local.get(), id);
                }
            }
        }
        let workers = stream.config.workers;
        let first = stream.queries.first().map_or(0, |q| q.timestamp_ms);
        let span = stream
            .queries
            .last()
            .map_or(0, |q| q.timestamp_ms)
            .saturating_sub(first)
            .max(1);
        let mut out = Self {
            workers,
            batches: vec![Vec::new(); workers as usize],
            schedule: Vec::with_capacity(stream.queries.len() + workers as usize),
            window,
            events: 0,
            blocks_stored: 0,
            bytes: 0,
        };
        let mut missing = None;
        for (q, query) in stream.queries.iter().enumerate() {
            let events = &stream.events[query.events.clone()];
            if events.is_empty() {
                continue;
            }
            let offset = (query.timestamp_ms - first) as f64 / span as f64;
            let ts = 1_795_317_349.0 + query.timestamp_ms as f64 / 1e3;
            let batch = ingest::encode_batch(ts, events, true, true, &mut tokens, |block, out| {
                match id_of_local.get(&block.local.get()) {
                    Some(&id) => block_tokens(id, BLOCK_TOKENS as usize, out),
                    None => missing = Some(block.local.get()),
                }
            });
            out.push(
                query.worker,
                window.mul_f64(offset),
                Some(q),
                batch.stored_events > 0,
                batch,
            );
        }
        if let Some(local) = missing {
            bail!("local hash {local:#x} is not the hash of any trace block's 16 tokens");
        }
        let marker = marker_tokens();
        for worker in 0..workers {
            let event = Mutation::Stored {
                worker: Worker::new(u64::from(worker), 0),
                tier: Tier::Device,
                parent: None,
                blocks: vec![StoredBlock {
                    external: ExternalBlockHash::new(MARKER_HASH),
                    local: LocalBlockHash::new(0),
                }],
            };
            let batch = ingest::encode_batch(0.0, &[event], true, false, &mut tokens, |_, out| {
                out.extend_from_slice(&marker);
            });
            out.push(worker, window, None, true, batch);
        }
        Ok(out)
    }

    fn push(
        &mut self,
        worker: u32,
        at: Duration,
        request: Option<usize>,
        stores: bool,
        batch: ingest::EncodedBatch,
    ) {
        let batches = &mut self.batches[worker as usize];
        self.schedule.push(Scheduled {
            at,
            worker,
            seq: batches.len() as u64,
            request,
            stores,
        });
        self.events += batch.stored_events + batch.removed_events;
        self.blocks_stored += batch.tokens / u64::from(BLOCK_TOKENS);
        self.bytes += batch.payload.len() as u64;
        batches.push(batch.payload);
    }

    /// The reference model fed exactly the published batches, decoded and converted as an
    /// indexer does (each worker's batches in order; workers are independent).
    ///
    /// # Errors
    /// If a batch does not decode or an event is dropped (the fleet encodes only valid events).
    pub fn reference(&self) -> Result<ReferenceIndex> {
        let mut reference = ReferenceIndex::new();
        let mut drops = DropCounters::default();
        let mut mutations = Vec::new();
        for (worker, batches) in self.batches.iter().enumerate() {
            let converter = Converter::new(Source {
                worker_id: worker as u64,
                dp_rank: 0,
                block_size: BlockSize::new(BLOCK_TOKENS).context("block size")?,
                engine: EngineKind::Vllm,
            });
            for payload in batches {
                mutations.clear();
                converter
                    .ingest(payload, &mut mutations, &mut drops)
                    .context("a fleet batch does not decode")?;
                for mutation in &mutations {
                    reference.apply(mutation);
                }
            }
        }
        if drops.total() > 0 {
            bail!("the reference dropped fleet events: {drops:?}");
        }
        Ok(reference)
    }
}

/// Where an indexer reaches one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// The worker id.
    pub worker: u32,
    /// The live PUB endpoint (`tcp://127.0.0.1:port`).
    pub live: String,
    /// The replay ROUTER endpoint.
    pub replay: String,
}

/// The fleet's sockets, bound on loopback, and its replay server.
pub struct Fleet {
    stream: Arc<FleetStream>,
    publishers: Vec<zmq::Socket>,
    endpoints: Vec<Endpoints>,
    published: Arc<Vec<AtomicU64>>,
    stop: Arc<AtomicBool>,
    replay: Option<JoinHandle<Result<()>>>,
    replays: Arc<AtomicU64>,
    _context: zmq::Context,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("workers", &self.stream.workers)
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

/// What one publishing pass did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PublishReport {
    /// Wall time from the first send to the last.
    pub elapsed: Duration,
    /// How late the latest batch left after its due time.
    pub max_late: Duration,
}

fn bound(socket: &zmq::Socket) -> Result<String> {
    socket.bind("tcp://127.0.0.1:0")?;
    socket
        .get_last_endpoint()?
        .map_err(|raw| anyhow::anyhow!("a non-UTF-8 endpoint {raw:?}"))
}

impl Fleet {
    /// Binds every worker's XPUB and ROUTER on loopback and starts serving replays.
    ///
    /// # Errors
    /// If a socket cannot be created or bound.
    pub fn start(stream: Arc<FleetStream>) -> Result<Self> {
        let context = zmq::Context::new();
        let mut publishers = Vec::new();
        let mut routers = Vec::new();
        let mut endpoints = Vec::new();
        for worker in 0..stream.workers {
            let publisher = context.socket(zmq::XPUB)?;
            publisher.set_sndhwm(0)?;
            publisher.set_xpub_verbose(true)?;
            publisher.set_linger(0)?;
            let live = bound(&publisher)?;
            let router = context.socket(zmq::ROUTER)?;
            router.set_linger(0)?;
            let replay = bound(&router)?;
            publishers.push(publisher);
            routers.push(router);
            endpoints.push(Endpoints {
                worker,
                live,
                replay,
            });
        }
        let published: Arc<Vec<AtomicU64>> =
            Arc::new((0..stream.workers).map(|_| AtomicU64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let replays = Arc::new(AtomicU64::new(0));
        let replay = {
            let (stream, published, stop, replays) = (
                Arc::clone(&stream),
                Arc::clone(&published),
                Arc::clone(&stop),
                Arc::clone(&replays),
            );
            std::thread::Builder::new()
                .name("fleet-replay".into())
                .spawn(move || serve_replays(&routers, &stream, &published, &stop, &replays))?
        };
        Ok(Self {
            stream,
            publishers,
            endpoints,
            published,
            stop,
            replay: Some(replay),
            replays,
            _context: context,
        })
    }

    /// Every worker's endpoints.
    pub fn endpoints(&self) -> &[Endpoints] {
        &self.endpoints
    }

    /// Waits until every worker's publisher has `subscribers` subscriptions.
    ///
    /// # Errors
    /// If some worker has fewer when `timeout` runs out.
    pub fn wait_subscribed(&self, subscribers: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for (worker, publisher) in self.publishers.iter().enumerate() {
            let mut seen = 0;
            while seen < subscribers {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    bail!(
                        "worker {worker} has {seen} of {subscribers} subscribers after {timeout:?}"
                    );
                }
                if publisher.poll(zmq::POLLIN, left.as_millis().max(1) as i64)? > 0 {
                    let message = publisher.recv_bytes(0)?;
                    if message.first() == Some(&1) {
                        seen += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Publishes the whole schedule at its pace from now on, on the calling thread; `sent` is
    /// called after each send with the batch and the instant just before it was sent.
    ///
    /// # Errors
    /// If a send fails.
    pub fn publish(&mut self, mut sent: impl FnMut(&Scheduled, Instant)) -> Result<PublishReport> {
        let start = Instant::now();
        let mut max_late = Duration::ZERO;
        for item in &self.stream.schedule {
            let due = start + item.at;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let at = Instant::now();
            max_late = max_late.max(at.saturating_duration_since(due));
            let payload = &self.stream.batches[item.worker as usize][item.seq as usize];
            let publisher = &self.publishers[item.worker as usize];
            publisher.send(TOPIC, zmq::SNDMORE)?;
            publisher.send(&item.seq.to_be_bytes()[..], zmq::SNDMORE)?;
            publisher.send(&payload[..], 0)?;
            self.published[item.worker as usize].store(item.seq + 1, Ordering::Release);
            sent(item, at);
        }
        Ok(PublishReport {
            elapsed: start.elapsed(),
            max_late,
        })
    }

    /// Replay requests served so far (each a gap an indexer saw).
    pub fn replays_served(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// Stops the replay server and closes every socket.
    ///
    /// # Errors
    /// If the replay server failed.
    pub fn stop(mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.replay.take() {
            Some(handle) => handle
                .join()
                .map_err(|_| anyhow::anyhow!("the replay server panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Answers replay requests (`[identity, "", start_seq]`) on every worker's ROUTER with that
/// worker's published batches from `start_seq` on, as `[identity, "", topic, seq, payload]`,
/// then the end marker (sequence `u64::MAX`, empty payload).
fn serve_replays(
    routers: &[zmq::Socket],
    stream: &FleetStream,
    published: &[AtomicU64],
    stop: &AtomicBool,
    served: &AtomicU64,
) -> Result<()> {
    while !stop.load(Ordering::Relaxed) {
        let mut items: Vec<zmq::PollItem<'_>> = routers
            .iter()
            .map(|r| r.as_poll_item(zmq::POLLIN))
            .collect();
        if zmq::poll(&mut items, 50)? == 0 {
            continue;
        }
        let ready: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, item)| item.is_readable())
            .map(|(w, _)| w)
            .collect();
        for worker in ready {
            let router = &routers[worker];
            let frames = router.recv_multipart(0)?;
            let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
                continue;
            };
            let end = published[worker].load(Ordering::Acquire);
            for seq in start..end {
                let payload = &stream.batches[worker][seq as usize];
                router.send_multipart(
                    [
                        identity.as_slice(),
                        b"",
                        TOPIC,
                        &seq.to_be_bytes(),
                        payload.as_slice(),
                    ],
                    0,
                )?;
            }
            router.send_multipart(
                [
                    identity.as_slice(),
                    b"",
                    TOPIC,
                    &u64::MAX.to_be_bytes(),
                    b"",
                ],
                0,
            )?;
            served.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{self, EngineConfig, Eviction};
    use crate::trace::TraceRequest;
    use kvatlas_index::MatchOptions;

    fn small_trace() -> Vec<TraceRequest> {
        (0..40u64)
            .map(|i| TraceRequest {
                timestamp: i * 10,
                input_length: 64,
                output_length: 1,
                hash_ids: vec![0, 1 + i % 5, 100 + i],
            })
            .collect()
    }

    #[test]
    fn the_reference_fed_the_wire_bytes_holds_the_engines_final_caches() {
        let trace = small_trace();
        let config = EngineConfig {
            block_tokens: BLOCK_TOKENS,
            ..EngineConfig::new(4, 6, Eviction::LeafFirst, 7)
        };
        let stream = engine::generate(&trace, &config);
        let fleet = FleetStream::build(&stream, &trace, Duration::from_millis(100))
            .expect("a stream generated from the trace");
        assert_eq!(fleet.schedule.len(), stream.queries.len() + 4);
        assert!(fleet.schedule.windows(2).all(|w| w[0].at <= w[1].at));
        let reference = fleet.reference().expect("the fleet encodes valid batches");
        let hasher = BlockHasher::new(BLOCK_TOKENS).expect("a valid block size");
        let marker: Vec<LocalBlockHash> = hasher.local_hashes(&marker_tokens()).collect();
        let matches = reference.find_matches(&marker, &MatchOptions::default());
        assert_eq!(matches.workers.len(), 4, "every worker holds the marker");
        // Every worker's final cache (plus the marker) is what the reference holds for it.
        let stats = reference.stats();
        for (worker, cache) in stream.final_caches.iter().enumerate() {
            let held = stats
                .workers
                .iter()
                .find(|w| w.worker == Worker::new(worker as u64, 0))
                .map_or(0, |w| w.per_tier[Tier::Device.index()]);
            assert_eq!(held, cache.len() as u64 + 1, "worker {worker}");
        }
    }
}
