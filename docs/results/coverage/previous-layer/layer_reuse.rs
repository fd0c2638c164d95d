//! Could a layer take its candidates from the layer before it instead of proposing its own?
//!
//! On queries and keys captured from a full-attention prefill (`capture_dense`), for pairs of
//! adjacent layers (a, b = a + 1), every head of b, every chunk from the second on and every tile
//! of 64 queries: the share of the tile's attention that its chunk, the forced positions (4
//! sinks and the last L before the chunk) and H chosen far positions cover, where the H are
//! - `oracle`: the tile's own best H (what no estimator beats);
//! - `sampled+rank`: 4 H candidates by the exact attention of every 16th query of the tile (the
//!   study's stage 1; the kernel's samples all 64 queries on a key sketch), the best H of them by
//!   the whole tile's attention (stage 2, exact here);
//! - `prev-head+rank`: 4 H candidates by layer a's attention of the same tile and head index,
//!   ranked by layer b's tile (stage 1 replaced by the previous layer, stage 2 kept);
//! - `prev-all+rank`: 4 H candidates by layer a's attention of the same tile summed over its
//!   heads, ranked by layer b's tile;
//! - `prev-head`, `prev-all`: layer a's best H taken as they are (neither stage);
//! - `forced only`: no far position chosen.
//! Layer a's attention is its exact attention here, so the `prev-*` rows are upper bounds for
//! a kernel, whose layer a would only have its own estimate.
//!
//!   cp docs/results/coverage/previous-layer/layer_reuse.rs h2o-research/examples/ &&
//!   cargo run --release -p h2o-research --example layer_reuse -- TEXT N LAYERS_B
//!
//! (LAYERS_B: the layers b, comma-separated; each is captured with the layer before it.)

use h2o_research::coverage::{capture_dense, ChunkAttention, DenseLayer, StudyConfig};
use h2o_llama::{default_model, Model, ModelParams};

const CHUNK: usize = 1024;
const LOCAL: usize = 256;
const HEAVY: usize = 256;
const SINK: usize = 4;
const TILE: usize = 64;
const SAMPLE_EVERY: usize = 16;
const CANDIDATES: usize = 4 * HEAVY;

const VARIANTS: [&str; 7] = [
    "oracle",
    "sampled+rank",
    "prev-head+rank",
    "prev-all+rank",
    "prev-head",
    "prev-all",
    "forced only",
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

/// The `n` positions of `free` with the largest `mass`.
fn top(mass: &[f32], free: &[usize], n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = free.to_vec();
    v.sort_by(|&x, &y| mass[y].total_cmp(&mass[x]).then(x.cmp(&y)));
    v.truncate(n);
    v
}

/// Per tile, the tile's attention summed over its queries on every far position.
fn tile_masses(att: &ChunkAttention) -> Vec<Vec<f32>> {
    (0..att.rows.div_ceil(TILE))
        .map(|t| {
            let mut m = vec![0f32; att.start];
            for r in t * TILE..((t + 1) * TILE).min(att.rows) {
                add(&mut m, att.far_row(r));
            }
            m
        })
        .collect()
}

/// Layer a's tile masses for every head at one chunk: `[head][tile][position]`.
fn previous_layer(a: &DenseLayer, start: usize, end: usize) -> Vec<Vec<Vec<f32>>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..a.n_head)
            .map(|h| s.spawn(move || tile_masses(&ChunkAttention::of(a, h, start, end))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Sums of each variant's coverage over tiles, and the number of tiles, for head `h` of b.
fn head_coverage(
    b: &DenseLayer,
    h: usize,
    start: usize,
    end: usize,
    prev: &[Vec<Vec<f32>>],
    prev_all: &[Vec<f32>],
) -> ([f64; VARIANTS.len()], usize) {
    let att = ChunkAttention::of(b, h, start, end);
    let forced: Vec<usize> = shape().forced(start).into_iter().map(|p| p as usize).collect();
    let free: Vec<usize> = (0..start).filter(|p| forced.binary_search(p).is_err()).collect();
    let mut sums = [0f64; VARIANTS.len()];
    let mut tiles = 0;
    for (t, mass) in tile_masses(&att).iter().enumerate() {
        let rows: Vec<usize> = (t * TILE..((t + 1) * TILE).min(att.rows)).collect();
        let mut sampled = vec![0f32; start];
        for &r in rows.iter().step_by(SAMPLE_EVERY) {
            add(&mut sampled, att.far_row(r));
        }
        let ranked = |candidates: Vec<usize>| top(mass, &candidates, HEAVY);
        let chosen: [Vec<usize>; VARIANTS.len()] = [
            top(mass, &free, HEAVY),
            ranked(top(&sampled, &free, CANDIDATES)),
            ranked(top(&prev[h][t], &free, CANDIDATES)),
            ranked(top(&prev_all[t], &free, CANDIDATES)),
            top(&prev[h][t], &free, HEAVY),
            top(&prev_all[t], &free, HEAVY),
            Vec::new(),
        ];
        let intra: f64 = rows.iter().map(|&r| f64::from(att.intra[r])).sum();
        let held: f64 = forced.iter().map(|&p| f64::from(mass[p])).sum();
        for (sum, set) in sums.iter_mut().zip(&chosen) {
            let far: f64 = set.iter().map(|&p| f64::from(mass[p])).sum();
            *sum += (intra + held + far) / rows.len() as f64;
        }
        tiles += 1;
    }
    (sums, tiles)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [text, n, layers_b] = args.as_slice() else {
        return Err("usage: layer_reuse TEXT N LAYERS_B (for example 2,8,14,20,26)".into());
    };
    let n: usize = n.parse()?;
    let layers_b: Vec<u32> = layers_b
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if layers_b.contains(&0) {
        return Err("layer 0 has no layer before it".into());
    }
    let model = Model::load(
        default_model::ensure(|m| eprintln!("{m}"))?,
        &ModelParams::default(),
    )?;
    let mut tokens = model.tokenize(&std::fs::read_to_string(text)?, true, false)?;
    if tokens.len() < n {
        return Err(format!("{text} has {} tokens, fewer than {n}", tokens.len()).into());
    }
    tokens.truncate(n);
    let wanted: Vec<u32> = layers_b.iter().flat_map(|&l| [l - 1, l]).collect();
    eprintln!("layer_reuse: full-attention prefill of {n} tokens, capturing layers {wanted:?}");
    let layers = capture_dense(&model, &tokens, Some(&wanted), 2)?;
    let find = |l: u32| layers.iter().find(|x| x.layer == l).expect("captured");
    println!("| layer b | {} |", VARIANTS.join(" | "));
    println!("|---:|{}", "---:|".repeat(VARIANTS.len()));
    let mut total = [0f64; VARIANTS.len()];
    let mut total_tiles = 0;
    for &lb in &layers_b {
        let (a, b) = (find(lb - 1), find(lb));
        let mut sums = [0f64; VARIANTS.len()];
        let mut tiles = 0;
        for start in (CHUNK..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            eprintln!("layer_reuse: layers {}/{lb}, chunk at {start}", lb - 1);
            let prev = previous_layer(a, start, end);
            let prev_all: Vec<Vec<f32>> = (0..prev[0].len())
                .map(|t| {
                    let mut m = vec![0f32; start];
                    for head in &prev {
                        add(&mut m, &head[t]);
                    }
                    m
                })
                .collect();
            let per_head: Vec<([f64; VARIANTS.len()], usize)> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..b.n_head)
                    .map(|h| {
                        let (prev, prev_all) = (&prev, &prev_all);
                        s.spawn(move || head_coverage(b, h, start, end, prev, prev_all))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (s, t) in per_head {
                for (x, y) in sums.iter_mut().zip(s) {
                    *x += y;
                }
                tiles += t;
            }
        }
        let cells: Vec<String> = sums.iter().map(|s| format!("{:.4}", s / tiles as f64)).collect();
        println!("| {lb} | {} |", cells.join(" | "));
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
    Ok(())
}
