//! The request log: one line per request on stderr, with the job's counts when there was one.
//! A streamed answer writes its own line when the stream ends.

use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use crate::error::ApiError;

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

pub async fn log_requests(mut req: Request, next: Next) -> Response {
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
