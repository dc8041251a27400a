//! Scale-out over NATS JetStream with real parts: Debian's `nats-server` (file storage) on a
//! loopback port, `kvatlas serve --publish-to` ingests fed by mock vLLM engines over ZMQ, and
//! `kvatlas serve --consume-from` replicas — each a process, killed with SIGKILL where the
//! issue says "kill". Every replica must end exactly equal to the engines' caches (the oracle),
//! and replicas must agree query for query.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::Served;
use kvatlas_fleet::engine::{EngineConfig, Engines, Eviction, Router, membership_digest};
use kvatlas_fleet::nats::NatsServer;
use kvatlas_fleet::publish::Publishers;
use kvatlas_fleet::trace::{TraceRequest, block_tokens, default_trace_path, load_trace};
use kvatlas_fleet::vllm::{BLOCK_TOKENS, encode_batch};
use kvatlas_index::{ExternalBlockHash, Mutation, Tier, Worker};
use kvatlas_proto::v1::{self, indexer_client::IndexerClient};
use tokio_stream::StreamExt as _;

const MODEL: &str = "m";
const WORKERS: u32 = 6;
/// Bound on a replica catching up with what was published.
const CONVERGE: Duration = Duration::from_secs(30);

/// Mock engines serving the Mooncake trace, publishing vLLM batches on ZMQ.
struct Fleet {
    engines: Engines,
    router: Router,
    publishers: Publishers,
    trace: Vec<TraceRequest>,
    next: usize,
    tokens: Vec<u32>,
    batches: u64,
}

impl Fleet {
    fn new() -> Self {
        let config = EngineConfig {
            block_tokens: BLOCK_TOKENS,
            ..EngineConfig::new(WORKERS, 96, Eviction::LeafFirst, 7)
        };
        Self {
            engines: Engines::new(&config),
            router: Router::new(&config),
            publishers: Publishers::bind(WORKERS).expect("engine sockets bind"),
            trace: load_trace(&default_trace_path()).expect("the trace loads"),
            next: 0,
            tokens: Vec::new(),
            batches: 0,
        }
    }

    /// `--workers` for `kvatlas serve`.
    fn workers_arg(&self) -> String {
        self.publishers
            .endpoints()
            .iter()
            .map(|e| format!("{}={},replay={}", e.worker, e.live, e.replay))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Serves the next `n` requests (random routing), publishing each one's events.
    fn serve(&mut self, n: usize) {
        let mut events = Vec::<Mutation>::new();
        for _ in 0..n {
            let request = &self.trace[self.next % self.trace.len()];
            self.next += 1;
            let prompt = self.engines.prompt(request);
            let truth = self.engines.scores(&prompt);
            let w = self.router.route(&truth);
            let score = truth
                .binary_search_by_key(&w, |&(ow, _)| ow)
                .map_or(0, |k| truth[k].1);
            events.clear();
            self.engines.serve(w, score, &prompt, &mut events);
            if events.is_empty() {
                continue;
            }
            let ids: BTreeMap<u64, u64> = prompt
                .locals
                .iter()
                .zip(&request.hash_ids)
                .map(|(l, &id)| (l.get(), id))
                .collect();
            let batch = encode_batch(0.0, &events, true, true, &mut self.tokens, |block, out| {
                let id = ids.get(&block.local.get()).copied().unwrap_or_default();
                block_tokens(id, BLOCK_TOKENS as usize, out);
            });
            self.publishers
                .publish(w, batch.payload.into())
                .expect("published");
            self.batches += 1;
        }
    }

    /// The digest of what the engines' caches hold now.
    fn oracle(&self) -> u64 {
        let caches = self.engines.caches();
        membership_digest(
            caches
                .iter()
                .enumerate()
                .flat_map(|(w, blocks)| blocks.iter().map(move |b| (Worker::new(w as u64, 0), b))),
        )
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The membership digest (device tier) of the server's state, from its `Snapshot` RPC.
fn state_digest(grpc: &str) -> Result<u64, String> {
    let bytes = runtime().block_on(async {
        let mut client = IndexerClient::connect(grpc.to_owned())
            .await
            .map_err(|e| e.to_string())?;
        let mut chunks = client
            .snapshot(v1::SnapshotRequest::default())
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        let mut bytes = Vec::new();
        while let Some(chunk) = chunks.next().await {
            bytes.extend_from_slice(&chunk.map_err(|e| e.to_string())?.data);
        }
        Ok::<_, String>(bytes)
    })?;
    let (_, images) = kvatlas_server::snapshot::read(&bytes[..]).map_err(|e| e.to_string())?;
    let memberships: Vec<(Worker, ExternalBlockHash)> = images
        .iter()
        .flat_map(|image| &image.snapshot.workers)
        .flat_map(|w| {
            w.blocks
                .iter()
                .filter(|b| b.tiers.contains(Tier::Device))
                .map(move |b| (w.worker, b.external))
        })
        .collect();
    Ok(membership_digest(memberships.iter().map(|(w, b)| (*w, b))))
}

/// Waits until the server's state equals the oracle.
fn converges(server: &Served, fleet: &Fleet, what: &str) {
    let want = fleet.oracle();
    let started = Instant::now();
    let mut last = Err("never asked".to_owned());
    while started.elapsed() < CONVERGE {
        last = state_digest(&server.grpc);
        if last.as_ref() == Ok(&want) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "{what}: the state did not converge to the engines' caches within {CONVERGE:?} \
         (oracle {want:#x}, server {last:?}); log: {:?}",
        server.log_lines()
    );
}

/// A metric's value from `/metrics` (0 if absent).
fn metric(server: &Served, name: &str) -> u64 {
    let body = http_get(server, "/metrics").expect("GET /metrics");
    body.lines()
        .find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(' ')?;
            rest.trim().parse::<f64>().ok()
        })
        .map_or(0, |v| v as u64)
}

/// The whole answer (status line, headers, body) to `GET path`.
fn http_get(server: &Served, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(&server.http)?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer)
}

/// The answers of both servers to the same prompts, which must be equal.
fn agree(a: &Served, b: &Served, fleet: &mut Fleet) {
    let prompts: Vec<Vec<u64>> = fleet
        .trace
        .iter()
        .take(40)
        .map(|request| {
            fleet
                .engines
                .prompt(request)
                .locals
                .iter()
                .map(|l| l.get())
                .collect()
        })
        .collect();
    let answers = |grpc: &str| {
        runtime().block_on(async {
            let mut client = IndexerClient::connect(grpc.to_owned())
                .await
                .expect("connects");
            let mut all = Vec::new();
            for hashes in &prompts {
                let answer = client
                    .query(v1::QueryRequest {
                        index: Some(v1::IndexSelector {
                            model: MODEL.into(),
                            tenant: String::new(),
                        }),
                        input: Some(v1::query_request::Input::LocalHashes(v1::LocalHashes {
                            hashes: hashes.clone(),
                        })),
                        ..v1::QueryRequest::default()
                    })
                    .await
                    .expect("answered")
                    .into_inner();
                let mut scores: Vec<(u64, u32, u32)> = answer
                    .matches
                    .iter()
                    .map(|m| (m.instance_id, m.dp_rank, m.device_blocks))
                    .collect();
                scores.sort_unstable();
                all.push(scores);
            }
            all
        })
    };
    let (left, right) = (answers(&a.grpc), answers(&b.grpc));
    assert!(
        left.iter().any(|s| !s.is_empty()),
        "the prompts match something"
    );
    assert_eq!(left, right, "the replicas answer alike");
}

fn ingest(nats: &NatsServer, fleet: &Fleet) -> Served {
    ingest_with(nats, fleet, &[])
}

/// An ingest of the fleet's engines with `extra` flags.
fn ingest_with(nats: &NatsServer, fleet: &Fleet, extra: &[&str]) -> Served {
    let (url, block_size, workers) = (nats.url(), BLOCK_TOKENS.to_string(), fleet.workers_arg());
    let mut args = vec![
        "--publish-to",
        &url,
        "--model",
        MODEL,
        "--block-size",
        &block_size,
        "--workers",
        &workers,
    ];
    args.extend_from_slice(extra);
    Served::start(&args)
}

fn replica(nats: &NatsServer) -> Served {
    Served::start(&[
        "--consume-from",
        &nats.url(),
        "--nats-snapshot-interval-secs",
        "1",
    ])
}

#[test]
fn replicas_converge_through_a_replica_kill_a_nats_restart_and_a_late_start() {
    let mut nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let ingest = ingest(&nats, &fleet);
    fleet
        .publishers
        .wait_subscribed(1, Duration::from_secs(20))
        .expect("the ingest subscribes");
    let first = replica(&nats);

    fleet.serve(300);
    converges(&first, &fleet, "replica 1");
    converges(&ingest, &fleet, "the ingest");
    // Let replica 1 write a snapshot, then kill it mid-stream.
    std::thread::sleep(Duration::from_millis(1500));
    fleet.serve(150);
    first.kill_9();
    fleet.serve(150);
    let first = replica(&nats);
    converges(&first, &fleet, "replica 1 after SIGKILL and restart");
    assert!(
        metric(&first, "kvatlas_log_consumed_total") < fleet.batches,
        "the restarted replica started from a snapshot, not the stream's beginning"
    );

    // nats-server restarts (file storage): nothing acknowledged is lost, both sides resume.
    nats.restart().expect("nats-server restarts");
    fleet.serve(300);
    converges(&first, &fleet, "replica 1 after the nats-server restart");

    // A replica started while the ingest is busy.
    let feeder = std::thread::spawn(move || {
        fleet.serve(400);
        fleet
    });
    std::thread::sleep(Duration::from_millis(100));
    let second = replica(&nats);
    let mut fleet = feeder.join().expect("the engines served");
    converges(&second, &fleet, "replica 2, started during the load");
    converges(&first, &fleet, "replica 1");
    agree(&first, &second, &mut fleet);
    for server in [&first, &second] {
        assert_eq!(metric(server, "kvatlas_log_dropped_invalid_total"), 0);
        assert_eq!(metric(server, "kvatlas_log_sequences_lost_total"), 0);
    }
    assert_eq!(metric(&ingest, "kvatlas_log_queued_total"), fleet.batches);
    first.kill_9();
    second.kill_9();
    ingest.kill_9();
}

#[test]
fn two_ingests_deduplicate_and_the_survivor_carries_on() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let one = ingest(&nats, &fleet);
    let two = ingest(&nats, &fleet);
    fleet
        .publishers
        .wait_subscribed(2, Duration::from_secs(20))
        .expect("both ingests subscribe");
    let replica = replica(&nats);
    fleet.serve(300);
    converges(&replica, &fleet, "the replica fed by two ingests");
    // Both ingests publish every batch: each second copy is dropped, by the stream (the same
    // message id) or by the replica (a batch it applied). Ingests group a source's backlog
    // differently, so which of the two drops a copy varies.
    let started = Instant::now();
    let dropped = loop {
        let dropped = metric(&one, "kvatlas_log_publish_duplicates_total")
            + metric(&two, "kvatlas_log_publish_duplicates_total")
            + metric(&replica, "kvatlas_log_dropped_duplicate_total")
            + metric(&replica, "kvatlas_log_dropped_stale_total");
        if dropped >= fleet.batches || started.elapsed() > CONVERGE {
            break dropped;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(dropped, fleet.batches, "each second copy was dropped once");
    assert!(
        metric(&one, "kvatlas_log_publish_duplicates_total")
            + metric(&two, "kvatlas_log_publish_duplicates_total")
            > 0,
        "the stream deduplicated by message id"
    );
    one.kill_9();
    fleet.serve(300);
    converges(&replica, &fleet, "the replica after one ingest died");
    // Every batch applied once: the copies were dropped by the stream or the replica.
    let applied = metric(&replica, "kvatlas_log_applied_total");
    assert_eq!(
        applied, fleet.batches,
        "each engine batch applied exactly once"
    );
    replica.kill_9();
    two.kill_9();
}

/// Waits until the server answers `/ready` with 200 (a replica: it has read the stream).
fn ready(server: &Served) {
    let started = Instant::now();
    while started.elapsed() < CONVERGE {
        if http_get(server, "/ready").is_ok_and(|answer| answer.starts_with("HTTP/1.1 200")) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("not ready within {CONVERGE:?}: {:?}", server.log_lines());
}

/// Sends `signal` (`STOP`, `CONT`) to the server's process.
fn signal(server: &Served, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &server.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal}");
}

#[test]
fn a_replica_behind_the_retention_window_rebootstraps_from_a_snapshot() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    // A stream that keeps only 100 kB of records.
    let ingest = ingest_with(&nats, &fleet, &["--nats-max-bytes", "100000"]);
    fleet
        .publishers
        .wait_subscribed(1, Duration::from_secs(20))
        .expect("the ingest subscribes");
    let keeper = replica(&nats);
    let sleeper = replica(&nats);
    for server in [&keeper, &sleeper] {
        ready(server);
    }
    fleet.serve(20);
    converges(&sleeper, &fleet, "the replica before it is stopped");
    // The sleeper stops reading; the stream moves past what it read.
    signal(&sleeper, "STOP");
    // Far more than the stream keeps, in steps the running replica keeps up with.
    for _ in 0..30 {
        fleet.serve(100);
        std::thread::sleep(Duration::from_millis(30));
    }
    converges(&keeper, &fleet, "the replica that kept up");
    // Let the keeper write a snapshot of the newest state.
    std::thread::sleep(Duration::from_millis(2_500));
    signal(&sleeper, "CONT");
    converges(
        &sleeper,
        &fleet,
        "the replica after it fell behind the retention window",
    );
    assert!(
        metric(&sleeper, "kvatlas_log_rebootstraps_total") >= 1,
        "the replica noticed the stream skipped what it had not read"
    );
    assert_eq!(metric(&sleeper, "kvatlas_log_sequences_lost_total"), 0);
    agree(&keeper, &sleeper, &mut fleet);
    keeper.kill_9();
    sleeper.kill_9();
    ingest.kill_9();
}

#[test]
fn records_lost_to_retention_with_no_snapshot_are_counted_and_the_replica_serves() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let ingest = ingest_with(&nats, &fleet, &["--nats-max-bytes", "20000"]);
    fleet
        .publishers
        .wait_subscribed(1, Duration::from_secs(20))
        .expect("the ingest subscribes");
    // Published before any replica (so before any snapshot), far more than the stream keeps.
    fleet.serve(600);
    converges(&ingest, &fleet, "the ingest");
    let started = Instant::now();
    while metric(&ingest, "kvatlas_log_published_total") < fleet.batches {
        assert!(
            started.elapsed() < CONVERGE,
            "the ingest published everything"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let late = replica(&nats);
    ready(&late);
    let lost = metric(&late, "kvatlas_log_sequences_lost_total");
    assert!(
        lost > 0,
        "the stream's first records were gone and no snapshot covered them"
    );
    assert_eq!(metric(&late, "kvatlas_log_rebootstraps_total"), 1);
    assert_eq!(metric(&late, "kvatlas_log_dropped_invalid_total"), 0);
    late.kill_9();
    ingest.kill_9();
}
