//! The true attention of one head over one chunk's queries, split into what lies before the chunk
//! (the far keys a memory must choose from) and what lies inside it (which the chunk attends to
//! anyway).

use super::DenseLayer;

/// `a · b` in f32 with eight running sums, so that the compiler vectorises it.
#[must_use]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One head's full causal attention for the queries of `[start, end)`.
#[derive(Debug, Clone)]
pub struct ChunkAttention {
    /// First position of the chunk: the far keys are `[0, start)`.
    pub start: usize,
    /// Queries (rows), in position order `start, start + 1, …`.
    pub rows: usize,
    /// `rows × start`: each query's attention on every far key.
    pub far: Vec<f32>,
    /// Each query's attention on the keys of its own chunk (itself included).
    pub intra: Vec<f32>,
}

impl ChunkAttention {
    /// Row `r`'s attention on the far keys.
    #[must_use]
    pub fn far_row(&self, r: usize) -> &[f32] {
        &self.far[r * self.start..(r + 1) * self.start]
    }

    /// Computes it for query head `head` of `layer` (its KV head by GQA), in f32 with f64 sums.
    #[must_use]
    pub fn of(layer: &DenseLayer, head: usize, start: usize, end: usize) -> Self {
        let rows = end - start;
        let mut far = vec![0f32; rows * start];
        let mut intra = vec![0f32; rows];
        let mut logits = vec![0f32; end];
        for r in 0..rows {
            let i = start + r;
            let q = layer.q_row(i, head);
            for (j, l) in logits[..=i].iter_mut().enumerate() {
                *l = layer.scale * dot(q, layer.k_row(j, head));
            }
            let m = logits[..=i]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let mut z = 0f64;
            for l in &mut logits[..=i] {
                *l = (*l - m).exp();
                z += f64::from(*l);
            }
            let inv = (1.0 / z) as f32;
            for (f, &e) in far[r * start..(r + 1) * start]
                .iter_mut()
                .zip(&logits[..start])
            {
                *f = e * inv;
            }
            intra[r] = (logits[start..=i].iter().map(|&e| f64::from(e)).sum::<f64>() / z) as f32;
        }
        Self {
            start,
            rows,
            far,
            intra,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_the_plain_sum_at_every_length() {
        for n in [0, 1, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..n).map(|x| x as f32 * 0.5 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|x| 1.0 + (x % 5) as f32).collect();
            let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - plain).abs() < 1e-3, "n = {n}");
        }
    }
}
