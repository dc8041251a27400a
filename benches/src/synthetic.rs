//! Workload B (`docs/benchmarks.md`, "Workloads"): a synthetic index of 1024 sequences × 1024
//! blocks (1,048,576 (worker, block) memberships), after Dynamo's `radix_tree_microbench`.
//!
//! Sequence `i` belongs to worker `i % 128`; its first 256 blocks are the prefix of one of 4
//! prefix groups (chosen with a seeded generator), the rest are its own. Local hashes are random
//! 64-bit values (shared within a group's prefix). Engine (external) hashes come in two kinds
//! ([`EngineHashes`]):
//! - **unique** per sequence and position: two sequences of one worker that share a prefix are
//!   two sets of blocks, and the index holds exactly `sequences × depth` memberships;
//! - **chained** from the local hashes, as engines and Dynamo's sequence hash do (the peer
//!   harness's Workload B): a worker's sequences of one group share their prefix *blocks*, so
//!   removing one whole sequence takes the prefix from under the worker's other sequences of the
//!   group, and storing it again brings their suffixes back — the shared-prefix cycle, the weak
//!   case of an index that keeps a worker's reachable blocks eagerly (`docs/index.md`).
//!
//! Measured, on one backend through its synchronous [`KvIndex`] path:
//! 1. build: one `Stored` (no parent) per sequence, timed as a whole → blocks/s;
//! 2. `find_matches` latency, `iterations` each (the first 10 % discarded): **hit** (a whole
//!    sequence), **partial** (its first half + the same number of unknown blocks), **miss** (only
//!    unknown blocks); hit and partial answers are checked against an oracle computed from the
//!    construction (the owner scores the matched length, other workers holding a sequence of the
//!    same group score the shared prefix), miss answers must be empty;
//! 3. `cycles` × (remove a whole sequence, store it again), each call timed;
//! 4. 64 hit queries re-checked after the cycles; `stats().heap_bytes` after the build.

use std::time::Instant;

use hdrhistogram::Histogram;
use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{
    ExternalBlockHash, KvIndex, MatchOptions, Matches, Mutation, StoredBlock, Tier, Worker,
};

use crate::engine::{SplitMix64, splitmix64};
use crate::replay::{Latency, backend};

/// The shape of the synthetic index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SyntheticConfig {
    /// Number of sequences.
    pub sequences: usize,
    /// Blocks per sequence.
    pub depth: usize,
    /// Workers (sequence `i` belongs to worker `i % workers`).
    pub workers: u32,
    /// Leading blocks shared within a prefix group.
    pub shared: usize,
    /// Number of prefix groups.
    pub groups: u32,
    /// `find_matches` iterations per query kind (the first 10 % are discarded).
    pub iterations: usize,
    /// Remove + store cycles.
    pub cycles: usize,
    /// Seed of the group assignment and of the hashes.
    pub seed: u64,
    /// How engine hashes are made.
    pub engine_hashes: EngineHashes,
}

/// How the synthetic sequences' engine (external) hashes are made (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineHashes {
    /// Unique per sequence and position: sequences never share blocks.
    #[default]
    Unique,
    /// Chained from the local hashes (each block's hash covers its whole prefix): a worker's
    /// sequences of one group share their prefix blocks.
    Chained,
}

impl Default for SyntheticConfig {
    /// Workload B: 1024 × 1024, 128 workers, 256 shared blocks, 4 groups,
    /// 1000 iterations and cycles.
    fn default() -> Self {
        Self {
            sequences: 1024,
            depth: 1024,
            workers: 128,
            shared: 256,
            groups: 4,
            iterations: 1000,
            cycles: 1000,
            seed: 42,
            engine_hashes: EngineHashes::Unique,
        }
    }
}

/// One synthetic sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// Its owner.
    pub worker: Worker,
    /// Its prefix group.
    pub group: u32,
    /// Its local hashes (`depth` of them).
    pub locals: Vec<LocalBlockHash>,
    /// Its engine hashes (see [`EngineHashes`]).
    pub externals: Vec<ExternalBlockHash>,
}

impl Sequence {
    /// The `Stored` event of the whole sequence (no parent).
    pub fn store(&self) -> Mutation {
        Mutation::Stored {
            worker: self.worker,
            tier: Tier::Device,
            parent: None,
            blocks: self
                .externals
                .iter()
                .zip(&self.locals)
                .map(|(&external, &local)| StoredBlock { external, local })
                .collect(),
        }
    }

    /// The `Removed` event of the whole sequence.
    pub fn remove(&self) -> Mutation {
        Mutation::Removed {
            worker: self.worker,
            tier: Tier::Device,
            blocks: self.externals.clone(),
        }
    }
}

/// The generated workload.
#[derive(Debug, Clone)]
pub struct Synthetic {
    /// Its shape.
    pub config: SyntheticConfig,
    /// The sequences.
    pub sequences: Vec<Sequence>,
    /// Per group, per worker: whether the worker holds a sequence of the group.
    group_workers: Vec<Vec<bool>>,
}

const TAG_GROUP: u64 = 0x6772_6f75_7000_0000;
const TAG_OWN: u64 = 0x6f77_6e00_0000_0000;
const TAG_EXTERNAL: u64 = 0x6578_7400_0000_0000;
const TAG_UNKNOWN: u64 = 0x756e_6b00_0000_0000;

fn mix(seed: u64, tag: u64, a: u64, b: u64) -> u64 {
    splitmix64(splitmix64(splitmix64(seed ^ tag) ^ a) ^ b)
}

/// Engine hashes chained from local hashes: block `k`'s covers blocks `0..=k`.
fn chained_externals(seed: u64, locals: &[LocalBlockHash]) -> Vec<ExternalBlockHash> {
    let mut previous = 0u64;
    locals
        .iter()
        .map(|local| {
            previous = mix(seed, TAG_EXTERNAL, previous, local.get());
            ExternalBlockHash::new(previous)
        })
        .collect()
}

/// Generates the workload (deterministic in `config`).
///
/// # Panics
/// If `workers` or `groups` is 0, or `shared > depth`.
pub fn generate(config: &SyntheticConfig) -> Synthetic {
    assert!(config.workers > 0 && config.groups > 0 && config.shared <= config.depth);
    let mut rng = SplitMix64::new(config.seed);
    let mut group_workers = vec![vec![false; config.workers as usize]; config.groups as usize];
    let sequences = (0..config.sequences)
        .map(|i| {
            let group = rng.below(config.groups);
            let worker = (i % config.workers as usize) as u32;
            group_workers[group as usize][worker as usize] = true;
            let locals: Vec<LocalBlockHash> = (0..config.depth)
                .map(|pos| {
                    let raw = if pos < config.shared {
                        mix(config.seed, TAG_GROUP, u64::from(group), pos as u64)
                    } else {
                        mix(config.seed, TAG_OWN, i as u64, pos as u64)
                    };
                    LocalBlockHash::new(raw)
                })
                .collect();
            let externals = match config.engine_hashes {
                EngineHashes::Unique => (0..config.depth)
                    .map(|pos| {
                        ExternalBlockHash::new(mix(config.seed, TAG_EXTERNAL, i as u64, pos as u64))
                    })
                    .collect(),
                EngineHashes::Chained => chained_externals(config.seed, &locals),
            };
            Sequence {
                worker: Worker::new(u64::from(worker), 0),
                group,
                locals,
                externals,
            }
        })
        .collect();
    Synthetic {
        config: *config,
        sequences,
        group_workers,
    }
}

impl Synthetic {
    /// `n` local hashes no sequence contains.
    pub fn unknown(&self, salt: u64, n: usize) -> Vec<LocalBlockHash> {
        (0..n)
            .map(|pos| LocalBlockHash::new(mix(self.config.seed, TAG_UNKNOWN, salt, pos as u64)))
            .collect()
    }

    /// The hit query of sequence `s` (all its blocks).
    pub fn hit(&self, s: usize) -> Vec<LocalBlockHash> {
        self.sequences[s].locals.clone()
    }

    /// The partial query of sequence `s`: its first half, then as many unknown blocks.
    pub fn partial(&self, s: usize) -> Vec<LocalBlockHash> {
        let half = self.config.depth / 2;
        let mut query = self.sequences[s].locals[..half].to_vec();
        query.extend(self.unknown(s as u64, self.config.depth - half));
        query
    }

    /// The oracle of a query made of sequence `s`'s first `known` blocks followed by unknown
    /// ones: `(worker id, device score)` sorted by worker.
    pub fn oracle(&self, s: usize, known: usize) -> Vec<(u64, u32)> {
        let seq = &self.sequences[s];
        let shared = self.config.shared.min(known) as u32;
        let mut scores: Vec<(u64, u32)> = self.group_workers[seq.group as usize]
            .iter()
            .enumerate()
            .filter(|&(_, &holds)| holds)
            .map(|(w, _)| (w as u64, shared))
            .filter(|&(_, score)| score > 0)
            .collect();
        let own = seq.worker.worker_id;
        match scores.binary_search_by_key(&own, |&(w, _)| w) {
            Ok(i) => scores[i].1 = known as u32,
            Err(i) => scores.insert(i, (own, known as u32)),
        }
        scores.retain(|&(_, score)| score > 0);
        scores
    }

    /// Total (worker, block) memberships once every sequence is stored.
    pub fn memberships(&self) -> u64 {
        (self.config.sequences * self.config.depth) as u64 - self.shared_prefix_blocks()
    }

    /// Blocks stored again while the index is built: with chained engine hashes, every
    /// sequence after a worker's first of a group re-stores the group's prefix (counted as
    /// duplicate stores); none with unique hashes.
    pub fn shared_prefix_blocks(&self) -> u64 {
        if self.config.engine_hashes == EngineHashes::Unique {
            return 0;
        }
        let mut seen = std::collections::HashSet::new();
        let repeats = self
            .sequences
            .iter()
            .filter(|s| !seen.insert((s.worker, s.group)))
            .count();
        (repeats * self.config.shared) as u64
    }
}

/// Whether an answer equals an oracle (device scores, rank 0).
fn agrees(matches: &Matches, oracle: &[(u64, u32)]) -> bool {
    matches.workers.len() == oracle.len()
        && matches
            .workers
            .iter()
            .zip(oracle)
            .all(|(m, &(w, score))| m.worker == Worker::new(w, 0) && m.device == score)
}

/// Results of Workload B on one backend.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SyntheticResult {
    /// Backend name.
    pub backend: String,
    /// Seconds to store every sequence.
    pub build_secs: f64,
    /// Blocks stored per second during the build.
    pub build_blocks_per_s: f64,
    /// `find_matches` of whole sequences.
    pub hit: Latency,
    /// `find_matches` of half a sequence + unknown blocks.
    pub partial: Latency,
    /// `find_matches` of unknown blocks only.
    pub miss: Latency,
    /// `apply(Removed)` of a whole sequence.
    pub remove: Latency,
    /// `apply(Stored)` of a whole sequence.
    pub store: Latency,
    /// Heap estimate after the build.
    pub heap_bytes: u64,
    /// `heap_bytes / memberships`.
    pub bytes_per_membership: f64,
    /// Memberships the index reports after the build.
    pub memberships: u64,
    /// Memberships the index reports after the remove + store cycles.
    pub memberships_after_cycles: u64,
    /// Memberships expected (`sequences × depth`).
    pub expected_memberships: u64,
    /// Queries (hit, partial, miss, and the re-checks after the cycles) whose answer differed
    /// from the oracle.
    pub mismatches: u64,
    /// Queries checked.
    pub checked: u64,
    /// Anomalies the index reported (expected: the build's duplicate stores of shared
    /// prefixes, [`Synthetic::shared_prefix_blocks`]).
    pub anomalies: u64,
    /// Anomalies expected.
    pub expected_anomalies: u64,
}

impl SyntheticResult {
    /// Whether every check passed.
    pub fn is_correct(&self) -> bool {
        self.mismatches == 0
            && self.anomalies == self.expected_anomalies
            && self.memberships == self.expected_memberships
            && self.memberships_after_cycles == self.expected_memberships
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

/// The sequence used by iteration `k` (a stride coprime with any power of two spreads them).
fn pick(k: usize, sequences: usize) -> usize {
    (k.wrapping_mul(7919)) % sequences.max(1)
}

/// Runs Workload B against the backend called `name`; `None` if there is no such backend.
pub fn run(name: &str, workload: &Synthetic) -> Option<SyntheticResult> {
    let mut index = backend(name)?;
    let config = &workload.config;
    let options = MatchOptions::default();
    let mut anomalies = 0u64;

    let stores: Vec<Mutation> = workload.sequences.iter().map(Sequence::store).collect();
    let start = Instant::now();
    for store in &stores {
        anomalies += index.apply(store).anomalies();
    }
    let build_secs = start.elapsed().as_secs_f64().max(1e-9);
    drop(stores);
    let stats = index.stats();

    let (mut mismatches, mut checked) = (0u64, 0u64);
    let skip = config.iterations / 10;
    let mut time_queries = |kind: usize, index: &dyn KvIndex| {
        let mut histogram = histogram();
        for k in 0..config.iterations {
            let s = pick(k, config.sequences);
            let (query, oracle) = match kind {
                0 => (workload.hit(s), workload.oracle(s, config.depth)),
                1 => (workload.partial(s), workload.oracle(s, config.depth / 2)),
                _ => (
                    workload.unknown(1 << 40 | k as u64, config.depth),
                    Vec::new(),
                ),
            };
            let begin = Instant::now();
            let matches = index.find_matches(&query, &options);
            let elapsed = begin.elapsed();
            if k >= skip {
                histogram.saturating_record(elapsed.as_nanos().max(1) as u64);
            }
            checked += 1;
            mismatches += u64::from(!agrees(&matches, &oracle));
        }
        Latency::of(&histogram)
    };
    let hit = time_queries(0, &*index);
    let partial = time_queries(1, &*index);
    let miss = time_queries(2, &*index);

    let (mut remove, mut store) = (histogram(), histogram());
    for k in 0..config.cycles {
        let seq = &workload.sequences[pick(k + 1, config.sequences)];
        let (removed, stored) = (seq.remove(), seq.store());
        let begin = Instant::now();
        let report = index.apply(&removed);
        let middle = Instant::now();
        let report2 = index.apply(&stored);
        let end = Instant::now();
        remove.saturating_record((middle - begin).as_nanos().max(1) as u64);
        store.saturating_record((end - middle).as_nanos().max(1) as u64);
        anomalies += report.anomalies() + report2.anomalies();
    }
    for k in 0..64.min(config.sequences) {
        let s = pick(k + 3, config.sequences);
        let matches = index.find_matches(&workload.hit(s), &options);
        checked += 1;
        mismatches += u64::from(!agrees(&matches, &workload.oracle(s, config.depth)));
    }
    let after = index.stats().memberships;
    let expected = workload.memberships();
    Some(SyntheticResult {
        backend: name.to_string(),
        build_secs,
        build_blocks_per_s: expected as f64 / build_secs,
        hit,
        partial,
        miss,
        remove: Latency::of(&remove),
        store: Latency::of(&store),
        heap_bytes: stats.heap_bytes,
        bytes_per_membership: stats.heap_bytes as f64 / stats.memberships.max(1) as f64,
        memberships: stats.memberships,
        memberships_after_cycles: after,
        expected_memberships: expected,
        mismatches,
        checked,
        anomalies,
        expected_anomalies: workload.shared_prefix_blocks(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_workload_has_a_million_memberships_with_the_right_sharing() {
        let workload = generate(&SyntheticConfig::default());
        assert_eq!(workload.sequences.len(), 1024);
        assert!(workload.sequences.iter().all(|s| s.locals.len() == 1024));
        assert_eq!(workload.memberships(), 1_048_576);
        // Distinct engine hashes: one per (sequence, position).
        let mut externals: Vec<u64> = workload
            .sequences
            .iter()
            .flat_map(|s| s.externals.iter().map(|e| e.get()))
            .collect();
        externals.sort_unstable();
        externals.dedup();
        assert_eq!(externals.len(), 1_048_576);
        // Distinct local hashes: 4 groups × 256 shared + 1024 × 768 own.
        let mut locals: Vec<u64> = workload
            .sequences
            .iter()
            .flat_map(|s| s.locals.iter().map(|l| l.get()))
            .collect();
        locals.sort_unstable();
        locals.dedup();
        assert_eq!(locals.len(), 4 * 256 + 1024 * 768);
        // Sharing: same group ⇒ same first 256 blocks, different 257th.
        let (a, b) = (&workload.sequences[0], &workload.sequences[1]);
        let same = workload
            .sequences
            .iter()
            .skip(1)
            .find(|s| s.group == a.group)
            .expect("a group has more than one sequence");
        assert_eq!(a.locals[..256], same.locals[..256]);
        assert_ne!(a.locals[256], same.locals[256]);
        if a.group != b.group {
            assert_ne!(a.locals[0], b.locals[0]);
        }
        // Ownership and group sizes (random, roughly a quarter each).
        assert!(
            workload
                .sequences
                .iter()
                .enumerate()
                .all(|(i, s)| s.worker.worker_id == (i % 128) as u64)
        );
        for g in 0..4 {
            let n = workload.sequences.iter().filter(|s| s.group == g).count();
            assert!((180..330).contains(&n), "group {g}: {n}");
        }
    }

    #[test]
    fn generation_is_deterministic() {
        let config = SyntheticConfig {
            sequences: 64,
            depth: 32,
            workers: 8,
            shared: 8,
            ..SyntheticConfig::default()
        };
        let (a, b) = (generate(&config), generate(&config));
        assert_eq!(a.sequences, b.sequences);
        let other = generate(&SyntheticConfig { seed: 7, ..config });
        assert_ne!(a.sequences, other.sequences);
    }

    #[test]
    fn every_backend_agrees_with_the_construction_oracle() {
        let config = SyntheticConfig {
            sequences: 96,
            depth: 64,
            workers: 16,
            shared: 16,
            groups: 4,
            iterations: 50,
            cycles: 40,
            seed: 5,
            engine_hashes: EngineHashes::Unique,
        };
        let workload = generate(&config);
        for name in crate::replay::backend_names() {
            let result = run(name, &workload).expect("registered");
            assert!(result.is_correct(), "{name}: {result:?}");
            assert_eq!(result.memberships, 96 * 64, "{name}");
            assert_eq!(result.checked, 150 + 64);
        }
    }

    /// Chained engine hashes: a worker's sequences of one group share their prefix blocks
    /// (fewer memberships, duplicate stores while building), and the remove + store cycle of a
    /// whole sequence — which takes the prefix from under its siblings and gives it back — keeps
    /// every backend equal to the construction oracle.
    #[test]
    fn chained_engine_hashes_share_prefix_blocks_and_every_backend_agrees() {
        let config = SyntheticConfig {
            sequences: 96,
            depth: 64,
            workers: 16,
            shared: 16,
            groups: 2,
            iterations: 50,
            cycles: 60,
            seed: 5,
            engine_hashes: EngineHashes::Chained,
        };
        let workload = generate(&config);
        // 96 sequences over 16 workers and 2 groups: some worker holds two of one group.
        let shared = workload.shared_prefix_blocks();
        assert!(shared >= 16 * 16, "{shared}");
        assert_eq!(workload.memberships(), 96 * 64 - shared);
        let (a, b) = (&workload.sequences[0], &workload.sequences[16]);
        assert_eq!(a.worker, b.worker);
        if a.group == b.group {
            assert_eq!(a.externals[..16], b.externals[..16]);
            assert_ne!(a.externals[16], b.externals[16]);
        }
        for name in crate::replay::backend_names() {
            let result = run(name, &workload).expect("registered");
            assert!(result.is_correct(), "{name}: {result:?}");
            assert_eq!(result.anomalies, shared, "{name}");
        }
    }
}
