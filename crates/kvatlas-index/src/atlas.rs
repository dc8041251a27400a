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
//! kept by a [`RunLedger`](crate::run_ledger::RunLedger): per block only its engine hash and a table entry, everything else per
//! run of consecutive blocks (a run's blocks sit at consecutive offsets of one edge, so one
//! `(edge, offset)` names them all).

//!
//! # Files
//!
//! - `forest.rs`: edges, branches, covers, and the forest's recorded operations;
//! - `spans.rs`: span arithmetic (exact per-level counts when a rank holds a position twice);
//! - `sink.rs`: the ledger's membership sink into the forest;
//! - `query.rs`: the query walk;
//! - `books.rs`: the writer-only books (per rank its ledger) and how mutations reach the forest;
//! - `capacity.rs`: the optional capacity bound and its evictions;
//! - `concurrent.rs`: [`ConcurrentAtlas`], one set of books over two forests.

use kvatlas_hash::LocalBlockHash;

use crate::backend::KvIndex;
use crate::model::{ApplyReport, IndexStats, MatchOptions, Matches, Mutation};
use crate::snapshot::Snapshot;

mod books;
mod capacity;
mod concurrent;
mod forest;
mod query;
mod sink;
mod spans;

use books::Books;
pub use capacity::Eviction;
pub use concurrent::ConcurrentAtlas;
use forest::{Forest, ForestOp};

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

    /// The evictions since the previous call (empty without a capacity bound), the newest
    /// ones: at most twice the capacity (within 1,024 and 2^20) are kept between calls, so a
    /// caller that counts evictions from the [`ApplyReport`]s need never call this.
    pub fn take_evictions(&mut self) -> Vec<Eviction> {
        self.books.take_evictions()
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
mod tests;
