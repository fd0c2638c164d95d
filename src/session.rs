//! A context on a model: evaluate prompts, read logits, generate, reset.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::capture::{AttentionCapture, CaptureSink};
use crate::error::{DecodeError, Error, H2oError, Result};
use crate::model::{Model, Token};
use crate::sampler::Sampler;
use crate::{backend, sys};

/// H2O sparse-prefill parameters: the memory each chunk attends to holds the last `local`
/// tokens of the previous chunk and the `heavy` highest-scoring earlier tokens.
/// `local = heavy = 0` turns H2O off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct H2oConfig {
    /// L: recent tokens kept from the previous chunk.
    pub local: u32,
    /// H: heavy hitters kept by accumulated attention score.
    pub heavy: u32,
}

impl H2oConfig {
    /// M = L + H, the memory set size.
    #[must_use]
    pub fn memory_size(&self) -> u64 {
        u64::from(self.local) + u64::from(self.heavy)
    }

    /// False for L = H = 0, which means stock attention.
    #[must_use]
    pub fn is_enabled(&self) -> bool {
        self.memory_size() > 0
    }
}

/// When to use flash attention (`-fa on|off|auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum FlashAttention {
    #[default]
    Auto,
    On,
    Off,
}

/// Context parameters. Defaults follow llama.cpp's (`n_ctx` 0 = the model's training context).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SessionConfig {
    /// Context size in tokens (`-c`); 0 = the model's training context.
    pub n_ctx: u32,
    /// Logical batch: the most tokens handed to one `llama_decode` call (`-b`). Like
    /// llama.cpp, a session caps it at `n_ctx`; [`Session::config`] reports the value in effect.
    pub n_batch: u32,
    /// Physical batch, which is also the H2O chunk size S (`-ub`); capped at `n_batch`.
    pub n_ubatch: u32,
    /// CPU threads (`-t`).
    pub n_threads: u32,
    pub flash_attn: FlashAttention,
    /// H2O sparse prefill; `None` (or L = H = 0) is stock attention.
    pub h2o: Option<H2oConfig>,
    /// Copy every H2O attention op's inputs and output out of the graph, for checks against
    /// [`crate::reference`] (see [`Session::take_attention_captures`]). Slow and memory-hungry:
    /// for verification on short prompts only.
    pub capture_attention: bool,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            n_ctx: 0,
            n_batch: 2048,
            n_ubatch: 512,
            n_threads: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(4),
            flash_attn: FlashAttention::Auto,
            h2o: None,
            capture_attention: false,
        }
    }
}

impl SessionConfig {
    /// Checks the parameters without touching llama.cpp.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the bad parameter and what to use instead.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.n_batch == 0 {
            return bad("batch size (-b) must be at least 1".into());
        }
        if self.n_ubatch == 0 {
            return bad("micro-batch size (-ub) must be at least 1".into());
        }
        if self.n_ubatch > self.n_batch {
            return bad(format!(
                "micro-batch size -ub {} is larger than batch size -b {}: use -ub <= -b",
                self.n_ubatch, self.n_batch
            ));
        }
        if self.n_threads == 0 {
            return bad("thread count (-t) must be at least 1".into());
        }
        if let Some(h2o) = self.h2o.filter(H2oConfig::is_enabled) {
            // the chunk size S in effect: llama.cpp caps -b at -c (when given) and -ub at -b
            let chunk = match self.n_ctx {
                0 => self.n_ubatch,
                c => self.n_ubatch.min(c),
            };
            if h2o.memory_size() >= u64::from(chunk) {
                let (limit, fix) = if chunk < self.n_ubatch {
                    (
                        format!(
                            "the chunk size, which the context -c {chunk} caps at {chunk} (-ub {})",
                            self.n_ubatch
                        ),
                        "raise -c or lower L/H",
                    )
                } else {
                    (
                        format!("the chunk size -ub {chunk}"),
                        "lower L/H or raise -ub",
                    )
                };
                return bad(format!(
                    "H2O memory M = --h2o-local {} + --h2o-heavy {} = {} must be smaller than {limit}: {fix}",
                    h2o.local,
                    h2o.heavy,
                    h2o.memory_size()
                ));
            }
            if cfg!(feature = "stock") {
                return bad("this build is the stock llama.cpp engine (feature `stock`), which has no H2O: \
                            build without that feature, or run without --h2o-local/--h2o-heavy"
                    .into());
            }
        }
        if self.capture_attention && cfg!(feature = "stock") {
            return bad("attention capture reads the H2O op, which the stock engine (feature `stock`) lacks".into());
        }
        Ok(())
    }
}

/// The H2O state a session holds (see [`Session::h2o_state`]): its shape, its size and how far
/// the chunked prefill has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct H2oState {
    /// L.
    pub local: u32,
    /// H.
    pub heavy: u32,
    /// M = L + H, the slots of a memory set.
    pub memory_size: u32,
    /// S = `n_ubatch`, positions per chunk.
    pub chunk_size: u32,
    /// Layers with H2O state.
    pub n_layer: u32,
    /// Query heads per layer; memory sets and scores are per query head.
    pub n_head: u32,
    /// Cache cells, which are the positions the scores cover.
    pub kv_size: u32,
    /// Chunks completed since the last reset.
    pub chunks_done: u32,
    /// Prompt positions in those chunks.
    pub tokens_done: u32,
    /// Whether a memory set has been built since the last reset.
    pub memory_initialized: bool,
    /// Bytes of the score and memory-index tensors of all layers.
    pub size_bytes: u64,
}

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
    has_logits: bool,
    interrupt: Option<Arc<AtomicBool>>,
    /// Filled by llama.cpp's eval callback when `capture_attention` is on; boxed so that the
    /// address handed to llama.cpp stays put. Dropped after the context (see Drop).
    capture: Option<Box<CaptureSink>>,
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
        backend::init();
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
        cp.no_perf = false;
        #[cfg(not(feature = "stock"))]
        if let Some(h2o) = config.h2o.filter(H2oConfig::is_enabled) {
            // validate() bounded M = L + H by n_ubatch, so both fit in i32
            cp.h2o_local = h2o.local as i32;
            cp.h2o_heavy = h2o.heavy as i32;
        }
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
        let ctx = NonNull::new(raw).ok_or_else(|| Error::ContextInit {
            reason: backend::recent_log_reason(),
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
            has_logits: false,
            interrupt: None,
            capture,
        })
    }

    /// The model this session runs.
    #[must_use]
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The parameters this session was created with, with `n_batch` and `n_ubatch` as llama.cpp
    /// put them into effect (capped at the context size).
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

    /// The H2O state, or `None` when the session runs full attention.
    #[must_use]
    pub fn h2o_state(&self) -> Option<H2oState> {
        #[cfg(feature = "stock")]
        {
            None
        }
        #[cfg(not(feature = "stock"))]
        {
            // SAFETY: plain-data out parameter, valid context.
            let mut info: sys::llama_h2o_info = unsafe { std::mem::zeroed() };
            let rc = unsafe { sys::llama_h2o_get_info(self.ctx.as_ptr(), &mut info) };
            (rc == sys::LLAMA_H2O_STATUS_OK).then_some(H2oState {
                local: info.n_local as u32,
                heavy: info.n_heavy as u32,
                memory_size: info.n_memory as u32,
                chunk_size: info.n_chunk as u32,
                n_layer: info.n_layer as u32,
                n_head: info.n_head as u32,
                kv_size: info.kv_size as u32,
                chunks_done: info.n_chunks_done as u32,
                tokens_done: info.n_tokens_done as u32,
                memory_initialized: info.memory_initialized,
                size_bytes: info.size_bytes as u64,
            })
        }
    }

    /// The memory set of `layer`, query `head`: the positions the next chunk attends to besides
    /// its own, as the engine stores them (ascending, unused slots −1).
    ///
    /// # Errors
    /// [`Error::H2o`]: no H2O state, or `layer`/`head` out of range.
    pub fn h2o_memory_set(&self, layer: u32, head: u32) -> Result<crate::reference::MemorySet> {
        let state = self.h2o_state().ok_or(H2oError::Disabled)?;
        self.check_h2o_head(&state, layer, head)?;
        #[allow(unused_mut)] // filled by the FFI call, which stock builds lack
        let mut slots = vec![-1i32; state.memory_size as usize];
        #[cfg(not(feature = "stock"))]
        {
            // SAFETY: `slots` has room for the M values written; layer/head were checked.
            let rc = unsafe {
                sys::llama_h2o_get_memory_indices(
                    self.ctx.as_ptr(),
                    layer as i32,
                    head as i32,
                    slots.as_mut_ptr(),
                    slots.len(),
                )
            };
            h2o_status(rc, &state, layer, head, 0..0)?;
        }
        Ok(crate::reference::MemorySet { slots })
    }

    /// Accumulated attention scores of `layer`, query `head`, for `positions` (F32 values of the
    /// BF16 store).
    ///
    /// # Errors
    /// [`Error::H2o`]: no H2O state, `layer`/`head` out of range, or positions outside the cache.
    pub fn h2o_scores(
        &self,
        layer: u32,
        head: u32,
        positions: std::ops::Range<u32>,
    ) -> Result<Vec<f32>> {
        let state = self.h2o_state().ok_or(H2oError::Disabled)?;
        self.check_h2o_head(&state, layer, head)?;
        if positions.start > positions.end || positions.end > state.kv_size {
            return Err(H2oError::InvalidRange {
                start: positions.start.into(),
                end: positions.end.into(),
                kv_size: state.kv_size,
            }
            .into());
        }
        #[allow(unused_mut)] // filled by the FFI call, which stock builds lack
        let mut scores = vec![0f32; positions.len()];
        #[cfg(not(feature = "stock"))]
        {
            // SAFETY: `scores` has room for the n values written; arguments were checked.
            let rc = unsafe {
                sys::llama_h2o_get_scores(
                    self.ctx.as_ptr(),
                    layer as i32,
                    head as i32,
                    positions.start as i32,
                    scores.len() as i32,
                    scores.as_mut_ptr(),
                )
            };
            h2o_status(rc, &state, layer, head, positions)?;
        }
        Ok(scores)
    }

    fn check_h2o_head(&self, state: &H2oState, layer: u32, head: u32) -> Result<()> {
        if layer >= state.n_layer {
            return Err(H2oError::InvalidLayer {
                layer,
                n_layer: state.n_layer,
            }
            .into());
        }
        if head >= state.n_head {
            return Err(H2oError::InvalidHead {
                head,
                n_head: state.n_head,
            }
            .into());
        }
        Ok(())
    }

    /// The H2O attention ops run since the last call, one [`AttentionCapture`] per layer and
    /// `llama_decode` call, in the order they ran.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the session was created without
    /// [`SessionConfig::capture_attention`]; [`Error::Capture`] when a node could not be read.
    pub fn take_attention_captures(&mut self) -> Result<Vec<AttentionCapture>> {
        let sink = self.capture.as_ref().ok_or_else(|| {
            Error::InvalidConfig(
                "attention capture is off: create the session with capture_attention = true".into(),
            )
        })?;
        sink.take().map_err(Error::Capture)
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
        self.has_logits = false;
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
        mut progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        self.check_prompt(tokens)?;
        self.has_logits = false;
        let mut done = 0;
        for piece in tokens.chunks(self.config.n_batch as usize) {
            let last = done + piece.len() == tokens.len();
            self.batch.fill(piece, self.n_past, last);
            self.decode_batch()?;
            self.n_past += piece.len() as u32;
            done += piece.len();
            progress(done, tokens.len());
        }
        self.has_logits = true;
        Ok(())
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
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let total = self.n_past as usize + tokens.len();
        if total > self.n_ctx as usize {
            return Err(Error::PromptTooLong {
                n_past: self.n_past as usize,
                n_prompt: tokens.len(),
                n_predict: 0,
                n_ctx: self.n_ctx,
                n_ctx_train: self.model.n_ctx_train(),
            });
        }
        let vocab = self.model.n_vocab() as i32;
        if let Some(&bad) = tokens.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(Error::Tokenize(format!(
                "token id {bad} is outside the vocabulary (0..{vocab})"
            )));
        }
        Ok(())
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
            pending.extend(self.model.token_bytes(token, false));
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

/// Maps a `llama_h2o_*` return value (count or negative `llama_h2o_status`) to a typed error.
#[cfg(not(feature = "stock"))]
fn h2o_status(
    rc: i32,
    state: &H2oState,
    layer: u32,
    head: u32,
    positions: std::ops::Range<u32>,
) -> Result<()> {
    if rc >= 0 {
        return Ok(());
    }
    Err(match rc {
        sys::LLAMA_H2O_STATUS_DISABLED => H2oError::Disabled,
        sys::LLAMA_H2O_STATUS_INVALID_LAYER => H2oError::InvalidLayer {
            layer,
            n_layer: state.n_layer,
        },
        sys::LLAMA_H2O_STATUS_INVALID_HEAD => H2oError::InvalidHead {
            head,
            n_head: state.n_head,
        },
        sys::LLAMA_H2O_STATUS_INVALID_RANGE => H2oError::InvalidRange {
            start: positions.start.into(),
            end: positions.end.into(),
            kv_size: state.kv_size,
        },
        other => H2oError::Other(other),
    }
    .into())
}
