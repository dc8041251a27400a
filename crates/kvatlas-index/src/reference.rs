//! The reference model: the test oracle every backend is compared with.
//!
//! Deliberately naive and independent of the backends' shared code (it does not use the ledger):
//! each worker rank keeps a plain map from engine hash to `(local hash, parent hash, tiers)`, and
//! a query is answered straight from the definition in `docs/index.md` — the set of a rank's
//! blocks that form a chain matching the query's first `i` blocks, grown one position at a time.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvatlas_hash::LocalBlockHash;

use crate::backend::KvIndex;
use crate::model::{
    ApplyReport, ExternalBlockHash, IndexStats, MatchOptions, Matches, Mutation, Tier, TierSet,
    Worker, WorkerBlocks, WorkerMatch,
};
use crate::snapshot::{Snapshot, SnapshotBlock, WorkerSnapshot};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    local: LocalBlockHash,
    parent: Option<ExternalBlockHash>,
    tiers: TierSet,
}

/// The naive, obviously-correct index (slow: `O(blocks)` per query position).
#[derive(Debug, Clone, Default)]
pub struct ReferenceIndex {
    workers: BTreeMap<Worker, HashMap<ExternalBlockHash, Block>>,
}

impl ReferenceIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// The rank's score when only blocks held on a tier in `allowed` count.
    fn score(
        blocks: &HashMap<ExternalBlockHash, Block>,
        query: &[LocalBlockHash],
        allowed: &[Tier],
    ) -> u32 {
        let usable = |b: &Block| allowed.iter().any(|t| b.tiers.contains(*t));
        // Blocks ending a chain that matches the query's first `depth` blocks.
        let mut frontier: HashSet<ExternalBlockHash> = HashSet::new();
        let mut depth = 0u32;
        for (position, local) in query.iter().enumerate() {
            let next: HashSet<ExternalBlockHash> = blocks
                .iter()
                .filter(|(_, b)| b.local == *local && usable(b))
                .filter(|(_, b)| match b.parent {
                    None => position == 0,
                    Some(parent) => position > 0 && frontier.contains(&parent),
                })
                .map(|(hash, _)| *hash)
                .collect();
            if next.is_empty() {
                break;
            }
            frontier = next;
            depth += 1;
        }
        depth
    }
}

impl KvIndex for ReferenceIndex {
    fn apply(&mut self, mutation: &Mutation) -> ApplyReport {
        let mut report = ApplyReport::default();
        match mutation {
            Mutation::Stored {
                worker,
                tier,
                parent,
                blocks,
            } => {
                let held = self.workers.entry(*worker).or_default();
                if let Some(p) = parent
                    && !blocks.is_empty()
                    && !held.contains_key(p)
                {
                    report.unknown_parents += 1;
                }
                let mut previous = *parent;
                for block in blocks {
                    match held.get_mut(&block.external) {
                        Some(existing)
                            if existing.local != block.local || existing.parent != previous =>
                        {
                            report.conflicting_stores += 1;
                        }
                        Some(existing) if existing.tiers.contains(*tier) => {
                            report.duplicate_stores += 1
                        }
                        Some(existing) => {
                            existing.tiers = existing.tiers.with(*tier);
                            report.stored += 1;
                        }
                        None => {
                            let b = Block {
                                local: block.local,
                                parent: previous,
                                tiers: TierSet::only(*tier),
                            };
                            held.insert(block.external, b);
                            report.stored += 1;
                        }
                    }
                    previous = Some(block.external);
                }
                if held.is_empty() {
                    self.workers.remove(worker);
                }
            }
            Mutation::Removed {
                worker,
                tier,
                blocks,
            } => {
                let held = self.workers.entry(*worker).or_default();
                for hash in blocks {
                    match held.get_mut(hash) {
                        Some(b) if b.tiers.contains(*tier) => {
                            b.tiers = b.tiers.without(*tier);
                            report.removed += 1;
                            if b.tiers.is_empty() {
                                held.remove(hash);
                            }
                        }
                        _ => report.unknown_removes += 1,
                    }
                }
                if held.is_empty() {
                    self.workers.remove(worker);
                }
            }
            Mutation::Cleared { worker } => {
                if let Some(held) = self.workers.remove(worker) {
                    report.cleared += held
                        .values()
                        .map(|b| u64::from(b.tiers.bits().count_ones()))
                        .sum::<u64>();
                }
            }
        }
        report
    }

    fn remove_worker(&mut self, worker_id: u64) -> ApplyReport {
        let ranks: Vec<Worker> = self
            .workers
            .keys()
            .filter(|w| w.worker_id == worker_id)
            .copied()
            .collect();
        let mut report = ApplyReport::default();
        for worker in ranks {
            report.merge(&self.apply(&Mutation::Cleared { worker }));
        }
        report
    }

    fn clear(&mut self) {
        self.workers.clear();
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        let mut matches = Matches::default();
        for (worker, blocks) in &self.workers {
            let device = Self::score(blocks, query, &[Tier::Device]);
            let host = Self::score(blocks, query, &[Tier::Device, Tier::Host]);
            let disk = Self::score(blocks, query, &Tier::ALL);
            matches.workers.push(WorkerMatch {
                worker: *worker,
                device,
                host,
                disk,
            });
        }
        matches.finish(options);
        matches
    }

    fn snapshot(&self) -> Snapshot {
        let workers = self
            .workers
            .iter()
            .map(|(worker, blocks)| {
                let mut blocks: Vec<SnapshotBlock> = blocks
                    .iter()
                    .map(|(hash, b)| SnapshotBlock {
                        external: *hash,
                        local: b.local,
                        parent: b.parent,
                        tiers: b.tiers,
                    })
                    .collect();
                blocks.sort_unstable_by_key(|b| b.external);
                WorkerSnapshot {
                    worker: *worker,
                    blocks,
                }
            })
            .collect();
        Snapshot { workers }
    }

    fn restore(&mut self, snapshot: &Snapshot) {
        self.workers.clear();
        for w in &snapshot.workers {
            let held = self.workers.entry(w.worker).or_default();
            for b in w.blocks.iter().filter(|b| !b.tiers.is_empty()) {
                held.insert(
                    b.external,
                    Block {
                        local: b.local,
                        parent: b.parent,
                        tiers: b.tiers,
                    },
                );
            }
        }
        self.workers.retain(|_, held| !held.is_empty());
    }

    fn stats(&self) -> IndexStats {
        let mut stats = IndexStats::default();
        for (worker, blocks) in &self.workers {
            let mut per_tier = [0u64; 4];
            for b in blocks.values() {
                for t in b.tiers.iter() {
                    per_tier[t.index()] += 1;
                }
            }
            stats.memberships += per_tier.iter().sum::<u64>();
            stats.workers.push(WorkerBlocks {
                worker: *worker,
                per_tier,
            });
        }
        stats
    }
}
