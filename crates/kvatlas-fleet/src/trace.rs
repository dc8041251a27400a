//! Mooncake-style JSONL traces: loading, the preprocessing options of Dynamo's `mooncake_bench`
//! (trace-length factor, duplication factor), and turning hash ids into deterministic token blocks.

use std::io::BufRead;
use std::path::{Path, PathBuf};

/// Why a trace could not be read or transformed.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("reading trace {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line is not a trace request.
    #[error("{path}:{line}: malformed trace line: {source}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What the JSON parser said.
        source: serde_json::Error,
    },
    /// A trace-length or duplication factor of 0, or one that overflows the hash ids.
    #[error("{0}")]
    Factor(String),
}

type Result<T> = std::result::Result<T, TraceError>;

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

/// The Mooncake conversation trace shipped in the repository (`data/traces/`, Apache-2.0).
pub fn default_trace_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/mooncake_conversation_trace.jsonl")
}

/// Reads a JSONL trace; blank lines are skipped, a malformed line is an error naming it.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>> {
    let read = |source| TraceError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let mut requests = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(read)?;
        if line.trim().is_empty() {
            continue;
        }
        let request: TraceRequest =
            serde_json::from_str(&line).map_err(|source| TraceError::Malformed {
                path: path.to_owned(),
                line: number + 1,
                source,
            })?;
        requests.push(request);
    }
    Ok(requests)
}

/// The largest hash id of `trace` (`None` if it has no blocks).
pub fn max_hash_id(trace: &[TraceRequest]) -> Option<u64> {
    trace.iter().flat_map(|r| r.hash_ids.iter().copied()).max()
}

/// The trace-length factor (`--trace-length-factor k`, as Dynamo's harness): every hash id `h`
/// becomes the `k` ids `h*k, h*k+1, …, h*k+k-1`, so every request is `k` times as many blocks
/// (each block standing for `512 / k` tokens) with the same sharing structure. `k = 1` is the
/// identity; `k = 0` or an id overflowing `u64` is an error.
pub fn scale_length(trace: &mut [TraceRequest], k: u64) -> Result<()> {
    if k == 0 {
        return Err(TraceError::Factor(
            "the trace-length factor must be at least 1".into(),
        ));
    }
    if k == 1 {
        return Ok(());
    }
    if max_hash_id(trace).is_some_and(|max| {
        max.checked_mul(k)
            .and_then(|x| x.checked_add(k - 1))
            .is_none()
    }) {
        return Err(TraceError::Factor(format!(
            "trace-length factor {k} overflows the trace's hash ids"
        )));
    }
    for request in trace {
        request.hash_ids = request
            .hash_ids
            .iter()
            .flat_map(|&h| (h * k)..(h * k + k))
            .collect();
    }
    Ok(())
}

/// The duplication factor (`--duplication-factor d`, as Dynamo's harness): `d` structurally
/// identical copies of the trace with disjoint hash ids — copy `c` adds `(max_id + 1) * c` to every
/// id — whose requests are interleaved by timestamp (a stable merge: at equal timestamps, request
/// order first, then copy order). `d = 1` is the identity; `d = 0` or an id overflowing `u64` is an
/// error.
pub fn duplicate(trace: Vec<TraceRequest>, d: u64) -> Result<Vec<TraceRequest>> {
    if d == 0 {
        return Err(TraceError::Factor(
            "the duplication factor must be at least 1".into(),
        ));
    }
    if d == 1 {
        return Ok(trace);
    }
    let stride = max_hash_id(&trace).map_or(0, |max| max.saturating_add(1));
    // The last copy's largest id is stride * d - 1.
    if stride.checked_mul(d).is_none() {
        return Err(TraceError::Factor(format!(
            "duplication factor {d} overflows the trace's hash ids"
        )));
    }
    let mut out = Vec::with_capacity(trace.len() * d as usize);
    for request in &trace {
        for copy in 0..d {
            let offset = stride * copy;
            out.push(TraceRequest {
                hash_ids: request.hash_ids.iter().map(|&h| h + offset).collect(),
                ..request.clone()
            });
        }
    }
    // The trace is normally sorted already; a stable sort keeps (request, copy) order at ties.
    out.sort_by_key(|r| r.timestamp);
    Ok(out)
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

    fn request(timestamp: u64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp,
            input_length: 512 * ids.len() as u64,
            output_length: 7,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn the_length_factor_splits_every_id_into_k_ids() {
        let mut trace = vec![request(0, &[0, 1, 2]), request(5, &[0, 1, 9])];
        scale_length(&mut trace, 1).expect("identity");
        assert_eq!(trace[1].hash_ids, [0, 1, 9]);
        scale_length(&mut trace, 4).expect("fits");
        assert_eq!(trace[0].hash_ids, (0..12).collect::<Vec<_>>());
        assert_eq!(trace[1].hash_ids[8..], [36, 37, 38, 39]);
        assert!(scale_length(&mut trace, 0).is_err());
        assert!(scale_length(&mut [request(0, &[u64::MAX / 2])], 3).is_err());

        // On the shared trace: every request has exactly k times its blocks, and sharing is
        // preserved (distinct ids multiply by k too).
        let original = load_trace(&default_trace_path()).expect("the trace in data/traces");
        let mut scaled = original[..500].to_vec();
        scale_length(&mut scaled, 3).expect("fits");
        for (a, b) in original.iter().zip(&scaled) {
            assert_eq!(b.hash_ids.len(), 3 * a.hash_ids.len());
            assert_eq!(b.timestamp, a.timestamp);
        }
        let distinct = |t: &[TraceRequest]| {
            t.iter()
                .flat_map(|r| r.hash_ids.iter())
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        assert_eq!(distinct(&scaled), 3 * distinct(&original[..500]));
    }

    #[test]
    fn duplication_makes_disjoint_interleaved_copies() {
        let trace = vec![
            request(0, &[0, 1, 2]),
            request(5, &[0, 3]),
            request(5, &[4]),
        ];
        let copies = duplicate(trace.clone(), 3).expect("fits");
        assert_eq!(copies.len(), 9);
        // Interleaved by timestamp, request order then copy order at ties.
        let firsts: Vec<(u64, u64)> = copies
            .iter()
            .map(|r| (r.timestamp, r.hash_ids[0]))
            .collect();
        assert_eq!(
            firsts,
            [
                (0, 0),
                (0, 5),
                (0, 10),
                (5, 0),
                (5, 5),
                (5, 10),
                (5, 4),
                (5, 9),
                (5, 14)
            ]
        );
        // Each copy is the original shifted by (max + 1) * copy; copies share no id.
        for (i, r) in copies.iter().enumerate() {
            let original = &trace[i / 3];
            let offset = 5 * (i % 3) as u64;
            assert_eq!(
                r.hash_ids,
                original
                    .hash_ids
                    .iter()
                    .map(|h| h + offset)
                    .collect::<Vec<_>>()
            );
            assert_eq!(r.output_length, original.output_length);
        }
        let ids_of = |copy: u64| -> std::collections::HashSet<u64> {
            copies
                .iter()
                .flat_map(|r| r.hash_ids.iter().copied())
                .filter(|h| h / 5 == copy)
                .collect()
        };
        assert_eq!(ids_of(0).len(), 5);
        assert_eq!(ids_of(1).len(), 5);
        assert!(ids_of(0).is_disjoint(&ids_of(1)));
        assert_eq!(duplicate(trace.clone(), 1).expect("identity"), trace);
        assert!(duplicate(trace, 0).is_err());

        // On the shared trace: d copies of every block count, and disjoint distinct ids.
        let original = load_trace(&default_trace_path()).expect("the trace in data/traces");
        let part = original[..300].to_vec();
        let blocks: usize = part.iter().map(|r| r.hash_ids.len()).sum();
        let stride = max_hash_id(&part).expect("blocks") + 1;
        let copies = duplicate(part, 2).expect("fits");
        assert_eq!(
            copies.iter().map(|r| r.hash_ids.len()).sum::<usize>(),
            2 * blocks
        );
        assert!(copies.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let (a, b): (Vec<_>, Vec<_>) = copies
            .iter()
            .flat_map(|r| r.hash_ids.iter().copied())
            .partition(|&h| h < stride);
        let a: std::collections::HashSet<u64> = a.into_iter().collect();
        let b: std::collections::HashSet<u64> = b.into_iter().map(|h| h - stride).collect();
        assert_eq!(a, b);
    }

    #[test]
    fn the_shared_trace_loads() {
        let trace = load_trace(&default_trace_path()).expect("the trace in data/traces");
        assert_eq!(trace.len(), 12_031);
        assert_eq!(trace[0].hash_ids[..3], [0, 1, 2]);
    }
}
