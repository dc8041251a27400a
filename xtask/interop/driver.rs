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

/// One batch of a `burst`.
pub struct BurstBatch {
    pub seq: u64,
    pub payload: Vec<u8>,
    /// The blocks it stored, in order.
    pub stored: Vec<StoredTokens>,
}

/// A stored block: its engine hash (as u64), its parent's, its tokens.
#[derive(Debug, Clone)]
pub struct StoredTokens {
    pub hash: u64,
    pub parent: Option<u64>,
    pub tokens: Vec<u32>,
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

    /// `burst <n> <seed> [leaf]`: `count` random batches published back to back.
    pub fn burst(&mut self, count: usize, seed: u64, leaf_only: bool) -> Vec<BurstBatch> {
        let leaf = if leaf_only { " leaf" } else { "" };
        let reply = self.command(&format!("burst {count} {seed}{leaf}"));
        reply["batches"]
            .as_array()
            .expect("batches")
            .iter()
            .map(|b| BurstBatch {
                seq: b["seq"].as_u64().expect("seq"),
                payload: hex(b["payload"].as_str().expect("payload")),
                stored: b["stored"]
                    .as_array()
                    .expect("stored")
                    .iter()
                    .map(|block| StoredTokens {
                        hash: block[0].as_u64().expect("hash"),
                        parent: block[1].as_u64(),
                        tokens: block[2]
                            .as_array()
                            .expect("tokens")
                            .iter()
                            .map(|t| u32::try_from(t.as_u64().expect("token")).expect("u32"))
                            .collect(),
                    })
                    .collect(),
            })
            .collect()
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

// ---------------------------------------------------------------------------------------------
// A fleet of publishers
// ---------------------------------------------------------------------------------------------

/// One engine of a [`Fleet`]: its driver, its endpoints and every batch it published.
pub struct Member {
    pub instance_id: u64,
    pub port: u16,
    pub replay_port: u16,
    pub driver: Driver,
    pub published: Vec<BurstBatch>,
}

impl Member {
    /// The PUB endpoint to connect to.
    pub fn endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// The replay ROUTER endpoint.
    pub fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    /// The last sequence number published.
    pub fn last_seq(&self) -> Option<u64> {
        self.published.last().map(|b| b.seq)
    }
}

/// Engines of one release, each publishing random bursts through its real publisher.
pub struct Fleet {
    pub members: Vec<Member>,
    round: u64,
}

impl Fleet {
    /// One started publisher per instance id.
    pub fn spawn(engine: &str, version: &str, instance_ids: &[u64]) -> Self {
        let members = instance_ids
            .iter()
            .map(|&instance_id| {
                let (port, replay_port) = (free_port(), free_port());
                let mut driver = Driver::spawn(
                    engine,
                    version,
                    &format!("tcp://*:{port}"),
                    &format!("tcp://*:{replay_port}"),
                );
                driver.command("start");
                Member {
                    instance_id,
                    port,
                    replay_port,
                    driver,
                    published: Vec::new(),
                }
            })
            .collect();
        Self { members, round: 0 }
    }

    /// `per_member` random batches from every member (leaf-first evictions only with `leaf`).
    pub fn round(&mut self, per_member: usize, leaf: bool) {
        self.round += 1;
        for member in &mut self.members {
            let seed = member.instance_id * 1_000_003 + self.round;
            let batches = member.driver.burst(per_member, seed, leaf);
            member.published.extend(batches);
        }
    }

    /// One empty batch from every member: a listener that missed the last batches sees the
    /// gap and replays it.
    pub fn nudge(&mut self) {
        for member in &mut self.members {
            let batch = member.driver.publish("empty");
            member.published.push(BurstBatch {
                seq: batch.seq,
                payload: batch.payload,
                stored: Vec::new(),
            });
        }
    }

    /// Publishes rounds in a thread, `pause` apart, until `stop` is set; the thread returns the
    /// fleet.
    pub fn publish_in_background(
        mut self,
        per_member: usize,
        leaf: bool,
        pause: Duration,
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> std::thread::JoinHandle<Fleet> {
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                self.round(per_member, leaf);
                std::thread::sleep(pause);
            }
            self
        })
    }

    /// The reference model fed every published batch of every member, in order.
    pub fn reference(&self, kind: kvatlas_events::EngineKind) -> kvatlas_index::ReferenceIndex {
        let members: Vec<_> = self.members.iter().map(|m| (m, kind)).collect();
        reference_of(&members)
    }

    pub fn quit(self) {
        for member in self.members {
            member.driver.quit();
        }
    }
}

/// The reference model fed every batch the members published, in order, each decoded as its
/// engine's.
pub fn reference_of(
    members: &[(&Member, kvatlas_events::EngineKind)],
) -> kvatlas_index::ReferenceIndex {
    use kvatlas_index::KvIndex as _;
    let mut reference = kvatlas_index::ReferenceIndex::new();
    for (member, kind) in members {
        let converter = kvatlas_events::Converter::new(kvatlas_events::Source {
            worker_id: member.instance_id,
            dp_rank: 0,
            block_size: kvatlas_hash::BlockSize::new(BLOCK).expect("block size"),
            engine: *kind,
        });
        let (mut mutations, mut drops) = (Vec::new(), kvatlas_events::DropCounters::new());
        for batch in &member.published {
            mutations.clear();
            converter
                .ingest(&batch.payload, &mut mutations, &mut drops)
                .expect("the batch decodes");
            for m in &mutations {
                reference.apply(m);
            }
        }
        assert_eq!(drops.total(), 0, "drops {drops:?}");
    }
    reference
}
