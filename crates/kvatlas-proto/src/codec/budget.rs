//! How much memory a request takes once prost decodes it, counted in its bytes before decoding.
//!
//! A decoded message can be far larger than its bytes. A list of integers holds at most 8 bytes
//! per byte received (a `uint64` of one byte), but a list of messages or strings holds a whole
//! element per element: an empty `KvEvent` is 2 bytes on the wire and 144 in memory, so a
//! 16 MiB `PublishEventsRequest` of them decoded to 1.1 GiB. [`decoded_size`] counts what prost
//! would build — each list element at its size in memory, each string's bytes — by walking the
//! message's fields without building anything, for the requests whose decoded form can exceed
//! 8 bytes per byte (a table by hand, [`COUNTED_REQUESTS`], which a test holds to the `.proto`
//! files' descriptors: every RPC input that can reach such a list is in it). Every other request
//! decodes to at most 8 bytes per byte plus its own struct, under the bound the server sets
//! (16 × `--max-message-bytes`) without counting it.
//!
//! The walk reads fields as prost does: a nested message's fields are read from the whole
//! message (prost checks a nested length against the rest of the whole message, then errs if
//! the nested message did not end where it said), unknown fields are skipped, a packed run is
//! counted as prost reads it (a last varint or word that continues past the run's end is read
//! and kept before prost errs), and where prost stops with an error the count stops no earlier
//! (what prost built up to there is counted).
//!
//! The count is of the lists' lengths. Their capacity can be larger: prost grows a list by
//! doubling as it pushes and does not shrink it, so a decoded list can hold up to twice its
//! count (three times while it grows), and a small one at least 4 elements.

use std::any::{Any, TypeId};
use std::mem::size_of;
use std::sync::atomic::AtomicUsize;

use super::answers::{delimited, varint};
use super::requests::{skip, varints_read};
use crate::llmd::indexer::v1::GetPodScoresRequest;
use crate::v1::{
    AllBlocksCleared, BlocksRemoved, BlocksStored, IndexSelector, KvEvent, PublishEventsRequest,
};

/// The most bytes a request message may take once decoded (0: no bound); see
/// [`super::bound_decoded_size`].
pub(super) static MAX_DECODED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// No list element of [`COUNTED_REQUESTS`] takes more than this many bytes of memory per byte on
/// the wire (the largest is an empty `KvEvent`: 144 bytes for 2; a test holds every schema to
/// it), so a message whose bytes times this, plus the largest counted struct, stay within the
/// bound is not counted.
pub(super) const MOST_BYTES_PER_BYTE: usize = 128;

/// What a field takes in memory once prost decodes it (fields not named take none of their
/// own: scalars, and `optional` scalars, sit inside their message).
#[derive(Debug, Clone, Copy)]
pub(super) enum Field {
    /// A singular message, kept inside its parent: only its own fields take memory. (A second
    /// occurrence merges into the first; both are counted.)
    Message(&'static Schema),
    /// A repeated message: an element of [`Schema::size`] bytes per occurrence, and its fields.
    Messages(&'static Schema),
    /// A string or bytes field: its bytes (a later occurrence replaces an earlier one; both are
    /// counted).
    Text,
    /// A repeated string: a `String` and its bytes per occurrence.
    Texts,
    /// A repeated integer kept in `width` bytes: one per varint, packed or not.
    Varints(usize),
    /// A repeated `fixed64`: 8 bytes per 8 bytes, packed or not.
    Fixed64s,
}

/// A message's shape, as far as memory goes.
#[derive(Debug)]
pub(super) struct Schema {
    /// The message's full protobuf name.
    pub(super) name: &'static str,
    /// Its size in memory (`size_of` of the generated struct).
    pub(super) size: usize,
    /// The fields that take memory of their own, by field number.
    pub(super) fields: &'static [(u32, Field)],
}

impl Schema {
    fn field(&self, number: u64) -> Option<Field> {
        self.fields
            .iter()
            .find(|(n, _)| u64::from(*n) == number)
            .map(|&(_, field)| field)
    }
}

const INDEX_SELECTOR: Schema = Schema {
    name: "kvatlas.v1.IndexSelector",
    size: size_of::<IndexSelector>(),
    fields: &[(1, Field::Text), (2, Field::Text)],
};

const BLOCKS_STORED: Schema = Schema {
    name: "kvatlas.v1.BlocksStored",
    size: size_of::<BlocksStored>(),
    fields: &[
        (2, Field::Varints(size_of::<u64>())),
        (3, Field::Varints(size_of::<u32>())),
        (4, Field::Fixed64s),
        (6, Field::Text),
        (7, Field::Text),
    ],
};

const BLOCKS_REMOVED: Schema = Schema {
    name: "kvatlas.v1.BlocksRemoved",
    size: size_of::<BlocksRemoved>(),
    fields: &[(1, Field::Varints(size_of::<u64>()))],
};

const ALL_BLOCKS_CLEARED: Schema = Schema {
    name: "kvatlas.v1.AllBlocksCleared",
    size: size_of::<AllBlocksCleared>(),
    fields: &[],
};

const KV_EVENT: Schema = Schema {
    name: "kvatlas.v1.KvEvent",
    size: size_of::<KvEvent>(),
    fields: &[
        (1, Field::Message(&BLOCKS_STORED)),
        (2, Field::Message(&BLOCKS_REMOVED)),
        (3, Field::Message(&ALL_BLOCKS_CLEARED)),
    ],
};

const PUBLISH_EVENTS_REQUEST: Schema = Schema {
    name: "kvatlas.v1.PublishEventsRequest",
    size: size_of::<PublishEventsRequest>(),
    fields: &[
        (1, Field::Message(&INDEX_SELECTOR)),
        (6, Field::Messages(&KV_EVENT)),
    ],
};

const GET_POD_SCORES_REQUEST: Schema = Schema {
    name: "indexer.v1.GetPodScoresRequest",
    size: size_of::<GetPodScoresRequest>(),
    fields: &[(1, Field::Text), (2, Field::Text), (3, Field::Texts)],
};

/// A request whose decoded form can exceed 8 bytes per byte.
#[derive(Debug)]
pub(super) struct Counted {
    /// The generated type's id.
    type_id: fn() -> TypeId,
    /// Its shape.
    pub(super) schema: &'static Schema,
    /// What it lists, for the refusal's advice ("send fewer … per message").
    pub(super) lists: &'static str,
}

/// The requests whose decoded form can exceed 8 bytes per byte.
pub(super) const COUNTED_REQUESTS: &[Counted] = &[
    Counted {
        type_id: TypeId::of::<PublishEventsRequest>,
        schema: &PUBLISH_EVENTS_REQUEST,
        lists: "events",
    },
    Counted {
        type_id: TypeId::of::<GetPodScoresRequest>,
        schema: &GET_POD_SCORES_REQUEST,
        lists: "pod identifiers",
    },
];

/// The bytes the message in `bytes` takes once prost decodes it as `schema`'s message, counted
/// without decoding it (see the module docs).
pub(super) fn decoded_size(schema: &Schema, bytes: &[u8]) -> usize {
    let mut size = schema.size;
    let mut at = 0;
    let _ = fields(schema, bytes, &mut at, bytes.len(), &mut size);
    size
}

/// Adds the memory of `schema`'s fields found from `at` to `end` (read from the whole `bytes`,
/// as prost reads them) to `size`; `None` where prost errs.
fn fields(
    schema: &Schema,
    bytes: &[u8],
    at: &mut usize,
    end: usize,
    size: &mut usize,
) -> Option<()> {
    while *at < end {
        let key = varint(bytes, at)?;
        let wire = key & 7;
        let Some(field) = schema.field(key >> 3) else {
            skip(bytes, at, key)?;
            continue;
        };
        let add = |size: &mut usize, n: usize| *size = size.saturating_add(n);
        match (field, wire) {
            (Field::Message(nested), 2) => nested_message(nested, bytes, at, size)?,
            (Field::Messages(nested), 2) => {
                add(size, nested.size);
                nested_message(nested, bytes, at, size)?;
            }
            (Field::Text, 2) => add(size, delimited(bytes, at)?.len()),
            (Field::Texts, 2) => add(size, size_of::<String>() + delimited(bytes, at)?.len()),
            (Field::Varints(width), 2) => add(size, width * varints_read(delimited(bytes, at)?)),
            (Field::Varints(width), 0) => {
                varint(bytes, at)?;
                add(size, width);
            }
            // A last word that continues past the run is read and kept before prost errs.
            (Field::Fixed64s, 2) => add(size, 8 * delimited(bytes, at)?.len().div_ceil(8)),
            (Field::Fixed64s, 1) => {
                *at = at.checked_add(8).filter(|&end| end <= bytes.len())?;
                add(size, 8);
            }
            // Any other wire type for these fields is prost's error.
            _ => return None,
        }
    }
    Some(())
}

/// A nested message's length, then its fields (read from the whole message, as prost does).
fn nested_message(schema: &Schema, bytes: &[u8], at: &mut usize, size: &mut usize) -> Option<()> {
    let len = usize::try_from(varint(bytes, at)?).ok()?;
    let end = at.checked_add(len).filter(|&end| end <= bytes.len())?;
    fields(schema, bytes, at, end, size)?;
    (*at == end).then_some(())
}

/// The decoded size of `bytes` as `U`, with `U`'s entry, when `U` is a request of
/// [`COUNTED_REQUESTS`] and the size is over `bound` (0: no bound). A message that cannot reach
/// the bound (its bytes times [`MOST_BYTES_PER_BYTE`], plus the largest counted struct) is not
/// counted.
pub(super) fn over_bound<U: Any>(bytes: &[u8], bound: usize) -> Option<(usize, &'static Counted)> {
    // Arithmetic first: a query (every request the server answers most) of less than a
    // 128th of the bound skips the table too.
    let most = bytes
        .len()
        .saturating_mul(MOST_BYTES_PER_BYTE)
        .saturating_add(LARGEST_COUNTED_STRUCT);
    if bound == 0 || most <= bound {
        return None;
    }
    let counted = counted::<U>()?;
    Some((decoded_size(counted.schema, bytes), counted)).filter(|&(size, _)| size > bound)
}

/// The largest struct of [`COUNTED_REQUESTS`].
const LARGEST_COUNTED_STRUCT: usize = {
    let mut largest = 0;
    let mut i = 0;
    while i < COUNTED_REQUESTS.len() {
        if COUNTED_REQUESTS[i].schema.size > largest {
            largest = COUNTED_REQUESTS[i].schema.size;
        }
        i += 1;
    }
    largest
};

/// The decoded size of `bytes` as `U`, with `U`'s entry, when `U` is a request of
/// [`COUNTED_REQUESTS`].
pub(super) fn decoded_size_of<U: Any>(bytes: &[u8]) -> Option<(usize, &'static Counted)> {
    let counted = counted::<U>()?;
    Some((decoded_size(counted.schema, bytes), counted))
}

/// `U`'s entry in [`COUNTED_REQUESTS`].
fn counted<U: Any>() -> Option<&'static Counted> {
    let id = TypeId::of::<U>();
    COUNTED_REQUESTS.iter().find(|c| (c.type_id)() == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{LogBatch, QueryRequest, kv_event};
    use proptest::prelude::*;
    use prost::Message;

    /// The bytes a decoded `PublishEventsRequest` takes, element by element.
    fn size_of_publish(r: &PublishEventsRequest) -> usize {
        let selector = r
            .index
            .as_ref()
            .map_or(0, |s| s.model.len() + s.tenant.len());
        let events: usize = r
            .events
            .iter()
            .map(|e| {
                size_of::<KvEvent>()
                    + match &e.event {
                        Some(kv_event::Event::Stored(s)) => {
                            8 * s.block_hashes.len()
                                + 4 * s.token_ids.len()
                                + 8 * s.local_hashes.len()
                                + s.lora_name.len()
                                + s.cache_salt.len()
                        }
                        Some(kv_event::Event::Removed(r)) => 8 * r.block_hashes.len(),
                        Some(kv_event::Event::Cleared(_)) | None => 0,
                    }
            })
            .sum();
        size_of::<PublishEventsRequest>() + selector + events
    }

    fn size_of_pod_scores(r: &GetPodScoresRequest) -> usize {
        size_of::<GetPodScoresRequest>()
            + r.prompt.len()
            + r.model_name.len()
            + r.pod_identifiers
                .iter()
                .map(|p| size_of::<String>() + p.len())
                .sum::<usize>()
    }

    fn publish_request() -> impl Strategy<Value = PublishEventsRequest> {
        let hashes = prop::collection::vec(prop_oneof![0u64..300, any::<u64>()], 0..6);
        let event = prop_oneof![
            (
                hashes.clone(),
                prop::collection::vec(0u32..70_000, 0..20),
                prop::collection::vec(any::<u64>(), 0..4),
                "[a-z]{0,3}",
                "[a-z]{0,3}",
                proptest::option::of(any::<u64>()),
            )
                .prop_map(
                    |(
                        block_hashes,
                        token_ids,
                        local_hashes,
                        lora_name,
                        cache_salt,
                        parent_hash,
                    )| {
                        kv_event::Event::Stored(BlocksStored {
                            parent_hash,
                            block_hashes,
                            token_ids,
                            local_hashes,
                            tier: 0,
                            lora_name,
                            cache_salt,
                        })
                    }
                ),
            hashes.prop_map(|block_hashes| kv_event::Event::Removed(BlocksRemoved {
                block_hashes,
                tier: 1,
            })),
            Just(kv_event::Event::Cleared(AllBlocksCleared {})),
        ];
        (
            proptest::option::of(("[a-z]{0,4}", "[a-z]{0,4}")),
            any::<u64>(),
            prop::collection::vec(proptest::option::of(event), 0..8),
        )
            .prop_map(|(index, instance_id, events)| PublishEventsRequest {
                index: index.map(|(model, tenant)| IndexSelector { model, tenant }),
                instance_id,
                dp_rank: 0,
                seq: Some(3),
                block_size: 16,
                events: events.into_iter().map(|event| KvEvent { event }).collect(),
            })
    }

    proptest! {
        /// A message's count is its decoded form's size, and for bytes altered at random, no
        /// less than what prost decodes from them.
        #[test]
        fn counts_what_prost_decodes(
            request in publish_request(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..), 0..3),
            cut in any::<prop::sample::Index>(),
            tail in prop::collection::vec(any::<u8>(), 0..6),
        ) {
            let bytes = request.encode_to_vec();
            prop_assert_eq!(decoded_size(&PUBLISH_EVENTS_REQUEST, &bytes), size_of_publish(&request));
            let bytes = super::super::altered(bytes, &flips, cut, &tail);
            let counted = decoded_size(&PUBLISH_EVENTS_REQUEST, &bytes);
            if let Ok(decoded) = PublishEventsRequest::decode(bytes.as_slice()) {
                prop_assert!(counted >= size_of_publish(&decoded));
            }
            // What lets a short message go uncounted.
            prop_assert!(counted <= bytes.len() * MOST_BYTES_PER_BYTE + LARGEST_COUNTED_STRUCT);
        }

        #[test]
        fn counts_pod_identifiers(
            prompt in "[a-z ]{0,20}",
            pods in prop::collection::vec("[a-z0-9-]{0,12}", 0..10),
        ) {
            let request = GetPodScoresRequest {
                prompt,
                model_name: "m".into(),
                pod_identifiers: pods,
            };
            let bytes = request.encode_to_vec();
            let counted = decoded_size(&GET_POD_SCORES_REQUEST, &bytes);
            prop_assert_eq!(counted, size_of_pod_scores(&request));
            prop_assert!(counted <= bytes.len() * MOST_BYTES_PER_BYTE + LARGEST_COUNTED_STRUCT);
        }
    }

    /// Unpacked lists and a repeated singular message (merged by prost): counted as prost
    /// builds them.
    #[test]
    fn counts_the_layouts_prost_also_accepts() {
        // Two `removed` fields in one event, merged by prost; hashes unpacked (tag 1, varint).
        let removed = [0x08, 0x05, 0x08, 0x06];
        let mut event = Vec::new();
        for _ in 0..2 {
            event.push(0x12);
            event.push(removed.len() as u8);
            event.extend_from_slice(&removed);
        }
        let mut bytes = vec![0x32, event.len() as u8];
        bytes.extend_from_slice(&event);
        let decoded = PublishEventsRequest::decode(bytes.as_slice()).expect("prost decodes it");
        let Some(kv_event::Event::Removed(r)) = &decoded.events[0].event else {
            panic!("not a removal: {decoded:?}");
        };
        assert_eq!(r.block_hashes, [5, 6, 5, 6]);
        assert_eq!(
            decoded_size(&PUBLISH_EVENTS_REQUEST, &bytes),
            size_of_publish(&decoded)
        );
    }

    /// A packed run whose last varint or word continues past the run's end: prost reads it
    /// from the rest of the message and keeps it, then errs; it is counted.
    #[test]
    fn counts_a_last_element_read_past_its_run() {
        // An event removing hashes [5, 0x85 …]: the run's last byte continues into the next
        // field's key.
        let removed = [0x0a, 0x02, 0x05, 0x85, 0x10, 0x01];
        let mut bytes = vec![0x32, removed.len() as u8 + 2, 0x12, removed.len() as u8];
        bytes.extend_from_slice(&removed);
        assert!(PublishEventsRequest::decode(bytes.as_slice()).is_err());
        let event = size_of::<PublishEventsRequest>() + size_of::<KvEvent>();
        assert_eq!(decoded_size(&PUBLISH_EVENTS_REQUEST, &bytes), event + 2 * 8);
        // Local hashes packed in 9 bytes: two words counted (prost reads the second from the
        // rest of the message when 8 bytes remain).
        let stored = [0x22, 0x09, 1, 2, 3, 4, 5, 6, 7, 8, 9];
        let mut bytes = vec![0x32, stored.len() as u8 + 2, 0x0a, stored.len() as u8];
        bytes.extend_from_slice(&stored);
        assert!(PublishEventsRequest::decode(bytes.as_slice()).is_err());
        assert_eq!(decoded_size(&PUBLISH_EVENTS_REQUEST, &bytes), event + 2 * 8);
    }

    /// An empty event is 2 bytes and 144 in memory: the largest ratio of any request, and under
    /// the constant that lets short messages go uncounted.
    #[test]
    fn no_request_decodes_to_more_than_the_constant_per_byte() {
        for Counted { schema, .. } in COUNTED_REQUESTS {
            let mut most = 0;
            let mut stack = vec![*schema];
            while let Some(s) = stack.pop() {
                for &(_, field) in s.fields {
                    match field {
                        // The shortest element: a 1-byte key and a 1-byte length of 0.
                        Field::Messages(nested) => {
                            most = most.max(nested.size.div_ceil(2));
                            stack.push(nested);
                        }
                        Field::Message(nested) => stack.push(nested),
                        Field::Texts => most = most.max(size_of::<String>().div_ceil(2)),
                        Field::Varints(width) => most = most.max(width),
                        // A 1-byte packed run (3 bytes with key and length) counts a word.
                        Field::Fixed64s => most = most.max(8usize.div_ceil(3)),
                        Field::Text => most = most.max(1),
                    }
                }
            }
            assert!(
                most <= MOST_BYTES_PER_BYTE,
                "{}: {most} bytes per byte",
                schema.name
            );
        }
        assert_eq!(
            decoded_size(&PUBLISH_EVENTS_REQUEST, &[0x32, 0x00].repeat(1000)),
            size_of::<PublishEventsRequest>() + 1000 * size_of::<KvEvent>()
        );
    }

    #[test]
    fn refuses_only_counted_requests_over_the_bound() {
        let bytes = [0x32, 0x00].repeat(1000);
        let size = size_of::<PublishEventsRequest>() + 1000 * size_of::<KvEvent>();
        assert_eq!(
            over_bound::<PublishEventsRequest>(&bytes, size - 1).map(|(n, c)| (n, c.lists)),
            Some((size, "events"))
        );
        assert!(over_bound::<PublishEventsRequest>(&bytes, size).is_none());
        assert!(over_bound::<PublishEventsRequest>(&bytes, 0).is_none());
        // Other messages are not counted (every other RPC input is at most 8 bytes per byte;
        // `LogBatch` lists mutations but is read from the NATS stream, not decoded here).
        assert!(over_bound::<QueryRequest>(&bytes, 1).is_none());
        assert!(over_bound::<LogBatch>(&bytes, 1).is_none());
    }
}

/// The table against the `.proto` files' descriptors.
#[cfg(test)]
mod follows_the_protos {
    use std::collections::HashMap;

    use prost::Message;
    use prost_types::field_descriptor_proto::{Label, Type};
    use prost_types::{DescriptorProto, FileDescriptorSet};

    use super::{COUNTED_REQUESTS, Field, Schema};

    /// Every message of `set` by its full name (`.package.Name`).
    fn messages(set: &FileDescriptorSet) -> HashMap<String, &DescriptorProto> {
        fn add<'a>(
            prefix: &str,
            message: &'a DescriptorProto,
            into: &mut HashMap<String, &'a DescriptorProto>,
        ) {
            let name = format!("{prefix}.{}", message.name());
            for nested in &message.nested_type {
                add(&name, nested, into);
            }
            into.insert(name, message);
        }
        let mut all = HashMap::new();
        for file in &set.file {
            for message in &file.message_type {
                add(&format!(".{}", file.package()), message, &mut all);
            }
        }
        all
    }

    /// Whether a message reachable from `name` holds a list of messages or strings (more than
    /// 8 bytes of memory per byte).
    fn lists_elements(name: &str, all: &HashMap<String, &DescriptorProto>) -> bool {
        let mut stack = vec![name.to_owned()];
        let mut seen = Vec::new();
        while let Some(name) = stack.pop() {
            if seen.contains(&name) {
                continue;
            }
            let message = all[&name];
            seen.push(name);
            for f in &message.field {
                let repeated = f.label() == Label::Repeated;
                match f.r#type() {
                    Type::Message => {
                        if repeated {
                            return true;
                        }
                        stack.push(f.type_name().to_owned());
                    }
                    Type::String | Type::Bytes if repeated => return true,
                    _ => {}
                }
            }
        }
        false
    }

    /// `schema` names exactly the fields of `message` that take memory, each as it decodes.
    fn check(schema: &Schema, message: &DescriptorProto, all: &HashMap<String, &DescriptorProto>) {
        let full = |s: &Schema| format!(".{}", s.name);
        for f in &message.field {
            let number = u32::try_from(f.number()).expect("a positive field number");
            let listed = schema
                .fields
                .iter()
                .find(|(n, _)| *n == number)
                .map(|&(_, k)| k);
            let repeated = f.label() == Label::Repeated;
            let what = format!("{}.{}", schema.name, f.name());
            match (f.r#type(), repeated, listed) {
                (Type::Message, false, Some(Field::Message(nested)))
                | (Type::Message, true, Some(Field::Messages(nested))) => {
                    assert_eq!(full(nested), f.type_name(), "{what}");
                    check(nested, all[f.type_name()], all);
                }
                (Type::String | Type::Bytes, false, Some(Field::Text))
                | (Type::String | Type::Bytes, true, Some(Field::Texts))
                | (Type::Fixed64 | Type::Sfixed64 | Type::Double, true, Some(Field::Fixed64s)) => {}
                (Type::Uint64 | Type::Int64 | Type::Sint64, true, Some(Field::Varints(8)))
                | (
                    Type::Uint32 | Type::Int32 | Type::Sint32 | Type::Enum,
                    true,
                    Some(Field::Varints(4)),
                ) => {}
                (
                    Type::Uint64
                    | Type::Int64
                    | Type::Sint64
                    | Type::Uint32
                    | Type::Int32
                    | Type::Sint32
                    | Type::Enum
                    | Type::Bool
                    | Type::Fixed64
                    | Type::Sfixed64
                    | Type::Double
                    | Type::Fixed32
                    | Type::Sfixed32
                    | Type::Float,
                    false,
                    None,
                ) => {}
                (kind, repeated, listed) => {
                    panic!("{what}: {kind:?} (repeated: {repeated}) is counted as {listed:?}")
                }
            }
        }
        for (number, _) in schema.fields {
            assert!(
                message
                    .field
                    .iter()
                    .any(|f| f.number() == i32::try_from(*number).unwrap_or(0)),
                "{}: no field {number}",
                schema.name
            );
        }
    }

    /// Every request of both services that can reach a list of messages or strings is in the
    /// table, every request in the table can, and its fields are the descriptor's.
    #[test]
    fn the_table_follows_the_protos() {
        let mut requests = 0;
        for bytes in [
            crate::v1::FILE_DESCRIPTOR_SET,
            crate::llmd::indexer::v1::FILE_DESCRIPTOR_SET,
        ] {
            let set = FileDescriptorSet::decode(bytes).expect("the descriptor set decodes");
            let all = messages(&set);
            for service in set.file.iter().flat_map(|f| &f.service) {
                for method in &service.method {
                    requests += 1;
                    let input = method.input_type();
                    let listed = COUNTED_REQUESTS
                        .iter()
                        .find(|c| format!(".{}", c.schema.name) == input);
                    assert_eq!(
                        listed.is_some(),
                        lists_elements(input, &all),
                        "{input} (of {}) and the table disagree",
                        method.name()
                    );
                    if let Some(counted) = listed {
                        check(counted.schema, all[input], &all);
                    }
                }
            }
        }
        assert!(requests >= 9, "{requests} methods found");
    }
}
