//! Cutting token sequences into blocks and hashing each block's tokens (the local, or chunk, hash).

use std::num::NonZeroU32;

use xxhash_rust::const_xxh3::const_custom_default_secret;
use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_secret, xxh3_64_with_seed};

use crate::{HashError, xxh3_tokens};

/// The base seed of every XXH3 call, shared with NVIDIA Dynamo (`XXH3_SEED` / `CHAIN_XXH3_SEED`).
pub const BASE_SEED: u64 = 1337;

/// XXH3 hashes inputs longer than this many bytes with a secret derived from the seed; shorter
/// inputs mix the seed in directly. [`BlockHasher`] derives that secret once instead of per call.
const XXH3_MID_SIZE_MAX: usize = 240;

/// Blocks up to this many tokens are laid out as bytes in a stack buffer and hashed in one call;
/// larger blocks stream through it.
const STACK_BUFFER_TOKENS: usize = 1024;

/// A token id as engines emit it.
pub type TokenId = u32;

/// Number of tokens in one KV block (1 ..= [`BlockSize::MAX`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(try_from = "u32", into = "u32"))]
pub struct BlockSize(NonZeroU32);

impl BlockSize {
    /// The largest accepted block size, in tokens. Real engines use 16 to 512.
    pub const MAX: u32 = 1 << 16;

    /// Validates a block size.
    ///
    /// # Errors
    /// [`HashError::InvalidBlockSize`] for 0 or a value above [`BlockSize::MAX`].
    pub const fn new(tokens: u32) -> Result<Self, HashError> {
        match NonZeroU32::new(tokens) {
            Some(n) if tokens <= Self::MAX => Ok(Self(n)),
            _ => Err(HashError::InvalidBlockSize { block_size: tokens }),
        }
    }

    /// The block size in tokens.
    pub const fn get(self) -> u32 {
        self.0.get()
    }

    /// The block size in tokens, as a `usize`.
    pub const fn as_usize(self) -> usize {
        self.0.get() as usize
    }

    /// How many full blocks `num_tokens` tokens make; a trailing partial block does not count.
    pub const fn full_blocks(self, num_tokens: usize) -> usize {
        num_tokens / self.as_usize()
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = HashError;

    fn try_from(tokens: u32) -> Result<Self, HashError> {
        Self::new(tokens)
    }
}

impl From<BlockSize> for u32 {
    fn from(size: BlockSize) -> u32 {
        size.get()
    }
}

/// Hash of the tokens inside one block, independent of what precedes it (the "chunk hash").
///
/// Two blocks with the same tokens (and the same LoRA adapter and cache salt) have the same local
/// hash wherever they appear. This is what a router computes for a query and what the index is
/// walked with.
///
/// ```
/// use kvatlas_hash::{BlockHasher, LocalBlockHash};
///
/// let hasher = BlockHasher::new(4)?;
/// let block = hasher.hash_block(&[1, 2, 3, 4]);
/// assert_eq!(block.get(), 0xcb38_e4d7_fb2d_ca5c); // Dynamo 1.6.1's value
///
/// // The same tokens after another block: the same local hash.
/// let locals: Vec<LocalBlockHash> = hasher.local_hashes(&[9, 9, 9, 9, 1, 2, 3, 4]).collect();
/// assert_eq!(locals[1], block);
/// assert_ne!(locals[0], block);
/// # Ok::<(), kvatlas_hash::HashError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct LocalBlockHash(u64);

impl LocalBlockHash {
    /// Wraps a raw value (for example one received over the wire).
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw 64-bit value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// Hashes token blocks exactly as NVIDIA Dynamo's `compute_block_hash_for_seq` does.
///
/// `local = XXH3-64(tokens as little-endian u32 bytes, seed)` with
/// `seed = 1337 + XXH3-64(lora_name, 0) + XXH3-64(cache_salt, 1)` (wrapping adds; an empty or
/// absent name or salt adds nothing).
///
/// A hasher is cheap to keep and to clone (about 500 bytes); build one per (block size, LoRA, salt)
/// and reuse it: the seed-derived XXH3 secret is computed once here rather than on every block.
///
/// ```
/// use kvatlas_hash::{BlockHasher, LocalBlockHash};
///
/// let tokens: Vec<u32> = (1..=10).collect(); // two full blocks of 4, and 2 tokens left over
/// let hasher = BlockHasher::new(4)?;
/// let locals: Vec<LocalBlockHash> = hasher.local_hashes(&tokens).collect();
/// assert_eq!(locals.len(), 2); // the partial block is not hashed
/// assert_eq!(locals[1].get(), 0xe8d3_ec39_b907_b74c); // Dynamo 1.6.1's value
/// assert_eq!(locals[1], hasher.hash_block(&tokens[4..8]));
///
/// // A LoRA adapter (or a cache salt) changes the seed, hence every local hash.
/// let lora = BlockHasher::new(4)?.with_lora_name("my-lora");
/// assert_eq!(lora.hash_block(&tokens[..4]).get(), 0xd97c_824a_0d4b_dab1);
/// let salted = BlockHasher::new(4)?.with_options(None, Some("tenant-a"));
/// assert_eq!(salted.hash_block(&tokens[..4]).get(), 0x4fa3_e809_7233_e995);
///
/// // Hashing many prompts without allocating: reuse one buffer.
/// let mut buffer = Vec::new();
/// hasher.extend_local_hashes(&tokens, &mut buffer);
/// assert_eq!(buffer, locals);
/// # Ok::<(), kvatlas_hash::HashError>(())
/// ```
#[derive(Clone)]
pub struct BlockHasher {
    block_size: BlockSize,
    seed: u64,
    /// `const_custom_default_secret(seed)`: what `xxh3_64_with_seed` derives for long inputs.
    long_input_secret: [u8; 192],
    /// Per-lane keys of the in-place mid-size path.
    mid_keys: xxh3_tokens::MidKeys,
}

impl std::fmt::Debug for BlockHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockHasher")
            .field("block_size", &self.block_size)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens with no LoRA adapter and no cache salt.
    ///
    /// # Errors
    /// [`HashError::InvalidBlockSize`] when `block_size` is 0 or above [`BlockSize::MAX`].
    pub fn new(block_size: u32) -> Result<Self, HashError> {
        Ok(Self::with_block_size(BlockSize::new(block_size)?))
    }

    /// A hasher for an already validated block size.
    pub fn with_block_size(block_size: BlockSize) -> Self {
        Self::from_parts(block_size, BASE_SEED)
    }

    fn from_parts(block_size: BlockSize, seed: u64) -> Self {
        Self {
            block_size,
            seed,
            long_input_secret: const_custom_default_secret(seed),
            mid_keys: xxh3_tokens::MidKeys::new(seed),
        }
    }

    /// Mixes a LoRA adapter name into the seed (Dynamo: `seed += XXH3-64(name, 0)`); empty = none.
    ///
    /// Call at most once per hasher: a second call mixes a second name in.
    #[must_use]
    pub fn with_lora_name(self, lora_name: &str) -> Self {
        if lora_name.is_empty() {
            return self;
        }
        let seed = self
            .seed
            .wrapping_add(xxh3_64_with_seed(lora_name.as_bytes(), 0));
        Self::from_parts(self.block_size, seed)
    }

    /// Mixes a cache salt (Dynamo's `cache_namespace`, the engines' `cache_salt`) into the seed
    /// (`seed += XXH3-64(salt, 1)`); empty = none.
    ///
    /// Call at most once per hasher: a second call mixes a second salt in.
    #[must_use]
    pub fn with_cache_salt(self, cache_salt: &str) -> Self {
        if cache_salt.is_empty() {
            return self;
        }
        let seed = self
            .seed
            .wrapping_add(xxh3_64_with_seed(cache_salt.as_bytes(), 1));
        Self::from_parts(self.block_size, seed)
    }

    /// Applies optional LoRA name and cache salt, the form engines' events carry them in.
    #[must_use]
    pub fn with_options(self, lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        self.with_lora_name(lora_name.unwrap_or_default())
            .with_cache_salt(cache_salt.unwrap_or_default())
    }

    /// The block size this hasher cuts sequences into.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// The effective XXH3 seed (base seed plus LoRA and salt contributions).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Hashes exactly the given tokens as one block, whatever their number.
    ///
    /// Use it when the block boundaries are already known (an engine event); use
    /// [`BlockHasher::local_hashes`] to cut a prompt into blocks.
    #[inline]
    pub fn hash_block(&self, tokens: &[TokenId]) -> LocalBlockHash {
        // 5..=60 tokens (block sizes 8, 16, 32, ...) are hashed in place; the other sizes go
        // through a byte buffer in out-of-line functions, so this hot path keeps a small stack
        // frame (an inlined 4 KiB buffer made every call pay for the frame).
        let hash = if (xxh3_tokens::MIN_TOKENS..=xxh3_tokens::MAX_TOKENS).contains(&tokens.len()) {
            xxh3_tokens::hash_mid(tokens, &self.mid_keys)
        } else {
            self.hash_block_buffered(tokens)
        };
        LocalBlockHash(hash)
    }

    /// Blocks outside the in-place range: lay the tokens out as bytes, then call `xxhash-rust`.
    #[inline(never)]
    fn hash_block_buffered(&self, tokens: &[TokenId]) -> u64 {
        match tokens.len() {
            0..xxh3_tokens::MIN_TOKENS => self.hash_via_buffer::<16>(tokens),
            xxh3_tokens::MIN_TOKENS..=128 => self.hash_via_buffer::<512>(tokens),
            129..=STACK_BUFFER_TOKENS => {
                self.hash_via_buffer::<{ STACK_BUFFER_TOKENS * 4 }>(tokens)
            }
            _ => {
                let mut state = Xxh3::with_seed(self.seed);
                let mut buffer = [0u8; STACK_BUFFER_TOKENS * 4];
                for chunk in tokens.chunks(STACK_BUFFER_TOKENS) {
                    state.update(write_le_bytes(chunk, &mut buffer));
                }
                state.digest()
            }
        }
    }

    /// Lays `tokens` out in an `N`-byte stack buffer and hashes them; `4 * tokens.len() <= N`.
    #[inline(always)]
    fn hash_via_buffer<const N: usize>(&self, tokens: &[TokenId]) -> u64 {
        let mut buffer = [0u8; N];
        self.hash_bytes(write_le_bytes(tokens, &mut buffer))
    }

    /// XXH3-64 of `bytes` with this hasher's seed; bit-identical to `xxh3_64_with_seed`.
    fn hash_bytes(&self, bytes: &[u8]) -> u64 {
        if bytes.len() <= XXH3_MID_SIZE_MAX {
            xxh3_64_with_seed(bytes, self.seed)
        } else {
            // For inputs above 240 bytes XXH3-with-seed *is* XXH3-with-secret over the secret
            // derived from the seed (the spec's `XXH3_hashLong_64b_withSeed`).
            xxh3_64_with_secret(bytes, &self.long_input_secret)
        }
    }

    /// The local hashes of every full block of `tokens`, lazily, without allocating.
    /// A trailing partial block is skipped.
    pub fn local_hashes<'a>(&'a self, tokens: &'a [TokenId]) -> LocalHashes<'a> {
        LocalHashes {
            hasher: self,
            blocks: tokens.chunks_exact(self.block_size.as_usize()),
        }
    }

    /// Appends the local hashes of every full block of `tokens` to `out` (reuse `out` across
    /// calls to hash many prompts without allocating).
    pub fn extend_local_hashes(&self, tokens: &[TokenId], out: &mut Vec<LocalBlockHash>) {
        // `chunks_exact().map()` is `TrustedLen`, so `extend` writes without per-item capacity
        // checks (the `LocalHashes` adapter cannot promise that on stable Rust).
        out.extend(
            tokens
                .chunks_exact(self.block_size.as_usize())
                .map(|block| self.hash_block(block)),
        );
    }
}

/// Writes `tokens` as little-endian bytes into the front of `buffer` and returns that part.
/// `buffer` must hold at least `4 * tokens.len()` bytes (callers size it so).
#[inline]
fn write_le_bytes<'b>(tokens: &[TokenId], buffer: &'b mut [u8]) -> &'b mut [u8] {
    let bytes = &mut buffer[..tokens.len() * 4];
    for (out, token) in bytes.chunks_exact_mut(4).zip(tokens) {
        out.copy_from_slice(&token.to_le_bytes());
    }
    bytes
}

/// Iterator over the local hashes of the full blocks of a token sequence; see
/// [`BlockHasher::local_hashes`].
#[derive(Debug, Clone)]
pub struct LocalHashes<'a> {
    hasher: &'a BlockHasher,
    blocks: std::slice::ChunksExact<'a, TokenId>,
}

impl Iterator for LocalHashes<'_> {
    type Item = LocalBlockHash;

    #[inline]
    fn next(&mut self) -> Option<LocalBlockHash> {
        self.blocks
            .next()
            .map(|block| self.hasher.hash_block(block))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for LocalHashes<'_> {}

impl DoubleEndedIterator for LocalHashes<'_> {
    fn next_back(&mut self) -> Option<LocalBlockHash> {
        self.blocks
            .next_back()
            .map(|block| self.hasher.hash_block(block))
    }
}

impl std::iter::FusedIterator for LocalHashes<'_> {}

/// Local hashes of every full block of `tokens` (no LoRA, no salt); convenience for
/// [`BlockHasher::local_hashes`].
///
/// # Errors
/// [`HashError::InvalidBlockSize`] for a block size of 0 or above [`BlockSize::MAX`].
pub fn compute_local_hashes(
    tokens: &[TokenId],
    block_size: u32,
) -> Result<Vec<LocalBlockHash>, HashError> {
    let hasher = BlockHasher::new(block_size)?;
    Ok(hasher.local_hashes(tokens).collect())
}
