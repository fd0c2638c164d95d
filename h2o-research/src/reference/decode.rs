//! Sparse decode (`ggml_h2o_decode`): which positions a decode step reads (its
//! estimates and gaps formed in the engine's own F32 operations, so that the choice is the
//! engine's), and the step's attention over them in f64.
//!
//! A step at `n` visible positions reads the first `max(ceil(sink/B), 1)` blocks of `B`
//! positions, the recent window from the block boundary at or below `n - local`, and, of the
//! positions of the sketched blocks between them, the `budget` whose gap is least. A position's
//! gap is how far its estimated logit stands below the best estimate of the same query head, the
//! least over the query heads of its KV head; the estimate is the product of the query and the
//! key on the KV head's sketch channels, the quarter of the channels whose keys held the most
//! energy when the first block was sketched, each quantized to 8 bits with its own scale
//! ([`sketch_quantize`]) and their products summed as integers, as the engine does.
//!
//! With a coverage γ below 1, a step takes, of its budget, only the candidates of
//! the least-gap buckets whose weight reaches γ of all candidates': a candidate's bucket is the
//! leading 11 bits of its gap's F32 pattern, and weighs `exp(-its least gap)` in integer units
//! of 2^-24, so that every backend counts the same.

use super::softmax::{apply_sink, dense_attention, Logits, Matrix};
use h2o_llama::DecodeCapture;

/// Positions per block (`GGML_H2O_DECODE_BLOCK`).
pub const DECODE_BLOCK: usize = 16;

/// What one KV head's query heads read in one step.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// Positions `[0, sink_end)` and `[recent_begin, n)` are read whole.
    pub sink_end: usize,
    pub recent_begin: usize,
    /// The chosen positions between them, ascending: the engine's own choice, since the
    /// estimates and gaps are formed as it forms them, in the same F32 operations.
    pub chosen: Vec<usize>,
}

impl DecodePlan {
    /// Every position read, ascending.
    #[must_use]
    pub fn positions(&self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..self.sink_end.min(n)).collect();
        p.extend(&self.chosen);
        p.extend(self.recent_begin.max(self.sink_end)..n);
        p
    }
}

/// Each channel's key energy over positions `0 .. n`: the sum of its squares, in f64.
pub fn channel_energy<'k, T: Copy + Into<f64> + 'k>(
    key: impl Fn(usize) -> &'k [T],
    n: usize,
    d: usize,
) -> Vec<f64> {
    let mut e = vec![0.0_f64; d];
    for pos in 0..n {
        for (acc, &x) in e.iter_mut().zip(key(pos)) {
            let x: f64 = x.into();
            *acc += x * x;
        }
    }
    e
}

/// The sketch channels of a KV head whose keys over positions `0 .. n` are `key(pos)`: the
/// `d / 4` channels of most energy, ties to the lower channel, ascending.
pub fn sketch_channels<'k>(key: impl Fn(usize) -> &'k [f32], n: usize, d: usize) -> Vec<usize> {
    strongest_channels(&channel_energy(key, n, d), d / 4)
}

/// The `keep` channels of most energy `e`, ties to the lower channel, ascending.
#[must_use]
pub fn strongest_channels(e: &[f64], keep: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..e.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
    let mut chosen = order[..keep].to_vec();
    chosen.sort_unstable();
    chosen
}

/// The 8-bit sketch of `x` (a key's, or a pre-scaled query's, values on the sketch channels),
/// as the engine forms it in F32 (`h2o_sketch_quantize`): each value times `127 / a`, `a` their
/// largest magnitude, rounded to nearest even, and the scale `a / 127`. Zeros (and values so
/// small that `127 / a` overflows) take scale 0 and zeros; values with a NaN or an infinity take
/// scale NaN (their estimates are -inf) and zeros.
#[must_use]
pub fn sketch_quantize(x: &[f32]) -> (Vec<i8>, f32) {
    let a = x.iter().fold(0.0_f32, |a, v| a.max(v.abs()));
    if x.iter().any(|v| !v.is_finite()) {
        return (vec![0; x.len()], f32::NAN);
    }
    let inv = 127.0_f32 / a;
    if inv.is_infinite() {
        return (vec![0; x.len()], 0.0);
    }
    let q = x
        .iter()
        .map(|&v| (v * inv).round_ties_even() as i8)
        .collect();
    (q, a / 127.0)
}

/// The estimated logit of a query with 8-bit sketch `(q, sq)` at a key with sketch `(k, sk)`:
/// their integer dot product times `sq`, then times `sk`, in F32 (NaN becomes -inf).
#[must_use]
pub fn sketch_estimate(q: &(Vec<i8>, f32), k: &(Vec<i8>, f32)) -> f32 {
    let dot: i32 =
        q.0.iter()
            .zip(&k.0)
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum();
    let e = (dot as f32 * q.1) * k.1;
    if e.is_nan() {
        f32::NEG_INFINITY
    } else {
        e
    }
}

/// The first-level bucket of a gap: the leading 11 bits of its F32 pattern (a negative gap's
/// taken as 0), an eighth of an octave.
#[must_use]
pub fn gap_bucket(gap: f64) -> usize {
    let bits = (gap as f32).to_bits();
    let bits = if bits >> 31 == 1 { 0 } else { bits };
    (bits >> 20) as usize & 2047
}

/// What a candidate of bucket `b` weighs: `exp(-the bucket's least gap)` in units of 2^-24
/// (0 for infinite gaps and beyond), as `h2o_decode_bucket_weight`.
#[must_use]
pub fn bucket_weight(b: usize) -> u64 {
    let bits = (b as u32) << 20;
    if bits >= 0x7f80_0000 {
        return 0;
    }
    ((-f64::from(f32::from_bits(bits))).exp() * 16_777_216.0 + 0.5) as u64
}

/// How many of the candidates with gaps `gap` coverage `coverage` takes: whole buckets from the
/// least gaps until their weight reaches `coverage` of all candidates' (all of them when none
/// weighs anything).
#[must_use]
pub fn coverage_take(gap: &[f64], coverage: f32) -> usize {
    let mut count = [0_u64; 2048];
    for &g in gap {
        count[gap_bucket(g)] += 1;
    }
    let weight: Vec<u64> = (0..2048).map(|b| count[b] * bucket_weight(b)).collect();
    let total: u64 = weight.iter().sum();
    if total == 0 {
        return gap.len();
    }
    let need = (f64::from(coverage) * total as f64).ceil() as u64;
    let (mut held, mut taken) = (0_u64, 0_u64);
    for b in 0..2048 {
        held += weight[b];
        taken += count[b];
        if held >= need {
            break;
        }
    }
    taken as usize
}

/// What the query heads `queries` (each `d` values, scaled by `scale`) of one KV head read,
/// whose keys are `key(pos)` for positions `0 .. n`, with `channels` as its sketch and the
/// first `sketched` blocks sketched; with `coverage` below 1, of the budget only what
/// [`coverage_take`] takes.
#[allow(clippy::too_many_arguments)]
pub fn decode_plan<'k>(
    queries: &[&[f32]],
    key: impl Fn(usize) -> &'k [f32],
    n: usize,
    scale: f64,
    sink: usize,
    local: usize,
    budget: usize,
    coverage: f32,
    channels: &[usize],
    sketched: usize,
) -> DecodePlan {
    let b = DECODE_BLOCK;
    let n_full = (n / b).min(sketched);
    let sink_blocks = sink.div_ceil(b).max(1).min(n_full);
    let recent_block = (n.saturating_sub(local) / b).min(n_full).max(sink_blocks);
    let candidates: Vec<usize> = (sink_blocks * b..recent_block * b).collect();
    let mut take = budget.min(candidates.len());
    let mut plan = DecodePlan {
        sink_end: sink_blocks * b,
        recent_begin: recent_block * b,
        chosen: candidates.clone(),
    };
    if take == candidates.len() {
        return plan;
    }
    // the engine scales the query in F32, then quantizes it and each key on the sketch channels
    let sketches: Vec<(Vec<i8>, f32)> = candidates
        .iter()
        .map(|&pos| sketch_quantize(&channels.iter().map(|&c| key(pos)[c]).collect::<Vec<f32>>()))
        .collect();
    let estimates: Vec<Vec<f32>> = queries
        .iter()
        .map(|q| {
            let qs = sketch_quantize(
                &channels
                    .iter()
                    .map(|&c| q[c] * scale as f32)
                    .collect::<Vec<f32>>(),
            );
            sketches.iter().map(|k| sketch_estimate(&qs, k)).collect()
        })
        .collect();
    // the gaps in F32, as the engine forms them from the same estimates: the same values bit for
    // bit (a head with no estimate, its best -inf, adds nothing)
    let mut gap32 = vec![f32::INFINITY; candidates.len()];
    for u in &estimates {
        let best = u.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if best == f32::NEG_INFINITY {
            continue;
        }
        for (g, &x) in gap32.iter_mut().zip(u) {
            *g = g.min(best - x);
        }
    }
    let gap: Vec<f64> = gap32.iter().map(|&g| f64::from(g)).collect();
    if coverage < 1.0 {
        take = take.min(coverage_take(&gap, coverage));
    }
    // the least gaps, ties to the earlier position
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&i, &j| gap[i].total_cmp(&gap[j]).then(i.cmp(&j)));
    let mut chosen: Vec<usize> = order[..take].iter().map(|&i| candidates[i]).collect();
    chosen.sort_unstable();
    plan.chosen = chosen;
    plan
}

/// A captured decode step recomputed: per KV head its plan (with the sketch channels the op
/// kept), and per query head the output (`[n_head][head_dim_v]`) of one softmax over the plan's
/// positions (see [`decode_attention`]).
#[must_use]
pub fn decode_step(c: &DecodeCapture) -> (Vec<DecodePlan>, Vec<f64>) {
    let (n, d) = (c.n as usize, c.head_dim as usize);
    let (n_head, n_head_kv) = (c.n_head as usize, c.n_head_kv as usize);
    let group = n_head / n_head_kv;
    let plans: Vec<DecodePlan> = (0..n_head_kv)
        .map(|kvh| {
            let key = |pos: usize| &c.k[(pos * n_head_kv + kvh) * d..][..d];
            let queries: Vec<&[f32]> = (0..group)
                .map(|r| &c.q[(kvh * group + r) * d..][..d])
                .collect();
            let channels: Vec<usize> = c.sketch_channels[kvh * (d / 4)..][..d / 4]
                .iter()
                .map(|&ch| ch as usize)
                .collect();
            decode_plan(
                &queries,
                key,
                n,
                f64::from(c.scale),
                c.sink as usize,
                c.local as usize,
                c.budget as usize,
                c.coverage,
                &channels,
                c.sketched_blocks as usize,
            )
        })
        .collect();
    let positions: Vec<Vec<usize>> = plans.iter().map(|p| p.positions(n)).collect();
    let out = decode_attention(c, &positions);
    (plans, out)
}

/// One softmax per query head of a captured decode step over `positions[kvh]`, the positions
/// its KV head's query heads read, with the capture's logit scale, soft-cap and learned sinks:
/// `[n_head][head_dim_v]`. With every position `0 .. n` for each KV head, full attention.
#[must_use]
pub fn decode_attention(c: &DecodeCapture, positions: &[Vec<usize>]) -> Vec<f64> {
    let (n, d, dv) = (c.n as usize, c.head_dim as usize, c.head_dim_v as usize);
    let (n_head, n_head_kv) = (c.n_head as usize, c.n_head_kv as usize);
    let group = n_head / n_head_kv;
    let logits = Logits {
        scale: f64::from(c.scale),
        softcap: f64::from(c.softcap),
    };
    let widen = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
    let rows = |data: &[f32], width: usize, kvh: usize| {
        let mut m = Vec::with_capacity(n * width);
        for pos in 0..n {
            m.extend(widen(&data[(pos * n_head_kv + kvh) * width..][..width]));
        }
        Matrix::new(n, width, m)
    };
    let mut out = Vec::with_capacity(n_head * dv);
    for (kvh, keys) in positions.iter().enumerate() {
        let (k, v) = (rows(&c.k, d, kvh), rows(&c.v, dv, kvh));
        for h in kvh * group..(kvh + 1) * group {
            let q = Matrix::new(1, d, widen(&c.q[h * d..(h + 1) * d]));
            let key_sets = [keys.clone()];
            let mut o = dense_attention(&q, &k, &v, logits, &key_sets);
            if let Some(&sink) = c.sinks.get(h) {
                apply_sink(&mut o, &q, &k, logits, &key_sets, f64::from(sink));
            }
            out.extend(o.data);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{
        bucket_weight, coverage_take, decode_plan, gap_bucket, sketch_channels, sketch_estimate,
        sketch_quantize, DECODE_BLOCK,
    };

    #[test]
    fn a_sketch_holds_each_value_within_half_its_step() {
        let (q, s) = sketch_quantize(&[1.0, -0.5, 0.25, 0.0]);
        assert_eq!(q, vec![127, -64, 32, 0]); // -63.5 rounds to even
        assert_eq!(s, 1.0 / 127.0);
        for seed in 0..20 {
            let x = keys(1, 16, seed);
            let (q, s) = sketch_quantize(&x);
            assert!(q.iter().all(|&v| v.unsigned_abs() <= 127));
            assert_eq!(q.iter().map(|v| v.unsigned_abs()).max(), Some(127));
            for (&v, &qv) in x.iter().zip(&q) {
                assert!((v - f32::from(qv) * s).abs() <= s * 0.5001, "{v} {qv} {s}");
            }
        }
        assert_eq!(sketch_quantize(&[0.0; 4]), (vec![0; 4], 0.0));
        assert_eq!(sketch_quantize(&[1e-39, 0.0]), (vec![0; 2], 0.0)); // 127 / a overflows
        let bad = sketch_quantize(&[1.0, f32::NAN, 0.0, 0.0]);
        assert!(bad.1.is_nan() && bad.0 == vec![0; 4]);
        assert_eq!(
            sketch_estimate(&sketch_quantize(&[1.0; 4]), &bad),
            f32::NEG_INFINITY
        );
        // the estimate approaches the product of the values
        let (x, y) = (keys(1, 16, 7), keys(1, 16, 8));
        let exact: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
        let est = sketch_estimate(&sketch_quantize(&x), &sketch_quantize(&y));
        assert!((est - exact).abs() < 0.02, "{est} {exact}");
    }

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
    fn the_sketch_keeps_the_channels_of_most_key_energy() {
        let (n, d) = (100, 16);
        let mut k = keys(n, d, 3);
        for pos in 0..n {
            for (c, gain) in [(3, 4.0), (5, 3.0), (11, 2.0), (14, 5.0)] {
                k[pos * d + c] *= gain;
            }
        }
        assert_eq!(
            sketch_channels(|p| &k[p * d..(p + 1) * d], n, d),
            vec![3, 5, 11, 14]
        );
        // equal energy everywhere: the lower channels
        let flat = vec![1.0_f32; n * d];
        assert_eq!(
            sketch_channels(|p| &flat[p * d..(p + 1) * d], n, d),
            vec![0, 1, 2, 3]
        );
    }

    #[test]
    fn the_choice_is_the_best_estimate_within_the_budget() {
        let (n, d) = (40 * DECODE_BLOCK + 7, 8);
        for seed in 1..20 {
            let k = keys(n, d, seed);
            let q = keys(1, d, seed + 100);
            let key = |pos: usize| &k[pos * d..(pos + 1) * d];
            let channels = sketch_channels(key, n / DECODE_BLOCK * DECODE_BLOCK, d);
            let plan = decode_plan(
                &[&q],
                key,
                n,
                1.0,
                4,
                24,
                80,
                1.0,
                &channels,
                n / DECODE_BLOCK,
            );
            // first block, window from the boundary at or below n - 24, 80 positions between
            assert_eq!(plan.sink_end, DECODE_BLOCK);
            assert_eq!(plan.recent_begin, (n - 24) / DECODE_BLOCK * DECODE_BLOCK);
            assert_eq!(plan.chosen.len(), 80);
            assert!(plan.chosen.windows(2).all(|w| w[0] < w[1]));
            // with one query head the gap ranks as the estimate does: every chosen position's
            // estimate (from the 8-bit sketches) is at least every left-out candidate's
            let on_channels = |x: &[f32]| channels.iter().map(|&c| x[c]).collect::<Vec<f32>>();
            let qs = sketch_quantize(&on_channels(&q));
            let estimate = |pos: usize| -> f64 {
                f64::from(sketch_estimate(
                    &qs,
                    &sketch_quantize(&on_channels(key(pos))),
                ))
            };
            let worst_in = plan
                .chosen
                .iter()
                .map(|&p| estimate(p))
                .fold(f64::INFINITY, f64::min);
            for pos in plan.sink_end..plan.recent_begin {
                if !plan.chosen.contains(&pos) {
                    assert!(
                        estimate(pos) <= worst_in + 1e-12,
                        "seed {seed}, position {pos}"
                    );
                }
            }
            // the positions read: sinks, chosen, window, each once
            let pos = plan.positions(n);
            assert_eq!(pos.len(), DECODE_BLOCK + 80 + (n - plan.recent_begin));
            assert!(pos.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn unsketched_blocks_are_read_whole_and_a_covering_budget_reads_every_position() {
        let (n, d) = (10 * DECODE_BLOCK + 3, 4);
        let k = keys(n, d, 7);
        let q = keys(1, d, 8);
        let key = |p: usize| &k[p * d..(p + 1) * d];
        let plan = decode_plan(&[&q], key, n, 1.0, 0, 16, 1024, 1.0, &[1], 10);
        assert_eq!(plan.positions(n), (0..n).collect::<Vec<_>>());
        // only 4 blocks sketched: the rest is the recent window, whatever the budget
        let few = decode_plan(&[&q], key, n, 1.0, 0, 16, 16, 1.0, &[1], 4);
        assert_eq!(few.recent_begin, 4 * DECODE_BLOCK);
        assert_eq!(few.chosen.len(), 16);
        // fewer positions than a block: all of them
        let short = decode_plan(&[&q], key, 9, 1.0, 0, 0, 16, 1.0, &[1], 0);
        assert_eq!(short.positions(9), (0..9).collect::<Vec<_>>());
    }

    #[test]
    fn coverage_takes_the_fewest_least_gap_buckets_that_hold_its_share() {
        for seed in 1..20 {
            // gaps as a step's: 0 for a head's best, then spread over a few units
            let gap: Vec<f64> = keys(500, 1, seed)
                .iter()
                .map(|&x| f64::from((x + 0.5) * 8.0))
                .chain([0.0])
                .collect();
            let weight_upto = |last: usize| -> u64 {
                gap.iter()
                    .filter(|&&g| gap_bucket(g) <= last)
                    .map(|&g| bucket_weight(gap_bucket(g)))
                    .sum()
            };
            let total = weight_upto(2047);
            let mut previous = 0;
            for coverage in [0.1_f32, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0] {
                let taken = coverage_take(&gap, coverage);
                // whole buckets: the taken gaps are exactly those of the buckets up to the cut
                let mut sorted = gap.clone();
                sorted.sort_by(f64::total_cmp);
                let cut = gap_bucket(sorted[taken - 1]);
                assert!(taken == gap.len() || gap_bucket(sorted[taken]) > cut);
                // they hold the share, and one bucket fewer would not
                let need = (f64::from(coverage) * total as f64).ceil() as u64;
                assert!(weight_upto(cut) >= need, "seed {seed}, coverage {coverage}");
                let below = sorted[..taken]
                    .iter()
                    .filter(|&&g| gap_bucket(g) < cut)
                    .map(|&g| bucket_weight(gap_bucket(g)))
                    .sum::<u64>();
                assert!(below < need, "seed {seed}, coverage {coverage}");
                // more coverage never takes fewer
                assert!(taken >= previous);
                previous = taken;
            }
        }
        // the weights: exp(-gap) of the bucket's least gap, in units of 2^-24; nothing for
        // infinite gaps
        assert_eq!(bucket_weight(gap_bucket(0.0)), 1 << 24);
        assert_eq!(
            bucket_weight(gap_bucket(1.0)),
            ((-1.0_f64).exp() * 16_777_216.0 + 0.5) as u64
        );
        assert_eq!(bucket_weight(gap_bucket(f64::INFINITY)), 0);
        // no weight anywhere: every candidate
        assert_eq!(coverage_take(&[f64::INFINITY; 7], 0.5), 7);
    }

    #[test]
    fn a_plan_under_coverage_takes_at_most_the_budget_and_fewer_with_less_coverage() {
        let (n, d) = (60 * DECODE_BLOCK, 8);
        for seed in 1..10 {
            let k = keys(n, d, seed);
            let q = keys(1, d, seed + 50);
            let key = |pos: usize| &k[pos * d..(pos + 1) * d];
            let channels = sketch_channels(key, n, d);
            let plan = |coverage: f32| {
                decode_plan(
                    &[&q],
                    key,
                    n,
                    4.0,
                    0,
                    32,
                    400,
                    coverage,
                    &channels,
                    n / DECODE_BLOCK,
                )
            };
            let (all, most, few) = (plan(1.0), plan(0.9), plan(0.3));
            assert_eq!(all.chosen.len(), 400);
            assert!(few.chosen.len() <= most.chosen.len() && most.chosen.len() <= 400);
            assert!(
                few.chosen.len() < 400,
                "seed {seed}: coverage 0.3 took the budget"
            );
            // what a lower coverage takes is the head of what a higher one takes
            assert!(few.chosen.iter().all(|p| most.chosen.contains(p)));
        }
    }
}
