//! Per-rank chain bookkeeping, one slot per block (the ledger of `radix`, `positional` and
//! `crtc`; Atlas uses [`crate::run_ledger::RunLedger`], which keeps the same contract per run of
//! blocks): which blocks a worker rank holds, their parent links, and which of them are *rooted*
//! — reachable from a sequence start through held blocks — at each cumulative tier level.
//!
//! Backends never see holes, dangling parents, duplicates or conflicting stores: the ledger turns
//! every mutation into changes of **rooted membership** — "this worker now has one more (or one
//! fewer) rooted block at level `l` at the node for local path P" — through the [`Membership`]
//! trait. Rooted membership is prefix-closed along every path (a rooted block's parent is rooted
//! at the same or a lower level), and the ledger keeps it prefix-closed at *every* call it makes,
//! so a backend may store coverage as prefix lengths, stop a worker at its first miss, or jump and
//! binary-search along a query, and still answer exactly.
//!
//! Invariants (checked by the differential tests against [`crate::ReferenceIndex`]):
//! - `level(b) = max(best_level(tiers(b)), level(parent(b)))`, with `level = 0, 1, 2` for
//!   device / host / disk-or-external, a root's parent counting as level 0, and an unheld parent
//!   making `b` [`UNROOTED`];
//! - a block has a node (and exactly one membership, at its level) iff it is rooted;
//! - the children list of `b` holds exactly the held blocks whose parent hash is `b`'s hash;
//!   held blocks whose parent is not held are listed under that hash in `dangling`.
//!
//! Memory: a block costs one 32-byte slot plus its entry in a hash table of slot indices (a
//! 2-byte index and a 2-byte tag in 64-byte buckets, 5.7–7.1 bytes per entry; 4-byte entries in
//! hashbrown past 65,536 slots).
//! A rooted block keeps its node handle (the backend knows the node's local hash); an unrooted
//! one keeps its local hash in the same word. A parent hash is the parent slot's own hash, except
//! for dangling blocks, whose missing parent's hash is kept in a side table.

use std::cell::Cell;
use std::marker::PhantomData;

use kvatlas_hash::LocalBlockHash;
use rustc_hash::FxHashMap;

use std::collections::BTreeMap;

use crate::model::{
    ApplyReport, ExternalBlockHash, IndexStats, Level, Mutation, StoredBlock, Tier, TierSet,
    UNROOTED, Worker, WorkerBlocks, table_bytes,
};
use crate::run_ledger::RunNode;
use crate::slot_table::{SlotTable, hash_of};
use crate::snapshot::{Snapshot, SnapshotBlock, WorkerSnapshot};

/// A backend's node handle, storable in one `u64`.
pub(crate) trait NodeBits: Copy {
    /// The handle as bits.
    fn to_bits(self) -> u64;
    /// The handle back from [`NodeBits::to_bits`].
    fn from_bits(bits: u64) -> Self;
}

impl NodeBits for u32 {
    fn to_bits(self) -> u64 {
        u64::from(self)
    }

    fn from_bits(bits: u64) -> Self {
        bits as u32
    }
}

/// A cursor over a held block's children, oldest to newest. It reads the ledger at each step
/// and fetches the next child before yielding the current one, so a loop body may change the
/// yielded child (even unlink its sibling pointer) but not the parent's list.
struct Children {
    /// The parent's newest child: where the circular list ends.
    last: u32,
    next: u32,
}

impl Children {
    fn of<N>(ledger: &Ledger<N>, parent: u32) -> Self {
        let last = ledger.slots[parent as usize].last_child;
        let next = match last {
            NIL => NIL,
            last => ledger.slots[last as usize].next_sibling,
        };
        Self { last, next }
    }

    #[inline]
    fn next<N>(&mut self, ledger: &Ledger<N>) -> Option<u32> {
        let child = self.next;
        if child == NIL {
            return None;
        }
        self.next = if child == self.last {
            NIL
        } else {
            ledger.slots[child as usize].next_sibling
        };
        Some(child)
    }
}

/// How a backend records rooted membership for one worker rank.
pub(crate) trait Membership {
    /// The backend's handle of a node (a local-hash path from the root).
    type Node: NodeBits;

    /// The node for `local` under `parent` (`None` = a first block), created if needed.
    fn child(&mut self, parent: Option<Self::Node>, local: LocalBlockHash) -> Self::Node;

    /// The local hash of the node's last block.
    fn local(&self, node: Self::Node) -> LocalBlockHash;

    /// One more rooted block of this worker at `node`, at `level`.
    fn add(&mut self, node: Self::Node, level: Level);

    /// A hint: about `blocks` more nodes may be asked for along one path (a stored run), so
    /// storage for them can be reserved at once. Default: ignored.
    fn expect(&mut self, blocks: usize) {
        let _ = blocks;
    }

    /// One fewer rooted block of this worker at `node`, at `level`. After the last membership
    /// of every worker is gone from a node and its descendants, the backend may free it.
    fn remove(&mut self, node: Self::Node, level: Level);

    /// Adds rooted blocks along one path: the node for `locals[0]` under `from`, then for as
    /// many of the following locals as the backend chooses, each under the one before, all at
    /// `level`. Returns the first node and how many blocks were added (at least one). A
    /// backend whose nodes are positions along stretches of path ([`crate::run_ledger::RunNode`])
    /// may add several at once, but only while they stay at consecutive positions of the first
    /// node's stretch. Default: one block ([`Membership::child`] and [`Membership::add`]).
    fn extend_path(
        &mut self,
        from: Self::Node,
        locals: &[LocalBlockHash],
        level: Level,
    ) -> (Self::Node, usize) {
        let node = self.child(Some(from), locals[0]);
        self.add(node, level);
        (node, 1)
    }

    /// [`Membership::add`] for the `len` consecutive nodes `first.advance(0..len)` of one
    /// stretch, in path order (a run of the run-structured ledger changing level). Default: one
    /// call per block; a backend that keeps covers per stretch does it in one step.
    fn add_along(&mut self, first: Self::Node, len: u32, level: Level)
    where
        Self::Node: RunNode,
    {
        for k in 0..len {
            self.add(first.advance(k), level);
        }
    }

    /// [`Membership::remove`] for the `len` consecutive nodes `first.advance(0..len)` of one
    /// stretch, last first (so the path stays prefix-closed in between).
    fn remove_along(&mut self, first: Self::Node, len: u32, level: Level)
    where
        Self::Node: RunNode,
    {
        for k in (0..len).rev() {
            self.remove(first.advance(k), level);
        }
    }

    /// Appends the local hashes of the `len` consecutive nodes `first.advance(0..len)` to
    /// `into` (a run leaving the rooted forest keeps them).
    fn locals_along(&self, first: Self::Node, len: u32, into: &mut Vec<LocalBlockHash>)
    where
        Self::Node: RunNode,
    {
        into.extend((0..len).map(|k| self.local(first.advance(k))));
    }
}

/// A removal naming at least 1/`WARM_DIVISOR` of a rank's blocks first reads the rank's whole
/// slot table ([`SlotTable::warm`]): the pass costs a sequential read of the table, less than
/// the scattered misses it saves from that many probes (synthetic remove 68 → 52 µs). A store
/// does not: its probes hit lines a removal or an earlier store of the run's neighbours touched,
/// and the pass cost more than it saved there (store 47 → 60 µs).
const WARM_DIVISOR: usize = 16;
/// Only a rank holding at least this many blocks has its table read first: a smaller table
/// (≤ 12 KB with its control bytes) is likely still cached, and reading it whole then costs
/// more than the probes it would warm (Workload A's ranks hold at most 512 blocks).
const WARM_MIN_BLOCKS: usize = 4096;

/// Marks "none" in the ledgers' links (no slot, run or position).
pub(crate) const NIL: u32 = u32::MAX;
/// `Slot::flags`: the block has a parent.
const HAS_PARENT: u8 = 1;
/// `Slot::flags`: the slot is on the free list.
const FREED: u8 = 2;
/// `Slot::flags`: the slot is on `remove`'s deletion stack (parent links can form cycles).
const VISITING: u8 = 4;

#[derive(Debug, Clone, Copy)]
struct Slot {
    external: ExternalBlockHash,
    /// Rooted: the node handle's bits. Unrooted: the local hash.
    payload: u64,
    /// The parent's slot when the parent is held, else `NIL`.
    parent_slot: u32,
    /// The newest held child, `NIL` if none. Siblings form a circular list through
    /// `next_sibling`, entered here: `last_child.next_sibling` is the oldest child, so the
    /// oldest child (what LRU eviction removes) is unlinked in O(1).
    last_child: u32,
    next_sibling: u32,
    tiers: TierSet,
    level: Level,
    flags: u8,
}

thread_local! {
    // Working buffers of one mutation, reused by the next one on the same thread. They are not
    // index state (their size follows the largest single mutation, not the index), so one set
    // per thread replaces one per rank. Taken and put back, so a nested use gets its own.
    /// [`propagate`]'s list of level changes (both ledgers'; it is not reentrant).
    static LEVEL_CHANGES: Cell<Vec<(u32, Level)>> = const { Cell::new(Vec::new()) };
    /// `remove`'s blocks touched.
    static TOUCHED: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    /// [`delete_emptied`]'s stack (both ledgers').
    static DELETIONS: Cell<Vec<(u32, bool)>> = const { Cell::new(Vec::new()) };
}

/// One worker rank's blocks and chains.
#[derive(Debug, Clone)]
pub(crate) struct Ledger<N> {
    /// Slot indices, hashed by the slot's external hash.
    table: SlotTable,
    slots: Vec<Slot>,
    /// Head of the free slots' list, threaded through their `next_sibling` (`NIL`: none).
    free: u32,
    /// Held blocks whose parent is not held.
    dangling: Dangling,
    per_tier: [u64; 4],
    node: PhantomData<N>,
}

impl<N> Default for Ledger<N> {
    fn default() -> Self {
        Self {
            table: SlotTable::default(),
            slots: Vec::new(),
            free: NIL,
            dangling: Dangling::default(),
            per_tier: [0; 4],
            node: PhantomData,
        }
    }
}

impl<N: NodeBits> Ledger<N> {
    /// Blocks held per tier.
    pub(crate) fn per_tier(&self) -> [u64; 4] {
        self.per_tier
    }

    /// Number of held blocks (any tier).
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Approximate heap bytes of this ledger.
    pub(crate) fn heap_bytes(&self) -> u64 {
        (self.table.heap_bytes()
            + self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.dangling.heap_bytes()) as u64
    }

    /// Debug builds: every children list is acyclic and consistent with `parent_slot`, and
    /// every dangling block is listed under its parent's hash.
    #[cfg(debug_assertions)]
    fn check_links(&self) {
        for slot in self.table.iter() {
            let s = &self.slots[slot as usize];
            assert!(
                s.flags & FREED == 0,
                "slot {slot} is in the table but freed"
            );
            let mut children = Children::of(self, slot);
            let mut steps = 0;
            while let Some(child) = children.next(self) {
                assert_eq!(
                    self.slots[child as usize].parent_slot, slot,
                    "child {child} of {slot}"
                );
                steps += 1;
                assert!(steps <= self.slots.len(), "cycle in the children of {slot}");
            }
            if s.parent_slot == NIL && s.flags & HAS_PARENT != 0 {
                assert!(
                    self.dangling.parent_of(slot).is_some(),
                    "dangling slot {slot} has no recorded parent"
                );
            }
        }
        self.dangling.check(|slot| {
            self.slots.get(slot as usize).is_some_and(|s| {
                s.flags & FREED == 0 && s.flags & HAS_PARENT != 0 && s.parent_slot == NIL
            })
        });
    }

    #[inline]
    fn find(&self, external: ExternalBlockHash) -> Option<u32> {
        let slots = &self.slots;
        self.table.find(hash_of(external), |i| {
            slots[i as usize].external == external
        })
    }

    /// The slot next to `near` (either side) if it is live and holds `external`: a run stored
    /// in one mutation sits in consecutive slots, so a removed chain is mostly found without a
    /// table probe.
    #[inline]
    fn adjacent(&self, near: u32, external: ExternalBlockHash) -> Option<u32> {
        if near == NIL {
            return None;
        }
        [near.wrapping_add(1), near.wrapping_sub(1)]
            .into_iter()
            .find(|&c| {
                self.slots
                    .get(c as usize)
                    .is_some_and(|s| s.flags & FREED == 0 && s.external == external)
            })
    }

    fn local_of<M: Membership<Node = N>>(&self, sink: &M, slot: u32) -> LocalBlockHash {
        let s = &self.slots[slot as usize];
        if s.level == UNROOTED {
            LocalBlockHash::new(s.payload)
        } else {
            sink.local(N::from_bits(s.payload))
        }
    }

    fn parent_of(&self, slot: u32) -> Option<ExternalBlockHash> {
        let s = &self.slots[slot as usize];
        if s.flags & HAS_PARENT == 0 {
            None
        } else if s.parent_slot != NIL {
            Some(self.slots[s.parent_slot as usize].external)
        } else {
            self.dangling.parent_of(slot)
        }
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
        let mut previous_slot = held_parent(parent, blocks, report, |p| self.find(p));
        let mut previous = parent;
        sink.expect(blocks.len());
        for block in blocks {
            match self.find(block.external) {
                Some(slot) => {
                    previous_slot = Some(slot);
                    let tiers = self.slots[slot as usize].tiers;
                    if self.local_of(sink, slot) != block.local || self.parent_of(slot) != previous
                    {
                        report.conflicting_stores += 1;
                    } else if tiers.contains(tier) {
                        report.duplicate_stores += 1;
                    } else {
                        self.slots[slot as usize].tiers = tiers.with(tier);
                        self.per_tier[tier.index()] += 1;
                        report.stored += 1;
                        propagate(self, sink, slot);
                    }
                }
                None => {
                    let slot = self.insert(
                        sink,
                        block.external,
                        block.local,
                        previous,
                        TierSet::only(tier),
                        previous_slot,
                    );
                    previous_slot = Some(slot);
                    report.stored += 1;
                }
            }
            previous = Some(block.external);
        }
        #[cfg(debug_assertions)]
        self.check_links();
    }

    /// Restores one block from a snapshot (any order; dangling parents allowed).
    pub(crate) fn restore<M: Membership<Node = N>>(&mut self, sink: &mut M, block: &SnapshotBlock) {
        if block.tiers.is_empty() || self.find(block.external).is_some() {
            return;
        }
        self.insert(
            sink,
            block.external,
            block.local,
            block.parent,
            block.tiers,
            None,
        );
    }

    /// Applies a removal on one tier.
    ///
    /// One `Removed` is applied as a whole (readers never see part of a mutation through
    /// [`crate::baseline::Locked`]), so it runs in three passes: drop the tier from every named block; then
    /// recompute levels (a head-first list unroots the chain once, from its top); then free the
    /// blocks held on no tier, children before parents, so a removed chain never passes through
    /// the dangling table.
    pub(crate) fn remove<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        tier: Tier,
        blocks: &[ExternalBlockHash],
        report: &mut ApplyReport,
    ) {
        if self.table.len() >= WARM_MIN_BLOCKS && blocks.len() * WARM_DIVISOR >= self.table.len() {
            self.table.warm();
        }
        let mut touched = TOUCHED.take();
        touched.clear();
        let mut near = NIL;
        for hash in blocks {
            let Some(slot) = self.adjacent(near, *hash).or_else(|| self.find(*hash)) else {
                report.unknown_removes += 1;
                continue;
            };
            near = slot;
            let tiers = self.slots[slot as usize].tiers;
            if !tiers.contains(tier) {
                report.unknown_removes += 1;
                continue;
            }
            report.removed += 1;
            self.per_tier[tier.index()] -= 1;
            self.slots[slot as usize].tiers = tiers.without(tier);
            touched.push(slot);
        }
        for &slot in &touched {
            propagate(self, sink, slot);
        }
        delete_emptied(self, &touched);
        TOUCHED.set(touched);
        #[cfg(debug_assertions)]
        self.check_links();
    }

    /// Drops every block; returns the number of (block, tier) memberships that ended.
    ///
    /// Memberships are removed children first, keeping the backend's view prefix-closed.
    pub(crate) fn clear<M: Membership<Node = N>>(&mut self, sink: &mut M) -> u64 {
        let mut ended = 0;
        // Pre-order over the rooted forest (rooted blocks without a parent start it), then
        // remove in reverse.
        let mut order = Vec::new();
        for slot in self.table.iter() {
            let s = &self.slots[slot as usize];
            ended += u64::from(s.tiers.bits().count_ones());
            if s.level != UNROOTED && s.flags & HAS_PARENT == 0 {
                order.push(slot);
            }
        }
        let mut next = 0;
        while next < order.len() {
            let mut children = Children::of(self, order[next]);
            next += 1;
            while let Some(child) = children.next(self) {
                if self.slots[child as usize].level != UNROOTED {
                    order.push(child);
                }
            }
        }
        for &slot in order.iter().rev() {
            let s = &self.slots[slot as usize];
            sink.remove(N::from_bits(s.payload), s.level);
        }
        *self = Self::default();
        ended
    }

    /// Every held block, for a snapshot; `local` gives a node's local hash.
    pub(crate) fn snapshot(&self, local: impl Fn(N) -> LocalBlockHash) -> Vec<SnapshotBlock> {
        let mut blocks: Vec<SnapshotBlock> = self
            .table
            .iter()
            .map(|slot| {
                let s = &self.slots[slot as usize];
                let local = if s.level == UNROOTED {
                    LocalBlockHash::new(s.payload)
                } else {
                    local(N::from_bits(s.payload))
                };
                SnapshotBlock {
                    external: s.external,
                    local,
                    parent: self.parent_of(slot),
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
        parent_hint: Option<u32>,
    ) -> u32 {
        let slot = Slot {
            external,
            payload: local.get(),
            parent_slot: NIL,
            last_child: NIL,
            next_sibling: NIL,
            tiers,
            level: UNROOTED,
            flags: if parent.is_some() { HAS_PARENT } else { 0 },
        };
        let index = match self.free {
            NIL => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
            index => {
                self.free = self.slots[index as usize].next_sibling;
                self.slots[index as usize] = slot;
                index
            }
        };
        let slots = &self.slots;
        self.table.insert(hash_of(external), index, |i| {
            hash_of(slots[i as usize].external)
        });
        for tier in tiers.iter() {
            self.per_tier[tier.index()] += 1;
        }
        if let Some(parent) = parent {
            // In a stored run the parent is the block just handled: no lookup needed.
            let parent_slot = match parent_hint {
                Some(hint) if self.slots[hint as usize].external == parent => Some(hint),
                _ => self.find(parent),
            };
            match parent_slot {
                Some(parent_slot) if parent_slot != index => self.link(parent_slot, index),
                _ => {
                    self.dangling.wait(index, parent);
                }
            }
        }
        // Blocks stored earlier whose parent is this block now hang under it.
        if let Some(children) = self.dangling.take_waiting(external) {
            for child in children {
                if child == index {
                    // A block naming itself as parent can never be reached; keep it aside.
                    continue;
                }
                self.dangling.adopted(child);
                self.link(index, child);
            }
        }
        propagate(self, sink, index);
        index
    }

    /// Unlinks and frees a block that is held on no tier (already unrooted by `propagate`).
    fn delete(&mut self, slot: u32) {
        let s = self.slots[slot as usize];
        debug_assert!(s.level == UNROOTED && s.tiers.is_empty());
        // Its children now wait for this hash to be stored again.
        let mut children = Children::of(self, slot);
        while let Some(child) = children.next(self) {
            let c = &mut self.slots[child as usize];
            c.parent_slot = NIL;
            c.next_sibling = NIL;
            self.dangling.wait(child, s.external);
        }
        self.slots[slot as usize].last_child = NIL;
        if s.parent_slot != NIL {
            self.unlink(slot);
        } else if s.flags & HAS_PARENT != 0 {
            self.dangling.forget(slot);
        }
        self.table.remove(hash_of(s.external), slot);
        let freed = &mut self.slots[slot as usize];
        freed.flags |= FREED;
        freed.next_sibling = self.free;
        self.free = slot;
    }

    /// Appends `child` as the newest child of `parent`.
    fn link(&mut self, parent: u32, child: u32) {
        let last = self.slots[parent as usize].last_child;
        let next = if last == NIL {
            child
        } else {
            std::mem::replace(&mut self.slots[last as usize].next_sibling, child)
        };
        let c = &mut self.slots[child as usize];
        c.parent_slot = parent;
        c.next_sibling = next;
        self.slots[parent as usize].last_child = child;
    }

    /// Removes `child` from its parent's circular children list: O(1) for the oldest child (LRU
    /// eviction's order), a walk over the siblings otherwise.
    fn unlink(&mut self, child: u32) {
        let (parent, next) = {
            let c = &self.slots[child as usize];
            (c.parent_slot, c.next_sibling)
        };
        if next == child {
            // The only child.
            self.slots[parent as usize].last_child = NIL;
        } else {
            let last = self.slots[parent as usize].last_child;
            let mut previous = last;
            while self.slots[previous as usize].next_sibling != child {
                previous = self.slots[previous as usize].next_sibling;
            }
            self.slots[previous as usize].next_sibling = next;
            if last == child {
                self.slots[parent as usize].last_child = previous;
            }
        }
        let c = &mut self.slots[child as usize];
        c.parent_slot = NIL;
        c.next_sibling = NIL;
    }
}

impl<N: NodeBits> LevelForest<N> for Ledger<N> {
    fn parent(&self, slot: u32) -> Parent {
        let s = &self.slots[slot as usize];
        if s.flags & HAS_PARENT == 0 {
            Parent::None
        } else if s.parent_slot == NIL {
            Parent::Missing
        } else {
            Parent::Held(s.parent_slot)
        }
    }

    fn level(&self, slot: u32) -> Level {
        self.slots[slot as usize].level
    }

    fn own_level(&self, slot: u32) -> Level {
        self.slots[slot as usize].tiers.best_level()
    }

    fn has_children(&self, slot: u32) -> bool {
        self.slots[slot as usize].last_child != NIL
    }

    fn each_child(&self, slot: u32, mut f: impl FnMut(u32)) {
        let mut children = Children::of(self, slot);
        while let Some(child) = children.next(self) {
            f(child);
        }
    }

    fn take_for_deletion(&mut self, slot: u32) -> bool {
        let s = &mut self.slots[slot as usize];
        let take = s.tiers.is_empty() && s.flags & (FREED | VISITING) == 0;
        if take {
            s.flags |= VISITING;
        }
        take
    }

    fn delete(&mut self, slot: u32) {
        Ledger::delete(self, slot);
    }

    /// Moves one block to `level`, adding the new membership before removing the old one so the
    /// backend never sees the node empty (and frees it) in between.
    fn set_level<M: Membership<Node = N>>(&mut self, sink: &mut M, slot: u32, level: Level) {
        let s = self.slots[slot as usize];
        let old_node = (s.level != UNROOTED).then(|| N::from_bits(s.payload));
        let payload = match (old_node, level == UNROOTED) {
            // Stays rooted, at another level: same node.
            (Some(node), false) => {
                sink.add(node, level);
                sink.remove(node, s.level);
                node.to_bits()
            }
            // Leaves the rooted forest: keep its local hash (read before the node may go).
            (Some(node), true) => {
                let local = sink.local(node);
                sink.remove(node, s.level);
                local.get()
            }
            // Joins the rooted forest under its (rooted) parent.
            (None, false) => {
                let parent_node = match s.parent_slot {
                    NIL => None,
                    parent => Some(N::from_bits(self.slots[parent as usize].payload)),
                };
                let node = sink.child(parent_node, LocalBlockHash::new(s.payload));
                sink.add(node, level);
                node.to_bits()
            }
            (None, true) => s.payload,
        };
        let s = &mut self.slots[slot as usize];
        s.level = level;
        s.payload = payload;
    }
}

/// The items waiting for one parent.
pub(crate) type Waiters = smallvec::SmallVec<[u32; 4]>;

/// Items (blocks, or runs of blocks) whose parent is not held, waiting for it: listed under the
/// parent's engine hash, which is also kept per item (no record of the parent is left to name
/// it). A block naming itself as parent stays recorded but leaves the list when it is stored
/// (it can never be reached).
#[derive(Debug, Clone, Default)]
pub(crate) struct Dangling {
    /// Parent hash → the items waiting for it (nearly always one: kept inline, with no
    /// allocation, up to four; the same 24 bytes as a `Vec`).
    waiting: FxHashMap<ExternalBlockHash, Waiters>,
    /// Item → its parent's hash.
    parents: FxHashMap<u32, ExternalBlockHash>,
}

impl Dangling {
    /// Records that `item` waits for the block hashed `parent`.
    pub(crate) fn wait(&mut self, item: u32, parent: ExternalBlockHash) {
        self.waiting.entry(parent).or_default().push(item);
        self.parents.insert(item, parent);
    }

    /// Records that `item` waits for the block hashed `parent` instead of the one it waited
    /// for, if any: [`Dangling::forget`] then [`Dangling::wait`], with one lookup of the item.
    pub(crate) fn rewait(&mut self, item: u32, parent: ExternalBlockHash) {
        if let Some(old) = self.parents.insert(item, parent) {
            self.unlist(item, old);
        }
        self.waiting.entry(parent).or_default().push(item);
    }

    /// Whether no item waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The hash of the parent `item` waits for.
    pub(crate) fn parent_of(&self, item: u32) -> Option<ExternalBlockHash> {
        self.parents.get(&item).copied()
    }

    /// How many parents items wait for.
    pub(crate) fn parents_waited_for(&self) -> usize {
        self.waiting.len()
    }

    /// The parents items wait for (in no particular order).
    pub(crate) fn each_parent_waited_for(&self) -> impl Iterator<Item = ExternalBlockHash> + '_ {
        self.waiting.keys().copied()
    }

    /// Takes the list of the items waiting for `parent` (just stored); each one the caller
    /// links under it must be passed to [`Dangling::adopted`].
    #[inline]
    pub(crate) fn take_waiting(&mut self, parent: ExternalBlockHash) -> Option<Waiters> {
        if self.waiting.is_empty() {
            return None;
        }
        self.waiting.remove(&parent)
    }

    /// `item` (taken by [`Dangling::take_waiting`]) has its parent now.
    pub(crate) fn adopted(&mut self, item: u32) {
        self.parents.remove(&item);
    }

    /// `item` is deleted while waiting.
    pub(crate) fn forget(&mut self, item: u32) {
        if let Some(parent) = self.parents.remove(&item) {
            self.unlist(item, parent);
        }
    }

    /// Takes `item` off the list of the items waiting for `parent` (the list goes when empty,
    /// found by the same lookup: an item waiting alone is the common case).
    fn unlist(&mut self, item: u32, parent: ExternalBlockHash) {
        if let std::collections::hash_map::Entry::Occupied(mut waiting) = self.waiting.entry(parent)
        {
            waiting.get_mut().retain(|w| *w != item);
            if waiting.get().is_empty() {
                waiting.remove();
            }
        }
    }

    /// Debug builds: every waiting item is recorded under the parent it waits for, and every
    /// recorded item satisfies `is_dangling` (a leftover record, say of an item adopted or
    /// deleted, would only leak memory; this is how tests see it).
    #[cfg(debug_assertions)]
    pub(crate) fn check(&self, is_dangling: impl Fn(u32) -> bool) {
        for (parent, items) in &self.waiting {
            assert!(!items.is_empty(), "empty waiting list under {parent:?}");
            for item in items {
                assert_eq!(self.parents.get(item), Some(parent), "waiting item {item}");
            }
        }
        for &item in self.parents.keys() {
            assert!(
                is_dangling(item),
                "item {item} is recorded as dangling but is not"
            );
        }
    }

    /// Approximate heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.waiting
            .values()
            .map(|v| if v.spilled() { v.capacity() * 4 } else { 0 })
            .sum::<usize>()
            + table_bytes(self.waiting.capacity(), 8 + 24)
            + table_bytes(self.parents.capacity(), 16)
    }
}

/// An item's parent, as its level sees it.
pub(crate) enum Parent {
    /// It starts a sequence.
    None,
    /// Its parent is not held (or not reachable): it is unrooted.
    Missing,
    /// The held item holding its parent.
    Held(u32),
}

/// A ledger seen as a forest of items (blocks, or runs of blocks) with levels: what level
/// propagation needs. An item's level is the max of its own tiers' best level and its parent's
/// ([`UNROOTED`] without a held parent).
pub(crate) trait LevelForest<N> {
    /// Where `item`'s parent stands.
    fn parent(&self, item: u32) -> Parent;
    /// The level `item` should have given its tiers and its parent's level.
    fn wanted_level(&self, item: u32) -> Level {
        match self.parent(item) {
            Parent::None => self.own_level(item),
            Parent::Missing => UNROOTED,
            Parent::Held(parent) => self.own_level(item).max(self.level(parent)),
        }
    }
    /// The level it has.
    fn level(&self, item: u32) -> Level;
    /// The best level of its own tiers.
    fn own_level(&self, item: u32) -> Level;
    /// Whether any item has it as parent.
    fn has_children(&self, item: u32) -> bool;
    /// Calls `f` with each item that has it as parent.
    fn each_child(&self, item: u32, f: impl FnMut(u32));
    /// Moves it to `level`, reporting the membership change to `sink`.
    fn set_level<M: Membership<Node = N>>(&mut self, sink: &mut M, item: u32, level: Level);
    /// If it is held on no tier and not yet taken, marks it taken for deletion and says so.
    fn take_for_deletion(&mut self, item: u32) -> bool;
    /// Deletes an item taken for deletion (held on no tier, already unrooted).
    fn delete(&mut self, item: u32);
}

/// The held block a stored run's `parent` names, looked up once (each later block's parent is
/// the block before it); a parent not held is counted in `report`.
pub(crate) fn held_parent(
    parent: Option<ExternalBlockHash>,
    blocks: &[StoredBlock],
    report: &mut ApplyReport,
    find: impl FnOnce(ExternalBlockHash) -> Option<u32>,
) -> Option<u32> {
    let parent = parent.filter(|_| !blocks.is_empty())?;
    let found = find(parent);
    if found.is_none() {
        report.unknown_parents += 1;
    }
    found
}

/// Deletes the items among `touched` held on no tier, and their descendants held on no tier,
/// children before parents (so a removed chain never passes through the dangling table). An item
/// is taken once: parent links may form a cycle.
pub(crate) fn delete_emptied<N, L: LevelForest<N>>(ledger: &mut L, touched: &[u32]) {
    let mut stack = DELETIONS.take();
    stack.clear();
    for &item in touched {
        if ledger.take_for_deletion(item) {
            stack.push((item, false));
        }
        // Depth-first: an item is deleted on its second visit, after its emptied children.
        while let Some((item, children_done)) = stack.pop() {
            if children_done {
                ledger.delete(item);
                continue;
            }
            stack.push((item, true));
            let children = stack.len();
            ledger.each_child(item, |child| stack.push((child, false)));
            let mut kept = children;
            for i in children..stack.len() {
                let child = stack[i].0;
                if ledger.take_for_deletion(child) {
                    stack[kept] = (child, false);
                    kept += 1;
                }
            }
            stack.truncate(kept);
        }
    }
    DELETIONS.set(stack);
}

/// Recomputes `item`'s level and, when it changed, its membership and its descendants'.
///
/// Within one call every change goes the same way (a child's level is the max of its own and
/// its parent's). Improvements are applied parents first and worsenings children first, so the
/// backend's rooted membership stays prefix-closed at *every* call it receives, not just between
/// mutations — backends may store coverage as prefix lengths.
pub(crate) fn propagate<N, L: LevelForest<N>, M: Membership<Node = N>>(
    ledger: &mut L,
    sink: &mut M,
    item: u32,
) {
    let wanted = ledger.wanted_level(item);
    let old = ledger.level(item);
    if wanted == old {
        return;
    }
    if !ledger.has_children(item) {
        // The common case (a leaf): nothing below to cascade to.
        ledger.set_level(sink, item, wanted);
        return;
    }
    // Pre-order list of (item, new level) for the subtree part whose level changes.
    let mut changes = LEVEL_CHANGES.take();
    changes.clear();
    changes.push((item, wanted));
    let mut next = 0;
    while next < changes.len() {
        let (parent, parent_level) = changes[next];
        next += 1;
        ledger.each_child(parent, |child| {
            let level = ledger.own_level(child).max(parent_level);
            if level != ledger.level(child) {
                changes.push((child, level));
            }
        });
    }
    if wanted < old {
        for &(item, level) in &changes {
            ledger.set_level(sink, item, level);
        }
    } else {
        for &(item, level) in changes.iter().rev() {
            ledger.set_level(sink, item, level);
        }
    }
    LEVEL_CHANGES.set(changes);
}

/// A backend's shared structure, as the per-rank ledgers see it: where a rank's rooted
/// memberships go, and how big it is.
pub(crate) trait Structure {
    /// The structure's node handle.
    type Node: NodeBits;
    /// The membership sink of one rank.
    type Sink<'a>: Membership<Node = Self::Node>
    where
        Self: 'a;

    /// The sink recording `worker`'s memberships.
    fn sink(&mut self, worker: Worker) -> Self::Sink<'_>;

    /// The local hash of a node's last block.
    fn local(&self, node: Self::Node) -> LocalBlockHash;

    /// Heap bytes of the structure.
    fn heap_bytes(&self) -> u64;
}

/// Every rank's ledger: the per-rank half of a backend (applying mutations, removing workers,
/// snapshots, block counts), the same for every backend built on a [`Structure`].
#[derive(Debug, Clone)]
pub(crate) struct LedgerSet<N> {
    ledgers: BTreeMap<Worker, Ledger<N>>,
}

impl<N> Default for LedgerSet<N> {
    fn default() -> Self {
        Self {
            ledgers: BTreeMap::new(),
        }
    }
}

impl<N: NodeBits> LedgerSet<N> {
    /// Applies one rank's mutation to its ledger and, through it, to `structure`.
    pub(crate) fn apply<S: Structure<Node = N>>(
        &mut self,
        structure: &mut S,
        mutation: &Mutation,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        let worker = mutation.worker();
        match mutation {
            Mutation::Stored {
                tier,
                parent,
                blocks,
                ..
            } => {
                let ledger = self.ledgers.entry(worker).or_default();
                ledger.store(
                    &mut structure.sink(worker),
                    *tier,
                    *parent,
                    blocks,
                    &mut report,
                );
            }
            Mutation::Removed { tier, blocks, .. } => {
                let ledger = self.ledgers.entry(worker).or_default();
                ledger.remove(&mut structure.sink(worker), *tier, blocks, &mut report);
            }
            Mutation::Cleared { .. } => report.cleared += self.clear_rank(structure, worker),
        }
        if self.ledgers.get(&worker).is_some_and(|l| l.len() == 0) {
            self.ledgers.remove(&worker);
        }
        report
    }

    /// Drops every rank of `worker_id`.
    pub(crate) fn remove_worker<S: Structure<Node = N>>(
        &mut self,
        structure: &mut S,
        worker_id: u64,
    ) -> ApplyReport {
        let ranks: Vec<Worker> = self
            .ledgers
            .keys()
            .filter(|w| w.worker_id == worker_id)
            .copied()
            .collect();
        let mut report = ApplyReport::default();
        for worker in ranks {
            report.cleared += self.clear_rank(structure, worker);
        }
        report
    }

    fn clear_rank<S: Structure<Node = N>>(&mut self, structure: &mut S, worker: Worker) -> u64 {
        match self.ledgers.remove(&worker) {
            Some(mut ledger) => ledger.clear(&mut structure.sink(worker)),
            None => 0,
        }
    }

    /// Every rank's held blocks.
    pub(crate) fn snapshot<S: Structure<Node = N>>(&self, structure: &S) -> Snapshot {
        let workers = self
            .ledgers
            .iter()
            .map(|(worker, ledger)| WorkerSnapshot {
                worker: *worker,
                blocks: ledger.snapshot(|node| structure.local(node)),
            })
            .filter(|w| !w.blocks.is_empty())
            .collect();
        Snapshot { workers }
    }

    /// Restores a snapshot into empty ledgers and `structure`.
    pub(crate) fn restore<S: Structure<Node = N>>(
        &mut self,
        structure: &mut S,
        snapshot: &Snapshot,
    ) {
        for w in &snapshot.workers {
            let ledger = self.ledgers.entry(w.worker).or_default();
            let mut sink = structure.sink(w.worker);
            for block in &w.blocks {
                ledger.restore(&mut sink, block);
            }
        }
        self.ledgers.retain(|_, l| l.len() > 0);
    }

    /// Block counts per rank and the heap of the ledgers plus `structure`.
    pub(crate) fn stats<S: Structure<Node = N>>(&self, structure: &S) -> IndexStats {
        let workers: Vec<WorkerBlocks> = self
            .ledgers
            .iter()
            .map(|(worker, ledger)| WorkerBlocks {
                worker: *worker,
                per_tier: ledger.per_tier(),
            })
            .collect();
        IndexStats {
            memberships: workers.iter().flat_map(|w| w.per_tier).sum(),
            heap_bytes: structure.heap_bytes()
                + self.ledgers.values().map(Ledger::heap_bytes).sum::<u64>(),
            workers,
        }
    }
}
