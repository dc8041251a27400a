//! The `kvatlas.v1.Indexer` gRPC service: request validation, proto ↔ domain conversion, status
//! codes, the concurrency limit and the per-RPC metrics.
//!
//! Queries run inline on the handler's task (a walk of the `ConcurrentAtlas` takes microseconds
//! and waits for at most one write, never for a busy writer); registrations, unregistrations and
//! lists, which start or join listener threads or take the index's writer side for statistics,
//! run on the blocking pool. Every failure becomes a status from [`status`], the one place
//! `ServiceError`s are mapped.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvatlas_events::{EngineKind, ListenerStatus, SocketMode};
use kvatlas_index::{Checkpoint, Mutation, Unit};
use kvatlas_proto::v1::{self, indexer_server::Indexer, query_request};
use tokio_stream::Stream;
use tokio_util::sync::WaitForCancellationFutureOwned;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::Caller;
use crate::error::ServiceError;
use crate::metrics::Rpc;
use crate::publish::{Admission, Publisher};
use crate::query::{Answer, QueryInput, QueryOptions};
use crate::registry::{
    FeedCounters, IndexKey, RankSource, RankView, WorkerRegistration, block_size_field,
};
use crate::state::State;

/// The service; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct IndexerService {
    state: Arc<State>,
}

impl IndexerService {
    pub(crate) fn new(state: Arc<State>) -> Self {
        Self { state }
    }
}

/// The gRPC status of a service error.
pub(crate) fn status(error: ServiceError) -> Status {
    match error {
        ServiceError::InvalidArgument(m) => Status::invalid_argument(m),
        ServiceError::NotFound(m) => Status::not_found(m),
        ServiceError::FailedPrecondition(m) => Status::failed_precondition(m),
        ServiceError::AlreadyExists(m) => Status::already_exists(m),
        ServiceError::ResourceExhausted(m) => Status::resource_exhausted(m),
        ServiceError::Unavailable(m) => Status::unavailable(m),
        ServiceError::Unauthenticated(m) => Status::unauthenticated(m),
        ServiceError::PermissionDenied(m) => Status::permission_denied(m),
        ServiceError::Internal(m) => Status::internal(m),
    }
}

/// tonic reports an inbound message larger than `--max-message-bytes` as OUT_OF_RANGE; gRPC's own
/// code for it (grpc-core, grpc-go, grpc-java) is RESOURCE_EXHAUSTED, a limit, and that is what
/// kvatlas answers. kvatlas itself never answers OUT_OF_RANGE, so the mapping is unambiguous.
pub(crate) fn inbound_status(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange {
        Status::resource_exhausted(status.message().to_owned())
    } else {
        status
    }
}

/// A gRPC service whose trailers-only answers (a request tonic refused before the handler ran,
/// such as a unary message over the size limit) carry [`inbound_status`]'s code.
///
/// Invariant: `11` and `8` are `tonic::Code::OutOfRange` and `ResourceExhausted` (gRPC's
/// numbering, fixed by the protocol; a unit test holds them).
#[derive(Debug, Clone)]
pub(crate) struct OversizeStatus<S>(pub(crate) S);

impl<S: tonic::server::NamedService> tonic::server::NamedService for OversizeStatus<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, R> tonic::codegen::Service<tonic::codegen::http::Request<B>> for OversizeStatus<S>
where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<R>,
        >,
    S::Future: Unpin,
{
    type Response = tonic::codegen::http::Response<R>;
    type Error = S::Error;
    type Future = OversizeAnswer<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<B>) -> Self::Future {
        OversizeAnswer(self.0.call(request))
    }
}

/// The answer of an [`OversizeStatus`] service: the inner answer, its `grpc-status` header
/// OUT_OF_RANGE (`11`) rewritten to RESOURCE_EXHAUSTED (`8`). No allocation of its own: the
/// generated services' futures are already boxed, hence `Unpin`.
#[derive(Debug)]
pub(crate) struct OversizeAnswer<F>(F);

impl<F, R, E> std::future::Future for OversizeAnswer<F>
where
    F: std::future::Future<Output = Result<tonic::codegen::http::Response<R>, E>> + Unpin,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut response = std::task::ready!(Pin::new(&mut self.0).poll(cx))?;
        let headers = response.headers_mut();
        if headers
            .get("grpc-status")
            .is_some_and(|v| v.as_bytes() == b"11")
        {
            headers.insert(
                "grpc-status",
                tonic::codegen::http::HeaderValue::from_static("8"),
            );
        }
        Poll::Ready(Ok(response))
    }
}

/// The gate in front of a gRPC service (`kvatlas.v1.Indexer`, llm-d's `GetPodScores`): from a
/// request's headers alone, before its message is read and decoded, it authenticates the
/// `authorization` header and admits the request within the concurrency limit and its token's
/// quota ([`State::admit`]), or answers at once (UNAUTHENTICATED, RESOURCE_EXHAUSTED). The
/// request carries its [`Caller`] (anonymous without authentication) and its place
/// ([`crate::state::HandedPlace`]) to the handler.
///
/// Admitted after decoding (an interceptor and the handler), a burst of requests each declaring
/// a message of `--max-message-bytes` was read and decoded in full, every one of them, before
/// the limit shed all but a few: the limit bounded the work, not the memory. Through the gate,
/// what requests hold in memory is at most the limit's count of messages.
#[derive(Debug, Clone)]
pub(crate) struct Gate<S> {
    inner: S,
    state: Arc<State>,
}

impl<S> Gate<S> {
    pub(crate) fn new(inner: S, state: Arc<State>) -> Self {
        Self { inner, state }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Gate<S> {
    const NAME: &'static str = S::NAME;
}

/// The RPC a request's path names (`None`: a path no handler answers; tonic answers it
/// UNIMPLEMENTED).
fn rpc_of_path(path: &str) -> Option<Rpc> {
    Some(match path {
        "/kvatlas.v1.Indexer/Query" => Rpc::Query,
        "/kvatlas.v1.Indexer/QueryStream" => Rpc::QueryStream,
        "/kvatlas.v1.Indexer/RegisterWorker" => Rpc::RegisterWorker,
        "/kvatlas.v1.Indexer/UnregisterWorker" => Rpc::UnregisterWorker,
        "/kvatlas.v1.Indexer/ListWorkers" => Rpc::ListWorkers,
        "/kvatlas.v1.Indexer/ListIndexes" => Rpc::ListIndexes,
        "/kvatlas.v1.Indexer/PublishEvents" => Rpc::PublishEvents,
        "/kvatlas.v1.Indexer/Snapshot" => Rpc::Snapshot,
        "/indexer.v1.IndexerService/GetPodScores" => Rpc::GetPodScores,
        _ => return None,
    })
}

impl<S, R> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for Gate<S>
where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<R>,
        >,
    S::Future: Unpin,
    R: Default,
{
    type Response = tonic::codegen::http::Response<R>;
    type Error = S::Error;
    type Future = GateAnswer<S::Future, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let started = Instant::now();
        let header = request.headers().get("authorization");
        let caller = match self.state.authenticate(header) {
            Ok(caller) => caller,
            Err(error) => return GateAnswer::Refused(Some(status(error).into_http())),
        };
        let rpc = rpc_of_path(request.uri().path());
        // A one-message request body that stalls fails (and gives its place back); a stream's
        // may rightly stay quiet between messages.
        let mut request = match rpc {
            Some(Rpc::QueryStream | Rpc::PublishEvents) | None => request,
            Some(_) => {
                let stall = self.state.limits.stall_timeout;
                request.map(|body| {
                    tonic::body::Body::new(crate::stalled_body::StallLimited::new(
                        body,
                        stall,
                        |timeout| {
                            Box::new(Status::deadline_exceeded(
                                crate::stalled_body::stalled_message(timeout),
                            ))
                        },
                    ))
                })
            }
        };
        if let Some(rpc) = rpc {
            match self.state.admit(rpc, &caller) {
                Ok(permit) => {
                    request
                        .extensions_mut()
                        .insert(crate::state::HandedPlace::new(permit));
                }
                Err(error) => {
                    let refused = status(error);
                    self.state
                        .metrics
                        .record(rpc, started.elapsed(), refused.code() as i32);
                    return GateAnswer::Refused(Some(refused.into_http()));
                }
            }
        }
        request.extensions_mut().insert(caller);
        GateAnswer::Inner(self.inner.call(request))
    }
}

/// The answer of a [`Gate`]: the service's, or the gate's refusal (trailers only).
#[derive(Debug)]
pub(crate) enum GateAnswer<F, R> {
    Inner(F),
    /// Taken when polled.
    Refused(Option<tonic::codegen::http::Response<R>>),
}

impl<F, R, E> std::future::Future for GateAnswer<F, R>
where
    F: std::future::Future<Output = Result<tonic::codegen::http::Response<R>, E>> + Unpin,
    R: Default,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // `GateAnswer` is `Unpin`: `F` is, and a response is only moved out of its `Option`.
        match self.get_mut() {
            GateAnswer::Inner(answer) => Pin::new(answer).poll(cx),
            GateAnswer::Refused(refused) => Poll::Ready(Ok(refused
                .take()
                .unwrap_or_else(|| Status::internal("polled after completion").into_http()))),
        }
    }
}

impl<F: Unpin, R> Unpin for GateAnswer<F, R> {}

/// The place the [`Gate`] admitted `request` with (its absence is a wiring error of the
/// server, hence INTERNAL).
pub(crate) fn permit_of<T>(request: &Request<T>) -> Result<crate::state::Permit, ServiceError> {
    request
        .extensions()
        .get::<crate::state::HandedPlace>()
        .and_then(crate::state::HandedPlace::take)
        .ok_or_else(|| ServiceError::Internal("the request was not admitted".into()))
}

/// The caller the authentication interceptor attached to `request` (its absence is a wiring
/// error of the server, hence INTERNAL).
pub(crate) fn caller_of<T>(request: &Request<T>) -> Result<Caller, ServiceError> {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| ServiceError::Internal("the request was not authenticated".into()))
}

fn key_of(selector: Option<&v1::IndexSelector>) -> Result<IndexKey, ServiceError> {
    let selector = selector.ok_or_else(|| {
        ServiceError::InvalidArgument(
            "index is missing: name the model (and tenant) whose index to use".into(),
        )
    })?;
    let key = IndexKey::new(selector.model.clone(), selector.tenant.clone());
    key.validate()?;
    Ok(key)
}

fn selector_of(key: &IndexKey) -> v1::IndexSelector {
    v1::IndexSelector {
        model: key.model.clone(),
        tenant: key.tenant.clone(),
    }
}

/// Runs a blocking operation (a registry change, a tokenization) off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ServiceError> + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ServiceError::Internal(format!("the operation failed: {e}")))?
}

/// Most instance ids a query's filter may name (each answer row is checked against the list).
pub(crate) const MAX_INSTANCE_FILTER: usize = 4096;

impl IndexerService {
    /// Records a finished request's latency and code, passing the result through.
    fn finish<T>(
        &self,
        rpc: Rpc,
        started: Instant,
        result: Result<T, Status>,
    ) -> Result<T, Status> {
        let code = match &result {
            Ok(_) => 0,
            Err(status) => status.code() as i32,
        };
        self.state.metrics.record(rpc, started.elapsed(), code);
        result
    }

    /// Answers one query (unary or one stream message).
    pub(crate) fn answer(
        &self,
        caller: &Caller,
        request: &v1::QueryRequest,
    ) -> Result<v1::QueryResponse, ServiceError> {
        let key = key_of(request.index.as_ref())?;
        caller.check(&key.tenant)?;
        self.state.check_ready()?;
        let input = match &request.input {
            Some(query_request::Input::Tokens(tokens)) => QueryInput::Tokens(&tokens.ids),
            Some(query_request::Input::LocalHashes(hashes)) => {
                QueryInput::LocalHashes(&hashes.hashes)
            }
            None => {
                return Err(ServiceError::InvalidArgument(
                    "input is missing: give the prompt as tokens or local_hashes".into(),
                ));
            }
        };
        if let Some(o) = &request.options
            && o.instance_ids.len() > MAX_INSTANCE_FILTER
        {
            return Err(ServiceError::InvalidArgument(format!(
                "options.instance_ids names {} instances; at most {MAX_INSTANCE_FILTER} are \
                 accepted (leave it empty for every instance)",
                o.instance_ids.len()
            )));
        }
        let options = request
            .options
            .as_ref()
            .map_or_else(QueryOptions::default, |o| QueryOptions {
                early_exit: o.early_exit,
                top_k: (o.top_k > 0).then_some(o.top_k as usize),
                min_blocks: o.min_blocks,
                instances: o.instance_ids.clone(),
                device_only: o.device_only,
            });
        let entry = self.state.registry.require(&key, |t| caller.may_use(t))?;
        let answer = entry.query(
            input,
            &request.lora_name,
            &request.cache_salt,
            &options,
            self.state.limits.max_query_tokens,
        )?;
        Ok(response_of(&answer))
    }
}

fn response_of(answer: &Answer) -> v1::QueryResponse {
    let block = u64::from(answer.block_size.get());
    v1::QueryResponse {
        matches: answer
            .matches
            .workers
            .iter()
            .map(|m| v1::WorkerMatch {
                instance_id: m.worker.worker_id,
                dp_rank: m.worker.dp_rank,
                device_blocks: m.device,
                host_blocks: m.host,
                longest_blocks: m.disk,
                matched_tokens: u64::from(m.device) * block,
                longest_matched_tokens: u64::from(m.disk) * block,
            })
            .collect(),
        block_size: answer.block_size.get(),
        query_blocks: u32::try_from(answer.query_blocks).unwrap_or(u32::MAX),
        last_event_unix_micros: answer.last_event_unix_micros,
        events_applied: answer.events_applied,
    }
}

fn engine_of(value: i32) -> Result<EngineKind, ServiceError> {
    match v1::EngineKind::try_from(value) {
        Ok(v1::EngineKind::Unspecified | v1::EngineKind::Vllm) => Ok(EngineKind::Vllm),
        Ok(v1::EngineKind::Sglang) => Ok(EngineKind::Sglang),
        Err(_) => Err(ServiceError::InvalidArgument(format!(
            "engine is {value}, not an engine kind (1 vLLM, 2 SGLang)"
        ))),
    }
}

fn mode_of(value: i32) -> Result<SocketMode, ServiceError> {
    match v1::SocketMode::try_from(value) {
        Ok(v1::SocketMode::Connect) => Ok(SocketMode::Connect),
        Ok(v1::SocketMode::Bind) => Ok(SocketMode::Bind),
        Err(_) => Err(ServiceError::InvalidArgument(format!(
            "socket_mode is {value}, not a socket mode (0 connect, 1 bind)"
        ))),
    }
}

/// What a registration over the network may bind: a listener the server binds takes the
/// endpoint's address on this host, so only a caller whose token is limited to no tenant may
/// ask for one, and only on `tcp://`. Binding an `ipc://` path makes ZeroMQ remove whatever
/// file is there first (and again at unregistration): a token file, a TLS key, a snapshot.
/// Such endpoints are for the operator's own `--workers … bind` and config file.
///
/// A server without authentication (whose own listeners are on loopback) binds only on a
/// loopback address over the API, unless `--allow-unauthenticated`: any local process may call
/// it, and would otherwise open a socket on the network that takes events from anyone.
///
/// # Errors
/// PERMISSION_DENIED for a bind by a tenant-limited caller, on anything but `tcp://`, or beyond
/// loopback on a server without authentication.
fn check_remote_bind(
    caller: &Caller,
    registration: &WorkerRegistration,
    authenticated_or_allowed: bool,
) -> Result<(), ServiceError> {
    if registration.mode != SocketMode::Bind {
        return Ok(());
    }
    if !caller.unrestricted() {
        return Err(ServiceError::PermissionDenied(
            "socket_mode BIND makes the server listen on this host; only a token limited to no \
             tenant may register one"
                .into(),
        ));
    }
    // The replay endpoint is always connected to, never bound.
    let endpoint = &registration.endpoint;
    if !endpoint.starts_with("tcp://") {
        return Err(ServiceError::PermissionDenied(format!(
            "socket_mode BIND over the API takes tcp:// endpoints only, not {endpoint:?}: \
             binding an ipc:// path removes the file there first; bind such endpoints with \
             `kvatlas serve --workers … bind` or the config file"
        )));
    }
    if !authenticated_or_allowed && !crate::registry::on_loopback(endpoint) {
        return Err(ServiceError::PermissionDenied(format!(
            "this server has no authentication, so over the API it binds on loopback only, not \
             {endpoint:?}: start it with --auth-tokens (and register with a token limited to no \
             tenant), or with --allow-unauthenticated"
        )));
    }
    Ok(())
}

pub(crate) fn registration_of(
    request: &v1::RegisterWorkerRequest,
) -> Result<WorkerRegistration, ServiceError> {
    Ok(WorkerRegistration {
        index: key_of(request.index.as_ref())?,
        instance_id: request.instance_id,
        dp_rank: request.dp_rank,
        block_size: block_size_field(request.block_size, "block_size")?,
        engine: engine_of(request.engine)?,
        endpoint: request.endpoint.trim().to_owned(),
        replay_endpoint: Some(request.replay_endpoint.trim().to_owned()).filter(|e| !e.is_empty()),
        topic: request.topic.clone(),
        mode: mode_of(request.socket_mode)?,
        pod_name: Some(request.pod_name.clone()).filter(|p| !p.is_empty()),
    })
}

fn counters_of(c: &FeedCounters) -> v1::WorkerCounters {
    v1::WorkerCounters {
        batches_received: c.batches_received,
        batches_applied: c.batches_applied,
        batches_replayed: c.batches_replayed,
        duplicates: c.duplicates,
        gaps: c.gaps,
        replays_completed: c.replays_completed,
        replays_failed: c.replays_failed,
        resyncs: c.resyncs,
        restarts: c.restarts,
        bad_frames: c.bad_frames,
        decode_errors: c.decode_errors,
        mutations_enqueued: c.mutations_enqueued,
        backpressure_waits: c.backpressure_waits,
        connects: c.connects,
        connect_retries: c.connect_retries,
        disconnects: c.disconnects,
        catch_ups: c.catch_ups,
        probes: c.probes,
        replay_resyncs: c.replay_resyncs,
        held_dropped: c.held_dropped,
        dropped: c
            .drops
            .iter()
            .map(|(reason, n)| (reason.to_string(), n))
            .collect(),
    }
}

fn worker_info(view: &RankView) -> v1::WorkerInfo {
    let mut info = v1::WorkerInfo {
        index: Some(selector_of(&view.index)),
        instance_id: view.worker.worker_id,
        dp_rank: view.worker.dp_rank,
        status: match view.status {
            ListenerStatus::Pending => v1::WorkerStatus::Pending,
            ListenerStatus::Active => v1::WorkerStatus::Active,
            ListenerStatus::Failed => v1::WorkerStatus::Failed,
            ListenerStatus::Stopped => v1::WorkerStatus::Stopped,
            ListenerStatus::Held => v1::WorkerStatus::Held,
        } as i32,
        last_error: view.last_error.clone().unwrap_or_default(),
        last_seq: view.last_seq,
        micros_since_last_batch: view.micros_since_last_batch,
        counters: Some(counters_of(&view.counters)),
        blocks: Some(v1::BlockCounts {
            device: view.blocks[0],
            host: view.blocks[1],
            disk: view.blocks[2],
            external: view.blocks[3],
        }),
        ..v1::WorkerInfo::default()
    };
    match &view.source {
        RankSource::Zmq(registration) => {
            info.source = v1::WorkerSource::Zmq as i32;
            info.engine = match registration.engine {
                EngineKind::Vllm => v1::EngineKind::Vllm,
                EngineKind::Sglang => v1::EngineKind::Sglang,
            } as i32;
            info.endpoint.clone_from(&registration.endpoint);
            info.replay_endpoint = registration.replay_endpoint.clone().unwrap_or_default();
            info.topic.clone_from(&registration.topic);
            info.socket_mode = match registration.mode {
                SocketMode::Connect => v1::SocketMode::Connect,
                SocketMode::Bind => v1::SocketMode::Bind,
            } as i32;
            info.pod_name = registration.pod_name.clone().unwrap_or_default();
        }
        RankSource::Grpc => info.source = v1::WorkerSource::Grpc as i32,
        RankSource::BatchRank => info.source = v1::WorkerSource::BatchRank as i32,
    }
    info
}

/// Whether a (model, tenant) passes a list request's filters and the caller's tenants.
fn listed(caller: &Caller, model: &str, tenant: &str, key: &IndexKey) -> bool {
    (model.is_empty() || model == key.model)
        && (tenant.is_empty() || tenant == key.tenant)
        && caller.may_use(&key.tenant)
}

impl IndexerService {
    /// The indexes a list request names (empty model or tenant = any) that the caller may see.
    ///
    /// # Errors
    /// What `Caller::check_named` answers.
    fn listed_entries(
        &self,
        caller: &Caller,
        model: &str,
        tenant: &str,
    ) -> Result<Vec<Arc<crate::registry::IndexEntry>>, ServiceError> {
        caller.check_named(tenant)?;
        Ok(self
            .state
            .registry
            .all()
            .into_iter()
            .filter(|e| listed(caller, model, tenant, &e.key))
            .collect())
    }
}

#[tonic::async_trait]
impl Indexer for IndexerService {
    async fn query(
        &self,
        request: Request<v1::QueryRequest>,
    ) -> Result<Response<v1::QueryResponse>, Status> {
        let started = Instant::now();
        let result = (|| {
            let caller = caller_of(&request).map_err(status)?;
            let _permit = permit_of(&request).map_err(status)?;
            self.answer(&caller, request.get_ref())
                .map(Response::new)
                .map_err(status)
        })();
        self.finish(Rpc::Query, started, result)
    }

    type QueryStreamStream = QueryAnswers;

    async fn query_stream(
        &self,
        request: Request<Streaming<v1::QueryRequest>>,
    ) -> Result<Response<Self::QueryStreamStream>, Status> {
        let started = Instant::now();
        let result = (|| {
            let mut caller = caller_of(&request).map_err(status)?;
            let permit = permit_of(&request).map_err(status)?;
            let tokens_changed = self.state.watch_tokens(&mut caller).map_err(status)?;
            Ok(Response::new(QueryAnswers {
                service: self.clone(),
                caller,
                inbound: request.into_inner(),
                shutdown: Box::pin(self.state.shutdown.clone().cancelled_owned()),
                tokens_changed: Box::pin(tokens_changed.cancelled_owned()),
                _permit: permit,
                done: false,
            }))
        })();
        if result.is_err() {
            return self.finish(Rpc::QueryStream, started, result);
        }
        result
    }

    async fn register_worker(
        &self,
        request: Request<v1::RegisterWorkerRequest>,
    ) -> Result<Response<v1::RegisterWorkerResponse>, Status> {
        let started = Instant::now();
        let result = async {
            let caller = caller_of(&request)?;
            let _permit = permit_of(&request)?;
            let registration = registration_of(request.get_ref())?;
            caller.check(&registration.index.tenant)?;
            check_remote_bind(
                &caller,
                &registration,
                self.state.tokens.is_some() || self.state.allow_unauthenticated,
            )?;
            self.state.check_writable()?;
            let registry = Arc::clone(&self.state.registry);
            let registered = blocking(move || registry.register(registration)).await?;
            self.state.update_gate();
            Ok(Response::new(v1::RegisterWorkerResponse {
                created_index: registered.created_index,
                already_registered: registered.already_registered,
                worker: Some(worker_info(&registered.view)),
            }))
        }
        .await
        .map_err(status);
        self.finish(Rpc::RegisterWorker, started, result)
    }

    async fn unregister_worker(
        &self,
        request: Request<v1::UnregisterWorkerRequest>,
    ) -> Result<Response<v1::UnregisterWorkerResponse>, Status> {
        let started = Instant::now();
        let result = async {
            let caller = caller_of(&request)?;
            let _permit = permit_of(&request)?;
            let message = request.get_ref();
            let key = key_of(message.index.as_ref())?;
            let tenant = if message.all_tenants {
                if !caller.unrestricted() {
                    return Err(ServiceError::PermissionDenied(format!(
                        "the token {:?} is limited to some tenants and cannot unregister across \
                         all tenants; name the tenant",
                        caller.name
                    )));
                }
                None
            } else {
                caller.check(&key.tenant)?;
                Some(key.tenant.clone())
            };
            let (instance, rank) = (message.instance_id, message.dp_rank);
            self.state.check_writable()?;
            let registry = Arc::clone(&self.state.registry);
            let done = blocking(move || {
                registry.unregister(&key.model, tenant.as_deref(), instance, rank, |t| {
                    caller.may_use(t)
                })
            })
            .await?;
            Ok(Response::new(v1::UnregisterWorkerResponse {
                ranks_removed: done.ranks_removed,
                listeners_stopped: done.listeners_stopped,
                blocks_removed: done.blocks_removed,
                indexes: done.indexes.iter().map(selector_of).collect(),
            }))
        }
        .await
        .map_err(status);
        self.finish(Rpc::UnregisterWorker, started, result)
    }

    async fn list_workers(
        &self,
        request: Request<v1::ListWorkersRequest>,
    ) -> Result<Response<v1::ListWorkersResponse>, Status> {
        let started = Instant::now();
        let result = async {
            let caller = caller_of(&request)?;
            let _permit = permit_of(&request)?;
            let filter = request.into_inner();
            let entries = self.listed_entries(&caller, &filter.model, &filter.tenant)?;
            let workers = blocking(move || {
                Ok(entries
                    .iter()
                    .flat_map(|entry| entry.rank_views(&entry.blocks_per_rank()))
                    .map(|view| worker_info(&view))
                    .collect())
            })
            .await?;
            Ok(Response::new(v1::ListWorkersResponse { workers }))
        }
        .await
        .map_err(status);
        self.finish(Rpc::ListWorkers, started, result)
    }

    async fn list_indexes(
        &self,
        request: Request<v1::ListIndexesRequest>,
    ) -> Result<Response<v1::ListIndexesResponse>, Status> {
        let started = Instant::now();
        let result = async {
            let caller = caller_of(&request)?;
            let _permit = permit_of(&request)?;
            let filter = request.into_inner();
            let entries = self.listed_entries(&caller, &filter.model, &filter.tenant)?;
            let indexes = blocking(move || {
                Ok(entries
                    .iter()
                    .map(|entry| {
                        let index = entry.index();
                        let stats = kvatlas_index::SharedKvIndex::stats(index);
                        let totals = index.totals();
                        v1::IndexInfo {
                            index: Some(selector_of(&entry.key)),
                            block_size: entry.block_size.get(),
                            registered_ranks: u32::try_from(entry.feeds.lock().len())
                                .unwrap_or(u32::MAX),
                            ranks_with_blocks: u32::try_from(stats.workers.len())
                                .unwrap_or(u32::MAX),
                            memberships: stats.memberships,
                            heap_bytes: stats.heap_bytes,
                            capacity: index.capacity().unwrap_or(0),
                            last_event_unix_micros: index.last_event_unix_micros(),
                            events_applied: index.events_applied(),
                            events_queued: entry.pool.queued() as u64,
                            anomalies: Some(v1::IndexAnomalies {
                                unknown_parents: totals.unknown_parents,
                                unknown_removes: totals.unknown_removes,
                                duplicate_stores: totals.duplicate_stores,
                                conflicting_stores: totals.conflicting_stores,
                                evicted: totals.evicted,
                            }),
                        }
                    })
                    .collect())
            })
            .await?;
            Ok(Response::new(v1::ListIndexesResponse { indexes }))
        }
        .await
        .map_err(status);
        self.finish(Rpc::ListIndexes, started, result)
    }

    async fn publish_events(
        &self,
        request: Request<Streaming<v1::PublishEventsRequest>>,
    ) -> Result<Response<v1::PublishEventsResponse>, Status> {
        let started = Instant::now();
        let result = self.publish(request).await;
        self.finish(Rpc::PublishEvents, started, result)
    }

    type SnapshotStream = SnapshotChunks;

    async fn snapshot(
        &self,
        request: Request<v1::SnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        let started = Instant::now();
        let result = (|| {
            let caller = caller_of(&request).map_err(status)?;
            let permit = permit_of(&request).map_err(status)?;
            let filter = request.into_inner();
            caller.check_named(&filter.tenant).map_err(status)?;
            let held = self
                .state
                .admit_dump("Snapshot", Some(permit))
                .map_err(status)?;
            let chunks = crate::snapshot_stream::stream_filtered(
                Arc::clone(&self.state.registry),
                move |key| listed(&caller, &filter.model, &filter.tenant, key),
                held,
                self.state.limits.stall_timeout,
            );
            Ok(Response::new(SnapshotChunks { chunks }))
        })();
        self.finish(Rpc::Snapshot, started, result)
    }
}

/// The chunks of a `Snapshot` answer. Its places among the concurrent requests and the
/// whole-state reads are held by the task writing it, until the last chunk is buffered (or the
/// reader stalls for the stall timeout).
pub(crate) struct SnapshotChunks {
    chunks: crate::snapshot_stream::SnapshotStream,
}

impl std::fmt::Debug for SnapshotChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotChunks").finish_non_exhaustive()
    }
}

impl Stream for SnapshotChunks {
    type Item = Result<v1::SnapshotChunk, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.chunks).poll_next(cx).map(|chunk| {
            chunk.map(|chunk| {
                chunk
                    .map(|data| v1::SnapshotChunk { data: data.into() })
                    .map_err(|error| Status::internal(format!("the snapshot failed: {error}")))
            })
        })
    }
}

impl IndexerService {
    /// `PublishEvents` (see `publish`): reads, checks and applies messages until the client
    /// closes the stream or a shutdown starts, then waits until everything is applied and
    /// acknowledges it.
    async fn publish(
        &self,
        request: Request<Streaming<v1::PublishEventsRequest>>,
    ) -> Result<Response<v1::PublishEventsResponse>, Status> {
        let mut caller = caller_of(&request).map_err(status)?;
        let _permit = permit_of(&request).map_err(status)?;
        let mut inbound = request.into_inner();
        let mut publisher = Publisher::new(
            self.state.next_stream_id(),
            Arc::clone(&self.state.registry),
        );
        let shutdown = self.state.shutdown.clone();
        // A change of the tokens ends a quiet stream of a revoked token at once, not at its
        // next message.
        let mut tokens_changed = self.state.watch_tokens(&mut caller).map_err(status)?;
        let failure = loop {
            enum Next<M> {
                Message(M),
                TokensChanged,
            }
            let next = tokio::select! {
                biased;
                () = shutdown.cancelled() => break None,
                () = tokens_changed.cancelled() => Next::TokensChanged,
                message = inbound.message() => Next::Message(message),
            };
            let message = match next {
                Next::Message(message) => message,
                Next::TokensChanged => match self.state.watch_tokens(&mut caller) {
                    Ok(next) => {
                        tokens_changed = next;
                        continue;
                    }
                    Err(revoked) => {
                        let applied = publisher.counts.messages_applied;
                        break Some(status(revoked.with_message(|m| {
                            format!("{m}; the {applied} message(s) it sent were applied")
                        })));
                    }
                },
            };
            let message = match message {
                Ok(Some(message)) => message,
                Ok(None) => break None,
                Err(refused) => {
                    // What was applied, for a publisher that resends unsequenced messages.
                    let refused = inbound_status(refused);
                    break Some(Status::new(
                        refused.code(),
                        format!(
                            "message {}: {}; the {} message(s) before it were applied",
                            publisher.counts.messages_received + 1,
                            refused.message(),
                            publisher.counts.messages_applied
                        ),
                    ));
                }
            };
            // A token revoked (or its tenants changed) since the stream opened: from this
            // message on.
            let published = match self.state.recheck(&mut caller) {
                Ok(()) => self.publish_one(&caller, &mut publisher, &message).await,
                Err(revoked) => Err(revoked),
            };
            if let Err(error) = published {
                // Whatever the code (a bad field, a revoked token, a rank another source took,
                // a bootstrap starting), a publisher that resends unsequenced messages needs
                // to know which were applied: their clears and removes are not idempotent.
                let applied = publisher.counts.messages_applied;
                break Some(status(error.with_message(|m| {
                    format!(
                        "message {} (instance {} rank {}): {m}; the {applied} message(s) before \
                         it were applied",
                        publisher.counts.messages_received + 1,
                        message.instance_id,
                        message.dp_rank
                    )
                })));
            }
        };
        // Everything enqueued is applied before the stream's messages are acknowledged.
        let indexes = publisher.fed_indexes();
        blocking(move || {
            for entry in indexes {
                entry.pool.flush();
            }
            Ok(())
        })
        .await
        .map_err(status)?;
        self.state.update_gate();
        match failure {
            Some(status) => Err(status),
            None => Ok(Response::new(publisher.response())),
        }
    }

    async fn publish_one(
        &self,
        caller: &Caller,
        publisher: &mut Publisher,
        message: &v1::PublishEventsRequest,
    ) -> Result<(), ServiceError> {
        let received = std::time::Instant::now();
        self.state.check_writable()?;
        let tenant = message.index.as_ref().map_or("", |s| s.tenant.as_str());
        caller.check(if tenant.is_empty() {
            crate::registry::DEFAULT_TENANT
        } else {
            tenant
        })?;
        // In order with the instance's other messages, from admission to the log (see
        // `Registry::publish_order`); waiting here is safe to cancel: nothing is looked up,
        // created or admitted yet.
        // (`IndexKey::new` names the default tenant for an empty one, as `prepare` does.)
        let key = crate::registry::IndexKey::new(
            message.index.as_ref().map_or("", |s| s.model.as_str()),
            tenant,
        );
        let order = self
            .state
            .registry
            .publish_order(&key, message.instance_id)
            .lock_owned()
            .await;
        // Nothing is admitted once a shutdown has stopped waiting for admitted batches (a call
        // the shutdown cut goes on running, and its batch would be applied after the final
        // report, or its record refused by the closed log, uncounted).
        // (Held until the batch is enqueued and logged here or handed to a tracked task: a
        // shutdown that closes the tracker meanwhile waits for it.)
        let _tracked = self.state.admitted_batches.token();
        if self.state.admitted_batches.is_closed() {
            return Err(ServiceError::Unavailable(
                "the server is shutting down: retry at another replica or after its restart".into(),
            ));
        }
        let prepared = publisher.prepare(message)?;
        let (resync, fingerprint) = match publisher.admit(&prepared)? {
            Admission::Duplicate => return Ok(()),
            Admission::Apply {
                resync,
                fingerprint,
            } => (resync, fingerprint),
        };
        let events = prepared.mutations.len();
        let mut mutations = Vec::with_capacity(events + 1);
        if resync {
            mutations.push(Mutation::Cleared {
                worker: prepared.worker,
            });
        }
        mutations.extend(prepared.mutations);
        // One unit: a snapshot holds the whole message or none of it, and its sequence number
        // with it (a restarted server continues the rank's numbering).
        let unit = Unit {
            worker_id: prepared.worker.worker_id,
            checkpoint: prepared
                .seq
                .zip(fingerprint)
                .map(|(seq, fingerprint)| Checkpoint {
                    source: prepared.worker,
                    position: seq,
                    fingerprint,
                }),
            mutations,
            resync,
            received: Some(received),
            published: None,
        };
        // An ingest logs what it applies (encoded first: the unit moves to the writers); an
        // unsequenced message without events changes nothing and is not logged (nor could its
        // record name its rank).
        let changes = unit.checkpoint.is_some() || !unit.mutations.is_empty();
        let logged = prepared.entry.log.as_ref().filter(|_| changes).map(|log| {
            let record = crate::log_record::encode_unit(
                &prepared.entry.key,
                prepared.entry.block_size,
                &unit,
            );
            (Arc::clone(log), record)
        });
        // The batch's sequence number is admitted: from here it must be applied and logged
        // even if the client goes away (a cancelled call, or the stream ended), or its retry
        // would be dropped as a duplicate of a batch nobody applied. Where the lane and the log
        // have room it is done here and now (no wait, nothing to cancel); what has to wait runs
        // in a task of its own, which the call only waits for, and which holds the instance's
        // order until it is done (the instance's next message waits for it). (A task for every
        // message cost a fifth of the service benchmark's PublishEvents load rate.)
        let entry = Arc::clone(&prepared.entry);
        // (A publish-only ingest applies nothing itself.)
        let unit = if entry.publish_only() {
            None
        } else {
            match entry.pool.try_enqueue_unit(unit) {
                Ok(()) => None,
                Err(kvatlas_index::EnqueueError::Full(unit)) => Some(unit),
                Err(kvatlas_index::EnqueueError::Stopped(_)) => {
                    return Err(ServiceError::Internal(
                        "the index writers have stopped".into(),
                    ));
                }
            }
        };
        let logged = match (unit.is_none(), logged) {
            (true, Some((log, record))) => log.try_send(record).map(|record| (log, record)),
            (_, logged) => logged,
        };
        if unit.is_none() && logged.is_none() {
            publisher.applied(events);
            return Ok(());
        }
        let rest = self.state.admitted_batches.spawn(async move {
            let _order = order;
            if let Some(unit) = unit {
                enqueue(&entry.pool, unit).await?;
            }
            if let Some((log, record)) = logged {
                log.send(record).await;
            }
            Ok::<(), ServiceError>(())
        });
        rest.await.map_err(|failed| {
            ServiceError::Internal(format!("applying the batch failed: {failed}"))
        })??;
        publisher.applied(events);
        Ok(())
    }
}

/// Enqueues a unit, waiting (without blocking the runtime) while its lane is full.
pub(crate) async fn enqueue(
    pool: &kvatlas_index::ThreadPool<crate::served_index::ServedIndex>,
    unit: Unit,
) -> Result<(), ServiceError> {
    let mut unit = unit;
    let mut backoff = Duration::from_micros(50);
    loop {
        match pool.try_enqueue_unit(unit) {
            Ok(()) => return Ok(()),
            Err(kvatlas_index::EnqueueError::Full(back)) => {
                unit = back;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(5));
            }
            Err(kvatlas_index::EnqueueError::Stopped(_)) => {
                return Err(ServiceError::Internal(
                    "the index writers have stopped".into(),
                ));
            }
        }
    }
}

/// The answers of a `QueryStream`: each inbound query answered inline when the response stream
/// is polled, in order; ends with UNAVAILABLE when a shutdown starts.
pub(crate) struct QueryAnswers {
    service: IndexerService,
    caller: Caller,
    inbound: Streaming<v1::QueryRequest>,
    shutdown: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Ready when the tokens in force change: the caller is rechecked then, so a revoked
    /// token ends a stream that sends nothing more (and frees its places).
    tokens_changed: Pin<Box<WaitForCancellationFutureOwned>>,
    _permit: crate::state::Permit,
    done: bool,
}

impl std::fmt::Debug for QueryAnswers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryAnswers").finish_non_exhaustive()
    }
}

impl Stream for QueryAnswers {
    type Item = Result<v1::QueryStreamResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.shutdown.as_mut().poll(cx).is_ready() {
            self.done = true;
            return Poll::Ready(Some(Err(Status::unavailable(
                "the server is shutting down",
            ))));
        }
        // (Polled again after each change: the next one wakes this stream.)
        while self.tokens_changed.as_mut().poll(cx).is_ready() {
            let this = &mut *self;
            match this.service.state.watch_tokens(&mut this.caller) {
                Ok(next) => this.tokens_changed = Box::pin(next.cancelled_owned()),
                Err(error) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(status(error))));
                }
            }
        }
        match Pin::new(&mut self.inbound).poll_next(cx) {
            Poll::Ready(Some(Ok(request))) => {
                // A token revoked since the stream opened ends it; new tenants apply from this
                // query on.
                let this = &mut *self;
                if let Err(error) = this.service.state.recheck(&mut this.caller) {
                    self.done = true;
                    return Poll::Ready(Some(Err(status(error))));
                }
                let started = Instant::now();
                let outcome = match self.service.answer(&self.caller, &request) {
                    Ok(response) => {
                        self.service
                            .state
                            .metrics
                            .record(Rpc::QueryStream, started.elapsed(), 0);
                        v1::query_stream_response::Outcome::Response(response)
                    }
                    Err(error) => {
                        let status = status(error);
                        self.service.state.metrics.record(
                            Rpc::QueryStream,
                            started.elapsed(),
                            status.code() as i32,
                        );
                        v1::query_stream_response::Outcome::Error(v1::QueryError {
                            code: status.code() as u32,
                            message: status.message().to_owned(),
                        })
                    }
                };
                Poll::Ready(Some(Ok(v1::QueryStreamResponse {
                    request_id: request.request_id,
                    outcome: Some(outcome),
                })))
            }
            Poll::Ready(Some(Err(status))) => {
                self.done = true;
                Poll::Ready(Some(Err(inbound_status(status))))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    /// `OversizeAnswer` rewrites the header's digits; they must be these codes.
    #[test]
    fn the_rewritten_header_digits_are_grpcs_codes() {
        assert_eq!(tonic::Code::OutOfRange as i32, 11);
        assert_eq!(tonic::Code::ResourceExhausted as i32, 8);
    }
}
