//! Rendering of the `kvatlas-bench` results: the markdown tables and paragraphs printed to stdout,
//! and the plots of the open-loop runs (drawn by [`crate::plot`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::clear::ClearResult;
use crate::concurrent::{ConcurrentConfig, ConcurrentResult};
use crate::engine::{EngineConfig, Routing, Stream};
use crate::openloop::{
    self, KEEP_UP_FACTOR, OpenLoopConfig, OpenLoopResult, P99_JUMP, SweepSummary,
};
use crate::plot;
use crate::replay::ReplayResult;
use crate::synthetic::{EngineHashes, SyntheticConfig, SyntheticResult};

/// A duration in ns as µs (two decimals below 100 µs, none up to 10 ms) or ms.
pub fn us(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.0} ms", ns as f64 / 1e6)
    } else if ns >= 100_000 {
        format!("{:.0} µs", ns as f64 / 1e3)
    } else {
        format!("{:.2} µs", ns as f64 / 1e3)
    }
}

/// A rate with an SI suffix: `1.23M`, `4.5k` or `789`.
pub fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// The routing of a conversation configuration, as its section title shows it.
pub fn routing_text(c: &EngineConfig) -> String {
    match c.routing {
        Routing::Random => format!("routing=random seed={}", c.seed),
        Routing::KvAware if c.load_bound_percent == 0 => "routing=kv-aware (unbounded)".into(),
        Routing::KvAware => format!(
            "routing=kv-aware (load ≤ {} % of mean)",
            c.load_bound_percent
        ),
    }
}

/// The section title of a conversation configuration and its stream's summary.
pub fn stream_text(stream: &Stream, generate_secs: f64) -> String {
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

/// The title and table header of the interleaved replay; one [`interleaved_row`] per backend.
pub const INTERLEAVED_HEADER: &str = "\n#### Interleaved replay (exact, oracle-checked)\n\n\
    | backend | requests | events | events/s | blocks/s | find p50 | p99 | p99.9 | max \
    | find/s (1/mean) | mismatches | misrouted | state | heap MB | B/membership | digest |\n\
    |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

/// One backend's row of the interleaved replay table.
pub fn interleaved_row(r: &ReplayResult) -> String {
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

/// The title and table header of the open-loop runs; one [`open_loop_row`] per run.
pub fn open_loop_header(config: &OpenLoopConfig) -> String {
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

/// One open-loop run's row (achieved loads in parentheses when the run did not keep up).
pub fn open_loop_row(r: &OpenLoopResult) -> String {
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

/// The sweep summary table: threshold throughput and p99 jump per backend.
pub fn sweep_text(summaries: &[SweepSummary]) -> String {
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

/// The synthetic workload's section: title and one row per backend.
pub fn synthetic_text(config: &SyntheticConfig, results: &[SyntheticResult]) -> String {
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

/// The concurrent workload's section: title and one row per backend.
pub fn concurrent_text(
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

/// The clear workload's section: title and one row per backend.
pub fn clear_text(stream: &Stream, results: &[ClearResult]) -> String {
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

/// Writes the sweep plot (with `sweep`) and the latency CDF of one conversation configuration's
/// open-loop runs into `dir`; returns the files written.
pub fn plots(
    dir: &Path,
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
