//! Request handling without a network, for the fuzz target (`fuzz/fuzz_targets/requests.rs`,
//! built with `cfg(fuzzing)`) and this crate's robustness test: bytes are decoded as a request
//! message and go through the same validation, conversion and index work as over gRPC, against
//! one small in-process server state (bounded: few indexes, a capacity per index). What a peer
//! sends a bootstrapping replica goes through the same test: a native snapshot (read and checked)
//! and a Dynamo `/dump` (parsed and applied). So do the JSON bodies of Dynamo's HTTP routes
//! (parsed as axum's `Json` does, then handled by the route) and llm-d's `GetPodScores` (with a
//! small word-level tokenizer for model `m`), and what a replica reads from NATS: an event-log
//! message's records (unframed, decoded and checked, handed to their index). Not an API.
//!
//! The property: no input panics, and none is answered with INTERNAL — a bad request is the
//! client's error, and says so. A `QueryRequest` is decoded both by the gRPC codec (whose
//! hand-written fast path must give prost's result for any bytes) and by prost, and the two
//! must agree.

use std::sync::{Arc, OnceLock};

use kvatlas_proto::v1;
use prost::Message;

use axum::Json;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, StatusCode};
use http_body_util::BodyExt as _;
use kvatlas_proto::llmd::indexer::v1::GetPodScoresRequest;

use crate::auth::Caller;
use crate::config::{IndexSettings, Limits};
use crate::dynamo;
use crate::error::ServiceError;
use crate::grpc::{IndexerService, registration_of};
use crate::llmd::{PodScoresService, Tokenizers};
use crate::publish::{Admission, Publisher};
use crate::registry::{LogRole, Registry};
use crate::state::State;

/// The fuzzed server's limits: few indexes and ranks.
fn limits() -> Limits {
    Limits {
        max_query_tokens: 1 << 14,
        max_indexes: 8,
        max_registered_ranks: 64,
        ..Limits::default()
    }
}

fn settings() -> IndexSettings {
    IndexSettings {
        writer_threads: 1,
        writer_queue: 1024,
        capacity: Some(50_000),
        ..IndexSettings::default()
    }
}

fn state() -> Arc<State> {
    static STATE: OnceLock<Arc<State>> = OnceLock::new();
    Arc::clone(STATE.get_or_init(|| {
        let registry = Arc::new(Registry::new(settings(), limits()));
        Arc::new(State::new(registry, limits(), None, 0))
    }))
}

/// A replica's state, which `POST /register` bodies and event-log messages go to: its registry
/// refuses a registration after every check of the request has passed, so that no listener (no
/// socket, no thread) starts for a fuzzed endpoint, and its indexes are the log's alone.
fn replica_state() -> Arc<State> {
    static STATE: OnceLock<Arc<State>> = OnceLock::new();
    Arc::clone(STATE.get_or_init(|| {
        let registry = Registry::new(settings(), limits())
            .with_log(LogRole::Replica("fuzzing".into()), Arc::default());
        Arc::new(State::new(Arc::new(registry), limits(), None, 0))
    }))
}

/// A tokenizer.json for model `m`: whitespace-split words `tN` with id N (N < 64), `<unk>` 64.
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":{"type":"WhitespaceSplit"},"post_processor":null,
"decoder":null,"model":{"type":"WordLevel","unk_token":"<unk>","vocab":{"<unk>":64,
"t0":0,"t1":1,"t2":2,"t3":3,"t4":4,"t5":5,"t6":6,"t7":7,"t8":8,"t9":9,"t10":10,"t11":11,
"t12":12,"t13":13,"t14":14,"t15":15,"t16":16,"t17":17,"t18":18,"t19":19,"t20":20,"t21":21,
"t22":22,"t23":23,"t24":24,"t25":25,"t26":26,"t27":27,"t28":28,"t29":29,"t30":30,"t31":31,
"t32":32,"t33":33,"t34":34,"t35":35,"t36":36,"t37":37,"t38":38,"t39":39,"t40":40,"t41":41,
"t42":42,"t43":43,"t44":44,"t45":45,"t46":46,"t47":47,"t48":48,"t49":49,"t50":50,"t51":51,
"t52":52,"t53":53,"t54":54,"t55":55,"t56":56,"t57":57,"t58":58,"t59":59,"t60":60,"t61":61,
"t62":62,"t63":63}}}"#;

fn pod_scores() -> PodScoresService {
    static SERVICE: OnceLock<PodScoresService> = OnceLock::new();
    SERVICE
        .get_or_init(|| {
            let mut tokenizers = Tokenizers::default();
            if let Err(e) = tokenizers.add("m", TOKENIZER.as_bytes()) {
                panic!("the fuzzing tokenizer does not parse: {e}");
            }
            PodScoresService::new(state(), Arc::new(tokenizers))
        })
        .clone()
}

/// One runtime for the async handlers (a route's blocking work runs on its blocking pool).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => panic!("no tokio runtime for fuzzing: {e}"),
        }
    })
}

/// The codec's count of the memory `bytes` take once decoded is never below that of `decoded`,
/// what prost decoded from them: the count of its canonical bytes, which is its decoded size
/// (the codec's property test holds the count of canonical bytes to it).
fn decoded_no_larger_than_counted<U: Message + 'static>(bytes: &[u8], decoded: &U) {
    let counted = kvatlas_proto::codec::decoded_size::<U>(bytes);
    let size = kvatlas_proto::codec::decoded_size::<U>(&decoded.encode_to_vec());
    assert!(
        counted >= size,
        "{counted:?} bytes counted, the decoded message takes {size:?}"
    );
}

/// A Dynamo route's JSON `body` (the route picked by `route`), parsed as axum's `Json`
/// extractor does (`None` if it does not parse: axum answers 400/422) and handled; a 500 is
/// INTERNAL, another error status the client's error.
fn dynamo_route(route: u8, body: &[u8]) -> Option<Result<(), ServiceError>> {
    fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Option<Json<T>> {
        serde_json::from_slice(body).ok().map(Json)
    }
    /// As the query routes' `FastJson` extractor: the fast parse, else `serde_json`'s.
    fn parse_fast<T: crate::fast_json::FastParse>(
        body: &[u8],
    ) -> Option<crate::fast_json::FastJson<T>> {
        T::fast_parse(body)
            .or_else(|| serde_json::from_slice(body).ok())
            .map(crate::fast_json::FastJson)
    }
    let headers = HeaderMap::new();
    let state = AxumState(state());
    runtime().block_on(async move {
        let (name, response) = match route % 6 {
            0 => (
                "/register",
                dynamo::register(AxumState(replica_state()), headers, parse(body)?).await,
            ),
            1 => (
                "/unregister",
                dynamo::unregister(state, headers, parse(body)?).await,
            ),
            2 => (
                "/query",
                dynamo::query(state, headers, parse_fast(body)?).await,
            ),
            3 => (
                "/query_by_hash",
                dynamo::query_by_hash(state, headers, parse_fast(body)?).await,
            ),
            4 => (
                "/register_peer",
                dynamo::register_peer(state, headers, parse(body)?).await,
            ),
            _ => (
                "/deregister_peer",
                dynamo::deregister_peer(state, headers, parse(body)?).await,
            ),
        };
        let status = response.status();
        if status.is_success() {
            return Some(Ok(()));
        }
        let text = response
            .into_body()
            .collect()
            .await
            .map(|body| String::from_utf8_lossy(&body.to_bytes()).into_owned())
            .unwrap_or_default();
        let message = format!("{name} answered {status}: {text}");
        Some(Err(if status == StatusCode::INTERNAL_SERVER_ERROR {
            ServiceError::Internal(message)
        } else {
            ServiceError::InvalidArgument(message)
        }))
    })
}

/// Decodes `data[1..]` as the request `data[0]` selects and handles it; `None` when the bytes
/// are not that message (tonic answers INVALID_ARGUMENT then), else the handling's outcome.
/// Selectors (mod 8): 0 `Query`, 1 `RegisterWorker`, 2 `PublishEvents`, 3 a peer's native
/// snapshot, 4 a peer's Dynamo `/dump`, 5 a Dynamo route's JSON body (the next byte picks the
/// route), 6 llm-d's `GetPodScores`, 7 a NATS event-log message as a replica reads it.
pub fn request(data: &[u8]) -> Option<Result<(), ServiceError>> {
    let (&selector, body) = data.split_first()?;
    let state = state();
    let service = IndexerService::new(Arc::clone(&state));
    let caller = Caller::anonymous();
    Some(match selector % 8 {
        7 => log_message(&replica_state(), body),
        5 => {
            let (&route, json) = body.split_first()?;
            return dynamo_route(route, json);
        }
        6 => {
            let decoded = GetPodScoresRequest::decode(body).ok()?;
            decoded_no_larger_than_counted(body, &decoded);
            let mut request = tonic::Request::new(decoded);
            // What the gate in front of the service attaches.
            let permit = state.admit(crate::metrics::Rpc::GetPodScores, &caller);
            request
                .extensions_mut()
                .insert(crate::state::HandedPlace::new(permit.expect("a place")));
            request.extensions_mut().insert(caller);
            runtime().block_on(pod_scores().answer(request)).map(drop)
        }
        3 => crate::snapshot::read(body)
            .map(drop)
            .map_err(|e| ServiceError::InvalidArgument(e.to_string())),
        4 => crate::dynamo::parse_dump(body)
            .map_err(ServiceError::InvalidArgument)
            .and_then(|dump| crate::dynamo::apply_dump(&state.registry, dump.indexes))
            .map(drop),
        0 => {
            // The codec counts the token ids of any bytes before decoding them (no panic).
            let counted = kvatlas_proto::codec::count_token_ids(body);
            // The codec's hand-written decoding must give prost's answer for any bytes.
            let query = kvatlas_proto::codec::decode_message::<v1::QueryRequest>(body);
            assert_eq!(
                query,
                v1::QueryRequest::decode(body),
                "the codec decoded a QueryRequest differently from prost"
            );
            let query = query.ok()?;
            // The count the codec bounds a query by is never below the ids decoded.
            if let Some(v1::query_request::Input::Tokens(tokens)) = &query.input {
                assert!(
                    counted >= tokens.ids.len(),
                    "{counted} token ids counted, {} decoded",
                    tokens.ids.len()
                );
            }
            service.answer(&caller, &query).map(drop)
        }
        1 => {
            let register = v1::RegisterWorkerRequest::decode(body).ok()?;
            // Validation and conversion only: starting listeners is not the request's business.
            registration_of(&register).map(drop)
        }
        _ => {
            let message = v1::PublishEventsRequest::decode(body).ok()?;
            decoded_no_larger_than_counted(body, &message);
            let mut publisher = Publisher::new(state.next_stream_id(), Arc::clone(&state.registry));
            publisher.prepare(&message).and_then(|prepared| {
                if let Admission::Apply { .. } = publisher.admit(&prepared)? {
                    for mutation in prepared.mutations {
                        // A full lane drops here: the fuzzer must not wait.
                        let _ = prepared.entry.pool.try_enqueue(mutation);
                    }
                }
                Ok(())
            })
        }
    })
}

/// A NATS event-log message (a stream message's records, or one live record) through what a
/// replica does with it before its sequencing: unframed, each record decoded and checked, its
/// index found or created, its unit handed to the index's writers. A record that fails is the
/// sender's error (a replica counts it in `dropped_invalid` and skips it).
fn log_message(state: &State, payload: &[u8]) -> Result<(), ServiceError> {
    let records = crate::log_record::unframe(payload).map_err(ServiceError::InvalidArgument)?;
    for record in records {
        let record =
            crate::log_record::Record::decode(record).map_err(ServiceError::InvalidArgument)?;
        let (entry, _) = state
            .registry
            .index_for(&record.key, Some(record.block_size))?;
        if let Some(unit) = record.into_unit(Some(std::time::Instant::now())) {
            // A full lane drops here: the fuzzer must not wait.
            let _ = entry.pool.try_enqueue_unit(unit);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            Just("m".to_owned()),
            Just("m2".to_owned()),
            "[a-z]{1,4}",
            "\\PC{0,300}",
        ]
    }

    fn selector() -> impl Strategy<Value = Option<v1::IndexSelector>> {
        proptest::option::of(
            (name(), name()).prop_map(|(model, tenant)| v1::IndexSelector { model, tenant }),
        )
    }

    fn stored() -> impl Strategy<Value = v1::BlocksStored> {
        (
            proptest::option::of(any::<u64>()),
            proptest::collection::vec(any::<u64>(), 0..6),
            proptest::collection::vec(any::<u32>(), 0..40),
            proptest::collection::vec(any::<u64>(), 0..6),
            -1..6i32,
            name(),
        )
            .prop_map(
                |(parent_hash, block_hashes, token_ids, local_hashes, tier, lora)| {
                    v1::BlocksStored {
                        parent_hash,
                        block_hashes,
                        token_ids,
                        local_hashes,
                        tier,
                        lora_name: lora,
                        cache_salt: String::new(),
                    }
                },
            )
    }

    fn event() -> impl Strategy<Value = v1::KvEvent> {
        prop_oneof![
            Just(None),
            stored().prop_map(|s| Some(v1::kv_event::Event::Stored(s))),
            (proptest::collection::vec(any::<u64>(), 0..4), -1..5i32).prop_map(
                |(block_hashes, tier)| Some(v1::kv_event::Event::Removed(v1::BlocksRemoved {
                    block_hashes,
                    tier
                }))
            ),
            Just(Some(v1::kv_event::Event::Cleared(v1::AllBlocksCleared {}))),
        ]
        .prop_map(|event| v1::KvEvent { event })
    }

    /// One request of each kind, structured (so most pass decoding) with hostile values.
    fn message() -> impl Strategy<Value = Vec<u8>> {
        let query = (
            selector(),
            name(),
            prop_oneof![
                Just(None),
                proptest::collection::vec(any::<u32>(), 0..200)
                    .prop_map(|ids| Some(v1::query_request::Input::Tokens(v1::TokenIds { ids }))),
                proptest::collection::vec(any::<u64>(), 0..50).prop_map(|hashes| Some(
                    v1::query_request::Input::LocalHashes(v1::LocalHashes { hashes })
                )),
            ],
            (
                any::<bool>(),
                0..5u32,
                0..5u32,
                proptest::collection::vec(0..4u64, 0..3),
            ),
        )
            .prop_map(
                |(index, lora, input, (early_exit, top_k, min_blocks, ids))| {
                    let mut bytes = vec![0];
                    v1::QueryRequest {
                        index,
                        lora_name: lora,
                        input,
                        options: Some(v1::QueryOptions {
                            early_exit,
                            top_k,
                            min_blocks,
                            instance_ids: ids,
                            device_only: top_k == 3,
                        }),
                        ..v1::QueryRequest::default()
                    }
                    .encode(&mut bytes)
                    .map(|()| bytes)
                    .unwrap_or_default()
                },
            );
        let register = (selector(), any::<u32>(), -1..4i32, name(), -1..3i32).prop_map(
            |(index, block_size, engine, endpoint, socket_mode)| {
                let mut bytes = vec![1];
                v1::RegisterWorkerRequest {
                    index,
                    block_size: block_size % 40,
                    engine,
                    endpoint,
                    socket_mode,
                    ..v1::RegisterWorkerRequest::default()
                }
                .encode(&mut bytes)
                .map(|()| bytes)
                .unwrap_or_default()
            },
        );
        let publish = (
            selector(),
            0..4u64,
            0..3u32,
            proptest::option::of(0..6u64),
            0..9u32,
            proptest::collection::vec(event(), 0..5),
        )
            .prop_map(|(index, instance_id, dp_rank, seq, block_size, events)| {
                let mut bytes = vec![2];
                v1::PublishEventsRequest {
                    index,
                    instance_id,
                    dp_rank,
                    seq,
                    block_size,
                    events,
                }
                .encode(&mut bytes)
                .map(|()| bytes)
                .unwrap_or_default()
            });
        // What a peer sends: a native snapshot and a Dynamo dump of a small random state.
        let peer = (
            proptest::collection::vec((0..4u64, proptest::collection::vec(0..6u64, 1..5)), 0..6),
            any::<bool>(),
        )
            .prop_map(|(runs, as_dump)| {
                use kvatlas_index::KvIndex as _;
                let mut reference = kvatlas_index::ReferenceIndex::new();
                for (worker, chain) in runs {
                    let mut parent = None;
                    for id in chain {
                        let external = kvatlas_index::ExternalBlockHash::new(
                            id * 7
                                + parent.map_or(0, |p: kvatlas_index::ExternalBlockHash| p.get()),
                        );
                        reference.apply(&kvatlas_index::Mutation::Stored {
                            worker: kvatlas_index::Worker::new(worker, 0),
                            tier: kvatlas_index::Tier::Device,
                            parent,
                            blocks: vec![kvatlas_index::StoredBlock {
                                external,
                                local: kvatlas_hash::LocalBlockHash::new(id),
                            }],
                        });
                        parent = Some(external);
                    }
                }
                // A model no other generated request uses: the state persists across cases,
                // and a request may have created "m" with another block size.
                let image = crate::snapshot::IndexImage {
                    key: crate::registry::IndexKey::new("peer-model", ""),
                    block_size: kvatlas_hash::BlockSize::new(4).expect("a block size"),
                    capacity: None,
                    feeds: Vec::new(),
                    marks: std::collections::BTreeMap::new(),
                    snapshot: reference.snapshot(),
                };
                if as_dump {
                    let mut bytes = vec![4];
                    crate::dynamo::write_dump(&[image], &mut bytes).expect("a Vec takes it");
                    bytes
                } else {
                    let mut writer = crate::snapshot::Writer::new(vec![3], 0).expect("a writer");
                    writer.index(&image).expect("written");
                    writer.finish().expect("finished")
                }
            });
        // Dynamo's routes: JSON bodies with the routes' fields, hostile values and types.
        let json_value = prop_oneof![
            Just(serde_json::Value::Null),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_map(serde_json::Value::from),
            name().prop_map(serde_json::Value::from),
            proptest::collection::vec(any::<u32>(), 0..80).prop_map(serde_json::Value::from),
        ];
        let hashes = proptest::collection::vec(
            prop_oneof![
                any::<u64>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                any::<u64>().prop_map(|h| serde_json::Value::from(h.to_string())),
                json_value.clone(),
            ],
            0..40,
        );
        let http = (
            0..6u8,
            name(),
            proptest::option::of(name()),
            proptest::collection::vec(any::<u32>(), 0..120),
            hashes,
            (any::<u64>(), 0..40u32, proptest::option::of(0..4u32)),
            (
                prop_oneof![
                    Just("tcp://127.0.0.1:1".to_owned()),
                    Just("ipc:///tmp/x".to_owned()),
                    name()
                ],
                proptest::option::of(prop_oneof![Just("vLLM".to_owned()), name()]),
            ),
            proptest::option::of(("[a-z_]{1,12}", json_value)),
        )
            .prop_map(
                |(
                    route,
                    model,
                    group,
                    tokens,
                    hashes,
                    (id, block_size, rank),
                    (url, kind),
                    extra,
                )| {
                    let mut body = match route {
                        0 => serde_json::json!({"instance_id": id % 4, "endpoint": url,
                            "model_name": model, "routing_group": group, "block_size": block_size,
                            "dp_rank": rank, "type": kind}),
                        1 => serde_json::json!({"instance_id": id % 4, "model_name": model,
                            "tenant_id": group, "dp_rank": rank}),
                        2 => serde_json::json!({"token_ids": tokens, "model_name": model,
                            "routing_group": group, "lora_name": kind, "cache_salt": group}),
                        3 => serde_json::json!({"block_hashes": hashes, "modelname": model,
                            "routing_group": group}),
                        _ => serde_json::json!({"url": url}),
                    };
                    if let (Some((field, value)), Some(fields)) = (extra, body.as_object_mut()) {
                        fields.insert(field, value);
                    }
                    let mut bytes = vec![5, route];
                    bytes.extend(body.to_string().into_bytes());
                    bytes
                },
            );
        let pod_scores = (
            prop_oneof![
                proptest::collection::vec(0..70u32, 0..200).prop_map(|words| words
                    .iter()
                    .map(|w| format!("t{w}"))
                    .collect::<Vec<_>>()
                    .join(" ")),
                "\\PC{0,200}",
            ],
            name(),
            proptest::collection::vec(name(), 0..3),
        )
            .prop_map(|(prompt, model, pod_identifiers)| {
                let mut bytes = vec![6];
                GetPodScoresRequest {
                    prompt,
                    model_name: if model.len() > 2 { "m".into() } else { model },
                    pod_identifiers,
                }
                .encode(&mut bytes)
                .map(|()| bytes)
                .unwrap_or_default()
            });
        // A NATS event-log message: one to three framed records with hostile values.
        let log_mutation = (
            0..3u32,
            prop_oneof![
                Just(None),
                (
                    proptest::option::of(0..8u64),
                    proptest::collection::vec((0..8u64, any::<u64>()), 0..6),
                    0..6usize,
                    prop_oneof![4 => 0..4i32, 1 => -1..6i32],
                )
                    .prop_map(|(parent_hash, blocks, locals, tier)| {
                        // Mostly one local hash per block, as kvatlas writes them.
                        let (block_hashes, mut local_hashes): (Vec<u64>, Vec<u64>) =
                            blocks.into_iter().unzip();
                        if locals == 0 {
                            local_hashes.pop();
                        }
                        Some(v1::log_mutation::Event::Stored(v1::LogStored {
                            parent_hash,
                            block_hashes,
                            local_hashes,
                            tier,
                        }))
                    }),
                (proptest::collection::vec(0..8u64, 0..4), -1..5i32).prop_map(
                    |(block_hashes, tier)| Some(v1::log_mutation::Event::Removed(v1::LogRemoved {
                        block_hashes,
                        tier
                    }))
                ),
                Just(Some(v1::log_mutation::Event::Cleared(
                    v1::AllBlocksCleared {}
                ))),
            ],
        )
            .prop_map(|(dp_rank, event)| v1::LogMutation { dp_rank, event });
        let log_body = prop_oneof![
            Just(None),
            (
                proptest::option::of(0..6u64),
                any::<u64>(),
                any::<bool>(),
                proptest::collection::vec(log_mutation, 0..5),
                proptest::option::of(any::<i64>()),
            )
                .prop_map(
                    |(seq, fingerprint, resync, mutations, published_unix_micros)| Some(
                        v1::log_record::Body::Batch(v1::LogBatch {
                            seq,
                            fingerprint,
                            resync,
                            mutations,
                            published_unix_micros,
                        })
                    )
                ),
            proptest::option::of(0..3u32).prop_map(|dp_rank| Some(
                v1::log_record::Body::Unregister(v1::LogUnregister { dp_rank })
            )),
        ];
        let log_selector = prop_oneof![
            4 => prop_oneof![Just("m"), Just("m2")].prop_map(|model| Some(v1::IndexSelector {
                model: model.to_owned(),
                tenant: "default".to_owned(),
            })),
            1 => selector(),
        ];
        let log_block_size = prop_oneof![4 => Just(16u32), 1 => 0..40u32];
        let log_record = (log_selector, log_block_size, 0..4u64, 0..3u32, log_body).prop_map(
            |(index, block_size, instance_id, dp_rank, body)| {
                v1::LogRecord {
                    index,
                    block_size,
                    instance_id,
                    dp_rank,
                    body,
                }
                .encode_to_vec()
            },
        );
        let log = proptest::collection::vec(log_record, 1..4).prop_map(|records| {
            let mut bytes = vec![7];
            for record in records {
                prost::encoding::encode_varint(record.len() as u64, &mut bytes);
                bytes.extend(record);
            }
            bytes
        });
        prop_oneof![query, register, publish, peer, http, pod_scores, log]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        /// Structured requests with hostile values, and the same bytes flipped and cut.
        #[test]
        fn no_request_panics_or_is_internal(
            bytes in message(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
            cut in any::<prop::sample::Index>(),
        ) {
            let outcome = request(&bytes);
            prop_assert!(!matches!(outcome, Some(Err(ServiceError::Internal(_)))), "{outcome:?}");
            if matches!(bytes.first(), Some(3 | 4)) {
                // What kvatlas writes for a peer, kvatlas reads: it is restored, or refused
                // only at the index limit (the state is shared by every case, and the cases
                // before may have filled it with indexes that hold something).
                prop_assert!(
                    matches!(outcome, Some(Ok(()))) || matches!(
                        &outcome,
                        Some(Err(ServiceError::ResourceExhausted(why))) if why.contains("--max-indexes")
                    ),
                    "{outcome:?}"
                );
            }
            let mut mangled = bytes.clone();
            if mangled.len() > 1 {
                for (at, value) in flips {
                    let i = 1 + at.index(mangled.len() - 1);
                    mangled[i] ^= value;
                }
                mangled.truncate(1 + cut.index(mangled.len()));
            }
            let outcome = request(&mangled);
            prop_assert!(!matches!(outcome, Some(Err(ServiceError::Internal(_)))), "{outcome:?}");
        }
    }
}
