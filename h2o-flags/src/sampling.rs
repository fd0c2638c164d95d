//! The sampling flags of a run (h2o-cli) and the server's request defaults (h2o-server),
//! spelled as llama.cpp spells them, each declared once with one type; a front end keeps its
//! own default only for `-n`, where llama-cli's and llama-server's differ in use (a run of a
//! few tokens, a server that generates until the answer ends).

use clap::Args;
use h2o_llama::Error;

/// `--temp --top-k --top-p -s -n -v`.
#[derive(Args, Debug, Clone, Copy, PartialEq)]
pub struct SamplingFlags {
    /// Sampling temperature; 0 = greedy (h2o-server: for requests that give none)
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k sampling, 0 = off (h2o-server: for requests that give none)
    #[arg(long = "top-k", value_name = "N", default_value_t = 40)]
    pub top_k: i32,
    /// Top-p sampling, 1 = off (h2o-server: for requests that give none)
    #[arg(long = "top-p", value_name = "P", default_value_t = 0.95)]
    pub top_p: f32,
    /// Random seed, -1 = a random one (h2o-server: for each request that gives none)
    #[arg(
        short = 's',
        long,
        value_name = "N",
        default_value_t = -1,
        allow_negative_numbers = true
    )]
    pub seed: i64,
    /// Tokens to generate, -1 = until the end of generation or a full context (h2o-server:
    /// the most a request generates; one asking for more gets this many) [default: 64 in
    /// h2o-cli, -1 in h2o-server]
    #[arg(
        short = 'n',
        long = "n-predict",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub n_predict: Option<i64>,
    /// Echo llama.cpp's own log to stderr (h2o-server: also add llama-server's `__verbose`, the
    /// `/completion` answer with the prompt's text, to whole OpenAI answers)
    #[arg(short = 'v', long)]
    pub verbose: bool,
}

impl SamplingFlags {
    /// `-s`: `None` for a random seed (-1), or an [`Error::InvalidConfig`] naming the flag.
    pub fn seed(&self) -> Result<Option<u32>, Error> {
        match self.seed {
            -1 => Ok(None),
            s => u32::try_from(s).map(Some).map_err(|_| {
                Error::InvalidConfig(format!(
                    "--seed must be between 0 and {} (or -1: a random one), got {s}",
                    u32::MAX
                ))
            }),
        }
    }

    /// `-n`, or the front end's `default` where left out: `None` for -1 (until the end of
    /// generation or a full context), or an [`Error::InvalidConfig`] naming the flag.
    pub fn n_predict(&self, default: i64) -> Result<Option<u64>, Error> {
        match self.n_predict.unwrap_or(default) {
            -1 => Ok(None),
            n => u64::try_from(n).map(Some).map_err(|_| {
                Error::InvalidConfig(format!(
                    "--n-predict must be at least 0 (or -1: until the end of generation), got {n}"
                ))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sampling: SamplingFlags,
    }

    fn parse(args: &[&str]) -> SamplingFlags {
        Cli::try_parse_from(std::iter::once("app").chain(args.iter().copied()))
            .expect("flags parse")
            .sampling
    }

    #[test]
    fn llama_cpps_spellings_and_defaults() {
        let d = parse(&[]);
        assert_eq!((d.temp, d.top_k, d.top_p, d.seed), (0.8, 40, 0.95, -1));
        assert_eq!(
            (d.seed().unwrap(), d.n_predict(64).unwrap()),
            (None, Some(64))
        );
        assert_eq!(d.n_predict(-1).unwrap(), None);
        let s = parse(&["-s", "42", "-n", "-1", "--top-k", "0", "--temp", "0", "-v"]);
        assert_eq!(
            (s.seed().unwrap(), s.n_predict(64).unwrap()),
            (Some(42), None)
        );
        assert_eq!((s.temp, s.top_k, s.verbose), (0.0, 0, true));
        let s = parse(&["--seed", "4294967295", "--n-predict", "7"]);
        assert_eq!(
            (s.seed().unwrap(), s.n_predict(-1).unwrap()),
            (Some(u32::MAX), Some(7))
        );
    }

    #[test]
    fn out_of_range_values_name_their_flag() {
        let e = parse(&["-s", "-2"]).seed().unwrap_err().to_string();
        assert!(e.contains("--seed"), "{e}");
        let e = parse(&["-s", "4294967296"]).seed().unwrap_err().to_string();
        assert!(e.contains("--seed"), "{e}");
        let e = parse(&["-n", "-5"]).n_predict(64).unwrap_err().to_string();
        assert!(e.contains("--n-predict"), "{e}");
    }
}
