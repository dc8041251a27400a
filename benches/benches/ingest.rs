//! KV-event ingestion throughput on one core: vLLM 0.33 msgpack batches built from
//! the Mooncake conversation trace at block size 16 ([`kvatlas_bench::ingest`]).
//!
//! - `ingest/stores/decode`: [`decode_batch`] only, in tokens/s;
//! - `ingest/stores/decode_convert`: + conversion, every block re-hashed from its 16 tokens with
//!   `kvatlas-hash`, in tokens/s (bar: ≥ 200M tokens/s);
//! - `ingest/mixed/decode_convert_apply`: stores and evictions in engine order, + applying the
//!   mutations to a fresh `Locked<Atlas>`, in tokens/s;
//! - `ingest/removes/decode_convert`: one-hash `BlockRemoved` batches, in events/s (bar: ≥ 1M).
//!
//! Each iteration processes the whole batch set. Run with
//! `cargo bench -p kvatlas-bench --bench ingest`; `KVATLAS_INGEST_REQUESTS` sets how many trace
//! requests are used (default 1000).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvatlas_bench::ingest::{self, EncodedBatch, IngestConfig, IngestStream};
use kvatlas_bench::trace::{default_trace_path, load_trace};
use kvatlas_events::{Converter, DropCounters, decode_batch};
use kvatlas_index::{Atlas, baseline::Locked};

fn stream() -> IngestStream {
    let trace = load_trace(&default_trace_path()).expect("the trace in data/traces");
    let requests = std::env::var("KVATLAS_INGEST_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(IngestConfig::default().requests);
    let stream = ingest::build(
        &trace,
        &IngestConfig {
            requests,
            ..IngestConfig::default()
        },
    );
    for (name, set) in [
        ("stores", &stream.stores),
        ("removes", &stream.removes),
        ("mixed", &stream.mixed),
    ] {
        eprintln!(
            "ingest/{name}: {} batches, {} stored events, {} tokens, {} removed events, {:.1} MB",
            set.batches.len(),
            set.stored_events,
            set.tokens,
            set.removed_events,
            set.bytes as f64 / 1e6
        );
    }
    stream
}

fn decode_all(batches: &[EncodedBatch]) -> usize {
    batches
        .iter()
        .map(|b| decode_batch(black_box(&b.payload)).map_or(0, |batch| batch.events.len()))
        .sum()
}

fn convert_all(converter: &Converter, batches: &[EncodedBatch]) -> usize {
    let (mut out, mut drops) = (Vec::new(), DropCounters::new());
    let mut n = 0;
    for b in batches {
        out.clear();
        let _ = converter.ingest(black_box(&b.payload), &mut out, &mut drops);
        n += out.len();
    }
    assert_eq!(drops.total(), 0, "the stream must convert without drops");
    n
}

fn ingestion(c: &mut Criterion) {
    let stream = stream();
    let converter = Converter::new(ingest::source());

    let mut group = c.benchmark_group("ingest/stores");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(stream.stores.tokens));
    group.bench_function("decode", |b| b.iter(|| decode_all(&stream.stores.batches)));
    group.bench_function("decode_convert", |b| {
        b.iter(|| convert_all(&converter, &stream.stores.batches))
    });
    group.finish();

    let mut group = c.benchmark_group("ingest/mixed");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Elements(stream.mixed.tokens));
    group.bench_function("decode_convert_apply", |b| {
        b.iter_batched(
            || Locked::new(Atlas::new()),
            |index| {
                let mut drops = DropCounters::new();
                ingest::ingest_into(&converter, &stream.mixed.batches, &index, &mut drops);
                index
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();

    let mut group = c.benchmark_group("ingest/removes");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(stream.removes.removed_events));
    group.bench_function("decode", |b| b.iter(|| decode_all(&stream.removes.batches)));
    group.bench_function("decode_convert", |b| {
        b.iter(|| convert_all(&converter, &stream.removes.batches))
    });
    group.finish();
}

criterion_group!(benches, ingestion);
criterion_main!(benches);
