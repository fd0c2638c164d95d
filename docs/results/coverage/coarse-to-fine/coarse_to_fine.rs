//! Could stage 1 read a few block summaries instead of every earlier position?
//!
//! Today's stage 1 scores every position before the chunk for the queries of each tile of 64
//! and proposes 4 H candidates, which stage 2 ranks by the whole tile; it reads all N earlier
//! positions per tile, so its cost grows with the prompt. This program measures estimators that
//! first score block summaries and only then positions inside the best blocks.
//!
//! On queries and keys captured from a full-attention prefill (`capture_dense`), for every head,
//! every chunk from the second on and every tile of 64 queries: the share of the tile's attention
//! that its chunk, the forced positions (4 sinks and the last L before the chunk) and H chosen far
//! positions cover, where the H are
//! - `oracle`: the tile's own best H;
//! - `today`: 4 H candidates by the exact attention of every 16th query of the tile (the study's
//!   stage 1), ranked;
//! - `mean16/tile`: blocks of 16 positions, aligned to position 0, each summarised by its mean key;
//!   all 64 queries of the tile score them; the best blocks give the 4 H candidates, ranked;
//! - `quest16/tile`: the same with Quest's upper bound of the block's logits (per-channel minimum
//!   and maximum of its keys) in place of the mean key;
//! - `mean16/chunk`, `quest16/chunk`: the block scan once per chunk and KV group (every 16th query
//!   of the chunk, every query head of the group), which keeps the best blocks holding 4096 free
//!   positions; per tile, `today`'s samples propose 4 H candidates among those only, ranked;
//! - `mean64/chunk`: `mean16/chunk` with blocks of 64;
//! - `quest16/chunk@2K`, `@8K`: `quest16/chunk` keeping 2048 or 8192 free positions;
//! - `exact16/chunk`: not an estimator but a bound on the `/chunk` scans: `mean16/chunk` with
//!   each block scored by the sampled queries' exact attention on it, which no summary beats;
//! - `sketch16/chunk` (round 2): `exact16/chunk` with the scanning queries' attention taken on a
//!   key sketch, the quarter of each KV head's channels with the most key energy over the positions
//!   before the chunk (the kernel's `tile_sketch` picks its channels the same way): the softmax
//!   over positions is taken on the sketch's logits, a block's score is the sum over its
//!   positions. Unlike `exact16/chunk` this is a scan a kernel could run: per chunk it reads every
//!   earlier key once per KV head, on a quarter of its channels;
//! - `sketch16/chunk@N/4`, `quest16/chunk@N/4` (round 2): keeping max(4096, F / 4) free positions,
//!   F the free positions before the chunk, a budget that grows with the prompt;
//! - `quest16/tile@4K`: the Quest scan per tile (all 64 queries) keeps 4096 free positions, among
//!   which `today`'s samples propose (what sharing the scan over the chunk costs);
//! - `mean256>16/tile`: per tile, blocks of 256 by mean key, the best holding 4096 free positions,
//!   then their blocks of 16 by mean key, the best giving the 4 H candidates, ranked;
//! - `forced only`: no far position chosen.
//!
//! "Ranked" is stage 2: the best H of the candidates by the tile's exact attention, as the study
//! measures it. A block's score, for one query, is its weight in a softmax over the blocks' logits
//! (each weighted by its size); a block's score is summed over the scoring queries. Blocks that
//! hold forced positions take part (they compete for the query's weight); only free positions
//! become candidates.
//!
//!   cp docs/results/coverage/coarse-to-fine/coarse_to_fine.rs h2o-research/examples/ &&
//!   cargo run --release -p h2o-research --example coarse_to_fine -- TEXT N LAYERS [MODEL]
//!
//! (LAYERS: comma-separated, or `all` for every layer with full attention, which on a model with
//! sliding-window layers is its global layers; MODEL: a known model's name such as `gemma3-270m`,
//! or a GGUF file; the default model without it.)

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use h2o_research::coverage::{capture_dense, ChunkAttention, DenseLayer, StudyConfig};
use h2o_llama::{default_model, models, Model, ModelParams};

const CHUNK: usize = 1024;
const LOCAL: usize = 256;
const HEAVY: usize = 256;
const SINK: usize = 4;
const TILE: usize = 64;
const SAMPLE_EVERY: usize = 16;
const CANDIDATES: usize = 4 * HEAVY;
/// Free positions the `/chunk` scans and the first level of `mean256>16/tile` keep.
const KEEP: usize = 4096;
/// The sketch scans read `1 / SKETCH` of each key head's channels.
const SKETCH: usize = 4;

const VARIANTS: [&str; 16] = [
    "oracle",
    "today",
    "mean16/tile",
    "quest16/tile",
    "mean256>16/tile",
    "quest16/tile@4K",
    "exact16/chunk",
    "mean16/chunk",
    "quest16/chunk",
    "mean64/chunk",
    "quest16/chunk@2K",
    "quest16/chunk@8K",
    "sketch16/chunk",
    "sketch16/chunk@N/4",
    "quest16/chunk@N/4",
    "forced only",
];

/// The `/chunk` variants, in `VARIANTS` order: name, block size, how blocks are scored, free
/// positions kept.
const CHUNK_SCANS: [(&str, usize, Scan, Keep); 9] = [
    // not an estimator: what the best scan of blocks of 16 could keep
    ("exact16/chunk", 16, Scan::Exact, Keep::Fixed(KEEP)),
    ("mean16/chunk", 16, Scan::Summary(Bound::Mean), Keep::Fixed(KEEP)),
    ("quest16/chunk", 16, Scan::Summary(Bound::Quest), Keep::Fixed(KEEP)),
    ("mean64/chunk", 64, Scan::Summary(Bound::Mean), Keep::Fixed(KEEP)),
    // how the kept share matters: half and twice as many positions
    ("quest16/chunk@2K", 16, Scan::Summary(Bound::Quest), Keep::Fixed(KEEP / 2)),
    ("quest16/chunk@8K", 16, Scan::Summary(Bound::Quest), Keep::Fixed(2 * KEEP)),
    // round 2: the exact scan made affordable by reading a quarter of the channels
    ("sketch16/chunk", 16, Scan::Sketch, Keep::Fixed(KEEP)),
    // round 2: whether a budget that grows with the prompt rescues the cheap scans
    ("sketch16/chunk@N/4", 16, Scan::Sketch, Keep::Quarter),
    ("quest16/chunk@N/4", 16, Scan::Summary(Bound::Quest), Keep::Quarter),
];

/// How many free positions a `/chunk` scan keeps.
#[derive(Clone, Copy)]
enum Keep {
    /// this many, whatever the prompt's length
    Fixed(usize),
    /// `max(KEEP, F / 4)` with F the free positions before the chunk: the fine pass then reads a
    /// fixed share of the prompt, so its cost grows with N as today's does, but at a quarter
    Quarter,
}

impl Keep {
    /// The positions kept of `free` free ones (all of them where there are fewer).
    fn of(self, free: usize) -> usize {
        match self {
            Keep::Fixed(n) => n,
            Keep::Quarter => KEEP.max(free / 4),
        }
        .min(free)
    }
}

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

/// `a · b` with eight running sums, so that the compiler vectorises it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail = a.len() / 8 * 8;
    acc.iter().sum::<f32>() + dot_plain(&a[tail..], &b[tail..])
}

fn dot_plain(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Quest's bound on `q · k` over keys whose channels lie in `[lo, hi]`:
/// Σ_c max(q_c lo_c, q_c hi_c).
fn quest(q: &[f32], lo: &[f32], hi: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for ((x, l), h) in q.chunks_exact(8).zip(lo.chunks_exact(8)).zip(hi.chunks_exact(8)) {
        for c in 0..8 {
            acc[c] += (x[c] * l[c]).max(x[c] * h[c]);
        }
    }
    let tail = q.len() / 8 * 8;
    let rest: f32 = (tail..q.len()).map(|c| (q[c] * lo[c]).max(q[c] * hi[c])).sum();
    acc.iter().sum::<f32>() + rest
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

/// How a block's logit for a query is estimated from its summary.
#[derive(Clone, Copy)]
enum Bound {
    /// `q · mean key` (FlashPrefill's block summary)
    Mean,
    /// Quest's per-channel upper bound from the block's minimum and maximum keys
    Quest,
}

/// How a chunk scan scores blocks.
#[derive(Clone, Copy)]
enum Scan {
    /// from a block summary, as `block_scores`
    Summary(Bound),
    /// by the exact attention of the scanning queries, summed over the block
    Exact,
    /// as `Exact`, but with the logits taken on a key sketch (`Sketch`)
    Sketch,
}

/// One KV head's keys up to the chunk's end on the `d / SKETCH` channels with the most key energy
/// (Σ k_c² over the positions before the chunk), the channels a kernel's sketch would keep. Made
/// per chunk, as the energy changes with the prompt.
struct Sketch {
    /// the channels, ascending
    chan: Vec<usize>,
    /// `[position][chan.len()]`, positions `0..end`
    keys: Vec<f32>,
}

impl Sketch {
    fn of(layer: &DenseLayer, kv: usize, start: usize, end: usize) -> Self {
        let head = kv * (layer.n_head / layer.n_head_kv);
        let d = layer.head_dim;
        let mut energy = vec![0f64; d];
        for j in 0..start {
            for (e, &x) in energy.iter_mut().zip(layer.k_row(j, head)) {
                *e += f64::from(x) * f64::from(x);
            }
        }
        let mut chan: Vec<usize> = (0..d).collect();
        chan.sort_by(|&x, &y| energy[y].total_cmp(&energy[x]).then(x.cmp(&y)));
        chan.truncate(d / SKETCH);
        chan.sort_unstable();
        let keys = (0..end)
            .flat_map(|j| {
                let k = layer.k_row(j, head);
                chan.iter().map(move |&c| k[c])
            })
            .collect();
        Self { chan, keys }
    }

    /// The query `q` on the sketch's channels.
    fn query(&self, q: &[f32]) -> Vec<f32> {
        self.chan.iter().map(|&c| q[c]).collect()
    }

    fn key(&self, j: usize) -> &[f32] {
        let r = self.chan.len();
        &self.keys[j * r..(j + 1) * r]
    }
}

/// One layer's keys summarised in aligned blocks of `size` positions, per KV head: the mean key
/// and the per-channel minimum and maximum. Made once per layer for the whole prompt; a chunk
/// reads the blocks before it, which are whole (the chunk's start is a multiple of every block
/// size used here).
struct Blocks {
    size: usize,
    d: usize,
    n_blocks: usize,
    /// `[kv head][block][d]`
    mean: Vec<f32>,
    lo: Vec<f32>,
    hi: Vec<f32>,
}

impl Blocks {
    fn of(layer: &DenseLayer, size: usize) -> Self {
        let (d, n_blocks) = (layer.head_dim, layer.n_pos / size);
        let len = layer.n_head_kv * n_blocks * d;
        let (mut mean, mut lo, mut hi) = (
            vec![0f32; len],
            vec![f32::INFINITY; len],
            vec![f32::NEG_INFINITY; len],
        );
        let group = layer.n_head / layer.n_head_kv;
        for kv in 0..layer.n_head_kv {
            for b in 0..n_blocks {
                let at = (kv * n_blocks + b) * d;
                for j in b * size..(b + 1) * size {
                    let k = layer.k_row(j, kv * group);
                    for c in 0..d {
                        mean[at + c] += k[c] / size as f32;
                        lo[at + c] = lo[at + c].min(k[c]);
                        hi[at + c] = hi[at + c].max(k[c]);
                    }
                }
            }
        }
        Self {
            size,
            d,
            n_blocks,
            mean,
            lo,
            hi,
        }
    }

    /// The estimated `q · k` of block `b` of KV head `kv` (unscaled).
    fn logit(&self, bound: Bound, kv: usize, b: usize, q: &[f32]) -> f32 {
        let at = (kv * self.n_blocks + b) * self.d;
        let r = at..at + self.d;
        match bound {
            Bound::Mean => dot(q, &self.mean[r]),
            Bound::Quest => quest(q, &self.lo[r.clone()], &self.hi[r]),
        }
    }
}

/// Σ over the queries at positions `queries` (query head `head`) of each of `blocks`' weight in
/// that query's softmax over `blocks`. A block's weight is size × exp(logit); the blocks here all
/// have the same size, so the size cancels. Each query gives 1 in all, so a query whose attention
/// is spread counts as much as one whose attention is sharp, and no query dominates by its scale.
fn block_scores(
    layer: &DenseLayer,
    s: &Blocks,
    bound: Bound,
    head: usize,
    queries: &[usize],
    blocks: &[usize],
) -> Vec<f32> {
    let kv = layer.kv_head(head);
    let mut scores = vec![0f32; blocks.len()];
    let mut w = vec![0f32; blocks.len()];
    for &i in queries {
        let q = layer.q_row(i, head);
        for (x, &b) in w.iter_mut().zip(blocks) {
            *x = layer.scale * s.logit(bound, kv, b, q);
        }
        let m = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f64;
        for x in &mut w {
            *x = (*x - m).exp();
            z += f64::from(*x);
        }
        let inv = (1.0 / z) as f32;
        for (sc, &x) in scores.iter_mut().zip(&w) {
            *sc += x * inv;
        }
    }
    scores
}

/// `blocks` (of `size` positions) in order of `scores`, skipping those without a free position,
/// until they hold `want` free positions or none are left.
fn best_blocks(
    scores: &[f32],
    blocks: &[usize],
    size: usize,
    is_free: &[bool],
    want: usize,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by(|&x, &y| scores[y].total_cmp(&scores[x]).then(x.cmp(&y)));
    let mut kept = Vec::new();
    let mut held = 0;
    for i in order {
        if held >= want {
            break;
        }
        let b = blocks[i];
        let free = is_free[b * size..(b + 1) * size].iter().filter(|&&f| f).count();
        if free > 0 {
            kept.push(b);
            held += free;
        }
    }
    kept
}

/// The free positions of `blocks` (of `size`), block by block in the given order.
fn free_positions(blocks: &[usize], size: usize, is_free: &[bool]) -> Vec<usize> {
    blocks
        .iter()
        .flat_map(|&b| (b * size..(b + 1) * size).filter(|&p| is_free[p]))
        .collect()
}

/// Per tile: all queries of the tile score every block of `s` before the chunk; the free
/// positions of the best blocks are the 4 H candidates (the last block cut where it overshoots).
fn tile_blocks(
    layer: &DenseLayer,
    s: &Blocks,
    bound: Bound,
    head: usize,
    queries: &[usize],
    is_free: &[bool],
) -> Vec<usize> {
    let blocks: Vec<usize> = (0..is_free.len() / s.size).collect();
    let scores = block_scores(layer, s, bound, head, queries, &blocks);
    let best = best_blocks(&scores, &blocks, s.size, is_free, CANDIDATES);
    let mut c = free_positions(&best, s.size, is_free);
    c.truncate(CANDIDATES);
    c
}

/// Per tile: all queries of the tile score every block of `s` before the chunk with Quest's
/// bound; the free positions of the best blocks holding `KEEP` are kept, and `sampled` (the
/// tile's stage-1 samples, exact) proposes the 4 H candidates among them.
fn tile_keep_then_sample(
    layer: &DenseLayer,
    s: &Blocks,
    head: usize,
    queries: &[usize],
    is_free: &[bool],
    sampled: &[f32],
) -> Vec<usize> {
    let blocks: Vec<usize> = (0..is_free.len() / s.size).collect();
    let scores = block_scores(layer, s, Bound::Quest, head, queries, &blocks);
    let kept = free_positions(&best_blocks(&scores, &blocks, s.size, is_free, KEEP), s.size, is_free);
    top(sampled, &kept, CANDIDATES)
}

/// Per tile, two levels: blocks of 256 by mean key, the best holding `KEEP` free positions; then
/// the blocks of 16 inside those, by mean key, giving the 4 H candidates. The tile reads N / 256
/// summaries and then a fixed number (`KEEP` / 16).
fn hierarchical(
    layer: &DenseLayer,
    big: &Blocks,
    small: &Blocks,
    head: usize,
    queries: &[usize],
    is_free: &[bool],
) -> Vec<usize> {
    let coarse: Vec<usize> = (0..is_free.len() / big.size).collect();
    let scores = block_scores(layer, big, Bound::Mean, head, queries, &coarse);
    let kept = best_blocks(&scores, &coarse, big.size, is_free, KEEP);
    let per = big.size / small.size;
    let children: Vec<usize> = kept.iter().flat_map(|&b| b * per..(b + 1) * per).collect();
    let scores = block_scores(layer, small, Bound::Mean, head, queries, &children);
    let best = best_blocks(&scores, &children, small.size, is_free, CANDIDATES);
    let mut c = free_positions(&best, small.size, is_free);
    c.truncate(CANDIDATES);
    c
}

/// Per query at `queries` (query head `head`), its exact attention (over every position up to
/// itself) summed over each block of `size` before `start`.
fn exact_block_mass(
    layer: &DenseLayer,
    head: usize,
    queries: &[usize],
    start: usize,
    size: usize,
) -> Vec<f32> {
    let logits = |i: usize| -> Vec<f32> {
        let q = layer.q_row(i, head);
        (0..=i)
            .map(|j| layer.scale * dot(q, layer.k_row(j, head)))
            .collect()
    };
    block_mass(queries, start, size, logits)
}

/// `exact_block_mass` with each logit taken on the sketch's channels only (same scale, no
/// correction for the channels left out), as a kernel's sketched proposal has it.
fn sketch_block_mass(
    layer: &DenseLayer,
    sketch: &Sketch,
    head: usize,
    queries: &[usize],
    start: usize,
    size: usize,
) -> Vec<f32> {
    let logits = |i: usize| -> Vec<f32> {
        let q = sketch.query(layer.q_row(i, head));
        (0..=i)
            .map(|j| layer.scale * dot(&q, sketch.key(j)))
            .collect()
    };
    block_mass(queries, start, size, logits)
}

/// Per query at `queries`, the softmax over `logits(query)` (every position up to the query)
/// summed over each block of `size` before `start`, then summed over the queries.
fn block_mass(
    queries: &[usize],
    start: usize,
    size: usize,
    logits: impl Fn(usize) -> Vec<f32>,
) -> Vec<f32> {
    let mut mass = vec![0f32; start / size];
    for &i in queries {
        let logits = logits(i);
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = logits.iter().map(|&l| (l - m).exp()).collect();
        let z: f64 = e.iter().map(|&x| f64::from(x)).sum();
        for (b, x) in mass.iter_mut().enumerate() {
            let sum: f64 = e[b * size..(b + 1) * size].iter().map(|&y| f64::from(y)).sum();
            *x += (sum / z) as f32;
        }
    }
    mass
}

/// Once per chunk and KV group: every 16th query of the chunk, for every query head of the group,
/// scores every block before the chunk; the best blocks holding `keep` free positions are kept
/// (all free positions where there are fewer), ascending. The chunk's 16 tiles share the scan, so
/// it costs each tile N / 256 block reads for blocks of 16.
#[allow(clippy::too_many_arguments)]
fn chunk_keep(
    layer: &DenseLayer,
    s: &Blocks,
    sketch: &Sketch,
    scan: Scan,
    keep: Keep,
    kv: usize,
    start: usize,
    end: usize,
    is_free: &[bool],
) -> Vec<usize> {
    let group = layer.n_head / layer.n_head_kv;
    let blocks: Vec<usize> = (0..start / s.size).collect();
    let queries: Vec<usize> = (start..end).step_by(SAMPLE_EVERY).collect();
    let mut scores = vec![0f32; blocks.len()];
    for head in kv * group..(kv + 1) * group {
        let head_scores = match scan {
            Scan::Summary(bound) => block_scores(layer, s, bound, head, &queries, &blocks),
            Scan::Exact => exact_block_mass(layer, head, &queries, start, s.size),
            Scan::Sketch => sketch_block_mass(layer, sketch, head, &queries, start, s.size),
        };
        add(&mut scores, &head_scores);
    }
    let keep = keep.of(is_free.iter().filter(|&&f| f).count());
    let best = best_blocks(&scores, &blocks, s.size, is_free, keep);
    let mut kept = free_positions(&best, s.size, is_free);
    kept.sort_unstable();
    kept
}

/// The free far positions of a chunk starting at `start`: everything before it but the forced.
fn free_mask(start: usize) -> (Vec<usize>, Vec<bool>) {
    let forced: Vec<usize> = shape().forced(start).into_iter().map(|p| p as usize).collect();
    let mut is_free = vec![true; start];
    for &p in &forced {
        is_free[p] = false;
    }
    (forced, is_free)
}

/// One layer's block summaries at the sizes the variants read.
struct Summaries {
    b16: Blocks,
    b64: Blocks,
    b256: Blocks,
}

impl Summaries {
    fn of_size(&self, size: usize) -> &Blocks {
        [&self.b16, &self.b64, &self.b256]
            .into_iter()
            .find(|b| b.size == size)
            .expect("a summarised block size")
    }
}

/// Sums of each variant's coverage over tiles, and the number of tiles, for head `h` at one chunk.
fn head_coverage(
    layer: &DenseLayer,
    h: usize,
    start: usize,
    end: usize,
    s: &Summaries,
    kept: &[Vec<usize>],
) -> ([f64; VARIANTS.len()], usize) {
    let att = ChunkAttention::of(layer, h, start, end);
    let (forced, is_free) = free_mask(start);
    let free: Vec<usize> = (0..start).filter(|&p| is_free[p]).collect();
    let mut sums = [0f64; VARIANTS.len()];
    let mut tiles = 0;
    for (t, mass) in tile_masses(&att).iter().enumerate() {
        let rows: Vec<usize> = (t * TILE..((t + 1) * TILE).min(att.rows)).collect();
        let queries: Vec<usize> = rows.iter().map(|&r| start + r).collect();
        // today's stage 1: the exact attention of every 16th query of the tile
        let mut sampled = vec![0f32; start];
        for &r in rows.iter().step_by(SAMPLE_EVERY) {
            add(&mut sampled, att.far_row(r));
        }
        let ranked = |candidates: Vec<usize>| top(mass, &candidates, HEAVY);
        let mut chosen: Vec<Vec<usize>> = vec![
            top(mass, &free, HEAVY),
            ranked(top(&sampled, &free, CANDIDATES)),
            ranked(tile_blocks(layer, &s.b16, Bound::Mean, h, &queries, &is_free)),
            ranked(tile_blocks(layer, &s.b16, Bound::Quest, h, &queries, &is_free)),
            ranked(hierarchical(layer, &s.b256, &s.b16, h, &queries, &is_free)),
            ranked(tile_keep_then_sample(layer, &s.b16, h, &queries, &is_free, &sampled)),
        ];
        // the same samples as today's, among the positions each chunk scan kept
        chosen.extend(kept.iter().map(|k| ranked(top(&sampled, k, CANDIDATES))));
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
    (sums, tiles)
}

/// Stage 1's work per tile of one query head with `f` positions before the chunk and `group`
/// query heads per KV head: (vectors read, query·vector products). Counts, not timings; the
/// `/chunk` scans are divided over the chunk's 16 tiles and the group's heads (the reads over the
/// tiles only, as the group's heads share them); the fine levels read at most `KEEP` positions
/// (`KEEP` / 16 blocks). Stage 2 (64 queries × 4 H candidates) is the
/// same for every variant and left out.
fn stage1_work(variant: &str, f: usize, group: usize) -> Option<(usize, usize)> {
    let tiles = CHUNK / TILE;
    let samples = TILE / SAMPLE_EVERY;
    let chunk_samples = CHUNK / SAMPLE_EVERY;
    // a chunk scan over blocks of `size`, `vectors` summary vectors a block, then the fine pass
    let kept = KEEP.min(f);
    if let Some(&(_, size, scan, keep)) = CHUNK_SCANS.iter().find(|c| c.0 == variant) {
        // vectors read per block, and query·vector products per block and scanning query, in
        // vectors of all channels (a sketched key or product counts 1 / SKETCH)
        let (vectors, products, share) = match scan {
            Scan::Summary(Bound::Mean) => (1, 1, 1),
            Scan::Summary(Bound::Quest) => (2, 2, 1),
            Scan::Exact => (size, size, 1),
            Scan::Sketch => (size, size, SKETCH),
        };
        let keep = match keep {
            // as in round 1's tables
            Keep::Fixed(k) => k.min(f),
            Keep::Quarter => keep.of(f.saturating_sub(LOCAL + SINK)),
        };
        return Some((
            vectors * f / size / tiles / share + keep,
            products * chunk_samples * group * (f / size) / (tiles * group) / share + samples * keep,
        ));
    }
    Some(match variant {
        "today" => (f, samples * f),
        "mean16/tile" => (f / 16, TILE * f / 16),
        "quest16/tile" => (2 * f / 16, 2 * TILE * f / 16),
        "mean256>16/tile" => (f / 256 + kept / 16, TILE * (f / 256 + kept / 16)),
        "quest16/tile@4K" => (2 * f / 16 + kept, 2 * TILE * f / 16 + samples * kept),
        "forced only" => (0, 0),
        _ => return None,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (text, n, layers_arg, model_arg) = match args.as_slice() {
        [t, n, l] => (t, n, l, None),
        [t, n, l, m] => (t, n, l, Some(m)),
        _ => return Err("usage: coarse_to_fine TEXT N LAYERS|all [MODEL]".into()),
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
    eprintln!("coarse_to_fine: full-attention prefill of {n} tokens, capturing {layers_arg}");
    let layers = capture_dense(&model, &tokens, wanted.as_deref(), 2)?;
    eprintln!("coarse_to_fine: captured in {:.0} s", clock.elapsed().as_secs_f64());
    let names: Vec<u32> = layers.iter().map(|l| l.layer).collect();
    let first = &layers[0];
    println!(
        "{}, {text}, {n} tokens, layers {names:?} ({} query heads, {} KV heads, {} channels); \
         S = {CHUNK}, L = {LOCAL}, H = {HEAVY}, {SINK} sinks, tiles of {TILE}, 4 H = {CANDIDATES} \
         candidates, {KEEP} positions kept by the coarse levels; chunks 1 on. Mean covered share \
         of the tile's attention.\n",
        path.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        first.n_head,
        first.n_head_kv,
        first.head_dim,
    );
    println!("| layer | {} |", VARIANTS.join(" | "));
    println!("|---:|{}", "---:|".repeat(VARIANTS.len()));
    let mut total = [0f64; VARIANTS.len()];
    let mut total_tiles = 0;
    let mut by_chunk: BTreeMap<usize, ([f64; VARIANTS.len()], usize)> = BTreeMap::new();
    for layer in &layers {
        let s = Summaries {
            b16: Blocks::of(layer, 16),
            b64: Blocks::of(layer, 64),
            b256: Blocks::of(layer, 256),
        };
        let mut sums = [0f64; VARIANTS.len()];
        let mut tiles = 0;
        for start in (CHUNK..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            eprintln!(
                "coarse_to_fine: layer {}, chunk at {start} ({:.0} s)",
                layer.layer,
                clock.elapsed().as_secs_f64()
            );
            let (_, is_free) = free_mask(start);
            // per KV group, what each chunk scan kept
            let kept: Vec<Vec<Vec<usize>>> = (0..layer.n_head_kv)
                .map(|kv| {
                    let sketch = Sketch::of(layer, kv, start, end);
                    CHUNK_SCANS
                        .iter()
                        .map(|&(_, size, scan, keep)| {
                            let b = s.of_size(size);
                            chunk_keep(layer, b, &sketch, scan, keep, kv, start, end, &is_free)
                        })
                        .collect()
                })
                .collect();
            let per_head: Vec<([f64; VARIANTS.len()], usize)> = std::thread::scope(|sc| {
                let handles: Vec<_> = (0..layer.n_head)
                    .map(|h| {
                        let (s, kept) = (&s, &kept[layer.kv_head(h)]);
                        sc.spawn(move || head_coverage(layer, h, start, end, s, kept))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let at = by_chunk.entry(start).or_insert(([0f64; VARIANTS.len()], 0));
            for (s, t) in per_head {
                for ((x, y), z) in sums.iter_mut().zip(s).zip(at.0.iter_mut()) {
                    *x += y;
                    *z += y;
                }
                tiles += t;
                at.1 += t;
            }
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

    // where the `/chunk` variants filter at all: a chunk with more than KEEP free positions
    println!(
        "\nBy chunk, over the layers and heads (a `/chunk` variant keeps every free position \
         while a chunk has at most as many as it keeps: start − {} ≤ {KEEP} for 4K):\n",
        LOCAL + SINK
    );
    println!("| chunk start | {} |", VARIANTS.join(" | "));
    println!("|---:|{}", "---:|".repeat(VARIANTS.len()));
    for (start, (sums, tiles)) in &by_chunk {
        let cells: Vec<String> = sums.iter().map(|s| format!("{:.4}", s / *tiles as f64)).collect();
        println!("| {start} | {} |", cells.join(" | "));
    }

    // round 2: whether a variant's loss grows with the positions before the chunk
    println!("\nBy chunk, difference from `today` (the trend with the positions before the chunk):\n");
    let others: Vec<usize> = (0..VARIANTS.len()).filter(|&v| VARIANTS[v] != "today").collect();
    let today = VARIANTS.iter().position(|&v| v == "today").expect("today");
    println!(
        "| chunk start | {} |",
        others.iter().map(|&v| VARIANTS[v]).collect::<Vec<_>>().join(" | ")
    );
    println!("|---:|{}", "---:|".repeat(others.len()));
    for (start, (sums, tiles)) in &by_chunk {
        let base = sums[today] / *tiles as f64;
        let cells: Vec<String> = others
            .iter()
            .map(|&v| format!("{:+.4}", sums[v] / *tiles as f64 - base))
            .collect();
        println!("| {start} | {} |", cells.join(" | "));
    }

    let f = n - CHUNK;
    let group = first.n_head / first.n_head_kv;
    println!(
        "\nStage 1's work per tile of one query head in the last chunk (F = {f} positions before \
         it, {group} query heads per KV head): counts of vectors read (keys or block summaries; \
         Quest's are two a block) and of query·vector products, not timings. Stage 2 (64 × {CANDIDATES}) \
         is the same for all.\n"
    );
    println!("| variant | vectors read | query·vector products |\n|---|---:|---:|");
    for v in VARIANTS {
        if let Some((reads, products)) = stage1_work(v, f, group) {
            println!("| {v} | {reads} | {products} |");
        }
    }
    // round 2: the same counts at the lengths the README compares, from the same formulas
    let lengths = [8192, 16384, 32768, 131072];
    println!(
        "\nThe same counts at other prompt lengths N (F = N − {CHUNK}), from the same formulas \
         (counts, not measured): vectors read / query·vector products.\n"
    );
    let heads: Vec<String> = lengths.iter().map(|l| format!("N = {l}")).collect();
    println!("| variant | {} |\n|---|{}", heads.join(" | "), "---:|".repeat(lengths.len()));
    for v in VARIANTS {
        let cells: Vec<String> = lengths
            .iter()
            .filter_map(|&l| stage1_work(v, l - CHUNK, group))
            .map(|(r, p)| format!("{r} / {p}"))
            .collect();
        if !cells.is_empty() {
            println!("| {v} | {} |", cells.join(" | "));
        }
    }
    eprintln!("coarse_to_fine: done in {:.0} s", clock.elapsed().as_secs_f64());
    Ok(())
}
