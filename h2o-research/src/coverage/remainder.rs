//! What a memory's choice does to each query's attention output, not only to the mass it
//! covers: the relative error of the output against full attention, for a tile's memory chosen
//! by its sampled queries or by an oracle, with the far positions left out either dropped (the
//! memory alone) or stood in for by one summary per block (the block's mean key, with its size
//! as a logit bias, and its mean value).

use std::ops::Range;

use serde::Serialize;

use super::attention::dot;
use super::{DenseLayer, StudyConfig};

/// Positions per summary block.
pub const SUMMARY_BLOCKS: [usize; 2] = [64, 16];

/// One way of choosing and completing the memory, and its output error.
#[derive(Debug, Clone, Serialize)]
pub struct OutputRow {
    pub choice: String,
    pub remainder: String,
    /// Relative L2 error of the attention output against full attention: mean, 90th percentile.
    pub error_mean: f64,
    pub error_p90: f64,
    /// Extra keys a query attends to for the summaries (mean over queries).
    pub extra_keys: f64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Choice {
    Sampled(usize),
    Oracle,
}

/// The rows of [`OutputRow`] for every head of `layers`, fixed budget M per tile, on
/// `threads` threads.
#[must_use]
pub fn output_errors(layers: &[DenseLayer], c: &StudyConfig, threads: usize) -> Vec<OutputRow> {
    let choices = [Choice::Sampled(16), Choice::Oracle];
    let remainders: Vec<Option<usize>> = std::iter::once(None)
        .chain(SUMMARY_BLOCKS.iter().map(|&b| Some(b)))
        .collect();
    let jobs: Vec<(usize, usize)> = layers
        .iter()
        .enumerate()
        .flat_map(|(li, l)| (0..l.n_head).map(move |h| (li, h)))
        .collect();
    let combos = choices.len() * remainders.len();
    let per_head: Vec<(Vec<Vec<f64>>, Vec<f64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|t| {
                let (jobs, choices, remainders) = (&jobs, &choices, &remainders);
                s.spawn(move || {
                    let mut errors = vec![Vec::new(); combos];
                    let mut extra = vec![0f64; combos];
                    for &(li, head) in jobs.iter().skip(t).step_by(threads.max(1)) {
                        study_head(
                            &layers[li],
                            head,
                            c,
                            choices,
                            remainders,
                            &mut errors,
                            &mut extra,
                        );
                    }
                    (errors, extra)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let mut out = Vec::new();
    for (xi, choice) in choices.iter().enumerate() {
        for (ri, rem) in remainders.iter().enumerate() {
            let k = xi * remainders.len() + ri;
            let mut e: Vec<f64> = per_head
                .iter()
                .flat_map(|(e, _)| e[k].iter().copied())
                .collect();
            let n = e.len().max(1);
            let extra: f64 = per_head.iter().map(|(_, x)| x[k]).sum();
            let mean = e.iter().sum::<f64>() / n as f64;
            e.sort_by(f64::total_cmp);
            out.push(OutputRow {
                choice: match choice {
                    Choice::Sampled(every) => format!("sampled queries (1 in {every}) per tile"),
                    Choice::Oracle => "oracle: per tile".into(),
                },
                remainder: match rem {
                    None => "dropped".into(),
                    Some(b) => format!("block summaries of {b}"),
                },
                error_mean: mean,
                error_p90: e.get(e.len() * 9 / 10).copied().unwrap_or(f64::NAN),
                extra_keys: extra / n as f64,
            });
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn study_head(
    layer: &DenseLayer,
    head: usize,
    c: &StudyConfig,
    choices: &[Choice],
    remainders: &[Option<usize>],
    errors: &mut [Vec<f64>],
    extra: &mut [f64],
) {
    for ci in c.first_chunk.. {
        let start = ci * c.chunk;
        if start >= layer.n_pos {
            break;
        }
        let end = (start + c.chunk).min(layer.n_pos);
        for t0 in (start..end).step_by(c.tile) {
            let tile = t0..(t0 + c.tile).min(end);
            let probs = Probs::of(layer, head, tile.clone());
            let truths: Vec<Vec<f64>> = (0..tile.len())
                .map(|r| truth(layer, head, &probs, r))
                .collect();
            for (xi, &choice) in choices.iter().enumerate() {
                let chosen = choose(&probs, c, start, choice);
                for (ri, &rem) in remainders.iter().enumerate() {
                    let summaries = rem
                        .map(|b| summarise(layer, head, start, &chosen, b))
                        .unwrap_or_default();
                    let k = xi * remainders.len() + ri;
                    for (r, i) in tile.clone().enumerate() {
                        let e = row_error(
                            layer, head, &probs, r, i, start, &chosen, &summaries, &truths[r],
                        );
                        errors[k].push(e);
                        extra[k] += summaries.len() as f64;
                    }
                }
            }
        }
    }
}

/// One block's stand-in: mean key, mean value, ln of its size.
struct Summary {
    k: Vec<f32>,
    v: Vec<f32>,
    ln_n: f32,
}

fn v_row(layer: &DenseLayer, head: usize, j: usize) -> &[f32] {
    let (dv, kv) = (layer.head_dim_v, layer.kv_head(head));
    let at = (j * layer.n_head_kv + kv) * dv;
    &layer.v[at..at + dv]
}

fn summarise(
    layer: &DenseLayer,
    head: usize,
    start: usize,
    chosen: &[usize],
    b: usize,
) -> Vec<Summary> {
    let mut in_chosen = vec![false; start];
    for &j in chosen {
        in_chosen[j] = true;
    }
    let mut out = Vec::new();
    for b0 in (0..start).step_by(b) {
        let members: Vec<usize> = (b0..(b0 + b).min(start))
            .filter(|&j| !in_chosen[j])
            .collect();
        if members.is_empty() {
            continue;
        }
        let mut k = vec![0f32; layer.head_dim];
        let mut v = vec![0f32; layer.head_dim_v];
        for &j in &members {
            k.iter_mut()
                .zip(layer.k_row(j, head))
                .for_each(|(a, &x)| *a += x);
            v.iter_mut()
                .zip(v_row(layer, head, j))
                .for_each(|(a, &x)| *a += x);
        }
        let n = members.len() as f32;
        k.iter_mut().for_each(|x| *x /= n);
        v.iter_mut().for_each(|x| *x /= n);
        out.push(Summary { k, v, ln_n: n.ln() });
    }
    out
}

fn truth(layer: &DenseLayer, head: usize, p: &Probs, r: usize) -> Vec<f64> {
    let mut t = vec![0f64; layer.head_dim_v];
    for (j, &a) in p.att[r].iter().enumerate() {
        for (o, &x) in t.iter_mut().zip(v_row(layer, head, j)) {
            *o += a * f64::from(x);
        }
    }
    t
}

/// Each row's logits on every key up to itself, and its true attention.
struct Probs {
    /// `[row][key]` (keys up to the row's position)
    logits: Vec<Vec<f32>>,
    att: Vec<Vec<f64>>,
}

impl Probs {
    fn of(layer: &DenseLayer, head: usize, tile: Range<usize>) -> Self {
        let mut logits = Vec::new();
        let mut att = Vec::new();
        for i in tile {
            let q = layer.q_row(i, head);
            let l: Vec<f32> = (0..=i)
                .map(|j| layer.scale * dot(q, layer.k_row(j, head)))
                .collect();
            let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            att.push(e.into_iter().map(|x| x / z).collect());
            logits.push(l);
        }
        Self { logits, att }
    }
}

/// The tile's memory: sinks and the local window, then the best far positions by the chosen
/// rows' attention, M in all (ascending).
fn choose(p: &Probs, c: &StudyConfig, start: usize, choice: Choice) -> Vec<usize> {
    let mut forced: Vec<usize> = c.forced(start).into_iter().map(|x| x as usize).collect();
    let rows: Vec<usize> = match choice {
        Choice::Sampled(every) => (0..p.att.len())
            .filter(|r| r % every == every - 1)
            .collect(),
        Choice::Oracle => (0..p.att.len()).collect(),
    };
    let rows = if rows.is_empty() {
        vec![p.att.len() - 1]
    } else {
        rows
    };
    let mut score = vec![0f64; start];
    for &r in &rows {
        for (s, &a) in score.iter_mut().zip(&p.att[r][..start]) {
            *s += a;
        }
    }
    let mut rest: Vec<usize> = (0..start).filter(|x| !forced.contains(x)).collect();
    rest.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    let budget = c.budget().min(start);
    let take = budget.saturating_sub(forced.len());
    forced.extend(rest.into_iter().take(take));
    forced.sort_unstable();
    forced
}

/// Row `r` (position `i`)'s relative output error attending to its chunk, `chosen` and
/// `summaries`.
#[allow(clippy::too_many_arguments)]
fn row_error(
    layer: &DenseLayer,
    head: usize,
    p: &Probs,
    r: usize,
    i: usize,
    start: usize,
    chosen: &[usize],
    summaries: &[Summary],
    truth: &[f64],
) -> f64 {
    let logits = &p.logits[r];
    let m = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let mut z = 0f64;
    let mut out = vec![0f64; layer.head_dim_v];
    let mut add = |l: f64, v: &[f32]| {
        let w = (l - m).exp();
        z += w;
        for (o, &x) in out.iter_mut().zip(v) {
            *o += w * f64::from(x);
        }
    };
    for j in chosen.iter().copied().chain(start..=i) {
        add(f64::from(logits[j]), v_row(layer, head, j));
    }
    let q = layer.q_row(i, head);
    for s in summaries {
        add(f64::from(layer.scale * dot(q, &s.k) + s.ln_n), &s.v);
    }
    let norm = truth.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
    let err = out
        .iter()
        .zip(truth)
        .map(|(o, t)| (o / z - t).powi(2))
        .sum::<f64>()
        .sqrt();
    err / norm
}
