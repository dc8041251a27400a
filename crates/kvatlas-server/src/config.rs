//! The server's configuration: addresses, index and writer settings, limits, authentication,
//! TLS and the workers to register at start, with the safety rules checked before anything
//! listens ([`ServerConfig::validate`]).
//!
//! Defaults are safe: both listeners on loopback; a non-loopback address without an auth token
//! file is refused unless [`ServerConfig::allow_unauthenticated`] says otherwise.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use kvatlas_events::{EngineKind, ListenerOptions, SocketMode};
use kvatlas_hash::BlockSize;

use crate::registry::{IndexKey, WorkerRegistration};

/// The default gRPC port (the usual gRPC port; llm-d's indexer example uses it too).
pub const DEFAULT_GRPC_PORT: u16 = 50051;
/// The default HTTP port (Dynamo's standalone indexer's default).
pub const DEFAULT_HTTP_PORT: u16 = 8090;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A value is out of range or malformed.
    #[error("{0}")]
    Invalid(String),
    /// Listening beyond loopback without authentication.
    #[error(
        "refusing to listen on {addr} without authentication: anyone who can reach it could \
         read every tenant's scores and register workers. Give an auth token file \
         (--auth-tokens FILE), or --allow-unauthenticated to accept that"
    )]
    Unauthenticated {
        /// The non-loopback address.
        addr: SocketAddr,
    },
}

/// Limits that protect the server from oversized or too many requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most token ids in one query (local-hash queries: blocks times the block size).
    pub max_query_tokens: usize,
    /// Largest gRPC message accepted, in bytes.
    pub max_message_bytes: usize,
    /// Most requests (unary calls and open streams) served at once; beyond it requests are shed
    /// with RESOURCE_EXHAUSTED.
    pub max_concurrent_requests: usize,
    /// Most requests and open streams one bearer token holds at once, for tokens whose line
    /// in the token file sets no `max_requests=` (`None` = only `max_concurrent_requests`).
    pub max_requests_per_token: Option<usize>,
    /// Most indexes (model, tenant pairs).
    pub max_indexes: usize,
    /// Most registered worker ranks over all indexes (each ZMQ listener is a thread).
    pub max_registered_ranks: usize,
    /// How long a whole-state read (`/snapshot`, the `Snapshot` RPC, `/dump`) waits for its
    /// reader to take the next chunk before it is abandoned and its places (among the
    /// whole-state reads, the concurrent requests and its token's) freed.
    pub stall_timeout: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_query_tokens: 1 << 20,
            max_message_bytes: 16 << 20,
            max_concurrent_requests: 1024,
            max_requests_per_token: None,
            max_indexes: 1024,
            max_registered_ranks: 4096,
            stall_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// PEM files of the server's TLS certificate chain and private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain (PEM).
    pub cert: PathBuf,
    /// The private key (PEM).
    pub key: PathBuf,
}

/// How the indexes are built and fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexSettings {
    /// Writer threads per index (sticky per worker rank).
    pub writer_threads: usize,
    /// Units queued per writer thread before producers wait (one rank's batch, or one
    /// mutation of Dynamo's HTTP routes).
    pub writer_queue: usize,
    /// Threads that poll the ZMQ listeners' sockets, shared by every index (each serves many
    /// listeners: a burst of batches from many engines wakes one thread, not one per engine).
    pub listener_threads: usize,
    /// Most (rank, block) pairs per index before the least recently stored leaves are
    /// evicted (`None` = unbounded); a peer's or the bucket's snapshot holding more is refused.
    pub capacity: Option<u64>,
    /// The ZMQ listeners' timeouts and buffers.
    pub listener: ListenerOptions,
}

impl Default for IndexSettings {
    fn default() -> Self {
        Self {
            writer_threads: 2,
            writer_queue: 16_384,
            listener_threads: 1,
            capacity: None,
            listener: ListenerOptions::default(),
        }
    }
}

/// The default time between data-directory snapshots.
pub const DEFAULT_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(30);

/// Where and how often the server persists its state (see `store`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Persistence {
    /// The data directory: snapshots are loaded from it at start and written to it.
    pub data_dir: PathBuf,
    /// Time between periodic snapshots (`None`: only at shutdown).
    pub interval: Option<Duration>,
}

/// A model's tokenizer (`--tokenizer MODEL=PATH`): llm-d's `GetPodScores` takes a prompt
/// string, which the server tokenizes with the model's Hugging Face `tokenizer.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerFile {
    /// The model (the index's model name, llm-d's `model_name`).
    pub model: String,
    /// Its `tokenizer.json`, loaded at start.
    pub path: PathBuf,
}

impl TokenizerFile {
    /// Parses `MODEL=PATH` (the model may not contain `=`; the path may).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the malformed item.
    pub fn parse(spec: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| {
            ConfigError::Invalid(format!(
                "--tokenizer {spec:?}: {why} (expected MODEL=PATH/tokenizer.json)"
            ))
        };
        let (model, path) = spec.split_once('=').ok_or_else(|| bad("no `=`"))?;
        let model = model.trim();
        if model.is_empty() {
            return Err(bad("empty model"));
        }
        if model.len() > crate::registry::MAX_NAME_BYTES {
            return Err(bad("the model name is too long"));
        }
        if path.trim().is_empty() {
            return Err(bad("empty path"));
        }
        Ok(Self {
            model: model.to_owned(),
            path: PathBuf::from(path.trim()),
        })
    }
}

/// Everything `kvatlas serve` needs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The gRPC listen address (port 0 picks a free port).
    pub grpc_addr: SocketAddr,
    /// The HTTP listen address (`/health`, `/ready`, `/metrics`; port 0 picks a free port).
    pub http_addr: SocketAddr,
    /// Index and writer settings.
    pub index: IndexSettings,
    /// The startup gate: queries are refused (UNAVAILABLE, health NOT_SERVING) until this many
    /// worker ranks are registered.
    pub min_initial_workers: usize,
    /// Request limits.
    pub limits: Limits,
    /// The bearer-token file (see `auth`); `None` = no authentication.
    pub auth_tokens: Option<PathBuf>,
    /// Accept a non-loopback listen address without authentication.
    pub allow_unauthenticated: bool,
    /// TLS for both listeners.
    pub tls: Option<TlsFiles>,
    /// Worker ranks registered at start.
    pub workers: Vec<WorkerRegistration>,
    /// How often the token file and the TLS certificate are checked for changes (`None`: on
    /// SIGHUP and [`crate::RunningServer::reload`] only).
    pub reload_check: Option<Duration>,
    /// How long a graceful shutdown may take before open streams are cut.
    pub shutdown_timeout: Duration,
    /// Snapshots in a data directory (`None`: the state lives in memory only).
    pub persistence: Option<Persistence>,
    /// Peers (base URLs of kvatlas or Dynamo indexers' HTTP side) a replica with no local
    /// snapshot bootstraps from, tried in order.
    pub peers: Vec<String>,
    /// A file whose first line is the bearer token sent to peers (`--peer-token-file`).
    pub peer_token_file: Option<PathBuf>,
    /// PEM CA certificates trusted for `https://` peers (`--peer-ca-cert`; default: the system's
    /// roots).
    pub peer_ca_cert: Option<PathBuf>,
    /// The models' tokenizers, for llm-d's `GetPodScores` (at most one per model).
    pub tokenizers: Vec<TokenizerFile>,
    /// An ingest: every unit the feeds apply is also published to this NATS JetStream event
    /// log (`--publish-to`).
    pub publish_to: Option<crate::nats::NatsLog>,
    /// A replica: the indexes are fed by this NATS JetStream event log only (`--consume-from`).
    pub consume_from: Option<crate::nats::NatsLog>,
    /// An ingest that only publishes (`--publish-only`, with `publish_to`): it keeps no index
    /// of its own (the events are decoded, hashed, sequenced and published, not applied here),
    /// and refuses queries with FAILED_PRECONDITION: the replicas answer them.
    pub publish_only: bool,
    /// Keep every async worker polling for I/O instead of sleeping until woken (`--busy-poll`):
    /// a request is picked up within microseconds instead of after a thread wakeup, at the cost
    /// of a core per worker, busy or idle.
    pub busy_poll: bool,
}

/// The longest duration a setting takes (ten years): durations are added to clocks (a
/// deadline, a timer's next tick), and one far beyond any use overflowed there and panicked,
/// or reached NATS wrapped.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Refuses a duration beyond [`MAX_DURATION`], naming the flag that sets it.
pub(crate) fn within_max_duration(flag: &str, duration: Option<Duration>) -> Result<(), String> {
    match duration {
        Some(duration) if duration > MAX_DURATION => Err(format!(
            "{flag} {}: at most {} (ten years)",
            duration.as_secs(),
            MAX_DURATION.as_secs()
        )),
        _ => Ok(()),
    }
}

/// How often the token file and the TLS certificate are checked for changes by default.
pub const DEFAULT_RELOAD_CHECK: Duration = Duration::from_secs(10);

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            grpc_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), DEFAULT_GRPC_PORT),
            http_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), DEFAULT_HTTP_PORT),
            index: IndexSettings::default(),
            min_initial_workers: 0,
            limits: Limits::default(),
            auth_tokens: None,
            allow_unauthenticated: false,
            tls: None,
            workers: Vec::new(),
            reload_check: Some(DEFAULT_RELOAD_CHECK),
            shutdown_timeout: Duration::from_secs(10),
            persistence: None,
            peers: Vec::new(),
            peer_token_file: None,
            peer_ca_cert: None,
            tokenizers: Vec::new(),
            publish_to: None,
            consume_from: None,
            publish_only: false,
            busy_poll: false,
        }
    }
}

impl ServerConfig {
    /// A configuration listening on loopback ports chosen by the OS (for tests and tools).
    pub fn ephemeral() -> Self {
        let any_port = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        Self {
            grpc_addr: any_port,
            http_addr: any_port,
            ..Self::default()
        }
    }

    /// Checks ranges and the safety rule (no unauthenticated non-loopback listener unless
    /// allowed).
    ///
    /// # Errors
    /// [`ConfigError`] naming the offending setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = |value: usize, name: &str| {
            if value == 0 {
                Err(ConfigError::Invalid(format!("{name} must be at least 1")))
            } else {
                Ok(())
            }
        };
        positive(self.index.writer_threads, "writer threads")?;
        positive(self.index.writer_queue, "the writer queue")?;
        positive(self.index.listener_threads, "listener threads")?;
        positive(self.limits.max_query_tokens, "max query tokens")?;
        positive(self.limits.max_message_bytes, "max message bytes")?;
        positive(
            self.limits.max_concurrent_requests,
            "max concurrent requests",
        )?;
        if self.limits.max_requests_per_token == Some(0) {
            return Err(ConfigError::Invalid(
                "max requests per token must be at least 1 (leave it unset for no bound)".into(),
            ));
        }
        positive(self.limits.max_indexes, "max indexes")?;
        positive(self.limits.max_registered_ranks, "max registered ranks")?;
        for (flag, duration) in [
            ("--stall-timeout-secs", Some(self.limits.stall_timeout)),
            ("--reload-check-secs", self.reload_check),
            ("--shutdown-timeout-secs", Some(self.shutdown_timeout)),
            (
                "--snapshot-interval-secs",
                self.persistence.as_ref().and_then(|p| p.interval),
            ),
        ] {
            within_max_duration(flag, duration).map_err(ConfigError::Invalid)?;
        }
        if self.limits.stall_timeout.is_zero() {
            return Err(ConfigError::Invalid(
                "the stall timeout must be at least 1 second".into(),
            ));
        }
        // (The command line maps 0 to none; a program setting zero made the reloader re-read
        // the files in a tight loop.)
        if self.reload_check.is_some_and(|every| every.is_zero()) {
            return Err(ConfigError::Invalid(
                "the reload check interval must be at least 1 second (none: no periodic check)"
                    .into(),
            ));
        }
        if self.index.capacity == Some(0) {
            return Err(ConfigError::Invalid(
                "the index capacity must be at least 1 membership (leave it unset for no bound)"
                    .into(),
            ));
        }
        if let Some(Persistence {
            interval: Some(interval),
            ..
        }) = &self.persistence
            && interval.is_zero()
        {
            return Err(ConfigError::Invalid(
                "the snapshot interval must be positive (leave it unset to snapshot only at \
                 shutdown)"
                    .into(),
            ));
        }
        for (i, tokenizer) in self.tokenizers.iter().enumerate() {
            if self.tokenizers[..i]
                .iter()
                .any(|other| other.model == tokenizer.model)
            {
                return Err(ConfigError::Invalid(format!(
                    "two tokenizers for model {:?}: give one --tokenizer per model",
                    tokenizer.model
                )));
            }
        }
        for peer in &self.peers {
            if !peer.starts_with("http://") && !peer.starts_with("https://") {
                return Err(ConfigError::Invalid(format!(
                    "peer {peer:?}: expected an http:// or https:// URL (a peer's HTTP address, \
                     for example http://10.0.0.7:8090)"
                )));
            }
        }
        for log in [&self.publish_to, &self.consume_from].into_iter().flatten() {
            log.validate().map_err(ConfigError::Invalid)?;
        }
        if self.publish_only {
            if self.publish_to.is_none() {
                return Err(ConfigError::Invalid(
                    "--publish-only needs --publish-to (it makes a server an ingest; \
                     --publish-only keeps that ingest from holding an index)"
                        .into(),
                ));
            }
            let conflict = if self.persistence.is_some() {
                Some("--data-dir (a publish-only ingest holds no index to snapshot)")
            } else if !self.peers.is_empty() {
                Some("--peers (a publish-only ingest holds no index to bootstrap)")
            } else {
                None
            };
            refuse_combination("--publish-only", conflict)?;
        }
        if self.publish_to.is_some() && self.persistence.is_some() {
            // An ingest's snapshot records the positions of the units its index applied, not of
            // those the stream stored: restarted from it, its listeners would resume after
            // records it never published, and no replica would ever get them.
            refuse_combination(
                "--publish-to",
                Some(
                    "--data-dir (an ingest's snapshot would record positions of batches the stream \
                     had not stored yet, and after a restart from it those would never be \
                     published; an ingest starts over from its engines' replay rings, and \
                     `--workers` or the routers register its engines again)",
                ),
            )?;
        }
        if self.consume_from.is_some() {
            let conflict = if self.publish_to.is_some() {
                Some("--publish-to (a server is an ingest or a replica, not both)")
            } else if !self.workers.is_empty() {
                Some("--workers (a replica's indexes are fed by the stream only)")
            } else if self.persistence.is_some() {
                Some(
                    "--data-dir (a replica restores the bucket's snapshot, which names the stream sequence it covers)",
                )
            } else if !self.peers.is_empty() {
                Some("--peers (a replica bootstraps from the bucket's snapshot)")
            } else if self.min_initial_workers > 0 {
                Some(
                    "--min-initial-workers (or DYN_ROUTER_MIN_INITIAL_WORKERS; a replica \
                     registers no workers, so it would never be ready: it is ready once it has \
                     read the stream)",
                )
            } else {
                None
            };
            refuse_combination("--consume-from", conflict)?;
        }
        if self.min_initial_workers > self.limits.max_registered_ranks {
            return Err(ConfigError::Invalid(format!(
                "--min-initial-workers {} exceeds --max-registered-ranks {}: queries would \
                 never be answered",
                self.min_initial_workers, self.limits.max_registered_ranks
            )));
        }
        if self.auth_tokens.is_none() && !self.allow_unauthenticated {
            for addr in [self.grpc_addr, self.http_addr] {
                if !addr.ip().is_loopback() {
                    return Err(ConfigError::Unauthenticated { addr });
                }
            }
        }
        Ok(())
    }
}

/// The error for `flag` given with `conflict` (a flag and why they exclude each other), if any.
fn refuse_combination(flag: &str, conflict: Option<&str>) -> Result<(), ConfigError> {
    match conflict {
        Some(conflict) => Err(ConfigError::Invalid(format!(
            "{flag} cannot be combined with {conflict}"
        ))),
        None => Ok(()),
    }
}

/// Defaults for the workers of a `--workers` list (Dynamo's `--model-name`, `--tenant-id`,
/// `--block-size`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerDefaults {
    /// The index they belong to.
    pub index: IndexKey,
    /// The engines' block size.
    pub block_size: BlockSize,
    /// The engine.
    pub engine: EngineKind,
}

/// Parses a `--workers` list: Dynamo's `ID[:DP_RANK]=ENDPOINT,...` form, where each worker may
/// be followed by options that apply to it: `replay=ENDPOINT`, `topic=PREFIX`,
/// `engine=vllm|sglang`, `bind`, `pod=NAME` (the pod it answers as in llm-d's `GetPodScores`).
/// For example
/// `1=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,pod=10.0.0.5:8000,2:1=tcp://10.0.0.6:5557`.
///
/// # Errors
/// [`ConfigError::Invalid`] naming the malformed item.
pub fn parse_worker_list(
    list: &str,
    defaults: &WorkerDefaults,
) -> Result<Vec<WorkerRegistration>, ConfigError> {
    let mut workers: Vec<WorkerRegistration> = Vec::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = |why: &str| ConfigError::Invalid(format!("--workers item {item:?}: {why}"));
        if item == "bind" {
            last_worker(&mut workers, item)?.mode = SocketMode::Bind;
            continue;
        }
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| bad("expected ID[:DP_RANK]=ENDPOINT or an option"))?;
        // Spaces around `=` are the list's, not the value's (`pod= 10.0.0.5` was the pod
        // " 10.0.0.5", which llm-d's exact pod filter never matched; `topic= kv` subscribed to
        // " kv").
        let (key, value) = (key.trim(), value.trim());
        match key {
            "replay" => last_worker(&mut workers, item)?.replay_endpoint = Some(value.to_owned()),
            "topic" => last_worker(&mut workers, item)?.topic = value.to_owned(),
            "pod" => {
                crate::registry::validate_pod_name(value).map_err(|e| bad(&e.to_string()))?;
                last_worker(&mut workers, item)?.pod_name = Some(value.to_owned());
            }
            "engine" => {
                let engine = parse_engine(value)
                    .ok_or_else(|| bad("unknown engine (expected vllm or sglang)"))?;
                last_worker(&mut workers, item)?.engine = engine;
            }
            _ => {
                let (id, rank) = match key.split_once(':') {
                    Some((id, rank)) => (id, Some(rank)),
                    None => (key, None),
                };
                let instance_id = id
                    .trim()
                    .parse()
                    .map_err(|_| bad("the worker id is not an unsigned integer"))?;
                let dp_rank = rank
                    .map(|r| r.trim().parse())
                    .transpose()
                    .map_err(|_| bad("the dp rank is not an unsigned integer"))?
                    .unwrap_or(0);
                if value.trim().is_empty() {
                    return Err(bad("empty endpoint"));
                }
                workers.push(WorkerRegistration {
                    index: defaults.index.clone(),
                    instance_id,
                    dp_rank,
                    block_size: defaults.block_size,
                    engine: defaults.engine,
                    endpoint: value.trim().to_owned(),
                    replay_endpoint: None,
                    topic: String::new(),
                    mode: SocketMode::Connect,
                    pod_name: None,
                });
            }
        }
    }
    Ok(workers)
}

/// The worker an option item applies to: the last one listed before it.
fn last_worker<'a>(
    workers: &'a mut [WorkerRegistration],
    item: &str,
) -> Result<&'a mut WorkerRegistration, ConfigError> {
    workers.last_mut().ok_or_else(|| {
        ConfigError::Invalid(format!(
            "--workers item {item:?}: an option before any worker"
        ))
    })
}

/// Parses a `--peers` list: comma-separated URLs, trimmed, empty items dropped (Dynamo's
/// form).
pub fn parse_peer_list(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.trim_end_matches('/').to_owned())
        .collect()
}

/// `vllm` or `sglang` (case-insensitively).
pub fn parse_engine(name: &str) -> Option<EngineKind> {
    if name.eq_ignore_ascii_case("vllm") {
        Some(EngineKind::Vllm)
    } else if name.eq_ignore_ascii_case("sglang") {
        Some(EngineKind::Sglang)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> WorkerDefaults {
        WorkerDefaults {
            index: IndexKey::new("m", "default"),
            block_size: BlockSize::new(16).expect("16"),
            engine: EngineKind::Vllm,
        }
    }

    #[test]
    fn publish_only_needs_publish_to_and_no_index_state() {
        let mut config = ServerConfig {
            publish_only: true,
            ..ServerConfig::default()
        };
        let error = config.validate().expect_err("no --publish-to").to_string();
        assert!(
            error.contains("--publish-only") && error.contains("--publish-to"),
            "{error}"
        );
        config.publish_to = Some(crate::nats::NatsLog::new(String::from(
            "nats://127.0.0.1:4222",
        )));
        config.validate().expect("an ingest that only publishes");
        config.peers = vec!["http://127.0.0.1:8090".into()];
        let error = config.validate().expect_err("peers").to_string();
        assert!(error.contains("--peers"), "{error}");
        // Any ingest, indexing or not, refuses a data directory.
        config.peers.clear();
        config.publish_only = false;
        config.validate().expect("an ingest that keeps an index");
        config.persistence = Some(Persistence {
            data_dir: std::path::PathBuf::from("/tmp/x"),
            interval: None,
        });
        let error = config.validate().expect_err("data dir").to_string();
        assert!(
            error.contains("--publish-to") && error.contains("--data-dir"),
            "{error}"
        );
    }

    /// A configuration built in code is held to the command line's bounds: a duration beyond
    /// ten years is refused naming the flag (a `Duration::MAX` shutdown timeout overflowed the
    /// clock at SIGTERM and panicked).
    /// A reload check every zero seconds, set in code (the command line maps 0 to none), is
    /// refused: the reloader re-read the files in a tight loop.
    #[test]
    fn a_reload_check_of_zero_is_refused() {
        let config = ServerConfig {
            reload_check: Some(Duration::ZERO),
            ..ServerConfig::default()
        };
        let error = config.validate().expect_err("refused").to_string();
        assert!(error.contains("reload check interval"), "{error}");
    }

    #[test]
    fn a_duration_beyond_ten_years_is_refused_also_in_code() {
        let beyond = MAX_DURATION + Duration::from_secs(1);
        let mut config = ServerConfig {
            shutdown_timeout: Duration::MAX,
            ..ServerConfig::default()
        };
        let error = config.validate().expect_err("too long").to_string();
        assert!(error.contains("--shutdown-timeout-secs"), "{error}");
        config.shutdown_timeout = MAX_DURATION;
        config.validate().expect("ten years");
        config.reload_check = Some(beyond);
        let error = config.validate().expect_err("too long").to_string();
        assert!(error.contains("--reload-check-secs"), "{error}");
        config.reload_check = None;
        let mut log = crate::nats::NatsLog::new("nats://127.0.0.1:4222");
        log.live_confirm_timeout = beyond;
        config.consume_from = Some(log);
        let error = config.validate().expect_err("too long").to_string();
        assert!(error.contains("--nats-live-confirm-secs"), "{error}");
    }

    #[test]
    fn a_startup_gate_that_can_never_open_is_refused() {
        let mut config = ServerConfig {
            consume_from: Some(crate::nats::NatsLog::new("nats://127.0.0.1:4222")),
            ..ServerConfig::default()
        };
        config.validate().expect("a replica");
        config.min_initial_workers = 1;
        let error = config
            .validate()
            .expect_err("a replica waits for none")
            .to_string();
        assert!(error.contains("--min-initial-workers"), "{error}");
        config.consume_from = None;
        config.validate().expect("a server that registers workers");
        config.min_initial_workers = config.limits.max_registered_ranks + 1;
        let error = config
            .validate()
            .expect_err("more than can register")
            .to_string();
        assert!(error.contains("--max-registered-ranks"), "{error}");
    }

    #[test]
    fn zero_threads_are_refused_with_the_setting_named() {
        for (name, set) in [
            (
                "writer threads",
                (|c: &mut ServerConfig| c.index.writer_threads = 0) as fn(&mut ServerConfig),
            ),
            ("listener threads", |c: &mut ServerConfig| {
                c.index.listener_threads = 0
            }),
        ] {
            let mut config = ServerConfig::default();
            config.validate().expect("the defaults are valid");
            set(&mut config);
            let error = config.validate().expect_err(name).to_string();
            assert!(
                error.contains(name) && error.contains("at least 1"),
                "{error}"
            );
        }
    }

    #[test]
    fn dynamo_worker_lists_parse() {
        let workers =
            parse_worker_list("1=tcp://h:5557, 2:1=tcp://h:5558", &defaults()).expect("parses");
        let ids: Vec<_> = workers.iter().map(|w| (w.instance_id, w.dp_rank)).collect();
        assert_eq!(ids, [(1, 0), (2, 1)]);
        assert_eq!(workers[1].endpoint, "tcp://h:5558");
        assert!(workers.iter().all(|w| w.replay_endpoint.is_none()));
    }

    #[test]
    fn options_attach_to_the_worker_before_them() {
        let workers = parse_worker_list(
            "1=tcp://h:5557,replay=tcp://h:5560,engine=sglang,bind,pod=10.0.0.5:8000,\
             2=tcp://h:5558,topic=kv",
            &defaults(),
        )
        .expect("parses");
        assert_eq!(workers[0].pod_name.as_deref(), Some("10.0.0.5:8000"));
        assert_eq!(workers[1].pod_name, None);
        assert_eq!(workers[0].replay_endpoint.as_deref(), Some("tcp://h:5560"));
        assert_eq!(workers[0].engine, EngineKind::Sglang);
        assert_eq!(workers[0].mode, SocketMode::Bind);
        assert_eq!(workers[1].topic, "kv");
        assert_eq!(workers[1].engine, EngineKind::Vllm);
        assert_eq!(workers[1].mode, SocketMode::Connect);
        // Spaces around `=` are not the value's.
        let spaced = parse_worker_list(
            "1 = tcp://h:5557, pod = 10.0.0.5:8000, topic = kv, replay = tcp://h:5560",
            &defaults(),
        )
        .expect("parses");
        assert_eq!(spaced[0].pod_name.as_deref(), Some("10.0.0.5:8000"));
        assert_eq!(spaced[0].topic, "kv");
        assert_eq!(spaced[0].replay_endpoint.as_deref(), Some("tcp://h:5560"));
        assert_eq!(spaced[0].endpoint, "tcp://h:5557");
    }

    #[test]
    fn malformed_items_are_named() {
        for (list, needle) in [
            ("x=tcp://h:1", "worker id"),
            ("1:y=tcp://h:1", "dp rank"),
            ("replay=tcp://h:1", "before any worker"),
            ("1=", "empty endpoint"),
            ("1=tcp://h:1,engine=trt", "unknown engine"),
            ("1", "expected ID"),
            ("1=tcp://h:1,pod= ", "pod_name is blank"),
        ] {
            let error = parse_worker_list(list, &defaults())
                .expect_err(list)
                .to_string();
            assert!(error.contains(needle), "{list}: {error}");
        }
    }

    #[test]
    fn tokenizer_specs_parse_and_one_per_model() {
        let file = TokenizerFile::parse("llama=/models/llama/tokenizer.json").expect("parses");
        assert_eq!(file.model, "llama");
        assert_eq!(file.path, PathBuf::from("/models/llama/tokenizer.json"));
        let file = TokenizerFile::parse("m=dir=x/tokenizer.json").expect("parses");
        assert_eq!(file.path, PathBuf::from("dir=x/tokenizer.json"));
        for (spec, needle) in [
            ("llama", "no `=`"),
            ("=x", "empty model"),
            ("m=", "empty path"),
        ] {
            let error = TokenizerFile::parse(spec).expect_err(spec).to_string();
            assert!(error.contains(needle), "{spec}: {error}");
        }
        let config = ServerConfig {
            tokenizers: vec![
                TokenizerFile::parse("m=a").expect("parses"),
                TokenizerFile::parse("m=b").expect("parses"),
            ],
            ..ServerConfig::default()
        };
        let error = config.validate().expect_err("two for m").to_string();
        assert!(error.contains("two tokenizers for model \"m\""), "{error}");
    }

    #[test]
    fn public_addresses_need_auth_unless_allowed() {
        let mut config = ServerConfig::default();
        config.validate().expect("loopback is fine");
        config.grpc_addr = "0.0.0.0:50051".parse().expect("addr");
        assert!(matches!(
            config.validate(),
            Err(ConfigError::Unauthenticated { .. })
        ));
        config.allow_unauthenticated = true;
        config.validate().expect("explicitly allowed");
        config.allow_unauthenticated = false;
        config.auth_tokens = Some("tokens".into());
        config.validate().expect("authenticated");
    }
}
