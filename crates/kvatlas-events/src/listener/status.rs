//! What a listener reports: its id, [`ListenerStatus`], [`ListenerCounters`] and
//! [`ListenerState`], and the atomics its thread updates them through.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Resume;
use crate::convert::Source;
use crate::counters::{DropCounters, Reason};

/// Identifies a listener in a [`Listeners`](super::Listeners) registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListenerId(pub(super) u64);

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
    /// The listener hit a fatal error and ended (see `last_error`).
    Failed,
    /// The listener was stopped.
    Stopped,
    /// Started held: live batches are buffered, nothing is applied until it is released.
    Held,
}

impl ListenerStatus {
    pub(super) const fn as_u8(self) -> u8 {
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
    /// Probes: replays asked because the live stream stayed quiet (see
    /// [`ListenerOptions::quiet_probe`](super::ListenerOptions::quiet_probe)); not gaps.
    pub probes: u64,
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
pub(super) struct SharedCounters {
    pub(super) messages_received: AtomicU64,
    pub(super) batches_received: AtomicU64,
    pub(super) bad_frames: AtomicU64,
    pub(super) batches_applied: AtomicU64,
    pub(super) batches_replayed: AtomicU64,
    pub(super) batch_decode_errors: AtomicU64,
    pub(super) duplicates: AtomicU64,
    pub(super) gaps: AtomicU64,
    pub(super) late_joins: AtomicU64,
    pub(super) catch_ups: AtomicU64,
    pub(super) probes: AtomicU64,
    pub(super) replays_completed: AtomicU64,
    pub(super) replays_failed: AtomicU64,
    pub(super) resyncs: AtomicU64,
    pub(super) restarts: AtomicU64,
    pub(super) replay_resyncs: AtomicU64,
    pub(super) overflow_resyncs: AtomicU64,
    pub(super) mutations_enqueued: AtomicU64,
    pub(super) resync_clears: AtomicU64,
    pub(super) backpressure_waits: AtomicU64,
    pub(super) backpressure_micros: AtomicU64,
    pub(super) mutations_abandoned: AtomicU64,
    pub(super) held_dropped: AtomicU64,
    pub(super) connects: AtomicU64,
    pub(super) connect_retries: AtomicU64,
    pub(super) disconnects: AtomicU64,
    drops: [AtomicU64; Reason::COUNT],
}

pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl SharedCounters {
    pub(super) fn snapshot(&self) -> ListenerCounters {
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
            probes: get(&self.probes),
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

    pub(super) fn add_drops(&self, drops: &DropCounters) {
        for (reason, n) in drops.iter() {
            if let Some(c) = self.drops.get(reason.index()) {
                c.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

/// State shared between a listener (on its poller thread) and its handle.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) stop: AtomicBool,
    pub(super) status: AtomicU8,
    /// `u64::MAX` = none.
    pub(super) last_seq: AtomicU64,
    /// When the listener started; `last_batch_micros` counts from it.
    pub(super) started: Instant,
    /// Microseconds from `started` to the last valid live message, plus one (0 = none yet).
    pub(super) last_batch_micros: AtomicU64,
    pub(super) last_error: Mutex<Option<String>>,
    pub(super) counters: SharedCounters,
    /// Set by [`Listener::release`](super::Listener::release): the position a held listener
    /// continues from.
    pub(super) release: Mutex<Option<Option<Resume>>>,
}

impl Shared {
    pub(super) fn set_status(&self, status: ListenerStatus) {
        self.status.store(status.as_u8(), Ordering::Release);
    }

    pub(super) fn status(&self) -> ListenerStatus {
        ListenerStatus::from_u8(self.status.load(Ordering::Acquire))
    }

    pub(super) fn set_error(&self, error: String) {
        *self.last_error.lock() = Some(error);
    }

    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}
