//! `snapshot-bench`: the recovery benchmark behind `cargo xtask bench snapshot` (see
//! `kvatlas_bench::snapshot`): native snapshots written, streamed and restored, and a replica
//! bootstrapped from a peer, through `kvatlas serve` processes.
//!
//! `cargo xtask bench snapshot [--runs 3] [--states workload-a,1m,10m] [--quick] [--json FILE]`

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvatlas_bench::snapshot::{self, Settings, StateKind};

/// Snapshot size, write, stream, restore and peer bootstrap times.
#[derive(Debug, Parser)]
struct Args {
    /// The kvatlas binary (`cargo xtask bench snapshot` builds and passes target/release/kvatlas).
    #[arg(long)]
    kvatlas: PathBuf,
    /// Runs per state (medians reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// States: `workload-a`, or a synthetic fleet's memberships (`1m`, `10m`, `250k`).
    #[arg(long, value_delimiter = ',', default_value = "workload-a,1m,10m")]
    states: Vec<String>,
    /// A short run: 1 run of Workload A and a 100k-membership fleet.
    #[arg(long)]
    quick: bool,
    /// Also write the runs and medians as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn state(name: &str) -> Result<StateKind> {
    if name == "workload-a" {
        return Ok(StateKind::WorkloadA);
    }
    let (digits, scale) = match name.to_ascii_lowercase() {
        n if n.ends_with('m') => (n.trim_end_matches('m').to_owned(), 1_000_000),
        n if n.ends_with('k') => (n.trim_end_matches('k').to_owned(), 1_000),
        n => (n, 1),
    };
    let n: u64 = digits
        .parse()
        .with_context(|| format!("unknown state `{name}` (workload-a, 1m, 10m, 250k …)"))?;
    if n == 0 {
        bail!("a synthetic state needs at least one membership");
    }
    Ok(StateKind::Synthetic(n * scale))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let states = if args.quick {
        vec![StateKind::WorkloadA, StateKind::Synthetic(100_000)]
    } else {
        args.states
            .iter()
            .map(|s| state(s))
            .collect::<Result<_>>()?
    };
    let settings = Settings {
        kvatlas: args.kvatlas,
        runs: if args.quick { 1 } else { args.runs },
        states,
        scratch: snapshot::default_scratch(),
    };
    let reports = snapshot::run(&settings, |step| eprintln!("snapshot bench: {step}"))?;
    print!("{}", snapshot::markdown(&reports));
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&reports)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
