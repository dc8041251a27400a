//! `PositionalSequenceHash`: a sequence hash that also carries the block's position and a
//! fragment of its local hash, bit-compatible with `dynamo-tokens`.

use crate::{HashError, LocalBlockHash, SequenceHash};

/// A hash that knows the position (0-based block index) of the block it identifies.
///
/// Implemented by [`PositionalSequenceHash`] and [`crate::PositionalLineageHash`], so position-
/// keyed structures can be generic over either.
pub trait PositionalHash {
    /// The block's position in its sequence (0 for the first block).
    fn position(&self) -> u64;
}

/// The widths of one positional-sequence-hash mode.
struct SequenceMode {
    position_bits: u32,
    local_bits: u32,
}

/// Modes 0..=3: position bits + local-hash bits always add up to 62.
const SEQUENCE_MODES: [SequenceMode; 4] = [
    SequenceMode {
        position_bits: 8,
        local_bits: 54,
    },
    SequenceMode {
        position_bits: 16,
        local_bits: 46,
    },
    SequenceMode {
        position_bits: 24,
        local_bits: 38,
    },
    SequenceMode {
        position_bits: 31,
        local_bits: 31,
    },
];

/// `u128` packing of a block's identity and position.
///
/// Layout (most significant bit first):
///
/// ```text
/// bits 127..126  mode m (0..=3): the smallest mode whose position field fits the position
/// next P(m) bits position, P = 8 | 16 | 24 | 31
/// next L(m) bits low bits of the local block hash, L = 54 | 46 | 38 | 31 (P + L = 62)
/// bits  63..0    the sequence hash
/// ```
///
/// Equal to `dynamo_tokens::PositionalSequenceHash` bit for bit (golden vectors in the tests and
/// in `docs/hashing.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct PositionalSequenceHash(u128);

impl PositionalSequenceHash {
    /// The largest encodable position (mode 3, 31 bits).
    pub const MAX_POSITION: u64 = (1 << 31) - 1;

    /// Packs a block's sequence hash, position and local hash.
    ///
    /// # Errors
    /// [`HashError::PositionOutOfRange`] when `position > MAX_POSITION`.
    pub fn new(
        sequence_hash: SequenceHash,
        position: u64,
        local_hash: LocalBlockHash,
    ) -> Result<Self, HashError> {
        let (mode, spec) = SEQUENCE_MODES
            .iter()
            .enumerate()
            .find(|(_, spec)| position < 1 << spec.position_bits)
            .ok_or(HashError::PositionOutOfRange {
                position,
                max: Self::MAX_POSITION,
            })?;
        let local_fragment = local_hash.get() & low_mask(spec.local_bits);
        let upper = ((mode as u64) << 62) | (position << spec.local_bits) | local_fragment;
        Ok(Self(((upper as u128) << 64) | sequence_hash.get() as u128))
    }

    /// Reinterprets a raw value (every `u128` is a valid positional sequence hash).
    pub const fn from_u128(raw: u128) -> Self {
        Self(raw)
    }

    /// The raw packed value.
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// The encoding mode (0..=3).
    pub const fn mode(self) -> u8 {
        (self.upper() >> 62) as u8
    }

    /// The sequence hash (lower 64 bits).
    pub const fn sequence_hash(self) -> SequenceHash {
        SequenceHash::new(self.0 as u64)
    }

    /// The low bits of the local block hash that the mode keeps (54, 46, 38 or 31 bits).
    pub const fn local_hash_fragment(self) -> u64 {
        let spec = &SEQUENCE_MODES[self.mode() as usize];
        self.upper() & low_mask(spec.local_bits)
    }

    const fn upper(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

impl PositionalHash for PositionalSequenceHash {
    fn position(&self) -> u64 {
        let spec = &SEQUENCE_MODES[self.mode() as usize];
        (self.upper() >> spec.local_bits) & low_mask(spec.position_bits)
    }
}

/// A `u64` with the low `bits` bits set (`bits <= 64`).
pub(crate) const fn low_mask(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}
