//! The designs kvatlas measured on its way to [`crate::Atlas`], kept as baselines.
//!
//! Every one is exact (the same ledger contract, the same differential tests against
//! [`crate::ReferenceIndex`]) and every one is still measured by the bench (`cargo xtask bench
//! --backends radix,positional,crtc,...`), so a change to the default can be checked against
//! the roads not taken. A router does not need them: use [`crate::Atlas`] when one thread owns
//! the index, [`crate::ConcurrentAtlas`] behind a [`crate::ThreadPool`] when queries and events
//! run at once.
//!
//! - Backends: [`RadixTree`] (a tree of blocks, Dynamo's first design), [`PositionalIndexer`]
//!   (a flat map of (position, local hash), Dynamo's positional indexer), [`PositionalRadixTree`]
//!   (a tree keyed by position), [`ConcurrentRadixTree`] (per-node locks, Dynamo's CRTC, made
//!   exact by a ledger);
//! - fronts that make any single-owner backend shareable: [`Locked`] (a reader-writer lock) and
//!   [`LeftRight`] (two copies and an operation log).
//!
//! `docs/index.md` ("Backends") says how each works and why Atlas is the default.

pub use crate::concurrent_radix::ConcurrentRadixTree;
pub use crate::left_right::LeftRight;
pub use crate::locked::Locked;
pub use crate::positional::PositionalIndexer;
pub use crate::positional_tree::PositionalRadixTree;
pub use crate::radix::RadixTree;
