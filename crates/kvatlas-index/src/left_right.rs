//! `LeftRight<T>`: two copies of a single-threaded backend, so that reads do not wait for a busy
//! writer and the writer does not wait for readers.
//!
//! Readers always read the *front* copy (re-checking, once locked, that it is still the front).
//! Every write goes into an operation log. The writer brings the *back* copy up to date — the log
//! entries it missed, then the new one — and makes it the front with one atomic store; the old
//! front catches up on its next turn. If a reader still holds the back copy (it was preempted
//! mid-read), the writer applies to the front copy instead, under its write lock (readers then wait
//! for one mutation, about a microsecond), and the back copy catches up later. So the writer never
//! waits for a preempted reader, and a reader never waits for more than one mutation.
//!
//! Invariants (checked under every interleaving by the loom model in `tests/loom.rs`):
//! - the front copy has applied every mutation whose `apply` returned; a swap only ever makes a
//!   fully caught-up copy the front, so successive reads never go back in time;
//! - both copies apply the same log in the same order, so they hold the same state once caught up;
//! - a reader sees a state between two whole mutations.
//!
//! Costs: every mutation is applied twice and the index is held twice in memory; the log holds the
//! mutations one copy has not applied yet (usually one). Writes are serialized through one lock
//! (mutations of different ranks commute, but both copies must receive the same ones).
//! [`crate::Locked`] is the single-copy alternative that lets a busy writer delay readers.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use kvatlas_hash::LocalBlockHash;

use crate::backend::{KvIndex, SharedKvIndex};
use crate::model::{ApplyReport, IndexStats, MatchOptions, Matches, Mutation};
use crate::snapshot::Snapshot;
use crate::sync::{AtomicUsize, Mutex, RwLock};

/// A write, as logged for the copy that has not applied it yet.
#[derive(Debug, Clone)]
enum Op {
    Apply(Mutation),
    RemoveWorker(u64),
    Clear,
    Restore(Snapshot),
}

impl Op {
    fn run<T: KvIndex>(&self, index: &mut T) -> ApplyReport {
        match self {
            Op::Apply(mutation) => index.apply(mutation),
            Op::RemoveWorker(worker_id) => index.remove_worker(*worker_id),
            Op::Clear => {
                index.clear();
                ApplyReport::default()
            }
            Op::Restore(snapshot) => {
                index.restore(snapshot);
                ApplyReport::default()
            }
        }
    }
}

/// The operations not yet applied by both copies.
#[derive(Debug, Default)]
struct Log {
    /// Entries from absolute position `base` on.
    entries: VecDeque<Op>,
    base: u64,
    /// Per copy, the absolute position of the next entry it has to apply.
    applied: [u64; 2],
}

impl Log {
    /// Applies to `copy` (index `which`) every entry it has not applied; returns the report of
    /// the last entry if this copy is the first to apply it.
    fn catch_up<T: KvIndex>(&mut self, which: usize, copy: &mut T) -> Option<ApplyReport> {
        let end = self.base + self.entries.len() as u64;
        let first_new = self.applied[1 - which].max(self.applied[which]);
        let mut report = None;
        while self.applied[which] < end {
            let position = self.applied[which];
            let run = self.entries[(position - self.base) as usize].run(copy);
            if position >= first_new {
                report = Some(run);
            }
            self.applied[which] += 1;
        }
        // Entries both copies applied are no longer needed.
        let done = self.applied[0].min(self.applied[1]);
        while self.base < done {
            self.entries.pop_front();
            self.base += 1;
        }
        report
    }
}

/// Two copies of a backend; see the module docs.
#[derive(Debug)]
pub struct LeftRight<T> {
    copies: [RwLock<T>; 2],
    /// Index of the copy readers use.
    front: AtomicUsize,
    /// Serializes writers and holds the operation log.
    log: Mutex<Log>,
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
            log: Mutex::new(Log::default()),
        }
    }

    /// Logs `op` and applies it (see the module docs); returns its report.
    fn write(&self, op: Op) -> ApplyReport {
        let mut log = self.log.lock();
        log.entries.push_back(op);
        let front = self.front.load(Ordering::Acquire);
        let back = 1 - front;
        if let Some(mut copy) = self.copies[back].try_write() {
            // The usual case: bring the back copy up to date and publish it.
            let report = log.catch_up(back, &mut *copy);
            drop(copy);
            self.front.store(back, Ordering::Release);
            return report.unwrap_or_default();
        }
        // A reader that picked the old front before the last swap still holds it: write the
        // front copy in place (its readers wait for this one mutation).
        let mut copy = self.copies[front].write();
        log.catch_up(front, &mut *copy).unwrap_or_default()
    }

    /// Reads the front copy. The copy is re-checked to still be the front once locked: a reader
    /// that loaded the index just before a swap could otherwise lock the copy the writer is
    /// bringing ahead, see a state not yet published, and then go back in time on its next read
    /// (found by the loom model in `tests/loom.rs`).
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
        self.write(Op::Apply(mutation.clone()))
    }

    fn apply_owned(&self, mutation: Mutation) -> ApplyReport {
        self.write(Op::Apply(mutation))
    }

    fn remove_worker(&self, worker_id: u64) -> ApplyReport {
        self.write(Op::RemoveWorker(worker_id))
    }

    fn clear(&self) {
        self.write(Op::Clear);
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.read(|index| index.find_matches(query, options))
    }

    fn snapshot(&self) -> Snapshot {
        self.read(|index| index.snapshot())
    }

    fn restore(&self, snapshot: &Snapshot) {
        self.write(Op::Restore(snapshot.clone()));
    }

    fn stats(&self) -> IndexStats {
        // Both copies converge to the same state; the memory is about twice one copy's.
        let mut stats = self.read(|index| index.stats());
        stats.heap_bytes *= 2;
        stats
    }
}
