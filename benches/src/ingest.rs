//! KV-event ingestion workload: the Mooncake trace as vLLM 0.33 msgpack batches.
//!
//! The trace is split to 16-token blocks (trace-length factor 32, vLLM's default block size) and
//! run through one mock engine ([`crate::engine::generate`], one worker, LRU eviction), so the
//! stream has the engine's real mix of stores (only the blocks it misses) and one-block evictions.
//! Each request's events become one batch (one scheduler step), encoded exactly as vLLM 0.33's
//! publisher does (`docs/events.md` §7): `[ts, events, dp_rank]`, a `BlockStored` as a `map16(8)`
//! with `uint64` hashes, 16 token ids per block and `medium: "GPU"`, a `BlockRemoved` as a
//! `fixmap(4)` with one hash (vLLM emits one event per evicted block). Tokens are
//! [`crate::trace::block_tokens`] of each block's engine hash, so every block's tokens differ.
//!
//! [`ingest_into`] is the in-process path (decode + convert + apply on one thread) used by the
//! `ingest` criterion bench and the `ingest-e2e` binary, which compares it with the same batches
//! sent over a loopback ZMQ socket to a [`kvatlas_events::Listener`].

use kvatlas_events::{Converter, DropCounters, EngineKind, Source};
use kvatlas_hash::BlockSize;
use kvatlas_index::{Mutation, SharedKvIndex};

use crate::engine::{EngineConfig, Eviction, LocalHashing, generate};
use crate::trace::{TRACE_BLOCK_TOKENS, TraceRequest, block_tokens, scale_length};

/// vLLM's default block size, the one the stream is built with.
pub const INGEST_BLOCK_TOKENS: u32 = kvatlas_fleet::vllm::BLOCK_TOKENS;

/// The ZMQ topic vLLM publishes on by default.
pub const TOPIC: &[u8] = b"kv-events";

/// How the ingestion stream is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngestConfig {
    /// Use only the first N trace requests (before splitting to 16-token blocks).
    pub requests: usize,
    /// Blocks (of 16 tokens) the mock engine's cache holds.
    pub capacity: usize,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            requests: 1_000,
            capacity: 65_536,
        }
    }
}

pub use kvatlas_fleet::vllm::{EncodedBatch, encode_batch};

/// A set of batches with their totals.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchSet {
    /// The batches, in stream order.
    pub batches: Vec<EncodedBatch>,
    /// Total token ids.
    pub tokens: u64,
    /// Total `BlockStored` events.
    pub stored_events: u64,
    /// Total `BlockRemoved` events.
    pub removed_events: u64,
    /// Total payload bytes.
    pub bytes: u64,
}

impl BatchSet {
    fn push(&mut self, batch: EncodedBatch) {
        self.tokens += batch.tokens;
        self.stored_events += batch.stored_events;
        self.removed_events += batch.removed_events;
        self.bytes += batch.payload.len() as u64;
        self.batches.push(batch);
    }

    /// All events (stored + removed).
    pub fn events(&self) -> u64 {
        self.stored_events + self.removed_events
    }
}

/// The three views of one engine stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestStream {
    /// Each request's events in engine order (stores and evictions), one batch per request.
    pub mixed: BatchSet,
    /// Each request's stores only.
    pub stores: BatchSet,
    /// Each request's evictions only (requests without evictions have no batch).
    pub removes: BatchSet,
}

/// The registered source the stream belongs to (worker 0, rank 0, block size 16, vLLM).
pub fn source() -> Source {
    Source {
        worker_id: 0,
        dp_rank: 0,
        block_size: BlockSize::new(INGEST_BLOCK_TOKENS).expect("16 is a valid block size"),
        engine: EngineKind::Vllm,
    }
}

/// Builds the stream from `trace`'s first `config.requests` requests.
///
/// # Panics
/// If `config.capacity` is 0.
pub fn build(trace: &[TraceRequest], config: &IngestConfig) -> IngestStream {
    let mut requests = trace[..config.requests.min(trace.len())].to_vec();
    let factor = (TRACE_BLOCK_TOKENS / INGEST_BLOCK_TOKENS as usize) as u64;
    scale_length(&mut requests, factor).expect("trace hash ids fit in u64 after splitting");
    let engine = EngineConfig {
        local_hashing: LocalHashing::Splitmix,
        block_tokens: INGEST_BLOCK_TOKENS,
        ..EngineConfig::new(1, config.capacity, Eviction::LeafFirst, 42)
    };
    let stream = generate(&requests, &engine);
    let mut out = IngestStream::default();
    let mut tokens = Vec::new();
    for (q, query) in stream.queries.iter().enumerate() {
        let ts = 1_795_317_349.0 + query.timestamp_ms as f64 / 1e3 + q as f64 * 1e-6;
        let events = &stream.events[query.events.clone()];
        out.mixed.push(encode(ts, events, true, true, &mut tokens));
        if events.iter().any(|e| matches!(e, Mutation::Stored { .. })) {
            out.stores
                .push(encode(ts, events, true, false, &mut tokens));
        }
        if events.iter().any(|e| matches!(e, Mutation::Removed { .. })) {
            out.removes
                .push(encode(ts, events, false, true, &mut tokens));
        }
    }
    out
}

/// Decodes, converts and applies every batch of `batches` on the calling thread; returns the
/// mutations applied. Decode errors and dropped events are counted in `drops`.
pub fn ingest_into<I: SharedKvIndex + ?Sized>(
    converter: &Converter,
    batches: &[EncodedBatch],
    index: &I,
    drops: &mut DropCounters,
) -> u64 {
    let mut mutations = Vec::new();
    let mut applied = 0;
    for batch in batches {
        mutations.clear();
        // An error is counted in `drops` by `ingest`.
        let _ = converter.ingest(&batch.payload, &mut mutations, drops);
        for mutation in &mutations {
            index.apply(mutation);
        }
        applied += mutations.len() as u64;
    }
    applied
}

/// Encodes one request's events (its stores if `stores`, its evictions if `removes`) as a
/// vLLM 0.33 batch; evictions become one `BlockRemoved` per block. Each stored block's tokens
/// are [`block_tokens`] of its engine hash.
fn encode(
    ts: f64,
    events: &[Mutation],
    stores: bool,
    removes: bool,
    tokens: &mut Vec<u32>,
) -> EncodedBatch {
    encode_batch(ts, events, stores, removes, tokens, |block, out| {
        block_tokens(block.external.get(), INGEST_BLOCK_TOKENS as usize, out);
    })
}

#[cfg(test)]
mod tests {
    use kvatlas_index::{Atlas, baseline::Locked};

    use super::*;

    fn tiny_trace() -> Vec<TraceRequest> {
        (0..20)
            .map(|i| TraceRequest {
                timestamp: i * 10,
                input_length: 2048,
                output_length: 1,
                hash_ids: vec![0, 1 + i % 3, 100 + i],
            })
            .collect()
    }

    #[test]
    fn stream_decodes_without_drops() {
        let stream = build(
            &tiny_trace(),
            &IngestConfig {
                requests: 20,
                capacity: 200,
            },
        );
        assert!(stream.stores.tokens > 0);
        assert!(stream.removes.removed_events > 0, "the cache must evict");
        assert_eq!(stream.mixed.tokens, stream.stores.tokens);
        assert_eq!(
            stream.mixed.events(),
            stream.stores.events() + stream.removes.events()
        );
        let converter = Converter::new(source());
        let index = Locked::new(Atlas::new());
        let mut drops = DropCounters::new();
        let applied = ingest_into(&converter, &stream.mixed.batches, &index, &mut drops);
        assert_eq!(drops.total(), 0);
        assert_eq!(
            applied,
            stream.mixed.stored_events + stream.mixed.removed_events
        );
    }
}
