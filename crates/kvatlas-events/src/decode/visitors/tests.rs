//! Unit tests of the decoder's internals: the token-id and hash fast paths against the tolerant
//! visitors they stand in for, and the slice deserializer against rmp-serde's.
//!
//! The reference is [`decode_batch_rmp_serde`]: the same visitors driven by rmp-serde, where the
//! raw-array hook does not exist, so every token id and hash goes through `deserialize_any`.

use proptest::prelude::*;

use super::*;
use crate::decode::MsgpackError;

#[path = "../../../tests/common/mod.rs"]
mod common;

#[test]
fn bin_hash_takes_the_last_eight_bytes_and_left_pads() {
    assert_eq!(bin_hash(&[]), 0);
    assert_eq!(bin_hash(&[1, 2]), 0x0102);
    let mut long = [0u8; 32];
    long[24..].copy_from_slice(&0x1122_3344_5566_7788u64.to_be_bytes());
    long[0] = 0xff;
    assert_eq!(bin_hash(&long), 0x1122_3344_5566_7788);
}

/// Both decoders agree on `payload`: the same batch (compared through `Debug`, so a NaN `ts`
/// compares equal), or errors with the same reason and message.
fn assert_same(payload: &[u8]) -> Result<(), TestCaseError> {
    match (decode_batch(payload), decode_batch_rmp_serde(payload)) {
        (Ok(fast), Ok(reference)) => {
            prop_assert_eq!(format!("{fast:?}"), format!("{reference:?}"));
        }
        (Err(fast), Err(reference)) => {
            prop_assert_eq!(fast.reason(), reference.reason());
            prop_assert_eq!(fast.to_string(), reference.to_string());
        }
        (fast, reference) => {
            prop_assert!(false, "fast {fast:?} != reference {reference:?}");
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Token-id elements.

/// One encoded element of a `token_ids` array, with the id the fast path must produce (`None`:
/// it must decline, and the visitors decide).
#[derive(Debug, Clone)]
struct Elem {
    bytes: Vec<u8>,
    id: Option<u32>,
}

/// The boundary values of every width, and neighbours.
const UINTS: [u64; 14] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xffff,
    0x1_0000,
    151_935,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    u64::MAX,
];

const INTS: [i64; 13] = [
    0,
    1,
    0x7f,
    -1,
    -32,
    -33,
    -128,
    0x7fff,
    -0x8000,
    0x7fff_ffff,
    0xffff_ffff,
    0x1_0000_0000,
    i64::MIN,
];

/// `v` as a msgpack unsigned int of marker `marker` (`None` for a positive fixint), if it fits.
fn uint_as(v: u64, marker: Option<u8>) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    match marker {
        None => out.push(u8::try_from(v).ok().filter(|b| *b < 0x80)?),
        Some(0xcc) => out.extend([0xcc, u8::try_from(v).ok()?]),
        Some(0xcd) => {
            out.push(0xcd);
            out.extend(u16::try_from(v).ok()?.to_be_bytes());
        }
        Some(0xce) => {
            out.push(0xce);
            out.extend(u32::try_from(v).ok()?.to_be_bytes());
        }
        Some(_) => {
            out.push(0xcf);
            out.extend(v.to_be_bytes());
        }
    }
    Some(out)
}

/// `v` as a msgpack signed int of marker `marker` (`None` for a negative fixint), if it fits.
fn int_as(v: i64, marker: Option<u8>) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    match marker {
        None => out.push(
            i8::try_from(v)
                .ok()
                .filter(|b| *b >= -32 && *b < 0)?
                .to_be_bytes()[0],
        ),
        Some(0xd0) => out.extend([0xd0, i8::try_from(v).ok()?.to_be_bytes()[0]]),
        Some(0xd1) => {
            out.push(0xd1);
            out.extend(i16::try_from(v).ok()?.to_be_bytes());
        }
        Some(0xd2) => {
            out.push(0xd2);
            out.extend(i32::try_from(v).ok()?.to_be_bytes());
        }
        Some(_) => {
            out.push(0xd3);
            out.extend(v.to_be_bytes());
        }
    }
    Some(out)
}

/// Every int encoding of every boundary value that fits, with its expected id.
fn all_int_elems() -> Vec<Elem> {
    let mut elems = Vec::new();
    for v in UINTS {
        for marker in [None, Some(0xcc), Some(0xcd), Some(0xce), Some(0xcf)] {
            if let Some(bytes) = uint_as(v, marker) {
                elems.push(Elem {
                    bytes,
                    id: u32::try_from(v).ok(),
                });
            }
        }
    }
    for v in INTS {
        for marker in [None, Some(0xd0), Some(0xd1), Some(0xd2), Some(0xd3)] {
            if let Some(bytes) = int_as(v, marker) {
                elems.push(Elem {
                    bytes,
                    id: u32::try_from(v).ok(),
                });
            }
        }
    }
    elems
}

/// Elements the fast path must decline: pairs (SGLang EAGLE), other arrays, and every other
/// type.
fn other_elems() -> Vec<Elem> {
    let declined = |bytes: Vec<u8>| Elem { bytes, id: None };
    vec![
        declined(vec![0x92, 0x01, 0x02]),                   // [1, 2]: a pair
        declined(vec![0x92, 0xce, 0, 1, 0, 0, 0xcd, 1, 0]), // a pair of wider ids
        declined(vec![0x91, 0x01]),                         // [1]
        declined(vec![0x93, 0x01, 0x02, 0x03]),             // [1, 2, 3]
        declined(vec![0x92, 0xff, 0x02]),                   // [-1, 2]
        declined(vec![0x90]),                               // []
        declined(vec![0xc0]),                               // nil
        declined(vec![0xc2]),                               // false
        declined(vec![0xc3]),                               // true
        declined(vec![0xca, 0x3f, 0x80, 0, 0]),             // 1.0f32
        declined(vec![0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0]), // 1.0f64
        declined(vec![0xa1, b'7']),                         // "7"
        declined(vec![0xc4, 0x01, 0x07]),                   // bin [7]
        declined(vec![0x80]),                               // {}
        declined(vec![0x81, 0x01, 0x02]),                   // {1: 2}
        declined(vec![0xd4, 0x01, 0x07]),                   // fixext1
        declined(vec![0xc7, 0x00, 0x01]),                   // ext8, empty
        declined(vec![0xc1]),                               // reserved
    ]
}

fn elem() -> impl Strategy<Value = Elem> {
    prop_oneof![
        8 => prop::sample::select(all_int_elems()),
        // Random ids of a large vocabulary, minimally encoded (the real mix).
        8 => (0u64..151_936).prop_map(|v| Elem {
            bytes: uint_as(v, None)
                .or_else(|| uint_as(v, Some(0xcc)))
                .or_else(|| uint_as(v, Some(0xcd)))
                .or_else(|| uint_as(v, Some(0xce)))
                .unwrap_or_default(),
            id: u32::try_from(v).ok(),
        }),
        1 => prop::sample::select(other_elems()),
    ]
}

/// An array header for `n` elements: fixarray when it fits and `small`, else array16 or
/// array32 (`wide`).
fn array_header(n: usize, small: bool, wide: bool) -> Vec<u8> {
    match (u8::try_from(n), u16::try_from(n)) {
        (Ok(n), _) if n < 16 && small => vec![0x90 | n],
        (_, Ok(n)) if !wide => [&[0xdc][..], &n.to_be_bytes()].concat(),
        _ => [
            &[0xdd][..],
            &u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes(),
        ]
        .concat(),
    }
}

#[test]
fn every_int_width_and_boundary_decodes_as_the_visitors_decide() {
    let other = other_elems();
    for elem in all_int_elems().iter().chain(&other) {
        // Alone, then between two ordinary ids, each time followed by enough bytes for the
        // 9-byte window and at the very end of the input (the padded tail).
        for body in [
            elem.bytes.clone(),
            [&[0x05][..], &elem.bytes, &[0xcd, 0x12, 0x34]].concat(),
        ] {
            let count = if body.len() == elem.bytes.len() { 1 } else { 3 };
            let expected: Option<Vec<u32>> = if body.len() == elem.bytes.len() {
                elem.id.map(|id| vec![id])
            } else {
                elem.id.map(|id| vec![5, id, 0x1234])
            };
            for trailer in [&[][..], &[0xc0; 16][..]] {
                let input = [&body[..], trailer].concat();
                let got = fast::token_ids(&input, count);
                assert_eq!(
                    got,
                    expected.clone().map(|ids| (ids, body.len())),
                    "{:02x?}",
                    elem.bytes
                );
            }
        }
    }
}

#[test]
fn token_fast_path_refuses_counts_beyond_the_input_and_truncation() {
    // More elements claimed than bytes left: refused before reserving anything.
    assert_eq!(fast::token_ids(&[1, 2, 3], 4), None);
    assert_eq!(fast::token_ids(&[], 1), None);
    assert_eq!(fast::token_ids(&[], 0), Some((vec![], 0)));
    // Cut inside the last element, in the tail and in the main loop's reach.
    assert_eq!(fast::token_ids(&[0xce, 0, 0, 1], 1), None);
    assert_eq!(fast::token_ids(&[1, 2, 0xcd, 0], 3), None);
    let mut long = [0xcd, 0x01, 0x00].repeat(8);
    long.extend([0xce, 0, 0]);
    assert_eq!(fast::token_ids(&long, 9), None);
    assert_eq!(
        fast::token_ids(&long, 8).map(|(ids, used)| (ids.len(), used)),
        Some((8, 24))
    );
}

#[test]
fn hash_fast_path_takes_ints_and_bin8_and_declines_the_rest() {
    let mut bytes = vec![0x07, 0xcc, 0xff, 0xcd, 0xab, 0xcd, 0xce, 1, 2, 3, 4];
    bytes.extend([0xcf, 0xff, 0xee, 0xdd, 0xcc, 0xbb, 0xaa, 0x99, 0x88]);
    bytes.extend([0xff, 0xd0, 0x80, 0xd1, 0xff, 0x00, 0xd2, 0x80, 0, 0, 0]);
    bytes.extend([0xd3, 0x80, 0, 0, 0, 0, 0, 0, 1]);
    bytes.extend([0xc4, 0x02, 0x12, 0x34, 0xc4, 0x00]);
    let expected = vec![
        7,
        0xff,
        0xabcd,
        0x0102_0304,
        0xffee_ddcc_bbaa_9988,
        u64::MAX,
        -128i64 as u64,
        -256i64 as u64,
        i64::from(i32::MIN) as u64,
        (i64::MIN + 1) as u64,
        0x1234,
        0,
    ];
    assert_eq!(
        fast::hashes(&bytes, expected.len()),
        Some((expected, bytes.len()))
    );
    for declined in [
        &[0xc0][..],
        &[0xc5, 0, 1, 7],
        &[0xa1, b'h'],
        &[0x91, 1],
        &[0xcb],
    ] {
        assert_eq!(fast::hashes(declined, 1), None, "{declined:02x?}");
    }
    assert_eq!(fast::hashes(&[0xcf, 1, 2], 1), None);
    assert_eq!(fast::hashes(&[0xc4, 9, 1], 1), None);
    assert_eq!(fast::hashes(&[1], 2), None);
}

/// A batch with one `BlockStored` carrying `tokens` (raw bytes of the whole `token_ids` value),
/// positional or map layout, followed by a second, ordinary event.
fn store_batch(tokens: &[u8], hashes: &[u8], map: bool) -> Vec<u8> {
    let mut w = common::W::new();
    w.arr(3).f(common::TS).arr(2);
    if map {
        w.map(5).s("type").s("BlockStored").s("block_hashes");
        w.0.extend_from_slice(hashes);
        w.s("parent_block_hash").nil().s("token_ids");
        w.0.extend_from_slice(tokens);
        w.s("block_size").u(4);
    } else {
        w.arr(6).s("BlockStored");
        w.0.extend_from_slice(hashes);
        w.nil();
        w.0.extend_from_slice(tokens);
        w.u(4).nil();
    }
    w.arr(2).s("BlockRemoved").u64s(&[common::H1]);
    w.u(0);
    w.bytes()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    /// Random `token_ids` arrays mixing every marker width, boundary values and (rarely) the
    /// forms the fast path declines: the fast path yields exactly the expected ids or declines,
    /// and whole batches decode exactly as through the visitors alone — also with the header
    /// claiming too many elements, and cut at every kind of position.
    #[test]
    fn token_fast_path_matches_the_visitors(
        elems in proptest::collection::vec(elem(), 0..40),
        small in any::<bool>(),
        wide in any::<bool>(),
        map in any::<bool>(),
        extra_claimed in prop_oneof![4 => Just(0usize), 1 => 1usize..3],
        cut in any::<prop::sample::Index>(),
    ) {
        let body: Vec<u8> = elems.iter().flat_map(|e| e.bytes.clone()).collect();
        let expected: Option<Vec<u32>> = elems.iter().map(|e| e.id).collect();
        prop_assert_eq!(
            fast::token_ids(&body, elems.len()),
            expected.map(|ids| (ids, body.len()))
        );

        let tokens = [array_header(elems.len() + extra_claimed, small, wide), body].concat();
        let hashes = [array_header(1, true, false), vec![0x2a]].concat();
        let payload = store_batch(&tokens, &hashes, map);
        assert_same(&payload)?;
        assert_same(&payload[..cut.index(payload.len() + 1)])?;
    }

    /// The same for `block_hashes`: ints of every width and sign, bins, and other types.
    #[test]
    fn hash_fast_path_matches_the_visitors(
        hashes in proptest::collection::vec(prop_oneof![
            4 => prop::sample::select(all_int_elems()).prop_map(|e| e.bytes),
            1 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| {
                [&[0xc4, u8::try_from(b.len()).unwrap_or(0)][..], &b].concat()
            }),
            1 => proptest::collection::vec(any::<u8>(), 0..4).prop_map(|b| {
                [&[0xc5, 0, u8::try_from(b.len()).unwrap_or(0)][..], &b].concat()
            }),
            1 => prop::sample::select(other_elems()).prop_map(|e| e.bytes),
        ], 0..12),
        map in any::<bool>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let body: Vec<u8> = hashes.concat();
        let list = [array_header(hashes.len(), true, false), body].concat();
        let tokens = [array_header(4, true, false), vec![1, 2, 3, 4]].concat();
        let payload = store_batch(&tokens, &list, map);
        assert_same(&payload)?;
        assert_same(&payload[..cut.index(payload.len() + 1)])?;
    }

    /// The slice deserializer reproduces rmp-serde on anything: random bytes, and every fixture
    /// with random bytes overwritten, inserted or cut.
    #[test]
    fn slice_deserializer_matches_rmp_serde(
        input in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..400),
            (
                any::<prop::sample::Index>(),
                proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
            )
                .prop_map(|(which, edits)| {
                    let fixtures = common::all();
                    let mut bytes = which.get(&fixtures).1.clone();
                    for (at, byte, kind) in edits {
                        let i = at.index(bytes.len() + 1);
                        match kind {
                            0 if i < bytes.len() => bytes[i] = byte,
                            1 => bytes.insert(i, byte),
                            _ => bytes.truncate(i),
                        }
                    }
                    bytes
                }),
        ]
    ) {
        assert_same(&input)?;
    }
}

#[test]
fn every_fixture_decodes_as_through_rmp_serde() {
    for (name, bytes) in common::all() {
        assert_same(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        for cut in 0..bytes.len() {
            assert_same(&bytes[..cut]).unwrap_or_else(|e| panic!("{name} cut at {cut}: {e}"));
        }
    }
}

#[test]
fn nesting_limit_and_reserved_marker_fail_as_in_rmp_serde() {
    // 40 nested arrays as the batch's `events`, an ext and a reserved byte in a token list.
    let mut deep = vec![0x92, 0x00];
    deep.extend([0x91; 40]);
    deep.push(0xc0);
    assert_same(&deep).expect("same error");
    assert!(matches!(
        decode_batch(&deep),
        Err(DecodeError::Msgpack(MsgpackError(
            rmp_serde::decode::Error::DepthLimitExceeded
        )))
    ));
    for tokens in [&[0x92, 0x01, 0xc1][..], &[0x92, 0xd4, 0x01, 0x07, 0x01]] {
        let payload = store_batch(tokens, &[0x91, 0x2a], false);
        assert_same(&payload).expect("same outcome");
    }
}

/// `token_ids` through either deserializer with `max_depth` levels left, reduced to
/// comparable form.
fn tokens_at_depth(bytes: &[u8], max_depth: usize, fast: bool) -> Result<Option<Vec<u32>>, String> {
    let list = if fast {
        TokenList::deserialize(&mut SliceDeserializer::new(bytes, max_depth))
    } else {
        let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
        de.set_max_depth(max_depth);
        TokenList::deserialize(&mut de)
    };
    list.map(|TokenList(tokens)| tokens.ok().map(|t| t.ids))
        .map_err(|e| e.to_string())
}

#[test]
fn the_raw_array_hook_respects_the_nesting_limit() {
    for bytes in [&[0x93, 1, 2, 3][..], &[0x90], &[0x91, 0x92, 1, 2]] {
        for max_depth in 1..4 {
            assert_eq!(
                tokens_at_depth(bytes, max_depth, true),
                tokens_at_depth(bytes, max_depth, false),
                "{bytes:02x?} at depth {max_depth}"
            );
        }
    }
    assert_eq!(
        tokens_at_depth(&[0x93, 1, 2, 3], 2, true),
        Ok(Some(vec![1, 2, 3]))
    );
}

#[test]
fn raw_string_keys_and_tags_decode_as_checked_strings() {
    // Tags and keys as fixstr, str8 and str16, known and unknown, valid and invalid UTF-8, and
    // cut inside the string.
    let str8 = |s: &[u8]| [&[0xd9, u8::try_from(s.len()).unwrap_or(0)][..], s].concat();
    let str16 = |s: &[u8]| [&[0xda, 0][..], &[u8::try_from(s.len()).unwrap_or(0)], s].concat();
    let fix = |s: &[u8]| [&[0xa0 | u8::try_from(s.len()).unwrap_or(0)][..], s].concat();
    let names: [&[u8]; 7] = [
        b"BlockRemoved",
        b"BlockRemovee",
        b"Block\xffemoved",
        b"block_hashes",
        b"block_hashe\xff",
        b"type",
        b"",
    ];
    for tag in names {
        for key in names {
            for enc in [fix, str8, str16] {
                let mut w = common::W::new();
                w.arr(3).f(common::TS).arr(2);
                // Positional: the tag first.
                w.arr(2);
                w.0.extend(enc(tag));
                w.u64s(&[common::H1]);
                // Map: the key as `type` or `block_hashes`.
                w.map(2).s("type");
                w.0.extend(enc(tag));
                w.0.extend(enc(key));
                w.u64s(&[common::H2]);
                w.u(0);
                let payload = w.bytes();
                for cut in 0..=payload.len() {
                    assert_same(&payload[..cut])
                        .unwrap_or_else(|e| panic!("{tag:02x?} {key:02x?} cut {cut}: {e}"));
                }
            }
        }
    }
    let batch = decode_batch(&[0x92, 0x00, 0x91, 0x92, 0xa3, 0xff, 0xfe, 0xfd, 0x90]);
    assert_eq!(
        batch.map(|b| b.skipped.first().map(|s| s.detail)).ok(),
        Some(Some("event tag is not a string"))
    );
}
