//! `Atlas`: kvatlas's default backend — a compressed radix tree whose edges are contiguous runs of
//! local hashes and whose per-edge worker coverage is a prefix length per tier level.
//!
//! # Structure
//!
//! - An **edge** holds a run of local hashes (`locals`), one per block position, stored
//!   contiguously; a query compares a whole run with one slice comparison.
//! - A **branch** can leave an edge at any offset: the child edge is registered under
//!   `(edge, offset, first local)` in one hash map, and its first block is an alternative to
//!   `locals[offset]` (or extends the edge when `offset == len`). Edges are never split, so node
//!   handles `(edge, offset)` stay valid as long as the block they name is held; a path that
//!   extends an edge's last block is appended in place.
//! - A **cover** says which prefix of an edge a worker rank holds at each level:
//!   `bounds[l]` = number of leading blocks of the edge held at level ≤ `l` (device 0, host 1,
//!   any tier 2). This is exact because the ledger keeps rooted membership prefix-closed at every
//!   call; multiplicity above one (two rooted blocks of one rank at the same path, possible with
//!   non-uniform engine hashes) is kept in a side table.
//! - Covers are kept sorted by worker rank, so the answer comes out sorted without a sort.
//!
//! # Query
//!
//! Walk edges from the root: compare the query with the edge's run (`m` = common length), and for
//! each cover still alive set `score[l] = depth + min(bounds[l], m)`; a level stays alive only if
//! `bounds[l] >= m`. Continue at the child `(edge, m, query[depth + m])`. The work is one slice
//! comparison plus one pass over the covers per edge visited — nothing per position.
//!
//! # Memory
//!
//! An edge is truncated when its tail is covered by no rank and carries no branch, and freed when
//! nothing remains, so memory follows the live state rather than the churn. Each rank's blocks are
//! kept by a [`RunLedger`]: per block only its engine hash and a table entry, everything else per
//! run of consecutive blocks (a run's blocks sit at consecutive offsets of one edge, so one
//! `(edge, offset)` names them all).

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvatlas_hash::LocalBlockHash;
use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::backend::KvIndex;
use crate::ledger::{Membership, NodeBits};
use crate::model::{
    ApplyReport, ExternalBlockHash, IndexStats, LEVELS, Level, MatchOptions, Matches, Mutation,
    TierSet, Worker, WorkerBlocks, WorkerMatch, table_bytes,
};
use crate::run_ledger::{RunLedger, RunNode};
use crate::snapshot::{Snapshot, WorkerSnapshot};

mod concurrent;

pub use concurrent::ConcurrentAtlas;

const NIL: u32 = u32::MAX;

/// A block position: `(edge, offset in the edge)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct NodeRef {
    edge: u32,
    offset: u32,
}

impl RunNode for NodeRef {
    #[inline]
    fn advance(self, blocks: u32) -> Self {
        Self {
            edge: self.edge,
            offset: self.offset + blocks,
        }
    }
}

impl NodeBits for NodeRef {
    fn to_bits(self) -> u64 {
        (u64::from(self.edge) << 32) | u64::from(self.offset)
    }

    fn from_bits(bits: u64) -> Self {
        Self {
            edge: (bits >> 32) as u32,
            offset: bits as u32,
        }
    }
}

/// Which prefix of an edge a worker rank holds, per cumulative level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cover {
    slot: u32,
    /// `bounds[0] <= bounds[1] <= bounds[2]`, and `bounds[2] > 0` (empty covers are dropped).
    /// When the rank holds a position more than once, `Forest::multiple` has its exact counts.
    bounds: [u32; LEVELS],
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Edge {
    locals: Vec<LocalBlockHash>,
    /// Query position of `locals[0]`.
    depth: u32,
    /// Parent edge (`NIL` for an edge starting at position 0).
    parent: u32,
    /// Offset in the parent where this edge branches off (its first block's position there).
    attach: u32,
    /// Number of child edges.
    children: u32,
    /// Largest offset a child ever branched off at; the run is never truncated below it.
    /// Reset to 0 only when no child is left, so every child attaches at or below it
    /// ([`Forest::child_edge`] relies on it).
    max_child_offset: u32,
    /// Sorted by worker rank (see `Atlas::slot_workers`).
    covers: Vec<Cover>,
}

impl Edge {
    /// Whether a child edge may attach at `offset`: every child attaches at or below
    /// `max_child_offset`, so an edge without children, or an offset past that mark, has none.
    #[inline]
    fn may_branch_at(&self, offset: u32) -> bool {
        self.children != 0 && offset <= self.max_child_offset
    }
}

/// Per-level counts of one rank's rooted blocks over the offsets `lo..hi` of an edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    lo: u32,
    hi: u32,
    counts: [u32; LEVELS],
}

/// Every position one rank holds on an edge, as runs of equal per-level counts: sorted,
/// non-overlapping, adjacent runs with different counts, no all-zero run. Kept only while some
/// position is held more than once (two engine hashes for the same tokens); otherwise the
/// cover's bounds say it all.
type ExplicitCounts = Vec<Span>;

/// Worker-rank slots and the edges, shared by all ledgers.
#[derive(Debug, Clone, Default)]
struct Forest {
    edges: Vec<Edge>,
    free_edges: Vec<u32>,
    /// Child edges, and root edges under the parent `NIL` at offset 0.
    branches: Branches,
    /// Per `(edge, slot)` where that rank holds some position more than once: all its counts
    /// on the edge, run-length encoded (the cover's bounds are derived from them).
    multiple: FxHashMap<(u32, u32), ExplicitCounts>,
    /// Reused by [`Forest::update_run`]'s general path.
    spans_scratch: [Vec<Span>; 2],
    /// Slot → worker rank (for ordering covers).
    slot_workers: Vec<Worker>,
    /// While `Some`, every change is also recorded here, so that a second copy can be brought
    /// to the same state by [`Forest::replay`] (see [`ConcurrentAtlas`]).
    journal: Option<Vec<ForestOp>>,
}

/// One change of a [`Forest`], as recorded in its journal. Replaying a copy's journal, in order,
/// on an identical copy makes the same calls with the same arguments, so (every step being
/// deterministic) it ends in the same state — with the same edge ids.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ForestOp {
    /// [`Forest::branch_off`], which returned `edge`.
    BranchOff {
        parent: u32,
        attach: u32,
        local: LocalBlockHash,
        capacity: u32,
        edge: u32,
    },
    /// [`Forest::extend_edge`] with one local (kept apart: no allocation per recorded block).
    ExtendEdge {
        edge: u32,
        local: LocalBlockHash,
        reserve: u32,
    },
    /// [`Forest::extend_edge`] with several locals.
    ExtendEdgeWith {
        edge: u32,
        locals: Box<[LocalBlockHash]>,
        reserve: u32,
    },
    /// [`Forest::settle`].
    Settle {
        edge: u32,
        slot: u32,
        level: Level,
        add: bool,
        lo: u32,
        hi: u32,
    },
    /// [`Forest::assign_slot`].
    AssignSlot { slot: u32, worker: Worker },
    /// [`Forest::reset`].
    Reset,
}

impl Forest {
    /// Records `op` if a journal is kept.
    #[inline]
    fn record(&mut self, op: impl FnOnce() -> ForestOp) {
        if let Some(journal) = &mut self.journal {
            journal.push(op());
        }
    }

    /// Applies a change recorded in another copy's journal (not recorded again).
    fn replay(&mut self, op: &ForestOp) {
        let journal = self.journal.take();
        match *op {
            ForestOp::BranchOff {
                parent,
                attach,
                local,
                capacity,
                edge,
            } => {
                let replayed = self.branch_off(parent, attach, local, capacity as usize);
                debug_assert_eq!(replayed, edge, "the copies diverged");
            }
            ForestOp::ExtendEdge {
                edge,
                local,
                reserve,
            } => self.extend_edge(edge, &[local], reserve as usize),
            ForestOp::ExtendEdgeWith {
                edge,
                ref locals,
                reserve,
            } => self.extend_edge(edge, locals, reserve as usize),
            ForestOp::Settle {
                edge,
                slot,
                level,
                add,
                lo,
                hi,
            } => self.settle(edge, slot, level, add, lo, hi),
            ForestOp::AssignSlot { slot, worker } => self.assign_slot(slot, worker),
            ForestOp::Reset => self.reset(),
        }
        self.journal = journal;
    }

    /// Empties the forest (the journal, if kept, records it).
    fn reset(&mut self) {
        let journal = self.journal.take();
        *self = Self::default();
        self.journal = journal;
        self.record(|| ForestOp::Reset);
    }

    /// Gives rank slot `slot` to `worker` (a new slot is the next one).
    fn assign_slot(&mut self, slot: u32, worker: Worker) {
        match self.slot_workers.get_mut(slot as usize) {
            Some(owner) => *owner = worker,
            None => {
                debug_assert_eq!(slot as usize, self.slot_workers.len(), "slots are dense");
                self.slot_workers.push(worker);
            }
        }
        self.record(|| ForestOp::AssignSlot { slot, worker });
    }

    /// A new edge whose first block is `local`, branching off `parent` at offset `attach`
    /// (`parent == NIL`: a root edge), with room for `capacity` blocks; returns its id.
    fn branch_off(
        &mut self,
        parent: u32,
        attach: u32,
        local: LocalBlockHash,
        capacity: usize,
    ) -> u32 {
        let depth = match parent {
            NIL => 0,
            parent => self.edges[parent as usize].depth + attach,
        };
        let mut locals = Vec::with_capacity(capacity.max(1));
        locals.push(local);
        let edge = self.new_edge(Edge {
            locals,
            depth,
            parent,
            attach,
            ..Edge::default()
        });
        self.branches.insert(&self.edges, edge);
        if parent != NIL {
            let p = &mut self.edges[parent as usize];
            p.children += 1;
            p.max_child_offset = p.max_child_offset.max(attach);
        }
        self.record(|| ForestOp::BranchOff {
            parent,
            attach,
            local,
            capacity: capacity as u32,
            edge,
        });
        edge
    }

    /// Appends `more` to `edge`'s run (the path extends its last block, and no branch can
    /// attach where the appended blocks go), reserving room for `reserve` blocks when short.
    fn extend_edge(&mut self, edge: u32, more: &[LocalBlockHash], reserve: usize) {
        let locals = &mut self.edges[edge as usize].locals;
        if locals.capacity() - locals.len() < more.len() {
            locals.reserve_exact(reserve.max(more.len()));
        }
        locals.extend_from_slice(more);
        self.record(|| match *more {
            [local] => ForestOp::ExtendEdge {
                edge,
                local,
                reserve: reserve as u32,
            },
            _ => ForestOp::ExtendEdgeWith {
                edge,
                locals: more.into(),
                reserve: reserve as u32,
            },
        });
    }

    /// Applies a run of membership changes ([`Forest::update_run`]), then gives back what a
    /// stored run over-reserved, or truncates and frees what a removal left unused.
    fn settle(&mut self, edge: u32, slot: u32, level: Level, add: bool, lo: u32, hi: u32) {
        self.update_run(edge, slot, level, add, lo, hi);
        if add {
            // A stored run ends here: give back what its announced length over-reserved
            // (blocks of the run that were already held asked for no new position).
            let locals = &mut self.edges[edge as usize].locals;
            if locals.capacity() > locals.len() + locals.len() / 8 + 4 {
                locals.shrink_to_fit();
            }
        } else {
            self.collect(edge);
        }
        self.record(|| ForestOp::Settle {
            edge,
            slot,
            level,
            add,
            lo,
            hi,
        });
    }

    fn new_edge(&mut self, edge: Edge) -> u32 {
        match self.free_edges.pop() {
            Some(id) => {
                self.edges[id as usize] = edge;
                id
            }
            None => {
                self.edges.push(edge);
                (self.edges.len() - 1) as u32
            }
        }
    }

    /// The cover of `slot` on `edge`, as an index into `covers`, or where to insert it.
    #[inline]
    fn find_cover(&self, edge: u32, slot: u32) -> Result<usize, usize> {
        let covers = &self.edges[edge as usize].covers;
        if covers.len() <= 8 {
            // Most edges have a few covers: compare slots directly, no indirection.
            if let Some(i) = covers.iter().position(|c| c.slot == slot) {
                return Ok(i);
            }
        }
        let worker = self.slot_workers[slot as usize];
        let slot_workers = &self.slot_workers;
        self.edges[edge as usize]
            .covers
            .binary_search_by(|c| slot_workers[c.slot as usize].cmp(&worker))
    }

    /// Adds (or removes) one rooted block of `slot` at each offset `lo..hi` of `edge`, at `level`
    /// — the same as doing it per offset, increasing for adds and decreasing for removes, each
    /// step prefix-closed by the ledger's guarantee. One bounds update when the rank holds each
    /// of those offsets at most once (a stored run extending its prefix, a chain unrooted
    /// children first: the common cases); otherwise through run-length encoded counts.
    fn update_run(&mut self, edge: u32, slot: u32, level: Level, add: bool, lo: u32, hi: u32) {
        let key = (edge, slot);
        let found = self.find_cover(edge, slot);
        let explicit = !self.multiple.is_empty() && self.multiple.contains_key(&key);
        let mut bounds = match found {
            Ok(i) => self.edges[edge as usize].covers[i].bounds,
            Err(_) => [0; LEVELS],
        };
        let l = level as usize;
        let simple = !explicit
            && if add {
                // The rank held nothing at `lo..hi` and (prefix closure) everything before
                // `lo` at a level ≤ `level`: each block extends the bounds of `level` and up.
                bounds[LEVELS - 1] == lo
            } else {
                // `lo..hi` is the tail, held exactly once, at `level`.
                bounds[l..].iter().all(|&b| b == hi) && (l == 0 || bounds[l - 1] <= lo)
            };
        if simple {
            for bound in &mut bounds[l..] {
                debug_assert_eq!(*bound, if add { lo } else { hi }, "change off the frontier");
                *bound = if add { hi } else { lo };
            }
        } else {
            let [mut before, mut after] = std::mem::take(&mut self.spans_scratch);
            before.clear();
            match self.multiple.remove(&key) {
                Some(spans) => before = spans,
                None => spans_of_bounds(bounds, &mut before),
            }
            change_spans(&before, lo, hi, level, add, &mut after);
            bounds = bounds_of_spans(&after);
            let multiple = after.iter().any(|s| s.counts.iter().sum::<u32>() > 1);
            if multiple {
                after.shrink_to_fit();
                self.multiple.insert(key, after);
                after = Vec::new();
            }
            self.spans_scratch = [before, after];
        }
        let covers = &mut self.edges[edge as usize].covers;
        match found {
            Ok(i) if bounds[LEVELS - 1] == 0 => remove_cover(covers, i),
            Ok(i) => covers[i].bounds = bounds,
            Err(i) if bounds[LEVELS - 1] > 0 => insert_cover(covers, i, Cover { slot, bounds }),
            Err(_) => {}
        }
    }

    /// How many leading blocks of the query from `edge`'s depth on match the edge's run, and
    /// whether the query goes on past them.
    #[inline]
    fn match_run(&self, edge: u32, query: &[LocalBlockHash]) -> (u32, bool) {
        let e = &self.edges[edge as usize];
        let depth = e.depth as usize;
        let span = e.locals.len().min(query.len() - depth);
        let matched = common_prefix(&e.locals[..span], &query[depth..depth + span]);
        (matched as u32, depth + matched < query.len())
    }

    /// The edge the query continues on after matching `matched` blocks of `edge`.
    #[inline]
    fn next_on_path(&self, edge: u32, matched: u32, query: &[LocalBlockHash]) -> Option<u32> {
        let at = self.edges[edge as usize].depth as usize + matched as usize;
        self.child_edge(edge, matched, query[at])
    }

    /// The child edge leaving `edge` at `offset` with first block `local`. Every child of an
    /// edge attaches at or below its `max_child_offset` (see [`Edge`]), so an edge without
    /// children, or an offset past that mark, needs no lookup: the common case of a query
    /// ending on a leaf edge, and of a stored run extending a fresh edge block by block.
    #[inline]
    fn child_edge(&self, edge: u32, offset: u32, local: LocalBlockHash) -> Option<u32> {
        if !self.edges[edge as usize].may_branch_at(offset) {
            return None;
        }
        self.branches.get(&self.edges, edge, offset, local)
    }

    /// Follows the query's path below `root` (whose run matched `matched` blocks): calls
    /// `visit(edge, matched, continues)` on each deeper edge while it returns `true` (some rank
    /// still matching) and the path goes on.
    #[inline]
    fn walk_below(
        &self,
        root: u32,
        matched: u32,
        query: &[LocalBlockHash],
        mut visit: impl FnMut(&Edge, u32, bool) -> bool,
    ) {
        let (mut edge, mut matched) = (root, matched);
        while let Some(child) = self.next_on_path(edge, matched, query) {
            edge = child;
            let continues;
            (matched, continues) = self.match_run(edge, query);
            if !visit(&self.edges[edge as usize], matched, continues) {
                break;
            }
        }
    }

    /// Truncates `edge`'s unused tail and frees it, then its ancestors, when nothing remains.
    fn collect(&mut self, mut edge: u32) {
        while edge != NIL {
            let e = &mut self.edges[edge as usize];
            if e.children == 0 {
                e.max_child_offset = 0;
            }
            let len = e.locals.len() as u32;
            if e.max_child_offset >= len || e.covers.iter().any(|c| c.bounds[LEVELS - 1] >= len) {
                // The whole run is still in use: nothing to truncate. (On a shared prefix most
                // ranks cover the whole edge, so this stops at one of the first covers instead
                // of taking the maximum over all of them.)
                return;
            }
            let covered = e
                .covers
                .iter()
                .map(|c| c.bounds[LEVELS - 1])
                .max()
                .unwrap_or(0);
            let keep = covered.max(e.max_child_offset) as usize;
            if keep > 0 || e.children > 0 {
                if keep < e.locals.len() {
                    e.locals.truncate(keep.max(1));
                    if e.locals.capacity() > 2 * e.locals.len() + 8 {
                        e.locals.shrink_to_fit();
                    }
                }
                return;
            }
            let (parent, attach, first) = (e.parent, e.attach, e.locals.first().copied());
            *e = Edge::default();
            self.free_edges.push(edge);
            if let Some(first) = first {
                self.branches.remove(parent, attach, first, edge);
                if parent != NIL {
                    self.edges[parent as usize].children -= 1;
                }
            }
            edge = parent;
        }
    }

    /// Whether `other` holds the same state (edges, branches, counts and slots; capacities and
    /// scratch space aside).
    #[cfg(test)]
    fn same_state(&self, other: &Forest) -> bool {
        let branches = |f: &Forest| {
            let mut ids: Vec<u32> = f.branches.table.iter().copied().collect();
            ids.sort_unstable();
            ids
        };
        self.edges == other.edges
            && self.free_edges == other.free_edges
            && branches(self) == branches(other)
            && self.multiple == other.multiple
            && self.slot_workers == other.slot_workers
    }

    /// Number of edges in use (for leak tests).
    #[cfg(test)]
    fn live_edges(&self) -> usize {
        self.edges.len() - self.free_edges.len()
    }

    fn heap_bytes(&self) -> u64 {
        let per_edge: usize = self
            .edges
            .iter()
            .map(|e| e.locals.capacity() * 8 + e.covers.capacity() * std::mem::size_of::<Cover>())
            .sum();
        let multiple_entry = std::mem::size_of::<((u32, u32), ExplicitCounts)>();
        let multiple_counts: usize = self
            .multiple
            .values()
            .map(|spans| spans.capacity() * std::mem::size_of::<Span>())
            .sum();
        (self.edges.capacity() * std::mem::size_of::<Edge>()
            + per_edge
            + table_bytes(self.branches.table.capacity(), 4)
            + table_bytes(self.multiple.capacity(), multiple_entry)
            + multiple_counts
            + self.free_edges.capacity() * 4
            + self.slot_workers.capacity() * std::mem::size_of::<Worker>()) as u64
    }
}

/// Child edges by `(parent edge, offset, first local)`. A bucket holds only the child's id
/// (4 bytes and a control byte): the key is read back from the child edge itself.
#[derive(Debug, Clone, Default)]
struct Branches {
    table: HashTable<u32>,
}

fn branch_hash(parent: u32, offset: u32, local: LocalBlockHash) -> u64 {
    key_hash(parent, offset, local.get())
}

fn key_hash(parent: u32, offset: u32, local: u64) -> u64 {
    FxBuildHasher.hash_one((parent, offset, local))
}

fn edge_key_hash(edges: &[Edge], edge: u32) -> u64 {
    let e = &edges[edge as usize];
    key_hash(e.parent, e.attach, e.locals.first().map_or(0, |l| l.get()))
}

impl Branches {
    /// The child edge leaving `parent` at `offset` with first block `local`.
    #[inline]
    fn get(&self, edges: &[Edge], parent: u32, offset: u32, local: LocalBlockHash) -> Option<u32> {
        self.table
            .find(branch_hash(parent, offset, local), |&c| {
                let e = &edges[c as usize];
                e.parent == parent && e.attach == offset && e.locals.first() == Some(&local)
            })
            .copied()
    }

    /// Registers `child` (already in `edges`, with its first block) under its key.
    fn insert(&mut self, edges: &[Edge], child: u32) {
        self.table
            .insert_unique(edge_key_hash(edges, child), child, |&c| {
                edge_key_hash(edges, c)
            });
    }

    /// Unregisters `child`, whose key was `(parent, offset, local)`.
    fn remove(&mut self, parent: u32, offset: u32, local: LocalBlockHash, child: u32) {
        if let Ok(entry) = self
            .table
            .find_entry(branch_hash(parent, offset, local), |&c| c == child)
        {
            entry.remove();
        }
    }
}

/// The counts a cover's bounds imply: one block per position, at the lowest level whose bound
/// covers it.
fn spans_of_bounds(bounds: [u32; LEVELS], into: &mut Vec<Span>) {
    let mut lo = 0;
    for (level, &hi) in bounds.iter().enumerate() {
        if hi > lo {
            let mut counts = [0; LEVELS];
            counts[level] = 1;
            into.push(Span { lo, hi, counts });
            lo = hi;
        }
    }
}

/// `spans` with one block more (or fewer) at `level` over `lo..hi`, written to `into`, still
/// sorted, merged and without zero runs.
fn change_spans(spans: &[Span], lo: u32, hi: u32, level: Level, add: bool, into: &mut Vec<Span>) {
    into.clear();
    let push = |into: &mut Vec<Span>, span: Span| {
        if span.lo >= span.hi || span.counts == [0; LEVELS] {
            return;
        }
        match into.last_mut() {
            Some(last) if last.hi == span.lo && last.counts == span.counts => last.hi = span.hi,
            _ => into.push(span),
        }
    };
    let changed = |mut counts: [u32; LEVELS]| {
        let count = &mut counts[level as usize];
        // The ledger only removes memberships it added; saturate rather than underflow.
        *count = if add {
            *count + 1
        } else {
            count.saturating_sub(1)
        };
        counts
    };
    // `lo..cursor` of the changed range is written.
    let mut cursor = lo;
    for span in spans {
        let gap_end = span.lo.min(hi);
        if cursor < gap_end {
            push(
                into,
                Span {
                    lo: cursor,
                    hi: gap_end,
                    counts: changed([0; LEVELS]),
                },
            );
            cursor = gap_end;
        }
        let from = span.lo.max(lo).min(span.hi);
        let to = span.hi.min(hi).max(from);
        push(
            into,
            Span {
                lo: span.lo,
                hi: from,
                counts: span.counts,
            },
        );
        push(
            into,
            Span {
                lo: from,
                hi: to,
                counts: changed(span.counts),
            },
        );
        push(
            into,
            Span {
                lo: to,
                hi: span.hi,
                counts: span.counts,
            },
        );
        cursor = cursor.max(to);
    }
    if cursor < hi {
        push(
            into,
            Span {
                lo: cursor,
                hi,
                counts: changed([0; LEVELS]),
            },
        );
    }
}

/// A cover's bounds from exact counts: per level, the leading positions held at or below it.
fn bounds_of_spans(spans: &[Span]) -> [u32; LEVELS] {
    let mut bounds = [0; LEVELS];
    for (level, bound) in bounds.iter_mut().enumerate() {
        for span in spans {
            if span.lo != *bound || span.counts[..=level].iter().all(|&c| c == 0) {
                break;
            }
            *bound = span.hi;
        }
    }
    bounds
}

/// Inserts a cover, growing small cover lists one at a time (most edges are covered by one or
/// two ranks; doubling would leave most of each list's allocation unused).
fn insert_cover(covers: &mut Vec<Cover>, at: usize, cover: Cover) {
    if covers.len() == covers.capacity() && covers.len() < 8 {
        covers.reserve_exact(1);
    }
    covers.insert(at, cover);
}

/// Removes a cover, giving memory back when the list is mostly unused.
fn remove_cover(covers: &mut Vec<Cover>, at: usize) {
    covers.remove(at);
    if covers.capacity() > 2 * covers.len() + 2 {
        covers.shrink_to_fit();
    }
}

/// One rank's membership sink into the forest.
///
/// Consecutive additions along one edge (a stored run: offsets going up, one level) and
/// consecutive removals (a removed chain, children first: offsets going down) are gathered into
/// one pending run and applied to the rank's cover in one update when the run ends — at the next
/// call that does not extend it, or when the sink is dropped. The ledger's calls are therefore
/// applied in their order, only grouped; nothing reads covers while a run is pending (queries
/// cannot run during a mutation, and `child` / `local` read only runs of locals).
struct Sink<'a> {
    forest: &'a mut Forest,
    slot: u32,
    pending: Pending,
    /// Blocks the ledger announced it may still add along the current path ([`Membership::expect`]):
    /// a new or extended run of locals reserves exactly that much instead of doubling.
    expected: usize,
}

/// A run of same-kind membership changes of one rank on one edge, at one level, over the
/// offsets `lo..hi`, not yet applied to the cover.
#[derive(Debug, Clone, Copy)]
enum Pending {
    None,
    Add {
        edge: u32,
        level: Level,
        lo: u32,
        hi: u32,
    },
    Remove {
        edge: u32,
        level: Level,
        lo: u32,
        hi: u32,
    },
}

impl<'a> Sink<'a> {
    fn new(forest: &'a mut Forest, slot: u32) -> Self {
        Self {
            forest,
            slot,
            pending: Pending::None,
            expected: 0,
        }
    }

    /// Applies the pending run, if any.
    fn flush(&mut self) {
        match std::mem::replace(&mut self.pending, Pending::None) {
            Pending::None => {}
            Pending::Add {
                edge,
                level,
                lo,
                hi,
            } => self.forest.settle(edge, self.slot, level, true, lo, hi),
            Pending::Remove {
                edge,
                level,
                lo,
                hi,
            } => self.forest.settle(edge, self.slot, level, false, lo, hi),
        }
    }
}

impl Drop for Sink<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

impl Membership for Sink<'_> {
    type Node = NodeRef;

    fn child(&mut self, parent: Option<NodeRef>, local: LocalBlockHash) -> NodeRef {
        if matches!(self.pending, Pending::Remove { .. }) {
            // A pending removal defers truncating its edge; settle it before the shape changes.
            self.flush();
        }
        let remaining = self.expected.max(1);
        self.expected = remaining - 1;
        let forest = &mut *self.forest;
        let Some(parent) = parent else {
            let edge = match forest.branches.get(&forest.edges, NIL, 0, local) {
                Some(edge) => edge,
                None => forest.branch_off(NIL, 0, local, remaining),
            };
            return NodeRef { edge, offset: 0 };
        };
        let target = parent.offset + 1;
        let e = &forest.edges[parent.edge as usize];
        let len = e.locals.len();
        if e.locals.get(target as usize) == Some(&local) {
            return NodeRef {
                edge: parent.edge,
                offset: target,
            };
        }
        if let Some(edge) = forest.child_edge(parent.edge, target, local) {
            return NodeRef { edge, offset: 0 };
        }
        if target as usize == len {
            // The path extends the edge's last block: append in place.
            forest.extend_edge(parent.edge, &[local], remaining);
            return NodeRef {
                edge: parent.edge,
                offset: target,
            };
        }
        let edge = forest.branch_off(parent.edge, target, local, remaining);
        NodeRef { edge, offset: 0 }
    }

    fn local(&self, node: NodeRef) -> LocalBlockHash {
        self.forest.edges[node.edge as usize].locals[node.offset as usize]
    }

    fn expect(&mut self, blocks: usize) {
        self.expected = blocks;
    }

    fn extend_path(
        &mut self,
        from: NodeRef,
        locals: &[LocalBlockHash],
        level: Level,
    ) -> (NodeRef, usize) {
        let first = self.child(Some(from), locals[0]);
        self.add(first, level);
        // Further blocks on the first one's edge: where the edge already has them, and — once
        // the path reaches the edge's end where no branch can attach — appended all at once.
        let mut added = 1;
        while added < locals.len() {
            let target = first.offset + added as u32;
            let e = &self.forest.edges[first.edge as usize];
            if e.locals.get(target as usize) == Some(&locals[added]) {
                added += 1;
                continue;
            }
            if target as usize == e.locals.len() && !e.may_branch_at(target) {
                // `expected` counts the blocks still to come after the first one.
                let reserve = self.expected;
                self.forest
                    .extend_edge(first.edge, &locals[added..], reserve);
                added = locals.len();
            }
            break;
        }
        if added > 1 {
            self.expected = self.expected.saturating_sub(added - 1);
            if let Pending::Add { ref mut hi, .. } = self.pending {
                *hi += added as u32 - 1;
            }
        }
        (first, added)
    }

    fn add(&mut self, node: NodeRef, level: Level) {
        self.add_along(node, 1, level);
    }

    fn add_along(&mut self, first: NodeRef, len: u32, level: Level) {
        if len == 0 {
            return;
        }
        if let Pending::Add {
            edge,
            level: run_level,
            ref mut hi,
            ..
        } = self.pending
            && edge == first.edge
            && run_level == level
            && *hi == first.offset
        {
            *hi += len;
            return;
        }
        self.flush();
        self.pending = Pending::Add {
            edge: first.edge,
            level,
            lo: first.offset,
            hi: first.offset + len,
        };
    }

    fn remove_along(&mut self, first: NodeRef, len: u32, level: Level) {
        if len == 0 {
            return;
        }
        if let Pending::Remove {
            edge,
            level: run_level,
            ref mut lo,
            ..
        } = self.pending
            && edge == first.edge
            && run_level == level
            && *lo == first.offset + len
        {
            *lo = first.offset;
            return;
        }
        self.flush();
        self.pending = Pending::Remove {
            edge: first.edge,
            level,
            lo: first.offset,
            hi: first.offset + len,
        };
    }

    fn locals_along(&self, first: NodeRef, len: u32, into: &mut Vec<LocalBlockHash>) {
        let from = first.offset as usize;
        into.extend_from_slice(
            &self.forest.edges[first.edge as usize].locals[from..from + len as usize],
        );
    }

    fn remove(&mut self, node: NodeRef, level: Level) {
        self.remove_along(node, 1, level);
    }
}

/// Per-query scratch, reused across queries on the same thread.
#[derive(Default)]
struct Scratch {
    /// Per cover of the root edge (in cover order): the scores so far and the levels still
    /// matching (bit `l`).
    states: Vec<([u32; LEVELS], u8)>,
    /// Slot → index into `states`; written only for ranks that continue past the root edge,
    /// read only for covers of deeper edges that hold blocks on a level the query follows. By
    /// prefix closure such a rank holds the whole path to the edge on that level, so it
    /// continued past the root edge: its entry is this query's.
    index_of_slot: Vec<u32>,
    /// Device-only walk: per row of the answer, whether the rank still matches.
    alive: Vec<bool>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Scores of one cover on an edge whose run matched the query for `m` blocks; returns the
/// levels (among `alive`) that continue past the edge.
#[inline(always)]
fn score_cover(
    cover: &Cover,
    depth: u32,
    m: u32,
    continues: bool,
    alive: u8,
    score: &mut [u32; LEVELS],
) -> u8 {
    if alive == 0b001 {
        // Device-only queries (the common case): one level.
        let bound = cover.bounds[0];
        score[0] = depth + bound.min(m);
        return u8::from(bound >= m && continues);
    }
    let mut next = 0u8;
    for (level, (bound, score)) in cover.bounds.iter().zip(score.iter_mut()).enumerate() {
        if alive & (1 << level) != 0 {
            *score = depth + (*bound).min(m);
            if *bound >= m && continues {
                next |= 1 << level;
            }
        }
    }
    next
}

/// kvatlas's default backend (see the module docs), for one thread that owns the index
/// ([`ConcurrentAtlas`] is the same index for concurrent readers and writers).
///
/// ```
/// use kvatlas_hash::BlockHasher;
/// use kvatlas_index::{
///     Atlas, ExternalBlockHash, KvIndex, MatchOptions, Mutation, StoredBlock, Tier, Worker,
/// };
///
/// // A prompt of three 4-token blocks, hashed as a router hashes it.
/// let tokens: Vec<u32> = (0..12).collect();
/// let locals: Vec<_> = BlockHasher::new(4)?.local_hashes(&tokens).collect();
///
/// // Worker 1 (rank 0) cached the first two blocks on its GPU, under its own hashes 100, 101.
/// let worker = Worker::new(1, 0);
/// let blocks = vec![
///     StoredBlock { external: ExternalBlockHash::new(100), local: locals[0] },
///     StoredBlock { external: ExternalBlockHash::new(101), local: locals[1] },
/// ];
/// let stored = Mutation::Stored { worker, tier: Tier::Device, parent: None, blocks };
/// let mut index = Atlas::new();
/// assert_eq!(index.apply(&stored).stored, 2);
///
/// // It holds the prompt's first two blocks.
/// let matches = index.find_matches(&locals, &MatchOptions::default());
/// assert_eq!(matches.device_score(worker), 2);
/// assert_eq!(matches.workers.len(), 1);
///
/// // The engine evicts the second block: one left.
/// let blocks = vec![ExternalBlockHash::new(101)];
/// index.apply(&Mutation::Removed { worker, tier: Tier::Device, blocks });
/// assert_eq!(index.find_matches(&locals, &MatchOptions::default()).device_score(worker), 1);
/// # Ok::<(), kvatlas_hash::HashError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Atlas {
    /// What queries read.
    forest: Forest,
    /// What only writes read.
    books: Books,
}

/// The writer-only part of an Atlas: per rank, its ledger and its slot in the forest. Every
/// change it makes to the forest goes through the forest's recorded operations (see
/// [`ForestOp`]), so [`ConcurrentAtlas`] can keep one `Books` for two forests.
#[derive(Debug, Clone, Default)]
struct Books {
    /// Per rank: its slot in the forest and its ledger (hashed: looked up on every mutation;
    /// listings sort by rank).
    ledgers: FxHashMap<Worker, (u32, RunLedger<NodeRef>)>,
    /// Slots of ranks that left, for reuse.
    free_slots: Vec<u32>,
    /// The optional capacity bound and its eviction state.
    bound: Option<Bound>,
}

/// Capacity bound: at most `capacity` held (rank, block) pairs; beyond it, the least recently
/// stored *leaf* across all ranks is evicted (see [`Atlas::with_capacity`]).
#[derive(Debug, Clone, Default)]
struct Bound {
    capacity: u64,
    /// Held (rank, block) pairs.
    held: u64,
    /// The recency clock shared by every ledger.
    clock: u64,
    /// Candidate leaves, least recent first; validated when popped (lazy deletion).
    heap: BinaryHeap<Reverse<(u64, Worker, u32, ExternalBlockHash)>>,
    /// Every block, least recent first: used only when no leaf is left (parent links in a
    /// cycle); built on demand, validated when popped.
    fallback: BinaryHeap<Reverse<(u64, Worker, u32, ExternalBlockHash)>>,
    /// Evictions not yet taken by [`Atlas::take_evictions`] (bounded by `capacity`).
    evicted: Vec<Eviction>,
    /// Reused buffer.
    candidates: Vec<(u64, u32, ExternalBlockHash)>,
}

/// A block the index evicted to stay within its capacity: it answers from then on as if the
/// engine had removed the block from every tier it held it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    /// The owner.
    pub worker: Worker,
    /// The block's engine hash.
    pub external: ExternalBlockHash,
    /// The tiers it was held on.
    pub tiers: TierSet,
}

impl Atlas {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index holding at most `capacity` (rank, block) pairs.
    ///
    /// Eviction policy (lineage-aware LRU): when a mutation leaves more than `capacity` pairs, the
    /// least recently stored *leaf* block (one without held children) of any rank is evicted,
    /// until the bound holds. Leaves go first, so a prefix shared by many requests stays as long
    /// as any of its continuations does; a block becomes a candidate again when its last child
    /// goes. Answers stay exact for what remains: after an eviction the index answers exactly as
    /// if the engine had removed the block ([`Atlas::take_evictions`] lists them).
    pub fn with_capacity(capacity: u64) -> Self {
        Self {
            forest: Forest::default(),
            books: Books::with_capacity(Some(capacity)),
        }
    }

    /// The evictions since the previous call (empty without a capacity bound).
    pub fn take_evictions(&mut self) -> Vec<Eviction> {
        self.books.take_evictions()
    }
}

impl Books {
    /// Empty books, with the capacity bound `capacity` if any.
    fn with_capacity(capacity: Option<u64>) -> Self {
        Self {
            bound: capacity.map(|capacity| Bound {
                capacity,
                ..Bound::default()
            }),
            ..Self::default()
        }
    }

    /// The evictions since the previous call (empty without a capacity bound).
    fn take_evictions(&mut self) -> Vec<Eviction> {
        self.bound
            .as_mut()
            .map(|b| std::mem::take(&mut b.evicted))
            .unwrap_or_default()
    }

    /// Applies the capacity bound after a mutation of `worker` changed its held count.
    fn enforce_bound(
        &mut self,
        forest: &mut Forest,
        worker: Worker,
        held_before: usize,
        report: &mut ApplyReport,
    ) {
        let Some(bound) = &mut self.bound else { return };
        let held_after = self.ledgers.get(&worker).map_or(0, |(_, l)| l.len());
        bound.held = (bound.held + held_after as u64).saturating_sub(held_before as u64);
        if let Some((_, ledger)) = self.ledgers.get_mut(&worker) {
            bound.clock = bound.clock.max(ledger.clock());
            ledger.take_candidates(&mut bound.candidates);
            for (stamp, slot, external) in bound.candidates.drain(..) {
                bound.heap.push(Reverse((stamp, worker, slot, external)));
            }
        }
        let mut fallback_built = false;
        while bound.held > bound.capacity {
            let (Reverse((stamp, victim, slot, external)), leaf) = match bound.heap.pop() {
                Some(entry) => (entry, true),
                None => match bound.fallback.pop() {
                    Some(entry) => (entry, false),
                    None if fallback_built => break,
                    None => {
                        // No leaf left (parent links in a cycle): any block, least recent
                        // first, so the bound holds whatever the input.
                        fallback_built = true;
                        for (worker, (_, ledger)) in &self.ledgers {
                            ledger.all_blocks(&mut bound.candidates);
                            for (stamp, slot, external) in bound.candidates.drain(..) {
                                bound
                                    .fallback
                                    .push(Reverse((stamp, *worker, slot, external)));
                            }
                        }
                        continue;
                    }
                },
            };
            let Some((victim_slot, ledger)) = self.ledgers.get_mut(&victim) else {
                continue;
            };
            if !ledger.is_current(slot, external, stamp, leaf) {
                continue;
            }
            let before = ledger.len();
            let tiers = ledger.evict(&mut Sink::new(forest, *victim_slot), slot);
            bound.held -= (before - ledger.len()) as u64;
            report.evicted += u64::from(tiers.bits().count_ones());
            bound.evicted.push(Eviction {
                worker: victim,
                external,
                tiers,
            });
            ledger.take_candidates(&mut bound.candidates);
            for (stamp, slot, external) in bound.candidates.drain(..) {
                bound.heap.push(Reverse((stamp, victim, slot, external)));
            }
        }
        // Stale entries accumulate lazily; rebuild when they dominate.
        if (bound.heap.len() + bound.fallback.len()) as u64 > 4 * bound.held + 1024 {
            self.rebuild_heap();
        }
        // Ranks whose last block was evicted give their slot back.
        let emptied: Vec<Worker> = match &self.bound {
            Some(bound) => bound.evicted.iter().map(|e| e.worker).collect(),
            None => Vec::new(),
        };
        for worker in emptied {
            self.release_if_empty(worker);
        }
    }

    /// Rebuilds the candidate heap from the current leaves and recounts the held pairs.
    fn rebuild_heap(&mut self) {
        let Some(bound) = &mut self.bound else { return };
        bound.heap.clear();
        bound.fallback.clear();
        bound.held = 0;
        for (worker, (_, ledger)) in &self.ledgers {
            bound.held += ledger.len() as u64;
            ledger.all_leaves(&mut bound.candidates);
            for (stamp, slot, external) in bound.candidates.drain(..) {
                bound.heap.push(Reverse((stamp, *worker, slot, external)));
            }
        }
    }

    /// The rank's slot and ledger, given a slot in `forest` if new.
    fn slot_and_ledger(
        &mut self,
        forest: &mut Forest,
        worker: Worker,
    ) -> (u32, &mut RunLedger<NodeRef>) {
        let free_slots = &mut self.free_slots;
        let (slot, ledger) = self.ledgers.entry(worker).or_insert_with(|| {
            let slot = free_slots.pop().unwrap_or(forest.slot_workers.len() as u32);
            forest.assign_slot(slot, worker);
            (slot, RunLedger::default())
        });
        (*slot, ledger)
    }

    fn release_if_empty(&mut self, worker: Worker) {
        if let Some((slot, ledger)) = self.ledgers.get(&worker)
            && ledger.len() == 0
        {
            self.free_slots.push(*slot);
            self.ledgers.remove(&worker);
        }
    }

    fn clear_worker(&mut self, forest: &mut Forest, worker: Worker) -> u64 {
        let Some((slot, ledger)) = self.ledgers.get_mut(&worker) else {
            return 0;
        };
        let ended = ledger.clear(&mut Sink::new(forest, *slot));
        self.release_if_empty(worker);
        ended
    }
}

impl Forest {
    /// The walk described in the module docs; fills `out` with every rank's exact scores.
    fn walk(&self, query: &[LocalBlockHash], tiered: bool, out: &mut Vec<WorkerMatch>) {
        let Some(first) = query.first() else { return };
        let Some(root) = self.branches.get(&self.edges, NIL, 0, *first) else {
            return;
        };
        if tiered {
            self.walk_tiered(query, root, out);
        } else {
            self.walk_device(query, root, out);
        }
    }

    /// Runs `walk` with this thread's query scratch (its slot → row index made to cover every
    /// rank slot), the root edge, and how far the query matches it (`matched`, `continues`).
    #[inline]
    fn at_root<R>(
        &self,
        query: &[LocalBlockHash],
        root: u32,
        walk: impl FnOnce(&mut Scratch, &Edge, u32, bool) -> R,
    ) -> R {
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let slots = self.slot_workers.len();
            if scratch.index_of_slot.len() < slots {
                scratch.index_of_slot.resize(slots, 0);
            }
            let (matched, continues) = self.match_run(root, query);
            walk(&mut scratch, &self.edges[root as usize], matched, continues)
        })
    }

    /// The walk for tiered queries: all three levels followed (bits 0b111 of a row's state).
    fn walk_tiered(&self, query: &[LocalBlockHash], root: u32, out: &mut Vec<WorkerMatch>) {
        self.at_root(query, root, |scratch, e, m, continues| {
            let Scratch {
                states,
                index_of_slot,
                ..
            } = scratch;
            // The root edge: every rank with a match covers it, so its covers (sorted by rank)
            // are the answer's rows, scored in one sequential pass.
            states.clear();
            states.extend(e.covers.iter().map(|cover| {
                let mut score = [0; LEVELS];
                let next = score_cover(cover, 0, m, continues, 0b111, &mut score);
                (score, next)
            }));
            let goes_on = states.iter().map(|&(_, next)| next != 0);
            // Deeper edges: only ranks that continued past the root edge can cover them.
            if index_rows(&e.covers, goes_on, index_of_slot) {
                self.walk_below(root, m, query, |e, matched, continues| {
                    let mut any_alive = false;
                    for cover in &e.covers {
                        // Every level is followed: a rank covering this edge holds the path to it
                        // on some level, so it continued past the root edge (row of this query).
                        let row = index_of_slot[cover.slot as usize] as usize;
                        let Some((score, state)) = states.get_mut(row) else {
                            debug_assert!(false, "a cover without a row");
                            continue;
                        };
                        if *state != 0 {
                            *state = score_cover(cover, e.depth, matched, continues, *state, score);
                            any_alive |= *state != 0;
                        }
                    }
                    any_alive
                });
            }
            // Every cover holds at least the edge's first block on some tier and the query
            // matched it: every row has `disk >= 1`.
            let workers = &self.slot_workers;
            out.clear();
            out.extend(e.covers.iter().zip(states.iter()).map(
                |(cover, &([device, host, disk], _))| WorkerMatch {
                    worker: workers[cover.slot as usize],
                    device,
                    host,
                    disk,
                },
            ));
        });
    }

    /// The walk for device-only queries (the routing hot path): one level, rows written
    /// straight into `out` (replacing its contents) — one pass over the root edge's covers,
    /// then in-place updates of the ranks that continue.
    fn walk_device(&self, query: &[LocalBlockHash], root: u32, out: &mut Vec<WorkerMatch>) {
        self.at_root(query, root, |scratch, e, m, continues| {
            let Scratch {
                index_of_slot,
                alive,
                ..
            } = scratch;
            // One row per cover, in two tight passes; a rank holding the edge on lower tiers
            // only (bound 0: score 0, never continuing) is dropped at the end.
            let workers = &self.slot_workers;
            out.clear();
            out.extend(e.covers.iter().map(|cover| {
                let score = cover.bounds[0].min(m);
                WorkerMatch {
                    worker: workers[cover.slot as usize],
                    device: score,
                    host: score,
                    disk: score,
                }
            }));
            alive.clear();
            alive.extend(
                e.covers
                    .iter()
                    .map(|cover| cover.bounds[0] >= m && continues),
            );
            if index_rows(&e.covers, alive.iter().copied(), index_of_slot) {
                self.walk_below(root, m, query, |e, matched, continues| {
                    let mut any_alive = false;
                    for cover in &e.covers {
                        let bound = cover.bounds[0];
                        if bound == 0 {
                            // Lower tiers only: this rank may have stopped at the root
                            // edge, with no row written this query.
                            continue;
                        }
                        // By prefix closure a rank with device blocks here held the whole
                        // path on the device: it continued past every edge so far and has
                        // this query's row.
                        let row = index_of_slot[cover.slot as usize] as usize;
                        let (Some(goes_on), Some(answer)) = (alive.get_mut(row), out.get_mut(row))
                        else {
                            debug_assert!(false, "a device cover without a row");
                            continue;
                        };
                        if !*goes_on {
                            continue;
                        }
                        let score = e.depth + bound.min(matched);
                        (answer.device, answer.host, answer.disk) = (score, score, score);
                        *goes_on = bound >= matched && continues;
                        any_alive |= *goes_on;
                    }
                    any_alive
                });
            }
            // The root edge matched at least its first block, so only those ranks scored 0.
            if out.iter().any(|row| row.device == 0) {
                out.retain(|row| row.device > 0);
            }
        });
    }
}

/// Records, for each root-edge cover whose rank goes on past the root edge, its row (the
/// cover's position) under its slot; returns whether any rank goes on.
#[inline]
fn index_rows(
    covers: &[Cover],
    goes_on: impl Iterator<Item = bool>,
    index_of_slot: &mut [u32],
) -> bool {
    let mut any = false;
    for (row, (cover, goes_on)) in covers.iter().zip(goes_on).enumerate() {
        if goes_on {
            index_of_slot[cover.slot as usize] = row as u32;
            any = true;
        }
    }
    any
}

/// Length of the common prefix of two equally long runs.
#[inline]
fn common_prefix(a: &[LocalBlockHash], b: &[LocalBlockHash]) -> usize {
    // Compare in chunks so the common all-equal case runs as wide comparisons.
    const CHUNK: usize = 16;
    let mut done = 0;
    for (x, y) in a.chunks(CHUNK).zip(b.chunks(CHUNK)) {
        if x == y {
            done += x.len();
        } else {
            return done + x.iter().zip(y).take_while(|(p, q)| p == q).count();
        }
    }
    done
}

impl Books {
    /// Applies one rank's mutation, changing `forest` to match.
    fn apply(&mut self, forest: &mut Forest, mutation: &Mutation) -> ApplyReport {
        let mut report = ApplyReport::default();
        let worker = mutation.worker();
        let held_before = match self.bound {
            Some(_) => self.ledgers.get(&worker).map_or(0, |(_, l)| l.len()),
            None => 0,
        };
        let clock = self.bound.as_ref().map(|b| b.clock);
        match mutation {
            Mutation::Stored {
                tier,
                parent,
                blocks,
                ..
            } => {
                let (slot, ledger) = self.slot_and_ledger(forest, worker);
                if let Some(clock) = clock {
                    ledger.track_recency(clock);
                    ledger.set_clock(clock);
                }
                ledger.store(
                    &mut Sink::new(forest, slot),
                    *tier,
                    *parent,
                    blocks,
                    &mut report,
                );
            }
            Mutation::Removed { tier, blocks, .. } => {
                let (slot, ledger) = self.slot_and_ledger(forest, worker);
                ledger.remove(&mut Sink::new(forest, slot), *tier, blocks, &mut report);
            }
            Mutation::Cleared { .. } => report.cleared += self.clear_worker(forest, worker),
        }
        if self.bound.is_some() {
            self.enforce_bound(forest, worker, held_before, &mut report);
        }
        self.release_if_empty(worker);
        report
    }

    /// Drops every rank of `worker_id`.
    fn remove_worker(&mut self, forest: &mut Forest, worker_id: u64) -> ApplyReport {
        let mut ranks: Vec<Worker> = self
            .ledgers
            .keys()
            .filter(|w| w.worker_id == worker_id)
            .copied()
            .collect();
        ranks.sort_unstable();
        let mut report = ApplyReport::default();
        for worker in ranks {
            report.cleared += self.clear_worker(forest, worker);
        }
        if self.bound.is_some() {
            self.rebuild_heap();
        }
        report
    }

    /// Drops everything (the capacity bound stays).
    fn clear(&mut self, forest: &mut Forest) {
        *self = Self::with_capacity(self.bound.as_ref().map(|b| b.capacity));
        forest.reset();
    }

    /// A consistent cut; `forest` is the copy in step with these books.
    fn snapshot(&self, forest: &Forest) -> Snapshot {
        let mut workers: Vec<WorkerSnapshot> = self
            .ledgers
            .iter()
            .map(|(worker, (_, ledger))| WorkerSnapshot {
                worker: *worker,
                blocks: ledger.snapshot(|node: NodeRef| {
                    forest.edges[node.edge as usize].locals[node.offset as usize]
                }),
            })
            .filter(|w| !w.blocks.is_empty())
            .collect();
        workers.sort_unstable_by_key(|w| w.worker);
        Snapshot { workers }
    }

    /// Replaces the contents with a snapshot's.
    fn restore(&mut self, forest: &mut Forest, snapshot: &Snapshot) {
        self.clear(forest);
        let bounded = self.bound.is_some();
        for w in &snapshot.workers {
            let (slot, ledger) = self.slot_and_ledger(forest, w.worker);
            if bounded {
                // Restored blocks count as stored now, in snapshot order.
                ledger.track_recency(0);
            }
            let mut sink = Sink::new(forest, slot);
            for block in &w.blocks {
                ledger.restore(&mut sink, block);
            }
            drop(sink);
            self.release_if_empty(w.worker);
        }
        if bounded {
            self.rebuild_heap();
        }
    }

    /// Occupancy, and the heap of these books plus `forest_bytes`.
    fn stats(&self, forest_bytes: u64) -> IndexStats {
        let mut workers: Vec<WorkerBlocks> = self
            .ledgers
            .iter()
            .map(|(worker, (_, ledger))| WorkerBlocks {
                worker: *worker,
                per_tier: ledger.per_tier(),
            })
            .collect();
        workers.sort_unstable_by_key(|w| w.worker);
        IndexStats {
            memberships: workers.iter().flat_map(|w| w.per_tier).sum(),
            heap_bytes: forest_bytes
                + self
                    .ledgers
                    .values()
                    .map(|(_, l)| l.heap_bytes())
                    .sum::<u64>(),
            workers,
        }
    }
}

impl Forest {
    /// The answer to a query (see the module docs).
    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        let mut matches = Matches::default();
        self.walk(query, options.tiered, &mut matches.workers);
        if options.early_exit || options.top_k.is_some() {
            matches.finish(options);
        }
        matches
    }
}

impl KvIndex for Atlas {
    fn apply(&mut self, mutation: &Mutation) -> ApplyReport {
        self.books.apply(&mut self.forest, mutation)
    }

    fn remove_worker(&mut self, worker_id: u64) -> ApplyReport {
        self.books.remove_worker(&mut self.forest, worker_id)
    }

    fn clear(&mut self) {
        self.books.clear(&mut self.forest);
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        self.forest.find_matches(query, options)
    }

    fn snapshot(&self) -> Snapshot {
        self.books.snapshot(&self.forest)
    }

    fn restore(&mut self, snapshot: &Snapshot) {
        self.books.restore(&mut self.forest, snapshot);
    }

    fn stats(&self) -> IndexStats {
        self.books.stats(self.forest.heap_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ExternalBlockHash, StoredBlock, Tier};
    use crate::reference::ReferenceIndex;

    /// Per-position counts (the model) against the run-length encoding, after every change.
    fn check_spans(changes: &[(u32, u32, Level, bool)]) {
        const WIDTH: usize = 24;
        let mut model = [[0u32; LEVELS]; WIDTH];
        let mut spans = Vec::new();
        let mut next = Vec::new();
        for &(lo, len, level, add) in changes {
            let hi = (lo + len).min(WIDTH as u32);
            change_spans(&spans, lo, hi, level, add, &mut next);
            std::mem::swap(&mut spans, &mut next);
            for counts in &mut model[lo as usize..hi as usize] {
                let c = &mut counts[level as usize];
                *c = if add { *c + 1 } else { c.saturating_sub(1) };
            }
            let mut expected = Vec::new();
            for (p, &counts) in model.iter().enumerate() {
                let p = p as u32;
                if counts == [0; LEVELS] {
                    continue;
                }
                match expected.last_mut() {
                    Some(Span { hi, counts: c, .. }) if *hi == p && *c == counts => *hi += 1,
                    _ => expected.push(Span {
                        lo: p,
                        hi: p + 1,
                        counts,
                    }),
                }
            }
            assert_eq!(spans, expected, "after {changes:?}");
            let mut bounds = [0; LEVELS];
            for (level, bound) in bounds.iter_mut().enumerate() {
                while (*bound as usize) < WIDTH
                    && model[*bound as usize][..=level].iter().any(|&c| c > 0)
                {
                    *bound += 1;
                }
            }
            assert_eq!(bounds_of_spans(&spans), bounds);
            let mut from_bounds = Vec::new();
            spans_of_bounds(bounds, &mut from_bounds);
            assert_eq!(bounds_of_spans(&from_bounds), bounds);
        }
    }

    proptest::proptest! {
        #[test]
        fn run_length_counts_match_per_position_counts(
            changes in proptest::collection::vec(
                (0u32..24, 0u32..8, 0u8..LEVELS as u8, proptest::bool::weighted(0.6)),
                0..40,
            )
        ) {
            check_spans(&changes);
        }
    }

    /// A device-only query must not confuse a rank that covers a deeper edge only on a lower
    /// tier with another rank's row (regression: rows were indexed only for ranks still
    /// matching on the device tier, so such a rank read a stale row left by an earlier query).
    #[test]
    fn lower_tier_ranks_on_deeper_edges_do_not_touch_other_rows() {
        let blocks = |ids: &[u64]| -> Vec<StoredBlock> {
            ids.iter()
                .map(|&i| StoredBlock {
                    external: ExternalBlockHash::new(i),
                    local: LocalBlockHash::new(i),
                })
                .collect()
        };
        let store = |worker, tier, ids: &[u64]| Mutation::Stored {
            worker,
            tier,
            parent: None,
            blocks: blocks(ids),
        };
        let locals = |ids: &[u64]| -> Vec<LocalBlockHash> {
            ids.iter().map(|&i| LocalBlockHash::new(i)).collect()
        };
        let (victim, lower) = (Worker::new(1, 0), Worker::new(2, 0));
        let mut atlas = Atlas::new();
        // An earlier query leaves `lower`'s row index at 0 (it was the only row then).
        atlas.apply(&store(lower, Tier::Device, &[90, 91]));
        atlas.find_matches(&locals(&[90, 91, 92]), &MatchOptions::default());
        // Root edge [1, 2, 3]; `lower` branches off at offset 2 on the host tier; the victim
        // (row 0 now) follows that branch on the device tier and goes on.
        atlas.apply(&store(victim, Tier::Device, &[1, 2, 3]));
        atlas.apply(&store(lower, Tier::Host, &[1, 2, 4, 5]));
        atlas.apply(&Mutation::Stored {
            worker: victim,
            tier: Tier::Device,
            parent: Some(ExternalBlockHash::new(2)),
            blocks: blocks(&[14, 15, 16, 17])
                .into_iter()
                .zip([4, 5, 6, 7])
                .map(|(b, l)| StoredBlock {
                    local: LocalBlockHash::new(l),
                    ..b
                })
                .collect(),
        });
        let query = locals(&[1, 2, 4, 5, 6, 7, 8]);
        let matches = atlas.find_matches(&query, &MatchOptions::default()).workers;
        assert_eq!(matches.len(), 1);
        assert_eq!((matches[0].worker, matches[0].device), (victim, 6));
        let tiered = MatchOptions {
            tiered: true,
            ..MatchOptions::default()
        };
        let matches = atlas.find_matches(&query, &tiered).workers;
        assert_eq!(matches.len(), 2);
        assert_eq!((matches[0].worker, matches[0].device), (victim, 6));
        assert_eq!(
            (matches[1].worker, matches[1].device, matches[1].host),
            (lower, 0, 4)
        );
    }

    /// A rank holding more blocks than 2-byte slot indices address (the ledger's table widens)
    /// keeps finding its blocks: removals deep in the chain cut the score exactly there.
    #[test]
    fn a_rank_beyond_65535_blocks_stays_exact() {
        let worker = Worker::new(1, 0);
        let mut atlas = Atlas::new();
        let local = |i: u64| LocalBlockHash::new(i % 1000 + 7);
        for run in 0..70u64 {
            atlas.apply(&Mutation::Stored {
                worker,
                tier: Tier::Device,
                parent: (run > 0).then(|| ExternalBlockHash::new(run * 1000 - 1)),
                blocks: (run * 1000..(run + 1) * 1000)
                    .map(|i| StoredBlock {
                        external: ExternalBlockHash::new(i),
                        local: local(i),
                    })
                    .collect(),
            });
        }
        let query: Vec<LocalBlockHash> = (0..70_000).map(local).collect();
        let options = MatchOptions::default();
        assert_eq!(
            atlas.find_matches(&query, &options).workers[0].device,
            70_000
        );
        // Blocks stored before and after the table widened, found again by hash.
        let report = atlas.apply(&Mutation::Removed {
            worker,
            tier: Tier::Device,
            blocks: [69_999, 66_000, 100]
                .into_iter()
                .map(ExternalBlockHash::new)
                .collect(),
        });
        assert_eq!(report.removed, 3);
        assert_eq!(atlas.find_matches(&query, &options).workers[0].device, 100);
        // The removed blocks' descendants are held but unrooted.
        assert_eq!(atlas.stats().memberships, 69_997);
        assert_eq!(atlas.snapshot().workers[0].blocks.len(), 69_997);
    }

    /// The run-structured ledger keeps a stored chain as one run, cuts it only where a change
    /// hits its middle, and reuses freed arena positions instead of growing.
    #[test]
    fn runs_stay_whole_and_the_arena_is_reused() {
        let worker = Worker::new(3, 0);
        let hashes = |from: u64, len: u64| -> Vec<ExternalBlockHash> {
            (from..from + len).map(ExternalBlockHash::new).collect()
        };
        // `len` blocks from `from`, each the parent of the next, under `parent`.
        let store = |tier, parent: Option<u64>, from: u64, len: u64| Mutation::Stored {
            worker,
            tier,
            parent: parent.map(ExternalBlockHash::new),
            blocks: (from..from + len)
                .map(|i| StoredBlock {
                    external: ExternalBlockHash::new(i),
                    local: LocalBlockHash::new(i * 31 + 1),
                })
                .collect(),
        };
        let remove = |tier, blocks: Vec<ExternalBlockHash>| Mutation::Removed {
            worker,
            tier,
            blocks,
        };
        let ledger = |atlas: &Atlas| -> (usize, usize, usize) {
            let (_, l) = &atlas.books.ledgers[&worker];
            (l.run_count(), l.arena_len(), l.len())
        };
        let mut atlas = Atlas::new();
        atlas.apply(&store(Tier::Device, None, 0, 1000));
        assert_eq!(ledger(&atlas), (1, 1000, 1000));
        // Leaf-first eviction, named deepest first: the run shrinks, the arena with it.
        let mut descending = hashes(900, 100);
        descending.reverse();
        atlas.apply(&remove(Tier::Device, descending));
        assert_eq!(ledger(&atlas), (1, 900, 900));
        // A block in the middle gains a tier: three runs; a middle block removed: the run
        // after it hangs dangling, still one piece.
        atlas.apply(&store(Tier::Host, Some(99), 100, 1));
        assert_eq!(ledger(&atlas).0, 3);
        atlas.apply(&remove(Tier::Device, hashes(500, 1)));
        assert_eq!(ledger(&atlas), (4, 900, 899));
        // A continuation stored after the removal fills the hole, not the arena's end.
        atlas.apply(&store(Tier::Device, Some(499), 5000, 1));
        assert_eq!(ledger(&atlas), (5, 900, 900));
        // Everything named in a scrambled order, some twice: nothing left, the arena empty.
        let mut all: Vec<ExternalBlockHash> = hashes(0, 900);
        all.push(ExternalBlockHash::new(5000));
        all.sort_by_key(|h| h.get().wrapping_mul(0x9e37_79b9_7f4a_7c15));
        all.extend(hashes(10, 5));
        let report = atlas.apply(&remove(Tier::Device, all));
        assert_eq!((report.removed, report.unknown_removes), (900, 6));
        let report = atlas.apply(&remove(Tier::Host, hashes(100, 1)));
        assert_eq!(report.removed, 1);
        assert!(!atlas.books.ledgers.contains_key(&worker));
        assert_eq!(atlas.stats().memberships, 0);
    }

    /// A rank's two sequences share a prefix; the first is removed whole and stored again (the
    /// peer harness's Workload B cycle). The second's suffix leaves the forest and comes back as
    /// one run on one edge, in a handful of forest changes rather than one per block, and the
    /// answers equal the reference model's throughout.
    #[test]
    fn a_sibling_under_a_restored_prefix_is_rerooted_per_run() {
        let worker = Worker::new(7, 0);
        // A chain of blocks with the given engine hashes; local hash = f(engine hash).
        let chain = |hashes: &[u64]| -> Vec<StoredBlock> {
            hashes
                .iter()
                .map(|&h| StoredBlock {
                    external: ExternalBlockHash::new(h),
                    local: LocalBlockHash::new(h.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
                })
                .collect()
        };
        let prefix: Vec<u64> = (1..=256).collect();
        let first: Vec<u64> = prefix.iter().copied().chain(10_000..10_768).collect();
        let second: Vec<u64> = prefix.iter().copied().chain(20_000..20_768).collect();
        let store = |hashes: &[u64]| Mutation::Stored {
            worker,
            tier: Tier::Device,
            parent: None,
            blocks: chain(hashes),
        };
        let remove = Mutation::Removed {
            worker,
            tier: Tier::Device,
            blocks: first.iter().map(|&h| ExternalBlockHash::new(h)).collect(),
        };
        let query = |hashes: &[u64]| -> Vec<LocalBlockHash> {
            chain(hashes).iter().map(|b| b.local).collect()
        };
        let scores = |m: &Matches| -> Vec<(Worker, u32)> {
            m.workers.iter().map(|w| (w.worker, w.device)).collect()
        };
        let mut atlas = Atlas::new();
        let mut reference = ReferenceIndex::new();
        for m in [store(&first), store(&second)] {
            atlas.apply(&m);
            reference.apply(&m);
        }
        let options = MatchOptions::default();
        let check = |atlas: &Atlas, reference: &ReferenceIndex| {
            for q in [query(&first), query(&second)] {
                assert_eq!(
                    scores(&atlas.find_matches(&q, &options)),
                    scores(&reference.find_matches(&q, &options))
                );
            }
        };
        check(&atlas, &reference);
        let runs = |atlas: &Atlas| atlas.books.ledgers[&worker].1.run_count();
        let (runs_before, edges_before) = (runs(&atlas), atlas.forest.live_edges());
        assert_eq!(
            scores(&atlas.find_matches(&query(&second), &options)),
            [(worker, 1024)]
        );

        atlas.apply(&remove);
        reference.apply(&remove);
        check(&atlas, &reference);
        assert!(
            atlas
                .find_matches(&query(&second), &options)
                .workers
                .is_empty()
        );

        atlas.forest.journal = Some(Vec::new());
        atlas.apply(&store(&first));
        reference.apply(&store(&first));
        let changes = atlas.forest.journal.take().map_or(0, |j| j.len());
        check(&atlas, &reference);
        assert_eq!(
            scores(&atlas.find_matches(&query(&second), &options)),
            [(worker, 1024)]
        );
        assert_eq!(
            (runs(&atlas), atlas.forest.live_edges()),
            (runs_before, edges_before)
        );
        // 1,792 blocks come back; a per-block re-rooting recorded one change for each.
        assert!(changes <= 16, "{changes} forest changes for two runs");
    }

    /// After every rank leaves, nothing of the forest is left in use, whatever the history.
    #[test]
    fn the_forest_empties_when_every_rank_leaves() {
        let mut atlas = Atlas::new();
        let mut state = 0x1234_5678_u64;
        let mut next = |bound: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % bound
        };
        for round in 0..400u64 {
            let worker = Worker::new(next(4), 0);
            let tier = Tier::ALL[next(4) as usize];
            let mutation = if next(3) > 0 {
                let blocks = (0..1 + next(6))
                    .map(|_| {
                        let id = next(40);
                        StoredBlock {
                            external: ExternalBlockHash::new(id),
                            local: LocalBlockHash::new(id % 7),
                        }
                    })
                    .collect();
                let parent = (next(4) > 0).then(|| ExternalBlockHash::new(next(40)));
                Mutation::Stored {
                    worker,
                    tier,
                    parent,
                    blocks,
                }
            } else {
                let blocks = (0..1 + next(5))
                    .map(|_| ExternalBlockHash::new(next(40)))
                    .collect();
                Mutation::Removed {
                    worker,
                    tier,
                    blocks,
                }
            };
            atlas.apply(&mutation);
            if round % 100 == 99 {
                for id in 0..4 {
                    atlas.remove_worker(id);
                }
                assert_eq!(
                    atlas.forest.live_edges(),
                    0,
                    "edges leaked after round {round}"
                );
                assert!(atlas.forest.branches.table.is_empty());
                assert!(atlas.forest.multiple.is_empty());
                assert!(atlas.books.ledgers.is_empty());
            }
        }
    }
}
