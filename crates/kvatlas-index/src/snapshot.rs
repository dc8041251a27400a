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

    /// A 64-bit digest of the state, for comparing replicas or checking a state after a
    /// restart: equal snapshots have equal digests, and a difference in any worker, block,
    /// parent link or tier changes it with overwhelming probability (not cryptographic).
    pub fn digest(&self) -> u64 {
        /// The splitmix64 finalizer: a bijection with good avalanche.
        const fn mix(x: u64) -> u64 {
            let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        let mut state = mix(self.workers.len() as u64);
        let mut add = |value: u64| state = mix(state ^ value).wrapping_add(state.rotate_left(17));
        for worker in &self.workers {
            add(worker.worker.worker_id);
            add(u64::from(worker.worker.dp_rank));
            add(worker.blocks.len() as u64);
            for block in &worker.blocks {
                add(block.external.get());
                add(block.local.get());
                add(block.parent.map_or(0, |p| p.get()));
                add(u64::from(block.parent.is_some()) | u64::from(block.tiers.bits()) << 1);
            }
        }
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(external: u64, parent: Option<u64>, tiers: u8) -> SnapshotBlock {
        SnapshotBlock {
            external: ExternalBlockHash::new(external),
            local: LocalBlockHash::new(external * 7),
            parent: parent.map(ExternalBlockHash::new),
            tiers: TierSet::from_bits(tiers),
        }
    }

    #[test]
    fn digests_tell_states_apart() {
        let snapshot = |blocks: Vec<SnapshotBlock>| Snapshot {
            workers: vec![WorkerSnapshot {
                worker: Worker::new(1, 0),
                blocks,
            }],
        };
        let base = snapshot(vec![block(1, None, 1), block(2, Some(1), 1)]);
        assert_eq!(base.digest(), base.clone().digest());
        let variants = [
            snapshot(vec![block(1, None, 1)]),
            snapshot(vec![block(1, None, 1), block(2, Some(1), 3)]),
            snapshot(vec![block(1, None, 1), block(2, None, 1)]),
            snapshot(vec![block(1, None, 1), block(2, Some(0), 1)]),
            Snapshot::default(),
        ];
        for variant in variants {
            assert_ne!(base.digest(), variant.digest(), "{variant:?}");
        }
        let mut other_rank = base.clone();
        other_rank.workers[0].worker = Worker::new(1, 1);
        assert_ne!(base.digest(), other_rank.digest());
    }
}
