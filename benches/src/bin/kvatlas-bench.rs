//! `kvatlas-bench`: the benchmark harness behind `cargo xtask bench`, one subcommand per preset
//! (`suite`, the default, `conversation`, `synthetic`, `concurrent`, `clear`); the command line is
//! `kvatlas_bench::cli`, the runs `kvatlas_bench::harness`, the tables `kvatlas_bench::render`.
//!
//! Markdown tables go to stdout, progress to stderr (hidden when it is not a terminal), results to
//! `--json`, plots to `--plot-dir`. Exits non-zero if any correctness check fails; an open-loop
//! run that does not keep up is reported as invalid, not as a failure.

use anyhow::{Result, bail};
use clap::Parser;
use kvatlas_bench::cli::{self, Cli};

fn main() -> Result<()> {
    let failures = cli::run(Cli::parse())?;
    if !failures.is_empty() {
        for failure in &failures {
            eprintln!("MISMATCH: {failure}");
        }
        bail!("{} correctness check(s) failed", failures.len());
    }
    Ok(())
}
