//! The decoder itself: [`decode_batch`] and the tolerant serde visitors it drives, one per wire
//! shape (batch envelope, event, tag, key, scalar, hash and token lists, extra keys).

use std::fmt;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::msgpack::{RAW_ARRAY, RAW_STR, SliceDeserializer, raw_array};
use super::types::{
    BlockRemoved, BlockStored, DecodeError, Event, EventBatch, MAX_SKIPPED_KEPT, SaltSource,
    SkippedEvent,
};
use super::{MAX_DEPTH, MAX_PREALLOC, MAX_PREALLOC_BYTES, fast};
use crate::counters::Reason;

/// Decodes one batch payload (the third frame of a live message, or a replayed payload).
///
/// Accepts `[ts, events]`, `[ts, events, dp_rank]` (extra trailing elements ignored) and the map
/// form `{ts, events, data_parallel_rank | attn_dp_rank}`; `ts` may be a float or an int. Events
/// may be positional arrays or tagged maps, mixed freely. Bytes after the batch are ignored.
///
/// # Errors
/// A [`DecodeError`] when the payload is not msgpack or its envelope is malformed; a malformed
/// *event* never fails the batch (see [`EventBatch::skipped`]).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut de = SliceDeserializer::new(payload, MAX_DEPTH);
    let BatchOut(result) = BatchOut::deserialize(&mut de).map_err(DecodeError::msgpack)?;
    result
}

/// [`decode_batch`] on `rmp-serde`'s own deserializer, where the raw-array and raw-string hooks
/// do not exist: every token id, hash, key and tag goes through the visitors. The reference the
/// fast paths are tested against (unit tests, and the fuzz target under `cfg(fuzzing)`).
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub fn decode_batch_rmp_serde(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut de = rmp_serde::Deserializer::from_read_ref(payload);
    de.set_max_depth(MAX_DEPTH);
    let BatchOut(result) = BatchOut::deserialize(&mut de).map_err(DecodeError::msgpack)?;
    result
}

// ---------------------------------------------------------------------------------------------
// Tolerant building blocks.

/// Capacity to reserve for a sequence of `T` whose header claims `hint` elements.
fn cap<T>(hint: Option<usize>) -> usize {
    let per_element = std::mem::size_of::<T>().max(1);
    hint.unwrap_or(0)
        .min(MAX_PREALLOC)
        .min(MAX_PREALLOC_BYTES / per_element)
}

fn drain_seq<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<usize, A::Error> {
    let mut n = 0usize;
    while seq.next_element::<IgnoredAny>()?.is_some() {
        n = n.saturating_add(1);
    }
    Ok(n)
}

fn drain_map<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Engine hash from a `bin`: the last 8 bytes big-endian, left-padded with zeros when shorter.
pub(super) fn bin_hash(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .skip(bytes.len().saturating_sub(8))
        .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
}

/// Implements the listed `visit_*` kinds as "wrong type": the value is consumed and `$bad`
/// returned. Every visitor below uses it for the kinds it does not accept, so no wire value can
/// make a visitor fail (only malformed msgpack does).
macro_rules! tolerate {
    ($bad:expr; $($kind:ident),* $(,)?) => { $( tolerate!(@one $kind, $bad); )* };
    (@one bool, $bad:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> { Ok($bad) }
    };
    (@one i64, $bad:expr) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> { Ok($bad) }
    };
    (@one u64, $bad:expr) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> { Ok($bad) }
    };
    (@one f64, $bad:expr) => {
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> { Ok($bad) }
    };
    (@one str, $bad:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> { Ok($bad) }
    };
    (@one bytes, $bad:expr) => {
        fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Self::Value, E> { Ok($bad) }
    };
    (@one unit, $bad:expr) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> { Ok($bad) }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> { Ok($bad) }
    };
    (@one seq, $bad:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            drain_seq(&mut seq)?;
            Ok($bad)
        }
    };
    (@one map, $bad:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            drain_map(&mut map)?;
            Ok($bad)
        }
    };
    (@one newtype, $bad:expr) => {
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            IgnoredAny::deserialize(d)?;
            Ok($bad)
        }
    };
}

/// Marker for a value of the wrong type (already consumed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bad;

/// Any msgpack value, reduced to what scalar fields need.
#[derive(Debug, Clone, PartialEq)]
enum Scalar {
    Nil,
    Bool,
    Uint(u64),
    /// A negative integer.
    Neg(i64),
    Float(f64),
    Str(String),
    /// A `bin`, already reduced to an engine hash.
    Bin(u64),
    /// An array, map or ext (consumed).
    Compound,
}

impl Scalar {
    fn opt_str(self) -> Result<Option<String>, Bad> {
        match self {
            Scalar::Nil => Ok(None),
            Scalar::Str(s) => Ok(Some(s)),
            _ => Err(Bad),
        }
    }

    fn opt_uint(self) -> Result<Option<u64>, Bad> {
        match self {
            Scalar::Nil => Ok(None),
            Scalar::Uint(u) => Ok(Some(u)),
            _ => Err(Bad),
        }
    }

    fn opt_hash(self) -> Result<Option<u64>, Bad> {
        match self {
            Scalar::Nil => Ok(None),
            Scalar::Uint(u) | Scalar::Bin(u) => Ok(Some(u)),
            Scalar::Neg(i) => Ok(Some(i as u64)),
            _ => Err(Bad),
        }
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any msgpack value")
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Scalar, E> {
                Ok(Scalar::Bool)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(u64::try_from(v).map_or(Scalar::Neg(v), Scalar::Uint))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Uint(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar::Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar::Str(v.to_owned()))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Scalar, E> {
                Ok(Scalar::Bin(bin_hash(v)))
            }
            tolerate!(Scalar::Nil; unit);
            tolerate!(Scalar::Compound; seq, map, newtype);
        }
        d.deserialize_any(V)
    }
}

/// An event tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
    NotStr,
}

impl Tag {
    /// The tag a string's bytes name (`utf8`: whether they are valid UTF-8, checked only for
    /// an unknown tag).
    fn of(bytes: &[u8], utf8: impl FnOnce() -> bool) -> Self {
        match bytes {
            b"BlockStored" => Tag::Stored,
            b"BlockRemoved" => Tag::Removed,
            b"AllBlocksCleared" => Tag::Cleared,
            // A string that is not UTF-8 is offered as a bin, and a bin is not a tag.
            _ if utf8() => Tag::Unknown,
            _ => Tag::NotStr,
        }
    }
}

impl<'de> Deserialize<'de> for Tag {
    /// Through the raw-string hook ([`msgpack`](super::msgpack)) when the deserializer has it.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Hook;
        impl<'de> Visitor<'de> for Hook {
            type Value = Tag;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an event tag")
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Tag, D::Error> {
                d.deserialize_any(V)
            }
            /// A string's unchecked bytes.
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Tag, E> {
                Ok(Tag::of(v, || std::str::from_utf8(v).is_ok()))
            }
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Tag;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an event tag")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Tag, E> {
                Ok(Tag::of(v.as_bytes(), || true))
            }
            tolerate!(Tag::NotStr; bool, i64, u64, f64, bytes, unit, seq, map, newtype);
        }
        d.deserialize_newtype_struct(RAW_STR, Hook)
    }
}

/// A map key this crate knows (event, batch and metadata keys share one table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
    Ownership,
    SessionId,
    CacheSalt,
    Metadata,
    Ts,
    Events,
    DpRank,
    Other,
}

impl Key {
    /// The key a string's bytes name (bytes that are not UTF-8 name none).
    fn of(bytes: &[u8]) -> Self {
        match bytes {
            b"type" => Key::Type,
            b"block_hashes" => Key::BlockHashes,
            b"parent_block_hash" => Key::ParentBlockHash,
            b"token_ids" => Key::TokenIds,
            b"block_size" => Key::BlockSize,
            b"lora_id" => Key::LoraId,
            b"medium" => Key::Medium,
            b"lora_name" => Key::LoraName,
            b"extra_keys" => Key::ExtraKeys,
            b"group_idx" => Key::GroupIdx,
            b"kv_cache_spec_kind" => Key::KvCacheSpecKind,
            b"kv_cache_spec_sliding_window" => Key::KvCacheSpecSlidingWindow,
            b"locality" => Key::Locality,
            b"ownership" => Key::Ownership,
            b"session_id" => Key::SessionId,
            b"cache_salt" => Key::CacheSalt,
            b"metadata" => Key::Metadata,
            b"ts" => Key::Ts,
            b"events" => Key::Events,
            b"data_parallel_rank" | b"attn_dp_rank" => Key::DpRank,
            _ => Key::Other,
        }
    }
}

impl<'de> Deserialize<'de> for Key {
    /// Through the raw-string hook ([`msgpack`](super::msgpack)) when the deserializer has it:
    /// every known key is ASCII, so matching unchecked bytes gives what matching the checked
    /// string would.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Hook;
        impl<'de> Visitor<'de> for Hook {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map key")
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
                d.deserialize_any(V)
            }
            /// A string's unchecked bytes.
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Key, E> {
                Ok(Key::of(v))
            }
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key::of(v.as_bytes()))
            }
            tolerate!(Key::Other; bool, i64, u64, f64, bytes, unit, seq, map, newtype);
        }
        d.deserialize_newtype_struct(RAW_STR, Hook)
    }
}

/// One element of `block_hashes`.
struct HashItem(Option<u64>);

impl<'de> Deserialize<'de> for HashItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HashItem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block hash")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HashItem, E> {
                Ok(HashItem(Some(v as u64)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HashItem, E> {
                Ok(HashItem(Some(v)))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<HashItem, E> {
                Ok(HashItem(Some(bin_hash(v))))
            }
            tolerate!(HashItem(None); bool, f64, str, unit, seq, map, newtype);
        }
        d.deserialize_any(V)
    }
}

/// `block_hashes`: an array of hashes.
struct HashList(Result<Vec<u64>, Bad>);

impl<'de> Deserialize<'de> for HashList {
    /// Through the raw-array hook ([`msgpack`](super::msgpack)): [`fast::hashes`] when every
    /// element is an int or a `bin8`, else the visitor below.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Hook;
        impl<'de> Visitor<'de> for Hook {
            type Value = HashList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of block hashes")
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<HashList, D::Error> {
                d.deserialize_any(V)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, raw: A) -> Result<HashList, A::Error> {
                let fast = |bytes: &[u8], count| {
                    fast::hashes(bytes, count).map(|(hashes, used)| (HashList(Ok(hashes)), used))
                };
                raw_array(raw, fast, Slow(V))
            }
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HashList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of block hashes")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<HashList, A::Error> {
                let mut hashes = Vec::with_capacity(cap::<u64>(seq.size_hint()));
                let mut bad = false;
                while let Some(HashItem(item)) = seq.next_element()? {
                    match item {
                        Some(h) if !bad => hashes.push(h),
                        _ => bad = true,
                    }
                }
                Ok(HashList(if bad { Err(Bad) } else { Ok(hashes) }))
            }
            tolerate!(HashList(Err(Bad)); bool, i64, u64, f64, str, bytes, unit, map, newtype);
        }
        d.deserialize_newtype_struct(RAW_ARRAY, Hook)
    }
}

/// Deserializes with a visitor through `deserialize_any` (the slow side of the raw-array hook).
struct Slow<V>(V);

impl<'de, V: Visitor<'de>> DeserializeSeed<'de> for Slow<V> {
    type Value = V::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        d.deserialize_any(self.0)
    }
}

/// One element of `token_ids`: a token or an `[a, b]` pair.
enum TokenItem {
    Id(u32),
    Pair(u32, u32),
    Bad,
}

fn token_of(s: Option<Scalar>) -> Option<u32> {
    match s {
        Some(Scalar::Uint(u)) => u32::try_from(u).ok(),
        _ => None,
    }
}

impl<'de> Deserialize<'de> for TokenItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenItem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id or a pair of token ids")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenItem, E> {
                Ok(u32::try_from(v).map_or(TokenItem::Bad, TokenItem::Id))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenItem, E> {
                Ok(u32::try_from(v).map_or(TokenItem::Bad, TokenItem::Id))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TokenItem, A::Error> {
                let a = token_of(seq.next_element::<Scalar>()?);
                let b = token_of(seq.next_element::<Scalar>()?);
                let extra = drain_seq(&mut seq)?;
                Ok(match (a, b, extra) {
                    (Some(a), Some(b), 0) => TokenItem::Pair(a, b),
                    _ => TokenItem::Bad,
                })
            }
            tolerate!(TokenItem::Bad; bool, f64, str, bytes, unit, map, newtype);
        }
        d.deserialize_any(V)
    }
}

/// `token_ids`, flattened.
#[derive(Debug, Default)]
struct Tokens {
    ids: Vec<u32>,
    pairs: bool,
}

struct TokenList(Result<Tokens, Bad>);

impl<'de> Deserialize<'de> for TokenList {
    /// Through the raw-array hook ([`msgpack`](super::msgpack)): [`fast::token_ids`] when every
    /// element is an int in `0..=u32::MAX`, else (pairs, wrong types, out of range, truncated)
    /// the visitor below.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Hook;
        impl<'de> Visitor<'de> for Hook {
            type Value = TokenList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of token ids")
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<TokenList, D::Error> {
                d.deserialize_any(V)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, raw: A) -> Result<TokenList, A::Error> {
                let fast = |bytes: &[u8], count| {
                    fast::token_ids(bytes, count)
                        .map(|(ids, used)| (TokenList(Ok(Tokens { ids, pairs: false })), used))
                };
                raw_array(raw, fast, Slow(V))
            }
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of token ids")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TokenList, A::Error> {
                let mut ids = Vec::with_capacity(cap::<u32>(seq.size_hint()));
                let mut pairs: Option<bool> = None;
                let mut last_second = None;
                let mut bad = false;
                while let Some(item) = seq.next_element::<TokenItem>()? {
                    if bad {
                        continue;
                    }
                    match (item, pairs) {
                        (TokenItem::Id(t), None | Some(false)) => {
                            pairs = Some(false);
                            ids.push(t);
                        }
                        (TokenItem::Pair(a, b), None | Some(true)) => {
                            pairs = Some(true);
                            ids.push(a);
                            last_second = Some(b);
                        }
                        _ => bad = true,
                    }
                }
                if bad {
                    return Ok(TokenList(Err(Bad)));
                }
                ids.extend(last_second);
                Ok(TokenList(Ok(Tokens {
                    ids,
                    pairs: pairs == Some(true),
                })))
            }
            // nil: a tokenless store.
            tolerate!(TokenList(Ok(Tokens::default())); unit);
            tolerate!(TokenList(Err(Bad)); bool, i64, u64, f64, str, bytes, map, newtype);
        }
        d.deserialize_newtype_struct(RAW_ARRAY, Hook)
    }
}

/// Position 7 (a `lora_name` string or SGLang's `{cache_salt}` map) or the `metadata` key.
#[derive(Debug)]
enum LoraOrMeta {
    Nil,
    Lora(String),
    /// A metadata map, with its `cache_salt` if any.
    Meta(Option<String>),
    Bad,
}

impl<'de> Deserialize<'de> for LoraOrMeta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LoraOrMeta;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a LoRA name or a metadata map")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<LoraOrMeta, E> {
                Ok(LoraOrMeta::Lora(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LoraOrMeta, A::Error> {
                let mut salt = None;
                let mut bad = false;
                while let Some(key) = map.next_key::<Key>()? {
                    if key == Key::CacheSalt {
                        match map.next_value::<Scalar>()?.opt_str() {
                            Ok(s) => salt = s,
                            Err(Bad) => bad = true,
                        }
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(if bad {
                    LoraOrMeta::Bad
                } else {
                    LoraOrMeta::Meta(salt)
                })
            }
            tolerate!(LoraOrMeta::Nil; unit);
            tolerate!(LoraOrMeta::Bad; bool, i64, u64, f64, bytes, seq, newtype);
        }
        d.deserialize_any(V)
    }
}

/// What `extra_keys` tells the decoder.
#[derive(Debug, Default)]
struct ExtraInfo {
    /// A `"dynamo-cache-salt:"`-prefixed string in the first block's keys (prefix stripped).
    salt: Option<String>,
    /// Tuples (multimodal `(mm_id, offset)`) or bytes (prompt-embedding digests).
    non_token: bool,
}

/// The prefix Dynamo gives a cache salt it passes through vLLM's `extra_keys`.
const DYNAMO_SALT_PREFIX: &str = "dynamo-cache-salt:";

/// One item of one block's extra keys.
enum ExtraItem {
    Salt(String),
    NonToken,
    Plain,
}

impl<'de> Deserialize<'de> for ExtraItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ExtraItem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an extra key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ExtraItem, E> {
                Ok(match v.strip_prefix(DYNAMO_SALT_PREFIX) {
                    Some(salt) => ExtraItem::Salt(salt.to_owned()),
                    None => ExtraItem::Plain,
                })
            }
            tolerate!(ExtraItem::NonToken; bytes, seq, newtype);
            tolerate!(ExtraItem::Plain; bool, i64, u64, f64, unit, map);
        }
        d.deserialize_any(V)
    }
}

/// One block's extra keys: nil or a tuple of items.
struct ExtraBlock(ExtraInfo);

impl<'de> Deserialize<'de> for ExtraBlock {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ExtraBlock;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block's extra keys")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraBlock, A::Error> {
                let mut info = ExtraInfo::default();
                while let Some(item) = seq.next_element::<ExtraItem>()? {
                    match item {
                        ExtraItem::Salt(s) if info.salt.is_none() => info.salt = Some(s),
                        ExtraItem::NonToken => info.non_token = true,
                        _ => {}
                    }
                }
                Ok(ExtraBlock(info))
            }
            // A bare string (not a tuple): treat like a one-item tuple.
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ExtraBlock, E> {
                Ok(ExtraBlock(ExtraInfo {
                    salt: v.strip_prefix(DYNAMO_SALT_PREFIX).map(str::to_owned),
                    non_token: false,
                }))
            }
            tolerate!(ExtraBlock(ExtraInfo::default()); bool, i64, u64, f64, unit, map);
            tolerate!(ExtraBlock(ExtraInfo { salt: None, non_token: true }); bytes, newtype);
        }
        d.deserialize_any(V)
    }
}

/// `extra_keys`: nil or one entry per block.
struct ExtraKeys(Result<ExtraInfo, Bad>);

impl<'de> Deserialize<'de> for ExtraKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ExtraKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("per-block extra keys")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraKeys, A::Error> {
                let mut info = ExtraInfo::default();
                let mut first = true;
                while let Some(ExtraBlock(block)) = seq.next_element()? {
                    if first {
                        info.salt = block.salt;
                        first = false;
                    }
                    info.non_token |= block.non_token;
                }
                Ok(ExtraKeys(Ok(info)))
            }
            tolerate!(ExtraKeys(Ok(ExtraInfo::default())); unit);
            tolerate!(ExtraKeys(Err(Bad)); bool, i64, u64, f64, str, bytes, map, newtype);
        }
        d.deserialize_any(V)
    }
}

// ---------------------------------------------------------------------------------------------
// Events.

/// The fields of any event, as read (absent = `None`), before the tag decides what they mean.
#[derive(Default)]
struct Raw {
    tag: Option<Tag>,
    block_hashes: Option<Result<Vec<u64>, Bad>>,
    parent: Option<Scalar>,
    tokens: Option<Result<Tokens, Bad>>,
    block_size: Option<Scalar>,
    lora_id: Option<Scalar>,
    medium: Option<Scalar>,
    lora_name: Option<Scalar>,
    /// Positional element 7.
    position7: Option<LoraOrMeta>,
    /// The map layout's `metadata` key.
    metadata: Option<LoraOrMeta>,
    cache_salt: Option<Scalar>,
    extra_keys: Option<Result<ExtraInfo, Bad>>,
    group_idx: Option<Scalar>,
    kind: Option<Scalar>,
    sliding_window: Option<Scalar>,
    locality: Option<Scalar>,
    ownership: Option<Scalar>,
    session_id: Option<Scalar>,
}

type Skip = (Reason, &'static str);

fn malformed(detail: &'static str) -> Skip {
    (Reason::MalformedEvent, detail)
}

fn opt_str(field: Option<Scalar>, name: &'static str) -> Result<Option<String>, Skip> {
    field.map_or(Ok(None), |s| s.opt_str().map_err(|Bad| malformed(name)))
}

fn opt_uint(field: Option<Scalar>, name: &'static str) -> Result<Option<u64>, Skip> {
    field.map_or(Ok(None), |s| s.opt_uint().map_err(|Bad| malformed(name)))
}

fn non_empty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

impl Raw {
    fn finish(self) -> Result<Event, Skip> {
        match self.tag {
            None => Err(malformed("missing `type` tag")),
            Some(Tag::NotStr) => Err(malformed("event tag is not a string")),
            Some(Tag::Unknown) => Err((Reason::UnknownEventType, "unknown event tag")),
            Some(Tag::Cleared) => Ok(Event::AllBlocksCleared),
            Some(Tag::Removed) => self.finish_removed(),
            Some(Tag::Stored) => self.finish_stored(),
        }
    }

    fn hashes(&mut self) -> Result<Vec<u64>, Skip> {
        match self.block_hashes.take() {
            None => Err(malformed("missing `block_hashes`")),
            Some(Err(Bad)) => Err(malformed("`block_hashes` is not an array of ints or bins")),
            Some(Ok(h)) => Ok(h),
        }
    }

    fn finish_removed(mut self) -> Result<Event, Skip> {
        Ok(Event::BlockRemoved(BlockRemoved {
            block_hashes: self.hashes()?,
            medium: opt_str(self.medium, "`medium` is not a string")?,
            group_idx: opt_uint(self.group_idx, "`group_idx` is not an unsigned int")?,
            locality: opt_str(self.locality, "`locality` is not a string")?,
            ownership: opt_str(self.ownership, "`ownership` is not a string")?,
        }))
    }

    fn finish_stored(mut self) -> Result<Event, Skip> {
        let block_hashes = self.hashes()?;
        let tokens = match self.tokens {
            None => Tokens::default(),
            Some(Ok(t)) => t,
            Some(Err(Bad)) => return Err(malformed("`token_ids` is not an array of u32 or pairs")),
        };
        let has_tokens = !tokens.ids.is_empty();
        let parent_block_hash = match self.parent {
            None if has_tokens => return Err(malformed("missing `parent_block_hash`")),
            None => None,
            Some(s) => s
                .opt_hash()
                .map_err(|Bad| malformed("`parent_block_hash` is not an int, bin or nil"))?,
        };
        let block_size = match self.block_size {
            None | Some(Scalar::Nil) if has_tokens => {
                return Err(malformed("missing `block_size`"));
            }
            None | Some(Scalar::Nil) => None,
            Some(Scalar::Uint(u)) => {
                Some(u32::try_from(u).map_err(|_| malformed("`block_size` does not fit in u32"))?)
            }
            Some(_) => return Err(malformed("`block_size` is not an unsigned int")),
        };
        let mut lora_name = opt_str(self.lora_name, "`lora_name` is not a string")?;
        let mut position7_salt = None;
        match self.position7 {
            None | Some(LoraOrMeta::Nil) => {}
            Some(LoraOrMeta::Lora(name)) => {
                lora_name.get_or_insert(name);
            }
            Some(LoraOrMeta::Meta(salt)) => position7_salt = salt,
            Some(LoraOrMeta::Bad) => {
                return Err(malformed(
                    "position 7 is neither a LoRA name nor a metadata map",
                ));
            }
        }
        let metadata_salt = match self.metadata {
            None | Some(LoraOrMeta::Nil) => None,
            Some(LoraOrMeta::Meta(salt)) => salt,
            Some(LoraOrMeta::Lora(_) | LoraOrMeta::Bad) => {
                return Err(malformed(
                    "`metadata` is not a map with a string `cache_salt`",
                ));
            }
        };
        let extra = match self.extra_keys {
            None => ExtraInfo::default(),
            Some(Ok(info)) => info,
            Some(Err(Bad)) => return Err(malformed("`extra_keys` is not an array")),
        };
        let top_salt = opt_str(self.cache_salt, "`cache_salt` is not a string")?;
        let (cache_salt, salt_source) = [
            (top_salt, SaltSource::TopLevel),
            (metadata_salt, SaltSource::Metadata),
            (position7_salt, SaltSource::PositionalMetadata),
            (extra.salt, SaltSource::ExtraKeys),
        ]
        .into_iter()
        .find_map(|(salt, source)| non_empty(salt).map(|s| (Some(s), Some(source))))
        .unwrap_or((None, None));
        Ok(Event::BlockStored(Box::new(BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids: tokens.ids,
            pair_encoded: tokens.pairs,
            block_size,
            lora_id: opt_uint(self.lora_id, "`lora_id` is not an unsigned int")?,
            medium: opt_str(self.medium, "`medium` is not a string")?,
            lora_name: non_empty(lora_name),
            cache_salt,
            salt_source,
            non_token_extra_keys: extra.non_token,
            group_idx: opt_uint(self.group_idx, "`group_idx` is not an unsigned int")?,
            kv_cache_spec_kind: opt_str(self.kind, "`kv_cache_spec_kind` is not a string")?,
            kv_cache_spec_sliding_window: opt_uint(
                self.sliding_window,
                "`kv_cache_spec_sliding_window` is not an unsigned int",
            )?,
            locality: opt_str(self.locality, "`locality` is not a string")?,
            ownership: opt_str(self.ownership, "`ownership` is not a string")?,
            session_id: opt_str(self.session_id, "`session_id` is not a string")?,
        })))
    }
}

/// One element of `events`: decoded, or skipped with a reason (never a serde error).
struct EventElement(Result<Event, Skip>);

impl<'de> Deserialize<'de> for EventElement {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EventElement;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a KV event (array or map)")
            }

            /// Positional layout: the tag at [0], then fields in declaration order.
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventElement, A::Error> {
                let Some(tag) = seq.next_element::<Tag>()? else {
                    return Ok(EventElement(Err(malformed("empty event array"))));
                };
                let mut raw = Raw {
                    tag: Some(tag),
                    ..Raw::default()
                };
                match tag {
                    Tag::Stored => {
                        raw.block_hashes = seq.next_element::<HashList>()?.map(|h| h.0);
                        raw.parent = seq.next_element()?;
                        raw.tokens = seq.next_element::<TokenList>()?.map(|t| t.0);
                        raw.block_size = seq.next_element()?;
                        raw.lora_id = seq.next_element()?;
                        raw.medium = seq.next_element()?;
                        raw.position7 = seq.next_element()?;
                        raw.extra_keys = seq.next_element::<ExtraKeys>()?.map(|e| e.0);
                        raw.group_idx = seq.next_element()?;
                        raw.kind = seq.next_element()?;
                        raw.sliding_window = seq.next_element()?;
                        // Never emitted positionally by a release; Dynamo accepts them here.
                        raw.locality = seq.next_element()?;
                        raw.ownership = seq.next_element()?;
                    }
                    Tag::Removed => {
                        raw.block_hashes = seq.next_element::<HashList>()?.map(|h| h.0);
                        raw.medium = seq.next_element()?;
                        raw.group_idx = seq.next_element()?;
                    }
                    Tag::Cleared | Tag::Unknown | Tag::NotStr => {}
                }
                drain_seq(&mut seq)?;
                Ok(EventElement(raw.finish()))
            }

            /// Map layout: keys in any order, `type` decides at the end.
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventElement, A::Error> {
                let mut raw = Raw::default();
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Type => raw.tag = Some(map.next_value()?),
                        Key::BlockHashes => {
                            raw.block_hashes = Some(map.next_value::<HashList>()?.0);
                        }
                        Key::ParentBlockHash => raw.parent = Some(map.next_value()?),
                        Key::TokenIds => raw.tokens = Some(map.next_value::<TokenList>()?.0),
                        Key::BlockSize => raw.block_size = Some(map.next_value()?),
                        Key::LoraId => raw.lora_id = Some(map.next_value()?),
                        Key::Medium => raw.medium = Some(map.next_value()?),
                        Key::LoraName => raw.lora_name = Some(map.next_value()?),
                        Key::ExtraKeys => {
                            raw.extra_keys = Some(map.next_value::<ExtraKeys>()?.0);
                        }
                        Key::GroupIdx => raw.group_idx = Some(map.next_value()?),
                        Key::KvCacheSpecKind => raw.kind = Some(map.next_value()?),
                        Key::KvCacheSpecSlidingWindow => {
                            raw.sliding_window = Some(map.next_value()?);
                        }
                        Key::Locality => raw.locality = Some(map.next_value()?),
                        Key::Ownership => raw.ownership = Some(map.next_value()?),
                        Key::SessionId => raw.session_id = Some(map.next_value()?),
                        Key::CacheSalt => raw.cache_salt = Some(map.next_value()?),
                        Key::Metadata => raw.metadata = Some(map.next_value()?),
                        Key::Ts | Key::Events | Key::DpRank | Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(EventElement(raw.finish()))
            }

            tolerate!(EventElement(Err(malformed("event is not an array or a map")));
                bool, i64, u64, f64, str, bytes, unit, newtype);
        }
        d.deserialize_any(V)
    }
}

/// The `events` array.
struct Events(Result<Decoded, Bad>);

/// The `events` array decoded: the events, the skipped ones kept, those counted beyond.
type Decoded = (Vec<Event>, Vec<SkippedEvent>, Vec<(Reason, u64)>);

impl<'de> Deserialize<'de> for Events {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Events;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of events")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Events, A::Error> {
                let mut events = Vec::with_capacity(cap::<Event>(seq.size_hint()));
                let mut skipped = Vec::new();
                let mut beyond: Vec<(Reason, u64)> = Vec::new();
                let mut index = 0usize;
                while let Some(EventElement(slot)) = seq.next_element()? {
                    match slot {
                        Ok(event) => events.push(event),
                        Err((reason, detail)) if skipped.len() < MAX_SKIPPED_KEPT => {
                            skipped.push(SkippedEvent {
                                index,
                                reason,
                                detail,
                            });
                        }
                        Err((reason, _)) => match beyond.iter_mut().find(|(r, _)| *r == reason) {
                            Some((_, count)) => *count += 1,
                            None => beyond.push((reason, 1)),
                        },
                    }
                    index = index.saturating_add(1);
                }
                Ok(Events(Ok((events, skipped, beyond))))
            }
            tolerate!(Events(Err(Bad)); bool, i64, u64, f64, str, bytes, unit, map, newtype);
        }
        d.deserialize_any(V)
    }
}

/// The batch envelope.
struct BatchOut(Result<EventBatch, DecodeError>);

fn finish_batch(
    ts: Option<Scalar>,
    events: Option<Events>,
    rank: Option<Scalar>,
) -> Result<EventBatch, DecodeError> {
    let ts = match ts {
        None => return Err(DecodeError::MissingField("ts")),
        Some(Scalar::Float(f)) => f,
        #[allow(clippy::cast_precision_loss)]
        Some(Scalar::Uint(u)) => u as f64,
        #[allow(clippy::cast_precision_loss)]
        Some(Scalar::Neg(i)) => i as f64,
        Some(_) => return Err(DecodeError::InvalidField("ts")),
    };
    let (events, skipped, skipped_beyond) = match events {
        None => return Err(DecodeError::MissingField("events")),
        Some(Events(Err(Bad))) => return Err(DecodeError::InvalidField("events")),
        Some(Events(Ok(e))) => e,
    };
    let dp_rank = match rank {
        None | Some(Scalar::Nil) => None,
        Some(Scalar::Uint(u)) => {
            Some(u32::try_from(u).map_err(|_| DecodeError::DpRankOutOfRange(u))?)
        }
        Some(Scalar::Neg(i)) => return Err(DecodeError::NegativeDpRank(i)),
        Some(_) => return Err(DecodeError::InvalidField("dp_rank")),
    };
    Ok(EventBatch {
        ts,
        dp_rank,
        events,
        skipped,
        skipped_beyond,
    })
}

impl<'de> Deserialize<'de> for BatchOut {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BatchOut;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a KV event batch")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BatchOut, A::Error> {
                let ts = seq.next_element::<Scalar>()?;
                let events = seq.next_element::<Events>()?;
                let rank = seq.next_element::<Scalar>()?;
                drain_seq(&mut seq)?;
                if events.is_none() {
                    let len = usize::from(ts.is_some());
                    return Ok(BatchOut(Err(DecodeError::TooShort { len })));
                }
                Ok(BatchOut(finish_batch(ts, events, rank)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BatchOut, A::Error> {
                let (mut ts, mut events, mut rank) = (None, None, None);
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Ts => ts = Some(map.next_value()?),
                        Key::Events => events = Some(map.next_value()?),
                        Key::DpRank => rank = Some(map.next_value()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(BatchOut(finish_batch(ts, events, rank)))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<BatchOut, E> {
                Ok(not_a_batch("a bool"))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<BatchOut, E> {
                Ok(not_a_batch("an int"))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<BatchOut, E> {
                Ok(not_a_batch("an int"))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<BatchOut, E> {
                Ok(not_a_batch("a float"))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<BatchOut, E> {
                Ok(not_a_batch("a string"))
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<BatchOut, E> {
                Ok(not_a_batch("a bin"))
            }
            tolerate!(not_a_batch("nil"); unit);
            tolerate!(not_a_batch("an ext"); newtype);
        }
        d.deserialize_any(V)
    }
}

fn not_a_batch(found: &'static str) -> BatchOut {
    BatchOut(Err(DecodeError::NotABatch { found }))
}

#[cfg(test)]
mod tests;
