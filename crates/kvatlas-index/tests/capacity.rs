//! The capacity bound of the default backend: never more than `capacity` held (rank, block)
//! pairs; only leaves are evicted, least recently stored first; answers stay exact for what
//! remains (the reference model fed the same evictions answers identically).

use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{
    Atlas, ConcurrentAtlas, ExternalBlockHash, KvIndex, MatchOptions, Mutation, ReferenceIndex,
    SharedKvIndex, StoredBlock, Tier, Worker,
};
use proptest::prelude::*;

const WORKERS: [Worker; 3] = [Worker::new(0, 0), Worker::new(0, 1), Worker::new(1, 0)];

fn op() -> impl Strategy<Value = Mutation> {
    let worker = prop::sample::select(WORKERS.to_vec());
    let tier = prop_oneof![3 => Just(Tier::Device), 1 => Just(Tier::Host)];
    let store = (
        worker.clone(),
        tier.clone(),
        prop::option::weighted(0.7, 0..14u64),
        prop::collection::vec((0..14u64, 0..3u64), 1..5),
    )
        .prop_map(|(worker, tier, parent, blocks)| Mutation::Stored {
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
        });
    let remove = (worker.clone(), tier, prop::collection::vec(0..14u64, 1..3)).prop_map(
        |(worker, tier, hashes)| Mutation::Removed {
            worker,
            tier,
            blocks: hashes.into_iter().map(ExternalBlockHash::new).collect(),
        },
    );
    prop_oneof![8 => store, 3 => remove, 1 => worker.prop_map(|worker| Mutation::Cleared { worker })]
}

fn queries() -> Vec<Vec<LocalBlockHash>> {
    let mut all = vec![vec![]];
    for len in 1..=4u32 {
        for code in 0..3u64.pow(len) {
            all.push(
                (0..len)
                    .map(|i| LocalBlockHash::new(code / 3u64.pow(i) % 3))
                    .collect(),
            );
        }
    }
    all
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn bounded_atlas_is_exact_for_what_remains(capacity in 1u64..8, ops in prop::collection::vec(op(), 1..40)) {
        let queries = queries();
        let tiered = MatchOptions::default().with_tiered(true);
        let mut atlas = Atlas::with_capacity(capacity);
        // The concurrent Atlas shares the eviction code: it must evict the same blocks.
        let concurrent = ConcurrentAtlas::with_capacity(capacity);
        let mut oracle = ReferenceIndex::new();
        for (step, mutation) in ops.iter().enumerate() {
            let mut got = atlas.apply(mutation);
            prop_assert_eq!(SharedKvIndex::apply(&concurrent, mutation), got, "step {}: concurrent report", step);
            let want = oracle.apply(mutation);
            let evicted = got.evicted;
            got.evicted = 0;
            prop_assert_eq!(got, want, "step {}: report", step);
            let evictions = atlas.take_evictions();
            prop_assert_eq!(concurrent.take_evictions(), evictions.clone(), "step {}: concurrent evictions", step);
            prop_assert_eq!(evictions.iter().map(|e| u64::from(e.tiers.bits().count_ones())).sum::<u64>(), evicted);
            for eviction in &evictions {
                // Only leaves (no other held block names it as parent) — unless no rank holds any leaf
                // at all (parent links in a cycle), when the bound falls back to any block.
                let held = oracle.snapshot();
                let has_children = |worker, external| {
                    held.workers.iter().filter(|w| w.worker == worker).any(|w| w.blocks.iter().any(|b| b.parent == Some(external) && b.external != external))
                };
                let any_leaf = held.workers.iter().any(|w| w.blocks.iter().any(|b| !has_children(w.worker, b.external)));
                prop_assert!(
                    !has_children(eviction.worker, eviction.external) || !any_leaf,
                    "step {}: evicted {:?}, which has children, while leaves existed", step, eviction
                );
                for tier in eviction.tiers.iter() {
                    oracle.apply(&Mutation::Removed { worker: eviction.worker, tier, blocks: vec![eviction.external] });
                }
            }
            prop_assert!(atlas.snapshot().blocks() as u64 <= capacity, "step {}: over capacity", step);
            prop_assert_eq!(atlas.snapshot(), oracle.snapshot(), "step {}: state", step);
            for query in &queries {
                prop_assert_eq!(atlas.find_matches(query, &tiered), oracle.find_matches(query, &tiered), "step {}: {:?}", step, query);
                prop_assert_eq!(SharedKvIndex::find_matches(&concurrent, query, &tiered), oracle.find_matches(query, &tiered), "step {}: concurrent {:?}", step, query);
            }
        }
    }
}

/// Evictions nobody takes (the server counts them from the reports) are kept to a bound: the
/// list grew for ever, and every write scanned all of it. Every eviction is still counted.
#[test]
fn evictions_not_taken_are_kept_to_a_bound() {
    let worker = Worker::new(7, 0);
    let mut atlas = Atlas::with_capacity(1);
    let mut counted = 0;
    for i in 0..10_000u64 {
        counted += atlas
            .apply(&Mutation::Stored {
                worker,
                tier: Tier::Device,
                parent: None,
                blocks: vec![StoredBlock {
                    external: ExternalBlockHash::new(i),
                    local: LocalBlockHash::new(1_000_000 + i),
                }],
            })
            .evicted;
    }
    assert_eq!(
        counted, 9_999,
        "each store past the first evicted one block"
    );
    let kept = atlas.take_evictions();
    assert!(
        !kept.is_empty() && kept.len() <= 2 * 1024,
        "{} evictions kept",
        kept.len()
    );
    assert_eq!(
        kept.last().map(|e| e.external.get()),
        Some(9_998),
        "the newest are kept"
    );
}

/// `worker` stores block `i` alone (engine hash `i`, local hash 1,000 + `i`), without a parent.
fn store(worker: Worker, i: u64) -> Mutation {
    Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: None,
        blocks: vec![StoredBlock {
            external: ExternalBlockHash::new(i),
            local: LocalBlockHash::new(1_000 + i),
        }],
    }
}

/// The ranks of the restore tests: two restored ([`two_ranks_stored`]), one storing after.
const ONE: Worker = Worker::new(9, 0);
const OTHER: Worker = Worker::new(5, 0);
const LATER: Worker = Worker::new(1, 0);

/// An index where [`ONE`] stored blocks `0..n` and [`OTHER`] blocks `100..100 + n`, in turn.
fn two_ranks_stored(n: u64) -> Atlas {
    let mut atlas = Atlas::new();
    for i in 0..n {
        atlas.apply(&store(ONE, i));
        atlas.apply(&store(OTHER, 100 + i));
    }
    atlas
}

/// After a restore, the blocks stored next are newer than the restored ones: over capacity,
/// restored blocks go first, the ranks' in turn. (The bound's clock stayed at 0 on a restore:
/// the first blocks stored after it were stamped as old as the oldest restored ones and, on a
/// tie decided by the rank, evicted first.)
#[test]
fn blocks_stored_after_a_restore_are_newer_than_the_restored_ones() {
    let before = two_ranks_stored(3);
    let mut atlas = Atlas::with_capacity(7);
    atlas.restore(&before.snapshot());
    assert_eq!(atlas.apply(&store(LATER, 10)).evicted, 0, "7 held");
    assert_eq!(atlas.apply(&store(LATER, 11)).evicted, 1, "8: one goes");
    assert_eq!(atlas.apply(&store(LATER, 12)).evicted, 1, "and another");
    let mut evicted: Vec<(Worker, u64)> = atlas
        .take_evictions()
        .iter()
        .map(|e| (e.worker, e.external.get()))
        .collect();
    evicted.sort_unstable();
    assert_eq!(
        evicted,
        [(OTHER, 100), (ONE, 0)],
        "the oldest restored block of each rank in turn, none stored after the restore"
    );
}

/// A snapshot holding more than the capacity is evicted down to it by the restore, the oldest
/// restored blocks of each rank in turn, in both fronts; the next mutation evicts only for
/// itself (it evicted the whole excess, charged to its report, and the index held more than
/// its bound until then). No eviction of the restore's is reported.
#[test]
fn a_restore_beyond_the_capacity_is_evicted_down_to_it() {
    let snapshot = two_ranks_stored(5).snapshot();
    // What stays: the two newest of each rank.
    let query = |i: u64| vec![LocalBlockHash::new(1_000 + i)];
    let kept = |index: &dyn Fn(&[LocalBlockHash]) -> usize| {
        (0..5)
            .flat_map(|i| [i, 100 + i])
            .filter(|&i| index(&query(i)) > 0)
            .collect::<Vec<u64>>()
    };
    let mut atlas = Atlas::with_capacity(4);
    atlas.restore(&snapshot);
    assert_eq!(atlas.stats().memberships, 4);
    assert!(
        atlas.take_evictions().is_empty(),
        "the restore's are not reported"
    );
    assert_eq!(
        kept(&|q| atlas
            .find_matches(q, &MatchOptions::default())
            .workers
            .len()),
        [3, 103, 4, 104]
    );
    assert_eq!(atlas.apply(&store(LATER, 10)).evicted, 1, "its own only");
    let concurrent = ConcurrentAtlas::with_capacity(4);
    concurrent.restore(&snapshot);
    assert_eq!(concurrent.stats().memberships, 4);
    assert_eq!(
        kept(&|q| concurrent
            .find_matches(q, &MatchOptions::default())
            .workers
            .len()),
        [3, 103, 4, 104]
    );
}

/// Two conversations share a 4-block system prompt; over capacity, their private tails go
/// first (least recent first) and the shared prefix stays.
///
/// (A cycle of parent links has no leaf: the bound then falls back to any block, least recent
/// first; the property test below meets such inputs.)
#[test]
fn shared_prefixes_are_kept_longest() {
    let worker = Worker::new(7, 0);
    let block = |i: u64| StoredBlock {
        external: ExternalBlockHash::new(i),
        local: LocalBlockHash::new(1000 + i),
    };
    let mut atlas = Atlas::with_capacity(8);
    // Prefix 0..4, then conversation A 4..7 under block 3, then conversation B 10..13 under block 3.
    atlas.apply(&Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: None,
        blocks: (0..4).map(block).collect(),
    });
    atlas.apply(&Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: Some(ExternalBlockHash::new(3)),
        blocks: (4..7).map(block).collect(),
    });
    atlas.apply(&Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: Some(ExternalBlockHash::new(3)),
        blocks: (10..13).map(block).collect(),
    });
    // 10 blocks > 8: two leaves go, the least recent first: A's tail (6, then 5).
    let evicted: Vec<u64> = atlas
        .take_evictions()
        .iter()
        .map(|e| e.external.get())
        .collect();
    assert_eq!(evicted, [6, 5]);
    let prefix: Vec<LocalBlockHash> = (0..4).map(|i| LocalBlockHash::new(1000 + i)).collect();
    assert_eq!(
        atlas
            .find_matches(&prefix, &MatchOptions::default())
            .device_score(worker),
        4
    );
    let b: Vec<LocalBlockHash> = [0, 1, 2, 3, 10, 11, 12]
        .iter()
        .map(|i| LocalBlockHash::new(1000 + i))
        .collect();
    assert_eq!(
        atlas
            .find_matches(&b, &MatchOptions::default())
            .device_score(worker),
        7
    );
    // Block 4 (A) is touched, then 13 hangs under 12: the leaves are 4 and 13, and 4 is older.
    atlas.apply(&Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: Some(ExternalBlockHash::new(3)),
        blocks: vec![block(4)],
    });
    atlas.apply(&Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: Some(ExternalBlockHash::new(12)),
        blocks: vec![block(13)],
    });
    let evicted: Vec<u64> = atlas
        .take_evictions()
        .iter()
        .map(|e| e.external.get())
        .collect();
    assert_eq!(evicted, [4]);
}
