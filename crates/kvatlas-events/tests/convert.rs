//! Conversion policy: decoded fixtures → index mutations, with every drop counted by reason.

mod common;

use common::*;
use kvatlas_events::{
    Converter, DecodeError, DropCounters, EngineKind, Reason, Source, decode_batch,
};
use kvatlas_hash::{BlockHasher, BlockSize, LocalBlockHash};
use kvatlas_index::{ExternalBlockHash, Mutation, StoredBlock, Tier, Worker};

const WORKER: u64 = 7;

fn converter(block_size: u32, engine: EngineKind) -> Converter {
    Converter::new(Source {
        worker_id: WORKER,
        dp_rank: 0,
        block_size: BlockSize::new(block_size).expect("valid block size"),
        engine,
    })
}

fn ingest(conv: &Converter, bytes: &[u8]) -> (Vec<Mutation>, DropCounters) {
    let (mut out, mut drops) = (Vec::new(), DropCounters::new());
    conv.ingest(bytes, &mut out, &mut drops)
        .expect("batch decodes");
    (out, drops)
}

fn locals(block_size: u32, lora: Option<&str>, salt: Option<&str>, tokens: &[u32]) -> Vec<u64> {
    let hasher = BlockHasher::new(block_size)
        .expect("valid")
        .with_options(lora, salt);
    tokens
        .chunks_exact(block_size as usize)
        .map(|c| hasher.hash_block(c).get())
        .collect()
}

fn stored_blocks(m: &Mutation) -> (Worker, Tier, Option<u64>, Vec<(u64, u64)>) {
    match m {
        Mutation::Stored {
            worker,
            tier,
            parent,
            blocks,
        } => (
            *worker,
            *tier,
            parent.map(ExternalBlockHash::get),
            blocks
                .iter()
                .map(|b| (b.external.get(), b.local.get()))
                .collect(),
        ),
        other => panic!("expected Stored, got {other:?}"),
    }
}

fn only(drops: &DropCounters, reason: Reason, n: u64) {
    assert_eq!(drops.get(reason), n, "{drops:?}");
    assert_eq!(drops.total(), n, "{drops:?}");
}

#[test]
fn real_vllm_0_33_0_batch_becomes_a_device_remove_and_a_host_store() {
    let (out, drops) = ingest(&converter(16, EngineKind::Vllm), &hexb(VLLM_0_33_0_HEX));
    assert_eq!(drops.total(), 0);
    let worker = Worker::new(WORKER, 0);
    let tokens: Vec<u32> = (1032..1048).collect();
    let local = LocalBlockHash::new(locals(16, None, None, &tokens)[0]);
    assert_eq!(
        out,
        vec![
            Mutation::Removed {
                worker,
                tier: Tier::Device,
                blocks: vec![ExternalBlockHash::new(H_0_33)],
            },
            Mutation::Stored {
                worker,
                tier: Tier::Host,
                parent: Some(ExternalBlockHash::new(H2)),
                blocks: vec![StoredBlock {
                    external: ExternalBlockHash::new(H_0_33),
                    local,
                }],
            },
        ]
    );
}

#[test]
fn real_array_layout_and_cleared() {
    let (out, drops) = ingest(&converter(2, EngineKind::Vllm), &hexb(VLLM_0_23_0_ARRAY));
    assert_eq!(drops.total(), 0);
    assert_eq!(out.len(), 3);
    let (_, tier, parent, blocks) = stored_blocks(&out[0]);
    assert_eq!((tier, parent), (Tier::Device, None));
    let expected = locals(2, None, None, &[1000, 1001, 1002, 1003]);
    assert_eq!(blocks, vec![(H1, expected[0]), (H2, expected[1])]);
    assert_eq!(
        out[2],
        Mutation::Cleared {
            worker: Worker::new(WORKER, 0)
        }
    );
    let (out, _) = ingest(&converter(16, EngineKind::Vllm), &hexb(VLLM_0_33_0_CLEARED));
    assert_eq!(
        out,
        vec![Mutation::Cleared {
            worker: Worker::new(WORKER, 0)
        }]
    );
}

#[test]
fn batch_rank_overrides_the_registered_rank() {
    let conv = Converter::new(Source {
        worker_id: WORKER,
        dp_rank: 4,
        block_size: BlockSize::new(16).expect("valid"),
        engine: EngineKind::Vllm,
    });
    let (out, _) = ingest(&conv, &vllm_0_10_2());
    assert!(out.iter().all(|m| m.worker() == Worker::new(WORKER, 1)));
    let (out, _) = ingest(&conv, &vllm_0_9_0());
    assert!(out.iter().all(|m| m.worker() == Worker::new(WORKER, 4)));
    assert_eq!(out.len(), 2);
    // 0.10.2's removal is on the CPU tier.
    let (out, _) = ingest(&conv, &vllm_0_10_2());
    assert!(matches!(
        out[1],
        Mutation::Removed {
            tier: Tier::Host,
            ..
        }
    ));
}

#[test]
fn lora_and_salt_are_mixed_in_like_a_router_query() {
    // Dynamo golden vectors (`docs/hashing.md`): tokens 1..=8, block size 4.
    let (out, drops) = ingest(&converter(4, EngineKind::Vllm), &vllm_0_14_lora());
    assert_eq!(drops.total(), 0);
    assert_eq!(stored_blocks(&out[0]).3, vec![(H1, 0xd97c_824a_0d4b_dab1)]);

    let (out, _) = ingest(
        &converter(4, EngineKind::Vllm),
        &vllm_0_17_extra_keys_salt(),
    );
    assert_eq!(
        stored_blocks(&out[0]).3,
        vec![(H1, 0x4fa3_e809_7233_e995), (H2, 0x9b76_51d1_fc72_8ccb)]
    );

    let (out, drops) = ingest(&converter(4, EngineKind::Sglang), &sglang_0_5_18_metadata());
    assert_eq!(drops.total(), 0);
    assert!(out.iter().all(|m| m.worker() == Worker::new(WORKER, 2)));
    assert_eq!(stored_blocks(&out[0]).3[0].1, 0x4fa3_e809_7233_e995);
    assert_eq!(stored_blocks(&out[1]).3[0].1, 0xcb38_e4d7_fb2d_ca5c);
    assert_eq!(stored_blocks(&out[2]).3[0].1, 0xcb38_e4d7_fb2d_ca5c);
}

#[test]
fn sglang_map_layout_tiers_salts_and_lora() {
    let (out, drops) = ingest(&converter(4, EngineKind::Sglang), &sglang_0_5_20_map());
    assert_eq!(drops.total(), 0);
    let tokens: Vec<u32> = (1..=8).collect();
    let (worker, tier, parent, blocks) = stored_blocks(&out[0]);
    assert_eq!(worker, Worker::new(WORKER, 1));
    assert_eq!((tier, parent), (Tier::Host, Some((-10i64) as u64)));
    let expected = locals(4, None, Some("tenant-a"), &tokens);
    assert_eq!(
        blocks,
        vec![
            ((-11i64) as u64, expected[0]),
            ((-12i64) as u64, expected[1])
        ]
    );
    let expected = locals(4, Some("my-lora"), Some("tenant-b"), &tokens[..4]);
    assert_eq!(stored_blocks(&out[1]).3[0].1, expected[0]);
    assert!(matches!(
        out[2],
        Mutation::Removed {
            tier: Tier::Disk,
            ..
        }
    ));
}

#[test]
fn eagle_pairs_hash_the_page_tokens() {
    let (out, drops) = ingest(&converter(4, EngineKind::Sglang), &sglang_eagle_pairs());
    assert_eq!(drops.total(), 0);
    assert_eq!(stored_blocks(&out[0]).3[0].1, 0xcb38_e4d7_fb2d_ca5c);
}

#[test]
fn bin_hashes_become_external_ids() {
    let (out, _) = ingest(&converter(4, EngineKind::Vllm), &bin_hashes());
    let (_, _, parent, blocks) = stored_blocks(&out[0]);
    assert_eq!(parent, Some(0x0001_0203_0405_0607));
    assert_eq!(blocks[0].0, H1);
}

#[test]
fn sglang_partial_last_page_is_dropped_and_counted() {
    let (out, drops) = ingest(&converter(4, EngineKind::Sglang), &sglang_partial_page());
    assert_eq!(out.len(), 1);
    only(&drops, Reason::PartialPage, 1);
    // The same bytes from a vLLM source: a block-size mismatch, loudly.
    let (out, drops) = ingest(&converter(4, EngineKind::Vllm), &sglang_partial_page());
    assert_eq!(out.len(), 1);
    only(&drops, Reason::BlockSizeMismatch, 1);

    // A coalesced run whose last page is partial: full pages kept.
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.arr(7)
        .s("BlockStored")
        .arr(2)
        .i(-1)
        .i(-2)
        .nil()
        .tokens(1..=6)
        .u(4)
        .nil()
        .nil();
    w.nil();
    let (out, drops) = ingest(&converter(4, EngineKind::Sglang), &w.bytes());
    assert_eq!(stored_blocks(&out[0]).3.len(), 1);
    only(&drops, Reason::PartialPage, 1);
    let (out, drops) = ingest(&converter(4, EngineKind::Vllm), &w.bytes());
    assert!(out.is_empty());
    only(&drops, Reason::TokenCountMismatch, 1);
}

#[test]
fn block_size_mismatch_is_counted_never_an_empty_store() {
    let (out, drops) = ingest(&converter(8, EngineKind::Vllm), &vllm_0_9_0());
    assert_eq!(out.len(), 1, "only the removal: {out:?}");
    only(&drops, Reason::BlockSizeMismatch, 1);
}

#[test]
fn filters_groups_kinds_and_multimodal() {
    let (out, drops) = ingest(&converter(4, EngineKind::Vllm), &vllm_0_20_groups());
    assert_eq!(out.len(), 1);
    only(&drops, Reason::NonMainGroup, 2);
    let (out, drops) = ingest(&converter(4, EngineKind::Vllm), &vllm_0_23_kinds());
    assert_eq!(out.len(), 1);
    only(&drops, Reason::NonFullAttentionKind, 1);
    let (out, drops) = ingest(&converter(4, EngineKind::Vllm), &vllm_0_17_multimodal());
    assert!(out.is_empty());
    only(&drops, Reason::NonTokenContent, 1);
    let (out, drops) = ingest(
        &converter(16, EngineKind::Vllm),
        &vllm_0_33_map16_all_keys(),
    );
    assert_eq!(out.len(), 1, "LOCAL, full_attention, group 0: {drops:?}");
}

#[test]
fn tokenless_unknown_medium_locality_ownership_and_unnamed_lora() {
    let (out, drops) = ingest(&converter(16, EngineKind::Vllm), &tokenless_offload());
    assert!(out.is_empty());
    only(&drops, Reason::Tokenless, 1);

    let event = |medium: &str, extra: &dyn Fn(&mut W)| {
        let mut w = W::new();
        w.arr(3).f(TS).arr(1).map(8);
        w.s("type").s("BlockStored").s("block_hashes").u64s(&[H1]);
        w.s("parent_block_hash").nil().s("token_ids").tokens(1..=4);
        w.s("block_size").u(4).s("medium").s(medium);
        extra(&mut w);
        w.u(0);
        w.bytes()
    };
    let none = |w: &mut W| {
        w.s("lora_id").nil().s("x").nil();
    };
    let conv = converter(4, EngineKind::Vllm);
    let (out, drops) = ingest(&conv, &event("cpu", &none));
    assert!(matches!(
        out[..],
        [Mutation::Stored {
            tier: Tier::Host,
            ..
        }]
    ));
    assert_eq!(drops.total(), 0);
    let (_, drops) = ingest(&conv, &event("my-connector", &none));
    only(&drops, Reason::UnknownMedium, 1);
    let (_, drops) = ingest(
        &conv,
        &event("CPU", &|w| {
            w.s("locality").s("REMOTE").s("lora_id").nil();
        }),
    );
    only(&drops, Reason::NonLocalLocality, 1);
    let (_, drops) = ingest(
        &conv,
        &event("CPU", &|w| {
            w.s("ownership").s("kvcr").s("lora_id").nil();
        }),
    );
    only(&drops, Reason::ForeignOwnership, 1);
    let (_, drops) = ingest(
        &conv,
        &event("GPU", &|w| {
            w.s("lora_id").u(3).s("lora_name").nil();
        }),
    );
    only(&drops, Reason::UnnamedLora, 1);
}

#[test]
fn skipped_events_are_counted_and_the_rest_applied() {
    let (out, drops) = ingest(&converter(16, EngineKind::Vllm), &unknown_tag_in_middle());
    assert_eq!(out.len(), 2);
    assert_eq!(drops.get(Reason::UnknownEventType), 1);
    assert_eq!(drops.get(Reason::MalformedEvent), 2);
    assert_eq!(drops.total(), 3);
}

#[test]
fn a_negative_rank_rejects_the_batch_with_a_counted_error() {
    let conv = converter(16, EngineKind::Vllm);
    let (mut out, mut drops) = (Vec::new(), DropCounters::new());
    let err = conv
        .ingest(&negative_dp_rank(), &mut out, &mut drops)
        .expect_err("negative rank");
    assert!(matches!(err, DecodeError::NegativeDpRank(-1)));
    assert!(out.is_empty());
    only(&drops, Reason::NegativeDpRank, 1);
    let err = conv
        .ingest(b"\xc1", &mut out, &mut drops)
        .expect_err("reserved marker");
    assert_eq!(err.reason(), Reason::MalformedBatch);
    assert_eq!(drops.get(Reason::MalformedBatch), 1);
}

#[test]
fn decode_then_convert_batch_matches_ingest() {
    let conv = converter(16, EngineKind::Vllm);
    let batch = decode_batch(&vllm_0_24_map()).expect("decodes");
    let (mut out, mut drops) = (Vec::new(), DropCounters::new());
    conv.convert_batch(&batch, &mut out, &mut drops);
    assert_eq!((out.clone(), drops), ingest(&conv, &vllm_0_24_map()));
    assert_eq!(out.len(), 3);
}
