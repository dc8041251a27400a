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
//!
//! A peer is `http://` or `https://` (rustls; the CA certificates of `--peer-ca-cert`, else the
//! system's roots). With `--peer-token-file` every request carries that bearer token: a peer
//! that listens beyond loopback requires one, and `/snapshot` needs a token allowed every tenant.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types;

use crate::dynamo;
use crate::registry::Registry;
use crate::snapshot;

/// The longest a peer may take to answer (its status and headers).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a peer's body may pause between two pieces: a large snapshot takes as long as it
/// takes while it keeps coming, a stalled peer is given up.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The slowest a peer's body may come on average once [`IDLE_TIMEOUT`] has passed since its
/// first byte was asked for: a peer that keeps sending a little at a time (never pausing for
/// 30 s) is given up too, instead of holding the bootstrap (and the held listeners) for ever.
/// 4 GiB at this rate take 68 minutes.
const MIN_RATE: u64 = 1 << 20;
/// The largest peer answer accepted.
const LIMIT: usize = 4 << 30;
/// The most of an announced length reserved before any byte arrives.
const PREALLOCATED: usize = 256 << 20;
/// Pieces of a snapshot in flight between the download and the reader.
pub(crate) const PIECES_IN_FLIGHT: usize = 64;

/// How long a bootstrap waits for a peer busy serving other whole-state reads (429), or still
/// bootstrapping itself (503), before it tries the next peer.
const BUSY_PATIENCE: Duration = Duration::from_secs(60);

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
        /// Memberships held once they were applied.
        memberships: u64,
        /// The partitions the peer could not dump (`KEY (ITS ERROR)`): not bootstrapped.
        skipped: Vec<String>,
    },
    /// No peer answered: started empty.
    Empty {
        /// Why each peer failed.
        failures: Vec<String>,
    },
}

/// How this server reaches its peers: the bearer token it sends and, for `https://` peers, the
/// roots it trusts.
#[derive(Clone, Default)]
pub(crate) struct PeerAccess {
    token: Option<String>,
    tls: Option<TlsConnector>,
}

impl std::fmt::Debug for PeerAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("PeerAccess")
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl PeerAccess {
    /// The token (the first token of its file: [`crate::auth::token_of_file`]) and, when a peer
    /// is `https://`, a TLS
    /// connector trusting `ca_pem`'s certificates, else the system's roots.
    ///
    /// # Errors
    /// A message naming what is wrong: an empty token, a CA file without a certificate.
    pub(crate) fn new(
        token_text: Option<&str>,
        ca_pem: Option<&[u8]>,
        peers: &[String],
    ) -> Result<Self, String> {
        let token = match token_text {
            Some(text) => {
                let token = crate::auth::token_of_file(text);
                if token.is_empty() {
                    return Err("the peer token file holds no token".into());
                }
                Some(token.to_owned())
            }
            None => None,
        };
        let tls = if peers.iter().any(|p| p.starts_with("https://")) || ca_pem.is_some() {
            Some(connector(ca_pem)?)
        } else {
            None
        };
        Ok(Self { token, tls })
    }
}

/// A rustls client trusting `ca_pem`'s certificates, or the system's roots without it.
fn connector(ca_pem: Option<&[u8]>) -> Result<TlsConnector, String> {
    let config = crate::tls::client_config(ca_pem, "--peer-ca-cert", None)?;
    Ok(TlsConnector::from(Arc::new(config)))
}

/// `GET url`: the response once its status and headers are in (within [`ANSWER_TIMEOUT`]).
async fn request(
    access: &PeerAccess,
    url: &str,
) -> Result<hyper::Response<hyper::body::Incoming>, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("bad URL {url:?}: {e}"))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(format!("{url}: a peer is an http:// or https:// URL")),
    };
    let host = uri
        .host()
        .ok_or_else(|| format!("{url}: no host"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let authority = uri
        .authority()
        .map_or_else(|| host.clone(), |a| a.as_str().to_owned());
    let mut request = hyper::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(hyper::header::HOST, authority)
        .header(hyper::header::ACCEPT, "*/*");
    if let Some(token) = &access.token {
        request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let answer = async {
        let tcp = TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        if https {
            let connector = access
                .tls
                .as_ref()
                .ok_or_else(|| format!("{url}: no TLS configured for https:// peers"))?;
            let name =
                pki_types::ServerName::try_from(host.clone()).map_err(|e| format!("{url}: {e}"))?;
            let tls = connector
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            send(tls, request).await
        } else {
            send(tcp, request).await
        }
    };
    tokio::time::timeout(ANSWER_TIMEOUT, answer)
        .await
        .map_err(|_| format!("no answer within {ANSWER_TIMEOUT:?}"))?
}

/// Sends `request` on a new HTTP/1.1 connection over `io`; the connection is driven by a task
/// until the answer's body is read.
async fn send(
    io: impl AsyncRead + AsyncWrite + Send + Unpin + 'static,
    request: hyper::Request<http_body_util::Empty<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, String> {
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("peer connection: {e}");
        }
    });
    sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())
}

/// A peer's answer body, read piece by piece within its limits: at most [`IDLE_TIMEOUT`]
/// between two pieces, [`MIN_RATE`] on average after the first [`IDLE_TIMEOUT`], [`LIMIT`]
/// bytes in all.
struct Download {
    body: hyper::body::Incoming,
    received: usize,
    started: tokio::time::Instant,
    /// [`IDLE_TIMEOUT`] and [`MIN_RATE`] (other values in tests).
    idle_timeout: Duration,
    min_rate: u64,
}

impl Download {
    fn new(body: hyper::body::Incoming) -> Self {
        Self::with_limits(body, IDLE_TIMEOUT, MIN_RATE)
    }

    fn with_limits(body: hyper::body::Incoming, idle_timeout: Duration, min_rate: u64) -> Self {
        Self {
            body,
            received: 0,
            started: tokio::time::Instant::now(),
            idle_timeout,
            min_rate,
        }
    }

    /// Takes `waited` off the download's time: the reader made it wait (a full channel), and
    /// the peer is not to blame.
    fn excuse(&mut self, waited: Duration) {
        self.started += waited;
    }

    /// When the bytes received so far become too few for the minimum rate.
    fn rate_deadline(&self) -> tokio::time::Instant {
        let earned = Duration::from_secs_f64(self.received as f64 / self.min_rate as f64);
        self.started + self.idle_timeout + earned
    }

    /// The body's next piece (`None` at its end), or why the peer is given up.
    async fn next_piece(&mut self) -> Result<Option<Bytes>, String> {
        let idle_timeout = self.idle_timeout;
        loop {
            let idle = tokio::time::Instant::now() + idle_timeout;
            let rate = self.rate_deadline();
            let frame = tokio::time::timeout_at(idle.min(rate), self.body.frame())
                .await
                .map_err(|_| {
                    if rate < idle {
                        format!(
                            "the answer came too slowly: {} bytes in {:.1?}, under {} KiB/s",
                            self.received,
                            self.started.elapsed(),
                            self.min_rate >> 10
                        )
                    } else {
                        format!("the answer stalled for {idle_timeout:?}")
                    }
                })?;
            let Some(frame) = frame else {
                return Ok(None);
            };
            let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() else {
                continue; // trailers
            };
            self.received += data.len();
            if self.received > LIMIT {
                return Err(format!("the answer is larger than {LIMIT} bytes"));
            }
            return Ok(Some(data));
        }
    }
}

/// `GET url`, whole: (status, body).
async fn get(access: &PeerAccess, url: &str) -> Result<(u16, Bytes), String> {
    let response = request(access, url).await?;
    let status = response.status().as_u16();
    // Sized from the announced length (within the download's bound): grown by doubling, a
    // large dump reserved up to twice its size.
    let announced = response
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = Download::new(response.into_body());
    let mut whole = Vec::with_capacity(announced.min(PREALLOCATED));
    while let Some(piece) = body.next_piece().await? {
        whole.extend_from_slice(&piece);
    }
    Ok((status, Bytes::from(whole)))
}

/// The first 512 bytes of an error answer's body, as text (empty if it has none).
async fn what_it_said(response: hyper::Response<hyper::body::Incoming>) -> String {
    let mut body = Download::new(response.into_body());
    match body.next_piece().await {
        Ok(Some(piece)) => String::from_utf8_lossy(&piece[..piece.len().min(512)])
            .trim()
            .to_owned(),
        _ => String::new(),
    }
}

/// A [`std::io::Read`] over the pieces a download sends, for a reader on a blocking thread.
pub(crate) struct Pieces {
    receiver: tokio::sync::mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl Pieces {
    /// What `receiver` is sent, read in order; its end once the senders are gone.
    pub(crate) fn new(receiver: tokio::sync::mpsc::Receiver<Bytes>) -> Self {
        Self {
            receiver,
            current: Bytes::new(),
        }
    }
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
pub(crate) async fn bootstrap(
    registry: &Arc<Registry>,
    peers: &[String],
    access: &PeerAccess,
) -> Bootstrap {
    let mut failures = Vec::new();
    let mut outcome = None;
    for peer in peers {
        let base = peer.trim_end_matches('/');
        match try_peer(registry, base, access).await {
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

async fn try_peer(
    registry: &Arc<Registry>,
    base: &str,
    access: &PeerAccess,
) -> Result<Bootstrap, String> {
    try_peer_within(registry, base, access, BUSY_PATIENCE).await
}

/// [`try_peer`], waiting for a busy peer for `patience`.
async fn try_peer_within(
    registry: &Arc<Registry>,
    base: &str,
    access: &PeerAccess,
    patience: Duration,
) -> Result<Bootstrap, String> {
    // A peer serving its limit of whole-state reads answers 429, and one still bootstrapping
    // from its own peers 503: wait for it (replicas started or replaced together bootstrap from
    // each other), up to `patience` of wall-clock time, its answers' time included (counting
    // the pauses alone, a peer slow to answer 429 held the bootstrap for half an hour). (A 503
    // was taken for a failed peer at once: the replica skipped it and started empty.) A peer
    // shutting down answers 503 for good: the next peer.
    let started = tokio::time::Instant::now();
    let response = loop {
        let response = request(access, &format!("{base}/snapshot")).await?;
        let status = response.status().as_u16();
        let waited = started.elapsed();
        if !matches!(status, 429 | 503) || waited >= patience {
            break response;
        }
        if status == 503 {
            let said = what_it_said(response).await;
            if said.contains("shutting down") {
                return Err(format!("GET /snapshot answered 503: {said}"));
            }
        }
        let pause = (waited / 2)
            .clamp(Duration::from_millis(250), Duration::from_secs(2))
            .min(patience.saturating_sub(started.elapsed()));
        tracing::info!(peer = %base, status, "the peer is busy or not ready; asking again in {pause:?}");
        tokio::time::sleep(pause).await;
    };
    let status = response.status().as_u16();
    if status == 200 {
        // The snapshot is read (and checked) as it downloads; it is restored only once whole
        // and its checksum matched.
        let (sender, receiver) = tokio::sync::mpsc::channel(PIECES_IN_FLIGHT);
        let reader = {
            let registry = Arc::clone(registry);
            tokio::task::spawn_blocking(move || {
                snapshot::read_within(Pieces::new(receiver), registry.read_limits())
                    .map(|(_, images)| images)
                    .map_err(|e| e.to_string())
            })
        };
        let mut body = Download::new(response.into_body());
        let mut download = Ok(());
        loop {
            match body.next_piece().await {
                Ok(Some(piece)) => {
                    let sending = tokio::time::Instant::now();
                    if sender.send(piece).await.is_err() {
                        break; // the reader refused the snapshot: its error says why
                    }
                    body.excuse(sending.elapsed());
                }
                Ok(None) => break,
                Err(why) => {
                    download = Err(why);
                    break;
                }
            }
        }
        drop(sender);
        let images = reader.await.map_err(|e| e.to_string())?;
        // Restored only if the download also ended well: a body cut off after its last byte
        // reads as a whole snapshot, but the peer is then reported failed.
        download?;
        let images = images?;
        let registry = Arc::clone(registry);
        let peer = base.to_owned();
        return tokio::task::spawn_blocking(move || {
            let memberships = images.iter().map(snapshot::IndexImage::memberships).sum();
            registry
                .restore_images(&images, None)
                .map_err(|e| e.to_string())?;
            Ok(Bootstrap::Snapshot { peer, memberships })
        })
        .await
        .map_err(|e| e.to_string())?;
    }
    let status_of_snapshot = status;
    if status != 404 && status != 405 {
        let said = what_it_said(response).await;
        let hint = if status == 401 || status == 403 {
            " (give --peer-token-file a token the peer allows every tenant)"
        } else {
            ""
        };
        return Err(format!("GET /snapshot answered {status}: {said}{hint}"));
    }
    // Not a kvatlas peer: Dynamo's /dump.
    let (status, body) = get(access, &format!("{base}/dump")).await?;
    if status != 200 {
        let said = String::from_utf8_lossy(&body[..body.len().min(512)])
            .trim()
            .to_owned();
        return Err(format!(
            "GET /snapshot answered {snapshot_status} and GET /dump {status}: {said} (neither \
             a kvatlas nor a Dynamo peer here: is {base} the peer's address without a path?)",
            snapshot_status = status_of_snapshot,
        ));
    }
    let registry = Arc::clone(registry);
    let peer = base.to_owned();
    tokio::task::spawn_blocking(move || {
        let parsed = dynamo::parse_dump(&body)?;
        // Parsed: the body (up to the download's bound) is not held while the dump is applied.
        drop(body);
        let skipped = parsed.skipped;
        let events = dynamo::apply_dump(&registry, parsed.indexes).map_err(|e| e.to_string())?;
        let memberships = registry
            .all()
            .iter()
            .map(|entry| kvatlas_index::SharedKvIndex::stats(entry.index()).memberships)
            .sum();
        Ok(Bootstrap::Dump {
            peer,
            events,
            memberships,
            skipped,
        })
    })
    .await
    .map_err(|e| e.to_string())?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer on a loopback port that announces `announced` bytes and sends `piece` bytes every
    /// `every`, `pieces` times, then closes.
    fn trickling_peer(announced: usize, piece: usize, every: Duration, pieces: usize) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/snapshot", listener.local_addr().expect("addr"));
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let Ok((mut stream, _)) = listener.accept() else {
                return;
            };
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-length: {announced}\r\nconnection: close\r\n\r\n"
            );
            for _ in 0..pieces {
                if stream.write_all(&vec![7u8; piece]).is_err() {
                    return;
                }
                std::thread::sleep(every);
            }
        });
        url
    }

    /// Reads the answer of `url` with a 300 ms idle timeout and grace, and a minimum rate of
    /// 1 MiB/s: the bytes read, or why the peer was given up, and how long it took.
    async fn download(url: &str) -> (Result<usize, String>, Duration) {
        let started = std::time::Instant::now();
        let response = request(&PeerAccess::default(), url)
            .await
            .expect("an answer");
        let mut body =
            Download::with_limits(response.into_body(), Duration::from_millis(300), 1 << 20);
        let mut read = 0;
        let outcome = loop {
            match body.next_piece().await {
                Ok(Some(piece)) => read += piece.len(),
                Ok(None) => break Ok(read),
                Err(why) => break Err(why),
            }
        };
        (outcome, started.elapsed())
    }

    /// A peer on a loopback port that answers every request with `status` (an empty body)
    /// after `delay`.
    fn slow_peer(status: &'static str, delay: Duration) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                std::thread::spawn(move || {
                    let mut request = [0u8; 1024];
                    let _ = stream.read(&mut request);
                    std::thread::sleep(delay);
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    );
                });
            }
        });
        url
    }

    fn empty_registry() -> Arc<Registry> {
        Arc::new(Registry::new(
            crate::config::IndexSettings::default(),
            crate::config::Limits::default(),
        ))
    }

    /// A busy peer is waited for within the patience in wall-clock time, its slow answers
    /// included (only the pauses were counted: with answers of 1 s and 1.5 s of patience it
    /// took six answers and pauses, over 7 s).
    #[tokio::test]
    async fn a_busy_peer_slow_to_answer_is_waited_for_within_the_patience() {
        let peer = slow_peer("429 Too Many Requests", Duration::from_secs(1));
        let started = std::time::Instant::now();
        let outcome = try_peer_within(
            &empty_registry(),
            &peer,
            &PeerAccess::default(),
            Duration::from_millis(1500),
        )
        .await;
        let took = started.elapsed();
        let why = outcome.expect_err("a peer busy for good is given up");
        assert!(why.contains("429"), "{why}");
        assert!(took < Duration::from_secs(5), "given up after {took:?}");
    }

    /// A URL that is neither a kvatlas nor a Dynamo peer says so, with both answers.
    #[tokio::test]
    async fn a_peer_answering_neither_path_is_named_as_such() {
        let peer = slow_peer("404 Not Found", Duration::ZERO);
        let why = try_peer(&empty_registry(), &peer, &PeerAccess::default())
            .await
            .expect_err("nothing to bootstrap from");
        assert!(
            why.contains("GET /snapshot answered 404 and GET /dump 404")
                && why.contains("without a path"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn a_peer_that_trickles_is_given_up_and_a_fast_one_read_whole() {
        // 10 bytes every 50 ms (never idle for 300 ms), for 20 s.
        let (outcome, took) =
            download(&trickling_peer(4000, 10, Duration::from_millis(50), 400)).await;
        let why = outcome.expect_err("a peer trickling 200 bytes a second is given up");
        assert!(why.contains("too slowly"), "{why}");
        assert!(took < Duration::from_secs(10), "given up after {took:?}");

        // The same peer sending its 4,000 bytes at once is read whole.
        let (outcome, _) = download(&trickling_peer(4000, 4000, Duration::ZERO, 1)).await;
        assert_eq!(outcome, Ok(4000));

        // One that pauses longer than the idle timeout is given up as stalled (its first 4 MiB
        // bought it 4 s at the minimum rate: the pause, not the rate, gives it up).
        let (outcome, _) =
            download(&trickling_peer(8 << 20, 4 << 20, Duration::from_secs(2), 2)).await;
        let why = outcome.expect_err("a peer pausing 2 s is given up");
        assert!(why.contains("stalled"), "{why}");
    }
}
