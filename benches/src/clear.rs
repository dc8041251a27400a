//! Workload D (`docs/benchmarks.md`, "Workloads"): the cost of `Cleared`.
//!
//! On one index, `rounds` times: apply the stream's events (timed: "replay ms"), check the index
//! holds exactly the engines' final caches, then apply one `Cleared` per worker `0..workers`
//! (timed: "clear-all ms") and check the index is empty — `stats().memberships == 0`, an empty
//! snapshot and no non-empty answer to any of the stream's queries. Rounds after the first
//! re-populate an index that has been cleared, so stale state left by `Cleared` would show.

use std::time::Instant;

use kvatlas_index::{MatchOptions, Mutation, Worker};

use crate::engine::Stream;
use crate::replay::{backend, snapshot_state};

/// Results of Workload D on one backend.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClearResult {
    /// Backend name.
    pub backend: String,
    /// Workers cleared per round (one `Cleared` each).
    pub workers: u32,
    /// Events applied per round before the clear.
    pub events: u64,
    /// Milliseconds to apply the stream's events, per round.
    pub replay_ms: Vec<f64>,
    /// Milliseconds to apply the `Cleared` of every worker, per round.
    pub clear_all_ms: Vec<f64>,
    /// Median of `replay_ms`.
    pub replay_ms_median: f64,
    /// Median of `clear_all_ms`.
    pub clear_all_ms_median: f64,
    /// Memberships the index reported before each clear (each must equal `expected_memberships`).
    pub memberships_before_clear: Vec<u64>,
    /// Memberships the mock engines hold at the end of the stream.
    pub expected_memberships: u64,
    /// Memberships the index reported after each clear (each must be 0).
    pub memberships_after_clear: Vec<u64>,
    /// Blocks the index reported as ended through `Cleared` (`ApplyReport::cleared`), per round.
    pub cleared_reported: Vec<u64>,
    /// Queries with a non-empty answer after a clear, summed over rounds (must be 0).
    pub answers_after_clear: u64,
    /// Whether the index held exactly the engines' final caches before every clear, and an empty
    /// snapshot after it.
    pub state_matches: bool,
    /// Anomalies reported while applying the events (expected 0: the stream is clean).
    pub anomalies: u64,
}

impl ClearResult {
    /// Whether every check passed: full before each clear, empty after it.
    pub fn is_correct(&self) -> bool {
        self.state_matches
            && self.anomalies == 0
            && self.answers_after_clear == 0
            && self.memberships_after_clear.iter().all(|&m| m == 0)
            && self
                .memberships_before_clear
                .iter()
                .all(|&m| m == self.expected_memberships)
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

/// Runs Workload D with the backend called `name` for `rounds` rounds (at least one) on one index.
///
/// Returns `None` if there is no such backend.
pub fn run(name: &str, stream: &Stream, rounds: usize) -> Option<ClearResult> {
    let mut index = backend(name)?;
    let clears: Vec<Mutation> = (0..stream.config.workers)
        .map(|w| Mutation::Cleared {
            worker: Worker::new(u64::from(w), 0),
        })
        .collect();
    let expected = (stream.stats.final_memberships, stream.final_state_digest);
    let options = MatchOptions::default();
    let mut result = ClearResult {
        backend: name.to_string(),
        workers: stream.config.workers,
        events: stream.events.len() as u64,
        replay_ms: Vec::new(),
        clear_all_ms: Vec::new(),
        replay_ms_median: 0.0,
        clear_all_ms_median: 0.0,
        memberships_before_clear: Vec::new(),
        expected_memberships: stream.stats.final_memberships,
        memberships_after_clear: Vec::new(),
        cleared_reported: Vec::new(),
        answers_after_clear: 0,
        state_matches: true,
        anomalies: 0,
    };
    for _ in 0..rounds.max(1) {
        let start = Instant::now();
        for event in &stream.events {
            let report = index.apply(event);
            result.anomalies += report.anomalies();
        }
        result.replay_ms.push(start.elapsed().as_secs_f64() * 1e3);
        result
            .memberships_before_clear
            .push(index.stats().memberships);
        result.state_matches &= snapshot_state(&index.snapshot()) == expected;

        let start = Instant::now();
        let mut cleared = 0;
        for clear in &clears {
            cleared += index.apply(clear).cleared;
        }
        result
            .clear_all_ms
            .push(start.elapsed().as_secs_f64() * 1e3);
        result.cleared_reported.push(cleared);
        result
            .memberships_after_clear
            .push(index.stats().memberships);
        result.state_matches &= index.snapshot().blocks() == 0;
        result.answers_after_clear += stream
            .queries
            .iter()
            .filter(|q| !index.find_matches(&q.locals, &options).workers.is_empty())
            .count() as u64;
    }
    result.replay_ms_median = median(&result.replay_ms);
    result.clear_all_ms_median = median(&result.clear_all_ms);
    Some(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConfig, Eviction, generate};
    use crate::replay::backend_names;
    use crate::trace::{default_trace_path, load_trace};

    #[test]
    fn every_backend_is_empty_after_each_clear_all_and_refills_exactly() {
        let mut trace = load_trace(&default_trace_path()).expect("the trace in data/traces");
        trace.truncate(400);
        for eviction in Eviction::ALL {
            let stream = generate(&trace, &EngineConfig::new(8, 64, eviction, 5));
            assert!(stream.stats.final_memberships > 0);
            for name in backend_names() {
                let result = run(name, &stream, 3).expect("registered");
                assert!(result.is_correct(), "{name} {eviction:?}: {result:?}");
                assert_eq!(result.replay_ms.len(), 3);
                assert_eq!(result.clear_all_ms.len(), 3);
                assert_eq!(result.memberships_after_clear, [0, 0, 0]);
            }
        }
    }

    #[test]
    fn a_wrong_stream_is_caught() {
        let mut trace = load_trace(&default_trace_path()).expect("the trace in data/traces");
        trace.truncate(100);
        let mut stream = generate(&trace, &EngineConfig::new(4, 64, Eviction::LeafFirst, 5));
        // One worker too few cleared: that worker's blocks survive the clear-all.
        stream.config.workers -= 1;
        let result = run("radix", &stream, 1).expect("registered");
        assert!(!result.is_correct(), "{result:?}");
        assert!(result.memberships_after_clear[0] > 0);
    }
}
