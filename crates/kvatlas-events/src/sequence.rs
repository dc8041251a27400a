//! Per-source sequencing: ordering, gap replay, duplicates and restarts, as a sans-IO state
//! machine ([`Sequencer`]).
//!
//! The engine numbers its batches `0, 1, 2, …` per publisher process, starting again at 0 when
//! it restarts (`docs/events.md` §7.1). The sequencer turns the live stream, plus whatever a
//! replay request returns, into an in-order stream of batches to apply, and tells the caller
//! when the worker's state can no longer be trusted ([`Action::Resync`]: clear the worker, then
//! keep applying).
//!
//! It performs no I/O and reads no clock: the caller feeds inputs with the `handle_*` methods
//! and drains [`Action`]s with [`Sequencer::poll_action`], like `quinn-proto`. Time comes in
//! the same way: the caller gives each replay request its deadline
//! ([`Sequencer::set_replay_deadline`], when it sends the request and again whenever an answer
//! arrives), asks when to wake up ([`Sequencer::poll_timeout`]) and reports the time then
//! ([`Sequencer::handle_timeout`]); a replay endpoint that never answers is then failed here,
//! and tests drive it with made-up instants.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use xxhash_rust::xxh3::xxh3_64;

/// Identifies one replay request, so answers to an abandoned request are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplayId(u64);

impl ReplayId {
    /// The raw id (increasing per sequencer).
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// Why the worker's state had to be rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResyncReason {
    /// The engine restarted: the live sequence went backwards with new content, or a replay
    /// anchored at the last batch applied found other content or nothing there
    /// ([`Sequencer::probe`]).
    Restart,
    /// A replay started later than requested or skipped batches (the engine's ring no longer
    /// held them).
    ReplayIncomplete,
    /// The caller reported the replay as failed (no replay endpoint, timeout, error).
    ReplayFailed,
    /// More live batches arrived during a replay than the buffer holds.
    BufferOverflow,
}

/// What the caller must do next, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<P> {
    /// Decode and apply this batch (batches come out in sequence order).
    Apply {
        /// The batch's sequence number.
        seq: u64,
        /// The payload, as fed in.
        payload: P,
        /// Its fingerprint (XXH3-64 of the payload), to record with the batch so a restarted
        /// consumer can tell a replayed batch from a new one ([`Sequencer::resume`]).
        fingerprint: u64,
    },
    /// Ask the engine's replay endpoint for batches `from..to` (send `from` as the start
    /// sequence; read until the end marker), feeding each reply to
    /// [`Sequencer::handle_replay_batch`] and the end marker to
    /// [`Sequencer::handle_replay_end`].
    Replay {
        /// The request's id, to pass back with its answers.
        id: ReplayId,
        /// The start sequence to send: the last batch applied when its fingerprint is known
        /// (the *anchor*: its copy in the engine's ring shows the engine is the incarnation
        /// that published it, see [`Sequencer::probe`]; it is checked, not applied), else the
        /// first missing sequence number.
        from: u64,
        /// First sequence number already buffered (exclusive end of the hole); `u64::MAX` for
        /// a catch-up ([`Sequencer::catch_up`]: whatever the engine has from `from` on).
        to: u64,
    },
    /// Batches were lost for good or the engine restarted: drop every block of the worker (all
    /// tiers), then keep applying the batches that follow.
    Resync {
        /// Why.
        reason: ResyncReason,
    },
}

/// Tuning of a [`Sequencer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequencerConfig {
    /// Batches buffered ahead of a hole (live ones, and replayed ones ahead of it) while the
    /// hole waits for a replay; one more forces a [`ResyncReason::BufferOverflow`].
    pub max_buffered: usize,
    /// Bytes of payload buffered at most (the batches of `max_buffered`, however large each
    /// may be, are bounded by it too); a batch that would take more forces a
    /// [`ResyncReason::BufferOverflow`] as one batch too many does.
    pub max_buffered_bytes: usize,
    /// Applied batches remembered (sequence and content fingerprint) to tell a duplicate from
    /// a restart.
    pub recent_window: usize,
}

impl Default for SequencerConfig {
    fn default() -> Self {
        Self {
            max_buffered: 1024,
            max_buffered_bytes: 64 << 20,
            recent_window: 1024,
        }
    }
}

/// What a sequencer has seen (monotonic counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SequenceCounters {
    /// Batches handed out with [`Action::Apply`].
    pub applied: u64,
    /// Of those, batches that came from a replay.
    pub applied_from_replay: u64,
    /// Replays requested (gaps, late joins and catch-ups).
    pub replays_requested: u64,
    /// Of those, catch-ups after a resume ([`Sequencer::catch_up`]).
    pub catch_ups: u64,
    /// Of those, probes of a quiet stream ([`Sequencer::probe`]), and requests for an engine's
    /// whole ring that follow an end marker no ring seen yet can explain.
    pub probes: u64,
    /// Of those, requested because the first live batch was not 0.
    pub late_joins: u64,
    /// Batches dropped as duplicates of an applied or buffered batch.
    pub duplicates: u64,
    /// Engine restarts detected.
    pub restarts: u64,
    /// Resyncs, for any reason (restarts included).
    pub resyncs: u64,
    /// Resyncs because a replay came back incomplete or failed.
    pub replay_resyncs: u64,
    /// Resyncs because the live buffer overflowed.
    pub overflow_resyncs: u64,
    /// Replay answers for a request no longer outstanding (ignored).
    pub stale_replay_frames: u64,
    /// Replays failed because their deadline passed ([`Sequencer::handle_timeout`]).
    pub replay_timeouts: u64,
    /// The most live batches buffered at once.
    pub max_buffered: u64,
}

#[derive(Debug)]
struct Buffered<P> {
    payload: P,
    fingerprint: u64,
}

#[derive(Debug, Clone, Copy)]
struct Outstanding {
    id: ReplayId,
    from: u64,
    to: u64,
    answered: bool,
    /// A catch-up ([`Sequencer::catch_up`]): no known end, and no resync if it fails.
    open_ended: bool,
    /// The last batch applied, `(seq, fingerprint)`, when the request starts at it: the
    /// engine's copy of it is checked, not applied (see [`Sequencer::probe`]).
    anchor: Option<(u64, u64)>,
    /// The anchor came back (first in the answer).
    anchor_seen: bool,
    /// A request from 0 asked because an anchored open-ended request was answered with the
    /// end marker alone before any ring was seen: a batch in its answer shows the engine keeps
    /// a ring, so the end marker meant a restart (see [`Sequencer::probe`]).
    confirming: bool,
    /// The answer is being ignored (an open-ended answer that started past what is applied,
    /// seen for the first time at this position).
    discarding: bool,
    /// When the request fails if nothing more arrives (set by the caller).
    deadline: Option<Instant>,
}

impl Outstanding {
    /// A request not yet answered, with no anchor and no special role (its id, start and end
    /// are set by the caller).
    const fn new() -> Self {
        Self {
            id: ReplayId(0),
            from: 0,
            to: 0,
            answered: false,
            open_ended: false,
            anchor: None,
            anchor_seen: false,
            confirming: false,
            discarding: false,
            deadline: None,
        }
    }
}

/// The sequencing state of one source (one engine publisher).
///
/// Call protocol:
/// - inputs: [`handle_live`](Self::handle_live) for each live `(seq, payload)`;
///   [`handle_replay_batch`](Self::handle_replay_batch),
///   [`handle_replay_end`](Self::handle_replay_end) and
///   [`handle_replay_failed`](Self::handle_replay_failed) for the answers to an
///   [`Action::Replay`]; [`set_replay_deadline`](Self::set_replay_deadline) when the request
///   goes out and as answers arrive, and [`handle_timeout`](Self::handle_timeout) at the
///   instant [`poll_timeout`](Self::poll_timeout) names;
/// - outputs: [`poll_action`](Self::poll_action) until `None` after each input.
///
/// Rules (`docs/events.md` has the full state machine):
/// - the first live batch with `seq > 0` (late join) → replay `0..seq`;
/// - `seq == next` → apply; `seq > next` → buffer and replay `next..seq` (one replay at a time);
/// - a batch below the next one to apply, or at a buffered one's number → duplicate, dropped
///   (by its number: the content is compared only for a live batch at or below the last live
///   one that is not among the recent or buffered ones, below); a live batch at or below the
///   last live one that fills a hole (at or above the next one to apply) → out of order,
///   accepted; one below the next to apply with content other than the recent batch of its
///   number → restart: resync and start over from it;
/// - a replay that starts late, skips batches or fails → resync, then continue with what is
///   there (the worker is rebuilt from the events that follow);
/// - more than [`SequencerConfig::max_buffered`] buffered live batches → resync, flush them;
/// - a replay asks from the last batch applied (the anchor): its copy in the engine's ring
///   with other content, or no answer but the end marker from an engine seen to keep a ring →
///   restart: resync and replay the new incarnation from 0.
///
/// `P` is the payload type (`Vec<u8>`, `bytes::Bytes`, ...); it is fingerprinted (XXH3) to tell
/// duplicates from restarts and is never decoded here.
#[derive(Debug)]
pub struct Sequencer<P> {
    config: SequencerConfig,
    /// The next sequence number to apply.
    next: u64,
    /// The highest live sequence number of the current engine incarnation.
    last_live: Option<u64>,
    /// Out-of-order batches waiting for the hole before them to fill.
    pending: BTreeMap<u64, Buffered<P>>,
    /// The payload bytes in `pending` (invariant: their sum, kept by `buffer` and `unbuffer`).
    pending_bytes: usize,
    replay: Option<Outstanding>,
    next_replay_id: u64,
    /// `(seq, fingerprint)` of the last applied batches.
    recent: VecDeque<(u64, u64)>,
    /// A replay answer has carried a batch: the engine's replay endpoint keeps a ring of its
    /// batches (an engine configured without one answers every request with the end marker
    /// alone, which must not be read as a restart).
    ring_seen: bool,
    /// `next` when an open-ended answer last started past it (ignored then: the batches in
    /// between may still be on their way on the live stream). The same again at the same
    /// `next` is a loss.
    suspect: Option<u64>,
    actions: VecDeque<Action<P>>,
    counters: SequenceCounters,
}

impl<P: AsRef<[u8]>> Default for Sequencer<P> {
    fn default() -> Self {
        Self::new(SequencerConfig::default())
    }
}

impl<P: AsRef<[u8]>> Sequencer<P> {
    /// A sequencer that has seen nothing yet.
    pub fn new(config: SequencerConfig) -> Self {
        Self {
            config,
            next: 0,
            last_live: None,
            pending: BTreeMap::new(),
            pending_bytes: 0,
            replay: None,
            next_replay_id: 0,
            recent: VecDeque::new(),
            ring_seen: false,
            suspect: None,
            actions: VecDeque::new(),
            counters: SequenceCounters::default(),
        }
    }

    /// A sequencer that continues a stream applied up to `position` elsewhere (a snapshot the
    /// consumer restored): `recent` holds `(seq, fingerprint)` of the last batches applied there,
    /// oldest first (at most [`SequencerConfig::recent_window`] are kept).
    ///
    /// From there: `position + 1` is applied next; a later batch is a gap (replayed); a batch at
    /// or below `position` is a duplicate if `recent` holds it with the same fingerprint, and
    /// otherwise a new engine incarnation (restart: resync). A restart whose new sequence has
    /// already passed `position` when the consumer comes back looks like a gap on the live
    /// stream (the engines' batches carry no incarnation id); the catch-up, anchored at
    /// `position` ([`Sequencer::probe`]), finds it while the new incarnation's ring still holds
    /// its own batch `position`.
    pub fn resume(config: SequencerConfig, position: u64, recent: &[(u64, u64)]) -> Self {
        let mut sequencer = Self::new(config);
        sequencer.next = position.saturating_add(1);
        sequencer.last_live = Some(position);
        let keep = recent.len().min(config.recent_window);
        sequencer
            .recent
            .extend(recent[recent.len() - keep..].iter().copied());
        sequencer
    }

    /// Asks the engine for every batch after the last one applied, without waiting for a live
    /// batch to reveal the gap: for a consumer that resumed a stream ([`Sequencer::resume`])
    /// after being away, so an engine that went quiet meanwhile is still caught up. Emits an
    /// open-ended [`Action::Replay`] (`to == u64::MAX`) unless a replay is outstanding. Its
    /// answer is handled like any replay (a first batch later than asked means the engine's ring
    /// lost the start: resync); its failure is not a loss (nothing says a batch was missed; a
    /// later live batch would reveal a gap and replay it), so it only ends the request.
    pub fn catch_up(&mut self) {
        if self.replay.is_some() {
            return;
        }
        self.counters.catch_ups += 1;
        self.request_open_ended();
    }

    /// Asks the engine for every batch after the last one applied because the live stream has
    /// been quiet: a batch the live stream lost (published before the subscription took effect,
    /// during a reconnection, or dropped at a high-water mark) is otherwise only noticed when a
    /// later batch arrives, which a quiet engine may not send for a long time. Handled as a
    /// catch-up ([`Sequencer::catch_up`]): what comes back is applied, a first batch later than
    /// asked resyncs, a failure only ends the request. Returns whether the request was made:
    /// not while a replay is outstanding, and not before the sequencer has a position (nothing
    /// applied and nothing resumed: the first live batch shows what is missing).
    ///
    /// **Anchored.** A catch-up or probe (any replay, in fact) starts at the last batch
    /// applied, not after it, when its fingerprint is known: a running engine's ring always
    /// holds its newest batch, so the answer's first batch is that batch again (checked, not
    /// applied), or the one after it (the ring just dropped it). An engine that restarted and
    /// went quiet is found this way — its live stream shows nothing — and resynced
    /// ([`ResyncReason::Restart`]; its new incarnation's batches are then replayed from 0):
    /// - the batch at the anchor's sequence number has other content: a new incarnation that
    ///   has published past it;
    /// - only the end marker comes back: the engine holds nothing from the anchor on, which a
    ///   running engine's ring cannot be. Trusted once a replay answer has carried a batch
    ///   (the endpoint keeps a ring): an engine configured without one answers every request
    ///   with the end marker alone. Before that, an open-ended request so answered is followed
    ///   by a request for the whole ring (from 0, counted as a probe): any batch in its answer
    ///   settles it (a restart, and the answer is the new incarnation's); the end marker alone
    ///   again leaves it open (no ring, or a new incarnation that has published nothing).
    pub fn probe(&mut self) -> bool {
        if self.replay.is_some() || !self.has_position() {
            return false;
        }
        self.counters.probes += 1;
        self.request_open_ended();
        true
    }

    /// The last batch applied, `(seq, fingerprint)`, if its fingerprint is known: what a
    /// probe or replay is anchored at.
    pub fn last_applied(&self) -> Option<(u64, u64)> {
        let last = self.next.checked_sub(1)?;
        self.recent.back().filter(|&&(seq, _)| seq == last).copied()
    }

    /// [`Sequencer::probe`], anchored at `anchor` — a batch applied earlier, still among the
    /// recent ones — instead of at the last batch applied. A listener probes after a
    /// reconnection from the batch applied when the connection opened: a new incarnation's
    /// first batch, applied since as a continuation of the old numbering, would otherwise be
    /// the anchor, match itself in the new ring, and hide the restart. The batches between
    /// the anchor and the next one are answered again and dropped as duplicates. Falls back to
    /// [`Sequencer::probe`] when `anchor` is no longer among the recent batches (a resync
    /// since, or too long ago).
    pub fn probe_from(&mut self, anchor: (u64, u64)) -> bool {
        if self.replay.is_some() || !self.has_position() {
            return false;
        }
        if anchor.0 >= self.next || !self.recent.contains(&anchor) {
            return self.probe();
        }
        self.counters.probes += 1;
        self.request_anchored(u64::MAX, true, Some(anchor));
        true
    }

    /// Emits an open-ended replay from the next sequence number (see [`Sequencer::probe`]).
    fn request_open_ended(&mut self) {
        self.request(u64::MAX, true);
    }

    /// Emits a replay of `next..to`, anchored at the last batch applied if its fingerprint is
    /// known: the request asks from that batch, whose copy in the engine's ring is checked and
    /// not applied (see [`Sequencer::probe`]).
    fn request(&mut self, to: u64, open_ended: bool) {
        self.request_anchored(to, open_ended, self.last_applied());
    }

    /// Emits a replay of `next..to` asking from `anchor` (a batch applied, checked in the
    /// answer and not applied again), or from `next` without one.
    fn request_anchored(&mut self, to: u64, open_ended: bool, anchor: Option<(u64, u64)>) {
        self.issue(Outstanding {
            from: self.next,
            to,
            open_ended,
            anchor,
            ..Outstanding::new()
        });
    }

    /// Asks the engine for its whole ring (from 0, open-ended): does it keep one? (See
    /// [`Sequencer::probe`].) Counted as a probe.
    fn request_confirmation(&mut self) {
        self.counters.probes += 1;
        self.issue(Outstanding {
            from: 0,
            to: u64::MAX,
            open_ended: true,
            confirming: true,
            ..Outstanding::new()
        });
    }

    /// Makes `request` (given an id here) the outstanding replay and emits its action, asking
    /// from its anchor if it has one.
    fn issue(&mut self, request: Outstanding) {
        let id = ReplayId(self.next_replay_id);
        self.next_replay_id += 1;
        self.counters.replays_requested += 1;
        let Outstanding {
            from, to, anchor, ..
        } = request;
        self.replay = Some(Outstanding { id, ..request });
        self.actions.push_back(Action::Replay {
            id,
            from: anchor.map_or(from, |(seq, _)| seq),
            to,
        });
    }

    /// A replay answer showed that the engine restarted (see [`Sequencer::probe`]): resync,
    /// forget the old incarnation, and ask for the new one's batches from 0.
    fn restarted_quietly(&mut self) {
        self.restart_found_by_replay();
        self.request_open_ended();
    }

    /// A replay answer showed a restart: as [`Sequencer::restarted`], and the new
    /// incarnation's batches are to be replayed from 0 (counted as a late join).
    fn restart_found_by_replay(&mut self) {
        self.restarted();
        self.counters.late_joins += 1;
    }

    /// The engine restarted: resync, and forget the old incarnation (its buffer, its replay and
    /// its batches' fingerprints); the next batch applied is 0.
    fn restarted(&mut self) {
        self.counters.restarts += 1;
        self.resync(ResyncReason::Restart);
        self.pending.clear();
        self.pending_bytes = 0;
        self.replay = None;
        self.recent.clear();
        self.next = 0;
        self.last_live = None;
    }

    /// Whether the sequencer knows where its stream stands: it has applied a batch or resumed
    /// from a position (a [`Sequencer::probe`] can then ask for what follows).
    pub fn has_position(&self) -> bool {
        self.last_live.is_some() || self.next > 0
    }

    /// Whether a replay answer has carried a batch, showing that the engine's replay endpoint
    /// keeps a ring of its batches (until then an answer with nothing but the end marker is
    /// not taken for a restart: see [`Sequencer::probe`]).
    pub fn ring_seen(&self) -> bool {
        self.ring_seen
    }

    /// `(seq, fingerprint)` of the last batches applied, oldest first.
    pub fn recent(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.recent.iter().copied()
    }

    /// The next action to take, if any.
    pub fn poll_action(&mut self) -> Option<Action<P>> {
        self.actions.pop_front()
    }

    /// The counters so far.
    pub fn counters(&self) -> &SequenceCounters {
        &self.counters
    }

    /// The next sequence number the sequencer will apply.
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    /// The outstanding replay request, if any, as `(id, from, to)`.
    pub fn outstanding_replay(&self) -> Option<(ReplayId, u64, u64)> {
        self.replay.map(|r| (r.id, r.from, r.to))
    }

    /// Live batches currently buffered.
    pub fn buffered(&self) -> usize {
        self.pending.len()
    }

    /// Payload bytes currently buffered (at most [`SequencerConfig::max_buffered_bytes`]).
    pub fn buffered_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// A batch received on the live (PUB/SUB) stream.
    pub fn handle_live(&mut self, seq: u64, payload: P) {
        let fingerprint = xxh3_64(payload.as_ref());
        if self.last_live.is_some_and(|last| seq <= last) {
            if self.is_duplicate(seq, fingerprint) {
                self.counters.duplicates += 1;
                return;
            }
            if seq >= self.next {
                // Neither applied nor buffered, after later ones: a batch that fills a hole out
                // of order (a publisher that reconnected to a bound socket: its old
                // connection's last batches can come after the new one's first), not a
                // restart. A restart whose numbers fall inside the hole is still found: the
                // replay asks for the hole from the last batch applied, whose copy in the
                // engine's ring then differs (the anchor).
                self.accept(seq, payload, fingerprint, false);
                self.request_replay_if_needed();
                return;
            }
            // Below what is applied, with other content: within one publisher process the
            // stream only moves forward, so this is a new one.
            self.restarted();
        }
        let first = self.last_live.is_none();
        self.last_live = Some(seq);
        // A late join is counted with the replay it asks for: one already outstanding (the
        // replay from 0 that found a restart, counted then) asks for nothing more.
        if first && seq > self.next && self.replay.is_none() {
            self.counters.late_joins += 1;
        }
        self.accept(seq, payload, fingerprint, false);
        self.request_replay_if_needed();
    }

    /// One batch of the answer to replay `id`.
    pub fn handle_replay_batch(&mut self, id: ReplayId, seq: u64, payload: P) {
        let Some(replay) = self.replay.as_mut().filter(|r| r.id == id) else {
            self.counters.stale_replay_frames += 1;
            return;
        };
        self.ring_seen = true;
        if replay.confirming {
            // The engine keeps a ring, yet held nothing from the last batch applied on: it
            // restarted. What this answer brings from 0 is the new incarnation's.
            let mut confirmed = *replay;
            confirmed.confirming = false;
            self.restart_found_by_replay();
            self.replay = Some(confirmed);
        }
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        if replay.discarding {
            return;
        }
        let fingerprint = xxh3_64(payload.as_ref());
        if let Some((anchor_seq, anchor_fingerprint)) = replay.anchor
            && !replay.answered
            && !replay.anchor_seen
            && seq == anchor_seq
        {
            replay.anchor_seen = true;
            if fingerprint != anchor_fingerprint {
                // Another batch under the number of the last one applied: a new incarnation.
                self.restarted_quietly();
            }
            return;
        }
        let first = !replay.answered;
        replay.answered = true;
        // Compared with what is applied now, not when the request went out: live batches may
        // have been applied meanwhile (an open-ended request does not hold them back), and a
        // ring that has moved past the request's start then lost nothing the stream still needs.
        // Nor is an open-ended answer that starts past what is applied proof of a loss the
        // first time: the batches in between may still be on their way on the live stream (a
        // busy engine, a small ring). It is ignored; the same at the same position the next
        // time (the live stream brought nothing meanwhile) is a loss.
        if first && replay.open_ended && seq > self.next && self.suspect != Some(self.next) {
            self.suspect = Some(self.next);
            replay.discarding = true;
            return;
        }
        if seq > self.next && (first || seq < replay.to) {
            // The engine's ring no longer holds `next..seq`.
            self.skip_to(seq, ResyncReason::ReplayIncomplete);
        }
        self.accept(seq, payload, fingerprint, true);
        // A buffer overflow ends the replay (the rest of its answer is stale): the holes left
        // behind the buffered batches are asked for at once, not at the next live batch.
        self.request_replay_if_needed();
    }

    /// The end marker of replay `id`.
    pub fn handle_replay_end(&mut self, id: ReplayId) {
        let Some(replay) = self.replay.filter(|r| r.id == id) else {
            self.counters.stale_replay_frames += 1;
            return;
        };
        self.replay = None;
        if replay.anchor.is_some() && !replay.anchor_seen && !replay.answered {
            if self.ring_seen {
                // Nothing from the last batch applied on: the engine that published it is gone.
                self.restarted_quietly();
                return;
            }
            if replay.open_ended {
                // No ring seen yet: an engine without one answers so too. Ask for its whole
                // ring; an answer with any batch in it settles it.
                self.request_confirmation();
                return;
            }
        }
        if !replay.open_ended && self.next < replay.to {
            self.skip_to(replay.to, ResyncReason::ReplayIncomplete);
        }
        self.request_replay_if_needed();
    }

    /// Replay `id` fails if nothing more about it arrives by `deadline`: call it when the
    /// request is sent, and again (with a later deadline) whenever one of its answers arrives.
    /// Ignored for a request no longer outstanding.
    pub fn set_replay_deadline(&mut self, id: ReplayId, deadline: Instant) {
        if let Some(replay) = self.replay.as_mut().filter(|r| r.id == id) {
            replay.deadline = Some(deadline);
        }
    }

    /// When [`Sequencer::handle_timeout`] must be called next: the outstanding replay's
    /// deadline, if it has one.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.replay.and_then(|r| r.deadline)
    }

    /// The time is `now`: an outstanding replay whose deadline has passed fails (as
    /// [`Sequencer::handle_replay_failed`], counted in
    /// [`SequenceCounters::replay_timeouts`]). Returns the replay that timed out, so the caller
    /// can drop its request.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<ReplayId> {
        let replay = self.replay?;
        if replay.deadline.is_none_or(|deadline| now < deadline) {
            return None;
        }
        self.counters.replay_timeouts += 1;
        self.handle_replay_failed(replay.id);
        Some(replay.id)
    }

    /// Replay `id` failed (a socket error, or the source has no replay endpoint).
    pub fn handle_replay_failed(&mut self, id: ReplayId) {
        let Some(replay) = self.replay.filter(|r| r.id == id) else {
            self.counters.stale_replay_frames += 1;
            return;
        };
        self.replay = None;
        // Only a hole still open is lost: an answer (or live batches) that already filled it
        // before the end marker went missing lost nothing, and clearing the source's blocks then
        // would drop what its engine still holds.
        if !replay.open_ended && self.next < replay.to {
            self.skip_to(replay.to, ResyncReason::ReplayFailed);
        }
        self.request_replay_if_needed();
    }

    /// Whether `(seq, fingerprint)` is a batch already applied (recently) or buffered.
    fn is_duplicate(&self, seq: u64, fingerprint: u64) -> bool {
        self.recent
            .iter()
            .any(|&(s, f)| s == seq && f == fingerprint)
            || self
                .pending
                .get(&seq)
                .is_some_and(|b| b.fingerprint == fingerprint)
    }

    /// Applies `seq` if it is next, buffers it if it is ahead, drops it if it is behind.
    fn accept(&mut self, seq: u64, payload: P, fingerprint: u64, from_replay: bool) {
        if seq < self.next || self.pending.contains_key(&seq) {
            self.counters.duplicates += 1;
            return;
        }
        if seq == self.next {
            self.apply(seq, payload, fingerprint, from_replay);
            self.drain_contiguous();
            return;
        }
        let bytes = payload.as_ref().len();
        if self.pending.len() >= self.config.max_buffered
            || self.pending_bytes.saturating_add(bytes) > self.config.max_buffered_bytes
        {
            // Give up the holes below this batch and apply it in its place. If the batches
            // left above it would still fill the buffer (it lies below every buffered batch: a
            // late one filling a hole out of order; or they hold the bytes), that frees no room
            // and the next batch would overflow again, with a second resync undoing what was
            // applied after the first: then the whole buffer is flushed, holes given up.
            self.counters.overflow_resyncs += 1;
            self.replay = None;
            let (mut above, mut above_bytes) = (0, 0usize);
            for (_, b) in self
                .pending
                .range((std::ops::Bound::Excluded(seq), std::ops::Bound::Unbounded))
            {
                above += 1;
                above_bytes = above_bytes.saturating_add(b.payload.as_ref().len());
            }
            self.buffer(seq, payload, fingerprint);
            let upto = if above >= self.config.max_buffered
                || above_bytes.saturating_add(bytes) > self.config.max_buffered_bytes
            {
                self.pending.keys().next_back().copied().unwrap_or(seq)
            } else {
                seq
            };
            // Applies everything below `upto`, then `upto` (the next to apply) and what follows
            // it without a hole.
            self.skip_to(upto, ResyncReason::BufferOverflow);
            return;
        }
        self.buffer(seq, payload, fingerprint);
        let buffered = self.pending.len() as u64;
        self.counters.max_buffered = self.counters.max_buffered.max(buffered);
    }

    /// Buffers batch `seq` (not buffered yet).
    fn buffer(&mut self, seq: u64, payload: P, fingerprint: u64) {
        self.pending_bytes = self.pending_bytes.saturating_add(payload.as_ref().len());
        self.pending.insert(
            seq,
            Buffered {
                payload,
                fingerprint,
            },
        );
    }

    /// Takes the first buffered batch if `take` accepts its sequence number.
    fn unbuffer_first(&mut self, take: impl FnOnce(u64) -> bool) -> Option<(u64, Buffered<P>)> {
        let entry = self.pending.first_entry()?;
        if !take(*entry.key()) {
            return None;
        }
        let (seq, b) = entry.remove_entry();
        self.pending_bytes = self.pending_bytes.saturating_sub(b.payload.as_ref().len());
        Some((seq, b))
    }

    /// Gives up on everything before `seq`: emits a resync, applies the buffered batches below
    /// `seq` in order (holes accepted), and makes `seq` the next to apply.
    fn skip_to(&mut self, seq: u64, reason: ResyncReason) {
        if matches!(
            reason,
            ResyncReason::ReplayIncomplete | ResyncReason::ReplayFailed
        ) {
            self.counters.replay_resyncs += 1;
        }
        self.resync(reason);
        while let Some((s, b)) = self.unbuffer_first(|s| s < seq) {
            self.apply(s, b.payload, b.fingerprint, false);
        }
        self.next = self.next.max(seq);
        self.drain_contiguous();
    }

    fn resync(&mut self, reason: ResyncReason) {
        self.counters.resyncs += 1;
        self.actions.push_back(Action::Resync { reason });
    }

    fn drain_contiguous(&mut self) {
        let mut next = self.next;
        while let Some((seq, b)) = self.unbuffer_first(|s| s == next) {
            self.apply(seq, b.payload, b.fingerprint, false);
            next = self.next;
        }
    }

    fn apply(&mut self, seq: u64, payload: P, fingerprint: u64, from_replay: bool) {
        self.counters.applied += 1;
        if from_replay {
            self.counters.applied_from_replay += 1;
        }
        if self.config.recent_window > 0 {
            if self.recent.len() >= self.config.recent_window {
                self.recent.pop_front();
            }
            self.recent.push_back((seq, fingerprint));
        }
        self.next = seq.saturating_add(1);
        self.actions.push_back(Action::Apply {
            seq,
            payload,
            fingerprint,
        });
    }

    /// With batches buffered behind a hole and no replay outstanding, asks for the hole.
    fn request_replay_if_needed(&mut self) {
        if self.replay.is_some() {
            return;
        }
        let Some(&to) = self.pending.keys().next() else {
            return;
        };
        self.request(to, false);
    }
}
