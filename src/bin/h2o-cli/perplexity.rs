//! `h2o-cli perplexity`: how much worse H2O predicts a text than full attention.
//!
//! Like llama-perplexity: the text is cut into consecutive windows of `-c` tokens, each window
//! is evaluated from an empty cache (its first token replaced by BOS), and every position
//! predicts the next token. Perplexity is reported over the whole window and over its second
//! half (llama-perplexity's convention: the second half has at least `c/2` tokens of context).
//! Both engines run in this process, call by call in step, so that H2O's token distributions can
//! be compared with full attention's (the KL divergence and top-1 agreement of
//! llama-perplexity's `--kl-divergence`) without storing them.
//!
//! Full attention here is this build with H2O off, which `tests/stock_equivalence.rs` shows is
//! bit-identical to the stock build; `scripts/ppl-vs-stock.sh` also runs the stock build itself.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Result};
use h2o_llama::scoring::{log_softmax, PositionScore, Scores, Summary};
use h2o_llama::{H2oConfig, Session, SessionConfig, Token};

#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    /// Text to score (UTF-8)
    #[arg(short = 'f', long, value_name = "FILE")]
    file: PathBuf,
    /// Model file (GGUF) [default: the default model]
    #[arg(short = 'm', long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// Window (context) size in tokens
    #[arg(
        short = 'c',
        long = "ctx-size",
        value_name = "N",
        default_value_t = 4096
    )]
    ctx_size: u32,
    /// Logical batch; logits of every token of a call are held at once (n_vocab floats each)
    #[arg(
        short = 'b',
        long = "batch-size",
        value_name = "N",
        default_value_t = 1024
    )]
    batch_size: u32,
    #[command(flatten)]
    shape: crate::H2oShape,
    /// Score at most this many windows [default: all]
    #[arg(long, value_name = "N")]
    chunks: Option<usize>,
    /// CPU threads
    #[arg(short = 't', long)]
    threads: Option<u32>,
    /// Print one JSON record instead of the table
    #[arg(long)]
    json: bool,
    // (help as an attribute: rustdoc would read the brackets as links)
    #[arg(
        long,
        value_name = "L:H[:P[:S[:T]]],..",
        value_delimiter = ',',
        value_parser = parse_shape,
        help = "Ablation: also score these H2O shapes (L:H[:POLICY[:SINK[:TAIL]]], comma-separated, \
                omitted parts as the library recommends; e.g. 512:0,0:512 for local-only and heavy-only \
                at the same M as 256:256), against the same full attention, and print one row per shape \
                (the main shape first; a shape named twice is scored once)"
    )]
    ablate: Vec<H2oConfig>,
    /// Also measure how much far context each configuration recovers: perplexity of the last
    /// 1024 tokens of each window given all earlier tokens (full attention and every H2O shape),
    /// and given only 512 or 0 of them (full attention, a window cut short). Needs -c >= 2048.
    #[arg(long)]
    far_context: bool,
}

/// Tokens at the end of a window that --far-context scores.
const FAR_TAIL: usize = 1024;
/// The shortened far contexts --far-context compares with.
const FAR_CUT: [usize; 2] = [512, 0];

fn parse_shape(s: &str) -> std::result::Result<H2oConfig, String> {
    let parts: Vec<&str> = s.split(':').collect();
    if !(2..=5).contains(&parts.len()) {
        return Err(format!(
            "{s:?}: write an H2O shape as L:H[:POLICY[:SINK[:TAIL]]], e.g. 256:256 or 256:256:h2o:0:0"
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
    if !shape.is_enabled() {
        return Err(format!(
            "{s:?}: L = H = 0 is full attention, which is always scored"
        ));
    }
    Ok(shape)
}

/// One H2O shape's scores against full attention.
#[derive(Debug, serde::Serialize)]
struct ShapeReport {
    h2o: H2oConfig,
    whole: Summary,
    second_half: Summary,
}

/// --far-context: the last tokens of each window, with all, some or none of the far context.
#[derive(Debug, serde::Serialize)]
struct FarContext {
    /// predictions scored per window (the last FAR_TAIL tokens but the first, which a window cut
    /// to them starts with)
    positions: usize,
    /// full attention with every earlier token of the window
    ppl_full: f64,
    /// full attention with only `far_tokens` tokens before the last FAR_TAIL
    cut: Vec<FarCut>,
    /// every H2O shape with every earlier token, and the share of the far context's gain it keeps:
    /// (ppl with no far context − ppl of the shape) / (that − ppl of full attention)
    shapes: Vec<FarShape>,
}

#[derive(Debug, serde::Serialize)]
struct FarCut {
    far_tokens: usize,
    ppl: f64,
}

#[derive(Debug, serde::Serialize)]
struct FarShape {
    h2o: H2oConfig,
    ppl: f64,
    recovered_percent: f64,
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
    /// None: full attention only (L = H = 0)
    h2o: Option<H2oConfig>,
    whole: Summary,
    second_half: Summary,
    /// with --ablate: every shape scored (the main one first), else empty
    shapes: Vec<ShapeReport>,
    /// with --far-context
    far_context: Option<FarContext>,
}

pub fn run(args: &PerplexityArgs, interrupt: Arc<AtomicBool>) -> Result<()> {
    let h2o = args.shape.config();
    if args.ctx_size < 4 {
        bail!("-c {}: a window needs at least 4 tokens", args.ctx_size);
    }
    if args.far_context && (args.ctx_size as usize) < 2 * FAR_TAIL {
        bail!(
            "--far-context scores the last {FAR_TAIL} tokens of a window after at least as many: use -c {} or more",
            2 * FAR_TAIL
        );
    }
    let base = SessionConfig {
        n_ctx: args.ctx_size,
        n_batch: args.batch_size,
        n_ubatch: args.shape.ubatch_size,
        n_threads: args.threads.unwrap_or(SessionConfig::default().n_threads),
        ..SessionConfig::default()
    };
    // the main shape first (unless L = H = 0), then the ablation's; each scored once
    let mut shapes: Vec<H2oConfig> = Vec::new();
    for shape in std::iter::once(h2o)
        .filter(H2oConfig::is_enabled)
        .chain(args.ablate.iter().copied())
    {
        if !shapes.contains(&shape) {
            shapes.push(shape);
        }
    }
    let shape_config = |shape: H2oConfig| SessionConfig {
        h2o: Some(shape),
        ..base.clone()
    };
    base.validate()?;
    for &shape in &shapes {
        shape_config(shape).validate()?;
    }
    let text = crate::read_text_file(&args.file, "text file")?;
    let model = crate::load_model(args.model.as_deref(), 0, args.json, &interrupt)?;
    let tokens = model.tokenize(&text, true, false)?;
    let n_ctx = args.ctx_size as usize;
    let mut windows = tokens.len() / n_ctx;
    if windows == 0 {
        bail!(
            "{} has {} tokens, fewer than one window of -c {}: use a smaller -c or a longer text",
            args.file.display(),
            tokens.len(),
            n_ctx
        );
    }
    if let Some(limit) = args.chunks {
        windows = windows.min(limit.max(1));
    }
    let mut full = Session::new(&model, base.clone())?;
    full.set_interrupt_flag(interrupt.clone());
    // L = H = 0: full attention only (how the stock build, which has no H2O, takes part)
    let mut sparse = shapes
        .iter()
        .map(|&shape| {
            let mut s = Session::new(&model, shape_config(shape))?;
            s.set_interrupt_flag(interrupt.clone());
            Ok(s)
        })
        .collect::<Result<Vec<_>>>()?;
    let bos = model.bos_token();
    let show_progress = !args.json && std::io::stderr().is_terminal();

    // per shape (or one, full attention against itself, when there is no shape)
    let n_scored = shapes.len().max(1);
    let mut whole: Vec<Scores> = (0..n_scored).map(|_| Scores::default()).collect();
    let mut second: Vec<Scores> = (0..n_scored).map(|_| Scores::default()).collect();
    // --far-context: the window's last tokens per shape, and full attention's with the far context cut
    let far_from = n_ctx.saturating_sub(FAR_TAIL);
    let mut far: Vec<Scores> = (0..n_scored).map(|_| Scores::default()).collect();
    let mut far_cut: Vec<Scores> = FAR_CUT.iter().map(|_| Scores::default()).collect();
    for w in 0..windows {
        let mut window: Vec<Token> = tokens[w * n_ctx..(w + 1) * n_ctx].to_vec();
        if let Some(bos) = bos {
            window[0] = bos;
        }
        full.reset();
        sparse.iter_mut().for_each(Session::reset);
        let first_second_half = n_ctx / 2;
        for (start, piece) in window.chunks(args.batch_size as usize).scan(0, |s, p| {
            let start = *s;
            *s += p.len();
            Some((start, p))
        }) {
            if show_progress {
                eprint!(
                    "\r\x1b[Kperplexity: window {}/{windows}, tokens {start}/{n_ctx}",
                    w + 1
                );
            }
            // full attention first, its log-probabilities kept for the call's tokens
            let mut log_probs: Vec<Vec<f32>> = Vec::with_capacity(piece.len());
            full.evaluate_with_logits(piece, |_, logits| log_probs.push(log_softmax(logits)))?;
            let mut score = |k: usize, i: usize, lp_h2o: &[f32]| {
                let pos = start + i;
                let Some(&next) = window.get(pos + 1) else {
                    return; // the last token predicts beyond the window
                };
                let p = PositionScore::new(&log_probs[i], lp_h2o, next as usize);
                for scores in [
                    Some(&mut whole[k]),
                    (pos >= first_second_half).then_some(&mut second[k]),
                    (args.far_context && pos >= far_from).then_some(&mut far[k]),
                ]
                .into_iter()
                .flatten()
                {
                    scores.push(p);
                }
            };
            for (k, s) in sparse.iter_mut().enumerate() {
                s.evaluate_with_logits(piece, |i, logits| score(k, i, &log_softmax(logits)))?;
            }
            if sparse.is_empty() {
                // no H2O: compare full attention with itself, which leaves only its perplexity
                (0..piece.len()).for_each(|i| score(0, i, &log_probs[i]));
            }
        }
        if args.far_context {
            for (cut, scores) in FAR_CUT.iter().zip(far_cut.iter_mut()) {
                if show_progress {
                    eprint!(
                        "\r\x1b[Kperplexity: window {}/{windows}, {cut} tokens of far context",
                        w + 1
                    );
                }
                let mut short: Vec<Token> = window[far_from - cut..].to_vec();
                if let Some(bos) = bos {
                    short[0] = bos;
                }
                full.reset();
                let mut done = 0;
                for piece in short.chunks(args.batch_size as usize) {
                    full.evaluate_with_logits(piece, |i, logits| {
                        let at = done + i; // index in `short`; position far_from - cut + at
                        if at >= *cut && at + 1 < short.len() {
                            let lp = log_softmax(logits);
                            scores.push(PositionScore::new(&lp, &lp, short[at + 1] as usize));
                        }
                    })?;
                    done += piece.len();
                }
            }
        }
    }
    if show_progress {
        eprint!("\r\x1b[K");
    }
    let report = Report {
        file: args.file.display().to_string(),
        model: model.path().display().to_string(),
        text_tokens: tokens.len(),
        windows,
        n_ctx: args.ctx_size,
        n_batch: args.batch_size,
        n_ubatch: args.shape.ubatch_size,
        h2o: shapes.first().copied(),
        whole: whole[0].summary(),
        second_half: second[0].summary(),
        far_context: args.far_context.then(|| {
            let ppl_cut: Vec<f64> = far_cut.iter().map(|s| s.summary().ppl_full).collect();
            let ppl_full = far[0].summary().ppl_full;
            let ppl_none = ppl_cut[FAR_CUT.len() - 1];
            FarContext {
                positions: far[0].len(),
                ppl_full,
                cut: FAR_CUT
                    .iter()
                    .zip(&ppl_cut)
                    .map(|(&far_tokens, &ppl)| FarCut { far_tokens, ppl })
                    .collect(),
                shapes: shapes
                    .iter()
                    .zip(&far)
                    .map(|(&h2o, s)| {
                        let ppl = s.summary().ppl_h2o;
                        FarShape {
                            h2o,
                            ppl,
                            recovered_percent: 100.0 * (ppl_none - ppl) / (ppl_none - ppl_full),
                        }
                    })
                    .collect(),
            }
        }),
        shapes: if args.ablate.is_empty() {
            Vec::new()
        } else {
            shapes
                .iter()
                .zip(whole.iter().zip(&second))
                .map(|(&h2o, (w, s))| ShapeReport {
                    h2o,
                    whole: w.summary(),
                    second_half: s.summary(),
                })
                .collect()
        },
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
        if let Some(far) = &report.far_context {
            print!("{}", far_table(far));
        }
    }
    Ok(())
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
                h.local, h.heavy, h.select, h.sink, h.dense_tail
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
                shape.h2o.select,
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
            h.h2o.select,
            h.h2o.sink,
            h.h2o.dense_tail,
            h.ppl,
            h.recovered_percent
        ));
    }
    s
}
