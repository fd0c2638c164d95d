//! What a session is created with: [`SessionConfig`] (context size, batches, threads, flash
//! attention, H2O, attention capture) and its validation, before llama.cpp sees any of it.

use crate::error::{Error, Result};

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
    /// llama.cpp, a session caps it at `n_ctx`; [`Session::config`](crate::Session::config) reports the value in effect.
    pub n_batch: u32,
    /// Physical batch, which is also the H2O chunk size S (`-ub`); capped at `n_batch`.
    pub n_ubatch: u32,
    /// CPU threads (`-t`).
    pub n_threads: u32,
    pub flash_attn: FlashAttention,
    /// H2O sparse prefill; `None` (or L = H = 0) is stock attention.
    pub h2o: Option<H2oConfig>,
    /// Copy every H2O attention op's inputs and output out of the graph, for checks against
    /// [`crate::reference`] (see [`Session::take_attention_captures`](crate::Session::take_attention_captures)). Slow and memory-hungry:
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
