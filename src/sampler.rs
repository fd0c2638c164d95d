//! Token sampling with llama.cpp's sampler chain.

use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::model::Token;
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
        }
    }
}

/// A llama.cpp sampler chain; owns the `llama_sampler` and frees it on drop.
#[derive(Debug)]
pub struct Sampler {
    ptr: NonNull<sys::llama_sampler>,
}

// SAFETY: the chain is only used through &mut self.
unsafe impl Send for Sampler {}

impl Drop for Sampler {
    fn drop(&mut self) {
        // SAFETY: owned pointer, freed once; the chain frees the samplers added to it.
        unsafe { sys::llama_sampler_free(self.ptr.as_ptr()) }
    }
}

impl Sampler {
    /// Builds the chain `top_k → top_p → temperature → dist(seed)`, or `greedy`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a NaN temperature or a top-p outside (0, 1].
    pub fn new(config: &SamplerConfig) -> Result<Self> {
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
        // SAFETY: each llama_sampler_init_* returns a new sampler whose ownership passes to the
        // chain on llama_sampler_chain_add; the chain is owned by `Sampler`.
        unsafe {
            let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
            let chain = NonNull::new(chain)
                .ok_or_else(|| Error::InvalidConfig("cannot create sampler".into()))?;
            let this = Self { ptr: chain };
            if config.temperature <= 0.0 {
                sys::llama_sampler_chain_add(chain.as_ptr(), sys::llama_sampler_init_greedy());
            } else {
                if config.top_k > 0 {
                    sys::llama_sampler_chain_add(
                        chain.as_ptr(),
                        sys::llama_sampler_init_top_k(config.top_k),
                    );
                }
                if config.top_p < 1.0 {
                    sys::llama_sampler_chain_add(
                        chain.as_ptr(),
                        sys::llama_sampler_init_top_p(config.top_p, 1),
                    );
                }
                sys::llama_sampler_chain_add(
                    chain.as_ptr(),
                    sys::llama_sampler_init_temp(config.temperature),
                );
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
        // SAFETY: ctx is a live context with logits for its last output (idx -1).
        unsafe { sys::llama_sampler_sample(self.ptr.as_ptr(), ctx, -1) }
    }

    /// Samples from the logits of the context's output `idx` (its index in the last batch) and
    /// accepts the token.
    pub(crate) fn sample_at(&mut self, ctx: *mut sys::llama_context, idx: i32) -> Token {
        // SAFETY: ctx is a live context; llama.cpp checks idx against the last batch's outputs
        // and aborts on a bad one, so callers pass indices of tokens that asked for logits.
        unsafe { sys::llama_sampler_sample(self.ptr.as_ptr(), ctx, idx) }
    }

    /// Forgets accepted tokens and re-seeds, so that a new generation starts fresh.
    pub fn reset(&mut self) {
        // SAFETY: valid chain.
        unsafe { sys::llama_sampler_reset(self.ptr.as_ptr()) }
    }
}
