//! Shared by the server's integration tests: starting a server on loopback ports the OS picks,
//! a deterministic script of engine events mirrored into a [`ReferenceIndex`], a minimal HTTP/1.1
//! client, and a ZMQ publisher speaking vLLM's wire format.

#![allow(dead_code, unreachable_pub)] // each test binary uses a part

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvatlas_hash::{BlockHasher, LocalBlockHash};
use kvatlas_index::{
    ExternalBlockHash, KvIndex, MatchOptions, Matches, Mutation, ReferenceIndex, StoredBlock, Tier,
    Worker,
};
use kvatlas_proto::v1::{self, indexer_client::IndexerClient, kv_event};
use kvatlas_server::{RunningServer, ServerConfig};
use tonic::transport::Channel;

/// Bound on every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(20);

/// A server and a client connected to it.
pub struct Harness {
    pub server: RunningServer,
    pub client: IndexerClient<Channel>,
    pub url: String,
}

/// Starts a server with `config` (its addresses replaced by ephemeral loopback ports).
pub async fn start(config: ServerConfig) -> Harness {
    let ephemeral = ServerConfig::ephemeral();
    let config = ServerConfig {
        grpc_addr: ephemeral.grpc_addr,
        http_addr: ephemeral.http_addr,
        ..config
    };
    let server = RunningServer::start(config)
        .await
        .expect("the server starts");
    let url = format!("http://{}", server.grpc_addr());
    let client = IndexerClient::connect(url.clone())
        .await
        .expect("the client connects");
    Harness {
        server,
        client,
        url,
    }
}

/// Polls `condition` until it holds (at most [`WAIT`]).
pub async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !condition().await {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Registers `engine` as worker `instance_id` of `model` (default tenant) at `block_size`, its
/// listener connecting to it.
#[allow(dead_code)] // not every test binary uses it
pub async fn register_engine(
    client: &mut v1::indexer_client::IndexerClient<tonic::transport::Channel>,
    (model, block_size): (&str, u32),
    instance_id: u64,
    engine: &VllmPublisher,
) {
    client
        .register_worker(v1::RegisterWorkerRequest {
            index: selector(model, ""),
            instance_id,
            block_size,
            endpoint: engine.endpoint.clone(),
            ..v1::RegisterWorkerRequest::default()
        })
        .await
        .expect("registers");
}

/// The server's `ListWorkers` answer.
#[allow(dead_code)] // not every test binary uses it
pub async fn listed_workers(
    client: &mut v1::indexer_client::IndexerClient<tonic::transport::Channel>,
) -> v1::ListWorkersResponse {
    client
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner()
}

/// Publishes empty batches on `engine` until one of the server's listeners reports itself
/// active (it hears the engine: ZMQ's slow joiner is past).
#[allow(dead_code)] // not every test binary uses it
pub async fn wait_for_an_active_listener(
    client: &v1::indexer_client::IndexerClient<tonic::transport::Channel>,
    engine: &mut VllmPublisher,
) {
    wait_until("the listener to become active", || {
        engine.publish(&[], None);
        let mut client = client.clone();
        async move {
            let workers = listed_workers(&mut client).await;
            workers
                .workers
                .iter()
                .any(|w| w.status == v1::WorkerStatus::Active as i32)
        }
    })
    .await;
}

/// A query of `tokens` in `model`'s index for `tenant`.
#[allow(dead_code)] // not every test binary uses it
pub fn token_query(model: &str, tenant: &str, tokens: Vec<u32>) -> v1::QueryRequest {
    v1::QueryRequest {
        index: selector(model, tenant),
        input: Some(v1::query_request::Input::Tokens(v1::TokenIds {
            ids: tokens,
        })),
        ..v1::QueryRequest::default()
    }
}

pub fn selector(model: &str, tenant: &str) -> Option<v1::IndexSelector> {
    Some(v1::IndexSelector {
        model: model.into(),
        tenant: tenant.into(),
    })
}

/// `Query` of `model` (default tenant) by local hashes, default options: the answer.
pub async fn query_hashes(
    h: &mut Harness,
    model: &str,
    locals: &[LocalBlockHash],
) -> v1::QueryResponse {
    h.client
        .query(v1::QueryRequest {
            index: selector(model, ""),
            input: Some(v1::query_request::Input::LocalHashes(v1::LocalHashes {
                hashes: locals.iter().map(|l| l.get()).collect(),
            })),
            ..v1::QueryRequest::default()
        })
        .await
        .expect("query")
        .into_inner()
}

// ---------------------------------------------------------------------------------------------
// A deterministic event script
// ---------------------------------------------------------------------------------------------

/// splitmix64: a small deterministic generator.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The tokens of the block with `symbol` at `position` (prompts sharing symbols at the same
/// positions share blocks).
pub fn block_tokens(symbol: u64, position: usize, block_size: u32) -> Vec<u32> {
    (0..block_size)
        .map(|j| (symbol as u32) * 100_000 + (position as u32) * 100 + j)
        .collect()
}

/// The tokens of a prompt made of `symbols`.
pub fn prompt_tokens(symbols: &[u64], block_size: u32) -> Vec<u32> {
    symbols
        .iter()
        .enumerate()
        .flat_map(|(i, &s)| block_tokens(s, i, block_size))
        .collect()
}

/// An engine's hash of the block ending the path `symbols` on `worker` (each worker hashes its
/// own way: the same tokens get different engine hashes on different workers).
pub fn engine_hash(worker: Worker, symbols: &[u64]) -> u64 {
    let mut h = worker.worker_id.wrapping_mul(0x0100_0000_01b3) ^ u64::from(worker.dp_rank);
    for &s in symbols {
        h = Rng(h ^ s).next();
    }
    h
}

/// One scripted batch: the message to publish and the mutations it means.
#[derive(Debug, Clone)]
pub struct ScriptedBatch {
    pub message: v1::PublishEventsRequest,
    pub mutations: Vec<Mutation>,
}

/// A random but deterministic script of batches for `workers` of one index: stores of random
/// prompt stretches (parents held or not), removes of stored blocks on their tier (in any
/// order, so holes appear), clears; tokens or local hashes; sequenced per rank from 0.
pub fn script(
    seed: u64,
    model: &str,
    workers: &[Worker],
    batches: usize,
    block_size: u32,
) -> Vec<ScriptedBatch> {
    let mut rng = Rng(seed);
    let hasher = BlockHasher::new(block_size).expect("block size");
    let mut stored: Vec<(Worker, Vec<u64>, Tier)> = Vec::new();
    let mut seqs = vec![0u64; workers.len()];
    let tiers = [
        Tier::Device,
        Tier::Device,
        Tier::Device,
        Tier::Host,
        Tier::Disk,
    ];
    let proto_tier = |tier: Tier| match tier {
        Tier::Device => v1::StorageTier::Device,
        Tier::Host => v1::StorageTier::Host,
        Tier::Disk => v1::StorageTier::Disk,
        Tier::External => v1::StorageTier::External,
    } as i32;
    let mut out = Vec::with_capacity(batches);
    for _ in 0..batches {
        let w = rng.below(workers.len() as u64) as usize;
        let worker = workers[w];
        let mut events = Vec::new();
        let mut mutations = Vec::new();
        for _ in 0..=rng.below(3) {
            let roll = rng.below(100);
            if roll < 60 || stored.is_empty() {
                // Store blocks [start, end) of a random prompt of up to 8 blocks.
                let len = 1 + rng.below(8) as usize;
                let path: Vec<u64> = (0..len).map(|_| rng.below(3)).collect();
                let start = if rng.below(4) == 0 {
                    rng.below(len as u64) as usize
                } else {
                    0
                };
                let end = start + 1 + rng.below((len - start) as u64) as usize;
                let tier = tiers[rng.below(tiers.len() as u64) as usize];
                let parent = (start > 0).then(|| engine_hash(worker, &path[..start]));
                let hashes: Vec<u64> = (start..end)
                    .map(|i| engine_hash(worker, &path[..=i]))
                    .collect();
                let tokens: Vec<u32> = (start..end)
                    .flat_map(|i| block_tokens(path[i], i, block_size))
                    .collect();
                let locals: Vec<LocalBlockHash> = tokens
                    .chunks(block_size as usize)
                    .map(|chunk| hasher.hash_block(chunk))
                    .collect();
                let by_tokens = rng.below(2) == 0;
                events.push(v1::KvEvent {
                    event: Some(kv_event::Event::Stored(v1::BlocksStored {
                        parent_hash: parent,
                        block_hashes: hashes.clone(),
                        token_ids: if by_tokens { tokens } else { Vec::new() },
                        local_hashes: if by_tokens {
                            Vec::new()
                        } else {
                            locals.iter().map(|l| l.get()).collect()
                        },
                        tier: proto_tier(tier),
                        ..v1::BlocksStored::default()
                    })),
                });
                mutations.push(Mutation::Stored {
                    worker,
                    tier,
                    parent: parent.map(ExternalBlockHash::new),
                    blocks: hashes
                        .iter()
                        .zip(&locals)
                        .map(|(&h, &local)| StoredBlock {
                            external: ExternalBlockHash::new(h),
                            local,
                        })
                        .collect(),
                });
                for i in start..end {
                    stored.push((worker, path[..=i].to_vec(), tier));
                }
            } else if roll < 95 {
                // Mostly a block this worker stored (any order: holes appear), sometimes a
                // random one it may not hold (an unknown remove).
                let mine: Vec<usize> = (0..stored.len())
                    .filter(|&i| stored[i].0 == worker)
                    .collect();
                let (path, tier) = if !mine.is_empty() && rng.below(6) != 0 {
                    let pick = mine[rng.below(mine.len() as u64) as usize];
                    let (_, path, tier) = stored.swap_remove(pick);
                    (path, tier)
                } else {
                    let len = 1 + rng.below(8) as usize;
                    ((0..len).map(|_| rng.below(3)).collect(), Tier::Device)
                };
                let hash = engine_hash(worker, &path);
                events.push(v1::KvEvent {
                    event: Some(kv_event::Event::Removed(v1::BlocksRemoved {
                        block_hashes: vec![hash],
                        tier: proto_tier(tier),
                    })),
                });
                mutations.push(Mutation::Removed {
                    worker,
                    tier,
                    blocks: vec![ExternalBlockHash::new(hash)],
                });
            } else {
                events.push(v1::KvEvent {
                    event: Some(kv_event::Event::Cleared(v1::AllBlocksCleared {})),
                });
                mutations.push(Mutation::Cleared { worker });
                stored.retain(|(owner, _, _)| *owner != worker);
            }
        }
        if events.is_empty() {
            continue;
        }
        out.push(ScriptedBatch {
            message: v1::PublishEventsRequest {
                index: selector(model, ""),
                instance_id: worker.worker_id,
                dp_rank: worker.dp_rank,
                seq: Some(seqs[w]),
                block_size,
                events,
            },
            mutations,
        });
        seqs[w] += 1;
    }
    out
}

/// Publishes `batches` over one `PublishEvents` stream; returns the acknowledgement.
pub async fn publish_script(
    client: &mut IndexerClient<Channel>,
    batches: &[ScriptedBatch],
) -> v1::PublishEventsResponse {
    let messages: Vec<_> = batches.iter().map(|b| b.message.clone()).collect();
    client
        .publish_events(tokio_stream::iter(messages))
        .await
        .expect("published")
        .into_inner()
}

/// Feeds `batches`' mutations to `reference`.
pub fn apply_script(reference: &mut ReferenceIndex, batches: &[ScriptedBatch]) {
    for batch in batches {
        for m in &batch.mutations {
            reference.apply(m);
        }
    }
}

/// A random prompt over the script's alphabet, as (symbols, tokens, local hashes).
pub fn random_prompt(rng: &mut Rng, block_size: u32) -> (Vec<u32>, Vec<LocalBlockHash>) {
    let len = 1 + rng.below(9) as usize;
    let symbols: Vec<u64> = (0..len).map(|_| rng.below(3)).collect();
    let mut tokens = prompt_tokens(&symbols, block_size);
    // Sometimes a trailing partial block, which scores nothing.
    if rng.below(3) == 0 {
        tokens.extend(0..(block_size / 2));
    }
    let hasher = BlockHasher::new(block_size).expect("block size");
    let locals = hasher.local_hashes(&tokens).collect();
    (tokens, locals)
}

/// The reference's tiered answer for `locals`.
pub fn reference_answer(reference: &ReferenceIndex, locals: &[LocalBlockHash]) -> Matches {
    reference.find_matches(locals, &MatchOptions::default().with_tiered(true))
}

/// A server answer as (instance, rank, device, host, longest) tuples.
pub fn answer_rows(response: &v1::QueryResponse) -> Vec<(u64, u32, u32, u32, u32)> {
    response
        .matches
        .iter()
        .map(|m| {
            (
                m.instance_id,
                m.dp_rank,
                m.device_blocks,
                m.host_blocks,
                m.longest_blocks,
            )
        })
        .collect()
}

/// The reference's answer in the same form.
pub fn reference_rows(matches: &Matches) -> Vec<(u64, u32, u32, u32, u32)> {
    matches
        .workers
        .iter()
        .map(|m| {
            (
                m.worker.worker_id,
                m.worker.dp_rank,
                m.device,
                m.host,
                m.disk,
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

/// `GET path` over HTTP/1.1; returns (status, body).
pub fn http_get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    let (status, body) = http_get_bytes(addr, path, token);
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// `GET path` over HTTP/1.1; returns (status, body bytes).
pub fn http_get_bytes(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, Vec<u8>) {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect HTTP");
    stream.set_read_timeout(Some(WAIT)).expect("read timeout");
    let auth = token.map_or_else(String::new, |t| format!("authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: localhost\r\n{auth}connection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).expect("read");
    parse_http_bytes(&response)
}

/// `POST path` with a JSON body over HTTP/1.1; returns (status, body).
pub fn http_post_json(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    http_post_json_as(addr, path, body, None)
}

/// [`http_post_json`] with a bearer token.
pub fn http_post_json_as(
    addr: SocketAddr,
    path: &str,
    body: &str,
    token: Option<&str>,
) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect HTTP");
    stream.set_read_timeout(Some(WAIT)).expect("read timeout");
    let auth = token.map_or_else(String::new, |t| format!("authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         {auth}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    parse_http(&response)
}

/// (status, body) of an HTTP/1.1 response (chunked bodies are reassembled).
pub fn parse_http(response: &str) -> (u16, String) {
    let (status, body) = parse_http_bytes(response.as_bytes());
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// (status, body bytes) of an HTTP/1.1 response (chunked bodies are reassembled).
pub fn parse_http_bytes(response: &[u8]) -> (u16, Vec<u8>) {
    let split = |bytes: &'_ [u8], at: &[u8]| {
        bytes
            .windows(at.len())
            .position(|w| w == at)
            .map(|i| (bytes[..i].to_vec(), i + at.len()))
    };
    let (head, body_at) =
        split(response, b"\r\n\r\n").unwrap_or((response.to_vec(), response.len()));
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let body = &response[body_at..];
    if !head.contains("transfer-encoding: chunked") {
        return (status, body.to_vec());
    }
    let mut out = Vec::new();
    let mut rest = body;
    while let Some((size, at)) = split(rest, b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&size).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.extend_from_slice(&rest[at..at + size]);
        rest = &rest[at + size + 2..];
    }
    (status, out)
}

/// The value of an exposition line `name{labels} value` (labels given in full, in order).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

// ---------------------------------------------------------------------------------------------
// A vLLM-format ZMQ publisher
// ---------------------------------------------------------------------------------------------

/// A PUB socket on an ephemeral loopback port sending vLLM batches `[topic, seq, payload]`.
pub struct VllmPublisher {
    _context: zmq::Context,
    socket: zmq::Socket,
    pub endpoint: String,
    pub seq: u64,
}

/// A vLLM (≥ 0.24) tagged-map event.
pub enum VllmEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
    },
    Removed {
        hashes: Vec<u64>,
    },
    Cleared,
}

impl VllmPublisher {
    pub fn bind() -> Self {
        let context = zmq::Context::new();
        let socket = context.socket(zmq::PUB).expect("PUB");
        socket.set_sndhwm(0).expect("hwm");
        socket.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = socket
            .get_last_endpoint()
            .expect("endpoint")
            .expect("utf-8 endpoint");
        Self {
            _context: context,
            socket,
            endpoint,
            seq: 0,
        }
    }

    /// Publishes one batch; `dp_rank` is the batch's rank field (`None` = nil).
    pub fn publish(&mut self, events: &[VllmEvent], dp_rank: Option<u32>) -> u64 {
        self.publish_at(events, dp_rank, VLLM_TS)
    }

    /// Publishes one batch with `ts` as its timestamp (seconds since the epoch).
    #[allow(dead_code)] // not every test binary uses it
    pub fn publish_at(&mut self, events: &[VllmEvent], dp_rank: Option<u32>, ts: f64) -> u64 {
        let payload = vllm_batch_at(events, dp_rank, ts);
        let seq = self.seq;
        self.socket
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &payload[..]], 0)
            .expect("PUB send");
        self.seq += 1;
        seq
    }
}

/// The timestamp of [`vllm_batch`]'s batches: a fixed time long past (not a publication time).
pub const VLLM_TS: f64 = 1_700_000_000.5;

/// `[ts, [events…], dp_rank]` with vLLM ≥ 0.24 tagged-map events, `ts` [`VLLM_TS`].
pub fn vllm_batch(events: &[VllmEvent], dp_rank: Option<u32>) -> Vec<u8> {
    vllm_batch_at(events, dp_rank, VLLM_TS)
}

/// As [`vllm_batch`] with `ts` as the batch's timestamp.
pub fn vllm_batch_at(events: &[VllmEvent], dp_rank: Option<u32>, ts: f64) -> Vec<u8> {
    use rmp::encode::{
        write_array_len, write_f64, write_map_len, write_nil, write_str, write_u64, write_uint,
    };
    let mut w = Vec::new();
    let str_ = |w: &mut Vec<u8>, s: &str| write_str(w, s).expect("write");
    write_array_len(&mut w, 3).expect("write");
    write_f64(&mut w, ts).expect("write");
    write_array_len(&mut w, events.len() as u32).expect("write");
    for event in events {
        match event {
            VllmEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => {
                write_map_len(&mut w, 6).expect("write");
                str_(&mut w, "type");
                str_(&mut w, "BlockStored");
                str_(&mut w, "block_hashes");
                write_array_len(&mut w, hashes.len() as u32).expect("write");
                for h in hashes {
                    write_u64(&mut w, *h).expect("write");
                }
                str_(&mut w, "parent_block_hash");
                match parent {
                    Some(p) => write_u64(&mut w, *p).map(|_| ()).expect("write"),
                    None => write_nil(&mut w).expect("write"),
                }
                str_(&mut w, "token_ids");
                write_array_len(&mut w, tokens.len() as u32).expect("write");
                for t in tokens {
                    write_uint(&mut w, u64::from(*t)).expect("write");
                }
                str_(&mut w, "block_size");
                write_uint(&mut w, u64::from(*block_size)).expect("write");
                str_(&mut w, "medium");
                str_(&mut w, "GPU");
            }
            VllmEvent::Removed { hashes } => {
                write_map_len(&mut w, 3).expect("write");
                str_(&mut w, "type");
                str_(&mut w, "BlockRemoved");
                str_(&mut w, "block_hashes");
                write_array_len(&mut w, hashes.len() as u32).expect("write");
                for h in hashes {
                    write_u64(&mut w, *h).expect("write");
                }
                str_(&mut w, "medium");
                str_(&mut w, "GPU");
            }
            VllmEvent::Cleared => {
                write_map_len(&mut w, 1).expect("write");
                str_(&mut w, "type");
                str_(&mut w, "AllBlocksCleared");
            }
        }
    }
    match dp_rank {
        Some(rank) => write_uint(&mut w, u64::from(rank))
            .map(|_| ())
            .expect("write"),
        None => write_nil(&mut w).expect("write"),
    }
    w
}

/// A self-signed certificate for 127.0.0.1 and its key, written to `dir` as cert.pem and
/// key.pem (the directory made if missing); the files and the certificate's PEM.
pub fn self_signed_certificate(dir: &std::path::Path) -> (kvatlas_server::TlsFiles, String) {
    std::fs::create_dir_all(dir).expect("dir");
    let certified =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).expect("certificate");
    let files = kvatlas_server::TlsFiles {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    };
    let pem = certified.cert.pem();
    std::fs::write(&files.cert, &pem).expect("write");
    std::fs::write(&files.key, certified.signing_key.serialize_pem()).expect("write");
    (files, pem)
}
