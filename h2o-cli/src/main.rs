//! `h2o-cli`: run a prompt through llama.cpp with (optionally) H2O sparse prefill.
//! A thin shell over the `h2o_llama` library: parse flags, load, generate, report.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use h2o_flags::{
    llama_spellings, AutoDecision, AutoFit, EngineFlags, H2oChoice, H2oFlags, SamplingFlags,
};
use h2o_llama::{
    default_model, demo, models, Error, ErrorKind, Generation, H2oConfig, H2oState, Integrity,
    Model, PromptCache, Sampler, SamplerConfig, Session, SessionConfig,
};

mod bench;
mod coverage;
mod eval;
#[cfg(test)]
mod fuzz;
mod heavy_hitters;
mod perplexity;

/// Exit codes (documented in docs/cli.md): distinct per failure class.
mod exit {
    #[allow(dead_code)] // clap exits with it itself; listed so the table is complete
    pub const USAGE: u8 = 2;
    pub const INPUT: u8 = 3; // bad prompt/config values
    pub const MODEL: u8 = 4; // model missing, unreadable, not GGUF, rejected; default-model fetch
    pub const RUNTIME: u8 = 5; // llama.cpp failed while running
    pub const INTERRUPTED: u8 = 130; // Ctrl-C
}

const EXAMPLES: &str = "\
Examples:
  h2o-cli -n 32                                   # default model, built-in demo prompt
  h2o-cli -p \"The capital of France is\" -n 16 --temp 0
  h2o-cli -f prompt.txt -c 8192 -b 4096 -ub 1024
  h2o-cli -b 4096 -ub 1024 --h2o-local 256 --h2o-heavy 256
  h2o-cli -m model.gguf -p \"Hello\" --json
  h2o-cli bench --stock-cli target/stock/release/h2o-cli   # prefill speed vs stock

Exit codes: 0 ok, 2 bad flags, 3 bad input or parameters, 4 model problem,
5 llama.cpp failure, 130 interrupted.";

/// Run a prompt with llama.cpp, optionally with H2O chunked sparse prefill.
#[derive(Parser, Debug)]
#[command(
    name = "h2o-cli",
    version,
    about,
    after_help = EXAMPLES,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(flatten)]
    engine: EngineFlags,
    /// Prompt text [default: a built-in demo prompt spanning several chunks]
    #[arg(short = 'p', long, conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the prompt from a UTF-8 text file
    #[arg(short = 'f', long, value_name = "FILE")]
    file: Option<PathBuf>,
    #[command(flatten)]
    sampling: SamplingFlags,
    #[command(flatten)]
    h2o: H2oFlags,
    /// Print one JSON record on stdout instead of text + summary
    #[arg(long)]
    json: bool,
    /// Write the next-token logits after the prompt to FILE (n_vocab little-endian f32), e.g.
    /// to diff this build against a stock one
    #[arg(long, value_name = "FILE")]
    logits_out: Option<PathBuf>,
    /// llama-cli's prompt cache: when FILE holds a saved state whose tokens begin the prompt,
    /// load it and evaluate only the rest; save the state to FILE after the prompt. Refused
    /// when FILE was saved with another model or other H2O settings
    #[arg(long, value_name = "FILE")]
    prompt_cache: Option<PathBuf>,
    /// Use exactly N tokens of the demo ledger as the prompt (for benchmarks)
    #[arg(long, value_name = "N", conflicts_with_all = ["prompt", "file"], hide = true)]
    synthetic_prompt: Option<usize>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Prefill throughput of H2O against stock llama.cpp, interleaved in one run
    Bench(bench::BenchArgs),
    /// Perplexity of H2O and of full attention on a text, and the KL divergence between them
    Perplexity(perplexity::PerplexityArgs),
    /// Which tokens H2O keeps as heavy hitters, per layer and head, and how stable the choice is
    HeavyHitters(heavy_hitters::HeavyHittersArgs),
    /// Long-context tasks (needles, multi-key, variable tracking, key-value lookup) answered by
    /// full attention and each H2O policy on the same prompts
    Eval(eval::EvalArgs),
    /// How much of each query's attention each way of choosing the memory covers (oracles,
    /// today's policies, estimators, budgets that follow coverage), on a text's real attention
    Coverage(coverage::CoverageArgs),
}

#[derive(serde::Serialize)]
struct AutoRecord<'a> {
    outcome: &'static str,
    note: &'a str,
}

#[derive(serde::Serialize)]
struct Record<'a> {
    model: String,
    prompt_tokens: usize,
    generated_tokens: usize,
    chunks: usize,
    /// chunks of this prompt whose queries attended to a memory set, as llama.cpp counted them
    /// (0 with full attention)
    sparse_chunks: u32,
    /// prompt tokens that attended to the whole prompt (the dense tail), as llama.cpp counted them
    dense_tail_tokens: u32,
    /// bytes of the H2O state (scores, memory sets, chunk sums), 0 with full attention
    h2o_state_bytes: u64,
    n_batch: u32,
    n_ubatch: u32,
    n_ctx: u32,
    h2o: Option<H2oConfig>,
    /// with `--h2o auto`, what H2O came to (`on` or `full_attention`) and why
    #[serde(skip_serializing_if = "Option::is_none")]
    h2o_auto: Option<AutoRecord<'a>>,
    time_to_first_token_ms: f64,
    prefill_ms: f64,
    prefill_tokens_per_second: f64,
    decode_tokens_per_second: f64,
    /// keys each generated token's attention read, per head, on average over the decode steps
    /// (all cached positions with full-attention decode; fewer with --h2o-decode sparse)
    decode_keys_per_step: f64,
    stopped_at_eog: bool,
    /// the process's peak resident memory (Linux), for benchmarks
    peak_rss_bytes: Option<u64>,
    /// bytes of the K+V cache this context holds (of the -ctk / -ctv types)
    kv_cache_bytes: u64,
    /// prompt tokens loaded from --prompt-cache instead of evaluated (not in prompt_tokens)
    cached_prompt_tokens: usize,
    text: &'a str,
}

/// The llama.cpp multi-letter flags h2o-cli takes (clap cannot declare them).
const LLAMA_FLAGS: &[&str] = &["-ub", "-fa", "-ngl", "-ctk", "-ctv", "-hf"];

fn main() -> ExitCode {
    let cli = Cli::parse_from(llama_spellings::expand(std::env::args(), LLAMA_FLAGS));
    let interrupt = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupt.clone();
        let _ = ctrlc::set_handler(move || {
            if flag.swap(true, Ordering::SeqCst) {
                // Second Ctrl-C: the user really wants out.
                std::process::exit(i32::from(exit::INTERRUPTED));
            }
        });
    }
    let result = match &cli.command {
        Some(Command::Bench(args)) => bench::run(args, &interrupt),
        Some(Command::Perplexity(args)) => perplexity::run(args, interrupt.clone()),
        Some(Command::HeavyHitters(args)) => heavy_hitters::run(args, interrupt.clone()),
        Some(Command::Eval(args)) => eval::run(args, interrupt.clone()),
        Some(Command::Coverage(args)) => coverage::run(args, interrupt.clone()),
        None => run(&cli, interrupt.clone()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A terminal's Ctrl-C also reaches our children (pip fetching the default model): when
        // they fail after it, the interrupt is the cause, and the user should be told so.
        Err(e) if interrupt.load(Ordering::SeqCst) => {
            match e.downcast_ref::<Error>() {
                Some(Error::Interrupted) => eprintln!("h2o-cli: interrupted by Ctrl-C"),
                _ => eprintln!("h2o-cli: interrupted by Ctrl-C: {e:#}"),
            }
            ExitCode::from(exit::INTERRUPTED)
        }
        Err(e) => {
            eprintln!("h2o-cli: error: {e:#}");
            ExitCode::from(exit_code(&e))
        }
    }
}

fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<Error>().map(Error::kind) {
        Some(ErrorKind::Interrupted) => exit::INTERRUPTED,
        Some(ErrorKind::Model) => exit::MODEL,
        Some(ErrorKind::Runtime) => exit::RUNTIME,
        Some(ErrorKind::Input) | None => exit::INPUT,
    }
}

fn read_prompt(cli: &Cli) -> Result<(String, &'static str)> {
    if let Some(n) = cli.synthetic_prompt {
        // the tokens are made after the model loads; this is the description
        return Ok((format!("{n} tokens of the demo ledger"), "synthetic"));
    }
    if let Some(p) = &cli.prompt {
        return Ok((p.clone(), "-p"));
    }
    if let Some(f) = &cli.file {
        return Ok((read_text_file(f, "prompt file")?, "-f"));
    }
    Ok((demo::prompt(demo::DEFAULT_ENTRIES), "demo"))
}

fn run(cli: &Cli, interrupt: Arc<AtomicBool>) -> Result<()> {
    h2o_llama::set_log_echo(cli.sampling.verbose);
    // Fail on bad parameters before any download or model load
    session_config(cli, None)?.validate()?;
    sampler_config(cli)?;
    cli.sampling.n_predict(N_PREDICT)?;
    let (prompt_text, prompt_source) = read_prompt(cli)?;
    if prompt_text.trim().is_empty() {
        return Err(Error::EmptyPrompt.into());
    }

    let model = load_model(&cli.engine, cli.json, &interrupt)?;
    let prompt = match cli.synthetic_prompt {
        Some(n) => demo::prompt_tokens(&model, n)?,
        None => model.tokenize(&prompt_text, true, true)?,
    };
    if prompt.is_empty() {
        return Err(Error::EmptyPrompt.into());
    }
    let (config, auto) = plan(cli, Some(prompt.len()))?;
    let mut session = Session::new(&model, config)?;
    session.set_interrupt_flag(interrupt);
    let mut sampler = Sampler::new(&sampler_config(cli)?)?;
    if !cli.json {
        print_header(&model, &session, &prompt_text, prompt_source, prompt.len());
        if let Some(auto) = &auto {
            eprintln!("h2o-cli: {}", auto.note);
        }
    }
    let cached = match &cli.prompt_cache {
        Some(path) => use_prompt_cache(&mut session, path, &prompt, cli.json)?,
        None => 0,
    };
    let before = session.h2o_state();
    let generation = prefill_and_generate(cli, &mut session, &prompt[cached..], &mut sampler)?;
    report(
        cli,
        &model,
        &session,
        &generation,
        cached,
        before,
        auto.as_ref(),
    )
}

/// The session the flags give a prompt of `n_prompt` tokens; before the prompt is known
/// (`None`), the flags' own, without the H2O a long prompt would turn on by itself. Where H2O
/// turns on by itself, a flag it does not fit is an error naming `--h2o off`.
fn session_config(cli: &Cli, n_prompt: Option<usize>) -> Result<SessionConfig> {
    Ok(plan(cli, n_prompt)?.0)
}

/// [`session_config`], and with the prompt known and H2O left to decide, what it came to.
fn plan(cli: &Cli, n_prompt: Option<usize>) -> Result<(SessionConfig, Option<AutoDecision>)> {
    let choice = cli.h2o.choice()?;
    let gpu = cli.engine.layers_on_gpu();
    let n = match (choice, n_prompt) {
        (H2oChoice::Auto { .. }, None) => return Ok((cli.engine.session_config(None), None)),
        (_, None) => {
            let h2o = choice.h2o().map(|h2o| cli.h2o.on_backend(h2o, gpu));
            return Ok((cli.engine.session_config(h2o), None));
        }
        (H2oChoice::Auto { .. }, Some(n)) => n,
        (_, Some(n)) => {
            let h2o = cli.h2o.for_prompt(n, gpu)?;
            return Ok((cli.engine.session_config(h2o), None));
        }
    };
    let Some(h2o) = cli.h2o.for_prompt(n, gpu)? else {
        let decision = AutoDecision::full_attention(auto_note(None, n, gpu));
        return Ok((cli.engine.session_config(None), Some(decision)));
    };
    let fit = AutoFit::of(h2o, &cli.engine, cli.engine.ctx_size());
    if let (
        AutoFit::FullAttention { .. },
        H2oChoice::Auto {
            sparse_decode_asked: true,
            ..
        },
    ) = (fit, choice)
    {
        return Err(Error::InvalidConfig(format!(
            "--h2o-decode sparse and --h2o-decode-coverage need H2O on, and {}: add --h2o on \
             with --h2o-local/--h2o-heavy that fit the chunk (or use --h2o-decode full)",
            fit.note()
        ))
        .into());
    }
    let config = cli.engine.session_config(fit.h2o());
    if fit.h2o().is_some() {
        config.validate().map_err(|e| {
            H2oChoice::refused_by_itself(
                e,
                &format!(
                    "H2O turns on by itself for prompts of {} tokens or more (this one has {n})",
                    H2oConfig::AUTO_FROM_TOKENS
                ),
            )
        })?;
    }
    let decision = AutoDecision {
        outcome: fit.outcome(),
        note: auto_note(Some(fit), n, gpu),
    };
    Ok((config, Some(decision)))
}

/// Why a run left to decide (`--h2o auto`) uses H2O or not: `fit` is what H2O turned on by
/// itself came to on the flags' chunks (`None`: it did not turn on).
fn auto_note(fit: Option<AutoFit>, n_prompt: usize, layers_on_gpu: bool) -> String {
    let from = H2oConfig::AUTO_FROM_TOKENS;
    match fit {
        Some(AutoFit::Fits(_)) => format!(
            "H2O on by itself: the prompt has {n_prompt} tokens, {from} or more (--h2o off for \
             full attention)"
        ),
        Some(fit) => format!(
            "full attention: the prompt has {n_prompt} tokens, {from} or more, but {} (--h2o on \
             with --h2o-local/--h2o-heavy that fit the chunk to use it anyway)",
            fit.note()
        ),
        None if layers_on_gpu => format!(
            "full attention: {} (--h2o on to use it anyway)",
            H2oChoice::why_full_attention(n_prompt, true)
        ),
        None => format!(
            "full attention: the prompt has {n_prompt} tokens, H2O turns on by itself from {from} \
             (--h2o on to use it anyway)"
        ),
    }
}

/// Tokens a run generates where `-n` is left out.
const N_PREDICT: i64 = 64;

/// The sampler the flags give: a seed out of range is an error naming `--seed`.
fn sampler_config(cli: &Cli) -> Result<SamplerConfig> {
    let s = &cli.sampling;
    Ok(SamplerConfig {
        temperature: s.temp,
        top_k: s.top_k,
        top_p: s.top_p,
        seed: s.seed()?.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
        }),
        ..SamplerConfig::default()
    })
}

/// Tokens to generate after `n_prompt` more prompt tokens: `-n`, or with `-n -1` what the
/// context has left.
fn n_predict(cli: &Cli, session: &Session, n_prompt: usize) -> Result<usize> {
    Ok(match cli.sampling.n_predict(N_PREDICT)? {
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => (session.n_ctx() as usize).saturating_sub(session.n_past() as usize + n_prompt),
    })
}

/// What runs, on stderr: the model, the prompt, the flags in effect and the H2O state.
fn print_header(
    model: &Model,
    session: &Session,
    prompt_text: &str,
    prompt_source: &str,
    n_prompt: usize,
) {
    // -b and -ub as llama.cpp put them into effect (capped at -c)
    let config = session.config();
    eprintln!(
        "h2o-cli: {} | prompt: {} ({} tokens) | -c {} -b {} -ub {} | {}",
        model.description(),
        prompt_source,
        n_prompt,
        session.n_ctx(),
        config.n_batch,
        config.n_ubatch,
        match config.h2o {
            Some(h2o) => format!(
                "H2O L={} H={} {}, {}",
                h2o.local,
                h2o.heavy,
                h2o.policy_label(),
                match h2o.decode_budget {
                    0 => "full decode".to_string(),
                    n => format!("sparse decode of {n}"),
                }
            ),
            None => "full attention".into(),
        }
    );
    if let Some(st) = session.h2o_state() {
        eprintln!(
            "h2o-cli: H2O state: L={} H={} (memory M={}) chunk S={} | {} layers x {} heads x {} positions | {:.2} MiB",
            st.local,
            st.heavy,
            st.memory_size,
            st.chunk_size,
            st.n_layer,
            st.n_head,
            st.kv_size,
            st.size_bytes as f64 / (1024.0 * 1024.0)
        );
    }
    if prompt_source == "demo" {
        let lines: Vec<&str> = prompt_text.lines().collect();
        let tail = lines[lines.len().saturating_sub(2)..].join("\n");
        eprintln!("h2o-cli: demo prompt ends with:\n{tail}");
    }
}

/// Evaluates `rest` (the prompt less what a prompt cache held) and generates, printing the text
/// as it comes unless `--json`. With `--logits-out` or `--prompt-cache` the prefill runs on its
/// own, so that the logits and the state are saved before sampling.
fn prefill_and_generate(
    cli: &Cli,
    session: &mut Session,
    rest: &[h2o_llama::Token],
    sampler: &mut Sampler,
) -> Result<Generation> {
    let show_progress = !cli.json && std::io::stderr().is_terminal();
    let progress = |done: usize, total: usize| {
        if show_progress && done < total {
            eprint!("\r\x1b[Kprefill: {done}/{total} prompt tokens");
        } else if show_progress {
            eprint!("\r\x1b[K"); // prefill over: leave the line to the generated text
        }
    };
    let mut stdout = std::io::stdout().lock();
    let on_text = |piece: &str| {
        if !cli.json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
        true
    };
    let n_predict = n_predict(cli, session, rest.len())?;
    if cli.logits_out.is_none() && cli.prompt_cache.is_none() {
        return Ok(session.generate_with_progress(rest, sampler, n_predict, progress, on_text)?);
    }
    let start = std::time::Instant::now();
    match &cli.prompt_cache {
        // saved on the way, where a longer prompt can reuse it exactly
        Some(path) => {
            let held = session.n_past();
            let saved = session.evaluate_saving_prompt_cache(rest, path, progress)?;
            if !cli.json {
                let what = match saved {
                    Some(n) => format!("saved the first {n} tokens"),
                    None if held > 0 => {
                        "kept as it was (it holds what a longer prompt can reuse)".to_string()
                    }
                    None => "nothing saved: with H2O this prompt has no whole chunk before its \
                             dense tail, and no state inside it continues as a fresh run does"
                        .to_string(),
                };
                eprintln!("h2o-cli: prompt cache {}: {what}", path.display());
            }
        }
        None => session.evaluate_with_progress(rest, progress)?,
    }
    let prefill = start.elapsed();
    if let Some(path) = &cli.logits_out {
        let logits = session.logits().context("no logits after the prompt")?;
        let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(path, bytes)
            .with_context(|| format!("cannot write the logits to {}", path.display()))?;
    }
    let mut g = session.generate_with_progress(&[], sampler, n_predict, |_, _| {}, on_text)?;
    g.timings.prompt_tokens = rest.len();
    g.timings.prefill = prefill;
    g.timings.time_to_first_token += prefill;
    Ok(g)
}

/// The run's figures: one JSON record with `--json`, else two summary lines on stderr.
fn report(
    cli: &Cli,
    model: &Model,
    session: &Session,
    generation: &Generation,
    cached: usize,
    before: Option<H2oState>,
    auto: Option<&AutoDecision>,
) -> Result<()> {
    let config = session.config();
    let t = &generation.timings;
    let chunks = t.prompt_tokens.div_ceil(config.n_ubatch as usize);
    let h2o_state = session.h2o_state();
    // what llama.cpp counted during this prompt (a loaded prompt cache brings its own counts)
    let (sparse_chunks, dense_tail_tokens) =
        h2o_state.map_or((0, 0), |after| after.counts_since(before.as_ref()));
    let mut stdout = std::io::stdout().lock();
    if cli.json {
        let record = Record {
            model: model.path().display().to_string(),
            prompt_tokens: t.prompt_tokens,
            generated_tokens: t.generated_tokens,
            chunks,
            sparse_chunks,
            dense_tail_tokens,
            h2o_state_bytes: h2o_state.map_or(0, |s| s.size_bytes),
            n_batch: config.n_batch,
            n_ubatch: config.n_ubatch,
            n_ctx: session.n_ctx(),
            h2o: session.config().h2o,
            h2o_auto: auto.map(|a| AutoRecord {
                outcome: a.outcome,
                note: &a.note,
            }),
            time_to_first_token_ms: t.time_to_first_token.as_secs_f64() * 1e3,
            prefill_ms: t.prefill.as_secs_f64() * 1e3,
            prefill_tokens_per_second: t.prefill_tokens_per_second(),
            decode_tokens_per_second: t.decode_tokens_per_second(),
            decode_keys_per_step: session.decode_keys_per_step(cached + t.prompt_tokens),
            stopped_at_eog: generation.stopped_at_eog,
            peak_rss_bytes: peak_rss_bytes(),
            kv_cache_bytes: model.kv_cache_bytes(
                session.n_ctx(),
                config.cache_type_k,
                config.cache_type_v,
            ),
            cached_prompt_tokens: cached,
            text: &generation.text,
        };
        serde_json::to_writer(&mut stdout, &record)?;
        writeln!(stdout)?;
        return Ok(());
    }
    writeln!(stdout)?;
    let attention = match h2o_state {
        Some(st) => format!(
            "H2O: {sparse_chunks} of {chunks} chunks sparse, {dense_tail_tokens} dense-tail tokens, memory {} tokens (L={} H={}), state {:.2} MiB",
            st.memory_size,
            st.local,
            st.heavy,
            st.size_bytes as f64 / (1024.0 * 1024.0)
        ),
        None => "full attention".into(),
    };
    eprintln!("h2o-cli: {attention}");
    eprintln!(
        "h2o-cli: prompt tokens {} | chunks {} (-ub {}) | time to first token {:.2} s | prefill {:.1} tok/s | \
         decode {:.1} tok/s ({} tokens{}, {:.0} keys a step)",
        t.prompt_tokens,
        chunks,
        config.n_ubatch,
        t.time_to_first_token.as_secs_f64(),
        t.prefill_tokens_per_second(),
        t.decode_tokens_per_second(),
        t.generated_tokens,
        if generation.stopped_at_eog { ", stopped at end of generation" } else { "" },
        session.decode_keys_per_step(cached + t.prompt_tokens)
    );
    Ok(())
}

/// Loads `path` into the fresh `session` when its tokens begin `prompt`; returns how many prompt
/// tokens it holds (0 when it was not used) and says what happened on stderr.
fn use_prompt_cache(
    session: &mut Session,
    path: &std::path::Path,
    prompt: &[h2o_llama::Token],
    quiet: bool,
) -> Result<usize> {
    let outcome = session.load_prompt_cache(path, prompt)?;
    let (cached, what) = match outcome {
        PromptCache::Missing => (0, "none yet: evaluating the whole prompt".to_string()),
        PromptCache::Reused { tokens, integrity } => {
            if integrity == Integrity::Unverified {
                eprintln!(
                    "h2o-cli: warning: prompt cache {} has no checksum (saved before checked \
                     state files): it was loaded unchecked; saving it again adds one",
                    path.display()
                );
            }
            (
                tokens,
                format!(
                    "reusing {tokens} of {} prompt tokens, evaluating {}",
                    prompt.len(),
                    prompt.len() - tokens
                ),
            )
        }
        PromptCache::Unused { common, cached } if common == cached && cached > 0 => (
            0,
            format!("holds this whole prompt ({cached} tokens) but no logits: evaluating it again"),
        ),
        PromptCache::Unused { common, cached } => (
            0,
            format!(
                "its {cached} tokens do not begin this prompt (the first {common} agree): \
                 evaluating the whole prompt"
            ),
        ),
        PromptCache::EndsInTail { cached } => (
            0,
            format!(
                "its {cached} tokens begin this prompt, but with H2O a fresh run of this prompt \
                 attends to the last of them in its dense tail, which the cache ran sparse: \
                 evaluating the whole prompt"
            ),
        ),
        PromptCache::NotFresh { cached } => (
            0,
            format!(
                "its {cached} tokens begin this prompt, but its H2O state ran a dense tail or \
                 left a chunk open, so continuing it would differ from a fresh run: evaluating \
                 the whole prompt"
            ),
        ),
    };
    if !quiet {
        eprintln!("h2o-cli: prompt cache {}: {what}", path.display());
    }
    Ok(cached)
}

/// Peak resident set size of this process (`VmHWM`), where /proc has it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Reads a UTF-8 text file, naming `what` it is in errors.
fn read_text_file(f: &std::path::Path, what: &str) -> Result<String> {
    let bytes = std::fs::read(f).with_context(|| format!("cannot read {what} {}", f.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{what} {} is not UTF-8 text (invalid byte at offset {}); convert it first, e.g. iconv -t UTF-8",
            f.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// Loads `-m FILE` (or a known model's name: `-m gemma3-270m`), or the default model, with the
/// engine's `-ngl`; known models are fetched on first use (`quiet` hides the messages).
fn load_model(engine: &EngineFlags, quiet: bool, interrupt: &AtomicBool) -> Result<Model> {
    let log = |msg: &str| {
        if !quiet {
            eprintln!("h2o-cli: {msg}");
        }
    };
    let path = match &engine.model {
        Some(p) => models::resolve(p, log, interrupt)?,
        None => default_model::ensure_interruptible(log, interrupt)?,
    };
    Ok(Model::load(&path, &engine.model_params())?)
}
