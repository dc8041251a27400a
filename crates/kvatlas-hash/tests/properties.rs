//! Property tests: block cutting, equivalence with one-shot XXH3, encode/decode round trips and
//! parent/child matching across every lineage mode boundary.

use kvatlas_hash::{
    BASE_SEED, BlockHasher, LocalBlockHash, PositionalHash, PositionalLineageHash,
    PositionalSequenceHash, SequenceHash, sequence_hashes, sequence_hashes_after,
};
use proptest::prelude::*;
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn le_bytes(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Positions clustered around every mode boundary plus uniform ones.
fn positions() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..4,
        250u64..262,
        65530u64..65542,
        16_777_210u64..16_777_216,
        0u64..(1 << 24),
    ]
}

#[test]
fn block_cutting_edge_cases() {
    let hasher = BlockHasher::new(4).expect("valid");
    assert_eq!(
        hasher.local_hashes(&[]).count(),
        0,
        "empty sequence has no blocks"
    );
    assert_eq!(
        hasher.local_hashes(&[1, 2, 3]).count(),
        0,
        "a partial block is not hashed"
    );
    let seven: Vec<_> = hasher.local_hashes(&[1, 2, 3, 4, 5, 6, 7]).collect();
    assert_eq!(
        seven,
        [hasher.hash_block(&[1, 2, 3, 4])],
        "trailing partial block dropped"
    );

    let unit = BlockHasher::new(1).expect("block size 1 is valid");
    let per_token: Vec<_> = unit.local_hashes(&[9, 8, 7]).collect();
    assert_eq!(per_token.len(), 3);
    assert_eq!(
        per_token[1].get(),
        xxh3_64_with_seed(&8u32.to_le_bytes(), BASE_SEED)
    );
    assert_eq!(
        unit.local_hashes(&[9, 8, 7]).next_back(),
        Some(per_token[2])
    );
}

/// Every token count from 0 to 300 (all XXH3 input-size paths and the token-lane port) with
/// several seeds equals one-shot XXH3 over the little-endian bytes.
#[test]
fn hash_block_equals_xxh3_for_every_length() {
    let tokens: Vec<u32> = (0..300u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ 0xdead_beef)
        .collect();
    for (lora, salt) in [("", ""), ("my-lora", ""), ("", "tenant-a"), ("x", "y")] {
        let hasher = BlockHasher::new(16)
            .expect("valid")
            .with_lora_name(lora)
            .with_cache_salt(salt);
        for len in 0..=tokens.len() {
            let block = &tokens[..len];
            let expected = xxh3_64_with_seed(&le_bytes(block), hasher.seed());
            assert_eq!(
                hasher.hash_block(block).get(),
                expected,
                "{len} tokens, lora {lora:?}, salt {salt:?}"
            );
        }
    }
}

#[test]
fn extend_local_hashes_appends() {
    let hasher = BlockHasher::new(2).expect("valid");
    let mut out = vec![LocalBlockHash::new(42)];
    hasher.extend_local_hashes(&[1, 2, 3, 4, 5], &mut out);
    assert_eq!(out.len(), 3);
    assert_eq!(out[0], LocalBlockHash::new(42));
    assert_eq!(out[2], hasher.hash_block(&[3, 4]));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every buffer tier and the streaming path hash exactly like one-shot XXH3 with the seed.
    #[test]
    fn hash_block_equals_one_shot_xxh3(
        tokens in prop_oneof![
            prop::collection::vec(any::<u32>(), 0..80),
            prop::collection::vec(any::<u32>(), 55..70),
            prop::collection::vec(any::<u32>(), 120..140),
            prop::collection::vec(any::<u32>(), 1000..1100),
            prop::collection::vec(any::<u32>(), 2040..2060),
        ],
        lora in "[a-z]{0,6}",
        salt in "[a-z]{0,6}",
    ) {
        let hasher = BlockHasher::new(16).expect("valid").with_lora_name(&lora).with_cache_salt(&salt);
        let expected = xxh3_64_with_seed(&le_bytes(&tokens), hasher.seed());
        prop_assert_eq!(hasher.hash_block(&tokens).get(), expected);
    }

    /// Cutting into blocks = hashing each full chunk; the partial tail is ignored.
    #[test]
    fn local_hashes_are_per_full_block(
        tokens in prop::collection::vec(any::<u32>(), 0..300),
        block_size in 1u32..40,
    ) {
        let hasher = BlockHasher::new(block_size).expect("valid");
        let got: Vec<_> = hasher.local_hashes(&tokens).collect();
        let want: Vec<_> = tokens
            .chunks_exact(block_size as usize)
            .map(|c| xxh3_64_with_seed(&le_bytes(c), BASE_SEED))
            .collect();
        prop_assert_eq!(got.len(), tokens.len() / block_size as usize);
        prop_assert_eq!(got.iter().map(|h| h.get()).collect::<Vec<_>>(), want);
    }

    /// The rolling chain: seq[0] = local[0], seq[i] = XXH3(le(seq[i-1]) ‖ le(local[i]), 1337),
    /// and continuing after a prefix equals hashing the whole sequence.
    #[test]
    fn sequence_chain_matches_definition(raw in prop::collection::vec(any::<u64>(), 1..40), split in 0usize..40) {
        let locals: Vec<_> = raw.iter().copied().map(LocalBlockHash::new).collect();
        let seqs: Vec<_> = sequence_hashes(locals.iter().copied()).collect();
        prop_assert_eq!(seqs[0].get(), raw[0]);
        for i in 1..raw.len() {
            let mut bytes = seqs[i - 1].get().to_le_bytes().to_vec();
            bytes.extend_from_slice(&raw[i].to_le_bytes());
            prop_assert_eq!(seqs[i].get(), xxh3_64_with_seed(&bytes, BASE_SEED));
        }
        let split = split.min(locals.len());
        let parent = split.checked_sub(1).map(|i| seqs[i]);
        let tail: Vec<_> = sequence_hashes_after(parent, locals[split..].iter().copied()).collect();
        prop_assert_eq!(&tail[..], &seqs[split..]);
    }

    /// Positional sequence hash: encode → decode gives back position, sequence hash and the
    /// local-hash bits the mode keeps.
    #[test]
    fn positional_sequence_round_trip(seq in any::<u64>(), local in any::<u64>(), position in prop_oneof![positions(), 0u64..(1 << 31)]) {
        let hash = PositionalSequenceHash::new(SequenceHash::new(seq), position, LocalBlockHash::new(local)).expect("in range");
        prop_assert_eq!(hash.position(), position);
        prop_assert_eq!(hash.sequence_hash().get(), seq);
        let local_bits = 62 - [8, 16, 24, 31][hash.mode() as usize];
        prop_assert_eq!(hash.local_hash_fragment(), local & ((1u64 << local_bits) - 1));
        prop_assert_eq!(PositionalSequenceHash::from_u128(hash.as_u128()), hash);
        // The smallest mode that fits the position is used.
        let smallest = [8u32, 16, 24, 31].iter().position(|bits| position < 1 << bits).expect("fits");
        prop_assert_eq!(hash.mode() as usize, smallest);
    }

    /// Lineage hash: round trip, and a child's parent fragment equals its parent's current
    /// fragment at every position, including 255→256 and 65535→65536.
    #[test]
    fn lineage_parent_child_matching(grandparent in any::<u64>(), parent in any::<u64>(), child in any::<u64>(), position in positions()) {
        let position = position.min(PositionalLineageHash::MAX_POSITION - 2);
        let grandparent = (position > 0).then_some(SequenceHash::new(grandparent));
        let parent_hash = PositionalLineageHash::new(SequenceHash::new(parent), grandparent, position).expect("valid");
        let child_hash = PositionalLineageHash::new(SequenceHash::new(child), Some(SequenceHash::new(parent)), position + 1).expect("valid");
        prop_assert!(parent_hash.is_parent_of(child_hash));
        prop_assert_eq!(child_hash.parent_fragment(), parent_hash.current_fragment());
        prop_assert_eq!(parent_hash.position(), position);
        prop_assert_eq!(child_hash.position(), position + 1);
        prop_assert_eq!(PositionalLineageHash::from_u128(child_hash.as_u128()), Ok(child_hash));
        // A different parent (in the bits the child keeps) is not recognised as the parent.
        let other = SequenceHash::new(parent ^ 1);
        let stranger = PositionalLineageHash::new(other, grandparent, position).expect("valid");
        prop_assert!(!stranger.is_parent_of(child_hash));
        // Not the parent of something two positions further.
        let grandchild = PositionalLineageHash::new(SequenceHash::new(child), Some(SequenceHash::new(parent)), position + 2).expect("valid");
        prop_assert!(!parent_hash.is_parent_of(grandchild));
    }
}
