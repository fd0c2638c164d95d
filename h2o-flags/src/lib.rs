//! The flags that `h2o-cli`'s commands and `h2o-server` share, each declared once with one type
//! and one default: the engine's ([`EngineFlags`]: `-m -c -b -ub -t -ngl -fa -ctk -ctv`), H2O's
//! memory ([`H2oMemory`]) and policy ([`H2oPolicy`]), sampling ([`SamplingFlags`]: `--temp
//! --top-k --top-p -s -n -v`), and llama.cpp's multi-letter spellings ([`llama_spellings`]).
//! Both front ends turn them into the same [`SessionConfig`] and [`H2oConfig`].
//!
//! ```
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     engine: h2o_flags::EngineFlags,
//!     #[command(flatten)]
//!     h2o: h2o_flags::H2oFlags,
//! }
//!
//! let cli = Cli::parse_from(["app", "--h2o-local", "256", "--h2o-heavy", "256"]);
//! let h2o = cli.h2o.choice().unwrap().for_prompt(100, false).unwrap().expect("H2O on");
//! assert_eq!((h2o.local, h2o.heavy), (256, 256));
//! let session = cli.engine.session_config(Some(h2o));
//! assert_eq!((session.n_batch, session.n_ubatch), (4096, 1024));
//! // left to decide: H2O for long prompts only
//! let cli = Cli::parse_from(["app"]);
//! let choice = cli.h2o.choice().unwrap();
//! assert!(choice.for_prompt(100, false).unwrap().is_none());
//! let long = h2o_llama::H2oConfig::AUTO_FROM_TOKENS as usize;
//! assert!(choice.for_prompt(long, false).unwrap().is_some());
//! // with the layers on a GPU, only when asked for
//! assert!(choice.for_prompt(long, true).unwrap().is_none());
//! assert_eq!(cli.engine.session_config(None).n_ubatch, 512);
//! ```
//!
//! [`SessionConfig`]: h2o_llama::SessionConfig

mod engine;
pub mod llama_spellings;
mod sampling;

pub use engine::{EngineFlag, EngineFlags, RpcServers};
pub use sampling::SamplingFlags;

use clap::{Args, ValueEnum};
use h2o_llama::{Error, H2oConfig, Selection, SessionConfig};

/// Whether a run or the server uses H2O (`--h2o`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum H2oSwitch {
    /// H2O for prompts of 4,096 tokens or more, full attention for shorter ones (the server:
    /// H2O on when its slots hold such a prompt)
    // the number is H2oConfig::AUTO_FROM_TOKENS, which help text cannot name (a unit test
    // holds the two together)
    #[default]
    Auto,
    /// H2O for every prompt
    On,
    /// full attention, as stock llama.cpp
    Off,
}

impl H2oSwitch {
    /// The flag's value.
    pub fn as_str(self) -> &'static str {
        match self {
            H2oSwitch::Auto => "auto",
            H2oSwitch::On => "on",
            H2oSwitch::Off => "off",
        }
    }
}

/// How generated tokens attend (`--h2o-decode`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeMode {
    /// every step reads the whole cache (llama.cpp's decode)
    Full,
    /// every step reads its sinks, recent window and the positions its query points at
    Sparse,
}

impl DecodeMode {
    /// The flag's value for this mode.
    pub fn as_str(self) -> &'static str {
        match self {
            DecodeMode::Full => "full",
            DecodeMode::Sparse => "sparse",
        }
    }
}

/// How H2O chooses its memory and how generated tokens attend: every flag of [`H2oConfig`] but
/// the memory's size and sinks ([`H2oMemory`]). Defaults are the library's recommendation
/// ([`H2oConfig::new`]).
#[derive(Args, Debug, Clone, Copy)]
pub struct H2oPolicy {
    /// H2O: how the heavy part of the memory is chosen: seed (the seed rule: accumulated past
    /// attention; also taken as h2o), hybrid (half blocks of 16 by the chunk's own queries, half
    /// accumulated attention), coverage (each tile of 64 queries its own memory from sampled
    /// queries; budgets shared by the heads where they cover most)
    #[arg(long = "h2o-select", value_name = "POLICY", default_value_t = H2oConfig::RECOMMENDED_SELECT)]
    pub select: Selection,
    /// H2O: the last T tokens of a prompt attend to the whole prompt (a longer tail than the
    /// prompt covers all of it)
    #[arg(long = "h2o-dense-tail", value_name = "T", default_value_t = H2oConfig::RECOMMENDED_DENSE_TAIL)]
    pub dense_tail: u32,
    /// H2O coverage policy: a tile takes no more budget once its memory covers this share of
    /// its estimated attention, in (0, 1] (1: the whole budget -L + -H on average)
    // hidden: a research knob; its default spends the whole budget, which every measured target uses
    #[arg(
        long = "h2o-coverage",
        value_name = "GAMMA",
        default_value_t = 1.0,
        hide = true
    )]
    pub coverage: f32,
    /// H2O coverage policy: queries of each tile of 64 that attend to every position before the
    /// chunk to choose its memory (1, 2, 4, 8, 16, 32 or 64; more choose better and cost more)
    #[arg(long = "h2o-tile-samples", value_name = "N", default_value_t = H2oConfig::RECOMMENDED_TILE_SAMPLES)]
    pub tile_samples: u32,
    /// H2O coverage policy: the sampled queries' logits read 1/N of the key channels, those with
    /// the most key energy (1: exact; 2, 4 or 8 cost that share, so more samples fit; 0: by the
    /// model's key heads, a quarter of up to 128 channels, half of wider ones)
    #[arg(long = "h2o-tile-sketch", value_name = "N", default_value_t = H2oConfig::TILE_SKETCH_BY_HEAD)]
    pub tile_sketch: u32,
    /// H2O coverage policy: 0, or a pool of N positions per chunk and head, chosen by every 16th
    /// query of each tile, among which each tile's samples propose instead of every earlier
    /// position (with the N/4 its own such queries attend to most), so that the proposal's cost
    /// stops growing with the prompt; it acts on chunks with more than 1.25 × N candidates (0 or
    /// at least 4 × --h2o-heavy; CPU only) [default: 8192 where the attention runs on the CPU,
    /// 0 where it is offloaded]
    #[arg(long = "h2o-tile-pool", value_name = "N")]
    pub tile_pool: Option<u32>,
    /// H2O decode: full (each generated token reads its whole cache) or sparse (the first block,
    /// the last --h2o-local positions and the --h2o-decode-budget positions its query points
    /// at, by logits estimated from a quarter of the key channels; the cache is kept whole)
    /// [default: sparse where H2O runs without --h2o-local/--h2o-heavy; full with them and in
    /// the commands that compare H2O with full attention]
    #[arg(long = "h2o-decode", value_name = "MODE", value_enum)]
    pub decode: Option<DecodeMode>,
    /// H2O sparse decode: positions a step chooses, besides the first block and the recent
    /// window (at most the context of a sequence)
    #[arg(long = "h2o-decode-budget", value_name = "N", default_value_t = H2oConfig::RECOMMENDED_DECODE_BUDGET)]
    pub decode_budget: u32,
    /// H2O sparse decode: of its budget, a step takes only the fewest positions whose estimated
    /// attention holds this share of all those between the sinks and the window, in (0, 1]
    /// (1: the whole budget; the budget is then a cap)
    // hidden: a research knob; its default takes the whole budget, which every measured target uses
    #[arg(
        long = "h2o-decode-coverage",
        value_name = "GAMMA",
        default_value_t = 1.0,
        hide = true
    )]
    pub decode_coverage: f32,
}

impl H2oPolicy {
    /// This policy with a memory of `local` recent and `heavy` chosen positions and the
    /// library's sinks (not checked: sessions check it when they are created); decode as
    /// `--h2o-decode` says, full where it is left out.
    pub fn config(&self, local: u32, heavy: u32) -> H2oConfig {
        self.config_decoding(local, heavy, DecodeMode::Full)
    }

    /// As [`H2oPolicy::config`], with `decode` where `--h2o-decode` is left out.
    pub fn config_decoding(&self, local: u32, heavy: u32, decode: DecodeMode) -> H2oConfig {
        let mut h2o = H2oConfig::new(local, heavy);
        h2o.select = self.select;
        h2o.dense_tail = self.dense_tail;
        h2o.coverage = self.coverage;
        h2o.tile_samples = self.tile_samples;
        h2o.tile_sketch = self.tile_sketch;
        if let Some(pool) = self.tile_pool {
            h2o.tile_pool = pool;
        }
        h2o.decode_budget = match self.decode.unwrap_or(decode) {
            DecodeMode::Sparse => self.decode_budget,
            DecodeMode::Full => 0,
        };
        h2o.decode_coverage = self.decode_coverage;
        h2o
    }

    /// The flags that give this policy to another process that takes them.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec!["--h2o-select".into(), self.select.to_string()];
        a.extend(["--h2o-dense-tail".into(), self.dense_tail.to_string()]);
        a.extend(["--h2o-coverage".into(), self.coverage.to_string()]);
        a.extend(["--h2o-tile-samples".into(), self.tile_samples.to_string()]);
        a.extend(["--h2o-tile-sketch".into(), self.tile_sketch.to_string()]);
        if let Some(pool) = self.tile_pool {
            // only where asked, so that builds without the flag take the others
            a.extend(["--h2o-tile-pool".into(), pool.to_string()]);
        }
        let decode = self.decode.unwrap_or(DecodeMode::Full);
        a.extend(["--h2o-decode".into(), decode.as_str().into()]);
        a.extend(["--h2o-decode-budget".into(), self.decode_budget.to_string()]);
        a.extend([
            "--h2o-decode-coverage".into(),
            self.decode_coverage.to_string(),
        ]);
        a
    }
}

/// The memory's size and sinks: `--h2o-local`, `--h2o-heavy`, `--h2o-sink`.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct H2oMemory {
    /// H2O: recent tokens L kept from the previous chunk [default: 0, and H2O is off while L = H
    /// = 0; 256 in the commands that compare H2O with full attention]
    // Taken as signed so that a negative value gets a message naming the flag, not clap's
    // "unexpected argument '-5'".
    #[arg(long = "h2o-local", value_name = "L", allow_negative_numbers = true)]
    pub local: Option<i64>,
    /// H2O: heavy-hitter tokens H kept by the selection policy (--h2o-select) [default: as
    /// --h2o-local]
    #[arg(long = "h2o-heavy", value_name = "H", allow_negative_numbers = true)]
    pub heavy: Option<i64>,
    /// H2O: the first N positions always stay in memory (out of the heavy budget)
    /// [default: 4, at most --h2o-heavy]
    #[arg(long = "h2o-sink", value_name = "N")]
    pub sink: Option<u32>,
}

impl H2oMemory {
    /// L and H in the commands that compare H2O with full attention, where left out.
    pub const COMPARED: u32 = 256;

    /// L and H, each `default` where left out; a count out of range is an
    /// [`Error::InvalidConfig`] naming its flag.
    pub fn local_heavy(&self, default: u32) -> Result<(u32, u32), Error> {
        let count = |flag: &str, v: Option<i64>| match v {
            None => Ok(default),
            Some(v) => u32::try_from(v).map_err(|_| {
                Error::InvalidConfig(format!(
                    "{flag} must be between 0 and {}, got {v}",
                    u32::MAX
                ))
            }),
        };
        Ok((
            count("--h2o-local", self.local)?,
            count("--h2o-heavy", self.heavy)?,
        ))
    }
}

/// H2O's flags: whether it runs ([`H2oSwitch`]), the memory ([`H2oMemory`]) and its policy
/// ([`H2oPolicy`]).
#[derive(Args, Debug, Clone, Copy)]
pub struct H2oFlags {
    /// H2O: auto (on for prompts of 4,096 tokens or more, with L = H = 256 and chunks of 1,024
    /// unless given; the server: on when its slots hold such a prompt), on (every prompt), or
    /// off (full attention, as stock llama.cpp). Giving --h2o-local or --h2o-heavy turns it
    /// on; both 0 turn it off
    #[arg(long = "h2o", value_name = "WHEN", value_enum, default_value_t = H2oSwitch::Auto)]
    pub switch: H2oSwitch,
    #[command(flatten)]
    pub memory: H2oMemory,
    #[command(flatten)]
    pub policy: H2oPolicy,
}

/// What the flags of a run or the server decide about H2O.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum H2oChoice {
    /// Full attention.
    Off,
    /// H2O with this configuration, whatever the prompt.
    On(H2oConfig),
    /// Left to the front end (`--h2o auto` and no memory flags): this configuration for
    /// prompts of [`H2oConfig::AUTO_FROM_TOKENS`] tokens or more, full attention for shorter
    /// ones and wherever layers run on a GPU ([`H2oChoice::for_prompt`]).
    Auto {
        h2o: H2oConfig,
        /// `--h2o-decode sparse` or `--h2o-decode-coverage` was given: a prompt that runs full
        /// attention cannot have it, and is refused rather than decoded fully.
        sparse_decode_asked: bool,
    },
}

impl H2oChoice {
    /// The H2O of a prompt of `n_prompt` tokens (`None`: full attention), with the layers on a
    /// GPU or not ([`EngineFlags::layers_on_gpu`]). Left to decide, H2O turns on by itself
    /// ([`H2oChoice::by_itself`]) from [`H2oConfig::AUTO_FROM_TOKENS`] tokens on the CPU only.
    /// An [`Error::InvalidConfig`] when the flags asked for sparse decode and H2O does not turn
    /// on by itself.
    pub fn for_prompt(
        &self,
        n_prompt: usize,
        layers_on_gpu: bool,
    ) -> Result<Option<H2oConfig>, Error> {
        match *self {
            H2oChoice::Off => Ok(None),
            H2oChoice::On(h2o) => Ok(Some(h2o)),
            H2oChoice::Auto { h2o, .. } if Self::by_itself(n_prompt, layers_on_gpu) => {
                Ok(Some(h2o))
            }
            H2oChoice::Auto {
                sparse_decode_asked: false,
                ..
            } => Ok(None),
            H2oChoice::Auto { .. } => Err(Error::InvalidConfig(format!(
                "--h2o-decode sparse and --h2o-decode-coverage need H2O on, and {}: add --h2o on \
                 (or use --h2o-decode full)",
                Self::why_full_attention(n_prompt, layers_on_gpu)
            ))),
        }
    }

    /// Whether H2O turns on by itself (`--h2o auto`) for a prompt of `n_prompt` tokens: from
    /// [`H2oConfig::AUTO_FROM_TOKENS`] tokens ([`H2oConfig::automatic_for`]), where the bench
    /// measured its default configuration at 1.1x full attention's prefill speed or more, and
    /// only with the layers on the CPU: on a GPU no length has been measured where it is faster
    /// than full attention (coverage selection ran at 0.31x at 32K on an H200, and sparse decode
    /// slower than full decode), so there it runs only when asked for (`--h2o on`).
    pub fn by_itself(n_prompt: usize, layers_on_gpu: bool) -> bool {
        !layers_on_gpu && H2oConfig::automatic_for(n_prompt)
    }

    /// Why a prompt of `n_prompt` tokens left to decide runs full attention, for messages.
    pub fn why_full_attention(n_prompt: usize, layers_on_gpu: bool) -> String {
        if layers_on_gpu {
            "layers run on the GPU or RPC servers (-ngl), where H2O does not turn on by itself: \
             its default has not been measured faster than full attention there"
                .into()
        } else {
            format!(
                "a prompt of {n_prompt} tokens runs full attention (H2O turns on by itself from {})",
                H2oConfig::AUTO_FROM_TOKENS
            )
        }
    }

    /// `e`, from checking a configuration H2O turned on by itself (`why` says what turned it
    /// on), with the way out: flags it fits, or `--h2o off`.
    pub fn refused_by_itself(e: Error, why: &str) -> Error {
        match e {
            Error::InvalidConfig(msg) => Error::InvalidConfig(format!(
                "{msg}; {why}: give flags it fits, or --h2o off for full attention"
            )),
            e => e,
        }
    }

    /// The configuration H2O runs with where it runs (`None`: never).
    pub fn h2o(&self) -> Option<H2oConfig> {
        match *self {
            H2oChoice::Off => None,
            H2oChoice::On(h2o) | H2oChoice::Auto { h2o, .. } => Some(h2o),
        }
    }
}

/// What H2O turned on by itself (`--h2o auto`) comes to on the engine's chunks: itself where
/// its memory fits them (M = L + H < S), full attention where it does not (an `-ub` of 512 or
/// less, llama.cpp's default among them). Never a refusal: full attention would have run. A
/// memory scaled to such chunks was measured and left out: at `-ub 512`, L = H = 128 lost +0.8
/// to +2.4 % perplexity on six texts at 4K and L = H = 192 up to +1.7 %, where the default
/// keeps prose and fiction within +1 % (docs/results/prefill-speed/README.md, "Chunks that do
/// not hold the memory").
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AutoFit {
    /// The memory fits the chunks.
    Fits(H2oConfig),
    /// The memory does not fit chunks of `chunk` tokens: full attention.
    FullAttention { chunk: u32 },
}

impl AutoFit {
    /// `h2o`, which H2O turned on by itself, on the chunks of `engine`'s flags with H2O on in a
    /// context of `n_ctx` tokens (0: the model's).
    pub fn of(h2o: H2oConfig, engine: &EngineFlags, n_ctx: u32) -> Self {
        let chunk = SessionConfig {
            n_ctx,
            ..engine.session_config(Some(h2o))
        }
        .chunk_size();
        if h2o.memory_size() < u64::from(chunk) {
            AutoFit::Fits(h2o)
        } else {
            AutoFit::FullAttention { chunk }
        }
    }

    /// The configuration that runs (`None`: full attention).
    pub fn h2o(&self) -> Option<H2oConfig> {
        match *self {
            AutoFit::Fits(h2o) => Some(h2o),
            AutoFit::FullAttention { .. } => None,
        }
    }

    /// One word for machine-read records (`--json`, `/props`): `on` or `full_attention`.
    pub fn outcome(&self) -> &'static str {
        match self {
            AutoFit::Fits(_) => AutoDecision::ON,
            AutoFit::FullAttention { .. } => AutoDecision::FULL_ATTENTION,
        }
    }

    /// What a user reads, as a clause: the memory on the chunks, or why full attention runs.
    pub fn note(&self) -> String {
        match *self {
            AutoFit::Fits(h2o) => format!(
                "its memory of L = {} H = {} fits the chunks",
                h2o.local, h2o.heavy
            ),
            AutoFit::FullAttention { chunk } => format!(
                "chunks of -ub {chunk} (-ub capped by -b and -c) do not hold H2O's memory of \
                 L + H = {}, and a memory scaled down to them loses more than the default allows: \
                 H2O turns on by itself with -ub {} or more",
                2 * H2oConfig::RECOMMENDED_MEMORY,
                2 * H2oConfig::RECOMMENDED_MEMORY + 1
            ),
        }
    }
}

/// What `--h2o auto` came to for a run or the server: a word for machine-read records
/// (h2o-cli's `--json`, h2o-server's `/props`: `on` or `full_attention`) and what a user reads
/// on stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoDecision {
    pub outcome: &'static str,
    pub note: String,
}

impl AutoDecision {
    /// The outcome where H2O runs.
    pub const ON: &'static str = "on";
    /// The outcome where full attention runs.
    pub const FULL_ATTENTION: &'static str = "full_attention";

    /// Full attention, with `note` saying why.
    pub fn full_attention(note: String) -> Self {
        Self {
            outcome: Self::FULL_ATTENTION,
            note,
        }
    }

    /// Full attention because of `why`, as the server's setup line and `/props` say it.
    pub fn left_off(why: &str) -> Self {
        Self::full_attention(format!("H2O left off: {why}; --h2o on to use it"))
    }
}

impl H2oFlags {
    /// This policy and the given sinks with a memory of `local` and `heavy` positions (not
    /// checked: sessions check it when they are created); decode as `--h2o-decode` says, full
    /// where it is left out.
    pub fn with_memory(&self, local: u32, heavy: u32) -> H2oConfig {
        self.with_memory_decoding(local, heavy, DecodeMode::Full)
    }

    fn with_memory_decoding(&self, local: u32, heavy: u32, decode: DecodeMode) -> H2oConfig {
        let mut h2o = self.policy.config_decoding(local, heavy, decode);
        if let Some(sink) = self.memory.sink {
            h2o.sink = sink;
        }
        h2o
    }

    /// What a run (h2o-cli) or the server does: H2O off with `--h2o off` or L = H = 0 given, on
    /// with L or H given or `--h2o on` (L and H 256 where left out), else left to the prompt's
    /// length ([`H2oChoice::Auto`]). Without memory flags decode is sparse unless
    /// `--h2o-decode full` ([`H2oConfig::automatic`]); with them, full unless `--h2o-decode
    /// sparse`.
    /// A count out of range, memory flags beside `--h2o off`, or sparse decode without H2O, is
    /// an [`Error::InvalidConfig`] naming the flag.
    pub fn choice(&self) -> Result<H2oChoice, Error> {
        let given = self.memory.local.is_some() || self.memory.heavy.is_some();
        if self.switch == H2oSwitch::Off {
            if given {
                return Err(Error::InvalidConfig(
                    "--h2o off is full attention: leave out --h2o-local and --h2o-heavy, or \
                     leave out --h2o off to use them"
                        .into(),
                ));
            }
            self.with_memory(0, 0).check_decode_needs_h2o()?;
            return Ok(H2oChoice::Off);
        }
        // without memory flags, the recommended configuration, which decodes sparsely; with
        // them, a count left out is 0 and decode full unless asked, as before H2O turned on by
        // itself
        let (default, decode) = if given {
            (0, DecodeMode::Full)
        } else {
            (H2oConfig::RECOMMENDED_MEMORY, DecodeMode::Sparse)
        };
        let (local, heavy) = self.memory.local_heavy(default)?;
        let h2o = self.with_memory_decoding(local, heavy, decode);
        if !h2o.is_enabled() {
            if self.switch == H2oSwitch::On {
                return Err(Error::InvalidConfig(
                    "--h2o on needs a memory: --h2o-local and --h2o-heavy of 0 turn H2O off; \
                     give counts above 0 or leave them out (256 each)"
                        .into(),
                ));
            }
            h2o.check_decode_needs_h2o()?;
            return Ok(H2oChoice::Off);
        }
        Ok(match (self.switch, given) {
            (H2oSwitch::Auto, false) => H2oChoice::Auto {
                h2o,
                sparse_decode_asked: self.policy.decode == Some(DecodeMode::Sparse)
                    || self.policy.decode_coverage != 1.0,
            },
            _ => H2oChoice::On(h2o),
        })
    }

    /// The H2O of a run whose prompt has `n_prompt` tokens (`None`: full attention), with the
    /// layers on a GPU or not ([`EngineFlags::layers_on_gpu`]): [`H2oChoice::for_prompt`] of
    /// these flags' choice, as [`H2oFlags::on_backend`] runs it.
    pub fn for_prompt(
        &self,
        n_prompt: usize,
        layers_on_gpu: bool,
    ) -> Result<Option<H2oConfig>, Error> {
        let h2o = self.choice()?.for_prompt(n_prompt, layers_on_gpu)?;
        Ok(h2o.map(|h2o| self.on_backend(h2o, layers_on_gpu)))
    }

    /// `h2o` as it runs with the layers on a GPU or not: on a GPU, sparse decode, which decoded
    /// slower than full decode there (144 against 383 steps/s after 8K on an H200), only where
    /// `--h2o-decode sparse` or `--h2o-decode-coverage` asks for it; on the CPU as it is.
    pub fn on_backend(&self, mut h2o: H2oConfig, layers_on_gpu: bool) -> H2oConfig {
        let decode_asked = self.policy.decode.is_some() || self.policy.decode_coverage != 1.0;
        if layers_on_gpu && !decode_asked {
            h2o.decode_budget = 0;
        }
        h2o
    }

    /// The H2O configuration of a command that compares H2O with full attention (bench,
    /// perplexity, eval, the studies): L and H [`H2oMemory::COMPARED`] where left out, full
    /// decode unless `--h2o-decode sparse`. Such commands set H2O on themselves: `--h2o` other
    /// than auto is refused there.
    pub fn compared(&self) -> Result<H2oConfig, Error> {
        if self.switch != H2oSwitch::Auto {
            return Err(Error::InvalidConfig(format!(
                "--h2o {}: this command compares H2O with full attention and runs both;                  leave out --h2o",
                self.switch.as_str()
            )));
        }
        let (local, heavy) = self.memory.local_heavy(H2oMemory::COMPARED)?;
        Ok(self.with_memory(local, heavy))
    }

    /// The flags that give `h2o` (the memory and this policy) to another process that takes
    /// them.
    pub fn args(&self, h2o: &H2oConfig) -> Vec<String> {
        let mut a: Vec<String> = vec!["--h2o-local".into(), h2o.local.to_string()];
        a.extend(["--h2o-heavy".into(), h2o.heavy.to_string()]);
        a.extend(["--h2o-sink".into(), h2o.sink.to_string()]);
        a.extend(self.policy.args());
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        h2o: H2oFlags,
    }

    fn parse(args: &[&str]) -> H2oFlags {
        Cli::try_parse_from(std::iter::once("app").chain(args.iter().copied()))
            .expect("flags parse")
            .h2o
    }

    /// The H2O of a run whose prompt has `n` tokens.
    fn run_config(flags: &H2oFlags, n: usize) -> Result<Option<H2oConfig>, Error> {
        flags.choice()?.for_prompt(n, false)
    }

    #[test]
    fn the_help_says_from_which_length_h2o_turns_on_by_itself() {
        use clap::CommandFactory;
        let n = H2oConfig::AUTO_FROM_TOKENS;
        let said = format!("{},{:03} tokens or more", n / 1000, n % 1000);
        let mut cli = Cli::command();
        let help = cli.render_long_help().to_string();
        let flag = help.find("--h2o <WHEN>").expect("--h2o in the help");
        let shown = &help[flag..];
        assert_eq!(
            shown.matches(said.as_str()).count(),
            2,
            "--h2o's help and its `auto` value say {said}:\n{shown}"
        );
        assert!(!help.contains("AUTO_FROM_TOKENS"), "{help}");
    }

    #[test]
    fn no_flags_leave_h2o_to_the_prompts_length() {
        let auto = H2oConfig::AUTO_FROM_TOKENS as usize;
        let flags = parse(&[]);
        assert_eq!(flags.choice().unwrap().h2o(), Some(H2oConfig::automatic()));
        assert!(matches!(flags.choice().unwrap(), H2oChoice::Auto { .. }));
        assert_eq!(run_config(&flags, auto - 1).unwrap(), None);
        assert_eq!(
            run_config(&flags, auto).unwrap(),
            Some(H2oConfig::automatic())
        );
        let h2o = H2oConfig::automatic();
        assert_eq!((h2o.local, h2o.heavy, h2o.decode_budget), (256, 256, 1024));
        assert_eq!(h2o.select, Selection::Coverage);
        // --h2o-decode full keeps the rest
        let full = run_config(&parse(&["--h2o-decode", "full"]), auto)
            .unwrap()
            .unwrap();
        assert_eq!(full.decode_budget, 0);
        // sparse decode asked for is never dropped with H2O: a short prompt is refused
        let sparse = parse(&["--h2o-decode", "sparse"]);
        assert_eq!(
            run_config(&sparse, auto).unwrap().unwrap().decode_budget,
            1024
        );
        let err = run_config(&sparse, auto - 1).unwrap_err();
        assert!(err.to_string().contains("--h2o on"), "{err}");
    }

    #[test]
    fn h2o_does_not_turn_on_by_itself_with_layers_on_a_gpu() {
        let long = 4 * H2oConfig::AUTO_FROM_TOKENS as usize;
        let auto = parse(&[]).choice().unwrap();
        assert_eq!(auto.for_prompt(long, true).unwrap(), None);
        assert_eq!(
            auto.for_prompt(long, false).unwrap(),
            Some(H2oConfig::automatic())
        );
        assert!(!H2oChoice::by_itself(long, true));
        // sparse decode asked for is refused there, naming the GPU and the way out
        let err = parse(&["--h2o-decode", "sparse"])
            .choice()
            .unwrap()
            .for_prompt(long, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("GPU") && err.contains("--h2o on"), "{err}");
        // asked for, it runs there too, with full decode unless sparse decode is asked for
        let on = parse(&["--h2o", "on"]);
        let h2o = on.for_prompt(long, true).unwrap().unwrap();
        assert_eq!(h2o.decode_budget, 0);
        assert_eq!(
            H2oConfig {
                decode_budget: H2oConfig::RECOMMENDED_DECODE_BUDGET,
                ..h2o
            },
            H2oConfig::automatic()
        );
        assert_eq!(
            on.for_prompt(long, false).unwrap(),
            Some(H2oConfig::automatic())
        );
        let sparse = parse(&["--h2o", "on", "--h2o-decode", "sparse"]);
        assert_eq!(
            sparse
                .for_prompt(long, true)
                .unwrap()
                .unwrap()
                .decode_budget,
            H2oConfig::RECOMMENDED_DECODE_BUDGET
        );
        let cut = parse(&["--h2o", "on", "--h2o-decode-coverage", "0.9"]);
        assert!(cut.for_prompt(long, true).unwrap().unwrap().decode_budget > 0);
        let given = parse(&["--h2o-local", "128", "--h2o-heavy", "128"])
            .choice()
            .unwrap();
        assert!(given.for_prompt(100, true).unwrap().is_some());
    }

    #[test]
    fn h2o_by_itself_leaves_chunks_that_do_not_hold_its_memory_to_full_attention() {
        #[derive(Parser)]
        struct Both {
            #[command(flatten)]
            engine: EngineFlags,
            #[command(flatten)]
            h2o: H2oFlags,
        }
        let fit = |args: &[&str], n_ctx: u32| {
            let both = Both::try_parse_from(std::iter::once("app").chain(args.iter().copied()))
                .expect("flags parse");
            let h2o = both.h2o.choice().unwrap().h2o().unwrap();
            AutoFit::of(h2o, &both.engine, n_ctx)
        };
        let automatic = H2oConfig::automatic();
        assert_eq!(fit(&[], 0), AutoFit::Fits(automatic));
        assert_eq!(fit(&[], 0).outcome(), "on");
        assert_eq!(fit(&["--ubatch-size", "513"], 0), AutoFit::Fits(automatic));
        // llama.cpp's default -ub, and smaller ones
        for ub in [512, 256, 32] {
            let small = fit(&["--ubatch-size", &ub.to_string()], 0);
            assert_eq!(small, AutoFit::FullAttention { chunk: ub });
            assert_eq!((small.h2o(), small.outcome()), (None, "full_attention"));
            assert!(
                small.note().contains(&format!("-ub {ub} ")),
                "{}",
                small.note()
            );
            assert!(small.note().contains("-ub 513 or more"), "{}", small.note());
        }
        // -b caps a left-out -ub, and -c caps the chunk
        assert_eq!(
            fit(&["--batch-size", "32"], 4096),
            AutoFit::FullAttention { chunk: 32 }
        );
        assert_eq!(
            fit(&["--ubatch-size", "2048"], 500),
            AutoFit::FullAttention { chunk: 500 }
        );
    }

    #[test]
    fn on_and_off_do_not_ask_the_prompt() {
        assert_eq!(parse(&["--h2o", "off"]).choice().unwrap(), H2oChoice::Off);
        assert_eq!(
            parse(&["--h2o", "on"]).choice().unwrap(),
            H2oChoice::On(H2oConfig::automatic())
        );
        assert_eq!(
            run_config(&parse(&["--h2o-local", "0", "--h2o-heavy", "0"]), 1 << 20).unwrap(),
            None
        );
        let err = parse(&["--h2o", "off", "--h2o-local", "8"])
            .choice()
            .unwrap_err();
        assert!(err.to_string().contains("--h2o off"), "{err}");
        let err = parse(&["--h2o", "on", "--h2o-local", "0", "--h2o-heavy", "0"])
            .choice()
            .unwrap_err();
        assert!(err.to_string().contains("--h2o on"), "{err}");
    }

    #[test]
    fn flags_left_out_are_the_library_defaults() {
        let h2o = run_config(&parse(&["--h2o-local", "256", "--h2o-heavy", "256"]), 1)
            .unwrap()
            .unwrap();
        assert_eq!(h2o, H2oConfig::new(256, 256));
    }

    #[test]
    fn a_negative_count_names_its_flag() {
        let err = parse(&["--h2o-local", "-5", "--h2o-heavy", "256"])
            .choice()
            .unwrap_err();
        assert!(err.to_string().contains("--h2o-local"), "{err}");
        let err = parse(&["--h2o-heavy", "-1"]).choice().unwrap_err();
        assert!(err.to_string().contains("--h2o-heavy"), "{err}");
    }

    #[test]
    fn sparse_decode_without_h2o_is_refused() {
        for args in [
            &["--h2o", "off", "--h2o-decode", "sparse"][..],
            &[
                "--h2o-local",
                "0",
                "--h2o-heavy",
                "0",
                "--h2o-decode",
                "sparse",
            ],
        ] {
            let err = parse(args).choice().unwrap_err();
            assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
        }
    }

    #[test]
    fn the_budget_counts_only_with_sparse_decode() {
        let full = parse(&[
            "--h2o-local",
            "8",
            "--h2o-heavy",
            "8",
            "--h2o-decode-budget",
            "64",
        ]);
        assert_eq!(run_config(&full, 1).unwrap().unwrap().decode_budget, 0);
        let sparse = parse(&[
            "--h2o-local",
            "8",
            "--h2o-heavy",
            "8",
            "--h2o-decode",
            "sparse",
            "--h2o-decode-budget",
            "64",
        ]);
        assert_eq!(run_config(&sparse, 1).unwrap().unwrap().decode_budget, 64);
    }

    #[test]
    fn left_out_counts_are_0_beside_a_given_one_and_256_for_a_comparison() {
        let flags = parse(&["--h2o-local", "32", "--h2o-sink", "8"]);
        let run = run_config(&flags, 1).unwrap().unwrap();
        assert_eq!((run.local, run.heavy, run.sink), (32, 0, 8));
        let compared = parse(&[]).compared().unwrap();
        assert_eq!(compared, H2oConfig::new(256, 256));
        let compared = flags.compared().unwrap();
        assert_eq!(
            (compared.local, compared.heavy, compared.sink),
            (32, 256, 8)
        );
        let err = parse(&["--h2o-heavy", "-3"]).compared().unwrap_err();
        assert!(err.to_string().contains("--h2o-heavy"), "{err}");
        let err = parse(&["--h2o", "off"]).compared().unwrap_err();
        assert!(err.to_string().contains("leave out --h2o"), "{err}");
    }

    #[test]
    fn args_give_the_same_memory_and_policy_to_another_process() {
        let flags = parse(&[
            "--h2o-sink",
            "8",
            "--h2o-select",
            "hybrid",
            "--h2o-dense-tail",
            "9",
        ]);
        let h2o = flags.compared().unwrap();
        let again = Cli::try_parse_from(std::iter::once("app".to_string()).chain(flags.args(&h2o)))
            .expect("args parse")
            .h2o;
        assert_eq!(run_config(&again, 1).unwrap(), Some(h2o));
    }

    #[test]
    fn args_give_the_same_policy_to_another_process() {
        let flags = parse(&[
            "--h2o-select",
            "coverage",
            "--h2o-coverage",
            "0.9",
            "--h2o-tile-samples",
            "32",
            "--h2o-tile-sketch",
            "2",
            "--h2o-decode",
            "sparse",
            "--h2o-decode-budget",
            "128",
        ]);
        let mut again: Vec<String> = vec!["--h2o-local".into(), "16".into()];
        again.extend(["--h2o-heavy".into(), "16".into()]);
        again.extend(flags.policy.args());
        let again = Cli::try_parse_from(std::iter::once("app".to_string()).chain(again))
            .expect("args parse")
            .h2o;
        assert_eq!(flags.policy.config(16, 16), again.policy.config(16, 16));
    }
}
