//! Concurrency: the read guarantee under concurrent writers, and the thread-pool front.
//!
//! Read guarantee (`SharedKvIndex`): a `find_matches` never credits a worker rank with a prefix it
//! did not hold at some moment during the call. Writers apply scripted streams (holes from
//! head-first eviction, re-stores, tail removals; the two workers use different engine hashes for
//! the same tokens) and publish how many mutations they have applied; readers check every answer
//! against the scores the reference model gives after each of those mutations.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{
    Atlas, Checkpoint, ConcurrentAtlas, EnqueueError, ExternalBlockHash, KvIndex, MatchOptions,
    Mutation, ReferenceIndex, SharedKvIndex, StoredBlock, ThreadPool, Tier, Unit, Worker,
    baseline::{ConcurrentRadixTree, LeftRight, Locked, RadixTree},
};

const CHAIN: u64 = 48;

fn local(i: u64) -> LocalBlockHash {
    LocalBlockHash::new(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x55)
}

fn external(worker: Worker, i: u64) -> ExternalBlockHash {
    // Non-uniform engine hashes: each worker names the same tokens differently.
    ExternalBlockHash::new(worker.worker_id * 1_000_000 + i)
}

fn store(worker: Worker, from: u64, to: u64) -> Mutation {
    Mutation::Stored {
        worker,
        tier: Tier::Device,
        parent: from.checked_sub(1).map(|p| external(worker, p)),
        blocks: (from..to)
            .map(|i| StoredBlock {
                external: external(worker, i),
                local: local(i),
            })
            .collect(),
    }
}

fn remove(worker: Worker, blocks: impl Iterator<Item = u64>) -> Mutation {
    Mutation::Removed {
        worker,
        tier: Tier::Device,
        blocks: blocks.map(|i| external(worker, i)).collect(),
    }
}

/// A deterministic script of mutations for one worker, and its score after each prefix of it.
fn script(worker: Worker, seed: u64, steps: usize) -> (Vec<Mutation>, Vec<u32>) {
    let mut state = seed;
    let mut next = move |bound: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % bound
    };
    let mut mutations = Vec::new();
    for _ in 0..steps {
        let m = match next(5) {
            0 | 1 => {
                let from = next(CHAIN);
                store(worker, from, (from + 1 + next(16)).min(CHAIN))
            }
            2 => store(worker, 0, CHAIN),
            3 => remove(worker, std::iter::once(next(CHAIN))), // a hole anywhere
            _ => {
                let from = next(CHAIN);
                remove(worker, from..CHAIN) // tail-first eviction
            }
        };
        mutations.push(m);
    }
    let query: Vec<LocalBlockHash> = (0..CHAIN).map(local).collect();
    let mut oracle = ReferenceIndex::new();
    let mut scores = vec![0];
    for m in &mutations {
        oracle.apply(m);
        scores.push(
            oracle
                .find_matches(&query, &MatchOptions::default())
                .device_score(worker),
        );
    }
    (mutations, scores)
}

/// Runs one writer thread per rank (`ranks` ranks, all storing the same token chain under their
/// own engine hashes) and two readers checking every answer; returns the per-rank scripts.
fn check_read_guarantee<I: SharedKvIndex + 'static>(
    index: Arc<I>,
    ranks: usize,
) -> Vec<(Vec<Mutation>, Vec<u32>)> {
    let workers: Vec<Worker> = (0..ranks as u64).map(|i| Worker::new(i + 1, 0)).collect();
    let scripts: Vec<_> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| script(*w, 7 + i as u64, 4000))
        .collect();
    let progress: Arc<Vec<AtomicUsize>> =
        Arc::new((0..ranks).map(|_| AtomicUsize::new(0)).collect());
    let query: Arc<Vec<LocalBlockHash>> = Arc::new((0..CHAIN).map(local).collect());

    std::thread::scope(|scope| {
        for (w, (mutations, _)) in scripts.iter().enumerate() {
            let (index, progress) = (Arc::clone(&index), Arc::clone(&progress));
            scope.spawn(move || {
                for m in mutations {
                    index.apply(m);
                    progress[w].fetch_add(1, Ordering::Release);
                }
            });
        }
        for _ in 0..2 {
            let (index, progress, query, scripts, workers) = (
                Arc::clone(&index),
                Arc::clone(&progress),
                Arc::clone(&query),
                &scripts,
                &workers,
            );
            scope.spawn(move || {
                let mut checked = 0;
                while checked < 3000 {
                    let before: Vec<usize> = progress.iter().map(|p| p.load(Ordering::Acquire)).collect();
                    let matches = index.find_matches(&query, &MatchOptions::default());
                    let after: Vec<usize> = progress.iter().map(|p| p.load(Ordering::Acquire)).collect();
                    for (w, worker) in workers.iter().enumerate() {
                        let scores = &scripts[w].1;
                        // States during the call: after `before` mutations up to after `after + 1`
                        // (the next one may have completed before its counter was bumped).
                        let window = &scores[before[w]..=(after[w] + 1).min(scores.len() - 1)];
                        let got = matches.device_score(*worker);
                        let (lo, hi) = (window.iter().min().copied().unwrap_or(0), window.iter().max().copied().unwrap_or(0));
                        assert!(lo <= got && got <= hi, "worker {worker:?} scored {got}, held between {lo} and {hi} during the call");
                    }
                    checked += 1;
                }
            });
        }
    });

    // At rest, the answer is exact.
    let matches = index.find_matches(&query, &MatchOptions::default());
    for (w, worker) in workers.iter().enumerate() {
        assert_eq!(
            matches.device_score(*worker),
            *scripts[w].1.last().unwrap_or(&0)
        );
    }
    scripts
}

#[test]
fn locked_radix_tree_keeps_the_read_guarantee() {
    check_read_guarantee(Arc::new(Locked::new(RadixTree::new())), 2);
}

#[test]
fn left_right_atlas_keeps_the_read_guarantee() {
    check_read_guarantee(Arc::new(LeftRight::new(Atlas::new(), Atlas::new())), 2);
}

#[test]
fn concurrent_atlas_keeps_the_read_guarantee() {
    check_read_guarantee(Arc::new(ConcurrentAtlas::new()), 2);
}

#[test]
fn locked_atlas_keeps_the_read_guarantee() {
    check_read_guarantee(Arc::new(Locked::new(Atlas::new())), 2);
}

#[test]
fn concurrent_radix_tree_keeps_the_read_guarantee() {
    check_read_guarantee(Arc::new(ConcurrentRadixTree::new()), 2);
}

/// Four writer threads of four ranks apply at once (this backend does not serialize ranks), on
/// one shared token chain: the ranks race to create, pin and free the same nodes. Afterwards the
/// state is exactly the oracle's, and once every rank is cleared no node is left (no leaked pin).
#[test]
fn concurrent_radix_tree_with_several_writers_keeps_the_read_guarantee() {
    let index = Arc::new(ConcurrentRadixTree::new());
    let scripts = check_read_guarantee(Arc::clone(&index), 4);
    let mut oracle = ReferenceIndex::new();
    for (mutations, _) in &scripts {
        for m in mutations {
            oracle.apply(m);
        }
    }
    assert_eq!(SharedKvIndex::snapshot(&*index), oracle.snapshot());
    assert_eq!(
        SharedKvIndex::stats(&*index).workers,
        oracle.stats().workers
    );
    SharedKvIndex::clear(&*index);
    assert_eq!(index.nodes(), 0, "nodes left after clear");
    assert_eq!(SharedKvIndex::stats(&*index).memberships, 0);
}

/// Snapshots taken while four ranks write: each rank's part is its state between two of its
/// mutations (a consistent cut per rank).
#[test]
fn concurrent_radix_tree_snapshots_are_per_rank_cuts() {
    let index = ConcurrentRadixTree::new();
    let workers: Vec<Worker> = (1..=4).map(|i| Worker::new(i, 0)).collect();
    let scripts: Vec<Vec<Mutation>> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| script(*w, 100 + i as u64, 600).0)
        .collect();
    // Each rank's snapshot blocks after each prefix of its script.
    let states: Vec<Vec<Vec<kvatlas_index::SnapshotBlock>>> = workers
        .iter()
        .zip(&scripts)
        .map(|(worker, mutations)| {
            let mut oracle = ReferenceIndex::new();
            let mut states = vec![Vec::new()];
            for m in mutations {
                oracle.apply(m);
                let snapshot = oracle.snapshot();
                let blocks = snapshot
                    .workers
                    .iter()
                    .find(|w| w.worker == *worker)
                    .map(|w| w.blocks.clone())
                    .unwrap_or_default();
                states.push(blocks);
            }
            states
        })
        .collect();
    let progress: Vec<AtomicUsize> = workers.iter().map(|_| AtomicUsize::new(0)).collect();
    std::thread::scope(|scope| {
        for (w, mutations) in scripts.iter().enumerate() {
            let (index, progress) = (&index, &progress);
            scope.spawn(move || {
                for m in mutations {
                    SharedKvIndex::apply(index, m);
                    progress[w].fetch_add(1, Ordering::Release);
                }
            });
        }
        let mut taken = 0;
        while progress.iter().any(|p| p.load(Ordering::Acquire) < 600) || taken < 20 {
            let before: Vec<usize> = progress.iter().map(|p| p.load(Ordering::Acquire)).collect();
            let snapshot = SharedKvIndex::snapshot(&index);
            let after: Vec<usize> = progress.iter().map(|p| p.load(Ordering::Acquire)).collect();
            for (w, worker) in workers.iter().enumerate() {
                let blocks = snapshot
                    .workers
                    .iter()
                    .find(|s| s.worker == *worker)
                    .map(|s| s.blocks.clone())
                    .unwrap_or_default();
                let last = (after[w] + 1).min(states[w].len() - 1);
                assert!(
                    states[w][before[w]..=last].contains(&blocks),
                    "{worker:?}: the snapshot is none of the states after mutations {}..={last}",
                    before[w]
                );
            }
            taken += 1;
        }
    });
}

#[test]
fn thread_pool_applies_each_rank_in_order_and_flushes() -> std::io::Result<()> {
    let pool = ThreadPool::new(Locked::new(RadixTree::new()), 3, 8)?;
    let mut oracle = ReferenceIndex::new();
    let mut expected = kvatlas_index::ApplyReport::default();
    for w in 0..6u64 {
        let worker = Worker::new(w, (w % 2) as u32);
        let (mutations, _) = script(worker, w, 300);
        for m in mutations {
            expected.merge(&oracle.apply(&m));
            pool.enqueue(m)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        }
    }
    assert_eq!(pool.flush(), expected, "reports accumulated across lanes");
    assert_eq!(
        SharedKvIndex::snapshot(pool.index()),
        oracle.snapshot(),
        "same state as applying in order"
    );

    let removed = pool.remove_worker(3);
    assert_eq!(removed, oracle.remove_worker(3));
    assert_eq!(SharedKvIndex::snapshot(pool.index()), oracle.snapshot());
    Ok(())
}

/// A worker id whose mutations make [`Gated`]'s writer panic.
const POISON: u64 = 666;

/// A pool's index whose writes wait at a gate the test can hold, and which records the size of
/// every batch it is given (and panics on a mutation of worker [`POISON`]).
struct Gated(Locked<RadixTree>, parking_lot::Mutex<Vec<usize>>);

impl Gated {
    fn new() -> Self {
        Self(
            Locked::new(RadixTree::new()),
            parking_lot::Mutex::new(Vec::new()),
        )
    }
}

impl SharedKvIndex for Gated {
    fn apply(&self, m: &Mutation) -> kvatlas_index::ApplyReport {
        self.apply_batch(&mut vec![m.clone()])
    }
    fn apply_batch(&self, batch: &mut Vec<Mutation>) -> kvatlas_index::ApplyReport {
        let mut sizes = self.1.lock();
        assert!(
            batch.iter().all(|m| m.worker().worker_id != POISON),
            "a poisoned mutation stops the writer"
        );
        sizes.push(batch.len());
        let mut report = kvatlas_index::ApplyReport::default();
        for m in batch.drain(..) {
            report.merge(&self.0.apply(&m));
        }
        report
    }
    fn remove_worker(&self, id: u64) -> kvatlas_index::ApplyReport {
        self.0.remove_worker(id)
    }
    fn clear(&self) {
        self.0.clear()
    }
    fn find_matches(&self, q: &[LocalBlockHash], o: &MatchOptions) -> kvatlas_index::Matches {
        SharedKvIndex::find_matches(&self.0, q, o)
    }
    fn snapshot(&self) -> kvatlas_index::Snapshot {
        SharedKvIndex::snapshot(&self.0)
    }
    fn restore(&self, s: &kvatlas_index::Snapshot) {
        self.0.restore(s)
    }
    fn stats(&self) -> kvatlas_index::IndexStats {
        SharedKvIndex::stats(&self.0)
    }
}

#[test]
fn thread_pool_applies_what_waits_as_one_batch_in_order() -> std::io::Result<()> {
    // A held gate keeps the writer from draining its lane; then what waits comes as batches.
    const CAPACITY: usize = 8;
    let pool = ThreadPool::new(Gated::new(), 1, CAPACITY)?;
    let worker = Worker::new(4, 0);
    let (mutations, _) = script(worker, 4, 40);
    let mut oracle = ReferenceIndex::new();
    let gate = pool.index().1.lock();
    let mut accepted = 0;
    for m in mutations {
        match pool.try_enqueue(m.clone()) {
            Ok(()) => {
                oracle.apply(&m);
                accepted += 1;
            }
            // The writer waits at the gate and the lane is full: stop here, in order.
            Err(EnqueueError::Full(_)) => break,
            Err(EnqueueError::Stopped(_)) => panic!("writers stopped"),
        }
    }
    drop(gate);
    pool.flush();
    let sizes = pool.index().1.lock().clone();
    assert_eq!(
        sizes.iter().sum::<usize>(),
        accepted,
        "every mutation applied once"
    );
    assert!(
        sizes.iter().all(|&n| (1..=CAPACITY).contains(&n)),
        "batches within the lane's capacity: {sizes:?}"
    );
    assert!(
        sizes.iter().any(|&n| n > 1),
        "what waited in the lane came as one batch: {sizes:?}"
    );
    assert_eq!(
        SharedKvIndex::snapshot(pool.index()),
        oracle.snapshot(),
        "applied in order"
    );
    Ok(())
}

#[test]
fn thread_pool_queues_are_bounded() -> std::io::Result<()> {
    // One lane with room for one mutation; a writer waiting at the held gate cannot drain it.
    let pool = ThreadPool::new(Gated::new(), 1, 1)?;
    let worker = Worker::new(9, 0);
    let held = pool.index().1.lock();
    let mut full = 0;
    for i in 0..10 {
        match pool.try_enqueue(store(worker, i, i + 1)) {
            Ok(()) => {}
            Err(EnqueueError::Full(m)) => {
                assert_eq!(m.worker(), worker, "the mutation is handed back");
                full += 1;
            }
            Err(EnqueueError::Stopped(_)) => panic!("writers stopped"),
        }
    }
    // At most one mutation in the writer's hands and one in the queue.
    assert!(full >= 8, "only {full} of 10 enqueues were refused");
    assert!(
        pool.queued() <= 1,
        "{} queued in a lane of 1",
        pool.queued()
    );
    drop(held);
    let report = pool.flush();
    assert_eq!(report.stored as usize, 10 - full);
    assert_eq!(pool.queued(), 0, "a flush leaves nothing queued");
    Ok(())
}

#[test]
fn thread_pool_enqueue_waits_for_room_and_keeps_order() -> std::io::Result<()> {
    // A lane of two; the writer waits at the held gate with one mutation, two more fill the lane.
    let pool = Arc::new(ThreadPool::new(Gated::new(), 1, 2)?);
    let worker = Worker::new(5, 0);
    let gate = pool.index().1.lock();
    let mut oracle = ReferenceIndex::new();
    let first = store(worker, 0, 1);
    pool.enqueue(first.clone()).expect("the pool is running");
    oracle.apply(&first);
    // Wait until the writer has taken it off the lane (it then waits at the gate).
    while pool.queued() > 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut next = 1;
    while next < 10 {
        let m = store(worker, next, next + 1);
        match pool.try_enqueue(m.clone()) {
            Ok(()) => {
                oracle.apply(&m);
            }
            Err(EnqueueError::Full(_)) => break,
            Err(EnqueueError::Stopped(_)) => panic!("writers stopped"),
        }
        next += 1;
    }
    assert!(
        pool.queued() <= 2,
        "{} queued in a lane of 2",
        pool.queued()
    );
    // A blocking enqueue waits for room while the lane is full...
    let done = Arc::new(AtomicUsize::new(0));
    let waiting = {
        let (pool, done) = (Arc::clone(&pool), Arc::clone(&done));
        let m = store(worker, next, next + 1);
        std::thread::spawn(move || {
            let result = pool.enqueue(m);
            done.store(1, Ordering::SeqCst);
            result.is_ok()
        })
    };
    oracle.apply(&store(worker, next, next + 1));
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(
        done.load(Ordering::SeqCst),
        0,
        "the enqueue waited for room"
    );
    // ...and goes through once the writer drains the lane, after what was queued before it.
    drop(gate);
    assert!(waiting.join().expect("producer thread"), "enqueued");
    pool.flush();
    assert_eq!(pool.queued(), 0);
    assert_eq!(
        SharedKvIndex::snapshot(pool.index()),
        oracle.snapshot(),
        "every mutation applied once, in order"
    );
    Ok(())
}

#[test]
fn a_producer_waiting_for_room_learns_that_the_writer_stopped() -> std::io::Result<()> {
    let pool = Arc::new(ThreadPool::new(Gated::new(), 1, 1)?);
    let gate = pool.index().1.lock();
    // The writer takes the poisoned mutation and waits at the gate; one more fills the lane.
    pool.enqueue(store(Worker::new(POISON, 0), 0, 1))
        .expect("the pool is running");
    let mut filled = false;
    for _ in 0..100 {
        match pool.try_enqueue(store(Worker::new(POISON, 0), 1, 2)) {
            Ok(()) => {
                filled = true;
                break;
            }
            // The writer has not taken the first one off the lane yet.
            Err(EnqueueError::Full(_)) => std::thread::sleep(std::time::Duration::from_millis(5)),
            Err(EnqueueError::Stopped(_)) => panic!("writers stopped early"),
        }
    }
    assert!(filled, "the writer took the first mutation");
    let waiting = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.enqueue(store(Worker::new(POISON, 0), 2, 3)))
    };
    std::thread::sleep(std::time::Duration::from_millis(100));
    // The writer panics on the poisoned batch: the waiting producer is told, not left waiting.
    drop(gate);
    match waiting.join().expect("producer thread") {
        Err(EnqueueError::Stopped(m)) => assert_eq!(m.worker().worker_id, POISON),
        other => panic!("expected Stopped, got {other:?}"),
    }
    assert!(matches!(
        pool.try_enqueue(store(Worker::new(1, 0), 0, 1)),
        Err(EnqueueError::Stopped(_))
    ));
    Ok(())
}

/// Records, per `apply_checkpointed` call, the mutations it got (as `(worker, first external)`)
/// and the checkpoints, so the test can check that no unit was split from its checkpoint.
#[derive(Default)]
struct Recording(parking_lot::Mutex<Vec<Call>>);

/// One `apply_checkpointed` call: its mutations as `(worker, first external)`, its checkpoints.
type Call = (Vec<(Worker, u64)>, Vec<Checkpoint>);

impl SharedKvIndex for Recording {
    fn apply(&self, m: &Mutation) -> kvatlas_index::ApplyReport {
        self.apply_batch(&mut vec![m.clone()])
    }
    fn apply_batch(&self, batch: &mut Vec<Mutation>) -> kvatlas_index::ApplyReport {
        self.apply_checkpointed(batch, &mut Vec::new())
    }
    fn apply_checkpointed(
        &self,
        batch: &mut Vec<Mutation>,
        checkpoints: &mut Vec<Checkpoint>,
    ) -> kvatlas_index::ApplyReport {
        let applied = batch
            .drain(..)
            .map(|m| match m {
                Mutation::Stored { worker, blocks, .. } => (worker, blocks[0].external.get()),
                other => (other.worker(), 0),
            })
            .collect();
        self.0.lock().push((applied, std::mem::take(checkpoints)));
        kvatlas_index::ApplyReport::default()
    }
    fn remove_worker(&self, _: u64) -> kvatlas_index::ApplyReport {
        kvatlas_index::ApplyReport::default()
    }
    fn clear(&self) {}
    fn find_matches(&self, _: &[LocalBlockHash], _: &MatchOptions) -> kvatlas_index::Matches {
        kvatlas_index::Matches::default()
    }
    fn snapshot(&self) -> kvatlas_index::Snapshot {
        kvatlas_index::Snapshot::default()
    }
    fn restore(&self, _: &kvatlas_index::Snapshot) {}
    fn stats(&self) -> kvatlas_index::IndexStats {
        kvatlas_index::IndexStats::default()
    }
}

#[test]
fn thread_pool_never_splits_a_unit_from_its_checkpoint_and_keeps_a_workers_ranks_in_order()
-> std::io::Result<()> {
    // Units of 1..=70 mutations (some beyond the pool's largest batch) alternating between two
    // ranks of one worker, each with a checkpoint numbering it.
    let pool = ThreadPool::new(Recording::default(), 3, 4)?;
    let mut sent = Vec::new();
    for unit in 0..60u64 {
        let rank = (unit % 2) as u32;
        let worker = Worker::new(9, rank);
        let mutations: Vec<Mutation> = (0..=(unit * 7) % 70)
            .map(|i| store(worker, unit * 1000 + i, unit * 1000 + i + 1))
            .collect();
        sent.extend(mutations.iter().map(|m| (m.worker(), first_external(m))));
        pool.enqueue_unit(Unit {
            worker_id: 9,
            mutations,
            checkpoint: Some(Checkpoint {
                source: Worker::new(9, 0),
                position: unit,
                fingerprint: unit * 31,
            }),
            resync: false,
            received: None,
            published: None,
        })
        .map_err(|_| std::io::Error::other("writers stopped"))?;
    }
    pool.flush();
    let calls = pool.index().0.lock().clone();
    // All of them in order (one lane for every rank of the worker).
    let applied: Vec<(Worker, u64)> = calls.iter().flat_map(|(m, _)| m.clone()).collect();
    assert_eq!(applied, sent);
    // Every unit's mutations all come in one call, with its checkpoint.
    let unit_end = |u: u64| (0..=u).map(|v| ((v * 7) % 70 + 1) as usize).sum::<usize>();
    let unit_start = |u: u64| unit_end(u) - ((u * 7) % 70 + 1) as usize;
    let mut seen = 0usize;
    let mut next_unit = 0u64;
    for (mutations, checkpoints) in &calls {
        let before = seen;
        seen += mutations.len();
        for checkpoint in checkpoints {
            assert_eq!(checkpoint.position, next_unit, "checkpoints in order");
            assert!(
                unit_start(next_unit) >= before && unit_end(next_unit) <= seen,
                "unit {next_unit} ({}..{}) split from its checkpoint (call held {before}..{seen})",
                unit_start(next_unit),
                unit_end(next_unit)
            );
            next_unit += 1;
        }
    }
    assert_eq!(next_unit, 60);
    Ok(())
}

fn first_external(m: &Mutation) -> u64 {
    match m {
        Mutation::Stored { blocks, .. } => blocks[0].external.get(),
        _ => 0,
    }
}

#[test]
fn thread_pool_tells_the_delay_observer_how_long_each_received_unit_took_to_become_visible()
-> std::io::Result<()> {
    use kvatlas_index::UnitDelay;
    use std::time::{Duration, Instant};
    let delays = Arc::new(parking_lot::Mutex::new(Vec::<UnitDelay>::new()));
    let observer = {
        let delays = Arc::clone(&delays);
        Arc::new(move |delay: UnitDelay| delays.lock().push(delay))
    };
    let pool = ThreadPool::with_delay_observer(ConcurrentAtlas::new(), 2, 4, observer)?;
    // Units received "a while ago" (an instant 50 ms back), some of them published 30 ms before
    // that; units without an instant, and plain mutations: only the first kind is reported,
    // each at least its 50 ms, and at least 80 ms since publication where it was known.
    let long_ago = Duration::from_millis(50);
    let before = Duration::from_millis(30);
    let Some((received, published)) = Instant::now()
        .checked_sub(long_ago)
        .and_then(|received| Some((received, received.checked_sub(before)?)))
    else {
        return Ok(()); // the clock started less than 80 ms ago: nothing to measure against
    };
    let (mut timed, mut aged) = (0, 0);
    for unit in 0..24u64 {
        let worker = Worker::new(unit % 5, 0);
        let stamped = unit % 3 != 0;
        let dated = stamped && unit % 2 == 0;
        timed += usize::from(stamped);
        aged += usize::from(dated);
        pool.enqueue_unit(Unit {
            worker_id: worker.worker_id,
            mutations: vec![store(worker, unit * 10, unit * 10 + 4)],
            checkpoint: None,
            resync: false,
            received: stamped.then_some(received),
            published: dated.then_some(published),
        })
        .map_err(|_| std::io::Error::other("writers stopped"))?;
        pool.enqueue(store(worker, 5_000 + unit, 5_001 + unit))
            .map_err(|_| std::io::Error::other("writers stopped"))?;
    }
    let report = pool.flush();
    assert_eq!(report.stored, 24 * 4 + 24);
    let delays = delays.lock();
    assert_eq!(delays.len(), timed, "one report per unit with an instant");
    assert!(
        delays.iter().all(|d| d.since_received >= long_ago),
        "{delays:?}"
    );
    let ages: Vec<Duration> = delays.iter().filter_map(|d| d.since_published).collect();
    assert_eq!(
        ages.len(),
        aged,
        "an age for each unit that was published at a known time"
    );
    assert!(
        delays
            .iter()
            .filter_map(|d| Some((d.since_received, d.since_published?)))
            .all(|(received, age)| age >= received + before),
        "{delays:?}"
    );
    Ok(())
}
