//! `LeftRight<T>`: two copies of a single-threaded backend, so that reads do not wait for a busy
//! writer and the writer does not wait for readers.
//!
//! Readers always read the *front* copy (re-checking, once locked, that it is still the front).
//! Every write goes into an operation log. The writer brings the *back* copy up to date — the log
//! entries it missed, then the new one — and makes it the front with one atomic store; the old
//! front catches up on its next turn. If a reader still holds the back copy (it was preempted
//! mid-read), the writer applies to the front copy instead, under its write lock (readers then wait
//! for one write, spinning briefly before they sleep), and the back copy catches up later. So the
//! writer never waits for a preempted reader, and a reader never waits for more than one write.
//! A write may carry a batch of mutations ([`SharedKvIndex::apply_batch`]): one swap and one
//! catch-up for all of them, and fewer reads overlapping a swap when writes come back to back.
//!
//! Invariants (checked under every interleaving by the loom model in `tests/loom.rs`):
//! - the front copy has applied every mutation whose `apply` returned; a swap only ever makes a
//!   fully caught-up copy the front, so successive reads never go back in time;
//! - both copies apply the same log in the same order, so they hold the same state once caught up;
//! - a reader sees a state between two whole writes (mutations or batches).
//!
//! Costs: every mutation is applied twice and the index is held twice in memory; the log holds the
//! mutations one copy has not applied yet (usually one). Writes are serialized through one lock
//! (mutations of different ranks commute, but both copies must receive the same ones).
//! [`crate::baseline::Locked`] is the single-copy alternative that lets a busy writer delay readers.
//!
//! The protocol itself is [`TwoCopies`], generic over what a copy is and what the log holds:
//! `LeftRight` logs whole mutations; [`crate::ConcurrentAtlas`] keeps the writer-only part of its
//! index once and logs only the changes to the part readers see.

use std::sync::atomic::Ordering;

use kvatlas_hash::LocalBlockHash;

use crate::backend::{KvIndex, SharedKvIndex};
use crate::model::{ApplyReport, IndexStats, MatchOptions, Matches, Mutation};
use crate::snapshot::Snapshot;
use crate::sync::{AtomicUsize, Mutex, RwLock};

/// A copy that can be brought up to date by replaying logged operations.
pub(crate) trait Absorb<Op> {
    /// Applies `op` (one logged operation), exactly as the copy that logged it was changed.
    fn absorb(&mut self, op: &Op);
}

/// How many times a reader retries a write-locked front copy, a short spin apart, before it
/// waits on the lock. Loom explores every interleaving of each try: none there.
#[cfg(not(loom))]
const FRONT_COPY_SPINS: usize = 64;
#[cfg(loom)]
const FRONT_COPY_SPINS: usize = 0;

/// The operations not yet applied by both copies.
#[derive(Debug)]
struct Log<Op> {
    /// Entries from absolute position `base` on. Usually the last write's operations only
    /// (the other copy applies them on its next turn, and then they go).
    entries: Vec<Op>,
    base: u64,
    /// Per copy, the absolute position of the next entry it has to apply.
    applied: [u64; 2],
}

impl<Op> Default for Log<Op> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            base: 0,
            applied: [0; 2],
        }
    }
}

impl<Op> Log<Op> {
    fn end(&self) -> u64 {
        self.base + self.entries.len() as u64
    }

    /// Applies to `copy` (index `which`) every entry it has not applied.
    fn catch_up<C: Absorb<Op>>(&mut self, which: usize, copy: &mut C) {
        let from = (self.applied[which] - self.base) as usize;
        for op in &self.entries[from..] {
            copy.absorb(op);
        }
        self.applied[which] = self.end();
        self.trim();
    }

    /// Appends `ops` (leaving it empty), which copy `which` (caught up before) has already
    /// applied.
    fn record(&mut self, which: usize, ops: &mut Vec<Op>) {
        debug_assert_eq!(self.applied[which], self.end(), "recording on a stale copy");
        if self.entries.is_empty() {
            // The usual case: the buffers trade places, nothing is copied.
            std::mem::swap(&mut self.entries, ops);
        } else {
            self.entries.append(ops);
        }
        self.applied[which] = self.end();
    }

    /// Drops the entries once both copies applied them all. (While one copy lags — a reader
    /// held it through several writes — they stay; that copy catches up on its next turn.)
    fn trim(&mut self) {
        if self.applied[0] == self.applied[1] {
            self.base = self.end();
            self.entries.clear();
        }
    }
}

/// The writer's side: its own state (not read by readers) and the log.
#[derive(Debug)]
struct Writer<W, Op> {
    state: W,
    log: Log<Op>,
    /// Reused buffer for the operations of one write.
    ops: Vec<Op>,
}

/// The synchronization of every left-right front: two copies of `C` read by readers, a writer
/// state `W` only the (serialized) writer sees, and the log of operations one copy has not
/// applied yet. See the module docs for the protocol; `tests/loom.rs` model-checks it.
#[derive(Debug)]
pub(crate) struct TwoCopies<C, W, Op> {
    copies: [RwLock<C>; 2],
    /// Index of the copy readers use.
    front: AtomicUsize,
    /// Serializes writers.
    writer: Mutex<Writer<W, Op>>,
}

impl<C: Absorb<Op>, W, Op> TwoCopies<C, W, Op> {
    /// Two identical copies and the writer's state.
    pub(crate) fn new(left: C, right: C, state: W) -> Self {
        Self {
            copies: [RwLock::new(left), RwLock::new(right)],
            front: AtomicUsize::new(0),
            writer: Mutex::new(Writer {
                state,
                log: Log::default(),
                ops: Vec::new(),
            }),
        }
    }

    /// Runs one write: `write(state, copy, ops)` changes a caught-up copy and pushes to `ops`
    /// the operations that bring the other copy to the same state; the changed copy is then
    /// published (see the module docs).
    pub(crate) fn write<R>(&self, write: impl FnOnce(&mut W, &mut C, &mut Vec<Op>) -> R) -> R {
        let mut writer = self.writer.lock();
        let Writer { state, log, ops } = &mut *writer;
        ops.clear();
        let front = self.front.load(Ordering::Acquire);
        let back = 1 - front;
        if let Some(mut copy) = self.copies[back].try_write() {
            // The usual case: bring the back copy up to date, change it and publish it.
            log.catch_up(back, &mut *copy);
            let result = write(state, &mut copy, ops);
            log.record(back, ops);
            drop(copy);
            self.front.store(back, Ordering::Release);
            return result;
        }
        // A reader that picked the old front before the last swap still holds it: write the
        // front copy in place (its readers wait for this one write).
        let mut copy = self.copies[front].write();
        log.catch_up(front, &mut *copy);
        let result = write(state, &mut copy, ops);
        log.record(front, ops);
        result
    }

    /// Runs `check` on both copies as they are (for the tests).
    #[cfg(test)]
    pub(crate) fn both<R>(&self, check: impl FnOnce(&C, &C) -> R) -> R {
        let _writer = self.writer.lock();
        check(&self.copies[0].read(), &self.copies[1].read())
    }

    /// Reads the front copy. The copy is re-checked to still be the front once locked: a reader
    /// that loaded the index just before a swap could otherwise lock the copy the writer is
    /// bringing ahead, see a state not yet published, and then go back in time on its next read
    /// (found by the loom model in `tests/loom.rs`).
    pub(crate) fn read<R>(&self, read: impl FnOnce(&C) -> R) -> R {
        let mut spins = 0;
        loop {
            let front = self.front.load(Ordering::Acquire);
            // The front copy is write-locked only while the writer changes it in place (see
            // `write`), for about one mutation: spin for it a while rather than sleep, since
            // waking a parked thread costs more than the wait itself.
            let guard = match self.copies[front].try_read() {
                Some(guard) => guard,
                None if spins < FRONT_COPY_SPINS => {
                    spins += 1;
                    for _ in 0..32 {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                None => self.copies[front].read(),
            };
            if self.front.load(Ordering::Acquire) == front {
                return read(&guard);
            }
        }
    }
}

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

/// One copy of a [`LeftRight`]: a backend, brought up to date by re-applying logged writes.
#[derive(Debug)]
struct Replica<T>(T);

impl<T: KvIndex> Absorb<Op> for Replica<T> {
    fn absorb(&mut self, op: &Op) {
        op.run(&mut self.0);
    }
}

/// Two copies of a backend; see the module docs.
#[derive(Debug)]
pub struct LeftRight<T> {
    copies: TwoCopies<Replica<T>, (), Op>,
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
            copies: TwoCopies::new(Replica(left), Replica(right), ()),
        }
    }

    /// Applies `op` to a caught-up copy and logs it for the other; returns its report.
    fn write(&self, op: Op) -> ApplyReport {
        self.copies.write(|(), copy, ops| {
            let report = op.run(&mut copy.0);
            ops.push(op);
            report
        })
    }

    /// Reads the front copy.
    fn read<R>(&self, read: impl FnOnce(&T) -> R) -> R {
        self.copies.read(|copy| read(&copy.0))
    }
}

impl<T: KvIndex + Sync> SharedKvIndex for LeftRight<T> {
    fn apply(&self, mutation: &Mutation) -> ApplyReport {
        self.write(Op::Apply(mutation.clone()))
    }

    fn apply_owned(&self, mutation: Mutation) -> ApplyReport {
        self.write(Op::Apply(mutation))
    }

    /// One write for the whole batch: one swap, one catch-up of the other copy.
    fn apply_batch(&self, batch: &mut Vec<Mutation>) -> ApplyReport {
        self.copies.write(|(), copy, ops| {
            let mut report = ApplyReport::default();
            for mutation in batch.drain(..) {
                let op = Op::Apply(mutation);
                report.merge(&op.run(&mut copy.0));
                ops.push(op);
            }
            report
        })
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
