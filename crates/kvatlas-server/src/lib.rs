//! kvatlas's service: the global KV-cache index as a server that routers call over gRPC.
//!
//! | Module | Does |
//! |---|---|
//! | `registry` | one index per (model, tenant): its `ConcurrentAtlas` behind a writer pool, its ZMQ listeners, who feeds each worker rank |
//! | `query` | answering a query inline: hashing the prompt as the engines' events are hashed, one walk, the options |
//! | `publish` | `PublishEvents`: engine-neutral events pushed over gRPC, checked whole, sequenced per rank |
//! | `grpc` | the `kvatlas.v1.Indexer` service: validation, proto ↔ domain conversion, status codes |
//! | `llmd` | llm-d's `indexer.v1.IndexerService/GetPodScores`: the models' tokenizers, pods, llm-d's tier-weighted score |
//! | `http` | `/health`, `/ready`, `/metrics`, `/snapshot` and Dynamo's routes |
//! | `dynamo` | Dynamo's standalone-indexer HTTP API (1.6.1): register, query, `/dump`, peers |
//! | [`snapshot`], `snapshot_stream` | the native snapshot format; streaming it over HTTP and gRPC |
//! | [`store`] | the data directory: snapshots written atomically, the newest readable one loaded |
//! | `peers` | bootstrapping a replica from a peer's snapshot (or a Dynamo peer's `/dump`) |
//! | `nats`, `log_record`, `log_ingest`, `log_replica` | scale-out over NATS JetStream: the event log's records, an ingest publishing every applied unit, replicas consuming it and sharing snapshots |
//! | `metrics` | the Prometheus instruments and exposition |
//! | `auth` | bearer tokens (constant-time), per-tenant permissions |
//! | `config`, `tls`, `server` | configuration and its safety rules, TLS, start and graceful shutdown |
//! | [`cli`] | the `kvatlas` command line: `serve` and the client commands |
//!
//! ```no_run
//! use kvatlas_server::{RunningServer, ServerConfig};
//!
//! # async fn run() -> Result<(), kvatlas_server::StartError> {
//! let server = RunningServer::start(ServerConfig::default()).await?;
//! println!("gRPC on {}", server.grpc_addr());
//! let report = server.run_until_signal().await;
//! # Ok(())
//! # }
//! ```
//!
//! This is the only kvatlas crate with an async runtime: tokio, tonic and axum stop here, and the
//! index and event crates below it stay runtime-free (`cargo xtask tidy`).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod auth;
mod bounded_read;
pub mod cli;
mod config;
mod dynamo;
mod error;
mod fast_json;
#[cfg(any(test, fuzzing))]
pub mod fuzzing;
mod grpc;
mod http;
mod llmd;
mod log_ingest;
mod log_record;
mod log_replica;
mod metrics;
mod nats;
mod opening_deadline;
mod peers;
mod places;
mod publish;
mod query;
mod registry;
mod reload;
mod served_index;
mod server;
pub mod snapshot;
mod snapshot_stream;
mod stalled_body;
mod state;
pub mod store;
mod tls;

pub use auth::{Caller, MIN_TOKEN_BYTES, TokenFileError, Tokens};
pub use config::{
    ConfigError, DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_RELOAD_CHECK,
    DEFAULT_SNAPSHOT_INTERVAL, IndexSettings, Limits, Persistence, ServerConfig, TlsFiles,
    TokenizerFile, WorkerDefaults, parse_engine, parse_peer_list, parse_worker_list,
};
pub use error::ServiceError;
pub use llmd::TokenizerError;
pub use nats::{
    DEFAULT_SNAPSHOT_BUCKET, DEFAULT_STREAM, DEFAULT_SUBJECT_PREFIX, NatsAccess, NatsLog,
};
pub use peers::Bootstrap;
pub use registry::{DEFAULT_TENANT, FeedCounters, IndexKey, MAX_NAME_BYTES, WorkerRegistration};
pub use reload::{ReloadOutcome, Reloaded};
pub use server::{
    IndexReport, Restored, RunningServer, ShutdownReport, StartError, shutdown_signal,
};
