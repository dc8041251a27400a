//! Runs a `kvatlas-bench` [`Plan`]: loads and transforms the trace, runs each chosen workload on
//! each backend (one function per preset), prints the markdown of [`crate::render`] to stdout
//! (progress to stderr, hidden when it is not a terminal), writes the `--json` report and returns
//! the failed correctness checks.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::clear::{self, ClearResult};
use crate::concurrent::{self, ConcurrentConfig, ConcurrentResult};
use crate::engine::{EngineConfig, Stream, StreamStats, generate};
use crate::openloop::{OpenLoopConfig, OpenLoopResult, SweepSummary, run_open_loop, summarize};
use crate::render::{
    INTERLEAVED_HEADER, clear_text, concurrent_text, interleaved_row, open_loop_header,
    open_loop_row, plots, stream_text, sweep_text, synthetic_text,
};
use crate::replay::{self, ReplayResult};
use crate::synthetic::{self, EngineHashes, SyntheticConfig, SyntheticResult};
use crate::trace::{TraceRequest, duplicate, load_trace, scale_length};

/// What one `kvatlas-bench` invocation runs, resolved from its command line by [`crate::cli`]:
/// every `--quick` default is applied and every value checked.
#[derive(Debug, Clone)]
pub struct Plan {
    /// A smoke run (only labels the header: the sizes below are resolved already).
    pub quick: bool,
    /// The backends to run, in order (registered names).
    pub backends: Vec<String>,
    /// The trace and its transformation (loaded only when a workload replays it).
    pub trace: TracePlan,
    /// Workload A: the conversation trace through mock engines.
    pub conversation: Option<ConversationPlan>,
    /// Workload B: the synthetic index, run twice (engine hashes unique, then chained; its
    /// `engine_hashes` is ignored).
    pub synthetic: Option<SyntheticConfig>,
    /// Workloads C and D, on one stream of the trace.
    pub base: Option<BasePlan>,
    /// Write the results as JSON to this file.
    pub json: Option<PathBuf>,
}

/// The trace a plan replays and how it is transformed.
#[derive(Debug, Clone)]
pub struct TracePlan {
    /// The JSONL trace.
    pub path: PathBuf,
    /// Keep only the first N requests, before the factors (all if `None`).
    pub requests: Option<usize>,
    /// Split every hash id into this many ids ([`scale_length`]).
    pub length_factor: u64,
    /// Replay this many disjoint copies, interleaved by timestamp ([`duplicate`]).
    pub duplication_factor: u64,
}

/// Workload A: its engine configurations and how each stream is replayed.
#[derive(Debug, Clone)]
pub struct ConversationPlan {
    /// One stream, and one set of tables, per configuration.
    pub configs: Vec<EngineConfig>,
    /// Replay interleaved: each query checked against the oracle.
    pub interleaved: bool,
    /// Replay open loop through the concurrent write front, once per window.
    pub open_loop: bool,
    /// The windows are a sweep (summarized, and plotted with `plot_dir`).
    pub sweep: bool,
    /// The windows the trace is rescaled to in the open loop.
    pub windows: Vec<Duration>,
    /// Events-only passes per backend in the interleaved replay (median reported).
    pub passes: usize,
    /// The open-loop settings; `window` is replaced by each of `windows`.
    pub open_loop_config: OpenLoopConfig,
    /// Write plots (SVG and PNG) of the open-loop runs into this directory.
    pub plot_dir: Option<PathBuf>,
}

/// Workloads C and D: both replay one stream (by default random routing, leaf-first eviction).
#[derive(Debug, Clone)]
pub struct BasePlan {
    /// The engines that make the stream.
    pub engine: EngineConfig,
    /// Workload C: one writer and one reader, alone and at once.
    pub concurrent: Option<ConcurrentConfig>,
    /// Workload D: rounds of (replay, clear all) on one index.
    pub clear_rounds: Option<usize>,
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

/// What every workload of a run shares: the progress bar, the backends and the failed checks.
struct Session<'a> {
    bar: ProgressBar,
    backends: &'a [String],
    failures: Vec<String>,
}

/// Prints to stdout without tearing the progress bar.
fn out(bar: &ProgressBar, text: &str) {
    bar.suspend(|| println!("{text}"));
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

/// Runs `plan`: the tables go to stdout, the report to `plan.json`. Returns the correctness
/// checks that failed (empty if all passed); errors are I/O, a bad trace or a vanished backend.
pub fn run(plan: &Plan) -> Result<Vec<String>> {
    let backends = &plan.backends;
    let base = plan.base.as_ref();
    let run_synthetic = plan.synthetic.is_some();
    let run_concurrent = base.is_some_and(|b| b.concurrent.is_some());
    let run_clear = base.is_some_and(|b| b.clear_rounds.is_some());
    if let Some(dir) = plan.conversation.as_ref().and_then(|c| c.plot_dir.as_ref()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }

    let n = backends.len() as u64;
    let mut units = 0u64;
    if let Some(c) = &plan.conversation {
        let open_loop_runs = if c.open_loop {
            c.windows.len() as u64
        } else {
            0
        };
        let per_mode = u64::from(c.interleaved) + open_loop_runs;
        units += c.configs.len() as u64 * n * per_mode;
    }
    units += n * (2 * u64::from(run_synthetic) + u64::from(run_concurrent) + u64::from(run_clear));
    let bar = progress(units);

    let needs_trace = plan.conversation.is_some() || base.is_some();
    let path = &plan.trace.path;
    let mut trace = if needs_trace {
        load_trace(path)?
    } else {
        Vec::new()
    };
    if let Some(limit) = plan.trace.requests {
        trace.truncate(limit);
    }
    let trace_requests = trace.len();
    scale_length(&mut trace, plan.trace.length_factor)?;
    let trace = duplicate(trace, plan.trace.duplication_factor)?;
    out(
        &bar,
        &format!(
            "## kvatlas-bench ({}; trace {}, {} requests{}; backends {})\n\n\
             Machine: 2 shared vCPUs — other processes (builds) may run at the same time: \
             figures are noisy, compare medians of repeated runs.",
            if plan.quick { "quick" } else { "standard" },
            path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            trace.len(),
            if plan.trace.length_factor > 1 || plan.trace.duplication_factor > 1 {
                format!(
                    " = {trace_requests} × duplication factor {}, trace-length factor {}",
                    plan.trace.duplication_factor, plan.trace.length_factor
                )
            } else {
                String::new()
            },
            backends
                .iter()
                .map(|b| replay::labelled(b))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );

    let mut report = Report {
        trace: path.display().to_string(),
        requests: trace.len(),
        trace_length_factor: plan.trace.length_factor,
        duplication_factor: plan.trace.duplication_factor,
        ..Report::default()
    };
    let mut session = Session {
        bar,
        backends,
        failures: Vec::new(),
    };

    if let Some(config) = &plan.conversation {
        report.conversation = conversation(&mut session, &trace, config)?;
    }
    if let Some(config) = &plan.synthetic {
        for engine_hashes in [EngineHashes::Unique, EngineHashes::Chained] {
            let config = SyntheticConfig {
                engine_hashes,
                ..*config
            };
            let run = synthetic(&mut session, &config)?;
            match engine_hashes {
                EngineHashes::Unique => report.synthetic = Some(run),
                EngineHashes::Chained => report.synthetic_chained = Some(run),
            }
        }
    }
    if let Some(base) = base {
        // Workloads C and D use Workload A's stream: random routing, leaf-first eviction.
        let stream = generate(&trace, &base.engine);
        if let Some(config) = &base.concurrent {
            report.concurrent = Some(concurrent(&mut session, &stream, config)?);
        }
        if let Some(rounds) = base.clear_rounds {
            report.clear = Some(clear(&mut session, &stream, rounds)?);
        }
    }
    session.bar.finish_and_clear();

    if let Some(json) = &plan.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(json, text).with_context(|| format!("writing {}", json.display()))?;
    }
    Ok(session.failures)
}

/// Workload A: per configuration, the stream, then each backend interleaved and open loop.
fn conversation(
    session: &mut Session<'_>,
    trace: &[TraceRequest],
    plan: &ConversationPlan,
) -> Result<Vec<ConfigRun>> {
    let (bar, backends, failures) = (&session.bar, session.backends, &mut session.failures);
    let ol_config = |window| OpenLoopConfig {
        window,
        ..plan.open_loop_config
    };
    let mut runs = Vec::new();
    if plan.interleaved {
        out(
            bar,
            &format!(
                "\nInterleaved: events/s and blocks/s from an events-only pass on a fresh \
                 index (median of {}); find: one thread, timer cost included; heap: \
                 `stats().heap_bytes`; state = the final snapshot equals the engines' caches; \
                 misrouted = queries the router, fed the backend's answer, would send to another \
                 worker than the stream did (KV-aware routing; must be 0).",
                plan.passes.max(1)
            ),
        );
    }
    for &config in &plan.configs {
        let label = format!("{} {}", config.eviction.name(), config.routing.name());
        let start = Instant::now();
        let stream = generate(trace, &config);
        let generate_secs = start.elapsed().as_secs_f64();
        out(bar, &stream_text(&stream, generate_secs));
        let mut results = Vec::new();
        if plan.interleaved {
            out(bar, INTERLEAVED_HEADER);
            for name in backends {
                bar.set_message(format!("{label} interleaved {name}"));
                let result = replay::run(name, &stream, plan.passes)
                    .with_context(|| format!("backend `{name}` vanished"))?;
                bar.inc(1);
                out(bar, &interleaved_row(&result));
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
        if plan.open_loop {
            out(bar, &open_loop_header(&ol_config(plan.windows[0])));
            for name in backends {
                for &window in &plan.windows {
                    bar.set_message(format!(
                        "{label} open loop {name} {:.1} ms",
                        window.as_secs_f64() * 1e3
                    ));
                    let result = run_open_loop(name, &stream, &ol_config(window))?;
                    bar.inc(1);
                    out(bar, &open_loop_row(&result));
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
            if plan.sweep {
                out(bar, &sweep_text(&summaries));
            }
            if let Some(dir) = &plan.plot_dir {
                let files = plots(dir, &stream, &open, backends, plan.sweep)?;
                out(
                    bar,
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
        runs.push(ConfigRun {
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
    Ok(runs)
}

/// Workload B with one kind of engine hashes.
fn synthetic(
    session: &mut Session<'_>,
    synthetic_config: &SyntheticConfig,
) -> Result<(SyntheticConfig, Vec<SyntheticResult>)> {
    let (bar, backends, failures) = (&session.bar, session.backends, &mut session.failures);
    let engine_hashes = synthetic_config.engine_hashes;
    bar.set_message("synthetic: generating");
    let workload = synthetic::generate(synthetic_config);
    let mut results = Vec::new();
    for name in backends {
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
    out(bar, &synthetic_text(synthetic_config, &results));
    Ok((*synthetic_config, results))
}

/// Workload C: one writer and one reader on `stream`, alone and at once.
fn concurrent(
    session: &mut Session<'_>,
    stream: &Stream,
    concurrent_config: &ConcurrentConfig,
) -> Result<(ConcurrentConfig, Vec<ConcurrentResult>)> {
    let (bar, backends, failures) = (&session.bar, session.backends, &mut session.failures);
    let mut results = Vec::new();
    for name in backends {
        bar.set_message(format!("concurrent {name}"));
        let result = concurrent::run(name, stream, concurrent_config)?;
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
    out(bar, &concurrent_text(stream, concurrent_config, &results));
    Ok((*concurrent_config, results))
}

/// Workload D: `rounds` of (replay `stream`, one `Cleared` per worker) on one index.
fn clear(
    session: &mut Session<'_>,
    stream: &Stream,
    rounds: usize,
) -> Result<(EngineConfig, Vec<ClearResult>)> {
    let (bar, backends, failures) = (&session.bar, session.backends, &mut session.failures);
    let mut results = Vec::new();
    for name in backends {
        bar.set_message(format!("clear {name}"));
        let result = clear::run(name, stream, rounds)
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
    out(bar, &clear_text(stream, &results));
    Ok((stream.config, results))
}
