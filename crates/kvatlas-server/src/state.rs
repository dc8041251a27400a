//! The state every request handler shares: the registry, the metrics, the limits, the tokens,
//! the startup gate and the shutdown signal.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio_util::sync::CancellationToken;

use crate::auth::{Caller, RequestQuota, TokenFile};
use crate::config::Limits;
use crate::error::ServiceError;
use crate::metrics::{Metrics, Rpc};
use crate::places::Places;
use crate::registry::Registry;
use crate::snapshot_stream::Held;

/// Reads of the whole state (`/dump`, `/snapshot`, the `Snapshot` RPC) allowed at once: each
/// holds images of the indexes it reads until its answer is written, so their number, not only
/// their size, bounds the memory they take.
pub(crate) const MAX_CONCURRENT_DUMPS: usize = 2;

/// Shared by every handler of one server.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) registry: Arc<Registry>,
    pub(crate) metrics: Metrics,
    pub(crate) limits: Limits,
    /// `None` = no authentication.
    pub(crate) tokens: Option<TokenFile>,
    /// Registered ranks needed before queries are answered.
    pub(crate) min_initial_workers: usize,
    gate_open: AtomicBool,
    shutting_down: AtomicBool,
    /// Cancelled when a graceful shutdown starts: streams stop reading and answer.
    pub(crate) shutdown: CancellationToken,
    next_stream: AtomicU64,
    /// Peer URLs (`--peers`, `/register_peer`): where a bootstrap looks for a snapshot.
    pub(crate) peers: parking_lot::Mutex<std::collections::BTreeSet<String>>,
    /// While a bootstrap from a peer runs, queries are refused (the state is not complete).
    bootstrapping: AtomicBool,
    /// Whole-state reads running (at most [`MAX_CONCURRENT_DUMPS`]).
    dumps: Places,
    /// `PublishEvents` batches admitted whose unit or record waited for room in a task of its
    /// own: a call cut by the shutdown leaves it running, and the shutdown waits for it before
    /// its final report and the log's drain.
    pub(crate) admitted_batches: tokio_util::task::TaskTracker,
    /// `--allow-unauthenticated`: without tokens, a registration over the API may still bind
    /// beyond loopback.
    pub(crate) allow_unauthenticated: bool,
}

/// How many bytes of memory a request message may take once decoded (its lists counted at their
/// length), per byte of the message size limit: 16. That is twice what a list of one-byte
/// `uint64`s takes (8, plus the message's own struct), and above the densest event an engine
/// sends (a removal of one 64-bit hash: 152 bytes in memory for the 15–16 bytes on the wire of
/// almost every hash, about 10 per byte), so no message of integer lists or ordinary events is
/// refused for it, whatever its size; a flood of near-empty list elements is (an empty
/// `KvEvent`: 72 per byte).
pub(crate) const DECODED_BYTES_PER_MESSAGE_BYTE: usize = 16;

impl State {
    /// A server's shared state. It raises the process-wide token-id bound to
    /// `limits.max_query_tokens` (`kvatlas_proto::codec::bound_token_ids`) and the decoded-size
    /// bound to [`DECODED_BYTES_PER_MESSAGE_BYTE`] × `limits.max_message_bytes`
    /// (`kvatlas_proto::codec::bound_decoded_size`), for good: a server that then fails to start
    /// leaves them raised, which only lets a later server's over-limit requests be held longer
    /// before they are refused. Servers of one process with different limits share the highest.
    pub(crate) fn new(
        registry: Arc<Registry>,
        limits: Limits,
        tokens: Option<TokenFile>,
        min_initial_workers: usize,
    ) -> Self {
        // A query's ids over the limit are kept only up to the limit + 1, then refused (by the
        // gRPC codec and the JSON query routes): decoded whole, each byte of a packed id became
        // four of memory, and each of a JSON list up to four.
        kvatlas_proto::codec::bound_token_ids(limits.max_query_tokens);
        // A request's decoded form is held to 16 bytes per byte of the message limit: a list of
        // empty messages took 72 per byte.
        kvatlas_proto::codec::bound_decoded_size(
            limits
                .max_message_bytes
                .saturating_mul(DECODED_BYTES_PER_MESSAGE_BYTE),
        );
        Self {
            registry,
            metrics: Metrics::default(),
            limits,
            tokens,
            min_initial_workers,
            gate_open: AtomicBool::new(false),
            shutting_down: AtomicBool::new(false),
            shutdown: CancellationToken::new(),
            next_stream: AtomicU64::new(1),
            peers: parking_lot::Mutex::new(std::collections::BTreeSet::new()),
            bootstrapping: AtomicBool::new(false),
            dumps: Places::default(),
            admitted_batches: tokio_util::task::TaskTracker::new(),
            allow_unauthenticated: false,
        }
    }

    /// The state with `--allow-unauthenticated` as `allow`.
    pub(crate) fn allowing_unauthenticated(mut self, allow: bool) -> Self {
        self.allow_unauthenticated = allow;
        self
    }

    /// A place among the whole-state reads (`what` names the request for the error), for a
    /// state that can be read whole ([`State::check_snapshot_ready`]), held with the
    /// request's own place (`request`) by whoever writes the answer.
    ///
    /// # Errors
    /// RESOURCE_EXHAUSTED while [`MAX_CONCURRENT_DUMPS`] of them run; what
    /// [`State::check_snapshot_ready`] answers.
    pub(crate) fn admit_dump(
        self: &Arc<Self>,
        what: &str,
        request: Option<Permit>,
    ) -> Result<Held, ServiceError> {
        if !self.dumps.take(MAX_CONCURRENT_DUMPS) {
            return Err(ServiceError::ResourceExhausted(format!(
                "{what}: {MAX_CONCURRENT_DUMPS} reads of the whole state (/dump, /snapshot, \
                 Snapshot) are already running; retry when they finish"
            )));
        }
        let permit = DumpPermit {
            state: Arc::clone(self),
        };
        self.check_snapshot_ready()?;
        Ok(Held {
            dump: permit,
            request,
        })
    }

    /// Whether a bootstrap from a peer runs.
    pub(crate) fn bootstrapping(&self) -> bool {
        self.bootstrapping.load(Ordering::Acquire)
    }

    /// Marks the start or the end of a bootstrap from a peer.
    pub(crate) fn set_bootstrapping(&self, on: bool) {
        self.bootstrapping.store(on, Ordering::Release);
    }

    /// UNAVAILABLE while the server restores a peer's or the event log's snapshot: a
    /// registration, an unregistration or a published batch applied now would be overwritten by
    /// the restore (and a new listener's position would have moved past what it applied), so it
    /// is refused, to retry once the server is ready. A replica's refusal of feeds
    /// (FAILED_PRECONDITION) comes first.
    pub(crate) fn check_writable(&self) -> Result<(), ServiceError> {
        self.registry.check_feeds_allowed()?;
        if self.bootstrapping.load(Ordering::Acquire) {
            return Err(ServiceError::Unavailable(
                "not ready: restoring the index from a snapshot; registrations, \
                 unregistrations and published events are refused until it is restored (they \
                 would be overwritten): retry"
                    .into(),
            ));
        }
        Ok(())
    }

    /// UNAVAILABLE while a snapshot would be incomplete or cut short: during a bootstrap from a
    /// peer and once a shutdown started (the startup gate does not matter: the state is whole);
    /// FAILED_PRECONDITION on a publish-only ingest, which holds no index.
    pub(crate) fn check_snapshot_ready(&self) -> Result<(), ServiceError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ServiceError::Unavailable(
                "the server is shutting down".into(),
            ));
        }
        if self.bootstrapping.load(Ordering::Acquire) {
            return Err(ServiceError::Unavailable(
                "not ready: restoring the index from a peer's snapshot".into(),
            ));
        }
        if self.registry.publish_only() {
            return Err(ServiceError::FailedPrecondition(
                "this server is a publish-only ingest (--publish-only): it keeps no index to \
                 snapshot; a replica's snapshots are in the NATS object store"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Opens the startup gate once enough ranks are registered; `true` if it is open.
    pub(crate) fn update_gate(&self) -> bool {
        if self.gate_open.load(Ordering::Acquire) {
            return true;
        }
        if self.registry.registered_ranks() >= self.min_initial_workers {
            if !self.gate_open.swap(true, Ordering::AcqRel) {
                tracing::info!(
                    registered = self.registry.registered_ranks(),
                    "startup gate open: serving queries"
                );
            }
            return true;
        }
        false
    }

    /// Whether queries are answered: the gate is open, no bootstrap runs, no shutdown started.
    pub(crate) fn ready(&self) -> bool {
        !self.shutting_down.load(Ordering::Acquire)
            && !self.bootstrapping.load(Ordering::Acquire)
            && self.update_gate()
    }

    /// UNAVAILABLE with the reason unless [`State::ready`].
    pub(crate) fn check_ready(&self) -> Result<(), ServiceError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(ServiceError::Unavailable(
                "the server is shutting down".into(),
            ));
        }
        if self.bootstrapping.load(Ordering::Acquire) {
            return Err(ServiceError::Unavailable(
                "not ready: restoring the index from a peer's snapshot".into(),
            ));
        }
        if !self.update_gate() {
            return Err(ServiceError::Unavailable(format!(
                "not ready: {} of the {} worker ranks the startup gate waits for are registered \
                 (--min-initial-workers)",
                self.registry.registered_ranks(),
                self.min_initial_workers
            )));
        }
        Ok(())
    }

    /// Marks the start of a graceful shutdown.
    pub(crate) fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        self.shutdown.cancel();
    }

    /// The caller of a request's `authorization` header (gRPC metadata or HTTP); a header
    /// that is not visible ASCII is refused as such (it was taken for a missing one).
    pub(crate) fn authenticate(
        &self,
        header: Option<&tonic::codegen::http::HeaderValue>,
    ) -> Result<Caller, ServiceError> {
        let Some(tokens) = &self.tokens else {
            return Ok(Caller::anonymous());
        };
        let text = match header.map(|value| value.to_str()) {
            None => Ok(None),
            Some(Ok(text)) => Ok(Some(text)),
            Some(Err(_)) => Err(ServiceError::Unauthenticated(
                "the authorization header holds bytes that are not visible ASCII: send \
                 `authorization: Bearer <token>` with the token as the token file has it"
                    .into(),
            )),
        };
        text.and_then(|text| tokens.authorize_header(text))
            .inspect_err(|_| {
                self.metrics.auth_failure();
            })
    }

    /// For an open stream, at its start and whenever the tokens in force change: `caller`
    /// rechecked ([`State::recheck`]), and what is cancelled at the next change
    /// ([`crate::auth::TokenFile::changes`]; never without tokens). Taken before the recheck,
    /// so a change in between is seen by one or the other.
    ///
    /// # Errors
    /// UNAUTHENTICATED once the caller's token was revoked.
    pub(crate) fn watch_tokens(
        &self,
        caller: &mut Caller,
    ) -> Result<tokio_util::sync::CancellationToken, ServiceError> {
        let changes = self.tokens.as_ref().map_or_else(
            // No tokens, no change: never cancelled.
            tokio_util::sync::CancellationToken::new,
            TokenFile::changes,
        );
        self.recheck(caller)?;
        Ok(changes)
    }

    /// For a stream's next message, or a change of the tokens: its caller as the tokens in
    /// force now have it ([`crate::auth::TokenFile::recheck`]).
    ///
    /// # Errors
    /// UNAUTHENTICATED once its token was revoked.
    pub(crate) fn recheck(&self, caller: &mut Caller) -> Result<(), ServiceError> {
        match &self.tokens {
            None => Ok(()),
            Some(tokens) => tokens.recheck(caller).inspect_err(|_| {
                self.metrics.auth_failure();
            }),
        }
    }

    /// A fresh stream id.
    pub(crate) fn next_stream_id(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// Admits one gRPC request of `caller` within the limits, or sheds it (counted by `rpc`).
    pub(crate) fn admit(
        self: &Arc<Self>,
        rpc: Rpc,
        caller: &Caller,
    ) -> Result<Permit, ServiceError> {
        self.admit_request(caller)
            .inspect_err(|_| self.metrics.shed(rpc))
    }

    /// Admits one request (gRPC or HTTP) of `caller` within the server's concurrency limit and
    /// the caller's token quota, or refuses it with RESOURCE_EXHAUSTED; the caller counts the
    /// refusal.
    pub(crate) fn admit_request(self: &Arc<Self>, caller: &Caller) -> Result<Permit, ServiceError> {
        let quota = match &caller.quota {
            Some(quota) if !quota.take() => {
                return Err(ServiceError::ResourceExhausted(format!(
                    "the token {:?} holds its limit of {} concurrent requests and open \
                     streams (max_requests in the token file, or --max-requests-per-token); \
                     retry with backoff",
                    caller.name,
                    quota.limit()
                )));
            }
            quota => quota.clone(),
        };
        // From here the quota's place is held by the permit (and given back with it).
        let mut permit = Permit {
            state: Arc::clone(self),
            quota,
            counted: false,
        };
        if !self
            .metrics
            .in_flight()
            .take(self.limits.max_concurrent_requests)
        {
            return Err(ServiceError::ResourceExhausted(format!(
                "the server is at its limit of {} concurrent requests; retry with backoff",
                self.limits.max_concurrent_requests
            )));
        }
        permit.counted = true;
        Ok(permit)
    }
}

/// One admitted whole-state read; dropping it frees its place.
#[derive(Debug)]
pub(crate) struct DumpPermit {
    state: Arc<State>,
}

impl Drop for DumpPermit {
    fn drop(&mut self) {
        self.state.dumps.give_back();
    }
}

/// A request's place, handed in the request's extensions from where it was admitted (the gRPC
/// gate, the HTTP middleware for the routes that hand it on) to its handler; cloneable, as
/// extensions must be. The handler takes it once and holds it while it works (a stream for its
/// life); if none does, the place is freed when the request is dropped.
#[derive(Clone, Debug)]
pub(crate) struct HandedPlace(Arc<parking_lot::Mutex<Option<Permit>>>);

impl HandedPlace {
    /// Hands `permit` on.
    pub(crate) fn new(permit: Permit) -> Self {
        Self(Arc::new(parking_lot::Mutex::new(Some(permit))))
    }

    /// The place, once (`None` after it was taken).
    pub(crate) fn take(&self) -> Option<Permit> {
        self.0.lock().take()
    }
}

/// One admitted request; dropping it frees its place and its token's.
#[derive(Debug)]
pub(crate) struct Permit {
    state: Arc<State>,
    /// The token's quota whose place this holds.
    quota: Option<Arc<RequestQuota>>,
    /// Whether it holds a place among the server's requests in flight.
    counted: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.counted {
            self.state.metrics.in_flight().give_back();
        }
        if let Some(quota) = &self.quota {
            quota.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At most [`MAX_CONCURRENT_DUMPS`] whole-state reads hold a place; the next is refused
    /// with RESOURCE_EXHAUSTED naming the request, and a finished read frees its place.
    #[test]
    fn whole_state_reads_are_bounded() {
        let registry = Arc::new(Registry::new(
            crate::config::IndexSettings::default(),
            Limits::default(),
        ));
        let state = Arc::new(State::new(registry, Limits::default(), None, 0));
        let held: Vec<Held> = (0..MAX_CONCURRENT_DUMPS)
            .map(|_| state.admit_dump("/dump", None).expect("a place"))
            .collect();
        match state.admit_dump("/snapshot", None) {
            Err(ServiceError::ResourceExhausted(message)) => {
                assert!(message.starts_with("/snapshot: 2 reads"), "{message}");
            }
            other => panic!("expected RESOURCE_EXHAUSTED, got {other:?}"),
        }
        drop(held);
        let again = state.admit_dump("Snapshot", None).expect("a place again");
        drop(again);
        assert_eq!(state.dumps.held(), 0);
    }
}
