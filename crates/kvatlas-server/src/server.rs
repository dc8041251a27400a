//! Starting and stopping a server: [`RunningServer::start`] checks the configuration, restores
//! the state, registers the initial workers, binds both listeners (port 0 resolved before it
//! returns) and serves; [`RunningServer::shutdown`] stops gracefully.
//!
//! Where the state at start comes from, first match wins:
//! 1. the data directory's newest readable snapshot (`--data-dir`): every index, its recorded
//!    feeds registered again, each ZMQ listener continuing from its rank's checkpoint (the
//!    engine's replay endpoint fills what was published while the server was down; a hole it
//!    cannot fill resyncs the rank, counted);
//! 2. a peer (`--peers`): the configured workers' listeners start *held* (subscribed, buffering),
//!    the server answers UNAVAILABLE while `peers::bootstrap` restores the first peer that
//!    answers, then releases them from the peer's checkpoints;
//! 3. empty.
//!
//! With a data directory, snapshots are written every interval (skipped while nothing changed)
//! and once more at shutdown, after the last queued event is applied.
//!
//! Shutdown order, so that nothing acknowledged is lost:
//! 1. the server stops being ready (health NOT_SERVING, `/ready` 503, queries UNAVAILABLE);
//! 2. open streams are told to stop: `PublishEvents` streams stop reading, wait until what they
//!    enqueued is applied and acknowledge it; `QueryStream`s end with UNAVAILABLE;
//! 3. both listeners stop accepting and wait for in-flight requests (at most the shutdown
//!    timeout);
//! 4. the ZMQ listeners stop, and every index's writers apply what was queued;
//! 5. with a data directory, the final snapshot;
//! 6. [`ShutdownReport`]: per index, what it holds (memberships and a digest of its state) and
//!    the last sequence number applied for every rank.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvatlas_index::{SharedKvIndex, Worker};
use kvatlas_proto::llmd::indexer::v1::indexer_service_server::IndexerServiceServer;
use kvatlas_proto::v1::indexer_server::IndexerServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::auth::{TokenFile, TokenFileError};
use crate::config::Persistence;
use crate::config::{ConfigError, ServerConfig};
use crate::error::ServiceError;
use crate::grpc::{Gate, IndexerService, OversizeStatus};
use crate::llmd::{PodScoresService, TokenizerError, Tokenizers};
use crate::opening_deadline::{HTTP2_PREFACE_BYTES, OpeningDeadline};
use crate::peers::Bootstrap;
use crate::registry::{Feed, IndexKey, Registry, WorkerRegistration};
use crate::reload::{Reloaded, Reloader};
use crate::served_index::unix_micros_now;
use crate::state::State;
use crate::store::{DataDir, Written};
use crate::tls::ServerIdentity;

/// HTTP/2 flow-control windows (per connection and per stream): large enough that busy
/// connections rarely stop to send WINDOW_UPDATE frames.
const WINDOW_BYTES: u32 = 8 << 20;
/// Idle time before the gRPC server pings a connection (HTTP/2) and probes it (TCP keepalive).
const GRPC_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// A ping not answered within this closes the connection.
const GRPC_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

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
    /// The peer token or CA file was refused.
    #[error("peers: {0}")]
    PeerAccess(String),
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
    /// A model's tokenizer (`--tokenizer`) could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The NATS event log cannot be used (`--publish-to`, `--consume-from`).
    #[error("NATS event log: {0}")]
    Nats(String),
    /// The data directory cannot be used.
    #[error("cannot use the data directory {path}: {source}")]
    DataDir {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
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
    /// Every registered rank (fed, or not fed since a restore) and the last sequence number
    /// applied for it.
    pub last_seq: Vec<(Worker, Option<u64>)>,
}

/// What the server held when it stopped, index by index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Per index, sorted by key.
    pub indexes: Vec<IndexReport>,
    /// The final snapshot, with a data directory: the file written, or why it failed.
    pub snapshot: Option<Result<Written, String>>,
    /// With `--publish-to`: why applied units did not all reach the NATS event log before
    /// the shutdown's deadline (`None`: they did, or there is no log).
    pub unpublished: Option<String>,
}

/// Where the state a server started with came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restored {
    /// Nothing: it started empty (no data directory snapshot, no peers).
    Nothing,
    /// A data-directory snapshot.
    DataDir {
        /// The file.
        path: std::path::PathBuf,
        /// Memberships restored.
        memberships: u64,
    },
    /// A bootstrap from a peer is running or done (see [`RunningServer::bootstrap`]).
    Peers,
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
    restored: Restored,
    bootstrap: Option<JoinHandle<Bootstrap>>,
    snapshots: Option<(DataDir, JoinHandle<()>)>,
    stop_snapshots: CancellationToken,
    /// An ingest's publisher: stopped (and drained, until the deadline set first) after the
    /// feeds at shutdown.
    log_publisher: Option<(
        CancellationToken,
        Arc<std::sync::OnceLock<tokio::time::Instant>>,
        JoinHandle<u64>,
    )>,
    /// A replica's consumer.
    replica: Option<crate::log_replica::Replica>,
    /// Reads the token file and the TLS certificate again (on SIGHUP, every few seconds, and
    /// when [`RunningServer::reload`] asks).
    reloader: Arc<Reloader>,
}

impl RunningServer {
    /// Checks `config`, registers its workers, binds and starts serving. It takes SIGHUP for
    /// the whole process from its call on (to read the token file and the certificate again,
    /// `docs/server.md` §4): a process embedding a server no longer ends on SIGHUP.
    ///
    /// # Errors
    /// [`StartError`], naming the setting, file, address or worker at fault.
    pub async fn start(config: ServerConfig) -> Result<Self, StartError> {
        // SIGHUP is taken before anything else (a rotation tool signalling a server that is
        // still restoring its state must not end it).
        let hangup = crate::reload::Hangup::take();
        config.validate()?;
        let tokens = config
            .auth_tokens
            .as_deref()
            .map(|path| TokenFile::load(path, config.limits.max_requests_per_token))
            .transpose()?;
        let tls = config
            .tls
            .as_ref()
            .map(ServerIdentity::load)
            .transpose()
            .map_err(StartError::Tls)?
            .map(Arc::new);
        let tokenizer_files = config.tokenizers.clone();
        let tokenizers = tokio::task::spawn_blocking(move || Tokenizers::load(&tokenizer_files))
            .await
            .map_err(|e| StartError::Grpc(e.to_string()))??;
        let nats_timeout = Duration::from_secs(10);
        let mut registry = Registry::new(config.index, config.limits).with_binds_beyond_loopback(
            config.auth_tokens.is_some() || config.allow_unauthenticated,
        );
        let mut log_publisher = None;
        if let Some(log) = &config.publish_to {
            let stats = Arc::new(crate::nats::LogStats::default());
            let js = crate::nats::connect(log, nats_timeout, Arc::clone(&stats))
                .await
                .map_err(StartError::Nats)?;
            let stream = crate::nats::stream(&js, log)
                .await
                .map_err(StartError::Nats)?;
            // A stream made by hand may limit its messages below nats-server's.
            let stream_max_message_size = stream.cached_info().config.max_message_size;
            let (handle, queue) = crate::log_ingest::LogHandle::new(
                Arc::clone(&stats),
                config.publish_only,
                stream.cached_info().config.duplicate_window,
            );
            registry =
                registry.with_log(crate::registry::LogRole::Ingest(handle), Arc::clone(&stats));
            let stop = CancellationToken::new();
            let drain_until = Arc::new(std::sync::OnceLock::new());
            let task = tokio::spawn(crate::log_ingest::run_publisher(
                js,
                log.clone(),
                stream_max_message_size,
                queue,
                stats,
                stop.clone(),
                Arc::clone(&drain_until),
            ));
            tracing::info!(url = %crate::nats::shown_url(&log.url), stream = %log.stream, "ingest: publishing to the NATS event log");
            log_publisher = Some((stop, drain_until, task));
        }
        if let Some(log) = &config.consume_from {
            registry = registry.with_log(
                crate::registry::LogRole::Replica(log.stream.clone()),
                Arc::new(crate::nats::LogStats::default()),
            );
        }
        let registry = Arc::new(registry);
        let state = Arc::new(
            State::new(
                Arc::clone(&registry),
                config.limits,
                tokens,
                config.min_initial_workers,
            )
            .allowing_unauthenticated(config.allow_unauthenticated),
        );
        let data_dir = match &config.persistence {
            Some(persistence) => Some(open_data_dir(persistence).await?),
            None => None,
        };
        let restored = match &data_dir {
            Some(dir) => restore_local(dir, &registry, &state, &config.workers).await?,
            None => Restored::Nothing,
        };
        // A replica of the event log is not ready before it restored the bucket's snapshot and
        // read what the stream held (`log_replica`).
        if config.consume_from.is_some() {
            state.set_bootstrapping(true);
        }
        // A replica with no state of its own bootstraps from a peer: its listeners start held.
        let bootstrap_from_peers = restored == Restored::Nothing && !config.peers.is_empty();
        // Read at every start, used or not: a typo in a path otherwise shows only on the day
        // the data directory is empty, when the bootstrap is needed.
        let peer_access = if !config.peers.is_empty()
            || config.peer_token_file.is_some()
            || config.peer_ca_cert.is_some()
        {
            let read = |path: &std::path::Path, what: &str| {
                std::fs::read(path).map_err(|e| {
                    StartError::PeerAccess(format!(
                        "cannot read the {what} {}: {e}",
                        path.display()
                    ))
                })
            };
            let token = config
                .peer_token_file
                .as_deref()
                .map(|path| read(path, "peer token file"))
                .transpose()?
                .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
            let ca = config
                .peer_ca_cert
                .as_deref()
                .map(|path| read(path, "peer CA certificate"))
                .transpose()?;
            crate::peers::PeerAccess::new(token.as_deref(), ca.as_deref(), &config.peers)
                .map_err(StartError::PeerAccess)?
        } else {
            crate::peers::PeerAccess::default()
        };
        let restored = if bootstrap_from_peers {
            state.set_bootstrapping(true);
            Restored::Peers
        } else {
            restored
        };
        state.peers.lock().extend(config.peers.iter().cloned());
        for registration in config.workers {
            let (instance_id, dp_rank, endpoint) = (
                registration.instance_id,
                registration.dp_rank,
                registration.endpoint.clone(),
            );
            let registry = Arc::clone(&registry);
            tokio::task::spawn_blocking(move || {
                registry.register_with(registration, bootstrap_from_peers)
            })
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
        if config.busy_poll {
            let workers = tokio::runtime::Handle::current().metrics().num_workers();
            for _ in 0..workers {
                tokio::spawn(busy_poll(stop_accepting.clone()));
            }
            tracing::info!(
                workers,
                "busy-polling: every runtime worker keeps a core busy"
            );
        }
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health = tokio::spawn(track_health(Arc::clone(&state), reporter));
        let reloader = Arc::new(Reloader::new(Arc::clone(&state), tls.clone()));
        tokio::spawn(Arc::clone(&reloader).watch(
            hangup,
            config.reload_check,
            stop_accepting.clone(),
        ));
        let grpc = serve_grpc(
            &state,
            Arc::new(tokenizers),
            grpc_listener,
            tls.as_deref(),
            health_service,
            stop_accepting.clone(),
        )?;
        let http = serve_http(
            crate::http::router(Arc::clone(&state)),
            http_listener,
            tls.as_deref(),
            state.limits.stall_timeout,
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
        let bootstrap = bootstrap_from_peers.then(|| {
            let (state, peers) = (Arc::clone(&state), config.peers.clone());
            tokio::spawn(async move {
                let outcome = crate::peers::bootstrap(&state.registry, &peers, &peer_access).await;
                record_bootstrap(&state, &outcome);
                state.set_bootstrapping(false);
                outcome
            })
        });
        let replica = match &config.consume_from {
            Some(log) => {
                tracing::info!(url = %crate::nats::shown_url(&log.url), stream = %log.stream, "replica: consuming the NATS event log");
                Some(
                    crate::log_replica::start(Arc::clone(&state), log.clone(), nats_timeout)
                        .await
                        .map_err(StartError::Nats)?,
                )
            }
            None => None,
        };
        let stop_snapshots = CancellationToken::new();
        let snapshots = data_dir.map(|dir| {
            let interval = config.persistence.as_ref().and_then(|p| p.interval);
            let task = tokio::spawn(periodic_snapshots(
                Arc::clone(&state),
                dir.clone(),
                interval,
                stop_snapshots.clone(),
            ));
            (dir, task)
        });
        Ok(Self {
            grpc_addr,
            http_addr,
            state,
            stop_accepting,
            grpc,
            http,
            health,
            shutdown_timeout: config.shutdown_timeout,
            restored,
            bootstrap,
            snapshots,
            stop_snapshots,
            log_publisher,
            replica,
            reloader,
        })
    }

    /// Reads the token file and the TLS certificate and key again now, as SIGHUP does (and a
    /// check every few seconds): what changed and is valid is in force from the next request
    /// or handshake on; what changed and is not is refused, and what was in force stays.
    pub async fn reload(&self) -> Reloaded {
        self.reloader.check_off_the_runtime().await
    }

    /// Where the state this server started with came from.
    pub fn restored(&self) -> &Restored {
        &self.restored
    }

    /// Waits for the bootstrap from peers to end and says what it did (`None` without one, or
    /// if it was already taken).
    pub async fn bootstrap(&mut self) -> Option<Bootstrap> {
        let task = self.bootstrap.take()?;
        task.await.ok()
    }

    /// Writes a data-directory snapshot now (`None` without a data directory).
    pub async fn snapshot_now(&self) -> Option<Result<Written, String>> {
        let (dir, _) = self.snapshots.as_ref()?;
        Some(write_snapshot(Arc::clone(&self.state), dir.clone()).await)
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

    /// Runs until SIGINT or SIGTERM, then shuts down gracefully. The signals are taken from
    /// this call on: [`shutdown_signal`], called before [`RunningServer::start`], takes them
    /// from the start on ([`RunningServer::run_until`]).
    pub async fn run_until_signal(self) -> ShutdownReport {
        self.run_until(shutdown_signal()).await
    }

    /// Runs until `signal` completes, then shuts down gracefully.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) -> ShutdownReport {
        signal.await;
        tracing::info!("shutdown signal received: stopping gracefully");
        self.shutdown().await
    }

    /// Stops gracefully (see the module docs) and reports what every index held.
    pub async fn shutdown(self) -> ShutdownReport {
        self.state.begin_shutdown();
        self.stop_accepting.cancel();
        // One deadline for the whole shutdown (each phase waited the whole timeout before: with
        // JetStream down and the log full, three times it).
        let deadline = self.shutdown_timeout;
        let until = tokio::time::Instant::now() + deadline;
        let grpc = self.grpc;
        let grpc_abort = grpc.abort_handle();
        match tokio::time::timeout_at(until, grpc).await {
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
        if tokio::time::timeout_at(until, self.http).await.is_err() {
            http_abort.abort();
        }
        self.health.abort();
        if let Some(bootstrap) = self.bootstrap {
            bootstrap.abort();
        }
        self.stop_snapshots.cancel();
        if let Some(replica) = self.replica {
            replica.stop.cancel();
            let _ = replica.task.await;
        }
        let dir = match self.snapshots {
            Some((dir, task)) => {
                // A periodic snapshot being written is finished first.
                let _ = task.await;
                Some(dir)
            }
            None => None,
        };
        // PublishEvents batches admitted by calls the deadline cut still wait for room in their
        // lane or the log (the log's publisher still runs): applied and queued before the final
        // report and the log's drain.
        let admitted = &self.state.admitted_batches;
        admitted.close();
        if tokio::time::timeout_at(until, admitted.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                "{} PublishEvents batch(es) admitted before the shutdown still wait for room in \
                 their lane or the event log after {deadline:?}",
                admitted.len()
            );
        }
        let registry = Arc::clone(&self.state.registry);
        let mut report = tokio::task::spawn_blocking(move || final_report(&registry))
            .await
            .unwrap_or_default();
        // The feeds are stopped and their units applied: publish what the log still holds.
        if let Some((stop, drain_until, task)) = self.log_publisher {
            // What is left of the shutdown's time, and a second at least: the records queued
            // are what replicas will never get otherwise.
            let _ =
                drain_until.set(until.max(tokio::time::Instant::now() + Duration::from_secs(1)));
            stop.cancel();
            let left = match task.await {
                Ok(left) => left,
                Err(error) => {
                    tracing::error!("the NATS publisher failed: {error}");
                    report.unpublished = Some(format!("the NATS publisher failed: {error}"));
                    0
                }
            };
            // What still waited for the log's room now finds it closed, and counts its record
            // as lost (a moment: the queue is gone).
            let _ = tokio::time::timeout(Duration::from_millis(200), admitted.wait()).await;
            let lost = self
                .state
                .registry
                .log_stats()
                .lost_at_shutdown
                .load(std::sync::atomic::Ordering::Relaxed);
            match left + lost + admitted.len() as u64 {
                0 => tracing::info!("every applied unit is published to the NATS event log"),
                left => {
                    let why = format!(
                        "{left} record(s) could not be published to the NATS event log before \
                         the shutdown timeout"
                    );
                    tracing::error!("{why}");
                    report.unpublished.get_or_insert(why);
                }
            }
        }
        // A bootstrap from a peer cut short by the shutdown left a half-built state (and a
        // restore it started may still run): written, the next start would take it for the
        // server's own and never bootstrap again. The data directory keeps what it had.
        let dir = dir.filter(|_| {
            let bootstrapping = self.state.bootstrapping();
            if bootstrapping {
                tracing::warn!(
                    "no final snapshot: the bootstrap from a peer had not finished (the next \
                     start bootstraps again)"
                );
            }
            !bootstrapping
        });
        if let Some(dir) = dir {
            let written = write_snapshot(Arc::clone(&self.state), dir).await;
            match &written {
                Ok(w) => tracing::info!(
                    path = %w.path.display(),
                    bytes = w.bytes,
                    memberships = w.memberships,
                    "final snapshot written"
                ),
                Err(error) => tracing::error!("the final snapshot failed: {error}"),
            }
            report.snapshot = Some(written);
        }
        report
    }
}

/// Opens the data directory (off the async workers).
async fn open_data_dir(persistence: &Persistence) -> Result<DataDir, StartError> {
    let path = persistence.data_dir.clone();
    let opened = tokio::task::spawn_blocking({
        let path = path.clone();
        move || DataDir::open(path)
    })
    .await
    .map_err(|e| StartError::Grpc(e.to_string()))?;
    opened.map_err(|source| StartError::DataDir { path, source })
}

/// Restores the data directory's newest usable snapshot, logging every file refused: one that
/// cannot be read, or one that reads but cannot be restored whole here (checked before anything
/// is applied, also against the `configured` registrations, registered after it), is moved
/// aside and the next older one is tried. A configured registration replaces the snapshot's
/// for the same rank.
async fn restore_local(
    dir: &DataDir,
    registry: &Arc<Registry>,
    state: &Arc<State>,
    configured: &[WorkerRegistration],
) -> Result<Restored, StartError> {
    let (dir, registry, configured) = (dir.clone(), Arc::clone(registry), configured.to_vec());
    let path = dir.path().to_owned();
    let loaded = tokio::task::spawn_blocking(move || {
        // Each file refused, why, and whether it was left in place (a newer build's, found
        // again by each load below: reported once).
        let mut refused: Vec<(std::path::PathBuf, String, bool)> = Vec::new();
        loop {
            let loaded = dir.load()?;
            for (file, why) in loaded.rejected {
                let left = matches!(why, crate::snapshot::SnapshotError::NewerVersion { .. });
                if !refused.iter().any(|(seen, _, _)| *seen == file) {
                    refused.push((file, why.to_string(), left));
                }
            }
            let Some((path, created, images)) = loaded.snapshot else {
                return Ok::<_, std::io::Error>((None, refused));
            };
            let memberships: u64 = images.iter().map(crate::snapshot::IndexImage::memberships).sum();
            // A file that does not fit this server's settings is refused (set aside, below); one
            // that fits but fails to restore failed for a reason of the machine's (a writer or
            // listener thread that cannot start): the start fails and the file stays, as for a
            // file the machine cannot read (each kept snapshot was set aside in turn, and the
            // server started empty).
            let fits = registry.check_images(&images, &configured);
            let restored = match fits {
                Ok(()) => Ok(registry
                    .restore_images(&images, Some(&configured))
                    .map_err(|error| {
                        std::io::Error::other(format!(
                            "the snapshot {} could not be restored ({error}); it is kept",
                            path.display()
                        ))
                    })?),
                Err(refusal) => Err(refusal),
            };
            match restored {
                Ok(failed) => {
                    for (registration, error) in failed {
                        tracing::warn!(
                            worker = registration.instance_id,
                            dp_rank = registration.dp_rank,
                            endpoint = %registration.endpoint,
                            "a worker recorded in the snapshot could not be registered again: {error}"
                        );
                    }
                    tracing::info!(
                        path = %path.display(),
                        created_unix_micros = created,
                        memberships,
                        indexes = images.len(),
                        "restored the data directory's snapshot"
                    );
                    return Ok((Some((path, memberships)), refused));
                }
                Err(error) => {
                    // Loaded again below: a file that stays would be found for ever.
                    dir.set_aside(&path).map_err(|cannot| {
                        std::io::Error::new(
                            cannot.kind(),
                            format!(
                                "the snapshot {} cannot be restored on this server ({error}) \
                                 and cannot be moved aside ({cannot}): move it out of the \
                                 data directory",
                                path.display()
                            ),
                        )
                    })?;
                    refused.push((
                        path,
                        format!("it cannot be restored on this server ({error}); nothing of it was applied"),
                        false,
                    ));
                }
            }
        }
    })
    .await
    .map_err(|e| StartError::Grpc(e.to_string()))?
    .map_err(|source| StartError::DataDir { path, source })?;
    let (restored, rejected) = loaded;
    for (file, why, left_in_place) in &rejected {
        if *left_in_place {
            tracing::error!(
                file = %file.display(),
                "skipped snapshot file {}: {why}; left in place for the newer kvatlas",
                file.display()
            );
            continue;
        }
        tracing::error!(
            file = %file.display(),
            "refused snapshot file {}: {why}; moved aside to {}.rejected",
            file.display(),
            file.display()
        );
    }
    if restored.is_none() && !rejected.is_empty() {
        tracing::warn!("no snapshot of the data directory could be used; starting empty");
    }
    // Moved aside: a newer build's file left in place is not (counted, every start after a
    // rollback added one for it).
    let moved_aside = rejected.iter().filter(|(_, _, left)| !left).count();
    let recovery = &state.metrics.recovery;
    recovery
        .rejected_files
        .fetch_add(moved_aside as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(match restored {
        Some((path, memberships)) => {
            *recovery.restored.lock() = Some(("data_dir", memberships));
            Restored::DataDir { path, memberships }
        }
        None => Restored::Nothing,
    })
}

/// Logs a bootstrap's outcome and records it in the metrics.
fn record_bootstrap(state: &State, outcome: &Bootstrap) {
    let restored = &state.metrics.recovery.restored;
    match outcome {
        Bootstrap::Snapshot { peer, memberships } => {
            tracing::info!(peer = %peer, memberships, "bootstrapped from the peer's snapshot");
            *restored.lock() = Some(("peer_snapshot", *memberships));
        }
        Bootstrap::Dump {
            peer,
            events,
            memberships,
            skipped,
        } => {
            if skipped.is_empty() {
                tracing::info!(
                    peer = %peer,
                    events,
                    memberships,
                    "bootstrapped from the peer's /dump (Dynamo's events: no checkpoints)"
                );
            } else {
                tracing::warn!(
                    peer = %peer,
                    events,
                    memberships,
                    "bootstrapped in part from the peer's /dump (Dynamo's events: no \
                     checkpoints): {} partition(s) the peer could not dump are not \
                     bootstrapped: {}",
                    skipped.len(),
                    skipped.join("; ")
                );
            }
            // Memberships, as the other sources' (it recorded the events applied).
            *restored.lock() = Some(("peer_dump", *memberships));
        }
        Bootstrap::Empty { failures } => tracing::warn!(
            "no peer could be bootstrapped from ({}); starting empty",
            failures.join("; ")
        ),
    }
}

/// Writes a snapshot of every index into `dir`, one index's image in memory at a time, and
/// records it in the metrics.
async fn write_snapshot(state: Arc<State>, dir: DataDir) -> Result<Written, String> {
    let started = std::time::Instant::now();
    let state_for_write = Arc::clone(&state);
    let written = tokio::task::spawn_blocking(move || {
        let entries = state_for_write.registry.all();
        dir.write(entries.iter().map(|e| e.image()), unix_micros_now())
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|w| w.map_err(|e| e.to_string()));
    let recovery = &state.metrics.recovery;
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    match &written {
        Ok(w) => {
            recovery.written.fetch_add(1, relaxed);
            recovery.last_bytes.store(w.bytes, relaxed);
            recovery.last_memberships.store(w.memberships, relaxed);
            recovery.last_duration_micros.store(
                u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                relaxed,
            );
            recovery
                .last_unix_micros
                .store(u64::try_from(unix_micros_now()).unwrap_or(0), relaxed);
        }
        Err(_) => {
            recovery.failed.fetch_add(1, relaxed);
        }
    }
    written
}

/// What changes when the state changes: per index, events applied, feeds registered and
/// unregistrations.
fn generation(registry: &Registry) -> Vec<(IndexKey, u64, usize, u64)> {
    registry
        .all()
        .iter()
        .map(|e| {
            (
                e.key.clone(),
                e.index().events_applied(),
                e.feeds.lock().len(),
                e.unregistrations.load(std::sync::atomic::Ordering::Acquire),
            )
        })
        .collect()
}

/// Keeps one runtime worker from sleeping until `stop` (`--busy-poll`). A task that yields in a
/// loop is always runnable, so its worker never parks: between tasks it polls the I/O driver
/// without blocking (tokio polls it before running a yielded task again), and a request that
/// arrives is picked up within microseconds instead of after the thread is woken — two wakeups
/// per request of tens of microseconds each on a VM. Costs the worker's core, busy or idle.
async fn busy_poll(stop: CancellationToken) {
    while !stop.is_cancelled() {
        tokio::task::yield_now().await;
    }
}

/// Writes a snapshot every `interval` while the state changed since the last one, until `stop`.
async fn periodic_snapshots(
    state: Arc<State>,
    dir: DataDir,
    interval: Option<Duration>,
    stop: CancellationToken,
) {
    let Some(interval) = interval else {
        return;
    };
    let mut last = generation(&state.registry);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        if state.bootstrapping() {
            continue;
        }
        let now = generation(&state.registry);
        if now == last {
            continue;
        }
        match write_snapshot(Arc::clone(&state), dir.clone()).await {
            Ok(w) => {
                tracing::debug!(path = %w.path.display(), bytes = w.bytes, "snapshot written");
                last = now;
            }
            Err(error) => tracing::error!(
                dir = %dir.path().display(),
                "a periodic snapshot failed: {error}; the previous snapshots are kept"
            ),
        }
    }
}

/// Stops every listener, applies what is queued and reports each index.
pub(crate) fn final_report(registry: &Registry) -> ShutdownReport {
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
                // What the state reported holds: the index's checkpoint (a batch cut by the
                // shutdown's deadline while it waited for room was accepted, not applied).
                let applied = if entry.publish_only() {
                    grpc.last_seq
                } else {
                    index.mark(*worker).map(|m| m.position)
                };
                last_seq.push((*worker, applied));
            }
        }
        // Ranks not fed since a restore: where their feed would continue from.
        for worker in entry.unfed.lock().keys() {
            last_seq.push((*worker, index.mark(*worker).map(|m| m.position)));
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
    ShutdownReport {
        indexes,
        snapshot: None,
        unpublished: None,
    }
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
            for service in [
                kvatlas_proto::v1::SERVICE_NAME,
                kvatlas_proto::llmd::indexer::v1::SERVICE_NAME,
            ] {
                reporter.set_service_status(service, status).await;
            }
            reporter.set_service_status("", status).await;
            serving = Some(ready);
        }
        tokio::time::sleep(HEALTH_POLL).await;
    }
}

fn serve_grpc(
    state: &Arc<State>,
    tokenizers: Arc<Tokenizers>,
    listener: TcpListener,
    tls: Option<&ServerIdentity>,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    stop: CancellationToken,
) -> Result<JoinHandle<Result<(), tonic::transport::Error>>, StartError> {
    use tokio_stream::StreamExt as _;
    let limits = state.limits;
    // A message over the size limit is RESOURCE_EXHAUSTED (`OversizeStatus`), as gRPC's other
    // implementations answer it. The limit is on what the server accepts, not on its answers:
    // those are its own, bounded by its state's limits (an answer over it — a `Snapshot` chunk
    // is 1 MiB — failed as OUT_OF_RANGE in the trailers, the answer lost).
    // Authentication and admission happen at the `Gate`, before a message is read.
    let service = Gate::new(
        OversizeStatus(
            IndexerServer::new(IndexerService::new(Arc::clone(state)))
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(usize::MAX),
        ),
        Arc::clone(state),
    );
    // llm-d's API behind the same token check, limits and metrics.
    let llmd = Gate::new(
        OversizeStatus(
            IndexerServiceServer::new(PodScoresService::new(Arc::clone(state), tokenizers))
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(usize::MAX),
        ),
        Arc::clone(state),
    );
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvatlas_proto::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                kvatlas_proto::llmd::indexer::v1::FILE_DESCRIPTOR_SET,
            )
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
    // A client that vanished without closing its connection (a host that lost power, a
    // partition) is found by HTTP/2 pings and the connection closed, releasing what its
    // streams held: request permits, and a PublishEvents rank its restarted sidecar would
    // otherwise find still "fed by another stream".
    let mut builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(GRPC_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(GRPC_KEEPALIVE_TIMEOUT))
        .initial_connection_window_size(Some(WINDOW_BYTES))
        .initial_stream_window_size(Some(WINDOW_BYTES));
    // Health and reflection (the API's schema, public in any case) need no token, so probes and
    // grpcurl work; every kvatlas.v1 RPC and llm-d's GetPodScores go through the `Gate`.
    let router = builder
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .add_service(llmd);
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(GRPC_KEEPALIVE_INTERVAL));
    // HTTP/2's keep-alive pings start after the client's preface: one that does not send it
    // within the stall timeout is closed (it held a task and a descriptor for good).
    let preface_within = limits.stall_timeout;
    let Some(tls) = tls else {
        let incoming = incoming.map(move |accepted| {
            accepted.map(|tcp| OpeningDeadline::new(tcp, HTTP2_PREFACE_BYTES, preface_within))
        });
        return Ok(tokio::spawn(
            router.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()),
        ));
    };
    // TLS in front of tonic rather than tonic's own (which takes its certificate once): the
    // handshake presents whatever certificate is current (a reload replaces it).
    let acceptor = tls
        .acceptor(&[b"h2"])
        .map_err(|e| StartError::Tls(format!("gRPC TLS: {e}")))?;
    let handshaken =
        tls_incoming("gRPC", incoming, acceptor, stop.clone()).map(move |handshaken| {
            handshaken.map(|tls| OpeningDeadline::new(tls, HTTP2_PREFACE_BYTES, preface_within))
        });
    Ok(tokio::spawn(router.serve_with_incoming_shutdown(
        handshaken,
        stop.cancelled_owned(),
    )))
}

/// How long a client has to complete its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS connections of `incoming` (the `what` listener's), each handshaken in a task of its
/// own (a slow client holds up nobody else) within [`TLS_HANDSHAKE_TIMEOUT`]; a failed
/// handshake is logged at debug level and dropped (a client that does not trust the
/// certificate, or speaks plaintext to the TLS port, is the usual cause: not a warning per
/// connection a scanner opens). Accepting ends with `stop`, and handshakes under way with it.
fn tls_incoming(
    what: &'static str,
    incoming: TcpIncoming,
    acceptor: tokio_rustls::TlsAcceptor,
    stop: CancellationToken,
) -> tokio_stream::wrappers::ReceiverStream<
    Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>,
> {
    use tokio_stream::StreamExt as _;
    let (handshaken, receiver) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        let mut handshakes = tokio::task::JoinSet::new();
        let mut last_accept_warning = None;
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => break,
                accepted = incoming.next() => accepted,
                Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
            };
            let tcp = match accepted {
                Some(Ok(tcp)) => tcp,
                Some(Err(error)) => {
                    after_failed_accept(what, &error, &mut last_accept_warning).await;
                    continue;
                }
                None => break,
            };
            let (acceptor, handshaken) = (acceptor.clone(), handshaken.clone());
            handshakes.spawn(async move {
                let peer = tcp
                    .peer_addr()
                    .map_or_else(|_| "an unknown peer".to_owned(), |peer| peer.to_string());
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = handshaken.send(Ok(tls)).await;
                    }
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, "{what}: TLS handshake failed: {error}");
                    }
                    Err(_) => {
                        tracing::debug!(
                            %peer,
                            "{what}: no TLS handshake within {TLS_HANDSHAKE_TIMEOUT:?}"
                        );
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(receiver)
}

/// After a failed accept (out of descriptors, typically): logs it, once a second at most, and
/// pauses briefly before the next accept is tried.
async fn after_failed_accept(
    what: &str,
    error: &std::io::Error,
    last: &mut Option<tokio::time::Instant>,
) {
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
        *last = Some(tokio::time::Instant::now());
        tracing::warn!("{what}: accepting a connection failed: {error}");
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

/// Serves `router` on `listener` (HTTPS with `tls`) until `stop`: HTTP/1.1 and HTTP/2 (h2c
/// with prior knowledge on plain HTTP, ALPN over TLS). A connection that sends nothing for
/// `header_timeout` (`--stall-timeout-secs`), or an HTTP/1.1 connection whose request headers
/// take longer than that to arrive, is closed, as is one idle that long between requests.
/// Before its headers are whole no token is checked, and without a timer hyper waits for them
/// for ever (a client sending part of a request line held a task, a descriptor and up to
/// ≈ 400 KiB of header buffer for good, however many). An HTTP/2 connection is pinged as
/// gRPC's are, and closed if the ping is not answered.
fn serve_http(
    router: axum::Router,
    listener: TcpListener,
    tls: Option<&ServerIdentity>,
    header_timeout: Duration,
    stop: CancellationToken,
) -> Result<JoinHandle<()>, String> {
    // As gRPC's: an answer is not held back by Nagle's algorithm behind an unacknowledged
    // earlier one.
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let Some(tls) = tls else {
        return Ok(tokio::spawn(serve_connections(
            "HTTP",
            incoming,
            router,
            header_timeout,
            stop,
        )));
    };
    let acceptor = tls.acceptor(&[b"h2", b"http/1.1"])?;
    let handshaken = tls_incoming("HTTPS", incoming, acceptor, stop.clone());
    Ok(tokio::spawn(serve_connections(
        "HTTPS",
        handshaken,
        router,
        header_timeout,
        stop,
    )))
}

/// Serves `router` on each connection of `incoming` (the `what` listener's) until `stop`.
/// As `axum::serve`'s graceful shutdown does: once `stop` is cancelled no connection is
/// accepted, every open one finishes its request in flight and closes (HTTP/2: GOAWAY), and
/// the task ends when they all have (the caller's deadline aborts it, and with it the
/// connections, past `--shutdown-timeout-secs`). So a request on an open connection is not
/// served after the final snapshot was written.
async fn serve_connections<IO>(
    what: &'static str,
    incoming: impl tokio_stream::Stream<Item = Result<IO, std::io::Error>>,
    router: axum::Router,
    header_timeout: Duration,
    stop: CancellationToken,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use tokio_stream::StreamExt as _;
    // Boxed, so that dropping it below closes it (the listener, or the handshaken channel).
    let mut incoming = Box::pin(incoming);
    let mut connections = tokio::task::JoinSet::new();
    let mut last_accept_warning = None;
    let mut builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(GRPC_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(GRPC_KEEPALIVE_TIMEOUT);
    let builder = Arc::new(builder);
    loop {
        let io = tokio::select! {
            () = stop.cancelled() => break,
            next = incoming.next() => match next {
                Some(Ok(io)) => io,
                Some(Err(error)) => {
                    after_failed_accept(what, &error, &mut last_accept_warning).await;
                    continue;
                }
                None => break,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (router, stop, builder) = (router.clone(), stop.clone(), Arc::clone(&builder));
        connections.spawn(async move {
            let service = hyper_util::service::TowerToHyperService::new(router);
            // Until its first byte hyper reads a connection's protocol version without a timer
            // (the header timeout starts after it): one that sends nothing is closed then.
            let io = OpeningDeadline::new(io, 1, header_timeout);
            let connection = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
            tokio::pin!(connection);
            let mut stopping = false;
            loop {
                tokio::select! {
                    _ = connection.as_mut() => break,
                    () = stop.cancelled(), if !stopping => {
                        stopping = true;
                        connection.as_mut().graceful_shutdown();
                    }
                }
            }
        });
    }
    // Connections accepted and not taken (handshaken, for HTTPS) are closed now, not when the
    // others end.
    drop(incoming);
    while connections.join_next().await.is_some() {}
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM. On unix the signals are taken from the call on,
/// not from the future's first poll: called before a server starts, a signal that comes while
/// it starts (a supervisor stopping it at once) is not met by the signal's default action
/// (`kvatlas serve` stops the start at once). Elsewhere, Ctrl-C from the first poll.
///
/// # Panics
/// Outside a tokio runtime (tokio's signal handling needs one).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt()).ok();
        let mut terminate = signal(SignalKind::terminate()).ok();
        async move {
            tokio::select! {
                () = received(interrupt.as_mut()) => {}
                () = received(terminate.as_mut()) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Completes when `signal` is received (never without one).
#[cfg(unix)]
async fn received(signal: Option<&mut tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}
