//! Decoding a KV-event batch payload (msgpack) into typed events, tolerantly.
//!
//! One hand-written serde [`Visitor`](serde::de::Visitor) per wire shape, driven by
//! `deserialize_any`. Every visitor accepts *any* msgpack value: a value of the wrong type is
//! consumed (drained with [`IgnoredAny`](serde::de::IgnoredAny)) and marked bad instead of
//! failing, so one malformed or unknown event becomes a [`SkippedEvent`] and the rest of its
//! batch still decodes. Only bytes that are not msgpack at all (truncated input, reserved
//! markers, nesting deeper than [`MAX_DEPTH`]) or a malformed envelope fail the whole batch, as a
//! typed [`DecodeError`].
//!
//! The deserializer is the crate's own (`msgpack`): `rmp-serde`'s self-describing path over a
//! byte slice, value for value and error for error, plus two hooks a visitor may use. Token ids
//! and block hashes go through the *raw-array* hook: the whole array is decoded from its raw
//! bytes in one loop (`fast`; branchless for token ids) and, at the first element that loop does
//! not handle (SGLang's `[a, b]` pairs, a wrong type, an id out of `u32` range, truncation), the
//! array is decoded again through its visitor, so what is accepted and what is skipped does not
//! change. Map keys and event tags are matched as bytes through the *raw-string* hook (no UTF-8
//! check for a handful of ASCII names). Unit tests run every visitor on both this deserializer
//! and `rmp-serde`'s, on random and mutated payloads, and compare.
//!
//! Preallocations driven by wire lengths are capped at [`MAX_PREALLOC`] elements and
//! [`MAX_PREALLOC_BYTES`] bytes, so a forged `array32` header cannot allocate gigabytes: memory
//! stays proportional to the payload (plus a small constant). The fast paths reserve one output
//! element per element they are about to decode, and refuse a header claiming more elements than
//! bytes remain, so theirs stays within 4 (token ids) or 8 (hashes) bytes per input byte.
//!
//! Files: `types` holds the public event and error types, `visitors` the visitors and
//! [`decode_batch`] that drives them, `msgpack` the deserializer and `fast` the fast paths.

mod fast;
mod msgpack;
mod types;
mod visitors;

pub use types::{
    BlockRemoved, BlockStored, DecodeError, Event, EventBatch, MAX_EVENT_AGE, MAX_SKIPPED_KEPT,
    MsgpackError, SaltSource, SkippedEvent, instant_of_wall_clock,
};
pub use visitors::decode_batch;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub use visitors::decode_batch_rmp_serde;

/// Largest number of elements preallocated from a msgpack length header.
pub const MAX_PREALLOC: usize = 4096;

/// Largest number of bytes preallocated from one msgpack length header (so a forged `array32`
/// header in front of large elements, such as events, reserves at most this much).
pub const MAX_PREALLOC_BYTES: usize = 16 * 1024;

/// Deepest msgpack nesting accepted (real batches nest at most 6 levels).
pub const MAX_DEPTH: usize = 32;
