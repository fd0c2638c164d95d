//! The router: endpoints, the API key check, the request log, and the JSON body extractor that
//! turns every malformed body into an OpenAI error object.
//!
//! Handlers reach the engine through [`crate::state::Engine`] rather than the engine's handle
//! itself, so that the unit tests below can run the whole HTTP stack against a scripted engine,
//! with no model.

use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::body::{parse_json, Body};
use crate::error::ApiError;
use crate::metrics;
pub use crate::state::{AppState, Engine, Options, Shared};

pub fn router(state: Shared) -> Router {
    Router::new()
        // llama-server answers each of these with and without the /v1 prefix
        .route("/v1/chat/completions", post(generate::chat))
        .route("/chat/completions", post(generate::chat))
        .route("/v1/completions", post(generate::completions))
        // without /v1, llama-server's own shape, as /completion
        .route("/completions", post(generate::llama_completion))
        .route("/completion", post(generate::llama_completion))
        .route("/infill", post(generate::infill))
        .route("/v1/models", get(info::models))
        .route("/models", get(info::models))
        .route("/health", get(info::health))
        .route("/v1/health", get(info::health))
        .route("/metrics", get(metrics_text))
        .route("/props", get(info::props))
        .route("/slots", get(info::slots))
        .route("/slots/{id}", post(slots::action))
        .route("/apply-template", post(info::apply_template))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route("/", get(info::webui))
        .fallback(not_found)
        // after the routes: it applies to those registered so far
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .layer(DefaultBodyLimit::max(state.options.max_body))
        .layer(middleware::from_fn(cors))
        .layer(middleware::from_fn(crate::log::log_requests))
        .with_state(state)
}

/// Serves `app` on `listener` until `stop` resolves, then waits for the open connections to
/// end. Each connection is hyper's HTTP/1 with Title-Case header names on the wire
/// (`Access-Control-Allow-Origin`), as llama-server writes them: header names are
/// case-insensitive, but some clients compare them as written.
///
/// # Errors
/// The listener failed in a way that is not one connection's (out of file descriptors is
/// waited out, not returned).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.title_case_headers(true);
    tokio::pin!(stop);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // a connection that failed before it was accepted, or no descriptors left:
                // neither stops the server
                Err(e) if is_connection_error(&e) => continue,
                Err(e) if e.raw_os_error() == Some(24) => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
                Err(e) => return Err(e),
            },
            () = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let io = hyper_util::rt::TokioIo::new(stream);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let connection = graceful.watch(http1.serve_connection(io, service));
        tokio::spawn(async move {
            // a client that goes away mid-answer is not the server's error
            let _ = connection.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

// ---- CORS ---------------------------------------------------------------------------------------

/// Browsers' cross-origin requests, as llama-server allows them: any origin, and a preflight
/// `OPTIONS` answered 200 (before the key check: a preflight carries no credentials).
async fn cors(req: Request, next: Next) -> Response {
    let origin = req.headers().get(header::ORIGIN).cloned();
    let mut response = if req.method() == Method::OPTIONS {
        StatusCode::OK.into_response()
    } else {
        next.run(req).await
    };
    let h = response.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_ORIGIN,
        origin.unwrap_or_else(|| HeaderValue::from_static("*")),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
        HeaderValue::from_static("true"),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST"),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("*"),
    );
    response
}

// ---- API key ------------------------------------------------------------------------------------

/// Endpoints that answer without a key, as llama-server's: health checks come from load
/// balancers, and the model list and the page from anyone who may then log in.
const PUBLIC: &[&str] = &["/health", "/v1/health", "/models", "/v1/models", "/"];

async fn require_api_key(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let Some(key) = &state.options.api_key else {
        return next.run(req).await;
    };
    if PUBLIC.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    // `Authorization: Bearer KEY`, or llama-server's other header, `X-Api-Key: KEY`
    let headers = req.headers();
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    match given {
        Some(k) if constant_time_eq(k.as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => ApiError::unauthorized(
            "Invalid API Key: send the key the server was started with (--api-key)",
        )
        .into_response(),
        None => ApiError::unauthorized(
            "Invalid API Key: this server needs one, in the header `Authorization: Bearer KEY` \
             or `X-Api-Key: KEY`",
        )
        .into_response(),
    }
}

/// Compares without stopping at the first difference, so response times do not leak the key.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---- JSON bodies --------------------------------------------------------------------------------

/// A JSON body whose every failure is an OpenAI error object: too large (413), not UTF-8,
/// malformed, or a field missing or of the wrong type (400, naming the field).
///
/// The content type is not checked: `curl -d` sends `application/x-www-form-urlencoded`, and
/// llama-server takes JSON whatever the header says.
pub struct ApiJson<T>(pub T);

impl<T: Body> FromRequest<Shared> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Shared) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(state.options.max_body)
            } else {
                ApiError::invalid(
                    None,
                    format!("cannot read the request body: {}", r.body_text()),
                )
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

async fn metrics_text(State(state): State<Shared>) -> Response {
    let body = metrics::render(
        state.engine.metrics(),
        state.engine.info(),
        state.rejected_queue_full.load(Ordering::Relaxed),
    );
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], body).into_response()
}

async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!(
        "no endpoint {method} {}: this server has POST /v1/chat/completions, POST /v1/completions, \
         POST /completion, POST /infill, POST /tokenize, POST /detokenize, POST /apply-template, GET /v1/models, \
         GET /health, GET /metrics, GET /props and GET /slots",
        uri.path()
    ))
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::method_not_allowed(format!("{} does not take {method}", uri.path()))
}

mod generate;
mod info;
mod slots;
mod tokens;

#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod tests;
