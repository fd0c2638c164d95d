//! Fuzzing of h2o-cli's command line: random argument lists, built from every flag of every
//! command with values valid and not (numbers out of range, negative, huge, empty, not numbers,
//! unknown policies and cache types, flags repeated or missing their value), go through the
//! parsing `main` does and the checks that run before a model loads and once the prompt's
//! length is known (`session_config`,
//! `SessionConfig::validate`, the sampler). Each must end in a parsed command line or a clear
//! error, never a panic.
//!
//! `cargo test` runs 2,000 cases and replays the kept ones in `tests/fuzz-corpus/` (one argument
//! a line); `scripts/fuzz.sh` runs many more (`H2O_FUZZ_CASES`, `H2O_FUZZ_SEED`).

use clap::Parser;
use h2o_llama::fuzzing::{kept_cases, Budget, Rng};

use super::{sampler_config, session_config, Cli, LLAMA_FLAGS};

const COMMANDS: &[&str] = &[
    "",
    "bench",
    "perplexity",
    "heavy-hitters",
    "eval",
    "coverage",
];

const FLAGS: &[&str] = &[
    "-m",
    "-p",
    "-f",
    "-n",
    "-c",
    "-b",
    "-ub",
    "--ubatch-size",
    "-t",
    "-fa",
    "--flash-attn",
    "-ctk",
    "-ctv",
    "--cache-type-k",
    "--cache-type-v",
    "-ngl",
    "--n-gpu-layers",
    "--temp",
    "--top-k",
    "--top-p",
    "--seed",
    "--h2o-local",
    "--h2o-heavy",
    "--h2o-select",
    "--h2o-sink",
    "--h2o-dense-tail",
    "--h2o-coverage",
    "--h2o-tile-samples",
    "--h2o-tile-sketch",
    "--h2o-decode",
    "--h2o-decode-budget",
    "--h2o-decode-coverage",
    "--json",
    "--logits-out",
    "--prompt-cache",
    "--synthetic-prompt",
    "-v",
    "-r",
    "--chunks",
    "--ablate",
    "--tasks",
    "--lengths",
    "--depths",
    "--policies",
    "--layers",
    "--png",
    "--stock-cli",
    "--speed",
    "--far-context",
    "--decode-tail",
    "--",
    "-",
    "--help-not",
    "-x",
];

const VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "64",
    "256",
    "1024",
    "4096",
    "4294967296",
    "99999999999999999999",
    "0.5",
    "1.5",
    "-0.5",
    "nan",
    "inf",
    "",
    " ",
    "abc",
    "on",
    "off",
    "auto",
    "f16",
    "q8_0",
    "q4_0",
    "bf16",
    "iq4_nl",
    "h2o",
    "hybrid",
    "coverage",
    "query",
    "full",
    "sparse",
    "256:256",
    "256:256:coverage",
    "1:2:3:4:5:6:7:8:9",
    "::",
    "4096,8192",
    "0,,1",
    "/nonexistent",
    "\u{0}",
    "日本",
    "-5,-6",
];

fn case(seed: u64) -> Vec<String> {
    let mut rng = Rng::new(seed);
    let mut args = vec!["h2o-cli".to_string()];
    let command = COMMANDS[rng.below(COMMANDS.len())];
    if !command.is_empty() {
        args.push(command.into());
    }
    for _ in 0..rng.below(8) {
        args.push(FLAGS[rng.below(FLAGS.len())].into());
        if rng.below(5) != 0 {
            args.push(VALUES[rng.below(VALUES.len())].into());
        }
    }
    args
}

/// Parses `args` as `main` does and, for a plain run, checks what `run` checks before loading a
/// model. Clap's own errors (and `--help`) are answers, not findings; a panic is.
fn exercise(args: &[String]) {
    let expanded = h2o_flags::llama_spellings::expand(args.iter().cloned(), LLAMA_FLAGS);
    let Ok(cli) = Cli::try_parse_from(expanded) else {
        return;
    };
    if cli.command.is_none() {
        // before the prompt is known, and for a prompt long enough for H2O to turn on by itself
        let long = h2o_llama::H2oConfig::AUTO_FROM_TOKENS as usize;
        for n_prompt in [None, Some(long)] {
            if let Ok(config) = session_config(&cli, n_prompt) {
                let _ = config.validate();
            }
        }
        if let Ok(config) = sampler_config(&cli) {
            let _ = h2o_llama::Sampler::new(&config);
        }
    }
}

#[test]
fn random_command_lines_parse_or_are_refused_never_panic() {
    let budget = Budget::from_env(2000);
    let mut all: Vec<Vec<String>> = (0..budget.cases)
        .map(|i| case(budget.case_seed(i)))
        .collect();
    // a kept case: one argument a line
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus");
    let kept = kept_cases(&corpus);
    all.extend(kept.iter().map(|bytes| {
        String::from_utf8_lossy(bytes)
            .lines()
            .map(String::from)
            .collect()
    }));
    let mut findings = Vec::new();
    for args in &all {
        if std::panic::catch_unwind(|| exercise(args)).is_err() {
            findings.push(args.join("\n"));
        }
    }
    budget.keep_findings("cli", findings.iter().map(|f| f.as_bytes()));
    eprintln!(
        "{} random command lines (seed {}) and {} kept ones: {} findings",
        budget.cases,
        budget.seed,
        kept.len(),
        findings.len()
    );
    assert!(findings.is_empty(), "panics on:\n{}", findings.join("\n\n"));
}

#[test]
fn the_flags_are_declared_without_clashes() {
    use clap::CommandFactory;
    Cli::command().debug_assert();
}
