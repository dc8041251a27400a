//! kvatlas's KV-event ingestion: from an engine's ZMQ stream of msgpack batches to index
//! mutations.
//!
//! vLLM and SGLang publish their KV-cache changes as numbered msgpack batches over ZMQ.
//! `docs/events.md` in the repository says what kvatlas accepts, indexes and drops, and its §7
//! summarises the engines' wire formats. The crate is a sans-IO core plus one socket edge:
//!
//! | Module | Does |
//! |---|---|
//! | [`decode`] | payload bytes → [`EventBatch`]: every layout and version (positional arrays, tagged maps, 2/3-element and map batches), tolerantly — a bad event is skipped and counted, never the batch |
//! | [`convert`] | [`EventBatch`] → [`kvatlas_index::Mutation`]s for a registered [`Source`]: medium → tier, group/kind/locality filters, block-size checks, local hashes recomputed from tokens with `kvatlas-hash` (LoRA and salt mixed in as a router query does) |
//! | [`sequence`] | per-source ordering: gaps → replay requests, duplicates, restarts and incomplete replays → resync; a sans-IO state machine in the style of `quinn-proto` |
//! | [`frames`] | the ZMQ multipart layouts of live messages and replay replies |
//! | [`counters`] | [`Reason`] and [`DropCounters`]: every dropped event is counted by reason |
//! | `listener` | **the I/O edge** (feature `listener`, on by default): a ZMQ SUB per source (connect or bind) and a DEALER for replays, polled with many others by a few poller threads (`ListenerThreads`), driving the sequencer and handing mutations to a bounded `MutationSink` (a [`kvatlas_index::ThreadPool`]); the `Listeners` registry (start / stop / state / list) |
//!
//! ```
//! use kvatlas_events::{Converter, DropCounters, EngineKind, Source};
//! use kvatlas_hash::BlockSize;
//! use kvatlas_index::Mutation;
//!
//! // `[ts, [["AllBlocksCleared"]], 0]`
//! let payload = b"\x93\xcb\x41\xda\xc0\x97\x99\x4e\x46\x9a\x91\x91\xb0AllBlocksCleared\x00";
//! let converter = Converter::new(Source {
//!     worker_id: 7,
//!     dp_rank: 0,
//!     block_size: BlockSize::new(16)?,
//!     engine: EngineKind::Vllm,
//! });
//! let (mut mutations, mut drops) = (Vec::new(), DropCounters::new());
//! converter.ingest(payload, &mut mutations, &mut drops)?;
//! assert!(matches!(mutations[..], [Mutation::Cleared { .. }]));
//! assert_eq!(drops.total(), 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Only `listener` opens sockets, spawns threads or reads the clock; `decode`, `convert`,
//! `sequence`, `frames` and `counters` take bytes and return values or actions, and own no
//! index. The crate never depends on tokio, tonic, prost or hyper (checked by
//! `cargo xtask tidy`): the listener uses the blocking `zmq` crate (bundled libzmq) on plain
//! threads. Nothing in it panics on wire input, and memory stays bounded: a length header
//! drives at most [`decode::MAX_PREALLOC_BYTES`] of preallocation in the general decoder, and
//! at most 4 (token ids) or 8 (hashes) bytes per remaining input byte in the fast paths (a
//! header claiming more elements than bytes remain is refused), and the listener's queues (SUB
//! high-water mark, sequencer buffer, sink lanes) are all bounded.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod convert;
pub mod counters;
pub mod decode;
pub mod frames;
#[cfg(feature = "listener")]
pub mod listener;
pub mod sequence;

pub use convert::{Converter, EngineKind, Source, tier_for_medium};
pub use counters::{DropCounters, Reason};
pub use decode::{
    BlockRemoved, BlockStored, DecodeError, Event, EventBatch, MAX_EVENT_AGE, MAX_SKIPPED_KEPT,
    MsgpackError, SaltSource, SkippedEvent, decode_batch, instant_of_wall_clock,
};
pub use frames::{FrameError, LiveMessage, ReplayReply, decode_live_message, decode_replay_reply};
#[cfg(feature = "listener")]
pub use listener::{
    ApplyInline, Listener, ListenerConfig, ListenerCounters, ListenerError, ListenerId,
    ListenerOptions, ListenerState, ListenerStatus, ListenerThreads, Listeners,
    MAX_RANKS_PER_SOURCE, MutationSink, Resume, SinkError, SocketMode,
};
pub use sequence::{Action, ReplayId, ResyncReason, SequenceCounters, Sequencer, SequencerConfig};
