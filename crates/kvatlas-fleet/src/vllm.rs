//! vLLM's KV-event batches, encoded byte for byte as vLLM 0.33's publisher sends them
//! (`docs/events.md` §7): `[ts, [events…], dp_rank]` in msgpack, a `BlockStored` as a `map16(8)`
//! with `uint64` hashes, the run's token ids, `block_size` and `medium: "GPU"`, and one
//! `fixmap(4)` `BlockRemoved` per evicted block (vLLM emits one event per block).

use kvatlas_index::{Mutation, StoredBlock};

/// Tokens per block of the batches (vLLM's default block size).
pub const BLOCK_TOKENS: u32 = 16;

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

/// `batch` (written by [`encode_batch`]) with its timestamp replaced by `ts`, as an engine
/// stamps a batch when it publishes it (vLLM and SGLang take `time.time()`); `None` if `batch`
/// does not start as [`encode_batch`] writes it (an array of three, then a float64).
pub fn with_timestamp(batch: &[u8], ts: f64) -> Option<Vec<u8>> {
    let (&[0x93, 0xcb], _) = batch.split_first_chunk::<2>()? else {
        return None;
    };
    let mut stamped = batch.to_vec();
    stamped.get_mut(2..10)?.copy_from_slice(&ts.to_be_bytes());
    Some(stamped)
}

/// An engine's stamp for a batch published now: seconds since the Unix epoch on the wall
/// clock, as vLLM and SGLang take `time.time()` (0 if the clock reads earlier).
pub fn wall_clock_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The timestamp of `batch` as [`encode_batch`] or [`with_timestamp`] wrote it (seconds since
/// the epoch); `None` if `batch` does not start that way.
pub fn timestamp(batch: &[u8]) -> Option<f64> {
    let (&[0x93, 0xcb], rest) = batch.split_first_chunk::<2>()? else {
        return None;
    };
    Some(f64::from_be_bytes(*rest.first_chunk::<8>()?))
}

/// Encodes events as one vLLM 0.33 batch at block size [`BLOCK_TOKENS`] (rank 0): its
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
                w.str("block_size").uint(u64::from(BLOCK_TOKENS));
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
    use kvatlas_hash::LocalBlockHash;
    use kvatlas_index::{ExternalBlockHash, Tier, Worker};

    use super::*;

    fn encoded(ts: f64) -> Vec<u8> {
        let worker = Worker::new(1, 0);
        let events = [
            Mutation::Stored {
                worker,
                tier: Tier::Device,
                parent: None,
                blocks: vec![StoredBlock {
                    external: ExternalBlockHash::new(7),
                    local: LocalBlockHash::new(9),
                }],
            },
            Mutation::Removed {
                worker,
                tier: Tier::Device,
                blocks: vec![ExternalBlockHash::new(7)],
            },
        ];
        let mut tokens = Vec::new();
        encode_batch(ts, &events, true, true, &mut tokens, |_, out| {
            out.extend(0..BLOCK_TOKENS);
        })
        .payload
    }

    #[test]
    fn a_restamped_batch_is_the_batch_encoded_with_that_timestamp() {
        let now = 1_795_781_819.123_456;
        assert_eq!(with_timestamp(&encoded(0.0), now), Some(encoded(now)));
        assert_ne!(encoded(0.0), encoded(now));
        assert_eq!(timestamp(&encoded(now)), Some(now));
        assert_eq!(
            timestamp(&encoded(0.0)[..9]),
            None,
            "cut inside the timestamp"
        );
        assert_eq!(timestamp(&[0x93, 0xca, 0, 0, 0, 0]), None, "a float 32");
        assert_eq!(timestamp(&[]), None);
    }

    #[test]
    fn only_batches_as_encode_batch_writes_them_are_restamped() {
        let batch = encoded(1.0);
        assert_eq!(
            with_timestamp(&batch[..9], 2.0),
            None,
            "cut inside the timestamp"
        );
        assert_eq!(
            with_timestamp(&[0x93, 0xcf, 0, 0, 0, 0, 0, 0, 0, 1], 2.0),
            None
        );
        assert_eq!(with_timestamp(&[], 2.0), None);
    }
}
