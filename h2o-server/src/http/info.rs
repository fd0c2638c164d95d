//! The endpoints that describe the server rather than generate: the model list, health,
//! properties, the slots, the chat template applied, and the page at `/`.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{ApiJson, Shared};
use crate::body::Body;
use crate::engine::Sampling;
use crate::error::ApiError;
use crate::openai::{chat_messages, ChatMessageIn};
use crate::response;

pub async fn models(State(state): State<Shared>) -> Json<Value> {
    let info = state.engine.info();
    Json(json!({
        "object": "list",
        "data": [{
            "id": info.model_id,
            "aliases": info.aliases,
            "tags": info.tags,
            "object": "model",
            "created": info.created,
            "owned_by": "h2o-llama",
            "meta": {
                "n_ctx_slot": info.n_ctx_slot,
                "n_parallel": info.n_parallel,
                "n_ubatch": info.n_ubatch,
                "n_vocab": info.n_vocab,
                "h2o": info.h2o,
            },
        }],
    }))
}

pub async fn health(State(state): State<Shared>) -> Json<Value> {
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

/// The settings a request that sets nothing gets.
fn default_sampling(state: &Shared) -> Sampling {
    let d = state.engine.info().defaults;
    Sampling {
        max_tokens: u32::try_from(d.n_predict).unwrap_or(state.engine.info().n_ctx_slot),
        temperature: d.temperature as f32,
        top_k: d.top_k,
        top_p: d.top_p as f32,
        // -1 as llama-server shows a random seed: u32::MAX
        seed: u32::try_from(d.seed).unwrap_or(u32::MAX),
        stop: Vec::new(),
        logit_bias: Vec::new(),
        logit_bias_text: Vec::new(),
        grammar: None,
        grammar_triggers: None,
        grammar_prefill: Vec::new(),
        preserved_tokens: Vec::new(),
        probs: None,
        post_sampling_probs: false,
    }
}

pub async fn props(State(state): State<Shared>) -> Json<Value> {
    let info = state.engine.info();
    let params = response::generation_settings(&default_sampling(&state), info);
    let template = state
        .engine
        .jinja()
        .templates
        .as_ref()
        .ok()
        .and_then(|t| t.info().ok());
    Json(json!({
        "model_path": info.model_file,
        "model_alias": info.model_id,
        "total_slots": info.n_parallel,
        "default_generation_settings": {
            "id": 0,
            "n_ctx": info.n_ctx_slot,
            "is_processing": false,
            "params": params,
        },
        "n_ubatch": info.n_ubatch,
        "flash_attn": info.flash_attn.name(),
        "h2o": info.h2o,
        // with --h2o auto, what it came to and why (null with --h2o on or off)
        "h2o_auto": info.h2o_auto.as_ref().map(|a| json!({"outcome": a.outcome, "note": a.note})),
        // the Jinja template's text and capabilities, as llama-server's (null without them)
        "chat_template": template.as_ref().map(|t| &t.source),
        "chat_template_caps": template.as_ref().map(|t| &t.caps),
        "endpoint_slots": state.options.slots,
        "webui": state.options.webui,
        "system_fingerprint": response::system_fingerprint(),
        "build_info": format!("h2o-server {} (llama.cpp from llama-cpp-sys-2 {})", env!("CARGO_PKG_VERSION"), h2o_llama::UPSTREAM_VERSION),
    }))
}

/// `GET /slots`: each slot's state, its `params` as llama-server shows them (the running job's
/// sampling, the server's defaults when idle) and its H2O state (policy, memory, chunks run
/// sparse, tokens reused); 501 with `--no-slots`.
pub async fn slots(State(state): State<Shared>) -> Result<Json<Value>, ApiError> {
    if !state.options.slots {
        return Err(ApiError::not_supported(
            "this server was started with --no-slots: start it without it to see the slots",
        ));
    }
    let info = state.engine.info();
    let defaults = default_sampling(&state);
    let slots: Vec<Value> = state
        .engine
        .slots()
        .into_iter()
        .map(|view| {
            let sampling = view.sampling.as_ref().unwrap_or(&defaults);
            let mut v = json!(view);
            v["params"] = response::generation_settings(sampling, info);
            v
        })
        .collect();
    Ok(Json(Value::Array(slots)))
}

/// `POST /apply-template`.
#[derive(Debug, Deserialize)]
pub struct ApplyTemplateRequest {
    pub messages: Vec<ChatMessageIn>,
}

impl Body for ApplyTemplateRequest {}

/// `POST /apply-template`: the prompt a chat request with these messages would evaluate.
pub async fn apply_template(
    State(state): State<Shared>,
    ApiJson(body): ApiJson<ApplyTemplateRequest>,
) -> Result<Json<Value>, ApiError> {
    let messages = chat_messages(body.messages)?;
    let prompt = state
        .engine
        .apply_template(&messages)
        .map_err(|e| ApiError::field("messages", e.to_string()))?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// The page at `/`: a chat box on `/v1/chat/completions`, streaming (404 with `--no-webui`).
pub async fn webui(State(state): State<Shared>) -> Response {
    if !state.options.webui {
        return ApiError::not_found("this server was started with --no-webui: it has no page at /")
            .into_response();
    }
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("webui.html"),
    )
        .into_response()
}
