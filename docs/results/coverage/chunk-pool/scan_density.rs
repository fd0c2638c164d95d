//! A pool per chunk, round 3: does a denser scan, or a larger pool, recover what the pool loses?
//!
//! `chunk_pool.rs` found that the kernel's pool (each head's scan by every 16th query of each tile
//! choosing 4,096 positions, each tile adding the 1,024 its own scanned queries attend to most)
//! covers 0.0047 less of the tile's attention than the kernel's own proposal on Gemma 3 at 32K,
//! nearly all of it on layer 5. Here the same measure for the kernel's pool with a denser scan
//! (every 8th or every 4th query of a tile: 8 or 16 a tile), a larger tile's own (2,048) and a
//! larger pool (8,192 + 2,048), all by the head's own scan, as the kernel runs it; and the scan
//! shared by the KV group for comparison. The rest is `chunk_pool.rs`'s: the kernel's proposal
//! among the tile's pool, ranked by the tile's exact attention, H = 256 per tile.
//!
//!   cp docs/results/coverage/chunk-pool/scan_density.rs h2o-research/examples/ &&
//!   cargo run --release -p h2o-research --example scan_density -- TEXT N LAYERS [MODEL]

use std::collections::BTreeMap;

use h2o_research::coverage::study::{self, sketch, sketch_proposal, top, StudyArgs};
use h2o_research::coverage::{ChunkAttention, DenseLayer, StudyConfig};

const CHUNK: usize = 1024;
const LOCAL: usize = 256;
const HEAVY: usize = 256;
const SINK: usize = 4;
const TILE: usize = 64;
const CANDIDATES: usize = 4 * HEAVY;
/// The scans' densities: every this-many-th query of each tile.
const SCAN_EVERY: [usize; 3] = [16, 8, 4];

const VARIANTS: [&str; 9] = [
    "oracle",
    "today/kernel",
    "pool/4K/head+own/1K",
    "pool/4K/head+own/1K, scan 1/8",
    "pool/4K/head+own/1K, scan 1/4",
    "pool/4K/head+own/2K",
    "pool/8K/head+own/2K",
    "pool/4K+own/1K",
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

/// The pooled variants, in `VARIANTS` order from `FIRST_POOL`: the scan, its density (an index
/// into `SCAN_EVERY`), the pool's size, and how many positions the tile's own scanned queries add
/// (their best by their attention in the scan).
const POOLS: [(Scan, usize, usize, usize); 6] = [
    (Scan::Head, 0, 4096, 1024),
    (Scan::Head, 1, 4096, 1024),
    (Scan::Head, 2, 4096, 1024),
    (Scan::Head, 0, 4096, 2048),
    (Scan::Head, 0, 8192, 2048),
    (Scan::Group, 0, 4096, 1024),
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
/// every `every`-th from the tile's `every − 1`-th on, or its last row without one, as
/// the kernel samples a tile's queries.
fn tile_samples(t0: usize, end: usize, every: usize) -> Vec<usize> {
    let s: Vec<usize> = (t0 + every - 1..end.min(t0 + TILE)).step_by(every).collect();
    if s.is_empty() {
        vec![end.min(t0 + TILE) - 1]
    } else {
        s
    }
}

/// A chunk's scans of one density: by the KV group, by the head, by the head per tile.
type Scans = (Vec<f32>, Vec<f32>, Vec<Vec<f32>>);

/// The chunk's scans for head `h` by every `every`-th query of each tile: the sketched attention
/// on the free positions (`among`) of those queries of every tile of the chunk, summed over every
/// head of `h`'s KV group (with `with_group`; else `h`'s alone) and over `h` alone; and `h`'s own
/// per tile.
fn scans(
    layer: &DenseLayer,
    h: usize,
    chunk: std::ops::Range<usize>,
    chan: &[usize],
    ks: &[f32],
    among: &[usize],
    start: usize,
    every: usize,
    with_group: bool,
) -> Scans {
    let g = layer.n_head / layer.n_head_kv;
    let first = layer.kv_head(h) * g;
    let mut group = vec![0f32; start];
    let mut own = vec![0f32; start];
    let mut by_tile = Vec::new();
    for t0 in chunk.clone().step_by(TILE) {
        let rows = tile_samples(t0, chunk.end, every);
        for head in (first..first + g).filter(|&x| with_group || x == h) {
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
        // per density: the group's scan, the head's, the head's by tile
        let scanned: Vec<Scans> = SCAN_EVERY
            .iter()
            .enumerate()
            .map(|(d, &every)| scans(layer, h, start..end, &chan, &ks, &free, start, every, d == 0))
            .collect();
        // per pooled variant, the chunk's pool (ascending)
        let pools: Vec<Vec<usize>> = POOLS
            .iter()
            .map(|&(scan, density, k, _)| {
                let (group, own, _) = &scanned[density];
                let mass = match scan {
                    Scan::Group => group,
                    Scan::Head => own,
                };
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
            for ((pool, &(_, density, _, extra)), size) in pools.iter().zip(&POOLS).zip(&mut sizes) {
                let mut pool = pool.clone();
                if extra > 0 {
                    // the tile's own samples' best, where the chunk's pool lacks them
                    let mut inside = vec![false; start];
                    for &p in &pool {
                        inside[p] = true;
                    }
                    let outside: Vec<usize> = free.iter().copied().filter(|&p| !inside[p]).collect();
                    pool.extend(top(&scanned[density].2[t], &outside, extra));
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
    let args = StudyArgs::parse("scan_density", &std::env::args().skip(1).collect::<Vec<_>>())?;
    let captured = study::capture("scan_density", &args)?;
    let (n, text, layers, clock) = (args.n, args.text.display(), &captured.layers, captured.clock);
    let names: Vec<u32> = layers.iter().map(|l| l.layer).collect();
    let first = &layers[0];
    println!(
        "{}, {text}, {n} tokens, layers {names:?} ({} query heads, {} KV heads, {} channels); \
         S = {CHUNK}, L = {LOCAL}, H = {HEAVY}, {SINK} sinks, tiles of {TILE}, 4 H = {CANDIDATES} \
         candidates from all 64 queries of the tile on a key sketch, the pools \
         by every {SCAN_EVERY:?}th query of each tile; chunks 1 on. Mean covered share of the \
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
            "scan_density: layer {} ({:.0} s)",
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
    eprintln!("scan_density: done in {:.0} s", clock.elapsed().as_secs_f64());
    Ok(())
}
