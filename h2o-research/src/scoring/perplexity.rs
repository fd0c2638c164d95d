//! Perplexity of a text under full attention and H2O shapes, as llama-perplexity measures it.
//!
//! The text is cut into consecutive windows of `n_ctx` tokens, each evaluated from an empty
//! cache (its first token replaced by BOS), and every position predicts the next token.
//! Perplexity is reported over the whole window and over its second half (llama-perplexity's
//! convention: the second half has at least `n_ctx/2` tokens of context). All sessions run call
//! by call in step, so that each H2O shape's token distributions are compared with full
//! attention's (KL divergence, top-1 agreement) without storing them.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::{log_softmax, PositionScore, Scores, Summary};
use h2o_llama::{Error, H2oConfig, Model, Result, Session, SessionConfig, Token};

/// Tokens at the end of a window that [`WindowOptions::far_context`] scores.
pub const FAR_TAIL: usize = 1024;
/// The shortened far contexts [`WindowOptions::far_context`] compares with.
pub const FAR_CUT: [usize; 2] = [512, 0];

/// How a text is scored.
#[derive(Debug, Clone, Default)]
pub struct WindowOptions {
    /// Score at most this many windows (all if `None`).
    pub max_windows: Option<usize>,
    /// Also measure how much far context each configuration recovers: perplexity of the last
    /// [`FAR_TAIL`] tokens of each window given all earlier tokens (full attention and every
    /// shape), and given only [`FAR_CUT`] of them (full attention, a window cut short).
    pub far_context: bool,
    /// Also time a plain prefill of the first window (no logits but the last) under full
    /// attention and every shape, this many times each, alternating (0: no timing).
    pub speed_reps: usize,
}

/// Prefill times of the first window (see [`WindowOptions::speed_reps`]): medians of the runs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PrefillTimes {
    pub reps: usize,
    pub tokens: usize,
    pub full_attention_seconds: f64,
    /// One per shape, in the order given.
    pub shape_seconds: Vec<f64>,
}

/// One H2O shape's scores against full attention.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShapeScores {
    pub h2o: H2oConfig,
    pub whole: Summary,
    pub second_half: Summary,
}

/// The last tokens of each window, with all, some or none of the far context.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FarContext {
    /// predictions scored per window (the last FAR_TAIL tokens but the first, which a window cut
    /// to them starts with)
    pub positions: usize,
    /// full attention with every earlier token of the window
    pub ppl_full: f64,
    /// full attention with only `far_tokens` tokens before the last FAR_TAIL
    pub cut: Vec<FarCut>,
    /// every H2O shape with every earlier token, and the share of the far context's gain it
    /// keeps: (ppl with no far context − ppl of the shape) / (that − ppl of full attention)
    pub shapes: Vec<FarShape>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct FarCut {
    pub far_tokens: usize,
    pub ppl: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct FarShape {
    pub h2o: H2oConfig,
    pub ppl: f64,
    pub recovered_percent: f64,
}

/// What [`perplexity`] measured.
#[derive(Debug, Clone)]
pub struct Perplexity {
    pub windows: usize,
    /// One entry per shape, in the order given; with no shape, one entry comparing full
    /// attention with itself (which leaves only its perplexity).
    pub shapes: Vec<ShapeScores>,
    /// With [`WindowOptions::far_context`].
    pub far_context: Option<FarContext>,
    /// With [`WindowOptions::speed_reps`] > 0.
    pub prefill: Option<PrefillTimes>,
}

/// Per shape (or one, full attention against itself), the running scores.
struct Tally {
    whole: Vec<Scores>,
    second: Vec<Scores>,
    far: Vec<Scores>,
    far_cut: Vec<Scores>,
}

/// Scores `tokens` in windows of `base.n_ctx` under full attention (`base`) and under `base`
/// with each of `shapes` (deduplicated by the caller). `progress` receives one-line messages.
///
/// # Errors
/// [`Error::InvalidConfig`] for a window too small, a text shorter than one window or a far
/// context that does not fit; what creating or evaluating a session returns, including
/// [`Error::Interrupted`] once `interrupt` is set.
pub fn perplexity(
    model: &Model,
    tokens: &[Token],
    base: &SessionConfig,
    shapes: &[H2oConfig],
    options: &WindowOptions,
    interrupt: Arc<AtomicBool>,
    mut progress: impl FnMut(&str),
) -> Result<Perplexity> {
    let n_ctx = base.n_ctx as usize;
    check(n_ctx, tokens.len(), options)?;
    let mut windows = tokens.len() / n_ctx;
    if let Some(limit) = options.max_windows {
        windows = windows.min(limit.max(1));
    }
    let mut full = Session::new(model, base.clone())?;
    full.set_interrupt_flag(interrupt.clone());
    let mut sparse = shapes
        .iter()
        .map(|&shape| {
            let mut s = Session::new(
                model,
                SessionConfig {
                    h2o: Some(shape),
                    ..base.clone()
                },
            )?;
            s.set_interrupt_flag(interrupt.clone());
            Ok(s)
        })
        .collect::<Result<Vec<_>>>()?;
    let n_scored = shapes.len().max(1);
    let fresh = |n: usize| (0..n).map(|_| Scores::default()).collect::<Vec<_>>();
    let mut tally = Tally {
        whole: fresh(n_scored),
        second: fresh(n_scored),
        far: fresh(n_scored),
        far_cut: fresh(FAR_CUT.len()),
    };
    for w in 0..windows {
        let mut window: Vec<Token> = tokens[w * n_ctx..(w + 1) * n_ctx].to_vec();
        if let Some(bos) = model.bos_token() {
            window[0] = bos;
        }
        score_window(
            &window,
            base.n_batch as usize,
            options,
            &mut full,
            &mut sparse,
            &mut tally,
            |done| {
                progress(&format!(
                    "window {}/{windows}, tokens {done}/{n_ctx}",
                    w + 1
                ))
            },
        )?;
        if options.far_context {
            score_far_cuts(
                model,
                &window,
                base.n_batch as usize,
                &mut full,
                &mut tally.far_cut,
                |cut| {
                    progress(&format!(
                        "window {}/{windows}, {cut} tokens of far context",
                        w + 1
                    ))
                },
            )?;
        }
    }
    let far_context = options
        .far_context
        .then(|| far_report(shapes, &tally.far, &tally.far_cut));
    let prefill = if options.speed_reps > 0 {
        let mut window: Vec<Token> = tokens[..n_ctx].to_vec();
        if let Some(bos) = model.bos_token() {
            window[0] = bos;
        }
        progress("timing the prefill of the first window");
        Some(time_prefill(
            &window,
            options.speed_reps,
            &mut full,
            &mut sparse,
        )?)
    } else {
        None
    };
    let scored: Vec<ShapeScores> = tally
        .whole
        .iter()
        .zip(&tally.second)
        .enumerate()
        .map(|(k, (w, s))| ShapeScores {
            h2o: shapes.get(k).copied().unwrap_or(H2oConfig::new(0, 0)),
            whole: w.summary(),
            second_half: s.summary(),
        })
        .collect();
    Ok(Perplexity {
        windows,
        shapes: scored,
        far_context,
        prefill,
    })
}

/// `reps` plain prefills of `window` with every session, alternating full attention and the
/// shapes, each from an empty cache; the median time of each.
fn time_prefill(
    window: &[Token],
    reps: usize,
    full: &mut Session<'_>,
    sparse: &mut [Session<'_>],
) -> Result<PrefillTimes> {
    let once = |s: &mut Session<'_>| -> Result<f64> {
        s.reset();
        let start = std::time::Instant::now();
        s.evaluate(window)?;
        let secs = start.elapsed().as_secs_f64();
        s.reset();
        Ok(secs)
    };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); 1 + sparse.len()];
    for _ in 0..reps {
        times[0].push(once(full)?);
        for (k, s) in sparse.iter_mut().enumerate() {
            times[k + 1].push(once(s)?);
        }
    }
    let mut medians: Vec<f64> = times.iter().map(|t| crate::bench::median(t)).collect();
    let full_attention_seconds = medians.remove(0);
    Ok(PrefillTimes {
        reps,
        tokens: window.len(),
        full_attention_seconds,
        shape_seconds: medians,
    })
}

fn check(n_ctx: usize, n_tokens: usize, options: &WindowOptions) -> Result<()> {
    if n_ctx < 4 {
        return Err(Error::InvalidConfig(format!(
            "-c {n_ctx}: a window needs at least 4 tokens"
        )));
    }
    if options.far_context && n_ctx < 2 * FAR_TAIL {
        return Err(Error::InvalidConfig(format!(
            "--far-context scores the last {FAR_TAIL} tokens of a window after at least as many: \
             use -c {} or more",
            2 * FAR_TAIL
        )));
    }
    if n_tokens < n_ctx {
        return Err(Error::InvalidConfig(format!(
            "the text has {n_tokens} tokens, fewer than one window of -c {n_ctx}: use a smaller \
             -c or a longer text"
        )));
    }
    Ok(())
}

/// One window, call by call: full attention first (its log-probabilities kept for the call's
/// tokens), then every shape, each position scored against full attention.
fn score_window(
    window: &[Token],
    n_batch: usize,
    options: &WindowOptions,
    full: &mut Session<'_>,
    sparse: &mut [Session<'_>],
    tally: &mut Tally,
    mut progress: impl FnMut(usize),
) -> Result<()> {
    let n_ctx = window.len();
    let second_half_from = n_ctx / 2;
    let far_from = n_ctx.saturating_sub(FAR_TAIL);
    full.reset();
    sparse.iter_mut().for_each(Session::reset);
    let mut start = 0;
    for piece in window.chunks(n_batch) {
        progress(start);
        let mut log_probs: Vec<Vec<f32>> = Vec::with_capacity(piece.len());
        full.evaluate_with_logits(piece, |_, logits| log_probs.push(log_softmax(logits)))?;
        let mut score = |k: usize, i: usize, lp_h2o: &[f32]| {
            let pos = start + i;
            let Some(&next) = window.get(pos + 1) else {
                return; // the last token predicts beyond the window
            };
            let p = PositionScore::new(&log_probs[i], lp_h2o, next as usize);
            for scores in [
                Some(&mut tally.whole[k]),
                (pos >= second_half_from).then_some(&mut tally.second[k]),
                (options.far_context && pos >= far_from).then_some(&mut tally.far[k]),
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
        start += piece.len();
    }
    Ok(())
}

/// Full attention on the window's last [`FAR_TAIL`] tokens with only [`FAR_CUT`] tokens of far
/// context before them.
fn score_far_cuts(
    model: &Model,
    window: &[Token],
    n_batch: usize,
    full: &mut Session<'_>,
    far_cut: &mut [Scores],
    mut progress: impl FnMut(usize),
) -> Result<()> {
    let far_from = window.len().saturating_sub(FAR_TAIL);
    for (&cut, scores) in FAR_CUT.iter().zip(far_cut.iter_mut()) {
        progress(cut);
        let mut short: Vec<Token> = window[far_from - cut..].to_vec();
        if let Some(bos) = model.bos_token() {
            short[0] = bos;
        }
        full.reset();
        let mut done = 0;
        for piece in short.chunks(n_batch) {
            full.evaluate_with_logits(piece, |i, logits| {
                let at = done + i; // index in `short`; position far_from - cut + at
                if at >= cut && at + 1 < short.len() {
                    let lp = log_softmax(logits);
                    scores.push(PositionScore::new(&lp, &lp, short[at + 1] as usize));
                }
            })?;
            done += piece.len();
        }
    }
    Ok(())
}

fn far_report(shapes: &[H2oConfig], far: &[Scores], far_cut: &[Scores]) -> FarContext {
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
            .zip(far)
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
}
