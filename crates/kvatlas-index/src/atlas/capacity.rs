//! The optional capacity bound: at most N held (rank, block) pairs, least recently stored leaf
//! evicted first (see [`super::Atlas::with_capacity`]).
use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::model::{ApplyReport, ExternalBlockHash, TierSet, Worker};

use super::books::Books;
use super::forest::Forest;
use super::sink::Sink;

/// Capacity bound: at most `capacity` held (rank, block) pairs; beyond it, the least recently
/// stored *leaf* across all ranks is evicted (see [`Atlas::with_capacity`](super::Atlas::with_capacity)).
#[derive(Debug, Clone, Default)]
pub(super) struct Bound {
    pub(super) capacity: u64,
    /// Held (rank, block) pairs.
    pub(super) held: u64,
    /// The recency clock shared by every ledger.
    pub(super) clock: u64,
    /// Candidate leaves, least recent first; validated when popped (lazy deletion).
    pub(super) heap: BinaryHeap<Reverse<(u64, Worker, u32, ExternalBlockHash)>>,
    /// Every block, least recent first: used only when no leaf is left (parent links in a
    /// cycle); built on demand, validated when popped.
    pub(super) fallback: BinaryHeap<Reverse<(u64, Worker, u32, ExternalBlockHash)>>,
    /// Evictions not yet taken by [`Atlas::take_evictions`](super::Atlas::take_evictions):
    /// the newest [`Bound::evictions_kept`] at most (older ones are dropped; every eviction
    /// is counted in its [`ApplyReport`]). A caller that never takes them (the server counts
    /// them from the reports) made the list grow for ever, and each write scanned all of it.
    pub(super) evicted: Vec<Eviction>,
    /// Reused buffer.
    pub(super) candidates: Vec<(u64, u32, ExternalBlockHash)>,
}

impl Bound {
    /// How many untaken evictions are kept: the capacity, within 1,024 and 2^20.
    fn evictions_kept(&self) -> usize {
        usize::try_from(self.capacity.clamp(1 << 10, 1 << 20)).unwrap_or(1 << 20)
    }
}

/// A block the index evicted to stay within its capacity: it answers from then on as if the
/// engine had removed the block from every tier it held it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    /// The owner.
    pub worker: Worker,
    /// The block's engine hash.
    pub external: ExternalBlockHash,
    /// The tiers it was held on.
    pub tiers: TierSet,
}

impl Books {
    /// Empty books, with the capacity bound `capacity` if any.
    pub(super) fn with_capacity(capacity: Option<u64>) -> Self {
        Self {
            bound: capacity.map(|capacity| Bound {
                capacity,
                ..Bound::default()
            }),
            ..Self::default()
        }
    }

    /// The evictions since the previous call (empty without a capacity bound).
    pub(super) fn take_evictions(&mut self) -> Vec<Eviction> {
        self.bound
            .as_mut()
            .map(|b| std::mem::take(&mut b.evicted))
            .unwrap_or_default()
    }

    /// Applies the capacity bound after a mutation of `worker` changed its held count.
    pub(super) fn enforce_bound(
        &mut self,
        forest: &mut Forest,
        worker: Worker,
        held_before: usize,
        report: &mut ApplyReport,
    ) {
        let Some(bound) = &mut self.bound else { return };
        let held_after = self.ledgers.get(&worker).map_or(0, |(_, l)| l.len());
        bound.held = (bound.held + held_after as u64).saturating_sub(held_before as u64);
        if let Some((_, ledger)) = self.ledgers.get_mut(&worker) {
            bound.clock = bound.clock.max(ledger.clock());
            ledger.take_candidates(&mut bound.candidates);
            for (stamp, slot, external) in bound.candidates.drain(..) {
                bound.heap.push(Reverse((stamp, worker, slot, external)));
            }
        }
        self.evict_over_bound(forest, report);
    }

    /// Evicts, least recent first, until the held pairs are within the bound (the candidates
    /// and the held count up to date); the ranks emptied give their index back.
    pub(super) fn evict_over_bound(&mut self, forest: &mut Forest, report: &mut ApplyReport) {
        let Some(bound) = &mut self.bound else { return };
        // This call's evictions start here (the ranks they emptied are released below).
        let first_new = bound.evicted.len();
        let mut fallback_built = false;
        while bound.held > bound.capacity {
            let (Reverse((stamp, victim, slot, external)), leaf) = match bound.heap.pop() {
                Some(entry) => (entry, true),
                None => match bound.fallback.pop() {
                    Some(entry) => (entry, false),
                    None if fallback_built => break,
                    None => {
                        // No leaf left (parent links in a cycle): any block, least recent
                        // first, so the bound holds whatever the input.
                        fallback_built = true;
                        for (worker, (_, ledger)) in &self.ledgers {
                            ledger.all_blocks(&mut bound.candidates);
                            for (stamp, slot, external) in bound.candidates.drain(..) {
                                bound
                                    .fallback
                                    .push(Reverse((stamp, *worker, slot, external)));
                            }
                        }
                        continue;
                    }
                },
            };
            let Some((victim_index, ledger)) = self.ledgers.get_mut(&victim) else {
                continue;
            };
            if !ledger.is_current(slot, external, stamp, leaf) {
                continue;
            }
            let before = ledger.len();
            let tiers = ledger.evict(&mut Sink::new(forest, *victim_index), slot);
            bound.held -= (before - ledger.len()) as u64;
            report.evicted += u64::from(tiers.bits().count_ones());
            bound.evicted.push(Eviction {
                worker: victim,
                external,
                tiers,
            });
            ledger.take_candidates(&mut bound.candidates);
            for (stamp, slot, external) in bound.candidates.drain(..) {
                bound.heap.push(Reverse((stamp, victim, slot, external)));
            }
        }
        // Stale entries accumulate lazily; rebuild when they dominate.
        if (bound.heap.len() + bound.fallback.len()) as u64 > 4 * bound.held + 1024 {
            self.rebuild_heap();
        }
        // Ranks whose last block this call evicted give their index back.
        let emptied: Vec<Worker> = match &mut self.bound {
            Some(bound) => {
                let emptied = bound.evicted[first_new..]
                    .iter()
                    .map(|e| e.worker)
                    .collect();
                // At most twice the kept number between trims: amortised, a constant per
                // eviction.
                let kept = bound.evictions_kept();
                if bound.evicted.len() > 2 * kept {
                    let dropped = bound.evicted.len() - kept;
                    bound.evicted.drain(..dropped);
                }
                emptied
            }
            None => Vec::new(),
        };
        for worker in emptied {
            self.release_if_empty(worker);
        }
    }

    /// Rebuilds the candidate heap from the current leaves and recounts the held pairs.
    pub(super) fn rebuild_heap(&mut self) {
        let Some(bound) = &mut self.bound else { return };
        bound.heap.clear();
        bound.fallback.clear();
        bound.held = 0;
        for (worker, (_, ledger)) in &self.ledgers {
            bound.held += ledger.len() as u64;
            ledger.all_leaves(&mut bound.candidates);
            for (stamp, slot, external) in bound.candidates.drain(..) {
                bound.heap.push(Reverse((stamp, *worker, slot, external)));
            }
        }
    }
}
