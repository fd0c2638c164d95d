//! Could a tile's candidates come from what the previous chunk chose, instead of from every
//! earlier position?
//!
//! Today's stage 1 lets a few sampled queries of each tile of 64 score every position before the
//! chunk and propose 4 H candidates, which stage 2 ranks by the whole tile; its reads per tile grow
//! with the prompt. Here the proposal reads a pool that does not: the positions the previous
//! chunk's tiles kept, plus the positions that became far since that chunk (its own positions and
//! its local window). A position that no earlier chunk kept and that is older than the previous
//! chunk can then come back only through a periodic full scan.
//!
//! On queries and keys captured from a full-attention prefill (`capture_dense`), for every head,
//! every chunk from the second on and every tile of 64 queries: the share of the tile's attention
//! that its chunk, the forced positions (4 sinks and the last L before the chunk) and H chosen far
//! positions cover, where the H are
//! - `oracle`: the tile's own best H;
//! - `today`: 4 H candidates by the exact attention of every 16th query of the tile, among every
//!   free position, ranked (the study's stage 1 and 2);
//! - `carry/H`: the same samples propose 4 H among the pool, ranked; the pool of chunk c is the
//!   union of the H each tile of chunk c − 1 kept (under this variant) and the free positions of
//!   `[start(c − 1) − L, start(c))`; chunk 1's pool is every free position;
//! - `carry/2H`: the pool carries each tile's best 2 H of its 4 H candidates (by the tile's
//!   attention) instead of the H it kept;
//! - `carry/H+scan/4`, `carry/H+scan/8`: `carry/H`, with every 4th or 8th chunk proposing among
//!   every free position as `today` does (a periodic full scan, whose cost is spread over the
//!   chunks between);
//! - `today/kernel` (round 2): the proposal as the kernel makes it by default: all 64 queries of
//!   the tile, each with logits on a key sketch (the D/4 channels with the most key energy over
//!   the positions up to the chunk's end, D/2 for heads wider than 128, as the session recommends),
//!   a softmax over the free positions scored, summed over the queries; 4 H candidates, ranked;
//! - `carry/H/kernel` (round 2): `today/kernel`'s proposal among `carry/H`'s pool (the softmax
//!   over the pool's positions, the only ones a kernel would score), carrying its own choice;
//! - `forced only`: no far position chosen.
//!
//! "Ranked" is stage 2: the best H of the candidates by the tile's exact attention. The pool's
//! size is printed per chunk: it is what stage 1 reads per tile instead of every free position.
//!
//!   cp docs/results/coverage/carry-over/carry_over.rs h2o-research/examples/ &&
//!   cargo run --release -p h2o-research --example carry_over -- TEXT N LAYERS [MODEL]
//!
//! (LAYERS: comma-separated, or `all` for every layer with full attention, which on a model with
//! sliding-window layers is its global layers; MODEL: a known model's name such as `gemma3-270m`,
//! or a GGUF file; the default model without it.)

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use h2o_llama::{default_model, models, Model, ModelParams};
use h2o_research::coverage::{capture_dense, ChunkAttention, DenseLayer, StudyConfig};

const CHUNK: usize = 1024;
const LOCAL: usize = 256;
const HEAVY: usize = 256;
const SINK: usize = 4;
const TILE: usize = 64;
const SAMPLE_EVERY: usize = 16;
const CANDIDATES: usize = 4 * HEAVY;

const VARIANTS: [&str; 9] = [
    "oracle",
    "today",
    "today/kernel",
    "carry/H",
    "carry/2H",
    "carry/H+scan/4",
    "carry/H+scan/8",
    "carry/H/kernel",
    "forced only",
];

/// Where the carrying variants start in `VARIANTS`.
const FIRST_CARRY: usize = 3;

/// The carrying variants, in `VARIANTS` order from `FIRST_CARRY`: positions each tile passes on
/// (its best this-many candidates by the tile's attention), the period of the full scan (0:
/// none), and whether the kernel's sketched proposal makes the candidates.
const CARRIES: [(usize, usize, bool); 5] = [
    (HEAVY, 0, false),
    (2 * HEAVY, 0, false),
    (HEAVY, 4, false),
    (HEAVY, 8, false),
    (HEAVY, 0, true),
];

/// The study's shape: only `forced` (the sinks and the local window) is used here.
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

/// `sum += row`, element by element.
fn add(sum: &mut [f32], row: &[f32]) {
    for (x, &y) in sum.iter_mut().zip(row) {
        *x += y;
    }
}

/// The `n` positions of `among` with the largest `mass`, best first (ties to the lower).
fn top(mass: &[f32], among: &[usize], n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = among.to_vec();
    v.sort_by(|&x, &y| mass[y].total_cmp(&mass[x]).then(x.cmp(&y)));
    v.truncate(n);
    v
}

/// The kernel's proposal for the rows of a tile: each query's logits on the sketch's channels
/// (`chan`; keys `ks`, `start × chan.len()`), a softmax over `among`, summed over the queries.
fn sketch_proposal(
    layer: &DenseLayer,
    h: usize,
    queries: &[usize],
    chan: &[usize],
    ks: &[f32],
    among: &[usize],
    start: usize,
) -> Vec<f32> {
    let r = chan.len();
    let mut mass = vec![0f32; start];
    let mut logits = vec![0f32; among.len()];
    for &i in queries {
        let q = layer.q_row(i, h);
        let qs: Vec<f32> = chan.iter().map(|&c| q[c] * layer.scale).collect();
        for (l, &j) in logits.iter_mut().zip(among) {
            *l = dot(&qs, &ks[j * r..(j + 1) * r]);
        }
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f64;
        for l in &mut logits {
            *l = (*l - m).exp();
            z += f64::from(*l);
        }
        let inv = (1.0 / z) as f32;
        for (&e, &j) in logits.iter().zip(among) {
            mass[j] += e * inv;
        }
    }
    mass
}

/// `a · b` with eight running sums, so that the compiler vectorises it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail = a.len() / 8 * 8;
    acc.iter().sum::<f32>() + a[tail..].iter().zip(&b[tail..]).map(|(x, y)| x * y).sum::<f32>()
}

/// The sketch's channels for head `h`'s KV head: the `d / sketch` with the most key energy over
/// the positions `[0, end)`, ties to the lower channel, ascending; and the keys of `[0, start)` in
/// those channels.
fn sketch(layer: &DenseLayer, h: usize, start: usize, end: usize) -> (Vec<usize>, Vec<f32>) {
    let d = layer.head_dim;
    let r = d / if d > 128 { 2 } else { 4 };
    let mut energy = vec![0f64; d];
    for j in 0..end {
        for (e, &x) in energy.iter_mut().zip(layer.k_row(j, h)) {
            *e += f64::from(x) * f64::from(x);
        }
    }
    let mut chan: Vec<usize> = (0..d).collect();
    chan.sort_by(|&a, &b| energy[b].total_cmp(&energy[a]).then(a.cmp(&b)));
    chan.truncate(r);
    chan.sort_unstable();
    let mut ks = Vec::with_capacity(start * r);
    for j in 0..start {
        let k = layer.k_row(j, h);
        ks.extend(chan.iter().map(|&c| k[c]));
    }
    (chan, ks)
}

/// What one head gives at one chunk: per variant the covered share summed over tiles, the
/// number of tiles, and per carrying variant the pool's size.
struct ChunkResult {
    start: usize,
    sums: [f64; VARIANTS.len()],
    tiles: usize,
    pools: [usize; CARRIES.len()],
}

/// Every chunk of head `h`, in order: the carrying variants pass their choice on.
fn head_run(layer: &DenseLayer, h: usize, n: usize) -> Vec<ChunkResult> {
    let mut out = Vec::new();
    // per carrying variant, the positions chunk c − 1 passed on
    let mut carried: Vec<Vec<bool>> = vec![Vec::new(); CARRIES.len()];
    for (c, start) in (CHUNK..n).step_by(CHUNK).enumerate() {
        let c = c + 1;
        let end = (start + CHUNK).min(n);
        let att = ChunkAttention::of(layer, h, start, end);
        let forced: Vec<usize> = shape().forced(start).into_iter().map(|p| p as usize).collect();
        let mut is_free = vec![true; start];
        for &p in &forced {
            is_free[p] = false;
        }
        let free: Vec<usize> = (0..start).filter(|&p| is_free[p]).collect();
        // the free positions that became far since the previous chunk: its own and its window
        let new_from = (start - CHUNK).saturating_sub(LOCAL);
        let pools: Vec<Vec<usize>> = CARRIES
            .iter()
            .zip(&carried)
            .map(|(&(_, scan, _), kept)| {
                if c == 1 || (scan > 0 && c % scan == 0) {
                    free.clone()
                } else {
                    free.iter()
                        .copied()
                        .filter(|&p| p >= new_from || kept.get(p).copied().unwrap_or(false))
                        .collect()
                }
            })
            .collect();
        let (chan, ks) = sketch(layer, h, start, end);
        let mut next: Vec<Vec<bool>> = vec![vec![false; end]; CARRIES.len()];
        let mut sums = [0f64; VARIANTS.len()];
        let mut tiles = 0;
        for t in 0..att.rows.div_ceil(TILE) {
            let rows: Vec<usize> = (t * TILE..((t + 1) * TILE).min(att.rows)).collect();
            let mut mass = vec![0f32; start];
            for &r in &rows {
                add(&mut mass, att.far_row(r));
            }
            let mut sampled = vec![0f32; start];
            for &r in rows.iter().step_by(SAMPLE_EVERY) {
                add(&mut sampled, att.far_row(r));
            }
            let queries: Vec<usize> = rows.iter().map(|&r| start + r).collect();
            let kernel = sketch_proposal(layer, h, &queries, &chan, &ks, &free, start);
            let mut chosen: Vec<Vec<usize>> = vec![
                top(&mass, &free, HEAVY),
                top(&mass, &top(&sampled, &free, CANDIDATES), HEAVY),
                top(&mass, &top(&kernel, &free, CANDIDATES), HEAVY),
            ];
            for ((pool, &(pass, _, by_kernel)), next) in pools.iter().zip(&CARRIES).zip(&mut next) {
                let proposal = if by_kernel {
                    sketch_proposal(layer, h, &queries, &chan, &ks, pool, start)
                } else {
                    sampled.clone()
                };
                let ranked = top(&mass, &top(&proposal, pool, CANDIDATES), pass.max(HEAVY));
                for &p in ranked.iter().take(pass) {
                    next[p] = true;
                }
                chosen.push(ranked[..HEAVY.min(ranked.len())].to_vec());
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
        carried = next;
        let mut sizes = [0; CARRIES.len()];
        for (s, p) in sizes.iter_mut().zip(&pools) {
            *s = p.len();
        }
        out.push(ChunkResult {
            start,
            sums,
            tiles,
            pools: sizes,
        });
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (text, n, layers_arg, model_arg) = match args.as_slice() {
        [t, n, l] => (t, n, l, None),
        [t, n, l, m] => (t, n, l, Some(m)),
        _ => return Err("usage: carry_over TEXT N LAYERS|all [MODEL]".into()),
    };
    let n: usize = n.parse()?;
    let wanted: Option<Vec<u32>> = if layers_arg == "all" {
        None
    } else {
        Some(layers_arg.split(',').map(str::parse).collect::<Result<_, _>>()?)
    };
    let log = |m: &str| eprintln!("{m}");
    let path = match model_arg {
        Some(m) => models::resolve(Path::new(m), log, &AtomicBool::new(false))?,
        None => default_model::ensure(log)?,
    };
    let model = Model::load(&path, &ModelParams::default())?;
    let mut tokens = model.tokenize(&std::fs::read_to_string(text)?, true, false)?;
    if tokens.len() < n {
        return Err(format!("{text} has {} tokens, fewer than {n}", tokens.len()).into());
    }
    tokens.truncate(n);
    let clock = std::time::Instant::now();
    eprintln!("carry_over: full-attention prefill of {n} tokens, capturing {layers_arg}");
    let layers = capture_dense(&model, &tokens, wanted.as_deref(), 2)?;
    eprintln!("carry_over: captured in {:.0} s", clock.elapsed().as_secs_f64());
    let names: Vec<u32> = layers.iter().map(|l| l.layer).collect();
    let first = &layers[0];
    println!(
        "{}, {text}, {n} tokens, layers {names:?} ({} query heads, {} KV heads, {} channels); \
         S = {CHUNK}, L = {LOCAL}, H = {HEAVY}, {SINK} sinks, tiles of {TILE}, 4 H = {CANDIDATES} \
         candidates from every {SAMPLE_EVERY}th query (`/kernel`: from all 64 on a key sketch); \
         chunks 1 on. Mean covered share of the tile's attention.\n",
        path.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        first.n_head,
        first.n_head_kv,
        first.head_dim,
    );
    println!("| layer | {} |", VARIANTS.join(" | "));
    println!("|---:|{}", "---:|".repeat(VARIANTS.len()));
    let mut total = [0f64; VARIANTS.len()];
    let mut total_tiles = 0;
    // per chunk start: sums, tiles, pool sizes summed over heads, heads
    let mut by_chunk: BTreeMap<usize, ([f64; VARIANTS.len()], usize, [usize; CARRIES.len()], usize)> =
        BTreeMap::new();
    for layer in &layers {
        eprintln!(
            "carry_over: layer {} ({:.0} s)",
            layer.layer,
            clock.elapsed().as_secs_f64()
        );
        let per_head: Vec<Vec<ChunkResult>> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..layer.n_head)
                .map(|h| sc.spawn(move || head_run(layer, h, n)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut sums = [0f64; VARIANTS.len()];
        let mut tiles = 0;
        for r in per_head.iter().flatten() {
            let at = by_chunk
                .entry(r.start)
                .or_insert(([0f64; VARIANTS.len()], 0, [0; CARRIES.len()], 0));
            for ((x, y), z) in sums.iter_mut().zip(r.sums).zip(at.0.iter_mut()) {
                *x += y;
                *z += y;
            }
            for (x, y) in at.2.iter_mut().zip(r.pools) {
                *x += y;
            }
            tiles += r.tiles;
            at.1 += r.tiles;
            at.3 += 1;
        }
        let cells: Vec<String> = sums.iter().map(|s| format!("{:.4}", s / tiles as f64)).collect();
        println!("| {} | {} |", layer.layer, cells.join(" | "));
        for (x, y) in total.iter_mut().zip(sums) {
            *x += y;
        }
        total_tiles += tiles;
    }
    let cells: Vec<String> = total
        .iter()
        .map(|s| format!("**{:.4}**", s / total_tiles as f64))
        .collect();
    println!("| all | {} |", cells.join(" | "));

    let today = 1;
    println!(
        "\nBy chunk, over the layers and heads: difference from `today`, and the mean pool each \
         carrying variant's stage 1 reads per tile (`today` reads every free position: start − {}).\n",
        LOCAL + SINK
    );
    let others: Vec<usize> = (0..VARIANTS.len()).filter(|&v| v != today).collect();
    println!(
        "| chunk start | today | {} | {} |",
        others.iter().map(|&v| VARIANTS[v]).collect::<Vec<_>>().join(" | "),
        VARIANTS[FIRST_CARRY..FIRST_CARRY + CARRIES.len()]
            .iter()
            .map(|v| format!("pool {v}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---:|---:|{}", "---:|".repeat(others.len() + CARRIES.len()));
    for (start, (sums, tiles, pools, heads)) in &by_chunk {
        let base = sums[today] / *tiles as f64;
        let cells: Vec<String> = others
            .iter()
            .map(|&v| format!("{:+.4}", sums[v] / *tiles as f64 - base))
            .collect();
        let sizes: Vec<String> = pools.iter().map(|p| format!("{}", p / heads)).collect();
        println!("| {start} | {base:.4} | {} | {} |", cells.join(" | "), sizes.join(" | "));
    }
    eprintln!("carry_over: done in {:.0} s", clock.elapsed().as_secs_f64());
    Ok(())
}
