//! Scoring a text under two attention configurations (full attention and H2O), as
//! llama-perplexity does: per scored position, each one's negative log-likelihood of the next
//! token, the KL divergence between their next-token distributions and whether their top
//! tokens agree; then perplexities, the KLD's mean and quantiles and the top-1 agreement.
//! [`perplexity`] scores a text in windows as llama-perplexity does, [`decode_tail`] the last
//! tokens of each window through sparse against full-attention decode; `h2o-cli perplexity` is
//! a front end over both.

pub mod decode_tail;
pub mod perplexity;

/// Log-probabilities from logits (log-softmax, accumulated in f64 for the normaliser).
#[must_use]
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let log_sum = sum.ln() as f32;
    logits.iter().map(|&x| x - max - log_sum).collect()
}

/// Index of the largest value (the first of equals by `total_cmp`'s order; 0 for an empty slice).
#[must_use]
pub fn argmax(v: &[f32]) -> usize {
    (0..v.len())
        .max_by(|&i, &j| v[i].total_cmp(&v[j]))
        .unwrap_or(0)
}

/// KL(p ‖ q) in nats, from log-probabilities; never negative (rounding can push it below 0).
#[must_use]
pub fn kl_divergence(log_p: &[f32], log_q: &[f32]) -> f64 {
    let kld: f64 = log_p
        .iter()
        .zip(log_q)
        .map(|(&p, &q)| f64::from(p).exp() * (f64::from(p) - f64::from(q)))
        .sum();
    kld.max(0.0)
}

/// One position's scores: each configuration's negative log-likelihood of the next token, their
/// distributions' KL divergence and whether their top tokens agree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PositionScore {
    pub nll_reference: f64,
    pub nll_candidate: f64,
    /// KL(reference ‖ candidate) in nats
    pub kld: f64,
    pub top1_same: bool,
}

impl PositionScore {
    /// Scores the position whose next token is `next` from both log-probability vectors.
    ///
    /// # Panics
    /// When `next` is not an index of the vectors.
    #[must_use]
    pub fn new(reference: &[f32], candidate: &[f32], next: usize) -> Self {
        Self {
            nll_reference: -f64::from(reference[next]),
            nll_candidate: -f64::from(candidate[next]),
            kld: kl_divergence(reference, candidate),
            top1_same: argmax(reference) == argmax(candidate),
        }
    }
}

/// Per-position scores of a reference (full attention) against a candidate (H2O).
#[derive(Debug, Default, Clone)]
pub struct Scores {
    nll_reference: Vec<f64>,
    nll_candidate: Vec<f64>,
    /// KL(reference ‖ candidate) in nats
    kld: Vec<f64>,
    top1_same: Vec<bool>,
}

impl Scores {
    /// Adds one position's scores.
    pub fn push(&mut self, p: PositionScore) {
        self.nll_reference.push(p.nll_reference);
        self.nll_candidate.push(p.nll_candidate);
        self.kld.push(p.kld);
        self.top1_same.push(p.top1_same);
    }

    /// Scores the position whose next token is `next` (see [`PositionScore::new`]) and adds it.
    ///
    /// # Panics
    /// When `next` is not an index of the vectors.
    pub fn add(&mut self, reference: &[f32], candidate: &[f32], next: usize) {
        self.push(PositionScore::new(reference, candidate, next));
    }

    /// Positions scored so far.
    #[must_use]
    pub fn len(&self) -> usize {
        self.nll_reference.len()
    }

    /// Whether no position was scored.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.nll_reference.is_empty()
    }

    /// Perplexities, KLD statistics and top-1 agreement over the scored positions.
    #[must_use]
    pub fn summary(&self) -> Summary {
        let n = self.len().max(1) as f64;
        let ppl = |nll: &[f64]| (nll.iter().sum::<f64>() / n).exp();
        let mut kld = self.kld.clone();
        kld.sort_by(f64::total_cmp);
        let quantile = |q: f64| {
            if kld.is_empty() {
                0.0
            } else {
                kld[((kld.len() - 1) as f64 * q).round() as usize]
            }
        };
        let (ppl_full, ppl_h2o) = (ppl(&self.nll_reference), ppl(&self.nll_candidate));
        Summary {
            positions: self.len(),
            ppl_full,
            ppl_h2o,
            delta_ppl_percent: (ppl_h2o / ppl_full - 1.0) * 100.0,
            kld_mean: self.kld.iter().sum::<f64>() / n,
            kld_median: quantile(0.5),
            kld_p99: quantile(0.99),
            kld_max: quantile(1.0),
            top1_agreement_percent: 100.0 * self.top1_same.iter().filter(|&&x| x).count() as f64
                / n,
        }
    }
}

/// What [`Scores::summary`] reports (field names as in `h2o-cli perplexity --json`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Summary {
    pub positions: usize,
    /// Perplexity of the reference (full attention).
    pub ppl_full: f64,
    /// Perplexity of the candidate (H2O).
    pub ppl_h2o: f64,
    /// (ppl_h2o / ppl_full − 1) × 100
    pub delta_ppl_percent: f64,
    pub kld_mean: f64,
    pub kld_median: f64,
    pub kld_p99: f64,
    pub kld_max: f64,
    pub top1_agreement_percent: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_normalises_and_keeps_the_order() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f64 = lp.iter().map(|&x| f64::from(x).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(lp[0] < lp[1] && lp[1] < lp[2]);
        assert_eq!(argmax(&lp), 2);
        // large logits do not overflow
        assert!(log_softmax(&[1e30, 0.0]).iter().all(|x| x.is_finite()));
    }

    #[test]
    fn identical_distributions_score_zero_divergence_and_agree() {
        let lp = log_softmax(&[0.5, -1.0, 2.0, 0.0]);
        let mut s = Scores::default();
        s.add(&lp, &lp, 2);
        s.add(&lp, &lp, 0);
        let sum = s.summary();
        assert_eq!(sum.positions, 2);
        assert_eq!(sum.kld_max, 0.0);
        assert_eq!(sum.delta_ppl_percent, 0.0);
        assert_eq!(sum.top1_agreement_percent, 100.0);
        // perplexity = exp(mean nll)
        let want = ((-f64::from(lp[2]) - f64::from(lp[0])) / 2.0).exp();
        assert!((sum.ppl_full - want).abs() < 1e-9);
    }

    #[test]
    fn a_worse_candidate_has_higher_perplexity_and_positive_divergence() {
        let reference = log_softmax(&[3.0, 0.0, 0.0]);
        let candidate = log_softmax(&[0.0, 3.0, 0.0]);
        let mut s = Scores::default();
        s.add(&reference, &candidate, 0);
        let sum = s.summary();
        assert!(sum.ppl_h2o > sum.ppl_full);
        assert!(sum.kld_mean > 0.0);
        assert_eq!(sum.top1_agreement_percent, 0.0);
        // KL(p||q) by hand
        let kl: f64 = (0..3)
            .map(|i| {
                let p = f64::from(reference[i]);
                p.exp() * (p - f64::from(candidate[i]))
            })
            .sum();
        assert!((sum.kld_mean - kl).abs() < 1e-9);
    }

    #[test]
    fn no_positions_give_a_summary_without_nan() {
        let sum = Scores::default().summary();
        assert_eq!(sum.positions, 0);
        assert_eq!(sum.kld_p99, 0.0);
        assert!(!sum.kld_mean.is_nan());
    }
}
