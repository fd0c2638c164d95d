//! Sparse decode against full-attention decode on the same windows (`h2o-cli perplexity
//! --decode-tail N`): each window's first tokens go in as a prompt (the same H2O prefill for
//! both), then its last `N` tokens one at a time through the decode path, as generated text
//! would; every decode step's next-token distribution is scored against full-attention decode's
//! (Δ perplexity, KL divergence, top-1 agreement), and both decode paths are timed.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{log_softmax, Scores, Summary};
use h2o_llama::{Error, H2oConfig, Model, Result, Session, SessionConfig, Token};

/// What [`decode_tail`] measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DecodeTail {
    pub windows: usize,
    /// Tokens of each window that went through the decode path.
    pub tail: usize,
    /// The sparse decode's shape (its `decode_budget` > 0).
    pub h2o: H2oConfig,
    /// Full-attention decode as reference, sparse decode as candidate.
    pub summary: Summary,
    /// Keys a sparse step read per head, on average, and what full decode read.
    pub sparse_keys_per_step: f64,
    pub full_keys_per_step: f64,
    /// Decode steps per second of each path, over all scored steps.
    pub full_steps_per_second: f64,
    pub sparse_steps_per_second: f64,
}

/// Scores the last `tail` tokens of each window of `base.n_ctx` tokens (at most `max_windows`),
/// decoded one at a time, under sparse decode (`base.h2o`, whose `decode_budget` is > 0) against
/// full-attention decode after the same prefill. `progress` receives one-line messages.
///
/// # Errors
/// [`Error::InvalidConfig`] without a sparse decode budget, for a tail that leaves no prompt or a
/// text shorter than one window; what creating or evaluating a session returns, including
/// [`Error::Interrupted`] once `interrupt` is set.
pub fn decode_tail(
    model: &Model,
    tokens: &[Token],
    base: &SessionConfig,
    tail: usize,
    max_windows: Option<usize>,
    interrupt: Arc<AtomicBool>,
    mut progress: impl FnMut(&str),
) -> Result<DecodeTail> {
    let n_ctx = base.n_ctx as usize;
    let sparse = base
        .h2o
        .filter(|h| h.is_enabled() && h.decode_budget > 0)
        .ok_or_else(|| {
            Error::InvalidConfig(
                "--decode-tail compares sparse decode with full-attention decode: give H2O \
                 (--h2o-local/--h2o-heavy) and --h2o-decode sparse"
                    .into(),
            )
        })?;
    if tail == 0 || tail + 1 >= n_ctx {
        return Err(Error::InvalidConfig(format!(
            "--decode-tail {tail} must be at least 1 and leave a prompt of at least 2 tokens in \
             a window of -c {n_ctx}"
        )));
    }
    if tokens.len() < n_ctx {
        return Err(Error::InvalidConfig(format!(
            "the text has {} tokens, fewer than one window of -c {n_ctx}: use a smaller -c or \
             a longer text",
            tokens.len()
        )));
    }
    let mut windows = tokens.len() / n_ctx;
    if let Some(limit) = max_windows {
        windows = windows.min(limit.max(1));
    }
    let open = |decode_budget: u32| -> Result<Session<'_>> {
        let mut s = Session::new(
            model,
            SessionConfig {
                h2o: Some(H2oConfig {
                    decode_budget,
                    decode_coverage: if decode_budget == 0 {
                        1.0
                    } else {
                        sparse.decode_coverage
                    },
                    ..sparse
                }),
                ..base.clone()
            },
        )?;
        s.set_interrupt_flag(interrupt.clone());
        Ok(s)
    };
    let mut full = open(0)?;
    let mut sparse_session = open(sparse.decode_budget)?;
    let mut scores = Scores::default();
    let (mut t_full, mut t_sparse) = (Duration::ZERO, Duration::ZERO);
    let (mut keys_full, mut keys_sparse, mut steps) = (0_u64, 0.0_f64, 0_u64);
    for w in 0..windows {
        let mut window: Vec<Token> = tokens[w * n_ctx..(w + 1) * n_ctx].to_vec();
        if let Some(bos) = model.bos_token() {
            window[0] = bos;
        }
        let prompt_len = n_ctx - tail;
        progress(&format!(
            "window {}/{windows}: prompt of {prompt_len} tokens",
            w + 1
        ));
        for s in [&mut full, &mut sparse_session] {
            s.reset();
            s.evaluate(&window[..prompt_len])?;
        }
        for i in prompt_len..n_ctx - 1 {
            if (i - prompt_len).is_multiple_of(64) {
                progress(&format!(
                    "window {}/{windows}: decode step {}/{}",
                    w + 1,
                    i - prompt_len,
                    tail - 1
                ));
            }
            let step = [window[i]];
            let t0 = Instant::now();
            full.evaluate(&step)?;
            t_full += t0.elapsed();
            let t0 = Instant::now();
            sparse_session.evaluate(&step)?;
            t_sparse += t0.elapsed();
            let reference = log_softmax(full.logits().expect("logits after a decode step"));
            let candidate =
                log_softmax(sparse_session.logits().expect("logits after a decode step"));
            scores.add(&reference, &candidate, window[i + 1] as usize);
            keys_full += (i + 1) as u64;
            steps += 1;
        }
        // what the window's steps read, as the session counted them (or, with the whole budget,
        // as H2oConfig::decode_keys knows them)
        keys_sparse += sparse_session.decode_keys_per_step(prompt_len) * (tail - 1) as f64;
    }
    let per_step = |keys: f64| keys / steps.max(1) as f64;
    let rate = |t: Duration| steps as f64 / t.as_secs_f64().max(f64::MIN_POSITIVE);
    Ok(DecodeTail {
        windows,
        tail,
        h2o: sparse,
        summary: scores.summary(),
        sparse_keys_per_step: per_step(keys_sparse),
        full_keys_per_step: per_step(keys_full as f64),
        full_steps_per_second: rate(t_full),
        sparse_steps_per_second: rate(t_sparse),
    })
}
