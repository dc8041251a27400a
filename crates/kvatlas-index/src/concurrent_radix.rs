//! `ConcurrentRadixTree`: a radix tree that readers walk while writers change it, and that
//! writers of different worker ranks change at the same time — without a global lock
//! ([`crate::baseline::Locked`]) or a second copy ([`crate::baseline::LeftRight`]).
//!
//! # Structure
//!
//! - **Nodes** are one per local-hash path from the root (per-block nodes, as in
//!   [`crate::baseline::RadixTree`]). Each node is an `Arc<Node>` whose mutable part — the ranks with a
//!   rooted block there and how many at each level (sorted by rank), and its children by local
//!   hash — sits behind the node's own `parking_lot::RwLock`. First blocks hang from `roots`, a
//!   sharded `DashMap` keyed by local hash. Children point to their parent weakly.
//! - **Ranks** each own a [`Ledger`] (`src/ledger.rs`) behind a `parking_lot::Mutex`, in a
//!   `DashMap` keyed by rank: one rank's mutations are serialized by its mutex, different ranks'
//!   run in parallel. The ledger absorbs every anomaly (holes, dangling parents, duplicates,
//!   conflicts, cycles) and drives a per-call [`Membership`] sink that adds and removes the rank's
//!   rooted memberships in the shared tree. A rank whose ledger empties is dropped from the map.
//! - **Node handles** (what a ledger stores for a rooted block) are entries of the rank's own
//!   handle table, each holding an `Arc` of the node (see [`Handles`]): a writer reaches the
//!   nodes its ledger names by an array index under its rank's mutex, with no shared table.
//!   Readers never use handles: they follow `Arc` links from the roots.
//!
//! # Concurrency protocol
//!
//! Invariants (hold at every instant, not only between mutations):
//! 1. A node is *attached* (linked from its parent's children, or from `roots`) from its creation
//!    until it is *detached*; at most one attached node exists per path, and an attached node's
//!    parent is attached. A node's path never changes.
//! 2. A node is detached only while it has no members, no children and no pins, under the write
//!    locks of its parent and itself (or, for a first block, under the `roots` shard lock and its
//!    own); once detached it is never changed again (nothing can reach it to add to it).
//! 3. A rank's handles name only nodes where that rank is a member, or the one node its sink has
//!    *pinned*: `child` finds or creates a node under its parent's lock and pins it (a counter a
//!    detaching writer checks under that same parent lock), so another rank cannot detach it
//!    between the ledger's `child` and `add` calls; `add` then turns the pin into a membership.
//!    A handle is released when its block's last membership goes (the ledger then keeps the
//!    block's local hash and never uses the handle again), so a reused entry never stands for a
//!    block that still uses the old node.
//! 4. Lock order: a rank's mutex, then the `roots` shard or a parent node, then its child node;
//!    the rank map's shard locks are taken alone. Readers hold one lock at a time.
//!
//! # Read guarantee
//!
//! A `find_matches` never credits a rank with a prefix it did not hold at some moment during the
//! call, and never reports less than the rank held throughout the call. The walk reads, under
//! one read lock per node, the node's members and the child for the next query position; so the
//! node at depth `k` is read at an instant `t_k`, and was attached when it was found (at
//! `t_(k-1)`).
//! - *No over-crediting:* a rank seen at depth `k` at `t_k` was a member of the node of path
//!   `q[0..k)` at `t_k` (a node with a member is attached, and its path is fixed). A rank's
//!   memberships change one node at a time, in its ledger's order, and the ledger keeps them
//!   prefix-closed after *every* call; so at `t_k` the rank held a chain for `q[0..k)` at the
//!   level it was seen with. Per level the same holds: a level's score stops at the first node
//!   where the rank's best level is worse, and the ledger's levels never improve down a chain.
//! - *No under-crediting:* if the rank held `q[0..k+1)` throughout the call, its memberships kept
//!   every node of that path non-empty, hence attached (invariant 2), so the walk found them and
//!   saw the rank at each.
//!
//! Within one mutation the ledger's membership changes all go one way (a store only adds, a
//! removal or clear only removes, a level change adds the new level before removing the old), so
//! the states a reader may observe mid-mutation lie between those before and after it.
//! `tests/concurrency.rs` checks both bounds against the reference model with concurrent writers
//! of several ranks.
//!
//! # Reclamation
//!
//! A node with no members and no children is detached at once by the writer that emptied it, and
//! its ancestors after it while they are empty too, so memory follows the live state (tests
//! check that the tree empties when every rank leaves, also after concurrent writers). A reader
//! still holding a detached node sees it empty (and stops there), and the node is freed when the
//! last reader lets go. A detached node is never reattached: a later store of the same path
//! creates a new node. Weak parent links and an iterative `Drop` keep freeing a long chain from
//! recursing.
//!
//! # Costs and limits
//!
//! A query costs one read lock, one `Arc` clone and a comparison of the active ranks with the
//! node's members per position (a node where every active rank continues is checked in one
//! pass); a hot node (a shared system prompt) is a shared lock word for all readers, as in
//! Dynamo's CRTC. Per-block nodes make long shared prefixes cost `O(depth × ranks)` per query,
//! where [`crate::Atlas`] compares runs. Memory is per node (136 bytes with its `Arc` header,
//! holding one member and one child inline; tables beyond), per further rank-membership (32
//! bytes) and per rooted block (a 16-byte handle entry), on top of the ledgers. Writes of one rank take node write locks that readers of those nodes briefly
//! wait for. `clear`, `remove_worker` and `restore` go rank by rank (each rank atomically with
//! respect to its own mutations); a concurrent reader may see some ranks already changed and
//! others not, which the per-rank guarantee allows. There is no loom model of this protocol yet;
//! it is checked by stress tests.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use kvatlas_hash::LocalBlockHash;
use parking_lot::{Mutex, RwLock, RwLockUpgradableReadGuard};
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use crate::backend::SharedKvIndex;
use crate::ledger::{Ledger, Membership, NodeBits};
use crate::model::{
    ApplyReport, IndexStats, LEVELS, Level, MatchOptions, Matches, Mutation, Worker, WorkerBlocks,
    WorkerMatch, table_bytes,
};
use crate::snapshot::{Snapshot, WorkerSnapshot};

/// A ledger's node handle: an entry of its rank's [`Handles`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Handle(u32);

impl NodeBits for Handle {
    fn to_bits(self) -> u64 {
        u64::from(self.0)
    }

    fn from_bits(bits: u64) -> Self {
        // Only bits made by `to_bits` come back.
        Handle(bits as u32)
    }
}

/// One rank's rooted blocks at a node, per level.
#[derive(Debug, Clone, Copy)]
struct Member {
    worker: Worker,
    counts: [u32; LEVELS],
}

impl Member {
    /// The best (lowest) level with a rooted block (a member always has one).
    fn best_level(&self) -> usize {
        self.counts
            .iter()
            .position(|&c| c > 0)
            .unwrap_or(LEVELS - 1)
    }
}

/// Grows a node's small vector one element at a time up to 4 (most nodes have one member and
/// one child; `Vec`'s first allocation would be 4 elements), by doubling after.
fn make_room<T>(v: &mut Vec<T>) {
    if v.len() == v.capacity() {
        if v.len() < 4 {
            v.reserve_exact(1);
        } else {
            v.reserve(1);
        }
    }
}

/// Shrinks a node's vector once it is a quarter full (memory follows the live state).
fn give_back<T>(v: &mut Vec<T>) {
    if v.capacity() > 4 && v.len() * 4 <= v.capacity() {
        v.shrink_to(v.len() * 2);
    }
}

/// Up to this many children are kept in a vector (most nodes have one).
const FEW_CHILDREN: usize = 8;

/// A node's children by local hash: inline when there is one (most nodes), then a vector, then
/// a hash map.
#[derive(Debug, Default)]
enum Children {
    #[default]
    None,
    One(LocalBlockHash, Arc<Node>),
    Few(Vec<(LocalBlockHash, Arc<Node>)>),
    Many(FxHashMap<LocalBlockHash, Arc<Node>>),
}

impl Children {
    fn get(&self, local: &LocalBlockHash) -> Option<&Arc<Node>> {
        match self {
            Children::None => None,
            Children::One(l, node) => (l == local).then_some(node),
            Children::Few(few) => few.iter().find(|(l, _)| l == local).map(|(_, n)| n),
            Children::Many(many) => many.get(local),
        }
    }

    fn insert(&mut self, local: LocalBlockHash, node: Arc<Node>) {
        match std::mem::take(self) {
            Children::None => *self = Children::One(local, node),
            Children::One(l, n) => {
                let mut few = Vec::with_capacity(2);
                few.extend([(l, n), (local, node)]);
                *self = Children::Few(few);
            }
            Children::Few(mut few) if few.len() < FEW_CHILDREN => {
                make_room(&mut few);
                few.push((local, node));
                *self = Children::Few(few);
            }
            Children::Few(few) => {
                let mut many: FxHashMap<_, _> = few.into_iter().collect();
                many.insert(local, node);
                *self = Children::Many(many);
            }
            Children::Many(mut many) => {
                many.insert(local, node);
                *self = Children::Many(many);
            }
        }
    }

    fn remove(&mut self, local: &LocalBlockHash) {
        match self {
            Children::None => {}
            Children::One(l, _) => {
                if l == local {
                    *self = Children::None;
                }
            }
            Children::Few(few) => {
                if let Some(i) = few.iter().position(|(l, _)| l == local) {
                    few.swap_remove(i);
                    if few.len() == 1
                        && let Some((l, n)) = few.pop()
                    {
                        *self = Children::One(l, n);
                    } else {
                        give_back(few);
                    }
                }
            }
            Children::Many(many) => {
                many.remove(local);
                if many.len() <= FEW_CHILDREN / 2 {
                    *self = Children::Few(std::mem::take(many).into_iter().collect());
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Children::None => true,
            Children::One(..) => false,
            Children::Few(few) => few.is_empty(),
            Children::Many(many) => many.is_empty(),
        }
    }

    /// Every child (for walks over the whole tree).
    fn nodes(&self) -> Vec<Arc<Node>> {
        match self {
            Children::None => Vec::new(),
            Children::One(_, node) => vec![Arc::clone(node)],
            Children::Few(few) => few.iter().map(|(_, n)| Arc::clone(n)).collect(),
            Children::Many(many) => many.values().cloned().collect(),
        }
    }

    /// Every child, taken out.
    fn into_nodes(self) -> Vec<Arc<Node>> {
        match self {
            Children::None => Vec::new(),
            Children::One(_, node) => vec![node],
            Children::Few(few) => few.into_iter().map(|(_, n)| n).collect(),
            Children::Many(many) => many.into_values().collect(),
        }
    }

    fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(LocalBlockHash, Arc<Node>)>();
        match self {
            Children::None | Children::One(..) => 0,
            Children::Few(few) => few.capacity() * entry,
            Children::Many(many) => table_bytes(many.capacity(), entry),
        }
    }
}

/// The ranks with a rooted block at a node, sorted by rank: inline when there is one (most
/// nodes), else a vector. No member has all counts zero.
#[derive(Debug, Default)]
enum Members {
    #[default]
    None,
    One(Member),
    Many(Vec<Member>),
}

impl Members {
    fn as_slice(&self) -> &[Member] {
        match self {
            Members::None => &[],
            Members::One(member) => std::slice::from_ref(member),
            Members::Many(many) => many,
        }
    }

    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    fn add(&mut self, worker: Worker, level: Level) {
        let mut counts = [0; LEVELS];
        counts[level as usize] = 1;
        let new = Member { worker, counts };
        match self {
            Members::None => *self = Members::One(new),
            Members::One(member) if member.worker == worker => {
                member.counts[level as usize] += 1;
            }
            Members::One(member) => {
                let mut many = Vec::with_capacity(2);
                if member.worker < worker {
                    many.extend([*member, new]);
                } else {
                    many.extend([new, *member]);
                }
                *self = Members::Many(many);
            }
            Members::Many(many) => match many.binary_search_by_key(&worker, |m| m.worker) {
                Ok(i) => many[i].counts[level as usize] += 1,
                Err(i) => {
                    make_room(many);
                    many.insert(i, new);
                }
            },
        }
    }

    fn remove(&mut self, worker: Worker, level: Level) {
        let found = self.as_slice().binary_search_by_key(&worker, |m| m.worker);
        debug_assert!(
            found.is_ok_and(|i| self.as_slice()[i].counts[level as usize] > 0),
            "{worker:?} removed a membership it does not have"
        );
        let Ok(i) = found else { return };
        match self {
            Members::None => {}
            Members::One(member) => {
                member.counts[level as usize] = member.counts[level as usize].saturating_sub(1);
                if member.counts == [0; LEVELS] {
                    *self = Members::None;
                }
            }
            Members::Many(many) => {
                let count = &mut many[i].counts[level as usize];
                *count = count.saturating_sub(1);
                if many[i].counts == [0; LEVELS] {
                    many.remove(i);
                    if many.len() == 1
                        && let Some(last) = many.pop()
                    {
                        *self = Members::One(last);
                    } else {
                        give_back(many);
                    }
                }
            }
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Members::None | Members::One(_) => 0,
            Members::Many(many) => many.capacity() * std::mem::size_of::<Member>(),
        }
    }
}

/// A node's mutable part, behind its lock.
#[derive(Debug, Default)]
struct NodeState {
    members: Members,
    children: Children,
    /// Linked into the tree (see the module docs, invariant 1); `false` forever once detached.
    attached: bool,
}

impl NodeState {
    fn is_empty(&self) -> bool {
        self.members.is_empty() && self.children.is_empty()
    }
}

/// One node of the tree: the last block of a local-hash path.
#[derive(Debug)]
struct Node {
    local: LocalBlockHash,
    /// `None` for a first block. Weak, so that dropping a detached chain never recurses.
    parent: Option<Weak<Node>>,
    /// Sinks between `child` and `add` (invariant 3). Incremented only under the parent's lock
    /// (or the `roots` shard lock), which a detaching writer holds while it reads this.
    pins: AtomicU32,
    state: RwLock<NodeState>,
}

impl Node {
    /// Whether the node can be detached: no members, children or pins. Called with the node's
    /// state locked for writing and its parent's (or `roots` shard) lock held.
    fn is_free(&self, state: &NodeState) -> bool {
        state.attached && state.is_empty() && self.pins.load(Ordering::Acquire) == 0
    }
}

/// The shared tree (see the module docs).
#[derive(Debug, Default)]
struct Tree {
    roots: DashMap<LocalBlockHash, Arc<Node>, FxBuildHasher>,
    /// Attached nodes.
    nodes: AtomicUsize,
}

impl Tree {
    fn sink<'a>(&'a self, worker: Worker, handles: &'a mut Handles) -> Sink<'a> {
        Sink {
            tree: self,
            worker,
            handles,
            pinned: None,
        }
    }

    /// A new attached node, pinned once (its creator's `child` call).
    fn new_node(&self, local: LocalBlockHash, parent: Option<Weak<Node>>) -> Arc<Node> {
        self.nodes.fetch_add(1, Ordering::Relaxed);
        Arc::new(Node {
            local,
            parent,
            pins: AtomicU32::new(1),
            state: RwLock::new(NodeState {
                attached: true,
                ..NodeState::default()
            }),
        })
    }

    /// The first-block node for `local`, created if needed, pinned.
    fn root_child(&self, local: LocalBlockHash) -> Arc<Node> {
        // Pinning under the shard's read lock excludes a detaching writer (which holds it for
        // writing in `remove_if`).
        if let Some(node) = self.roots.get(&local) {
            node.pins.fetch_add(1, Ordering::AcqRel);
            return Arc::clone(node.value());
        }
        match self.roots.entry(local) {
            Entry::Occupied(entry) => {
                let node = entry.get();
                node.pins.fetch_add(1, Ordering::AcqRel);
                Arc::clone(node)
            }
            Entry::Vacant(entry) => {
                let node = self.new_node(local, None);
                entry.insert(Arc::clone(&node));
                node
            }
        }
    }

    /// The child of `parent` for `local`, created if needed, pinned.
    fn child_of(&self, parent: &Arc<Node>, local: LocalBlockHash) -> Arc<Node> {
        // An upgradable read lets readers through while excluding a detaching writer (which
        // needs the parent's write lock), so the pin cannot race with a detach.
        let state = parent.state.upgradable_read();
        debug_assert!(state.attached, "a child is added under a detached node");
        if let Some(node) = state.children.get(&local) {
            node.pins.fetch_add(1, Ordering::AcqRel);
            return Arc::clone(node);
        }
        let mut state = RwLockUpgradableReadGuard::upgrade(state);
        let node = self.new_node(local, Some(Arc::downgrade(parent)));
        state.children.insert(local, Arc::clone(&node));
        node
    }

    /// Releases a pin; frees the node if that leaves it unused.
    fn unpin(&self, node: Arc<Node>) {
        if node.pins.fetch_sub(1, Ordering::AcqRel) == 1 && node.state.read().is_empty() {
            self.collect(node);
        }
    }

    /// Detaches `node` if it is free, then its ancestors while they are free.
    fn collect(&self, mut node: Arc<Node>) {
        loop {
            let parent = match &node.parent {
                None => {
                    let detached = self.roots.remove_if(&node.local, |_, n| {
                        if !Arc::ptr_eq(n, &node) {
                            return false;
                        }
                        let mut state = n.state.write();
                        let free = n.is_free(&state);
                        if free {
                            state.attached = false;
                        }
                        free
                    });
                    if detached.is_some() {
                        self.nodes.fetch_sub(1, Ordering::Relaxed);
                    }
                    return;
                }
                Some(parent) => {
                    // An attached node's parent is attached, hence alive; a dead parent means
                    // `node` was detached already.
                    let Some(parent) = parent.upgrade() else {
                        return;
                    };
                    let mut parent_state = parent.state.write();
                    let mut state = node.state.write();
                    if !node.is_free(&state) {
                        return;
                    }
                    state.attached = false;
                    parent_state.children.remove(&node.local);
                    let parent_empty = parent_state.is_empty();
                    drop(state);
                    drop(parent_state);
                    self.nodes.fetch_sub(1, Ordering::Relaxed);
                    if !parent_empty {
                        return;
                    }
                    parent
                }
            };
            node = parent;
        }
    }

    /// Heap bytes of the tree (a walk from the roots; approximate under concurrent writes).
    fn heap_bytes(&self) -> u64 {
        let node_bytes = std::mem::size_of::<Node>() + 2 * std::mem::size_of::<usize>();
        let mut total = table_bytes(
            self.roots.capacity(),
            std::mem::size_of::<(u64, Arc<Node>)>(),
        );
        let mut stack: Vec<Arc<Node>> = self.roots.iter().map(|e| Arc::clone(e.value())).collect();
        while let Some(node) = stack.pop() {
            let state = node.state.read();
            total += node_bytes + state.members.heap_bytes() + state.children.heap_bytes();
            stack.extend(state.children.nodes());
        }
        total as u64
    }
}

impl Drop for Tree {
    /// Takes the tree apart iteratively: dropping a deep tree through its `Arc` links would
    /// recurse once per level.
    fn drop(&mut self) {
        let mut stack: Vec<Arc<Node>> = std::mem::take(&mut self.roots)
            .into_iter()
            .map(|(_, node)| node)
            .collect();
        while let Some(node) = stack.pop() {
            let children = std::mem::take(&mut node.state.write().children);
            stack.extend(children.into_nodes());
        }
    }
}

/// The nodes a rank's ledger names, by [`Handle`]: one entry per rooted block of the rank (and one
/// for a block joining, between `child` and `add`), holding the node and the memberships taken
/// through it — 1 for a rooted block, 2 for an instant while its level changes (the ledger adds
/// the new level before removing the old). An entry is freed when that count returns to 0 (the
/// block left the rooted forest: the ledger keeps its local hash and never uses the handle
/// again), so entries are reused only for handles the ledger has dropped. Lookups are an array
/// index under the rank's mutex: no shared table, no hashing.
#[derive(Debug, Default)]
struct Handles {
    entries: Vec<HandleEntry>,
    free: Vec<u32>,
}

#[derive(Debug, Default)]
struct HandleEntry {
    node: Option<Arc<Node>>,
    memberships: u32,
}

impl Handles {
    fn insert(&mut self, node: Arc<Node>) -> Handle {
        let entry = HandleEntry {
            node: Some(node),
            memberships: 0,
        };
        match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = entry;
                Handle(i)
            }
            None => {
                self.entries.push(entry);
                Handle((self.entries.len() - 1) as u32)
            }
        }
    }

    /// The node of a live handle.
    fn node(&self, handle: Handle) -> &Arc<Node> {
        match self
            .entries
            .get(handle.0 as usize)
            .and_then(|s| s.node.as_ref())
        {
            Some(node) => node,
            // The ledger only names handles it holds (see the type's docs); reaching this
            // means the ledger and the handles disagree.
            None => panic!("{handle:?} is not a live handle"),
        }
    }

    /// Frees a handle's entry; returns its node (`None` if the handle was not live).
    fn release(&mut self, handle: Handle) -> Option<Arc<Node>> {
        let node = self.entries.get_mut(handle.0 as usize)?.node.take()?;
        self.free.push(handle.0);
        if self.free.len() == self.entries.len() {
            // Every handle is gone (the rank left the tree): give the memory back.
            *self = Self::default();
        }
        Some(node)
    }

    fn heap_bytes(&self) -> u64 {
        (self.entries.capacity() * std::mem::size_of::<HandleEntry>() + self.free.capacity() * 4)
            as u64
    }
}

/// One rank's membership sink into the shared tree (one per ledger call, under the rank's
/// mutex).
struct Sink<'a> {
    tree: &'a Tree,
    worker: Worker,
    handles: &'a mut Handles,
    /// The handle the last `child` returned, whose node is pinned until `add` makes this rank
    /// a member of it.
    pinned: Option<Handle>,
}

impl Sink<'_> {
    /// Drops a pin `add` did not consume (the ledger always calls `add` after `child`; this
    /// keeps a stray pin from leaking).
    fn release_pin(&mut self) {
        if let Some(handle) = self.pinned.take()
            && let Some(node) = self.handles.release(handle)
        {
            self.tree.unpin(node);
        }
    }
}

impl Drop for Sink<'_> {
    fn drop(&mut self) {
        self.release_pin();
    }
}

impl Membership for Sink<'_> {
    type Node = Handle;

    fn child(&mut self, parent: Option<Handle>, local: LocalBlockHash) -> Handle {
        self.release_pin();
        let node = match parent {
            None => self.tree.root_child(local),
            Some(parent) => self.tree.child_of(self.handles.node(parent), local),
        };
        let handle = self.handles.insert(node);
        self.pinned = Some(handle);
        handle
    }

    fn local(&self, handle: Handle) -> LocalBlockHash {
        self.handles.node(handle).local
    }

    fn add(&mut self, handle: Handle, level: Level) {
        let node = self.handles.node(handle);
        {
            let mut state = node.state.write();
            debug_assert!(state.attached, "membership added to a detached node");
            state.members.add(self.worker, level);
        }
        if self.pinned == Some(handle) {
            // This rank is now a member: the node stays attached without the pin.
            self.pinned = None;
            node.pins.fetch_sub(1, Ordering::AcqRel);
        }
        self.handles.entries[handle.0 as usize].memberships += 1;
    }

    fn remove(&mut self, handle: Handle, level: Level) {
        let node = self.handles.node(handle);
        let empty = {
            let mut state = node.state.write();
            state.members.remove(self.worker, level);
            state.is_empty()
        };
        let entry = &mut self.handles.entries[handle.0 as usize];
        debug_assert!(
            entry.memberships > 0,
            "{handle:?} removed more than it added"
        );
        entry.memberships = entry.memberships.saturating_sub(1);
        let node = if entry.memberships == 0 {
            self.handles.release(handle)
        } else {
            None
        };
        if empty && let Some(node) = node {
            self.tree.collect(node);
        }
    }
}

/// One rank's ledger. `retired` marks a ledger taken out of the rank map (it emptied); a writer
/// that finds its rank retired looks the rank up again.
#[derive(Debug, Default)]
struct Rank {
    ledger: Ledger<Handle>,
    handles: Handles,
    retired: bool,
}

/// A rank's ledger, shared between the rank map and the writers using it.
type RankCell = Arc<Mutex<Rank>>;

/// The concurrent radix tree: concurrent reads, concurrent writes of different ranks (see the
/// module docs for the protocol and the read guarantee).
#[derive(Default)]
pub struct ConcurrentRadixTree {
    tree: Tree,
    ranks: DashMap<Worker, RankCell, FxBuildHasher>,
}

impl std::fmt::Debug for ConcurrentRadixTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrentRadixTree")
            .field("ranks", &self.ranks.len())
            .field("nodes", &self.nodes())
            .finish()
    }
}

impl ConcurrentRadixTree {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Nodes currently attached (every node on a path where some rank has a rooted block): a
    /// gauge of the tree's size, and how the concurrency tests prove that racing writers leak no
    /// node (0 once every rank is gone).
    pub fn nodes(&self) -> usize {
        self.tree.nodes.load(Ordering::Relaxed)
    }

    /// The ledger of `worker`, created if needed.
    fn rank(&self, worker: Worker) -> RankCell {
        if let Some(rank) = self.ranks.get(&worker) {
            return Arc::clone(rank.value());
        }
        Arc::clone(self.ranks.entry(worker).or_default().value())
    }

    /// The ledger of `worker`, if it has one.
    fn existing_rank(&self, worker: Worker) -> Option<RankCell> {
        self.ranks.get(&worker).map(|rank| Arc::clone(rank.value()))
    }

    /// Every rank with a ledger, sorted.
    fn all_ranks(&self) -> Vec<(Worker, RankCell)> {
        let mut ranks: Vec<(Worker, RankCell)> = self
            .ranks
            .iter()
            .map(|e| (*e.key(), Arc::clone(e.value())))
            .collect();
        ranks.sort_unstable_by_key(|(worker, _)| *worker);
        ranks
    }

    /// Takes an emptied ledger out of the rank map (called with its mutex held).
    fn retire(&self, worker: Worker, cell: &RankCell, rank: &mut Rank) {
        rank.retired = true;
        self.ranks.remove_if(&worker, |_, v| Arc::ptr_eq(v, cell));
    }

    /// Runs `f` on `worker`'s live ledger (created if needed) under its mutex, and retires the
    /// ledger if it is left empty.
    fn with_rank<R>(
        &self,
        worker: Worker,
        f: impl FnOnce(&mut Ledger<Handle>, &mut Sink<'_>) -> R,
    ) -> R {
        loop {
            let cell = self.rank(worker);
            let mut rank = cell.lock();
            if rank.retired {
                continue;
            }
            let result = {
                let Rank {
                    ledger, handles, ..
                } = &mut *rank;
                f(ledger, &mut self.tree.sink(worker, handles))
            };
            if rank.ledger.len() == 0 {
                self.retire(worker, &cell, &mut rank);
            }
            return result;
        }
    }

    /// Drops every block of `worker`; returns the (block, tier) pairs that ended.
    fn clear_rank(&self, worker: Worker) -> u64 {
        loop {
            let Some(cell) = self.existing_rank(worker) else {
                return 0;
            };
            let mut rank = cell.lock();
            if rank.retired {
                continue;
            }
            let Rank {
                ledger, handles, ..
            } = &mut *rank;
            let ended = ledger.clear(&mut self.tree.sink(worker, handles));
            self.retire(worker, &cell, &mut rank);
            return ended;
        }
    }
}

/// A rank still matching during a walk.
#[derive(Debug, Clone, Copy)]
struct Active {
    worker: Worker,
    /// Its row in the answer.
    row: usize,
    /// The worst best-level along the path so far: the levels from it up still match.
    level: usize,
}

/// Sets the scores of levels `from..to` of `row` to `depth` (a level's score is the depth
/// where it stopped matching).
fn credit(row: &mut WorkerMatch, from: usize, to: usize, depth: u32) {
    for level in from..to {
        match level {
            0 => row.device = depth,
            1 => row.host = depth,
            _ => row.disk = depth,
        }
    }
}

impl SharedKvIndex for ConcurrentRadixTree {
    fn apply(&self, mutation: &Mutation) -> ApplyReport {
        let mut report = ApplyReport::default();
        match mutation {
            Mutation::Stored {
                worker,
                tier,
                parent,
                blocks,
            } => self.with_rank(*worker, |ledger, sink| {
                ledger.store(sink, *tier, *parent, blocks, &mut report);
            }),
            Mutation::Removed {
                worker,
                tier,
                blocks,
            } => self.with_rank(*worker, |ledger, sink| {
                ledger.remove(sink, *tier, blocks, &mut report);
            }),
            Mutation::Cleared { worker } => report.cleared += self.clear_rank(*worker),
        }
        report
    }

    fn remove_worker(&self, worker_id: u64) -> ApplyReport {
        let mut report = ApplyReport::default();
        for (worker, _) in self.all_ranks() {
            if worker.worker_id == worker_id {
                report.cleared += self.clear_rank(worker);
            }
        }
        report
    }

    fn clear(&self) {
        for (worker, _) in self.all_ranks() {
            self.clear_rank(worker);
        }
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        // One row per member of the first node (every rank with a match is one), sorted by rank,
        // and the ranks still matching, also sorted. A row is written only when its rank stops
        // matching at some levels, so a node where nothing changes costs one comparison per rank.
        let mut rows: Vec<WorkerMatch> = Vec::new();
        let mut active: Vec<Active> = Vec::new();
        let mut next = query
            .first()
            .and_then(|first| self.tree.roots.get(first).map(|n| Arc::clone(n.value())));
        let mut depth = 0u32;
        while let Some(node) = next.take() {
            depth += 1;
            // One critical section per node: its members and the next child, at one instant.
            let state = node.state.read();
            let members = state.members.as_slice();
            if depth == 1 {
                rows.reserve_exact(members.len());
                active.reserve_exact(members.len());
                for m in members {
                    active.push(Active {
                        worker: m.worker,
                        row: rows.len(),
                        level: m.best_level(),
                    });
                    rows.push(WorkerMatch {
                        worker: m.worker,
                        device: 0,
                        host: 0,
                        disk: 0,
                    });
                }
            } else if members.len() == active.len()
                && active
                    .iter()
                    .zip(members)
                    .all(|(a, m)| a.worker == m.worker && m.best_level() <= a.level)
            {
                // The common case on a shared prefix: every rank continues at its level.
            } else {
                // Both lists are sorted by rank: a merge.
                let mut j = 0;
                active.retain_mut(|a| {
                    while j < members.len() && members[j].worker < a.worker {
                        j += 1;
                    }
                    let Some(m) = members.get(j).filter(|m| m.worker == a.worker) else {
                        // Not here: every level still matching stops at the previous depth.
                        credit(&mut rows[a.row], a.level, LEVELS, depth - 1);
                        return false;
                    };
                    let level = m.best_level();
                    if level > a.level {
                        // Only worse levels continue: the better ones stop at the previous depth.
                        credit(&mut rows[a.row], a.level, level, depth - 1);
                        a.level = level;
                    }
                    true
                });
            }
            if !active.is_empty() {
                next = query
                    .get(depth as usize)
                    .and_then(|local| state.children.get(local))
                    .cloned();
            }
        }
        for a in &active {
            credit(&mut rows[a.row], a.level, LEVELS, depth);
        }
        let mut matches = Matches { workers: rows };
        matches.finish(options);
        matches
    }

    fn snapshot(&self) -> Snapshot {
        let workers = self
            .all_ranks()
            .into_iter()
            .filter_map(|(worker, cell)| {
                let rank = cell.lock();
                let blocks = rank
                    .ledger
                    .snapshot(|handle| rank.handles.node(handle).local);
                (!rank.retired && !blocks.is_empty()).then_some(WorkerSnapshot { worker, blocks })
            })
            .collect();
        Snapshot { workers }
    }

    fn restore(&self, snapshot: &Snapshot) {
        let restored: FxHashSet<Worker> = snapshot.workers.iter().map(|w| w.worker).collect();
        for (worker, _) in self.all_ranks() {
            if !restored.contains(&worker) {
                self.clear_rank(worker);
            }
        }
        // Each rank is replaced under its mutex (a snapshot naming a rank twice adds up).
        let mut started: FxHashSet<Worker> = FxHashSet::default();
        for w in &snapshot.workers {
            let first = started.insert(w.worker);
            self.with_rank(w.worker, |ledger, sink| {
                if first {
                    ledger.clear(sink);
                }
                for block in &w.blocks {
                    ledger.restore(sink, block);
                }
            });
        }
    }

    fn stats(&self) -> IndexStats {
        let mut heap = self.tree.heap_bytes()
            + table_bytes(
                self.ranks.capacity(),
                std::mem::size_of::<(Worker, RankCell)>(),
            ) as u64;
        let mut workers = Vec::new();
        for (worker, cell) in self.all_ranks() {
            let rank = cell.lock();
            heap += rank.ledger.heap_bytes()
                + rank.handles.heap_bytes()
                + std::mem::size_of::<Mutex<Rank>>() as u64
                + 16;
            if !rank.retired && rank.ledger.len() > 0 {
                workers.push(WorkerBlocks {
                    worker,
                    per_tier: rank.ledger.per_tier(),
                });
            }
        }
        IndexStats {
            memberships: workers.iter().flat_map(|w| w.per_tier).sum(),
            heap_bytes: heap,
            workers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ExternalBlockHash, StoredBlock, Tier};

    fn chain(worker: Worker, from: u64, to: u64) -> Mutation {
        Mutation::Stored {
            worker,
            tier: Tier::Device,
            parent: from.checked_sub(1).map(ExternalBlockHash::new),
            blocks: (from..to)
                .map(|i| StoredBlock {
                    external: ExternalBlockHash::new(i),
                    local: LocalBlockHash::new(i),
                })
                .collect(),
        }
    }

    #[test]
    fn memory_follows_the_live_state() {
        let tree = ConcurrentRadixTree::new();
        let (a, b) = (Worker::new(1, 0), Worker::new(2, 0));
        tree.apply(&chain(a, 0, 100));
        tree.apply(&chain(b, 0, 50));
        assert_eq!(tree.nodes(), 100);
        // A head-first removal unroots a's whole chain; b keeps the first 50 nodes.
        tree.apply(&Mutation::Removed {
            worker: a,
            tier: Tier::Device,
            blocks: vec![ExternalBlockHash::new(0)],
        });
        assert_eq!(tree.nodes(), 50);
        tree.apply(&chain(a, 0, 1));
        assert_eq!(tree.nodes(), 100, "re-storing the head re-roots the chain");
        tree.remove_worker(1);
        tree.apply(&Mutation::Cleared { worker: b });
        assert_eq!(tree.nodes(), 0);
        assert!(tree.tree.roots.is_empty());
        assert!(tree.ranks.is_empty(), "emptied ledgers are dropped");
    }

    /// Wide nodes: many ranks at a node and many children under one (the differential tests'
    /// small alphabets never grow a node past three children), through every inline / vector /
    /// map transition and back, against the reference model.
    #[test]
    fn wide_nodes_answer_like_the_reference() {
        use crate::backend::KvIndex;
        let tree = ConcurrentRadixTree::new();
        let mut oracle = crate::ReferenceIndex::new();
        let mut state = 11u64;
        let mut next = move |bound: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % bound
        };
        let options = MatchOptions {
            tiered: true,
            ..MatchOptions::default()
        };
        let queries: Vec<Vec<LocalBlockHash>> = (0..3)
            .flat_map(|a| (0..24).map(move |b| vec![a, 100 + b, 200]))
            .map(|q| q.into_iter().map(LocalBlockHash::new).collect())
            .collect();
        for step in 0..3000 {
            let worker = Worker::new(next(16), 0);
            // Engine hashes per rank: (first, second) → a three-block chain under a shared root.
            let (a, b) = (next(3), next(24));
            let external =
                |i: u64| ExternalBlockHash::new(worker.worker_id << 32 | a << 16 | b << 4 | i);
            let mutation = match next(3) {
                0 | 1 => Mutation::Stored {
                    worker,
                    tier: [Tier::Device, Tier::Host, Tier::Disk][next(3) as usize],
                    parent: None,
                    blocks: [a, 100 + b, 200]
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| StoredBlock {
                            external: external(i as u64),
                            local: LocalBlockHash::new(l),
                        })
                        .collect(),
                },
                _ => Mutation::Removed {
                    worker,
                    tier: Tier::Device,
                    blocks: vec![external(next(3))],
                },
            };
            assert_eq!(
                tree.apply(&mutation),
                oracle.apply(&mutation),
                "step {step}"
            );
            if step % 25 == 0 {
                for q in &queries {
                    assert_eq!(
                        tree.find_matches(q, &options),
                        oracle.find_matches(q, &options),
                        "step {step}, query {q:?}"
                    );
                }
            }
        }
        assert!(tree.nodes() > 24, "the workload grows wide nodes");
        for w in 0..16 {
            tree.remove_worker(w);
        }
        assert_eq!(tree.nodes(), 0);
    }

    #[test]
    fn a_deep_tree_drops_without_recursing() {
        let tree = ConcurrentRadixTree::new();
        tree.apply(&chain(Worker::new(1, 0), 0, 200_000));
        assert_eq!(tree.nodes(), 200_000);
        drop(tree);
    }

    #[test]
    fn a_pinned_node_survives_its_last_member_leaving() {
        let tree = Tree::default();
        let (a, b) = (Worker::new(1, 0), Worker::new(2, 0));
        let (mut handles_a, mut handles_b) = (Handles::default(), Handles::default());
        let mut sink_b = tree.sink(b, &mut handles_b);
        let node_b = sink_b.child(None, LocalBlockHash::new(7));
        sink_b.add(node_b, 0);
        // Rank a finds b's node and pins it; b leaves before a records its membership.
        let mut sink_a = tree.sink(a, &mut handles_a);
        let node_a = sink_a.child(None, LocalBlockHash::new(7));
        sink_b.remove(node_b, 0);
        drop(sink_b);
        assert_eq!(
            tree.nodes.load(Ordering::Relaxed),
            1,
            "a pinned node is not freed"
        );
        sink_a.add(node_a, 1);
        assert!(tree.roots.get(&LocalBlockHash::new(7)).is_some_and(|n| {
            let state = n.state.read();
            let members = state.members.as_slice();
            members.len() == 1 && members[0].worker == a
        }));
        sink_a.remove(node_a, 1);
        drop(sink_a);
        assert_eq!(tree.nodes.load(Ordering::Relaxed), 0);
        assert!(tree.roots.is_empty());
        assert!(handles_a.entries.is_empty() && handles_b.entries.is_empty());
    }

    #[test]
    fn a_stray_pin_is_released() {
        let tree = Tree::default();
        let mut handles = Handles::default();
        let mut sink = tree.sink(Worker::new(1, 0), &mut handles);
        let root = sink.child(None, LocalBlockHash::new(1));
        sink.add(root, 0);
        // `child` without `add` (the ledger never does this): the pin must not leak.
        sink.child(Some(root), LocalBlockHash::new(2));
        drop(sink);
        assert_eq!(
            tree.nodes.load(Ordering::Relaxed),
            1,
            "the unused child was freed with the sink"
        );
        let mut sink = tree.sink(Worker::new(1, 0), &mut handles);
        sink.remove(root, 0);
        drop(sink);
        assert_eq!(tree.nodes.load(Ordering::Relaxed), 0);
        assert!(tree.roots.is_empty());
    }
}
