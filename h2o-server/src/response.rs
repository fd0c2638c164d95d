//! The one home of the answers' shapes: OpenAI's `chat.completion` and `text_completion` (whole
//! and as stream chunks) and llama-server's `/completion` objects, built from what a job
//! produced. `http` sends them whole, `sse` as events; neither builds JSON of its own.

use h2o_llama::{ChatReply, ReplyDelta, Token, TokenLogprobs};
use serde::Serialize;
use serde_json::{json, Value};

use crate::engine::{EngineInfo, FinishReason, JobTimings, Sampling};
use crate::openai::{new_id, unix_now};

/// llama-server's `system_fingerprint`: `b` and the build, here the pinned llama.cpp package's
/// version with this server's.
pub fn system_fingerprint() -> String {
    format!(
        "b{}-h2o-server-{}",
        h2o_llama::UPSTREAM_VERSION,
        env!("CARGO_PKG_VERSION")
    )
}

/// What a finished job produced.
#[derive(Debug, Clone, Default)]
pub struct Output {
    pub text: String,
    pub tokens: Vec<Token>,
    pub probs: Vec<TokenLogprobs>,
    /// The prompt's tokens, as evaluated.
    pub prompt: Vec<Token>,
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub timings: JobTimings,
    pub slot: Option<u32>,
}

impl Output {
    /// Takes in what `event` says of the job: its slot and prompt, a piece of text with its
    /// tokens and log-probabilities, or its end; progress and failures leave it as it is.
    pub fn record(&mut self, event: &crate::engine::Event) {
        use crate::engine::Event;
        match event {
            Event::Started { slot, prompt, .. } => {
                self.slot = Some(*slot);
                self.prompt.clone_from(prompt);
            }
            Event::Token {
                text,
                tokens,
                probs,
            } => {
                self.text.push_str(text);
                self.tokens.extend_from_slice(tokens);
                self.probs.extend_from_slice(probs);
            }
            Event::Done {
                finish,
                completion_tokens,
                prompt_tokens,
                timings,
            } => {
                self.finish = Some(*finish);
                self.prompt_tokens = *prompt_tokens;
                self.completion_tokens = *completion_tokens;
                self.timings = timings.clone();
            }
            Event::Progress { .. } | Event::Failed(_) => {}
        }
    }

    pub fn finish_reason(&self) -> &'static str {
        self.finish.map_or("stop", FinishReason::as_str)
    }
}

#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq, Eq)]
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
    pub system_fingerprint: String,
}

impl Head {
    pub fn new(id_prefix: &str, object: &'static str, info: &EngineInfo) -> Self {
        Self {
            id: new_id(id_prefix),
            object,
            created: unix_now(),
            model: info.model_id.clone(),
            system_fingerprint: system_fingerprint(),
        }
    }
}

/// An OpenAI object beginning with `head`'s fields, then `rest`'s.
fn with_head(head: &Head, rest: Value) -> Value {
    let mut v = json!({
        "id": head.id,
        "object": head.object,
        "created": head.created,
        "model": head.model,
        "system_fingerprint": head.system_fingerprint,
    });
    if let (Some(v), Value::Object(rest)) = (v.as_object_mut(), rest) {
        v.extend(rest);
    }
    v
}

/// How a token is spelled in the log-probability lists.
pub trait Spell {
    fn bytes(&self, token: Token) -> Vec<u8>;
}

/// One token's entry: OpenAI's `{token, logprob, bytes}` with llama-server's `id`; or, for
/// `post_sampling_probs`, `prob` in place of `logprob`.
fn prob_entry(spell: &dyn Spell, token: Token, logprob: f32, linear: bool) -> Value {
    let bytes = spell.bytes(token);
    let mut e = json!({
        "id": token,
        "token": String::from_utf8_lossy(&bytes),
        "bytes": bytes,
    });
    if linear {
        e["prob"] = f64::from(logprob).exp().into();
    } else {
        e["logprob"] = logprob.into();
    }
    e
}

/// The `content` list of OpenAI's chat `logprobs`, and llama-server's
/// `completion_probabilities`: each token with its likeliest alternatives.
pub fn prob_list(spell: &dyn Spell, probs: &[TokenLogprobs], linear: bool) -> Vec<Value> {
    let top_key = if linear { "top_probs" } else { "top_logprobs" };
    probs
        .iter()
        .map(|p| {
            let mut e = prob_entry(spell, p.token, p.logprob, linear);
            e[top_key] = p
                .top
                .iter()
                .map(|&(t, lp)| prob_entry(spell, t, lp, linear))
                .collect::<Vec<_>>()
                .into();
            e
        })
        .collect()
}

/// OpenAI's legacy `text_completion` `logprobs`: parallel lists of tokens, their
/// log-probabilities, their alternatives as `{token: logprob}`, and their offsets in the text.
pub fn legacy_logprobs(spell: &dyn Spell, probs: &[TokenLogprobs], offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(probs.len());
    let mut at = offset;
    let mut tokens = Vec::with_capacity(probs.len());
    for p in probs {
        let piece = String::from_utf8_lossy(&spell.bytes(p.token)).into_owned();
        text_offset.push(at);
        at += piece.len();
        tokens.push(piece);
    }
    json!({
        "tokens": tokens,
        "token_logprobs": probs.iter().map(|p| p.logprob).collect::<Vec<_>>(),
        "top_logprobs": probs.iter().map(|p| {
            p.top.iter().map(|&(t, lp)| {
                (String::from_utf8_lossy(&spell.bytes(t)).into_owned(), Value::from(lp))
            }).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// llama-server's `generation_settings` (and `/props`' `default_generation_settings.params`).
pub fn generation_settings(sampling: &Sampling, info: &EngineInfo) -> Value {
    json!({
        "n_predict": sampling.max_tokens,
        "seed": sampling.seed,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "stop": sampling.stop,
        "n_probs": sampling.probs.unwrap_or(0),
        "grammar": sampling.grammar.as_ref().map_or("", |(g, _)| g.as_str()),
        "logit_bias": sampling.logit_bias.iter().map(|&(t, b)| json!([t, if b.is_finite() { Value::from(b) } else { Value::Bool(false) }])).collect::<Vec<_>>(),
        "n_ctx": info.n_ctx_slot,
        "model": info.model_id,
        "h2o": info.h2o,
    })
}

/// llama-server's `stop_type` for a finish reason.
pub fn stop_type(finish: Option<FinishReason>) -> &'static str {
    match finish {
        Some(FinishReason::Stop) => "eos",
        Some(FinishReason::StopWord) => "word",
        Some(FinishReason::Length | FinishReason::ContextFull) => "limit",
        None => "none",
    }
}

/// What a `/completion` request asked of its answer's shape.
#[derive(Debug, Clone, Default)]
pub struct LlamaShape {
    pub probs: bool,
    pub probs_linear: bool,
    pub return_tokens: bool,
    pub response_fields: Option<Vec<String>>,
}

/// llama-server's `/completion` answer, and the last event of its stream (`content` empty
/// there: the pieces carried it).
pub fn llama_final(
    content: &str,
    out: &Output,
    settings: &Value,
    info: &EngineInfo,
    shape: &LlamaShape,
    spell: &dyn Spell,
    prompt_text: &str,
) -> Value {
    let mut v = json!({
        "index": 0,
        "content": content,
        "tokens": if shape.return_tokens { out.tokens.clone() } else { Vec::new() },
        "id_slot": out.slot.map_or(-1, i64::from),
        "stop": true,
        "model": info.model_id,
        "tokens_predicted": out.completion_tokens,
        "tokens_evaluated": out.prompt_tokens,
        "generation_settings": settings,
        "prompt": prompt_text,
        "has_new_line": out.text.contains('\n'),
        "truncated": out.finish == Some(FinishReason::ContextFull) || out.timings.context_shifted,
        "stop_type": stop_type(out.finish),
        "stopping_word": "",
        "tokens_cached": out.timings.cache_n,
        "timings": out.timings,
    });
    if shape.probs {
        v["completion_probabilities"] = prob_list(spell, &out.probs, shape.probs_linear).into();
    }
    match &shape.response_fields {
        Some(fields) if !fields.is_empty() => pick_fields(&v, fields),
        _ => v,
    }
}

/// llama-server's `response_fields`: only these, each found by its `/`-separated path and
/// keyed by the path itself; a path that leads nowhere is left out.
fn pick_fields(v: &Value, fields: &[String]) -> Value {
    let mut out = serde_json::Map::new();
    for f in fields {
        let found = f.split('/').try_fold(v, |node, key| node.get(key));
        if let Some(found) = found {
            out.insert(f.clone(), found.clone());
        }
    }
    Value::Object(out)
}

/// One streamed piece of `/completion`.
pub fn llama_chunk(
    text: &str,
    tokens: &[Token],
    probs: &[TokenLogprobs],
    shape: &LlamaShape,
    spell: &dyn Spell,
    slot: Option<u32>,
) -> Value {
    let mut v = json!({
        "index": 0,
        "content": text,
        "tokens": tokens,
        "stop": false,
        "id_slot": slot.map_or(-1, i64::from),
    });
    if shape.probs {
        v["completion_probabilities"] = prob_list(spell, probs, shape.probs_linear).into();
    }
    v
}

/// llama-server's `prompt_progress` object.
pub fn prompt_progress(total: usize, cache: usize, processed: usize, time_ms: f64) -> Value {
    json!({ "total": total, "cache": cache, "processed": processed, "time_ms": time_ms })
}

/// An OpenAI chunk with no choice that carries `prompt_progress` (`return_progress`).
pub fn openai_progress_chunk(head: &Head, progress: Value) -> Value {
    with_head(
        head,
        json!({
            "choices": [],
            "prompt_progress": progress,
        }),
    )
}

/// llama-server's `prompt_progress` event of a `/completion` stream (`return_progress`).
pub fn progress_chunk(total: usize, cache: usize, processed: usize, time_ms: f64) -> Value {
    json!({
        "index": 0,
        "content": "",
        "tokens": [],
        "stop": false,
        "prompt_progress": prompt_progress(total, cache, processed, time_ms),
    })
}

/// One choice of a whole chat answer: what its job produced, its reply as a Jinja template's
/// parser split it, and its log-probabilities when asked for.
pub struct ChatChoice {
    pub out: Output,
    pub reply: Option<ChatReply>,
    pub logprobs: Option<Vec<Value>>,
}

/// A whole `chat.completion`, one choice per job (`n`). The prompt counts once in `usage`, as
/// OpenAI counts it; the completions add up.
pub fn chat_completion(head: &Head, choices: &[ChatChoice]) -> Value {
    let prompt_tokens = choices.first().map_or(0, |c| c.out.prompt_tokens);
    let completion_tokens = choices.iter().map(|c| c.out.completion_tokens).sum();
    with_head(
        head,
        json!({
            "choices": choices.iter().enumerate().map(|(i, c)| json!({
                "index": i,
                "message": chat_message(&c.out.text, c.reply.as_ref()),
                "finish_reason": chat_finish_reason(&c.out, c.reply.as_ref()),
                "logprobs": c.logprobs.as_ref().map(|l| json!({ "content": l })),
            })).collect::<Vec<_>>(),
            "usage": Usage::new(prompt_tokens, completion_tokens),
            "timings": choices.last().map(|c| &c.out.timings),
        }),
    )
}

/// The answer's message: its text, or its content, reasoning and tool calls as llama-server
/// gives them (content null when only tools were called; reasoning only when there is some).
fn chat_message(text: &str, reply: Option<&ChatReply>) -> Value {
    let Some(reply) = reply else {
        return json!({ "role": "assistant", "content": text });
    };
    let mut message = serde_json::Map::new();
    message.insert("role".into(), "assistant".into());
    let content = if reply.content.is_empty() && !reply.tool_calls.is_empty() {
        Value::Null
    } else {
        Value::from(reply.content.as_str())
    };
    message.insert("content".into(), content);
    if !reply.reasoning_content.is_empty() {
        message.insert(
            "reasoning_content".into(),
            reply.reasoning_content.as_str().into(),
        );
    }
    if !reply.tool_calls.is_empty() {
        let calls: Vec<Value> = reply
            .tool_calls
            .iter()
            .map(|c| {
                json!({
                    "type": "function",
                    "id": c.id,
                    "function": { "name": c.name, "arguments": c.arguments },
                })
            })
            .collect();
        message.insert("tool_calls".into(), calls.into());
    }
    Value::Object(message)
}

/// `tool_calls` when the answer called tools and was not cut short, as llama-server's.
pub fn chat_finish_reason(out: &Output, reply: Option<&ChatReply>) -> &'static str {
    let called = reply.is_some_and(|r| !r.tool_calls.is_empty());
    match out.finish {
        Some(FinishReason::Length | FinishReason::ContextFull) => out.finish_reason(),
        _ if called => "tool_calls",
        _ => out.finish_reason(),
    }
}

/// The `delta` of one piece of a parsed reply: content, reasoning, or a piece of tool call
/// `index` (with its id, type and name on its first piece), as llama-server streams them.
pub fn reply_delta(d: &ReplyDelta) -> serde_json::Map<String, Value> {
    let mut delta = serde_json::Map::new();
    if !d.reasoning_content.is_empty() {
        delta.insert(
            "reasoning_content".into(),
            d.reasoning_content.as_str().into(),
        );
    }
    if !d.content.is_empty() {
        delta.insert("content".into(), d.content.as_str().into());
    }
    if let (Some(index), Some(call)) = (d.tool_call_index, &d.tool_call) {
        let mut tool_call = serde_json::Map::new();
        tool_call.insert("index".into(), index.into());
        if !call.id.is_empty() {
            tool_call.insert("id".into(), call.id.as_str().into());
            tool_call.insert("type".into(), "function".into());
        }
        let mut function = serde_json::Map::new();
        if !call.name.is_empty() {
            function.insert("name".into(), call.name.as_str().into());
        }
        function.insert("arguments".into(), call.arguments.as_str().into());
        tool_call.insert("function".into(), function.into());
        delta.insert("tool_calls".into(), json!([tool_call]));
    }
    delta
}

/// A whole `text_completion`, one choice per prompt.
pub fn text_completion(head: &Head, outs: &[(Output, Option<Value>)]) -> Value {
    let prompt_tokens = outs.iter().map(|(o, _)| o.prompt_tokens).sum();
    let completion_tokens = outs.iter().map(|(o, _)| o.completion_tokens).sum();
    with_head(
        head,
        json!({
            "choices": outs.iter().enumerate().map(|(i, (o, logprobs))| json!({
                "index": i,
                "text": o.text,
                "finish_reason": o.finish_reason(),
                "logprobs": logprobs,
            })).collect::<Vec<_>>(),
            "usage": Usage::new(prompt_tokens, completion_tokens),
            "timings": outs.last().map(|(o, _)| &o.timings),
        }),
    )
}

/// One `chat.completion.chunk`. `delta_content`: `Some(None)` sends `"content": null` (the
/// first chunk, as llama-server), `None` leaves the key out (the finishing chunk).
pub fn chat_chunk(
    head: &Head,
    role: bool,
    delta_content: Option<Option<&str>>,
    finish: Option<&str>,
    logprobs: Option<Vec<Value>>,
) -> Value {
    let mut delta = serde_json::Map::new();
    if role {
        delta.insert("role".into(), "assistant".into());
    }
    if let Some(c) = delta_content {
        delta.insert("content".into(), c.map_or(Value::Null, Value::from));
    }
    chat_delta_chunk(head, delta, finish, logprobs)
}

/// One `chat.completion.chunk` carrying `delta`.
pub fn chat_delta_chunk(
    head: &Head,
    delta: serde_json::Map<String, Value>,
    finish: Option<&str>,
    logprobs: Option<Vec<Value>>,
) -> Value {
    with_head(
        head,
        json!({
            "choices": [{
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": logprobs.map(|c| json!({ "content": c })),
            }],
        }),
    )
}

/// One streamed `text_completion` chunk.
pub fn text_chunk(head: &Head, text: &str, finish: Option<&str>, logprobs: Option<Value>) -> Value {
    with_head(
        head,
        json!({
            "choices": [{
                "index": 0,
                "text": text,
                "finish_reason": finish,
                "logprobs": logprobs,
            }],
        }),
    )
}

/// The chunk with `usage` (and llama-server's `timings`) and no choices, OpenAI's last before
/// `[DONE]` when `stream_options.include_usage` asked for it.
pub fn usage_chunk(head: &Head, out: &Output) -> Value {
    with_head(
        head,
        json!({
            "choices": [],
            "usage": Usage::new(out.prompt_tokens, out.completion_tokens),
            "timings": out.timings,
        }),
    )
}
