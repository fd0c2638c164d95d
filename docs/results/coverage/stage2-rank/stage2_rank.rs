//! Could stage 2 of coverage selection rank its candidates on cheaper logits?
//!
//! Stage 2 is the part of the default's estimate whose cost does not depend on the prompt's
//! length: every query of a tile of 64 scores its chunk (exactly, which the attention needs
//! anyway), the forced positions and the 4 H candidates of stage 1 with exact logits, a softmax
//! over all of them per query, and the candidates are ranked by the tile's summed attention.
//! Here the same ranking is made with logits the kernel could compute for less: on half or a
//! quarter of the channels (those with the most key energy up to the chunk's end), or with the
//! query and the keys rounded to BF16 (products summed in f32). Two variants whose perplexity is
//! known calibrate the measure: 3 H candidates instead of 4 H, and ranking by every second query
//! of the tile.
//!
//! On queries and keys captured from a full-attention prefill (`capture_dense`), for every head,
//! every chunk from the second on and every tile of 64 queries: the share of the tile's attention
//! that its chunk, the forced positions (4 sinks and the last L before the chunk) and H chosen far
//! positions cover, where the H are
//! - `oracle`: the tile's own best H;
//! - `ideal rank`: the best H of the kernel's 4 H candidates by the tile's exact attention over
//!   the whole prompt (what the earlier studies called `today/kernel`);
//! - `rank/exact`: the kernel's stage 2: the candidates ranked by the tile's attention over its
//!   chunk, the forced positions and the candidates, exact logits;
//! - `rank/bf16`, `rank/D2`, `rank/D4`: the same on cheaper logits for the forced positions and
//!   the candidates (the chunk's stay exact);
//! - `rank/3H`: exact ranking of the best 3 H of the proposal; `rank/every2`: exact ranking by the
//!   tile's odd queries only;
//! - `forced only`: no far position chosen.
//!
//! The candidates are the kernel's default proposal: all 64 queries of the tile, logits on the
//! key sketch (the D/4 channels with the most key energy, D/2 for heads wider than 128), a softmax
//! over the free positions, summed, the best 4 H.
//!
//!   cp docs/results/coverage/stage2-rank/stage2_rank.rs h2o-research/examples/ &&
//!   cargo run --release -p h2o-research --example stage2_rank -- TEXT N LAYERS [MODEL]
//!
//! (LAYERS: comma-separated, or `all` for every layer with full attention; MODEL: a known model's
//! name such as `gemma3-270m`, or a GGUF file; the default model without it.)

use h2o_research::coverage::study::{self, dot, energy_order, sketch, sketch_proposal, top, StudyArgs};
use h2o_research::coverage::{ChunkAttention, DenseLayer, StudyConfig};

const CHUNK: usize = 1024;
const LOCAL: usize = 256;
const HEAVY: usize = 256;
const SINK: usize = 4;
const TILE: usize = 64;
const CANDIDATES: usize = 4 * HEAVY;

const VARIANTS: [&str; 9] = [
    "oracle",
    "ideal rank",
    "rank/exact",
    "rank/bf16",
    "rank/D2",
    "rank/D4",
    "rank/3H",
    "rank/every2",
    "forced only",
];

/// The logits a ranking reads for the forced positions and the candidates.
#[derive(Clone, Copy)]
enum Logits {
    Exact,
    Bf16,
    /// the first this-many channels of the energy order
    Channels(usize),
}

/// The ranking variants, in `VARIANTS` order from `rank/exact`: logits, candidates, and whether
/// only the odd rows of the tile rank.
const RANKINGS: [(Logits, usize, bool); 6] = [
    (Logits::Exact, CANDIDATES, false),
    (Logits::Bf16, CANDIDATES, false),
    (Logits::Channels(2), CANDIDATES, false),
    (Logits::Channels(4), CANDIDATES, false),
    (Logits::Exact, 3 * HEAVY, false),
    (Logits::Exact, CANDIDATES, true),
];

fn shape() -> StudyConfig {
    StudyConfig {
        chunk: CHUNK,
        local: LOCAL,
        heavy: HEAVY,
        sink: SINK,
        tile: TILE,
        block: 16,
        first_chunk: 1,
        only: None,
    }
}

/// `x` rounded to BF16 (to nearest, ties to even), back in f32.
fn bf16(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000)
}

/// The first `r` channels of `order`, ascending.
fn channels(order: &[usize], r: usize) -> Vec<usize> {
    let mut c = order[..r].to_vec();
    c.sort_unstable();
    c
}

/// Stage 2's ranking of `cand` for the tile's `queries`: per query a softmax over its chunk (exact
/// logits, up to itself), the forced positions and the candidates (logits by `how`), the
/// candidates' attention summed over the queries; indexed by position.
fn stage2(
    layer: &DenseLayer,
    h: usize,
    queries: &[usize],
    start: usize,
    forced: &[usize],
    cand: &[usize],
    how: Logits,
    order: &[usize],
) -> Vec<f32> {
    let keys: Vec<usize> = forced.iter().chain(cand).copied().collect();
    let chan: Vec<usize> = match how {
        Logits::Channels(f) => channels(order, layer.head_dim / f),
        _ => (0..layer.head_dim).collect(),
    };
    let round = |x: f32| if matches!(how, Logits::Bf16) { bf16(x) } else { x };
    let ks: Vec<Vec<f32>> = keys
        .iter()
        .map(|&j| {
            let k = layer.k_row(j, h);
            chan.iter().map(|&c| round(k[c])).collect()
        })
        .collect();
    let mut score = vec![0f32; start];
    let mut x = vec![0f32; keys.len()];
    for &i in queries {
        let q = layer.q_row(i, h);
        let intra: Vec<f32> = (start..=i).map(|j| layer.scale * dot(q, layer.k_row(j, h))).collect();
        let qs: Vec<f32> = chan.iter().map(|&c| round(q[c] * layer.scale)).collect();
        for (l, k) in x.iter_mut().zip(&ks) {
            *l = dot(&qs, k);
        }
        let m = intra.iter().chain(&x).copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z: f64 = intra.iter().map(|&l| f64::from((l - m).exp())).sum();
        for l in &mut x {
            *l = (*l - m).exp();
            z += f64::from(*l);
        }
        let inv = (1.0 / z) as f32;
        for (&e, &j) in x[forced.len()..].iter().zip(cand) {
            score[j] += e * inv;
        }
    }
    score
}

/// Head `h`'s covered shares summed over its tiles of every chunk, per variant, and its tiles.
fn head_run(layer: &DenseLayer, h: usize, n: usize) -> ([f64; VARIANTS.len()], usize) {
    let mut sums = [0f64; VARIANTS.len()];
    let mut tiles = 0;
    for start in (CHUNK..n).step_by(CHUNK) {
        let end = (start + CHUNK).min(n);
        let att = ChunkAttention::of(layer, h, start, end);
        let forced: Vec<usize> = shape().forced(start).into_iter().map(|p| p as usize).collect();
        let mut is_free = vec![true; start];
        for &p in &forced {
            is_free[p] = false;
        }
        let free: Vec<usize> = (0..start).filter(|&p| is_free[p]).collect();
        let order = energy_order(layer, h, end);
        let (chan, keys) = sketch(layer, h, start, end);
        for t in 0..att.rows.div_ceil(TILE) {
            let rows: Vec<usize> = (t * TILE..((t + 1) * TILE).min(att.rows)).collect();
            let mut mass = vec![0f32; start];
            for &r in &rows {
                for (x, &y) in mass.iter_mut().zip(att.far_row(r)) {
                    *x += y;
                }
            }
            let queries: Vec<usize> = rows.iter().map(|&r| start + r).collect();
            let proposal = sketch_proposal(layer, h, &queries, &chan, &keys, &free, start);
            let proposed = top(&proposal, &free, CANDIDATES);
            let mut chosen: Vec<Vec<usize>> = vec![top(&mass, &free, HEAVY), top(&mass, &proposed, HEAVY)];
            for &(how, n_cand, odd) in &RANKINGS {
                let cand = &proposed[..n_cand.min(proposed.len())];
                let ranking: Vec<usize> = if odd {
                    queries.iter().copied().skip(1).step_by(2).collect()
                } else {
                    queries.clone()
                };
                let score = stage2(layer, h, &ranking, start, &forced, cand, how, &order);
                chosen.push(top(&score, cand, HEAVY));
            }
            chosen.push(Vec::new());
            assert_eq!(chosen.len(), VARIANTS.len());
            let intra: f64 = rows.iter().map(|&r| f64::from(att.intra[r])).sum();
            let held: f64 = forced.iter().map(|&p| f64::from(mass[p])).sum();
            for (sum, set) in sums.iter_mut().zip(&chosen) {
                let far: f64 = set.iter().map(|&p| f64::from(mass[p])).sum();
                *sum += (intra + held + far) / rows.len() as f64;
            }
            tiles += 1;
        }
    }
    (sums, tiles)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = StudyArgs::parse("stage2_rank", &std::env::args().skip(1).collect::<Vec<_>>())?;
    let captured = study::capture("stage2_rank", &args)?;
    let (n, text, layers, clock) = (args.n, args.text.display(), &captured.layers, captured.clock);
    let names: Vec<u32> = layers.iter().map(|l| l.layer).collect();
    let first = &layers[0];
    println!(
        "{}, {text}, {n} tokens, layers {names:?} ({} query heads, {} KV heads, {} channels); \
         S = {CHUNK}, L = {LOCAL}, H = {HEAVY}, {SINK} sinks, tiles of {TILE}, 4 H = {CANDIDATES} \
         candidates from all 64 queries of the tile on the key sketch; chunks 1 on. Mean covered \
         share of the tile's attention; the last row: difference from `rank/exact`.\n",
        captured.model_file, first.n_head, first.n_head_kv, first.head_dim,
    );
    println!("| layer | {} |", VARIANTS.join(" | "));
    println!("|---:|{}", "---:|".repeat(VARIANTS.len()));
    let mut total = [0f64; VARIANTS.len()];
    let mut total_tiles = 0;
    for layer in layers {
        eprintln!("stage2_rank: layer {} ({:.0} s)", layer.layer, clock.elapsed().as_secs_f64());
        let per_head: Vec<([f64; VARIANTS.len()], usize)> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..layer.n_head)
                .map(|h| sc.spawn(move || head_run(layer, h, n)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut sums = [0f64; VARIANTS.len()];
        let mut tiles = 0;
        for (s, t) in &per_head {
            for (x, y) in sums.iter_mut().zip(s) {
                *x += y;
            }
            tiles += t;
        }
        let cells: Vec<String> = sums.iter().map(|s| format!("{:.4}", s / tiles as f64)).collect();
        println!("| {} | {} |", layer.layer, cells.join(" | "));
        for (x, y) in total.iter_mut().zip(sums) {
            *x += y;
        }
        total_tiles += tiles;
    }
    let mean: Vec<f64> = total.iter().map(|s| s / total_tiles as f64).collect();
    let cells: Vec<String> = mean.iter().map(|m| format!("**{m:.4}**")).collect();
    println!("| all | {} |", cells.join(" | "));
    let exact = mean[2];
    let diffs: Vec<String> = mean.iter().map(|m| format!("{:+.4}", m - exact)).collect();
    println!("| all − rank/exact | {} |", diffs.join(" | "));
    eprintln!("stage2_rank: done in {:.0} s", clock.elapsed().as_secs_f64());
    Ok(())
}
