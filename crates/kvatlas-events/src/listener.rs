//! The socket edge: ZMQ listeners that feed the sans-IO core and hand mutations to an index.
//!
//! This is the only module of the crate that performs I/O (sockets, threads, clocks). One
//! [`Listener`] serves one registered source (one engine publisher: a worker's data-parallel
//! rank) on a poller thread that serves many ([`ListenerThreads`]):
//!
//! ```text
//!  engine PUB ──► SUB (connect, or bind) ──frames──► Sequencer ──Apply──► decode + convert
//!  engine ROUTER ◄──► DEALER (one per replay) ──┘         │ Resync → Mutation::Cleared
//!                                                        ▼
//!              MutationSink::try_push(Unit: a batch's mutations + its checkpoint)
//!                                     (bounded; full → wait = backpressure)
//! ```
//!
//! - **Poller threads**: a [`ListenerThreads`] set (one thread by default) watches every
//!   listener's SUB (and, while a replay is outstanding, its DEALER) with one epoll, and
//!   reads each signalled socket in turn: a burst of batches from many engines wakes one
//!   thread, not one per engine. A stop or release wakes the thread at once; otherwise it wakes at the
//!   listeners' deadlines (replays, probes) or after [`ListenerOptions::recv_timeout`]. A
//!   panic in one listener's code fails that listener only.
//! - **Replay**: an [`Action::Replay`] opens a fresh DEALER to the replay endpoint, sends
//!   `[b"", start_be8]` and feeds every reply (2-, 3- or 4-frame layouts) to the sequencer until
//!   the end marker. No reply for [`ListenerOptions::replay_timeout`] (the loop gives the
//!   sequencer each request's deadline, sleeps until [`Sequencer::poll_timeout`] at the latest
//!   and reports the time with [`Sequencer::handle_timeout`]), a socket error, or no replay
//!   endpoint at all → the replay fails → resync. Live batches keep arriving meanwhile and are
//!   buffered by the sequencer (bounded).
//! - **Resync** ([`Action::Resync`]) → a [`Mutation::Cleared`] for every rank the source has fed,
//!   counted and logged (`tracing`, target `kvatlas_events::listener`). A source feeds at most
//!   [`MAX_RANKS_PER_SOURCE`] ranks, so every one is remembered; a batch of a further rank is
//!   dropped and counted. A resumed listener is told the ranks fed before ([`Resume::ranks`]).
//! - **Units and checkpoints**: each applied batch goes to the sink as one [`Unit`] — its
//!   mutations and a [`Checkpoint`] (the source's rank, the batch's sequence number and
//!   fingerprint) — so an index that records checkpoints pairs its snapshots exactly with the
//!   batches they hold.
//! - **Resume and hold**: a listener can continue a stream applied elsewhere
//!   ([`ListenerConfig::resume`]: a restored snapshot's checkpoint), and can start *held*
//!   ([`ListenerConfig::hold`]): it receives and buffers live batches (bounded) but applies nothing
//!   until [`Listener::release`] gives it the position to continue from — how a new replica
//!   subscribes first, restores a peer's snapshot, then applies exactly what follows it.
//! - **Backpressure**: mutations go to a [`MutationSink`] (for example a
//!   [`kvatlas_index::ThreadPool`], whose lanes are bounded). A full lane makes the listener
//!   wait (counted in [`ListenerCounters::backpressure_waits`]); it stops reading its socket,
//!   the SUB's receive high-water mark fills and libzmq drops live messages, which the sequencer
//!   sees as a gap: replay, and if the engine's ring no longer holds the batches, a counted
//!   resync. Memory never grows without bound.
//!
//! [`Listeners`] is the registry a server drives: start, stop, state, list.
//!
//! Files: `config` (what a listener is started with, and its validation), `status` (its id,
//! status, counters and state, and the atomics behind them), `error`, `sink` (where mutations
//! go), `lifecycle` ([`Listener`]: socket setup, start, state and stop), `event_loop` (one
//! listener's sockets and state: replays, sequencer, sink), `poller` ([`ListenerThreads`]: the
//! threads that poll many listeners) and `registry` ([`Listeners`]).
//!
//! [`Action::Replay`]: crate::sequence::Action::Replay
//! [`Action::Resync`]: crate::sequence::Action::Resync
//! [`Sequencer::poll_timeout`]: crate::sequence::Sequencer::poll_timeout
//! [`Sequencer::handle_timeout`]: crate::sequence::Sequencer::handle_timeout
//! [`Mutation::Cleared`]: kvatlas_index::Mutation::Cleared
//! [`Unit`]: kvatlas_index::Unit
//! [`Checkpoint`]: kvatlas_index::Checkpoint

mod config;
mod error;
mod event_loop;
mod lifecycle;
mod poller;
mod registry;
mod sink;
mod status;

pub use config::{ListenerConfig, ListenerOptions, Resume, SocketMode};
pub use error::ListenerError;
pub use event_loop::MAX_RANKS_PER_SOURCE;
pub use lifecycle::Listener;
pub use poller::ListenerThreads;
pub use registry::Listeners;
pub use sink::{ApplyInline, MutationSink, SinkError};
pub use status::{ListenerCounters, ListenerId, ListenerState, ListenerStatus};
