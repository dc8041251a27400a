//! The decoder's public output: a decoded batch and its events, and why a batch fails.

use std::fmt;

use crate::counters::Reason;

/// A decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EventBatch {
    /// The engine's timestamp of the scheduler step (seconds since the epoch).
    pub ts: f64,
    /// The batch's data-parallel rank (`data_parallel_rank` / `attn_dp_rank`), if sent.
    pub dp_rank: Option<u32>,
    /// The events that decoded, in batch order.
    pub events: Vec<Event>,
    /// The first [`MAX_SKIPPED_KEPT`] events that did not decode (unknown tag, malformed),
    /// with their position.
    pub skipped: Vec<SkippedEvent>,
    /// The events that did not decode beyond those, counted by reason, not kept (a batch of
    /// tens of millions of one-byte elements, each kept as a 32-byte record, held 32 times its
    /// payload).
    pub skipped_beyond: Vec<(Reason, u64)>,
}

/// The skipped events a batch keeps with their position and detail ([`EventBatch::skipped`]);
/// the others are only counted ([`EventBatch::skipped_beyond`]).
pub const MAX_SKIPPED_KEPT: usize = 64;

/// The oldest batch timestamp [`EventBatch::published_at`] takes as the engine's wall clock:
/// older ones are not a publication time (a test's `0.0`, a replayed trace's own clock).
pub const MAX_EVENT_AGE: std::time::Duration = std::time::Duration::from_secs(60);

impl EventBatch {
    /// When the engine published the batch, on the monotonic clock of `now`: its timestamp
    /// read as the engine's wall clock (`time.time()` in vLLM and SGLang), with `wall_now` the
    /// wall-clock reading taken with `now` ([`instant_of_wall_clock`]).
    pub fn published_at(
        &self,
        now: std::time::Instant,
        wall_now: std::time::SystemTime,
    ) -> Option<std::time::Instant> {
        instant_of_wall_clock(self.ts, now, wall_now)
    }
}

/// `unix_seconds`, a wall-clock time (seconds since the epoch, possibly another machine's
/// clock), on the monotonic clock of `now`, with `wall_now` the wall-clock reading taken with
/// `now`. `None` for a time ahead of `wall_now` (a clock running ahead) or older than
/// [`MAX_EVENT_AGE`] (not a recent wall-clock time).
pub fn instant_of_wall_clock(
    unix_seconds: f64,
    now: std::time::Instant,
    wall_now: std::time::SystemTime,
) -> Option<std::time::Instant> {
    let wall_now = wall_now
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs_f64();
    let age = wall_now - unix_seconds;
    // `!(..)` also refuses NaN.
    if !(0.0..=MAX_EVENT_AGE.as_secs_f64()).contains(&age) {
        return None;
    }
    now.checked_sub(std::time::Duration::from_secs_f64(age))
}

/// An event of the batch that was skipped while decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkippedEvent {
    /// Position of the event in the batch's `events` array.
    pub index: usize,
    /// [`Reason::MalformedEvent`] or [`Reason::UnknownEventType`].
    pub reason: Reason,
    /// Which field or shape was wrong (for logs).
    pub detail: &'static str,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A run of blocks became cached (boxed: it is several times the size of the other
    /// variants, and a batch of one-block removes would otherwise move and reserve that much
    /// per event).
    BlockStored(Box<BlockStored>),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// Every block of the source was dropped (all tiers).
    AllBlocksCleared,
}

/// Where a store's cache salt came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SaltSource {
    /// The map layout's top-level `cache_salt` key (SGLang ≥ 0.5.20).
    TopLevel,
    /// A map event's nested `metadata: {cache_salt}`.
    Metadata,
    /// The positional metadata map at position 7 (SGLang 0.5.18–0.5.19).
    PositionalMetadata,
    /// A `"dynamo-cache-salt:"`-prefixed string in the first block's `extra_keys`.
    ExtraKeys,
}

/// A `BlockStored` event: every field of its wire layout (`docs/events.md` §7.2) that the
/// producer sent.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct BlockStored {
    /// Engine hash per block (ints as their 64-bit pattern, `bin` as its last 8 bytes BE).
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before the first one; `None` = the run starts the sequence.
    pub parent_block_hash: Option<u64>,
    /// Tokens of all blocks, concatenated (pair-encoded ids already flattened, see
    /// [`BlockStored::pair_encoded`]). Empty for a tokenless (location-only) store.
    pub token_ids: Vec<u32>,
    /// Whether `token_ids` came as `[[a, b], ...]` pairs (SGLang EAGLE): flattened to the first
    /// of each pair plus the second of the last pair, one more token than pairs.
    pub pair_encoded: bool,
    /// Tokens per block; `None` only for a tokenless store that did not send it.
    pub block_size: Option<u32>,
    /// Deprecated LoRA adapter id.
    pub lora_id: Option<u64>,
    /// Storage tier string, as sent.
    pub medium: Option<String>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// The request's cache salt, from the first of the sources in [`SaltSource`] order that
    /// carries a non-empty one.
    pub cache_salt: Option<String>,
    /// Where `cache_salt` came from.
    pub salt_source: Option<SaltSource>,
    /// Whether `extra_keys` carried multimodal or prompt-embedding entries (tuples or bytes).
    pub non_token_extra_keys: bool,
    /// KV-cache group (hybrid models); 0 = the full-attention group.
    pub group_idx: Option<u64>,
    /// KV-cache spec kind (`full_attention`, `sliding_window`, `mamba`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding-window size of the group's spec.
    pub kv_cache_spec_sliding_window: Option<u64>,
    /// `LOCAL` or `REMOTE` (offload tiers).
    pub locality: Option<String>,
    /// Secondary offload tier id (for example `kvcr`).
    pub ownership: Option<String>,
    /// The request session that triggered the store (attribution only).
    pub session_id: Option<String>,
}

/// A `BlockRemoved` event (wire layout in `docs/events.md` §7.2).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks.
    pub block_hashes: Vec<u64>,
    /// Storage tier string, as sent.
    pub medium: Option<String>,
    /// KV-cache group.
    pub group_idx: Option<u64>,
    /// `LOCAL` or `REMOTE`.
    pub locality: Option<String>,
    /// Secondary offload tier id.
    pub ownership: Option<String>,
}

/// Why a whole batch could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload is not well-formed msgpack (truncated, reserved marker, too deep).
    #[error("payload is not well-formed msgpack: {0}")]
    Msgpack(#[source] MsgpackError),
    /// The top-level value is neither an array nor a map.
    #[error("payload is not a batch: expected an array or a map, found {found}")]
    NotABatch {
        /// What was found instead.
        found: &'static str,
    },
    /// The batch array has fewer than 2 elements.
    #[error("batch array has {len} element(s), expected 2 or 3")]
    TooShort {
        /// The array's length.
        len: usize,
    },
    /// A required batch field (`ts`, `events`) is missing.
    #[error("batch field `{0}` is missing")]
    MissingField(&'static str),
    /// A batch field has the wrong type.
    #[error("batch field `{0}` has the wrong type")]
    InvalidField(&'static str),
    /// The data-parallel rank is negative (rejected, never bit-cast).
    #[error("batch data-parallel rank {0} is negative")]
    NegativeDpRank(i64),
    /// The data-parallel rank does not fit in a `u32`.
    #[error("batch data-parallel rank {0} does not fit in u32")]
    DpRankOutOfRange(u64),
}

/// Why a payload is not well-formed msgpack: the msgpack parser's own error, kept opaque.
///
/// The parser's error type is not part of this crate's API (a new `rmp-serde` must not change
/// it): this value shows the parser's message as its `Display` and its `Debug`, and the parser's
/// cause, if any (the I/O error of a truncated read), as [`std::error::Error::source`].
pub struct MsgpackError(pub(super) rmp_serde::decode::Error);

impl fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl std::error::Error for MsgpackError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.0)
    }
}

impl DecodeError {
    /// A msgpack parser error as a [`DecodeError::Msgpack`] (crate-private: no public
    /// conversion names the parser's type).
    pub(super) fn msgpack(error: rmp_serde::decode::Error) -> Self {
        DecodeError::Msgpack(MsgpackError(error))
    }

    /// The counter this error is recorded under.
    pub fn reason(&self) -> Reason {
        match self {
            DecodeError::NegativeDpRank(_) => Reason::NegativeDpRank,
            DecodeError::DpRankOutOfRange(_) => Reason::DpRankOutOfRange,
            _ => Reason::MalformedBatch,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

    use super::*;

    fn batch(ts: f64) -> EventBatch {
        EventBatch {
            ts,
            dp_rank: None,
            events: Vec::new(),
            skipped: Vec::new(),
            skipped_beyond: Vec::new(),
        }
    }

    #[test]
    fn a_recent_timestamp_is_carried_onto_the_monotonic_clock() {
        let now = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let Some(expected) = now.checked_sub(Duration::from_micros(1_500)) else {
            return; // the monotonic clock started under 1.5 ms ago
        };
        let published = batch(1_800_000_000.0 - 0.0015).published_at(now, wall);
        let off = published.map(|p| p.max(expected) - p.min(expected));
        // f64 seconds since the epoch hold about 0.24 µs here.
        assert!(off.is_some_and(|d| d < Duration::from_micros(1)), "{off:?}");
        assert_eq!(batch(1_800_000_000.0).published_at(now, wall), Some(now));
    }

    #[test]
    fn timestamps_that_are_not_a_recent_wall_clock_give_no_publication_time() {
        let now = Instant::now();
        let wall = SystemTime::now();
        let secs = wall
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let too_old = secs - MAX_EVENT_AGE.as_secs_f64() - 1.0;
        for ts in [
            0.0,
            1_795_317_349.0,
            too_old,
            secs + 0.5,
            f64::NAN,
            f64::INFINITY,
        ] {
            assert_eq!(batch(ts).published_at(now, wall), None, "ts {ts}");
        }
        assert!(batch(secs - 1.0).published_at(now, wall).is_some());
    }
}
