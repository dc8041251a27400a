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
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::dynamo;
use crate::registry::Registry;
use crate::snapshot;

/// The longest a peer may take to answer (its status and headers).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a peer's body may pause between two pieces: a large snapshot takes as long as it
/// takes while it keeps coming, a stalled peer is given up.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest peer answer accepted.
const LIMIT: usize = 4 << 30;
/// Pieces of a snapshot in flight between the download and the reader.
const PIECES_IN_FLIGHT: usize = 64;

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

/// `GET url`: the response once its status and headers are in (within [`ANSWER_TIMEOUT`]).
async fn request(url: &str) -> Result<hyper::Response<hyper::body::Incoming>, String> {
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
    tokio::time::timeout(ANSWER_TIMEOUT, client.request(request))
        .await
        .map_err(|_| format!("no answer within {ANSWER_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())
}

/// The body's next piece (`None` at its end), within [`IDLE_TIMEOUT`]; `received` counts the
/// bytes so far against [`LIMIT`].
async fn next_piece(
    body: &mut hyper::body::Incoming,
    received: &mut usize,
) -> Result<Option<Bytes>, String> {
    loop {
        let frame = tokio::time::timeout(IDLE_TIMEOUT, body.frame())
            .await
            .map_err(|_| format!("the answer stalled for {IDLE_TIMEOUT:?}"))?;
        let Some(frame) = frame else {
            return Ok(None);
        };
        let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() else {
            continue; // trailers
        };
        *received += data.len();
        if *received > LIMIT {
            return Err(format!("the answer is larger than {LIMIT} bytes"));
        }
        return Ok(Some(data));
    }
}

/// `GET url`, whole: (status, body).
async fn get(url: &str) -> Result<(u16, Bytes), String> {
    let response = request(url).await?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let (mut whole, mut received) = (Vec::new(), 0);
    while let Some(piece) = next_piece(&mut body, &mut received).await? {
        whole.extend_from_slice(&piece);
    }
    Ok((status, Bytes::from(whole)))
}

/// A [`std::io::Read`] over the pieces a download sends, for a reader on a blocking thread.
struct Pieces {
    receiver: tokio::sync::mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl std::io::Read for Pieces {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.receiver.blocking_recv() {
                Some(piece) => self.current = piece,
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.current.len());
        out[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
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
    let response = request(&format!("{base}/snapshot")).await?;
    let status = response.status().as_u16();
    if status == 200 {
        // The snapshot is read (and checked) as it downloads; it is restored only once whole
        // and its checksum matched.
        let (sender, receiver) = tokio::sync::mpsc::channel(PIECES_IN_FLIGHT);
        let reader = {
            let registry = std::sync::Arc::clone(registry);
            let peer = base.to_owned();
            tokio::task::spawn_blocking(move || {
                let pieces = Pieces {
                    receiver,
                    current: Bytes::new(),
                };
                let (_, images) = snapshot::read(pieces).map_err(|e| e.to_string())?;
                let memberships = images.iter().map(snapshot::IndexImage::memberships).sum();
                registry
                    .restore_images(&images, false)
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(Bootstrap::Snapshot { peer, memberships })
            })
        };
        let mut body = response.into_body();
        let mut received = 0;
        let mut download = Ok(());
        loop {
            match next_piece(&mut body, &mut received).await {
                Ok(Some(piece)) => {
                    if sender.send(piece).await.is_err() {
                        break; // the reader refused the snapshot: its error says why
                    }
                }
                Ok(None) => break,
                Err(why) => {
                    download = Err(why);
                    break;
                }
            }
        }
        drop(sender);
        let restored = reader.await.map_err(|e| e.to_string())?;
        download?;
        return restored;
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
