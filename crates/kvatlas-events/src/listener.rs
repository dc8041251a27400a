//! The socket edge: ZMQ listeners that feed the sans-IO core and hand mutations to an index.
//!
//! This is the only module of the crate that performs I/O (sockets, threads, clocks). One
//! [`Listener`] serves one registered source (one engine publisher: a worker's data-parallel
//! rank) on its own thread:
//!
//! ```text
//!  engine PUB ──► SUB (connect, or bind) ──frames──► Sequencer ──Apply──► decode + convert
//!  engine ROUTER ◄──► DEALER (one per replay) ──┘         │ Resync → Mutation::Cleared
//!                                                        ▼
//!              MutationSink::try_push(Unit: a batch's mutations + its checkpoint)
//!                                     (bounded; full → wait = backpressure)
//! ```
//!
//! - **One thread per source** polls its SUB (and, while a replay is outstanding, its DEALER)
//!   with a bounded timeout ([`ListenerOptions::recv_timeout`]), so [`Listener::stop`] always
//!   returns within about one timeout.
//! - **Replay**: an [`Action::Replay`] opens a fresh DEALER to the replay endpoint, sends
//!   `[b"", start_be8]` and feeds every reply (2-, 3- or 4-frame layouts) to the sequencer until
//!   the end marker. No reply for [`ListenerOptions::replay_timeout`] (the loop gives the
//!   sequencer each request's deadline, sleeps until [`Sequencer::poll_timeout`] at the latest
//!   and reports the time with [`Sequencer::handle_timeout`]), a socket error, or no replay
//!   endpoint at all → the replay fails → resync. Live batches keep arriving meanwhile and are
//!   buffered by the sequencer (bounded).
//! - **Resync** ([`Action::Resync`]) → a [`Mutation::Cleared`] for every rank the source has fed,
//!   counted and logged (`tracing`, target `kvatlas_events::listener`).
//! - **Units and checkpoints**: each applied batch goes to the sink as one [`Unit`] — its
//!   mutations and a [`Checkpoint`] (the source's rank, the batch's sequence number and
//!   fingerprint) — so an index that records checkpoints pairs its snapshots exactly with the
//!   batches they hold.
//! - **Resume and hold**: a listener can continue a stream applied elsewhere
//!   ([`ListenerConfig::resume`]: a restored snapshot's checkpoint), and can start *held*
//!   ([`ListenerConfig::hold`]): it receives and buffers live batches (bounded) but applies nothing
//!   until [`Listener::release`] gives it the position to continue from — how a new replica
//!   subscribes first, restores a peer's snapshot, then applies exactly what follows it.
//! - **Backpressure**: mutations go to a [`MutationSink`] (for example a
//!   [`kvatlas_index::ThreadPool`], whose lanes are bounded). A full lane makes the listener
//!   wait (counted in [`ListenerCounters::backpressure_waits`]); it stops reading its socket,
//!   the SUB's receive high-water mark fills and libzmq drops live messages, which the sequencer
//!   sees as a gap: replay, and if the engine's ring no longer holds the batches, a counted
//!   resync. Memory never grows without bound.
//!
//! [`Listeners`] is the registry a server drives: start, stop, state, list.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvatlas_index::{Checkpoint, EnqueueError, Mutation, SharedKvIndex, ThreadPool, Unit, Worker};
use parking_lot::Mutex;

use crate::convert::{Converter, Source};
use crate::counters::{DropCounters, Reason};
use crate::decode::decode_batch;
use crate::frames::{ReplayReply, decode_live_message, decode_replay_reply, replay_request};
use crate::sequence::{Action, ReplayId, ResyncReason, Sequencer, SequencerConfig};

/// At most this many frames of one message are kept (the longest valid layout has 4); further
/// frames are received and discarded, so a hostile peer cannot make a message grow unbounded.
const MAX_KEPT_FRAMES: usize = 4;

/// At most this many distinct ranks are remembered per source for resync clears (a source is
/// one engine rank; batches normally all carry the same rank).
const MAX_TRACKED_RANKS: usize = 64;

// ---------------------------------------------------------------------------------------------
// Sink
// ---------------------------------------------------------------------------------------------

/// Why a [`MutationSink`] did not take a unit; the unit is handed back.
#[derive(Debug)]
pub enum SinkError {
    /// The sink is full right now (the index is not keeping up): try again later.
    Full(Unit),
    /// The sink is gone for good (its writer threads stopped).
    Closed(Unit),
}

/// Where a listener hands its mutations: a bounded, per-worker-ordered queue in front of an
/// index.
///
/// Contract: units of one worker pushed by one thread are applied in push order, each whole
/// ([`ThreadPool`]'s sticky lanes guarantee it). `try_push` never blocks; the listener waits
/// and retries on [`SinkError::Full`], which is how backpressure reaches the socket.
pub trait MutationSink: Send + Sync {
    /// Hands over one unit (a batch's mutations and its checkpoint) if there is room.
    ///
    /// # Errors
    /// [`SinkError::Full`] to be retried later, [`SinkError::Closed`] for good.
    fn try_push(&self, unit: Unit) -> Result<(), SinkError>;
}

impl<I: SharedKvIndex + 'static> MutationSink for ThreadPool<I> {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        self.try_enqueue_unit(unit).map_err(|error| match error {
            EnqueueError::Full(u) => SinkError::Full(u),
            EnqueueError::Stopped(u) => SinkError::Closed(u),
        })
    }
}

impl<S: MutationSink + ?Sized> MutationSink for Arc<S> {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        (**self).try_push(unit)
    }
}

/// A sink that applies each unit inline, on the listener's thread, to a shared index (never
/// full). Simple, and the listener's own thread pays for the index writes.
#[derive(Debug)]
pub struct ApplyInline<I>(pub Arc<I>);

impl<I: SharedKvIndex> MutationSink for ApplyInline<I> {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        let mut mutations = unit.mutations;
        let mut checkpoints: Vec<Checkpoint> = unit.checkpoint.into_iter().collect();
        self.0.apply_checkpointed(&mut mutations, &mut checkpoints);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// Whether the listener's SUB connects to the engine or binds for engines that connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum SocketMode {
    /// Connect to an engine's bound PUB (vLLM's default `tcp://*:5557`); reconnects forever.
    #[default]
    Connect,
    /// Bind, for engines configured with a connect endpoint (llm-d's centralized mode).
    Bind,
}

/// Tuning of a listener's sockets and timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerOptions {
    /// The longest the listener thread waits on its sockets before checking for stop (and the
    /// bound on how long [`Listener::stop`] takes). Default 100 ms.
    pub recv_timeout: Duration,
    /// A replay fails when no reply arrives for this long (per reply, not in total). Default 2 s.
    pub replay_timeout: Duration,
    /// First reconnection delay of the SUB and DEALER (`ZMQ_RECONNECT_IVL`). Default 100 ms.
    pub reconnect_interval: Duration,
    /// Maximum reconnection delay (`ZMQ_RECONNECT_IVL_MAX`, exponential backoff). Default 5 s.
    pub reconnect_interval_max: Duration,
    /// The SUB's receive high-water mark in messages (`ZMQ_RCVHWM`): how much libzmq buffers
    /// while the listener is backpressured before dropping (→ gap → replay). Default 10 000.
    pub receive_hwm: i32,
    /// Largest accepted frame in bytes (`ZMQ_MAXMSGSIZE`; a larger one drops the connection).
    /// Default 64 MiB.
    pub max_frame_bytes: i64,
    /// Live messages read per wake-up before checking replay replies and stop. Default 256.
    pub max_batches_per_wakeup: usize,
    /// The sequencer's buffer and duplicate window.
    pub sequencer: SequencerConfig,
}

impl Default for ListenerOptions {
    fn default() -> Self {
        Self {
            recv_timeout: Duration::from_millis(100),
            replay_timeout: Duration::from_secs(2),
            reconnect_interval: Duration::from_millis(100),
            reconnect_interval_max: Duration::from_secs(5),
            receive_hwm: 10_000,
            max_frame_bytes: 64 << 20,
            max_batches_per_wakeup: 256,
            sequencer: SequencerConfig::default(),
        }
    }
}

/// Everything needed to start a listener for one source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerConfig {
    /// The registered source: worker id, data-parallel rank, block size, engine kind.
    pub source: Source,
    /// The engine's PUB endpoint (connect mode) or the endpoint to bind (bind mode), e.g.
    /// `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint; without it every gap resyncs.
    pub replay_endpoint: Option<String>,
    /// The SUB's topic prefix filter (empty = everything, vLLM's default topic is empty).
    pub topic: Vec<u8>,
    /// Connect (default) or bind.
    pub mode: SocketMode,
    /// Timeouts, buffers and limits.
    pub options: ListenerOptions,
    /// Continue a stream applied elsewhere up to this position (see [`Resume`]); `None` starts
    /// fresh.
    pub resume: Option<Resume>,
    /// Start held: buffer live batches, apply nothing until [`Listener::release`].
    pub hold: bool,
}

/// Where a listener continues a stream applied elsewhere: the checkpoint of a restored snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resume {
    /// The sequence number of the last batch applied.
    pub position: u64,
    /// `(seq, fingerprint)` of the last batches applied, oldest first (to tell a batch already
    /// applied from a restarted engine's new one; see [`Sequencer::resume`]).
    pub recent: Vec<(u64, u64)>,
}

impl ListenerConfig {
    /// A connect-mode config without replay endpoint or topic filter, with default options.
    pub fn new(source: Source, endpoint: impl Into<String>) -> Self {
        Self {
            source,
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: Vec::new(),
            mode: SocketMode::Connect,
            options: ListenerOptions::default(),
            resume: None,
            hold: false,
        }
    }

    /// Sets the replay endpoint.
    pub fn with_replay_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// Sets the topic prefix filter.
    pub fn with_topic(mut self, topic: impl Into<Vec<u8>>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Sets the socket mode.
    pub fn with_mode(mut self, mode: SocketMode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets the options.
    pub fn with_options(mut self, options: ListenerOptions) -> Self {
        self.options = options;
        self
    }

    /// Continues a stream applied elsewhere (see [`Resume`]).
    pub fn with_resume(mut self, resume: Option<Resume>) -> Self {
        self.resume = resume;
        self
    }

    /// Starts held (see [`ListenerConfig::hold`]).
    pub fn held(mut self) -> Self {
        self.hold = true;
        self
    }
}

// ---------------------------------------------------------------------------------------------
// Errors and state
// ---------------------------------------------------------------------------------------------

/// Why a listener could not be started, stopped or found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ListenerError {
    /// The endpoint was rejected by libzmq (bad syntax, unknown transport, unresolvable
    /// interface, address in use when binding).
    #[error("endpoint {endpoint:?} rejected: {source}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// libzmq's error.
        #[source]
        source: zmq::Error,
    },
    /// Creating or configuring a socket failed.
    #[error("socket setup ({what}) failed: {source}")]
    Socket {
        /// The failing step.
        what: &'static str,
        /// libzmq's error.
        #[source]
        source: zmq::Error,
    },
    /// An option is out of range.
    #[error("invalid option {name}: {reason}")]
    InvalidOption {
        /// The option.
        name: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// Another running listener already feeds this worker rank (two writers would interleave
    /// its mutations).
    #[error("listener {existing} already serves worker {worker_id} rank {dp_rank}")]
    DuplicateSource {
        /// The worker.
        worker_id: u64,
        /// The rank.
        dp_rank: u32,
        /// The listener serving it.
        existing: ListenerId,
    },
    /// No listener with this id.
    #[error("no listener {0}")]
    UnknownListener(ListenerId),
    /// The OS refused to start the listener thread.
    #[error("cannot start the listener thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// Identifies a listener in a [`Listeners`] registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListenerId(u64);

impl ListenerId {
    /// The raw id.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ListenerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Where a listener is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListenerStatus {
    /// Sockets are set up; no valid live batch has arrived yet (the engine may not be up).
    Pending,
    /// At least one valid live batch has arrived.
    Active,
    /// The listener thread hit a fatal error and exited (see `last_error`).
    Failed,
    /// The listener was stopped.
    Stopped,
    /// Started held: live batches are buffered, nothing is applied until it is released.
    Held,
}

impl ListenerStatus {
    const fn as_u8(self) -> u8 {
        match self {
            ListenerStatus::Pending => 0,
            ListenerStatus::Active => 1,
            ListenerStatus::Failed => 2,
            ListenerStatus::Stopped => 3,
            ListenerStatus::Held => 4,
        }
    }

    const fn from_u8(v: u8) -> Self {
        match v {
            0 => ListenerStatus::Pending,
            1 => ListenerStatus::Active,
            2 => ListenerStatus::Failed,
            4 => ListenerStatus::Held,
            _ => ListenerStatus::Stopped,
        }
    }

    /// A lower-case label (`pending`, `active`, `failed`, `stopped`).
    pub const fn as_str(self) -> &'static str {
        match self {
            ListenerStatus::Pending => "pending",
            ListenerStatus::Active => "active",
            ListenerStatus::Failed => "failed",
            ListenerStatus::Stopped => "stopped",
            ListenerStatus::Held => "held",
        }
    }
}

impl fmt::Display for ListenerStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot of one listener's counters (monotonic since start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ListenerCounters {
    /// Messages read from the SUB (valid or not).
    pub messages_received: u64,
    /// Live messages with valid frames (`[topic, seq, payload]`).
    pub batches_received: u64,
    /// Messages (live or replay replies) rejected by the framing rules: wrong frame count,
    /// sequence frame not 8 bytes, end marker with a payload.
    pub bad_frames: u64,
    /// Batches applied in sequence order (decoded, converted, handed to the sink), including
    /// those that failed to decode (they count under `drops`).
    pub batches_applied: u64,
    /// Of the applied batches, those that came from a replay.
    pub batches_replayed: u64,
    /// Applied batches whose payload failed to decode (also in `drops` by reason).
    pub batch_decode_errors: u64,
    /// Batches dropped as duplicates.
    pub duplicates: u64,
    /// Gaps seen: replays requested (late joins included).
    pub gaps: u64,
    /// Of those, requested because the first live batch was not 0.
    pub late_joins: u64,
    /// Catch-up replays after resuming a stream (not gaps: asked without waiting for a live
    /// batch, in case the engine published while this consumer was away).
    pub catch_ups: u64,
    /// Replays that ended with the end marker.
    pub replays_completed: u64,
    /// Replays that failed: no replay endpoint, timeout, socket error.
    pub replays_failed: u64,
    /// Resyncs for any reason.
    pub resyncs: u64,
    /// Of those, engine restarts.
    pub restarts: u64,
    /// Of those, incomplete or failed replays.
    pub replay_resyncs: u64,
    /// Of those, live-buffer overflows during a replay.
    pub overflow_resyncs: u64,
    /// Mutations handed to the sink (resync clears included).
    pub mutations_enqueued: u64,
    /// `Cleared` mutations issued by resyncs.
    pub resync_clears: u64,
    /// Times the sink was full and the listener had to wait (backpressure episodes).
    pub backpressure_waits: u64,
    /// Total time spent waiting on a full sink, in microseconds.
    pub backpressure_micros: u64,
    /// Mutations abandoned because the listener was stopped while waiting on a full sink.
    pub mutations_abandoned: u64,
    /// Live batches dropped from a held listener's full buffer (replayed after its release).
    pub held_dropped: u64,
    /// Connections to the engine made (connect mode) or accepted (bind mode).
    pub connects: u64,
    /// Failed connection attempts, retried (the engine down or unreachable).
    pub connect_retries: u64,
    /// Connections the engine closed.
    pub disconnects: u64,
    /// Events and batches dropped, by reason (decode and conversion).
    pub drops: DropCounters,
}

/// What a listener is doing, as seen from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerState {
    /// The listener's id in its registry (0 for a listener started outside one).
    pub id: ListenerId,
    /// The registered source.
    pub source: Source,
    /// The SUB endpoint; in bind mode, the address actually bound (a `*` port resolved).
    pub endpoint: String,
    /// Pending, active, failed or stopped.
    pub status: ListenerStatus,
    /// The most recent error (fatal or not): a bad frame, a decode error, a replay failure, a
    /// resync.
    pub last_error: Option<String>,
    /// The counters.
    pub counters: ListenerCounters,
    /// The sequence number of the last applied batch (`None` before the first, and right after
    /// an engine restart until the new incarnation's first batch is applied).
    pub last_seq: Option<u64>,
    /// Time since the last valid live message (`None` before the first). libzmq reconnects
    /// silently, so a growing value is the sign of a dead or unreachable engine.
    pub since_last_batch: Option<Duration>,
}

/// The atomics behind [`ListenerCounters`].
#[derive(Debug, Default)]
struct SharedCounters {
    messages_received: AtomicU64,
    batches_received: AtomicU64,
    bad_frames: AtomicU64,
    batches_applied: AtomicU64,
    batches_replayed: AtomicU64,
    batch_decode_errors: AtomicU64,
    duplicates: AtomicU64,
    gaps: AtomicU64,
    late_joins: AtomicU64,
    catch_ups: AtomicU64,
    replays_completed: AtomicU64,
    replays_failed: AtomicU64,
    resyncs: AtomicU64,
    restarts: AtomicU64,
    replay_resyncs: AtomicU64,
    overflow_resyncs: AtomicU64,
    mutations_enqueued: AtomicU64,
    resync_clears: AtomicU64,
    backpressure_waits: AtomicU64,
    backpressure_micros: AtomicU64,
    mutations_abandoned: AtomicU64,
    held_dropped: AtomicU64,
    connects: AtomicU64,
    connect_retries: AtomicU64,
    disconnects: AtomicU64,
    drops: [AtomicU64; Reason::COUNT],
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl SharedCounters {
    fn snapshot(&self) -> ListenerCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut drops = DropCounters::new();
        for reason in Reason::ALL {
            if let Some(c) = self.drops.get(reason.index()) {
                drops.add(reason, get(c));
            }
        }
        ListenerCounters {
            messages_received: get(&self.messages_received),
            batches_received: get(&self.batches_received),
            bad_frames: get(&self.bad_frames),
            batches_applied: get(&self.batches_applied),
            batches_replayed: get(&self.batches_replayed),
            batch_decode_errors: get(&self.batch_decode_errors),
            duplicates: get(&self.duplicates),
            gaps: get(&self.gaps),
            late_joins: get(&self.late_joins),
            catch_ups: get(&self.catch_ups),
            replays_completed: get(&self.replays_completed),
            replays_failed: get(&self.replays_failed),
            resyncs: get(&self.resyncs),
            restarts: get(&self.restarts),
            replay_resyncs: get(&self.replay_resyncs),
            overflow_resyncs: get(&self.overflow_resyncs),
            mutations_enqueued: get(&self.mutations_enqueued),
            resync_clears: get(&self.resync_clears),
            backpressure_waits: get(&self.backpressure_waits),
            backpressure_micros: get(&self.backpressure_micros),
            mutations_abandoned: get(&self.mutations_abandoned),
            held_dropped: get(&self.held_dropped),
            connects: get(&self.connects),
            connect_retries: get(&self.connect_retries),
            disconnects: get(&self.disconnects),
            drops,
        }
    }

    fn add_drops(&self, drops: &DropCounters) {
        for (reason, n) in drops.iter() {
            if let Some(c) = self.drops.get(reason.index()) {
                c.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

/// State shared between a listener's thread and its handle.
#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    status: AtomicU8,
    /// `u64::MAX` = none.
    last_seq: AtomicU64,
    /// When the thread started; `last_batch_micros` counts from it.
    started: Instant,
    /// Microseconds from `started` to the last valid live message, plus one (0 = none yet).
    last_batch_micros: AtomicU64,
    last_error: Mutex<Option<String>>,
    counters: SharedCounters,
    /// Set by [`Listener::release`]: the position a held listener continues from.
    release: Mutex<Option<Option<Resume>>>,
}

impl Shared {
    fn set_status(&self, status: ListenerStatus) {
        self.status.store(status.as_u8(), Ordering::Release);
    }

    fn status(&self) -> ListenerStatus {
        ListenerStatus::from_u8(self.status.load(Ordering::Acquire))
    }

    fn set_error(&self, error: String) {
        *self.last_error.lock() = Some(error);
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

// ---------------------------------------------------------------------------------------------
// Listener
// ---------------------------------------------------------------------------------------------

/// One running listener: a thread with a ZMQ SUB (and a DEALER during replays) for one source.
///
/// Dropping it stops it (see [`Listener::stop`]).
#[derive(Debug)]
pub struct Listener {
    id: ListenerId,
    source: Source,
    endpoint: String,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Sets up the SUB (and checks the replay endpoint) on the caller's thread, so that a bad
    /// endpoint is reported here, then starts the listener thread.
    ///
    /// # Errors
    /// [`ListenerError::Endpoint`] for an endpoint libzmq rejects, [`ListenerError::Socket`]
    /// if a socket cannot be configured, [`ListenerError::InvalidOption`] for an out-of-range
    /// option, [`ListenerError::Spawn`] if the thread cannot start.
    pub fn start(
        context: &zmq::Context,
        config: ListenerConfig,
        sink: Arc<dyn MutationSink>,
    ) -> Result<Self, ListenerError> {
        Self::start_with_id(context, ListenerId(0), config, sink)
    }

    fn start_with_id(
        context: &zmq::Context,
        id: ListenerId,
        config: ListenerConfig,
        sink: Arc<dyn MutationSink>,
    ) -> Result<Self, ListenerError> {
        let options = &config.options;
        let recv_timeout = millis_i32(options.recv_timeout, "recv_timeout")?;
        millis_i32(options.replay_timeout, "replay_timeout")?;
        let reconnect = millis_i32(options.reconnect_interval, "reconnect_interval")?;
        let reconnect_max = millis_i32(options.reconnect_interval_max, "reconnect_interval_max")?;
        if recv_timeout == 0 {
            return Err(ListenerError::InvalidOption {
                name: "recv_timeout",
                reason: "must be at least 1 ms",
            });
        }
        if options.receive_hwm < 0 {
            return Err(ListenerError::InvalidOption {
                name: "receive_hwm",
                reason: "must not be negative",
            });
        }
        if options.max_frame_bytes < 1 {
            return Err(ListenerError::InvalidOption {
                name: "max_frame_bytes",
                reason: "must be positive",
            });
        }
        if options.max_batches_per_wakeup == 0 {
            return Err(ListenerError::InvalidOption {
                name: "max_batches_per_wakeup",
                reason: "must be at least 1",
            });
        }

        let socket = |what| move |source| ListenerError::Socket { what, source };
        let sub = context.socket(zmq::SUB).map_err(socket("create SUB"))?;
        sub.set_linger(0).map_err(socket("ZMQ_LINGER"))?;
        sub.set_rcvtimeo(recv_timeout)
            .map_err(socket("ZMQ_RCVTIMEO"))?;
        sub.set_rcvhwm(options.receive_hwm)
            .map_err(socket("ZMQ_RCVHWM"))?;
        sub.set_maxmsgsize(options.max_frame_bytes)
            .map_err(socket("ZMQ_MAXMSGSIZE"))?;
        sub.set_reconnect_ivl(reconnect)
            .map_err(socket("ZMQ_RECONNECT_IVL"))?;
        sub.set_reconnect_ivl_max(reconnect_max)
            .map_err(socket("ZMQ_RECONNECT_IVL_MAX"))?;
        sub.set_subscribe(&config.topic)
            .map_err(socket("ZMQ_SUBSCRIBE"))?;
        let endpoint_error = |endpoint: &str| {
            let endpoint = endpoint.to_owned();
            move |source| ListenerError::Endpoint { endpoint, source }
        };
        // Connection events (refused, retried, connected, disconnected) for `last_error`; a
        // listener without them still works, so a failure here is only logged.
        let monitor = match monitor_socket(context, &sub) {
            Ok(monitor) => Some(monitor),
            Err(error) => {
                tracing::warn!(
                    target: "kvatlas_events::listener",
                    "no connection monitor for {}: {error}",
                    config.endpoint
                );
                None
            }
        };
        let endpoint = match config.mode {
            SocketMode::Connect => {
                sub.connect(&config.endpoint)
                    .map_err(endpoint_error(&config.endpoint))?;
                config.endpoint.clone()
            }
            SocketMode::Bind => {
                sub.bind(&config.endpoint)
                    .map_err(endpoint_error(&config.endpoint))?;
                match sub.get_last_endpoint() {
                    Ok(Ok(bound)) => bound,
                    _ => config.endpoint.clone(),
                }
            }
        };
        if let Some(replay) = &config.replay_endpoint {
            // Validate now; each replay uses a fresh DEALER.
            let probe = context
                .socket(zmq::DEALER)
                .map_err(socket("create DEALER"))?;
            probe.set_linger(0).map_err(socket("ZMQ_LINGER"))?;
            probe.connect(replay).map_err(endpoint_error(replay))?;
        }

        let initial = if config.hold {
            ListenerStatus::Held
        } else {
            ListenerStatus::Pending
        };
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            status: AtomicU8::new(initial.as_u8()),
            last_seq: AtomicU64::new(config.resume.as_ref().map_or(u64::MAX, |r| r.position)),
            started: Instant::now(),
            last_batch_micros: AtomicU64::new(0),
            last_error: Mutex::new(None),
            counters: SharedCounters::default(),
            release: Mutex::new(None),
        });
        let source = config.source;
        let sequencer = match &config.resume {
            Some(resume) => {
                Sequencer::resume(config.options.sequencer, resume.position, &resume.recent)
            }
            None => Sequencer::new(config.options.sequencer),
        };
        let mut worker = ListenerThread {
            context: context.clone(),
            sub,
            monitor,
            connection_error: None,
            held: config.hold.then(VecDeque::new),
            replay: None,
            sequencer,
            converter: Converter::new(source),
            ranks: BTreeSet::from([Worker::new(source.worker_id, source.dp_rank)]),
            mutations: Vec::new(),
            pending_clears: Vec::new(),
            sink,
            shared: Arc::clone(&shared),
            config,
        };
        let thread = std::thread::Builder::new()
            .name(format!(
                "kvatlas-listen-{}-{}",
                source.worker_id, source.dp_rank
            ))
            .spawn(move || worker.run())
            .map_err(ListenerError::Spawn)?;
        Ok(Self {
            id,
            source,
            endpoint,
            shared,
            thread: Some(thread),
        })
    }

    /// The listener's id (0 outside a registry).
    pub fn id(&self) -> ListenerId {
        self.id
    }

    /// The registered source.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The SUB endpoint (in bind mode, the address actually bound).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Releases a listener started held ([`ListenerConfig::hold`]): it continues from `resume`
    /// (the checkpoint of the snapshot restored meanwhile) or from scratch, then applies the live
    /// batches it buffered — those the snapshot already holds are dropped as duplicates, a hole
    /// before them is replayed. Takes effect within one receive timeout; a listener not held
    /// ignores it.
    pub fn release(&self, resume: Option<Resume>) {
        *self.shared.release.lock() = Some(resume);
    }

    /// The current state.
    pub fn state(&self) -> ListenerState {
        let last_seq = self.shared.last_seq.load(Ordering::Acquire);
        let last_batch = self.shared.last_batch_micros.load(Ordering::Relaxed);
        let since_last_batch = (last_batch > 0).then(|| {
            self.shared
                .started
                .elapsed()
                .saturating_sub(Duration::from_micros(last_batch - 1))
        });
        ListenerState {
            id: self.id,
            source: self.source,
            endpoint: self.endpoint.clone(),
            status: self.shared.status(),
            last_error: self.shared.last_error.lock().clone(),
            counters: self.shared.counters.snapshot(),
            last_seq: (last_seq != u64::MAX).then_some(last_seq),
            since_last_batch,
        }
    }

    /// Stops the thread and waits for it (at most about one
    /// [`ListenerOptions::recv_timeout`], plus the mutation being converted); returns the final
    /// state. The index keeps the source's blocks.
    pub fn stop(mut self) -> ListenerState {
        self.shutdown();
        self.state()
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                self.shared
                    .set_error("the listener thread panicked".to_owned());
                self.shared.set_status(ListenerStatus::Failed);
            } else if self.shared.status() != ListenerStatus::Failed {
                self.shared.set_status(ListenerStatus::Stopped);
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Monitors `sub`'s connection events on a fresh inproc endpoint; returns the PAIR that
/// receives them.
fn monitor_socket(context: &zmq::Context, sub: &zmq::Socket) -> Result<zmq::Socket, zmq::Error> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let endpoint = format!(
        "inproc://kvatlas-listener-monitor-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let events = [
        zmq::SocketEvent::CONNECTED,
        zmq::SocketEvent::ACCEPTED,
        zmq::SocketEvent::CONNECT_RETRIED,
        zmq::SocketEvent::DISCONNECTED,
        zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL,
        zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL,
        zmq::SocketEvent::HANDSHAKE_FAILED_AUTH,
    ]
    .iter()
    .fold(0, |mask, event| mask | (*event as i32));
    sub.monitor(&endpoint, events)?;
    let pair = context.socket(zmq::PAIR)?;
    pair.set_linger(0)?;
    pair.connect(&endpoint)?;
    Ok(pair)
}

fn millis_i32(d: Duration, name: &'static str) -> Result<i32, ListenerError> {
    i32::try_from(d.as_millis()).map_err(|_| ListenerError::InvalidOption {
        name,
        reason: "longer than i32::MAX milliseconds",
    })
}

/// A fatal condition that ends the listener thread.
#[derive(Debug)]
enum Exit {
    /// Asked to stop.
    Stopped,
    /// A fatal error (already recorded).
    Failed,
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
struct Received {
    frames: Vec<Vec<u8>>,
    count: usize,
}

/// Receives one whole multipart message, keeping at most [`MAX_KEPT_FRAMES`] frames.
/// `Ok(None)` when nothing is ready (`EAGAIN`).
fn receive(socket: &zmq::Socket, flags: i32) -> Result<Option<Received>, zmq::Error> {
    let first = match socket.recv_bytes(flags) {
        Ok(frame) => frame,
        Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => return Ok(None),
        Err(error) => return Err(error),
    };
    let mut frames = vec![first];
    let mut count = 1;
    // The rest of a multipart message is delivered atomically with its first frame.
    while socket.get_rcvmore()? {
        let frame = socket.recv_bytes(0)?;
        count += 1;
        if frames.len() < MAX_KEPT_FRAMES {
            frames.push(frame);
        }
    }
    Ok(Some(Received { frames, count }))
}

impl Received {
    fn slices(&self) -> Vec<&[u8]> {
        self.frames.iter().map(Vec::as_slice).collect()
    }
}

/// The listener thread's state.
struct ListenerThread {
    context: zmq::Context,
    config: ListenerConfig,
    sub: zmq::Socket,
    /// The PAIR receiving the SUB's connection events, if it could be set up.
    monitor: Option<zmq::Socket>,
    /// The connection error this thread last reported in `last_error` (cleared on connect).
    connection_error: Option<String>,
    /// While held: the live batches received, oldest first (at most the sequencer's buffer;
    /// the oldest are dropped beyond it, and replayed after the release).
    held: Option<VecDeque<(u64, Vec<u8>)>>,
    replay: Option<ReplayState>,
    sequencer: Sequencer<Vec<u8>>,
    converter: Converter,
    /// Ranks this source has fed (cleared on resync), capped at [`MAX_TRACKED_RANKS`].
    ranks: BTreeSet<Worker>,
    /// Reused conversion buffer.
    mutations: Vec<Mutation>,
    /// Clears a resync decided, handed over with the batch that follows it (the same drive),
    /// so the unit carries the resync ([`Unit::resync`]) with the position it resumes from.
    pending_clears: Vec<Mutation>,
    sink: Arc<dyn MutationSink>,
    shared: Arc<Shared>,
}

impl ListenerThread {
    fn run(&mut self) {
        match self.event_loop() {
            Exit::Stopped => self.shared.set_status(ListenerStatus::Stopped),
            Exit::Failed => self.shared.set_status(ListenerStatus::Failed),
        }
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

    fn event_loop(&mut self) -> Exit {
        if self.held.is_none()
            && self.config.resume.is_some()
            && let Err(exit) = self.catch_up()
        {
            return exit;
        }
        let recv_timeout = self.config.options.recv_timeout;
        loop {
            if self.shared.stopping() {
                return Exit::Stopped;
            }
            if self.held.is_some() {
                let released = self.shared.release.lock().take();
                if let Some(resume) = released
                    && let Err(exit) = self.release(resume)
                {
                    return exit;
                }
            }
            let timeout = match self.sequencer.poll_timeout() {
                Some(deadline) => deadline
                    .saturating_duration_since(Instant::now())
                    .min(recv_timeout),
                None => recv_timeout,
            };
            let timeout_ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
            let (live_ready, monitor_ready, replay_ready) = {
                let mut items = Vec::with_capacity(3);
                items.push(self.sub.as_poll_item(zmq::POLLIN));
                if let Some(monitor) = &self.monitor {
                    items.push(monitor.as_poll_item(zmq::POLLIN));
                }
                let replay_at = items.len();
                if let Some(replay) = &self.replay {
                    items.push(replay.dealer.as_poll_item(zmq::POLLIN));
                }
                match zmq::poll(&mut items, timeout_ms) {
                    Ok(_) => (
                        items.first().is_some_and(zmq::PollItem::is_readable),
                        self.monitor.is_some()
                            && items.get(1).is_some_and(zmq::PollItem::is_readable),
                        self.replay.is_some()
                            && items.get(replay_at).is_some_and(zmq::PollItem::is_readable),
                    ),
                    Err(zmq::Error::EINTR) => (false, false, false),
                    Err(error) => return self.fail(format!("zmq poll: {error}")),
                }
            };
            if monitor_ready {
                self.read_monitor();
            }
            if replay_ready && let Err(exit) = self.read_replay() {
                return exit;
            }
            if live_ready && let Err(exit) = self.read_live() {
                return exit;
            }
            if self.sequencer.handle_timeout(Instant::now()).is_some() {
                let from = self.replay.as_ref().map_or(0, |replay| replay.from);
                self.replay_abandoned(format!("replay from {from} timed out"));
                if let Err(exit) = self.drive() {
                    return exit;
                }
            }
        }
    }

    /// Leaves the held state: continue from `resume`, then apply what was buffered.
    fn release(&mut self, resume: Option<Resume>) -> Result<(), Exit> {
        let resumed = resume.is_some();
        if let Some(resume) = resume {
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
            let address = String::from_utf8_lossy(address);
            let counters = &self.shared.counters;
            let error = match zmq::SocketEvent::from_raw(event) {
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
                    let payload = frames.pop().unwrap_or_default();
                    if let Some(held) = &mut self.held {
                        if held.len() >= self.config.options.sequencer.max_buffered.max(1) {
                            held.pop_front();
                            bump(&self.shared.counters.held_dropped);
                        }
                        held.push_back((seq, payload));
                        continue;
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

    /// Reads every replay reply available without blocking.
    fn read_replay(&mut self) -> Result<(), Exit> {
        loop {
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
            self.sequencer
                .set_replay_deadline(id, Instant::now() + self.config.options.replay_timeout);
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
                    let payload = frames.pop().unwrap_or_default();
                    self.sequencer.handle_replay_batch(id, seq, payload);
                }
                Ok(None) => {
                    bump(&self.shared.counters.replays_completed);
                    self.replay = None;
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
        self.replay = None;
    }

    /// Performs the sequencer's actions until it has none.
    fn drive(&mut self) -> Result<(), Exit> {
        while let Some(action) = self.sequencer.poll_action() {
            match action {
                Action::Apply {
                    seq,
                    payload,
                    fingerprint,
                } => self.apply(seq, &payload, fingerprint)?,
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
            })?;
        }
        // A replay the sequencer abandoned (buffer overflow, restart) is not waited for.
        if let Some(replay) = &self.replay
            && self
                .sequencer
                .outstanding_replay()
                .is_none_or(|(id, _, _)| id != replay.id)
        {
            self.replay = None;
        }
        self.publish_sequence_counters();
        Ok(())
    }

    fn publish_sequence_counters(&self) {
        let s = self.sequencer.counters();
        let c = &self.shared.counters;
        let set = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        set(&c.duplicates, s.duplicates);
        set(&c.gaps, s.replays_requested - s.catch_ups);
        set(&c.late_joins, s.late_joins);
        set(&c.catch_ups, s.catch_ups);
        set(&c.resyncs, s.resyncs);
        set(&c.restarts, s.restarts);
        set(&c.replay_resyncs, s.replay_resyncs);
        set(&c.overflow_resyncs, s.overflow_resyncs);
        set(&c.batches_replayed, s.applied_from_replay);
    }

    fn start_replay(&mut self, id: ReplayId, from: u64, to: u64) {
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
        match self.open_dealer(&endpoint, from) {
            Ok(dealer) => {
                self.replay = Some(ReplayState { id, from, dealer });
                self.sequencer
                    .set_replay_deadline(id, Instant::now() + self.config.options.replay_timeout);
            }
            Err(error) => {
                self.replay_failed(id, format!("replay request to {endpoint}: {error}"));
            }
        }
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
        match decode_batch(payload) {
            Ok(batch) => {
                let worker = self.converter.worker_for(batch.dp_rank);
                if self.ranks.len() < MAX_TRACKED_RANKS {
                    self.ranks.insert(worker);
                }
                self.converter
                    .convert_batch(&batch, &mut self.mutations, &mut drops);
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
        let mutations: Vec<Mutation> = self
            .ranks
            .iter()
            .map(|&worker| Mutation::Cleared { worker })
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

// ---------------------------------------------------------------------------------------------
// Registry
// ---------------------------------------------------------------------------------------------

/// A registry of listeners sharing one ZMQ context and one sink: what a server drives.
///
/// Dropping it stops every listener.
pub struct Listeners {
    context: zmq::Context,
    sink: Arc<dyn MutationSink>,
    next_id: AtomicU64,
    listeners: Mutex<BTreeMap<ListenerId, Listener>>,
}

impl fmt::Debug for Listeners {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listeners")
            .field("listeners", &self.listeners.lock().len())
            .finish_non_exhaustive()
    }
}

impl Listeners {
    /// An empty registry whose listeners hand their mutations to `sink`.
    pub fn new(sink: Arc<dyn MutationSink>) -> Self {
        Self::with_context(zmq::Context::new(), sink)
    }

    /// An empty registry using an existing ZMQ context.
    pub fn with_context(context: zmq::Context, sink: Arc<dyn MutationSink>) -> Self {
        Self {
            context,
            sink,
            next_id: AtomicU64::new(1),
            listeners: Mutex::new(BTreeMap::new()),
        }
    }

    /// Starts a listener for `config`'s source.
    ///
    /// # Errors
    /// [`ListenerError::DuplicateSource`] if a listener already serves that worker rank, and
    /// the errors of [`Listener::start`] (bad endpoints among them).
    pub fn start(&self, config: ListenerConfig) -> Result<ListenerId, ListenerError> {
        let mut listeners = self.listeners.lock();
        let (worker_id, dp_rank) = (config.source.worker_id, config.source.dp_rank);
        if let Some(existing) = listeners
            .values()
            .find(|l| l.source.worker_id == worker_id && l.source.dp_rank == dp_rank)
        {
            return Err(ListenerError::DuplicateSource {
                worker_id,
                dp_rank,
                existing: existing.id,
            });
        }
        let id = ListenerId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let listener = Listener::start_with_id(&self.context, id, config, Arc::clone(&self.sink))?;
        listeners.insert(id, listener);
        Ok(id)
    }

    /// Stops listener `id`, waits for its thread, and returns its final state.
    ///
    /// # Errors
    /// [`ListenerError::UnknownListener`].
    pub fn stop(&self, id: ListenerId) -> Result<ListenerState, ListenerError> {
        // Joined outside the registry lock.
        let listener = self
            .listeners
            .lock()
            .remove(&id)
            .ok_or(ListenerError::UnknownListener(id))?;
        Ok(listener.stop())
    }

    /// Releases held listener `id` (see [`Listener::release`]).
    ///
    /// # Errors
    /// [`ListenerError::UnknownListener`].
    pub fn release(&self, id: ListenerId, resume: Option<Resume>) -> Result<(), ListenerError> {
        self.listeners
            .lock()
            .get(&id)
            .map(|listener| listener.release(resume))
            .ok_or(ListenerError::UnknownListener(id))
    }

    /// The state of listener `id`.
    ///
    /// # Errors
    /// [`ListenerError::UnknownListener`].
    pub fn state(&self, id: ListenerId) -> Result<ListenerState, ListenerError> {
        self.listeners
            .lock()
            .get(&id)
            .map(Listener::state)
            .ok_or(ListenerError::UnknownListener(id))
    }

    /// The states of every listener, by id.
    pub fn list(&self) -> Vec<ListenerState> {
        self.listeners
            .lock()
            .values()
            .map(Listener::state)
            .collect()
    }

    /// Stops every listener; returns their final states.
    pub fn stop_all(&self) -> Vec<ListenerState> {
        let listeners = std::mem::take(&mut *self.listeners.lock());
        listeners.into_values().map(Listener::stop).collect()
    }
}

impl Drop for Listeners {
    fn drop(&mut self) {
        self.stop_all();
    }
}
