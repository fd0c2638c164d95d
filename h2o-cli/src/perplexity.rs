//! `h2o-cli perplexity`: how much worse H2O predicts a text than full attention. The scoring
//! (windows as llama-perplexity cuts them, KLD, top-1 agreement, far context) is
//! `h2o_research::scoring::perplexity`; this is its flags, progress and tables.
//!
//! Full attention here is this build with H2O off, which `h2o-cli/tests/stock_equivalence.rs`
//! shows is bit-identical to the stock build; `scripts/ppl-vs-stock.sh` also runs the stock
//! build itself.

use std::cell::Cell;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use h2o_flags::{EngineFlags, H2oFlags};
use h2o_llama::{CacheType, H2oConfig, Model, SessionConfig};
use h2o_research::scoring::decode_tail;
use h2o_research::scoring::perplexity::{
    self, FarContext, PrefillTimes, ShapeScores, WindowOptions, FAR_TAIL,
};
use h2o_research::scoring::Summary;

#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    /// Text to score (UTF-8)
    #[arg(short = 'f', long, value_name = "FILE")]
    file: PathBuf,
    /// The engine of every session; -c is the window (left out: the model's training context),
    /// and every token of a call keeps its logits (n_vocab floats each), so -b bounds that memory
    #[command(flatten)]
    engine: EngineFlags,
    /// The H2O shape scored against full attention (L = H = 256 where left out; 0 and 0: full
    /// attention only)
    #[command(flatten)]
    h2o: H2oFlags,
    /// Score at most this many windows [default: all]
    #[arg(long, value_name = "N")]
    chunks: Option<usize>,
    /// Print one JSON record instead of the table
    #[arg(long)]
    json: bool,
    // (help as an attribute: rustdoc would read the brackets as links)
    #[arg(
        long,
        value_name = "L:H[:P[:S[:T[:N[:G[:K[:POOL]]]]]]],..",
        value_delimiter = ',',
        value_parser = parse_shape,
        help = "Ablation: also score these H2O shapes (L:H[:POLICY[:SINK[:TAIL[:TILE_SAMPLES[:COVERAGE[:TILE_SKETCH[:TILE_POOL]]]]]]], \
                comma-separated, omitted parts as the library recommends; e.g. 512:0,0:512 for local-only and heavy-only \
                at the same M as 256:256), against the same full attention, and print one row per shape \
                (the main shape first; a shape named twice is scored once)"
    )]
    ablate: Vec<H2oConfig>,
    /// Also measure how much far context each configuration recovers: perplexity of the last
    /// 1024 tokens of each window given all earlier tokens (full attention and every H2O shape),
    /// and given only 512 or 0 of them (full attention, a window cut short). Needs -c >= 2048.
    #[arg(long)]
    far_context: bool,
    /// Also time a plain prefill of the first window under full attention and every H2O shape,
    /// N times each, alternating (medians), and report each shape's speed-up
    #[arg(long, value_name = "N")]
    speed: Option<usize>,
    /// With --speed: draw Δ ppl (whole window) against the prefill speed-up of every shape into
    /// this PNG file
    #[arg(long, value_name = "FILE", requires = "speed")]
    png: Option<PathBuf>,
    /// Score sparse decode instead: the last N tokens of each window go one at a time through
    /// the decode path after the rest as a prompt, under --h2o-decode sparse and under
    /// full-attention decode (the same H2O prefill before both): Δ ppl, KLD, top-1 agreement,
    /// keys read and decode speed
    #[arg(long, value_name = "N", conflicts_with_all = ["ablate", "far_context", "speed"])]
    decode_tail: Option<usize>,
}

fn parse_shape(s: &str) -> std::result::Result<H2oConfig, String> {
    let parts: Vec<&str> = s.split(':').collect();
    if !(2..=9).contains(&parts.len()) {
        return Err(format!(
            "{s:?}: write an H2O shape as \
             L:H[:POLICY[:SINK[:TAIL[:TILE_SAMPLES[:COVERAGE[:TILE_SKETCH[:TILE_POOL]]]]]]], e.g. \
             256:256, 256:256:h2o:0:0, 256:256:coverage:4:64:16:0.9, \
             256:256:coverage:4:64:32:1:4 or 256:256:coverage:4:64:64:1:0:4096"
        ));
    }
    let n = |v: &str| {
        v.trim()
            .parse::<u32>()
            .map_err(|e| format!("{s:?}: {v:?} is not a token count ({e})"))
    };
    let mut shape = H2oConfig::new(n(parts[0])?, n(parts[1])?);
    if let Some(p) = parts.get(2) {
        shape.select = p.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
    }
    if let Some(v) = parts.get(3) {
        shape.sink = n(v)?;
    }
    if let Some(v) = parts.get(4) {
        shape.dense_tail = n(v)?;
    }
    if let Some(v) = parts.get(5) {
        shape.tile_samples = n(v)?;
    }
    if let Some(v) = parts.get(6) {
        shape.coverage = v
            .trim()
            .parse::<f32>()
            .map_err(|e| format!("{s:?}: {v:?} is not a coverage share ({e})"))?;
    }
    if let Some(v) = parts.get(7) {
        shape.tile_sketch = n(v)?;
    }
    if let Some(v) = parts.get(8) {
        shape.tile_pool = n(v)?;
    }
    if !shape.is_enabled() {
        return Err(format!(
            "{s:?}: L = H = 0 is full attention, which is always scored"
        ));
    }
    Ok(shape)
}

#[derive(Debug, serde::Serialize)]
struct Report {
    file: String,
    model: String,
    text_tokens: usize,
    windows: usize,
    n_ctx: u32,
    n_batch: u32,
    n_ubatch: u32,
    n_gpu_layers: i32,
    cache_type_k: CacheType,
    cache_type_v: CacheType,
    /// None: full attention only (L = H = 0)
    h2o: Option<H2oConfig>,
    whole: Summary,
    second_half: Summary,
    /// with --ablate: every shape scored (the main one first), else empty
    shapes: Vec<ShapeScores>,
    /// with --far-context
    far_context: Option<FarContext>,
    /// with --speed
    prefill: Option<PrefillTimes>,
}

/// The sessions' shape the flags give (full attention; callers add H2O), with the window the
/// model takes where -c is left out. The batches are H2O's, so that full attention and H2O
/// score with the same calls.
fn session_config(args: &PerplexityArgs, model: Option<&Model>) -> SessionConfig {
    let mut config = args.engine.compared_session_config();
    if config.n_ctx == 0 {
        if let Some(model) = model {
            config.n_ctx = model.n_ctx_train();
        }
    }
    config
}

/// Progress on stderr, `--json` or not (the record is on stdout): a line that redraws itself on a
/// terminal, in a log a line when the run starts and then at most one every
/// `ProgressLine::LOG_EVERY`; `done()` clears a terminal's line.
struct ProgressLine {
    redraw: bool,
    last_logged: Cell<Option<Instant>>,
}

impl ProgressLine {
    const LOG_EVERY: Duration = Duration::from_secs(15);

    fn new() -> Self {
        Self {
            redraw: std::io::stderr().is_terminal(),
            last_logged: Cell::new(None),
        }
    }

    fn show(&self, msg: &str) {
        if self.redraw {
            eprint!("\r\x1b[Kperplexity: {msg}");
        } else if self
            .last_logged
            .get()
            .is_none_or(|t| t.elapsed() >= Self::LOG_EVERY)
        {
            eprintln!("h2o-cli perplexity: {msg}");
            self.last_logged.set(Some(Instant::now()));
        }
    }

    fn done(&self) {
        if self.redraw {
            eprint!("\r\x1b[K");
        }
    }
}

pub fn run(args: &PerplexityArgs, interrupt: Arc<AtomicBool>) -> Result<()> {
    if let Some(tail) = args.decode_tail {
        return run_decode_tail(args, tail, interrupt);
    }
    let base = session_config(args, None);
    // the main shape first (unless L = H = 0: full attention only, how the stock build, which
    // has no H2O, takes part), then the ablation's; each scored once
    let shapes = distinct(
        std::iter::once(args.h2o.compared()?)
            .filter(H2oConfig::is_enabled)
            .chain(args.ablate.iter().copied()),
    );
    base.validate()?;
    for &shape in &shapes {
        SessionConfig {
            h2o: Some(shape),
            ..base.clone()
        }
        .validate()?;
    }
    if args.speed == Some(0) {
        anyhow::bail!("--speed 0: give the number of timed prefills per configuration, 1 or more");
    }
    if let Some(png) = &args.png {
        h2o_research::chart::check_writable(png).context("--png")?;
    }
    let text = crate::read_text_file(&args.file, "text file")?;
    let model = crate::load_model(&args.engine, args.json, &interrupt)?;
    let base = session_config(args, Some(&model));
    // what the shapes leave to the model (the sketch), chosen now so that the record names it
    let shapes = distinct(shapes.iter().map(|shape| shape.for_model(&model)));
    let tokens = model.tokenize(&text, true, false)?;
    let options = WindowOptions {
        max_windows: args.chunks,
        far_context: args.far_context,
        speed_reps: args.speed.unwrap_or(0),
    };
    let progress = ProgressLine::new();
    let scored = perplexity::perplexity(
        &model,
        &tokens,
        &base,
        &shapes,
        &options,
        interrupt,
        |msg| progress.show(msg),
    )
    .with_context(|| args.file.display().to_string())?;
    progress.done();
    let main = &scored.shapes[0];
    let report = Report {
        file: args.file.display().to_string(),
        model: model.path().display().to_string(),
        text_tokens: tokens.len(),
        windows: scored.windows,
        n_ctx: base.n_ctx,
        n_batch: base.n_batch,
        n_ubatch: base.n_ubatch,
        n_gpu_layers: args.engine.n_gpu_layers,
        cache_type_k: base.cache_type_k,
        cache_type_v: base.cache_type_v,
        h2o: shapes.first().copied(),
        whole: main.whole,
        second_half: main.second_half,
        shapes: if args.ablate.is_empty() {
            Vec::new()
        } else {
            scored.shapes.clone()
        },
        far_context: scored.far_context,
        prefill: scored.prefill,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
        if let Some(far) = &report.far_context {
            print!("{}", far_table(far));
        }
        if let Some(prefill) = &report.prefill {
            print!("{}", speed_table(&scored.shapes, prefill));
        }
    }
    if let (Some(png), Some(prefill)) = (&args.png, &report.prefill) {
        draw_tradeoff(png, &report, &scored.shapes, prefill)?;
        if !args.json {
            eprintln!("h2o-cli perplexity: chart written to {}", png.display());
        }
    }
    Ok(())
}

/// The shapes in order, each once.
fn distinct(shapes: impl Iterator<Item = H2oConfig>) -> Vec<H2oConfig> {
    let mut seen: Vec<H2oConfig> = Vec::new();
    for shape in shapes {
        if !seen.contains(&shape) {
            seen.push(shape);
        }
    }
    seen
}

/// `--decode-tail N`: sparse decode against full-attention decode on each window's last N tokens.
fn run_decode_tail(args: &PerplexityArgs, tail: usize, interrupt: Arc<AtomicBool>) -> Result<()> {
    let h2o = Some(args.h2o.compared()?);
    SessionConfig {
        h2o,
        ..session_config(args, None)
    }
    .validate()?;
    let text = crate::read_text_file(&args.file, "text file")?;
    let model = crate::load_model(&args.engine, args.json, &interrupt)?;
    let base = SessionConfig {
        h2o,
        ..session_config(args, Some(&model))
    };
    let tokens = model.tokenize(&text, true, false)?;
    let progress = ProgressLine::new();
    let r = decode_tail::decode_tail(
        &model,
        &tokens,
        &base,
        tail,
        args.chunks,
        interrupt,
        |msg| progress.show(msg),
    )
    .with_context(|| args.file.display().to_string())?;
    progress.done();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let s = &r.summary;
    println!(
        "text: {} | {} windows of -c {}, the last {} tokens of each decoded one at a time | {} L {} H {} \
         sink {}, decode budget {}\n\n\
         | decode | ppl | Δ ppl | KLD mean | KLD p99 | top-1 | keys a step | steps/s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n\
         | full attention | {:.4} | | | | | {:.0} | {:.1} |\n\
         | sparse | {:.4} | {:+.2} % | {:.4} | {:.4} | {:.1} % | {:.0} | {:.1} ({:.2}×) |",
        args.file.display(),
        r.windows,
        base.n_ctx,
        r.tail,
        r.h2o.policy_label(),
        r.h2o.local,
        r.h2o.heavy,
        r.h2o.sink,
        r.h2o.decode_budget,
        s.ppl_full,
        r.full_keys_per_step,
        r.full_steps_per_second,
        s.ppl_h2o,
        s.delta_ppl_percent,
        s.kld_mean,
        s.kld_p99,
        s.top1_agreement_percent,
        r.sparse_keys_per_step,
        r.sparse_steps_per_second,
        r.sparse_steps_per_second / r.full_steps_per_second
    );
    Ok(())
}

fn speed_table(shapes: &[ShapeScores], t: &PrefillTimes) -> String {
    let mut s = format!(
        "\nprefill of the first window ({} tokens), median of {}: full attention {:.2} s\n\n\
         | configuration | prefill s | speed-up | Δ ppl, whole window |\n|---|---:|---:|---:|\n",
        t.tokens, t.reps, t.full_attention_seconds
    );
    for (shape, &secs) in shapes.iter().zip(&t.shape_seconds) {
        s.push_str(&format!(
            "| {} L {} H {} sink {} tail {} | {:.2} | {:.2}× | {:+.2} % |\n",
            shape.h2o.policy_label(),
            shape.h2o.local,
            shape.h2o.heavy,
            shape.h2o.sink,
            shape.h2o.dense_tail,
            secs,
            t.full_attention_seconds / secs,
            shape.whole.delta_ppl_percent
        ));
    }
    s
}

fn draw_tradeoff(
    png: &std::path::Path,
    r: &Report,
    shapes: &[ShapeScores],
    t: &PrefillTimes,
) -> Result<()> {
    let points: Vec<h2o_research::chart::TradeoffPoint> = shapes
        .iter()
        .zip(&t.shape_seconds)
        .map(|(shape, &secs)| h2o_research::chart::TradeoffPoint {
            label: format!(
                "{} {}:{}",
                shape.h2o.policy_label(),
                shape.h2o.local,
                shape.h2o.heavy
            ),
            speedup: t.full_attention_seconds / secs,
            delta_ppl_percent: shape.whole.delta_ppl_percent,
        })
        .collect();
    let text = std::path::Path::new(&r.file)
        .file_name()
        .map_or_else(|| r.file.clone(), |n| n.to_string_lossy().into_owned());
    let title = format!(
        "{text}, {} tokens, -ub {}: perplexity against prefill speed (full attention = 1×)",
        t.tokens, r.n_ubatch
    );
    Ok(h2o_research::chart::tradeoff(png, &title, &points)?)
}

fn table(r: &Report) -> String {
    let mut s = format!(
        "text: {} ({} tokens, {} windows of -c {}) | model: {} | -b {} -ub {} | {}\n\n",
        r.file,
        r.text_tokens,
        r.windows,
        r.n_ctx,
        r.model,
        r.n_batch,
        r.n_ubatch,
        match r.h2o {
            Some(h) => format!(
                "H2O L = {} H = {}, {} sink {} tail {}",
                h.local,
                h.heavy,
                h.policy_label(),
                h.sink,
                h.dense_tail
            ),
            None => "full attention only (H2O off)".into(),
        }
    );
    if !r.shapes.is_empty() {
        s.push_str(&format!(
            "ablation, second half of each window ({} positions scored; full attention ppl {:.4})\n\n\
             | L | H | M | select | sink | tail | ppl H2O | Δ ppl | KLD mean | KLD p99 | top-1 agreement | Δ ppl, whole window |\n\
             |---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            r.second_half.positions, r.second_half.ppl_full
        ));
        for shape in &r.shapes {
            let p = &shape.second_half;
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {:.4} | {:+.2} % | {:.5} | {:.5} | {:.2} % | {:+.2} % |\n",
                shape.h2o.local,
                shape.h2o.heavy,
                shape.h2o.memory_size(),
                shape.h2o.policy_label(),
                shape.h2o.sink,
                shape.h2o.dense_tail,
                p.ppl_h2o,
                p.delta_ppl_percent,
                p.kld_mean,
                p.kld_p99,
                p.top1_agreement_percent,
                shape.whole.delta_ppl_percent
            ));
        }
        return s;
    }
    if r.h2o.is_none() {
        s.push_str("| positions | scored | ppl |\n|---|---:|---:|\n");
        for (name, p) in [("whole window", &r.whole), ("second half", &r.second_half)] {
            s.push_str(&format!(
                "| {name} | {} | {:.4} |\n",
                p.positions, p.ppl_full
            ));
        }
        return s;
    }
    s.push_str(
        "| positions | scored | ppl full attention | ppl H2O | Δ ppl | KLD mean | KLD median | KLD p99 \
         | top-1 agreement |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (name, p) in [("whole window", &r.whole), ("second half", &r.second_half)] {
        s.push_str(&format!(
            "| {name} | {} | {:.4} | {:.4} | {:+.2} % | {:.5} | {:.5} | {:.5} | {:.2} % |\n",
            p.positions,
            p.ppl_full,
            p.ppl_h2o,
            p.delta_ppl_percent,
            p.kld_mean,
            p.kld_median,
            p.kld_p99,
            p.top1_agreement_percent
        ));
    }
    s
}

fn far_table(f: &FarContext) -> String {
    let mut s = format!(
        "\nfar context: perplexity of the last {FAR_TAIL} tokens of each window ({} predictions)\n\n\
         | attention | far context | ppl | far context's gain kept |\n|---|---|---:|---:|\n\
         | full | all | {:.4} | 100 % |\n",
        f.positions, f.ppl_full
    );
    let ppl_none = f.cut.last().map_or(f64::NAN, |c| c.ppl);
    for c in &f.cut {
        s.push_str(&format!(
            "| full | {} tokens | {:.4} | {:.1} % |\n",
            c.far_tokens,
            c.ppl,
            100.0 * (ppl_none - c.ppl) / (ppl_none - f.ppl_full)
        ));
    }
    for h in &f.shapes {
        s.push_str(&format!(
            "| H2O L {} H {} {} sink {} tail {} | all | {:.4} | {:.1} % |\n",
            h.h2o.local,
            h.h2o.heavy,
            h.h2o.policy_label(),
            h.h2o.sink,
            h.h2o.dense_tail,
            h.ppl,
            h.recovered_percent
        ));
    }
    s
}
