//! Turning decoded events into [`kvatlas_index::Mutation`]s for one registered source.
//!
//! The policy (what is indexed, what is dropped and why) is the table in `docs/events.md`; in
//! short, for a `BlockStored`:
//!
//! 1. `group_idx` must be absent or 0, `kv_cache_spec_kind` absent or one of
//!    [`INDEXED_KV_CACHE_SPEC_KINDS`] (Dynamo and llm-d index only full-attention groups);
//! 2. `locality` absent or `LOCAL`, `ownership` absent (remote and secondary offload tiers are
//!    another indexer's business);
//! 3. `medium` maps to a [`Tier`] ([`tier_for_medium`]);
//! 4. the store has hashes and tokens (a tokenless, location-only offload store is dropped:
//!    its local hashes cannot be computed), a `lora_name` whenever it has a `lora_id`, and no
//!    multimodal or prompt-embedding `extra_keys`;
//! 5. its `block_size` equals the source's and `len(token_ids) == len(block_hashes) × block_size`
//!    (an SGLang partial last page is dropped and counted; the event's full pages are kept).
//!
//! Every block's [`LocalBlockHash`](kvatlas_hash::LocalBlockHash) is recomputed from its tokens
//! with [`BlockHasher::with_options`]`(lora_name, cache_salt)`, exactly as a router hashes a
//! query; the engine's hash is kept as an opaque [`ExternalBlockHash`].

use kvatlas_hash::{BlockHasher, BlockSize};
use kvatlas_index::{ExternalBlockHash, Mutation, StoredBlock, Tier, Worker};

use crate::counters::{DropCounters, Reason};
use crate::decode::{BlockRemoved, BlockStored, DecodeError, Event, EventBatch, decode_batch};

/// Which engine produces a source's events (their hash spaces and quirks differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// vLLM: full blocks only.
    Vllm,
    /// SGLang: may publish a partial last page, pair-encoded (EAGLE) token ids, signed hashes.
    Sglang,
}

/// A registered event source: one engine publisher (one worker's data-parallel rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source {
    /// The worker the events belong to.
    pub worker_id: u64,
    /// The registered data-parallel rank; a rank carried by a batch overrides it.
    pub dp_rank: u32,
    /// The engine's block (page) size in tokens; events with another size are rejected.
    pub block_size: BlockSize,
    /// The producing engine.
    pub engine: EngineKind,
}

/// `kv_cache_spec_kind` values whose blocks are indexed (compared case-insensitively); an
/// absent kind is indexed too.
pub const INDEXED_KV_CACHE_SPEC_KINDS: [&str; 3] =
    ["full_attention", "mla_attention", "sink_full_attention"];

/// Medium strings (compared case-insensitively) and the tier each maps to.
const MEDIA: [(&str, Tier); 14] = [
    ("", Tier::Device),
    ("GPU", Tier::Device),
    ("DEVICE", Tier::Device),
    ("CPU", Tier::Host),
    ("CPU_PINNED", Tier::Host),
    ("CPU_TIER1", Tier::Host),
    ("CPU_TIER2", Tier::Disk),
    ("STORAGE", Tier::Disk),
    ("DISK", Tier::Disk),
    ("NVME", Tier::Disk),
    ("EXTERNAL", Tier::External),
    ("NETWORK", Tier::External),
    ("REMOTE", Tier::External),
    ("SHARED", Tier::External),
];

/// The tier an event's `medium` string names (`docs/events.md` §2), case-insensitively; `None`
/// (absent or nil) and `""` are the device. `None` is returned for an unknown medium.
pub fn tier_for_medium(medium: Option<&str>) -> Option<Tier> {
    let Some(medium) = medium else {
        return Some(Tier::Device);
    };
    MEDIA
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(medium))
        .map(|(_, tier)| *tier)
}

/// Converts one source's decoded events into mutations, counting every drop.
#[derive(Debug, Clone)]
pub struct Converter {
    source: Source,
    /// The source's hasher without LoRA or salt (cloned and re-seeded for those).
    hasher: BlockHasher,
}

impl Converter {
    /// A converter for `source`.
    pub fn new(source: Source) -> Self {
        Self {
            hasher: BlockHasher::with_block_size(source.block_size),
            source,
        }
    }

    /// The registered source.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The worker rank a batch's events belong to: the batch's rank if it carries one, else
    /// the registered rank.
    pub fn worker_for(&self, batch_dp_rank: Option<u32>) -> Worker {
        Worker::new(
            self.source.worker_id,
            batch_dp_rank.unwrap_or(self.source.dp_rank),
        )
    }

    /// Decodes `payload` and converts its events, appending mutations to `out` in event order.
    ///
    /// # Errors
    /// The batch's [`DecodeError`] (also counted in `drops` under [`DecodeError::reason`]).
    pub fn ingest(
        &self,
        payload: &[u8],
        out: &mut Vec<Mutation>,
        drops: &mut DropCounters,
    ) -> Result<(), DecodeError> {
        match decode_batch(payload) {
            Ok(batch) => {
                self.convert_batch(&batch, out, drops);
                Ok(())
            }
            Err(error) => {
                drops.record(error.reason());
                Err(error)
            }
        }
    }

    /// Converts a decoded batch: counts its skipped events, then converts each event for
    /// [`Converter::worker_for`] the batch's rank, appending to `out` in order.
    pub fn convert_batch(
        &self,
        batch: &EventBatch,
        out: &mut Vec<Mutation>,
        drops: &mut DropCounters,
    ) {
        for skipped in &batch.skipped {
            drops.record(skipped.reason);
        }
        for &(reason, count) in &batch.skipped_beyond {
            drops.add(reason, count);
        }
        let worker = self.worker_for(batch.dp_rank);
        out.reserve(batch.events.len());
        for event in &batch.events {
            if let Some(mutation) = self.convert_event(worker, event, drops) {
                out.push(mutation);
            }
        }
    }

    /// Converts one event for `worker`; `None` when it is dropped (counted in `drops`).
    pub fn convert_event(
        &self,
        worker: Worker,
        event: &Event,
        drops: &mut DropCounters,
    ) -> Option<Mutation> {
        let result = match event {
            Event::BlockStored(stored) => self.stored(worker, stored, drops),
            Event::BlockRemoved(removed) => removed_mutation(worker, removed),
            Event::AllBlocksCleared => Ok(Mutation::Cleared { worker }),
        };
        result.map_err(|reason| drops.record(reason)).ok()
    }

    fn stored(
        &self,
        worker: Worker,
        s: &BlockStored,
        drops: &mut DropCounters,
    ) -> Result<Mutation, Reason> {
        check_group(s.group_idx)?;
        if let Some(kind) = &s.kv_cache_spec_kind
            && !INDEXED_KV_CACHE_SPEC_KINDS
                .iter()
                .any(|k| k.eq_ignore_ascii_case(kind))
        {
            return Err(Reason::NonFullAttentionKind);
        }
        check_placement(s.locality.as_deref(), s.ownership.as_deref())?;
        let tier = tier_for_medium(s.medium.as_deref()).ok_or(Reason::UnknownMedium)?;
        if s.block_hashes.is_empty() {
            return Err(Reason::Empty);
        }
        if s.token_ids.is_empty() {
            return Err(Reason::Tokenless);
        }
        if s.lora_id.is_some() && s.lora_name.is_none() {
            return Err(Reason::UnnamedLora);
        }
        if s.non_token_extra_keys {
            return Err(Reason::NonTokenContent);
        }

        let registered = self.source.block_size.as_usize();
        let Some(event_size) = s.block_size else {
            return Err(Reason::MalformedEvent);
        };
        let sglang = self.source.engine == EngineKind::Sglang;
        if usize::try_from(event_size).ok() != Some(registered) {
            return Err(
                if sglang && event_size > 0 && (event_size as usize) < registered {
                    Reason::PartialPage
                } else {
                    Reason::BlockSizeMismatch
                },
            );
        }

        let n = s.block_hashes.len();
        let expected = n.saturating_mul(registered);
        let len = s.token_ids.len();
        let tokens: &[u32] = if len == expected {
            &s.token_ids
        } else if s.pair_encoded && len == expected.saturating_add(1) {
            s.token_ids.get(..expected).unwrap_or_default()
        } else if sglang && len < expected && len > expected.saturating_sub(registered) {
            // The last page is partial: keep the full ones, count the partial one.
            if n == 1 {
                return Err(Reason::PartialPage);
            }
            drops.record(Reason::PartialPage);
            &s.token_ids
        } else {
            return Err(Reason::TokenCountMismatch);
        };

        let seeded;
        let hasher = if s.lora_name.is_none() && s.cache_salt.is_none() {
            &self.hasher
        } else {
            seeded = self
                .hasher
                .clone()
                .with_options(s.lora_name.as_deref(), s.cache_salt.as_deref());
            &seeded
        };
        let blocks = tokens
            .chunks_exact(registered)
            .zip(&s.block_hashes)
            .map(|(chunk, hash)| StoredBlock {
                external: ExternalBlockHash::new(*hash),
                local: hasher.hash_block(chunk),
            })
            .collect();
        Ok(Mutation::Stored {
            worker,
            tier,
            parent: s.parent_block_hash.map(ExternalBlockHash::new),
            blocks,
        })
    }
}

fn removed_mutation(worker: Worker, r: &BlockRemoved) -> Result<Mutation, Reason> {
    check_group(r.group_idx)?;
    check_placement(r.locality.as_deref(), r.ownership.as_deref())?;
    let tier = tier_for_medium(r.medium.as_deref()).ok_or(Reason::UnknownMedium)?;
    if r.block_hashes.is_empty() {
        return Err(Reason::Empty);
    }
    Ok(Mutation::Removed {
        worker,
        tier,
        blocks: r
            .block_hashes
            .iter()
            .copied()
            .map(ExternalBlockHash::new)
            .collect(),
    })
}

fn check_group(group_idx: Option<u64>) -> Result<(), Reason> {
    match group_idx {
        None | Some(0) => Ok(()),
        Some(_) => Err(Reason::NonMainGroup),
    }
}

fn check_placement(locality: Option<&str>, ownership: Option<&str>) -> Result<(), Reason> {
    if locality.is_some_and(|l| !l.eq_ignore_ascii_case("LOCAL")) {
        return Err(Reason::NonLocalLocality);
    }
    if ownership.is_some_and(|o| !o.is_empty()) {
        return Err(Reason::ForeignOwnership);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_map_case_insensitively() {
        assert_eq!(tier_for_medium(None), Some(Tier::Device));
        assert_eq!(tier_for_medium(Some("")), Some(Tier::Device));
        assert_eq!(tier_for_medium(Some("gpu")), Some(Tier::Device));
        assert_eq!(tier_for_medium(Some("cpu")), Some(Tier::Host));
        assert_eq!(tier_for_medium(Some("Cpu_Pinned")), Some(Tier::Host));
        assert_eq!(tier_for_medium(Some("CPU_TIER2")), Some(Tier::Disk));
        assert_eq!(tier_for_medium(Some("disk")), Some(Tier::Disk));
        assert_eq!(tier_for_medium(Some("STORAGE")), Some(Tier::Disk));
        assert_eq!(tier_for_medium(Some("EXTERNAL")), Some(Tier::External));
        assert_eq!(tier_for_medium(Some("my-connector")), None);
    }

    /// A batch of many events that do not decode (one-byte nils) keeps the first
    /// [`crate::MAX_SKIPPED_KEPT`] with their position, counts the others by reason (each was a
    /// 32-byte record: 32 times the payload), and every one is counted as dropped.
    #[test]
    fn skipped_events_beyond_the_kept_ones_are_counted_not_kept() {
        const EVENTS: u32 = 100_000;
        // [ts, [nil × EVENTS], nil]
        let mut payload = vec![0x93, 0xcb];
        payload.extend_from_slice(&1_700_000_000.0f64.to_be_bytes());
        payload.push(0xdd);
        payload.extend_from_slice(&EVENTS.to_be_bytes());
        payload.extend(std::iter::repeat_n(0xc0, EVENTS as usize));
        payload.push(0xc0);
        let batch = crate::decode_batch(&payload).expect("the batch decodes");
        assert!(batch.events.is_empty());
        assert_eq!(batch.skipped.len(), crate::MAX_SKIPPED_KEPT);
        assert_eq!(batch.skipped[3].index, 3);
        let beyond: u64 = batch.skipped_beyond.iter().map(|&(_, n)| n).sum();
        assert_eq!(beyond, u64::from(EVENTS) - crate::MAX_SKIPPED_KEPT as u64);
        assert!(
            batch.skipped.capacity() * std::mem::size_of::<crate::SkippedEvent>()
                <= payload.len() / 16,
            "{} skipped events kept",
            batch.skipped.capacity()
        );
        let converter = Converter::new(Source {
            worker_id: 1,
            dp_rank: 0,
            block_size: kvatlas_hash::BlockSize::new(16).expect("a block size"),
            engine: EngineKind::Vllm,
        });
        let (mut out, mut drops) = (Vec::new(), DropCounters::default());
        converter.convert_batch(&batch, &mut out, &mut drops);
        assert!(out.is_empty());
        assert_eq!(drops.total(), u64::from(EVENTS));
    }
}
