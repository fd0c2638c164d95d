//! Property test: the engine's memory-set rule (`ggml_h2o_build_memory_set`, through
//! `engine_rule`) equals the plain-Rust reference (`reference::build_memory_set`) on thousands
//! of random states — chunk sizes, L, H (either may be 0), prompt lengths with a partial last
//! chunk, and scores that are distinct, tied, all equal, or extreme (subnormal to infinite, no
//! NaN) — and every set it builds is in range, ascending, and Local and Heavy never overlap.
#![cfg(not(feature = "stock"))]

use h2o_llama::engine_build_memory_set;
use h2o_llama::Error;
use h2o_research::reference::{build_memory_set, H2oParams, MemorySet};

/// A small deterministic generator (SplitMix64), so that a failure names a reproducible trial.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn bf16_bits(x: f32) -> u16 {
    // round to nearest even, as the engine stores scores
    let u = x.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn bf16_value(bits: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(bits) << 16))
}

/// A score of the kind the trial's mode asks for (scores are sums of probabilities: never
/// negative).
fn draw(rng: &mut Rng, mode: usize) -> u16 {
    match mode {
        0 => bf16_bits((rng.next() >> 40) as f32 / (1u64 << 24) as f32 * 100.0), // distinct
        1 => bf16_bits(rng.below(3) as f32),                                     // many ties
        2 => bf16_bits(0.25),                                                    // all equal
        3 => {
            // extremes: zero, the smallest subnormal, tiny, one, F16's max, BF16's max, infinity
            const E: [u16; 7] = [0x0000, 0x0001, 0x0da2, 0x3f80, 0x477f, 0x7f7f, 0x7f80];
            E[rng.below(E.len())]
        }
        _ => {
            bf16_bits(((rng.next() >> 11) as f64 / (1u64 << 53) as f64 * 20.0 - 10.0).exp() as f32)
        } // heavy-tailed
    }
}

fn check_invariants(set: &MemorySet, chunk_end: usize, local: usize, what: &str) {
    let positions: Vec<usize> = set.positions().collect();
    assert!(
        set.slots
            .iter()
            .all(|&p| p == -1 || (p >= 0 && (p as usize) < chunk_end)),
        "{what}: slot out of range: {:?}",
        set.slots
    );
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "{what}: not ascending: {positions:?}"
    );
    // used slots first, then -1
    let used = positions.len();
    assert!(
        set.slots[used..].iter().all(|&p| p == -1),
        "{what}: {:?}",
        set.slots
    );
    let local_start = chunk_end.saturating_sub(local);
    let in_local = positions.iter().filter(|&&p| p >= local_start).count();
    assert_eq!(
        in_local,
        chunk_end - local_start,
        "{what}: Local incomplete: {positions:?}"
    );
    // Heavy = the rest, all before Local: the two never overlap
    assert!(
        positions[..used - in_local]
            .iter()
            .all(|&p| p < local_start),
        "{what}: {positions:?}"
    );
}

#[test]
fn engine_rule_equals_the_reference_on_random_states() {
    let mut rng = Rng(0x5eed_2026);
    let mut builds = 0;
    for trial in 0..1500 {
        let s = 2 + rng.below(299);
        let m = 1 + rng.below(s - 1); // 1 <= M < S
        let local = rng.below(m + 1);
        let heavy = m - local;
        let n_chunks = 1 + rng.below(6);
        let n = (n_chunks - 1) * s + 1 + rng.below(s); // the last chunk may be partial
        let mode = trial % 5;
        // a third of the trials keep sinks (0 ..= H of them)
        let sink = if trial % 3 == 0 {
            rng.below(heavy + 1)
        } else {
            0
        };
        let params = H2oParams {
            chunk: s,
            local,
            heavy,
            sink,
            ..Default::default()
        };
        let mut scores = vec![0u16; n];
        let mut previous: Option<MemorySet> = None;
        for c in 0..n_chunks {
            let chunk = c * s..((c + 1) * s).min(n);
            // the scores so far, as accumulation would have left them
            for score in &mut scores[..chunk.end] {
                *score = draw(&mut rng, mode);
            }
            let wide: Vec<f64> = scores.iter().map(|&b| bf16_value(b)).collect();
            let what = format!(
                "trial {trial} (S {s} L {local} H {heavy} sink {sink} N {n} mode {mode}) chunk {c}"
            );
            let engine = engine_build_memory_set(
                &scores,
                previous.as_ref(),
                local,
                heavy,
                sink,
                chunk.clone(),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let reference = build_memory_set(&params, previous.as_ref(), chunk.clone(), &wide);
            assert_eq!(engine, reference, "{what}");
            check_invariants(&engine, chunk.end, local, &what);
            previous = Some(engine);
            builds += 1;
        }
    }
    eprintln!("{builds} memory-set builds: engine = reference");
}

#[test]
fn engine_rule_refuses_states_it_could_read_out_of_bounds() {
    let scores = vec![0x3f80u16; 64];
    let bad = |r: Result<MemorySet, Error>| matches!(r, Err(Error::InvalidConfig(_)));
    // a previous slot at or after the chunk's start
    let prev = MemorySet {
        slots: vec![3, 40, -1, -1],
    };
    assert!(bad(engine_build_memory_set(
        &scores,
        Some(&prev),
        2,
        2,
        0,
        32..48
    )));
    // a previous set of the wrong size, a chunk past the scores, no memory at all
    let short = MemorySet { slots: vec![1, 2] };
    assert!(bad(engine_build_memory_set(
        &scores,
        Some(&short),
        2,
        2,
        0,
        32..48
    )));
    assert!(bad(engine_build_memory_set(&scores, None, 2, 2, 0, 48..80)));
    assert!(bad(engine_build_memory_set(&scores, None, 0, 0, 0, 0..16)));
    // and a valid one works
    let ok = engine_build_memory_set(&scores, None, 2, 2, 0, 0..16).unwrap();
    assert_eq!(ok.slots, vec![0, 1, 14, 15]);
    // a sink larger than the heavy budget
    assert!(bad(engine_build_memory_set(&scores, None, 2, 2, 3, 0..16)));
}
