//! The headroom study of memory selection: on queries and keys captured from a real model's
//! full-attention prefill, how much of each query's attention a memory of a given budget covers
//! (its chunk's own keys plus the chosen far positions), for
//! - oracles that know the true attention, per chunk, per tile of queries, per query;
//! - today's policies (the seed rule, `query`, `hybrid`), run by [`crate::reference`];
//! - estimators a kernel could afford ([`Strategy`]), each with its cost in multiply-adds
//!   against full attention's;
//! - budgets that follow estimated coverage across heads and layers, at the same average.
//!
//! `h2o-cli coverage` is its front end; docs/results/coverage/README.md holds its results.

use std::ops::Range;

use serde::Serialize;

use crate::reference::{self, H2oParams, Matrix, Selection};
use h2o_llama::{Error, Result};
use h2o_llama::{H2oConfig, Model, Session, SessionConfig, Token};

mod allocate;
mod attention;
mod estimates;
pub mod remainder;
mod strategies;
pub mod study;

pub use allocate::{Pool, STEP};
pub use attention::ChunkAttention;
pub use strategies::{Granularity, Strategy};

use allocate::{mean_p10, spend, spread, Unit};
use estimates::BlockSummaries;
use strategies::rank;

/// The shape the study measures at.
#[derive(Debug, Clone, Serialize)]
pub struct StudyConfig {
    /// S: positions per chunk.
    pub chunk: usize,
    /// L, H: the memory M = L + H is the average budget of far positions per query.
    pub local: usize,
    pub heavy: usize,
    /// Sinks kept by the estimators and today's hybrid and `query`.
    pub sink: usize,
    /// Queries per tile for per-tile choices.
    pub tile: usize,
    /// Positions per block for block-wise choices.
    pub block: usize,
    /// Chunks before this one are not measured (chunk 0 has no far keys).
    pub first_chunk: usize,
    /// Only the estimators and oracles whose name contains this (today's policies always).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub only: Option<String>,
}

impl StudyConfig {
    /// The average budget, M = L + H.
    #[must_use]
    pub fn budget(&self) -> usize {
        self.local + self.heavy
    }

    /// The most one unit may get when budgets follow coverage: 4 M.
    #[must_use]
    pub fn max_budget(&self) -> usize {
        4 * self.budget()
    }

    /// The ways of choosing this study measures: every [`Strategy`], or those that `only` names,
    /// with today's `query` estimator last (its cost is that policy's).
    #[must_use]
    pub fn strategies(&self) -> Vec<Strategy> {
        strategies::ALL
            .iter()
            .copied()
            .filter(|s| {
                *s == Strategy::TodaysQuery
                    || self
                        .only
                        .as_ref()
                        .is_none_or(|o| s.name().contains(o.as_str()))
            })
            .collect()
    }

    /// The sinks and the local window of a chunk starting at `start`, ascending.
    #[must_use]
    pub fn forced(&self, start: usize) -> Vec<u32> {
        let local = start.saturating_sub(self.local);
        (0..self.sink.min(local))
            .chain(local..start)
            .map(|p| p as u32)
            .collect()
    }

    /// # Errors
    /// [`Error::InvalidConfig`] naming the parameter.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.budget() == 0 || !self.budget().is_multiple_of(STEP) {
            return bad(format!(
                "the study's budget M = L + H = {} must be a positive multiple of {STEP}",
                self.budget()
            ));
        }
        if self.budget() >= self.chunk {
            return bad(format!(
                "M = L + H = {} must be smaller than the chunk size {}",
                self.budget(),
                self.chunk
            ));
        }
        if self.tile == 0 || self.block == 0 || self.first_chunk == 0 {
            return bad("tile, block and first chunk must be at least 1".into());
        }
        Ok(())
    }
}

/// One layer's queries and keys (and values, for today's policies) over a whole prompt.
#[derive(Debug, Clone)]
pub struct DenseLayer {
    pub layer: u32,
    pub n_pos: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub scale: f32,
    /// `[position][head][head_dim]`
    pub q: Vec<f32>,
    /// `[position][kv head][head_dim]`
    pub k: Vec<f32>,
    /// `[position][kv head][head_dim_v]`
    pub v: Vec<f32>,
}

impl DenseLayer {
    #[must_use]
    pub fn kv_head(&self, head: usize) -> usize {
        head / (self.n_head / self.n_head_kv)
    }

    #[must_use]
    pub fn q_row(&self, pos: usize, head: usize) -> &[f32] {
        let d = self.head_dim;
        let at = (pos * self.n_head + head) * d;
        &self.q[at..at + d]
    }

    /// The key at `pos` that query head `head` reads.
    #[must_use]
    pub fn k_row(&self, pos: usize, head: usize) -> &[f32] {
        let d = self.head_dim;
        let at = (pos * self.n_head_kv + self.kv_head(head)) * d;
        &self.k[at..at + d]
    }

    fn head_matrices(&self, head: usize) -> (Matrix, Matrix, Matrix) {
        let (d, dv, kv) = (self.head_dim, self.head_dim_v, self.kv_head(head));
        let rows = |data: &[f32], width: usize, stride: usize, at: usize| -> Matrix {
            let m: Vec<f64> = (0..self.n_pos)
                .flat_map(|p| {
                    let o = (p * stride + at) * width;
                    data[o..o + width].iter().map(|&x| f64::from(x))
                })
                .collect();
            Matrix::new(self.n_pos, width, m)
        };
        (
            rows(&self.q, d, self.n_head, head),
            rows(&self.k, d, self.n_head_kv, kv),
            rows(&self.v, dv, self.n_head_kv, kv),
        )
    }
}

/// Runs `tokens` through `model` with full attention in one call, with every layer's attention
/// captured (the H2O op's dense tail covering the whole prompt computes full attention), and
/// returns the captured layers: those in `layers`, or all with an H2O op (the global layers of a
/// model with sliding-window layers).
///
/// # Errors
/// Context creation, the prefill or the capture failed.
pub fn capture_dense(
    model: &Model,
    tokens: &[Token],
    layers: Option<&[u32]>,
    n_threads: u32,
) -> Result<Vec<DenseLayer>> {
    let n = tokens.len() as u32;
    let config = SessionConfig {
        n_ctx: n,
        n_batch: n,
        n_ubatch: 512.min(n),
        n_threads,
        h2o: Some(H2oConfig {
            dense_tail: n,
            ..H2oConfig::seed(1, 1)
        }),
        capture_attention: true,
        ..SessionConfig::default()
    };
    let mut session = Session::new(model, config)?;
    session.capture_only_layers(layers.map(<[u32]>::to_vec))?;
    session.evaluate(tokens)?;
    let mut captures = session.take_attention_captures()?;
    captures.sort_by_key(|c| (c.layer, c.p0));
    let mut out: Vec<DenseLayer> = Vec::new();
    for c in captures {
        if out.last().is_none_or(|l| l.layer != c.layer) {
            out.push(DenseLayer {
                layer: c.layer,
                n_pos: 0,
                n_head: c.n_head as usize,
                n_head_kv: c.n_head_kv as usize,
                head_dim: c.head_dim as usize,
                head_dim_v: c.head_dim_v as usize,
                scale: c.scale,
                q: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
            });
        }
        let l = out.last_mut().expect("pushed");
        l.q.extend_from_slice(&c.q);
        l.n_pos = (c.p0 + c.n_tokens) as usize;
        // each call's capture holds every position so far: keep the latest
        l.k = c.k;
        l.v = c.v;
    }
    if out.is_empty() {
        return Err(Error::InvalidConfig(
            "no attention layer was captured: check --layers against the model's layers".into(),
        ));
    }
    Ok(out)
}

/// One line of the result.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub strategy: String,
    pub granularity: String,
    pub budget: String,
    /// Mean and 10th percentile over the measured queries of the attention covered.
    pub coverage_mean: f64,
    pub coverage_p10: f64,
    /// Budgets given to units (positions): 10th, 50th, 90th percentile.
    pub budget_spread: [usize; 3],
    /// What the estimator costs, as a share of full attention's multiply-adds at this length.
    pub cost_share: f64,
}

/// How far a layer's attention reaches.
#[derive(Debug, Clone, Serialize)]
pub struct LayerReach {
    pub layer: u32,
    /// Mean over queries of the attention outside their own chunk: over all heads, and the
    /// lowest and highest head.
    pub far_mean: f64,
    pub far_lowest_head: f64,
    pub far_highest_head: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub config: StudyConfig,
    pub n_tokens: usize,
    pub layers: Vec<LayerReach>,
    pub rows: Vec<Row>,
}

/// Today's policies, run by the reference on the captured layer.
const POLICIES: [(&str, Selection, usize); 2] = [
    ("today: seed rule (h2o, sink 0)", Selection::Seed, 0),
    (
        "today: hybrid (sink), the default",
        Selection::Hybrid,
        usize::MAX,
    ),
];

/// What one (layer, head) contributes.
#[derive(Default)]
struct HeadResult {
    /// per strategy, its units
    units: Vec<Vec<Unit>>,
    /// per policy, each measured query's coverage
    policies: Vec<Vec<f32>>,
    /// per strategy, Σ of its cost and of full attention's
    cost: Vec<f64>,
    full_cost: f64,
    far: Vec<f32>,
}

/// Runs the study on `layers` (from [`capture_dense`]), on `threads` threads, calling
/// `progress(done, total)` after each (layer, head).
///
/// # Errors
/// [`Error::InvalidConfig`] for bad parameters or a prompt shorter than two chunks.
pub fn run(
    layers: &[DenseLayer],
    config: &StudyConfig,
    threads: usize,
    progress: impl Fn(usize, usize) + Sync,
) -> Result<Report> {
    config.validate()?;
    let n_pos = layers.first().map_or(0, |l| l.n_pos);
    if n_pos <= config.first_chunk * config.chunk {
        return Err(Error::InvalidConfig(format!(
            "the prompt has {n_pos} tokens: the study needs more than {} (it measures chunks from {} on, of {} tokens)",
            config.first_chunk * config.chunk,
            config.first_chunk,
            config.chunk
        )));
    }
    let jobs: Vec<(usize, usize)> = layers
        .iter()
        .enumerate()
        .flat_map(|(li, l)| (0..l.n_head).map(move |h| (li, h)))
        .collect();
    let done = std::sync::atomic::AtomicUsize::new(0);
    let summaries: Vec<BlockSummaries> = layers
        .iter()
        .map(|l| BlockSummaries::of(l, config.block))
        .collect();
    let results: Vec<((usize, usize), HeadResult)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|t| {
                let (jobs, done, progress, summaries) = (&jobs, &done, &progress, &summaries);
                s.spawn(move || {
                    jobs.iter()
                        .skip(t)
                        .step_by(threads.max(1))
                        .map(|&(li, h)| {
                            let r = study_head(&layers[li], &summaries[li], li, h, config);
                            let n = done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                            progress(n, jobs.len());
                            ((li, h), r)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("study thread"))
            .collect()
    });
    Ok(summarise(layers, config, n_pos, results))
}

fn study_head(
    layer: &DenseLayer,
    summaries: &BlockSummaries,
    li: usize,
    head: usize,
    c: &StudyConfig,
) -> HeadResult {
    let chunks: Vec<Range<usize>> = reference::chunk_bounds(layer.n_pos, c.chunk)
        .into_iter()
        .skip(c.first_chunk)
        .collect();
    let (q, k, v) = layer.head_matrices(head);
    let mut seed_scores = Vec::new();
    let policy_sets: Vec<Vec<reference::MemorySet>> = POLICIES
        .iter()
        .map(|&(_, select, sink)| {
            let params = H2oParams {
                chunk: c.chunk,
                local: c.local,
                heavy: c.heavy,
                select,
                sink: sink.min(c.sink).min(c.heavy),
                tail_start: None,
            };
            let r = reference::h2o_attention_head(&q, &k, &v, f64::from(layer.scale), &params);
            if select == Selection::Seed {
                // what earlier chunks drew attention to, for the hybrid estimators
                seed_scores = r.build_scores;
            }
            r.memory_sets
        })
        .collect();
    let steps = c.max_budget() / STEP;
    let measured = c.strategies();
    let mut out = HeadResult {
        units: vec![Vec::new(); measured.len()],
        policies: vec![Vec::new(); POLICIES.len()],
        cost: vec![0.0; measured.len()],
        ..HeadResult::default()
    };
    for chunk in chunks {
        let ci = chunk.start / c.chunk;
        let att = ChunkAttention::of(layer, head, chunk.start, chunk.end);
        for (si, &s) in measured.iter().enumerate() {
            let scores = &seed_scores[ci - 1];
            for ranked in rank(s, c, layer, summaries, head, &att, scores) {
                out.units[si].push(Unit::of((li, ci, head), &att, &ranked, steps));
            }
            for i in chunk.clone() {
                out.cost[si] += s.cost_macs(c, layer.head_dim, chunk.start, i, att.rows);
            }
        }
        for (pi, sets) in policy_sets.iter().enumerate() {
            let set: Vec<usize> = sets[ci - 1].positions().collect();
            for r in 0..att.rows {
                let far = att.far_row(r);
                let covered: f64 = set.iter().map(|&p| f64::from(far[p])).sum();
                out.policies[pi].push((f64::from(att.intra[r]) + covered) as f32);
            }
        }
        out.full_cost += chunk
            .clone()
            .map(|i| 2.0 * (layer.head_dim * (i + 1)) as f64)
            .sum::<f64>();
        out.far.extend(att.intra.iter().map(|x| 1.0 - x));
    }
    out
}

fn summarise(
    layers: &[DenseLayer],
    c: &StudyConfig,
    n_tokens: usize,
    mut results: Vec<((usize, usize), HeadResult)>,
) -> Report {
    results.sort_by_key(|(k, _)| *k);
    let full_cost: f64 = results.iter().map(|(_, r)| r.full_cost).sum();
    let budget_steps = c.budget() / STEP;
    let measured = c.strategies();
    let mut rows = Vec::new();
    for (pi, (name, select, _)) in POLICIES.iter().enumerate() {
        let cov: Vec<f32> = results
            .iter()
            .flat_map(|(_, r)| r.policies[pi].iter().copied())
            .collect();
        let (mean, p10) = mean_p10(&cov);
        let cost = if *select == Selection::Seed {
            0.0
        } else {
            results
                .iter()
                .map(|(_, r)| r.cost[measured.len() - 1])
                .sum::<f64>()
                / full_cost
        };
        rows.push(Row {
            strategy: (*name).to_string(),
            granularity: "chunk".into(),
            budget: Pool::Fixed.name().into(),
            coverage_mean: mean,
            coverage_p10: p10,
            budget_spread: [c.budget(); 3],
            cost_share: cost,
        });
    }
    for (si, &s) in measured.iter().enumerate() {
        let units: Vec<Unit> = results
            .iter_mut()
            .flat_map(|(_, r)| std::mem::take(&mut r.units[si]))
            .collect();
        let cost = results.iter().map(|(_, r)| r.cost[si]).sum::<f64>() / full_cost;
        let pools: &[Pool] = if s.estimates_coverage() && s.granularity() != Granularity::Query {
            match s.granularity() {
                Granularity::Tile => &[Pool::Fixed, Pool::Tiles, Pool::Heads, Pool::HeadsAndLayers],
                _ => &[Pool::Fixed, Pool::Heads, Pool::HeadsAndLayers],
            }
        } else {
            &[Pool::Fixed]
        };
        for &pool in pools {
            let spent = spend(&units, pool, budget_steps);
            let (mean, p10) = mean_p10(&spent.coverage);
            rows.push(Row {
                strategy: s.name(),
                granularity: serde_json::to_value(s.granularity())
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                budget: pool.name().into(),
                coverage_mean: mean,
                coverage_p10: p10,
                budget_spread: spread(&spent.budgets),
                cost_share: cost,
            });
        }
    }
    let reach = layers
        .iter()
        .enumerate()
        .map(|(li, l)| {
            let heads: Vec<f64> = results
                .iter()
                .filter(|((x, _), _)| *x == li)
                .map(|(_, r)| r.far.iter().map(|&x| f64::from(x)).sum::<f64>() / r.far.len() as f64)
                .collect();
            LayerReach {
                layer: l.layer,
                far_mean: heads.iter().sum::<f64>() / heads.len() as f64,
                far_lowest_head: heads.iter().copied().fold(f64::INFINITY, f64::min),
                far_highest_head: heads.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect();
    Report {
        config: c.clone(),
        n_tokens,
        layers: reach,
        rows,
    }
}

impl Report {
    /// The result as markdown tables.
    #[must_use]
    pub fn markdown(&self) -> String {
        let c = &self.config;
        let mut s = format!(
            "{} tokens, S = {}, average budget M = L + H = {} ({} + {}), tiles of {} queries, blocks of {}; queries of chunks {} on\n\n",
            self.n_tokens, c.chunk, c.budget(), c.local, c.heavy, c.tile, c.block, c.first_chunk
        );
        s += "| layer | attention outside the chunk, mean | lowest head | highest head |\n|---:|---:|---:|---:|\n";
        for l in &self.layers {
            s += &format!(
                "| {} | {:.3} | {:.3} | {:.3} |\n",
                l.layer, l.far_mean, l.far_lowest_head, l.far_highest_head
            );
        }
        s += "\n| strategy | unit | budget | covered, mean | covered, p10 | budgets p10 / p50 / p90 | estimator cost (of full attention) |\n|---|---|---|---:|---:|---|---:|\n";
        for r in &self.rows {
            s += &format!(
                "| {} | {} | {} | {:.4} | {:.4} | {} / {} / {} | {:.1} % |\n",
                r.strategy,
                r.granularity,
                r.budget,
                r.coverage_mean,
                r.coverage_p10,
                r.budget_spread[0],
                r.budget_spread[1],
                r.budget_spread[2],
                100.0 * r.cost_share
            );
        }
        s
    }
}
