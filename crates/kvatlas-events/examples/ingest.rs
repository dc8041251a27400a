//! `ingest`: ingest KV events from engines' ZMQ endpoints into an in-memory `Atlas` index and
//! print, every few seconds, each listener's state, the index's stats and (optionally) the
//! index's answer for a prompt. For trying the listener edge by hand:
//!
//! ```text
//! cargo run --release -p kvatlas-events --example ingest -- \
//!     --source 1=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 \
//!     --source 1:1=tcp://127.0.0.1:5558,replay=tcp://127.0.0.1:5559 \
//!     --block-size 16 --engine vllm --interval 5 --query-tokens prompt.txt
//! ```
//!
//! A source is `WORKER[:DP_RANK]=ENDPOINT[,replay=ENDPOINT][,topic=PREFIX][,bind]`; `bind`
//! makes the listener bind its SUB for engines that connect. The query file holds token ids
//! separated by whitespace or commas. Stop with Ctrl-C (or `--duration`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use kvatlas_events::{
    EngineKind, ListenerConfig, ListenerState, Listeners, MutationSink, SocketMode, Source,
};
use kvatlas_hash::{BlockHasher, BlockSize, LocalBlockHash};
use kvatlas_index::{Atlas, Locked, MatchOptions, SharedKvIndex, ThreadPool, Tier};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Engine {
    Vllm,
    Sglang,
}

/// Ingest KV events from vLLM / SGLang ZMQ publishers and print the index's state.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// `WORKER[:DP_RANK]=ENDPOINT[,replay=ENDPOINT][,topic=PREFIX][,bind]` (repeatable).
    #[arg(long = "source", required = true)]
    sources: Vec<String>,
    /// The engines' block (page) size in tokens.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// The producing engine.
    #[arg(long, value_enum, default_value = "vllm")]
    engine: Engine,
    /// Default SUB topic prefix for sources without `topic=`.
    #[arg(long, default_value = "")]
    topic: String,
    /// Seconds between reports.
    #[arg(long, default_value_t = 5)]
    interval: u64,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long)]
    duration: Option<u64>,
    /// A file of token ids; each report also prints which workers hold its prefix.
    #[arg(long)]
    query_tokens: Option<std::path::PathBuf>,
    /// Index writer threads.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Mutations queued per writer before listeners are backpressured.
    #[arg(long, default_value_t = 4096)]
    queue: usize,
}

/// A parsed `--source`.
#[derive(Debug)]
struct SourceSpec {
    worker_id: u64,
    dp_rank: u32,
    endpoint: String,
    replay: Option<String>,
    topic: Option<String>,
    bind: bool,
}

fn parse_source(spec: &str) -> Result<SourceSpec> {
    let (who, rest) = spec
        .split_once('=')
        .with_context(|| format!("source {spec:?}: expected WORKER[:DP]=ENDPOINT"))?;
    let (worker, dp) = match who.split_once(':') {
        Some((w, d)) => (w, Some(d)),
        None => (who, None),
    };
    let worker_id = worker
        .trim()
        .parse()
        .with_context(|| format!("source {spec:?}: bad worker id {worker:?}"))?;
    let dp_rank = match dp {
        Some(d) => d
            .trim()
            .parse()
            .with_context(|| format!("source {spec:?}: bad dp rank {d:?}"))?,
        None => 0,
    };
    let mut parts = rest.split(',');
    let endpoint = parts.next().unwrap_or_default().trim().to_owned();
    if endpoint.is_empty() {
        bail!("source {spec:?}: empty endpoint");
    }
    let mut out = SourceSpec {
        worker_id,
        dp_rank,
        endpoint,
        replay: None,
        topic: None,
        bind: false,
    };
    for part in parts {
        match part.trim().split_once('=') {
            Some(("replay", v)) => out.replay = Some(v.to_owned()),
            Some(("topic", v)) => out.topic = Some(v.to_owned()),
            None if part.trim() == "bind" => out.bind = true,
            _ => bail!("source {spec:?}: unknown option {part:?}"),
        }
    }
    Ok(out)
}

fn read_tokens(path: &std::path::Path) -> Result<Vec<u32>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().with_context(|| format!("bad token id {t:?}")))
        .collect()
}

fn print_listener(state: &ListenerState) {
    let c = &state.counters;
    println!(
        "  listener {} worker {}:{} {} [{}] last_seq={} received={} applied={} replayed={} \
         duplicates={} gaps={} resyncs={} (restarts={}) bad_frames={} decode_errors={} \
         enqueued={} backpressure_waits={} ({} ms)",
        state.id,
        state.source.worker_id,
        state.source.dp_rank,
        state.endpoint,
        state.status,
        state
            .last_seq
            .map_or_else(|| "-".to_owned(), |s| s.to_string()),
        c.batches_received,
        c.batches_applied,
        c.batches_replayed,
        c.duplicates,
        c.gaps,
        c.resyncs,
        c.restarts,
        c.bad_frames,
        c.batch_decode_errors,
        c.mutations_enqueued,
        c.backpressure_waits,
        c.backpressure_micros / 1000,
    );
    let drops: Vec<String> = c.drops.iter().map(|(r, n)| format!("{r}={n}")).collect();
    if !drops.is_empty() {
        println!("    drops: {}", drops.join(" "));
    }
    if let Some(idle) = state.since_last_batch {
        println!("    last live batch {:.1} s ago", idle.as_secs_f64());
    }
    if let Some(error) = &state.last_error {
        println!("    last error: {error}");
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let block_size = BlockSize::new(args.block_size).context("--block-size must be positive")?;
    let engine = match args.engine {
        Engine::Vllm => EngineKind::Vllm,
        Engine::Sglang => EngineKind::Sglang,
    };
    let query: Option<Vec<LocalBlockHash>> = match &args.query_tokens {
        Some(path) => {
            let tokens = read_tokens(path)?;
            let hasher = BlockHasher::with_block_size(block_size);
            Some(hasher.local_hashes(&tokens).collect())
        }
        None => None,
    };

    let pool = Arc::new(
        ThreadPool::new(Locked::new(Atlas::new()), args.writers, args.queue)
            .context("starting the index writers")?,
    );
    let sink: Arc<dyn MutationSink> = pool.clone();
    let listeners = Listeners::new(sink);
    for spec in &args.sources {
        let spec = parse_source(spec)?;
        let source = Source {
            worker_id: spec.worker_id,
            dp_rank: spec.dp_rank,
            block_size,
            engine,
        };
        let mut config = ListenerConfig::new(source, spec.endpoint.clone())
            .with_topic(
                spec.topic
                    .unwrap_or_else(|| args.topic.clone())
                    .into_bytes(),
            )
            .with_mode(if spec.bind {
                SocketMode::Bind
            } else {
                SocketMode::Connect
            });
        if let Some(replay) = spec.replay {
            config = config.with_replay_endpoint(replay);
        }
        let id = listeners
            .start(config)
            .with_context(|| format!("starting the listener for {}", spec.endpoint))?;
        println!(
            "started listener {id} for worker {}:{} on {}",
            spec.worker_id, spec.dp_rank, spec.endpoint
        );
    }

    let started = Instant::now();
    let interval = Duration::from_secs(args.interval.max(1));
    loop {
        std::thread::sleep(interval);
        println!("--- {:.1} s", started.elapsed().as_secs_f64());
        for state in listeners.list() {
            print_listener(&state);
        }
        let stats = pool.index().stats();
        println!(
            "  index: {} worker ranks, {} memberships, {:.1} MiB",
            stats.workers.len(),
            stats.memberships,
            stats.heap_bytes as f64 / (1024.0 * 1024.0)
        );
        for w in &stats.workers {
            let tiers: Vec<String> = Tier::ALL
                .iter()
                .zip(w.per_tier)
                .filter(|(_, n)| *n > 0)
                .map(|(t, n)| format!("{t:?}={n}"))
                .collect();
            println!(
                "    worker {}:{} {}",
                w.worker.worker_id,
                w.worker.dp_rank,
                tiers.join(" ")
            );
        }
        if let Some(query) = &query {
            let options = MatchOptions {
                tiered: true,
                ..MatchOptions::default()
            };
            let matches = pool.find_matches(query, &options);
            println!("  query ({} blocks):", query.len());
            if matches.workers.is_empty() {
                println!("    no worker holds its first block");
            }
            for m in &matches.workers {
                println!(
                    "    worker {}:{} device={} host={} any={}",
                    m.worker.worker_id, m.worker.dp_rank, m.device, m.host, m.disk
                );
            }
        }
        if args
            .duration
            .is_some_and(|d| started.elapsed() >= Duration::from_secs(d))
        {
            break;
        }
    }
    for state in listeners.stop_all() {
        print_listener(&state);
    }
    Ok(())
}
