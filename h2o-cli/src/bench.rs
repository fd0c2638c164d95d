//! `h2o-cli bench`: prefill throughput of H2O against stock llama.cpp.
//!
//! Every measurement is a fresh process (this binary for H2O, `--stock-cli` for stock), so that
//! each starts from the same cold state and its peak memory is its own. The schedule (engines
//! alternating), medians and the table are `h2o_research::bench`'s.

use std::cell::Cell;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use h2o_flags::{EngineFlag, EngineFlags, H2oFlags};
use h2o_llama::{default_model, models, H2oConfig};
use h2o_research::bench::{self, Engine, Measurement, Point, Report, Run};
use h2o_research::chart;

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
    /// The engine of both sides' runs; -b is capped at each prompt length, -c is each prompt
    /// length
    #[command(flatten)]
    engine: EngineFlags,
    #[command(flatten)]
    h2o: H2oFlags,
    /// The stock (unpatched) build's h2o-cli to compare against; build it with
    /// `cargo build --release -p h2o-cli --features stock --target-dir target/stock`. Without it the
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

pub fn run(args: &BenchArgs, interrupt: &AtomicBool) -> Result<()> {
    if args.repetitions == 0 || args.n_prompt.is_empty() {
        bail!("nothing to measure: give at least one --n-prompt and -r 1 or more");
    }
    if let Some(&n) = args.n_prompt.iter().find(|&&n| n < 2) {
        bail!("--n-prompt {n}: a prompt needs at least 2 tokens");
    }
    args.engine.refuse(
        "h2o-cli bench",
        &[EngineFlag::CtxSize],
        "each run's context is its prompt length",
    )?;
    let h2o = args.h2o.compared()?;
    if let Some(png) = &args.png {
        chart::check_writable(png).context("--png")?;
    }
    if let Some(stock) = &args.stock_cli {
        if !stock.is_file() {
            bail!(
                "--stock-cli {}: no such file; build it with \
                 `cargo build --release -p h2o-cli --features stock --target-dir target/stock`",
                stock.display()
            );
        }
    }
    let this = std::env::current_exe().context("cannot locate this h2o-cli")?;
    // progress goes to stderr with --json too (the record is on stdout): a line that redraws
    // itself on a terminal, a line per run in a log
    let redraw = std::io::stderr().is_terminal();
    let log = |msg: &str| {
        if !args.json {
            eprintln!("h2o-cli bench: {msg}");
        }
    };
    let model = match &args.engine.model {
        Some(p) => models::resolve(p, log, interrupt)?,
        None => default_model::ensure_interruptible(log, interrupt)?,
    };
    let baseline = match &args.stock_cli {
        Some(p) => format!("stock ({})", p.display()),
        None => "full attention, this build (not stock: pass --stock-cli)".to_string(),
    };

    let points: Vec<Point> = args
        .n_prompt
        .iter()
        .map(|&n| Point {
            n_prompt: n,
            n_batch: args
                .engine
                .batch_size
                .unwrap_or(n.min(args.engine.batch_size(true)))
                .max(args.engine.ubatch_size(true)),
        })
        .collect();
    // the sketch and the pool the H2O runs chose (a sketch left out is the model's, a pool left
    // out the backend's), so that the record names what ran, as the runs' own records do
    let chosen: Cell<Option<Chosen>> = Cell::new(None);
    let rows = bench::interleaved(&points, args.repetitions, |run| {
        if interrupt.load(Ordering::Relaxed) {
            return Err(h2o_llama::Error::Interrupted.into());
        }
        let progress = format!(
            "bench: run {}/{}: N = {}, {}, repetition {}/{}",
            run.index + 1,
            run.total,
            run.point.n_prompt,
            run.engine.label(),
            run.repetition,
            args.repetitions
        );
        if redraw {
            eprint!("\r\x1b[K{progress}");
        } else {
            eprintln!("h2o-cli {progress}");
        }
        let exe = match run.engine {
            Engine::Baseline => args.stock_cli.as_deref().unwrap_or(&this),
            Engine::H2o => &this,
        };
        let (measurement, resolved) = measure(exe, &model, args, &h2o, run)?;
        if run.engine == Engine::H2o {
            chosen.set(resolved);
        }
        Ok::<_, anyhow::Error>(measurement)
    })?;
    if redraw {
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
        threads: args.engine.threads(),
        n_gpu_layers: args.engine.n_gpu_layers,
        n_ubatch: args.engine.ubatch_size(true),
        cache_type_k: args.engine.cache_type_k.name(),
        cache_type_v: args.engine.cache_type_v.name(),
        h2o_local: h2o.local,
        h2o_heavy: h2o.heavy,
        h2o: H2oConfig {
            tile_sketch: chosen.get().map_or(h2o.tile_sketch, |c| c.tile_sketch),
            tile_pool: chosen.get().map_or(h2o.tile_pool, |c| c.tile_pool),
            ..h2o
        },
        repetitions: args.repetitions,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.markdown());
    }
    if let Some(png) = &args.png {
        report.draw(png)?;
        if !args.json {
            eprintln!("h2o-cli bench: chart written to {}", png.display());
        }
    }
    Ok(())
}

/// What a run's H2O configuration left to the model and the backend resolved to.
#[derive(Clone, Copy)]
struct Chosen {
    tile_sketch: u32,
    tile_pool: u32,
}

/// Runs one prefill in a fresh process (this binary or the stock one, with the same flags but
/// the `--h2o-*` ones) and reads the figures from its JSON record, and the coverage sketch and
/// pool its H2O configuration resolved to (`None` without H2O).
fn measure(
    exe: &Path,
    model: &Path,
    args: &BenchArgs,
    h2o: &H2oConfig,
    run: &Run,
) -> Result<(Measurement, Option<Chosen>)> {
    let Point {
        n_prompt: n,
        n_batch,
    } = run.point;
    let mut cmd = Command::new(exe);
    cmd.arg("-m")
        .arg(model)
        .args(["--synthetic-prompt", &n.to_string()])
        .args(["-c", &n.max(n_batch).to_string()])
        .args(["-b", &n_batch.to_string()])
        .args(["--ubatch-size", &args.engine.ubatch_size(true).to_string()])
        .args(["-t", &args.engine.threads().to_string()])
        .args(["--n-gpu-layers", &args.engine.n_gpu_layers.to_string()])
        .args(["--flash-attn", &args.engine.flash_attn.to_string()])
        .args(["--cache-type-k", args.engine.cache_type_k.name()])
        .args(["--cache-type-v", args.engine.cache_type_v.name()])
        .args(["-n", "0", "--temp", "0", "--json"]);
    if let Some(rpc) = &args.engine.rpc {
        cmd.args(["--rpc", &rpc.0.join(",")]);
    }
    if args.engine.no_repack {
        cmd.arg("--no-repack");
    }
    if run.engine == Engine::H2o {
        cmd.args(args.h2o.args(h2o));
    } else if args.stock_cli.is_none() {
        // this build's full attention: a long prompt would otherwise turn H2O on by itself
        cmd.args(["--h2o", "off"]);
    }
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {}", exe.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        bail!(
            "{} run of {n} tokens failed ({}): {}",
            run.engine.label(),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    let r: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{} printed no JSON record", exe.display()))?;
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
    let measurement = Measurement {
        tokens_per_second: field("prefill_tokens_per_second")?,
        prefill_ms: field("prefill_ms")?,
        peak_rss_bytes: r["peak_rss_bytes"].as_u64(),
        h2o_state_bytes: r["h2o_state_bytes"].as_u64().unwrap_or(0),
        kv_cache_bytes: r["kv_cache_bytes"].as_u64().unwrap_or(0),
    };
    let h = &r["h2o"];
    let chosen = match (h["tile_sketch"].as_u64(), h["tile_pool"].as_u64()) {
        (Some(sketch), Some(pool)) => Some(Chosen {
            tile_sketch: sketch as u32,
            tile_pool: pool as u32,
        }),
        _ => None,
    };
    Ok((measurement, chosen))
}
