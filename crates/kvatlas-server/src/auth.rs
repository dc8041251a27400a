//! Bearer-token authentication and per-tenant authorization.
//!
//! The token file has one token per line, optionally followed by `tenants=a,b` (the token may
//! only use those tenants; without it, every tenant), `name=LABEL` (how logs name the caller)
//! and `max_requests=N` (the most requests and open streams the token holds at once, of the
//! server's `--max-concurrent-requests`; without it, `--max-requests-per-token` if set);
//! `#` at the start of a line or after whitespace starts a comment (a `#` inside a token is
//! part of the token):
//!
//! ```text
//! # kvatlas tokens
//! 7f3c9a51e2d84b06a1c5f0e9d2b47a38                       name=router
//! 0c8e41f7a29b5d36e4a1f8c07b92d5e3 tenants=team-a,team-b  name=team-a-router max_requests=64
//! ```
//!
//! Tokens are compared in constant time: the SHA-256 of the presented token against the SHA-256
//! of each configured one, every one of them, with `subtle` (neither a token's length nor how
//! much of it matched shows in the timing). A token must be at least [`MIN_TOKEN_BYTES`] long.
//!
//! A [`Caller`] is attached to every authenticated request; a tenant-limited caller never sees
//! another tenant's index, workers or scores (PERMISSION_DENIED when it names one; lists leave
//! them out). Health checks and reflection (the API's schema, public anyway) need no token; every
//! `kvatlas.v1` RPC and `/metrics` do once a token file is given.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Mutex, RwLock};

use ring::digest::{SHA256, digest};
use subtle::ConstantTimeEq;

use crate::error::ServiceError;
use crate::places::Places;
use crate::reload::{Reread, reload_file};

/// The bearer token a client's token file holds: the first word of its first line that is not
/// blank or a comment (empty if none), so that a copy of a server's token file sends its first
/// token, not its heading comment.
pub(crate) fn token_of_file(text: &str) -> &str {
    text.lines()
        .map(|line| without_comment(line).trim())
        .find(|line| !line.is_empty())
        .and_then(|line| line.split_whitespace().next())
        .unwrap_or_default()
}

/// The shortest token accepted, in bytes.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Why a token file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenFileError {
    /// The file could not be read.
    #[error("cannot read the token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("token file {path} line {line}: {why}")]
    Line {
        /// The file.
        path: String,
        /// The 1-based line number.
        line: usize,
        /// What is wrong (the token itself is never printed).
        why: String,
    },
    /// The file holds no token.
    #[error("token file {path} holds no token")]
    Empty {
        /// The file.
        path: String,
    },
}

/// One token's share of the server's concurrency: at most `limit` requests (and open streams)
/// in flight at once, so one client cannot hold every place of `--max-concurrent-requests`.
#[derive(Debug)]
pub struct RequestQuota {
    /// The most at once (changed in place when a reload of the token file changes it;
    /// `usize::MAX`: no limit, the requests only counted).
    limit: AtomicUsize,
    /// Requests of the token in flight (at most `limit` when taken: see [`Places`]).
    in_flight: Places,
}

impl RequestQuota {
    /// A quota of `limit` requests at once.
    pub fn new(limit: usize) -> Self {
        Self {
            limit: AtomicUsize::new(limit),
            in_flight: Places::default(),
        }
    }

    /// The most requests at once.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Takes a place; `false` (nothing taken) when all `limit` are held.
    pub(crate) fn take(&self) -> bool {
        self.in_flight.take(self.limit())
    }

    /// Gives back a place [`RequestQuota::take`] took.
    pub(crate) fn give_back(&self) {
        self.in_flight.give_back();
    }

    /// The places held now.
    fn held(&self) -> usize {
        self.in_flight.held()
    }
}

/// Who is calling, as far as authorization is concerned.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The token's name (`anonymous` without authentication).
    pub name: Arc<str>,
    /// The tenants it may use (`None` = every tenant).
    pub tenants: Option<Arc<BTreeSet<String>>>,
    /// Its share of the server's concurrency (`None` = only the server's limit), shared by
    /// every request that presents the same token.
    pub quota: Option<Arc<RequestQuota>>,
    /// The SHA-256 of its token (`None` without authentication), so that a stream can find
    /// the token again after the token file changed ([`TokenFile::recheck`]).
    pub(crate) token: Option<[u8; 32]>,
    /// The version of the token file it was authenticated by (0 for the file read at start,
    /// one more at every reload that changed it).
    pub(crate) generation: u64,
}

impl Caller {
    /// The caller of a server without authentication: every tenant.
    pub fn anonymous() -> Self {
        Self {
            name: Arc::from("anonymous"),
            tenants: None,
            quota: None,
            token: None,
            generation: 0,
        }
    }

    /// Whether it may use `tenant`.
    pub fn may_use(&self, tenant: &str) -> bool {
        self.tenants.as_ref().is_none_or(|t| t.contains(tenant))
    }

    /// Whether it may use every tenant.
    pub fn unrestricted(&self) -> bool {
        self.tenants.is_none()
    }

    /// For a request that filters by tenant (empty = every tenant it may use): PERMISSION_DENIED
    /// when it names one it may not use, which an empty answer would hide.
    ///
    /// # Errors
    /// What [`Caller::check`] answers for a named tenant.
    pub fn check_named(&self, tenant: &str) -> Result<(), ServiceError> {
        if tenant.is_empty() {
            Ok(())
        } else {
            self.check(tenant)
        }
    }

    /// PERMISSION_DENIED unless it may use `tenant`.
    ///
    /// # Errors
    /// [`ServiceError::PermissionDenied`].
    pub fn check(&self, tenant: &str) -> Result<(), ServiceError> {
        if self.may_use(tenant) {
            Ok(())
        } else {
            Err(ServiceError::PermissionDenied(format!(
                "the token {:?} is not allowed tenant {tenant:?}",
                self.name
            )))
        }
    }
}

#[derive(Debug)]
struct Token {
    sha256: [u8; 32],
    caller: Caller,
}

/// The configured tokens.
#[derive(Debug)]
pub struct Tokens {
    tokens: Vec<Token>,
    /// Which version of the token file these are ([`Caller::generation`]).
    generation: u64,
}

/// The server's token file: the tokens in force, re-read while the server runs
/// ([`TokenFile::reload`], on SIGHUP and every few seconds), so tokens are added, revoked and
/// rotated without a restart.
#[derive(Debug)]
pub(crate) struct TokenFile {
    path: PathBuf,
    /// `--max-requests-per-token`, for the tokens without `max_requests=`.
    default_quota: Option<usize>,
    /// The SHA-256 of the text last loaded (a file that reads the same is not parsed again;
    /// the text itself, tokens in the clear, is not kept). Held by a reload from its read to
    /// its swap, so that two reloads cannot put an older file back in force.
    loaded: Mutex<[u8; 32]>,
    current: RwLock<Arc<Tokens>>,
    /// The generation of the tokens in `current`, readable without its lock: a stream compares
    /// its caller's generation with it at every message, and looks its token up again only
    /// when the file changed ([`TokenFile::recheck`]).
    generation: AtomicU64,
    /// Cancelled when the tokens in force change (and replaced by a fresh one): an open
    /// stream waits on it as well as on its next message, so a token revoked ends its quiet
    /// streams at once ([`TokenFile::changes`]; before, a stream that sent nothing more kept
    /// its places and its ranks until its client went away).
    changed: Mutex<tokio_util::sync::CancellationToken>,
    /// The quotas of revoked tokens whose requests are still in flight (a unary request
    /// admitted before the revocation finishes), by the token's SHA-256: a token added again
    /// takes its count back (it started afresh, beside the requests it still held). An entry
    /// goes once its count is 0, checked at each reload: at most as many entries as requests
    /// in flight.
    revoked: Mutex<std::collections::HashMap<[u8; 32], Arc<RequestQuota>>>,
}

impl TokenFile {
    /// Reads the token file at `path`.
    ///
    /// # Errors
    /// [`TokenFileError`] naming the file and line (never the token).
    pub(crate) fn load(path: &Path, default_quota: Option<usize>) -> Result<Self, TokenFileError> {
        let text = read_text(path)?;
        let tokens =
            Tokens::parse(&text, &path.display().to_string())?.with_default_quota(default_quota);
        Ok(Self {
            path: path.to_owned(),
            default_quota,
            loaded: Mutex::new(sha256(text.as_bytes())),
            current: RwLock::new(Arc::new(tokens)),
            generation: AtomicU64::new(0),
            changed: Mutex::new(tokio_util::sync::CancellationToken::new()),
            revoked: Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// Cancelled at the next change of the tokens in force. A stream takes it, then rechecks
    /// its caller ([`TokenFile::recheck`]: a change between its authentication and this call
    /// is then seen), and rechecks again whenever it is cancelled, taking the next one.
    pub(crate) fn changes(&self) -> tokio_util::sync::CancellationToken {
        self.changed.lock().clone()
    }

    /// Reads the file again ([`crate::reload::reread`]: blocking, a changed file is read until
    /// two reads agree); tokens that changed are in force from the next request on, and from
    /// the next message of a stream already open (`QueryStream` and `PublishEvents` call
    /// [`TokenFile::recheck`]; a unary request already admitted finishes). `Changed(n)`: `n`
    /// tokens are now in force.
    ///
    /// # Errors
    /// [`TokenFileError`]; the tokens in force do not change.
    pub(crate) fn reload(&self) -> Result<Reread<usize>, TokenFileError> {
        reload_file(
            &self.loaded,
            |text: &String| sha256(text.as_bytes()),
            || read_text(&self.path),
            |text| {
                let tokens = Tokens::parse(text, &self.path.display().to_string())?
                    .with_default_quota(self.default_quota);
                // Matched with the tokens in force under the read lock (requests go on),
                // swapped under the write lock: `loaded` keeps every other reload out.
                let mut revoked = self.revoked.lock();
                revoked.retain(|_, quota| quota.held() > 0);
                let in_force = Arc::clone(&self.current.read());
                let mut tokens = tokens.keeping_quotas_of(&in_force, &revoked);
                for token in &in_force.tokens {
                    if let Some(quota) = &token.caller.quota
                        && quota.held() > 0
                        && !tokens.tokens.iter().any(|t| t.sha256 == token.sha256)
                    {
                        revoked.insert(token.sha256, Arc::clone(quota));
                    }
                }
                for token in &tokens.tokens {
                    revoked.remove(&token.sha256);
                }
                drop(revoked);
                let count = tokens.len();
                let mut current = self.current.write();
                tokens.set_generation(current.generation + 1);
                self.generation.store(tokens.generation, Ordering::Release);
                *current = Arc::new(tokens);
                drop(current);
                // After the swap: a stream woken rechecks against the new tokens.
                std::mem::take(&mut *self.changed.lock()).cancel();
                Ok(count)
            },
        )
    }

    /// The file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The caller of an `authorization` header value, by the tokens in force.
    ///
    /// # Errors
    /// What [`Tokens::authorize_header`] answers.
    pub(crate) fn authorize_header(&self, header: Option<&str>) -> Result<Caller, ServiceError> {
        self.current.read().authorize_header(header)
    }

    /// For a stream's next message: `caller` as the tokens in force now have it. Unchanged
    /// (one atomic load) unless the file changed since `caller` was authenticated; then its
    /// token's current line replaces it (new tenants and name; the stream keeps the place it
    /// took in the quota).
    ///
    /// # Errors
    /// UNAUTHENTICATED when the token is no longer in the file.
    pub(crate) fn recheck(&self, caller: &mut Caller) -> Result<(), ServiceError> {
        if self.generation.load(Ordering::Acquire) == caller.generation {
            return Ok(());
        }
        let current = self.current.read();
        match caller.token.and_then(|token| current.caller_of(&token)) {
            Some(now) => {
                *caller = now;
                Ok(())
            }
            None => Err(ServiceError::Unauthenticated(
                "the token of this stream was revoked (the server's token file changed): open \
                 a new stream with a valid token"
                    .into(),
            )),
        }
    }
}

/// A token file's text.
fn read_text(path: &Path) -> Result<String, TokenFileError> {
    crate::bounded_read::read_text_within(path, crate::bounded_read::MAX_TOKEN_FILE_BYTES).map_err(
        |source| TokenFileError::Read {
            path: path.display().to_string(),
            source,
        },
    )
}

/// `value` for an error message, unless it is as long as a token could be.
fn shown(value: &str) -> String {
    if value.len() < MIN_TOKEN_BYTES {
        format!("{value:?}")
    } else {
        format!("<{} bytes, not shown>", value.len())
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

impl Tokens {
    /// Reads a token file (format in the module docs).
    ///
    /// # Errors
    /// [`TokenFileError`] naming the file and line (never the token).
    pub fn from_file(path: &Path) -> Result<Self, TokenFileError> {
        Self::parse(&read_text(path)?, &path.display().to_string())
    }

    /// Parses a token file's text; `path` names it in errors.
    ///
    /// # Errors
    /// [`TokenFileError::Line`] or [`TokenFileError::Empty`].
    pub fn parse(text: &str, path: &str) -> Result<Self, TokenFileError> {
        let mut tokens = Vec::new();
        // Each token's line, by its hash.
        let mut lines = std::collections::HashMap::new();
        for (number, line) in text.lines().enumerate() {
            let line = without_comment(line).trim();
            if line.is_empty() {
                continue;
            }
            let bad = |why: String| TokenFileError::Line {
                path: path.to_owned(),
                line: number + 1,
                why,
            };
            let mut words = line.split_whitespace();
            let secret = words.next().unwrap_or_default();
            if let Some((field, _)) = secret.split_once('=')
                && ["tenants", "name", "max_requests"].contains(&field)
            {
                return Err(bad(format!(
                    "the line starts with the field {field}=; the token goes first on its line"
                )));
            }
            if secret.len() < MIN_TOKEN_BYTES {
                return Err(bad(format!(
                    "the token is {} bytes long; at least {MIN_TOKEN_BYTES} are required",
                    secret.len()
                )));
            }
            // An `authorization` header that is not visible ASCII is refused, so such a token
            // could never authenticate (a byte-order mark an editor put before the first one,
            // a pasted non-breaking space): refused here, with its line, not taken silently.
            if let Some(other) = secret.chars().find(|c| !c.is_ascii_graphic()) {
                return Err(bad(format!(
                    "the token holds {other:?} (U+{:04X}); a token is visible ASCII, as the \
                     authorization header that carries it must be (a byte-order mark at the \
                     file's start? save it as UTF-8 without one)",
                    u32::from(other)
                )));
            }
            let sha256 = sha256(secret.as_bytes());
            let mut caller = Caller {
                name: Arc::from(format!("line {}", number + 1)),
                tenants: None,
                quota: None,
                token: Some(sha256),
                generation: 0,
            };
            for (position, word) in words.enumerate() {
                match word.split_once('=') {
                    Some(("tenants", list)) => {
                        let tenants: BTreeSet<String> = list
                            .split(',')
                            .map(str::trim)
                            .filter(|t| !t.is_empty())
                            .map(str::to_owned)
                            .collect();
                        if tenants.is_empty() {
                            return Err(bad("tenants= lists no tenant".into()));
                        }
                        caller.tenants = Some(Arc::new(tenants));
                    }
                    Some(("name", "")) => return Err(bad("name= gives no label".into())),
                    Some(("name", label)) => caller.name = Arc::from(label),
                    Some(("max_requests", limit)) => match limit.parse::<usize>() {
                        Ok(limit) if limit > 0 => {
                            caller.quota = Some(Arc::new(RequestQuota::new(limit)));
                        }
                        _ => {
                            return Err(bad(format!(
                                "max_requests={} is not a number of requests of at least 1",
                                shown(limit)
                            )));
                        }
                    },
                    _ => {
                        // Not shown: a line with its words out of order (or two tokens on one
                        // line) has a token here.
                        return Err(bad(format!(
                            "word {} is an unknown field or a misplaced token (not shown; the \
                             token goes first on its line, then tenants=A,B, name=LABEL or \
                             max_requests=N)",
                            position + 2
                        )));
                    }
                }
            }
            if let Some(first) = lines.insert(sha256, number + 1) {
                return Err(bad(format!(
                    "the same token as line {first} (one line per token: which tenants and \
                     quota would it have?)"
                )));
            }
            tokens.push(Token { sha256, caller });
        }
        if tokens.is_empty() {
            return Err(TokenFileError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Self {
            tokens,
            generation: 0,
        })
    }

    /// Marks these tokens (and the callers they authenticate) as version `generation` of the
    /// file.
    fn set_generation(&mut self, generation: u64) {
        self.generation = generation;
        for token in &mut self.tokens {
            token.caller.generation = generation;
        }
    }

    /// The caller of the token whose SHA-256 is `token`, if it is one of these.
    fn caller_of(&self, token: &[u8; 32]) -> Option<Caller> {
        self.tokens
            .iter()
            .find(|t| t.sha256 == *token)
            .map(|t| t.caller.clone())
    }

    /// Gives every token without `max_requests=` a quota of `limit` requests at once (each
    /// token its own), or without a limit, an unbounded one: every token's requests in flight
    /// are counted, so that a reload that gives a token a limit counts those it holds already
    /// (without, a token holding 50 streams got a fresh quota of 2 and could open 2 more).
    #[must_use]
    pub fn with_default_quota(mut self, limit: Option<usize>) -> Self {
        for token in &mut self.tokens {
            token
                .caller
                .quota
                .get_or_insert_with(|| Arc::new(RequestQuota::new(limit.unwrap_or(usize::MAX))));
        }
        self
    }

    /// The tokens, each keeping the quota it has in `old` (and with it the count of its requests
    /// in flight, under its new limit) when `old` has the same token with a quota, or else the
    /// quota it had when it was `revoked`: a reload of the file does not give a token that
    /// holds its whole share a fresh one.
    #[must_use]
    fn keeping_quotas_of(
        mut self,
        old: &Tokens,
        revoked: &std::collections::HashMap<[u8; 32], Arc<RequestQuota>>,
    ) -> Self {
        let quotas: std::collections::HashMap<&[u8; 32], &Arc<RequestQuota>> = revoked
            .iter()
            .chain(
                old.tokens
                    .iter()
                    .filter_map(|o| o.caller.quota.as_ref().map(|q| (&o.sha256, q))),
            )
            .collect();
        for token in &mut self.tokens {
            let Some(limit) = token.caller.quota.as_ref().map(|q| q.limit()) else {
                continue;
            };
            if let Some(quota) = quotas.get(&token.sha256) {
                quota.limit.store(limit, Ordering::Relaxed);
                token.caller.quota = Some(Arc::clone(quota));
            }
        }
        self
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are none (never, for tokens read from a file).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The caller a bearer token authenticates, comparing against every token in constant time.
    pub fn authenticate(&self, presented: &str) -> Option<Caller> {
        let presented = sha256(presented.as_bytes());
        let mut found = None;
        for token in &self.tokens {
            if bool::from(token.sha256.ct_eq(&presented)) {
                found = Some(token.caller.clone());
            }
        }
        found
    }

    /// The caller of an `authorization` header value (`Bearer TOKEN`).
    ///
    /// # Errors
    /// UNAUTHENTICATED, saying whether the header is missing, malformed or the token unknown.
    pub fn authorize_header(&self, header: Option<&str>) -> Result<Caller, ServiceError> {
        let Some(header) = header else {
            return Err(ServiceError::Unauthenticated(
                "missing credentials: send the header `authorization: Bearer <token>`".into(),
            ));
        };
        // The scheme's name is case-insensitive (RFC 9110 §11.1).
        let token = header
            .get(..7)
            .filter(|scheme| scheme.eq_ignore_ascii_case("bearer "))
            .and_then(|_| header.get(7..))
            .ok_or_else(|| {
                ServiceError::Unauthenticated(
                    "the authorization header must be `Bearer <token>`".into(),
                )
            })?;
        self.authenticate(token.trim())
            .ok_or_else(|| ServiceError::Unauthenticated("unknown bearer token".into()))
    }
}

/// `line` up to its comment: a `#` at its start or after whitespace (one inside a token is part
/// of it: cutting the token there would store a prefix, which a caller who knew only the prefix
/// could use, and the whole token would be refused).
fn without_comment(line: &str) -> &str {
    let mut previous_is_space = true;
    for (at, c) in line.char_indices() {
        if c == '#' && previous_is_space {
            return &line[..at];
        }
        previous_is_space = c.is_whitespace();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_inside_a_token_is_part_of_it_and_the_scheme_is_case_insensitive() {
        let text = "0123456789abcdef#xyz name=hashed # a comment\n#0123456789abcdef-off\n";
        let tokens = Tokens::parse(text, "tokens").expect("parses");
        let caller = tokens
            .authenticate("0123456789abcdef#xyz")
            .expect("the whole token");
        assert_eq!(&*caller.name, "hashed");
        assert!(
            tokens.authenticate("0123456789abcdef").is_none(),
            "not its prefix"
        );
        assert!(
            tokens.authenticate("0123456789abcdef-off").is_none(),
            "a commented line"
        );
        for header in [
            "Bearer 0123456789abcdef#xyz",
            "BEARER 0123456789abcdef#xyz",
            "bearer  0123456789abcdef#xyz",
        ] {
            assert!(tokens.authorize_header(Some(header)).is_ok(), "{header}");
        }
        for header in ["Basic 0123456789abcdef#xyz", "Bearer", "Bearé 0123", ""] {
            assert!(tokens.authorize_header(Some(header)).is_err(), "{header}");
        }
    }

    const FILE: &str = "\
# comment
0123456789abcdef-admin               name=admin
0123456789abcdef-team   tenants=a,b  # a team's router
";

    #[test]
    fn tokens_authenticate_and_limit_tenants() {
        let tokens = Tokens::parse(FILE, "tokens").expect("parses");
        let admin = tokens
            .authenticate("0123456789abcdef-admin")
            .expect("admin token");
        assert_eq!(&*admin.name, "admin");
        assert!(admin.unrestricted() && admin.may_use("anything"));
        let team = tokens
            .authenticate("0123456789abcdef-team")
            .expect("team token");
        assert!(team.may_use("a") && team.may_use("b") && !team.may_use("c"));
        assert!(matches!(
            team.check("c"),
            Err(ServiceError::PermissionDenied(_))
        ));
        assert!(tokens.authenticate("0123456789abcdef-adm").is_none());
        assert!(tokens.authenticate("").is_none());
    }

    /// `max_requests=` gives a token its own quota; the server-wide default fills in only the
    /// tokens without one, each with a quota of its own; a quota's places are taken and given
    /// back.
    #[test]
    fn quotas_come_from_the_line_or_the_default() {
        let text =
            "0123456789abcdef-one max_requests=1\n0123456789abcdef-two\n0123456789abcdef-three\n";
        let bare = Tokens::parse(text, "t").expect("parses");
        assert!(
            bare.authenticate("0123456789abcdef-two")
                .expect("two")
                .quota
                .is_none()
        );
        let unlimited = Tokens::parse(text, "t")
            .expect("parses")
            .with_default_quota(None);
        let counted = unlimited
            .authenticate("0123456789abcdef-two")
            .and_then(|caller| caller.quota)
            .expect("counted without a limit");
        assert_eq!(counted.limit(), usize::MAX);
        let tokens = Tokens::parse(text, "t")
            .expect("parses")
            .with_default_quota(Some(5));
        let quota = |token: &str| {
            tokens
                .authenticate(token)
                .and_then(|caller| caller.quota)
                .expect("a quota")
        };
        assert_eq!(quota("0123456789abcdef-one").limit(), 1);
        assert_eq!(quota("0123456789abcdef-two").limit(), 5);
        assert!(!Arc::ptr_eq(
            &quota("0123456789abcdef-two"),
            &quota("0123456789abcdef-three")
        ));
        let one = quota("0123456789abcdef-one");
        assert!(one.take());
        assert!(
            !quota("0123456789abcdef-one").take(),
            "shared by the token's requests"
        );
        one.give_back();
        assert!(one.take());
    }

    /// A reload that gives a token without a limit `max_requests=2` counts the requests and
    /// streams it holds already: holding 3, it opens no more (it got a fresh quota and could
    /// open 2 more). So does one revoked and added again while its requests run.
    #[test]
    fn a_reload_that_limits_a_token_counts_what_it_holds() {
        let dir =
            std::env::temp_dir().join(format!("kvatlas-token-limited-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("tokens");
        let token = "limited-0123456789abcdef";
        std::fs::write(&path, format!("{token}\n")).expect("write");
        let file = TokenFile::load(&path, None).expect("loads");
        let caller = || {
            file.authorize_header(Some(&format!("Bearer {token}")))
                .expect("known")
        };
        let quota = caller().quota.expect("counted");
        for _ in 0..3 {
            assert!(quota.take(), "no limit yet");
        }
        std::fs::write(&path, format!("{token} max_requests=2\n")).expect("write");
        assert_eq!(file.reload().expect("reads"), Reread::Changed(1));
        let limited = caller().quota.expect("a quota");
        assert_eq!(limited.limit(), 2);
        assert!(!limited.take(), "3 held of 2: no place");
        for _ in 0..2 {
            quota.give_back();
        }
        assert!(limited.take(), "1 held of 2: a place");
        quota.give_back();

        // Revoked while it holds a place, then added again: its count comes back with it.
        let other = "other-0123456789abcdef";
        std::fs::write(&path, format!("{other}\n")).expect("write");
        assert_eq!(file.reload().expect("reads"), Reread::Changed(1));
        assert!(
            file.authorize_header(Some(&format!("Bearer {token}")))
                .is_err()
        );
        std::fs::write(&path, format!("{other}\n{token} max_requests=1\n")).expect("write");
        assert_eq!(file.reload().expect("reads"), Reread::Changed(2));
        let again = caller().quota.expect("a quota");
        assert!(
            !again.take(),
            "1 held of 1 since before the revocation: no place"
        );
        limited.give_back();
        assert!(again.take(), "given back: a place");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A token no `authorization` header can carry is refused with its line: a byte-order
    /// mark before the first (it was taken, and that client was refused for good, unaware).
    /// (A non-breaking space is whitespace: it splits the line, and the token is too short.)
    #[test]
    fn a_token_that_is_not_visible_ascii_is_refused() {
        for text in [
            "\u{feff}0123456789abcdef\n",
            "0123456789abcdef\n0123456789abcdéf\n",
        ] {
            let error = Tokens::parse(text, "t").expect_err("refused").to_string();
            assert!(error.contains("visible ASCII"), "{error}");
        }
        let error = Tokens::parse("0123456789abcdef\n0123456789abcdef\u{200b}\n", "t")
            .expect_err("a zero-width space pasted with it")
            .to_string();
        assert!(
            error.contains("line 2") && error.contains("U+200B"),
            "{error}"
        );
    }

    #[test]
    fn headers_must_be_bearer_tokens() {
        let tokens = Tokens::parse(FILE, "tokens").expect("parses");
        assert!(
            tokens
                .authorize_header(Some("Bearer 0123456789abcdef-admin"))
                .is_ok()
        );
        for header in [
            None,
            Some("Basic 0123456789abcdef-admin"),
            Some("Bearer nope"),
        ] {
            assert!(matches!(
                tokens.authorize_header(header),
                Err(ServiceError::Unauthenticated(_))
            ));
        }
    }

    #[test]
    fn a_clients_token_file_gives_its_first_token() {
        assert_eq!(token_of_file("0123456789abcdef\n"), "0123456789abcdef");
        assert_eq!(
            token_of_file("# kvatlas tokens\n\n  abc#def0123456789 tenants=a # the router\nx\n"),
            "abc#def0123456789",
            "a copy of a server's token file sends its first token"
        );
        assert_eq!(token_of_file("# only a comment\n\n"), "");
    }

    #[test]
    fn bad_files_are_refused_without_echoing_tokens() {
        for (text, needle) in [
            ("short", "at least 16"),
            ("0123456789abcdef tenants=", "no tenant"),
            ("0123456789abcdef role=admin", "word 2 is an unknown field"),
            ("0123456789abcdef max_requests=0", "at least 1"),
            ("0123456789abcdef max_requests=many", "at least 1"),
            (
                "0123456789abcdef max_requests=0123456789abcdef",
                "at least 1",
            ),
            ("# nothing\n", "holds no token"),
            // Words out of order: the token is where a field was expected.
            ("tenants=a,b 0123456789abcdef", "token goes first"),
            ("name=abc 0123456789abcdef=", "token goes first"),
            ("0123456789abcdef= 0123456789abcdef", "token goes first"),
            (
                "0123456789abcdef\n0123456789abcdef tenants=a",
                "same token as line 1",
            ),
        ] {
            let error = Tokens::parse(text, "f").expect_err(text).to_string();
            assert!(error.contains(needle), "{text}: {error}");
            assert!(!error.contains("0123456789abcdef"), "{error}");
        }
    }

    #[test]
    fn a_reload_swaps_the_tokens_and_keeps_the_quotas_of_unchanged_ones() {
        let dir = std::env::temp_dir().join(format!("kvatlas-token-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("tokens");
        let (kept, resized, gone, added) = (
            "kept-0123456789abcdef",
            "resized-0123456789abcdef",
            "gone-0123456789abcdef",
            "added-0123456789abcdef",
        );
        std::fs::write(
            &path,
            format!("{kept} name=kept\n{resized} max_requests=2\n{gone} tenants=a\n"),
        )
        .expect("write");
        let file = TokenFile::load(&path, Some(4)).expect("loads");
        let bearer = |token: &str| format!("Bearer {token}");
        let caller = |token: &str| file.authorize_header(Some(&bearer(token)));
        let kept_quota = caller(kept).expect("kept").quota.expect("default quota");
        assert!(kept_quota.take(), "one of its requests in flight");
        let resized_quota = caller(resized).expect("resized").quota.expect("quota");
        assert_eq!(file.reload().expect("reads"), Reread::Same, "unchanged");

        std::fs::write(
            &path,
            format!("{kept} name=kept\n{resized} max_requests=3\n{added}\n"),
        )
        .expect("write");
        assert_eq!(file.reload().expect("reads"), Reread::Changed(3));
        let now = caller(kept).expect("kept").quota.expect("quota");
        assert!(
            Arc::ptr_eq(&now, &kept_quota),
            "the same quota, its request still counted"
        );
        let now = caller(resized).expect("resized").quota.expect("quota");
        assert!(Arc::ptr_eq(&now, &resized_quota), "the same quota");
        assert_eq!(now.limit(), 3, "under its new limit");
        assert!(caller(gone).is_err(), "revoked");
        assert!(caller(added).expect("added").may_use("b"), "every tenant");

        // A line that is not valid: refused, the tokens in force stay.
        std::fs::write(&path, format!("{kept}\n{added} tenants=\n")).expect("write");
        let refused = file.reload().expect_err("invalid").to_string();
        assert!(refused.contains("line 2"), "{refused}");
        assert!(caller(added).is_ok() && caller(resized).is_ok());
        // A file that cannot be read: the same.
        std::fs::remove_file(&path).expect("remove");
        assert!(matches!(file.reload(), Err(TokenFileError::Read { .. })));
        assert!(caller(kept).is_ok());
        let _ = std::fs::remove_dir_all(dir);
    }
}
