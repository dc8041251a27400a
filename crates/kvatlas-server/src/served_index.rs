//! [`ServedIndex`]: a [`ConcurrentAtlas`] that also keeps what a service reports about it — how
//! many events it applied, when it last applied one (the freshness every answer carries) and the
//! running totals of what it absorbed.
//!
//! It sits behind the index's [`kvatlas_index::ThreadPool`], so its writes run on the writer
//! threads; the figures are atomics and one small mutex taken once per applied batch.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{
    ApplyReport, ConcurrentAtlas, IndexStats, MatchOptions, Matches, Mutation, SharedKvIndex,
    Snapshot,
};
use parking_lot::Mutex;

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
        }
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
