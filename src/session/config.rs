//! What a session is created with: [`SessionConfig`] (context size, batches, threads, flash
//! attention, H2O, attention capture) and its validation, before llama.cpp sees any of it.

use crate::cache_type::CacheType;
use crate::error::{Error, Result};
use crate::model::Model;

/// How a chunk chooses the heavy part of its memory (`--h2o-select`). The discriminants are
/// llama.cpp's `llama_h2o_select` (what [`AttentionCapture::select`](crate::AttentionCapture)
/// reports); 1 and 2 belonged to retired policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Selection {
    /// The seed rule (`seed`; `h2o` is taken too, its name before): after each chunk, the
    /// positions with the highest attention accumulated from earlier queries.
    #[default]
    Seed = 0,
    /// `hybrid`: half of the budget as blocks of 16 earlier positions that the chunk's own queries
    /// may attend to most (bounded per channel by each block's key minima and maxima), the other
    /// half by accumulated attention (the seed rule's scores) among all other earlier positions.
    Hybrid = 3,
    /// `coverage` (recommended): every tile of 64 queries chooses its own memory, position by
    /// position: its sampled queries' attention on a key sketch proposes candidates and the
    /// whole tile's attention ranks them; the heavy budget is shared by all heads' tiles of a
    /// chunk and goes where it covers the most estimated attention, until a tile's estimate
    /// reaches [`H2oConfig::coverage`] (see docs/results/coverage/README.md).
    Coverage = 4,
}

impl Selection {
    /// Every policy, in the order the CLI lists them.
    pub const ALL: [Selection; 3] = [Selection::Seed, Selection::Hybrid, Selection::Coverage];

    /// The name `--h2o-select` takes.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Selection::Seed => "seed",
            Selection::Hybrid => "hybrid",
            Selection::Coverage => "coverage",
        }
    }

    #[cfg(not(feature = "stock"))]
    pub(crate) fn to_sys(self) -> crate::sys::llama_h2o_select {
        match self {
            Selection::Seed => crate::sys::LLAMA_H2O_SELECT_SEED,
            Selection::Hybrid => crate::sys::LLAMA_H2O_SELECT_HYBRID,
            Selection::Coverage => crate::sys::LLAMA_H2O_SELECT_COVERAGE,
        }
    }
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Policies earlier versions took (whole blocks chosen by the chunk's own queries), named in the
/// error that refuses them.
const RETIRED: [&str; 2] = ["query", "query-mean"];

impl std::str::FromStr for Selection {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        // the seed rule's name before it was `seed`, kept for command lines and scripts
        if s == "h2o" {
            return Ok(Selection::Seed);
        }
        if RETIRED.contains(&s) {
            return Err(Error::InvalidConfig(format!(
                "the H2O selection policy {s:?} was retired: it lost to hybrid on every text measured; \
                 use hybrid (half of its budget chosen the same way) or coverage"
            )));
        }
        Selection::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Selection::ALL.iter().map(|p| p.name()).collect();
                Error::InvalidConfig(format!(
                    "unknown H2O selection policy {s:?}: use one of {}",
                    names.join(", ")
                ))
            })
    }
}

/// H2O sparse-prefill parameters: the memory each chunk attends to holds the last `local`
/// tokens before the chunk and `heavy` more chosen by `select`. `local = heavy = 0` turns H2O
/// off.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct H2oConfig {
    /// L: recent tokens kept from the previous chunk.
    pub local: u32,
    /// H: the budget `select` fills.
    pub heavy: u32,
    /// How the heavy part is chosen.
    pub select: Selection,
    /// Positions `0 .. sink` always in memory, out of the heavy budget (`--h2o-sink`).
    pub sink: u32,
    /// The last `dense_tail` tokens of a prompt attend to the whole prompt (`--h2o-dense-tail`).
    pub dense_tail: u32,
    /// [`Selection::Coverage`]: a tile takes no more budget once the attention its memory
    /// covers, as estimated from its sampled queries, reaches this (`--h2o-coverage`), in (0, 1];
    /// 1 spends the whole budget. The same for every sequence of a context.
    pub coverage: f32,
    /// [`Selection::Coverage`]: queries of each tile of 64 that attend to every position before
    /// the chunk to choose its memory (`--h2o-tile-samples`): 1, 2, 4, 8, 16, 32 or 64. More
    /// choose better and cost more. The same for every sequence of a context.
    pub tile_samples: u32,
    /// [`Selection::Coverage`]: the sampled queries' logits read `1 / tile_sketch` of the key
    /// channels, those of most key energy per KV head (`--h2o-tile-sketch`): 1 (exact), 2, 4
    /// or 8, or [`H2oConfig::TILE_SKETCH_BY_HEAD`] (0) for the share that suits the model's
    /// key heads, [`H2oConfig::recommended_tile_sketch`], chosen when a session is created. A
    /// sketch costs that share of the exact proposal, so more samples fit in the same work;
    /// every query of the tile still ranks what they propose exactly.
    pub tile_sketch: u32,
    /// [`Selection::Coverage`]: 0 (every tile's samples read every position before the chunk),
    /// or the size of the pool they read instead (`--h2o-tile-pool`): once per chunk, every
    /// 16th query of each tile chooses this many positions for its head by its sketched
    /// attention; each tile adds the quarter as many that its own such queries attend to most,
    /// and its samples propose among those alone. The proposal's cost then stops growing with
    /// the prompt; chunks with no more candidates than a tile's pool propose as without one. 0
    /// or at least 4 × `heavy`; the CPU's kernels only. [`H2oConfig::TILE_POOL_BY_BACKEND`]
    /// leaves it to where the attention runs ([`H2oConfig::recommended_tile_pool`]), chosen
    /// when a session is created.
    pub tile_pool: u32,
    /// Sparse decode (`--h2o-decode sparse --h2o-decode-budget N`): each generated token attends
    /// to the first block of 16 positions (more with `sink`), its last `local` positions, and up
    /// to this many positions between them, those its query heads' logits estimated from a key
    /// sketch (the quarter of each KV head's channels with the most key energy) rank highest
    /// (`ggml_h2o_decode`). 0: decode reads the whole cache, as llama.cpp does. The KV cache is kept
    /// whole either way, so any step could attend to everything.
    pub decode_budget: u32,
    /// Sparse decode: of its `decode_budget` positions, a step takes only the fewest whose
    /// estimated attention holds this share of that of every position between the sinks and
    /// the window (`--h2o-decode-coverage`), in (0, 1]; 1 takes the whole budget. The budget
    /// becomes a cap, and a step whose query points at few positions reads few.
    /// The same for every sequence of a context.
    pub decode_coverage: f32,
}

impl Default for H2oConfig {
    fn default() -> Self {
        Self {
            local: 0,
            heavy: 0,
            select: Selection::default(),
            sink: 0,
            dense_tail: 0,
            coverage: 1.0,
            tile_samples: Self::RECOMMENDED_TILE_SAMPLES,
            tile_sketch: Self::TILE_SKETCH_BY_HEAD,
            tile_pool: 0,
            decode_budget: 0,
            decode_coverage: 1.0,
        }
    }
}

impl H2oConfig {
    /// The seed's rule, as docs/seed-rule.md defines it: heavy hitters by accumulated attention, no sink,
    /// no dense tail.
    #[must_use]
    pub fn seed(local: u32, heavy: u32) -> Self {
        Self {
            local,
            heavy,
            ..Self::default()
        }
    }

    /// The selection this project recommends (the front ends' defaults), measured in
    /// docs/results/coverage/README.md ("Targets"): coverage selection, the first positions as
    /// sinks, and a dense tail for the question at the end of a prompt. Decode reads the whole
    /// cache; [`H2oConfig::automatic`] adds sparse decode.
    #[must_use]
    pub fn new(local: u32, heavy: u32) -> Self {
        Self {
            local,
            heavy,
            select: Self::RECOMMENDED_SELECT,
            sink: Self::RECOMMENDED_SINK.min(heavy),
            dense_tail: Self::RECOMMENDED_DENSE_TAIL,
            coverage: 1.0,
            tile_samples: Self::RECOMMENDED_TILE_SAMPLES,
            tile_sketch: Self::TILE_SKETCH_BY_HEAD,
            tile_pool: Self::TILE_POOL_BY_BACKEND,
            decode_budget: 0,
            decode_coverage: 1.0,
        }
    }

    pub const RECOMMENDED_SELECT: Selection = Selection::Coverage;
    /// L and H of [`H2oConfig::automatic`].
    pub const RECOMMENDED_MEMORY: u32 = 256;
    /// The shortest prompt the front ends give H2O when left to decide (`--h2o auto`): the
    /// length from which `h2o-cli bench` measured coverage selection at 1.1× stock's prefill
    /// speed or more on the default model (docs/results/prefill-speed/README.md, "When H2O
    /// turns on by itself").
    pub const AUTO_FROM_TOKENS: u32 = 4096;
    pub const RECOMMENDED_SINK: u32 = 4;
    pub const RECOMMENDED_DENSE_TAIL: u32 = 64;
    pub const RECOMMENDED_TILE_SAMPLES: u32 = 64;
    /// `tile_sketch` to be chosen by the width of the model's key heads
    /// ([`H2oConfig::recommended_tile_sketch`]).
    pub const TILE_SKETCH_BY_HEAD: u32 = 0;
    /// `tile_pool` to be chosen by where the model's attention runs
    /// ([`H2oConfig::recommended_tile_pool`]).
    pub const TILE_POOL_BY_BACKEND: u32 = u32::MAX;
    /// The pool of [`H2oConfig::recommended_tile_pool`] on the CPU.
    pub const RECOMMENDED_TILE_POOL: u32 = 8192;
    /// Positions a sparse decode step chooses when the flags leave it out.
    pub const RECOMMENDED_DECODE_BUDGET: u32 = 1024;
    /// The block of positions sparse decode sketches (`GGML_H2O_DECODE_BLOCK`); its sinks and
    /// recent window are whole blocks.
    pub const DECODE_BLOCK: u32 = 16;

    /// What h2o-cli and h2o-server run when left to decide, for prompts of
    /// [`H2oConfig::AUTO_FROM_TOKENS`] or more: [`H2oConfig::new`] with L = H = 256 and sparse
    /// decode of [`H2oConfig::RECOMMENDED_DECODE_BUDGET`] positions (docs/results/decode).
    #[must_use]
    pub fn automatic() -> Self {
        Self {
            decode_budget: Self::RECOMMENDED_DECODE_BUDGET,
            ..Self::new(Self::RECOMMENDED_MEMORY, Self::RECOMMENDED_MEMORY)
        }
    }

    /// Whether a prompt of `n_prompt` tokens gets H2O when the front ends decide: from
    /// [`H2oConfig::AUTO_FROM_TOKENS`] tokens on, and never in the stock build, which has no
    /// H2O.
    #[must_use]
    pub fn automatic_for(n_prompt: usize) -> bool {
        !cfg!(feature = "stock") && n_prompt >= Self::AUTO_FROM_TOKENS as usize
    }

    /// The sketch this project recommends for key heads of `head_dim` channels, measured in
    /// docs/results/coverage/README.md, "A sketch by the heads' width": a quarter of heads up to
    /// 128 channels (16 of SmolLM2's 64), half of wider ones (128 of Gemma 3's 256, where a
    /// quarter lost more than +3 % on a novel at 32K and half did not).
    #[must_use]
    pub fn recommended_tile_sketch(head_dim: u32) -> u32 {
        if head_dim > 128 {
            2
        } else {
            4
        }
    }

    /// The pool this project recommends for coverage selection with a heavy budget of `heavy`,
    /// measured in docs/results/coverage/chunk-pool/README.md: where the attention runs on the
    /// CPU, [`H2oConfig::RECOMMENDED_TILE_POOL`] positions. It acts only on chunks with more
    /// candidates than a tile's pool (10,240: prompts beyond about 11K tokens), where it keeps
    /// the prefill's speed from falling with the prompt as proposals from every position let
    /// it fall, within the quality targets; shorter prompts run as without it, bit for bit.
    /// Elsewhere 0: the CUDA kernels have no pool, and neither has a policy other than coverage
    /// selection, nor a heavy budget the pool cannot hold ([`H2oConfig::pool_holds_proposals`]).
    #[must_use]
    pub fn recommended_tile_pool(select: Selection, heavy: u32, attention_on_cpu: bool) -> u32 {
        let fits = Self::pool_holds_proposals(Self::RECOMMENDED_TILE_POOL, heavy);
        if attention_on_cpu && select == Selection::Coverage && fits {
            Self::RECOMMENDED_TILE_POOL
        } else {
            0
        }
    }

    /// Whether a pool of `pool` positions holds the 4 × `heavy` candidates a tile proposes from it.
    #[must_use]
    pub fn pool_holds_proposals(pool: u32, heavy: u32) -> bool {
        u64::from(pool) >= 4 * u64::from(heavy)
    }

    /// This configuration on `model`: a `tile_sketch` of [`H2oConfig::TILE_SKETCH_BY_HEAD`]
    /// becomes the sketch recommended for its key heads, and a `tile_pool` of
    /// [`H2oConfig::TILE_POOL_BY_BACKEND`] the pool recommended where its attention runs;
    /// everything else as it is.
    #[must_use]
    pub fn for_model(self, model: &Model) -> Self {
        let tile_sketch = match self.tile_sketch {
            Self::TILE_SKETCH_BY_HEAD => Self::recommended_tile_sketch(model.key_head_width()),
            n => n,
        };
        let tile_pool = match self.tile_pool {
            Self::TILE_POOL_BY_BACKEND => {
                Self::recommended_tile_pool(self.select, self.heavy, model.attention_on_cpu())
            }
            n => n,
        };
        Self {
            tile_sketch,
            tile_pool,
            ..self
        }
    }

    /// M = L + H, the memory set size.
    #[must_use]
    pub fn memory_size(&self) -> u64 {
        u64::from(self.local) + u64::from(self.heavy)
    }

    /// The policy as tables show it: its name and, for `coverage`, the tile samples, their
    /// sketch and a target below 1 (`coverage/4`, `coverage/32 sketch/4`, `coverage/16@0.95`).
    #[must_use]
    pub fn policy_label(&self) -> String {
        if self.select != Selection::Coverage {
            return self.select.name().to_string();
        }
        let mut label = format!("coverage/{}", self.tile_samples);
        if self.tile_sketch > 1 {
            label += &format!(" sketch/{}", self.tile_sketch);
        }
        match self.tile_pool {
            0 => {}
            Self::TILE_POOL_BY_BACKEND => label += " pool/by backend",
            n => label += &format!(" pool/{n}"),
        }
        if self.coverage < 1.0 {
            label += &format!("@{}", self.coverage);
        }
        label
    }

    /// Keys a decode step reads when `n` positions are visible to it (its own included), per
    /// query head: all `n` with full-attention decode; with sparse decode, the first block(s),
    /// the recent window down to a block boundary, and at most `decode_budget` positions
    /// between them, as `ggml_h2o_decode` chooses them. With `decode_coverage` below 1 this is
    /// the most a step reads; what it read is known once it has chosen
    /// (`Session::decode_keys_per_step`).
    #[must_use]
    pub fn decode_keys(&self, n: u32) -> u32 {
        if self.decode_budget == 0 {
            return n;
        }
        let b = Self::DECODE_BLOCK;
        let n_full = n / b;
        let sink_blocks = self.sink.div_ceil(b).max(1).min(n_full);
        let recent_block = (n.saturating_sub(self.local) / b)
            .min(n_full)
            .max(sink_blocks);
        let chosen = self.decode_budget.min((recent_block - sink_blocks) * b);
        sink_blocks * b + chosen + (n - recent_block * b)
    }

    /// The mean of [`Self::decode_keys`] over decode steps seeing `first ..= last` positions
    /// (0 for no step): what a generation after a prompt of `first - 1` tokens read per step.
    #[must_use]
    pub fn mean_decode_keys(&self, first: u32, last: u32) -> f64 {
        if first > last {
            return 0.0;
        }
        let total: u64 = (first..=last).map(|n| u64::from(self.decode_keys(n))).sum();
        total as f64 / f64::from(last - first + 1)
    }

    /// False for L = H = 0, which means stock attention.
    #[must_use]
    pub fn is_enabled(&self) -> bool {
        self.memory_size() > 0
    }

    /// Front ends build an `H2oConfig` from their flags and drop it where L = H = 0; sparse
    /// decode asked for in it would then be dropped with it, silently.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the flags when this asks for sparse decode (a budget, or
    /// a coverage below 1) without H2O on.
    pub fn check_decode_needs_h2o(&self) -> Result<()> {
        if !self.is_enabled() && (self.decode_budget > 0 || self.decode_coverage != 1.0) {
            return Err(Error::InvalidConfig(
                "--h2o-decode sparse and --h2o-decode-coverage need H2O on: sparse decode reads \
                 the key sketches an H2O context keeps; add --h2o-local and --h2o-heavy (or use \
                 --h2o-decode full)"
                    .into(),
            ));
        }
        Ok(())
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

impl FlashAttention {
    /// llama.cpp's spelling (`-fa on|off|auto`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

impl std::fmt::Display for FlashAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FlashAttention {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        [Self::On, Self::Off, Self::Auto]
            .into_iter()
            .find(|fa| fa.name() == s)
            .ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "unknown flash attention setting {s:?}: use on, off or auto"
                ))
            })
    }
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
    /// Element types of the KV cache's K and V (`-ctk`, `-ctv`).
    pub cache_type_k: CacheType,
    pub cache_type_v: CacheType,
    /// H2O sparse prefill; `None` (or L = H = 0) is stock attention.
    pub h2o: Option<H2oConfig>,
    /// With H2O: keep llama.cpp's undo log (`h2o_undo_log`), so that
    /// [`Session::truncate`](crate::Session::truncate) into the prompt keeps the complete chunks
    /// below the cut and evaluates only the rest again, instead of all kept tokens. Costs host
    /// memory: about one copy of the H2O scores, plus M scores per head, layer and chunk. Off by
    /// default, as in llama.cpp; ignored without H2O.
    pub h2o_undo_log: bool,
    /// Copy every H2O attention op's inputs and output out of the graph, for checks against
    /// the plain-Rust reference (`h2o_research::reference`) (see [`Session::take_attention_captures`](crate::Session::take_attention_captures)). Slow and memory-hungry:
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
            cache_type_k: CacheType::F16,
            cache_type_v: CacheType::F16,
            h2o: None,
            h2o_undo_log: false,
            capture_attention: false,
        }
    }
}

impl SessionConfig {
    /// The chunk size S that H2O runs with: `-ub`, capped at `-c` where given (llama.cpp caps
    /// `-b` at `-c` and `-ub` at `-b`).
    #[must_use]
    pub fn chunk_size(&self) -> u32 {
        match self.n_ctx {
            0 => self.n_ubatch,
            c => self.n_ubatch.min(c),
        }
    }

    /// This configuration on `model`, with what it leaves to the model chosen
    /// ([`H2oConfig::for_model`]); [`crate::Session::new`] creates its context with it.
    #[must_use]
    pub fn for_model(self, model: &Model) -> Self {
        Self {
            h2o: self.h2o.map(|h2o| h2o.for_model(model)),
            ..self
        }
    }

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
        if self.cache_type_v.is_quantized() && self.flash_attn == FlashAttention::Off {
            return bad(format!(
                "a quantized V cache (-ctv {}) needs flash attention, as in llama.cpp: use -fa on or \
                 auto, or -ctv f16",
                self.cache_type_v
            ));
        }
        if let Some(h2o) = self.h2o.filter(H2oConfig::is_enabled) {
            let chunk = self.chunk_size();
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
            if h2o.sink > h2o.heavy {
                return bad(format!(
                    "H2O sink --h2o-sink {} is larger than the heavy budget --h2o-heavy {}: the sink \
                     positions come out of that budget; lower the sink or raise the budget",
                    h2o.sink, h2o.heavy
                ));
            }
            if !(h2o.coverage > 0.0 && h2o.coverage <= 1.0) {
                return bad(format!(
                    "H2O coverage --h2o-coverage {} must be in (0, 1]: the share of attention a tile's \
                     memory should cover (1 spends the whole budget)",
                    h2o.coverage
                ));
            }
            if !(1..=64).contains(&h2o.tile_samples) || 64 % h2o.tile_samples != 0 {
                return bad(format!(
                    "H2O --h2o-tile-samples {} must divide the tile of 64 queries: use 1, 2, 4, 8, \
                     16, 32 or 64",
                    h2o.tile_samples
                ));
            }
            if ![H2oConfig::TILE_SKETCH_BY_HEAD, 1, 2, 4, 8].contains(&h2o.tile_sketch) {
                return bad(format!(
                    "H2O --h2o-tile-sketch {} must be 1, 2, 4 or 8: the sampled queries' logits \
                     read 1/N of the key channels (1: all; 0 or leave it out: by the heads' width)",
                    h2o.tile_sketch
                ));
            }
            if h2o.tile_pool > 0
                && h2o.tile_pool != H2oConfig::TILE_POOL_BY_BACKEND
                && (h2o.select != Selection::Coverage
                    || !H2oConfig::pool_holds_proposals(h2o.tile_pool, h2o.heavy))
            {
                return bad(format!(
                    "H2O --h2o-tile-pool {} must be 0 (off) or, with --h2o-select coverage, at least \
                     4 × --h2o-heavy = {}: each tile proposes that many candidates from the pool",
                    h2o.tile_pool,
                    4 * u64::from(h2o.heavy)
                ));
            }
            if self.n_ctx > 0 && h2o.decode_budget > self.n_ctx {
                return bad(format!(
                    "H2O decode budget --h2o-decode-budget {} is larger than the context -c {}: a \
                     step cannot attend to more positions than the sequence holds; lower it (or \
                     use --h2o-decode full)",
                    h2o.decode_budget, self.n_ctx
                ));
            }
            if !(h2o.decode_coverage > 0.0 && h2o.decode_coverage <= 1.0) {
                return bad(format!(
                    "H2O decode coverage --h2o-decode-coverage {} must be in (0, 1]: the share of a \
                     step's estimated attention its chosen positions hold (1 takes the whole budget)",
                    h2o.decode_coverage
                ));
            }
            if h2o.decode_coverage < 1.0 && h2o.decode_budget == 0 {
                return bad(format!(
                    "H2O decode coverage --h2o-decode-coverage {} needs sparse decode: add \
                     --h2o-decode sparse (its --h2o-decode-budget is then the most a step takes)",
                    h2o.decode_coverage
                ));
            }
            if h2o.decode_budget > 0 && h2o.decode_budget < H2oConfig::DECODE_BLOCK {
                return bad(format!(
                    "H2O decode budget --h2o-decode-budget {} is smaller than one block of {} \
                     positions: use at least {}, or --h2o-decode full",
                    h2o.decode_budget,
                    H2oConfig::DECODE_BLOCK,
                    H2oConfig::DECODE_BLOCK
                ));
            }
            if self.n_ctx > 0 && h2o.dense_tail > self.n_ctx {
                return bad(format!(
                    "H2O dense tail --h2o-dense-tail {} is longer than the context -c {}: lower it",
                    h2o.dense_tail, self.n_ctx
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

#[cfg(test)]
mod tests {
    use super::{H2oConfig, Selection};

    #[test]
    fn the_recommended_pool_is_the_cpus_and_coverage_selections_alone() {
        let pool = H2oConfig::recommended_tile_pool;
        let (c, rec) = (Selection::Coverage, H2oConfig::RECOMMENDED_TILE_POOL);
        assert_eq!(pool(c, 256, true), rec);
        assert_eq!(
            pool(c, rec / 4, true),
            rec,
            "a pool of 4 H is the least allowed"
        );
        assert_eq!(
            pool(c, rec / 4 + 1, true),
            0,
            "a tile proposes 4 H from the pool"
        );
        assert_eq!(
            pool(c, 256, false),
            0,
            "offloaded: the CUDA kernels have no pool"
        );
        assert_eq!(pool(Selection::Seed, 256, true), 0);
        assert_eq!(pool(Selection::Hybrid, 256, true), 0);
        let label = H2oConfig::new(256, 256).policy_label();
        assert!(label.ends_with("pool/by backend"), "{label}");
    }

    #[test]
    fn policies_parse_by_name_and_retired_ones_are_refused_naming_what_replaces_them() {
        for p in Selection::ALL {
            assert_eq!(p.name().parse::<Selection>().unwrap(), p);
            #[cfg(not(feature = "stock"))]
            assert_eq!(
                p as u32,
                p.to_sys(),
                "{p}: the discriminant is llama.cpp's value"
            );
        }
        assert_eq!("h2o".parse::<Selection>().unwrap(), Selection::Seed);
        for retired in ["query", "query-mean"] {
            let err = retired.parse::<Selection>().unwrap_err().to_string();
            assert!(
                err.contains("was retired") && err.contains("use hybrid"),
                "{err}"
            );
        }
        let err = "nope".parse::<Selection>().unwrap_err().to_string();
        assert!(err.contains("use one of seed, hybrid, coverage"), "{err}");
    }

    #[test]
    fn decode_keys_count_what_a_sparse_step_reads() {
        let full = H2oConfig::new(64, 64);
        assert_eq!(full.decode_keys(1612), 1612);
        let sparse = H2oConfig {
            decode_budget: 256,
            ..full
        };
        // one sink block, 16 chosen blocks, and the window from position 1536 (a block boundary
        // at or below 1612 - 64) to the end
        assert_eq!(sparse.decode_keys(1612), 17 * 16 + (1612 - 1536));
        // the budget counts positions, not blocks
        let odd = H2oConfig {
            decode_budget: 100,
            ..full
        };
        assert_eq!(odd.decode_keys(1612), 16 + 100 + (1612 - 1536));
        // a budget that covers every block between the sinks and the window reads everything
        let covering = H2oConfig {
            decode_budget: 1024,
            ..full
        };
        assert_eq!(covering.decode_keys(712), 712);
        // fewer positions than a block: all of them
        assert_eq!(sparse.decode_keys(10), 10);
        assert_eq!(sparse.decode_keys(0), 0);
        // the mean over steps: full decode reads one more key each step
        assert_eq!(full.mean_decode_keys(10, 12), 11.0);
        assert_eq!(full.mean_decode_keys(5, 4), 0.0);
    }
}
