//! The one error type of the crate.

use std::fmt;

/// Why a hashing call rejected its input.
///
/// Every fallible function of the crate returns this; nothing in the crate panics on caller input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HashError {
    /// The block size was 0 or above [`crate::BlockSize::MAX`].
    InvalidBlockSize {
        /// The rejected block size, in tokens.
        block_size: u32,
    },
    /// The position does not fit the hash type's encoding.
    PositionOutOfRange {
        /// The rejected position (0-based block index).
        position: u64,
        /// The largest position the hash type can encode.
        max: u64,
    },
    /// A lineage hash at position > 0 was built without a parent.
    MissingParent {
        /// The position of the block that needs a parent.
        position: u64,
    },
    /// A lineage hash at position 0 was given a parent (the first block of a sequence has none).
    UnexpectedParent,
    /// A raw `u128` carried the reserved lineage mode `0b11`.
    InvalidMode {
        /// The 2-bit mode found in the top bits.
        mode: u8,
    },
}

impl fmt::Display for HashError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidBlockSize { block_size } => write!(
                f,
                "invalid block size {block_size}: must be between 1 and {} tokens",
                crate::BlockSize::MAX
            ),
            Self::PositionOutOfRange { position, max } => {
                write!(f, "block position {position} is out of range (max {max})")
            }
            Self::MissingParent { position } => write!(
                f,
                "block at position {position} needs a parent sequence hash (only position 0 has none)"
            ),
            Self::UnexpectedParent => {
                write!(
                    f,
                    "the block at position 0 cannot have a parent sequence hash"
                )
            }
            Self::InvalidMode { mode } => {
                write!(
                    f,
                    "mode {mode:#04b} is reserved in a positional lineage hash"
                )
            }
        }
    }
}

impl std::error::Error for HashError {}
