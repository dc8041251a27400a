//! The `kvatlas` command line: the arguments of every subcommand and what each does. The binary
//! (`crates/kvatlas`) only parses, sets up logging with [`init_logging`] and calls these.
//!
//! - [`serve`]: settings come from flags, then `KVATLAS_*` environment variables, then a TOML
//!   file (`--config`, the same names in snake_case), then the defaults; it serves until SIGINT
//!   or SIGTERM and prints what every index held when it stopped.
//! - [`query`], [`workers`], [`indexes`], [`register`], [`unregister`]: gRPC clients; a table by
//!   default, JSON with `--json`; a failed call exits non-zero with the server's message.

use std::fmt::Write as _;
use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvatlas_events::ListenerOptions;
use kvatlas_hash::BlockSize;
use kvatlas_proto::client::{Client, ClientError, ConnectOptions};
use kvatlas_proto::v1;
use serde_json::{Value, json};

use crate::config::{
    ConfigError, DEFAULT_SNAPSHOT_INTERVAL, IndexSettings, Limits, Persistence, ServerConfig,
    TlsFiles, TokenizerFile, WorkerDefaults, parse_engine, parse_peer_list, parse_worker_list,
};
use crate::nats::{NatsAccess, NatsLog};
use crate::registry::{DEFAULT_TENANT, IndexKey};
use crate::server::{RunningServer, ShutdownReport, StartError};

/// The longest `--quiet-probe-ms` (10 minutes).
const MAX_QUIET_PROBE_MS: u64 = 600_000;
/// The shortest `--quiet-probe-ms` but 0 (a quiet engine's replay endpoint is asked this often
/// per rank: below it, the probes are a load on the engines that finds nothing sooner than the
/// live stream would).
const MIN_QUIET_PROBE_MS: u64 = 50;
/// The exit status after a second SIGINT or SIGTERM cut the graceful shutdown short (128 +
/// SIGINT's number, as shells report an interrupted command).
pub const SECOND_SIGNAL_EXIT: i32 = 130;
/// The most `--runtime-threads`.
const MAX_RUNTIME_THREADS: usize = 1024;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// A setting is invalid.
    #[error("{0}")]
    Config(String),
    /// The server did not start.
    #[error(transparent)]
    Start(#[from] StartError),
    /// A file could not be read.
    #[error("cannot read {what}: {source}")]
    Read {
        /// The file.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The input (tokens or hashes) is malformed.
    #[error("{0}")]
    Input(String),
    /// The call failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The runtime could not be started.
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// `serve` stopped, but lost something on the way (its final snapshot, records for the
    /// event log): a supervisor must not take the stop for a clean one.
    #[error("the shutdown was not clean: {0}")]
    Shutdown(String),
}

impl From<ConfigError> for CliError {
    fn from(error: ConfigError) -> Self {
        CliError::Config(error.to_string())
    }
}

impl CliError {
    /// The process exit code: 2 for usage and input errors (a file named on the command line
    /// that cannot be read among them), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Config(_) | CliError::Input(_) | CliError::Read { .. } => 2,
            _ => 1,
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Sets up logging to stderr with a `tracing` filter (`info`, `kvatlas_server=debug`, ...).
///
/// # Errors
/// [`CliError::Config`] for a malformed filter.
pub fn init_logging(format: LogFormat, filter: &str) -> Result<(), CliError> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| CliError::Config(format!("bad log filter {filter:?}: {e}")))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    installed.map_err(|e| CliError::Config(format!("cannot set up logging: {e}")))
}

/// A multi-thread runtime with `threads` workers (default: one per core but one, left to the
/// index writers and listeners; at least one). On the 2-core machine of `docs/benchmarks.md`, one
/// worker serves more queries than two (they share the cores with the writers and the clients)
/// and more than a current-thread runtime.
fn runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime, CliError> {
    if threads == Some(0) {
        return Err(CliError::Config(
            "--runtime-threads must be at least 1 (or unset: one per core but one)".into(),
        ));
    }
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get().saturating_sub(1))
            .max(1)
    });
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .map_err(CliError::Runtime)
}

// ---------------------------------------------------------------------------------------------
// serve
// ---------------------------------------------------------------------------------------------

/// Which of `serve`'s settings came from an environment variable rather than a flag, where
/// it matters: a port from the environment does not change an address from the command line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArgSources {
    /// `--http-addr` is `KVATLAS_HTTP_ADDR`'s.
    pub http_addr_from_env: bool,
    /// `--port` is `KVATLAS_PORT`'s.
    pub port_from_env: bool,
    /// `--tokenizer` is `KVATLAS_TOKENIZER`'s: a comma-separated list (on the command line a
    /// comma is part of the path).
    pub tokenizer_from_env: bool,
}

/// `--port`'s value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortArg {
    /// A port number.
    Port(u16),
    /// A Kubernetes service link (`tcp://HOST:PORT`): Kubernetes sets `KVATLAS_PORT` so in every
    /// pod of a namespace with a Service named `kvatlas`. Ignored from the environment, refused
    /// as a flag.
    ServiceLink(String),
}

/// Parses `--port` / `KVATLAS_PORT`: a port number, or a Kubernetes service link.
fn parse_port(value: &str) -> Result<PortArg, String> {
    if let Ok(port) = value.trim().parse() {
        return Ok(PortArg::Port(port));
    }
    if ["tcp://", "udp://", "sctp://"]
        .iter()
        .any(|scheme| value.starts_with(scheme))
    {
        return Ok(PortArg::ServiceLink(value.to_owned()));
    }
    Err(format!("{value:?} is not a port number (0 to 65535)"))
}

/// A listen address: an IP address and a port, or `localhost:PORT` (127.0.0.1). Other host
/// names are refused saying what to give (a listener binds an interface's address; a name
/// that resolves to several, or to another one tomorrow, is not one).
fn parse_listen_addr(value: &str) -> Result<SocketAddr, String> {
    let value = value.trim();
    if let Ok(addr) = value.parse() {
        return Ok(addr);
    }
    if let Some(port) = value.strip_prefix("localhost:")
        && let Ok(port) = port.parse::<u16>()
    {
        return Ok(SocketAddr::new(
            std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            port,
        ));
    }
    Err(format!(
        "{value:?} is not an IP address and port: give one such as 127.0.0.1:8090 (loopback), \
         0.0.0.0:8090 (every IPv4 interface) or [::]:8090; host names other than localhost \
         are not resolved"
    ))
}

/// A listen address of the config file, read as the flags read theirs ([`parse_listen_addr`]:
/// `localhost:PORT` too; serde's own reading refused it with a generic error).
fn listen_addr_in_file<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<SocketAddr>, D::Error> {
    let text = <String as serde::Deserialize>::deserialize(deserializer)?;
    parse_listen_addr(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// `kvatlas serve`: run the index service.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// A TOML file with any of these settings (snake_case names); flags and environment
    /// variables override it.
    #[arg(long, env = "KVATLAS_CONFIG")]
    pub config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:50051; port 0 picks a free port].
    #[arg(long, env = "KVATLAS_GRPC_ADDR", value_parser = parse_listen_addr)]
    pub grpc_addr: Option<SocketAddr>,
    /// HTTP listen address for /health, /ready, /metrics, /snapshot and Dynamo's API
    /// [default: 127.0.0.1:8090].
    #[arg(long, env = "KVATLAS_HTTP_ADDR", value_parser = parse_listen_addr)]
    pub http_addr: Option<SocketAddr>,
    /// The HTTP port on the HTTP address's host (Dynamo's `--port`; kvatlas still listens on
    /// loopback unless --http-addr says otherwise). `KVATLAS_PORT` does not change an
    /// `--http-addr` given on the command line; a `KVATLAS_PORT` that is a Kubernetes service
    /// link (`tcp://10.96.0.12:8090`, set for a Service named `kvatlas`) is ignored, with a
    /// warning.
    #[arg(long, env = "KVATLAS_PORT", value_parser = parse_port)]
    pub port: Option<PortArg>,
    /// Which of the settings above came from the environment rather than the command line
    /// ([`ServeArgs::note_sources`]; without it, all count as flags).
    #[arg(skip)]
    pub sources: ArgSources,
    /// Workers to register at start: `ID[:DP_RANK]=ENDPOINT,...` (Dynamo's form), each
    /// optionally followed by `replay=ENDPOINT`, `topic=PREFIX`, `engine=vllm|sglang`, `bind`,
    /// `pod=NAME` (the pod it answers as in llm-d's `GetPodScores`).
    #[arg(long, env = "KVATLAS_WORKERS")]
    pub workers: Option<String>,
    /// The model of the `--workers` [default: default].
    #[arg(long, alias = "model-name", env = "KVATLAS_MODEL")]
    pub model: Option<String>,
    /// The tenant of the `--workers` (Dynamo's `--routing-group`) [default: default].
    #[arg(long, aliases = ["routing-group", "tenant-id"], env = "KVATLAS_TENANT")]
    pub tenant: Option<String>,
    /// The engines' block size of the `--workers` (required with --workers).
    #[arg(long, env = "KVATLAS_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// The engine of the `--workers`: vllm or sglang [default: vllm].
    #[arg(long, env = "KVATLAS_ENGINE")]
    pub engine: Option<String>,
    /// Index writer threads per index (Dynamo's `--threads`) [default: 2].
    #[arg(long, alias = "threads", env = "KVATLAS_WRITER_THREADS")]
    pub writer_threads: Option<usize>,
    /// Units queued per writer thread before producers wait (a unit is one rank's batch from a
    /// listener or `PublishEvents`, or one mutation of Dynamo's HTTP routes) [default: 16384].
    #[arg(long, env = "KVATLAS_WRITER_QUEUE")]
    pub writer_queue: Option<usize>,
    /// Threads polling the engines' ZMQ sockets, shared by all indexes; each serves many
    /// engines [default: 1].
    #[arg(long, env = "KVATLAS_LISTENER_THREADS")]
    pub listener_threads: Option<usize>,
    /// Most (rank, block) pairs per index; beyond it the least recently stored leaf blocks are
    /// evicted, and a peer's or the NATS bucket's snapshot holding more is refused
    /// [default: unbounded].
    #[arg(long, env = "KVATLAS_CAPACITY")]
    pub capacity: Option<u64>,
    /// Refuse queries (health NOT_SERVING) until this many worker ranks are registered; Dynamo's
    /// `DYN_ROUTER_MIN_INITIAL_WORKERS` is read when neither this nor the file sets it
    /// [default: 0].
    #[arg(long, env = "KVATLAS_MIN_INITIAL_WORKERS")]
    pub min_initial_workers: Option<usize>,
    /// The data directory: the newest readable snapshot in it is restored at start, and
    /// snapshots are written to it periodically and at shutdown [default: none, in memory only].
    #[arg(long, env = "KVATLAS_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Seconds between data-directory snapshots (skipped while nothing changed); 0 = only at
    /// shutdown [default: 30].
    #[arg(long, env = "KVATLAS_SNAPSHOT_INTERVAL_SECS")]
    pub snapshot_interval_secs: Option<u64>,
    /// Milliseconds of silence on an engine's live stream after which its replay endpoint is
    /// asked for everything from the last batch applied on (a probe): a batch the live stream
    /// lost is then found even if the engine publishes nothing after it, and so is an engine
    /// that restarted and went quiet. The wait doubles while the stream stays quiet (up to
    /// 16 ×); a probe also follows every (re)connection to the engine, and the first batch;
    /// 0 = never probe [default: 2000, at most 600000].
    #[arg(long, env = "KVATLAS_QUIET_PROBE_MS")]
    pub quiet_probe_ms: Option<u64>,
    /// Peers to bootstrap from when there is no local snapshot: comma-separated base URLs of
    /// kvatlas (native snapshot, exact) or Dynamo indexers (`/dump`), tried in order.
    #[arg(long, env = "KVATLAS_PEERS")]
    pub peers: Option<String>,
    /// A file whose first line is the bearer token sent to peers (a peer listening beyond
    /// loopback requires one; `/snapshot` needs a token allowed every tenant).
    #[arg(long, env = "KVATLAS_PEER_TOKEN_FILE")]
    pub peer_token_file: Option<PathBuf>,
    /// PEM CA certificates to trust for https:// peers [default: the system's roots].
    #[arg(long, env = "KVATLAS_PEER_CA_CERT")]
    pub peer_ca_cert: Option<PathBuf>,
    /// Most token ids per query [default: 1048576].
    #[arg(long, env = "KVATLAS_MAX_QUERY_TOKENS")]
    pub max_query_tokens: Option<usize>,
    /// Largest gRPC message in bytes [default: 16 MiB].
    #[arg(long, env = "KVATLAS_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Most requests and open streams served at once; beyond it requests are shed with
    /// RESOURCE_EXHAUSTED [default: 1024].
    #[arg(long, env = "KVATLAS_MAX_CONCURRENT_REQUESTS")]
    pub max_concurrent_requests: Option<usize>,
    /// With --auth-tokens: most requests and open streams one token holds at once, for tokens
    /// whose line sets no `max_requests=` [default: no bound but the server's].
    #[arg(long, env = "KVATLAS_MAX_REQUESTS_PER_TOKEN")]
    pub max_requests_per_token: Option<usize>,
    /// Most indexes [default: 1024].
    #[arg(long, env = "KVATLAS_MAX_INDEXES")]
    pub max_indexes: Option<usize>,
    /// Most registered worker ranks [default: 4096].
    #[arg(long, env = "KVATLAS_MAX_REGISTERED_RANKS")]
    pub max_registered_ranks: Option<usize>,
    /// Seconds a whole-state read (`/snapshot`, `Snapshot`, `/dump`) waits for its reader to
    /// take the next 1 MiB chunk before it is abandoned, freeing its places (among the two
    /// whole-state reads, the concurrent requests and its token's) [default: 30].
    #[arg(long, env = "KVATLAS_STALL_TIMEOUT_SECS")]
    pub stall_timeout_secs: Option<u64>,
    /// Bearer-token file: one token per line, optionally `tenants=A,B`, `name=LABEL` and
    /// `max_requests=N`. Read again on SIGHUP and every --reload-check-secs (an invalid version
    /// is refused).
    #[arg(long, env = "KVATLAS_AUTH_TOKENS")]
    pub auth_tokens: Option<PathBuf>,
    /// Accept listening beyond loopback without authentication.
    #[arg(long, env = "KVATLAS_ALLOW_UNAUTHENTICATED", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_unauthenticated: Option<bool>,
    /// TLS certificate chain (PEM) for both listeners. It and the key are read again on SIGHUP
    /// and every --reload-check-secs (new connections get a changed pair; an invalid one is
    /// refused).
    #[arg(long, env = "KVATLAS_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, env = "KVATLAS_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Seconds between checks of the token file and the TLS certificate for changes; 0 reads
    /// them again on SIGHUP only [default: 10].
    #[arg(long, env = "KVATLAS_RELOAD_CHECK_SECS")]
    pub reload_check_secs: Option<u64>,
    /// Seconds a graceful shutdown may take [default: 10].
    #[arg(long, env = "KVATLAS_SHUTDOWN_TIMEOUT")]
    pub shutdown_timeout_secs: Option<u64>,
    /// Async runtime threads serving requests [default: one per core but one (at least 1)].
    #[arg(long, env = "KVATLAS_RUNTIME_THREADS")]
    pub runtime_threads: Option<usize>,
    /// Keep the runtime threads polling for requests instead of sleeping until woken: lower
    /// latency at low load (no thread wakeup per request), a core busy per runtime thread.
    #[arg(long, env = "KVATLAS_BUSY_POLL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub busy_poll: Option<bool>,
    /// A model's Hugging Face tokenizer.json, `MODEL=PATH` (repeatable; comma-separated in the
    /// environment variable): llm-d's GetPodScores tokenizes prompts with it. Loaded at start.
    #[arg(long = "tokenizer", env = "KVATLAS_TOKENIZER")]
    pub tokenizers: Vec<String>,
    /// Be an ingest: publish every event batch the listeners and PublishEvents apply to this
    /// NATS JetStream event log, `nats://HOST:PORT` (docs/server.md, "Scale-out").
    #[arg(long, env = "KVATLAS_PUBLISH_TO", conflicts_with = "consume_from")]
    pub publish_to: Option<String>,
    /// With --publish-to: only publish. The ingest keeps no index of its own (no apply, less
    /// CPU and memory) and refuses queries (FAILED_PRECONDITION): query the replicas.
    #[arg(long, env = "KVATLAS_PUBLISH_ONLY", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub publish_only: Option<bool>,
    /// Be a query replica of this NATS JetStream event log, `nats://HOST:PORT`: restore the
    /// newest snapshot of the bucket, apply the stream, write snapshots in turn.
    #[arg(long, env = "KVATLAS_CONSUME_FROM")]
    pub consume_from: Option<String>,
    /// The event log's JetStream stream [default: KVATLAS_EVENTS].
    #[arg(long, env = "KVATLAS_NATS_STREAM")]
    pub nats_stream: Option<String>,
    /// The event log's subject prefix [default: kvatlas.events].
    #[arg(long, env = "KVATLAS_NATS_SUBJECT_PREFIX")]
    pub nats_subject_prefix: Option<String>,
    /// Seconds the stream keeps a record (used when the ingest creates it) [default: 3600].
    #[arg(long, env = "KVATLAS_NATS_MAX_AGE_SECS")]
    pub nats_max_age_secs: Option<u64>,
    /// Bytes the stream keeps (used when the ingest creates it) [default: 1 GiB].
    #[arg(long, env = "KVATLAS_NATS_MAX_BYTES")]
    pub nats_max_bytes: Option<i64>,
    /// The object-store bucket of replica snapshots [default: KVATLAS_SNAPSHOTS].
    #[arg(long, env = "KVATLAS_NATS_SNAPSHOT_BUCKET")]
    pub nats_snapshot_bucket: Option<String>,
    /// Seconds between a replica's snapshots, taken in turn with the other replicas; 0 = never
    /// [default: 30].
    #[arg(long, env = "KVATLAS_NATS_SNAPSHOT_INTERVAL_SECS")]
    pub nats_snapshot_interval_secs: Option<u64>,
    /// Turn the live path off: an ingest publishes to the stream only, and a replica applies
    /// what the stream delivers only (by default an ingest also publishes each record at once
    /// on core NATS and replicas apply it before the stream confirms it: docs/server.md).
    #[arg(long, env = "KVATLAS_NATS_NO_LIVE", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub nats_no_live: Option<bool>,
    /// Seconds a replica waits for the stream's copy of a live record it applied; past them it
    /// takes the record for one its ingest never stored (the ingest died first) and goes back
    /// to the stream's state [default: 30].
    #[arg(long, env = "KVATLAS_NATS_LIVE_CONFIRM_SECS")]
    pub nats_live_confirm_secs: Option<u64>,
    /// A file holding the token of a nats-server with `authorization { token }`, read at
    /// start and at every reconnection (a rotated token is used once NATS asks again).
    #[arg(long, env = "KVATLAS_NATS_TOKEN_FILE", conflicts_with_all = ["nats_nkey_file", "nats_creds_file"])]
    pub nats_token_file: Option<PathBuf>,
    /// A file holding an NKey seed (`SU…`) whose public key nats-server authorizes, read at
    /// start and at every reconnection.
    #[arg(
        long,
        env = "KVATLAS_NATS_NKEY_FILE",
        conflicts_with = "nats_creds_file"
    )]
    pub nats_nkey_file: Option<PathBuf>,
    /// A NATS credentials file (a user JWT and its seed, as `nsc` writes it) for a nats-server
    /// in operator mode, read at start and at every reconnection.
    #[arg(long, env = "KVATLAS_NATS_CREDS_FILE")]
    pub nats_creds_file: Option<PathBuf>,
    /// CA certificates (PEM) the NATS server's certificate must chain to (a private CA);
    /// the connection must then be TLS [default: the system's roots for a tls:// URL].
    #[arg(long, env = "KVATLAS_NATS_CA_CERT")]
    pub nats_ca_cert: Option<PathBuf>,
    /// A client certificate (PEM) for a nats-server that verifies clients (`tls { verify:
    /// true }`), with --nats-tls-key.
    #[arg(long, env = "KVATLAS_NATS_TLS_CERT")]
    pub nats_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --nats-tls-cert.
    #[arg(long, env = "KVATLAS_NATS_TLS_KEY")]
    pub nats_tls_key: Option<PathBuf>,
}

/// The TOML file of `--config`: the same settings.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    #[serde(default, deserialize_with = "listen_addr_in_file")]
    grpc_addr: Option<SocketAddr>,
    #[serde(default, deserialize_with = "listen_addr_in_file")]
    http_addr: Option<SocketAddr>,
    port: Option<u16>,
    workers: Option<String>,
    model: Option<String>,
    tenant: Option<String>,
    block_size: Option<u32>,
    engine: Option<String>,
    writer_threads: Option<usize>,
    writer_queue: Option<usize>,
    listener_threads: Option<usize>,
    capacity: Option<u64>,
    min_initial_workers: Option<usize>,
    data_dir: Option<PathBuf>,
    snapshot_interval_secs: Option<u64>,
    quiet_probe_ms: Option<u64>,
    peers: Option<String>,
    peer_token_file: Option<PathBuf>,
    peer_ca_cert: Option<PathBuf>,
    max_query_tokens: Option<usize>,
    max_message_bytes: Option<usize>,
    max_concurrent_requests: Option<usize>,
    max_requests_per_token: Option<usize>,
    max_indexes: Option<usize>,
    max_registered_ranks: Option<usize>,
    stall_timeout_secs: Option<u64>,
    auth_tokens: Option<PathBuf>,
    allow_unauthenticated: Option<bool>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    reload_check_secs: Option<u64>,
    shutdown_timeout_secs: Option<u64>,
    runtime_threads: Option<usize>,
    busy_poll: Option<bool>,
    /// `MODEL=PATH` items, as `--tokenizer`.
    tokenizer: Option<Vec<String>>,
    publish_to: Option<String>,
    publish_only: Option<bool>,
    consume_from: Option<String>,
    nats_stream: Option<String>,
    nats_subject_prefix: Option<String>,
    nats_max_age_secs: Option<u64>,
    nats_max_bytes: Option<i64>,
    nats_snapshot_bucket: Option<String>,
    nats_snapshot_interval_secs: Option<u64>,
    nats_no_live: Option<bool>,
    nats_live_confirm_secs: Option<u64>,
    nats_token_file: Option<PathBuf>,
    nats_nkey_file: Option<PathBuf>,
    nats_creds_file: Option<PathBuf>,
    nats_ca_cert: Option<PathBuf>,
    nats_tls_cert: Option<PathBuf>,
    nats_tls_key: Option<PathBuf>,
}

impl ServeArgs {
    /// Records which settings came from the environment, from the command line's matches of
    /// `serve` (the binary calls it; the derive's parse cannot tell).
    pub fn note_sources(&mut self, matches: &clap::ArgMatches) {
        let from_env = |id: &str| {
            matches!(
                matches.value_source(id),
                Some(clap::parser::ValueSource::EnvVariable)
            )
        };
        self.sources = ArgSources {
            http_addr_from_env: from_env("http_addr"),
            port_from_env: from_env("port"),
            tokenizer_from_env: from_env("tokenizers"),
        };
    }

    /// The server configuration and runtime threads: flags and environment, then the file,
    /// then the defaults.
    ///
    /// # Errors
    /// [`CliError::Config`] for an unreadable or malformed file or an invalid setting.
    pub fn resolve(&self) -> Result<(ServerConfig, Option<usize>), CliError> {
        self.resolve_noting_unused()
            .map(|resolved| (resolved.config, resolved.runtime_threads))
    }

    /// As [`ServeArgs::resolve`], and the settings given that have no effect with the others
    /// (`serve` logs them as warnings: a `--snapshot-interval-secs` without `--data-dir` is
    /// more likely a forgotten `--data-dir` than a wish).
    ///
    /// # Errors
    /// What [`ServeArgs::resolve`] returns.
    pub fn resolve_noting_unused(&self) -> Result<Resolved, CliError> {
        let file: ServeFile = match &self.config {
            Some(path) => {
                let text = crate::bounded_read::read_text_within(
                    path,
                    crate::bounded_read::MAX_CONFIG_BYTES,
                )
                .map_err(|source| CliError::Read {
                    what: path.display().to_string(),
                    source,
                })?;
                toml::from_str(&text)
                    .map_err(|e| CliError::Config(format!("{}: {e}", path.display())))?
            }
            None => ServeFile::default(),
        };
        // (What the file gave, for the settings without effect: `file` is taken apart below.)
        let given_by_file = file.clone();
        if let Some(threads) = self
            .runtime_threads
            .or(file.runtime_threads)
            .filter(|&threads| threads > MAX_RUNTIME_THREADS)
        {
            return Err(CliError::Config(format!(
                "--runtime-threads {threads}: at most {MAX_RUNTIME_THREADS}"
            )));
        }
        let defaults = ServerConfig::default();
        let limits = Limits::default();
        let index = IndexSettings::default();
        // Flags win over the environment, and both over the file, as a whole: an address is
        // not changed by a port from a layer below it (`--http-addr` by `KVATLAS_PORT` or the
        // file's `port`), and a port changes whichever address wins otherwise.
        let mut http_addr = self
            .http_addr
            .or(file.http_addr)
            .unwrap_or(defaults.http_addr);
        let address_from_flag = self.http_addr.is_some() && !self.sources.http_addr_from_env;
        let mut ignored = Vec::new();
        let port = match &self.port {
            Some(PortArg::Port(port)) => Some(*port),
            Some(PortArg::ServiceLink(link)) if self.sources.port_from_env => {
                ignored.push(format!(
                    "KVATLAS_PORT={link:?} is ignored: a Kubernetes service link (set for a \
                     Service named kvatlas), not a port; give --port or --http-addr"
                ));
                None
            }
            Some(PortArg::ServiceLink(link)) => {
                return Err(CliError::Config(format!(
                    "--port {link:?}: a port number (0 to 65535) is expected"
                )));
            }
            None => None,
        };
        let port = port
            .filter(|_| !(address_from_flag && self.sources.port_from_env))
            .or(file.port.filter(|_| self.http_addr.is_none()));
        if let Some(port) = port {
            http_addr.set_port(port);
        }
        let min_initial_workers = match self.min_initial_workers.or(file.min_initial_workers) {
            Some(n) => n,
            None => dynamo_min_initial_workers()?,
        };
        let persistence = self
            .data_dir
            .clone()
            .or(file.data_dir)
            .map(|data_dir| Persistence {
                data_dir,
                interval: match self.snapshot_interval_secs.or(file.snapshot_interval_secs) {
                    Some(0) => None,
                    Some(secs) => Some(Duration::from_secs(secs)),
                    None => Some(DEFAULT_SNAPSHOT_INTERVAL),
                },
            });
        let mut config = ServerConfig {
            grpc_addr: self
                .grpc_addr
                .or(file.grpc_addr)
                .unwrap_or(defaults.grpc_addr),
            http_addr,
            index: IndexSettings {
                writer_threads: self
                    .writer_threads
                    .or(file.writer_threads)
                    .unwrap_or(index.writer_threads),
                writer_queue: self
                    .writer_queue
                    .or(file.writer_queue)
                    .unwrap_or(index.writer_queue),
                listener_threads: self
                    .listener_threads
                    .or(file.listener_threads)
                    .unwrap_or(index.listener_threads),
                capacity: self.capacity.or(file.capacity),
                listener: ListenerOptions {
                    quiet_probe: match self.quiet_probe_ms.or(file.quiet_probe_ms) {
                        Some(0) => None,
                        Some(ms) if ms > MAX_QUIET_PROBE_MS => {
                            return Err(CliError::Config(format!(
                                "--quiet-probe-ms {ms} is longer than {MAX_QUIET_PROBE_MS} \
                                 (10 minutes); 0 turns probing off"
                            )));
                        }
                        Some(ms) if ms < MIN_QUIET_PROBE_MS => {
                            return Err(CliError::Config(format!(
                                "--quiet-probe-ms {ms} is shorter than {MIN_QUIET_PROBE_MS}: \
                                 each quiet engine's replay endpoint would be asked every {ms} \
                                 ms; 0 turns probing off"
                            )));
                        }
                        Some(ms) => Some(Duration::from_millis(ms)),
                        None => index.listener.quiet_probe,
                    },
                    ..index.listener
                },
            },
            min_initial_workers,
            limits: Limits {
                max_query_tokens: self
                    .max_query_tokens
                    .or(file.max_query_tokens)
                    .unwrap_or(limits.max_query_tokens),
                max_message_bytes: self
                    .max_message_bytes
                    .or(file.max_message_bytes)
                    .unwrap_or(limits.max_message_bytes),
                max_concurrent_requests: self
                    .max_concurrent_requests
                    .or(file.max_concurrent_requests)
                    .unwrap_or(limits.max_concurrent_requests),
                max_requests_per_token: self
                    .max_requests_per_token
                    .or(file.max_requests_per_token)
                    .or(limits.max_requests_per_token),
                max_indexes: self
                    .max_indexes
                    .or(file.max_indexes)
                    .unwrap_or(limits.max_indexes),
                max_registered_ranks: self
                    .max_registered_ranks
                    .or(file.max_registered_ranks)
                    .unwrap_or(limits.max_registered_ranks),
                stall_timeout: self
                    .stall_timeout_secs
                    .or(file.stall_timeout_secs)
                    .map_or(limits.stall_timeout, Duration::from_secs),
            },
            auth_tokens: self.auth_tokens.clone().or(file.auth_tokens),
            allow_unauthenticated: self
                .allow_unauthenticated
                .or(file.allow_unauthenticated)
                .unwrap_or(false),
            tls: tls_pair(
                self.tls_cert.clone().or(file.tls_cert),
                self.tls_key.clone().or(file.tls_key),
                "TLS needs both a certificate (--tls-cert) and a key (--tls-key)",
            )?,
            workers: Vec::new(),
            reload_check: match self.reload_check_secs.or(file.reload_check_secs) {
                Some(0) => None,
                Some(secs) => Some(Duration::from_secs(secs)),
                None => defaults.reload_check,
            },
            shutdown_timeout: self
                .shutdown_timeout_secs
                .or(file.shutdown_timeout_secs)
                .map_or(defaults.shutdown_timeout, Duration::from_secs),
            persistence,
            peers: self
                .peers
                .clone()
                .or(file.peers)
                .map(|list| parse_peer_list(&list))
                .unwrap_or_default(),
            peer_token_file: self.peer_token_file.clone().or(file.peer_token_file),
            peer_ca_cert: self.peer_ca_cert.clone().or(file.peer_ca_cert),
            tokenizers: if self.tokenizers.is_empty() {
                file.tokenizer.unwrap_or_default()
            } else if self.sources.tokenizer_from_env {
                self.tokenizers
                    .iter()
                    .flat_map(|list| list.split(','))
                    .map(str::to_owned)
                    .collect()
            } else {
                self.tokenizers.clone()
            }
            .iter()
            .map(|spec| TokenizerFile::parse(spec))
            .collect::<Result<_, _>>()?,
            publish_to: None,
            consume_from: None,
            publish_only: self.publish_only.or(file.publish_only).unwrap_or(false),
            busy_poll: self.busy_poll.or(file.busy_poll).unwrap_or(false),
        };
        let nats_access = NatsAccess {
            token_file: self
                .nats_token_file
                .clone()
                .or_else(|| file.nats_token_file.clone()),
            nkey_file: self
                .nats_nkey_file
                .clone()
                .or_else(|| file.nats_nkey_file.clone()),
            creds_file: self
                .nats_creds_file
                .clone()
                .or_else(|| file.nats_creds_file.clone()),
            ca_cert: self
                .nats_ca_cert
                .clone()
                .or_else(|| file.nats_ca_cert.clone()),
            client_tls: tls_pair(
                self.nats_tls_cert
                    .clone()
                    .or_else(|| file.nats_tls_cert.clone()),
                self.nats_tls_key
                    .clone()
                    .or_else(|| file.nats_tls_key.clone()),
                "a NATS client certificate needs both --nats-tls-cert and --nats-tls-key",
            )?,
        };
        let nats = |url: String| {
            let defaults = NatsLog::new(url);
            NatsLog {
                access: nats_access.clone(),
                stream: self
                    .nats_stream
                    .clone()
                    .or_else(|| file.nats_stream.clone())
                    .unwrap_or(defaults.stream),
                subject_prefix: self
                    .nats_subject_prefix
                    .clone()
                    .or_else(|| file.nats_subject_prefix.clone())
                    .unwrap_or(defaults.subject_prefix),
                max_age: self
                    .nats_max_age_secs
                    .or(file.nats_max_age_secs)
                    .map_or(defaults.max_age, Duration::from_secs),
                max_bytes: self
                    .nats_max_bytes
                    .or(file.nats_max_bytes)
                    .unwrap_or(defaults.max_bytes),
                snapshot_bucket: self
                    .nats_snapshot_bucket
                    .clone()
                    .or_else(|| file.nats_snapshot_bucket.clone())
                    .unwrap_or(defaults.snapshot_bucket),
                snapshot_interval: match self
                    .nats_snapshot_interval_secs
                    .or(file.nats_snapshot_interval_secs)
                {
                    Some(0) => None,
                    Some(secs) => Some(Duration::from_secs(secs)),
                    None => defaults.snapshot_interval,
                },
                live: !self.nats_no_live.or(file.nats_no_live).unwrap_or(false),
                live_confirm_timeout: self
                    .nats_live_confirm_secs
                    .or(file.nats_live_confirm_secs)
                    .map_or(defaults.live_confirm_timeout, Duration::from_secs),
                ..defaults
            }
        };
        config.publish_to = self
            .publish_to
            .clone()
            .or_else(|| file.publish_to.clone())
            .map(nats);
        config.consume_from = self
            .consume_from
            .clone()
            .or_else(|| file.consume_from.clone())
            .map(nats);
        if let Some(list) = self.workers.clone().or(file.workers) {
            let block_size = self.block_size.or(file.block_size).ok_or_else(|| {
                CliError::Config("--workers needs --block-size (the engines' block size)".into())
            })?;
            let block_size = BlockSize::new(block_size)
                .map_err(|e| CliError::Config(format!("--block-size: {e}")))?;
            let engine_name = self
                .engine
                .clone()
                .or(file.engine)
                .unwrap_or_else(|| "vllm".into());
            let engine = parse_engine(&engine_name).ok_or_else(|| {
                CliError::Config(format!("--engine {engine_name:?}: expected vllm or sglang"))
            })?;
            let defaults = WorkerDefaults {
                index: IndexKey::new(
                    self.model
                        .clone()
                        .or(file.model)
                        .unwrap_or_else(|| "default".into()),
                    self.tenant
                        .clone()
                        .or(file.tenant)
                        .unwrap_or_else(|| DEFAULT_TENANT.into()),
                ),
                block_size,
                engine,
            };
            config.workers = parse_worker_list(&list, &defaults)?;
        }
        config.validate()?;
        let mut without_effect = self.without_effect(&given_by_file, &config);
        without_effect.extend(ignored);
        Ok(Resolved {
            config,
            runtime_threads: self.runtime_threads.or(file.runtime_threads),
            without_effect,
        })
    }

    /// The settings given (by a flag, a variable or the file) that have no effect with the
    /// resolved `config`, each with what it needs.
    fn without_effect(&self, file: &ServeFile, config: &ServerConfig) -> Vec<String> {
        // Whether a setting was given, by a flag, a variable or the file.
        macro_rules! given {
            ($field:ident) => {
                self.$field.is_some() || file.$field.is_some()
            };
        }
        let mut unused = Vec::new();
        let mut note = |given: bool, flag: &str, needs: &str| {
            if given {
                unused.push(format!("{flag} has no effect without {needs}"));
            }
        };
        let log = config.publish_to.is_some() || config.consume_from.is_some();
        let replica = config.consume_from.is_some();
        for (given, flag) in [
            (given!(nats_stream), "--nats-stream"),
            (given!(nats_subject_prefix), "--nats-subject-prefix"),
            (given!(nats_max_age_secs), "--nats-max-age-secs"),
            (given!(nats_max_bytes), "--nats-max-bytes"),
            (given!(nats_no_live), "--nats-no-live"),
            (given!(nats_token_file), "--nats-token-file"),
            (given!(nats_nkey_file), "--nats-nkey-file"),
            (given!(nats_creds_file), "--nats-creds-file"),
            (given!(nats_ca_cert), "--nats-ca-cert"),
            (given!(nats_tls_cert), "--nats-tls-cert"),
        ] {
            note(given && !log, flag, "--publish-to or --consume-from");
        }
        for (given, flag) in [
            (given!(nats_snapshot_bucket), "--nats-snapshot-bucket"),
            (
                given!(nats_snapshot_interval_secs),
                "--nats-snapshot-interval-secs",
            ),
        ] {
            note(
                given && !replica,
                flag,
                "--consume-from (replicas write and read the bucket)",
            );
        }
        let live_confirm = given!(nats_live_confirm_secs);
        note(
            live_confirm && !replica,
            "--nats-live-confirm-secs",
            "--consume-from (a replica confirms live records)",
        );
        note(
            live_confirm && config.consume_from.as_ref().is_some_and(|log| !log.live),
            "--nats-live-confirm-secs",
            "the live path (--nats-no-live turns it off)",
        );
        for (given, flag) in [
            (config.peer_token_file.is_some(), "--peer-token-file"),
            (config.peer_ca_cert.is_some(), "--peer-ca-cert"),
        ] {
            note(given && config.peers.is_empty(), flag, "--peers");
        }
        note(
            given!(snapshot_interval_secs) && config.persistence.is_none(),
            "--snapshot-interval-secs",
            "--data-dir",
        );
        note(
            given!(max_requests_per_token) && config.auth_tokens.is_none(),
            "--max-requests-per-token",
            "--auth-tokens",
        );
        note(
            given!(reload_check_secs) && config.auth_tokens.is_none() && config.tls.is_none(),
            "--reload-check-secs",
            "--auth-tokens or --tls-cert",
        );
        let workers = config.workers.is_empty();
        for (given, flag) in [
            (given!(model), "--model"),
            (given!(tenant), "--tenant"),
            (given!(block_size), "--block-size"),
            (given!(engine), "--engine"),
        ] {
            note(
                given && workers,
                flag,
                "--workers (it applies to them only)",
            );
        }
        unused
    }
}

/// What [`ServeArgs::resolve_noting_unused`] makes of the settings.
#[derive(Debug)]
pub struct Resolved {
    /// The server's configuration.
    pub config: ServerConfig,
    /// `--runtime-threads`.
    pub runtime_threads: Option<usize>,
    /// Settings given that have no effect with the others, each saying what it needs.
    pub without_effect: Vec<String>,
}

/// Dynamo's `DYN_ROUTER_MIN_INITIAL_WORKERS`, or 0 if unset.
fn dynamo_min_initial_workers() -> Result<usize, CliError> {
    match std::env::var("DYN_ROUTER_MIN_INITIAL_WORKERS") {
        Ok(value) => value.trim().parse().map_err(|e| {
            CliError::Config(format!(
                "DYN_ROUTER_MIN_INITIAL_WORKERS must be a non-negative integer, got {value:?}: {e}"
            ))
        }),
        Err(_) => Ok(0),
    }
}

/// `kvatlas serve`: serves until SIGINT or SIGTERM, then prints what every index held.
///
/// # Errors
/// A bad setting, or a server that cannot start.
pub fn serve(args: &ServeArgs) -> Result<(), CliError> {
    let Resolved {
        config,
        runtime_threads: threads,
        without_effect,
    } = args.resolve_noting_unused()?;
    for setting in &without_effect {
        tracing::warn!("{setting}");
    }
    let runtime = runtime(threads)?;
    let report = runtime.block_on(async {
        // Taken before the start: a SIGTERM while the server starts (a restore, NATS being
        // reached) stops the start at once, and one after it stops the server gracefully.
        let signal = crate::shutdown_signal();
        tokio::pin!(signal);
        let server = tokio::select! {
            started = RunningServer::start(config) => started?,
            () = &mut signal => {
                tracing::info!("shutdown signal received while starting: stopping");
                return Ok(None);
            }
        };
        // A second signal while the graceful shutdown runs (open streams waited for up to
        // --shutdown-timeout-secs, then the final snapshot) stops the process at once, as an
        // operator pressing Ctrl-C twice expects. Its listener is taken as the first signal
        // comes (not before: it would see the first one too).
        let (first_came, second_signal) = tokio::sync::oneshot::channel();
        let watching = tokio::spawn(async move {
            if let Ok(second) = second_signal.await {
                second.await;
                tracing::warn!(
                    "a second shutdown signal: exiting now, without the rest of the graceful \
                     shutdown or the final snapshot"
                );
                std::process::exit(SECOND_SIGNAL_EXIT);
            }
        });
        let report = server
            .run_until(async move {
                signal.await;
                let _ = first_came.send(crate::shutdown_signal());
            })
            .await;
        // The shutdown is complete (its snapshot written): a signal now does not cut the
        // summary short.
        watching.abort();
        Ok::<_, CliError>(Some(report))
    })?;
    match report {
        Some(report) => {
            // Printed for whoever reads it: a stdout closed by now (its reader gone) does not
            // turn the stop into a crash (`print!` panicked).
            use std::io::Write as _;
            let _ = std::io::stdout()
                .lock()
                .write_all(shutdown_summary(&report).as_bytes());
            let failures: Vec<String> = report
                .snapshot
                .and_then(Result::err)
                .map(|error| format!("the final snapshot failed: {error}"))
                .into_iter()
                .chain(report.unpublished)
                .collect();
            if !failures.is_empty() {
                return Err(CliError::Shutdown(failures.join("; ")));
            }
        }
        // Stopped while starting: what the start left running on blocking threads (a restore
        // reading a snapshot, engines' sockets being set up) is not waited for (dropping the
        // runtime would wait for it); it reads, or sets up what the exit closes.
        None => runtime.shutdown_background(),
    }
    Ok(())
}

/// The lines `serve` prints at the end, one per index.
pub fn shutdown_summary(report: &ShutdownReport) -> String {
    let mut out = String::new();
    for index in &report.indexes {
        let _ = writeln!(
            out,
            "index model={} tenant={}: {} memberships, digest {:#018x}, {} events applied",
            index.key.model,
            index.key.tenant,
            index.memberships,
            index.digest,
            index.events_applied
        );
        for (worker, seq) in &index.last_seq {
            let _ = writeln!(
                out,
                "  worker {} rank {}: last applied seq {}",
                worker.worker_id,
                worker.dp_rank,
                seq.map_or_else(|| "-".to_owned(), |s| s.to_string())
            );
        }
    }
    match &report.snapshot {
        Some(Ok(written)) => {
            let _ = writeln!(
                out,
                "snapshot {}: {} bytes, {} memberships",
                written.path.display(),
                written.bytes,
                written.memberships
            );
        }
        Some(Err(error)) => {
            let _ = writeln!(out, "the final snapshot failed: {error}");
        }
        None => {}
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Client commands
// ---------------------------------------------------------------------------------------------

/// How the client commands reach a server.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectArgs {
    /// The server's gRPC address.
    #[arg(long, env = "KVATLAS_SERVER", default_value = "http://127.0.0.1:50051")]
    pub server: String,
    /// A file holding the bearer token (its first token: blank lines and `#` comments skipped).
    #[arg(long, env = "KVATLAS_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// A PEM CA certificate to trust for an https:// server.
    #[arg(long, env = "KVATLAS_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Seconds to wait for an answer.
    #[arg(long, default_value_t = 10)]
    pub timeout_secs: u64,
}

fn read_file(path: &Path) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|source| CliError::Read {
        what: path.display().to_string(),
        source,
    })
}

impl ConnectArgs {
    async fn connect(&self) -> Result<Client, CliError> {
        let token = match &self.token_file {
            Some(path) => {
                let text = String::from_utf8_lossy(&read_file(path)?).into_owned();
                let token = crate::auth::token_of_file(&text);
                if token.is_empty() {
                    return Err(CliError::Config(format!(
                        "the token file {} holds no token",
                        path.display()
                    )));
                }
                Some(token.to_owned())
            }
            None => None,
        };
        let options = ConnectOptions {
            token,
            timeout: Some(Duration::from_secs(self.timeout_secs.max(1))),
            ca_certificate_pem: self.ca_cert.as_deref().map(read_file).transpose()?,
        };
        Ok(Client::connect_with(&self.server, &options).await?)
    }
}

/// `kvatlas query`: which workers hold how much of a prompt.
#[derive(Debug, Clone, clap::Args)]
pub struct QueryArgs {
    #[command(flatten)]
    /// The server.
    pub connect: ConnectArgs,
    /// The model.
    #[arg(long)]
    pub model: String,
    /// The tenant.
    #[arg(long, default_value = DEFAULT_TENANT)]
    pub tenant: String,
    /// A file of token ids (whitespace or comma separated; `-` = stdin); the server hashes them.
    #[arg(long, conflicts_with = "hashes", required_unless_present = "hashes")]
    pub tokens: Option<PathBuf>,
    /// A file of local block hashes (decimal or 0x-hex; `-` = stdin).
    #[arg(long)]
    pub hashes: Option<PathBuf>,
    /// The LoRA adapter of the prompt (token queries).
    #[arg(long, default_value = "")]
    pub lora_name: String,
    /// The cache salt of the prompt (token queries).
    #[arg(long, default_value = "")]
    pub cache_salt: String,
    /// Stop once at most one worker still matches.
    #[arg(long)]
    pub early_exit: bool,
    /// Keep only the best k workers.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Leave out workers matching fewer blocks.
    #[arg(long, default_value_t = 0)]
    pub min_blocks: u32,
    /// Only these instance ids (repeatable).
    #[arg(long = "instance")]
    pub instances: Vec<u64>,
    /// Score the device tier only.
    #[arg(long)]
    pub device_only: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn read_input(path: &Path) -> Result<String, CliError> {
    if path == Path::new("-") {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|source| CliError::Read {
                what: "standard input".into(),
                source,
            })?;
        Ok(text)
    } else {
        Ok(String::from_utf8_lossy(&read_file(path)?).into_owned())
    }
}

fn numbers<T>(
    text: &str,
    parse: impl Fn(&str) -> Option<T>,
    what: &str,
) -> Result<Vec<T>, CliError> {
    text.split(|c: char| c.is_whitespace() || matches!(c, ',' | '[' | ']'))
        .filter(|t| !t.is_empty())
        .map(|t| parse(t).ok_or_else(|| CliError::Input(format!("{t:?} is not a {what}"))))
        .collect()
}

fn parse_hash(text: &str) -> Option<u64> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// `kvatlas query`.
///
/// # Errors
/// Unreadable or malformed input, or the server's error.
pub fn query(args: &QueryArgs) -> Result<String, CliError> {
    let input = match (&args.tokens, &args.hashes) {
        (Some(path), _) => v1::query_request::Input::Tokens(v1::TokenIds {
            ids: numbers(&read_input(path)?, |t| t.parse().ok(), "token id (u32)")?,
        }),
        (None, Some(path)) => v1::query_request::Input::LocalHashes(v1::LocalHashes {
            hashes: numbers(&read_input(path)?, parse_hash, "local hash (u64)")?,
        }),
        (None, None) => return Err(CliError::Input("give --tokens or --hashes".into())),
    };
    let request = v1::QueryRequest {
        index: Some(v1::IndexSelector {
            model: args.model.clone(),
            tenant: args.tenant.clone(),
        }),
        lora_name: args.lora_name.clone(),
        cache_salt: args.cache_salt.clone(),
        input: Some(input),
        options: Some(v1::QueryOptions {
            early_exit: args.early_exit,
            top_k: args.top_k,
            min_blocks: args.min_blocks,
            instance_ids: args.instances.clone(),
            device_only: args.device_only,
        }),
        request_id: 0,
    };
    let answer = runtime(Some(1))?.block_on(async {
        let mut client = args.connect.connect().await?;
        let answer = client
            .raw()
            .query(request)
            .await
            .map_err(ClientError::from)?;
        Ok::<_, CliError>(answer.into_inner())
    })?;
    Ok(if args.json {
        format!("{}\n", query_json(&answer))
    } else {
        query_table(&answer, &args.model, &args.tenant)
    })
}

fn query_json(answer: &v1::QueryResponse) -> Value {
    json!({
        "block_size": answer.block_size,
        "query_blocks": answer.query_blocks,
        "last_event_unix_micros": answer.last_event_unix_micros,
        "events_applied": answer.events_applied,
        "matches": answer.matches.iter().map(|m| json!({
            "instance_id": m.instance_id,
            "dp_rank": m.dp_rank,
            "device_blocks": m.device_blocks,
            "host_blocks": m.host_blocks,
            "longest_blocks": m.longest_blocks,
            "matched_tokens": m.matched_tokens,
            "longest_matched_tokens": m.longest_matched_tokens,
        })).collect::<Vec<_>>(),
    })
}

/// Formats rows as left-aligned columns.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (cell, width) in cells.zip(&widths) {
            let _ = write!(text, "{cell:<width$}  ");
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

fn query_table(answer: &v1::QueryResponse, model: &str, tenant: &str) -> String {
    let freshness = if answer.last_event_unix_micros > 0 {
        let now = crate::served_index::unix_micros_now();
        format!(
            "last event {:.3} s ago",
            (now - answer.last_event_unix_micros).max(0) as f64 / 1e6
        )
    } else {
        "no event applied yet".to_owned()
    };
    let mut out = format!(
        "model {model} tenant {tenant}: block size {}, prompt {} blocks, {} events applied, {freshness}\n",
        answer.block_size, answer.query_blocks, answer.events_applied
    );
    if answer.matches.is_empty() {
        out.push_str("no worker holds the prompt's first block\n");
        return out;
    }
    let rows: Vec<Vec<String>> = answer
        .matches
        .iter()
        .map(|m| {
            vec![
                m.instance_id.to_string(),
                m.dp_rank.to_string(),
                m.device_blocks.to_string(),
                m.host_blocks.to_string(),
                m.longest_blocks.to_string(),
                m.matched_tokens.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(
        &["INSTANCE", "DP", "DEVICE", "HOST", "LONGEST", "TOKENS"],
        &rows,
    ));
    out
}

/// `kvatlas workers` and `kvatlas indexes`: list.
#[derive(Debug, Clone, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    /// The server.
    pub connect: ConnectArgs,
    /// Only this model.
    #[arg(long, default_value = "")]
    pub model: String,
    /// Only this tenant.
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn selector_json(selector: Option<&v1::IndexSelector>) -> (String, String) {
    selector.map_or_else(Default::default, |s| (s.model.clone(), s.tenant.clone()))
}

fn enum_name<E: TryFrom<i32> + std::fmt::Debug>(value: i32) -> String {
    E::try_from(value).map_or_else(|_| value.to_string(), |e| format!("{e:?}").to_lowercase())
}

/// `kvatlas workers`.
///
/// # Errors
/// The server's error.
pub fn workers(args: &ListArgs) -> Result<String, CliError> {
    let listed = runtime(Some(1))?.block_on(async {
        let mut client = args.connect.connect().await?;
        let listed = client
            .raw()
            .list_workers(v1::ListWorkersRequest {
                model: args.model.clone(),
                tenant: args.tenant.clone(),
            })
            .await
            .map_err(ClientError::from)?;
        Ok::<_, CliError>(listed.into_inner())
    })?;
    if args.json {
        let workers: Vec<Value> = listed
            .workers
            .iter()
            .map(|w| {
                let (model, tenant) = selector_json(w.index.as_ref());
                let counters = w.counters.clone().unwrap_or_default();
                let blocks = w.blocks.unwrap_or_default();
                json!({
                    "model": model, "tenant": tenant,
                    "instance_id": w.instance_id, "dp_rank": w.dp_rank,
                    "pod_name": w.pod_name,
                    "source": enum_name::<v1::WorkerSource>(w.source),
                    "engine": enum_name::<v1::EngineKind>(w.engine),
                    "status": enum_name::<v1::WorkerStatus>(w.status),
                    "endpoint": w.endpoint, "replay_endpoint": w.replay_endpoint,
                    "last_error": w.last_error, "last_seq": w.last_seq,
                    "micros_since_last_batch": w.micros_since_last_batch,
                    "blocks": {"device": blocks.device, "host": blocks.host, "disk": blocks.disk, "external": blocks.external},
                    "counters": {
                        "batches_received": counters.batches_received,
                        "batches_applied": counters.batches_applied,
                        "batches_replayed": counters.batches_replayed,
                        "duplicates": counters.duplicates, "gaps": counters.gaps,
                        "resyncs": counters.resyncs, "restarts": counters.restarts,
                        "catch_ups": counters.catch_ups,
                        "probes": counters.probes,
                        "replay_resyncs": counters.replay_resyncs,
                        "held_dropped": counters.held_dropped,
                        "decode_errors": counters.decode_errors,
                        "dropped": counters.dropped,
                    },
                })
            })
            .collect();
        return Ok(format!("{}\n", Value::Array(workers)));
    }
    if listed.workers.is_empty() {
        return Ok("no worker registered\n".into());
    }
    let rows: Vec<Vec<String>> = listed
        .workers
        .iter()
        .map(|w| {
            let (model, tenant) = selector_json(w.index.as_ref());
            let counters = w.counters.clone().unwrap_or_default();
            let blocks = w.blocks.unwrap_or_default();
            vec![
                model,
                tenant,
                w.instance_id.to_string(),
                w.dp_rank.to_string(),
                if w.pod_name.is_empty() {
                    "-".into()
                } else {
                    w.pod_name.clone()
                },
                enum_name::<v1::WorkerSource>(w.source),
                enum_name::<v1::WorkerStatus>(w.status),
                w.last_seq.map_or_else(|| "-".into(), |s| s.to_string()),
                counters.batches_applied.to_string(),
                counters.gaps.to_string(),
                counters.resyncs.to_string(),
                format!(
                    "{}/{}/{}",
                    blocks.device,
                    blocks.host,
                    blocks.disk + blocks.external
                ),
                w.endpoint.clone(),
                w.last_error.clone(),
            ]
        })
        .collect();
    Ok(table(
        &[
            "MODEL",
            "TENANT",
            "INSTANCE",
            "DP",
            "POD",
            "SOURCE",
            "STATUS",
            "LAST_SEQ",
            "BATCHES",
            "GAPS",
            "RESYNCS",
            "BLOCKS(D/H/O)",
            "ENDPOINT",
            "LAST_ERROR",
        ],
        &rows,
    ))
}

/// `kvatlas indexes`.
///
/// # Errors
/// The server's error.
pub fn indexes(args: &ListArgs) -> Result<String, CliError> {
    let listed = runtime(Some(1))?.block_on(async {
        let mut client = args.connect.connect().await?;
        let listed = client
            .raw()
            .list_indexes(v1::ListIndexesRequest {
                model: args.model.clone(),
                tenant: args.tenant.clone(),
            })
            .await
            .map_err(ClientError::from)?;
        Ok::<_, CliError>(listed.into_inner())
    })?;
    if args.json {
        let indexes: Vec<Value> = listed
            .indexes
            .iter()
            .map(|i| {
                let (model, tenant) = selector_json(i.index.as_ref());
                json!({
                    "model": model, "tenant": tenant, "block_size": i.block_size,
                    "registered_ranks": i.registered_ranks, "ranks_with_blocks": i.ranks_with_blocks,
                    "memberships": i.memberships, "heap_bytes": i.heap_bytes, "capacity": i.capacity,
                    "last_event_unix_micros": i.last_event_unix_micros,
                    "events_applied": i.events_applied, "events_queued": i.events_queued,
                })
            })
            .collect();
        return Ok(format!("{}\n", Value::Array(indexes)));
    }
    if listed.indexes.is_empty() {
        return Ok("no index\n".into());
    }
    let rows: Vec<Vec<String>> = listed
        .indexes
        .iter()
        .map(|i| {
            let (model, tenant) = selector_json(i.index.as_ref());
            vec![
                model,
                tenant,
                i.block_size.to_string(),
                i.registered_ranks.to_string(),
                i.ranks_with_blocks.to_string(),
                i.memberships.to_string(),
                format!("{:.1}", i.heap_bytes as f64 / (1 << 20) as f64),
                i.events_applied.to_string(),
                i.events_queued.to_string(),
            ]
        })
        .collect();
    Ok(table(
        &[
            "MODEL",
            "TENANT",
            "BLOCK",
            "REGISTERED",
            "RANKS",
            "MEMBERSHIPS",
            "HEAP_MIB",
            "EVENTS",
            "QUEUED",
        ],
        &rows,
    ))
}

/// `kvatlas register`: start listening to an engine rank's ZMQ publisher.
#[derive(Debug, Clone, clap::Args)]
pub struct RegisterArgs {
    #[command(flatten)]
    /// The server.
    pub connect: ConnectArgs,
    /// The model.
    #[arg(long)]
    pub model: String,
    /// The tenant.
    #[arg(long, default_value = DEFAULT_TENANT)]
    pub tenant: String,
    /// The worker (engine instance) id.
    #[arg(long)]
    pub instance_id: u64,
    /// The data-parallel rank.
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    /// The engine's block size.
    #[arg(long)]
    pub block_size: u32,
    /// vllm or sglang.
    #[arg(long, default_value = "vllm")]
    pub engine: String,
    /// The engine's ZMQ PUB endpoint.
    #[arg(long)]
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint.
    #[arg(long, default_value = "")]
    pub replay_endpoint: String,
    /// The SUB topic prefix.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Bind the endpoint (engines connect) instead of connecting: `tcp://` only, and only with a
    /// token limited to no tenant (`ipc://` binds go in `kvatlas serve --workers … bind`).
    #[arg(long)]
    pub bind: bool,
    /// The pod the rank answers as in llm-d's GetPodScores (llm-d's pod identifier, for example
    /// the engine's IP:port).
    #[arg(long, default_value = "")]
    pub pod_name: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `kvatlas register`.
///
/// # Errors
/// An unknown engine, or the server's error.
pub fn register(args: &RegisterArgs) -> Result<String, CliError> {
    let engine = match parse_engine(&args.engine) {
        Some(kvatlas_events::EngineKind::Vllm) => v1::EngineKind::Vllm,
        Some(kvatlas_events::EngineKind::Sglang) => v1::EngineKind::Sglang,
        None => {
            return Err(CliError::Input(format!(
                "--engine {:?}: expected vllm or sglang",
                args.engine
            )));
        }
    };
    let request = v1::RegisterWorkerRequest {
        index: Some(v1::IndexSelector {
            model: args.model.clone(),
            tenant: args.tenant.clone(),
        }),
        instance_id: args.instance_id,
        dp_rank: args.dp_rank,
        block_size: args.block_size,
        engine: engine as i32,
        endpoint: args.endpoint.clone(),
        replay_endpoint: args.replay_endpoint.clone(),
        topic: args.topic.clone(),
        socket_mode: if args.bind {
            v1::SocketMode::Bind
        } else {
            v1::SocketMode::Connect
        } as i32,
        pod_name: args.pod_name.clone(),
    };
    let response = runtime(Some(1))?.block_on(async {
        let mut client = args.connect.connect().await?;
        let response = client
            .raw()
            .register_worker(request)
            .await
            .map_err(ClientError::from)?;
        Ok::<_, CliError>(response.into_inner())
    })?;
    let worker = response.worker.unwrap_or_default();
    Ok(if args.json {
        format!(
            "{}\n",
            json!({
                "created_index": response.created_index,
                "already_registered": response.already_registered,
                "endpoint": worker.endpoint,
                "status": enum_name::<v1::WorkerStatus>(worker.status),
            })
        )
    } else {
        format!(
            "worker {} rank {} {} for model {} tenant {} ({}; {})\n",
            args.instance_id,
            args.dp_rank,
            if response.already_registered {
                "was already registered"
            } else {
                "registered"
            },
            args.model,
            args.tenant,
            worker.endpoint,
            if response.created_index {
                "new index"
            } else {
                "existing index"
            }
        )
    })
}

/// `kvatlas unregister`: stop a worker's listeners and remove its blocks.
#[derive(Debug, Clone, clap::Args)]
pub struct UnregisterArgs {
    #[command(flatten)]
    /// The server.
    pub connect: ConnectArgs,
    /// The model.
    #[arg(long)]
    pub model: String,
    /// The tenant.
    #[arg(long, default_value = DEFAULT_TENANT, conflicts_with = "all_tenants")]
    pub tenant: String,
    /// Every tenant of the model.
    #[arg(long)]
    pub all_tenants: bool,
    /// The worker (engine instance) id.
    #[arg(long)]
    pub instance_id: u64,
    /// Only this data-parallel rank.
    #[arg(long)]
    pub dp_rank: Option<u32>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `kvatlas unregister`.
///
/// # Errors
/// The server's error.
pub fn unregister(args: &UnregisterArgs) -> Result<String, CliError> {
    let request = v1::UnregisterWorkerRequest {
        index: Some(v1::IndexSelector {
            model: args.model.clone(),
            tenant: args.tenant.clone(),
        }),
        instance_id: args.instance_id,
        dp_rank: args.dp_rank,
        all_tenants: args.all_tenants,
    };
    let response = runtime(Some(1))?.block_on(async {
        let mut client = args.connect.connect().await?;
        let response = client
            .raw()
            .unregister_worker(request)
            .await
            .map_err(ClientError::from)?;
        Ok::<_, CliError>(response.into_inner())
    })?;
    Ok(if args.json {
        format!(
            "{}\n",
            json!({
                "ranks_removed": response.ranks_removed,
                "listeners_stopped": response.listeners_stopped,
                "blocks_removed": response.blocks_removed,
            })
        )
    } else {
        format!(
            "worker {}: {} rank(s) removed, {} listener(s) stopped, {} block memberships removed\n",
            args.instance_id,
            response.ranks_removed,
            response.listeners_stopped,
            response.blocks_removed
        )
    })
}

/// A certificate and its key given together (`None` if neither is given).
///
/// # Errors
/// `missing` when only one of them is given.
fn tls_pair(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    missing: &str,
) -> Result<Option<TlsFiles>, CliError> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key })),
        (None, None) => Ok(None),
        _ => Err(CliError::Config(missing.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MAX_DURATION;

    #[test]
    fn number_lists_accept_common_forms() {
        let tokens = numbers("[1, 2,3]\n4\t5", |t| t.parse::<u32>().ok(), "token").expect("ok");
        assert_eq!(tokens, [1, 2, 3, 4, 5]);
        let hashes = numbers("0x10 17", parse_hash, "hash").expect("ok");
        assert_eq!(hashes, [16, 17]);
        let error = numbers("1 x", |t| t.parse::<u32>().ok(), "token id").expect_err("x");
        assert!(error.to_string().contains("\"x\" is not a token id"));
    }

    /// `serve`'s flags as a command line.
    #[derive(clap::Parser)]
    struct CommandLine {
        #[command(flatten)]
        serve: ServeArgs,
    }

    /// `serve` with `flags`, resolved (the flags must parse).
    fn resolve(flags: &[&str]) -> Result<Resolved, String> {
        let mut line = vec!["serve"];
        line.extend_from_slice(flags);
        <CommandLine as clap::Parser>::try_parse_from(line)
            .expect("parses")
            .serve
            .resolve_noting_unused()
            .map_err(|e| e.to_string())
    }

    #[test]
    fn nats_access_settings_reach_both_roles_and_conflicts_are_refused() {
        let tls = [
            "--nats-ca-cert",
            "/ca.pem",
            "--nats-tls-cert",
            "/c.pem",
            "--nats-tls-key",
            "/k.pem",
        ];
        let mut flags = vec!["--consume-from", "tls://127.0.0.1:4222"];
        flags.extend_from_slice(&["--nats-token-file", "/t"]);
        flags.extend_from_slice(&tls);
        let resolved = resolve(&flags).expect("resolves");
        let access = &resolved.config.consume_from.expect("a replica").access;
        assert_eq!(access.token_file.as_deref(), Some(Path::new("/t")));
        assert_eq!(access.nkey_file, None);
        assert_eq!(access.ca_cert.as_deref(), Some(Path::new("/ca.pem")));
        assert_eq!(
            access.client_tls,
            Some(TlsFiles {
                cert: "/c.pem".into(),
                key: "/k.pem".into()
            })
        );
        assert!(resolved.without_effect.is_empty());
        let ingest = resolve(&["--publish-to", "nats://h:4222", "--nats-nkey-file", "/s.nk"])
            .expect("resolves");
        let access = &ingest.config.publish_to.expect("an ingest").access;
        assert_eq!(access.nkey_file.as_deref(), Some(Path::new("/s.nk")));

        // Each refused with what to do.
        for (flags, expected) in [
            (
                &["--publish-to", "nats://h:4222", "--nats-tls-cert", "/c.pem"][..],
                "--nats-tls-key",
            ),
            (
                &[
                    "--publish-to",
                    "nats://u:secret@h:4222",
                    "--nats-token-file",
                    "/t",
                ][..],
                "carries credentials",
            ),
        ] {
            let error = resolve(flags).expect_err("refused");
            assert!(error.contains(expected), "{flags:?}: {error}");
            assert!(!error.contains("secret"), "{error}");
        }
        // Both a token and a seed: clap refuses the flags; a config file's keys are refused
        // by the check.
        for both in [
            ["--nats-token-file", "/t", "--nats-nkey-file", "/s"],
            ["--nats-nkey-file", "/s", "--nats-creds-file", "/c"],
            ["--nats-creds-file", "/c", "--nats-token-file", "/t"],
        ] {
            let line = [&["serve"][..], &both[..]].concat();
            assert!(<CommandLine as clap::Parser>::try_parse_from(line).is_err());
        }
        let dir = std::env::temp_dir().join(format!("kvatlas-nats-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("serve.toml");
        std::fs::write(
            &file,
            "consume_from = \"nats://h:4222\"\nnats_token_file = \"/t\"\n\
             nats_creds_file = \"/s\"\n",
        )
        .expect("write");
        let error = resolve(&["--config", &file.display().to_string()]).expect_err("both");
        assert!(error.contains("give one"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
        // Without a role they do nothing, and are named.
        assert_eq!(
            resolve(&["--nats-ca-cert", "/ca.pem"])
                .expect("resolves")
                .without_effect,
            ["--nats-ca-cert has no effect without --publish-to or --consume-from"]
        );
    }

    #[test]
    fn settings_without_effect_are_named_with_what_they_need() {
        let unused = |flags: &[&str]| resolve(flags).expect("resolves").without_effect;
        assert!(unused(&[]).is_empty());
        assert_eq!(
            unused(&[
                "--snapshot-interval-secs",
                "5",
                "--nats-stream",
                "s",
                "--model",
                "m",
                "--max-requests-per-token",
                "4",
                "--reload-check-secs",
                "0",
            ]),
            [
                "--nats-stream has no effect without --publish-to or --consume-from",
                "--snapshot-interval-secs has no effect without --data-dir",
                "--max-requests-per-token has no effect without --auth-tokens",
                "--reload-check-secs has no effect without --auth-tokens or --tls-cert",
                "--model has no effect without --workers (it applies to them only)",
            ]
        );
        assert_eq!(
            unused(&[
                "--consume-from",
                "nats://127.0.0.1:4222",
                "--nats-no-live",
                "--nats-live-confirm-secs",
                "5",
                "--peer-token-file",
                "/t",
            ]),
            [
                "--nats-live-confirm-secs has no effect without the live path (--nats-no-live \
                 turns it off)",
                "--peer-token-file has no effect without --peers",
            ]
        );
        assert_eq!(
            unused(&[
                "--publish-to",
                "nats://127.0.0.1:4222",
                "--nats-live-confirm-secs",
                "5"
            ]),
            [
                "--nats-live-confirm-secs has no effect without --consume-from (a replica confirms \
              live records)"
            ]
        );
        // With what they need, nothing is named; an ingest's snapshot bucket is a replica's.
        let dir = std::env::temp_dir().join(format!("kvatlas-unused-{}", std::process::id()));
        let data = dir.display().to_string();
        assert!(unused(&["--snapshot-interval-secs", "5", "--data-dir", &data]).is_empty());
        assert_eq!(
            unused(&[
                "--publish-to",
                "nats://127.0.0.1:4222",
                "--nats-stream",
                "s",
                "--nats-snapshot-bucket",
                "b",
                "--model",
                "m",
                "--block-size",
                "16",
                "--workers",
                "1=tcp://127.0.0.1:5557",
            ]),
            [
                "--nats-snapshot-bucket has no effect without --consume-from (replicas write and \
                 read the bucket)"
            ]
        );
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("kvatlas-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("serve.toml");
        std::fs::write(
            &file,
            "grpc_addr = \"127.0.0.1:7000\"\nwriter_threads = 3\nworkers = \"1=tcp://h:1\"\n\
             block_size = 32\nmodel = \"m\"\ntokenizer = [\"m=/t/tokenizer.json\"]\n\
             listener_threads = 2\n",
        )
        .expect("write");
        let args = ServeArgs {
            config: Some(file.clone()),
            writer_threads: Some(5),
            ..ServeArgs::default()
        };
        let (config, _) = args.resolve().expect("resolves");
        assert_eq!(config.grpc_addr.port(), 7000, "from the file");
        assert_eq!(config.index.writer_threads, 5, "the flag wins");
        assert_eq!(config.index.listener_threads, 2, "from the file");
        assert_eq!(config.http_addr.port(), crate::DEFAULT_HTTP_PORT, "default");
        assert_eq!(config.workers.len(), 1);
        assert_eq!(config.workers[0].block_size.get(), 32);
        assert_eq!(config.workers[0].index.model, "m");
        assert_eq!(
            config.tokenizers,
            [TokenizerFile::parse("m=/t/tokenizer.json").expect("parses")],
            "from the file"
        );
        std::fs::write(&file, "grpc_adr = \"127.0.0.1:7000\"\n").expect("write");
        let error = args.resolve().expect_err("typo").to_string();
        assert!(error.contains("grpc_adr"), "{error}");
        // Addresses read as the flags read theirs: `localhost:PORT` too.
        std::fs::write(&file, "grpc_addr = \"localhost:7001\"\n").expect("write");
        let (config, _) = args.resolve().expect("localhost:PORT");
        assert_eq!(
            config.grpc_addr,
            "127.0.0.1:7001".parse().expect("an address")
        );
        std::fs::write(&file, "http_addr = \"example.com:80\"\n").expect("write");
        let error = args.resolve().expect_err("a host name").to_string();
        assert!(error.contains("not resolved"), "{error}");

        // The file's `port` does not change a flag's address; `--port` changes the file's.
        std::fs::write(
            &file,
            "port = 9000\nhttp_addr = \"127.0.0.1:8000\"\nbusy_poll = true\n\
             allow_unauthenticated = true\ntls_key = \"/k.pem\"\n",
        )
        .expect("write");
        let with = |flags: &[&str]| {
            let mut line = vec!["serve", "--config"];
            let file = file.display().to_string();
            line.push(&file);
            line.extend_from_slice(flags);
            let line = <CommandLine as clap::Parser>::try_parse_from(line).expect("parses");
            line.serve.resolve().map(|(config, _)| config)
        };
        let http_port = |flags: &[&str]| with(flags).expect("resolves").http_addr.port();
        assert_eq!(
            http_port(&["--http-addr", "127.0.0.1:7100", "--tls-cert", "/c.pem"]),
            7100
        );
        assert_eq!(http_port(&["--port", "7200", "--tls-cert", "/c.pem"]), 7200);
        assert_eq!(
            http_port(&["--tls-cert", "/c.pem"]),
            9000,
            "the file's port"
        );
        // A port from the environment does not change an address from the command line; a
        // port flag changes an address from the environment.
        let port_with = |flags: &[&str], sources: ArgSources| {
            let file = file.display().to_string();
            let mut line = vec!["serve", "--config", &file, "--tls-cert", "/c.pem"];
            line.extend_from_slice(flags);
            let mut line = <CommandLine as clap::Parser>::try_parse_from(line).expect("parses");
            line.serve.sources = sources;
            line.serve.resolve().expect("resolves").0.http_addr.port()
        };
        let both = ["--http-addr", "127.0.0.1:7100", "--port", "7200"];
        let env_port = ArgSources {
            port_from_env: true,
            ..ArgSources::default()
        };
        assert_eq!(
            port_with(&both, env_port),
            7100,
            "KVATLAS_PORT under --http-addr"
        );
        assert_eq!(port_with(&both, ArgSources::default()), 7200, "--port");
        let env_address = ArgSources {
            http_addr_from_env: true,
            ..ArgSources::default()
        };
        assert_eq!(
            port_with(&both, env_address),
            7200,
            "--port over KVATLAS_HTTP_ADDR"
        );
        let env_both = ArgSources {
            http_addr_from_env: true,
            port_from_env: true,
            ..ArgSources::default()
        };
        assert_eq!(
            port_with(&both, env_both),
            7200,
            "both from the environment"
        );
        assert_eq!(
            port_with(&["--port", "7200"], env_port),
            7200,
            "over the file's address"
        );
        // A flag turns off what the file turned on (a bare flag still turns it on).
        let config = with(&["--tls-cert", "/c.pem", "--busy-poll=false"]).expect("resolves");
        assert!(!config.busy_poll && config.allow_unauthenticated);
        let config =
            with(&["--tls-cert", "/c.pem", "--allow-unauthenticated=no"]).expect("resolves");
        assert!(config.busy_poll && !config.allow_unauthenticated);
        assert!(
            <CommandLine as clap::Parser>::try_parse_from(["serve", "--publish-only"])
                .expect("parses")
                .serve
                .publish_only
                == Some(true)
        );
        // A certificate from the command line and its key from the file go together; one
        // without the other is refused with both flags named.
        let tls = with(&["--tls-cert", "/c.pem"]).expect("resolves").tls;
        assert_eq!(tls.map(|t| t.key), Some(PathBuf::from("/k.pem")));
        std::fs::write(&file, "port = 9000\n").expect("write");
        let error = with(&["--tls-cert", "/c.pem"])
            .expect_err("no key")
            .to_string();
        assert!(error.contains("--tls-key"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `--tokenizer` takes one `MODEL=PATH` per flag, a comma part of the path; the environment
    /// variable a comma-separated list (the flag was split at commas too: a path with one was
    /// cut in two and the start failed).
    #[test]
    fn tokenizer_lists_split_at_commas_in_the_environment_only() {
        let parse =
            |line: &[&str]| <CommandLine as clap::Parser>::try_parse_from(line).expect("parses");
        let mut line = parse(&["serve", "--tokenizer", "m=/models/a,b/tokenizer.json"]);
        let (config, _) = line.serve.resolve().expect("resolves");
        assert_eq!(
            config.tokenizers,
            [TokenizerFile::parse("m=/models/a,b/tokenizer.json").expect("parses")]
        );
        line.serve.sources = ArgSources {
            tokenizer_from_env: true,
            ..ArgSources::default()
        };
        line.serve.tokenizers = vec!["m=/t/m.json,n=/t/n.json".into()];
        let (config, _) = line.serve.resolve().expect("resolves");
        assert_eq!(
            config.tokenizers,
            [
                TokenizerFile::parse("m=/t/m.json").expect("parses"),
                TokenizerFile::parse("n=/t/n.json").expect("parses")
            ]
        );
    }

    /// A `KVATLAS_PORT` Kubernetes set (a service link, in every pod of a namespace with a
    /// Service named `kvatlas`) is ignored with a warning; it stopped the start, naming a flag
    /// the operator never gave. As a flag it is refused, and so is a value that is neither.
    #[test]
    fn a_kubernetes_service_link_in_the_port_variable_is_ignored() {
        let parse = |line: &[&str]| <CommandLine as clap::Parser>::try_parse_from(line);
        let mut line = parse(&["serve", "--port", "tcp://10.96.0.12:8090"]).expect("parses");
        let refused = line.serve.resolve().expect_err("a link is not a port");
        assert!(refused.to_string().contains("a port number"), "{refused}");
        line.serve.sources = ArgSources {
            port_from_env: true,
            ..ArgSources::default()
        };
        let resolved = line.serve.resolve_noting_unused().expect("resolves");
        assert_eq!(resolved.config.http_addr.port(), crate::DEFAULT_HTTP_PORT);
        assert!(
            resolved
                .without_effect
                .iter()
                .any(|w| w.contains("KVATLAS_PORT") && w.contains("service link")),
            "{:?}",
            resolved.without_effect
        );
        assert!(parse(&["serve", "--port", "http"]).is_err());
    }

    /// `--quiet-probe-ms`: the listeners' probe interval; 0 turns probing off; too long or too
    /// short is refused with the flag's name; unset keeps the library's default.
    #[test]
    fn the_quiet_probe_interval_is_set_turned_off_or_refused() {
        let probe = |ms: Option<u64>| {
            ServeArgs {
                quiet_probe_ms: ms,
                ..ServeArgs::default()
            }
            .resolve()
            .map(|(config, _)| config.index.listener.quiet_probe)
        };
        assert_eq!(
            probe(None).expect("default"),
            ListenerOptions::default().quiet_probe
        );
        assert_eq!(
            probe(Some(250)).expect("set"),
            Some(Duration::from_millis(250))
        );
        assert_eq!(probe(Some(0)).expect("off"), None);
        let error = probe(Some(MAX_QUIET_PROBE_MS + 1))
            .expect_err("too long")
            .to_string();
        assert!(error.contains("--quiet-probe-ms"), "{error}");
        assert!(probe(Some(MIN_QUIET_PROBE_MS)).is_ok());
        let error = probe(Some(1)).expect_err("too short").to_string();
        assert!(error.contains("--quiet-probe-ms"), "{error}");
    }

    /// A duration beyond ten years, or more runtime threads than 1,024, is refused naming the
    /// flag: such a shutdown timeout overflowed the clock and panicked at SIGTERM, a NATS max
    /// age reached NATS wrapped (`u64::MAX` s + 194 s as about 2 minutes), and the runtime
    /// panicked spawning its threads.
    #[test]
    fn durations_and_threads_beyond_any_use_are_refused_naming_the_flag() {
        let resolve = |flags: &[&str]| {
            let mut line = vec!["serve"];
            line.extend_from_slice(flags);
            <CommandLine as clap::Parser>::try_parse_from(line)
                .expect("parses")
                .serve
                .resolve()
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let nats = ["--publish-to", "nats://127.0.0.1:4222"];
        for (flag, needs) in [
            ("--shutdown-timeout-secs", &[][..]),
            ("--stall-timeout-secs", &[]),
            ("--reload-check-secs", &[]),
            ("--snapshot-interval-secs", &["--data-dir", "/d"]),
            ("--nats-max-age-secs", &nats),
            ("--nats-live-confirm-secs", &nats),
            ("--nats-snapshot-interval-secs", &nats),
        ] {
            let at = |secs: u64| {
                let secs = secs.to_string();
                let mut flags = vec![flag, secs.as_str()];
                flags.extend_from_slice(needs);
                resolve(&flags)
            };
            assert!(
                at(MAX_DURATION.as_secs()).is_ok(),
                "{flag}: {:?}",
                at(MAX_DURATION.as_secs())
            );
            let error = at(18_446_744_194).expect_err("beyond ten years");
            assert!(error.contains(flag), "{error}");
        }
        assert!(resolve(&["--runtime-threads", "1024"]).is_ok());
        let error = resolve(&["--runtime-threads", "1000000"]).expect_err("too many");
        assert!(error.contains("--runtime-threads"), "{error}");
    }

    /// A listen address is an IP address and port or `localhost:PORT`; any other host name is
    /// refused saying what to give (it was clap's bare "invalid socket address syntax").
    #[test]
    fn listen_addresses_take_localhost_and_refuse_other_names_saying_what_to_give() {
        let parse = |flags: &[&str]| {
            let mut line = vec!["serve"];
            line.extend_from_slice(flags);
            <CommandLine as clap::Parser>::try_parse_from(line).map(|line| line.serve)
        };
        let serve =
            parse(&["--grpc-addr", "localhost:7001", "--http-addr", "[::1]:7002"]).expect("parses");
        assert_eq!(
            serve.grpc_addr,
            Some("127.0.0.1:7001".parse().expect("addr"))
        );
        assert_eq!(serve.http_addr, Some("[::1]:7002".parse().expect("addr")));
        for bad in ["kvatlas.internal:8090", "8090", "localhost"] {
            let error = parse(&["--http-addr", bad]).expect_err(bad).to_string();
            assert!(error.contains("0.0.0.0:8090"), "{bad}: {error}");
        }
    }

    /// Dynamo's standalone indexer's command line (`python -m dynamo.indexer --port --threads
    /// --block-size --workers --model-name --routing-group --peers`) starts `kvatlas serve`
    /// with the same meaning (and still on loopback).
    #[test]
    fn dynamos_command_line_maps_onto_serve() {
        let line = <CommandLine as clap::Parser>::try_parse_from([
            "kvatlas-serve",
            "--port",
            "9100",
            "--threads",
            "3",
            "--block-size",
            "32",
            "--workers",
            "1=tcp://127.0.0.1:5557,2:1=tcp://127.0.0.1:5558",
            "--model-name",
            "llama",
            "--routing-group",
            "team-a",
            "--peers",
            "http://127.0.0.1:8091,http://127.0.0.1:8092",
        ])
        .expect("Dynamo's flags parse");
        let (config, _) = line.serve.resolve().expect("resolves");
        assert_eq!(
            config.http_addr,
            SocketAddr::from(([127, 0, 0, 1], 9100)),
            "--port, on loopback"
        );
        assert_eq!(config.index.writer_threads, 3, "--threads");
        let workers: Vec<_> = config
            .workers
            .iter()
            .map(|w| {
                (
                    w.index.model.as_str(),
                    w.index.tenant.as_str(),
                    w.instance_id,
                    w.dp_rank,
                    w.block_size.get(),
                    w.endpoint.as_str(),
                )
            })
            .collect();
        assert_eq!(
            workers,
            [
                ("llama", "team-a", 1, 0, 32, "tcp://127.0.0.1:5557"),
                ("llama", "team-a", 2, 1, 32, "tcp://127.0.0.1:5558"),
            ]
        );
        assert_eq!(
            config.peers,
            ["http://127.0.0.1:8091", "http://127.0.0.1:8092"]
        );
    }
}
