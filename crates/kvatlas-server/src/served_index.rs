//! [`ServedIndex`]: a [`ConcurrentAtlas`] that also keeps what a service reports about it — how
//! many events it applied, when it last applied one (the freshness every answer carries) and the
//! running totals of what it absorbed — and the checkpoint of every source feeding it.
//!
//! It sits behind the index's [`kvatlas_index::ThreadPool`], so its writes run on the writer
//! threads; the figures are atomics and one small mutex taken once per applied batch.
//!
//! Invariant: checkpointed writes ([`SharedKvIndex::apply_checkpointed`]) and
//! [`ServedIndex::image`] hold the same lock, so a snapshot holds exactly the units whose
//! checkpoints it records — every source's position names the last batch the state reflects,
//! and no part of a later one.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{
    ApplyReport, Checkpoint, ConcurrentAtlas, IndexStats, MatchOptions, Matches, Mutation,
    SharedKvIndex, Snapshot, Worker,
};
use parking_lot::Mutex;

use crate::snapshot::SourceMark;

/// Fingerprints kept per source (the listeners' duplicate window).
pub(crate) const RECENT_KEPT: usize = 1024;

/// A checkpoint taken out of the index by [`ServedIndex::take_mark`].
#[derive(Debug)]
pub(crate) struct TakenMark {
    mark: Mark,
    /// [`ServedIndex`]'s restores when it was taken.
    restores: u64,
}

/// A source's checkpoint as kept between snapshots.
#[derive(Debug, Clone, Default)]
struct Mark {
    position: u64,
    recent: VecDeque<(u64, u64)>,
}

impl Mark {
    fn record(&mut self, position: u64, fingerprint: u64) {
        self.position = position;
        if self.recent.len() >= RECENT_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back((position, fingerprint));
    }

    fn to_source_mark(&self) -> SourceMark {
        SourceMark {
            position: self.position,
            recent: self.recent.iter().copied().collect(),
        }
    }
}

/// Microseconds since the Unix epoch, now (0 if the clock is before it).
pub(crate) fn unix_micros_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// A [`ConcurrentAtlas`] with the service's figures (see the module docs).
#[derive(Debug)]
pub(crate) struct ServedIndex {
    atlas: ConcurrentAtlas,
    capacity: Option<u64>,
    /// Mutations applied since creation.
    applied: AtomicU64,
    /// When the last mutation was applied (Unix microseconds; 0 = never).
    last_applied: AtomicI64,
    /// Running totals of the apply reports (anomalies, evictions).
    totals: Mutex<ApplyReport>,
    /// Every source's checkpoint; its lock also orders checkpointed writes against snapshots.
    marks: Mutex<BTreeMap<Worker, Mark>>,
    /// Restores of a snapshot so far (changed with `marks` locked): a checkpoint taken out
    /// before a restore is not put back after it.
    restores: AtomicU64,
}

impl ServedIndex {
    /// An empty index, bounded to `capacity` memberships if given.
    pub(crate) fn new(capacity: Option<u64>) -> Self {
        Self {
            atlas: capacity.map_or_else(ConcurrentAtlas::new, ConcurrentAtlas::with_capacity),
            capacity,
            applied: AtomicU64::new(0),
            last_applied: AtomicI64::new(0),
            totals: Mutex::new(ApplyReport::default()),
            marks: Mutex::new(BTreeMap::new()),
            restores: AtomicU64::new(0),
        }
    }

    /// A consistent cut and the checkpoint of every source it reflects.
    pub(crate) fn image(&self) -> (Snapshot, BTreeMap<Worker, SourceMark>) {
        let marks = self.marks.lock();
        let snapshot = self.atlas.snapshot();
        let marks = marks
            .iter()
            .map(|(worker, mark)| (*worker, mark.to_source_mark()))
            .collect();
        (snapshot, marks)
    }

    /// Replaces the state and the checkpoints with a snapshot's.
    pub(crate) fn restore_image(&self, snapshot: &Snapshot, marks: &BTreeMap<Worker, SourceMark>) {
        let mut kept = self.marks.lock();
        self.restores.fetch_add(1, Ordering::Relaxed);
        self.atlas.restore(snapshot);
        *kept = marks
            .iter()
            .map(|(worker, mark)| {
                (
                    *worker,
                    Mark {
                        position: mark.position,
                        // The newest of them, as `Mark::record` keeps (a snapshot's reader keeps
                        // no more; a hand-made image could hold more).
                        recent: mark.recent[mark.recent.len().saturating_sub(RECENT_KEPT)..]
                            .iter()
                            .copied()
                            .collect(),
                    },
                )
            })
            .collect();
        self.last_applied
            .store(unix_micros_now(), Ordering::Release);
    }

    /// The checkpoint of `source`, if one was recorded.
    pub(crate) fn mark(&self, source: Worker) -> Option<SourceMark> {
        self.marks.lock().get(&source).map(Mark::to_source_mark)
    }

    /// Removes the checkpoint of `source` and hands it over, to be put back with
    /// [`ServedIndex::put_back_mark`] if what it was removed for does not happen.
    pub(crate) fn take_mark(&self, source: Worker) -> Option<TakenMark> {
        let mut marks = self.marks.lock();
        let restores = self.restores.load(Ordering::Relaxed);
        marks
            .remove(&source)
            .map(|mark| TakenMark { mark, restores })
    }

    /// Puts back a checkpoint [`ServedIndex::take_mark`] removed, unless a snapshot was
    /// restored since (the state it numbered is gone) or the source has a checkpoint again
    /// (newer). The caller keeps the source's feeds from starting meanwhile.
    pub(crate) fn put_back_mark(&self, source: Worker, taken: TakenMark) {
        let mut marks = self.marks.lock();
        if self.restores.load(Ordering::Relaxed) == taken.restores {
            marks.entry(source).or_insert(taken.mark);
        }
    }

    /// The ranks holding a checkpoint.
    pub(crate) fn marked_workers(&self) -> Vec<Worker> {
        self.marks.lock().keys().copied().collect()
    }

    /// Forgets the checkpoints of every rank of `worker_id` (or one rank): the source is gone,
    /// and a later one with the same id starts fresh.
    pub(crate) fn forget_marks(&self, worker_id: u64, dp_rank: Option<u32>) {
        self.marks
            .lock()
            .retain(|w, _| w.worker_id != worker_id || dp_rank.is_some_and(|r| r != w.dp_rank));
    }

    /// Removes every rank of `worker_id` and forgets their checkpoints in one step (under the
    /// checkpoints' lock, as a snapshot's cut is taken): no snapshot holds the checkpoints of an
    /// instance whose blocks are gone, and none holds its blocks without them. (Unregistering
    /// an instance removed the blocks, then forgot the checkpoints: a cut in between recorded
    /// positions for a source that was gone.) Its units must be flushed before.
    pub(crate) fn remove_worker_forgetting_marks(&self, worker_id: u64) -> ApplyReport {
        let mut marks = self.marks.lock();
        let report = self.atlas.remove_worker(worker_id);
        marks.retain(|w, _| w.worker_id != worker_id);
        drop(marks);
        self.record(0, &report)
    }

    /// Clears one rank and forgets its checkpoint in one step (under the checkpoints' lock, as
    /// a snapshot's cut is taken), for the same reason as
    /// [`ServedIndex::remove_worker_forgetting_marks`]: cleared through its lane and forgotten
    /// after, a cut in between recorded a checkpoint for a rank with no blocks and no feed, and
    /// a re-registration of the rank after a restore resumed from it. Its units must be flushed
    /// before.
    pub(crate) fn clear_rank_forgetting_mark(&self, worker: Worker) -> ApplyReport {
        let mut marks = self.marks.lock();
        let report = self.atlas.apply(&Mutation::Cleared { worker });
        marks.remove(&worker);
        drop(marks);
        self.record(1, &report)
    }

    /// The capacity bound, if any.
    pub(crate) fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Mutations applied since creation.
    pub(crate) fn events_applied(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// When the last mutation was applied (Unix microseconds; 0 = never).
    pub(crate) fn last_event_unix_micros(&self) -> i64 {
        self.last_applied.load(Ordering::Acquire)
    }

    /// The running totals of everything applied.
    pub(crate) fn totals(&self) -> ApplyReport {
        *self.totals.lock()
    }

    fn record(&self, mutations: u64, report: &ApplyReport) -> ApplyReport {
        self.totals.lock().merge(report);
        self.last_applied
            .store(unix_micros_now(), Ordering::Release);
        self.applied.fetch_add(mutations, Ordering::AcqRel);
        *report
    }
}

impl SharedKvIndex for ServedIndex {
    fn apply(&self, mutation: &Mutation) -> ApplyReport {
        let report = self.atlas.apply(mutation);
        self.record(1, &report)
    }

    fn apply_batch(&self, batch: &mut Vec<Mutation>) -> ApplyReport {
        let mutations = batch.len() as u64;
        let report = self.atlas.apply_batch(batch);
        self.record(mutations, &report)
    }

    fn apply_checkpointed(
        &self,
        batch: &mut Vec<Mutation>,
        checkpoints: &mut Vec<Checkpoint>,
    ) -> ApplyReport {
        let mutations = batch.len() as u64;
        let report = {
            let mut marks = self.marks.lock();
            let report = self.atlas.apply_batch(batch);
            for checkpoint in checkpoints.drain(..) {
                marks
                    .entry(checkpoint.source)
                    .or_default()
                    .record(checkpoint.position, checkpoint.fingerprint);
            }
            report
        };
        self.record(mutations, &report)
    }

    fn remove_worker(&self, worker_id: u64) -> ApplyReport {
        let report = self.atlas.remove_worker(worker_id);
        self.record(0, &report)
    }

    fn clear(&self) {
        self.atlas.clear();
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.atlas.find_matches(query, options)
    }

    fn snapshot(&self) -> Snapshot {
        self.atlas.snapshot()
    }

    fn restore(&self, snapshot: &Snapshot) {
        self.atlas.restore(snapshot);
    }

    fn stats(&self) -> IndexStats {
        self.atlas.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::SourceMark;

    /// A checkpoint taken out is put back — unless a restore replaced the checkpoints since
    /// (it numbered a state that is gone), or the source has a newer one.
    #[test]
    fn a_taken_checkpoint_is_put_back_unless_restored_or_renewed_since() {
        let index = ServedIndex::new(None);
        let worker = Worker::new(7, 0);
        let marks = |position| {
            BTreeMap::from([(
                worker,
                SourceMark {
                    position,
                    recent: Vec::new(),
                },
            )])
        };
        let empty = Snapshot::default();
        index.restore_image(&empty, &marks(5));
        let position = |index: &ServedIndex| index.mark(worker).map(|m| m.position);

        let taken = index.take_mark(worker).expect("a checkpoint");
        assert_eq!(position(&index), None);
        index.put_back_mark(worker, taken);
        assert_eq!(position(&index), Some(5), "put back");

        let taken = index.take_mark(worker).expect("a checkpoint");
        index.restore_image(&empty, &BTreeMap::new());
        index.put_back_mark(worker, taken);
        assert_eq!(position(&index), None, "a restore came between");

        index.restore_image(&empty, &marks(9));
        let taken = index.take_mark(worker).expect("a checkpoint");
        index.marks.lock().insert(
            worker,
            Mark {
                position: 11,
                recent: VecDeque::new(),
            },
        );
        index.put_back_mark(worker, taken);
        assert_eq!(position(&index), Some(11), "the newer one stays");
    }
}
