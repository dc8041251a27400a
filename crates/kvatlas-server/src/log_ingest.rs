//! The ingest side of the event log: every unit a feed hands to an index is also published
//! to the NATS JetStream stream, in the order the index applies it.
//!
//! - [`LoggedSink`] sits between the ZMQ listeners and an index's writers: a unit is accepted
//!   only if both the log's queue and the writers have room (a listener waits otherwise), so
//!   the log never misses a unit the index applied and memory stays bounded.
//! - [`run_publisher`] publishes the queue. One message of a worker instance (every rank of it,
//!   in one index) is in flight at a time (the next after the stream acknowledged the previous
//!   one), so a retry after a failure never reorders an instance's records, and an
//!   unregistration of every rank follows each rank's earlier batches; the records that queued
//!   behind it go together in the next message (up to 64 records, 512 KiB); different instances
//!   are in flight together.
//!   A failed publish is retried with the same message id until the stream takes it: a record
//!   stored twice (an acknowledgement lost) is dropped by the stream's duplicate window.
//! - The **live path** (`NatsLog::live`, on by default): as the publisher takes each record off
//!   the queue it also publishes it at once on core NATS (no storage, no acknowledgement, a
//!   bounded queue of its own: a record left off is counted and the stream still carries it),
//!   with the digest of the source's record before it ([`log_record::LIVE_PREV_HEADER`]), so a
//!   replica can tell whether it continues the records it holds (`log_replica`). A record too
//!   large for the stream to surely take ([`LivePath::max_record_bytes`]) is left to the stream.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use kvatlas_events::{MutationSink, SinkError};
use kvatlas_hash::BlockSize;
use kvatlas_index::{ThreadPool, Unit, Worker};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::log_record::{self, Outgoing};
use crate::nats::{LogStats, NatsLog};
use crate::registry::IndexKey;
use crate::served_index::ServedIndex;

/// Records queued for publishing before feeds wait: the channel to the publisher holds as
/// many, and so do the publisher's lanes (records behind their instance's message in flight),
/// besides the messages in flight ([`IN_FLIGHT`]).
pub(crate) const QUEUE: usize = 8192;
/// Messages in flight to the stream at once (at most one per source).
const IN_FLIGHT: usize = 512;
/// Live records queued for core NATS before more are left off.
const LIVE_QUEUE: usize = 4096;

/// A live record: its subject, the digest of its source's record before it, its wire form.
type LiveRecord = (String, u64, bytes::Bytes);

/// Per source, the digest of the last record published live: what the next names as its
/// predecessor.
///
/// Invariant: it holds only sources that have published since they were last unregistered, so
/// it grows with the registered ranks, not with every rank that ever published.
#[derive(Debug, Default)]
struct LiveHeads(HashMap<(IndexKey, Worker), u64>);

impl LiveHeads {
    /// Takes `record` in: `Some(predecessor's digest)` (0 for a source's first record) for a
    /// batch to publish live; `None` for an unregistration, which is not published live (a
    /// replica applies only batches live) and ends the chains of the ranks it names, as it ends
    /// them at a replica (`log_replica`). A source that comes back starts a new chain, and its
    /// first live record is left to the stream.
    fn advance(&mut self, record: &Outgoing) -> Option<u64> {
        let (key, worker) = &record.source;
        if let Some(ranks) = record.unregisters {
            self.0.retain(|(k, w), _| {
                k != key
                    || w.worker_id != worker.worker_id
                    || ranks.is_some_and(|rank| rank != w.dp_rank)
            });
            return None;
        }
        let digest = log_record::digest(&record.payload);
        // The source's key is cloned once, when it first publishes.
        Some(match self.0.get_mut(&record.source) {
            Some(head) => std::mem::replace(head, digest),
            None => {
                self.0.insert(record.source.clone(), digest);
                0
            }
        })
    }
}

/// The live path's publishing side.
struct LivePath {
    tx: mpsc::Sender<LiveRecord>,
    prefix: String,
    heads: LiveHeads,
    stats: Arc<LogStats>,
    /// The largest record published live: one the stream surely takes alone (its framed
    /// payload within [`group_bytes`] of [`message_limit`]). A larger one is left to the
    /// stream: nats-server may refuse its stream message (a few dozen bytes of headers more
    /// than the live one, or beyond the stream's own limit), and a replica that applied it
    /// live would then find the source's next record diverge.
    max_record_bytes: usize,
}

impl LivePath {
    /// Starts the task that publishes live records on `client`.
    fn start(
        client: async_nats::Client,
        log: &NatsLog,
        stats: Arc<LogStats>,
        max_record_bytes: usize,
    ) -> Self {
        let (tx, mut rx) = mpsc::channel::<LiveRecord>(LIVE_QUEUE);
        let task_stats = Arc::clone(&stats);
        tokio::spawn(async move {
            while let Some((subject, prev, payload)) = rx.recv().await {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(
                    log_record::LIVE_PREV_HEADER,
                    format!("{prev:016x}").as_str(),
                );
                let published = client.publish_with_headers(subject, headers, payload).await;
                if published.is_ok() {
                    LogStats::bump(&task_stats.live_published);
                } else {
                    LogStats::bump(&task_stats.live_dropped);
                }
            }
        });
        Self {
            tx,
            prefix: log.live_prefix(),
            heads: LiveHeads::default(),
            stats,
            max_record_bytes,
        }
    }

    /// Publishes a batch's `record` live (or counts it left off), chained to its source's last
    /// record; an unregistration only ends chains ([`LiveHeads::advance`]).
    fn publish(&mut self, record: &Outgoing) {
        let Some(prev) = self.heads.advance(record) else {
            return;
        };
        // Left to the stream (the chain goes on from it: the next live record names it, and
        // continues a replica's chain once the stream delivered it).
        if !fits_live(record.payload.len(), self.max_record_bytes) {
            return;
        }
        let subject =
            log_record::subject(&self.prefix, &record.source.0, record.source.1.worker_id);
        if self
            .tx
            .try_send((subject, prev, record.payload.clone()))
            .is_err()
        {
            LogStats::bump(&self.stats.live_dropped);
        }
    }
}

/// The handle feeds publish through.
#[derive(Debug)]
pub(crate) struct LogHandle {
    tx: mpsc::Sender<Outgoing>,
    stats: Arc<LogStats>,
    /// The ingest only publishes (`--publish-only`): units are not applied to its indexes,
    /// and its indexes refuse queries.
    pub(crate) publish_only: bool,
    /// The stream's duplicate window: how long a message id, once stored, makes a later
    /// message with the same id a duplicate.
    pub(crate) duplicate_window: Duration,
}

impl LogHandle {
    /// A handle and the receiving end [`run_publisher`] drains.
    pub(crate) fn new(
        stats: Arc<LogStats>,
        publish_only: bool,
        duplicate_window: Duration,
    ) -> (Arc<Self>, mpsc::Receiver<Outgoing>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (
            Arc::new(Self {
                tx,
                stats,
                publish_only,
                duplicate_window,
            }),
            rx,
        )
    }

    /// Waits for room, then queues `record` (from async code: `PublishEvents`).
    pub(crate) async fn send(&self, record: Outgoing) {
        LogStats::bump(&self.stats.queued);
        // Fails only once the publisher is gone (shutdown): nothing is left to publish to.
        if self.tx.send(record).await.is_err() {
            LogStats::bump(&self.stats.lost_at_shutdown);
        }
    }

    /// Queues `record` if the queue has room now, else hands it back; once the publisher is
    /// gone (shutdown) it is counted as lost, as [`LogHandle::send`] does: nothing is left to
    /// publish to.
    pub(crate) fn try_send(&self, record: Outgoing) -> Option<Outgoing> {
        match self.tx.try_send(record) {
            Ok(()) => {
                LogStats::bump(&self.stats.queued);
                None
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                LogStats::bump(&self.stats.queued);
                LogStats::bump(&self.stats.lost_at_shutdown);
                None
            }
            Err(mpsc::error::TrySendError::Full(record)) => Some(record),
        }
    }

    /// Queues `record` from blocking code (an unregistration, which runs on a blocking thread),
    /// waiting for room if the queue is full: it is queued before anything the caller does
    /// next (a task sending it later could let a re-registered rank's batches overtake it, and
    /// a replica would then remove them).
    ///
    /// # Panics
    /// Called from an async task (it blocks its thread).
    pub(crate) fn send_now(&self, record: Outgoing) {
        LogStats::bump(&self.stats.queued);
        // Fails only once the publisher is gone (shutdown): nothing is left to publish to.
        if self.tx.blocking_send(record).is_err() {
            LogStats::bump(&self.stats.lost_at_shutdown);
        }
    }
}

/// A [`MutationSink`] that hands each unit to an index's writers and queues its record (only
/// queues it on a publish-only ingest).
pub(crate) struct LoggedSink {
    pub(crate) pool: Arc<ThreadPool<ServedIndex>>,
    pub(crate) log: Arc<LogHandle>,
    pub(crate) key: IndexKey,
    pub(crate) block_size: BlockSize,
    /// The salts of ranks registered again within the duplicate window.
    pub(crate) id_salts: Arc<crate::registry::IdSalts>,
}

impl MutationSink for LoggedSink {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        let permit = match self.log.tx.try_reserve() {
            Ok(permit) => permit,
            Err(mpsc::error::TrySendError::Full(())) => return Err(SinkError::Full(unit)),
            Err(mpsc::error::TrySendError::Closed(())) => return Err(SinkError::Closed(unit)),
        };
        let salt = self.id_salts.of(log_record::source_of(&unit));
        let record = log_record::encode_unit_salted(&self.key, self.block_size, &unit, salt);
        if !self.log.publish_only {
            self.pool.try_push(unit)?;
        }
        LogStats::bump(&self.log.stats.queued);
        permit.send(record);
        Ok(())
    }
}

/// A publish's outcome: the records back, and whether the stream took them (`Ok(true)`: as a
/// duplicate).
type Published = (Vec<Outgoing>, Result<bool, Failure>);

/// Why a publish failed.
#[derive(Debug)]
enum Failure {
    /// Worth retrying (NATS unreachable, no acknowledgement in time, ...).
    Transient(String),
    /// The message is larger than the server's `max_payload`, or the stream's `max_msg_size`:
    /// retrying cannot help. A group is split; a single record is refused and counted.
    TooLarge(String),
    /// No stream takes the subject (it was deleted, or nats-server lost its storage): the
    /// publisher creates it again and retries.
    NoStream(String),
}

/// Messages in flight: their tasks, and each task's lane and record count, so that a lane
/// whose task panicked (its records are gone with it) still moves on to its next message
/// instead of staying busy for ever.
#[derive(Default)]
struct Flights {
    tasks: JoinSet<Published>,
    lanes: HashMap<tokio::task::Id, (Lane, usize)>,
}

/// A message's task ended: its lane and records with the outcome, or, if the task panicked,
/// its lane and how many records were lost with it.
enum Landed {
    Done(Lane, Published),
    Panicked(Lane, usize),
}

impl Flights {
    fn len(&self) -> usize {
        self.tasks.len()
    }

    fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// The next message whose task ended (`None`: none in flight).
    async fn next(&mut self) -> Option<Landed> {
        loop {
            let done = self.tasks.join_next_with_id().await?;
            if let Some(landed) = self.landed(done) {
                return Some(landed);
            }
        }
    }

    /// A task's end as its lane's: `None` for a task not listed (every task is, when spawned:
    /// [`spawn_publish`]).
    fn landed(
        &mut self,
        done: Result<(tokio::task::Id, Published), tokio::task::JoinError>,
    ) -> Option<Landed> {
        let (id, published) = match done {
            Ok((id, published)) => (id, Some(published)),
            Err(error) => (error.id(), None),
        };
        let (lane, records) = self.lanes.remove(&id)?;
        Some(match published {
            Some(published) => Landed::Done(lane, published),
            None => Landed::Panicked(lane, records),
        })
    }
}

/// Takes the next message's records of a source's backlog: as many as fit one message of at
/// most `max_bytes`.
fn next_group(backlog: &mut VecDeque<Outgoing>, max_bytes: usize) -> Vec<Outgoing> {
    let mut group = Vec::new();
    let mut bytes = 0;
    while let Some(next) = backlog.front() {
        // Each record is framed with its length (`log_record::frame`).
        let framed = next.payload.len() + varint_len(next.payload.len());
        let full = group.len() == log_record::MAX_RECORDS_PER_MESSAGE
            || (!group.is_empty() && bytes + framed > max_bytes);
        if full {
            break;
        }
        bytes += framed;
        group.extend(backlog.pop_front());
    }
    group
}

/// What orders publishing: an index's worker instance. A record goes out only after every
/// earlier record of its instance was stored, so an unregistration of every rank of an instance
/// is stored after every batch of any of its ranks that was queued before it (with a lane per
/// rank, one queued behind another message of its rank was stored after the unregistration: a
/// replica then held the batch's blocks of a removed worker).
type Lane = (IndexKey, u64);

fn lane_of(record: &Outgoing) -> Lane {
    (record.source.0.clone(), record.source.1.worker_id)
}

/// The publisher's lanes: at most one message in flight per lane, the lane's later records
/// waiting behind it in order.
#[derive(Debug)]
struct Lanes {
    /// Lanes with a message in flight.
    busy: HashSet<Lane>,
    waiting: HashMap<Lane, VecDeque<Outgoing>>,
    /// Records waiting, over every lane.
    queued: usize,
    /// The most payload bytes a group takes ([`group_bytes`]).
    max_bytes: usize,
}

/// Whether a record of `payload_len` bytes goes live: its framed form within `max_record_bytes`
/// ([`LivePath::max_record_bytes`]).
fn fits_live(payload_len: usize, max_record_bytes: usize) -> bool {
    payload_len + varint_len(payload_len) <= max_record_bytes
}

/// The most bytes of a message (payload and headers) the stream takes: nats-server's
/// `max_payload` (`0`: unknown) and the stream's `max_msg_size` (≤ 0: none), the smaller.
fn message_limit(max_payload: usize, stream_max_message_size: i32) -> usize {
    match usize::try_from(stream_max_message_size) {
        Ok(limit) if limit > 0 && max_payload > 0 => max_payload.min(limit),
        Ok(limit) if limit > 0 => limit,
        _ => max_payload,
    }
}

/// The most payload bytes of a group of records for a stream whose messages take at most
/// `max_payload` bytes ([`message_limit`]; `0`: unknown): [`log_record::MAX_MESSAGE_BYTES`], or less with room for the
/// message's headers ([`HEADER_ROOM`]), so that groups fit and only a single record too large
/// is refused. (Read when the publisher starts: a server that comes back with a smaller one
/// has groups split as they are refused.)
fn group_bytes(max_payload: usize) -> usize {
    if max_payload == 0 {
        return log_record::MAX_MESSAGE_BYTES;
    }
    log_record::MAX_MESSAGE_BYTES.min(max_payload.saturating_sub(HEADER_ROOM).max(1))
}

/// Room left in a message for its headers: `NATS/1.0`, and a `Nats-Msg-Id` of two names of at
/// most 256 bytes, percent-encoded (up to 3 bytes each), the worker, rank and sequence, and a
/// group's count and hash.
const HEADER_ROOM: usize = 2048;

impl Lanes {
    /// No lane busy; groups of at most `max_bytes` ([`group_bytes`]).
    fn new(max_bytes: usize) -> Self {
        Self {
            busy: HashSet::new(),
            waiting: HashMap::new(),
            queued: 0,
            max_bytes,
        }
    }

    /// Takes a record off the queue: `Some` to publish it now (its lane was idle and is now
    /// busy), `None` if it waits behind its lane's message in flight.
    fn take(&mut self, record: Outgoing) -> Option<Outgoing> {
        let lane = lane_of(&record);
        if self.busy.contains(&lane) {
            self.queued += 1;
            self.waiting.entry(lane).or_default().push_back(record);
            None
        } else {
            self.busy.insert(lane);
            Some(record)
        }
    }

    /// Puts `records` (of `lane`, in order) back at the front of the lane's waiting records:
    /// the lane's message in flight was split.
    fn put_back(&mut self, lane: &Lane, records: Vec<Outgoing>) {
        if records.is_empty() {
            return;
        }
        self.queued += records.len();
        let waiting = self.waiting.entry(lane.clone()).or_default();
        for record in records.into_iter().rev() {
            waiting.push_front(record);
        }
    }

    /// The stream stored the message of `lane` in flight: the lane's next message (as many of
    /// its waiting records as fit one), or nothing, and the lane is idle.
    fn stored(&mut self, lane: &Lane) -> Vec<Outgoing> {
        let group = self
            .waiting
            .get_mut(lane)
            .map(|backlog| next_group(backlog, self.max_bytes))
            .unwrap_or_default();
        if group.is_empty() {
            self.busy.remove(lane);
            self.waiting.remove(lane);
        } else {
            self.queued -= group.len();
        }
        group
    }
}

/// Publishes the queue until `stop` is cancelled and the queue is drained (see the module
/// docs); returns the records it could not publish before `drain_deadline` after `stop`.
/// `stream_max_message_size`: the stream's `max_msg_size` when the publisher starts (≤ 0:
/// none).
pub(crate) async fn run_publisher(
    js: jetstream::Context,
    log: NatsLog,
    stream_max_message_size: i32,
    mut rx: mpsc::Receiver<Outgoing>,
    stats: Arc<LogStats>,
    stop: CancellationToken,
    drain_until: Arc<std::sync::OnceLock<tokio::time::Instant>>,
) -> u64 {
    let max_bytes = group_bytes(message_limit(
        js.client().server_info().max_payload,
        stream_max_message_size,
    ));
    let mut live = log
        .live
        .then(|| LivePath::start(js.client(), &log, Arc::clone(&stats), max_bytes));
    let prefix = log.subject_prefix.clone();
    let mut lanes = Lanes::new(max_bytes);
    let mut flights = Flights::default();
    // Creating the stream again after it was found missing (at most once a second).
    let mut creating: Option<tokio::task::JoinHandle<()>> = None;
    let mut last_creation: Option<tokio::time::Instant> = None;
    let mut retry_backoff = Duration::from_millis(10);
    let mut stopping = false;
    // The queue is closed and empty: `recv` would answer `None` at once on every turn, and the
    // loop would spin while messages are still in flight.
    let mut drained = false;
    let mut deadline = None;
    loop {
        let room = lanes.queued < QUEUE && flights.len() < IN_FLIGHT;
        tokio::select! {
            biased;
            Some(landed) = flights.next(), if !flights.is_empty() => {
                let (lane, (records, outcome)) = match landed {
                    Landed::Done(lane, published) => (lane, published),
                    Landed::Panicked(lane, lost) => {
                        stats.publish_refused.fetch_add(lost as u64, std::sync::atomic::Ordering::Relaxed);
                        tracing::error!(
                            "publishing {lost} record(s) to NATS panicked: they are dropped and \
                             the replicas will not get them (counted in \
                             kvatlas_log_publish_refused_total); the worker's next records go on"
                        );
                        publish_next(&mut lanes, &mut flights, &js, &prefix, &lane);
                        continue;
                    }
                };
                match outcome {
                    Ok(duplicate) => {
                        use std::sync::atomic::Ordering::Relaxed;
                        retry_backoff = Duration::from_millis(10);
                        let n = records.len() as u64;
                        stats.published.fetch_add(n, Relaxed);
                        for record in &records {
                            stats.publish_latency.observe(record.queued_at.elapsed());
                        }
                        if duplicate {
                            stats.publish_duplicates.fetch_add(n, Relaxed);
                        } else {
                            stats.published_bytes.fetch_add(wire_bytes(&prefix, &records), Relaxed);
                        }
                        publish_next(&mut lanes, &mut flights, &js, &prefix, &lane);
                    }
                    Err(Failure::TooLarge(error)) => {
                        let mut records = records;
                        if records.len() > 1 {
                            // Too many records for one message here: the first goes alone, the
                            // rest wait at the front of the lane, in order.
                            let rest = records.split_off(1);
                            lanes.put_back(&lane, rest);
                            spawn_publish(&mut flights, &js, &prefix, records, Duration::ZERO);
                            continue;
                        }
                        LogStats::bump(&stats.publish_refused);
                        tracing::error!(
                            "a record of {} bytes cannot be published: {error}; it is dropped \
                             and the replicas will not get it (counted in \
                             kvatlas_log_publish_refused_total; raise nats-server's \
                             max_payload or the stream's max_msg_size, or have the engine send \
                             smaller batches)",
                            records.first().map_or(0, |r| r.payload.len()),
                        );
                        publish_next(&mut lanes, &mut flights, &js, &prefix, &lane);
                    }
                    Err(Failure::NoStream(error)) => {
                        LogStats::bump(&stats.publish_retries);
                        if creating.as_ref().is_none_or(tokio::task::JoinHandle::is_finished)
                            && last_creation.is_none_or(|at| at.elapsed() >= Duration::from_secs(1))
                        {
                            tracing::debug!("publishing to NATS found no stream: {error}");
                            last_creation = Some(tokio::time::Instant::now());
                            creating = Some(tokio::spawn(create_again(
                                js.clone(),
                                log.clone(),
                                Arc::clone(&stats),
                            )));
                        }
                        spawn_publish(&mut flights, &js, &prefix, records, retry_backoff);
                        retry_backoff = (retry_backoff * 2).min(Duration::from_secs(1));
                    }
                    Err(Failure::Transient(error)) => {
                        LogStats::bump(&stats.publish_retries);
                        tracing::warn!(
                            "publishing to NATS failed ({error}); retrying in {retry_backoff:?}"
                        );
                        spawn_publish(&mut flights, &js, &prefix, records, retry_backoff);
                        retry_backoff = (retry_backoff * 2).min(Duration::from_secs(1));
                    }
                }
            }
            received = rx.recv(), if room && !drained => match received {
                Some(record) => {
                    if let Some(published) = record.published {
                        stats.sent_age.observe(published.elapsed());
                    }
                    // Not while stopping: the drain may end before the stream stores it, and a
                    // record applied live that the stream never holds is an orphan at every
                    // replica (each goes back to the stream's state for it).
                    if let Some(live) = &mut live
                        && !stopping
                    {
                        live.publish(&record);
                    }
                    if let Some(record) = lanes.take(record) {
                        spawn_publish(&mut flights, &js, &prefix, vec![record], Duration::ZERO);
                    }
                }
                None => {
                    stopping = true;
                    drained = true;
                }
            },
            () = stop.cancelled(), if !stopping => {
                stopping = true;
                rx.close();
                // Set before `stop` is cancelled (a second if not: a caller that did not say).
                deadline = Some(drain_until.get().copied().unwrap_or_else(|| {
                    tokio::time::Instant::now() + Duration::from_secs(1)
                }));
            }
            () = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => break,
        }
        if stopping && flights.is_empty() && lanes.queued == 0 && rx.is_empty() {
            break;
        }
    }
    let in_flight: usize = {
        let mut n = 0;
        while let Some(done) = flights.tasks.try_join_next_with_id() {
            n += match flights.landed(done) {
                Some(Landed::Done(_, (records, Err(_)))) => records.len(),
                Some(Landed::Panicked(_, lost)) => lost,
                Some(Landed::Done(_, (_, Ok(_)))) | None => 0,
            };
        }
        n + flights
            .lanes
            .values()
            .map(|(_, records)| records)
            .sum::<usize>()
    };
    flights.tasks.abort_all();
    let left = lanes.queued + in_flight + rx.len();
    u64::try_from(left).unwrap_or(u64::MAX)
}

/// The bytes a message takes on the wire: its subject, its header block (`NATS/1.0`, the
/// `Nats-Msg-Id` line, the blank line) and its framed payload.
fn wire_bytes(prefix: &str, records: &[Outgoing]) -> u64 {
    let Some(first) = records.first() else {
        return 0;
    };
    let subject = log_record::subject(prefix, &first.source.0, first.source.1.worker_id);
    let headers = log_record::group_id(records)
        .map_or(0, |id| "NATS/1.0\r\nNats-Msg-Id: \r\n\r\n".len() + id.len());
    let payload: usize = records
        .iter()
        .map(|r| r.payload.len() + varint_len(r.payload.len()))
        .sum();
    (subject.len() + headers + payload) as u64
}

fn varint_len(n: usize) -> usize {
    prost::encoding::encoded_len_varint(n as u64)
}

/// The message in flight of `lane` is done with (stored, or refused for good): publishes the
/// lane's next message, if records wait, else the lane is idle.
fn publish_next(
    lanes: &mut Lanes,
    flights: &mut Flights,
    js: &jetstream::Context,
    prefix: &str,
    lane: &Lane,
) {
    let group = lanes.stored(lane);
    if !group.is_empty() {
        spawn_publish(flights, js, prefix, group, Duration::ZERO);
    }
}

/// Publishes `records` (one lane's, in order) as one message after `delay`.
fn spawn_publish(
    flights: &mut Flights,
    js: &jetstream::Context,
    prefix: &str,
    records: Vec<Outgoing>,
    delay: Duration,
) {
    let js = js.clone();
    let Some(first) = records.first() else {
        return;
    };
    let subject = log_record::subject(prefix, &first.source.0, first.source.1.worker_id);
    let lane = (lane_of(first), records.len());
    let task = flights.tasks.spawn(async move {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let mut publish =
            jetstream::message::PublishMessage::build().payload(log_record::frame(&records));
        if let Some(id) = log_record::group_id(&records) {
            publish = publish.message_id(id.as_str());
        }
        let outcome = match js.send_publish(subject, publish).await {
            Ok(ack) => match ack.await {
                Ok(ack) => Ok(ack.duplicate),
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::context::PublishErrorKind::StreamNotFound =>
                {
                    Err(Failure::NoStream(e.to_string()))
                }
                // The stream's own limit on a message (its `max_msg_size`, set by whoever
                // created it): refused for good, as one too large for nats-server.
                Err(e)
                    if api_error_code(&e)
                        == Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) =>
                {
                    Err(Failure::TooLarge(format!("the stream refused it: {e}")))
                }
                Err(e) => Err(Failure::Transient(format!("no acknowledgement: {e}"))),
            },
            Err(e)
                if e.kind()
                    == async_nats::jetstream::context::PublishErrorKind::MaxPayloadExceeded =>
            {
                Err(Failure::TooLarge(e.to_string()))
            }
            Err(e) => Err(Failure::Transient(e.to_string())),
        };
        (records, outcome)
    });
    flights.lanes.insert(task.id(), lane);
}

/// The JetStream API error code a refused publish carries, if the stream answered with one.
fn api_error_code(error: &jetstream::context::PublishError) -> Option<jetstream::ErrorCode> {
    use std::error::Error as _;
    error
        .source()?
        .downcast_ref::<jetstream::Error>()
        .map(jetstream::Error::error_code)
}

/// Creates the stream again after a publish found none for its subject (it was deleted, or
/// nats-server lost its storage); counted in `kvatlas_log_stream_created_again_total` if the
/// create succeeded (an identical create racing another ingest's succeeds too).
async fn create_again(js: jetstream::Context, log: NatsLog, stats: Arc<LogStats>) {
    if let Ok(stream) = js.get_stream(&log.stream).await {
        // Another ingest, or a replica, created it meanwhile; or it never took the subjects.
        let subjects = &stream.cached_info().config.subjects;
        if !subjects.contains(&log.subjects()) {
            tracing::warn!(
                stream = %log.stream,
                ?subjects,
                "publishing to NATS found no stream for {}, and stream {} does not take it \
                 (a stream of that name made with other settings?)",
                log.subjects(),
                log.stream
            );
        }
        return;
    }
    match js.create_stream(crate::nats::stream_config(&log)).await {
        Ok(_) => {
            LogStats::bump(&stats.stream_created_again);
            tracing::warn!(
                stream = %log.stream,
                "created the event-log stream again: the replicas read it from its start, and \
                 records that only the lost stream held are gone"
            );
        }
        Err(error) => tracing::warn!("creating the event-log stream again: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvatlas_index::Mutation;

    fn batch(key: &IndexKey, worker: Worker, tag: u64) -> Outgoing {
        let size = BlockSize::new(16).expect("16");
        let unit = Unit {
            worker_id: worker.worker_id,
            mutations: vec![Mutation::Removed {
                worker,
                tier: kvatlas_index::Tier::Device,
                blocks: vec![kvatlas_index::ExternalBlockHash::new(tag)],
            }],
            checkpoint: None,
            resync: false,
            received: None,
            published: None,
        };
        log_record::encode_unit(key, size, &unit)
    }

    #[test]
    fn live_heads_chain_each_source_and_forget_unregistered_ones() {
        let size = BlockSize::new(16).expect("16");
        let (a, b) = (IndexKey::new("m", "t"), IndexKey::new("n", "t"));
        let mut heads = LiveHeads::default();
        let first = batch(&a, Worker::new(1, 0), 1);
        assert_eq!(heads.advance(&first), Some(0), "a source's first record");
        assert_eq!(
            heads.advance(&batch(&a, Worker::new(1, 0), 2)),
            Some(log_record::digest(&first.payload)),
            "the next names its predecessor"
        );
        for worker in [Worker::new(1, 1), Worker::new(1, 2), Worker::new(2, 0)] {
            heads.advance(&batch(&a, worker, 3));
        }
        heads.advance(&batch(&b, Worker::new(1, 0), 4));
        assert_eq!(heads.0.len(), 5);

        // One rank: only it is forgotten, and the unregistration is not published live.
        assert_eq!(
            heads.advance(&log_record::encode_unregister(&a, size, 1, Some(1))),
            None
        );
        assert_eq!(heads.0.len(), 4);
        assert!(!heads.0.contains_key(&(a.clone(), Worker::new(1, 1))));
        // The whole instance in one index: the other instance and the other index stay.
        assert_eq!(
            heads.advance(&log_record::encode_unregister(&a, size, 1, None)),
            None
        );
        let mut left: Vec<_> = heads.0.keys().cloned().collect();
        left.sort();
        assert_eq!(
            left,
            vec![(a.clone(), Worker::new(2, 0)), (b, Worker::new(1, 0))]
        );
        // A source that comes back starts a new chain.
        assert_eq!(heads.advance(&batch(&a, Worker::new(1, 0), 5)), Some(0));
    }

    /// Groups fit nats-server's `max_payload` (with room for the headers), and a group split
    /// after the server refused it as too large goes out again in its order.
    #[test]
    fn groups_fit_the_servers_max_payload_and_a_split_group_keeps_its_order() {
        assert_eq!(group_bytes(0), log_record::MAX_MESSAGE_BYTES);
        assert_eq!(group_bytes(1 << 20), log_record::MAX_MESSAGE_BYTES);
        assert_eq!(group_bytes(4096), 2048);
        // The stream's own limit, when it has one below nats-server's.
        assert_eq!(message_limit(1 << 20, 0), 1 << 20);
        assert_eq!(message_limit(1 << 20, -1), 1 << 20);
        assert_eq!(message_limit(1 << 20, 4096), 4096);
        assert_eq!(message_limit(4096, 1 << 20), 4096);
        assert_eq!(message_limit(0, 4096), 4096);
        let a = IndexKey::new("m", "t");
        let record = |tag: u64| {
            let mut record = batch(&a, Worker::new(1, 0), tag);
            record.payload = bytes::Bytes::from(vec![u8::try_from(tag).unwrap_or(0); 900]);
            record
        };
        let mut lanes = Lanes::new(group_bytes(4096));
        assert!(lanes.take(record(1)).is_some());
        for tag in 2..=5 {
            assert!(lanes.take(record(tag)).is_none());
        }
        let lane = (a.clone(), 1);
        let tags = |group: &[Outgoing]| -> Vec<u8> { group.iter().map(|r| r.payload[0]).collect() };
        let group = lanes.stored(&lane);
        assert_eq!(
            tags(&group),
            [2, 3],
            "two framed records of 902 bytes fit 2,048; three do not"
        );
        // At the boundary the length prefixes count: two records of 1,023 bytes are 2,046
        // bytes, but 2,050 framed.
        let mut tight = Lanes::new(group_bytes(4096));
        let large = |tag: u64| {
            let mut record = record(tag);
            record.payload = bytes::Bytes::from(vec![u8::try_from(tag).unwrap_or(0); 1023]);
            record
        };
        assert!(tight.take(large(6)).is_some());
        assert!(tight.take(large(7)).is_none() && tight.take(large(8)).is_none());
        assert_eq!(
            tags(&tight.stored(&lane)),
            [7],
            "one framed record at a time"
        );
        // Refused as too large anyway: the first goes alone, the second waits in front.
        let mut group = group;
        lanes.put_back(&lane, group.split_off(1));
        assert_eq!(lanes.queued, 3);
        assert_eq!(tags(&lanes.stored(&lane)), [3, 4]);
        assert_eq!(tags(&lanes.stored(&lane)), [5]);
        assert!(lanes.stored(&lane).is_empty(), "the lane is idle");
        assert_eq!(lanes.queued, 0);
    }

    /// Every rank of an instance shares a lane: an unregistration of the whole instance waits
    /// behind a batch of rank 3 queued before it (with a lane per rank it went out at once and
    /// was stored before the batch).
    #[test]
    fn an_instance_unregistration_waits_for_every_rank_queued_before_it() {
        let size = BlockSize::new(16).expect("16");
        let (a, b) = (IndexKey::new("m", "t"), IndexKey::new("n", "t"));
        let mut lanes = Lanes::new(log_record::MAX_MESSAGE_BYTES);
        let in_flight = lanes.take(batch(&a, Worker::new(1, 3), 1));
        assert!(in_flight.is_some(), "an idle lane publishes at once");
        assert!(
            lanes.take(batch(&a, Worker::new(1, 3), 2)).is_none(),
            "behind it"
        );
        assert!(
            lanes
                .take(log_record::encode_unregister(&a, size, 1, None))
                .is_none(),
            "the unregistration waits behind rank 3's batches"
        );
        // Other instances and other indexes are not held up.
        assert!(lanes.take(batch(&a, Worker::new(2, 3), 3)).is_some());
        assert!(lanes.take(batch(&b, Worker::new(1, 3), 4)).is_some());
        assert_eq!(lanes.queued, 2);
        // Once rank 3's message is stored, the rest goes out in order, in one message.
        let next = lanes.stored(&(a.clone(), 1));
        assert_eq!(next.len(), 2);
        assert_eq!(next[0].source.1, Worker::new(1, 3));
        assert_eq!(next[1].unregisters, Some(None));
        assert_eq!(lanes.queued, 0);
        assert!(
            lanes.stored(&(a.clone(), 1)).is_empty(),
            "the lane is idle again"
        );
        assert!(lanes.take(batch(&a, Worker::new(1, 0), 5)).is_some());
    }
}
