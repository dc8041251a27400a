//! kvatlas benchmarks: criterion micro-benchmarks live in `benches/` and the trace-replay
//! harness behind `cargo xtask bench` lives here. Nothing depends on this crate.
//!
//! The harness: [`trace`] loads a Mooncake trace (and applies the trace-length and duplication
//! factors), [`engine`] runs it through deterministic mock engines (per-worker LRU caches, random
//! or KV-aware routing) into a stream of queries, oracle scores and KV events;
//! [`replay`] replays that stream against each index backend exactly (interleaved, every query
//! checked), [`openloop`] replays it deadline-driven through the concurrent write front and sweeps
//! the offered load; [`synthetic`], [`concurrent`] and [`clear`] are
//! Workloads B, C and D;
//! [`plot`] draws the sweep and latency CDF; [`ingest`] turns the trace into vLLM msgpack event
//! batches for the KV-event ingestion benchmarks; [`service`] loads a `kvatlas serve` process with
//! Workload A and measures its gRPC queries (`cargo xtask bench service`).
//!
//! The `kvatlas-bench` binary is [`cli`] (one subcommand per preset, resolved into a
//! [`harness::Plan`]), [`harness`] (runs the plan's workloads) and [`render`] (its markdown tables
//! and plots).

pub mod clear;
pub mod cli;
pub mod concurrent;
pub mod e2e;
pub mod fleet;
pub mod harness;
pub mod http;
pub mod ingest;
pub mod log_floor;
pub mod openloop;
pub mod plot;
pub mod render;
pub mod replay;
pub mod scale_out;
pub mod service;
pub mod snapshot;
pub mod synthetic;
pub mod zmq_floor;

/// The mock engines, from `kvatlas-fleet` (where `kvatlas demo` drives them too).
pub use kvatlas_fleet::engine;
/// Mooncake traces, from `kvatlas-fleet`.
pub use kvatlas_fleet::trace;
