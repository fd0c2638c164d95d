//! The one error shape every endpoint answers with, llama-server's:
//! `{"error": {"code": STATUS, "message", "type"}}`, plus `param` naming the request field at
//! fault where there is one, and for a prompt over the context llama-server's
//! `exceed_context_size_error` with `n_prompt_tokens` and `n_ctx`. OpenAI clients read
//! `error.message` and branch on the status; nothing the server sends may be axum's plain-text
//! rejection instead.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

pub use crate::engine::library_reason;
use crate::engine::{JobError, SubmitError};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// llama-server's `type`: `invalid_request_error`, `authentication_error`,
    /// `not_found_error`, `server_error`, `unavailable_error`, `not_supported_error`,
    /// `exceed_context_size_error`.
    pub kind: &'static str,
    /// The request field at fault, as OpenAI names it (`messages[0].content`, `max_tokens`).
    pub param: Option<String>,
    /// More fields of the error object (`n_prompt_tokens`, `n_ctx`).
    pub extra: Vec<(&'static str, serde_json::Value)>,
    /// Seconds for a `Retry-After` header (queue full).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            extra: Vec::new(),
            retry_after_s: None,
        }
    }

    /// 400: the request is wrong; `param` names the field when there is one.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            param: param.map(str::to_string),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400 for one field.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(param), message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
    }

    /// 501: a feature this server was started without (`--no-slots`, no `--slot-save-path`).
    pub fn not_supported(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_IMPLEMENTED, "not_supported_error", message)
    }

    /// 400: the prompt does not fit a slot; llama-server's shape, which clients match on to
    /// trim a conversation.
    pub fn exceed_context(n_prompt: usize, n_ctx: u32, message: impl Into<String>) -> Self {
        Self {
            extra: vec![
                ("n_prompt_tokens", n_prompt.into()),
                ("n_ctx", n_ctx.into()),
            ],
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "exceed_context_size_error",
                message,
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            message,
        )
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "the request body is larger than this server's limit of {limit} bytes: send a \
                 shorter prompt, or start the server with a larger --max-body"
            ),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body, also sent as an SSE event when a stream fails after its headers.
    pub fn body(&self) -> serde_json::Value {
        let mut error = serde_json::json!({
            "code": self.status.as_u16(),
            "message": self.message,
            "type": self.kind,
        });
        if let Some(p) = &self.param {
            error["param"] = p.as_str().into();
        }
        for (k, v) in &self.extra {
            error[*k] = v.clone();
        }
        serde_json::json!({ "error": error })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response.extensions_mut().insert(self);
        response
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull { retry_after_s, .. } => Self {
                // at least 1: "Retry-After: 0" invites a client to hammer the server
                retry_after_s: Some(retry_after_s.max(1)),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable_error",
                    e.to_string(),
                )
            },
            SubmitError::ShuttingDown => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                e.to_string(),
            ),
        }
    }
}

/// A failed job; `prompt_param` is the field that held the prompt (`messages` or `prompt`).
pub fn job_error(e: &JobError, prompt_param: &str) -> ApiError {
    let message = e.to_string();
    match e {
        JobError::PromptTooLong {
            n_prompt,
            n_ctx_slot,
        } => ApiError {
            param: Some(prompt_param.to_string()),
            ..ApiError::exceed_context(*n_prompt, *n_ctx_slot, message)
        },
        JobError::EmptyPrompt | JobError::Template(_) | JobError::BadPrompt(_) => {
            ApiError::field(prompt_param, message)
        }
        JobError::Sampling { param, .. } => ApiError::field(param, message),
        JobError::Engine(_) => ApiError::internal(message),
        JobError::ShuttingDown => SubmitError::ShuttingDown.into(),
    }
}

/// The engine dropped a job's sender without `Done` or `Failed`: a bug or a crash on its side.
pub fn engine_gone() -> ApiError {
    ApiError::internal("the engine stopped before the request finished")
}
