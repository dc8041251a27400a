//! `PositionalIndexer`: a position-keyed index with jump search, after NVIDIA Dynamo's
//! `PositionalIndexer`, made exact.
//!
//! One node per local-hash path from the root, as in [`crate::baseline::RadixTree`], but nodes are found
//! through a flat map keyed by `(position, local hash)` instead of by walking from the root. Paths
//! that share a `(position, local hash)` cell are told apart by their **path hash**: the
//! [`SequenceHash`] chain of the path's *local* hashes (never the engines' external hashes).
//!
//! # Why jumping is exact
//!
//! The shared [`Ledger`](crate::ledger::Ledger) reports *rooted* membership, which is prefix-closed along every path: a
//! worker rank with a rooted block at level `l` on the query's node at position `p` also has one
//! at a level `<= l` on the query's node at `p - 1`. So for each rank, its best level on the
//! query's node at position `p` (`3` when it has none there, or the node does not exist) is a
//! non-decreasing function `g(p)`, and its score at cumulative level `l` is the first position
//! where `g(p) > l`. A query probes positions `jump` apart; where a rank's `g` did not change
//! between two probes nothing changed in between, and where it did, a binary search over the
//! skipped range finds each crossed level's exact boundary.
//!
//! # Path hashes on the query side
//!
//! A `(position, local)` cell holding a single node does **not** prove that the node lies on the
//! query's path (the query may differ earlier, at a position a jump skipped), so every node a
//! query uses is checked against the query's own path hash at that position. The query computes
//! its chain lazily, only as far as the deepest probe that found a cell, and caches it. Two
//! distinct paths are treated as one only if their 64-bit path hashes collide at the same
//! position and local hash — the same kind of assumption as identifying a block by its 64-bit
//! local hash. Writes never rely on it: a node's children are found by parent identity.

use kvatlas_hash::{LocalBlockHash, SequenceHash};
use rustc_hash::FxHashMap;

use crate::backend::KvIndex;
use crate::ledger::{LedgerSet, Membership, Structure};
use crate::model::{
    ApplyReport, IndexStats, LEVELS, Level, MatchOptions, Matches, Mutation, Worker, WorkerMatch,
    table_bytes,
};
use crate::snapshot::Snapshot;

/// Marks "no node" (the parent of a first block, or a free cell's parent).
const NIL: u32 = u32::MAX;
/// A rank's level on a node where it has no rooted block.
const ABSENT: Level = 3;

#[derive(Debug, Clone)]
struct Member {
    worker: Worker,
    /// Rooted blocks of this worker at the node, per level.
    counts: [u32; LEVELS],
}

impl Member {
    /// The best (lowest) level with a rooted block ([`ABSENT`] if none).
    fn best_level(&self) -> Level {
        self.counts
            .iter()
            .position(|&c| c > 0)
            .map_or(ABSENT, |l| l as Level)
    }
}

#[derive(Debug, Clone)]
struct Node {
    local: LocalBlockHash,
    position: u32,
    /// The path hash: the sequence-hash chain of the local hashes from the root to here.
    seq: SequenceHash,
    parent: u32,
    /// Live nodes whose parent is this one.
    children: u32,
    /// Ranks with a rooted block here, sorted by worker.
    members: Vec<Member>,
}

impl Node {
    /// The best level of `worker` here ([`ABSENT`] if it has no rooted block here).
    fn level_of(&self, worker: Worker) -> Level {
        self.members
            .binary_search_by_key(&worker, |m| m.worker)
            .map_or(ABSENT, |i| self.members[i].best_level())
    }
}

/// The nodes of one `(position, local hash)` cell.
#[derive(Debug, Clone)]
enum Entry {
    /// The common case: one path reaches this cell.
    Single(u32),
    /// Several paths reach this cell: `(path hash, node)` pairs.
    Multi(Vec<(SequenceHash, u32)>),
}

/// Node storage and the positional map, shared by all workers' ledgers.
#[derive(Debug, Clone, Default)]
struct Arena {
    nodes: Vec<Node>,
    free: Vec<u32>,
    cells: FxHashMap<(u32, LocalBlockHash), Entry>,
}

impl Arena {
    /// The node for `local` under `parent` (`NIL` = root), if it exists.
    fn find_child(&self, parent: u32, position: u32, local: LocalBlockHash) -> Option<u32> {
        match self.cells.get(&(position, local))? {
            Entry::Single(node) => (self.nodes[*node as usize].parent == parent).then_some(*node),
            Entry::Multi(nodes) => nodes
                .iter()
                .map(|&(_, node)| node)
                .find(|&node| self.nodes[node as usize].parent == parent),
        }
    }

    /// The node at `(position, local)` whose path hash is `seq`, if any.
    fn find_path(&self, position: u32, local: LocalBlockHash, seq: SequenceHash) -> Option<u32> {
        match self.cells.get(&(position, local))? {
            Entry::Single(node) => (self.nodes[*node as usize].seq == seq).then_some(*node),
            Entry::Multi(nodes) => nodes.iter().find(|(s, _)| *s == seq).map(|&(_, n)| n),
        }
    }

    /// Frees `node` and then its ancestors while they have neither members nor children.
    fn collect(&mut self, mut node: u32) {
        while node != NIL {
            let n = &self.nodes[node as usize];
            if !n.members.is_empty() || n.children > 0 {
                return;
            }
            let (parent, key) = (n.parent, (n.position, n.local));
            let emptied = match self.cells.get_mut(&key) {
                Some(Entry::Single(_)) | None => true,
                Some(Entry::Multi(nodes)) => {
                    nodes.retain(|&(_, n)| n != node);
                    if let [(_, last)] = nodes[..] {
                        self.cells.insert(key, Entry::Single(last));
                    }
                    false
                }
            };
            if emptied {
                self.cells.remove(&key);
            }
            let freed = &mut self.nodes[node as usize];
            freed.members = Vec::new();
            freed.parent = NIL;
            self.free.push(node);
            if parent != NIL {
                let p = &mut self.nodes[parent as usize];
                p.children = p.children.saturating_sub(1);
            }
            node = parent;
        }
    }

    fn heap_bytes(&self) -> u64 {
        let cell_entry = std::mem::size_of::<((u32, LocalBlockHash), Entry)>();
        let multi: usize = self
            .cells
            .values()
            .map(|e| match e {
                Entry::Single(_) => 0,
                Entry::Multi(v) => v.capacity() * std::mem::size_of::<(SequenceHash, u32)>(),
            })
            .sum();
        let members: usize = self
            .nodes
            .iter()
            .map(|n| n.members.capacity() * std::mem::size_of::<Member>())
            .sum();
        (self.nodes.capacity() * std::mem::size_of::<Node>()
            + members
            + table_bytes(self.cells.capacity(), cell_entry)
            + multi
            + self.free.capacity() * 4) as u64
    }
}

struct Sink<'a> {
    arena: &'a mut Arena,
    worker: Worker,
}

impl Structure for Arena {
    type Node = u32;
    type Sink<'a> = Sink<'a>;

    fn sink(&mut self, worker: Worker) -> Sink<'_> {
        Sink {
            arena: self,
            worker,
        }
    }

    fn local(&self, node: u32) -> LocalBlockHash {
        self.nodes[node as usize].local
    }

    fn heap_bytes(&self) -> u64 {
        Arena::heap_bytes(self)
    }
}

impl Membership for Sink<'_> {
    type Node = u32;

    fn child(&mut self, parent: Option<u32>, local: LocalBlockHash) -> u32 {
        let (parent, position, seq) = match parent {
            Some(p) => {
                let pn = &self.arena.nodes[p as usize];
                (p, pn.position.saturating_add(1), pn.seq.extend(local))
            }
            None => (NIL, 0, SequenceHash::first(local)),
        };
        if let Some(node) = self.arena.find_child(parent, position, local) {
            return node;
        }
        let node = Node {
            local,
            position,
            seq,
            parent,
            children: 0,
            members: Vec::new(),
        };
        let id = match self.arena.free.pop() {
            Some(id) => {
                self.arena.nodes[id as usize] = node;
                id
            }
            None => {
                self.arena.nodes.push(node);
                (self.arena.nodes.len() - 1) as u32
            }
        };
        if parent != NIL {
            self.arena.nodes[parent as usize].children += 1;
        }
        let arena = &mut *self.arena;
        match arena.cells.get_mut(&(position, local)) {
            None => {
                arena.cells.insert((position, local), Entry::Single(id));
            }
            Some(Entry::Multi(nodes)) => nodes.push((seq, id)),
            Some(entry @ Entry::Single(_)) => {
                if let Entry::Single(other) = *entry {
                    let other_seq = arena.nodes[other as usize].seq;
                    *entry = Entry::Multi(vec![(other_seq, other), (seq, id)]);
                }
            }
        }
        id
    }

    fn local(&self, node: u32) -> LocalBlockHash {
        self.arena.nodes[node as usize].local
    }

    fn add(&mut self, node: u32, level: Level) {
        let members = &mut self.arena.nodes[node as usize].members;
        match members.binary_search_by_key(&self.worker, |m| m.worker) {
            Ok(i) => members[i].counts[level as usize] += 1,
            Err(i) => {
                let mut counts = [0; LEVELS];
                counts[level as usize] = 1;
                members.insert(
                    i,
                    Member {
                        worker: self.worker,
                        counts,
                    },
                );
            }
        }
    }

    fn remove(&mut self, node: u32, level: Level) {
        let members = &mut self.arena.nodes[node as usize].members;
        if let Ok(i) = members.binary_search_by_key(&self.worker, |m| m.worker) {
            let count = &mut members[i].counts[level as usize];
            *count = count.saturating_sub(1);
            if members[i].counts.iter().all(|&c| c == 0) {
                members.remove(i);
            }
        }
        self.arena.collect(node);
    }
}

/// Position marker in [`Query::nodes`]: not looked up yet.
const UNKNOWN: u32 = u32::MAX;
/// Position marker in [`Query::nodes`]: the query's path has no node there.
const MISSING: u32 = u32::MAX - 1;

/// One query's lazily computed path hashes and nodes.
struct Query<'a> {
    arena: &'a Arena,
    locals: &'a [LocalBlockHash],
    /// The query's path hashes for positions `0..seqs.len()`.
    seqs: Vec<SequenceHash>,
    /// Per position: the query's node, [`UNKNOWN`] or [`MISSING`].
    nodes: Vec<u32>,
}

impl<'a> Query<'a> {
    fn new(arena: &'a Arena, locals: &'a [LocalBlockHash]) -> Self {
        Self {
            arena,
            locals,
            seqs: Vec::new(),
            nodes: vec![UNKNOWN; locals.len()],
        }
    }

    /// The query's path hash at `position` (extends the cached chain as needed).
    fn seq(&mut self, position: usize) -> SequenceHash {
        while self.seqs.len() <= position {
            let local = self.locals[self.seqs.len()];
            let next = match self.seqs.last() {
                Some(previous) => previous.extend(local),
                None => SequenceHash::first(local),
            };
            self.seqs.push(next);
        }
        self.seqs[position]
    }

    /// The node of the query's path at `position`, if it exists.
    fn node(&mut self, position: usize) -> Option<&'a Node> {
        let mut id = self.nodes[position];
        if id == UNKNOWN {
            id = MISSING;
            let key_position = u32::try_from(position).ok();
            if let Some(p) = key_position
                && self.arena.cells.contains_key(&(p, self.locals[position]))
            {
                let seq = self.seq(position);
                if let Some(node) = self.arena.find_path(p, self.locals[position], seq) {
                    id = node;
                }
            }
            self.nodes[position] = id;
        }
        (id != MISSING).then(|| &self.arena.nodes[id as usize])
    }

    /// The best level of `worker` on the query's node at `position`.
    fn level(&mut self, position: usize, worker: Worker) -> Level {
        self.node(position).map_or(ABSENT, |n| n.level_of(worker))
    }
}

/// A rank still matching during a query.
struct Active {
    worker: Worker,
    /// Its best level on the query's node at the last probed position.
    level: Level,
    /// Final scores of the levels below `level`.
    scores: [u32; LEVELS],
}

/// The exact single-threaded positional index with jump search (see the module docs).
#[derive(Debug, Clone)]
pub struct PositionalIndexer {
    arena: Arena,
    ledgers: LedgerSet<u32>,
    jump: usize,
}

impl Default for PositionalIndexer {
    fn default() -> Self {
        Self::with_jump(Self::DEFAULT_JUMP)
    }
}

impl PositionalIndexer {
    /// The default distance between the positions a query probes.
    pub const DEFAULT_JUMP: usize = 32;

    /// An empty index probing every [`Self::DEFAULT_JUMP`] positions.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index probing every `jump` positions (`0` is treated as `1`: a linear walk).
    pub fn with_jump(jump: usize) -> Self {
        Self {
            arena: Arena::default(),
            ledgers: LedgerSet::default(),
            jump: jump.max(1),
        }
    }

    /// The distance between probes.
    pub fn jump(&self) -> usize {
        self.jump
    }

    /// Exact per-level scores of every rank matching the query's first block.
    ///
    /// Levels above `max_level` are not computed (their scores are left at the last computed
    /// level's); a rank leaves the search once its level exceeds `max_level`.
    fn exact_scores(&self, locals: &[LocalBlockHash], max_level: Level) -> Vec<WorkerMatch> {
        if locals.is_empty() {
            return Vec::new();
        }
        let mut query = Query::new(&self.arena, locals);
        let Some(first) = query.node(0) else {
            return Vec::new();
        };
        let mut active: Vec<Active> = first
            .members
            .iter()
            .map(|m| Active {
                worker: m.worker,
                level: m.best_level(),
                scores: [0; LEVELS],
            })
            .filter(|a| a.level <= max_level)
            .collect();
        let mut done: Vec<WorkerMatch> = Vec::new();
        let finish = |a: &Active, end: u32| {
            let mut s = a.scores;
            for score in &mut s[a.level.min(ABSENT) as usize..] {
                *score = end;
            }
            for l in (max_level as usize + 1)..LEVELS {
                s[l] = s[max_level as usize];
            }
            WorkerMatch {
                worker: a.worker,
                device: s[0],
                host: s[1],
                disk: s[2],
            }
        };
        let mut current = 0usize;
        while current + 1 < locals.len() && !active.is_empty() {
            let next = (current + self.jump).min(locals.len() - 1);
            // Both `active` and a node's members are sorted by worker: merge them.
            let members: &[Member] = query.node(next).map_or(&[], |n| &n.members);
            let mut m = 0;
            for a in &mut active {
                while m < members.len() && members[m].worker < a.worker {
                    m += 1;
                }
                let there = match members.get(m) {
                    Some(member) if member.worker == a.worker => member.best_level(),
                    _ => ABSENT,
                };
                if there == a.level {
                    continue;
                }
                // Levels a.level..there end inside (current, next]: find each boundary, the
                // first position whose level exceeds it (g is non-decreasing).
                let mut low = current;
                let top = there.min(max_level + 1);
                for l in a.level..top {
                    let mut high = next;
                    while high - low > 1 {
                        let mid = low + (high - low) / 2;
                        if query.level(mid, a.worker) > l {
                            high = mid;
                        } else {
                            low = mid;
                        }
                    }
                    a.scores[l as usize] = high as u32;
                    // Later levels end no earlier than this one: positions before `high` are
                    // at a level <= l.
                    low = high - 1;
                }
                a.level = there;
            }
            active.retain(|a| {
                if a.level > max_level {
                    done.push(finish(a, 0));
                    false
                } else {
                    true
                }
            });
            current = next;
        }
        let end = (current + 1) as u32;
        done.extend(active.iter().map(|a| finish(a, end)));
        done
    }
}

impl KvIndex for PositionalIndexer {
    fn apply(&mut self, mutation: &Mutation) -> ApplyReport {
        self.ledgers.apply(&mut self.arena, mutation)
    }

    fn remove_worker(&mut self, worker_id: u64) -> ApplyReport {
        self.ledgers.remove_worker(&mut self.arena, worker_id)
    }

    fn clear(&mut self) {
        self.ledgers = LedgerSet::default();
        self.arena = Arena::default();
    }

    fn find_matches(&self, query: &[LocalBlockHash], options: &MatchOptions) -> Matches {
        // Without tiers only the device level is reported: a rank leaves once off the device.
        let max_level = if options.tiered { 2 } else { 0 };
        let mut matches = Matches {
            workers: self.exact_scores(query, max_level),
        };
        matches.finish(options);
        matches
    }

    fn snapshot(&self) -> Snapshot {
        self.ledgers.snapshot(&self.arena)
    }

    fn restore(&mut self, snapshot: &Snapshot) {
        self.clear();
        self.ledgers.restore(&mut self.arena, snapshot);
    }

    fn stats(&self) -> IndexStats {
        self.ledgers.stats(&self.arena)
    }
}

#[cfg(test)]
mod tests {
    use kvatlas_hash::LocalBlockHash;

    use super::*;
    use crate::model::{ExternalBlockHash, StoredBlock, Tier};
    use crate::reference::ReferenceIndex;

    /// Stores `locals` as one chain with engine hashes `base + i` on `tier`.
    fn store(worker: Worker, tier: Tier, base: u64, locals: &[u64]) -> Mutation {
        Mutation::Stored {
            worker,
            tier,
            parent: None,
            blocks: locals
                .iter()
                .enumerate()
                .map(|(i, &l)| StoredBlock {
                    external: ExternalBlockHash::new(base + i as u64),
                    local: LocalBlockHash::new(l),
                })
                .collect(),
        }
    }

    fn remove(worker: Worker, tier: Tier, hashes: &[u64]) -> Mutation {
        Mutation::Removed {
            worker,
            tier,
            blocks: hashes.iter().copied().map(ExternalBlockHash::new).collect(),
        }
    }

    fn query(locals: &[u64]) -> Vec<LocalBlockHash> {
        locals.iter().copied().map(LocalBlockHash::new).collect()
    }

    #[test]
    fn long_chains_diverging_at_137_score_exactly() {
        let (a, b, c) = (Worker::new(1, 0), Worker::new(2, 0), Worker::new(3, 0));
        let chain_a: Vec<u64> = (0..300).collect();
        let chain_b: Vec<u64> = (0..300)
            .map(|i| if i < 137 { i } else { 1000 + i })
            .collect();
        let mutations = [
            // A: all on device, then block 220 moves to host.
            store(a, Tier::Device, 0, &chain_a),
            remove(a, Tier::Device, &[220]),
            store(a, Tier::Host, 0, &chain_a[..221]),
            // B: different engine hashes for the shared 137 blocks; its own branch on disk.
            store(b, Tier::Device, 10_000, &chain_b[..137]),
            Mutation::Stored {
                worker: b,
                tier: Tier::Disk,
                parent: Some(ExternalBlockHash::new(10_136)),
                blocks: (137..300)
                    .map(|i| StoredBlock {
                        external: ExternalBlockHash::new(10_000 + i),
                        local: LocalBlockHash::new(chain_b[i as usize]),
                    })
                    .collect(),
            },
            // C: A's chain with a hole at block 64.
            store(c, Tier::Device, 20_000, &chain_a),
            remove(c, Tier::Device, &[20_064]),
        ];
        let mut index = PositionalIndexer::new();
        assert_eq!(index.jump(), 32);
        let mut oracle = ReferenceIndex::new();
        for m in &mutations {
            assert_eq!(index.apply(m), oracle.apply(m), "{m:?}");
        }
        let tiered = MatchOptions {
            tiered: true,
            ..MatchOptions::default()
        };
        let got = index.find_matches(&query(&chain_a), &tiered);
        let want = |worker, device, host, disk| WorkerMatch {
            worker,
            device,
            host,
            disk,
        };
        assert_eq!(
            got.workers,
            [
                want(a, 220, 300, 300),
                want(b, 137, 137, 137),
                want(c, 64, 64, 64)
            ]
        );
        let got = index.find_matches(&query(&chain_b), &tiered);
        assert_eq!(
            got.workers,
            [
                want(a, 137, 137, 137),
                want(b, 137, 137, 300),
                want(c, 64, 64, 64)
            ]
        );
        let device_only = index.find_matches(&query(&chain_b), &MatchOptions::default());
        assert_eq!(device_only.device_score(b), 137);
        assert_eq!(device_only.get(b).map(|m| m.disk), Some(137));

        // Every jump size and prefix length agrees with the oracle.
        let snapshot = index.snapshot();
        let options = [
            tiered,
            MatchOptions::default(),
            MatchOptions {
                early_exit: true,
                ..MatchOptions::default()
            },
        ];
        for jump in [1, 2, 7, 32, 137, 300, 1000] {
            let mut other = PositionalIndexer::with_jump(jump);
            other.restore(&snapshot);
            for chain in [&chain_a, &chain_b] {
                for len in [0, 1, 2, 63, 64, 65, 136, 137, 138, 220, 221, 299, 300] {
                    let q = query(&chain[..len]);
                    for o in &options {
                        assert_eq!(
                            other.find_matches(&q, o),
                            oracle.find_matches(&q, o),
                            "jump {jump}, len {len}, {o:?}"
                        );
                    }
                }
            }
        }

        // Dropping everything frees every node.
        assert_eq!(index.remove_worker(1), oracle.remove_worker(1));
        index.apply(&Mutation::Cleared { worker: b });
        index.apply(&Mutation::Cleared { worker: c });
        assert!(index.arena.cells.is_empty());
        assert_eq!(index.arena.free.len(), index.arena.nodes.len());
    }
}
