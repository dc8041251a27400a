//! Golden vectors: Dynamo 1.6.1's values (computed with its published `dynamo-tokens` and
//! `dynamo-kv-router` 1.6.1 crates) and kvatlas's own lineage vectors, both listed in
//! `docs/hashing.md`. These are the compatibility contract.

use kvatlas_hash::{
    BlockHasher, HashError, LocalBlockHash, PositionalHash, PositionalLineageHash,
    PositionalSequenceHash, SequenceHash, compute_local_hashes, compute_sequence_hashes,
};

fn tokens_1_to_8() -> Vec<u32> {
    (1..=8).collect()
}

#[test]
fn local_and_sequence_hashes_match_dynamo() {
    let locals = compute_local_hashes(&tokens_1_to_8(), 4).expect("block size 4 is valid");
    assert_eq!(
        locals,
        [
            LocalBlockHash::new(0xcb38e4d7fb2dca5c),
            LocalBlockHash::new(0xe8d3ec39b907b74c)
        ]
    );
    let seqs = compute_sequence_hashes(&locals);
    assert_eq!(
        seqs,
        [
            SequenceHash::new(0xcb38e4d7fb2dca5c),
            SequenceHash::new(0x44a2b2379d6d3c3d)
        ]
    );
}

#[test]
fn lora_name_is_mixed_into_the_seed_like_dynamo() {
    let hasher = BlockHasher::new(4)
        .expect("valid")
        .with_lora_name("my-lora");
    let locals: Vec<u64> = hasher
        .local_hashes(&tokens_1_to_8())
        .map(LocalBlockHash::get)
        .collect();
    assert_eq!(locals, [0xd97c824a0d4bdab1, 0x6de6cbec6a335efe]);
}

#[test]
fn cache_salt_is_mixed_into_the_seed_like_dynamo() {
    let hasher = BlockHasher::new(4)
        .expect("valid")
        .with_cache_salt("tenant-a");
    let locals: Vec<u64> = hasher
        .local_hashes(&tokens_1_to_8())
        .map(LocalBlockHash::get)
        .collect();
    assert_eq!(locals, [0x4fa3e8097233e995, 0x9b7651d1fc728ccb]);
}

#[test]
fn empty_lora_and_salt_count_as_absent() {
    let plain = BlockHasher::new(4).expect("valid");
    let empty = plain.clone().with_lora_name("").with_cache_salt("");
    let via_options = plain.clone().with_options(Some(""), None);
    assert_eq!(plain.seed(), empty.seed());
    assert_eq!(plain.seed(), via_options.seed());
    assert_eq!(
        plain.hash_block(&[1, 2, 3, 4]),
        empty.hash_block(&[1, 2, 3, 4])
    );
}

#[test]
fn positional_sequence_hash_matches_dynamo_at_every_mode_boundary() {
    let vectors: [(u64, u128, u8); 9] = [
        (0, 0x001cba98765432100123456789abcdef, 0),
        (1, 0x005cba98765432100123456789abcdef, 0),
        (255, 0x3fdcba98765432100123456789abcdef, 0),
        (256, 0x40403a98765432100123456789abcdef, 1),
        (65535, 0x7ffffa98765432100123456789abcdef, 1),
        (65536, 0x80400018765432100123456789abcdef, 2),
        (16777215, 0xbfffffd8765432100123456789abcdef, 2),
        (16777216, 0xc0800000765432100123456789abcdef, 3),
        (2147483647, 0xfffffffff65432100123456789abcdef, 3),
    ];
    for (position, expected, mode) in vectors {
        let hash = PositionalSequenceHash::new(
            SequenceHash::new(0x0123456789abcdef),
            position,
            LocalBlockHash::new(0xfedcba9876543210),
        )
        .expect("position in range");
        assert_eq!(hash.as_u128(), expected, "position {position}");
        assert_eq!(hash.mode(), mode, "position {position}");
        assert_eq!(hash.position(), position);
        assert_eq!(hash.sequence_hash(), SequenceHash::new(0x0123456789abcdef));
    }
}

#[test]
fn positional_sequence_hash_rejects_positions_beyond_31_bits() {
    let err = PositionalSequenceHash::new(SequenceHash::new(1), 1 << 31, LocalBlockHash::new(2));
    assert_eq!(
        err,
        Err(HashError::PositionOutOfRange {
            position: 1 << 31,
            max: (1 << 31) - 1
        })
    );
}

/// kvatlas's own lineage vectors, also listed in `docs/hashing.md`. The expected values were
/// computed independently from the written layout, not by this crate: by
/// `tests/lineage_vectors.py` (Python 3, standard library only), which prints these rows and
/// whose `--check` confirms that this file and `docs/hashing.md` hold them.
#[test]
fn lineage_hash_vectors() {
    let current = SequenceHash::new(0x0123456789abcdef);
    let parent = SequenceHash::new(0xfedcba9876543210);
    let vectors: [(u64, u128, u8); 7] = [
        (0, 0x00000000000000000123456789abcdef, 0),
        (1, 0x0076e5d4c3b2a1908123456789abcdef, 0),
        (255, 0x3ff6e5d4c3b2a1908023456789abcdef, 0),
        (256, 0x40402e5d4c3b2a190823456789abcdef, 1),
        (65535, 0x7fffee5d4c3b2a190803456789abcdef, 1),
        (65536, 0x80400025d4c3b2a19083456789abcdef, 2),
        (16777215, 0xbfffffe5d4c3b2a19083456789abcdef, 2),
    ];
    for (position, expected, mode) in vectors {
        let parent = (position > 0).then_some(parent);
        let hash = PositionalLineageHash::new(current, parent, position).expect("valid");
        assert_eq!(hash.as_u128(), expected, "position {position}");
        assert_eq!(hash.mode(), mode, "position {position}");
        assert_eq!(hash.position(), position);
        assert_eq!(PositionalLineageHash::from_u128(expected), Ok(hash));
    }
}

#[test]
fn lineage_hash_rejects_bad_input() {
    let h = SequenceHash::new(7);
    assert_eq!(
        PositionalLineageHash::new(h, Some(h), 1 << 24),
        Err(HashError::PositionOutOfRange {
            position: 1 << 24,
            max: (1 << 24) - 1
        })
    );
    assert_eq!(
        PositionalLineageHash::new(h, None, 5),
        Err(HashError::MissingParent { position: 5 })
    );
    assert_eq!(
        PositionalLineageHash::new(h, Some(h), 0),
        Err(HashError::UnexpectedParent)
    );
    assert_eq!(
        PositionalLineageHash::from_u128(3 << 126),
        Err(HashError::InvalidMode { mode: 3 })
    );
}

#[test]
fn invalid_block_sizes_are_errors() {
    assert_eq!(
        BlockHasher::new(0).err(),
        Some(HashError::InvalidBlockSize { block_size: 0 })
    );
    let too_big = kvatlas_hash::BlockSize::MAX + 1;
    assert_eq!(
        compute_local_hashes(&[1], too_big),
        Err(HashError::InvalidBlockSize {
            block_size: too_big
        })
    );
    assert!(BlockHasher::new(kvatlas_hash::BlockSize::MAX).is_ok());
}
