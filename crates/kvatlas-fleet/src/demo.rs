//! `kvatlas demo`: the whole system working in one command, before it is wired to real engines.
//!
//! It runs the same simulation twice, once per routing policy, each on a fresh `kvatlas serve`
//! (a child process of this executable, on loopback ports of its choosing):
//!
//! 1. a fleet of mock engines ([`crate::engine::Engines`], one LRU prefix cache each) publishing
//!    vLLM KV-event batches on ZMQ ([`crate::publish`]), registered with the server;
//! 2. a router replaying the Mooncake conversation trace at a chosen request rate: for every
//!    request it asks the index over gRPC (local hashes, as `kvatlas-proto`'s client sends them)
//!    which engine holds how much of the prompt, then sends it to a random engine (**random**)
//!    or to the engine with the longest cached prefix among those not overloaded (**KV-aware**);
//! 3. the engine serves it — evicting, caching — and publishes what changed.
//!
//! While it runs, a progress line shows events/s, queries/s, query latency p50/p99, the fleet's
//! prefix-cache hit rate and the index's size; the end prints both policies side by side: how
//! much prefill KV-aware routing saved, and whether every answer matched the engines' caches,
//! and writes two plots (`--plots DIR`): the hit rate as requests arrive, and the query latency
//! CDF, per policy.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use kvatlas_index::Mutation;
use kvatlas_proto::v1::{self, indexer_client::IndexerClient, query_request};
use rustc_hash::FxHashMap;

use crate::engine::{EngineConfig, Engines, Eviction, Router, Routing};
use crate::plot::{self, Axes, Cdf, PlotError};
use crate::publish::{PublishError, Publishers};
use crate::server::{ServeChild, ServeError};
use crate::trace::{self, TraceError, block_tokens};
use crate::vllm::{self, BLOCK_TOKENS};

/// The model name the demo's engines register under.
const MODEL: &str = "demo";

/// `kvatlas demo`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Trace requests to replay per routing policy.
    #[arg(long, default_value_t = 4_000)]
    pub requests: usize,
    /// Simulated engines.
    #[arg(long, default_value_t = 16)]
    pub engines: u32,
    /// Blocks (of 16 tokens) each engine's prefix cache holds.
    #[arg(long, default_value_t = 1_024)]
    pub capacity: usize,
    /// Requests per second.
    #[arg(long, default_value_t = 1_000.0)]
    pub rate: f64,
    /// The Mooncake-style JSONL trace [default: the conversation trace in data/traces/].
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The kvatlas executable to run as the server [default: this one].
    #[arg(long)]
    pub kvatlas: Option<PathBuf>,
    /// Where the plots go (SVG and PNG: the hit rate as requests arrive, the query latency CDF).
    #[arg(long, default_value = "kvatlas-demo")]
    pub plots: PathBuf,
}

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The fleet's sockets failed.
    #[error("the simulated fleet: {0}")]
    Fleet(#[from] PublishError),
    /// The server could not be started.
    #[error(transparent)]
    Server(#[from] ServeError),
    /// This executable could not be found.
    #[error("finding this executable: {0}")]
    Executable(std::io::Error),
    /// A query failed.
    #[error("query: {0}")]
    Query(String),
    /// A bad option.
    #[error("{0}")]
    Usage(String),
    /// A plot could not be written.
    #[error(transparent)]
    Plot(#[from] PlotError),
}

/// What one routing policy did.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyReport {
    /// The routing policy.
    pub routing: Routing,
    /// Requests routed.
    pub requests: u64,
    /// vLLM events published (a `BlockStored` per run, a `BlockRemoved` per block).
    pub events: u64,
    /// Wall seconds.
    pub seconds: f64,
    /// Query latency percentiles (µs): p50, p99.
    pub query_p50_us: f64,
    /// p99.
    pub query_p99_us: f64,
    /// Prefix-cache hit rate: blocks found cached on the chosen engine / blocks requested.
    pub hit_rate: f64,
    /// Answers equal to the engines' caches at the moment of the query.
    pub exact_answers: u64,
    /// Memberships the index held at the end, and the engines' caches' total.
    pub index_blocks: u64,
    /// The engines' total.
    pub engine_blocks: u64,
    /// The hit rate so far (%) as requests arrive: `(requests, hit rate)`.
    pub hit_curve: Vec<(f64, f64)>,
    /// The query latency distribution.
    pub latency_cdf: Cdf,
}

fn query_request(locals: &[kvatlas_hash::LocalBlockHash]) -> v1::QueryRequest {
    v1::QueryRequest {
        index: Some(v1::IndexSelector {
            model: MODEL.into(),
            tenant: String::new(),
        }),
        input: Some(query_request::Input::LocalHashes(v1::LocalHashes {
            hashes: locals.iter().map(|h| h.get()).collect(),
        })),
        ..v1::QueryRequest::default()
    }
}

async fn index_blocks(client: &mut IndexerClient<tonic::transport::Channel>) -> u64 {
    client
        .list_indexes(v1::ListIndexesRequest {
            model: MODEL.into(),
            tenant: String::new(),
        })
        .await
        .map(|r| r.into_inner().indexes.iter().map(|i| i.memberships).sum())
        .unwrap_or(0)
}

/// Runs one routing policy on a fresh server and fleet.
fn run_policy(
    args: &DemoArgs,
    kvatlas: &Path,
    trace: &[trace::TraceRequest],
    routing: Routing,
) -> Result<PolicyReport, DemoError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| DemoError::Usage(e.to_string()))?;
    let config = EngineConfig {
        block_tokens: BLOCK_TOKENS,
        ..EngineConfig::new(args.engines, args.capacity, Eviction::LeafFirst, 42)
    }
    .with_routing(routing);
    let publishers = Publishers::bind(args.engines)?;
    let workers: Vec<String> = publishers
        .endpoints()
        .iter()
        .map(|e| format!("{}={},replay={}", e.worker, e.live, e.replay))
        .collect();
    let serve_args: Vec<String> = [
        "--model",
        MODEL,
        "--block-size",
        &BLOCK_TOKENS.to_string(),
        "--workers",
        &workers.join(","),
    ]
    .map(str::to_owned)
    .to_vec();
    let server = ServeChild::start(kvatlas, &serve_args)?;
    publishers.wait_subscribed(1, Duration::from_secs(30))?;
    let mut client = runtime
        .block_on(IndexerClient::connect(server.url.clone()))
        .map_err(|e| DemoError::Query(e.to_string()))?;

    let bar = ProgressBar::new(trace.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:24}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(routing.name());

    let mut engines = Engines::new(&config);
    let mut router = Router::new(&config);
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
        .map_err(|e| DemoError::Usage(e.to_string()))?;
    let (mut events_published, mut exact, mut index_size) = (0u64, 0u64, 0u64);
    let mut events = Vec::<Mutation>::new();
    let mut tokens = Vec::new();
    let mut hit_curve = Vec::new();
    let start = Instant::now();
    let mut last_update = start;
    for (i, request) in trace.iter().enumerate() {
        let due = start + Duration::from_secs_f64(i as f64 / args.rate);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let prompt = engines.prompt(request);
        // The router asks the index.
        let asked = Instant::now();
        let answer = runtime
            .block_on(client.query(query_request(&prompt.locals)))
            .map_err(|status| DemoError::Query(status.message().to_owned()))?
            .into_inner();
        let _ = latency.record(asked.elapsed().as_nanos().max(1) as u64);
        let indexed: Vec<(u32, u32)> = answer
            .matches
            .iter()
            .filter(|m| m.device_blocks > 0)
            .filter_map(|m| Some((u32::try_from(m.instance_id).ok()?, m.device_blocks)))
            .collect();
        let truth = engines.scores(&prompt);
        if indexed == truth {
            exact += 1;
        }
        let w = router.route(&indexed);
        let score = truth
            .binary_search_by_key(&w, |&(ow, _)| ow)
            .map_or(0, |k| truth[k].1);
        events.clear();
        engines.serve(w, score, &prompt, &mut events);
        if !events.is_empty() {
            let ids: FxHashMap<u64, u64> = prompt
                .locals
                .iter()
                .zip(&request.hash_ids)
                .map(|(l, &id)| (l.get(), id))
                .collect();
            let batch = vllm::encode_batch(
                i as f64 / args.rate,
                &events,
                true,
                true,
                &mut tokens,
                |block, out| {
                    let id = ids.get(&block.local.get()).copied().unwrap_or_default();
                    block_tokens(id, BLOCK_TOKENS as usize, out);
                },
            );
            events_published += batch.stored_events + batch.removed_events;
            publishers.publish(w, batch.payload.into())?;
        }
        if (i + 1) % 50 == 0 || i + 1 == trace.len() {
            hit_curve.push(((i + 1) as f64, engines.stats().hit_rate() * 100.0));
        }
        if last_update.elapsed() >= Duration::from_millis(250) {
            last_update = Instant::now();
            index_size = runtime.block_on(index_blocks(&mut client));
            let seconds = start.elapsed().as_secs_f64();
            let stats = engines.stats();
            bar.set_position(i as u64 + 1);
            bar.set_message(format!(
                "{:>6.0} events/s {:>5.0} queries/s  query p50 {:>4.0} µs p99 {:>5.0} µs  hit rate {:>5.1} %  index {} blocks",
                events_published as f64 / seconds,
                (i + 1) as f64 / seconds,
                latency.value_at_quantile(0.5) as f64 / 1e3,
                latency.value_at_quantile(0.99) as f64 / 1e3,
                stats.hit_rate() * 100.0,
                index_size
            ));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    // Let the index catch up with the last events, then compare its size with the caches'.
    let engine_blocks = engines.stats().final_memberships;
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(5) {
        index_size = runtime.block_on(index_blocks(&mut client));
        if index_size == engine_blocks {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Close the connection first (its task lives on this runtime): a graceful stop waits for
    // open connections.
    drop(client);
    drop(runtime);
    server.stop();
    publishers.stop()?;
    let stats = engines.stats();
    Ok(PolicyReport {
        routing,
        requests: trace.len() as u64,
        events: events_published,
        seconds,
        query_p50_us: latency.value_at_quantile(0.5) as f64 / 1e3,
        query_p99_us: latency.value_at_quantile(0.99) as f64 / 1e3,
        hit_rate: stats.hit_rate(),
        exact_answers: exact,
        index_blocks: index_size,
        engine_blocks,
        hit_curve,
        latency_cdf: plot::cdf_of(&latency),
    })
}

/// The two policies side by side.
pub fn summary(reports: &[PolicyReport]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "| routing | requests | events | events/s | queries/s | query p50 / p99 | prefix-cache hit rate | answers equal to the engines' caches | index blocks at the end (engines) |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} / {:.0} µs | {:.1} % | {} of {} | {} ({}) |",
            r.routing.name(),
            r.requests,
            r.events,
            r.events as f64 / r.seconds,
            r.requests as f64 / r.seconds,
            r.query_p50_us,
            r.query_p99_us,
            r.hit_rate * 100.0,
            r.exact_answers,
            r.requests,
            r.index_blocks,
            r.engine_blocks
        );
    }
    if let [random, aware] = reports {
        let _ = writeln!(
            out,
            "\nKV-aware routing found {:.1} % of the prompt blocks already cached on the engine it \
             chose, random routing {:.1} %: {:.1}× as many blocks whose prefill was skipped. An \
             answer differs from the engines' caches only when it was asked before the index had \
             applied the previous request's events (freshness).",
            aware.hit_rate * 100.0,
            random.hit_rate * 100.0,
            if random.hit_rate > 0.0 {
                aware.hit_rate / random.hit_rate
            } else {
                0.0
            }
        );
    }
    out
}

/// Writes the hit-rate curves and the query latency CDFs of both policies into `dir`.
fn plots(dir: &Path, reports: &[PolicyReport]) -> Result<Vec<PathBuf>, DemoError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| DemoError::Usage(format!("creating {}: {e}", dir.display())))?;
    let curves: Vec<plot::Line> = reports
        .iter()
        .map(|r| (r.routing.name().to_owned(), r.hit_curve.clone()))
        .collect();
    let mut written = plot::lines(
        &dir.join("hit-rate"),
        "prefix-cache hit rate: KV-aware against random routing",
        Axes {
            x: "requests routed",
            y: "prompt blocks found cached (%)",
        },
        &curves,
    )?;
    let cdfs: Vec<(String, Cdf)> = reports
        .iter()
        .map(|r| (r.routing.name().to_owned(), r.latency_cdf.clone()))
        .collect();
    written.extend(plot::cdf(
        &dir.join("query-latency"),
        "the router's queries to kvatlas serve (gRPC)",
        "query latency (round trip)",
        &cdfs,
    )?);
    Ok(written)
}

/// Runs the demo (see the module docs) and returns the summary to print.
///
/// # Errors
/// If the trace cannot be read, the server cannot be started, or a query fails.
pub fn run(args: &DemoArgs) -> Result<String, DemoError> {
    if args.engines == 0 || args.capacity == 0 || args.rate <= 0.0 || args.requests == 0 {
        return Err(DemoError::Usage(
            "--engines, --capacity, --rate and --requests must be positive".into(),
        ));
    }
    let kvatlas = match &args.kvatlas {
        Some(path) => path.clone(),
        None => std::env::current_exe().map_err(DemoError::Executable)?,
    };
    let path = args.trace.clone().unwrap_or_else(trace::default_trace_path);
    let path = path.canonicalize().unwrap_or(path);
    let mut requests = trace::load_trace(&path)?;
    requests.truncate(args.requests);
    eprintln!(
        "kvatlas demo: {} engines ({} blocks of {} tokens each) publishing vLLM KV events on ZMQ, a \
         router replaying {} requests of {} at {} requests/s, kvatlas serve between them",
        args.engines,
        args.capacity,
        BLOCK_TOKENS,
        requests.len(),
        path.display(),
        args.rate
    );
    let mut reports = Vec::new();
    for routing in [Routing::Random, Routing::KvAware] {
        reports.push(run_policy(args, &kvatlas, &requests, routing)?);
    }
    let written = plots(&args.plots, &reports)?;
    let mut out = summary(&reports);
    if !written.is_empty() {
        let names: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
        out.push_str(&format!("\nPlots: {}\n", names.join(", ")));
    }
    Ok(out)
}
