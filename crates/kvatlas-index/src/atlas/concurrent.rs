//! `ConcurrentAtlas`: the Atlas for concurrent readers and writers.
//!
//! An Atlas has two parts: the [`Forest`] that queries read (edges, covers, branches) and the
//! [`Books`] that only writes read (every rank's ledger: engine hashes, parent links, tiers).
//! The ledger is most of a write's work — hash-table probes, conflict and duplicate checks, level
//! propagation — and its result is a short list of forest changes ([`ForestOp`]).
//!
//! So this front keeps the books **once**, on the writer's side, and the forest **twice**, in the
//! left-right arrangement of [`crate::baseline::LeftRight`] (the same synchronization code,
//! [`TwoCopies`]): a write runs the ledger against the back forest, which records its changes;
//! the back forest is published; the other copy replays the recorded changes on its next turn.
//! Compared with `LeftRight<Atlas>`, a mutation pays the ledger once instead of twice and the
//! ledgers are held once in memory.
//!
//! Invariants:
//! - both forests start empty and receive the same changes in the same order; every change is
//!   deterministic (edge ids come from the same free list), so a caught-up copy equals the
//!   other (checked by the unit tests after every mutation, and by the differential tests, which
//!   read the two copies alternately);
//! - the books are in step with the copy being written: every write first brings that copy up to
//!   date, and only then runs the ledger, which reads local hashes from it;
//! - readers see a forest between two whole mutations, never going back in time (`TwoCopies`'
//!   guarantees, model-checked in `tests/loom.rs`).

use kvatlas_hash::LocalBlockHash;

use super::{Books, Eviction, Forest, ForestOp};
use crate::backend::SharedKvIndex;
use crate::left_right::{Absorb, TwoCopies};
use crate::model::{ApplyReport, IndexStats, MatchOptions, Matches, Mutation};
use crate::snapshot::Snapshot;

impl Absorb<ForestOp> for Forest {
    fn absorb(&mut self, op: &ForestOp) {
        self.replay(op);
    }
}

/// kvatlas's default backend for concurrent use: one writer at a time, and readers that do not
/// wait for a busy writer — at most for one write, when the writer has to change the copy they
/// read in place (see [`crate::baseline::LeftRight`] for the protocol). The answers are exactly
/// [`super::Atlas`]'s.
///
/// Writes and reads both take `&self` ([`SharedKvIndex`]), so the index can be shared between
/// threads as it is; a [`crate::ThreadPool`] in front of it applies each rank's mutations in order
/// on writer threads while callers query inline.
///
/// ```
/// use kvatlas_hash::BlockHasher;
/// use kvatlas_index::{
///     ConcurrentAtlas, ExternalBlockHash, MatchOptions, Mutation, SharedKvIndex, StoredBlock,
///     Tier, Worker,
/// };
///
/// let tokens: Vec<u32> = (0..12).collect();
/// let locals: Vec<_> = BlockHasher::new(4)?.local_hashes(&tokens).collect();
/// let worker = Worker::new(1, 0);
/// let blocks = locals
///     .iter()
///     .zip(100..)
///     .map(|(&local, hash)| StoredBlock { external: ExternalBlockHash::new(hash), local })
///     .collect();
/// let stored = Mutation::Stored { worker, tier: Tier::Host, parent: None, blocks };
///
/// let index = ConcurrentAtlas::new();
/// std::thread::scope(|s| {
///     // A writer thread applies the engine's event while this thread may query.
///     s.spawn(|| index.apply(&stored));
///     let _maybe_not_yet = index.find_matches(&locals, &MatchOptions::default());
/// });
///
/// // Host-tier blocks count only in a tiered query: all 3 blocks on the host, none on the GPU.
/// let tiered = MatchOptions::default().with_tiered(true);
/// let matches = index.find_matches(&locals, &tiered);
/// let m = matches.get(worker).expect("worker 1 matches");
/// assert_eq!((m.device, m.host, m.disk), (0, 3, 3));
/// assert!(index.find_matches(&locals, &MatchOptions::default()).workers.is_empty());
/// # Ok::<(), kvatlas_hash::HashError>(())
/// ```
#[derive(Debug)]
pub struct ConcurrentAtlas {
    copies: TwoCopies<Forest, Books, ForestOp>,
}

impl Default for ConcurrentAtlas {
    fn default() -> Self {
        Self::new()
    }
}

impl ConcurrentAtlas {
    /// An empty index.
    pub fn new() -> Self {
        Self::from_books(Books::default())
    }

    /// An empty index holding at most `capacity` (rank, block) pairs, with the eviction policy
    /// of [`super::Atlas::with_capacity`].
    pub fn with_capacity(capacity: u64) -> Self {
        Self::from_books(Books::with_capacity(Some(capacity)))
    }

    fn from_books(books: Books) -> Self {
        Self {
            copies: TwoCopies::new(Forest::default(), Forest::default(), books),
        }
    }

    /// The evictions since the previous call (empty without a capacity bound).
    pub fn take_evictions(&self) -> Vec<Eviction> {
        self.write(|books, _| books.take_evictions())
    }

    /// Runs `write` on the books and a caught-up forest whose changes are recorded for the
    /// other copy.
    fn write<R>(&self, write: impl FnOnce(&mut Books, &mut Forest) -> R) -> R {
        self.copies.write(|books, forest, ops| {
            forest.journal = Some(std::mem::take(ops));
            let result = write(books, forest);
            *ops = forest.journal.take().unwrap_or_default();
            result
        })
    }

    /// Whether both forests, once caught up, hold the same state (for the tests).
    #[cfg(test)]
    fn copies_agree(&self) -> bool {
        // Two writes that change nothing bring each copy up to date in turn.
        self.write(|_, _| ());
        self.write(|_, _| ());
        self.copies.both(|left, right| left.same_state(right))
    }
}

impl SharedKvIndex for ConcurrentAtlas {
    fn apply(&self, mutation: &Mutation) -> ApplyReport {
        self.write(|books, forest| books.apply(forest, mutation))
    }

    /// One write for the whole batch: one swap, one replay on the other copy.
    fn apply_batch(&self, batch: &mut Vec<Mutation>) -> ApplyReport {
        self.write(|books, forest| {
            let mut report = ApplyReport::default();
            for mutation in batch.drain(..) {
                report.merge(&books.apply(forest, &mutation));
            }
            report
        })
    }

    fn remove_worker(&self, worker_id: u64) -> ApplyReport {
        self.write(|books, forest| books.remove_worker(forest, worker_id))
    }

    fn clear(&self) {
        self.write(|books, forest| books.clear(forest));
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.copies
            .read(|forest| forest.find_matches(query, options))
    }

    fn snapshot(&self) -> Snapshot {
        self.write(|books, forest| books.snapshot(forest))
    }

    fn restore(&self, snapshot: &Snapshot) {
        self.write(|books, forest| books.restore(forest, snapshot));
    }

    fn stats(&self) -> IndexStats {
        // The forest is held twice, the books once.
        self.write(|books, forest| books.stats(2 * forest.heap_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Atlas;
    use crate::backend::KvIndex;
    use crate::model::{ExternalBlockHash, StoredBlock, Tier, Worker};
    use proptest::prelude::*;

    fn mutation(worker: u64, kind: u8, start: u64, len: u64, fork: u64) -> Mutation {
        let worker = Worker::new(worker, 0);
        let external = |i: u64| ExternalBlockHash::new(worker.worker_id * 1000 + i);
        match kind {
            0 | 1 => Mutation::Stored {
                worker,
                tier: if kind == 0 { Tier::Device } else { Tier::Host },
                parent: start.checked_sub(1).map(external),
                blocks: (start..start + len)
                    .map(|i| StoredBlock {
                        external: external(i),
                        // Ranks share the first blocks, then fork.
                        local: LocalBlockHash::new(if i < fork {
                            i
                        } else {
                            100 * worker.worker_id + i
                        }),
                    })
                    .collect(),
            },
            2 => Mutation::Removed {
                worker,
                tier: Tier::Device,
                blocks: (start..start + len).map(external).collect(),
            },
            _ => Mutation::Cleared { worker },
        }
    }

    proptest! {
        /// After every mutation, both forests agree and the answers equal a plain Atlas's.
        #[test]
        fn copies_stay_identical_and_answer_like_atlas(
            steps in proptest::collection::vec((0u64..3, 0u8..4, 0u64..8, 1u64..6, 0u64..6), 1..40)
        ) {
            let concurrent = ConcurrentAtlas::new();
            let mut plain = Atlas::new();
            let query: Vec<LocalBlockHash> = (0..14).map(LocalBlockHash::new).collect();
            for (worker, kind, start, len, fork) in steps {
                let m = mutation(worker, kind, start, len, fork);
                prop_assert_eq!(concurrent.apply(&m), plain.apply(&m));
                prop_assert!(concurrent.copies_agree());
                let options = MatchOptions { tiered: true, ..MatchOptions::default() };
                prop_assert_eq!(
                    SharedKvIndex::find_matches(&concurrent, &query, &options),
                    plain.find_matches(&query, &options)
                );
            }
            prop_assert_eq!(SharedKvIndex::snapshot(&concurrent), plain.snapshot());
            SharedKvIndex::clear(&concurrent);
            prop_assert!(concurrent.copies_agree());
        }
    }
}
