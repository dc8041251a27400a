//! `PublishEvents`: KV events pushed over gRPC in kvatlas's engine-neutral form, for engines or
//! sidecars that cannot use ZMQ (and for tests).
//!
//! Each message is one batch of one worker rank's events. It is checked whole before anything is
//! applied ([`Publisher::prepare`]: the index, the block size, every event); a bad message ends
//! the stream with INVALID_ARGUMENT naming the event and field, and everything before it stays
//! applied. Then the rank's sequence number is checked ([`Publisher::admit`]), with the
//! listener's rules for a source without replay:
//!
//! | the batch's `seq` | outcome |
//! |---|---|
//! | absent | applied (unsequenced) |
//! | the rank's first, or last + 1 | applied |
//! | at or below the last applied | a duplicate: dropped and counted (a retry is harmless) |
//! | 0 after a higher number | an engine restart: the rank is cleared (counted), then applied |
//! | beyond last + 1 | a gap: the lost batches cannot be recovered, so the rank is cleared (counted, and reported in `last_error`), then the batch is applied |
//!
//! A sequenced batch's checkpoint fingerprint is chained onto the rank's history (a resync
//! onto the batch before it, any other batch onto its epoch's resync: [`fingerprint`]),
//! across producer restarts and, on an ingest, across an unregistration
//! within the event log's duplicate window ([`RetiredChains`]): the stream's duplicate window
//! never takes a restarted producer's batch for its earlier incarnation's.
//!
//! A rank fed over gRPC is registered by its first message (source `GRPC` in `ListWorkers`); it
//! cannot also have a ZMQ listener, and one stream at a time feeds it, so its events reach its
//! writer lane in order. A rank restored from the data directory's snapshot keeps its last
//! sequence number, also one the restore could not feed again at once (the rank limit): fed
//! again later, it continues from it.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::sync::Arc;
use std::time::Instant;

use kvatlas_index::{ExternalBlockHash, Mutation, StoredBlock, Tier, Worker};
use kvatlas_proto::v1::{self, kv_event};

use crate::error::ServiceError;
use crate::registry::{Feed, GrpcFeed, IndexEntry, IndexKey, Registry, Unfed, block_size_field};
use crate::snapshot::RecordedFeed;

/// A checked message, ready to apply.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) entry: Arc<IndexEntry>,
    /// Whether this message created the index (removed again if the message is refused).
    created: bool,
    pub(crate) worker: Worker,
    pub(crate) seq: Option<u64>,
    pub(crate) mutations: Vec<Mutation>,
    /// A sequenced batch's [`content_digest`] (0 for an unsequenced one).
    content: u64,
}

/// The fingerprint a `PublishEvents` batch's checkpoint records, as a listener's is the hash
/// of the engine's payload: the digest of its mutations (`content`, [`content_digest`]),
/// whether a resync's clear goes before them, chained onto `after`: for a resync, the
/// fingerprint of the rank's batch before it, and it opens an epoch; for any other batch, its
/// epoch's resync (`None` before the feed's first resync, or, for a rank unregistered within
/// the event log's duplicate window, the unregistered feed's last fingerprint). A replica and
/// the event log's duplicate window tell two batches of a rank at one sequence number apart
/// by it: a producer that restarted at 0 is not taken for a retry of its first incarnation's
/// batch. The chain is what tells a restarted producer's batches from its earlier
/// incarnation's when their contents are alike: without it, a producer that sent the same
/// batch 1 after a restart had it dropped by the stream as a duplicate of the first
/// incarnation's batch 1, and one that restarted twice with the same batch 0 had its second
/// resync dropped — the replicas missed either. Two ingests fed the same messages of a rank
/// chain alike, so they still publish each batch under one message id; and since a batch
/// chains onto its epoch, not its predecessor, an ingest restarted while the producer runs
/// (fed from the middle, no epoch) still agrees with the other as long as the producer has
/// not restarted since the other began.
pub(crate) fn fingerprint(content: u64, resync: bool, after: Option<u64>) -> u64 {
    let mut bytes = [0u8; 18];
    bytes[0] = u8::from(resync);
    bytes[1] = u8::from(after.is_some());
    bytes[2..10].copy_from_slice(&content.to_le_bytes());
    bytes[10..].copy_from_slice(&after.unwrap_or(0).to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// The digest of a batch's mutations (computed before the rank's lock is taken: a message may
/// hold a million blocks).
pub(crate) fn content_digest(mutations: &[Mutation]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for mutation in mutations {
        let worker = mutation.worker();
        let (kind, tier) = match mutation {
            Mutation::Stored { tier, .. } => (1u8, tier.index() as u8),
            Mutation::Removed { tier, .. } => (2, tier.index() as u8),
            Mutation::Cleared { .. } => (3, 0),
        };
        hasher.update(&[kind, tier]);
        hasher.update(&worker.worker_id.to_le_bytes());
        hasher.update(&worker.dp_rank.to_le_bytes());
        match mutation {
            Mutation::Stored { parent, blocks, .. } => {
                hasher.update(&[u8::from(parent.is_some())]);
                hasher.update(&parent.map_or(0, ExternalBlockHash::get).to_le_bytes());
                hasher.update(&(blocks.len() as u64).to_le_bytes());
                for block in blocks {
                    hasher.update(&block.external.get().to_le_bytes());
                    hasher.update(&block.local.get().to_le_bytes());
                }
            }
            Mutation::Removed { blocks, .. } => {
                hasher.update(&(blocks.len() as u64).to_le_bytes());
                for block in blocks {
                    hasher.update(&block.get().to_le_bytes());
                }
            }
            Mutation::Cleared { .. } => {}
        }
    }
    hasher.digest()
}

/// What to do with a prepared message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Apply it, after clearing the rank if `resync`.
    Apply {
        /// Clear the rank first (a gap or an engine restart).
        resync: bool,
        /// A sequenced batch's fingerprint ([`fingerprint`]), for its checkpoint; `None` for
        /// an unsequenced one.
        fingerprint: Option<u64>,
    },
    /// Drop it: its sequence number was already applied.
    Duplicate,
}

/// One `PublishEvents` stream's state: the ranks it feeds and its counts.
#[derive(Debug)]
pub(crate) struct Publisher {
    stream: u64,
    registry: Arc<Registry>,
    /// The ranks this stream fed, with their index.
    fed: BTreeMap<(IndexKey, Worker), Arc<IndexEntry>>,
    pub(crate) counts: v1::PublishEventsResponse,
}

impl Publisher {
    /// A new stream's state; `stream` identifies it among open streams.
    pub(crate) fn new(stream: u64, registry: Arc<Registry>) -> Self {
        Self {
            stream,
            registry,
            fed: BTreeMap::new(),
            counts: v1::PublishEventsResponse::default(),
        }
    }

    /// Checks a message whole and converts its events (nothing is applied).
    ///
    /// # Errors
    /// INVALID_ARGUMENT naming the bad field, NOT_FOUND for an unknown index without a block
    /// size, FAILED_PRECONDITION for a block-size mismatch.
    pub(crate) fn prepare(
        &self,
        message: &v1::PublishEventsRequest,
    ) -> Result<Prepared, ServiceError> {
        let selector = message.index.clone().unwrap_or_default();
        let key = IndexKey::new(selector.model, selector.tenant);
        let block_size = (message.block_size != 0)
            .then(|| block_size_field(message.block_size, "block_size"))
            .transpose()?;
        let (entry, created) = self.registry.index_for(&key, block_size)?;
        let worker = Worker::new(message.instance_id, message.dp_rank);
        let mutations = match convert_events(&entry, worker, &message.events) {
            Ok(mutations) => mutations,
            Err(error) => {
                if created {
                    self.registry.forget_if_unused(&entry);
                }
                return Err(error);
            }
        };
        let content = message.seq.map_or(0, |_| content_digest(&mutations));
        Ok(Prepared {
            entry,
            created,
            worker,
            seq: message.seq,
            mutations,
            content,
        })
    }

    /// Checks the rank's feed and sequence number and records the batch (see the module docs).
    ///
    /// # Errors
    /// FAILED_PRECONDITION if a ZMQ listener or another stream feeds the rank,
    /// RESOURCE_EXHAUSTED at the registered-rank limit.
    pub(crate) fn admit(&mut self, prepared: &Prepared) -> Result<Admission, ServiceError> {
        let admitted = self.admit_feed(prepared);
        if admitted.is_err() && prepared.created {
            self.registry.forget_if_unused(&prepared.entry);
        }
        if self.fed.len() > self.registry.limits().max_registered_ranks {
            self.forget_gone_ranks();
        }
        admitted
    }

    /// Forgets the ranks this stream no longer feeds (unregistered since, or fed by another
    /// stream now). A long-lived stream of a churning fleet feeds ever new instances; the
    /// ranks it feeds at once are at most `--max-registered-ranks`, and so, pruned past it, is
    /// what it remembers. (Their index is held no longer either.)
    fn forget_gone_ranks(&mut self) {
        let stream = self.stream;
        self.fed.retain(|(_, worker), entry| {
            matches!(
                entry.feeds.lock().get(worker),
                Some(Feed::Grpc(grpc)) if grpc.stream == Some(stream)
            )
        });
    }

    /// [`Publisher::admit`] but for the removal of an index the refused message created.
    fn admit_feed(&mut self, prepared: &Prepared) -> Result<Admission, ServiceError> {
        let entry = &prepared.entry;
        let worker = prepared.worker;
        let mut feeds = entry.feeds.lock();
        if entry.removed.load(std::sync::atomic::Ordering::SeqCst) {
            // Taken out of the registry by a concurrent request that created it and failed:
            // refused before the sequence number is admitted, so sending it again is safe.
            return Err(crate::registry::removed_meanwhile(&entry.key));
        }
        let feed = match feeds.entry(worker) {
            Entry::Vacant(vacant) => {
                self.registry.reserve_rank()?;
                self.registry.confirm_rank();
                tracing::info!(
                    model = %entry.key.model,
                    tenant = %entry.key.tenant,
                    instance_id = worker.worker_id,
                    dp_rank = worker.dp_rank,
                    "worker rank fed over PublishEvents"
                );
                // A rank a restore recorded as fed over PublishEvents, and could not feed
                // again, continues its sequence numbers from its checkpoint: a batch re-sent
                // at or below it is a duplicate. (Any other checkpoint — a ZMQ listener's
                // position — numbers another source's batches: a new feed starts afresh.)
                let was_unfed = entry.unfed.lock().remove(&worker);
                // (The last sequence number and the chain head the feed continues.)
                let (last_seq, last_fingerprint) = match was_unfed {
                    Some(Unfed {
                        recorded: RecordedFeed::Grpc { .. },
                        ..
                    }) => entry.index().mark(worker).map_or((None, None), |mark| {
                        (Some(mark.position), chain_head(&mark))
                    }),
                    Some(Unfed {
                        recorded: RecordedFeed::Zmq(_),
                        ..
                    }) => {
                        // The listener's position, not this client's: forgotten, so that a
                        // later restore does not number this feed's batches by it.
                        entry
                            .index()
                            .forget_marks(worker.worker_id, Some(worker.dp_rank));
                        (None, None)
                    }
                    // A fresh feed, numbered afresh; unregistered within the stream's duplicate
                    // window, it chains onto where the unregistered feed's chain stood: the same
                    // batches sent again were dropped by the stream as duplicates of the
                    // unregistered feed's, and the replicas missed them.
                    None => (None, entry.retired_chains.lock().take(worker)),
                };
                // (A restored rank's epoch is not recorded: none, as an ingest fed from the
                // middle has.)
                let epoch = if was_unfed.is_none() {
                    last_fingerprint
                } else {
                    None
                };
                vacant.insert(Feed::Grpc(Box::new(GrpcFeed {
                    last_seq,
                    last_fingerprint,
                    epoch,
                    ..GrpcFeed::default()
                })))
            }
            Entry::Occupied(occupied) => occupied.into_mut(),
        };
        let Feed::Grpc(grpc) = feed else {
            return Err(ServiceError::FailedPrecondition(format!(
                "worker {} rank {} of {} is fed by a ZMQ listener; unregister it before \
                 publishing its events over gRPC",
                worker.worker_id, worker.dp_rank, entry.key
            )));
        };
        match grpc.stream {
            Some(other) if other != self.stream => {
                return Err(ServiceError::FailedPrecondition(format!(
                    "worker {} rank {} of {} is being fed by another PublishEvents stream; one \
                     stream at a time feeds a rank (its events must stay in order)",
                    worker.worker_id, worker.dp_rank, entry.key
                )));
            }
            _ => grpc.stream = Some(self.stream),
        }
        self.fed
            .entry((entry.key.clone(), worker))
            .or_insert_with(|| Arc::clone(entry));
        grpc.counters.batches_received += 1;
        grpc.last_batch = Some(Instant::now());
        self.counts.messages_received += 1;
        let resync = match sequence(grpc, prepared.seq) {
            Sequenced::InOrder => false,
            Sequenced::Duplicate => {
                grpc.counters.duplicates += 1;
                self.counts.duplicates += 1;
                return Ok(Admission::Duplicate);
            }
            Sequenced::Gap => {
                self.counts.gaps += 1;
                true
            }
            Sequenced::Restart => true,
        };
        // A resync chains onto the batch before it and opens an epoch; any other batch chains
        // onto its epoch (see `fingerprint`).
        let fingerprint = prepared.seq.map(|_| {
            let chained = if resync {
                let opened = fingerprint(prepared.content, true, grpc.last_fingerprint);
                grpc.epoch = Some(opened);
                opened
            } else {
                fingerprint(prepared.content, false, grpc.epoch)
            };
            grpc.last_fingerprint = Some(chained);
            chained
        });
        grpc.counters.batches_applied += 1;
        grpc.counters.mutations_enqueued += prepared.mutations.len() as u64;
        if resync {
            grpc.counters.resyncs += 1;
            self.counts.resyncs += 1;
        }
        Ok(Admission::Apply {
            resync,
            fingerprint,
        })
    }

    /// Counts an applied message.
    pub(crate) fn applied(&mut self, events: usize) {
        self.counts.messages_applied += 1;
        self.counts.events_applied += events as u64;
    }

    /// The indexes this stream fed (to flush before acknowledging).
    pub(crate) fn fed_indexes(&self) -> Vec<Arc<IndexEntry>> {
        let mut seen = BTreeMap::new();
        for ((key, _), entry) in &self.fed {
            seen.entry(key.clone()).or_insert_with(|| Arc::clone(entry));
        }
        seen.into_values().collect()
    }

    /// The response: the counts and the last applied sequence number of every rank this stream
    /// fed (of those it still feeds, once it fed more than `--max-registered-ranks`).
    pub(crate) fn response(&self) -> v1::PublishEventsResponse {
        let mut response = self.counts.clone();
        response.ranks = self
            .fed
            .iter()
            .map(|((key, worker), entry)| {
                let last_seq = match entry.feeds.lock().get(worker) {
                    Some(Feed::Grpc(grpc)) => grpc.last_seq,
                    _ => None,
                };
                v1::RankProgress {
                    index: Some(v1::IndexSelector {
                        model: key.model.clone(),
                        tenant: key.tenant.clone(),
                    }),
                    instance_id: worker.worker_id,
                    dp_rank: worker.dp_rank,
                    last_seq,
                }
            })
            .collect();
        response
    }
}

impl Drop for Publisher {
    /// Releases the ranks this stream fed, so another stream may feed them.
    fn drop(&mut self) {
        for ((_, worker), entry) in &self.fed {
            if let Some(Feed::Grpc(grpc)) = entry.feeds.lock().get_mut(worker)
                && grpc.stream == Some(self.stream)
            {
                grpc.stream = None;
            }
        }
    }
}

/// Where a batch's sequence number falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sequenced {
    /// Unsequenced, the rank's first, or the next one.
    InOrder,
    /// At or below the last applied.
    Duplicate,
    /// Beyond the next one.
    Gap,
    /// 0 after a higher number.
    Restart,
}

/// The sequencing rules of the module docs, recording gaps and restarts in `grpc` and moving
/// its last sequence number.
/// Where the chains of `PublishEvents` ranks unregistered at an ingest stood
/// ([`fingerprint`]), kept for the stream's duplicate window: a new feed of the rank within it
/// chains onto its predecessor's head, so its batches are not taken for the unregistered
/// feed's. Invariant: at most [`RETIRED_CHAINS_KEPT`] entries, none older than the window it
/// was retired with (pruned as entries are added; an entry evicted early, past the bound, lets
/// a new feed that sends the same batches again within the window lose them at the replicas).
#[derive(Debug, Default)]
pub(crate) struct RetiredChains {
    heads: std::collections::HashMap<Worker, (u64, Instant)>,
    /// The entries in the order they were retired (an ingest's window is one length, so also
    /// in the order they expire), with when they expire; one whose rank was retired again
    /// since is stale (its expiry is not the rank's in `heads`).
    order: std::collections::VecDeque<(Worker, Instant)>,
}

/// The most unregistered chains an index remembers ([`RetiredChains`]).
pub(crate) const RETIRED_CHAINS_KEPT: usize = 65_536;

impl RetiredChains {
    /// Remembers that `worker`'s chain stood at `head` when it was unregistered, for `window`.
    pub(crate) fn retire(&mut self, worker: Worker, head: u64, window: std::time::Duration) {
        let now = Instant::now();
        let expires = now.checked_add(window).unwrap_or(now);
        while let Some(&(oldest, until)) = self.order.front()
            && (until <= now || self.order.len() >= RETIRED_CHAINS_KEPT)
        {
            self.order.pop_front();
            if self.heads.get(&oldest).is_some_and(|(_, at)| *at == until) {
                self.heads.remove(&oldest);
            }
        }
        self.heads.insert(worker, (head, expires));
        self.order.push_back((worker, expires));
    }

    /// Whether any chain is remembered still within its window.
    pub(crate) fn live(&self) -> bool {
        let now = Instant::now();
        self.heads.values().any(|(_, until)| *until > now)
    }

    /// The head `worker`'s unregistered chain stood at, if within its window; forgotten.
    pub(crate) fn take(&mut self, worker: Worker) -> Option<u64> {
        self.heads
            .remove(&worker)
            .filter(|(_, until)| *until > Instant::now())
            .map(|(head, _)| head)
    }
}

/// The fingerprint of the batch at `mark`'s position (what a restored rank's next batch chains
/// onto, [`fingerprint`]), if the mark still has it.
pub(crate) fn chain_head(mark: &crate::snapshot::SourceMark) -> Option<u64> {
    mark.recent
        .last()
        .filter(|(seq, _)| *seq == mark.position)
        .map(|(_, fingerprint)| *fingerprint)
}

fn sequence(grpc: &mut GrpcFeed, seq: Option<u64>) -> Sequenced {
    let Some(seq) = seq else {
        return Sequenced::InOrder;
    };
    let outcome = match grpc.last_seq {
        None => Sequenced::InOrder,
        Some(last) if last.checked_add(1) == Some(seq) => Sequenced::InOrder,
        Some(last) if seq == 0 && last > 0 => {
            grpc.counters.restarts += 1;
            grpc.last_error = Some(format!(
                "engine restart: sequence number 0 after {last}; the rank was cleared"
            ));
            Sequenced::Restart
        }
        Some(last) if seq <= last => return Sequenced::Duplicate,
        Some(last) => {
            grpc.counters.gaps += 1;
            grpc.last_error = Some(format!(
                "gap: batches {}..={} never arrived; the rank was cleared and is rebuilt from \
                 later events",
                last + 1,
                seq - 1
            ));
            Sequenced::Gap
        }
    };
    grpc.last_seq = Some(seq);
    outcome
}

/// The tier of a proto enum value (`field` names it in the error).
pub(crate) fn tier_of(value: i32, field: &str) -> Result<Tier, ServiceError> {
    match v1::StorageTier::try_from(value) {
        Ok(v1::StorageTier::Device) => Ok(Tier::Device),
        Ok(v1::StorageTier::Host) => Ok(Tier::Host),
        Ok(v1::StorageTier::Disk) => Ok(Tier::Disk),
        Ok(v1::StorageTier::External) => Ok(Tier::External),
        Err(_) => Err(ServiceError::InvalidArgument(format!(
            "{field} is {value}, not a storage tier (0 device, 1 host, 2 disk, 3 external)"
        ))),
    }
}

/// Converts and checks a message's events for `worker` (all or none).
fn convert_events(
    entry: &IndexEntry,
    worker: Worker,
    events: &[v1::KvEvent],
) -> Result<Vec<Mutation>, ServiceError> {
    let block = entry.block_size.as_usize();
    let mut mutations = Vec::with_capacity(events.len());
    for (i, event) in events.iter().enumerate() {
        let invalid = |what: String| ServiceError::InvalidArgument(format!("events[{i}]: {what}"));
        let mutation = match &event.event {
            None => {
                return Err(invalid(
                    "no event set (one of stored, removed, cleared)".into(),
                ));
            }
            Some(kv_event::Event::Stored(stored)) => {
                let n = stored.block_hashes.len();
                if n == 0 {
                    return Err(invalid("stored.block_hashes is empty".into()));
                }
                let tier = tier_of(stored.tier, &format!("events[{i}].stored.tier"))?;
                let locals: Vec<u64> =
                    match (stored.token_ids.is_empty(), stored.local_hashes.is_empty()) {
                        (false, true) => {
                            let expected = n.saturating_mul(block);
                            if stored.token_ids.len() != expected {
                                return Err(invalid(format!(
                                    "stored has {} token ids for {n} blocks of {block} tokens; \
                                 exactly {expected} are needed (only full blocks are indexed)",
                                    stored.token_ids.len()
                                )));
                            }
                            let hasher = entry
                                .hasher_for(&stored.lora_name, &stored.cache_salt)
                                .map_err(|e| invalid(e.to_string()))?;
                            stored
                                .token_ids
                                .chunks_exact(block)
                                .map(|chunk| hasher.hash_block(chunk).get())
                                .collect()
                        }
                        (true, false) => {
                            if stored.local_hashes.len() != n {
                                return Err(invalid(format!(
                                    "stored has {} local hashes for {n} block hashes; give one per \
                                 block",
                                    stored.local_hashes.len()
                                )));
                            }
                            if !stored.lora_name.is_empty() || !stored.cache_salt.is_empty() {
                                return Err(invalid(
                                    "stored.lora_name and stored.cache_salt apply to token_ids \
                                 only: local hashes already carry them"
                                        .into(),
                                ));
                            }
                            stored.local_hashes.clone()
                        }
                        (false, false) => {
                            return Err(invalid(
                                "stored gives both token_ids and local_hashes; give one".into(),
                            ));
                        }
                        (true, true) => {
                            return Err(invalid(
                                "stored gives neither token_ids nor local_hashes; the index needs \
                             one of them to place the blocks"
                                    .into(),
                            ));
                        }
                    };
                Mutation::Stored {
                    worker,
                    tier,
                    parent: stored.parent_hash.map(ExternalBlockHash::new),
                    blocks: stored
                        .block_hashes
                        .iter()
                        .zip(locals)
                        .map(|(&external, local)| StoredBlock {
                            external: ExternalBlockHash::new(external),
                            local: kvatlas_hash::LocalBlockHash::new(local),
                        })
                        .collect(),
                }
            }
            Some(kv_event::Event::Removed(removed)) => {
                if removed.block_hashes.is_empty() {
                    return Err(invalid("removed.block_hashes is empty".into()));
                }
                Mutation::Removed {
                    worker,
                    tier: tier_of(removed.tier, &format!("events[{i}].removed.tier"))?,
                    blocks: removed
                        .block_hashes
                        .iter()
                        .copied()
                        .map(ExternalBlockHash::new)
                        .collect(),
                }
            }
            Some(kv_event::Event::Cleared(_)) => Mutation::Cleared { worker },
        };
        mutations.push(mutation);
    }
    Ok(mutations)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A retired chain is handed to the rank's next feed once, within its window only, and
    /// the oldest goes first past the bound.
    #[test]
    fn retired_chains_keep_to_their_window_and_bound() {
        let window = std::time::Duration::from_secs(120);
        let mut chains = RetiredChains::default();
        chains.retire(Worker::new(1, 0), 11, window);
        chains.retire(Worker::new(2, 0), 22, std::time::Duration::ZERO);
        assert_eq!(chains.take(Worker::new(1, 0)), Some(11));
        assert_eq!(chains.take(Worker::new(1, 0)), None, "handed over once");
        assert_eq!(chains.take(Worker::new(2, 0)), None, "past its window");
        for id in 0..RETIRED_CHAINS_KEPT as u64 + 1 {
            chains.retire(Worker::new(100 + id, 0), id, window);
        }
        assert_eq!(chains.heads.len(), RETIRED_CHAINS_KEPT);
        assert_eq!(chains.take(Worker::new(100, 0)), None, "the oldest went");
        assert_eq!(chains.take(Worker::new(101, 0)), Some(1));
    }

    /// A batch's fingerprint tells apart what the duplicate window must not merge: the same
    /// mutations after another chain head, or with a resync's clear.
    #[test]
    fn fingerprints_chain_onto_the_batch_before() {
        let content = 0xabcd;
        let fresh = fingerprint(content, false, None);
        assert_eq!(
            fresh,
            fingerprint(content, false, None),
            "alike for two ingests"
        );
        assert_ne!(fresh, fingerprint(content, true, None));
        assert_ne!(fresh, fingerprint(content, false, Some(0)));
        assert_ne!(
            fingerprint(content, false, Some(1)),
            fingerprint(content, false, Some(2))
        );
    }

    /// The fingerprints `seqs` of instance 1's (empty) batches get at a fresh registry's
    /// stream, in order (`None`: a duplicate).
    fn fingerprints_of(registry: &Arc<Registry>, seqs: &[u64]) -> Vec<Option<u64>> {
        let mut publisher = Publisher::new(1, Arc::clone(registry));
        seqs.iter()
            .map(|&seq| {
                let prepared = publisher.prepare(&message(1, seq)).expect("prepared");
                match publisher.admit(&prepared).expect("admitted") {
                    Admission::Apply { fingerprint, .. } => fingerprint,
                    Admission::Duplicate => None,
                }
            })
            .collect()
    }

    fn fresh_registry() -> Arc<Registry> {
        Arc::new(Registry::new(
            crate::config::IndexSettings::default(),
            crate::config::Limits::default(),
        ))
    }

    /// Batches alike in number and content are told apart across producer restarts, and two
    /// ingests agree on every batch's fingerprint — also one fed from the middle (restarted
    /// while the producer ran), until the producer's next restart.
    #[test]
    fn fingerprints_tell_incarnations_apart_and_ingests_agree() {
        let first = fresh_registry();
        let all = fingerprints_of(&first, &[0, 1, 2, 3, 0, 1, 0]);
        let (run1, run2, run3) = (&all[..4], &all[4..6], &all[6..]);
        assert!(all.iter().all(Option::is_some));
        assert_ne!(
            run2[1], run1[1],
            "batch 1 after a restart is not the first run's"
        );
        assert_ne!(
            run3[0], run2[0],
            "a second restart's resync is not the first's"
        );
        assert_ne!(run2[0], run1[0]);
        // An ingest fed from batch 2 on agrees from there.
        let second = fresh_registry();
        let from_the_middle = fingerprints_of(&second, &[2, 3, 0, 1, 0]);
        assert_eq!(from_the_middle, all[2..].to_vec());
    }

    #[test]
    fn sequence_rules() {
        let mut feed = GrpcFeed::default();
        use Sequenced::*;
        assert_eq!(sequence(&mut feed, Some(5)), InOrder, "any first number");
        assert_eq!(sequence(&mut feed, Some(6)), InOrder);
        assert_eq!(sequence(&mut feed, Some(6)), Duplicate);
        assert_eq!(sequence(&mut feed, Some(2)), Duplicate);
        assert_eq!(sequence(&mut feed, None), InOrder, "unsequenced");
        assert_eq!(sequence(&mut feed, Some(9)), Gap, "7..=8 lost");
        assert_eq!(feed.counters.gaps, 1);
        assert!(
            feed.last_error
                .as_deref()
                .is_some_and(|e| e.contains("7..=8"))
        );
        assert_eq!(sequence(&mut feed, Some(0)), Restart);
        assert_eq!(feed.counters.restarts, 1);
        assert_eq!(sequence(&mut feed, Some(1)), InOrder);
        assert_eq!(feed.last_seq, Some(1));
    }

    /// The index image of the unfed-rank tests: ranks 1 and 2 of model `m` recorded as fed over
    /// `PublishEvents`, with checkpoints 5 and 7 and one block each.
    fn two_grpc_ranks() -> crate::snapshot::IndexImage {
        use crate::snapshot::{IndexImage, RecordedFeed, SourceMark};
        use kvatlas_index::{Snapshot, SnapshotBlock, TierSet, WorkerSnapshot};

        let (first, second) = (Worker::new(1, 0), Worker::new(2, 0));
        let mark = |position| SourceMark {
            position,
            recent: Vec::new(),
        };
        let holding = |worker: Worker| WorkerSnapshot {
            worker,
            blocks: vec![SnapshotBlock {
                external: ExternalBlockHash::new(worker.worker_id * 10),
                local: kvatlas_hash::LocalBlockHash::new(worker.worker_id * 100),
                parent: None,
                tiers: TierSet::only(Tier::Device),
            }],
        };
        IndexImage {
            key: IndexKey::new("m", crate::registry::DEFAULT_TENANT),
            block_size: kvatlas_hash::BlockSize::new(16).expect("16"),
            capacity: None,
            feeds: vec![
                RecordedFeed::Grpc { worker: first },
                RecordedFeed::Grpc { worker: second },
            ],
            marks: std::collections::BTreeMap::from([(first, mark(5)), (second, mark(7))]),
            snapshot: Snapshot {
                workers: vec![holding(first), holding(second)],
            },
        }
    }

    /// A registry of at most one registered rank, with [`two_grpc_ranks`] restored as after a
    /// restart: rank 1 is fed again, rank 2 does not fit and is unfed.
    fn restored_with_one_unfed() -> Arc<Registry> {
        crate::registry::restored_within_one_rank(two_grpc_ranks()).0
    }

    fn message(instance_id: u64, seq: u64) -> v1::PublishEventsRequest {
        v1::PublishEventsRequest {
            index: Some(v1::IndexSelector {
                model: "m".into(),
                tenant: String::new(),
            }),
            instance_id,
            seq: Some(seq),
            block_size: 16,
            ..v1::PublishEventsRequest::default()
        }
    }

    /// A `PublishEvents` rank a restart could not feed again (the rank limit) is listed with
    /// its reason, still recorded in the next snapshot, and — fed again once a place is free —
    /// continues from its checkpoint: a batch the client re-sends at or below it is a
    /// duplicate (it was applied again: the new feed had no last sequence number).
    #[test]
    fn a_rank_restored_without_its_feed_continues_from_its_checkpoint() {
        let registry = restored_with_one_unfed();
        let entry = registry.all().pop().expect("the index");
        let views = entry.rank_views(&entry.blocks_per_rank());
        let unfed = views
            .iter()
            .find(|v| v.worker == Worker::new(2, 0))
            .expect("the unfed rank is listed");
        assert!(matches!(unfed.source, crate::registry::RankSource::Grpc));
        assert_eq!(unfed.last_seq, Some(7));
        assert!(
            unfed
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("not fed since the snapshot was restored")),
            "{:?}",
            unfed.last_error
        );
        assert_eq!(
            entry.image().feeds,
            two_grpc_ranks().feeds,
            "the next snapshot records both feeds"
        );

        registry
            .unregister("m", None, 1, None, |_| true)
            .expect("unregistered");
        let mut publisher = Publisher::new(1, Arc::clone(&registry));
        let again = publisher.prepare(&message(2, 7)).expect("prepared");
        assert_eq!(
            publisher.admit(&again).expect("admitted"),
            Admission::Duplicate
        );
        let next = publisher.prepare(&message(2, 8)).expect("prepared");
        assert!(matches!(
            publisher.admit(&next).expect("admitted"),
            Admission::Apply { resync: false, .. }
        ));
        assert!(entry.unfed.lock().is_empty(), "the rank is fed again");
        // Batch 8 is accepted, not applied (nothing was queued here): ListWorkers' last_seq is
        // what a query sees, the checkpoint 7.
        let views = entry.rank_views(&entry.blocks_per_rank());
        let fed = views
            .iter()
            .find(|v| v.worker == Worker::new(2, 0))
            .expect("listed");
        assert_eq!(fed.last_seq, Some(7));
    }

    /// Unregistering a rank nobody feeds (not fed since the restore) removes its blocks and
    /// its checkpoint, without giving back a registered rank's place it never held (it was
    /// NOT_FOUND and kept both); a later feed of the same id starts afresh.
    #[test]
    fn an_unfed_rank_is_unregistered_with_its_blocks_and_checkpoint() {
        let registry = restored_with_one_unfed();
        let entry = registry.all().pop().expect("the index");
        let removed = registry
            .unregister("m", None, 2, Some(0), |_| true)
            .expect("the unfed rank is unregistered");
        assert_eq!((removed.ranks_removed, removed.blocks_removed), (1, 1));
        assert_eq!(registry.registered_ranks(), 1, "rank 1 keeps its place");
        assert!(entry.index().mark(Worker::new(2, 0)).is_none());
        assert!(!entry.blocks_per_rank().contains_key(&Worker::new(2, 0)));
        assert_eq!(entry.image().feeds.len(), 1, "only rank 1 is recorded");
        assert!(
            registry.unregister("m", None, 2, None, |_| true).is_err(),
            "nothing of it is left"
        );
    }

    /// A checkpoint a new feed did not record itself — after a peer bootstrap, a ZMQ
    /// listener's position — does not number a `PublishEvents` client's batches.
    #[test]
    fn a_new_feed_does_not_take_a_checkpoint_it_did_not_record() {
        let registry = Arc::new(Registry::new(
            crate::config::IndexSettings::default(),
            crate::config::Limits::default(),
        ));
        registry
            .restore_images(&[two_grpc_ranks()], None)
            .expect("bootstrapped as from a peer");
        let mut publisher = Publisher::new(1, Arc::clone(&registry));
        let first = publisher.prepare(&message(2, 1)).expect("prepared");
        assert!(matches!(
            publisher.admit(&first).expect("admitted"),
            Admission::Apply { resync: false, .. }
        ));
    }

    /// A rank a restore recorded as fed by a ZMQ listener, and could not feed again, fed over
    /// `PublishEvents` later: the listener's position does not number the client's batches
    /// (a batch numbered 1 is applied, not dropped as a duplicate), and it is forgotten, so
    /// that a later restore does not number them by it either.
    #[test]
    fn a_feed_of_the_other_kind_does_not_take_the_recorded_checkpoint() {
        use crate::snapshot::RecordedFeed;

        let mut image = two_grpc_ranks();
        image.feeds[1] = RecordedFeed::Zmq(zmq_rank(2, "tcp://127.0.0.1:1"));
        let (registry, failed) = crate::registry::restored_within_one_rank(image);
        assert_eq!(failed, 1, "the listener does not fit the rank limit");
        let entry = registry.all().pop().expect("the index");
        assert!(entry.unfed.lock().contains_key(&Worker::new(2, 0)));
        registry
            .unregister("m", None, 1, None, |_| true)
            .expect("unregistered");

        let mut publisher = Publisher::new(1, Arc::clone(&registry));
        let first = publisher.prepare(&message(2, 1)).expect("prepared");
        assert!(matches!(
            publisher.admit(&first).expect("admitted"),
            Admission::Apply { resync: false, .. }
        ));
        assert!(
            entry.index().mark(Worker::new(2, 0)).is_none(),
            "the listener's checkpoint is forgotten"
        );
    }

    /// Rank 0 of `instance_id` in [`two_grpc_ranks`]'s index, fed by a vLLM publisher at
    /// `endpoint`.
    fn zmq_rank(instance_id: u64, endpoint: &str) -> crate::registry::WorkerRegistration {
        let image = two_grpc_ranks();
        crate::registry::vllm_rank(&image.key, instance_id, image.block_size, endpoint)
    }

    /// A ZMQ registration of a rank a restore recorded as fed over `PublishEvents` sets the
    /// client's checkpoint aside (it does not number the engine's batches); when the listener
    /// fails to start, the checkpoint is put back and the rank stays unfed, so the client
    /// feeding it again still continues from it (the checkpoint was lost, and a re-sent batch
    /// was applied a second time).
    #[test]
    fn a_failed_registration_keeps_an_unfed_ranks_checkpoint() {
        let registry = restored_with_one_unfed();
        let entry = registry.all().pop().expect("the index");
        registry
            .unregister("m", None, 1, None, |_| true)
            .expect("unregistered");
        let refused = registry.register(zmq_rank(2, "not-an-endpoint"));
        assert!(
            matches!(refused, Err(ServiceError::InvalidArgument(_))),
            "{refused:?}"
        );
        assert_eq!(
            entry.index().mark(Worker::new(2, 0)).map(|m| m.position),
            Some(7),
            "the checkpoint is back"
        );
        assert!(entry.unfed.lock().contains_key(&Worker::new(2, 0)));

        let mut publisher = Publisher::new(1, Arc::clone(&registry));
        let again = publisher.prepare(&message(2, 7)).expect("prepared");
        assert_eq!(
            publisher.admit(&again).expect("admitted"),
            Admission::Duplicate
        );
    }

    /// A rank not fed since the restore is still known as registered: Dynamo's `/unregister`
    /// of it under another model names where it is, and the shutdown report gives its
    /// checkpoint (both read the live feeds only).
    #[test]
    fn an_unfed_rank_is_named_where_registered_ranks_are() {
        let registry = restored_with_one_unfed();
        assert_eq!(
            crate::dynamo::unregister_not_found(&registry, "other", None, 2, None, |_| true),
            "instance 2 is registered for model=m routing_group=default"
        );
        let report = crate::server::final_report(&registry);
        assert_eq!(
            report.indexes[0].last_seq,
            [(Worker::new(1, 0), Some(5)), (Worker::new(2, 0), Some(7))]
        );
    }

    /// A long-lived stream that feeds instance after instance, each unregistered in turn,
    /// remembers at most the limit of registered ranks (plus the one it just fed).
    #[test]
    fn a_stream_forgets_the_ranks_it_no_longer_feeds() {
        let limits = crate::config::Limits {
            max_registered_ranks: 4,
            ..crate::config::Limits::default()
        };
        let registry = Arc::new(Registry::new(
            crate::config::IndexSettings::default(),
            limits,
        ));
        let mut publisher = Publisher::new(1, Arc::clone(&registry));
        let message = |instance_id: u64| v1::PublishEventsRequest {
            index: Some(v1::IndexSelector {
                model: "m".into(),
                tenant: String::new(),
            }),
            instance_id,
            block_size: 16,
            ..v1::PublishEventsRequest::default()
        };
        for instance in 0..40 {
            let prepared = publisher.prepare(&message(instance)).expect("prepared");
            publisher.admit(&prepared).expect("admitted");
            registry
                .unregister("m", None, instance, None, |_| true)
                .expect("unregistered");
            assert!(
                publisher.fed.len() <= 5,
                "{} remembered",
                publisher.fed.len()
            );
        }
        // Ranks it still feeds are kept.
        for instance in 100..104 {
            let prepared = publisher.prepare(&message(instance)).expect("prepared");
            publisher.admit(&prepared).expect("admitted");
        }
        let prepared = publisher.prepare(&message(100)).expect("prepared");
        publisher.admit(&prepared).expect("admitted");
        let fed: Vec<u64> = publisher.fed.keys().map(|(_, w)| w.worker_id).collect();
        assert!(fed.ends_with(&[100, 101, 102, 103]), "{fed:?}");
    }
}
