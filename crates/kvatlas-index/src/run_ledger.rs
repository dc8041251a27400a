//! One worker rank's blocks kept as **runs**: the per-rank ledger of the default backend
//! ([`crate::Atlas`]), with the same contract as [`crate::ledger::Ledger`] (read its module docs:
//! the ledger turns every mutation into prefix-closed changes of rooted membership) and a
//! layout that stores what a stored run has in common once.
//!
//! A block is held in a **slot** of the rank's arena (a slot is a block's record and its
//! index, as in the other ledger). The only per-block data is its engine hash
//! (`hashes[slot]`, 8 bytes) and its entry in a table of slots keyed by engine hash
//! (a 2-byte slot and a 2-byte tag in 64-byte buckets while slots fit in 16 bits,
//! [`crate::tag_table`]). Everything else belongs to a [`Run`]: consecutive
//! slots `start..start + len` where every block but the first has the block before it as its
//! parent, all on the same tiers and therefore at the same level, and — when rooted — at
//! consecutive offsets of one stretch of the backend's path (`node.advance(k)` is block `k`'s
//! node, [`RunNode`]). A run keeps its parent block, its child runs (runs whose parent block is
//! one of its blocks; the next block of the run itself is not listed), its tiers, level and
//! first node.
//!
//! Runs are cut, never copied: a change that hits part of a run (a removal from its middle, a
//! tier added to some of its blocks, a path that leaves an edge) splits it at the boundary, and
//! the tail becomes a child run of the head's last block. No block moves, so the table never
//! changes on a split. Unrooted runs (a dangling or unrooted parent) keep their local hashes in a
//! side table, as the backend has no node for them.
//!
//! Invariants (checked after every mutation in debug builds, [`RunLedger::check`]):
//! - `starts` maps each run's first slot to the run; runs and the free ranges tile the arena
//!   `0..hashes.len()`; the table holds exactly the slots in runs, each under its hash;
//! - a run's `parent`/`parent_run` name a held block and the run holding it, and the run is in
//!   that run's child list; a run with a parent that is not held is listed in `dangling` under
//!   its parent's hash (except a block naming itself as parent, which can never be reached);
//! - `level == max(best_level(tiers), level(parent_run))` (`UNROOTED` for a missing parent), so
//!   a run's blocks all share one level; a rooted run's blocks have the nodes
//!   `node.advance(0..len)`, an unrooted one's local hashes are in `locals`.

use std::cell::Cell;

use kvatlas_hash::LocalBlockHash;
use rustc_hash::FxHashMap;

use crate::ledger::{
    Dangling, LevelForest, Membership, NIL, NodeBits, Parent, delete_emptied, held_parent,
    propagate,
};
use crate::model::{
    ApplyReport, ExternalBlockHash, Level, StoredBlock, Tier, TierSet, UNROOTED, table_bytes,
};
use crate::slot_table::{SlotTable, hash_of};
use crate::snapshot::SnapshotBlock;

/// A node handle along which consecutive blocks of a path can be addressed by offset.
pub(crate) trait RunNode: NodeBits + PartialEq {
    /// The node `blocks` positions further along the same stretch of path.
    fn advance(self, blocks: u32) -> Self;
}

/// A stretch of placed blocks looks up the parents runs wait for (instead of checking each
/// placed block) when it is more than this many times longer than their number.
const ADOPT_LOOKUP_RATIO: usize = 4;

/// `Run::flags`: the run's first block has a parent.
const HAS_PARENT: u8 = 1;
/// `Run::flags`: on `remove`'s deletion stack (parent links can form cycles).
const VISITING: u8 = 2;
/// `Run::flags`: the record is on the free list.
const FREE: u8 = 4;

/// Consecutive slots that share parent links, tiers, level and a stretch of path.
#[derive(Debug, Clone, Copy)]
struct Run<N> {
    start: u32,
    len: u32,
    /// The first block's parent slot when that parent is held, else `NIL`.
    parent: u32,
    /// The run holding `parent`, else `NIL`.
    parent_run: u32,
    /// Child runs, a doubly linked list through `next_sibling` / `prev_sibling`.
    first_child: u32,
    next_sibling: u32,
    prev_sibling: u32,
    /// The first block's node, while rooted.
    node: N,
    tiers: TierSet,
    level: Level,
    flags: u8,
}

/// One run of removed (or tier-gaining) blocks found so far: slots `lo..hi` of run `run`,
/// which spans `start..end`.
#[derive(Debug, Clone, Copy)]
struct Segment {
    run: u32,
    start: u32,
    end: u32,
    lo: u32,
    hi: u32,
}

/// New blocks of a store at consecutive slots, already in the table, waiting to be placed in
/// runs together: `blocks[first..first + len]` at slots `pos..pos + len`, whose parent is
/// `previous` (held) or else `previous_hash` (not held, or none).
#[derive(Debug, Clone, Copy)]
struct Fresh {
    first: usize,
    pos: u32,
    len: u32,
    previous: Option<u32>,
    previous_hash: Option<ExternalBlockHash>,
}

thread_local! {
    // Working buffers of one mutation (see the same in `ledger.rs`).
    /// `place_stretch`'s local hashes of the blocks it places.
    static LOCALS: Cell<Vec<LocalBlockHash>> = const { Cell::new(Vec::new()) };
    /// `remove`'s stretches of named blocks.
    static STRETCHES: Cell<Vec<Segment>> = const { Cell::new(Vec::new()) };
    /// `remove`'s runs touched.
    static TOUCHED: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    /// `place_stretch`'s placed blocks that runs wait for: (slot, engine hash).
    static ADOPTING: Cell<Vec<(u32, ExternalBlockHash)>> = const { Cell::new(Vec::new()) };
}

/// Per-block recency for capacity-bounded backends (as in the per-block ledger).
#[derive(Debug, Clone, Default)]
struct Recency {
    /// Last store time of each slot (parallel to `hashes`).
    stamps: Vec<u64>,
    clock: u64,
    /// `(stamp, slot, external)` of blocks that are now leaves.
    candidates: Vec<(u64, u32, ExternalBlockHash)>,
}

/// One worker rank's blocks and chains, as runs (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct RunLedger<N> {
    /// Slots, hashed by their engine hash.
    table: SlotTable,
    /// Engine hash per slot (free slots hold stale values; the table never names them).
    hashes: Vec<ExternalBlockHash>,
    runs: Vec<Run<N>>,
    free_runs: Vec<u32>,
    /// Bit `p` is set iff a run or a hole starts at slot `p`: the run holding a slot is
    /// the one starting at the nearest set bit at or before it.
    bounds: Vec<u64>,
    /// First slot → run.
    starts: FxHashMap<u32, u32>,
    /// Bit `p` is set iff a hole (a free arena range, coalesced, never touching the arena's
    /// end) starts at slot `p`; the hole's length is kept in `hashes[p]` (a free slot's hash is
    /// not read otherwise). A bit and two array reads instead of a hash map: holes are made and
    /// taken about once per deleted run and per store.
    hole_bits: Vec<u64>,
    /// Holes in the arena (set bits of `hole_bits`).
    hole_count: usize,
    /// Hole starts by size class (`floor(log2(length))`), for allocation; entries go stale when
    /// a hole is taken or merged and are dropped when met (or all rebuilt when they pile up).
    classes: Vec<Vec<u32>>,
    /// Entries in `classes`.
    class_entries: usize,
    /// Slots in holes.
    free_blocks: u64,
    /// Local hashes of the blocks of unrooted runs.
    locals: FxHashMap<u32, Vec<LocalBlockHash>>,
    /// Runs whose parent is not held.
    dangling: Dangling,
    per_tier: [u64; 4],
    recency: Option<Recency>,
}

impl<N> Default for RunLedger<N> {
    fn default() -> Self {
        Self {
            table: SlotTable::default(),
            hashes: Vec::new(),
            runs: Vec::new(),
            free_runs: Vec::new(),
            bounds: Vec::new(),
            starts: FxHashMap::default(),
            hole_bits: Vec::new(),
            hole_count: 0,
            classes: Vec::new(),
            class_entries: 0,
            free_blocks: 0,
            locals: FxHashMap::default(),
            dangling: Dangling::default(),
            per_tier: [0; 4],
            recency: None,
        }
    }
}

/// Makes room for `len` elements without doubling: a rank's arrays grow in steps over its
/// life, and doubling would leave up to half of them unused. A large step (an eighth of the
/// capacity or more, like a long stored run) gets exactly the room it needs; smaller steps grow
/// the capacity by a quarter, so growth stays amortized.
fn reserve_gently<T>(vec: &mut Vec<T>, len: usize) {
    let capacity = vec.capacity();
    if len > capacity {
        let step = len - capacity;
        let target = if step >= capacity / 8 {
            len
        } else {
            len.max(capacity + capacity / 4)
        };
        vec.reserve_exact(target.max(8) - vec.len());
    }
}

/// Sets bit `pos` of a bitmap, growing it as needed.
fn set_bit(words: &mut Vec<u64>, pos: u32) {
    let word = pos as usize / 64;
    if word >= words.len() {
        words.resize(word + 1, 0);
    }
    words[word] |= 1 << (pos % 64);
}

/// Clears bit `pos` of a bitmap (nothing if it lies beyond it).
fn clear_bit(words: &mut [u64], pos: u32) {
    if let Some(word) = words.get_mut(pos as usize / 64) {
        *word &= !(1 << (pos % 64));
    }
}

/// The length of the hole starting at `start` ([`RunLedger`]'s `hole_bits`), if one does.
#[inline]
fn hole_len_in(hole_bits: &[u64], hashes: &[ExternalBlockHash], start: u32) -> Option<u32> {
    let word = *hole_bits.get(start as usize / 64)?;
    // A hole's length fits its `u32` slot range.
    (word & (1 << (start % 64)) != 0).then(|| hashes[start as usize].get() as u32)
}

/// The size class of a hole of `len` blocks.
fn class_of(len: u32) -> usize {
    (31 - len.max(1).leading_zeros()) as usize
}

impl<N: RunNode> RunLedger<N> {
    /// Blocks held per tier.
    pub(crate) fn per_tier(&self) -> [u64; 4] {
        self.per_tier
    }

    /// Number of held blocks (any tier).
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Number of runs (for tests).
    #[cfg(test)]
    pub(crate) fn run_count(&self) -> usize {
        self.starts.len()
    }

    /// Run records made so far, free ones included (for tests).
    #[cfg(test)]
    pub(crate) fn run_records(&self) -> usize {
        self.runs.len()
    }

    /// Arena slots in use or in holes (for tests).
    #[cfg(test)]
    pub(crate) fn arena_len(&self) -> usize {
        self.hashes.len()
    }

    /// Holes in the arena and entries in their size-class lists, stale ones included (for tests).
    #[cfg(test)]
    pub(crate) fn hole_entries(&self) -> (usize, usize) {
        (self.hole_count, self.class_entries)
    }

    // ---- recency (capacity bound) -------------------------------------------------------------

    /// Starts recording recency (for a capacity bound); `clock` continues the backend's clock.
    pub(crate) fn track_recency(&mut self, clock: u64) {
        if self.recency.is_none() {
            let mut recency = Recency {
                clock,
                ..Recency::default()
            };
            recency.stamps.resize(self.hashes.len(), 0);
            self.recency = Some(recency);
        }
    }

    /// The recency clock (to carry over to other ledgers).
    pub(crate) fn clock(&self) -> u64 {
        self.recency.as_ref().map_or(0, |r| r.clock)
    }

    /// Sets the recency clock (the backend keeps one clock across ledgers).
    pub(crate) fn set_clock(&mut self, clock: u64) {
        if let Some(recency) = &mut self.recency {
            recency.clock = clock;
        }
    }

    /// Takes the eviction candidates recorded since the last call.
    pub(crate) fn take_candidates(&mut self, into: &mut Vec<(u64, u32, ExternalBlockHash)>) {
        if let Some(recency) = &mut self.recency {
            into.append(&mut recency.candidates);
        }
    }

    /// Every current leaf as a candidate (to rebuild the backend's heap).
    pub(crate) fn all_leaves(&self, into: &mut Vec<(u64, u32, ExternalBlockHash)>) {
        let Some(recency) = &self.recency else { return };
        for &r in self.starts.values() {
            let last = self.end(r) - 1;
            if self.is_leaf(last) {
                into.push((
                    recency.stamps[last as usize],
                    last,
                    self.hashes[last as usize],
                ));
            }
        }
    }

    /// Every held block as a candidate, leaves or not (the fallback when no leaf is left).
    pub(crate) fn all_blocks(&self, into: &mut Vec<(u64, u32, ExternalBlockHash)>) {
        let Some(recency) = &self.recency else { return };
        for &r in self.starts.values() {
            for pos in self.runs[r as usize].start..self.end(r) {
                into.push((recency.stamps[pos as usize], pos, self.hashes[pos as usize]));
            }
        }
    }

    /// Whether `(slot, external, stamp)` still names a held block last stored at `stamp` (and,
    /// with `leaf`, one without held children).
    pub(crate) fn is_current(
        &self,
        slot: u32,
        external: ExternalBlockHash,
        stamp: u64,
        leaf: bool,
    ) -> bool {
        let Some(recency) = &self.recency else {
            return false;
        };
        self.hashes.get(slot as usize) == Some(&external)
            && self.find(external) == Some(slot)
            && recency.stamps.get(slot as usize) == Some(&stamp)
            && (!leaf || self.is_leaf(slot))
    }

    /// Evicts a held block from every tier (as if the engine had removed it); returns its tiers.
    pub(crate) fn evict<M: Membership<Node = N>>(&mut self, sink: &mut M, slot: u32) -> TierSet {
        let external = self.hashes[slot as usize];
        let tiers = self.runs[self.run_of(slot) as usize].tiers;
        let mut report = ApplyReport::default();
        for tier in tiers.iter() {
            self.remove(sink, tier, &[external], &mut report);
        }
        tiers
    }

    /// Records that `pos` was stored now, and is a candidate if it is a leaf.
    #[inline]
    fn touch(&mut self, pos: u32) {
        if self.recency.is_none() {
            return;
        }
        let leaf = self.is_leaf(pos);
        let external = self.hashes[pos as usize];
        let Some(recency) = &mut self.recency else {
            return;
        };
        recency.clock += 1;
        recency.stamps[pos as usize] = recency.clock;
        if leaf {
            recency.candidates.push((recency.clock, pos, external));
        }
    }

    /// Records that `pos` may just have become a leaf (a child run left).
    fn became_leaf(&mut self, pos: u32) {
        if self.recency.is_none() || !self.is_leaf(pos) {
            return;
        }
        let external = self.hashes[pos as usize];
        if let Some(recency) = &mut self.recency {
            recency
                .candidates
                .push((recency.stamps[pos as usize], pos, external));
        }
    }

    /// Whether the held block at `pos` has no held child.
    fn is_leaf(&self, pos: u32) -> bool {
        let r = self.run_of(pos);
        if r == NIL || pos + 1 != self.end(r) {
            return false;
        }
        let mut child = self.runs[r as usize].first_child;
        while child != NIL {
            let c = &self.runs[child as usize];
            if c.parent == pos {
                return false;
            }
            child = c.next_sibling;
        }
        true
    }

    // ---- sizes --------------------------------------------------------------------------------

    /// Approximate heap bytes of this ledger.
    pub(crate) fn heap_bytes(&self) -> u64 {
        let locals: usize = self
            .locals
            .values()
            .map(|v| v.capacity() * 8)
            .sum::<usize>()
            + table_bytes(self.locals.capacity(), 4 + 24);
        let recency = self.recency.as_ref().map_or(0, |r| {
            r.stamps.capacity() * 8 + r.candidates.capacity() * 16
        });
        (self.table.heap_bytes()
            + self.hashes.capacity() * 8
            + self.runs.capacity() * std::mem::size_of::<Run<N>>()
            + self.free_runs.capacity() * 4
            + self.bounds.capacity() * 8
            + table_bytes(self.starts.capacity(), 8)
            + self.hole_bits.capacity() * 8
            + self.classes.iter().map(|c| c.capacity() * 4).sum::<usize>()
            + locals
            + self.dangling.heap_bytes()
            + recency) as u64
    }

    // ---- lookups ------------------------------------------------------------------------------

    #[inline]
    fn find(&self, external: ExternalBlockHash) -> Option<u32> {
        let hashes = &self.hashes;
        self.table
            .find(hash_of(external), |i| hashes[i as usize] == external)
    }

    /// The run holding the held slot `pos` (`NIL` if `pos` is not held).
    #[inline]
    fn run_of(&self, pos: u32) -> u32 {
        self.bound_at_or_before(pos)
            .and_then(|start| self.starts.get(&start).copied())
            .unwrap_or(NIL)
    }

    /// The nearest run or hole start at or before `pos`.
    #[inline]
    fn bound_at_or_before(&self, pos: u32) -> Option<u32> {
        let mut word = pos as usize / 64;
        let mut bits = match self.bounds.get(word) {
            Some(&bits) => bits & (u64::MAX >> (63 - pos % 64)),
            None => {
                word = self.bounds.len().checked_sub(1)?;
                self.bounds[word]
            }
        };
        loop {
            if bits != 0 {
                return Some((word * 64) as u32 + 63 - bits.leading_zeros());
            }
            if word == 0 {
                return None;
            }
            word -= 1;
            bits = self.bounds[word];
        }
    }

    fn set_bound(&mut self, pos: u32) {
        set_bit(&mut self.bounds, pos);
    }

    fn clear_bound(&mut self, pos: u32) {
        clear_bit(&mut self.bounds, pos);
    }

    #[inline]
    fn end(&self, r: u32) -> u32 {
        let run = &self.runs[r as usize];
        run.start + run.len
    }

    #[inline]
    fn node_at(&self, r: u32, pos: u32) -> N {
        let run = &self.runs[r as usize];
        run.node.advance(pos - run.start)
    }

    /// The local hash of `pos` in run `r`; `local` gives a node's.
    fn local_with(&self, r: u32, pos: u32, local: impl Fn(N) -> LocalBlockHash) -> LocalBlockHash {
        let run = &self.runs[r as usize];
        if run.level == UNROOTED {
            self.locals[&r][(pos - run.start) as usize]
        } else {
            local(run.node.advance(pos - run.start))
        }
    }

    /// The engine hash of the parent of `pos` in run `r`.
    fn parent_hash(&self, r: u32, pos: u32) -> Option<ExternalBlockHash> {
        let run = &self.runs[r as usize];
        if pos > run.start {
            Some(self.hashes[pos as usize - 1])
        } else if run.flags & HAS_PARENT == 0 {
            None
        } else if run.parent != NIL {
            Some(self.hashes[run.parent as usize])
        } else {
            self.dangling.parent_of(r)
        }
    }

    // ---- runs ---------------------------------------------------------------------------------

    fn new_run(&mut self, run: Run<N>) -> u32 {
        let start = run.start;
        let id = match self.free_runs.pop() {
            Some(id) => {
                self.runs[id as usize] = run;
                id
            }
            None => {
                let len = self.runs.len() + 1;
                reserve_gently(&mut self.runs, len);
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        };
        self.starts.insert(start, id);
        self.set_bound(start);
        id
    }

    /// A run record of `len` blocks from `start`, with no links yet.
    fn bare(start: u32, len: u32, node: N, tiers: TierSet, level: Level, flags: u8) -> Run<N> {
        Run {
            start,
            len,
            parent: NIL,
            parent_run: NIL,
            first_child: NIL,
            next_sibling: NIL,
            prev_sibling: NIL,
            node,
            tiers,
            level,
            flags,
        }
    }

    /// Makes `child` a child run of `parent_run`, hanging at the block `parent`.
    fn link_child(&mut self, parent_run: u32, parent: u32, child: u32) {
        let first = self.runs[parent_run as usize].first_child;
        if first != NIL {
            self.runs[first as usize].prev_sibling = child;
        }
        let c = &mut self.runs[child as usize];
        c.parent = parent;
        c.parent_run = parent_run;
        c.next_sibling = first;
        c.prev_sibling = NIL;
        self.runs[parent_run as usize].first_child = child;
    }

    /// Takes `child` out of its parent run's child list.
    fn unlink_child(&mut self, child: u32) {
        let Run {
            parent_run,
            prev_sibling,
            next_sibling,
            ..
        } = self.runs[child as usize];
        if prev_sibling == NIL {
            self.runs[parent_run as usize].first_child = next_sibling;
        } else {
            self.runs[prev_sibling as usize].next_sibling = next_sibling;
        }
        if next_sibling != NIL {
            self.runs[next_sibling as usize].prev_sibling = prev_sibling;
        }
        let c = &mut self.runs[child as usize];
        c.parent = NIL;
        c.parent_run = NIL;
        c.next_sibling = NIL;
        c.prev_sibling = NIL;
    }

    /// Cuts run `r` before slot `at` (inside it, not its first): the blocks from `at` on
    /// become a new run, a child of `r`'s new last block, taking the child runs that hang on
    /// them. Returns the new run.
    fn split(&mut self, r: u32, at: u32) -> u32 {
        let run = self.runs[r as usize];
        debug_assert!(run.start < at && at < run.start + run.len);
        let head = at - run.start;
        let node = if run.level == UNROOTED {
            run.node
        } else {
            run.node.advance(head)
        };
        let tail = self.new_run(Self::bare(
            at,
            run.len - head,
            node,
            run.tiers,
            run.level,
            HAS_PARENT,
        ));
        self.runs[r as usize].len = head;
        if run.level == UNROOTED
            && let Some(locals) = self.locals.get_mut(&r)
        {
            let rest = locals.split_off(head as usize);
            locals.shrink_to_fit();
            self.locals.insert(tail, rest);
        }
        let mut child = run.first_child;
        while child != NIL {
            let next = self.runs[child as usize].next_sibling;
            let parent = self.runs[child as usize].parent;
            if parent >= at {
                self.unlink_child(child);
                self.link_child(tail, parent, child);
            }
            child = next;
        }
        self.link_child(r, at - 1, tail);
        tail
    }

    /// Splits run `r` so that `lo..hi` (inside it) is a run of its own; returns that run.
    fn isolate(&mut self, mut r: u32, lo: u32, hi: u32) -> u32 {
        if lo > self.runs[r as usize].start {
            r = self.split(r, lo);
        }
        if hi < self.end(r) {
            self.split(r, hi);
        }
        r
    }

    // ---- the arena ----------------------------------------------------------------------------

    /// Free slots for a piece of at most `want` new blocks: a hole that holds them all
    /// (the smallest size class that surely does, or a fitting hole of `want`'s own class); else,
    /// when holes make up half the arena, the largest hole; else new slots at the arena's
    /// end. Returns `(start, len)`, `1 <= len <= want`.
    fn alloc(&mut self, want: u32) -> (u32, u32) {
        let want = want.max(1);
        if self.hole_count > 0 {
            let many = self.free_blocks * 2 > self.hashes.len() as u64;
            if let Some((start, len)) = self.fitting_hole(want, many) {
                self.take_free(start, len);
                self.clear_bound(start);
                let take = len.min(want);
                if len > take {
                    self.set_bound(start + take);
                    self.put_free(start + take, len - take);
                }
                return (start, take);
            }
        }
        let start = self.hashes.len();
        let end = start + want as usize;
        assert!(
            u32::try_from(end).is_ok_and(|end| end < NIL),
            "a worker rank holds at most 2^32 - 1 blocks"
        );
        reserve_gently(&mut self.hashes, end);
        self.hashes.resize(end, ExternalBlockHash::new(0));
        if let Some(recency) = &mut self.recency {
            recency.stamps.resize(end, 0);
        }
        (start as u32, want)
    }

    /// A hole for `want` blocks (see [`RunLedger::alloc`]); with `any`, the largest class's
    /// hole when none fits.
    fn fitting_hole(&mut self, want: u32, any: bool) -> Option<(u32, u32)> {
        let own = class_of(want);
        // Holes of `want`'s own class may be shorter: look at a few.
        if let Some(entries) = self.classes.get_mut(own) {
            let mut i = entries.len();
            let mut looked = 0;
            while i > 0 && looked < 2 {
                i -= 1;
                let start = entries[i];
                match hole_len_in(&self.hole_bits, &self.hashes, start) {
                    Some(len) if class_of(len) == own => {
                        looked += 1;
                        if len >= want {
                            return Some((start, len));
                        }
                    }
                    _ => {
                        entries.swap_remove(i);
                        self.class_entries -= 1;
                    }
                }
            }
        }
        for class in own + 1..self.classes.len() {
            if let Some(hole) = self.last_hole(class) {
                return Some(hole);
            }
        }
        if any && !self.classes.is_empty() {
            for class in (0..=own.min(self.classes.len().saturating_sub(1))).rev() {
                if let Some(hole) = self.last_hole(class) {
                    return Some(hole);
                }
            }
        }
        None
    }

    /// The newest hole of a size class, dropping stale entries on the way.
    fn last_hole(&mut self, class: usize) -> Option<(u32, u32)> {
        while let Some(&start) = self.classes[class].last() {
            match self.hole_len(start) {
                Some(len) if class_of(len) == class => return Some((start, len)),
                _ => {
                    self.classes[class].pop();
                    self.class_entries -= 1;
                }
            }
        }
        None
    }

    /// The length of the hole starting at `start`, if one does.
    #[inline]
    fn hole_len(&self, start: u32) -> Option<u32> {
        hole_len_in(&self.hole_bits, &self.hashes, start)
    }

    fn take_free(&mut self, start: u32, len: u32) {
        debug_assert_eq!(self.hole_len(start), Some(len));
        clear_bit(&mut self.hole_bits, start);
        self.hole_count -= 1;
        self.free_blocks -= u64::from(len);
    }

    fn put_free(&mut self, start: u32, len: u32) {
        debug_assert!(len > 0 && ((start + len) as usize) < self.hashes.len());
        set_bit(&mut self.hole_bits, start);
        self.hashes[start as usize] = ExternalBlockHash::new(u64::from(len));
        self.hole_count += 1;
        self.free_blocks += u64::from(len);
        let class = class_of(len);
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        self.classes[class].push(start);
        self.class_entries += 1;
        if self.class_entries > 2 * self.hole_count + 64 {
            // Stale entries dominate: keep each hole's entry once. (Every hole has an entry in
            // its class: one is pushed whenever a hole is made, and only stale ones are dropped.)
            let (bits, hashes) = (&self.hole_bits, &self.hashes);
            let mut entries = 0;
            for (class, starts) in self.classes.iter_mut().enumerate() {
                starts.retain(|&s| {
                    hole_len_in(bits, hashes, s).is_some_and(|len| class_of(len) == class)
                });
                starts.sort_unstable();
                starts.dedup();
                entries += starts.len();
            }
            debug_assert_eq!(entries, self.hole_count);
            self.class_entries = entries;
        }
    }

    /// Gives slots back (no run starts inside them), merging with neighbouring holes; a
    /// hole at the arena's end shortens the arena instead.
    fn free_range(&mut self, mut start: u32, mut len: u32) {
        if len == 0 {
            return;
        }
        if start > 0
            && let Some(left) = self.bound_at_or_before(start - 1)
            && let Some(left_len) = self.hole_len(left)
            && left + left_len == start
        {
            self.take_free(left, left_len);
            self.clear_bound(start);
            start = left;
            len += left_len;
        }
        if let Some(right_len) = self.hole_len(start + len) {
            self.take_free(start + len, right_len);
            self.clear_bound(start + len);
            len += right_len;
        }
        if (start + len) as usize == self.hashes.len() {
            self.clear_bound(start);
            self.hashes.truncate(start as usize);
            self.bounds.truncate((start as usize).div_ceil(64));
            // (No hole starts at or after `start`: holes never touch the arena's end.)
            self.hole_bits.truncate((start as usize).div_ceil(64));
            if let Some(recency) = &mut self.recency {
                recency.stamps.truncate(start as usize);
            }
        } else {
            self.set_bound(start);
            self.put_free(start, len);
        }
    }
}

// ---- levels ---------------------------------------------------------------------------------

impl<N: RunNode> LevelForest<N> for RunLedger<N> {
    fn parent(&self, r: u32) -> Parent {
        let run = &self.runs[r as usize];
        if run.flags & HAS_PARENT == 0 {
            Parent::None
        } else if run.parent_run == NIL {
            Parent::Missing
        } else {
            Parent::Held(run.parent_run)
        }
    }

    fn level(&self, r: u32) -> Level {
        self.runs[r as usize].level
    }

    fn own_level(&self, r: u32) -> Level {
        self.runs[r as usize].tiers.best_level()
    }

    fn has_children(&self, r: u32) -> bool {
        self.runs[r as usize].first_child != NIL
    }

    fn each_child(&self, r: u32, mut f: impl FnMut(u32)) {
        let mut child = self.runs[r as usize].first_child;
        while child != NIL {
            f(child);
            child = self.runs[child as usize].next_sibling;
        }
    }

    /// Moves run `r` to `level`: new memberships before old ones are dropped (so the backend
    /// never sees a node empty in between), additions in path order and removals in reverse.
    fn set_level<M: Membership<Node = N>>(&mut self, sink: &mut M, r: u32, level: Level) {
        let run = self.runs[r as usize];
        let old = run.level;
        match (old == UNROOTED, level == UNROOTED) {
            (false, false) => {
                sink.add_along(run.node, run.len, level);
                sink.remove_along(run.node, run.len, old);
                self.runs[r as usize].level = level;
            }
            (false, true) => {
                // Leaves the rooted forest. A run held on no tier is about to be deleted and
                // needs no local hashes.
                if !run.tiers.is_empty() {
                    let mut locals = Vec::with_capacity(run.len as usize);
                    sink.locals_along(run.node, run.len, &mut locals);
                    self.locals.insert(r, locals);
                }
                sink.remove_along(run.node, run.len, old);
                self.runs[r as usize].level = UNROOTED;
            }
            (true, false) => self.root(sink, r, level),
            (true, true) => {}
        }
    }

    fn take_for_deletion(&mut self, r: u32) -> bool {
        let run = &mut self.runs[r as usize];
        let take = run.tiers.is_empty() && run.flags & (FREE | VISITING) == 0;
        if take {
            run.flags |= VISITING;
        }
        take
    }

    fn delete(&mut self, r: u32) {
        self.delete_run(r);
    }
}

impl<N: RunNode> RunLedger<N> {
    /// Roots the unrooted run `r` (its parent, if any, is rooted) at `level`: asks the backend
    /// for the path of its blocks a stretch at a time ([`Membership::extend_path`]), cutting
    /// the run where the path leaves a stretch. Re-rooting a run the forest has kept (or can
    /// append in one piece) costs per stretch, not per block: before, each block was asked for
    /// on its own, and an edge rebuilt block by block grew its storage one block at a time
    /// (peer Workload B store 168 µs, most of it reallocation).
    fn root<M: Membership<Node = N>>(&mut self, sink: &mut M, r: u32, level: Level) {
        let locals = self.locals.remove(&r).unwrap_or_default();
        let run = self.runs[r as usize];
        debug_assert_eq!(locals.len(), run.len as usize);
        let Some(&first_local) = locals.first() else {
            self.runs[r as usize].level = level;
            return;
        };
        let parent =
            (run.flags & HAS_PARENT != 0).then(|| self.node_at(run.parent_run, run.parent));
        self.runs[r as usize].level = level;
        sink.expect(locals.len());
        let first = sink.child(parent, first_local);
        sink.add(first, level);
        self.runs[r as usize].node = first;
        let mut piece = r;
        let mut last = first;
        let mut k = 1usize;
        while k < locals.len() {
            let (node, added) = sink.extend_path(last, &locals[k..], level);
            if node != last.advance(1) {
                piece = self.split(piece, run.start + k as u32);
                self.runs[piece as usize].node = node;
            }
            last = node.advance(added as u32 - 1);
            k += added;
        }
    }

    // ---- mutations ----------------------------------------------------------------------------

    /// Applies a stored run.
    pub(crate) fn store<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        tier: Tier,
        parent: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
        report: &mut ApplyReport,
    ) {
        let mut previous = held_parent(parent, blocks, report, |p| self.find(p));
        let mut previous_hash = parent;
        sink.expect(blocks.len());
        // The run being built from this store's new blocks (its last block is `previous`).
        let mut open = NIL;
        // Free slots reserved for new blocks.
        let mut range = (0u32, 0u32);
        // Held blocks (consecutive in one run) that gain `tier`.
        let mut gaining: Option<Segment> = None;
        // New blocks at consecutive slots, in the table but not yet placed in runs.
        // (Placed before anything else happens: when a held block or a new range comes, and at
        // the end. Placing them right after the loop instead measured ≈ 1 µs slower per 1024-block
        // store, from code generation alone.)
        let mut fresh: Option<Fresh> = None;
        let mut i = 0;
        while i < blocks.len() {
            if range.1 == 0 {
                self.place_fresh(sink, blocks, tier, fresh.take(), &mut open, report);
                range = self.alloc((blocks.len() - i) as u32);
            }
            // New blocks, one after another, until a held one or the end of the free range:
            // each block's slot is written before the table is probed, so one probe finds
            // a held block or adds this one. (Kept tight: this is a long store's whole work.)
            let first = i;
            let limit = blocks.len().min(i + range.1 as usize);
            let mut held = None;
            {
                let hashes = &mut self.hashes;
                let table = &mut self.table;
                while i < limit {
                    let external = blocks[i].external;
                    let pos = range.0 + (i - first) as u32;
                    hashes[pos as usize] = external;
                    let hashes = &*hashes;
                    held = table.find_or_insert(
                        hash_of(external),
                        pos,
                        limit - i,
                        |h| hashes[h as usize] == external,
                        |h| hash_of(hashes[h as usize]),
                    );
                    if held.is_some() {
                        break;
                    }
                    i += 1;
                }
            }
            if i > first {
                let len = (i - first) as u32;
                self.gain(sink, tier, gaining.take());
                // (Fresh blocks are placed whenever a held block or a new range comes, so none
                // are waiting here.)
                debug_assert!(fresh.is_none());
                fresh = Some(Fresh {
                    first,
                    pos: range.0,
                    len,
                    previous,
                    previous_hash,
                });
                previous = Some(range.0 + len - 1);
                previous_hash = Some(blocks[i - 1].external);
                range.0 += len;
                range.1 -= len;
            }
            let Some(pos) = held else { continue };
            let block = &blocks[i];
            i += 1;
            // (It may be one of the fresh blocks, named twice: place them first.)
            self.place_fresh(sink, blocks, tier, fresh.take(), &mut open, report);
            open = NIL;
            let r = match gaining {
                Some(s) if (s.start..s.end).contains(&pos) => s.run,
                _ => self.run_of(pos),
            };
            let mut tiers = self.runs[r as usize].tiers;
            if gaining.is_some_and(|s| (s.lo..s.hi).contains(&pos)) {
                // Named earlier in this store: it already gains the tier.
                tiers = tiers.with(tier);
            }
            if self.local_with(r, pos, |node| sink.local(node)) != block.local
                || self.parent_hash(r, pos) != previous_hash
            {
                self.gain(sink, tier, gaining.take());
                report.conflicting_stores += 1;
            } else if tiers.contains(tier) {
                self.gain(sink, tier, gaining.take());
                report.duplicate_stores += 1;
                self.touch(pos);
            } else {
                match &mut gaining {
                    Some(s) if s.run == r && s.hi == pos => s.hi += 1,
                    _ => {
                        self.gain(sink, tier, gaining.take());
                        let run = &self.runs[r as usize];
                        gaining = Some(Segment {
                            run: r,
                            start: run.start,
                            end: run.start + run.len,
                            lo: pos,
                            hi: pos + 1,
                        });
                    }
                }
                self.per_tier[tier.index()] += 1;
                report.stored += 1;
                self.touch(pos);
            }
            previous = Some(pos);
            previous_hash = Some(block.external);
        }
        self.place_fresh(sink, blocks, tier, fresh.take(), &mut open, report);
        self.gain(sink, tier, gaining.take());
        self.free_range(range.0, range.1);
        #[cfg(debug_assertions)]
        self.check();
    }

    /// Adds `tier` to the held blocks of `segment`.
    fn gain<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        tier: Tier,
        segment: Option<Segment>,
    ) {
        let Some(s) = segment else { return };
        let m = self.isolate(s.run, s.lo, s.hi);
        self.runs[m as usize].tiers = self.runs[m as usize].tiers.with(tier);
        propagate(self, sink, m);
    }

    /// Places a store's fresh blocks (see [`Fresh`]) on `tier` and records them as stored now.
    fn place_fresh<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        blocks: &[StoredBlock],
        tier: Tier,
        fresh: Option<Fresh>,
        open: &mut u32,
        report: &mut ApplyReport,
    ) {
        let Some(f) = fresh else { return };
        let stretch = &blocks[f.first..f.first + f.len as usize];
        self.place_stretch(
            sink,
            stretch,
            TierSet::only(tier),
            f.previous,
            f.previous_hash,
            open,
            f.pos,
        );
        report.stored += u64::from(f.len);
        if self.recency.is_some() {
            for pos in f.pos..f.pos + f.len {
                self.touch(pos);
            }
        }
    }

    /// Places new blocks, already at slots `pos..` in the arena and the table, each the
    /// parent of the next; the first one's parent is `previous` (held) or, when that is `None`,
    /// `previous_hash` (not held, or no parent). They extend `open` while they continue it (on
    /// a rooted run: while the backend's path stays on one stretch, [`Membership::extend_path`]),
    /// else start a run. Then runs waiting for one of them as their parent hang under it.
    #[allow(clippy::too_many_arguments)]
    fn place_stretch<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        blocks: &[StoredBlock],
        tiers: TierSet,
        previous: Option<u32>,
        previous_hash: Option<ExternalBlockHash>,
        open: &mut u32,
        pos: u32,
    ) {
        let n = blocks.len() as u32;
        for tier in tiers.iter() {
            self.per_tier[tier.index()] += u64::from(n);
        }
        let mut locals = LOCALS.take();
        locals.clear();
        locals.extend(blocks.iter().map(|b| b.local));
        let mut placed = 0;
        while placed < n {
            let at = pos + placed;
            let o = *open;
            if o != NIL && self.end(o) == at && self.runs[o as usize].tiers == tiers {
                let run = self.runs[o as usize];
                if run.level == UNROOTED {
                    if let Some(unrooted) = self.locals.get_mut(&o) {
                        unrooted.extend_from_slice(&locals[placed as usize..]);
                    }
                    self.runs[o as usize].len += n - placed;
                    placed = n;
                } else {
                    let last = run.node.advance(run.len - 1);
                    let (first, added) =
                        sink.extend_path(last, &locals[placed as usize..], run.level);
                    let added = added.max(1) as u32;
                    if first == last.advance(1) {
                        self.runs[o as usize].len += added;
                    } else {
                        let r = self
                            .new_run(Self::bare(at, added, first, tiers, run.level, HAS_PARENT));
                        self.link_child(o, at - 1, r);
                        *open = r;
                    }
                    placed += added;
                }
            } else {
                *open = self.start_run(
                    sink,
                    at,
                    locals[placed as usize],
                    tiers,
                    previous,
                    previous_hash,
                );
                placed += 1;
            }
        }
        LOCALS.set(locals);
        if self.dangling.is_empty() {
            return;
        }
        // The placed blocks some run waits for, in slot order: when few parents are waited
        // for, each is looked up (a removed prefix leaves a rank's other sequences waiting for
        // one block, and its re-store should not probe every block it stores); else every
        // placed block is checked.
        if self.dangling.parents_waited_for() * ADOPT_LOOKUP_RATIO < blocks.len() {
            let mut adopting = ADOPTING.take();
            adopting.clear();
            for hash in self.dangling.each_parent_waited_for() {
                if let Some(at) = self.find(hash)
                    && (pos..pos + n).contains(&at)
                {
                    adopting.push((at, hash));
                }
            }
            adopting.sort_unstable_by_key(|&(at, _)| at);
            for &(at, hash) in &adopting {
                self.adopt_waiting(sink, at, hash);
            }
            ADOPTING.set(adopting);
        } else {
            for (at, block) in (pos..).zip(blocks) {
                self.adopt_waiting(sink, at, block.external);
            }
        }
    }

    /// Hangs the runs waiting for `hash` (just placed at `at`) under it.
    fn adopt_waiting<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        at: u32,
        hash: ExternalBlockHash,
    ) {
        let Some(waiting) = self.dangling.take_waiting(hash) else {
            return;
        };
        for w in waiting {
            if self.runs[w as usize].start == at {
                // A block naming itself as parent can never be reached; keep it aside.
                continue;
            }
            self.dangling.adopted(w);
            let holder = self.run_of(at);
            self.link_child(holder, at, w);
            propagate(self, sink, w);
        }
    }

    /// Starts a one-block run at `pos` (see [`RunLedger::place_stretch`]).
    fn start_run<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        pos: u32,
        local: LocalBlockHash,
        tiers: TierSet,
        previous: Option<u32>,
        previous_hash: Option<ExternalBlockHash>,
    ) -> u32 {
        let parent_run = previous.map_or(NIL, |p| self.run_of(p));
        let flags = if previous_hash.is_some() {
            HAS_PARENT
        } else {
            0
        };
        let r = self.new_run(Self::bare(pos, 1, N::from_bits(0), tiers, UNROOTED, flags));
        match (previous, previous_hash) {
            (Some(parent), _) => self.link_child(parent_run, parent, r),
            (None, Some(hash)) => {
                self.dangling.wait(r, hash);
            }
            (None, None) => {}
        }
        let level = self.wanted_level(r);
        self.runs[r as usize].level = level;
        if level == UNROOTED {
            self.locals.insert(r, vec![local]);
        } else {
            let parent_node = previous.map(|p| self.node_at(parent_run, p));
            let node = sink.child(parent_node, local);
            self.runs[r as usize].node = node;
            sink.add(node, level);
        }
        r
    }

    /// Restores a rank's blocks from a snapshot (any order; dangling parents allowed), parents
    /// before their children: a snapshot lists them by engine hash, so a chain's blocks are
    /// scattered through it, and restored in that order each became a run of its own (3×
    /// the original's heap). In parent-first order each block extends the run its parent
    /// went into, and a chain is one run again, as stored. (Blocks on a cycle of parent links
    /// come last, from the first of them listed.) Recency, under a capacity bound, is stamped
    /// in that order.
    pub(crate) fn restore<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        blocks: &[SnapshotBlock],
    ) {
        let mut open = NIL;
        for i in parent_first(blocks) {
            self.restore_one(sink, &blocks[i], &mut open);
        }
        #[cfg(debug_assertions)]
        self.check();
    }

    /// Restores one block; `open` is the run the previous one went into (`NIL` for a rank's
    /// first): a block whose parent is that run's last block, placed in the next slot with the
    /// same tiers, extends it.
    fn restore_one<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        block: &SnapshotBlock,
        open: &mut u32,
    ) {
        if block.tiers.is_empty() || self.find(block.external).is_some() {
            return;
        }
        let previous = block.parent.and_then(|p| self.find(p));
        // The open run is continued only by its own last block's child (`place_stretch`
        // checks the slot and the tiers).
        if *open != NIL && previous.is_none_or(|p| p + 1 != self.end(*open)) {
            *open = NIL;
        }
        let (pos, _) = self.alloc(1);
        self.hashes[pos as usize] = block.external;
        let hashes = &self.hashes;
        self.table.insert(hash_of(block.external), pos, |i| {
            hash_of(hashes[i as usize])
        });
        self.place_stretch(
            sink,
            &[StoredBlock {
                external: block.external,
                local: block.local,
            }],
            block.tiers,
            previous,
            block.parent,
            open,
            pos,
        );
        self.touch(pos);
    }

    /// Applies a removal on one tier: drops the tier from every named block (a run's blocks
    /// named one after the other, in either direction, are handled as one piece); then
    /// recomputes levels; then deletes the runs held on no tier, children before parents.
    pub(crate) fn remove<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        tier: Tier,
        blocks: &[ExternalBlockHash],
        report: &mut ApplyReport,
    ) {
        // Stretches of named blocks: a block next to the current stretch's end in its run
        // extends it, checked in place without a table probe (a removed chain is mostly found
        // that way, named in either direction).
        let mut stretches = STRETCHES.take();
        stretches.clear();
        let mut current: Option<Segment> = None;
        for &hash in blocks {
            if let Some(s) = &mut current {
                if s.hi < s.end && self.hashes[s.hi as usize] == hash {
                    s.hi += 1;
                    continue;
                }
                if s.lo > s.start && self.hashes[s.lo as usize - 1] == hash {
                    s.lo -= 1;
                    continue;
                }
            }
            let Some(pos) = self.find(hash) else {
                report.unknown_removes += 1;
                continue;
            };
            stretches.extend(current.take());
            let r = self.run_of(pos);
            current = Some(Segment {
                run: r,
                start: self.runs[r as usize].start,
                end: self.end(r),
                lo: pos,
                hi: pos + 1,
            });
        }
        stretches.extend(current);
        // In slot order, overlapping stretches (blocks named twice) and touching ones in
        // the same run merge; each merged stretch loses the tier at once.
        if !stretches.is_sorted_by_key(|s| s.lo) {
            stretches.sort_unstable_by_key(|s| s.lo);
        }
        let mut touched = TOUCHED.take();
        touched.clear();
        let mut merged: Option<Segment> = None;
        for &s in stretches.iter() {
            if let Some(m) = &mut merged {
                if s.lo < m.hi {
                    // Overlap: the same slots, so the same run.
                    report.unknown_removes += u64::from(s.hi.min(m.hi) - s.lo);
                    m.hi = m.hi.max(s.hi);
                    continue;
                }
                if s.lo == m.hi && s.lo < m.end {
                    m.hi = s.hi;
                    continue;
                }
            }
            if let Some(m) = merged.replace(s) {
                self.drop_tier(sink, tier, m, report, &mut touched);
            }
        }
        if let Some(m) = merged {
            self.drop_tier(sink, tier, m, report, &mut touched);
        }
        STRETCHES.set(stretches);
        for &r in &touched {
            propagate(self, sink, r);
        }
        delete_emptied(self, &touched);
        TOUCHED.set(touched);
        #[cfg(debug_assertions)]
        self.check();
    }

    /// Drops `tier` from the named blocks `stretch` (making them a run of their own), or counts
    /// them unknown if their run is not on that tier.
    fn drop_tier<M: Membership<Node = N>>(
        &mut self,
        sink: &mut M,
        tier: Tier,
        stretch: Segment,
        report: &mut ApplyReport,
        touched: &mut Vec<u32>,
    ) {
        let blocks = u64::from(stretch.hi - stretch.lo);
        // Earlier stretches may have split the run (a split keeps the head's record and gives
        // the tail a new one; nothing is freed before the deletions that follow): the run found
        // still holds the stretch if it still spans its first slot, else look it up again.
        let found = &self.runs[stretch.run as usize];
        let r = if (found.start..found.start + found.len).contains(&stretch.lo) {
            stretch.run
        } else {
            self.run_of(stretch.lo)
        };
        if !self.runs[r as usize].tiers.contains(tier) {
            report.unknown_removes += blocks;
            return;
        }
        report.removed += blocks;
        self.per_tier[tier.index()] -= blocks;
        let run = self.runs[r as usize];
        if stretch.lo > run.start
            && stretch.hi == run.start + run.len
            && run.tiers.without(tier).is_empty()
            && run.level != UNROOTED
            && !self.has_child_on(r, stretch.lo..)
        {
            self.cut_tail(sink, r, stretch.lo);
            return;
        }
        if stretch.lo == run.start
            && stretch.hi < run.start + run.len
            && run.tiers.without(tier).is_empty()
            && !self.has_child_on(r, ..stretch.hi)
        {
            self.cut_head(sink, r, stretch.hi);
            return;
        }
        let m = self.isolate(r, stretch.lo, stretch.hi);
        self.runs[m as usize].tiers = self.runs[m as usize].tiers.without(tier);
        touched.push(m);
    }

    /// Whether a child run of `r` hangs on a slot in `slots`.
    fn has_child_on(&self, r: u32, slots: impl std::ops::RangeBounds<u32>) -> bool {
        let mut child = self.runs[r as usize].first_child;
        while child != NIL {
            let c = &self.runs[child as usize];
            if slots.contains(&c.parent) {
                return true;
            }
            child = c.next_sibling;
        }
        false
    }

    /// Removes the single-tier run `r`'s blocks before slot `at` (not all of them; no child
    /// run hangs on them) in place: the rest keeps `r`'s record and now waits for the last
    /// removed block as its parent, so it is unrooted (with the child runs hanging on it) if it
    /// was rooted. What splitting the rest off as a child run, then unrooting and deleting the
    /// head does (the same calls to the backend, in the same order: the rest and its children
    /// first, then the head; the same slots freed), without making the rest's record and link,
    /// splitting its local hashes into a new list, and dropping the head's record. Head-first
    /// eviction removes chains this way.
    fn cut_head<M: Membership<Node = N>>(&mut self, sink: &mut M, r: u32, at: u32) {
        let run = self.runs[r as usize];
        let head = at - run.start;
        let parent_hash = self.hashes[at as usize - 1];
        // Away from its old parent, waiting for the block it now hangs on.
        if run.parent_run != NIL {
            self.unlink_child(r);
        }
        {
            let rest = &mut self.runs[r as usize];
            rest.start = at;
            rest.len -= head;
            rest.parent = NIL;
            rest.parent_run = NIL;
            rest.flags |= HAS_PARENT;
            if run.level != UNROOTED {
                rest.node = run.node.advance(head);
            }
        }
        self.dangling.rewait(r, parent_hash);
        self.starts.remove(&run.start);
        self.starts.insert(at, r);
        self.set_bound(at);
        if run.level == UNROOTED {
            if let Some(locals) = self.locals.get_mut(&r) {
                locals.drain(..head as usize);
                if locals.capacity() > 2 * locals.len() {
                    locals.shrink_to_fit();
                }
            }
        } else {
            // The rest and the runs hanging on it leave the forest, children first; then the
            // head, whose path the rest continued.
            propagate(self, sink, r);
            sink.remove_along(run.node, head, run.level);
        }
        self.release_slots(run.start, head);
        if run.parent_run != NIL {
            // The block it hung on may be a leaf now (in the rest itself if `r` hung on its own
            // tail: no child hangs on the head).
            self.became_leaf(run.parent);
        }
    }

    /// Removes the rooted, single-tier run `r`'s blocks from slot `at` on (not its first; no
    /// child run hangs on them) in place: what splitting them off as a run of their own, then
    /// unrooting and deleting that run does (the same calls to the backend, the same slots
    /// freed), without making and dropping the run's record, its start entry and its link.
    /// Leaf-first eviction removes chains this way.
    fn cut_tail<M: Membership<Node = N>>(&mut self, sink: &mut M, r: u32, at: u32) {
        let run = self.runs[r as usize];
        let head = at - run.start;
        let len = run.len - head;
        sink.remove_along(run.node.advance(head), len, run.level);
        self.runs[r as usize].len = head;
        self.release_slots(at, len);
        self.became_leaf(at - 1);
    }

    /// Deletes a run held on no tier (already unrooted by `propagate`): its child runs wait for
    /// their parent's hash again; its slots and record are freed.
    fn delete_run(&mut self, d: u32) {
        let run = self.runs[d as usize];
        debug_assert!(run.level == UNROOTED && run.tiers.is_empty());
        let mut child = run.first_child;
        while child != NIL {
            let next = self.runs[child as usize].next_sibling;
            if child != d {
                let hash = self.hashes[self.runs[child as usize].parent as usize];
                self.unlink_child(child);
                self.dangling.wait(child, hash);
            }
            child = next;
        }
        if run.parent_run != NIL {
            self.unlink_child(d);
            if run.parent_run != d {
                self.became_leaf(run.parent);
            }
        } else if run.flags & HAS_PARENT != 0 {
            self.dangling.forget(d);
        }
        self.starts.remove(&run.start);
        // The start bit stays: the slots become a hole (or leave the arena).
        // (A run held on no tier was not given local hashes when it left the forest, so
        // there is usually nothing to remove: skip the lookup when no run has any.)
        if !self.locals.is_empty() {
            self.locals.remove(&d);
        }
        self.runs[d as usize] = Self::bare(0, 0, run.node, TierSet::default(), UNROOTED, FREE);
        self.free_runs.push(d);
        self.release_slots(run.start, run.len);
    }

    /// Gives back `len` slots from `start` that no run holds any more (the run's record no
    /// longer covers them): their table entries go, then the slots become a hole.
    fn release_slots(&mut self, start: u32, len: u32) {
        let hashes = &self.hashes;
        self.table
            .remove_each(start..start + len, |pos| hash_of(hashes[pos as usize]));
        self.free_range(start, len);
    }

    /// Drops every block; returns the number of (block, tier) memberships that ended.
    /// Memberships are removed children first, keeping the backend's view prefix-closed.
    pub(crate) fn clear<M: Membership<Node = N>>(&mut self, sink: &mut M) -> u64 {
        let mut ended = 0;
        let mut order = Vec::new();
        for &r in self.starts.values() {
            let run = &self.runs[r as usize];
            ended += u64::from(run.len) * u64::from(run.tiers.bits().count_ones());
            if run.level != UNROOTED && run.flags & HAS_PARENT == 0 {
                order.push(r);
            }
        }
        let mut next = 0;
        while next < order.len() {
            let mut child = self.runs[order[next] as usize].first_child;
            next += 1;
            while child != NIL {
                let c = &self.runs[child as usize];
                if c.level != UNROOTED {
                    order.push(child);
                }
                child = c.next_sibling;
            }
        }
        for &r in order.iter().rev() {
            let run = self.runs[r as usize];
            for k in (0..run.len).rev() {
                sink.remove(run.node.advance(k), run.level);
            }
        }
        *self = Self::default();
        ended
    }

    /// Every held block, for a snapshot; `local` gives a node's local hash.
    pub(crate) fn snapshot(&self, local: impl Fn(N) -> LocalBlockHash) -> Vec<SnapshotBlock> {
        let mut blocks = Vec::with_capacity(self.len());
        for &r in self.starts.values() {
            let run = &self.runs[r as usize];
            for pos in run.start..run.start + run.len {
                blocks.push(SnapshotBlock {
                    external: self.hashes[pos as usize],
                    local: self.local_with(r, pos, &local),
                    parent: self.parent_hash(r, pos),
                    tiers: run.tiers,
                });
            }
        }
        blocks.sort_unstable_by_key(|b| b.external);
        blocks
    }

    /// Debug builds: the invariants of the module docs.
    #[cfg(debug_assertions)]
    fn check(&self) {
        let mut covered = 0u64;
        let mut at = 0u32;
        while (at as usize) < self.hashes.len() {
            assert_eq!(
                self.bound_at_or_before(at),
                Some(at),
                "a segment starts at {at}"
            );
            if let Some(&r) = self.starts.get(&at) {
                let run = &self.runs[r as usize];
                assert_eq!(run.start, at, "run {r} is listed at {at}");
                assert!(run.len > 0 && run.flags & (FREE | VISITING) == 0, "run {r}");
                for pos in at..at + run.len {
                    assert_eq!(
                        self.find(self.hashes[pos as usize]),
                        Some(pos),
                        "table entry of {pos}"
                    );
                }
                covered += u64::from(run.len);
                at += run.len;
            } else {
                let len = self.hole_len(at);
                assert!(len.is_some_and(|l| l > 0), "hole at {at}");
                at += len.unwrap_or(1);
            }
        }
        assert_eq!(
            at as usize,
            self.hashes.len(),
            "runs and holes tile the arena"
        );
        let bits: u32 = self.bounds.iter().map(|w| w.count_ones()).sum();
        assert_eq!(
            bits as usize,
            self.starts.len() + self.hole_count,
            "start bits"
        );
        assert_eq!(covered as usize, self.table.len(), "table size");
        let mut holes = (0u64, 0usize);
        for (w, &bits) in self.hole_bits.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let at = (w * 64) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                assert!(
                    self.bound_at_or_before(at) == Some(at) && !self.starts.contains_key(&at),
                    "the hole at {at} is a segment"
                );
                holes.0 += u64::from(self.hole_len(at).unwrap_or(0));
                holes.1 += 1;
            }
        }
        assert_eq!(holes, (self.free_blocks, self.hole_count), "free count");
        for &r in self.starts.values() {
            let run = &self.runs[r as usize];
            assert_eq!(run.level, self.wanted_level(r), "level of run {r}");
            assert_eq!(
                self.locals.get(&r).map(Vec::len),
                (run.level == UNROOTED).then_some(run.len as usize),
                "locals of run {r}"
            );
            if run.parent_run != NIL {
                let p = &self.runs[run.parent_run as usize];
                assert!(
                    (p.start..p.start + p.len).contains(&run.parent),
                    "parent of run {r}"
                );
                let mut child = p.first_child;
                let mut listed = false;
                let mut steps = 0;
                while child != NIL {
                    listed |= child == r;
                    child = self.runs[child as usize].next_sibling;
                    steps += 1;
                    assert!(steps <= self.runs.len(), "cycle in a child list");
                }
                assert!(listed, "run {r} is not in its parent's child list");
            } else if run.flags & HAS_PARENT != 0 {
                assert!(
                    self.dangling.parent_of(r).is_some(),
                    "dangling run {r} has no recorded parent"
                );
            }
            let mut child = run.first_child;
            while child != NIL {
                assert_eq!(self.runs[child as usize].parent_run, r, "child of {r}");
                child = self.runs[child as usize].next_sibling;
            }
        }
        self.dangling.check(|r| {
            self.runs.get(r as usize).is_some_and(|run| {
                run.flags & FREE == 0 && run.flags & HAS_PARENT != 0 && run.parent_run == NIL
            })
        });
    }
}

/// The positions of `blocks` with every block after its parent when its parent is among them,
/// and each block's first child right after it (depth first, in listed order otherwise);
/// blocks on a cycle of parent links last, from the first of them listed.
fn parent_first(blocks: &[SnapshotBlock]) -> Vec<usize> {
    let mut at: FxHashMap<ExternalBlockHash, usize> =
        FxHashMap::with_capacity_and_hasher(blocks.len(), Default::default());
    for (i, block) in blocks.iter().enumerate() {
        at.entry(block.external).or_insert(i);
    }
    let parents: Vec<Option<usize>> = (0..blocks.len())
        .map(|i| {
            blocks[i]
                .parent
                .and_then(|p| at.get(&p).copied())
                .filter(|&p| p != i)
        })
        .collect();
    // Children in listed order, as index lists (a block's first child at `first[parent]`,
    // the next at `next[child]`).
    let mut first = vec![usize::MAX; blocks.len()];
    let mut next = vec![usize::MAX; blocks.len()];
    for i in (0..blocks.len()).rev() {
        if let Some(p) = parents[i] {
            next[i] = first[p];
            first[p] = i;
        }
    }
    let mut order = Vec::with_capacity(blocks.len());
    let mut emitted = vec![false; blocks.len()];
    let (mut stack, mut children) = (Vec::new(), Vec::new());
    let mut walk = |root: usize, order: &mut Vec<usize>, emitted: &mut Vec<bool>| {
        stack.push(root);
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut emitted[i], true) {
                continue;
            }
            order.push(i);
            // Pushed last-first, so that the first child is taken next.
            children.clear();
            let mut c = first[i];
            while c != usize::MAX {
                children.push(c);
                c = next[c];
            }
            stack.extend(children.iter().rev());
        }
    };
    for (i, parent) in parents.iter().enumerate() {
        if parent.is_none() {
            walk(i, &mut order, &mut emitted);
        }
    }
    for i in 0..blocks.len() {
        if !emitted[i] {
            walk(i, &mut order, &mut emitted);
        }
    }
    order
}
