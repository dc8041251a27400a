//! [`Client`]: a typed `kvatlas.v1.Indexer` client for router frontends, hashing prompts locally.
//!
//! [`Client::query`] learns an index's block size once (`ListIndexes`), cuts the prompt into
//! blocks and hashes them with [`kvatlas_hash::BlockHasher`] (LoRA name and cache salt mixed in
//! exactly as the server and the engines' events do), and sends the local hashes. Every answer
//! carries the index's block size; if it ever differs from the one the prompt was hashed with,
//! the client learns the new size and asks again, once.
//!
//! [`Client::raw`] gives the generated stub for every other RPC.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvatlas_hash::{BlockHasher, BlockSize, LocalBlockHash};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::v1::indexer_client::IndexerClient;
use crate::v1::{
    IndexSelector, ListIndexesRequest, LocalHashes, QueryOptions, QueryRequest, QueryResponse,
    query_request,
};

/// At most this many (block size, LoRA, salt) hashers are cached; the cache is emptied when
/// full (a router uses a handful).
const MAX_CACHED_HASHERS: usize = 64;

/// At most this many indexes' block sizes are remembered; the memory is emptied when full.
const MAX_REMEMBERED_INDEXES: usize = 4096;

/// An idle connection is pinged this often (HTTP/2 PING; TCP keepalive at the same period)...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// ...and closed if the ping is not answered within this: a server host that vanished (lost
/// power, a partition) is found within a minute, and the next call connects again, instead of
/// calls waiting for TCP's retransmission timeout (about 15 minutes).
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// The generated stub with the client's authentication.
pub type RawClient = IndexerClient<InterceptedService<Channel, BearerToken>>;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server address is not a valid URI.
    #[error("invalid server address {address:?}: {source}")]
    InvalidAddress {
        /// The address as given.
        address: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The connection could not be made.
    #[error("cannot connect to {address}: {source}")]
    Connect {
        /// The address.
        address: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The bearer token cannot be sent as an HTTP/2 header value.
    #[error("the bearer token contains characters not allowed in a header")]
    InvalidToken,
    /// TLS could not be configured.
    #[error("TLS setup: {0}")]
    Tls(#[source] tonic::transport::Error),
    /// The server answered with an error status.
    #[error("the server answered {}: {}", code_name(.0.code()), .0.message())]
    Status(#[from] tonic::Status),
    /// The index named does not exist on the server.
    #[error("no index for model {model:?} tenant {tenant:?} on the server")]
    UnknownIndex {
        /// The model.
        model: String,
        /// The tenant.
        tenant: String,
    },
    /// The server reported a block size kvatlas-hash cannot cut prompts into.
    #[error("the server reports block size {0}, which is not usable")]
    BadBlockSize(u32),
    /// The index's block size changed again while a query was asked again with the new one
    /// (the index is being recreated): retry later.
    #[error(
        "the block size of model {model:?} tenant {tenant:?} changed twice during one query \
         (the index is being recreated); retry"
    )]
    BlockSizeUnsettled {
        /// The model.
        model: String,
        /// The tenant.
        tenant: String,
    },
}

/// The canonical name of a gRPC status code (`NOT_FOUND`, `INVALID_ARGUMENT`, ...).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

impl ClientError {
    /// The gRPC status, if the server answered with one.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            ClientError::Status(status) => Some(status),
            _ => None,
        }
    }
}

/// Adds `authorization: Bearer <token>` to every call (nothing without a token). Its `Debug`
/// never shows the token.
#[derive(Clone, Default)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("BearerToken")
            .field(&self.0.as_ref().map(|_| "…"))
            .finish()
    }
}

impl BearerToken {
    /// A token to send, or none.
    ///
    /// # Errors
    /// [`ClientError::InvalidToken`] if the token cannot be a header value.
    pub fn new(token: Option<&str>) -> Result<Self, ClientError> {
        token
            .map(|t| {
                let mut value: MetadataValue<Ascii> = format!("Bearer {}", t.trim())
                    .parse()
                    .map_err(|_| ClientError::InvalidToken)?;
                // Left out of HTTP/2's header compression tables and of debug output.
                value.set_sensitive(true);
                Ok(value)
            })
            .transpose()
            .map(Self)
    }
}

impl Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// How to connect. Its `Debug` never shows the token.
#[derive(Clone, Default)]
pub struct ConnectOptions {
    /// A bearer token sent with every call.
    pub token: Option<String>,
    /// A timeout for every call, and for connecting (at the start and when the client
    /// connects again); none by default. Without it, a call on a connection to a server host
    /// that vanished fails once the keepalive (a ping every 30 s, answered within 20 s) finds
    /// the connection dead.
    pub timeout: Option<Duration>,
    /// A PEM CA certificate to trust for `https://` addresses (the system roots are not used).
    #[cfg(feature = "tls")]
    pub ca_certificate_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("ConnectOptions");
        out.field("token", &self.token.as_ref().map(|_| "…"))
            .field("timeout", &self.timeout);
        #[cfg(feature = "tls")]
        out.field(
            "ca_certificate_pem",
            &self.ca_certificate_pem.as_ref().map(Vec::len),
        );
        out.finish()
    }
}

/// A prompt to score: the index it belongs to and its tokens.
#[derive(Debug, Clone, Copy)]
pub struct Prompt<'a> {
    /// The model.
    pub model: &'a str,
    /// The tenant (empty = "default").
    pub tenant: &'a str,
    /// The token ids.
    pub tokens: &'a [u32],
    /// The LoRA adapter (empty = none).
    pub lora_name: &'a str,
    /// The cache salt (empty = none).
    pub cache_salt: &'a str,
}

impl<'a> Prompt<'a> {
    /// A prompt of the default tenant, without LoRA or salt.
    pub fn new(model: &'a str, tokens: &'a [u32]) -> Self {
        Self {
            model,
            tenant: "",
            tokens,
            lora_name: "",
            cache_salt: "",
        }
    }

    /// The same prompt in `tenant`.
    #[must_use]
    pub fn tenant(self, tenant: &'a str) -> Self {
        Self { tenant, ..self }
    }

    /// The same prompt with a LoRA adapter.
    #[must_use]
    pub fn lora_name(self, lora_name: &'a str) -> Self {
        Self { lora_name, ..self }
    }

    /// The same prompt with a cache salt.
    #[must_use]
    pub fn cache_salt(self, cache_salt: &'a str) -> Self {
        Self { cache_salt, ..self }
    }

    fn tenant_or_default(&self) -> &'a str {
        if self.tenant.is_empty() {
            "default"
        } else {
            self.tenant
        }
    }
}

/// A typed client (see the module docs). Cheap to clone: clones share the connection and the
/// block sizes learned (a router that clones the client per call asks `ListIndexes` once per
/// index, not once per clone); each keeps its own hashers.
#[derive(Debug, Clone)]
pub struct Client {
    raw: RawClient,
    block_sizes: Arc<Mutex<HashMap<(String, String), BlockSize>>>,
    hashers: HashMap<(BlockSize, String, String), BlockHasher>,
}

impl Client {
    /// Connects to `address` (`http://host:port`, or `https://` with the `tls` feature).
    ///
    /// # Errors
    /// [`ClientError::InvalidAddress`] or [`ClientError::Connect`].
    pub async fn connect(address: &str) -> Result<Self, ClientError> {
        Self::connect_with(address, &ConnectOptions::default()).await
    }

    /// Connects with options (a bearer token, a timeout, a CA certificate).
    ///
    /// # Errors
    /// [`ClientError::InvalidAddress`], [`ClientError::InvalidToken`], [`ClientError::Tls`] or
    /// [`ClientError::Connect`].
    pub async fn connect_with(
        address: &str,
        options: &ConnectOptions,
    ) -> Result<Self, ClientError> {
        let mut endpoint = Endpoint::from_shared(address.to_owned())
            .map_err(|source| ClientError::InvalidAddress {
                address: address.to_owned(),
                source,
            })?
            .tcp_nodelay(true)
            .tcp_keepalive(Some(KEEPALIVE_INTERVAL))
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        if let Some(timeout) = options.timeout {
            endpoint = endpoint.timeout(timeout).connect_timeout(timeout);
        }
        #[cfg(feature = "tls")]
        if let Some(ca) = &options.ca_certificate_pem {
            let tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca));
            endpoint = endpoint.tls_config(tls).map_err(ClientError::Tls)?;
        }
        let token = BearerToken::new(options.token.as_deref())?;
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| ClientError::Connect {
                address: address.to_owned(),
                source,
            })?;
        Ok(Self::from_channel(channel, token))
    }

    /// A client over an existing channel.
    pub fn from_channel(channel: Channel, token: BearerToken) -> Self {
        Self {
            raw: IndexerClient::with_interceptor(channel, token)
                .max_decoding_message_size(64 << 20),
            block_sizes: Arc::default(),
            hashers: HashMap::new(),
        }
    }

    /// The generated stub, for every RPC.
    pub fn raw(&mut self) -> &mut RawClient {
        &mut self.raw
    }

    /// The block size of an index (asked once, then remembered).
    ///
    /// # Errors
    /// [`ClientError::UnknownIndex`], [`ClientError::BadBlockSize`] or the server's status.
    pub async fn block_size(
        &mut self,
        model: &str,
        tenant: &str,
    ) -> Result<BlockSize, ClientError> {
        let tenant = if tenant.is_empty() { "default" } else { tenant };
        let key = (model.to_owned(), tenant.to_owned());
        if let Some(size) = self.remembered(&key) {
            return Ok(size);
        }
        let listed = self
            .raw
            .list_indexes(ListIndexesRequest {
                model: model.to_owned(),
                tenant: tenant.to_owned(),
            })
            .await?
            .into_inner();
        let info = listed
            .indexes
            .into_iter()
            .find(|i| {
                i.index
                    .as_ref()
                    .is_some_and(|s| s.model == model && s.tenant == tenant)
            })
            .ok_or_else(|| ClientError::UnknownIndex {
                model: model.to_owned(),
                tenant: tenant.to_owned(),
            })?;
        let size = BlockSize::new(info.block_size)
            .map_err(|_| ClientError::BadBlockSize(info.block_size))?;
        self.remember(key, size);
        Ok(size)
    }

    /// The block size learned for (model, tenant), by this client or a clone.
    fn remembered(&self, key: &(String, String)) -> Option<BlockSize> {
        // A panic elsewhere while the map was held leaves it whole (inserts and clears only).
        let sizes = self
            .block_sizes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        sizes.get(key).copied()
    }

    /// Forgets the block size learned for (model, tenant).
    fn forget(&self, key: &(String, String)) {
        self.block_sizes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }

    fn remember(&self, key: (String, String), size: BlockSize) {
        let mut sizes = self
            .block_sizes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if sizes.len() >= MAX_REMEMBERED_INDEXES && !sizes.contains_key(&key) {
            sizes.clear();
        }
        sizes.insert(key, size);
    }

    /// Hashes `prompt` locally and asks which worker ranks hold how much of it. If the index's
    /// block size changed since it was learned (an answer names another size, or the server
    /// refuses the prompt as INVALID_ARGUMENT and `ListIndexes` now names another size), the
    /// prompt is hashed again at the new size and asked again.
    ///
    /// # Errors
    /// The server's status (NOT_FOUND for an unknown index, ...), or the errors of
    /// [`Client::block_size`].
    pub async fn query(
        &mut self,
        prompt: &Prompt<'_>,
        options: QueryOptions,
    ) -> Result<QueryResponse, ClientError> {
        let mut size = self.block_size(prompt.model, prompt.tenant).await?;
        let key = (
            prompt.model.to_owned(),
            prompt.tenant_or_default().to_owned(),
        );
        let mut asked_again = false;
        // At most two retries: the index's block size changed since it was learned (a server
        // restarted without its state, a replica of another configuration), found by an answer
        // naming another size, or by a refusal that the size asked again explains.
        for _ in 0..3 {
            let hashes = self.local_hashes(size, prompt);
            let request = QueryRequest {
                index: Some(IndexSelector {
                    model: prompt.model.to_owned(),
                    tenant: prompt.tenant_or_default().to_owned(),
                }),
                input: Some(query_request::Input::LocalHashes(LocalHashes {
                    hashes: hashes.into_iter().map(LocalBlockHash::get).collect(),
                })),
                options: Some(options.clone()),
                ..QueryRequest::default()
            };
            let response = match self.raw.query(request).await {
                Ok(response) => response.into_inner(),
                // Hashed at a stale, smaller block size, a long prompt is too many blocks for
                // the server's token limit, and refused before any answer names the size: it
                // is asked again, once (otherwise every such prompt kept failing).
                Err(status) if status.code() == tonic::Code::InvalidArgument && !asked_again => {
                    asked_again = true;
                    self.forget(&key);
                    let fresh = self.block_size(prompt.model, prompt.tenant).await?;
                    if fresh == size {
                        return Err(status.into());
                    }
                    size = fresh;
                    continue;
                }
                Err(status) => return Err(status.into()),
            };
            if response.block_size == size.get() {
                return Ok(response);
            }
            size = BlockSize::new(response.block_size)
                .map_err(|_| ClientError::BadBlockSize(response.block_size))?;
            self.remember(key.clone(), size);
        }
        Err(ClientError::BlockSizeUnsettled {
            model: prompt.model.to_owned(),
            tenant: prompt.tenant_or_default().to_owned(),
        })
    }

    /// The local hashes of `prompt`'s full blocks for `size`.
    pub fn local_hashes(&mut self, size: BlockSize, prompt: &Prompt<'_>) -> Vec<LocalBlockHash> {
        if self.hashers.len() >= MAX_CACHED_HASHERS {
            self.hashers.clear();
        }
        let hasher = self
            .hashers
            .entry((
                size,
                prompt.lora_name.to_owned(),
                prompt.cache_salt.to_owned(),
            ))
            .or_insert_with(|| {
                BlockHasher::with_block_size(size)
                    .with_lora_name(prompt.lora_name)
                    .with_cache_salt(prompt.cache_salt)
            });
        hasher.local_hashes(prompt.tokens).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_the_token() {
        let token = "secret-0123456789abcdef";
        let bearer = BearerToken::new(Some(token)).expect("a header value");
        let options = ConnectOptions {
            token: Some(token.to_owned()),
            ..ConnectOptions::default()
        };
        for shown in [format!("{bearer:?}"), format!("{options:?}")] {
            assert!(!shown.contains("secret"), "{shown}");
            assert!(shown.contains('…'), "says a token is set: {shown}");
        }
    }
}
