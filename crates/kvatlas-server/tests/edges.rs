//! What the server does at its edges: malformed, oversized and invalid requests get a status
//! that names the problem and leave the index untouched; authentication on every RPC but health,
//! per-tenant tokens; the concurrency limit sheds; TLS on both listeners; the metrics tell what
//! happened.

mod common;

use std::path::PathBuf;

use bytes::{Buf, BufMut};
use common::*;
use kvatlas_index::{KvIndex, ReferenceIndex, Worker};
use kvatlas_proto::client::{Client, ConnectOptions};
use kvatlas_proto::v1::{self, query_request};
use kvatlas_server::{Limits, RunningServer, ServerConfig, TlsFiles};
use tonic::Code;
use tonic::codec::{DecodeBuf, Decoder, EncodeBuf, Encoder};

const MODEL: &str = "m";
const BLOCK: u32 = 4;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvatlas-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A codec sending and receiving raw bytes, to put arbitrary bytes on the wire.
#[derive(Debug, Default, Clone)]
struct RawCodec;
#[derive(Debug)]
struct RawBytes;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawBytes;
    type Decoder = RawBytes;
    fn encoder(&mut self) -> RawBytes {
        RawBytes
    }
    fn decoder(&mut self) -> RawBytes {
        RawBytes
    }
}

impl Encoder for RawBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawBytes {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let mut out = vec![0; buf.remaining()];
        buf.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

async fn raw_call(url: &str, path: &'static str, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .expect("url")
        .connect()
        .await
        .expect("connects");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    grpc.unary(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        RawCodec,
    )
    .await
    .map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_change_nothing() {
    let config = ServerConfig {
        limits: Limits {
            max_query_tokens: 64,
            max_message_bytes: 4096,
            ..Limits::default()
        },
        ..ServerConfig::default()
    };
    let mut h = start(config).await;
    let batches = script(1, MODEL, &[Worker::new(1, 0), Worker::new(2, 0)], 50, BLOCK);
    publish_script(&mut h.client, &batches).await;
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    let tokens = prompt_tokens(&[0, 1, 2], BLOCK);
    let mut hashes_with_salt = token_query(MODEL, "", Vec::new());
    hashes_with_salt.input = Some(query_request::Input::LocalHashes(v1::LocalHashes {
        hashes: vec![1, 2],
    }));
    hashes_with_salt.cache_salt = "s".into();
    let mut long_salt = token_query(MODEL, "", tokens.clone());
    long_salt.cache_salt = "s".repeat(1025);
    let mut long_lora = token_query(MODEL, "", tokens.clone());
    long_lora.lora_name = "l".repeat(1025);
    let cases: Vec<(v1::QueryRequest, Code, &str)> = vec![
        (
            v1::QueryRequest::default(),
            Code::InvalidArgument,
            "index is missing",
        ),
        (
            token_query("", "", tokens.clone()),
            Code::InvalidArgument,
            "index.model is empty",
        ),
        (
            token_query(&"x".repeat(300), "", tokens.clone()),
            Code::InvalidArgument,
            "at most 256",
        ),
        (
            v1::QueryRequest {
                index: selector(MODEL, ""),
                ..v1::QueryRequest::default()
            },
            Code::InvalidArgument,
            "input is missing",
        ),
        (
            token_query(MODEL, "", vec![7; 65]),
            Code::InvalidArgument,
            "at most 64",
        ),
        (
            hashes_with_salt,
            Code::InvalidArgument,
            "apply to token queries only",
        ),
        (
            long_salt,
            Code::InvalidArgument,
            "cache_salt is 1025 bytes long; at most 1024",
        ),
        (
            long_lora,
            Code::InvalidArgument,
            "lora_name is 1025 bytes long; at most 1024",
        ),
        (
            token_query("unknown-model", "", tokens.clone()),
            Code::NotFound,
            "no index for model \"unknown-model\"",
        ),
        (
            token_query(MODEL, "tenant-x", tokens.clone()),
            Code::NotFound,
            "tenants are [\"default\"]",
        ),
    ];
    for (request, code, needle) in cases {
        let status = h.client.query(request.clone()).await.expect_err("refused");
        assert_eq!(status.code(), code, "{request:?}: {status:?}");
        assert!(status.message().contains(needle), "{needle}: {status:?}");
    }
    let registrations: Vec<(v1::RegisterWorkerRequest, Code, &str)> = vec![
        (
            v1::RegisterWorkerRequest {
                index: selector(MODEL, ""),
                block_size: 0,
                endpoint: "tcp://127.0.0.1:5557".into(),
                ..v1::RegisterWorkerRequest::default()
            },
            Code::InvalidArgument,
            "block_size is 0",
        ),
        (
            v1::RegisterWorkerRequest {
                index: selector(MODEL, ""),
                block_size: BLOCK,
                engine: 9,
                endpoint: "tcp://127.0.0.1:5557".into(),
                ..v1::RegisterWorkerRequest::default()
            },
            Code::InvalidArgument,
            "engine is 9",
        ),
        (
            v1::RegisterWorkerRequest {
                index: selector(MODEL, ""),
                block_size: BLOCK,
                ..v1::RegisterWorkerRequest::default()
            },
            Code::InvalidArgument,
            "endpoint is empty",
        ),
        (
            v1::RegisterWorkerRequest {
                index: selector(MODEL, ""),
                block_size: BLOCK * 2,
                endpoint: "tcp://127.0.0.1:5557".into(),
                ..v1::RegisterWorkerRequest::default()
            },
            Code::FailedPrecondition,
            "has block size 4 but this request gives 8",
        ),
    ];
    for (request, code, needle) in registrations {
        let status = h
            .client
            .register_worker(request.clone())
            .await
            .expect_err("refused");
        assert_eq!(status.code(), code, "{request:?}: {status:?}");
        assert!(status.message().contains(needle), "{needle}: {status:?}");
    }
    // Bytes that are not a QueryRequest: a packed fixed64 field of 7 bytes.
    let malformed = vec![0x2a, 0x09, 0x0a, 0x07, 1, 2, 3, 4, 5, 6, 7];
    let status = raw_call(&h.url, "/kvatlas.v1.Indexer/Query", malformed)
        .await
        .expect_err("malformed");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("malformed QueryRequest"),
        "{status:?}"
    );
    // A message over the size limit.
    let status = h
        .client
        .query(token_query(MODEL, "", vec![70_000; 2_000]))
        .await
        .expect_err("too large");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");
    // On a QueryStream a bad query gets an error answer and the stream goes on; a message over
    // the size limit ends the stream with RESOURCE_EXHAUSTED.
    let streamed = |id: u64, model: &str, tokens: Vec<u32>| v1::QueryRequest {
        request_id: id,
        ..token_query(model, "", tokens)
    };
    let queries = vec![
        streamed(1, MODEL, tokens.clone()),
        streamed(2, "unknown-model", tokens.clone()),
        streamed(3, MODEL, tokens.clone()),
        streamed(4, MODEL, vec![70_000; 2_000]),
        streamed(5, MODEL, tokens.clone()),
    ];
    let mut answers = h
        .client
        .query_stream(tokio_stream::iter(queries))
        .await
        .expect("the stream opens")
        .into_inner();
    let mut outcomes = Vec::new();
    let ended = loop {
        match answers.message().await {
            Ok(Some(answer)) => outcomes.push((
                answer.request_id,
                match answer.outcome {
                    Some(v1::query_stream_response::Outcome::Response(_)) => "answer".to_owned(),
                    Some(v1::query_stream_response::Outcome::Error(e)) => {
                        assert!(e.message.contains("unknown-model"), "{e:?}");
                        format!("error {}", e.code)
                    }
                    None => "nothing".to_owned(),
                },
            )),
            Ok(None) => break None,
            Err(status) => break Some(status),
        }
    };
    assert_eq!(
        outcomes,
        [
            (1, "answer".to_owned()),
            (2, format!("error {}", Code::NotFound as u32)),
            (3, "answer".to_owned())
        ]
    );
    let ended = ended.expect("the oversized message ends the stream");
    assert_eq!(ended.code(), Code::ResourceExhausted, "{ended:?}");
    // PublishEvents alike: nothing of an oversized message is applied.
    let oversized = v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: 1,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: (1_000..2_000).collect(),
                local_hashes: (1_000..2_000).collect(),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    let status = h
        .client
        .publish_events(tokio_stream::iter([oversized]))
        .await
        .expect_err("too large");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // A stored run of token ids with a LoRA name over the limit is refused by name.
    let long_lora = v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: 1,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: vec![7_000],
                token_ids: vec![1; BLOCK as usize],
                lora_name: "l".repeat(1025),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    let status = h
        .client
        .publish_events(tokio_stream::iter([long_lora]))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("events[0]: lora_name is 1025 bytes long"),
        "{status:?}"
    );
    // None of it changed the index, and good queries are still answered exactly.
    let report_digest = reference.snapshot().digest();
    let mut rng = Rng(3);
    for _ in 0..20 {
        let (tokens, locals) = random_prompt(&mut rng, BLOCK);
        let answer = h
            .client
            .query(token_query(MODEL, "", tokens))
            .await
            .expect("query")
            .into_inner();
        assert_eq!(
            answer_rows(&answer),
            reference_rows(&reference_answer(&reference, &locals))
        );
    }
    let report = h.server.shutdown().await;
    assert_eq!(report.indexes[0].digest, report_digest);
}

/// A `PublishEvents` message of `instance_id` storing the blocks `hashes` (with their local
/// hashes) in `model`'s index of `tenant`.
fn stored_blocks(
    model: &str,
    tenant: &str,
    instance_id: u64,
    hashes: Vec<u64>,
    locals: Vec<u64>,
) -> v1::PublishEventsRequest {
    v1::PublishEventsRequest {
        index: selector(model, tenant),
        instance_id,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: hashes,
                local_hashes: locals,
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    }
}

fn token_file(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("tokens");
    std::fs::write(
        &path,
        "# admin\nadmin-0123456789abcdef name=admin\nteam-a-0123456789abcdef tenants=a,c name=team-a\n",
    )
    .expect("write tokens");
    path
}

async fn authed(url: &str, token: Option<&str>) -> Client {
    Client::connect_with(
        url,
        &ConnectOptions {
            token: token.map(str::to_owned),
            ..ConnectOptions::default()
        },
    )
    .await
    .expect("connects")
}

/// Dynamo's query routes also take the Mooncake RFC's fields: `model` for `model_name`,
/// `instance_id` (that instance's answer only), `block_size` (checked against the index's), and
/// refuse its deprecated `lora_id` with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_queries_take_the_mooncake_rfc_fields() {
    let mut h = start(ServerConfig::default()).await;
    let hasher = kvatlas_hash::BlockHasher::new(BLOCK).expect("size");
    let tokens = prompt_tokens(&[1, 2, 3], BLOCK);
    let locals: Vec<u64> = hasher.local_hashes(&tokens).map(|l| l.get()).collect();
    // Instance 1 holds the three blocks, instance 2 the first two.
    let store = |instance: u64, blocks: usize| v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: instance,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: (0..blocks as u64).map(|b| instance * 100 + b).collect(),
                local_hashes: locals[..blocks].to_vec(),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    h.client
        .publish_events(tokio_stream::iter([store(1, 3), store(2, 2)]))
        .await
        .expect("published");
    let http = h.server.http_addr();
    let post = |path: &str, body: serde_json::Value| {
        let (status, text) = http_post_json(http, path, &body.to_string());
        let json = serde_json::from_str::<serde_json::Value>(&text).unwrap_or_default();
        (status, json, text)
    };
    let scores = |json: &serde_json::Value| json["scores"].clone();
    let both = serde_json::json!({"1": {"0": 12}, "2": {"0": 8}});
    let (status, json, text) = post(
        "/query",
        serde_json::json!({"token_ids": tokens, "model": MODEL}),
    );
    assert_eq!((status, scores(&json)), (200, both.clone()), "{text}");
    let (status, json, text) = post(
        "/query",
        serde_json::json!({"token_ids": tokens, "model": MODEL, "instance_id": 2, "block_size": BLOCK}),
    );
    assert_eq!(
        (status, scores(&json)),
        (200, serde_json::json!({"2": {"0": 8}})),
        "{text}"
    );
    assert_eq!(
        json["instances"].as_object().map(|o| o.len()),
        Some(1),
        "{text}"
    );
    let (status, json, text) = post(
        "/query_by_hash",
        serde_json::json!({"seq_hashes": locals, "model": MODEL, "instance_id": 1}),
    );
    assert_eq!(
        (status, scores(&json)),
        (200, serde_json::json!({"1": {"0": 12}})),
        "{text}"
    );
    let (status, _, text) = post(
        "/query",
        serde_json::json!({"token_ids": tokens, "model": MODEL, "block_size": BLOCK * 2}),
    );
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("block_size mismatch") && text.contains(&format!("the index has {BLOCK}")),
        "{text}"
    );
    let (status, _, text) = post(
        "/query",
        serde_json::json!({"token_ids": tokens, "model": MODEL, "lora_id": 3}),
    );
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("lora_id is not accepted") && text.contains("lora_name"),
        "{text}"
    );
    // Without the RFC's fields, 1.6.1's request is answered as before.
    let (status, json, text) = post(
        "/query",
        serde_json::json!({"token_ids": tokens, "model_name": MODEL}),
    );
    assert_eq!((status, scores(&json)), (200, both), "{text}");
    h.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_but_health_needs_a_token_and_tokens_keep_to_their_tenants() {
    let dir = temp_dir("auth");
    let h = start(ServerConfig {
        auth_tokens: Some(token_file(&dir)),
        ..ServerConfig::default()
    })
    .await;
    let hasher = kvatlas_hash::BlockHasher::new(BLOCK).expect("size");
    let tokens = prompt_tokens(&[1], BLOCK);
    let store = |tenant: &str| {
        let locals = hasher.local_hashes(&tokens).map(|l| l.get()).collect();
        stored_blocks(MODEL, tenant, 1, vec![1], locals)
    };
    for token in [None, Some("wrong-token-0123456789")] {
        let mut client = authed(&h.url, token).await;
        let raw = client.raw();
        let calls: Vec<(&str, tonic::Status)> = vec![
            (
                "Query",
                raw.query(token_query(MODEL, "a", tokens.clone()))
                    .await
                    .expect_err(""),
            ),
            (
                "QueryStream",
                raw.query_stream(tokio_stream::iter(Vec::<v1::QueryRequest>::new()))
                    .await
                    .expect_err(""),
            ),
            (
                "RegisterWorker",
                raw.register_worker(v1::RegisterWorkerRequest::default())
                    .await
                    .expect_err(""),
            ),
            (
                "UnregisterWorker",
                raw.unregister_worker(v1::UnregisterWorkerRequest::default())
                    .await
                    .expect_err(""),
            ),
            (
                "ListWorkers",
                raw.list_workers(v1::ListWorkersRequest::default())
                    .await
                    .expect_err(""),
            ),
            (
                "ListIndexes",
                raw.list_indexes(v1::ListIndexesRequest::default())
                    .await
                    .expect_err(""),
            ),
            (
                "PublishEvents",
                raw.publish_events(tokio_stream::iter([store("a")]))
                    .await
                    .expect_err(""),
            ),
            (
                "Snapshot",
                raw.snapshot(v1::SnapshotRequest::default())
                    .await
                    .expect_err(""),
            ),
        ];
        for (rpc, status) in calls {
            assert_eq!(
                status.code(),
                Code::Unauthenticated,
                "{rpc} {token:?}: {status:?}"
            );
        }
    }
    // Health needs no token.
    let channel = tonic::transport::Endpoint::from_shared(h.url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connects");
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health without a token");

    let mut admin = authed(&h.url, Some("admin-0123456789abcdef")).await;
    let mut team = authed(&h.url, Some("team-a-0123456789abcdef")).await;
    admin
        .raw()
        .publish_events(tokio_stream::iter([store("a"), store("b")]))
        .await
        .expect("admin publishes to any tenant");
    let status = team
        .raw()
        .publish_events(tokio_stream::iter([store("b")]))
        .await
        .expect_err("team-a may not feed tenant b");
    assert_eq!(status.code(), Code::PermissionDenied);
    let answer = team
        .raw()
        .query(token_query(MODEL, "a", tokens.clone()))
        .await
        .expect("its own tenant")
        .into_inner();
    assert_eq!(answer.matches.len(), 1);
    let status = team
        .raw()
        .query(token_query(MODEL, "b", tokens.clone()))
        .await
        .expect_err("another tenant");
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("\"team-a\""), "{status:?}");
    // A tenant it may use that has no index: the hint names only the tenants it may use.
    let status = team
        .raw()
        .query(token_query(MODEL, "c", tokens.clone()))
        .await
        .expect_err("no index in tenant c");
    assert_eq!(status.code(), Code::NotFound);
    assert!(
        status.message().contains("tenants are [\"a\"]"),
        "not tenant b: {status:?}"
    );
    let listed = team
        .raw()
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("list")
        .into_inner();
    let tenants: Vec<_> = listed
        .indexes
        .iter()
        .map(|i| i.index.clone().unwrap_or_default().tenant)
        .collect();
    assert_eq!(tenants, ["a"], "only its tenants are listed");
    // Naming a tenant it may not use is refused, not answered with nothing.
    let other = |model: &str| v1::ListWorkersRequest {
        model: model.into(),
        tenant: "b".into(),
    };
    for status in [
        team.raw().list_workers(other(MODEL)).await.expect_err("b"),
        team.raw()
            .list_indexes(v1::ListIndexesRequest {
                model: String::new(),
                tenant: "b".into(),
            })
            .await
            .expect_err("b"),
        team.raw()
            .snapshot(v1::SnapshotRequest {
                model: MODEL.into(),
                tenant: "b".into(),
            })
            .await
            .expect_err("b"),
    ] {
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    }
    let everywhere = v1::UnregisterWorkerRequest {
        index: selector(MODEL, ""),
        instance_id: 1,
        all_tenants: true,
        ..v1::UnregisterWorkerRequest::default()
    };
    let status = team
        .raw()
        .unregister_worker(everywhere.clone())
        .await
        .expect_err("not across tenants");
    assert_eq!(status.code(), Code::PermissionDenied);
    let all = admin
        .raw()
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(all.indexes.len(), 2);
    // A token allowed every tenant unregisters an instance from all of them at once.
    let removed = admin
        .raw()
        .unregister_worker(everywhere)
        .await
        .expect("across tenants")
        .into_inner();
    let mut tenants: Vec<_> = removed.indexes.iter().map(|i| i.tenant.clone()).collect();
    tenants.sort();
    assert_eq!(tenants, ["a", "b"], "{removed:?}");
    assert_eq!(removed.ranks_removed, 2, "{removed:?}");
    assert!(removed.blocks_removed >= 2, "{removed:?}");
    let left = admin
        .raw()
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(left.workers.iter().all(|w| w.instance_id != 1), "{left:?}");
    // Dynamo's /unregister without a routing group means every group: with a limited token,
    // every group it may use, and no other.
    admin
        .raw()
        .publish_events(tokio_stream::iter([store("a"), store("b")]))
        .await
        .expect("fed again");
    let (status, text) = http_post_json_as(
        h.server.http_addr(),
        "/unregister",
        &format!(r#"{{"instance_id":1,"model_name":"{MODEL}"}}"#),
        Some("team-a-0123456789abcdef"),
    );
    assert_eq!(status, 200, "{text}");
    let left = admin
        .raw()
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner();
    let tenants: Vec<_> = left
        .workers
        .iter()
        .filter(|w| w.instance_id == 1)
        .map(|w| w.index.clone().unwrap_or_default().tenant)
        .collect();
    assert_eq!(tenants, ["b"], "{left:?}");

    let http = h.server.http_addr();
    assert_eq!(http_get(http, "/metrics", None).0, 401);
    // A header that is there but not visible ASCII is not called missing.
    let (status, text) = http_get(http, "/metrics", Some("t\u{f6}k\u{e9}n"));
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("not visible ASCII"), "{text}");
    let mut garbled = tonic::Request::new(v1::ListIndexesRequest::default());
    garbled.metadata_mut().insert(
        "authorization",
        tonic::metadata::AsciiMetadataValue::try_from("Bearer t\u{f6}k\u{e9}n".as_bytes())
            .expect("obs-text is a header value"),
    );
    let status = h
        .client
        .clone()
        .list_indexes(garbled)
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("not visible ASCII"), "{status:?}");
    // Without credentials, a request is refused before its body is looked at: 401, not what
    // the body would have earned (400 for bad JSON or fields the server refuses).
    for body in [
        "not json",
        r#"{"token_ids":[1],"model_name":"m","lora_id":7}"#,
    ] {
        let (status, text) = http_post_json(http, "/query", body);
        assert_eq!(status, 401, "{body}: {text}");
        assert!(text.contains("missing credentials"), "{text}");
    }
    let (status, _) = http_post_json(
        http,
        "/query_by_hash",
        r#"{"block_hashes":[1],"model_name":"m","cache_salt":"s"}"#,
    );
    assert_eq!(status, 401);
    assert_eq!(
        http_get(http, "/metrics", Some("team-a-0123456789abcdef")).0,
        403
    );
    let (status, body) = http_get(http, "/metrics", Some("admin-0123456789abcdef"));
    assert_eq!(status, 200);
    assert!(
        metric(&body, "kvatlas_auth_failures_total").is_some_and(|n| n >= 15.0),
        "{body}"
    );
    assert_eq!(http_get(http, "/health", None).0, 200);
    assert_eq!(
        http_get(
            http,
            "/workers?routing_group=b",
            Some("team-a-0123456789abcdef")
        )
        .0,
        403
    );
    assert_eq!(
        http_get(
            http,
            "/workers?routing_group=a",
            Some("team-a-0123456789abcdef")
        )
        .0,
        200
    );
    // The peer list is the whole server's: a tenant-limited token may not read or change it.
    assert_eq!(
        http_get(http, "/peers", Some("team-a-0123456789abcdef")).0,
        403
    );
    assert_eq!(
        http_get(http, "/peers", Some("admin-0123456789abcdef")).0,
        200
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A `PublishEvents` message refused (a bad event, or a rank beyond the registered-rank limit)
/// leaves no index behind, even when it named a new index with its block size: refused messages
/// cannot use up `max_indexes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_publishes_leave_no_index_behind() {
    let mut h = start(ServerConfig {
        limits: Limits {
            max_registered_ranks: 1,
            ..Limits::default()
        },
        ..ServerConfig::default()
    })
    .await;
    let stored =
        |model: &str, instance_id: u64| stored_blocks(model, "", instance_id, vec![1], vec![11]);
    h.client
        .publish_events(tokio_stream::iter([stored(MODEL, 1)]))
        .await
        .expect("the first rank is fed");
    let bad_event = v1::PublishEventsRequest {
        events: vec![v1::KvEvent { event: None }],
        ..stored("fresh-a", 2)
    };
    let status = h
        .client
        .publish_events(tokio_stream::iter([bad_event]))
        .await
        .expect_err("a bad event");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let status = h
        .client
        .publish_events(tokio_stream::iter([stored("fresh-b", 2)]))
        .await
        .expect_err("beyond the rank limit");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let models: Vec<String> = h
        .client
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("listed")
        .into_inner()
        .indexes
        .into_iter()
        .filter_map(|i| i.index.map(|k| k.model))
        .collect();
    assert_eq!(models, [MODEL]);
    h.server.shutdown().await;
}

/// At the registered-rank limit only a new rank is refused: a rank that has a feed gets the
/// answer it gets below the limit (before, every RegisterWorker was RESOURCE_EXHAUSTED there,
/// the same registration sent again too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_rank_limit_a_registered_rank_is_answered_as_below_it() {
    let mut h = start(ServerConfig {
        limits: Limits {
            max_registered_ranks: 2,
            ..Limits::default()
        },
        ..ServerConfig::default()
    })
    .await;
    let register = |instance_id: u64, port: u16| v1::RegisterWorkerRequest {
        index: selector(MODEL, ""),
        instance_id,
        block_size: BLOCK,
        endpoint: format!("tcp://127.0.0.1:{port}"),
        ..v1::RegisterWorkerRequest::default()
    };
    let first = h
        .client
        .register_worker(register(1, 5557))
        .await
        .expect("registered")
        .into_inner();
    assert!(!first.already_registered);
    // The second and last place: a rank fed over PublishEvents.
    h.client
        .publish_events(tokio_stream::iter([stored_blocks(
            MODEL,
            "",
            3,
            vec![1],
            vec![11],
        )]))
        .await
        .expect("fed");
    let again = h
        .client
        .register_worker(register(1, 5557))
        .await
        .expect("the same registration again")
        .into_inner();
    assert!(again.already_registered);
    for (request, code) in [
        (register(1, 5558), Code::AlreadyExists),
        (register(3, 5557), Code::FailedPrecondition),
        (register(2, 5557), Code::ResourceExhausted),
    ] {
        let status = h
            .client
            .register_worker(request)
            .await
            .expect_err("refused");
        assert_eq!(status.code(), code, "{status:?}");
    }
    h.server.shutdown().await;
}

/// A registration over the API may bind a listener only with a token limited to no tenant and
/// only on `tcp://`: binding an `ipc://` path makes ZeroMQ remove the file there first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_registrations_bind_only_tcp_and_only_for_unrestricted_tokens() {
    let dir = temp_dir("bind");
    let h = start(ServerConfig {
        auth_tokens: Some(token_file(&dir)),
        ..ServerConfig::default()
    })
    .await;
    let precious = dir.join("precious");
    std::fs::write(&precious, "keep me").expect("write");
    let bind = |tenant: &str, endpoint: String| v1::RegisterWorkerRequest {
        index: selector(MODEL, tenant),
        instance_id: 9,
        block_size: BLOCK,
        endpoint,
        socket_mode: v1::SocketMode::Bind as i32,
        ..v1::RegisterWorkerRequest::default()
    };
    let mut team_a = authed(&h.url, Some("team-a-0123456789abcdef")).await;
    let status = team_a
        .raw()
        .register_worker(bind("a", "tcp://127.0.0.1:*".into()))
        .await
        .expect_err("a tenant-limited token may not bind");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status
            .message()
            .contains("only a token limited to no tenant"),
        "{status:?}"
    );
    let mut admin = authed(&h.url, Some("admin-0123456789abcdef")).await;
    let ipc = format!("ipc://{}", precious.display());
    let status = admin
        .raw()
        .register_worker(bind("a", ipc))
        .await
        .expect_err("ipc binds are refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("tcp:// endpoints only"),
        "{status:?}"
    );
    assert_eq!(
        std::fs::read_to_string(&precious).expect("the file is still there"),
        "keep me"
    );
    // A tcp:// bind by an unrestricted token is registered, and connecting stays open to all.
    admin
        .raw()
        .register_worker(bind("a", "tcp://127.0.0.1:*".into()))
        .await
        .expect("an unrestricted token binds tcp://");
    team_a
        .raw()
        .register_worker(v1::RegisterWorkerRequest {
            instance_id: 10,
            socket_mode: v1::SocketMode::Connect as i32,
            ..bind("a", "tcp://127.0.0.1:5557".into())
        })
        .await
        .expect("a tenant-limited token connects");
    h.server.shutdown().await;
}

/// A server without authentication (its listeners on loopback) binds over the API on loopback
/// only: any local process may call it, and would otherwise open a socket on the network that
/// takes events from anyone. `--allow-unauthenticated` lifts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_server_binds_on_loopback_only() {
    let bind = |instance_id: u64, endpoint: &str| v1::RegisterWorkerRequest {
        index: selector(MODEL, ""),
        instance_id,
        block_size: BLOCK,
        endpoint: endpoint.to_owned(),
        socket_mode: v1::SocketMode::Bind as i32,
        ..v1::RegisterWorkerRequest::default()
    };
    let h = start(ServerConfig::default()).await;
    let mut client = authed(&h.url, None).await;
    for endpoint in [
        "tcp://0.0.0.0:*",
        "tcp://*:*",
        "tcp://eth0:*",
        "tcp://[::]:*",
    ] {
        let status = client
            .raw()
            .register_worker(bind(1, endpoint))
            .await
            .expect_err(endpoint);
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(
            status.message().contains("binds on loopback only"),
            "{status:?}"
        );
    }
    client
        .raw()
        .register_worker(bind(2, "tcp://127.0.0.1:*"))
        .await
        .expect("a loopback bind");
    h.server.shutdown().await;

    let h = start(ServerConfig {
        allow_unauthenticated: true,
        ..ServerConfig::default()
    })
    .await;
    let mut client = authed(&h.url, None).await;
    client
        .raw()
        .register_worker(bind(3, "tcp://0.0.0.0:*"))
        .await
        .expect("allowed");
    h.server.shutdown().await;

    // A bind beyond loopback recorded in the data directory's snapshot (registered while the
    // server authenticated) is not bound again by a restart without authentication: its rank
    // stays unfed, saying why.
    let dir = temp_dir("bind-restore");
    let persistence = Some(kvatlas_server::Persistence {
        data_dir: dir.join("data"),
        interval: None,
    });
    let h = start(ServerConfig {
        auth_tokens: Some(token_file(&dir)),
        persistence: persistence.clone(),
        ..ServerConfig::default()
    })
    .await;
    let mut admin = authed(&h.url, Some("admin-0123456789abcdef")).await;
    admin
        .raw()
        .register_worker(bind(4, "tcp://0.0.0.0:*"))
        .await
        .expect("an authenticated server binds anywhere");
    h.server.shutdown().await;
    let h = start(ServerConfig {
        persistence,
        ..ServerConfig::default()
    })
    .await;
    let mut client = authed(&h.url, None).await;
    let workers = client
        .raw()
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("listed")
        .into_inner()
        .workers;
    let rank = workers
        .iter()
        .find(|w| w.instance_id == 4)
        .expect("the recorded rank is listed");
    assert!(
        rank.last_error
            .contains("binds registrations on loopback only"),
        "{rank:?}"
    );
    h.server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_addresses_without_auth_are_refused_at_start() {
    let config = ServerConfig {
        grpc_addr: "0.0.0.0:0".parse().expect("addr"),
        ..ServerConfig::ephemeral()
    };
    let error = RunningServer::start(config).await.expect_err("refused");
    assert!(
        error.to_string().contains("refusing to listen on 0.0.0.0"),
        "{error}"
    );
    let config = ServerConfig {
        auth_tokens: Some("/nonexistent/tokens".into()),
        ..ServerConfig::ephemeral()
    };
    let error = RunningServer::start(config)
        .await
        .expect_err("no token file");
    assert!(error.to_string().contains("/nonexistent/tokens"), "{error}");
}

/// Calls the unary `Query` at `url` with a request body that never sends its message; its
/// answer, which must come within `wait_secs`.
async fn query_without_its_message(
    url: &str,
    wait_secs: u64,
) -> Result<tonic::Response<v1::QueryResponse>, tonic::Status> {
    let channel = tonic::transport::Channel::from_shared(url.to_owned())
        .expect("a url")
        .connect()
        .await
        .expect("connects");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    tokio::time::timeout(
        std::time::Duration::from_secs(wait_secs),
        grpc.client_streaming(
            tonic::Request::new(tokio_stream::pending::<v1::QueryRequest>()),
            tonic::codegen::http::uri::PathAndQuery::from_static("/kvatlas.v1.Indexer/Query"),
            kvatlas_proto::codec::Codec::<v1::QueryRequest, v1::QueryResponse>::default(),
        ),
    )
    .await
    .expect("answered without its message")
}

/// A server of one concurrent request, its place held by an open `QueryStream`: the server, the
/// stream's sender (dropped, the stream ends) and its answers.
async fn one_place_held_by_a_stream() -> (
    Harness,
    tokio::sync::mpsc::Sender<v1::QueryRequest>,
    tonic::Streaming<v1::QueryStreamResponse>,
) {
    let config = ServerConfig {
        limits: Limits {
            max_concurrent_requests: 1,
            ..Limits::default()
        },
        ..ServerConfig::default()
    };
    let mut h = start(config).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<v1::QueryRequest>(1);
    let stream = h
        .client
        .query_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream opens")
        .into_inner();
    (h, tx, stream)
}

/// A request beyond the concurrency limit is shed from its headers, before its message is read:
/// a unary `Query` whose message never comes is answered RESOURCE_EXHAUSTED at once. (The limit
/// was checked by the handler, after the whole message was read and decoded: a burst of
/// requests of `--max-message-bytes` each was held in memory in full before being shed, and
/// this request waited for its message until its deadline.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beyond_the_limit_is_shed_before_its_message_is_read() {
    let (h, tx, mut stream) = one_place_held_by_a_stream().await;
    let status = query_without_its_message(&h.url, 5)
        .await
        .expect_err("shed");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("limit of 1 concurrent"),
        "{status:?}"
    );
    let (_, body) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(
        metric(&body, "kvatlas_requests_shed_total{rpc=\"Query\"}"),
        Some(1.0),
        "{body}"
    );
    drop(tx);
    assert!(stream.message().await.expect("ends cleanly").is_none());
    h.server.shutdown().await;
}

/// A request whose body stalls gives its place back after `--stall-timeout-secs`: over HTTP a
/// POST that declared a body and sent none, over gRPC a unary call whose message never comes.
/// (The place was held until the client closed the connection: as many stalled uploads as
/// places filled both APIs for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_body_stalls_gives_its_place_back() {
    let config = ServerConfig {
        limits: Limits {
            max_concurrent_requests: 1,
            stall_timeout: std::time::Duration::from_secs(1),
            ..Limits::default()
        },
        ..ServerConfig::default()
    };
    let h = start(config).await;
    let http = h.server.http_addr();
    let stalled = tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(http).expect("connect");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .expect("timeout");
        std::io::Write::write_all(
            &mut stream,
            b"POST /query HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
              content-length: 100\r\n\r\n{\"token",
        )
        .expect("send");
        let mut response = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stream, &mut response);
        String::from_utf8_lossy(&response).into_owned()
    });
    let answer = stalled.await.expect("joined");
    assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
    assert_eq!(http_get(http, "/workers", None).0, 200, "the place is free");

    let status = query_without_its_message(&h.url, 20)
        .await
        .expect_err("stalled");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("stalled"), "{status:?}");
    h.client
        .clone()
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("the place is free");
    h.server.shutdown().await;
}

/// An HTTP connection that sends nothing, whose request headers stall (no token checked yet), or
/// that stays idle between requests, is closed after `--stall-timeout-secs`: it held a task, a
/// descriptor and its header buffer for good, however many a client opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_connection_whose_headers_stall_is_closed() {
    let config = ServerConfig {
        limits: Limits {
            stall_timeout: std::time::Duration::from_secs(1),
            ..Limits::default()
        },
        ..ServerConfig::default()
    };
    let h = start(config).await;
    let http = h.server.http_addr();
    let sent = [
        // Nothing at all (hyper waits for the first bytes to tell HTTP/1.1 from HTTP/2).
        &b""[..],
        // Half a request line.
        &b"POST /query HTTP/1.1\r\nx-padding: "[..],
        // A whole request, the connection kept alive, then nothing.
        &b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n"[..],
    ];
    for sent in sent {
        let answer = answer_until_closed(http, sent).await;
        if sent.starts_with(b"GET") {
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        }
    }
    h.server.shutdown().await;
}

/// What the server sends on a connection to `to` on which `sent` was written, until it closes
/// the connection (a reset counts as closed); fails if it is still open 20 s on.
async fn answer_until_closed(to: std::net::SocketAddr, sent: &'static [u8]) -> String {
    tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(to).expect("connect");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .expect("timeout");
        std::io::Write::write_all(&mut stream, sent).expect("send");
        let mut response = Vec::new();
        match std::io::Read::read_to_end(&mut stream, &mut response) {
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("the connection stayed open 20 s after sending {sent:?}: {error}")
            }
            _ => String::from_utf8_lossy(&response).into_owned(),
        }
    })
    .await
    .expect("joined")
}

/// A gRPC connection that sends nothing, or part of HTTP/2's preface, is closed after
/// `--stall-timeout-secs`: HTTP/2's pings start after the preface, and it held a task and a
/// descriptor for good, before any token was checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_connection_without_its_preface_is_closed() {
    let config = ServerConfig {
        limits: Limits {
            stall_timeout: std::time::Duration::from_secs(1),
            ..Limits::default()
        },
        ..ServerConfig::default()
    };
    let mut h = start(config).await;
    let grpc = h.server.grpc_addr();
    for sent in [&b""[..], &b"PRI * HTTP/2.0\r\n"[..]] {
        answer_until_closed(grpc, sent).await;
    }
    // A client that sends its preface in time is served.
    h.client
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("served");
    h.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_concurrency_limit_are_shed() {
    let (mut h, tx, mut stream) = one_place_held_by_a_stream().await;
    let status = h
        .client
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect_err("shed");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("limit of 1 concurrent"),
        "{status:?}"
    );
    // The HTTP routes share the limit; liveness, readiness and metrics still answer.
    let http = h.server.http_addr();
    let query = r#"{"token_ids":[1,2,3,4],"model_name":"m"}"#;
    let (code, text) = http_post_json(http, "/query", query);
    assert_eq!(code, 429, "{text}");
    assert!(text.contains("limit of 1 concurrent"), "{text}");
    assert_eq!(http_get(http, "/workers", None).0, 429);
    for open in ["/health", "/ready", "/metrics"] {
        assert_eq!(http_get(http, open, None).0, 200, "{open}");
    }
    drop(tx);
    assert!(stream.message().await.expect("ends cleanly").is_none());
    let mut client = h.client.clone();
    wait_until("the place to be free", || {
        let mut client = client.clone();
        async move {
            client
                .list_indexes(v1::ListIndexesRequest::default())
                .await
                .is_ok()
        }
    })
    .await;
    let (_, body) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(
        metric(&body, "kvatlas_requests_shed_total{rpc=\"ListIndexes\"}"),
        Some(1.0),
        "{body}"
    );
    for route in ["/query", "/workers"] {
        assert_eq!(
            metric(
                &body,
                &format!("kvatlas_http_requests_total{{route=\"{route}\",status=\"429\"}}")
            ),
            Some(1.0),
            "{route}: {body}"
        );
    }
    // Once the place is free, HTTP requests are served again (and give it back), and an answer
    // of known length keeps its content-length (holding the place does not make it chunked).
    for _ in 0..3 {
        let mut stream = std::net::TcpStream::connect(http).expect("connect");
        std::io::Write::write_fmt(
            &mut stream,
            format_args!("GET /workers HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n"),
        )
        .expect("send");
        let mut response = String::new();
        std::io::Read::read_to_string(&mut stream, &mut response).expect("read");
        let head = response
            .split("\r\n\r\n")
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("content-length:"), "{head}");
        assert!(!head.contains("chunked"), "{head}");
    }
    // Answers are counted under their route and status, not only the refusals.
    let (_, body) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(
        metric(
            &body,
            "kvatlas_http_requests_total{route=\"/workers\",status=\"200\"}"
        ),
        Some(3.0),
        "{body}"
    );
    let _ = client.list_indexes(v1::ListIndexesRequest::default()).await;
}

/// A token's share of the concurrency: a token with `max_requests=1` that holds an open stream
/// is refused its next request (gRPC and HTTP), while another token is served; tokens without
/// a line of their own get `--max-requests-per-token` each; a freed place is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_holds_at_most_its_share_of_the_requests() {
    let dir = temp_dir("quota");
    let tokens = dir.join("tokens");
    std::fs::write(
        &tokens,
        "router-0123456789abcdef name=router max_requests=1
         team-a-0123456789abcdef name=team-a tenants=a
         team-b-0123456789abcdef name=team-b tenants=b
",
    )
    .expect("write tokens");
    let h = start(ServerConfig {
        auth_tokens: Some(tokens),
        limits: Limits {
            max_requests_per_token: Some(2),
            ..Limits::default()
        },
        ..ServerConfig::default()
    })
    .await;
    let http = h.server.http_addr();
    let list = v1::ListIndexesRequest::default;
    async fn open_stream(
        client: &mut Client,
    ) -> (
        tokio::sync::mpsc::Sender<v1::QueryRequest>,
        tonic::Streaming<v1::QueryStreamResponse>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel::<v1::QueryRequest>(1);
        let stream = client
            .raw()
            .query_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("stream opens")
            .into_inner();
        (tx, stream)
    }

    let mut router = authed(&h.url, Some("router-0123456789abcdef")).await;
    let held = open_stream(&mut router).await;
    let status = router
        .raw()
        .list_indexes(list())
        .await
        .expect_err("its share is held");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("\"router\" holds its limit of 1"),
        "{status:?}"
    );
    let (code, text) = http_get(http, "/workers", Some("router-0123456789abcdef"));
    assert_eq!(code, 429, "{text}");
    // Other tokens are served: team-a has two places of its own (the server-wide default).
    let mut team_a = authed(&h.url, Some("team-a-0123456789abcdef")).await;
    let second = open_stream(&mut team_a).await;
    team_a
        .raw()
        .list_indexes(list())
        .await
        .expect("its second place");
    let third = open_stream(&mut team_a).await;
    let status = team_a
        .raw()
        .list_indexes(list())
        .await
        .expect_err("two held");
    assert_eq!(status.code(), Code::ResourceExhausted);
    let mut team_b = authed(&h.url, Some("team-b-0123456789abcdef")).await;
    team_b
        .raw()
        .list_indexes(list())
        .await
        .expect("team-b has its own two");

    // Closing the router's stream gives its place back.
    let (tx, mut stream) = held;
    drop(tx);
    assert!(stream.message().await.expect("ends cleanly").is_none());
    let router_raw = router.raw().clone();
    wait_until("the router's place to be free", || {
        let mut raw = router_raw.clone();
        async move { raw.list_indexes(list()).await.is_ok() }
    })
    .await;
    drop((second, third));
    let _ = std::fs::remove_dir_all(dir);
}

/// `--max-message-bytes` bounds what the server accepts, not its answers: a snapshot larger than
/// it comes back whole (its 1 MiB chunks failed with OUT_OF_RANGE in the trailers under any
/// smaller limit, the answer lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_larger_than_the_message_limit_are_sent() {
    let limit = 4096;
    let mut h = start(ServerConfig {
        limits: Limits {
            max_message_bytes: limit,
            ..Limits::default()
        },
        ..ServerConfig::default()
    })
    .await;
    // 8 ranks of 150 blocks each, every message under the limit.
    let messages: Vec<v1::PublishEventsRequest> = (0..8u64)
        .map(|instance| {
            let hashes = (0..150).map(|i| (instance << 40) ^ (i * 0x9E37_79B9));
            let locals = (0..150).map(|i| (instance << 32) + i);
            stored_blocks(MODEL, "", instance + 1, hashes.collect(), locals.collect())
        })
        .collect();
    h.client
        .publish_events(tokio_stream::iter(messages))
        .await
        .expect("applied");
    let mut stream = h
        .client
        .snapshot(v1::SnapshotRequest::default())
        .await
        .expect("snapshot")
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream
        .message()
        .await
        .expect("a chunk larger than the limit")
    {
        bytes.extend_from_slice(&chunk.data);
    }
    assert!(bytes.len() > limit, "{} bytes", bytes.len());
    let (_, images) = kvatlas_server::snapshot::read(&bytes[..]).expect("a valid snapshot");
    assert_eq!(images.len(), 1);
    let listed = h
        .client
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("listed")
        .into_inner();
    assert_eq!(listed.workers.len(), 8);
    h.server.shutdown().await;
}

/// A token revoked, or its tenants narrowed, while a `QueryStream` or a `PublishEvents` stream
/// is open takes effect at the stream's next message (before, an open stream kept the rights
/// it was opened with for as long as its connection lived).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_revoked_or_narrowed_reaches_its_open_streams() {
    let dir = temp_dir("revoked-streams");
    let tokens = dir.join("tokens");
    let (admin, team) = ("admin-0123456789abcdef", "team-0123456789abcdef");
    let write = |team_line: &str| {
        std::fs::write(&tokens, format!("{admin} name=admin\n{team_line}\n")).expect("write");
    };
    write(&format!("{team} name=team tenants=a,b"));
    let h = start(ServerConfig {
        auth_tokens: Some(tokens.clone()),
        // Only the test's reloads.
        reload_check: None,
        ..ServerConfig::default()
    })
    .await;
    let hasher = kvatlas_hash::BlockHasher::new(BLOCK).expect("size");
    let store = |tenant: &str, hash: u64, symbol: u64| {
        let tokens = prompt_tokens(&[symbol], BLOCK);
        let locals = hasher.local_hashes(&tokens).map(|l| l.get()).collect();
        stored_blocks(MODEL, tenant, 1, vec![hash], locals)
    };
    let admin_raw = authed(&h.url, Some(admin)).await.raw().clone();
    let matches = |symbol: u64| {
        let mut raw = admin_raw.clone();
        async move {
            raw.query(token_query(MODEL, "a", prompt_tokens(&[symbol], BLOCK)))
                .await
                .map_or(0, |answer| answer.into_inner().matches.len())
        }
    };

    // Both streams open with tenants a and b; each is used once.
    let mut team_client = authed(&h.url, Some(team)).await;
    let (query_tx, query_rx) = tokio::sync::mpsc::channel::<v1::QueryRequest>(1);
    let mut answers = team_client
        .raw()
        .query_stream(tokio_stream::wrappers::ReceiverStream::new(query_rx))
        .await
        .expect("stream opens")
        .into_inner();
    let (publish_tx, publish_rx) = tokio::sync::mpsc::channel::<v1::PublishEventsRequest>(1);
    let mut publisher = team_client.raw().clone();
    let published = tokio::spawn(async move {
        publisher
            .publish_events(tokio_stream::wrappers::ReceiverStream::new(publish_rx))
            .await
    });
    publish_tx.send(store("a", 1, 1)).await.expect("sends");
    wait_until("the first batch to be applied", || async {
        matches(1).await == 1
    })
    .await;
    let mut ask = async |tenant: &str| {
        query_tx
            .send(token_query(MODEL, tenant, prompt_tokens(&[1], BLOCK)))
            .await
            .expect("sends");
        answers.message().await
    };
    let outcome = |answer: Result<Option<v1::QueryStreamResponse>, tonic::Status>| match answer
        .expect("answered")
        .and_then(|a| a.outcome)
    {
        Some(v1::query_stream_response::Outcome::Response(_)) => Code::Ok,
        Some(v1::query_stream_response::Outcome::Error(e)) => Code::from(e.code as i32),
        None => Code::Unknown,
    };
    assert_ne!(
        outcome(ask("b").await),
        Code::PermissionDenied,
        "tenant b, before"
    );

    // Narrowed to tenant a: the open query stream may no longer ask tenant b.
    write(&format!("{team} name=team tenants=a"));
    h.server.reload().await;
    assert_eq!(
        outcome(ask("b").await),
        Code::PermissionDenied,
        "tenant b, after"
    );
    assert_eq!(outcome(ask("a").await), Code::Ok, "tenant a still");

    // Revoked: both streams end at once, though neither sends anything more (they ended at
    // their next message only: a quiet stream of a revoked token kept its places, and a
    // quiet publisher its ranks, until its client went away).
    write("");
    h.server.reload().await;
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), answers.message())
        .await
        .expect("the quiet query stream ends without a message")
        .expect_err("with an error");
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert!(ended.message().contains("revoked"), "{ended:?}");
    let refused = tokio::time::timeout(std::time::Duration::from_secs(10), published)
        .await
        .expect("the quiet publish stream ends without a message")
        .expect("joins")
        .expect_err("with an error");
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    // The status says what was applied (an unsequenced publisher resends the rest).
    assert!(
        refused
            .message()
            .contains("the token of this stream was revoked"),
        "{refused:?}"
    );
    assert!(
        refused
            .message()
            .contains("the 1 message(s) it sent were applied"),
        "{refused:?}"
    );
    drop((query_tx, publish_tx));
    assert_eq!(
        matches(1).await,
        1,
        "the message before the revocation was applied"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A client that asks for `/dump` and stops reading loses its request's place, and its
/// token's, with the stall timeout: with `max_requests=1`, its token is refused (429) while
/// the dump is being written and served again once the writing is abandoned, though the stalled
/// connection stays open; what the stalled client reads afterwards is a cut answer (no chunked
/// end), never a whole one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_dump_reader_gives_back_its_tokens_place() {
    use std::io::{Read as _, Write as _};

    let dir = temp_dir("stalled-dump");
    let tokens = dir.join("tokens");
    let token = "peer-0123456789abcdef";
    std::fs::write(&tokens, format!("{token} name=peer max_requests=1\n")).expect("write tokens");
    let h = start(ServerConfig {
        auth_tokens: Some(tokens),
        limits: Limits {
            stall_timeout: std::time::Duration::from_secs(2),
            ..Limits::default()
        },
        ..ServerConfig::default()
    })
    .await;
    // 600,000 blocks: their dump (about 40 MB of JSON) is far more than the answer's channel
    // (4 MiB) and the sockets' buffers (a few MiB each) hold.
    let batch = |b: u64| v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: 1,
        block_size: BLOCK,
        seq: Some(b + 1),
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: (0..10_000).map(|i| b * 10_000 + i + 1).collect(),
                local_hashes: (0..10_000).map(|i| (b * 10_000 + i) * 7 + 3).collect(),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    let mut client = authed(&h.url, Some(token)).await;
    client
        .raw()
        .publish_events(tokio_stream::iter((0..60).map(batch)))
        .await
        .expect("published");
    let http = h.server.http_addr();

    let mut stalled = std::net::TcpStream::connect(http).expect("connect HTTP");
    stalled
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("read timeout");
    write!(
        stalled,
        "GET /dump HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {token}\r\n\
         connection: close\r\n\r\n"
    )
    .expect("send");
    let mut head = [0u8; 12];
    stalled.read_exact(&mut head).expect("the answer starts");
    assert_eq!(&head, b"HTTP/1.1 200", "{}", String::from_utf8_lossy(&head));
    let (code, text) = http_get(http, "/workers", Some(token));
    assert_eq!(
        code, 429,
        "the dump being written holds the token's place: {text}"
    );

    wait_until(
        "the stalled dump to give back the token's place",
        || async { http_get(http, "/workers", Some(token)).0 == 200 },
    )
    .await;
    let mut rest = Vec::new();
    // The server closes the connection once it finds the answer abandoned (a reset is as good).
    let _ = stalled.read_to_end(&mut rest);
    assert!(
        !rest.ends_with(b"\r\n0\r\n\r\n"),
        "a stalled dump must not end as a whole answer"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_tell_what_happened() {
    let mut h = start(ServerConfig::default()).await;
    let engine = VllmPublisher::bind();
    register_engine(&mut h.client, (MODEL, BLOCK), 50, &engine).await;
    let batches = script(
        2,
        MODEL,
        &[Worker::new(1, 0), Worker::new(2, 0)],
        200,
        BLOCK,
    );
    let messages: Vec<_> = batches.iter().map(|b| b.message.clone()).collect();
    h.client
        .publish_events(tokio_stream::iter(messages))
        .await
        .expect("published");
    let mut reference = ReferenceIndex::new();
    let mut mutations = 0;
    for b in &batches {
        for m in &b.mutations {
            reference.apply(m);
            mutations += 1;
        }
    }
    let memberships: u32 = reference
        .snapshot()
        .workers
        .iter()
        .flat_map(|w| &w.blocks)
        .map(|b| b.tiers.bits().count_ones())
        .sum();
    for _ in 0..3 {
        h.client
            .query(token_query(MODEL, "", prompt_tokens(&[0, 0], BLOCK)))
            .await
            .expect("query");
    }
    let _ = h.client.query(token_query("nope", "", vec![1])).await;
    let (status, body) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(status, 200);
    let labels = "model=\"m\",tenant=\"default\"";
    for (series, value) in [
        (
            format!("kvatlas_events_applied_total{{{labels}}}"),
            f64::from(mutations),
        ),
        (
            format!("kvatlas_index_memberships{{{labels}}}"),
            f64::from(memberships),
        ),
        (
            format!("kvatlas_batches_total{{{labels},outcome=\"applied\"}}"),
            batches.len() as f64,
        ),
        (
            format!("kvatlas_listeners{{{labels},status=\"pending\"}}"),
            1.0,
        ),
        (
            "kvatlas_requests_total{rpc=\"Query\",code=\"OK\"}".into(),
            3.0,
        ),
        (
            "kvatlas_requests_total{rpc=\"Query\",code=\"NOT_FOUND\"}".into(),
            1.0,
        ),
        (
            "kvatlas_requests_total{rpc=\"PublishEvents\",code=\"OK\"}".into(),
            1.0,
        ),
        (
            "kvatlas_request_duration_seconds_count{rpc=\"Query\"}".into(),
            4.0,
        ),
        ("kvatlas_registered_ranks".into(), 3.0),
        ("kvatlas_ready".into(), 1.0),
        // The one ZMQ listener, on the one poller thread (the default).
        (
            "kvatlas_listener_thread_listeners{thread=\"0\"}".into(),
            1.0,
        ),
    ] {
        assert_eq!(metric(&body, &series), Some(value), "{series}\n{body}");
    }
    // Started, the listener was served at least once.
    let turns = metric(&body, "kvatlas_listener_thread_turns_total{thread=\"0\"}");
    assert!(turns.is_some_and(|t| t >= 1.0), "{turns:?}\n{body}");
    assert!(body.contains("# TYPE kvatlas_request_duration_seconds histogram"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_both_listeners() {
    let dir = temp_dir("tls");
    let (cert_pem, _) = write_certificate(&dir);
    let server = RunningServer::start(ServerConfig {
        tls: Some(TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }),
        ..ServerConfig::ephemeral()
    })
    .await
    .expect("starts with TLS");
    let url = format!("https://{}", server.grpc_addr());
    let mut client = Client::connect_with(
        &url,
        &ConnectOptions {
            ca_certificate_pem: Some(cert_pem.clone().into_bytes()),
            ..ConnectOptions::default()
        },
    )
    .await
    .expect("TLS client connects");
    client
        .raw()
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("a call over TLS");
    // Plaintext is not served.
    let plain = format!("http://{}", server.grpc_addr());
    if let Ok(mut plain) = Client::connect(&plain).await {
        plain
            .raw()
            .list_indexes(v1::ListIndexesRequest::default())
            .await
            .expect_err("plaintext against TLS");
    }
    // HTTPS on the HTTP listener.
    assert_eq!(
        https_get(server.http_addr(), &cert_pem, "/ready", None)
            .await
            .expect("TLS handshake"),
        (200, "ready\n".to_owned())
    );
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A GET over HTTPS trusting only `ca_pem`: the status and body, or the handshake's error.
async fn https_get(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    path: &str,
    token: Option<&str>,
) -> Result<(u16, String), std::io::Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("pem"))
        .expect("root");
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("tcp");
    let mut tls = connector
        .connect(ServerName::try_from("127.0.0.1").expect("name"), tcp)
        .await?;
    let authorization = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    tls.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: x\r\n{authorization}connection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .expect("write");
    let mut response = String::new();
    tls.read_to_string(&mut response).await.ok();
    Ok(parse_http(&response))
}

/// A self-signed certificate for 127.0.0.1 and its key written to `dir` (cert.pem, key.pem);
/// the certificate's and the key's PEM.
fn write_certificate(dir: &std::path::Path) -> (String, String) {
    let (files, cert) = self_signed_certificate(dir);
    (cert, std::fs::read_to_string(files.key).expect("read"))
}

/// A certificate rotated and a token file rewritten in place are in force without a restart
/// (SIGHUP and the periodic check call the same reload; the binary's test sends SIGHUP): new
/// handshakes on both listeners present the new certificate, a revoked token is refused on a
/// connection opened before, and files that became invalid are refused while what was in
/// force stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_and_token_file_are_served_without_a_restart() {
    use kvatlas_server::{ReloadOutcome, Reloaded};
    let dir = temp_dir("tls-reload");
    let (first_pem, first_key) = write_certificate(&dir);
    let tokens = dir.join("tokens");
    let (old, new) = ("old-token-0123456789", "new-token-0123456789");
    std::fs::write(&tokens, format!("{old} name=old\n")).expect("write");
    let server = RunningServer::start(ServerConfig {
        tls: Some(TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }),
        auth_tokens: Some(tokens.clone()),
        // Only the test's reloads (a periodic check could take the changes first).
        reload_check: None,
        ..ServerConfig::ephemeral()
    })
    .await
    .expect("starts with TLS");
    let url = format!("https://{}", server.grpc_addr());
    let client = |ca: &str, token: &str| {
        let options = ConnectOptions {
            ca_certificate_pem: Some(ca.as_bytes().to_vec()),
            token: Some(token.to_owned()),
            ..ConnectOptions::default()
        };
        let url = url.clone();
        async move { Client::connect_with(&url, &options).await }
    };
    let list = |mut client: Client| async move {
        client
            .raw()
            .list_indexes(v1::ListIndexesRequest::default())
            .await
            .map(|_| ())
    };
    let opened_before = client(&first_pem, old).await.expect("connects");
    list(opened_before.clone())
        .await
        .expect("the first pair and token");
    assert_eq!(
        server.reload().await,
        Reloaded {
            tokens: Some(ReloadOutcome::Unchanged),
            tls: Some(ReloadOutcome::Unchanged)
        }
    );

    let (second_pem, _) = write_certificate(&dir);
    std::fs::write(&tokens, format!("{new} name=new\n")).expect("write");
    assert_eq!(
        server.reload().await,
        Reloaded {
            tokens: Some(ReloadOutcome::Applied),
            tls: Some(ReloadOutcome::Applied)
        }
    );
    // The old token is refused, also on the connection opened before the reload.
    let refused = list(opened_before).await.expect_err("revoked");
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    // New handshakes present the new certificate: a client trusting only the first fails.
    if let Ok(stale) = client(&first_pem, new).await {
        list(stale)
            .await
            .expect_err("the first certificate is no longer presented");
    }
    list(client(&second_pem, new).await.expect("connects"))
        .await
        .expect("the second pair and the new token");
    assert!(
        https_get(server.http_addr(), &first_pem, "/ready", None)
            .await
            .is_err(),
        "HTTPS presents the new certificate too"
    );
    let (status, metrics) = https_get(server.http_addr(), &second_pem, "/metrics", Some(new))
        .await
        .expect("HTTPS with the second certificate");
    assert_eq!(status, 200, "{metrics}");
    for file in ["tokens", "tls"] {
        let series = format!("kvatlas_reloads_total{{file=\"{file}\",outcome=\"applied\"}}");
        assert_eq!(metric(&metrics, &series), Some(1.0), "{series}\n{metrics}");
    }

    // The first certificate's key with the second certificate, and a token file with a bad
    // line: both refused, saying why; the second pair and the new token stay in force.
    std::fs::write(dir.join("key.pem"), &first_key).expect("write");
    std::fs::write(&tokens, format!("{new}\nshort\n")).expect("write");
    let reloaded = server.reload().await;
    let said = |outcome: Option<ReloadOutcome>| match outcome {
        Some(ReloadOutcome::Refused(why)) => why,
        other => panic!("not refused: {other:?}"),
    };
    assert!(said(reloaded.tls).contains("cannot serve TLS"));
    assert!(said(reloaded.tokens).contains("line 2"));
    list(client(&second_pem, new).await.expect("connects"))
        .await
        .expect("what was in force stays");
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Reflection answers in both of its versions (grpcurl 1.8 and grpcio's reflection client speak
/// v1alpha; newer tools v1), without a token, listing every service served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_services_in_both_versions() {
    let dir = temp_dir("reflection");
    let h = start(ServerConfig {
        auth_tokens: Some(token_file(&dir)),
        ..ServerConfig::default()
    })
    .await;
    let channel = tonic::transport::Endpoint::from_shared(h.url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connects");
    let want = [
        "grpc.health.v1.Health",
        "indexer.v1.IndexerService",
        "kvatlas.v1.Indexer",
    ];
    // The two versions' types differ only in their module.
    macro_rules! listed_services {
        ($version:ident) => {{
            use tonic_reflection::pb::$version as r;
            let request = r::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(r::server_reflection_request::MessageRequest::ListServices(
                    String::new(),
                )),
            };
            let answer = r::server_reflection_client::ServerReflectionClient::new(channel.clone())
                .server_reflection_info(tokio_stream::iter([request]))
                .await
                .expect("reflection needs no token")
                .into_inner()
                .message()
                .await
                .expect("an answer")
                .expect("one answer");
            let Some(r::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
                answer.message_response
            else {
                panic!("not a service list: {answer:?}");
            };
            list.service
                .into_iter()
                .map(|s| s.name)
                .collect::<Vec<String>>()
        }};
    }
    for (version, names) in [
        ("v1", listed_services!(v1)),
        ("v1alpha", listed_services!(v1alpha)),
    ] {
        for name in want {
            assert!(
                names.iter().any(|n| n == name),
                "{version} lists {name}: {names:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `--busy-poll`: with its one runtime worker spinning instead of sleeping, the server still
/// runs every other task (the requests, the writers' acknowledgements), answers exactly, and
/// shuts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_busy_polling_server_answers_and_stops() {
    let mut h = start(ServerConfig {
        busy_poll: true,
        ..ServerConfig::default()
    })
    .await;
    let batches = script(5, MODEL, &[Worker::new(1, 0)], 40, BLOCK);
    publish_script(&mut h.client, &batches).await;
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    let mut rng = Rng(11);
    for _ in 0..20 {
        let (_, locals) = random_prompt(&mut rng, BLOCK);
        let answer = query_hashes(&mut h, MODEL, &locals).await;
        assert_eq!(
            answer_rows(&answer),
            reference_rows(&reference_answer(&reference, &locals))
        );
    }
    let report = tokio::time::timeout(std::time::Duration::from_secs(20), h.server.shutdown())
        .await
        .expect("the shutdown ends");
    assert_eq!(report.indexes.len(), 1);
}

/// A query's instance filter is bounded: each answer row is checked against it, so a filter of
/// millions of ids (a 16 MiB message) would stall a runtime thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_filter_beyond_its_bound_is_refused() {
    let mut h = start(ServerConfig::default()).await;
    let batches = script(2, MODEL, &[Worker::new(1, 0), Worker::new(2, 0)], 20, BLOCK);
    publish_script(&mut h.client, &batches).await;
    let query = |ids: Vec<u64>| {
        let mut request = token_query(MODEL, "", prompt_tokens(&[0, 1, 2], BLOCK));
        request.options = Some(v1::QueryOptions {
            instance_ids: ids,
            ..v1::QueryOptions::default()
        });
        request
    };
    let refused = h
        .client
        .query(query(vec![1; 4097]))
        .await
        .expect_err("4,097 ids are refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("at most 4096"), "{refused:?}");
    h.client
        .query(query(vec![1; 4096]))
        .await
        .expect("4,096 ids are answered");
    h.server.shutdown().await;
}
