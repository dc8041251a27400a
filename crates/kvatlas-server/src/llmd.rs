//! llm-d's `indexer.v1.IndexerService/GetPodScores` on kvatlas's gRPC port, so that an llm-d
//! router can ask kvatlas instead of llm-d's indexer (`docs/server.md`, "llm-d's
//! GetPodScores").
//!
//! A request is a prompt string, a model name and optionally the pods to consider. It is
//! answered like llm-d's `LongestPrefixScorer` answers it, on kvatlas's exact index:
//!
//! 1. the prompt is tokenized with the model's `tokenizer.json` (`--tokenizer MODEL=PATH`,
//!    loaded at start by [`Tokenizers::load`]) with the special tokens the tokenizer adds (vLLM's
//!    `/v1/completions` default, which llm-d's tokenizer service follows), no chat template, no
//!    truncation;
//! 2. the tokens are scored by the index of (model, the default tenant) through `query`, as a
//!    `Query` with token ids would be: per worker rank, the leading blocks held on the device
//!    tier, on device or host, and on any tier;
//! 3. each rank's score is llm-d's: the sum over its matched prefix of the block's tier weight
//!    ([`rank_score`]), added block by block as llm-d adds them;
//! 4. ranks answer as their pod ([`pod_of`]) — the registration's pod name, else a pod name of
//!    another rank of the same instance, else the instance id in decimal — and a pod with
//!    several ranks gets its best rank's score and that rank in `data_parallel_rank`;
//! 5. `pod_identifiers`, when given, keeps only those pods; pods that hold no leading block are
//!    left out, as llm-d leaves them out.
//!
//! Where kvatlas differs from llm-d, and why, is in `docs/server.md`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvatlas_index::{Matches, Worker, WorkerMatch};
use kvatlas_proto::llmd::indexer::v1::{
    GetPodScoresRequest, GetPodScoresResponse, PodScore,
    indexer_service_server::IndexerService as LlmdIndexer,
};
use tokenizers::Tokenizer;
use tonic::{Request, Response, Status};

use crate::config::TokenizerFile;
use crate::error::ServiceError;
use crate::grpc::{blocking, caller_of, status};
use crate::metrics::Rpc;
use crate::query::{QueryInput, QueryOptions};
use crate::registry::{DEFAULT_TENANT, IndexEntry, IndexKey, MAX_NAME_BYTES};
use crate::state::State;

/// llm-d's weight of a block held on the device (GPU) tier (`gpu`, `pkg/kvcache/backend.go`).
pub(crate) const DEVICE_WEIGHT: f64 = 1.0;
/// llm-d's weight of a block held on the host (CPU) tier (`cpu`).
pub(crate) const HOST_WEIGHT: f64 = 0.8;
/// llm-d's weight of a tier its defaults do not list (disk, external pools): 1.0.
pub(crate) const OTHER_WEIGHT: f64 = 1.0;

/// Most bytes of prompt accepted per token a query may have (`--max-query-tokens`): a prompt
/// longer than that is refused before it is tokenized.
pub(crate) const PROMPT_BYTES_PER_TOKEN: usize = 16;

/// Why a tokenizer could not be loaded at start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The file could not be read.
    #[error("cannot read the tokenizer of model {model:?} ({path}): {source}")]
    Read {
        /// The model.
        model: String,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a tokenizer the `tokenizers` crate can load.
    #[error(
        "the tokenizer of model {model:?} ({path}) is not a loadable tokenizer.json: {reason} \
         (give the model's Hugging Face tokenizer.json file)"
    )]
    Parse {
        /// The model.
        model: String,
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
}

/// The models' tokenizers, loaded once at start; read-only afterwards.
#[derive(Debug, Default)]
pub(crate) struct Tokenizers {
    by_model: BTreeMap<String, Arc<Tokenizer>>,
}

impl Tokenizers {
    /// Loads every file (blocking: a tokenizer.json may be tens of megabytes). Truncation and
    /// padding configured in a file are switched off: a prompt is scored whole, as vLLM
    /// tokenizes it.
    ///
    /// # Errors
    /// The first file that cannot be read or parsed.
    pub(crate) fn load(files: &[TokenizerFile]) -> Result<Self, TokenizerError> {
        let mut tokenizers = Self::default();
        for file in files {
            let bytes = std::fs::read(&file.path).map_err(|source| TokenizerError::Read {
                model: file.model.clone(),
                path: file.path.clone(),
                source,
            })?;
            let vocabulary =
                tokenizers
                    .add(&file.model, &bytes)
                    .map_err(|reason| TokenizerError::Parse {
                        model: file.model.clone(),
                        path: file.path.clone(),
                        reason,
                    })?;
            tracing::info!(
                model = %file.model,
                path = %file.path.display(),
                vocabulary,
                "loaded tokenizer"
            );
        }
        Ok(tokenizers)
    }

    /// Parses a tokenizer.json's `bytes` as `model`'s tokenizer, truncation and padding off;
    /// returns the size of its vocabulary.
    ///
    /// # Errors
    /// Why the bytes are not a tokenizer.
    pub(crate) fn add(&mut self, model: &str, bytes: &[u8]) -> Result<usize, String> {
        let mut tokenizer = Tokenizer::from_bytes(bytes).map_err(|e| e.to_string())?;
        tokenizer.with_truncation(None).map_err(|e| e.to_string())?;
        tokenizer.with_padding(None);
        let vocabulary = tokenizer.get_vocab_size(true);
        self.by_model.insert(model.to_owned(), Arc::new(tokenizer));
        Ok(vocabulary)
    }

    /// The tokenizer of `model`.
    ///
    /// # Errors
    /// FAILED_PRECONDITION naming the flag and the models that have one.
    fn of(&self, model: &str) -> Result<Arc<Tokenizer>, ServiceError> {
        self.by_model.get(model).cloned().ok_or_else(|| {
            let known: Vec<&str> = self.by_model.keys().map(String::as_str).collect();
            ServiceError::FailedPrecondition(format!(
                "no tokenizer for model {model:?}: GetPodScores takes a prompt string, which \
                 kvatlas tokenizes with the model's tokenizer.json; start kvatlas serve with \
                 --tokenizer {model}=PATH/tokenizer.json (models with a tokenizer: {known:?})"
            ))
        })
    }
}

/// The score of one rank, llm-d's way: over the matched prefix, each block's tier weight, added
/// in block order (so that the sum is bit for bit llm-d's). Blocks within the device score weigh
/// [`DEVICE_WEIGHT`], then those within the device-or-host score [`HOST_WEIGHT`], then the rest
/// of the longest match [`OTHER_WEIGHT`] — kvatlas's scores are cumulative (`docs/index.md`), so
/// a block held on the device again after the first device miss weighs as host (see
/// `docs/server.md` for when this differs from llm-d).
pub(crate) fn rank_score(m: &WorkerMatch) -> f64 {
    let mut score = 0.0;
    for block in 0..m.disk.max(m.host).max(m.device) {
        score += if block < m.device {
            DEVICE_WEIGHT
        } else if block < m.host {
            HOST_WEIGHT
        } else {
            OTHER_WEIGHT
        };
    }
    score
}

/// The pod `worker` answers as, given the index's `ranks` and the pod `name` each was registered
/// with: its own pod name; else the pod name of its instance's lowest rank that has one (a rank
/// stored under because its instance's batches carried it, or registered without a name); else
/// its instance id in decimal.
pub(crate) fn pod_of<V>(
    ranks: &BTreeMap<Worker, V>,
    name: impl Fn(&V) -> Option<&str>,
    worker: Worker,
) -> String {
    if let Some(pod) = ranks.get(&worker).and_then(&name) {
        return pod.to_owned();
    }
    ranks
        .range(Worker::new(worker.worker_id, 0)..=Worker::new(worker.worker_id, u32::MAX))
        .find_map(|(_, rank)| name(rank))
        .map_or_else(|| worker.worker_id.to_string(), str::to_owned)
}

/// The answer's scores: one per pod holding the prompt's first block (and named in `filter`
/// when it is not empty), the pod's best rank, sorted by score (best first), then pod.
pub(crate) fn pod_scores(
    matches: &Matches,
    pod: impl Fn(Worker) -> String,
    filter: &[String],
) -> Vec<PodScore> {
    let filter: HashSet<&str> = filter.iter().map(String::as_str).collect();
    let mut best: BTreeMap<String, (f64, Worker)> = BTreeMap::new();
    for m in &matches.workers {
        let score = rank_score(m);
        if score <= 0.0 {
            continue;
        }
        let name = pod(m.worker);
        if !filter.is_empty() && !filter.contains(name.as_str()) {
            continue;
        }
        // Ranks come sorted: on a tie, the lower rank stays.
        best.entry(name)
            .and_modify(|b| {
                if score > b.0 {
                    *b = (score, m.worker);
                }
            })
            .or_insert((score, m.worker));
    }
    let mut scores: Vec<PodScore> = best
        .into_iter()
        .map(|(pod, (score, worker))| PodScore {
            pod,
            score,
            data_parallel_rank: Some(i32::try_from(worker.dp_rank).unwrap_or(i32::MAX)),
        })
        .collect();
    scores.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.pod.cmp(&b.pod)));
    scores
}

/// Scores `tokens` against `entry` (see the module docs).
fn score_tokens(
    entry: &IndexEntry,
    tokens: &[u32],
    filter: &[String],
    max_query_tokens: usize,
) -> Result<Vec<PodScore>, ServiceError> {
    let answer = entry.query(
        QueryInput::Tokens(tokens),
        "",
        "",
        &QueryOptions::default(),
        max_query_tokens,
    )?;
    // The pods of the matched ranks, read at once: the feeds' lock is not held while scoring.
    let instances: BTreeSet<u64> = answer
        .matches
        .workers
        .iter()
        .map(|m| m.worker.worker_id)
        .collect();
    let registered = entry.registered_pods(&instances);
    Ok(pod_scores(
        &answer.matches,
        |worker| pod_of(&registered, |pod| pod.as_deref(), worker),
        filter,
    ))
}

/// The `indexer.v1.IndexerService` service; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct PodScoresService {
    state: Arc<State>,
    tokenizers: Arc<Tokenizers>,
    /// Places of the prompts tokenized at once: one per core. A tokenization is CPU-bound
    /// and holds many times its prompt's size (more than a hundred bytes per byte by a
    /// reading of tokenizers 0.22: per-byte alignments, a string per token); as many as the
    /// requests in flight at once (with a 16 MiB prompt each) could exhaust the memory.
    tokenizing: Arc<tokio::sync::Semaphore>,
}

impl PodScoresService {
    pub(crate) fn new(state: Arc<State>, tokenizers: Arc<Tokenizers>) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        Self {
            state,
            tokenizers,
            tokenizing: Arc::new(tokio::sync::Semaphore::new(cores)),
        }
    }

    /// Answers one request (see the module docs).
    pub(crate) async fn answer(
        &self,
        request: Request<GetPodScoresRequest>,
    ) -> Result<GetPodScoresResponse, ServiceError> {
        let caller = caller_of(&request)?;
        let permit = crate::grpc::permit_of(&request)?;
        caller.check(DEFAULT_TENANT)?;
        self.state.check_ready()?;
        let GetPodScoresRequest {
            prompt,
            model_name,
            pod_identifiers,
        } = request.into_inner();
        if model_name.is_empty() {
            return Err(ServiceError::InvalidArgument(
                "model_name is empty: name the model whose workers to score".into(),
            ));
        }
        if model_name.len() > MAX_NAME_BYTES {
            return Err(ServiceError::InvalidArgument(format!(
                "model_name is {} bytes long; at most {MAX_NAME_BYTES} are accepted",
                model_name.len()
            )));
        }
        let key = IndexKey::new(model_name, DEFAULT_TENANT);
        let tokenizer = self.tokenizers.of(&key.model)?;
        let max_tokens = self.state.limits.max_query_tokens;
        let max_bytes = max_tokens.saturating_mul(PROMPT_BYTES_PER_TOKEN);
        if prompt.len() > max_bytes {
            return Err(ServiceError::InvalidArgument(format!(
                "the prompt is {} bytes long; this server tokenizes at most {max_bytes} \
                 ({PROMPT_BYTES_PER_TOKEN} per token of --max-query-tokens {max_tokens})",
                prompt.len()
            )));
        }
        // No index for the model yet: no pod holds anything (llm-d answers the same), and the
        // prompt is not tokenized for nothing; nor on a publish-only ingest, which answers no
        // query.
        if self.state.registry.publish_only() {
            return Err(crate::query::publish_only_refusal());
        }
        let Some(entry) = self.state.registry.get(&key) else {
            return Ok(GetPodScoresResponse::default());
        };
        let model = key.model.clone();
        let tokenizing = Arc::clone(&self.tokenizing)
            .acquire_owned()
            .await
            .map_err(|_| ServiceError::Unavailable("the server is shutting down".into()))?;
        // The tokenization holds the request's place and its place among the tokenizations: a
        // blocking job is not stopped when its caller goes away, so a cancelled request's
        // places are freed only when the job ends (with the place in the request's future,
        // cancelled requests escaped --max-concurrent-requests and piled tokenizations up on
        // the blocking pool).
        let (tokens, _permit) = blocking(move || {
            let _tokenizing = tokenizing;
            let ids = tokenizer
                .encode_fast(prompt.as_str(), true)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| {
                    ServiceError::InvalidArgument(format!(
                        "the prompt cannot be tokenized with the tokenizer of model {model:?}: {e}"
                    ))
                })?;
            Ok((ids, permit))
        })
        .await?;
        if tokens.len() > max_tokens {
            return Err(ServiceError::InvalidArgument(format!(
                "the prompt has {} tokens; this server accepts at most {max_tokens} per query",
                tokens.len()
            )));
        }
        let scores = score_tokens(&entry, &tokens, &pod_identifiers, max_tokens)?;
        Ok(GetPodScoresResponse { scores })
    }
}

#[tonic::async_trait]
impl LlmdIndexer for PodScoresService {
    async fn get_pod_scores(
        &self,
        request: Request<GetPodScoresRequest>,
    ) -> Result<Response<GetPodScoresResponse>, Status> {
        let started = Instant::now();
        let result = self
            .answer(request)
            .await
            .map(Response::new)
            .map_err(status);
        let code = match &result {
            Ok(_) => 0,
            Err(status) => status.code() as i32,
        };
        self.state
            .metrics
            .record(Rpc::GetPodScores, started.elapsed(), code);
        result
    }
}

#[cfg(test)]
mod tests;
