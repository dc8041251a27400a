//! The replica side of the event log (`kvatlas serve --consume-from`): restore the newest
//! snapshot of the bucket, consume the stream from the sequence after the one it covers, apply
//! every record, and write snapshots in turn with the other replicas.
//!
//! **Exactness.** A replica applies the records in stream order, so replicas that read the same
//! stream hold the same state at the same stream sequence, with no timing guess. Per source it
//! keeps the position and the recent `(sequence, fingerprint)` pairs (restored with a snapshot,
//! as index checkpoints), and drops:
//! - a batch it has applied (same sequence and fingerprint): a second ingest's copy that came
//!   after the stream's duplicate window;
//! - a batch at or below the source's position that is not a resync: an ingest re-publishing
//!   what it replayed from an engine (a late join).
//!
//! A resync record (the engine restarted, or an ingest lost batches for good) is applied even
//! when its sequence is not new: it begins by clearing the source's ranks.
//!
//! **The live path** (`NatsLog::live`). An ingest also publishes each record at once on core
//! NATS, with the digest of the record it published before it for the same source. A caught-up
//! replica applies a live record when it continues its source's chain (its predecessor is the
//! last record the replica holds of that source: the stream's last, or a live one still
//! pending) and the source's sequencing admits it; the record's digest then waits, pending,
//! for the stream:
//! - the stream delivers the same bytes next for that source: confirmed, not applied again;
//! - the stream delivers a record the stream alone would have dropped (stale, duplicate): dropped
//!   as before, the pending records wait on;
//! - the stream delivers anything else the stream alone would have applied: the replica no longer
//!   holds the stream's state (two ingests disagreed about a source). It counts a divergence,
//!   reports not ready, empties its indexes, restores the newest snapshot and consumes the stream
//!   from after it: the stream's state again — when a snapshot the stream continues is there, or
//!   the stream holds every record. Otherwise that would lose, of every worker, what only the
//!   records retention dropped held: the replica removes the ranks the diverged source changed
//!   alone (its own and those of its unconfirmed live records: blocks, checkpoints, sequencing),
//!   applies the stream's record to them afresh and goes on.
//!
//! With one ingest the stream carries a source's records in the order they were published live,
//! so the third case needs two ingests that publish different records for one source (one of
//! them lost batches, or joined late). A live record that does not continue the chain (lost on
//! core NATS, a gap, a resync the replica has not seen) is left to the stream; the chain picks up
//! again once the stream has delivered its predecessor.
//!
//! **Snapshots.** A snapshot is a consistent cut of the stream's state: when one is due the
//! live path pauses until the stream has confirmed every pending record (milliseconds), then the
//! cut is taken. A cut: the consumer stops between two records,
//! every index's writers finish what they hold, and the images are taken before the next
//! record is read; they are encoded and put while consumption goes on. The object holds [`SNAPSHOT_MAGIC`], the stream sequence it covers (u64 LE)
//! and the native snapshot (`snapshot.rs`). Each cut is an object of its own, named by the
//! sequence it covers, its description naming that sequence and the stream's creation time;
//! readers take the current stream's highest ([`SnapshotObject::rank`]), and a put deletes all
//! but the two best.
//!
//! **Retention.** If the stream no longer holds the next sequence (the replica fell behind
//! the retention window), the replica restores the newest snapshot if it covers the hole and
//! continues after it (counted); otherwise it counts the sequences lost and continues. Live
//! records still pending then may have had their copies among the records lost: a source's
//! next record from the stream confirms a later pending one and keeps those before it, or, if
//! the stream alone would apply it, keeps them all ([`Chain::judge`]) — the replica keeps what
//! its live path applied rather than taking the next record for a divergence.
//!
//! **A stream created again** (deleted, or nats-server's storage lost) is told by its creation
//! time: the replica keeps its state and reads the new stream from its start (counted); the
//! equal states of equal sequences then hold only among replicas that had read the same part
//! of the old stream.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use kvatlas_index::Worker;
use tokio::io::AsyncReadExt as _;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::log_record::{Body, Record};
use crate::nats::{LogStats, NatsLog, SNAPSHOT_OBJECT};
use crate::registry::{IndexEntry, IndexKey, Registry};
use crate::state::State;

/// The first bytes of a replica snapshot object.
pub(crate) const SNAPSHOT_MAGIC: &[u8; 8] = b"KVATREPL";
/// Recent `(sequence, fingerprint)` pairs kept per source.
const RECENT: usize = 1024;
/// Live records of one source applied and not yet confirmed by the stream, at most (fewer than
/// [`RECENT`], so that the pairs before them are still known).
const LIVE_PENDING: usize = 256;

/// What a replica does with a batch of a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Apply it.
    Apply,
    /// Already applied: drop.
    Duplicate,
    /// At or below the source's position, not a resync: drop.
    Stale,
}

/// One source's sequencing state at a replica.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SourceState {
    position: Option<u64>,
    recent: VecDeque<(u64, u64)>,
}

impl SourceState {
    /// The state a checkpoint recorded.
    pub(crate) fn from_mark(position: u64, recent: &[(u64, u64)]) -> Self {
        let mut state = Self {
            position: Some(position),
            recent: recent.iter().copied().collect(),
        };
        while state.recent.len() > RECENT {
            state.recent.pop_front();
        }
        state
    }

    /// Decides about a batch (see the module docs) and, if it is applied, records it.
    pub(crate) fn admit(&mut self, seq: Option<u64>, fingerprint: u64, resync: bool) -> Admission {
        let Some(seq) = seq else {
            return Admission::Apply;
        };
        if self.recent.contains(&(seq, fingerprint)) {
            return Admission::Duplicate;
        }
        if !resync && self.position.is_some_and(|position| seq <= position) {
            return Admission::Stale;
        }
        self.position = Some(seq);
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, fingerprint));
        Admission::Apply
    }

    /// What [`Self::admit`] would have decided about a batch before the last `pending`
    /// admissions that recorded a batch (sequenced ones: an unsequenced batch leaves no pair),
    /// given the position before them (`None`: no position; ignored if `pending` is 0), without
    /// recording anything.
    fn admit_before(
        &self,
        pending: usize,
        position_before: Option<u64>,
        seq: Option<u64>,
        fingerprint: u64,
        resync: bool,
    ) -> Admission {
        let Some(seq) = seq else {
            return Admission::Apply;
        };
        let (position, known) = if pending == 0 {
            (self.position, self.recent.len())
        } else {
            (position_before, self.recent.len().saturating_sub(pending))
        };
        if self
            .recent
            .iter()
            .take(known)
            .any(|&pair| pair == (seq, fingerprint))
        {
            return Admission::Duplicate;
        }
        if !resync && position.is_some_and(|position| seq <= position) {
            return Admission::Stale;
        }
        Admission::Apply
    }
}

/// A source's place on the live path at a replica (see the module docs).
#[derive(Debug, Default)]
struct Chain {
    /// The digest of the last record of the source the stream delivered (`None`: none yet).
    head: Option<u64>,
    /// The live records applied and not yet confirmed, oldest first.
    pending: VecDeque<LiveId>,
    /// The source's position before the first pending record.
    position_before: Option<u64>,
    /// Whether the stream skipped records (retention, no snapshot covering them) since it
    /// last delivered a record of this source: the stream's copies of the live records
    /// pending, applied before or after the skip (a live record late on core NATS), may have
    /// been among them. Cleared once the stream delivers a record of the source with none
    /// pending, or the last pending one: a live record applied after that continues the
    /// stream's record, so its copy comes after the hole.
    after_loss: bool,
}

/// What a replica makes of the stream's next record of a source ([`Chain::judge`]).
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// The stream's copy of the pending live records named (oldest first): applied already.
    /// More than one only after a loss ([`Chain::after_loss`]): the others' copies were among
    /// the records the stream skipped.
    Confirmed(Vec<LiveId>),
    /// The record is judged as the stream alone would judge it. `kept`: the pending live
    /// records taken as the stream's, their copies among the records the stream skipped.
    Judged {
        admission: Admission,
        kept: Vec<LiveId>,
    },
    /// Something else the stream alone would have applied: the replica no longer holds the
    /// stream's state.
    Diverged,
}

impl Chain {
    /// The stream delivered the oldest pending record: it is the stream's now. The chain goes
    /// on from it (its ingest's next live record names it).
    fn confirm_front(&mut self) -> Option<LiveId> {
        let live = self.pending.pop_front()?;
        self.head = Some(live.digest);
        self.position_before = live.seq.or(self.position_before);
        // The stream delivered (or skipped) every record applied live: the next one applied
        // live continues it, its copy after the hole.
        if self.pending.is_empty() {
            self.after_loss = false;
        }
        Some(live)
    }

    /// The pending records whose admission recorded a `(sequence, fingerprint)` pair: the
    /// sequenced ones (an unsequenced batch is applied without one).
    fn recorded_pending(&self) -> usize {
        self.pending
            .iter()
            .filter(|live| live.seq.is_some())
            .count()
    }

    /// The digest a live record must name as its predecessor to continue this chain.
    fn tip(&self) -> Option<u64> {
        self.pending.back().map(|id| id.digest).or(self.head)
    }

    /// Judges the stream's next record of this chain's source, `record` (see the module
    /// docs), recording in `source` and here what the verdict applies or confirms (the caller
    /// forgets the confirmed and kept records' digests, and applies an admitted record).
    ///
    /// After a loss ([`Self::after_loss`]) the stream may no longer hold the oldest pending
    /// records: with one ingest the stream carries a source's records in the order they went
    /// live, so a record equal to a later pending one confirms it and those before it, and a
    /// record the stream alone would apply after every pending one keeps them all (their
    /// copies were skipped). Either way the replica keeps what the live path applied, the
    /// engine's records, rather than taking the next record for a divergence and going back
    /// to an older state. (Records the stream delivers again later are dropped by the
    /// source's sequencing, as any other copy.)
    fn judge(&mut self, source: &mut SourceState, record: &LiveId) -> Verdict {
        let Some(front) = self.pending.front().copied() else {
            self.after_loss = false;
            self.head = Some(record.digest);
            return Verdict::Judged {
                admission: source.admit(record.seq, record.fingerprint, record.resync),
                kept: Vec::new(),
            };
        };
        // Another ingest's copy of a live record is the live record too (the same bytes are
        // confirmed before decoding).
        let matched = if front.is(record) {
            Some(0)
        } else if self.after_loss {
            self.pending.iter().position(|live| live.is(record))
        } else {
            None
        };
        if let Some(last) = matched {
            let confirmed = (0..=last).filter_map(|_| self.confirm_front()).collect();
            return Verdict::Confirmed(confirmed);
        }
        // What the stream alone would do: drop it (the pending records wait on), or apply it,
        // which the live path got ahead of.
        let admission = source.admit_before(
            self.recorded_pending(),
            self.position_before,
            record.seq,
            record.fingerprint,
            record.resync,
        );
        if admission != Admission::Apply {
            self.head = Some(record.digest);
            return Verdict::Judged {
                admission,
                kept: Vec::new(),
            };
        }
        if !self.after_loss {
            return Verdict::Diverged;
        }
        let kept = std::iter::from_fn(|| self.confirm_front()).collect();
        self.head = Some(record.digest);
        Verdict::Judged {
            admission: source.admit(record.seq, record.fingerprint, record.resync),
            kept,
        }
    }
}

/// What identifies a live record when the stream delivers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LiveId {
    /// Its digest (`log_record::digest`).
    digest: u64,
    /// Its batch's sequence number, fingerprint and resync flag.
    seq: Option<u64>,
    fingerprint: u64,
    resync: bool,
    /// Its batch's engine stamp (Unix µs), if any.
    published_micros: Option<i64>,
    /// For a resync, the digest of its mutations (`log_record::resync_content`); else 0.
    content: u64,
}

impl LiveId {
    /// Whether the stream's record `other` is this live record: the same bytes, or, for an
    /// engine's sequenced batch, the same sequence number, fingerprint (the hash of the
    /// engine's payload, which fixes the mutations) and resync flag, and for a resync the same
    /// mutations (its clears are the ingest's, not the engine's). (Two ingests stamp the same
    /// batch with publish times that may differ by a microsecond: the bytes differ, the state
    /// they make does not.)
    fn is(&self, other: &LiveId) -> bool {
        self.digest == other.digest
            || (self.seq.is_some()
                && self.fingerprint != 0
                && (self.seq, self.fingerprint, self.resync, self.content)
                    == (other.seq, other.fingerprint, other.resync, other.content))
    }
}

/// The stream delivered, for a source with live records pending, something else the stream
/// alone would have applied: the replica no longer holds the stream's state of instance
/// `instance` of index `key`.
#[derive(Debug)]
struct Diverged {
    key: IndexKey,
    instance: u64,
    /// The rank whose source diverged (`None`: every rank, an unregistration of them all).
    rank: Option<u32>,
}

/// The replica's running part.
#[derive(Debug)]
pub(crate) struct Replica {
    pub(crate) task: tokio::task::JoinHandle<()>,
    pub(crate) stop: CancellationToken,
}

/// Connects, bootstraps from the newest snapshot and starts consuming (the server reports
/// not ready until the replica has read everything the stream held when it started).
pub(crate) async fn start(
    state: Arc<State>,
    log: NatsLog,
    connect_timeout: Duration,
) -> Result<Replica, String> {
    let stats = Arc::clone(state.registry.log_stats());
    let js = crate::nats::connect(&log, connect_timeout, Arc::clone(&stats)).await?;
    let stream = crate::nats::stream(&js, &log).await?;
    let bucket = crate::nats::snapshot_bucket(&js, &log).await?;
    let bucket_stream = js
        .get_stream(format!("OBJ_{}", log.snapshot_bucket))
        .await
        .map_err(|e| format!("the snapshot bucket's stream: {e}"))?;
    state.set_bootstrapping(true);
    let stream_created = created_nanos(stream.cached_info());
    let reads_from = stream.cached_info().state.first_sequence;
    let covered = restore_newest(
        &state.registry,
        &bucket,
        &log.stream,
        stream_created,
        reads_from,
        &stats,
    )
    .await?;
    let live = if log.live {
        let client = js.client();
        let live = client
            .subscribe(log.live_subjects())
            .await
            .map_err(|e| format!("subscribing to the live path: {e}"))?;
        Some(live)
    } else {
        None
    };
    let stop = CancellationToken::new();
    let stream_identity = watch_stream_identity(stream.clone(), stop.clone());
    let consumer = Consumer {
        state,
        stats,
        log,
        js,
        stream,
        stream_created,
        stream_identity,
        bucket,
        bucket_stream,
        sources: HashMap::new(),
        live,
        chains: HashMap::new(),
        live_pending: HashMap::new(),
        live_paused: false,
        overdue_stream_end: None,
        next_stream_info: tokio::time::Instant::now(),
        stream_unreachable: None,
        applied: covered.unwrap_or(0),
        newest_seen: SeenSnapshots::new(tokio::time::Instant::now()),
        caught_up: false,
        last_snapshot: tokio::time::Instant::now(),
        snapshot_put: None,
    };
    let task = tokio::spawn(consumer.run(stop.clone()));
    Ok(Replica { task, stop })
}

struct Consumer {
    state: Arc<State>,
    stats: Arc<LogStats>,
    log: NatsLog,
    js: jetstream::Context,
    stream: jetstream::stream::Stream,
    /// When the stream `applied` counts in was created (Unix ns): a stream of the same name
    /// created again (deleted, or nats-server's storage lost) starts its sequences afresh.
    stream_created: i128,
    /// The stream's creation time as last read in the background ([`watch_stream_identity`]).
    stream_identity: tokio::sync::watch::Receiver<Option<i128>>,
    bucket: jetstream::object_store::ObjectStore,
    /// The stream holding the bucket's objects (to purge the markers of deleted ones).
    bucket_stream: jetstream::stream::Stream,
    sources: HashMap<(IndexKey, Worker), SourceState>,
    /// The live path's subscription (`None`: off).
    live: Option<async_nats::Subscriber>,
    /// Per source, its place on the live path.
    chains: HashMap<(IndexKey, Worker), Chain>,
    /// Live records applied and not yet confirmed, over every source: their digests, sources
    /// (so that the stream's copy is confirmed without decoding it) and when they were applied.
    live_pending: HashMap<u64, ((IndexKey, Worker), tokio::time::Instant)>,
    /// A snapshot waits for the pending records: no live record is applied meanwhile.
    live_paused: bool,
    /// The stream's last sequence and when it was read, once a live record was overdue: when
    /// the replica has applied that far and a record overdue before that read is still
    /// unconfirmed, the stream does not hold it (kept until the replica has read that far).
    overdue_stream_end: Option<(u64, tokio::time::Instant)>,
    /// When the stream's end may be asked for next (at most every 5 s: while JetStream is down
    /// each ask waits for its timeout, and the live subscription is not read meanwhile).
    next_stream_info: tokio::time::Instant,
    /// When the stream was last seen out of reach (the connection down, an ask for its end
    /// failing, the consumer stopping on an error). A live record's confirmation wait runs
    /// from then if that is later than its applying: its ingest could not store it meanwhile
    /// and may still be retrying (an outage longer than the wait made every replica take
    /// its pending records for orphans and re-bootstrap at once, as the outage ended).
    stream_unreachable: Option<tokio::time::Instant>,
    /// The last stream sequence applied (or covered by the restored snapshot).
    applied: u64,
    /// Since when this replica has seen the bucket's newest snapshot object: the snapshot
    /// turns judge a snapshot's age by it, not by the object's modification time.
    newest_seen: SeenSnapshots,
    caught_up: bool,
    last_snapshot: tokio::time::Instant,
    /// The snapshot being encoded and put, if any.
    snapshot_put: Option<tokio::task::JoinHandle<()>>,
}

impl Consumer {
    async fn run(mut self, stop: CancellationToken) {
        const FIRST_BACKOFF: Duration = Duration::from_millis(50);
        let mut backoff = FIRST_BACKOFF;
        loop {
            if stop.is_cancelled() {
                return;
            }
            let consumed = self
                .stats
                .consumed
                .load(std::sync::atomic::Ordering::Relaxed);
            match self.consume(&stop).await {
                Ok(()) => return,
                Err(error) => {
                    self.stream_unreachable = Some(tokio::time::Instant::now());
                    // A run that read records was not a failure that repeats (a re-bootstrap,
                    // a divergence): the backoff starts again (it stayed at 2 s for good, the
                    // live path unread meanwhile).
                    if self
                        .stats
                        .consumed
                        .load(std::sync::atomic::Ordering::Relaxed)
                        > consumed
                    {
                        backoff = FIRST_BACKOFF;
                    }
                    tracing::warn!(
                        "the event-log consumer stopped ({error}); resuming in {backoff:?}"
                    );
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Reads from the sequence after `applied` until stopped (`Ok`) or the consumer fails.
    async fn consume(&mut self, stop: &CancellationToken) -> Result<(), String> {
        // The stream and the bucket, created again if they are gone (as at the start).
        self.stream = crate::nats::stream(&self.js, &self.log).await?;
        self.bucket = crate::nats::snapshot_bucket(&self.js, &self.log).await?;
        self.bucket_stream = self
            .js
            .get_stream(format!("OBJ_{}", self.log.snapshot_bucket))
            .await
            .map_err(|e| format!("the snapshot bucket's stream: {e}"))?;
        let (messages, last_sequence, created) = {
            let info = self.stream.cached_info();
            (
                info.state.messages,
                info.state.last_sequence,
                created_nanos(info),
            )
        };
        if created != self.stream_created {
            self.stream_recreated(created);
        } else if last_sequence < self.applied {
            self.stream_shortened(last_sequence);
        }
        if last_sequence > self.applied && messages == 0 {
            // Retention dropped everything after this replica's position (the stream is empty):
            // a skip to the sequence after the last, like one seen on a message.
            if self.skipped(last_sequence + 1).await? {
                return Err("re-bootstrapped from a snapshot".into());
            }
            self.applied = last_sequence;
        }
        if last_sequence <= self.applied {
            self.caught_up();
        }
        let start = self.applied + 1;
        // An ordered pull consumer: the replica fetches what it can apply (a stopped or slow
        // replica is sent no more of the stream than its open pull requests asked for, at most
        // 750 messages; it reads on from its own position, and finds out if retention dropped
        // what it had not read); gaps and stalls recreate it from the last sequence. (The live
        // path's core-NATS subscription has no such bound.)
        let consumer = self
            .stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: self.log.subjects(),
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: start,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating the consumer: {e}"))?;
        // The ordered consumer re-creates itself on its own (after a gap, missed heartbeats, a
        // nats-server restart), also on a stream created again since, from the sequence after
        // its last (or from the start): a message of another consumer than the last is applied
        // only once the stream is known to be the same.
        let mut consumer_name = consumer.cached_info().name.clone();
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| format!("reading the stream: {e}"))?;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let message = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                Ok(()) = self.stream_identity.changed() => {
                    let created = *self.stream_identity.borrow_and_update();
                    if created.is_some_and(|created| created != self.stream_created) {
                        return Err("the stream was created again".into());
                    }
                    continue;
                }
                _ = tick.tick() => {
                    if self.js.client().connection_state()
                        != async_nats::connection::State::Connected
                    {
                        self.stream_unreachable = Some(tokio::time::Instant::now());
                    }
                    if self.live_overdue() && self.read_to_the_streams_end().await? {
                        // Those overdue before the stream's end was read: their copies would
                        // have been read (a later one's may still come).
                        let read = self
                            .overdue_stream_end
                            .map_or_else(tokio::time::Instant::now, |(_, read)| read);
                        let overdue = self.overdue_instances(read);
                        if !self.diverged(overdue).await? {
                            return Err("re-bootstrapped: a live record was never stored".into());
                        }
                    }
                    self.maybe_snapshot().await;
                    continue;
                }
                Some(live) = next_live(&mut self.live) => {
                    self.apply_live(&live).await;
                    continue;
                }
                message = messages.next() => message,
            };
            let Some(message) = message else {
                return Err("the stream ended".into());
            };
            let message = message.map_err(|e| e.to_string())?;
            let arrived = std::time::Instant::now();
            let info = message.info().map_err(|e| format!("message info: {e}"))?;
            if info.consumer != consumer_name {
                self.check_same_stream(Some(info.stream_sequence)).await?;
                info.consumer.clone_into(&mut consumer_name);
            }
            let sequence = info.stream_sequence;
            let pending = info.pending;
            let published_nanos = info.published.unix_timestamp_nanos();
            if sequence <= self.applied {
                continue; // read again after the consumer was recreated
            }
            if sequence > self.applied + 1 && self.skipped(sequence).await? {
                return Err("re-bootstrapped from a snapshot".into());
            }
            if !self
                .apply_message(&message.payload, arrived, published_nanos)
                .await?
            {
                return Err("re-bootstrapped after a live-path divergence".into());
            }
            self.applied = sequence;
            self.stats
                .stream_sequence
                .store(sequence, std::sync::atomic::Ordering::Relaxed);
            let lag = u64::try_from(time_now_nanos() - published_nanos).unwrap_or(0);
            self.stats.lag.observe(Duration::from_nanos(lag));
            if pending == 0 {
                self.caught_up();
            }
            if self.live_paused && self.live_pending.is_empty() {
                self.maybe_snapshot().await;
            }
        }
    }

    /// Applies a live record if it continues its source's chain (see the module docs);
    /// otherwise leaves it to the stream.
    async fn apply_live(&mut self, message: &async_nats::Message) {
        if self.try_apply_live(message).await {
            LogStats::bump(&self.stats.live_applied);
            LogStats::bump(&self.stats.applied);
        } else {
            LogStats::bump(&self.stats.live_skipped);
        }
    }

    /// [`Self::apply_live`]: whether the record was applied.
    async fn try_apply_live(&mut self, message: &async_nats::Message) -> bool {
        if !self.caught_up || self.live_paused {
            return false;
        }
        let arrived = std::time::Instant::now();
        let Some(prev) = message
            .headers
            .as_ref()
            .and_then(|h| h.get(crate::log_record::LIVE_PREV_HEADER))
            .and_then(|v| u64::from_str_radix(v.as_str(), 16).ok())
        else {
            return false;
        };
        let Ok(record) = Record::decode(&message.payload) else {
            return false;
        };
        let Body::Batch {
            seq,
            fingerprint,
            resync,
            published_unix_micros,
            mutations,
        } = &record.body
        else {
            return false;
        };
        if let Some(age) = age_since(*published_unix_micros, time_now_nanos()) {
            self.stats.live_age.observe(age);
        }
        // A record that changes a rank other than its source's is left to the stream: live
        // records are ordered by their source's chain only, so one applied ahead of the
        // stream could overtake a record of that other rank (another source's, or a per-rank
        // unregistration) that the stream holds before it, and the replica then kept a block
        // the ingest had not, or lost one it had, for good.
        if mutations
            .iter()
            .any(|m| m.worker().dp_rank != record.source.dp_rank)
        {
            return false;
        }
        let source_key = (record.key.clone(), record.source);
        let (Some(chain), Some(source)) = (
            self.chains.get_mut(&source_key),
            self.sources.get_mut(&source_key),
        ) else {
            return false;
        };
        let digest = crate::log_record::digest(&message.payload);
        // A record equal to one still pending (an unsequenced batch sent twice) is left to the
        // stream: pending records are found by their digest, so each must be distinct.
        if chain.tip() != Some(prev)
            || chain.pending.len() >= LIVE_PENDING
            || self.live_pending.contains_key(&digest)
        {
            return false;
        }
        let Ok((entry, _)) = self
            .state
            .registry
            .index_for(&record.key, Some(record.block_size))
        else {
            return false;
        };
        let position = source.position;
        if source.admit(*seq, *fingerprint, *resync) != Admission::Apply {
            return false;
        }
        if chain.pending.is_empty() {
            chain.position_before = position;
        }
        chain.pending.push_back(LiveId {
            digest,
            seq: *seq,
            fingerprint: *fingerprint,
            resync: *resync,
            published_micros: *published_unix_micros,
            content: crate::log_record::resync_content(&record.body),
        });
        self.live_pending
            .insert(digest, (source_key, tokio::time::Instant::now()));
        if let Some(unit) = record.into_unit(Some(arrived)) {
            // Fails only when the writers are gone (shutdown).
            let _ = crate::grpc::enqueue(&entry.pool, unit).await;
        }
        true
    }

    /// Confirms the live record whose wire form has `digest`, if it is its source's oldest
    /// pending one (the stream stored it at `stored_nanos`); `false` if it is not pending.
    fn confirm(&mut self, digest: u64, stored_nanos: i128) -> bool {
        let Some((source, _)) = self.live_pending.get(&digest) else {
            return false;
        };
        let Some(chain) = self.chains.get_mut(source) else {
            return false;
        };
        if chain
            .pending
            .front()
            .is_none_or(|live| live.digest != digest)
        {
            return false;
        }
        let live = chain.confirm_front();
        self.live_pending.remove(&digest);
        LogStats::bump(&self.stats.live_confirmed);
        if let Some(age) = live.and_then(|live| age_since(live.published_micros, stored_nanos)) {
            self.stats.stored_age.observe(age);
        }
        true
    }

    /// Whether a live record applied here has waited longer than `--nats-live-confirm-secs`
    /// for the stream's copy. Its ingest published it live and then never stored it (the
    /// ingest died first, or ran out of time at shutdown): the replica holds a record the
    /// stream does not, and, while a snapshot is due, the live path stays paused for it. Such a
    /// replica goes back to the stream's state (counted as a divergence).
    fn live_overdue(&self) -> bool {
        let now = tokio::time::Instant::now();
        self.live_pending
            .values()
            .any(|(_, applied)| self.confirmation_due(*applied) < now)
    }

    /// The instances (index, instance) of the live records whose confirmation was due before
    /// `before`.
    fn overdue_instances(&self, before: tokio::time::Instant) -> Vec<Diverged> {
        let mut overdue: Vec<(IndexKey, Worker)> = self
            .live_pending
            .values()
            .filter(|(_, applied)| self.confirmation_due(*applied) < before)
            .map(|(source, _)| source.clone())
            .collect();
        overdue.sort();
        overdue.dedup();
        overdue
            .into_iter()
            .map(|(key, worker)| Diverged {
                key,
                instance: worker.worker_id,
                rank: Some(worker.dp_rank),
            })
            .collect()
    }

    /// When a live record applied at `applied` has waited its time for the stream's copy:
    /// `--nats-live-confirm-secs` after it was applied, or after the stream was last out of
    /// reach if that is later.
    fn confirmation_due(&self, applied: tokio::time::Instant) -> tokio::time::Instant {
        let from = self
            .stream_unreachable
            .map_or(applied, |unreachable| unreachable.max(applied));
        from + self.log.live_confirm_timeout
    }

    /// Whether a live record overdue for `--nats-live-confirm-secs` is one the stream does not
    /// hold: the replica has read everything the stream held when it was asked, after the
    /// record became overdue, and the record is still unconfirmed. While JetStream is down, or
    /// the replica is behind the stream, the stream's copy may still come (before, either made
    /// the replica empty its indexes and re-bootstrap, and an outage kept it unavailable). The
    /// stream's end is read once and kept until the replica has read that far (a busy stream is
    /// never read to its current end), asked for at most every 5 s and waited for at most
    /// 1 s (the consumer's loop waits meanwhile); each overdue record is judged against the
    /// read that came after it became overdue. `Err`: the stream was created again (its end is
    /// not this replica's to compare; the consumer starts again and reads the new stream).
    async fn read_to_the_streams_end(&mut self) -> Result<bool, String> {
        let now = tokio::time::Instant::now();
        if let Some((end, read)) = self.overdue_stream_end
            && self.applied >= end
        {
            if self
                .live_pending
                .values()
                .any(|(_, applied)| self.confirmation_due(*applied) < read)
            {
                return Ok(true);
            }
            // Read that far, and what is overdue became so after the read: ask again.
            self.overdue_stream_end = None;
        }
        if self.overdue_stream_end.is_none() && now >= self.next_stream_info {
            self.next_stream_info = now + Duration::from_secs(5);
            match tokio::time::timeout(Duration::from_secs(1), self.stream.info()).await {
                Ok(Ok(info)) => {
                    if created_nanos(info) != self.stream_created {
                        return Err("the stream was created again".into());
                    }
                    self.overdue_stream_end = Some((info.state.last_sequence, now));
                }
                _ => self.stream_unreachable = Some(tokio::time::Instant::now()),
            }
        }
        Ok(false)
    }

    /// The stream was created again (deleted, or nats-server lost its storage) at `created`:
    /// counts it and reads the new stream from its start. The indexes are kept (the engines
    /// still hold what they stored; each source's position drops what the new stream repeats):
    /// what only the lost stream held and this replica had not read is lost.
    fn stream_recreated(&mut self, created: i128) {
        LogStats::bump(&self.stats.stream_recreations);
        tracing::error!(
            stream = %self.log.stream,
            stream_sequence = self.applied,
            "the event-log stream was created again (deleted, or nats-server lost its storage): \
             records the old stream held after this replica's position are lost; keeping the \
             state and reading the new stream from its start"
        );
        self.stream_created = created;
        self.read_on_after(0);
    }

    /// Reads the stream on after `sequence`, the live path's chains forgotten (they named
    /// records of a stream that is no longer what this replica reads).
    fn read_on_after(&mut self, sequence: u64) {
        self.applied = sequence;
        self.stats
            .stream_sequence
            .store(sequence, std::sync::atomic::Ordering::Relaxed);
        self.forget_live();
    }

    /// The stream (the same one) ends at `last_sequence`, below what this replica applied: it
    /// lost its tail (nats-server's host crashed before its store reached the disk, or the
    /// stream was restored from a backup). Counted with the streams created again; the replica
    /// keeps its state and reads on after the stream's end, where the next records will be
    /// stored (read from the start, the whole stream would be applied again on top of the
    /// state; read from its own position, the records stored in between would be skipped).
    fn stream_shortened(&mut self, last_sequence: u64) {
        LogStats::bump(&self.stats.stream_recreations);
        tracing::error!(
            stream = %self.log.stream,
            stream_sequence = self.applied,
            last_sequence,
            "the event-log stream ends below this replica's position: it lost records this \
             replica applied (replicas that had not read them lack them); reading on after its end"
        );
        self.read_on_after(last_sequence);
    }

    /// Whether the stream is still the one `applied` counts in, whole (its creation time and
    /// end read now): `Err` to have the consumer start again, which finds out what changed. A
    /// stream that lost its tail is handled here ([`Consumer::stream_shortened`]): by the time
    /// the consumer starts again, the records stored after the outage may have taken the stream
    /// past this replica's position. (One written on that far before this read cannot be told
    /// from one that lost nothing.) `first`: the sequence of the first message of an ordered
    /// consumer that re-created itself — nats-server starts it at the stream's end then, so the
    /// records from it on were stored after the loss and are read (unless it is the stream's
    /// first, where async-nats starts a consumer that had delivered nothing). `Ok`: the
    /// stream's first sequence, as read.
    async fn check_same_stream(&mut self, first: Option<u64>) -> Result<u64, String> {
        let info = tokio::time::timeout(Duration::from_secs(2), self.stream.get_info())
            .await
            .map_err(|_| "stream info: no answer within 2 s".to_owned())?
            .map_err(|e| format!("stream info: {e}"))?;
        if created_nanos(&info) != self.stream_created {
            Err("the stream was created again".into())
        } else if info.state.last_sequence < self.applied {
            let last = info.state.last_sequence;
            let read_on_after = match first {
                Some(first) if first > info.state.first_sequence => (first - 1).min(last),
                _ => last,
            };
            self.stream_shortened(read_on_after);
            Err("the stream ends below this replica's position".into())
        } else {
            Ok(info.state.first_sequence)
        }
    }

    /// Forgets every chain and pending live record (the indexes were replaced).
    fn forget_live(&mut self) {
        self.chains.clear();
        self.live_pending.clear();
        self.live_paused = false;
        self.overdue_stream_end = None;
    }

    /// The stream is no longer what the live path applied for the sources `diverged`: count
    /// it, report not ready, empty every index, restore the newest snapshot and consume again
    /// from after it — if a snapshot the stream continues is there. Without one (snapshots
    /// off, none written yet, or retention dropped records after the newest), that would lose
    /// what only the dropped records held, of every worker: the replica then removes, of each
    /// diverged source, its rank — all its unconfirmed live records changed (their blocks,
    /// checkpoints and sequencing; the stream's next records of it start afresh) —
    /// keeps every other rank's state (a sibling rank fed by an engine of its own, vLLM's data
    /// parallelism), still serving, and goes on consuming. `Ok(true)`: removed in place;
    /// `Ok(false)`: re-bootstrapped (the consumer starts again from after the snapshot).
    async fn diverged(&mut self, diverged: Vec<Diverged>) -> Result<bool, String> {
        // A stream created again is not a divergence: the consumer starts again and keeps the
        // state. Where the stream begins: an older snapshot than the best is restored only if
        // the stream continues it.
        let reads_from = self.check_same_stream(None).await?;
        let newest = newest_position(&self.bucket, &self.log.stream, self.stream_created).await?;
        LogStats::bump(&self.stats.live_divergences);
        if reads_from > 1 && !newest.is_some_and(|covered| continues(covered, reads_from)) {
            tracing::warn!(
                stream_sequence = self.applied,
                sources = ?diverged,
                "the event log delivered something else than a record the live path applied, \
                 and no snapshot the stream continues is there: removing the ranks the \
                 diverged sources changed; their next records start them afresh"
            );
            for Diverged {
                key,
                instance,
                rank,
            } in diverged
            {
                // A live record changes its source's rank only (one that changes another is
                // left to the stream), so the source's rank holds all it changed.
                self.forget_sources(&key, instance, rank);
                if let Some(entry) = self.state.registry.get(&key) {
                    remove_from_index(entry, instance, rank).await;
                }
            }
            return Ok(true);
        }
        tracing::warn!(
            stream_sequence = self.applied,
            "the event log delivered something else than a record the live path applied: \
             re-bootstrapping from the newest snapshot"
        );
        self.caught_up = false;
        self.state.set_bootstrapping(true);
        self.sources.clear();
        self.forget_live();
        // From the stream's start until a snapshot is restored: if restoring fails, the next
        // attempt reads everything the stream holds into the emptied indexes.
        self.applied = 0;
        let registry = Arc::clone(&self.state.registry);
        tokio::task::spawn_blocking(move || {
            for entry in registry.all() {
                entry.pool.flush();
                entry.index().restore_image(
                    &kvatlas_index::Snapshot::default(),
                    &std::collections::BTreeMap::new(),
                );
            }
        })
        .await
        .map_err(|e| e.to_string())?;
        self.applied = restore_newest(
            &self.state.registry,
            &self.bucket,
            &self.log.stream,
            self.stream_created,
            reads_from,
            &self.stats,
        )
        .await?
        .unwrap_or(0);
        Ok(false)
    }

    /// Forgets the sequencing state, the chains and the pending live records of the sources
    /// of `instance` of index `key` (one rank, or all): their blocks are going, and the
    /// stream's next records of them start afresh.
    fn forget_sources(&mut self, key: &IndexKey, instance: u64, rank: Option<u32>) {
        self.sources
            .retain(|source, _| !of_instance(source, key, instance, rank));
        let live_pending = &mut self.live_pending;
        self.chains.retain(|source, chain| {
            if !of_instance(source, key, instance, rank) {
                return true;
            }
            for live in &chain.pending {
                live_pending.remove(&live.digest);
            }
            false
        });
    }

    fn caught_up(&mut self) {
        if !self.caught_up {
            self.caught_up = true;
            self.state.set_bootstrapping(false);
            tracing::info!(
                stream_sequence = self.applied,
                "replica caught up with the event log: serving queries"
            );
        }
    }

    /// The stream skipped from `applied + 1` to `sequence` (retention). Restores the newest
    /// snapshot if it covers the hole (`true`: consume again after it), else counts the loss.
    async fn skipped(&mut self, sequence: u64) -> Result<bool, String> {
        // A stream created again skips too (the consumer starts again and reads it whole).
        self.check_same_stream(None).await?;
        let lost = sequence - self.applied - 1;
        // A listing that fails is not an empty bucket: the consumer starts again and asks
        // again (taken for one, the records a snapshot covers were counted lost for good).
        let newest = newest_position(&self.bucket, &self.log.stream, self.stream_created).await?;
        // Every hole found, whether a snapshot covers it or its records are lost; counted once
        // it is handled (a restore that fails has the consumer start again and find it again).
        if let Some(covered) = newest
            && continues(covered, sequence)
        {
            tracing::warn!(
                from = self.applied + 1,
                to = sequence,
                covered,
                "the stream no longer holds the next records: re-bootstrapping from the newest snapshot"
            );
            if let Some(covered) = restore_newest(
                &self.state.registry,
                &self.bucket,
                &self.log.stream,
                self.stream_created,
                sequence,
                &self.stats,
            )
            .await?
            {
                LogStats::bump(&self.stats.rebootstraps);
                self.sources.clear();
                // The snapshot replaced what the live path applied: nothing is pending.
                self.forget_live();
                self.applied = covered;
                return Ok(true);
            }
            // The snapshot was gone by the time it was read (a bucket emptied meanwhile): the
            // records are lost as if none had covered them.
        }
        LogStats::bump(&self.stats.rebootstraps);
        self.stats
            .sequences_lost
            .fetch_add(lost, std::sync::atomic::Ordering::Relaxed);
        // The stream's copies of live records pending may have been among them, also of those
        // applied after this (late on core NATS).
        for chain in self.chains.values_mut() {
            chain.after_loss = true;
        }
        tracing::error!(
            from = self.applied + 1,
            to = sequence,
            "the stream no longer holds {lost} record(s) and no snapshot covers them: \
             the state may miss their events"
        );
        Ok(false)
    }

    /// Applies the records of one message, which the stream stored at `stored_nanos` (Unix
    /// ns) and arrived at `arrived` (a malformed message is counted and skipped). A record
    /// that shows a divergence ([`Consumer::diverged`]) is applied once its instance was
    /// removed in place, and the message's next records after it (those before it stay
    /// applied once); `Ok(false)`: the replica re-bootstrapped instead, and the consumer starts
    /// again from after the snapshot.
    async fn apply_message(
        &mut self,
        payload: &[u8],
        arrived: std::time::Instant,
        stored_nanos: i128,
    ) -> Result<bool, String> {
        match crate::log_record::unframe(payload) {
            Ok(records) => {
                for record in records {
                    LogStats::bump(&self.stats.consumed);
                    let Err(diverged) = self.apply(record, arrived, stored_nanos).await else {
                        continue;
                    };
                    if !self.diverged(vec![diverged]).await? {
                        return Ok(false);
                    }
                    // Its instance's sources start afresh: nothing pending to diverge from.
                    // (Consumed once: counted above.)
                    if self.apply(record, arrived, stored_nanos).await.is_err() {
                        return Err("a record diverged again once its instance was removed".into());
                    }
                }
            }
            Err(why) => {
                LogStats::bump(&self.stats.dropped_invalid);
                tracing::warn!("dropped an event-log message: {why}");
            }
        }
        Ok(true)
    }

    /// Decodes, sequences and applies one record of a message that the stream stored at
    /// `stored_nanos` and arrived at `arrived` (an invalid one is counted and skipped), or
    /// confirms the live record it is. The caller counts it consumed.
    async fn apply(
        &mut self,
        payload: &[u8],
        arrived: std::time::Instant,
        stored_nanos: i128,
    ) -> Result<(), Diverged> {
        let digest = crate::log_record::digest(payload);
        if self.confirm(digest, stored_nanos) {
            return Ok(());
        }
        let record = match Record::decode(payload) {
            Ok(record) => record,
            Err(why) => {
                LogStats::bump(&self.stats.dropped_invalid);
                tracing::warn!("dropped an event-log record: {why}");
                return Ok(());
            }
        };
        let registry = &self.state.registry;
        // An unregistration names an index, it does not create one, and its block size is not
        // read: an ingest that held no index of the worker forwards it with any.
        let found = match &record.body {
            Body::Unregister { .. } => match registry.get(&record.key) {
                Some(entry) => Ok(entry),
                None => {
                    // Nothing of it here (no source of the index either): applied as it is.
                    LogStats::bump(&self.stats.applied);
                    return Ok(());
                }
            },
            _ => registry
                .index_for(&record.key, Some(record.block_size))
                .map(|(entry, _)| entry),
        };
        let entry = match found {
            Ok(entry) => entry,
            Err(error) => {
                LogStats::bump(&self.stats.dropped_invalid);
                tracing::warn!("dropped an event-log record for {}: {error}", record.key);
                return Ok(());
            }
        };
        let source_key = (record.key.clone(), record.source);
        match &record.body {
            Body::Unregister { dp_rank } => {
                let (instance, rank) = (record.source.worker_id, *dp_rank);
                // After a loss, the pending records' copies may have been skipped: they go
                // with their ranks.
                if self.chains.iter().any(|(source, chain)| {
                    of_instance(source, &record.key, instance, rank)
                        && !chain.pending.is_empty()
                        && !chain.after_loss
                }) {
                    return Err(Diverged {
                        key: record.key.clone(),
                        instance,
                        rank,
                    });
                }
                self.forget_sources(&record.key, instance, rank);
                remove_from_index(Arc::clone(&entry), instance, rank).await;
                LogStats::bump(&self.stats.applied);
            }
            Body::Batch {
                seq,
                fingerprint,
                resync,
                published_unix_micros,
                ..
            } => {
                if let Some(age) = age_since(*published_unix_micros, stored_nanos) {
                    self.stats.stored_age.observe(age);
                }
                if !self.sources.contains_key(&source_key)
                    && self.sources.len() >= registry.limits().max_registered_ranks
                {
                    LogStats::bump(&self.stats.dropped_invalid);
                    tracing::warn!(
                        "dropped an event-log record: more sources than --max-registered-ranks"
                    );
                    return Ok(());
                }
                let source = self.sources.entry(source_key.clone()).or_insert_with(|| {
                    entry
                        .index()
                        .mark(record.source)
                        .map(|mark| SourceState::from_mark(mark.position, &mark.recent))
                        .unwrap_or_default()
                });
                let chain = self.chains.entry(source_key).or_default();
                let id = LiveId {
                    digest,
                    seq: *seq,
                    fingerprint: *fingerprint,
                    resync: *resync,
                    published_micros: *published_unix_micros,
                    content: crate::log_record::resync_content(&record.body),
                };
                let admission = match chain.judge(source, &id) {
                    Verdict::Confirmed(confirmed) => {
                        // The last is the stream's copy; those before it were kept.
                        for live in confirmed {
                            self.live_pending.remove(&live.digest);
                        }
                        LogStats::bump(&self.stats.live_confirmed);
                        return Ok(());
                    }
                    Verdict::Judged { admission, kept } => {
                        for live in kept {
                            self.live_pending.remove(&live.digest);
                        }
                        admission
                    }
                    Verdict::Diverged => {
                        return Err(Diverged {
                            key: record.key.clone(),
                            instance: record.source.worker_id,
                            rank: Some(record.source.dp_rank),
                        });
                    }
                };
                match admission {
                    Admission::Apply => {}
                    Admission::Duplicate => {
                        LogStats::bump(&self.stats.dropped_duplicate);
                        return Ok(());
                    }
                    Admission::Stale => {
                        LogStats::bump(&self.stats.dropped_stale);
                        return Ok(());
                    }
                }
                if let Some(unit) = record.into_unit(Some(arrived))
                    && crate::grpc::enqueue(&entry.pool, unit).await.is_ok()
                {
                    LogStats::bump(&self.stats.applied);
                }
            }
        }
        Ok(())
    }

    /// Writes a snapshot if it is this replica's turn: its interval passed and no other
    /// replica wrote one within it.
    async fn maybe_snapshot(&mut self) {
        let Some(interval) = self.log.snapshot_interval else {
            return;
        };
        if self.last_snapshot.elapsed() < interval || !self.caught_up {
            return;
        }
        if !self.live_pending.is_empty() {
            // The cut is the stream's state: the live path waits until the stream confirmed
            // what it applied (the consumer calls again when it has).
            self.live_paused = true;
            return;
        }
        self.live_paused = false;
        let now = tokio::time::Instant::now();
        self.last_snapshot = now;
        if let Ok(Some(newest)) =
            newest_snapshot(&self.bucket, &self.log.stream, self.stream_created).await
        {
            let seen_for =
                now.saturating_duration_since(self.newest_seen.seen(&newest.info.name, now));
            if newest.takes_the_turn(self.stream_created, self.applied, seen_for, interval) {
                LogStats::bump(&self.stats.snapshots_skipped);
                return;
            }
        }
        if self
            .snapshot_put
            .as_ref()
            .is_some_and(|put| !put.is_finished())
        {
            return; // the previous one is still being put
        }
        // The cut pauses consumption; encoding and the upload run beside it.
        let (covered, stream_created) = (self.applied, self.stream_created);
        let images = match take_cut(&self.state.registry).await {
            Ok(images) => images,
            Err(error) => {
                LogStats::bump(&self.stats.snapshots_failed);
                tracing::warn!("the replica snapshot failed: {error}");
                return;
            }
        };
        let (bucket, stats) = (self.bucket.clone(), Arc::clone(&self.stats));
        let (bucket_stream, bucket_name) =
            (self.bucket_stream.clone(), self.log.snapshot_bucket.clone());
        let (stream, stream_name) = (self.stream.clone(), self.log.stream.clone());
        let name = snapshot_name(&stream_name, covered);
        // Its own put is seen from now (a put that fails leaves another object the newest).
        self.newest_seen.put(name.clone(), now);
        self.snapshot_put = Some(tokio::spawn(async move {
            let put = put_snapshot(&bucket, images, name, covered, stream_created).await;
            if put.is_ok() {
                // Ranked by the stream as it is now (created again during the put, the cut's
                // stream would rank the new stream's snapshots last and delete them).
                let current = match stream.get_info().await {
                    Ok(info) => created_nanos(&info),
                    Err(_) => stream_created,
                };
                prune_snapshots(&bucket, &bucket_stream, &bucket_name, &stream_name, current).await;
                purge_orphan_chunks(&bucket, &bucket_stream, &bucket_name, ORPHAN_CHUNK_AGE).await;
            }
            match put {
                Ok(bytes) => {
                    LogStats::bump(&stats.snapshots_written);
                    tracing::info!(
                        stream_sequence = covered,
                        bytes,
                        "replica snapshot written to the bucket"
                    );
                }
                Err(error) => {
                    LogStats::bump(&stats.snapshots_failed);
                    tracing::warn!("the replica snapshot failed: {error}");
                }
            }
        }));
    }
}

/// Reads the stream's creation time every 5 s until `stop` (a timed-out or failed read is
/// skipped), so that a replica waiting for its next sequence finds out that the stream was
/// created again (a consumer of the new stream would skip its first sequences).
fn watch_stream_identity(
    stream: jetstream::stream::Stream,
    stop: CancellationToken,
) -> tokio::sync::watch::Receiver<Option<i128>> {
    let (tx, rx) = tokio::sync::watch::channel(None);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
            if tx.is_closed() {
                return;
            }
            if let Ok(Ok(info)) =
                tokio::time::timeout(Duration::from_secs(2), stream.get_info()).await
            {
                let created = Some(created_nanos(&info));
                tx.send_if_modified(|known| std::mem::replace(known, created) != created);
            }
        }
    });
    rx
}

/// The next live record (never, once the live path is off or its subscription ended).
async fn next_live(live: &mut Option<async_nats::Subscriber>) -> Option<async_nats::Message> {
    let message = match live {
        Some(subscription) => subscription.next().await,
        None => None,
    };
    if message.is_none() {
        *live = None;
        std::future::pending::<()>().await;
    }
    message
}

/// The age at `at_nanos` (Unix ns) of a batch the engine stamped `published_micros` (Unix µs),
/// if it has a stamp and the age is not negative.
fn age_since(published_micros: Option<i64>, at_nanos: i128) -> Option<Duration> {
    let nanos = at_nanos - i128::from(published_micros?) * 1000;
    Some(Duration::from_nanos(u64::try_from(nanos).ok()?))
}

fn time_now_nanos() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX))
}

/// The stream sequence an object's description names (`stream_sequence=N`, maybe followed by
/// ` stream_created=T`).
fn covered_of(description: Option<&str>) -> Option<u64> {
    let rest = description?.strip_prefix("stream_sequence=")?;
    rest.split(' ').next()?.parse().ok()
}

/// The stream a snapshot object's description says it was cut from: its creation time (Unix
/// ns, ` stream_created=T`); `None` for a snapshot of kvatlas before it was written down.
fn stream_of(description: Option<&str>) -> Option<i128> {
    description?
        .split(' ')
        .find_map(|field| field.strip_prefix("stream_created="))?
        .parse()
        .ok()
}

/// The description of a snapshot covering `covered` of the stream created at `stream_created`.
fn snapshot_description(covered: u64, stream_created: i128) -> String {
    format!("stream_sequence={covered} stream_created={stream_created}")
}

/// A stream's creation time (Unix ns): what tells a stream from one of the same name created
/// again after it was deleted or its storage lost (the time survives a nats-server restart).
fn created_nanos(info: &jetstream::stream::Info) -> i128 {
    info.created.unix_timestamp_nanos()
}

/// Since when a replica has seen the bucket's newest snapshot object, by its own monotonic
/// clock (a snapshot's age for the snapshot turns; the object's modification time is its
/// writer's wall clock).
#[derive(Debug)]
struct SeenSnapshots {
    /// When the replica started: the age of an object already there when it first lists the
    /// bucket (a replica started after a fleet restart takes its first turn when due).
    started: tokio::time::Instant,
    /// The newest object listed last, and when it was first listed.
    listed: Option<(String, tokio::time::Instant)>,
    /// The replica's own last put (its object, and when it was put). Not taken for a listed
    /// one: a put that fails, or is still under way, leaves the object listed before as the
    /// newest, with the age it had.
    own: Option<(String, tokio::time::Instant)>,
}

impl SeenSnapshots {
    fn new(started: tokio::time::Instant) -> Self {
        Self {
            started,
            listed: None,
            own: None,
        }
    }

    /// Since when object `name`, listed now as the newest, has been seen.
    fn seen(&mut self, name: &str, now: tokio::time::Instant) -> tokio::time::Instant {
        if let Some((own, put)) = &self.own
            && own == name
        {
            return *put;
        }
        match &self.listed {
            Some((listed, seen)) if listed == name => *seen,
            listed => {
                let seen = if listed.is_none() { self.started } else { now };
                self.listed = Some((name.to_owned(), seen));
                seen
            }
        }
    }

    /// The replica puts object `name` now.
    fn put(&mut self, name: String, now: tokio::time::Instant) {
        self.own = Some((name, now));
    }
}

/// A snapshot object of the bucket.
#[derive(Debug)]
struct SnapshotObject {
    /// The stream sequence it covers.
    covered: u64,
    /// The stream it was cut from ([`stream_of`]).
    stream: Option<i128>,
    info: jetstream::object_store::ObjectInfo,
}

impl SnapshotObject {
    /// Where a replica consuming the stream created at `current` reads on after restoring it:
    /// after the sequence it covers if it was cut from that stream (or does not say), from the
    /// stream's start if it was cut from a stream since re-created.
    fn position_in(&self, current: i128) -> u64 {
        if self.cut_from(current) {
            self.covered
        } else {
            0
        }
    }

    /// Whether it takes the snapshot turn of a replica of the stream created at `current` at
    /// position `applied`, which has seen it for `seen_for` (or put it that long ago): it is of
    /// this stream and covers that position or a later one, or was first seen less than ¾ of
    /// `interval` ago. Its age is judged by the replica's own clock, not by the object's
    /// modification time, its writer's clock: a writer's clock minutes ahead made every other
    /// replica skip for as long, one behind made them all write at every turn.
    fn takes_the_turn(
        &self,
        current: i128,
        applied: u64,
        seen_for: Duration,
        interval: Duration,
    ) -> bool {
        let this_stream = self.stream == Some(current);
        this_stream && (self.covered >= applied || seen_for < interval * 3 / 4)
    }

    /// Whether it was cut from the stream created at `current` (or does not say).
    fn cut_from(&self, current: i128) -> bool {
        self.stream.is_none_or(|stream| stream == current)
    }

    /// The order of snapshots for a replica of the stream created at `current`, best last: the
    /// current stream's first, then those that do not say (kvatlas before it was written down:
    /// taken for the current stream's), then other streams', a stream created later first;
    /// within each, by the sequence they cover. (Not by creation time alone: a clock that
    /// stepped back between two streams would rank a gone stream's snapshots above the
    /// current one's for good.)
    fn rank(&self, current: i128) -> (u8, i128, u64) {
        let standing = match self.stream {
            Some(stream) if stream == current => 2,
            None => 1,
            Some(_) => 0,
        };
        (standing, self.stream.unwrap_or(i128::MIN), self.covered)
    }
}

/// The name of the snapshot object of stream `stream` covering `covered`: one object per cut,
/// so that a put that finishes late (its replica paused, or cut off from NATS, mid-put) never
/// hides a newer snapshot: readers take the highest sequence in the bucket, whatever the order
/// of puts. The stream's name is part of it: fleets of two streams sharing a bucket (the
/// default one) neither overwrite, restore nor prune each other's snapshots.
fn snapshot_name(stream: &str, covered: u64) -> String {
    format!("{SNAPSHOT_OBJECT}-{stream}-{covered:020}")
}

/// The stream sequence a snapshot object of the bucket covers, by its name, if it is a replica
/// snapshot of stream `stream`: named for it ([`snapshot_name`]), or named as kvatlas did before
/// names carried the stream (`snapshot-N`, or the single `snapshot` object of kvatlas before
/// per-cut names, by its description), which are taken for this stream's only if their
/// description says they were cut from the stream created at `current` (or does not say), so
/// that a fleet of another stream sharing the bucket neither restores nor prunes them.
/// `None`: not a replica snapshot, or another stream's.
fn covered_by(name: &str, description: Option<&str>, stream: &str, current: i128) -> Option<u64> {
    let old_style_of_another = || stream_of(description).is_some_and(|created| created != current);
    if name == SNAPSHOT_OBJECT {
        return covered_of(description).filter(|_| !old_style_of_another());
    }
    let rest = name.strip_prefix(SNAPSHOT_OBJECT)?.strip_prefix('-')?;
    let digits = match rest.strip_prefix(stream).and_then(|r| r.strip_prefix('-')) {
        Some(digits) => digits,
        // Before names carried the stream: the digits alone.
        None if old_style_of_another() => return None,
        None => rest,
    };
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The bucket's snapshot objects, the best first for a replica of the stream created at
/// `current` ([`SnapshotObject::rank`]).
async fn snapshots(
    bucket: &jetstream::object_store::ObjectStore,
    stream: &str,
    current: i128,
) -> Result<Vec<SnapshotObject>, String> {
    let mut list = bucket
        .list()
        .await
        .map_err(|e| format!("listing the snapshot bucket: {e}"))?;
    let mut found = Vec::new();
    while let Some(info) = list.next().await {
        let info = info.map_err(|e| format!("listing the snapshot bucket: {e}"))?;
        let description = info.description.as_deref();
        if let Some(covered) = covered_by(&info.name, description, stream, current) {
            let stream = stream_of(description);
            found.push(SnapshotObject {
                covered,
                stream,
                info,
            });
        }
    }
    found.sort_unstable_by_key(|object| std::cmp::Reverse(object.rank(current)));
    Ok(found)
}

/// The bucket's best snapshot object for a replica of the stream created at `current`.
async fn newest_snapshot(
    bucket: &jetstream::object_store::ObjectStore,
    stream: &str,
    current: i128,
) -> Result<Option<SnapshotObject>, String> {
    Ok(snapshots(bucket, stream, current).await?.into_iter().next())
}

/// Where a replica of the stream created at `current` reads on after restoring the newest
/// snapshot ([`SnapshotObject::position_in`]), if there is one.
async fn newest_position(
    bucket: &jetstream::object_store::ObjectStore,
    stream: &str,
    current: i128,
) -> Result<Option<u64>, String> {
    Ok(newest_snapshot(bucket, stream, current)
        .await?
        .map(|object| object.position_in(current)))
}

/// Restores the best snapshot of the bucket that can be read and restored: where a replica of
/// the stream created at `current` reads on ([`SnapshotObject::position_in`]); `None`: the
/// bucket has none (or only objects a newer put pruned while they were read), and the replica
/// reads the stream from its start.
///
/// The best-ranked object is tried first, whatever it covers (as when it is the only one). If
/// it cannot be read or restored (a damaged store, a put cut off whose first chunks were
/// purged), it is named in a warning with how to delete it and counted
/// (`snapshots_unreadable`), and the next is tried — but only an object after which the
/// replica reads on from `reads_from` or before (the stream's first sequence: an older cut
/// would leave records the stream no longer holds unread). With none such and `reads_from` ≤
/// 1 (the stream holds every record), the replica starts from the stream's start (`None`),
/// which loses nothing either; the indexes must then be empty (at a start, or emptied by the
/// caller). Otherwise the best one's error is returned: a replica does not start from a state
/// with a hole.
pub(crate) async fn restore_newest(
    registry: &Arc<Registry>,
    bucket: &jetstream::object_store::ObjectStore,
    stream: &str,
    current: i128,
    reads_from: u64,
    stats: &LogStats,
) -> Result<Option<u64>, String> {
    // Objects that could not be read or restored, and the best one's error.
    let mut unreadable: Vec<String> = Vec::new();
    let mut best_error = None;
    // Whether the best of a listing was passed over (unreadable, or gone on the last listing):
    // from then on only a cut the stream continues is tried.
    let mut past_best = false;
    // A newer put prunes older objects: the one listed may be gone when it is read, and the
    // list is read again (a few times: each prune needs a newer snapshot).
    let mut listings = 0;
    'listing: loop {
        listings += 1;
        let listed = snapshots(bucket, stream, current).await?;
        for candidate in &listed {
            if unreadable.contains(&candidate.info.name) {
                continue;
            }
            // Once the best was passed over, only a cut the stream still continues.
            if past_best && !continues(candidate.position_in(current), reads_from) {
                continue;
            }
            match restore_object(registry, bucket, &candidate.info, current).await {
                Ok(Some(position)) => {
                    if !unreadable.is_empty() {
                        tracing::warn!(
                            object = candidate.info.name,
                            stream_sequence = position,
                            "restored an older replica snapshot: {} newer one(s) could not be \
                             read or restored (named above)",
                            unreadable.len()
                        );
                    }
                    return Ok(Some(position));
                }
                // Pruned by a newer put since the listing.
                Ok(None) if listings <= 3 => continue 'listing,
                Ok(None) => past_best = true,
                Err(error) => {
                    LogStats::bump(&stats.snapshots_unreadable);
                    tracing::warn!("{error}");
                    best_error.get_or_insert(error);
                    unreadable.push(candidate.info.name.clone());
                    past_best = true;
                }
            }
        }
        break;
    }
    let Some(best) = best_error else {
        return Ok(None);
    };
    if reads_from <= 1 {
        tracing::warn!(
            "no replica snapshot could be restored (named above): reading the stream from its \
             start, which holds every record"
        );
        return Ok(None);
    }
    Err(best)
}

/// Names a snapshot object that cannot be read or restored, with what the operator can do.
fn named_snapshot(name: &str, bucket: &str, error: &str) -> String {
    format!(
        "the snapshot object {name:?} of bucket {bucket:?}: {error} (delete it, e.g. `nats \
         object rm {bucket} {name}`, and the replica starts from the next snapshot, or from the \
         stream's start)"
    )
}

/// A snapshot object's read gives up after this long without a byte.
const SNAPSHOT_READ_IDLE: Duration = Duration::from_secs(30);

/// How sending an object's bytes to a reader ended ([`send_pieces`]).
#[derive(Debug, PartialEq, Eq)]
enum Sent {
    /// Every byte was sent.
    Whole,
    /// No byte came for the idle time (a read that waits for ever is given up).
    Stalled,
    /// The reader stopped taking them (its result says why).
    Refused,
}

/// Sends `object`'s bytes to `pieces`, piece by piece, until its end, a stall of `idle`, or the
/// receiver's end; `pieces` is dropped then (the reader sees the end). The time spent waiting
/// for the reader to take a piece is not idle time.
async fn send_pieces(
    object: &mut (impl tokio::io::AsyncRead + Unpin),
    pieces: tokio::sync::mpsc::Sender<bytes::Bytes>,
    idle: Duration,
) -> std::io::Result<Sent> {
    let mut buffer = vec![0; 128 << 10];
    loop {
        match tokio::time::timeout(idle, object.read(&mut buffer)).await {
            Err(_) => return Ok(Sent::Stalled),
            Ok(read) => match read? {
                0 => return Ok(Sent::Whole),
                n => {
                    let piece = bytes::Bytes::copy_from_slice(&buffer[..n]);
                    if pieces.send(piece).await.is_err() {
                        return Ok(Sent::Refused);
                    }
                }
            },
        }
    }
}

/// Reads a replica snapshot object as it arrives: [`SNAPSHOT_MAGIC`], the stream sequence it
/// covers, then a snapshot read within `limits` (never held whole: a snapshot object of a big
/// fleet, or any object put in the bucket, was read into memory whole before any limit was
/// checked, and a replica that met one larger than its memory failed at every start).
fn read_replica_snapshot(
    mut object: impl std::io::Read,
    limits: crate::snapshot::ReadLimits,
) -> Result<(u64, Vec<crate::snapshot::IndexImage>), String> {
    let mut magic = [0u8; 8];
    if object.read_exact(&mut magic).is_err() || &magic != SNAPSHOT_MAGIC {
        return Err("not a kvatlas replica snapshot".into());
    }
    let mut covered = [0u8; 8];
    object
        .read_exact(&mut covered)
        .map_err(|_| "truncated".to_owned())?;
    let (_, images) = crate::snapshot::read_within(object, limits).map_err(|e| e.to_string())?;
    Ok((u64::from_le_bytes(covered), images))
}

/// Reads and restores the snapshot object `listed`: where a replica of the stream created at
/// `current` reads on after it; `None` if the object is gone (a newer put pruned it). Nothing is
/// changed unless the whole object restores ([`Registry::restore_images`]); an error names the
/// object ([`named_snapshot`]).
async fn restore_object(
    registry: &Arc<Registry>,
    bucket: &jetstream::object_store::ObjectStore,
    listed: &jetstream::object_store::ObjectInfo,
    current: i128,
) -> Result<Option<u64>, String> {
    let (name, bucket_name) = (listed.name.clone(), listed.bucket.clone());
    let named = move |error: String| named_snapshot(&name, &bucket_name, &error);
    let mut object = match bucket.get(&listed.name).await {
        Ok(object) => object,
        Err(error) if error.kind() == jetstream::object_store::GetErrorKind::NotFound => {
            return Ok(None);
        }
        Err(error) => return Err(named(format!("reading it: {error}"))),
    };
    // Judged by what was read (a put of the same name may have replaced the listed one).
    let same_stream =
        stream_of(object.info.description.as_deref()).is_none_or(|stream| stream == current);
    let (pieces, received) = tokio::sync::mpsc::channel(crate::peers::PIECES_IN_FLIGHT);
    let reader = {
        let limits = registry.read_limits();
        tokio::task::spawn_blocking(move || {
            read_replica_snapshot(crate::peers::Pieces::new(received), limits)
        })
    };
    let sent = send_pieces(&mut object, pieces, SNAPSHOT_READ_IDLE).await;
    let read = reader.await.map_err(|e| e.to_string())?;
    match sent {
        Ok(Sent::Whole | Sent::Refused) => {}
        Ok(Sent::Stalled) => {
            // Deleted while it was read (a newer put pruned it: its chunks are gone, and the
            // reader waited for them for ever), or stalled.
            // (A deleted object's marker reads as one that is deleted, until it is purged.)
            let gone = match bucket.info(&listed.name).await {
                Ok(info) => info.deleted,
                Err(error) => error.kind() == jetstream::object_store::InfoErrorKind::NotFound,
            };
            if gone {
                return Ok(None);
            }
            return Err(named(format!(
                "reading it: no data for {} s",
                SNAPSHOT_READ_IDLE.as_secs()
            )));
        }
        Err(error) => return Err(named(format!("reading it: {error}"))),
    }
    let (covered, images) = read.map_err(&named)?;
    let registry = Arc::clone(registry);
    tokio::task::spawn_blocking(move || {
        for entry in registry.all() {
            entry.pool.flush();
        }
        registry
            .restore_images(&images, None)
            .map_err(|e| named(format!("restoring it: {e}")))?;
        let memberships: u64 = images
            .iter()
            .map(crate::snapshot::IndexImage::memberships)
            .sum();
        if same_stream {
            tracing::info!(
                stream_sequence = covered,
                memberships,
                "restored a replica snapshot"
            );
        } else {
            tracing::warn!(
                stream_sequence = covered,
                memberships,
                "restored a replica snapshot cut from the stream before it was created \
                 again: reading the stream from its start"
            );
        }
        Ok(Some(if same_stream { covered } else { 0 }))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Takes a consistent cut: every writer idle (the caller applies nothing meanwhile), the images
/// of every index.
async fn take_cut(registry: &Arc<Registry>) -> Result<Vec<crate::snapshot::IndexImage>, String> {
    let registry = Arc::clone(registry);
    tokio::task::spawn_blocking(move || {
        registry
            .all()
            .iter()
            .map(|entry| {
                entry.pool.flush();
                entry.image()
            })
            .collect()
    })
    .await
    .map_err(|e| e.to_string())
}

/// A replica snapshot object of `images` covering the stream up to `covered` (what
/// [`read_replica_snapshot`] reads).
fn encode_replica_snapshot(
    images: &[crate::snapshot::IndexImage],
    covered: u64,
) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(1 << 20);
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&covered.to_le_bytes());
    let mut writer = crate::snapshot::Writer::new(out, crate::served_index::unix_micros_now())
        .map_err(|e| e.to_string())?;
    for image in images {
        writer.index(image).map_err(|e| e.to_string())?;
    }
    writer.finish().map_err(|e| e.to_string())
}

/// Encodes a cut and puts it in the bucket as object `name` covering `covered`; returns its
/// size.
async fn put_snapshot(
    bucket: &jetstream::object_store::ObjectStore,
    images: Vec<crate::snapshot::IndexImage>,
    name: String,
    covered: u64,
    stream_created: i128,
) -> Result<usize, String> {
    let bytes = tokio::task::spawn_blocking(move || encode_replica_snapshot(&images, covered))
        .await
        .map_err(|e| e.to_string())??;
    let size = bytes.len();
    let meta = jetstream::object_store::ObjectMetadata {
        name,
        description: Some(snapshot_description(covered, stream_created)),
        ..Default::default()
    };
    bucket
        .put(meta, &mut bytes.as_slice())
        .await
        .map_err(|e| format!("putting the snapshot object: {e}"))?;
    Ok(size)
}

/// Whether a stream whose next record to read is `next` continues a snapshot read on after
/// `covered` (nothing between them is missing).
fn continues(covered: u64, next: u64) -> bool {
    covered.saturating_add(1) >= next
}

/// Whether `source` (index, rank) is a rank of `instance` of index `key` (one rank, or all).
fn of_instance(
    (source_key, worker): &(IndexKey, Worker),
    key: &IndexKey,
    instance: u64,
    rank: Option<u32>,
) -> bool {
    source_key == key && worker.worker_id == instance && rank.is_none_or(|r| r == worker.dp_rank)
}

/// Removes `instance` (one rank, or all) from `entry`'s index and forgets its checkpoints: the
/// units still queued first (they record their checkpoints), then the blocks go and the
/// checkpoints are forgotten in one step (before the flush, a stale one stayed), as at the
/// ingest.
async fn remove_from_index(entry: Arc<IndexEntry>, instance: u64, rank: Option<u32>) {
    let _ = tokio::task::spawn_blocking(move || {
        entry.pool.flush();
        match rank {
            None => entry.index().remove_worker_forgetting_marks(instance),
            Some(rank) => entry
                .index()
                .clear_rank_forgetting_mark(Worker::new(instance, rank)),
        };
    })
    .await;
}

/// Snapshot objects kept in the bucket: the newest, and the one before it for a replica that
/// listed the bucket just before the newest was put and is still reading.
const SNAPSHOTS_KEPT: usize = 2;

/// Deletes the bucket's snapshot objects beyond the newest [`SNAPSHOTS_KEPT`] (a failure is
/// logged: the next put prunes again). A deleted object leaves a marker in the bucket's stream
/// (`bucket_stream`), one per name, and every cut has a name of its own: the marker is purged
/// too, or the bucket would keep one per snapshot ever pruned and every listing read them all.
async fn prune_snapshots(
    bucket: &jetstream::object_store::ObjectStore,
    bucket_stream: &jetstream::stream::Stream,
    bucket_name: &str,
    stream: &str,
    current: i128,
) {
    use base64::Engine as _;
    let stale = match snapshots(bucket, stream, current).await {
        Ok(found) => found.into_iter().skip(SNAPSHOTS_KEPT),
        Err(error) => {
            tracing::warn!("pruning old replica snapshots: {error}");
            return;
        }
    };
    for SnapshotObject { info, .. } in stale {
        if let Err(error) = bucket.delete(&info.name).await {
            tracing::warn!(object = %info.name, "pruning an old replica snapshot: {error}");
            continue;
        }
        // The subject async-nats keeps an object's metadata on.
        let marker = format!(
            "$O.{bucket_name}.M.{}",
            base64::engine::general_purpose::URL_SAFE.encode(&info.name)
        );
        if let Err(error) = bucket_stream.purge().filter(marker).await {
            tracing::warn!(object = %info.name, "purging a pruned snapshot's marker: {error}");
        }
    }
}

/// How long before the bucket's last message the last chunk of an object no metadata names
/// must have been stored for [`purge_orphan_chunks`] to take it for the leftover of a put cut
/// off (a put under way stores its chunks before its metadata: one of another replica's,
/// writing now, is not touched). A put paused longer than this between two chunks (its
/// replica stopped, not killed) would lose its first chunks and then name a snapshot that
/// cannot be read: a replica starting from it names the object and how to delete it, and
/// restores the next best if the stream still continues that one, or else fails to start until
/// a newer snapshot ranks first ([`restore_newest`]).
pub(crate) const ORPHAN_CHUNK_AGE: Duration = Duration::from_secs(600);

/// Purges the bucket's chunks that no object's metadata names and that were last written more
/// than `older_than` ago: what a put cut off (a replica killed mid-put, a connection lost) left
/// behind. The object store never removes them (a put cut off has no name to delete by), and
/// each is up to a snapshot's size, in a bucket without a size bound. Returns how many objects'
/// chunks were purged; failures are logged (the next snapshot's put tries again).
pub(crate) async fn purge_orphan_chunks(
    bucket: &jetstream::object_store::ObjectStore,
    bucket_stream: &jetstream::stream::Stream,
    bucket_name: &str,
    older_than: Duration,
) -> usize {
    let named = async {
        let mut named = std::collections::HashSet::new();
        let mut list = bucket.list().await.map_err(|e| e.to_string())?;
        while let Some(info) = list.next().await {
            named.insert(info.map_err(|e| e.to_string())?.nuid);
        }
        // The chunk subjects are listed after the names: a put that ends in between has its
        // chunks listed and its name not, and is spared by its age. (A set: the listing comes
        // in pages, and a subject added between two shifts the second by one.)
        let mut subjects = std::collections::BTreeSet::new();
        let mut listed = bucket_stream
            .info_with_subjects(format!("$O.{bucket_name}.C.>"))
            .await
            .map_err(|e| e.to_string())?;
        // Ages are measured on nats-server's clock (a chunk's time is its; this replica's own
        // clock running ahead would make another replica's put under way look old): the
        // stream's last message, at least this replica's own put just made, is "now".
        let now = listed.info.state.last_timestamp.unix_timestamp_nanos();
        while let Some(subject) = listed.next().await {
            subjects.insert(subject.map_err(|e| e.to_string())?.0);
        }
        Ok::<_, String>((named, subjects, now))
    };
    let (named, subjects, now) = match named.await {
        Ok(found) => found,
        Err(error) => {
            tracing::warn!("looking for chunks of snapshot puts cut off: {error}");
            return 0;
        }
    };
    let mut purged = 0;
    for subject in subjects {
        let nuid = subject.rsplit('.').next().unwrap_or_default();
        if named.contains(nuid) {
            continue;
        }
        let written = match bucket_stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(last) => last.time.unix_timestamp_nanos(),
            Err(error) => {
                tracing::warn!(%subject, "reading an unnamed chunk's age: {error}");
                continue;
            }
        };
        if now - written < i128::try_from(older_than.as_nanos()).unwrap_or(i128::MAX) {
            continue;
        }
        match bucket_stream.purge().filter(subject.clone()).await {
            Ok(_) => {
                purged += 1;
                tracing::info!(%subject, "purged the chunks of a snapshot put cut off");
            }
            Err(error) => tracing::warn!(%subject, "purging a put's leftover chunks: {error}"),
        }
    }
    purged
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stream the tests' snapshot objects are of.
    const STREAM: &str = "EVENTS";

    #[test]
    fn duplicates_and_stale_batches_are_dropped_and_resyncs_applied() {
        let mut source = SourceState::default();
        assert_eq!(source.admit(Some(0), 10, false), Admission::Apply);
        assert_eq!(source.admit(Some(1), 11, false), Admission::Apply);
        // The same batch again (a second ingest's copy).
        assert_eq!(source.admit(Some(1), 11, false), Admission::Duplicate);
        assert_eq!(source.admit(Some(0), 10, false), Admission::Duplicate);
        // A gap is applied (the ingest resolved it).
        assert_eq!(source.admit(Some(5), 15, false), Admission::Apply);
        // An old batch re-published after the recent window: stale.
        assert_eq!(source.admit(Some(3), 13, false), Admission::Stale);
        // The engine restarted: the resync record is applied although 0 is not new...
        assert_eq!(source.admit(Some(0), 99, true), Admission::Apply);
        // ...and the new stream continues from it; its duplicate is still dropped.
        assert_eq!(source.admit(Some(1), 98, false), Admission::Apply);
        assert_eq!(source.admit(Some(0), 99, true), Admission::Duplicate);
        // Unsequenced records (clears alone) are always applied.
        assert_eq!(source.admit(None, 0, true), Admission::Apply);
    }

    #[test]
    fn the_recent_window_is_bounded_and_restored_from_a_checkpoint() {
        let mut source = SourceState::default();
        for seq in 0..(RECENT as u64 + 10) {
            assert_eq!(source.admit(Some(seq), seq, false), Admission::Apply);
        }
        assert_eq!(source.recent.len(), RECENT);
        // Fell out of the window: below the position, so stale rather than duplicate.
        assert_eq!(source.admit(Some(0), 0, false), Admission::Stale);
        let restored = SourceState::from_mark(7, &[(6, 60), (7, 70)]);
        let mut restored_copy = restored.clone();
        assert_eq!(
            restored_copy.admit(Some(7), 70, false),
            Admission::Duplicate
        );
        assert_eq!(restored_copy.admit(Some(8), 80, false), Admission::Apply);
        assert_eq!(restored.position, Some(7));
    }

    #[test]
    fn the_view_before_pending_admissions_is_the_streams() {
        let mut source = SourceState::default();
        for seq in 0..5 {
            assert_eq!(source.admit(Some(seq), seq * 10, false), Admission::Apply);
        }
        // Two live records admitted on top (positions 5 and 6).
        let before = source.position;
        assert_eq!(source.admit(Some(5), 50, false), Admission::Apply);
        assert_eq!(source.admit(Some(6), 60, false), Admission::Apply);
        // The stream alone is at 4: 5 is new to it, whatever its fingerprint.
        assert_eq!(
            source.admit_before(2, before, Some(5), 51, false),
            Admission::Apply
        );
        assert_eq!(
            source.admit_before(2, before, Some(5), 50, false),
            Admission::Apply
        );
        // What it applied or passed is dropped as it would have been.
        assert_eq!(
            source.admit_before(2, before, Some(3), 30, false),
            Admission::Duplicate
        );
        assert_eq!(
            source.admit_before(2, before, Some(3), 31, false),
            Admission::Stale
        );
        // A resync it has not seen, and an unsequenced record, it would apply.
        assert_eq!(
            source.admit_before(2, before, Some(3), 31, true),
            Admission::Apply
        );
        assert_eq!(
            source.admit_before(2, before, None, 0, false),
            Admission::Apply
        );
        // With nothing pending the view is the source's own.
        assert_eq!(
            source.admit_before(0, None, Some(6), 60, false),
            Admission::Duplicate
        );
        assert_eq!(
            source.admit_before(0, None, Some(7), 70, false),
            Admission::Apply
        );
        assert_eq!(source.position, Some(6), "nothing recorded");
    }

    /// Pending unsequenced records left no pair: the pairs before the pending sequenced ones
    /// are still the stream's, so a second ingest's copy of a resync the stream delivered is a
    /// duplicate (counting every pending record hid it, and the replica took it for a
    /// divergence).
    #[test]
    fn only_sequenced_pending_records_hide_pairs() {
        let mut source = SourceState::default();
        assert_eq!(source.admit(Some(4), 40, true), Admission::Apply);
        let before = source.position;
        let mut chain = Chain::default();
        for (digest, seq) in [(1, Some(5)), (2, None)] {
            assert_eq!(source.admit(seq, digest * 10, false), Admission::Apply);
            chain.pending.push_back(LiveId {
                digest,
                seq,
                fingerprint: digest * 10,
                resync: false,
                published_micros: None,
                content: 0,
            });
        }
        assert_eq!(chain.recorded_pending(), 1);
        assert_eq!(
            source.admit_before(chain.recorded_pending(), before, Some(4), 40, true),
            Admission::Duplicate
        );
        assert_eq!(
            source.admit_before(chain.pending.len(), before, Some(4), 40, true),
            Admission::Apply,
            "what counting every pending record decided"
        );
    }

    #[test]
    fn a_live_record_is_the_streams_copy_by_bytes_or_by_its_engine_batch() {
        let live = LiveId {
            digest: 1,
            seq: Some(5),
            fingerprint: 77,
            resync: false,
            published_micros: None,
            content: 0,
        };
        // Another ingest's copy: stamped a microsecond apart, the same engine batch.
        assert!(live.is(&LiveId { digest: 2, ..live }));
        assert!(!live.is(&LiveId {
            digest: 2,
            fingerprint: 78,
            ..live
        }));
        assert!(!live.is(&LiveId {
            digest: 2,
            seq: Some(6),
            ..live
        }));
        assert!(!live.is(&LiveId {
            digest: 2,
            resync: true,
            ..live
        }));
        // A resync's copy from another ingest clearing other ranks is another record; one
        // making the same mutations is the same.
        let resync = LiveId {
            resync: true,
            content: 41,
            ..live
        };
        assert!(resync.is(&LiveId {
            digest: 2,
            ..resync
        }));
        assert!(!resync.is(&LiveId {
            digest: 2,
            content: 42,
            ..resync
        }));
        // Without an engine fingerprint (PublishEvents) or a sequence, only the same bytes.
        let pushed = LiveId {
            fingerprint: 0,
            ..live
        };
        assert!(!pushed.is(&LiveId {
            digest: 2,
            ..pushed
        }));
        assert!(pushed.is(&pushed));
        let unsequenced = LiveId { seq: None, ..live };
        assert!(!unsequenced.is(&LiveId {
            digest: 2,
            ..unsequenced
        }));
    }

    #[test]
    fn a_chain_continues_from_its_last_pending_record_or_the_streams() {
        let mut chain = Chain::default();
        assert_eq!(
            chain.tip(),
            None,
            "nothing delivered yet: no live record continues it"
        );
        chain.head = Some(9);
        assert_eq!(chain.tip(), Some(9));
        chain.pending.push_back(LiveId {
            digest: 11,
            seq: Some(1),
            fingerprint: 1,
            resync: false,
            published_micros: None,
            content: 0,
        });
        assert_eq!(chain.tip(), Some(11));
        // Confirmed, the record is the stream's: the chain goes on from it.
        chain.after_loss = true;
        assert_eq!(chain.confirm_front().map(|live| live.digest), Some(11));
        assert_eq!((chain.tip(), chain.position_before), (Some(11), Some(1)));
        assert!(
            !chain.after_loss,
            "the stream delivered (or skipped) every record applied live: a loss is behind it"
        );
        assert_eq!(chain.confirm_front(), None);
    }

    /// A live record of `digest` (as its fingerprint too) with sequence number `seq`.
    fn live_id(digest: u64, seq: Option<u64>) -> LiveId {
        LiveId {
            digest,
            seq,
            fingerprint: digest,
            resync: false,
            published_micros: None,
            content: 0,
        }
    }

    /// An object's bytes go to the reader piece by piece: a read that stops giving bytes is
    /// given up after the idle time, one that ends is sent whole, and a reader that stops
    /// taking them ends the sending.
    #[tokio::test]
    async fn an_object_is_sent_in_pieces_until_its_end_a_stall_or_a_refusal() {
        use tokio::io::AsyncWriteExt as _;
        let (mut writer, mut object) = tokio::io::duplex(64);
        let idle = Duration::from_millis(100);
        writer.write_all(b"some").await.expect("written");
        let (pieces, mut received) = tokio::sync::mpsc::channel(4);
        let started = std::time::Instant::now();
        let sent = send_pieces(&mut object, pieces, idle).await;
        assert_eq!(sent.expect("no error"), Sent::Stalled);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(received.recv().await.as_deref(), Some(&b"some"[..]));
        assert_eq!(received.recv().await, None, "the sender is dropped");

        writer.write_all(b" more").await.expect("written");
        drop(writer);
        let (pieces, mut received) = tokio::sync::mpsc::channel(4);
        let sent = send_pieces(&mut object, pieces, idle).await;
        assert_eq!(sent.expect("no error"), Sent::Whole);
        assert_eq!(received.recv().await.as_deref(), Some(&b" more"[..]));

        let (mut writer, mut object) = tokio::io::duplex(64);
        writer.write_all(b"unwanted").await.expect("written");
        let (pieces, received) = tokio::sync::mpsc::channel(4);
        drop(received);
        let sent = send_pieces(&mut object, pieces, idle).await;
        assert_eq!(sent.expect("no error"), Sent::Refused);
    }

    /// A replica snapshot object is read as it comes, never held whole: one that goes on for
    /// ever is refused at its first bad byte (it was read into memory whole before any check);
    /// a sound one reads back with the stream sequence it covers.
    #[test]
    fn a_replica_snapshot_is_read_as_it_comes() {
        let header: &[u8] = SNAPSHOT_MAGIC;
        let covered = 7u64.to_le_bytes();
        let endless = std::io::Read::chain(
            std::io::Read::chain(header, &covered[..]),
            std::io::repeat(0),
        );
        let refused = read_replica_snapshot(endless, crate::snapshot::ReadLimits::default());
        assert!(refused.is_err(), "{refused:?}");
        let refused = read_replica_snapshot(
            &b"KVATSNAP and more"[..],
            crate::snapshot::ReadLimits::default(),
        );
        assert_eq!(
            refused.err().as_deref(),
            Some("not a kvatlas replica snapshot")
        );
        let refused =
            read_replica_snapshot(&SNAPSHOT_MAGIC[..], crate::snapshot::ReadLimits::default());
        assert_eq!(refused.err().as_deref(), Some("truncated"));

        let image = crate::snapshot::IndexImage {
            key: IndexKey::new("m", crate::registry::DEFAULT_TENANT),
            block_size: kvatlas_hash::BlockSize::new(16).expect("16"),
            capacity: None,
            feeds: Vec::new(),
            marks: std::collections::BTreeMap::new(),
            snapshot: kvatlas_index::Snapshot::default(),
        };
        let object = encode_replica_snapshot(std::slice::from_ref(&image), 41).expect("encoded");
        let (covered, images) =
            read_replica_snapshot(&object[..], crate::snapshot::ReadLimits::default())
                .expect("read back");
        assert_eq!(covered, 41);
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].key, image.key);
    }

    /// A source whose stream delivered its batch 1, with live records of `pending` (digests and
    /// sequence numbers) applied after it, as the live path applies them.
    fn chain_with_pending(pending: &[(u64, Option<u64>)]) -> (SourceState, Chain) {
        let mut source = SourceState::default();
        let mut chain = Chain::default();
        let first = live_id(1, Some(1));
        assert_eq!(
            chain.judge(&mut source, &first),
            Verdict::Judged {
                admission: Admission::Apply,
                kept: Vec::new()
            }
        );
        chain.position_before = source.position;
        for &(digest, seq) in pending {
            let live = live_id(digest, seq);
            assert_eq!(
                source.admit(live.seq, live.fingerprint, false),
                Admission::Apply
            );
            chain.pending.push_back(live);
        }
        (source, chain)
    }

    /// The stream's next record after its pending live records, which the stream no longer
    /// holds (retention skipped them, no snapshot covering): a divergence before a loss, and
    /// after one the pending records are kept and the record applied. (Before, a replica that
    /// fell behind the retention window while its live path kept up took it for a divergence
    /// and went back to an older snapshot, losing every record after it.)
    #[test]
    fn after_a_loss_the_streams_next_record_keeps_the_pending_live_ones() {
        let pending = [(2, Some(2)), (3, None), (4, Some(3))];
        let next = live_id(5, Some(4));
        let (mut source, mut chain) = chain_with_pending(&pending);
        assert_eq!(chain.judge(&mut source, &next), Verdict::Diverged);

        chain.after_loss = true;
        let Verdict::Judged { admission, kept } = chain.judge(&mut source, &next) else {
            panic!("judged as the stream alone would")
        };
        assert_eq!(admission, Admission::Apply);
        let kept: Vec<u64> = kept.iter().map(|live| live.digest).collect();
        assert_eq!(kept, [2, 3, 4]);
        assert!(chain.pending.is_empty() && !chain.after_loss);
        assert_eq!((chain.tip(), source.position), (Some(5), Some(4)));
        // A copy of a kept record delivered after the hole is dropped by its sequence.
        assert_eq!(
            chain.judge(&mut source, &live_id(4, Some(3))),
            Verdict::Judged {
                admission: Admission::Duplicate,
                kept: Vec::new()
            }
        );
    }

    /// After a loss, the stream's copy of a later pending record confirms it and keeps those
    /// before it (an unsequenced one among them is not applied a second time); a record the
    /// stream alone would drop is dropped, the pending ones waiting on.
    #[test]
    fn after_a_loss_a_later_pending_record_confirms_those_before_it() {
        let (mut source, mut chain) = chain_with_pending(&[(2, Some(2)), (3, None), (4, Some(3))]);
        chain.after_loss = true;
        assert_eq!(
            chain.judge(&mut source, &live_id(9, Some(1))),
            Verdict::Judged {
                admission: Admission::Stale,
                kept: Vec::new()
            }
        );
        assert_eq!(chain.pending.len(), 3);
        let Verdict::Confirmed(confirmed) = chain.judge(&mut source, &live_id(3, None)) else {
            panic!("the unsequenced pending record's copy confirms it")
        };
        let confirmed: Vec<u64> = confirmed.iter().map(|live| live.digest).collect();
        assert_eq!(confirmed, [2, 3]);
        assert!(chain.after_loss, "one record still pending");
        assert!(matches!(
            chain.judge(&mut source, &live_id(4, Some(3))),
            Verdict::Confirmed(_)
        ));
        assert!(chain.pending.is_empty() && !chain.after_loss);
        // Without a loss, a later pending record's copy is a divergence.
        let (mut source, mut chain) = chain_with_pending(&[(2, Some(2)), (3, None)]);
        assert_eq!(
            chain.judge(&mut source, &live_id(3, None)),
            Verdict::Diverged
        );
    }

    #[test]
    fn a_snapshot_description_names_the_sequence_it_covers() {
        assert_eq!(covered_of(Some("stream_sequence=42")), Some(42));
        assert_eq!(covered_of(Some("something else")), None);
        assert_eq!(covered_of(None), None);
        assert_eq!(
            covered_by(&snapshot_name(STREAM, 42), None, STREAM, 1),
            Some(42)
        );
        assert_eq!(
            covered_by(&snapshot_name(STREAM, u64::MAX), None, STREAM, 1),
            Some(u64::MAX)
        );
        assert_eq!(
            covered_by(SNAPSHOT_OBJECT, Some("stream_sequence=7"), STREAM, 1),
            Some(7),
            "the single object of kvatlas before per-cut names"
        );
        for other in [
            "snapshot-42",
            "snapshot-0000000000000000004x",
            "notes",
            "snapshot",
        ] {
            assert_eq!(covered_by(other, None, STREAM, 1), None, "{other}");
        }
        // Names sort as the sequences they cover.
        assert!(snapshot_name(STREAM, 9) < snapshot_name(STREAM, 10));
        // Another stream's snapshots (a bucket two fleets share) are none of this stream's,
        // also when one name begins with the other.
        for other in ["EVENTS-B", "EVENT", "OTHER"] {
            assert_eq!(
                covered_by(&snapshot_name(other, 42), None, STREAM, 1),
                None,
                "{other}"
            );
            assert_eq!(
                covered_by(&snapshot_name(STREAM, 42), None, other, 1),
                None,
                "{other}"
            );
        }
        // Named before names carried the stream: any stream's, as then.
        assert_eq!(
            covered_by("snapshot-00000000000000000042", None, STREAM, 1),
            Some(42)
        );
        assert_eq!(
            covered_by("snapshot-00000000000000000042", None, "OTHER", 1),
            Some(42)
        );
    }

    /// A listed snapshot object of stream [`STREAM`] covering `covered`, cut from the stream
    /// created at `stream` (`None`: not saying).
    fn object(covered: u64, stream: Option<i128>) -> SnapshotObject {
        SnapshotObject {
            covered,
            stream,
            info: jetstream::object_store::ObjectInfo {
                name: snapshot_name(STREAM, covered),
                description: None,
                metadata: HashMap::new(),
                headers: None,
                options: None,
                bucket: "b".into(),
                nuid: String::new(),
                size: 0,
                chunks: 0,
                modified: None,
                digest: None,
                deleted: false,
            },
        }
    }

    #[test]
    fn a_snapshot_names_its_stream_and_one_of_a_stream_created_again_is_read_from_its_start() {
        let description = snapshot_description(42, -5);
        assert_eq!(covered_of(Some(&description)), Some(42));
        assert_eq!(stream_of(Some(&description)), Some(-5));
        assert_eq!(stream_of(Some("stream_sequence=42")), None);
        assert_eq!(stream_of(Some("stream_sequence=42 stream_created=x")), None);
        // Of its own stream, or not saying: read on after what it covers.
        assert_eq!(object(42, Some(7)).position_in(7), 42);
        assert_eq!(object(42, None).position_in(7), 42);
        // Of a stream created again since (or before it): from the start.
        assert_eq!(object(42, Some(6)).position_in(7), 0);
        assert_eq!(object(42, Some(8)).position_in(7), 0);
        // The current stream's snapshot is best whatever it covers (also when a gone stream's
        // claims a later creation: a clock stepped back); then one that does not say; then a
        // later stream's before an earlier one's.
        assert!(object(3, Some(7)).rank(7) > object(42, Some(8)).rank(7));
        assert!(object(43, Some(7)).rank(7) > object(42, Some(7)).rank(7));
        assert!(object(3, None).rank(7) > object(42, Some(8)).rank(7));
        assert!(object(3, Some(7)).rank(7) > object(99, None).rank(7));
        assert!(object(3, Some(6)).rank(7) > object(42, Some(5)).rank(7));
    }

    /// How long a replica has seen the newest object: since it started for one there at its
    /// first listing, since it was first listed for a newer one, since its put for its own; a
    /// put that failed or is still under way does not make the object listed before new again.
    #[test]
    fn a_snapshot_is_seen_since_the_start_its_listing_or_its_put() {
        let started = tokio::time::Instant::now();
        let at = |seconds: u64| started + Duration::from_secs(seconds);
        let mut seen = SeenSnapshots::new(started);
        assert_eq!(
            seen.seen("a", at(30)),
            started,
            "there at the first listing"
        );
        assert_eq!(seen.seen("a", at(60)), started);
        assert_eq!(seen.seen("b", at(90)), at(90), "another replica's, new");
        seen.put("c".into(), at(120));
        // The put failed, or is under way: "b" is as old as it was.
        assert_eq!(seen.seen("b", at(150)), at(90));
        assert_eq!(seen.seen("c", at(180)), at(120), "its own, since its put");
        assert_eq!(seen.seen("b", at(210)), at(90));
    }

    /// The snapshot turn is judged by how long the replica has seen the newest object (its own
    /// clock), not by the object's modification time (its writer's clock, which is not read).
    #[test]
    fn a_snapshot_turn_is_judged_by_the_replicas_own_clock() {
        let interval = Duration::from_secs(30);
        let seconds = Duration::from_secs;
        // Another replica's, seen for 10 s: recent, its turn is taken.
        assert!(object(10, Some(7)).takes_the_turn(7, 20, seconds(10), interval));
        // Seen for a whole interval (its writer stopped writing): this replica's turn.
        assert!(!object(10, Some(7)).takes_the_turn(7, 20, seconds(30), interval));
        // This position or a later one: taken, however long seen.
        assert!(object(20, Some(7)).takes_the_turn(7, 20, seconds(600), interval));
        // Another stream's (or one that does not say): not taken.
        assert!(!object(30, Some(8)).takes_the_turn(7, 20, Duration::ZERO, interval));
        assert!(!object(30, None).takes_the_turn(7, 20, Duration::ZERO, interval));
    }

    /// A `nats-server` with JetStream on a free loopback port and a fresh store (killed and
    /// removed when dropped): `KVATLAS_NATS_SERVER`, else `nats-server` on `PATH`, else
    /// Debian's `/usr/sbin/nats-server` (`.ci/run` installs it).
    struct TestNats {
        child: std::process::Child,
        store: std::path::PathBuf,
        url: String,
    }

    impl TestNats {
        async fn start() -> Self {
            let on_path = |name: &std::ffi::OsStr| {
                if std::path::Path::new(name).components().count() > 1 {
                    return Some(std::path::PathBuf::from(name));
                }
                std::env::var_os("PATH").and_then(|paths| {
                    std::env::split_paths(&paths)
                        .map(|dir| dir.join(name))
                        .find(|path| path.is_file())
                })
            };
            let binary = std::env::var_os("KVATLAS_NATS_SERVER")
                .and_then(|name| on_path(&name))
                .or_else(|| on_path("nats-server".as_ref()))
                .unwrap_or_else(|| "/usr/sbin/nats-server".into());
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let store =
                std::env::temp_dir().join(format!("kvatlas-orphans-{}-{port}", std::process::id()));
            let mut child = std::process::Command::new(&binary)
                .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
                .arg(&store)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "{} runs ({e}): install nats-server (Debian's package; .ci/run does)",
                        binary.display()
                    )
                });
            let url = format!("nats://127.0.0.1:{port}");
            // Ready once a NATS client connects (an open port alone was not enough: a client
            // connecting just after it was reset, once in a few runs).
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while async_nats::connect(&url).await.is_err() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("nats-server on port {port} exited: {status}");
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "nats-server is not ready"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Self { child, store, url }
        }
    }

    impl Drop for TestNats {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.store);
        }
    }

    /// The chunks of a put cut off (stored, with no metadata naming them) are purged once old
    /// enough; a fresh one (a put under way) and every named object's chunks are not. With a
    /// real nats-server and async-nats' object store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_of_a_put_cut_off_are_purged_once_old() {
        let nats = TestNats::start().await;
        let client = async_nats::connect(&nats.url).await.expect("connects");
        let js = jetstream::new(client);
        let mut log = NatsLog::new(nats.url.clone());
        log.snapshot_bucket = "orphans".into();
        let bucket = crate::nats::snapshot_bucket(&js, &log)
            .await
            .expect("bucket");
        let kept = vec![7u8; 300 * 1024];
        bucket
            .put("kept", &mut kept.as_slice())
            .await
            .expect("a whole put");
        // A put cut off after its chunks: two chunks on a subject no metadata names.
        let orphan = "$O.orphans.C.cutoffputnuid0000000000";
        for _ in 0..2 {
            js.publish(orphan, vec![1u8; 1024].into())
                .await
                .expect("published")
                .await
                .expect("stored");
        }
        let bucket_stream = js
            .get_stream("OBJ_orphans")
            .await
            .expect("the bucket's stream");
        let chunk_subjects = || async {
            let mut listed = bucket_stream
                .info_with_subjects("$O.orphans.C.>")
                .await
                .expect("info");
            let mut subjects = Vec::new();
            while let Some(subject) = listed.next().await {
                subjects.push(subject.expect("a subject").0);
            }
            subjects
        };
        assert_eq!(chunk_subjects().await.len(), 2);
        // Fresh: spared (another replica's put could be under way).
        assert_eq!(
            purge_orphan_chunks(&bucket, &bucket_stream, "orphans", ORPHAN_CHUNK_AGE).await,
            0
        );
        assert_eq!(chunk_subjects().await.len(), 2);
        // Old enough: purged; the named object is whole.
        assert_eq!(
            purge_orphan_chunks(&bucket, &bucket_stream, "orphans", Duration::ZERO).await,
            1
        );
        let left = chunk_subjects().await;
        assert_eq!(left.len(), 1, "{left:?}");
        assert!(!left[0].ends_with("cutoffputnuid0000000000"), "{left:?}");
        let mut read = Vec::new();
        bucket
            .get("kept")
            .await
            .expect("the kept object")
            .read_to_end(&mut read)
            .await
            .expect("read whole");
        assert_eq!(read, kept);
    }

    /// A nats-server and its snapshot bucket named `name`.
    async fn nats_with_bucket(name: &str) -> (TestNats, jetstream::object_store::ObjectStore) {
        let nats = TestNats::start().await;
        let js = jetstream::new(async_nats::connect(&nats.url).await.expect("connects"));
        let mut log = NatsLog::new(nats.url.clone());
        log.snapshot_bucket = name.into();
        let bucket = crate::nats::snapshot_bucket(&js, &log)
            .await
            .expect("bucket");
        (nats, bucket)
    }

    /// Puts `bytes` in `bucket` as the snapshot object covering `covered` of the stream created
    /// at 1 (not a snapshot: what a damaged store or a put cut off leaves).
    async fn put_garbage_snapshot(
        bucket: &jetstream::object_store::ObjectStore,
        covered: u64,
        bytes: &[u8],
    ) {
        let meta = jetstream::object_store::ObjectMetadata {
            name: snapshot_name(STREAM, covered),
            description: Some(snapshot_description(covered, 1)),
            ..Default::default()
        };
        bucket.put(meta, &mut &*bytes).await.expect("put");
    }

    /// An empty registry with the default settings and limits.
    fn empty_registry() -> Arc<Registry> {
        Arc::new(Registry::new(
            crate::config::IndexSettings::default(),
            crate::config::Limits::default(),
        ))
    }

    /// A snapshot object a replica cannot restore is named in the error, with what to do.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreadable_snapshot_is_named_with_what_to_do() {
        let (_nats, bucket) = nats_with_bucket("broken").await;
        put_garbage_snapshot(&bucket, 7, b"not a snapshot").await;
        let registry = empty_registry();
        // The stream begins after the first record: no snapshot, no start without a hole.
        let stats = LogStats::default();
        let error = restore_newest(&registry, &bucket, STREAM, 1, 2, &stats)
            .await
            .expect_err("garbage is not restored");
        assert!(error.contains(&snapshot_name(STREAM, 7)), "{error}");
        assert!(error.contains("nats object rm broken"), "{error}");
        assert!(registry.all().is_empty(), "nothing restored");
        assert_eq!(
            stats
                .snapshots_unreadable
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        // The stream holds every record: read from its start.
        assert_eq!(
            restore_newest(&registry, &bucket, STREAM, 1, 1, &stats).await,
            Ok(None)
        );
        assert!(registry.all().is_empty(), "nothing restored");
    }

    /// An index image of one block held by `worker`.
    fn image_of(worker: Worker) -> crate::snapshot::IndexImage {
        use kvatlas_index::{Snapshot, SnapshotBlock, Tier, TierSet, WorkerSnapshot};
        crate::snapshot::IndexImage {
            key: IndexKey::new("m", crate::registry::DEFAULT_TENANT),
            block_size: kvatlas_hash::BlockSize::new(16).expect("16"),
            capacity: None,
            feeds: Vec::new(),
            marks: std::collections::BTreeMap::new(),
            snapshot: Snapshot {
                workers: vec![WorkerSnapshot {
                    worker,
                    blocks: vec![SnapshotBlock {
                        external: kvatlas_index::ExternalBlockHash::new(30),
                        local: kvatlas_hash::LocalBlockHash::new(300),
                        parent: None,
                        tiers: TierSet::only(Tier::Device),
                    }],
                }],
            },
        }
    }

    /// Puts the image of one block of `worker` as object `name` covering `covered` of the
    /// stream created at `created`.
    async fn put_image(
        bucket: &jetstream::object_store::ObjectStore,
        worker: Worker,
        name: String,
        covered: u64,
        created: i128,
    ) {
        put_snapshot(bucket, vec![image_of(worker)], name, covered, created)
            .await
            .expect("put");
    }

    /// Prunes bucket `bucket_name`'s snapshots for a replica of stream `stream` created at
    /// `current`, and lists the names left, sorted.
    async fn pruned(
        nats: &TestNats,
        bucket: &jetstream::object_store::ObjectStore,
        bucket_name: &str,
        stream: &str,
        current: i128,
    ) -> Vec<String> {
        let js = jetstream::new(async_nats::connect(&nats.url).await.expect("connects"));
        let bucket_stream = js
            .get_stream(format!("OBJ_{bucket_name}"))
            .await
            .expect("the bucket's stream");
        prune_snapshots(bucket, &bucket_stream, bucket_name, stream, current).await;
        let mut names = Vec::new();
        let mut list = bucket.list().await.expect("lists");
        while let Some(info) = list.next().await {
            names.push(info.expect("an object").name);
        }
        names.sort();
        names
    }

    /// Two streams' fleets sharing a snapshot bucket (the default one) each restore and prune
    /// only their own stream's snapshots: a replica of one restores its stream's snapshot even
    /// when the other's covers the same or a higher sequence, and a put of the other prunes
    /// none of its.
    /// With a real nats-server. (Objects named by the sequence alone were every stream's: a
    /// replica restored the other fleet's state, and each fleet's puts pruned the other's.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_sharing_a_bucket_keep_to_their_own_snapshots() {
        let (nats, bucket) = nats_with_bucket("shared").await;
        let (ours, theirs) = (Worker::new(3, 0), Worker::new(4, 0));
        put_image(&bucket, ours, snapshot_name("A", 7), 7, 1).await;
        // One at the same sequence as ours (its name once replaced ours).
        for covered in [5, 7, 9] {
            put_image(&bucket, theirs, snapshot_name("B", covered), covered, 2).await;
        }
        let (restored, stats) = (empty_registry(), LogStats::default());
        assert_eq!(
            restore_newest(&restored, &bucket, "A", 1, 1, &stats).await,
            Ok(Some(7))
        );
        let entries = restored.all();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].image().snapshot.workers[0].worker, ours);

        let names = pruned(&nats, &bucket, "shared", "B", 2).await;
        assert_eq!(
            names,
            [
                snapshot_name("A", 7),
                snapshot_name("B", 7),
                snapshot_name("B", 9)
            ]
        );
    }

    /// A snapshot named as before names carried the stream (`snapshot-N`) of another stream
    /// sharing the bucket (a fleet not upgraded yet) is neither restored nor pruned by a replica
    /// of this one; one cut from this stream is. With a real nats-server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_old_style_snapshot_of_another_stream_is_neither_restored_nor_pruned() {
        let (nats, bucket) = nats_with_bucket("old-style").await;
        let old_style = |covered: u64| format!("{SNAPSHOT_OBJECT}-{covered:020}");
        let theirs = Worker::new(4, 0);
        put_image(&bucket, theirs, old_style(9), 9, 3).await;
        let (registry, stats) = (empty_registry(), LogStats::default());
        assert_eq!(
            restore_newest(&registry, &bucket, "A", 1, 1, &stats).await,
            Ok(None),
            "nothing of this stream: read from its start"
        );
        assert!(registry.all().is_empty(), "nothing restored");
        // This stream's: one named as before, cut from it, and three named for it.
        let ours = Worker::new(3, 0);
        put_image(&bucket, ours, old_style(4), 4, 1).await;
        for covered in [5, 6, 7] {
            put_image(&bucket, ours, snapshot_name("A", covered), covered, 1).await;
        }
        let names = pruned(&nats, &bucket, "old-style", "A", 1).await;
        assert_eq!(
            names,
            [old_style(9), snapshot_name("A", 6), snapshot_name("A", 7)]
        );
    }

    /// A newest snapshot object that cannot be read does not keep a replica from starting from
    /// the next one — when the stream continues that one; one it does not continue (records
    /// dropped by retention between the two) is not restored, and the error names the newest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_older_snapshot_is_restored_when_the_newest_cannot_be_read() {
        let (_nats, bucket) = nats_with_bucket("fallback").await;
        let worker = Worker::new(3, 0);
        put_image(&bucket, worker, snapshot_name(STREAM, 7), 7, 1).await;
        put_garbage_snapshot(&bucket, 9, b"cut off").await;

        // The stream still holds sequence 8: the older cut is continued.
        let (restored, stats) = (empty_registry(), LogStats::default());
        assert_eq!(
            restore_newest(&restored, &bucket, STREAM, 1, 8, &stats).await,
            Ok(Some(7))
        );
        assert_eq!(
            stats
                .snapshots_unreadable
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        let entries = restored.all();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].image().snapshot.workers[0].worker, worker);

        // The stream begins at 9: restoring 7 would leave sequence 8 unread.
        let (untouched, stats) = (empty_registry(), LogStats::default());
        let error = restore_newest(&untouched, &bucket, STREAM, 1, 9, &stats)
            .await
            .expect_err("no snapshot the stream continues can be read");
        assert!(error.contains(&snapshot_name(STREAM, 9)), "{error}");
        assert!(untouched.all().is_empty(), "nothing restored");
        assert_eq!(
            stats
                .snapshots_unreadable
                .load(std::sync::atomic::Ordering::Relaxed),
            1,
            "the older one was not tried"
        );
    }
}
