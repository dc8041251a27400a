//! `e2e-bench`: the end-to-end benchmark behind `cargo xtask bench e2e` (see
//! `kvatlas_bench::e2e`): one simulated fleet, one query stream, `kvatlas serve` and Dynamo's
//! standalone indexer one after the other on this machine.
//!
//! `cargo xtask bench e2e [--runs 3] [--quick] [--json FILE] [--plots DIR]`

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use kvatlas_bench::e2e::{self, Settings};
use kvatlas_bench::zmq_floor;

/// kvatlas against Dynamo's standalone indexer on the same fleet and the same queries.
#[derive(Debug, Parser)]
struct Args {
    /// The kvatlas binary (`cargo xtask bench e2e` builds and passes target/release/kvatlas).
    #[arg(long)]
    kvatlas: PathBuf,
    /// Python of a venv with `ai-dynamo-runtime==1.6.1` (`cargo xtask bench e2e` prepares
    /// target/interop/dynamo-venv).
    #[arg(long)]
    dynamo_python: PathBuf,
    /// Dynamo's `--threads` (its own default).
    #[arg(long, default_value_t = 4)]
    dynamo_threads: usize,
    /// Runs (medians reported) [default: 3; 1 with --quick].
    #[arg(long)]
    runs: Option<usize>,
    /// Simulated engines.
    #[arg(long, default_value_t = 128)]
    workers: u32,
    /// Blocks per engine cache.
    #[arg(long, default_value_t = 512)]
    capacity: usize,
    /// Trace requests per second (the trace's timing, rescaled).
    #[arg(long, default_value_t = 2_000.0)]
    rate: f64,
    /// Offered loads of the query sweep (queries/s, ascending).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,2000,4000,6000,8000,12000,16000,24000,32000,48000,64000,96000,128000,192000"
    )]
    loads: Vec<f64>,
    /// Seconds per sweep point.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// HTTP connections (and unary gRPC tasks) of the load generator.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Prompts checked against the reference model per service and eviction order.
    #[arg(long, default_value_t = 2_000)]
    exactness_queries: usize,
    /// The freshness probe takes a stored batch at most once per this many milliseconds (it
    /// queries until the batch shows, loading the service while it measures).
    #[arg(long, default_value_t = 10.0)]
    probe_interval_ms: f64,
    /// A short run: 1 run (unless --runs says), 3,000 trace requests, 1 s sweep points, 500
    /// exactness prompts.
    #[arg(long)]
    quick: bool,
    /// Also write the runs as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the freshness CDF plot (SVG and PNG) into this directory.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Exit non-zero unless kvatlas answered every exactness query like the reference model
    /// (over HTTP and gRPC) and applied every engine's events (CI runs this).
    #[arg(long)]
    check: bool,
    /// An extra argument of every `kvatlas serve` started (repeat it for more, e.g.
    /// `--kvatlas-arg=--busy-poll`): for trying settings; the reported figures use none.
    #[arg(long, allow_hyphen_values = true)]
    kvatlas_arg: Vec<String>,
    /// The services to measure (both by default).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "kvatlas,dynamo"
    )]
    services: Vec<e2e::ServiceKind>,
    /// Skip the machine's floor (the fleet's schedule into a bare ZMQ subscriber process,
    /// measured before the services in every run and eviction order).
    #[arg(long)]
    no_zmq_floor: bool,
}

fn main() -> Result<()> {
    if let Some(received) = zmq_floor::run_if_receiver() {
        // The floor's receiver, started by this program's own run.
        return received;
    }
    let args = Args::parse();
    let zmq_floor = if args.no_zmq_floor {
        None
    } else {
        Some(std::env::current_exe().context("the path of e2e-bench, for the floor's receiver")?)
    };
    let settings = Settings {
        kvatlas: args.kvatlas,
        dynamo_python: args.dynamo_python,
        dynamo_threads: args.dynamo_threads,
        runs: args.runs.unwrap_or(if args.quick { 1 } else { 3 }),
        workers: args.workers,
        capacity: args.capacity,
        requests: args.quick.then_some(3_000),
        rate: args.rate,
        loads: args.loads,
        step: Duration::from_secs_f64(if args.quick { 1.0 } else { args.seconds }),
        connections: args.connections,
        exactness_queries: if args.quick {
            500
        } else {
            args.exactness_queries
        },
        probe_interval: Duration::try_from_secs_f64(args.probe_interval_ms / 1e3)
            .ok()
            .filter(|interval| !interval.is_zero())
            .context("--probe-interval-ms must be a positive number of milliseconds")?,
        plots: args.plots,
        services: args.services,
        sweep: true,
        replicas: 2,
        kvatlas_args: args.kvatlas_arg,
        ingest_args: Vec::new(),
        zmq_floor,
    };
    let summary = e2e::run(&settings, |step| eprintln!("e2e bench: {step}"))?;
    print!("{}", e2e::markdown(&summary));
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.check {
        e2e::check(&summary)?;
    }
    Ok(())
}
