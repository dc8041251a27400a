//! Atlas's unit tests: span arithmetic against a per-position model, the forest's shape and
//! memory after churn, and answers against the reference index.

use super::forest::Span;
use super::spans::{bounds_of_spans, change_spans, spans_of_bounds};
use super::*;
use crate::model::{ExternalBlockHash, LEVELS, Level, StoredBlock, Tier, Worker};
use crate::reference::ReferenceIndex;

/// Per-position counts (the model) against the run-length encoding, after every change.
fn check_spans(changes: &[(u32, u32, Level, bool)]) {
    const WIDTH: usize = 24;
    let mut model = [[0u32; LEVELS]; WIDTH];
    let mut spans = Vec::new();
    let mut next = Vec::new();
    for &(lo, len, level, add) in changes {
        let hi = (lo + len).min(WIDTH as u32);
        change_spans(&spans, lo, hi, level, add, &mut next);
        std::mem::swap(&mut spans, &mut next);
        for counts in &mut model[lo as usize..hi as usize] {
            let c = &mut counts[level as usize];
            *c = if add { *c + 1 } else { c.saturating_sub(1) };
        }
        let mut expected = Vec::new();
        for (p, &counts) in model.iter().enumerate() {
            let p = p as u32;
            if counts == [0; LEVELS] {
                continue;
            }
            match expected.last_mut() {
                Some(Span { hi, counts: c, .. }) if *hi == p && *c == counts => *hi += 1,
                _ => expected.push(Span {
                    lo: p,
                    hi: p + 1,
                    counts,
                }),
            }
        }
        assert_eq!(spans, expected, "after {changes:?}");
        let mut bounds = [0; LEVELS];
        for (level, bound) in bounds.iter_mut().enumerate() {
            while (*bound as usize) < WIDTH
                && model[*bound as usize][..=level].iter().any(|&c| c > 0)
            {
                *bound += 1;
            }
        }
        assert_eq!(bounds_of_spans(&spans), bounds);
        let mut from_bounds = Vec::new();
        spans_of_bounds(bounds, &mut from_bounds);
        assert_eq!(bounds_of_spans(&from_bounds), bounds);
    }
}

proptest::proptest! {
    #[test]
    fn run_length_counts_match_per_position_counts(
        changes in proptest::collection::vec(
            (0u32..24, 0u32..8, 0u8..LEVELS as u8, proptest::bool::weighted(0.6)),
            0..40,
        )
    ) {
        check_spans(&changes);
    }
}

/// A device-only query must not confuse a rank that covers a deeper edge only on a lower
/// tier with another rank's row (regression: rows were indexed only for ranks still
/// matching on the device tier, so such a rank read a stale row left by an earlier query).
#[test]
fn lower_tier_ranks_on_deeper_edges_do_not_touch_other_rows() {
    let blocks = |ids: &[u64]| -> Vec<StoredBlock> {
        ids.iter()
            .map(|&i| StoredBlock {
                external: ExternalBlockHash::new(i),
                local: LocalBlockHash::new(i),
            })
            .collect()
    };
    let store = |worker, tier, ids: &[u64]| Mutation::Stored {
        worker,
        tier,
        parent: None,
        blocks: blocks(ids),
    };
    let locals = |ids: &[u64]| -> Vec<LocalBlockHash> {
        ids.iter().map(|&i| LocalBlockHash::new(i)).collect()
    };
    let (victim, lower) = (Worker::new(1, 0), Worker::new(2, 0));
    let mut atlas = Atlas::new();
    // An earlier query leaves `lower`'s row index at 0 (it was the only row then).
    atlas.apply(&store(lower, Tier::Device, &[90, 91]));
    atlas.find_matches(&locals(&[90, 91, 92]), &MatchOptions::default());
    // Root edge [1, 2, 3]; `lower` branches off at offset 2 on the host tier; the victim
    // (row 0 now) follows that branch on the device tier and goes on.
    atlas.apply(&store(victim, Tier::Device, &[1, 2, 3]));
    atlas.apply(&store(lower, Tier::Host, &[1, 2, 4, 5]));
    atlas.apply(&Mutation::Stored {
        worker: victim,
        tier: Tier::Device,
        parent: Some(ExternalBlockHash::new(2)),
        blocks: blocks(&[14, 15, 16, 17])
            .into_iter()
            .zip([4, 5, 6, 7])
            .map(|(b, l)| StoredBlock {
                local: LocalBlockHash::new(l),
                ..b
            })
            .collect(),
    });
    let query = locals(&[1, 2, 4, 5, 6, 7, 8]);
    let matches = atlas.find_matches(&query, &MatchOptions::default()).workers;
    assert_eq!(matches.len(), 1);
    assert_eq!((matches[0].worker, matches[0].device), (victim, 6));
    let tiered = MatchOptions {
        tiered: true,
        ..MatchOptions::default()
    };
    let matches = atlas.find_matches(&query, &tiered).workers;
    assert_eq!(matches.len(), 2);
    assert_eq!((matches[0].worker, matches[0].device), (victim, 6));
    assert_eq!(
        (matches[1].worker, matches[1].device, matches[1].host),
        (lower, 0, 4)
    );
}

/// A rank holding more blocks than 2-byte slot indices address (the ledger's table widens)
/// keeps finding its blocks: removals deep in the chain cut the score exactly there.
#[test]
fn a_rank_beyond_65535_blocks_stays_exact() {
    let worker = Worker::new(1, 0);
    let mut atlas = Atlas::new();
    let local = |i: u64| LocalBlockHash::new(i % 1000 + 7);
    for run in 0..70u64 {
        atlas.apply(&Mutation::Stored {
            worker,
            tier: Tier::Device,
            parent: (run > 0).then(|| ExternalBlockHash::new(run * 1000 - 1)),
            blocks: (run * 1000..(run + 1) * 1000)
                .map(|i| StoredBlock {
                    external: ExternalBlockHash::new(i),
                    local: local(i),
                })
                .collect(),
        });
    }
    let query: Vec<LocalBlockHash> = (0..70_000).map(local).collect();
    let options = MatchOptions::default();
    assert_eq!(
        atlas.find_matches(&query, &options).workers[0].device,
        70_000
    );
    // Blocks stored before and after the table widened, found again by hash.
    let report = atlas.apply(&Mutation::Removed {
        worker,
        tier: Tier::Device,
        blocks: [69_999, 66_000, 100]
            .into_iter()
            .map(ExternalBlockHash::new)
            .collect(),
    });
    assert_eq!(report.removed, 3);
    assert_eq!(atlas.find_matches(&query, &options).workers[0].device, 100);
    // The removed blocks' descendants are held but unrooted.
    assert_eq!(atlas.stats().memberships, 69_997);
    assert_eq!(atlas.snapshot().workers[0].blocks.len(), 69_997);
}

/// The run-structured ledger keeps a stored chain as one run, cuts it only where a change
/// hits its middle, and reuses freed arena positions instead of growing.
#[test]
fn runs_stay_whole_and_the_arena_is_reused() {
    let worker = Worker::new(3, 0);
    let hashes = |from: u64, len: u64| -> Vec<ExternalBlockHash> {
        (from..from + len).map(ExternalBlockHash::new).collect()
    };
    // `len` blocks from `from`, each the parent of the next, under `parent`.
    let store = |tier, parent: Option<u64>, from: u64, len: u64| Mutation::Stored {
        worker,
        tier,
        parent: parent.map(ExternalBlockHash::new),
        blocks: (from..from + len)
            .map(|i| StoredBlock {
                external: ExternalBlockHash::new(i),
                local: LocalBlockHash::new(i * 31 + 1),
            })
            .collect(),
    };
    let remove = |tier, blocks: Vec<ExternalBlockHash>| Mutation::Removed {
        worker,
        tier,
        blocks,
    };
    let ledger = |atlas: &Atlas| -> (usize, usize, usize) {
        let (_, l) = &atlas.books.ledgers[&worker];
        (l.run_count(), l.arena_len(), l.len())
    };
    let mut atlas = Atlas::new();
    atlas.apply(&store(Tier::Device, None, 0, 1000));
    assert_eq!(ledger(&atlas), (1, 1000, 1000));
    // Leaf-first eviction, named deepest first: the run shrinks, the arena with it.
    let mut descending = hashes(900, 100);
    descending.reverse();
    atlas.apply(&remove(Tier::Device, descending));
    assert_eq!(ledger(&atlas), (1, 900, 900));
    // A block in the middle gains a tier: three runs; a middle block removed: the run
    // after it hangs dangling, still one piece.
    atlas.apply(&store(Tier::Host, Some(99), 100, 1));
    assert_eq!(ledger(&atlas).0, 3);
    atlas.apply(&remove(Tier::Device, hashes(500, 1)));
    assert_eq!(ledger(&atlas), (4, 900, 899));
    // A continuation stored after the removal fills the hole, not the arena's end.
    atlas.apply(&store(Tier::Device, Some(499), 5000, 1));
    assert_eq!(ledger(&atlas), (5, 900, 900));
    // Everything named in a scrambled order, some twice: nothing left, the arena empty.
    let mut all: Vec<ExternalBlockHash> = hashes(0, 900);
    all.push(ExternalBlockHash::new(5000));
    all.sort_by_key(|h| h.get().wrapping_mul(0x9e37_79b9_7f4a_7c15));
    all.extend(hashes(10, 5));
    let report = atlas.apply(&remove(Tier::Device, all));
    assert_eq!((report.removed, report.unknown_removes), (900, 6));
    let report = atlas.apply(&remove(Tier::Host, hashes(100, 1)));
    assert_eq!(report.removed, 1);
    // Emptied by its own removals, the rank keeps its ledger's room (not listed, no blocks),
    // and a later store starts the arena again from its first slot.
    assert_eq!(ledger(&atlas), (0, 0, 0));
    assert!(atlas.books.ledgers[&worker].1.heap_bytes() > 0);
    assert_eq!(atlas.stats().memberships, 0);
    assert!(atlas.stats().workers.is_empty());
    atlas.apply(&store(Tier::Device, None, 7000, 10));
    assert_eq!(ledger(&atlas), (1, 10, 10));
    let mut reference = ReferenceIndex::new();
    reference.apply(&store(Tier::Device, None, 7000, 10));
    assert_eq!(atlas.stats().workers, reference.stats().workers);
    // Its clear (or the worker's removal) gives the room back.
    atlas.apply(&Mutation::Cleared { worker });
    assert!(!atlas.books.ledgers.contains_key(&worker));
    // A removal naming only blocks a rank does not hold leaves no ledger behind.
    atlas.apply(&remove(Tier::Device, hashes(1, 3)));
    assert!(!atlas.books.ledgers.contains_key(&worker));
}

/// Holes made one block at a time and then merged pile up stale entries in the size-class
/// lists until they are pruned; the arena is reused and shrinks back, and the answers equal the
/// reference model's. (Debug builds check the ledger's invariants, holes included, after every
/// mutation.)
#[test]
fn holes_merge_and_their_class_lists_are_pruned() {
    let worker = Worker::new(5, 0);
    let chain = |parent: Option<u64>, from: u64, len: u64| Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: parent.map(ExternalBlockHash::new),
        blocks: (from..from + len)
            .map(|i| StoredBlock {
                external: ExternalBlockHash::new(i),
                local: LocalBlockHash::new(i * 7 + 3),
            })
            .collect(),
    };
    let remove = |block: u64| Mutation::Removed {
        worker,
        tier: Tier::Device,
        blocks: vec![ExternalBlockHash::new(block)],
    };
    let holes = |atlas: &Atlas| atlas.books.ledgers[&worker].1.hole_entries();
    let arena = |atlas: &Atlas| atlas.books.ledgers[&worker].1.arena_len();
    let mut atlas = Atlas::new();
    let mut reference = ReferenceIndex::new();
    let mut apply = |atlas: &mut Atlas, mutation: Mutation| {
        atlas.apply(&mutation);
        reference.apply(&mutation);
    };
    apply(&mut atlas, chain(None, 0, 600));
    // Every odd block but the last: 299 holes of one slot, none touching another.
    for block in (1..599).step_by(2) {
        apply(&mut atlas, remove(block));
    }
    assert_eq!(holes(&atlas), (299, 299));
    // The even blocks from the second on: each merges the holes on both sides into one, and
    // the merged holes' old entries go stale; the lists are pruned when stale entries pass
    // twice the holes (plus 64).
    let mut most = 0;
    for block in (2..598).step_by(2) {
        apply(&mut atlas, remove(block));
        let (count, entries) = holes(&atlas);
        assert!(entries >= count && entries <= 2 * count + 64 + 1);
        most = most.max(entries);
    }
    assert_eq!(holes(&atlas).0, 1, "one hole from slot 1 to 597");
    assert!(most > 64, "stale entries piled up before they were pruned");
    assert_eq!(arena(&atlas), 600);
    // A store fills the hole instead of growing the arena.
    apply(&mut atlas, chain(Some(0), 1000, 500));
    assert_eq!(arena(&atlas), 600);
    let query: Vec<LocalBlockHash> = [0u64]
        .into_iter()
        .chain(1000..1500)
        .map(|i| LocalBlockHash::new(i * 7 + 3))
        .collect();
    let options = MatchOptions::default();
    assert_eq!(
        atlas.find_matches(&query, &options),
        reference.find_matches(&query, &options)
    );
    assert_eq!(
        atlas.find_matches(&query, &options).device_score(worker),
        501
    );
    // Everything removed: the arena leaves no hole behind.
    let mut all: Vec<ExternalBlockHash> = [0u64, 598, 599]
        .into_iter()
        .chain(1000..1500)
        .map(ExternalBlockHash::new)
        .collect();
    all.reverse();
    atlas.apply(&Mutation::Removed {
        worker,
        tier: Tier::Device,
        blocks: all,
    });
    assert_eq!((arena(&atlas), holes(&atlas).0), (0, 0));
}

/// A rank's two sequences share a prefix; the first is removed whole and stored again (the
/// peer harness's Workload B cycle). The second's suffix leaves the forest and comes back as
/// one run on one edge, in a handful of forest changes rather than one per block, and the
/// answers equal the reference model's throughout.
#[test]
fn a_sibling_under_a_restored_prefix_is_rerooted_per_run() {
    let worker = Worker::new(7, 0);
    // A chain of blocks with the given engine hashes; local hash = f(engine hash).
    let chain = |hashes: &[u64]| -> Vec<StoredBlock> {
        hashes
            .iter()
            .map(|&h| StoredBlock {
                external: ExternalBlockHash::new(h),
                local: LocalBlockHash::new(h.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            })
            .collect()
    };
    let prefix: Vec<u64> = (1..=256).collect();
    let first: Vec<u64> = prefix.iter().copied().chain(10_000..10_768).collect();
    let second: Vec<u64> = prefix.iter().copied().chain(20_000..20_768).collect();
    let store = |hashes: &[u64]| Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: None,
        blocks: chain(hashes),
    };
    let remove = Mutation::Removed {
        worker,
        tier: Tier::Device,
        blocks: first.iter().map(|&h| ExternalBlockHash::new(h)).collect(),
    };
    let query =
        |hashes: &[u64]| -> Vec<LocalBlockHash> { chain(hashes).iter().map(|b| b.local).collect() };
    let scores = |m: &Matches| -> Vec<(Worker, u32)> {
        m.workers.iter().map(|w| (w.worker, w.device)).collect()
    };
    let mut atlas = Atlas::new();
    let mut reference = ReferenceIndex::new();
    for m in [store(&first), store(&second)] {
        atlas.apply(&m);
        reference.apply(&m);
    }
    let options = MatchOptions::default();
    let check = |atlas: &Atlas, reference: &ReferenceIndex| {
        for q in [query(&first), query(&second)] {
            assert_eq!(
                scores(&atlas.find_matches(&q, &options)),
                scores(&reference.find_matches(&q, &options))
            );
        }
    };
    check(&atlas, &reference);
    let runs = |atlas: &Atlas| atlas.books.ledgers[&worker].1.run_count();
    let (runs_before, edges_before) = (runs(&atlas), atlas.forest.live_edges());
    assert_eq!(
        scores(&atlas.find_matches(&query(&second), &options)),
        [(worker, 1024)]
    );

    atlas.apply(&remove);
    reference.apply(&remove);
    check(&atlas, &reference);
    assert!(
        atlas
            .find_matches(&query(&second), &options)
            .workers
            .is_empty()
    );

    atlas.forest.journal = Some(Vec::new());
    atlas.apply(&store(&first));
    reference.apply(&store(&first));
    let changes = atlas.forest.journal.take().map_or(0, |j| j.len());
    check(&atlas, &reference);
    assert_eq!(
        scores(&atlas.find_matches(&query(&second), &options)),
        [(worker, 1024)]
    );
    assert_eq!(
        (runs(&atlas), atlas.forest.live_edges()),
        (runs_before, edges_before)
    );
    // 1,792 blocks come back; a per-block re-rooting recorded one change for each.
    assert!(changes <= 16, "{changes} forest changes for two runs");
}

/// Head-first eviction cuts a chain's first blocks off in place: the rest keeps its run
/// record (no record is made for it, none dropped), leaves the forest with the branch hanging
/// on it, and is rooted again (a run of its own under the re-stored head) when the head is
/// stored again; answers equal the reference model's throughout.
#[test]
fn a_chain_evicted_head_first_keeps_its_run() {
    let worker = Worker::new(9, 0);
    let block = |h: u64| StoredBlock {
        external: ExternalBlockHash::new(h),
        local: LocalBlockHash::new(h * 13 + 5),
    };
    let store = |parent: Option<u64>, hashes: std::ops::Range<u64>| Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: parent.map(ExternalBlockHash::new),
        blocks: hashes.map(block).collect(),
    };
    let remove = |hashes: Vec<u64>| Mutation::Removed {
        worker,
        tier: Tier::Device,
        blocks: hashes.into_iter().map(ExternalBlockHash::new).collect(),
    };
    let trunk: Vec<LocalBlockHash> = (0..100).map(|h| block(h).local).collect();
    let branch: Vec<LocalBlockHash> = (0..61).chain(1000..1010).map(|h| block(h).local).collect();
    let options = MatchOptions::default().with_tiered(true);
    let mut atlas = Atlas::new();
    let mut reference = ReferenceIndex::new();
    let mut apply = |m: Mutation| {
        assert_eq!(atlas.apply(&m), reference.apply(&m));
        for q in [&trunk, &branch] {
            assert_eq!(
                atlas.find_matches(q, &options),
                reference.find_matches(q, &options)
            );
        }
        assert_eq!(atlas.snapshot(), reference.snapshot());
        let (_, ledger) = &atlas.books.ledgers[&worker];
        (ledger.run_count(), ledger.run_records(), ledger.len())
    };
    apply(store(None, 0..100));
    assert_eq!(apply(store(Some(60), 1000..1010)), (2, 2, 110));
    // The rooted chain's head: the rest and the branch are unrooted, two records still.
    assert_eq!(apply(remove((0..20).collect())), (2, 2, 90));
    // The unrooted rest's head, named deepest first.
    assert_eq!(apply(remove((20..35).rev().collect())), (2, 2, 75));
    // The head stored again adopts the rest, and the branch is rooted with it.
    assert_eq!(apply(store(None, 0..35)).0, 3);
}

/// After every rank leaves, nothing of the forest is left in use, whatever the history.
#[test]
fn the_forest_empties_when_every_rank_leaves() {
    let mut atlas = Atlas::new();
    let mut state = 0x1234_5678_u64;
    let mut next = |bound: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % bound
    };
    for round in 0..400u64 {
        let worker = Worker::new(next(4), 0);
        let tier = Tier::ALL[next(4) as usize];
        let mutation = if next(3) > 0 {
            let blocks = (0..1 + next(6))
                .map(|_| {
                    let id = next(40);
                    StoredBlock {
                        external: ExternalBlockHash::new(id),
                        local: LocalBlockHash::new(id % 7),
                    }
                })
                .collect();
            let parent = (next(4) > 0).then(|| ExternalBlockHash::new(next(40)));
            Mutation::Stored {
                worker,
                tier,
                parent,
                blocks,
            }
        } else {
            let blocks = (0..1 + next(5))
                .map(|_| ExternalBlockHash::new(next(40)))
                .collect();
            Mutation::Removed {
                worker,
                tier,
                blocks,
            }
        };
        atlas.apply(&mutation);
        if round % 100 == 99 {
            for id in 0..4 {
                atlas.remove_worker(id);
            }
            assert_eq!(
                atlas.forest.live_edges(),
                0,
                "edges leaked after round {round}"
            );
            assert!(atlas.forest.branches.table.is_empty());
            assert!(atlas.forest.multiple.is_empty());
            assert!(atlas.books.ledgers.is_empty());
        }
    }
}
