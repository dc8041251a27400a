//! kvatlas benchmarks: criterion micro-benchmarks live in `benches/` and the trace-replay
//! harness behind `cargo xtask bench` lives here. Nothing depends on this crate.
//!
//! The harness: [`trace`] loads a Mooncake trace, [`engine`] runs it through deterministic mock
//! engines (per-worker LRU caches) into a stream of queries, oracle scores and KV events, and
//! [`replay`] replays that stream against each index backend.

pub mod engine;
pub mod replay;
pub mod trace;
