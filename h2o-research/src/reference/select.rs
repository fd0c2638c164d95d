//! The block half of [`Selection::Hybrid`] in the reference: the memory a chunk's own queries
//! choose, written for readability like the rest of the reference.

use std::ops::Range;

use super::{H2oParams, Matrix, MemorySet, Selection};

/// Positions per block of query-aware selection (`GGML_H2O_BLOCK`).
pub const SELECT_BLOCK: usize = 16;
/// Query-aware selection samples the last this-many queries of a chunk…
pub const SAMPLE_LAST: usize = 32;
/// …and up to this many more, evenly spread over the rest.
pub const SAMPLE_STRIDE: usize = 32;

/// The queries of `rows` that choose a query-aware memory: the last [`SAMPLE_LAST`], then up
/// to [`SAMPLE_STRIDE`] evenly spread over the rest.
#[must_use]
pub fn query_sample(rows: Range<usize>) -> Vec<usize> {
    let last0 = rows.end.saturating_sub(SAMPLE_LAST).max(rows.start);
    let n_rest = last0 - rows.start;
    let n_pick = n_rest.min(SAMPLE_STRIDE);
    (last0..rows.end)
        .chain((0..n_pick).map(|k| rows.start + k * n_rest / n_pick))
        .collect()
}

/// A query-aware memory and what chose it.
#[derive(Debug, Clone, PartialEq)]
pub struct QuerySelection {
    pub set: MemorySet,
    /// `(first position, score)` of every candidate block, in position order
    pub blocks: Vec<(usize, f64)>,
}

/// The memory of the chunk starting at `chunk_start` under [`Selection::Hybrid`]: Local
/// `[start − L, start)`, Sink `[0, sink)`, the best blocks of [`SELECT_BLOCK`] positions of
/// `[sink, start − L)` until `⌈(H − |Sink|)/2⌉` positions are taken (a block that does not fit
/// is cut), and the candidates outside the taken blocks with the highest `scores` (the seed
/// rule's accumulated attention, one per position) for the rest, ties to the lower position. A
/// block's score is the sum over the sampled queries (`sample`, rows of `q`) of its share in a
/// softmax over the blocks of `scale · q·k̂`, where `q·k̂` is the per-channel upper bound
/// `Σ_d max(q_d·min_d, q_d·max_d)` of the block's keys. The bounds are plain scaled products:
/// an estimate of where attention goes, which a model's logit soft-cap (monotone) would only
/// flatten, so the engine and this reference leave it out here.
#[must_use]
pub fn select_by_query(
    params: &H2oParams,
    q: &Matrix,
    k: &Matrix,
    scale: f64,
    chunk_start: usize,
    sample: &[usize],
    scores: &[f64],
) -> QuerySelection {
    let local = chunk_start.saturating_sub(params.local)..chunk_start;
    let sink_end = params.sink.min(local.start);
    let candidates = sink_end..local.start;
    let budget = params.heavy.saturating_sub(sink_end);
    debug_assert_eq!(params.select, Selection::Hybrid);
    let by_score = budget / 2;
    let mut positions: Vec<usize> = (0..sink_end).chain(local).collect();
    let mut blocks = Vec::new();
    if candidates.len() <= budget {
        positions.extend(candidates);
    } else {
        let ranges = block_ranges(&candidates);
        let summaries: Vec<BlockSummary> = ranges
            .iter()
            .map(|r| BlockSummary::of(k, r.clone()))
            .collect();
        let score = block_shares(q, scale, sample, &summaries);
        let in_blocks = take_blocks(&ranges, &score, budget - by_score);
        if by_score > 0 {
            let mut rest: Vec<usize> = candidates
                .clone()
                .filter(|p| !in_blocks.contains(p))
                .collect();
            rest.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            rest.truncate(budget - in_blocks.len());
            positions.extend(rest);
        }
        positions.extend(in_blocks);
        blocks = ranges.iter().map(|r| r.start).zip(score).collect();
    }
    positions.sort_unstable();
    let mut slots: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    slots.resize(params.memory_size(), -1);
    QuerySelection {
        set: MemorySet { slots },
        blocks,
    }
}

/// The candidates cut at multiples of [`SELECT_BLOCK`] (the first and last block may be short).
fn block_ranges(candidates: &Range<usize>) -> Vec<Range<usize>> {
    (candidates.start / SELECT_BLOCK..candidates.end.div_ceil(SELECT_BLOCK))
        .map(|b| {
            (b * SELECT_BLOCK).max(candidates.start)..((b + 1) * SELECT_BLOCK).min(candidates.end)
        })
        .collect()
}

/// What a query sees of a block of keys: its per-channel minimum and maximum.
struct BlockSummary {
    lo: Vec<f64>,
    hi: Vec<f64>,
}

impl BlockSummary {
    fn of(k: &Matrix, block: Range<usize>) -> Self {
        let d = k.cols;
        let mut lo = vec![f64::INFINITY; d];
        let mut hi = vec![f64::NEG_INFINITY; d];
        for j in block {
            for ((l, h), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(k.row(j)) {
                *l = l.min(x);
                *h = h.max(x);
            }
        }
        Self { lo, hi }
    }

    /// The logit `qi · k̂` of a (scaled) query against the block: the upper bound
    /// `Σ_d max(q_d·lo_d, q_d·hi_d)`.
    fn logit(&self, qi: &[f64]) -> f64 {
        qi.iter()
            .zip(self.lo.iter().zip(&self.hi))
            .map(|(x, (l, h))| (x * l).max(x * h))
            .sum()
    }
}

/// Each block's summed share in the softmax over the blocks, over the sampled queries.
fn block_shares(q: &Matrix, scale: f64, sample: &[usize], summaries: &[BlockSummary]) -> Vec<f64> {
    let mut score = vec![0.0; summaries.len()];
    for &i in sample {
        let qi: Vec<f64> = q.row(i).iter().map(|x| x * scale).collect();
        let logits: Vec<f64> = summaries.iter().map(|b| b.logit(&qi)).collect();
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (s, x) in score.iter_mut().zip(&e) {
            *s += x / sum;
        }
    }
    score
}

/// The positions of the best-scoring blocks (ties to the lower block), `budget` in all: the
/// last block taken may be cut short.
fn take_blocks(ranges: &[Range<usize>], score: &[f64], budget: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    let mut left = budget;
    let mut taken = Vec::new();
    for b in order {
        if left == 0 {
            break;
        }
        let r = ranges[b].start..ranges[b].end.min(ranges[b].start + left);
        left -= r.len();
        taken.extend(r);
    }
    taken
}

#[cfg(test)]
mod tests {
    use super::*;

    // a deterministic stream of values in [-amp, amp)
    fn matrix(seed: u64, rows: usize, cols: usize, amp: f64) -> Matrix {
        let mut s = seed;
        let data = (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * amp
            })
            .collect();
        Matrix::new(rows, cols, data)
    }

    const D: usize = 8;

    #[test]
    fn hybrid_keeps_local_sinks_the_block_the_queries_point_at_and_the_best_scores() {
        // keys 0..96 random but small; block [48, 64) gets keys along the direction every
        // query of chunk 96..128 looks in, so it must be chosen whatever else happens; the
        // accumulated scores favour [20, 38), which fills the other half of the budget
        let n = 128;
        let mut k = matrix(11, n, D, 0.1);
        let mut q = matrix(12, n, D, 0.1);
        for j in 48..64 {
            k.data[j * D] = 4.0;
        }
        for i in 96..128 {
            q.data[i * D] = 4.0;
        }
        let scores: Vec<f64> = (0..n)
            .map(|p| f64::from(u8::from((20..38).contains(&p))))
            .collect();
        let params = H2oParams {
            chunk: 32,
            local: 8,
            heavy: 40, // 36 after the sinks: 18 in blocks, 18 by score
            select: Selection::Hybrid,
            sink: 4,
            ..Default::default()
        };
        let sel = select_by_query(&params, &q, &k, 0.125, 96, &query_sample(96..128), &scores);
        let pos: Vec<usize> = sel.set.positions().collect();
        assert_eq!(pos.len(), 48, "{pos:?}");
        for p in (0..4).chain(88..96).chain(48..64).chain(20..38) {
            assert!(pos.contains(&p), "{p} missing from {pos:?}");
        }
        // the block half took [48, 64) and two positions of one more block: the rest, 18, by score
        assert_eq!(pos.iter().filter(|p| (4..88).contains(*p)).count(), 36);
        // the sample: the last 32 rows of the chunk part, no more here
        assert_eq!(query_sample(96..128).len(), 32);
        // with more rows than SAMPLE_LAST, the rest is sampled by stride, all inside the rows
        let sample = query_sample(100..300);
        assert_eq!(sample.len(), SAMPLE_LAST + SAMPLE_STRIDE);
        assert!(sample.iter().all(|i| (100..300).contains(i)));
    }
}
