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
use kvatlas_index::{Mutation, SharedKvIndex, StoredBlock};

use crate::engine::{EngineConfig, Eviction, LocalHashing, generate};
use crate::trace::{TRACE_BLOCK_TOKENS, TraceRequest, block_tokens, scale_length};

/// vLLM's default block size, the one the stream is built with.
pub const INGEST_BLOCK_TOKENS: u32 = 16;

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

/// One encoded batch and what it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedBatch {
    /// The msgpack payload (the third ZMQ frame).
    pub payload: Vec<u8>,
    /// Token ids in its `BlockStored` events.
    pub tokens: u64,
    /// `BlockStored` events.
    pub stored_events: u64,
    /// `BlockRemoved` events (one hash each).
    pub removed_events: u64,
}

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

/// Encodes events as one vLLM 0.33 batch at block size [`INGEST_BLOCK_TOKENS`] (rank 0): its
/// stores if `stores` (each block's 16 token ids appended by `fill_tokens`), its evictions if
/// `removes` (one `BlockRemoved` per block, as vLLM emits them). `tokens` is scratch space.
pub fn encode_batch(
    ts: f64,
    events: &[Mutation],
    stores: bool,
    removes: bool,
    tokens: &mut Vec<u32>,
    mut fill_tokens: impl FnMut(&StoredBlock, &mut Vec<u32>),
) -> EncodedBatch {
    let mut count = 0usize;
    for event in events {
        match event {
            Mutation::Stored { .. } if stores => count += 1,
            Mutation::Removed { blocks, .. } if removes => count += blocks.len(),
            _ => {}
        }
    }
    let mut w = Writer::default();
    let mut batch = EncodedBatch {
        payload: Vec::new(),
        tokens: 0,
        stored_events: 0,
        removed_events: 0,
    };
    w.array(3).f64(ts).array(count);
    for event in events {
        match event {
            Mutation::Stored { parent, blocks, .. } if stores => {
                tokens.clear();
                for block in blocks {
                    fill_tokens(block, tokens);
                }
                w.raw(&[0xde, 0x00, 0x08]); // map16(8), as 0.33.0 always sends
                w.str("type").str("BlockStored").str("block_hashes");
                w.array(blocks.len());
                for block in blocks {
                    w.uint(block.external.get());
                }
                w.str("parent_block_hash");
                match parent {
                    Some(p) => w.uint(p.get()),
                    None => w.nil(),
                };
                w.str("token_ids").array(tokens.len());
                for &t in tokens.iter() {
                    w.uint(u64::from(t));
                }
                w.str("block_size").uint(u64::from(INGEST_BLOCK_TOKENS));
                w.str("lora_id").nil().str("medium").str("GPU");
                w.str("lora_name").nil();
                batch.tokens += tokens.len() as u64;
                batch.stored_events += 1;
            }
            Mutation::Removed { blocks, .. } if removes => {
                for block in blocks {
                    w.raw(&[0x84]); // fixmap(4)
                    w.str("type").str("BlockRemoved").str("block_hashes");
                    w.array(1).uint(block.get());
                    w.str("medium").str("GPU").str("group_idx").uint(0);
                    batch.removed_events += 1;
                }
            }
            _ => {}
        }
    }
    w.uint(0); // data_parallel_rank
    batch.payload = w.0;
    batch
}

/// A minimal msgpack writer (the subset vLLM's msgspec encoder produces for these batches).
#[derive(Debug, Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }

    fn array(&mut self, n: usize) -> &mut Self {
        if n < 16 {
            self.0.push(0x90 | n as u8);
        } else if let Ok(n) = u16::try_from(n) {
            self.0.push(0xdc);
            self.0.extend_from_slice(&n.to_be_bytes());
        } else {
            self.0.push(0xdd);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self
    }

    fn str(&mut self, s: &str) -> &mut Self {
        debug_assert!(s.len() < 32, "only fixstr keys and values");
        self.0.push(0xa0 | s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    fn nil(&mut self) -> &mut Self {
        self.0.push(0xc0);
        self
    }

    fn f64(&mut self, x: f64) -> &mut Self {
        self.0.push(0xcb);
        self.0.extend_from_slice(&x.to_be_bytes());
        self
    }

    /// The smallest unsigned encoding, as msgspec writes integers (so a 64-bit hash is nearly
    /// always a `uint64`).
    fn uint(&mut self, x: u64) -> &mut Self {
        if x < 128 {
            self.0.push(x as u8);
        } else if x <= u64::from(u8::MAX) {
            self.0.extend_from_slice(&[0xcc, x as u8]);
        } else if x <= u64::from(u16::MAX) {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(x as u16).to_be_bytes());
        } else if x <= u64::from(u32::MAX) {
            self.0.push(0xce);
            self.0.extend_from_slice(&(x as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&x.to_be_bytes());
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use kvatlas_index::{Atlas, Locked};

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
