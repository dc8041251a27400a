//! kvatlas benchmarks: criterion micro-benchmarks live in `benches/` and the trace-replay
//! harness behind `cargo xtask bench` lives here. Nothing depends on this crate.

pub mod trace;
