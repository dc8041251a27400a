//! Fuzz target: any bytes through the KV-event batch decoder and the converter (both engine
//! kinds, two block sizes), and through the replay-frame parser. Must never panic, and ASan /
//! `-rss_limit_mb` catch unbounded allocation. The decoder must also agree with itself run on
//! `rmp-serde`'s deserializer (no fast paths): the same batch, or the same error.

#![no_main]

use kvatlas_events::decode::decode_batch_rmp_serde;
use kvatlas_events::{
    Converter, DropCounters, EngineKind, Source, decode_batch, decode_replay_reply,
};
use kvatlas_hash::BlockSize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match (decode_batch(data), decode_batch_rmp_serde(data)) {
        // Through `Debug`, so that a NaN timestamp compares equal.
        (Ok(fast), Ok(reference)) => assert_eq!(format!("{fast:?}"), format!("{reference:?}")),
        (Err(fast), Err(reference)) => {
            assert_eq!(fast.reason(), reference.reason());
            assert_eq!(fast.to_string(), reference.to_string());
        }
        (fast, reference) => panic!("fast path {fast:?} != reference {reference:?}"),
    }
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        for block_size in [2, 16] {
            let Ok(block_size) = BlockSize::new(block_size) else {
                return;
            };
            let converter = Converter::new(Source {
                worker_id: 1,
                dp_rank: 0,
                block_size,
                engine,
            });
            let (mut out, mut drops) = (Vec::new(), DropCounters::new());
            let _ = converter.ingest(data, &mut out, &mut drops);
        }
    }
    // The same bytes cut into frames at the first two 0x00 bytes, as a replay reply.
    let mut frames: Vec<&[u8]> = data.splitn(4, |b| *b == 0).collect();
    frames.truncate(4);
    let _ = decode_replay_reply(&frames);
});
