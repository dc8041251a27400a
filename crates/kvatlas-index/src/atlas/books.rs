//! The writer-only books of an Atlas: per rank its ledger and rank index, and how a mutation,
//! a clear, a snapshot and a restore change the forest through them.

use rustc_hash::FxHashMap;

use crate::model::{ApplyReport, IndexStats, Mutation, Worker, WorkerBlocks};
use crate::run_ledger::RunLedger;
use crate::snapshot::{Snapshot, WorkerSnapshot};

use super::capacity::Bound;
use super::forest::{Forest, NodeRef};
use super::sink::Sink;

/// The writer-only part of an Atlas: per rank, its ledger and its rank index in the forest. Every
/// change it makes to the forest goes through the forest's recorded operations (see
/// [`ForestOp`](super::forest::ForestOp)), so [`ConcurrentAtlas`](super::ConcurrentAtlas) can keep one `Books` for two forests.
#[derive(Debug, Clone, Default)]
pub(super) struct Books {
    /// Per rank: its rank index in the forest and its ledger (hashed: looked up on every mutation;
    /// listings sort by rank).
    pub(super) ledgers: FxHashMap<Worker, (u32, RunLedger<NodeRef>)>,
    /// Indices of ranks that left, for reuse.
    pub(super) free_rank_indices: Vec<u32>,
    /// The optional capacity bound and its eviction state.
    pub(super) bound: Option<Bound>,
}

impl Books {
    /// The rank's slot and ledger, given a slot in `forest` if new, and whether the ledger was
    /// created by this call.
    pub(super) fn rank_index_and_ledger(
        &mut self,
        forest: &mut Forest,
        worker: Worker,
    ) -> (u32, &mut RunLedger<NodeRef>, bool) {
        let free_rank_indices = &mut self.free_rank_indices;
        let mut created = false;
        let (rank_index, ledger) = self.ledgers.entry(worker).or_insert_with(|| {
            created = true;
            let rank_index = free_rank_indices.pop().unwrap_or(forest.ranks.len() as u32);
            forest.assign_rank_index(rank_index, worker);
            (rank_index, RunLedger::default())
        });
        (*rank_index, ledger, created)
    }

    /// Drops `worker`'s ledger and gives its rank index back if it holds no block.
    ///
    /// Called after a clear, a worker's removal, an eviction by the capacity bound, and a
    /// mutation that created a ledger and left it empty. Not after a rank's own `Removed` took
    /// its last block: an engine whose cache drained stores again, and its ledger keeps its room
    /// (table, arena, run records) as a hash map keeps its capacity, instead of growing every
    /// array again from nothing. That room is bounded by the rank's own peak and goes with its
    /// clear or removal.
    pub(super) fn release_if_empty(&mut self, worker: Worker) {
        if let Some((rank_index, ledger)) = self.ledgers.get(&worker)
            && ledger.len() == 0
        {
            self.free_rank_indices.push(*rank_index);
            self.ledgers.remove(&worker);
        }
    }

    pub(super) fn clear_worker(&mut self, forest: &mut Forest, worker: Worker) -> u64 {
        let Some((rank_index, ledger)) = self.ledgers.get_mut(&worker) else {
            return 0;
        };
        let ended = ledger.clear(&mut Sink::new(forest, *rank_index));
        self.release_if_empty(worker);
        ended
    }
}

impl Books {
    /// Applies one rank's mutation, changing `forest` to match.
    pub(super) fn apply(&mut self, forest: &mut Forest, mutation: &Mutation) -> ApplyReport {
        let mut report = ApplyReport::default();
        let worker = mutation.worker();
        let held_before = match self.bound {
            Some(_) => self.ledgers.get(&worker).map_or(0, |(_, l)| l.len()),
            None => 0,
        };
        let clock = self.bound.as_ref().map(|b| b.clock);
        // Whether this mutation created the rank's ledger and left it empty (garbage: a removal
        // naming blocks of a rank that holds none, a store that added nothing): it is dropped
        // again. A ledger emptied by the rank's own removals stays (see `release_if_empty`).
        let mut created_empty = false;
        match mutation {
            Mutation::Stored {
                tier,
                parent,
                blocks,
                ..
            } => {
                let (rank_index, ledger, created) = self.rank_index_and_ledger(forest, worker);
                if let Some(clock) = clock {
                    ledger.track_recency(clock);
                    ledger.set_clock(clock);
                }
                ledger.store(
                    &mut Sink::new(forest, rank_index),
                    *tier,
                    *parent,
                    blocks,
                    &mut report,
                );
                created_empty = created && ledger.len() == 0;
            }
            Mutation::Removed { tier, blocks, .. } => {
                let (rank_index, ledger, created) = self.rank_index_and_ledger(forest, worker);
                ledger.remove(
                    &mut Sink::new(forest, rank_index),
                    *tier,
                    blocks,
                    &mut report,
                );
                created_empty = created && ledger.len() == 0;
            }
            Mutation::Cleared { .. } => report.cleared += self.clear_worker(forest, worker),
        }
        if self.bound.is_some() {
            self.enforce_bound(forest, worker, held_before, &mut report);
        }
        if created_empty {
            self.release_if_empty(worker);
        }
        report
    }

    /// Drops every rank of `worker_id`.
    pub(super) fn remove_worker(&mut self, forest: &mut Forest, worker_id: u64) -> ApplyReport {
        let mut ranks: Vec<Worker> = self
            .ledgers
            .keys()
            .filter(|w| w.worker_id == worker_id)
            .copied()
            .collect();
        ranks.sort_unstable();
        let mut report = ApplyReport::default();
        for worker in ranks {
            report.cleared += self.clear_worker(forest, worker);
        }
        if self.bound.is_some() {
            self.rebuild_heap();
        }
        report
    }

    /// Drops everything (the capacity bound stays).
    pub(super) fn clear(&mut self, forest: &mut Forest) {
        *self = Self::with_capacity(self.bound.as_ref().map(|b| b.capacity));
        forest.reset();
    }

    /// A consistent cut; `forest` is the copy in step with these books.
    pub(super) fn snapshot(&self, forest: &Forest) -> Snapshot {
        let mut workers: Vec<WorkerSnapshot> = self
            .ledgers
            .iter()
            .map(|(worker, (_, ledger))| WorkerSnapshot {
                worker: *worker,
                blocks: ledger.snapshot(|node: NodeRef| {
                    forest.edges[node.edge as usize].locals[node.offset as usize]
                }),
            })
            .filter(|w| !w.blocks.is_empty())
            .collect();
        workers.sort_unstable_by_key(|w| w.worker);
        Snapshot { workers }
    }

    /// Replaces the contents with a snapshot's; with a capacity bound, a snapshot holding more
    /// is evicted down to it at once, least recent first (its excess was evicted by the next
    /// mutation, whatever it was, and charged to its report; meanwhile the index held more
    /// than its bound). These evictions are not reported: they are the restore's.
    pub(super) fn restore(&mut self, forest: &mut Forest, snapshot: &Snapshot) {
        self.clear(forest);
        let bounded = self.bound.is_some();
        // The writes after the restore continue from the newest restored stamp: the bound's
        // clock stayed at 0 before, so the first blocks stored after a restore were stamped as
        // old as the oldest restored ones and evicted first.
        let mut clock = 0;
        for w in &snapshot.workers {
            let (rank_index, ledger, _) = self.rank_index_and_ledger(forest, w.worker);
            if bounded {
                // Restored blocks count as stored now, in the order restored (a rank's parents
                // before their children, `RunLedger::restore`), each rank's from 0
                // (so a bound evicts the ranks' restored blocks in turn, not one rank's first).
                ledger.track_recency(0);
            }
            let mut sink = Sink::new(forest, rank_index);
            ledger.restore(&mut sink, &w.blocks);
            drop(sink);
            clock = clock.max(ledger.clock());
            self.release_if_empty(w.worker);
        }
        if let Some(bound) = &mut self.bound {
            bound.clock = clock;
        }
        if bounded {
            self.rebuild_heap();
            self.evict_over_bound(forest, &mut ApplyReport::default());
            let _ = self.take_evictions();
        }
    }

    /// Occupancy, and the heap of these books plus `forest_bytes`.
    pub(super) fn stats(&self, forest_bytes: u64) -> IndexStats {
        let mut workers: Vec<WorkerBlocks> = self
            .ledgers
            .iter()
            .filter(|(_, (_, ledger))| ledger.len() > 0)
            .map(|(worker, (_, ledger))| WorkerBlocks {
                worker: *worker,
                per_tier: ledger.per_tier(),
            })
            .collect();
        workers.sort_unstable_by_key(|w| w.worker);
        IndexStats {
            memberships: workers.iter().flat_map(|w| w.per_tier).sum(),
            heap_bytes: forest_bytes
                + self
                    .ledgers
                    .values()
                    .map(|(_, l)| l.heap_bytes())
                    .sum::<u64>(),
            workers,
        }
    }
}
