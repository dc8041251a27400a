//! The ledger's membership sink into the forest: groups a rank's consecutive changes along one
//! edge into one cover update.

use kvatlas_hash::LocalBlockHash;

use crate::ledger::Membership;
use crate::model::Level;

use super::forest::{Forest, NIL, NodeRef};

/// One rank's membership sink into the forest.
///
/// Consecutive additions along one edge (a stored run: offsets going up, one level) and
/// consecutive removals (a removed chain, children first: offsets going down) are gathered into
/// one pending run and applied to the rank's cover in one update when the run ends — at the next
/// call that does not extend it, or when the sink is dropped. The ledger's calls are therefore
/// applied in their order, only grouped; nothing reads covers while a run is pending (queries
/// cannot run during a mutation, and `child` / `local` read only runs of locals).
pub(super) struct Sink<'a> {
    pub(super) forest: &'a mut Forest,
    pub(super) rank_index: u32,
    pub(super) pending: Pending,
    /// Blocks the ledger announced it may still add along the current path ([`Membership::expect`]):
    /// a new or extended run of locals reserves exactly that much instead of doubling.
    pub(super) expected: usize,
}

/// A run of same-kind membership changes of one rank on one edge, at one level, over the
/// offsets `lo..hi`, not yet applied to the cover.
#[derive(Debug, Clone, Copy)]
pub(super) enum Pending {
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
    #[inline]
    pub(super) fn new(forest: &'a mut Forest, rank_index: u32) -> Self {
        Self {
            forest,
            rank_index,
            pending: Pending::None,
            expected: 0,
        }
    }

    /// Applies the pending run, if any.
    #[inline]
    pub(super) fn flush(&mut self) {
        match std::mem::replace(&mut self.pending, Pending::None) {
            Pending::None => {}
            Pending::Add {
                edge,
                level,
                lo,
                hi,
            } => self
                .forest
                .settle(edge, self.rank_index, level, true, lo, hi),
            Pending::Remove {
                edge,
                level,
                lo,
                hi,
            } => self
                .forest
                .settle(edge, self.rank_index, level, false, lo, hi),
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

    #[inline]
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

    #[inline]
    fn local(&self, node: NodeRef) -> LocalBlockHash {
        self.forest.edges[node.edge as usize].locals[node.offset as usize]
    }

    #[inline]
    fn expect(&mut self, blocks: usize) {
        self.expected = blocks;
    }

    #[inline]
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

    #[inline]
    fn add(&mut self, node: NodeRef, level: Level) {
        self.add_along(node, 1, level);
    }

    #[inline]
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

    #[inline]
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

    #[inline]
    fn locals_along(&self, first: NodeRef, len: u32, into: &mut Vec<LocalBlockHash>) {
        let from = first.offset as usize;
        into.extend_from_slice(
            &self.forest.edges[first.edge as usize].locals[from..from + len as usize],
        );
    }

    #[inline]
    fn remove(&mut self, node: NodeRef, level: Level) {
        self.remove_along(node, 1, level);
    }
}
