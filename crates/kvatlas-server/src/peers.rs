//! Bootstrapping from a peer (`--peers`): a new replica subscribes to its engines first (its
//! listeners start held, buffering), then fetches a peer's state, restores it, and releases its
//! listeners from the peer's checkpoints — no event lost or applied twice, and no timing guess.
//!
//! Peers are tried in order. A kvatlas peer serves its native snapshot at `GET /snapshot`, with
//! every source's checkpoint: each held listener continues exactly after the batch the snapshot
//! reflects for its rank (the batches it buffered meanwhile that the snapshot already holds are
//! dropped as duplicates; a hole between is replayed from the engine, or the rank is resynced and
//! that is counted). A Dynamo peer has no `/snapshot`: its `GET /dump` (weakly consistent, no
//! checkpoints) is applied instead and the listeners start from scratch (replaying from the
//! engine's ring where they can), as Dynamo's own replicas do. With no reachable peer the replica
//! starts empty.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::dynamo;
use crate::registry::Registry;
use crate::snapshot;

/// The longest a peer's answer may take.
const TIMEOUT: Duration = Duration::from_secs(30);
/// The largest peer answer accepted.
const LIMIT: usize = 4 << 30;

/// What a bootstrap did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bootstrap {
    /// Restored a kvatlas peer's native snapshot (with checkpoints).
    Snapshot {
        /// The peer.
        peer: String,
        /// Memberships restored.
        memberships: u64,
    },
    /// Applied a peer's `/dump` (Dynamo's JSON events, no checkpoints).
    Dump {
        /// The peer.
        peer: String,
        /// Events applied.
        events: u64,
    },
    /// No peer answered: started empty.
    Empty {
        /// Why each peer failed.
        failures: Vec<String>,
    },
}

/// `GET url` with a timeout and a size limit: (status, body).
async fn get(url: &str) -> Result<(u16, Bytes), String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("bad URL {url:?}: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "{url}: only http:// peers are supported (a TLS peer cannot be fetched yet)"
        ));
    }
    let client = Client::builder(TokioExecutor::new()).build_http::<http_body_util::Empty<Bytes>>();
    let request = hyper::Request::get(uri)
        .header("accept", "*/*")
        .body(http_body_util::Empty::new())
        .map_err(|e| e.to_string())?;
    let fetch = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), LIMIT)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, body))
    };
    tokio::time::timeout(TIMEOUT, fetch)
        .await
        .map_err(|_| format!("no answer within {TIMEOUT:?}"))?
}

/// Restores the first peer that answers (see the module docs), then releases every held
/// listener.
pub(crate) async fn bootstrap(registry: &std::sync::Arc<Registry>, peers: &[String]) -> Bootstrap {
    let mut failures = Vec::new();
    let mut outcome = None;
    for peer in peers {
        let base = peer.trim_end_matches('/');
        match try_peer(registry, base).await {
            Ok(done) => {
                outcome = Some(done);
                break;
            }
            Err(why) => {
                tracing::warn!(peer = %peer, "bootstrap from peer failed: {why}");
                failures.push(format!("{peer}: {why}"));
            }
        }
    }
    for entry in registry.all() {
        entry.release_held();
    }
    outcome.unwrap_or(Bootstrap::Empty { failures })
}

async fn try_peer(registry: &std::sync::Arc<Registry>, base: &str) -> Result<Bootstrap, String> {
    let (status, body) = get(&format!("{base}/snapshot")).await?;
    if status == 200 {
        let registry = std::sync::Arc::clone(registry);
        let peer = base.to_owned();
        return tokio::task::spawn_blocking(move || {
            let (_, images) = snapshot::read(&body[..]).map_err(|e| e.to_string())?;
            let memberships = images.iter().map(snapshot::IndexImage::memberships).sum();
            registry
                .restore_images(&images, false)
                .map_err(|e| e.to_string())?;
            Ok(Bootstrap::Snapshot { peer, memberships })
        })
        .await
        .map_err(|e| e.to_string())?;
    }
    if status != 404 && status != 405 {
        return Err(format!("GET /snapshot answered {status}"));
    }
    // Not a kvatlas peer: Dynamo's /dump.
    let (status, body) = get(&format!("{base}/dump")).await?;
    if status != 200 {
        return Err(format!("GET /dump answered {status}"));
    }
    let registry = std::sync::Arc::clone(registry);
    let peer = base.to_owned();
    tokio::task::spawn_blocking(move || {
        let parsed = dynamo::parse_dump(&body)?;
        let events = dynamo::apply_dump(&registry, parsed).map_err(|e| e.to_string())?;
        Ok(Bootstrap::Dump { peer, events })
    })
    .await
    .map_err(|e| e.to_string())?
}
