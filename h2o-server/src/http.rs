//! The router: endpoints, the API key check, the request log, and the JSON body extractor that
//! turns every malformed body into an OpenAI error object.
//!
//! Handlers reach the engine through the [`Engine`] trait rather than [`EngineHandle`] itself, so
//! that the unit tests below can run the whole HTTP stack against a scripted engine, with no
//! model.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use h2o_llama::{ChatMessage, Token};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{
    EngineHandle, EngineInfo, Event, Job, JobError, Metrics, SlotOp, SlotOpDone, SlotOpError,
    SlotView, SubmitError,
};
use crate::error::ApiError;
use crate::metrics;
use crate::openai::Body;
use crate::response::Spell;

/// A slot operation's answer, boxed so that [`Engine`] stays a trait object.
pub type SlotOpFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<SlotOpDone, SlotOpError>> + Send + 'a>,
>;

/// What the HTTP layer needs of the engine.
pub trait Engine: Send + Sync + 'static {
    /// # Errors
    /// As [`EngineHandle::submit`].
    fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, SubmitError>;
    fn info(&self) -> &EngineInfo;
    /// The Jinja chat templates (`--jinja`, `--no-jinja`, tools).
    fn jinja(&self) -> &crate::jinja::Jinja;
    fn metrics(&self) -> &Metrics;
    fn slots(&self) -> Vec<SlotView>;
    /// As [`EngineHandle::slot_op`].
    fn slot_op(&self, id: u32, op: SlotOp) -> SlotOpFuture<'_>;
    /// # Errors
    /// As [`EngineHandle::apply_template`].
    fn apply_template(&self, messages: &[ChatMessage]) -> Result<String, JobError>;
    /// # Errors
    /// As [`EngineHandle::tokenize`].
    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, h2o_llama::Error>;
    /// # Errors
    /// As [`EngineHandle::token_piece`].
    fn token_piece(&self, token: Token) -> Result<Vec<u8>, h2o_llama::Error>;
    /// # Errors
    /// As [`EngineHandle::detokenize`].
    fn detokenize(&self, tokens: &[Token]) -> Result<String, h2o_llama::Error>;
}

impl Engine for EngineHandle {
    fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, SubmitError> {
        EngineHandle::submit(self, job)
    }

    fn info(&self) -> &EngineInfo {
        EngineHandle::info(self)
    }

    fn jinja(&self) -> &crate::jinja::Jinja {
        EngineHandle::jinja(self)
    }

    fn metrics(&self) -> &Metrics {
        EngineHandle::metrics(self)
    }

    fn slots(&self) -> Vec<SlotView> {
        EngineHandle::slots(self)
    }

    fn slot_op(&self, id: u32, op: SlotOp) -> SlotOpFuture<'_> {
        Box::pin(EngineHandle::slot_op(self, id, op))
    }

    fn apply_template(&self, messages: &[ChatMessage]) -> Result<String, JobError> {
        EngineHandle::apply_template(self, messages)
    }

    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, h2o_llama::Error> {
        EngineHandle::tokenize(self, text, add_special, parse_special)
    }

    fn token_piece(&self, token: Token) -> Result<Vec<u8>, h2o_llama::Error> {
        EngineHandle::token_piece(self, token)
    }

    fn detokenize(&self, tokens: &[Token]) -> Result<String, h2o_llama::Error> {
        EngineHandle::detokenize(self, tokens)
    }
}

/// Token spellings for the log-probability lists, from the engine's vocabulary.
pub struct EngineSpell(pub Arc<dyn Engine>);

impl Spell for EngineSpell {
    fn bytes(&self, token: Token) -> Vec<u8> {
        self.0.token_piece(token).unwrap_or_default()
    }
}

/// Server settings the endpoints follow, beside the engine's.
#[derive(Debug, Clone)]
pub struct Options {
    /// `--api-key`: every endpoint but the public ones wants the key.
    pub api_key: Option<String>,
    /// `--max-body`, in bytes.
    pub max_body: usize,
    /// `GET /slots` (off: 501, `--no-slots`).
    pub slots: bool,
    /// The page at `/` (off: 404, `--no-webui`).
    pub webui: bool,
    /// `--slot-save-path`: where `POST /slots/{id}?action=save|restore` keep their files
    /// (none: those answer 501).
    pub slot_save_path: Option<std::path::PathBuf>,
    /// `--verbose`: whole OpenAI answers carry llama-server's `__verbose`, the first choice's
    /// `/completion` answer (its prompt text among it), for debugging templates.
    pub verbose: bool,
}

impl Options {
    #[must_use]
    pub fn new(api_key: Option<String>, max_body: usize) -> Self {
        Self {
            api_key,
            max_body,
            slots: true,
            webui: true,
            slot_save_path: None,
            verbose: false,
        }
    }
}

pub struct AppState {
    pub engine: Arc<dyn Engine>,
    pub options: Options,
    /// Requests answered 503 because the queue was full (the engine never saw them).
    pub rejected_queue_full: AtomicU64,
}

impl AppState {
    pub fn new(engine: Arc<dyn Engine>, options: Options) -> Self {
        Self {
            engine,
            options,
            rejected_queue_full: AtomicU64::new(0),
        }
    }

    /// Token spellings through this state's engine.
    pub fn spell(&self) -> Arc<EngineSpell> {
        Arc::new(EngineSpell(Arc::clone(&self.engine)))
    }
}

pub(crate) type Shared = Arc<AppState>;

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

/// Parses a request body: UTF-8, then JSON syntax, then the endpoint's fields and the common
/// ones, each failure a 400 that says which.
pub fn parse_json<T: Body>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            None,
            "the request body is empty: send a JSON object",
        ));
    }
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(ApiError::invalid(
            None,
            format!(
                "the request body is not UTF-8 text (invalid byte at offset {}): send JSON encoded as UTF-8",
                e.valid_up_to()
            ),
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| json_error(".", e))?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            None,
            "the request body must be a JSON object ({…})",
        ));
    }
    let mut body: T = fields(value.clone())?;
    if let Some(common) = body.common_mut() {
        *common = fields(value)?;
    }
    Ok(body)
}

/// A struct from a JSON object, naming the field at fault.
pub(crate) fn fields<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        json_error(&path, e.into_inner())
    })
}

fn json_error(path: &str, e: serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            ApiError::invalid(None, format!("the request body is not valid JSON: {e}"))
        }
        Category::Data => {
            let msg = e.to_string();
            // serde reports a missing field at the object holding it: name the field itself
            let missing = msg
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
                .map(|field| {
                    if path == "." {
                        field.to_string()
                    } else {
                        format!("{path}.{field}")
                    }
                });
            match missing {
                Some(param) => ApiError::field(&param, format!("missing field `{param}`")),
                None if path == "." => {
                    ApiError::invalid(None, format!("the request body does not fit: {msg}"))
                }
                None => ApiError::field(path, format!("{path}: {msg}")),
            }
        }
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
