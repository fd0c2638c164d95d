//! Plain reference implementation of H2O chunked sparse attention (SPEC.md items 1–7), in
//! f64, written for readability: the engine's results are checked against it.
//!
//! One attention head at a time; [`h2o_attention`] maps query heads to KV heads (GQA).
//! For chunk `c` (positions `[cS, min((c+1)S, N))`), query `i` attends to the causal keys of its
//! own chunk (intra) and to the memory set `M_{c-1}` (inter). The two partial softmaxes are
//! merged exactly. Scores start as column sums of the intra attention and grow by the column
//! sums of the inter attention; after each chunk but the last, the memory set is rebuilt from
//! the last `L` positions plus the `H` best-scoring other candidates (the seed rule, with
//! optional sinks). The other policies choose chunk `c`'s memory from its own queries when it
//! starts ([`select_by_query`]); queries of the dense tail attend to every earlier position.

use std::ops::Range;

mod select;

pub use crate::session::Selection;
pub use select::{
    query_sample, select_by_query, QuerySelection, SAMPLE_LAST, SAMPLE_STRIDE, SELECT_BLOCK,
};

/// H2O parameters: chunk size S (`n_ubatch`), local window L, heavy budget H, and how the heavy
/// part is chosen (`select`, with `sink` positions always kept inside H); queries from
/// `tail_start` on are the dense tail (full attention, no scores). `H2oParams { chunk, local,
/// heavy, ..Default::default() }` is the seed rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct H2oParams {
    pub chunk: usize,
    pub local: usize,
    pub heavy: usize,
    pub select: Selection,
    pub sink: usize,
    pub tail_start: Option<usize>,
}

impl H2oParams {
    /// M = L + H.
    #[must_use]
    pub fn memory_size(&self) -> usize {
        self.local + self.heavy
    }
}

/// Chunk `c` holds positions `[cS, min((c+1)S, n))` (SPEC item 1).
#[must_use]
pub fn chunk_bounds(n_tokens: usize, chunk: usize) -> Vec<Range<usize>> {
    assert!(chunk > 0, "chunk size must be positive");
    (0..n_tokens.div_ceil(chunk))
        .map(|c| c * chunk..((c + 1) * chunk).min(n_tokens))
        .collect()
}

/// A memory set as stored by the engine: `M` slots of ascending positions, unused slots −1.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemorySet {
    pub slots: Vec<i32>,
}

impl MemorySet {
    /// The positions in use, ascending.
    pub fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().filter(|&&p| p >= 0).map(|&p| p as usize)
    }
}

/// Builds `M_c` after a chunk ending at `chunk_end` (SPEC item 5): `Local = [max(end − L, 0), end)`;
/// `Sink = [0, sink)` minus Local; candidates = (previous memory ∪ this chunk) \ (Local ∪ Sink);
/// `Heavy` = the `H − |Sink|` candidates with the highest score, ties to the lower position;
/// result sorted, padded with −1 to `M` slots.
#[must_use]
pub fn build_memory_set(
    params: &H2oParams,
    previous: Option<&MemorySet>,
    chunk: Range<usize>,
    scores: &[f64],
) -> MemorySet {
    let local = chunk.end.saturating_sub(params.local)..chunk.end;
    let sink = 0..params.sink.min(local.start);
    let mut candidates: Vec<usize> = previous
        .into_iter()
        .flat_map(MemorySet::positions)
        .chain(chunk.clone())
        .collect();
    candidates.sort_unstable();
    candidates.dedup();
    candidates.retain(|p| !local.contains(p) && !sink.contains(p));
    // Highest score first; equal scores: lower position first.
    candidates.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    candidates.truncate(params.heavy - sink.len());
    let mut positions: Vec<usize> = local.chain(sink).chain(candidates).collect();
    positions.sort_unstable();
    let mut slots: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    slots.resize(params.memory_size(), -1);
    MemorySet { slots }
}

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

/// Exact merge of two partial softmaxes over disjoint key sets (seed 002, Alg. 1).
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

/// Softmax of query `i` over `keys`: the partial state and the attention weights (one per key).
fn attend(
    q: &[f64],
    k: &Matrix,
    v: &Matrix,
    scale: f64,
    keys: &[usize],
) -> (PartialSoftmax, Vec<f64>) {
    if keys.is_empty() {
        return (PartialSoftmax::empty(v.cols), vec![]);
    }
    let logits: Vec<f64> = keys.iter().map(|&j| scale * dot(q, k.row(j))).collect();
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

/// Everything the method produces for one head.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadResult {
    /// `N × dv` attention output.
    pub output: Matrix,
    /// `memory_sets[c]` = `M_c`, built after chunk `c`, for every chunk but the last.
    pub memory_sets: Vec<MemorySet>,
    /// Final accumulated score of every position.
    pub scores: Vec<f64>,
    /// `build_scores[c]`: the scores `memory_sets[c]` was built from (after chunk `c`).
    pub build_scores: Vec<Vec<f64>>,
    /// The key set each query attended to (for checks against dense attention).
    pub key_sets: Vec<Vec<usize>>,
}

/// H2O attention of one query head against its KV head (SPEC items 1–6).
/// `q`, `k`: `N × d`; `v`: `N × dv`; `scale` is the logit scale (1/√d usually).
#[must_use]
pub fn h2o_attention_head(
    q: &Matrix,
    k: &Matrix,
    v: &Matrix,
    scale: f64,
    params: &H2oParams,
) -> HeadResult {
    h2o_attention_head_given_memory(q, k, v, scale, params, &[])
}

/// [`h2o_attention_head`], except that chunk `c + 1` attends to `given[c]` instead of the
/// reference's own `M_c` wherever `given` has one. The result's `memory_sets` are still the
/// reference's own builds, from the scores that history produced.
///
/// This is how an engine whose scores are rounded (BF16) is checked without one near-tie
/// swap spreading to every later chunk: feed its memory sets in, compare each chunk's output
/// with the engine's, and each of its memory sets with the build from the same history.
#[must_use]
pub fn h2o_attention_head_given_memory(
    q: &Matrix,
    k: &Matrix,
    v: &Matrix,
    scale: f64,
    params: &H2oParams,
    given: &[MemorySet],
) -> HeadResult {
    let n = q.rows;
    assert!(
        k.rows == n && v.rows == n && k.cols == q.cols,
        "q, k, v disagree in shape"
    );
    let mut output = Matrix::new(n, v.cols, vec![0.0; n * v.cols]);
    let mut scores = vec![0.0; n];
    let mut memory_sets: Vec<MemorySet> = Vec::new();
    let mut build_scores = Vec::new();
    // the memory set the next chunk attends to: given, or else the reference's own
    let mut attended: Option<MemorySet> = None;
    let mut key_sets = Vec::with_capacity(n);
    let chunks = chunk_bounds(n, params.chunk);
    let by_query = params.select != Selection::H2o;
    let tail_start = params.tail_start.unwrap_or(usize::MAX);
    for (c, chunk) in chunks.iter().enumerate() {
        if c >= 1 && by_query {
            let sample = query_sample(chunk.clone());
            memory_sets
                .push(select_by_query(params, q, k, scale, chunk.start, &sample, &scores).set);
            build_scores.push(scores.clone());
        }
        if c >= 1 {
            attended = Some(given.get(c - 1).unwrap_or(&memory_sets[c - 1]).clone());
        }
        let memory: Vec<usize> = attended
            .as_ref()
            .map(|m| m.positions().collect())
            .unwrap_or_default();
        for i in chunk.clone() {
            if i >= tail_start {
                // the dense tail: every position up to i, no scores
                let keys: Vec<usize> = (0..=i).collect();
                let (all, _) = attend(q.row(i), k, v, scale, &keys);
                output.data[i * v.cols..(i + 1) * v.cols].copy_from_slice(&all.output());
                key_sets.push(keys);
                continue;
            }
            let intra_keys: Vec<usize> = (chunk.start..=i).collect();
            let (intra, a_intra) = attend(q.row(i), k, v, scale, &intra_keys);
            let (inter, a_inter) = attend(q.row(i), k, v, scale, &memory);
            // Scores: intra column sums (init), then inter column sums (accumulate) — each
            // softmax normalised over its own key set (SPEC item 4).
            for (&j, w) in intra_keys.iter().zip(&a_intra) {
                scores[j] += w;
            }
            for (&j, w) in memory.iter().zip(&a_inter) {
                scores[j] += w;
            }
            let merged = merge_partial_softmax(&intra, &inter);
            output.data[i * v.cols..(i + 1) * v.cols].copy_from_slice(&merged.output());
            key_sets.push(memory.iter().copied().chain(intra_keys).collect());
        }
        if c + 1 < chunks.len() && !by_query {
            let set = build_memory_set(params, attended.as_ref(), chunk.clone(), &scores);
            memory_sets.push(set);
            build_scores.push(scores.clone());
        }
    }
    HeadResult {
        output,
        memory_sets,
        scores,
        build_scores,
        key_sets,
    }
}

/// H2O attention for all query heads; `q[h]` uses KV head `h / (n_head / n_head_kv)` (GQA).
///
/// # Panics
/// If `q.len()` is not a multiple of `k.len()` or `k.len() != v.len()`.
#[must_use]
pub fn h2o_attention(
    q: &[Matrix],
    k: &[Matrix],
    v: &[Matrix],
    scale: f64,
    params: &H2oParams,
) -> Vec<HeadResult> {
    assert!(
        !k.is_empty() && k.len() == v.len() && q.len().is_multiple_of(k.len()),
        "bad head counts"
    );
    let group = q.len() / k.len();
    q.iter()
        .enumerate()
        .map(|(h, qh)| h2o_attention_head(qh, &k[h / group], &v[h / group], scale, params))
        .collect()
}

/// Dense softmax attention of each query `i` over the explicit key set `key_sets[i]`.
#[must_use]
pub fn dense_attention(
    q: &Matrix,
    k: &Matrix,
    v: &Matrix,
    scale: f64,
    key_sets: &[Vec<usize>],
) -> Matrix {
    let mut out = Vec::with_capacity(q.rows * v.cols);
    for (i, keys) in key_sets.iter().enumerate() {
        out.extend(attend(q.row(i), k, v, scale, keys).0.output());
    }
    Matrix::new(q.rows, v.cols, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        }
        fn matrix(&mut self, rows: usize, cols: usize, amp: f64) -> Matrix {
            Matrix::new(
                rows,
                cols,
                (0..rows * cols).map(|_| amp * self.next()).collect(),
            )
        }
    }

    const D: usize = 8;

    fn max_abs_diff(a: &Matrix, b: &Matrix) -> f64 {
        a.data
            .iter()
            .zip(&b.data)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    fn run(n: usize, params: H2oParams, seed: u64) -> (Matrix, Matrix, Matrix, HeadResult) {
        let mut rng = Rng(seed);
        // Amplitude 2 makes attention peaked enough for selections to depend on the data.
        let (q, k, v) = (
            rng.matrix(n, D, 2.0),
            rng.matrix(n, D, 2.0),
            rng.matrix(n, D, 1.0),
        );
        let r = h2o_attention_head(&q, &k, &v, 1.0 / (D as f64).sqrt(), &params);
        (q, k, v, r)
    }

    /// The key sets written out from the SPEC, independently of the implementation.
    fn expected_key_sets(n: usize, s: usize, memory_sets: &[MemorySet]) -> Vec<Vec<usize>> {
        (0..n)
            .map(|i| {
                let c = i / s;
                let mut keys: Vec<usize> = if c == 0 {
                    vec![]
                } else {
                    memory_sets[c - 1].positions().collect()
                };
                keys.extend(c * s..=i);
                keys
            })
            .collect()
    }

    fn assert_matches_dense(n: usize, params: H2oParams, seed: u64) -> HeadResult {
        let (q, k, v, r) = run(n, params, seed);
        let sets = expected_key_sets(n, params.chunk, &r.memory_sets);
        assert_eq!(r.key_sets, sets);
        let dense = dense_attention(&q, &k, &v, 1.0 / (D as f64).sqrt(), &sets);
        let err = max_abs_diff(&r.output, &dense);
        assert!(
            err < 1e-12,
            "n={n} {params:?}: merged output differs from dense by {err}"
        );
        // Memory-set invariants: M slots, ascending, in range, before the next chunk, padded with -1 only at the end.
        for (c, m) in r.memory_sets.iter().enumerate() {
            assert_eq!(m.slots.len(), params.memory_size());
            let pos: Vec<usize> = m.positions().collect();
            assert!(
                pos.windows(2).all(|w| w[0] < w[1]),
                "not sorted: {:?}",
                m.slots
            );
            assert!(pos.iter().all(|&p| p < (c + 1) * params.chunk));
            assert!(m.slots.iter().skip(pos.len()).all(|&s| s == -1));
            let end = (c + 1) * params.chunk;
            let local: Vec<usize> = (end.saturating_sub(params.local)..end).collect();
            assert!(
                local.iter().all(|p| pos.contains(p)),
                "local window missing from {:?}",
                m.slots
            );
        }
        r
    }

    #[test]
    fn every_policy_attends_to_its_key_sets_and_the_tail_to_everything() {
        for select in Selection::ALL {
            for (sink, tail) in [(0, None), (3, None), (3, Some(70))] {
                let n = 80;
                let params = H2oParams {
                    chunk: 16,
                    local: 4,
                    heavy: 6,
                    select,
                    sink,
                    tail_start: tail,
                };
                let (q, k, v, r) = run(n, params, 5);
                let mut sets = expected_key_sets(n, params.chunk, &r.memory_sets);
                for (i, keys) in sets.iter_mut().enumerate() {
                    if tail.is_some_and(|t| i >= t) {
                        *keys = (0..=i).collect();
                    }
                }
                assert_eq!(r.key_sets, sets, "{select} sink {sink} tail {tail:?}");
                let dense = dense_attention(&q, &k, &v, 1.0 / (D as f64).sqrt(), &sets);
                assert!(max_abs_diff(&r.output, &dense) < 1e-12);
                for (c, m) in r.memory_sets.iter().enumerate() {
                    let pos: Vec<usize> = m.positions().collect();
                    assert_eq!(pos.len(), 10, "{select} chunk {c}: {pos:?}");
                    assert!(
                        (0..sink).all(|p| pos.contains(&p)),
                        "{select}: sinks missing"
                    );
                }
            }
        }
    }

    #[test]
    fn chunk_bounds_are_position_aligned() {
        assert_eq!(chunk_bounds(10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(chunk_bounds(8, 4), vec![0..4, 4..8]);
        assert_eq!(chunk_bounds(3, 4), vec![0..3]);
        assert!(chunk_bounds(0, 4).is_empty());
    }

    #[test]
    fn merge_is_exact() {
        let mut rng = Rng(3);
        let (q, k, v) = (
            rng.matrix(1, D, 3.0),
            rng.matrix(10, D, 3.0),
            rng.matrix(10, 5, 1.0),
        );
        let all: Vec<usize> = (0..10).collect();
        let (whole, _) = attend(q.row(0), &k, &v, 0.5, &all);
        let (a, _) = attend(q.row(0), &k, &v, 0.5, &all[..3]);
        let (b, _) = attend(q.row(0), &k, &v, 0.5, &all[3..]);
        let merged = merge_partial_softmax(&a, &b);
        for (x, y) in merged.output().iter().zip(whole.output()) {
            assert!((x - y).abs() < 1e-14);
        }
        let e = PartialSoftmax::empty(5);
        assert_eq!(merge_partial_softmax(&e, &a), a);
        assert_eq!(merge_partial_softmax(&a, &e), a);
    }

    #[test]
    fn single_chunk_is_plain_causal_attention() {
        // N = S and N < S: one chunk, no memory, exactly stock's key set (SPEC item 8).
        for n in [16, 11] {
            let r = assert_matches_dense(
                n,
                H2oParams {
                    chunk: 16,
                    local: 4,
                    heavy: 4,
                    ..Default::default()
                },
                1,
            );
            assert!(r.memory_sets.is_empty());
            assert!(r
                .key_sets
                .iter()
                .enumerate()
                .all(|(i, ks)| *ks == (0..=i).collect::<Vec<_>>()));
        }
    }

    #[test]
    fn chunk_zero_partial_last_chunk_and_two_s_minus_one() {
        let p = H2oParams {
            chunk: 16,
            local: 4,
            heavy: 4,
            ..Default::default()
        };
        for n in [31, 32, 33, 50, 64] {
            let r = assert_matches_dense(n, p, 7 + n as u64);
            assert_eq!(r.memory_sets.len(), n.div_ceil(16) - 1);
            // Chunk 0 never sees memory.
            assert!((0..16.min(n)).all(|i| r.key_sets[i] == (0..=i).collect::<Vec<_>>()));
        }
    }

    #[test]
    fn local_only_heavy_only_and_memory_close_to_chunk() {
        for p in [
            H2oParams {
                chunk: 16,
                local: 0,
                heavy: 6,
                ..Default::default()
            },
            H2oParams {
                chunk: 16,
                local: 6,
                heavy: 0,
                ..Default::default()
            },
            H2oParams {
                chunk: 16,
                local: 7,
                heavy: 8,
                ..Default::default()
            }, // M = S - 1
            H2oParams {
                chunk: 16,
                local: 1,
                heavy: 14,
                ..Default::default()
            },
        ] {
            let r = assert_matches_dense(70, p, 11);
            for m in &r.memory_sets {
                let used = m.positions().count();
                assert_eq!(
                    used,
                    p.memory_size(),
                    "{p:?}: enough candidates exist, so every slot is used"
                );
            }
            if p.heavy == 0 {
                // Local only: memory = last L positions of the previous chunk.
                for (c, m) in r.memory_sets.iter().enumerate() {
                    let end = (c + 1) * 16;
                    assert_eq!(
                        m.positions().collect::<Vec<_>>(),
                        (end - p.local..end).collect::<Vec<_>>()
                    );
                }
            }
        }
    }

    #[test]
    fn scores_follow_the_spec_definition() {
        let p = H2oParams {
            chunk: 8,
            local: 2,
            heavy: 3,
            ..Default::default()
        };
        let (_, _, _, r) = run(20, p, 5);
        // Every softmax row sums to 1: intra contributes |C_c| per chunk, inter |C_c| when
        // the memory is non-empty (chunks >= 1).
        let chunks = chunk_bounds(20, 8);
        let total: f64 = r.scores.iter().sum();
        let expected: f64 = chunks
            .iter()
            .enumerate()
            .map(|(c, ch)| ch.len() as f64 * if c == 0 { 1.0 } else { 2.0 })
            .sum();
        assert!((total - expected).abs() < 1e-9, "{total} vs {expected}");
        // The last query of a chunk attends to itself only through the intra part: s(j) >= A(j, j) > 0.
        assert!(r.scores.iter().all(|&s| s > 0.0));
    }

    #[test]
    fn heavy_hitters_are_the_top_scores_with_ties_to_lower_positions() {
        let p = H2oParams {
            chunk: 8,
            local: 2,
            heavy: 3,
            ..Default::default()
        };
        let mut scores = vec![0.0; 16];
        for (pos, s) in [
            (1, 5.0),
            (3, 5.0),
            (5, 9.0),
            (2, 1.0),
            (6, 100.0),
            (7, 100.0),
        ] {
            scores[pos] = s;
        }
        // Positions 6, 7 are local (end 8, L 2); heavy = 5 (9.0), then 1 and 3 tie at 5.0: both fit.
        let m = build_memory_set(&p, None, 0..8, &scores);
        assert_eq!(m.slots, vec![1, 3, 5, 6, 7]);
        // Ties beyond the budget go to the lower position.
        let p2 = H2oParams { heavy: 2, ..p };
        assert_eq!(
            build_memory_set(&p2, None, 0..8, &scores).slots,
            vec![1, 5, 6, 7]
        );
        // All-equal scores: the lowest positions win.
        let flat = vec![0.5; 16];
        assert_eq!(
            build_memory_set(&p, None, 0..8, &flat).slots,
            vec![0, 1, 2, 6, 7]
        );
        // Survival across chunks: a previous heavy hitter stays a candidate; the old local window too.
        let prev = MemorySet {
            slots: vec![1, 3, 5, 6, 7],
        };
        let mut s2 = scores.clone();
        s2[12] = 50.0;
        let m2 = build_memory_set(&p, Some(&prev), 8..16, &s2);
        assert_eq!(
            m2.slots,
            vec![6, 7, 12, 14, 15],
            "top scores among memory ∪ chunk: 6, 7 (100), 12 (50)"
        );
        // Too few candidates: unused slots are -1.
        let p3 = H2oParams {
            chunk: 8,
            local: 2,
            heavy: 5,
            ..Default::default()
        };
        assert_eq!(
            build_memory_set(&p3, None, 0..4, &flat).slots,
            vec![0, 1, 2, 3, -1, -1, -1]
        );
    }

    #[test]
    fn gqa_heads_share_kv_and_select_per_head() {
        let (n, n_head, n_head_kv) = (60, 6, 2);
        let mut rng = Rng(99);
        let q: Vec<Matrix> = (0..n_head).map(|_| rng.matrix(n, D, 2.5)).collect();
        let k: Vec<Matrix> = (0..n_head_kv).map(|_| rng.matrix(n, D, 2.5)).collect();
        let v: Vec<Matrix> = (0..n_head_kv).map(|_| rng.matrix(n, D, 1.0)).collect();
        let p = H2oParams {
            chunk: 16,
            local: 3,
            heavy: 5,
            ..Default::default()
        };
        let scale = 1.0 / (D as f64).sqrt();
        let results = h2o_attention(&q, &k, &v, scale, &p);
        for (h, r) in results.iter().enumerate() {
            let kv = h / (n_head / n_head_kv);
            // Each head equals the single-head computation against its KV head.
            assert_eq!(*r, h2o_attention_head(&q[h], &k[kv], &v[kv], scale, &p));
            let dense = dense_attention(&q[h], &k[kv], &v[kv], scale, &r.key_sets);
            assert!(max_abs_diff(&r.output, &dense) < 1e-12);
        }
        // Selection is per query head: heads sharing a KV head still pick different heavy hitters.
        let distinct: std::collections::HashSet<_> =
            results.iter().map(|r| r.memory_sets.clone()).collect();
        assert!(distinct.len() > 1, "all heads selected the same memory");
        assert_ne!(
            results[0].memory_sets, results[1].memory_sets,
            "heads 0 and 1 share KV head 0 but should differ"
        );
    }
}
