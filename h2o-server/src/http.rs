//! The router: endpoints, the API key check, the request log, and the JSON body extractor that
//! turns every malformed body into an OpenAI error object.
//!
//! Handlers reach the engine through the [`Engine`] trait rather than [`EngineHandle`] itself, so
//! that the unit tests below can run the whole HTTP stack against a scripted engine, with no
//! model.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use h2o_llama::Token;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{
    EngineHandle, EngineInfo, Event, FinishReason, Job, JobTimings, Metrics, SubmitError,
};
use crate::error::{engine_gone, job_error, ApiError};
use crate::openai::{
    AssistantMessage, Body, ChatChoice, ChatCompletion, ChatRequest, CompletionRequest, Head,
    LlamaCompletion, LlamaCompletionRequest, TextChoice, TextCompletion, Usage,
};
use crate::{metrics, sse};

/// What the HTTP layer needs of the engine.
pub trait Engine: Send + Sync + 'static {
    /// # Errors
    /// As [`EngineHandle::submit`].
    fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, SubmitError>;
    fn info(&self) -> &EngineInfo;
    fn metrics(&self) -> &Metrics;
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

    fn metrics(&self) -> &Metrics {
        EngineHandle::metrics(self)
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

pub struct AppState {
    pub engine: Arc<dyn Engine>,
    /// `--api-key`: every endpoint but `/health` wants `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// `--max-body`, in bytes.
    pub max_body: usize,
    /// Requests answered 503 because the queue was full (the engine never saw them).
    pub rejected_queue_full: AtomicU64,
}

impl AppState {
    pub fn new(engine: Arc<dyn Engine>, api_key: Option<String>, max_body: usize) -> Self {
        Self {
            engine,
            api_key,
            max_body,
            rejected_queue_full: AtomicU64::new(0),
        }
    }
}

type Shared = Arc<AppState>;

pub fn router(state: Shared) -> Router {
    Router::new()
        // llama-server answers each of these with and without the /v1 prefix
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/completion", post(llama_completion))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/props", get(props))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .fallback(not_found)
        // after the routes: it applies to those registered so far
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .layer(DefaultBodyLimit::max(state.max_body))
        .layer(middleware::from_fn(log_requests))
        .with_state(state)
}

// ---- request log --------------------------------------------------------------------------------

/// What the log line of a request says, beyond method, path and status.
#[derive(Debug, Clone, Copy, Default)]
pub struct JobStats {
    /// The engine slot that ran the request.
    pub slot: Option<u32>,
    pub prompt_tokens: Option<usize>,
    pub completion_tokens: Option<usize>,
    pub ttft: Option<Duration>,
}

/// Put on a streamed response: the stream writes its own log line when it ends, since the
/// counts are not known when the headers go out.
#[derive(Debug, Clone, Copy)]
pub struct LoggedByStream;

/// The request's method, path and arrival, for handlers that log (or time) it themselves.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    pub method: Method,
    pub path: String,
    pub start: Instant,
}

async fn log_requests(mut req: Request, next: Next) -> Response {
    let info = RequestInfo {
        method: req.method().clone(),
        path: req.uri().path().to_string(),
        start: Instant::now(),
    };
    req.extensions_mut().insert(info.clone());
    let response = next.run(req).await;
    if response.extensions().get::<LoggedByStream>().is_none() {
        let stats = response
            .extensions()
            .get::<JobStats>()
            .copied()
            .unwrap_or_default();
        let error = response
            .extensions()
            .get::<ApiError>()
            .map(|e| e.message.as_str());
        log_line(&info, response.status(), &stats, "", error);
    }
    response
}

/// One line per request on stderr: `h2o-server: POST /v1/chat/completions 200 prompt=… completion=…
/// ttft=…ms total=…ms`, with `stream` for streamed answers and the reason for errors.
pub fn log_line(
    info: &RequestInfo,
    status: StatusCode,
    stats: &JobStats,
    note: &str,
    error: Option<&str>,
) {
    let opt = |v: Option<usize>| v.map_or_else(|| "-".to_string(), |n| n.to_string());
    let ttft = stats.ttft.map_or_else(
        || "-".to_string(),
        |d| format!("{:.1}ms", d.as_secs_f64() * 1e3),
    );
    let mut line = format!(
        "h2o-server: {} {} {}{note} slot={} prompt={} completion={} ttft={ttft} total={:.1}ms",
        info.method,
        info.path,
        status.as_u16(),
        stats
            .slot
            .map_or_else(|| "-".to_string(), |s| s.to_string()),
        opt(stats.prompt_tokens),
        opt(stats.completion_tokens),
        info.start.elapsed().as_secs_f64() * 1e3,
    );
    if let Some(e) = error {
        // a log line, not a dump: long messages quote the whole prompt at times
        let e: String = e.chars().take(300).collect();
        line.push_str(": ");
        line.push_str(&e);
    }
    eprintln!("{line}");
}

// ---- API key ------------------------------------------------------------------------------------

async fn require_api_key(State(state): State<Shared>, req: Request, next: Next) -> Response {
    let Some(key) = &state.api_key else {
        return next.run(req).await;
    };
    // health checks come from load balancers, which hold no key (as in llama-server)
    if matches!(req.uri().path(), "/health" | "/v1/health") {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(k) if constant_time_eq(k.as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => ApiError::unauthorized(
            "invalid API key: send the key the server was started with (--api-key)",
        )
        .into_response(),
        None => ApiError::unauthorized(
            "this server needs an API key: send the header `Authorization: Bearer KEY`",
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
                ApiError::too_large(state.max_body)
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
fn fields<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
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

// ---- generation ---------------------------------------------------------------------------------

/// A submitted job whose first event has arrived: from here on the answer is a 200, or, for a
/// stream, events in the body. Dropping it drops the receiver, which cancels the job.
pub struct Run {
    rx: UnboundedReceiver<Event>,
    first: Option<Event>,
    /// The request field that held the prompt, for error objects.
    pub prompt_param: &'static str,
    pub request: RequestInfo,
    pub stats: JobStats,
}

/// What a finished job produced.
pub struct Output {
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub timings: JobTimings,
}

impl Run {
    /// Submits `job` and waits for its first event, so that a job refused at once (a prompt too
    /// long for a slot) is still a 400 rather than an error inside a 200 stream. The wait
    /// includes the time in the queue.
    async fn start(
        state: &AppState,
        job: Job,
        prompt_param: &'static str,
        request: RequestInfo,
    ) -> Result<Self, ApiError> {
        let mut rx = state.engine.submit(job).inspect_err(|e| {
            if matches!(e, SubmitError::QueueFull { .. }) {
                state.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
            }
        })?;
        let first = match rx.recv().await {
            None => return Err(engine_gone()),
            Some(Event::Failed(e)) => return Err(job_error(&e, prompt_param)),
            Some(first) => first,
        };
        Ok(Self {
            rx,
            // handed out (and counted) by the first `next`
            first: Some(first),
            prompt_param,
            request,
            stats: JobStats::default(),
        })
    }

    /// The next event, keeping the log's counts; `None` once the engine dropped the sender.
    pub async fn next(&mut self) -> Option<Event> {
        let event = match self.first.take() {
            Some(e) => e,
            None => self.rx.recv().await?,
        };
        match &event {
            Event::Started {
                slot,
                prompt_tokens,
            } => {
                self.stats.slot = Some(*slot);
                self.stats.prompt_tokens = Some(*prompt_tokens);
            }
            Event::Token { .. } => {
                self.stats
                    .ttft
                    .get_or_insert_with(|| self.request.start.elapsed());
                *self.stats.completion_tokens.get_or_insert(0) += 1;
            }
            Event::Done {
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                self.stats.prompt_tokens = Some(*prompt_tokens);
                self.stats.completion_tokens = Some(*completion_tokens);
            }
            Event::Failed(_) => {}
        }
        Some(event)
    }

    /// Reads the job to its end.
    async fn collect(mut self) -> Result<(Output, JobStats), ApiError> {
        let mut text = String::new();
        loop {
            match self.next().await {
                Some(Event::Started { .. }) => {}
                Some(Event::Token { text: piece, .. }) => text.push_str(&piece),
                Some(Event::Done {
                    finish,
                    completion_tokens,
                    prompt_tokens,
                    timings,
                }) => {
                    let output = Output {
                        text,
                        finish,
                        prompt_tokens,
                        completion_tokens,
                        timings,
                    };
                    return Ok((output, self.stats));
                }
                Some(Event::Failed(e)) => return Err(job_error(&e, self.prompt_param)),
                None => return Err(engine_gone()),
            }
        }
    }
}

/// A JSON 200 whose log line carries the job's counts.
fn json_with_stats<T: serde::Serialize>(body: &T, stats: JobStats) -> Response {
    let mut response = Json(body).into_response();
    response.extensions_mut().insert(stats);
    response
}

async fn chat(
    State(state): State<Shared>,
    Extension(request): Extension<RequestInfo>,
    ApiJson(body): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let info = state.engine.info();
    let (job, delivery) = body.into_job(info)?;
    let run = Run::start(&state, job, "messages", request).await?;
    let head = Head::new(
        "chatcmpl",
        if delivery.stream {
            "chat.completion.chunk"
        } else {
            "chat.completion"
        },
        info,
    );
    if delivery.stream {
        return Ok(sse::respond(
            run,
            sse::Format::Chat {
                head,
                include_usage: delivery.include_usage,
            },
        ));
    }
    let (out, stats) = run.collect().await?;
    let body = ChatCompletion {
        head,
        choices: [ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant",
                content: out.text,
            },
            finish_reason: out.finish.as_str(),
            logprobs: None,
        }],
        usage: Usage::new(out.prompt_tokens, out.completion_tokens),
        timings: out.timings,
    };
    Ok(json_with_stats(&body, stats))
}

async fn completions(
    State(state): State<Shared>,
    Extension(request): Extension<RequestInfo>,
    ApiJson(body): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let info = state.engine.info();
    let (job, delivery) = body.into_job(info)?;
    let run = Run::start(&state, job, "prompt", request).await?;
    let head = Head::new("cmpl", "text_completion", info);
    if delivery.stream {
        return Ok(sse::respond(
            run,
            sse::Format::Text {
                head,
                include_usage: delivery.include_usage,
            },
        ));
    }
    let (out, stats) = run.collect().await?;
    let body = TextCompletion {
        head,
        choices: [TextChoice {
            index: 0,
            text: out.text,
            finish_reason: Some(out.finish.as_str()),
            logprobs: None,
        }],
        usage: Usage::new(out.prompt_tokens, out.completion_tokens),
        timings: out.timings,
    };
    Ok(json_with_stats(&body, stats))
}

async fn llama_completion(
    State(state): State<Shared>,
    Extension(request): Extension<RequestInfo>,
    ApiJson(body): ApiJson<LlamaCompletionRequest>,
) -> Result<Response, ApiError> {
    let info = state.engine.info();
    let (job, delivery) = body.into_job(info)?;
    let run = Run::start(&state, job, "prompt", request).await?;
    if delivery.stream {
        return Ok(sse::respond(
            run,
            sse::Format::Llama {
                model: info.model_id.clone(),
            },
        ));
    }
    let (out, stats) = run.collect().await?;
    let body = llama_final(&out.text, &info.model_id, &out);
    Ok(json_with_stats(&body, stats))
}

/// llama-server's `stop_type` for a finish reason.
pub fn stop_type(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Stop => "eos",
        FinishReason::StopWord => "word",
        FinishReason::Length => "limit",
    }
}

pub fn llama_final<'a>(content: &'a str, model: &'a str, out: &'a Output) -> LlamaCompletion<'a> {
    LlamaCompletion {
        content,
        stop: true,
        model,
        tokens_predicted: out.completion_tokens,
        tokens_evaluated: out.prompt_tokens,
        tokens_cached: out.timings.cache_n,
        stop_type: stop_type(out.finish),
        timings: &out.timings,
    }
}

// ---- everything else ----------------------------------------------------------------------------

async fn models(State(state): State<Shared>) -> Json<serde_json::Value> {
    let info = state.engine.info();
    Json(json!({
        "object": "list",
        "data": [{
            "id": info.model_id,
            "object": "model",
            "created": info.created,
            "owned_by": "h2o-llama",
            "meta": {
                "n_ctx_slot": info.n_ctx_slot,
                "n_parallel": info.n_parallel,
                "n_ubatch": info.n_ubatch,
                "h2o": info.h2o,
            },
        }],
    }))
}

async fn health(State(state): State<Shared>) -> Json<serde_json::Value> {
    let info = state.engine.info();
    let m = state.engine.metrics();
    let busy = m.slots_busy.load(Ordering::Relaxed);
    Json(json!({
        "status": "ok",
        "slots_idle": u64::from(info.n_parallel).saturating_sub(busy),
        "slots_busy": busy,
        "queue_length": m.queue_len.load(Ordering::Relaxed),
    }))
}

async fn props(State(state): State<Shared>) -> Json<serde_json::Value> {
    let info = state.engine.info();
    Json(json!({
        "model_path": info.model_id,
        "total_slots": info.n_parallel,
        "default_generation_settings": { "n_ctx": info.n_ctx_slot },
        "n_ubatch": info.n_ubatch,
        "flash_attn": info.flash_attn.name(),
        "h2o": info.h2o,
        "build_info": format!("h2o-server {} (llama.cpp from llama-cpp-sys-2 {})", env!("CARGO_PKG_VERSION"), h2o_llama::UPSTREAM_VERSION),
    }))
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
         POST /completion, POST /tokenize, POST /detokenize, GET /v1/models, GET /health, \
         GET /metrics and GET /props",
        uri.path()
    ))
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::method_not_allowed(format!("{} does not take {method}", uri.path()))
}

mod tokens;

#[cfg(test)]
mod tests;
