//! Mooncake-style JSONL traces: loading, and turning hash ids into deterministic token blocks.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Tokens per trace block in the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt length in tokens.
    #[serde(default)]
    pub input_length: u64,
    /// Generated tokens.
    #[serde(default)]
    pub output_length: u64,
    /// One id per 512-token prefix block; equal ids at equal positions are the same block.
    pub hash_ids: Vec<u64>,
}

/// The shared Mooncake conversation trace, beside the project (`../shared/traces/`).
pub fn default_trace_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/mooncake_conversation_trace.jsonl")
}

/// Reads a JSONL trace; blank lines are skipped, a malformed line is an error naming it.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let mut requests = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let request: TraceRequest = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: malformed trace line", path.display(), number + 1))?;
        requests.push(request);
    }
    Ok(requests)
}

/// Deterministic tokens of one trace block: a splitmix64 stream seeded by the hash id, so the same
/// id always yields the same `len` tokens and different ids yield different blocks.
pub fn block_tokens(hash_id: u64, len: usize, out: &mut Vec<u32>) {
    let mut state = hash_id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x6b76_6174_6c61_7321;
    out.extend((0..len).map(|_| {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % 151_936) as u32
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_tokens_are_deterministic_and_distinct() {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        block_tokens(7, 16, &mut a);
        block_tokens(7, 16, &mut b);
        block_tokens(8, 16, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.len(), 16);
    }

    #[test]
    fn the_shared_trace_loads() {
        let trace = load_trace(&default_trace_path()).expect("shared trace present");
        assert_eq!(trace.len(), 12_031);
        assert_eq!(trace[0].hash_ids[..3], [0, 1, 2]);
    }
}
