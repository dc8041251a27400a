//! The threads listeners run on: [`ListenerThreads`], a fixed set of poller threads, each
//! serving many listeners with one epoll over all their sockets.
//!
//! A thread per listener woke once per batch per engine: a burst of batches from many engines
//! (a fleet's requests often arrive together) woke as many threads, each for a few
//! microseconds of work, and they queued for the cores. A poller thread wakes once for the
//! burst and reads every ready socket in turn.
//!
//! - **Adding** a listener ([`ListenerThreads::add`]) hands its [`ListenerCore`] (sockets set
//!   up on the caller's thread) to the least-loaded poller over a channel and wakes it.
//! - **Readiness**: each listener's sockets are registered with the poller's epoll by their
//!   `ZMQ_FD` (edge-triggered: it signals that the socket's state may have changed). An event
//!   marks the listener; a marked listener is served (`ZMQ_EVENTS` says which sockets hold
//!   messages) and stays marked, served again without waiting, until `ZMQ_EVENTS` shows
//!   nothing left — a read may consume the next signal, so only an empty socket is left to the
//!   epoll. A wake costs in proportion to the listeners with something to read, not to all of
//!   them (a `zmq::poll` over 128 engines' sockets cost more than the batches it found).
//! - **Waking**: a [`mio::Waker`] ([`ListenerThreads::wake`]) ends a poll at once, so a stop or
//!   release takes effect without waiting for a timeout.
//! - **Ending**: a listener ends when it is asked to stop or fails; its poller records the
//!   status, drops the core (its sockets close on the thread that used them) and with it the
//!   sender of its *done* channel, which is what [`Listener::stop`](super::Listener::stop)
//!   waits for. A panic in one listener's code ends that listener only (failed, with the
//!   reason), not the others on its thread.
//! - **Backpressure** blocks a poller: a listener that finds the sink full waits (with a short
//!   backoff) before its poller serves the next listener — the writers are saturated, and
//!   what the sockets buffer meanwhile is bounded by their high-water marks.

use std::io::ErrorKind;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::ListenerError;
use super::event_loop::{Exit, ListenerCore, Ready, TOKENS_PER_LISTENER};

/// The waker's token (listeners' tokens count up from 0).
const WAKE: mio::Token = mio::Token(usize::MAX);
/// Epoll events taken per poll.
const EVENTS_PER_POLL: usize = 256;

/// A fixed set of poller threads that listeners run on (cheap to clone: every clone shares
/// the threads). The threads stop when the last clone is dropped, after the listeners on them
/// were stopped.
///
/// A [`Listeners`](super::Listeners) registry starts listeners on the set it was given; a
/// server gives every index's registry the same set. A [`Listener`](super::Listener) started
/// on its own gets a set of one thread.
#[derive(Debug, Clone)]
pub struct ListenerThreads {
    inner: Arc<Threads>,
}

#[derive(Debug)]
struct Threads {
    pollers: Vec<Poller>,
}

/// The handle of one poller thread.
#[derive(Debug)]
struct Poller {
    commands: mpsc::Sender<Command>,
    waker: mio::Waker,
    /// Listeners on this thread (added, not yet ended).
    load: Arc<AtomicUsize>,
    /// Turns this thread has given its listeners ([`ListenerThreads::turns`]).
    turns: Arc<AtomicU64>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

enum Command {
    Add(Entry),
}

/// A listener on a poller thread, with the sender its [`Listener`](super::Listener) waits on.
struct Entry {
    /// Declared first: dropped (sockets closed) before `_done` tells the waiter.
    core: Box<ListenerCore>,
    /// Never sent on: dropping it disconnects the waiter.
    _done: mpsc::Sender<()>,
    /// To be served without waiting for an event (an event came, or a socket still holds
    /// messages after it was served).
    marked: bool,
    /// When it is to be served even without an event (its [`ListenerCore::before_poll`]
    /// deadline); `None` once served, until that deadline is taken again.
    due: Option<Instant>,
}

/// Where [`ListenerThreads::add`] put a listener: the poller to wake for it, and the channel
/// that disconnects once the poller has dropped it.
#[derive(Debug)]
pub(super) struct Placement {
    pub(super) poller: usize,
    pub(super) done: mpsc::Receiver<()>,
}

impl ListenerThreads {
    /// Starts `threads` poller threads (at least one), named `{name}-{i}` (or `name` alone for
    /// one thread).
    ///
    /// # Errors
    /// [`ListenerError::InvalidOption`] for zero threads; [`ListenerError::Spawn`] if a thread
    /// or its wake-up socket cannot be created.
    pub fn new(threads: usize, name: &str) -> Result<Self, ListenerError> {
        if threads == 0 {
            return Err(ListenerError::InvalidOption {
                name: "listener threads",
                reason: "must be at least 1",
            });
        }
        let pollers = (0..threads)
            .map(|i| {
                let name = if threads == 1 {
                    name.to_owned()
                } else {
                    format!("{name}-{i}")
                };
                Poller::spawn(name)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            inner: Arc::new(Threads { pollers }),
        })
    }

    /// The number of poller threads.
    pub fn len(&self) -> usize {
        self.inner.pollers.len()
    }

    /// Always false: a set has at least one thread.
    pub fn is_empty(&self) -> bool {
        self.inner.pollers.is_empty()
    }

    /// Listeners currently running on each thread.
    pub fn loads(&self) -> Vec<usize> {
        self.inner
            .pollers
            .iter()
            .map(|p| p.load.load(Ordering::Relaxed))
            .collect()
    }

    /// Turns each thread has given its listeners so far: a turn is one listener served (its
    /// ready sockets read, or its deadlines — a replay's, a probe's, the receive timeout —
    /// handled). A wake gives turns only to the listeners it concerns, so a burst on a few of
    /// many engines costs turns for those few.
    pub fn turns(&self) -> Vec<u64> {
        self.inner
            .pollers
            .iter()
            .map(|p| p.turns.load(Ordering::Relaxed))
            .collect()
    }

    /// Hands `core` to the least-loaded poller and wakes it.
    pub(super) fn add(&self, core: ListenerCore) -> Result<Placement, ListenerError> {
        let (index, poller) = self
            .inner
            .pollers
            .iter()
            .enumerate()
            .min_by_key(|(_, p)| p.load.load(Ordering::Relaxed))
            .ok_or(ListenerError::InvalidOption {
                name: "listener threads",
                reason: "must be at least 1",
            })?;
        let (done, waiter) = mpsc::channel();
        poller.load.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            core: Box::new(core),
            _done: done,
            marked: true,
            due: None,
        };
        if poller.commands.send(Command::Add(entry)).is_err() {
            poller.load.fetch_sub(1, Ordering::Relaxed);
            return Err(ListenerError::Spawn(std::io::Error::other(
                "the listener thread has exited",
            )));
        }
        poller.wake();
        Ok(Placement {
            poller: index,
            done: waiter,
        })
    }

    /// Wakes poller `index` (a listener on it was asked to stop or was released).
    pub(super) fn wake(&self, index: usize) {
        if let Some(poller) = self.inner.pollers.get(index) {
            poller.wake();
        }
    }
}

impl Poller {
    fn spawn(name: String) -> Result<Self, ListenerError> {
        let poll = mio::Poll::new().map_err(ListenerError::Spawn)?;
        let waker = mio::Waker::new(poll.registry(), WAKE).map_err(ListenerError::Spawn)?;
        let (commands, received) = mpsc::channel();
        let load = Arc::new(AtomicUsize::new(0));
        let turns = Arc::new(AtomicU64::new(0));
        let thread = PollerThread {
            commands: received,
            poll,
            load: Arc::clone(&load),
            turns: Arc::clone(&turns),
            slots: Vec::new(),
            free: Vec::new(),
        };
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || thread.run())
            .map_err(ListenerError::Spawn)?;
        Ok(Self {
            commands,
            waker,
            load,
            turns,
            thread: Mutex::new(Some(handle)),
        })
    }

    fn wake(&self) {
        // Fails only if the eventfd cannot be written, which leaves the poll to its timeout.
        let _ = self.waker.wake();
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        for poller in &mut self.pollers {
            // Closing the channel tells the thread to stop every listener left on it and exit.
            let (closed, _) = mpsc::channel();
            drop(std::mem::replace(&mut poller.commands, closed));
            poller.wake();
        }
        for poller in &self.pollers {
            if let Some(thread) = poller.thread.lock().take() {
                let _ = thread.join();
            }
        }
    }
}

/// A poller thread's state.
struct PollerThread {
    commands: mpsc::Receiver<Command>,
    poll: mio::Poll,
    load: Arc<AtomicUsize>,
    turns: Arc<AtomicU64>,
    /// The listeners served; a listener's tokens are `slot * TOKENS_PER_LISTENER + offset`.
    slots: Vec<Option<Entry>>,
    /// Empty slots, reused first.
    free: Vec<usize>,
}

/// Runs `f` on `entry`'s core; a panic becomes a failure of that listener alone.
fn guarded<T>(
    entry: &mut Entry,
    f: impl FnOnce(&mut ListenerCore) -> Result<T, Exit>,
) -> Result<T, Exit> {
    match catch_unwind(AssertUnwindSafe(|| f(&mut entry.core))) {
        Ok(result) => result,
        Err(_) => {
            entry
                .core
                .shared()
                .set_error("the listener panicked (a bug: please report it)".to_owned());
            Err(Exit::Failed)
        }
    }
}

impl PollerThread {
    fn run(mut self) {
        let mut events = mio::Events::with_capacity(EVENTS_PER_POLL);
        // A wake (a command, a stop, a release) may concern any listener, so every listener's
        // deadline is taken again after one; otherwise only the deadlines of the listeners
        // served since, the only ones that can have moved (a listener's deadline depends on
        // its own state, which changes only when it is served, and on its stop and release
        // flags, which are set with a wake).
        let mut woken = true;
        loop {
            if !self.take_commands() {
                for slot in 0..self.slots.len() {
                    self.end(slot, Exit::Stopped);
                }
                return;
            }
            let now = Instant::now();
            // Without listeners, only a wake (a command, or the set dropped) ends the poll.
            let mut deadline: Option<Instant> = None;
            let mut marked = false;
            for slot in 0..self.slots.len() {
                let Some(entry) = self.slots[slot].as_mut() else {
                    continue;
                };
                let due = match entry.due {
                    Some(due) if !woken => due,
                    _ => match guarded(entry, |core| core.before_poll(now)) {
                        Ok(due) => {
                            entry.due = Some(due);
                            due
                        }
                        Err(exit) => {
                            self.end(slot, exit);
                            continue;
                        }
                    },
                };
                deadline = Some(deadline.map_or(due, |d| d.min(due)));
                marked |= entry.marked;
            }
            let timeout = if marked {
                Some(Duration::ZERO)
            } else {
                deadline.map(|deadline| deadline.saturating_duration_since(now))
            };
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(error) if error.kind() == ErrorKind::Interrupted => continue,
                Err(error) => {
                    // Fatal for the thread: its listeners fail, and later additions are
                    // refused ("the listener thread has exited") instead of polled by a loop
                    // that can no longer wait.
                    let message = format!("epoll: {error}");
                    for slot in 0..self.slots.len() {
                        if let Some(entry) = &self.slots[slot] {
                            entry.core.shared().set_error(message.clone());
                        }
                        self.end(slot, Exit::Failed);
                    }
                    return;
                }
            }
            woken = false;
            for event in &events {
                if event.token() == WAKE {
                    woken = true;
                    continue;
                }
                let slot = event.token().0 / TOKENS_PER_LISTENER;
                if let Some(Some(entry)) = self.slots.get_mut(slot) {
                    entry.marked = true;
                }
            }
            // Served: the listeners with an event or still holding messages, and those whose
            // deadline (a replay's, a probe's, the receive timeout) has come. The others are
            // passed over without a call, so a wake costs in proportion to the listeners it
            // concerns.
            let now = Instant::now();
            for slot in 0..self.slots.len() {
                let Some(entry) = self.slots[slot].as_mut() else {
                    continue;
                };
                if !entry.marked && entry.due.is_some_and(|due| due > now) {
                    continue;
                }
                let ready = if entry.marked {
                    entry.core.ready_now()
                } else {
                    Ready::default()
                };
                entry.due = None;
                self.turns.fetch_add(1, Ordering::Relaxed);
                let served = guarded(entry, |core| core.after_poll(ready));
                match served {
                    // Still marked while a socket holds messages (read caps, or a signal the
                    // reads consumed): only an empty socket waits for the epoll.
                    Ok(()) => entry.marked = ready.any() && entry.core.ready_now().any(),
                    Err(exit) => self.end(slot, exit),
                }
            }
        }
    }

    /// Takes every pending command; false once the set was dropped (the channel closed).
    fn take_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Add(entry)) => self.add(entry),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Registers a new listener's sockets and runs its start.
    fn add(&mut self, mut entry: Entry) {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let attached = self
            .poll
            .registry()
            .try_clone()
            .and_then(|registry| entry.core.attach(registry, slot * TOKENS_PER_LISTENER));
        if let Err(error) = attached {
            entry
                .core
                .shared()
                .set_error(format!("cannot watch the listener's sockets: {error}"));
            self.slots[slot] = Some(entry);
            self.end(slot, Exit::Failed);
            return;
        }
        let begun = guarded(&mut entry, ListenerCore::begin);
        self.slots[slot] = Some(entry);
        if let Err(exit) = begun {
            self.end(slot, exit);
        }
    }

    /// Ends the listener in `slot` (if any): records how it ended, removes its sockets from the
    /// epoll and drops it — its sockets close here, then its waiter is told.
    fn end(&mut self, slot: usize, exit: Exit) {
        let Some(mut entry) = self.slots.get_mut(slot).and_then(Option::take) else {
            return;
        };
        entry.core.finish(exit);
        self.free.push(slot);
        self.load.fetch_sub(1, Ordering::Relaxed);
        drop(entry);
    }
}
