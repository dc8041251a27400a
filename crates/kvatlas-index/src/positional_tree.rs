//! `PositionalRadixTree`: the sparse two-level map of the token-hashing design — position first,
//! then the positional hash — for values keyed by [`PositionalSequenceHash`] or
//! [`PositionalLineageHash`].
//!
//! Keys carry their own position ([`PositionalHash`]), so the outer level is implied by the key:
//! only populated positions have an inner map, every lookup is two hash probes, and all blocks at
//! one depth can be listed without scanning the rest. With [`PositionalLineageHash`] keys a
//! block's parent is found without pointers: look at the previous position for the key whose
//! current fragment is the child's parent fragment ([`PositionalRadixTree::parent`]).
//!
//! Single-threaded (`&mut self` writes); wrap it in a lock to share it.

use std::hash::Hash;

use kvatlas_hash::{PositionalHash, PositionalLineageHash, PositionalSequenceHash};
use rustc_hash::FxHashMap;

/// A map from positional hashes to values, grouped by position (see the module docs).
#[derive(Debug, Clone)]
pub struct PositionalRadixTree<V, K = PositionalSequenceHash>
where
    K: PositionalHash + Hash + Eq + Clone,
{
    map: FxHashMap<u64, FxHashMap<K, V>>,
    len: usize,
}

impl<V, K: PositionalHash + Hash + Eq + Clone> Default for PositionalRadixTree<V, K> {
    fn default() -> Self {
        Self {
            map: FxHashMap::default(),
            len: 0,
        }
    }
}

impl<V, K: PositionalHash + Hash + Eq + Clone> PositionalRadixTree<V, K> {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts `value` under `key`; returns the value it replaced, if any.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let old = self
            .map
            .entry(key.position())
            .or_default()
            .insert(key, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// The value under `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.map.get(&key.position())?.get(key)
    }

    /// The value under `key`, mutably.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.map.get_mut(&key.position())?.get_mut(key)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// Removes `key`; returns its value. A position left empty is dropped.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let position = key.position();
        let level = self.map.get_mut(&position)?;
        let value = level.remove(key)?;
        if level.is_empty() {
            self.map.remove(&position);
        }
        self.len -= 1;
        Some(value)
    }

    /// The entries at `position`, in no particular order (empty if none).
    pub fn position(&self, position: u64) -> impl Iterator<Item = (&K, &V)> {
        self.map.get(&position).into_iter().flatten()
    }

    /// Number of entries at `position`.
    pub fn len_at(&self, position: u64) -> usize {
        self.map.get(&position).map_or(0, FxHashMap::len)
    }

    /// The populated positions, in no particular order.
    pub fn positions(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.keys().copied()
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.values().flatten()
    }

    /// Total number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tree has no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.map.clear();
        self.len = 0;
    }
}

impl<V> PositionalRadixTree<V, PositionalLineageHash> {
    /// The entry of `child`'s parent: the key at the previous position whose current fragment is
    /// `child`'s parent fragment (`None` at position 0 or when the parent is absent).
    ///
    /// Fragments are 51 to 59 bits, so two parents could in principle share one; the first found
    /// is returned.
    pub fn parent(&self, child: &PositionalLineageHash) -> Option<(&PositionalLineageHash, &V)> {
        let position = child.position().checked_sub(1)?;
        self.position(position)
            .find(|(key, _)| key.is_parent_of(*child))
    }

    /// The entries whose parent is `parent` (at the next position, naming it as their parent).
    pub fn children<'a>(
        &'a self,
        parent: &'a PositionalLineageHash,
    ) -> impl Iterator<Item = (&'a PositionalLineageHash, &'a V)> + 'a {
        let next = parent.position().checked_add(1);
        next.into_iter()
            .flat_map(move |p| self.position(p))
            .filter(move |(key, _)| parent.is_parent_of(**key))
    }
}

#[cfg(test)]
mod tests {
    use kvatlas_hash::{LocalBlockHash, SequenceHash, compute_sequence_hashes};

    use super::*;

    fn locals(raw: &[u64]) -> Vec<LocalBlockHash> {
        raw.iter().copied().map(LocalBlockHash::new).collect()
    }

    fn sequence_keys(raw: &[u64]) -> Vec<PositionalSequenceHash> {
        let locals = locals(raw);
        compute_sequence_hashes(&locals)
            .into_iter()
            .zip(&locals)
            .enumerate()
            .map(|(i, (seq, local))| {
                PositionalSequenceHash::new(seq, i as u64, *local).expect("small position")
            })
            .collect()
    }

    fn lineage_keys(raw: &[u64]) -> Vec<PositionalLineageHash> {
        let seqs: Vec<SequenceHash> = compute_sequence_hashes(&locals(raw));
        seqs.iter()
            .enumerate()
            .map(|(i, seq)| {
                let parent = i.checked_sub(1).map(|p| seqs[p]);
                PositionalLineageHash::new(*seq, parent, i as u64).expect("small position")
            })
            .collect()
    }

    #[test]
    fn sequence_keys_insert_get_remove() {
        let mut tree: PositionalRadixTree<&str> = PositionalRadixTree::new();
        let a = sequence_keys(&[1, 2, 3]);
        let b = sequence_keys(&[1, 9, 3]);
        assert!(tree.is_empty());
        for (i, key) in a.iter().enumerate() {
            assert_eq!(tree.insert(*key, ["a0", "a1", "a2"][i]), None);
        }
        // b shares its first block with a: same key, replaced.
        assert_eq!(tree.insert(b[0], "b0"), Some("a0"));
        assert_eq!(tree.insert(b[1], "b1"), None);
        assert_eq!(tree.insert(b[2], "b2"), None);
        assert_eq!(tree.len(), 5);
        assert_eq!(tree.len_at(0), 1);
        assert_eq!(tree.len_at(2), 2);
        assert_eq!(tree.len_at(7), 0);
        assert_eq!(tree.get(&a[2]), Some(&"a2"));
        assert_eq!(tree.get(&b[2]), Some(&"b2"));
        assert_ne!(a[2], b[2], "same local hash, different prefix");
        if let Some(v) = tree.get_mut(&a[1]) {
            *v = "a1'";
        }
        assert_eq!(tree.get(&a[1]), Some(&"a1'"));

        let mut at_two: Vec<&str> = tree.position(2).map(|(_, v)| *v).collect();
        at_two.sort_unstable();
        assert_eq!(at_two, ["a2", "b2"]);
        assert_eq!(tree.position(99).count(), 0);
        let mut positions: Vec<u64> = tree.positions().collect();
        positions.sort_unstable();
        assert_eq!(positions, [0, 1, 2]);
        assert_eq!(tree.iter().count(), 5);

        assert_eq!(tree.remove(&a[2]), Some("a2"));
        assert_eq!(tree.remove(&a[2]), None);
        assert!(!tree.contains_key(&a[2]));
        assert_eq!(tree.remove(&b[2]), Some("b2"));
        assert_eq!(tree.len_at(2), 0);
        assert_eq!(tree.positions().count(), 2, "empty position dropped");
        assert_eq!(tree.len(), 3);
        tree.clear();
        assert!(tree.is_empty());
        assert_eq!(tree.positions().count(), 0);
    }

    #[test]
    fn lineage_keys_find_parents_and_children_without_pointers() {
        let mut tree: PositionalRadixTree<u32, PositionalLineageHash> = PositionalRadixTree::new();
        let a = lineage_keys(&[1, 2, 3, 4]);
        let b = lineage_keys(&[1, 2, 7, 4]);
        for (i, key) in a.iter().enumerate() {
            tree.insert(*key, i as u32);
        }
        for (i, key) in b.iter().enumerate().skip(2) {
            tree.insert(*key, 10 + i as u32);
        }
        assert_eq!(tree.len(), 6);
        assert_eq!(tree.parent(&a[0]), None, "position 0 has no parent");
        assert_eq!(tree.parent(&a[3]), Some((&a[2], &2)));
        assert_eq!(tree.parent(&b[3]), Some((&b[2], &12)));
        // Both branches hang under the shared block at position 1.
        assert_eq!(tree.parent(&b[2]), Some((&a[1], &1)));
        let mut children: Vec<u32> = tree.children(&a[1]).map(|(_, v)| *v).collect();
        children.sort_unstable();
        assert_eq!(children, [2, 12]);
        assert_eq!(tree.children(&a[3]).count(), 0);
        // Same local hash at position 3, different lineage: distinct keys, distinct parents.
        assert_ne!(a[3], b[3]);
        tree.remove(&a[2]);
        assert_eq!(tree.parent(&a[3]), None, "parent gone");
        assert_eq!(tree.parent(&b[3]), Some((&b[2], &12)));
    }

    #[test]
    fn deep_positions_cross_mode_boundaries() {
        // Positions 255/256 and 65535/65536 switch encoding modes; parent links still resolve.
        let locals: Vec<LocalBlockHash> = (0..300u64).map(LocalBlockHash::new).collect();
        let seqs = compute_sequence_hashes(&locals);
        let mut tree: PositionalRadixTree<usize, PositionalLineageHash> =
            PositionalRadixTree::new();
        let keys: Vec<PositionalLineageHash> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let parent = i.checked_sub(1).map(|p| seqs[p]);
                PositionalLineageHash::new(*s, parent, i as u64).expect("small position")
            })
            .collect();
        for (i, key) in keys.iter().enumerate() {
            tree.insert(*key, i);
        }
        for (i, key) in keys.iter().enumerate().skip(1) {
            assert_eq!(tree.parent(key).map(|(_, v)| *v), Some(i - 1));
        }
        let hi_seq = SequenceHash::new(42);
        let hi = PositionalLineageHash::new(hi_seq, Some(SequenceHash::new(41)), 70_000)
            .expect("in range");
        tree.insert(hi, 70_000);
        assert_eq!(tree.position(70_000).count(), 1);
        assert_eq!(tree.parent(&hi), None);
    }
}
