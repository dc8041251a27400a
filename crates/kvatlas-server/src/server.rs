//! Starting and stopping a server: [`RunningServer::start`] checks the configuration, registers
//! the initial workers, binds both listeners (port 0 resolved before it returns) and serves;
//! [`RunningServer::shutdown`] stops gracefully.
//!
//! Shutdown order, so that nothing acknowledged is lost:
//! 1. the server stops being ready (health NOT_SERVING, `/ready` 503, queries UNAVAILABLE);
//! 2. open streams are told to stop: `PublishEvents` streams stop reading, wait until what they
//!    enqueued is applied and acknowledge it; `QueryStream`s end with UNAVAILABLE;
//! 3. both listeners stop accepting and wait for in-flight requests (at most the shutdown
//!    timeout);
//! 4. the ZMQ listeners stop, and every index's writers apply what was queued;
//! 5. [`ShutdownReport`]: per index, what it holds (memberships and a digest of its state) and
//!    the last sequence number applied for every rank.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvatlas_index::{SharedKvIndex, Worker};
use kvatlas_proto::v1::indexer_server::IndexerServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::auth::{TokenFileError, Tokens};
use crate::config::{ConfigError, ServerConfig};
use crate::error::ServiceError;
use crate::grpc::{IndexerService, authenticate};
use crate::registry::{Feed, IndexKey, Registry};
use crate::state::State;
use crate::tls::TlsMaterial;

/// HTTP/2 flow-control windows (per connection and per stream): large enough that busy
/// connections rarely stop to send WINDOW_UPDATE frames.
const WINDOW_BYTES: u32 = 8 << 20;

/// How often the health service's status is brought in line with readiness.
const HEALTH_POLL: Duration = Duration::from_millis(50);

/// Why a server did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The token file was refused.
    #[error(transparent)]
    Tokens(#[from] TokenFileError),
    /// The TLS files were refused.
    #[error("{0}")]
    Tls(String),
    /// A listen address could not be bound.
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        /// gRPC or HTTP.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An initial worker could not be registered.
    #[error("cannot register worker {instance_id} rank {dp_rank} ({endpoint}): {error}")]
    Worker {
        /// The worker.
        instance_id: u64,
        /// Its rank.
        dp_rank: u32,
        /// Its endpoint.
        endpoint: String,
        /// Why.
        error: ServiceError,
    },
    /// The gRPC server could not be set up.
    #[error("gRPC setup: {0}")]
    Grpc(String),
}

/// What one index held when the server stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexReport {
    /// The index.
    pub key: IndexKey,
    /// (rank, block, tier) memberships held.
    pub memberships: u64,
    /// [`kvatlas_index::Snapshot::digest`] of its state.
    pub digest: u64,
    /// Index mutations applied since it was created.
    pub events_applied: u64,
    /// Every rank with a feed, and the last sequence number applied for it.
    pub last_seq: Vec<(Worker, Option<u64>)>,
}

/// What the server held when it stopped, index by index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Per index, sorted by key.
    pub indexes: Vec<IndexReport>,
}

/// A running server (see the module docs).
#[derive(Debug)]
pub struct RunningServer {
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    state: Arc<State>,
    stop_accepting: CancellationToken,
    grpc: JoinHandle<Result<(), tonic::transport::Error>>,
    http: JoinHandle<()>,
    health: JoinHandle<()>,
    shutdown_timeout: Duration,
}

impl RunningServer {
    /// Checks `config`, registers its workers, binds and starts serving.
    ///
    /// # Errors
    /// [`StartError`], naming the setting, file, address or worker at fault.
    pub async fn start(config: ServerConfig) -> Result<Self, StartError> {
        config.validate()?;
        let tokens = config
            .auth_tokens
            .as_deref()
            .map(Tokens::from_file)
            .transpose()?;
        let tls = config
            .tls
            .as_ref()
            .map(TlsMaterial::load)
            .transpose()
            .map_err(StartError::Tls)?;
        let registry = Arc::new(Registry::new(config.index, config.limits));
        let state = Arc::new(State::new(
            Arc::clone(&registry),
            config.limits,
            tokens,
            config.min_initial_workers,
        ));
        for registration in config.workers {
            let (instance_id, dp_rank, endpoint) = (
                registration.instance_id,
                registration.dp_rank,
                registration.endpoint.clone(),
            );
            let registry = Arc::clone(&registry);
            tokio::task::spawn_blocking(move || registry.register(registration))
                .await
                .map_err(|e| StartError::Grpc(e.to_string()))?
                .map_err(|error| StartError::Worker {
                    instance_id,
                    dp_rank,
                    endpoint,
                    error,
                })?;
        }

        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { what, addr, source })
        };
        let grpc_listener = bind("gRPC", config.grpc_addr).await?;
        let http_listener = bind("HTTP", config.http_addr).await?;
        let local = |listener: &TcpListener, what, addr| {
            listener
                .local_addr()
                .map_err(|source| StartError::Bind { what, addr, source })
        };
        let grpc_addr = local(&grpc_listener, "gRPC", config.grpc_addr)?;
        let http_addr = local(&http_listener, "HTTP", config.http_addr)?;

        let stop_accepting = CancellationToken::new();
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health = tokio::spawn(track_health(Arc::clone(&state), reporter));
        let grpc = serve_grpc(
            &state,
            grpc_listener,
            tls.as_ref(),
            health_service,
            stop_accepting.clone(),
        )?;
        let http = serve_http(
            crate::http::router(Arc::clone(&state)),
            http_listener,
            tls.as_ref(),
            stop_accepting.clone(),
        )
        .map_err(StartError::Tls)?;
        tracing::info!(
            grpc = %grpc_addr,
            http = %http_addr,
            tls = tls.is_some(),
            auth = state.tokens.is_some(),
            "kvatlas serving: gRPC on {grpc_addr}, HTTP on {http_addr}"
        );
        Ok(Self {
            grpc_addr,
            http_addr,
            state,
            stop_accepting,
            grpc,
            http,
            health,
            shutdown_timeout: config.shutdown_timeout,
        })
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The bound HTTP address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// Whether the server answers queries (the startup gate is open, no shutdown started).
    pub fn ready(&self) -> bool {
        self.state.ready()
    }

    /// Runs until SIGINT or SIGTERM, then shuts down gracefully.
    pub async fn run_until_signal(self) -> ShutdownReport {
        wait_for_signal().await;
        tracing::info!("shutdown signal received: stopping gracefully");
        self.shutdown().await
    }

    /// Stops gracefully (see the module docs) and reports what every index held.
    pub async fn shutdown(self) -> ShutdownReport {
        self.state.begin_shutdown();
        self.stop_accepting.cancel();
        let deadline = self.shutdown_timeout;
        let grpc = self.grpc;
        let grpc_abort = grpc.abort_handle();
        match tokio::time::timeout(deadline, grpc).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!("the gRPC server ended with an error: {error}"),
            Ok(Err(error)) => tracing::warn!("the gRPC server task failed: {error}"),
            Err(_) => {
                tracing::warn!(
                    "open gRPC requests did not finish within {deadline:?}; cutting them"
                );
                grpc_abort.abort();
            }
        }
        let http_abort = self.http.abort_handle();
        if tokio::time::timeout(deadline, self.http).await.is_err() {
            http_abort.abort();
        }
        self.health.abort();
        let registry = Arc::clone(&self.state.registry);
        tokio::task::spawn_blocking(move || final_report(&registry))
            .await
            .unwrap_or_default()
    }
}

/// Stops every listener, applies what is queued and reports each index.
fn final_report(registry: &Registry) -> ShutdownReport {
    let mut indexes = Vec::new();
    for entry in registry.all() {
        let states = entry.stop_listeners();
        entry.pool.flush();
        let index = entry.index();
        let snapshot = index.snapshot();
        let mut last_seq: Vec<(Worker, Option<u64>)> = states
            .iter()
            .map(|s| {
                (
                    Worker::new(s.source.worker_id, s.source.dp_rank),
                    s.last_seq,
                )
            })
            .collect();
        for (worker, feed) in entry.feeds.lock().iter() {
            if let Feed::Grpc(grpc) = feed {
                last_seq.push((*worker, grpc.last_seq));
            }
        }
        last_seq.sort();
        let report = IndexReport {
            key: entry.key.clone(),
            memberships: snapshot
                .workers
                .iter()
                .flat_map(|w| &w.blocks)
                .map(|b| u64::from(b.tiers.bits().count_ones()))
                .sum(),
            digest: snapshot.digest(),
            events_applied: index.events_applied(),
            last_seq,
        };
        tracing::info!(
            model = %report.key.model,
            tenant = %report.key.tenant,
            memberships = report.memberships,
            digest = format_args!("{:#018x}", report.digest),
            events_applied = report.events_applied,
            last_seq = ?report.last_seq,
            "index at shutdown"
        );
        indexes.push(report);
    }
    ShutdownReport { indexes }
}

/// Keeps the health service in line with readiness: NOT_SERVING until the startup gate opens
/// and again once a shutdown starts.
async fn track_health(state: Arc<State>, reporter: tonic_health::server::HealthReporter) {
    let mut serving = None;
    loop {
        let ready = state.ready();
        if serving != Some(ready) {
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            reporter
                .set_service_status(kvatlas_proto::v1::SERVICE_NAME, status)
                .await;
            reporter.set_service_status("", status).await;
            serving = Some(ready);
        }
        tokio::time::sleep(HEALTH_POLL).await;
    }
}

fn serve_grpc(
    state: &Arc<State>,
    listener: TcpListener,
    tls: Option<&TlsMaterial>,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    stop: CancellationToken,
) -> Result<JoinHandle<Result<(), tonic::transport::Error>>, StartError> {
    let limits = state.limits;
    let auth = {
        let state = Arc::clone(state);
        move |request| authenticate(&state, request)
    };
    let service = InterceptedService::new(
        IndexerServer::new(IndexerService::new(Arc::clone(state)))
            .max_decoding_message_size(limits.max_message_bytes)
            .max_encoding_message_size(limits.max_message_bytes),
        auth,
    );
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvatlas_proto::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| StartError::Grpc(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| StartError::Grpc(format!("reflection: {e}")))?;
    // The concurrency limit is enforced per request (shedding with RESOURCE_EXHAUSTED), not as
    // HTTP/2's per-connection stream limit, which makes clients queue silently instead.
    let mut builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_connection_window_size(Some(WINDOW_BYTES))
        .initial_stream_window_size(Some(WINDOW_BYTES));
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(tls.identity()))
            .map_err(|e| StartError::Tls(format!("gRPC TLS: {e}")))?;
    }
    // Health and reflection (the API's schema, public in any case) need no token, so probes and
    // grpcurl work; every kvatlas.v1 RPC goes through `authenticate`.
    let router = builder
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service);
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    Ok(tokio::spawn(router.serve_with_incoming_shutdown(
        incoming,
        stop.cancelled_owned(),
    )))
}

fn serve_http(
    router: axum::Router,
    listener: TcpListener,
    tls: Option<&TlsMaterial>,
    stop: CancellationToken,
) -> Result<JoinHandle<()>, String> {
    let Some(tls) = tls else {
        return Ok(tokio::spawn(async move {
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
            if let Err(error) = served {
                tracing::warn!("the HTTP server ended with an error: {error}");
            }
        }));
    };
    let acceptor = tls.acceptor()?;
    Ok(tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let Ok((tcp, _)) = accepted else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let (acceptor, router) = (acceptor.clone(), router.clone());
            tokio::spawn(async move {
                let Ok(Ok(tls)) =
                    tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await
                else {
                    return;
                };
                let service = hyper_util::service::TowerToHyperService::new(router);
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                .await;
            });
        }
    }))
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM.
async fn wait_for_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
