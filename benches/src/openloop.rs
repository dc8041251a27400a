//! Open-loop, deadline-driven replay of a mock-engine [`Stream`] through the concurrent write
//! front, and the offered-load sweep built on it (the completion-correct method of
//! `docs/benchmarks.md`, "Open loop").
//!
//! Each request's trace timestamp is rescaled onto a benchmark window: the first request is due
//! at 0, the last at `window`. Every worker's timeline (its queries, each followed by the events
//! it caused, in trace order: the order the index needs per worker) goes to one of `issuers`
//! issuer threads (`worker_id % issuers`), which merges its workers' timelines in time order.
//! With the clock started, an issuer waits for each operation's deadline (an absolute-deadline
//! sleep, then a spin of the last `spin` that yields the core between checks) and then:
//!
//! - **an event** is handed to `ThreadPool::new(front, pool_threads, queue_capacity)` with the
//!   front `LeftRight<backend>` (default) or `Locked<backend>` — or the backend's concurrent form
//!   when it has one (`ConcurrentAtlas` for `atlas`, `crtc` itself): the real write path, sticky
//!   per-rank lanes, bounded queues. A full lane blocks the issuer (backpressure; every such wait
//!   is counted);
//! - **a query** runs inline (`pool.find_matches`, the pool's read path), its latency recorded
//!   as *completion − deadline* (coordinated omission corrected: a query issued late, because the
//!   issuer was blocked or the core was busy, is charged for it), with the service time of the
//!   call and the issue lag (start − deadline) recorded separately.
//!
//! With one issuer and one writer thread the harness keeps exactly 2 threads busy, which is what
//! this 2-core machine has.
//!
//! The clock stops when the last query has completed **and** the pool has drained
//! (`ThreadPool::flush` after the last enqueue). A run keeps up only if that completion time is at
//! most [`KEEP_UP_FACTOR`] × the window; a run that does not is reported as invalid, never as a
//! throughput figure.
//!
//! Queries race the writers here, so per-query scores are not checked (the interleaved replay
//! checks them exactly). What is checked: the index's final state (every (worker, block)
//! membership, by count and order-independent digest) equals the mock engines' final caches, every
//! query was answered, and no anomaly was reported.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use kvatlas_index::{
    EnqueueError, MatchOptions, Mutation, SharedKvIndex, ThreadPool,
    baseline::{LeftRight, Locked},
};

use crate::engine::Stream;
use crate::replay::{Boxed, Latency, backend, shared_backend, snapshot_state};

/// A run keeps up if it completes within this factor of its window.
pub const KEEP_UP_FACTOR: f64 = 1.10;

/// How an open-loop run is driven.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct OpenLoopConfig {
    /// The benchmark window the trace is rescaled to.
    #[serde(serialize_with = "ser_duration_ms")]
    pub window: Duration,
    /// Writer threads of the pool.
    pub pool_threads: usize,
    /// Capacity of each writer lane (mutations).
    pub queue_capacity: usize,
    /// How the pool shares the index with readers.
    pub front: FrontKind,
    /// Event issuer threads.
    pub issuers: usize,
    /// How long before a deadline an issuer stops sleeping and spins.
    #[serde(serialize_with = "ser_duration_ms")]
    pub spin: Duration,
}

fn ser_duration_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl Default for OpenLoopConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(1),
            pool_threads: 1,
            queue_capacity: 1024,
            front: FrontKind::default(),
            issuers: 1,
            spin: Duration::from_micros(200),
        }
    }
}

pub use kvatlas_fleet::plot::Cdf;
use kvatlas_fleet::plot::cdf_of;

/// The results of one open-loop run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OpenLoopResult {
    /// Backend name.
    pub backend: String,
    /// How the run was driven.
    pub config: OpenLoopConfig,
    /// Queries issued (and answered).
    pub queries: u64,
    /// Events issued (and applied: the pool was drained).
    pub events: u64,
    /// Query hashes + stored and removed hashes.
    pub block_ops: u64,
    /// Seconds from the start to the last completion (query or drained event).
    pub completion_secs: f64,
    /// `completion_secs / window`.
    pub completion_ratio: f64,
    /// Whether the run completed within [`KEEP_UP_FACTOR`] × the window.
    pub kept_up: bool,
    /// Operations (queries + events) per second of window: the load offered.
    pub offered_ops_per_s: f64,
    /// Operations per second of completion time.
    pub achieved_ops_per_s: f64,
    /// Block operations per second of window.
    pub offered_block_ops_per_s: f64,
    /// Block operations per second of completion time.
    pub achieved_block_ops_per_s: f64,
    /// Query latency from its intended send time (deadline) to completion.
    pub latency: Latency,
    /// Time inside `find_matches` alone.
    pub service: Latency,
    /// How late the query thread started each query (start − deadline): the generator's own
    /// lateness, part of `latency` (on 2 shared cores, mostly waiting for a core).
    pub issue_lag: Latency,
    /// Latency CDF (deadline to completion).
    pub cdf: Cdf,
    /// Enqueues that found their lane full and waited (backpressure).
    pub backpressure_waits: u64,
    /// Worst lateness of an event enqueue behind its deadline, in ns (includes backpressure).
    pub max_event_lag_ns: u64,
    /// Seconds the final `flush` (the drain) took after the last event was enqueued.
    pub drain_secs: f64,
    /// Memberships in the index at the end.
    pub memberships: u64,
    /// Memberships the mock engines hold at the end.
    pub expected_memberships: u64,
    /// Whether the final index state equals the engines' (count and digest).
    pub state_matches: bool,
    /// Anomalies the index reported (expected 0).
    pub anomalies: u64,
    /// Index heap estimate at the end.
    pub heap_bytes: u64,
}

impl OpenLoopResult {
    /// Whether the correctness checks passed (final state, anomalies, every query answered).
    pub fn is_correct(&self) -> bool {
        self.state_matches && self.anomalies == 0
    }
}

/// Deadlines (ns after the start) of each query of `stream`: trace timestamps rescaled so the
/// first is due at 0 and the last at `window`, made non-decreasing in trace order (so per-worker
/// order never changes). A trace whose timestamps are all equal is spread evenly by index.
pub fn deadlines(stream: &Stream, window: Duration) -> Vec<u64> {
    let queries = &stream.queries;
    let Some(first) = queries.first() else {
        return Vec::new();
    };
    let t0 = first.timestamp_ms;
    let mut running = t0;
    let times: Vec<u64> = queries
        .iter()
        .map(|q| {
            running = running.max(q.timestamp_ms);
            running - t0
        })
        .collect();
    let span = times.last().copied().unwrap_or(0);
    let window_ns = window.as_nanos() as f64;
    if span == 0 {
        let n = (queries.len().max(2) - 1) as f64;
        return (0..queries.len())
            .map(|i| (window_ns * i as f64 / n) as u64)
            .collect();
    }
    times
        .iter()
        .map(|&t| (window_ns * t as f64 / span as f64) as u64)
        .collect()
}

/// One operation of an issuer's timeline.
#[derive(Debug)]
enum Op {
    /// Run `stream.queries[i]` inline.
    Query(usize),
    /// Enqueue this event on the write front.
    Event(Mutation),
}

/// What one issuer measured.
#[derive(Debug)]
struct Issued {
    latency: Histogram<u64>,
    service: Histogram<u64>,
    lag: Histogram<u64>,
    last_query: Instant,
    backpressure: u64,
    max_event_lag: u64,
    events: u64,
}

impl Issued {
    fn new(start: Instant) -> Self {
        Self {
            latency: histogram(),
            service: histogram(),
            lag: histogram(),
            last_query: start,
            backpressure: 0,
            max_event_lag: 0,
            events: 0,
        }
    }

    fn record(&mut self, deadline: Instant, begin: Instant, end: Instant) {
        let ns = |d: Duration| (d.as_nanos() as u64).max(1);
        self.latency.saturating_record(ns(end - deadline));
        self.service.saturating_record(ns(end - begin));
        self.lag
            .saturating_record(ns(begin.saturating_duration_since(deadline)));
        self.last_query = self.last_query.max(end);
    }

    fn merge(&mut self, other: &Issued) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.latency.add(&other.latency);
        let _ = self.service.add(&other.service);
        let _ = self.lag.add(&other.lag);
        self.last_query = self.last_query.max(other.last_query);
        self.backpressure += other.backpressure;
        self.max_event_lag = self.max_event_lag.max(other.max_event_lag);
        self.events += other.events;
    }
}

/// Waits until `deadline`: sleeps until `spin` before it, then spins (yielding the core to any
/// runnable thread between checks; on 2 cores the writers need it).
fn wait_until(deadline: Instant, spin: Duration) {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > spin {
            std::thread::sleep(left - spin);
        } else {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

/// Runs one open-loop replay of `stream` against the backend called `name` (see the module docs).
///
/// # Errors
/// If there is no such backend, a thread cannot be started, or the pool stops.
pub fn run_open_loop(
    name: &str,
    stream: &Stream,
    config: &OpenLoopConfig,
) -> Result<OpenLoopResult> {
    let pool = front(
        name,
        config.front,
        config.pool_threads,
        config.queue_capacity,
    )?;

    let due = deadlines(stream, config.window);
    let issuers = config.issuers.max(1);
    // Each issuer's timeline, in trace order: a query, then the events it caused, all due at the
    // request's deadline (events cloned before the clock starts).
    let mut lanes: Vec<Vec<(u64, Op)>> = (0..issuers).map(|_| Vec::new()).collect();
    for (q, (query, &deadline)) in stream.queries.iter().zip(&due).enumerate() {
        let lane = &mut lanes[query.worker as usize % issuers];
        lane.push((deadline, Op::Query(q)));
        for event in &stream.events[query.events.clone()] {
            lane.push((deadline, Op::Event(event.clone())));
        }
    }
    let options = MatchOptions::default();
    let spin = config.spin;

    // A short lead so every thread is waiting before the first deadline.
    let start = Instant::now() + Duration::from_millis(5);
    let (issued, last_enqueue, drained_at, report) = std::thread::scope(|s| {
        let threads: Vec<_> = lanes
            .into_iter()
            .map(|lane| {
                let pool = &pool;
                s.spawn(move || -> Result<Issued> {
                    let mut out = Issued::new(start);
                    for (deadline, op) in lane {
                        let deadline = start + Duration::from_nanos(deadline);
                        wait_until(deadline, spin);
                        match op {
                            Op::Query(q) => {
                                let begin = Instant::now();
                                let matches =
                                    pool.find_matches(&stream.queries[q].locals, &options);
                                let end = Instant::now();
                                std::hint::black_box(&matches);
                                out.record(deadline, begin, end);
                            }
                            Op::Event(event) => {
                                match pool.try_enqueue(event) {
                                    Ok(()) => {}
                                    Err(EnqueueError::Full(event)) => {
                                        out.backpressure += 1;
                                        if pool.enqueue(event).is_err() {
                                            bail!("the writer pool stopped");
                                        }
                                    }
                                    Err(EnqueueError::Stopped(_)) => {
                                        bail!("the writer pool stopped")
                                    }
                                }
                                out.max_event_lag =
                                    out.max_event_lag.max(deadline.elapsed().as_nanos() as u64);
                                out.events += 1;
                            }
                        }
                    }
                    Ok(out)
                })
            })
            .collect();
        let mut total = Issued::new(start);
        for handle in threads {
            match handle.join() {
                Ok(Ok(part)) => total.merge(&part),
                Ok(Err(error)) => return Err(error),
                Err(_) => bail!("an issuer thread panicked"),
            }
        }
        let last_enqueue = Instant::now();
        let report = pool.flush();
        Ok((total, last_enqueue, Instant::now(), report))
    })?;
    let Issued {
        mut latency,
        service,
        lag,
        last_query: queries_done,
        backpressure,
        max_event_lag,
        events: events_enqueued,
    } = issued;
    let end = queries_done.max(drained_at);
    let completion = end.saturating_duration_since(start).as_secs_f64().max(1e-9);
    let window = config.window.as_secs_f64().max(1e-9);

    let (memberships, digest) = snapshot_state(&pool.index().snapshot());
    let heap_bytes = pool.index().stats().heap_bytes;
    drop(pool);
    if latency.is_empty() {
        latency.saturating_record(1);
    }

    let queries = stream.queries.len() as u64;
    let ops = queries + events_enqueued;
    let block_ops = stream.stats.query_blocks + stream.event_blocks();
    let anomalies = report.anomalies();
    Ok(OpenLoopResult {
        backend: name.to_string(),
        config: *config,
        queries,
        events: events_enqueued,
        block_ops,
        completion_secs: completion,
        completion_ratio: completion / window,
        kept_up: completion <= KEEP_UP_FACTOR * window,
        offered_ops_per_s: ops as f64 / window,
        achieved_ops_per_s: ops as f64 / completion,
        offered_block_ops_per_s: block_ops as f64 / window,
        achieved_block_ops_per_s: block_ops as f64 / completion,
        latency: Latency::of(&latency),
        service: Latency::of(&service),
        issue_lag: Latency::of(&lag),
        cdf: cdf_of(&latency),
        backpressure_waits: backpressure,
        max_event_lag_ns: max_event_lag,
        drain_secs: drained_at.duration_since(last_enqueue).as_secs_f64(),
        memberships,
        expected_memberships: stream.stats.final_memberships,
        state_matches: events_enqueued == stream.events.len() as u64
            && (memberships, digest) == (stream.stats.final_memberships, stream.final_state_digest),
        anomalies,
        heap_bytes,
    })
}

/// Log-spaced windows from `max` (slowest offered load) down to `min` (fastest), `steps` of them
/// (at least 1; 1 step = `max` alone).
pub fn sweep_windows(min: Duration, max: Duration, steps: usize) -> Vec<Duration> {
    let (lo, hi) = (
        min.as_secs_f64().max(1e-9),
        max.as_secs_f64().max(min.as_secs_f64()).max(1e-9),
    );
    if steps <= 1 {
        return vec![Duration::from_secs_f64(hi)];
    }
    (0..steps)
        .map(|i| {
            let f = i as f64 / (steps - 1) as f64;
            Duration::from_secs_f64(hi * (lo / hi).powf(f))
        })
        .collect()
}

/// What a sweep found for one backend.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SweepSummary {
    /// Backend name.
    pub backend: String,
    /// The highest offered load (ops/s) that was kept up with, if any.
    pub threshold_ops_per_s: Option<f64>,
    /// Block ops/s offered at the threshold.
    pub threshold_block_ops_per_s: Option<f64>,
    /// p99 (ns) at the threshold.
    pub threshold_p99_ns: Option<u64>,
    /// The lowest offered load (ops/s) whose p99 is at least [`P99_JUMP`] × the p99 at the
    /// lowest offered load: where the latency curve turns up.
    pub p99_jump_ops_per_s: Option<f64>,
    /// Runs (ordered by offered load, lowest first) whose final state was wrong.
    pub incorrect_runs: usize,
}

/// The p99 growth (over the lowest offered load's) that counts as "the p99 jumps".
pub const P99_JUMP: f64 = 10.0;

/// Summarizes one backend's sweep runs (any order).
pub fn summarize(backend: &str, runs: &[OpenLoopResult]) -> SweepSummary {
    let mut sorted: Vec<&OpenLoopResult> = runs.iter().filter(|r| r.backend == backend).collect();
    sorted.sort_by(|a, b| a.offered_ops_per_s.total_cmp(&b.offered_ops_per_s));
    let threshold = sorted
        .iter()
        .filter(|r| r.kept_up)
        .max_by(|a, b| a.offered_ops_per_s.total_cmp(&b.offered_ops_per_s));
    let base = sorted.first().map(|r| r.latency.p99_ns.max(1));
    let jump = base.and_then(|base| {
        sorted
            .iter()
            .find(|r| r.latency.p99_ns as f64 >= P99_JUMP * base as f64)
            .map(|r| r.offered_ops_per_s)
    });
    SweepSummary {
        backend: backend.to_string(),
        threshold_ops_per_s: threshold.map(|r| r.offered_ops_per_s),
        threshold_block_ops_per_s: threshold.map(|r| r.offered_block_ops_per_s),
        threshold_p99_ns: threshold.map(|r| r.latency.p99_ns),
        p99_jump_ops_per_s: jump,
        incorrect_runs: sorted.iter().filter(|r| !r.is_correct()).count(),
    }
}

/// How the writer pool shares the index with readers. A backend with a concurrent form (a
/// registry entry with [`crate::replay::Backend::shared`]: `atlas` → `ConcurrentAtlas`, `crtc`)
/// uses that form whatever the kind: it is the backend's own, better way to share itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FrontKind {
    /// `Locked<backend>`: one copy behind a reader-writer lock (a saturated writer delays readers).
    Locked,
    /// `LeftRight<backend>`: two copies and an operation log; reads do not wait for the writer.
    #[default]
    LeftRight,
}

/// The shared index behind the pool: one of the two concurrent fronts over a registry backend,
/// or a concurrent backend itself.
#[derive(Debug)]
pub enum SharedFront {
    /// See [`FrontKind::LeftRight`].
    LeftRight(LeftRight<Boxed>),
    /// See [`FrontKind::Locked`].
    Locked(Locked<Boxed>),
    /// A backend that is concurrent itself, without a front.
    Native(NativeIndex),
}

/// A concurrent registry backend, boxed (see [`crate::replay::Backend::shared`]).
pub struct NativeIndex(pub Box<dyn SharedKvIndex>);

impl std::fmt::Debug for NativeIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NativeIndex(dyn SharedKvIndex)")
    }
}

macro_rules! delegate {
    ($self:ident, $index:ident => $call:expr) => {
        match $self {
            SharedFront::LeftRight($index) => $call,
            SharedFront::Locked($index) => $call,
            SharedFront::Native(NativeIndex($index)) => $call,
        }
    };
}

impl SharedKvIndex for SharedFront {
    fn apply(&self, mutation: &Mutation) -> kvatlas_index::ApplyReport {
        delegate!(self, index => index.apply(mutation))
    }

    fn apply_owned(&self, mutation: Mutation) -> kvatlas_index::ApplyReport {
        delegate!(self, index => index.apply_owned(mutation))
    }

    fn apply_batch(&self, batch: &mut Vec<Mutation>) -> kvatlas_index::ApplyReport {
        delegate!(self, index => index.apply_batch(batch))
    }

    fn remove_worker(&self, worker_id: u64) -> kvatlas_index::ApplyReport {
        delegate!(self, index => index.remove_worker(worker_id))
    }

    fn clear(&self) {
        delegate!(self, index => index.clear())
    }

    fn find_matches(
        &self,
        query: &[kvatlas_hash::LocalBlockHash],
        options: &MatchOptions,
    ) -> kvatlas_index::Matches {
        delegate!(self, index => index.find_matches(query, options))
    }

    fn snapshot(&self) -> kvatlas_index::Snapshot {
        delegate!(self, index => index.snapshot())
    }

    fn restore(&self, snapshot: &kvatlas_index::Snapshot) {
        delegate!(self, index => index.restore(snapshot))
    }

    fn stats(&self) -> kvatlas_index::IndexStats {
        delegate!(self, index => index.stats())
    }
}

/// The shared pool type, for callers that build their own front.
pub type Front = ThreadPool<SharedFront>;

/// Builds the concurrent front of kind `kind` over the backend called `name` (a backend that is
/// concurrent itself is used directly; see [`FrontKind`]).
///
/// # Errors
/// If there is no such backend or a writer thread cannot be started.
pub fn front(name: &str, kind: FrontKind, threads: usize, queue_capacity: usize) -> Result<Front> {
    let make = || {
        backend(name)
            .map(Boxed)
            .with_context(|| format!("unknown backend `{name}`"))
    };
    let shared = match (shared_backend(name), kind) {
        (Some(native), _) => SharedFront::Native(NativeIndex(native)),
        (None, FrontKind::LeftRight) => SharedFront::LeftRight(LeftRight::new(make()?, make()?)),
        (None, FrontKind::Locked) => SharedFront::Locked(Locked::new(make()?)),
    };
    ThreadPool::new(shared, threads, queue_capacity).context("starting the writer pool")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConfig, Eviction, generate};
    use crate::trace::TraceRequest;

    /// 60 requests over one trace minute, 4 workers, small caches (eviction happens).
    fn tiny_stream() -> Stream {
        let trace: Vec<TraceRequest> = (0..60u64)
            .map(|i| TraceRequest {
                timestamp: i * 1000,
                input_length: 0,
                output_length: 0,
                hash_ids: (0..(4 + i % 7)).map(|b| (i % 5) * 100 + b).collect(),
            })
            .collect();
        generate(&trace, &EngineConfig::new(4, 12, Eviction::LeafFirst, 3))
    }

    #[test]
    fn deadlines_span_the_window_in_order() {
        let stream = tiny_stream();
        let due = deadlines(&stream, Duration::from_millis(100));
        assert_eq!(due.len(), 60);
        assert_eq!(due[0], 0);
        assert_eq!(*due.last().expect("non-empty"), 100_000_000);
        assert!(due.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_paced_run_is_exact_and_judged_by_its_completion_time() {
        let stream = tiny_stream();
        assert!(stream.stats.blocks_removed > 0);
        let config = OpenLoopConfig {
            window: Duration::from_millis(400),
            ..OpenLoopConfig::default()
        };
        let ops = (60 + stream.events.len()) as f64;
        for name in ["atlas", "radix", "crtc", "reference"] {
            // Whether this machine keeps up with a given rate is a timing figure: it belongs in
            // the benchmark (`cargo xtask bench`, `docs/benchmarks.md`, "Open loop"), not in a
            // unit test on a shared machine. What holds on any machine: the final state is
            // exact, every operation is issued on its deadline or later (so the run cannot end
            // before the window), and the verdict and rates follow from the completion time.
            let result = run_open_loop(name, &stream, &config).expect("runs");
            assert!(result.is_correct(), "{name}: {result:?}");
            assert_eq!(result.queries, 60);
            assert_eq!(result.events, stream.events.len() as u64);
            assert!(result.completion_secs >= 0.400, "{name}: {result:?}");
            assert!((result.offered_ops_per_s - ops / 0.400).abs() < 1e-6);
            assert!((result.achieved_ops_per_s - ops / result.completion_secs).abs() < 1e-6);
            assert!((result.completion_ratio - result.completion_secs / 0.400).abs() < 1e-9);
            assert_eq!(
                result.kept_up,
                result.completion_secs <= KEEP_UP_FACTOR * 0.400,
                "{name}: {result:?}"
            );
            if result.kept_up {
                assert!(result.achieved_ops_per_s >= result.offered_ops_per_s / KEEP_UP_FACTOR);
            }
        }
    }

    #[test]
    fn an_impossible_rate_is_reported_invalid_but_still_drains_correctly() {
        let stream = tiny_stream();
        let config = OpenLoopConfig {
            window: Duration::from_micros(1),
            queue_capacity: 1,
            ..OpenLoopConfig::default()
        };
        let result = run_open_loop("radix", &stream, &config).expect("runs");
        assert!(!result.kept_up, "{result:?}");
        assert!(result.completion_ratio > KEEP_UP_FACTOR);
        assert!(result.achieved_ops_per_s < result.offered_ops_per_s);
        // Drain-correct: every event was applied before the clock stopped.
        assert!(result.is_correct(), "{result:?}");
        let summary = summarize("radix", std::slice::from_ref(&result));
        assert_eq!(summary.threshold_ops_per_s, None);
    }

    #[test]
    fn sweep_windows_are_log_spaced_from_slow_to_fast() {
        let w = sweep_windows(Duration::from_millis(10), Duration::from_millis(1000), 3);
        let ms: Vec<f64> = w.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        assert!((ms[0] - 1000.0).abs() < 1e-6 && (ms[1] - 100.0).abs() < 1e-6);
        assert!((ms[2] - 10.0).abs() < 1e-6);
        assert_eq!(
            sweep_windows(Duration::ZERO, Duration::from_millis(5), 1).len(),
            1
        );
    }
}
