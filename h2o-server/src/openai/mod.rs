//! Request bodies of the three generation endpoints and their checks, turning each into engine
//! [`Job`]s (one per prompt and choice) and the [`Delivery`] that says how the answer goes out.
//! The sampling fields are checked in `fields`, the prompts read in `prompt`; chats with tools
//! (or all chats under `--jinja`) are rendered by `crate::jinja`.
//!
//! Every check happens here, before the engine sees the job, so that a bad request costs no slot
//! and gets a 400 naming the field. Fields this server does not implement (`frequency_penalty`,
//! `user`, …) are ignored, as llama-server does.

use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use h2o_llama::ReplyParser;
use serde::Deserialize;
use serde_json::Value;

use crate::body::{fields, Body};
use crate::engine::{EngineInfo, Job, Prompt};
use crate::error::ApiError;
use crate::jinja::{self, ChatFields, Jinja};

mod fields;
mod infill;
mod prompt;

use fields::{count_field, h2o_overrides, max_tokens, response_format_grammar, sampling};
pub use infill::InfillRequest;
pub use prompt::{chat_messages, check_nul};
use prompt::{check_messages, prompts};

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// OpenAI's messages: read as [`ChatMessageIn`] for llama.cpp's built-in templates, passed
    /// whole (tool calls and tool results included) to the Jinja ones.
    pub messages: Value,
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
    /// OpenAI's: log-probabilities of the answer's tokens, and `top_logprobs` of the likeliest.
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", …}`.
    #[serde(default)]
    pub response_format: Value,
    /// OpenAI's function tools; they take the request to the Jinja templates (`jinja`).
    #[serde(default)]
    pub tools: Value,
    /// `auto`, `required` or `none`.
    #[serde(default)]
    pub tool_choice: Value,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the Jinja template (llama-server's).
    #[serde(default)]
    pub chat_template_kwargs: Value,
    /// How thinking is split from the reply: `none`, `auto`, `deepseek`, `deepseek-legacy`.
    #[serde(default)]
    pub reasoning_format: Option<String>,
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
    /// OpenAI's legacy `logprobs`: the number of likeliest tokens to list with each.
    #[serde(default)]
    pub logprobs: Option<i64>,
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
    /// llama-server's `n_probs`: log-probabilities of each token and of the likeliest this many.
    #[serde(default)]
    pub n_probs: Option<i64>,
    /// `n_probs` as probabilities (`prob`, `top_probs`) rather than log-probabilities.
    #[serde(default)]
    pub post_sampling_probs: Option<bool>,
    /// The ids of the answer's tokens in `tokens`.
    #[serde(default)]
    pub return_tokens: Option<bool>,
    /// Only these fields of the answer (`"generation_settings/n_predict"` reaches inside).
    #[serde(default)]
    pub response_fields: Option<Vec<String>>,
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
    #[serde(default)]
    pub top_k: Option<i64>,
    /// `{"TOKEN_ID": bias}`, or `[[TOKEN_ID or "text", bias or false], …]` (llama-server's);
    /// `false` (or -inf) bans the token.
    #[serde(default)]
    pub logit_bias: Value,
    /// GBNF the answer must follow.
    #[serde(default)]
    pub grammar: Option<String>,
    /// A JSON schema the answer must follow (llama-server's field).
    #[serde(default)]
    pub json_schema: Value,
    /// Send `prompt_progress` events while the prompt is evaluated (streams only).
    #[serde(default)]
    pub return_progress: Option<bool>,
    /// Reuse the slot's cached prefix (default: yes).
    #[serde(default)]
    pub cache_prompt: Option<bool>,
    /// Tokens a context shift keeps (llama-server's; -1: the prompt).
    #[serde(default)]
    pub n_keep: Option<i64>,
    /// The slot to run on (llama-server's; -1 or absent: the idle slot sharing the longest
    /// prefix).
    #[serde(default)]
    pub id_slot: Option<i64>,
    /// H2O overrides for this request (extensions of this server).
    #[serde(default)]
    pub h2o_select: Option<String>,
    #[serde(default)]
    pub h2o_sink: Option<i64>,
    #[serde(default)]
    pub h2o_dense_tail: Option<i64>,
    /// `"full"` or `"sparse"` decode for this request, and its sparse decode budget.
    #[serde(default)]
    pub h2o_decode: Option<String>,
    #[serde(default)]
    pub h2o_decode_budget: Option<i64>,
}

impl Body for ChatRequest {
    fn read_shared(&mut self, value: Value) -> Result<(), ApiError> {
        self.common = fields(value)?;
        Ok(())
    }
}

impl Body for CompletionRequest {
    fn read_shared(&mut self, value: Value) -> Result<(), ApiError> {
        self.common = fields(value)?;
        Ok(())
    }
}

impl Body for LlamaCompletionRequest {
    fn read_shared(&mut self, value: Value) -> Result<(), ApiError> {
        self.common = fields(value)?;
        Ok(())
    }
}

/// How the answer is sent, decided from the request.
#[derive(Debug, Default)]
pub struct Delivery {
    pub stream: bool,
    /// OpenAI's `stream_options.include_usage`: one more chunk with `usage` before `[DONE]`.
    pub include_usage: bool,
    /// Log-probabilities in the answer (`logprobs`, `n_probs`).
    pub probs: bool,
    /// `/completion`'s `post_sampling_probs`: probabilities rather than their logs.
    pub probs_linear: bool,
    /// `/completion`'s `return_tokens`.
    pub return_tokens: bool,
    /// `/completion`'s `response_fields`.
    pub response_fields: Option<Vec<String>>,
    /// `return_progress`: `prompt_progress` events in a stream.
    pub progress: bool,
    /// A Jinja-rendered chat's reply parsers, one per choice: the answers' content and tool
    /// calls come from them (empty: the answers are text).
    pub reply_parsers: Vec<ReplyParser>,
}

impl ChatRequest {
    /// The job this request asks for.
    ///
    /// # Errors
    /// A 400 naming the first bad field.
    /// The jobs this request asks for: one per choice (`n`).
    ///
    /// # Errors
    /// A 400 naming the first bad field.
    pub fn into_jobs(
        self,
        info: &EngineInfo,
        jinja: &Jinja,
    ) -> Result<(Vec<Job>, Delivery), ApiError> {
        let n = check_n(self.n, self.stream)?;
        // both given: the newer name wins, as in OpenAI's API
        let (max_param, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        let max_tokens = max_tokens(max_param, max, false, info)?;
        let top = match (self.logprobs, self.top_logprobs) {
            (Some(true), n) => Some(count_field("top_logprobs", n.unwrap_or(0), 20)?),
            (_, Some(_)) => {
                return Err(ApiError::field(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ))
            }
            _ => None,
        };
        // one render per choice: each reply has a parser of its own
        let rendered = if jinja.renders(jinja::is_given(&self.tools))? {
            check_messages(&self.messages)?;
            let fields = ChatFields {
                messages: &self.messages,
                tools: &self.tools,
                tool_choice: &self.tool_choice,
                parallel_tool_calls: self.parallel_tool_calls,
                chat_template_kwargs: &self.chat_template_kwargs,
                reasoning_format: self.reasoning_format.as_deref(),
            };
            (0..n)
                .map(|_| jinja.render(&fields))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let prompt = match rendered.first() {
            Some(r) => Prompt::Text(r.prompt.clone()),
            None => {
                // read as the body's own field, so that an error names the message at fault
                #[derive(Deserialize)]
                struct Messages {
                    messages: Vec<ChatMessageIn>,
                }
                let m: Messages = fields(serde_json::json!({ "messages": self.messages }))?;
                Prompt::Chat(chat_messages(m.messages)?)
            }
        };
        let mut job = job(prompt, &self.common, max_tokens, info)?;
        if let Some(g) = response_format_grammar(&self.response_format)? {
            if job.sampling.grammar.is_some() {
                return Err(ApiError::field(
                    "response_format",
                    "response_format and grammar/json_schema both constrain the answer: send one",
                ));
            }
            job.sampling.grammar = Some(g);
        }
        if let Some(r) = rendered.first() {
            r.configure(&mut job.sampling)?;
        }
        job.sampling.probs = top;
        let mut d = delivery(self.stream, self.stream_options.as_ref(), &self.common);
        d.probs = top.is_some();
        d.reply_parsers = rendered.into_iter().map(|r| r.parser).collect();
        job.progress = d.progress;
        Ok((choices(job, n), d))
    }
}

impl CompletionRequest {
    /// # Errors
    /// A 400 naming the first bad field.
    pub fn into_job(self, info: &EngineInfo) -> Result<(Vec<Job>, Delivery), ApiError> {
        let prompts = prompts(&self.prompt, info)?;
        let n = check_n(self.n, self.stream)?;
        if self.echo == Some(true) {
            return Err(ApiError::field(
                "echo",
                "echo is not supported: leave it out or set it to false",
            ));
        }
        let probs = self
            .logprobs
            .map(|n| count_field("logprobs", n, 20))
            .transpose()?;
        let max_tokens = max_tokens("max_tokens", self.max_tokens, false, info)?;
        let mut d = delivery(self.stream, self.stream_options.as_ref(), &self.common);
        d.probs = probs.is_some();
        let jobs = jobs(prompts, &self.common, max_tokens, probs, &d, info)?;
        // OpenAI's order: the choices of the first prompt, then the second's
        let jobs = jobs.into_iter().flat_map(|j| choices(j, n)).collect();
        Ok((jobs, d))
    }
}

impl LlamaCompletionRequest {
    /// # Errors
    /// A 400 naming the first bad field.
    pub fn into_job(self, info: &EngineInfo) -> Result<(Vec<Job>, Delivery), ApiError> {
        let prompts = prompts(&self.prompt, info)?;
        let max_tokens = max_tokens("n_predict", self.n_predict, true, info)?;
        let probs = match self.n_probs {
            None | Some(0) => None,
            Some(n) => Some(count_field("n_probs", n, 100)?),
        };
        let mut d = delivery(self.stream, None, &self.common);
        d.probs = probs.is_some();
        d.probs_linear = self.post_sampling_probs == Some(true);
        d.return_tokens = self.return_tokens == Some(true);
        d.response_fields = self.response_fields;
        let mut jobs = jobs(prompts, &self.common, max_tokens, probs, &d, info)?;
        for job in &mut jobs {
            job.sampling.post_sampling_probs = d.probs_linear;
        }
        Ok((jobs, d))
    }
}

/// One job per prompt of a completion request (a stream takes one prompt).
fn jobs(
    prompts: Vec<Prompt>,
    common: &Common,
    max_tokens: u32,
    probs: Option<usize>,
    d: &Delivery,
    info: &EngineInfo,
) -> Result<Vec<Job>, ApiError> {
    if d.stream && prompts.len() > 1 {
        return Err(ApiError::field(
            "prompt",
            format!(
                "prompt holds {} prompts, which a stream cannot carry: send them without \
                 stream, or one per request",
                prompts.len()
            ),
        ));
    }
    prompts
        .into_iter()
        .map(|p| {
            let mut job = job(p, common, max_tokens, info)?;
            job.sampling.probs = probs;
            job.progress = d.progress;
            Ok(job)
        })
        .collect()
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
        sampling: sampling(common, max_tokens, info)?,
        h2o: h2o_overrides(common, info)?,
        progress: false,
        cache_prompt: common.cache_prompt.unwrap_or(true),
        n_keep: match common.n_keep {
            None => 0,
            Some(n) if n >= -1 => n,
            Some(n) => {
                return Err(ApiError::field(
                    "n_keep",
                    format!("n_keep must be -1 (the whole prompt) or more, got {n}"),
                ))
            }
        },
        id_slot: match common.id_slot {
            None | Some(-1) => None,
            Some(n) if (0..i64::from(info.n_parallel)).contains(&n) => Some(n as u32),
            Some(n) => {
                return Err(ApiError::field(
                    "id_slot",
                    format!(
                        "id_slot {n}: the server has {} slots (0 to {}), or -1 for any idle one",
                        info.n_parallel,
                        info.n_parallel - 1
                    ),
                ))
            }
        },
    })
}

fn delivery(stream: Option<bool>, options: Option<&StreamOptions>, common: &Common) -> Delivery {
    let stream = stream.unwrap_or(false);
    Delivery {
        stream,
        include_usage: stream && options.is_some_and(|o| o.include_usage),
        progress: stream && common.return_progress == Some(true),
        ..Delivery::default()
    }
}

/// Most choices one request may ask for.
const MAX_CHOICES: i64 = 16;

/// OpenAI's `n`: how many choices, each a job of its own (whole answers only).
fn check_n(n: Option<i64>, stream: Option<bool>) -> Result<usize, ApiError> {
    let n = n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::field(
            "n",
            format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
        ));
    }
    if n > 1 && stream == Some(true) {
        return Err(ApiError::field(
            "n",
            format!("n = {n} choices are answered whole: send stream: false, or n = 1"),
        ));
    }
    Ok(n as usize)
}

/// `n` copies of `job`, each sampled with its own seed (the request's seed, plus its index).
fn choices(job: Job, n: usize) -> Vec<Job> {
    (0..n)
        .map(|i| {
            let mut j = job.clone();
            j.sampling.seed = job.sampling.seed.wrapping_add(i as u32);
            j
        })
        .collect()
}

pub(super) fn json_kind(v: &Value) -> &'static str {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::PromptPiece;
    use h2o_llama::{ChatMessage, Selection};

    fn info(h2o: bool) -> EngineInfo {
        EngineInfo {
            model_id: "m.gguf".into(),
            n_parallel: 2,
            n_ctx_slot: 512,
            n_ubatch: 64,
            flash_attn: h2o_llama::FlashAttention::Off,
            h2o_auto: None,
            fim: h2o_llama::FimTokens::default(),
            h2o: h2o.then(|| h2o_llama::H2oConfig::new(16, 16)),
            created: 0,
            n_vocab: 256,
            aliases: Vec::new(),
            tags: Vec::new(),
            model_file: "m.gguf".into(),
            defaults: crate::engine::RequestDefaults::default(),
        }
    }

    /// As the server reads a body.
    fn parse<T: Body>(body: &Value) -> T {
        crate::body::parse_json(body.to_string().as_bytes()).unwrap()
    }

    fn chat(body: Value, h2o: bool) -> Result<(Job, Delivery), ApiError> {
        chats(body, h2o).map(|(mut jobs, d)| (jobs.remove(0), d))
    }

    fn chats(body: Value, h2o: bool) -> Result<(Vec<Job>, Delivery), ApiError> {
        // no model here: the Jinja templates are out of reach, requests with tools are 400
        let jinja = Jinja {
            mode: crate::jinja::JinjaMode::Tools,
            templates: Err("no model in unit tests".into()),
            reasoning_format: None,
        };
        parse::<ChatRequest>(&body).into_jobs(&info(h2o), &jinja)
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
    fn n_choices_are_jobs_with_their_own_seeds() {
        let user = serde_json::json!([{"role": "user", "content": "hi"}]);
        let (jobs, _) = chats(
            serde_json::json!({"messages": user, "n": 3, "seed": 7}),
            false,
        )
        .unwrap();
        let seeds: Vec<u32> = jobs.iter().map(|j| j.sampling.seed).collect();
        assert_eq!(seeds, [7, 8, 9]);
        let (jobs, _) = chats(serde_json::json!({"messages": user}), false).unwrap();
        assert_eq!(jobs.len(), 1);
    }

    #[test]
    fn defaults_are_the_servers_and_fill_a_slot() {
        let (job, d) = chat(
            serde_json::json!({"messages": [{"role": "user", "content": "x"}]}),
            false,
        )
        .unwrap();
        assert_eq!(job.sampling.max_tokens, 512);
        // llama-server's defaults (RequestDefaults::default)
        assert_eq!(job.sampling.temperature, 0.8);
        assert_eq!(job.sampling.top_k, 40);
        assert_eq!(job.sampling.top_p, 0.95);
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
            (
                serde_json::json!({"messages": user, "n": 2, "stream": true}),
                "n",
            ),
            (serde_json::json!({"messages": user, "n": 0}), "n"),
            (serde_json::json!({"messages": user, "n": 17}), "n"),
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
            serde_json::json!({"messages": user, "h2o_select": "seed", "h2o_sink": 16, "h2o_dense_tail": 0}),
            true,
        )
        .unwrap();
        assert_eq!(job.h2o.select, Some(Selection::Seed));
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
            e.message.contains("use one of seed, hybrid, coverage"),
            "{}",
            e.message
        );
        let e = chat(
            serde_json::json!({"messages": user, "h2o_select": "query"}),
            true,
        )
        .unwrap_err();
        assert!(
            e.message.contains("was retired") && e.message.contains("use hybrid"),
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
    fn a_request_asks_for_full_or_sparse_decode_within_what_the_server_keeps() {
        let user = serde_json::json!([{"role": "user", "content": "x"}]);
        let decode = |body: Value, info: &EngineInfo| -> Result<Option<u32>, ApiError> {
            let jinja = Jinja {
                mode: crate::jinja::JinjaMode::Tools,
                templates: Err("no model in unit tests".into()),
                reasoning_format: None,
            };
            parse::<ChatRequest>(&body)
                .into_jobs(info, &jinja)
                .map(|(mut jobs, _)| jobs.remove(0).h2o.decode_budget)
        };
        let param = |r: Result<Option<u32>, ApiError>| r.unwrap_err().param.unwrap_or_default();
        // a server without sparse decode: full is what it does; sparse it cannot do
        let plain = info(true);
        assert_eq!(
            decode(serde_json::json!({"messages": user}), &plain).unwrap(),
            None
        );
        assert_eq!(
            decode(
                serde_json::json!({"messages": user, "h2o_decode": "full"}),
                &plain
            )
            .unwrap(),
            Some(0)
        );
        for (body, field) in [
            (
                serde_json::json!({"messages": user, "h2o_decode": "sparse"}),
                "h2o_decode",
            ),
            (
                serde_json::json!({"messages": user, "h2o_decode_budget": 64}),
                "h2o_decode_budget",
            ),
            (
                serde_json::json!({"messages": user, "h2o_decode": "fast"}),
                "h2o_decode",
            ),
            (
                serde_json::json!({"messages": user, "h2o_decode": "full", "h2o_decode_budget": 64}),
                "h2o_decode_budget",
            ),
        ] {
            assert_eq!(param(decode(body.clone(), &plain)), field, "{body}");
        }
        // a server with sparse decode, budget 64, slots of 512 tokens
        let mut sparse = info(true);
        sparse.h2o = sparse.h2o.map(|h| h2o_llama::H2oConfig {
            decode_budget: 64,
            ..h
        });
        assert_eq!(
            decode(
                serde_json::json!({"messages": user, "h2o_decode": "sparse"}),
                &sparse
            )
            .unwrap(),
            Some(64)
        );
        assert_eq!(
            decode(
                serde_json::json!({"messages": user, "h2o_decode_budget": 100}),
                &sparse
            )
            .unwrap(),
            Some(100)
        );
        for budget in [8, 513, -1] {
            let body = serde_json::json!({"messages": user, "h2o_decode_budget": budget});
            assert_eq!(
                param(decode(body.clone(), &sparse)),
                "h2o_decode_budget",
                "{body}"
            );
        }
    }

    #[test]
    fn completion_prompts_are_text_token_ids_or_several_of_them() {
        let info = info(false);
        let jobs = |body: Value| -> Result<Vec<Job>, ApiError> {
            parse::<CompletionRequest>(&body)
                .into_job(&info)
                .map(|(jobs, _)| jobs)
        };
        assert!(
            matches!(&jobs(serde_json::json!({"prompt": "a"})).unwrap()[..], [Job { prompt: Prompt::Text(t), .. }] if t == "a")
        );
        assert_eq!(jobs(serde_json::json!({"prompt": ["a"]})).unwrap().len(), 1);
        assert_eq!(
            jobs(serde_json::json!({"prompt": ["a", "b"]}))
                .unwrap()
                .len(),
            2
        );
        assert_eq!(
            jobs(serde_json::json!({"prompt": [[1, 2], "b"]}))
                .unwrap()
                .len(),
            2
        );
        // llama-server's JSON prompt objects, alone and among other prompts
        let object = jobs(serde_json::json!({"prompt": {"prompt_string": "a b"}})).unwrap();
        assert!(
            matches!(&object[..], [Job { prompt: Prompt::Text(t), .. }] if t == "a b"),
            "{object:?}"
        );
        let two = jobs(serde_json::json!({"prompt": [[1, 2], {"prompt_string": [3]}]})).unwrap();
        assert!(
            matches!(&two[..], [_, Job { prompt: Prompt::Tokens(p), .. }] if p == &vec![PromptPiece::Token(3)]),
            "{two:?}"
        );
        let mixed = jobs(serde_json::json!({"prompt": [1, "x", 2]})).unwrap();
        let [Job {
            prompt: Prompt::Tokens(pieces),
            ..
        }] = &mixed[..]
        else {
            panic!("one prompt of tokens and text: {mixed:?}")
        };
        assert_eq!(
            pieces,
            &vec![
                PromptPiece::Token(1),
                PromptPiece::Text("x".into()),
                PromptPiece::Token(2)
            ]
        );
        for (body, param) in [
            (serde_json::json!({"prompt": ""}), "prompt"),
            (serde_json::json!({"prompt": []}), "prompt"),
            (serde_json::json!({"prompt": 1}), "prompt"),
            (serde_json::json!({"prompt": null}), "prompt"),
            (serde_json::json!({"prompt": [1, 256]}), "prompt"),
            (serde_json::json!({"prompt": [1, -1]}), "prompt"),
            (serde_json::json!({"prompt": [1, {}]}), "prompt[0]"),
            (serde_json::json!({"prompt": [[1], ""]}), "prompt[1]"),
            (serde_json::json!({"prompt": {}}), "prompt"),
            (
                serde_json::json!({"prompt": {"prompt_string": 3}}),
                "prompt",
            ),
            (
                serde_json::json!({"prompt": {"prompt_string": "a", "x": 1}}),
                "prompt",
            ),
            (
                serde_json::json!({"prompt": {"prompt_string": "a <__media__>", "multimodal_data": ["AA=="]}}),
                "prompt",
            ),
            (
                serde_json::json!({"prompt": [[1], {"prompt_string": ""}]}),
                "prompt[1].prompt_string",
            ),
        ] {
            let e = jobs(body.clone()).expect_err("should be refused");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        let e = jobs(serde_json::json!({"prompt": ["a", "b"], "stream": true})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let llama = |body: Value| -> Result<(Job, Delivery), ApiError> {
            parse::<LlamaCompletionRequest>(&body)
                .into_job(&info)
                .map(|(mut jobs, d)| (jobs.remove(0), d))
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
