//! The ways a memory can be chosen, each as a ranking of the far positions for a unit of queries
//! (a chunk, a tile of queries, or one query): oracles that know the true attention, and the
//! estimators a kernel could afford, each with what it estimates and what it costs.

use std::ops::Range;

use super::attention::ChunkAttention;
use super::estimates::{antidiagonal_masses, sparq_masses, BlockSummaries};
use super::{DenseLayer, StudyConfig};

/// Which queries share one memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Granularity {
    Chunk,
    Tile,
    Query,
}

/// A way of ranking the far positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// One set per chunk and head: the positions with the most attention from the chunk's
    /// queries (today's design, chosen with hindsight).
    OracleChunk,
    /// As `OracleChunk`, but the last L positions always, then the best others (today's rule's
    /// shape: local window plus heavy hitters).
    OracleChunkLocal,
    /// One set per tile of queries, by the tile's attention.
    OracleTile,
    /// Per tile, whole blocks of `block` positions, by the tile's attention on each block.
    OracleTileBlocks,
    /// Each query its own best positions.
    OracleQuery,
    /// Per tile: the exact attention of every `every`-th query of the tile, token by token.
    SampledQueries { every: usize },
    /// Per tile: the sampled queries' ranking and the seed rule's accumulated scores taken in
    /// turn (a hybrid of what the tile points at and what earlier chunks drew attention to).
    SampledAndScores { every: usize },
    /// Per tile, in two stages, as the `coverage` kernel does: 4 H candidates, the best of the
    /// sampled queries' attention, then `from_scores` more by the accumulated scores and
    /// `from_prev` more from the previous tile's final ranking (where not already in); every
    /// query of the tile then computes its logits on the forced positions and the candidates,
    /// which are ranked by the tile's attention on them, each query normalised over its chunk,
    /// the forced positions and the candidates. The estimate is that attention. With
    /// `rank_every` > 1 only every `rank_every`-th query of the tile ranks (and estimates), at
    /// that share of the second stage's cost. With `propose_every` > 1 only every
    /// `propose_every`-th tile of a chunk proposes (the first one always); the tiles between
    /// rank the candidates the tile before them ranked, at that share of the first stage's cost.
    SampledRefined {
        every: usize,
        from_scores: usize,
        from_prev: usize,
        taper: bool,
        rank_every: usize,
        propose_every: usize,
    },
    /// Per tile, two stages: every query of the tile estimates its logits from its `r`
    /// largest-magnitude channels only (SparQ), a softmax at SparQ's corrected temperature; the
    /// 4 H candidates with the most of that estimated attention are then ranked as in
    /// `SampledRefined`. With `taper`, both keep the local window only as far as
    /// `SampledTapered` does.
    SparqRefined { r: usize, taper: bool },
    /// As `SampledQueries`, but the local window a tile keeps shrinks by the tile's offset in
    /// its chunk (a tile `o` queries in sees `o` recent positions of its own chunk already), so
    /// later tiles spend more of their budget on far positions.
    SampledTapered { every: usize },
    /// As `SampledQueries`, with the logits computed in the `rank` leading principal
    /// directions of the layer's keys (from the first chunk's keys), at `rank / head_dim` of
    /// the cost per sampled query.
    SampledLowRank { every: usize, rank: usize },
    /// Per tile: a softmax over blocks of `block` keys, each summarised by its mean key
    /// (logit + ln of the block's size), for every query of the tile.
    MeanKeys,
    /// Per tile: Quest's per-channel key bounds of each block, for every query of the tile.
    KeyBounds,
    /// Per tile: each query's logits on every 8th key along antidiagonals (XAttention's
    /// stride-8 pattern), a softmax over those.
    Antidiagonal,
    /// Per chunk: the exact attention of the chunk's last 64 queries (MInference's vertical
    /// lines).
    LastQueries,
    /// Per chunk: today's `query` estimator (key bounds of blocks of 16, a softmax over blocks
    /// for 64 sampled queries).
    TodaysQuery,
}

/// Every strategy, in the report's order.
pub const ALL: [Strategy; 42] = [
    Strategy::OracleChunk,
    Strategy::OracleChunkLocal,
    Strategy::OracleTile,
    Strategy::OracleTileBlocks,
    Strategy::OracleQuery,
    Strategy::SampledQueries { every: 8 },
    Strategy::SampledQueries { every: 16 },
    Strategy::SampledQueries { every: 32 },
    Strategy::SampledAndScores { every: 16 },
    Strategy::SampledRefined {
        every: 16,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 1,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 16,
        from_scores: 256,
        from_prev: 256,
        taper: false,
        rank_every: 1,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 8,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 1,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 4,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 1,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 16,
        from_scores: 0,
        from_prev: 0,
        taper: true,
        rank_every: 1,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 4,
        from_scores: 0,
        from_prev: 0,
        taper: true,
        rank_every: 1,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 4,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 2,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 4,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 4,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 8,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 2,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 8,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 4,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 16,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 4,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 8,
        from_scores: 0,
        from_prev: 0,
        taper: true,
        rank_every: 2,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 8,
        from_scores: 0,
        from_prev: 0,
        taper: true,
        rank_every: 4,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 16,
        from_scores: 0,
        from_prev: 0,
        taper: true,
        rank_every: 2,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 16,
        from_scores: 0,
        from_prev: 0,
        taper: true,
        rank_every: 4,
        propose_every: 1,
    },
    Strategy::SampledRefined {
        every: 4,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 1,
        propose_every: 2,
    },
    Strategy::SampledRefined {
        every: 4,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 2,
        propose_every: 2,
    },
    Strategy::SampledRefined {
        every: 4,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 2,
        propose_every: 4,
    },
    Strategy::SampledRefined {
        every: 8,
        from_scores: 0,
        from_prev: 0,
        taper: false,
        rank_every: 2,
        propose_every: 2,
    },
    Strategy::SparqRefined { r: 4, taper: false },
    Strategy::SparqRefined { r: 8, taper: false },
    Strategy::SparqRefined {
        r: 16,
        taper: false,
    },
    Strategy::SparqRefined { r: 4, taper: true },
    Strategy::SparqRefined { r: 8, taper: true },
    Strategy::SampledTapered { every: 16 },
    Strategy::SampledLowRank { every: 4, rank: 16 },
    Strategy::SampledLowRank { every: 8, rank: 32 },
    Strategy::SampledLowRank { every: 4, rank: 8 },
    Strategy::MeanKeys,
    Strategy::KeyBounds,
    Strategy::Antidiagonal,
    Strategy::LastQueries,
    Strategy::TodaysQuery,
];

/// The key stride of [`Strategy::Antidiagonal`].
pub const SAMPLE_EVERY: usize = 8;
/// Queries at the end of a chunk that [`Strategy::LastQueries`] computes exactly.
pub const LAST_QUERIES: usize = 64;

impl Strategy {
    #[must_use]
    pub fn name(self) -> String {
        match self {
            Self::SampledQueries { every } => {
                return format!("sampled queries (1 in {every}) per tile")
            }
            Self::SampledAndScores { every } => {
                return format!("sampled queries (1 in {every}) and accumulated scores, per tile")
            }
            Self::SampledTapered { every } => {
                return format!("sampled queries (1 in {every}), local window tapered per tile")
            }
            Self::SampledLowRank { every, rank } => {
                return format!("sampled queries (1 in {every}) in {rank} principal key directions, per tile")
            }
            Self::SparqRefined { r, taper } => {
                return format!(
                    "two stages: every query's {r} largest channels (SparQ) name 4 H candidates, all queries rank them, per tile{}",
                    if taper { ", local window tapered" } else { "" }
                )
            }
            Self::SampledRefined {
                every,
                from_scores,
                from_prev,
                taper,
                rank_every,
                propose_every,
            } => {
                let rankers = if rank_every == 1 {
                    "all queries".to_string()
                } else {
                    format!("1 query in {rank_every}")
                };
                let proposers = if propose_every == 1 {
                    String::new()
                } else {
                    format!(" of 1 tile in {propose_every}")
                };
                return format!(
                    "two stages: sampled queries (1 in {every}){proposers} + {from_scores} by scores + {from_prev} from the previous tile name 4 H candidates, {rankers} rank them, per tile{}",
                    if taper { ", local window tapered" } else { "" }
                )
            }
            Self::OracleChunk => "oracle: per chunk",
            Self::OracleChunkLocal => "oracle: per chunk, local L + best others",
            Self::OracleTile => "oracle: per tile",
            Self::OracleTileBlocks => "oracle: per tile, in blocks",
            Self::OracleQuery => "oracle: per query",
            Self::MeanKeys => "mean keys of blocks, per tile",
            Self::KeyBounds => "key bounds of blocks (Quest), per tile",
            Self::Antidiagonal => "antidiagonal keys (stride 8), per tile",
            Self::LastQueries => "last 64 queries (vertical), per chunk",
            Self::TodaysQuery => "today's query estimator, per chunk",
        }
        .to_string()
    }

    #[must_use]
    pub fn granularity(self) -> Granularity {
        match self {
            Self::OracleChunk | Self::OracleChunkLocal | Self::LastQueries | Self::TodaysQuery => {
                Granularity::Chunk
            }
            Self::OracleQuery => Granularity::Query,
            _ => Granularity::Tile,
        }
    }

    #[must_use]
    pub fn is_oracle(self) -> bool {
        matches!(
            self,
            Self::OracleChunk
                | Self::OracleChunkLocal
                | Self::OracleTile
                | Self::OracleTileBlocks
                | Self::OracleQuery
        )
    }

    /// Whether the estimator also estimates how much attention a budget covers, so that
    /// budgets can follow it. Key bounds are not a mass (they rank only).
    #[must_use]
    pub fn estimates_coverage(self) -> bool {
        !matches!(self, Self::KeyBounds | Self::TodaysQuery)
    }

    /// Multiply-adds the estimator spends for query `i` of a chunk starting at `start`, where
    /// the chunk has `rows` queries; full attention spends `2·d·(i + 1)` (Q·K and P·V).
    #[must_use]
    pub fn cost_macs(self, c: &StudyConfig, d: usize, start: usize, i: usize, rows: usize) -> f64 {
        let (d, w, i, rows) = (d as f64, start as f64, i as f64, rows as f64);
        let blocks = (i + 1.0) / c.block as f64;
        match self {
            s if s.is_oracle() => 0.0,
            // one query in `every` attends to every key up to itself
            Self::SampledQueries { every }
            | Self::SampledAndScores { every }
            | Self::SampledTapered { every } => d * (i + 1.0) / every as f64,
            Self::SampledLowRank { every, rank } => rank as f64 * (i + 1.0) / every as f64,
            // and every query's logits on the candidates
            Self::SparqRefined { r, .. } => {
                r as f64 * (i + 1.0) + d * ((4 * c.heavy + c.local) as f64).min(w)
            }
            Self::SampledRefined {
                every,
                rank_every,
                propose_every,
                ..
            } => {
                d * (i + 1.0) / (every * propose_every) as f64
                    + d * ((4 * c.heavy + c.local) as f64).min(w) / rank_every as f64
            }
            Self::MeanKeys => d * blocks,
            Self::KeyBounds => 2.0 * d * w / c.block as f64,
            Self::Antidiagonal => d * (i + 1.0) / SAMPLE_EVERY as f64,
            Self::LastQueries => LAST_QUERIES as f64 * d * (i + 1.0) / rows,
            Self::TodaysQuery => 64.0 * 2.0 * d * w / c.block as f64 / rows,
            _ => 0.0,
        }
    }
}

/// What an estimator believes a budget covers, for budgets that follow coverage.
#[derive(Debug, Clone)]
pub enum Estimate {
    /// The unit's coverage measured on these rows (exact queries the estimator computed).
    Rows(Vec<usize>),
    /// Estimated attention inside the chunk, and on each ranked position (mean per query).
    Masses { intra: f32, ranked: Vec<f32> },
}

/// One unit's ranking: the rows (queries) of the chunk that share it, the far positions best
/// first (forced positions first), and, where the strategy has one, its estimate.
#[derive(Debug, Clone)]
pub struct Ranked {
    pub rows: Range<usize>,
    pub order: Vec<u32>,
    /// Positions at the head of `order` that any budget keeps (sinks and the local window).
    pub forced: usize,
    pub estimate: Option<Estimate>,
}

/// The rankings of `strategy` for one head and chunk.
#[must_use]
pub fn rank(
    strategy: Strategy,
    c: &StudyConfig,
    layer: &DenseLayer,
    summaries: &BlockSummaries,
    head: usize,
    att: &ChunkAttention,
    scores: &[f64],
) -> Vec<Ranked> {
    let start = att.start;
    let kmax = c.max_budget().min(start);
    let units: Vec<Range<usize>> = match strategy.granularity() {
        #[allow(clippy::single_range_in_vec_init)] // one unit: the whole chunk
        Granularity::Chunk => vec![0..att.rows],
        Granularity::Tile => (0..att.rows)
            .step_by(c.tile)
            .map(|r| r..(r + c.tile).min(att.rows))
            .collect(),
        Granularity::Query => (0..att.rows).map(|r| r..r + 1).collect(),
    };
    // estimators keep the sinks and the local window, as a policy built on them would
    let forced: Vec<u32> = if strategy.is_oracle() && strategy != Strategy::OracleChunkLocal {
        Vec::new()
    } else if strategy == Strategy::OracleChunkLocal {
        (start.saturating_sub(c.local)..start)
            .map(|p| p as u32)
            .collect()
    } else {
        c.forced(start)
    };
    let mut prev: Option<Vec<u32>> = None;
    units
        .into_iter()
        .map(|rows| {
            let (order, estimate) = match strategy {
                // an oracle knows its coverage: its budgets can follow the truth
                Strategy::OracleChunk
                | Strategy::OracleChunkLocal
                | Strategy::OracleTile
                | Strategy::OracleQuery => {
                    let scores = column_sums(att, rows.clone());
                    (
                        order_positions(&scores, &forced, kmax),
                        Some(Estimate::Rows(rows.clone().collect())),
                    )
                }
                Strategy::OracleTileBlocks => {
                    let scores = column_sums(att, rows.clone());
                    let blocks = block_totals(&scores, c.block);
                    (
                        order_blocks(&blocks, c.block, start, &forced, kmax),
                        Some(Estimate::Rows(rows.clone().collect())),
                    )
                }
                Strategy::SampledQueries { every } | Strategy::SampledAndScores { every } => {
                    let sampled: Vec<usize> = rows
                        .clone()
                        .filter(|r| (r - rows.start) % every == every - 1)
                        .collect();
                    let sampled = if sampled.is_empty() {
                        vec![rows.end - 1]
                    } else {
                        sampled
                    };
                    let by_samples = order_positions(&column_sums_of(att, &sampled), &forced, kmax);
                    let order = if matches!(strategy, Strategy::SampledAndScores { .. }) {
                        let by_scores = order_positions(&scores[..start], &forced, kmax);
                        interleave(&by_samples, &by_scores, forced.len().min(kmax), kmax)
                    } else {
                        by_samples
                    };
                    (order, Some(Estimate::Rows(sampled)))
                }
                Strategy::SampledTapered { every } => {
                    let sampled = sampled_rows(rows.clone(), every);
                    let local = start.saturating_sub(c.local.saturating_sub(rows.start));
                    let tapered: Vec<u32> = forced
                        .iter()
                        .copied()
                        .filter(|&p| (p as usize) < c.sink || p as usize >= local)
                        .collect();
                    let order = order_positions(&column_sums_of(att, &sampled), &tapered, kmax);
                    return Ranked {
                        rows,
                        order,
                        forced: tapered.len().min(kmax),
                        estimate: Some(Estimate::Rows(sampled)),
                    };
                }
                Strategy::SampledLowRank { every, rank } => {
                    let sampled = sampled_rows(rows.clone(), every);
                    let masses = summaries.low_rank_masses(layer, head, start, &sampled, rank);
                    let order = order_positions(&masses, &forced, kmax);
                    (order, Some(Estimate::Rows(sampled)))
                }
                Strategy::SampledRefined {
                    every,
                    from_scores,
                    from_prev,
                    taper,
                    rank_every,
                    propose_every,
                } => {
                    let forced = tapered(c, &forced, start, rows.start, taper);
                    let tile = rows.start / c.tile;
                    let cand: Vec<u32> = match prev.as_ref() {
                        // a tile that does not propose ranks what the tile before it ranked
                        Some(p) if !tile.is_multiple_of(propose_every) => p.clone(),
                        _ => propose(
                            c,
                            att,
                            rows.clone(),
                            every,
                            &forced,
                            kmax,
                            scores,
                            from_scores,
                            prev.as_deref(),
                            from_prev,
                        ),
                    };
                    let rankers = sampled_rows(rows.clone(), rank_every);
                    let (refined, base, masses) = refine(att, &rankers, &forced, &cand);
                    let order: Vec<u32> = forced.iter().chain(&refined).copied().collect();
                    prev = Some(refined);
                    let n = rankers.len() as f32;
                    let mut ranked: Vec<f32> = forced.iter().map(|_| 0.0).collect();
                    ranked.extend(masses.iter().map(|&m| m as f32 / n));
                    (
                        order,
                        Some(Estimate::Masses {
                            intra: base as f32 / n,
                            ranked,
                        }),
                    )
                }
                Strategy::SparqRefined { r, taper } => {
                    let forced = tapered(c, &forced, start, rows.start, taper);
                    let approx = sparq_masses(layer, head, start, rows.clone(), r);
                    let by_approx = order_positions(&approx, &forced, kmax);
                    let n_forced = forced.len().min(kmax);
                    let n_cand = (4 * c.heavy).min(by_approx.len() - n_forced);
                    let cand = &by_approx[n_forced..n_forced + n_cand];
                    let rankers: Vec<usize> = rows.clone().collect();
                    let (refined, base, masses) = refine(att, &rankers, &forced, cand);
                    let order: Vec<u32> = forced.iter().chain(&refined).copied().collect();
                    let n = rows.len() as f32;
                    let mut ranked: Vec<f32> = forced.iter().map(|_| 0.0).collect();
                    ranked.extend(masses.iter().map(|&m| m as f32 / n));
                    (
                        order,
                        Some(Estimate::Masses {
                            intra: base as f32 / n,
                            ranked,
                        }),
                    )
                }
                Strategy::LastQueries => {
                    let last: Vec<usize> =
                        (rows.end.saturating_sub(LAST_QUERIES)..rows.end).collect();
                    let scores = column_sums_of(att, &last);
                    (
                        order_positions(&scores, &forced, kmax),
                        Some(Estimate::Rows(last)),
                    )
                }
                Strategy::MeanKeys | Strategy::Antidiagonal => {
                    let (per_pos, intra) = if strategy == Strategy::MeanKeys {
                        summaries.mean_key_masses(c, layer, head, start, rows.clone())
                    } else {
                        antidiagonal_masses(layer, head, start, rows.clone())
                    };
                    let blocks = block_totals(&per_pos, c.block);
                    let order = order_blocks(&blocks, c.block, start, &forced, kmax);
                    let n = rows.len() as f32;
                    let ranked = order
                        .iter()
                        .map(|&p| per_pos[p as usize] as f32 / n)
                        .collect();
                    (
                        order,
                        Some(Estimate::Masses {
                            intra: intra as f32 / n,
                            ranked,
                        }),
                    )
                }
                Strategy::KeyBounds | Strategy::TodaysQuery => {
                    let queries: Vec<usize> = if strategy == Strategy::KeyBounds {
                        rows.clone().collect()
                    } else {
                        crate::reference::query_sample(rows.clone())
                    };
                    // as today's estimator: a softmax over the candidate blocks only
                    let candidates = c.sink.min(start)..start.saturating_sub(c.local);
                    let blocks =
                        summaries.bound_shares(c, layer, head, start, candidates, &queries);
                    (order_blocks(&blocks, c.block, start, &forced, kmax), None)
                }
            };
            let n_forced = match strategy {
                Strategy::SampledRefined { taper, .. } | Strategy::SparqRefined { taper, .. } => {
                    tapered(c, &forced, start, rows.start, taper).len()
                }
                _ => forced.len(),
            };
            Ranked {
                rows,
                order,
                forced: n_forced.min(kmax),
                estimate,
            }
        })
        .collect()
}

/// The forced positions of a tile whose first query is `offset` into its chunk: with `taper`,
/// the sinks and only the last `L - offset` positions of the local window.
fn tapered(c: &StudyConfig, forced: &[u32], start: usize, offset: usize, taper: bool) -> Vec<u32> {
    if !taper {
        return forced.to_vec();
    }
    let local = start.saturating_sub(c.local.saturating_sub(offset));
    forced
        .iter()
        .copied()
        .filter(|&p| (p as usize) < c.sink || p as usize >= local)
        .collect()
}

/// The first stage of [`Strategy::SampledRefined`] for the tile of `rows`: 4 H candidates (after
/// the forced positions), `from_scores` by the accumulated scores, `from_prev` from the previous
/// tile's ranking, the rest by the attention of every `every`-th query of the tile.
#[allow(clippy::too_many_arguments)] // the strategy's fields and the unit's context
fn propose(
    c: &StudyConfig,
    att: &ChunkAttention,
    rows: Range<usize>,
    every: usize,
    forced: &[u32],
    kmax: usize,
    scores: &[f64],
    from_scores: usize,
    prev: Option<&[u32]>,
    from_prev: usize,
) -> Vec<u32> {
    let start = att.start;
    let sampled = sampled_rows(rows, every);
    let by_samples = order_positions(&column_sums_of(att, &sampled), forced, kmax);
    let n_forced = forced.len().min(kmax);
    let n_cand = (4 * c.heavy).min(by_samples.len() - n_forced);
    let mut taken = vec![false; start];
    forced.iter().for_each(|&p| taken[p as usize] = true);
    let mut cand: Vec<u32> = Vec::with_capacity(n_cand);
    let mut take = |from: &mut dyn Iterator<Item = u32>, n: usize, cand: &mut Vec<u32>| {
        let goal = (cand.len() + n).min(n_cand);
        for p in from {
            if cand.len() >= goal {
                break;
            }
            if !taken[p as usize] {
                taken[p as usize] = true;
                cand.push(p);
            }
        }
    };
    let by_scores = order_positions(&scores[..start], forced, kmax);
    take(
        &mut by_scores[n_forced..].iter().copied(),
        from_scores,
        &mut cand,
    );
    if let Some(p) = prev {
        take(&mut p.iter().copied(), from_prev, &mut cand);
    }
    take(
        &mut by_samples[n_forced..].iter().copied(),
        n_cand,
        &mut cand,
    );
    cand
}

/// Every `every`-th row of a tile (its last at least).
fn sampled_rows(rows: Range<usize>, every: usize) -> Vec<usize> {
    let sampled: Vec<usize> = rows
        .clone()
        .filter(|r| (r - rows.start) % every == every - 1)
        .collect();
    if sampled.is_empty() {
        vec![rows.end - 1]
    } else {
        sampled
    }
}

/// `candidates` by descending Σ over `rows` of each query's attention on them, each query
/// normalised over its chunk, `forced` and the candidates only (ties to the lower position);
/// with Σ over rows of the attention so normalised on the chunk and `forced`, and each ranked
/// candidate's Σ.
fn refine(
    att: &ChunkAttention,
    rows: &[usize],
    forced: &[u32],
    candidates: &[u32],
) -> (Vec<u32>, f64, Vec<f64>) {
    let mut score = vec![0f64; candidates.len()];
    let mut base = 0f64;
    for &r in rows {
        let far = att.far_row(r);
        let fixed = f64::from(att.intra[r])
            + forced
                .iter()
                .map(|&p| f64::from(far[p as usize]))
                .sum::<f64>();
        let z = fixed
            + candidates
                .iter()
                .map(|&p| f64::from(far[p as usize]))
                .sum::<f64>();
        base += fixed / z;
        for (s, &p) in score.iter_mut().zip(candidates) {
            *s += f64::from(far[p as usize]) / z;
        }
    }
    let mut idx: Vec<usize> = (0..candidates.len()).collect();
    idx.sort_by(|&a, &b| {
        score[b]
            .total_cmp(&score[a])
            .then(candidates[a].cmp(&candidates[b]))
    });
    (
        idx.iter().map(|&i| candidates[i]).collect(),
        base,
        idx.iter().map(|&i| score[i]).collect(),
    )
}

/// Σ over `rows` of each far position's attention.
fn column_sums(att: &ChunkAttention, rows: Range<usize>) -> Vec<f64> {
    column_sums_of(att, &rows.collect::<Vec<_>>())
}

fn column_sums_of(att: &ChunkAttention, rows: &[usize]) -> Vec<f64> {
    let mut s = vec![0f64; att.start];
    for &r in rows {
        for (x, &p) in s.iter_mut().zip(att.far_row(r)) {
            *x += f64::from(p);
        }
    }
    s
}

/// The first `forced` of `a` (equal in both), then `a` and `b` in turn, each position once.
fn interleave(a: &[u32], b: &[u32], forced: usize, kmax: usize) -> Vec<u32> {
    let mut seen = vec![
        false;
        a.iter()
            .chain(b)
            .map(|&p| p as usize + 1)
            .max()
            .unwrap_or(0)
    ];
    let mut out = Vec::with_capacity(kmax);
    let mut push = |p: u32, out: &mut Vec<u32>| {
        if !seen[p as usize] {
            seen[p as usize] = true;
            out.push(p);
        }
    };
    for &p in &a[..forced] {
        push(p, &mut out);
    }
    let (mut ia, mut ib) = (a[forced..].iter(), b[forced.min(b.len())..].iter());
    while out.len() < kmax {
        match (ia.next(), ib.next()) {
            (None, None) => break,
            (x, y) => {
                for p in x.into_iter().chain(y) {
                    if out.len() < kmax {
                        push(*p, &mut out);
                    }
                }
            }
        }
    }
    out
}

/// Sums of `per_pos` over blocks `[b·block, (b+1)·block)`.
fn block_totals(per_pos: &[f64], block: usize) -> Vec<f64> {
    per_pos.chunks(block).map(|b| b.iter().sum()).collect()
}

/// `forced`, then every other position by descending score (ties to the lower position), at
/// most `kmax` in all.
fn order_positions(scores: &[f64], forced: &[u32], kmax: usize) -> Vec<u32> {
    let mut rest: Vec<u32> = (0..scores.len() as u32)
        .filter(|p| !forced.contains(p))
        .collect();
    rest.sort_by(|&a, &b| {
        scores[b as usize]
            .total_cmp(&scores[a as usize])
            .then(a.cmp(&b))
    });
    forced.iter().copied().chain(rest).take(kmax).collect()
}

/// `forced`, then the positions of whole blocks by descending block score (ties to the lower
/// block), skipping forced positions, at most `kmax` in all.
fn order_blocks(
    blocks: &[f64],
    block: usize,
    start: usize,
    forced: &[u32],
    kmax: usize,
) -> Vec<u32> {
    let mut ids: Vec<usize> = (0..blocks.len()).collect();
    ids.sort_by(|&a, &b| blocks[b].total_cmp(&blocks[a]).then(a.cmp(&b)));
    let mut order = forced.to_vec();
    for b in ids {
        for p in b * block..((b + 1) * block).min(start) {
            if !forced.contains(&(p as u32)) {
                order.push(p as u32);
            }
        }
        if order.len() >= kmax {
            break;
        }
    }
    order.truncate(kmax);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_keep_forced_positions_first_and_never_repeat_one() {
        let scores = [0.1, 0.9, 0.3, 0.9, 0.0, 0.5];
        assert_eq!(order_positions(&scores, &[5], 4), vec![5, 1, 3, 2]);
        let blocks = block_totals(&scores, 2); // [1.0, 1.2, 0.5]
        assert_eq!(order_blocks(&blocks, 2, 6, &[3], 6), vec![3, 2, 0, 1, 4, 5]);
        assert_eq!(order_blocks(&blocks, 2, 5, &[], 3), vec![2, 3, 0]);
    }
}
