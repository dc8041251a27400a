//! kvatlas's Dynamo routes beside Dynamo's own standalone indexer (`python -m dynamo.indexer`
//! from `ai-dynamo-runtime==1.6.1`, the venv `cargo xtask interop` builds; its interpreter in
//! `KVATLAS_DYNAMO_PYTHON`), run by `cargo xtask interop` (`#[ignore]`d in a plain `cargo test`).
//!
//! Both services are registered the same real publishers (vLLM 0.33.0's and SGLang 0.5.23's own
//! publisher code, `xtask/interop/driver.rs`) with the same `/register` bodies and asked the same
//! requests. Status codes always agree; bodies agree exactly where Dynamo's are stable (its maps
//! and arrays are compared as sets: their order varies between calls in 1.6.1); answers agree
//! where Dynamo is exact (leaf-first eviction, uniform engine hashes). Where kvatlas answers
//! differently on purpose, the test names the case, checks kvatlas against `ReferenceIndex` fed
//! the same payloads, and prints what Dynamo answered (`docs/server.md`, "Differences from
//! Dynamo 1.6.1"):
//!
//! - `routes_answer_like_dynamo`: registration, `/workers` (kvatlas's a superset), `/query`,
//!   `/query_by_hash`, `/dump` (as sets of blocks), the peer routes, `/health`, `/metrics`,
//!   `/unregister`, and the error cases (400, 404, 405, 409, 415, 422);
//! - `each_recovers_the_others_dump`: a Dynamo replica started with `--peers` at kvatlas answers
//!   like kvatlas, and a kvatlas replica bootstrapped from Dynamo's `/dump` answers like Dynamo;
//! - `head_first_eviction`, `non_uniform_engine_hashes`, `tenant_isolation`,
//!   `intended_differences_in_requests` (the Mooncake RFC's field names among them): the
//!   intended differences.

mod common;
#[path = "../../../xtask/interop/driver.rs"]
mod driver;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::{Harness, start};
use driver::{BLOCK, Fleet, Member, WAIT, free_port, reference_of};
use kvatlas_events::EngineKind;
use kvatlas_hash::BlockHasher;
use kvatlas_index::{KvIndex, MatchOptions, Matches, ReferenceIndex};
use kvatlas_server::{Bootstrap, ServerConfig};
use serde_json::{Value, json};

const MODEL: &str = "compat";
const JSON: Option<&str> = Some("application/json");

/// One test at a time: each runs two services and several Python publishers on two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

/// An HTTP answer: status, the headers compared, body.
#[derive(Debug, Clone)]
struct Reply {
    status: u16,
    content_type: Option<String>,
    allow: Option<String>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {:?}", self.status, self.body))
    }
}

/// One HTTP/1.1 request (`connection: close`), read to the end.
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: &str,
) -> Reply {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    stream.set_read_timeout(Some(WAIT)).expect("read timeout");
    let content_type = content_type.map_or_else(String::new, |c| format!("content-type: {c}\r\n"));
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\n{content_type}content-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"));
    let (status, body) = common::parse_http(&response);
    let head = response.split("\r\n\r\n").next().unwrap_or_default();
    let header = |name: &str| {
        head.lines().skip(1).find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    Reply {
        status,
        content_type: header("content-type"),
        allow: header("allow"),
        body,
    }
}

/// A POST of `len` bytes (`{}` and spaces: JSON, were it not too long), as a client over a
/// route's body limit sends it.
fn post_long(addr: SocketAddr, path: &str, len: usize) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    stream.set_read_timeout(Some(WAIT)).expect("read timeout");
    let mut body = b"{}".to_vec();
    body.resize(len, b' ');
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {len}\r\nconnection: close\r\n\r\n"
    )
    .expect("send");
    stream.write_all(&body).expect("send the body");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .unwrap_or_else(|e| panic!("POST {path} of {len} bytes on {addr}: {e}"));
    common::parse_http(&response)
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, JSON, &body.to_string())
}

fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, None, "")
}

// ---------------------------------------------------------------------------------------------
// Dynamo's standalone indexer
// ---------------------------------------------------------------------------------------------

/// `python -m dynamo.indexer` on a free port; killed on drop, its log printed if the test is
/// failing.
struct Dynamo {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Dynamo {
    /// Starts it with `args` (after `--port`) and waits (bounded) until `/health` answers.
    fn start(args: &[&str]) -> Self {
        let python = std::env::var_os("KVATLAS_DYNAMO_PYTHON").unwrap_or_else(|| {
            panic!(
                "KVATLAS_DYNAMO_PYTHON is not set: run these tests with `cargo xtask interop` \
                 (it installs ai-dynamo-runtime 1.6.1 in target/interop/dynamo-venv)"
            )
        });
        let port = free_port();
        let log =
            std::env::temp_dir().join(format!("kvatlas-dynamo-{}-{port}.log", std::process::id()));
        let file = std::fs::File::create(&log).expect("the log file");
        let child = Command::new(&python)
            .args(["-m", "dynamo.indexer", "--port", &port.to_string()])
            .args(args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", PathBuf::from(&python).display()));
        let mut dynamo = Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
        };
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = dynamo.child.try_wait() {
                panic!("Dynamo exited ({status}) at start:\n{}", dynamo.log());
            }
            if TcpStream::connect(dynamo.addr).is_ok() && get(dynamo.addr, "/health").status == 200
            {
                return dynamo;
            }
            assert!(
                start.elapsed() < WAIT,
                "Dynamo did not answer /health within {WAIT:?}:\n{}",
                dynamo.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its log so far, without colours.
    fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut out = String::with_capacity(text.len());
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }
}

impl Drop for Dynamo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!(
                "---- Dynamo on {} (last {} log lines) ----",
                self.addr,
                tail.len()
            );
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

// ---------------------------------------------------------------------------------------------
// The two services side by side
// ---------------------------------------------------------------------------------------------

/// Dynamo and kvatlas, fresh.
struct Pair {
    runtime: tokio::runtime::Runtime,
    kvatlas: Option<Harness>,
    dynamo: Dynamo,
}

impl Pair {
    fn start(dynamo_args: &[&str]) -> Self {
        let runtime = runtime();
        let kvatlas = runtime.block_on(start(ServerConfig::default()));
        let dynamo = Dynamo::start(dynamo_args);
        Self {
            runtime,
            kvatlas: Some(kvatlas),
            dynamo,
        }
    }

    fn k(&self) -> SocketAddr {
        self.kvatlas.as_ref().expect("running").server.http_addr()
    }

    fn d(&self) -> SocketAddr {
        self.dynamo.addr
    }

    /// The same request to both: (Dynamo's reply, kvatlas's).
    fn both(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &str,
    ) -> (Reply, Reply) {
        (
            request(self.d(), method, path, content_type, body),
            request(self.k(), method, path, content_type, body),
        )
    }

    /// The same request to both, answered alike (status, content type, `allow`, body); kvatlas's
    /// reply.
    fn same(
        &self,
        what: &str,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &str,
    ) -> Reply {
        let (d, k) = self.both(method, path, content_type, body);
        same_reply(what, &d, &k);
        k
    }

    fn same_post(&self, what: &str, path: &str, body: &Value) -> Reply {
        self.same(what, "POST", path, JSON, &body.to_string())
    }

    fn shutdown(mut self) {
        if let Some(h) = self.kvatlas.take() {
            self.runtime.block_on(h.server.shutdown());
        }
    }
}

/// Dynamo's and kvatlas's replies agree: status, content type, `allow`, and the body (as JSON
/// when it is JSON: object keys in any order; arrays as sets where 1.6.1's order is arbitrary).
fn same_reply(what: &str, dynamo: &Reply, kvatlas: &Reply) {
    assert_eq!(
        (dynamo.status, &dynamo.content_type, &dynamo.allow),
        (kvatlas.status, &kvatlas.content_type, &kvatlas.allow),
        "{what}: status or headers differ\n  Dynamo:  {dynamo:?}\n  kvatlas: {kvatlas:?}"
    );
    match (
        serde_json::from_str::<Value>(&dynamo.body),
        serde_json::from_str::<Value>(&kvatlas.body),
    ) {
        (Ok(d), Ok(k)) => assert_eq!(
            unordered(&d),
            unordered(&k),
            "{what}: bodies differ\n  Dynamo:  {d}\n  kvatlas: {k}"
        ),
        _ => assert_eq!(
            dynamo.body, kvatlas.body,
            "{what}: bodies differ\n  Dynamo:  {dynamo:?}\n  kvatlas: {kvatlas:?}"
        ),
    }
}

/// `value` with every array sorted (1.6.1 lists `/workers` and `/peers` in hash-map order).
fn unordered(value: &Value) -> Value {
    match value {
        Value::Array(items) => {
            let mut items: Vec<Value> = items.iter().map(unordered).collect();
            items.sort_by_key(Value::to_string);
            Value::Array(items)
        }
        Value::Object(map) => {
            Value::Object(map.iter().map(|(k, v)| (k.clone(), unordered(v))).collect())
        }
        other => other.clone(),
    }
}

/// Every field Dynamo gives is in kvatlas's answer with the same value (kvatlas may add some).
fn assert_superset(what: &str, dynamo: &Value, kvatlas: &Value) {
    match (dynamo, kvatlas) {
        (Value::Object(d), Value::Object(k)) => {
            for (key, value) in d {
                let Some(theirs) = k.get(key) else {
                    panic!("{what}: kvatlas lacks {key:?} ({dynamo} vs {kvatlas})");
                };
                assert_superset(&format!("{what}.{key}"), value, theirs);
            }
        }
        _ => assert_eq!(dynamo, kvatlas, "{what}"),
    }
}

/// `GET path` (a `/workers` listing) of both: the same instances, each with Dynamo's fields and
/// values (kvatlas adds its sequencing figures to each listener).
fn same_workers(pair: &Pair, path: &str) {
    let (d, k) = pair.both("GET", path, None, "");
    assert_eq!((d.status, k.status), (200, 200), "{path}");
    let by_instance = |reply: &Reply| -> BTreeMap<u64, Value> {
        reply
            .json()
            .as_array()
            .expect("an array")
            .iter()
            .map(|w| (w["instance_id"].as_u64().expect("instance_id"), w.clone()))
            .collect()
    };
    let (d_workers, k_workers) = (by_instance(&d), by_instance(&k));
    assert_eq!(
        d_workers.keys().collect::<Vec<_>>(),
        k_workers.keys().collect::<Vec<_>>(),
        "{path}: the same instances"
    );
    for (id, worker) in &d_workers {
        assert_superset(&format!("{path}[{id}]"), worker, &k_workers[id]);
    }
}

// ---------------------------------------------------------------------------------------------
// Publishers, prompts, the reference
// ---------------------------------------------------------------------------------------------

/// The `/register` body of a fleet member (the same for both services).
fn register_body(member: &Member, extra: &Value) -> Value {
    let mut body = json!({
        "instance_id": member.instance_id,
        "endpoint": member.endpoint(),
        "replay_endpoint": member.replay_endpoint(),
        "model_name": MODEL,
        "block_size": BLOCK,
    });
    if let (Value::Object(body), Value::Object(extra)) = (&mut body, extra) {
        body.extend(extra.clone());
    }
    body
}

/// The chain every member stores last (`store_after_clear`: three blocks of tokens no burst
/// uses): once a service holds it for a member, it applied everything the member published.
fn publish_markers(members: &mut [&mut Member]) -> Vec<u32> {
    let mut tokens = Vec::new();
    for member in members.iter_mut() {
        let reply = member.driver.command("publish store_after_clear");
        tokens = event_tokens(&reply["events"]);
        member.published.push(driver::BurstBatch {
            seq: reply["seq"].as_u64().expect("seq"),
            payload: driver::hex(reply["payload"].as_str().expect("payload")),
            stored: Vec::new(),
        });
    }
    tokens
}

/// The token ids of a driver reply's stored events (tagged-map or array events).
fn event_tokens(events: &Value) -> Vec<u32> {
    let mut tokens = Vec::new();
    for event in events.as_array().expect("events") {
        let ids = match event {
            Value::Object(map) => map.get("token_ids"),
            Value::Array(fields) => fields.get(3),
            _ => None,
        };
        if let Some(ids) = ids.and_then(Value::as_array) {
            tokens.extend(
                ids.iter().map(|t| {
                    u32::try_from(t.as_u64().expect("a token id")).expect("a u32 token id")
                }),
            );
        }
    }
    tokens
}

/// The ZMQ listeners kvatlas lists: (instance, rank) → last sequence number applied.
fn kvatlas_seqs(addr: SocketAddr) -> BTreeMap<(u64, String), Option<u64>> {
    let mut out = BTreeMap::new();
    for worker in get(addr, "/workers").json().as_array().expect("workers") {
        let instance = worker["instance_id"].as_u64().expect("instance_id");
        for (rank, listener) in worker["listeners"].as_object().expect("listeners") {
            out.insert((instance, rank.clone()), listener["last_seq"].as_u64());
        }
    }
    out
}

/// Publishes the markers, then nudges until kvatlas applied every member's last batch and
/// Dynamo holds every member's marker (each listener applies in order, so it holds the rest).
fn settle(pair: &Pair, members: &mut [&mut Member]) -> Vec<u32> {
    let marker = publish_markers(members);
    let query = json!({"token_ids": marker, "model_name": MODEL});
    let full = u64::from(BLOCK) * 3;
    let start = Instant::now();
    loop {
        let seqs = kvatlas_seqs(pair.k());
        let kvatlas_done = members
            .iter()
            .all(|m| seqs.get(&(m.instance_id, "0".into())).copied().flatten() == m.last_seq());
        let answer = post(pair.d(), "/query", &query).json();
        let dynamo_done = members
            .iter()
            .all(|m| answer["scores"][m.instance_id.to_string()]["0"].as_u64() == Some(full));
        if kvatlas_done && dynamo_done {
            return marker;
        }
        assert!(
            start.elapsed() < WAIT,
            "the services never caught up with the publishers: kvatlas {kvatlas_done} ({seqs:?}), \
             Dynamo {dynamo_done} ({answer})"
        );
        std::thread::sleep(Duration::from_millis(300));
        for member in members.iter_mut() {
            let batch = member.driver.publish("empty");
            member.published.push(driver::BurstBatch {
                seq: batch.seq,
                payload: batch.payload,
                stored: Vec::new(),
            });
        }
    }
}

/// Every stored block's prompt (its chain's tokens from the root), at most `limit`, plus `also`.
fn prompts(members: &[&Member], also: &[Vec<u32>], limit: usize) -> Vec<Vec<u32>> {
    let mut out = BTreeSet::new();
    for member in members {
        let blocks: BTreeMap<u64, (Option<u64>, &[u32])> = member
            .published
            .iter()
            .flat_map(|b| &b.stored)
            .map(|s| (s.hash, (s.parent, s.tokens.as_slice())))
            .collect();
        for &hash in blocks.keys() {
            let mut chain = Vec::new();
            let mut at = Some(hash);
            while let Some((parent, tokens)) = at.and_then(|h| blocks.get(&h)) {
                chain.push(*tokens);
                at = *parent;
                if chain.len() > blocks.len() {
                    break;
                }
            }
            chain.reverse();
            out.insert(chain.concat());
        }
    }
    let mut out: Vec<Vec<u32>> = out.into_iter().take(limit).collect();
    out.extend(also.iter().cloned());
    out
}

/// What a `/query` of `tokens` answers for `matches`, in 1.6.1's JSON (`docs/server.md` §7:
/// `scores` device tokens by instance then rank, zeros left out; `instances` the tiered summary
/// of every instance matched on some tier).
fn expected_answer(matches: &Matches) -> Value {
    let tokens = |blocks: u32| u64::from(blocks) * u64::from(BLOCK);
    let mut scores = serde_json::Map::new();
    let mut instances = serde_json::Map::new();
    for m in &matches.workers {
        let (instance, rank) = (m.worker.worker_id.to_string(), m.worker.dp_rank.to_string());
        if m.device > 0 {
            scores
                .entry(instance.clone())
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("object")
                .insert(rank.clone(), json!(tokens(m.device)));
        }
        let summary = instances.entry(instance).or_insert_with(
            || json!({"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}),
        );
        summary["dp"][&rank] = json!(tokens(m.device));
        for (field, value) in [
            ("gpu", m.device),
            ("cpu", m.host),
            ("disk", m.disk),
            ("longest_matched", m.disk),
        ] {
            let was = summary[field].as_u64().unwrap_or(0);
            summary[field] = json!(was.max(tokens(value)));
        }
    }
    json!({"scores": scores, "frequencies": [], "instances": instances})
}

fn reference_answer(reference: &ReferenceIndex, tokens: &[u32]) -> Value {
    let hasher = BlockHasher::new(BLOCK).expect("block size");
    let locals: Vec<_> = hasher.local_hashes(tokens).collect();
    expected_answer(&reference.find_matches(&locals, &MatchOptions::default().with_tiered(true)))
}

/// `/query_by_hash`'s body for `tokens`: the local hashes as i64 (1.6.1 takes `Vec<i64>`).
fn by_hash_body(tokens: &[u32], extra: &Value) -> Value {
    let hasher = BlockHasher::new(BLOCK).expect("block size");
    let hashes: Vec<i64> = hasher
        .local_hashes(tokens)
        .map(|h| h.get() as i64)
        .collect();
    let mut body = json!({"block_hashes": hashes, "model_name": MODEL});
    if let (Value::Object(body), Value::Object(extra)) = (&mut body, extra) {
        body.extend(extra.clone());
    }
    body
}

/// The blocks of a `/dump`, one row per block: (partition, worker, rank, tier, engine hash,
/// parent engine hash, local hash). Runs are cut differently by the two services; the blocks
/// and their links are what a replica rebuilds.
type DumpRow = (String, u64, u64, String, u64, Option<u64>, u64);

fn dump_rows(dump: &Value) -> BTreeSet<DumpRow> {
    let mut rows = BTreeSet::new();
    for (key, partition) in dump.as_object().expect("a dump is an object") {
        for event in partition["events"].as_array().expect("events") {
            let stored = &event["event"]["data"]["stored"];
            let mut parent = stored["parent_hash"].as_u64();
            for block in stored["blocks"].as_array().expect("stored blocks") {
                let hash = block["block_hash"].as_u64().expect("block_hash");
                rows.insert((
                    key.clone(),
                    event["worker_id"].as_u64().expect("worker_id"),
                    event["event"]["dp_rank"].as_u64().unwrap_or(0),
                    event["storage_tier"]
                        .as_str()
                        .unwrap_or("device")
                        .to_owned(),
                    hash,
                    parent,
                    block["tokens_hash"].as_u64().expect("tokens_hash"),
                ));
                parent = Some(hash);
            }
        }
    }
    rows
}

/// Asks both services every prompt by tokens and by hash: both answers equal, and equal the
/// reference's.
fn same_answers(what: &str, pair: &Pair, prompts: &[Vec<u32>], reference: &ReferenceIndex) {
    for tokens in prompts {
        let expected = reference_answer(reference, tokens);
        let body = json!({"token_ids": tokens, "model_name": MODEL});
        let k = pair.same_post(&format!("{what}: /query {tokens:?}"), "/query", &body);
        assert_eq!(
            k.json(),
            expected,
            "{what}: /query {tokens:?} against the reference"
        );
        let body = by_hash_body(tokens, &json!({}));
        let k = pair.same_post(
            &format!("{what}: /query_by_hash {body}"),
            "/query_by_hash",
            &body,
        );
        assert_eq!(
            k.json(),
            expected,
            "{what}: /query_by_hash against the reference"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The routes, side by side
// ---------------------------------------------------------------------------------------------

/// Requests both services must answer alike (status, content type, `allow`, body), one a line:
/// `METHOD PATH CONTENT-TYPE [BODY]` (`json` = `application/json`, `-` = none): bodies that are
/// not JSON (400), a missing or wrong content type (415), JSON of the wrong shape (422), unknown
/// partitions (404), wrong methods (405) and an unknown path (404).
const ERROR_CASES: &str = r#"
    POST /query json nope
    POST /query json
    POST /query text/plain {"token_ids":[1],"model_name":"m"}
    POST /query - {"token_ids":[1],"model_name":"m"}
    POST /query json {"model_name":"m"}
    POST /query json {"token_ids":[1,-2,3],"model_name":"m"}
    POST /query json {"token_ids":[1,2,4294967296],"model_name":"m"}
    POST /query json {"token_ids":"abc","model_name":"m"}
    POST /query json {"token_ids":[1.5],"model_name":"m"}
    POST /query json {"token_ids":[1,2,3],"model_name":"unknown"}
    GET /query -
    POST /query_by_hash json {"block_hashes":["1"],"model_name":"m"}
    POST /query_by_hash json {"model_name":"m"}
    POST /query_by_hash json {"block_hashes":[1],"model_name":"unknown"}
    POST /query_by_hash json {"block_hashes":[1],"model_name":"unknown","cache_salt":"s"}
    POST /register json not json
    POST /register json
    POST /register text/plain {"instance_id":1,"model_name":"m"}
    POST /register json {"instance_id":1,"endpoint":"tcp://127.0.0.1:5999","model":"m","block_size":16}
    POST /register json {"instance_id":1,"model_name":"m","block_size":16}
    POST /register json {"instance_id":"3","endpoint":"tcp://127.0.0.1:5999","model_name":"m","block_size":16}
    POST /register json {"instance_id":-3,"endpoint":"tcp://127.0.0.1:5999","model_name":"m","block_size":16}
    POST /register json {"instance_id":3,"endpoint":"tcp://127.0.0.1:5999","model_name":"m","block_size":"16"}
    POST /register json {"instance_id":3,"endpoint":"tcp://127.0.0.1:5999","model_name":"m","block_size":16,"dp_rank":-1}
    GET /register -
    POST /unregister json xx
    POST /unregister json {"instance_id":1}
    POST /unregister json {"model_name":"m"}
    POST /unregister json {"instance_id":"1","model_name":"m"}
    POST /workers json {}
    POST /health json {}
    POST /dump json {}
    POST /peers json {}
    GET /register_peer -
    POST /register_peer json {"peer":"http://x"}
    POST /register_peer json {"url":5}
    POST /deregister_peer json {}
    GET /nope -
"#;

#[test]
#[ignore = "needs Dynamo's and the engines' wheels: run `cargo xtask interop`"]
fn routes_answer_like_dynamo() {
    let _serial = serial();
    let mut fleet = Fleet::spawn("vllm", "0.33.0", &[1, 2, 3]);
    let pair = Pair::start(&[]);

    // Empty services.
    pair.same("GET /health", "GET", "/health", None, "");
    pair.same("HEAD /health", "HEAD", "/health", None, "");
    pair.same("/workers, none", "GET", "/workers", None, "");
    pair.same("/peers, none", "GET", "/peers", None, "");
    pair.same("/dump, nothing", "GET", "/dump", None, "");
    pair.same_post(
        "/query of an unknown model",
        "/query",
        &json!({"token_ids": [1, 2, 3], "model_name": MODEL}),
    );

    // Registration of the real publishers, the same bodies.
    for member in &fleet.members {
        let k = pair.same_post(
            &format!("/register {}", member.instance_id),
            "/register",
            &register_body(member, &json!({})),
        );
        assert_eq!(k.status, 201);
    }
    let first = &fleet.members[0];
    pair.same_post(
        "the same /register again",
        "/register",
        &register_body(first, &json!({})),
    );
    pair.same_post(
        "a registered rank with another endpoint",
        "/register",
        &register_body(first, &json!({"endpoint": "tcp://127.0.0.1:1"})),
    );
    let unused = format!("tcp://127.0.0.1:{}", free_port());
    for block_size in [32, 0] {
        pair.same_post(
            &format!("a block size of {block_size} for the model's partition"),
            "/register",
            &json!({"instance_id": 9, "endpoint": unused, "model_name": MODEL, "block_size": block_size}),
        );
    }
    for endpoint in ["not-a-url", "", "http://127.0.0.1:5994", "tcp://127.0.0.1"] {
        pair.same_post(
            &format!("/register with the endpoint {endpoint:?}"),
            "/register",
            &json!({"instance_id": 9, "endpoint": endpoint, "model_name": MODEL, "block_size": 16}),
        );
    }
    pair.same_post(
        "/register with a bad replay endpoint",
        "/register",
        &json!({"instance_id": 9, "endpoint": unused, "replay_endpoint": "garbage", "model_name": MODEL, "block_size": 16}),
    );

    // The engines publish; leaf-first evictions and vLLM's uniform hashes: Dynamo is exact.
    fleet.round(30, true);
    let marker = {
        let mut members: Vec<&mut Member> = fleet.members.iter_mut().collect();
        settle(&pair, &mut members)
    };
    let members: Vec<&Member> = fleet.members.iter().collect();
    let with_kind: Vec<(&Member, EngineKind)> =
        members.iter().map(|m| (*m, EngineKind::Vllm)).collect();
    let reference = reference_of(&with_kind);
    let mut extra = vec![marker.clone(), marker[..20].to_vec(), Vec::new()];
    extra.push([&marker[..16], &[7; 16][..], &marker[32..]].concat()); // a miss in the middle
    let asked = prompts(&members, &extra, 150);
    same_answers("uniform hashes, leaf-first", &pair, &asked, &reference);
    eprintln!(
        "uniform hashes, leaf-first: {} prompts answered alike by Dynamo, kvatlas and the reference",
        asked.len()
    );

    // Queries with the optional fields and the error answers of the query routes.
    let tokens = &asked[0];
    for (what, extra) in [
        ("routing_group default", json!({"routing_group": "default"})),
        (
            "an empty lora and salt",
            json!({"lora_name": "", "cache_salt": ""}),
        ),
        ("a lora", json!({"lora_name": "x"})),
        ("a salt", json!({"cache_salt": "s"})),
        ("unknown fields", json!({"type": "q", "unknown": true})),
        (
            "an unknown routing group",
            json!({"routing_group": "nogroup"}),
        ),
    ] {
        let mut body = json!({"token_ids": tokens, "model_name": MODEL});
        body.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        pair.same_post(&format!("/query with {what}"), "/query", &body);
    }
    for (what, extra) in [
        ("cache_salt", json!({"cache_salt": "s"})),
        ("an empty cache_salt", json!({"cache_salt": ""})),
        ("a null cache_salt", json!({"cache_salt": null})),
        (
            "an unknown routing group",
            json!({"routing_group": "nogroup"}),
        ),
    ] {
        pair.same_post(
            &format!("/query_by_hash with {what}"),
            "/query_by_hash",
            &by_hash_body(tokens, &extra),
        );
    }
    pair.same_post(
        "/query_by_hash of external hashes",
        "/query_by_hash",
        &json!({"block_hashes": [-1, 9_223_372_036_854_775_807_i64], "model_name": MODEL}),
    );
    // Body limits (1.6.1's: 2 MiB, 8 MiB on the query routes): a body one byte over is refused
    // alike.
    for (path, limit) in [
        ("/register", 2 << 20),
        ("/unregister", 2 << 20),
        ("/register_peer", 2 << 20),
        ("/query", 8 << 20),
        ("/query_by_hash", 8 << 20),
    ] {
        let d = post_long(pair.d(), path, limit + 1);
        let k = post_long(pair.k(), path, limit + 1);
        assert_eq!(d, k, "a body over {limit} bytes to {path}");
        assert_eq!(k.0, 413, "a body over {limit} bytes to {path}: {k:?}");
    }
    for line in ERROR_CASES.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.trim().splitn(4, ' ');
        let (method, path) = (parts.next().expect("method"), parts.next().expect("path"));
        let content_type = match parts.next().expect("content type") {
            "-" => None,
            "json" => JSON,
            other => Some(other),
        };
        let body = parts.next().unwrap_or_default();
        pair.same(line.trim(), method, path, content_type, body);
    }

    // /workers: Dynamo's fields, kvatlas's a superset; the filters.
    for query in [
        String::new(),
        format!("?model_name={MODEL}"),
        "?model_name=nonexistent".into(),
        "?routing_group=default".into(),
        "?routing_group=nogroup".into(),
        "?foo=bar".into(),
    ] {
        same_workers(&pair, &format!("/workers{query}"));
    }

    // /dump: the same blocks, parents and local hashes (uniform hashes: even Dynamo's
    // first-writer hashes of shared blocks are every writer's).
    let (d, k) = pair.both("GET", "/dump", None, "");
    assert_eq!((d.status, k.status), (200, 200), "/dump");
    let (d_rows, k_rows) = (dump_rows(&d.json()), dump_rows(&k.json()));
    assert!(!d_rows.is_empty(), "Dynamo's dump holds blocks");
    assert_eq!(d_rows, k_rows, "/dump: the same blocks");
    assert_eq!(
        d.json()[format!("{MODEL}:default")]["block_size"],
        k.json()[format!("{MODEL}:default")]["block_size"]
    );

    // /metrics: both Prometheus text (the families are each service's own).
    let (d, k) = pair.both("GET", "/metrics", None, "");
    assert_eq!((d.status, k.status), (200, 200), "/metrics");
    for reply in [&d, &k] {
        let content_type = reply.content_type.as_deref().unwrap_or_default();
        assert!(
            content_type.starts_with("text/plain; version=0.0.4"),
            "{reply:?}"
        );
        assert!(reply.body.contains("# TYPE "), "{reply:?}");
    }

    // Peers: a set of URLs, not validated, used at startup only.
    for url in [
        "http://127.0.0.1:18091",
        "http://127.0.0.1:18092/",
        "",
        "not a url",
    ] {
        let k = pair.same_post(
            "/register_peer",
            "/register_peer",
            &json!({"url": url, "extra": 1}),
        );
        assert_eq!(k.status, 201);
    }
    pair.same_post(
        "/register_peer again",
        "/register_peer",
        &json!({"url": ""}),
    );
    pair.same("/peers", "GET", "/peers", None, "");
    pair.same_post(
        "/deregister_peer",
        "/deregister_peer",
        &json!({"url": "not a url"}),
    );
    pair.same_post(
        "/deregister_peer again",
        "/deregister_peer",
        &json!({"url": "not a url"}),
    );
    pair.same("/peers after", "GET", "/peers", None, "");

    // /unregister: unknown instances, ranks, models and groups; instance 3 (twice); instance 2's
    // only rank, named with its group.
    for body in [
        json!({"instance_id": 99, "model_name": MODEL}),
        json!({"instance_id": 99, "model_name": MODEL, "routing_group": "default"}),
        json!({"instance_id": 99, "model_name": MODEL, "routing_group": "default", "dp_rank": 0}),
        json!({"instance_id": 1, "model_name": "nomodel"}),
        json!({"instance_id": 1, "model_name": MODEL, "routing_group": "nogroup"}),
        json!({"instance_id": 1, "model_name": MODEL, "routing_group": "default", "dp_rank": 5}),
        json!({"instance_id": 3, "model_name": MODEL, "foo": "bar"}),
        json!({"instance_id": 3, "model_name": MODEL}),
        json!({"instance_id": 2, "model_name": MODEL, "routing_group": "default", "dp_rank": 0}),
    ] {
        pair.same_post(&format!("/unregister {body}"), "/unregister", &body);
    }
    // Their blocks are gone from both (Dynamo removes them through its indexer's queue).
    let left: Vec<(&Member, EngineKind)> = with_kind
        .iter()
        .filter(|(m, _)| m.instance_id == 1)
        .copied()
        .collect();
    let reference = reference_of(&left);
    let start = Instant::now();
    loop {
        let pending = asked.iter().find(|tokens| {
            let body = json!({"token_ids": tokens, "model_name": MODEL});
            post(pair.d(), "/query", &body).json() != reference_answer(&reference, tokens)
        });
        let Some(tokens) = pending else { break };
        assert!(
            start.elapsed() < WAIT,
            "Dynamo still answers {tokens:?} with unregistered workers"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    same_answers("after /unregister", &pair, &asked, &reference);
    same_workers(&pair, "/workers");
    pair.shutdown();
    fleet.quit();
}

// ---------------------------------------------------------------------------------------------
// /dump, both ways
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs Dynamo's and the engines' wheels: run `cargo xtask interop`"]
fn each_recovers_the_others_dump() {
    let _serial = serial();
    let mut fleet = Fleet::spawn("vllm", "0.33.0", &[4, 5]);
    // One more engine with an offload: blocks on the host tier.
    let mut tiered = Fleet::spawn("vllm", "0.33.0", &[6]);
    let pair = Pair::start(&[]);
    for member in fleet.members.iter().chain(&tiered.members) {
        let k = pair.same_post("/register", "/register", &register_body(member, &json!({})));
        assert_eq!(k.status, 201);
    }
    fleet.round(25, true);
    let offload = &mut tiered.members[0];
    let mut offload_prompts = Vec::new();
    for step in ["store_root", "store_chain", "remove_store"] {
        let reply = offload.driver.command(&format!("publish {step}"));
        offload_prompts.push(event_tokens(&reply["events"]));
        offload.published.push(driver::BurstBatch {
            seq: reply["seq"].as_u64().expect("seq"),
            payload: driver::hex(reply["payload"].as_str().expect("payload")),
            stored: Vec::new(),
        });
    }
    // Chain a (2 blocks), then c under a on the host tier (`remove_store`'s second event).
    let offloaded = [offload_prompts[0].clone(), offload_prompts[2].clone()].concat();
    let marker = {
        let mut members: Vec<&mut Member> = fleet
            .members
            .iter_mut()
            .chain(tiered.members.iter_mut())
            .collect();
        settle(&pair, &mut members)
    };
    let members: Vec<&Member> = fleet.members.iter().chain(&tiered.members).collect();
    let with_kind: Vec<(&Member, EngineKind)> =
        members.iter().map(|m| (*m, EngineKind::Vllm)).collect();
    let reference = reference_of(&with_kind);
    let asked = prompts(
        &members,
        &[marker, offloaded.clone(), offload_prompts[0].clone()],
        120,
    );
    same_answers("the sources", &pair, &asked, &reference);
    let summary = &post(
        pair.k(),
        "/query",
        &json!({"token_ids": offloaded, "model_name": MODEL}),
    )
    .json()["instances"]["6"];
    assert_eq!(
        (&summary["gpu"], &summary["cpu"]),
        (&json!(32), &json!(48)),
        "the offloaded block extends the match on the host tier"
    );

    // (a) A Dynamo replica started with --peers at kvatlas recovers kvatlas's index (Dynamo
    // recovers the blocks, not the workers: a `/dump` carries no registrations, so the
    // replica's `/workers` stays empty).
    let replica = Dynamo::start(&["--peers", &format!("http://{}", pair.k())]);
    for tokens in &asked {
        let body = json!({"token_ids": tokens, "model_name": MODEL});
        let (from, to) = (
            post(pair.k(), "/query", &body),
            post(replica.addr, "/query", &body),
        );
        same_reply(
            &format!("Dynamo recovered from kvatlas: /query {tokens:?}"),
            &to,
            &from,
        );
    }
    assert_eq!(get(replica.addr, "/workers").json(), json!([]));
    assert_eq!(
        get(replica.addr, "/peers").json(),
        json!([format!("http://{}", pair.k())])
    );
    assert_eq!(
        dump_rows(&get(replica.addr, "/dump").json()),
        dump_rows(&get(pair.k(), "/dump").json()),
        "Dynamo's dump of what it recovered holds kvatlas's blocks"
    );
    eprintln!(
        "Dynamo recovered kvatlas's /dump: {} prompts answered alike",
        asked.len()
    );
    drop(replica);

    // (b) `kvatlas serve --peers` at Dynamo bootstraps from Dynamo's /dump (Dynamo has no
    // /snapshot) and answers like Dynamo.
    let replica = pair.runtime.block_on(async {
        let mut b = start(ServerConfig {
            peers: vec![pair.dynamo.url()],
            ..ServerConfig::default()
        })
        .await;
        let outcome = b.server.bootstrap().await.expect("a bootstrap");
        assert!(
            matches!(&outcome, Bootstrap::Dump { events, .. } if *events > 0),
            "{outcome:?}"
        );
        b
    });
    let replica_addr = replica.server.http_addr();
    // The restored gauge counts memberships, as the index's does (it counted the events).
    let metrics = get(replica_addr, "/metrics").body;
    let gauge = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|line| line.starts_with(name))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let restored = gauge("kvatlas_restored_memberships{source=\"peer_dump\"}");
    assert!(restored > 0.0, "{metrics}");
    assert_eq!(restored, gauge("kvatlas_index_memberships{"), "{metrics}");
    for tokens in &asked {
        let body = json!({"token_ids": tokens, "model_name": MODEL});
        let (from, to) = (
            post(pair.d(), "/query", &body),
            post(replica_addr, "/query", &body),
        );
        same_reply(
            &format!("kvatlas recovered from Dynamo: /query {tokens:?}"),
            &from,
            &to,
        );
    }
    assert_eq!(get(replica_addr, "/workers").json(), json!([]));
    assert_eq!(
        dump_rows(&get(replica_addr, "/dump").json()),
        dump_rows(&get(pair.d(), "/dump").json()),
        "kvatlas's dump of what it recovered holds Dynamo's blocks"
    );
    eprintln!(
        "kvatlas recovered Dynamo's /dump: {} prompts answered alike",
        asked.len()
    );
    pair.runtime.block_on(replica.server.shutdown());
    pair.shutdown();
    fleet.quit();
    tiered.quit();
}

// ---------------------------------------------------------------------------------------------
// The intended differences, by name
// ---------------------------------------------------------------------------------------------

/// Publishes a scenario step of `member`'s driver (recorded for the reference); its tokens.
fn step(member: &mut Member, name: &str) -> Vec<u32> {
    let reply = member.driver.command(&format!("publish {name}"));
    member.published.push(driver::BurstBatch {
        seq: reply["seq"].as_u64().expect("seq"),
        payload: driver::hex(reply["payload"].as_str().expect("payload")),
        stored: Vec::new(),
    });
    event_tokens(&reply["events"])
}

/// Polls Dynamo until `tokens` are answered `expected` (bounded): how the test knows Dynamo
/// applied a batch whose effect it knows.
fn dynamo_answers(pair: &Pair, tokens: &[u32], expected: &Value) {
    let body = json!({"token_ids": tokens, "model_name": MODEL});
    let start = Instant::now();
    loop {
        let answer = post(pair.d(), "/query", &body).json();
        if answer == *expected {
            return;
        }
        assert!(
            start.elapsed() < WAIT,
            "Dynamo answers {answer} for {tokens:?}, not {expected}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls kvatlas until its listeners applied every batch `member` published (nudging).
fn kvatlas_applied(pair: &Pair, member: &mut Member) {
    let start = Instant::now();
    while kvatlas_seqs(pair.k())
        .get(&(member.instance_id, "0".into()))
        .copied()
        .flatten()
        != member.last_seq()
    {
        assert!(
            start.elapsed() < WAIT,
            "kvatlas never applied the last batch"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A head-first eviction (an engine evicts a block whose child it keeps, then stores it again):
/// Dynamo drops the evicted block's descendants from its tree and does not bring them back, so
/// it under-counts the chain afterwards; kvatlas keeps the child (dangling, not counted) and
/// counts it again once its parent is back, as `ReferenceIndex` does.
#[test]
#[ignore = "needs Dynamo's and the engines' wheels: run `cargo xtask interop`"]
fn head_first_eviction() {
    let _serial = serial();
    let mut engine = Fleet::spawn("vllm", "0.33.0", &[41]);
    let pair = Pair::start(&[]);
    pair.same_post(
        "/register",
        "/register",
        &register_body(&engine.members[0], &json!({})),
    );
    let member = &mut engine.members[0];
    let a = step(member, "store_root");
    let b = step(member, "store_chain");
    settle(&pair, &mut [&mut *member]);
    let chain = [a.clone(), b].concat();
    let check = |what: &str, member: &Member, dynamo_tokens: u64| {
        let reference = driver::reference_of(&[(member, EngineKind::Vllm)]);
        let expected = reference_answer(&reference, &chain);
        let body = json!({"token_ids": chain, "model_name": MODEL});
        let (d, k) = (
            post(pair.d(), "/query", &body),
            post(pair.k(), "/query", &body),
        );
        assert_eq!(k.json(), expected, "{what}: kvatlas against the reference");
        assert_eq!(
            d.json()["scores"]["41"]["0"].as_u64(),
            Some(dynamo_tokens),
            "{what}: Dynamo 1.6.1 ({})",
            d.body
        );
        eprintln!(
            "head-first eviction, {what}: Dynamo {}, kvatlas = reference {}",
            d.json()["scores"],
            k.json()["scores"]
        );
    };
    check("before", member, 48);
    // Chain a's last block goes, chain b (its child) stays in the engine's cache.
    step(member, "remove_parent");
    dynamo_answers(
        &pair,
        &a,
        &reference_answer(&driver::reference_of(&[(member, EngineKind::Vllm)]), &a),
    );
    kvatlas_applied(&pair, member);
    check("after remove_parent", member, 16);
    // It comes back: the engine holds a and b again.
    step(member, "restore_parent");
    dynamo_answers(
        &pair,
        &a,
        &reference_answer(&driver::reference_of(&[(member, EngineKind::Vllm)]), &a),
    );
    kvatlas_applied(&pair, member);
    check("after restore_parent", member, 32);
    pair.shutdown();
    engine.quit();
}

/// vLLM and SGLang workers of one model store the same tokens under different engine hashes.
/// Dynamo keeps one engine hash per tree node (the first writer's), so another worker's
/// removal by its own hash can miss; kvatlas keeps every rank's own hashes and answers like
/// `ReferenceIndex`.
#[test]
#[ignore = "needs Dynamo's and the engines' wheels: run `cargo xtask interop`"]
fn non_uniform_engine_hashes() {
    let _serial = serial();
    let mut vllm = Fleet::spawn("vllm", "0.33.0", &[51]);
    let mut sglang = Fleet::spawn("sglang", "0.5.23", &[52]);
    let pair = Pair::start(&[]);
    pair.same_post(
        "/register vLLM",
        "/register",
        &register_body(&vllm.members[0], &json!({})),
    );
    pair.same_post(
        "/register SGLang (the RFC's `type`, which Dynamo ignores)",
        "/register",
        &register_body(&sglang.members[0], &json!({"type": "SGLang"})),
    );
    // Leaf-first evictions only: the differences come from the hashes alone.
    for _ in 0..3 {
        vllm.round(10, true);
        sglang.round(10, true);
    }
    let marker = settle(&pair, &mut [&mut vllm.members[0], &mut sglang.members[0]]);
    let members = [
        (&vllm.members[0], EngineKind::Vllm),
        (&sglang.members[0], EngineKind::Sglang),
    ];
    let reference = reference_of(&members);
    let asked = prompts(&[&vllm.members[0], &sglang.members[0]], &[marker], 200);
    let mut differ = Vec::new();
    for tokens in &asked {
        let expected = reference_answer(&reference, tokens);
        let body = json!({"token_ids": tokens, "model_name": MODEL});
        let (d, k) = (
            post(pair.d(), "/query", &body),
            post(pair.k(), "/query", &body),
        );
        assert_eq!((d.status, k.status), (200, 200));
        assert_eq!(
            k.json(),
            expected,
            "kvatlas against the reference: {tokens:?}"
        );
        if d.json() != expected {
            differ.push((d.json()["scores"].clone(), expected["scores"].clone()));
        }
    }
    eprintln!(
        "non-uniform engine hashes: kvatlas = reference on {} prompts; Dynamo differs on {}{}",
        asked.len(),
        differ.len(),
        differ
            .iter()
            .take(5)
            .map(|(d, e)| format!("\n  Dynamo {d}, reference {e}"))
            .collect::<String>()
    );
    let (d, k) = (get(pair.d(), "/dump").json(), get(pair.k(), "/dump").json());
    let (d_rows, k_rows) = (dump_rows(&d), dump_rows(&k));
    let log = pair.dynamo.log();
    eprintln!(
        "non-uniform engine hashes: /dump blocks: Dynamo {}, kvatlas {}, in both {}; Dynamo \
         skipped {} stores whose parent it could not find by the worker's own hash",
        d_rows.len(),
        k_rows.len(),
        d_rows.intersection(&k_rows).count(),
        log.matches("Failed to find parent block").count()
    );
    pair.shutdown();
    vllm.quit();
    sglang.quit();
}

/// 1.6.1 partitions by `routing_group` and ignores `tenant_id`; kvatlas isolates by either (a
/// query of tenant A never sees tenant B's workers).
#[test]
#[ignore = "needs Dynamo's and the engines' wheels: run `cargo xtask interop`"]
fn tenant_isolation() {
    let _serial = serial();
    let mut fleet = Fleet::spawn("vllm", "0.33.0", &[61, 62]);
    let pair = Pair::start(&[]);
    pair.same_post(
        "/register without a tenant",
        "/register",
        &register_body(&fleet.members[0], &json!({})),
    );
    pair.same_post(
        "/register with tenant_id acme",
        "/register",
        &register_body(&fleet.members[1], &json!({"tenant_id": "acme"})),
    );
    fleet.round(20, true);
    let marker = {
        let mut members: Vec<&mut Member> = fleet.members.iter_mut().collect();
        settle(&pair, &mut members)
    };
    let (plain, acme) = (&fleet.members[0], &fleet.members[1]);
    let everyone = driver::reference_of(&[(plain, EngineKind::Vllm), (acme, EngineKind::Vllm)]);
    let (only_plain, only_acme) = (
        driver::reference_of(&[(plain, EngineKind::Vllm)]),
        driver::reference_of(&[(acme, EngineKind::Vllm)]),
    );
    let asked = prompts(&[plain, acme], &[marker], 100);
    for tokens in &asked {
        let ask = |extra: Value| {
            let mut body = json!({"token_ids": tokens, "model_name": MODEL});
            body.as_object_mut()
                .expect("object")
                .extend(extra.as_object().expect("object").clone());
            (
                post(pair.d(), "/query", &body),
                post(pair.k(), "/query", &body),
            )
        };
        // No tenant: Dynamo sees both workers, kvatlas the default tenant's.
        let (d, k) = ask(json!({}));
        assert_eq!(
            d.json(),
            reference_answer(&everyone, tokens),
            "Dynamo, no tenant"
        );
        assert_eq!(
            k.json(),
            reference_answer(&only_plain, tokens),
            "kvatlas, no tenant"
        );
        // tenant_id acme: ignored by Dynamo; kvatlas answers for acme's worker alone.
        let (d, k) = ask(json!({"tenant_id": "acme"}));
        assert_eq!(
            d.json(),
            reference_answer(&everyone, tokens),
            "Dynamo, tenant_id"
        );
        assert_eq!(
            k.json(),
            reference_answer(&only_acme, tokens),
            "kvatlas, tenant_id"
        );
        // routing_group acme: no such group in Dynamo; kvatlas's tenant acme.
        let (d, k) = ask(json!({"routing_group": "acme"}));
        assert_eq!(d.status, 404, "Dynamo, routing_group acme: {d:?}");
        assert_eq!(
            k.json(),
            reference_answer(&only_acme, tokens),
            "kvatlas, routing_group"
        );
    }
    // A tenant nobody registered: Dynamo ignores it and answers for the default group; kvatlas
    // has no such index (404, Dynamo's words for an unknown group).
    let body = json!({"token_ids": asked[0], "model_name": MODEL, "tenant_id": "never"});
    let (d, k) = (
        post(pair.d(), "/query", &body),
        post(pair.k(), "/query", &body),
    );
    assert_eq!(
        d.json(),
        reference_answer(&everyone, &asked[0]),
        "Dynamo, an unknown tenant"
    );
    assert_eq!(
        (k.status, k.json()),
        (
            404,
            json!({"error": format!("no indexer for model={MODEL} routing_group=never")})
        ),
        "kvatlas, an unknown tenant"
    );
    pair.same_post(
        "an unknown routing group",
        "/query",
        &json!({"token_ids": asked[0], "model_name": MODEL, "routing_group": "never"}),
    );
    // /workers: Dynamo lists acme's worker in the default group, kvatlas in acme.
    let group_of = |addr: SocketAddr| -> BTreeMap<u64, String> {
        get(addr, "/workers")
            .json()
            .as_array()
            .expect("workers")
            .iter()
            .map(|w| {
                (
                    w["instance_id"].as_u64().expect("id"),
                    w["routing_group"].as_str().expect("group").to_owned(),
                )
            })
            .collect()
    };
    assert_eq!(
        group_of(pair.d()),
        BTreeMap::from([(61, "default".into()), (62, "default".into())])
    );
    assert_eq!(
        group_of(pair.k()),
        BTreeMap::from([(61, "default".into()), (62, "acme".into())])
    );
    let listed = |addr: SocketAddr, query: &str| -> Vec<u64> {
        get(addr, &format!("/workers{query}"))
            .json()
            .as_array()
            .expect("workers")
            .iter()
            .map(|w| w["instance_id"].as_u64().expect("id"))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    };
    for (query, dynamo, kvatlas) in [
        ("?tenant_id=acme", vec![61, 62], vec![62]),
        ("?routing_group=acme", vec![], vec![62]),
        ("?tenant_id=never", vec![61, 62], vec![]),
    ] {
        assert_eq!(
            (listed(pair.d(), query), listed(pair.k(), query)),
            (dynamo, kvatlas),
            "/workers{query}: (Dynamo, kvatlas)"
        );
    }
    // An unregistration naming the wrong tenant: Dynamo ignores tenant_id and removes the
    // worker; kvatlas finds no such worker in that tenant and says where it is.
    let body = json!({"instance_id": 61, "model_name": MODEL, "tenant_id": "acme"});
    let (d, k) = (
        post(pair.d(), "/unregister", &body),
        post(pair.k(), "/unregister", &body),
    );
    assert_eq!(d.status, 200, "Dynamo: {d:?}");
    assert_eq!(
        (k.status, k.json()),
        (
            404,
            json!({"error": format!("instance 61 is registered for model={MODEL} routing_group=default")})
        ),
        "kvatlas"
    );
    eprintln!(
        "tenant isolation: {} prompts; Dynamo ignored tenant_id, kvatlas answered per tenant like \
         the reference",
        asked.len()
    );
    pair.shutdown();
    fleet.quit();
}

/// Registration and query forms kvatlas accepts where 1.6.1 refuses or does otherwise.
#[test]
#[ignore = "needs Dynamo's wheel: run `cargo xtask interop`"]
fn intended_differences_in_requests() {
    let _serial = serial();
    let pair = Pair::start(&[]);
    let endpoint = || format!("tcp://127.0.0.1:{}", free_port());
    let status = |what: &str, path: &str, body: Value, dynamo: u16, kvatlas: u16| {
        let (d, k) = (post(pair.d(), path, &body), post(pair.k(), path, &body));
        assert_eq!(
            (d.status, k.status),
            (dynamo, kvatlas),
            "{what}: Dynamo {d:?}, kvatlas {k:?}"
        );
        eprintln!(
            "{what}: Dynamo {} {:?}, kvatlas {} {:?}",
            d.status, d.body, k.status, k.body
        );
    };
    pair.same_post(
        "/register",
        "/register",
        &json!({"instance_id": 70, "endpoint": endpoint(), "model_name": MODEL, "block_size": 16}),
    );
    // A listener whose engine never published: 1.6.1 shows it `active` (its ZMQ connect is
    // asynchronous: `pending` for a moment after the registration on a loaded machine), kvatlas
    // `pending` until the first batch.
    let listener_status = |addr: SocketAddr| -> Value {
        get(addr, "/workers").json()[0]["listeners"]["0"]["status"].clone()
    };
    let waiting = std::time::Instant::now();
    while listener_status(pair.d()) != json!("active")
        && waiting.elapsed() < std::time::Duration::from_secs(10)
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        (listener_status(pair.d()), listener_status(pair.k())),
        (json!("active"), json!("pending")),
        "(Dynamo, kvatlas)"
    );
    // `null` for a field 1.6.1 defaults (it wants a string there).
    status(
        "/query with a null routing_group",
        "/query",
        json!({"token_ids": [1, 2, 3], "model_name": MODEL, "routing_group": null}),
        422,
        200,
    );
    // The Mooncake RFC's names.
    status(
        "/register with `modelname`",
        "/register",
        json!({"instance_id": 71, "endpoint": endpoint(), "modelname": MODEL, "block_size": 16, "type": "vLLM", "additionalsalt": "s"}),
        422,
        201,
    );
    status(
        "/query with `modelname`",
        "/query",
        json!({"token_ids": [1, 2, 3], "modelname": MODEL}),
        422,
        200,
    );
    status(
        "/query with the RFC's `model`",
        "/query",
        json!({"token_ids": [1, 2, 3], "model": MODEL}),
        422,
        200,
    );
    status(
        "/query_by_hash with the RFC's `model`",
        "/query_by_hash",
        json!({"block_hashes": [1], "model": MODEL}),
        422,
        200,
    );
    // The RFC's `block_size` (1.6.1 ignores it) is checked against the index's.
    status(
        "/query with the RFC's `block_size`, not the index's",
        "/query",
        json!({"token_ids": [1, 2, 3], "model_name": MODEL, "block_size": 32}),
        200,
        400,
    );
    // The RFC's deprecated `lora_id` (1.6.1 ignores it) is refused with the reason.
    status(
        "/query with the RFC's deprecated `lora_id`",
        "/query",
        json!({"token_ids": [1, 2, 3], "model_name": MODEL, "lora_id": 1}),
        200,
        400,
    );
    status(
        "/query_by_hash with `seq_hashes`",
        "/query_by_hash",
        json!({"seq_hashes": [1], "model_name": MODEL}),
        422,
        200,
    );
    // A local hash ≥ 2^63 as an unsigned number (1.6.1 takes i64 only).
    status(
        "/query_by_hash with a u64 ≥ 2^63",
        "/query_by_hash",
        json!({"block_hashes": [16_863_443_419_780_771_464_u64], "model_name": MODEL}),
        422,
        200,
    );
    // An instance in a second model: 1.6.1 keeps an instance in one partition.
    status(
        "/register of instance 70 for another model",
        "/register",
        json!({"instance_id": 70, "endpoint": endpoint(), "model_name": "other", "block_size": 16}),
        409,
        201,
    );
    // Block size 0 for a new partition: 1.6.1 creates one that never matches.
    status(
        "/register with block_size 0",
        "/register",
        json!({"instance_id": 73, "endpoint": endpoint(), "model_name": "zero", "block_size": 0}),
        201,
        400,
    );
    // An endpoint of the right form that ZMQ cannot connect to: 1.6.1 registers a failed
    // listener, kvatlas refuses it.
    status(
        "/register with a wildcard host",
        "/register",
        json!({"instance_id": 74, "endpoint": format!("tcp://*:{}", free_port()), "model_name": MODEL, "block_size": 16}),
        201,
        400,
    );
    // /unregister with a dp_rank and no routing_group: 1.6.1 removes every rank.
    for rank in [0, 1] {
        pair.same_post(
            "/register of two ranks",
            "/register",
            &json!({"instance_id": 72, "dp_rank": rank, "endpoint": endpoint(), "model_name": MODEL, "block_size": 16}),
        );
    }
    pair.same_post(
        "/unregister of one rank without a group",
        "/unregister",
        &json!({"instance_id": 72, "model_name": MODEL, "dp_rank": 1}),
    );
    let ranks = |addr: SocketAddr| -> Vec<String> {
        get(addr, &format!("/workers?model_name={MODEL}"))
            .json()
            .as_array()
            .expect("workers")
            .iter()
            .filter(|w| w["instance_id"] == 72)
            .flat_map(|w| {
                w["listeners"]
                    .as_object()
                    .expect("listeners")
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    assert_eq!(
        ranks(pair.d()),
        Vec::<String>::new(),
        "Dynamo removed both ranks"
    );
    assert_eq!(
        ranks(pair.k()),
        vec!["0".to_owned()],
        "kvatlas removed rank 1 only"
    );
    pair.shutdown();
}
