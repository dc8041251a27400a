//! `Locked<T>`: any single-threaded backend behind a reader-writer lock, usable from many threads.
//!
//! Reads share the lock and run in parallel; each mutation takes it exclusively, so every read
//! sees the index between two whole mutations — the read guarantee of [`SharedKvIndex`] holds
//! trivially. This is the simplest concurrent front and the baseline the finer-grained designs are
//! measured against; `parking_lot`'s lock is writer-fair, so a stream of reads cannot starve the
//! event writer.

use kvatlas_hash::LocalBlockHash;
use parking_lot::RwLock;

use crate::backend::{KvIndex, SharedKvIndex};
use crate::model::{ApplyReport, IndexStats, MatchOptions, Matches, Mutation};
use crate::snapshot::Snapshot;

/// A [`KvIndex`] shared behind a reader-writer lock.
#[derive(Debug, Default)]
pub struct Locked<T> {
    inner: RwLock<T>,
}

impl<T: KvIndex + Sync> Locked<T> {
    /// Wraps a backend.
    pub fn new(index: T) -> Self {
        Self {
            inner: RwLock::new(index),
        }
    }

    /// Unwraps the backend.
    pub fn into_inner(self) -> T {
        self.inner.into_inner()
    }
}

impl<T: KvIndex + Sync> SharedKvIndex for Locked<T> {
    fn apply(&self, mutation: &Mutation) -> ApplyReport {
        self.inner.write().apply(mutation)
    }

    fn remove_worker(&self, worker_id: u64) -> ApplyReport {
        self.inner.write().remove_worker(worker_id)
    }

    fn clear(&self) {
        self.inner.write().clear();
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.inner.read().find_matches(query, options)
    }

    fn snapshot(&self) -> Snapshot {
        self.inner.read().snapshot()
    }

    fn restore(&self, snapshot: &Snapshot) {
        self.inner.write().restore(snapshot);
    }

    fn stats(&self) -> IndexStats {
        self.inner.read().stats()
    }
}
