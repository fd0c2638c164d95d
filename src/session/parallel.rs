//! Several sequences on one context, as a server's slots: each sequence has its own KV stream
//! and, with H2O, its own H2O state, its prompt evaluated in calls the caller
//! interleaves with decode steps of all sequences in one `llama_decode` (continuous batching).
//!
//! A sequence's results are those of a [`Session`](super::Session) holding it alone, bit for bit:
//! its prompt calls are the calls a session makes, prefix reuse keeps only what a fresh prefill
//! would reach unchanged (the rules of [`Session::evaluate_reusing`](super::Session::evaluate_reusing)),
//! and a decode step of several sequences gives each the logits of its own step. For that last
//! point flash attention is off with more than one sequence: llama.cpp's CPU flash-attention
//! kernel (at the pinned version) gives one stream of a multi-stream decode ubatch other logits
//! than alone (max |diff| 0.40 on SmolLM2; `tests/cpp/test-h2o-kv-cache.cpp`, "several
//! sequences"), with or without H2O.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use super::prefix::reusable;
use super::{unscored_from, Batch, FlashAttention, H2oConfig, H2oState, SessionConfig};
use crate::error::{DecodeError, Error, Result};
use crate::model::{Model, Token};
use crate::sampler::Sampler;
use crate::{backend, sys};

mod state;
pub(crate) use state::parse_sequence;

/// A sequence of a [`ParallelSession`]: `0 .. n_seq`.
pub type SeqId = u32;

/// Asked by llama.cpp during a call whether to stop it (true: stop); see
/// [`ParallelSession::prefill_with_abort`].
pub type AbortCheck<'a> = &'a (dyn Fn() -> bool + Sync);

/// What a sequence holds, and the H2O bookkeeping prefix reuse needs (as in `Session`).
#[derive(Debug, Clone)]
struct SeqBook {
    tokens: Vec<Token>,
    /// End of the last prompt call (more than one token).
    prompt_end: u32,
    /// First position whose H2O state may differ from a fresh prefill's.
    fresh_until: u32,
    /// The memory selection this sequence runs (L and H are the context's).
    h2o: Option<H2oConfig>,
    /// What its sparse decode steps read since its last prompt call (see `Session`'s).
    decode_keys: super::decode_keys::DecodeKeys,
}

impl SeqBook {
    fn empty(h2o: Option<H2oConfig>) -> Self {
        Self {
            tokens: Vec::new(),
            prompt_end: 0,
            fresh_until: u32::MAX,
            h2o,
            decode_keys: super::decode_keys::DecodeKeys::default(),
        }
    }

    fn n_past(&self) -> u32 {
        self.tokens.len() as u32
    }
}

/// What a sequence's prompt state depends on: its selection, not its decode budget.
fn selection(h2o: Option<H2oConfig>) -> Option<H2oConfig> {
    h2o.map(|h| H2oConfig {
        decode_budget: 0,
        decode_coverage: 1.0,
        ..h
    })
}

/// One llama.cpp context serving `n_seq` sequences, each with its own KV stream of
/// `n_ctx_seq` cells and its own H2O state.
pub struct ParallelSession<'m> {
    model: &'m Model,
    ctx: NonNull<sys::llama_context>,
    batch: Batch,
    config: SessionConfig,
    n_ctx_seq: u32,
    /// The sequences share one KV cache of `n_ctx_seq` cells ([`Self::with_unified_cache`]).
    unified: bool,
    seqs: Vec<SeqBook>,
}

// SAFETY: a llama_context may move between threads; it is only used through &mut self.
unsafe impl Send for ParallelSession<'_> {}

impl Drop for ParallelSession<'_> {
    fn drop(&mut self) {
        // SAFETY: owned context, freed once, before the model it borrows.
        unsafe { sys::llama_free(self.ctx.as_ptr()) }
    }
}

impl std::fmt::Debug for ParallelSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelSession")
            .field("config", &self.config)
            .field("n_seq", &self.seqs.len())
            .field("n_ctx_seq", &self.n_ctx_seq)
            .finish()
    }
}

impl<'m> ParallelSession<'m> {
    /// Creates a context on `model` for `n_seq` sequences; `config.n_ctx` is the context of
    /// each (0: the model's training context), so the KV cache holds `n_seq` times that.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for bad parameters or `n_seq` outside `1..=256`;
    /// [`Error::ContextInit`] with llama.cpp's reason when it cannot create the context.
    pub fn new(model: &'m Model, config: SessionConfig, n_seq: u32) -> Result<Self> {
        Self::create(model, config, n_seq, false)
    }

    /// Creates a context on `model` whose `n_seq` sequences share one KV cache of
    /// `config.n_ctx` cells (llama.cpp's `kv_unified`, llama-server's `--kv-unified`): any of
    /// them may grow to the whole cache while the others leave room, and a step that finds no
    /// room fails with [`DecodeError::NoKvSlot`].
    ///
    /// # Errors
    /// As [`ParallelSession::new`]; with H2O, [`Error::InvalidConfig`]: each sequence keeps its
    /// H2O state with its own KV stream, which a unified cache does not have.
    pub fn with_unified_cache(model: &'m Model, config: SessionConfig, n_seq: u32) -> Result<Self> {
        if config.h2o.is_some_and(|h| h.is_enabled()) {
            return Err(Error::InvalidConfig(
                "a unified KV cache (--kv-unified) holds every sequence in one stream, and H2O \
                 keeps each sequence's scores and memory sets with its own stream: use full \
                 attention or leave the cache per sequence"
                    .into(),
            ));
        }
        Self::create(model, config, n_seq, true)
    }

    fn create(model: &'m Model, config: SessionConfig, n_seq: u32, unified: bool) -> Result<Self> {
        config.validate()?;
        if config.capture_attention {
            return Err(Error::InvalidConfig(
                "attention capture serves one sequence: use a Session".into(),
            ));
        }
        if !(1..=256).contains(&n_seq) {
            return Err(Error::InvalidConfig(format!(
                "{n_seq} sequences (-np): use 1 to 256"
            )));
        }
        backend::init();
        let mut config = config.for_model(model);
        // see the module documentation; a quantized V cache needs flash attention, as llama.cpp
        // says, so auto stays auto (on) with one
        if n_seq > 1
            && config.flash_attn == FlashAttention::Auto
            && !config.cache_type_v.is_quantized()
        {
            config.flash_attn = FlashAttention::Off;
        }
        let n_ctx_seq = match config.n_ctx {
            0 => model.n_ctx_train(),
            c => c,
        };
        let mut cp = super::context_params(&config);
        cp.n_ctx = if unified {
            n_ctx_seq
        } else {
            n_ctx_seq.saturating_mul(n_seq)
        };
        cp.n_seq_max = n_seq;
        cp.kv_unified = unified;
        backend::clear_recent_log();
        // SAFETY: model outlives the context (lifetime 'm); ownership of the result is ours.
        let raw = unsafe { sys::llama_init_from_model(model.as_ptr(), cp) };
        let ctx = NonNull::new(raw).ok_or_else(|| {
            crate::rpc::allocation_error(backend::recent_log_reason(), |reason| {
                Error::ContextInit { reason }
            })
        })?;
        // SAFETY: valid context. llama.cpp pads each sequence's context to 256 cells and caps
        // n_batch at n_ctx and n_ubatch at n_batch: use what is in effect, but hold each
        // sequence to the context it asked for (as llama-server's slots hold -c / -np); the
        // padding cells stay unused.
        let n_ctx_seq = unsafe { sys::llama_n_ctx_seq(ctx.as_ptr()) }.min(n_ctx_seq);
        (config.n_batch, config.n_ubatch) = unsafe {
            (
                sys::llama_n_batch(ctx.as_ptr()),
                sys::llama_n_ubatch(ctx.as_ptr()),
            )
        };
        config.n_ctx = n_ctx_seq;
        let h2o = config.h2o.filter(H2oConfig::is_enabled);
        Ok(Self {
            model,
            ctx,
            batch: Batch::new(config.n_batch.max(n_seq)),
            config,
            n_ctx_seq,
            unified,
            seqs: vec![SeqBook::empty(h2o); n_seq as usize],
        })
    }

    /// The model this session runs.
    #[must_use]
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The parameters in effect (`n_ctx` per sequence, `n_batch` and `n_ubatch` as capped, what
    /// they left to the model chosen: [`SessionConfig::for_model`]).
    #[must_use]
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    #[must_use]
    pub fn n_seq(&self) -> u32 {
        self.seqs.len() as u32
    }

    /// Cells of each sequence: the longest prompt + completion it holds.
    #[must_use]
    pub fn n_ctx_seq(&self) -> u32 {
        self.n_ctx_seq
    }

    /// Cells no sequence holds, when the sequences share one cache ([`Self::with_unified_cache`];
    /// `None` with a stream per sequence, where each has its own `n_ctx_seq`).
    #[must_use]
    pub fn unified_cells_free(&self) -> Option<usize> {
        self.unified.then(|| {
            let used: usize = self.seqs.iter().map(|s| s.tokens.len()).sum();
            (self.n_ctx_seq as usize).saturating_sub(used)
        })
    }

    /// The tokens sequence `seq` holds, in order.
    ///
    /// # Panics
    /// When `seq >= n_seq`.
    #[must_use]
    pub fn tokens(&self, seq: SeqId) -> &[Token] {
        &self.seqs[seq as usize].tokens
    }

    /// The keys a query head of `seq` read per decode step after a prompt of `n_prompt`
    /// tokens, over the steps that saw `n_prompt + 1 ..= last` positions: as llama.cpp counted
    /// them where a step's count follows its attention (`decode_coverage` below 1), else
    /// [`H2oConfig::mean_decode_keys`] of the sequence's settings, which is then exact.
    #[must_use]
    pub fn decode_keys_per_step(&self, seq: SeqId, n_prompt: u32, last: u32) -> f64 {
        self.seqs.get(seq as usize).map_or(0.0, |book| {
            book.decode_keys.per_step(book.h2o, n_prompt + 1, last)
        })
    }

    /// The memory selection sequence `seq` runs (`None`: full attention).
    #[must_use]
    pub fn h2o(&self, seq: SeqId) -> Option<H2oConfig> {
        self.seqs.get(seq as usize).and_then(|b| b.h2o)
    }

    /// Empties sequence `seq`; its memory selection goes back to the context's.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a sequence outside `0..n_seq`.
    pub fn clear(&mut self, seq: SeqId) -> Result<()> {
        self.check_seq(seq)?;
        // SAFETY: valid context and memory; seq < n_seq_max.
        unsafe {
            sys::llama_memory_seq_rm(sys::llama_get_memory(self.ctx.as_ptr()), seq as i32, -1, -1);
        }
        self.seqs[seq as usize] = SeqBook::empty(self.config.h2o.filter(H2oConfig::is_enabled));
        Ok(())
    }

    /// Prepares sequence `seq` for `prompt` with memory selection `h2o` (its `local` and
    /// `heavy` must be the context's, and so must what is set for the whole context: coverage
    /// selection's target, samples and sketch, where a sketch left out is the context's, and
    /// sparse decode's coverage; `None`: the context's selection): keeps the longest
    /// prefix of what the sequence holds that a fresh prefill of `prompt` would reach unchanged
    /// (with H2O, up to a chunk boundary; none when the selection changes), and returns how many
    /// tokens it kept. Evaluate the rest, `prompt[kept..]`, with [`ParallelSession::prefill`].
    ///
    /// `h2o.decode_budget` is the sequence's own sparse decode budget (0: full-attention
    /// decode), which needs a context with sparse decode on when it is not 0. It changes
    /// nothing the prompt builds, so it keeps the prefix; the sequences decoding together in a
    /// step each read their own budget.
    ///
    /// # Errors
    /// [`Error::EmptyPrompt`]; [`Error::PromptTooLong`] when `prompt` does not fit the
    /// sequence's context; [`Error::InvalidConfig`] for a bad sequence, selection or decode
    /// budget.
    pub fn start_prompt(
        &mut self,
        seq: SeqId,
        prompt: &[Token],
        h2o: Option<H2oConfig>,
    ) -> Result<usize> {
        self.check_seq(seq)?;
        // the prompt replaces what the sequence holds, so it has the whole context
        super::check_tokens(self.model, 0, self.n_ctx_seq, prompt)?;
        let default = self.config.h2o.filter(H2oConfig::is_enabled);
        let want = h2o.filter(H2oConfig::is_enabled).or(default);
        if let (Some(w), Some(d)) = (want, default) {
            if (w.local, w.heavy) != (d.local, d.heavy) || w.sink > w.heavy {
                return Err(Error::InvalidConfig(format!(
                    "a sequence's H2O memory is the context's L = {}, H = {} with a sink of at most H \
                     (asked: L = {}, H = {}, sink {})",
                    d.local, d.heavy, w.local, w.heavy, w.sink
                )));
            }
        } else if want != default {
            return Err(Error::InvalidConfig(
                "H2O per sequence needs a context with H2O on (--h2o-local/--h2o-heavy)".into(),
            ));
        }
        let want = match (want, default) {
            (Some(w), Some(d)) => Some(Self::context_wide(w, d)?),
            (w, _) => w,
        };
        if let (Some(w), Some(d)) = (want, default) {
            self.check_decode_budget(w.decode_budget, d.decode_budget)?;
        }
        let book = &self.seqs[seq as usize];
        let keep = if selection(book.h2o) == selection(want) {
            let common = super::state::common_prefix(&book.tokens, prompt).min(prompt.len() - 1);
            reusable(
                book.h2o,
                &self.config,
                prompt.len() as u32,
                common as u32,
                book.fresh_until,
            )
        } else {
            0
        };
        let kept = self.rewind(seq, keep);
        // kept > 0 only where the selection stays; an emptied sequence runs the context's
        if selection(want) != selection(self.seqs[seq as usize].h2o) {
            self.set_selection(seq, want)?;
        }
        self.set_decode_budget(seq, want)?;
        Ok(kept as usize)
    }

    /// A sequence's selection `w` with what is set for the whole context `d` (coverage
    /// selection's target, samples, sketch and pool, sparse decode's coverage): the context's, a sketch
    /// or a pool left out ([`H2oConfig::TILE_SKETCH_BY_HEAD`], [`H2oConfig::TILE_POOL_BY_BACKEND`])
    /// included, or an error naming the flag.
    fn context_wide(w: H2oConfig, d: H2oConfig) -> Result<H2oConfig> {
        let w = H2oConfig {
            tile_sketch: match w.tile_sketch {
                H2oConfig::TILE_SKETCH_BY_HEAD => d.tile_sketch,
                n => n,
            },
            tile_pool: match w.tile_pool {
                H2oConfig::TILE_POOL_BY_BACKEND => d.tile_pool,
                n => n,
            },
            ..w
        };
        let fields = [
            (
                "sparse decode coverage --h2o-decode-coverage",
                d.decode_coverage.to_string(),
                w.decode_coverage.to_string(),
            ),
            (
                "coverage target --h2o-coverage",
                d.coverage.to_string(),
                w.coverage.to_string(),
            ),
            (
                "--h2o-tile-samples",
                d.tile_samples.to_string(),
                w.tile_samples.to_string(),
            ),
            (
                "--h2o-tile-sketch",
                d.tile_sketch.to_string(),
                w.tile_sketch.to_string(),
            ),
            (
                "--h2o-tile-pool",
                d.tile_pool.to_string(),
                w.tile_pool.to_string(),
            ),
        ];
        if let Some((flag, context, asked)) = fields.into_iter().find(|(_, c, a)| c != a) {
            return Err(Error::InvalidConfig(format!(
                "a sequence's {flag} is the context's ({context}; asked: {asked}): it is set for \
                 the whole context"
            )));
        }
        Ok(w)
    }

    /// A sequence's decode budget `want` where the context's is `context`: 0 (full attention)
    /// anywhere, else a context with sparse decode and a budget as `--h2o-decode-budget` takes.
    fn check_decode_budget(&self, want: u32, context: u32) -> Result<()> {
        if want == context || want == 0 {
            return Ok(());
        }
        if context == 0 {
            return Err(Error::InvalidConfig(format!(
                "a sequence's sparse decode budget ({want}) needs a context with sparse decode on \
                 (h2o decode_budget > 0, --h2o-decode sparse), which keeps the key sketches"
            )));
        }
        if want < H2oConfig::DECODE_BLOCK || want > self.n_ctx_seq {
            return Err(Error::InvalidConfig(format!(
                "a sequence's sparse decode budget must be 0 (full attention) or between {} and its \
                 context of {} positions, got {want}",
                H2oConfig::DECODE_BLOCK,
                self.n_ctx_seq
            )));
        }
        Ok(())
    }

    /// Gives sequence `seq` the decode budget of `h2o` in llama.cpp (its own, or the context's
    /// where they agree), then books `h2o` as the sequence's.
    fn set_decode_budget(&mut self, seq: SeqId, h2o: Option<H2oConfig>) -> Result<()> {
        // a stock build has no sparse decode to set
        #[cfg(not(feature = "stock"))]
        {
            let context = self.config.h2o.map_or(0, |h| h.decode_budget);
            if context > 0 {
                let own = h2o.map_or(context, |h| h.decode_budget);
                // 0 is full attention: a budget that covers the sequence's context
                let n_budget = match own {
                    o if o == context => -1,
                    0 => i32::try_from(self.n_ctx_seq).unwrap_or(i32::MAX),
                    o => i32::try_from(o).unwrap_or(i32::MAX),
                };
                // SAFETY: valid context; llama.cpp checks every argument.
                let rc = unsafe {
                    sys::llama_h2o_set_seq_decode(self.ctx.as_ptr(), seq as i32, n_budget)
                };
                if rc != sys::LLAMA_H2O_STATUS_OK {
                    return Err(Error::InvalidConfig(format!(
                        "llama.cpp refused the sparse decode budget {own} for sequence {seq} (status {rc})"
                    )));
                }
            }
        }
        self.seqs[seq as usize].h2o = h2o;
        Ok(())
    }

    /// Evaluates the next call of a prompt's remaining tokens `rest` in sequence `seq`: as many
    /// as a fresh session's call holds there (up to the next multiple of `n_batch`), at most
    /// `limit` (a server passes `n_ubatch`, one chunk, while other sequences wait for their next
    /// token; H2O's state does not depend on how a prompt is split, so only a dense tail is kept
    /// whole in the last call, as a fresh session has it), with next-token logits for the last token of `rest` when this call
    /// reaches it (then [`ParallelSession::sample_last`] samples it). Returns how many tokens
    /// it evaluated.
    ///
    /// # Errors
    /// As [`Session::evaluate`](super::Session::evaluate); a failed call leaves the sequence
    /// empty.
    pub fn prefill(&mut self, seq: SeqId, rest: &[Token], limit: usize) -> Result<usize> {
        self.prefill_inner(seq, rest, limit, None)
    }

    /// [`ParallelSession::prefill`], stopped early when `abort` says so: llama.cpp's CPU
    /// backend asks it between the operations of its graphs, and once it returns true the call
    /// ends with [`Error::Interrupted`] and the sequence is emptied (the others are untouched).
    /// A server stops a long prompt call this way when its client has gone. Operations on a GPU
    /// run to their end.
    ///
    /// # Errors
    /// As [`ParallelSession::prefill`]; [`Error::Interrupted`] when stopped.
    pub fn prefill_with_abort(
        &mut self,
        seq: SeqId,
        rest: &[Token],
        limit: usize,
        abort: AbortCheck<'_>,
    ) -> Result<usize> {
        self.prefill_inner(seq, rest, limit, Some(abort))
    }

    fn prefill_inner(
        &mut self,
        seq: SeqId,
        rest: &[Token],
        limit: usize,
        abort: Option<AbortCheck<'_>>,
    ) -> Result<usize> {
        self.check_seq(seq)?;
        self.check_tokens(seq, rest)?;
        let n_batch = self.config.n_batch as usize;
        let start = self.seqs[seq as usize].n_past();
        let mut len = rest
            .len()
            .min((n_batch - start as usize % n_batch).min(limit.max(1)));
        if let Some(tail_start) = self.dense_tail_start(seq, start as usize + rest.len()) {
            // the chunk holding the dense tail's start, and the rest of the prompt, go in one
            // call, as in a fresh session's last call: with the hybrid selection, a chunk split
            // between a call without logits and the call with the dense tail selects other
            // memory than a fresh prefill (measured on SmolLM2: other greedy tokens)
            let s = self.config.n_ubatch as usize;
            let tail_start = tail_start / s * s;
            let end = start as usize + len;
            if end > tail_start && end < start as usize + rest.len() {
                len = if tail_start > start as usize {
                    tail_start - start as usize
                } else {
                    rest.len()
                };
            }
        }
        let piece = &rest[..len];
        let last = piece.len() == rest.len();
        self.batch.clear();
        for (i, &t) in piece.iter().enumerate() {
            self.batch.push(
                t,
                start + i as u32,
                seq as i32,
                last && i + 1 == piece.len(),
            );
        }
        self.decode_batch(&[seq], abort)?;
        let book = &mut self.seqs[seq as usize];
        book.tokens.extend_from_slice(piece);
        if piece.len() > 1 {
            book.prompt_end = book.n_past();
        }
        // a prompt's piece starts the count again; a piece of one token is a step of the prompt
        book.decode_keys = Default::default();
        book.fresh_until = book
            .fresh_until
            .min(unscored_from(book.h2o, start, piece.len(), last));
        Ok(piece.len())
    }

    /// Context shift (llama-server's `--context-shift`): drops `n_discard` tokens of sequence
    /// `seq` after its first `n_keep` and moves the later ones back by as many positions
    /// (llama.cpp re-rotates their keys), so that a generation that filled the sequence can go
    /// on. The sequence's tokens follow; a next prompt reuses what still matches.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad sequence, a range past the sequence's end, a sequence
    /// running H2O (its memory sets and scores are kept by position, which a shift would move)
    /// or a model whose cache cannot shift positions.
    pub fn shift_context(&mut self, seq: SeqId, n_keep: u32, n_discard: u32) -> Result<()> {
        self.check_seq(seq)?;
        let book = &self.seqs[seq as usize];
        if book.h2o.is_some() {
            return Err(Error::InvalidConfig(format!(
                "sequence {seq} runs H2O, whose memory sets and scores are kept by position: its \
                 context cannot be shifted"
            )));
        }
        let n_past = book.n_past();
        if n_discard == 0 || n_keep.saturating_add(n_discard) > n_past {
            return Err(Error::InvalidConfig(format!(
                "context shift of sequence {seq}: keep {n_keep} and drop {n_discard} of its \
                 {n_past} tokens"
            )));
        }
        // SAFETY: valid context and memory; seq < n_seq_max.
        let mem = unsafe { sys::llama_get_memory(self.ctx.as_ptr()) };
        // SAFETY: as above.
        if !unsafe { sys::llama_memory_can_shift(mem) } {
            return Err(Error::InvalidConfig(
                "this model's KV cache cannot shift positions (llama.cpp's can_shift is false)"
                    .into(),
            ));
        }
        let (keep, end) = (n_keep as i32, (n_keep + n_discard) as i32);
        // SAFETY: as above; positions within the sequence.
        if !unsafe { sys::llama_memory_seq_rm(mem, seq as i32, keep, end) } {
            return Err(Error::InvalidConfig(format!(
                "llama.cpp could not drop positions {keep}..{end} of sequence {seq}"
            )));
        }
        // SAFETY: as above.
        unsafe {
            sys::llama_memory_seq_add(mem, seq as i32, end, n_past as i32, -(n_discard as i32))
        };
        let book = &mut self.seqs[seq as usize];
        book.tokens
            .drain(n_keep as usize..(n_keep + n_discard) as usize);
        book.prompt_end = book.prompt_end.min(n_keep);
        book.fresh_until = book.fresh_until.min(n_keep);
        Ok(())
    }

    /// One decode step: each `(seq, token)` appended to its sequence, all in one `llama_decode`,
    /// with next-token logits for each; [`ParallelSession::sample_at`] with the step's index
    /// `i` samples the `i`-th.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad or repeated sequence, or a full one
    /// ([`Error::PromptTooLong`]); a failed step leaves its sequences empty.
    pub fn decode(&mut self, step: &[(SeqId, Token)]) -> Result<()> {
        self.decode_inner(step, None)
    }

    /// [`ParallelSession::decode`], stopped early when `abort` says so, as
    /// [`ParallelSession::prefill_with_abort`] is; a stopped step empties all its sequences.
    ///
    /// # Errors
    /// As [`ParallelSession::decode`]; [`Error::Interrupted`] when stopped.
    pub fn decode_with_abort(
        &mut self,
        step: &[(SeqId, Token)],
        abort: AbortCheck<'_>,
    ) -> Result<()> {
        self.decode_inner(step, Some(abort))
    }

    fn decode_inner(
        &mut self,
        step: &[(SeqId, Token)],
        abort: Option<AbortCheck<'_>>,
    ) -> Result<()> {
        if step.is_empty() {
            return Ok(());
        }
        if step.len() > self.seqs.len() {
            return Err(Error::InvalidConfig(format!(
                "a decode step of {} tokens for {} sequences: one token per sequence",
                step.len(),
                self.seqs.len()
            )));
        }
        let mut seen = vec![false; self.seqs.len()];
        for &(seq, t) in step {
            self.check_seq(seq)?;
            if std::mem::replace(&mut seen[seq as usize], true) {
                return Err(Error::InvalidConfig(format!(
                    "sequence {seq} appears twice in one decode step"
                )));
            }
            self.check_tokens(seq, &[t])?;
        }
        self.batch.clear();
        for &(seq, t) in step {
            self.batch
                .push(t, self.seqs[seq as usize].n_past(), seq as i32, true);
        }
        let seqs: Vec<SeqId> = step.iter().map(|&(s, _)| s).collect();
        self.decode_batch(&seqs, abort)?;
        let h2o = self.config.h2o.filter(H2oConfig::is_enabled);
        for &(seq, t) in step {
            let book = &mut self.seqs[seq as usize];
            let start = book.n_past();
            book.tokens.push(t);
            book.decode_keys
                .record(self.ctx, seq as i32, 1, start + 1, h2o);
            book.fresh_until = book
                .fresh_until
                .min(unscored_from(book.h2o, start, 1, true));
        }
        Ok(())
    }

    /// Samples with `sampler` from the logits of the last [`ParallelSession::prefill`] call
    /// that reached the end of its prompt.
    pub fn sample_last(&mut self, sampler: &mut Sampler) -> Token {
        sampler.sample_at(self.ctx.as_ptr(), -1)
    }

    /// Samples with `sampler` from the logits of entry `i` of the last
    /// [`ParallelSession::decode`] step.
    ///
    /// # Panics
    /// When `i` is not an index of that step.
    pub fn sample_at(&mut self, sampler: &mut Sampler, i: usize) -> Token {
        let n = self.batch.raw.n_tokens as usize;
        assert!(i < n, "decode step entry {i} of {n}");
        sampler.sample_at(self.ctx.as_ptr(), i as i32)
    }

    /// The next-token logits of entry `i` of the last [`ParallelSession::decode`] step, or
    /// with `i = None` of the last [`ParallelSession::prefill`] call that reached the end of
    /// its prompt (`n_vocab` values; what [`ParallelSession::sample_at`] and
    /// [`ParallelSession::sample_last`] sample from).
    ///
    /// # Panics
    /// When `i` is not an index of that step.
    #[must_use]
    pub fn logits(&self, i: Option<usize>) -> Option<&[f32]> {
        let idx = match i {
            Some(i) => {
                let n = self.batch.raw.n_tokens as usize;
                assert!(i < n, "decode step entry {i} of {n}");
                i as i32
            }
            None => -1,
        };
        // SAFETY: llama.cpp keeps the last batch's logits until the next decode, which needs
        // &mut self; it returns null for an index without logits.
        unsafe {
            let p = sys::llama_get_logits_ith(self.ctx.as_ptr(), idx);
            (!p.is_null()).then(|| std::slice::from_raw_parts(p, self.model.n_vocab()))
        }
    }

    /// The H2O state of sequence `seq` (its chunk progress), or `None` with full attention.
    #[must_use]
    pub fn h2o_state(&self, seq: SeqId) -> Option<H2oState> {
        #[cfg(feature = "stock")]
        {
            let _ = seq;
            None
        }
        #[cfg(not(feature = "stock"))]
        {
            let seq = i32::try_from(seq).ok()?;
            // SAFETY: plain-data out parameter, valid context; llama.cpp checks seq.
            let mut info: sys::llama_h2o_info = unsafe { std::mem::zeroed() };
            let rc = unsafe { sys::llama_h2o_get_seq_info(self.ctx.as_ptr(), seq, &mut info) };
            (rc == sys::LLAMA_H2O_STATUS_OK).then(|| super::h2o::state_from_info(&info))
        }
    }

    /// Where a fresh session's prefill of a `n`-token prompt starts its dense tail in sequence
    /// `seq`: the last `dense_tail` positions, within its last call; `None` without one.
    fn dense_tail_start(&self, seq: SeqId, n: usize) -> Option<usize> {
        let tail = self.seqs[seq as usize].h2o?.dense_tail as usize;
        if tail == 0 {
            return None;
        }
        let n_batch = self.config.n_batch as usize;
        let last_call = (n.max(1) - 1) / n_batch * n_batch;
        Some(n.saturating_sub(tail).max(last_call))
    }

    fn check_seq(&self, seq: SeqId) -> Result<()> {
        if (seq as usize) < self.seqs.len() {
            Ok(())
        } else {
            Err(Error::InvalidConfig(format!(
                "sequence {seq} of a session with {} sequences",
                self.seqs.len()
            )))
        }
    }

    /// [`super::check_tokens`] for `tokens` appended to sequence `seq`.
    fn check_tokens(&self, seq: SeqId, tokens: &[Token]) -> Result<()> {
        let n_past = self.seqs[seq as usize].tokens.len();
        super::check_tokens(self.model, n_past, self.n_ctx_seq, tokens)
    }

    /// Sets the memory selection of the empty sequence `seq`.
    fn set_selection(&mut self, seq: SeqId, h2o: Option<H2oConfig>) -> Result<()> {
        #[cfg(not(feature = "stock"))]
        if let Some(h) = h2o {
            // SAFETY: valid context; llama.cpp checks every argument.
            let rc = unsafe {
                sys::llama_h2o_set_seq_select(
                    self.ctx.as_ptr(),
                    seq as i32,
                    h.select.to_sys(),
                    h.sink as i32,
                    i32::try_from(h.dense_tail).unwrap_or(i32::MAX),
                )
            };
            if rc != sys::LLAMA_H2O_STATUS_OK {
                return Err(Error::InvalidConfig(format!(
                    "llama.cpp refused the H2O selection {} (sink {}, dense tail {}) for sequence {seq} \
                     (status {rc})",
                    h.select.name(),
                    h.sink,
                    h.dense_tail
                )));
            }
        }
        self.seqs[seq as usize].h2o = h2o;
        Ok(())
    }

    /// Cuts sequence `seq` back to its first `keep` tokens, or empties it where llama.cpp
    /// refuses the cut (or `keep` is 0); returns the tokens kept.
    fn rewind(&mut self, seq: SeqId, keep: u32) -> u32 {
        let book = &self.seqs[seq as usize];
        if keep == book.n_past() {
            return keep;
        }
        // SAFETY: valid context and memory; keep <= n_past fits in i32.
        let cut = keep > 0
            && unsafe {
                sys::llama_memory_seq_rm(
                    sys::llama_get_memory(self.ctx.as_ptr()),
                    seq as i32,
                    keep as i32,
                    -1,
                )
            };
        let book = &mut self.seqs[seq as usize];
        if cut {
            book.tokens.truncate(keep as usize);
            book.prompt_end = book.prompt_end.min(keep);
            book.decode_keys = Default::default();
            // `keep` is at most `fresh_until`, and nothing of the history after it is left
            book.fresh_until = u32::MAX;
            keep
        } else {
            // emptied, the sequence runs the context's selection again (in llama.cpp too)
            let _ = self.clear(seq);
            0
        }
    }

    /// Runs `llama_decode` on the filled batch, asking `abort` between graph operations
    /// whether to stop; on failure the sequences in it are emptied (part of the batch may be in
    /// the cache).
    fn decode_batch(&mut self, seqs: &[SeqId], abort: Option<AbortCheck<'_>>) -> Result<()> {
        unsafe extern "C" fn ask(data: *mut c_void) -> bool {
            // SAFETY: `data` points at `abort` below, registered only while llama_decode runs.
            let abort = unsafe { &*(data as *const AbortCheck<'_>) };
            // a panic must not unwind into C: take it as a request to stop
            catch_unwind(AssertUnwindSafe(abort)).unwrap_or(true)
        }
        let ctx = self.ctx.as_ptr();
        // SAFETY: valid context and a batch filled within its capacity. The callback is
        // registered for this llama_decode alone, with a pointer to `abort`, which outlives it;
        // no other code runs between registering and unregistering it.
        let rc = unsafe {
            match &abort {
                Some(abort) => {
                    let data: *const AbortCheck<'_> = abort;
                    sys::llama_set_abort_callback(ctx, Some(ask), data as *mut c_void);
                    let rc = sys::llama_decode(ctx, self.batch.raw);
                    sys::llama_set_abort_callback(ctx, None, std::ptr::null_mut());
                    rc
                }
                None => sys::llama_decode(ctx, self.batch.raw),
            }
        };
        if rc == 0 {
            return Ok(());
        }
        for &seq in seqs {
            let _ = self.clear(seq);
        }
        match DecodeError::from_code(rc) {
            DecodeError::Aborted => Err(Error::Interrupted),
            e => Err(Error::Decode(e)),
        }
    }
}
