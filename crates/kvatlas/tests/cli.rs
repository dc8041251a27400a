//! The `kvatlas` binary as an operator uses it: `serve` on ephemeral loopback ports, the client
//! commands against it (tables, `--json`, exit codes and the server's message on failure), a
//! config file, the safety refusal, and SIGTERM with the final per-index summary.

mod common;

use std::io::Write;
use std::process::{Command, Output, Stdio};

use common::{BIN, Served, publish};

use kvatlas_hash::BlockHasher;
use kvatlas_index::{
    ExternalBlockHash, KvIndex, Mutation, ReferenceIndex, StoredBlock, Tier, Worker,
};
use kvatlas_proto::v1;

const BLOCK: u32 = 4;

fn kvatlas(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvatlas runs");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write stdin");
    } else {
        drop(child.stdin.take());
    }
    child.wait_with_output().expect("exits")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn tokens(symbols: &[u32]) -> Vec<u32> {
    symbols
        .iter()
        .enumerate()
        .flat_map(|(i, &s)| (0..BLOCK).map(move |j| s * 1000 + i as u32 * 10 + j))
        .collect()
}

/// Worker `w` stores the blocks of `symbols`; returns the message and its mutation.
fn store(worker: u64, symbols: &[u32]) -> (v1::PublishEventsRequest, Mutation) {
    let hasher = BlockHasher::new(BLOCK).expect("size");
    let locals: Vec<_> = hasher.local_hashes(&tokens(symbols)).collect();
    let hashes: Vec<u64> = (0..symbols.len() as u64)
        .map(|i| worker * 100 + i)
        .collect();
    let message = v1::PublishEventsRequest {
        index: Some(v1::IndexSelector {
            model: "m".into(),
            tenant: String::new(),
        }),
        instance_id: worker,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: hashes.clone(),
                token_ids: tokens(symbols),
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    };
    let mutation = Mutation::Stored {
        worker: Worker::new(worker, 0),
        tier: Tier::Device,
        parent: None,
        blocks: hashes
            .iter()
            .zip(locals)
            .map(|(&h, local)| StoredBlock {
                external: ExternalBlockHash::new(h),
                local,
            })
            .collect(),
    };
    (message, mutation)
}

#[test]
fn serve_query_list_register_and_stop() {
    let served = Served::start(&[]);
    let server = served.grpc.clone();
    let (m1, s1) = store(1, &[1, 2, 3]);
    let (m2, s2) = store(2, &[1, 2]);
    publish(&server, vec![m1, m2]);

    // A table by default, from a file or stdin.
    let dir = std::env::temp_dir().join(format!("kvatlas-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let prompt = tokens(&[1, 2, 3, 4]);
    let listed: Vec<String> = prompt.iter().map(u32::to_string).collect();
    std::fs::write(dir.join("prompt.txt"), listed.join(" ")).expect("write");
    let path = dir.join("prompt.txt").display().to_string();
    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "m", "--tokens", &path,
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.contains("block size 4, prompt 4 blocks"), "{table}");
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip_while(|l| !l.starts_with("INSTANCE"))
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        [
            ["1", "0", "3", "3", "3", "12"],
            ["2", "0", "2", "2", "2", "8"]
        ]
    );

    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "m", "--tokens", "-", "--json", "--top-k", "1",
        ],
        Some(&format!("[{}]", listed.join(","))),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["matches"].as_array().map(Vec::len), Some(1));
    assert_eq!(json["matches"][0]["instance_id"], 1);
    assert_eq!(json["matches"][0]["matched_tokens"], 12);
    assert_eq!(json["events_applied"], 2);

    // Local hashes, as a router computes them.
    let hasher = BlockHasher::new(BLOCK).expect("size");
    let hashes: Vec<String> = hasher
        .local_hashes(&prompt)
        .map(|h| format!("{:#x}", h.get()))
        .collect();
    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "m", "--hashes", "-", "--json",
        ],
        Some(&hashes.join("\n")),
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["matches"].as_array().map(Vec::len), Some(2));

    // A failed query exits non-zero with the server's message.
    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "nope", "--tokens", &path,
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    let error = text(&out.stderr);
    assert!(
        error.contains("NOT_FOUND") && error.contains("no index for model \"nope\""),
        "{error}"
    );
    // Bad input is a usage error.
    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "m", "--tokens", "-",
        ],
        Some("1 2 x"),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("\"x\" is not a token id"));
    // So is a file that cannot be read, as the exit codes promise (it exited 1, as a failure
    // of the server's).
    let missing = dir.join("missing.txt").display().to_string();
    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "m", "--tokens", &missing,
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("missing.txt"));
    let out = kvatlas(&["serve", "--config", &missing], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));

    // Register, list, unregister.
    let out = kvatlas(
        &[
            "register",
            "--server",
            &server,
            "--model",
            "m",
            "--instance-id",
            "9",
            "--block-size",
            "4",
            "--endpoint",
            "tcp://127.0.0.1:9",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("worker 9 rank 0 registered"));
    let out = kvatlas(
        &[
            "register",
            "--server",
            &server,
            "--model",
            "m",
            "--instance-id",
            "10",
            "--block-size",
            "8",
            "--endpoint",
            "tcp://127.0.0.1:9",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("FAILED_PRECONDITION"),
        "{}",
        text(&out.stderr)
    );
    let out = kvatlas(&["workers", "--server", &server, "--json"], None);
    let workers: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let sources: Vec<_> = workers
        .as_array()
        .expect("array")
        .iter()
        .map(|w| {
            (
                w["instance_id"].as_u64(),
                w["source"].as_str().map(str::to_owned),
            )
        })
        .collect();
    assert_eq!(
        sources,
        [
            (Some(1), Some("grpc".to_owned())),
            (Some(2), Some("grpc".to_owned())),
            (Some(9), Some("zmq".to_owned())),
        ]
    );
    let out = kvatlas(&["workers", "--server", &server], None);
    assert!(text(&out.stdout).contains("tcp://127.0.0.1:9"));
    let out = kvatlas(&["indexes", "--server", &server], None);
    let indexes = text(&out.stdout);
    assert!(
        indexes.lines().nth(1).is_some_and(|l| l.starts_with("m ")),
        "{indexes}"
    );
    let out = kvatlas(
        &[
            "unregister",
            "--server",
            &server,
            "--model",
            "m",
            "--instance-id",
            "2",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("1 rank(s) removed"),
        "{}",
        text(&out.stdout)
    );

    // /health over HTTP while serving.
    let mut http = std::net::TcpStream::connect(&served.http).expect("http");
    http.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .expect("write");
    let mut response = String::new();
    std::io::Read::read_to_string(&mut http, &mut response).expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    // SIGTERM: a clean exit and the summary of what the index held.
    let (status, stdout) = served.terminate();
    assert!(status.success(), "{status:?}");
    let mut reference = ReferenceIndex::new();
    reference.apply(&s1);
    reference.apply(&s2);
    reference.remove_worker(2);
    let digest = format!("digest {:#018x}", reference.snapshot().digest());
    assert!(
        stdout.contains("index model=m tenant=default: 3 memberships"),
        "{stdout}"
    );
    assert!(stdout.contains(&digest), "{stdout}\nwanted {digest}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A query of more token ids than `--max-query-tokens` is refused with the server's message,
/// decoded only up to the limit (the process's codec is bounded by it); on a `QueryStream` that
/// query alone is refused and the stream goes on.
#[test]
fn a_query_over_the_token_limit_is_refused_before_decoding() {
    let served = Served::start(&["--max-query-tokens", "8"]);
    let server = served.grpc.clone();
    publish(&server, vec![store(1, &[1, 2]).0]);
    let twenty: String = (1..=20).map(|t| format!("{t} ")).collect();
    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "m", "--tokens", "-",
        ],
        Some(&twenty),
    );
    assert_eq!(out.status.code(), Some(1));
    let error = text(&out.stderr);
    assert!(
        error.contains("INVALID_ARGUMENT")
            && error.contains("the prompt has more than 8 tokens; this server accepts at most 8"),
        "{error}"
    );
    // At the limit, the query is answered.
    let at_limit: String = tokens(&[1, 2]).iter().map(|t| format!("{t} ")).collect();
    let out = kvatlas(
        &[
            "query", "--server", &server, "--model", "m", "--tokens", "-",
        ],
        Some(&at_limit),
    );
    assert!(out.status.success(), "{out:?}");

    // On a stream: the query over the limit gets its error, the next its answer.
    let query = |request_id: u64, ids: Vec<u32>| v1::QueryRequest {
        index: Some(v1::IndexSelector {
            model: "m".into(),
            tenant: String::new(),
        }),
        input: Some(v1::query_request::Input::Tokens(v1::TokenIds { ids })),
        request_id,
        ..v1::QueryRequest::default()
    };
    let answers: Vec<v1::QueryStreamResponse> = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            let mut client = v1::indexer_client::IndexerClient::connect(server.clone())
                .await
                .expect("connects");
            let requests = vec![query(1, (1..=20).collect()), query(2, tokens(&[1, 2]))];
            let mut answers = client
                .query_stream(tokio_stream::iter(requests))
                .await
                .expect("stream opened")
                .into_inner();
            let mut all = Vec::new();
            while let Some(answer) = answers.message().await.expect("the stream goes on") {
                all.push(answer);
            }
            all
        });
    assert_eq!(answers.len(), 2, "{answers:?}");
    match &answers[0] {
        v1::QueryStreamResponse {
            request_id: 1,
            outcome: Some(v1::query_stream_response::Outcome::Error(error)),
        } => {
            assert_eq!(error.code, 3, "{error:?}");
            assert!(error.message.contains("more than 8 tokens"), "{error:?}");
        }
        other => panic!("expected query 1's error, got {other:?}"),
    }
    match &answers[1] {
        v1::QueryStreamResponse {
            request_id: 2,
            outcome: Some(v1::query_stream_response::Outcome::Response(answer)),
        } => assert_eq!(answer.matches.len(), 1, "{answer:?}"),
        other => panic!("expected query 2's answer, got {other:?}"),
    }

    // Dynamo's routes: a JSON list over the limit is kept only up to the limit + 1 and refused;
    // one at the limit is answered.
    let post = |path: &str, body: &str| -> String {
        let mut http = std::net::TcpStream::connect(&served.http).expect("http");
        write!(
            http,
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .expect("write");
        let mut response = String::new();
        std::io::Read::read_to_string(&mut http, &mut response).expect("read");
        response
    };
    let twenty: Vec<u64> = (1..=20).collect();
    let at_limit: Vec<u64> = tokens(&[1, 2]).into_iter().map(u64::from).collect();
    let two_blocks: Vec<u64> = BlockHasher::new(BLOCK)
        .expect("size")
        .local_hashes(&tokens(&[1, 2]))
        .map(|h| h.get())
        .collect();
    // Worker 1 holds both blocks: a prompt cut by one id would score 4 tokens, not 8.
    let whole = r#""scores":{"1":{"0":8}}"#;
    let cases = [
        (
            "/query",
            "token_ids",
            &twenty,
            "HTTP/1.1 400",
            "the prompt has more than 8 tokens; this server accepts at most 8",
        ),
        ("/query", "token_ids", &at_limit, "HTTP/1.1 200", whole),
        (
            "/query_by_hash",
            "block_hashes",
            &twenty,
            "HTTP/1.1 400",
            "the prompt has more than 8 blocks of 4 tokens; this server accepts at most 8",
        ),
        (
            "/query_by_hash",
            "block_hashes",
            &two_blocks,
            "HTTP/1.1 200",
            whole,
        ),
    ];
    for (path, field, ids, status, needle) in cases {
        let ids = serde_json::to_string(ids).expect("json");
        let response = post(path, &format!(r#"{{"model_name":"m","{field}":{ids}}}"#));
        assert!(
            response.starts_with(status) && response.contains(needle),
            "{path} {ids}: {response}"
        );
    }

    let (status, _) = served.terminate();
    assert!(status.success(), "{status:?}");
}

#[test]
fn serve_takes_a_config_file_and_refuses_unsafe_settings() {
    let dir = std::env::temp_dir().join(format!("kvatlas-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("serve.toml");
    std::fs::write(&file, "min_initial_workers = 3\nwriter_threads = 1\n").expect("write");
    let served = Served::start(&["--config", &file.display().to_string()]);
    let out = kvatlas(
        &[
            "query",
            "--server",
            &served.grpc,
            "--model",
            "m",
            "--tokens",
            "-",
        ],
        Some("1 2 3 4"),
    );
    assert_eq!(out.status.code(), Some(1));
    let error = text(&out.stderr);
    assert!(
        error.contains("UNAVAILABLE") && error.contains("0 of the 3"),
        "{error}"
    );
    let (status, _) = served.terminate();
    assert!(status.success());

    // A typo in the file, a public address without auth, a malformed --workers list.
    std::fs::write(&file, "min_initial_worker = 3\n").expect("write");
    let config = file.display().to_string();
    let cases: [(&[&str], i32, &str); 3] = [
        (&["serve", "--config", &config], 2, "min_initial_worker"),
        (
            &[
                "serve",
                "--grpc-addr",
                "0.0.0.0:0",
                "--http-addr",
                "127.0.0.1:0",
            ],
            2,
            "refusing to listen on 0.0.0.0:0 without authentication",
        ),
        (
            &[
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--workers",
                "1=tcp://h:1",
                "--block-size",
                "16",
                "--workers",
                "x",
            ],
            2,
            "",
        ),
    ];
    for (args, code, needle) in cases {
        let out = kvatlas(args, None);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(needle),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let out = kvatlas(
        &[
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--workers",
            "x=tcp://h:1",
            "--block-size",
            "16",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("the worker id is not an unsigned integer"));
    let _ = std::fs::remove_dir_all(dir);
}

/// One row of `kvatlas demo`'s summary table, by its routing name: the cells between `|`.
fn demo_row(table: &str, routing: &str) -> Vec<String> {
    table
        .lines()
        .find(|l| l.starts_with(&format!("| {routing} |")))
        .unwrap_or_else(|| panic!("no {routing} row in:\n{table}"))
        .split('|')
        .map(|c| c.trim().to_owned())
        .filter(|c| !c.is_empty())
        .collect()
}

#[test]
fn the_demo_runs_fleet_router_and_server_and_the_index_ends_equal_to_the_caches() {
    let plots = std::env::temp_dir().join(format!("kvatlas-demo-test-{}", std::process::id()));
    let plots_arg = plots.to_string_lossy().into_owned();
    let out = kvatlas(
        &[
            "demo",
            "--plots",
            &plots_arg,
            "--requests",
            "300",
            "--engines",
            "4",
            "--capacity",
            "256",
            "--rate",
            "3000",
        ],
        None,
    );
    assert!(out.status.success(), "demo failed: {}", text(&out.stderr));
    let table = text(&out.stdout);
    let percent = |cell: &str| -> f64 {
        cell.trim_end_matches(" %")
            .parse()
            .unwrap_or_else(|_| panic!("a hit rate, got {cell:?}"))
    };
    let mut hit_rates = Vec::new();
    for routing in ["random", "kv-aware"] {
        let row = demo_row(&table, routing);
        assert_eq!(row[1], "300", "every request routed: {row:?}");
        // "index blocks at the end (engines)": the index holds exactly the engines' caches.
        let (index, engines) = row[8]
            .split_once(" (")
            .unwrap_or_else(|| panic!("index (engines), got {:?}", row[8]));
        assert_eq!(index, engines.trim_end_matches(')'), "{routing}: {row:?}");
        assert_ne!(index, "0", "the engines published: {row:?}");
        hit_rates.push(percent(&row[6]));
    }
    assert!(
        hit_rates[1] >= hit_rates[0],
        "KV-aware routing reuses at least as much as random: {hit_rates:?}\n{table}"
    );
    // The plots need a TrueType font; where one is found, both are written.
    if table.contains("Plots: ") {
        for plot in ["hit-rate.svg", "query-latency.svg"] {
            assert!(plots.join(plot).is_file(), "{plot} written:\n{table}");
        }
    }
    let _ = std::fs::remove_dir_all(&plots);
}

#[test]
fn json_logs_are_one_object_per_line() {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(BIN)
        .args(["--log-format", "json", "serve"])
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .env_remove("KVATLAS_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvatlas serve starts");
    let stderr = child.stderr.take().expect("stderr");
    let mut logged = Vec::new();
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        let object: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("not a JSON object ({e}): {line}"));
        let serving = object["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("kvatlas serving: gRPC on 127.0.0.1:"));
        logged.push(object);
        if serving {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let last = logged.last().expect("something logged");
    assert_eq!(last["level"], "INFO", "{logged:?}");
    assert!(
        last["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("HTTP on 127.0.0.1:")),
        "the serving line, as JSON: {logged:?}"
    );
}

/// A request whose decoded form would take more than 16 bytes of memory per byte of the message
/// limit (here 4,096 bytes: 64 KiB) is refused before it is decoded, with what to change; a
/// message as long whose list is of one-byte integers, and one of ordinary removals, are applied.
#[test]
fn a_request_that_would_decode_to_too_much_memory_is_refused_before_decoding() {
    let served = Served::start(&["--max-message-bytes", "4096"]);
    let server = served.grpc.clone();
    // 1,800 empty events: 3,600 bytes on the wire, 259 KB in memory.
    let empty_events = v1::PublishEventsRequest {
        index: Some(v1::IndexSelector {
            model: "m".into(),
            tenant: String::new(),
        }),
        instance_id: 1,
        block_size: BLOCK,
        events: vec![v1::KvEvent { event: None }; 1_800],
        ..v1::PublishEventsRequest::default()
    };
    let removal = |block_hashes: Vec<u64>| v1::KvEvent {
        event: Some(v1::kv_event::Event::Removed(v1::BlocksRemoved {
            block_hashes,
            tier: 0,
        })),
    };
    // 4,070 one-byte block hashes in one removal: 33 KB in memory.
    let small_hashes = v1::PublishEventsRequest {
        events: vec![removal(vec![5; 4_070])],
        ..empty_events.clone()
    };
    // 250 removals of one 64-bit hash each (the densest event engines send): 38 KB.
    let removals = v1::PublishEventsRequest {
        events: (0..250u64).map(|i| removal(vec![u64::MAX - i])).collect(),
        ..empty_events.clone()
    };
    for applied in [&small_hashes, &removals] {
        let wire = prost::Message::encoded_len(applied);
        assert!((4_000..=4_096).contains(&wire), "{wire} bytes");
    }
    let wire = prost::Message::encoded_len(&empty_events);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut client = v1::indexer_client::IndexerClient::connect(server.clone())
            .await
            .expect("connects");
        let status = client
            .publish_events(tokio_stream::iter([empty_events]))
            .await
            .expect_err("refused");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        // The struct, the model name's byte and 1,800 events.
        let size = std::mem::size_of::<v1::PublishEventsRequest>()
            + 1
            + 1_800 * std::mem::size_of::<v1::KvEvent>();
        assert!(
            status.message().contains(&format!(
                "the kvatlas.v1.PublishEventsRequest message of {wire} bytes would take {size} \
                 bytes of memory once decoded; this server decodes at most 65536 per message"
            )) && status.message().contains("send fewer events per message"),
            "{status:?}"
        );
        let applied = client
            .publish_events(tokio_stream::iter([small_hashes, removals]))
            .await
            .expect("applied")
            .into_inner();
        assert_eq!(applied.messages_applied, 2, "{applied:?}");
    });
}

/// SIGHUP makes `serve` read its token file again: a token added works at once, a token taken
/// out is refused, and a file that became invalid is refused while the tokens in force stay.
#[test]
fn sighup_reloads_the_token_file() {
    let dir = std::env::temp_dir().join(format!("kvatlas-cli-hup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (old, new) = ("old-token-0123456789", "new-token-0123456789");
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("{old} name=old\n")).expect("write");
    // No periodic check: only the signal can make the server read the file again.
    let served = Served::start(&[
        "--auth-tokens",
        &tokens.display().to_string(),
        "--reload-check-secs",
        "0",
    ]);
    let lists_with = |token: &str| {
        let file = dir.join("client-token");
        std::fs::write(&file, token).expect("write");
        let out = kvatlas(
            &[
                "indexes",
                "--server",
                &served.grpc,
                "--token-file",
                &file.display().to_string(),
            ],
            None,
        );
        (out.status.success(), text(&out.stderr))
    };
    assert!(lists_with(old).0, "the token of the file at start");
    let (ok, said) = lists_with(new);
    assert!(!ok && said.contains("unknown bearer token"), "{said}");
    let hangup = || {
        let status = Command::new("kill")
            .args(["-HUP", &served.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    };
    let wait_for_log = |what: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let line = served
                .stderr
                .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
                .unwrap_or_else(|_| panic!("no log line with {what:?}"));
            if line.contains(what) {
                return line;
            }
        }
    };
    std::fs::write(&tokens, format!("{new} name=new\n")).expect("write");
    hangup();
    wait_for_log("reloaded the token file");
    assert!(lists_with(new).0, "the new token is in force");
    let (ok, said) = lists_with(old);
    assert!(
        !ok && said.contains("unknown bearer token"),
        "the old one is not: {said}"
    );

    // A file with a line that is not a token: refused, said, and the tokens stay.
    std::fs::write(&tokens, format!("{new} name=new\nshort\n")).expect("write");
    hangup();
    let line = wait_for_log("not reloaded");
    assert!(line.contains("line 2"), "{line}");
    assert!(lists_with(new).0, "the tokens in force stay");
    let (status, _) = served.terminate();
    assert!(status.success());
    let _ = std::fs::remove_dir_all(dir);
}

/// A client command whose reader went away (`kvatlas indexes | head -0`) exits 0 without a
/// panic: the output was wanted no further (`print!` panicked on the closed pipe, exit 101).
#[test]
fn a_closed_output_is_not_a_crash() {
    let served = Served::start(&[]);
    let mut child = Command::new(BIN)
        .args(["indexes", "--server", &served.grpc])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvatlas runs");
    // The reader is gone before the command has connected and answered.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("exits");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("panicked"),
        "{}",
        text(&out.stderr)
    );
    let (status, _) = served.terminate();
    assert!(status.success());
}

/// `KVATLAS_TOKENIZER` is a comma-separated list, `--tokenizer` one `MODEL=PATH` whose path may
/// hold a comma: the start fails on the first file that is missing, named whole.
#[test]
fn tokenizer_lists_are_split_in_the_environment_not_on_the_command_line() {
    let start = |args: &[&str], env: Option<&str>| {
        let mut command = Command::new(BIN);
        command
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
            ])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(list) = env {
            command.env("KVATLAS_TOKENIZER", list);
        }
        let out = command.output().expect("runs");
        assert!(!out.status.success());
        text(&out.stderr)
    };
    let said = start(&[], Some("a=/missing/a.json,b=/missing/b.json"));
    assert!(
        said.contains("/missing/a.json") && !said.contains("b="),
        "{said}"
    );
    let said = start(&["--tokenizer", "a=/missing/x,y.json"], None);
    assert!(said.contains("/missing/x,y.json"), "{said}");
}

/// `KVATLAS_PORT` in the environment (a container's) does not change an `--http-addr` given on
/// the command line: the server starts on the flag's address, not on the variable's port
/// (taken here, so that binding it would fail).
#[test]
fn the_port_variable_does_not_change_the_http_address_flag() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let served = Served::start_with_env(&[], &[("KVATLAS_PORT", &port)]);
    assert!(
        !served.http.ends_with(&format!(":{port}")),
        "{}",
        served.http
    );
    let (status, _) = served.terminate();
    assert!(status.success());
}

/// A `KVATLAS_PORT` that Kubernetes set for a Service named `kvatlas` (a service link) does not
/// stop the start: it is ignored, and the warning says so.
#[test]
fn a_kubernetes_service_link_in_the_port_variable_does_not_stop_the_start() {
    let served = Served::start_with_env(&[], &[("KVATLAS_PORT", "tcp://10.96.0.12:8090")]);
    let log = served.startup_log.join("\n");
    assert!(
        log.contains("KVATLAS_PORT") && log.contains("service link"),
        "{log}"
    );
    let (status, _) = served.terminate();
    assert!(status.success());
}

/// SIGTERM while `serve` starts (here: waiting for a NATS server that accepted the connection
/// and says nothing) stops the start at once and exits cleanly; before, the signal's default
/// action killed the process (its handler was installed once the server served).
#[test]
fn sigterm_while_starting_stops_the_start() {
    use std::io::BufRead;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("nats://{}", silent.local_addr().expect("addr"));
    let mut child = common::serve_command(&["--publish-to", &url])
        .spawn()
        .expect("kvatlas serve starts");
    // The server is in its start once it connected to the silent "NATS server" (waited for
    // with a deadline: a server that failed first never connects).
    let (connected, accepted) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = connected.send(silent.accept().map(|(connection, _)| connection));
        std::thread::sleep(std::time::Duration::from_secs(30));
    });
    let stderr = child.stderr.take().expect("stderr");
    let (lines, log) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines.send(line);
        }
    });
    let wait = std::time::Duration::from_secs(20);
    // Held open (and silent) until the end.
    let Ok(Ok(_connection)) = accepted.recv_timeout(wait) else {
        let _ = child.kill();
        panic!(
            "the server never connected: {:?}",
            log.try_iter().collect::<Vec<_>>()
        );
    };
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = std::time::Instant::now() + wait;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running after SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // (The process has exited: its stderr ends, and with it the reader's lines.)
    let log: Vec<String> = log.iter().collect();
    assert!(status.success(), "{status:?}: {log:?}");
    assert!(
        log.iter()
            .any(|l| l.contains("shutdown signal received while starting")),
        "{log:?}"
    );
}

/// A second SIGINT while the graceful shutdown waits (here for an HTTP request whose body
/// never comes, up to a 120 s shutdown timeout) stops the process at once, with status 130
/// and a warning that says what was cut short. Before, the second signal was taken by the
/// handler and did nothing: an operator's second Ctrl-C waited out the whole timeout.
#[test]
fn a_second_signal_stops_the_graceful_shutdown_at_once() {
    use std::time::{Duration, Instant};
    let mut server = Served::start(&["--shutdown-timeout-secs", "120"]);
    let mut in_flight = std::net::TcpStream::connect(&server.http).expect("connects");
    in_flight
        .write_all(
            b"POST /query HTTP/1.1\r\nHost: kvatlas\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{",
        )
        .expect("a request begun");
    // The request is in flight once the server has read its head; then the first signal.
    let deadline = Instant::now() + Duration::from_secs(15);
    while common::fleet::metric(&server, "kvatlas_requests_in_flight") == 0 {
        assert!(
            Instant::now() < deadline,
            "the request never reached the server"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    common::fleet::signal(&server, "INT");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        server.child.try_wait().expect("waits").is_none(),
        "the graceful shutdown waits for the request in flight"
    );
    common::fleet::signal(&server, "INT");
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = server.child.try_wait().expect("waits") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "still running 15 s after the second signal"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.code(),
        Some(kvatlas_server::cli::SECOND_SIGNAL_EXIT),
        "{status:?}"
    );
    // (The process has exited: its stderr ends, and with it the reader's lines.)
    let log: Vec<String> = server.stderr.iter().collect();
    assert!(
        log.iter()
            .any(|line| line.contains("a second shutdown signal")),
        "{log:?}"
    );
    drop(in_flight);
}
