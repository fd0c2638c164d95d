//! Request bodies of the three generation endpoints and their checks, turning each into an
//! engine [`Job`]; and the response and chunk shapes OpenAI clients (and llama-server's
//! `/completion` clients) parse.
//!
//! Every check happens here, before the engine sees the job, so that a bad request costs no slot
//! and gets a 400 naming the field. Fields this server does not implement (`frequency_penalty`,
//! `logprobs`, `user`, …) are ignored, as llama-server does, except those that would change the
//! answer's shape (`n` > 1).

use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use h2o_llama::{ChatMessage, Selection};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::{EngineInfo, H2oOverrides, Job, JobTimings, Prompt, Sampling};
use crate::error::ApiError;

/// OpenAI's range for `temperature`.
const MAX_TEMPERATURE: f64 = 2.0;

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name for `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(skip)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, an array of `{"type": "text", "text": …}` parts, or null (an assistant turn
    /// that only called tools): checked by hand for messages that name the problem.
    #[serde(default)]
    pub content: Value,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// A string, or an array holding one string.
    pub prompt: Value,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(skip)]
    pub common: Common,
}

/// llama-server's `POST /completion`.
#[derive(Debug, Deserialize)]
pub struct LlamaCompletionRequest {
    pub prompt: Value,
    #[serde(default)]
    pub stream: Option<bool>,
    /// -1 (or absent): until the end of generation or a full slot.
    #[serde(default)]
    pub n_predict: Option<i64>,
    #[serde(skip)]
    pub common: Common,
}

/// Fields every generation endpoint takes. Read from the body in a second pass rather than with
/// `#[serde(flatten)]`, which would lose the field's name from type errors.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    /// -1 (or absent): a random seed, as llama-server.
    #[serde(default)]
    pub seed: Option<i64>,
    /// A string or an array of strings.
    #[serde(default)]
    pub stop: Value,
    /// H2O overrides for this request (extensions of this server).
    #[serde(default)]
    pub h2o_select: Option<String>,
    #[serde(default)]
    pub h2o_sink: Option<i64>,
    #[serde(default)]
    pub h2o_dense_tail: Option<i64>,
}

/// A request body: its own fields, and for the generation endpoints the [`Common`] ones.
pub trait Body: serde::de::DeserializeOwned {
    /// Where the common fields go; `None` for bodies without them.
    fn common_mut(&mut self) -> Option<&mut Common> {
        None
    }
}

impl Body for ChatRequest {
    fn common_mut(&mut self) -> Option<&mut Common> {
        Some(&mut self.common)
    }
}

impl Body for CompletionRequest {
    fn common_mut(&mut self) -> Option<&mut Common> {
        Some(&mut self.common)
    }
}

impl Body for LlamaCompletionRequest {
    fn common_mut(&mut self) -> Option<&mut Common> {
        Some(&mut self.common)
    }
}

/// How the answer is sent, decided from the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Delivery {
    pub stream: bool,
    /// OpenAI's `stream_options.include_usage`: one more chunk with `usage` before `[DONE]`.
    pub include_usage: bool,
}

impl ChatRequest {
    /// The job this request asks for.
    ///
    /// # Errors
    /// A 400 naming the first bad field.
    pub fn into_job(self, info: &EngineInfo) -> Result<(Job, Delivery), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::field(
                "messages",
                "messages is empty: send at least one message",
            ));
        }
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        check_n(self.n)?;
        // both given: the newer name wins, as in OpenAI's API
        let (max_param, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        let max_tokens = max_tokens(max_param, max, false, info)?;
        let job = job(Prompt::Chat(messages), &self.common, max_tokens, info)?;
        Ok((job, delivery(self.stream, self.stream_options.as_ref())))
    }
}

impl CompletionRequest {
    /// # Errors
    /// A 400 naming the first bad field.
    pub fn into_job(self, info: &EngineInfo) -> Result<(Job, Delivery), ApiError> {
        let prompt = prompt_text(&self.prompt)?;
        check_n(self.n)?;
        if self.echo == Some(true) {
            return Err(ApiError::field(
                "echo",
                "echo is not supported: leave it out or set it to false",
            ));
        }
        let max_tokens = max_tokens("max_tokens", self.max_tokens, false, info)?;
        let job = job(Prompt::Text(prompt), &self.common, max_tokens, info)?;
        Ok((job, delivery(self.stream, self.stream_options.as_ref())))
    }
}

impl LlamaCompletionRequest {
    /// # Errors
    /// A 400 naming the first bad field.
    pub fn into_job(self, info: &EngineInfo) -> Result<(Job, Delivery), ApiError> {
        let prompt = prompt_text(&self.prompt)?;
        let max_tokens = max_tokens("n_predict", self.n_predict, true, info)?;
        let job = job(Prompt::Text(prompt), &self.common, max_tokens, info)?;
        Ok((job, delivery(self.stream, None)))
    }
}

/// A job from its prompt and the fields every generation endpoint shares.
fn job(
    prompt: Prompt,
    common: &Common,
    max_tokens: u32,
    info: &EngineInfo,
) -> Result<Job, ApiError> {
    Ok(Job {
        prompt,
        sampling: sampling(common, max_tokens)?,
        h2o: h2o_overrides(common, info)?,
    })
}

fn delivery(stream: Option<bool>, options: Option<&StreamOptions>) -> Delivery {
    let stream = stream.unwrap_or(false);
    Delivery {
        stream,
        include_usage: stream && options.is_some_and(|o| o.include_usage),
    }
}

fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::field(
            "n",
            format!("n = {n} is not supported: this server returns one choice per request (n = 1)"),
        )),
    }
}

/// One chat message, with `developer` read as `system` (OpenAI's newer name for it).
fn message(i: usize, m: ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(ApiError::field(
                &format!("messages[{i}].role"),
                format!(
                    "messages[{i}].role {other:?} is not supported: use system, user or assistant"
                ),
            ))
        }
    };
    let param = format!("messages[{i}].content");
    let content = match m.content {
        Value::String(s) => s,
        Value::Null => String::new(),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::field(
                            &format!("{param}[{j}]"),
                            format!(
                                "{param}[{j}] is {}: this server reads only text parts \
                                 ({{\"type\": \"text\", \"text\": \"…\"}})",
                                kind.map_or_else(
                                    || "not a text part".to_string(),
                                    |k| format!("of type {k:?}")
                                )
                            ),
                        ))
                    }
                }
            }
            text
        }
        other => {
            return Err(ApiError::field(
                &param,
                format!(
                    "{param} must be a string or an array of text parts, not {}",
                    json_kind(&other)
                ),
            ))
        }
    };
    check_nul(&param, &content)?;
    Ok(ChatMessage::new(role, content))
}

/// The prompt of the completion endpoints: a string, or an array with one string in it.
fn prompt_text(v: &Value) -> Result<String, ApiError> {
    let text = match v {
        Value::String(s) => s.clone(),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        Value::Array(items) if items.len() > 1 => {
            return Err(ApiError::field(
                "prompt",
                format!("prompt holds {} prompts: send one per request", items.len()),
            ))
        }
        Value::Null => return Err(ApiError::field("prompt", "missing field `prompt`")),
        other => {
            return Err(ApiError::field(
                "prompt",
                format!("prompt must be a string, not {}", json_kind(other)),
            ))
        }
    };
    // the engine would find no tokens either; saying so here costs no slot
    if text.is_empty() {
        return Err(ApiError::field(
            "prompt",
            "the prompt is empty: send at least one token of text",
        )
        .with_code("empty_prompt"));
    }
    check_nul("prompt", &text)?;
    Ok(text)
}

/// llama.cpp's tokenizer takes C strings: a NUL would cut the text short without a word.
pub fn check_nul(param: &str, text: &str) -> Result<(), ApiError> {
    match text.find('\0') {
        Some(at) => Err(ApiError::field(
            param,
            format!("{param} contains a NUL character at byte {at}, which the tokenizer cannot take: remove it"),
        )),
        None => Ok(()),
    }
}

/// The most tokens to generate: at least 1, at most a slot's context. Absent means until the end
/// of generation or a full slot (OpenAI's and llama-server's default); `/completion` also takes
/// llama-server's -1 for that.
fn max_tokens(
    param: &str,
    v: Option<i64>,
    minus_one_unlimited: bool,
    info: &EngineInfo,
) -> Result<u32, ApiError> {
    let limit = info.n_ctx_slot;
    match v {
        None => Ok(limit),
        Some(-1) if minus_one_unlimited => Ok(limit),
        Some(n) if n < 1 => Err(ApiError::field(
            param,
            format!(
                "{param} must be at least 1{}, got {n}",
                if minus_one_unlimited { " (or -1: until the slot is full)" } else { "" }
            ),
        )),
        Some(n) if n > i64::from(limit) => Err(ApiError::field(
            param,
            format!(
                "{param} = {n} is more than a slot's context of {limit} tokens (prompt and completion \
                 together): ask for at most {limit}, or start the server with a larger -c"
            ),
        )),
        Some(n) => Ok(n as u32),
    }
}

fn sampling(c: &Common, max_tokens: u32) -> Result<Sampling, ApiError> {
    // OpenAI's default temperature and top_p are 1
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::field(
            "temperature",
            format!("temperature must be between 0 and {MAX_TEMPERATURE} (0 = greedy), got {temperature}"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::field(
            "top_p",
            format!("top_p must be between 0 and 1, got {top_p}"),
        ));
    }
    let seed = match c.seed {
        None | Some(-1) => random_u64() as u32,
        Some(s) => u32::try_from(s).map_err(|_| {
            ApiError::field(
                "seed",
                format!(
                    "seed must be between 0 and {} (or -1: random), got {s}",
                    u32::MAX
                ),
            )
        })?,
    };
    Ok(Sampling {
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        seed,
        stop: stop_strings(&c.stop)?,
    })
}

fn stop_strings(v: &Value) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match v {
        Value::Null => return Ok(Vec::new()),
        Value::String(_) => vec![v],
        Value::Array(items) => items.iter().collect(),
        other => {
            return Err(ApiError::field(
                "stop",
                format!(
                    "stop must be a string or an array of strings, not {}",
                    json_kind(other)
                ),
            ))
        }
    };
    list.into_iter()
        .enumerate()
        .map(|(i, s)| match s {
            // an empty stop string would end every answer before it begins
            Value::String(s) if s.is_empty() => {
                Err(ApiError::field("stop", format!("stop[{i}] is empty")))
            }
            Value::String(s) => Ok(s.clone()),
            other => Err(ApiError::field(
                "stop",
                format!("stop[{i}] must be a string, not {}", json_kind(other)),
            )),
        })
        .collect()
}

/// The request's H2O fields, checked against the server's L and H as `--h2o-*` are at start.
fn h2o_overrides(c: &Common, info: &EngineInfo) -> Result<H2oOverrides, ApiError> {
    if c.h2o_select.is_none() && c.h2o_sink.is_none() && c.h2o_dense_tail.is_none() {
        return Ok(H2oOverrides::default());
    }
    let Some(h2o) = info.h2o.filter(h2o_llama::H2oConfig::is_enabled) else {
        // silently ignoring them would report full-attention answers as the policy asked for
        let param = if c.h2o_select.is_some() {
            "h2o_select"
        } else if c.h2o_sink.is_some() {
            "h2o_sink"
        } else {
            "h2o_dense_tail"
        };
        return Err(ApiError::field(
            param,
            format!(
                "{param} needs H2O, but this server runs full attention: start it with \
                 --h2o-local L --h2o-heavy H, or leave {param} out"
            ),
        ));
    };
    let select = c
        .h2o_select
        .as_deref()
        .map(|s| {
            s.parse::<Selection>().map_err(|e| {
                let message = match e {
                    h2o_llama::Error::InvalidConfig(m) => m,
                    other => other.to_string(),
                };
                ApiError::field("h2o_select", message)
            })
        })
        .transpose()?;
    let sink = c
        .h2o_sink
        .map(|s| match u32::try_from(s) {
            Ok(s) if s <= h2o.heavy => Ok(s),
            _ => Err(ApiError::field(
                "h2o_sink",
                format!(
                    "h2o_sink must be between 0 and the server's heavy budget --h2o-heavy {} (the sink \
                     positions come out of it), got {s}",
                    h2o.heavy
                ),
            )),
        })
        .transpose()?;
    let dense_tail = c
        .h2o_dense_tail
        .map(|t| match u32::try_from(t) {
            Ok(t) if t <= info.n_ctx_slot => Ok(t),
            _ => Err(ApiError::field(
                "h2o_dense_tail",
                format!(
                    "h2o_dense_tail must be between 0 and a slot's context of {} tokens, got {t}",
                    info.n_ctx_slot
                ),
            )),
        })
        .transpose()?;
    Ok(H2oOverrides {
        select,
        sink,
        dense_tail,
    })
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// 64 random bits from the standard library's per-process hash keys (ids and seeds need no
/// cryptographic strength, and this keeps a random-number crate out).
pub fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// `chatcmpl-…` / `cmpl-…` ids.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", random_u64())
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// ---- responses -------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// Fields every OpenAI response and chunk starts with.
#[derive(Debug, Clone, Serialize)]
pub struct Head {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
}

impl Head {
    pub fn new(id_prefix: &str, object: &'static str, info: &EngineInfo) -> Self {
        Self {
            id: new_id(id_prefix),
            object,
            created: unix_now(),
            model: info.model_id.clone(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    #[serde(flatten)]
    pub head: Head,
    pub choices: [ChatChoice; 1],
    pub usage: Usage,
    /// llama-server's extra field: the engine's timings of this request.
    pub timings: JobTimings,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub finish_reason: &'static str,
    pub logprobs: Option<()>,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Serialize)]
pub struct TextCompletion {
    #[serde(flatten)]
    pub head: Head,
    pub choices: [TextChoice; 1],
    pub usage: Usage,
    pub timings: JobTimings,
}

#[derive(Debug, Serialize)]
pub struct TextChoice {
    pub index: u32,
    pub text: String,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<()>,
}

/// One `chat.completion.chunk`.
#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    #[serde(flatten)]
    pub head: &'a Head,
    pub choices: Vec<ChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<&'a JobTimings>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<()>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

/// One streamed `text_completion` chunk.
#[derive(Debug, Serialize)]
pub struct TextChunk<'a> {
    #[serde(flatten)]
    pub head: &'a Head,
    pub choices: Vec<TextChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<&'a JobTimings>,
}

#[derive(Debug, Serialize)]
pub struct TextChunkChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub finish_reason: Option<&'static str>,
    pub logprobs: Option<()>,
}

/// llama-server's `/completion` answer (and the last event of its stream).
#[derive(Debug, Serialize)]
pub struct LlamaCompletion<'a> {
    pub content: &'a str,
    pub stop: bool,
    pub model: &'a str,
    pub tokens_predicted: usize,
    pub tokens_evaluated: usize,
    pub tokens_cached: usize,
    /// `eos` (end of generation or a stop string: see the engine's `FinishReason::Stop`) or
    /// `limit` (`n_predict` or a full slot).
    pub stop_type: &'static str,
    pub timings: &'a JobTimings,
}

/// One streamed piece of `/completion`.
#[derive(Debug, Serialize)]
pub struct LlamaChunk<'a> {
    pub content: &'a str,
    pub stop: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(h2o: bool) -> EngineInfo {
        EngineInfo {
            model_id: "m.gguf".into(),
            n_parallel: 2,
            n_ctx_slot: 512,
            n_ubatch: 64,
            flash_attn: h2o_llama::FlashAttention::Off,
            h2o: h2o.then(|| h2o_llama::H2oConfig::new(16, 16)),
            created: 0,
        }
    }

    /// As the server reads a body.
    fn parse<T: Body>(body: &Value) -> T {
        crate::http::parse_json(body.to_string().as_bytes()).unwrap()
    }

    fn chat(body: Value, h2o: bool) -> Result<(Job, Delivery), ApiError> {
        parse::<ChatRequest>(&body).into_job(&info(h2o))
    }

    fn param_of(r: Result<(Job, Delivery), ApiError>) -> String {
        let e = r.expect_err("should be refused");
        assert_eq!(e.status, 400, "{e:?}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn a_plain_chat_request_becomes_a_chat_job() {
        let (job, d) = chat(
            serde_json::json!({
                "messages": [
                    {"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
                ],
                "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "seed": 5,
                "stop": "\n", "stream": true, "stream_options": {"include_usage": true}
            }),
            false,
        )
        .unwrap();
        let Prompt::Chat(m) = &job.prompt else {
            panic!("not a chat prompt")
        };
        assert_eq!(m[0], ChatMessage::new("system", "Be brief."));
        assert_eq!(m[1], ChatMessage::new("user", "Hi there"));
        assert_eq!(job.sampling.max_tokens, 7);
        assert_eq!(job.sampling.temperature, 0.0);
        assert_eq!(job.sampling.seed, 5);
        assert_eq!(job.sampling.stop, vec!["\n".to_string()]);
        assert!(d.stream && d.include_usage);
    }

    #[test]
    fn defaults_fill_a_slot_with_random_sampling() {
        let (job, d) = chat(
            serde_json::json!({"messages": [{"role": "user", "content": "x"}]}),
            false,
        )
        .unwrap();
        assert_eq!(job.sampling.max_tokens, 512);
        assert_eq!(job.sampling.temperature, 1.0);
        assert_eq!(job.sampling.top_p, 1.0);
        assert!(job.sampling.stop.is_empty());
        assert!(!d.stream && !d.include_usage);
    }

    #[test]
    fn bad_fields_are_named() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let cases = [
            (serde_json::json!({"messages": []}), "messages"),
            (
                serde_json::json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0]",
            ),
            (
                serde_json::json!({"messages": [{"role": "user", "content": "a\u{0}b"}]}),
                "messages[0].content",
            ),
            (
                serde_json::json!({"messages": user, "max_tokens": 0}),
                "max_tokens",
            ),
            (
                serde_json::json!({"messages": user, "max_tokens": 513}),
                "max_tokens",
            ),
            (
                serde_json::json!({"messages": user, "max_completion_tokens": -1}),
                "max_completion_tokens",
            ),
            (
                serde_json::json!({"messages": user, "temperature": -0.1}),
                "temperature",
            ),
            (
                serde_json::json!({"messages": user, "temperature": 2.5}),
                "temperature",
            ),
            (
                serde_json::json!({"messages": user, "top_p": 1.01}),
                "top_p",
            ),
            (serde_json::json!({"messages": user, "seed": -2}), "seed"),
            (
                serde_json::json!({"messages": user, "seed": 1_i64 << 40}),
                "seed",
            ),
            (serde_json::json!({"messages": user, "stop": 3}), "stop"),
            (
                serde_json::json!({"messages": user, "stop": ["a", 1]}),
                "stop",
            ),
            (serde_json::json!({"messages": user, "stop": [""]}), "stop"),
            (serde_json::json!({"messages": user, "n": 2}), "n"),
            (
                serde_json::json!({"messages": user, "h2o_select": "hybrid"}),
                "h2o_select",
            ),
        ];
        for (body, param) in cases {
            assert_eq!(param_of(chat(body.clone(), false)), param, "{body}");
        }
    }

    #[test]
    fn h2o_overrides_follow_the_library_names_and_the_server_budget() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let (job, _) = chat(
            serde_json::json!({"messages": user, "h2o_select": "query-mean", "h2o_sink": 16, "h2o_dense_tail": 0}),
            true,
        )
        .unwrap();
        assert_eq!(job.h2o.select, Some(Selection::QueryMean));
        assert_eq!(job.h2o.sink, Some(16));
        assert_eq!(job.h2o.dense_tail, Some(0));
        for s in Selection::ALL {
            let (job, _) = chat(
                serde_json::json!({"messages": user, "h2o_select": s.name()}),
                true,
            )
            .unwrap();
            assert_eq!(job.h2o.select, Some(s));
        }
        let e = chat(
            serde_json::json!({"messages": user, "h2o_select": "nope"}),
            true,
        )
        .unwrap_err();
        assert!(
            e.message
                .contains("use one of h2o, query, query-mean, hybrid, coverage"),
            "{}",
            e.message
        );
        assert_eq!(
            param_of(chat(
                serde_json::json!({"messages": user, "h2o_sink": 17}),
                true
            )),
            "h2o_sink"
        );
        assert_eq!(
            param_of(chat(
                serde_json::json!({"messages": user, "h2o_dense_tail": 513}),
                true
            )),
            "h2o_dense_tail"
        );
    }

    #[test]
    fn completion_prompts_are_one_non_empty_string() {
        let info = info(false);
        let job = |body: Value| -> Result<(Job, Delivery), ApiError> {
            parse::<CompletionRequest>(&body).into_job(&info)
        };
        assert!(job(serde_json::json!({"prompt": "a"})).is_ok());
        assert!(job(serde_json::json!({"prompt": ["a"]})).is_ok());
        for body in [
            serde_json::json!({"prompt": ""}),
            serde_json::json!({"prompt": ["a", "b"]}),
            serde_json::json!({"prompt": 1}),
            serde_json::json!({"prompt": null}),
            serde_json::json!({"prompt": [1, 2, 3]}),
        ] {
            assert_eq!(param_of(job(body.clone())), "prompt", "{body}");
        }
        let llama = |body: Value| -> Result<(Job, Delivery), ApiError> {
            parse::<LlamaCompletionRequest>(&body).into_job(&info)
        };
        assert_eq!(
            llama(serde_json::json!({"prompt": "a", "n_predict": -1}))
                .unwrap()
                .0
                .sampling
                .max_tokens,
            512
        );
        assert_eq!(
            param_of(llama(serde_json::json!({"prompt": "a", "n_predict": -2}))),
            "n_predict"
        );
        assert_eq!(
            param_of(llama(serde_json::json!({"prompt": "a", "n_predict": 0}))),
            "n_predict"
        );
    }
}
