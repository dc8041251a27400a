//! `service-bench`: the service benchmark behind `cargo xtask bench service` (see
//! `kvatlas_bench::service`): a tonic load generator against a `kvatlas serve` process.
//!
//! `cargo xtask bench service [--runs 3] [--seconds 3] [--quick] [--json FILE]`

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use kvatlas_bench::service::{self, Settings};

/// Queries against `kvatlas serve` holding the Workload A state.
#[derive(Debug, Parser)]
struct Args {
    /// The kvatlas binary (`cargo xtask bench service` builds and passes target/release/kvatlas).
    #[arg(long)]
    kvatlas: PathBuf,
    /// Runs on fresh servers (medians reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds per throughput point.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Queries of the 1-in-flight latency measurement.
    #[arg(long, default_value_t = 20_000)]
    latency_queries: usize,
    /// In-flight counts of the throughput points.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64")]
    in_flight: Vec<usize>,
    /// A short run: 1 run, 1 s points, 2,000 trace requests, 2,000 latency queries.
    #[arg(long)]
    quick: bool,
    /// Also write the runs and medians as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Worker threads of the load generator (1 = a current-thread runtime).
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Busy-poll on both sides: `kvatlas serve --busy-poll` and a load generator that keeps
    /// polling instead of sleeping between answers.
    #[arg(long)]
    busy_poll: bool,
    /// Extra `kvatlas serve` arguments (repeatable), e.g. `--serve-arg=--writer-threads=1`.
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    serve_args: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let settings = Settings {
        kvatlas: args.kvatlas,
        runs: if args.quick { 1 } else { args.runs },
        duration: Duration::from_secs_f64(if args.quick { 1.0 } else { args.seconds }),
        latency_queries: if args.quick {
            2_000
        } else {
            args.latency_queries
        },
        in_flight: args.in_flight,
        workers: 128,
        capacity: 512,
        requests: args.quick.then_some(2_000),
        serve_args: args.serve_args,
        client_threads: args.client_threads,
        busy_poll: args.busy_poll,
    };
    let summary = service::run(&settings, |step| eprintln!("service bench: {step}"))?;
    print!("{}", service::markdown(&summary));
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
