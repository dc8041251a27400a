//! The Rust side of `xtask/interop/drive_publisher.py`, shared by the interop tests of
//! kvatlas-events and kvatlas-server (each includes this file with `#[path]`): spawn the driver
//! over an engine's real publisher code, step the scenario, read its replies.

#![allow(dead_code, unreachable_pub)] // each test binary uses a part

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, unbounded};
use serde_json::Value;

/// Bound on every wait for the driver.
pub const WAIT: Duration = Duration::from_secs(30);
/// The scenario's block size.
pub const BLOCK: u32 = 16;
/// The topic the driver's publisher uses.
pub const TOPIC: &str = "kv-events";

/// How a release encodes its events : checked on the driver's first batch, so
/// a wheel that does not produce the layout a test is named after fails it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `["BlockStored", f1, f2, …]` (vLLM ≤ 0.23, SGLang ≤ 0.5.19).
    Array,
    /// `{"type": "BlockStored", …}` (vLLM ≥ 0.24, SGLang ≥ 0.5.20).
    Map,
}

// ---------------------------------------------------------------------------------------------
// The Python driver
// ---------------------------------------------------------------------------------------------

/// One published batch, as the driver reports it.
pub struct Published {
    pub seq: u64,
    /// The layout of the batch's first event, if it has one.
    pub layout: Option<Layout>,
    pub payload: Vec<u8>,
    /// The driver's model of the engine's cache after the batch: `(engine hash, tier name)`.
    pub held: BTreeSet<(u64, String)>,
}

/// The driver subprocess: commands on stdin, one JSON reply per command on stdout.
pub struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    replies: Receiver<String>,
    what: String,
}

impl Driver {
    pub fn spawn(engine: &str, version: &str, endpoint: &str, replay_endpoint: &str) -> Self {
        let dir = PathBuf::from(std::env::var_os("KVATLAS_INTEROP_DIR").unwrap_or_else(|| {
            panic!("KVATLAS_INTEROP_DIR is not set: run these tests with `cargo xtask interop`")
        }));
        let python = dir.join("venv/bin/python");
        let src = dir.join("src").join(format!("{engine}-{version}"));
        assert!(
            python.is_file() && src.is_dir(),
            "{} or {} is missing: run `cargo xtask interop` (it downloads and extracts the wheels)",
            python.display(),
            src.display()
        );
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../xtask/interop/drive_publisher.py");
        let mut child = Command::new(&python)
            .arg(&script)
            .args(["--engine", engine, "--src"])
            .arg(&src)
            .args(["--endpoint", endpoint, "--replay-endpoint", replay_endpoint])
            .args(["--topic", TOPIC])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", python.display()));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, replies) = unbounded();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stdin = child.stdin.take();
        let mut driver = Self {
            child,
            stdin,
            replies,
            what: format!("{engine} {version}"),
        };
        let ready = driver.reply("startup");
        assert_eq!(ready["ok"], "ready", "{}: {ready}", driver.what);
        driver
    }

    /// Waits (bounded) for the next reply; a driver error fails the test with its message.
    pub fn reply(&mut self, command: &str) -> Value {
        let line = match self.replies.recv_timeout(WAIT) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                panic!("{}: no reply to `{command}` within {WAIT:?}", self.what)
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait();
                panic!(
                    "{}: the driver exited ({status:?}) before answering `{command}`",
                    self.what
                )
            }
        };
        let value: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{}: bad reply {line:?}: {e}", self.what));
        if let Some(error) = value.get("error") {
            panic!("{}: `{command}` failed in the driver: {error}", self.what);
        }
        value
    }

    pub fn command(&mut self, command: &str) -> Value {
        let stdin = self.stdin.as_mut().expect("driver stdin open");
        writeln!(stdin, "{command}").expect("write to the driver");
        stdin.flush().expect("flush the driver's stdin");
        self.reply(command)
    }

    pub fn publish(&mut self, step: &str) -> Published {
        let reply = self.command(&format!("publish {step}"));
        let seq = reply["seq"].as_u64().expect("seq");
        let payload = hex(reply["payload"].as_str().expect("payload"));
        let held = reply["held"]
            .as_array()
            .expect("held")
            .iter()
            .flat_map(|entry| {
                let hash = entry[0].as_u64().expect("u64 hash");
                let tiers = entry[1].as_array().expect("tiers").clone();
                tiers
                    .into_iter()
                    .map(move |t| (hash, t.as_str().expect("tier").to_owned()))
            })
            .collect();
        let layout = reply["events"].get(0).map(|event| {
            if event.is_array() {
                Layout::Array
            } else {
                Layout::Map
            }
        });
        Published {
            seq,
            layout,
            payload,
            held,
        }
    }

    pub fn quit(mut self) {
        self.command("quit");
        self.stdin = None;
        let _ = self.child.wait();
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.stdin = None;
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex payload"))
        .collect()
}

/// A TCP port free on loopback right now (the engine binds it on `*` a moment later).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}
