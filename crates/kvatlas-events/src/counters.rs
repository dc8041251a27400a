//! Why events are dropped, and per-reason counters ([`Reason`], [`DropCounters`]).
//!
//! Nothing the ingestion core drops is dropped silently: every skipped event, filtered event,
//! partial page and rejected batch is attributed to exactly one [`Reason`] and counted.

use std::fmt;

/// Why an event (or a whole batch, for the `Batch*` reasons) was not turned into a mutation.
///
/// `docs/events.md` has the policy table behind each reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The batch envelope was not a valid batch (not msgpack, wrong shape, missing `ts` or
    /// `events`): the whole batch is dropped.
    MalformedBatch,
    /// The batch carried a negative data-parallel rank (never bit-cast): the whole batch is
    /// dropped.
    NegativeDpRank,
    /// The batch carried a data-parallel rank above `u32::MAX`: the whole batch is dropped.
    DpRankOutOfRange,
    /// An event had no string tag, a required field was missing or a field had the wrong type.
    MalformedEvent,
    /// An event's tag was not `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.
    UnknownEventType,
    /// The `medium` string maps to no tier (`docs/events.md`, medium table).
    UnknownMedium,
    /// `group_idx` was not 0: a secondary KV-cache group of a hybrid model.
    NonMainGroup,
    /// `kv_cache_spec_kind` was not a full-attention kind (sliding window, mamba, ...).
    NonFullAttentionKind,
    /// `locality` was not `LOCAL` (a remote offload tier of another worker).
    NonLocalLocality,
    /// `ownership` was set (a secondary offload tier such as `"kvcr"`).
    ForeignOwnership,
    /// A store without token ids (a location-only offload event): its local hashes cannot be
    /// computed.
    Tokenless,
    /// A store or remove without any block hash.
    Empty,
    /// The event's `block_size` differs from the registered source's block size.
    BlockSizeMismatch,
    /// `len(token_ids) != len(block_hashes) × block_size`.
    TokenCountMismatch,
    /// An SGLang partial last page (`block_size` below the page size): not a full block.
    PartialPage,
    /// A store with a `lora_id` but no `lora_name`: its LoRA seed cannot be reproduced.
    UnnamedLora,
    /// A store whose `extra_keys` carry multimodal or prompt-embedding content: its tokens do
    /// not determine the block.
    NonTokenContent,
    /// The batch carried a data-parallel rank that would be more than its source's
    /// `MAX_RANKS_PER_SOURCE`th distinct one (a listener clears every rank its source fed on a
    /// resync, so it must remember them all): the whole batch is dropped.
    TooManyDpRanks,
}

impl Reason {
    /// Every reason, in declaration order ([`Reason::index`] is the position here).
    pub const ALL: [Reason; 18] = [
        Reason::MalformedBatch,
        Reason::NegativeDpRank,
        Reason::DpRankOutOfRange,
        Reason::MalformedEvent,
        Reason::UnknownEventType,
        Reason::UnknownMedium,
        Reason::NonMainGroup,
        Reason::NonFullAttentionKind,
        Reason::NonLocalLocality,
        Reason::ForeignOwnership,
        Reason::Tokenless,
        Reason::Empty,
        Reason::BlockSizeMismatch,
        Reason::TokenCountMismatch,
        Reason::PartialPage,
        Reason::UnnamedLora,
        Reason::NonTokenContent,
        Reason::TooManyDpRanks,
    ];

    /// Number of reasons.
    pub const COUNT: usize = Self::ALL.len();

    /// Position in [`Reason::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// A stable `snake_case` label (for metrics and logs).
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::MalformedBatch => "malformed_batch",
            Reason::NegativeDpRank => "negative_dp_rank",
            Reason::DpRankOutOfRange => "dp_rank_out_of_range",
            Reason::MalformedEvent => "malformed_event",
            Reason::UnknownEventType => "unknown_event_type",
            Reason::UnknownMedium => "unknown_medium",
            Reason::NonMainGroup => "non_main_group",
            Reason::NonFullAttentionKind => "non_full_attention_kind",
            Reason::NonLocalLocality => "non_local_locality",
            Reason::ForeignOwnership => "foreign_ownership",
            Reason::Tokenless => "tokenless",
            Reason::Empty => "empty",
            Reason::BlockSizeMismatch => "block_size_mismatch",
            Reason::TokenCountMismatch => "token_count_mismatch",
            Reason::PartialPage => "partial_page",
            Reason::UnnamedLora => "unnamed_lora",
            Reason::NonTokenContent => "non_token_content",
            Reason::TooManyDpRanks => "too_many_dp_ranks",
        }
    }

    /// Whether the reason drops a whole batch rather than one event.
    pub const fn is_batch_level(self) -> bool {
        matches!(
            self,
            Reason::MalformedBatch
                | Reason::NegativeDpRank
                | Reason::DpRankOutOfRange
                | Reason::TooManyDpRanks
        )
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-[`Reason`] drop counts (plain `u64`s; merge them to aggregate sources).
///
/// Batch-level reasons count batches; the others count events, except
/// [`Reason::PartialPage`], which counts dropped partial pages (the full pages of the same
/// event are still indexed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct DropCounters {
    counts: [u64; Reason::COUNT],
}

impl DropCounters {
    /// All zero.
    pub const fn new() -> Self {
        Self {
            counts: [0; Reason::COUNT],
        }
    }

    /// Counts one drop for `reason`.
    pub fn record(&mut self, reason: Reason) {
        self.add(reason, 1);
    }

    /// Counts `n` drops for `reason` (saturating).
    pub fn add(&mut self, reason: Reason, n: u64) {
        if let Some(slot) = self.counts.get_mut(reason.index()) {
            *slot = slot.saturating_add(n);
        }
    }

    /// The count for `reason`.
    pub fn get(&self, reason: Reason) -> u64 {
        self.counts.get(reason.index()).copied().unwrap_or(0)
    }

    /// The sum over all reasons.
    pub fn total(&self) -> u64 {
        self.counts.iter().fold(0u64, |a, b| a.saturating_add(*b))
    }

    /// Adds another set of counters to this one.
    pub fn merge(&mut self, other: &DropCounters) {
        for reason in Reason::ALL {
            self.add(reason, other.get(reason));
        }
    }

    /// The non-zero counts, in [`Reason::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (Reason, u64)> + '_ {
        Reason::ALL
            .into_iter()
            .map(|r| (r, self.get(r)))
            .filter(|(_, n)| *n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_match_all_and_labels_are_unique() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
        let mut labels: Vec<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Reason::COUNT);
    }

    #[test]
    fn counters_record_merge_and_iterate() {
        let mut a = DropCounters::new();
        a.record(Reason::UnknownMedium);
        a.add(Reason::Tokenless, 2);
        let mut b = DropCounters::new();
        b.record(Reason::UnknownMedium);
        b.merge(&a);
        assert_eq!(b.get(Reason::UnknownMedium), 2);
        assert_eq!(b.total(), 4);
        assert_eq!(
            b.iter().collect::<Vec<_>>(),
            vec![(Reason::UnknownMedium, 2), (Reason::Tokenless, 2)]
        );
    }
}
