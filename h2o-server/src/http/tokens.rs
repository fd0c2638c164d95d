//! llama-server's `POST /tokenize` and `POST /detokenize`: the model's tokens for a text and
//! back, so that clients can count a prompt against a slot's context before sending it. They
//! read the model's vocabulary only, so they answer at once, whatever the slots are doing.

use axum::extract::State;
use axum::Json;
use h2o_llama::{Error, Token};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ApiJson, Shared};
use crate::body::Body;
use crate::error::ApiError;
use crate::openai::check_nul;

/// `POST /tokenize`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    /// Add the model's BOS/EOS as its metadata asks (llama-server's default: no).
    #[serde(default)]
    pub add_special: bool,
    /// Read text such as `<|im_start|>` as control tokens (llama-server's default: yes).
    #[serde(default = "yes")]
    pub parse_special: bool,
    /// Answer `{"id", "piece"}` pairs instead of bare ids.
    #[serde(default)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

impl Body for TokenizeRequest {}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<Token>,
}

impl Body for DetokenizeRequest {}

/// A token with its text: a string when the piece is whole UTF-8, else its bytes (a character
/// split across tokens), as llama-server sends it.
#[derive(Debug, Serialize)]
pub struct Piece {
    pub id: Token,
    pub piece: Value,
}

pub async fn tokenize(
    State(state): State<Shared>,
    ApiJson(body): ApiJson<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    check_nul("content", &body.content)?;
    let engine = state.engine.clone();
    // a long text takes a while to tokenize: keep it off the async workers
    let tokens = tokio::task::spawn_blocking(move || -> Result<Value, ApiError> {
        let tokens = engine
            .tokenize(&body.content, body.add_special, body.parse_special)
            .map_err(|e| library_error("content", &e))?;
        if !body.with_pieces {
            return Ok(serde_json::to_value(tokens).unwrap_or_default());
        }
        let pieces = tokens
            .into_iter()
            .map(|id| {
                let bytes = engine
                    .token_piece(id)
                    .map_err(|e| library_error("content", &e))?;
                let piece = match String::from_utf8(bytes) {
                    Ok(text) => Value::String(text),
                    Err(e) => Value::from(e.into_bytes()),
                };
                Ok(Piece { id, piece })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        Ok(serde_json::to_value(pieces).unwrap_or_default())
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??;
    Ok(Json(serde_json::json!({ "tokens": tokens })))
}

pub async fn detokenize(
    State(state): State<Shared>,
    ApiJson(body): ApiJson<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let engine = state.engine.clone();
    let content = tokio::task::spawn_blocking(move || engine.detokenize(&body.tokens))
        .await
        .map_err(|e| ApiError::internal(format!("detokenizing failed: {e}")))?
        .map_err(|e| library_error("tokens", &e))?;
    Ok(Json(serde_json::json!({ "content": content })))
}

/// The library's refusals of a text or a token list are the client's fault (400).
fn library_error(param: &str, e: &Error) -> ApiError {
    match e {
        Error::InvalidToken { token, n_vocab } => ApiError::field(
            param,
            format!("token id {token} is not in the model's vocabulary of {n_vocab} tokens (ids 0..{n_vocab})"),
        ),
        other => ApiError::field(param, other.to_string()),
    }
}
