//! A deterministic mock inference engine: per worker an LRU prefix cache of `C` blocks, fed a
//! trace's requests, emitting the `Stored`/`Removed` events a real engine would, plus the exact
//! per-worker scores (the oracle) every query must get from an index.
//!
//! This is Workload A of `shared/reference/peer-baseline.md`: one trace `hash_id` is one index
//! block, `local = LocalBlockHash(splitmix64(hash_id))`, external (engine) hashes are the
//! kvatlas [`SequenceHash`] chain of the request's path, and each request goes to a uniformly
//! random worker (a seeded [`SplitMix64`] stream; not cache-aware).
//!
//! Per request, in order:
//! 1. the oracle: for every worker, the number of leading request blocks in its cache;
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

use kvatlas_hash::{LocalBlockHash, SequenceHash};
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
    /// the stream, they leave an empty index (the "drain" of peer-baseline.md's Workload C).
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

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
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

    fn push_front(&mut self, slot: u32) {
        self.nodes[slot as usize].prev = NIL;
        self.nodes[slot as usize].next = self.head;
        if self.head == NIL {
            self.tail = slot;
        } else {
            self.nodes[self.head as usize].prev = slot;
        }
        self.head = slot;
    }

    /// Cached children of `key`.
    fn cached_children(&self, key: u64) -> u32 {
        self.children.get(&key).copied().unwrap_or(0)
    }

    /// Makes `key` (whose parent is `parent`) the most recently used, inserting it if absent.
    fn touch(&mut self, key: u64, parent: Option<u64>) {
        if let Some(&slot) = self.index.get(&key) {
            if self.head != slot {
                self.unlink(slot);
                self.push_front(slot);
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
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.index.insert(key, slot);
        self.push_front(slot);
    }

    /// Removes and returns the least recently used key.
    fn pop_lru(&mut self) -> Option<u64> {
        let slot = self.tail;
        if slot == NIL {
            return None;
        }
        self.unlink(slot);
        self.free.push(slot);
        let Node {
            key,
            parent,
            has_parent,
            ..
        } = self.nodes[slot as usize];
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

/// Runs `trace` through `config.workers` mock engines and returns the replayable stream.
///
/// Deterministic: the same trace and configuration always give the same stream.
///
/// # Panics
/// If `config.workers` is 0 or `config.capacity` is 0.
pub fn generate(trace: &[TraceRequest], config: &EngineConfig) -> Stream {
    assert!(
        config.workers > 0 && config.capacity > 0,
        "need workers and capacity"
    );
    let mut caches: Vec<Lru> = (0..config.workers).map(|_| Lru::new()).collect();
    let mut rng = SplitMix64::new(config.seed);
    let mut queries = Vec::with_capacity(trace.len());
    let mut events = Vec::new();
    let mut stats = StreamStats::default();
    let mut digest = ScoreDigest::default();
    let mut externals: Vec<ExternalBlockHash> = Vec::new();
    let mut held: Vec<bool> = Vec::new();

    for (q, request) in trace.iter().enumerate() {
        let locals: Vec<LocalBlockHash> = request
            .hash_ids
            .iter()
            .map(|&id| local_hash_of(id))
            .collect();
        externals.clear();
        let mut previous: Option<SequenceHash> = None;
        for &local in &locals {
            let hash = SequenceHash::chain(previous, local);
            externals.push(ExternalBlockHash::new(hash.get()));
            previous = Some(hash);
        }
        stats.query_blocks += locals.len() as u64;

        // 1. The oracle, before this request's events.
        let mut oracle = Vec::new();
        for (w, cache) in caches.iter().enumerate() {
            let score = externals
                .iter()
                .take_while(|e| cache.contains(e.get()))
                .count() as u32;
            if score > 0 {
                oracle.push((w as u32, score));
                digest.add(q, w as u64, score);
            }
        }
        if !oracle.is_empty() {
            stats.queries_hit += 1;
        }

        let w = rng.below(config.workers);
        let worker = Worker::new(u64::from(w), 0);
        let cache = &mut caches[w as usize];
        stats.assigned_hit_blocks += oracle
            .binary_search_by_key(&w, |&(ow, _)| ow)
            .map_or(0, |i| u64::from(oracle[i].1));
        let n = externals.len().min(config.capacity);
        held.clear();
        held.extend(externals[..n].iter().map(|e| cache.contains(e.get())));
        let missing = held.iter().filter(|&&h| !h).count();
        if let Some(first_missing) = held.iter().position(|&h| !h)
            && held[first_missing..].iter().any(|&h| h)
        {
            stats.requests_with_holes += 1;
        }
        let first_event = events.len();

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
                    local: locals[j],
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

        queries.push(Query {
            timestamp_ms: request.timestamp,
            worker: w,
            locals,
            oracle,
            events: first_event..events.len(),
        });
    }
    stats.final_memberships = caches.iter().map(|c| c.len() as u64).sum();
    let final_caches: Vec<Vec<ExternalBlockHash>> = caches
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
        .collect();
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

    #[test]
    fn one_worker_stores_only_what_it_lacks_and_evicts_leaves() {
        let trace = [request(&[0, 1, 2]), request(&[0, 1, 3]), request(&[0, 4])];
        let config = EngineConfig {
            workers: 1,
            capacity: 4,
            eviction: Eviction::LeafFirst,
            seed: 1,
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
        let config = EngineConfig {
            workers: 1,
            capacity: 5,
            eviction: Eviction::HeadFirst,
            seed: 7,
        };
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
}
