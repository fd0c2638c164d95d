//! Unit tests of the reference against dense attention and the seed rule's definitions
//! (docs/seed-rule.md).

use super::softmax::dot;
use super::*;

/// Deterministic pseudo-random values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    fn matrix(&mut self, rows: usize, cols: usize, amp: f64) -> Matrix {
        Matrix::new(
            rows,
            cols,
            (0..rows * cols).map(|_| amp * self.next()).collect(),
        )
    }
}

const D: usize = 8;

fn max_abs_diff(a: &Matrix, b: &Matrix) -> f64 {
    a.data
        .iter()
        .zip(&b.data)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn run(n: usize, params: H2oParams, seed: u64) -> (Matrix, Matrix, Matrix, HeadResult) {
    let mut rng = Rng(seed);
    // Amplitude 2 makes attention peaked enough for selections to depend on the data.
    let (q, k, v) = (
        rng.matrix(n, D, 2.0),
        rng.matrix(n, D, 2.0),
        rng.matrix(n, D, 1.0),
    );
    let r = h2o_attention_head(&q, &k, &v, 1.0 / (D as f64).sqrt(), &params);
    (q, k, v, r)
}

/// The key sets written out from the seed rule, independently of the implementation.
fn expected_key_sets(n: usize, s: usize, memory_sets: &[MemorySet]) -> Vec<Vec<usize>> {
    (0..n)
        .map(|i| {
            let c = i / s;
            let mut keys: Vec<usize> = if c == 0 {
                vec![]
            } else {
                memory_sets[c - 1].positions().collect()
            };
            keys.extend(c * s..=i);
            keys
        })
        .collect()
}

fn assert_matches_dense(n: usize, params: H2oParams, seed: u64) -> HeadResult {
    let (q, k, v, r) = run(n, params, seed);
    let sets = expected_key_sets(n, params.chunk, &r.memory_sets);
    assert_eq!(r.key_sets, sets);
    let dense = dense_attention(&q, &k, &v, 1.0 / (D as f64).sqrt(), &sets);
    let err = max_abs_diff(&r.output, &dense);
    assert!(
        err < 1e-12,
        "n={n} {params:?}: merged output differs from dense by {err}"
    );
    // Memory-set invariants: M slots, ascending, in range, before the next chunk, padded with -1 only at the end.
    for (c, m) in r.memory_sets.iter().enumerate() {
        assert_eq!(m.slots.len(), params.memory_size());
        let pos: Vec<usize> = m.positions().collect();
        assert!(
            pos.windows(2).all(|w| w[0] < w[1]),
            "not sorted: {:?}",
            m.slots
        );
        assert!(pos.iter().all(|&p| p < (c + 1) * params.chunk));
        assert!(m.slots.iter().skip(pos.len()).all(|&s| s == -1));
        let end = (c + 1) * params.chunk;
        let local: Vec<usize> = (end.saturating_sub(params.local)..end).collect();
        assert!(
            local.iter().all(|p| pos.contains(p)),
            "local window missing from {:?}",
            m.slots
        );
    }
    r
}

#[test]
fn every_policy_attends_to_its_key_sets_and_the_tail_to_everything() {
    // coverage selection's key sets, a memory per tile, are checked in tiles.rs
    // (`each_query_attends_exactly_to_its_chunk_and_its_tiles_memory`)
    for select in [Selection::Seed, Selection::Hybrid] {
        for (sink, tail) in [(0, None), (3, None), (3, Some(70))] {
            let n = 80;
            let params = H2oParams {
                chunk: 16,
                local: 4,
                heavy: 6,
                select,
                sink,
                tail_start: tail,
            };
            let (q, k, v, r) = run(n, params, 5);
            let mut sets = expected_key_sets(n, params.chunk, &r.memory_sets);
            for (i, keys) in sets.iter_mut().enumerate() {
                if tail.is_some_and(|t| i >= t) {
                    *keys = (0..=i).collect();
                }
            }
            assert_eq!(r.key_sets, sets, "{select} sink {sink} tail {tail:?}");
            let dense = dense_attention(&q, &k, &v, 1.0 / (D as f64).sqrt(), &sets);
            assert!(max_abs_diff(&r.output, &dense) < 1e-12);
            for (c, m) in r.memory_sets.iter().enumerate() {
                let pos: Vec<usize> = m.positions().collect();
                assert_eq!(pos.len(), 10, "{select} chunk {c}: {pos:?}");
                assert!(
                    (0..sink).all(|p| pos.contains(&p)),
                    "{select}: sinks missing"
                );
            }
        }
    }
}

#[test]
fn chunk_bounds_are_position_aligned() {
    assert_eq!(chunk_bounds(10, 4), vec![0..4, 4..8, 8..10]);
    assert_eq!(chunk_bounds(8, 4), vec![0..4, 4..8]);
    assert_eq!(chunk_bounds(3, 4), vec![0..3]);
    assert!(chunk_bounds(0, 4).is_empty());
}

#[test]
fn merge_is_exact() {
    let mut rng = Rng(3);
    let (q, k, v) = (
        rng.matrix(1, D, 3.0),
        rng.matrix(10, D, 3.0),
        rng.matrix(10, 5, 1.0),
    );
    let all: Vec<usize> = (0..10).collect();
    let (whole, _) = attend(q.row(0), &k, &v, 0.5.into(), &all);
    let (a, _) = attend(q.row(0), &k, &v, 0.5.into(), &all[..3]);
    let (b, _) = attend(q.row(0), &k, &v, 0.5.into(), &all[3..]);
    let merged = merge_partial_softmax(&a, &b);
    for (x, y) in merged.output().iter().zip(whole.output()) {
        assert!((x - y).abs() < 1e-14);
    }
    let e = PartialSoftmax::empty(5);
    assert_eq!(merge_partial_softmax(&e, &a), a);
    assert_eq!(merge_partial_softmax(&a, &e), a);
}

#[test]
fn single_chunk_is_plain_causal_attention() {
    // N = S and N < S: one chunk, no memory, exactly stock's key set (seed rule item 8).
    for n in [16, 11] {
        let r = assert_matches_dense(
            n,
            H2oParams {
                chunk: 16,
                local: 4,
                heavy: 4,
                ..Default::default()
            },
            1,
        );
        assert!(r.memory_sets.is_empty());
        assert!(r
            .key_sets
            .iter()
            .enumerate()
            .all(|(i, ks)| *ks == (0..=i).collect::<Vec<_>>()));
    }
}

#[test]
fn chunk_zero_partial_last_chunk_and_two_s_minus_one() {
    let p = H2oParams {
        chunk: 16,
        local: 4,
        heavy: 4,
        ..Default::default()
    };
    for n in [31, 32, 33, 50, 64] {
        let r = assert_matches_dense(n, p, 7 + n as u64);
        assert_eq!(r.memory_sets.len(), n.div_ceil(16) - 1);
        // Chunk 0 never sees memory.
        assert!((0..16.min(n)).all(|i| r.key_sets[i] == (0..=i).collect::<Vec<_>>()));
    }
}

#[test]
fn local_only_heavy_only_and_memory_close_to_chunk() {
    for p in [
        H2oParams {
            chunk: 16,
            local: 0,
            heavy: 6,
            ..Default::default()
        },
        H2oParams {
            chunk: 16,
            local: 6,
            heavy: 0,
            ..Default::default()
        },
        H2oParams {
            chunk: 16,
            local: 7,
            heavy: 8,
            ..Default::default()
        }, // M = S - 1
        H2oParams {
            chunk: 16,
            local: 1,
            heavy: 14,
            ..Default::default()
        },
    ] {
        let r = assert_matches_dense(70, p, 11);
        for m in &r.memory_sets {
            let used = m.positions().count();
            assert_eq!(
                used,
                p.memory_size(),
                "{p:?}: enough candidates exist, so every slot is used"
            );
        }
        if p.heavy == 0 {
            // Local only: memory = last L positions of the previous chunk.
            for (c, m) in r.memory_sets.iter().enumerate() {
                let end = (c + 1) * 16;
                assert_eq!(
                    m.positions().collect::<Vec<_>>(),
                    (end - p.local..end).collect::<Vec<_>>()
                );
            }
        }
    }
}

#[test]
fn scores_follow_the_spec_definition() {
    let p = H2oParams {
        chunk: 8,
        local: 2,
        heavy: 3,
        ..Default::default()
    };
    let (_, _, _, r) = run(20, p, 5);
    // Every softmax row sums to 1: intra contributes |C_c| per chunk, inter |C_c| when
    // the memory is non-empty (chunks >= 1).
    let chunks = chunk_bounds(20, 8);
    let total: f64 = r.scores.iter().sum();
    let expected: f64 = chunks
        .iter()
        .enumerate()
        .map(|(c, ch)| ch.len() as f64 * if c == 0 { 1.0 } else { 2.0 })
        .sum();
    assert!((total - expected).abs() < 1e-9, "{total} vs {expected}");
    // The last query of a chunk attends to itself only through the intra part: s(j) >= A(j, j) > 0.
    assert!(r.scores.iter().all(|&s| s > 0.0));
}

#[test]
fn heavy_hitters_are_the_top_scores_with_ties_to_lower_positions() {
    let p = H2oParams {
        chunk: 8,
        local: 2,
        heavy: 3,
        ..Default::default()
    };
    let mut scores = vec![0.0; 16];
    for (pos, s) in [
        (1, 5.0),
        (3, 5.0),
        (5, 9.0),
        (2, 1.0),
        (6, 100.0),
        (7, 100.0),
    ] {
        scores[pos] = s;
    }
    // Positions 6, 7 are local (end 8, L 2); heavy = 5 (9.0), then 1 and 3 tie at 5.0: both fit.
    let m = build_memory_set(&p, None, 0..8, &scores);
    assert_eq!(m.slots, vec![1, 3, 5, 6, 7]);
    // Ties beyond the budget go to the lower position.
    let p2 = H2oParams { heavy: 2, ..p };
    assert_eq!(
        build_memory_set(&p2, None, 0..8, &scores).slots,
        vec![1, 5, 6, 7]
    );
    // All-equal scores: the lowest positions win.
    let flat = vec![0.5; 16];
    assert_eq!(
        build_memory_set(&p, None, 0..8, &flat).slots,
        vec![0, 1, 2, 6, 7]
    );
    // Survival across chunks: a previous heavy hitter stays a candidate; the old local window too.
    let prev = MemorySet {
        slots: vec![1, 3, 5, 6, 7],
    };
    let mut s2 = scores.clone();
    s2[12] = 50.0;
    let m2 = build_memory_set(&p, Some(&prev), 8..16, &s2);
    assert_eq!(
        m2.slots,
        vec![6, 7, 12, 14, 15],
        "top scores among memory ∪ chunk: 6, 7 (100), 12 (50)"
    );
    // Too few candidates: unused slots are -1.
    let p3 = H2oParams {
        chunk: 8,
        local: 2,
        heavy: 5,
        ..Default::default()
    };
    assert_eq!(
        build_memory_set(&p3, None, 0..4, &flat).slots,
        vec![0, 1, 2, 3, -1, -1, -1]
    );
}

#[test]
fn gqa_heads_share_kv_and_select_per_head() {
    let (n, n_head, n_head_kv) = (60, 6, 2);
    let mut rng = Rng(99);
    let q: Vec<Matrix> = (0..n_head).map(|_| rng.matrix(n, D, 2.5)).collect();
    let k: Vec<Matrix> = (0..n_head_kv).map(|_| rng.matrix(n, D, 2.5)).collect();
    let v: Vec<Matrix> = (0..n_head_kv).map(|_| rng.matrix(n, D, 1.0)).collect();
    let p = H2oParams {
        chunk: 16,
        local: 3,
        heavy: 5,
        ..Default::default()
    };
    let scale = 1.0 / (D as f64).sqrt();
    let results = h2o_attention(&q, &k, &v, scale, &p);
    for (h, r) in results.iter().enumerate() {
        let kv = h / (n_head / n_head_kv);
        // Each head equals the single-head computation against its KV head.
        assert_eq!(*r, h2o_attention_head(&q[h], &k[kv], &v[kv], scale, &p));
        let dense = dense_attention(&q[h], &k[kv], &v[kv], scale, &r.key_sets);
        assert!(max_abs_diff(&r.output, &dense) < 1e-12);
    }
    // Selection is per query head: heads sharing a KV head still pick different heavy hitters.
    let distinct: std::collections::HashSet<_> =
        results.iter().map(|r| r.memory_sets.clone()).collect();
    assert!(distinct.len() > 1, "all heads selected the same memory");
    assert_ne!(
        results[0].memory_sets, results[1].memory_sets,
        "heads 0 and 1 share KV head 0 but should differ"
    );
}

#[test]
fn soft_capped_logits_are_the_logits_of_every_part() {
    // logits well beyond the cap, so that capping changes the attention
    let mut rng = Rng(2024);
    let (n, amp) = (70, 6.0);
    let (q, k, v) = (
        rng.matrix(n, D, amp),
        rng.matrix(n, D, amp),
        rng.matrix(n, D, 1.0),
    );
    let capped = Logits {
        scale: 1.0,
        softcap: 5.0,
    };
    for select in [Selection::Seed, Selection::Hybrid] {
        let p = H2oParams {
            chunk: 16,
            local: 4,
            heavy: 6,
            select,
            sink: 2,
            tail_start: Some(60),
        };
        let r = h2o_attention_head(&q, &k, &v, capped, &p);
        let dense = dense_attention(&q, &k, &v, capped, &r.key_sets);
        assert!(max_abs_diff(&r.output, &dense) < 1e-12, "{select:?}");
        let uncapped = dense_attention(&q, &k, &v, 1.0, &r.key_sets);
        assert!(
            max_abs_diff(&r.output, &uncapped) > 1e-3,
            "{select:?}: the cap changed nothing"
        );
    }
}

#[test]
fn a_sink_joins_each_query_denominator_and_nothing_else() {
    let mut rng = Rng(77);
    let (n, sink) = (40, 1.5);
    let (q, k, v) = (
        rng.matrix(n, D, 2.0),
        rng.matrix(n, D, 2.0),
        rng.matrix(n, 5, 1.0),
    );
    let p = H2oParams {
        chunk: 16,
        local: 3,
        heavy: 5,
        ..Default::default()
    };
    let r = h2o_attention_head(&q, &k, &v, 0.5, &p);
    let mut with_sink = r.output.clone();
    apply_sink(&mut with_sink, &q, &k, 0.5, &r.key_sets, sink);
    for (i, keys) in r.key_sets.iter().enumerate() {
        // softmax over the keys' logits and the sink logit, the sink's share going nowhere
        let e: Vec<f64> = keys
            .iter()
            .map(|&j| (0.5 * dot(q.row(i), k.row(j))).exp())
            .collect();
        let z: f64 = e.iter().sum::<f64>() + f64::exp(sink);
        for d in 0..v.cols {
            let want: f64 = keys.iter().zip(&e).map(|(&j, x)| x / z * v.row(j)[d]).sum();
            assert!((with_sink.row(i)[d] - want).abs() < 1e-12);
        }
    }
}
