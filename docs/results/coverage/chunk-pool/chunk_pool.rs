//! Could one scan per chunk and KV group choose the positions that each tile's proposal then
//! reads, instead of every tile reading every earlier position?
//!
//! The kernel's default stage 1 lets all 64 queries of a tile score every free position before the
//! chunk on a key sketch and propose 4 H candidates, which stage 2 ranks by the whole tile. Its
//! reads and products per tile grow with the prompt. Here a **pool** is chosen once per chunk: the
//! sampled queries of every tile of the chunk (every 16th, four a tile, as the kernel samples
//! them), of every query head of the KV group or of the head alone, score every free position on
//! the same sketch (a softmax over the free positions per query, summed); the K free positions
//! with the most of that attention form the pool. A tile may add the best P positions of its own
//! sampled queries' attention in that scan (computed anyway). Each tile then makes the kernel's
//! proposal among its pool only, and stage 2 ranks it as today. Per tile of one query head the
//! scan costs what four sampled queries a tile cost, a sixteenth of today's proposal.
//!
//! On queries and keys captured from a full-attention prefill (`capture_dense`), for every head,
//! every chunk from the second on and every tile of 64 queries: the share of the tile's attention
//! that its chunk, the forced positions (4 sinks and the last L before the chunk) and H chosen far
//! positions cover, where the H are
//! - `oracle`: the tile's own best H;
//! - `today/kernel`: the kernel's default proposal (all 64 queries of the tile, logits on the key
//!   sketch of D/4 channels with the most key energy up to the chunk's end, D/2 for heads wider
//!   than 128; a softmax over the free positions, summed), 4 H candidates, ranked;
//! - `pool/K`: the same proposal among a pool of K positions chosen by the scan of every head of
//!   the KV group, ranked; `pool/4K/head`: by the head's own scan;
//! - `pool/F/4`: K = max(4096, F / 4), F the free positions before the chunk;
//! - `pool/K+own/P`: the pool of K joined with the P best positions (outside it) of the tile's own
//!   sampled queries;
//! - `forced only`: no far position chosen.
//!
//! "Ranked" is stage 2: the best H of the candidates by the tile's exact attention.
//!
//!   cp docs/results/coverage/chunk-pool/chunk_pool.rs h2o-research/examples/ &&
//!   cargo run --release -p h2o-research --example chunk_pool -- TEXT N LAYERS [MODEL]
//!
//! (LAYERS: comma-separated, or `all` for every layer with full attention, which on a model with
//! sliding-window layers is its global layers; MODEL: a known model's name such as `gemma3-270m`,
//! or a GGUF file; the default model without it.)

use std::collections::BTreeMap;

use h2o_research::coverage::study::{self, sketch, sketch_proposal, top, StudyArgs};
use h2o_research::coverage::{ChunkAttention, DenseLayer, StudyConfig};

const CHUNK: usize = 1024;
const LOCAL: usize = 256;
const HEAVY: usize = 256;
const SINK: usize = 4;
const TILE: usize = 64;
const CANDIDATES: usize = 4 * HEAVY;
/// The chunk's scan: every this-many-th query of the chunk.
const SCAN_EVERY: usize = 16;

const VARIANTS: [&str; 10] = [
    "oracle",
    "today/kernel",
    "pool/4K",
    "pool/4K/head",
    "pool/F/4",
    "pool/2K+own/512",
    "pool/2K+own/1K",
    "pool/4K+own/1K",
    "pool/4K/head+own/1K",
    "forced only",
];

/// Where the pooled variants start in `VARIANTS`.
const FIRST_POOL: usize = 2;

/// Which scan chooses a pool.
#[derive(Clone, Copy)]
enum Scan {
    /// the sampled queries of the chunk, every head of the KV group
    Group,
    /// the sampled queries of the chunk, the head's own
    Head,
}

/// The pooled variants, in `VARIANTS` order from `FIRST_POOL`: the scan, the pool's size (0: a
/// quarter of the free positions, at least 4096), and how many positions the tile's own sampled
/// queries add (their best by their attention in the scan).
const POOLS: [(Scan, usize, usize); 7] = [
    (Scan::Group, 4096, 0),
    (Scan::Head, 4096, 0),
    (Scan::Group, 0, 0),
    (Scan::Group, 2048, 512),
    (Scan::Group, 2048, 1024),
    (Scan::Group, 4096, 1024),
    (Scan::Head, 4096, 1024),
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

/// The sampled queries of the tile whose first position is `t0` (rows `t0 .. end` present):
/// every `SCAN_EVERY`-th from the tile's `SCAN_EVERY − 1`-th on, or its last row without one, as
/// the kernel samples a tile's queries.
fn tile_samples(t0: usize, end: usize) -> Vec<usize> {
    let s: Vec<usize> = (t0 + SCAN_EVERY - 1..end.min(t0 + TILE)).step_by(SCAN_EVERY).collect();
    if s.is_empty() {
        vec![end.min(t0 + TILE) - 1]
    } else {
        s
    }
}

/// The chunk's scans for head `h`: the sketched attention on the free positions (`among`) of
/// the sampled queries of every tile of the chunk, summed over every head of `h`'s KV group and
/// over `h` alone; and `h`'s own per tile.
fn scans(
    layer: &DenseLayer,
    h: usize,
    chunk: std::ops::Range<usize>,
    chan: &[usize],
    ks: &[f32],
    among: &[usize],
    start: usize,
) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let g = layer.n_head / layer.n_head_kv;
    let first = layer.kv_head(h) * g;
    let mut group = vec![0f32; start];
    let mut own = vec![0f32; start];
    let mut by_tile = Vec::new();
    for t0 in chunk.clone().step_by(TILE) {
        let rows = tile_samples(t0, chunk.end);
        for head in first..first + g {
            let m = sketch_proposal(layer, head, &rows, chan, ks, among, start);
            add(&mut group, &m);
            if head == h {
                add(&mut own, &m);
                by_tile.push(m);
            }
        }
    }
    (group, own, by_tile)
}

/// What one head gives at one chunk: per variant the covered share summed over tiles, the
/// number of tiles, and per pooled variant the mean size of its tiles' pools.
struct ChunkResult {
    start: usize,
    sums: [f64; VARIANTS.len()],
    tiles: usize,
    pools: [usize; POOLS.len()],
}

/// Every chunk of head `h`, in order.
fn head_run(layer: &DenseLayer, h: usize, n: usize) -> Vec<ChunkResult> {
    let mut out = Vec::new();
    for start in (CHUNK..n).step_by(CHUNK) {
        let end = (start + CHUNK).min(n);
        let att = ChunkAttention::of(layer, h, start, end);
        let forced: Vec<usize> = shape().forced(start).into_iter().map(|p| p as usize).collect();
        let mut is_free = vec![true; start];
        for &p in &forced {
            is_free[p] = false;
        }
        let free: Vec<usize> = (0..start).filter(|&p| is_free[p]).collect();
        let (chan, ks) = sketch(layer, h, start, end);
        let (group, own, by_tile) = scans(layer, h, start..end, &chan, &ks, &free, start);
        // per pooled variant, the chunk's pool (ascending)
        let pools: Vec<Vec<usize>> = POOLS
            .iter()
            .map(|&(scan, k, _)| {
                let mass = match scan {
                    Scan::Group => &group,
                    Scan::Head => &own,
                };
                let k = if k == 0 { (free.len() / 4).max(4096) } else { k };
                let mut pool = top(mass, &free, k);
                pool.sort_unstable();
                pool
            })
            .collect();
        let mut pool_sums = [0usize; POOLS.len()];
        let mut sums = [0f64; VARIANTS.len()];
        let mut tiles = 0;
        for t in 0..att.rows.div_ceil(TILE) {
            let rows: Vec<usize> = (t * TILE..((t + 1) * TILE).min(att.rows)).collect();
            let mut mass = vec![0f32; start];
            for &r in &rows {
                add(&mut mass, att.far_row(r));
            }
            let queries: Vec<usize> = rows.iter().map(|&r| start + r).collect();
            let kernel = sketch_proposal(layer, h, &queries, &chan, &ks, &free, start);
            let mut chosen: Vec<Vec<usize>> = vec![
                top(&mass, &free, HEAVY),
                top(&mass, &top(&kernel, &free, CANDIDATES), HEAVY),
            ];
            let mut sizes = [0; POOLS.len()];
            for ((pool, &(_, _, extra)), size) in pools.iter().zip(&POOLS).zip(&mut sizes) {
                let mut pool = pool.clone();
                if extra > 0 {
                    // the tile's own samples' best, where the chunk's pool lacks them
                    let mut inside = vec![false; start];
                    for &p in &pool {
                        inside[p] = true;
                    }
                    let outside: Vec<usize> = free.iter().copied().filter(|&p| !inside[p]).collect();
                    pool.extend(top(&by_tile[t], &outside, extra));
                    pool.sort_unstable();
                }
                *size = pool.len();
                let proposal = sketch_proposal(layer, h, &queries, &chan, &ks, &pool, start);
                chosen.push(top(&mass, &top(&proposal, &pool, CANDIDATES), HEAVY));
            }
            for (x, y) in pool_sums.iter_mut().zip(sizes) {
                *x += y;
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
        let mut sizes = [0; POOLS.len()];
        for (s, p) in sizes.iter_mut().zip(pool_sums) {
            *s = p / tiles;
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
    let args = StudyArgs::parse("chunk_pool", &std::env::args().skip(1).collect::<Vec<_>>())?;
    let captured = study::capture("chunk_pool", &args)?;
    let (n, text, layers, clock) = (args.n, args.text.display(), &captured.layers, captured.clock);
    let names: Vec<u32> = layers.iter().map(|l| l.layer).collect();
    let first = &layers[0];
    println!(
        "{}, {text}, {n} tokens, layers {names:?} ({} query heads, {} KV heads, {} channels); \
         S = {CHUNK}, L = {LOCAL}, H = {HEAVY}, {SINK} sinks, tiles of {TILE}, 4 H = {CANDIDATES} \
         candidates from all 64 queries of the tile on a key sketch, the pools \
         by every {SCAN_EVERY}th query of each tile; chunks 1 on. Mean covered share of the \
         tile's attention.\n",
        captured.model_file, first.n_head, first.n_head_kv, first.head_dim,
    );
    println!("| layer | {} |", VARIANTS.join(" | "));
    println!("|---:|{}", "---:|".repeat(VARIANTS.len()));
    let mut total = [0f64; VARIANTS.len()];
    let mut total_tiles = 0;
    // per chunk start: sums, tiles, pool sizes summed over heads, heads
    let mut by_chunk: BTreeMap<usize, ([f64; VARIANTS.len()], usize, [usize; POOLS.len()], usize)> =
        BTreeMap::new();
    for layer in layers {
        eprintln!(
            "chunk_pool: layer {} ({:.0} s)",
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
                .or_insert(([0f64; VARIANTS.len()], 0, [0; POOLS.len()], 0));
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

    let today = 1; // today/kernel
    println!(
        "\nBy chunk, over the layers and heads: difference from `today/kernel`, and the mean pool \
         each pooled variant's tiles read (`today/kernel` reads every free position: start − {}).\n",
        LOCAL + SINK
    );
    let others: Vec<usize> = (0..VARIANTS.len()).filter(|&v| v != today).collect();
    println!(
        "| chunk start | today/kernel | {} | {} |",
        others.iter().map(|&v| VARIANTS[v]).collect::<Vec<_>>().join(" | "),
        VARIANTS[FIRST_POOL..FIRST_POOL + POOLS.len()]
            .iter()
            .map(|v| format!("pool {v}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---:|---:|{}", "---:|".repeat(others.len() + POOLS.len()));
    for (start, (sums, tiles, pools, heads)) in &by_chunk {
        let base = sums[today] / *tiles as f64;
        let cells: Vec<String> = others
            .iter()
            .map(|&v| format!("{:+.4}", sums[v] / *tiles as f64 - base))
            .collect();
        let sizes: Vec<String> = pools.iter().map(|p| format!("{}", p / heads)).collect();
        println!("| {start} | {base:.4} | {} | {} |", cells.join(" | "), sizes.join(" | "));
    }
    eprintln!("chunk_pool: done in {:.0} s", clock.elapsed().as_secs_f64());
    Ok(())
}
