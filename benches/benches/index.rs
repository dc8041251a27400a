//! Index operations on Workload B (`docs/benchmarks.md`, "Workloads"): ≈ 1M (worker, block)
//! memberships, 1024 sequences × 1024 blocks, 128 workers, 25 % shared prefix — store and remove
//! of a whole 1024-block sequence, and `find_matches` hit / partial / miss, for every backend.
//!
//! Run with `cargo xtask bench micro -- index` (criterion; `KVATLAS_BACKENDS=atlas` for one backend). The trace-replay harness
//! (`cargo xtask bench synthetic`) measures the same workload with percentiles, the
//! oracle check and heap figures.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvatlas_bench::replay::{backend, default_backends};
use kvatlas_bench::synthetic::{SyntheticConfig, generate};
use kvatlas_index::MatchOptions;

fn index_operations(c: &mut Criterion) {
    let workload = generate(&SyntheticConfig::default());
    let sequences = &workload.sequences;
    let options = MatchOptions::default();
    // `KVATLAS_BACKENDS=atlas,radix` limits the run to some backends (each builds a 1M index).
    let chosen = std::env::var("KVATLAS_BACKENDS").ok();
    for name in default_backends() {
        if chosen
            .as_deref()
            .is_some_and(|list| !list.split(',').any(|n| n == name))
        {
            continue;
        }
        let Some(mut index) = backend(name) else {
            continue;
        };
        for sequence in sequences {
            index.apply(&sequence.store());
        }
        let mut group = c.benchmark_group(format!("index_1M/{name}"));
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(3))
            .warm_up_time(Duration::from_secs(1));

        let hits: Vec<_> = (0..64)
            .map(|s| workload.hit(s * 13 % sequences.len()))
            .collect();
        let partials: Vec<_> = (0..64)
            .map(|s| workload.partial(s * 13 % sequences.len()))
            .collect();
        let misses: Vec<_> = (0..64).map(|s| workload.unknown(s as u64, 1024)).collect();
        for (kind, queries) in [
            ("find_hit", &hits),
            ("find_partial", &partials),
            ("find_miss", &misses),
        ] {
            let mut i = 0;
            group.bench_function(BenchmarkId::from_parameter(kind), |b| {
                b.iter(|| {
                    i = (i + 1) % queries.len();
                    black_box(index.find_matches(black_box(&queries[i]), &options))
                })
            });
        }

        // Remove (timed) then store (untimed) a whole sequence, and the reverse.
        let mut s = 0;
        group.bench_function(BenchmarkId::from_parameter("remove_1024"), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    s = (s + 7) % sequences.len();
                    let start = Instant::now();
                    black_box(index.apply(&sequences[s].remove()));
                    timed += start.elapsed();
                    index.apply(&sequences[s].store());
                }
                timed
            })
        });
        group.bench_function(BenchmarkId::from_parameter("store_1024"), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    s = (s + 7) % sequences.len();
                    index.apply(&sequences[s].remove());
                    let start = Instant::now();
                    black_box(index.apply(&sequences[s].store()));
                    timed += start.elapsed();
                }
                timed
            })
        });
        group.finish();
    }
}

criterion_group!(benches, index_operations);
criterion_main!(benches);
