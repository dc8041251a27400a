//! The end-to-end benchmark behind `cargo xtask bench e2e`: the same simulated fleet and the
//! same router traffic against `kvatlas serve` and Dynamo's standalone indexer
//! (`python -m dynamo.indexer` from `ai-dynamo-runtime` 1.6.1), one service after the other on
//! this machine, in one invocation.
//!
//! Per run and per service, for each eviction order (leaf-first, head-first):
//!
//! 1. **Ingest.** A fresh service; a fresh fleet ([`Publishers`]) of `workers` engines on loopback, each
//!    registered with the service over `POST /register` (Dynamo's route, which kvatlas also
//!    serves) with its live and replay endpoints; publishing starts once the service subscribed
//!    to every engine. The fleet publishes the Workload A stream (the Mooncake trace through the
//!    mock engines) at the trace's timing rescaled to `rate` requests per second.
//! 2. **Freshness.** While it publishes, probes (a router's HTTP clients, up to four in flight,
//!    each on a connection of its own) take stored batches, at most one per `probe_interval`
//!    (10 ms by default), and each queries the stored
//!    prompt over `POST /query` until the publishing worker's score covers it: the lag from
//!    the instant before the send to the answer that shows it (an upper bound: it includes one
//!    query's round trip). A probe not satisfied within 2 s is counted as unseen (also when
//!    the worker's later requests evicted the probed prefix before the probe saw it, which
//!    happens unpaced) and recorded at 2 s in both bounds (censored, not dropped).
//! 3. **CPU.** The service's user + system CPU seconds over the publishing window and the
//!    quiesce (`/proc/PID/stat`), per million vLLM events published (the probe's queries are
//!    included and counted).
//! 4. **Quiesce and exactness.** Each engine's last batch stores the marker block; once a
//!    marker query shows every worker (at every replica), everything was applied. Then
//!    `exactness_queries` whole prompts (each a trace request's, and a block more) are asked
//!    over HTTP (and, for kvatlas, over gRPC too) and every answer's per-worker scores
//!    are compared with [`kvatlas_index::ReferenceIndex`] fed the same published bytes.
//! 5. **Query load** (leaf-first state only). An offered-load sweep per protocol — HTTP
//!    `POST /query` with token ids for both services (the same request bytes), and for kvatlas
//!    gRPC `Query` (unary) and `QueryStream`, with local hashes as `kvatlas-proto`'s client
//!    sends them. Open loop: query `i` is due at `start + i / rate` (a pacing thread), taken by
//!    the first free connection (HTTP: `connections` keep-alive connections; unary gRPC:
//!    `connections` tasks on one HTTP/2 connection; stream: one stream), and its latency is
//!    completion − due time, so a late start is charged (coordinated omission corrected). A
//!    point passes with p99 ≤ 1 ms, at least 95 % of the offered rate achieved and no error;
//!    the sweep stops at the first point that fails, and the service's figure is the highest
//!    offered rate that passed. A failed point is run once more before the sweep stops (a
//!    single stall of the shared machine is not the service's limit); the second try counts.
//! 6. **Memory.** The service's peak RSS (`VmHWM`) over everything above.
//!
//! The load generator, the fleet and the service share the machine's cores: the same for both
//! services. Figures are medians over `runs` runs (mismatches: the maximum).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{KvIndex, MatchOptions, ReferenceIndex};
use kvatlas_proto::v1;
use serde::Serialize;
use serde_json::json;

use crate::engine::{self, EngineConfig, Eviction};
use crate::fleet::{self, BLOCK_TOKENS, FleetStream, Scheduled, marker_tokens};
use crate::http::{self, AsyncConnection, Connection};
use crate::service::{self, MODEL, Prompt, Server};
use crate::trace::{self, TraceRequest};
use kvatlas_fleet::publish::Publishers;

/// The services compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
pub enum ServiceKind {
    /// `kvatlas serve`.
    Kvatlas,
    /// `python -m dynamo.indexer` (`ai-dynamo-runtime` 1.6.1).
    Dynamo,
    /// `kvatlas serve --publish-to` (the engines' ingest) → a real nats-server (JetStream) →
    /// `kvatlas serve --consume-from` replicas; measured at the first replica
    /// (`crate::scale_out`).
    KvatlasNats,
}

impl ServiceKind {
    /// Its name in reports.
    pub const fn name(self) -> &'static str {
        match self {
            ServiceKind::Kvatlas => "kvatlas",
            ServiceKind::Dynamo => "Dynamo",
            ServiceKind::KvatlasNats => "kvatlas via NATS",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The `kvatlas` binary.
    pub kvatlas: PathBuf,
    /// The Python interpreter of a venv holding `ai-dynamo-runtime` 1.6.1.
    pub dynamo_python: PathBuf,
    /// Dynamo's `--threads` (its default is 4).
    pub dynamo_threads: usize,
    /// Runs (medians reported).
    pub runs: usize,
    /// Mock engines.
    pub workers: u32,
    /// Blocks per engine cache.
    pub capacity: usize,
    /// Trace requests used (all when `None`).
    pub requests: Option<usize>,
    /// Requests per second the trace is replayed at (sets the publishing window).
    pub rate: f64,
    /// Offered loads of the sweep (queries per second, ascending).
    pub loads: Vec<f64>,
    /// Seconds per sweep point.
    pub step: Duration,
    /// HTTP keep-alive connections (and unary gRPC tasks) of the load generator.
    pub connections: usize,
    /// Prompts checked against the reference per service and eviction order.
    pub exactness_queries: usize,
    /// The freshness probe takes a batch at most this often (it queries until the batch is
    /// visible, so it loads the service and the machine while it measures); 10 ms by default.
    pub probe_interval: Duration,
    /// Where the plots go (`None`: no plots).
    pub plots: Option<PathBuf>,
    /// The services measured (both by default; one alone is for investigating, not comparing).
    pub services: Vec<ServiceKind>,
    /// Run the query-load sweeps (on the leaf-first state; never through NATS).
    pub sweep: bool,
    /// Replicas behind the ingest for [`ServiceKind::KvatlasNats`].
    pub replicas: usize,
    /// Extra arguments of every `kvatlas serve` started (alone, ingest and replicas), e.g.
    /// `--busy-poll`; empty for the default settings the figures are reported with.
    pub kvatlas_args: Vec<String>,
    /// Extra arguments of the ingest only (through NATS), after `kvatlas_args`, e.g.
    /// `--publish-only`.
    pub ingest_args: Vec<String>,
    /// Per run and eviction order, also publish the fleet's schedule into a bare ZMQ
    /// subscriber started as this program (`crate::zmq_floor`): the machine's floor under
    /// the services' event age. `None`: not measured. With
    /// [`ServiceKind::KvatlasNats`] among the services, the same program is also started
    /// as the log's floor (`crate::log_floor`): a bare relay into JetStream and
    /// [`Self::replicas`] bare consumers.
    pub zmq_floor: Option<PathBuf>,
}

/// Freshness: publish-to-visible lag.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Freshness {
    /// Probes that saw their batch.
    pub samples: u64,
    /// Probes not satisfied within 2 s.
    pub unseen: u64,
    /// Queries the probe sent.
    pub probe_queries: u64,
    /// Lag percentiles in µs (upper bounds: publish to the answer that showed the batch).
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// The largest lag.
    pub max_us: f64,
    /// Lower bounds of the lag (publish to the send of the last query that did not yet show
    /// the batch; 0 when the first did): the true lag lies between the two, p50.
    pub lower_p50_us: f64,
    /// The lower bounds' p99.
    pub lower_p99_us: f64,
    /// The probe's query round trip during ingest, p50: the resolution of the lag figures.
    pub round_trip_p50_us: f64,
    /// kvatlas's own account (`kvatlas_ingest_delay_seconds`, at the service queried): every
    /// batch of the phase, from its receipt by the server (taken off the ZMQ socket; at a
    /// replica, the event-log message's arrival) to its events visible to queries. Not the
    /// publish-to-visible lag: the engine's send, the kernel and the ZMQ I/O threads before the
    /// receipt, and the query that sees it, are outside. Histogram bucket bounds, µs; `None`
    /// for Dynamo.
    pub server_delay: Option<ServerDelay>,
    /// kvatlas's own account of the whole publish-to-visible lag
    /// (`kvatlas_event_age_seconds`, at the service queried): every batch of the phase, from
    /// the fleet's wall-clock stamp as it sent it (the `ts` an engine writes) to its events
    /// visible to queries; buckets of 50 µs below 1 ms. The query that sees a batch is outside
    /// (a query that starts once the batch is visible sees it); at a replica, through the ingest
    /// and the event log, which carries the stamp. `None` for Dynamo.
    pub event_age: Option<ServerDelay>,
    /// Points of the lag CDF (fraction, ns) for the plot.
    #[serde(skip)]
    pub cdf: Vec<(f64, u64)>,
}

/// Which of a phase's server histograms (for the report's rows).
type Account = fn(&Freshness) -> Option<&ServerDelay>;

/// One of the server's delay histograms over one ingest phase.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ServerDelay {
    /// Batches counted.
    pub batches: u64,
    /// The upper bound of the bucket holding the median, µs.
    pub p50_le_us: f64,
    /// The upper bound of the bucket holding the 99th percentile, µs.
    pub p99_le_us: f64,
    /// The fraction of batches visible within 1 ms of their receipt.
    pub within_1ms: f64,
}

impl ServerDelay {
    /// The histogram `name` of the server at `http_addr`.
    fn scrape(http_addr: &str, name: &str) -> Result<Self> {
        let buckets = http::histogram_buckets(http_addr, name)?;
        Ok(Self {
            batches: buckets.last().map_or(0, |b| b.1),
            p50_le_us: http::quantile_bound(&buckets, 0.5) * 1e6,
            p99_le_us: http::quantile_bound(&buckets, 0.99) * 1e6,
            within_1ms: http::fraction_within(&buckets, 1e-3),
        })
    }
}

/// One ingest phase (one eviction order) of one service.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ingest {
    /// The eviction order of the mock engines.
    pub eviction: &'static str,
    /// vLLM events published.
    pub events: u64,
    /// Seconds the fleet took to publish (the window, plus lateness).
    pub publish_seconds: f64,
    /// Milliseconds from the last send until the marker query showed every worker.
    pub quiesce_ms: f64,
    /// Whether every worker's marker was seen (if not, exactness is still checked).
    pub quiesced: bool,
    /// Service CPU seconds (user + system) over publishing and quiesce.
    pub cpu_seconds: f64,
    /// Per million events published.
    pub cpu_seconds_per_million_events: f64,
    /// `cpu_seconds` by process (through NATS: the ingest, nats-server, each replica).
    pub cpu_seconds_by_process: Vec<(String, f64)>,
    /// Publish-to-visible lag.
    pub freshness: Freshness,
    /// Prompts compared with the reference.
    pub exactness_queries: u64,
    /// HTTP answers that differ from the reference.
    pub http_mismatches: u64,
    /// gRPC answers that differ from the reference (kvatlas only).
    pub grpc_mismatches: Option<u64>,
    /// An example of a mismatch, for the report.
    pub first_mismatch: Option<String>,
    /// Replay requests the fleet served. Not gaps alone: kvatlas asks each engine once for its
    /// position when it subscribes (`docs/events.md` §4), so a kvatlas run without a gap shows
    /// one per engine; Dynamo asks only on a gap.
    pub replays: u64,
}

/// One point of a load sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LoadPoint {
    /// Offered queries per second.
    pub offered: f64,
    /// Achieved (answered per second of the run).
    pub achieved: f64,
    /// Latency percentiles from the due time, µs.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Errors (non-200 answers, failed calls).
    pub errors: u64,
    /// p99 ≤ 1 ms, ≥ 95 % achieved, no error.
    pub passed: bool,
}

/// A protocol's sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sweep {
    /// `HTTP /query`, `gRPC Query`, `gRPC QueryStream`.
    pub protocol: &'static str,
    /// The points run, ascending.
    pub points: Vec<LoadPoint>,
    /// The highest offered rate that passed (0 if none).
    pub threshold_qps: f64,
}

/// One service in one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceRun {
    /// Which service.
    pub service: ServiceKind,
    /// The ingest phases (leaf-first, head-first).
    pub ingest: Vec<Ingest>,
    /// The query sweeps (on the leaf-first state).
    pub sweeps: Vec<Sweep>,
    /// Peak RSS in MiB over the run's processes (the largest).
    pub peak_rss_mib: f64,
    /// Through NATS: what the event log measured (`None` for the other services).
    pub scale_out: Option<crate::scale_out::LogFigures>,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The load, in words.
    pub load: String,
    /// Per run, per service.
    pub runs: Vec<Vec<ServiceRun>>,
    /// Per run, per eviction order (leaf-first, head-first): the floor under the event age,
    /// the same schedule into a bare ZMQ subscriber (empty when not measured).
    pub floors: Vec<Vec<crate::zmq_floor::Floor>>,
    /// Per run and eviction order, through NATS: the same schedule through a bare relay,
    /// JetStream and bare consumers, at the first consumer (empty when not measured).
    pub log_floors: Vec<Vec<crate::zmq_floor::Floor>>,
}

/// What one eviction order's fleet publishes, with the reference's answers.
struct Prepared {
    eviction: Eviction,
    stream: Arc<FleetStream>,
    /// Per exactness prompt, the reference's device scores in tokens by (worker, rank).
    expected: Vec<BTreeMap<(u64, u32), u64>>,
    /// Per trace request, its prompt's blocks cached by its worker after it (for the probe).
    cached_blocks: Vec<usize>,
}

/// A running service under test.
enum Service {
    Kvatlas(Server),
    Dynamo(DynamoServer),
    Replicated(crate::scale_out::Replicated),
}

impl Service {
    fn start(kind: ServiceKind, settings: &Settings) -> Result<Self> {
        Ok(match kind {
            ServiceKind::Kvatlas => {
                Service::Kvatlas(Server::start(&settings.kvatlas, &settings.kvatlas_args)?)
            }
            ServiceKind::Dynamo => Service::Dynamo(DynamoServer::start(
                &settings.dynamo_python,
                settings.dynamo_threads,
            )?),
            ServiceKind::KvatlasNats => Service::Replicated(crate::scale_out::Replicated::start(
                &settings.kvatlas,
                settings.replicas,
                &settings.kvatlas_args,
                &settings.ingest_args,
            )?),
        })
    }

    /// The process queries are asked of (its peak RSS is reported).
    fn pid(&self) -> u32 {
        match self {
            Service::Kvatlas(s) => s.pid(),
            Service::Dynamo(s) => s.child.id(),
            Service::Replicated(r) => r.replicas[0].pid(),
        }
    }

    /// Every process of the service, named (their CPU time is summed): through NATS, the
    /// ingest, the nats-server and every replica.
    fn processes(&self) -> Vec<(String, u32)> {
        match self {
            Service::Replicated(r) => r.processes(),
            other => vec![("server".to_owned(), other.pid())],
        }
    }

    /// Where queries go (through NATS: the first replica).
    fn http(&self) -> &str {
        match self {
            Service::Kvatlas(s) => &s.http,
            Service::Dynamo(s) => &s.http,
            Service::Replicated(r) => &r.replicas[0].http,
        }
    }

    /// Every address that answers queries (through NATS: each replica).
    fn query_https(&self) -> Vec<&str> {
        match self {
            Service::Replicated(r) => r.replicas.iter().map(|x| x.http.as_str()).collect(),
            other => vec![other.http()],
        }
    }

    /// Where workers are registered (through NATS: the ingest).
    fn register_http(&self) -> &str {
        match self {
            Service::Replicated(r) => &r.ingest.http,
            other => other.http(),
        }
    }

    fn stop(self) {
        match self {
            Service::Kvatlas(s) => s.stop(),
            Service::Dynamo(s) => drop(s),
            Service::Replicated(r) => r.stop(),
        }
    }
}

/// `python -m dynamo.indexer` as a child process.
struct DynamoServer {
    child: Child,
    http: String,
    _log: mpsc::Receiver<String>,
}

impl DynamoServer {
    fn start(python: &Path, threads: usize) -> Result<Self> {
        // Dynamo takes a port, not an address: take a free one (it binds 0.0.0.0).
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut child = Command::new(python)
            .args(["-m", "dynamo.indexer", "--port"])
            .arg(port.to_string())
            .arg("--threads")
            .arg(threads.to_string())
            .env("DYN_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} -m dynamo.indexer", python.display()))?;
        let stderr = child.stderr.take().context("stderr")?;
        let rx = kvatlas_fleet::server::lines_of(stderr);
        let http = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut c) = Connection::connect(&http)
                && let Ok((200, _)) = c.send(&http::get("/health"))
            {
                break;
            }
            if let Some(status) = child.try_wait()? {
                let log: Vec<String> = rx.try_iter().collect();
                bail!("Dynamo's indexer exited ({status}): {}", log.join("\n"));
            }
            if Instant::now() > deadline {
                // Not left running (a `Child` dropped is not killed).
                let _ = child.kill();
                let _ = child.wait();
                bail!("Dynamo's indexer did not answer /health within 60 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Self {
            child,
            http,
            _log: rx,
        })
    }
}

impl Drop for DynamoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// User + system CPU seconds of process `pid` so far.
pub(crate) fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat
        .rsplit_once(')')
        .context("a /proc stat line without the command's closing parenthesis")?
        .1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of the line (utime, stime) are the 12th and 13th after the command.
    let ticks = |i: usize| -> Result<f64> {
        Ok(fields
            .get(i)
            .context("a short /proc stat line")?
            .parse::<f64>()?)
    };
    // USER_HZ is 100 on Linux.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

/// Per-worker device scores in tokens from a `/query` answer's `scores` (`{worker: {rank:
/// tokens}}`), zeros left out.
fn http_scores(body: &[u8]) -> Result<BTreeMap<(u64, u32), u64>> {
    let value: serde_json::Value = serde_json::from_slice(body)?;
    let scores = value
        .get("scores")
        .and_then(|s| s.as_object())
        .context("an answer without `scores`")?;
    let mut out = BTreeMap::new();
    for (worker, ranks) in scores {
        let worker: u64 = worker.parse()?;
        for (rank, tokens) in ranks
            .as_object()
            .context("a worker's scores not an object")?
        {
            let tokens = tokens.as_u64().context("a score not an integer")?;
            if tokens > 0 {
                out.insert((worker, rank.parse()?), tokens);
            }
        }
    }
    Ok(out)
}

/// The (worker, rank) entries on which two score maps differ, as `(w, r): expected → got`.
fn difference(expected: &BTreeMap<(u64, u32), u64>, got: &BTreeMap<(u64, u32), u64>) -> String {
    let keys: std::collections::BTreeSet<_> = expected.keys().chain(got.keys()).collect();
    let parts: Vec<String> = keys
        .into_iter()
        .filter(|k| expected.get(k) != got.get(k))
        .map(|k| {
            format!(
                "worker {} rank {}: {} tokens expected, {} answered",
                k.0,
                k.1,
                expected.get(k).copied().unwrap_or(0),
                got.get(k).copied().unwrap_or(0)
            )
        })
        .collect();
    parts.join("; ")
}

fn query_body(tokens: &[u32]) -> Vec<u8> {
    http::post_json(
        "/query",
        &serde_json::to_vec(&json!({ "token_ids": tokens, "model_name": MODEL }))
            .unwrap_or_default(),
    )
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid bounds")
}

fn register(service: &Service, fleet: &Publishers) -> Result<()> {
    let mut c = Connection::connect(service.register_http())?;
    for e in fleet.endpoints() {
        let (status, body) = c.post(
            "/register",
            &json!({
                "instance_id": e.worker,
                "endpoint": e.live,
                "replay_endpoint": e.replay,
                "model_name": MODEL,
                "block_size": BLOCK_TOKENS,
            }),
        )?;
        if !(200..300).contains(&status) {
            bail!(
                "registering worker {}: {status} {}",
                e.worker,
                String::from_utf8_lossy(&body)
            );
        }
    }
    Ok(())
}

/// One probe job: a stored batch and the prompt that shows it.
struct Probe {
    sent: Instant,
    worker: u64,
    body: Vec<u8>,
    tokens: u64,
}

/// What the probe measured.
struct ProbeResults {
    /// Upper bounds of the lag: publish to the answer that showed the batch.
    upper: Histogram<u64>,
    /// Lower bounds: publish to the send of the last query that did not show it (0 if the first
    /// query did).
    lower: Histogram<u64>,
    /// Round trips of the probe's queries.
    round_trips: Histogram<u64>,
    unseen: u64,
}

impl ProbeResults {
    fn new() -> Self {
        Self {
            upper: histogram(),
            lower: histogram(),
            round_trips: histogram(),
            unseen: 0,
        }
    }
}

/// Runs probes until the channel closes.
fn run_probes(
    http_addr: &str,
    jobs: &Mutex<mpsc::Receiver<Probe>>,
    in_flight: &AtomicUsize,
) -> Result<ProbeResults> {
    let mut c = Connection::connect(http_addr)?;
    let mut out = ProbeResults::new();
    loop {
        // (The lock is held only to take a job: the other probers wait for theirs meanwhile.)
        let next = jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .recv();
        let Ok(job) = next else { break };
        let deadline = job.sent + Duration::from_secs(2);
        let mut last_unseen_send = None;
        loop {
            let send = Instant::now();
            let (status, body) = c.send(&job.body)?;
            let now = Instant::now();
            let _ = out
                .round_trips
                .record(now.duration_since(send).as_nanos().max(1) as u64);
            let seen = status == 200
                && http_scores(&body)?
                    .get(&(job.worker, 0))
                    .copied()
                    .unwrap_or(0)
                    >= job.tokens;
            if seen {
                let since =
                    |t: Instant| t.saturating_duration_since(job.sent).as_nanos().max(1) as u64;
                let _ = out.upper.record(since(now));
                let _ = out.lower.record(last_unseen_send.map_or(1, since));
                break;
            }
            last_unseen_send = Some(send);
            if now > deadline {
                // Censored, not dropped: recorded at the deadline (its lag is at least that),
                // so a service that stalls has its stall in the percentiles (dropped, the
                // probes it never answered were left out of its tail).
                out.unseen += 1;
                let at_deadline = Duration::from_secs(2).as_nanos() as u64;
                let _ = out.upper.record(at_deadline);
                let _ = out.lower.record(at_deadline);
                break;
            }
        }
        in_flight.fetch_sub(1, Ordering::AcqRel);
    }
    Ok(out)
}

/// Probes in flight at once, each on a connection of its own: with one, a stall of the
/// service yielded one sample however long it lasted (the batches published meanwhile were
/// skipped while the probe waited); with several, a stall is sampled again every
/// `probe_interval` until they are all waiting.
const PROBES_IN_FLIGHT: usize = 4;

fn ingest_phase(
    service: &Service,
    prepared: &Prepared,
    trace: &[TraceRequest],
    settings: &Settings,
) -> Result<(Ingest, Publishers)> {
    let fleet = Publishers::bind(prepared.stream.workers)?;
    register(service, &fleet)?;
    fleet.wait_subscribed(1, Duration::from_secs(30))?;

    let (jobs, receiver) = mpsc::channel::<Probe>();
    let receiver = Arc::new(Mutex::new(receiver));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let probers: Vec<_> = (0..PROBES_IN_FLIGHT)
        .map(|_| {
            let (addr, receiver, in_flight) = (
                service.http().to_owned(),
                Arc::clone(&receiver),
                Arc::clone(&in_flight),
            );
            std::thread::spawn(move || run_probes(&addr, &receiver, &in_flight))
        })
        .collect();
    let cpu_of = |processes: &[(String, u32)]| -> Result<Vec<f64>> {
        processes
            .iter()
            .map(|&(_, pid)| cpu_seconds(pid))
            .collect::<Result<Vec<f64>>>()
    };
    let processes = service.processes();
    let cpu_before = cpu_of(&processes)?;
    let mut last_probe: Option<Instant> = None;
    let mut tokens = Vec::new();
    let report = fleet::publish_schedule(&prepared.stream, &fleet, |item: &Scheduled, at| {
        let Some(request) = item.request.filter(|_| item.stores) else {
            return;
        };
        if in_flight.load(Ordering::Acquire) >= PROBES_IN_FLIGHT
            || last_probe.is_some_and(|t| at - t < settings.probe_interval)
        {
            return;
        }
        let blocks = prepared.cached_blocks[request];
        if blocks == 0 {
            return;
        }
        tokens.clear();
        for &id in &trace[request].hash_ids[..blocks] {
            trace::block_tokens(id, BLOCK_TOKENS as usize, &mut tokens);
        }
        in_flight.fetch_add(1, Ordering::AcqRel);
        last_probe = Some(at);
        let _ = jobs.send(Probe {
            sent: at,
            worker: u64::from(item.worker),
            body: query_body(&tokens),
            tokens: blocks as u64 * u64::from(BLOCK_TOKENS),
        });
    })?;
    drop(jobs);
    let published = Instant::now();

    // Quiesce: the marker on every worker, at every address that answers (each replica: the
    // exactness check below asks them all).
    let marker = query_body(&marker_tokens());
    let workers = prepared.stream.workers as usize;
    let mut quiesced = true;
    for address in service.query_https() {
        let mut c = Connection::connect(address)?;
        let mut shown = false;
        while published.elapsed() < Duration::from_secs(60) {
            let (status, body) = c.send(&marker)?;
            if status == 200 && http_scores(&body)?.len() >= workers {
                shown = true;
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        quiesced &= shown;
    }
    let quiesce_ms = published.elapsed().as_secs_f64() * 1e3;
    let mut c = Connection::connect(service.http())?;
    let mut probes = ProbeResults::new();
    for prober in probers {
        let part = prober
            .join()
            .map_err(|_| anyhow::anyhow!("the probe panicked"))??;
        probes.upper.add(&part.upper)?;
        probes.lower.add(&part.lower)?;
        probes.round_trips.add(&part.round_trips)?;
        probes.unseen += part.unseen;
    }
    let lags = &probes.upper;
    let cpu_by_process: Vec<(String, f64)> = processes
        .iter()
        .zip(cpu_of(&processes)?.iter().zip(&cpu_before))
        .map(|((name, _), (after, before))| (name.clone(), after - before))
        .collect();
    let cpu: f64 = cpu_by_process.iter().map(|(_, seconds)| seconds).sum();
    let replays = fleet.replays_served();
    let scrape = |name| ServerDelay::scrape(service.http(), name).map(Some);
    let (server_delay, event_age) = match service {
        Service::Kvatlas(_) | Service::Replicated(_) => (
            scrape("kvatlas_ingest_delay_seconds")?,
            scrape("kvatlas_event_age_seconds")?,
        ),
        Service::Dynamo(_) => (None, None),
    };

    // Exactness over HTTP (and gRPC for kvatlas).
    let prompts = exactness_prompts(trace, settings.exactness_queries);
    let mut http_mismatches = 0;
    let mut first_mismatch = None;
    for (prompt, expected) in prompts.iter().zip(&prepared.expected) {
        let (status, body) = c.send(&query_body(&prompt.tokens))?;
        // An error is never a right answer (taken for an empty one, it was right for every
        // prompt that no worker holds).
        let got = if status == 200 {
            Some(http_scores(&body)?)
        } else {
            None
        };
        if got.as_ref() != Some(expected) {
            http_mismatches += 1;
            first_mismatch.get_or_insert_with(|| match &got {
                Some(got) => format!("HTTP (status {status}): {}", difference(expected, got)),
                None => format!(
                    "HTTP status {status}: {}",
                    String::from_utf8_lossy(&body[..body.len().min(200)])
                ),
            });
        }
    }
    let grpc_mismatches = match service {
        Service::Kvatlas(server) => {
            let (mismatches, example) = grpc_exactness(&server.url, &prompts, &prepared.expected)?;
            if let Some(example) = example {
                first_mismatch.get_or_insert(example);
            }
            Some(mismatches)
        }
        Service::Replicated(replicated) => {
            // Every replica answers like the reference.
            let mut total = 0;
            for replica in &replicated.replicas {
                let (mismatches, example) =
                    grpc_exactness(&replica.url, &prompts, &prepared.expected)?;
                if let Some(example) = example {
                    first_mismatch.get_or_insert(example);
                }
                total += mismatches;
            }
            Some(total)
        }
        Service::Dynamo(_) => None,
    };
    let events = prepared.stream.events;
    let us = |q: f64| lags.value_at_quantile(q) as f64 / 1e3;
    let ingest = Ingest {
        eviction: prepared.eviction.name(),
        events,
        publish_seconds: report.elapsed.as_secs_f64(),
        quiesce_ms,
        quiesced,
        cpu_seconds: cpu,
        cpu_seconds_per_million_events: cpu / events.max(1) as f64 * 1e6,
        cpu_seconds_by_process: cpu_by_process,
        freshness: Freshness {
            samples: lags.len(),
            unseen: probes.unseen,
            probe_queries: probes.round_trips.len(),
            p50_us: us(0.5),
            p99_us: us(0.99),
            max_us: lags.max() as f64 / 1e3,
            lower_p50_us: probes.lower.value_at_quantile(0.5) as f64 / 1e3,
            lower_p99_us: probes.lower.value_at_quantile(0.99) as f64 / 1e3,
            round_trip_p50_us: probes.round_trips.value_at_quantile(0.5) as f64 / 1e3,
            server_delay,
            event_age,
            cdf: crate::plot::cdf_of(lags),
        },
        exactness_queries: prompts.len() as u64,
        http_mismatches,
        grpc_mismatches,
        first_mismatch,
        replays,
    };
    Ok((ingest, fleet))
}

/// The prompts checked for exactness: every k-th trace request's whole prompt, and a block
/// more (a 64-block prompt left every block deeper than 64 unasked).
fn exactness_prompts(trace: &[TraceRequest], n: usize) -> Vec<Prompt> {
    let step = (trace.len() / n.max(1)).max(1);
    let picked: Vec<TraceRequest> = trace.iter().step_by(step).take(n).cloned().collect();
    service::whole_prompts(&picked)
}

fn grpc_exactness(
    url: &str,
    prompts: &[Prompt],
    expected: &[BTreeMap<(u64, u32), u64>],
) -> Result<(u64, Option<String>)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut client = service::connect(url).await?;
        let mut mismatches = 0;
        let mut example = None;
        for (i, (prompt, expected)) in prompts.iter().zip(expected).enumerate() {
            let answer = client
                .query(service::request(prompt, true, i as u64))
                .await?
                .into_inner();
            let got: BTreeMap<(u64, u32), u64> = answer
                .matches
                .iter()
                .filter(|m| m.device_blocks > 0)
                .map(|m| ((m.instance_id, m.dp_rank), m.matched_tokens))
                .collect();
            if &got != expected {
                mismatches += 1;
                example.get_or_insert_with(|| format!("gRPC: {}", difference(expected, &got)));
            }
        }
        Ok((mismatches, example))
    })
}

/// The protocols of a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http,
    GrpcUnary,
    GrpcStream,
}

impl Protocol {
    const fn name(self) -> &'static str {
        match self {
            Protocol::Http => "HTTP /query",
            Protocol::GrpcUnary => "gRPC Query",
            Protocol::GrpcStream => "gRPC QueryStream",
        }
    }
}

/// Paces query indices `0..total` at `rate` from `start` into `due`.
fn pace(start: Instant, rate: f64, total: usize, due: tokio::sync::mpsc::UnboundedSender<usize>) {
    for i in 0..total {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
        if due.send(i).is_err() {
            return;
        }
    }
}

/// Latency of query `i` (due at `start + i / rate`) completed now, in ns.
fn late_ns(start: Instant, rate: f64, i: usize) -> u64 {
    let due = start + Duration::from_secs_f64(i as f64 / rate);
    Instant::now()
        .saturating_duration_since(due)
        .as_nanos()
        .max(1) as u64
}

struct Target<'a> {
    http: &'a str,
    grpc: Option<&'a str>,
    http_requests: &'a Arc<Vec<Vec<u8>>>,
    prompts: &'a Arc<Vec<Prompt>>,
    connections: usize,
}

async fn load_point(
    target: &Target<'_>,
    protocol: Protocol,
    rate: f64,
    step: Duration,
) -> Result<LoadPoint> {
    let total = (rate * step.as_secs_f64()).ceil() as usize;
    let cap = step * 3 + Duration::from_secs(1);
    let start = Instant::now() + Duration::from_millis(20);
    let (due, receiver) = tokio::sync::mpsc::unbounded_channel();
    let pacer = std::thread::spawn(move || pace(start, rate, total, due));
    let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
    let mut tasks = Vec::new();
    match protocol {
        Protocol::Http => {
            for _ in 0..target.connections {
                let mut c = AsyncConnection::connect(target.http).await?;
                let (receiver, requests) =
                    (Arc::clone(&receiver), Arc::clone(target.http_requests));
                tasks.push(tokio::spawn(async move {
                    let (mut h, mut errors) = (histogram(), 0u64);
                    loop {
                        let Some(i) = receiver.lock().await.recv().await else {
                            break;
                        };
                        if start.elapsed() > cap {
                            errors += 1;
                            continue;
                        }
                        match c.send(&requests[i % requests.len()]).await {
                            Ok(200) => {
                                let _ = h.record(late_ns(start, rate, i));
                            }
                            _ => errors += 1,
                        }
                    }
                    (h, errors)
                }));
            }
        }
        Protocol::GrpcUnary => {
            let client = service::connect(target.grpc.context("no gRPC address")?).await?;
            for _ in 0..target.connections {
                let (receiver, prompts, mut client) = (
                    Arc::clone(&receiver),
                    Arc::clone(target.prompts),
                    client.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let (mut h, mut errors) = (histogram(), 0u64);
                    loop {
                        let Some(i) = receiver.lock().await.recv().await else {
                            break;
                        };
                        if start.elapsed() > cap {
                            errors += 1;
                            continue;
                        }
                        match client
                            .query(service::request(
                                &prompts[i % prompts.len()],
                                false,
                                i as u64,
                            ))
                            .await
                        {
                            Ok(_) => {
                                let _ = h.record(late_ns(start, rate, i));
                            }
                            Err(_) => errors += 1,
                        }
                    }
                    (h, errors)
                }));
            }
        }
        Protocol::GrpcStream => {
            let mut client = service::connect(target.grpc.context("no gRPC address")?).await?;
            let (tx, rx) = tokio::sync::mpsc::channel::<v1::QueryRequest>(1024);
            let prompts = Arc::clone(target.prompts);
            let forward = {
                let receiver = Arc::clone(&receiver);
                tokio::spawn(async move {
                    loop {
                        let Some(i) = receiver.lock().await.recv().await else {
                            break;
                        };
                        if tx
                            .send(service::request(
                                &prompts[i % prompts.len()],
                                false,
                                i as u64,
                            ))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                })
            };
            let mut answers = client
                .query_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await?
                .into_inner();
            tasks.push(tokio::spawn(async move {
                let (mut h, mut errors) = (histogram(), 0u64);
                let mut seen = 0;
                while seen < total && start.elapsed() <= cap {
                    match tokio::time::timeout(Duration::from_millis(100), answers.message()).await
                    {
                        Ok(Ok(Some(answer))) => {
                            seen += 1;
                            if matches!(
                                answer.outcome,
                                Some(v1::query_stream_response::Outcome::Response(_))
                            ) {
                                let _ = h.record(late_ns(start, rate, answer.request_id as usize));
                            } else {
                                errors += 1;
                            }
                        }
                        Ok(_) => {
                            errors += 1;
                            break;
                        }
                        Err(_) => {}
                    }
                }
                errors += (total - seen) as u64;
                forward.abort();
                (h, errors)
            }));
        }
    }
    let mut h = histogram();
    let mut errors = 0;
    for task in tasks {
        let (th, te) = task.await?;
        h.add(&th)?;
        errors += te;
    }
    let elapsed = start.elapsed();
    let _ = pacer.join();
    let us = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
    let achieved = h.len() as f64 / elapsed.as_secs_f64().max(step.as_secs_f64());
    let p99_us = us(0.99);
    Ok(LoadPoint {
        offered: rate,
        achieved,
        p50_us: us(0.5),
        p99_us,
        errors,
        passed: p99_us <= 1_000.0 && achieved >= 0.95 * rate && errors == 0,
    })
}

fn sweep(target: &Target<'_>, protocol: Protocol, settings: &Settings) -> Result<Sweep> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut points = Vec::new();
    for &rate in &settings.loads {
        let mut point = runtime.block_on(load_point(target, protocol, rate, settings.step))?;
        if !point.passed {
            // One retry: a single stall of this shared 2-core machine should not end a sweep.
            point = runtime.block_on(load_point(target, protocol, rate, settings.step))?;
        }
        points.push(point);
        if !point.passed {
            break;
        }
    }
    let threshold_qps = points
        .iter()
        .take_while(|p| p.passed)
        .last()
        .map_or(0.0, |p| p.offered);
    Ok(Sweep {
        protocol: protocol.name(),
        points,
        threshold_qps,
    })
}

fn run_service(
    kind: ServiceKind,
    prepared: &[Prepared],
    trace: &[TraceRequest],
    sweep_prompts: &Arc<Vec<Prompt>>,
    http_requests: &Arc<Vec<Vec<u8>>>,
    settings: &Settings,
    progress: &mut dyn FnMut(&str),
) -> Result<ServiceRun> {
    let mut run = ServiceRun {
        service: kind,
        ingest: Vec::new(),
        sweeps: Vec::new(),
        peak_rss_mib: 0.0,
        scale_out: None,
    };
    for p in prepared {
        progress(&format!(
            "{}: ingest, {} eviction",
            kind.name(),
            p.eviction.name()
        ));
        let service = Service::start(kind, settings)?;
        // The fleet stays up (idle, connected) while the service answers the query load, as a
        // real fleet would: its engines going away would leave the service reconnecting.
        let (ingest, fleet) = ingest_phase(&service, p, trace, settings)
            .with_context(|| format!("{} ingest ({})", kind.name(), p.eviction.name()))?;
        progress(&format!(
            "{}: {} events, freshness p50 {:.0} µs p99 {:.0} µs, {} of {} answers wrong",
            kind.name(),
            ingest.events,
            ingest.freshness.p50_us,
            ingest.freshness.p99_us,
            ingest.http_mismatches,
            ingest.exactness_queries
        ));
        if let Service::Replicated(replicated) = &service
            && p.eviction == Eviction::LeafFirst
        {
            progress("kvatlas via NATS: a new replica bootstraps on this state");
            let figures = replicated.figures(ingest.events)?;
            progress(&format!(
                "kvatlas via NATS: engine stamp → stored p99 ≤ {:.2} ms; ingest queued → \
                 acknowledged p99 ≤ {:.2} ms; stream stored → replica applied p50 ≤ {:.2} ms, \
                 p99 ≤ {:.2} ms; bootstrap {:.0} ms",
                figures.stored_age_p99_ms,
                figures.publish_p99_ms,
                figures.replica_lag_p50_ms,
                figures.replica_lag_p99_ms,
                figures.bootstrap_ms
            ));
            run.scale_out = Some(figures);
        }
        run.ingest.push(ingest);
        if p.eviction == Eviction::LeafFirst && settings.sweep && kind != ServiceKind::KvatlasNats {
            let grpc = match &service {
                Service::Kvatlas(s) => Some(s.url.clone()),
                Service::Dynamo(_) | Service::Replicated(_) => None,
            };
            let target = Target {
                http: service.http(),
                grpc: grpc.as_deref(),
                http_requests,
                prompts: sweep_prompts,
                connections: settings.connections,
            };
            let protocols: &[Protocol] = match kind {
                ServiceKind::Kvatlas => {
                    &[Protocol::Http, Protocol::GrpcUnary, Protocol::GrpcStream]
                }
                ServiceKind::Dynamo | ServiceKind::KvatlasNats => &[Protocol::Http],
            };
            for &protocol in protocols {
                progress(&format!("{}: load sweep, {}", kind.name(), protocol.name()));
                let s = sweep(&target, protocol, settings)?;
                progress(&format!(
                    "{}: {} passes up to {:.0} queries/s",
                    kind.name(),
                    s.protocol,
                    s.threshold_qps
                ));
                run.sweeps.push(s);
            }
        }
        run.peak_rss_mib = run
            .peak_rss_mib
            .max(service::status_mib(service.pid(), "VmHWM:"));
        service.stop();
        fleet.stop()?;
    }
    Ok(run)
}

/// Runs the benchmark (see the module docs).
///
/// # Errors
/// If a service cannot be started or driven, or a run breaks off.
pub fn run(settings: &Settings, mut progress: impl FnMut(&str)) -> Result<Summary> {
    if settings.runs == 0 || settings.rate.is_nan() || settings.rate <= 0.0 {
        bail!("--runs and --rate must be positive");
    }
    if settings.workers == 0 || settings.capacity == 0 {
        bail!("--workers and --capacity must be positive");
    }
    if settings
        .loads
        .iter()
        .any(|load| load.is_nan() || *load <= 0.0)
    {
        bail!("every offered load must be positive");
    }
    let mut trace = trace::load_trace(&trace::default_trace_path())?;
    if let Some(n) = settings.requests {
        trace.truncate(n);
    }
    let span_s = trace.last().map_or(0, |r| r.timestamp) as f64 / 1e3;
    let window = Duration::from_secs_f64(trace.len() as f64 / settings.rate);
    let exactness = exactness_prompts(&trace, settings.exactness_queries);
    let mut prepared = Vec::new();
    for eviction in Eviction::ALL {
        progress(&format!(
            "generating the fleet's stream ({} eviction)",
            eviction.name()
        ));
        let config = EngineConfig {
            block_tokens: BLOCK_TOKENS,
            ..EngineConfig::new(settings.workers, settings.capacity, eviction, 42)
        };
        let stream = engine::generate(&trace, &config);
        let fleet = FleetStream::build(&stream, &trace, window)?;
        let reference: ReferenceIndex = fleet.reference()?;
        let expected = exactness
            .iter()
            .map(|p| {
                let locals: Vec<LocalBlockHash> =
                    p.hashes.iter().map(|&h| LocalBlockHash::new(h)).collect();
                reference
                    .find_matches(&locals, &MatchOptions::default())
                    .workers
                    .iter()
                    .filter(|m| m.device > 0)
                    .map(|m| {
                        (
                            (m.worker.worker_id, m.worker.dp_rank),
                            u64::from(m.device) * u64::from(BLOCK_TOKENS),
                        )
                    })
                    .collect()
            })
            .collect();
        let cached_blocks = trace
            .iter()
            .map(|r| r.hash_ids.len().min(settings.capacity))
            .collect();
        prepared.push(Prepared {
            eviction,
            stream: Arc::new(fleet),
            expected,
            cached_blocks,
        });
    }
    let sweep_prompts = Arc::new(service::prompts(&trace));
    let http_requests = Arc::new(
        sweep_prompts
            .iter()
            .map(|p| query_body(&p.tokens))
            .collect::<Vec<_>>(),
    );
    let mut runs = Vec::new();
    let mut floors = Vec::new();
    let mut log_floors = Vec::new();
    for r in 0..settings.runs {
        if let Some(exe) = &settings.zmq_floor {
            let mut run_floors = Vec::new();
            for p in &prepared {
                progress(&format!(
                    "run {} of {}: the floor, the fleet into a bare ZMQ subscriber ({} eviction)",
                    r + 1,
                    settings.runs,
                    p.eviction.name()
                ));
                let floor = crate::zmq_floor::measure(&p.stream, exe)?;
                progress(&floor.progress_line("the floor"));
                run_floors.push(floor);
            }
            floors.push(run_floors);
            if settings.services.contains(&ServiceKind::KvatlasNats) {
                let mut run_floors = Vec::new();
                for p in &prepared {
                    progress(&format!(
                        "run {} of {}: the log's floor, the fleet through a bare relay, \
                         JetStream and {} bare consumer(s) ({} eviction)",
                        r + 1,
                        settings.runs,
                        settings.replicas.max(1),
                        p.eviction.name()
                    ));
                    let floor = crate::log_floor::measure(&p.stream, exe, settings.replicas)?;
                    progress(&floor.progress_line("the log's floor"));
                    run_floors.push(floor);
                }
                log_floors.push(run_floors);
            }
        }
        // The services in turn, first to last in even runs and last to first in odd ones: a
        // drift of the shared host within a run (this VM's speed swings 2–3× between days)
        // does not always fall on the same service. (Always in one order, the second service
        // was measured later in every run.) Reported in the services' order.
        let count = settings.services.len();
        let mut services: Vec<Option<ServiceRun>> = (0..count).map(|_| None).collect();
        let order: Vec<usize> = if r % 2 == 0 {
            (0..count).collect()
        } else {
            (0..count).rev().collect()
        };
        for i in order {
            let kind = settings.services[i];
            progress(&format!(
                "run {} of {}: {}",
                r + 1,
                settings.runs,
                kind.name()
            ));
            services[i] = Some(run_service(
                kind,
                &prepared,
                &trace,
                &sweep_prompts,
                &http_requests,
                settings,
                &mut progress,
            )?);
        }
        runs.push(services.into_iter().flatten().collect());
    }
    let first = &prepared[0].stream;
    let load = format!(
        "{} requests of the Mooncake conversation trace ({span_s:.0} s of trace time) replayed in \
         {:.1} s ({} requests/s) by W={} simulated vLLM engines with C={}-block caches, one trace \
         block = one 16-token block: {} vLLM events ({} blocks stored, {:.1} MB of msgpack) per \
         eviction order; queries: 64-block prompts (1,024 tokens), {} HTTP connections",
        trace.len(),
        window.as_secs_f64(),
        settings.rate,
        settings.workers,
        settings.capacity,
        first.events,
        first.blocks_stored,
        first.bytes as f64 / 1e6,
        settings.connections,
    );
    let summary = Summary {
        load,
        runs,
        floors,
        log_floors,
    };
    if let Some(dir) = &settings.plots {
        plots(dir, &summary)?;
    }
    Ok(summary)
}

/// Writes the plots of the last run: the freshness CDF of both services (both eviction orders)
/// and the query sweeps.
fn plots(dir: &Path, summary: &Summary) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let Some(last) = summary.runs.last() else {
        return Ok(());
    };
    let curves: Vec<(String, Vec<(f64, u64)>)> = last
        .iter()
        .flat_map(|s| {
            s.ingest.iter().map(move |i| {
                (
                    format!("{} ({})", s.service.name(), i.eviction),
                    i.freshness.cdf.clone(),
                )
            })
        })
        .filter(|(_, cdf)| !cdf.is_empty())
        .collect();
    crate::plot::cdf(
        &dir.join("e2e-freshness"),
        "publish-to-visible lag (freshness, upper bounds)",
        "from the engine's send to the answer that shows the block",
        &curves,
    )?;
    let series: Vec<crate::plot::SweepSeries> = last
        .iter()
        .flat_map(|s| {
            s.sweeps.iter().map(move |sweep| crate::plot::SweepSeries {
                name: format!("{} {}", s.service.name(), sweep.protocol),
                points: sweep
                    .points
                    .iter()
                    .map(|p| crate::plot::SweepPoint {
                        offered: p.offered,
                        achieved: p.achieved,
                        p99_us: p.p99_us,
                        ok: p.passed,
                    })
                    .collect(),
            })
        })
        .collect();
    crate::plot::query_sweep(
        &dir.join("e2e-queries"),
        "queries: achieved vs offered, p99 from the due time",
        &series,
    )?;
    Ok(())
}

/// Fails unless kvatlas was exact (HTTP and gRPC) and quiesced in every run.
///
/// Unseen probes are reported, not failed: a probe can be unsatisfiable without any fault of
/// the service, when the worker's later requests evict the probed prefix before the probe's
/// first query sees it (observed unpaced, head-first: a 23-block prefix whose score stayed at
/// one block). Every batch's freshness is in the service's own `kvatlas_event_age_seconds`.
///
/// # Errors
/// The first run and eviction order where it was not.
pub fn check(summary: &Summary) -> Result<()> {
    // A check that asked nothing passes nothing.
    let asked: u64 = summary
        .runs
        .iter()
        .flatten()
        .filter(|s| s.service != ServiceKind::Dynamo)
        .flat_map(|s| &s.ingest)
        .map(|i| i.exactness_queries)
        .sum();
    if asked == 0 {
        bail!(
            "nothing was checked: kvatlas was not among the services measured, or no exactness \
             query was asked (--exactness-queries 0)"
        );
    }
    for (r, run) in summary.runs.iter().enumerate() {
        for service in run.iter().filter(|s| s.service != ServiceKind::Dynamo) {
            for i in &service.ingest {
                let wrong = i.http_mismatches + i.grpc_mismatches.unwrap_or(0);
                if wrong > 0 || !i.quiesced {
                    bail!(
                        "run {}, {} eviction: {} gave {wrong} wrong answers of {} (first: \
                         {}), quiesced: {} (probes unseen: {})",
                        r + 1,
                        i.eviction,
                        service.service.name(),
                        i.exactness_queries,
                        i.first_mismatch.as_deref().unwrap_or("none"),
                        i.quiesced,
                        i.freshness.unseen
                    );
                }
            }
        }
    }
    Ok(())
}

fn median(mut values: Vec<f64>) -> f64 {
    service::median(&mut values)
}

/// The floor's row for the eviction order at `index` (medians over the runs), ending in
/// `tail`; empty when the floor was not measured.
fn floor_row(summary: &Summary, index: usize, tail: &str) -> String {
    let floors: Vec<&crate::zmq_floor::Floor> =
        summary.floors.iter().filter_map(|f| f.get(index)).collect();
    if floors.is_empty() {
        return String::new();
    }
    let of = |f: fn(&crate::zmq_floor::Floor) -> f64| median(floors.iter().map(|x| f(x)).collect());
    format!(
        "| the machine's floor: the same schedule into a bare ZMQ subscriber process, the stamp → \
         received (every batch), {} | p50 {:.0} µs, p99 {:.0} µs, {:.1} % within 1 ms |{tail}\n",
        Eviction::ALL[index].name(),
        of(|f| f.p50_us),
        of(|f| f.p99_us),
        of(|f| f.within_1ms) * 100.0,
    )
}

/// The medians (mismatches: the maximum) as a Markdown report.
pub fn markdown(summary: &Summary) -> String {
    use std::fmt::Write as _;
    let mut out = format!("Load: {}\n\n", summary.load);
    let of = |kind: ServiceKind| -> Vec<&ServiceRun> {
        summary
            .runs
            .iter()
            .flat_map(|r| r.iter().filter(move |s| s.service == kind))
            .collect()
    };
    let (kv, dy) = (of(ServiceKind::Kvatlas), of(ServiceKind::Dynamo));
    if kv.is_empty() || dy.is_empty() {
        out.push_str(
            "Only one service was measured: no comparison (the figures are in the JSON).\n",
        );
        if !summary.floors.is_empty() {
            let _ = writeln!(
                out,
                "\n| the machine's floor (medians of {} runs) | |",
                summary.floors.len()
            );
            let _ = writeln!(out, "|---|---|");
            for eviction in 0..Eviction::ALL.len() {
                out.push_str(&floor_row(summary, eviction, ""));
            }
        }
        return out;
    }
    let threshold = |runs: &[&ServiceRun], protocol: &str| -> Option<f64> {
        let v: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.sweeps.iter().find(|s| s.protocol == protocol))
            .map(|s| s.threshold_qps)
            .collect();
        (!v.is_empty()).then(|| median(v))
    };
    // NaN: not measured in that run (a freshness figure without a single probe seen); the
    // median of the runs that measured it, NaN (shown as n/a) if none did.
    let ingest = |runs: &[&ServiceRun], eviction: &str, f: fn(&Ingest) -> f64| -> f64 {
        let measured: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.ingest.iter().find(|i| i.eviction == eviction))
            .map(f)
            .filter(|v| !v.is_nan())
            .collect();
        if measured.is_empty() {
            f64::NAN
        } else {
            median(measured)
        }
    };
    let worst = |runs: &[&ServiceRun], f: fn(&Ingest) -> u64| -> u64 {
        runs.iter()
            .flat_map(|r| r.ingest.iter().map(f))
            .max()
            .unwrap_or(0)
    };
    let _ = writeln!(
        out,
        "| figure (medians of {} runs) | kvatlas | Dynamo 1.6.1 | kvatlas / Dynamo |",
        summary.runs.len()
    );
    let _ = writeln!(out, "|---|---|---|---|");
    let dy_http = threshold(&dy, Protocol::Http.name()).unwrap_or(0.0);
    for protocol in [Protocol::Http, Protocol::GrpcUnary, Protocol::GrpcStream] {
        if let Some(k) = threshold(&kv, protocol.name()) {
            let d = threshold(&dy, protocol.name());
            let _ = writeln!(
                out,
                "| queries/s at p99 ≤ 1 ms, {} | {k:.0} | {} | {} |",
                protocol.name(),
                d.map_or("—".to_owned(), |d| format!("{d:.0}")),
                if dy_http > 0.0 {
                    format!("{:.2}× (vs Dynamo HTTP)", k / dy_http)
                } else {
                    "—".into()
                },
            );
        }
    }
    for eviction in ["leaf-first", "head-first"] {
        let row = |label: &str, f: fn(&Ingest) -> f64, unit: &str| {
            let (k, d) = (ingest(&kv, eviction, f), ingest(&dy, eviction, f));
            let shown = |v: f64| {
                if v.is_nan() {
                    "n/a".to_owned()
                } else {
                    format!("{v:.1} {unit}")
                }
            };
            format!(
                "| {label}, {eviction} | {} | {} | {} |\n",
                shown(k),
                shown(d),
                if d > 0.0 && !k.is_nan() {
                    format!("{:.2}×", k / d)
                } else {
                    "—".into()
                }
            )
        };
        // A freshness figure of a run whose probes were never seen is not 0 but unmeasured.
        fn probed(i: &Ingest, v: f64) -> f64 {
            if i.freshness.samples == 0 {
                f64::NAN
            } else {
                v
            }
        }
        out.push_str(&row(
            "freshness p50 (upper bound)",
            |i| probed(i, i.freshness.p50_us),
            "µs",
        ));
        out.push_str(&row(
            "freshness p99 (upper bound)",
            |i| probed(i, i.freshness.p99_us),
            "µs",
        ));
        out.push_str(&row(
            "freshness p50 (lower bound)",
            |i| probed(i, i.freshness.lower_p50_us),
            "µs",
        ));
        out.push_str(&row(
            "freshness p99 (lower bound)",
            |i| probed(i, i.freshness.lower_p99_us),
            "µs",
        ));
        out.push_str(&row(
            "freshness probes seen (up to 4 in flight)",
            |i| i.freshness.samples as f64,
            "",
        ));
        out.push_str(&row(
            "freshness probes unseen within 2 s (in the figures above at 2 s)",
            |i| i.freshness.unseen as f64,
            "",
        ));
        out.push_str(&row(
            "probe query round trip p50",
            |i| i.freshness.round_trip_p50_us,
            "µs",
        ));
        out.push_str(&row(
            "CPU s per million events",
            |i| i.cpu_seconds_per_million_events,
            "s",
        ));
        out.push_str(&row("quiesce after the last send", |i| i.quiesce_ms, "ms"));
        let server = |account: Account, f: fn(&ServerDelay) -> f64| {
            median(
                kv.iter()
                    .filter_map(|r| r.ingest.iter().find(|i| i.eviction == eviction))
                    .filter_map(|i| account(&i.freshness).map(f))
                    .collect(),
            )
        };
        let accounts: [(&str, Account); 2] = [
            (
                "kvatlas's own receipt → visible (server histogram, every batch)",
                |f| f.server_delay.as_ref(),
            ),
            (
                "kvatlas's event age: the engine's stamp at send → visible (server histogram, \
                 every batch, 50 µs buckets)",
                |f| f.event_age.as_ref(),
            ),
        ];
        for (what, account) in accounts {
            let (p50, p99, within) = (
                server(account, |d| d.p50_le_us),
                server(account, |d| d.p99_le_us),
                server(account, |d| d.within_1ms),
            );
            if p99 > 0.0 {
                let _ = writeln!(
                    out,
                    "| {what}, {eviction} | p50 ≤ {p50:.0} µs, p99 ≤ {p99:.0} µs, {:.1} % within \
                     1 ms | — | |",
                    within * 100.0
                );
            }
        }
    }
    for eviction in 0..Eviction::ALL.len() {
        out.push_str(&floor_row(summary, eviction, " — | |"));
    }
    let rss = |runs: &[&ServiceRun]| median(runs.iter().map(|r| r.peak_rss_mib).collect());
    let (k, d) = (rss(&kv), rss(&dy));
    let _ = writeln!(
        out,
        "| peak RSS | {k:.1} MiB | {d:.1} MiB | {:.2}× |",
        k / d.max(1e-9)
    );
    let _ = writeln!(
        out,
        "| wrong answers (max over runs, HTTP / gRPC) | {} / {} of {} | {} of {} | |",
        worst(&kv, |i| i.http_mismatches),
        worst(&kv, |i| i.grpc_mismatches.unwrap_or(0)),
        kv.first()
            .and_then(|r| r.ingest.first())
            .map_or(0, |i| i.exactness_queries),
        worst(&dy, |i| i.http_mismatches),
        dy.first()
            .and_then(|r| r.ingest.first())
            .map_or(0, |i| i.exactness_queries),
    );
    for (kind, runs) in [(ServiceKind::Kvatlas, &kv), (ServiceKind::Dynamo, &dy)] {
        // The first run with a wrong answer, its first eviction order with one.
        if let Some(run) = runs
            .iter()
            .find(|r| r.ingest.iter().any(|i| i.first_mismatch.is_some()))
        {
            for ingest in &run.ingest {
                if let Some(example) = &ingest.first_mismatch {
                    let _ = writeln!(
                        out,
                        "\n{} ({}): first wrong answer: {example}",
                        kind.name(),
                        ingest.eviction
                    );
                    break;
                }
            }
        }
    }
    let _ = writeln!(
        out,
        "\nSweeps (the last run; p50 / p99 µs at each offered load, ✗ = failed):\n"
    );
    if let Some(last) = summary.runs.last() {
        for s in last {
            for sweep in &s.sweeps {
                let points: Vec<String> = sweep
                    .points
                    .iter()
                    .map(|p| {
                        format!(
                            "{:.0}/s: {:.0} / {:.0}{}",
                            p.offered,
                            p.p50_us,
                            p.p99_us,
                            if p.passed { "" } else { " ✗" }
                        )
                    })
                    .collect();
                let _ = writeln!(
                    out,
                    "- {} {}: {}",
                    s.service.name(),
                    sweep.protocol,
                    points.join(", ")
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A check of a summary in which nothing was asked fails: it checked nothing.
    #[test]
    fn a_check_that_asked_nothing_fails() {
        let summary = Summary {
            load: String::new(),
            runs: vec![Vec::new()],
            floors: Vec::new(),
            log_floors: Vec::new(),
        };
        let why = check(&summary).expect_err("nothing was checked");
        assert!(why.to_string().contains("nothing was checked"), "{why}");
    }
}
