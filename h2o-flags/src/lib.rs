//! The H2O flags that `h2o-cli` and `h2o-server` share: one clap definition, so that both front
//! ends take the same names, defaults and help, and turn them into the same [`H2oConfig`].
//!
//! ```
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     h2o: h2o_flags::H2oFlags,
//! }
//!
//! let cli = Cli::parse_from(["app", "--h2o-local", "256", "--h2o-heavy", "256"]);
//! let h2o = cli.h2o.config().unwrap().expect("H2O on");
//! assert_eq!((h2o.local, h2o.heavy), (256, 256));
//! assert!(Cli::parse_from(["app"]).h2o.config().unwrap().is_none());
//! ```

use clap::{Args, ValueEnum};
use h2o_llama::{Error, H2oConfig, Selection};

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
/// the memory's size. Defaults are the library's recommendation ([`H2oConfig::new`]).
#[derive(Args, Debug, Clone, Copy)]
pub struct H2oPolicy {
    /// H2O: how the heavy part of the memory is chosen: h2o (the seed rule: accumulated past
    /// attention), query (blocks by the chunk's own queries, key bounds), query-mean (same, mean
    /// keys), hybrid (half query, half accumulated attention), coverage (each tile of 64 queries
    /// its own memory from sampled queries; budgets shared by the heads where they cover most)
    #[arg(long = "h2o-select", value_name = "POLICY", default_value_t = H2oConfig::RECOMMENDED_SELECT)]
    pub select: Selection,
    /// H2O: the first N positions always stay in memory (out of the heavy budget)
    /// [default: 4, at most --h2o-heavy]
    #[arg(long = "h2o-sink", value_name = "N")]
    pub sink: Option<u32>,
    /// H2O: the last T tokens of a prompt attend to the whole prompt (a longer tail than the
    /// prompt covers all of it)
    #[arg(long = "h2o-dense-tail", value_name = "T", default_value_t = H2oConfig::RECOMMENDED_DENSE_TAIL)]
    pub dense_tail: u32,
    /// H2O coverage policy: a tile takes no more budget once its memory covers this share of
    /// its estimated attention, in (0, 1] (1: the whole budget -L + -H on average)
    #[arg(long = "h2o-coverage", value_name = "GAMMA", default_value_t = 1.0)]
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
    /// H2O decode: full (each generated token reads its whole cache) or sparse (the first block,
    /// the last --h2o-local positions and the --h2o-decode-budget positions its query points
    /// at, by logits estimated from a quarter of the key channels; the cache is kept whole)
    #[arg(long = "h2o-decode", value_name = "MODE", value_enum, default_value_t = DecodeMode::Full)]
    pub decode: DecodeMode,
    /// H2O sparse decode: positions a step chooses, besides the first block and the recent
    /// window (at most the context of a sequence)
    #[arg(long = "h2o-decode-budget", value_name = "N", default_value_t = H2oConfig::RECOMMENDED_DECODE_BUDGET)]
    pub decode_budget: u32,
    /// H2O sparse decode: of its budget, a step takes only the fewest positions whose estimated
    /// attention holds this share of all those between the sinks and the window, in (0, 1]
    /// (1: the whole budget; the budget is then a cap)
    #[arg(
        long = "h2o-decode-coverage",
        value_name = "GAMMA",
        default_value_t = 1.0
    )]
    pub decode_coverage: f32,
}

impl H2oPolicy {
    /// This policy with a memory of `local` recent and `heavy` chosen positions (not checked:
    /// sessions check it when they are created).
    pub fn config(&self, local: u32, heavy: u32) -> H2oConfig {
        let mut h2o = H2oConfig::new(local, heavy);
        h2o.select = self.select;
        h2o.sink = self.sink.unwrap_or(h2o.sink);
        h2o.dense_tail = self.dense_tail;
        h2o.coverage = self.coverage;
        h2o.tile_samples = self.tile_samples;
        h2o.tile_sketch = self.tile_sketch;
        h2o.decode_budget = match self.decode {
            DecodeMode::Sparse => self.decode_budget,
            DecodeMode::Full => 0,
        };
        h2o.decode_coverage = self.decode_coverage;
        h2o
    }

    /// The flags that give this policy to another process that takes them.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec!["--h2o-select".into(), self.select.to_string()];
        if let Some(sink) = self.sink {
            a.extend(["--h2o-sink".into(), sink.to_string()]);
        }
        a.extend(["--h2o-dense-tail".into(), self.dense_tail.to_string()]);
        a.extend(["--h2o-coverage".into(), self.coverage.to_string()]);
        a.extend(["--h2o-tile-samples".into(), self.tile_samples.to_string()]);
        a.extend(["--h2o-tile-sketch".into(), self.tile_sketch.to_string()]);
        a.extend(["--h2o-decode".into(), self.decode.as_str().into()]);
        a.extend(["--h2o-decode-budget".into(), self.decode_budget.to_string()]);
        a.extend([
            "--h2o-decode-coverage".into(),
            self.decode_coverage.to_string(),
        ]);
        a
    }
}

/// The memory's size (`--h2o-local`, `--h2o-heavy`; both 0 leave H2O off, the default) and its
/// [`H2oPolicy`].
#[derive(Args, Debug, Clone, Copy)]
pub struct H2oFlags {
    /// H2O: recent tokens L kept from the previous chunk (0 with --h2o-heavy 0 = off)
    // Taken as signed so that a negative value gets a message naming the flag, not clap's
    // "unexpected argument '-5'".
    #[arg(
        long,
        value_name = "L",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub h2o_local: i64,
    /// H2O: heavy-hitter tokens H kept by the selection policy (--h2o-select)
    #[arg(
        long,
        value_name = "H",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub h2o_heavy: i64,
    #[command(flatten)]
    pub policy: H2oPolicy,
}

impl H2oFlags {
    /// The H2O configuration the flags ask for, `None` when they leave H2O off. A count out of
    /// range, or sparse decode without H2O, is an [`Error::InvalidConfig`] naming the flag.
    pub fn config(&self) -> Result<Option<H2oConfig>, Error> {
        let count = |flag: &str, v: i64| {
            u32::try_from(v).map_err(|_| {
                Error::InvalidConfig(format!(
                    "{flag} must be between 0 and {}, got {v}",
                    u32::MAX
                ))
            })
        };
        let h2o = self.policy.config(
            count("--h2o-local", self.h2o_local)?,
            count("--h2o-heavy", self.h2o_heavy)?,
        );
        h2o.check_decode_needs_h2o()?;
        Ok(h2o.is_enabled().then_some(h2o))
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

    #[test]
    fn no_flags_leave_h2o_off() {
        assert!(parse(&[]).config().unwrap().is_none());
    }

    #[test]
    fn flags_left_out_are_the_library_defaults() {
        let h2o = parse(&["--h2o-local", "256", "--h2o-heavy", "256"])
            .config()
            .unwrap()
            .unwrap();
        assert_eq!(h2o, H2oConfig::new(256, 256));
    }

    #[test]
    fn a_negative_count_names_its_flag() {
        let err = parse(&["--h2o-local", "-5", "--h2o-heavy", "256"])
            .config()
            .unwrap_err();
        assert!(err.to_string().contains("--h2o-local"), "{err}");
        let err = parse(&["--h2o-heavy", "-1"]).config().unwrap_err();
        assert!(err.to_string().contains("--h2o-heavy"), "{err}");
    }

    #[test]
    fn sparse_decode_without_h2o_is_refused() {
        let err = parse(&["--h2o-decode", "sparse"]).config().unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
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
        assert_eq!(full.config().unwrap().unwrap().decode_budget, 0);
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
        assert_eq!(sparse.config().unwrap().unwrap().decode_budget, 64);
    }

    #[test]
    fn args_give_the_same_policy_to_another_process() {
        let flags = parse(&[
            "--h2o-select",
            "coverage",
            "--h2o-sink",
            "8",
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
