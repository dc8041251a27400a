//! Scale-out over NATS JetStream (`docs/server.md`, "Scale-out over NATS JetStream"): the
//! connection, the event-log stream and the snapshot bucket both roles share, and their
//! counters.
//!
//! - An **ingest** (`--publish-to`) runs the listeners as usual and publishes every unit it
//!   applies as a [`log_record`](crate::log_record) (`log_ingest`).
//! - A **replica** (`--consume-from`) restores the newest snapshot of the bucket, consumes the
//!   stream from the sequence after it and applies what it reads (`log_replica`); replicas
//!   write snapshots in turn.
//!
//! Debian's nats-server is 2.9: only streams, ordered consumers, message-id deduplication and
//! object stores are used (no 2.10 features).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream;

use crate::config::TlsFiles;
use crate::metrics::Histogram;

/// The default stream name.
pub const DEFAULT_STREAM: &str = "KVATLAS_EVENTS";
/// The default subject prefix.
pub const DEFAULT_SUBJECT_PREFIX: &str = "kvatlas.events";
/// The default object-store bucket of replica snapshots.
pub const DEFAULT_SNAPSHOT_BUCKET: &str = "KVATLAS_SNAPSHOTS";
/// The object holding the newest snapshot.
pub(crate) const SNAPSHOT_OBJECT: &str = "snapshot";

/// Where the event log lives and how it is kept (`--publish-to` / `--consume-from`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsLog {
    /// The NATS server(s), `nats://HOST:PORT` (comma-separated for a cluster).
    pub url: String,
    /// The JetStream stream.
    pub stream: String,
    /// Subjects are `PREFIX.MODEL.TENANT.INSTANCE`.
    pub subject_prefix: String,
    /// The stream drops records older than this.
    pub max_age: Duration,
    /// The stream drops its oldest records beyond this many bytes.
    pub max_bytes: i64,
    /// The window in which JetStream drops a second record with the same message id (two
    /// ingests fed by the same engines).
    pub duplicate_window: Duration,
    /// The object-store bucket of snapshots.
    pub snapshot_bucket: String,
    /// Time between a replica's snapshots (`None`: it never writes one).
    pub snapshot_interval: Option<Duration>,
    /// The live path: an ingest also publishes each record at once on core NATS
    /// (subjects `PREFIX-live.…`, no storage), and a replica applies a live record that
    /// continues the chain of its source's records before the stream delivers it; the stream
    /// confirms it (`log_replica`). `false`: the stream alone.
    pub live: bool,
    /// How long a replica waits for the stream's copy of a live record it applied before it
    /// takes the record for one its ingest never stored and goes back to the stream's state.
    pub live_confirm_timeout: Duration,
    /// How this server proves itself to NATS and checks NATS's certificate, besides a user
    /// and password in the URL.
    pub access: NatsAccess,
}

/// How a server proves itself to NATS and checks NATS's certificate (`--nats-token-file`,
/// `--nats-nkey-file`, `--nats-creds-file`, `--nats-ca-cert`, `--nats-tls-cert` and
/// `--nats-tls-key`). A user and password go in the URL (`nats://user:password@host:4222`).
///
/// The token, seed and credentials files are read at start (a missing or malformed one stops
/// the start) and again at every reconnection, so a rotated token or seed is used once NATS
/// asks for it (a nats-server reloaded with new credentials disconnects the clients whose old
/// ones it no longer accepts). The CA and client certificate are checked at start and read by
/// the NATS client at every connection. Holds paths only (a `Debug` print shows no secret).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsAccess {
    /// A file holding the token of a nats-server with `authorization { token: … }` (its
    /// first word that is not a comment, as a peer token file).
    pub token_file: Option<PathBuf>,
    /// A file holding an NKey seed (`SU…`, as `nk -gen user` writes it) whose public key is
    /// one of nats-server's `authorization { users: [{ nkey: U… }] }`.
    pub nkey_file: Option<PathBuf>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed, as `nsc` writes it)
    /// for a nats-server in operator mode (accounts and users as JWTs).
    pub creds_file: Option<PathBuf>,
    /// CA certificates (PEM) NATS's certificate must chain to, instead of the system's
    /// roots. Given, the connection must be TLS (a plain nats-server is refused).
    pub ca_cert: Option<PathBuf>,
    /// A client certificate and key (PEM) presented to a nats-server that verifies its
    /// clients (`tls { verify: true }`). Given, the connection must be TLS.
    pub client_tls: Option<TlsFiles>,
}

impl NatsAccess {
    /// Whether the connection must be TLS (a CA or a client certificate is given).
    fn requires_tls(&self) -> bool {
        self.ca_cert.is_some() || self.client_tls.is_some()
    }

    /// What the token, seed or credentials file gives for a connection whose server sent
    /// `nonce` (`None`: no such file is given; the URL's credentials, if any, are used).
    ///
    /// # Errors
    /// The file's setting and path and what is wrong (an unreadable or empty file, a seed or
    /// credentials file that is not one); never the file's content.
    fn credentials(&self, nonce: &[u8]) -> Result<Option<async_nats::Auth>, String> {
        let mut auth = async_nats::Auth::new();
        if let Some(path) = &self.token_file {
            auth.token = Some(secret_of_file(path, "--nats-token-file", "token")?);
        } else if let Some(path) = &self.nkey_file {
            let seed = secret_of_file(path, "--nats-nkey-file", "NKey seed")?;
            let pair = key_pair(&seed, path, "--nats-nkey-file")?;
            auth.signature = Some(signed(&pair, nonce, path, "--nats-nkey-file")?);
            auth.nkey = Some(pair.public_key());
        } else if let Some(path) = &self.creds_file {
            let text = crate::bounded_read::read_text_within(
                path,
                crate::bounded_read::MAX_SECRET_FILE_BYTES,
            )
            .map_err(|e| format!("cannot read --nats-creds-file {}: {e}", path.display()))?;
            let (Some(jwt), Some(seed)) =
                (creds_block(&text, "JWT"), creds_block(&text, "NKEY SEED"))
            else {
                return Err(format!(
                    "--nats-creds-file {}: not a NATS credentials file (a user JWT and its \
                     NKey seed, each between -----BEGIN and ------END lines)",
                    path.display()
                ));
            };
            let pair = key_pair(seed, path, "--nats-creds-file")?;
            auth.signature = Some(signed(&pair, nonce, path, "--nats-creds-file")?);
            auth.jwt = Some(jwt.to_owned());
        } else {
            return Ok(None);
        }
        Ok(Some(auth))
    }

    /// Checks that the CA file and the client certificate and key, if given, form a TLS
    /// client configuration (async-nats reads them again at each connection, and its own
    /// messages do not name the setting).
    ///
    /// # Errors
    /// What is wrong with the CA file or the client certificate and key.
    fn check_tls(&self) -> Result<(), String> {
        if !self.requires_tls() {
            return Ok(());
        }
        let ca_pem = match &self.ca_cert {
            Some(path) => Some(
                std::fs::read(path)
                    .map_err(|e| format!("cannot read --nats-ca-cert {}: {e}", path.display()))?,
            ),
            None => None,
        };
        crate::tls::client_config(
            ca_pem.as_deref(),
            "--nats-ca-cert",
            self.client_tls.as_ref(),
        )
        .map(|_| ())
    }
}

/// The key pair of an NKey `seed` read from `path` (given with `flag`).
fn key_pair(seed: &str, path: &Path, flag: &str) -> Result<nkeys::KeyPair, String> {
    nkeys::KeyPair::from_seed(seed).map_err(|e| {
        format!(
            "{flag} {}: not an NKey seed (a user's seed starts with SU): {e}",
            path.display()
        )
    })
}

/// `nonce` signed with `pair` (the seed of `path`, given with `flag`).
fn signed(pair: &nkeys::KeyPair, nonce: &[u8], path: &Path, flag: &str) -> Result<Vec<u8>, String> {
    pair.sign(nonce)
        .map_err(|e| format!("{flag} {}: cannot sign with the seed: {e}", path.display()))
}

/// The first line of a credentials file's block whose `-----BEGIN …-----` line names `label`
/// (`JWT`, `NKEY SEED`): the format `nsc` writes, a decorated block per item.
fn creds_block<'a>(text: &'a str, label: &str) -> Option<&'a str> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.lines().map(str::trim);
    lines.find(|line| line.starts_with("---") && line.contains("BEGIN") && line.contains(label))?;
    lines
        .find(|line| !line.is_empty())
        .filter(|line| !line.starts_with("---"))
}

/// The secret a token or seed file holds: its first word that is not a comment
/// ([`crate::auth::token_of_file`]).
fn secret_of_file(path: &Path, flag: &str, what: &str) -> Result<String, String> {
    let text =
        crate::bounded_read::read_text_within(path, crate::bounded_read::MAX_SECRET_FILE_BYTES)
            .map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))?;
    let secret = crate::auth::token_of_file(&text);
    if secret.is_empty() {
        return Err(format!("{flag} {} holds no {what}", path.display()));
    }
    Ok(secret.to_owned())
}

/// The credentials a NATS URL carries, as NATS clients read them: `user:password@` a user and
/// password, `token@` a token (percent-encoded characters decoded). No `Debug`: never printed.
#[derive(Clone, PartialEq, Eq)]
enum UrlCredentials {
    UserPassword(String, String),
    Token(String),
}

/// The servers of a NATS URL (a comma-separated list), each parsed as async-nats parses one
/// (`nats://` when no scheme is given, port 4222 when none), with their credentials taken out:
/// async-nats neither splits a list nor sends a URL's credentials, and its debug log prints a
/// server's URL whole.
struct NatsServers {
    /// The servers, without credentials.
    addresses: Vec<async_nats::ServerAddr>,
    /// The credentials the servers carry (the same for every server that carries some).
    credentials: Option<UrlCredentials>,
}

impl NatsServers {
    /// Parses `list`.
    ///
    /// # Errors
    /// A server that does not parse (named by its place in the list, not its text, which may
    /// hold a password), a scheme other than `nats://` or `tls://`, servers with different
    /// credentials, credentials that are not UTF-8 once decoded.
    fn parse(list: &str) -> Result<Self, String> {
        let decode = |part: &str| {
            percent_encoding::percent_decode_str(part)
                .decode_utf8()
                .map(std::borrow::Cow::into_owned)
                .map_err(|_| "the NATS URL's credentials are not UTF-8 once decoded".to_owned())
        };
        let servers: Vec<&str> = list.split(',').map(str::trim).collect();
        let mut addresses = Vec::with_capacity(servers.len());
        let mut credentials = None;
        for (place, server) in servers.iter().enumerate() {
            let which = || {
                if servers.len() == 1 {
                    "the NATS URL".to_owned()
                } else {
                    format!("server {} of the NATS URL list", place + 1)
                }
            };
            let mut url = server
                .parse::<async_nats::ServerAddr>()
                .map_err(|e| {
                    // The parser's message names the problem, not the text.
                    format!(
                        "{} does not parse ({e}); write a ',', '@', '/' or '#' in a password \
                         as %2C, %40, %2F, %23",
                        which()
                    )
                })?
                .into_inner();
            if url.host_str().is_none_or(str::is_empty) {
                return Err(format!("{} does not parse: no host", which()));
            }
            if !matches!(url.scheme(), "nats" | "tls") {
                return Err(format!(
                    "{}: scheme {}:// is not supported (nats:// or tls://)",
                    which(),
                    url.scheme()
                ));
            }
            // `user:@host` is a user with an empty password, as NATS clients read it (the URL
            // parser drops an empty password).
            let empty_password = server
                .rsplit_once('@')
                .is_some_and(|(userinfo, _)| userinfo.ends_with(':'));
            let carried = match (url.username(), url.password()) {
                ("", None) => None,
                (user, Some(password)) => Some(UrlCredentials::UserPassword(
                    decode(user)?,
                    decode(password)?,
                )),
                (user, None) if empty_password => {
                    Some(UrlCredentials::UserPassword(decode(user)?, String::new()))
                }
                (token, None) => Some(UrlCredentials::Token(decode(token)?)),
            };
            if let Some(carried) = carried {
                if credentials.as_ref().is_some_and(|found| *found != carried) {
                    return Err(format!(
                        "the servers of the NATS URL list {} carry different credentials: \
                         one connection sends one set",
                        shown_url(list)
                    ));
                }
                credentials = Some(carried);
                // A URL with a host always takes these.
                let _ = url.set_username("");
                let _ = url.set_password(None);
            }
            addresses.push(
                async_nats::ServerAddr::from_url(url).map_err(|e| format!("{}: {e}", which()))?,
            );
        }
        Ok(Self {
            addresses,
            credentials,
        })
    }
}

impl NatsLog {
    /// The defaults for `url`: stream `KVATLAS_EVENTS`, 1 hour / 1 GiB retention, a 2-minute
    /// duplicate window, snapshots every 30 s into `KVATLAS_SNAPSHOTS`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            stream: DEFAULT_STREAM.to_owned(),
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            max_age: Duration::from_secs(3600),
            max_bytes: 1 << 30,
            duplicate_window: Duration::from_secs(120),
            snapshot_bucket: DEFAULT_SNAPSHOT_BUCKET.to_owned(),
            snapshot_interval: Some(Duration::from_secs(30)),
            live: true,
            live_confirm_timeout: Duration::from_secs(30),
            access: NatsAccess::default(),
        }
    }

    /// Checks names and ranges.
    ///
    /// # Errors
    /// What is wrong, naming the setting.
    pub fn validate(&self) -> Result<(), String> {
        let name_ok = |name: &str| {
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if !name_ok(&self.stream) {
            return Err(format!(
                "NATS stream name {:?}: use letters, digits, '-' and '_'",
                self.stream
            ));
        }
        if !name_ok(&self.snapshot_bucket) {
            return Err(format!(
                "NATS snapshot bucket {:?}: use letters, digits, '-' and '_'",
                self.snapshot_bucket
            ));
        }
        let prefix_ok = !self.subject_prefix.is_empty()
            && self.subject_prefix.split('.').all(|token| {
                !token.is_empty() && !token.contains(['*', '>', ' ', '\t', '\r', '\n'])
            });
        if !prefix_ok {
            return Err(format!(
                "NATS subject prefix {:?}: dot-separated tokens without wildcards or spaces",
                self.subject_prefix
            ));
        }
        if self.max_bytes <= 0 || self.max_age.is_zero() || self.duplicate_window.is_zero() {
            return Err(
                "NATS retention (max age, max bytes) and duplicate window must be positive".into(),
            );
        }
        if self.live_confirm_timeout.is_zero() {
            return Err("the live path's confirmation wait must be at least a second".into());
        }
        for (flag, duration) in [
            ("--nats-max-age-secs", Some(self.max_age)),
            ("the duplicate window", Some(self.duplicate_window)),
            ("--nats-snapshot-interval-secs", self.snapshot_interval),
            ("--nats-live-confirm-secs", Some(self.live_confirm_timeout)),
        ] {
            crate::config::within_max_duration(flag, duration)?;
        }
        let files = [
            (&self.access.token_file, "--nats-token-file"),
            (&self.access.nkey_file, "--nats-nkey-file"),
            (&self.access.creds_file, "--nats-creds-file"),
        ];
        let given: Vec<&str> = files
            .iter()
            .filter(|(file, _)| file.is_some())
            .map(|(_, flag)| *flag)
            .collect();
        if given.len() > 1 {
            return Err(format!(
                "{}: give one (a connection authenticates one way)",
                given.join(" and ")
            ));
        }
        let servers = NatsServers::parse(&self.url)?;
        if let Some(flag) = given.first()
            && servers.credentials.is_some()
        {
            return Err(format!(
                "the NATS URL {} carries credentials and {flag} is given: give one",
                shown_url(&self.url)
            ));
        }
        if self.duplicate_window > self.max_age {
            return Err(format!(
                "the stream's max age (--nats-max-age-secs {}) must be at least its duplicate \
                 window, {} s (two ingests' copies of a batch within it are stored once)",
                self.max_age.as_secs(),
                self.duplicate_window.as_secs()
            ));
        }
        Ok(())
    }

    /// The subjects the stream holds.
    pub(crate) fn subjects(&self) -> String {
        format!("{}.>", self.subject_prefix)
    }

    /// The live path's subject prefix: the stream's with `-live` on its last token, so that
    /// the stream (`PREFIX.>`) never stores a live record.
    pub(crate) fn live_prefix(&self) -> String {
        format!("{}-live", self.subject_prefix)
    }

    /// The live path's subjects.
    pub(crate) fn live_subjects(&self) -> String {
        format!("{}.>", self.live_prefix())
    }
}

/// Messages a subscription buffers (the ingest's live queue holds as many).
const SUBSCRIPTION_CAPACITY: usize = 4096;

/// Connects to NATS (failing within `timeout`, with the URL in the message); what the client
/// reports about the connection later (a disconnection, a message it dropped) is counted in
/// `stats` ([`count_client_event`]).
pub(crate) async fn connect(
    log: &NatsLog,
    timeout: Duration,
    stats: Arc<LogStats>,
) -> Result<jetstream::Context, String> {
    let access = Arc::new(log.access.clone());
    let servers = NatsServers::parse(&log.url)?;
    let count = u32::try_from(servers.addresses.len().max(1)).unwrap_or(u32::MAX);
    let per_server = (timeout / count).max(Duration::from_secs(2));
    // The first connection tries each server once, one after the other.
    let wait = timeout.max(per_server.saturating_mul(count));
    // Read the files once now: a missing or malformed one stops the start with its name.
    access.check_tls()?;
    let mut options = match access.credentials(b"")? {
        None => match servers.credentials {
            None => async_nats::ConnectOptions::new(),
            Some(UrlCredentials::UserPassword(user, password)) => {
                async_nats::ConnectOptions::with_user_and_password(user, password)
            }
            Some(UrlCredentials::Token(token)) => async_nats::ConnectOptions::with_token(token),
        },
        Some(_) => {
            let access = Arc::clone(&access);
            let failures = AtomicU64::new(0);
            // At every (re)connection: a rotated token, seed or credentials file is read then.
            async_nats::ConnectOptions::with_auth_callback(move |nonce| {
                let given = access.credentials(&nonce);
                std::future::ready(given.map(Option::unwrap_or_default).map_err(|problem| {
                    // Reconnections are tried every few seconds for ever: one line per power
                    // of two.
                    let failed = failures.fetch_add(1, Ordering::Relaxed) + 1;
                    if failed.is_power_of_two() {
                        tracing::warn!(failed, "NATS: {problem}");
                    }
                    async_nats::AuthError::new(problem)
                }))
            })
        }
    };
    // async-nats reads these files at every connection (a rotated CA or client certificate
    // is taken then), and with a CA file given it does not read the system's roots.
    if let Some(ca) = &log.access.ca_cert {
        options = options.add_root_certificates(ca.clone());
    }
    if let Some(files) = &log.access.client_tls {
        options = options.add_client_certificate(files.cert.clone(), files.key.clone());
    }
    if log.access.requires_tls() {
        options = options.require_tls(true);
    }
    let options = options
        .name("kvatlas")
        .event_callback(move |event| {
            count_client_event(&stats, &event);
            std::future::ready(())
        })
        // Each server of a list gets its share of the wait (at least 2 s), so one that drops
        // connection attempts does not use it all before the next is tried.
        .connection_timeout(per_server)
        // Messages buffered per subscription before NATS drops them (async-nats's default is
        // 65,536): a replica does not read its live subscription while it restores a snapshot,
        // and a live record left off costs only its early application (the stream carries it).
        .subscription_capacity(SUBSCRIPTION_CAPACITY)
        // Reconnect forever: a restarted nats-server is waited for, never given up on.
        .max_reconnects(None);
    let client = tokio::time::timeout(wait, options.connect(servers.addresses.as_slice()))
        .await
        .map_err(|_| {
            format!(
                "cannot reach NATS at {}: no answer within {wait:?}",
                shown_url(&log.url)
            )
        })?
        .map_err(|e| {
            let refused = matches!(
                e.kind(),
                async_nats::ConnectErrorKind::AuthorizationViolation
                    | async_nats::ConnectErrorKind::Authentication
            );
            let hint = if refused {
                " (NATS refused the credentials: check --nats-token-file, --nats-nkey-file, \
                 --nats-creds-file or \
                 the URL's user and password)"
            } else {
                ""
            };
            format!("cannot reach NATS at {}: {e}{hint}", shown_url(&log.url))
        })?;
    Ok(jetstream::new(client))
}

/// `url` (a comma-separated list of servers) for logs and errors: each server that parses as
/// `scheme://host:port`, with `***@` before the host where it carries credentials; one that
/// does not parse is named by its place only (its text may hold a password).
pub(crate) fn shown_url(url: &str) -> String {
    url.split(',')
        .map(str::trim)
        .enumerate()
        .map(
            |(place, server)| match server.parse::<async_nats::ServerAddr>() {
                Ok(address) => {
                    let hidden = if address.has_user_pass() || address.password().is_some() {
                        "***@"
                    } else {
                        ""
                    };
                    let url = address.into_inner();
                    // An IPv6 host keeps its brackets.
                    format!(
                        "{}://{hidden}{}:{}",
                        url.scheme(),
                        url.host_str().unwrap_or_default(),
                        url.port_or_known_default().unwrap_or(4222)
                    )
                }
                Err(_) => format!("(server {} does not parse)", place + 1),
            },
        )
        .collect::<Vec<_>>()
        .join(",")
}

/// Counts and logs one event the NATS client reports.
///
/// A `SlowConsumer` event is one message the client dropped because its subscription's buffer
/// (`SUBSCRIPTION_CAPACITY`) was full — on a replica, a live record (the stream carries it
/// later) or a message of the stream's ordered consumer (which notices the gap and re-creates
/// itself). The client queues at most 128 events and drops further ones, so under a burst the
/// count is a lower bound of the messages dropped.
pub(crate) fn count_client_event(stats: &LogStats, event: &async_nats::Event) {
    match event {
        async_nats::Event::SlowConsumer(subscription) => {
            let dropped = stats.nats_slow_consumer.fetch_add(1, Ordering::Relaxed) + 1;
            // One line per power of two: a burst of drops does not flood the log.
            if dropped.is_power_of_two() {
                tracing::warn!(
                    subscription,
                    dropped,
                    "NATS: a subscription's buffer was full and the client dropped a message \
                     (the stream carries live records; counted in \
                     kvatlas_log_nats_slow_consumer_total)"
                );
            }
        }
        async_nats::Event::Disconnected => {
            LogStats::bump(&stats.nats_disconnects);
            tracing::warn!("NATS: disconnected; reconnecting");
        }
        async_nats::Event::Connected => tracing::info!("NATS: connected"),
        other => tracing::warn!("NATS: {other}"),
    }
}

/// The event-log stream, created with `log`'s retention if absent (an existing stream keeps
/// its own configuration, but must take the log's subjects: one of that name made by hand or
/// by a deployment with another `--nats-subject-prefix` is refused, naming both; accepted, an
/// ingest's every publish found no stream and was retried for ever, its queue full and its
/// engines waiting, and a replica read nothing).
pub(crate) async fn stream(
    js: &jetstream::Context,
    log: &NatsLog,
) -> Result<jetstream::stream::Stream, String> {
    let stream = js
        .get_or_create_stream(stream_config(log))
        .await
        .map_err(|e| format!("NATS stream {}: {e}", log.stream))?;
    let subjects = &stream.cached_info().config.subjects;
    if !subjects.iter().any(|taken| covers(taken, &log.subjects())) {
        return Err(format!(
            "NATS stream {} takes the subjects {subjects:?}, not {}: it was made with other \
             settings (by hand, or with another --nats-subject-prefix); use that prefix, name \
             another stream with --nats-stream, or delete the stream",
            log.stream,
            log.subjects()
        ));
    }
    // Nothing else either: a replica reads the log's subjects only, and takes any other
    // message's sequence number for a record the stream lost (it re-bootstrapped or counted
    // a loss at each, and a foreign last message kept it from ever being caught up).
    if let Some(wider) = subjects
        .iter()
        .find(|taken| !within(taken, &log.subject_prefix))
    {
        return Err(format!(
            "NATS stream {} takes the subjects {subjects:?}: {wider:?} is more than the event \
             log's {}, and a replica would take the other messages for records the stream \
             lost; give the log a stream of its own (--nats-stream) or take {wider:?} out of it",
            log.stream,
            log.subjects()
        ));
    }
    Ok(stream)
}

/// Whether every subject the stream subject `taken` takes lies under `prefix` (a subject of
/// the log: `prefix`'s tokens as they are, then one or more).
fn within(taken: &str, prefix: &str) -> bool {
    let mut tokens = taken.split('.');
    prefix
        .split('.')
        .all(|literal| tokens.next() == Some(literal))
        && tokens.next().is_some()
}

/// Whether the stream subject `taken` (NATS wildcards: `*` one token, `>` one or more at the
/// end) takes every subject of `wanted`, which ends in `>`.
fn covers(taken: &str, wanted: &str) -> bool {
    let wanted: Vec<&str> = wanted.split('.').collect();
    // Every token of `wanted` before its final `>` is matched one to one; the final `>` (one
    // or more tokens of any length) only by a `>`.
    let last = wanted.len() - 1;
    for (at, token) in taken.split('.').enumerate() {
        if token == ">" {
            return true;
        }
        if at >= last || (token != "*" && token != wanted[at]) {
            return false;
        }
    }
    false
}

/// The event-log stream's configuration from `log`'s settings.
pub(crate) fn stream_config(log: &NatsLog) -> jetstream::stream::Config {
    jetstream::stream::Config {
        name: log.stream.clone(),
        subjects: vec![log.subjects()],
        max_age: log.max_age,
        max_bytes: log.max_bytes,
        duplicate_window: log.duplicate_window,
        storage: jetstream::stream::StorageType::File,
        discard: jetstream::stream::DiscardPolicy::Old,
        ..Default::default()
    }
}

/// The snapshot bucket, created if absent.
pub(crate) async fn snapshot_bucket(
    js: &jetstream::Context,
    log: &NatsLog,
) -> Result<jetstream::object_store::ObjectStore, String> {
    match js.get_object_store(&log.snapshot_bucket).await {
        Ok(store) => Ok(store),
        Err(_) => js
            .create_object_store(jetstream::object_store::Config {
                bucket: log.snapshot_bucket.clone(),
                description: Some("kvatlas replica snapshots".to_owned()),
                storage: jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("NATS object store {}: {e}", log.snapshot_bucket)),
    }
}

#[cfg(test)]
mod subject_tests {
    use super::{covers, within};

    #[test]
    fn a_stream_subject_covers_the_logs_subjects_only_if_it_takes_all_of_them() {
        for taken in [
            "kvatlas.events.>",
            "kvatlas.>",
            ">",
            "*.events.>",
            "kvatlas.*.>",
        ] {
            assert!(covers(taken, "kvatlas.events.>"), "{taken}");
        }
        for taken in [
            "kvatlas.prod.>",
            "kvatlas.events.*",
            "kvatlas.events",
            "kvatlas.events.m.>",
            "kvatlas.*",
            "other.>",
            "",
        ] {
            assert!(!covers(taken, "kvatlas.events.>"), "{taken}");
        }
    }

    #[test]
    fn a_stream_subject_lies_within_the_log_only_under_its_prefix() {
        for taken in ["kvatlas.events.>", "kvatlas.events.m.>", "kvatlas.events.*"] {
            assert!(within(taken, "kvatlas.events"), "{taken}");
        }
        for taken in [
            "kvatlas.>",
            ">",
            "*.events.>",
            "kvatlas.*.>",
            "kvatlas.events",
            "other.>",
        ] {
            assert!(!within(taken, "kvatlas.events"), "{taken}");
        }
    }
}

/// A histogram with the event age's fine buckets ([`Histogram::event_ages`]).
#[derive(Debug)]
pub(crate) struct AgeHistogram(pub(crate) Histogram);

impl Default for AgeHistogram {
    fn default() -> Self {
        Self(Histogram::event_ages())
    }
}

impl AgeHistogram {
    /// Counts `age`, unless it is longer than an event age can be
    /// ([`kvatlas_events::MAX_EVENT_AGE`]: a stamp that far back is not a recent wall-clock
    /// time).
    pub(crate) fn observe(&self, age: std::time::Duration) {
        if age <= kvatlas_events::MAX_EVENT_AGE {
            self.0.observe(age);
        }
    }
}

/// What the event log did in this process (both roles; `/metrics` shows them).
#[derive(Debug, Default)]
pub(crate) struct LogStats {
    /// At a replica, a batch's engine stamp to the stream storing its record: the engine's,
    /// the ingest's and NATS's share of the event age (`kvatlas_event_age_seconds` is the
    /// whole, to visible at the replica).
    pub(crate) stored_age: AgeHistogram,
    /// At a replica, a stamped batch's engine stamp to its live record reaching the replica's
    /// consumer: the engine's, the ingest's and core NATS's share of the event age on the live
    /// path.
    pub(crate) live_age: AgeHistogram,
    /// At an ingest, a stamped batch's engine stamp to its publisher taking its record off the
    /// queue (and sending it live): the engine's and the ingest's share of the event age.
    pub(crate) sent_age: AgeHistogram,
    /// Records handed to the publisher.
    pub(crate) queued: AtomicU64,
    /// Records the stream acknowledged.
    pub(crate) published: AtomicU64,
    /// Of those, acknowledged as duplicates (another ingest published them first).
    pub(crate) publish_duplicates: AtomicU64,
    /// Bytes of the records the stream stored (not duplicates): subject, `Nats-Msg-Id` header
    /// block and payload, as sent.
    pub(crate) published_bytes: AtomicU64,
    /// Publishes that failed and were retried.
    pub(crate) publish_retries: AtomicU64,
    /// Records the stream cannot take: one record larger than NATS's `max_payload` (or records
    /// whose publish task panicked). Never retried; the replicas do not get them (logged as
    /// errors).
    pub(crate) publish_refused: AtomicU64,
    /// Records handed to the log after its publisher stopped (a shutdown): not published.
    pub(crate) lost_at_shutdown: AtomicU64,
    /// Records consumed by a replica.
    pub(crate) consumed: AtomicU64,
    /// Of those, applied.
    pub(crate) applied: AtomicU64,
    /// Dropped: a batch the replica had applied (same sequence and fingerprint).
    pub(crate) dropped_duplicate: AtomicU64,
    /// Dropped: a batch at or below the source's position without a resync (an ingest
    /// re-publishing what it replayed).
    pub(crate) dropped_stale: AtomicU64,
    /// Dropped: undecodable or refused records.
    pub(crate) dropped_invalid: AtomicU64,
    /// The stream skipped sequences the replica had not read (retention): re-bootstraps.
    pub(crate) rebootstraps: AtomicU64,
    /// Sequences lost for good (no snapshot covered them).
    pub(crate) sequences_lost: AtomicU64,
    /// Times a replica found the stream re-created (deleted, or its storage lost): it read the
    /// new stream from its start, keeping its state.
    pub(crate) stream_recreations: AtomicU64,
    /// Times an ingest found no stream for its subjects and created it again.
    pub(crate) stream_created_again: AtomicU64,
    /// The last stream sequence a replica applied.
    pub(crate) stream_sequence: AtomicU64,
    /// Snapshots written to the bucket, and skipped because another replica's was recent.
    pub(crate) snapshots_written: AtomicU64,
    pub(crate) snapshots_skipped: AtomicU64,
    pub(crate) snapshots_failed: AtomicU64,
    /// Failed attempts of a replica to read or restore a snapshot object (an older one is tried
    /// when the stream continues it; a replica that cannot start counts each attempt).
    pub(crate) snapshots_unreadable: AtomicU64,
    /// Live path, at an ingest: records published live, and left out (the live queue full).
    pub(crate) live_published: AtomicU64,
    pub(crate) live_dropped: AtomicU64,
    /// Live path, at a replica: live records applied before the stream delivered them; of
    /// those, confirmed by the stream; live records not applied (they did not continue their
    /// source's chain, or the replica was not caught up); divergences (the stream delivered
    /// something else than a record applied live: the replica re-bootstraps).
    pub(crate) live_applied: AtomicU64,
    pub(crate) live_confirmed: AtomicU64,
    pub(crate) live_skipped: AtomicU64,
    pub(crate) live_divergences: AtomicU64,
    /// Messages the NATS client dropped because a subscription's buffer was full (a lower
    /// bound: [`count_client_event`]).
    pub(crate) nats_slow_consumer: AtomicU64,
    /// Times the NATS connection was lost (the client reconnects).
    pub(crate) nats_disconnects: AtomicU64,
    /// Time from the stream storing a record to the replica applying it.
    pub(crate) lag: Histogram,
    /// Time from the ingest queueing a record to the stream acknowledging it.
    pub(crate) publish_latency: Histogram,
}

impl LogStats {
    /// Adds one to `counter`.
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Appends the `kvatlas_log_*` metrics.
    pub(crate) fn render(&self, out: &mut String, role: &str) {
        use std::fmt::Write as _;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let counters: [(&str, &str, u64); 26] = [
            (
                "published_bytes",
                "bytes of the records stored (subject, headers, payload)",
                get(&self.published_bytes),
            ),
            (
                "queued",
                "records handed to the publisher",
                get(&self.queued),
            ),
            (
                "published",
                "records the stream acknowledged",
                get(&self.published),
            ),
            (
                "publish_duplicates",
                "acknowledged as duplicates of another ingest's",
                get(&self.publish_duplicates),
            ),
            (
                "publish_retries",
                "publishes retried",
                get(&self.publish_retries),
            ),
            (
                "publish_refused",
                "records not published: larger than NATS's max_payload, or lost with a publish task that panicked (replicas miss them)",
                get(&self.publish_refused),
            ),
            (
                "consumed",
                "records read by the replica",
                get(&self.consumed),
            ),
            (
                "applied",
                "records applied by the replica",
                get(&self.applied),
            ),
            (
                "dropped_duplicate",
                "records dropped: already applied",
                get(&self.dropped_duplicate),
            ),
            (
                "dropped_stale",
                "records dropped: at or below the source's position",
                get(&self.dropped_stale),
            ),
            (
                "dropped_invalid",
                "records dropped: undecodable or refused",
                get(&self.dropped_invalid),
            ),
            (
                "rebootstraps",
                "re-bootstraps after the stream skipped sequences",
                get(&self.rebootstraps),
            ),
            (
                "sequences_lost",
                "stream sequences no snapshot covered",
                get(&self.sequences_lost),
            ),
            (
                "stream_recreations",
                "streams found re-created (deleted or storage lost): read again from their start",
                get(&self.stream_recreations),
            ),
            (
                "stream_created_again",
                "streams an ingest found missing and created again",
                get(&self.stream_created_again),
            ),
            (
                "snapshots_written",
                "snapshots written to the bucket",
                get(&self.snapshots_written),
            ),
            (
                "snapshots_skipped",
                "snapshot turns left to another replica",
                get(&self.snapshots_skipped),
            ),
            (
                "live_published",
                "records published on the live path",
                get(&self.live_published),
            ),
            (
                "live_dropped",
                "records left off the live path (its queue full; the stream carries them)",
                get(&self.live_dropped),
            ),
            (
                "live_applied",
                "live records applied before the stream delivered them",
                get(&self.live_applied),
            ),
            (
                "live_confirmed",
                "live records the stream then delivered unchanged",
                get(&self.live_confirmed),
            ),
            (
                "live_skipped",
                "live records left to the stream (not continuing their source's chain)",
                get(&self.live_skipped),
            ),
            (
                "live_divergences",
                "streams that delivered something else than a live record applied (re-bootstraps)",
                get(&self.live_divergences),
            ),
            (
                "snapshots_unreadable",
                "failed attempts to read or restore a snapshot object (an older one is tried when the stream continues it)",
                get(&self.snapshots_unreadable),
            ),
            (
                "nats_slow_consumer",
                "messages the NATS client dropped, a subscription's buffer full (a lower bound)",
                get(&self.nats_slow_consumer),
            ),
            (
                "nats_disconnects",
                "NATS connections lost (the client reconnects)",
                get(&self.nats_disconnects),
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP kvatlas_log_{name}_total Event log ({role}): {help}."
            );
            let _ = writeln!(out, "# TYPE kvatlas_log_{name}_total counter");
            let _ = writeln!(out, "kvatlas_log_{name}_total {value}");
        }
        let _ = writeln!(
            out,
            "# HELP kvatlas_log_snapshots_failed_total Event log: snapshots that failed."
        );
        let _ = writeln!(out, "# TYPE kvatlas_log_snapshots_failed_total counter");
        let _ = writeln!(
            out,
            "kvatlas_log_snapshots_failed_total {}",
            get(&self.snapshots_failed)
        );
        let _ = writeln!(
            out,
            "# HELP kvatlas_log_stream_sequence The last stream sequence the replica applied."
        );
        let _ = writeln!(out, "# TYPE kvatlas_log_stream_sequence gauge");
        let _ = writeln!(
            out,
            "kvatlas_log_stream_sequence {}",
            get(&self.stream_sequence)
        );
        self.publish_latency.render(
            out,
            "kvatlas_log_publish_seconds",
            "From the ingest queueing a record to the stream acknowledging it.",
            "",
        );
        self.lag.render(
            out,
            "kvatlas_log_lag_seconds",
            "From the stream storing a record to the replica applying it.",
            "",
        );
        self.sent_age.0.render(
            out,
            "kvatlas_log_sent_age_seconds",
            "At an ingest: from a batch's engine stamp to the publisher taking its record.",
            "",
        );
        self.live_age.0.render(
            out,
            "kvatlas_log_live_age_seconds",
            "At a replica: from a batch's engine stamp to its live record reaching the consumer.",
            "",
        );
        self.stored_age.0.render(
            out,
            "kvatlas_log_stored_age_seconds",
            "At a replica: from a batch's engine stamp to the stream storing its record.",
            "",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_a_url_are_not_shown() {
        assert_eq!(shown_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            shown_url("nats://user:s3cret@nats.local:4222"),
            "nats://***@nats.local:4222"
        );
        assert_eq!(shown_url("tok3n@h:1, h2"), "nats://***@h:1,nats://h2:4222");
        assert_eq!(shown_url("tls://a:b@h:1/x@y"), "tls://***@h:1");
        assert_eq!(
            shown_url("nats://a:s3cret@h:1,nats://b:0ther@[::1]:2"),
            "nats://***@h:1,nats://***@[::1]:2"
        );
        assert_eq!(shown_url("nats://:s3cret@h:1"), "nats://***@h:1");
        // A comma in a password splits the list where async-nats's parser would not take it:
        // neither part is shown.
        let shown = shown_url("nats://u:pa,ss@h:4222");
        assert_eq!(shown, "(server 1 does not parse),nats://***@h:4222");
        assert!(!shown_url("nats://u:p w@h:1").contains("p w"));
    }

    #[test]
    fn a_credentials_files_blocks_are_found_as_nsc_writes_them() {
        let jwt = "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.c2ln";
        let seed = "SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM";
        let file = format!(
            "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        );
        for text in [
            file.clone(),
            file.replace('\n', "\r\n"),
            format!("\u{feff}{file}"),
        ] {
            assert_eq!(creds_block(&text, "JWT"), Some(jwt));
            assert_eq!(creds_block(&text, "NKEY SEED"), Some(seed));
        }
        // An empty block is no block (the next block's line is not taken for it).
        let empty = "-----BEGIN NATS USER JWT-----\n------END NATS USER JWT------\n";
        assert_eq!(creds_block(empty, "JWT"), None);
        assert_eq!(creds_block(seed, "NKEY SEED"), None);
    }

    #[test]
    fn a_urls_servers_and_credentials_are_read_as_nats_clients_read_them() {
        let parse = |url: &str| NatsServers::parse(url);
        let plain = parse("nats://127.0.0.1:4222, h2:4223").expect("two servers");
        assert!(plain.credentials.is_none());
        let shown: Vec<String> = plain
            .addresses
            .iter()
            .map(|a| format!("{}:{}", a.host(), a.port()))
            .collect();
        assert_eq!(shown, ["127.0.0.1:4222", "h2:4223"]);
        let user = parse("nats://u:p%40ss%2C@h:1").expect("user");
        assert!(user.credentials == Some(UrlCredentials::UserPassword("u".into(), "p@ss,".into())));
        // The addresses handed to async-nats carry no credentials (its debug log prints them).
        assert!(!user.addresses[0].has_user_pass() && user.addresses[0].password().is_none());
        let token = parse("tls://t0ken@h:1").expect("token");
        assert!(token.credentials == Some(UrlCredentials::Token("t0ken".into())));
        assert!(!token.addresses[0].has_user_pass());
        let empty = parse("nats://u:@h:1").expect("an empty password");
        assert!(empty.credentials == Some(UrlCredentials::UserPassword("u".into(), String::new())));
        assert!(token.addresses[0].tls_required());
        // One connection sends one set: servers with the same, or some without, are fine.
        assert!(
            parse("nats://u:p@h:1,nats://u:p@h2:2,h3:3")
                .expect("same")
                .credentials
                .is_some()
        );
        for (url, expected) in [
            (
                "nats://u:p@h:1,nats://v:s3cret@h2:2",
                "different credentials",
            ),
            ("ws://u:s3cret@h:1", "not supported"),
            ("nats://u:s3cret@h:port", "does not parse"),
            (
                "nats://h:1,,h2:2",
                "server 2 of the NATS URL list does not parse",
            ),
        ] {
            let Err(error) = parse(url) else {
                panic!("{url} taken");
            };
            assert!(error.contains(expected), "{url}: {error}");
            assert!(!error.contains("s3cret"), "{error}");
        }
    }

    #[test]
    fn the_clients_dropped_messages_and_lost_connections_are_counted_and_shown() {
        let stats = LogStats::default();
        for _ in 0..3 {
            count_client_event(&stats, &async_nats::Event::SlowConsumer(7));
        }
        count_client_event(&stats, &async_nats::Event::Disconnected);
        count_client_event(&stats, &async_nats::Event::Connected);
        count_client_event(&stats, &async_nats::Event::LameDuckMode);
        let mut out = String::new();
        stats.render(&mut out, "replica");
        assert!(
            out.contains("\nkvatlas_log_nats_slow_consumer_total 3\n"),
            "{out}"
        );
        assert!(
            out.contains("\nkvatlas_log_nats_disconnects_total 1\n"),
            "{out}"
        );
    }
}
