//! A context on a model: evaluate prompts, read logits, generate, reset. What a session is created
//! with lives in `config`, H2O inspection in `h2o`, attention capture in `capture`, each with its
//! own `impl Session` where it needs the context.

mod capture;
mod config;
mod decode_keys;
mod h2o;
mod memory_set;
mod parallel;
mod prefix;
mod state;
mod state_file;
mod state_stream;

pub use config::{FlashAttention, H2oConfig, Selection, SessionConfig};
pub use h2o::H2oState;
#[cfg(not(feature = "stock"))]
pub use memory_set::engine_build_memory_set;
pub use memory_set::MemorySet;
pub use parallel::{AbortCheck, ParallelSession, SeqId};
pub use state::PromptCache;
pub use state_file::Integrity;

/// Every reader of saved-state bytes, on `bytes` (`crate::fuzzing`).
pub(crate) fn parse_saved_state(
    bytes: &[u8],
    n_ctx: u32,
) -> [std::result::Result<usize, String>; 2] {
    let state = state_file::check(bytes).map(|c| c.state);
    [
        state.clone().and_then(|s| state::parse_session(s, n_ctx)),
        state.and_then(|s| parallel::parse_sequence(s, n_ctx)),
    ]
}

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::capture::CaptureSink;
use crate::error::{DecodeError, Error, Result};
use crate::model::{Model, Token};
use crate::sampler::Sampler;
use crate::{backend, sys};

/// Where the time went, for the last [`Session::generate`] (or accumulated evaluations).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prefill: Duration,
    pub generated_tokens: usize,
    pub decode: Duration,
    pub time_to_first_token: Duration,
}

impl Timings {
    /// Prompt tokens per second.
    #[must_use]
    pub fn prefill_tokens_per_second(&self) -> f64 {
        per_second(self.prompt_tokens, self.prefill)
    }

    /// Generated tokens per second, counting the decode steps after the first token.
    #[must_use]
    pub fn decode_tokens_per_second(&self) -> f64 {
        per_second(self.generated_tokens.saturating_sub(1), self.decode)
    }
}

fn per_second(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// The result of [`Session::generate`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct Generation {
    pub tokens: Vec<Token>,
    pub text: String,
    /// True when the model produced an end-of-generation token before `n_predict`.
    pub stopped_at_eog: bool,
    pub timings: Timings,
}

/// An owned `llama_batch` sized for `n_batch` tokens of one sequence.
struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
}

impl Batch {
    fn new(capacity: u32) -> Self {
        // SAFETY: allocates arrays for `capacity` tokens with one seq id each; freed in Drop.
        let raw = unsafe { sys::llama_batch_init(capacity as i32, 0, 1) };
        Self {
            raw,
            capacity: capacity as usize,
        }
    }

    /// Fills the batch with `tokens` at positions `pos0..`, sequence 0; logits only for the
    /// last token when `logits_last`.
    fn fill(&mut self, tokens: &[Token], pos0: u32, logits_last: bool) {
        let n = tokens.len();
        self.fill_with_outputs(tokens, pos0, |i| logits_last && i + 1 == n);
    }

    /// As [`Batch::fill`], with logits for the tokens where `output(i)` holds.
    fn fill_with_outputs(&mut self, tokens: &[Token], pos0: u32, output: impl Fn(usize) -> bool) {
        assert!(tokens.len() <= self.capacity, "batch overflow");
        // SAFETY: all arrays were allocated by llama_batch_init for `capacity` entries and
        // seq_id[i] points to room for one id.
        unsafe {
            for (i, &t) in tokens.iter().enumerate() {
                *self.raw.token.add(i) = t;
                *self.raw.pos.add(i) = (pos0 as usize + i) as i32;
                *self.raw.n_seq_id.add(i) = 1;
                *(*self.raw.seq_id.add(i)) = 0;
                *self.raw.logits.add(i) = i8::from(output(i));
            }
        }
        self.raw.n_tokens = tokens.len() as i32;
    }
}

impl Batch {
    /// Empties the batch for [`Batch::push`].
    fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// Appends one token of sequence `seq` at `pos`.
    fn push(&mut self, token: Token, pos: u32, seq: i32, logits: bool) {
        let i = self.raw.n_tokens as usize;
        assert!(i < self.capacity, "batch overflow");
        // SAFETY: i < capacity; arrays allocated by llama_batch_init with one seq id per token.
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos as i32;
            *self.raw.n_seq_id.add(i) = 1;
            *(*self.raw.seq_id.add(i)) = seq;
            *self.raw.logits.add(i) = i8::from(logits);
        }
        self.raw.n_tokens += 1;
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: allocated by llama_batch_init, freed once.
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

unsafe extern "C" fn abort_requested(data: *mut c_void) -> bool {
    // SAFETY: `data` is the AtomicBool inside the Arc the session keeps alive while registered.
    unsafe { (*(data as *const AtomicBool)).load(Ordering::Relaxed) }
}

/// The first position of a call (at `start`, `len` tokens; `logits`: its last one asks for them)
/// whose queries H2O (`h2o`; `None`: full attention) does not score: all of a one-token call
/// (decode), or the dense tail of a call that ends a prompt; `u32::MAX` when none.
fn unscored_from(h2o: Option<H2oConfig>, start: u32, len: usize, logits: bool) -> u32 {
    let end = start + len as u32;
    match h2o {
        Some(_) if len == 1 => start,
        Some(h2o) if logits && h2o.dense_tail > 0 => end.saturating_sub(h2o.dense_tail).max(start),
        _ => u32::MAX,
    }
}

/// The checks before `tokens` go after `n_past` tokens into a sequence of `n_ctx` cells: not
/// empty, room for them, every id in the vocabulary.
fn check_tokens(model: &Model, n_past: usize, n_ctx: u32, tokens: &[Token]) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    if n_past + tokens.len() > n_ctx as usize {
        return Err(Error::PromptTooLong {
            n_past,
            n_prompt: tokens.len(),
            n_predict: 0,
            n_ctx,
            n_ctx_train: model.n_ctx_train(),
        });
    }
    model.check_tokens(tokens)
}

/// llama.cpp's context parameters for `config`, one sequence (checked by
/// [`SessionConfig::validate`] first).
fn context_params(config: &SessionConfig) -> sys::llama_context_params {
    // SAFETY: default params are plain data; we set scalar fields only.
    let mut cp = unsafe { sys::llama_context_default_params() };
    cp.n_ctx = config.n_ctx;
    cp.n_batch = config.n_batch;
    cp.n_ubatch = config.n_ubatch;
    cp.n_seq_max = 1;
    cp.n_threads = config.n_threads as i32;
    cp.n_threads_batch = config.n_threads as i32;
    cp.flash_attn_type = match config.flash_attn {
        FlashAttention::Auto => sys::LLAMA_FLASH_ATTN_TYPE_AUTO,
        FlashAttention::On => sys::LLAMA_FLASH_ATTN_TYPE_ENABLED,
        FlashAttention::Off => sys::LLAMA_FLASH_ATTN_TYPE_DISABLED,
    };
    cp.type_k = config.cache_type_k.to_sys();
    cp.type_v = config.cache_type_v.to_sys();
    cp.no_perf = false;
    #[cfg(not(feature = "stock"))]
    if let Some(h2o) = config.h2o.filter(H2oConfig::is_enabled) {
        // validate() bounded M = L + H by n_ubatch, so both fit in i32
        cp.h2o_local = h2o.local as i32;
        cp.h2o_heavy = h2o.heavy as i32;
        cp.h2o_select = h2o.select.to_sys();
        cp.h2o_sink = h2o.sink as i32; // <= heavy (validate())
        cp.h2o_dense_tail = i32::try_from(h2o.dense_tail).unwrap_or(i32::MAX);
        cp.h2o_coverage = h2o.coverage;
        cp.h2o_tile_samples = h2o.tile_samples as i32; // <= 64 (validate())
        cp.h2o_tile_sketch = h2o.tile_sketch as i32; // <= 8 (validate())
        cp.h2o_tile_pool = i32::try_from(h2o.tile_pool).unwrap_or(i32::MAX);
        cp.h2o_undo_log = config.h2o_undo_log;
        cp.h2o_decode_budget = i32::try_from(h2o.decode_budget).unwrap_or(i32::MAX);
        cp.h2o_decode_coverage = h2o.decode_coverage;
    }
    cp
}

/// A llama.cpp context on a [`Model`], holding one sequence's KV cache.
///
/// Tokens are appended with [`Session::evaluate`] (prompt) and [`Session::generate`]
/// (prompt + sampling); [`Session::reset`] empties the cache.
pub struct Session<'m> {
    model: &'m Model,
    ctx: NonNull<sys::llama_context>,
    batch: Batch,
    config: SessionConfig,
    n_ctx: u32,
    n_past: u32,
    /// The tokens in the cache, in order (`n_past` of them): what a saved state records.
    tokens: Vec<Token>,
    /// H2O bookkeeping for [`Session::truncate`]: the end of the last prompt call (a call of more
    /// than one token; what comes after it was decoded, which leaves the H2O state alone), and
    /// the first position from which the H2O state may differ from a fresh prefill of the same
    /// tokens (a dense tail scores nothing, nor does a one-token call).
    prompt_end: u32,
    fresh_until: u32,
    has_logits: bool,
    interrupt: Option<Arc<AtomicBool>>,
    /// Filled by llama.cpp's eval callback when `capture_attention` is on; boxed so that the
    /// address handed to llama.cpp stays put. Dropped after the context (see Drop).
    capture: Option<Box<CaptureSink>>,
    /// What sparse decode steps read since the last prompt call, where a step's count follows
    /// its attention (`decode_coverage` below 1).
    decode_keys: decode_keys::DecodeKeys,
}

// SAFETY: a llama_context may move between threads; it is only used through &mut self.
unsafe impl Send for Session<'_> {}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // SAFETY: owned context, freed once, before the model it borrows.
        unsafe { sys::llama_free(self.ctx.as_ptr()) }
    }
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("config", &self.config)
            .field("n_ctx", &self.n_ctx)
            .field("n_past", &self.n_past)
            .finish()
    }
}

impl<'m> Session<'m> {
    /// Creates a context on `model`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for bad parameters (see [`SessionConfig::validate`]);
    /// [`Error::ContextInit`] with llama.cpp's reason when it cannot create the context.
    pub fn new(model: &'m Model, config: SessionConfig) -> Result<Self> {
        config.validate()?;
        let config = config.for_model(model);
        backend::init();
        #[allow(unused_mut)] // the attention capture sets the eval callback
        let mut cp = context_params(&config);
        let capture = config
            .capture_attention
            .then(|| Box::new(CaptureSink::default()));
        #[cfg(not(feature = "stock"))]
        if let Some(sink) = &capture {
            cp.cb_eval = Some(crate::capture::eval_callback);
            cp.cb_eval_user_data = (&**sink as *const CaptureSink).cast_mut().cast();
        }
        backend::clear_recent_log();
        // SAFETY: model outlives the context (lifetime 'm); ownership of the result is ours.
        let raw = unsafe { sys::llama_init_from_model(model.as_ptr(), cp) };
        let ctx = NonNull::new(raw).ok_or_else(|| {
            crate::rpc::allocation_error(backend::recent_log_reason(), |reason| {
                Error::ContextInit { reason }
            })
        })?;
        // SAFETY: valid context.
        let n_ctx = unsafe { sys::llama_n_ctx(ctx.as_ptr()) };
        // llama.cpp caps n_batch at the requested n_ctx (and n_ubatch at n_batch); a batch
        // larger than the capped n_batch would fail its assert, so batch by what is in effect.
        let mut config = config;
        // SAFETY: valid context.
        (config.n_batch, config.n_ubatch) = unsafe {
            (
                sys::llama_n_batch(ctx.as_ptr()),
                sys::llama_n_ubatch(ctx.as_ptr()),
            )
        };
        let batch = Batch::new(config.n_batch);
        Ok(Self {
            model,
            ctx,
            batch,
            config,
            n_ctx,
            n_past: 0,
            prompt_end: 0,
            fresh_until: u32::MAX,
            tokens: Vec::new(),
            has_logits: false,
            interrupt: None,
            capture,
            decode_keys: decode_keys::DecodeKeys::default(),
        })
    }

    /// The model this session runs.
    #[must_use]
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The parameters this session was created with, with `n_batch` and `n_ubatch` as llama.cpp
    /// put them into effect (capped at the context size) and what they left to the model chosen
    /// ([`SessionConfig::for_model`]).
    #[must_use]
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Context size actually allocated (llama.cpp may round up).
    #[must_use]
    pub fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    /// Tokens currently in the KV cache.
    #[must_use]
    pub fn n_past(&self) -> u32 {
        self.n_past
    }

    /// The tokens in the KV cache, in order: what the session has evaluated since it was
    /// created, reset or loaded (prompt and generated tokens).
    #[must_use]
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }

    /// Registers a flag that, once set (e.g. by a Ctrl-C handler), makes the running and every
    /// later evaluation stop with [`Error::Interrupted`].
    pub fn set_interrupt_flag(&mut self, flag: Arc<AtomicBool>) {
        // SAFETY: the Arc stored in `self.interrupt` keeps the AtomicBool alive for as long as
        // the callback is registered (the context is freed before `self.interrupt` drops).
        unsafe {
            sys::llama_set_abort_callback(
                self.ctx.as_ptr(),
                Some(abort_requested),
                Arc::as_ptr(&flag) as *mut c_void,
            );
        }
        self.interrupt = Some(flag);
    }

    /// Empties the KV cache (and any per-sequence state); the next evaluation starts at 0.
    pub fn reset(&mut self) {
        // SAFETY: valid context; clearing with data = true also zeroes the buffers.
        unsafe { sys::llama_memory_clear(sys::llama_get_memory(self.ctx.as_ptr()), true) };
        if let Some(sink) = &self.capture {
            sink.clear();
        }
        self.n_past = 0;
        self.tokens.clear();
        self.prompt_end = 0;
        self.fresh_until = u32::MAX;
        self.has_logits = false;
        self.decode_keys = decode_keys::DecodeKeys::default();
    }

    /// Appends `tokens` to the sequence, in `llama_decode` calls of at most `n_batch` tokens.
    /// Afterwards [`Session::logits`] holds the next-token logits after the last token.
    ///
    /// # Errors
    /// [`Error::EmptyPrompt`] for no tokens; [`Error::PromptTooLong`] when they do not fit in
    /// the context; [`Error::Interrupted`] when the interrupt flag was set (the cache is then
    /// reset); [`Error::Decode`] for other llama.cpp failures.
    pub fn evaluate(&mut self, tokens: &[Token]) -> Result<()> {
        self.evaluate_with_progress(tokens, |_, _| {})
    }

    /// [`Session::evaluate`], calling `progress(done, total)` after every `llama_decode` call.
    ///
    /// # Errors
    /// As [`Session::evaluate`].
    pub fn evaluate_with_progress(
        &mut self,
        tokens: &[Token],
        progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        self.evaluate_in_calls(tokens, false, true, progress)
    }

    /// Evaluates `tokens` in calls of at most `n_batch`; with `aligned`, the calls end at
    /// multiples of `n_batch` as those of a session that evaluated everything from position 0.
    /// With `logits`, the last token's next-token logits are computed (and, under H2O, the last
    /// call's dense tail runs); without, the tokens are a prompt's first part, as a prompt batch
    /// that outputs no logits leaves them.
    fn evaluate_in_calls(
        &mut self,
        tokens: &[Token],
        aligned: bool,
        logits: bool,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        self.check_prompt(tokens)?;
        self.has_logits = false;
        let n_batch = self.config.n_batch as usize;
        let mut done = 0;
        while done < tokens.len() {
            let room = if aligned {
                n_batch - self.n_past as usize % n_batch
            } else {
                n_batch
            };
            let piece = &tokens[done..tokens.len().min(done + room)];
            let last = logits && done + piece.len() == tokens.len();
            self.batch.fill(piece, self.n_past, last);
            self.decode_batch()?;
            let start = self.n_past;
            self.n_past += piece.len() as u32;
            self.decode_keys
                .record(self.ctx, 0, piece.len(), self.n_past, self.h2o());
            self.tokens.extend_from_slice(piece);
            if piece.len() > 1 {
                self.prompt_end = self.n_past;
            }
            self.fresh_until = self
                .fresh_until
                .min(self.unscored_from(start, piece.len(), last));
            done += piece.len();
            progress(done, tokens.len());
        }
        self.has_logits = logits;
        Ok(())
    }

    /// The keys a query head read per decode step after a prompt of `n_prompt` tokens (the
    /// steps up to [`Session::n_past`]; 0 for none): as llama.cpp counted them where a step's
    /// count follows its attention (`decode_coverage` below 1), else
    /// [`H2oConfig::mean_decode_keys`], which is then exact.
    #[must_use]
    pub fn decode_keys_per_step(&self, n_prompt: usize) -> f64 {
        let first = u32::try_from(n_prompt)
            .unwrap_or(u32::MAX)
            .saturating_add(1);
        self.decode_keys
            .per_step(self.config.h2o, first, self.n_past)
    }

    /// The H2O settings the context runs with (`None` for full attention, L = H = 0 included).
    fn h2o(&self) -> Option<H2oConfig> {
        self.config.h2o.filter(H2oConfig::is_enabled)
    }

    /// The first position of a call (at `start`, `len` tokens; `logits`: its last one asks for
    /// them) whose queries H2O does not score: all of a one-token call (decode), or the dense
    /// tail of a call that ends a prompt.
    fn unscored_from(&self, start: u32, len: usize, logits: bool) -> u32 {
        unscored_from(self.h2o(), start, len, logits)
    }

    /// Runs `llama_decode` on the filled batch, mapping failures (an interrupted or aborted
    /// decode resets the cache).
    fn decode_batch(&mut self) -> Result<()> {
        // SAFETY: valid context and a batch filled within its capacity.
        let rc = unsafe { sys::llama_decode(self.ctx.as_ptr(), self.batch.raw) };
        if rc == 0 {
            return Ok(());
        }
        let err = DecodeError::from_code(rc);
        if err == DecodeError::Aborted || self.interrupted() {
            // Part of the batch may be in the cache: start clean rather than guess.
            self.reset();
            return Err(Error::Interrupted);
        }
        Err(Error::Decode(err))
    }

    /// The checks every evaluation makes before touching the cache.
    fn check_prompt(&self, tokens: &[Token]) -> Result<()> {
        check_tokens(self.model, self.n_past as usize, self.n_ctx, tokens)
    }

    /// Appends `tokens` like [`Session::evaluate`], and hands the next-token logits after every
    /// token to `each(i, logits)` (`i` indexes `tokens`), call by call, so that at most
    /// `n_batch` rows are held at once. Afterwards [`Session::logits`] is the last token's.
    ///
    /// # Errors
    /// As [`Session::evaluate`].
    pub fn evaluate_with_logits(
        &mut self,
        tokens: &[Token],
        mut each: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        self.check_prompt(tokens)?;
        self.has_logits = false;
        let n_vocab = self.model.n_vocab();
        let mut done = 0;
        for piece in tokens.chunks(self.config.n_batch as usize) {
            self.batch.fill_with_outputs(piece, self.n_past, |_| true);
            self.decode_batch()?;
            for i in 0..piece.len() {
                // SAFETY: the batch asked for logits of every token; llama.cpp keeps them until
                // the next decode, which needs &mut self.
                let row = unsafe {
                    let p = sys::llama_get_logits_ith(self.ctx.as_ptr(), i as i32);
                    (!p.is_null()).then(|| std::slice::from_raw_parts(p, n_vocab))
                };
                let row = row.ok_or(Error::MissingLogits(i))?;
                each(done + i, row);
            }
            self.n_past += piece.len() as u32;
            self.tokens.extend_from_slice(piece);
            done += piece.len();
        }
        self.has_logits = true;
        Ok(())
    }

    fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Next-token logits after the last evaluated token (`n_vocab` values), or `None` before
    /// any evaluation.
    #[must_use]
    pub fn logits(&self) -> Option<&[f32]> {
        if !self.has_logits {
            return None;
        }
        // SAFETY: the last decode requested logits for its last token; llama.cpp keeps them
        // until the next decode, which needs &mut self.
        unsafe {
            let p = sys::llama_get_logits_ith(self.ctx.as_ptr(), -1);
            if p.is_null() {
                None
            } else {
                Some(std::slice::from_raw_parts(p, self.model.n_vocab()))
            }
        }
    }

    /// Evaluates `prompt`, then samples up to `n_predict` tokens, stopping early at an
    /// end-of-generation token or when `on_text` returns false. `on_text` receives the
    /// generated text in complete UTF-8 pieces as it is produced.
    ///
    /// An empty `prompt` continues from the last evaluation (e.g. after reading
    /// [`Session::logits`] of a prompt given to [`Session::evaluate`]); its timings then count
    /// no prefill.
    ///
    /// # Errors
    /// As [`Session::evaluate`]; [`Error::PromptTooLong`] also when prompt + `n_predict`
    /// exceeds the context.
    pub fn generate(
        &mut self,
        prompt: &[Token],
        sampler: &mut Sampler,
        n_predict: usize,
        on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        self.generate_with_progress(prompt, sampler, n_predict, |_, _| {}, on_text)
    }

    /// [`Session::generate`], calling `progress(done, total)` as prompt tokens are evaluated
    /// (after every `llama_decode` call of the prefill).
    ///
    /// # Errors
    /// As [`Session::generate`].
    pub fn generate_with_progress(
        &mut self,
        prompt: &[Token],
        sampler: &mut Sampler,
        n_predict: usize,
        progress: impl FnMut(usize, usize),
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let needed = self.n_past as usize + prompt.len() + n_predict;
        if needed > self.n_ctx as usize {
            return Err(Error::PromptTooLong {
                n_past: self.n_past as usize,
                n_prompt: prompt.len(),
                n_predict,
                n_ctx: self.n_ctx,
                n_ctx_train: self.model.n_ctx_train(),
            });
        }
        let mut timings = Timings {
            prompt_tokens: prompt.len(),
            ..Timings::default()
        };
        let start = Instant::now();
        if !prompt.is_empty() || !self.has_logits {
            self.evaluate_with_progress(prompt, progress)?;
        }
        timings.prefill = start.elapsed();

        let mut tokens = Vec::new();
        let mut text = String::new();
        let mut pending: Vec<u8> = Vec::new();
        let mut stopped_at_eog = false;
        let decode_start = Instant::now();
        while tokens.len() < n_predict {
            let token = sampler.sample(self.ctx.as_ptr());
            if tokens.is_empty() {
                timings.time_to_first_token = start.elapsed();
            }
            if self.model.is_end_of_generation(token) {
                stopped_at_eog = true;
                break;
            }
            tokens.push(token);
            pending.extend(self.model.token_bytes(token, false)?);
            let valid = match std::str::from_utf8(&pending) {
                Ok(s) => s.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(), // incomplete tail: wait
                Err(_) => pending.len(),                              // invalid: flush lossily
            };
            let piece = String::from_utf8_lossy(&pending[..valid]).into_owned();
            pending.drain(..valid);
            text.push_str(&piece);
            let keep_going = piece.is_empty() || on_text(&piece);
            if !keep_going || tokens.len() == n_predict {
                break;
            }
            self.evaluate(&[token])?;
        }
        if !pending.is_empty() {
            let piece = String::from_utf8_lossy(&pending).into_owned();
            on_text(&piece);
            text.push_str(&piece);
        }
        timings.generated_tokens = tokens.len();
        timings.decode = decode_start.elapsed();
        Ok(Generation {
            tokens,
            text,
            stopped_at_eog,
            timings,
        })
    }
}
