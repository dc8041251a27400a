//! `ingest-e2e`: KV-event ingestion end to end over a loopback ZMQ socket vs in process
//! (the ingestion figures of `docs/benchmarks.md`).
//!
//! The Mooncake trace becomes vLLM 0.33 batches at block size 16 ([`kvatlas_bench::ingest`]).
//! In process, one thread decodes, converts (re-hashing every block) and applies them to a
//! `Locked<Atlas>`. Over the socket, a publisher thread sends the same pre-encoded batches as
//! `[topic, seq_be8, payload]` from a PUB (send high-water mark 0: nothing is dropped) bound on
//! `127.0.0.1` as fast as it can, to a [`Listener`] applying inline (`ApplyInline`) to its own
//! `Locked<Atlas>`; the wall time runs from the first send until the listener's counters show
//! every batch applied. Each way runs `--rounds` times on a fresh index (median reported).
//!
//! `cargo run --release -p kvatlas-bench --bin ingest-e2e -- [--requests N] [--rounds R]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvatlas_bench::ingest::{self, BatchSet, IngestConfig, TOPIC};
use kvatlas_bench::trace::{default_trace_path, load_trace};
use kvatlas_events::{
    ApplyInline, Converter, DropCounters, Listener, ListenerConfig, ListenerOptions,
};
use kvatlas_index::{Atlas, baseline::Locked};

/// Ingestion over a loopback ZMQ socket vs in process.
#[derive(Debug, Parser)]
struct Args {
    /// Use the first N trace requests (each split into 16-token blocks).
    #[arg(long, default_value_t = 1_000)]
    requests: usize,
    /// Blocks the mock engine's cache holds.
    #[arg(long, default_value_t = 65_536)]
    capacity: usize,
    /// Rounds each way (median reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Which batches to send.
    #[arg(long, value_enum, default_value = "mixed")]
    set: Set,
}

/// A view of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Set {
    /// Stores and evictions in engine order.
    Mixed,
    /// Stores only.
    Stores,
    /// Evictions only.
    Removes,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.rounds == 0 {
        bail!("--rounds must be positive");
    }
    let trace = load_trace(&default_trace_path())?;
    let stream = ingest::build(
        &trace,
        &IngestConfig {
            requests: args.requests,
            capacity: args.capacity,
        },
    );
    let set = match args.set {
        Set::Mixed => &stream.mixed,
        Set::Stores => &stream.stores,
        Set::Removes => &stream.removes,
    };
    println!(
        "stream ({:?}): {} batches, {} stored events, {} tokens, {} removed events, {:.1} MB",
        args.set,
        set.batches.len(),
        set.stored_events,
        set.tokens,
        set.removed_events,
        set.bytes as f64 / 1e6
    );

    let mut local = Vec::new();
    let mut socket = Vec::new();
    for _ in 0..args.rounds {
        local.push(in_process(set));
        socket.push(over_zmq(set)?);
    }
    let local = median(&mut local);
    let socket = median(&mut socket);
    println!();
    println!("| path | wall (ms) | tokens/s | events/s | batches/s | MB/s |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, time) in [("in process (1 thread)", local), ("loopback ZMQ", socket)] {
        let s = time.as_secs_f64();
        println!(
            "| {name} | {:.1} | {:.1}M | {:.2}M | {:.0}k | {:.0} |",
            s * 1e3,
            set.tokens as f64 / s / 1e6,
            set.events() as f64 / s / 1e6,
            set.batches.len() as f64 / s / 1e3,
            set.bytes as f64 / s / 1e6
        );
    }
    println!();
    println!(
        "socket / in-process wall-time ratio: {:.2} (bar: ≤ 2)",
        socket.as_secs_f64() / local.as_secs_f64()
    );
    Ok(())
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Decode + convert + apply on this thread, into a fresh index.
fn in_process(set: &BatchSet) -> Duration {
    let converter = Converter::new(ingest::source());
    let index = Locked::new(Atlas::new());
    let mut drops = DropCounters::new();
    let start = Instant::now();
    ingest::ingest_into(&converter, &set.batches, &index, &mut drops);
    let elapsed = start.elapsed();
    assert_eq!(drops.total(), 0, "the stream must convert without drops");
    elapsed
}

/// Publisher thread → PUB → loopback TCP → listener's SUB → decode/convert/apply inline.
fn over_zmq(set: &BatchSet) -> Result<Duration> {
    let context = zmq::Context::new();
    let publisher = context.socket(zmq::PUB)?;
    publisher.set_sndhwm(0)?;
    publisher.bind("tcp://127.0.0.1:*")?;
    let endpoint = publisher
        .get_last_endpoint()?
        .map_err(|_| anyhow::anyhow!("non-UTF-8 endpoint"))?;
    let index = Arc::new(Locked::new(Atlas::new()));
    let config = ListenerConfig::new(ingest::source(), endpoint)
        .with_topic(TOPIC)
        .with_options(ListenerOptions {
            recv_timeout: Duration::from_millis(20),
            // Large enough that the measured run never drops (a drop would be a replay, not
            // the decode-and-apply cost measured here), and still bounded.
            receive_hwm: 1 << 20,
            ..ListenerOptions::default()
        });
    let listener = Listener::start(&context, config, Arc::new(ApplyInline(index)))
        .context("starting the listener")?;

    // Wait out the slow joiner: empty batches until one is applied.
    let empty = [
        0x93, 0xcb, 0x41, 0xda, 0xc0, 0x97, 0x99, 0x4e, 0x46, 0x6d, 0x90, 0x00,
    ];
    let mut seq = 0u64;
    let deadline = Instant::now() + Duration::from_secs(10);
    while listener.state().counters.batches_applied == 0 {
        if Instant::now() > deadline {
            bail!("the listener never received a batch");
        }
        publisher.send_multipart([TOPIC, &seq.to_be_bytes(), &empty[..]], 0)?;
        seq += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    // Let stragglers of the warm-up land before the clock starts.
    std::thread::sleep(Duration::from_millis(50));
    // (The warm-up's first batch is a late join: a failed replay and a resync of the empty index.)
    let before = listener.state().counters;
    let base = before.batches_applied;
    let target = base + set.batches.len() as u64;

    let start = Instant::now();
    let elapsed = std::thread::scope(|scope| -> Result<Duration> {
        let sender = scope.spawn(move || -> Result<()> {
            for (i, batch) in set.batches.iter().enumerate() {
                let s = seq + i as u64;
                publisher.send_multipart([TOPIC, &s.to_be_bytes(), &batch.payload[..]], 0)?;
            }
            Ok(())
        });
        let deadline = start + Duration::from_secs(120);
        loop {
            let counters = listener.state().counters;
            if counters.batches_applied >= target {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out: {} of {} batches applied ({counters:?})",
                    counters.batches_applied - base,
                    set.batches.len()
                );
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let elapsed = start.elapsed();
        sender
            .join()
            .map_err(|_| anyhow::anyhow!("publisher panicked"))??;
        Ok(elapsed)
    })?;
    let state = listener.stop();
    let c = &state.counters;
    if c.drops.total() != 0
        || c.gaps != before.gaps
        || c.resyncs != before.resyncs
        || c.batch_decode_errors != 0
    {
        bail!("lossy run: {c:?}");
    }
    Ok(elapsed)
}
