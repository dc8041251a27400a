//! Hashing throughput: kvatlas-hash against raw XXH3-64 over the same bytes (the physical limit).
//!
//! Run with `cargo xtask bench micro` (or `cargo bench -p kvatlas-bench --bench hashing`).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvatlas_hash::{BASE_SEED, BlockHasher, LocalBlockHash, sequence_hashes};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Deterministic pseudo-random token ids (splitmix64, folded into a 150k vocabulary).
fn tokens(count: usize) -> Vec<u32> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    (0..count)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % 150_000) as u32
        })
        .collect()
}

fn le_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Local hashing of one block and of a 128k-token prompt, kvatlas vs raw XXH3 over ready bytes.
fn local_hashing(c: &mut Criterion) {
    for block_size in [16usize, 64] {
        let hasher = BlockHasher::new(block_size as u32).expect("valid block size");
        let block = tokens(block_size);
        let bytes = le_bytes(&block);
        let mut group = c.benchmark_group(format!("local_hash/block_{block_size}"));
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.bench_function("raw_xxh3", |b| {
            b.iter(|| xxh3_64_with_seed(black_box(&bytes), BASE_SEED))
        });
        group.bench_function("kvatlas", |b| {
            b.iter(|| hasher.hash_block(black_box(&block)))
        });
        group.finish();

        let prompt = tokens(128 * 1024);
        let prompt_bytes = le_bytes(&prompt);
        let block_bytes = block_size * 4;
        let mut out = Vec::with_capacity(prompt.len() / block_size);
        let mut group = c.benchmark_group(format!("prompt_128k/block_{block_size}"));
        group.throughput(Throughput::Bytes(prompt_bytes.len() as u64));
        group.bench_function("raw_xxh3", |b| {
            b.iter(|| {
                out.clear();
                out.extend(
                    black_box(&prompt_bytes)
                        .chunks_exact(block_bytes)
                        .map(|chunk| LocalBlockHash::new(xxh3_64_with_seed(chunk, BASE_SEED))),
                );
                out.len()
            })
        });
        group.bench_function("kvatlas", |b| {
            b.iter(|| {
                out.clear();
                hasher.extend_local_hashes(black_box(&prompt), &mut out);
                out.len()
            })
        });
        group.finish();
    }
}

/// Sequence hashing: chaining 8192 local hashes (a 128k-token prompt at block size 16).
fn sequence_hashing(c: &mut Criterion) {
    let hasher = BlockHasher::new(16).expect("valid block size");
    let locals: Vec<LocalBlockHash> = hasher.local_hashes(&tokens(128 * 1024)).collect();
    let mut group = c.benchmark_group("sequence_hash/8192_blocks");
    group.throughput(Throughput::Elements(locals.len() as u64));
    // The raw baseline chains too (each hash feeds the next), as the contract does: a sequence
    // hash is inherently a dependency chain, so this is its physical limit.
    group.bench_function("raw_xxh3_chained", |b| {
        b.iter(|| {
            black_box(&locals).iter().fold(0u64, |previous, local| {
                let mut bytes = [0u8; 16];
                bytes[..8].copy_from_slice(&previous.to_le_bytes());
                bytes[8..].copy_from_slice(&local.get().to_le_bytes());
                xxh3_64_with_seed(&bytes, BASE_SEED)
            })
        })
    });
    group.bench_function("kvatlas", |b| {
        b.iter(|| {
            sequence_hashes(black_box(&locals).iter().copied()).fold(0u64, |a, s| a ^ s.get())
        })
    });
    group.finish();
}

criterion_group!(benches, local_hashing, sequence_hashing);
criterion_main!(benches);
