//! Mock engines for the binary's tests: a fleet of vLLM-format publishers serving the Mooncake
//! trace over ZMQ (with replay), the engines' caches as the oracle, and helpers that read a
//! `kvatlas serve` child's state, metrics and readiness.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kvatlas_fleet::engine::{EngineConfig, Engines, Eviction, Router, membership_digest};
use kvatlas_fleet::publish::Publishers;
use kvatlas_fleet::trace::{TraceRequest, block_tokens, default_trace_path, load_trace};
use kvatlas_fleet::vllm::{BLOCK_TOKENS, encode_batch};
use kvatlas_index::{ExternalBlockHash, Mutation, Tier, Worker};
use kvatlas_proto::v1::{self, indexer_client::IndexerClient};
use tokio_stream::StreamExt as _;

use super::Served;

/// Engines in a fleet.
pub const WORKERS: u32 = 6;
/// Bound on a server catching up with what was published.
pub const CONVERGE: Duration = Duration::from_secs(30);

/// Mock engines serving the Mooncake trace, publishing vLLM batches on ZMQ.
pub struct Fleet {
    pub engines: Engines,
    pub router: Router,
    pub publishers: Publishers,
    pub trace: Vec<TraceRequest>,
    next: usize,
    tokens: Vec<u32>,
    /// Batches published so far.
    pub batches: u64,
    /// Stamp each batch with the wall clock as an engine does (otherwise `ts` is 0, which
    /// servers take as no stamp).
    pub stamped: bool,
}

impl Fleet {
    /// [`WORKERS`] engines replaying everything they published.
    pub fn new() -> Self {
        Self::with_ring(None)
    }

    /// [`WORKERS`] engines, each replaying only its newest `ring` batches (`None`: all).
    pub fn with_ring(ring: Option<usize>) -> Self {
        let config = EngineConfig {
            block_tokens: BLOCK_TOKENS,
            ..EngineConfig::new(WORKERS, 96, Eviction::LeafFirst, 7)
        };
        Self {
            engines: Engines::new(&config),
            router: Router::new(&config),
            publishers: Publishers::bind_with_ring(WORKERS, ring).expect("engine sockets bind"),
            trace: load_trace(&default_trace_path()).expect("the trace loads"),
            next: 0,
            tokens: Vec::new(),
            batches: 0,
            stamped: false,
        }
    }

    /// Waits until every engine has `subscribers` subscribers (the servers listen to all).
    pub fn wait_subscribed(&self, subscribers: usize) {
        self.publishers
            .wait_subscribed(subscribers, Duration::from_secs(20))
            .expect("the servers subscribe to every engine");
    }

    /// `--workers` for `kvatlas serve`.
    pub fn workers_arg(&self) -> String {
        self.publishers
            .endpoints()
            .iter()
            .map(|e| format!("{}={},replay={}", e.worker, e.live, e.replay))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Serves the next `n` requests (random routing), publishing each one's events.
    pub fn serve(&mut self, n: usize) {
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
            let ts = if self.stamped {
                kvatlas_fleet::vllm::wall_clock_seconds()
            } else {
                0.0
            };
            let batch = encode_batch(ts, &events, true, true, &mut self.tokens, |block, out| {
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
    pub fn oracle(&self) -> u64 {
        let held = self.held();
        membership_digest(held.iter().map(|(w, b)| (*w, b)))
    }

    /// What the engines' caches hold now: (rank, block) memberships.
    pub fn held(&self) -> BTreeSet<(Worker, ExternalBlockHash)> {
        self.engines
            .caches()
            .into_iter()
            .enumerate()
            .flat_map(|(w, blocks)| {
                blocks
                    .into_iter()
                    .map(move |b| (Worker::new(w as u64, 0), b))
            })
            .collect()
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The membership digest (device tier) of the server's state, from its `Snapshot` RPC.
pub fn state_digest(grpc: &str) -> Result<u64, String> {
    let held = state_memberships(grpc)?;
    Ok(membership_digest(held.iter().map(|(w, b)| (*w, b))))
}

/// The server's (rank, block) memberships on the device tier, from its `Snapshot` RPC.
pub fn state_memberships(grpc: &str) -> Result<BTreeSet<(Worker, ExternalBlockHash)>, String> {
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
    Ok(images
        .iter()
        .flat_map(|image| &image.snapshot.workers)
        .flat_map(|w| {
            w.blocks
                .iter()
                .filter(|b| b.tiers.contains(Tier::Device))
                .map(move |b| (w.worker, b.external))
        })
        .collect())
}

/// The sum of a labelled metric's series whose labels contain `having` (e.g. `kind="gap"`).
pub fn metric_sum(server: &Served, name: &str, having: &str) -> u64 {
    let body = http_get(server, "/metrics").expect("GET /metrics");
    body.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(having))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits until the server's state equals the oracle.
pub fn converges(server: &Served, fleet: &Fleet, what: &str) {
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

/// Waits until `check` holds (panicking with `what` after [`CONVERGE`]).
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < CONVERGE, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A metric's value from `/metrics` (0 if absent).
pub fn metric(server: &Served, name: &str) -> u64 {
    let body = http_get(server, "/metrics").expect("GET /metrics");
    body.lines()
        .find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(' ')?;
            rest.trim().parse::<f64>().ok()
        })
        .map_or(0, |v| v as u64)
}

/// The whole answer (status line, headers, body) to `GET path`.
pub fn http_get(server: &Served, path: &str) -> std::io::Result<String> {
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

/// Waits until the server answers `/ready` with 200 (a replica: it has read the stream).
pub fn ready(server: &Served) {
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
pub fn signal(server: &Served, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &server.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal}");
}
