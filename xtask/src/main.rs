//! kvatlas's task runner: `cargo xtask <task>`.
//!
//! - `ci`: everything CI checks (fmt, clippy, tests, docs, tidy, the fuzz crate and the sans-IO
//!   event core compile, quick bench); installs Debian's `nats-server` for the tests if missing;
//! - `tidy`: the workspace's layering rules, read from `cargo metadata`;
//! - `bench [PRESET] [--quick] [args…]`: the trace-replay harness (`kvatlas-bench`; PRESET is
//!   `suite`, the default, `conversation`, `synthetic`, `concurrent` or `clear`); `bench micro`:
//!   criterion benches;
//! - `interop [setup]`: the listener against vLLM's and SGLang's real publishers (PyPI wheels);
//! - `fuzz-corpus [DIR]`: writes the decoder's fixtures as the fuzz seed corpus.

mod interop;
mod nats;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  ci                 fmt --check, clippy -D warnings, tests, loom model, docs -D warnings, tidy,
                     check kvatlas-events --no-default-features, check the fuzz crate (fuzz/,
                     stable, --cfg fuzzing, target/fuzz-check), bench --quick; the tests need
                     nats-server (KVATLAS_NATS_SERVER, PATH or /usr/sbin): apt-get installs it
                     when missing and running as root
  tidy               check the crate layering (see docs/ARCHITECTURE.md)
  bench [PRESET] [ARGS…]
                     the trace-replay harness kvatlas-bench: PRESET is suite (the default),
                     conversation, synthetic, concurrent or clear, ARGS the preset's flags
                     (--quick = smoke run; `cargo xtask bench PRESET --help` lists them)
  bench micro [ARGS…] run the criterion micro-benchmarks (ARGS go to cargo bench)
  bench service [ARGS…] the gRPC service under load: kvatlas serve with the Workload A state
                     (ARGS go to service-bench: --runs, --seconds, --in-flight, --quick, --json)
  bench snapshot [ARGS…] snapshots and recovery: bytes per membership, write, stream, restore,
                     peer bootstrap (ARGS go to snapshot-bench: --runs, --states, --quick, --json)
  bench e2e [ARGS…]  kvatlas serve against Dynamo's standalone indexer (from PyPI, cached) on one
                     simulated fleet of vLLM engines: queries/s at p99 <= 1 ms, freshness, CPU,
                     memory, exactness (ARGS go to e2e-bench: --runs, --quick, --json, --plots)
  bench scale-out [ARGS…]
                     kvatlas serve alone against an ingest -> nats-server (JetStream) -> replicas
                     on the same fleet: event rate, lag at a replica, a new replica's bootstrap,
                     bytes per event (installs nats-server if missing; ARGS: --runs, --quick,
                     --json, --check, --indexing-ingest)
  interop            the listener and server against vLLM's and SGLang's real publishers, grpcio,
                     grpcurl and Dynamo's indexer, then short `bench e2e --check`, `bench service`
                     and `bench snapshot` runs (downloads once)
  interop setup      only build target/interop (venv, wheels, extracted publisher sources)
  fuzz-corpus [DIR]  write kvatlas-events' byte-exact decoding fixtures as the decode_batch fuzz
                     seed corpus (DIR defaults to fuzz/corpus/decode_batch)
";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        bail!("no task given");
    };
    match task.as_str() {
        "ci" => ci(),
        "tidy" => tidy::run(&workspace_root()),
        "bench" => bench(rest),
        "interop" => interop::main(rest),
        "fuzz-corpus" => fuzz_corpus(rest),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("{USAGE}");
            bail!("unknown task `{other}`")
        }
    }
}

/// The workspace root (the parent of this crate's directory).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs a command, failing with its description if it exits non-zero.
fn run(mut cmd: Command, what: &str) -> Result<()> {
    eprintln!("\n==> {what}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start: {what}"))?;
    if !status.success() {
        bail!("failed: {what} ({status})");
    }
    Ok(())
}

fn ci() -> Result<()> {
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run(fmt, "cargo fmt --check")?;

    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]);
    run(
        clippy,
        "cargo clippy --workspace --all-targets -- -D warnings",
    )?;

    // The NATS scale-out tests run a real nats-server (Debian's 2.9): installed here if missing.
    nats::ensure_nats_server()?;
    let mut test = cargo();
    test.args(["test", "--workspace", "--locked"]);
    run(test, "cargo test --workspace")?;

    // The hash crate's default feature set is empty (so the workspace run above is its
    // no-default-features build); its optional serde support must build and pass too.
    let mut all_features = cargo();
    all_features.args(["test", "-p", "kvatlas-hash", "--all-features", "--locked"]);
    run(all_features, "cargo test -p kvatlas-hash --all-features")?;

    // Loom model of the concurrent front's synchronization (its own target dir: `--cfg loom`
    // rebuilds every dependency and must not evict the main build).
    let mut model = cargo();
    model
        .args([
            "test",
            "-p",
            "kvatlas-index",
            "--release",
            "--locked",
            "--test",
            "loom",
        ])
        .env("RUSTFLAGS", "--cfg loom")
        .env("CARGO_TARGET_DIR", workspace_root().join("target/loom"));
    run(
        model,
        "loom model of the concurrent front (RUSTFLAGS=--cfg loom)",
    )?;

    let mut doc = cargo();
    doc.args(["doc", "--workspace", "--no-deps", "--locked"])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(doc, "cargo doc --workspace --no-deps (warnings denied)")?;
    // The private items' docs too: the module and type docs a newcomer reads link each other.
    let mut private_doc = cargo();
    private_doc
        .args([
            "doc",
            "--workspace",
            "--no-deps",
            "--locked",
            "--document-private-items",
        ])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(
        private_doc,
        "cargo doc --workspace --no-deps --document-private-items (warnings denied)",
    )?;

    eprintln!("\n==> cargo xtask tidy");
    tidy::run(&workspace_root())?;

    // The sans-IO event core alone (no ZMQ listener), as the fuzz crate and embedders build it:
    // the workspace runs above always enable the default `listener` feature.
    let mut events_core = cargo();
    events_core.args([
        "check",
        "-p",
        "kvatlas-events",
        "--no-default-features",
        "--locked",
    ]);
    run(
        events_core,
        "cargo check -p kvatlas-events --no-default-features",
    )?;

    // The fuzz targets compile (the fuzz crate is outside the workspace). cargo-fuzz builds them
    // on nightly with sanitizers; type-checking needs neither, only `--cfg fuzzing` (the server's
    // `fuzzing` module and `decode_batch_rmp_serde` exist under it). Own target dir: the cfg
    // changes every dependency's flags and must not evict the main build.
    let mut fuzz = cargo();
    fuzz.args([
        "check",
        "--manifest-path",
        "fuzz/Cargo.toml",
        "--bins",
        "--locked",
    ])
    .env("RUSTFLAGS", "--cfg fuzzing")
    .env(
        "CARGO_TARGET_DIR",
        workspace_root().join("target/fuzz-check"),
    );
    run(
        fuzz,
        "cargo check --manifest-path fuzz/Cargo.toml (RUSTFLAGS=--cfg fuzzing)",
    )?;

    bench(&["--quick".to_string()])?;
    eprintln!("\nci: all checks passed");
    Ok(())
}

/// Writes the `decode_batch` fuzz seed corpus: kvatlas-events' `examples/fuzz_corpus.rs` writes
/// every fixture of its `tests/common/mod.rs`, one file each, into `DIR` (default
/// `fuzz/corpus/decode_batch/`, relative to the current directory when given).
fn fuzz_corpus(args: &[String]) -> Result<()> {
    let dir = match args {
        [] => workspace_root().join("fuzz/corpus/decode_batch"),
        [dir] => std::env::current_dir()
            .context("current directory")?
            .join(dir),
        _ => {
            eprint!("{USAGE}");
            bail!("fuzz-corpus takes at most one directory");
        }
    };
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--quiet",
        "--locked",
        "-p",
        "kvatlas-events",
        "--no-default-features",
        "--example",
        "fuzz_corpus",
        "--",
    ])
    .arg(&dir);
    run(
        cmd,
        &format!("write the fuzz seed corpus to {}", dir.display()),
    )
}

fn bench(args: &[String]) -> Result<()> {
    if args.first().map(String::as_str) == Some("micro") {
        let mut cmd = cargo();
        cmd.args(["bench", "-p", "kvatlas-bench", "--locked"])
            .args(&args[1..]);
        return run(
            cmd,
            "cargo bench -p kvatlas-bench (criterion micro-benchmarks)",
        );
    }
    if let Some(bench @ ("service" | "snapshot" | "e2e" | "scale-out")) =
        args.first().map(String::as_str)
    {
        if bench == "scale-out" {
            nats::ensure_nats_server()?;
        }
        let mut build = cargo();
        build.args(["build", "--release", "--locked", "-p", "kvatlas"]);
        run(build, "cargo build --release -p kvatlas")?;
        let binary = workspace_root().join("target/release/kvatlas");
        let bin = format!("{bench}-bench");
        let mut cmd = cargo();
        cmd.args([
            "run",
            "--release",
            "--locked",
            "-p",
            "kvatlas-bench",
            "--bin",
            &bin,
            "--",
            "--kvatlas",
        ])
        .arg(&binary);
        if bench == "e2e" {
            // Dynamo's standalone indexer from PyPI, in the venv the interop tests use.
            cmd.arg("--dynamo-python").arg(interop::dynamo_python()?);
        }
        cmd.args(&args[1..]);
        return run(cmd, &format!("{bin} {}", args[1..].join(" ")));
    }
    if let Some(i) = args
        .iter()
        .position(|a| a == "--preset" || a.starts_with("--preset="))
    {
        let preset = match args[i].strip_prefix("--preset=") {
            Some(preset) => preset,
            None => args.get(i + 1).map_or("PRESET", String::as_str),
        };
        bail!("--preset is gone: the preset is a subcommand now, `cargo xtask bench {preset} …`");
    }
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "--locked",
        "-p",
        "kvatlas-bench",
        "--bin",
        "kvatlas-bench",
        "--",
    ])
    .args(args);
    run(cmd, &format!("kvatlas-bench {}", args.join(" ")))
}
