//! `PositionalLineageHash`: position, a fragment of the block's own sequence hash and a fragment
//! of its parent's, so parent/child links can be checked without pointers.

use crate::positional::low_mask;
use crate::{HashError, PositionalHash, SequenceHash};

/// The widths of one lineage mode.
struct LineageMode {
    position_bits: u32,
    fragment_bits: u32,
}

/// Modes 0..=2: position bits + 2 × fragment bits always add up to 126. Mode 3 is reserved.
const LINEAGE_MODES: [LineageMode; 3] = [
    LineageMode {
        position_bits: 8,
        fragment_bits: 59,
    },
    LineageMode {
        position_bits: 16,
        fragment_bits: 55,
    },
    LineageMode {
        position_bits: 24,
        fragment_bits: 51,
    },
];

/// `u128` packing of a block's position, its own identity and its parent's identity.
///
/// Layout (most significant bit first):
///
/// ```text
/// bits 127..126  mode m (0..=2; 3 is reserved): the smallest mode whose position field fits
/// next P(m) bits position, P = 8 | 16 | 24
/// next F(m) bits parent fragment:  low F bits of the parent's sequence hash (0 at position 0)
/// low  F(m) bits current fragment: low F bits of this block's sequence hash, F = 59 | 55 | 51
/// ```
///
/// **Cross-mode alignment.** At the last position of a mode (255 and 65535) the current fragment
/// is pre-truncated to the *next* mode's width, because the child (at 256 or 65536) can only store
/// that many parent bits. Hence, for every position, a child's [`parent_fragment`] equals its
/// parent's [`current_fragment`] exactly, and [`is_parent_of`] is one comparison.
///
/// [`parent_fragment`]: PositionalLineageHash::parent_fragment
/// [`current_fragment`]: PositionalLineageHash::current_fragment
/// [`is_parent_of`]: PositionalLineageHash::is_parent_of
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(try_from = "u128", into = "u128"))]
pub struct PositionalLineageHash(u128);

impl PositionalLineageHash {
    /// The largest encodable position (mode 2, 24 bits).
    pub const MAX_POSITION: u64 = (1 << 24) - 1;

    /// Packs a block's sequence hash, its parent's sequence hash and its position.
    ///
    /// # Errors
    /// - [`HashError::PositionOutOfRange`] when `position > MAX_POSITION`;
    /// - [`HashError::MissingParent`] when `position > 0` and `parent` is `None`;
    /// - [`HashError::UnexpectedParent`] when `position == 0` and `parent` is `Some`.
    pub fn new(
        current: SequenceHash,
        parent: Option<SequenceHash>,
        position: u64,
    ) -> Result<Self, HashError> {
        let mode = mode_for(position).ok_or(HashError::PositionOutOfRange {
            position,
            max: Self::MAX_POSITION,
        })?;
        let spec = &LINEAGE_MODES[mode];
        let parent_fragment = match (position, parent) {
            (0, None) => 0,
            (0, Some(_)) => return Err(HashError::UnexpectedParent),
            (_, None) => return Err(HashError::MissingParent { position }),
            (_, Some(parent)) => parent.get() & low_mask(spec.fragment_bits),
        };
        // The last position of a mode keeps only as many bits as its child's mode can store.
        let is_last_of_mode = position == low_mask(spec.position_bits);
        let current_bits = match LINEAGE_MODES.get(mode + 1) {
            Some(next) if is_last_of_mode => next.fragment_bits,
            _ => spec.fragment_bits,
        };
        let current_fragment = current.get() & low_mask(current_bits);

        let f = spec.fragment_bits;
        let raw = ((mode as u128) << 126)
            | ((position as u128) << (2 * f))
            | ((parent_fragment as u128) << f)
            | current_fragment as u128;
        Ok(Self(raw))
    }

    /// Reinterprets a raw value.
    ///
    /// # Errors
    /// [`HashError::InvalidMode`] when the top two bits hold the reserved mode 3.
    pub const fn from_u128(raw: u128) -> Result<Self, HashError> {
        let mode = (raw >> 126) as u8;
        if mode as usize >= LINEAGE_MODES.len() {
            return Err(HashError::InvalidMode { mode });
        }
        Ok(Self(raw))
    }

    /// The raw packed value.
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// The encoding mode (0..=2).
    pub const fn mode(self) -> u8 {
        (self.0 >> 126) as u8
    }

    /// The fragment of this block's sequence hash (59, 55 or 51 bits; fewer at a mode's last
    /// position, see the type docs).
    pub const fn current_fragment(self) -> u64 {
        (self.0 as u64) & low_mask(self.spec().fragment_bits)
    }

    /// The fragment of the parent's sequence hash (0 for position 0).
    pub const fn parent_fragment(self) -> u64 {
        let f = self.spec().fragment_bits;
        ((self.0 >> f) as u64) & low_mask(f)
    }

    /// Whether `child` is at the next position and names `self` as its parent.
    pub fn is_parent_of(self, child: Self) -> bool {
        child.position() == self.position() + 1
            && child.parent_fragment() == self.current_fragment()
    }

    const fn spec(self) -> &'static LineageMode {
        &LINEAGE_MODES[self.mode() as usize]
    }
}

impl PositionalHash for PositionalLineageHash {
    fn position(&self) -> u64 {
        let spec = self.spec();
        ((self.0 >> (2 * spec.fragment_bits)) as u64) & low_mask(spec.position_bits)
    }
}

impl TryFrom<u128> for PositionalLineageHash {
    type Error = HashError;

    fn try_from(raw: u128) -> Result<Self, HashError> {
        Self::from_u128(raw)
    }
}

impl From<PositionalLineageHash> for u128 {
    fn from(hash: PositionalLineageHash) -> u128 {
        hash.0
    }
}

/// The smallest lineage mode whose position field holds `position`.
fn mode_for(position: u64) -> Option<usize> {
    LINEAGE_MODES
        .iter()
        .position(|spec| position < 1 << spec.position_bits)
}
