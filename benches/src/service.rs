//! The service benchmark behind `cargo xtask bench service`: a Rust load generator (tonic) against
//! a `kvatlas serve` process on the same machine.
//!
//! Per run, a fresh server is started (release binary, ephemeral loopback ports), loaded with the
//! Workload A state — the Mooncake conversation trace through 128 mock engines with 512-block LRU
//! caches, one trace block = one block of 16 tokens, pushed over `PublishEvents` with local hashes
//! — and checked: the server's memberships must equal the mock engines' final state. Then:
//!
//! - unary `Query` with 1 request in flight: latency p50/p99/p999, by token ids and by local
//!   hashes;
//! - unary `Query` with 8–64 in flight (tasks sharing one HTTP/2 connection, or one connection
//!   each): queries/s and latency;
//! - `QueryStream` with 8–64 in flight on one stream: queries/s and latency;
//! - the server's resident memory after loading and at the end (`VmRSS`, `VmHWM`).
//!
//! Every prompt is a trace request cut or extended to exactly 64 blocks (1,024 tokens): its own
//! blocks first (the shared prefixes the index holds), then blocks of its own that no engine
//! holds, as the new part of a prompt would be. The load generator and the server share the
//! machine's cores; figures are medians over `--runs` runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use hdrhistogram::Histogram;
use kvatlas_index::Mutation;
use kvatlas_proto::v1::{self, indexer_client::IndexerClient, kv_event, query_request};
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};

use crate::engine::{self, EngineConfig, Eviction};
use crate::trace::{self, TraceRequest};

/// Tokens per block in the service benchmark (one trace block is one index block).
pub const BLOCK_TOKENS: u32 = 16;
/// Blocks per query prompt.
pub const PROMPT_BLOCKS: usize = 64;
pub(crate) const MODEL: &str = "workload-a";

/// What to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The `kvatlas` binary to start.
    pub kvatlas: PathBuf,
    /// Runs (each on a fresh server); medians are reported.
    pub runs: usize,
    /// How long each throughput point runs.
    pub duration: Duration,
    /// Queries of the 1-in-flight latency measurement.
    pub latency_queries: usize,
    /// In-flight counts of the throughput points.
    pub in_flight: Vec<usize>,
    /// Mock engines (Workload A: 128).
    pub workers: u32,
    /// Blocks per mock engine cache (Workload A: 512).
    pub capacity: usize,
    /// Trace requests used (all by default).
    pub requests: Option<usize>,
    /// Extra arguments for `kvatlas serve`.
    pub serve_args: Vec<String>,
    /// Worker threads of the load generator's runtime (1 = a current-thread runtime).
    pub client_threads: usize,
    /// Busy-poll on both sides: `kvatlas serve --busy-poll`, and a task in the load generator's
    /// runtime that keeps it polling instead of sleeping (what a router that wants the lowest
    /// latency would do with `kvatlas-proto`'s client).
    pub busy_poll: bool,
}

/// Latency quantiles in microseconds and the achieved rate.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Point {
    /// Requests in flight.
    pub in_flight: usize,
    /// Queries answered per second.
    pub qps: f64,
    /// Median latency, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Errors seen.
    pub errors: u64,
}

/// The machine's floor: a bare loopback TCP echo of 512 bytes between two threads (no gRPC, no
/// HTTP/2, blocking sockets), 20,000 round trips: what any request/response over loopback pays
/// for two thread wakeups on this machine.
pub fn tcp_echo_floor() -> Result<Point> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut socket, _) = listener.accept()?;
        socket.set_nodelay(true)?;
        let mut buf = [0u8; 512];
        loop {
            let n = socket.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            socket.write_all(&buf[..n])?;
        }
    });
    let mut socket = std::net::TcpStream::connect(addr)?;
    socket.set_nodelay(true)?;
    let mut buf = [7u8; 512];
    let mut h = histogram();
    let started = Instant::now();
    for _ in 0..20_000 {
        let at = Instant::now();
        socket.write_all(&buf)?;
        let mut got = 0;
        while got < buf.len() {
            got += socket.read(&mut buf[got..])?;
        }
        let _ = h.record(at.elapsed().as_nanos() as u64);
    }
    let elapsed = started.elapsed();
    drop(socket);
    let _ = echo.join();
    Ok(point(1, h.len(), elapsed, &h, 0))
}

/// One run's figures.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RunReport {
    /// The machine's loopback TCP echo round trip (see [`tcp_echo_floor`]).
    pub tcp_echo_floor: Point,
    /// Events pushed to load the state.
    pub load_events: usize,
    /// Seconds the load took (publish until acknowledged and applied).
    pub load_seconds: f64,
    /// Memberships the server holds after loading (equal to the mock engines').
    pub memberships: u64,
    /// Server RSS after loading, MiB.
    pub rss_loaded_mib: f64,
    /// Server peak RSS at the end, MiB.
    pub rss_peak_mib: f64,
    /// Unary, 1 in flight, token ids.
    pub unary_latency_tokens: Point,
    /// Unary, 1 in flight, local hashes.
    pub unary_latency_hashes: Point,
    /// Unary throughput points, token ids, one shared connection.
    pub unary_tokens: Vec<Point>,
    /// Unary throughput points, local hashes, one shared connection.
    pub unary_hashes: Vec<Point>,
    /// Unary throughput points, local hashes, one connection per task.
    pub unary_hashes_connections: Vec<Point>,
    /// `QueryStream` throughput points, token ids.
    pub stream_tokens: Vec<Point>,
    /// `QueryStream` throughput points, local hashes.
    pub stream_hashes: Vec<Point>,
}

/// A prepared prompt.
#[derive(Debug, Clone)]
pub(crate) struct Prompt {
    /// Its token ids.
    pub(crate) tokens: Vec<u32>,
    /// Its local hashes.
    pub(crate) hashes: Vec<u64>,
}

/// The prompts: every trace request as exactly [`PROMPT_BLOCKS`] blocks.
pub(crate) fn prompts(trace: &[TraceRequest]) -> Vec<Prompt> {
    prompts_of(trace, |_| PROMPT_BLOCKS)
}

/// Every trace request as its whole prompt and one block more (no trace block): what an
/// exactness check queries, so that no held block, however deep, goes unasked.
pub(crate) fn whole_prompts(trace: &[TraceRequest]) -> Vec<Prompt> {
    prompts_of(trace, |request| request.hash_ids.len() + 1)
}

/// Every trace request as `blocks_of(request)` blocks: its own, then new ones.
fn prompts_of(trace: &[TraceRequest], blocks_of: impl Fn(&TraceRequest) -> usize) -> Vec<Prompt> {
    let hasher = kvatlas_hash::BlockHasher::new(BLOCK_TOKENS).expect("a valid block size");
    trace
        .iter()
        .enumerate()
        .map(|(i, request)| {
            let blocks = blocks_of(request);
            let mut tokens = Vec::with_capacity(blocks * BLOCK_TOKENS as usize);
            for position in 0..blocks {
                let id = request.hash_ids.get(position).copied().unwrap_or_else(|| {
                    // The prompt's new part: ids no trace block uses (2^20 per request).
                    (1 << 40) + ((i as u64) << 20) + position as u64
                });
                trace::block_tokens(id, BLOCK_TOKENS as usize, &mut tokens);
            }
            let hashes = hasher.local_hashes(&tokens).map(|h| h.get()).collect();
            Prompt { tokens, hashes }
        })
        .collect()
}

/// The stream's mutations as `PublishEvents` messages, one per mutation, sequenced per rank.
pub(crate) fn messages(events: &[Mutation]) -> Vec<v1::PublishEventsRequest> {
    let mut seqs = std::collections::HashMap::<(u64, u32), u64>::new();
    events
        .iter()
        .map(|mutation| {
            let worker = mutation.worker();
            let event = match mutation {
                Mutation::Stored { parent, blocks, .. } => {
                    kv_event::Event::Stored(v1::BlocksStored {
                        parent_hash: parent.map(|p| p.get()),
                        block_hashes: blocks.iter().map(|b| b.external.get()).collect(),
                        local_hashes: blocks.iter().map(|b| b.local.get()).collect(),
                        ..v1::BlocksStored::default()
                    })
                }
                Mutation::Removed { blocks, .. } => kv_event::Event::Removed(v1::BlocksRemoved {
                    block_hashes: blocks.iter().map(|b| b.get()).collect(),
                    tier: v1::StorageTier::Device as i32,
                }),
                Mutation::Cleared { .. } => kv_event::Event::Cleared(v1::AllBlocksCleared {}),
            };
            let seq = seqs.entry((worker.worker_id, worker.dp_rank)).or_insert(0);
            let message = v1::PublishEventsRequest {
                index: Some(v1::IndexSelector {
                    model: MODEL.into(),
                    tenant: String::new(),
                }),
                instance_id: worker.worker_id,
                dp_rank: worker.dp_rank,
                seq: Some(*seq),
                block_size: BLOCK_TOKENS,
                events: vec![v1::KvEvent { event: Some(event) }],
            };
            *seq += 1;
            message
        })
        .collect()
}

/// A `kvatlas serve` child process on loopback.
pub(crate) use kvatlas_fleet::server::ServeChild as Server;

/// (VmRSS, VmHWM) of `server` in MiB.
pub(crate) fn memory(server: &Server) -> (f64, f64) {
    let pid = server.pid();
    (status_mib(pid, "VmRSS:"), status_mib(pid, "VmHWM:"))
}

/// A `/proc/PID/status` memory field (`VmRSS:`, `VmHWM:`) in MiB (0 if unreadable).
pub(crate) fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

pub(crate) async fn connect(url: &str) -> Result<IndexerClient<Channel>> {
    let channel = Endpoint::from_shared(url.to_owned())?
        .tcp_nodelay(true)
        .initial_connection_window_size(Some(8 << 20))
        .initial_stream_window_size(Some(8 << 20))
        .connect()
        .await?;
    Ok(IndexerClient::new(channel).max_decoding_message_size(64 << 20))
}

pub(crate) fn request(prompt: &Prompt, by_tokens: bool, id: u64) -> v1::QueryRequest {
    v1::QueryRequest {
        index: Some(v1::IndexSelector {
            model: MODEL.into(),
            tenant: String::new(),
        }),
        input: Some(if by_tokens {
            query_request::Input::Tokens(v1::TokenIds {
                ids: prompt.tokens.clone(),
            })
        } else {
            query_request::Input::LocalHashes(v1::LocalHashes {
                hashes: prompt.hashes.clone(),
            })
        }),
        request_id: id,
        ..v1::QueryRequest::default()
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds")
}

fn point(
    in_flight: usize,
    count: u64,
    elapsed: Duration,
    h: &Histogram<u64>,
    errors: u64,
) -> Point {
    let us = |q: f64| h.value_at_quantile(q) as f64 / 1_000.0;
    Point {
        in_flight,
        qps: count as f64 / elapsed.as_secs_f64(),
        p50_us: us(0.5),
        p99_us: us(0.99),
        p999_us: us(0.999),
        errors,
    }
}

/// Unary queries from `in_flight` tasks for `duration` (connections: one shared, or one each).
async fn unary(
    url: &str,
    prompts: &Arc<Vec<Prompt>>,
    by_tokens: bool,
    in_flight: usize,
    duration: Duration,
    connection_each: bool,
) -> Result<Point> {
    let shared = connect(url).await?;
    let next = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let mut client = if connection_each {
            connect(url).await?
        } else {
            shared.clone()
        };
        let (prompts, next, stop) = (Arc::clone(prompts), Arc::clone(&next), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut h = histogram();
            let mut errors = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let query = request(&prompts[i % prompts.len()], by_tokens, i as u64);
                let started = Instant::now();
                match client.query(query).await {
                    Ok(_) => {
                        let _ = h.record(started.elapsed().as_nanos() as u64);
                    }
                    Err(_) => errors += 1,
                }
            }
            (h, errors)
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut h = histogram();
    let mut errors = 0;
    for task in tasks {
        let (th, te) = task.await?;
        h.add(&th)?;
        errors += te;
    }
    let elapsed = started.elapsed();
    Ok(point(in_flight, h.len(), elapsed, &h, errors))
}

/// `QueryStream` with `in_flight` queries outstanding on one stream for `duration`.
async fn streamed(
    url: &str,
    prompts: &Arc<Vec<Prompt>>,
    by_tokens: bool,
    in_flight: usize,
    duration: Duration,
) -> Result<Point> {
    let mut client = connect(url).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<v1::QueryRequest>(in_flight.max(1));
    let window = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let sent_at = Arc::new(SendTimes::new(1 << 20));
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let (prompts, window, sent_at, stop) = (
            Arc::clone(prompts),
            Arc::clone(&window),
            Arc::clone(&sent_at),
            Arc::clone(&stop),
        );
        tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let Ok(permit) = window.acquire().await else {
                    break;
                };
                permit.forget();
                sent_at.set(i, Instant::now());
                if tx
                    .send(request(&prompts[i % prompts.len()], by_tokens, i as u64))
                    .await
                    .is_err()
                {
                    break;
                }
                i += 1;
            }
        })
    };
    let mut answers = client
        .query_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let started = Instant::now();
    let mut h = histogram();
    let mut errors = 0;
    while started.elapsed() < duration {
        let Some(answer) = answers.message().await? else {
            bail!("the stream ended early");
        };
        // Only answers count in the rate and the latencies, as on the unary path (an error
        // answer on the stream was counted as a query served).
        if matches!(
            answer.outcome,
            Some(v1::query_stream_response::Outcome::Response(_))
        ) {
            let _ = h.record(sent_at.elapsed_since(answer.request_id as usize).as_nanos() as u64);
        } else {
            errors += 1;
        }
        window.add_permits(1);
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    window.close();
    sender.abort();
    Ok(point(in_flight, h.len(), elapsed, &h, errors))
}

/// Send times by request id, in a ring (ids beyond the ring wrap; the window is far smaller).
struct SendTimes {
    times: Vec<std::sync::atomic::AtomicU64>,
    origin: Instant,
}

impl SendTimes {
    fn new(n: usize) -> Self {
        Self {
            times: (0..n)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            origin: Instant::now(),
        }
    }

    fn set(&self, id: usize, at: Instant) {
        let nanos = at.duration_since(self.origin).as_nanos() as u64;
        self.times[id % self.times.len()].store(nanos, Ordering::Release);
    }

    fn elapsed_since(&self, id: usize) -> Duration {
        let sent = self.times[id % self.times.len()].load(Ordering::Acquire);
        self.origin
            .elapsed()
            .saturating_sub(Duration::from_nanos(sent))
    }
}

/// One run on a fresh server.
fn run_once(
    settings: &Settings,
    messages: &[v1::PublishEventsRequest],
    memberships: u64,
    prompts: &Arc<Vec<Prompt>>,
) -> Result<RunReport> {
    let tcp_echo_floor = tcp_echo_floor()?;
    let mut serve_args = settings.serve_args.clone();
    if settings.busy_poll {
        serve_args.push("--busy-poll".into());
    }
    let server = Server::start(&settings.kvatlas, &serve_args)?;
    let runtime = if settings.client_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(settings.client_threads)
            .enable_all()
            .build()?
    };
    if settings.busy_poll {
        for _ in 0..settings.client_threads.max(1) {
            // Ends with the runtime at the end of the run.
            runtime.spawn(async {
                loop {
                    tokio::task::yield_now().await;
                }
            });
        }
    }
    let url = server.url.clone();
    let mut report = runtime.block_on(async {
        let mut client = connect(&url).await?;
        let started = Instant::now();
        let acked = client
            .publish_events(tokio_stream::iter(messages.to_vec()))
            .await?
            .into_inner();
        let load_seconds = started.elapsed().as_secs_f64();
        if acked.messages_applied as usize != messages.len() {
            bail!(
                "the server applied {} of {} messages",
                acked.messages_applied,
                messages.len()
            );
        }
        let listed = client
            .list_indexes(v1::ListIndexesRequest::default())
            .await?
            .into_inner();
        let held = listed.indexes.first().map_or(0, |i| i.memberships);
        if held != memberships {
            bail!("the server holds {held} memberships, the mock engines {memberships}");
        }
        let mut report = RunReport {
            tcp_echo_floor,
            load_events: messages.len(),
            load_seconds,
            memberships: held,
            rss_loaded_mib: memory(&server).0,
            ..RunReport::default()
        };
        // Warm up connections and caches.
        unary(&url, prompts, false, 8, Duration::from_millis(500), false).await?;
        let single = settings.latency_queries;
        for (by_tokens, slot) in [
            (true, &mut report.unary_latency_tokens),
            (false, &mut report.unary_latency_hashes),
        ] {
            let mut h = histogram();
            let started = Instant::now();
            let mut errors = 0;
            for i in 0..single {
                let query = request(&prompts[i % prompts.len()], by_tokens, i as u64);
                let at = Instant::now();
                match client.query(query).await {
                    Ok(_) => {
                        let _ = h.record(at.elapsed().as_nanos() as u64);
                    }
                    Err(_) => errors += 1,
                }
            }
            *slot = point(1, h.len(), started.elapsed(), &h, errors);
        }
        for &n in &settings.in_flight {
            report
                .unary_tokens
                .push(unary(&url, prompts, true, n, settings.duration, false).await?);
            report
                .unary_hashes
                .push(unary(&url, prompts, false, n, settings.duration, false).await?);
            report
                .unary_hashes_connections
                .push(unary(&url, prompts, false, n, settings.duration, true).await?);
            report
                .stream_tokens
                .push(streamed(&url, prompts, true, n, settings.duration).await?);
            report
                .stream_hashes
                .push(streamed(&url, prompts, false, n, settings.duration).await?);
        }
        Ok::<_, anyhow::Error>(report)
    })?;
    let (rss, peak) = memory(&server);
    report.rss_peak_mib = peak.max(rss);
    server.stop();
    Ok(report)
}

/// Medians over runs of every figure.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The settings' description.
    pub load: String,
    /// The runs.
    pub runs: Vec<RunReport>,
    /// Per-figure medians (same shape as a run).
    pub median: RunReport,
}

/// The median of `values` (of an even count, the mean of the middle two; 0 for none).
pub(crate) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

fn median_point(points: &[Point]) -> Point {
    let field = |f: fn(&Point) -> f64| median(&mut points.iter().map(f).collect::<Vec<_>>());
    Point {
        in_flight: points.first().map_or(0, |p| p.in_flight),
        qps: field(|p| p.qps),
        p50_us: field(|p| p.p50_us),
        p99_us: field(|p| p.p99_us),
        p999_us: field(|p| p.p999_us),
        errors: points.iter().map(|p| p.errors).sum(),
    }
}

fn median_report(runs: &[RunReport]) -> RunReport {
    let points = |f: fn(&RunReport) -> &Vec<Point>| -> Vec<Point> {
        let n = runs.first().map_or(0, |r| f(r).len());
        (0..n)
            .map(|i| median_point(&runs.iter().map(|r| f(r)[i]).collect::<Vec<_>>()))
            .collect()
    };
    let scalar = |f: fn(&RunReport) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    RunReport {
        tcp_echo_floor: median_point(&runs.iter().map(|r| r.tcp_echo_floor).collect::<Vec<_>>()),
        load_events: runs.first().map_or(0, |r| r.load_events),
        load_seconds: scalar(|r| r.load_seconds),
        memberships: runs.first().map_or(0, |r| r.memberships),
        rss_loaded_mib: scalar(|r| r.rss_loaded_mib),
        rss_peak_mib: scalar(|r| r.rss_peak_mib),
        unary_latency_tokens: median_point(
            &runs
                .iter()
                .map(|r| r.unary_latency_tokens)
                .collect::<Vec<_>>(),
        ),
        unary_latency_hashes: median_point(
            &runs
                .iter()
                .map(|r| r.unary_latency_hashes)
                .collect::<Vec<_>>(),
        ),
        unary_tokens: points(|r| &r.unary_tokens),
        unary_hashes: points(|r| &r.unary_hashes),
        unary_hashes_connections: points(|r| &r.unary_hashes_connections),
        stream_tokens: points(|r| &r.stream_tokens),
        stream_hashes: points(|r| &r.stream_hashes),
    }
}

/// Runs the benchmark (see the module docs).
///
/// # Errors
/// A server that does not start or load, or a failing client.
pub fn run(settings: &Settings, mut progress: impl FnMut(&str)) -> Result<Summary> {
    if settings.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let mut trace = trace::load_trace(&trace::default_trace_path())?;
    if let Some(n) = settings.requests {
        trace.truncate(n);
    }
    let config = EngineConfig {
        block_tokens: BLOCK_TOKENS,
        ..EngineConfig::new(settings.workers, settings.capacity, Eviction::LeafFirst, 42)
    };
    progress("generating the Workload A stream");
    let stream = engine::generate(&trace, &config);
    let messages = messages(&stream.events);
    let prompts = Arc::new(prompts(&trace));
    let mut runs = Vec::new();
    for run in 0..settings.runs {
        progress(&format!("run {} of {}", run + 1, settings.runs));
        runs.push(run_once(
            settings,
            &messages,
            stream.stats.final_memberships,
            &prompts,
        )?);
    }
    Ok(Summary {
        load: format!(
            "Workload A state: {} requests of the Mooncake conversation trace through W={} mock \
             engines of C={} blocks, {} events ({} memberships at the end); prompts of {} blocks \
             of {} tokens{}",
            trace.len(),
            settings.workers,
            settings.capacity,
            messages.len(),
            stream.stats.final_memberships,
            PROMPT_BLOCKS,
            BLOCK_TOKENS,
            if settings.busy_poll {
                "; busy-polling server (--busy-poll) and load generator"
            } else {
                ""
            }
        ),
        median: median_report(&runs),
        runs,
    })
}

/// The summary as a Markdown table.
pub fn markdown(summary: &Summary) -> String {
    use std::fmt::Write as _;
    let m = &summary.median;
    let mut out = format!(
        "{}\n\nmedians of {} runs; server peak RSS {:.1} MiB; load {:.0} events/s over PublishEvents\n\n",
        summary.load,
        summary.runs.len(),
        m.rss_peak_mib,
        m.load_events as f64 / m.load_seconds.max(1e-9)
    );
    out.push_str("| measurement | in flight | queries/s | p50 µs | p99 µs | p99.9 µs | errors |\n");
    out.push_str("|---|---|---|---|---|---|---|\n");
    let mut row = |name: &str, p: &Point| {
        let _ = writeln!(
            out,
            "| {name} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {} |",
            p.in_flight, p.qps, p.p50_us, p.p99_us, p.p999_us, p.errors
        );
    };
    row(
        "the machine's floor: loopback TCP echo, 512 B, no gRPC",
        &m.tcp_echo_floor,
    );
    row("unary Query, token ids", &m.unary_latency_tokens);
    row("unary Query, local hashes", &m.unary_latency_hashes);
    for (name, points) in [
        ("unary Query, token ids, 1 connection", &m.unary_tokens),
        ("unary Query, local hashes, 1 connection", &m.unary_hashes),
        (
            "unary Query, local hashes, connection per task",
            &m.unary_hashes_connections,
        ),
        ("QueryStream, token ids", &m.stream_tokens),
        ("QueryStream, local hashes", &m.stream_hashes),
    ] {
        for p in points {
            row(name, p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The median of an even count is the mean of its middle two (it was the upper one: two
    /// runs reported the worse).
    #[test]
    fn medians() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0]), 2.5);
    }
}
