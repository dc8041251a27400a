//! Hand-written decoding and encoding of `QueryRequest`, the message both query RPCs carry:
//! prost's message for every input it accepts, and prost's bytes for every message.
//!
//! A prompt sent as token ids is a packed field of about a thousand varints. prost reads each
//! through its generic merge (a bounds-checked varint decode, a push, a length re-check), and
//! perf of `kvatlas serve` answering `QueryStream` with 1,024 token ids put that at over a quarter
//! of the server's CPU. Here the ids are counted first (one byte without its high bit ends each
//! varint), the vector is sized once, and the varints are read eight bytes at a time;
//! the small nested messages (`IndexSelector`, `QueryOptions`) are still prost's. A client
//! sending token ids (the service benchmark's load generator, a router that leaves hashing to
//! the server) writes them the same way: lengths summed in one pass, varints into a flat buffer.
//!
//! Only the canonical layout is read: each known field at most once with its wire type, the ids
//! packed in one run, the hashes packed in whole 8-byte words, the strings valid UTF-8, no
//! varint longer than five bytes inside the ids. Anything else — a repeated or unknown field,
//! unpacked ids, a long varint, a cut message — returns `None` and the caller decodes with
//! prost, which then decides (merges, or refuses with its error).
//!
//! Invariant (checked by the property tests below): for every input, [`decode`] returns prost's
//! message or defers to it; for every message, [`encode`] writes prost's bytes.

use std::any::{Any, TypeId};
use std::sync::atomic::AtomicUsize;

use prost::Message;
use prost::encoding::{encoded_len_varint, message};

use super::answers::{delimited, put_field, put_varint, varint};
use crate::v1::{IndexSelector, LocalHashes, QueryOptions, QueryRequest, TokenIds, query_request};

// Tags: field number << 3 | wire type (0 varint, 2 length-delimited).
const INDEX: u8 = 1 << 3 | 2;
const LORA_NAME: u8 = 2 << 3 | 2;
const CACHE_SALT: u8 = 3 << 3 | 2;
const TOKENS: u8 = 4 << 3 | 2;
const LOCAL_HASHES: u8 = 5 << 3 | 2;
const OPTIONS: u8 = 6 << 3 | 2;
const REQUEST_ID: u8 = 7 << 3;
/// The packed field inside `TokenIds` and `LocalHashes` (field 1, length-delimited).
const PACKED: u8 = 1 << 3 | 2;

/// The ids of a packed `repeated uint32`, as prost reads them (each varint truncated to 32
/// bits), or `None` for a varint over five bytes or one cut short.
fn packed_u32(bytes: &[u8]) -> Option<Vec<u32>> {
    // Every varint ends with the one byte of it below 0x80, so this counts them (exactly, for
    // input that decodes; a cut last varint is refused below).
    let count = bytes.iter().filter(|&&b| b < 0x80).count();
    let mut ids = Vec::with_capacity(count);
    let mut at = 0;
    // Eight bytes at a time while eight remain: the first byte below 0x80 ends the varint, and
    // its 7-bit groups are gathered without a branch per byte.
    while let Some(word) = bytes.get(at..at + 8) {
        let word = u64::from_le_bytes(word.try_into().ok()?);
        let ends = !word & 0x8080_8080_8080_8080;
        let len = ends.trailing_zeros() / 8 + 1;
        if len > 5 {
            // Longer than five bytes (or none ends here): prost's general varint rules apply.
            return None;
        }
        let kept = word & (u64::MAX >> (64 - 8 * len));
        let value = (kept & 0x7f)
            | ((kept >> 1) & (0x7f << 7))
            | ((kept >> 2) & (0x7f << 14))
            | ((kept >> 3) & (0x7f << 21))
            | ((kept >> 4) & (0x7f << 28));
        // A fifth byte carries bits 28..35, of which prost keeps 28..32 (`as u32`).
        ids.push(value as u32);
        at += len as usize;
    }
    // The last few: prost's varint, within the same five-byte bound.
    while at < bytes.len() {
        let from = at;
        let value = varint(bytes, &mut at)?;
        if at - from > 5 {
            return None;
        }
        ids.push(value as u32);
    }
    Some(ids)
}

/// A packed `repeated fixed64`: whole little-endian words, or `None`.
fn packed_u64(bytes: &[u8]) -> Option<Vec<u64>> {
    let words = bytes.chunks_exact(8);
    if !words.remainder().is_empty() {
        return None;
    }
    Some(
        words
            .map(|w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
            .collect(),
    )
}

/// The one packed field of a `TokenIds` or `LocalHashes` (empty when absent), or `None` if the
/// message holds anything else.
fn only_packed(bytes: &[u8]) -> Option<&[u8]> {
    if bytes.is_empty() {
        return Some(bytes);
    }
    let mut at = 1;
    if bytes[0] != PACKED {
        return None;
    }
    let field = delimited(bytes, &mut at)?;
    (at == bytes.len()).then_some(field)
}

fn string(bytes: &[u8]) -> Option<String> {
    std::str::from_utf8(bytes).ok().map(str::to_owned)
}

/// A nested message decoded on its own, if it holds only its known fields in their canonical
/// form (it encodes back to exactly its bytes); else `None`, and the whole request is left to
/// prost. A nested message decoded alone starts prost's recursion budget afresh, one level
/// more than within the request: unknown groups nested 100 deep were accepted here and refused
/// by prost.
fn nested<M: Message + Default>(bytes: &[u8]) -> Option<M> {
    let message = M::decode(bytes).ok()?;
    (message.encoded_len() == bytes.len()).then_some(message)
}

/// A `QueryRequest` in the canonical layout, with at most `keep` of its token ids.
fn decode_request(bytes: &[u8], keep: usize) -> Option<QueryRequest> {
    let mut r = QueryRequest::default();
    // Fields seen (bit = field number): a second occurrence is prost's to merge.
    let mut seen = 0u8;
    let mut at = 0;
    while at < bytes.len() {
        let tag = bytes[at];
        at += 1;
        // Field numbers 1..=7 (a tag byte of 0x80 or more starts a longer field number).
        let field = tag >> 3;
        if !(1..=7).contains(&field) || seen & (1 << field) != 0 {
            return None;
        }
        seen |= 1 << field;
        match tag {
            INDEX => r.index = Some(nested::<IndexSelector>(delimited(bytes, &mut at)?)?),
            LORA_NAME => r.lora_name = string(delimited(bytes, &mut at)?)?,
            CACHE_SALT => r.cache_salt = string(delimited(bytes, &mut at)?)?,
            // The two inputs are a oneof: with both present the last wins, left to prost.
            TOKENS if r.input.is_none() => {
                let packed = only_packed(delimited(bytes, &mut at)?)?;
                let ids = packed_u32(first_varints(packed, keep))?;
                r.input = Some(query_request::Input::Tokens(TokenIds { ids }));
            }
            LOCAL_HASHES if r.input.is_none() => {
                let hashes = packed_u64(only_packed(delimited(bytes, &mut at)?)?)?;
                r.input = Some(query_request::Input::LocalHashes(LocalHashes { hashes }));
            }
            OPTIONS => r.options = Some(nested::<QueryOptions>(delimited(bytes, &mut at)?)?),
            REQUEST_ID => r.request_id = varint(bytes, &mut at)?,
            _ => return None,
        }
    }
    Some(r)
}

/// The most token ids a `QueryRequest` is decoded with (0: no bound); see
/// [`super::bound_token_ids`].
pub(super) static MAX_TOKEN_IDS: AtomicUsize = AtomicUsize::new(0);

/// Deepest nesting of groups skipped when counting (prost refuses more than 100).
const GROUP_DEPTH: usize = 128;

/// Skips the value of a field whose key is `key`, groups included (up to the end-group key of
/// the same field number, nested ones within), as prost skips an unknown field; `None` where
/// prost errs too (a value cut short, a wire type 4, 6 or 7 out of place, an end-group key of
/// another field) or nesting deeper than [`GROUP_DEPTH`] (prost errs before).
pub(super) fn skip(bytes: &[u8], at: &mut usize, key: u64) -> Option<()> {
    let fixed = |at: &mut usize, width: usize| {
        *at = at.checked_add(width).filter(|&end| end <= bytes.len())?;
        Some(())
    };
    let mut open: Vec<u64> = Vec::new();
    let mut key = key;
    loop {
        match key & 7 {
            0 => varint(bytes, at).map(drop)?,
            1 => fixed(at, 8)?,
            2 => delimited(bytes, at).map(drop)?,
            5 => fixed(at, 4)?,
            3 if open.len() < GROUP_DEPTH => open.push(key >> 3),
            4 if open.last() == Some(&(key >> 3)) => {
                open.pop();
            }
            _ => return None,
        }
        if open.is_empty() {
            return Some(());
        }
        key = varint(bytes, at)?;
    }
}

/// How many varints prost reads from the packed run `run`: one per byte below 0x80 (each ends
/// a varint), and one more if the last byte continues a varint, which prost reads on from the
/// rest of the message and keeps before it errs.
pub(super) fn varints_read(run: &[u8]) -> usize {
    let straddling = run.last().is_some_and(|&b| b >= 0x80);
    run.iter().filter(|&&b| b < 0x80).count() + usize::from(straddling)
}

/// How many token ids prost decodes from a `QueryRequest`'s bytes, at most, counted without
/// decoding them: every `tokens` field (prost merges repeated ones; a non-canonical message
/// naming another input in between is counted whole too), a packed run by its varints' last
/// bytes (and one more if its last byte continues a varint), an unpacked id as one, unknown
/// fields and groups skipped as prost skips them. Where the bytes stop being fields, prost
/// stops with an error, and so does the count — after what prost decoded first: prost checks
/// a nested field's length against the rest of the whole message, not of the message holding
/// it, so a run may go past the end of its `TokenIds` (prost decodes it, then errs), and it is
/// counted as read from the whole message too.
pub(super) fn count_token_ids(bytes: &[u8]) -> usize {
    let mut count = 0usize;
    let mut at = 0;
    while at < bytes.len() {
        let Some(key) = varint(bytes, &mut at) else {
            break;
        };
        if key != u64::from(TOKENS) {
            if skip(bytes, &mut at, key).is_none() {
                break;
            }
            continue;
        }
        let Some(end) = varint(bytes, &mut at)
            .and_then(|len| usize::try_from(len).ok())
            .and_then(|len| at.checked_add(len))
            .filter(|&end| end <= bytes.len())
        else {
            break;
        };
        // The `TokenIds` fields, each read from the whole message.
        while at < end {
            let Some(key) = varint(bytes, &mut at) else {
                return count;
            };
            if key == u64::from(PACKED) {
                let Some(run) = delimited(bytes, &mut at) else {
                    return count;
                };
                count += varints_read(run);
            } else if key == u64::from(PACKED & !7) {
                count += 1;
                if varint(bytes, &mut at).is_none() {
                    return count;
                }
            } else if skip(bytes, &mut at, key).is_none() {
                return count;
            }
        }
        if at != end {
            // A field ran past the end of its `TokenIds`: prost errs here.
            return count;
        }
    }
    count
}

/// The token ids `bytes` carry when `U` is `QueryRequest` and they are more than `bound` (0: no
/// bound). A message of n bytes carries at most n ids, so a message no longer than the bound
/// is not counted.
pub(super) fn over_bound<U: Any>(bytes: &[u8], bound: usize) -> Option<usize> {
    // The type first: a constant, so other messages (PublishEvents) skip the rest.
    if TypeId::of::<U>() != TypeId::of::<QueryRequest>() || bound == 0 || bytes.len() <= bound {
        return None;
    }
    Some(count_token_ids(bytes)).filter(|&count| count > bound)
}

/// `bytes` decoded as `U` as [`decode`] does, keeping only the first `keep` token ids: a query
/// over the bound is handed on cut (the server refuses it as it refuses any query over its
/// limit: on a stream, that query alone). `None` where [`decode`] defers to prost.
pub(super) fn decode_cut<U: Any>(bytes: &[u8], keep: usize) -> Option<U> {
    let mut slot: Option<U> = None;
    if let Some(slot) = (&mut slot as &mut dyn Any).downcast_mut::<Option<QueryRequest>>() {
        *slot = decode_request(bytes, keep);
    }
    slot
}

/// `packed` cut after its `keep`-th varint (whole if it holds no more: with a varint cut off
/// at its end, the whole run is refused as prost refuses it, not cut to nothing).
fn first_varints(packed: &[u8], keep: usize) -> &[u8] {
    if keep == 0 {
        return &packed[..0];
    }
    if packed.len() <= keep {
        // Each varint takes at least a byte: no more than `keep` of them.
        return packed;
    }
    packed
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b < 0x80)
        .nth(keep - 1)
        .map_or(packed, |(end, _)| &packed[..=end])
}

/// `bytes` decoded as `U` if `U` is `QueryRequest` and `bytes` have the canonical layout;
/// `None` otherwise (the caller decodes with prost, which then decides).
pub(crate) fn decode<U: Any>(bytes: &[u8]) -> Option<U> {
    let mut slot: Option<U> = None;
    if let Some(slot) = (&mut slot as &mut dyn Any).downcast_mut::<Option<QueryRequest>>() {
        *slot = decode_request(bytes, usize::MAX);
    }
    slot
}

/// A proto3 string field: omitted when empty.
fn put_string(out: &mut Vec<u8>, tag: u8, text: &str) {
    if !text.is_empty() {
        out.push(tag);
        put_varint(out, text.len() as u64);
        out.extend_from_slice(text.as_bytes());
    }
}

/// A `TokenIds` or `LocalHashes` input under `tag`: its one packed field of `packed` bytes, which
/// `write` appends (prost writes no packed field for an empty list, and the input stays present).
fn put_packed(out: &mut Vec<u8>, tag: u8, packed: usize, write: impl FnOnce(&mut Vec<u8>)) {
    out.push(tag);
    if packed == 0 {
        out.push(0);
        return;
    }
    put_varint(out, (1 + encoded_len_varint(packed as u64) + packed) as u64);
    out.push(PACKED);
    put_varint(out, packed as u64);
    out.reserve(packed);
    write(out);
}

fn encode_request(r: &QueryRequest, out: &mut Vec<u8>) {
    if let Some(index) = &r.index {
        message::encode(u32::from(INDEX >> 3), index, out);
    }
    put_string(out, LORA_NAME, &r.lora_name);
    put_string(out, CACHE_SALT, &r.cache_salt);
    match &r.input {
        Some(query_request::Input::Tokens(TokenIds { ids })) => {
            let packed = ids
                .iter()
                .map(|&id| encoded_len_varint(u64::from(id)))
                .sum();
            put_packed(out, TOKENS, packed, |out| {
                for &id in ids {
                    put_varint(out, u64::from(id));
                }
            });
        }
        Some(query_request::Input::LocalHashes(LocalHashes { hashes })) => {
            put_packed(out, LOCAL_HASHES, hashes.len() * 8, |out| {
                for &hash in hashes {
                    out.extend_from_slice(&hash.to_le_bytes());
                }
            });
        }
        None => {}
    }
    if let Some(options) = &r.options {
        message::encode(u32::from(OPTIONS >> 3), options, out);
    }
    put_field(out, REQUEST_ID, r.request_id);
}

/// Appends `request`'s protobuf encoding to the empty `out` if it is a `QueryRequest` and
/// returns where it starts (always 0, as [`super::answers::encode`] reports it); `None`
/// otherwise (the caller encodes it with prost).
pub(crate) fn encode<T: Any>(request: &T, out: &mut Vec<u8>) -> Option<usize> {
    let request = (request as &dyn Any).downcast_ref::<QueryRequest>()?;
    encode_request(request, out);
    Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), "[a-z0-9/_-]{1,12}", "\\PC{0,4}"]
    }

    fn any_request() -> impl Strategy<Value = QueryRequest> {
        // Token ids of every varint length, the extremes included.
        let id = prop_oneof![0u32..128, 128u32..16_384, any::<u32>(), Just(u32::MAX)];
        let input = prop_oneof![
            Just(None),
            proptest::collection::vec(id, 0..300)
                .prop_map(|ids| Some(query_request::Input::Tokens(TokenIds { ids }))),
            proptest::collection::vec(any::<u64>(), 0..80)
                .prop_map(|hashes| Some(query_request::Input::LocalHashes(LocalHashes { hashes }))),
        ];
        let index = proptest::option::of((any_text(), any_text()))
            .prop_map(|s| s.map(|(model, tenant)| IndexSelector { model, tenant }));
        let options = proptest::option::of((
            any::<bool>(),
            any::<u32>(),
            any::<u32>(),
            proptest::collection::vec(any::<u64>(), 0..4),
            any::<bool>(),
        ))
        .prop_map(|o| {
            o.map(
                |(early_exit, top_k, min_blocks, instance_ids, device_only)| QueryOptions {
                    early_exit,
                    top_k,
                    min_blocks,
                    instance_ids,
                    device_only,
                },
            )
        });
        (
            index,
            any_text(),
            any_text(),
            input,
            options,
            prop_oneof![Just(0u64), any::<u64>()],
        )
            .prop_map(
                |(index, lora_name, cache_salt, input, options, request_id)| QueryRequest {
                    index,
                    lora_name,
                    cache_salt,
                    input,
                    options,
                    request_id,
                },
            )
    }

    /// What the codec does: this module's message, else prost's.
    fn decoded(bytes: &[u8]) -> Result<QueryRequest, prost::DecodeError> {
        decode::<QueryRequest>(bytes).map_or_else(|| QueryRequest::decode(bytes), Ok)
    }

    proptest! {
        /// Any request is written as prost writes it, and prost's encoding is read here, not
        /// deferred, as prost reads it.
        #[test]
        fn requests_encode_and_decode_as_prost_does(request in any_request()) {
            let bytes = request.encode_to_vec();
            let mut ours = Vec::new();
            prop_assert_eq!(encode(&request, &mut ours), Some(0));
            prop_assert_eq!(&ours, &bytes);
            prop_assert_eq!(decode::<QueryRequest>(&bytes), Some(request.clone()));
            let ids = match &request.input {
                Some(query_request::Input::Tokens(tokens)) => tokens.ids.len(),
                _ => 0,
            };
            prop_assert_eq!(count_token_ids(&bytes), ids);
        }

        /// Any bytes — valid requests altered, cut or extended, and noise — decode as prost
        /// decodes them (the same message, or an error where prost errs).
        #[test]
        fn any_bytes_decode_as_prost_decodes_them(
            request in any_request(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
            cut in any::<prop::sample::Index>(),
            tail in proptest::collection::vec(any::<u8>(), 0..6),
        ) {
            let bytes = crate::codec::altered(request.encode_to_vec(), &flips, cut, &tail);
            prop_assert_eq!(decoded(&bytes).ok(), QueryRequest::decode(&bytes[..]).ok());
            // Counted before decoding (network input): any bytes, no panic, at most a count a byte.
            prop_assert!(count_token_ids(&bytes) <= bytes.len() + 1);
            // The count before decoding is never below the ids decoded (it bounds their memory).
            if let Ok(QueryRequest { input: Some(query_request::Input::Tokens(t)), .. }) =
                decoded(&bytes)
            {
                let n = count_token_ids(&bytes);
                prop_assert!(n >= t.ids.len(), "{} counted, {} decoded", n, t.ids.len());
            }
        }
    }

    /// An unknown group nested 100 deep in the request's index selector: prost refuses it
    /// (its recursion limit, counted from the request), and so does the codec, which leaves a
    /// nested message with unknown fields to prost (decoded alone, it was accepted).
    #[test]
    fn nested_groups_as_deep_as_prost_refuses_are_left_to_it() {
        let mut bytes = vec![0x0A, 0xCB, 0x01, 0x0A, 0x01, b'm'];
        bytes.extend(std::iter::repeat_n(0x1B, 100));
        bytes.extend(std::iter::repeat_n(0x1C, 100));
        bytes.extend([0x22, 0x00]);
        assert!(
            QueryRequest::decode(&bytes[..]).is_err(),
            "prost refuses it"
        );
        assert_eq!(decode::<QueryRequest>(&bytes), None, "left to prost");
        assert!(decoded(&bytes).is_err());
    }

    #[test]
    fn layouts_prost_merges_or_refuses_are_left_to_it() {
        let tokens = |ids: Vec<u32>| QueryRequest {
            input: Some(query_request::Input::Tokens(TokenIds { ids })),
            ..QueryRequest::default()
        };
        // Two prompts in one message: prost merges them (the packed ids concatenate).
        let one = tokens(vec![1, 2, 3]).encode_to_vec();
        let twice = [&one[..], &one[..]].concat();
        assert_eq!(decode::<QueryRequest>(&twice), None);
        assert_eq!(decoded(&twice), Ok(tokens(vec![1, 2, 3, 1, 2, 3])));
        // Unpacked ids (each its own field, wire type 0) are valid protobuf: prost reads them.
        let unpacked = [TOKENS, 4, 1 << 3, 7, 1 << 3, 9];
        assert_eq!(decode::<QueryRequest>(&unpacked), None);
        assert_eq!(decoded(&unpacked), Ok(tokens(vec![7, 9])));
        // A six-byte varint id: prost truncates it to 32 bits.
        let long = [TOKENS, 8, PACKED, 6, 0x81, 0x80, 0x80, 0x80, 0x80, 0x00];
        assert_eq!(decode::<QueryRequest>(&long), None);
        assert_eq!(decoded(&long), Ok(tokens(vec![1])));
        // A cut id and hashes that are not whole words: prost refuses them, and so does the codec.
        for bad in [
            &[TOKENS, 3, PACKED, 1, 0x80][..],
            &[LOCAL_HASHES, 5, PACKED, 3, 1, 2, 3],
        ] {
            assert_eq!(decode::<QueryRequest>(bad), None);
            assert!(QueryRequest::decode(bad).is_err());
        }
        // Other messages are prost's.
        assert_eq!(decode::<TokenIds>(&one), None);
        assert_eq!(encode(&TokenIds::default(), &mut Vec::new()), None);
    }

    /// Token ids are counted in every layout prost reads — repeated prompts, unpacked ids,
    /// unknown fields and groups (nested, and inside the ids' message) around them — up to
    /// where prost stops; a request over the bound is cut to `bound + 1` ids, one at the bound
    /// is not, and other messages are never counted.
    #[test]
    fn token_ids_over_the_bound_are_counted_and_cut_before_decoding() {
        let tokens = |ids: Vec<u32>| QueryRequest {
            index: Some(IndexSelector {
                model: "m".into(),
                tenant: String::new(),
            }),
            input: Some(query_request::Input::Tokens(TokenIds { ids })),
            request_id: 9,
            ..QueryRequest::default()
        };
        let ids: Vec<u32> = (0..300).collect();
        let one = tokens(ids).encode_to_vec();
        assert_eq!(count_token_ids(&one), 300);
        let twice = [&one[..], &one[..]].concat();
        assert_eq!(count_token_ids(&twice), 600);
        let unpacked = [TOKENS, 5, 1 << 3, 7, 1 << 3, 0x80, 1];
        assert_eq!(count_token_ids(&unpacked), 2);
        assert_eq!(count_token_ids(&[TOKENS, 3, PACKED, 1]), 0, "cut short");
        // Groups prost skips: an empty one of field 8, one nesting another with a varint, one
        // inside the ids' message, and an unknown fixed64 field.
        let groups = [
            &[8 << 3 | 3, 8 << 3 | 4][..],
            &[9 << 3 | 3, 10 << 3 | 3, 1 << 3, 5, 10 << 3 | 4, 9 << 3 | 4],
            &[TOKENS, 4, 2 << 3 | 3, 2 << 3 | 4, 1 << 3, 7],
            &[11 << 3 | 1, 1, 2, 3, 4, 5, 6, 7, 8],
            &one,
        ]
        .concat();
        let prost = QueryRequest::decode(&groups[..]).expect("prost skips groups");
        assert!(
            matches!(&prost.input, Some(query_request::Input::Tokens(t)) if t.ids.len() == 301)
        );
        assert_eq!(count_token_ids(&groups), 301);
        // A run longer than its `TokenIds` but within the message: prost decodes its 1,000
        // ids from the whole message, then errs (the enclosing length is exceeded).
        let mut past_the_end = vec![TOKENS, 5, PACKED];
        put_varint(&mut past_the_end, 1_000);
        past_the_end.resize(past_the_end.len() + 1_000, 1);
        assert!(QueryRequest::decode(&past_the_end[..]).is_err());
        assert_eq!(count_token_ids(&past_the_end), 1_000);
        // A varint whose last byte lies past its run: prost decodes it too.
        let straddling = [TOKENS, 5, PACKED, 2, 1, 0x81, 0x01];
        assert!(QueryRequest::decode(&straddling[..]).is_err());
        assert_eq!(count_token_ids(&straddling), 2);
        // Where prost stops with an error, after 300 ids, so does the count.
        let then_garbage = [&one[..], &[12 << 3 | 4], &one[..]].concat();
        assert!(QueryRequest::decode(&then_garbage[..]).is_err());
        assert_eq!(count_token_ids(&then_garbage), 300);

        assert_eq!(over_bound::<QueryRequest>(&one, 299), Some(300));
        assert_eq!(over_bound::<QueryRequest>(&one, 300), None);
        assert_eq!(over_bound::<QueryRequest>(&one, 0), None, "no bound");
        assert_eq!(over_bound::<TokenIds>(&one, 1), None, "not a QueryRequest");
        let cut = decode_cut::<QueryRequest>(&one, 100).expect("canonical");
        assert_eq!(
            cut,
            tokens((0..100).collect()),
            "the first 100, the rest as sent"
        );
        assert_eq!(
            decode_cut::<QueryRequest>(&one, 300),
            Some(tokens((0..300).collect()))
        );
        assert_eq!(
            decode_cut::<QueryRequest>(&twice, 100),
            None,
            "prost's layout"
        );
        assert_eq!(decode_cut::<TokenIds>(&one, 100), None);
        // Four whole ids and one cut off at the run's end, over a bound of 4 (kept: 5): prost
        // refuses it, and so does the cut (it was cut to no ids at all, and answered).
        let cut_off = [
            0x0a, 3, 0x0a, 1, b'm', TOKENS, 8, PACKED, 6, 1, 1, 1, 0x81, 0x01, 0x80,
        ];
        assert!(QueryRequest::decode(&cut_off[..]).is_err());
        assert_eq!(count_token_ids(&cut_off), 5);
        assert_eq!(
            decode_cut::<QueryRequest>(&cut_off, 5),
            None,
            "left to prost"
        );
    }

    #[test]
    fn a_fifth_byte_keeps_the_bits_prost_keeps() {
        // u32::MAX and a five-byte varint with bits above 32 set (prost truncates with `as u32`).
        for bytes in [
            [0xff, 0xff, 0xff, 0xff, 0x0f],
            [0xff, 0xff, 0xff, 0xff, 0x7f],
        ] {
            let message = [&[TOKENS, 7, PACKED, 5][..], &bytes].concat();
            assert_eq!(
                decode::<QueryRequest>(&message),
                QueryRequest::decode(&message[..]).ok()
            );
        }
    }
}
