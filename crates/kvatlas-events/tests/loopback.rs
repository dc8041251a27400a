//! Loopback integration tests of the listener edge with real ZMQ sockets on 127.0.0.1.
//!
//! A test publisher mimics vLLM's (`docs/events.md` §7.1 and §7.4): a PUB sending
//! `[topic, seq_be8, payload]` and a ROUTER replay endpoint serving its ring of recent batches
//! (both the old 2-frame and the new 3-frame reply bodies). Each scenario ends by comparing the
//! index the listener fed with a `ReferenceIndex` fed the same logical events through the same
//! converter. Ports are chosen by the OS (`tcp://127.0.0.1:*`), so tests run in parallel; every
//! wait is bounded.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::W;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, unbounded};
use kvatlas_events::{
    Converter, DropCounters, EngineKind, ListenerConfig, ListenerCounters, ListenerError,
    ListenerId, ListenerOptions, ListenerState, ListenerStatus, ListenerThreads, Listeners,
    MAX_RANKS_PER_SOURCE, MutationSink, Reason, SinkError, SocketMode, Source,
};
use kvatlas_hash::BlockSize;
use kvatlas_index::{
    Atlas, KvIndex, Mutation, ReferenceIndex, SharedKvIndex, ThreadPool, Unit, Worker,
    baseline::Locked,
};

const WAIT: Duration = Duration::from_secs(10);
const WORKER: u64 = 7;
const BLOCK: u32 = 16;

type Pool = ThreadPool<Locked<Atlas>>;

fn source() -> Source {
    Source {
        worker_id: WORKER,
        dp_rank: 0,
        block_size: BlockSize::new(BLOCK).expect("non-zero"),
        engine: EngineKind::Vllm,
    }
}

fn fast_options() -> ListenerOptions {
    ListenerOptions {
        recv_timeout: Duration::from_millis(20),
        replay_timeout: Duration::from_millis(1500),
        reconnect_interval: Duration::from_millis(20),
        reconnect_interval_max: Duration::from_millis(200),
        ..ListenerOptions::default()
    }
}

/// Polls `condition` every 2 ms for at most [`WAIT`].
fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ---------------------------------------------------------------------------------------------
// Payloads (msgpack batches)
// ---------------------------------------------------------------------------------------------

/// `[ts, [], 0]`: a batch without events (`ts` makes it unique per incarnation and seq).
fn empty_batch(ts: f64) -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(ts).arr(0).u(0);
    w.bytes()
}

fn tokens_for(hash: u64) -> impl Iterator<Item = u32> {
    let base = (hash % 1_000_000) as u32 * BLOCK;
    base..base + BLOCK
}

/// A map-layout (vLLM ≥ 0.24) batch storing a chain of blocks under `parent`.
fn store_batch(ts: f64, hashes: &[u64], parent: Option<u64>) -> Vec<u8> {
    store_batch_on_rank(ts, hashes, parent, 0)
}

/// [`store_batch`] with the batch's data-parallel rank `dp_rank`.
fn store_batch_on_rank(ts: f64, hashes: &[u64], parent: Option<u64>, dp_rank: u64) -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(ts).arr(1);
    w.map(8)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .u64s(hashes);
    w.s("parent_block_hash");
    match parent {
        Some(p) => w.u64(p),
        None => w.nil(),
    };
    w.s("token_ids")
        .tokens(hashes.iter().flat_map(|h| tokens_for(*h)));
    w.s("block_size")
        .u(u64::from(BLOCK))
        .s("lora_id")
        .nil()
        .s("medium")
        .s("GPU")
        .s("lora_name")
        .nil();
    w.u(dp_rank);
    w.bytes()
}

/// An array-layout (vLLM ≤ 0.23) batch removing blocks, with an unknown event type first (it
/// is skipped, the remove still applies).
fn remove_batch(ts: f64, hashes: &[u64]) -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(ts).arr(2);
    w.arr(2).s("BlockPinned").u(1);
    w.arr(4).s("BlockRemoved").u64s(hashes).s("GPU").u(0);
    w.u(0);
    w.bytes()
}

/// A deterministic stream of `n` logical batches for engine incarnation `inc`: chains of two
/// blocks, every third one a root, every fifth batch a remove.
fn event_stream(inc: u64, n: u64) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut last: Option<u64> = None;
    let mut stored: Vec<u64> = Vec::new();
    for k in 0..n {
        let ts = 1_700_000_000.0 + (inc * 10_000 + k) as f64;
        if k % 5 == 4 && stored.len() >= 2 {
            let victim = stored[stored.len() - 2];
            out.push(remove_batch(ts, &[victim]));
            continue;
        }
        let h = (inc << 40) | (k * 10 + 1);
        let hashes = [h, h + 1];
        let parent = if k % 3 == 0 { None } else { last };
        out.push(store_batch(ts, &hashes, parent));
        stored.extend(hashes);
        last = Some(h + 1);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Test publisher (vLLM-like PUB + ROUTER replay ring)
// ---------------------------------------------------------------------------------------------

enum Command {
    /// Put `(seq, payload)` in the ring and, if `live`, publish it.
    Publish {
        seq: u64,
        payload: Vec<u8>,
        live: bool,
    },
    /// Publish raw frames (malformed messages).
    Raw(Vec<Vec<u8>>),
    /// Close the PUB and bind a new one on the same endpoint: every subscriber's connection
    /// drops and is made again (a network blip; the engine, its ring and its sequence go on).
    Rebind,
}

#[derive(Clone)]
struct PublisherOptions {
    topic: Vec<u8>,
    ring: usize,
    /// vLLM ≥ 0.26 replies `[topic, seq, payload]`; older ones `[seq, payload]`.
    new_replay_layout: bool,
    /// Serve replay requests at all.
    answer_replays: bool,
    /// The PUB's send high-water mark (libzmq's default is 1000).
    send_hwm: i32,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        Self {
            topic: b"kv-events".to_vec(),
            ring: 10_000,
            new_replay_layout: true,
            answer_replays: true,
            send_hwm: 1000,
        }
    }
}

struct Publisher {
    commands: Option<Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: String,
    next_seq: u64,
    /// Makes payloads of different incarnations differ.
    incarnation: u64,
}

/// Binds `endpoint`, retrying while the port of a just-closed socket is still in use.
fn bind_retry(socket: &zmq::Socket, endpoint: &str) {
    let start = Instant::now();
    loop {
        match socket.bind(endpoint) {
            Ok(()) => return,
            Err(zmq::Error::EADDRINUSE) if start.elapsed() < WAIT => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(error) => panic!("bind {endpoint}: {error}"),
        }
    }
}

fn last_endpoint(socket: &zmq::Socket) -> String {
    socket
        .get_last_endpoint()
        .expect("getsockopt")
        .expect("utf-8 endpoint")
}

impl Publisher {
    /// A default publisher binding PUB and ROUTER on ephemeral loopback ports (engine id 1).
    fn loopback(ctx: &zmq::Context) -> Self {
        Self::start(
            ctx,
            "tcp://127.0.0.1:*",
            false,
            "tcp://127.0.0.1:*",
            1,
            PublisherOptions::default(),
        )
    }

    /// A publisher whose PUB binds `pub_at` (or connects to it when `connect`) and whose
    /// ROUTER binds `replay_at`.
    fn start(
        ctx: &zmq::Context,
        pub_at: &str,
        connect: bool,
        replay_at: &str,
        incarnation: u64,
        options: PublisherOptions,
    ) -> Self {
        let publisher = ctx.socket(zmq::PUB).expect("PUB");
        publisher.set_linger(0).expect("linger");
        publisher.set_sndhwm(options.send_hwm).expect("sndhwm");
        let endpoint = if connect {
            publisher.connect(pub_at).expect("connect PUB");
            pub_at.to_owned()
        } else {
            bind_retry(&publisher, pub_at);
            last_endpoint(&publisher)
        };
        let router = ctx.socket(zmq::ROUTER).expect("ROUTER");
        router.set_linger(0).expect("linger");
        bind_retry(&router, replay_at);
        let replay_endpoint = last_endpoint(&router);
        let (tx, rx) = unbounded();
        let ctx = ctx.clone();
        let thread =
            std::thread::spawn(move || publisher_loop(&ctx, publisher, &router, &rx, &options));
        Self {
            commands: Some(tx),
            thread: Some(thread),
            endpoint,
            replay_endpoint,
            next_seq: 0,
            incarnation,
        }
    }

    fn send(&self, command: Command) {
        if let Some(tx) = &self.commands {
            tx.send(command).expect("publisher thread alive");
        }
    }

    /// Publishes the next batch (live or ring-only); returns its seq.
    fn publish(&mut self, payload: Vec<u8>, live: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.send(Command::Publish { seq, payload, live });
        seq
    }

    fn empty(&self, seq: u64) -> Vec<u8> {
        empty_batch(1_000.0 + (self.incarnation * 100_000 + seq) as f64)
    }

    /// Publishes empty batches until the listener has applied one of them: the subscription is
    /// up (the first ones may be lost to the slow-joiner effect; replay heals them).
    fn warm_up(&mut self, listeners: &Listeners, id: ListenerId) -> Vec<Vec<u8>> {
        let mut sent = Vec::new();
        let start = Instant::now();
        loop {
            let payload = self.empty(self.next_seq);
            sent.push(payload.clone());
            let seq = self.publish(payload, true);
            std::thread::sleep(Duration::from_millis(5));
            if state(listeners, id).last_seq == Some(seq) {
                return sent;
            }
            assert!(start.elapsed() < WAIT, "subscription never came up");
        }
    }

    /// Publishes empty batches until the listener has applied the last one (so a lost tail
    /// shows up as a gap and is replayed); returns them (they are logical events too).
    fn pump(&mut self, listeners: &Listeners, id: ListenerId) -> Vec<Vec<u8>> {
        let mut sent = Vec::new();
        let start = Instant::now();
        loop {
            let payload = self.empty(self.next_seq);
            sent.push(payload.clone());
            let seq = self.publish(payload, true);
            let deadline = Instant::now() + Duration::from_millis(200);
            while Instant::now() < deadline {
                if state(listeners, id).last_seq == Some(seq) {
                    return sent;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            assert!(start.elapsed() < WAIT, "listener never caught up");
        }
    }

    /// Stops this engine and starts its next incarnation (incarnation 2) on the same ports,
    /// with default options: its sequence starts at 0 again, with other content.
    fn restart(self, ctx: &zmq::Context) -> Self {
        let (pub_at, replay_at) = (self.endpoint.clone(), self.replay_endpoint.clone());
        self.stop();
        Self::start(
            ctx,
            &pub_at,
            false,
            &replay_at,
            2,
            PublisherOptions::default(),
        )
    }

    fn stop(mut self) {
        self.commands = None;
        if let Some(thread) = self.thread.take() {
            thread.join().expect("publisher thread");
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.commands = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn publisher_loop(
    ctx: &zmq::Context,
    mut publisher: zmq::Socket,
    router: &zmq::Socket,
    commands: &Receiver<Command>,
    options: &PublisherOptions,
) {
    let mut ring: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    loop {
        match commands.recv_timeout(Duration::from_millis(1)) {
            Ok(Command::Publish { seq, payload, live }) => {
                if live {
                    let seq_be = seq.to_be_bytes();
                    publisher
                        .send_multipart([&options.topic[..], &seq_be[..], &payload[..]], 0)
                        .expect("PUB send");
                }
                ring.push_back((seq, payload));
                if ring.len() > options.ring {
                    ring.pop_front();
                }
            }
            Ok(Command::Raw(frames)) => publisher.send_multipart(frames, 0).expect("PUB send"),
            Ok(Command::Rebind) => {
                let endpoint = last_endpoint(&publisher);
                drop(publisher);
                publisher = ctx.socket(zmq::PUB).expect("PUB");
                publisher.set_linger(0).expect("linger");
                publisher.set_sndhwm(options.send_hwm).expect("sndhwm");
                bind_retry(&publisher, &endpoint);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        // vLLM's replay: [identity, b"", start_be8] → one reply per ring entry ≥ start, then the
        // end marker.
        while let Ok(request) = router.recv_multipart(zmq::DONTWAIT) {
            if !options.answer_replays {
                continue;
            }
            let [identity, delimiter, start] = &request[..] else {
                continue;
            };
            let (true, Ok(start)) = (delimiter.is_empty(), <[u8; 8]>::try_from(&start[..])) else {
                continue;
            };
            let start = u64::from_be_bytes(start);
            let reply = |seq: [u8; 8], payload: &[u8]| {
                let frames: Vec<&[u8]> = if options.new_replay_layout {
                    vec![identity, b"", &options.topic, &seq, payload]
                } else {
                    vec![identity, b"", &seq, payload]
                };
                router.send_multipart(frames, 0).expect("ROUTER send");
            };
            for (seq, payload) in ring.iter().filter(|(s, _)| *s >= start) {
                reply(seq.to_be_bytes(), payload);
            }
            if options.new_replay_layout {
                router
                    .send_multipart([&identity[..], b"", b"", &[0xff; 8], b""], 0)
                    .expect("ROUTER send");
            } else {
                reply([0xff; 8], b"");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

fn state(listeners: &Listeners, id: ListenerId) -> ListenerState {
    listeners.state(id).expect("listener registered")
}

/// A listener of `source` on `publisher`'s sockets and `topic`, with the tests' fast options.
fn listener_config(source: Source, publisher: &Publisher, topic: &[u8]) -> ListenerConfig {
    ListenerConfig::new(source, publisher.endpoint.clone())
        .with_replay_endpoint(publisher.replay_endpoint.clone())
        .with_topic(topic.to_vec())
        .with_options(fast_options())
}

/// The index behind the listeners, and the reference model fed the same logical batches.
struct Harness {
    ctx: zmq::Context,
    pool: Arc<Pool>,
    listeners: Listeners,
    reference: ReferenceIndex,
    converter: Converter,
}

impl Harness {
    fn new() -> Self {
        Self::with_sink(|pool| pool)
    }

    fn with_sink(wrap: impl FnOnce(Arc<Pool>) -> Arc<dyn MutationSink>) -> Self {
        let pool = Arc::new(ThreadPool::new(Locked::new(Atlas::new()), 2, 64).expect("pool"));
        let ctx = zmq::Context::new();
        let listeners =
            Listeners::with_context(ctx.clone(), wrap(Arc::clone(&pool))).expect("listener thread");
        Self {
            ctx,
            pool,
            listeners,
            reference: ReferenceIndex::new(),
            converter: Converter::new(source()),
        }
    }

    fn listen(&self, publisher: &Publisher, topic: &[u8]) -> ListenerId {
        let config = listener_config(source(), publisher, topic);
        self.listeners.start(config).expect("listener starts")
    }

    /// Feeds logical batches to the reference model, as the listener should apply them.
    fn reference_apply(&mut self, payloads: &[Vec<u8>]) {
        let mut mutations = Vec::new();
        let mut drops = DropCounters::new();
        for payload in payloads {
            mutations.clear();
            // A batch that fails to decode yields nothing, in both paths.
            let _ = self.converter.ingest(payload, &mut mutations, &mut drops);
            for m in &mutations {
                self.reference.apply(m);
            }
        }
    }

    /// Puts the state of `batches` (a stream's batches `0..`) into the index, as restoring a
    /// snapshot does, and returns the position to resume from with the batches' fingerprints,
    /// as the index's checkpoint records them.
    fn restore(&self, batches: &[Vec<u8>]) -> kvatlas_events::Resume {
        let converter = Converter::new(source());
        let mut mutations = Vec::new();
        let mut drops = DropCounters::new();
        for payload in batches {
            mutations.clear();
            let _ = converter.ingest(payload, &mut mutations, &mut drops);
            for m in mutations.drain(..) {
                self.pool
                    .enqueue(m)
                    .expect("the pool takes the snapshot's mutations");
            }
        }
        self.pool.flush();
        kvatlas_events::Resume {
            position: batches.len() as u64 - 1,
            recent: batches
                .iter()
                .enumerate()
                .map(|(seq, payload)| (seq as u64, xxhash_rust::xxh3::xxh3_64(payload)))
                .collect(),
            ranks: Vec::new(),
        }
    }

    fn reference_clear(&mut self) {
        self.reference.apply(&Mutation::Cleared {
            worker: Worker::new(WORKER, 0),
        });
    }

    /// Waits for the writers, then compares the index with the reference model.
    fn assert_index_matches_reference(&self) {
        self.pool.flush();
        let got = self.pool.index().snapshot();
        let want = self.reference.snapshot();
        assert!(want.blocks() > 0, "the scenario should leave blocks");
        assert_eq!(got, want, "index differs from the reference model");
    }
}

/// Publishes `payloads`; `live(i)` says whether the i-th goes out live (else ring only).
fn publish_all(publisher: &mut Publisher, payloads: &[Vec<u8>], live: impl Fn(usize) -> bool) {
    for (i, payload) in payloads.iter().enumerate() {
        publisher.publish(payload.clone(), live(i));
    }
}

/// A registry on a set of one poller thread, over an index with `writers` writer threads.
fn on_one_poller(writers: usize) -> (Arc<Pool>, zmq::Context, ListenerThreads, Listeners) {
    let pool = Arc::new(ThreadPool::new(Locked::new(Atlas::new()), writers, 64).expect("pool"));
    let ctx = zmq::Context::new();
    let threads = ListenerThreads::new(1, "test-listen").expect("the poller thread starts");
    let listeners = Listeners::with_threads(ctx.clone(), pool.clone(), threads.clone());
    (pool, ctx, threads, listeners)
}

/// A loopback engine for worker `worker_id` and its listener in `listeners`.
fn start_engine(
    listeners: &Listeners,
    ctx: &zmq::Context,
    worker_id: u64,
    options: ListenerOptions,
) -> (Source, Publisher, ListenerId) {
    let source = Source {
        worker_id,
        ..source()
    };
    let publisher = Publisher::loopback(ctx);
    let config = ListenerConfig::new(source, publisher.endpoint.clone())
        .with_replay_endpoint(publisher.replay_endpoint.clone())
        .with_options(options);
    let id = listeners.start(config).expect("the listener starts");
    (source, publisher, id)
}

// ---------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------

#[test]
fn many_listeners_share_one_poller_thread_and_stop_one_at_a_time() {
    let (pool, ctx, threads, listeners) = on_one_poller(2);
    let mut reference = ReferenceIndex::new();
    struct Engine {
        source: Source,
        publisher: Publisher,
        id: ListenerId,
        sent: Vec<Vec<u8>>,
    }
    let mut engines: Vec<Engine> = (0..6u64)
        .map(|w| {
            let (source, publisher, id) = start_engine(&listeners, &ctx, 100 + w, fast_options());
            Engine {
                source,
                publisher,
                id,
                sent: Vec::new(),
            }
        })
        .collect();
    assert_eq!(threads.loads(), vec![6], "one thread serves every listener");
    let publish_round = |engines: &mut [Engine], round: u64, n: u64| {
        for e in engines.iter_mut() {
            let events = event_stream(e.source.worker_id * 10 + round, n);
            publish_all(&mut e.publisher, &events, |_| true);
            e.sent.extend(events);
        }
        for e in engines.iter_mut() {
            let tail = e.publisher.pump(&listeners, e.id);
            e.sent.extend(tail);
        }
    };
    for e in &mut engines {
        let warm = e.publisher.warm_up(&listeners, e.id);
        e.sent.extend(warm);
    }
    publish_round(&mut engines, 1, 30);

    // Two stop; their blocks stay.
    for e in engines.drain(..2) {
        let last = listeners.stop(e.id).expect("a known listener");
        assert_eq!(last.status, ListenerStatus::Stopped, "{last:?}");
        assert_eq!(last.counters.resyncs, 0, "{last:?}");
        feed_reference(&mut reference, e.source, &e.sent);
    }
    assert_eq!(threads.loads(), vec![4]);
    // The others go on.
    publish_round(&mut engines, 2, 20);
    for e in &engines {
        let s = state(&listeners, e.id);
        assert_eq!(s.status, ListenerStatus::Active, "{s:?}");
        assert_eq!(s.counters.resyncs, 0, "{s:?}");
        feed_reference(&mut reference, e.source, &e.sent);
    }
    pool.flush();
    assert_eq!(pool.index().snapshot(), reference.snapshot());
    drop(listeners);
    assert_eq!(
        threads.loads(),
        vec![0],
        "dropping the registry stops its listeners"
    );
}

#[test]
fn a_wake_serves_only_the_listeners_it_concerns() {
    let (_pool, ctx, threads, listeners) = on_one_poller(1);
    // No deadline of their own comes due during the test: no probes, a 30 s receive timeout.
    let options = ListenerOptions {
        recv_timeout: Duration::from_secs(30),
        quiet_probe: None,
        ..fast_options()
    };
    const IDLE: u64 = 24;
    let mut engines: Vec<(Publisher, ListenerId)> = (0..=IDLE)
        .map(|w| {
            let (_, publisher, id) = start_engine(&listeners, &ctx, 100 + w, options);
            (publisher, id)
        })
        .collect();
    // Every engine is subscribed; only the last one publishes from here on.
    for (publisher, id) in &mut engines {
        publisher.warm_up(&listeners, *id);
    }
    let (busy, busy_id) = engines.last_mut().expect("engines");
    let turns_before = threads.turns()[0];
    const BATCHES: u64 = 40;
    for _ in 0..BATCHES {
        // One batch at a time, each read before the next is sent: one wake per batch.
        let seq = busy.publish(busy.empty(busy.next_seq), true);
        wait_for("the batch", || {
            state(&listeners, *busy_id).last_seq == Some(seq)
        });
    }
    let turns = threads.turns()[0] - turns_before;
    // The busy listener is served once per batch and again to find its socket empty (a read
    // may consume the next signal); the idle ones are passed over. Serving every listener on
    // every wake would give at least (IDLE + 1) * BATCHES = 1,000 turns.
    assert!(
        (BATCHES..=4 * BATCHES).contains(&turns),
        "{turns} turns for {BATCHES} batches on one of {} listeners",
        IDLE + 1
    );
    for (_, id) in &engines {
        let s = state(&listeners, *id);
        assert_eq!(s.status, ListenerStatus::Active, "{s:?}");
    }
}

#[test]
fn a_stop_or_release_wakes_the_poller_thread() {
    let h = Harness::new();
    let publisher = Publisher::loopback(&h.ctx);
    // Nothing else would wake the poller for 30 s: no probes, no replay, no traffic.
    let options = ListenerOptions {
        recv_timeout: Duration::from_secs(30),
        quiet_probe: None,
        ..fast_options()
    };
    let config = |hold: bool| {
        let config =
            ListenerConfig::new(source(), publisher.endpoint.clone()).with_options(options);
        if hold { config.held() } else { config }
    };
    let held = h
        .listeners
        .start(config(true))
        .expect("the listener starts");
    // Let the poller go to sleep on its sockets.
    std::thread::sleep(Duration::from_millis(50));
    h.listeners.release(held, None).expect("a known listener");
    wait_for("the release taken", || {
        state(&h.listeners, held).status == ListenerStatus::Pending
    });
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    let last = h.listeners.stop(held).expect("a known listener");
    assert!(
        started.elapsed() < WAIT,
        "the stop took {:?}",
        started.elapsed()
    );
    assert_eq!(last.status, ListenerStatus::Stopped);
}

/// Feeds `source`'s logical batches to `reference`.
fn feed_reference(reference: &mut ReferenceIndex, source: Source, payloads: &[Vec<u8>]) {
    let converter = Converter::new(source);
    let mut mutations = Vec::new();
    let mut drops = DropCounters::new();
    for payload in payloads {
        mutations.clear();
        let _ = converter.ingest(payload, &mut mutations, &mut drops);
        for m in &mutations {
            reference.apply(m);
        }
    }
}

#[test]
fn live_events_are_applied() {
    let mut h = Harness::new();
    let mut publisher = Publisher::loopback(&h.ctx);
    let id = h.listen(&publisher, b"kv");
    let warm = publisher.warm_up(&h.listeners, id);
    let events = event_stream(1, 40);
    publish_all(&mut publisher, &events, |_| true);
    let tail = publisher.pump(&h.listeners, id);

    let s = state(&h.listeners, id);
    assert_eq!(s.status, ListenerStatus::Active);
    assert_eq!(s.counters.resyncs, 0, "{s:?}");
    assert_eq!(s.counters.bad_frames, 0);
    assert_eq!(s.counters.batch_decode_errors, 0);
    // Every remove batch carries one unknown event, skipped and counted.
    assert_eq!(s.counters.drops.get(Reason::UnknownEventType), 8);
    assert!(s.counters.mutations_enqueued >= 40);

    h.reference_apply(&warm);
    h.reference_apply(&events);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
    let final_state = h.listeners.stop(id).expect("known listener");
    assert_eq!(final_state.status, ListenerStatus::Stopped);
}

#[test]
fn a_forced_gap_is_healed_by_replay() {
    for new_replay_layout in [true, false] {
        let mut h = Harness::new();
        let mut publisher = Publisher::start(
            &h.ctx,
            "tcp://127.0.0.1:*",
            false,
            "tcp://127.0.0.1:*",
            1,
            PublisherOptions {
                new_replay_layout,
                ..PublisherOptions::default()
            },
        );
        let id = h.listen(&publisher, b"");
        let warm = publisher.warm_up(&h.listeners, id);
        let before = state(&h.listeners, id).counters;
        let events = event_stream(1, 30);
        // Batches 10..15 and 22 are kept in the ring but never sent live.
        publish_all(&mut publisher, &events, |i| {
            !(10..15).contains(&i) && i != 22
        });
        let tail = publisher.pump(&h.listeners, id);
        // The live stream can move on as soon as the missing batches are in, before the replay's
        // end marker is read: wait for the marker too.
        wait_for("the replay's end marker", || {
            state(&h.listeners, id).counters.replays_completed > before.replays_completed
        });

        let s = state(&h.listeners, id);
        assert_eq!(s.counters.resyncs, 0, "{s:?}");
        assert!(s.counters.gaps > before.gaps, "{s:?}");
        assert!(
            s.counters.batches_replayed >= before.batches_replayed + 6,
            "{s:?}"
        );
        h.reference_apply(&warm);
        h.reference_apply(&events);
        h.reference_apply(&tail);
        h.assert_index_matches_reference();
    }
}

/// Replay replies are read a budget at a time (`max_batches_per_wakeup`, here 1 per wake-up):
/// a listener left with replies to read is served again without waiting for a new socket
/// event, so a long replay still completes within its per-reply timeout (a listener left
/// waiting would time the replay out and resync).
#[test]
fn a_long_replay_read_one_reply_per_wakeup_completes() {
    let mut h = Harness::new();
    let mut publisher = Publisher::start(
        &h.ctx,
        "tcp://127.0.0.1:*",
        false,
        "tcp://127.0.0.1:*",
        1,
        PublisherOptions::default(),
    );
    let config = listener_config(source(), &publisher, b"").with_options(ListenerOptions {
        max_batches_per_wakeup: 1,
        ..fast_options()
    });
    let id = h.listeners.start(config).expect("listener starts");
    let warm = publisher.warm_up(&h.listeners, id);
    let before = state(&h.listeners, id).counters;
    let events = event_stream(1, 300);
    // Batches 10..260 are kept in the ring but never sent live: one replay of 250 batches.
    publish_all(&mut publisher, &events, |i| !(10..260).contains(&i));
    let tail = publisher.pump(&h.listeners, id);
    wait_for("the replay's end marker", || {
        state(&h.listeners, id).counters.replays_completed > before.replays_completed
    });
    let s = state(&h.listeners, id);
    assert_eq!(s.counters.resyncs, before.resyncs, "{s:?}");
    assert_eq!(s.counters.replays_failed, before.replays_failed, "{s:?}");
    assert!(
        s.counters.batches_replayed >= before.batches_replayed + 250,
        "{s:?}"
    );
    h.reference_apply(&warm);
    h.reference_apply(&events);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}

/// Starts a listener on `publisher` that probes its quiet stream after `quiet_probe`, and warms
/// it up; returns it, the warm-up batches and the counters after them.
fn listen_probing(
    h: &Harness,
    publisher: &mut Publisher,
    quiet_probe: Duration,
) -> (ListenerId, Vec<Vec<u8>>, ListenerCounters) {
    let config = ListenerConfig::new(source(), publisher.endpoint.clone())
        .with_replay_endpoint(publisher.replay_endpoint.clone())
        .with_options(ListenerOptions {
            quiet_probe: Some(quiet_probe),
            ..fast_options()
        });
    let id = h.listeners.start(config).expect("listener starts");
    let warm = publisher.warm_up(&h.listeners, id);
    let before = state(&h.listeners, id).counters;
    (id, warm, before)
}

/// Waits until the listener applied the publisher's last batch, found by a probe (no gap seen,
/// nothing cleared), then compares the index with the reference model of every batch.
fn assert_probe_found_the_rest(
    h: &mut Harness,
    publisher: &Publisher,
    (id, warm, before): (ListenerId, Vec<Vec<u8>>, ListenerCounters),
    events: &[Vec<u8>],
) -> ListenerCounters {
    let last = publisher.next_seq - 1;
    let start = Instant::now();
    while state(&h.listeners, id).last_seq != Some(last) {
        assert!(
            start.elapsed() < WAIT,
            "timed out waiting for the lost batches, by a probe: {:?}",
            state(&h.listeners, id)
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let c = state(&h.listeners, id).counters;
    assert!(c.probes > before.probes, "{c:?}");
    assert_eq!(
        (c.gaps, c.resyncs),
        (before.gaps, before.resyncs),
        "no gap seen, nothing cleared: {c:?}"
    );
    h.reference_apply(&warm);
    h.reference_apply(events);
    h.assert_index_matches_reference();
    c
}

/// The last batches an engine publishes are lost on the live stream (as when they go out before
/// the subscription takes effect, or during a reconnection) and the engine then goes quiet: no
/// later batch shows the gap. The listener probes the quiet stream's replay endpoint and applies
/// them; without the probe they would be missing for as long as the engine stays quiet.
#[test]
fn the_last_batches_of_a_quiet_engine_lost_live_are_found_by_a_probe() {
    let mut h = Harness::new();
    let mut publisher = Publisher::loopback(&h.ctx);
    let listener = listen_probing(&h, &mut publisher, Duration::from_millis(100));
    let replayed = listener.2.batches_replayed;
    let events = event_stream(1, 24);
    // The last two (stores) are kept in the ring but never sent live.
    publish_all(&mut publisher, &events, |i| i < 22);
    let c = assert_probe_found_the_rest(&mut h, &publisher, listener, &events);
    assert!(c.batches_replayed >= replayed + 2, "{c:?}");
}

/// A batch published while the SUB's connection was down is lost on the live stream; the engine
/// then stays quiet. The listener probes as soon as the connection is made again (quiet probes
/// are set far beyond the test's wait, so only the reconnection can trigger it).
#[test]
fn a_batch_lost_while_the_connection_was_down_is_found_on_reconnection() {
    let mut h = Harness::new();
    let mut publisher = Publisher::loopback(&h.ctx);
    let listener = listen_probing(&h, &mut publisher, Duration::from_secs(60));
    let connects = listener.2.connects;
    let events = event_stream(1, 4);
    publish_all(&mut publisher, &events, |i| i < 3);
    publisher.send(Command::Rebind);
    let c = assert_probe_found_the_rest(&mut h, &publisher, listener, &events);
    assert!(c.connects > connects, "{c:?}");
}

/// An engine restarts (same ports, sequence from 0, other content) while its new batches go out
/// unheard, then stays quiet: the live stream shows nothing. The probe that follows — on the
/// reconnection, or when the stream has been quiet — asks the engine for the last batch applied;
/// the new incarnation holds nothing from there on, so the worker is resynced and the new
/// incarnation's batches replayed from 0. Without it the index would keep crediting the old
/// incarnation's blocks for as long as the engine stays quiet.
#[test]
fn an_engine_that_restarted_and_stayed_quiet_is_found_by_a_probe() {
    let mut h = Harness::new();
    let mut a = Publisher::loopback(&h.ctx);
    let (id, warm_a, _) = listen_probing(&h, &mut a, Duration::from_millis(100));
    let events_a = event_stream(1, 30);
    publish_all(&mut a, &events_a, |_| true);
    let tail_a = a.pump(&h.listeners, id);
    // Two probes have gone out, so the first was answered: the engine's ring has been seen.
    let probes = state(&h.listeners, id).counters.probes;
    wait_for("two probes of the quiet stream", || {
        state(&h.listeners, id).counters.probes >= probes + 2
    });
    restart_quietly_and_check(&mut h, a, id, [warm_a, events_a, tail_a]);
}

/// The same restart of an engine that was never quiet before it: quiet probes are set far beyond
/// the test's wait, so no replay need ever have shown that the engine keeps a ring — which is
/// what makes an answer with nothing but the end marker a restart. A listener therefore probes
/// once as soon as it has a position, busy stream or not.
#[test]
fn a_busy_engine_that_restarted_and_stayed_quiet_is_found_on_reconnection() {
    let mut h = Harness::new();
    let mut a = Publisher::loopback(&h.ctx);
    let (id, warm_a, _) = listen_probing(&h, &mut a, Duration::from_secs(600));
    // (A listener that joined late saw the ring in its catch-up's answer, and needs no probe:
    // the first probe goes out only while no replay has shown a ring.)
    wait_for(
        "the engine's ring seen, by the first probe or a replay",
        || {
            let counters = state(&h.listeners, id).counters;
            counters.probes >= 1 || counters.batches_replayed >= 1
        },
    );
    let events_a = event_stream(1, 30);
    publish_all(&mut a, &events_a, |_| true);
    let tail_a = a.pump(&h.listeners, id);
    restart_quietly_and_check(&mut h, a, id, [warm_a, events_a, tail_a]);
}

/// Stops engine `a`, starts its next incarnation on the same ports with a few batches in its ring
/// that never go out live, and waits until the listener found the restart and replayed them;
/// then compares the index with the reference model: `before` applied, cleared, the new batches.
fn restart_quietly_and_check(
    h: &mut Harness,
    a: Publisher,
    id: ListenerId,
    before: [Vec<Vec<u8>>; 3],
) {
    let last_a = a.next_seq - 1;
    let mut b = a.restart(&h.ctx);
    let events_b = event_stream(2, 6);
    publish_all(&mut b, &events_b, |_| false);
    assert!(
        b.next_seq - 1 < last_a,
        "the new incarnation stays below the old seq"
    );
    wait_for("the restart found and the new incarnation replayed", || {
        state(&h.listeners, id).last_seq == Some(b.next_seq - 1)
    });
    let s = state(&h.listeners, id);
    assert_eq!(
        (
            s.counters.restarts,
            s.counters.resyncs,
            s.counters.resync_clears
        ),
        (1, 1, 1),
        "{s:?}"
    );
    for batches in &before {
        h.reference_apply(batches);
    }
    h.reference_clear();
    h.reference_apply(&events_b);
    h.assert_index_matches_reference();
}

/// Restarts `a`'s engine, whose new incarnation publishes a few batches no one hears and goes
/// quiet, then starts a listener resumed at `resume` (probing only when asked); returns its
/// counters once it applied the new incarnation's batches, and those batches.
fn resume_after_a_quiet_restart(
    h: &Harness,
    a: Publisher,
    resume: kvatlas_events::Resume,
) -> (ListenerCounters, Vec<Vec<u8>>) {
    let mut b = a.restart(&h.ctx);
    let events_b = event_stream(2, 6);
    publish_all(&mut b, &events_b, |_| false);
    let config = ListenerConfig::new(source(), b.endpoint.clone())
        .with_replay_endpoint(b.replay_endpoint.clone())
        .with_options(ListenerOptions {
            quiet_probe: Some(Duration::from_secs(600)),
            ..fast_options()
        })
        .with_resume(Some(resume));
    let id = h.listeners.start(config).expect("listener starts");
    wait_for("the restart found and the new incarnation applied", || {
        state(&h.listeners, id).last_seq == Some(b.next_seq - 1)
    });
    (state(&h.listeners, id).counters, events_b)
}

/// A listener resumed from a snapshot (as after its server restarted) whose engine restarted
/// while it was away, published a few batches no one heard and went quiet. The catch-up,
/// anchored at the snapshot's position, gets nothing but the end marker, and no replay has yet
/// shown that the engine keeps a ring, so that alone proves nothing; the listener then asks for
/// the whole ring, whose batches show it exists: the worker is resynced and they are applied.
#[test]
fn a_resumed_listener_finds_an_engine_that_restarted_while_it_was_away() {
    let mut h = Harness::new();
    let mut a = Publisher::loopback(&h.ctx);
    let events_a = event_stream(1, 20);
    publish_all(&mut a, &events_a, |_| false);
    let resume = h.restore(&events_a);
    let (c, events_b) = resume_after_a_quiet_restart(&h, a, resume);
    assert_eq!((c.restarts, c.resyncs, c.catch_ups), (1, 1, 1), "{c:?}");
    h.reference_apply(&events_a);
    h.reference_clear();
    h.reference_apply(&events_b);
    h.assert_index_matches_reference();
}

/// A listener resumed from a snapshot of a source whose batches also fed a further rank (a
/// batch names its rank): the resumed state names that rank, and the resync after the engine
/// restarted clears it with the registered rank. A listener that remembered only its own rank
/// after resuming left the further rank's blocks in the index for good.
#[test]
fn a_resumed_listener_clears_the_further_ranks_its_source_fed_on_a_resync() {
    let mut h = Harness::new();
    let mut a = Publisher::loopback(&h.ctx);
    let mut events_a = event_stream(1, 10);
    events_a.push(store_batch_on_rank(
        1_700_000_100.0,
        &[(1 << 41) | 7, (1 << 41) | 8],
        None,
        1,
    ));
    publish_all(&mut a, &events_a, |_| false);
    let resume = kvatlas_events::Resume {
        // Another worker's rank is not the source's to clear.
        ranks: vec![Worker::new(WORKER, 1), Worker::new(WORKER + 1, 1)],
        ..h.restore(&events_a)
    };
    let (c, events_b) = resume_after_a_quiet_restart(&h, a, resume);
    assert_eq!(
        (c.restarts, c.resyncs, c.resync_clears),
        (1, 1, 2),
        "both ranks the source fed are cleared: {c:?}"
    );
    h.reference_apply(&events_a);
    for rank in [0, 1] {
        h.reference.apply(&Mutation::Cleared {
            worker: Worker::new(WORKER, rank),
        });
    }
    h.reference_apply(&events_b);
    h.assert_index_matches_reference();
}

/// A listener started held (as a server starts its listeners while it restores a snapshot)
/// buffers live batches and applies none; its buffer is bounded (half the sequencer's), so the
/// oldest are dropped (counted). Released at the snapshot's position, it first asks the engine
/// for everything after that position (a catch-up), which fills the hole between the snapshot
/// and the oldest batch still buffered, then goes through its buffer: what the catch-up already
/// applied is dropped as a duplicate, so every batch is applied exactly once and the index ends
/// equal to the reference model of the whole stream. Live batches that come before the
/// catch-up's answer find room in the sequencer's buffer beside the held ones (held up to the
/// whole buffer, the first overflowed it, and the resync cleared the restored state).
#[test]
fn a_held_listener_released_at_a_snapshot_position_applies_every_batch_once() {
    const HELD: usize = 12;
    let mut h = Harness::new();
    let mut publisher = Publisher::loopback(&h.ctx);
    let mut options = fast_options();
    options.sequencer.max_buffered = HELD;
    let config = ListenerConfig::new(source(), publisher.endpoint.clone())
        .with_replay_endpoint(publisher.replay_endpoint.clone())
        .with_options(options)
        .held();
    let id = h.listeners.start(config).expect("the listener starts");
    // The subscription comes up: empty batches until one reaches the (held) listener.
    let mut sent: Vec<Vec<u8>> = Vec::new();
    let started = Instant::now();
    while state(&h.listeners, id).counters.batches_received == 0 {
        let payload = publisher.empty(publisher.next_seq);
        sent.push(payload.clone());
        publisher.publish(payload, true);
        std::thread::sleep(Duration::from_millis(5));
        assert!(started.elapsed() < WAIT, "subscription never came up");
    }
    let events = event_stream(13, 40);
    publish_all(&mut publisher, &events, |_| true);
    sent.extend(events.iter().cloned());
    wait_for("the live batches buffered", || {
        state(&h.listeners, id).counters.batches_received as usize > events.len()
    });
    let s = state(&h.listeners, id);
    assert_eq!(s.status, ListenerStatus::Held, "{s:?}");
    assert_eq!(
        s.counters.batches_applied, 0,
        "nothing applied while held: {s:?}"
    );
    assert_eq!(s.last_seq, None, "{s:?}");
    assert!(
        s.counters.held_dropped >= (events.len() - HELD / 2) as u64,
        "the held buffer keeps the newest {}: {s:?}",
        HELD / 2
    );

    // The snapshot restored meanwhile holds batches 0..=position, as the index's checkpoint
    // records them: (seq, fingerprint) of each.
    let position = sent.len() - 25;
    let resume = h.restore(&sent[..=position]);
    h.listeners.release(id, Some(resume)).expect("released");
    // Live batches at once, before the catch-up's answer (the engine goes on publishing).
    for _ in 0..3 {
        let payload = publisher.empty(publisher.next_seq);
        sent.push(payload.clone());
        publisher.publish(payload, true);
    }
    wait_for("the catch-up's answer read to its end", || {
        state(&h.listeners, id).counters.replays_completed >= 1
    });
    let tail = publisher.pump(&h.listeners, id);
    sent.extend(tail);

    let s = state(&h.listeners, id);
    assert_eq!(s.counters.catch_ups, 1, "{s:?}");
    assert_eq!(s.counters.resyncs, 0, "{s:?}");
    assert!(
        s.counters.duplicates > 0,
        "buffered batches the snapshot or the catch-up held were dropped: {s:?}"
    );
    assert_eq!(
        s.counters.batches_applied as usize,
        sent.len() - 1 - position,
        "every batch after the snapshot's position applied once: {s:?}"
    );
    h.reference_apply(&sent);
    h.assert_index_matches_reference();
}

/// A source whose batches carry many dp ranks: a resync clears every one of them (each is
/// remembered), and a batch of a rank beyond [`MAX_RANKS_PER_SOURCE`] is dropped and counted
/// rather than applied to a rank a resync would not clear.
#[test]
fn a_resync_clears_every_rank_a_source_fed_and_a_rank_beyond_the_limit_is_dropped() {
    let mut h = Harness::new();
    let mut a = Publisher::loopback(&h.ctx);
    let id = h.listen(&a, b"kv-events");
    let warm_a = a.warm_up(&h.listeners, id);
    let limit = MAX_RANKS_PER_SOURCE as u64;
    let ranked: Vec<Vec<u8>> = (0..=limit)
        .map(|rank| {
            let ts = 1_700_000_000.0 + rank as f64;
            store_batch_on_rank(ts, &[(1 << 40) | (rank * 10 + 1)], None, rank)
        })
        .collect();
    publish_all(&mut a, &ranked, |_| true);
    let tail_a = a.pump(&h.listeners, id);
    let s = state(&h.listeners, id);
    assert_eq!(s.counters.drops.get(Reason::TooManyDpRanks), 1, "{s:?}");
    assert!(
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains(&format!("dp rank {limit}"))),
        "{s:?}"
    );

    let mut b = a.restart(&h.ctx);
    let events_b = event_stream(2, 12);
    publish_all(&mut b, &events_b, |_| true);
    let tail_b = b.pump(&h.listeners, id);
    let s = state(&h.listeners, id);
    assert_eq!((s.counters.restarts, s.counters.resyncs), (1, 1), "{s:?}");
    assert_eq!(
        s.counters.resync_clears, limit,
        "every rank fed is cleared: {s:?}"
    );

    h.reference_apply(&warm_a);
    h.reference_apply(&ranked[..MAX_RANKS_PER_SOURCE]);
    h.reference_apply(&tail_a);
    for rank in 0..limit {
        h.reference.apply(&Mutation::Cleared {
            worker: Worker::new(WORKER, u32::try_from(rank).expect("a small rank")),
        });
    }
    h.reference_apply(&events_b);
    h.reference_apply(&tail_b);
    h.assert_index_matches_reference();
}

/// Records every unit it is handed.
#[derive(Default)]
struct Recording(parking_lot::Mutex<Vec<Unit>>);

impl MutationSink for Recording {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        self.0.lock().push(unit);
        Ok(())
    }
}

/// A resync clears the source's registered rank first, then the other ranks its batches
/// carried: a unit of clears alone is named by its first rank (the event log files it under
/// that source).
#[test]
fn a_resync_clears_the_registered_rank_first() {
    let ctx = zmq::Context::new();
    let sink = Arc::new(Recording::default());
    let listeners = Listeners::with_context(ctx.clone(), sink.clone()).expect("listener thread");
    let mut a = Publisher::loopback(&ctx);
    let own = Source {
        dp_rank: 5,
        ..source()
    };
    let id = listeners
        .start(listener_config(own, &a, b"kv-events"))
        .expect("listener starts");
    a.warm_up(&listeners, id);
    // Batches of rank 2, below the registered rank 5; more than the next incarnation sends,
    // so that its numbers are below these (a restart, not a gap).
    let ranked: Vec<Vec<u8>> = (0..10)
        .map(|k| store_batch_on_rank(1_700_000_000.0 + k as f64, &[(1 << 40) | k], None, 2))
        .collect();
    publish_all(&mut a, &ranked, |_| true);
    a.pump(&listeners, id);
    let last_a = a.next_seq - 1;
    let mut b = a.restart(&ctx);
    publish_all(&mut b, &event_stream(2, 3), |_| true);
    b.pump(&listeners, id);
    assert!(
        b.next_seq - 1 < last_a,
        "the new incarnation stays below the old seq"
    );
    assert_eq!(state(&listeners, id).counters.restarts, 1);
    let units = sink.0.lock();
    let resync = units.iter().find(|u| u.resync).expect("a resync unit");
    let cleared: Vec<Worker> = resync
        .mutations
        .iter()
        .filter_map(|m| match m {
            Mutation::Cleared { worker } => Some(*worker),
            _ => None,
        })
        .collect();
    // (The warm-up's empty batches carry rank 0.)
    assert_eq!(
        cleared,
        vec![
            Worker::new(WORKER, 5),
            Worker::new(WORKER, 0),
            Worker::new(WORKER, 2)
        ]
    );
}

#[test]
fn a_publisher_restart_resyncs_the_worker() {
    let mut h = Harness::new();
    let mut a = Publisher::loopback(&h.ctx);
    let id = h.listen(&a, b"kv-events");
    let warm_a = a.warm_up(&h.listeners, id);
    let events_a = event_stream(1, 30);
    publish_all(&mut a, &events_a, |_| true);
    let tail_a = a.pump(&h.listeners, id);
    let last_a = a.next_seq - 1;

    // The engine restarts on the same ports: its sequence starts at 0 again, with other content
    // and fewer batches than before (a restart whose first seq is above the old one looks like
    // a gap, found by the gap's anchored replay: docs/events.md §3).
    let mut b = a.restart(&h.ctx);
    let events_b = event_stream(2, 12);
    publish_all(&mut b, &events_b, |_| true);
    let tail_b = b.pump(&h.listeners, id);
    assert!(
        b.next_seq - 1 < last_a,
        "the new incarnation must stay below the old seq"
    );

    let s = state(&h.listeners, id);
    assert_eq!(s.counters.restarts, 1, "{s:?}");
    assert_eq!(s.counters.resyncs, 1, "{s:?}");
    assert_eq!(s.counters.resync_clears, 1);
    assert_eq!(s.last_seq, Some(b.next_seq - 1));
    assert!(
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("Restart"))
    );

    h.reference_apply(&warm_a);
    h.reference_apply(&events_a);
    h.reference_apply(&tail_a);
    h.reference_clear();
    h.reference_apply(&events_b);
    h.reference_apply(&tail_b);
    h.assert_index_matches_reference();
    // Nothing of the first incarnation survives.
    let snapshot = h.pool.index().snapshot();
    assert!(
        snapshot.workers[0]
            .blocks
            .iter()
            .all(|b| b.external.get() >> 40 == 2)
    );
}

#[test]
fn malformed_messages_do_not_disturb_a_clean_stream() {
    let mut h = Harness::new();
    let mut publisher = Publisher::loopback(&h.ctx);
    let id = h.listen(&publisher, b"kv");
    let warm = publisher.warm_up(&h.listeners, id);
    let events = event_stream(1, 20);
    let topic = b"kv-events".to_vec();
    let seq5 = 5u64.to_be_bytes().to_vec();
    let garbage = [
        // Wrong frame counts, a 7-byte seq, an extra frame.
        vec![topic.clone(), seq5.clone()],
        vec![topic.clone()],
        vec![topic.clone(), seq5[1..].to_vec(), events[0].clone()],
        vec![
            topic.clone(),
            seq5.clone(),
            events[0].clone(),
            b"extra".to_vec(),
        ],
        // More frames than any layout (only the first 4 are kept, the rest discarded).
        [vec![topic.clone()], vec![Vec::new(); 5]].concat(),
    ];
    let mut logical = Vec::new();
    for (i, payload) in events.iter().enumerate() {
        if let Some(frames) = garbage.get(i / 4).filter(|_| i % 4 == 1) {
            publisher.send(Command::Raw(frames.clone()));
        }
        if i == 9 {
            // A batch with valid frames but a payload that is not msgpack, and a truncated
            // one: counted, and they still advance the sequence (no replay loop).
            for bad in [vec![0xc1, 0xff], payload[..payload.len() / 2].to_vec()] {
                logical.push(bad.clone());
                publisher.publish(bad, true);
            }
        }
        logical.push(payload.clone());
        publisher.publish(payload.clone(), true);
    }
    let pumping = Instant::now();
    let tail = publisher.pump(&h.listeners, id);

    let s = state(&h.listeners, id);
    assert_eq!(s.counters.bad_frames, 5, "{s:?}");
    // The last batch arrived after `pumping` (the pump's own), so the time since it is at most
    // the time since then (plus the microsecond the listener rounds its timestamp down by).
    assert!(
        s.since_last_batch
            .is_some_and(|d| d <= pumping.elapsed() + Duration::from_micros(1)),
        "{s:?}"
    );
    assert_eq!(s.counters.batch_decode_errors, 2, "{s:?}");
    assert_eq!(s.counters.drops.get(Reason::MalformedBatch), 2);
    assert_eq!(s.counters.resyncs, 0, "{s:?}");
    assert_eq!(s.status, ListenerStatus::Active);
    h.reference_apply(&warm);
    h.reference_apply(&logical);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}

#[test]
fn a_gap_older_than_the_replay_ring_resyncs_and_rebuilds() {
    let mut h = Harness::new();
    let mut publisher = Publisher::start(
        &h.ctx,
        "tcp://127.0.0.1:*",
        false,
        "tcp://127.0.0.1:*",
        1,
        PublisherOptions {
            ring: 2,
            ..PublisherOptions::default()
        },
    );
    let id = h.listen(&publisher, b"");
    // With a 2-batch ring, a late join during the warm-up may already resync (no blocks yet).
    let warm = publisher.warm_up(&h.listeners, id);
    let before = state(&h.listeners, id).counters;
    let events = event_stream(1, 30);
    // 10..15 never go out live; the ring (2 batches) holds only 14 and 15 when the gap is seen.
    publish_all(&mut publisher, &events[..16], |i| !(10..15).contains(&i));
    wait_for("the resync", || {
        state(&h.listeners, id).counters.resyncs == before.resyncs + 1
    });
    publish_all(&mut publisher, &events[16..], |_| true);
    let tail = publisher.pump(&h.listeners, id);

    let s = state(&h.listeners, id);
    assert_eq!(s.counters.resyncs, before.resyncs + 1, "{s:?}");
    assert_eq!(
        s.counters.replay_resyncs,
        before.replay_resyncs + 1,
        "{s:?}"
    );
    assert_eq!(s.counters.resync_clears, before.resync_clears + 1, "{s:?}");
    // The worker was cleared, then rebuilt from what followed: 14 (replayed), 15, 16, ...
    h.reference_apply(&warm);
    h.reference_apply(&events[..10]);
    h.reference_clear();
    h.reference_apply(&events[14..]);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}

#[test]
fn an_unanswered_replay_times_out_and_resyncs() {
    let mut h = Harness::new();
    let mut publisher = Publisher::start(
        &h.ctx,
        "tcp://127.0.0.1:*",
        false,
        "tcp://127.0.0.1:*",
        1,
        PublisherOptions {
            answer_replays: false,
            ..PublisherOptions::default()
        },
    );
    let config = ListenerConfig::new(source(), publisher.endpoint.clone())
        .with_replay_endpoint(publisher.replay_endpoint.clone())
        .with_options(ListenerOptions {
            replay_timeout: Duration::from_millis(150),
            ..fast_options()
        });
    let id = h.listeners.start(config).expect("starts");
    // Warm up until a batch is applied: a late join may already time out and resync here.
    let warm = publisher.warm_up(&h.listeners, id);
    let resyncs_before = state(&h.listeners, id).counters.resyncs;
    let events = event_stream(1, 20);
    publish_all(&mut publisher, &events, |i| i != 8);
    let tail = publisher.pump(&h.listeners, id);

    let s = state(&h.listeners, id);
    assert_eq!(s.counters.resyncs, resyncs_before + 1, "{s:?}");
    assert!(s.counters.replays_failed > 0);
    assert!(s.last_error.is_some());
    h.reference_apply(&warm);
    h.reference_apply(&events[..8]);
    h.reference_clear();
    h.reference_apply(&events[9..]);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}

#[test]
fn bind_mode_accepts_a_connecting_engine() {
    let mut h = Harness::new();
    // The listener binds first; the engine's PUB connects to it.
    let router = h.ctx.socket(zmq::ROUTER).expect("ROUTER");
    bind_retry(&router, "tcp://127.0.0.1:*");
    let replay_at = last_endpoint(&router);
    drop(router);
    let config = ListenerConfig::new(source(), "tcp://127.0.0.1:*")
        .with_mode(SocketMode::Bind)
        .with_options(fast_options());
    let id = h.listeners.start(config).expect("binds");
    let bound = state(&h.listeners, id).endpoint;
    assert!(
        bound.starts_with("tcp://127.0.0.1:") && !bound.ends_with('*'),
        "{bound}"
    );
    let mut publisher = Publisher::start(
        &h.ctx,
        &bound,
        true,
        &replay_at,
        1,
        PublisherOptions::default(),
    );
    // No replay endpoint registered: a late join resyncs instead; warm up until applied.
    let warm = publisher.warm_up(&h.listeners, id);
    let events = event_stream(1, 15);
    publish_all(&mut publisher, &events, |_| true);
    let tail = publisher.pump(&h.listeners, id);
    let s = state(&h.listeners, id);
    // Whatever was lost before the connection came up was resynced (cleared) before the
    // first applied batch; the warm-up batches carry no events either way.
    assert_eq!(s.counters.replay_resyncs, s.counters.resyncs);
    h.reference_apply(&warm);
    h.reference_apply(&events);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}

/// A sink that refuses every third push (as a full lane would), in front of the pool.
struct Congested {
    pool: Arc<Pool>,
    pushes: AtomicU64,
}

impl MutationSink for Congested {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        if self
            .pushes
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(3)
        {
            return Err(SinkError::Full(unit));
        }
        self.pool.try_push(unit)
    }
}

#[test]
fn a_full_sink_backpressures_without_losing_mutations() {
    let mut h = Harness::with_sink(|pool| {
        Arc::new(Congested {
            pool,
            pushes: AtomicU64::new(0),
        })
    });
    let mut publisher = Publisher::loopback(&h.ctx);
    let id = h.listen(&publisher, b"");
    let warm = publisher.warm_up(&h.listeners, id);
    let events = event_stream(1, 30);
    publish_all(&mut publisher, &events, |_| true);
    let tail = publisher.pump(&h.listeners, id);
    let s = state(&h.listeners, id);
    assert!(s.counters.backpressure_waits > 0, "{s:?}");
    assert_eq!(s.counters.mutations_abandoned, 0);
    h.reference_apply(&warm);
    h.reference_apply(&events);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}

#[test]
fn the_registry_rejects_bad_input_and_stops_listeners() {
    let h = Harness::new();
    let start = |endpoint: &str| {
        h.listeners
            .start(ListenerConfig::new(source(), endpoint).with_options(fast_options()))
    };
    for bad in [
        "",
        "not an endpoint",
        "tcp://",
        "foo://bar:1",
        "tcp://127.0.0.1:notaport",
    ] {
        assert!(
            matches!(start(bad), Err(ListenerError::Endpoint { .. })),
            "{bad:?} should be rejected"
        );
    }
    let bad_replay = ListenerConfig::new(source(), "tcp://127.0.0.1:1")
        .with_replay_endpoint("nope")
        .with_options(fast_options());
    assert!(matches!(
        h.listeners.start(bad_replay),
        Err(ListenerError::Endpoint { endpoint, .. }) if endpoint == "nope"
    ));
    let zero_timeout =
        ListenerConfig::new(source(), "tcp://127.0.0.1:1").with_options(ListenerOptions {
            recv_timeout: Duration::ZERO,
            ..fast_options()
        });
    assert!(matches!(
        h.listeners.start(zero_timeout),
        Err(ListenerError::InvalidOption { .. })
    ));
    // libzmq reads a high-water mark of 0 as "no limit": refused, memory stays bounded.
    for unbounded in [0, -1] {
        let config =
            ListenerConfig::new(source(), "tcp://127.0.0.1:1").with_options(ListenerOptions {
                receive_hwm: unbounded,
                ..fast_options()
            });
        assert!(matches!(
            h.listeners.start(config),
            Err(ListenerError::InvalidOption {
                name: "receive_hwm",
                ..
            })
        ));
    }
    assert!(h.listeners.list().is_empty());

    // Nothing listens on port 1: the listener stays pending.
    let id = start("tcp://127.0.0.1:1").expect("connect is lazy");
    assert!(matches!(
        start("tcp://127.0.0.1:2"),
        Err(ListenerError::DuplicateSource { existing, .. }) if existing == id
    ));
    std::thread::sleep(Duration::from_millis(50));
    let s = state(&h.listeners, id);
    assert_eq!(s.status, ListenerStatus::Pending);
    assert_eq!(s.last_seq, None);
    assert_eq!(h.listeners.list().len(), 1);

    // A stop returns (the thread is joined), with the listener stopped and gone from the
    // registry. How long it takes (about one `recv_timeout`) is a latency figure, not asserted
    // here: on a shared machine any thread can be descheduled past a fixed bound.
    let stopped = h.listeners.stop(id).expect("known");
    assert_eq!(stopped.id, id);
    assert_eq!(stopped.status, ListenerStatus::Stopped);
    assert!(h.listeners.list().is_empty());
    assert!(matches!(
        h.listeners.stop(id),
        Err(ListenerError::UnknownListener(_))
    ));
    assert!(h.listeners.state(id).is_err());
}

/// A sink in front of the pool that takes one unit (batch) per `interval` and is full otherwise
/// (an index that cannot keep up, draining at a fixed rate).
struct Slow {
    pool: Arc<Pool>,
    interval: Duration,
    last: parking_lot::Mutex<Option<Instant>>,
}

impl MutationSink for Slow {
    fn try_push(&self, unit: Unit) -> Result<(), SinkError> {
        let mut last = self.last.lock();
        if last.is_some_and(|t| t.elapsed() < self.interval) {
            return Err(SinkError::Full(unit));
        }
        *last = Some(Instant::now());
        self.pool.try_push(unit)
    }
}

#[test]
fn a_slow_index_backpressures_the_socket_and_replay_heals_the_drops() {
    let mut h = Harness::with_sink(|pool| {
        Arc::new(Slow {
            pool,
            interval: Duration::from_micros(500),
            last: parking_lot::Mutex::new(None),
        })
    });
    let mut publisher = Publisher::start(
        &h.ctx,
        "tcp://127.0.0.1:*",
        false,
        "tcp://127.0.0.1:*",
        1,
        PublisherOptions {
            send_hwm: 4,
            ..PublisherOptions::default()
        },
    );
    let config = ListenerConfig::new(source(), publisher.endpoint.clone())
        .with_replay_endpoint(publisher.replay_endpoint.clone())
        .with_options(ListenerOptions {
            receive_hwm: 4,
            ..fast_options()
        });
    let id = h.listeners.start(config).expect("starts");
    let warm = publisher.warm_up(&h.listeners, id);
    // 600 batches of 64 blocks (~4 KB each) at full speed; the sink takes 0.5 ms per batch.
    let events: Vec<Vec<u8>> = (0..600u64)
        .map(|k| {
            let first = (1u64 << 40) | (k * 100 + 1);
            let hashes: Vec<u64> = (first..first + 64).collect();
            store_batch(1_700_000_000.0 + k as f64, &hashes, None)
        })
        .collect();
    publish_all(&mut publisher, &events, |_| true);
    let tail = publisher.pump(&h.listeners, id);
    let s = state(&h.listeners, id);
    // The listener waited on the sink, stopped reading, the high-water marks dropped live
    // batches, and replay brought them back.
    assert!(s.counters.backpressure_waits > 0, "{s:?}");
    assert!(
        s.counters.gaps > 0 && s.counters.batches_replayed > 0,
        "{s:?}"
    );
    assert_eq!(s.counters.resyncs, 0, "{s:?}");
    assert_eq!(s.counters.mutations_abandoned, 0);
    h.reference_apply(&warm);
    h.reference_apply(&events);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}

#[test]
fn an_engine_that_is_down_is_reported_until_it_comes_up() {
    let mut h = Harness::new();
    // A free port, with nobody listening yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let pub_at = format!("tcp://127.0.0.1:{port}");
    let config = ListenerConfig::new(source(), pub_at.clone()).with_options(fast_options());
    let id = h.listeners.start(config).expect("listener starts");
    wait_for("the failed connection to be reported", || {
        let s = state(&h.listeners, id);
        s.counters.connect_retries > 0
            && s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("cannot reach the engine at tcp://127.0.0.1:"))
    });
    assert_eq!(state(&h.listeners, id).status, ListenerStatus::Pending);
    // The engine comes up on that port: the listener connects, and the error is gone.
    let mut engine = Publisher::start(
        &h.ctx,
        &pub_at,
        false,
        "tcp://127.0.0.1:*",
        1,
        PublisherOptions::default(),
    );
    let warm = engine.warm_up(&h.listeners, id);
    let s = state(&h.listeners, id);
    assert_eq!(s.status, ListenerStatus::Active);
    assert!(s.counters.connects >= 1, "{s:?}");
    assert!(
        s.last_error
            .as_deref()
            .is_none_or(|e| !e.contains("cannot reach")),
        "{s:?}"
    );
    let events = event_stream(3, 5);
    publish_all(&mut engine, &events, |_| true);
    let tail = engine.pump(&h.listeners, id);
    // Warm-up batches it missed before subscribing made it resync a still empty rank (they
    // hold no events); everything after is applied.
    h.reference_apply(&warm);
    h.reference_apply(&events);
    h.reference_apply(&tail);
    h.assert_index_matches_reference();
}
