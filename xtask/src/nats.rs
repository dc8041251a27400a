//! The `nats-server` the NATS scale-out tests and benchmarks run (Debian's 2.9, through
//! `kvatlas_fleet::nats::NatsServer`): `cargo xtask ci` makes sure there is one before the tests,
//! installing Debian's package when it runs as root.
//!
//! The lookup is `NatsServer::binary`'s: `KVATLAS_NATS_SERVER`, else `nats-server` on `PATH`,
//! else `/usr/sbin/nats-server` (kept in step by hand: xtask does not depend on the workspace's
//! crates).

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::run;

/// The environment variable naming the `nats-server` to use (as in `kvatlas_fleet::nats`).
const BINARY_ENV: &str = "KVATLAS_NATS_SERVER";

/// Where Debian's `nats-server` package installs the binary.
const DEBIAN_BINARY: &str = "/usr/sbin/nats-server";

/// Makes sure a `nats-server` is there for the tests: `KVATLAS_NATS_SERVER` set or one found
/// (on `PATH` or at `/usr/sbin/nats-server`) is used as it is; otherwise, as root, `apt-get
/// install -y nats-server` (with `apt-get update` first only if the install fails without it);
/// otherwise an error saying how to install it. Prints which `nats-server` is used.
pub(crate) fn ensure_nats_server() -> Result<()> {
    let binary = match find() {
        Some(binary) => binary,
        None => {
            install()?;
            find().with_context(|| {
                format!("apt-get installed nats-server, but it is neither on PATH nor at {DEBIAN_BINARY}")
            })?
        }
    };
    let output = Command::new(&binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} --version", binary.display()))?;
    if !output.status.success() {
        bail!(
            "{} --version failed ({}): {}",
            binary.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let version = String::from_utf8_lossy(&output.stdout);
    eprintln!(
        "ci: NATS tests use {} ({})",
        binary.display(),
        version.trim()
    );
    Ok(())
}

/// The `nats-server` the tests would run, if there is one (`KVATLAS_NATS_SERVER` is taken as
/// given; the tests report it if it is wrong).
fn find() -> Option<PathBuf> {
    if let Some(value) = std::env::var_os(BINARY_ENV).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(value));
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
    });
    on_path.or_else(|| Some(PathBuf::from(DEBIAN_BINARY)).filter(|p| p.is_file()))
}

/// `apt-get install -y nats-server` as root (retried after `apt-get update` if it fails), or an
/// error with how to install it.
fn install() -> Result<()> {
    if !is_root() {
        bail!(
            "nats-server not found ({BINARY_ENV} unset, not on PATH, not at {DEBIAN_BINARY}) and \
             not running as root to install it: run `sudo apt-get install nats-server` (Debian's \
             2.9), or set {BINARY_ENV} to a nats-server binary"
        );
    }
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("apt-get");
        cmd.args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null());
        cmd
    };
    let install = ["install", "-y", "-q", "nats-server"];
    if run(apt(&install), "apt-get install -y nats-server").is_ok() {
        return Ok(());
    }
    run(apt(&["update", "-q"]), "apt-get update")
        .context("could not update apt's package lists to install nats-server")?;
    run(
        apt(&install),
        "apt-get install -y nats-server (after apt-get update)",
    )
    .context("could not install Debian's nats-server package (the NATS tests need it)")
}

/// Whether this process runs as root (`id -u` prints 0).
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "0")
}
