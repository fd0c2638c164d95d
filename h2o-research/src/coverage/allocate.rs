//! Coverage curves (each query's covered attention at every budget on a grid) and the two ways of
//! spending a budget on them: the same for every unit, or where the estimated gain is largest.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::attention::ChunkAttention;
use super::strategies::{Estimate, Ranked};

/// Budgets are counted in steps of this many positions.
pub const STEP: usize = 32;

/// One unit (a chunk, a tile or a query of one head) with its rows' true coverage curves.
#[derive(Debug, Clone)]
pub struct Unit {
    /// Index of the studied layer, the chunk and the query head.
    pub layer: usize,
    pub chunk: usize,
    pub head: usize,
    pub rows: usize,
    /// Steps any budget keeps (the forced positions, rounded up).
    pub min_steps: usize,
    /// `rows × (steps + 1)`: coverage of each row after `g` steps of the ranking.
    pub truth: Vec<f32>,
    /// The estimator's belief of the unit's mean coverage after `g` steps, if it has one.
    pub estimate: Option<Vec<f32>>,
}

impl Unit {
    /// Builds the curves of one ranking, `steps` steps long.
    #[must_use]
    pub fn of(
        ids: (usize, usize, usize),
        att: &ChunkAttention,
        ranked: &Ranked,
        steps: usize,
    ) -> Self {
        let g_len = steps + 1;
        let curve_of = |r: usize| -> Vec<f32> {
            let far = att.far_row(r);
            let mut curve = Vec::with_capacity(g_len);
            let mut cum = f64::from(att.intra[r]);
            curve.push(cum as f32);
            for g in 0..steps {
                let lo = (g * STEP).min(ranked.order.len());
                let hi = ((g + 1) * STEP).min(ranked.order.len());
                cum += ranked.order[lo..hi]
                    .iter()
                    .map(|&p| f64::from(far[p as usize]))
                    .sum::<f64>();
                curve.push(cum as f32);
            }
            curve
        };
        let truth: Vec<f32> = ranked.rows.clone().flat_map(curve_of).collect();
        let estimate = ranked.estimate.as_ref().map(|e| match e {
            Estimate::Rows(rows) => {
                let mut mean = vec![0f32; g_len];
                for &r in rows {
                    for (m, x) in mean.iter_mut().zip(curve_of(r)) {
                        *m += x / rows.len() as f32;
                    }
                }
                mean
            }
            Estimate::Masses { intra, ranked: m } => {
                let mut curve = Vec::with_capacity(g_len);
                let mut cum = *intra;
                curve.push(cum);
                for g in 0..steps {
                    let lo = (g * STEP).min(m.len());
                    let hi = ((g + 1) * STEP).min(m.len());
                    cum += m[lo..hi].iter().sum::<f32>();
                    curve.push(cum);
                }
                curve
            }
        });
        Self {
            layer: ids.0,
            chunk: ids.1,
            head: ids.2,
            rows: ranked.rows.len(),
            min_steps: ranked.forced.div_ceil(STEP).min(steps),
            truth,
            estimate,
        }
    }

    fn steps(&self) -> usize {
        self.truth.len() / self.rows - 1
    }

    fn row_coverage(&self, g: usize) -> impl Iterator<Item = f32> + '_ {
        let g_len = self.steps() + 1;
        (0..self.rows).map(move |r| self.truth[r * g_len + g.min(g_len - 1)])
    }
}

/// Which units share one budget when budgets follow coverage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pool {
    /// Every unit gets the same budget.
    Fixed,
    /// The tiles of one head, layer and chunk share theirs.
    Tiles,
    /// The heads (and tiles) of one layer and chunk share theirs.
    Heads,
    /// All studied layers' heads (and tiles) of one chunk share theirs.
    HeadsAndLayers,
}

impl Pool {
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Tiles => "across one head's tiles",
            Self::Heads => "across heads",
            Self::HeadsAndLayers => "across heads and layers",
        }
    }
}

/// Per-row coverage and the budgets given, in positions per unit.
#[derive(Debug, Clone, Default)]
pub struct Spent {
    pub coverage: Vec<f32>,
    pub budgets: Vec<usize>,
}

/// Spends `budget_steps` per query (on average) on `units`: the same for each (`Pool::Fixed`),
/// or greedily, one step at a time, to the unit whose estimated mean coverage gains most, within
/// each pool. The result is judged by the true curves.
#[must_use]
pub fn spend(units: &[Unit], pool: Pool, budget_steps: usize) -> Spent {
    let mut steps: Vec<usize> = units.iter().map(|u| u.min_steps).collect();
    if pool == Pool::Fixed {
        steps = units
            .iter()
            .map(|u| budget_steps.max(u.min_steps).min(u.steps()))
            .collect();
    } else {
        let key = |u: &Unit| match pool {
            Pool::HeadsAndLayers => (usize::MAX, u.chunk, 0),
            Pool::Tiles => (u.layer, u.chunk, u.head),
            _ => (u.layer, u.chunk, 0),
        };
        let mut pools: std::collections::BTreeMap<(usize, usize, usize), Vec<usize>> =
            std::collections::BTreeMap::new();
        for (i, u) in units.iter().enumerate() {
            pools.entry(key(u)).or_default().push(i);
        }
        for members in pools.values() {
            greedy(units, members, budget_steps, &mut steps);
        }
    }
    let mut out = Spent::default();
    for (u, &g) in units.iter().zip(&steps) {
        out.coverage.extend(u.row_coverage(g));
        out.budgets.push((g * STEP).min(u.steps() * STEP));
    }
    out
}

struct Gain {
    per_row: f32,
    unit: usize,
}

impl PartialEq for Gain {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Gain {}
impl PartialOrd for Gain {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Gain {
    fn cmp(&self, o: &Self) -> Ordering {
        // larger gain first; ties to the lower unit
        self.per_row
            .total_cmp(&o.per_row)
            .then(o.unit.cmp(&self.unit))
    }
}

fn greedy(units: &[Unit], members: &[usize], budget_steps: usize, steps: &mut [usize]) {
    let total: usize = members.iter().map(|&i| units[i].rows * budget_steps).sum();
    let mut spent: usize = members.iter().map(|&i| units[i].rows * steps[i]).sum();
    let gain = |i: usize, g: usize| -> Option<Gain> {
        let est = units[i].estimate.as_ref()?;
        (g + 1 < est.len()).then(|| Gain {
            per_row: est[g + 1] - est[g],
            unit: i,
        })
    };
    let mut heap: BinaryHeap<Gain> = members.iter().filter_map(|&i| gain(i, steps[i])).collect();
    while let Some(best) = heap.pop() {
        let i = best.unit;
        if spent + units[i].rows > total {
            continue;
        }
        spent += units[i].rows;
        steps[i] += 1;
        if let Some(next) = gain(i, steps[i]) {
            heap.push(next);
        }
    }
}

/// Mean and 10th percentile.
#[must_use]
pub fn mean_p10(xs: &[f32]) -> (f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = xs.iter().map(|&x| f64::from(x)).sum::<f64>() / xs.len() as f64;
    let mut sorted = xs.to_vec();
    sorted.sort_by(f32::total_cmp);
    (mean, f64::from(sorted[sorted.len() / 10]))
}

/// The 10th, 50th and 90th percentile of `xs`.
#[must_use]
pub fn spread(xs: &[usize]) -> [usize; 3] {
    if xs.is_empty() {
        return [0; 3];
    }
    let mut s = xs.to_vec();
    s.sort_unstable();
    [s[s.len() / 10], s[s.len() / 2], s[s.len() * 9 / 10]]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(head: usize, truth: Vec<f32>, estimate: Vec<f32>) -> Unit {
        Unit {
            layer: 0,
            chunk: 1,
            head,
            rows: 1,
            min_steps: 0,
            truth,
            estimate: Some(estimate),
        }
    }

    #[test]
    fn budgets_go_where_the_estimate_gains_most_and_the_average_holds() {
        // head 0 is covered at once; head 1 gains with every step
        let a = unit(0, vec![0.9, 1.0, 1.0, 1.0], vec![0.9, 1.0, 1.0, 1.0]);
        let b = unit(1, vec![0.1, 0.4, 0.7, 0.9], vec![0.1, 0.4, 0.7, 0.9]);
        let units = [a, b];
        let fixed = spend(&units, Pool::Fixed, 1);
        assert_eq!(fixed.budgets, vec![STEP, STEP]);
        assert_eq!(fixed.coverage, vec![1.0, 0.4]);
        let moved = spend(&units, Pool::Heads, 1);
        // two steps in all: one to head 0 (gain 0.1) is worth less than a second to head 1 (0.3)
        assert_eq!(moved.budgets, vec![0, 2 * STEP]);
        assert_eq!(moved.coverage, vec![0.9, 0.7]);
    }
}
