//! Byte-exact decoding fixtures: the real bytes of `docs/events.md` §7.5 and one fixture per
//! layout/version row of §7.2 (and of the accepted forms of §1), each decoding to the documented
//! values.

mod common;

use common::*;
use kvatlas_events::{
    BlockRemoved, BlockStored, DecodeError, Event, EventBatch, Reason, SaltSource, decode_batch,
};

/// A `BlockStored` with the fields `set` gives (the type is `#[non_exhaustive]`).
fn block_stored(set: impl FnOnce(&mut BlockStored)) -> BlockStored {
    let mut event = BlockStored::default();
    set(&mut event);
    event
}

/// A `BlockRemoved` with the fields `set` gives.
fn block_removed(set: impl FnOnce(&mut BlockRemoved)) -> BlockRemoved {
    let mut event = BlockRemoved::default();
    set(&mut event);
    event
}

fn decode(bytes: &[u8]) -> EventBatch {
    decode_batch(bytes).expect("fixture decodes")
}

fn stored(event: &Event) -> &BlockStored {
    match event {
        Event::BlockStored(s) => s,
        other => panic!("expected BlockStored, got {other:?}"),
    }
}

fn removed(event: &Event) -> &BlockRemoved {
    match event {
        Event::BlockRemoved(r) => r,
        other => panic!("expected BlockRemoved, got {other:?}"),
    }
}

#[test]
fn real_vllm_0_33_0_batch_decodes_to_the_annotated_values() {
    let bytes = hexb(VLLM_0_33_0_HEX);
    assert_eq!(bytes.len(), 250);
    let batch = decode(&bytes);
    assert_eq!(batch.ts, 1_795_317_349.223_048_4);
    assert_eq!(batch.dp_rank, Some(0));
    assert!(batch.skipped.is_empty());
    assert_eq!(
        batch.events,
        vec![
            Event::BlockRemoved(block_removed(|e| {
                e.block_hashes = vec![H_0_33];
                e.medium = Some("GPU".into());
                e.group_idx = Some(0);
                e.locality = None;
                e.ownership = None;
            })),
            Event::BlockStored(Box::new(block_stored(|e| {
                e.block_hashes = vec![H_0_33];
                e.parent_block_hash = Some(H2);
                e.token_ids = (1032..=1047).collect();
                e.block_size = Some(16);
                e.medium = Some("CPU".into());
            }))),
        ]
    );
}

#[test]
fn real_vllm_0_33_0_all_blocks_cleared() {
    let bytes = hexb(VLLM_0_33_0_CLEARED);
    assert_eq!(bytes.len(), 35);
    let batch = decode(&bytes);
    assert_eq!(batch.ts, 1_795_317_349.223_059_2);
    assert_eq!(batch.events, vec![Event::AllBlocksCleared]);
    assert_eq!(batch.dp_rank, Some(0));
}

#[test]
fn real_vllm_0_23_0_array_layout() {
    let bytes = hexb(VLLM_0_23_0_ARRAY);
    assert_eq!(bytes.len(), 116);
    let batch = decode(&bytes);
    assert_eq!(batch.ts, 1_700_000_000.5);
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(
        batch.events,
        vec![
            Event::BlockStored(Box::new(block_stored(|e| {
                e.block_hashes = vec![H1, H2];
                e.parent_block_hash = None;
                e.token_ids = vec![1000, 1001, 1002, 1003];
                e.block_size = Some(2);
                e.medium = Some("GPU".into());
                e.group_idx = Some(0);
            }))),
            Event::BlockRemoved(block_removed(|e| {
                e.block_hashes = vec![H2];
                e.medium = Some("GPU".into());
                e.group_idx = Some(0);
            })),
            Event::AllBlocksCleared,
        ]
    );
}

#[test]
fn vllm_0_9_0_two_element_batch_and_six_element_store() {
    let batch = decode(&vllm_0_9_0());
    assert_eq!(batch.dp_rank, None);
    assert_eq!(batch.events.len(), 2);
    let s = stored(&batch.events[0]);
    assert_eq!(s.block_hashes, vec![H1, H2]);
    assert_eq!(s.token_ids, two_blocks().collect::<Vec<_>>());
    assert_eq!(
        (s.block_size, s.lora_id, &s.medium),
        (Some(16), None, &None)
    );
    assert_eq!(removed(&batch.events[1]).block_hashes, vec![H3]);
    assert_eq!(removed(&batch.events[1]).medium, None);
}

#[test]
fn vllm_0_10_2_seven_element_store_with_medium() {
    let batch = decode(&vllm_0_10_2());
    assert_eq!(batch.dp_rank, Some(1));
    assert_eq!(stored(&batch.events[0]).medium.as_deref(), Some("GPU"));
    assert_eq!(removed(&batch.events[1]).medium.as_deref(), Some("CPU"));
}

#[test]
fn vllm_0_14_lora_name_at_position_7() {
    let batch = decode(&vllm_0_14_lora());
    assert_eq!(batch.dp_rank, None);
    let s = stored(&batch.events[0]);
    assert_eq!(s.lora_name.as_deref(), Some("my-lora"));
    assert_eq!(s.lora_id, Some(1));
}

#[test]
fn vllm_0_17_extra_keys_carry_a_dynamo_salt_and_multimodal_flags() {
    let s = decode(&vllm_0_17_extra_keys_salt()).events[0].clone();
    let s = stored(&s);
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(s.salt_source, Some(SaltSource::ExtraKeys));
    assert!(!s.non_token_extra_keys);

    let mm = decode(&vllm_0_17_multimodal()).events[0].clone();
    assert!(stored(&mm).non_token_extra_keys);
    assert_eq!(stored(&mm).cache_salt, None);
}

#[test]
fn vllm_0_20_group_idx_on_both_events() {
    let batch = decode(&vllm_0_20_groups());
    assert_eq!(stored(&batch.events[0]).group_idx, Some(0));
    assert_eq!(stored(&batch.events[1]).group_idx, Some(1));
    assert_eq!(removed(&batch.events[2]).group_idx, Some(1));
}

#[test]
fn vllm_0_23_twelve_element_store_with_kind_and_window() {
    let batch = decode(&vllm_0_23_kinds());
    let full = stored(&batch.events[0]);
    assert_eq!(full.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(full.kv_cache_spec_sliding_window, None);
    let window = stored(&batch.events[1]);
    assert_eq!(window.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
    assert_eq!(window.kv_cache_spec_sliding_window, Some(128));
}

#[test]
fn vllm_0_24_tagged_maps() {
    let batch = decode(&vllm_0_24_map());
    assert_eq!(batch.events.len(), 3);
    let s = stored(&batch.events[0]);
    assert_eq!(s.block_hashes, vec![H1, H2]);
    assert_eq!(s.parent_block_hash, None);
    assert_eq!(s.block_size, Some(16));
    assert_eq!(removed(&batch.events[1]).block_hashes, vec![H3]);
    assert_eq!(batch.events[2], Event::AllBlocksCleared);
}

#[test]
fn vllm_0_33_map16_with_every_optional_key_in_any_order() {
    let bytes = vllm_0_33_map16_all_keys();
    assert_eq!(&bytes[11..14], &[0xde, 0x00, 0x10], "map16 header");
    let batch = decode(&bytes);
    assert!(batch.skipped.is_empty(), "{:?}", batch.skipped);
    let s = stored(&batch.events[0]);
    assert_eq!(s.block_hashes, vec![H3]);
    assert_eq!(s.parent_block_hash, Some(H2));
    assert_eq!(s.token_ids, (1032..1048).collect::<Vec<_>>());
    assert_eq!(s.group_idx, Some(0));
    assert_eq!(s.locality.as_deref(), Some("LOCAL"));
    assert_eq!(s.session_id.as_deref(), Some("sess-1"));
    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
}

#[test]
fn sglang_negative_int64_hashes_are_twos_complement() {
    let batch = decode(&sglang_0_5_5_negative());
    let s = stored(&batch.events[0]);
    assert_eq!(
        s.block_hashes,
        vec![(-2i64) as u64, (-3_000_000_000_000i64) as u64]
    );
    assert_eq!(s.parent_block_hash, Some(u64::MAX), "parent -1");
    assert_eq!(
        removed(&batch.events[1]).block_hashes,
        vec![(-2i64) as u64, (-3_000_000_000_000i64) as u64]
    );
}

#[test]
fn sglang_positional_metadata_map_with_and_without_salt() {
    let batch = decode(&sglang_0_5_18_metadata());
    assert_eq!(batch.dp_rank, Some(2));
    assert!(batch.skipped.is_empty(), "{:?}", batch.skipped);
    let salted = stored(&batch.events[0]);
    assert_eq!(salted.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(salted.salt_source, Some(SaltSource::PositionalMetadata));
    assert_eq!(salted.lora_name, None);
    assert_eq!(stored(&batch.events[1]).cache_salt, None);
    let no_salt = stored(&batch.events[2]);
    assert_eq!((&no_salt.cache_salt, no_salt.salt_source), (&None, None));
    assert_eq!(no_salt.block_hashes, vec![(-7i64) as u64]);
}

#[test]
fn sglang_map_layout_salt_sources_and_attn_dp_rank() {
    let batch = decode(&sglang_0_5_20_map());
    assert_eq!(batch.dp_rank, Some(1));
    let a = stored(&batch.events[0]);
    assert_eq!(a.block_hashes, vec![(-11i64) as u64, (-12i64) as u64]);
    assert_eq!(a.parent_block_hash, Some((-10i64) as u64));
    assert_eq!(a.medium.as_deref(), Some("CPU_PINNED"));
    assert_eq!(a.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(a.salt_source, Some(SaltSource::TopLevel));
    assert_eq!(a.session_id.as_deref(), Some("s-9"));
    let b = stored(&batch.events[1]);
    assert_eq!(b.lora_name.as_deref(), Some("my-lora"));
    assert_eq!(b.cache_salt.as_deref(), Some("tenant-b"));
    assert_eq!(b.salt_source, Some(SaltSource::Metadata));
    assert_eq!(removed(&batch.events[2]).medium.as_deref(), Some("DISK"));
}

#[test]
fn eagle_pairs_flatten_to_firsts_plus_last_second() {
    let s = decode(&sglang_eagle_pairs()).events[0].clone();
    let s = stored(&s);
    assert!(s.pair_encoded);
    assert_eq!(s.token_ids, vec![1, 2, 3, 4, 5]);
}

#[test]
fn bin_hashes_of_32_and_7_bytes() {
    let s = decode(&bin_hashes()).events[0].clone();
    let s = stored(&s);
    assert_eq!(s.block_hashes, vec![H1]);
    assert_eq!(s.parent_block_hash, Some(0x0001_0203_0405_0607));
}

#[test]
fn an_unknown_tag_or_a_malformed_event_skips_only_that_event() {
    let batch = decode(&unknown_tag_in_middle());
    assert_eq!(
        batch.events,
        vec![
            Event::BlockRemoved(block_removed(|e| {
                e.block_hashes = vec![H1];
            })),
            Event::AllBlocksCleared,
        ]
    );
    let skipped: Vec<_> = batch.skipped.iter().map(|s| (s.index, s.reason)).collect();
    assert_eq!(
        skipped,
        vec![
            (1, Reason::UnknownEventType),
            (2, Reason::MalformedEvent),
            (3, Reason::MalformedEvent),
        ]
    );
}

#[test]
fn map_batches_with_either_rank_key() {
    let batch = decode(&map_batch());
    assert_eq!(batch.ts, 1_700_000_000.0);
    assert_eq!(batch.dp_rank, Some(3));
    assert_eq!(batch.events, vec![Event::AllBlocksCleared]);
    let batch = decode(&map_batch_attn_dp_rank());
    assert_eq!((batch.dp_rank, batch.events.len()), (Some(5), 0));
}

#[test]
fn tokenless_store_decodes_with_no_tokens() {
    let s = decode(&tokenless_offload()).events[0].clone();
    assert!(stored(&s).token_ids.is_empty());
    assert_eq!(stored(&s).medium.as_deref(), Some("CPU"));
}

#[test]
fn envelope_errors_are_typed() {
    assert!(matches!(
        decode_batch(&negative_dp_rank()),
        Err(DecodeError::NegativeDpRank(-1))
    ));
    let too_big = W::new().arr(3).f(TS).arr(0).u(1 << 40).bytes();
    assert!(matches!(
        decode_batch(&too_big),
        Err(DecodeError::DpRankOutOfRange(_))
    ));
    assert!(matches!(
        decode_batch(&W::new().arr(1).f(TS).bytes()),
        Err(DecodeError::TooShort { len: 1 })
    ));
    assert!(matches!(
        decode_batch(&W::new().arr(2).s("ts").arr(0).bytes()),
        Err(DecodeError::InvalidField("ts"))
    ));
    assert!(matches!(
        decode_batch(&W::new().arr(2).f(TS).map(0).bytes()),
        Err(DecodeError::InvalidField("events"))
    ));
    assert!(matches!(
        decode_batch(&W::new().map(1).s("ts").f(TS).bytes()),
        Err(DecodeError::MissingField("events"))
    ));
    assert!(matches!(
        decode_batch(&W::new().s("hello").bytes()),
        Err(DecodeError::NotABatch { .. })
    ));
    assert!(matches!(decode_batch(&[]), Err(DecodeError::Msgpack(_))));
    // Truncated inside an event: not msgpack any more, the batch fails as a whole.
    let bytes = hexb(VLLM_0_33_0_HEX);
    assert!(matches!(
        decode_batch(&bytes[..100]),
        Err(DecodeError::Msgpack(_))
    ));
    assert_eq!(
        DecodeError::NegativeDpRank(-1).reason(),
        Reason::NegativeDpRank
    );
}

/// A msgpack error keeps the parser's message and cause behind the crate's own `MsgpackError`
/// (the parser's error type is not part of the API).
#[test]
fn msgpack_errors_show_the_parsers_message_and_cause() {
    use std::error::Error as _;

    let err = decode_batch(&[]).expect_err("empty payload");
    assert_eq!(err.reason(), Reason::MalformedBatch);
    assert_eq!(
        err.to_string(),
        "payload is not well-formed msgpack: IO error while reading marker: failed to fill whole buffer"
    );
    let DecodeError::Msgpack(inner) = &err else {
        panic!("expected a msgpack error, got {err:?}");
    };
    assert_eq!(
        inner.to_string(),
        "IO error while reading marker: failed to fill whole buffer"
    );
    let source = err.source().expect("the msgpack error");
    assert_eq!(source.to_string(), inner.to_string());
    let cause = source.source().expect("the I/O error");
    assert_eq!(cause.to_string(), "failed to fill whole buffer");
    assert!(cause.source().is_none());

    let mut deep = hexb("92 00");
    deep.extend([0x91; 40]);
    deep.push(0xc0);
    let err = decode_batch(&deep).expect_err("too deep");
    assert_eq!(
        err.to_string(),
        "payload is not well-formed msgpack: depth limit exceeded"
    );
    assert!(err.source().is_some_and(|s| s.source().is_none()));
}

#[test]
fn trailing_elements_and_wrong_typed_fields() {
    // A positional store with 14 elements plus junk, and a removal whose medium is an int.
    let mut w = W::new();
    w.arr(3).f(TS).arr(2);
    w.arr(16)
        .s("BlockStored")
        .u64s(&[H1])
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU")
        .nil();
    w.nil()
        .u(0)
        .s("full_attention")
        .nil()
        .s("LOCAL")
        .nil()
        .u(99)
        .map(0);
    w.arr(3).s("BlockRemoved").u64s(&[H1]).u(7);
    w.u(0);
    let batch = decode(&w.bytes());
    assert_eq!(stored(&batch.events[0]).locality.as_deref(), Some("LOCAL"));
    assert_eq!(batch.skipped.len(), 1);
    assert_eq!(batch.skipped[0].reason, Reason::MalformedEvent);
    assert_eq!(batch.skipped[0].index, 1);
}

#[test]
fn nesting_beyond_the_depth_limit_is_an_error_not_a_stack_overflow() {
    let mut bytes = hexb("93 cb41d954fc40200000 91");
    bytes.extend(std::iter::repeat_n(0x91, 100_000));
    bytes.push(0xc0);
    assert!(matches!(decode_batch(&bytes), Err(DecodeError::Msgpack(_))));
}

#[test]
fn token_ids_in_every_int_width_decode_at_their_boundaries() {
    let batch = decode(&token_id_widths());
    assert!(batch.skipped.is_empty(), "{:?}", batch.skipped);
    assert_eq!(batch.dp_rank, None);
    let first = stored(&batch.events[0]);
    assert_eq!(
        first.token_ids,
        [0, 0x7f, 0x80, 0xff, 0x100, 0xffff, 0x1_0000, u32::MAX]
    );
    assert!(!first.pair_encoded);
    let second = stored(&batch.events[1]);
    assert_eq!(
        second.token_ids,
        [0x7f, 0x7fff, 0x7fff_ffff, u32::MAX, u32::MAX, 0, 0, 5]
    );
    assert_eq!(second.parent_block_hash, Some(H2));
}

#[test]
fn token_ids_the_fast_path_declines_keep_their_meaning() {
    let batch = decode(&token_id_fallbacks());
    let skipped: Vec<(usize, Reason, &str)> = batch
        .skipped
        .iter()
        .map(|s| (s.index, s.reason, s.detail))
        .collect();
    let detail = "`token_ids` is not an array of u32 or pairs";
    assert_eq!(
        skipped,
        [1, 2, 3, 4].map(|index| (index, Reason::MalformedEvent, detail))
    );
    assert_eq!(batch.events.len(), 3);
    assert_eq!(stored(&batch.events[0]).token_ids, [1, 2]);
    let pairs = stored(&batch.events[1]);
    assert!(pairs.pair_encoded);
    assert_eq!(pairs.token_ids, [5, 6, 7]);
    assert_eq!(stored(&batch.events[2]).token_ids, [0x1234, 5]);
}

/// The committed fuzz seed corpus (`fuzz/corpus/decode_batch/`) holds every fixture, byte for
/// byte: what `cargo xtask fuzz-corpus` writes (`examples/fuzz_corpus.rs`). Entries libFuzzer
/// adds while running are other files and are not looked at.
#[test]
fn the_fuzz_seed_corpus_is_every_fixture() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/decode_batch");
    for (name, bytes) in all() {
        let seed = std::fs::read(dir.join(name))
            .unwrap_or_else(|e| panic!("seed `{name}`: {e} (run `cargo xtask fuzz-corpus`)"));
        assert!(
            seed == bytes,
            "seed `{name}` differs from its fixture (run `cargo xtask fuzz-corpus`)"
        );
    }
}
