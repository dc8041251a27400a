//! Differential property tests: every backend against the reference model, after every step of
//! random multi-worker event sequences (holes, duplicates, conflicts, unknown parents and removes,
//! cycles, clears, worker removal, non-uniform engine hashes), on queries, apply reports,
//! snapshots and stats.

use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{
    ExternalBlockHash, KvIndex, MatchOptions, Mutation, ReferenceIndex, StoredBlock, Tier, Worker,
    baseline::{PositionalIndexer, RadixTree},
};
use proptest::prelude::*;

/// Small alphabets so that paths, engine hashes and local hashes collide often.
const EXTERNALS: u64 = 14;
const LOCALS: u64 = 3;
const WORKERS: [Worker; 3] = [Worker::new(0, 0), Worker::new(0, 1), Worker::new(1, 0)];

#[derive(Debug, Clone)]
enum Op {
    Apply(Mutation),
    RemoveWorker(u64),
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Device), 1 => Just(Tier::Host), 1 => Just(Tier::Disk), 1 => Just(Tier::External)]
}

fn worker() -> impl Strategy<Value = Worker> {
    prop::sample::select(WORKERS.to_vec())
}

fn op() -> impl Strategy<Value = Op> {
    let store = (
        worker(),
        tier(),
        prop::option::weighted(0.7, 0..EXTERNALS),
        prop::collection::vec((0..EXTERNALS, 0..LOCALS), 1..5),
    )
        .prop_map(|(worker, tier, parent, blocks)| {
            Op::Apply(Mutation::Stored {
                worker,
                tier,
                parent: parent.map(ExternalBlockHash::new),
                blocks: blocks
                    .into_iter()
                    .map(|(e, l)| StoredBlock {
                        external: ExternalBlockHash::new(e),
                        local: LocalBlockHash::new(l),
                    })
                    .collect(),
            })
        });
    let remove = (worker(), tier(), prop::collection::vec(0..EXTERNALS, 1..4)).prop_map(
        |(worker, tier, hashes)| {
            Op::Apply(Mutation::Removed {
                worker,
                tier,
                blocks: hashes.into_iter().map(ExternalBlockHash::new).collect(),
            })
        },
    );
    prop_oneof![
        10 => store,
        5 => remove,
        1 => worker().prop_map(|worker| Op::Apply(Mutation::Cleared { worker })),
        1 => (0u64..2).prop_map(Op::RemoveWorker),
    ]
}

/// Every query of length 0..=4 over the local alphabet.
fn all_queries() -> Vec<Vec<LocalBlockHash>> {
    let mut queries = vec![vec![]];
    let mut frontier = vec![vec![]];
    for _ in 0..4 {
        let mut next = Vec::new();
        for q in &frontier {
            for l in 0..LOCALS {
                let mut longer: Vec<LocalBlockHash> = q.clone();
                longer.push(LocalBlockHash::new(l));
                next.push(longer);
            }
        }
        queries.extend(next.iter().cloned());
        frontier = next;
    }
    queries
}

fn options() -> [MatchOptions; 4] {
    [
        MatchOptions::default().with_tiered(true),
        MatchOptions::default(),
        MatchOptions::default().with_early_exit(true),
        MatchOptions::default()
            .with_tiered(true)
            .with_top_k(Some(1)),
    ]
}

fn assert_same_answers(
    backend: &dyn KvIndex,
    oracle: &ReferenceIndex,
    queries: &[Vec<LocalBlockHash>],
    context: &str,
) {
    for query in queries {
        for options in options() {
            let want = oracle.find_matches(query, &options);
            let got = backend.find_matches(query, &options);
            assert_eq!(got, want, "{context}: query {query:?}, options {options:?}");
        }
    }
}

fn run_differential(make: fn() -> Box<dyn KvIndex>, ops: &[Op]) {
    let queries = all_queries();
    let mut backend = make();
    let mut oracle = ReferenceIndex::new();
    for (step, op) in ops.iter().enumerate() {
        let (got, want) = match op {
            Op::Apply(m) => (backend.apply(m), oracle.apply(m)),
            Op::RemoveWorker(id) => (backend.remove_worker(*id), oracle.remove_worker(*id)),
        };
        let context = format!("step {step} ({op:?})");
        assert_eq!(got, want, "{context}: apply report");
        assert_same_answers(backend.as_ref(), &oracle, &queries, &context);
        assert_eq!(
            backend.stats().workers,
            oracle.stats().workers,
            "{context}: block counts"
        );
    }
    // Snapshots are backend-independent and restore to identical answers and behaviour.
    let snapshot = backend.snapshot();
    assert_eq!(snapshot, oracle.snapshot(), "snapshot");
    let mut restored = make();
    restored.restore(&snapshot);
    assert_same_answers(restored.as_ref(), &oracle, &queries, "after restore");
    assert_eq!(
        restored.snapshot(),
        snapshot,
        "snapshot of the restored index"
    );
    for op in ops.iter().take(12) {
        if let Op::Apply(m) = op {
            assert_eq!(
                restored.apply(m),
                oracle.apply(m),
                "restored index reacts like the oracle to {m:?}"
            );
        }
    }
    assert_same_answers(
        restored.as_ref(),
        &oracle,
        &queries,
        "after restore and more mutations",
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn radix_tree_matches_reference(ops in prop::collection::vec(op(), 1..40)) {
        run_differential(|| Box::new(RadixTree::new()), &ops);
    }

    #[test]
    fn positional_indexer_matches_reference(ops in prop::collection::vec(op(), 1..40)) {
        // Small jumps so that the short queries (up to 4 blocks) exercise jumps and the binary
        // search inside skipped ranges; 32 is the default (a single probe at the query's end).
        run_differential(|| Box::new(PositionalIndexer::with_jump(1)), &ops);
        run_differential(|| Box::new(PositionalIndexer::with_jump(2)), &ops);
        run_differential(|| Box::new(PositionalIndexer::with_jump(32)), &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn atlas_matches_reference(ops in prop::collection::vec(op(), 1..40)) {
        run_differential(|| Box::new(kvatlas_index::Atlas::new()), &ops);
    }

    /// Longer histories and queries than the exhaustive ones (up to 9 blocks), asked in a
    /// random order on one thread, so deeper edges, branches on several tiers and per-thread
    /// query scratch left by earlier queries all come into play.
    #[test]
    fn atlas_matches_reference_on_long_queries(
        ops in prop::collection::vec(op(), 1..80),
        queries in prop::collection::vec(prop::collection::vec(0..LOCALS, 5..10), 40),
    ) {
        let queries: Vec<Vec<LocalBlockHash>> = queries
            .into_iter()
            .map(|q| q.into_iter().map(LocalBlockHash::new).collect())
            .collect();
        let mut backend = kvatlas_index::Atlas::new();
        let mut oracle = ReferenceIndex::new();
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Apply(m) => assert_eq!(backend.apply(m), oracle.apply(m)),
                Op::RemoveWorker(id) => {
                    assert_eq!(backend.remove_worker(*id), oracle.remove_worker(*id))
                }
            }
            assert_same_answers(&backend, &oracle, &queries, &format!("step {step} ({op:?})"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    /// The concurrent Atlas (books once, two forests kept in step by replaying recorded changes)
    /// answers like the oracle: every write publishes the other forest, so consecutive steps
    /// read the two copies alternately.
    #[test]
    fn concurrent_atlas_matches_reference(ops in prop::collection::vec(op(), 1..40)) {
        run_differential(|| Box::new(kvatlas_index::Exclusive(kvatlas_index::ConcurrentAtlas::new())), &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, failure_persistence: None, ..ProptestConfig::default() })]

    /// The concurrent fronts answer like the oracle too (both left-right copies receive every
    /// mutation; `Exclusive` drives a `SharedKvIndex` through `KvIndex`).
    #[test]
    fn concurrent_fronts_match_reference(ops in prop::collection::vec(op(), 1..40)) {
        run_differential(
            || Box::new(kvatlas_index::Exclusive(kvatlas_index::baseline::LeftRight::new(kvatlas_index::Atlas::new(), kvatlas_index::Atlas::new()))),
            &ops,
        );
        run_differential(|| Box::new(kvatlas_index::Exclusive(kvatlas_index::baseline::Locked::new(RadixTree::new()))), &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    /// The concurrent radix tree, driven through `KvIndex` (its own ledgers and shared tree).
    #[test]
    fn concurrent_radix_tree_matches_reference(ops in prop::collection::vec(op(), 1..40)) {
        run_differential(|| Box::new(kvatlas_index::Exclusive(kvatlas_index::baseline::ConcurrentRadixTree::new())), &ops);
        // Reclamation under every anomaly: once every rank is gone, so is every node.
        let tree = kvatlas_index::baseline::ConcurrentRadixTree::new();
        for op in &ops {
            match op {
                Op::Apply(m) => kvatlas_index::SharedKvIndex::apply(&tree, m),
                Op::RemoveWorker(id) => kvatlas_index::SharedKvIndex::remove_worker(&tree, *id),
            };
        }
        for worker in WORKERS {
            kvatlas_index::SharedKvIndex::apply(&tree, &Mutation::Cleared { worker });
        }
        prop_assert_eq!(tree.nodes(), 0, "nodes left after every rank cleared");
    }
}

/// Block `e` of the regression tests: engine hash `e`, local hash `e % LOCALS`.
fn block(e: u64) -> StoredBlock {
    StoredBlock {
        external: ExternalBlockHash::new(e),
        local: LocalBlockHash::new(e % LOCALS),
    }
}

/// Every backend, boxed.
fn every_backend() -> [fn() -> Box<dyn KvIndex>; 5] {
    [
        || Box::new(RadixTree::new()),
        || Box::new(kvatlas_index::baseline::PositionalIndexer::new()),
        || Box::new(kvatlas_index::Atlas::new()),
        || {
            Box::new(kvatlas_index::Exclusive(
                kvatlas_index::ConcurrentAtlas::new(),
            ))
        },
        || {
            Box::new(kvatlas_index::Exclusive(
                kvatlas_index::baseline::ConcurrentRadixTree::new(),
            ))
        },
    ]
}

/// Regression: a held block named twice in one store that adds a tier gains the tier once (the
/// second naming is a duplicate). The run-structured ledger adds a tier to a stretch of blocks
/// at once, after the stretch ends, and once counted the second naming as a new store.
#[test]
fn a_block_named_twice_in_one_store_gains_its_tier_once() {
    let worker = WORKERS[0];
    let x = block(7);
    // A block naming itself as parent: held, never reachable, and its parent check passes
    // for every repetition of it in a store with that parent.
    let store = |tier, blocks: Vec<StoredBlock>| Mutation::Stored {
        worker,
        tier,
        parent: Some(x.external),
        blocks,
    };
    for make in every_backend() {
        run_differential(
            make,
            &[
                Op::Apply(store(Tier::Device, vec![x])),
                Op::Apply(store(Tier::Host, vec![x, x, x])),
            ],
        );
    }
}

/// Regression: removals naming blocks out of order and more than once: stretches of one run
/// named in pieces, in both directions, with repeats, across runs and tiers.
#[test]
fn removals_out_of_order_with_repeats() {
    let worker = WORKERS[0];
    let store = |tier, parent: Option<u64>, blocks: &[u64]| Mutation::Stored {
        worker,
        tier,
        parent: parent.map(ExternalBlockHash::new),
        blocks: blocks.iter().map(|&e| block(e)).collect(),
    };
    let remove = |tier, blocks: &[u64]| Mutation::Removed {
        worker,
        tier,
        blocks: blocks.iter().map(|&e| ExternalBlockHash::new(e)).collect(),
    };
    for make in every_backend() {
        run_differential(
            make,
            &[
                Op::Apply(store(Tier::Device, None, &[10, 11, 12, 13, 14, 15, 16, 17])),
                Op::Apply(store(Tier::Device, Some(13), &[20, 21, 22])),
                Op::Apply(store(Tier::Host, None, &[10, 11, 12])),
                Op::Apply(remove(
                    Tier::Device,
                    &[16, 12, 15, 11, 21, 12, 17, 99, 14, 16],
                )),
                Op::Apply(remove(Tier::Host, &[12, 10, 11, 10])),
                Op::Apply(remove(Tier::Device, &[13, 10, 22, 20])),
            ],
        );
    }
}

/// Regression: blocks whose parent links form a cycle, all removed by one event (a depth-first
/// deletion once revisited them forever). Every backend must terminate and agree with the oracle.
#[test]
fn cycles_of_parent_links_removed_in_one_event() {
    let worker = WORKERS[0];
    // 1's parent is 0, 2's is 1, and 0's is 2: a cycle, unreachable from any root.
    let cycle = Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: Some(ExternalBlockHash::new(0)),
        blocks: vec![block(1), block(2), block(0)],
    };
    let remove = Mutation::Removed {
        worker,
        tier: Tier::Device,
        blocks: [0, 1, 2].map(ExternalBlockHash::new).to_vec(),
    };
    for make in every_backend() {
        run_differential(
            make,
            &[
                Op::Apply(cycle.clone()),
                Op::Apply(remove.clone()),
                Op::Apply(cycle.clone()),
            ],
        );
    }
}

/// A restored Atlas holds its blocks in runs as the original does: a snapshot lists a rank's
/// blocks by engine hash, and restored in that order each became a run of its own (3× the
/// original's heap); restored parents first, a chain is one run again. 32 ranks, each holding
/// a 16-block shared prefix and a 48-block tail of its own, with engine hashes as scattered
/// as real ones.
#[test]
fn a_restored_atlas_takes_no_more_heap_than_the_original() {
    let mut original = kvatlas_index::Atlas::new();
    for rank in 0..32u64 {
        let blocks: Vec<StoredBlock> = (0..64u64)
            .map(|i| {
                let id = if i < 16 { i } else { 1_000 * (rank + 1) + i };
                // splitmix64's finalizer: an engine hash in no relation to the chain's order.
                let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                StoredBlock {
                    external: ExternalBlockHash::new(z ^ (z >> 31)),
                    local: LocalBlockHash::new(id),
                }
            })
            .collect();
        original.apply(&Mutation::Stored {
            worker: Worker::new(rank, 0),
            tier: Tier::Device,
            parent: None,
            blocks,
        });
    }
    let mut restored = kvatlas_index::Atlas::new();
    restored.restore(&original.snapshot());
    assert_eq!(restored.snapshot(), original.snapshot());
    let (before, after) = (original.stats().heap_bytes, restored.stats().heap_bytes);
    assert!(
        after * 10 <= before * 11,
        "restored {after} B against {before} B before"
    );
}
