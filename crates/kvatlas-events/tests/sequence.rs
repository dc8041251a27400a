//! The per-source sequencing state machine: contiguous streams, gaps healed by replay, late
//! joins, duplicates, restarts, incomplete, failed or timed-out replays and buffer overflow.

use std::time::{Duration, Instant};

use kvatlas_events::{Action, ReplayId, ResyncReason, Sequencer, SequencerConfig};

/// An action without its payload (payloads are checked separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum A {
    Apply(u64),
    Replay(u64, u64),
    Resync(ResyncReason),
}

use A::{Apply, Replay, Resync};

fn payload(incarnation: u32, seq: u64) -> Vec<u8> {
    format!("engine-{incarnation}-batch-{seq}").into_bytes()
}

/// A sequencer plus the payload check: every applied payload must be the one fed for its seq.
struct Harness {
    seq: Sequencer<Vec<u8>>,
    incarnation: u32,
}

impl Harness {
    fn new() -> Self {
        Self::with(SequencerConfig::default())
    }

    fn with(config: SequencerConfig) -> Self {
        Self {
            seq: Sequencer::new(config),
            incarnation: 0,
        }
    }

    fn drain(&mut self) -> Vec<A> {
        let mut out = Vec::new();
        while let Some(action) = self.seq.poll_action() {
            out.push(match action {
                Action::Apply {
                    seq, payload: p, ..
                } => {
                    assert_eq!(
                        p,
                        payload(self.incarnation, seq),
                        "payload of applied seq {seq}"
                    );
                    Apply(seq)
                }
                Action::Replay { from, to, .. } => Replay(from, to),
                Action::Resync { reason } => Resync(reason),
            });
        }
        out
    }

    fn live(&mut self, seqs: impl IntoIterator<Item = u64>) -> Vec<A> {
        for s in seqs {
            self.seq.handle_live(s, payload(self.incarnation, s));
        }
        self.drain()
    }

    fn replay_id(&self) -> ReplayId {
        self.seq
            .outstanding_replay()
            .expect("a replay is outstanding")
            .0
    }

    fn replay(&mut self, seqs: impl IntoIterator<Item = u64>, end: bool) -> Vec<A> {
        let id = self.replay_id();
        for s in seqs {
            self.seq
                .handle_replay_batch(id, s, payload(self.incarnation, s));
        }
        if end {
            self.seq.handle_replay_end(id);
        }
        self.drain()
    }
}

#[test]
fn contiguous_stream_is_applied_in_order() {
    let mut h = Harness::new();
    assert_eq!(h.live(0..4), vec![Apply(0), Apply(1), Apply(2), Apply(3)]);
    assert_eq!(h.seq.next_seq(), 4);
    assert_eq!(h.seq.counters().applied, 4);
    assert_eq!(h.seq.counters().replays_requested, 0);
}

#[test]
fn a_gap_is_replayed_and_buffered_live_batches_follow_in_order() {
    let mut h = Harness::new();
    assert_eq!(h.live(0..2), vec![Apply(0), Apply(1)]);
    assert_eq!(h.live([4]), vec![Replay(1, 4)]);
    assert_eq!(h.live([5, 6]), vec![], "buffered while the replay runs");
    assert_eq!(h.seq.buffered(), 3);
    // The ring answers from 2 and also repeats what we buffered.
    assert_eq!(
        h.replay(2..7, true),
        vec![Apply(2), Apply(3), Apply(4), Apply(5), Apply(6)]
    );
    assert_eq!(h.live([7]), vec![Apply(7)]);
    let c = h.seq.counters();
    assert_eq!((c.applied, c.applied_from_replay), (8, 2));
    assert_eq!((c.duplicates, c.resyncs, c.max_buffered), (3, 0, 3));
}

#[test]
fn a_replay_that_runs_ahead_of_live_makes_later_live_copies_duplicates() {
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([2]), vec![Replay(0, 2)]);
    assert_eq!(
        h.replay(1..5, true),
        vec![Apply(1), Apply(2), Apply(3), Apply(4)]
    );
    assert_eq!(h.live([3, 4, 5]), vec![Apply(5)]);
    assert_eq!(h.seq.counters().duplicates, 3);
}

#[test]
fn duplicates_are_dropped_and_counted() {
    let mut h = Harness::new();
    h.live(0..3);
    assert_eq!(h.live([2, 1]), vec![]);
    assert_eq!(h.seq.counters().duplicates, 2);
    assert_eq!(h.seq.counters().restarts, 0);
    // Duplicate of a buffered batch during a replay.
    assert_eq!(h.live([5]), vec![Replay(2, 5)]);
    assert_eq!(h.live([5]), vec![]);
    assert_eq!(h.seq.counters().duplicates, 3);
}

#[test]
fn a_backwards_sequence_with_new_content_is_a_restart() {
    let mut h = Harness::new();
    h.live(0..5);
    h.incarnation = 1;
    assert_eq!(
        h.live([0, 1]),
        vec![Resync(ResyncReason::Restart), Apply(0), Apply(1)]
    );
    assert_eq!(h.seq.counters().restarts, 1);
    // A restart noticed late (the new engine is already at 2): resync, then replay from 0.
    h.incarnation = 2;
    assert_eq!(
        h.live([1]),
        vec![Resync(ResyncReason::Restart), Replay(0, 1)]
    );
    assert_eq!(h.replay([0], true), vec![Apply(0), Apply(1)]);
}

/// A live batch that comes after later ones and fills a hole (a publisher reconnected to a
/// bound socket: its old connection's last batches arrive after the new one's first) is taken
/// in order, not as an engine restart, which would clear the worker and replay from 0.
#[test]
fn a_late_batch_inside_a_hole_is_out_of_order_not_a_restart() {
    let mut h = Harness::new();
    h.live(0..3);
    // The replay asks from the last batch applied (the anchor).
    assert_eq!(h.live([6]), vec![Replay(2, 6)]);
    assert_eq!(h.live([3]), vec![Apply(3)], "late, fills the hole's start");
    assert_eq!(h.live([5]), vec![], "late, buffered behind the hole at 4");
    assert_eq!(
        h.replay([2, 3, 4, 5, 6], true),
        vec![Apply(4), Apply(5), Apply(6)]
    );
    assert_eq!(h.seq.counters().restarts, 0);
    assert_eq!(h.seq.counters().resyncs, 0);
    // Below what is applied, with other content, it is still a restart.
    h.incarnation = 1;
    assert_eq!(h.live([0]), vec![Resync(ResyncReason::Restart), Apply(0)]);
}

/// A probe after a reconnection is anchored at the batch applied when the connection opened:
/// a new incarnation's batch that continued the old numbering and was applied since cannot
/// stand as the anchor (it would match itself in the new ring and hide the restart).
#[test]
fn a_probe_from_the_batch_before_a_reconnection_finds_a_restart_a_continuation_hid() {
    let mut hidden = Harness::new();
    let mut found = Harness::new();
    for h in [&mut hidden, &mut found] {
        h.live(0..3);
    }
    let anchor = found.seq.last_applied().expect("the last batch applied");
    assert_eq!(anchor.0, 2);
    for h in [&mut hidden, &mut found] {
        // The engine restarted while disconnected; the new connection's first batch is 3.
        h.incarnation = 1;
        assert_eq!(h.live([3]), vec![Apply(3)], "taken as a continuation");
    }
    // Anchored at the last batch applied (3, the new incarnation's): its ring agrees.
    assert!(hidden.seq.probe());
    assert_eq!(hidden.drain(), vec![Replay(3, u64::MAX)]);
    assert_eq!(hidden.replay([3], true), vec![]);
    assert_eq!(
        hidden.seq.counters().restarts,
        0,
        "the restart stays hidden"
    );
    // Anchored at 2, applied before the reconnection: the new ring's 2 differs.
    assert!(found.seq.probe_from(anchor));
    assert_eq!(found.drain(), vec![Replay(2, u64::MAX)]);
    let actions = found.replay([2, 3], false);
    assert_eq!(
        actions.first(),
        Some(&Resync(ResyncReason::Restart)),
        "{actions:?}"
    );
    assert_eq!(found.seq.counters().restarts, 1);
}

#[test]
fn a_restart_during_a_replay_abandons_it() {
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([3]), vec![Replay(0, 3)]);
    let stale = h.replay_id();
    h.incarnation = 1;
    assert_eq!(h.live([0]), vec![Resync(ResyncReason::Restart), Apply(0)]);
    h.seq.handle_replay_batch(stale, 1, payload(0, 1));
    h.seq.handle_replay_end(stale);
    assert_eq!(h.drain(), vec![]);
    assert_eq!(h.seq.counters().stale_replay_frames, 2);
}

#[test]
fn a_late_join_replays_from_zero() {
    let mut h = Harness::new();
    assert_eq!(h.live([3]), vec![Replay(0, 3)]);
    assert_eq!(h.live([4]), vec![]);
    assert_eq!(
        h.replay(0..3, true),
        vec![Apply(0), Apply(1), Apply(2), Apply(3), Apply(4)]
    );
    assert_eq!(h.seq.counters().late_joins, 1);
    assert_eq!(h.seq.counters().resyncs, 0);
}

#[test]
fn a_replay_that_starts_late_resyncs_then_continues() {
    let mut h = Harness::new();
    assert_eq!(h.live([5]), vec![Replay(0, 5)]);
    // The ring only holds 3.. any more.
    assert_eq!(
        h.replay(3..5, true),
        vec![
            Resync(ResyncReason::ReplayIncomplete),
            Apply(3),
            Apply(4),
            Apply(5)
        ]
    );
    assert_eq!(h.seq.counters().replay_resyncs, 1);
}

#[test]
fn a_replay_with_a_hole_or_nothing_resyncs() {
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([6]), vec![Replay(0, 6)]);
    assert_eq!(
        h.replay([1, 2, 4, 5], true),
        vec![
            Apply(1),
            Apply(2),
            Resync(ResyncReason::ReplayIncomplete),
            Apply(4),
            Apply(5),
            Apply(6)
        ]
    );
    // An empty answer (not even the last batch applied, 6) from an endpoint seen to keep a
    // ring: the engine that published 9 and 10 is gone: a restart, replayed from 0.
    assert_eq!(h.live([9, 10]), vec![Replay(6, 9)]);
    assert_eq!(
        h.replay([], true),
        vec![Resync(ResyncReason::Restart), Replay(0, u64::MAX)]
    );
    // From an endpoint never seen to keep one: resync and go on with what is buffered.
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([6, 7]), vec![Replay(0, 6)]);
    assert_eq!(
        h.replay([], true),
        vec![Resync(ResyncReason::ReplayIncomplete), Apply(6), Apply(7)]
    );
}

#[test]
fn a_failed_replay_resyncs() {
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([2, 3]), vec![Replay(0, 2)]);
    let id = h.replay_id();
    h.seq.handle_replay_failed(id);
    assert_eq!(
        h.drain(),
        vec![Resync(ResyncReason::ReplayFailed), Apply(2), Apply(3)]
    );
    h.seq.handle_replay_failed(id);
    assert_eq!(h.drain(), vec![]);
    assert_eq!(h.seq.counters().stale_replay_frames, 1);
}

/// A replay whose answer filled the hole but whose end marker never came (lost, or late past
/// the deadline) lost nothing: its failure, reported or timed out, must not clear the source.
#[test]
fn a_replay_that_fails_after_filling_its_hole_changes_nothing() {
    let start = Instant::now();
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([3]), vec![Replay(0, 3)]);
    assert_eq!(
        h.replay([0, 1, 2], false),
        vec![Apply(1), Apply(2), Apply(3)]
    );
    let id = h.replay_id();
    h.seq.handle_replay_failed(id);
    assert_eq!(h.drain(), vec![]);
    assert_eq!(h.seq.outstanding_replay(), None);
    assert_eq!(h.live([4]), vec![Apply(4)]);

    // The same through the deadline.
    assert_eq!(h.live([6]), vec![Replay(4, 6)]);
    let id = h.replay_id();
    h.seq
        .set_replay_deadline(id, start + Duration::from_millis(100));
    assert_eq!(h.replay([4, 5], false), vec![Apply(5), Apply(6)]);
    assert_eq!(
        h.seq.handle_timeout(start + Duration::from_millis(100)),
        Some(id)
    );
    assert_eq!(h.drain(), vec![]);
    let c = *h.seq.counters();
    assert_eq!(
        (c.resyncs, c.replay_resyncs, c.replay_timeouts),
        (0, 0, 1),
        "{c:?}"
    );
}

#[test]
fn a_new_gap_during_a_replay_is_requested_after_it() {
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([2, 3, 6]), vec![Replay(0, 2)]);
    assert_eq!(
        h.replay([1], true),
        vec![Apply(1), Apply(2), Apply(3), Replay(3, 6)]
    );
    assert_eq!(h.replay([4, 5], true), vec![Apply(4), Apply(5), Apply(6)]);
    assert_eq!(h.seq.counters().replays_requested, 2);
}

#[test]
fn buffer_overflow_resyncs_and_flushes() {
    let mut h = Harness::with(SequencerConfig {
        max_buffered: 4,
        recent_window: 16,
        ..SequencerConfig::default()
    });
    h.live([0]);
    assert_eq!(h.live(2..6), vec![Replay(0, 2)]);
    assert_eq!(h.seq.buffered(), 4);
    assert_eq!(
        h.live([6, 7]),
        vec![
            Resync(ResyncReason::BufferOverflow),
            Apply(2),
            Apply(3),
            Apply(4),
            Apply(5),
            Apply(6),
            Apply(7)
        ]
    );
    assert_eq!(h.seq.buffered(), 0);
    assert_eq!(h.seq.outstanding_replay(), None);
    assert_eq!(h.seq.counters().overflow_resyncs, 1);
}

/// The buffer is bounded in bytes too: a batch that would take more than the budget overflows
/// it as one batch too many does.
#[test]
fn a_buffer_over_its_byte_budget_resyncs_and_flushes() {
    let size = payload(0, 2).len();
    let mut h = Harness::with(SequencerConfig {
        max_buffered: 100,
        max_buffered_bytes: 2 * size + size / 2,
        ..SequencerConfig::default()
    });
    h.live([0]);
    assert_eq!(h.live([2, 3]), vec![Replay(0, 2)]);
    assert_eq!(h.seq.buffered_bytes(), 2 * size);
    assert_eq!(
        h.live([4]),
        vec![
            Resync(ResyncReason::BufferOverflow),
            Apply(2),
            Apply(3),
            Apply(4)
        ]
    );
    assert_eq!((h.seq.buffered(), h.seq.buffered_bytes()), (0, 0));
    assert_eq!(h.seq.counters().overflow_resyncs, 1);
}

/// A full buffer overflowed by a batch below the buffered ones (a late batch filling a hole out
/// of order) is flushed whole, that batch in its place: one resync, not one per later batch.
#[test]
fn an_overflow_by_a_batch_below_the_buffered_ones_flushes_them_all() {
    let mut h = Harness::with(SequencerConfig {
        max_buffered: 2,
        recent_window: 16,
        ..SequencerConfig::default()
    });
    h.live([0]);
    assert_eq!(h.live([4, 5]), vec![Replay(0, 4)]);
    assert_eq!(h.seq.buffered(), 2);
    assert_eq!(
        h.live([2]),
        vec![
            Resync(ResyncReason::BufferOverflow),
            Apply(2),
            Apply(4),
            Apply(5)
        ]
    );
    assert_eq!(h.seq.buffered(), 0);
    assert_eq!(h.seq.outstanding_replay(), None);
    assert_eq!(h.live([6, 7]), vec![Apply(6), Apply(7)]);
    assert_eq!(h.seq.counters().resyncs, 1);
}

/// A buffer overflow inside a replay's answer ends that replay; the hole it leaves behind the
/// buffered batches is asked for at once (before, not until the next live batch or probe).
#[test]
fn an_overflow_inside_a_replay_answer_asks_for_the_next_hole_at_once() {
    let mut h = Harness::with(SequencerConfig {
        max_buffered: 3,
        recent_window: 16,
        ..SequencerConfig::default()
    });
    h.live([0]);
    assert_eq!(h.live([3]), vec![Replay(0, 3)]);
    assert_eq!(h.live([10, 11]), vec![], "buffered");
    // The anchor, the hole, then batches ahead of what is applied: 6 is buffered, 8 overflows.
    assert_eq!(
        h.replay([0, 1, 2, 4, 6, 8], false),
        vec![
            Apply(1),
            Apply(2),
            Apply(3),
            Apply(4),
            Resync(ResyncReason::BufferOverflow),
            Apply(6),
            Apply(8),
            Replay(8, 10)
        ]
    );
}

#[test]
fn memory_stays_bounded_under_a_stream_of_gaps() {
    let mut h = Harness::with(SequencerConfig {
        max_buffered: 8,
        recent_window: 8,
        ..SequencerConfig::default()
    });
    h.live([0]);
    // Every other batch lost and the replay endpoint never answers.
    for s in (2..10_000).step_by(2) {
        h.live([s]);
        assert!(h.seq.buffered() <= 8);
    }
    assert!(h.seq.counters().overflow_resyncs > 0);
}

#[derive(Debug, Clone)]
enum Op {
    Live(u64, bool),
    ReplayBatch(u64, bool),
    ReplayEnd,
    ReplayFailed,
    StaleEnd(u64),
    /// A probe of a quiet stream (anchored at the last batch applied) or a catch-up.
    Probe(bool),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0u64..40, any::<bool>()).prop_map(|(s, b)| Op::Live(s, b)),
        3 => (0u64..40, any::<bool>()).prop_map(|(s, b)| Op::ReplayBatch(s, b)),
        1 => Just(Op::ReplayEnd),
        1 => Just(Op::ReplayFailed),
        1 => (0u64..5).prop_map(Op::StaleEnd),
        1 => any::<bool>().prop_map(Op::Probe),
    ]
}

proptest::proptest! {
    /// Whatever arrives, in whatever order: applied sequence numbers strictly increase except
    /// across a restart resync, the buffer stays within its bound, at most one replay is
    /// outstanding, and every applied payload is one that was fed for that sequence number.
    #[test]
    fn random_inputs_keep_the_invariants(ops in proptest::collection::vec(op(), 0..200)) {
        // A byte budget of about four of the test's payloads: both bounds get hit.
        let config = SequencerConfig { max_buffered: 6, max_buffered_bytes: 100, recent_window: 8 };
        let mut seq: Sequencer<Vec<u8>> = Sequencer::new(config);
        let mut last_applied: Option<u64> = None;
        let mut seen: Vec<ReplayId> = Vec::new();
        for op in ops {
            match op {
                Op::Live(s, alt) => seq.handle_live(s, payload(u32::from(alt), s)),
                Op::ReplayBatch(s, alt) => {
                    if let Some((id, _, _)) = seq.outstanding_replay() {
                        seq.handle_replay_batch(id, s, payload(u32::from(alt), s));
                    }
                }
                Op::ReplayEnd => {
                    if let Some((id, _, _)) = seq.outstanding_replay() {
                        seq.handle_replay_end(id);
                    }
                }
                Op::ReplayFailed => {
                    if let Some((id, _, _)) = seq.outstanding_replay() {
                        seq.handle_replay_failed(id);
                    }
                }
                Op::StaleEnd(i) => {
                    // An end marker for some earlier request (possibly the current one).
                    if !seen.is_empty() {
                        let id = seen[(i as usize) % seen.len()];
                        seq.handle_replay_end(id);
                    }
                }
                Op::Probe(true) => {
                    seq.probe();
                }
                Op::Probe(false) => seq.catch_up(),
            }
            if let Some((id, _, _)) = seq.outstanding_replay()
                && seen.last() != Some(&id)
            {
                seen.push(id);
            }
            proptest::prop_assert!(seq.buffered() <= config.max_buffered);
            proptest::prop_assert!(seq.buffered_bytes() <= config.max_buffered_bytes);
            while let Some(action) = seq.poll_action() {
                match action {
                    Action::Apply {
                        seq: s, payload: p, ..
                    } => {
                        if let Some(last) = last_applied {
                            proptest::prop_assert!(s > last, "applied {s} after {last}");
                        }
                        proptest::prop_assert!(p == payload(0, s) || p == payload(1, s));
                        last_applied = Some(s);
                    }
                    Action::Resync { reason: ResyncReason::Restart } => last_applied = None,
                    Action::Resync { .. } => {}
                    Action::Replay { from, to, .. } => proptest::prop_assert!(from < to),
                }
            }
        }
    }
}

/// A sequencer resumed after `position` with the fingerprints another sequencer recorded.
fn resumed(position: u64) -> Harness {
    let mut first = Harness::new();
    first.live(0..=position);
    let recent: Vec<(u64, u64)> = first.seq.recent().collect();
    Harness {
        seq: Sequencer::resume(SequencerConfig::default(), position, &recent),
        incarnation: 0,
    }
}

#[test]
fn a_resumed_sequencer_continues_after_its_position() {
    let mut h = resumed(9);
    // Batches the snapshot already held are duplicates; the next one is applied.
    assert_eq!(h.live([8, 9, 10]), vec![Apply(10)]);
    assert_eq!(h.seq.counters().duplicates, 2);
    // A batch beyond the next one is a gap, replayed as usual.
    assert_eq!(h.live([13]), vec![Replay(10, 13)]);
    assert_eq!(
        h.replay(11..13, true),
        vec![Apply(11), Apply(12), Apply(13)]
    );
    assert_eq!(h.seq.counters().resyncs, 0);
}

/// A restart found by a replay's anchor asks for the new incarnation from 0, counted as one
/// late join; the new incarnation's first live batch, arriving while that replay is out, asks
/// for nothing more and is not counted again.
#[test]
fn a_restart_found_by_the_anchor_is_one_late_join() {
    let mut h = resumed(10);
    assert_eq!(h.live([12]), vec![Replay(10, 12)]);
    h.incarnation = 1;
    let found = h.replay([10], false);
    assert_eq!(
        found.first(),
        Some(&Resync(ResyncReason::Restart)),
        "{found:?}"
    );
    assert!(h.seq.outstanding_replay().is_some());
    assert_eq!(h.live([5]), vec![]);
    assert_eq!(h.seq.counters().late_joins, 1);
}

#[test]
fn a_resumed_sequencer_skips_ahead_by_replay() {
    let mut h = resumed(4);
    // The engine went on while the consumer was down: the first live batch is 20.
    assert_eq!(h.live([20]), vec![Replay(4, 20)]);
    assert_eq!(h.seq.counters().late_joins, 0, "not a late join: resumed");
    let applied = h.replay(5..21, true);
    assert_eq!(applied.len(), 16);
    assert_eq!(applied.first(), Some(&Apply(5)));
}

#[test]
fn a_resumed_sequencer_detects_an_engine_that_restarted_meanwhile() {
    let mut h = resumed(9);
    // A new incarnation: seq 0 again, other content than what the snapshot recorded.
    h.incarnation = 1;
    assert_eq!(
        h.live([0, 1]),
        vec![Resync(ResyncReason::Restart), Apply(0), Apply(1)]
    );
    assert_eq!(h.seq.counters().restarts, 1);
}

#[test]
fn a_catch_up_replays_what_a_quiet_engine_published_meanwhile() {
    let mut h = resumed(9);
    h.seq.catch_up();
    // Anchored at the position: the engine's copy of batch 9 is checked, not applied.
    assert_eq!(h.drain(), vec![Replay(9, u64::MAX)]);
    // A live batch arriving during the catch-up waits for it.
    assert_eq!(h.live([14]), vec![]);
    assert_eq!(
        h.replay(9..15, true),
        vec![Apply(10), Apply(11), Apply(12), Apply(13), Apply(14)]
    );
    // The live stream goes on; replayed batches arriving live again are duplicates.
    assert_eq!(h.live([14, 15]), vec![Apply(15)]);
    let c = *h.seq.counters();
    assert_eq!((c.catch_ups, c.resyncs, c.duplicates), (1, 0, 2), "{c:?}");
}

#[test]
fn a_catch_up_with_nothing_new_or_no_answer_changes_nothing() {
    let mut h = resumed(9);
    h.seq.catch_up();
    h.drain();
    // An endpoint never seen to keep a ring answers with the end marker alone: not read as a
    // restart (an engine may run without a ring). Its whole ring is asked for; the end marker
    // alone again leaves it at that.
    assert_eq!(h.replay([], true), vec![Replay(0, u64::MAX)]);
    assert_eq!(h.replay([], true), vec![]);
    // Nothing after 9: the anchor, then the end marker.
    h.seq.catch_up();
    h.drain();
    assert_eq!(h.replay([9], true), vec![]);
    assert_eq!(h.live([10]), vec![Apply(10)]);
    // No answer at all (the engine is down): not a loss.
    h.seq.catch_up();
    h.drain();
    let id = h.replay_id();
    h.seq.handle_replay_failed(id);
    assert_eq!(h.drain(), vec![]);
    assert_eq!(h.live([11]), vec![Apply(11)]);
    assert_eq!(h.seq.counters().resyncs, 0);
}

#[test]
fn a_catch_up_that_starts_late_resyncs() {
    let mut h = resumed(9);
    h.seq.catch_up();
    h.drain();
    // The engine's ring no longer holds 10..20. The first time, 10..20 may still be on their
    // way on the live stream: ignored. The same again with nothing applied meanwhile: lost.
    assert_eq!(h.replay(20..22, true), vec![]);
    h.seq.catch_up();
    h.drain();
    assert_eq!(
        h.replay(20..22, true),
        vec![Resync(ResyncReason::ReplayIncomplete), Apply(20), Apply(21)]
    );
}

/// A probe of a quiet stream: none before the sequencer has a position or while a replay is
/// outstanding; it fetches the batch the live stream lost after the last one applied (the engine
/// published nothing after it, so no gap ever shows); a ring that lost it resyncs; counted apart
/// from catch-ups and gaps.
#[test]
fn a_probe_finds_the_last_batch_the_live_stream_lost() {
    let mut h = Harness::new();
    assert!(!h.seq.probe(), "nothing applied, nothing resumed: no probe");
    assert_eq!(h.drain(), vec![]);
    assert_eq!(h.live([0, 1]), vec![Apply(0), Apply(1)]);
    // Batch 2 was published but lost on the live stream; the engine then went quiet. The probe
    // asks from the last batch applied (1), whose copy is checked and not applied.
    assert!(h.seq.probe());
    assert_eq!(h.drain(), vec![Replay(1, u64::MAX)]);
    assert!(!h.seq.probe(), "one replay at a time");
    assert_eq!(h.replay([1, 2], true), vec![Apply(2)]);
    // Quiet with nothing lost: the last batch and the end marker come back.
    assert!(h.seq.probe());
    assert_eq!(h.drain(), vec![Replay(2, u64::MAX)]);
    assert_eq!(h.replay([2], true), vec![]);
    // The ring has just dropped the last batch applied, and holds the lost one after it.
    h.live([3]);
    assert!(h.seq.probe());
    h.drain();
    assert_eq!(h.replay([4], true), vec![Apply(4)]);
    // Lost again, and the ring no longer holds 5..7 when the probe asks: ignored the first
    // time (they may be on their way live), a loss the second.
    assert!(h.seq.probe());
    h.drain();
    assert_eq!(h.replay(7..9, true), vec![]);
    assert!(h.seq.probe());
    h.drain();
    assert_eq!(
        h.replay(7..9, true),
        vec![Resync(ResyncReason::ReplayIncomplete), Apply(7), Apply(8)]
    );
    let c = *h.seq.counters();
    assert_eq!(
        (c.probes, c.catch_ups, c.replays_requested, c.replay_resyncs),
        (5, 0, 5, 1),
        "{c:?}"
    );
    assert_eq!(
        (c.duplicates, c.restarts),
        (0, 0),
        "an anchor is not a duplicate: {c:?}"
    );
    // A resumed sequencer has a position: it can probe at once.
    let mut h = resumed(9);
    assert!(h.seq.probe());
    assert_eq!(h.drain(), vec![Replay(9, u64::MAX)]);
}

/// An engine that restarts and stays quiet shows nothing on the live stream; a probe anchored at
/// the last batch applied finds it, whether the new incarnation has published fewer batches
/// (nothing from the anchor on: only the end marker) or more (another batch under the anchor's
/// number). Either way the worker is resynced and the new incarnation replayed from 0.
#[test]
fn a_probe_finds_an_engine_that_restarted_and_went_quiet() {
    let mut h = Harness::new();
    assert_eq!(h.live(0..5).len(), 5);
    assert!(h.seq.probe());
    assert_eq!(h.drain(), vec![Replay(4, u64::MAX)]);
    assert_eq!(
        h.replay([4], true),
        vec![],
        "the engine still holds batch 4"
    );

    // Restarted; batches 0..3 of the new incarnation went out while no one listened.
    h.incarnation = 1;
    assert!(h.seq.probe());
    h.drain();
    assert_eq!(
        h.replay([], true),
        vec![Resync(ResyncReason::Restart), Replay(0, u64::MAX)]
    );
    assert!(
        !h.seq.probe(),
        "the new incarnation's replay is outstanding"
    );
    assert_eq!(h.replay(0..3, true), vec![Apply(0), Apply(1), Apply(2)]);

    // Restarted again, and this incarnation has published past the last batch applied (2).
    h.incarnation = 2;
    assert!(h.seq.probe());
    h.drain();
    let old = h.replay_id();
    assert_eq!(
        h.replay([2], false),
        vec![Resync(ResyncReason::Restart), Replay(0, u64::MAX)]
    );
    // The rest of the abandoned answer is stale.
    h.seq.handle_replay_batch(old, 3, payload(2, 3));
    h.seq.handle_replay_end(old);
    assert_eq!(h.drain(), vec![]);
    assert_eq!(
        h.replay(0..5, true),
        vec![Apply(0), Apply(1), Apply(2), Apply(3), Apply(4)]
    );
    assert_eq!(h.live([5]), vec![Apply(5)]);
    let c = *h.seq.counters();
    assert_eq!(
        (c.restarts, c.resyncs, c.probes, c.stale_replay_frames),
        (2, 2, 3, 2),
        "{c:?}"
    );
}

/// Replay timeouts with made-up instants, no sleeping: nothing happens before the deadline or
/// without one; an answer that moves the deadline postpones the failure; at the deadline the
/// replay fails like a reported failure (resync, then the buffered batches), counted as a
/// timeout, and its late answers are stale.
#[test]
fn a_replay_times_out_at_its_deadline_and_answers_push_the_deadline_back() {
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    let mut h = Harness::new();
    h.live([0]);
    assert_eq!(h.live([4, 5]), vec![Replay(0, 4)]);
    let id = h.replay_id();
    // No deadline given yet: no timeout, whatever the time.
    assert_eq!(h.seq.poll_timeout(), None);
    assert_eq!(h.seq.handle_timeout(at(1_000_000)), None);
    h.seq.set_replay_deadline(id, at(100));
    assert_eq!(h.seq.poll_timeout(), Some(at(100)));
    assert_eq!(h.seq.handle_timeout(at(99)), None);
    assert_eq!(h.drain(), vec![]);
    // An answer arrives at 80 ms; the caller moves the deadline.
    assert_eq!(h.replay([1], false), vec![Apply(1)]);
    h.seq.set_replay_deadline(id, at(180));
    assert_eq!(h.seq.handle_timeout(at(150)), None);
    assert_eq!(h.seq.handle_timeout(at(180)), Some(id));
    assert_eq!(
        h.drain(),
        vec![Resync(ResyncReason::ReplayFailed), Apply(4), Apply(5)]
    );
    assert_eq!(h.seq.poll_timeout(), None);
    // A deadline for a request that is no longer outstanding changes nothing.
    h.seq.set_replay_deadline(id, at(300));
    assert_eq!(h.seq.poll_timeout(), None);
    assert_eq!(h.seq.handle_timeout(at(500)), None);
    let c = *h.seq.counters();
    assert_eq!((c.replay_timeouts, c.replay_resyncs), (1, 1), "{c:?}");
    // The timed-out replay's late answers are stale.
    h.seq.handle_replay_batch(id, 2, payload(0, 2));
    assert_eq!(h.drain(), vec![]);
    assert_eq!(h.seq.counters().stale_replay_frames, 1);
}

/// A catch-up that times out is not a loss (nothing says a batch was missed): no resync.
#[test]
fn a_catch_up_that_times_out_changes_nothing() {
    let start = Instant::now();
    let mut h = resumed(9);
    h.seq.catch_up();
    h.drain();
    let id = h.replay_id();
    h.seq
        .set_replay_deadline(id, start + Duration::from_millis(10));
    assert_eq!(
        h.seq.handle_timeout(start + Duration::from_millis(10)),
        Some(id)
    );
    assert_eq!(h.drain(), vec![]);
    assert_eq!(h.live([10]), vec![Apply(10)]);
    let c = *h.seq.counters();
    assert_eq!((c.replay_timeouts, c.resyncs), (1, 0), "{c:?}");
}

/// A restarted engine whose first batch seen live is above the last one applied looks like a
/// gap on the live stream. The gap's replay is anchored at the last batch applied: the new
/// incarnation's batch under that number has other content, so the worker is resynced and the
/// new incarnation replayed from 0, instead of its batches being applied over the old ones.
#[test]
fn a_restart_that_looks_like_a_gap_is_found_by_the_anchor() {
    let mut h = Harness::new();
    assert_eq!(h.live(0..5).len(), 5);
    h.incarnation = 1;
    assert_eq!(h.live([9]), vec![Replay(4, 9)]);
    assert_eq!(
        h.replay(4..10, true),
        vec![Resync(ResyncReason::Restart), Replay(0, u64::MAX)]
    );
    assert_eq!(
        h.replay(0..10, true),
        (0..10).map(Apply).collect::<Vec<_>>()
    );
    assert_eq!(h.live([10]), vec![Apply(10)]);
    let c = *h.seq.counters();
    assert_eq!(
        (c.restarts, c.resyncs, c.replay_resyncs),
        (1, 1, 0),
        "{c:?}"
    );
}

/// An open-ended request does not hold the live stream back: batches keep being applied while
/// it is out. A small ring that has moved past the request's start by the time it answers has
/// then lost nothing the stream still needs — the answer is compared with what is applied at
/// that moment, not when the request went out — while one that starts past what is applied has.
#[test]
fn a_ring_that_moved_on_during_a_probe_of_a_busy_stream_lost_nothing() {
    let mut h = Harness::new();
    assert_eq!(h.live(0..3).len(), 3);
    assert!(h.seq.probe());
    assert_eq!(h.drain(), vec![Replay(2, u64::MAX)]);
    assert_eq!(h.live(3..8).len(), 5);
    // The ring now holds 5..8 only.
    assert_eq!(h.replay(5..8, true), vec![]);
    assert_eq!(h.live([8]), vec![Apply(8)]);
    // Again, and this time the ring starts past what is applied. 9 and 10 may still be on
    // their way live: the answer is ignored, and they come.
    assert!(h.seq.probe());
    h.drain();
    assert_eq!(h.replay(11..13, true), vec![]);
    assert_eq!(h.live(9..13).len(), 4);
    // Past what is applied once more (13 to 16 are not coming): ignored, then, with nothing
    // applied in between, a loss.
    for _ in 0..2 {
        assert!(h.seq.probe());
        h.drain();
        let answer = h.replay(17..19, true);
        if !answer.is_empty() {
            assert_eq!(
                answer,
                vec![Resync(ResyncReason::ReplayIncomplete), Apply(17), Apply(18)]
            );
        }
    }
    assert_eq!(h.seq.next_seq(), 19);
    let c = *h.seq.counters();
    assert_eq!((c.resyncs, c.duplicates), (1, 3), "{c:?}");
}

/// After a restore, the engine restarted meanwhile, published a few batches (fewer than the
/// position) and went quiet. The catch-up, anchored at the position, gets the end marker alone,
/// and no ring has been seen yet, so that proves nothing; the whole ring is asked for, and a
/// batch in it shows the ring exists: a restart, and the answer is the new incarnation's.
#[test]
fn a_catch_up_finds_a_restart_by_asking_for_the_whole_ring() {
    let mut h = resumed(9);
    h.seq.catch_up();
    assert_eq!(h.drain(), vec![Replay(9, u64::MAX)]);
    h.incarnation = 1;
    assert_eq!(h.replay([], true), vec![Replay(0, u64::MAX)]);
    assert_eq!(
        h.replay(0..3, true),
        vec![Resync(ResyncReason::Restart), Apply(0), Apply(1), Apply(2)]
    );
    assert_eq!(h.live([3]), vec![Apply(3)]);
    let c = *h.seq.counters();
    assert_eq!(
        (
            c.restarts,
            c.resyncs,
            c.catch_ups,
            c.probes,
            c.replays_requested
        ),
        (1, 1, 1, 1, 2),
        "{c:?}"
    );
}
