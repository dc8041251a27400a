//! Dynamo's standalone-indexer HTTP API (`python -m dynamo.indexer`, `ai-dynamo-runtime` 1.6.1),
//! served on kvatlas's HTTP port so a client of that service works by changing an address:
//! `/register`, `/unregister`, `/workers`, `/query`, `/query_by_hash`, `/dump`, `/register_peer`,
//! `/deregister_peer`, `/peers` (and `/health`, `/metrics` beside them).
//!
//! The running 1.6.1 service is the reference (not its older documentation): the same paths,
//! field names, status codes, JSON shapes and body limits, axum's own texts for bodies that are
//! not JSON (400), not `application/json` (415) or of the wrong shape (422), and 1.6.1's words
//! for its own errors (endpoint checks, a rank already registered, a block-size mismatch, an
//! unknown instance or rank); `tests/dynamo_compat.rs` checks them against the wheel. Where kvatlas
//! answers differently it does so on purpose, and `docs/server.md` lists each difference; the
//! main ones:
//!
//! - **tenants**: 1.6.1 partitions by `(model_name, routing_group)` and ignores `tenant_id`.
//!   kvatlas maps `routing_group` to its tenant and, when only `tenant_id` is given, isolates by
//!   it too (stricter: a query of tenant A never sees tenant B's workers);
//! - the Mooncake RFC's names are accepted as well: on `/register` `modelname` for `model_name`,
//!   `type` (`vLLM`, `SGLang`) for the engine and `additionalsalt`; on the queries `model` (and
//!   `modelname`) for `model_name`, `seq_hashes` / `block_hash` for `block_hashes`, and the
//!   RFC's `instance_id` (one instance's answer) and `block_size` (checked against the index's:
//!   400 if it differs); its deprecated `lora_id` is refused (400); `/query_by_hash` takes hashes
//!   as signed or unsigned 64-bit integers;
//! - `/unregister` with a `dp_rank` removes that rank only (1.6.1 removes every rank unless a
//!   `routing_group` is also given), also a rank no feed registered that holds blocks (a
//!   batch's `dp_rank` put them there; 1.6.1 answers 404); an instance may be registered in
//!   several indexes;
//! - a `block_size` of 0 is refused (400); an endpoint ZMQ cannot use is refused at
//!   registration (400) rather than shown as a failed listener;
//! - the dump of a rank lists its own engine hashes (1.6.1 lists the first writer's), one event
//!   per run of blocks on each tier, parents first.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use axum::extract::{Query as QueryParams, State as AxumState};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use kvatlas_events::{EngineKind, ListenerStatus, SocketMode};
use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{ExternalBlockHash, Matches, Mutation, Snapshot, StoredBlock, Tier, Worker};
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::fast_json::{FastJson, FastParse, KeepFirst};

use crate::auth::Caller;
use crate::error::ServiceError;
use crate::query::{QueryInput, QueryOptions};
use crate::registry::{
    DEFAULT_TENANT, IndexKey, RankSource, RankView, Registry, WorkerRegistration, block_size_field,
};
use crate::snapshot::IndexImage;
use crate::state::State;

/// Largest `/query` and `/query_by_hash` body (1.6.1's limit).
pub(crate) const QUERY_BODY_LIMIT: usize = 8 << 20;
/// Largest body of the other JSON routes (axum's default, as in 1.6.1).
pub(crate) const BODY_LIMIT: usize = 2 << 20;

/// A JSON error body with a status.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// The JSON error body and status of a service error.
pub(crate) fn service_error(e: &ServiceError) -> Response {
    error(
        StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        e.to_string(),
    )
}

fn ok(status: StatusCode) -> Response {
    (status, Json(json!({ "status": "ok" }))).into_response()
}

/// The caller of a request, or the 401/403 response.
fn caller(state: &State, headers: &HeaderMap) -> Result<Caller, Box<Response>> {
    state
        .authenticate(headers.get(header::AUTHORIZATION))
        .map_err(|e| Box::new(service_error(&e)))
}

/// [`caller`], refusing (403) a token limited to some tenants: the peer list is the whole
/// server's, not a tenant's.
fn server_wide_caller(state: &State, headers: &HeaderMap) -> Result<Caller, Box<Response>> {
    let caller = caller(state, headers)?;
    if !caller.unrestricted() {
        return Err(Box::new(service_error(&ServiceError::PermissionDenied(
            format!(
                "the token {:?} is limited to some tenants; the peer list is the whole \
                 server's: use a token limited to no tenant",
                caller.name
            ),
        ))));
    }
    Ok(caller)
}

/// The tenant a request names: its `routing_group`, else its `tenant_id`, passing over an empty
/// one (clients serialize unset fields as `""`, and `{"routing_group": "", "tenant_id": "a"}`
/// means tenant `a`); `Some("")` if it gives only empty ones, `None` if it gives neither.
fn named_tenant<'a>(routing_group: Option<&'a str>, tenant_id: Option<&'a str>) -> Option<&'a str> {
    let given = [routing_group, tenant_id];
    given
        .into_iter()
        .flatten()
        .find(|t| !t.is_empty())
        .or_else(|| given.into_iter().flatten().next())
}

/// The kvatlas tenant of a request: the one it names ([`named_tenant`]), else default.
fn tenant_of(routing_group: Option<&str>, tenant_id: Option<&str>) -> String {
    named_tenant(routing_group, tenant_id)
        .filter(|t| !t.is_empty())
        .unwrap_or(DEFAULT_TENANT)
        .to_owned()
}

/// 1.6.1's check of a ZMQ endpoint, with its messages: `tcp://HOST:PORT` (`[V6]:PORT`),
/// `ipc://PATH` or `inproc://NAME`. ZMQ itself may still refuse what passes (kvatlas then
/// answers 400 at registration; 1.6.1 shows a failed listener).
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let detail = match endpoint.split_once("://") {
        None => Err("missing scheme".to_owned()),
        Some(("tcp", address)) => {
            let split = match address.strip_prefix('[') {
                Some(v6) => v6
                    .split_once("]:")
                    .ok_or_else(|| "missing closing `]`".to_owned()),
                None => match address.rsplit_once(':') {
                    Some(("", _)) => Err("missing TCP host".to_owned()),
                    Some((host, port)) if !host.contains(':') => Ok((host, port)),
                    _ => Err("missing TCP port".to_owned()),
                },
            };
            split.and_then(|(_, port)| {
                port.parse::<u16>()
                    .map(drop)
                    .map_err(|e| format!("invalid TCP port: {e}"))
            })
        }
        Some(("ipc" | "inproc", "")) => Err("missing address".to_owned()),
        Some(("ipc" | "inproc", _)) => Ok(()),
        Some((scheme, _)) => Err(format!("unsupported scheme `{scheme}`")),
    };
    detail.map_err(|detail| format!("invalid ZMQ endpoint `{endpoint}`: {detail}"))
}

/// A 64-bit hash given as a signed (two's complement, as 1.6.1 wants) or unsigned integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AnyU64(u64);

impl<'de> Deserialize<'de> for AnyU64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = AnyU64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                // 1.6.1's words (it takes i64; kvatlas also takes u64).
                f.write_str("i64")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<AnyU64, E> {
                Ok(AnyU64(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<AnyU64, E> {
                Ok(AnyU64(v as u64))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

// ---------------------------------------------------------------------------------------------
// /register, /unregister
// ---------------------------------------------------------------------------------------------

/// `POST /register` (1.6.1's `RegisterRequest`, plus the Mooncake RFC's names).
#[derive(Debug, Deserialize)]
pub(crate) struct RegisterRequest {
    instance_id: u64,
    endpoint: String,
    #[serde(alias = "modelname")]
    model_name: String,
    routing_group: Option<String>,
    tenant_id: Option<String>,
    block_size: u32,
    dp_rank: Option<u32>,
    replay_endpoint: Option<String>,
    /// The Mooncake RFC's engine type: `vLLM` (default), `SGLang`.
    #[serde(rename = "type")]
    engine: Option<String>,
    #[serde(default, alias = "additionalsalt", rename = "additional_salt")]
    _additional_salt: Option<String>,
}

pub(crate) async fn register(
    AxumState(state): AxumState<Arc<State>>,
    headers: HeaderMap,
    Json(request): Json<RegisterRequest>,
) -> Response {
    let tenant = tenant_of(
        request.routing_group.as_deref(),
        request.tenant_id.as_deref(),
    );
    let caller = match caller(&state, &headers) {
        Ok(caller) => caller,
        Err(response) => return *response,
    };
    if let Err(e) = caller.check(&tenant) {
        return service_error(&e);
    }
    // 1.6.1's checks, in its order and words: the endpoints, a rank already registered, the
    // partition's block size.
    if let Err(message) = check_endpoint(&request.endpoint) {
        return error(StatusCode::BAD_REQUEST, message);
    }
    if let Some(replay) = &request.replay_endpoint
        && let Err(message) = check_endpoint(replay)
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!("invalid replay endpoint `{replay}`: {message}"),
        );
    }
    let rank = request.dp_rank.unwrap_or(0);
    if let Some(entry) = state
        .registry
        .get(&IndexKey::new(request.model_name.as_str(), tenant.as_str()))
    {
        if entry
            .feeds
            .lock()
            .contains_key(&Worker::new(request.instance_id, rank))
        {
            return error(
                StatusCode::CONFLICT,
                format!(
                    "instance {} dp_rank {rank} already registered",
                    request.instance_id
                ),
            );
        }
        if entry.block_size.get() != request.block_size {
            return error(
                StatusCode::CONFLICT,
                format!(
                    "block_size mismatch for model={} routing_group={}: existing={}, \
                     requested={}",
                    entry.key.model,
                    entry.key.tenant,
                    entry.block_size.get(),
                    request.block_size
                ),
            );
        }
    }
    let block_size = match block_size_field(request.block_size, "block_size") {
        Ok(size) => size,
        Err(e) => return service_error(&e),
    };
    let engine = match request.engine.as_deref() {
        None => EngineKind::Vllm,
        Some(kind) if kind.eq_ignore_ascii_case("vllm") => EngineKind::Vllm,
        Some(kind) if kind.eq_ignore_ascii_case("sglang") => EngineKind::Sglang,
        Some(other) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("unsupported engine type {other:?} (expected vLLM or SGLang)"),
            );
        }
    };
    let registration = WorkerRegistration {
        index: IndexKey::new(request.model_name, tenant),
        instance_id: request.instance_id,
        dp_rank: request.dp_rank.unwrap_or(0),
        block_size,
        engine,
        endpoint: request.endpoint.trim().to_owned(),
        replay_endpoint: request
            .replay_endpoint
            .map(|e| e.trim().to_owned())
            .filter(|e| !e.is_empty()),
        topic: String::new(),
        mode: SocketMode::Connect,
        pod_name: None,
    };
    let (instance, rank) = (registration.instance_id, registration.dp_rank);
    if let Err(e) = state.check_writable() {
        return service_error(&e);
    }
    let registry = Arc::clone(&state.registry);
    let registered = tokio::task::spawn_blocking(move || registry.register(registration)).await;
    state.update_gate();
    match registered {
        Ok(Ok(registered)) if registered.already_registered => error(
            StatusCode::CONFLICT,
            format!("instance {instance} dp_rank {rank} already registered"),
        ),
        Ok(Ok(_)) => ok(StatusCode::CREATED),
        // Registered meanwhile by another request (the checks above saw it free).
        Ok(Err(ServiceError::AlreadyExists(_))) => error(
            StatusCode::CONFLICT,
            format!("instance {instance} dp_rank {rank} already registered"),
        ),
        Ok(Err(ServiceError::FailedPrecondition(m))) => error(StatusCode::CONFLICT, m),
        Ok(Err(e)) => service_error(&e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// `POST /unregister`.
#[derive(Debug, Deserialize)]
pub(crate) struct UnregisterRequest {
    instance_id: u64,
    #[serde(alias = "modelname")]
    model_name: String,
    routing_group: Option<String>,
    tenant_id: Option<String>,
    dp_rank: Option<u32>,
}

pub(crate) async fn unregister(
    AxumState(state): AxumState<Arc<State>>,
    headers: HeaderMap,
    Json(request): Json<UnregisterRequest>,
) -> Response {
    let caller = match caller(&state, &headers) {
        Ok(caller) => caller,
        Err(response) => return *response,
    };
    // No group and no tenant: every tenant of the model (1.6.1: every routing group).
    let tenant = named_tenant(
        request.routing_group.as_deref(),
        request.tenant_id.as_deref(),
    )
    .map(|t| tenant_of(Some(t), None));
    if let Some(tenant) = &tenant
        && let Err(e) = caller.check(tenant)
    {
        return service_error(&e);
    }
    if let Err(e) = state.check_writable() {
        return service_error(&e);
    }
    let registry = Arc::clone(&state.registry);
    let done = tokio::task::spawn_blocking(move || {
        let may_use = |t: &str| caller.may_use(t);
        let (model, tenant) = (request.model_name.as_str(), tenant.as_deref());
        registry
            .unregister(model, tenant, request.instance_id, request.dp_rank, may_use)
            .map_err(|e| match e {
                ServiceError::NotFound(_) => ServiceError::NotFound(unregister_not_found(
                    &registry,
                    model,
                    tenant,
                    request.instance_id,
                    request.dp_rank,
                    may_use,
                )),
                other => other,
            })
    })
    .await;
    match done {
        Ok(Ok(_)) => ok(StatusCode::OK),
        Ok(Err(ServiceError::NotFound(message))) => error(StatusCode::NOT_FOUND, message),
        Ok(Err(e)) => service_error(&e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// 1.6.1's words for an unregistration that matched nothing: the rank is not registered, the
/// instance is registered elsewhere (the first such index), or it is not registered at all.
pub(crate) fn unregister_not_found(
    registry: &Registry,
    model: &str,
    tenant: Option<&str>,
    instance_id: u64,
    dp_rank: Option<u32>,
    may_use: impl Fn(&str) -> bool,
) -> String {
    let mut elsewhere = None;
    for entry in registry.all() {
        if !may_use(&entry.key.tenant)
            || entry
                .registered_pods(&BTreeSet::from([instance_id]))
                .is_empty()
        {
            continue;
        }
        let here = entry.key.model == model && tenant.is_none_or(|t| t == entry.key.tenant);
        if let (true, Some(rank)) = (here, dp_rank) {
            return format!("instance {instance_id} dp_rank {rank} not found");
        }
        elsewhere.get_or_insert(entry);
    }
    match elsewhere {
        Some(entry) => format!(
            "instance {instance_id} is registered for model={} routing_group={}",
            entry.key.model, entry.key.tenant
        ),
        None => format!("instance {instance_id} not found"),
    }
}

// ---------------------------------------------------------------------------------------------
// /workers
// ---------------------------------------------------------------------------------------------

/// `GET /workers` filters.
#[derive(Debug, Deserialize)]
pub(crate) struct WorkersParams {
    model_name: Option<String>,
    routing_group: Option<String>,
    tenant_id: Option<String>,
}

/// One listener of `/workers`: 1.6.1's fields, then kvatlas's sequencing figures (an
/// extension: a client of 1.6.1 ignores them).
#[derive(Debug, Serialize)]
struct ListenerInfo {
    endpoint: String,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_error: Option<String>,
    /// The last sequence number applied.
    last_seq: Option<u64>,
    /// Gaps, replays and resyncs so far.
    sequence: SequenceInfo,
}

/// How a listener's sequence went (kvatlas's extension of `/workers`).
#[derive(Debug, Serialize)]
struct SequenceInfo {
    gaps: u64,
    replays_completed: u64,
    replays_failed: u64,
    catch_ups: u64,
    probes: u64,
    resyncs: u64,
    replay_resyncs: u64,
    restarts: u64,
    duplicates: u64,
    held_dropped: u64,
}

/// One worker of `/workers` (1.6.1's `WorkerInfo`).
#[derive(Debug, Serialize)]
struct WorkerInfo {
    instance_id: u64,
    source: &'static str,
    status: &'static str,
    model_name: String,
    routing_group: String,
    block_size: u32,
    endpoints: BTreeMap<String, String>,
    listeners: BTreeMap<String, ListenerInfo>,
}

/// 1.6.1's listener states: `pending` (kvatlas: no batch yet, or held), `active`, `failed`.
fn status_name(status: ListenerStatus) -> &'static str {
    match status {
        ListenerStatus::Pending | ListenerStatus::Held => "pending",
        ListenerStatus::Active => "active",
        ListenerStatus::Failed | ListenerStatus::Stopped => "failed",
    }
}

pub(crate) async fn workers(
    AxumState(state): AxumState<Arc<State>>,
    headers: HeaderMap,
    QueryParams(params): QueryParams<WorkersParams>,
) -> Response {
    let caller = match caller(&state, &headers) {
        Ok(caller) => caller,
        Err(response) => return *response,
    };
    let tenant = named_tenant(params.routing_group.as_deref(), params.tenant_id.as_deref())
        .map(str::to_owned);
    // A tenant the caller may not use is refused, not answered with an empty list (an empty
    // group names no tenant: it lists nothing, as before).
    if let Some(tenant) = &tenant
        && let Err(e) = caller.check_named(tenant)
    {
        return service_error(&e);
    }
    let entries: Vec<_> = state
        .registry
        .all()
        .into_iter()
        .filter(|e| {
            params.model_name.as_ref().is_none_or(|m| *m == e.key.model)
                && tenant.as_ref().is_none_or(|t| *t == e.key.tenant)
                && caller.may_use(&e.key.tenant)
        })
        .collect();
    let listed = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for entry in entries {
            let views = entry.rank_views(&entry.blocks_per_rank());
            let mut by_instance: BTreeMap<u64, Vec<RankView>> = BTreeMap::new();
            for view in views {
                if !matches!(view.source, RankSource::BatchRank) {
                    by_instance
                        .entry(view.worker.worker_id)
                        .or_default()
                        .push(view);
                }
            }
            for (instance_id, views) in by_instance {
                out.push(worker_info(
                    &entry.key,
                    entry.block_size.get(),
                    instance_id,
                    &views,
                ));
            }
        }
        out
    })
    .await;
    match listed {
        Ok(listed) => (StatusCode::OK, Json(listed)).into_response(),
        // An empty 200 would tell a router the server has no workers.
        Err(failed) => {
            tracing::error!("GET /workers failed: {failed}");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the worker list could not be built: {failed}"),
            )
        }
    }
}

fn worker_info(
    key: &IndexKey,
    block_size: u32,
    instance_id: u64,
    views: &[RankView],
) -> WorkerInfo {
    let mut endpoints = BTreeMap::new();
    let mut listeners = BTreeMap::new();
    let mut grpc = false;
    for view in views {
        let endpoint = match &view.source {
            RankSource::Zmq(registration) => registration.endpoint.clone(),
            _ => {
                grpc = true;
                String::new()
            }
        };
        let rank = view.worker.dp_rank.to_string();
        endpoints.insert(rank.clone(), endpoint.clone());
        listeners.insert(
            rank,
            ListenerInfo {
                endpoint,
                status: status_name(view.status),
                last_error: view.last_error.clone(),
                last_seq: view.last_seq,
                sequence: SequenceInfo {
                    gaps: view.counters.gaps,
                    replays_completed: view.counters.replays_completed,
                    replays_failed: view.counters.replays_failed,
                    catch_ups: view.counters.catch_ups,
                    probes: view.counters.probes,
                    resyncs: view.counters.resyncs,
                    replay_resyncs: view.counters.replay_resyncs,
                    restarts: view.counters.restarts,
                    duplicates: view.counters.duplicates,
                    held_dropped: view.counters.held_dropped,
                },
            },
        );
    }
    // Aggregated with 1.6.1's priority: failed, pending, active.
    let status = ["failed", "pending", "active"]
        .into_iter()
        .find(|s| listeners.values().any(|l| l.status == *s))
        .unwrap_or("active");
    WorkerInfo {
        instance_id,
        source: if grpc { "grpc" } else { "zmq" },
        status,
        model_name: key.model.clone(),
        routing_group: key.tenant.clone(),
        block_size,
        endpoints,
        listeners,
    }
}

// ---------------------------------------------------------------------------------------------
// /query, /query_by_hash
// ---------------------------------------------------------------------------------------------

/// `POST /query` (1.6.1's fields, plus the Mooncake RFC's: `model`, `instance_id`,
/// `block_size`; its deprecated `lora_id` is refused with the reason).
pub(crate) type QueryRequest = QueryRequestOf<KeepFirst<u32>>;

/// `/query`'s fields, with the token ids as `T` (their raw JSON text on the fast path).
#[derive(Debug, Deserialize)]
pub(crate) struct QueryRequestOf<T> {
    token_ids: T,
    #[serde(alias = "model", alias = "modelname")]
    model_name: String,
    routing_group: Option<String>,
    tenant_id: Option<String>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    /// The RFC's: only this instance's ranks.
    instance_id: Option<u64>,
    /// The RFC's: the block size the caller hashed with.
    block_size: Option<u32>,
    /// The RFC's deprecated LoRA id (refused).
    lora_id: Option<Present>,
}

impl<T> QueryRequestOf<T> {
    /// The same request with other token ids.
    fn with_tokens<U>(self, token_ids: U) -> QueryRequestOf<U> {
        QueryRequestOf {
            token_ids,
            model_name: self.model_name,
            routing_group: self.routing_group,
            tenant_id: self.tenant_id,
            lora_name: self.lora_name,
            cache_salt: self.cache_salt,
            instance_id: self.instance_id,
            block_size: self.block_size,
            lora_id: self.lora_id,
        }
    }
}

/// The token ids are read from their raw text when they are plain integers (see
/// [`crate::fast_json`]): most of a 1,024-token query's parse.
impl FastParse for QueryRequest {
    fn fast_parse(bytes: &[u8]) -> Option<Self> {
        // The array's text borrowed from the body, not copied.
        let raw: QueryRequestOf<&serde_json::value::RawValue> =
            serde_json::from_slice(bytes).ok()?;
        let token_ids = crate::fast_json::parse_u32_array(
            raw.token_ids.get(),
            kvatlas_proto::codec::token_ids_kept(),
        )?;
        Some(raw.with_tokens(KeepFirst(token_ids)))
    }
}

impl FastParse for QueryByHashRequest {}

/// `POST /query_by_hash` (as `/query`, with the hashes instead of the tokens).
pub(crate) type QueryByHashRequest = QueryByHashRequestOf<KeepFirst<AnyU64>>;

/// `/query_by_hash`'s fields, with the hashes as `H` (a `Vec` in the tests comparing rejections).
#[derive(Debug, Deserialize)]
pub(crate) struct QueryByHashRequestOf<H> {
    #[serde(alias = "seq_hashes", alias = "block_hash")]
    block_hashes: H,
    #[serde(alias = "model", alias = "modelname")]
    model_name: String,
    routing_group: Option<String>,
    tenant_id: Option<String>,
    cache_salt: Option<String>,
    /// The RFC's: only this instance's ranks.
    instance_id: Option<u64>,
    /// The RFC's: the block size the caller hashed with.
    block_size: Option<u32>,
    /// The RFC's deprecated LoRA id (refused).
    lora_id: Option<Present>,
}

/// The Mooncake RFC's query fields that 1.6.1 does not have.
#[derive(Debug, Default)]
struct RfcQueryFields {
    /// Only this instance's ranks (omitted: every instance of the index).
    instance_id: Option<u64>,
    /// The block size the caller hashed with: checked against the index's.
    block_size: Option<u32>,
    /// The RFC's deprecated LoRA id, given: refused (an id cannot be mapped to the name engines
    /// hash).
    lora_id: bool,
}

/// A field whose presence is all that matters: its value is read past, never held (a refused
/// `lora_id` of a 8 MiB body made millions of `serde_json::Value`s first, outside the bounds the
/// query routes keep their lists in). `null` reads as absent, as for any `Option`.
#[derive(Debug)]
pub(crate) struct Present;

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        de::IgnoredAny::deserialize(deserializer).map(|_| Self)
    }
}

impl RfcQueryFields {
    /// The 400 answer for a field kvatlas cannot honour, if any.
    fn refusal(&self) -> Option<Response> {
        self.lora_id.then(|| {
            error(
                StatusCode::BAD_REQUEST,
                "lora_id is not accepted (the Mooncake RFC deprecates it): give the adapter's \
                 lora_name, which the engines mix into their block hashes",
            )
        })
    }

    /// The query options these fields ask for.
    fn options(&self) -> QueryOptions {
        QueryOptions {
            instances: self.instance_id.into_iter().collect(),
            ..QueryOptions::default()
        }
    }
}

/// `/query`'s answer as JSON bytes: `scores` (device tokens by instance, then rank; instances
/// with a device match only), `frequencies` (always empty, as in 1.6.1), `instances` (the
/// Mooncake RFC's tiered summary per instance: `longest_matched`, `gpu` (the best rank's device
/// tokens), `dp` (device tokens per rank), `cpu`, `disk`, cumulative, as 1.6.1 names them).
///
/// Written straight into one buffer: an answer lists every worker holding the prompt's first
/// block (often all of them), and building it as maps of strings cost more than the query.
fn score_response(matches: &Matches, block_size: u32) -> Vec<u8> {
    let tokens = |blocks: u32| u64::from(blocks) * u64::from(block_size);
    let mut sorted;
    let mut workers = matches.workers.as_slice();
    if !workers.is_sorted_by_key(|m| m.worker) {
        sorted = workers.to_vec();
        sorted.sort_by_key(|m| m.worker);
        workers = &sorted;
    }
    // Consecutive ranks of one instance (sorted by worker, so by instance first).
    let instances = || workers.chunk_by(|a, b| a.worker.worker_id == b.worker.worker_id);
    let mut out = Vec::with_capacity(64 + workers.len() * 96);
    // Numbers go through `itoa` (no formatter machinery: this is the hot part of an answer
    // listing 128 workers).
    let mut digits = itoa::Buffer::new();
    let mut number = |out: &mut Vec<u8>, n: u64| out.extend_from_slice(digits.format(n).as_bytes());
    out.extend_from_slice(b"{\"scores\":{");
    let mut first_instance = true;
    for ranks in instances() {
        if ranks.iter().all(|m| m.device == 0) {
            continue;
        }
        if !first_instance {
            out.push(b',');
        }
        first_instance = false;
        out.push(b'"');
        number(&mut out, ranks[0].worker.worker_id);
        out.extend_from_slice(b"\":{");
        let mut first_rank = true;
        for m in ranks.iter().filter(|m| m.device > 0) {
            if !first_rank {
                out.push(b',');
            }
            first_rank = false;
            out.push(b'"');
            number(&mut out, u64::from(m.worker.dp_rank));
            out.extend_from_slice(b"\":");
            number(&mut out, tokens(m.device));
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"},\"frequencies\":[],\"instances\":{");
    for (i, ranks) in instances().enumerate() {
        let best = |f: fn(&kvatlas_index::WorkerMatch) -> u32| {
            ranks.iter().map(|m| tokens(f(m))).max().unwrap_or(0)
        };
        if i > 0 {
            out.push(b',');
        }
        out.push(b'"');
        number(&mut out, ranks[0].worker.worker_id);
        out.extend_from_slice(b"\":{\"longest_matched\":");
        number(&mut out, best(|m| m.disk));
        out.extend_from_slice(b",\"gpu\":");
        number(&mut out, best(|m| m.device));
        out.extend_from_slice(b",\"dp\":{");
        for (j, m) in ranks.iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            out.push(b'"');
            number(&mut out, u64::from(m.worker.dp_rank));
            out.extend_from_slice(b"\":");
            number(&mut out, tokens(m.device));
        }
        out.extend_from_slice(b"},\"cpu\":");
        number(&mut out, best(|m| m.host));
        out.extend_from_slice(b",\"disk\":");
        number(&mut out, best(|m| m.disk));
        out.push(b'}');
    }
    out.extend_from_slice(b"}}");
    out
}

fn not_found(key: &IndexKey) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!(
            "no indexer for model={} routing_group={}",
            key.model, key.tenant
        ),
    )
}

fn answer(
    state: &State,
    headers: &HeaderMap,
    key: &IndexKey,
    input: QueryInput<'_>,
    lora_name: &str,
    cache_salt: &str,
    rfc: &RfcQueryFields,
) -> Response {
    if let Some(refusal) = rfc.refusal() {
        return refusal;
    }
    let caller = match caller(state, headers) {
        Ok(caller) => caller,
        Err(response) => return *response,
    };
    if let Err(e) = caller.check(&key.tenant) {
        return service_error(&e);
    }
    if let Err(e) = state.check_ready() {
        return service_error(&e);
    }
    let Some(entry) = state.registry.get(key) else {
        return not_found(key);
    };
    if let Some(size) = rfc.block_size
        && size != entry.block_size.get()
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "block_size mismatch for model={} routing_group={}: the index has {}, the \
                 query gives {size}",
                key.model,
                key.tenant,
                entry.block_size.get()
            ),
        );
    }
    match entry.query(
        input,
        lora_name,
        cache_salt,
        &rfc.options(),
        state.limits.max_query_tokens,
    ) {
        Ok(answer) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            score_response(&answer.matches, answer.block_size.get()),
        )
            .into_response(),
        Err(e) => service_error(&e),
    }
}

pub(crate) async fn query(
    AxumState(state): AxumState<Arc<State>>,
    headers: HeaderMap,
    FastJson(request): FastJson<QueryRequest>,
) -> Response {
    let key = IndexKey::new(
        request.model_name.clone(),
        tenant_of(
            request.routing_group.as_deref(),
            request.tenant_id.as_deref(),
        ),
    );
    answer(
        &state,
        &headers,
        &key,
        QueryInput::Tokens(&request.token_ids.0),
        request.lora_name.as_deref().unwrap_or_default(),
        request.cache_salt.as_deref().unwrap_or_default(),
        &RfcQueryFields {
            instance_id: request.instance_id,
            block_size: request.block_size,
            lora_id: request.lora_id.is_some(),
        },
    )
}

pub(crate) async fn query_by_hash(
    AxumState(state): AxumState<Arc<State>>,
    headers: HeaderMap,
    FastJson(request): FastJson<QueryByHashRequest>,
) -> Response {
    if request.cache_salt.is_some() {
        return error(
            StatusCode::BAD_REQUEST,
            "cache_salt is not accepted by /query_by_hash; block_hashes must already include the \
             intended cache salt",
        );
    }
    let key = IndexKey::new(
        request.model_name.clone(),
        tenant_of(
            request.routing_group.as_deref(),
            request.tenant_id.as_deref(),
        ),
    );
    // In place (the same allocation): a copy doubled what a body of hashes held.
    let hashes: Vec<u64> = request.block_hashes.0.into_iter().map(|h| h.0).collect();
    answer(
        &state,
        &headers,
        &key,
        QueryInput::LocalHashes(&hashes),
        "",
        "",
        &RfcQueryFields {
            instance_id: request.instance_id,
            block_size: request.block_size,
            lora_id: request.lora_id.is_some(),
        },
    )
}

// ---------------------------------------------------------------------------------------------
// /dump (both ways)
// ---------------------------------------------------------------------------------------------

/// 1.6.1's storage tier names.
fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host_pinned",
        Tier::Disk => "disk",
        Tier::External => "external",
    }
}

fn tier_of_name(name: &str) -> Option<Tier> {
    match name {
        "device" => Some(Tier::Device),
        "host_pinned" => Some(Tier::Host),
        "disk" => Some(Tier::Disk),
        "external" => Some(Tier::External),
        _ => None,
    }
}

/// A block on the cycle of parent links above `block`, a held block no root reaches (its
/// parents are all held, none written: a written parent's children are written with it, so
/// following them from `block` comes back to a block already passed).
fn cycle_above(
    block: ExternalBlockHash,
    held: &BTreeMap<ExternalBlockHash, (LocalBlockHash, Option<ExternalBlockHash>)>,
) -> ExternalBlockHash {
    let mut passed = BTreeSet::new();
    let mut at = block;
    while passed.insert(at) {
        match held
            .get(&at)
            .and_then(|b| b.1)
            .filter(|p| held.contains_key(p))
        {
            Some(parent) => at = parent,
            None => return at,
        }
    }
    at
}

/// The events of one index in 1.6.1's `RouterEvent` JSON, each handed to `emit` as it is made
/// (one run of blocks in memory at a time): per rank and tier, one `stored` event per run of
/// blocks (each block's parent the one before it), parents before children; event ids count
/// from 0 per tier, as 1.6.1 numbers them.
///
/// # Errors
/// The first of `emit`'s, which ends the walk.
fn each_dump_event<E>(
    snapshot: &Snapshot,
    mut emit: impl FnMut(&Value) -> Result<(), E>,
) -> Result<(), E> {
    for tier in Tier::ALL {
        let mut event_id = 0u64;
        for worker in &snapshot.workers {
            let held: BTreeMap<ExternalBlockHash, (LocalBlockHash, Option<ExternalBlockHash>)> =
                worker
                    .blocks
                    .iter()
                    .filter(|b| b.tiers.contains(tier))
                    .map(|b| (b.external, (b.local, b.parent)))
                    .collect();
            let mut children: BTreeMap<ExternalBlockHash, Vec<ExternalBlockHash>> = BTreeMap::new();
            let mut roots = Vec::new();
            for (&external, &(_, parent)) in &held {
                match parent.filter(|p| held.contains_key(p)) {
                    Some(p) => children.entry(p).or_default().push(external),
                    None => roots.push(external),
                }
            }
            // Depth first from each root; a run continues while a block has one child not yet
            // written. Blocks no root reaches lie on a cycle of parent links (an engine can
            // report one) or below one: once the roots are done, the cycle above the first of
            // them not written is entered at one of its blocks, which starts a run with its
            // recorded parent, and so on until every held block is written once — each after
            // its parent but for the block a cycle is entered at.
            let mut written: BTreeSet<ExternalBlockHash> = BTreeSet::new();
            let mut unreached = held.keys();
            let mut stack: Vec<(ExternalBlockHash, Option<ExternalBlockHash>)> = roots
                .iter()
                .rev()
                .map(|&r| (r, held.get(&r).and_then(|h| h.1)))
                .collect();
            while let Some((start, parent)) = stack.pop().or_else(|| {
                unreached
                    .by_ref()
                    .find(|h| !written.contains(*h))
                    .map(|&h| {
                        let entry = cycle_above(h, &held);
                        (entry, held.get(&entry).and_then(|b| b.1))
                    })
            }) {
                if !written.insert(start) {
                    continue;
                }
                let mut run = vec![start];
                let mut at = start;
                loop {
                    match children.get(&at).map(Vec::as_slice) {
                        Some([only]) if !written.contains(only) => {
                            written.insert(*only);
                            run.push(*only);
                            at = *only;
                        }
                        Some(many) => {
                            stack.extend(
                                many.iter()
                                    .rev()
                                    .filter(|c| !written.contains(*c))
                                    .map(|&c| (c, Some(at))),
                            );
                            break;
                        }
                        None => break,
                    }
                }
                let blocks: Vec<Value> = run
                    .iter()
                    .map(|h| {
                        json!({
                            "block_hash": h.get(),
                            "tokens_hash": held.get(h).map_or(0, |b| b.0.get()),
                            "mm_extra_info": null,
                        })
                    })
                    .collect();
                emit(&json!({
                    "worker_id": worker.worker.worker_id,
                    "storage_tier": tier_name(tier),
                    "residency_domain": "worker",
                    "event": {
                        "event_id": event_id,
                        "data": {"stored": {
                            "parent_hash": parent.map(ExternalBlockHash::get),
                            "start_position": null,
                            "blocks": blocks,
                        }},
                        "dp_rank": worker.worker.dp_rank,
                    },
                }))?;
                event_id += 1;
            }
        }
    }
    Ok(())
}

/// Writes `/dump` for `images`: `{"model:tenant": {"block_size": n, "events": [...], "model":
/// .., "tenant": ..}}`, keys in order, as `serde_json` orders a map's. The events are written
/// as they are made, so the dump never holds more than one run of blocks as JSON values (a
/// whole dump built as one value took hundreds of bytes per block).
///
/// The key is Dynamo's; `model` and `tenant` are kvatlas's additions (Dynamo's reader ignores
/// them) because the key is ambiguous when a name holds a colon (`llama3:8b`). Two indexes whose
/// keys coincide (model `a:b` tenant `c`, model `a` tenant `b:c`) are both written: the second
/// under its key with `#2` (`#3`, ...) appended, which kvatlas's reader does not need (it reads
/// `model` and `tenant`), where a plain insert kept only the last.
///
/// # Errors
/// The sink's.
pub(crate) fn write_dump(
    images: &[IndexImage],
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let mut keyed: BTreeMap<String, &IndexImage> = BTreeMap::new();
    for image in images {
        let plain = format!("{}:{}", image.key.model, image.key.tenant);
        let mut key = plain.clone();
        let mut copy = 1;
        while keyed.contains_key(&key) {
            copy += 1;
            key = format!("{plain}#{copy}");
        }
        keyed.insert(key, image);
    }
    out.write_all(b"{")?;
    for (at, (key, image)) in keyed.iter().enumerate() {
        if at > 0 {
            out.write_all(b",")?;
        }
        serde_json::to_writer(&mut *out, key)?;
        write!(
            out,
            ":{{\"block_size\":{},\"events\":[",
            image.block_size.get()
        )?;
        let mut first = true;
        each_dump_event(&image.snapshot, |event| {
            if !std::mem::take(&mut first) {
                out.write_all(b",")?;
            }
            serde_json::to_writer(&mut *out, event).map_err(std::io::Error::from)
        })?;
        out.write_all(b"],\"model\":")?;
        serde_json::to_writer(&mut *out, &image.key.model)?;
        out.write_all(b",\"tenant\":")?;
        serde_json::to_writer(&mut *out, &image.key.tenant)?;
        out.write_all(b"}")?;
    }
    out.write_all(b"}")
}

/// `/dump` for `images` as one JSON value (what [`write_dump`] writes, read back).
#[cfg(test)]
pub(crate) fn dump(images: &[IndexImage]) -> Value {
    let mut bytes = Vec::new();
    write_dump(images, &mut bytes).expect("a Vec takes every write");
    serde_json::from_slice(&bytes).expect("write_dump writes JSON")
}

/// `GET /dump`: built under a place among the whole-state reads, then streamed by a task that
/// holds that place and the request's (`crate::snapshot_stream`), so a reader that stalls loses
/// them with the stall timeout.
pub(crate) async fn dump_route(
    AxumState(state): AxumState<Arc<State>>,
    Extension(place): Extension<crate::state::HandedPlace>,
    headers: HeaderMap,
) -> Response {
    let caller = match caller(&state, &headers) {
        Ok(caller) => caller,
        Err(response) => return *response,
    };
    let held = match state.admit_dump("/dump", place.take()) {
        Ok(held) => held,
        // In the `{"error": ...}` form of every Dynamo route.
        Err(refused) => return service_error(&refused),
    };
    let registry = Arc::clone(&state.registry);
    // The images are taken under the places: a client that goes away meanwhile does not free
    // them while the images are in memory. Their JSON is written as the reader takes it.
    let images = tokio::task::spawn_blocking(move || {
        let images: Vec<IndexImage> = registry
            .all()
            .iter()
            .filter(|e| caller.may_use(&e.key.tenant))
            .map(|e| e.image())
            .collect();
        (images, held)
    })
    .await;
    match images {
        Ok((images, held)) => {
            let chunks = crate::snapshot_stream::stream_written(
                move |sink| {
                    write_dump(&images, sink)
                        .map_err(|e| format!("the dump could not be written: {e}"))
                },
                held,
                state.limits.stall_timeout,
                crate::snapshot_stream::CHUNK,
            );
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                axum::body::Body::from_stream(chunks),
            )
                .into_response()
        }
        // An empty 200 would tell a Dynamo replica the server holds nothing.
        Err(failed) => {
            tracing::error!("GET /dump failed: {failed}");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the dump could not be built: {failed}"),
            )
        }
    }
}

/// One partition of a peer's `/dump`: its block size and events, or, from Dynamo, the error
/// that kept the peer from dumping it (`{"error": ...}`; peers.md §1.12).
#[derive(Debug, Deserialize)]
struct DumpEntry {
    #[serde(default)]
    block_size: Option<u32>,
    /// kvatlas's dumps name the model and tenant (Dynamo's name them only in the key).
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    events: Option<Vec<RouterEvent>>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RouterEvent {
    worker_id: u64,
    #[serde(default = "device_tier")]
    storage_tier: String,
    event: KvCacheEvent,
}

fn device_tier() -> String {
    "device".to_owned()
}

#[derive(Debug, Deserialize)]
struct KvCacheEvent {
    data: EventData,
    #[serde(default)]
    dp_rank: u32,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum EventData {
    Stored(StoredData),
    Removed(RemovedData),
    Cleared,
}

#[derive(Debug, Deserialize)]
struct StoredData {
    parent_hash: Option<u64>,
    blocks: Vec<StoredBlockData>,
}

#[derive(Debug, Deserialize)]
struct StoredBlockData {
    block_hash: u64,
    tokens_hash: u64,
}

#[derive(Debug, Deserialize)]
struct RemovedData {
    block_hashes: Vec<u64>,
}

/// A peer's `/dump` as indexes to create and the mutations that rebuild them, in order.
pub(crate) type DumpImport = Vec<(IndexKey, u32, Vec<Mutation>)>;

/// A parsed `/dump`.
#[derive(Debug)]
pub(crate) struct ParsedDump {
    /// The indexes it rebuilds.
    pub(crate) indexes: DumpImport,
    /// The partitions the peer could not dump (left out), each as `KEY (ITS ERROR)`.
    pub(crate) skipped: Vec<String>,
}

/// Parses a Dynamo (or kvatlas) `/dump` body.
///
/// # Errors
/// What is malformed, in a sentence.
pub(crate) fn parse_dump(body: &[u8]) -> Result<ParsedDump, String> {
    let parsed: BTreeMap<String, DumpEntry> =
        serde_json::from_slice(body).map_err(|e| format!("the dump is not valid: {e}"))?;
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for (key, entry) in parsed {
        // A partition the peer could not dump is left out; the others are taken (a whole dump
        // refused for one failed partition left a replica with nothing from that peer).
        if let Some(error) = &entry.error {
            tracing::warn!(
                partition = %key,
                "the peer could not dump this partition ({error}); it is not bootstrapped \
                 from this peer"
            );
            skipped.push(format!("{key} ({error})"));
            continue;
        }
        let (Some(block_size), Some(events)) = (entry.block_size, entry.events) else {
            return Err(format!(
                "dump partition {key:?} has no block_size or no events (nor an error)"
            ));
        };
        let index_key = match (entry.model, entry.tenant) {
            (Some(model), Some(tenant)) => IndexKey::new(model, tenant),
            // Dynamo's dump: the key alone. Its own reader splits at the first colon, which
            // misreads a model named `llama3:8b`; model names hold colons far more often than
            // routing groups do, so the split is at the last one.
            _ => {
                let (model, group) = key
                    .rsplit_once(':')
                    .ok_or_else(|| format!("invalid dump key {key:?} (expected model:group)"))?;
                IndexKey::new(model, group)
            }
        };
        index_key
            .validate()
            .map_err(|e| format!("dump key {key:?}: {e}"))?;
        let mut mutations = Vec::with_capacity(events.len());
        for event in events {
            let tier = tier_of_name(&event.storage_tier)
                .ok_or_else(|| format!("unknown storage tier {:?}", event.storage_tier))?;
            let worker = Worker::new(event.worker_id, event.event.dp_rank);
            mutations.push(match event.event.data {
                EventData::Stored(stored) => Mutation::Stored {
                    worker,
                    tier,
                    parent: stored.parent_hash.map(ExternalBlockHash::new),
                    blocks: stored
                        .blocks
                        .iter()
                        .map(|b| StoredBlock {
                            external: ExternalBlockHash::new(b.block_hash),
                            local: LocalBlockHash::new(b.tokens_hash),
                        })
                        .collect(),
                },
                EventData::Removed(removed) => Mutation::Removed {
                    worker,
                    tier,
                    blocks: removed
                        .block_hashes
                        .into_iter()
                        .map(ExternalBlockHash::new)
                        .collect(),
                },
                EventData::Cleared => Mutation::Cleared { worker },
            });
        }
        out.push((index_key, block_size, mutations));
    }
    Ok(ParsedDump {
        indexes: out,
        skipped,
    })
}

/// Applies a parsed dump whole or not at all: each index's events are applied in order to an
/// index of its own, and the results are restored together (`Registry::restore_images`: a key
/// twice, a block size that contradicts the server's index, the index limit are refused before
/// anything changes; a restored index's contents are replaced). Returns the events applied.
///
/// # Errors
/// A block size the index cannot take; an index holding more (rank, block) pairs than
/// `--capacity`; what `Registry::restore_images` refuses.
pub(crate) fn apply_dump(registry: &Registry, dump: DumpImport) -> Result<u64, ServiceError> {
    let capacity = registry.read_limits().capacity;
    let mut applied = 0u64;
    let mut images = Vec::with_capacity(dump.len());
    for (key, block_size, mutations) in dump {
        let block_size = block_size_field(block_size, "the dump's block_size")?;
        let mut index = kvatlas_index::Atlas::new();
        for (at, mutation) in mutations.iter().enumerate() {
            kvatlas_index::KvIndex::apply(&mut index, mutation);
            // As applied, not only once whole: a dump far beyond the bound is refused before
            // it is all held. (A (rank, block) pair is one to four memberships, one per tier.)
            if let Some(capacity) = capacity
                && at % 4096 == 4095
            {
                let memberships = kvatlas_index::KvIndex::stats(&index).memberships;
                if memberships > capacity.saturating_mul(4) {
                    return Err(ServiceError::FailedPrecondition(format!(
                        "the dump's index for {key} holds more than {capacity} (rank, block) \
                         pairs after {} of its events, more than this server's --capacity of \
                         {capacity}",
                        at + 1
                    )));
                }
            }
        }
        applied += mutations.len() as u64;
        let snapshot = kvatlas_index::KvIndex::snapshot(&index);
        if let Some(capacity) = capacity
            && snapshot.blocks() as u64 > capacity
        {
            return Err(ServiceError::FailedPrecondition(format!(
                "the dump's index for {key} holds {} (rank, block) pairs, more than this \
                 server's --capacity of {capacity}",
                snapshot.blocks()
            )));
        }
        images.push(IndexImage {
            key,
            block_size,
            capacity: None,
            feeds: Vec::new(),
            marks: BTreeMap::new(),
            snapshot,
        });
    }
    registry.restore_images(&images, None)?;
    Ok(applied)
}

// ---------------------------------------------------------------------------------------------
// Peers
// ---------------------------------------------------------------------------------------------

/// `POST /register_peer`, `/deregister_peer`.
#[derive(Debug, Deserialize)]
pub(crate) struct PeerRequest {
    url: String,
}

/// Most peers a server keeps (1.6.1 keeps any number; a bound keeps the list's memory bounded).
pub(crate) const MAX_PEERS: usize = 256;
/// Longest peer URL accepted.
pub(crate) const MAX_PEER_URL_BYTES: usize = 2048;

pub(crate) async fn register_peer(
    AxumState(state): AxumState<Arc<State>>,
    headers: HeaderMap,
    Json(request): Json<PeerRequest>,
) -> Response {
    if let Err(response) = server_wide_caller(&state, &headers) {
        return *response;
    }
    if request.url.len() > MAX_PEER_URL_BYTES {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "the peer url is {} bytes long; at most {MAX_PEER_URL_BYTES} are accepted",
                request.url.len()
            ),
        );
    }
    let mut peers = state.peers.lock();
    if peers.len() >= MAX_PEERS && !peers.contains(&request.url) {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "{MAX_PEERS} peers are registered, the most this server keeps: deregister one \
                 first"
            ),
        );
    }
    peers.insert(request.url);
    ok(StatusCode::CREATED)
}

pub(crate) async fn deregister_peer(
    AxumState(state): AxumState<Arc<State>>,
    headers: HeaderMap,
    Json(request): Json<PeerRequest>,
) -> Response {
    if let Err(response) = server_wide_caller(&state, &headers) {
        return *response;
    }
    if state.peers.lock().remove(&request.url) {
        ok(StatusCode::OK)
    } else {
        error(StatusCode::NOT_FOUND, "peer not found")
    }
}

pub(crate) async fn peers(AxumState(state): AxumState<Arc<State>>, headers: HeaderMap) -> Response {
    if let Err(response) = server_wide_caller(&state, &headers) {
        return *response;
    }
    let peers: Vec<String> = state.peers.lock().iter().cloned().collect();
    (StatusCode::OK, Json(peers)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvatlas_index::{KvIndex, ReferenceIndex, SnapshotBlock, TierSet, WorkerSnapshot};

    /// `lora_id` counts by its presence, whatever its value (read past, not held); `null` is
    /// absent, as `Option<Value>` read it.
    #[test]
    fn lora_id_is_a_presence() {
        let parse = |lora_id: &str| {
            let body = format!(r#"{{"model_name":"m","token_ids":[1],"lora_id":{lora_id}}}"#);
            let query: QueryRequest = serde_json::from_str(&body).expect("parses");
            let by_hash: QueryByHashRequest =
                serde_json::from_str(&body.replace("token_ids", "block_hashes")).expect("parses");
            assert_eq!(query.lora_id.is_some(), by_hash.lora_id.is_some());
            query.lora_id.is_some()
        };
        assert!(parse("7"));
        assert!(parse(r#"{"a":[1,[2,{"b":"c"}]]}"#));
        let long = format!("[{}0]", "0,".repeat(100_000));
        assert!(parse(&long));
        assert!(!parse("null"));
        let bad = r#"{"model_name":"m","token_ids":[1],"lora_id":[1,}"#;
        assert!(serde_json::from_str::<QueryRequest>(bad).is_err());
    }

    /// The query routes' lists (`KeepFirst`) are rejected with the status and text axum's
    /// `Json` gives for a `Vec` (its path tracking included), and accepted with the same ids:
    /// the texts Dynamo's own service answers (`tests/dynamo_compat.rs`).
    #[tokio::test]
    async fn query_lists_are_read_as_vecs_are() {
        use axum::body::Body;
        use axum::extract::{FromRequest, Request};

        async fn read<T: serde::de::DeserializeOwned, V>(
            body: &str,
            ids: impl Fn(T) -> V,
        ) -> Result<V, (u16, String)> {
            let request = Request::builder()
                .method("POST")
                .uri("/")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body.to_owned()))
                .expect("a valid request");
            Json::<T>::from_request(request, &())
                .await
                .map(|Json(value)| ids(value))
                .map_err(|e| (e.status().as_u16(), e.body_text()))
        }
        let bodies = |field: &str| {
            [
                "[1,2,3]",
                "[]",
                "[1,-2,3]",
                "[1,2.5]",
                "[1,\"2\"]",
                "[1,null]",
                "\"1,2\"",
                "{\"a\":1}",
                "[1,2,]",
                "[1,2",
                "[18446744073709551616]",
            ]
            .map(|list| format!(r#"{{"model_name":"m","{field}":{list}}}"#))
        };
        for body in bodies("token_ids") {
            let kept = read(&body, |q: QueryRequest| q.token_ids.0).await;
            let whole = read(&body, |q: QueryRequestOf<Vec<u32>>| q.token_ids).await;
            assert_eq!(kept, whole, "{body}");
        }
        let mut rejections = 0;
        for body in bodies("block_hashes") {
            let kept = read(&body, |q: QueryByHashRequest| q.block_hashes.0).await;
            let whole = read(&body, |q: QueryByHashRequestOf<Vec<AnyU64>>| q.block_hashes).await;
            rejections += usize::from(whole.is_err());
            assert_eq!(kept, whole, "{body}");
        }
        assert!(rejections >= 8, "the bodies cover rejections");
    }

    /// The peer list is bounded in count and URL length, with a message saying so.
    #[tokio::test]
    async fn the_peer_list_is_bounded() {
        let registry = Arc::new(crate::registry::Registry::new(
            crate::config::IndexSettings::default(),
            crate::config::Limits::default(),
        ));
        let state = Arc::new(State::new(
            registry,
            crate::config::Limits::default(),
            None,
            0,
        ));
        let register = |url: String| {
            let state = Arc::clone(&state);
            async move {
                register_peer(
                    AxumState(state),
                    HeaderMap::new(),
                    Json(PeerRequest { url }),
                )
                .await
                .status()
            }
        };
        for i in 0..MAX_PEERS {
            assert_eq!(
                register(format!("http://h{i}:1")).await,
                StatusCode::CREATED
            );
        }
        // Again: already there, accepted.
        assert_eq!(register("http://h0:1".into()).await, StatusCode::CREATED);
        assert_eq!(
            register("http://one-more:1".into()).await,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            register(format!("http://{}", "x".repeat(MAX_PEER_URL_BYTES))).await,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(state.peers.lock().len(), MAX_PEERS);
        let removed = deregister_peer(
            AxumState(Arc::clone(&state)),
            HeaderMap::new(),
            Json(PeerRequest {
                url: "http://h0:1".into(),
            }),
        )
        .await;
        assert_eq!(removed.status(), StatusCode::OK);
        assert_eq!(
            register("http://one-more:1".into()).await,
            StatusCode::CREATED
        );
    }

    #[test]
    fn an_empty_routing_group_does_not_hide_the_tenant_id() {
        assert_eq!(named_tenant(Some(""), Some("cust-a")), Some("cust-a"));
        assert_eq!(tenant_of(Some(""), Some("cust-a")), "cust-a");
        assert_eq!(
            tenant_of(Some("g"), Some("cust-a")),
            "g",
            "the group comes first"
        );
        assert_eq!(tenant_of(None, Some("cust-a")), "cust-a");
        assert_eq!(tenant_of(Some(""), Some("")), DEFAULT_TENANT);
        assert_eq!(tenant_of(None, None), DEFAULT_TENANT);
        // `/workers` and `/unregister` tell "only empty names" from "no name".
        assert_eq!(named_tenant(Some(""), None), Some(""));
        assert_eq!(named_tenant(None, Some("")), Some(""));
        assert_eq!(named_tenant(None, None), None);
    }

    #[test]
    fn scores_and_instances_follow_dynamo() {
        let matches = Matches {
            workers: vec![
                kvatlas_index::WorkerMatch::new(Worker::new(4, 2), 2, 2, 2),
                kvatlas_index::WorkerMatch::new(Worker::new(4, 3), 1, 1, 1),
                kvatlas_index::WorkerMatch::new(Worker::new(3, 0), 0, 0, 2),
            ],
        };
        let response: Value =
            serde_json::from_slice(&score_response(&matches, 16)).expect("valid JSON");
        assert_eq!(
            response,
            json!({
                "scores": {"4": {"2": 32, "3": 16}},
                "frequencies": [],
                "instances": {
                    "3": {"longest_matched": 32, "gpu": 0, "dp": {"0": 0}, "cpu": 0, "disk": 32},
                    "4": {"longest_matched": 32, "gpu": 32, "dp": {"2": 32, "3": 16}, "cpu": 32, "disk": 32},
                },
            })
        );
    }

    #[test]
    fn endpoints_are_checked_with_dynamos_words() {
        // Observed on the 1.6.1 wheel (`tests/dynamo_compat.rs` compares the live answers).
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://*:5557",
            "tcp://[::1]:5",
            "tcp://h:+5",
            "ipc:///tmp/x.sock",
            "inproc://x",
        ] {
            assert_eq!(check_endpoint(ok), Ok(()), "{ok}");
        }
        for (bad, detail) in [
            ("not-a-url", "missing scheme"),
            ("", "missing scheme"),
            ("tcp:/x:5", "missing scheme"),
            ("http://127.0.0.1:5994", "unsupported scheme `http`"),
            ("TCP://h:5", "unsupported scheme `TCP`"),
            (" tcp://h:5", "unsupported scheme ` tcp`"),
            ("tcp://127.0.0.1", "missing TCP port"),
            ("tcp://a:b:5", "missing TCP port"),
            ("tcp://::1:5", "missing TCP port"),
            ("tcp://:5", "missing TCP host"),
            ("tcp://[::1]", "missing closing `]`"),
            (
                "tcp://h:",
                "invalid TCP port: cannot parse integer from empty string",
            ),
            (
                "tcp://h:5/path",
                "invalid TCP port: invalid digit found in string",
            ),
            (
                "tcp://h:99999",
                "invalid TCP port: number too large to fit in target type",
            ),
            ("ipc://", "missing address"),
            ("inproc://", "missing address"),
        ] {
            assert_eq!(
                check_endpoint(bad),
                Err(format!("invalid ZMQ endpoint `{bad}`: {detail}")),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_dump_rebuilds_the_same_state() {
        // Two ranks, a branch, a hole, two tiers.
        let block = |e: u64, p: Option<u64>, tiers: u8| SnapshotBlock {
            external: ExternalBlockHash::new(e),
            local: LocalBlockHash::new(e * 7),
            parent: p.map(ExternalBlockHash::new),
            tiers: TierSet::from_bits(tiers),
        };
        let snapshot = Snapshot {
            workers: vec![
                WorkerSnapshot {
                    worker: Worker::new(1, 0),
                    blocks: vec![
                        block(10, None, 1),
                        block(11, Some(10), 1),
                        block(12, Some(11), 3),
                        block(13, Some(11), 1),
                        block(20, Some(99), 1),
                        // A cycle of parent links, with blocks below it (one before its blocks
                        // in hash order): no root reaches them.
                        block(39, Some(43), 1),
                        block(40, Some(42), 1),
                        block(41, Some(40), 1),
                        block(42, Some(41), 1),
                        block(43, Some(41), 1),
                    ],
                },
                WorkerSnapshot {
                    worker: Worker::new(2, 1),
                    blocks: vec![block(30, None, 2), block(31, Some(30), 2)],
                },
            ],
        };
        let image = IndexImage {
            // A colon in the model name: the key `llama3:8b:g` alone is ambiguous.
            key: IndexKey::new("llama3:8b", "g"),
            block_size: kvatlas_hash::BlockSize::new(16).expect("16"),
            capacity: None,
            feeds: Vec::new(),
            marks: BTreeMap::new(),
            snapshot: snapshot.clone(),
        };
        let dumped = dump(&[image]);
        // Each block after its parent, but for the one a cycle is entered at.
        let order: Vec<u64> = dumped["llama3:8b:g"]["events"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["worker_id"] == 1 && e["storage_tier"] == "device")
            .flat_map(|e| {
                e["event"]["data"]["stored"]["blocks"]
                    .as_array()
                    .expect("blocks")
                    .iter()
                    .map(|b| b["block_hash"].as_u64().expect("hash"))
                    .collect::<Vec<_>>()
            })
            .collect();
        let at = |hash: u64| order.iter().position(|&h| h == hash).expect("dumped");
        let parents = [
            (11, 10),
            (12, 11),
            (13, 11),
            (41, 40),
            (42, 41),
            (40, 42),
            (43, 41),
            (39, 43),
        ];
        let before: Vec<u64> = parents
            .iter()
            .filter(|&&(child, parent)| at(child) < at(parent))
            .map(|&(child, _)| child)
            .collect();
        assert!(
            matches!(before.as_slice(), [40..=42]),
            "one block of the cycle precedes its parent, no other: {before:?} in {order:?}"
        );
        let body = serde_json::to_vec(&dumped).expect("json");
        let parsed = parse_dump(&body).expect("parses").indexes;
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].0, IndexKey::new("llama3:8b", "g"));
        let mut rebuilt = ReferenceIndex::new();
        for m in &parsed[0].2 {
            rebuilt.apply(m);
        }
        assert_eq!(rebuilt.snapshot(), snapshot);
        // Through a server's registry.
        let registry = Registry::new(
            crate::config::IndexSettings::default(),
            crate::config::Limits::default(),
        );
        apply_dump(&registry, parsed).expect("applied");
        let restored = registry
            .get(&IndexKey::new("llama3:8b", "g"))
            .expect("the index");
        assert_eq!(restored.image().snapshot, snapshot);
    }

    /// A dump beyond `--capacity` is refused as it is applied, not once all of it is held.
    #[test]
    fn a_dump_beyond_the_capacity_is_refused_as_it_is_applied() {
        let registry = Registry::new(
            crate::config::IndexSettings {
                capacity: Some(10),
                ..crate::config::IndexSettings::default()
            },
            crate::config::Limits::default(),
        );
        let events: Vec<Mutation> = (0..10_000u64)
            .map(|i| Mutation::Stored {
                worker: Worker::new(1, 0),
                tier: kvatlas_index::Tier::Device,
                parent: None,
                blocks: vec![StoredBlock {
                    external: ExternalBlockHash::new(i + 1),
                    local: LocalBlockHash::new(i + 1),
                }],
            })
            .collect();
        let refused = apply_dump(&registry, vec![(IndexKey::new("m", "g"), 16, events)])
            .expect_err("beyond the capacity");
        assert!(
            refused.to_string().contains("after 4096 of its events"),
            "{refused}"
        );
        assert!(registry.all().is_empty(), "nothing applied");
    }

    /// A dump is applied whole or not at all: one index whose block size contradicts the
    /// server's, or one index named twice, and nothing of the dump is applied.
    #[test]
    fn a_dump_is_applied_whole_or_not_at_all() {
        let registry = Registry::new(
            crate::config::IndexSettings::default(),
            crate::config::Limits::default(),
        );
        let stored = r#"{"worker_id": 1, "event": {"data": {"stored": {"parent_hash": null,
            "blocks": [{"block_hash": 5, "tokens_hash": 50}]}}}}"#;
        let existing = format!(r#"{{"m:g": {{"block_size": 32, "events": [{stored}]}}}}"#);
        apply_dump(
            &registry,
            parse_dump(existing.as_bytes()).expect("parses").indexes,
        )
        .expect("applied");
        let before = registry.all().len();
        let contradicting = format!(
            r#"{{"a:g": {{"block_size": 16, "events": [{stored}]}},
                "m:g": {{"block_size": 16, "events": [{stored}]}}}}"#
        );
        let twice = format!(
            r#"{{"b:g": {{"block_size": 16, "events": [{stored}]}},
                "x": {{"block_size": 16, "model": "b", "tenant": "g", "events": []}}}}"#
        );
        for body in [contradicting, twice] {
            let parsed = parse_dump(body.as_bytes()).expect("parses").indexes;
            assert!(apply_dump(&registry, parsed).is_err(), "{body}");
            assert_eq!(registry.all().len(), before, "no index created: {body}");
        }
        let kept = registry.get(&IndexKey::new("m", "g")).expect("m");
        assert_eq!(kept.image().snapshot.blocks(), 1);
    }

    /// A partition Dynamo answers with its error is left out and the others are taken; a
    /// partition with neither events nor an error is refused.
    #[test]
    fn a_dump_partition_the_peer_could_not_dump_is_left_out() {
        let body =
            br#"{"a:g": {"error": "lock poisoned"}, "b:g": {"block_size": 16, "events": []}}"#;
        let parsed = parse_dump(body).expect("parses");
        assert_eq!(parsed.skipped, vec!["a:g (lock poisoned)".to_owned()]);
        let keys: Vec<_> = parsed
            .indexes
            .iter()
            .map(|(key, size, _)| (key.clone(), *size))
            .collect();
        assert_eq!(keys, vec![(IndexKey::new("b", "g"), 16)]);
        let refused = parse_dump(br#"{"b:g": {"block_size": 16}}"#).expect_err("no events");
        assert!(
            refused.contains("\"b:g\" has no block_size or no events"),
            "{refused}"
        );
    }

    #[test]
    fn a_dynamo_dump_key_is_split_at_its_last_colon() {
        // Dynamo's dumps name the partition only in the key; Dynamo's own reader splits it at
        // the first colon and would read model `llama3`, group `8b:default`.
        let body = br#"{"llama3:8b:default": {"block_size": 16, "events": []}, "m:": {"block_size": 16, "events": []}}"#;
        let parsed = parse_dump(body).expect("parses").indexes;
        let keys: Vec<_> = parsed.iter().map(|(key, _, _)| key.clone()).collect();
        assert_eq!(
            keys,
            vec![
                IndexKey::new("llama3:8b", "default"),
                IndexKey::new("m", "default")
            ]
        );
        // Two indexes whose Dynamo keys coincide are both dumped, and both read back.
        let image = |model: &str, tenant: &str| IndexImage {
            key: IndexKey::new(model, tenant),
            block_size: kvatlas_hash::BlockSize::new(16).expect("16"),
            capacity: None,
            feeds: Vec::new(),
            marks: BTreeMap::new(),
            snapshot: Snapshot::default(),
        };
        let dumped = dump(&[image("a:b", "c"), image("a", "b:c")]);
        let keys: Vec<&String> = dumped.as_object().expect("an object").keys().collect();
        assert_eq!(keys, ["a:b:c", "a:b:c#2"]);
        let read = parse_dump(&serde_json::to_vec(&dumped).expect("JSON"))
            .expect("parses")
            .indexes;
        let mut read: Vec<(String, String)> = read
            .iter()
            .map(|(key, _, _)| (key.model.to_string(), key.tenant.to_string()))
            .collect();
        read.sort();
        let expected = [("a", "b:c"), ("a:b", "c")].map(|(m, t)| (m.to_owned(), t.to_owned()));
        assert_eq!(read, expected);
        let bad = parse_dump(br#"{":g": {"block_size": 16, "events": []}}"#).expect_err("no model");
        assert!(bad.contains("model is empty"), "{bad}");
        let bad =
            parse_dump(br#"{"nocolon": {"block_size": 16, "events": []}}"#).expect_err("no colon");
        assert!(bad.contains("expected model:group"), "{bad}");
    }
}
