//! Token-block hashing for KV-cache indexes.
//!
//! An LLM engine caches the attention keys and values of a prompt in fixed-size **blocks** of
//! tokens. To find which engine already holds a prompt's prefix, a router hashes the prompt the
//! same way the index was built. This crate is that hashing vocabulary, importable on its own:
//!
//! | Type | Bits | Identifies |
//! |---|---|---|
//! | [`LocalBlockHash`] | 64 | the tokens of one block (a chunk hash) |
//! | [`SequenceHash`] | 64 | a block together with its whole prefix (rolling hash) |
//! | [`PositionalSequenceHash`] | 128 | sequence hash + position + local-hash fragment |
//! | [`PositionalLineageHash`] | 128 | position + own and parent fragments (parent links without pointers) |
//!
//! The local and sequence hashes are bit-compatible with NVIDIA Dynamo's
//! (`compute_block_hash_for_seq`, `compute_seq_hash_for_block`, `PositionalSequenceHash`): XXH3-64
//! over little-endian `u32` tokens with seed 1337, LoRA name and cache salt mixed into the seed.
//! `docs/hashing.md` in the repository documents every bit and lists test vectors.
//!
//! ```
//! use kvatlas_hash::{BlockHasher, sequence_hashes};
//!
//! let tokens: Vec<u32> = (1..=8).collect();
//! let hasher = BlockHasher::new(4)?;
//! let locals: Vec<_> = hasher.local_hashes(&tokens).collect();
//! assert_eq!(locals[0].get(), 0xcb38_e4d7_fb2d_ca5c);
//! let seqs: Vec<_> = sequence_hashes(locals).collect();
//! assert_eq!(seqs[1].get(), 0x44a2_b237_9d6d_3c3d);
//! # Ok::<(), kvatlas_hash::HashError>(())
//! ```
//!
//! What this crate is not: it knows nothing about workers, indexes, engines' wire formats,
//! threads or I/O. Its only dependency is `xxhash-rust` (plus `serde` behind the `serde` feature).
//! Nothing in it panics on caller input; invalid block sizes and positions are [`HashError`]s.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod block;
mod error;
mod lineage;
mod positional;
mod sequence;
mod xxh3_tokens;

pub use block::{
    BASE_SEED, BlockHasher, BlockSize, LocalBlockHash, LocalHashes, TokenId, compute_local_hashes,
};
pub use error::HashError;
pub use lineage::PositionalLineageHash;
pub use positional::{PositionalHash, PositionalSequenceHash};
pub use sequence::{
    SequenceHash, SequenceHashes, compute_sequence_hashes, sequence_hashes, sequence_hashes_after,
};
