//! The forest: edges (runs of local hashes), their branches, and the covers saying which prefix
//! of an edge each rank holds; every change is a recorded [`ForestOp`] so a second copy can be
//! kept in step (see the parent module for the structure).
use std::hash::BuildHasher;

use hashbrown::HashTable;
use kvatlas_hash::LocalBlockHash;
use rustc_hash::{FxBuildHasher, FxHashMap};
use smallvec::SmallVec;

use crate::ledger::NodeBits;
use crate::model::{LEVELS, Level, Worker, table_bytes};
use crate::run_ledger::RunNode;

use super::query::common_prefix;
use super::spans::{bounds_of_spans, change_spans, insert_cover, remove_cover, spans_of_bounds};

pub(super) const NIL: u32 = u32::MAX;

/// A block position: `(edge, offset in the edge)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct NodeRef {
    pub(super) edge: u32,
    pub(super) offset: u32,
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
pub(super) struct Cover {
    pub(super) rank_index: u32,
    /// `bounds[0] <= bounds[1] <= bounds[2]`, and `bounds[2] > 0` (empty covers are dropped).
    /// When the rank holds a position more than once, `Forest::multiple` has its exact counts.
    pub(super) bounds: [u32; LEVELS],
}

/// An edge's covers, sorted by rank. Most edges are covered by one rank (a sequence only one
/// worker cached), so one cover is kept inline, without an allocation; the list is as large as
/// a `Vec` either way.
pub(super) type Covers = SmallVec<[Cover; 1]>;

// The inline cover costs no room: the list stays the size of a `Vec`.
const _: () = assert!(std::mem::size_of::<Covers>() == std::mem::size_of::<Vec<Cover>>());

/// Heap bytes of a cover list (none while its one cover is inline).
pub(super) fn covers_heap_bytes(covers: &Covers) -> usize {
    if covers.spilled() {
        covers.capacity() * std::mem::size_of::<Cover>()
    } else {
        0
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Edge {
    pub(super) locals: Vec<LocalBlockHash>,
    /// Query position of `locals[0]`.
    pub(super) depth: u32,
    /// Parent edge (`NIL` for an edge starting at position 0).
    pub(super) parent: u32,
    /// Offset in the parent where this edge branches off (its first block's position there).
    pub(super) attach: u32,
    /// Number of child edges.
    pub(super) children: u32,
    /// Largest offset a child ever branched off at; the run is never truncated below it.
    /// Reset to 0 only when no child is left, so every child attaches at or below it
    /// ([`Forest::child_edge`] relies on it).
    pub(super) max_child_offset: u32,
    /// Sorted by worker rank (see `Atlas::ranks`).
    pub(super) covers: Covers,
}

impl Edge {
    /// Whether a child edge may attach at `offset`: every child attaches at or below
    /// `max_child_offset`, so an edge without children, or an offset past that mark, has none.
    #[inline]
    pub(super) fn may_branch_at(&self, offset: u32) -> bool {
        self.children != 0 && offset <= self.max_child_offset
    }
}

/// Per-level counts of one rank's rooted blocks over the offsets `lo..hi` of an edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Span {
    pub(super) lo: u32,
    pub(super) hi: u32,
    pub(super) counts: [u32; LEVELS],
}

/// Every position one rank holds on an edge, as runs of equal per-level counts: sorted,
/// non-overlapping, adjacent runs with different counts, no all-zero run. Kept only while some
/// position is held more than once (two engine hashes for the same tokens); otherwise the
/// cover's bounds say it all.
pub(super) type ExplicitCounts = Vec<Span>;

/// The edges and the rank indices, shared by all ledgers.
#[derive(Debug, Clone, Default)]
pub(super) struct Forest {
    pub(super) edges: Vec<Edge>,
    pub(super) free_edges: Vec<u32>,
    /// Child edges, and root edges under the parent `NIL` at offset 0.
    pub(super) branches: Branches,
    /// Per `(edge, rank index)` where that rank holds some position more than once: all its counts
    /// on the edge, run-length encoded (the cover's bounds are derived from them).
    pub(super) multiple: FxHashMap<(u32, u32), ExplicitCounts>,
    /// Reused by [`Forest::update_run`]'s general path.
    pub(super) spans_scratch: [Vec<Span>; 2],
    /// Rank index → rank (for ordering covers). A rank's index is its dense number in this
    /// forest, given when it stores its first block and reused after it leaves.
    pub(super) ranks: Vec<Worker>,
    /// While `Some`, every change is also recorded here, so that a second copy can be brought
    /// to the same state by [`Forest::replay`] (see [`ConcurrentAtlas`](super::ConcurrentAtlas)).
    pub(super) journal: Option<Vec<ForestOp>>,
}

/// One change of a [`Forest`], as recorded in its journal. Replaying a copy's journal, in order,
/// on an identical copy makes the same calls with the same arguments, so (every step being
/// deterministic) it ends in the same state — with the same edge ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ForestOp {
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
        rank_index: u32,
        level: Level,
        add: bool,
        lo: u32,
        hi: u32,
    },
    /// [`Forest::assign_rank_index`].
    AssignRankIndex { rank_index: u32, worker: Worker },
    /// [`Forest::reset`].
    Reset,
}

impl Forest {
    /// Records `op` if a journal is kept.
    #[inline]
    pub(super) fn record(&mut self, op: impl FnOnce() -> ForestOp) {
        if let Some(journal) = &mut self.journal {
            journal.push(op());
        }
    }

    /// Applies a change recorded in another copy's journal (not recorded again).
    pub(super) fn replay(&mut self, op: &ForestOp) {
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
                rank_index,
                level,
                add,
                lo,
                hi,
            } => self.settle(edge, rank_index, level, add, lo, hi),
            ForestOp::AssignRankIndex { rank_index, worker } => {
                self.assign_rank_index(rank_index, worker)
            }
            ForestOp::Reset => self.reset(),
        }
        self.journal = journal;
    }

    /// Empties the forest (the journal, if kept, records it).
    pub(super) fn reset(&mut self) {
        let journal = self.journal.take();
        *self = Self::default();
        self.journal = journal;
        self.record(|| ForestOp::Reset);
    }

    /// Gives the rank index `rank_index` to `worker` (a new index is the next one).
    pub(super) fn assign_rank_index(&mut self, rank_index: u32, worker: Worker) {
        match self.ranks.get_mut(rank_index as usize) {
            Some(owner) => *owner = worker,
            None => {
                debug_assert_eq!(
                    rank_index as usize,
                    self.ranks.len(),
                    "rank indices are dense"
                );
                self.ranks.push(worker);
            }
        }
        self.record(|| ForestOp::AssignRankIndex { rank_index, worker });
    }

    /// A new edge whose first block is `local`, branching off `parent` at offset `attach`
    /// (`parent == NIL`: a root edge), with room for `capacity` blocks; returns its id.
    #[inline]
    pub(super) fn branch_off(
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
    #[inline]
    pub(super) fn extend_edge(&mut self, edge: u32, more: &[LocalBlockHash], reserve: usize) {
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
    #[inline]
    pub(super) fn settle(
        &mut self,
        edge: u32,
        rank_index: u32,
        level: Level,
        add: bool,
        lo: u32,
        hi: u32,
    ) {
        self.update_run(edge, rank_index, level, add, lo, hi);
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
            rank_index,
            level,
            add,
            lo,
            hi,
        });
    }

    pub(super) fn new_edge(&mut self, edge: Edge) -> u32 {
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

    /// The cover of the rank at `rank_index` on `edge`, as an index into `covers`, or where to insert it.
    #[inline]
    pub(super) fn find_cover(&self, edge: u32, rank_index: u32) -> Result<usize, usize> {
        let covers = &self.edges[edge as usize].covers;
        if covers.len() <= 8 {
            // Most edges have a few covers: compare rank indices directly, no indirection.
            if let Some(i) = covers.iter().position(|c| c.rank_index == rank_index) {
                return Ok(i);
            }
        }
        let worker = self.ranks[rank_index as usize];
        let ranks = &self.ranks;
        self.edges[edge as usize]
            .covers
            .binary_search_by(|c| ranks[c.rank_index as usize].cmp(&worker))
    }

    /// Adds (or removes) one rooted block of the rank at `rank_index` at each offset `lo..hi` of `edge`, at `level`
    /// — the same as doing it per offset, increasing for adds and decreasing for removes, each
    /// step prefix-closed by the ledger's guarantee. One bounds update when the rank holds each
    /// of those offsets at most once (a stored run extending its prefix, a chain unrooted
    /// children first: the common cases); otherwise through run-length encoded counts.
    pub(super) fn update_run(
        &mut self,
        edge: u32,
        rank_index: u32,
        level: Level,
        add: bool,
        lo: u32,
        hi: u32,
    ) {
        let key = (edge, rank_index);
        let found = self.find_cover(edge, rank_index);
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
            Err(i) if bounds[LEVELS - 1] > 0 => {
                insert_cover(covers, i, Cover { rank_index, bounds })
            }
            Err(_) => {}
        }
    }

    /// How many leading blocks of the query from `edge`'s depth on match the edge's run, and
    /// whether the query goes on past them.
    #[inline]
    pub(super) fn match_run(&self, edge: u32, query: &[LocalBlockHash]) -> (u32, bool) {
        let e = &self.edges[edge as usize];
        let depth = e.depth as usize;
        let span = e.locals.len().min(query.len() - depth);
        let matched = common_prefix(&e.locals[..span], &query[depth..depth + span]);
        (matched as u32, depth + matched < query.len())
    }

    /// The edge the query continues on after matching `matched` blocks of `edge`.
    #[inline]
    pub(super) fn next_on_path(
        &self,
        edge: u32,
        matched: u32,
        query: &[LocalBlockHash],
    ) -> Option<u32> {
        let at = self.edges[edge as usize].depth as usize + matched as usize;
        self.child_edge(edge, matched, query[at])
    }

    /// The child edge leaving `edge` at `offset` with first block `local`. Every child of an
    /// edge attaches at or below its `max_child_offset` (see [`Edge`]), so an edge without
    /// children, or an offset past that mark, needs no lookup: the common case of a query
    /// ending on a leaf edge, and of a stored run extending a fresh edge block by block.
    #[inline]
    pub(super) fn child_edge(&self, edge: u32, offset: u32, local: LocalBlockHash) -> Option<u32> {
        if !self.edges[edge as usize].may_branch_at(offset) {
            return None;
        }
        self.branches.get(&self.edges, edge, offset, local)
    }

    /// Follows the query's path below `root` (whose run matched `matched` blocks): calls
    /// `visit(edge, matched, continues)` on each deeper edge while it returns `true` (some rank
    /// still matching) and the path goes on.
    #[inline]
    pub(super) fn walk_below(
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
    pub(super) fn collect(&mut self, mut edge: u32) {
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

    /// Whether `other` holds the same state (edges, branches, counts and rank indices; capacities and
    /// scratch space aside).
    #[cfg(test)]
    pub(super) fn same_state(&self, other: &Forest) -> bool {
        let branches = |f: &Forest| {
            let mut ids: Vec<u32> = f.branches.table.iter().copied().collect();
            ids.sort_unstable();
            ids
        };
        self.edges == other.edges
            && self.free_edges == other.free_edges
            && branches(self) == branches(other)
            && self.multiple == other.multiple
            && self.ranks == other.ranks
    }

    /// Number of edges in use (for leak tests).
    #[cfg(test)]
    pub(super) fn live_edges(&self) -> usize {
        self.edges.len() - self.free_edges.len()
    }

    pub(super) fn heap_bytes(&self) -> u64 {
        let per_edge: usize = self
            .edges
            .iter()
            .map(|e| e.locals.capacity() * 8 + covers_heap_bytes(&e.covers))
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
            + self.ranks.capacity() * std::mem::size_of::<Worker>()) as u64
    }
}

/// Child edges by `(parent edge, offset, first local)`. A bucket holds only the child's id
/// (4 bytes and a control byte): the key is read back from the child edge itself.
#[derive(Debug, Clone, Default)]
pub(super) struct Branches {
    pub(super) table: HashTable<u32>,
}

pub(super) fn branch_hash(parent: u32, offset: u32, local: LocalBlockHash) -> u64 {
    key_hash(parent, offset, local.get())
}

pub(super) fn key_hash(parent: u32, offset: u32, local: u64) -> u64 {
    FxBuildHasher.hash_one((parent, offset, local))
}

pub(super) fn edge_key_hash(edges: &[Edge], edge: u32) -> u64 {
    let e = &edges[edge as usize];
    key_hash(e.parent, e.attach, e.locals.first().map_or(0, |l| l.get()))
}

impl Branches {
    /// The child edge leaving `parent` at `offset` with first block `local`.
    #[inline]
    pub(super) fn get(
        &self,
        edges: &[Edge],
        parent: u32,
        offset: u32,
        local: LocalBlockHash,
    ) -> Option<u32> {
        self.table
            .find(branch_hash(parent, offset, local), |&c| {
                let e = &edges[c as usize];
                e.parent == parent && e.attach == offset && e.locals.first() == Some(&local)
            })
            .copied()
    }

    /// Registers `child` (already in `edges`, with its first block) under its key.
    pub(super) fn insert(&mut self, edges: &[Edge], child: u32) {
        self.table
            .insert_unique(edge_key_hash(edges, child), child, |&c| {
                edge_key_hash(edges, c)
            });
    }

    /// Unregisters `child`, whose key was `(parent, offset, local)`.
    pub(super) fn remove(&mut self, parent: u32, offset: u32, local: LocalBlockHash, child: u32) {
        if let Ok(entry) = self
            .table
            .find_entry(branch_hash(parent, offset, local), |&c| c == child)
        {
            entry.remove();
        }
    }
}
