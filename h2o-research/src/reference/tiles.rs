//! [`Selection::Coverage`](super::Selection::Coverage) in the reference: every tile of [`TILE`] queries chooses its own memory,
//! token by token, from the exact attention of a few of its queries, and the tiles of all heads
//! of a chunk share one budget, spent where the estimated coverage gains most.
//!
//! For chunk `c` starting at `cs` and a call's rows of it, per query head and tile:
//! - **forced**: the sinks `[0, min(sink, cs − L))` and the local window `[cs − L, cs)`;
//! - **samples**: the tile's rows `i` with `(i − t0) mod e = e − 1`, `e = TILE / samples` (`t0`
//!   the tile's first position; the tile's last row if it has none), each with its attention
//!   `p_i` over the positions before the chunk, `[0, cs)` (a softmax over those only, so that a
//!   sample whose attention stays in its chunk weighs as much as one that reaches far); with
//!   `sketch` > 1 from logits over only the `d / sketch` channels of most key energy
//!   `Σ_j k_j[c]²` over the call's positions `[0, rows.end)` of the KV head (ties to the lower
//!   channel);
//! - **proposal**: the candidates `[sink_end, cs − L)` by `Σ_samples p_i(j)`, highest first,
//!   ties to the lower position, at most `4·H` of them;
//! - **pool** (`pool` > 0, and only where the chunk has more than `pool + pool / POOL_OWN`
//!   candidates): per head, the rows of every tile of the chunk that the call touches with
//!   `(i − t0) mod POOL_SCAN_EVERY = POOL_SCAN_EVERY − 1` (the tile's last row if it has none)
//!   attend as samples do, `p_i` over `[0, cs)` on the sketch's channels; the chunk's pool is the
//!   `pool` candidates with the most `Σ_rows p_i(j)` over all those tiles, and a tile's pool adds
//!   the `pool / POOL_OWN` candidates outside it with the most of its own rows' `Σ p_i(j)` (both
//!   highest first, ties to the lower position). The tile's samples then attend to its pool
//!   alone (a softmax over those keys) and propose among it as above;
//! - **ranking**: every row `i` of the tile attends to its chunk up to itself, the forced
//!   positions and the proposed candidates (`p'_i`, a softmax over those keys); the candidates
//!   go by `Σ_rows p'_i(j)`, highest first, ties to the lower position;
//! - **estimate** after `g` steps of [`BUDGET_STEP`] positions: the rows' mean `p'` on their
//!   chunk, the forced positions and the first `g` steps of the ranking.
//!
//! The budget: every unit (head, tile) starts at its forced positions; one step at a time goes
//! to the unit whose estimate gains most (ties to the lower head, then tile), among units whose
//! estimate is still below the coverage target γ, until the units hold on average `H − |sinks|`
//! ranked positions (so the average memory is at most M = L + H) or none can take more. A tile's
//! memory is its forced positions and its ranked positions up to its budget.

use std::ops::Range;

use super::{
    attend, attend_chunk_and_memory, chunk_bounds, H2oParams, HeadResult, Logits, Matrix, MemorySet,
};

/// Queries per tile (`H2O_QT` of the CPU kernel).
pub const TILE: usize = 64;
/// Budgets move in steps of this many positions.
pub const BUDGET_STEP: usize = 32;
/// A tile ranks at most this many times `H` candidates.
pub const MAX_HEAVY_FACTOR: usize = 4;
/// With a pool: one query in this many of every tile scans every earlier position.
pub const POOL_SCAN_EVERY: usize = 16;
/// With a pool: a tile's own scanned queries add `pool / POOL_OWN` candidates to it.
pub const POOL_OWN: usize = 4;

/// What [`Selection::Coverage`] adds to [`H2oParams`].
///
/// [`Selection::Coverage`]: super::Selection::Coverage
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CoverageParams {
    /// γ in (0, 1]: a tile takes no more budget once its estimate reaches it.
    pub coverage: f64,
    /// Queries of each tile that attend to every position before the chunk (a divisor of
    /// [`TILE`]).
    pub samples: usize,
    /// Their logits read `1 / sketch` of the key channels, those of most key energy (1: all).
    pub sketch: usize,
    /// 0, or the chunk's pool of candidates that the samples propose among (at least
    /// `MAX_HEAVY_FACTOR · H`).
    pub pool: usize,
}

/// One tile's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct TileMemory {
    /// The tile's rows (positions) in the call.
    pub rows: Range<usize>,
    /// Its memory, ascending.
    pub memory: Vec<usize>,
    /// The memory it would have at the average budget: the forced positions and the first
    /// `H − |sinks|` of its ranking, ascending (what the engine keeps as the chunk's memory set).
    pub at_average: Vec<usize>,
}

/// What one unit (head, tile) brings to the shared budget.
struct Unit {
    forced: Vec<usize>,
    ranked: Vec<usize>,
    /// estimate after g steps, g = 0 ..= steps
    estimate: Vec<f64>,
}

/// The sampled rows of the tile whose present rows are `rows` and whose first position is `t0`:
/// every `TILE / samples`-th.
#[must_use]
pub fn tile_samples(t0: usize, rows: &Range<usize>, samples: usize) -> Vec<usize> {
    let every = TILE / samples;
    let s: Vec<usize> = rows
        .clone()
        .filter(|i| (i - t0) % every == every - 1)
        .collect();
    if s.is_empty() {
        vec![rows.end - 1]
    } else {
        s
    }
}

/// The tiles of chunk `[cs, ce)` that rows `rows` (inside it) touch: `(t0, present rows)`.
#[must_use]
pub fn tiles_of(cs: usize, rows: &Range<usize>) -> Vec<(usize, Range<usize>)> {
    let first = cs + (rows.start - cs) / TILE * TILE;
    (first..rows.end)
        .step_by(TILE)
        .map(|t0| (t0, t0.max(rows.start)..(t0 + TILE).min(rows.end)))
        .collect()
}

/// The attention of query `i` (row of `q`) over the positions `[0, end)` alone (those before
/// its chunk), from logits over `channels` only (all without).
fn attention_before(
    q: &Matrix,
    k: &Matrix,
    logits: Logits,
    i: usize,
    end: usize,
    channels: Option<&[usize]>,
) -> Vec<f64> {
    let keys: Vec<usize> = (0..end).collect();
    attention_over(q, k, logits, i, &keys, channels)
}

/// The attention of query `i` over the positions `keys` alone (a softmax over those), from
/// logits over `channels` only (all without); in the order of `keys`.
fn attention_over(
    q: &Matrix,
    k: &Matrix,
    logits: Logits,
    i: usize,
    keys: &[usize],
    channels: Option<&[usize]>,
) -> Vec<f64> {
    let project = |row: &[f64]| -> Vec<f64> {
        channels.map_or_else(|| row.to_vec(), |c| c.iter().map(|&j| row[j]).collect())
    };
    let qi = project(q.row(i));
    let logits: Vec<f64> = keys
        .iter()
        .map(|&j| logits.logit(&qi, &project(k.row(j))))
        .collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// The memory of every tile of chunk `[cs, ..)` that `rows` touch, for every query head
/// (`q[h]`, reading `k[h / (q.len() / k.len())]`), under [`Selection::Coverage`]. Result:
/// `[head][tile]`.
///
/// [`Selection::Coverage`]: super::Selection::Coverage
#[must_use]
pub fn select_by_tiles(
    params: &H2oParams,
    cp: &CoverageParams,
    q: &[Matrix],
    k: &[Matrix],
    logits: impl Into<Logits>,
    cs: usize,
    rows: Range<usize>,
) -> Vec<Vec<TileMemory>> {
    let lg = logits.into();
    let group = q.len() / k.len();
    let local_start = cs.saturating_sub(params.local);
    let sink_end = params.sink.min(local_start);
    let forced: Vec<usize> = (0..sink_end).chain(local_start..cs).collect();
    let candidates = sink_end..local_start;
    let heavy = params.heavy.saturating_sub(sink_end);
    let n_rank = candidates.len().min(MAX_HEAVY_FACTOR * params.heavy);
    let steps = n_rank.div_ceil(BUDGET_STEP);
    let tiles = tiles_of(cs, &rows);
    // per KV head, the channels the samples' logits read
    let sketches: Vec<Option<Vec<usize>>> = k
        .iter()
        .map(|kh| {
            (cp.sketch > 1).then(|| {
                let energy = super::decode::channel_energy(|j| kh.row(j), rows.end, kh.cols);
                super::decode::strongest_channels(&energy, kh.cols / cp.sketch)
            })
        })
        .collect();

    let mut units: Vec<Unit> = Vec::new();
    let pooled = cp.pool > 0 && candidates.len() > cp.pool + cp.pool / POOL_OWN;
    for (h, qh) in q.iter().enumerate() {
        let kh = &k[h / group];
        let channels = sketches[h / group].as_deref();
        let scan =
            pooled.then(|| chunk_pool(qh, kh, lg, cs, &tiles, &candidates, cp.pool, channels));
        for (t, (t0, present)) in tiles.iter().enumerate() {
            let samples = tile_samples(*t0, present, cp.samples);
            // the positions the samples attend to: every one before the chunk, or the tile's pool
            let among: Vec<usize> = match &scan {
                None => (0..cs).collect(),
                Some((pool, tile_mass)) => {
                    tile_pool(pool, &tile_mass[t], &candidates, cp.pool / POOL_OWN)
                }
            };
            let attention: Vec<Vec<f64>> = samples
                .iter()
                .map(|&i| attention_over(qh, kh, lg, i, &among, channels))
                .collect();
            let mut score: Vec<(f64, usize)> = among
                .iter()
                .enumerate()
                .filter(|&(_, j)| candidates.contains(j))
                .map(|(m, &j)| (attention.iter().map(|p| p[m]).sum::<f64>(), j))
                .collect();
            score.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let proposed: Vec<usize> = score.iter().take(n_rank).map(|&(_, j)| j).collect();
            // every row of the tile over its chunk, the forced positions and the proposal
            let rows_p: Vec<(f64, Vec<f64>)> = present
                .clone()
                .map(|i| {
                    let keys: Vec<usize> = (cs..=i)
                        .chain(forced.iter().copied())
                        .chain(proposed.iter().copied())
                        .collect();
                    let logits: Vec<f64> = keys
                        .iter()
                        .map(|&j| lg.logit(qh.row(i), kh.row(j)))
                        .collect();
                    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let n_base = i + 1 - cs + forced.len();
                    (
                        e[..n_base].iter().sum::<f64>() / z,
                        e[n_base..].iter().map(|x| x / z).collect(),
                    )
                })
                .collect();
            let mut order: Vec<(f64, usize, usize)> = proposed
                .iter()
                .enumerate()
                .map(|(m, &j)| (rows_p.iter().map(|(_, p)| p[m]).sum::<f64>(), j, m))
                .collect();
            order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let ranked: Vec<usize> = order.iter().map(|&(_, j, _)| j).collect();
            let estimate = (0..=steps)
                .map(|g| {
                    let take = &order[..(g * BUDGET_STEP).min(n_rank)];
                    rows_p
                        .iter()
                        .map(|(base, p)| base + take.iter().map(|&(_, _, m)| p[m]).sum::<f64>())
                        .sum::<f64>()
                        / rows_p.len() as f64
                })
                .collect();
            units.push(Unit {
                forced: forced.clone(),
                ranked,
                estimate,
            });
        }
    }

    let given = spend_steps(&units, units.len() * heavy / BUDGET_STEP, cp.coverage);
    let mut out: Vec<Vec<TileMemory>> = vec![Vec::new(); q.len()];
    for (u, (unit, g)) in units.iter().zip(given).enumerate() {
        let mut memory: Vec<usize> = unit
            .forced
            .iter()
            .chain(&unit.ranked[..(g * BUDGET_STEP).min(unit.ranked.len())])
            .copied()
            .collect();
        memory.sort_unstable();
        let mut at_average: Vec<usize> = unit
            .forced
            .iter()
            .chain(unit.ranked.iter().take(heavy))
            .copied()
            .collect();
        at_average.sort_unstable();
        out[u / tiles.len()].push(TileMemory {
            rows: tiles[u % tiles.len()].1.clone(),
            memory,
            at_average,
        });
    }
    out
}

/// A head's pool for the chunk at `cs`: the `n_pool` candidates with the most attention of the
/// scanned rows of all `tiles`, ascending; and each tile's scanned attention on the candidates
/// (indexed by position − the first candidate).
#[allow(clippy::too_many_arguments)]
fn chunk_pool(
    q: &Matrix,
    k: &Matrix,
    lg: Logits,
    cs: usize,
    tiles: &[(usize, Range<usize>)],
    candidates: &Range<usize>,
    n_pool: usize,
    channels: Option<&[usize]>,
) -> (Vec<usize>, Vec<Vec<f64>>) {
    let tile_mass: Vec<Vec<f64>> = tiles
        .iter()
        .map(|(t0, present)| {
            let rows = tile_samples(*t0, present, TILE / POOL_SCAN_EVERY);
            let attention: Vec<Vec<f64>> = rows
                .iter()
                .map(|&i| attention_before(q, k, lg, i, cs, channels))
                .collect();
            candidates
                .clone()
                .map(|j| attention.iter().map(|p| p[j]).sum::<f64>())
                .collect()
        })
        .collect();
    let mass: Vec<f64> = (0..candidates.len())
        .map(|m| tile_mass.iter().map(|t| t[m]).sum())
        .collect();
    let mut pool = best(
        &mass,
        candidates.start,
        (0..candidates.len()).collect(),
        n_pool,
    );
    pool.sort_unstable();
    (pool, tile_mass)
}

/// A tile's pool: the chunk's `pool` and the `n_own` candidates outside it with the most of
/// the tile's scanned attention `mass`, ascending.
fn tile_pool(pool: &[usize], mass: &[f64], candidates: &Range<usize>, n_own: usize) -> Vec<usize> {
    let outside: Vec<usize> = (0..candidates.len())
        .filter(|&m| pool.binary_search(&(candidates.start + m)).is_err())
        .collect();
    let mut p: Vec<usize> = pool.to_vec();
    p.extend(best(mass, candidates.start, outside, n_own));
    p.sort_unstable();
    p
}

/// The `n` of `among` (indices into `mass`) with the most `mass`, highest first, ties to the
/// lower; as positions (`first` + index).
fn best(mass: &[f64], first: usize, mut among: Vec<usize>, n: usize) -> Vec<usize> {
    among.sort_by(|&a, &b| mass[b].total_cmp(&mass[a]).then(a.cmp(&b)));
    among.truncate(n);
    among.into_iter().map(|m| first + m).collect()
}

/// Steps per unit: `total` steps, one at a time, to the unit whose estimate gains most (ties to
/// the lower unit), among those still below `coverage` and not at their last step.
fn spend_steps(units: &[Unit], total: usize, coverage: f64) -> Vec<usize> {
    let mut given = vec![0usize; units.len()];
    for _ in 0..total {
        let best = units
            .iter()
            .enumerate()
            .filter(|(u, unit)| {
                given[*u] + 1 < unit.estimate.len() && unit.estimate[given[*u]] < coverage
            })
            .map(|(u, unit)| (unit.estimate[given[u] + 1] - unit.estimate[given[u]], u))
            // the largest gain; among equal gains the lowest unit
            .fold(None::<(f64, usize)>, |best, (gain, u)| match best {
                Some((b, _)) if b >= gain => best,
                _ => Some((gain, u)),
            });
        match best {
            Some((_, u)) => given[u] += 1,
            None => break,
        }
    }
    given
}

/// H2O attention of every query head under [`Selection::Coverage`], the prompt arriving in
/// `calls` (consecutive ranges covering `[0, N)`; a call that starts inside a
/// chunk chooses that chunk's tiles again from its own rows). Chunk 0 attends to itself alone;
/// from chunk 1 on each query attends causally to its chunk and to its tile's memory, merged
/// exactly; scores add both softmaxes' column sums. A result's `memory_sets[c]` is the memory of
/// chunk `c + 1`'s last tile at the average budget (the engine's `h2o_mem_idx`), padded with −1
/// to M. Queries from `params.tail_start` on attend to every earlier position and score nothing.
///
/// [`Selection::Coverage`]: super::Selection::Coverage
#[must_use]
pub fn h2o_attention_coverage(
    q: &[Matrix],
    k: &[Matrix],
    v: &[Matrix],
    logits: impl Into<Logits>,
    params: &H2oParams,
    cp: &CoverageParams,
    calls: &[Range<usize>],
) -> Vec<HeadResult> {
    let logits = logits.into();
    let n = q[0].rows;
    let group = q.len() / k.len();
    let tail_start = params.tail_start.unwrap_or(usize::MAX);
    let mut results: Vec<HeadResult> = (0..q.len())
        .map(|_| HeadResult {
            output: Matrix::new(n, v[0].cols, vec![0.0; n * v[0].cols]),
            memory_sets: Vec::new(),
            scores: vec![0.0; n],
            build_scores: Vec::new(),
            key_sets: vec![Vec::new(); n],
        })
        .collect();
    for call in calls {
        for chunk in chunk_bounds(n, params.chunk) {
            let rows = chunk.start.max(call.start)..chunk.end.min(call.end);
            if rows.is_empty() {
                continue;
            }
            let tiles: Vec<Vec<TileMemory>> = if chunk.start == 0 {
                vec![vec![]; q.len()]
            } else {
                select_by_tiles(params, cp, q, k, logits, chunk.start, rows.clone())
            };
            for (h, r) in results.iter_mut().enumerate() {
                let (kh, vh) = (&k[h / group], &v[h / group]);
                for i in rows.clone() {
                    let memory: &[usize] = tiles[h]
                        .iter()
                        .find(|t| t.rows.contains(&i))
                        .map_or(&[], |t| &t.memory);
                    let (row, keys) = if i >= tail_start {
                        let keys: Vec<usize> = (0..=i).collect();
                        (attend(q[h].row(i), kh, vh, logits, &keys).0.output(), keys)
                    } else {
                        attend_chunk_and_memory(
                            q[h].row(i),
                            kh,
                            vh,
                            logits,
                            chunk.start..=i,
                            memory,
                            &mut r.scores,
                        )
                    };
                    r.output.data[i * vh.cols..(i + 1) * vh.cols].copy_from_slice(&row);
                    r.key_sets[i] = keys;
                }
                if let Some(last) = tiles[h].last() {
                    let mut slots: Vec<i32> = last.at_average.iter().map(|&p| p as i32).collect();
                    slots.resize(params.memory_size(), -1);
                    let c = chunk.start / params.chunk;
                    r.memory_sets.truncate(c - 1);
                    r.memory_sets.push(MemorySet { slots });
                }
            }
        }
    }
    results
}

#[cfg(test)]
mod tests {
    use super::super::{dense_attention, Selection};
    use super::*;

    /// Deterministic values in [-amp, amp).
    fn matrix(seed: u64, rows: usize, cols: usize, amp: f64) -> Matrix {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let data = (0..rows * cols)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                amp * ((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)
            })
            .collect();
        Matrix::new(rows, cols, data)
    }

    const D: usize = 8;
    const FULL: CoverageParams = CoverageParams {
        coverage: 1.0,
        samples: 4,
        sketch: 1,
        pool: 0,
    };

    fn params() -> H2oParams {
        H2oParams {
            chunk: 128,
            local: 16,
            heavy: 40,
            select: Selection::Coverage,
            sink: 2,
            tail_start: None,
        }
    }

    /// Two query heads reading one KV head; amplitude 2 makes attention peaked.
    fn inputs(n: usize) -> (Vec<Matrix>, Vec<Matrix>, Vec<Matrix>) {
        (
            vec![matrix(1, n, D, 2.0), matrix(2, n, D, 2.0)],
            vec![matrix(3, n, D, 2.0)],
            vec![matrix(4, n, D, 1.0)],
        )
    }

    #[test]
    fn each_query_attends_exactly_to_its_chunk_and_its_tiles_memory() {
        let n = 3 * 128 + 40;
        let (q, k, v) = inputs(n);
        let p = params();
        let scale = 1.0 / (D as f64).sqrt();
        let results =
            h2o_attention_coverage(&q, &k, &v, scale, &p, &FULL, std::slice::from_ref(&(0..n)));
        for (h, r) in results.iter().enumerate() {
            // the key sets written out: the tile memories chosen for this head, plus the chunk
            let mut expected: Vec<Vec<usize>> = Vec::new();
            for i in 0..n {
                let cs = i / p.chunk * p.chunk;
                let mut keys: Vec<usize> = if cs == 0 {
                    Vec::new()
                } else {
                    let tiles =
                        select_by_tiles(&p, &FULL, &q, &k, scale, cs, cs..(cs + p.chunk).min(n));
                    let t = tiles[h].iter().find(|t| t.rows.contains(&i)).unwrap();
                    t.memory.clone()
                };
                keys.extend(cs..=i);
                expected.push(keys);
            }
            let dense = dense_attention(&q[h], &k[0], &v[0], scale, &expected);
            let worst = dense
                .data
                .iter()
                .zip(&r.output.data)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-12, "head {h}: {worst}");
            // every query adds one intra softmax, and one memory softmax from chunk 1 on
            let total: f64 = r.scores.iter().sum();
            let want = (p.chunk + 2 * (n - p.chunk)) as f64;
            assert!(
                (total - want).abs() < 1e-9,
                "head {h}: scores sum {total}, want {want}"
            );
        }
    }

    /// Properties of every choice, over random shapes: the memory holds the sinks and the local
    /// window, only earlier positions, each once, ranked positions in whole steps and at most
    /// 4·H of them; the units hold on average the heavy budget less the sinks (in whole steps),
    /// and a lower coverage target never spends more.
    #[test]
    fn memories_hold_the_forced_positions_and_spend_the_average_budget() {
        for seed in 0..24u64 {
            let chunk = [64, 128, 192][seed as usize % 3];
            let (local, heavy) = (
                [8, 16, 0][seed as usize % 3],
                [24, 40, 33][seed as usize / 3 % 3],
            );
            let sink = [0, 2, 4][seed as usize / 9 % 3];
            let p = H2oParams {
                chunk,
                local,
                heavy,
                select: Selection::Coverage,
                sink,
                tail_start: None,
            };
            let n = 3 * chunk;
            let q = vec![
                matrix(seed * 3 + 1, n, D, 2.0),
                matrix(seed * 3 + 2, n, D, 2.0),
            ];
            let k = vec![matrix(seed * 3 + 3, n, D, 2.0)];
            let scale = 1.0 / (D as f64).sqrt();
            for cs in [chunk, 2 * chunk] {
                let rows = cs + (seed as usize % 5)..cs + chunk;
                let cp = CoverageParams {
                    coverage: 1.0,
                    samples: [4, 8, 1][seed as usize % 3],
                    sketch: [1, 4, 2, 8][seed as usize % 4],
                    pool: [0, MAX_HEAVY_FACTOR * heavy][seed as usize / 2 % 2],
                };
                let full = select_by_tiles(&p, &cp, &q, &k, scale, cs, rows.clone());
                let part = select_by_tiles(
                    &p,
                    &CoverageParams {
                        coverage: 0.97,
                        ..cp
                    },
                    &q,
                    &k,
                    scale,
                    cs,
                    rows.clone(),
                );
                let forced: Vec<usize> = (0..sink).chain(cs - local..cs).collect();
                let mut ranked_total = 0;
                for t in full.iter().flatten() {
                    let what = format!("seed {seed}, chunk at {cs}, tile {:?}", t.rows);
                    assert!(
                        t.memory.windows(2).all(|w| w[0] < w[1]),
                        "{what}: ascending, once each"
                    );
                    assert!(
                        t.memory.iter().all(|&j| j < cs),
                        "{what}: only earlier positions"
                    );
                    assert!(
                        forced.iter().all(|f| t.memory.contains(f)),
                        "{what}: sinks and local window"
                    );
                    let ranked = t.memory.len() - forced.len();
                    assert_eq!(ranked % BUDGET_STEP, 0, "{what}: whole steps");
                    assert!(ranked <= MAX_HEAVY_FACTOR * heavy, "{what}: at most 4 H");
                    ranked_total += ranked;
                    assert_eq!(t.at_average.len(), forced.len() + (heavy - sink), "{what}");
                }
                let units = full.iter().flatten().count();
                assert_eq!(units, 2 * tiles_of(cs, &rows).len());
                assert_eq!(
                    ranked_total,
                    units * (heavy - sink) / BUDGET_STEP * BUDGET_STEP,
                    "seed {seed}: the average budget, in whole steps"
                );
                let part_total: usize = part
                    .iter()
                    .flatten()
                    .map(|t| t.memory.len() - forced.len())
                    .sum();
                assert!(
                    part_total <= ranked_total,
                    "seed {seed}: a lower target spends no more"
                );
            }
        }
    }

    /// A pool proposes only where the chunk has more candidates than a tile's pool holds: below
    /// that the memories are those without a pool; above it they differ from them (these inputs
    /// attend widely, so a pool of the minimum size misses positions the samples would choose).
    #[test]
    fn a_pool_acts_only_where_the_candidates_outnumber_it() {
        let n = 4 * 128;
        let (q, k, _) = inputs(n);
        let p = params();
        let pool = CoverageParams {
            pool: MAX_HEAVY_FACTOR * p.heavy,
            ..FULL
        };
        // chunk 1 has 128 − 16 − 2 = 110 candidates, chunk 3 has 366 (more than 160 + 40)
        let without = select_by_tiles(&p, &FULL, &q, &k, 0.35, 128, 128..256);
        assert_eq!(
            select_by_tiles(&p, &pool, &q, &k, 0.35, 128, 128..256),
            without
        );
        let without = select_by_tiles(&p, &FULL, &q, &k, 0.35, 384, 384..512);
        let with = select_by_tiles(&p, &pool, &q, &k, 0.35, 384, 384..512);
        assert_ne!(with, without);
        for (a, b) in with.iter().flatten().zip(without.iter().flatten()) {
            assert_eq!(
                a.memory.len(),
                b.memory.len(),
                "the same budget, spent elsewhere"
            );
        }
    }

    #[test]
    fn a_low_coverage_target_keeps_budget_unspent() {
        let n = 2 * 128;
        let (q, k, _) = inputs(n);
        let p = params();
        let low = CoverageParams {
            coverage: 0.01,
            ..FULL
        };
        let tiles = select_by_tiles(&p, &low, &q, &k, 0.35, 128, 128..256);
        // the chunk and the forced positions alone cover more than 1 % of any query's attention
        for t in tiles.iter().flatten() {
            assert_eq!(t.memory.len(), p.sink + p.local);
        }
    }

    #[test]
    fn steps_go_to_the_largest_gain_below_the_target_ties_to_the_lower_unit() {
        let unit = |estimate: Vec<f64>| Unit {
            forced: vec![],
            ranked: vec![],
            estimate,
        };
        // unit 0 gains little; 1 gains most at first; 2 gains as much as 1 does later
        let units = [
            unit(vec![0.5, 0.55, 0.6]),
            unit(vec![0.2, 0.6, 0.7]),
            unit(vec![0.4, 0.5, 0.9]),
        ];
        assert_eq!(spend_steps(&units, 1, 1.0), vec![0, 1, 0]);
        // second step: unit 0 (+0.05), 1 (+0.1), 2 (+0.1): the tie goes to unit 1
        assert_eq!(spend_steps(&units, 2, 1.0), vec![0, 2, 0]);
        assert_eq!(spend_steps(&units, 4, 1.0), vec![0, 2, 2]);
        // a unit at or above the target takes no more
        assert_eq!(spend_steps(&units, 6, 0.5), vec![0, 1, 1]);
    }

    #[test]
    fn tiles_and_samples_follow_the_chunk_and_the_call() {
        assert_eq!(
            tiles_of(128, &(128..256)),
            vec![(128, 128..192), (192, 192..256)]
        );
        assert_eq!(
            tiles_of(128, &(150..200)),
            vec![(128, 150..192), (192, 192..200)]
        );
        assert_eq!(tile_samples(128, &(128..192), 4), vec![143, 159, 175, 191]);
        assert_eq!(tile_samples(128, &(150..192), 4), vec![159, 175, 191]);
        assert_eq!(tile_samples(192, &(192..200), 4), vec![199]);
        assert_eq!(tile_samples(128, &(128..192), 2), vec![159, 191]);
        assert_eq!(tile_samples(128, &(128..192), 64).len(), 64);
    }
}
