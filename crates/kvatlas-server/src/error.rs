//! [`ServiceError`]: why a request failed, one variant per answer a client gets.
//!
//! Every message is written for a person: it names the field or the index, the value, and what
//! would be accepted. The gRPC layer maps the variants to status codes in one place
//! (`grpc::status`); the HTTP layer to HTTP codes.

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// A field is missing, malformed or out of range (gRPC INVALID_ARGUMENT, HTTP 400).
    #[error("{0}")]
    InvalidArgument(String),
    /// No such index or worker (NOT_FOUND, 404).
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the state: a block-size mismatch, a rank fed by another source
    /// (FAILED_PRECONDITION, 409).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A different registration of the same worker rank exists (ALREADY_EXISTS, 409).
    #[error("{0}")]
    AlreadyExists(String),
    /// A limit was hit or the server is shedding load (RESOURCE_EXHAUSTED, 429).
    #[error("{0}")]
    ResourceExhausted(String),
    /// Not ready yet, or shutting down (UNAVAILABLE, 503).
    #[error("{0}")]
    Unavailable(String),
    /// No or an unknown credential (UNAUTHENTICATED, 401).
    #[error("{0}")]
    Unauthenticated(String),
    /// The credential is not allowed this tenant or operation (PERMISSION_DENIED, 403).
    #[error("{0}")]
    PermissionDenied(String),
    /// Something failed inside the server (INTERNAL, 500).
    #[error("{0}")]
    Internal(String),
}

impl ServiceError {
    /// The same error (the same answer code) with its message rewritten by `f`.
    pub(crate) fn with_message(self, f: impl FnOnce(String) -> String) -> Self {
        match self {
            ServiceError::InvalidArgument(m) => ServiceError::InvalidArgument(f(m)),
            ServiceError::NotFound(m) => ServiceError::NotFound(f(m)),
            ServiceError::FailedPrecondition(m) => ServiceError::FailedPrecondition(f(m)),
            ServiceError::AlreadyExists(m) => ServiceError::AlreadyExists(f(m)),
            ServiceError::ResourceExhausted(m) => ServiceError::ResourceExhausted(f(m)),
            ServiceError::Unavailable(m) => ServiceError::Unavailable(f(m)),
            ServiceError::Unauthenticated(m) => ServiceError::Unauthenticated(f(m)),
            ServiceError::PermissionDenied(m) => ServiceError::PermissionDenied(f(m)),
            ServiceError::Internal(m) => ServiceError::Internal(f(m)),
        }
    }

    /// The HTTP status code of the error.
    pub fn http_status(&self) -> u16 {
        match self {
            ServiceError::InvalidArgument(_) => 400,
            ServiceError::Unauthenticated(_) => 401,
            ServiceError::PermissionDenied(_) => 403,
            ServiceError::NotFound(_) => 404,
            ServiceError::FailedPrecondition(_) | ServiceError::AlreadyExists(_) => 409,
            ServiceError::ResourceExhausted(_) => 429,
            ServiceError::Internal(_) => 500,
            ServiceError::Unavailable(_) => 503,
        }
    }
}
