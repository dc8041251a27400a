//! A hash table of block positions keyed by engine hash, shared by the per-rank ledgers: the
//! entries are the positions only (2 bytes each while they fit), and every lookup compares the
//! engine hash stored at the candidate position.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;

use crate::model::{ExternalBlockHash, table_bytes};

/// The hash a [`SlotTable`] files an engine hash under (every ledger's, so that one is used).
pub(crate) fn hash_of(external: ExternalBlockHash) -> u64 {
    FxBuildHasher.hash_one(external.get())
}

/// Slot indices hashed by engine hash: 2-byte entries while every slot index fits (a rank with
/// fewer than 65,535 slots — nearly always), 4-byte entries beyond.
#[derive(Debug, Clone)]
pub(crate) enum SlotTable {
    Narrow(HashTable<u16>),
    Wide(HashTable<u32>),
}

impl Default for SlotTable {
    fn default() -> Self {
        Self::Narrow(HashTable::new())
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
            Self::Narrow(t) => table_bytes(t.capacity(), 2),
            Self::Wide(t) => table_bytes(t.capacity(), 4),
        }
    }

    /// The slot index whose entry satisfies `eq`.
    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl Fn(u32) -> bool) -> Option<u32> {
        match self {
            Self::Narrow(t) => t.find(hash, |&i| eq(u32::from(i))).map(|&i| u32::from(i)),
            Self::Wide(t) => t.find(hash, |&i| eq(i)).copied(),
        }
    }

    /// Adds `slot` (not yet in the table); `rehash` gives any present slot's hash.
    pub(crate) fn insert(&mut self, hash: u64, slot: u32, rehash: impl Fn(u32) -> u64) {
        if let Self::Narrow(t) = self
            && u16::try_from(slot).is_err()
        {
            let mut wide = HashTable::with_capacity(t.len() + 1);
            for &i in t.iter() {
                let i = u32::from(i);
                wide.insert_unique(rehash(i), i, |&j| rehash(j));
            }
            *self = Self::Wide(wide);
        }
        match self {
            Self::Narrow(t) => {
                let narrow = slot as u16;
                t.insert_unique(hash, narrow, |&i| rehash(u32::from(i)));
            }
            Self::Wide(t) => {
                t.insert_unique(hash, slot, |&i| rehash(i));
            }
        }
    }

    /// In one probe: the slot whose entry satisfies `eq`, or else `slot` added (it must not be
    /// in the table yet) and `None`. `rehash` gives any present slot's hash.
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        slot: u32,
        eq: impl Fn(u32) -> bool,
        rehash: impl Fn(u32) -> u64,
    ) -> Option<u32> {
        if matches!(self, Self::Narrow(_)) && u16::try_from(slot).is_err() {
            // Widen first (rarely: a rank past 65,535 positions), then probe the wide table.
            let found = self.find(hash, &eq);
            if found.is_none() {
                self.insert(hash, slot, rehash);
            }
            return found;
        }
        match self {
            Self::Narrow(t) => {
                match t.entry(hash, |&i| eq(u32::from(i)), |&i| rehash(u32::from(i))) {
                    hashbrown::hash_table::Entry::Occupied(o) => Some(u32::from(*o.get())),
                    hashbrown::hash_table::Entry::Vacant(v) => {
                        v.insert(slot as u16);
                        None
                    }
                }
            }
            Self::Wide(t) => match t.entry(hash, |&i| eq(i), |&i| rehash(i)) {
                hashbrown::hash_table::Entry::Occupied(o) => Some(*o.get()),
                hashbrown::hash_table::Entry::Vacant(v) => {
                    v.insert(slot);
                    None
                }
            },
        }
    }

    /// Removes the entry of `slot`, hashed `hash`.
    pub(crate) fn remove(&mut self, hash: u64, slot: u32) {
        match self {
            Self::Narrow(t) => {
                if let Ok(entry) = t.find_entry(hash, |&i| u32::from(i) == slot) {
                    entry.remove();
                }
            }
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
            Self::Narrow(t) => t.iter().fold(0u32, |a, &i| a.wrapping_add(u32::from(i))),
            Self::Wide(t) => t.iter().fold(0u32, |a, &i| a.wrapping_add(i)),
        };
        std::hint::black_box(sum);
    }

    /// Every slot index in the table.
    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            Self::Narrow(t) => Box::new(t.iter().map(|&i| u32::from(i))),
            Self::Wide(t) => Box::new(t.iter().copied()),
        }
    }
}
