//! Rolling sequence hashes: the identity of a block *together with everything before it*.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::{BASE_SEED, LocalBlockHash};

/// Cumulative hash of a block and its whole prefix, in Dynamo's contract:
/// `seq[0] = local[0]`, `seq[i] = XXH3-64(le(seq[i-1]) ‖ le(local[i]), seed 1337)`.
///
/// Two blocks with equal tokens but different prefixes get different sequence hashes. LoRA and
/// cache salt enter only through the local hashes' seed.
///
/// ```
/// use kvatlas_hash::{BlockHasher, LocalBlockHash, SequenceHash, sequence_hashes};
///
/// let hasher = BlockHasher::new(4)?;
/// let locals: Vec<LocalBlockHash> = hasher.local_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]).collect();
/// let seqs: Vec<SequenceHash> = sequence_hashes(locals.iter().copied()).collect();
/// assert_eq!(seqs[0], SequenceHash::first(locals[0])); // the first block: its local hash
/// assert_eq!(seqs[1], seqs[0].extend(locals[1]));
/// assert_eq!(seqs[1].get(), 0x44a2_b237_9d6d_3c3d); // Dynamo 1.6.1's value
///
/// // The same second block after another first block: same local hash, new sequence hash.
/// let other = SequenceHash::first(hasher.hash_block(&[9, 9, 9, 9])).extend(locals[1]);
/// assert_ne!(other, seqs[1]);
/// # Ok::<(), kvatlas_hash::HashError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct SequenceHash(u64);

impl SequenceHash {
    /// Wraps a raw value (for example one received over the wire).
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw 64-bit value.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The sequence hash of the first block of a sequence: its local hash.
    pub const fn first(local: LocalBlockHash) -> Self {
        Self(local.get())
    }

    /// The sequence hash of the block after `self` whose local hash is `local`.
    #[inline]
    pub fn extend(self, local: LocalBlockHash) -> Self {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.0.to_le_bytes());
        bytes[8..].copy_from_slice(&local.get().to_le_bytes());
        Self(xxh3_64_with_seed(&bytes, BASE_SEED))
    }

    /// The sequence hash of a block given its parent's (`None` for the first block).
    #[inline]
    pub fn chain(parent: Option<Self>, local: LocalBlockHash) -> Self {
        match parent {
            Some(parent) => parent.extend(local),
            None => Self::first(local),
        }
    }
}

/// Iterator adapter turning local hashes into sequence hashes; see [`sequence_hashes`].
#[derive(Debug, Clone)]
pub struct SequenceHashes<I> {
    locals: I,
    previous: Option<SequenceHash>,
}

impl<I: Iterator<Item = LocalBlockHash>> Iterator for SequenceHashes<I> {
    type Item = SequenceHash;

    #[inline]
    fn next(&mut self) -> Option<SequenceHash> {
        let local = self.locals.next()?;
        let hash = SequenceHash::chain(self.previous, local);
        self.previous = Some(hash);
        Some(hash)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.locals.size_hint()
    }
}

impl<I: ExactSizeIterator<Item = LocalBlockHash>> ExactSizeIterator for SequenceHashes<I> {}

/// Chains local hashes into sequence hashes lazily, starting a new sequence (no parent).
///
/// To continue an existing sequence, use [`sequence_hashes_after`].
pub fn sequence_hashes<I: IntoIterator<Item = LocalBlockHash>>(
    locals: I,
) -> SequenceHashes<I::IntoIter> {
    SequenceHashes {
        locals: locals.into_iter(),
        previous: None,
    }
}

/// Chains local hashes into sequence hashes lazily, continuing after `parent`.
pub fn sequence_hashes_after<I: IntoIterator<Item = LocalBlockHash>>(
    parent: Option<SequenceHash>,
    locals: I,
) -> SequenceHashes<I::IntoIter> {
    SequenceHashes {
        locals: locals.into_iter(),
        previous: parent,
    }
}

/// The sequence hashes of a whole sequence of local hashes (convenience for [`sequence_hashes`]).
pub fn compute_sequence_hashes(locals: &[LocalBlockHash]) -> Vec<SequenceHash> {
    sequence_hashes(locals.iter().copied()).collect()
}
