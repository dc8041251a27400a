//! llm-d's `indexer.v1.IndexerService/GetPodScores` through a running server: a tokenizer.json
//! written here (a word-level vocabulary whose ids are known by construction, a BOS the
//! tokenizer adds, a truncation the server must switch off), workers registered with pod names
//! and fed over ZMQ in vLLM's format (one batch carrying another data-parallel rank), a worker
//! fed over `PublishEvents` with a host tier; the answers against the weights of the blocks each
//! worker was given, the pod filter, the errors, authentication, metrics, and pod names kept
//! across a restart.

mod common;

use std::path::{Path, PathBuf};

use common::{Harness, VllmEvent, VllmPublisher, http_get, metric, selector, start, wait_until};
use kvatlas_proto::llmd::indexer::v1::{
    GetPodScoresRequest, GetPodScoresResponse, indexer_service_client::IndexerServiceClient,
};
use kvatlas_proto::v1;
use kvatlas_server::{
    Limits, Persistence, RunningServer, ServerConfig, StartError, TokenizerError, TokenizerFile,
};
use tonic::Code;
use tonic::transport::Channel;

const MODEL: &str = "word-model";
const BLOCK: u32 = 4;
/// The id of the BOS token the tokenizer adds.
const BOS: u32 = 0;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvatlas-llmd-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A tokenizer.json: whitespace-split words `tN` with id N (2 ≤ N < 500), `<s>` (0) added in
/// front of every prompt, `<unk>` (1); a truncation to 8 tokens, which the server switches off.
fn write_tokenizer(dir: &Path) -> PathBuf {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<s>".into(), 0.into());
    vocab.insert("<unk>".into(), 1.into());
    for id in 2..500 {
        vocab.insert(format!("t{id}"), id.into());
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let bos = serde_json::json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0},
        "padding": null,
        "added_tokens": [special(0, "<s>"), special(1, "<unk>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer.to_string()).expect("write the tokenizer");
    path
}

/// The prompt whose tokens are `BOS, ids…`.
fn prompt_of(ids: &[u32]) -> String {
    ids.iter()
        .map(|id| format!("t{id}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn llmd_client(h: &Harness) -> IndexerServiceClient<Channel> {
    IndexerServiceClient::connect(h.url.clone())
        .await
        .expect("the llm-d client connects")
}

async fn scores(
    client: &mut IndexerServiceClient<Channel>,
    prompt: &str,
    model: &str,
    pods: &[&str],
) -> Result<Vec<(String, f64, Option<i32>)>, tonic::Status> {
    let answer: GetPodScoresResponse = client
        .get_pod_scores(GetPodScoresRequest {
            prompt: prompt.into(),
            model_name: model.into(),
            pod_identifiers: pods.iter().map(|p| (*p).to_owned()).collect(),
        })
        .await?
        .into_inner();
    Ok(answer
        .scores
        .into_iter()
        .map(|s| (s.pod, s.score, s.data_parallel_rank))
        .collect())
}

/// llm-d's weight of each block a worker was given (gpu 1.0, cpu 0.8), summed in order.
fn weighed(blocks: &[f64]) -> f64 {
    blocks.iter().sum()
}

async fn workers(h: &Harness) -> Vec<v1::WorkerInfo> {
    h.client
        .clone()
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner()
        .workers
}

fn register(instance_id: u64, endpoint: &str, pod: &str) -> v1::RegisterWorkerRequest {
    v1::RegisterWorkerRequest {
        index: selector(MODEL, ""),
        instance_id,
        block_size: BLOCK,
        endpoint: endpoint.into(),
        pod_name: pod.into(),
        ..v1::RegisterWorkerRequest::default()
    }
}

/// Publishes empty batches until the listener of `instance` has applied one (ZMQ's slow joiner).
async fn until_heard(h: &Harness, engine: &mut VllmPublisher, instance: u64) {
    wait_until("the listener to hear the engine", || {
        engine.publish(&[], None);
        async move {
            workers(h)
                .await
                .iter()
                .any(|w| w.instance_id == instance && w.status == v1::WorkerStatus::Active as i32)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_scored_with_llmds_weights() {
    let dir = scratch("scores");
    let tokenizer = write_tokenizer(&dir);
    let mut h = start(ServerConfig {
        tokenizers: vec![
            TokenizerFile::parse(&format!("{MODEL}={}", tokenizer.display())).expect("spec"),
            TokenizerFile::parse(&format!("unused-model={}", tokenizer.display())).expect("spec"),
        ],
        limits: Limits {
            max_query_tokens: 64,
            ..Limits::default()
        },
        ..ServerConfig::ephemeral()
    })
    .await;
    // The prompt: BOS and 23 words, 6 blocks of 4 tokens; its blocks are what engines store.
    let words: Vec<u32> = (10..33).collect();
    let tokens: Vec<u32> = std::iter::once(BOS).chain(words.iter().copied()).collect();
    let block = |i: usize| tokens[i * BLOCK as usize..(i + 1) * BLOCK as usize].to_vec();
    let run = |from: usize, to: usize| -> Vec<u32> { (from..to).flat_map(block).collect() };
    let prompt = prompt_of(&words);

    // Worker 1 (pod 10.0.0.1:8000): rank 0 holds 2 blocks; a batch carrying rank 1 stores 5.
    let mut engine1 = VllmPublisher::bind();
    h.client
        .register_worker(register(1, &engine1.endpoint, "10.0.0.1:8000"))
        .await
        .expect("registers");
    until_heard(&h, &mut engine1, 1).await;
    engine1.publish(
        &[VllmEvent::Stored {
            hashes: vec![101, 102],
            parent: None,
            tokens: run(0, 2),
            block_size: BLOCK,
        }],
        None,
    );
    engine1.publish(
        &[VllmEvent::Stored {
            hashes: vec![111, 112, 113, 114, 115],
            parent: None,
            tokens: run(0, 5),
            block_size: BLOCK,
        }],
        Some(1),
    );
    // Worker 2 (pod 10.0.0.2:8000): 3 blocks.
    let mut engine2 = VllmPublisher::bind();
    h.client
        .register_worker(register(2, &engine2.endpoint, "10.0.0.2:8000"))
        .await
        .expect("registers");
    until_heard(&h, &mut engine2, 2).await;
    engine2.publish(
        &[VllmEvent::Stored {
            hashes: vec![201, 202, 203],
            parent: None,
            tokens: run(0, 3),
            block_size: BLOCK,
        }],
        None,
    );
    // Worker 7, fed over PublishEvents, no pod name: 2 blocks on the device, 2 more on the host.
    let stored = |hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, tier| v1::KvEvent {
        event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
            parent_hash: parent,
            block_hashes: hashes,
            token_ids: tokens,
            tier: tier as i32,
            ..v1::BlocksStored::default()
        })),
    };
    let message = v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: 7,
        block_size: BLOCK,
        events: vec![
            stored(vec![701, 702], None, run(0, 2), v1::StorageTier::Device),
            stored(vec![703, 704], Some(702), run(2, 4), v1::StorageTier::Host),
        ],
        ..v1::PublishEventsRequest::default()
    };
    h.client
        .publish_events(tokio_stream::iter(vec![message]))
        .await
        .expect("published");

    let expected = vec![
        ("10.0.0.1:8000".to_owned(), weighed(&[1.0; 5]), Some(1)),
        ("7".to_owned(), weighed(&[1.0, 1.0, 0.8, 0.8]), Some(0)),
        ("10.0.0.2:8000".to_owned(), weighed(&[1.0; 3]), Some(0)),
    ];
    let mut client = llmd_client(&h).await;
    wait_until("the ZMQ batches to be applied", || {
        let mut client = client.clone();
        let (prompt, expected) = (prompt.clone(), expected.clone());
        async move { scores(&mut client, &prompt, MODEL, &[]).await.ok() == Some(expected) }
    })
    .await;

    // The filter keeps the named pods, in any case only those holding the first block.
    let filtered = scores(&mut client, &prompt, MODEL, &["7", "10.0.0.2:8000", "nope"])
        .await
        .expect("answers");
    assert_eq!(filtered, expected[1..].to_vec());
    // A prompt sharing 2 blocks, then diverging.
    let mut diverging = words.clone();
    diverging[10] = 400;
    let partial = scores(&mut client, &prompt_of(&diverging), MODEL, &[])
        .await
        .expect("answers");
    assert_eq!(
        partial,
        [
            ("10.0.0.1:8000".to_owned(), 2.0, Some(0)),
            ("10.0.0.2:8000".to_owned(), 2.0, Some(0)),
            ("7".to_owned(), 2.0, Some(0)),
        ]
    );
    // Nothing held, a prompt shorter than a block, an empty prompt, a model without an index:
    // empty answers, as llm-d gives.
    for (prompt, model) in [
        (prompt_of(&[300, 301, 302, 303]), MODEL),
        (prompt_of(&[10, 11]), MODEL),
        (String::new(), MODEL),
        (prompt.clone(), "unused-model"),
    ] {
        assert_eq!(
            scores(&mut client, &prompt, model, &[])
                .await
                .expect("answers"),
            [],
            "{prompt:?} {model}"
        );
    }

    // Errors a person can act on.
    let status = scores(&mut client, &prompt, "llama", &[])
        .await
        .expect_err("no tokenizer");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("--tokenizer llama=PATH"),
        "{status:?}"
    );
    let status = scores(&mut client, &prompt, "", &[])
        .await
        .expect_err("no model");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let long: Vec<u32> = (0..64).map(|i| 10 + i % 400).collect();
    let status = scores(&mut client, &prompt_of(&long), MODEL, &[])
        .await
        .expect_err("65 tokens");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("65 tokens"), "{status:?}");
    // A model with no index yet answers without tokenizing its prompt (llm-d's empty answer,
    // with no tokenizer's CPU and memory spent on it).
    assert_eq!(
        scores(&mut client, &prompt_of(&long), "unused-model", &[])
            .await
            .expect("answered untokenized"),
        []
    );
    let status = scores(&mut client, &"x".repeat(64 * 16 + 1), MODEL, &[])
        .await
        .expect_err("too many bytes");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // The registrations show their pod names; a different one is another registration.
    let listed = workers(&h).await;
    let pod = |instance: u64, rank: u32| {
        listed
            .iter()
            .find(|w| w.instance_id == instance && w.dp_rank == rank)
            .map(|w| w.pod_name.clone())
    };
    assert_eq!(pod(1, 0).as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(
        pod(1, 1).as_deref(),
        Some(""),
        "a batch's rank has no registration"
    );
    assert_eq!(pod(7, 0).as_deref(), Some(""));
    let status = h
        .client
        .register_worker(register(2, &engine2.endpoint, "10.0.0.9:8000"))
        .await
        .expect_err("another pod name");
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    let status = h
        .client
        .register_worker(register(3, &engine2.endpoint, " "))
        .await
        .expect_err("a blank pod name");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let (code, text) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(code, 200);
    assert!(
        metric(
            &text,
            "kvatlas_requests_total{rpc=\"GetPodScores\",code=\"OK\"}"
        )
        .is_some_and(|n| n >= 7.0),
        "{text}"
    );
    assert!(
        metric(
            &text,
            "kvatlas_requests_total{rpc=\"GetPodScores\",code=\"FAILED_PRECONDITION\"}"
        ) == Some(1.0),
        "{text}"
    );
    h.server.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_pod_scores_needs_a_token_for_the_default_tenant() {
    let dir = scratch("auth");
    let tokenizer = write_tokenizer(&dir);
    let tokens = dir.join("tokens");
    std::fs::write(
        &tokens,
        "all-tenants-token-0123456789\nother-tenant-token-0123456789 tenants=other\n",
    )
    .expect("tokens");
    let h = start(ServerConfig {
        tokenizers: vec![
            TokenizerFile::parse(&format!("{MODEL}={}", tokenizer.display())).expect("spec"),
        ],
        auth_tokens: Some(tokens),
        ..ServerConfig::ephemeral()
    })
    .await;
    let mut client = llmd_client(&h).await;
    let status = scores(&mut client, "t10", MODEL, &[])
        .await
        .expect_err("no token");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let call = |token: &str| {
        let mut request = tonic::Request::new(GetPodScoresRequest {
            prompt: "t10 t11 t12 t13".into(),
            model_name: MODEL.into(),
            pod_identifiers: Vec::new(),
        });
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {token}").parse().expect("header"),
        );
        request
    };
    let status = client
        .get_pod_scores(call("other-tenant-token-0123456789"))
        .await
        .expect_err("another tenant's token");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let answer = client
        .get_pod_scores(call("all-tenants-token-0123456789"))
        .await
        .expect("answers")
        .into_inner();
    assert!(answer.scores.is_empty());
    h.server.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_that_cannot_be_loaded_stops_the_start() {
    let dir = scratch("bad");
    let missing = dir.join("missing.json");
    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, "{\"model\": 3}").expect("write");
    for (path, kind) in [(&missing, "read"), (&garbage, "parse")] {
        let error = RunningServer::start(ServerConfig {
            tokenizers: vec![TokenizerFile {
                model: MODEL.into(),
                path: path.clone(),
            }],
            ..ServerConfig::ephemeral()
        })
        .await
        .expect_err("refused");
        let message = error.to_string();
        assert!(
            message.contains(MODEL) && message.contains(&path.display().to_string()),
            "{message}"
        );
        match (kind, &error) {
            ("read", StartError::Tokenizer(TokenizerError::Read { .. }))
            | ("parse", StartError::Tokenizer(TokenizerError::Parse { .. })) => {}
            _ => panic!("{kind}: {error:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_names_survive_a_restart() {
    let dir = scratch("restart");
    let config = || ServerConfig {
        persistence: Some(Persistence {
            data_dir: dir.join("data"),
            interval: None,
        }),
        ..ServerConfig::ephemeral()
    };
    let mut h = start(config()).await;
    // Nobody publishes there: the listener stays pending, its registration is recorded.
    h.client
        .register_worker(register(4, "tcp://127.0.0.1:9", "10.0.0.4:8000"))
        .await
        .expect("registers");
    let report = h.server.shutdown().await;
    assert!(matches!(report.snapshot, Some(Ok(_))), "{report:?}");
    let h = start(config()).await;
    let listed = workers(&h).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].pod_name, "10.0.0.4:8000");
    h.server.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
