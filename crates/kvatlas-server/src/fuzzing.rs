//! Request handling without a network, for the fuzz target (`fuzz/fuzz_targets/requests.rs`,
//! built with `cfg(fuzzing)`) and this crate's robustness test: bytes are decoded as a request
//! message and go through the same validation, conversion and index work as over gRPC, against
//! one small in-process server state (bounded: few indexes, a capacity per index). What a peer
//! sends a bootstrapping replica goes through the same test: a native snapshot (read and checked)
//! and a Dynamo `/dump` (parsed and applied). Not an API.
//!
//! The property: no input panics, and none is answered with INTERNAL — a bad request is the
//! client's error, and says so.

use std::sync::{Arc, OnceLock};

use kvatlas_proto::v1;
use prost::Message;

use crate::auth::Caller;
use crate::config::{IndexSettings, Limits};
use crate::error::ServiceError;
use crate::grpc::{IndexerService, registration_of};
use crate::publish::{Admission, Publisher};
use crate::registry::Registry;
use crate::state::State;

fn state() -> Arc<State> {
    static STATE: OnceLock<Arc<State>> = OnceLock::new();
    Arc::clone(STATE.get_or_init(|| {
        let limits = Limits {
            max_query_tokens: 1 << 14,
            max_indexes: 8,
            max_registered_ranks: 64,
            ..Limits::default()
        };
        let settings = IndexSettings {
            writer_threads: 1,
            writer_queue: 1024,
            capacity: Some(50_000),
            ..IndexSettings::default()
        };
        let registry = Arc::new(Registry::new(settings, limits));
        Arc::new(State::new(registry, limits, None, 0))
    }))
}

/// Decodes `data[1..]` as the request `data[0]` selects and handles it; `None` when the bytes
/// are not that message (tonic answers INVALID_ARGUMENT then), else the handling's outcome.
/// Selectors (mod 5): 0 `Query`, 1 `RegisterWorker`, 2 `PublishEvents`, 3 a peer's native
/// snapshot, 4 a peer's Dynamo `/dump`.
pub fn request(data: &[u8]) -> Option<Result<(), ServiceError>> {
    let (&selector, body) = data.split_first()?;
    let state = state();
    let service = IndexerService::new(Arc::clone(&state));
    let caller = Caller::anonymous();
    Some(match selector % 5 {
        3 => crate::snapshot::read(body)
            .map(drop)
            .map_err(|e| ServiceError::InvalidArgument(e.to_string())),
        4 => crate::dynamo::parse_dump(body)
            .map_err(ServiceError::InvalidArgument)
            .and_then(|dump| crate::dynamo::apply_dump(&state.registry, dump))
            .map(drop),
        0 => {
            let query = v1::QueryRequest::decode(body).ok()?;
            service.answer(&caller, &query).map(drop)
        }
        1 => {
            let register = v1::RegisterWorkerRequest::decode(body).ok()?;
            // Validation and conversion only: starting listeners is not the request's business.
            registration_of(&register).map(drop)
        }
        _ => {
            let message = v1::PublishEventsRequest::decode(body).ok()?;
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
                    bytes.extend(crate::dynamo::dump(&[image]).to_string().into_bytes());
                    bytes
                } else {
                    let mut writer = crate::snapshot::Writer::new(vec![3], 0).expect("a writer");
                    writer.index(&image).expect("written");
                    writer.finish().expect("finished")
                }
            });
        prop_oneof![query, register, publish, peer]
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
                // What kvatlas writes for a peer, kvatlas reads.
                prop_assert!(matches!(outcome, Some(Ok(()))), "{outcome:?}");
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
