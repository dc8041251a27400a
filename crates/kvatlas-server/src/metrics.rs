//! Prometheus metrics in the text exposition format (version 0.0.4), all prefixed `kvatlas_`.
//!
//! Request instruments are atomics updated on the request path (a histogram per RPC, counters
//! per RPC and status code, shed requests, requests in flight); index and listener figures are
//! read from the registry when `/metrics` is scraped. Every instrument belongs to one server
//! (no global recorder), so several servers in one process — tests do that — keep their own.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kvatlas_request_duration_seconds` | histogram | `rpc` (each `QueryStream` message counts as one request) |
//! | `kvatlas_requests_total` | counter | `rpc`, `code` (gRPC status name; errors are `code!="OK"`) |
//! | `kvatlas_requests_shed_total` | counter | `rpc` (gRPC requests refused at the concurrency limit; HTTP ones are `kvatlas_http_requests_total{status="429"}`) |
//! | `kvatlas_requests_in_flight` | gauge | (gRPC requests and open streams, and HTTP requests but `/health`, `/ready`, `/metrics`) |
//! | `kvatlas_auth_failures_total` | counter | (missing or unknown credentials) |
//! | `kvatlas_http_requests_total` | counter | `route`, `status` |
//! | `kvatlas_reloads_total` | counter | `file` (`tokens`, `tls`), `outcome` (`applied`; `refused`: a changed file that is not valid, counted at every check while it stays so — the server goes on with what it had) |
//! | `kvatlas_ready` | gauge | (1 once the startup gate is open) |
//! | `kvatlas_registered_ranks` | gauge | |
//! | `kvatlas_index_memberships`, `_worker_ranks`, `_heap_bytes`, `_capacity`, `_queue_depth`, `_last_event_timestamp_seconds` | gauge | `model`, `tenant` |
//! | `kvatlas_ingest_delay_seconds` | histogram | `model`, `tenant` (a batch's receipt — taken off its ZMQ socket, a `PublishEvents` message, an event-log message — to its events visible to queries; a batch held back for a gap counts from the message that released it; those a replay's timeout releases are not counted) |
//! | `kvatlas_event_age_seconds` | histogram | `model`, `tenant` (a ZMQ batch's own timestamp — the engine's wall clock when it published it — to its events visible to queries: how fresh the index is, the engine's side and the wire included; 50 µs buckets up to 1 ms, 0.5 ms up to 5 ms, 2.5 ms up to 25 ms; batches without a timestamp under a minute old and not ahead of this server's clock are not counted, so engines on other machines need synchronized clocks; at a replica, through the ingest and the event log, whose records carry the stamp) |
//! | `kvatlas_events_applied_total` | counter | `model`, `tenant` (index mutations applied) |
//! | `kvatlas_events_dropped_total` | counter | `model`, `tenant`, `reason` (the decoder's and converter's reasons) |
//! | `kvatlas_index_anomalies_total` | counter | `model`, `tenant`, `kind` (absorbed by the index; `evicted` for the capacity bound) |
//! | `kvatlas_batches_total` | counter | `model`, `tenant`, `outcome` (`received`, `applied`, `replayed`, `duplicate`, `decode_error`, `bad_frame`) |
//! | `kvatlas_sequence_events_total` | counter | `model`, `tenant`, `kind` (`gap`, `resync`, `restart`, `replay_completed`, `replay_failed`, `connect`, `connect_retry`, `disconnect`, `catch_up`, `probe` (a replay asked because the live stream stayed quiet), `replay_resync`, `held_dropped` (a live batch a held listener's full buffer dropped, replayed after its release)) |
//! | `kvatlas_listeners` | gauge | `model`, `tenant`, `status` |
//! | `kvatlas_listener_thread_listeners`, `kvatlas_listener_thread_turns_total` | gauge, counter | `thread` (the poller threads all indexes' listeners share; a turn is one listener served, so batches over turns says how many batches a turn finds) |
//! | `kvatlas_snapshots_total` | counter | `outcome` (`written`, `failed`: data-directory snapshots) |
//! | `kvatlas_snapshot_last_bytes`, `_last_memberships`, `_last_duration_seconds`, `_last_timestamp_seconds` | gauge | (the last snapshot written) |
//! | `kvatlas_snapshot_files_rejected_total` | counter | (unreadable snapshot files moved aside at start) |
//! | `kvatlas_restored_memberships` | gauge | `source` (`data_dir`, `peer_snapshot`, `peer_dump`: what the state at start came from) |
//! | `kvatlas_log_*_total` (`queued`, `published`, `publish_duplicates`, `published_bytes`, `publish_retries`, `publish_refused`, `consumed`, `applied`, `dropped_duplicate`, `dropped_stale`, `dropped_invalid`, `rebootstraps`, `sequences_lost`, `stream_recreations`, `stream_created_again`, `snapshots_written`, `snapshots_skipped`, `snapshots_failed`, `snapshots_unreadable`, `live_published`, `live_dropped`, `live_applied`, `live_confirmed`, `live_skipped`, `live_divergences`, `nats_slow_consumer`, `nats_disconnects`), `kvatlas_log_stream_sequence`, `kvatlas_log_publish_seconds`, `kvatlas_log_lag_seconds`, `kvatlas_log_stored_age_seconds`, `kvatlas_log_live_age_seconds`, `kvatlas_log_sent_age_seconds` | counter, gauge, histogram | (with `--publish-to` or `--consume-from`: the NATS event log; `stored_age`, at a replica: a stamped batch's engine stamp to the stream storing its record, and `live_age` to its live record reaching the replica's consumer; `sent_age`, at an ingest: the stamp to the publisher taking the record off its queue; in the event age's buckets) |

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::places::Places;
use crate::registry::Registry;

/// The RPCs of `kvatlas.v1.Indexer`, and llm-d's `GetPodScores`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rpc {
    Query,
    QueryStream,
    RegisterWorker,
    UnregisterWorker,
    ListWorkers,
    ListIndexes,
    PublishEvents,
    Snapshot,
    /// llm-d's `indexer.v1.IndexerService/GetPodScores`.
    GetPodScores,
}

impl Rpc {
    const ALL: [Rpc; 9] = [
        Rpc::Query,
        Rpc::QueryStream,
        Rpc::RegisterWorker,
        Rpc::UnregisterWorker,
        Rpc::ListWorkers,
        Rpc::ListIndexes,
        Rpc::PublishEvents,
        Rpc::Snapshot,
        Rpc::GetPodScores,
    ];

    const fn name(self) -> &'static str {
        match self {
            Rpc::Query => "Query",
            Rpc::QueryStream => "QueryStream",
            Rpc::RegisterWorker => "RegisterWorker",
            Rpc::UnregisterWorker => "UnregisterWorker",
            Rpc::ListWorkers => "ListWorkers",
            Rpc::ListIndexes => "ListIndexes",
            Rpc::PublishEvents => "PublishEvents",
            Rpc::Snapshot => "Snapshot",
            Rpc::GetPodScores => "GetPodScores",
        }
    }
}

/// The gRPC status code names, by code number.
const CODE_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// Latency bucket upper bounds, in seconds.
const BOUNDS: [f64; 16] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
    0.25, 1.0, 5.0,
];

/// Bucket upper bounds of an event's age when it became visible (`kvatlas_event_age_seconds`),
/// in seconds: every 50 µs up to 1 ms, so that a percentile near a millisecond is known to
/// within 50 µs; every 0.5 ms up to 5 ms, every 2.5 ms up to 25 ms (a replica's tail), then
/// coarser up to [`kvatlas_events::MAX_EVENT_AGE`].
pub(crate) const EVENT_AGE_BOUNDS: [f64; 50] = [
    50e-6, 100e-6, 150e-6, 200e-6, 250e-6, 300e-6, 350e-6, 400e-6, 450e-6, 500e-6, 550e-6, 600e-6,
    650e-6, 700e-6, 750e-6, 800e-6, 850e-6, 900e-6, 950e-6, 1e-3, 1.5e-3, 2e-3, 2.5e-3, 3e-3,
    3.5e-3, 4e-3, 4.5e-3, 5e-3, 7.5e-3, 10e-3, 12.5e-3, 15e-3, 17.5e-3, 20e-3, 22.5e-3, 25e-3,
    50e-3, 75e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
];

/// A fixed-bucket histogram of durations.
#[derive(Debug)]
pub(crate) struct Histogram {
    /// The buckets' upper bounds, in seconds, ascending.
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); one per bound, then `+Inf`.
    buckets: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl Default for Histogram {
    /// A histogram of request latencies.
    fn default() -> Self {
        Self::with_bounds(&BOUNDS)
    }
}

impl Histogram {
    /// An empty histogram of event ages ([`EVENT_AGE_BOUNDS`]).
    pub(crate) fn event_ages() -> Self {
        Self::with_bounds(&EVENT_AGE_BOUNDS)
    }

    /// An empty histogram with buckets up to each of `bounds` (seconds, ascending) and `+Inf`.
    pub(crate) fn with_bounds(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Counts one observation.
    pub(crate) fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        // The first bound at or above `seconds` (the bounds ascend); past the last, `+Inf`.
        let bucket = self.bounds.partition_point(|&bound| bound < seconds);
        if let Some(count) = self.buckets.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        self.sum_nanos.fetch_add(
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Appends the histogram `name` (with its HELP and TYPE lines) with `labels` (`k="v",…`
    /// or empty) on every sample.
    pub(crate) fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        header(out, name, "histogram", help);
        self.render_samples(out, name, labels);
    }

    /// Appends the samples (buckets, sum, count) of histogram `name` with `labels`, without
    /// the HELP and TYPE lines (one family, several label sets).
    pub(crate) fn render_samples(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, count) in self.buckets.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), |b| format!("{b}"));
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

/// Per-RPC instruments.
#[derive(Debug, Default)]
struct RpcInstruments {
    latency: Histogram,
    codes: [AtomicU64; CODE_NAMES.len()],
    shed: AtomicU64,
}

/// Snapshot and recovery instruments.
#[derive(Debug, Default)]
pub(crate) struct RecoveryInstruments {
    /// Data-directory snapshots written.
    pub(crate) written: AtomicU64,
    /// Data-directory snapshots that failed.
    pub(crate) failed: AtomicU64,
    /// The last snapshot written: bytes, memberships, duration (µs), time (Unix µs).
    pub(crate) last_bytes: AtomicU64,
    pub(crate) last_memberships: AtomicU64,
    pub(crate) last_duration_micros: AtomicU64,
    pub(crate) last_unix_micros: AtomicU64,
    /// Snapshot files moved aside at start.
    pub(crate) rejected_files: AtomicU64,
    /// Where the state at start came from, and how many memberships.
    pub(crate) restored: Mutex<Option<(&'static str, u64)>>,
}

/// A server's request instruments (see the module docs).
#[derive(Debug)]
pub(crate) struct Metrics {
    /// Snapshot and recovery instruments.
    pub(crate) recovery: RecoveryInstruments,
    rpcs: [RpcInstruments; Rpc::ALL.len()],
    in_flight: Places,
    auth_failures: AtomicU64,
    http: Mutex<std::collections::BTreeMap<(&'static str, u16), u64>>,
    /// Reloads by file and whether they were applied.
    reloads: Mutex<std::collections::BTreeMap<(&'static str, bool), u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            recovery: RecoveryInstruments::default(),
            rpcs: Default::default(),
            in_flight: Places::default(),
            auth_failures: AtomicU64::new(0),
            http: Mutex::new(std::collections::BTreeMap::new()),
            reloads: Mutex::new(std::collections::BTreeMap::new()),
        }
    }
}

impl Metrics {
    fn rpc(&self, rpc: Rpc) -> &RpcInstruments {
        // Indexed by the enum's declaration order, which `Rpc::ALL` lists.
        &self.rpcs[rpc as usize]
    }

    /// Records one finished request: its latency and status code number.
    pub(crate) fn record(&self, rpc: Rpc, elapsed: Duration, code: i32) {
        let instruments = self.rpc(rpc);
        instruments.latency.observe(elapsed);
        let code = usize::try_from(code)
            .ok()
            .filter(|c| *c < CODE_NAMES.len())
            .unwrap_or(2);
        instruments.codes[code].fetch_add(1, Ordering::Relaxed);
    }

    /// Records a request shed at the concurrency limit.
    pub(crate) fn shed(&self, rpc: Rpc) {
        self.rpc(rpc).shed.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a request refused for missing or unknown credentials.
    pub(crate) fn auth_failure(&self) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Shows `file`'s reload series at 0 until something happens (an alert on the increase of
    /// `refused` needs the series before its first refusal).
    pub(crate) fn declare_reloads(&self, file: &'static str) {
        let mut reloads = self.reloads.lock();
        for applied in [true, false] {
            reloads.entry((file, applied)).or_insert(0);
        }
    }

    /// Records a changed `file` (`tokens`, `tls`) applied or refused.
    pub(crate) fn reload(&self, file: &'static str, applied: bool) {
        *self.reloads.lock().entry((file, applied)).or_insert(0) += 1;
    }

    /// The requests-in-flight gauge.
    pub(crate) fn in_flight(&self) -> &Places {
        &self.in_flight
    }

    /// Records one HTTP request.
    pub(crate) fn http(&self, route: &'static str, status: u16) {
        *self.http.lock().entry((route, status)).or_insert(0) += 1;
    }

    /// The exposition text: these instruments plus the registry's figures.
    pub(crate) fn render(&self, registry: &Registry, ready: bool) -> String {
        let mut out = String::with_capacity(16 << 10);
        self.render_requests(&mut out);
        self.render_recovery(&mut out);
        render_indexes(&mut out, registry, ready);
        render_listener_threads(&mut out, registry);
        if let Some(role) = registry.log_role() {
            registry.log_stats().render(&mut out, role);
        }
        out
    }

    fn render_recovery(&self, out: &mut String) {
        let r = &self.recovery;
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        header(
            out,
            "kvatlas_snapshots_total",
            "counter",
            "Data-directory snapshots by outcome.",
        );
        let _ = writeln!(
            out,
            "kvatlas_snapshots_total{{outcome=\"written\"}} {}\nkvatlas_snapshots_total{{outcome=\"failed\"}} {}",
            load(&r.written),
            load(&r.failed)
        );
        for (name, help, value) in [
            (
                "kvatlas_snapshot_last_bytes",
                "Size of the last snapshot written.",
                load(&r.last_bytes) as f64,
            ),
            (
                "kvatlas_snapshot_last_memberships",
                "Memberships in the last snapshot written.",
                load(&r.last_memberships) as f64,
            ),
            (
                "kvatlas_snapshot_last_duration_seconds",
                "How long the last snapshot took to write.",
                load(&r.last_duration_micros) as f64 / 1e6,
            ),
            (
                "kvatlas_snapshot_last_timestamp_seconds",
                "When the last snapshot was written (Unix time; 0 = never).",
                load(&r.last_unix_micros) as f64 / 1e6,
            ),
        ] {
            header(out, name, "gauge", help);
            let _ = writeln!(out, "{name} {value}");
        }
        header(
            out,
            "kvatlas_snapshot_files_rejected_total",
            "counter",
            "Unreadable snapshot files moved aside at start (see the log for why).",
        );
        let _ = writeln!(
            out,
            "kvatlas_snapshot_files_rejected_total {}",
            load(&r.rejected_files)
        );
        if let Some((source, memberships)) = *r.restored.lock() {
            header(
                out,
                "kvatlas_restored_memberships",
                "gauge",
                "Memberships restored at start, by where they came from.",
            );
            let _ = writeln!(
                out,
                "kvatlas_restored_memberships{{source=\"{source}\"}} {memberships}"
            );
        }
    }

    fn render_requests(&self, out: &mut String) {
        header(
            out,
            "kvatlas_request_duration_seconds",
            "histogram",
            "gRPC request latency (each QueryStream message is one request).",
        );
        for rpc in Rpc::ALL {
            self.rpc(rpc).latency.render_samples(
                out,
                "kvatlas_request_duration_seconds",
                &format!("rpc=\"{}\"", rpc.name()),
            );
        }
        header(
            out,
            "kvatlas_requests_total",
            "counter",
            "gRPC requests by status code.",
        );
        for rpc in Rpc::ALL {
            for (code, count) in self.rpc(rpc).codes.iter().enumerate() {
                let count = count.load(Ordering::Relaxed);
                if count > 0 || code == 0 {
                    let _ = writeln!(
                        out,
                        "kvatlas_requests_total{{rpc=\"{}\",code=\"{}\"}} {count}",
                        rpc.name(),
                        CODE_NAMES[code]
                    );
                }
            }
        }
        header(
            out,
            "kvatlas_requests_shed_total",
            "counter",
            "Requests refused at the concurrency limit.",
        );
        for rpc in Rpc::ALL {
            let _ = writeln!(
                out,
                "kvatlas_requests_shed_total{{rpc=\"{}\"}} {}",
                rpc.name(),
                self.rpc(rpc).shed.load(Ordering::Relaxed)
            );
        }
        header(
            out,
            "kvatlas_requests_in_flight",
            "gauge",
            "gRPC requests and open streams being served.",
        );
        let _ = writeln!(out, "kvatlas_requests_in_flight {}", self.in_flight.held());
        header(
            out,
            "kvatlas_auth_failures_total",
            "counter",
            "Requests refused for missing or unknown credentials (gRPC and HTTP).",
        );
        let _ = writeln!(
            out,
            "kvatlas_auth_failures_total {}",
            self.auth_failures.load(Ordering::Relaxed)
        );
        header(
            out,
            "kvatlas_http_requests_total",
            "counter",
            "HTTP requests by route and status.",
        );
        for ((route, status), count) in self.http.lock().iter() {
            let _ = writeln!(
                out,
                "kvatlas_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {count}"
            );
        }
        header(
            out,
            "kvatlas_reloads_total",
            "counter",
            "Changed token files and TLS certificates applied or refused while running.",
        );
        for ((file, applied), count) in self.reloads.lock().iter() {
            let outcome = if *applied { "applied" } else { "refused" };
            let _ = writeln!(
                out,
                "kvatlas_reloads_total{{file=\"{file}\",outcome=\"{outcome}\"}} {count}"
            );
        }
    }
}

/// The poller threads every index's listeners share (none before the first index).
fn render_listener_threads(out: &mut String, registry: &Registry) {
    let threads = registry.listener_thread_figures();
    if threads.is_empty() {
        return;
    }
    type Figure = fn(&(usize, u64)) -> u64;
    let series: [(&str, &str, &str, Figure); 2] = [
        (
            "kvatlas_listener_thread_listeners",
            "gauge",
            "ZMQ listeners served by each listener (poller) thread.",
            |&(listeners, _)| listeners as u64,
        ),
        (
            "kvatlas_listener_thread_turns_total",
            "counter",
            "Turns each listener thread gave its listeners: one listener served (its sockets read, or a deadline of its handled).",
            |&(_, turns)| turns,
        ),
    ];
    for (name, kind, help, figure) in series {
        header(out, name, kind, help);
        for (thread, figures) in threads.iter().enumerate() {
            let _ = writeln!(out, "{name}{{thread=\"{thread}\"}} {}", figure(figures));
        }
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A label value escaped for the exposition format.
fn escape(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

fn render_indexes(out: &mut String, registry: &Registry, ready: bool) {
    header(
        out,
        "kvatlas_ready",
        "gauge",
        "1 once the startup gate is open and the server is not shutting down.",
    );
    let _ = writeln!(out, "kvatlas_ready {}", u8::from(ready));
    header(
        out,
        "kvatlas_registered_ranks",
        "gauge",
        "Registered worker ranks (ZMQ listeners and gRPC feeds).",
    );
    let _ = writeln!(
        out,
        "kvatlas_registered_ranks {}",
        registry.registered_ranks()
    );

    struct Row {
        labels: String,
        stats: kvatlas_index::IndexStats,
        capacity: u64,
        queued: usize,
        last_event: i64,
        applied: u64,
        totals: kvatlas_index::ApplyReport,
        counters: crate::registry::FeedCounters,
        listeners: std::collections::BTreeMap<&'static str, u64>,
        ingest_delay: std::sync::Arc<Histogram>,
        event_age: std::sync::Arc<Histogram>,
    }
    let rows: Vec<Row> = registry
        .all()
        .iter()
        .map(|entry| {
            let index = entry.index();
            Row {
                labels: format!(
                    "model=\"{}\",tenant=\"{}\"",
                    escape(&entry.key.model),
                    escape(&entry.key.tenant)
                ),
                stats: kvatlas_index::SharedKvIndex::stats(index),
                capacity: index.capacity().unwrap_or(0),
                queued: entry.pool.queued(),
                last_event: index.last_event_unix_micros(),
                applied: index.events_applied(),
                totals: index.totals(),
                counters: entry.total_counters(),
                listeners: entry.listener_statuses(),
                ingest_delay: std::sync::Arc::clone(&entry.ingest_delay),
                event_age: std::sync::Arc::clone(&entry.event_age),
            }
        })
        .collect();

    /// A gauge: name, help, value of a row.
    type Gauge = (&'static str, &'static str, fn(&Row) -> f64);
    let gauges: [Gauge; 6] = [
        (
            "kvatlas_index_memberships",
            "(rank, block, tier) memberships held.",
            |r| r.stats.memberships as f64,
        ),
        (
            "kvatlas_index_worker_ranks",
            "Worker ranks holding at least one block.",
            |r| r.stats.workers.len() as f64,
        ),
        (
            "kvatlas_index_heap_bytes",
            "Heap bytes the index estimates it uses.",
            |r| r.stats.heap_bytes as f64,
        ),
        (
            "kvatlas_index_capacity",
            "Most memberships held before evicting (0 = unbounded).",
            |r| r.capacity as f64,
        ),
        (
            "kvatlas_index_queue_depth",
            "Mutations waiting for the index writers.",
            |r| r.queued as f64,
        ),
        (
            "kvatlas_index_last_event_timestamp_seconds",
            "When the index last applied an event (Unix time; 0 = never).",
            |r| r.last_event as f64 / 1e6,
        ),
    ];
    for (name, help, value) in gauges {
        header(out, name, "gauge", help);
        for row in &rows {
            let _ = writeln!(out, "{name}{{{}}} {}", row.labels, value(row));
        }
    }
    header(
        out,
        "kvatlas_ingest_delay_seconds",
        "histogram",
        "From the receipt of a batch (taken off a ZMQ socket, a PublishEvents message, an \
         event-log message) to its events being visible to queries.",
    );
    for row in &rows {
        row.ingest_delay
            .render_samples(out, "kvatlas_ingest_delay_seconds", &row.labels);
    }
    header(
        out,
        "kvatlas_event_age_seconds",
        "histogram",
        "From an engine's timestamp of a batch (its publication, on the engine's wall clock) to \
         its events being visible to queries; ZMQ batches with a timestamp under a minute old \
         and not ahead of this server's clock (at a replica, carried by the event log).",
    );
    for row in &rows {
        row.event_age
            .render_samples(out, "kvatlas_event_age_seconds", &row.labels);
    }
    header(
        out,
        "kvatlas_events_applied_total",
        "counter",
        "Index mutations applied.",
    );
    for row in &rows {
        let _ = writeln!(
            out,
            "kvatlas_events_applied_total{{{}}} {}",
            row.labels, row.applied
        );
    }
    header(
        out,
        "kvatlas_events_dropped_total",
        "counter",
        "Events or batches dropped, by reason.",
    );
    for row in &rows {
        for (reason, count) in row.counters.drops.iter() {
            let _ = writeln!(
                out,
                "kvatlas_events_dropped_total{{{},reason=\"{reason}\"}} {count}",
                row.labels
            );
        }
    }
    header(
        out,
        "kvatlas_index_anomalies_total",
        "counter",
        "Anomalies the index absorbed, and capacity evictions.",
    );
    for row in &rows {
        let t = &row.totals;
        for (kind, count) in [
            ("unknown_parent", t.unknown_parents),
            ("unknown_remove", t.unknown_removes),
            ("duplicate_store", t.duplicate_stores),
            ("conflicting_store", t.conflicting_stores),
            ("evicted", t.evicted),
        ] {
            let _ = writeln!(
                out,
                "kvatlas_index_anomalies_total{{{},kind=\"{kind}\"}} {count}",
                row.labels
            );
        }
    }
    header(
        out,
        "kvatlas_batches_total",
        "counter",
        "Event batches by outcome.",
    );
    for row in &rows {
        let c = &row.counters;
        for (outcome, count) in [
            ("received", c.batches_received),
            ("applied", c.batches_applied),
            ("replayed", c.batches_replayed),
            ("duplicate", c.duplicates),
            ("decode_error", c.decode_errors),
            ("bad_frame", c.bad_frames),
        ] {
            let _ = writeln!(
                out,
                "kvatlas_batches_total{{{},outcome=\"{outcome}\"}} {count}",
                row.labels
            );
        }
    }
    header(
        out,
        "kvatlas_sequence_events_total",
        "counter",
        "Gaps, resyncs, engine restarts, replays and connection events.",
    );
    for row in &rows {
        let c = &row.counters;
        for (kind, count) in [
            ("gap", c.gaps),
            ("resync", c.resyncs),
            ("restart", c.restarts),
            ("replay_completed", c.replays_completed),
            ("replay_failed", c.replays_failed),
            ("connect", c.connects),
            ("connect_retry", c.connect_retries),
            ("disconnect", c.disconnects),
            ("catch_up", c.catch_ups),
            ("probe", c.probes),
            ("replay_resync", c.replay_resyncs),
            ("held_dropped", c.held_dropped),
        ] {
            let _ = writeln!(
                out,
                "kvatlas_sequence_events_total{{{},kind=\"{kind}\"}} {count}",
                row.labels
            );
        }
    }
    header(
        out,
        "kvatlas_listeners",
        "gauge",
        "ZMQ listeners by status.",
    );
    for row in &rows {
        for status in ["pending", "held", "active", "failed", "stopped"] {
            let _ = writeln!(
                out,
                "kvatlas_listeners{{{},status=\"{status}\"}} {}",
                row.labels,
                row.listeners.get(status).copied().unwrap_or(0)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ages_fall_into_fine_buckets_up_to_the_oldest_counted() {
        for bounds in [&BOUNDS[..], &EVENT_AGE_BOUNDS[..]] {
            assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{bounds:?}");
        }
        assert_eq!(
            EVENT_AGE_BOUNDS.last().copied(),
            Some(kvatlas_events::MAX_EVENT_AGE.as_secs_f64())
        );
        let ages = Histogram::with_bounds(&EVENT_AGE_BOUNDS);
        for micros in [40, 960, 1_001, 11_000, 24_000] {
            ages.observe(Duration::from_micros(micros));
        }
        let mut out = String::new();
        ages.render_samples(&mut out, "age", "");
        for (le, cumulative) in [
            ("0.00005", 1),
            ("0.00095", 1),
            ("0.001", 2),
            ("0.0015", 3),
            ("0.0125", 4),
            ("0.0225", 4),
            ("0.025", 5),
        ] {
            assert!(
                out.contains(&format!("age_bucket{{le=\"{le}\"}} {cumulative}\n")),
                "{le}: {out}"
            );
        }
    }

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let metrics = Metrics::default();
        metrics.record(Rpc::Query, Duration::from_micros(20), 0);
        metrics.record(Rpc::Query, Duration::from_millis(2), 5);
        let mut out = String::new();
        metrics.render_requests(&mut out);
        assert!(
            out.contains("kvatlas_request_duration_seconds_bucket{rpc=\"Query\",le=\"0.00001\"} 0")
        );
        assert!(
            out.contains(
                "kvatlas_request_duration_seconds_bucket{rpc=\"Query\",le=\"0.000025\"} 1"
            )
        );
        assert!(
            out.contains("kvatlas_request_duration_seconds_bucket{rpc=\"Query\",le=\"+Inf\"} 2")
        );
        assert!(out.contains("kvatlas_request_duration_seconds_count{rpc=\"Query\"} 2"));
        assert!(out.contains("kvatlas_requests_total{rpc=\"Query\",code=\"NOT_FOUND\"} 1"));
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
