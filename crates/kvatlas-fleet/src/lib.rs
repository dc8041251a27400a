//! A simulated fleet of inference engines, and `kvatlas demo`.
//!
//! - [`trace`]: Mooncake-style JSONL traces (the conversation trace ships in `data/traces/`).
//! - [`engine`]: deterministic mock engines — per worker an LRU prefix cache fed the trace's
//!   requests — emitting the KV events a real engine would, with the exact scores every query
//!   must get from an index (the oracle). [`engine::generate`] runs a whole trace offline;
//!   [`engine::Engines`] serves one request at a time for a live simulation.
//! - [`vllm`]: those events encoded as vLLM 0.33's KV-event batches, byte for byte.
//! - [`publish`]: the fleet on the wire — per engine a ZMQ XPUB and a replay ROUTER on loopback.
//! - [`plot`]: SVG/PNG plots (the demo's and the benchmarks').
//! - [`server`]: `kvatlas serve` as a child process on loopback (the demo's and the benchmarks').
//! - [`nats`]: a real `nats-server` (Debian's 2.9, JetStream on file storage) as a child process
//!   on loopback, restartable on the same port and store (the NATS scale-out tests' and
//!   benchmarks').
//! - [`demo`]: `kvatlas demo`, a fleet, a router and `kvatlas serve` in one command.
//!
//! The crate sits beside the service, not below it: it talks to `kvatlas serve` only as an
//! engine (ZMQ) and as a router (gRPC, `kvatlas-proto`'s client) would.

pub mod demo;
pub mod engine;
pub mod nats;
pub mod plot;
pub mod publish;
pub mod server;
pub mod trace;
pub mod vllm;
