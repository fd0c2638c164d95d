//! Could the query heads that share a KV head share the proposal of their memory?
//!
//! Today every query head proposes its own candidates (stage 1: the exact attention of every 16th
//! query of a tile of 64 on every position before the chunk) and ranks them by all 64 queries of
//! the tile (stage 2). Stage 1 is the part whose cost grows with the prompt, and it is paid once
//! per query head, where the heads of a KV group read the same keys. This program measures, per
//! tile of 64 queries, the share of each head's attention that its chunk, the forced positions (4
//! sinks and the last L before the chunk) and H chosen far positions cover, where the H are
//! - `oracle`: the head's own best H;
//! - `today`: 4 H candidates by the head's own samples (every 16th query of the tile), ranked by
//!   the head's whole tile;
//! - `union/rank`: 4 H candidates by the samples of every head of the group, summed (the same
//!   stage-1 work as today, the candidates shared), ranked by each head's tile;
//! - `rotate/rank`: 4 H candidates by 4 samples a tile for the whole group, each taken from one
//!   head in turn (the head of sample k of tile t is the group's (k + t) mod g-th), ranked by each
//!   head's tile: stage 1 costs 1 / g of today's;
//! - `rotate8/rank`: the same with 8 samples a tile (every 8th query): 2 / g of today's;
//! - `oracle/group`: one set of H for the whole group, the best by the group's summed attention
//!   (what any shared memory can reach);
//! - `rotate/group`: `rotate/rank`'s candidates ranked once by the group's summed attention, one
//!   set for the group (the attention could then read one gathered copy of the rows per group);
//! - `forced only`: no far position chosen.
//!
//!   mkdir -p h2o-research/examples && cp docs/results/coverage/kv-group/kv_group.rs h2o-research/examples/ &&
//!   cargo run --release -p h2o-research --example kv_group -- TEXT N LAYERS|all [MODEL]
//!
//! (LAYERS: comma-separated, or `all` for every layer with full attention; MODEL: a known model's
//! name such as `gemma3-270m`, or a GGUF file; the default model without it.)

use std::path::Path;
use std::sync::atomic::AtomicBool;

use h2o_llama::{default_model, models, Model, ModelParams};
use h2o_research::coverage::{capture_dense, ChunkAttention, DenseLayer, StudyConfig};

const CHUNK: usize = 1024;
const LOCAL: usize = 256;
const HEAVY: usize = 256;
const SINK: usize = 4;
const TILE: usize = 64;
const CANDIDATES: usize = 4 * HEAVY;

const VARIANTS: [&str; 8] = [
    "oracle",
    "today",
    "union/rank",
    "rotate/rank",
    "rotate8/rank",
    "oracle/group",
    "rotate/group",
    "forced only",
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

/// The far attention of rows `rows` of `att`, summed.
fn summed(att: &ChunkAttention, rows: impl Iterator<Item = usize>) -> Vec<f32> {
    let mut m = vec![0f32; att.start];
    for r in rows {
        add(&mut m, att.far_row(r));
    }
    m
}

/// The rotating samples of tile `t` (rows `rows`), `every` rows apart, across the group's heads
/// `atts`: sample k comes from head (k + t) mod g.
fn rotating(atts: &[ChunkAttention], t: usize, rows: &[usize], every: usize) -> Vec<f32> {
    let mut m = vec![0f32; atts[0].start];
    for (k, &r) in rows.iter().step_by(every).enumerate() {
        add(&mut m, atts[(k + t) % atts.len()].far_row(r));
    }
    m
}

/// Sums of each variant's coverage over the tiles and heads of one KV group at one chunk, and
/// the number of (head, tile) pairs.
fn group_coverage(layer: &DenseLayer, kv: usize, start: usize, end: usize) -> ([f64; VARIANTS.len()], usize) {
    let g = layer.n_head / layer.n_head_kv;
    let heads: Vec<usize> = (kv * g..(kv + 1) * g).collect();
    // the heads' attention in parallel: a model with one KV head has one group
    let atts: Vec<ChunkAttention> = std::thread::scope(|sc| {
        let handles: Vec<_> = heads
            .iter()
            .map(|&h| sc.spawn(move || ChunkAttention::of(layer, h, start, end)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let forced: Vec<usize> = shape().forced(start).into_iter().map(|p| p as usize).collect();
    let mut is_free = vec![true; start];
    for &p in &forced {
        is_free[p] = false;
    }
    let free: Vec<usize> = (0..start).filter(|&p| is_free[p]).collect();
    let rows_total = atts[0].rows;
    let mut sums = [0f64; VARIANTS.len()];
    let mut pairs = 0;
    for t in 0..rows_total.div_ceil(TILE) {
        let rows: Vec<usize> = (t * TILE..((t + 1) * TILE).min(rows_total)).collect();
        let masses: Vec<Vec<f32>> = atts.iter().map(|a| summed(a, rows.iter().copied())).collect();
        let sampled: Vec<Vec<f32>> = atts.iter().map(|a| summed(a, rows.iter().copied().step_by(16))).collect();
        let mut group_mass = vec![0f32; start];
        let mut union = vec![0f32; start];
        for (m, s) in masses.iter().zip(&sampled) {
            add(&mut group_mass, m);
            add(&mut union, s);
        }
        let union_cand = top(&union, &free, CANDIDATES);
        let rotate_cand = top(&rotating(&atts, t, &rows, 16), &free, CANDIDATES);
        let rotate8_cand = top(&rotating(&atts, t, &rows, 8), &free, CANDIDATES);
        let oracle_group = top(&group_mass, &free, HEAVY);
        let rotate_group = top(&group_mass, &rotate_cand, HEAVY);
        for (i, att) in atts.iter().enumerate() {
            let mass = &masses[i];
            let chosen: [Vec<usize>; VARIANTS.len()] = [
                top(mass, &free, HEAVY),
                top(mass, &top(&sampled[i], &free, CANDIDATES), HEAVY),
                top(mass, &union_cand, HEAVY),
                top(mass, &rotate_cand, HEAVY),
                top(mass, &rotate8_cand, HEAVY),
                oracle_group.clone(),
                rotate_group.clone(),
                Vec::new(),
            ];
            let intra: f64 = rows.iter().map(|&r| f64::from(att.intra[r])).sum();
            let held: f64 = forced.iter().map(|&p| f64::from(mass[p])).sum();
            for (sum, set) in sums.iter_mut().zip(&chosen) {
                let far: f64 = set.iter().map(|&p| f64::from(mass[p])).sum();
                *sum += (intra + held + far) / rows.len() as f64;
            }
            pairs += 1;
        }
    }
    (sums, pairs)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (text, n, layers_arg, model_arg) = match args.as_slice() {
        [t, n, l] => (t, n, l, None),
        [t, n, l, m] => (t, n, l, Some(m)),
        _ => return Err("usage: kv_group TEXT N LAYERS|all [MODEL]".into()),
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
    eprintln!("kv_group: full-attention prefill of {n} tokens, capturing {layers_arg}");
    let layers = capture_dense(&model, &tokens, wanted.as_deref(), 2)?;
    eprintln!("kv_group: captured in {:.0} s", clock.elapsed().as_secs_f64());
    let names: Vec<u32> = layers.iter().map(|l| l.layer).collect();
    let first = &layers[0];
    let g = first.n_head / first.n_head_kv;
    println!(
        "{}, {text}, {n} tokens, layers {names:?} ({} query heads, {} KV heads, g = {g}, {} channels); \
         S = {CHUNK}, L = {LOCAL}, H = {HEAVY}, {SINK} sinks, tiles of {TILE}, 4 H = {CANDIDATES} \
         candidates; chunks 1 on. Mean covered share of each head's tile attention.\n",
        path.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        first.n_head,
        first.n_head_kv,
        first.head_dim,
    );
    println!("| layer | {} |", VARIANTS.join(" | "));
    println!("|---:|{}", "---:|".repeat(VARIANTS.len()));
    let mut total = [0f64; VARIANTS.len()];
    let mut total_pairs = 0;
    for layer in &layers {
        let mut sums = [0f64; VARIANTS.len()];
        let mut pairs = 0;
        for start in (CHUNK..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            eprintln!("kv_group: layer {}, chunk at {start} ({:.0} s)", layer.layer, clock.elapsed().as_secs_f64());
            // the KV groups in parallel where there are several, else one thread
            let per_group: Vec<([f64; VARIANTS.len()], usize)> = std::thread::scope(|sc| {
                let handles: Vec<_> = (0..layer.n_head_kv)
                    .map(|kv| sc.spawn(move || group_coverage(layer, kv, start, end)))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (s, p) in per_group {
                for (x, y) in sums.iter_mut().zip(s) {
                    *x += y;
                }
                pairs += p;
            }
        }
        let cells: Vec<String> = sums.iter().map(|s| format!("{:.4}", s / pairs as f64)).collect();
        println!("| {} | {} |", layer.layer, cells.join(" | "));
        for (x, y) in total.iter_mut().zip(sums) {
            *x += y;
        }
        total_pairs += pairs;
    }
    let cells: Vec<String> = total.iter().map(|s| format!("**{:.4}**", s / total_pairs as f64)).collect();
    println!("| all | {} |", cells.join(" | "));
    let today = total[1] / total_pairs as f64;
    let diffs: Vec<String> = total.iter().map(|s| format!("{:+.4}", s / total_pairs as f64 - today)).collect();
    println!("| all − today | {} |", diffs.join(" | "));
    println!(
        "\nStage 1 per tile and KV group, as a share of today's (g = {g} heads × 4 samples × every \
         position before the chunk): union/rank 1, rotate/rank and rotate/group 1/{g}, \
         rotate8/rank 2/{g}; stage 2 (each head's 64 queries × 4 H candidates) unchanged, one \
         ranking by the group's summed attention for rotate/group."
    );
    eprintln!("kv_group: done in {:.0} s", clock.elapsed().as_secs_f64());
    Ok(())
}
