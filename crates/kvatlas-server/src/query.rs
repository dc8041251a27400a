//! Answering a query on the caller's thread: the prompt's local hashes (hashed here from token
//! ids with the index's block size, LoRA name and cache salt, exactly as `kvatlas-events` hashes
//! the engines' stored blocks; or given by the client), one walk of the `ConcurrentAtlas`, then
//! the options.
//!
//! The walk is exact; the options only select from exact scores: `instance_ids` and
//! `min_blocks` filter, then `early_exit` and `top_k` apply to what is left (through
//! [`Matches::finish`], the index crate's one implementation of them).

use kvatlas_hash::{BlockSize, LocalBlockHash};
use kvatlas_index::{MatchOptions, Matches, SharedKvIndex};

use crate::error::ServiceError;
use crate::registry::IndexEntry;

/// A prompt as the client sent it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum QueryInput<'a> {
    /// Token ids, hashed by the server.
    Tokens(&'a [u32]),
    /// Local block hashes computed by the client.
    LocalHashes(&'a [u64]),
}

/// How to answer (see `QueryOptions` in the .proto).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct QueryOptions {
    pub(crate) early_exit: bool,
    pub(crate) top_k: Option<usize>,
    pub(crate) min_blocks: u32,
    pub(crate) instances: Vec<u64>,
    pub(crate) device_only: bool,
}

/// An answer with the index's figures.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) matches: Matches,
    pub(crate) block_size: BlockSize,
    pub(crate) query_blocks: usize,
    pub(crate) last_event_unix_micros: i64,
    pub(crate) events_applied: u64,
}

/// How many ids (token ids or local hashes) a refused prompt has, in words: one cut at
/// `kvatlas_proto::codec::token_ids_kept()` ids (by the gRPC codec, or by the JSON parse of
/// Dynamo's routes) had more than one less, how many more is not known.
fn count_of(len: usize) -> String {
    if len == kvatlas_proto::codec::token_ids_kept() {
        format!("more than {}", len - 1)
    } else {
        len.to_string()
    }
}

impl IndexEntry {
    /// Scores a prompt (see the module docs).
    ///
    /// # Errors
    /// INVALID_ARGUMENT for a prompt over `max_query_tokens`, a LoRA name or salt over
    /// `MAX_SEED_BYTES`, or a LoRA name or salt given with local hashes (they are already mixed
    /// into the hashes); FAILED_PRECONDITION on a publish-only ingest (it holds no index).
    pub(crate) fn query(
        &self,
        input: QueryInput<'_>,
        lora_name: &str,
        cache_salt: &str,
        options: &QueryOptions,
        max_query_tokens: usize,
    ) -> Result<Answer, ServiceError> {
        if self.publish_only() {
            return Err(publish_only_refusal());
        }
        let block = self.block_size.as_usize();
        let hashes: Vec<LocalBlockHash> = match input {
            QueryInput::Tokens(tokens) => {
                if tokens.len() > max_query_tokens {
                    return Err(ServiceError::InvalidArgument(format!(
                        "the prompt has {} tokens; this server accepts at most \
                         {max_query_tokens} per query",
                        count_of(tokens.len())
                    )));
                }
                self.hasher_for(lora_name, cache_salt)?
                    .local_hashes(tokens)
                    .collect()
            }
            QueryInput::LocalHashes(hashes) => {
                if hashes.len().saturating_mul(block) > max_query_tokens {
                    return Err(ServiceError::InvalidArgument(format!(
                        "the prompt has {} blocks of {block} tokens; this server accepts at most \
                         {max_query_tokens} tokens per query",
                        count_of(hashes.len())
                    )));
                }
                if !lora_name.is_empty() || !cache_salt.is_empty() {
                    return Err(ServiceError::InvalidArgument(
                        "lora_name and cache_salt apply to token queries only: local hashes \
                         already carry them (mix them into the hasher's seed)"
                            .into(),
                    ));
                }
                hashes.iter().copied().map(LocalBlockHash::new).collect()
            }
        };
        let index = self.index();
        // Read before the walk: the answer reflects at least these events.
        let last_event_unix_micros = index.last_event_unix_micros();
        let events_applied = index.events_applied();
        let matches = score(index, &hashes, options);
        Ok(Answer {
            matches,
            block_size: self.block_size,
            query_blocks: hashes.len(),
            last_event_unix_micros,
            events_applied,
        })
    }
}

/// One walk of `index`, then the options.
fn score(index: &impl SharedKvIndex, hashes: &[LocalBlockHash], options: &QueryOptions) -> Matches {
    let finishing = MatchOptions::default()
        .with_tiered(!options.device_only)
        .with_early_exit(options.early_exit)
        .with_top_k(options.top_k);
    if options.instances.is_empty() && options.min_blocks == 0 {
        return index.find_matches(hashes, &finishing);
    }
    // Filters first, on exact scores; then early exit and top-k on what is left.
    let mut matches = index.find_matches(
        hashes,
        &MatchOptions::default().with_tiered(finishing.tiered),
    );
    if !options.instances.is_empty() {
        matches
            .workers
            .retain(|m| options.instances.contains(&m.worker.worker_id));
    }
    // Without the tiered view, `disk` equals the device score.
    matches.workers.retain(|m| m.disk >= options.min_blocks);
    matches.finish(&finishing);
    matches
}

/// FAILED_PRECONDITION: a publish-only ingest answers no query.
pub(crate) fn publish_only_refusal() -> ServiceError {
    ServiceError::FailedPrecondition(
        "this server is a publish-only ingest (--publish-only): it publishes the engines' \
         events to the NATS event log and keeps no index; query a replica (kvatlas serve \
         --consume-from)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvatlas_index::{ConcurrentAtlas, ExternalBlockHash, Mutation, StoredBlock, Tier, Worker};

    /// Worker `w` holds the first `depth[w]` blocks of the chain 0, 1, 2, ... on the device.
    fn index(depths: &[(u64, u64)]) -> ConcurrentAtlas {
        let index = ConcurrentAtlas::new();
        for &(w, depth) in depths {
            index.apply(&Mutation::Stored {
                worker: Worker::new(w, 0),
                tier: Tier::Device,
                parent: None,
                blocks: (0..depth)
                    .map(|i| StoredBlock {
                        external: ExternalBlockHash::new(w * 100 + i),
                        local: LocalBlockHash::new(i),
                    })
                    .collect(),
            });
        }
        index
    }

    fn scores(matches: &Matches) -> Vec<(u64, u32)> {
        matches
            .workers
            .iter()
            .map(|m| (m.worker.worker_id, m.device))
            .collect()
    }

    #[test]
    fn filters_select_from_exact_scores_before_top_k() {
        let index = index(&[(1, 5), (2, 3), (3, 4)]);
        let query: Vec<LocalBlockHash> = (0..6).map(LocalBlockHash::new).collect();
        let all = score(&index, &query, &QueryOptions::default());
        assert_eq!(scores(&all), [(1, 5), (2, 3), (3, 4)]);
        // Top-1 among instances 2 and 3 is 3, although 1 is best overall.
        let options = QueryOptions {
            top_k: Some(1),
            instances: vec![2, 3],
            ..QueryOptions::default()
        };
        assert_eq!(scores(&score(&index, &query, &options)), [(3, 4)]);
        let options = QueryOptions {
            min_blocks: 4,
            ..QueryOptions::default()
        };
        assert_eq!(scores(&score(&index, &query, &options)), [(1, 5), (3, 4)]);
        // Early exit among the filtered: 3 leads 2 by one, so both stay exact.
        let options = QueryOptions {
            early_exit: true,
            instances: vec![2, 3],
            ..QueryOptions::default()
        };
        assert_eq!(scores(&score(&index, &query, &options)), [(2, 3), (3, 4)]);
    }
}
