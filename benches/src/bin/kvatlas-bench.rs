//! `kvatlas-bench`: the trace-replay harness behind `cargo xtask bench`.
//!
//! Runs a Mooncake trace through deterministic mock engines (one LRU prefix cache per worker),
//! then replays the resulting queries and KV events against each chosen index backend, checking
//! every query's per-worker device scores against the engines' oracle. Prints a markdown table per
//! configuration; exits non-zero if any backend disagrees with the oracle.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvatlas_bench::engine::{EngineConfig, Eviction, Stream, StreamStats, generate};
use kvatlas_bench::replay::{ReplayResult, backend_names, default_backends, run};
use kvatlas_bench::trace::{default_trace_path, load_trace};

/// Replays a Mooncake-style trace through mock engines against kvatlas index backends.
#[derive(Debug, Parser)]
struct Args {
    /// Smoke run (a few seconds): the first 2,000 requests and 16 workers unless overridden.
    #[arg(long)]
    quick: bool,
    /// Backends to run, comma-separated (default: every registered backend except `reference`).
    #[arg(long, value_delimiter = ',')]
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
    /// Replay only the first N requests (default: all; 2,000 with --quick).
    #[arg(long)]
    requests: Option<usize>,
    /// Events-only passes per backend (fresh index each; the median is reported).
    #[arg(long, default_value_t = 5)]
    passes: usize,
    /// JSONL trace (default: the shared Mooncake conversation trace).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Seed of the request-to-worker assignment.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One configuration's stream summary and results, as written to `--json`.
#[derive(Debug, serde::Serialize)]
struct ConfigRun {
    config: EngineConfig,
    stream: StreamStats,
    events: u64,
    oracle_digest: u64,
    generate_secs: f64,
    results: Vec<ReplayResult>,
}

/// The whole `--json` document.
#[derive(Debug, serde::Serialize)]
struct Report {
    trace: String,
    requests: usize,
    runs: Vec<ConfigRun>,
}

fn print_stream(stream: &Stream, generate_secs: f64) {
    let s = &stream.stats;
    let c = &stream.config;
    println!(
        "\n### W={} C={} eviction={} seed={}\n",
        c.workers,
        c.capacity,
        c.eviction.name(),
        c.seed
    );
    println!(
        "Stream ({:.2} s to generate): {} requests ({} hit some worker, {} blocks), {} events \
         ({} Stored / {} Removed; {} blocks stored, {} removed), {} evictions leaving a \
         cached child, {} requests with holes, {} final (worker, block) pairs, oracle digest {:016x}.\n",
        generate_secs,
        stream.queries.len(),
        s.queries_hit,
        s.query_blocks,
        stream.events.len(),
        s.stored_events,
        s.removed_events,
        s.blocks_stored,
        s.blocks_removed,
        s.orphaning_evictions,
        s.requests_with_holes,
        s.final_memberships,
        stream.oracle_digest,
    );
    println!(
        "| backend | requests | events | events/s | blocks/s | find p50 | p99 | p99.9 | max \
         | find/s (1/mean) | mismatches | heap MB | B/membership | digest |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
}

fn us(ns: u64) -> String {
    format!("{:.2} µs", ns as f64 / 1e3)
}

fn print_row(r: &ReplayResult) {
    println!(
        "| {} | {} | {} | {:.0}k | {:.2}M | {} | {} | {} | {} | {:.0}k | {} | {:.1} | {:.0} | {:016x} |",
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
        r.heap_bytes as f64 / 1e6,
        r.bytes_per_membership,
        r.digest,
    );
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
    let workers = args.workers.unwrap_or(if args.quick { 16 } else { 128 });
    if workers == 0 || args.capacity == 0 {
        bail!("--workers and --capacity must be positive");
    }
    let limit = args
        .requests
        .or(if args.quick { Some(2_000) } else { None });
    let modes: Vec<Eviction> = args.eviction.map_or(Eviction::ALL.to_vec(), |e| vec![e]);

    let path = args.trace.clone().unwrap_or_else(default_trace_path);
    let mut trace = load_trace(&path)?;
    if let Some(limit) = limit {
        trace.truncate(limit);
    }
    println!(
        "## kvatlas-bench: trace replay ({}, {} requests)",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into()
        ),
        trace.len()
    );
    println!(
        "\nevents/s and blocks/s: events-only pass on a fresh index (median of {}); find: \
         interleaved replay, one thread, timer cost included; heap: `stats().heap_bytes` at the \
         end; B/membership = heap / final (worker, block) pairs.",
        args.passes.max(1)
    );

    let mut report = Report {
        trace: path.display().to_string(),
        requests: trace.len(),
        runs: Vec::new(),
    };
    let mut failures = Vec::new();
    for eviction in modes {
        let config = EngineConfig {
            workers,
            capacity: args.capacity,
            eviction,
            seed: args.seed,
        };
        let start = Instant::now();
        let stream = generate(&trace, &config);
        let generate_secs = start.elapsed().as_secs_f64();
        print_stream(&stream, generate_secs);
        let mut results = Vec::new();
        for name in &backends {
            let result = run(name, &stream, args.passes)
                .with_context(|| format!("backend `{name}` vanished from the registry"))?;
            print_row(&result);
            if !result.is_correct() {
                failures.push(format!(
                    "{name} ({}): {} mismatching (query, worker) scores in {} queries, digest \
                     {:016x} vs oracle {:016x}, memberships {} / {} (replay) vs {} expected",
                    eviction.name(),
                    result.mismatches,
                    result.mismatched_queries,
                    result.digest,
                    stream.oracle_digest,
                    result.memberships,
                    result.replay_memberships,
                    result.expected_memberships,
                ));
            }
            if result.anomalies > 0 {
                eprintln!(
                    "warning: {name} ({}) reported {} anomalies on a clean stream",
                    eviction.name(),
                    result.anomalies
                );
            }
            results.push(result);
        }
        report.runs.push(ConfigRun {
            config,
            stream: stream.stats,
            events: stream.events.len() as u64,
            oracle_digest: stream.oracle_digest,
            generate_secs,
            results,
        });
    }

    if let Some(json) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(json, text).with_context(|| format!("writing {}", json.display()))?;
    }
    if !failures.is_empty() {
        for failure in &failures {
            eprintln!("MISMATCH: {failure}");
        }
        bail!(
            "{} backend run(s) disagreed with the oracle",
            failures.len()
        );
    }
    Ok(())
}
