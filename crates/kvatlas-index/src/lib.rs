//! kvatlas's KV-block index: which worker rank holds which KV block on which tier, and for a
//! query (a prompt's local block hashes) how many leading blocks each rank holds.
//!
//! Exactness is the contract, under every order of events engines produce (holes from head-first
//! eviction, duplicates, unknown removes, unknown parents, clears, different engine hashes for the
//! same tokens); `docs/index.md` defines the scores. Every backend implements [`KvIndex`] (or
//! [`SharedKvIndex`] for concurrent use) and is tested against [`ReferenceIndex`], the naive
//! model.
//!
//! Which to use: [`Atlas`] (the default backend) when one thread owns the index;
//! [`ConcurrentAtlas`] when queries run while events are applied — usually behind a [`ThreadPool`]
//! that applies each rank's events in order on a writer thread while callers query inline. The
//! other designs kvatlas measured (a radix tree, positional indexes, a lock-per-node concurrent
//! tree, lock and left-right fronts) live in [`baseline`]; [`ReferenceIndex`] is the naive model
//! every backend is tested against.
//!
//! This crate is pure data structures: no sockets, files, clocks or async runtime.

// `unsafe` is allowed in one place only: `tag_table`'s SSE2 lane compare and cache prefetch, each
// block with its `// SAFETY:` argument.
#![deny(unsafe_code)]
#![deny(missing_docs)]

mod atlas;
mod backend;
mod concurrent_radix;
mod ledger;
mod left_right;
mod locked;
mod model;
mod pool;
mod positional;
mod positional_tree;
mod radix;
mod reference;
mod run_ledger;
mod slot_table;
mod snapshot;
mod sync;
mod tag_table;

pub mod baseline;

pub use atlas::{Atlas, ConcurrentAtlas, Eviction};
pub use backend::{Exclusive, KvIndex, SharedKvIndex};
pub use model::{
    ApplyReport, Checkpoint, ExternalBlockHash, IndexStats, MatchOptions, Matches, Mutation,
    StoredBlock, Tier, TierSet, Unit, Worker, WorkerBlocks, WorkerMatch,
};
#[cfg(loom)]
#[doc(hidden)]
pub use pool::LoomRoom;
pub use pool::{DelayObserver, EnqueueError, ThreadPool, UnitDelay};
pub use reference::ReferenceIndex;
pub use snapshot::{Snapshot, SnapshotBlock, WorkerSnapshot};

/// Kept at the root, out of the docs, for an external harness that runs Dynamo's kv-router
/// beside kvatlas in one process and names the type here; new code uses
/// [`baseline::ConcurrentRadixTree`].
#[doc(hidden)]
pub use baseline::ConcurrentRadixTree;
