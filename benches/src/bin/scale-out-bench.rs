//! `scale-out-bench`: scale-out over NATS JetStream behind `cargo xtask bench scale-out` (see
//! `kvatlas_bench::scale_out`): `kvatlas serve` alone against an ingest → nats-server →
//! replicas, on the same simulated fleet in the same run, paced (lag, bootstrap, wire bytes)
//! and unpaced (event rate).
//!
//! `cargo xtask bench scale-out [--runs 3] [--quick] [--json FILE] [--check]`

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use kvatlas_bench::e2e::{self, ServiceKind, Settings};
use kvatlas_bench::{scale_out, zmq_floor};

/// kvatlas alone against kvatlas through NATS JetStream, on the same fleet.
#[derive(Debug, Parser)]
struct Args {
    /// The kvatlas binary (`cargo xtask bench scale-out` builds and passes target/release/kvatlas).
    #[arg(long)]
    kvatlas: PathBuf,
    /// Runs (medians reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Simulated engines.
    #[arg(long, default_value_t = 128)]
    workers: u32,
    /// Blocks per engine cache.
    #[arg(long, default_value_t = 512)]
    capacity: usize,
    /// Trace requests per second of the paced run (Workload A's pace).
    #[arg(long, default_value_t = 2_000.0)]
    rate: f64,
    /// Trace requests per second of the unpaced run (as fast as the fleet publishes).
    #[arg(long, default_value_t = 1_000_000.0)]
    unpaced_rate: f64,
    /// Replicas behind the ingest.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Prompts checked against the reference model per service (on every replica).
    #[arg(long, default_value_t = 500)]
    exactness_queries: usize,
    /// A short run: 1 run, 3,000 trace requests.
    #[arg(long)]
    quick: bool,
    /// Also write both summaries as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Exit non-zero unless every replica answered like the reference model and saw every
    /// engine's events.
    #[arg(long)]
    check: bool,
    /// An extra argument of every `kvatlas serve` started (repeat it for more, e.g.
    /// `--kvatlas-arg=--busy-poll`): for trying settings; the reported figures use none.
    #[arg(long, allow_hyphen_values = true)]
    kvatlas_arg: Vec<String>,
    /// The ingest also keeps an index of its own and could answer queries (`kvatlas serve
    /// --publish-to` alone). By default it runs `--publish-only`: the ingest role of the
    /// scale-out layout, in which the replicas answer the queries.
    #[arg(long)]
    indexing_ingest: bool,
    /// An extra argument of the ingest only (repeat it for more): for trying settings.
    #[arg(long, allow_hyphen_values = true)]
    ingest_arg: Vec<String>,
}

fn main() -> Result<()> {
    if let Some(received) = zmq_floor::run_if_receiver() {
        // The floor's receiver, started by this program's own paced run.
        return received;
    }
    let args = Args::parse();
    let floor =
        std::env::current_exe().context("the path of scale-out-bench, for the floor's receiver")?;
    let mut ingest_args = Vec::new();
    if !args.indexing_ingest {
        ingest_args.push("--publish-only".to_owned());
    }
    ingest_args.extend(args.ingest_arg.iter().cloned());
    let ingest = scale_out::ingest_description(!args.indexing_ingest, &args.ingest_arg);
    let settings = |rate: f64, zmq_floor: Option<PathBuf>| Settings {
        kvatlas: args.kvatlas.clone(),
        dynamo_python: PathBuf::new(),
        dynamo_threads: 0,
        runs: if args.quick { 1 } else { args.runs },
        workers: args.workers,
        capacity: args.capacity,
        requests: args.quick.then_some(3_000),
        rate,
        loads: Vec::new(),
        step: Duration::from_secs(1),
        connections: 1,
        exactness_queries: args.exactness_queries,
        probe_interval: Duration::from_millis(10),
        plots: None,
        services: vec![ServiceKind::Kvatlas, ServiceKind::KvatlasNats],
        sweep: false,
        replicas: args.replicas,
        kvatlas_args: args.kvatlas_arg.clone(),
        ingest_args: ingest_args.clone(),
        zmq_floor,
    };
    // The machine's floor under the lag: paced only.
    let paced = e2e::run(&settings(args.rate, Some(floor)), |step| {
        eprintln!("scale-out bench (paced): {step}");
    })?;
    let unpaced = e2e::run(&settings(args.unpaced_rate, None), |step| {
        eprintln!("scale-out bench (unpaced): {step}");
    })?;
    print!("{}", scale_out::markdown(&paced, &unpaced, &ingest));
    if let Some(path) = args.json {
        let both = serde_json::json!({ "ingest": ingest, "paced": paced, "unpaced": unpaced });
        std::fs::write(&path, serde_json::to_string_pretty(&both)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.check {
        e2e::check(&paced)?;
        e2e::check(&unpaced)?;
    }
    Ok(())
}
