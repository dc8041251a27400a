//! One listener's sockets and state, [`ListenerCore`]: a poller thread
//! ([`super::poller`]) polls its SUB, connection monitor and replay DEALER together with other
//! listeners' sockets; the core reads what is ready, drives the sequencer (live batches,
//! replays, resyncs) and hands each applied batch to the sink.

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvatlas_index::{Checkpoint, Mutation, Unit, Worker};

use super::config::{MAX_PROBE_BACKOFF, millis_i32};
use super::status::{Shared, bump};
use super::{ListenerConfig, ListenerStatus, MutationSink, Resume, SinkError};
use crate::convert::{Converter, Source};
use crate::counters::{DropCounters, Reason};
use crate::decode::decode_batch;
use crate::frames::{ReplayReply, decode_live_message, decode_replay_reply, replay_request};
use crate::sequence::{Action, ReplayId, ResyncReason, Sequencer};

/// At most this many frames of one message are kept (the longest valid layout has 4); further
/// frames are received and discarded, so a hostile peer cannot make a message grow unbounded.
const MAX_KEPT_FRAMES: usize = 4;

/// At most this many distinct ranks are fed by one source (a source is one engine rank and its
/// batches normally all carry that rank; one publisher of a whole wide-EP deployment carries a
/// few hundred). A resync clears every rank the source fed, so each is remembered; a batch of a
/// further rank is dropped and counted ([`Reason::TooManyDpRanks`]), never applied unremembered.
pub const MAX_RANKS_PER_SOURCE: usize = 1024;

/// When a quiet stream is probed next ([`Sequencer::probe`]).
#[derive(Debug, Clone, Copy)]
struct ProbeSchedule {
    /// The configured interval: the first wait after a live batch.
    interval: Duration,
    /// How soon a probe that is due but could not go out is tried again.
    retry: Duration,
    /// The current wait (doubles while the stream stays quiet, up to
    /// [`MAX_PROBE_BACKOFF`] × `interval`).
    wait: Duration,
    /// When the next probe is due.
    at: Instant,
    /// The SUB's connection was (re)established since the last probe went out: a probe is due
    /// whatever the live stream does (a live batch read after the new connection may still
    /// have come over the old one, so it cannot stand for the probe).
    reconnected: bool,
    /// The batch last applied when the (first such) connection opened: that probe is anchored
    /// there ([`Sequencer::probe_from`]), not at a batch of the new connection applied since.
    anchor: Option<(u64, u64)>,
}

impl ProbeSchedule {
    fn new(interval: Duration, retry: Duration, now: Instant) -> Self {
        Self {
            interval,
            retry,
            wait: interval,
            at: now + interval,
            reconnected: false,
            anchor: None,
        }
    }

    /// A live batch arrived: the stream is not quiet; the next probe is one interval away,
    /// unless one is due for a reconnection.
    fn live(&mut self, now: Instant) {
        self.wait = self.interval;
        if !self.reconnected {
            self.at = now + self.interval;
        }
    }

    /// The SUB's connection (re)opened: whatever the engine published while it was down was
    /// lost on the live stream, so a probe is due now (and stays due until one goes out).
    fn connected(&mut self, now: Instant, last_applied: Option<(u64, u64)>) {
        if !self.reconnected {
            self.anchor = last_applied;
        }
        self.reconnected = true;
        self.at = now;
    }

    /// A due probe went out (`sent`: the next one backs off) or could not (a replay is
    /// outstanding, or there is no position yet: tried again shortly).
    fn after_probe(&mut self, now: Instant, sent: bool) {
        if sent {
            self.reconnected = false;
            self.anchor = None;
            self.at = now + self.wait;
            self.wait = (self.wait * 2).min(self.interval * MAX_PROBE_BACKOFF);
        } else {
            self.at = now + self.retry;
        }
    }
}

/// A condition that ends a listener: its poller drops it (closing its sockets) and records
/// the status ([`ListenerCore::finish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Exit {
    /// Asked to stop.
    Stopped,
    /// A fatal error (already recorded).
    Failed,
}

/// Which of a listener's sockets hold something to read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Ready {
    live: bool,
    monitor: bool,
    replay: bool,
}

impl Ready {
    /// Whether any socket holds something.
    pub(super) fn any(self) -> bool {
        self.live || self.monitor || self.replay
    }
}

/// Token offsets of a listener's sockets in its poller's epoll (see [`ListenerCore::attach`]).
const SUB_TOKEN: usize = 0;
const MONITOR_TOKEN: usize = 1;
const REPLAY_TOKEN: usize = 2;
/// Tokens reserved per listener.
pub(super) const TOKENS_PER_LISTENER: usize = 4;

/// A listener's registration with its poller's epoll.
struct Watch {
    registry: mio::Registry,
    base: usize,
}

impl Watch {
    fn register(&self, socket: &zmq::Socket, offset: usize) -> std::io::Result<()> {
        let fd = socket.get_fd().map_err(std::io::Error::other)?;
        self.registry.register(
            &mut mio::unix::SourceFd(&fd),
            mio::Token(self.base + offset),
            mio::Interest::READABLE,
        )
    }

    fn deregister(&self, socket: &zmq::Socket) {
        // A socket whose descriptor is already gone has nothing left to remove.
        if let Ok(fd) = socket.get_fd() {
            let _ = self.registry.deregister(&mut mio::unix::SourceFd(&fd));
        }
    }
}

/// An outstanding replay request and its socket.
struct ReplayState {
    id: ReplayId,
    from: u64,
    dealer: zmq::Socket,
}

impl fmt::Debug for ReplayState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayState")
            .field("id", &self.id)
            .field("from", &self.from)
            .finish_non_exhaustive()
    }
}

/// A received multipart message: its first [`MAX_KEPT_FRAMES`] frames and its true frame count.
///
/// The frames stay ZMQ's messages: a batch is decoded where ZMQ received it, and a payload the
/// sequencer keeps is kept as the message, not copied into a buffer of its own.
struct Received {
    frames: Vec<zmq::Message>,
    count: usize,
}

/// A batch's payload as received: ZMQ's message, handed to the sequencer as it is.
///
/// Memory: a received message may share ZMQ's receive buffer (8 KiB, with the other messages of
/// one read) until it is dropped, so a buffered payload can hold up to that much more than its
/// own bytes; what a listener buffers is bounded by `max_buffered_bytes` plus that slack per
/// batch (before the byte budget, only by `max_buffered` × `max_frame_bytes`: 64 GiB by default).
struct Payload(zmq::Message);

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Receives one whole multipart message, keeping at most [`MAX_KEPT_FRAMES`] frames.
/// `Ok(None)` when nothing is ready (`EAGAIN`).
fn receive(socket: &zmq::Socket, flags: i32) -> Result<Option<Received>, zmq::Error> {
    let first = match socket.recv_msg(flags) {
        Ok(frame) => frame,
        Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => return Ok(None),
        Err(error) => return Err(error),
    };
    let mut frames = Vec::with_capacity(MAX_KEPT_FRAMES);
    frames.push(first);
    let mut count = 1;
    // The rest of a multipart message is delivered atomically with its first frame; a signal
    // can still interrupt its reading (`EINTR`), which is retried rather than failing the
    // listener, or leaving the rest of the message to be read as a message of its own.
    while interrupted_again(|| socket.get_rcvmore())? {
        let frame = interrupted_again(|| socket.recv_msg(0))?;
        count += 1;
        if frames.len() < MAX_KEPT_FRAMES {
            frames.push(frame);
        }
    }
    Ok(Some(Received { frames, count }))
}

/// Runs `op` again while it is interrupted (`EINTR`, or `EAGAIN`, which a frame after the first
/// should not see), at most [`INTERRUPTED_TRIES`] times.
fn interrupted_again<T>(mut op: impl FnMut() -> Result<T, zmq::Error>) -> Result<T, zmq::Error> {
    let mut tries = 1;
    loop {
        match op() {
            Err(zmq::Error::EINTR | zmq::Error::EAGAIN) if tries < INTERRUPTED_TRIES => {
                tries += 1;
            }
            done => return done,
        }
    }
}

/// How many times a frame after a message's first is read before an interruption fails it.
const INTERRUPTED_TRIES: u32 = 64;

impl Received {
    fn slices(&self) -> Vec<&[u8]> {
        self.frames.iter().map(|frame| &frame[..]).collect()
    }
}

/// One listener's sockets and state, driven by the poller thread it was given to: its sockets
/// registered with the poller's epoll ([`ListenerCore::attach`]), before each poll
/// ([`ListenerCore::before_poll`]: stop, release, its next deadline), what holds messages
/// ([`ListenerCore::ready_now`]), after the poll ([`ListenerCore::after_poll`]: read what is
/// ready, timeouts, probes).
///
/// Invariant: it lives on one thread at a time (ZMQ sockets are not thread-safe); it moves to
/// its poller thread through a channel (a full memory barrier, as libzmq requires).
pub(super) struct ListenerCore {
    context: zmq::Context,
    config: ListenerConfig,
    sub: zmq::Socket,
    /// The PAIR receiving the SUB's connection events, if it could be set up.
    monitor: Option<zmq::Socket>,
    /// The connection error this thread last reported in `last_error` (cleared on connect).
    connection_error: Option<String>,
    /// While held: the live batches received, oldest first (at most half the sequencer's
    /// buffer, [`held_bound`], in batches and in bytes; the oldest are dropped beyond it, and
    /// replayed after the release).
    held: Option<VecDeque<(u64, Payload)>>,
    /// The payload bytes in `held`.
    held_bytes: usize,
    replay: Option<ReplayState>,
    /// Probes of a quiet stream; `None` without a replay endpoint or with probing off.
    probe: Option<ProbeSchedule>,
    sequencer: Sequencer<Payload>,
    converter: Converter,
    /// Ranks this source has fed (each cleared on a resync), at most [`MAX_RANKS_PER_SOURCE`].
    ranks: BTreeSet<Worker>,
    /// Reused conversion buffer.
    mutations: Vec<Mutation>,
    /// Clears a resync decided, handed over with the batch that follows it (the same drive),
    /// so the unit carries the resync ([`Unit::resync`]) with the position it resumes from.
    pending_clears: Vec<Mutation>,
    /// When this thread took the message being handled off its socket (live or replay): the
    /// [`Unit::received`] of the units it leads to. `None` while held batches are released
    /// (their wait is the startup gate's, not the pipeline's) and after a replay timed out.
    taken: Option<Instant>,
    sink: Arc<dyn MutationSink>,
    shared: Arc<Shared>,
    /// Its registration with its poller's epoll (`None` until attached, and after detach).
    watch: Option<Watch>,
}

/// The most a held listener keeps, in batches and in payload bytes: half the sequencer's
/// buffer. Released, it asks for what came after the restored position (a catch-up) and puts
/// the held batches in the sequencer's buffer behind that hole until the answer fills it; held
/// up to the whole buffer, the first live batch read before the answer overflowed it, and the
/// resync cleared the worker's restored state. The other half is the room for the live batches
/// that come meanwhile.
fn held_bound(sequencer: &crate::sequence::SequencerConfig) -> (usize, usize) {
    (
        (sequencer.max_buffered / 2).max(1),
        sequencer.max_buffered_bytes / 2,
    )
}

/// The ranks a source resumed from `resume` has fed: its registered rank, and the further ranks
/// of its worker the resumed state names (at most [`MAX_RANKS_PER_SOURCE`] in all).
fn fed_ranks(source: Source, resume: Option<&Resume>) -> BTreeSet<Worker> {
    let own = Worker::new(source.worker_id, source.dp_rank);
    let mut ranks = BTreeSet::from([own]);
    let further = resume
        .into_iter()
        .flat_map(|resume| resume.ranks.iter().copied())
        .filter(|worker| worker.worker_id == source.worker_id);
    for worker in further {
        if ranks.len() >= MAX_RANKS_PER_SOURCE {
            break;
        }
        ranks.insert(worker);
    }
    ranks
}

impl ListenerCore {
    /// The listener's state for `config`'s source, owning `sub` and `monitor`: held if the config
    /// says so, the sequencer resumed from [`ListenerConfig::resume`] if set.
    pub(super) fn new(
        context: zmq::Context,
        config: ListenerConfig,
        sub: zmq::Socket,
        monitor: Option<zmq::Socket>,
        sink: Arc<dyn MutationSink>,
        shared: Arc<Shared>,
    ) -> Self {
        let source = config.source;
        let sequencer = match &config.resume {
            Some(resume) => {
                Sequencer::resume(config.options.sequencer, resume.position, &resume.recent)
            }
            None => Sequencer::new(config.options.sequencer),
        };
        Self {
            context,
            sub,
            monitor,
            connection_error: None,
            held: config.hold.then(VecDeque::new),
            held_bytes: 0,
            replay: None,
            probe: config
                .options
                .quiet_probe
                .filter(|_| config.replay_endpoint.is_some())
                .map(|interval| {
                    let retry = config.options.recv_timeout.min(interval);
                    ProbeSchedule::new(interval, retry, Instant::now())
                }),
            sequencer,
            converter: Converter::new(source),
            ranks: fed_ranks(source, config.resume.as_ref()),
            mutations: Vec::new(),
            pending_clears: Vec::new(),
            taken: None,
            sink,
            shared,
            config,
            watch: None,
        }
    }

    /// Records how the listener ended and removes its sockets from the poller's epoll (called
    /// by its poller just before dropping it).
    pub(super) fn finish(&mut self, exit: Exit) {
        self.detach();
        match exit {
            Exit::Stopped => self.shared.set_status(ListenerStatus::Stopped),
            Exit::Failed => self.shared.set_status(ListenerStatus::Failed),
        }
    }

    /// The listener's shared state (status, counters, stop flag).
    pub(super) fn shared(&self) -> &Shared {
        &self.shared
    }

    fn fail(&self, error: String) -> Exit {
        tracing::error!(
            target: "kvatlas_events::listener",
            worker_id = self.config.source.worker_id,
            dp_rank = self.config.source.dp_rank,
            "listener failed: {error}"
        );
        self.shared.set_error(error);
        Exit::Failed
    }

    /// After resuming a stream, asks the engine for what it published meanwhile (see
    /// [`Sequencer::catch_up`]); without a replay endpoint the next live batch shows any gap.
    fn catch_up(&mut self) -> Result<(), Exit> {
        if self.config.replay_endpoint.is_some() {
            self.sequencer.catch_up();
            self.drive()?;
        }
        Ok(())
    }

    /// Called once on the poller thread before the first poll: a listener resuming a stream
    /// (and not held) asks the engine for what it published meanwhile.
    pub(super) fn begin(&mut self) -> Result<(), Exit> {
        if self.held.is_none() && self.config.resume.is_some() {
            self.catch_up()?;
        }
        Ok(())
    }

    /// Before a poll: ends the listener if it was asked to stop, takes a pending release, and
    /// returns the latest instant by which [`ListenerCore::after_poll`] must run again (a
    /// replay's deadline, a due probe, or one [`ListenerOptions::recv_timeout`] from `now`).
    ///
    /// [`ListenerOptions::recv_timeout`]: super::ListenerOptions::recv_timeout
    pub(super) fn before_poll(&mut self, now: Instant) -> Result<Instant, Exit> {
        if self.shared.stopping() {
            return Err(Exit::Stopped);
        }
        if self.held.is_some() {
            let released = self.shared.release.lock().take();
            if let Some(resume) = released {
                self.release(resume)?;
            }
        }
        let recv_timeout = self.config.options.recv_timeout;
        Ok([self.sequencer.poll_timeout(), self.probe.map(|p| p.at)]
            .into_iter()
            .flatten()
            .fold(now + recv_timeout, Instant::min))
    }

    /// Registers its sockets' notification descriptors (`ZMQ_FD`) with its poller's epoll,
    /// under tokens `base + 0` (SUB), `+ 1` (monitor) and `+ 2` (a replay's DEALER, while one is
    /// outstanding).
    pub(super) fn attach(&mut self, registry: mio::Registry, base: usize) -> std::io::Result<()> {
        let watch = Watch { registry, base };
        watch.register(&self.sub, SUB_TOKEN)?;
        if let Some(monitor) = &self.monitor {
            watch.register(monitor, MONITOR_TOKEN)?;
        }
        self.watch = Some(watch);
        Ok(())
    }

    /// Removes its sockets from its poller's epoll (before they are closed, so a descriptor
    /// number reused later is not confused with them).
    pub(super) fn detach(&mut self) {
        if let Some(watch) = self.watch.take() {
            watch.deregister(&self.sub);
            if let Some(monitor) = &self.monitor {
                watch.deregister(monitor);
            }
            if let Some(replay) = &self.replay {
                watch.deregister(&replay.dealer);
            }
        }
    }

    /// Which of its sockets hold something to read now (`ZMQ_EVENTS`, which also processes the
    /// socket's pending commands and so re-arms its `ZMQ_FD`). An error on the SUB or the
    /// DEALER counts as readable: the read that follows meets it and ends the listener or the
    /// replay. The monitor's reads ignore errors, so an error there counts as nothing to read
    /// (the listener is not served again and again for it).
    ///
    /// Invariant the poller keeps: a listener is served again without waiting for an epoll
    /// event until this reports nothing readable, so a notification consumed by a read is
    /// never lost.
    pub(super) fn ready_now(&self) -> Ready {
        let readable = |socket: &zmq::Socket, on_error: bool| {
            socket
                .get_events()
                .map_or(on_error, |events| events.contains(zmq::POLLIN))
        };
        Ready {
            live: readable(&self.sub, true),
            monitor: self.monitor.as_ref().is_some_and(|m| readable(m, false)),
            replay: self
                .replay
                .as_ref()
                .is_some_and(|r| readable(&r.dealer, true)),
        }
    }

    /// After a poll: reads what `ready` shows (connection events, replay replies, live
    /// batches), then handles an expired replay and a due probe.
    pub(super) fn after_poll(&mut self, ready: Ready) -> Result<(), Exit> {
        if ready.monitor {
            self.read_monitor();
        }
        if ready.replay {
            self.read_replay()?;
        }
        if ready.live {
            self.read_live()?;
        }
        let now = Instant::now();
        if self.sequencer.handle_timeout(now).is_some() {
            let from = self.replay.as_ref().map_or(0, |replay| replay.from);
            self.replay_abandoned(format!("replay from {from} timed out"));
            // What this releases (buffered batches, the resync's clears) was not just taken
            // off a socket: not timed.
            self.taken = None;
            self.drive()?;
        }
        self.probe_if_quiet(now)
    }

    /// Probes the engine if the live stream has been quiet until the probe is due, or to see
    /// its ring once (see [`Sequencer::probe`]); never while held.
    fn probe_if_quiet(&mut self, now: Instant) -> Result<(), Exit> {
        // No probe has gone out yet: one is due as soon as the stream has a position and no
        // replay has shown the engine keeps a ring, busy stream or not. Until a ring is seen, an
        // engine that restarts and stays quiet cannot be told from one without a ring
        // ([`Sequencer::probe`]); a busy engine may otherwise never be probed before it restarts.
        let see_ring = self.sequencer.counters().probes == 0
            && !self.sequencer.ring_seen()
            && self.sequencer.has_position();
        let Some(schedule) = self.probe.as_mut().filter(|p| now >= p.at || see_ring) else {
            return Ok(());
        };
        let sent = self.held.is_none()
            && match schedule.anchor {
                Some(anchor) => self.sequencer.probe_from(anchor),
                None => self.sequencer.probe(),
            };
        schedule.after_probe(now, sent);
        if sent {
            self.taken = None;
            self.drive()?;
        }
        Ok(())
    }

    /// Leaves the held state: continue from `resume`, then apply what was buffered.
    fn release(&mut self, resume: Option<Resume>) -> Result<(), Exit> {
        let resumed = resume.is_some();
        if let Some(resume) = resume {
            // Nothing was applied while held: the ranks fed are the resumed state's (without
            // one, the sequencer and the ranks stay those the listener was started with).
            self.ranks = fed_ranks(self.config.source, Some(&resume));
            self.sequencer = Sequencer::resume(
                self.config.options.sequencer,
                resume.position,
                &resume.recent,
            );
            self.shared
                .last_seq
                .store(resume.position, Ordering::Release);
        }
        let held = self.held.take().unwrap_or_default();
        self.held_bytes = 0;
        self.taken = None;
        self.shared.set_status(if held.is_empty() {
            ListenerStatus::Pending
        } else {
            ListenerStatus::Active
        });
        if resumed {
            self.catch_up()?;
        }
        for (seq, payload) in held {
            self.sequencer.handle_live(seq, payload);
            self.drive()?;
        }
        Ok(())
    }

    /// Reads the SUB's connection events: a failed or lost connection is reported in
    /// `last_error` (and counted) until a connection is made again.
    fn read_monitor(&mut self) {
        let Some(monitor) = &self.monitor else {
            return;
        };
        while let Ok(Some(received)) = receive(monitor, zmq::DONTWAIT) {
            let (Some(head), Some(address)) = (received.frames.first(), received.frames.get(1))
            else {
                continue;
            };
            let Some(event) = head.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]])) else {
                continue;
            };
            let value = head
                .get(2..6)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let address = String::from_utf8_lossy(&address[..]);
            let counters = &self.shared.counters;
            let error = match zmq::SocketEvent::from_raw(event) {
                zmq::SocketEvent::HANDSHAKE_SUCCEEDED => {
                    // Without a position (a fresh listener) the first live batch shows what
                    // is missing; there is nothing to probe after.
                    if self.sequencer.has_position()
                        && let Some(probe) = &mut self.probe
                    {
                        probe.connected(Instant::now(), self.sequencer.last_applied());
                    }
                    None
                }
                zmq::SocketEvent::CONNECTED | zmq::SocketEvent::ACCEPTED => {
                    bump(&counters.connects);
                    if let Some(ours) = self.connection_error.take() {
                        let mut last = self.shared.last_error.lock();
                        if last.as_deref() == Some(ours.as_str()) {
                            *last = None;
                        }
                    }
                    None
                }
                zmq::SocketEvent::CONNECT_RETRIED => {
                    bump(&counters.connect_retries);
                    Some(format!(
                        "cannot reach the engine at {address}: the connection attempt failed \
                         (the engine may be down or the address wrong); retrying in {value} ms"
                    ))
                }
                zmq::SocketEvent::DISCONNECTED => {
                    bump(&counters.disconnects);
                    Some(format!(
                        "the engine at {address} closed the connection; reconnecting"
                    ))
                }
                zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL
                | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL
                | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH => Some(format!(
                    "the ZMQ handshake with {address} failed: is it an engine's ZMQ PUB?"
                )),
                _ => None,
            };
            if let Some(error) = error {
                self.shared.set_error(error.clone());
                self.connection_error = Some(error);
            }
        }
    }

    /// Reads up to `max_batches_per_wakeup` live messages without blocking.
    fn read_live(&mut self) -> Result<(), Exit> {
        for _ in 0..self.config.options.max_batches_per_wakeup {
            let received = match receive(&self.sub, zmq::DONTWAIT) {
                Ok(Some(received)) => received,
                Ok(None) => return Ok(()),
                Err(zmq::Error::ETERM) => return Err(Exit::Stopped),
                Err(error) => return Err(self.fail(format!("SUB receive: {error}"))),
            };
            let now = Instant::now();
            self.taken = Some(now);
            bump(&self.shared.counters.messages_received);
            let seq = if received.count == received.frames.len() {
                decode_live_message(&received.slices()).map(|m| m.seq)
            } else {
                Err(crate::frames::FrameError::FrameCount {
                    count: received.count,
                    expected: "3",
                })
            };
            match seq {
                Ok(seq) => {
                    bump(&self.shared.counters.batches_received);
                    let micros = self.shared.started.elapsed().as_micros();
                    self.shared.last_batch_micros.store(
                        u64::try_from(micros).unwrap_or(u64::MAX - 1) + 1,
                        Ordering::Relaxed,
                    );
                    let mut frames = received.frames;
                    let payload = Payload(frames.pop().unwrap_or_else(zmq::Message::new));
                    if let Some(held) = &mut self.held {
                        let (max_held, max_held_bytes) = held_bound(&self.config.options.sequencer);
                        let bytes = payload.as_ref().len();
                        while !held.is_empty()
                            && (held.len() >= max_held
                                || self.held_bytes.saturating_add(bytes) > max_held_bytes)
                        {
                            if let Some((_, dropped)) = held.pop_front() {
                                self.held_bytes -= dropped.as_ref().len();
                            }
                            bump(&self.shared.counters.held_dropped);
                        }
                        self.held_bytes += bytes;
                        held.push_back((seq, payload));
                        continue;
                    }
                    if let Some(probe) = &mut self.probe {
                        probe.live(now);
                    }
                    if self.shared.status() == ListenerStatus::Pending {
                        self.shared.set_status(ListenerStatus::Active);
                    }
                    self.sequencer.handle_live(seq, payload);
                    self.drive()?;
                }
                Err(error) => {
                    bump(&self.shared.counters.bad_frames);
                    self.shared.set_error(format!("live message: {error}"));
                }
            }
            if self.shared.stopping() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Reads up to `max_batches_per_wakeup` replay replies without blocking: a long replay
    /// does not keep the poller thread from the other listeners on it (this one stays marked
    /// and is served again after them, [`Self::ready_now`]).
    fn read_replay(&mut self) -> Result<(), Exit> {
        for _ in 0..self.config.options.max_batches_per_wakeup {
            let Some(replay) = &self.replay else {
                return Ok(());
            };
            let id = replay.id;
            let received = match receive(&replay.dealer, zmq::DONTWAIT) {
                Ok(Some(received)) => received,
                Ok(None) => return Ok(()),
                Err(error) => {
                    self.replay_failed(id, format!("replay receive: {error}"));
                    return self.drive();
                }
            };
            let now = Instant::now();
            self.taken = Some(now);
            self.sequencer
                .set_replay_deadline(id, now + self.config.options.replay_timeout);
            let reply = if received.count == received.frames.len() {
                decode_replay_reply(&received.slices()).map(|reply| match reply {
                    ReplayReply::Batch { seq, .. } => Some(seq),
                    ReplayReply::End => None,
                })
            } else {
                Err(crate::frames::FrameError::FrameCount {
                    count: received.count,
                    expected: "2, 3 or 4",
                })
            };
            match reply {
                Ok(Some(seq)) => {
                    let mut frames = received.frames;
                    let payload = Payload(frames.pop().unwrap_or_else(zmq::Message::new));
                    self.sequencer.handle_replay_batch(id, seq, payload);
                }
                Ok(None) => {
                    bump(&self.shared.counters.replays_completed);
                    self.drop_replay();
                    self.sequencer.handle_replay_end(id);
                }
                Err(error) => {
                    bump(&self.shared.counters.bad_frames);
                    self.shared.set_error(format!("replay reply: {error}"));
                }
            }
            self.drive()?;
            if self.shared.stopping() {
                return Ok(());
            }
        }
        Ok(())
    }

    fn replay_failed(&mut self, id: ReplayId, error: String) {
        self.replay_abandoned(error);
        self.sequencer.handle_replay_failed(id);
    }

    /// Counts and reports a failed replay and drops its request (the sequencer knows already,
    /// or is told by the caller).
    fn replay_abandoned(&mut self, error: String) {
        bump(&self.shared.counters.replays_failed);
        tracing::warn!(
            target: "kvatlas_events::listener",
            worker_id = self.config.source.worker_id,
            dp_rank = self.config.source.dp_rank,
            "{error}"
        );
        self.shared.set_error(error);
        self.drop_replay();
    }

    /// Drops the outstanding replay's DEALER (deregistered first).
    fn drop_replay(&mut self) {
        if let Some(replay) = self.replay.take()
            && let Some(watch) = &self.watch
        {
            watch.deregister(&replay.dealer);
        }
    }

    /// Performs the sequencer's actions until it has none.
    fn drive(&mut self) -> Result<(), Exit> {
        while let Some(action) = self.sequencer.poll_action() {
            match action {
                Action::Apply {
                    seq,
                    payload,
                    fingerprint,
                } => self.apply(seq, payload.as_ref(), fingerprint)?,
                Action::Replay { id, from, to } => self.start_replay(id, from, to),
                Action::Resync { reason } => self.resync(reason),
            }
        }
        // A resync with no batch after it (nothing buffered): its clears go alone.
        if !self.pending_clears.is_empty() {
            let mutations = std::mem::take(&mut self.pending_clears);
            self.push(Unit {
                worker_id: self.config.source.worker_id,
                mutations,
                checkpoint: None,
                resync: true,
                received: self.taken,
                published: None,
            })?;
        }
        // A replay the sequencer abandoned (buffer overflow, restart) is not waited for.
        if let Some(replay) = &self.replay
            && self
                .sequencer
                .outstanding_replay()
                .is_none_or(|(id, _, _)| id != replay.id)
        {
            self.drop_replay();
        }
        self.publish_sequence_counters();
        Ok(())
    }

    fn publish_sequence_counters(&self) {
        let s = self.sequencer.counters();
        let c = &self.shared.counters;
        let set = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        set(&c.duplicates, s.duplicates);
        set(&c.gaps, s.replays_requested - s.catch_ups - s.probes);
        set(&c.late_joins, s.late_joins);
        set(&c.catch_ups, s.catch_ups);
        set(&c.probes, s.probes);
        set(&c.resyncs, s.resyncs);
        set(&c.restarts, s.restarts);
        set(&c.replay_resyncs, s.replay_resyncs);
        set(&c.overflow_resyncs, s.overflow_resyncs);
        set(&c.batches_replayed, s.applied_from_replay);
    }

    fn start_replay(&mut self, id: ReplayId, from: u64, to: u64) {
        // A request the sequencer gave up on (a restart, an overflow inside its answer) still
        // has its socket: it leaves the poller's watch before the new one takes its place (a
        // socket dropped while watched stays in epoll until libzmq closes it, waking the
        // poller for nothing).
        self.drop_replay();
        tracing::debug!(
            target: "kvatlas_events::listener",
            worker_id = self.config.source.worker_id,
            dp_rank = self.config.source.dp_rank,
            "gap: replaying {from}..{to}"
        );
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            self.replay_failed(
                id,
                format!("gap {from}..{to} and no replay endpoint: resync"),
            );
            return;
        };
        let dealer = match self.open_dealer(&endpoint, from) {
            Ok(dealer) => dealer,
            Err(error) => {
                self.replay_failed(id, format!("replay request to {endpoint}: {error}"));
                return;
            }
        };
        if let Some(watch) = &self.watch
            && let Err(error) = watch.register(&dealer, REPLAY_TOKEN)
        {
            self.replay_failed(id, format!("cannot watch the replay socket: {error}"));
            return;
        }
        self.replay = Some(ReplayState { id, from, dealer });
        self.sequencer
            .set_replay_deadline(id, Instant::now() + self.config.options.replay_timeout);
    }

    fn open_dealer(&self, endpoint: &str, from: u64) -> Result<zmq::Socket, zmq::Error> {
        let options = &self.config.options;
        let dealer = self.context.socket(zmq::DEALER)?;
        dealer.set_linger(0)?;
        dealer.set_maxmsgsize(options.max_frame_bytes)?;
        dealer.set_reconnect_ivl(millis_i32(options.reconnect_interval, "").unwrap_or(100))?;
        // With ZMQ_IMMEDIATE off (the default) the request is queued until the connection is up;
        // the send timeout only guards against a full queue.
        dealer.set_sndtimeo(millis_i32(options.recv_timeout, "").unwrap_or(100))?;
        dealer.connect(endpoint)?;
        let start = replay_request(from);
        dealer.send_multipart([&b""[..], &start[..]], 0)?;
        Ok(dealer)
    }

    /// Decodes and converts a batch and hands it to the sink as one unit with its checkpoint.
    fn apply(&mut self, seq: u64, payload: &[u8], fingerprint: u64) -> Result<(), Exit> {
        let mut drops = DropCounters::new();
        self.mutations.clear();
        let mut published = None;
        match decode_batch(payload) {
            Ok(batch) => {
                if self.taken.is_some() {
                    published = batch.published_at(Instant::now(), std::time::SystemTime::now());
                }
                let worker = self.converter.worker_for(batch.dp_rank);
                if self.ranks.contains(&worker) || self.ranks.len() < MAX_RANKS_PER_SOURCE {
                    self.ranks.insert(worker);
                    self.converter
                        .convert_batch(&batch, &mut self.mutations, &mut drops);
                } else {
                    drops.record(Reason::TooManyDpRanks);
                    self.shared.set_error(format!(
                        "batch {seq} dropped: its dp rank {} would be a rank beyond the \
                         {MAX_RANKS_PER_SOURCE} this source already fed, the most one source \
                         may feed",
                        worker.dp_rank
                    ));
                }
            }
            Err(error) => {
                drops.record(error.reason());
                bump(&self.shared.counters.batch_decode_errors);
                self.shared.set_error(format!("batch {seq}: {error}"));
            }
        }
        self.shared.counters.add_drops(&drops);
        let source = self.config.source;
        let resync = !self.pending_clears.is_empty();
        let mutations = if resync {
            let mut mutations = std::mem::take(&mut self.pending_clears);
            mutations.append(&mut self.mutations);
            mutations
        } else {
            std::mem::take(&mut self.mutations)
        };
        let unit = Unit {
            worker_id: source.worker_id,
            mutations,
            resync,
            // Recorded even for a batch without mutations: the stream has moved past it.
            checkpoint: Some(Checkpoint {
                source: Worker::new(source.worker_id, source.dp_rank),
                position: seq,
                fingerprint,
            }),
            received: self.taken,
            published,
        };
        self.push(unit)?;
        bump(&self.shared.counters.batches_applied);
        self.shared.last_seq.store(seq, Ordering::Release);
        Ok(())
    }

    fn resync(&mut self, reason: ResyncReason) {
        let source = self.config.source;
        tracing::warn!(
            target: "kvatlas_events::listener",
            worker_id = source.worker_id,
            dp_rank = source.dp_rank,
            ?reason,
            "resync: clearing the worker's blocks and rebuilding from live events"
        );
        self.shared.set_error(format!(
            "resync ({reason:?}) of worker {} rank {}",
            source.worker_id, source.dp_rank
        ));
        if reason == ResyncReason::Restart {
            self.shared.last_seq.store(u64::MAX, Ordering::Release);
        }
        // The registered rank first (it is always among the ranks): a unit of clears alone is
        // then filed under the source's own rank (the event log names a unit's source by it).
        let own = Worker::new(source.worker_id, source.dp_rank);
        let mutations: Vec<Mutation> = std::iter::once(own)
            .chain(self.ranks.iter().copied().filter(|&worker| worker != own))
            .map(|worker| Mutation::Cleared { worker })
            .collect();
        let clears = mutations.len() as u64;
        // Handed over with the next batch, or alone at the end of this drive.
        self.pending_clears.extend(mutations);
        self.shared
            .counters
            .resync_clears
            .fetch_add(clears, Ordering::Relaxed);
    }

    /// Hands one unit to the sink, waiting (with a short backoff, checking for stop) while it
    /// is full.
    fn push(&mut self, unit: Unit) -> Result<(), Exit> {
        let counters = &self.shared.counters;
        let mut unit = unit;
        let mut waiting_since = None;
        let mut backoff = Duration::from_micros(20);
        loop {
            let mutations = unit.mutations.len() as u64;
            match self.sink.try_push(unit) {
                Ok(()) => {
                    counters
                        .mutations_enqueued
                        .fetch_add(mutations, Ordering::Relaxed);
                    if let Some(since) = waiting_since {
                        let waited = Instant::now().saturating_duration_since(since);
                        counters.backpressure_micros.fetch_add(
                            u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
                            Ordering::Relaxed,
                        );
                    }
                    return Ok(());
                }
                Err(SinkError::Full(back)) => {
                    if waiting_since.is_none() {
                        waiting_since = Some(Instant::now());
                        bump(&counters.backpressure_waits);
                    }
                    if self.shared.stopping() {
                        counters
                            .mutations_abandoned
                            .fetch_add(back.mutations.len() as u64, Ordering::Relaxed);
                        return Err(Exit::Stopped);
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(1));
                    unit = back;
                }
                Err(SinkError::Closed(back)) => {
                    counters
                        .mutations_abandoned
                        .fetch_add(back.mutations.len() as u64, Ordering::Relaxed);
                    return Err(self.fail("the mutation sink is closed".to_owned()));
                }
            }
        }
    }
}
