//! XXH3-64 over `u32` tokens for the mid-size inputs (17 ..= 240 bytes, i.e. 5 ..= 60 tokens),
//! reading token pairs directly instead of first copying the tokens out as bytes.
//!
//! Why this exists: `xxhash-rust` hashes `&[u8]`, and without `unsafe` a `&[u32]` can only become
//! bytes by copying. For a 16-token block the copy and buffer setup cost twice the hash itself
//! (measured in `benches/benches/hashing.rs`). XXH3's mid-size paths read the input in 16-byte
//! lanes at 4-byte-aligned offsets, so on whole tokens each lane is `t[i] | t[i+1] << 32` and
//! `t[i+2] | t[i+3] << 32` — the little-endian reading of the same bytes. This module is a
//! transcription of `XXH3_len_17to128_64b` and `XXH3_len_129to240_64b` from the XXH3
//! specification onto tokens; `tests/properties.rs` checks it bit for bit against `xxhash-rust`
//! for every length and random seeds. Shorter and longer inputs go through `xxhash-rust`.

use xxhash_rust::const_xxh3::const_custom_default_secret;

/// XXH3's built-in secret (the seed-0 custom secret is the default secret itself).
const DEFAULT_SECRET: [u8; 192] = const_custom_default_secret(0);
/// `XXH_PRIME64_1`.
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
/// `XXH3_SECRET_SIZE_MIN`.
const SECRET_SIZE_MIN: usize = 136;

/// Smallest and largest token counts handled here (17 ..= 240 bytes).
pub(crate) const MIN_TOKENS: usize = 5;
pub(crate) const MAX_TOKENS: usize = 60;

#[inline(always)]
const fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

fn secret_u64(offset: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&DEFAULT_SECRET[offset..offset + 8]);
    u64::from_le_bytes(word)
}

/// The `(secret_lo + seed, secret_hi - seed)` pairs every lane of the mid-size paths XORs into
/// its input, computed once per seed (keeping the per-lane work to two XORs and one multiply).
#[derive(Clone, Copy)]
pub(crate) struct MidKeys {
    /// Lanes at secret offsets 0, 16, …, 112 (both paths).
    aligned: [[u64; 2]; 8],
    /// Lanes 8.. of the 129..=240-byte path, at secret offsets 3, 19, …, 99.
    shifted: [[u64; 2]; 7],
    /// The last lane of the 129..=240-byte path, at secret offset 119.
    last: [u64; 2],
}

impl MidKeys {
    pub(crate) fn new(seed: u64) -> Self {
        let pair = |offset: usize| {
            [
                secret_u64(offset).wrapping_add(seed),
                secret_u64(offset + 8).wrapping_sub(seed),
            ]
        };
        Self {
            aligned: std::array::from_fn(|lane| pair(16 * lane)),
            shifted: std::array::from_fn(|lane| pair(16 * lane + START_OFFSET)),
            last: pair(SECRET_SIZE_MIN - LAST_OFFSET),
        }
    }
}

const START_OFFSET: usize = 3;
const LAST_OFFSET: usize = 17;

/// `XXH3_mix16B` on the 16 bytes made of tokens `t[at..at + 4]`.
#[inline(always)]
fn mix16(tokens: &[u32], at: usize, key: [u64; 2]) -> u64 {
    let Some(&[t0, t1, t2, t3]) = tokens.get(at..at + 4) else {
        // Callers pass `at + 4 <= tokens.len()`; this arm is unreachable.
        return 0;
    };
    let lo = (u64::from(t0) | (u64::from(t1) << 32)) ^ key[0];
    let hi = (u64::from(t2) | (u64::from(t3) << 32)) ^ key[1];
    let product = u128::from(lo) * u128::from(hi);
    (product as u64) ^ ((product >> 64) as u64)
}

/// XXH3-64 (with the seed `keys` were made for) of the little-endian bytes of `tokens`, for
/// `MIN_TOKENS <= tokens.len() <= MAX_TOKENS`.
#[inline]
pub(crate) fn hash_mid(tokens: &[u32], keys: &MidKeys) -> u64 {
    let n = tokens.len();
    debug_assert!((MIN_TOKENS..=MAX_TOKENS).contains(&n));
    let k = &keys.aligned;
    let mut acc = ((n * 4) as u64).wrapping_mul(PRIME64_1);
    if n <= 32 {
        // 17 ..= 128 bytes: pairs of lanes from both ends, working inwards.
        if n > 8 {
            if n > 16 {
                if n > 24 {
                    acc = acc.wrapping_add(mix16(tokens, 12, k[6]));
                    acc = acc.wrapping_add(mix16(tokens, n - 16, k[7]));
                }
                acc = acc.wrapping_add(mix16(tokens, 8, k[4]));
                acc = acc.wrapping_add(mix16(tokens, n - 12, k[5]));
            }
            acc = acc.wrapping_add(mix16(tokens, 4, k[2]));
            acc = acc.wrapping_add(mix16(tokens, n - 8, k[3]));
        }
        acc = acc.wrapping_add(mix16(tokens, 0, k[0]));
        acc = acc.wrapping_add(mix16(tokens, n - 4, k[1]));
        avalanche(acc)
    } else {
        // 129 ..= 240 bytes: eight lanes, avalanche, the remaining full lanes, the last lane.
        for (lane, key) in k.iter().enumerate() {
            acc = acc.wrapping_add(mix16(tokens, 4 * lane, *key));
        }
        acc = avalanche(acc);
        for (lane, key) in (8..n / 4).zip(&keys.shifted) {
            acc = acc.wrapping_add(mix16(tokens, 4 * lane, *key));
        }
        acc = acc.wrapping_add(mix16(tokens, n - 4, keys.last));
        avalanche(acc)
    }
}
