//! Why a listener could not be started, stopped or found: [`ListenerError`].

use super::ListenerId;

/// Why a listener could not be started, stopped or found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ListenerError {
    /// The endpoint was rejected by libzmq (bad syntax, unknown transport, unresolvable
    /// interface, address in use when binding).
    #[error("endpoint {endpoint:?} rejected: {source}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// libzmq's error.
        #[source]
        source: zmq::Error,
    },
    /// Creating or configuring a socket failed.
    #[error("socket setup ({what}) failed: {source}")]
    Socket {
        /// The failing step.
        what: &'static str,
        /// libzmq's error.
        #[source]
        source: zmq::Error,
    },
    /// An option is out of range.
    #[error("invalid option {name}: {reason}")]
    InvalidOption {
        /// The option.
        name: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// Another running listener already feeds this worker rank (two writers would interleave
    /// its mutations).
    #[error("listener {existing} already serves worker {worker_id} rank {dp_rank}")]
    DuplicateSource {
        /// The worker.
        worker_id: u64,
        /// The rank.
        dp_rank: u32,
        /// The listener serving it.
        existing: ListenerId,
    },
    /// No listener with this id.
    #[error("no listener {0}")]
    UnknownListener(ListenerId),
    /// The OS refused to start the listener thread.
    #[error("cannot start the listener thread: {0}")]
    Spawn(#[source] std::io::Error),
}
