//! Fast paths for the two large integer arrays of a `BlockStored`: `token_ids` and
//! `block_hashes`.
//!
//! Both take the raw msgpack bytes that follow an array header (as handed out by the
//! deserializer's raw-array hook, [`super::msgpack::RAW_ARRAY`]) and the header's element count,
//! and return the decoded values with the number of bytes they used — or `None` as soon as an
//! element is anything they do not handle, in which case the caller decodes the whole array again
//! through the tolerant serde visitors. They therefore only ever *accept* arrays those visitors
//! would decode to exactly the same values, and leave every other case (pairs, wrong types,
//! out-of-range or negative token ids, truncated input) to them.
//!
//! Neither allocates more than the input justifies: a header claiming more elements than there
//! are bytes left is refused before anything is reserved (every element takes at least one
//! byte), so the output holds at most 4 (tokens) or 8 (hashes) bytes per input byte.

use super::visitors::bin_hash;

/// How one msgpack marker byte is decoded by [`token_ids`] (see [`TOKEN_TABLE`]).
#[derive(Debug, Clone, Copy)]
struct TokenMarker {
    /// Right shift of the 8 bytes after the marker (big-endian) that leaves the payload.
    shift: u32,
    /// `!0` when the value is in the payload, `0` for a positive fixint (the value is the
    /// marker itself).
    keep: u64,
    /// Marker bits that are the value: `0x7f` for a positive fixint, `0xff` for a marker this
    /// path does not handle (so the value is non-zero and hits `reject`), else `0`.
    fix: u64,
    /// Bits that must be clear for the value to be a token id: the top 32 bits (not a `u32`),
    /// the sign bit of a signed width, or everything for an unhandled marker.
    reject: u64,
}

/// Positive fixint, `uint8/16/32/64` and `int8/16/32/64`, indexed by marker byte.
///
/// A signed int is a token id when it is non-negative (the slow path's `visit_i64` →
/// `u32::try_from`); a 64-bit one also when it fits in 32 bits. Every other marker (negative
/// fixint, nil, floats, strings, arrays — the pair encoding —, maps, bins, exts, reserved)
/// rejects the array.
const TOKEN_TABLE: [TokenMarker; 256] = {
    const HIGH: u64 = 0xffff_ffff_0000_0000;
    let unhandled = TokenMarker {
        shift: 0,
        keep: 0,
        fix: 0xff,
        reject: !0,
    };
    let mut table = [unhandled; 256];
    let mut m = 0;
    while m < 0x80 {
        table[m] = TokenMarker {
            shift: 0,
            keep: 0,
            fix: 0x7f,
            reject: HIGH,
        };
        m += 1;
    }
    // (marker, payload bytes, sign bit of the payload or 0)
    let widths: [(usize, u32, u64); 8] = [
        (0xcc, 1, 0),
        (0xcd, 2, 0),
        (0xce, 4, 0),
        (0xcf, 8, 0),
        (0xd0, 1, 0x80),
        (0xd1, 2, 0x8000),
        (0xd2, 4, 0x8000_0000),
        // A negative int64 has its top bit set, which `HIGH` already rejects.
        (0xd3, 8, 0),
    ];
    let mut i = 0;
    while i < widths.len() {
        let (marker, bytes, sign) = widths[i];
        table[marker] = TokenMarker {
            shift: 64 - 8 * bytes,
            keep: !0,
            fix: 0,
            reject: HIGH | sign,
        };
        i += 1;
    }
    table
};

/// Decodes one element from a 9-byte window starting at its marker: `(value, reject bits,
/// encoded length)`. The value is a token id when `value & reject == 0`.
///
/// The length is computed rather than looked up, because it is the loop-carried dependency
/// (marker load → length → next marker load): a positive fixint takes 1 byte, and the
/// `0xcc..=0xd3` ints take 1 + 2^(marker & 3). Any other marker is rejected by the table, so its
/// (meaningless) length, between 1 and 9, only bounds how far the loop reads before it gives up.
#[inline(always)]
fn token_step(window: &[u8; 9]) -> (u64, u64, usize) {
    let [marker, payload @ ..] = *window;
    let entry = TOKEN_TABLE[usize::from(marker)];
    let value = ((u64::from_be_bytes(payload) >> entry.shift) & entry.keep)
        | (u64::from(marker) & entry.fix);
    let len = 1 + (usize::from(marker >> 7) << (marker & 3));
    (value, entry.reject, len)
}

/// Decodes `count` msgpack ints from the start of `bytes` into token ids, with the number of
/// bytes they take; `None` if any element is not an int in `0..=u32::MAX` or `bytes` ends first.
///
/// Branchless per element ([`token_step`]): one unaligned big-endian 8-byte load after the
/// marker, then shift and masks from a 256-entry table indexed by the marker (a `match` on the
/// marker mispredicts on about every other token of a real vocabulary, where 2- and 4-byte ids
/// mix at random). The last elements, whose 9-byte window would run past `bytes`, go through the
/// same step on a zero-padded copy.
pub(crate) fn token_ids(bytes: &[u8], count: usize) -> Option<(Vec<u32>, usize)> {
    if count > bytes.len() {
        return None;
    }
    // Zeroed up front so the loop writes through a slice: `push` would keep the vector's
    // fields in memory around its (never taken) grow call, on the loop's critical path.
    let mut ids = vec![0u32; count];
    let mut pos = 0usize;
    let mut rejected = 0u64;
    let mut done = 0usize;
    for id in &mut ids {
        let Some(window) = bytes.get(pos..).and_then(<[u8]>::first_chunk::<9>) else {
            break;
        };
        let (value, reject, len) = token_step(window);
        rejected |= value & reject;
        // Keeps the low 32 bits; an id with more is rejected above.
        *id = value as u32;
        pos += len;
        done += 1;
    }
    if rejected != 0 {
        return None;
    }
    for id in ids.get_mut(done..)? {
        let rest = bytes.get(pos..)?;
        let mut window = [0u8; 9];
        let available = rest.len().min(window.len());
        window
            .get_mut(..available)?
            .copy_from_slice(rest.get(..available)?);
        let (value, reject, len) = token_step(&window);
        if value & reject != 0 || len > rest.len() {
            return None;
        }
        *id = value as u32;
        pos += len;
    }
    Some((ids, pos))
}

/// Decodes `count` block hashes from the start of `bytes` (any msgpack int, as its 64-bit
/// two's-complement pattern, or a `bin8`, reduced by [`bin_hash`]), with the number of bytes
/// they take; `None` on any other element or if `bytes` ends first.
///
/// Hashes are one per block (1/16 of the tokens) and nearly always the same marker (`uint64`
/// or `bin8`), so a `match` predicts well here.
pub(crate) fn hashes(bytes: &[u8], count: usize) -> Option<(Vec<u64>, usize)> {
    if count > bytes.len() {
        return None;
    }
    let mut hashes = Vec::with_capacity(count);
    let mut rest = bytes;
    for _ in 0..count {
        let (&marker, tail) = rest.split_first()?;
        let (hash, tail) = match marker {
            0x00..=0x7f => (u64::from(marker), tail),
            0xcc => be::<1>(tail).map(|(b, t)| (u64::from(u8::from_be_bytes(b)), t))?,
            0xcd => be::<2>(tail).map(|(b, t)| (u64::from(u16::from_be_bytes(b)), t))?,
            0xce => be::<4>(tail).map(|(b, t)| (u64::from(u32::from_be_bytes(b)), t))?,
            0xcf => be::<8>(tail).map(|(b, t)| (u64::from_be_bytes(b), t))?,
            // Negative ints keep their two's-complement bit pattern (SGLang's signed hashes).
            0xd0 => be::<1>(tail).map(|(b, t)| (i64::from(i8::from_be_bytes(b)) as u64, t))?,
            0xd1 => be::<2>(tail).map(|(b, t)| (i64::from(i16::from_be_bytes(b)) as u64, t))?,
            0xd2 => be::<4>(tail).map(|(b, t)| (i64::from(i32::from_be_bytes(b)) as u64, t))?,
            0xd3 => be::<8>(tail).map(|(b, t)| (i64::from_be_bytes(b) as u64, t))?,
            0xe0..=0xff => (i64::from(marker as i8) as u64, tail),
            0xc4 => {
                let (&len, tail) = tail.split_first()?;
                let (bin, tail) = tail.split_at_checked(usize::from(len))?;
                (bin_hash(bin), tail)
            }
            _ => return None,
        };
        hashes.push(hash);
        rest = tail;
    }
    Some((hashes, bytes.len() - rest.len()))
}

/// The first `N` bytes of `bytes` and the rest.
#[inline(always)]
fn be<const N: usize>(bytes: &[u8]) -> Option<([u8; N], &[u8])> {
    bytes.split_first_chunk::<N>().map(|(b, t)| (*b, t))
}
