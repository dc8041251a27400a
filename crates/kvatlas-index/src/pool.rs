//! `ThreadPool`: the sticky-routing write front (the design of NVIDIA Dynamo's
//! `ThreadPoolIndexer`), with bounded queues.
//!
//! Each worker's mutations always go to the same writer thread (chosen by hashing the worker id,
//! so every data-parallel rank of one worker shares a lane), so one worker's mutations are
//! applied in order and never concurrently; different workers' are applied in parallel by
//! different threads. Reads do not go through the pool: `find_matches` runs inline on the
//! caller's thread against the shared index.
//!
//! A [`Unit`] — the mutations of one engine batch, say, with a [`Checkpoint`] of its source —
//! is never split: its mutations and its checkpoint reach
//! [`SharedKvIndex::apply_checkpointed`] in one call, so an index that records checkpoints can
//! pair every snapshot with exactly the positions its state reflects.
//!
//! Queues are bounded: [`ThreadPool::enqueue`] blocks when the rank's lane is full (backpressure
//! to the producer) and [`ThreadPool::try_enqueue`] hands the mutation back instead — memory never
//! grows without bound. [`ThreadPool::flush`] is a barrier: it returns once every mutation
//! enqueued before it has been applied, with the accumulated [`ApplyReport`].
//!
//! A writer thread applies what is waiting in its lane as one batch (at most [`MAX_BATCH`]
//! mutations and at most the lane's capacity, so a writer never holds more than a full lane;
//! through [`SharedKvIndex::apply_batch`]), so a left-right front publishes once per
//! batch rather than once per mutation when the lane is busy: fewer copy swaps, and fewer reads
//! that overlap one. An idle lane still applies a lone mutation at once.
//!
//! [`ThreadPool::with_delay_observer`] reports, for every [`Unit`] that carries a
//! [`Unit::received`] instant, how long after it (and after [`Unit::published`], when known) the
//! unit became visible (the server's ingest delay and event age metrics).

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use kvatlas_hash::LocalBlockHash;
use parking_lot::Mutex;
use rustc_hash::FxBuildHasher;

use crate::backend::SharedKvIndex;
use crate::model::{ApplyReport, Checkpoint, MatchOptions, Matches, Mutation, Unit};
use crate::sync::{AtomicBool, AtomicUsize, Condvar, wait_for};

/// Most mutations a writer thread applies as one batch.
const MAX_BATCH: usize = 64;

/// Told by a writer thread, for each [`Unit`] with a [`Unit::received`] instant, how long after
/// it the unit's mutations became visible to queries (the write that applied them returned).
/// It runs on the writer thread after every write: keep it short (an atomic histogram update).
pub type DelayObserver = Arc<dyn Fn(UnitDelay) + Send + Sync>;

/// How long a unit took to become visible to queries (the write that applied it returned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitDelay {
    /// Since [`Unit::received`].
    pub since_received: Duration,
    /// Since [`Unit::published`], if the unit carried it.
    pub since_published: Option<Duration>,
}

enum Task {
    Apply(Mutation),
    Unit(Unit),
    Flush(Sender<()>),
}

/// Why a mutation (or a [`Unit`]) was not enqueued; it is handed back.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError<T = Mutation> {
    /// The worker's lane is full: the index is not keeping up.
    #[error("the writer lane is full")]
    Full(T),
    /// The pool's threads have stopped (a writer panicked).
    #[error("the writer pool has stopped")]
    Stopped(T),
}

/// A pool of writer threads in front of a [`SharedKvIndex`] (see the module docs).
///
/// ```
/// use kvatlas_hash::LocalBlockHash;
/// use kvatlas_index::{
///     ConcurrentAtlas, ExternalBlockHash, MatchOptions, Mutation, StoredBlock, ThreadPool, Tier,
///     Worker,
/// };
///
/// // One writer thread, at most 1,024 mutations waiting per lane.
/// let pool = ThreadPool::new(ConcurrentAtlas::new(), 1, 1024)?;
/// let worker = Worker::new(7, 0);
/// let local = LocalBlockHash::new(42);
/// let blocks = vec![StoredBlock { external: ExternalBlockHash::new(1), local }];
/// pool.enqueue(Mutation::Stored { worker, tier: Tier::Device, parent: None, blocks })
///     .expect("the pool is running");
/// // Everything enqueued before `flush` is applied when it returns.
/// assert_eq!(pool.flush().stored, 1);
/// let matches = pool.find_matches(&[local], &MatchOptions::default());
/// assert_eq!(matches.device_score(worker), 1);
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct ThreadPool<I: SharedKvIndex + 'static> {
    index: Arc<I>,
    lanes: Vec<Lane>,
    threads: Vec<JoinHandle<()>>,
    reports: Arc<Mutex<ApplyReport>>,
}

/// One writer's queue: first in, first out, at most its capacity, with memory in step with what
/// waits in it.
///
/// crossbeam's bounded channel allocates every slot when it is created: at the server's default
/// of 16,384 tasks a lane, 1.7 MB per lane and 3.4 MB per index before a single event (a tenth of
/// the server's peak RSS on the end-to-end benchmark, and again for every further model and
/// tenant). So a lane is an unbounded channel (which allocates blocks of 31 tasks as they come
/// and frees them as the writer takes them) and keeps its bound in a [`Room`].
#[derive(Debug)]
struct Lane {
    sender: Sender<Task>,
    room: Arc<Room>,
}

/// A lane's bound, shared by its producers and its writer thread.
///
/// Invariant: `queued` counts the tasks sent and not yet taken by the writer, and never exceeds
/// `capacity`: a producer reserves a place before it sends ([`Room::try_reserve`]) and the writer
/// gives places back for the tasks it took, once per drained batch and before a flush is
/// acknowledged ([`Room::release`]).
#[derive(Debug)]
struct Room {
    capacity: usize,
    queued: AtomicUsize,
    /// Producers waiting in [`Room::reserve`].
    waiting: AtomicUsize,
    /// Set when the writer thread has ended (its receiver is gone): nothing waits for room then.
    closed: AtomicBool,
    lock: crate::sync::Mutex<()>,
    freed: Condvar,
}

impl Room {
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            queued: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            lock: crate::sync::Mutex::new(()),
            freed: Condvar::new(),
        }
    }

    /// Takes a place if one is free.
    fn try_reserve(&self) -> bool {
        let mut queued = self.queued.load(Ordering::SeqCst);
        loop {
            if queued >= self.capacity {
                return false;
            }
            match self.queued.compare_exchange_weak(
                queued,
                queued + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(now) => queued = now,
            }
        }
    }

    /// Takes a place, waiting for one; `false` once the writer has ended.
    ///
    /// No wakeup is lost: a producer counts itself in `waiting` and then checks `queued`, both
    /// under the lock; the writer lowers `queued` and then reads `waiting` by a read-modify-write
    /// ([`Room::release`]), and notifies under the lock. Model-checked with loom
    /// (`tests/loom.rs`); the timed wait is a second guard, not the mechanism.
    fn reserve(&self) -> bool {
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return false;
            }
            if self.try_reserve() {
                return true;
            }
            let mut guard = self.lock.lock();
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while self.queued.load(Ordering::SeqCst) >= self.capacity
                && !self.closed.load(Ordering::SeqCst)
            {
                guard = wait_for(&self.freed, guard, Duration::from_millis(50));
            }
            drop(guard);
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Gives back `taken` places (the writer took that many tasks).
    fn release(&self, taken: usize) {
        if taken == 0 {
            return;
        }
        self.queued.fetch_sub(taken, Ordering::SeqCst);
        // Read `waiting` with a read-modify-write, not a load: if a producer's increment comes
        // later in `waiting`'s order, it reads this write and so synchronizes with it, and its
        // check of `queued` then sees the places given back. This holds under acquire/release
        // alone, without relying on a store-load order (which loom does not model).
        if self.waiting.fetch_add(0, Ordering::SeqCst) > 0 {
            let _guard = self.lock.lock();
            self.freed.notify_all();
        }
    }

    /// The writer has ended: wakes every producer waiting for room (they report it stopped).
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _guard = self.lock.lock();
        self.freed.notify_all();
    }
}

/// A lane's bound, exposed for the loom model of its wakeups (`tests/loom.rs`) only.
#[cfg(loom)]
#[doc(hidden)]
#[derive(Debug)]
pub struct LoomRoom(Room);

#[cfg(loom)]
impl LoomRoom {
    /// A room of `capacity` places.
    pub fn new(capacity: usize) -> Self {
        Self(Room::new(capacity))
    }
    /// [`Room::try_reserve`].
    pub fn try_reserve(&self) -> bool {
        self.0.try_reserve()
    }
    /// [`Room::reserve`].
    pub fn reserve(&self) -> bool {
        self.0.reserve()
    }
    /// [`Room::release`].
    pub fn release(&self, taken: usize) {
        self.0.release(taken);
    }
    /// [`Room::close`].
    pub fn close(&self) {
        self.0.close();
    }
}

/// Closes a lane's [`Room`] when its writer thread ends, however it ends (a panic included).
struct CloseOnExit(Arc<Room>);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl Lane {
    /// Sends `task` if the lane has room: `Err((task, true))` when full, `Err((task, false))`
    /// when the writer has ended.
    fn try_send(&self, task: Task) -> Result<(), (Task, bool)> {
        if self.room.closed.load(Ordering::SeqCst) {
            return Err((task, false));
        }
        if !self.room.try_reserve() {
            return Err((task, true));
        }
        self.send_reserved(task).map_err(|task| (task, false))
    }

    /// Sends `task`, waiting for room; `Err(task)` when the writer has ended.
    fn send(&self, task: Task) -> Result<(), Task> {
        if !self.room.reserve() {
            return Err(task);
        }
        self.send_reserved(task)
    }

    fn send_reserved(&self, task: Task) -> Result<(), Task> {
        self.sender.send(task).map_err(|error| {
            self.room.release(1);
            error.0
        })
    }

    fn queued(&self) -> usize {
        self.room.queued.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Task::Apply(m) => f.debug_tuple("Apply").field(m).finish(),
            Task::Unit(u) => f.debug_tuple("Unit").field(u).finish(),
            Task::Flush(_) => f.write_str("Flush"),
        }
    }
}

impl<I: SharedKvIndex + 'static> ThreadPool<I> {
    /// Starts `threads` writer threads (at least 1), each with a queue of `queue_capacity`
    /// mutations (at least 1).
    ///
    /// # Errors
    /// The OS error if a writer thread cannot be started (threads already started are stopped).
    pub fn new(index: I, threads: usize, queue_capacity: usize) -> std::io::Result<Self> {
        Self::start(index, threads, queue_capacity, None)
    }

    /// As [`ThreadPool::new`], and `observer` is told, for every unit that carries a
    /// [`Unit::received`] instant, how long after it the unit became visible to queries.
    ///
    /// # Errors
    /// The OS error if a writer thread cannot be started (threads already started are stopped).
    pub fn with_delay_observer(
        index: I,
        threads: usize,
        queue_capacity: usize,
        observer: DelayObserver,
    ) -> std::io::Result<Self> {
        Self::start(index, threads, queue_capacity, Some(observer))
    }

    fn start(
        index: I,
        threads: usize,
        queue_capacity: usize,
        observer: Option<DelayObserver>,
    ) -> std::io::Result<Self> {
        let index = Arc::new(index);
        let reports = Arc::new(Mutex::new(ApplyReport::default()));
        let mut lanes = Vec::new();
        let mut handles = Vec::new();
        for lane in 0..threads.max(1) {
            let (sender, receiver) = unbounded();
            let room = Arc::new(Room::new(queue_capacity));
            let (index, reports) = (Arc::clone(&index), Arc::clone(&reports));
            let observer = observer.clone();
            let max_batch = MAX_BATCH.min(queue_capacity.max(1));
            let writer_room = Arc::clone(&room);
            let handle = std::thread::Builder::new()
                .name(format!("kvatlas-writer-{lane}"))
                .spawn(move || {
                    let _close = CloseOnExit(Arc::clone(&writer_room));
                    writer_loop(
                        &*index,
                        &receiver,
                        &writer_room,
                        &reports,
                        max_batch,
                        observer.as_deref(),
                    );
                });
            match handle {
                Ok(handle) => {
                    lanes.push(Lane { sender, room });
                    handles.push(handle);
                }
                Err(error) => {
                    // Dropping the senders stops the threads already started.
                    drop(lanes);
                    for handle in handles {
                        let _ = handle.join();
                    }
                    return Err(error);
                }
            }
        }
        Ok(Self {
            index,
            lanes,
            threads: handles,
            reports,
        })
    }

    /// The shared index (for reads, stats and snapshots).
    pub fn index(&self) -> &I {
        &self.index
    }

    /// Number of writer threads.
    pub fn threads(&self) -> usize {
        self.lanes.len()
    }

    /// Tasks waiting in the lanes, not yet taken by a writer (a gauge of how far the writers
    /// are behind).
    pub fn queued(&self) -> usize {
        self.lanes.iter().map(Lane::queued).sum()
    }

    /// The lane of every rank of `worker_id`.
    fn lane(&self, worker_id: u64) -> &Lane {
        let hash = FxBuildHasher.hash_one(worker_id);
        &self.lanes[(hash % self.lanes.len() as u64) as usize]
    }

    /// Enqueues a mutation on its worker's lane, waiting while the lane is full.
    ///
    /// # Errors
    /// [`EnqueueError::Stopped`] if the writer threads have stopped.
    pub fn enqueue(&self, mutation: Mutation) -> Result<(), EnqueueError> {
        self.lane(mutation.worker().worker_id)
            .send(Task::Apply(mutation))
            .map_err(|task| match task {
                Task::Apply(m) => EnqueueError::Stopped(m),
                _ => unreachable_task(),
            })
    }

    /// Enqueues a mutation if its lane has room.
    ///
    /// # Errors
    /// [`EnqueueError::Full`] when the lane is full, [`EnqueueError::Stopped`] if the writers
    /// stopped; the mutation is handed back either way.
    pub fn try_enqueue(&self, mutation: Mutation) -> Result<(), EnqueueError> {
        self.lane(mutation.worker().worker_id)
            .try_send(Task::Apply(mutation))
            .map_err(|e| match e {
                (Task::Apply(m), true) => EnqueueError::Full(m),
                (Task::Apply(m), false) => EnqueueError::Stopped(m),
                _ => unreachable_task(),
            })
    }

    /// Enqueues a unit on its worker's lane, waiting while the lane is full (one task, however
    /// many mutations it holds).
    ///
    /// # Errors
    /// [`EnqueueError::Stopped`] if the writer threads have stopped.
    pub fn enqueue_unit(&self, unit: Unit) -> Result<(), EnqueueError<Unit>> {
        self.lane(unit.worker_id)
            .send(Task::Unit(unit))
            .map_err(|task| match task {
                Task::Unit(u) => EnqueueError::Stopped(u),
                _ => unreachable_task(),
            })
    }

    /// Enqueues a unit if its lane has room.
    ///
    /// # Errors
    /// [`EnqueueError::Full`] when the lane is full, [`EnqueueError::Stopped`] if the writers
    /// stopped; the unit is handed back either way.
    pub fn try_enqueue_unit(&self, unit: Unit) -> Result<(), EnqueueError<Unit>> {
        self.lane(unit.worker_id)
            .try_send(Task::Unit(unit))
            .map_err(|e| match e {
                (Task::Unit(u), true) => EnqueueError::Full(u),
                (Task::Unit(u), false) => EnqueueError::Stopped(u),
                _ => unreachable_task(),
            })
    }

    /// Waits until every mutation enqueued before this call has been applied; returns the
    /// reports accumulated since the previous flush.
    pub fn flush(&self) -> ApplyReport {
        let acks: Vec<_> = self
            .lanes
            .iter()
            .filter_map(|lane| {
                let (ack, done) = bounded(1);
                lane.send(Task::Flush(ack)).ok().map(|()| done)
            })
            .collect();
        for done in acks {
            // A disconnected ack means that writer stopped; nothing more will come from it.
            let _ = done.recv();
        }
        std::mem::take(&mut *self.reports.lock())
    }

    /// Drops every rank of `worker_id`, after everything enqueued before the call.
    pub fn remove_worker(&self, worker_id: u64) -> ApplyReport {
        let mut report = self.flush();
        report.merge(&self.index.remove_worker(worker_id));
        report
    }

    /// Reads inline on the caller's thread.
    pub fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.index.find_matches(query, options)
    }
}

fn unreachable_task() -> ! {
    unreachable!("a send hands back the task it was given")
}

/// What a writer thread has taken from its lane and not yet applied.
struct Pending {
    batch: Vec<Mutation>,
    checkpoints: Vec<Checkpoint>,
    /// The [`Unit::received`] and [`Unit::published`] instants of the units in `batch` (kept
    /// only with an observer).
    received: Vec<(Instant, Option<Instant>)>,
}

impl Pending {
    /// Applies what is pending as one write and tells `observer` each unit's delay.
    ///
    /// Invariant: a unit's mutations and checkpoint land in the same `apply_checkpointed` call.
    fn apply<I: SharedKvIndex>(
        &mut self,
        index: &I,
        observer: Option<&(dyn Fn(UnitDelay) + Send + Sync)>,
    ) -> ApplyReport {
        if self.batch.is_empty() && self.checkpoints.is_empty() {
            return ApplyReport::default();
        }
        let report = if self.checkpoints.is_empty() {
            index.apply_batch(&mut self.batch)
        } else {
            index.apply_checkpointed(&mut self.batch, &mut self.checkpoints)
        };
        if let Some(observer) = observer
            && !self.received.is_empty()
        {
            let visible = Instant::now();
            for (received, published) in self.received.drain(..) {
                observer(UnitDelay {
                    since_received: visible.saturating_duration_since(received),
                    since_published: published.map(|p| visible.saturating_duration_since(p)),
                });
            }
        }
        report
    }
}

fn writer_loop<I: SharedKvIndex>(
    index: &I,
    receiver: &Receiver<Task>,
    room: &Room,
    reports: &Mutex<ApplyReport>,
    max_batch: usize,
    observer: Option<&(dyn Fn(UnitDelay) + Send + Sync)>,
) {
    let mut report = ApplyReport::default();
    let mut pending = Pending {
        batch: Vec::with_capacity(max_batch),
        checkpoints: Vec::new(),
        received: Vec::new(),
    };
    while let Ok(task) = receiver.recv() {
        // The task just received, then whatever else is already waiting (up to a batch). The
        // places of the tasks taken are given back once the lane is drained (one release per
        // batch, not per task), and before a flush is acknowledged.
        let mut taken = 0;
        let mut next = Some(task);
        while let Some(task) = next.take() {
            taken += 1;
            match task {
                Task::Apply(mutation) => pending.batch.push(mutation),
                Task::Unit(unit) => {
                    pending.batch.extend(unit.mutations);
                    pending.checkpoints.extend(unit.checkpoint);
                    if observer.is_some() {
                        pending
                            .received
                            .extend(unit.received.map(|r| (r, unit.published)));
                    }
                }
                Task::Flush(ack) => {
                    room.release(std::mem::take(&mut taken));
                    report.merge(&pending.apply(index, observer));
                    reports.lock().merge(&std::mem::take(&mut report));
                    let _ = ack.send(());
                    continue;
                }
            }
            if pending.batch.len() < max_batch {
                next = receiver.try_recv().ok();
            }
        }
        room.release(taken);
        report.merge(&pending.apply(index, observer));
    }
    reports.lock().merge(&report);
}

impl<I: SharedKvIndex + 'static> Drop for ThreadPool<I> {
    fn drop(&mut self) {
        self.lanes.clear();
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}
