//! `LeftRight<T>`: two copies of a single-threaded backend, so that reads never wait for writes.
//!
//! Readers always read the *front* copy. The writer applies a mutation to the *back* copy, makes
//! it the front (one atomic store), then applies the same mutation to the old front once the
//! readers still on it have left. A reader therefore sees a published state between two whole
//! mutations, and successive reads never go back in time (checked under every interleaving by the
//! loom model in `tests/loom.rs`); it waits only in the rare case where it picked the old front just
//! before a swap and the writer already queued for it.
//!
//! Measured weakness (`cargo xtask bench --preset concurrent --front left-right`): with more busy
//! threads than cores, a reader preempted inside its read keeps the writer waiting for a whole
//! time slice, so a saturated writer collapses (readers stay fast). A writer that never waits for
//! readers (an operation log replayed on the next swap) is the planned fix.
//!
//! Costs: every mutation is applied twice and the index is held twice in memory. Writes are
//! serialized through one lock (mutations of different ranks commute, but both copies must receive
//! the same ones). [`crate::Locked`] is the single-copy alternative that lets a busy writer delay
//! readers.

use std::sync::atomic::Ordering;

use kvatlas_hash::LocalBlockHash;

use crate::sync::{AtomicUsize, Mutex, RwLock};

use crate::backend::{KvIndex, SharedKvIndex};
use crate::model::{ApplyReport, IndexStats, MatchOptions, Matches, Mutation};
use crate::snapshot::Snapshot;

/// Two copies of a backend; see the module docs.
#[derive(Debug)]
pub struct LeftRight<T> {
    copies: [RwLock<T>; 2],
    /// Index of the copy readers use.
    front: AtomicUsize,
    /// Serializes writers.
    writer: Mutex<()>,
}

impl<T: KvIndex + Sync + Default> Default for LeftRight<T> {
    fn default() -> Self {
        Self::new(T::default(), T::default())
    }
}

impl<T: KvIndex + Sync> LeftRight<T> {
    /// Builds from two empty (or identical) copies of a backend.
    pub fn new(left: T, right: T) -> Self {
        Self {
            copies: [RwLock::new(left), RwLock::new(right)],
            front: AtomicUsize::new(0),
            writer: Mutex::new(()),
        }
    }

    /// Runs `write` on the back copy, swaps, then runs it on the other copy; returns the first
    /// run's result.
    fn write<R>(&self, write: impl Fn(&mut T) -> R) -> R {
        let _writer = self.writer.lock();
        let back = 1 - self.front.load(Ordering::Acquire);
        let result = write(&mut self.copies[back].write());
        self.front.store(back, Ordering::Release);
        // Waits for readers that were on the old front to leave it.
        write(&mut self.copies[1 - back].write());
        result
    }

    /// Reads the front copy. The copy is re-checked to still be the front once locked: a reader
    /// that loaded the index just before a swap could otherwise lock the copy the writer is
    /// bringing ahead, see a state not yet published, and then go back in time on its next read
    /// (found by the loom model in `tests/loom.rs`). A copy that is the front while read-locked
    /// is complete, and the writer cannot touch it before swapping away and taking its write lock.
    fn read<R>(&self, read: impl FnOnce(&T) -> R) -> R {
        loop {
            let front = self.front.load(Ordering::Acquire);
            let guard = self.copies[front].read();
            if self.front.load(Ordering::Acquire) == front {
                return read(&guard);
            }
        }
    }
}

impl<T: KvIndex + Sync> SharedKvIndex for LeftRight<T> {
    fn apply(&self, mutation: &Mutation) -> ApplyReport {
        self.write(|index| index.apply(mutation))
    }

    fn remove_worker(&self, worker_id: u64) -> ApplyReport {
        self.write(|index| index.remove_worker(worker_id))
    }

    fn clear(&self) {
        self.write(|index| index.clear());
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.read(|index| index.find_matches(query, options))
    }

    fn snapshot(&self) -> Snapshot {
        self.read(|index| index.snapshot())
    }

    fn restore(&self, snapshot: &Snapshot) {
        self.write(|index| index.restore(snapshot));
    }

    fn stats(&self) -> IndexStats {
        // Both copies hold the same state; the memory is twice one copy's.
        let mut stats = self.read(|index| index.stats());
        stats.heap_bytes *= 2;
        stats
    }
}
