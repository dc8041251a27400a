//! The traits every index backend implements.

use kvatlas_hash::LocalBlockHash;

use crate::model::{ApplyReport, Checkpoint, IndexStats, MatchOptions, Matches, Mutation};
use crate::snapshot::Snapshot;

/// An index owned by one thread at a time (`&mut self` writes, `&self` reads).
///
/// Contract (the same for every backend, enforced by the differential tests against
/// [`crate::ReferenceIndex`]): after any sequence of mutations, `find_matches` returns for each
/// worker rank the exact scores defined in `docs/index.md`, and `apply` reports every anomaly.
pub trait KvIndex: Send {
    /// Applies one worker rank's mutation (mutations of one rank must arrive in its order).
    fn apply(&mut self, mutation: &Mutation) -> ApplyReport;

    /// Drops every block of every rank of `worker_id`.
    fn remove_worker(&mut self, worker_id: u64) -> ApplyReport;

    /// Drops everything.
    fn clear(&mut self);

    /// For each worker rank, how many leading blocks of `query` (local hashes) it holds.
    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches;

    /// A consistent cut of the whole index.
    fn snapshot(&self) -> Snapshot;

    /// Replaces the contents with a snapshot's.
    fn restore(&mut self, snapshot: &Snapshot);

    /// Occupancy and memory figures.
    fn stats(&self) -> IndexStats;
}

/// An index that many threads use at once: reads run concurrently with writes.
///
/// Writers must not apply two mutations of the same worker rank concurrently (a sticky front that
/// routes each rank to one writer thread guarantees it); doing so is memory-safe but may interleave them.
/// Read guarantee: a `find_matches` never credits a worker rank with a prefix that rank did not
/// hold at some moment during the call.
pub trait SharedKvIndex: Send + Sync {
    /// Applies one worker rank's mutation.
    fn apply(&self, mutation: &Mutation) -> ApplyReport;

    /// Applies a mutation the caller gives up (a front that keeps mutations, such as
    /// [`crate::baseline::LeftRight`]'s log, then needs no copy). Same contract as [`SharedKvIndex::apply`].
    fn apply_owned(&self, mutation: Mutation) -> ApplyReport {
        self.apply(&mutation)
    }

    /// Applies the mutations of `batch` in order (leaving it empty); returns their merged
    /// reports. A front may publish them together: readers then see the state before or after
    /// the whole batch, which keeps the read guarantee (every published state was held). The
    /// default applies them one by one.
    fn apply_batch(&self, batch: &mut Vec<Mutation>) -> ApplyReport {
        let mut report = ApplyReport::default();
        for mutation in batch.drain(..) {
            report.merge(&self.apply_owned(mutation));
        }
        report
    }

    /// Applies the mutations of `batch` in order, then records `checkpoints`, as one step with
    /// respect to snapshots (leaving both empty). An index that records checkpoints (a service
    /// pairing its snapshots with its sources' positions) overrides it; the default applies the
    /// batch and forgets the checkpoints.
    fn apply_checkpointed(
        &self,
        batch: &mut Vec<Mutation>,
        checkpoints: &mut Vec<Checkpoint>,
    ) -> ApplyReport {
        checkpoints.clear();
        self.apply_batch(batch)
    }

    /// Drops every block of every rank of `worker_id`.
    fn remove_worker(&self, worker_id: u64) -> ApplyReport;

    /// Drops everything.
    fn clear(&self);

    /// For each worker rank, how many leading blocks of `query` it holds.
    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches;

    /// A consistent cut of the whole index.
    fn snapshot(&self) -> Snapshot;

    /// Replaces the contents with a snapshot's.
    fn restore(&self, snapshot: &Snapshot);

    /// Occupancy and memory figures.
    fn stats(&self) -> IndexStats;
}

/// A [`SharedKvIndex`] used through the single-owner [`KvIndex`] interface (for code that drives
/// every backend the same way, such as the differential tests and the bench harness).
#[derive(Debug, Default)]
pub struct Exclusive<T>(pub T);

impl<T: SharedKvIndex> KvIndex for Exclusive<T> {
    fn apply(&mut self, mutation: &Mutation) -> ApplyReport {
        self.0.apply(mutation)
    }

    fn remove_worker(&mut self, worker_id: u64) -> ApplyReport {
        self.0.remove_worker(worker_id)
    }

    fn clear(&mut self) {
        self.0.clear()
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.0.find_matches(query, options)
    }

    fn snapshot(&self) -> Snapshot {
        self.0.snapshot()
    }

    fn restore(&mut self, snapshot: &Snapshot) {
        self.0.restore(snapshot)
    }

    fn stats(&self) -> IndexStats {
        self.0.stats()
    }
}
