//! `h2o-cli bench`: prefill throughput of H2O against stock llama.cpp.
//!
//! Every measurement is a fresh process (this binary for H2O, `--stock-cli` for stock), so that
//! each starts from the same cold state and its peak memory is its own. Engines alternate for
//! every repetition and prompt length, so that a machine that slows down during the run slows
//! both alike; medians absorb the rest of the noise.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use h2o_llama::{default_model, H2oConfig};

/// `-b` unless given: the design's `-b 4096 -ub 1024`.
const DEFAULT_BATCH: u32 = 4096;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Prompt lengths in tokens, comma-separated
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_name = "N,..",
        value_delimiter = ',',
        default_values_t = [1024u32, 2048, 4096, 8192, 16384]
    )]
    n_prompt: Vec<u32>,
    /// Repetitions per prompt length and engine
    #[arg(short = 'r', long, default_value_t = 3)]
    repetitions: u32,
    /// Model file (GGUF) [default: the default model]
    #[arg(short = 'm', long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// CPU threads
    #[arg(short = 't', long, default_value_t = 2)]
    threads: u32,
    /// Layers to offload to the GPU (-ngl), with a CUDA build; passed to both engines
    #[arg(long = "n-gpu-layers", value_name = "N", default_value_t = 0)]
    n_gpu_layers: i32,
    /// Logical batch (-b) [default: 4096, as in the design's command, or the prompt length if
    /// shorter; never below -ub]. H2O runs a logical batch as one graph, so its compute buffers
    /// grow with -b; -b equal to -ub keeps its peak memory at stock's
    #[arg(short = 'b', long = "batch-size", value_name = "N")]
    batch_size: Option<u32>,
    #[command(flatten)]
    shape: crate::H2oShape,
    /// The stock (unpatched) build's h2o-cli to compare against; build it with
    /// `cargo build --release --features stock --target-dir target/stock`. Without it the
    /// baseline is full attention in this build, and is labelled so.
    #[arg(long, value_name = "PATH")]
    stock_cli: Option<PathBuf>,
    /// Print one JSON document instead of the markdown table
    #[arg(long)]
    json: bool,
    /// Also draw prefill tok/s against N for both engines into this PNG file
    #[arg(long, value_name = "FILE")]
    png: Option<PathBuf>,
}

/// One engine at one prompt length: every repetition's figures.
#[derive(Debug, Default, serde::Serialize)]
struct Series {
    tokens_per_second: Vec<f64>,
    prefill_ms: Vec<f64>,
    peak_rss_bytes: Vec<u64>,
    h2o_state_bytes: u64,
    kv_cache_bytes: u64,
}

#[derive(Debug, serde::Serialize)]
struct Row {
    n_prompt: u32,
    n_batch: u32,
    baseline: Series,
    h2o: Series,
    /// median H2O tok/s over median baseline tok/s
    speedup: f64,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    model: String,
    baseline: String,
    /// "stock" or "full attention", for column headers
    baseline_short: &'static str,
    threads: u32,
    n_gpu_layers: i32,
    n_ubatch: u32,
    h2o_local: u32,
    h2o_heavy: u32,
    h2o: H2oConfig,
    repetitions: u32,
    rows: Vec<Row>,
}

pub fn run(args: &BenchArgs, interrupt: &AtomicBool) -> Result<()> {
    if args.repetitions == 0 || args.n_prompt.is_empty() {
        bail!("nothing to measure: give at least one --n-prompt and -r 1 or more");
    }
    if let Some(&n) = args.n_prompt.iter().find(|&&n| n < 2) {
        bail!("--n-prompt {n}: a prompt needs at least 2 tokens");
    }
    if let Some(png) = &args.png {
        crate::chart::check_writable(png)?;
    }
    if let Some(stock) = &args.stock_cli {
        if !stock.is_file() {
            bail!(
                "--stock-cli {}: no such file; build it with \
                 `cargo build --release --features stock --target-dir target/stock`",
                stock.display()
            );
        }
    }
    let this = std::env::current_exe().context("cannot locate this h2o-cli")?;
    let show_progress = !args.json && std::io::stderr().is_terminal();
    let model = match &args.model {
        Some(p) => p.clone(),
        None => default_model::ensure_interruptible(
            |msg| {
                if !args.json {
                    eprintln!("h2o-cli bench: {msg}");
                }
            },
            interrupt,
        )?,
    };
    let baseline = match &args.stock_cli {
        Some(p) => format!("stock ({})", p.display()),
        None => "full attention, this build (not stock: pass --stock-cli)".to_string(),
    };

    let total = args.n_prompt.len() * args.repetitions as usize * 2;
    let mut done = 0;
    let mut rows = Vec::new();
    for &n in &args.n_prompt {
        let n_batch = args
            .batch_size
            .unwrap_or(n.min(DEFAULT_BATCH))
            .max(args.shape.ubatch_size);
        let mut base = Series::default();
        let mut h2o = Series::default();
        for rep in 1..=args.repetitions {
            for engine in [Engine::Baseline, Engine::H2o] {
                if interrupt.load(Ordering::Relaxed) {
                    return Err(h2o_llama::Error::Interrupted.into());
                }
                if show_progress {
                    eprint!(
                        "\r\x1b[Kbench: run {}/{total}: N = {n}, {}, repetition {rep}/{}",
                        done + 1,
                        engine.label(),
                        args.repetitions
                    );
                }
                let exe = match engine {
                    Engine::Baseline => args.stock_cli.as_deref().unwrap_or(&this),
                    Engine::H2o => &this,
                };
                let record = measure(exe, &model, args, n, n_batch, engine)?;
                let series = match engine {
                    Engine::Baseline => &mut base,
                    Engine::H2o => &mut h2o,
                };
                series.add(&record, n)?;
                done += 1;
            }
        }
        let speedup = median(&h2o.tokens_per_second) / median(&base.tokens_per_second);
        rows.push(Row {
            n_prompt: n,
            n_batch,
            baseline: base,
            h2o,
            speedup,
        });
    }
    if show_progress {
        eprint!("\r\x1b[K");
    }
    let report = Report {
        model: model.display().to_string(),
        baseline,
        baseline_short: if args.stock_cli.is_some() {
            "stock"
        } else {
            "full attention"
        },
        threads: args.threads,
        n_gpu_layers: args.n_gpu_layers,
        n_ubatch: args.shape.ubatch_size,
        h2o_local: args.shape.h2o_local,
        h2o_heavy: args.shape.h2o_heavy,
        h2o: args.shape.config(),
        repetitions: args.repetitions,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", markdown(&report));
    }
    if let Some(png) = &args.png {
        draw(png, &report)?;
        if !args.json {
            eprintln!("h2o-cli bench: chart written to {}", png.display());
        }
    }
    Ok(())
}

fn draw(png: &Path, r: &Report) -> Result<()> {
    let points: Vec<crate::chart::ThroughputPoint> = r
        .rows
        .iter()
        .map(|row| crate::chart::ThroughputPoint {
            n_prompt: row.n_prompt,
            baseline: spread(&row.baseline.tokens_per_second),
            h2o: spread(&row.h2o.tokens_per_second),
        })
        .collect();
    let model = Path::new(&r.model)
        .file_stem()
        .map_or_else(|| r.model.clone(), |f| f.to_string_lossy().into_owned());
    let title = format!(
        "prefill: {model}, -t {} -ub {}, L={} H={} {}, {} runs (median, min–max)",
        r.threads, r.n_ubatch, r.h2o_local, r.h2o_heavy, r.h2o.select, r.repetitions
    );
    crate::chart::throughput(png, &title, r.baseline_short, &points)
}

#[derive(Clone, Copy, PartialEq)]
enum Engine {
    Baseline,
    H2o,
}

impl Engine {
    fn label(self) -> &'static str {
        match self {
            Engine::Baseline => "baseline",
            Engine::H2o => "H2O",
        }
    }
}

impl Series {
    fn add(&mut self, r: &serde_json::Value, n: u32) -> Result<()> {
        let field = |k: &str| {
            r[k].as_f64()
                .with_context(|| format!("the measured run's JSON lacks {k}"))
        };
        if field("prompt_tokens")? as u32 != n {
            bail!(
                "the measured run prefilled {} tokens, not {n}",
                r["prompt_tokens"]
            );
        }
        self.tokens_per_second
            .push(field("prefill_tokens_per_second")?);
        self.prefill_ms.push(field("prefill_ms")?);
        if let Some(b) = r["peak_rss_bytes"].as_u64() {
            self.peak_rss_bytes.push(b);
        }
        self.h2o_state_bytes = r["h2o_state_bytes"].as_u64().unwrap_or(0);
        self.kv_cache_bytes = r["kv_cache_bytes"].as_u64().unwrap_or(0);
        Ok(())
    }
}

/// Runs one prefill of `n` tokens in a fresh process and returns its JSON record.
fn measure(
    exe: &Path,
    model: &Path,
    args: &BenchArgs,
    n: u32,
    n_batch: u32,
    engine: Engine,
) -> Result<serde_json::Value> {
    let mut cmd = Command::new(exe);
    cmd.arg("-m")
        .arg(model)
        .args(["--synthetic-prompt", &n.to_string()])
        .args(["-c", &n.max(n_batch).to_string()])
        .args(["-b", &n_batch.to_string()])
        .args(["--ubatch-size", &args.shape.ubatch_size.to_string()])
        .args(["-t", &args.threads.to_string()])
        .args(["--n-gpu-layers", &args.n_gpu_layers.to_string()])
        .args(["-n", "0", "--temp", "0", "--json"]);
    if engine == Engine::H2o {
        cmd.args(["--h2o-local", &args.shape.h2o_local.to_string()])
            .args(["--h2o-heavy", &args.shape.h2o_heavy.to_string()])
            .args(args.shape.policy.args());
    }
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {}", exe.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        bail!(
            "{} run of {n} tokens failed ({}): {}",
            engine.label(),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{} printed no JSON record", exe.display()))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Median and range of one engine's repetitions.
fn spread(v: &[f64]) -> crate::chart::Spread {
    crate::chart::Spread {
        median: median(v),
        min: v.iter().copied().fold(f64::INFINITY, f64::min),
        max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    }
}

fn summary(v: &[f64]) -> String {
    let s = spread(v);
    format!("{:.1} ({:.1}–{:.1})", s.median, s.min, s.max)
}

fn peak(v: &[u64]) -> String {
    if v.is_empty() {
        return "–".into();
    }
    let f: Vec<f64> = v.iter().map(|&b| mib(b)).collect();
    format!("{:.0}", median(&f))
}

fn markdown(r: &Report) -> String {
    let mut s = format!(
        "model: {} | baseline: {} | -t {} -ngl {} -ub {} | H2O L = {} H = {} | {} repetitions, \
         tok/s as median (min–max)\n\n",
        r.model,
        r.baseline,
        r.threads,
        r.n_gpu_layers,
        r.n_ubatch,
        r.h2o_local,
        r.h2o_heavy,
        r.repetitions
    );
    let b = r.baseline_short;
    s.push_str(&format!(
        "| N | -b | {b} tok/s | H2O tok/s | H2O / {b} | {b} peak MiB | H2O peak MiB \
         | H2O state MiB | K+V cache MiB |\n|---:|---:|---|---|---:|---:|---:|---:|---:|\n"
    ));
    for row in &r.rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.2}× | {} | {} | {:.2} | {:.1} |\n",
            row.n_prompt,
            row.n_batch,
            summary(&row.baseline.tokens_per_second),
            summary(&row.h2o.tokens_per_second),
            row.speedup,
            peak(&row.baseline.peak_rss_bytes),
            peak(&row.h2o.peak_rss_bytes),
            mib(row.h2o.h2o_state_bytes),
            mib(row.h2o.kv_cache_bytes),
        ));
    }
    s
}
