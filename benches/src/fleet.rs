//! The end-to-end benchmark's fleet: a whole stream of simulated vLLM engines, encoded up front
//! and published on schedule through [`kvatlas_fleet::publish::Publishers`].
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
//! - **Sockets.** Per worker an XPUB and a replay ROUTER ([`Publishers`]); publishing starts
//!   once the indexer under test subscribed to every engine.
//! - **Quiesce marker.** After its last batch every worker publishes one more: a single
//!   [`marker_tokens`] block. Each worker's batches are applied in order by any correct indexer,
//!   so once a query for the marker shows every worker, everything before it has been applied.
//!
//! Same trace, same configuration, same window: the same bytes at the same offsets.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvatlas_events::{Converter, DropCounters, EngineKind, Source};
use kvatlas_fleet::publish::Publishers;
use kvatlas_fleet::vllm::{self, EncodedBatch};
use kvatlas_hash::{BlockHasher, BlockSize, LocalBlockHash};
use kvatlas_index::{
    ExternalBlockHash, KvIndex, Mutation, ReferenceIndex, StoredBlock, Tier, Worker,
};
use rustc_hash::FxHashMap;

use crate::engine::Stream;
use crate::trace::{TraceRequest, block_tokens};

/// Tokens per block on the wire (vLLM's default; one trace block is one block).
pub const BLOCK_TOKENS: u32 = vllm::BLOCK_TOKENS;
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
    pub batches: Vec<Vec<Arc<[u8]>>>,
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
            let batch = vllm::encode_batch(ts, events, true, true, &mut tokens, |block, out| {
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
            let batch = vllm::encode_batch(0.0, &[event], true, false, &mut tokens, |_, out| {
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
        batch: EncodedBatch,
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
        batches.push(batch.payload.into());
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

/// What one publishing pass did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PublishReport {
    /// Wall time from the first send to the last.
    pub elapsed: Duration,
    /// How late the latest batch left after its due time.
    pub max_late: Duration,
}

/// Publishes `stream`'s whole schedule through `publishers` at its pace from now on, on the
/// calling thread, each batch stamped with the wall clock as it leaves (an engine's `ts`);
/// `sent` is called after each send with the batch and the instant just before it was sent.
///
/// # Errors
/// If a send fails.
pub fn publish_schedule(
    stream: &FleetStream,
    publishers: &Publishers,
    mut sent: impl FnMut(&Scheduled, Instant),
) -> Result<PublishReport> {
    let start = Instant::now();
    let mut max_late = Duration::ZERO;
    for item in &stream.schedule {
        let due = start + item.at;
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        let at = Instant::now();
        max_late = max_late.max(at.saturating_duration_since(due));
        let payload = &stream.batches[item.worker as usize][item.seq as usize];
        // Stamped as an engine stamps a batch: its wall clock as it publishes it.
        let payload = vllm::with_timestamp(payload, vllm::wall_clock_seconds())
            .map_or_else(|| Arc::clone(payload), Arc::from);
        let seq = publishers.publish(item.worker, payload)?;
        debug_assert_eq!(seq, item.seq, "one publisher per stream");
        sent(item, at);
    }
    Ok(PublishReport {
        elapsed: start.elapsed(),
        max_late,
    })
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
