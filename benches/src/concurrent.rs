//! Workload C (`docs/benchmarks.md`, "Workloads"): one writer and one reader at once, through
//! the concurrent front (`ThreadPool` over `LeftRight<backend>` or `Locked<backend>`, or over the
//! backend's concurrent form when it has one: `ConcurrentAtlas` for `atlas`, `crtc` itself).
//!
//! The event stream is a Workload-A stream plus its "drain" (one `Removed` per worker emptying its
//! cache), looped. Three phases of `phase` each, on fresh fronts:
//! 1. **events alone**: a producer thread enqueues `events ++ drain` in a loop (cloning each
//!    event) with a `flush` barrier every `flush_every` events; events/s counts flushed events
//!    only (drain-correct);
//! 2. **queries alone**: the stream's events applied once (a populated index), then one reader
//!    loops over the trace's queries, each `find_matches` timed;
//! 3. **both at once**: populated as in 2, the producer loops `drain ++ events` while the reader
//!    loops over the queries (the queried index evolves and is on average less full).
//!
//! Correctness: once a phase's clock has stopped, the producer finishes its current loop (not
//! timed) and the index must then hold exactly the expected state — empty after phase 1, the
//! engines' final caches after phase 3 — with no anomaly reported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use hdrhistogram::Histogram;
use kvatlas_index::{ApplyReport, MatchOptions, Mutation, SharedKvIndex};

use crate::engine::Stream;
use crate::openloop::{Front, FrontKind, front};
use crate::replay::{Latency, snapshot_state};

/// How Workload C is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ConcurrentConfig {
    /// Duration of each phase, in milliseconds.
    pub phase_ms: u64,
    /// Writer threads of the pool.
    pub pool_threads: usize,
    /// Capacity of each writer lane.
    pub queue_capacity: usize,
    /// How the pool shares the index with the reader.
    pub front: FrontKind,
    /// Events between two `flush` barriers of the producer.
    pub flush_every: usize,
}

impl Default for ConcurrentConfig {
    /// Dynamo's settings: 3 s phases, flush every 1024 events; one pool thread.
    fn default() -> Self {
        Self {
            phase_ms: 3000,
            pool_threads: 1,
            queue_capacity: 1024,
            front: FrontKind::default(),
            flush_every: 1024,
        }
    }
}

/// Results of Workload C on one backend.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConcurrentResult {
    /// Backend name.
    pub backend: String,
    /// Events per second, producer alone.
    pub events_alone_per_s: f64,
    /// Events per second with the reader running.
    pub events_concurrent_per_s: f64,
    /// Queries per second, reader alone.
    pub finds_alone_per_s: f64,
    /// Queries per second with the producer running.
    pub finds_concurrent_per_s: f64,
    /// Reader latency alone.
    pub find_alone: Latency,
    /// Reader latency with the producer running.
    pub find_concurrent: Latency,
    /// Events applied in the timed part of phase 1.
    pub events_alone: u64,
    /// Events applied in the timed part of phase 3.
    pub events_concurrent: u64,
    /// Whether the index held the expected state after phases 1 and 3.
    pub state_matches: bool,
    /// Anomalies reported (expected 0).
    pub anomalies: u64,
}

impl ConcurrentResult {
    /// Whether the checks passed.
    pub fn is_correct(&self) -> bool {
        self.state_matches && self.anomalies == 0
    }
}

/// The producer: loops `cycle` until `stop` is seen at a flush barrier (or `deadline` passes),
/// then finishes the current loop untimed. Returns (events flushed while timed, timed seconds,
/// accumulated report).
fn produce(
    pool: &Front,
    cycle: &[Mutation],
    flush_every: usize,
    stop: &AtomicBool,
    deadline: Option<Instant>,
) -> Result<(u64, f64, ApplyReport)> {
    let mut report = ApplyReport::default();
    let start = Instant::now();
    let (mut flushed, mut pending) = (0u64, 0u64);
    let mut timed = None;
    'outer: loop {
        for (i, event) in cycle.iter().enumerate() {
            if pool.enqueue(event.clone()).is_err() {
                bail!("the writer pool stopped");
            }
            pending += 1;
            let last = i + 1 == cycle.len();
            if pending as usize >= flush_every || last {
                report.merge(&pool.flush());
                if timed.is_none() {
                    flushed += pending;
                    let expired = deadline.is_some_and(|d| Instant::now() >= d);
                    if expired || stop.load(Ordering::Relaxed) {
                        timed = Some(start.elapsed().as_secs_f64());
                    }
                }
                pending = 0;
                if timed.is_some() && last {
                    break 'outer;
                }
            }
        }
        if cycle.is_empty() {
            break;
        }
    }
    report.merge(&pool.flush());
    Ok((
        flushed,
        timed.unwrap_or_else(|| start.elapsed().as_secs_f64()),
        report,
    ))
}

/// The reader: loops over the stream's queries until `duration` has passed; returns (queries,
/// seconds, latency histogram).
fn read(pool: &Front, stream: &Stream, duration: Duration) -> (u64, f64, Histogram<u64>) {
    let options = MatchOptions::default();
    let mut histogram =
        Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds");
    let start = Instant::now();
    let mut count = 0u64;
    'outer: loop {
        for query in &stream.queries {
            let begin = Instant::now();
            let matches = pool.find_matches(&query.locals, &options);
            let end = Instant::now();
            std::hint::black_box(&matches);
            histogram.saturating_record((end - begin).as_nanos().max(1) as u64);
            count += 1;
            if end - start >= duration {
                break 'outer;
            }
        }
        if stream.queries.is_empty() {
            break;
        }
    }
    (count, start.elapsed().as_secs_f64().max(1e-9), histogram)
}

fn populate(pool: &Front, stream: &Stream) -> Result<ApplyReport> {
    for event in &stream.events {
        if pool.enqueue(event.clone()).is_err() {
            bail!("the writer pool stopped");
        }
    }
    Ok(pool.flush())
}

/// Runs Workload C against the backend called `name`.
///
/// # Errors
/// If there is no such backend or the writer pool fails.
pub fn run(name: &str, stream: &Stream, config: &ConcurrentConfig) -> Result<ConcurrentResult> {
    let phase = Duration::from_millis(config.phase_ms);
    let drain = stream.drain_events();
    let forward: Vec<Mutation> = stream
        .events
        .iter()
        .cloned()
        .chain(drain.iter().cloned())
        .collect();
    let backward: Vec<Mutation> = drain
        .iter()
        .cloned()
        .chain(stream.events.iter().cloned())
        .collect();
    let expected = (stream.stats.final_memberships, stream.final_state_digest);
    let mut bad = 0u64;
    let mut state_matches = true;

    let new_front = || {
        front(
            name,
            config.front,
            config.pool_threads,
            config.queue_capacity,
        )
    };

    // Phase 1: events alone.
    let pool = new_front()?;
    let never = AtomicBool::new(false);
    let (events_alone, alone_secs, report) = produce(
        &pool,
        &forward,
        config.flush_every,
        &never,
        Some(Instant::now() + phase),
    )?;
    bad += report.anomalies();
    state_matches &= pool.index().stats().memberships == 0;
    drop(pool);

    // Phase 2: queries alone on a populated index.
    let pool = new_front()?;
    bad += populate(&pool, stream)?.anomalies();
    let (finds_alone, finds_alone_secs, alone_hist) = read(&pool, stream, phase);
    state_matches &= snapshot_state(&pool.index().snapshot()) == expected;
    drop(pool);

    // Phase 3: both at once.
    let pool = new_front()?;
    bad += populate(&pool, stream)?.anomalies();
    let stop = AtomicBool::new(false);
    let (producer, (finds_conc, finds_conc_secs, conc_hist)) = std::thread::scope(|s| {
        let producer = s.spawn(|| produce(&pool, &backward, config.flush_every, &stop, None));
        let reader = read(&pool, stream, phase);
        stop.store(true, Ordering::Relaxed);
        (producer.join(), reader)
    });
    let (events_conc, conc_secs, report) = match producer {
        Ok(result) => result?,
        Err(_) => bail!("the producer panicked"),
    };
    bad += report.anomalies();
    state_matches &= snapshot_state(&pool.index().snapshot()) == expected;
    drop(pool);

    Ok(ConcurrentResult {
        backend: name.to_string(),
        events_alone_per_s: events_alone as f64 / alone_secs.max(1e-9),
        events_concurrent_per_s: events_conc as f64 / conc_secs.max(1e-9),
        finds_alone_per_s: finds_alone as f64 / finds_alone_secs,
        finds_concurrent_per_s: finds_conc as f64 / finds_conc_secs,
        find_alone: Latency::of(&alone_hist),
        find_concurrent: Latency::of(&conc_hist),
        events_alone,
        events_concurrent: events_conc,
        state_matches,
        anomalies: bad,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConfig, Eviction, generate};
    use crate::trace::{default_trace_path, load_trace};

    #[test]
    fn a_short_concurrent_run_ends_in_the_expected_states() {
        let mut trace = load_trace(&default_trace_path()).expect("the trace in data/traces");
        trace.truncate(300);
        let stream = generate(&trace, &EngineConfig::new(8, 64, Eviction::LeafFirst, 42));
        let config = ConcurrentConfig {
            phase_ms: 60,
            flush_every: 64,
            ..ConcurrentConfig::default()
        };
        for name in ["atlas", "radix", "crtc"] {
            let result = run(name, &stream, &config).expect("runs");
            assert!(result.is_correct(), "{name}: {result:?}");
            assert!(
                result.events_alone > 0 && result.events_concurrent > 0,
                "{name}"
            );
            assert!(result.finds_alone_per_s > 0.0 && result.finds_concurrent_per_s > 0.0);
        }
    }
}
