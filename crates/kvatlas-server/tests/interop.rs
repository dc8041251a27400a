//! The server with real parts, run by `cargo xtask interop` (the tests are `#[ignore]`d in a
//! plain `cargo test`; they need the venv and wheels it caches under `target/interop`):
//!
//! - **engines**: vLLM 0.23.0, vLLM 0.33.0 and SGLang 0.5.23's own publisher code
//!   (`xtask/interop/drive_publisher.py`) feed a worker registered over gRPC: a late join healed
//!   by replay, live stores, removes, an offload to the host tier, a clear, an engine restart.
//!   After each phase the server's answers over gRPC equal a `ReferenceIndex` fed the same
//!   payloads, its block counts equal the engine's own cache model, and at shutdown its digest
//!   equals the reference's;
//! - **Python clients**: grpcio stubs generated at test time from the repository's .proto,
//!   grpcio-health-checking, grpcio-reflection (v1alpha), with a bearer token, in plaintext
//!   and over TLS;
//! - **grpcurl**: reflection listing and description and a health check (both without a token),
//!   unary calls with JSON in and out, and a call refused without the token; over TLS, before
//!   and after the certificate is rotated.

mod common;
#[path = "../../../xtask/interop/driver.rs"]
mod driver;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Harness, answer_rows, query_hashes, reference_rows, selector, start};
use driver::{BLOCK, Driver, Layout, Published, TOPIC, WAIT, free_port};
use kvatlas_events::{Converter, DropCounters, EngineKind, Source};
use kvatlas_hash::{BlockHasher, BlockSize, LocalBlockHash};
use kvatlas_index::{
    ExternalBlockHash, KvIndex, MatchOptions, Mutation, ReferenceIndex, Snapshot, Worker,
};
use kvatlas_proto::v1;
use kvatlas_server::ServerConfig;

const WORKER: u64 = 11;
const MODEL: &str = "engine-model";

fn interop_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("KVATLAS_INTEROP_DIR").unwrap_or_else(|| {
        panic!("KVATLAS_INTEROP_DIR is not set: run these tests with `cargo xtask interop`")
    }))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn vllm_0_23_0_through_the_server() {
    engine_scenario("vllm", "0.23.0", EngineKind::Vllm, Layout::Array);
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn vllm_0_33_0_through_the_server() {
    engine_scenario("vllm", "0.33.0", EngineKind::Vllm, Layout::Map);
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn sglang_0_5_23_through_the_server() {
    engine_scenario("sglang", "0.5.23", EngineKind::Sglang, Layout::Map);
}

/// The reference model fed the driver's payloads, and the driver's latest cache model.
struct Expected {
    reference: ReferenceIndex,
    converter: Converter,
    held: BTreeSet<(u64, String)>,
}

impl Expected {
    fn feed(&mut self, batch: &Published) {
        let (mut mutations, mut drops) = (Vec::new(), DropCounters::new());
        self.converter
            .ingest(&batch.payload, &mut mutations, &mut drops)
            .expect("the batch decodes");
        assert_eq!(drops.total(), 0, "seq {} drops {drops:?}", batch.seq);
        for m in &mutations {
            self.reference.apply(m);
        }
        self.held.clone_from(&batch.held);
    }
}

/// Every held block's chain of local hashes, from its root (or the first missing parent).
fn chains(snapshot: &Snapshot) -> Vec<Vec<LocalBlockHash>> {
    let mut out = Vec::new();
    for worker in &snapshot.workers {
        let by_hash: BTreeMap<ExternalBlockHash, _> =
            worker.blocks.iter().map(|b| (b.external, b)).collect();
        for block in &worker.blocks {
            let mut chain = vec![block.local];
            let mut parent = block.parent;
            while let Some(p) = parent.and_then(|p| by_hash.get(&p)) {
                chain.push(p.local);
                parent = p.parent;
                if chain.len() > worker.blocks.len() {
                    break;
                }
            }
            chain.reverse();
            out.push(chain);
        }
    }
    out
}

async fn check(h: &mut Harness, expected: &Expected, phase: &str) {
    // Every held chain, and its first block alone, answered like the reference.
    let options = MatchOptions::default().with_tiered(true);
    let snapshot = expected.reference.snapshot();
    let prompts = chains(&snapshot);
    assert!(
        !prompts.is_empty(),
        "{phase}: the scenario should hold blocks"
    );
    for prompt in prompts {
        let answer = query_hashes(h, MODEL, &prompt).await;
        assert_eq!(
            answer_rows(&answer),
            reference_rows(&expected.reference.find_matches(&prompt, &options)),
            "{phase}: prompt {prompt:?}"
        );
    }
    // The blocks per tier the server reports equal the engine's own model of its cache.
    let listed = h
        .client
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner();
    let blocks = listed.workers[0].blocks.unwrap_or_default();
    let count = |tier: &str| expected.held.iter().filter(|(_, t)| t == tier).count() as u64;
    assert_eq!(
        (blocks.device, blocks.host),
        (count("Device"), count("Host")),
        "{phase}: the server's blocks differ from the engine's cache"
    );
}

async fn worker_state(h: &mut Harness) -> v1::WorkerInfo {
    h.client
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner()
        .workers
        .into_iter()
        .find(|w| w.source == v1::WorkerSource::Zmq as i32)
        .expect("the registered worker")
}

/// Publishes empty batches until the server's listener applied the last one and `also` holds.
async fn pump(
    h: &mut Harness,
    driver: &mut Driver,
    expected: &mut Expected,
    also: impl Fn(&v1::WorkerCounters) -> bool,
) {
    let start = Instant::now();
    loop {
        let batch = driver.publish("empty");
        expected.feed(&batch);
        let deadline = Instant::now() + Duration::from_millis(300);
        while Instant::now() < deadline {
            let state = worker_state(h).await;
            if state.last_seq == Some(batch.seq) && also(&state.counters.unwrap_or_default()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(start.elapsed() < WAIT, "the listener never caught up");
    }
}

fn engine_scenario(engine: &str, version: &str, kind: EngineKind, layout: Layout) {
    let runtime = runtime();
    let (port, replay_port) = (free_port(), free_port());
    let mut driver = Driver::spawn(
        engine,
        version,
        &format!("tcp://*:{port}"),
        &format!("tcp://*:{replay_port}"),
    );
    let source = Source {
        worker_id: WORKER,
        dp_rank: 0,
        block_size: BlockSize::new(BLOCK).expect("size"),
        engine: kind,
    };
    let mut expected = Expected {
        reference: ReferenceIndex::new(),
        converter: Converter::new(source),
        held: BTreeSet::new(),
    };
    runtime.block_on(async {
        let mut h = start(ServerConfig::default()).await;
        // 1. Late join: two stores go out before the worker is registered.
        driver.command("start");
        for step in ["store_root", "store_chain"] {
            let batch = driver.publish(step);
            assert_eq!(batch.layout, Some(layout));
            expected.feed(&batch);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        h.client
            .register_worker(v1::RegisterWorkerRequest {
                index: selector(MODEL, ""),
                instance_id: WORKER,
                block_size: BLOCK,
                engine: match kind {
                    EngineKind::Vllm => v1::EngineKind::Vllm,
                    EngineKind::Sglang => v1::EngineKind::Sglang,
                } as i32,
                endpoint: format!("tcp://127.0.0.1:{port}"),
                replay_endpoint: format!("tcp://127.0.0.1:{replay_port}"),
                topic: TOPIC.into(),
                ..v1::RegisterWorkerRequest::default()
            })
            .await
            .expect("registers");
        let batch = driver.publish("remove_store");
        expected.feed(&batch);
        pump(&mut h, &mut driver, &mut expected, |_| true).await;
        check(&mut h, &expected, "late join + live").await;
        let c = worker_state(&mut h).await.counters.unwrap_or_default();
        assert!(c.replays_completed >= 1 && c.batches_replayed >= 2, "{c:?}");
        assert_eq!(c.resyncs, 0, "{c:?}");

        // 2. A clear and a new chain.
        for step in ["clear", "store_after_clear"] {
            let batch = driver.publish(step);
            expected.feed(&batch);
        }
        pump(&mut h, &mut driver, &mut expected, |_| true).await;
        check(&mut h, &expected, "clear + new chain").await;
        for _ in 0..10 {
            let batch = driver.publish("empty");
            expected.feed(&batch);
        }
        pump(&mut h, &mut driver, &mut expected, |_| true).await;
        let before = worker_state(&mut h).await.counters.unwrap_or_default();

        // 3. The engine restarts: its sequence starts again at 0.
        driver.command("stop");
        driver.command("start");
        expected.reference.apply(&Mutation::Cleared {
            worker: Worker::new(WORKER, 0),
        });
        for step in ["store_root", "store_chain"] {
            let batch = driver.publish(step);
            expected.feed(&batch);
        }
        let restarts = before.restarts;
        pump(&mut h, &mut driver, &mut expected, |c| {
            c.restarts > restarts
        })
        .await;
        check(&mut h, &expected, "after restart").await;
        let c = worker_state(&mut h).await.counters.unwrap_or_default();
        assert_eq!(
            (c.restarts, c.decode_errors, c.bad_frames),
            (1, 0, 0),
            "{c:?}"
        );
        assert!(c.dropped.is_empty(), "{c:?}");
        let report = h.server.shutdown().await;
        assert_eq!(
            report.indexes[0].digest,
            expected.reference.snapshot().digest(),
            "the server's final state differs from the reference"
        );
    });
    driver.quit();
    eprintln!("{engine} {version}: ok through the server ({layout:?} layout)");
}

// ---------------------------------------------------------------------------------------------
// Third-party gRPC clients
// ---------------------------------------------------------------------------------------------

const TOKEN: &str = "interop-token-0123456789";

fn token_file(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvatlas-interop-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("tokens");
    std::fs::write(&path, format!("{TOKEN} name=interop\n")).expect("write");
    path
}

#[test]
#[ignore = "needs the Python clients and grpcurl: run `cargo xtask interop`"]
fn python_grpcio_clients_with_health_and_reflection() {
    python_grpcio_clients(None);
    let dir = std::env::temp_dir().join(format!("kvatlas-interop-tls-{}", std::process::id()));
    python_grpcio_clients(Some(certificate(&dir)));
    let _ = std::fs::remove_dir_all(dir);
}

/// A self-signed certificate for 127.0.0.1 and its key, written to `dir` (cert.pem, key.pem).
fn certificate(dir: &std::path::Path) -> kvatlas_server::TlsFiles {
    common::self_signed_certificate(dir).0
}

/// The Python clients' scenario against a server, over TLS with `tls`.
fn python_grpcio_clients(tls: Option<kvatlas_server::TlsFiles>) {
    let runtime = runtime();
    // (The harness's plaintext client would not connect to a TLS server.)
    let server = runtime
        .block_on(kvatlas_server::RunningServer::start(ServerConfig {
            auth_tokens: Some(token_file("python")),
            tls: tls.clone(),
            ..ServerConfig::ephemeral()
        }))
        .expect("the server starts");
    let block = 4u32;
    let tokens = |n: u32, base: u32| -> Vec<u32> { (base..base + n * block).collect() };
    let stores = [(1u64, tokens(3, 1)), (2, tokens(2, 1)), (3, tokens(2, 500))];
    let prompts = [tokens(4, 1), tokens(2, 500), tokens(1, 9000), tokens(1, 1)];
    let spec = serde_json::json!({
        "model": "py",
        "block_size": block,
        "stores": stores.iter().map(|(i, t)| serde_json::json!({"instance": i, "tokens": t})).collect::<Vec<_>>(),
        "prompts": prompts,
    });
    // The reference's answers for the same stores.
    let hasher = BlockHasher::new(block).expect("size");
    let mut reference = ReferenceIndex::new();
    for (instance, tokens) in &stores {
        let locals: Vec<_> = hasher.local_hashes(tokens).collect();
        reference.apply(&Mutation::Stored {
            worker: Worker::new(*instance, 0),
            tier: kvatlas_index::Tier::Device,
            parent: None,
            blocks: locals
                .iter()
                .enumerate()
                .map(|(i, &local)| kvatlas_index::StoredBlock {
                    external: ExternalBlockHash::new(instance * 1000 + i as u64),
                    local,
                })
                .collect(),
        });
    }
    let expected: Vec<Vec<[u64; 5]>> = prompts
        .iter()
        .map(|p| {
            let locals: Vec<_> = hasher.local_hashes(p).collect();
            reference_rows(
                &reference.find_matches(&locals, &MatchOptions::default().with_tiered(true)),
            )
            .into_iter()
            .map(|(i, r, d, ho, l)| [i, u64::from(r), u64::from(d), u64::from(ho), u64::from(l)])
            .collect()
        })
        .collect();

    let dir = interop_dir();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/grpc_clients.py");
    let proto = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kvatlas-proto/proto");
    let scratch = std::env::temp_dir().join(format!("kvatlas-py-stubs-{}", std::process::id()));
    let mut child = Command::new(dir.join("venv/bin/python"))
        .arg(&script)
        .arg(server.grpc_addr().to_string())
        .arg(&proto)
        .arg(&scratch)
        .arg(TOKEN)
        .args(tls.iter().map(|files| &files.cert))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python runs");
    std::io::Write::write_all(
        child.stdin.as_mut().expect("stdin"),
        spec.to_string().as_bytes(),
    )
    .expect("spec");
    drop(child.stdin.take());
    let output = child.wait_with_output().expect("python exits");
    assert!(output.status.success(), "the Python client failed");
    let result: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the script's JSON");
    assert_eq!(result["health"], "SERVING");
    let services: Vec<&str> = result["services"]
        .as_array()
        .expect("services")
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    for service in ["kvatlas.v1.Indexer", "grpc.health.v1.Health"] {
        assert!(services.contains(&service), "{services:?}");
    }
    assert_eq!(result["messages_applied"], 3);
    let answers = |key: &str| -> Vec<Vec<[u64; 5]>> {
        serde_json::from_value(result[key].clone()).expect("answers")
    };
    assert_eq!(answers("unary"), expected);
    assert_eq!(answers("stream"), expected);
    assert_eq!(result["errors"]["empty_model"][0], "INVALID_ARGUMENT");
    assert_eq!(result["errors"]["unknown_model"][0], "NOT_FOUND");
    assert!(
        result["errors"]["unknown_model"][1]
            .as_str()
            .is_some_and(|m| m.contains("no index for model \"nope\""))
    );
    assert_eq!(
        result["workers"],
        serde_json::json!([
            [1, "WORKER_SOURCE_GRPC"],
            [2, "WORKER_SOURCE_GRPC"],
            [3, "WORKER_SOURCE_GRPC"]
        ])
    );
    runtime.block_on(server.shutdown());
    let _ = std::fs::remove_dir_all(scratch);
}

fn grpcurl(args: &[&str]) -> (bool, String) {
    let output = Command::new(interop_dir().join("venv/bin/grpcurl"))
        .args(args)
        .output()
        .expect("grpcurl runs");
    (
        output.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

#[test]
#[ignore = "needs grpcurl: run `cargo xtask interop`"]
fn grpcurl_lists_describes_and_calls() {
    let runtime = runtime();
    let h = runtime.block_on(start(ServerConfig {
        auth_tokens: Some(token_file("grpcurl")),
        ..ServerConfig::default()
    }));
    let addr = h.server.grpc_addr().to_string();
    let auth = format!("authorization: Bearer {TOKEN}");
    // Reflection (the API's schema, public anyway) and health need no token.
    let (ok, out) = grpcurl(&["-plaintext", &addr, "list"]);
    assert!(ok, "{out}");
    for service in [
        "kvatlas.v1.Indexer",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(out.lines().any(|l| l == service), "{service}: {out}");
    }
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-H",
        &auth,
        &addr,
        "describe",
        "kvatlas.v1.Indexer",
    ]);
    assert!(
        ok && out.contains("rpc QueryStream ( stream .kvatlas.v1.QueryRequest )"),
        "{out}"
    );
    // Without the token, the service's RPCs are refused.
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"model": "curl"}"#,
        &addr,
        "kvatlas.v1.Indexer/ListIndexes",
    ]);
    assert!(!ok && out.contains("Unauthenticated"), "{out}");
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"service": "kvatlas.v1.Indexer"}"#,
        &addr,
        "grpc.health.v1.Health/Check",
    ]);
    assert!(ok && out.contains("SERVING"), "{out}");
    // A unary call with JSON in and out.
    let publish = r#"{"index": {"model": "curl"}, "instanceId": "4", "blockSize": 2, "events": [{"stored": {"blockHashes": ["1", "2"], "tokenIds": [1, 2, 3, 4]}}]}"#;
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-H",
        &auth,
        "-d",
        publish,
        &addr,
        "kvatlas.v1.Indexer/PublishEvents",
    ]);
    assert!(ok && out.contains("\"messagesApplied\": \"1\""), "{out}");
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-H",
        &auth,
        "-d",
        r#"{"index": {"model": "curl"}, "tokens": {"ids": [1, 2, 3, 4, 5]}}"#,
        &addr,
        "kvatlas.v1.Indexer/Query",
    ]);
    assert!(ok, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).expect("JSON answer");
    assert_eq!(answer["matches"][0]["instanceId"], "4");
    assert_eq!(answer["matches"][0]["deviceBlocks"], 2);
    assert_eq!(answer["blockSize"], 2);
    runtime.block_on(h.server.shutdown());

    // Over TLS, and again after the certificate is rotated in place and reloaded: grpcurl
    // trusting the first certificate is refused, trusting the second it is served.
    let dir = std::env::temp_dir().join(format!("kvatlas-grpcurl-tls-{}", std::process::id()));
    let files = certificate(&dir);
    let first = dir.join("first.pem");
    std::fs::copy(&files.cert, &first).expect("copy");
    let server = runtime
        .block_on(kvatlas_server::RunningServer::start(ServerConfig {
            auth_tokens: Some(token_file("grpcurl-tls")),
            tls: Some(files.clone()),
            // Only the test's reload (a periodic check could take the rotation first).
            reload_check: None,
            ..ServerConfig::ephemeral()
        }))
        .expect("the server starts");
    let addr = server.grpc_addr().to_string();
    let list = |ca: &std::path::Path| {
        grpcurl(&[
            "-cacert",
            &ca.display().to_string(),
            "-H",
            &auth,
            "-d",
            "{}",
            &addr,
            "kvatlas.v1.Indexer/ListIndexes",
        ])
    };
    let (ok, out) = list(&first);
    assert!(ok, "over TLS: {out}");
    certificate(&dir);
    let reloaded = runtime.block_on(server.reload());
    assert_eq!(
        reloaded.tls,
        Some(kvatlas_server::ReloadOutcome::Applied),
        "{reloaded:?}"
    );
    let (ok, out) = list(&first);
    assert!(
        !ok && out.contains("certificate"),
        "the first certificate is gone: {out}"
    );
    let (ok, out) = list(&files.cert);
    assert!(ok, "the second certificate: {out}");
    runtime.block_on(server.shutdown());
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Recovery with engines publishing
// ---------------------------------------------------------------------------------------------

/// The ZMQ workers a server lists, as (instance, last seq, counters).
async fn zmq_workers(h: &mut Harness) -> Vec<(u64, Option<u64>, v1::WorkerCounters)> {
    h.client
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner()
        .workers
        .into_iter()
        .filter(|w| w.source == v1::WorkerSource::Zmq as i32)
        .map(|w| (w.instance_id, w.last_seq, w.counters.unwrap_or_default()))
        .collect()
}

/// Nudges the fleet until every server applied every member's last batch.
async fn settle(fleet: &mut driver::Fleet, servers: &mut [&mut Harness]) {
    let start = Instant::now();
    loop {
        let mut behind = false;
        for h in servers.iter_mut() {
            let listed = zmq_workers(h).await;
            for member in &fleet.members {
                let seq = listed
                    .iter()
                    .find(|(id, _, _)| *id == member.instance_id)
                    .and_then(|(_, seq, _)| *seq);
                behind |= seq != member.last_seq();
            }
        }
        if !behind {
            return;
        }
        assert!(start.elapsed() < WAIT, "the servers never caught up");
        tokio::time::sleep(Duration::from_millis(300)).await;
        fleet.nudge();
    }
}

/// Every held chain of the reference answered alike by the server.
async fn same_answers(h: &mut Harness, reference: &ReferenceIndex, model: &str, what: &str) {
    let options = MatchOptions::default().with_tiered(true);
    let prompts = chains(&reference.snapshot());
    assert!(!prompts.is_empty(), "{what}: the fleet should hold blocks");
    for prompt in prompts {
        let answer = query_hashes(h, model, &prompt).await;
        assert_eq!(
            answer_rows(&answer),
            reference_rows(&reference.find_matches(&prompt, &options)),
            "{what}: prompt {prompt:?}"
        );
    }
}

fn fleet_workers(fleet: &driver::Fleet, model: &str) -> Vec<kvatlas_server::WorkerRegistration> {
    fleet
        .members
        .iter()
        .map(|m| kvatlas_server::WorkerRegistration {
            index: kvatlas_server::IndexKey::new(model, ""),
            instance_id: m.instance_id,
            dp_rank: 0,
            block_size: BlockSize::new(BLOCK).expect("size"),
            engine: EngineKind::Vllm,
            endpoint: m.endpoint(),
            replay_endpoint: Some(m.replay_endpoint()),
            topic: TOPIC.into(),
            mode: kvatlas_events::SocketMode::Connect,
            pod_name: None,
        })
        .collect()
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn a_replica_bootstraps_from_a_peer_while_engines_publish() {
    const REPLICATED: &str = "replicated";
    let runtime = runtime();
    let mut fleet = driver::Fleet::spawn("vllm", "0.33.0", &[21, 22, 23]);
    runtime.block_on(async {
        let workers = fleet_workers(&fleet, REPLICATED);
        let mut a = start(ServerConfig {
            workers: workers.clone(),
            ..ServerConfig::default()
        })
        .await;
        fleet.round(30, false);
        settle(&mut fleet, &mut [&mut a]).await;
        // The engines keep publishing while B starts, subscribes (held), fetches A's snapshot,
        // restores it and continues from A's watermarks.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let publishing = fleet.publish_in_background(10, false, Duration::from_millis(5), stop.clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut b = start(ServerConfig {
            workers,
            peers: vec![format!("http://{}", a.server.http_addr())],
            ..ServerConfig::default()
        })
        .await;
        let outcome = b.server.bootstrap().await.expect("a bootstrap");
        assert!(
            matches!(outcome, kvatlas_server::Bootstrap::Snapshot { memberships, .. } if memberships > 0),
            "{outcome:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.store(true, std::sync::atomic::Ordering::Release);
        let mut fleet = publishing.join().expect("the publishing thread");
        settle(&mut fleet, &mut [&mut a, &mut b]).await;
        let reference = fleet.reference(EngineKind::Vllm);
        same_answers(&mut a, &reference, REPLICATED, "A").await;
        same_answers(&mut b, &reference, REPLICATED, "B").await;
        // Nothing was lost on the way (no rank of B resynced, no gap) and B continued from A's
        // watermarks: it applied only the batches after the snapshot, not the engines' history.
        for (id, _, c) in zmq_workers(&mut b).await {
            let published = fleet
                .members
                .iter()
                .find(|m| m.instance_id == id)
                .map_or(0, |m| m.published.len() as u64);
            assert_eq!((c.resyncs, c.gaps), (0, 0), "B's worker {id}: {c:?}");
            assert!(
                c.batches_applied > 0 && c.batches_applied < published,
                "B's worker {id} applied {} of {published} batches: {c:?}",
                c.batches_applied
            );
            eprintln!(
                "B's worker {id}: {} batches applied, {} replayed, {} duplicates, {} catch-ups",
                c.batches_applied, c.batches_replayed, c.duplicates, c.catch_ups
            );
        }
        let (a_report, b_report) = (a.server.shutdown().await, b.server.shutdown().await);
        let digest = reference.snapshot().digest();
        assert_eq!(a_report.indexes[0].digest, digest, "A equals the reference");
        assert_eq!(b_report.indexes[0].digest, digest, "B equals the reference");
        fleet.quit();
    });
}

// ---------------------------------------------------------------------------------------------
// llm-d's GetPodScores from Python
// ---------------------------------------------------------------------------------------------

/// Runs `tests/python/llmd_client.py` with `args`; its JSON output.
fn llmd_script(args: &[&str]) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/llmd_client.py");
    let output = Command::new(interop_dir().join("venv/bin/python"))
        .arg(&script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "llmd_client.py {} failed",
        args.first().copied().unwrap_or_default()
    );
    serde_json::from_slice(&output.stdout).expect("the script's JSON")
}

/// llm-d's `indexer.v1.IndexerService/GetPodScores` as an llm-d router calls it: a tokenizer
/// trained in Python (byte-level BPE with a BOS its post-processor adds) given to the server,
/// workers registered with pod names and fed over ZMQ in vLLM's format (an offload to the CPU
/// tier, a batch carrying another data-parallel rank) and one over `PublishEvents`; the script
/// checks the answers against its own port of llm-d's scorer over the same tokenizer's ids, and
/// that a client generated from llm-d's upstream proto reads them unchanged.
#[test]
#[ignore = "needs the Python clients and tokenizers: run `cargo xtask interop`"]
fn llmd_get_pod_scores_from_python() {
    const LLMD_MODEL: &str = "tiny-bpe";
    let scratch = std::env::temp_dir().join(format!("kvatlas-llmd-py-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let trained = llmd_script(&["train", scratch.to_str().expect("utf-8 path")]);
    let tokenizer = trained["tokenizer"].as_str().expect("the tokenizer's path");
    let runtime = runtime();
    let h = runtime.block_on(start(ServerConfig {
        tokenizers: vec![
            kvatlas_server::TokenizerFile::parse(&format!("{LLMD_MODEL}={tokenizer}"))
                .expect("spec"),
        ],
        ..ServerConfig::default()
    }));
    let proto = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kvatlas-proto/proto");
    let result = llmd_script(&[
        "run",
        &h.server.grpc_addr().to_string(),
        proto.to_str().expect("utf-8 path"),
        scratch.to_str().expect("utf-8 path"),
        tokenizer,
        LLMD_MODEL,
    ]);
    eprintln!("llmd_client.py: {result}");
    // The script asserted every answer against llm-d's scorer; what it saw, in brief.
    let a = result["answers"]["A"].as_array().expect("answers");
    assert_eq!(a.len(), 3, "three pods hold prompt A: {a:?}");
    assert!(
        a.contains(&serde_json::json!(["10.0.0.2:8000", 10.0, 1])),
        "pod 10.0.0.2:8000 answers with its rank 1's 10 blocks: {a:?}"
    );
    assert!(
        a.contains(&serde_json::json!([
            "10.0.0.1:8000",
            1.0 + 1.0 + 1.0 + 0.8 + 0.8,
            0
        ])),
        "3 GPU blocks and 2 offloaded to the CPU: {a:?}"
    );
    assert_eq!(result["answers"]["empty"], serde_json::json!([]));
    assert_eq!(result["upstream_client"], "same answers");
    assert_eq!(result["no_tokenizer"][0], "FAILED_PRECONDITION");
    assert!(
        result["no_tokenizer"][1]
            .as_str()
            .is_some_and(|m| m.contains("--tokenizer no-tokenizer-model=PATH")),
        "{result}"
    );
    assert!(
        result["services"]
            .as_array()
            .is_some_and(|s| s.contains(&serde_json::json!("indexer.v1.IndexerService"))),
        "{result}"
    );
    assert_eq!(
        result["pod_names"],
        serde_json::json!([
            [1, 0, "10.0.0.1:8000"],
            [2, 0, "10.0.0.2:8000"],
            [2, 1, ""],
            [7, 0, ""]
        ])
    );
    runtime.block_on(h.server.shutdown());
    let _ = std::fs::remove_dir_all(scratch);
}
