//! Byte-exact msgpack fixtures for every layout and version row of `docs/events.md` §1 and §7,
//! shared by the integration tests (and written out as the fuzz seed corpus by
//! `examples/fuzz_corpus.rs`, which `cargo xtask fuzz-corpus` runs).

#![allow(dead_code, unreachable_pub)] // shared by several test binaries, each using a part

/// Real vLLM hashes (`sha256`, tokens 1000.., block size 16; `docs/events.md` §7.3): H1 and H2
/// the first two blocks, H3 a third after them (vLLM 0.32.0), H_0_33 from the real 0.33.0 batch
/// (§7.5).
pub const H1: u64 = 7_322_446_309_363_477_352;
pub const H2: u64 = 17_027_874_615_116_373_601;
pub const H3: u64 = 3_250_420_131_345_999_776;
pub const H_0_33: u64 = 2_147_986_591_436_168_966;
pub const TS: f64 = 1_700_000_000.5;

/// Bytes from a hex string; whitespace is ignored and `"..."` inserts UTF-8 text verbatim.
pub fn hexb(spec: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut parts = spec.split('"');
    let mut in_text = false;
    for part in parts.by_ref() {
        if in_text {
            out.extend_from_slice(part.as_bytes());
        } else {
            let digits: Vec<u8> = part.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
            assert!(digits.len().is_multiple_of(2), "odd hex digits in {part:?}");
            for pair in digits.chunks(2) {
                let text = std::str::from_utf8(pair).expect("ascii");
                out.push(u8::from_str_radix(text, 16).expect("hex digit"));
            }
        }
        in_text = !in_text;
    }
    out
}

/// A msgpack writer over `rmp`'s primitives (each call writes exactly one marker + data).
#[derive(Debug, Default)]
pub struct W(pub Vec<u8>);

impl W {
    pub fn new() -> Self {
        Self(Vec::new())
    }
    pub fn arr(&mut self, n: u32) -> &mut Self {
        rmp::encode::write_array_len(&mut self.0, n).expect("vec write");
        self
    }
    pub fn map(&mut self, n: u32) -> &mut Self {
        rmp::encode::write_map_len(&mut self.0, n).expect("vec write");
        self
    }
    /// A `map16` header even for a small map (msgspec does this for wide structs).
    pub fn map16(&mut self, n: u16) -> &mut Self {
        self.0.push(0xde);
        self.0.extend_from_slice(&n.to_be_bytes());
        self
    }
    /// An `array16` header even for a small array.
    pub fn arr16(&mut self, n: u16) -> &mut Self {
        self.0.push(0xdc);
        self.0.extend_from_slice(&n.to_be_bytes());
        self
    }
    pub fn s(&mut self, v: &str) -> &mut Self {
        rmp::encode::write_str(&mut self.0, v).expect("vec write");
        self
    }
    pub fn u(&mut self, v: u64) -> &mut Self {
        rmp::encode::write_uint(&mut self.0, v).expect("vec write");
        self
    }
    /// A `uint64` (`cf`) whatever the value, as vLLM does for hashes ≥ 2^63.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        rmp::encode::write_u64(&mut self.0, v).expect("vec write");
        self
    }
    /// An `int64` (`d3`), as SGLang writes negative hashes.
    pub fn i64(&mut self, v: i64) -> &mut Self {
        rmp::encode::write_i64(&mut self.0, v).expect("vec write");
        self
    }
    pub fn i(&mut self, v: i64) -> &mut Self {
        rmp::encode::write_sint(&mut self.0, v).expect("vec write");
        self
    }
    pub fn f(&mut self, v: f64) -> &mut Self {
        rmp::encode::write_f64(&mut self.0, v).expect("vec write");
        self
    }
    pub fn nil(&mut self) -> &mut Self {
        rmp::encode::write_nil(&mut self.0).expect("vec write");
        self
    }
    pub fn bool(&mut self, v: bool) -> &mut Self {
        rmp::encode::write_bool(&mut self.0, v).expect("vec write");
        self
    }
    pub fn bin(&mut self, v: &[u8]) -> &mut Self {
        rmp::encode::write_bin(&mut self.0, v).expect("vec write");
        self
    }
    pub fn tokens(&mut self, tokens: impl IntoIterator<Item = u32>) -> &mut Self {
        let tokens: Vec<u32> = tokens.into_iter().collect();
        self.arr(u32::try_from(tokens.len()).expect("few tokens"));
        for t in tokens {
            self.u(u64::from(t));
        }
        self
    }
    pub fn u64s(&mut self, hashes: &[u64]) -> &mut Self {
        self.arr(u32::try_from(hashes.len()).expect("few"));
        for h in hashes {
            self.u64(*h);
        }
        self
    }
    pub fn bytes(&self) -> Vec<u8> {
        self.0.clone()
    }
}

/// The real vLLM 0.33.0 batch (BlockRemoved + CPU-tier BlockStored, map16; `docs/events.md` §7.5).
pub const VLLM_0_33_0_HEX: &str = "93cb41dac097994e466d9284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf1dcf2e6ca4dadf06a66d656469756da3475055a967726f75705f69647800de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf1dcf2e6ca4dadf06b1706172656e745f626c6f636b5f68617368cfec4f29beb1e71e61a9746f6b656e5f696473dc0010cd0408cd0409cd040acd040bcd040ccd040dcd040ecd040fcd0410cd0411cd0412cd0413cd0414cd0415cd0416cd0417aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c000";

/// The real vLLM 0.33.0 AllBlocksCleared batch (seq 4, 35 bytes; `docs/events.md` §7.5).
pub const VLLM_0_33_0_CLEARED: &str =
    "93 cb41dac097994e469a 91 81 a474797065 b0416c6c426c6f636b73436c6561726564 00";

/// A batch in the ≤ 0.23 array layout, from vLLM 0.23.0's real structs (`docs/events.md` §7.5).
pub const VLLM_0_23_0_ARRAY: &str = r#"93 cb41d954fc40200000 93 9c ab"BlockStored" 92 cf659e8e1f547aeb68 cfec4f29beb1e71e61 c0 94 cd03e8 cd03e9 cd03ea cd03eb 02 c0 a3"GPU" c0 c0 00 c0 c0  94 ac"BlockRemoved" 91 cfec4f29beb1e71e61 a3"GPU" 00  91 b0"AllBlocksCleared"  00"#;

/// Tokens of two 16-token blocks, 1000..1032, whose vLLM hashes are H1 and H2.
pub fn two_blocks() -> impl Iterator<Item = u32> {
    1000..1032
}

/// vLLM 0.9.0: 2-element batch, 6-element BlockStored (no medium), 2-element BlockRemoved.
pub fn vllm_0_9_0() -> Vec<u8> {
    let mut w = W::new();
    w.arr(2).f(TS).arr(2);
    w.arr(6)
        .s("BlockStored")
        .u64s(&[H1, H2])
        .nil()
        .tokens(two_blocks())
        .u(16)
        .nil();
    w.arr(2).s("BlockRemoved").u64s(&[H3]);
    w.bytes()
}

/// vLLM 0.10.2–0.13: 3-element batch, 7-element BlockStored (+ medium), 3-element BlockRemoved.
pub fn vllm_0_10_2() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(2);
    w.arr(7)
        .s("BlockStored")
        .u64s(&[H1, H2])
        .nil()
        .tokens(two_blocks())
        .u(16)
        .nil()
        .s("GPU");
    w.arr(3).s("BlockRemoved").u64s(&[H3]).s("CPU");
    w.u(1);
    w.bytes()
}

/// vLLM 0.14–0.16: 8-element BlockStored (+ lora_name).
pub fn vllm_0_14_lora() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.arr(8)
        .s("BlockStored")
        .u64s(&[H1])
        .nil()
        .tokens(1..=4)
        .u(4)
        .u(1)
        .s("GPU")
        .s("my-lora");
    w.nil();
    w.bytes()
}

/// vLLM 0.17–0.19: 9-element BlockStored (+ extra_keys) whose first block carries a Dynamo
/// cache salt.
pub fn vllm_0_17_extra_keys_salt() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.arr(9)
        .s("BlockStored")
        .u64s(&[H1, H2])
        .nil()
        .tokens(1..=8)
        .u(4)
        .nil()
        .s("GPU")
        .nil();
    w.arr(2).arr(1).s("dynamo-cache-salt:tenant-a").nil();
    w.u(0);
    w.bytes()
}

/// vLLM 0.17–0.19: a multimodal store (`extra_keys` with an `(mm_id, offset)` tuple).
pub fn vllm_0_17_multimodal() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.arr(9)
        .s("BlockStored")
        .u64s(&[H1])
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU")
        .nil();
    w.arr(1).arr(1).arr(2).s("mm-hash-abc").u(0);
    w.u(0);
    w.bytes()
}

/// vLLM 0.20–0.21: 10-element BlockStored (+ group_idx): group 0 and group 1.
pub fn vllm_0_20_groups() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(3);
    w.arr(10)
        .s("BlockStored")
        .u64s(&[H1])
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU")
        .nil();
    w.arr(2).nil().nil().u(0);
    w.arr(10)
        .s("BlockStored")
        .u64s(&[H2])
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU")
        .nil();
    w.nil().u(1);
    w.arr(4).s("BlockRemoved").u64s(&[H3]).s("GPU").u(1);
    w.u(0);
    w.bytes()
}

/// vLLM 0.22–0.23: 12-element BlockStored (+ kind, sliding window): full and sliding window.
pub fn vllm_0_23_kinds() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(2);
    w.arr(12)
        .s("BlockStored")
        .u64s(&[H1])
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU")
        .nil();
    w.nil().u(0).s("full_attention").nil();
    w.arr(12)
        .s("BlockStored")
        .u64s(&[H2])
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU")
        .nil();
    w.nil().u(0).s("sliding_window").u(128);
    w.u(0);
    w.bytes()
}

/// vLLM 0.24–0.32: tagged maps (fixmap), required keys only, in a 3-element batch.
pub fn vllm_0_24_map() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(3);
    w.map(8)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .u64s(&[H1, H2]);
    w.s("parent_block_hash")
        .nil()
        .s("token_ids")
        .tokens(two_blocks());
    w.s("block_size")
        .u(16)
        .s("lora_id")
        .nil()
        .s("medium")
        .s("GPU")
        .s("lora_name")
        .nil();
    w.map(3)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .u64s(&[H3])
        .s("medium")
        .s("GPU");
    w.map(1).s("type").s("AllBlocksCleared");
    w.u(0);
    w.bytes()
}

/// vLLM 0.33.0: map16 BlockStored with every optional key (keys in a shuffled order, `type`
/// not first), including `lookahead_token_ids` (ignored) and an unknown key.
pub fn vllm_0_33_map16_all_keys() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.map16(16);
    w.s("block_hashes").u64s(&[H3]).s("type").s("BlockStored");
    w.s("parent_block_hash")
        .u64(H2)
        .s("token_ids")
        .tokens(1032..1048);
    w.s("block_size")
        .u(16)
        .s("lora_id")
        .nil()
        .s("medium")
        .s("GPU")
        .s("lora_name")
        .nil();
    w.s("extra_keys").arr(1).nil();
    w.s("group_idx")
        .u(0)
        .s("kv_cache_spec_kind")
        .s("full_attention");
    w.s("kv_cache_spec_sliding_window")
        .nil()
        .s("locality")
        .s("LOCAL");
    w.s("session_id")
        .s("sess-1")
        .s("lookahead_token_ids")
        .arr(1)
        .tokens(1048..1050);
    w.s("future_field").map(1).s("x").arr(2).u(1).u(2);
    w.u(0);
    w.bytes()
}

/// SGLang ≤ 0.5.5: 6-element BlockStored with negative int64 hashes, one-hash-per-page.
pub fn sglang_0_5_5_negative() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(2);
    w.arr(6)
        .s("BlockStored")
        .arr(2)
        .i64(-2)
        .i64(-3_000_000_000_000)
        .i64(-1);
    w.tokens(1..=8).u(4).nil();
    w.arr(2)
        .s("BlockRemoved")
        .arr(2)
        .i64(-2)
        .i64(-3_000_000_000_000);
    w.u(0);
    w.bytes()
}

/// SGLang 0.5.18–0.5.19 positional: salted store (8 elements, metadata map with cache_salt),
/// unsalted store (7 elements), and a metadata map without cache_salt.
pub fn sglang_0_5_18_metadata() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(3);
    w.arr(8)
        .s("BlockStored")
        .arr(1)
        .i(-5)
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU");
    w.map(1).s("cache_salt").s("tenant-a");
    w.arr(7)
        .s("BlockStored")
        .arr(1)
        .i(-6)
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU");
    w.arr(8)
        .s("BlockStored")
        .arr(1)
        .i(-7)
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .nil();
    w.map(1).s("other").u(1);
    w.u(2);
    w.bytes()
}

/// SGLang ≥ 0.5.20 map layout: cache_salt, session_id, lora_name, CPU_PINNED, negative hashes;
/// a `metadata.cache_salt` store; `attn_dp_rank` 1 (position 2 of the batch).
pub fn sglang_0_5_20_map() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(3);
    w.map(9)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(2)
        .i64(-11)
        .i64(-12);
    w.s("parent_block_hash")
        .i64(-10)
        .s("token_ids")
        .tokens(1..=8)
        .s("block_size")
        .u(4);
    w.s("lora_id")
        .nil()
        .s("medium")
        .s("CPU_PINNED")
        .s("cache_salt")
        .s("tenant-a");
    w.s("session_id").s("s-9");
    w.map(8)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(1)
        .i64(-13);
    w.s("parent_block_hash")
        .nil()
        .s("token_ids")
        .tokens(1..=4)
        .s("block_size")
        .u(4);
    w.s("lora_id").nil().s("lora_name").s("my-lora");
    w.s("metadata").map(1).s("cache_salt").s("tenant-b");
    w.map(3)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .arr(1)
        .i64(-11);
    w.s("medium").s("DISK");
    w.u(1);
    w.bytes()
}

/// SGLang EAGLE: pair-encoded token ids (`[[a, b], ...]`), one 4-token page: the pairs
/// `(1,2) (2,3) (3,4) (4,5)` flatten to `1 2 3 4 5`.
pub fn sglang_eagle_pairs() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.arr(7).s("BlockStored").arr(1).i(-21).nil();
    w.arr(4);
    for t in 1..=4u64 {
        w.arr(2).u(t).u(t + 1);
    }
    w.u(4).nil().s("GPU");
    w.nil();
    w.bytes()
}

/// SGLang: a partial last page (block_size 2 < page size 4) after a full page.
pub fn sglang_partial_page() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(2);
    w.arr(7)
        .s("BlockStored")
        .arr(1)
        .i(-31)
        .nil()
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU");
    w.arr(7)
        .s("BlockStored")
        .arr(1)
        .i(-32)
        .i(-31)
        .tokens(5..=6)
        .u(2)
        .nil()
        .s("GPU");
    w.nil();
    w.bytes()
}

/// vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: `bin` hashes of 32 bytes; and a 7-byte
/// bin (left-padded) as parent.
pub fn bin_hashes() -> Vec<u8> {
    let mut h32 = [0xaa_u8; 32];
    h32[24..].copy_from_slice(&H1.to_be_bytes());
    let h7 = [1, 2, 3, 4, 5, 6, 7];
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.arr(7)
        .s("BlockStored")
        .arr(1)
        .bin(&h32)
        .bin(&h7)
        .tokens(1..=4)
        .u(4)
        .nil()
        .s("GPU");
    w.u(0);
    w.bytes()
}

/// An unknown tag and a malformed event between two good ones: the good ones still decode.
pub fn unknown_tag_in_middle() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(5);
    w.arr(2).s("BlockRemoved").u64s(&[H1]);
    w.arr(3).s("FooEvent").u(1).map(1).s("k").arr(1).u(2);
    w.map(2)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .s("not-a-list");
    w.u(42);
    w.map(1).s("type").s("AllBlocksCleared");
    w.u(0);
    w.bytes()
}

/// The never-released map batch: `{ts, events, data_parallel_rank}` (int ts).
pub fn map_batch() -> Vec<u8> {
    let mut w = W::new();
    w.map(4).s("ts").u(1_700_000_000).s("events").arr(1);
    w.arr(1).s("AllBlocksCleared");
    w.s("data_parallel_rank").u(3).s("extra").nil();
    w.bytes()
}

/// A map batch with SGLang's `attn_dp_rank` key.
pub fn map_batch_attn_dp_rank() -> Vec<u8> {
    let mut w = W::new();
    w.map(3)
        .s("attn_dp_rank")
        .u(5)
        .s("events")
        .arr(0)
        .s("ts")
        .f(TS);
    w.bytes()
}

/// A tokenless CPU-offload store (location-only event).
pub fn tokenless_offload() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(1);
    w.map(7)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .u64s(&[H1]);
    w.s("parent_block_hash")
        .nil()
        .s("token_ids")
        .arr(0)
        .s("block_size")
        .u(16);
    w.s("lora_id").nil().s("medium").s("CPU");
    w.u(0);
    w.bytes()
}

/// A batch with a negative data-parallel rank.
pub fn negative_dp_rank() -> Vec<u8> {
    let mut w = W::new();
    w.arr(3).f(TS).arr(1).arr(1).s("AllBlocksCleared").i(-1);
    w.bytes()
}

/// Token ids in every msgpack int form the decoder's fast path takes, at each width's
/// boundaries: positive fixint, `uint8/16/32`, non-negative `int8/16/32/64` and a `uint64` that
/// fits in 32 bits. A positional store (two 4-token blocks) and a map store whose `token_ids`
/// ends the payload (a 2-element batch), so the last ids are read near the end of the input.
pub fn token_id_widths() -> Vec<u8> {
    let mut w = W::new();
    w.arr(2).f(TS).arr(2);
    w.arr(7).s("BlockStored").u64s(&[H1, H2]).nil().arr(8);
    w.0.extend([0x00, 0x7f, 0xcc, 0x80, 0xcc, 0xff, 0xcd, 0x01, 0x00]);
    w.0.extend([0xcd, 0xff, 0xff, 0xce, 0x00, 0x01, 0x00, 0x00]);
    w.0.extend([0xce, 0xff, 0xff, 0xff, 0xff]);
    w.u(4).nil().s("GPU");
    w.map(5)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .u64s(&[H3, H1]);
    w.s("parent_block_hash").u64(H2).s("block_size").u(4);
    w.s("token_ids").arr(8);
    w.0.extend([0xd0, 0x7f, 0xd1, 0x7f, 0xff, 0xd2, 0x7f, 0xff, 0xff, 0xff]);
    w.0.extend([0xd3, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
    w.0.extend([
        0xcf, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xcf, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    w.0.extend([0xd0, 0x00, 0xd3, 0, 0, 0, 0, 0, 0, 0, 0x05]);
    w.bytes()
}

/// `token_ids` arrays the fast path hands back to the visitors, between good stores: an id of
/// 2^32, a negative `int8`, a float, a plain id followed by a pair, and a pair-encoded page
/// (SGLang EAGLE) — the first four are malformed, the pairs decode.
pub fn token_id_fallbacks() -> Vec<u8> {
    let store = |w: &mut W, hash: u64, tokens: &[u8]| {
        w.arr(6).s("BlockStored").u64s(&[hash]).nil().arr(2);
        w.0.extend_from_slice(tokens);
        w.u(2).nil();
    };
    let mut w = W::new();
    w.arr(3).f(TS).arr(7);
    store(&mut w, H1, &[0x01, 0x02]);
    store(&mut w, H2, &[0x01, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0]);
    store(&mut w, H2, &[0xd0, 0xff, 0x02]);
    store(&mut w, H2, &[0x01, 0xca, 0x3f, 0x80, 0, 0]);
    store(&mut w, H2, &[0x01, 0x92, 0x02, 0x03]);
    w.arr(6).s("BlockStored").u64s(&[H3]).nil().arr(2);
    w.arr(2).u(5).u(6).arr(2).u(6).u(7);
    w.u(2).nil();
    store(&mut w, H1, &[0xcd, 0x12, 0x34, 0x05]);
    w.u(0);
    w.bytes()
}

/// Every fixture, named (the fuzz seed corpus).
pub fn all() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("vllm_0_33_0_real", hexb(VLLM_0_33_0_HEX)),
        ("vllm_0_33_0_cleared_real", hexb(VLLM_0_33_0_CLEARED)),
        ("vllm_0_23_0_array_real", hexb(VLLM_0_23_0_ARRAY)),
        ("vllm_0_9_0", vllm_0_9_0()),
        ("vllm_0_10_2", vllm_0_10_2()),
        ("vllm_0_14_lora", vllm_0_14_lora()),
        ("vllm_0_17_extra_keys_salt", vllm_0_17_extra_keys_salt()),
        ("vllm_0_17_multimodal", vllm_0_17_multimodal()),
        ("vllm_0_20_groups", vllm_0_20_groups()),
        ("vllm_0_23_kinds", vllm_0_23_kinds()),
        ("vllm_0_24_map", vllm_0_24_map()),
        ("vllm_0_33_map16_all_keys", vllm_0_33_map16_all_keys()),
        ("sglang_0_5_5_negative", sglang_0_5_5_negative()),
        ("sglang_0_5_18_metadata", sglang_0_5_18_metadata()),
        ("sglang_0_5_20_map", sglang_0_5_20_map()),
        ("sglang_eagle_pairs", sglang_eagle_pairs()),
        ("sglang_partial_page", sglang_partial_page()),
        ("bin_hashes", bin_hashes()),
        ("unknown_tag_in_middle", unknown_tag_in_middle()),
        ("map_batch", map_batch()),
        ("map_batch_attn_dp_rank", map_batch_attn_dp_rank()),
        ("tokenless_offload", tokenless_offload()),
        ("negative_dp_rank", negative_dp_rank()),
        ("token_id_widths", token_id_widths()),
        ("token_id_fallbacks", token_id_fallbacks()),
    ]
}
