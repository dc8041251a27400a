//! A deterministic mock inference engine: per worker an LRU prefix cache of `C` blocks, fed a
//! trace's requests, emitting the `Stored`/`Removed` events a real engine would, plus the exact
//! per-worker scores (the oracle) every query must get from an index.
//!
//! This is Workload A (`docs/benchmarks.md`, "Workloads"): one trace `hash_id` is one index
//! block. Its local hash is, by default ([`LocalHashing::Tokens`]), what a router computes: the
//! block is expanded to deterministic tokens ([`crate::trace::block_tokens`]) and hashed with
//! `kvatlas-hash`'s [`BlockHasher`]; [`LocalHashing::Splitmix`] instead uses Dynamo's harness's
//! mapping `LocalBlockHash(splitmix64(hash_id))` (both are bijections of the ids in practice, so
//! the workload's structure is the same). External (engine) hashes are the
//! kvatlas [`SequenceHash`] chain of the request's path, and each request goes to a uniformly
//! random worker (a seeded [`SplitMix64`] stream; not cache-aware) or, with [`Routing::KvAware`],
//! to the worker with the best score (see [`Router`]).
//!
//! Per request, in order:
//! 1. the oracle: for every worker, the number of leading request blocks in its cache (exactly
//!    the device scores a correct index answers; KV-aware routing decides on these, so the stream
//!    does not depend on the backend under test — the replay checks that the backend's answers,
//!    and the routing decisions they imply, are the same);
//! 2. if the assigned worker must evict to fit the blocks it lacks: one `Removed` (device tier)
//!    with the evicted external hashes, least recently used first (the request's own held
//!    blocks are never evicted);
//! 3. one `Stored` per maximal run of blocks the worker lacks, `parent` = the block before the
//!    run (`None` at position 0);
//! 4. the request's blocks are touched: last-to-first in [`Eviction::LeafFirst`] (parents are
//!    more recent than children, so eviction takes leaves first and every cache stays
//!    prefix-closed, like vLLM), first-to-last in [`Eviction::HeadFirst`] (heads are evicted
//!    first, leaving holes: blocks held after a missing one).
//!
//! A request longer than `C` blocks is cached only up to its first `C` blocks.

use std::ops::Range;

use kvatlas_hash::{BlockHasher, LocalBlockHash, SequenceHash};
use kvatlas_index::{ExternalBlockHash, Mutation, StoredBlock, Tier, Worker};
use rustc_hash::FxHashMap;

use crate::trace::TraceRequest;

/// The splitmix64 finalizer of `x` (one step of the generator seeded with `x`): a bijection on
/// `u64` with good avalanche, used to turn trace hash ids into realistic 64-bit local hashes.
pub const fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The local (token) hash of a trace block: `LocalBlockHash(splitmix64(hash_id))`.
pub const fn local_hash_of(hash_id: u64) -> LocalBlockHash {
    LocalBlockHash::new(splitmix64(hash_id))
}

/// Makes the local hashes of requests as configured ([`LocalHashing`]). With tokens, a prompt is
/// expanded block by block and hashed with one [`BlockHasher`] as a router would; the hash of a
/// trace id is remembered so that stream generation does not re-hash the shared system prompt of
/// every request (generation is not timed; the values are the same either way).
#[derive(Debug)]
struct LocalHasher {
    hasher: Option<BlockHasher>,
    block_tokens: usize,
    known: FxHashMap<u64, LocalBlockHash>,
    tokens: Vec<u32>,
}

impl LocalHasher {
    fn new(config: &EngineConfig) -> Self {
        let hasher = match config.local_hashing {
            LocalHashing::Tokens => BlockHasher::new(config.block_tokens.max(1)).ok(),
            LocalHashing::Splitmix => None,
        };
        Self {
            hasher,
            block_tokens: config.block_tokens.max(1) as usize,
            known: FxHashMap::default(),
            tokens: Vec::new(),
        }
    }

    fn request(&mut self, hash_ids: &[u64]) -> Vec<LocalBlockHash> {
        let Some(hasher) = &self.hasher else {
            return hash_ids.iter().map(|&id| local_hash_of(id)).collect();
        };
        hash_ids
            .iter()
            .map(|&id| {
                *self.known.entry(id).or_insert_with(|| {
                    self.tokens.clear();
                    crate::trace::block_tokens(id, self.block_tokens, &mut self.tokens);
                    hasher.hash_block(&self.tokens)
                })
            })
            .collect()
    }
}

/// A tiny seeded pseudo-random generator (splitmix64 stream); deterministic across platforms.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.state);
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        out
    }

    /// A uniform value in `0..n` (multiply-high; the bias is below 2^-32 for `n < 2^32`).
    pub fn below(&mut self, n: u32) -> u32 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u32
    }
}

/// Which blocks a full cache gives up first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Eviction {
    /// Touch a request's blocks last-to-first: leaves go first, caches stay prefix-closed.
    LeafFirst,
    /// Touch a request's blocks first-to-last: heads go first, leaving holes.
    HeadFirst,
}

impl Eviction {
    /// Both modes, in reporting order.
    pub const ALL: [Eviction; 2] = [Eviction::LeafFirst, Eviction::HeadFirst];

    /// The CLI spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Eviction::LeafFirst => "leaf-first",
            Eviction::HeadFirst => "head-first",
        }
    }
}

/// How requests are assigned to workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Routing {
    /// A uniformly random worker (seeded; Workload A).
    Random,
    /// The worker with the best device score for the request (KV-aware), within a load bound.
    KvAware,
}

impl Routing {
    /// Both modes, in reporting order.
    pub const ALL: [Routing; 2] = [Routing::Random, Routing::KvAware];

    /// The CLI spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Routing::Random => "random",
            Routing::KvAware => "kv-aware",
        }
    }
}

/// The default load bound of KV-aware routing: a worker may take a request only if its assigned
/// requests then stay within 125 % of the mean (rounded up).
pub const DEFAULT_LOAD_BOUND_PERCENT: u32 = 125;

/// How a trace block's local hash is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LocalHashing {
    /// As a router frontend does: deterministic tokens hashed with `kvatlas-hash`.
    #[default]
    Tokens,
    /// Dynamo's harness's mapping: `LocalBlockHash(splitmix64(hash_id))`.
    Splitmix,
}

/// How the mock engines are set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EngineConfig {
    /// Number of workers (each one rank, `dp_rank` 0, worker ids `0..workers`).
    pub workers: u32,
    /// Blocks each worker's cache holds.
    pub capacity: usize,
    /// Eviction order.
    pub eviction: Eviction,
    /// Seed of the request-to-worker assignment.
    pub seed: u64,
    /// How requests are assigned to workers.
    pub routing: Routing,
    /// KV-aware routing only: a worker is eligible for request `q` (0-based) only if its assigned
    /// requests, this one included, stay within `⌈load_bound_percent × (q + 1) / (100 × workers)⌉`;
    /// 0 = unbounded. Must be 0 or at least 100 (then some worker is always eligible).
    pub load_bound_percent: u32,
    /// How local hashes are made.
    pub local_hashing: LocalHashing,
    /// Tokens per block with [`LocalHashing::Tokens`] (512 for the Mooncake traces, divided by a
    /// trace-length factor).
    pub block_tokens: u32,
}

impl EngineConfig {
    /// `workers` workers with `capacity` blocks each, random routing with `seed`.
    pub const fn new(workers: u32, capacity: usize, eviction: Eviction, seed: u64) -> Self {
        Self {
            workers,
            capacity,
            eviction,
            seed,
            routing: Routing::Random,
            load_bound_percent: DEFAULT_LOAD_BOUND_PERCENT,
            local_hashing: LocalHashing::Tokens,
            block_tokens: crate::trace::TRACE_BLOCK_TOKENS as u32,
        }
    }

    /// The same configuration with `routing`.
    pub const fn with_routing(self, routing: Routing) -> Self {
        Self { routing, ..self }
    }
}

/// The request-to-worker assignment, replayable: [`generate`] routes with the engines' exact
/// scores, and the replay re-routes every query with the backend's answers to check that
/// kvatlas's own `find_matches` makes the same decisions.
///
/// - [`Routing::Random`]: one [`SplitMix64::below`] draw per request (scores ignored).
/// - [`Routing::KvAware`]: among the workers within the load bound (see
///   [`EngineConfig::load_bound_percent`]; load = requests assigned so far), the one with the
///   highest device score; ties go to the lowest load, then the lowest worker id. Without a
///   bound, the trace's nearly universal first block would send every request to one worker.
#[derive(Debug, Clone)]
pub struct Router {
    routing: Routing,
    bound_percent: u64,
    rng: SplitMix64,
    loads: Vec<u64>,
    assigned: u64,
}

impl Router {
    /// A router for `config`, before any request.
    pub fn new(config: &EngineConfig) -> Self {
        Self {
            routing: config.routing,
            bound_percent: u64::from(config.load_bound_percent),
            rng: SplitMix64::new(config.seed),
            loads: vec![0; config.workers as usize],
            assigned: 0,
        }
    }

    /// Requests assigned to each worker so far.
    pub fn loads(&self) -> &[u64] {
        &self.loads
    }

    /// Assigns the next request, given its non-zero device scores as `(worker id, score)` sorted
    /// by worker id, and returns the worker.
    pub fn route(&mut self, scores: &[(u32, u32)]) -> u32 {
        let workers = self.loads.len() as u32;
        let chosen = match self.routing {
            Routing::Random => self.rng.below(workers),
            Routing::KvAware => {
                let bound = (self.bound_percent > 0).then(|| {
                    let scaled = self.bound_percent * (self.assigned + 1);
                    let per = 100 * u64::from(workers);
                    scaled.div_ceil(per).max(1)
                });
                let mut scores = scores.iter().peekable();
                let mut best: Option<(u32, u64, u32)> = None; // (score, load, worker)
                for w in 0..workers {
                    while scores.next_if(|&&(sw, _)| sw < w).is_some() {}
                    let score = scores.next_if(|&&(sw, _)| sw == w).map_or(0, |&(_, s)| s);
                    let load = self.loads[w as usize];
                    if bound.is_some_and(|b| load + 1 > b) {
                        continue;
                    }
                    // Higher score, then lower load; a later worker never wins a full tie.
                    if best.is_none_or(|(bs, bl, _)| score > bs || (score == bs && load < bl)) {
                        best = Some((score, load, w));
                    }
                }
                // Unreachable with a bound ≥ 100 %; fall back to the least-loaded worker.
                best.map_or_else(
                    || {
                        (0..workers)
                            .min_by_key(|&w| self.loads[w as usize])
                            .unwrap_or(0)
                    },
                    |(_, _, w)| w,
                )
            }
        };
        self.loads[chosen as usize] += 1;
        self.assigned += 1;
        chosen
    }
}

/// One request as the router sees it, with what the index must answer and the events it causes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// The request's trace arrival time in milliseconds (the open-loop replay rescales it).
    pub timestamp_ms: u64,
    /// The worker the request was assigned to.
    pub worker: u32,
    /// The request's local hashes (the `find_matches` query).
    pub locals: Vec<LocalBlockHash>,
    /// The exact device score of every worker with a non-zero score, before this request's
    /// events, as `(worker id, score)` sorted by worker id.
    pub oracle: Vec<(u32, u32)>,
    /// This request's events: a range of [`Stream::events`].
    pub events: Range<usize>,
}

/// Counts describing a generated stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct StreamStats {
    /// `Stored` events.
    pub stored_events: u64,
    /// `Removed` events.
    pub removed_events: u64,
    /// Blocks in all `Stored` events.
    pub blocks_stored: u64,
    /// Blocks in all `Removed` events.
    pub blocks_removed: u64,
    /// Sum over queries of the number of query blocks (the query-side block ops).
    pub query_blocks: u64,
    /// (worker, block) memberships when the stream ends.
    pub final_memberships: u64,
    /// Requests whose assigned worker held a block after a block it lacked (a hole).
    pub requests_with_holes: u64,
    /// Evicted blocks that still had a cached child once their `Removed` event was complete
    /// (each opens a hole in that worker's cache; always 0 with leaf-first eviction).
    pub orphaning_evictions: u64,
    /// Queries some worker had a non-zero score for.
    pub queries_hit: u64,
    /// Sum of the assigned workers' oracle scores (blocks reused).
    pub assigned_hit_blocks: u64,
    /// The most requests any one worker was assigned (balance: the mean is requests / workers).
    pub max_worker_requests: u64,
}

impl StreamStats {
    /// The cache hit rate of the routing: blocks found (as a cached prefix) in the assigned
    /// worker's cache / blocks requested (0 for an empty stream).
    pub fn hit_rate(&self) -> f64 {
        self.assigned_hit_blocks as f64 / self.query_blocks.max(1) as f64
    }
}

/// A generated, replayable stream: queries interleaved with their events.
#[derive(Debug, Clone)]
pub struct Stream {
    /// The configuration that produced it.
    pub config: EngineConfig,
    /// One per trace request, in trace order.
    pub queries: Vec<Query>,
    /// All events, in order; each query owns a contiguous range.
    pub events: Vec<Mutation>,
    /// Counts.
    pub stats: StreamStats,
    /// [`ScoreDigest`] of the oracle scores (equals a correct index's digest).
    pub oracle_digest: u64,
    /// Per worker id (`0..workers`), the external hashes its cache holds when the stream ends,
    /// sorted: the final state a correct index must hold.
    pub final_caches: Vec<Vec<ExternalBlockHash>>,
    /// [`membership_digest`] of `final_caches`.
    pub final_state_digest: u64,
}

impl Stream {
    /// Block operations of all events (stored + removed hashes).
    pub fn event_blocks(&self) -> u64 {
        self.stats.blocks_stored + self.stats.blocks_removed
    }

    /// One `Removed` (device tier) per worker with a non-empty cache, emptying it: appended to
    /// the stream, they leave an empty index (the "drain" of Workload C).
    pub fn drain_events(&self) -> Vec<Mutation> {
        self.final_caches
            .iter()
            .enumerate()
            .filter(|(_, blocks)| !blocks.is_empty())
            .map(|(w, blocks)| Mutation::Removed {
                worker: Worker::new(w as u64, 0),
                tier: Tier::Device,
                blocks: blocks.clone(),
            })
            .collect()
    }
}

/// An order-independent digest of a set of `(worker id, dp rank, external hash)` memberships:
/// the wrapping sum of a mix of each triple. Equal sets give equal digests whatever the order.
pub fn membership_digest<'a>(
    memberships: impl IntoIterator<Item = (Worker, &'a ExternalBlockHash)>,
) -> u64 {
    memberships
        .into_iter()
        .fold(0u64, |acc, (worker, external)| {
            let mixed = splitmix64(
                splitmix64(worker.worker_id ^ (u64::from(worker.dp_rank) << 48)) ^ external.get(),
            );
            acc.wrapping_add(mixed)
        })
}

/// An order-dependent digest of `(query index, worker, score)` triples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoreDigest(u64);

impl Default for ScoreDigest {
    fn default() -> Self {
        Self(0x6b76_6174_6c61_7321)
    }
}

impl ScoreDigest {
    /// Folds one non-zero score in (zero scores are implicit and must not be added).
    pub fn add(&mut self, query: usize, worker: u64, score: u32) {
        for word in [query as u64, worker, u64::from(score)] {
            self.0 = splitmix64(self.0 ^ word);
        }
    }

    /// The digest value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    key: u64,
    /// The parent block's key (meaningless when `has_parent` is false).
    parent: u64,
    has_parent: bool,
    prev: u32,
    next: u32,
}

/// An LRU set of external hashes: an intrusive doubly linked list over a slab, plus each
/// cached block's number of cached children (to measure holes).
#[derive(Debug, Default)]
struct Lru {
    index: FxHashMap<u64, u32>,
    children: FxHashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
}

impl Lru {
    fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            ..Self::default()
        }
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn contains(&self, key: u64) -> bool {
        self.index.contains_key(&key)
    }

    fn unlink(&mut self, at: u32) {
        let Node { prev, next, .. } = self.nodes[at as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, at: u32) {
        self.nodes[at as usize].prev = NIL;
        self.nodes[at as usize].next = self.head;
        if self.head == NIL {
            self.tail = at;
        } else {
            self.nodes[self.head as usize].prev = at;
        }
        self.head = at;
    }

    /// Cached children of `key`.
    fn cached_children(&self, key: u64) -> u32 {
        self.children.get(&key).copied().unwrap_or(0)
    }

    /// Makes `key` (whose parent is `parent`) the most recently used, inserting it if absent.
    fn touch(&mut self, key: u64, parent: Option<u64>) {
        if let Some(&at) = self.index.get(&key) {
            if self.head != at {
                self.unlink(at);
                self.push_front(at);
            }
            return;
        }
        if let Some(parent) = parent {
            *self.children.entry(parent).or_default() += 1;
        }
        let node = Node {
            key,
            parent: parent.unwrap_or(0),
            has_parent: parent.is_some(),
            prev: NIL,
            next: NIL,
        };
        let at = match self.free.pop() {
            Some(at) => {
                self.nodes[at as usize] = node;
                at
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.index.insert(key, at);
        self.push_front(at);
    }

    /// Removes and returns the least recently used key.
    fn pop_lru(&mut self) -> Option<u64> {
        let at = self.tail;
        if at == NIL {
            return None;
        }
        self.unlink(at);
        self.free.push(at);
        let Node {
            key,
            parent,
            has_parent,
            ..
        } = self.nodes[at as usize];
        self.index.remove(&key);
        if has_parent && let Some(count) = self.children.get_mut(&parent) {
            *count -= 1;
            if *count == 0 {
                self.children.remove(&parent);
            }
        }
        Some(key)
    }
}

/// The mock engines, one request at a time: what [`generate`] runs over a whole trace, and what
/// a live simulation (`kvatlas demo`) drives with its own routing decisions.
///
/// ```
/// use kvatlas_fleet::engine::{EngineConfig, Engines, Eviction};
/// use kvatlas_fleet::trace::TraceRequest;
///
/// let config = EngineConfig { block_tokens: 16, ..EngineConfig::new(2, 64, Eviction::LeafFirst, 7) };
/// let mut engines = Engines::new(&config);
/// let request = TraceRequest { timestamp: 0, input_length: 48, output_length: 1, hash_ids: vec![1, 2, 3] };
/// let prompt = engines.prompt(&request);
/// let mut events = Vec::new();
/// engines.serve(0, 0, &prompt, &mut events); // worker 0 caches the three blocks
/// assert_eq!(events.len(), 1, "one Stored run");
/// assert_eq!(engines.scores(&prompt), vec![(0, 3)]); // what a correct index now answers
/// ```
#[derive(Debug)]
pub struct Engines {
    config: EngineConfig,
    caches: Vec<Lru>,
    locals_of: LocalHasher,
    stats: StreamStats,
    held: Vec<bool>,
}

/// One request as the engines see it: its local hashes and its engine (sequence) hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// The local (token) hashes of its blocks.
    pub locals: Vec<LocalBlockHash>,
    /// The engine hashes of its blocks: the sequence-hash chain of its path.
    pub externals: Vec<ExternalBlockHash>,
}

impl Engines {
    /// `config.workers` engines with empty caches.
    ///
    /// # Panics
    /// If `config.workers` or `config.capacity` is 0, or `config.load_bound_percent` is in
    /// `1..100`.
    pub fn new(config: &EngineConfig) -> Self {
        assert!(
            config.workers > 0 && config.capacity > 0,
            "need workers and capacity"
        );
        assert!(
            config.load_bound_percent == 0 || config.load_bound_percent >= 100,
            "the load bound must be 0 (none) or at least 100 %"
        );
        Self {
            config: *config,
            caches: (0..config.workers).map(|_| Lru::new()).collect(),
            locals_of: LocalHasher::new(config),
            stats: StreamStats::default(),
            held: Vec::new(),
        }
    }

    /// The hashes of `request`'s blocks, as its engine and a router compute them.
    pub fn prompt(&mut self, request: &TraceRequest) -> Prompt {
        let locals = self.locals_of.request(&request.hash_ids);
        let mut externals = Vec::with_capacity(locals.len());
        let mut previous: Option<SequenceHash> = None;
        for &local in &locals {
            let hash = SequenceHash::chain(previous, local);
            externals.push(ExternalBlockHash::new(hash.get()));
            previous = Some(hash);
        }
        Prompt { locals, externals }
    }

    /// The exact device score of every worker with a non-zero score for `prompt` (leading
    /// blocks it holds), as `(worker id, score)` sorted by worker id: what a correct index
    /// answers.
    pub fn scores(&self, prompt: &Prompt) -> Vec<(u32, u32)> {
        let mut scores = Vec::new();
        for (w, cache) in self.caches.iter().enumerate() {
            let score = prompt
                .externals
                .iter()
                .take_while(|e| cache.contains(e.get()))
                .count() as u32;
            if score > 0 {
                scores.push((w as u32, score));
            }
        }
        scores
    }

    /// Runs `prompt` on worker `w` (whose exact score was `score`): evicts what it must, caches
    /// the blocks it lacks, and appends the events it emits to `events` (see the module docs).
    pub fn serve(&mut self, w: u32, score: u32, prompt: &Prompt, events: &mut Vec<Mutation>) {
        let config = self.config;
        let stats = &mut self.stats;
        let externals = &prompt.externals;
        let worker = Worker::new(u64::from(w), 0);
        let cache = &mut self.caches[w as usize];
        stats.query_blocks += prompt.locals.len() as u64;
        stats.assigned_hit_blocks += u64::from(score);
        let n = externals.len().min(config.capacity);
        let held = &mut self.held;
        held.clear();
        held.extend(externals[..n].iter().map(|e| cache.contains(e.get())));
        let missing = held.iter().filter(|&&h| !h).count();
        if let Some(first_missing) = held.iter().position(|&h| !h)
            && held[first_missing..].iter().any(|&h| h)
        {
            stats.requests_with_holes += 1;
        }

        let parent_of = |i: usize| i.checked_sub(1).map(|p| externals[p].get());
        // Pin the request's held blocks (make them most recent) so eviction never takes them.
        let order: Vec<usize> = match config.eviction {
            Eviction::LeafFirst => (0..n).rev().collect(),
            Eviction::HeadFirst => (0..n).collect(),
        };
        for &i in &order {
            if held[i] {
                cache.touch(externals[i].get(), parent_of(i));
            }
        }

        // 2. Evict, least recently used first.
        let need = (cache.len() + missing).saturating_sub(config.capacity);
        if need > 0 {
            let evicted: Vec<ExternalBlockHash> = (0..need)
                .map_while(|_| cache.pop_lru().map(ExternalBlockHash::new))
                .collect();
            stats.orphaning_evictions += evicted
                .iter()
                .filter(|e| cache.cached_children(e.get()) > 0)
                .count() as u64;
            stats.removed_events += 1;
            stats.blocks_removed += evicted.len() as u64;
            events.push(Mutation::Removed {
                worker,
                tier: Tier::Device,
                blocks: evicted,
            });
        }

        // 3. One Stored per maximal run of missing blocks.
        let mut i = 0;
        while i < n {
            if held[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < n && !held[i] {
                i += 1;
            }
            let blocks: Vec<StoredBlock> = (start..i)
                .map(|j| StoredBlock {
                    external: externals[j],
                    local: prompt.locals[j],
                })
                .collect();
            stats.stored_events += 1;
            stats.blocks_stored += blocks.len() as u64;
            events.push(Mutation::Stored {
                worker,
                tier: Tier::Device,
                parent: start.checked_sub(1).map(|p| externals[p]),
                blocks,
            });
        }

        // 4. Touch in the mode's order (inserting the stored blocks).
        for &i in &order {
            cache.touch(externals[i].get(), parent_of(i));
        }
        debug_assert!(cache.len() <= config.capacity);
    }

    /// The counts so far (`final_memberships`: the blocks the caches hold now).
    pub fn stats(&self) -> StreamStats {
        StreamStats {
            final_memberships: self.caches.iter().map(|c| c.len() as u64).sum(),
            ..self.stats
        }
    }

    /// Per worker id, the engine hashes its cache holds, sorted.
    pub fn caches(&self) -> Vec<Vec<ExternalBlockHash>> {
        self.caches
            .iter()
            .map(|cache| {
                let mut blocks: Vec<ExternalBlockHash> = cache
                    .index
                    .keys()
                    .map(|&k| ExternalBlockHash::new(k))
                    .collect();
                blocks.sort_unstable();
                blocks
            })
            .collect()
    }
}

/// Runs `trace` through `config.workers` mock engines and returns the replayable stream.
///
/// Deterministic: the same trace and configuration always give the same stream.
///
/// # Panics
/// If `config.workers` or `config.capacity` is 0, or `config.load_bound_percent` is in `1..100`.
pub fn generate(trace: &[TraceRequest], config: &EngineConfig) -> Stream {
    let mut engines = Engines::new(config);
    let mut router = Router::new(config);
    let mut queries = Vec::with_capacity(trace.len());
    let mut events = Vec::new();
    let mut digest = ScoreDigest::default();
    let mut queries_hit = 0;

    for (q, request) in trace.iter().enumerate() {
        let prompt = engines.prompt(request);
        // 1. The oracle, before this request's events.
        let oracle = engines.scores(&prompt);
        for &(w, score) in &oracle {
            digest.add(q, u64::from(w), score);
        }
        if !oracle.is_empty() {
            queries_hit += 1;
        }
        let w = router.route(&oracle);
        let score = oracle
            .binary_search_by_key(&w, |&(ow, _)| ow)
            .map_or(0, |i| oracle[i].1);
        let first_event = events.len();
        engines.serve(w, score, &prompt, &mut events);
        queries.push(Query {
            timestamp_ms: request.timestamp,
            worker: w,
            locals: prompt.locals,
            oracle,
            events: first_event..events.len(),
        });
    }
    let mut stats = engines.stats();
    stats.queries_hit = queries_hit;
    stats.max_worker_requests = router.loads().iter().copied().max().unwrap_or(0);
    let final_caches = engines.caches();
    let final_state_digest = membership_digest(
        final_caches
            .iter()
            .enumerate()
            .flat_map(|(w, blocks)| blocks.iter().map(move |b| (Worker::new(w as u64, 0), b))),
    );
    Stream {
        config: *config,
        queries,
        events,
        stats,
        oracle_digest: digest.get(),
        final_caches,
        final_state_digest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length: 0,
            output_length: 0,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn lru_evicts_least_recent_first() {
        let mut lru = Lru::new();
        for k in [1, 2, 3] {
            lru.touch(k, None);
        }
        lru.touch(1, None);
        assert_eq!(lru.pop_lru(), Some(2));
        assert_eq!(lru.pop_lru(), Some(3));
        lru.touch(4, None);
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.pop_lru(), Some(1));
        assert_eq!(lru.pop_lru(), Some(4));
        assert_eq!(lru.pop_lru(), None);
    }

    #[test]
    fn rng_is_uniform_enough_and_seeded() {
        let mut a = SplitMix64::new(42);
        let mut b = SplitMix64::new(42);
        let mut counts = [0u32; 8];
        for _ in 0..8000 {
            let x = a.below(8);
            assert_eq!(x, b.below(8));
            counts[x as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }

    /// By default a block's local hash is what a router computes from its tokens.
    #[test]
    fn local_hashes_are_the_routers_token_hashes() {
        let trace = [request(&[7, 8])];
        let stream = generate(&trace, &EngineConfig::new(1, 4, Eviction::LeafFirst, 1));
        let Mutation::Stored { blocks, .. } = &stream.events[0] else {
            panic!("expected Stored")
        };
        let mut tokens = Vec::new();
        for id in [7, 8] {
            crate::trace::block_tokens(id, 512, &mut tokens);
        }
        let hasher = BlockHasher::new(512).expect("valid block size");
        let router: Vec<LocalBlockHash> = hasher.local_hashes(&tokens).collect();
        assert_eq!(blocks.iter().map(|b| b.local).collect::<Vec<_>>(), router);
    }

    #[test]
    fn one_worker_stores_only_what_it_lacks_and_evicts_leaves() {
        let trace = [request(&[0, 1, 2]), request(&[0, 1, 3]), request(&[0, 4])];
        let config = EngineConfig {
            local_hashing: LocalHashing::Splitmix,
            ..EngineConfig::new(1, 4, Eviction::LeafFirst, 1)
        };
        let stream = generate(&trace, &config);
        let q = &stream.queries;
        assert_eq!(q[1].oracle, vec![(0, 2)]);
        // Request 1 stores only block 3, under block 1.
        let ev = &stream.events[q[1].events.clone()];
        assert_eq!(ev.len(), 1);
        let Mutation::Stored { parent, blocks, .. } = &ev[0] else {
            panic!("expected Stored, got {ev:?}");
        };
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].local, local_hash_of(3));
        let e1 = SequenceHash::first(local_hash_of(0)).extend(local_hash_of(1));
        assert_eq!(*parent, Some(ExternalBlockHash::new(e1.get())));
        // Request 2 must evict one block: the oldest leaf, block 2 (not the shared head).
        let ev = &stream.events[q[2].events.clone()];
        let Mutation::Removed { blocks, .. } = &ev[0] else {
            panic!("expected Removed, got {ev:?}");
        };
        let e2 = e1.extend(local_hash_of(2));
        assert_eq!(blocks, &[ExternalBlockHash::new(e2.get())]);
        assert_eq!(q[2].oracle, vec![(0, 1)]);
        assert_eq!(stream.stats.final_memberships, 4);
    }

    #[test]
    fn head_first_stores_every_missing_run_under_its_predecessor() {
        // Capacity 5: request 0 caches 10..14; request 1 (20, 21) evicts the head blocks 10
        // and 11 (least recent in head-first order); request 2 (10..14 again) finds 12..14 held
        // after the hole and stores 10, 11 as one run with no parent.
        let trace = [
            request(&[10, 11, 12, 13, 14]),
            request(&[20, 21]),
            request(&[10, 11, 12, 13, 14]),
        ];
        let config = EngineConfig::new(1, 5, Eviction::HeadFirst, 7);
        let stream = generate(&trace, &config);
        let q = &stream.queries;
        assert_eq!(q[2].oracle, vec![]);
        let ev = &stream.events[q[2].events.clone()];
        let stored: Vec<_> = ev
            .iter()
            .filter_map(|e| match e {
                Mutation::Stored { parent, blocks, .. } => Some((*parent, blocks.len())),
                _ => None,
            })
            .collect();
        assert_eq!(stored, vec![(None, 2)]);
        assert_eq!(stream.stats.requests_with_holes, 1);
    }

    #[test]
    fn kv_aware_routing_follows_the_cached_prefix_while_it_is_held() {
        // Two workers of 3 blocks. r0 → w0 (all tied, lowest id); r1 (no overlap) → w1 (lower
        // load); r2 extends r1 → w1 (score 2); r3 shares r0's prefix → w0 (score 2); r4 (new)
        // → w0 (loads tied 2:2, lowest id), evicting r0's blocks; r5 repeats r0, which nobody
        // holds any more → w1 (lower load).
        let trace = [
            request(&[1, 2, 3]),
            request(&[10, 11]),
            request(&[10, 11, 12]),
            request(&[1, 2]),
            request(&[20, 21, 22]),
            request(&[1, 2, 3]),
        ];
        let config = EngineConfig::new(2, 3, Eviction::LeafFirst, 9).with_routing(Routing::KvAware);
        let stream = generate(&trace, &config);
        let workers: Vec<u32> = stream.queries.iter().map(|q| q.worker).collect();
        assert_eq!(workers, [0, 1, 1, 0, 0, 1]);
        assert_eq!(stream.queries[2].oracle, vec![(1, 2)]);
        assert_eq!(stream.queries[3].oracle, vec![(0, 2)]);
        assert_eq!(stream.queries[5].oracle, vec![]);
        // Hits: 2 (r2) + 2 (r3) of 16 requested blocks.
        assert_eq!(stream.stats.assigned_hit_blocks, 4);
        assert_eq!(stream.stats.query_blocks, 16);
        assert!((stream.stats.hit_rate() - 0.25).abs() < 1e-12);
        assert_eq!(stream.stats.max_worker_requests, 3);
        // Deterministic, and independent of the seed (no random draw).
        let again = generate(&trace, &EngineConfig { seed: 10, ..config });
        assert_eq!(again.queries, stream.queries);
        assert_eq!(again.events, stream.events);
    }

    #[test]
    fn the_load_bound_keeps_a_shared_first_block_from_collapsing_onto_one_worker() {
        // Every request starts with block 0, as nearly every request of the shared trace does.
        let trace: Vec<TraceRequest> = (0..400u64).map(|i| request(&[0, 1000 + i])).collect();
        let bounded =
            EngineConfig::new(4, 64, Eviction::LeafFirst, 1).with_routing(Routing::KvAware);
        let stream = generate(&trace, &bounded);
        // ⌈1.25 × 400 / 4⌉ = 125.
        assert!(
            stream.stats.max_worker_requests <= 125,
            "{:?}",
            stream.stats
        );
        assert!(stream.queries.iter().skip(4).all(|q| !q.oracle.is_empty()));
        // Every request after the first on each worker reuses block 0.
        assert_eq!(stream.stats.assigned_hit_blocks, 400 - 4);
        let unbounded = generate(
            &trace,
            &EngineConfig {
                load_bound_percent: 0,
                ..bounded
            },
        );
        assert_eq!(unbounded.stats.max_worker_requests, 400);
        // Random routing reuses block 0 too, but spreads requests without looking.
        let random = generate(&trace, &EngineConfig::new(4, 64, Eviction::LeafFirst, 1));
        assert!(random.stats.max_worker_requests < 150);
    }

    #[test]
    fn the_router_replays_its_decisions_from_the_same_scores() {
        let config =
            EngineConfig::new(8, 16, Eviction::LeafFirst, 3).with_routing(Routing::KvAware);
        let trace: Vec<TraceRequest> = (0..200u64)
            .map(|i| request(&[i % 7, 100 + i % 13, 1000 + i]))
            .collect();
        let stream = generate(&trace, &config);
        let mut router = Router::new(&config);
        for q in &stream.queries {
            assert_eq!(router.route(&q.oracle), q.worker);
        }
        for routing in Routing::ALL {
            let config = config.with_routing(routing);
            let stream = generate(&trace, &config);
            let mut router = Router::new(&config);
            assert!(
                stream
                    .queries
                    .iter()
                    .all(|q| router.route(&q.oracle) == q.worker)
            );
        }
    }
}
