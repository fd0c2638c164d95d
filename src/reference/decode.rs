//! Sparse decode (patch 0025, `ggml_h2o_decode`) in f64: which blocks a decode step reads, and
//! the step's attention over them.
//!
//! A step at `n` visible positions reads the first `max(ceil(sink/B), 1)` blocks of `B`
//! positions, the recent window from the block boundary at or below `n - local`, and, of the
//! complete blocks between them, the `budget / B` with the largest score. A block's score sums,
//! over the query heads of its KV head, that head's softmax share of the block's bound of q·k,
//! where the bound takes per channel the block's key maximum for q ≥ 0 and its minimum for
//! q < 0 (Quest).

use crate::capture::DecodeCapture;

/// Positions per block (`GGML_H2O_DECODE_BLOCK`).
pub const DECODE_BLOCK: usize = 16;

/// What one KV head's query heads read in one step.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// Positions `[0, sink_end)` and `[recent_begin, n)` are read whole.
    pub sink_end: usize,
    pub recent_begin: usize,
    /// The chosen blocks between them, ascending.
    pub blocks: Vec<usize>,
    /// How far the last chosen block's score stands above the best one left out, relative to
    /// it (`f64::INFINITY` when nothing was left out): near 0, the engine's F32 scores may
    /// rank the two the other way.
    pub margin: f64,
}

impl DecodePlan {
    /// Every position read, ascending.
    #[must_use]
    pub fn positions(&self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..self.sink_end.min(n)).collect();
        for &b in &self.blocks {
            p.extend(b * DECODE_BLOCK..(b + 1) * DECODE_BLOCK);
        }
        p.extend(self.recent_begin.max(self.sink_end)..n);
        p
    }
}

/// The blocks the query heads `queries` (each `d` values, scaled by `scale`) of one KV head
/// read, whose keys are `key(pos)` (`d` values) for positions `0 .. n`.
pub fn decode_plan<'k>(
    queries: &[&[f32]],
    key: impl Fn(usize) -> &'k [f32],
    n: usize,
    scale: f64,
    sink: usize,
    local: usize,
    budget: usize,
) -> DecodePlan {
    let b = DECODE_BLOCK;
    let n_full = n / b;
    let sink_blocks = sink.div_ceil(b).max(1).min(n_full);
    let recent_block = (n.saturating_sub(local) / b).min(n_full).max(sink_blocks);
    let candidates: Vec<usize> = (sink_blocks..recent_block).collect();
    let take = (budget / b).min(candidates.len());
    let mut plan = DecodePlan {
        sink_end: sink_blocks * b,
        recent_begin: recent_block * b,
        blocks: candidates.clone(),
        margin: f64::INFINITY,
    };
    if take == candidates.len() {
        return plan;
    }
    let d = queries.first().map_or(0, |q| q.len());
    // each candidate block's channel minima and maxima
    let bounds: Vec<(Vec<f64>, Vec<f64>)> = candidates
        .iter()
        .map(|&blk| {
            let mut lo = vec![f64::INFINITY; d];
            let mut hi = vec![f64::NEG_INFINITY; d];
            for pos in blk * b..(blk + 1) * b {
                for (c, &x) in key(pos).iter().enumerate() {
                    lo[c] = lo[c].min(f64::from(x));
                    hi[c] = hi[c].max(f64::from(x));
                }
            }
            (lo, hi)
        })
        .collect();
    let mut score = vec![0.0_f64; candidates.len()];
    for q in queries {
        let u: Vec<f64> = bounds
            .iter()
            .map(|(lo, hi)| {
                q.iter()
                    .enumerate()
                    .map(|(c, &x)| {
                        let x = f64::from(x) * scale;
                        if x >= 0.0 {
                            x * hi[c]
                        } else {
                            x * lo[c]
                        }
                    })
                    .sum()
            })
            .collect();
        let max = u.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = u.iter().map(|&x| (x - max).exp()).collect();
        let z: f64 = e.iter().sum();
        for (s, x) in score.iter_mut().zip(e) {
            *s += x / z;
        }
    }
    // the largest scores, ties to the earlier block
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&i, &j| score[j].total_cmp(&score[i]).then(i.cmp(&j)));
    let (last_in, first_out) = (score[order[take - 1]], score[order[take]]);
    plan.margin = (last_in - first_out) / last_in.abs().max(f64::MIN_POSITIVE);
    let mut chosen: Vec<usize> = order[..take].iter().map(|&i| candidates[i]).collect();
    chosen.sort_unstable();
    plan.blocks = chosen;
    plan
}

/// A captured decode step recomputed: per KV head its plan, and per query head the output
/// (`[n_head][head_dim_v]`) of one softmax over the plan's positions, with the capture's logit
/// scale, soft-cap and learned sinks.
#[must_use]
pub fn decode_step(c: &DecodeCapture) -> (Vec<DecodePlan>, Vec<f64>) {
    let (n, d, dv) = (c.n as usize, c.head_dim as usize, c.head_dim_v as usize);
    let (n_head, n_head_kv) = (c.n_head as usize, c.n_head_kv as usize);
    let group = n_head / n_head_kv;
    let scale = f64::from(c.scale);
    let mut plans = Vec::with_capacity(n_head_kv);
    let mut out = vec![0.0_f64; n_head * dv];
    for kvh in 0..n_head_kv {
        let key = |pos: usize| &c.k[(pos * n_head_kv + kvh) * d..][..d];
        let value = |pos: usize| &c.v[(pos * n_head_kv + kvh) * dv..][..dv];
        let queries: Vec<&[f32]> = (0..group)
            .map(|r| &c.q[(kvh * group + r) * d..][..d])
            .collect();
        let plan = decode_plan(
            &queries,
            key,
            n,
            scale,
            c.sink as usize,
            c.local as usize,
            c.budget as usize,
        );
        let positions = plan.positions(n);
        for (r, q) in queries.iter().enumerate() {
            let h = kvh * group + r;
            let logits: Vec<f64> = positions
                .iter()
                .map(|&pos| {
                    let x: f64 = q
                        .iter()
                        .zip(key(pos))
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>()
                        * scale;
                    if c.softcap > 0.0 {
                        let cap = f64::from(c.softcap);
                        cap * (x / cap).tanh()
                    } else {
                        x
                    }
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sink = c.sinks.get(h).map_or(f64::NEG_INFINITY, |&s| f64::from(s));
            let weights: Vec<f64> = logits.iter().map(|&x| (x - max).exp()).collect();
            let z: f64 = weights.iter().sum::<f64>() + (sink - max).exp();
            let o = &mut out[h * dv..(h + 1) * dv];
            for (&pos, w) in positions.iter().zip(&weights) {
                for (acc, &x) in o.iter_mut().zip(value(pos)) {
                    *acc += w / z * f64::from(x);
                }
            }
        }
        plans.push(plan);
    }
    (plans, out)
}

#[cfg(test)]
mod tests {
    use super::{decode_plan, DECODE_BLOCK};

    /// Keys of `n` positions in `d` channels from a small deterministic generator.
    fn keys(n: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n * d)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn the_bound_bounds_every_key_and_the_choice_is_the_best_within_the_budget() {
        let (n, d) = (40 * DECODE_BLOCK + 7, 8);
        for seed in 1..20 {
            let k = keys(n, d, seed);
            let q = keys(1, d, seed + 100);
            let key = |pos: usize| &k[pos * d..(pos + 1) * d];
            let plan = decode_plan(&[&q], key, n, 1.0, 4, 24, 5 * DECODE_BLOCK);
            // first block, window from the boundary at or below n - 24, five blocks between
            assert_eq!(plan.sink_end, DECODE_BLOCK);
            assert_eq!(plan.recent_begin, (n - 24) / DECODE_BLOCK * DECODE_BLOCK);
            assert_eq!(plan.blocks.len(), 5);
            assert!(plan.blocks.windows(2).all(|w| w[0] < w[1]));
            // with one query head the score ranks as the bound does, and the bound bounds:
            // every chosen block's bound is at least every left-out block's best true logit
            let logit = |pos: usize| -> f64 {
                q.iter()
                    .zip(key(pos))
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum()
            };
            let bound = |blk: usize| -> f64 {
                (0..d)
                    .map(|c| {
                        let vals = (blk * DECODE_BLOCK..(blk + 1) * DECODE_BLOCK)
                            .map(|p| f64::from(key(p)[c]));
                        let x = f64::from(q[c]);
                        if x >= 0.0 {
                            x * vals.fold(f64::NEG_INFINITY, f64::max)
                        } else {
                            x * vals.fold(f64::INFINITY, f64::min)
                        }
                    })
                    .sum()
            };
            for blk in 1..plan.recent_begin / DECODE_BLOCK {
                let best = (blk * DECODE_BLOCK..(blk + 1) * DECODE_BLOCK)
                    .map(logit)
                    .fold(f64::NEG_INFINITY, f64::max);
                assert!(
                    best <= bound(blk) + 1e-12,
                    "block {blk}: {best} > {}",
                    bound(blk)
                );
                if !plan.blocks.contains(&blk) {
                    for &chosen in &plan.blocks {
                        assert!(bound(chosen) >= bound(blk) - 1e-12, "seed {seed}");
                    }
                }
            }
            // the positions read: sinks, chosen blocks, window, each once
            let pos = plan.positions(n);
            assert_eq!(pos.len(), DECODE_BLOCK * 6 + (n - plan.recent_begin));
            assert!(pos.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn a_budget_covering_the_candidates_reads_every_position() {
        let (n, d) = (10 * DECODE_BLOCK + 3, 4);
        let k = keys(n, d, 7);
        let q = keys(1, d, 8);
        let plan = decode_plan(&[&q], |p| &k[p * d..(p + 1) * d], n, 1.0, 0, 16, 1024);
        assert_eq!(plan.positions(n), (0..n).collect::<Vec<_>>());
        assert!(plan.margin.is_infinite());
        // fewer positions than a block: all of them
        let short = decode_plan(&[&q], |p| &k[p * d..(p + 1) * d], 9, 1.0, 0, 0, 16);
        assert_eq!(short.positions(9), (0..9).collect::<Vec<_>>());
    }
}
