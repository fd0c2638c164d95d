//! What the study's estimators believe each far position receives, from summaries a kernel
//! could keep or compute: per-block mean keys and key bounds, keys in a few principal
//! directions, antidiagonal samples of the logits, and SparQ's largest query channels.
//! [`super::strategies::rank`] turns these into rankings.

use std::ops::Range;

use super::attention::dot;
use super::strategies::SAMPLE_EVERY;
use super::{DenseLayer, StudyConfig};

/// Per-block summaries of one layer's keys, made once per layer: the mean key (by prefix sums,
/// so that a partial block inside the chunk has one too) and per-channel bounds of every
/// aligned block of `block` positions, per KV head.
pub struct BlockSummaries {
    /// `[kv head][position + 1][d]`: Σ of the keys before the position.
    prefix: Vec<Vec<f32>>,
    /// `[kv head][block][d]` minimum and maximum.
    lo: Vec<Vec<f32>>,
    hi: Vec<Vec<f32>>,
    /// `[kv head][position][LOW_RANK_MAX]`: each key in the leading principal directions of the
    /// first chunk's keys; `[kv head][LOW_RANK_MAX][d]` those directions.
    projected: Vec<Vec<f32>>,
    basis: Vec<Vec<f32>>,
}

/// The most principal directions [`super::Strategy::SampledLowRank`] may use.
const LOW_RANK_MAX: usize = 32;

impl BlockSummaries {
    #[must_use]
    pub fn of(layer: &DenseLayer, block: usize) -> Self {
        let d = layer.head_dim;
        let n = layer.n_pos;
        let mut prefix = Vec::new();
        let mut lo = Vec::new();
        let mut hi = Vec::new();
        for kv in 0..layer.n_head_kv {
            let head = kv * layer.n_head / layer.n_head_kv;
            let mut p = vec![0f32; (n + 1) * d];
            let mut l = vec![f32::INFINITY; n.div_ceil(block) * d];
            let mut h = vec![f32::NEG_INFINITY; n.div_ceil(block) * d];
            for j in 0..n {
                let k = layer.k_row(j, head);
                let b = j / block;
                for t in 0..d {
                    p[(j + 1) * d + t] = p[j * d + t] + k[t];
                    l[b * d + t] = l[b * d + t].min(k[t]);
                    h[b * d + t] = h[b * d + t].max(k[t]);
                }
            }
            prefix.push(p);
            lo.push(l);
            hi.push(h);
        }
        let mut projected = Vec::new();
        let mut basis = Vec::new();
        for kv in 0..layer.n_head_kv {
            let head = kv * layer.n_head / layer.n_head_kv;
            let keys: Vec<&[f32]> = (0..n.min(1024)).map(|j| layer.k_row(j, head)).collect();
            let b = principal_directions(&keys, d, LOW_RANK_MAX.min(d));
            let r = b.len() / d;
            let mut pr = vec![0f32; n * LOW_RANK_MAX];
            for j in 0..n {
                let k = layer.k_row(j, head);
                for t in 0..r {
                    pr[j * LOW_RANK_MAX + t] = dot(k, &b[t * d..(t + 1) * d]);
                }
            }
            projected.push(pr);
            basis.push(b);
        }
        Self {
            prefix,
            lo,
            hi,
            projected,
            basis,
        }
    }

    /// Per far position, Σ over the sampled rows of its attention when every logit is computed in
    /// the first `rank` principal directions (a softmax over all keys up to the query).
    pub(super) fn low_rank_masses(
        &self,
        layer: &DenseLayer,
        head: usize,
        start: usize,
        sampled: &[usize],
        rank: usize,
    ) -> Vec<f64> {
        let d = layer.head_dim;
        let kv = layer.kv_head(head);
        let (pr, b) = (&self.projected[kv], &self.basis[kv]);
        let rank = rank.min(b.len() / d);
        let mut masses = vec![0f64; start];
        let mut q = vec![0f32; rank];
        let mut logits = Vec::new();
        for &r in sampled {
            let i = start + r;
            let qr = layer.q_row(i, head);
            for (t, x) in q.iter_mut().enumerate() {
                *x = dot(qr, &b[t * d..(t + 1) * d]);
            }
            logits.clear();
            logits
                .extend((0..=i).map(|j| {
                    layer.scale * dot(&q, &pr[j * LOW_RANK_MAX..j * LOW_RANK_MAX + rank])
                }));
            let w = softmax(&logits);
            for (m, x) in masses.iter_mut().zip(&w[..start]) {
                *m += x;
            }
        }
        masses
    }

    fn mean(&self, layer: &DenseLayer, head: usize, range: Range<usize>, out: &mut [f32]) {
        let d = layer.head_dim;
        let p = &self.prefix[layer.kv_head(head)];
        let n = range.len() as f32;
        for t in 0..d {
            out[t] = (p[range.end * d + t] - p[range.start * d + t]) / n;
        }
    }

    /// Per far position, Σ over `rows` of the estimated attention of its block (spread evenly
    /// over the block); and Σ over rows of the estimated attention inside the chunk. Each
    /// query's estimate is a softmax over blocks of `scale·q·mean + ln(size)`: the chunk's
    /// blocks up to the query (the last one partial) and the far blocks.
    pub(super) fn mean_key_masses(
        &self,
        c: &StudyConfig,
        layer: &DenseLayer,
        head: usize,
        start: usize,
        rows: Range<usize>,
    ) -> (Vec<f64>, f64) {
        let d = layer.head_dim;
        let far_blocks: Vec<Range<usize>> = (0..start)
            .step_by(c.block)
            .map(|b| b..(b + c.block).min(start))
            .collect();
        let mut means = vec![0f32; far_blocks.len() * d];
        for (b, r) in far_blocks.iter().enumerate() {
            self.mean(layer, head, r.clone(), &mut means[b * d..(b + 1) * d]);
        }
        let mut per_pos = vec![0f64; start];
        let mut intra_total = 0f64;
        let mut mean = vec![0f32; d];
        let mut logits = Vec::new();
        for r in rows {
            let i = start + r;
            let q = layer.q_row(i, head);
            logits.clear();
            for (b, range) in far_blocks.iter().enumerate() {
                let l = layer.scale * dot(q, &means[b * d..(b + 1) * d]);
                logits.push(l + (range.len() as f32).ln());
            }
            let n_far = logits.len();
            for b0 in (start..=i).step_by(c.block) {
                let range = b0..(b0 + c.block).min(i + 1);
                self.mean(layer, head, range.clone(), &mut mean);
                logits.push(layer.scale * dot(q, &mean) + (range.len() as f32).ln());
            }
            let w = softmax(&logits);
            for (b, range) in far_blocks.iter().enumerate() {
                let each = w[b] / range.len() as f64;
                for p in range.clone() {
                    per_pos[p] += each;
                }
            }
            intra_total += w[n_far..].iter().sum::<f64>();
        }
        (per_pos, intra_total)
    }

    /// Per far block, Σ over `queries` of its share in a softmax, over the aligned blocks that
    /// overlap `candidates`, of the bound logits `scale·Σ_d max(q_d·lo_d, q_d·hi_d)` (Quest's
    /// bound; today's `query`); other blocks score 0.
    pub(super) fn bound_shares(
        &self,
        c: &StudyConfig,
        layer: &DenseLayer,
        head: usize,
        start: usize,
        candidates: Range<usize>,
        queries: &[usize],
    ) -> Vec<f64> {
        let d = layer.head_dim;
        let kv = layer.kv_head(head);
        let mut shares = vec![0f64; start.div_ceil(c.block)];
        if candidates.is_empty() {
            return shares;
        }
        let first = candidates.start / c.block;
        let mut logits = vec![0f32; candidates.end.div_ceil(c.block) - first];
        for &r in queries {
            let q = layer.q_row(start + r, head);
            for (b, l) in (first..).zip(logits.iter_mut()) {
                let (lo, hi) = (
                    &self.lo[kv][b * d..(b + 1) * d],
                    &self.hi[kv][b * d..(b + 1) * d],
                );
                let bound: f32 = q
                    .iter()
                    .zip(lo.iter().zip(hi))
                    .map(|(x, (a, b))| (x * a).max(x * b))
                    .sum();
                *l = layer.scale * bound;
            }
            for (s, w) in shares[first..].iter_mut().zip(softmax(&logits)) {
                *s += w;
            }
        }
        shares
    }
}

/// Per far position, Σ over `rows` of its estimated attention when each query sees only the
/// keys `j` with `(i + j) mod 8 = 7` (antidiagonals of 8 × 8 blocks) and a softmax over them;
/// and Σ over rows of the estimated attention inside the chunk.
pub(super) fn antidiagonal_masses(
    layer: &DenseLayer,
    head: usize,
    start: usize,
    rows: Range<usize>,
) -> (Vec<f64>, f64) {
    let mut per_pos = vec![0f64; start];
    let mut intra_total = 0f64;
    let mut keys = Vec::new();
    let mut logits = Vec::new();
    for r in rows {
        let i = start + r;
        let q = layer.q_row(i, head);
        keys.clear();
        logits.clear();
        let first = (SAMPLE_EVERY - 1 + SAMPLE_EVERY - i % SAMPLE_EVERY) % SAMPLE_EVERY;
        for j in (first..=i).step_by(SAMPLE_EVERY) {
            keys.push(j);
            logits.push(layer.scale * dot(q, layer.k_row(j, head)));
        }
        if keys.is_empty() {
            continue;
        }
        let w = softmax(&logits);
        for (&j, &p) in keys.iter().zip(&w) {
            if j < start {
                // the sampled key stands for its stride's neighbours
                for x in &mut per_pos[j.saturating_sub(SAMPLE_EVERY - 1)..=j] {
                    *x += p / SAMPLE_EVERY as f64;
                }
            } else {
                intra_total += p;
            }
        }
    }
    (per_pos, intra_total)
}

/// Per far position, Σ over `rows` of SparQ's estimate of its attention: each query's logits
/// from its `r` largest-magnitude channels, softmax over all keys up to the query at the
/// temperature SparQ corrects by (the share of the query's L1 norm those channels hold).
pub(super) fn sparq_masses(
    layer: &DenseLayer,
    head: usize,
    start: usize,
    rows: Range<usize>,
    r: usize,
) -> Vec<f64> {
    let d = layer.head_dim;
    let mut masses = vec![0f64; start];
    let mut logits = Vec::new();
    for row in rows {
        let i = start + row;
        let q = layer.q_row(i, head);
        let mut ch: Vec<usize> = (0..d).collect();
        ch.sort_by(|&a, &b| q[b].abs().total_cmp(&q[a].abs()));
        ch.truncate(r.min(d));
        let l1: f32 = q.iter().map(|x| x.abs()).sum();
        let l1r: f32 = ch.iter().map(|&t| q[t].abs()).sum();
        // SparQ: softmax(q_r·k_r / sqrt(d · l1r/l1)), the model's scale over sqrt(l1r/l1)
        let scale = layer.scale / (l1r / l1.max(1e-12)).sqrt().max(1e-6);
        logits.clear();
        logits.extend((0..=i).map(|j| {
            let k = layer.k_row(j, head);
            scale * ch.iter().map(|&t| q[t] * k[t]).sum::<f32>()
        }));
        let w = softmax(&logits);
        for (m, x) in masses.iter_mut().zip(&w[..start]) {
            *m += x;
        }
    }
    masses
}

/// The leading `r` eigenvectors (rows, unit length, by descending eigenvalue) of the second
/// moment of `rows` (each of length `d`), by cyclic Jacobi rotations.
fn principal_directions(rows: &[&[f32]], d: usize, r: usize) -> Vec<f32> {
    let mut a = vec![0f64; d * d];
    for x in rows {
        for i in 0..d {
            for j in 0..d {
                a[i * d + j] += f64::from(x[i]) * f64::from(x[j]);
            }
        }
    }
    let mut v = vec![0f64; d * d];
    for i in 0..d {
        v[i * d + i] = 1.0;
    }
    for _sweep in 0..30 {
        let off: f64 = (0..d)
            .flat_map(|i| (0..d).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * d + j] * a[i * d + j])
            .sum();
        if off < 1e-18 {
            break;
        }
        for p in 0..d {
            for q in p + 1..d {
                let apq = a[p * d + q];
                if apq.abs() < 1e-30 {
                    continue;
                }
                let theta = (a[q * d + q] - a[p * d + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..d {
                    let (akp, akq) = (a[k * d + p], a[k * d + q]);
                    a[k * d + p] = c * akp - s * akq;
                    a[k * d + q] = s * akp + c * akq;
                }
                for k in 0..d {
                    let (apk, aqk) = (a[p * d + k], a[q * d + k]);
                    a[p * d + k] = c * apk - s * aqk;
                    a[q * d + k] = s * apk + c * aqk;
                }
                for k in 0..d {
                    let (vkp, vkq) = (v[k * d + p], v[k * d + q]);
                    v[k * d + p] = c * vkp - s * vkq;
                    v[k * d + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&x, &y| a[y * d + y].total_cmp(&a[x * d + x]));
    order
        .into_iter()
        .take(r)
        .flat_map(|col| (0..d).map(|k| v[k * d + col] as f32).collect::<Vec<_>>())
        .collect()
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| f64::from((l - m).exp())).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}
