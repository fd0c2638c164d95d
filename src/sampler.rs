//! Token sampling with llama.cpp's sampler chain.

use std::ffi::CString;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::model::{Model, Token};
use crate::sys;

/// How to pick the next token. `temperature <= 0` means greedy (argmax), as in llama.cpp.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: i32,
    /// Nucleus sampling threshold (1.0 = off).
    pub top_p: f32,
    /// Seed of the final random draw.
    pub seed: u32,
    /// Added to the logits of these tokens before anything else looks at them (OpenAI's and
    /// llama-server's `logit_bias`); `f32::NEG_INFINITY` bans a token.
    pub logit_bias: Vec<(Token, f32)>,
    /// A GBNF grammar (llama.cpp's `grammars/README.md`) whose `root` rule every output must
    /// follow; tokens that would leave it get no probability.
    pub grammar: Option<String>,
    /// `Some`: the grammar is lazy, as a chat template's tool call grammar: it binds the output
    /// only from the first trigger on, and anything may come before.
    pub grammar_triggers: Option<GrammarTriggers>,
    /// Tokens the grammar accepts before the first sampled one: text the prompt already holds
    /// but the grammar's `root` starts with (a chat template's generation prompt).
    pub grammar_prefill: Vec<Token>,
}

/// What wakes a lazy grammar (llama.cpp's `llama_sampler_init_grammar_lazy_patterns`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrammarTriggers {
    /// Regular expressions over the generated text; the grammar binds from the first match's
    /// first group (or the match) on.
    pub patterns: Vec<String>,
    /// Tokens whose sampling wakes the grammar.
    pub tokens: Vec<Token>,
}

impl SamplerConfig {
    /// Deterministic argmax sampling.
    #[must_use]
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            logit_bias: Vec::new(),
            grammar: None,
            grammar_triggers: None,
            grammar_prefill: Vec::new(),
        }
    }
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: 0xC0FFEE,
            logit_bias: Vec::new(),
            grammar: None,
            grammar_triggers: None,
            grammar_prefill: Vec::new(),
        }
    }
}

/// A llama.cpp sampler chain, and a grammar sampler beside it; owns both `llama_sampler`s and
/// frees them on drop.
///
/// The grammar is not a link of the chain: checking every token of a large vocabulary against
/// it at each step costs far more than a small model's decode step. As llama.cpp's own
/// `common_sampler`, the chain picks a token first and the grammar checks that one; only when
/// it refuses does the grammar filter the whole vocabulary and the chain pick again.
#[derive(Debug)]
pub struct Sampler {
    ptr: NonNull<sys::llama_sampler>,
    /// The chain's cuts without its final draw (`logit_bias → top_k → top_p → temperature`, or
    /// `logit_bias → temperature 0` for greedy): stateless, so applying it to a copy of a step's
    /// candidates shows the distribution the draw picks from without moving its random state.
    cuts: NonNull<sys::llama_sampler>,
    grammar: Option<NonNull<sys::llama_sampler>>,
    /// `SamplerConfig::grammar_prefill`, accepted again after a reset.
    grammar_prefill: Vec<Token>,
    /// The candidates of a step with a grammar (one per vocabulary token), reused.
    candidates: Vec<sys::llama_token_data>,
}

// SAFETY: the samplers are only used through &mut self.
unsafe impl Send for Sampler {}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: owned pointers, freed once; the chain frees the samplers added to it.
        unsafe {
            sys::llama_sampler_free(self.ptr.as_ptr());
            sys::llama_sampler_free(self.cuts.as_ptr());
            if let Some(g) = self.grammar {
                sys::llama_sampler_free(g.as_ptr());
            }
        }
    }
}

impl Sampler {
    /// Builds the chain `top_k → top_p → temperature → dist(seed)`, or `greedy`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a NaN temperature, a top-p outside (0, 1], or a logit bias
    /// or grammar, which need the model's vocabulary: use [`Sampler::for_model`].
    pub fn new(config: &SamplerConfig) -> Result<Self> {
        if !config.logit_bias.is_empty() || config.grammar.is_some() {
            return Err(Error::InvalidConfig(
                "a logit bias or a grammar needs the model's vocabulary: build the sampler with \
                 Sampler::for_model"
                    .into(),
            ));
        }
        Self::build(config, None)
    }

    /// Builds the chain `logit_bias → (greedy | top_k → top_p → temperature → dist(seed))` for
    /// `model`'s vocabulary, and the grammar's sampler beside it, as llama-server does: the
    /// grammar decides which tokens can come before any of the chain's cuts.
    ///
    /// # Errors
    /// As [`Sampler::new`]; a biased token outside the vocabulary, a bias that is NaN, and a
    /// grammar llama.cpp cannot parse (the message has llama.cpp's reason) are
    /// [`Error::InvalidConfig`].
    pub fn for_model(model: &Model, config: &SamplerConfig) -> Result<Self> {
        let n_vocab = model.n_vocab();
        for &(token, bias) in &config.logit_bias {
            if usize::try_from(token).map_or(true, |t| t >= n_vocab) {
                return Err(Error::InvalidConfig(format!(
                    "logit bias for token {token}, which is not in the vocabulary (0..{n_vocab})"
                )));
            }
            if bias.is_nan() {
                return Err(Error::InvalidConfig(format!(
                    "logit bias for token {token} is NaN"
                )));
            }
        }
        Self::build(config, Some(model))
    }

    fn build(config: &SamplerConfig, model: Option<&Model>) -> Result<Self> {
        if config.temperature.is_nan() {
            return Err(Error::InvalidConfig("temperature is NaN".into()));
        }
        if !(config.top_p > 0.0 && config.top_p <= 1.0) {
            return Err(Error::InvalidConfig(format!(
                "top-p must be in (0, 1], got {}",
                config.top_p
            )));
        }
        crate::backend::init();
        let grammar = match (&config.grammar, model) {
            (Some(g), Some(_)) => Some(CString::new(g.as_str()).map_err(|_| {
                Error::InvalidConfig("the grammar contains a NUL character".into())
            })?),
            _ => None,
        };
        // SAFETY: each llama_sampler_init_* returns a new sampler whose ownership passes to the
        // chain on llama_sampler_chain_add; the chain is owned by `Sampler` (dropped, and so
        // freed, on every early return below).
        unsafe {
            let new_chain = || {
                NonNull::new(sys::llama_sampler_chain_init(
                    sys::llama_sampler_chain_default_params(),
                ))
                .ok_or_else(|| Error::InvalidConfig("cannot create sampler".into()))
            };
            let chain = new_chain()?;
            let cuts = match new_chain() {
                Ok(cuts) => cuts,
                Err(e) => {
                    sys::llama_sampler_free(chain.as_ptr());
                    return Err(e);
                }
            };
            let mut this = Self {
                ptr: chain,
                cuts,
                grammar: None,
                grammar_prefill: config.grammar_prefill.clone(),
                candidates: Vec::new(),
            };
            if let (Some(model), false) = (model, config.logit_bias.is_empty()) {
                let biases: Vec<sys::llama_logit_bias> = config
                    .logit_bias
                    .iter()
                    .map(|&(token, bias)| sys::llama_logit_bias { token, bias })
                    .collect();
                // llama.cpp copies the biases
                for target in [chain, cuts] {
                    sys::llama_sampler_chain_add(
                        target.as_ptr(),
                        sys::llama_sampler_init_logit_bias(
                            model.n_vocab() as i32,
                            biases.len() as i32,
                            biases.as_ptr(),
                        ),
                    );
                }
            }
            if let (Some(model), Some(grammar)) = (model, &grammar) {
                crate::backend::clear_recent_log();
                let g = match &config.grammar_triggers {
                    None => sys::llama_sampler_init_grammar(
                        model.vocab(),
                        grammar.as_ptr(),
                        c"root".as_ptr(),
                    ),
                    Some(triggers) => {
                        let patterns = triggers
                            .patterns
                            .iter()
                            .map(|p| CString::new(p.as_str()))
                            .collect::<std::result::Result<Vec<_>, _>>()
                            .map_err(|_| {
                                Error::InvalidConfig(
                                    "a grammar trigger contains a NUL character".into(),
                                )
                            })?;
                        let mut pattern_ptrs: Vec<*const std::os::raw::c_char> =
                            patterns.iter().map(|p| p.as_ptr()).collect();
                        // llama.cpp copies the patterns and tokens
                        sys::llama_sampler_init_grammar_lazy_patterns(
                            model.vocab(),
                            grammar.as_ptr(),
                            c"root".as_ptr(),
                            pattern_ptrs.as_mut_ptr(),
                            pattern_ptrs.len(),
                            triggers.tokens.as_ptr(),
                            triggers.tokens.len(),
                        )
                    }
                };
                let Some(g) = NonNull::new(g) else {
                    return Err(Error::InvalidConfig(format!(
                        "the grammar cannot be parsed: {}",
                        crate::backend::recent_log_reason()
                    )));
                };
                this.grammar = Some(g);
                // llama.cpp's grammar throws (and so aborts across the FFI) on a token it
                // cannot take: each prefill token is checked first
                for &token in &config.grammar_prefill {
                    if !Self::grammar_allows(g, token) {
                        return Err(Error::InvalidConfig(format!(
                            "the grammar does not start with the prefill's token {token}"
                        )));
                    }
                    sys::llama_sampler_accept(g.as_ptr(), token);
                }
            }
            if config.temperature <= 0.0 {
                sys::llama_sampler_chain_add(chain.as_ptr(), sys::llama_sampler_init_greedy());
                // temperature 0 keeps the largest logit alone, as greedy picks it
                sys::llama_sampler_chain_add(cuts.as_ptr(), sys::llama_sampler_init_temp(0.0));
            } else {
                for target in [chain, cuts] {
                    if config.top_k > 0 {
                        sys::llama_sampler_chain_add(
                            target.as_ptr(),
                            sys::llama_sampler_init_top_k(config.top_k),
                        );
                    }
                    if config.top_p < 1.0 {
                        sys::llama_sampler_chain_add(
                            target.as_ptr(),
                            sys::llama_sampler_init_top_p(config.top_p, 1),
                        );
                    }
                    sys::llama_sampler_chain_add(
                        target.as_ptr(),
                        sys::llama_sampler_init_temp(config.temperature),
                    );
                }
                sys::llama_sampler_chain_add(
                    chain.as_ptr(),
                    sys::llama_sampler_init_dist(config.seed),
                );
            }
            Ok(this)
        }
    }

    /// Samples from the logits of the context's last output and accepts the token.
    pub(crate) fn sample(&mut self, ctx: *mut sys::llama_context) -> Token {
        self.sample_at(ctx, -1)
    }

    /// Samples from the logits of the context's output `idx` (its index in the last batch, -1
    /// for the last) and accepts the token.
    pub(crate) fn sample_at(&mut self, ctx: *mut sys::llama_context, idx: i32) -> Token {
        let Some(grammar) = self.grammar else {
            // SAFETY: ctx is a live context; llama.cpp checks idx against the last batch's
            // outputs and aborts on a bad one, so callers pass indices of tokens that asked for
            // logits.
            return unsafe { sys::llama_sampler_sample(self.ptr.as_ptr(), ctx, idx) };
        };
        // SAFETY: as above; the logits row holds n_vocab values and lives until the next
        // decode, which cannot run while this borrows the sampler.
        unsafe {
            let logits = sys::llama_get_logits_ith(ctx, idx);
            let n_vocab =
                sys::llama_vocab_n_tokens(sys::llama_model_get_vocab(sys::llama_get_model(ctx)));
            let logits = std::slice::from_raw_parts(logits, n_vocab as usize);
            let token = self.pick(logits, None);
            let token = if Self::grammar_allows(grammar, token) {
                token
            } else {
                self.pick(logits, Some(grammar))
            };
            sys::llama_sampler_accept(grammar.as_ptr(), token);
            sys::llama_sampler_accept(self.ptr.as_ptr(), token);
            token
        }
    }

    /// The grammar's verdict on one token.
    ///
    /// # Safety
    /// `grammar` is a live sampler.
    unsafe fn grammar_allows(grammar: NonNull<sys::llama_sampler>, token: Token) -> bool {
        let mut one = sys::llama_token_data {
            id: token,
            logit: 1.0,
            p: 0.0,
        };
        let mut single = sys::llama_token_data_array {
            data: &raw mut one,
            size: 1,
            selected: -1,
            sorted: false,
        };
        // SAFETY: the array points at `one`, alive for the call; the caller's grammar is live.
        unsafe { sys::llama_sampler_apply(grammar.as_ptr(), &raw mut single) };
        one.logit.is_finite()
    }

    /// The chain's pick from `logits`, after `grammar` removed what it forbids when given.
    ///
    /// # Safety
    /// `grammar` is a live sampler.
    unsafe fn pick(
        &mut self,
        logits: &[f32],
        grammar: Option<NonNull<sys::llama_sampler>>,
    ) -> Token {
        // SAFETY: the caller's grammar and our chain are live; the array points into
        // `candidates`, which nothing touches until the read below.
        unsafe {
            let array = self.cut(logits, grammar, self.ptr);
            let at = usize::try_from(array.selected).unwrap_or(0);
            (*array.data.add(at)).id
        }
    }

    /// Fills `candidates` with every token of `logits`, lets `grammar` (when given) and then
    /// `chain` cut them, and returns the array they left (it points into `candidates`).
    ///
    /// # Safety
    /// `grammar` and `chain` are live samplers.
    unsafe fn cut(
        &mut self,
        logits: &[f32],
        grammar: Option<NonNull<sys::llama_sampler>>,
        chain: NonNull<sys::llama_sampler>,
    ) -> sys::llama_token_data_array {
        self.candidates.clear();
        self.candidates
            .extend(
                logits
                    .iter()
                    .enumerate()
                    .map(|(id, &logit)| sys::llama_token_data {
                        id: id as Token,
                        logit,
                        p: 0.0,
                    }),
            );
        let mut array = sys::llama_token_data_array {
            data: self.candidates.as_mut_ptr(),
            size: self.candidates.len(),
            selected: -1,
            sorted: false,
        };
        // SAFETY: the array points into `candidates`, alive and unmoved for the calls; the
        // samplers are live (the caller's promise).
        unsafe {
            if let Some(g) = grammar {
                sys::llama_sampler_apply(g.as_ptr(), &raw mut array);
            }
            sys::llama_sampler_apply(chain.as_ptr(), &raw mut array);
        }
        array
    }

    /// The distribution the chain's final draw picked `token` from (llama-server's
    /// `post_sampling_probs`): `logits` after the grammar (when there is one), the logit bias,
    /// top-k, top-p and the temperature, normalized over what is left; with greedy sampling the
    /// largest logit has probability 1. `top` lists the `n` likeliest, by that probability and
    /// then by logit. Nothing is accepted and no random state moves.
    pub fn post_sampling_probs(&mut self, logits: &[f32], token: Token, n: usize) -> TokenLogprobs {
        // SAFETY: our samplers are live, and neither the grammar's nor the cuts' apply changes
        // their state; the kept slice lies in `candidates`, untouched until it is read.
        let kept = unsafe {
            let array = self.cut(logits, self.grammar, self.cuts);
            std::slice::from_raw_parts(array.data, array.size)
        };
        TokenLogprobs::from_candidates(kept, logits, token, n)
    }

    /// Forgets accepted tokens and re-seeds, so that a new generation starts fresh.
    pub fn reset(&mut self) {
        // SAFETY: valid samplers.
        unsafe {
            sys::llama_sampler_reset(self.ptr.as_ptr());
            if let Some(g) = self.grammar {
                sys::llama_sampler_reset(g.as_ptr());
            }
        }
        self.accept_grammar_prefill();
    }

    /// The grammar takes `SamplerConfig::grammar_prefill` again (checked when it was built).
    fn accept_grammar_prefill(&mut self) {
        if let Some(g) = self.grammar {
            for &token in &self.grammar_prefill {
                // SAFETY: a live grammar sampler.
                unsafe { sys::llama_sampler_accept(g.as_ptr(), token) };
            }
        }
    }
}

/// A token's log-probability under the softmax of a row of logits, with the `n` most likely
/// tokens' (llama-server's `n_probs`, OpenAI's `logprobs`/`top_logprobs`).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: Token,
    /// Natural log of the token's probability.
    pub logprob: f32,
    /// The `n` most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(Token, f32)>,
}

impl TokenLogprobs {
    /// Log-probabilities of `token` and of the `n` most likely tokens under `softmax(logits)`,
    /// the distribution before any sampler (as llama-server's default, `post_sampling_probs`
    /// off). Computed in f64, so that a row of 150K logits sums without losing the tail.
    #[must_use]
    pub fn from_logits(logits: &[f32], token: Token, n: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits
            .iter()
            .map(|&l| (f64::from(l) - f64::from(max)).exp())
            .sum();
        let log_z = f64::from(max) + sum.ln();
        let logprob = |t: usize| (f64::from(logits[t]) - log_z) as f32;
        let mut top: Vec<usize> = Vec::with_capacity(n + 1);
        if n > 0 {
            // one pass keeping the best n, so that a 150K-token vocabulary is not sorted
            for (t, &l) in logits.iter().enumerate() {
                if top.len() == n && l <= logits[top[n - 1]] {
                    continue;
                }
                let at = top.partition_point(|&u| logits[u] >= l);
                top.insert(at, t);
                top.truncate(n);
            }
        }
        Self {
            token,
            logprob: usize::try_from(token)
                .ok()
                .filter(|&t| t < logits.len())
                .map_or(f32::NEG_INFINITY, logprob),
            top: top.into_iter().map(|t| (t as Token, logprob(t))).collect(),
        }
    }
}

impl TokenLogprobs {
    /// Log-probabilities under the softmax of what a sampler chain kept (`candidates`, any
    /// order; a logit of -inf has probability 0), with the `n` likeliest, ties (those the chain
    /// cut to -inf) by the larger raw logit in `logits` and then the lower id. A token the chain
    /// cut has log-probability -inf.
    fn from_candidates(
        candidates: &[sys::llama_token_data],
        logits: &[f32],
        token: Token,
        n: usize,
    ) -> Self {
        let max = candidates
            .iter()
            .map(|c| c.logit)
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = candidates
            .iter()
            .map(|c| (f64::from(c.logit) - f64::from(max)).exp())
            .sum();
        let log_z = f64::from(max) + sum.ln();
        let logprob = |c: &sys::llama_token_data| (f64::from(c.logit) - log_z) as f32;
        let mut order: Vec<&sys::llama_token_data> = candidates.iter().collect();
        let raw = |c: &sys::llama_token_data| logits[c.id as usize];
        order.sort_by(|a, b| {
            b.logit
                .total_cmp(&a.logit)
                .then(raw(b).total_cmp(&raw(a)))
                .then(a.id.cmp(&b.id))
        });
        Self {
            token,
            logprob: candidates
                .iter()
                .find(|c| c.id == token)
                .map_or(f32::NEG_INFINITY, logprob),
            top: order
                .into_iter()
                .take(n)
                .map(|c| (c.id, logprob(c)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TokenLogprobs;

    #[test]
    fn logprobs_are_a_log_softmax_and_the_top_list_is_sorted() {
        let logits = [1.0_f32, 3.0, 2.0, 3.0, -1.0];
        let p = TokenLogprobs::from_logits(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        assert!((f64::from(p.logprob) - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<i32> = p.top.iter().map(|&(t, _)| t).collect();
        assert_eq!(ids, vec![1, 3, 2], "most likely first, ties by lower id");
        let total: f64 = (0..logits.len())
            .map(|t| f64::from(TokenLogprobs::from_logits(&logits, t as i32, 0).logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(TokenLogprobs::from_logits(&logits, 0, 0).top.is_empty());
        assert_eq!(TokenLogprobs::from_logits(&logits, 0, 9).top.len(), 5);
    }

    #[test]
    fn post_sampling_probs_follow_the_chain_without_moving_its_draw() {
        use super::{Sampler, SamplerConfig};
        let logits = [1.0_f32, 3.0, 2.0, 2.5, -1.0];
        // greedy: the largest logit has it all; the others follow by logit, at 0
        let mut greedy = Sampler::new(&SamplerConfig::greedy()).unwrap();
        let p = greedy.post_sampling_probs(&logits, 1, 3);
        assert_eq!(p.logprob, 0.0);
        assert_eq!(p.top[0], (1, 0.0));
        let rest: Vec<i32> = p.top[1..].iter().map(|&(t, _)| t).collect();
        assert_eq!(rest, vec![3, 2]);
        assert!(p.top[1..].iter().all(|&(_, l)| l == f32::NEG_INFINITY));
        // top-k 2 at temperature 1: a softmax over the two kept
        let config = SamplerConfig {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            ..SamplerConfig::default()
        };
        let mut sampled = Sampler::new(&config).unwrap();
        let p = sampled.post_sampling_probs(&logits, 3, 5);
        let z = 3.0_f64.exp() + 2.5_f64.exp();
        assert!((f64::from(p.logprob) - (2.5 - z.ln())).abs() < 1e-6);
        assert_eq!(p.top.len(), 2, "the chain kept two: {p:?}");
        assert_eq!(
            sampled.post_sampling_probs(&logits, 0, 5).logprob,
            f32::NEG_INFINITY
        );
        // asking twice gives the same answer: nothing was drawn
        assert_eq!(sampled.post_sampling_probs(&logits, 3, 5), p);
    }
}
