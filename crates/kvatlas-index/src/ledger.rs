//! Per-worker chain bookkeeping shared by every backend: which blocks a worker rank holds, their
//! parent links, and which of them are *rooted* — reachable from a sequence start through held
//! blocks — at each cumulative tier level.
//!
//! Backends never see holes, dangling parents, duplicates or conflicting stores: the ledger turns
//! every mutation into changes of **rooted membership** — "this worker now has one more (or one
//! fewer) rooted block at level `l` at the node for local path P" — through the [`Membership`]
//! trait. Rooted membership is prefix-closed along every path (a rooted block's parent is rooted
//! at the same or a lower level), so a backend that stores exactly these counts answers
//! `find_matches` exactly, and may jump or binary-search along a query.
//!
//! Invariants (checked by the differential tests against [`crate::ReferenceIndex`]):
//! - `level(b) = max(best_level(tiers(b)), level(parent(b)))`, with `level = 0, 1, 2` for
//!   device / host / disk-or-external, a root's parent counting as level 0, and an unheld parent
//!   making `b` [`UNROOTED`];
//! - a block has a node (and exactly one membership, at its level) iff it is rooted;
//! - `children(b)` lists exactly the held blocks whose parent hash is `b`'s hash; held blocks
//!   whose parent is not held are listed under that hash in `dangling`.

use kvatlas_hash::LocalBlockHash;
use rustc_hash::FxHashMap;

use crate::model::{ApplyReport, ExternalBlockHash, Level, StoredBlock, Tier, TierSet, UNROOTED};
use crate::snapshot::SnapshotBlock;

/// How a backend records rooted membership for one worker rank.
pub(crate) trait Membership {
    /// The backend's handle of a node (a local-hash path from the root).
    type Node: Copy;

    /// The node for `local` under `parent` (`None` = a first block), created if needed.
    fn child(&mut self, parent: Option<Self::Node>, local: LocalBlockHash) -> Self::Node;

    /// One more rooted block of this worker at `node`, at `level`.
    fn add(&mut self, node: Self::Node, level: Level);

    /// One fewer rooted block of this worker at `node`, at `level`. After the last membership
    /// of every worker is gone from a node and its descendants, the backend may free it.
    fn remove(&mut self, node: Self::Node, level: Level);
}

/// Marks "no slot" in the intrusive lists.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Slot<N> {
    external: ExternalBlockHash,
    local: LocalBlockHash,
    /// The parent's engine hash; meaningful only if `has_parent`.
    parent: ExternalBlockHash,
    has_parent: bool,
    tiers: TierSet,
    level: Level,
    /// The parent's slot when the parent is held, else `NIL`.
    parent_slot: u32,
    first_child: u32,
    next_sibling: u32,
    prev_sibling: u32,
    /// Set iff the block is rooted.
    node: Option<N>,
}

/// One worker rank's blocks and chains.
#[derive(Debug, Clone)]
pub(crate) struct Ledger<N> {
    by_hash: FxHashMap<ExternalBlockHash, u32>,
    slots: Vec<Slot<N>>,
    free: Vec<u32>,
    /// Held blocks whose parent is not held, by that parent's hash.
    dangling: FxHashMap<ExternalBlockHash, Vec<u32>>,
    per_tier: [u64; 4],
}

impl<N> Default for Ledger<N> {
    fn default() -> Self {
        Self {
            by_hash: FxHashMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            dangling: FxHashMap::default(),
            per_tier: [0; 4],
        }
    }
}

impl<N: Copy> Ledger<N> {
    /// Blocks held per tier.
    pub(crate) fn per_tier(&self) -> [u64; 4] {
        self.per_tier
    }

    /// Number of held blocks (any tier).
    pub(crate) fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Approximate heap bytes of this ledger.
    pub(crate) fn heap_bytes(&self) -> u64 {
        let map_entry = std::mem::size_of::<(ExternalBlockHash, u32)>() + 1;
        let dangling: usize = self.dangling.values().map(|v| v.capacity() * 4 + 32).sum();
        (self.by_hash.capacity() * map_entry
            + self.slots.capacity() * std::mem::size_of::<Slot<N>>()
            + self.free.capacity() * 4
            + dangling) as u64
    }

    /// Applies a stored run.
    pub(crate) fn store<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        tier: Tier,
        parent: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
        report: &mut ApplyReport,
    ) {
        if let Some(parent) = parent
            && !blocks.is_empty()
            && !self.by_hash.contains_key(&parent)
        {
            report.unknown_parents += 1;
        }
        let mut previous = parent;
        for block in blocks {
            match self.by_hash.get(&block.external).copied() {
                Some(slot) => {
                    let existing = &self.slots[slot as usize];
                    let same_parent = match previous {
                        Some(p) => existing.has_parent && existing.parent == p,
                        None => !existing.has_parent,
                    };
                    if existing.local != block.local || !same_parent {
                        report.conflicting_stores += 1;
                    } else if existing.tiers.contains(tier) {
                        report.duplicate_stores += 1;
                    } else {
                        self.slots[slot as usize].tiers = existing.tiers.with(tier);
                        self.per_tier[tier.index()] += 1;
                        report.stored += 1;
                        self.propagate(sink, slot);
                    }
                }
                None => {
                    self.insert(
                        sink,
                        block.external,
                        block.local,
                        previous,
                        TierSet::only(tier),
                    );
                    report.stored += 1;
                }
            }
            previous = Some(block.external);
        }
    }

    /// Restores one block from a snapshot (any order; dangling parents allowed).
    pub(crate) fn restore<M: Membership<Node = N>>(&mut self, sink: &mut M, block: &SnapshotBlock) {
        if block.tiers.is_empty() || self.by_hash.contains_key(&block.external) {
            return;
        }
        self.insert(sink, block.external, block.local, block.parent, block.tiers);
    }

    /// Applies a removal on one tier.
    pub(crate) fn remove<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        tier: Tier,
        blocks: &[ExternalBlockHash],
        report: &mut ApplyReport,
    ) {
        for hash in blocks {
            let Some(slot) = self.by_hash.get(hash).copied() else {
                report.unknown_removes += 1;
                continue;
            };
            let tiers = self.slots[slot as usize].tiers;
            if !tiers.contains(tier) {
                report.unknown_removes += 1;
                continue;
            }
            report.removed += 1;
            self.per_tier[tier.index()] -= 1;
            let remaining = tiers.without(tier);
            self.slots[slot as usize].tiers = remaining;
            self.propagate(sink, slot);
            if remaining.is_empty() {
                self.delete(slot);
            }
        }
    }

    /// Drops every block; returns the number of (block, tier) memberships that ended.
    ///
    /// Memberships are removed children first, keeping the backend's view prefix-closed.
    pub(crate) fn clear<M: Membership<Node = N>>(&mut self, sink: &mut M) -> u64 {
        let mut ended = 0;
        // Pre-order over the rooted forest (rooted blocks whose parent is not a rooted block are
        // exactly the first blocks of sequences), then remove in reverse.
        let mut order = Vec::new();
        for &slot in self.by_hash.values() {
            let s = &self.slots[slot as usize];
            ended += u64::from(s.tiers.bits().count_ones());
            if s.node.is_some() && !s.has_parent {
                order.push(slot);
            }
        }
        let mut next = 0;
        while next < order.len() {
            let mut child = self.slots[order[next] as usize].first_child;
            next += 1;
            while child != NIL {
                if self.slots[child as usize].node.is_some() {
                    order.push(child);
                }
                child = self.slots[child as usize].next_sibling;
            }
        }
        for &slot in order.iter().rev() {
            let s = &self.slots[slot as usize];
            if let Some(node) = s.node {
                sink.remove(node, s.level);
            }
        }
        *self = Self::default();
        ended
    }

    /// Every held block, for a snapshot.
    pub(crate) fn snapshot(&self) -> Vec<SnapshotBlock> {
        let mut blocks: Vec<SnapshotBlock> = self
            .by_hash
            .values()
            .map(|&slot| {
                let s = &self.slots[slot as usize];
                SnapshotBlock {
                    external: s.external,
                    local: s.local,
                    parent: s.has_parent.then_some(s.parent),
                    tiers: s.tiers,
                }
            })
            .collect();
        blocks.sort_unstable_by_key(|b| b.external);
        blocks
    }

    fn insert<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        external: ExternalBlockHash,
        local: LocalBlockHash,
        parent: Option<ExternalBlockHash>,
        tiers: TierSet,
    ) {
        let slot = Slot {
            external,
            local,
            parent: parent.unwrap_or(ExternalBlockHash::new(0)),
            has_parent: parent.is_some(),
            tiers,
            level: UNROOTED,
            parent_slot: NIL,
            first_child: NIL,
            next_sibling: NIL,
            prev_sibling: NIL,
            node: None,
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index as usize] = slot;
                index
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.by_hash.insert(external, index);
        for tier in tiers.iter() {
            self.per_tier[tier.index()] += 1;
        }
        if let Some(parent) = parent {
            match self.by_hash.get(&parent).copied() {
                Some(parent_slot) if parent_slot != index => self.link(parent_slot, index),
                _ => self.dangling.entry(parent).or_default().push(index),
            }
        }
        // Blocks stored earlier whose parent is this block now hang under it.
        if let Some(children) = self.dangling.remove(&external) {
            for child in children {
                if child != index {
                    self.link(index, child);
                }
            }
        }
        self.propagate(sink, index);
    }

    /// Unlinks and frees a block that is held on no tier (already unrooted by `propagate`).
    fn delete(&mut self, slot: u32) {
        let s = self.slots[slot as usize].clone();
        debug_assert!(s.node.is_none() && s.tiers.is_empty());
        // Its children now wait for this hash to be stored again.
        let mut child = s.first_child;
        while child != NIL {
            let next = self.slots[child as usize].next_sibling;
            let c = &mut self.slots[child as usize];
            c.parent_slot = NIL;
            c.next_sibling = NIL;
            c.prev_sibling = NIL;
            self.dangling.entry(s.external).or_default().push(child);
            child = next;
        }
        if s.parent_slot != NIL {
            self.unlink(slot);
        } else if s.has_parent
            && let Some(waiting) = self.dangling.get_mut(&s.parent)
        {
            waiting.retain(|&c| c != slot);
            if waiting.is_empty() {
                self.dangling.remove(&s.parent);
            }
        }
        self.by_hash.remove(&s.external);
        self.free.push(slot);
    }

    fn link(&mut self, parent: u32, child: u32) {
        let head = self.slots[parent as usize].first_child;
        {
            let c = &mut self.slots[child as usize];
            c.parent_slot = parent;
            c.prev_sibling = NIL;
            c.next_sibling = head;
        }
        if head != NIL {
            self.slots[head as usize].prev_sibling = child;
        }
        self.slots[parent as usize].first_child = child;
    }

    fn unlink(&mut self, child: u32) {
        let (parent, prev, next) = {
            let c = &self.slots[child as usize];
            (c.parent_slot, c.prev_sibling, c.next_sibling)
        };
        if prev != NIL {
            self.slots[prev as usize].next_sibling = next;
        } else {
            self.slots[parent as usize].first_child = next;
        }
        if next != NIL {
            self.slots[next as usize].prev_sibling = prev;
        }
        let c = &mut self.slots[child as usize];
        c.parent_slot = NIL;
        c.prev_sibling = NIL;
        c.next_sibling = NIL;
    }

    /// The level `slot` should have given its tiers and its parent.
    fn wanted_level(&self, slot: u32) -> Level {
        let s = &self.slots[slot as usize];
        let own = s.tiers.best_level();
        if !s.has_parent {
            return own;
        }
        if s.parent_slot == NIL {
            return UNROOTED;
        }
        own.max(self.slots[s.parent_slot as usize].level)
    }

    /// Recomputes `slot`'s level and, when it changed, its membership and its descendants'.
    ///
    /// Within one call every change goes the same way (a child's level is the max of its own and
    /// its parent's). Improvements are applied parents first and worsenings children first, so
    /// the backend's rooted membership stays prefix-closed at *every* call it receives, not just
    /// between mutations — backends may store coverage as prefix lengths.
    fn propagate<M: Membership<Node = N>>(&mut self, sink: &mut M, slot: u32) {
        let wanted = self.wanted_level(slot);
        let old = self.slots[slot as usize].level;
        if wanted == old {
            return;
        }
        // Pre-order list of (slot, new level) for the subtree part whose level changes.
        let mut changes = vec![(slot, wanted)];
        let mut next = 0;
        while next < changes.len() {
            let (parent, parent_level) = changes[next];
            next += 1;
            let mut child = self.slots[parent as usize].first_child;
            while child != NIL {
                let c = &self.slots[child as usize];
                let level = c.tiers.best_level().max(parent_level);
                if level != c.level {
                    changes.push((child, level));
                }
                child = c.next_sibling;
            }
        }
        if wanted < old {
            for (slot, level) in changes {
                self.set_level(sink, slot, level);
            }
        } else {
            for (slot, level) in changes.into_iter().rev() {
                self.set_level(sink, slot, level);
            }
        }
    }

    /// Moves one block to `level`, adding the new membership before removing the old one so the
    /// backend never sees the node empty (and frees it) in between.
    fn set_level<M: Membership<Node = N>>(&mut self, sink: &mut M, slot: u32, level: Level) {
        let s = &self.slots[slot as usize];
        let (old_level, old_node) = (s.level, s.node);
        let node = if level == UNROOTED {
            None
        } else {
            let node = match old_node {
                Some(node) => node,
                None => {
                    let parent_node = match s.parent_slot {
                        NIL => None,
                        parent => self.slots[parent as usize].node,
                    };
                    sink.child(parent_node, s.local)
                }
            };
            sink.add(node, level);
            Some(node)
        };
        if let Some(old) = old_node {
            sink.remove(old, old_level);
        }
        let s = &mut self.slots[slot as usize];
        s.level = level;
        s.node = node;
    }
}
