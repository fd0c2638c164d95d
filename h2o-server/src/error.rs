//! The one error shape every endpoint answers with: OpenAI's
//! `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that goes with it.
//! Clients written for OpenAI read `error.message` and branch on the status; nothing the server
//! sends may be axum's plain-text rejection instead.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::engine::{JobError, SubmitError};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `server_error`, `unavailable_error`.
    pub kind: &'static str,
    /// The request field at fault, as OpenAI names it (`messages[0].content`, `max_tokens`).
    pub param: Option<String>,
    pub code: Option<&'static str>,
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
            code: None,
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
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
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
        Self {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!(
                    "the request body is larger than this server's limit of {limit} bytes: send a \
                     shorter prompt, or start the server with a larger --max-body"
                ),
            )
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body, also sent as an SSE event when a stream fails after its headers.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
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
                code: Some("queue_full"),
                // at least 1: "Retry-After: 0" invites a client to hammer the server
                retry_after_s: Some(retry_after_s.max(1)),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable_error",
                    e.to_string(),
                )
            },
            SubmitError::ShuttingDown => Self {
                code: Some("shutting_down"),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable_error",
                    e.to_string(),
                )
            },
        }
    }
}

/// A failed job; `prompt_param` is the field that held the prompt (`messages` or `prompt`).
pub fn job_error(e: &JobError, prompt_param: &str) -> ApiError {
    let message = e.to_string();
    match e {
        // OpenAI's own code for this case, which some clients check to trim the conversation
        JobError::PromptTooLong { .. } => {
            ApiError::field(prompt_param, message).with_code("context_length_exceeded")
        }
        JobError::EmptyPrompt => ApiError::field(prompt_param, message).with_code("empty_prompt"),
        JobError::Template(_) => ApiError::field(prompt_param, message).with_code("chat_template"),
        JobError::Engine(_) => ApiError::internal(message),
        JobError::ShuttingDown => SubmitError::ShuttingDown.into(),
    }
}

/// The engine dropped a job's sender without `Done` or `Failed`: a bug or a crash on its side.
pub fn engine_gone() -> ApiError {
    ApiError::internal("the engine stopped before the request finished")
}
