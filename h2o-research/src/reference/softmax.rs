//! Softmax attention over explicit key sets, and the exact merge of two partial softmaxes
//! (the online-softmax merge): the arithmetic every part of the reference shares.

/// Unnormalised softmax state of one query row over some keys: running max `m`, sum of
/// `exp(logit − m)` `l`, and `o = Σ exp(logit − m) · v`.
#[derive(Debug, Clone, PartialEq)]
pub struct PartialSoftmax {
    pub m: f64,
    pub l: f64,
    pub o: Vec<f64>,
}

impl PartialSoftmax {
    /// The state of attending to no key: contributes nothing to a merge.
    #[must_use]
    pub fn empty(dv: usize) -> Self {
        Self {
            m: f64::NEG_INFINITY,
            l: 0.0,
            o: vec![0.0; dv],
        }
    }

    /// The normalised output `o / l`.
    #[must_use]
    pub fn output(&self) -> Vec<f64> {
        self.o.iter().map(|x| x / self.l).collect()
    }
}

/// Exact merge of two partial softmaxes over disjoint key sets (the online-softmax merge).
#[must_use]
pub fn merge_partial_softmax(a: &PartialSoftmax, b: &PartialSoftmax) -> PartialSoftmax {
    if a.l == 0.0 {
        return b.clone();
    }
    if b.l == 0.0 {
        return a.clone();
    }
    let m = a.m.max(b.m);
    let (wa, wb) = ((a.m - m).exp(), (b.m - m).exp());
    PartialSoftmax {
        m,
        l: a.l * wa + b.l * wb,
        o: a.o.iter().zip(&b.o).map(|(x, y)| x * wa + y * wb).collect(),
    }
}
/// Row-major matrix of `rows × cols`.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f64>,
}

impl Matrix {
    #[must_use]
    pub fn new(rows: usize, cols: usize, data: Vec<f64>) -> Self {
        assert_eq!(data.len(), rows * cols, "matrix data has the wrong length");
        Self { rows, cols, data }
    }

    #[must_use]
    pub fn row(&self, r: usize) -> &[f64] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

pub(crate) fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// How a query's logit for a key is formed: `x = scale · q·k`, then, when `softcap > 0`
/// (Gemma 2), `softcap · tanh(x / softcap)`, as ggml's flash attention and the H2O op do. A bare
/// `f64` converts to the scale alone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Logits {
    pub scale: f64,
    /// 0: no soft-capping.
    pub softcap: f64,
}

impl Logits {
    #[must_use]
    pub fn logit(&self, q: &[f64], k: &[f64]) -> f64 {
        let x = self.scale * dot(q, k);
        if self.softcap > 0.0 {
            self.softcap * (x / self.softcap).tanh()
        } else {
            x
        }
    }
}

impl From<f64> for Logits {
    fn from(scale: f64) -> Self {
        Self {
            scale,
            softcap: 0.0,
        }
    }
}
/// Softmax of query `i` over `keys`: the partial state and the attention weights (one per key).
pub(crate) fn attend(
    q: &[f64],
    k: &Matrix,
    v: &Matrix,
    logits: Logits,
    keys: &[usize],
) -> (PartialSoftmax, Vec<f64>) {
    if keys.is_empty() {
        return (PartialSoftmax::empty(v.cols), vec![]);
    }
    let logits: Vec<f64> = keys.iter().map(|&j| logits.logit(q, k.row(j))).collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = p.iter().sum();
    let mut o = vec![0.0; v.cols];
    for (&j, &pj) in keys.iter().zip(&p) {
        for (od, vd) in o.iter_mut().zip(v.row(j)) {
            *od += pj * vd;
        }
    }
    let weights = p.iter().map(|x| x / l).collect();
    (PartialSoftmax { m, l, o }, weights)
}

/// Dense softmax attention of each query `i` over the explicit key set `key_sets[i]`.
#[must_use]
pub fn dense_attention(
    q: &Matrix,
    k: &Matrix,
    v: &Matrix,
    logits: impl Into<Logits>,
    key_sets: &[Vec<usize>],
) -> Matrix {
    let logits = logits.into();
    let mut out = Vec::with_capacity(q.rows * v.cols);
    for (i, keys) in key_sets.iter().enumerate() {
        out.extend(attend(q.row(i), k, v, logits, keys).0.output());
    }
    Matrix::new(q.rows, v.cols, out)
}

/// A learned attention sink (gpt-oss) on an attention output: each query's `sink` logit joins
/// the softmax denominator of its keys (`key_sets[i]`, as [`HeadResult::key_sets`] lists them),
/// so its output row shrinks by `Z / (Z + e^sink)`, `Z = Σ_keys e^logit`. The sink is no key: the
/// scores and memory sets do not change.
///
/// [`HeadResult::key_sets`]: super::HeadResult::key_sets
pub fn apply_sink(
    output: &mut Matrix,
    q: &Matrix,
    k: &Matrix,
    logits: impl Into<Logits>,
    key_sets: &[Vec<usize>],
    sink: f64,
) {
    let logits = logits.into();
    for (i, keys) in key_sets.iter().enumerate() {
        let x: Vec<f64> = keys
            .iter()
            .map(|&j| logits.logit(q.row(i), k.row(j)))
            .collect();
        let m = x.iter().copied().fold(sink, f64::max);
        let z: f64 = x.iter().map(|x| (x - m).exp()).sum();
        let keep = z / (z + (sink - m).exp());
        for o in &mut output.data[i * output.cols..(i + 1) * output.cols] {
            *o *= keep;
        }
    }
}
