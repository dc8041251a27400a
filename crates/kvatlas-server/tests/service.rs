//! The server end to end over gRPC on loopback: answers equal a `ReferenceIndex` fed the same
//! events (through `PublishEvents` and through a ZMQ listener), registration and its errors,
//! tenant isolation, the startup gate, the sequencing rules of `PublishEvents`, and a graceful
//! shutdown that loses nothing acknowledged.

mod common;

use std::time::Duration;

use common::*;
use kvatlas_hash::{BlockHasher, LocalBlockHash};
use kvatlas_index::{KvIndex, ReferenceIndex, Worker};
use kvatlas_proto::v1::{self, query_request};
use kvatlas_server::ServerConfig;
use tonic::Code;

const MODEL: &str = "llama";
const BLOCK: u32 = 4;

/// Publishes `batches` on one stream; the response acknowledges them.
async fn publish(
    client: &mut v1::indexer_client::IndexerClient<tonic::transport::Channel>,
    batches: &[ScriptedBatch],
) -> Result<v1::PublishEventsResponse, tonic::Status> {
    let messages: Vec<_> = batches.iter().map(|b| b.message.clone()).collect();
    client
        .publish_events(tokio_stream::iter(messages))
        .await
        .map(tonic::Response::into_inner)
}

fn hash_query(model: &str, locals: &[LocalBlockHash]) -> v1::QueryRequest {
    v1::QueryRequest {
        index: selector(model, ""),
        input: Some(query_request::Input::LocalHashes(v1::LocalHashes {
            hashes: locals.iter().map(|l| l.get()).collect(),
        })),
        ..v1::QueryRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_equal_the_reference_through_every_query_path() {
    let mut h = start(ServerConfig::default()).await;
    let workers = [
        Worker::new(1, 0),
        Worker::new(1, 1),
        Worker::new(2, 0),
        Worker::new(3, 0),
    ];
    let batches = script(7, MODEL, &workers, 600, BLOCK);
    let mut reference = ReferenceIndex::new();
    let mut rng = Rng(99);
    // In four rounds: publish a part, then compare a set of prompts through all three paths.
    for part in batches.chunks(150) {
        let acked = publish(&mut h.client, part).await.expect("published");
        assert_eq!(acked.messages_applied as usize, part.len());
        assert_eq!(acked.duplicates + acked.gaps + acked.resyncs, 0);
        for batch in part {
            for m in &batch.mutations {
                reference.apply(m);
            }
        }
        let prompts: Vec<_> = (0..40).map(|_| random_prompt(&mut rng, BLOCK)).collect();
        let mut stream_requests = Vec::new();
        for (i, (tokens, locals)) in prompts.iter().enumerate() {
            let expected = reference_rows(&reference_answer(&reference, locals));
            let by_tokens = h
                .client
                .query(token_query(MODEL, "", tokens.clone()))
                .await
                .expect("token query")
                .into_inner();
            assert_eq!(answer_rows(&by_tokens), expected, "tokens {tokens:?}");
            assert_eq!(by_tokens.query_blocks as usize, locals.len());
            assert_eq!(by_tokens.block_size, BLOCK);
            for m in &by_tokens.matches {
                assert_eq!(m.matched_tokens, u64::from(m.device_blocks * BLOCK));
                assert_eq!(
                    m.longest_matched_tokens,
                    u64::from(m.longest_blocks * BLOCK)
                );
            }
            let by_hashes = h
                .client
                .query(hash_query(MODEL, locals))
                .await
                .expect("hash query")
                .into_inner();
            assert_eq!(answer_rows(&by_hashes), expected);
            let mut request = token_query(MODEL, "", tokens.clone());
            request.request_id = 1000 + i as u64;
            stream_requests.push(request);
        }
        let mut answers = h
            .client
            .query_stream(tokio_stream::iter(stream_requests))
            .await
            .expect("stream opens")
            .into_inner();
        let mut seen = 0;
        while let Some(answer) = answers.message().await.expect("stream answer") {
            let i = (answer.request_id - 1000) as usize;
            let expected = reference_rows(&reference_answer(&reference, &prompts[i].1));
            match answer.outcome {
                Some(v1::query_stream_response::Outcome::Response(r)) => {
                    assert_eq!(answer_rows(&r), expected);
                }
                other => panic!("stream answer {i}: {other:?}"),
            }
            seen += 1;
        }
        assert_eq!(seen, prompts.len(), "one answer per streamed query");
    }
    let report = h.server.shutdown().await;
    assert_eq!(report.indexes.len(), 1);
    assert_eq!(report.indexes[0].digest, reference.snapshot().digest());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_filter_exact_scores() {
    let mut h = start(ServerConfig::default()).await;
    let workers = [Worker::new(1, 0), Worker::new(2, 0), Worker::new(3, 0)];
    let batches = script(11, MODEL, &workers, 300, BLOCK);
    let mut reference = ReferenceIndex::new();
    publish(&mut h.client, &batches).await.expect("published");
    for b in &batches {
        for m in &b.mutations {
            reference.apply(m);
        }
    }
    let mut rng = Rng(5);
    for _ in 0..60 {
        let (tokens, locals) = random_prompt(&mut rng, BLOCK);
        let exact = reference_answer(&reference, &locals);
        let mut request = token_query(MODEL, "", tokens);
        request.options = Some(v1::QueryOptions {
            top_k: 1,
            instance_ids: vec![2, 3],
            min_blocks: 1,
            ..v1::QueryOptions::default()
        });
        let answer = h.client.query(request).await.expect("query").into_inner();
        // The best of instances 2 and 3 by device score (ties: lower instance), if it holds a block.
        let mut candidates: Vec<_> = exact
            .workers
            .iter()
            .filter(|m| matches!(m.worker.worker_id, 2 | 3) && m.disk >= 1)
            .collect();
        candidates.sort_by(|a, b| b.device.cmp(&a.device).then(a.worker.cmp(&b.worker)));
        let expected: Vec<_> = candidates
            .first()
            .map(|m| {
                (
                    m.worker.worker_id,
                    m.worker.dp_rank,
                    m.device,
                    m.host,
                    m.disk,
                )
            })
            .into_iter()
            .collect();
        assert_eq!(answer_rows(&answer), expected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_wrapper_hashes_like_the_server() {
    let h = start(ServerConfig::default()).await;
    let mut raw = h.client.clone();
    let mut client = kvatlas_proto::client::Client::connect(&h.url)
        .await
        .expect("connects");
    // Worker 1 stores a prompt with a LoRA name and a salt; worker 2 without.
    let tokens = prompt_tokens(&[1, 2, 0], BLOCK);
    let hasher = BlockHasher::new(BLOCK).expect("size");
    let salted = hasher
        .clone()
        .with_lora_name("sql")
        .with_cache_salt("team-a");
    let store = |worker: u64, hasher: &BlockHasher| v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: worker,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: vec![worker * 10, worker * 10 + 1, worker * 10 + 2],
                local_hashes: hasher.local_hashes(&tokens).map(|l| l.get()).collect(),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    raw.publish_events(tokio_stream::iter([store(1, &salted), store(2, &hasher)]))
        .await
        .expect("published");
    let prompt = kvatlas_proto::client::Prompt::new(MODEL, &tokens);
    let plain = client
        .query(&prompt, v1::QueryOptions::default())
        .await
        .expect("query");
    assert_eq!(answer_rows(&plain), [(2, 0, 3, 3, 3)]);
    let with_salt = client
        .query(
            &prompt.lora_name("sql").cache_salt("team-a"),
            v1::QueryOptions::default(),
        )
        .await
        .expect("query");
    assert_eq!(answer_rows(&with_salt), [(1, 0, 3, 3, 3)]);
    // Clones share the block sizes learned: one ListIndexes for the index, not one per clone
    // (a router clones the client it connected per call). `client` asked once above.
    let template = kvatlas_proto::client::Client::connect(&h.url)
        .await
        .expect("connects");
    for _ in 0..3 {
        let answer = template
            .clone()
            .query(&prompt, v1::QueryOptions::default())
            .await
            .expect("query");
        assert_eq!(answer_rows(&answer), [(2, 0, 3, 3, 3)]);
    }
    let (_, metrics) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(
        metric(
            &metrics,
            "kvatlas_requests_total{rpc=\"ListIndexes\",code=\"OK\"}"
        ),
        Some(2.0),
        "{metrics}"
    );
    // The server hashes tokens with the same LoRA and salt.
    let mut request = token_query(MODEL, "", tokens.clone());
    request.lora_name = "sql".into();
    request.cache_salt = "team-a".into();
    let server_side = raw.query(request).await.expect("query").into_inner();
    assert_eq!(answer_rows(&server_side), answer_rows(&with_salt));
    let unknown = client
        .query(
            &kvatlas_proto::client::Prompt::new("nope", &tokens),
            v1::QueryOptions::default(),
        )
        .await
        .expect_err("no such index");
    assert!(unknown.to_string().contains("no index"), "{unknown}");
}

/// A client that learned an index's block size, pointed at a server where the index was made
/// again with a larger one (a restart without its state), learns it again when a long prompt,
/// hashed at the stale size, is refused as too many blocks for the token limit (every such
/// prompt was refused until a short one happened to get an answer naming the size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_learns_a_changed_block_size_from_a_refusal() {
    /// Stores worker 1's blocks of `tokens` at `block` tokens a block.
    async fn store(h: &Harness, block: u32, tokens: &[u32]) {
        let hasher = BlockHasher::new(block).expect("size");
        let locals: Vec<u64> = hasher.local_hashes(tokens).map(|l| l.get()).collect();
        let request = v1::PublishEventsRequest {
            index: selector(MODEL, ""),
            instance_id: 1,
            block_size: block,
            events: vec![v1::KvEvent {
                event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                    block_hashes: (1..=locals.len() as u64).collect(),
                    local_hashes: locals,
                    ..v1::BlocksStored::default()
                })),
            }],
            ..v1::PublishEventsRequest::default()
        };
        h.client
            .clone()
            .publish_events(tokio_stream::iter([request]))
            .await
            .expect("published");
    }
    let tokens: Vec<u32> = (0..1024).collect();
    let first = start(ServerConfig::default()).await;
    store(&first, 16, &tokens).await;
    let mut client = kvatlas_proto::client::Client::connect(&first.url)
        .await
        .expect("connects");
    let prompt = kvatlas_proto::client::Prompt::new(MODEL, &tokens);
    let answer = client
        .query(&prompt, v1::QueryOptions::default())
        .await
        .expect("query");
    assert_eq!(answer.block_size, 16);
    let grpc_addr = first.server.grpc_addr();
    first.server.shutdown().await;
    // The same address, the index made again with 64-token blocks, and a limit of 1,024 tokens:
    // 64 blocks of 16 are refused (64 × 64 tokens), 16 blocks of 64 are not.
    let config = ServerConfig {
        limits: kvatlas_server::Limits {
            max_query_tokens: 1024,
            ..kvatlas_server::Limits::default()
        },
        ..ServerConfig::default()
    };
    let second = kvatlas_server::RunningServer::start(ServerConfig {
        grpc_addr,
        http_addr: ServerConfig::ephemeral().http_addr,
        ..config
    })
    .await
    .expect("the second server starts on the first's address");
    let second = Harness {
        client: v1::indexer_client::IndexerClient::connect(format!("http://{grpc_addr}"))
            .await
            .expect("connects"),
        url: format!("http://{grpc_addr}"),
        server: second,
    };
    store(&second, 64, &tokens).await;
    let start = std::time::Instant::now();
    let answer = loop {
        match client.query(&prompt, v1::QueryOptions::default()).await {
            // The client's connection to the first server is made again.
            Err(error) if error.to_string().contains("transport") && start.elapsed() < WAIT => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            answer => break answer.expect("the size is learned again"),
        }
    };
    assert_eq!(answer.block_size, 64);
    assert_eq!(answer_rows(&answer), [(1, 0, 16, 16, 16)]);
    second.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_workers_register_override_ranks_and_unregister() {
    let mut h = start(ServerConfig::default()).await;
    let mut engine = VllmPublisher::bind();
    let register = v1::RegisterWorkerRequest {
        index: selector(MODEL, ""),
        instance_id: 7,
        dp_rank: 0,
        block_size: BLOCK,
        endpoint: engine.endpoint.clone(),
        ..v1::RegisterWorkerRequest::default()
    };
    let registered = h
        .client
        .register_worker(register.clone())
        .await
        .expect("registers")
        .into_inner();
    assert!(registered.created_index && !registered.already_registered);
    let again = h
        .client
        .register_worker(register.clone())
        .await
        .expect("the same registration again is fine")
        .into_inner();
    assert!(again.already_registered && !again.created_index);
    let mut other = register.clone();
    other.endpoint = "tcp://127.0.0.1:9".into();
    let status = h.client.register_worker(other).await.expect_err("differs");
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");

    // Empty batches until the listener hears the engine (ZMQ's slow joiner).
    let mut client = h.client.clone();
    wait_for_an_active_listener(&client, &mut engine).await;
    let tokens = prompt_tokens(&[1, 1, 1], BLOCK);
    engine.publish(
        &[VllmEvent::Stored {
            hashes: vec![71, 72, 73],
            parent: None,
            tokens: tokens.clone(),
            block_size: BLOCK,
        }],
        None,
    );
    // A batch carrying rank 1 overrides the registered rank 0.
    engine.publish(
        &[VllmEvent::Stored {
            hashes: vec![171, 172],
            parent: None,
            tokens: tokens[..2 * BLOCK as usize].to_vec(),
            block_size: BLOCK,
        }],
        Some(1),
    );
    let query = token_query(MODEL, "", tokens.clone());
    wait_until("both ranks' blocks", || {
        let (mut client, query) = (client.clone(), query.clone());
        async move {
            let answer = client.query(query).await.expect("query").into_inner();
            answer_rows(&answer) == [(7, 0, 3, 3, 3), (7, 1, 2, 2, 2)]
        }
    })
    .await;
    let listed = listed_workers(&mut client).await;
    let sources: Vec<_> = listed
        .workers
        .iter()
        .map(|w| {
            (
                w.instance_id,
                w.dp_rank,
                w.source,
                w.blocks.map(|b| b.device),
            )
        })
        .collect();
    assert_eq!(
        sources,
        [
            (7, 0, v1::WorkerSource::Zmq as i32, Some(3)),
            (7, 1, v1::WorkerSource::BatchRank as i32, Some(2)),
        ]
    );
    assert!(listed.workers[0].last_seq.is_some());

    // A mismatched block size is refused.
    let mut mismatched = register.clone();
    mismatched.instance_id = 8;
    mismatched.block_size = BLOCK * 2;
    let status = client
        .register_worker(mismatched)
        .await
        .expect_err("mismatch");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("block size"), "{status:?}");

    // Unregistering the whole instance removes both ranks (the registered one and the batch's)
    // with their blocks and stops the listener.
    let removed = client
        .unregister_worker(v1::UnregisterWorkerRequest {
            index: selector(MODEL, ""),
            instance_id: 7,
            ..v1::UnregisterWorkerRequest::default()
        })
        .await
        .expect("unregisters")
        .into_inner();
    assert_eq!(
        (
            removed.ranks_removed,
            removed.listeners_stopped,
            removed.blocks_removed
        ),
        (2, 1, 5)
    );
    let answer = client
        .query(query.clone())
        .await
        .expect("query")
        .into_inner();
    assert!(answer.matches.is_empty(), "{answer:?}");
    // Later batches from the engine are not heard any more.
    engine.publish(
        &[VllmEvent::Stored {
            hashes: vec![74],
            parent: None,
            tokens: tokens[..BLOCK as usize].to_vec(),
            block_size: BLOCK,
        }],
        None,
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let answer = client.query(query).await.expect("query").into_inner();
    assert!(answer.matches.is_empty(), "{answer:?}");
    let status = client
        .unregister_worker(v1::UnregisterWorkerRequest {
            index: selector(MODEL, ""),
            instance_id: 7,
            ..v1::UnregisterWorkerRequest::default()
        })
        .await
        .expect_err("already gone");
    assert_eq!(status.code(), Code::NotFound);
    let _ = &mut h;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_can_be_unregistered_alone() {
    let mut h = start(ServerConfig::default()).await;
    let tokens = prompt_tokens(&[0, 1], BLOCK);
    let hasher = BlockHasher::new(BLOCK).expect("size");
    let store = |rank: u32| v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: 4,
        dp_rank: rank,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: vec![u64::from(rank) * 10, u64::from(rank) * 10 + 1],
                local_hashes: hasher.local_hashes(&tokens).map(|l| l.get()).collect(),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    h.client
        .publish_events(tokio_stream::iter([store(0), store(1)]))
        .await
        .expect("published");
    let removed = h
        .client
        .unregister_worker(v1::UnregisterWorkerRequest {
            index: selector(MODEL, ""),
            instance_id: 4,
            dp_rank: Some(1),
            ..v1::UnregisterWorkerRequest::default()
        })
        .await
        .expect("unregisters rank 1")
        .into_inner();
    assert_eq!((removed.ranks_removed, removed.blocks_removed), (1, 2));
    let answer = h
        .client
        .query(token_query(MODEL, "", tokens))
        .await
        .expect("query")
        .into_inner();
    assert_eq!(answer_rows(&answer), [(4, 0, 2, 2, 2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated() {
    let mut h = start(ServerConfig::default()).await;
    let tokens = prompt_tokens(&[2, 2], BLOCK);
    let hasher = BlockHasher::new(BLOCK).expect("size");
    let store = |tenant: &str, worker: u64| v1::PublishEventsRequest {
        index: selector(MODEL, tenant),
        instance_id: worker,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: vec![worker, worker + 1],
                local_hashes: hasher.local_hashes(&tokens).map(|l| l.get()).collect(),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    h.client
        .publish_events(tokio_stream::iter([
            store("a", 1),
            store("b", 2),
            store("", 3),
        ]))
        .await
        .expect("published");
    for (tenant, worker) in [("a", 1), ("b", 2), ("", 3), ("default", 3)] {
        let answer = h
            .client
            .query(token_query(MODEL, tenant, tokens.clone()))
            .await
            .expect("query")
            .into_inner();
        assert_eq!(
            answer_rows(&answer),
            [(worker, 0, 2, 2, 2)],
            "tenant {tenant:?}"
        );
    }
    let status = h
        .client
        .query(token_query(MODEL, "c", tokens))
        .await
        .expect_err("no tenant c");
    assert_eq!(status.code(), Code::NotFound);
    assert!(status.message().contains("tenants"), "{status:?}");
    let indexes = h
        .client
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("list")
        .into_inner();
    let names: Vec<_> = indexes
        .indexes
        .iter()
        .map(|i| i.index.clone().unwrap_or_default().tenant)
        .collect();
    assert_eq!(names, ["a", "b", "default"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_engine_stays_pending_and_harms_nothing() {
    let mut h = start(ServerConfig::default()).await;
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("tcp://{}", closed.local_addr().expect("addr"));
    drop(closed);
    h.client
        .register_worker(v1::RegisterWorkerRequest {
            index: selector(MODEL, ""),
            instance_id: 1,
            block_size: BLOCK,
            endpoint,
            ..v1::RegisterWorkerRequest::default()
        })
        .await
        .expect("registration of a down engine is accepted");
    // It stays pending, and says why.
    let mut client = h.client.clone();
    wait_until("the failed connection to be reported", || {
        let mut client = client.clone();
        async move {
            let listed = listed_workers(&mut client).await;
            let worker = &listed.workers[0];
            assert_eq!(worker.status, v1::WorkerStatus::Pending as i32);
            worker
                .last_error
                .contains("cannot reach the engine at tcp://127.0.0.1:")
                && worker
                    .counters
                    .as_ref()
                    .is_some_and(|c| c.connect_retries > 0)
        }
    })
    .await;
    let _ = &mut client;
    let answer = h
        .client
        .query(token_query(MODEL, "", prompt_tokens(&[0], BLOCK)))
        .await
        .expect("queries are answered")
        .into_inner();
    assert!(answer.matches.is_empty());
    // A malformed endpoint is refused with the reason.
    let status = h
        .client
        .register_worker(v1::RegisterWorkerRequest {
            index: selector(MODEL, ""),
            instance_id: 2,
            block_size: BLOCK,
            endpoint: "not-an-endpoint".into(),
            ..v1::RegisterWorkerRequest::default()
        })
        .await
        .expect_err("bad endpoint");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("not-an-endpoint"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_gate_holds_queries_until_enough_workers() {
    let config = ServerConfig {
        min_initial_workers: 2,
        ..ServerConfig::default()
    };
    let mut h = start(config).await;
    let channel = tonic::transport::Endpoint::from_shared(h.url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connects");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let status = health
        .check(check("kvatlas.v1.Indexer"))
        .await
        .expect("health")
        .into_inner()
        .status;
    assert_ne!(status, serving);
    assert_eq!(http_get(h.server.http_addr(), "/ready", None).0, 503);
    assert_eq!(http_get(h.server.http_addr(), "/health", None).0, 200);
    let hasher = BlockHasher::new(BLOCK).expect("size");
    let tokens = prompt_tokens(&[0], BLOCK);
    let store = |worker: u64| v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: worker,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: vec![worker],
                local_hashes: hasher.local_hashes(&tokens).map(|l| l.get()).collect(),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    h.client
        .publish_events(tokio_stream::iter([store(1)]))
        .await
        .expect("published");
    let status = h
        .client
        .query(token_query(MODEL, "", tokens.clone()))
        .await
        .expect_err("gate closed");
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("1 of the 2"), "{status:?}");
    h.client
        .publish_events(tokio_stream::iter([store(2)]))
        .await
        .expect("published");
    let answer = h
        .client
        .query(token_query(MODEL, "", tokens))
        .await
        .expect("gate open")
        .into_inner();
    assert_eq!(answer.matches.len(), 2);
    wait_until("health SERVING", || {
        let mut health = health.clone();
        async move {
            health
                .check(check("kvatlas.v1.Indexer"))
                .await
                .is_ok_and(|r| r.into_inner().status == serving)
        }
    })
    .await;
    assert_eq!(http_get(h.server.http_addr(), "/ready", None).0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_events_follows_the_sequencing_rules() {
    let mut h = start(ServerConfig::default()).await;
    let worker = Worker::new(5, 0);
    let batches = script(3, MODEL, &[worker], 12, BLOCK);
    // Send 0..6, a retry of 3..6, then 8.. (7 lost): a duplicate run and a gap.
    let mut messages: Vec<_> = batches[..6].iter().map(|b| b.message.clone()).collect();
    messages.extend(batches[3..6].iter().map(|b| b.message.clone()));
    messages.extend(batches[8..].iter().map(|b| b.message.clone()));
    let acked = h
        .client
        .publish_events(tokio_stream::iter(messages))
        .await
        .expect("published")
        .into_inner();
    assert_eq!(acked.messages_received, 13);
    assert_eq!(acked.duplicates, 3);
    assert_eq!((acked.gaps, acked.resyncs), (1, 1));
    assert_eq!(acked.messages_applied, 10);
    assert_eq!(acked.ranks[0].last_seq, Some(11));
    // The gap cleared the rank: the index holds what 8.. built on an empty rank.
    let mut reference = ReferenceIndex::new();
    for b in &batches[..6] {
        b.mutations.iter().for_each(|m| {
            reference.apply(m);
        });
    }
    reference.apply(&kvatlas_index::Mutation::Cleared { worker });
    for b in &batches[8..] {
        b.mutations.iter().for_each(|m| {
            reference.apply(m);
        });
    }
    let listed = listed_workers(&mut h.client).await;
    let feed = &listed.workers[0];
    assert_eq!(feed.source, v1::WorkerSource::Grpc as i32);
    assert!(feed.last_error.contains("gap: batches 6..=7"), "{feed:?}");
    let counters = feed.counters.clone().unwrap_or_default();
    assert_eq!(
        (counters.duplicates, counters.gaps, counters.resyncs),
        (3, 1, 1)
    );

    // A restart (0 after 11) clears the rank again.
    let mut restart = batches[0].message.clone();
    restart.seq = Some(0);
    let acked = h
        .client
        .publish_events(tokio_stream::iter([restart]))
        .await
        .expect("published")
        .into_inner();
    assert_eq!((acked.resyncs, acked.messages_applied), (1, 1));
    reference.apply(&kvatlas_index::Mutation::Cleared { worker });
    batches[0].mutations.iter().for_each(|m| {
        reference.apply(m);
    });
    let report = h.server.shutdown().await;
    assert_eq!(report.indexes[0].digest, reference.snapshot().digest());
    assert_eq!(report.indexes[0].last_seq, [(worker, Some(0))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_message_ends_the_stream_after_applying_what_came_before() {
    let mut h = start(ServerConfig::default()).await;
    let worker = Worker::new(6, 0);
    let batches = script(4, MODEL, &[worker], 3, BLOCK);
    let mut bad = batches[2].message.clone();
    bad.events.push(v1::KvEvent {
        event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
            block_hashes: vec![1, 2],
            token_ids: vec![1, 2, 3],
            ..v1::BlocksStored::default()
        })),
    });
    let messages = vec![batches[0].message.clone(), batches[1].message.clone(), bad];
    let status = h
        .client
        .publish_events(tokio_stream::iter(messages))
        .await
        .expect_err("the third message is bad");
    assert_eq!(status.code(), Code::InvalidArgument);
    let message = status.message();
    assert!(message.contains("message 3"), "{message}");
    assert!(
        message.contains("3 token ids for 2 blocks of 4 tokens"),
        "{message}"
    );
    assert!(
        message.contains("2 message(s) before it were applied"),
        "{message}"
    );
    let mut reference = ReferenceIndex::new();
    for b in &batches[..2] {
        b.mutations.iter().for_each(|m| {
            reference.apply(m);
        });
    }
    let report = h.server.shutdown().await;
    assert_eq!(report.indexes[0].digest, reference.snapshot().digest());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_feed_per_rank() {
    let mut h = start(ServerConfig::default()).await;
    let engine = VllmPublisher::bind();
    register_engine(&mut h.client, (MODEL, BLOCK), 9, &engine).await;
    let batches = script(5, MODEL, &[Worker::new(9, 0)], 1, BLOCK);
    let status = publish(&mut h.client, &batches)
        .await
        .expect_err("a ZMQ listener feeds rank 0");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("ZMQ listener"), "{status:?}");

    // Two streams for one rank: the second is refused while the first is open.
    let batches = script(6, MODEL, &[Worker::new(10, 0)], 4, BLOCK);
    let (first_tx, first_rx) = tokio::sync::mpsc::channel(4);
    let mut first_client = h.client.clone();
    let first = tokio::spawn(async move {
        first_client
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(first_rx))
            .await
    });
    first_tx
        .send(batches[0].message.clone())
        .await
        .expect("send");
    wait_until("the first stream to feed the rank", || {
        let mut client = h.client.clone();
        async move {
            let listed = listed_workers(&mut client).await;
            listed.workers.iter().any(|w| w.instance_id == 10)
        }
    })
    .await;
    let status = h
        .client
        .publish_events(tokio_stream::iter([batches[1].message.clone()]))
        .await
        .expect_err("another stream feeds it");
    assert_eq!(status.code(), Code::FailedPrecondition);
    first_tx
        .send(batches[1].message.clone())
        .await
        .expect("send");
    drop(first_tx);
    let acked = first
        .await
        .expect("task")
        .expect("first stream")
        .into_inner();
    assert_eq!(acked.messages_applied, 2);
    // Once it closed, another stream may continue the rank.
    let acked = publish(&mut h.client, &batches[2..])
        .await
        .expect("continues");
    assert_eq!(acked.messages_applied, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_applies_and_acknowledges_what_it_read() {
    let h = start(ServerConfig::default()).await;
    let workers = [Worker::new(1, 0), Worker::new(2, 0)];
    let batches = script(8, MODEL, &workers, 5_000, BLOCK);
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut client = h.client.clone();
    let stream = tokio::spawn(async move {
        client
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    let messages: Vec<_> = batches.iter().map(|b| b.message.clone()).collect();
    let (sent_tx, sent) = tokio::sync::oneshot::channel();
    let sender = tokio::spawn(async move {
        for message in messages {
            if tx.send(message).await.is_err() {
                break;
            }
            tokio::task::yield_now().await;
        }
        let _ = sent_tx.send(());
        // Keep the stream open: the shutdown, not the client, ends it.
        std::future::pending::<()>().await;
    });
    // The client stops writing before the shutdown: a client still writing when the server
    // closes the connection may see the broken pipe before it reads the acknowledgement (the
    // transport's race, not the server's state, which the assertions below check either way).
    tokio::time::timeout(Duration::from_secs(30), sent)
        .await
        .expect("the sender handed every message to the stream")
        .expect("the sender finished");
    wait_until("some messages applied", || {
        let mut client = h.client.clone();
        async move {
            client
                .list_indexes(v1::ListIndexesRequest::default())
                .await
                .is_ok_and(|r| {
                    r.into_inner()
                        .indexes
                        .first()
                        .is_some_and(|i| i.events_applied > 100)
                })
        }
    })
    .await;
    let report = h.server.shutdown().await;
    sender.abort();
    let acked = stream
        .await
        .expect("task")
        .expect("the stream is acknowledged, not failed")
        .into_inner();
    // However far the sender got, the stream was open when the shutdown began (the sender
    // never closes it): every message acknowledged is in the final state, and nothing else.
    assert!(acked.messages_applied > 100, "{acked:?}");
    let mut reference = ReferenceIndex::new();
    for b in &batches[..acked.messages_applied as usize] {
        b.mutations.iter().for_each(|m| {
            reference.apply(m);
        });
    }
    assert_eq!(report.indexes[0].digest, reference.snapshot().digest());
    let last: Vec<_> = acked
        .ranks
        .iter()
        .map(|r| (Worker::new(r.instance_id, r.dp_rank), r.last_seq))
        .collect();
    assert_eq!(report.indexes[0].last_seq, last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_age_runs_from_the_engines_timestamp_to_visible() {
    let mut h = start(ServerConfig::default()).await;
    let mut engine = VllmPublisher::bind();
    register_engine(&mut h.client, (MODEL, BLOCK), 3, &engine).await;
    // Empty batches, stamped long ago, until the listener hears the engine (ZMQ's slow joiner).
    wait_for_an_active_listener(&h.client, &mut engine).await;
    let labels = format!("model=\"{MODEL}\",tenant=\"default\"");
    let labels = labels.as_str();
    let series = |name: &str| {
        let (_, body) = http_get(h.server.http_addr(), "/metrics", None);
        metric(&body, &format!("{name}{{{labels}}}"))
    };
    let wall = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64()
    };
    // Three batches stamped as an engine stamps them (its wall clock at publication), one stamped
    // ahead of this machine's clock, one stamped long ago: only the three have an age.
    let published = wall();
    for i in 0..3u64 {
        let tokens = prompt_tokens(&[40 + i], BLOCK);
        let stored = VllmEvent::Stored {
            hashes: vec![300 + i],
            parent: None,
            tokens,
            block_size: BLOCK,
        };
        engine.publish_at(&[stored], None, wall());
    }
    engine.publish_at(&[], None, wall() + 30.0);
    let last = engine.publish(&[], None);
    // Every batch handed to the index once the last one is; every one observed once the ingest
    // delay has counted as many batches as the listener received.
    let client = h.client.clone();
    wait_until("the last batch to be handed over", || {
        let mut client = client.clone();
        async move {
            let listed = listed_workers(&mut client).await;
            listed.workers.iter().any(|w| w.last_seq == Some(last))
        }
    })
    .await;
    let (_, body) = http_get(h.server.http_addr(), "/metrics", None);
    let received = metric(
        &body,
        &format!("kvatlas_batches_total{{{labels},outcome=\"received\"}}"),
    );
    assert!(received.is_some_and(|r| r >= 5.0), "{body}");
    wait_until("every batch received to be visible", || {
        let observed = series("kvatlas_ingest_delay_seconds_count");
        async move { observed == received }
    })
    .await;
    let elapsed = wall() - published;
    let (_, body) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(
        metric(
            &body,
            &format!("kvatlas_ingest_delay_seconds_count{{{labels}}}")
        ),
        received,
        "{body}"
    );
    assert_eq!(
        metric(
            &body,
            &format!("kvatlas_event_age_seconds_count{{{labels}}}")
        ),
        Some(3.0),
        "{body}"
    );
    let sum = metric(&body, &format!("kvatlas_event_age_seconds_sum{{{labels}}}"));
    assert!(
        sum.is_some_and(|s| s > 0.0 && s <= 3.0 * elapsed),
        "three ages, each within the {elapsed} s since the first was stamped: {sum:?}"
    );
    // Every age fell into a bucket no wider than 50 µs below a millisecond, or a coarser one.
    let le_1ms = metric(
        &body,
        &format!("kvatlas_event_age_seconds_bucket{{{labels},le=\"0.001\"}}"),
    );
    let le_950us = metric(
        &body,
        &format!("kvatlas_event_age_seconds_bucket{{{labels},le=\"0.00095\"}}"),
    );
    assert!(le_1ms.is_some() && le_950us.is_some(), "{body}");
}
