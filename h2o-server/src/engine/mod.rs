//! The engine: one llama.cpp context with `n_parallel` slots (sequences), run on its own thread.
//! The HTTP layer talks to it only through [`EngineHandle`]: it submits a [`Job`] and reads the
//! job's [`Event`]s from a channel. Dropping the receiver cancels the job and frees its slot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use h2o_llama::{
    ChatMessage, FlashAttention, H2oConfig, Model, Selection, SessionConfig, Token, TokenLogprobs,
};

/// What a library error says, without the "invalid configuration: " its `Display` puts before
/// a bad setting's reason (the HTTP layer's 400 names the field instead).
pub fn library_reason(e: h2o_llama::Error) -> String {
    match e {
        h2o_llama::Error::InvalidConfig(m) => m,
        other => other.to_string(),
    }
}

/// What the engine is started with (from the command line).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_path: std::path::PathBuf,
    /// Total context (`-c`), shared by the slots: each slot gets `n_ctx / n_parallel`; 0 = the
    /// model's training context per slot.
    pub n_ctx: u32,
    pub n_parallel: u32,
    /// Every slot's session: batches, threads, flash attention, cache types and H2O (its
    /// `n_ctx` is the slot's, which the engine derives from `n_ctx` above).
    pub session: SessionConfig,
    /// Where H2O turned on by itself with `n_ctx` 0: the slots' session instead when the
    /// model's training context, which each slot then gets, holds no prompt long enough for H2O
    /// (`H2oConfig::automatic_for`): full attention with the flags' full-attention batches.
    pub session_if_short: Option<SessionConfig>,
    /// With `--h2o auto`, what it came to (before `session_if_short` is known to apply).
    pub h2o_auto: Option<h2o_flags::AutoDecision>,
    /// How to load the model: `-ngl`, `--rpc`, `--no-repack`.
    pub model_params: h2o_llama::ModelParams,
    /// Jobs waiting for a slot beyond which `submit` answers [`SubmitError::QueueFull`].
    pub queue_capacity: usize,
    /// `--chat-template`: one of llama.cpp's built-in templates by name, or a template's text,
    /// in place of the model's own.
    pub chat_template: Option<String>,
    /// `--jinja`, `--no-jinja` or neither.
    pub jinja: JinjaMode,
    /// `--context-shift`: a generation that fills its slot drops half of what follows the kept
    /// tokens and goes on (full attention only).
    pub context_shift: bool,
    /// `--kv-unified`: the slots share one KV cache of `n_ctx` cells.
    pub kv_unified: bool,
    /// `--reasoning-format`: the default of requests' `reasoning_format`.
    pub reasoning_format: Option<String>,
    /// Jinja source in place of the model's template for the Jinja path (`--chat-template-file`,
    /// or a `--chat-template` that is Jinja text).
    pub jinja_template: Option<String>,
    /// `--alias`, split at commas.
    pub aliases: Vec<String>,
    /// `--tags`, split at commas.
    pub tags: Vec<String>,
    pub defaults: RequestDefaults,
}

/// Fixed facts about the running engine, for `/v1/models`, `/health` and `/props`.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// The model's file name, as `/v1/models` lists it.
    pub model_id: String,
    pub n_parallel: u32,
    /// Context per slot: the longest prompt + completion one request can have.
    pub n_ctx_slot: u32,
    pub n_ubatch: u32,
    /// Flash attention in effect (auto is off with more than one slot).
    pub flash_attn: FlashAttention,
    pub h2o: Option<H2oConfig>,
    /// With `--h2o auto`, what it came to: on, scaled to the chunks, or full attention, and why.
    pub h2o_auto: Option<h2o_flags::AutoDecision>,
    /// The vocabulary's fill-in-the-middle tokens (`/infill` needs them).
    pub fim: h2o_llama::FimTokens,
    /// The model's vocabulary size.
    pub n_vocab: usize,
    /// Unix seconds at start.
    pub created: u64,
    /// `--alias`: the model's names, the first in sorted order its id (as llama-server's);
    /// empty: the file name is the id.
    pub aliases: Vec<String>,
    /// `--tags`, listed with the model.
    pub tags: Vec<String>,
    /// The model's file name (`/props` `model_path`).
    pub model_file: String,
    /// What a request that leaves a sampling field out gets (`--temp`, `--seed`, …).
    pub defaults: RequestDefaults,
}

/// The server-wide sampling defaults (`--temp`, `--top-k`, `--top-p`, `--seed`, `-n`), as
/// llama-server's: a request's own fields override them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RequestDefaults {
    pub temperature: f64,
    pub top_k: i32,
    pub top_p: f64,
    /// -1: a random seed per request.
    pub seed: i64,
    /// -1: until the end of generation or a full slot.
    pub n_predict: i64,
}

impl Default for RequestDefaults {
    /// llama-server's defaults.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: -1,
            n_predict: -1,
        }
    }
}

/// The prompt of a job: raw text (`/v1/completions`, `/completion`), token ids (llama-server's
/// `prompt` as an array, whose strings are tokenized without special tokens in place), or a
/// conversation rendered with the model's chat template (`/v1/chat/completions`).
#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<PromptPiece>),
    Chat(Vec<ChatMessage>),
    /// llama-server's `/infill`: laid out with the model's fill-in-the-middle tokens
    /// ([`infill::infill_tokens`]).
    Infill(Infill),
}

/// What `/infill` completes: the code before and after the cursor, other files of the
/// project, and text that starts the completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Infill {
    pub prefix: String,
    pub suffix: String,
    pub extra: Vec<InfillChunk>,
    pub prompt: String,
    /// The request's `n_predict` (-1: to the end of the slot), which the layout leaves room for.
    pub n_predict: i64,
}

/// One file of `/infill`'s `input_extra`.
#[derive(Debug, Clone, PartialEq)]
pub struct InfillChunk {
    pub filename: String,
    pub text: String,
}

/// One element of a mixed `prompt` array: a token id, or text.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptPiece {
    Token(Token),
    Text(String),
}

/// Sampling settings of one job (validated by the HTTP layer).
#[derive(Debug, Clone)]
pub struct Sampling {
    pub max_tokens: u32,
    /// <= 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: i32,
    pub top_p: f32,
    pub seed: u32,
    /// Generation stops before the first occurrence of any of these; the text returned ends
    /// before it.
    pub stop: Vec<String>,
    /// Added to these tokens' logits (`logit_bias`); checked against the vocabulary.
    pub logit_bias: Vec<(Token, f32)>,
    /// Added to the logits of every token of these texts (`logit_bias` keyed by text, as
    /// llama-server takes it); tokenized by the engine.
    pub logit_bias_text: Vec<(String, f32)>,
    /// GBNF every answer must follow (`grammar`, or made from `json_schema`/`response_format`),
    /// and the request field it came from, for the 400 when llama.cpp cannot parse it.
    pub grammar: Option<(String, &'static str)>,
    /// `Some`: the grammar is lazy (a chat template's optional tool call), binding from the
    /// first trigger on.
    pub grammar_triggers: Option<h2o_llama::GrammarTriggers>,
    /// Tokens the grammar takes before the first sampled one (a chat template's generation
    /// prompt, which its tool call grammar starts with).
    pub grammar_prefill: Vec<Token>,
    /// Special tokens of a chat template's tool call format, kept in the answer's text for its
    /// parser (others are left out, as llama-server does).
    pub preserved_tokens: Vec<Token>,
    /// Log-probabilities of each generated token and of the `n_probs` most likely (0: none;
    /// `logprobs` asked with no top list: the token's own only).
    pub probs: Option<usize>,
    /// `probs` from the distribution the sampler drew from, after its cuts (llama-server's
    /// `post_sampling_probs`), rather than from the model's raw softmax.
    pub post_sampling_probs: bool,
}

/// Per-request H2O settings (extra body fields `h2o_select`, `h2o_sink`, `h2o_dense_tail`,
/// `h2o_decode`, `h2o_decode_budget`); `None` keeps the server's setting. L and H are the
/// server's (`--h2o-local/--h2o-heavy`).
#[derive(Debug, Clone, Default)]
pub struct H2oOverrides {
    pub select: Option<Selection>,
    pub sink: Option<u32>,
    pub dense_tail: Option<u32>,
    /// The request's sparse decode budget (0: full-attention decode).
    pub decode_budget: Option<u32>,
}

impl H2oOverrides {
    /// No field set: the server's settings.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.select.is_none()
            && self.sink.is_none()
            && self.dense_tail.is_none()
            && self.decode_budget.is_none()
    }
}

#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: Prompt,
    pub sampling: Sampling,
    pub h2o: H2oOverrides,
    /// Send [`Event::Progress`] after each prompt call (llama-server's `return_progress`).
    pub progress: bool,
    /// Reuse the slot's cached prefix (llama-server's `cache_prompt`, on by default); off, the
    /// prompt is evaluated whole.
    pub cache_prompt: bool,
    /// Tokens a context shift keeps at the start (llama-server's `n_keep`; -1: the prompt), a
    /// BOS besides.
    pub n_keep: i64,
    /// The slot the job must run on (llama-server's `id_slot`; `None`: the free slot sharing the
    /// longest prefix). A job for a busy slot waits for it; later jobs may start before it.
    pub id_slot: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-generation token.
    Stop,
    /// One of the request's stop strings (OpenAI reports it as "stop").
    StopWord,
    /// `max_tokens` reached.
    Length,
    /// The slot's context is full (llama-server's `truncated`): a `max_tokens` beyond the room
    /// left ends here, it is not an error.
    ContextFull,
}

impl FinishReason {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop | Self::StopWord => "stop",
            Self::Length | Self::ContextFull => "length",
        }
    }
}

/// llama-server's `timings` object, plus the H2O figures of the prefill.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct JobTimings {
    /// Prompt tokens evaluated for this job (those reused from the slot's cache not counted).
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub prompt_per_token_ms: f64,
    pub prompt_per_second: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    pub predicted_per_token_ms: f64,
    pub predicted_per_second: f64,
    /// Prompt tokens kept from the slot's previous job (prefix reuse).
    pub cache_n: usize,
    /// Time from the job's arrival to its first generated token (queueing included).
    pub ttft_ms: f64,
    /// H2O: chunks of the prompt, how many of them ran sparse and how many of its tokens took
    /// the dense tail (both as llama.cpp counted them), M = L + H, and the policy; all zero /
    /// "full" without H2O.
    pub h2o_chunks: u32,
    pub h2o_sparse_chunks: u32,
    pub h2o_dense_tail_tokens: u32,
    pub h2o_memory_size: u32,
    pub h2o_policy: String,
    /// Keys each decode step of this job read per head, on average: every cached position with
    /// full-attention decode, fewer with `--h2o-decode sparse`.
    pub h2o_decode_keys_per_step: f64,
    /// The context was shifted to make room (llama-server's `truncated`).
    #[serde(skip)]
    pub context_shifted: bool,
}

/// What a job reports, in this order: `Started`, any number of `Token`, then `Done`; or
/// `Failed` at any point (and nothing after it). The client's errors (`PromptTooLong`,
/// `EmptyPrompt`, `Template`) always come instead of `Started`.
#[derive(Debug, Clone)]
pub enum Event {
    Started {
        slot: u32,
        prompt_tokens: usize,
        /// The prompt's tokens, as evaluated (after the chat template).
        prompt: Vec<Token>,
    },
    /// The prompt's evaluation so far (only for jobs that asked for it): `processed` of
    /// `total` tokens, `cache` of them reused from the slot.
    Progress {
        total: usize,
        cache: usize,
        processed: usize,
        time_ms: f64,
    },
    /// A piece of generated text (complete UTF-8; bytes of a split character wait for the rest,
    /// and text that may begin a stop string waits for the tokens that decide), with the tokens
    /// generated since the last piece and their log-probabilities when the job asked for them.
    Token {
        text: String,
        tokens: Vec<Token>,
        probs: Vec<TokenLogprobs>,
    },
    Done {
        finish: FinishReason,
        completion_tokens: usize,
        prompt_tokens: usize,
        timings: JobTimings,
    },
    Failed(JobError),
}

/// Why a job failed. `PromptTooLong`, `EmptyPrompt` and `Template` are the client's fault (HTTP
/// 400); `Engine` is the server's (500); `ShuttingDown` is a 503.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    #[error("the request exceeds the available context size: the prompt has {n_prompt} tokens, but a slot's context holds {n_ctx_slot} (prompt + completion): shorten the prompt or start the server with a larger -c")]
    PromptTooLong { n_prompt: usize, n_ctx_slot: u32 },
    #[error("the prompt is empty: send at least one token of text")]
    EmptyPrompt,
    #[error("{0}")]
    Template(String),
    /// A token id of a `prompt` array outside the vocabulary.
    #[error("{0}")]
    BadPrompt(String),
    /// The sampling settings llama.cpp refused (a grammar it cannot parse), with the request
    /// field they came from.
    #[error("{message}")]
    Sampling {
        param: &'static str,
        message: String,
    },
    #[error("engine error: {0}")]
    Engine(String),
    #[error("the server is shutting down: the request was cancelled")]
    ShuttingDown,
}

/// What `POST /slots/{id}?action=…` asks of a free slot (llama-server's slot save and restore).
#[derive(Debug, Clone)]
pub enum SlotOp {
    /// Save the slot's sequence (tokens, KV cells, H2O state) to this file.
    Save(std::path::PathBuf),
    /// Replace the slot's sequence with one saved to this file.
    Restore(std::path::PathBuf),
    /// Empty the slot.
    Erase,
}

/// What a slot operation did: tokens saved, restored or erased, and file bytes.
#[derive(Debug, Clone, Copy)]
pub struct SlotOpDone {
    pub n_tokens: usize,
    pub n_bytes: usize,
    pub ms: f64,
    /// A restore from a file saved without a checksum (before checked state files): used
    /// unchecked.
    pub unverified: bool,
}

/// Why a slot operation was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SlotOpError {
    #[error("there is no slot {id}: this server has slots 0 to {}", .n - 1)]
    NoSuchSlot { id: u32, n: u32 },
    #[error("slot {0} is serving a request: try again when it is idle (GET /slots)")]
    Busy(u32),
    /// The save or the restore failed (llama.cpp's or the file system's reason).
    #[error("{0}")]
    Failed(String),
    #[error("the server is shutting down")]
    ShuttingDown,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum SubmitError {
    #[error(
        "the server is busy: {queued} requests are waiting for a slot; retry in {retry_after_s} s"
    )]
    QueueFull { queued: usize, retry_after_s: u64 },
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// What `GET /slots` shows of one slot (llama-server's fields, and the slot's H2O state), kept
/// up to date by the engine at each step.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SlotView {
    pub id: u32,
    /// The running job's number, -1 when idle.
    pub id_task: i64,
    pub n_ctx: u32,
    pub is_processing: bool,
    /// Tokens in the slot's sequence (a finished job's stay, for the next request to reuse).
    pub n_past: usize,
    pub next_token: NextTokenView,
    /// `None` with full attention.
    pub h2o: Option<SlotH2oView>,
    /// The running job's sampling (`None` when idle), which `/slots` shows as llama-server's
    /// `params`.
    #[serde(skip)]
    pub sampling: Option<Sampling>,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct NextTokenView {
    pub has_next_token: bool,
    pub n_remain: i64,
    pub n_decoded: usize,
}

/// A slot's H2O state: the policy and memory its job runs with, and what llama.cpp counted
/// while the job's prompt ran.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SlotH2oView {
    pub policy: String,
    pub memory_size: u32,
    pub local: u32,
    pub heavy: u32,
    /// Prompt tokens evaluated so far, of `prompt_tokens`.
    pub prompt_tokens: usize,
    pub prompt_processed: usize,
    pub sparse_chunks: u32,
    pub dense_tail_tokens: u32,
    /// Prompt tokens kept from the slot's previous job (prefix reuse).
    pub tokens_reused: usize,
}

/// Counters for `/metrics` (Prometheus text), updated by the engine.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests_total: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generated_tokens_total: AtomicU64,
    /// Microseconds spent in prompt evaluation / decode steps.
    pub prefill_us_total: AtomicU64,
    /// Prompt tokens reused from a slot's cache instead of evaluated.
    pub prompt_tokens_cached_total: AtomicU64,
    pub decode_us_total: AtomicU64,
    pub slots_busy: AtomicU64,
    pub queue_len: AtomicU64,
}

impl Metrics {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// The HTTP layer's side of the engine; cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) tx: std::sync::mpsc::SyncSender<worker::Command>,
    /// Set by [`EngineHandle::shutdown`]; a llama.cpp call in progress checks it.
    pub(crate) stopping: Arc<std::sync::atomic::AtomicBool>,
    /// The engine's model, for tokenizing outside the engine thread (llama.cpp's vocabulary is
    /// read-only once loaded).
    pub(crate) model: Arc<Model>,
    pub(crate) info: Arc<EngineInfo>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) slots: Arc<std::sync::Mutex<Vec<SlotView>>>,
    pub(crate) chat_template: Option<String>,
    pub(crate) jinja: Jinja,
    pub(crate) queue_capacity: usize,
    pub(crate) thread: Arc<std::sync::Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl EngineHandle {
    #[must_use]
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    #[must_use]
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Each slot as the engine last left it.
    #[must_use]
    pub fn slots(&self) -> Vec<SlotView> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The server's Jinja chat templates (`--jinja`, `--no-jinja`).
    #[must_use]
    pub fn jinja(&self) -> &Jinja {
        &self.jinja
    }

    /// llama.cpp's built-in chat template (or `--chat-template`'s) applied to `messages`, with
    /// the assistant's turn opened.
    ///
    /// # Errors
    /// The template is not one llama.cpp knows, or a message has a NUL byte.
    pub fn render_builtin(&self, messages: &[ChatMessage]) -> Result<String, JobError> {
        worker::render_chat(&self.model, self.chat_template.as_deref(), messages)
    }

    /// The model's tokens for `text` (llama-server's `/tokenize`).
    ///
    /// # Errors
    /// The text has a NUL byte, or llama.cpp cannot tokenize it.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, h2o_llama::Error> {
        self.model.tokenize(text, add_special, parse_special)
    }

    /// The bytes of one token's text, special tokens included (`/tokenize` with pieces).
    ///
    /// # Errors
    /// The token is not in the vocabulary.
    pub fn token_piece(&self, token: Token) -> Result<Vec<u8>, h2o_llama::Error> {
        self.model.token_bytes(token, true)
    }

    /// The text of `tokens`, control tokens included (`/detokenize`, as llama-server's).
    ///
    /// # Errors
    /// A token is not in the vocabulary.
    pub fn detokenize(&self, tokens: &[Token]) -> Result<String, h2o_llama::Error> {
        self.model.detokenize(tokens, true)
    }

    /// Runs `op` on slot `id` between the engine's steps.
    ///
    /// # Errors
    /// [`SlotOpError`]: no such slot, the slot is busy, the operation failed, or the server is
    /// stopping.
    pub async fn slot_op(&self, id: u32, op: SlotOp) -> Result<SlotOpDone, SlotOpError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx
            .try_send(worker::Command::Slot(id, op, tx))
            .map_err(|_| SlotOpError::ShuttingDown)?;
        rx.await.unwrap_or(Err(SlotOpError::ShuttingDown))
    }

    /// Queues a job. Its events arrive on the returned receiver; dropping the receiver cancels
    /// the job (the engine frees its slot at its next step).
    ///
    /// # Errors
    /// [`SubmitError::QueueFull`] when `queue_capacity` jobs already wait for a slot,
    /// [`SubmitError::ShuttingDown`] after [`EngineHandle::shutdown`].
    pub fn submit(
        &self,
        job: Job,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, SubmitError> {
        worker::submit(self, job)
    }

    /// Stops taking jobs, cancels queued and running ones (their receivers get
    /// `Failed(ShuttingDown)`), and returns once the engine thread has stopped.
    pub fn shutdown(&self) {
        worker::shutdown(self);
    }
}

pub mod infill;
mod templates;
mod worker;
pub use templates::{Jinja, JinjaMode};
pub use worker::start;
