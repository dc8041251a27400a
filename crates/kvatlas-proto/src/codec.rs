//! The protobuf codec of the generated stubs: prost's messages, with changes that matter at
//! hundreds of thousands of messages per second, and one that matters to people.
//!
//! - **Decoding from the contiguous slice.** tonic hands the decoder a view of its receive
//!   buffer; decoding through that view advances a `BytesMut` once per field, which for a prompt
//!   of 1,024 packed token ids is most of the decoding time. The message's bytes are contiguous,
//!   so it is decoded from a plain `&[u8]` instead.
//! - **Encoding into a flat buffer.** prost writes varints byte by byte; into tonic's `BytesMut`
//!   each byte is a capacity check and a copy. The message is encoded into a reused, exactly
//!   sized `Vec<u8>` and appended in one copy.
//! - **The answers by hand.** `QueryResponse` (and a `QueryStreamResponse` holding one) are
//!   encoded and decoded by hand-written code (`codec/answers.rs`), byte for byte prost's, because an
//!   answer lists a whole fleet of worker ranks (see there).
//! - **The queries by hand.** `QueryRequest` is decoded and encoded by hand-written code
//!   (`codec/requests.rs`), to prost's message and prost's bytes, because a prompt of token ids
//!   is a thousand packed varints (see there).
//! - **A request's decoded size is bounded before it is decoded** ([`bound_decoded_size`]): a
//!   list of messages takes a whole element in memory per 2 bytes on the wire, so such requests
//!   are counted in their bytes first (`codec/budget.rs`) and refused with RESOURCE_EXHAUSTED
//!   over the bound.
//! - **A message that does not decode is INVALID_ARGUMENT** ("malformed QueryRequest message:
//!   …") rather than tonic's INTERNAL: a client sent bad bytes; nothing failed inside the server.

use std::marker::PhantomData;

mod answers;
mod budget;
mod requests;

use prost::Message;
use prost::bytes::{Buf, BufMut};
use tonic::Status;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// The codec `build.rs` names for every method (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = MessageEncoder<T>;
    type Decoder = MessageDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        MessageEncoder {
            scratch: Vec::new(),
            _message: PhantomData,
        }
    }

    fn decoder(&mut self) -> Self::Decoder {
        MessageDecoder(PhantomData)
    }
}

/// Encodes into a reused flat buffer, then appends it in one copy (see the module docs).
#[derive(Debug)]
pub struct MessageEncoder<T> {
    scratch: Vec<u8>,
    _message: PhantomData<T>,
}

impl<T: Message + 'static> Encoder for MessageEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        self.scratch.clear();
        let hand_written = answers::encode(&item, &mut self.scratch)
            .or_else(|| requests::encode(&item, &mut self.scratch));
        let start = hand_written.unwrap_or_else(|| {
            let len = item.encoded_len();
            self.scratch.resize(len, 0);
            let mut slice: &mut [u8] = &mut self.scratch;
            item.encode_raw(&mut slice);
            // `encoded_len` is exact, so the slice is full.
            debug_assert!(slice.is_empty());
            0
        });
        buf.put_slice(&self.scratch[start..]);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// Decodes `bytes` as the server's and the client's codec does: the answers and `QueryRequest`
/// by this crate's hand-written code where their layout is canonical, everything else by prost.
/// The result is always prost's (the same message, or an error where prost errs); this entry
/// exists so that fuzzing and tests can hold the codec to that.
///
/// # Errors
/// prost's error for bytes that are not a valid `U`.
pub fn decode_message<U: Message + Default + 'static>(
    bytes: &[u8],
) -> Result<U, prost::DecodeError> {
    answers::decode::<U>(bytes)
        .or_else(|| requests::decode::<U>(bytes))
        .map_or_else(|| U::decode(bytes), Ok)
}

/// Bounds the token ids a `QueryRequest` is decoded with to at least `max` (the server's
/// `--max-query-tokens`), so that a message of one-byte ids does not become four bytes of
/// memory per byte before the server refuses it. A message carrying more ids (counted in its
/// bytes, [`count_token_ids`]) is decoded with only the first `max + 1`: the server then
/// refuses it as any query over its limit, with its request id, and on a `QueryStream` the
/// stream goes on. One the hand-written decoding does not read (a non-canonical layout, left
/// to prost) is refused with INVALID_ARGUMENT instead, which ends a stream. The bound is the
/// process's: it only rises (servers of one process with different limits each check their
/// own on the decoded query), and without a call nothing is bounded.
pub fn bound_token_ids(max: usize) {
    requests::MAX_TOKEN_IDS.fetch_max(max, std::sync::atomic::Ordering::Relaxed);
}

/// The bound [`bound_token_ids`] set (0: none): a decoded query holding more ids was cut.
pub fn token_id_bound() -> usize {
    requests::MAX_TOKEN_IDS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The most token ids a decoded query holds under `bound` (0: none): the bound + 1, so that a
/// query holding that many is known to be over it.
fn kept_under(bound: usize) -> usize {
    match bound {
        0 => usize::MAX,
        bound => bound.saturating_add(1),
    }
}

/// The most ids a query is decoded with under [`token_id_bound`]: its bound + 1 (`usize::MAX`
/// without one). A query decoded with exactly this many was cut (the rest not read) and is
/// over every server's limit; the server's JSON query routes keep as many.
pub fn token_ids_kept() -> usize {
    kept_under(token_id_bound())
}

/// Bounds the memory a request message may take once decoded (its lists counted at their
/// length) to `max` bytes, or to the bound already set if that is higher: the bound is the
/// process's and only rises, as [`bound_token_ids`]'s; without a call nothing is counted. (The
/// server sets `16 × --max-message-bytes`.) Lists of integers take at most 8 bytes per byte
/// received; a list of messages or strings takes a whole element per element (an empty
/// `KvEvent` is 2 bytes on the wire and 144 in memory). Requests that can hold such lists
/// (`PublishEventsRequest`, llm-d's `GetPodScoresRequest`) are counted in their bytes before
/// decoding, and one over the bound is refused with RESOURCE_EXHAUSTED.
pub fn bound_decoded_size(max: usize) {
    budget::MAX_DECODED_BYTES.fetch_max(max, std::sync::atomic::Ordering::Relaxed);
}

/// The bound [`bound_decoded_size`] set (0: none).
pub fn decoded_size_bound() -> usize {
    budget::MAX_DECODED_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// The bytes of memory `bytes` would take once decoded as `U`, counted without decoding them,
/// when `U` is a request whose decoded form can exceed 8 bytes per byte (`PublishEventsRequest`,
/// llm-d's `GetPodScoresRequest`); `None` for other messages. What [`bound_decoded_size`]
/// compares; public so that fuzzing and tests can hold it to what prost decodes.
pub fn decoded_size<U: std::any::Any>(bytes: &[u8]) -> Option<usize> {
    budget::decoded_size_of::<U>(bytes).map(|(size, _)| size)
}

/// How many token ids prost decodes from the `QueryRequest` in `bytes`, at most, counted
/// without decoding them (what [`bound_token_ids`] compares).
pub fn count_token_ids(bytes: &[u8]) -> usize {
    requests::count_token_ids(bytes)
}

/// Decodes from the message's contiguous bytes, reporting failures as INVALID_ARGUMENT naming
/// the message type; a `QueryRequest` over [`bound_token_ids`] is cut or refused before its
/// ids are decoded, and a request over [`bound_decoded_size`] refused before it is decoded.
#[derive(Debug)]
pub struct MessageDecoder<U>(PhantomData<U>);

impl<U: Message + Default + 'static> Decoder for MessageDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let len = buf.remaining();
        let decoded = if buf.chunk().len() >= len {
            let bytes = &buf.chunk()[..len];
            let most = decoded_size_bound();
            if let Some((size, counted)) = budget::over_bound::<U>(bytes, most) {
                buf.advance(len);
                return Err(Status::resource_exhausted(format!(
                    "the {} message of {len} bytes would take {size} bytes of memory once \
                     decoded; this server decodes at most {most} per message: send fewer {} per \
                     message",
                    counted.schema.name, counted.lists
                )));
            }
            let bound = token_id_bound();
            if let Some(count) = requests::over_bound::<U>(bytes, bound) {
                let cut = requests::decode_cut::<U>(bytes, kept_under(bound));
                buf.advance(len);
                return cut.map(Some).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "the prompt has {count} tokens; this server accepts at most {bound} per \
                         query (refused before decoding them)"
                    ))
                });
            }
            let decoded = decode_message::<U>(bytes);
            buf.advance(len);
            decoded
        } else {
            U::decode(&mut *buf)
        };
        decoded.map(Some).map_err(|error| {
            let name = std::any::type_name::<U>();
            let name = name.rsplit("::").next().unwrap_or(name);
            Status::invalid_argument(format!("malformed {name} message: {error}"))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// `bytes` with a few bytes flipped (`(where, xor)`), cut at `cut` and extended by `tail`: the
/// inputs the hand-written codecs' property tests hold to prost's decoding.
#[cfg(test)]
fn altered(
    mut bytes: Vec<u8>,
    flips: &[(proptest::sample::Index, u8)],
    cut: proptest::sample::Index,
    tail: &[u8],
) -> Vec<u8> {
    if !bytes.is_empty() {
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= value;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
    }
    bytes.extend_from_slice(tail);
    bytes
}
