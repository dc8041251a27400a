//! Backend-independent snapshots: every held block of every worker rank, with its parent link and
//! tiers. Restoring one into any backend yields an index that answers every query, and reacts to
//! every later mutation, exactly like the index it was taken from.

use kvatlas_hash::LocalBlockHash;

use crate::model::{ExternalBlockHash, TierSet, Worker};

/// One held block in a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SnapshotBlock {
    /// The engine's hash.
    pub external: ExternalBlockHash,
    /// The local (token) hash.
    pub local: LocalBlockHash,
    /// The parent's engine hash (`None` = first block of a sequence). The parent need not be
    /// held: holes and dangling chains are part of the state.
    pub parent: Option<ExternalBlockHash>,
    /// The tiers the block is held on (never empty).
    pub tiers: TierSet,
}

/// One worker rank's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSnapshot {
    /// The worker rank.
    pub worker: Worker,
    /// Its held blocks, sorted by engine hash.
    pub blocks: Vec<SnapshotBlock>,
}

/// A consistent cut of an index: per worker rank, its state between two of its mutations.
///
/// Worker ranks are independent (no mutation involves two of them), so per-rank atomic copies
/// taken at different instants still form a state the index could have been in.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// Per worker rank with at least one block, sorted by worker.
    pub workers: Vec<WorkerSnapshot>,
}

impl Snapshot {
    /// Total held (worker, block) pairs.
    pub fn blocks(&self) -> usize {
        self.workers.iter().map(|w| w.blocks.len()).sum()
    }
}
