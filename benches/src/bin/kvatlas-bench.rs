//! `kvatlas-bench`: the benchmark harness binary behind `cargo xtask bench`.

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use kvatlas_bench::trace::{TRACE_BLOCK_TOKENS, block_tokens, default_trace_path, load_trace};
use kvatlas_hash::BlockHasher;

/// Benchmarks kvatlas on a Mooncake-style trace.
#[derive(Debug, Parser)]
struct Args {
    /// Smoke run (≤ 1 minute): a slice of the trace.
    #[arg(long)]
    quick: bool,
    /// JSONL trace (default: the shared Mooncake conversation trace).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Block size the router hashes prompts with, in tokens.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let path = args.trace.clone().unwrap_or_else(default_trace_path);
    let mut trace = load_trace(&path)?;
    if args.quick {
        trace.truncate(2_000);
    }
    let hasher = BlockHasher::new(args.block_size)?;

    // Router-side work per request: expand the prompt to tokens and hash it into local hashes.
    let mut tokens = Vec::new();
    let mut locals = Vec::new();
    let mut hashed_tokens = 0usize;
    let mut hashing = std::time::Duration::ZERO;
    for request in &trace {
        tokens.clear();
        for &id in &request.hash_ids {
            block_tokens(id, TRACE_BLOCK_TOKENS, &mut tokens);
        }
        locals.clear();
        let start = Instant::now();
        hasher.extend_local_hashes(&tokens, &mut locals);
        hashing += start.elapsed();
        hashed_tokens += tokens.len();
    }
    let secs = hashing.as_secs_f64();
    println!("| requests | tokens hashed | block size | hashing time | tokens/s |");
    println!("|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {:.1} ms | {:.0}M |",
        trace.len(),
        hashed_tokens,
        args.block_size,
        secs * 1e3,
        hashed_tokens as f64 / secs / 1e6
    );
    Ok(())
}
