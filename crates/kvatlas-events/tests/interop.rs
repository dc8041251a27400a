//! Interop with the engines' **real** KV-event publisher code (vLLM 0.23.0, vLLM 0.33.0,
//! SGLang 0.5.23), run by `cargo xtask interop`.
//!
//! `cargo xtask interop` downloads the wheels from PyPI (cached under `target/interop/wheels`),
//! extracts the publisher modules into `target/interop/src/<pkg>-<version>/`, builds a small
//! venv (`target/interop/venv`) and runs these tests with `KVATLAS_INTEROP_DIR=target/interop`.
//! Each test starts `xtask/interop/drive_publisher.py`, which loads the engine's unmodified
//! `kv_events.py` without torch and creates its real `ZmqEventPublisher` (live PUB + replay
//! ROUTER), and steps a scenario through the driver's stdin:
//!
//! 1. **late join**: two stores are published before the listener exists; the listener's first
//!    live batch has `seq > 0`, so it replays from 0 through the engine's ROUTER;
//! 2. **live**: a remove + CPU-tier store, an `AllBlocksCleared`, a new 3-block chain;
//! 3. **restart**: the publisher is shut down and a new one binds the same endpoints (its seq
//!    restarts at 0): the listener must resync (clear the worker) and rebuild from the new
//!    incarnation's batches (replaying those it missed while reconnecting).
//!
//! After each phase the index must equal a [`ReferenceIndex`] fed the same payloads through
//! kvatlas's converter (plus the resync's clear), and — independently of kvatlas's decoder — hold
//! exactly the `(engine hash, tier)` pairs of the driver's own model of the engine's cache.
//!
//! The tests are `#[ignore]`d in plain `cargo test` runs (they need the downloaded wheels); run
//! them with `cargo xtask interop`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, unbounded};
use kvatlas_events::{
    Converter, DropCounters, EngineKind, Listener, ListenerConfig, ListenerCounters,
    ListenerOptions, ListenerStatus, Source,
};
use kvatlas_hash::BlockSize;
use kvatlas_index::{
    Atlas, KvIndex, Locked, Mutation, ReferenceIndex, SharedKvIndex, ThreadPool, Worker,
};
use serde_json::Value;

/// Bound on every wait for the listener or the driver.
const WAIT: Duration = Duration::from_secs(30);
const WORKER: u64 = 11;
const BLOCK: u32 = 16;
const TOPIC: &str = "kv-events";

type Pool = ThreadPool<Locked<Atlas>>;

/// How a release encodes its events (wire-formats §4): checked on the driver's first batch, so
/// a wheel that does not produce the layout a test is named after fails it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `["BlockStored", f1, f2, …]` (vLLM ≤ 0.23, SGLang ≤ 0.5.19).
    Array,
    /// `{"type": "BlockStored", …}` (vLLM ≥ 0.24, SGLang ≥ 0.5.20).
    Map,
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn vllm_0_23_0_array_layout() {
    run_scenario("vllm", "0.23.0", EngineKind::Vllm, Layout::Array);
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn vllm_0_33_0_map_layout() {
    run_scenario("vllm", "0.33.0", EngineKind::Vllm, Layout::Map);
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn sglang_0_5_23() {
    run_scenario("sglang", "0.5.23", EngineKind::Sglang, Layout::Map);
}

// ---------------------------------------------------------------------------------------------
// The Python driver
// ---------------------------------------------------------------------------------------------

/// One published batch, as the driver reports it.
struct Published {
    seq: u64,
    /// The layout of the batch's first event, if it has one.
    layout: Option<Layout>,
    payload: Vec<u8>,
    /// The driver's model of the engine's cache after the batch: `(engine hash, tier name)`.
    held: BTreeSet<(u64, String)>,
}

/// The driver subprocess: commands on stdin, one JSON reply per command on stdout.
struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    replies: Receiver<String>,
    what: String,
}

impl Driver {
    fn spawn(engine: &str, version: &str, endpoint: &str, replay_endpoint: &str) -> Self {
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
    fn reply(&mut self, command: &str) -> Value {
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

    fn command(&mut self, command: &str) -> Value {
        let stdin = self.stdin.as_mut().expect("driver stdin open");
        writeln!(stdin, "{command}").expect("write to the driver");
        stdin.flush().expect("flush the driver's stdin");
        self.reply(command)
    }

    fn publish(&mut self, step: &str) -> Published {
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

    fn quit(mut self) {
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

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex payload"))
        .collect()
}

/// A TCP port free on loopback right now (the engine binds it on `*` a moment later).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

// ---------------------------------------------------------------------------------------------
// The scenario
// ---------------------------------------------------------------------------------------------

/// The index the listener feeds, the reference model, and the driver's latest cache model.
struct Harness {
    pool: Arc<Pool>,
    reference: ReferenceIndex,
    converter: Converter,
    held: BTreeSet<(u64, String)>,
    what: String,
}

impl Harness {
    /// Feeds a batch to the reference model as the listener should apply it.
    fn expect(&mut self, batch: &Published) {
        let (mut mutations, mut drops) = (Vec::new(), DropCounters::new());
        self.converter
            .ingest(&batch.payload, &mut mutations, &mut drops)
            .unwrap_or_else(|e| panic!("{}: seq {} does not decode: {e}", self.what, batch.seq));
        assert_eq!(
            drops.total(),
            0,
            "{}: seq {} drops {drops:?}",
            self.what,
            batch.seq
        );
        for m in &mutations {
            self.reference.apply(m);
        }
        self.held = batch.held.clone();
    }

    /// Compares the index with the reference model and with the driver's cache model.
    fn check(&self, phase: &str) {
        self.pool.flush();
        let got = self.pool.index().snapshot();
        assert_eq!(
            got,
            self.reference.snapshot(),
            "{} ({phase}): the index differs from the reference model",
            self.what
        );
        let pairs: BTreeSet<(u64, String)> = got
            .workers
            .iter()
            .flat_map(|w| &w.blocks)
            .flat_map(|b| {
                b.tiers
                    .iter()
                    .map(move |t| (b.external.get(), format!("{t:?}")))
            })
            .collect();
        assert!(
            !self.held.is_empty(),
            "{phase}: the scenario should hold blocks"
        );
        assert_eq!(
            pairs, self.held,
            "{} ({phase}): the index does not hold what the engine holds",
            self.what
        );
    }
}

/// Publishes empty batches until the listener has applied the last one and `also` holds (so
/// anything it missed shows up as a gap or a restart and is handled first); every empty batch
/// is a logical event too.
fn pump(
    driver: &mut Driver,
    listener: &Listener,
    h: &mut Harness,
    also: impl Fn(&ListenerCounters) -> bool,
) {
    let start = Instant::now();
    loop {
        let batch = driver.publish("empty");
        h.expect(&batch);
        let deadline = Instant::now() + Duration::from_millis(300);
        while Instant::now() < deadline {
            let state = listener.state();
            if state.last_seq == Some(batch.seq) && also(&state.counters) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            start.elapsed() < WAIT,
            "{}: the listener never caught up: {:?}",
            h.what,
            listener.state()
        );
    }
}

fn run_scenario(engine: &str, version: &str, kind: EngineKind, layout: Layout) {
    let (port, replay_port) = (free_port(), free_port());
    let what = format!("{engine} {version}");
    let source = Source {
        worker_id: WORKER,
        dp_rank: 0,
        block_size: BlockSize::new(BLOCK).expect("non-zero"),
        engine: kind,
    };
    // The engine binds (its endpoints contain `*`, wire-formats §1); kvatlas connects.
    let mut driver = Driver::spawn(
        engine,
        version,
        &format!("tcp://*:{port}"),
        &format!("tcp://*:{replay_port}"),
    );
    let mut h = Harness {
        pool: Arc::new(ThreadPool::new(Locked::new(Atlas::new()), 2, 64).expect("pool")),
        reference: ReferenceIndex::new(),
        converter: Converter::new(source),
        held: BTreeSet::new(),
        what: what.clone(),
    };

    // 1. Late join: seq 0 and 1 go out before anyone subscribes.
    driver.command("start");
    for step in ["store_root", "store_chain"] {
        let batch = driver.publish(step);
        assert_eq!(
            batch.layout,
            Some(layout),
            "{what}: unexpected event layout"
        );
        h.expect(&batch);
    }
    // Let the publisher's thread send them before anyone subscribes.
    std::thread::sleep(Duration::from_millis(200));
    let ctx = zmq::Context::new();
    let config = ListenerConfig::new(source, format!("tcp://127.0.0.1:{port}"))
        .with_replay_endpoint(format!("tcp://127.0.0.1:{replay_port}"))
        .with_topic(TOPIC)
        .with_options(ListenerOptions {
            recv_timeout: Duration::from_millis(20),
            replay_timeout: Duration::from_secs(3),
            reconnect_interval: Duration::from_millis(20),
            reconnect_interval_max: Duration::from_millis(200),
            ..ListenerOptions::default()
        });
    let sink = Arc::clone(&h.pool);
    let listener = Listener::start(&ctx, config, sink).expect("listener starts");

    // 2. Live events (the first ones may still be lost to the slow-joiner effect: replayed).
    let batch = driver.publish("remove_store");
    h.expect(&batch);
    pump(&mut driver, &listener, &mut h, |_| true);
    h.check("late join + live");
    let c = listener.state().counters;
    assert_eq!(c.late_joins, 1, "{what}: {c:?}");
    assert!(c.replays_completed >= 1, "{what}: no replay: {c:?}");
    assert!(
        c.batches_replayed >= 2,
        "{what}: seq 0 and 1 not replayed: {c:?}"
    );
    assert_eq!(c.resyncs, 0, "{what}: {c:?}");

    for step in ["clear", "store_after_clear"] {
        let batch = driver.publish(step);
        h.expect(&batch);
    }
    pump(&mut driver, &listener, &mut h, |_| true);
    h.check("clear + new chain");
    // Raise the live seq well above what the next incarnation reaches before the listener
    // reconnects, so its first batch is seen as a restart and not as the continuation.
    for _ in 0..10 {
        let batch = driver.publish("empty");
        h.expect(&batch);
    }
    pump(&mut driver, &listener, &mut h, |_| true);
    let before = listener.state().counters;
    assert_eq!(before.resyncs, 0, "{what}: {before:?}");
    assert_eq!(before.batch_decode_errors, 0, "{what}: {before:?}");
    assert_eq!(before.drops.total(), 0, "{what}: {before:?}");

    // 3. Restart: a new publisher process on the same endpoints; its seq restarts at 0.
    driver.command("stop");
    driver.command("start");
    h.reference.apply(&Mutation::Cleared {
        worker: Worker::new(WORKER, 0),
    });
    for step in ["store_root", "store_chain"] {
        let batch = driver.publish(step);
        h.expect(&batch);
    }
    pump(&mut driver, &listener, &mut h, |c| {
        c.restarts > before.restarts
    });
    h.check("after restart");
    let c = listener.state().counters;
    assert_eq!(c.restarts, 1, "{what}: {c:?}");
    assert!(c.resyncs >= 1 && c.resync_clears >= 1, "{what}: {c:?}");
    assert_eq!(c.replays_failed, 0, "{what}: {c:?}");
    assert_eq!(c.bad_frames, 0, "{what}: {c:?}");
    assert_eq!(c.batch_decode_errors, 0, "{what}: {c:?}");
    assert_eq!(c.drops.total(), 0, "{what}: {c:?}");

    let state = listener.stop();
    assert_eq!(state.status, ListenerStatus::Stopped, "{what}: {state:?}");
    driver.quit();
    eprintln!(
        "{what}: ok ({layout:?} layout; late join: {} batches replayed; restart: resynced, {} \
         batches replayed; {} batches applied in all)",
        before.batches_replayed,
        c.batches_replayed - before.batches_replayed,
        c.batches_applied
    );
}
