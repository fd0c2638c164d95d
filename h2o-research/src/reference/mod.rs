//! Plain reference implementation of H2O chunked sparse attention (the seed rule's items 1–7,
//! docs/seed-rule.md), in f64, written for readability: the engine's results are checked against it.
//!
//! One attention head at a time; [`h2o_attention`] maps query heads to KV heads (GQA).
//! For chunk `c` (positions `[cS, min((c+1)S, N))`), query `i` attends to the causal keys of its
//! own chunk (intra) and to the memory set `M_{c-1}` (inter). The two partial softmaxes are
//! merged exactly. Scores start as column sums of the intra attention and grow by the column
//! sums of the inter attention; after each chunk but the last, the memory set is rebuilt from
//! the last `L` positions plus the `H` best-scoring other candidates (the seed rule, with
//! optional sinks). The other policies choose chunk `c`'s memory from its own queries when it
//! starts ([`select_by_query`]); queries of the dense tail attend to every earlier position.

use std::ops::{Range, RangeInclusive};

mod decode;
mod memory;
mod select;
mod softmax;
mod tiles;

pub use decode::{
    bucket_weight, channel_energy, coverage_take, decode_attention, decode_plan, decode_step,
    gap_bucket, sketch_channels, sketch_estimate, sketch_quantize, DecodePlan, DECODE_BLOCK,
};
pub use h2o_llama::Selection;
pub use memory::{build_memory_set, MemorySet};
pub use select::{
    query_sample, select_by_query, QuerySelection, SAMPLE_LAST, SAMPLE_STRIDE, SELECT_BLOCK,
};
pub(crate) use softmax::attend;
pub use softmax::{
    apply_sink, dense_attention, merge_partial_softmax, Logits, Matrix, PartialSoftmax,
};
pub use tiles::{
    h2o_attention_coverage, select_by_tiles, tile_samples, tiles_of, CoverageParams, TileMemory,
    BUDGET_STEP, MAX_HEAVY_FACTOR, TILE,
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

/// Chunk `c` holds positions `[cS, min((c+1)S, n))` (seed rule item 1).
#[must_use]
pub fn chunk_bounds(n_tokens: usize, chunk: usize) -> Vec<Range<usize>> {
    assert!(chunk > 0, "chunk size must be positive");
    (0..n_tokens.div_ceil(chunk))
        .map(|c| c * chunk..((c + 1) * chunk).min(n_tokens))
        .collect()
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

/// H2O attention of one query head against its KV head (seed rule items 1–6).
/// `q`, `k`: `N × d`; `v`: `N × dv`; `logits`: the logit scale (1/√d usually), or [`Logits`]
/// with a soft-cap.
#[must_use]
pub fn h2o_attention_head(
    q: &Matrix,
    k: &Matrix,
    v: &Matrix,
    logits: impl Into<Logits>,
    params: &H2oParams,
) -> HeadResult {
    h2o_attention_head_given_memory(q, k, v, logits, params, &[])
}

/// [`h2o_attention_head`], except that chunk `c + 1` attends to `given[c]` instead of the
/// reference's own `M_c` wherever `given` has one. The result's `memory_sets` are still the
/// reference's own builds, from the scores that history produced.
///
/// This is how an engine whose scores are rounded (BF16) is checked without one near-tie
/// swap spreading to every later chunk: feed its memory sets in, compare each chunk's output
/// with the engine's, and each of its memory sets with the build from the same history.
///
/// # Panics
/// Under [`Selection::Coverage`], whose tiles share one budget across all heads of a layer: its
/// reference is [`h2o_attention_coverage`].
#[must_use]
pub fn h2o_attention_head_given_memory(
    q: &Matrix,
    k: &Matrix,
    v: &Matrix,
    logits: impl Into<Logits>,
    params: &H2oParams,
    given: &[MemorySet],
) -> HeadResult {
    let logits = logits.into();
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
    assert!(
        params.select != Selection::Coverage,
        "coverage selection chooses per tile across heads: use h2o_attention_coverage"
    );
    let by_query = params.select == Selection::Hybrid;
    let tail_start = params.tail_start.unwrap_or(usize::MAX);
    for (c, chunk) in chunks.iter().enumerate() {
        if c >= 1 && by_query {
            let sample = query_sample(chunk.clone());
            memory_sets.push(
                select_by_query(params, q, k, logits.scale, chunk.start, &sample, &scores).set,
            );
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
            let (row, keys) = if i >= tail_start {
                // the dense tail: every position up to i, no scores
                let keys: Vec<usize> = (0..=i).collect();
                (attend(q.row(i), k, v, logits, &keys).0.output(), keys)
            } else {
                attend_chunk_and_memory(
                    q.row(i),
                    k,
                    v,
                    logits,
                    chunk.start..=i,
                    &memory,
                    &mut scores,
                )
            };
            output.data[i * v.cols..(i + 1) * v.cols].copy_from_slice(&row);
            key_sets.push(keys);
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
/// One query of a chunk: attends to its chunk's causal keys `intra` (from the chunk's start up to
/// the query itself) and to `memory` (inter), adds both attentions' column sums to `scores`, each softmax
/// normalised over its own key set (seed rule item 4), and merges the two exactly. Returns the output
/// row and the keys it attended to.
pub(super) fn attend_chunk_and_memory(
    q: &[f64],
    k: &Matrix,
    v: &Matrix,
    logits: Logits,
    intra: RangeInclusive<usize>,
    memory: &[usize],
    scores: &mut [f64],
) -> (Vec<f64>, Vec<usize>) {
    let intra_keys: Vec<usize> = intra.collect();
    let (intra, a_intra) = attend(q, k, v, logits, &intra_keys);
    let (inter, a_inter) = attend(q, k, v, logits, memory);
    for (&j, w) in intra_keys
        .iter()
        .zip(&a_intra)
        .chain(memory.iter().zip(&a_inter))
    {
        scores[j] += w;
    }
    let merged = merge_partial_softmax(&intra, &inter);
    (
        merged.output(),
        memory.iter().copied().chain(intra_keys).collect(),
    )
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
    logits: impl Into<Logits>,
    params: &H2oParams,
) -> Vec<HeadResult> {
    let logits = logits.into();
    assert!(
        !k.is_empty() && k.len() == v.len() && q.len().is_multiple_of(k.len()),
        "bad head counts"
    );
    let group = q.len() / k.len();
    q.iter()
        .enumerate()
        .map(|(h, qh)| h2o_attention_head(qh, &k[h / group], &v[h / group], logits, params))
        .collect()
}

#[cfg(test)]
mod tests;
