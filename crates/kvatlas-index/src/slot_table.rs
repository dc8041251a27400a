//! A hash table of block slots keyed by engine hash, shared by the per-rank ledgers: the
//! entries are the slots only (2 bytes each, beside a 2-byte tag, while they fit), and a
//! lookup compares the engine hash stored at a candidate slot whose tag matches.

use hashbrown::HashTable;

use crate::model::{ExternalBlockHash, table_bytes};
use crate::tag_table::TagTable;

/// The hash a [`SlotTable`] files an engine hash under (every ledger's, so that one is used):
/// a folded multiply (the 128-bit product's halves XORed), so that every bit of the engine hash
/// reaches every bit of the result — the tables take the bucket, the tag and hashbrown's 7-bit
/// tag from different bits. Unseeded, like the Fx hash it replaced: engine hashes are not
/// expected to be chosen against it, and crafted collisions cost time, never unbounded memory.
#[inline]
pub(crate) fn hash_of(external: ExternalBlockHash) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    const SALT: u64 = 0x243F_6A88_85A3_08D3;
    let product = u128::from(external.get() ^ SALT) * u128::from(K);
    (product as u64) ^ ((product >> 64) as u64)
}

/// Slot indices hashed by engine hash: 2-byte entries beside 2-byte tags in cache-line buckets
/// ([`TagTable`]) while every slot index fits (a rank with at most 65,536 slots — nearly always),
/// 4-byte entries in hashbrown beyond (rare enough that its plainer code wins).
#[derive(Debug, Clone)]
pub(crate) enum SlotTable {
    Narrow(TagTable),
    Wide(HashTable<u32>),
}

impl Default for SlotTable {
    fn default() -> Self {
        Self::Narrow(TagTable::default())
    }
}

impl SlotTable {
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Narrow(t) => t.len(),
            Self::Wide(t) => t.len(),
        }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Self::Narrow(t) => t.heap_bytes(),
            Self::Wide(t) => table_bytes(t.capacity(), 4),
        }
    }

    /// The slot index whose entry satisfies `eq`.
    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl Fn(u32) -> bool) -> Option<u32> {
        match self {
            Self::Narrow(t) => t.find(hash, eq),
            Self::Wide(t) => t.find(hash, |&i| eq(i)).copied(),
        }
    }

    /// Adds `slot` (not yet in the table); `rehash` gives any present slot's hash.
    pub(crate) fn insert(&mut self, hash: u64, slot: u32, rehash: impl Fn(u32) -> u64) {
        if let Self::Narrow(t) = self
            && u16::try_from(slot).is_err()
        {
            let mut wide = HashTable::with_capacity(t.len() + 1);
            for i in t.iter() {
                wide.insert_unique(rehash(i), i, |&j| rehash(j));
            }
            *self = Self::Wide(wide);
        }
        match self {
            Self::Narrow(t) => t.insert(hash, slot as u16, rehash),
            Self::Wide(t) => {
                t.insert_unique(hash, slot, |&i| rehash(i));
            }
        }
    }

    /// In one probe: the slot whose entry satisfies `eq`, or else `slot` added (it must not be
    /// in the table yet) and `None`. `rehash` gives any present slot's hash; `more` is how many
    /// entries the caller may add from this one on (a growing table makes room for them all).
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        slot: u32,
        more: usize,
        eq: impl Fn(u32) -> bool,
        rehash: impl Fn(u32) -> u64,
    ) -> Option<u32> {
        if matches!(self, Self::Narrow(_)) && u16::try_from(slot).is_err() {
            // Widen first (rarely: a rank past 65,535 slots), then probe the wide table.
            let found = self.find(hash, &eq);
            if found.is_none() {
                self.insert(hash, slot, rehash);
            }
            return found;
        }
        match self {
            Self::Narrow(t) => t.find_or_insert(hash, slot as u16, more, eq, rehash),
            Self::Wide(t) => match t.entry(hash, |&i| eq(i), |&i| rehash(i)) {
                hashbrown::hash_table::Entry::Occupied(o) => Some(*o.get()),
                hashbrown::hash_table::Entry::Vacant(v) => {
                    v.insert(slot);
                    None
                }
            },
        }
    }

    /// Removes the entries of the slots `slots`, slot `s` hashed `hash_at(s)` (a deleted run's:
    /// the narrow form loads each bucket ahead of its removal).
    pub(crate) fn remove_each(
        &mut self,
        slots: std::ops::Range<u32>,
        hash_at: impl Fn(u32) -> u64,
    ) {
        match self {
            Self::Narrow(t) => t.remove_each(slots, hash_at),
            Self::Wide(t) => {
                for slot in slots {
                    if let Ok(entry) = t.find_entry(hash_at(slot), |&i| i == slot) {
                        entry.remove();
                    }
                }
            }
        }
    }

    /// Removes the entry of `slot`, hashed `hash`.
    pub(crate) fn remove(&mut self, hash: u64, slot: u32) {
        match self {
            Self::Narrow(t) => t.remove(hash, slot),
            Self::Wide(t) => {
                if let Ok(entry) = t.find_entry(hash, |&i| i == slot) {
                    entry.remove();
                }
            }
        }
    }

    /// Reads the whole table once, front to back. A removal naming a good part of a rank's
    /// blocks probes the table at scattered places, each probe a cache miss when the rank has
    /// not been touched lately (and each waiting for the one before, inside the removal's
    /// dependent work); one sequential pass streams the table in at memory bandwidth instead.
    pub(crate) fn warm(&self) {
        let sum = match self {
            Self::Narrow(t) => return t.warm(),
            Self::Wide(t) => t.iter().fold(0u32, |a, &i| a.wrapping_add(i)),
        };
        std::hint::black_box(sum);
    }

    /// Every slot index in the table.
    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            Self::Narrow(t) => Box::new(t.iter()),
            Self::Wide(t) => Box::new(t.iter().copied()),
        }
    }
}
