//! The HTTP side: `/health` (liveness: 200 while the process serves), `/ready` (200 once the
//! startup gate is open, 503 with the reason before and during shutdown), `/metrics`
//! (Prometheus; with authentication on, it needs a token allowed every tenant, because its labels
//! name every index), `/snapshot` (the native snapshot stream, same token rule), and Dynamo's
//! standalone-indexer API (`dynamo`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State as AxumState};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};

use crate::dynamo;
use crate::error::ServiceError;
use crate::state::{HandedPlace, State};

/// The HTTP routes. Every route but `/health`, `/ready` and `/metrics` (which must answer
/// under overload) is authenticated first (`authenticate_and_admit`) and counts against
/// `--max-concurrent-requests` with the gRPC requests, until its response body is sent.
pub(crate) fn router(state: Arc<State>) -> Router {
    let limited = Router::new()
        .route("/snapshot", get(snapshot))
        .route("/register", post(dynamo::register))
        .route("/unregister", post(dynamo::unregister))
        .route("/workers", get(dynamo::workers))
        .route(
            "/query",
            post(dynamo::query).layer(DefaultBodyLimit::max(dynamo::QUERY_BODY_LIMIT)),
        )
        .route(
            "/query_by_hash",
            post(dynamo::query_by_hash).layer(DefaultBodyLimit::max(dynamo::QUERY_BODY_LIMIT)),
        )
        .route("/dump", get(dynamo::dump_route))
        .route("/register_peer", post(dynamo::register_peer))
        .route("/deregister_peer", post(dynamo::deregister_peer))
        .route("/peers", get(dynamo::peers))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            authenticate_and_admit,
        ));
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .merge(limited)
        .layer(DefaultBodyLimit::max(dynamo::BODY_LIMIT))
        .with_state(state)
}

/// The routes `router` limits, by path (for the metrics' `route` label).
const LIMITED_ROUTES: [&str; 10] = [
    "/snapshot",
    "/register",
    "/unregister",
    "/workers",
    "/query",
    "/query_by_hash",
    "/dump",
    "/register_peer",
    "/deregister_peer",
    "/peers",
];

/// The routes whose answer is written by a task of its own (the whole-state reads): their
/// request's place is handed to the route (`HandedPlace`), which gives it to that task, so a
/// reader that stalls loses it with the stall timeout (`snapshot_stream`) rather than holding
/// it, and its token's, for as long as its connection lives.
const HANDED_ROUTES: [&str; 2] = ["/snapshot", "/dump"];

/// Authenticates a request before anything else looks at it (an unauthenticated caller gets
/// 401, whatever its body: it learns nothing of what the server accepts), then admits it
/// within `--max-concurrent-requests` and holds its place until its response body is dropped
/// (sent, or the client went away) — or hands it to the route (`HANDED_ROUTES`); beyond the
/// limit, 429 with the reason. Every answer, refusals included, is counted in
/// `kvatlas_http_requests_total` under the route and its status (the routes do not count their
/// own). Whether the caller may use the tenant it names is the route's to check.
async fn authenticate_and_admit(
    AxumState(state): AxumState<Arc<State>>,
    request: Request,
    next: Next,
) -> Response {
    let route = LIMITED_ROUTES
        .into_iter()
        .find(|route| *route == request.uri().path());
    let count = |status: u16| {
        if let Some(route) = route {
            state.metrics.http(route, status);
        }
    };
    let refuse = |error: ServiceError| {
        count(error.http_status());
        dynamo::service_error(&error)
    };
    let caller = match state.authenticate(request.headers().get(header::AUTHORIZATION)) {
        Ok(caller) => caller,
        Err(error) => return refuse(error),
    };
    let permit = match state.admit_request(&caller) {
        Ok(permit) => permit,
        Err(error) => return refuse(error),
    };
    // The place is held from here: a body that stalls fails, and gives it back.
    let stall = state.limits.stall_timeout;
    let mut request = request.map(|body| {
        Body::new(crate::stalled_body::StallLimited::new(
            body,
            stall,
            |timeout| crate::stalled_body::stalled_message(timeout).into(),
        ))
    });
    if HANDED_ROUTES.contains(&request.uri().path()) {
        request.extensions_mut().insert(HandedPlace::new(permit));
        let response = next.run(request).await;
        count(response.status().as_u16());
        return response;
    }
    let response = next.run(request).await;
    count(response.status().as_u16());
    response.map(|body| {
        Body::new(HeldBody {
            body,
            _permit: permit,
        })
    })
}

/// A response body that holds its request's place until it is dropped. It reports the inner
/// body's size, so a response of known length keeps its `content-length` (a wrapper that
/// hid it would turn every answer into a chunked one).
struct HeldBody {
    body: Body,
    _permit: crate::state::Permit,
}

impl axum::body::HttpBody for HeldBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A plain-text error response.
pub(crate) fn error_response(error: &ServiceError) -> Response {
    let code =
        StatusCode::from_u16(error.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, format!("{error}\n")).into_response()
}

async fn health(AxumState(state): AxumState<Arc<State>>) -> Response {
    state.metrics.http("/health", 200);
    StatusCode::OK.into_response()
}

async fn ready(AxumState(state): AxumState<Arc<State>>) -> Response {
    match state.check_ready() {
        Ok(()) => {
            state.metrics.http("/ready", 200);
            (StatusCode::OK, "ready\n").into_response()
        }
        Err(error) => {
            state.metrics.http("/ready", 503);
            error_response(&error)
        }
    }
}

/// An unrestricted caller (every tenant), or the 401/403 response.
fn unrestricted(
    state: &State,
    headers: &HeaderMap,
    route: &'static str,
) -> Result<(), Box<Response>> {
    let allowed = state
        .authenticate(headers.get(header::AUTHORIZATION))
        .and_then(|caller| {
            if caller.unrestricted() {
                Ok(())
            } else {
                Err(ServiceError::PermissionDenied(format!(
                    "the token {:?} is limited to some tenants; {route} covers every index, so it \
                 needs a token allowed every tenant",
                    caller.name
                )))
            }
        });
    allowed.map_err(|error| {
        // A route behind `authenticate_and_admit` is counted there.
        if !LIMITED_ROUTES.contains(&route) {
            state.metrics.http(route, error.http_status());
        }
        Box::new(error_response(&error))
    })
}

/// The native snapshot of every index, streamed (`application/octet-stream`).
async fn snapshot(
    AxumState(state): AxumState<Arc<State>>,
    Extension(place): Extension<HandedPlace>,
    headers: HeaderMap,
) -> Response {
    if let Err(response) = unrestricted(&state, &headers, "/snapshot") {
        return *response;
    }
    let held = match state.admit_dump("/snapshot", place.take()) {
        Ok(held) => held,
        Err(error) => return error_response(&error),
    };
    let chunks = crate::snapshot_stream::stream(
        Arc::clone(&state.registry),
        held,
        state.limits.stall_timeout,
    );
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(chunks),
    )
        .into_response()
}

async fn metrics(AxumState(state): AxumState<Arc<State>>, headers: HeaderMap) -> Response {
    if let Err(response) = unrestricted(&state, &headers, "/metrics") {
        return *response;
    }
    let ready = state.ready();
    let registry = Arc::clone(&state.registry);
    let state_for_render = Arc::clone(&state);
    // Index statistics take each index's writer side briefly: off the async workers.
    let rendered =
        tokio::task::spawn_blocking(move || state_for_render.metrics.render(&registry, ready))
            .await;
    // A render that failed is a failed scrape (500), not a successful one of no series (a 200
    // with a comment had Prometheus keep `up` at 1 and every series go stale).
    let body = match rendered {
        Ok(body) => body,
        Err(error) => {
            state.metrics.http("/metrics", 500);
            tracing::error!("rendering /metrics failed: {error}");
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("rendering the metrics failed: {error}\n"),
            )
                .into_response();
        }
    };
    state.metrics.http("/metrics", 200);
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}
