//! Hand-written encoding and decoding of the query answers (`QueryResponse` and a
//! `QueryStreamResponse` holding one), byte for byte what prost writes and reads.
//!
//! An answer lists every worker rank holding the prompt's first block — often the whole fleet, a
//! hundred or more `WorkerMatch` messages of seven small integers each. prost computes each
//! nested message's length twice on the way out (once for the total, once for its own prefix)
//! and writes varints a byte at a time through a generic buffer; on the way in it decodes each
//! field through a generic merge. At hundreds of thousands of answers per second that was a
//! quarter of the server's CPU and as much of a Rust router's. Here:
//!
//! - **Encoding** writes each match in one pass: a `WorkerMatch` is at most 57 bytes (7 tags,
//!   three 10-byte and four 5-byte varints), so its length prefix is always one byte, written
//!   as a placeholder and filled in after the fields.
//! - **Decoding** reads the canonical layout (known fields with their wire types, each nested
//!   answer once) directly; anything else — an unknown field, another wire type, a varint prost
//!   would refuse, a `QueryError` outcome — returns `None` and the caller decodes with prost, so
//!   every input is answered exactly as prost answers it.
//!
//! Invariant (checked by the property tests below): for every message, [`encode`] writes
//! prost's bytes, and for every input, [`decode`] returns prost's message or defers to it.

use std::any::Any;

use crate::v1::{QueryResponse, QueryStreamResponse, WorkerMatch, query_stream_response};

/// The largest encoded `WorkerMatch`: seven one-byte tags, three u64 and four u32 varints.
const MAX_MATCH_BYTES: usize = 7 + 3 * 10 + 4 * 5;
const _: () = assert!(
    MAX_MATCH_BYTES < 0x80,
    "a match's length prefix is one byte"
);

// Tags: field number << 3 | wire type (0 varint, 2 length-delimited).
const MATCHES: u8 = 1 << 3 | 2;
const BLOCK_SIZE: u8 = 2 << 3;
const QUERY_BLOCKS: u8 = 3 << 3;
const LAST_EVENT: u8 = 4 << 3;
const EVENTS_APPLIED: u8 = 5 << 3;
const REQUEST_ID: u8 = 1 << 3;
const RESPONSE: u8 = 2 << 3 | 2;

pub(super) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A proto3 scalar field: omitted when zero.
pub(super) fn put_field(out: &mut Vec<u8>, tag: u8, value: u64) {
    if value != 0 {
        out.push(tag);
        put_varint(out, value);
    }
}

fn encode_response(r: &QueryResponse, out: &mut Vec<u8>) {
    out.reserve(r.matches.len() * 24 + 40);
    for m in &r.matches {
        out.push(MATCHES);
        let prefix = out.len();
        out.push(0);
        put_field(out, 1 << 3, m.instance_id);
        put_field(out, 2 << 3, u64::from(m.dp_rank));
        put_field(out, 3 << 3, u64::from(m.device_blocks));
        put_field(out, 4 << 3, u64::from(m.host_blocks));
        put_field(out, 5 << 3, u64::from(m.longest_blocks));
        put_field(out, 6 << 3, m.matched_tokens);
        put_field(out, 7 << 3, m.longest_matched_tokens);
        // At most MAX_MATCH_BYTES < 0x80: one byte.
        out[prefix] = (out.len() - prefix - 1) as u8;
    }
    put_field(out, BLOCK_SIZE, u64::from(r.block_size));
    put_field(out, QUERY_BLOCKS, u64::from(r.query_blocks));
    // int64 is the two's complement as a 64-bit varint.
    put_field(out, LAST_EVENT, r.last_event_unix_micros as u64);
    put_field(out, EVENTS_APPLIED, r.events_applied);
}

/// Room left at the front of a stream answer for its header: the request id (a tag and up to
/// ten bytes), the answer's tag and its length (up to five bytes: an answer under 32 GiB).
const STREAM_HEADROOM: usize = 1 + 10 + 1 + 5;

/// Writes `value` as a varint into `buf` at `*at`.
fn put_varint_at(buf: &mut [u8], at: &mut usize, mut value: u64) {
    while value >= 0x80 {
        buf[*at] = (value as u8) | 0x80;
        *at += 1;
        value >>= 7;
    }
    buf[*at] = value as u8;
    *at += 1;
}

/// Appends `message`'s protobuf encoding to the empty `out` if it is an answer this module
/// writes (a `QueryResponse`, or a `QueryStreamResponse` holding one or nothing) and returns
/// where in `out` the encoding starts; `None` otherwise (the caller encodes it with prost).
///
/// A stream answer's header holds the nested answer's length, known only once it is written:
/// the answer is written after [`STREAM_HEADROOM`] bytes and the header just before it, so
/// nothing is measured twice or moved.
pub(crate) fn encode<T: Any>(message: &T, out: &mut Vec<u8>) -> Option<usize> {
    debug_assert!(out.is_empty());
    let message = message as &dyn Any;
    if let Some(response) = message.downcast_ref::<QueryResponse>() {
        encode_response(response, out);
        return Some(0);
    }
    let stream = message.downcast_ref::<QueryStreamResponse>()?;
    match &stream.outcome {
        Some(query_stream_response::Outcome::Response(response)) => {
            out.resize(STREAM_HEADROOM, 0);
            encode_response(response, out);
            let len = (out.len() - STREAM_HEADROOM) as u64;
            debug_assert!(len < 1 << 35, "an answer's length fits five bytes");
            let mut header = [0u8; STREAM_HEADROOM];
            let mut at = 0;
            if stream.request_id != 0 {
                header[0] = REQUEST_ID;
                at = 1;
                put_varint_at(&mut header, &mut at, stream.request_id);
            }
            header[at] = RESPONSE;
            at += 1;
            put_varint_at(&mut header, &mut at, len);
            let start = STREAM_HEADROOM - at;
            out[start..STREAM_HEADROOM].copy_from_slice(&header[..at]);
            Some(start)
        }
        None => {
            put_field(out, REQUEST_ID, stream.request_id);
            Some(0)
        }
        Some(query_stream_response::Outcome::Error(_)) => None,
    }
}

/// A varint as prost reads it, or `None` where prost would refuse it (more than ten bytes, or
/// a tenth byte above 1) or the input ends.
pub(super) fn varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let byte = *bytes.get(*at)?;
        *at += 1;
        if i == 9 && byte > 1 {
            return None;
        }
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}

/// A length-delimited field's bytes.
pub(super) fn delimited<'a>(bytes: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let len = usize::try_from(varint(bytes, at)?).ok()?;
    let end = at.checked_add(len)?;
    let field = bytes.get(*at..end)?;
    *at = end;
    Some(field)
}

fn decode_match(bytes: &[u8]) -> Option<WorkerMatch> {
    let mut m = WorkerMatch::default();
    let mut at = 0;
    while at < bytes.len() {
        let tag = bytes[at];
        at += 1;
        let value = varint(bytes, &mut at);
        // prost reads uint32 as the varint truncated to 32 bits.
        match tag {
            t if t == 1 << 3 => m.instance_id = value?,
            t if t == 2 << 3 => m.dp_rank = value? as u32,
            t if t == 3 << 3 => m.device_blocks = value? as u32,
            t if t == 4 << 3 => m.host_blocks = value? as u32,
            t if t == 5 << 3 => m.longest_blocks = value? as u32,
            t if t == 6 << 3 => m.matched_tokens = value?,
            t if t == 7 << 3 => m.longest_matched_tokens = value?,
            _ => return None,
        }
    }
    Some(m)
}

fn decode_response(bytes: &[u8]) -> Option<QueryResponse> {
    let mut r = QueryResponse::default();
    let mut at = 0;
    while at < bytes.len() {
        let tag = bytes[at];
        at += 1;
        match tag {
            MATCHES => r.matches.push(decode_match(delimited(bytes, &mut at)?)?),
            BLOCK_SIZE => r.block_size = varint(bytes, &mut at)? as u32,
            QUERY_BLOCKS => r.query_blocks = varint(bytes, &mut at)? as u32,
            LAST_EVENT => r.last_event_unix_micros = varint(bytes, &mut at)? as i64,
            EVENTS_APPLIED => r.events_applied = varint(bytes, &mut at)?,
            _ => return None,
        }
    }
    Some(r)
}

fn decode_stream(bytes: &[u8]) -> Option<QueryStreamResponse> {
    let mut s = QueryStreamResponse::default();
    let mut at = 0;
    while at < bytes.len() {
        let tag = bytes[at];
        at += 1;
        match tag {
            REQUEST_ID => s.request_id = varint(bytes, &mut at)?,
            // A second answer would be merged into the first by prost: left to it.
            RESPONSE if s.outcome.is_none() => {
                let response = decode_response(delimited(bytes, &mut at)?)?;
                s.outcome = Some(query_stream_response::Outcome::Response(response));
            }
            _ => return None,
        }
    }
    Some(s)
}

/// `bytes` decoded as `U` if `U` is an answer this module reads and `bytes` have the canonical
/// layout; `None` otherwise (the caller decodes with prost, which then decides).
pub(crate) fn decode<U: Any>(bytes: &[u8]) -> Option<U> {
    let mut slot: Option<U> = None;
    let any = &mut slot as &mut dyn Any;
    if let Some(slot) = any.downcast_mut::<Option<QueryResponse>>() {
        *slot = decode_response(bytes);
    } else if let Some(slot) = any.downcast_mut::<Option<QueryStreamResponse>>() {
        *slot = decode_stream(bytes);
    }
    slot
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::QueryError;
    use proptest::prelude::*;
    use prost::Message;

    fn any_match() -> impl Strategy<Value = WorkerMatch> {
        // Zeros often (omitted fields), small values usually, the extremes sometimes.
        let small64 = prop_oneof![Just(0u64), 0u64..300, Just(u64::MAX), any::<u64>()];
        let small32 = prop_oneof![Just(0u32), 0u32..300, Just(u32::MAX), any::<u32>()];
        (
            small64.clone(),
            small32.clone(),
            small32.clone(),
            small32.clone(),
            small32,
            small64.clone(),
            small64,
        )
            .prop_map(
                |(id, rank, device, host, longest, tokens, longest_tokens)| WorkerMatch {
                    instance_id: id,
                    dp_rank: rank,
                    device_blocks: device,
                    host_blocks: host,
                    longest_blocks: longest,
                    matched_tokens: tokens,
                    longest_matched_tokens: longest_tokens,
                },
            )
    }

    fn any_response() -> impl Strategy<Value = QueryResponse> {
        (
            proptest::collection::vec(any_match(), 0..40),
            any::<u32>(),
            prop_oneof![Just(0u32), any::<u32>()],
            prop_oneof![Just(0i64), any::<i64>(), Just(-1i64)],
            any::<u64>(),
        )
            .prop_map(
                |(matches, block_size, query_blocks, last, applied)| QueryResponse {
                    matches,
                    block_size,
                    query_blocks,
                    last_event_unix_micros: last,
                    events_applied: applied,
                },
            )
    }

    fn any_stream() -> impl Strategy<Value = QueryStreamResponse> {
        (
            prop_oneof![Just(0u64), any::<u64>()],
            prop_oneof![
                Just(None),
                any_response().prop_map(|r| Some(query_stream_response::Outcome::Response(r))),
                (any::<u32>(), "[a-z ]{0,20}").prop_map(|(code, message)| Some(
                    query_stream_response::Outcome::Error(QueryError { code, message })
                )),
            ],
        )
            .prop_map(|(request_id, outcome)| QueryStreamResponse {
                request_id,
                outcome,
            })
    }

    /// What the codec does: this module's answer, else prost's.
    fn decoded<U: Message + Default + Any>(bytes: &[u8]) -> Result<U, prost::DecodeError> {
        decode::<U>(bytes).map_or_else(|| U::decode(bytes), Ok)
    }

    proptest! {
        #[test]
        fn responses_encode_as_prost_does(response in any_response()) {
            let mut ours = Vec::new();
            prop_assert_eq!(encode(&response, &mut ours), Some(0));
            prop_assert_eq!(&ours, &response.encode_to_vec());
            prop_assert_eq!(decode::<QueryResponse>(&ours), Some(response));
        }

        #[test]
        fn stream_answers_encode_as_prost_does(stream in any_stream()) {
            let mut ours = Vec::new();
            let is_error = matches!(stream.outcome, Some(query_stream_response::Outcome::Error(_)));
            let start = encode(&stream, &mut ours);
            prop_assert_eq!(start.is_none(), is_error);
            if let Some(start) = start {
                prop_assert_eq!(&ours[start..], &stream.encode_to_vec()[..]);
            }
            prop_assert_eq!(decoded::<QueryStreamResponse>(&stream.encode_to_vec()), Ok(stream));
        }

        /// Any bytes — valid answers altered, cut or extended, and noise — decode as prost
        /// decodes them (the same message, or an error where prost errs).
        #[test]
        fn any_bytes_decode_as_prost_decodes_them(
            stream in any_stream(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
            cut in any::<prop::sample::Index>(),
            tail in proptest::collection::vec(any::<u8>(), 0..6),
        ) {
            let bytes = crate::codec::altered(stream.encode_to_vec(), &flips, cut, &tail);
            prop_assert_eq!(
                decoded::<QueryStreamResponse>(&bytes).ok(),
                QueryStreamResponse::decode(&bytes[..]).ok()
            );
            prop_assert_eq!(
                decoded::<QueryResponse>(&bytes).ok(),
                QueryResponse::decode(&bytes[..]).ok()
            );
        }
    }

    #[test]
    fn other_messages_are_left_to_prost() {
        let mut out = Vec::new();
        assert_eq!(encode(&QueryError::default(), &mut out), None);
        assert!(out.is_empty());
        assert_eq!(decode::<QueryError>(&[]), None);
        // A second answer on one stream message is merged by prost: deferred.
        let one = QueryStreamResponse {
            request_id: 1,
            outcome: Some(query_stream_response::Outcome::Response(QueryResponse {
                block_size: 16,
                ..QueryResponse::default()
            })),
        }
        .encode_to_vec();
        let twice = [&one[..], &one[2..]].concat();
        assert_eq!(decode::<QueryStreamResponse>(&twice), None);
        assert!(QueryStreamResponse::decode(&twice[..]).is_ok());
    }
}
