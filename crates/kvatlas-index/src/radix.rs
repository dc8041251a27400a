//! `RadixTree`: a single-threaded radix tree of blocks, the structure of NVIDIA Dynamo's
//! single-threaded indexer, made exact.
//!
//! One node per local-hash path from the root; children keyed by local hash; each node lists the
//! worker ranks with a rooted block there and how many at each level. A query walks the tree
//! from the root, dropping each worker at the first node where it is not a member: `O(D × W)`.

use kvatlas_hash::LocalBlockHash;
use rustc_hash::FxHashMap;

use crate::backend::KvIndex;
use crate::ledger::{LedgerSet, Membership, Structure};
use crate::model::{
    ApplyReport, IndexStats, LEVELS, Level, MatchOptions, Matches, Mutation, Worker, WorkerMatch,
    table_bytes,
};
use crate::snapshot::Snapshot;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Member {
    worker: Worker,
    /// Rooted blocks of this worker at the node, per level.
    counts: [u32; LEVELS],
}

impl Member {
    /// The best (lowest) level with a rooted block, if any.
    fn best_level(&self) -> Option<usize> {
        self.counts.iter().position(|&c| c > 0)
    }
}

#[derive(Debug, Clone)]
struct Node {
    local: LocalBlockHash,
    parent: u32,
    children: FxHashMap<LocalBlockHash, u32>,
    members: Vec<Member>,
}

/// Node storage shared by all workers' ledgers.
#[derive(Debug, Clone, Default)]
struct Arena {
    nodes: Vec<Node>,
    free: Vec<u32>,
    roots: FxHashMap<LocalBlockHash, u32>,
}

impl Arena {
    fn children_of(&mut self, parent: u32) -> &mut FxHashMap<LocalBlockHash, u32> {
        if parent == NIL {
            &mut self.roots
        } else {
            &mut self.nodes[parent as usize].children
        }
    }

    /// Frees `node` and then its ancestors while they have neither members nor children.
    fn collect(&mut self, mut node: u32) {
        while node != NIL {
            let n = &self.nodes[node as usize];
            if !n.members.is_empty() || !n.children.is_empty() {
                return;
            }
            let (parent, local) = (n.parent, n.local);
            self.children_of(parent).remove(&local);
            self.nodes[node as usize].children = FxHashMap::default();
            self.free.push(node);
            node = parent;
        }
    }

    fn heap_bytes(&self) -> u64 {
        let child_entry = std::mem::size_of::<(LocalBlockHash, u32)>();
        let per_node: usize = self
            .nodes
            .iter()
            .map(|n| {
                table_bytes(n.children.capacity(), child_entry)
                    + n.members.capacity() * std::mem::size_of::<Member>()
            })
            .sum();
        (self.nodes.capacity() * std::mem::size_of::<Node>()
            + per_node
            + table_bytes(self.roots.capacity(), child_entry)
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
        let parent = parent.unwrap_or(NIL);
        if let Some(&node) = self.arena.children_of(parent).get(&local) {
            return node;
        }
        let node = Node {
            local,
            parent,
            children: FxHashMap::default(),
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
        self.arena.children_of(parent).insert(local, id);
        id
    }

    fn local(&self, node: u32) -> LocalBlockHash {
        self.arena.nodes[node as usize].local
    }

    fn add(&mut self, node: u32, level: Level) {
        let members = &mut self.arena.nodes[node as usize].members;
        match members.iter_mut().find(|m| m.worker == self.worker) {
            Some(m) => m.counts[level as usize] += 1,
            None => {
                let mut counts = [0; LEVELS];
                counts[level as usize] = 1;
                members.push(Member {
                    worker: self.worker,
                    counts,
                });
            }
        }
    }

    fn remove(&mut self, node: u32, level: Level) {
        let members = &mut self.arena.nodes[node as usize].members;
        if let Some(i) = members.iter().position(|m| m.worker == self.worker) {
            members[i].counts[level as usize] -= 1;
            if members[i].counts.iter().all(|&c| c == 0) {
                members.swap_remove(i);
            }
        }
        self.arena.collect(node);
    }
}

/// The exact single-threaded radix tree (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct RadixTree {
    arena: Arena,
    ledgers: LedgerSet<u32>,
}

impl RadixTree {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }
}

impl KvIndex for RadixTree {
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
        // Per active worker: its matched depth at each level, and the levels still matching.
        let mut active: Vec<(Worker, [u32; LEVELS], usize)> = Vec::new();
        let mut done: Vec<WorkerMatch> = Vec::new();
        let mut children = &self.arena.roots;
        for (position, local) in query.iter().enumerate() {
            let Some(&node) = children.get(local) else {
                break;
            };
            let node = &self.arena.nodes[node as usize];
            if position == 0 {
                for m in &node.members {
                    if let Some(best) = m.best_level() {
                        active.push((m.worker, [0; LEVELS], best));
                    }
                }
            }
            let depth = position as u32 + 1;
            active.retain_mut(|(worker, scores, best)| {
                // Levels at or above the worker's best level at this node still match.
                let here = node
                    .members
                    .iter()
                    .find(|m| m.worker == *worker)
                    .and_then(Member::best_level);
                match here {
                    Some(level) => {
                        *best = (*best).max(level);
                        for score in &mut scores[*best..] {
                            *score = depth;
                        }
                        true
                    }
                    None => {
                        done.push(WorkerMatch {
                            worker: *worker,
                            device: scores[0],
                            host: scores[1],
                            disk: scores[2],
                        });
                        false
                    }
                }
            });
            if active.is_empty() {
                break;
            }
            children = &node.children;
        }
        done.extend(active.into_iter().map(|(worker, s, _)| WorkerMatch {
            worker,
            device: s[0],
            host: s[1],
            disk: s[2],
        }));
        let mut matches = Matches { workers: done };
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
