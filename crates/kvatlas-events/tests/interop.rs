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

#[path = "../../../xtask/interop/driver.rs"]
mod driver;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use driver::{BLOCK, Driver, Layout, Published, TOPIC, WAIT, free_port};
use kvatlas_events::{
    Converter, DropCounters, EngineKind, Listener, ListenerConfig, ListenerCounters,
    ListenerOptions, ListenerStatus, Source,
};
use kvatlas_hash::BlockSize;
use kvatlas_index::{
    Atlas, KvIndex, Mutation, ReferenceIndex, SharedKvIndex, ThreadPool, Worker, baseline::Locked,
};

const WORKER: u64 = 11;

type Pool = ThreadPool<Locked<Atlas>>;

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
    // The engine binds (its endpoints contain `*`, `docs/events.md` §7.1); kvatlas connects.
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
    // The state can match once the replayed batches are applied while the replay's end marker
    // is still on its way: wait for the replay to complete, not only for the state.
    let batch = driver.publish("remove_store");
    h.expect(&batch);
    pump(&mut driver, &listener, &mut h, |c| c.replays_completed >= 1);
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
