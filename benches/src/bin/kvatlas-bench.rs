//! `kvatlas-bench`: the benchmark harness behind `cargo xtask bench`.
//!
//! Presets (the workloads of `docs/benchmarks.md`, those Dynamo's kv-router was measured on):
//! - `conversation` (Workload A): the Mooncake conversation trace through deterministic mock
//!   engines (one LRU prefix cache per worker, leaf-first and head-first eviction, random or
//!   KV-aware routing — by default random in both eviction modes plus KV-aware leaf-first), replayed
//!   (a) interleaved, every query checked against the engines' oracle, and (b) open loop against
//!   the concurrent write front, once or as a sweep of offered loads (threshold throughput);
//! - `synthetic` (Workload B): 1024 sequences × 1024 blocks, hit / partial / miss lookups and
//!   remove + store cycles, checked against the construction; twice: with engine hashes unique
//!   per sequence, and chained as engines make them (a worker's sequences of one group share
//!   their prefix blocks: the peer harness's shared-prefix cycle);
//! - `concurrent` (Workload C): one writer and one reader, alone and at once;
//! - `clear` (Workload D): replay the events, then one `Cleared` per worker, 3 rounds;
//! - `suite` (default): all four, the open loop as a sweep.
//!
//! `--trace-length-factor` and `--duplication-factor` transform the trace (after `--requests`)
//! before the mock engines, as Dynamo's `mooncake_bench` does.
//!
//! Markdown tables go to stdout, progress to stderr (hidden when it is not a terminal), results to
//! `--json`, plots to `--plot-dir`. Exits non-zero if any correctness check fails; an open-loop
//! run that does not keep up is reported as invalid, not as a failure.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvatlas_bench::clear::{self, ClearResult};
use kvatlas_bench::concurrent::{self, ConcurrentConfig, ConcurrentResult};
use kvatlas_bench::engine::{
    DEFAULT_LOAD_BOUND_PERCENT, EngineConfig, Eviction, LocalHashing, Routing, Stream, StreamStats,
    generate,
};
use kvatlas_bench::openloop::{
    FrontKind, KEEP_UP_FACTOR, OpenLoopConfig, OpenLoopResult, P99_JUMP, SweepSummary,
    run_open_loop, summarize, sweep_windows,
};
use kvatlas_bench::replay::{ReplayResult, backend_names, default_backends, run};
use kvatlas_bench::synthetic::{self, EngineHashes, SyntheticConfig, SyntheticResult};
use kvatlas_bench::trace::{
    TRACE_BLOCK_TOKENS, default_trace_path, duplicate, load_trace, scale_length,
};
use kvatlas_bench::{openloop, plot};

/// Which workloads to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Preset {
    /// Conversation + synthetic + concurrent + clear (the open loop as a sweep).
    Suite,
    /// Workload A: the Mooncake conversation trace through mock engines.
    Conversation,
    /// Workload B: 1024 × 1024 synthetic sequences.
    Synthetic,
    /// Workload C: one writer and one reader at once.
    Concurrent,
    /// Workload D: replay the events, then one `Cleared` per worker (3 rounds).
    Clear,
}

/// How the conversation preset replays its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Exact: each query checked against the oracle, then its events applied (one thread).
    Interleaved,
    /// Deadline-driven open loop through the concurrent write front.
    OpenLoop,
    /// Both.
    All,
}

/// Benchmarks kvatlas index backends on the workloads Dynamo's kv-router was measured on.
#[derive(Debug, Parser)]
struct Args {
    /// Smoke run (≈ 10-20 s, CI): 2,000 requests and 16 workers, a 3-step sweep, a smaller
    /// synthetic index, 0.3 s concurrent phases (each unless overridden).
    #[arg(long)]
    quick: bool,
    /// Workloads to run.
    #[arg(long, value_enum, default_value = "suite")]
    preset: Preset,
    /// Replay mode of the conversation preset.
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
    /// Backends to run, comma-separated (default: every registered backend except `reference`,
    /// which suits only tiny runs).
    #[arg(long, visible_alias = "compare", value_delimiter = ',')]
    backends: Vec<String>,
    /// Workers (default 128; 16 with --quick).
    #[arg(long)]
    workers: Option<u32>,
    /// Blocks each worker's cache holds.
    #[arg(long, default_value_t = 512)]
    capacity: usize,
    /// Eviction order of the mock engines (default: both, one table each).
    #[arg(long, value_enum)]
    eviction: Option<Eviction>,
    /// Request routing of the conversation preset (default: random with each eviction order,
    /// plus kv-aware with leaf-first eviction).
    #[arg(long, value_enum)]
    routing: Option<Routing>,
    /// KV-aware routing: a worker takes a request only if its request count then stays within
    /// this percentage of the mean (rounded up); 0 = unbounded (then the trace's shared first
    /// block sends every request to one worker).
    #[arg(long, default_value_t = DEFAULT_LOAD_BOUND_PERCENT)]
    load_bound_percent: u32,
    /// Split every trace hash id into k ids (h → h*k … h*k+k-1): k times the blocks per request.
    #[arg(long, default_value_t = 1)]
    trace_length_factor: u64,
    /// Replay d disjoint copies of the trace (ids offset by (max id + 1) × copy), interleaved by
    /// timestamp.
    #[arg(long, visible_alias = "trace-duplication-factor", default_value_t = 1)]
    duplication_factor: u64,
    /// Replay only the first N trace requests, before the length and duplication factors
    /// (default: all; 2,000 with --quick).
    #[arg(long)]
    requests: Option<usize>,
    /// Events-only passes per backend in the interleaved mode (median reported).
    #[arg(long, default_value_t = 5)]
    passes: usize,
    /// JSONL trace (default: the Mooncake conversation trace in data/traces/).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Seed of the request-to-worker assignment and the synthetic workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Open loop: the window the trace is rescaled to, in ms (single run, without --sweep).
    #[arg(long, default_value_t = 1000.0)]
    window_ms: f64,
    /// Open loop: sweep log-spaced windows from --sweep-max-ms (slow) to --sweep-min-ms (fast)
    /// (always on in the suite).
    #[arg(long)]
    sweep: bool,
    /// Fastest sweep window (ms).
    #[arg(long)]
    sweep_min_ms: Option<f64>,
    /// Slowest sweep window (ms).
    #[arg(long)]
    sweep_max_ms: Option<f64>,
    /// Sweep steps.
    #[arg(long)]
    sweep_steps: Option<usize>,
    /// Writer threads of the concurrent front (open loop and concurrent presets).
    #[arg(long, default_value_t = 1)]
    pool_threads: usize,
    /// Capacity of each writer lane (mutations).
    #[arg(long, default_value_t = 1024)]
    queue_capacity: usize,
    /// How a trace block's local hash is made: `tokens` (deterministic tokens hashed with
    /// kvatlas-hash, as a router does) or `splitmix` (Dynamo's harness's id mapping).
    #[arg(long, value_enum, default_value_t = LocalHashing::Tokens)]
    local_hashing: LocalHashing,
    /// How the concurrent front shares the index with readers.
    #[arg(long, value_enum, default_value_t = FrontKind::LeftRight)]
    front: FrontKind,
    /// Open loop: event issuer threads (workers split between them).
    #[arg(long, default_value_t = 1)]
    issuers: usize,
    /// Open loop: spin (instead of sleeping) this long before each deadline (µs).
    #[arg(long, default_value_t = 200)]
    spin_us: u64,
    /// Clear preset: rounds of (replay, clear all) on one index.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Concurrent preset: length of each phase (ms; default 3000, 300 with --quick).
    #[arg(long)]
    phase_ms: Option<u64>,
    /// Synthetic preset: sequences (default 1024; 256 with --quick).
    #[arg(long)]
    sequences: Option<usize>,
    /// Synthetic preset: blocks per sequence (default 1024; 512 with --quick).
    #[arg(long)]
    depth: Option<usize>,
    /// Synthetic preset: lookups per kind and remove + store cycles (default 1000; 200 with
    /// --quick).
    #[arg(long)]
    iterations: Option<usize>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write plots (SVG and PNG) of the open-loop runs into this directory.
    #[arg(long)]
    plot_dir: Option<PathBuf>,
}

/// One conversation configuration's stream summary and results, as written to `--json`.
#[derive(Debug, serde::Serialize)]
struct ConfigRun {
    config: EngineConfig,
    stream: StreamStats,
    /// `stream.hit_rate()`: blocks found in the assigned worker's cache / blocks requested.
    hit_rate: f64,
    events: u64,
    oracle_digest: u64,
    generate_secs: f64,
    interleaved: Vec<ReplayResult>,
    open_loop: Vec<OpenLoopResult>,
    sweep: Vec<SweepSummary>,
}

/// The whole `--json` document.
#[derive(Debug, Default, serde::Serialize)]
struct Report {
    trace: String,
    requests: usize,
    trace_length_factor: u64,
    duplication_factor: u64,
    conversation: Vec<ConfigRun>,
    synthetic: Option<(SyntheticConfig, Vec<SyntheticResult>)>,
    /// The same with chained engine hashes (the shared-prefix cycle, the peer's Workload B).
    synthetic_chained: Option<(SyntheticConfig, Vec<SyntheticResult>)>,
    concurrent: Option<(ConcurrentConfig, Vec<ConcurrentResult>)>,
    clear: Option<(EngineConfig, Vec<ClearResult>)>,
}

/// Prints to stdout without tearing the progress bar.
fn out(bar: &ProgressBar, text: &str) {
    bar.suspend(|| println!("{text}"));
}

fn us(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.0} ms", ns as f64 / 1e6)
    } else if ns >= 100_000 {
        format!("{:.0} µs", ns as f64 / 1e3)
    } else {
        format!("{:.2} µs", ns as f64 / 1e3)
    }
}

fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

fn routing_text(c: &EngineConfig) -> String {
    match c.routing {
        Routing::Random => format!("routing=random seed={}", c.seed),
        Routing::KvAware if c.load_bound_percent == 0 => "routing=kv-aware (unbounded)".into(),
        Routing::KvAware => format!(
            "routing=kv-aware (load ≤ {} % of mean)",
            c.load_bound_percent
        ),
    }
}

fn stream_text(stream: &Stream, generate_secs: f64) -> String {
    let s = &stream.stats;
    let c = &stream.config;
    format!(
        "\n### Conversation (Workload A): W={} C={} eviction={} {}\n\n\
         Stream ({:.2} s to generate): {} requests ({} hit some worker, {} blocks; **cache hit \
         rate {:.2} %** = {} blocks found in the assigned worker's cache / blocks requested; busiest \
         worker {} requests, mean {:.0}), {} events \
         ({} Stored / {} Removed; {} blocks stored, {} removed), {} evictions leaving a \
         cached child, {} requests with holes, {} final (worker, block) pairs, oracle digest {:016x}.",
        c.workers,
        c.capacity,
        c.eviction.name(),
        routing_text(c),
        generate_secs,
        stream.queries.len(),
        s.queries_hit,
        s.query_blocks,
        s.hit_rate() * 100.0,
        s.assigned_hit_blocks,
        s.max_worker_requests,
        stream.queries.len() as f64 / f64::from(c.workers),
        stream.events.len(),
        s.stored_events,
        s.removed_events,
        s.blocks_stored,
        s.blocks_removed,
        s.orphaning_evictions,
        s.requests_with_holes,
        s.final_memberships,
        stream.oracle_digest,
    )
}

const INTERLEAVED_HEADER: &str = "\n#### Interleaved replay (exact, oracle-checked)\n\n\
    | backend | requests | events | events/s | blocks/s | find p50 | p99 | p99.9 | max \
    | find/s (1/mean) | mismatches | misrouted | state | heap MB | B/membership | digest |\n\
    |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

fn interleaved_row(r: &ReplayResult) -> String {
    format!(
        "| {} | {} | {} | {:.0}k | {:.2}M | {} | {} | {} | {} | {:.0}k | {} | {} | {} | {:.1} | {:.0} | {:016x} |",
        r.backend,
        r.requests,
        r.events,
        r.events_per_s / 1e3,
        r.blocks_per_s / 1e6,
        us(r.find.p50_ns),
        us(r.find.p99_ns),
        us(r.find.p999_ns),
        us(r.find.max_ns),
        r.find_per_s / 1e3,
        r.mismatches,
        r.routing_disagreements,
        if r.state_matches { "ok" } else { "WRONG" },
        r.heap_bytes as f64 / 1e6,
        r.bytes_per_membership,
        r.digest,
    )
}

fn open_loop_header(config: &OpenLoopConfig) -> String {
    format!(
        "\n#### Open loop (deadline-driven; ThreadPool over {:?}<backend>, or over \
         the concurrent form of atlas and crtc, {} writer thread(s), \
         lanes of {}, {} issuer(s); latency = completion − deadline)\n\n\
         | backend | window | offered ops/s | achieved ops/s | offered blk ops/s | achieved blk ops/s \
         | completion / window | valid | p50 | p99 | p99.9 | max | service p50 / p99 \
         | issue lag p50 / p99 | backpressure waits | drain | state |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        config.front, config.pool_threads, config.queue_capacity, config.issuers
    )
}

fn open_loop_row(r: &OpenLoopResult) -> String {
    let (offered, achieved, offered_blk, achieved_blk) = if r.kept_up {
        (
            si(r.offered_ops_per_s),
            si(r.achieved_ops_per_s),
            si(r.offered_block_ops_per_s),
            si(r.achieved_block_ops_per_s),
        )
    } else {
        (
            si(r.offered_ops_per_s),
            format!("({})", si(r.achieved_ops_per_s)),
            si(r.offered_block_ops_per_s),
            format!("({})", si(r.achieved_block_ops_per_s)),
        )
    };
    format!(
        "| {} | {:.1} ms | {} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} |",
        r.backend,
        r.config.window.as_secs_f64() * 1e3,
        offered,
        achieved,
        offered_blk,
        achieved_blk,
        r.completion_ratio,
        if r.kept_up { "kept up" } else { "**invalid**" },
        us(r.latency.p50_ns),
        us(r.latency.p99_ns),
        us(r.latency.p999_ns),
        us(r.latency.max_ns),
        us(r.service.p50_ns),
        us(r.service.p99_ns),
        us(r.issue_lag.p50_ns),
        us(r.issue_lag.p99_ns),
        r.backpressure_waits,
        us((r.drain_secs * 1e9) as u64),
        if r.is_correct() { "ok" } else { "WRONG" },
    )
}

fn sweep_text(summaries: &[SweepSummary]) -> String {
    let mut text = format!(
        "\n#### Sweep summary\n\nThreshold = the highest offered load completed within \
         {KEEP_UP_FACTOR:.2}× its window; p99 jump = the lowest offered load whose p99 is ≥ \
         {P99_JUMP:.0}× the p99 at the lowest load.\n\n\
         | backend | threshold ops/s | threshold block ops/s | p99 at threshold | p99 jumps at (ops/s) | runs with a wrong final state |\n\
         |---|---|---|---|---|---|"
    );
    for s in summaries {
        let _ = write!(
            text,
            "\n| {} | {} | {} | {} | {} | {} |",
            s.backend,
            s.threshold_ops_per_s.map_or("none kept up".into(), si),
            s.threshold_block_ops_per_s.map_or("–".into(), si),
            s.threshold_p99_ns.map_or("–".into(), us),
            s.p99_jump_ops_per_s.map_or("no jump".into(), si),
            s.incorrect_runs,
        );
    }
    text
}

fn synthetic_text(config: &SyntheticConfig, results: &[SyntheticResult]) -> String {
    let hashes = match config.engine_hashes {
        EngineHashes::Unique => "engine hashes unique per sequence",
        EngineHashes::Chained => {
            "engine hashes chained, so a worker's sequences of one group share their prefix \
             blocks (the peer harness's Workload B: each cycle takes the prefix from under the \
             worker's other sequences of the group and gives it back)"
        }
    };
    let mut text = format!(
        "\n### Synthetic (Workload B): {} sequences × {} blocks, {} workers, {} shared blocks in {} \
         groups, {hashes}; {} lookups per kind (first 10 % discarded), {} remove + store \
         cycles\n\n\
         | backend | build M blocks/s | store p50 / p99 | remove p50 / p99 | hit p50 / p99 \
         | partial p50 / p99 | miss p50 / p99 | heap MB | B/membership | memberships | mismatches |\n\
         |---|---|---|---|---|---|---|---|---|---|---|",
        config.sequences,
        config.depth,
        config.workers,
        config.shared,
        config.groups,
        config.iterations,
        config.cycles
    );
    for r in results {
        let _ = write!(
            text,
            "\n| {} | {:.2} | {} / {} | {} / {} | {} / {} | {} / {} | {} / {} | {:.1} | {:.0} | {} | {} / {} |",
            r.backend,
            r.build_blocks_per_s / 1e6,
            us(r.store.p50_ns),
            us(r.store.p99_ns),
            us(r.remove.p50_ns),
            us(r.remove.p99_ns),
            us(r.hit.p50_ns),
            us(r.hit.p99_ns),
            us(r.partial.p50_ns),
            us(r.partial.p99_ns),
            us(r.miss.p50_ns),
            us(r.miss.p99_ns),
            r.heap_bytes as f64 / 1e6,
            r.bytes_per_membership,
            r.memberships,
            r.mismatches,
            r.checked,
        );
    }
    text
}

fn concurrent_text(
    stream: &Stream,
    config: &ConcurrentConfig,
    results: &[ConcurrentResult],
) -> String {
    let mut text = format!(
        "\n### Concurrent (Workload C): W={} C={} {} stream + drain looped; {} ms per phase; \
         ThreadPool over {:?}<backend>, or over the concurrent form of atlas and crtc, \
         with {} writer thread(s), \
         flush every {} events; one reader\n\n\
         | backend | events/s alone → concurrent | finds/s alone → concurrent | find p99 alone → concurrent \
         | find p50 conc. | find p99.9 conc. | find max conc. | state |\n\
         |---|---|---|---|---|---|---|---|",
        stream.config.workers,
        stream.config.capacity,
        stream.config.eviction.name(),
        config.phase_ms,
        config.front,
        config.pool_threads,
        config.flush_every
    );
    for r in results {
        let _ = write!(
            text,
            "\n| {} | {} → {} | {} → {} | {} → {} | {} | {} | {} | {} |",
            r.backend,
            si(r.events_alone_per_s),
            si(r.events_concurrent_per_s),
            si(r.finds_alone_per_s),
            si(r.finds_concurrent_per_s),
            us(r.find_alone.p99_ns),
            us(r.find_concurrent.p99_ns),
            us(r.find_concurrent.p50_ns),
            us(r.find_concurrent.p999_ns),
            us(r.find_concurrent.max_ns),
            if r.is_correct() { "ok" } else { "WRONG" },
        );
    }
    text
}

fn clear_text(stream: &Stream, results: &[ClearResult]) -> String {
    let rounds = results.first().map_or(0, |r| r.replay_ms.len());
    let mut text = format!(
        "\n### Clear (Workload D): W={} C={} {} stream ({} events, {} final memberships); per \
         round on one index: replay the events, then one `Cleared` per worker; {rounds} rounds, \
         median (min–max) ms\n\n\
         | backend | replay ms | clear-all ms | per `Cleared` µs | after clear-all |\n\
         |---|---|---|---|---|",
        stream.config.workers,
        stream.config.capacity,
        stream.config.eviction.name(),
        stream.events.len(),
        stream.stats.final_memberships,
    );
    let spread = |values: &[f64], median: f64| {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(0.0, f64::max);
        format!("{median:.2} ({min:.2}–{max:.2})")
    };
    for r in results {
        let _ = write!(
            text,
            "\n| {} | {} | {} | {:.1} | {} |",
            r.backend,
            spread(&r.replay_ms, r.replay_ms_median),
            spread(&r.clear_all_ms, r.clear_all_ms_median),
            r.clear_all_ms_median * 1e3 / f64::from(r.workers.max(1)),
            if r.is_correct() {
                "empty (0 memberships, 0 answers)".to_string()
            } else {
                format!(
                    "**WRONG**: {:?} memberships, {} answers",
                    r.memberships_after_clear, r.answers_after_clear
                )
            },
        );
    }
    text
}

fn progress(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}

fn main() -> Result<()> {
    let args = Args::parse();
    let backends: Vec<String> = if args.backends.is_empty() {
        default_backends().into_iter().map(String::from).collect()
    } else {
        args.backends.clone()
    };
    for name in &backends {
        if !backend_names().contains(&name.as_str()) {
            bail!(
                "unknown backend `{name}` (available: {})",
                backend_names().join(", ")
            );
        }
    }
    let quick = args.quick;
    let workers = args.workers.unwrap_or(if quick { 16 } else { 128 });
    if workers == 0 || args.capacity == 0 {
        bail!("--workers and --capacity must be positive");
    }
    let suite = args.preset == Preset::Suite;
    let run_conversation = suite || args.preset == Preset::Conversation;
    let run_synthetic = suite || args.preset == Preset::Synthetic;
    let run_concurrent = suite || args.preset == Preset::Concurrent;
    let run_clear = suite || args.preset == Preset::Clear;
    if args.load_bound_percent != 0 && args.load_bound_percent < 100 {
        bail!("--load-bound-percent must be 0 (unbounded) or at least 100");
    }
    let interleaved = args.mode != Mode::OpenLoop;
    let open_loop = args.mode != Mode::Interleaved;
    let sweep = suite || args.sweep;
    let windows: Vec<Duration> = if sweep {
        let (min, max, steps) = if quick {
            (20.0, 500.0, 3)
        } else {
            (20.0, 4000.0, 8)
        };
        sweep_windows(
            Duration::from_secs_f64(args.sweep_min_ms.unwrap_or(min) / 1e3),
            Duration::from_secs_f64(args.sweep_max_ms.unwrap_or(max) / 1e3),
            args.sweep_steps.unwrap_or(steps),
        )
    } else {
        vec![Duration::from_secs_f64(args.window_ms.max(0.0) / 1e3)]
    };
    let evictions: Vec<Eviction> = args.eviction.map_or(Eviction::ALL.to_vec(), |e| vec![e]);
    let engine = |eviction, routing| EngineConfig {
        load_bound_percent: args.load_bound_percent,
        local_hashing: args.local_hashing,
        block_tokens: (TRACE_BLOCK_TOKENS as u64 / args.trace_length_factor.max(1)).max(1) as u32,
        ..EngineConfig::new(workers, args.capacity, eviction, args.seed).with_routing(routing)
    };
    // Conversation configurations: the chosen routing with each eviction order; by default random
    // routing with each, plus KV-aware routing with the first (leaf-first unless chosen).
    let mut configs: Vec<EngineConfig> = evictions
        .iter()
        .map(|&e| engine(e, args.routing.unwrap_or(Routing::Random)))
        .collect();
    if args.routing.is_none() {
        configs.push(engine(evictions[0], Routing::KvAware));
    }
    let limit = args.requests.or(if quick { Some(2_000) } else { None });
    let synthetic_config = SyntheticConfig {
        sequences: args.sequences.unwrap_or(if quick { 256 } else { 1024 }),
        depth: args.depth.unwrap_or(if quick { 512 } else { 1024 }),
        iterations: args.iterations.unwrap_or(if quick { 200 } else { 1000 }),
        cycles: args.iterations.unwrap_or(if quick { 200 } else { 1000 }),
        seed: args.seed,
        ..SyntheticConfig::default()
    };
    if synthetic_config.shared > synthetic_config.depth {
        bail!("--depth must be at least {}", synthetic_config.shared);
    }
    let concurrent_config = ConcurrentConfig {
        phase_ms: args.phase_ms.unwrap_or(if quick { 300 } else { 3000 }),
        pool_threads: args.pool_threads,
        queue_capacity: args.queue_capacity,
        front: args.front,
        ..ConcurrentConfig::default()
    };
    let ol_config = |window| OpenLoopConfig {
        window,
        pool_threads: args.pool_threads,
        queue_capacity: args.queue_capacity,
        front: args.front,
        issuers: args.issuers,
        spin: Duration::from_micros(args.spin_us),
    };
    if let Some(dir) = &args.plot_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }

    let n = backends.len() as u64;
    let mut units = 0u64;
    if run_conversation {
        let per_mode = u64::from(interleaved) + if open_loop { windows.len() as u64 } else { 0 };
        units += configs.len() as u64 * n * per_mode;
    }
    units += n * (2 * u64::from(run_synthetic) + u64::from(run_concurrent) + u64::from(run_clear));
    let bar = progress(units);

    let needs_trace = run_conversation || run_concurrent || run_clear;
    let path = args.trace.clone().unwrap_or_else(default_trace_path);
    let mut trace = if needs_trace {
        load_trace(&path)?
    } else {
        Vec::new()
    };
    if let Some(limit) = limit {
        trace.truncate(limit);
    }
    let trace_requests = trace.len();
    scale_length(&mut trace, args.trace_length_factor)?;
    let trace = duplicate(trace, args.duplication_factor)?;
    out(
        &bar,
        &format!(
            "## kvatlas-bench ({}; trace {}, {} requests{}; backends {})\n\n\
             Machine: 2 shared vCPUs — other processes (builds) may run at the same time: \
             figures are noisy, compare medians of repeated runs.",
            if quick { "quick" } else { "standard" },
            path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            trace.len(),
            if args.trace_length_factor > 1 || args.duplication_factor > 1 {
                format!(
                    " = {trace_requests} × duplication factor {}, trace-length factor {}",
                    args.duplication_factor, args.trace_length_factor
                )
            } else {
                String::new()
            },
            backends
                .iter()
                .map(|b| kvatlas_bench::replay::labelled(b))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );

    let mut report = Report {
        trace: path.display().to_string(),
        requests: trace.len(),
        trace_length_factor: args.trace_length_factor,
        duplication_factor: args.duplication_factor,
        ..Report::default()
    };
    let mut failures = Vec::new();

    if run_conversation {
        if interleaved {
            out(
                &bar,
                &format!(
                    "\nInterleaved: events/s and blocks/s from an events-only pass on a fresh \
                     index (median of {}); find: one thread, timer cost included; heap: \
                     `stats().heap_bytes`; state = the final snapshot equals the engines' caches; \
                     misrouted = queries the router, fed the backend's answer, would send to another \
                     worker than the stream did (KV-aware routing; must be 0).",
                    args.passes.max(1)
                ),
            );
        }
        for &config in &configs {
            let label = format!("{} {}", config.eviction.name(), config.routing.name());
            let start = Instant::now();
            let stream = generate(&trace, &config);
            let generate_secs = start.elapsed().as_secs_f64();
            out(&bar, &stream_text(&stream, generate_secs));
            let mut results = Vec::new();
            if interleaved {
                out(&bar, INTERLEAVED_HEADER);
                for name in &backends {
                    bar.set_message(format!("{label} interleaved {name}"));
                    let result = run(name, &stream, args.passes)
                        .with_context(|| format!("backend `{name}` vanished"))?;
                    bar.inc(1);
                    out(&bar, &interleaved_row(&result));
                    if !result.is_correct() {
                        failures.push(format!(
                            "{name} ({label}) interleaved: {} mismatching (query, worker) scores \
                             in {} queries, {} routing decisions differing from the oracle's, \
                             digest {:016x} vs oracle {:016x}, memberships {} / {} vs {}, \
                             final state {}",
                            result.mismatches,
                            result.mismatched_queries,
                            result.routing_disagreements,
                            result.digest,
                            stream.oracle_digest,
                            result.memberships,
                            result.replay_memberships,
                            result.expected_memberships,
                            if result.state_matches { "ok" } else { "wrong" },
                        ));
                    }
                    if result.anomalies > 0 {
                        bar.suspend(|| {
                            eprintln!(
                                "warning: {name} ({label}) reported {} anomalies on a clean stream",
                                result.anomalies
                            );
                        });
                    }
                    results.push(result);
                }
            }
            let mut open = Vec::new();
            let mut summaries = Vec::new();
            if open_loop {
                out(&bar, &open_loop_header(&ol_config(windows[0])));
                for name in &backends {
                    for &window in &windows {
                        bar.set_message(format!(
                            "{label} open loop {name} {:.1} ms",
                            window.as_secs_f64() * 1e3
                        ));
                        let result = run_open_loop(name, &stream, &ol_config(window))?;
                        bar.inc(1);
                        out(&bar, &open_loop_row(&result));
                        if !result.is_correct() {
                            failures.push(format!(
                                "{name} ({label}) open loop {:.1} ms: final memberships {} vs {} \
                                 expected, state digest {}, {} anomalies",
                                window.as_secs_f64() * 1e3,
                                result.memberships,
                                result.expected_memberships,
                                if result.state_matches { "ok" } else { "wrong" },
                                result.anomalies,
                            ));
                        }
                        open.push(result);
                    }
                    summaries.push(summarize(name, &open));
                }
                if sweep {
                    out(&bar, &sweep_text(&summaries));
                }
                if let Some(dir) = &args.plot_dir {
                    let files = plots(dir, &stream, &open, &backends, sweep)?;
                    out(
                        &bar,
                        &format!(
                            "\nPlots: {}",
                            files
                                .iter()
                                .map(|f| f.display().to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    );
                }
            }
            report.conversation.push(ConfigRun {
                config,
                stream: stream.stats,
                hit_rate: stream.stats.hit_rate(),
                events: stream.events.len() as u64,
                oracle_digest: stream.oracle_digest,
                generate_secs,
                interleaved: results,
                open_loop: open,
                sweep: summaries,
            });
        }
    }

    for engine_hashes in [EngineHashes::Unique, EngineHashes::Chained] {
        if !run_synthetic {
            break;
        }
        let synthetic_config = SyntheticConfig {
            engine_hashes,
            ..synthetic_config
        };
        bar.set_message("synthetic: generating");
        let workload = synthetic::generate(&synthetic_config);
        let mut results = Vec::new();
        for name in &backends {
            bar.set_message(format!("synthetic {name}"));
            let result = synthetic::run(name, &workload)
                .with_context(|| format!("backend `{name}` vanished"))?;
            bar.inc(1);
            if !result.is_correct() {
                failures.push(format!(
                    "{name} synthetic ({engine_hashes:?} engine hashes): {} of {} answers differ \
                     from the construction oracle, memberships {} / {} vs {}, {} anomalies vs {}",
                    result.mismatches,
                    result.checked,
                    result.memberships,
                    result.memberships_after_cycles,
                    result.expected_memberships,
                    result.anomalies,
                    result.expected_anomalies
                ));
            }
            results.push(result);
        }
        drop(workload);
        out(&bar, &synthetic_text(&synthetic_config, &results));
        match engine_hashes {
            EngineHashes::Unique => report.synthetic = Some((synthetic_config, results)),
            EngineHashes::Chained => report.synthetic_chained = Some((synthetic_config, results)),
        }
    }

    // Workloads C and D use Workload A's stream: random routing, leaf-first eviction.
    let base_stream = (run_concurrent || run_clear)
        .then(|| generate(&trace, &engine(Eviction::LeafFirst, Routing::Random)));
    if let (true, Some(stream)) = (run_concurrent, &base_stream) {
        let mut results = Vec::new();
        for name in &backends {
            bar.set_message(format!("concurrent {name}"));
            let result = concurrent::run(name, stream, &concurrent_config)?;
            bar.inc(1);
            if !result.is_correct() {
                failures.push(format!(
                    "{name} concurrent: final state {}, {} anomalies",
                    if result.state_matches { "ok" } else { "wrong" },
                    result.anomalies
                ));
            }
            results.push(result);
        }
        out(&bar, &concurrent_text(stream, &concurrent_config, &results));
        report.concurrent = Some((concurrent_config, results));
    }

    if let (true, Some(stream)) = (run_clear, &base_stream) {
        let mut results = Vec::new();
        for name in &backends {
            bar.set_message(format!("clear {name}"));
            let result = clear::run(name, stream, args.rounds)
                .with_context(|| format!("backend `{name}` vanished"))?;
            bar.inc(1);
            if !result.is_correct() {
                failures.push(format!(
                    "{name} clear: memberships before clear {:?} (expected {}), after clear {:?}, \
                     {} non-empty answers after clearing, state {}, {} anomalies",
                    result.memberships_before_clear,
                    result.expected_memberships,
                    result.memberships_after_clear,
                    result.answers_after_clear,
                    if result.state_matches { "ok" } else { "wrong" },
                    result.anomalies
                ));
            }
            results.push(result);
        }
        out(&bar, &clear_text(stream, &results));
        report.clear = Some((stream.config, results));
    }
    bar.finish_and_clear();

    if let Some(json) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(json, text).with_context(|| format!("writing {}", json.display()))?;
    }
    if !failures.is_empty() {
        for failure in &failures {
            eprintln!("MISMATCH: {failure}");
        }
        bail!("{} correctness check(s) failed", failures.len());
    }
    Ok(())
}

/// Writes the sweep plot and the latency CDF of one conversation configuration.
fn plots(
    dir: &std::path::Path,
    stream: &Stream,
    runs: &[OpenLoopResult],
    backends: &[String],
    sweep: bool,
) -> Result<Vec<PathBuf>> {
    let c = &stream.config;
    let tag = format!(
        "W{}-C{}-{}-{}",
        c.workers,
        c.capacity,
        c.eviction.name(),
        c.routing.name()
    );
    let mut files = Vec::new();
    if sweep {
        files.extend(plot::sweep(
            &dir.join(format!("sweep-{tag}")),
            &format!(
                "Open loop, conversation trace W={} C={} {} {}: achieved vs offered (p99 dashed)",
                c.workers,
                c.capacity,
                c.eviction.name(),
                c.routing.name()
            ),
            runs,
        )?);
    }
    // CDFs at one common offered load: the highest every backend kept up with (else the lowest).
    let mut loads: Vec<f64> = runs.iter().map(|r| r.offered_ops_per_s).collect();
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    let common = loads
        .iter()
        .rev()
        .find(|&&load| {
            backends.iter().all(|b| {
                runs.iter()
                    .any(|r| &r.backend == b && r.offered_ops_per_s == load && r.kept_up)
            })
        })
        .or(loads.first())
        .copied();
    let curves: Vec<(String, openloop::Cdf)> = runs
        .iter()
        .filter(|r| Some(r.offered_ops_per_s) == common)
        .map(|r| {
            (
                format!(
                    "{} @ {} ops/s ({})",
                    r.backend,
                    si(r.offered_ops_per_s),
                    if r.kept_up { "kept up" } else { "invalid" }
                ),
                r.cdf.clone(),
            )
        })
        .collect();
    files.extend(plot::cdf(
        &dir.join(format!("cdf-{tag}")),
        &format!(
            "Query latency CDF (deadline → completion), W={} C={} {} {}",
            c.workers,
            c.capacity,
            c.eviction.name(),
            c.routing.name()
        ),
        "latency from deadline to completion",
        &curves,
    )?);
    Ok(files)
}
