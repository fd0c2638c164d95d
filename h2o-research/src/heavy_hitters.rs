//! Which tokens H2O keeps, and how stable that choice is: the study behind `h2o-cli
//! heavy-hitters`.
//!
//! The prompt is prefilled one chunk per `llama_decode` call (which gives the same memory sets
//! as one call: `tests/h2o_state.rs`), and after every chunk each (layer, query head)'s memory
//! set is read back. Its heavy hitters are the positions outside the local window (with a
//! query-aware policy: the memory the chunk read, chosen by its queries; the dense tail is off,
//! since every one of these calls ends a prompt). [`study`] reports:
//! - how much the heavy hitters of consecutive chunks overlap (Jaccard), per layer: H2O's premise
//!   is that a token that drew attention keeps drawing it;
//! - how much the final heavy hitters of two runs overlap: this run and a second one that
//!   prefills the prompt in one call on another thread count, where the only differences are
//!   summation order and BF16 ties;
//! - how many heads keep the first token (the "attention sink");
//! - how often each position was kept ([`KeptCounts`], for a map of the positions each head
//!   kept).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use h2o_llama::{Error, H2oConfig, Model, Result, Selection, Session, SessionConfig, Token};

/// Overlap of two ascending sets of positions: |A ∩ B| / |A ∪ B| (1 for two empty sets).
#[must_use]
pub fn jaccard(a: &[usize], b: &[usize]) -> f64 {
    let (mut i, mut j, mut common) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                common += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = a.len() + b.len() - common;
    if union == 0 {
        1.0
    } else {
        common as f64 / union as f64
    }
}

/// What a study runs: the H2O shape (its dense tail is ignored: every chunk-by-chunk call ends a
/// prompt, and a tail would make the two runs differ in more than batching) and the two runs'
/// thread counts.
#[derive(Debug, Clone, Copy)]
pub struct StudyConfig {
    pub h2o: H2oConfig,
    /// The chunk size S.
    pub n_ubatch: u32,
    /// Threads of the chunk-by-chunk run.
    pub threads: u32,
    /// Threads of the second run, which prefills the complete chunks in one call.
    pub vs_threads: u32,
}

impl StudyConfig {
    /// The H2O settings both runs use: the given ones without a dense tail.
    #[must_use]
    pub fn h2o(&self) -> H2oConfig {
        H2oConfig {
            dense_tail: 0,
            ..self.h2o
        }
    }

    fn session(&self, n_batch: u32, threads: u32, n_ctx: u32) -> SessionConfig {
        SessionConfig {
            n_ctx,
            n_batch,
            n_ubatch: self.n_ubatch,
            n_threads: threads,
            h2o: Some(self.h2o()),
            ..SessionConfig::default()
        }
    }

    /// Checks what can be checked before a model is loaded.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for no heavy budget, a zero thread count, or a bad H2O shape.
    pub fn validate(&self) -> Result<()> {
        if self.h2o.heavy == 0 {
            return Err(Error::InvalidConfig(
                "--h2o-heavy 0 keeps no heavy hitters: there is nothing to show".into(),
            ));
        }
        if self.threads == 0 || self.vs_threads == 0 {
            return Err(Error::InvalidConfig(
                "-t and --vs-threads must be at least 1".into(),
            ));
        }
        self.session(self.n_ubatch, self.threads, 0).validate()
    }
}

/// One layer's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerStats {
    /// The model's layer index (a sliding-window model has H2O state on its global layers only).
    pub layer: u32,
    /// mean Jaccard of consecutive chunks' heavy hitters, over heads and chunk pairs
    pub chunk_to_chunk_jaccard: f64,
    /// mean and lowest Jaccard of the two runs' final heavy hitters, over heads
    pub run_to_run_jaccard_mean: f64,
    pub run_to_run_jaccard_min: f64,
    /// heads whose final heavy hitters include position 0
    pub heads_keeping_first_token: u32,
}

/// The study's figures (the JSON record of `h2o-cli heavy-hitters` around a model and prompt
/// name).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub prompt_tokens: usize,
    pub n_ubatch: u32,
    pub h2o: H2oConfig,
    pub threads: u32,
    pub vs_threads: u32,
    /// memory sets read per (layer, head): one after each complete chunk
    pub sets_per_head: u32,
    pub layers: Vec<LayerStats>,
    pub chunk_to_chunk_jaccard: f64,
    pub run_to_run_jaccard_mean: f64,
    pub run_to_run_jaccard_min: f64,
    /// final heavy hitters, `[layer][head]` → positions (layers as in `layers`)
    pub final_heavy: Vec<Vec<Vec<usize>>>,
}

/// How many of the memory sets kept each position, in bins of `bin` positions:
/// `counts[l * n_head + h][p / bin]`, `l` indexing [`Report::layers`].
#[derive(Debug, Clone)]
pub struct KeptCounts {
    /// the model layers, as in [`Report::layers`]
    pub layers: Vec<u32>,
    pub n_head: usize,
    pub n_positions: usize,
    pub bin: usize,
    pub counts: Vec<Vec<u32>>,
}

impl KeptCounts {
    fn new(layers: Vec<u32>, n_head: usize, n_positions: usize) -> Self {
        // about a thousand bins, whatever the prompt's length
        let bin = n_positions.div_ceil(1000).max(1);
        let rows = layers.len() * n_head;
        Self {
            layers,
            n_head,
            n_positions,
            bin,
            counts: vec![vec![0; n_positions.div_ceil(bin)]; rows],
        }
    }

    fn add(&mut self, sets: &[Vec<Vec<usize>>]) {
        for (l, heads) in sets.iter().enumerate() {
            for (h, set) in heads.iter().enumerate() {
                for &p in set {
                    self.counts[l * self.n_head + h][p / self.bin] += 1;
                }
            }
        }
    }
}

/// Where a study is, for a progress line.
#[derive(Debug, Clone, Copy)]
pub enum Progress {
    /// The chunk-by-chunk run is about to evaluate chunk `chunk` (from 1) of `of`.
    Chunk { chunk: usize, of: usize },
    /// The second run, one call on `threads` threads, is starting.
    OneCall { threads: u32 },
}

/// The heavy part of every (layer, head)'s memory after the chunks done so far: the positions
/// outside its local window, `[i][head]` for the `i`-th of [`Session::h2o_layers`]. The seed rule
/// holds `M_c`, built after the last complete chunk c, whose window ends where that chunk ends;
/// the query-aware policies hold the memory chunk c read, whose window ends where chunk c starts.
///
/// # Errors
/// [`h2o_llama::H2oError::Disabled`] for a session without H2O.
pub fn heavy_sets(session: &Session<'_>, h2o: &H2oConfig) -> Result<Vec<Vec<Vec<usize>>>> {
    let st = session
        .h2o_state()
        .ok_or(Error::H2o(h2o_llama::H2oError::Disabled))?;
    let mut end = (st.chunks_done * st.chunk_size) as usize;
    if h2o.select != Selection::Seed {
        end = end.saturating_sub(st.chunk_size as usize);
    }
    let window = end.saturating_sub(h2o.local as usize)..end;
    session
        .h2o_layers()
        .into_iter()
        .map(|layer| {
            (0..st.n_head)
                .map(|head| {
                    let set = session.h2o_memory_set(layer, head)?;
                    Ok(set.positions().filter(|p| !window.contains(p)).collect())
                })
                .collect()
        })
        .collect()
}

/// What the chunk-by-chunk run measured.
struct ChunkByChunk {
    layers: Vec<u32>,
    kept: KeptCounts,
    /// per layer: the sum over chunk pairs of the heads' mean Jaccard
    jaccard_sum: Vec<f64>,
    pairs: u32,
    sets_per_head: u32,
    /// the heavy hitters after the last complete chunk
    last: Vec<Vec<Vec<usize>>>,
}

fn chunk_by_chunk(
    model: &Model,
    tokens: &[Token],
    cfg: &StudyConfig,
    n_ctx: u32,
    interrupt: Option<&Arc<AtomicBool>>,
    progress: &mut impl FnMut(Progress),
) -> Result<ChunkByChunk> {
    let s = cfg.n_ubatch as usize;
    let mut session = Session::new(model, cfg.session(cfg.n_ubatch, cfg.threads, n_ctx))?;
    if let Some(flag) = interrupt {
        session.set_interrupt_flag(flag.clone());
    }
    let layers = session.h2o_layers();
    let n_head = model.n_head() as usize;
    let mut kept = KeptCounts::new(layers.clone(), n_head, tokens.len());
    let mut jaccard_sum = vec![0.0f64; layers.len()];
    let (mut pairs, mut sets_per_head) = (0u32, 0u32);
    let mut previous: Option<Vec<Vec<Vec<usize>>>> = None;
    let n_chunks = tokens.len().div_ceil(s);
    for (c, chunk) in tokens.chunks(s).enumerate() {
        progress(Progress::Chunk {
            chunk: c + 1,
            of: n_chunks,
        });
        session.evaluate(chunk)?;
        if chunk.len() < s {
            break; // a partial last chunk builds no memory set
        }
        let sets = heavy_sets(&session, &cfg.h2o())?;
        sets_per_head += 1;
        kept.add(&sets);
        if let Some(prev) = &previous {
            pairs += 1;
            for (l, sum) in jaccard_sum.iter_mut().enumerate() {
                *sum += (0..n_head)
                    .map(|h| jaccard(&prev[l][h], &sets[l][h]))
                    .sum::<f64>()
                    / n_head as f64;
            }
        }
        previous = Some(sets);
    }
    Ok(ChunkByChunk {
        layers,
        kept,
        jaccard_sum,
        pairs,
        sets_per_head,
        // the caller checked for two complete chunks
        last: previous.unwrap_or_default(),
    })
}

fn layer_stats(a: &ChunkByChunk, final_b: &[Vec<Vec<usize>>]) -> Vec<LayerStats> {
    a.layers
        .iter()
        .enumerate()
        .map(|(l, &layer)| {
            let runs: Vec<f64> = a.last[l]
                .iter()
                .zip(&final_b[l])
                .map(|(x, y)| jaccard(x, y))
                .collect();
            LayerStats {
                layer,
                chunk_to_chunk_jaccard: if a.pairs > 0 {
                    a.jaccard_sum[l] / f64::from(a.pairs)
                } else {
                    f64::NAN
                },
                run_to_run_jaccard_mean: runs.iter().sum::<f64>() / runs.len() as f64,
                run_to_run_jaccard_min: runs.iter().copied().fold(1.0, f64::min),
                heads_keeping_first_token: a.last[l]
                    .iter()
                    .filter(|s| s.first() == Some(&0))
                    .count() as u32,
            }
        })
        .collect()
}

/// Runs the study on `tokens`: chunk by chunk on `cfg.threads`, then the complete chunks in one
/// call on `cfg.vs_threads`.
///
/// # Errors
/// [`Error::InvalidConfig`] for a bad configuration or a prompt shorter than two chunks; the
/// session's errors ([`Error::Interrupted`] when `interrupt` is raised).
pub fn study(
    model: &Model,
    tokens: &[Token],
    cfg: &StudyConfig,
    interrupt: Option<&Arc<AtomicBool>>,
    mut progress: impl FnMut(Progress),
) -> Result<(Report, KeptCounts)> {
    cfg.validate()?;
    let s = cfg.n_ubatch as usize;
    if tokens.len() < 2 * s {
        return Err(Error::InvalidConfig(format!(
            "the prompt has {} tokens: heavy hitters need at least two chunks of -ub {s} (use a \
             longer prompt or a smaller --ubatch-size)",
            tokens.len()
        )));
    }
    let too_long = |_| Error::InvalidConfig(format!("{} tokens is too long", tokens.len()));
    let n_ctx = u32::try_from(tokens.len().next_multiple_of(256)).map_err(too_long)?;
    let a = chunk_by_chunk(model, tokens, cfg, n_ctx, interrupt, &mut progress)?;

    // The complete chunks in one call (a query-aware policy would otherwise hold the memory the
    // partial last chunk read, which the chunk-by-chunk run never reads).
    let complete = &tokens[..tokens.len() / s * s];
    progress(Progress::OneCall {
        threads: cfg.vs_threads,
    });
    let whole = u32::try_from(complete.len()).map_err(too_long)?;
    let mut b = Session::new(model, cfg.session(whole, cfg.vs_threads, n_ctx))?;
    if let Some(flag) = interrupt {
        b.set_interrupt_flag(flag.clone());
    }
    b.evaluate(complete)?;
    let final_b = heavy_sets(&b, &cfg.h2o())?;
    drop(b);

    let layers = layer_stats(&a, &final_b);
    let n_layer = layers.len() as f64;
    let mean = |f: fn(&LayerStats) -> f64| layers.iter().map(f).sum::<f64>() / n_layer;
    let report = Report {
        prompt_tokens: tokens.len(),
        n_ubatch: cfg.n_ubatch,
        h2o: cfg.h2o(),
        threads: cfg.threads,
        vs_threads: cfg.vs_threads,
        sets_per_head: a.sets_per_head,
        chunk_to_chunk_jaccard: mean(|l| l.chunk_to_chunk_jaccard),
        run_to_run_jaccard_mean: mean(|l| l.run_to_run_jaccard_mean),
        run_to_run_jaccard_min: layers
            .iter()
            .map(|l| l.run_to_run_jaccard_min)
            .fold(1.0, f64::min),
        layers,
        final_heavy: a.last,
    };
    Ok((report, a.kept))
}

/// The report as a markdown table, one row per layer and one for all.
#[must_use]
pub fn markdown(model: &str, prompt: &str, r: &Report) -> String {
    let mut s = format!(
        "model: {model} | prompt: {prompt} ({} tokens) | S = {} L = {} H = {} | {} memory sets per \
         head | run-to-run: -t {} chunk by chunk vs -t {} in one call\n\n\
         | layer | Jaccard, consecutive chunks | Jaccard, run to run (mean) | (lowest head) | heads keeping token 0 |\n\
         |---:|---:|---:|---:|---:|\n",
        r.prompt_tokens,
        r.n_ubatch,
        r.h2o.local,
        r.h2o.heavy,
        r.sets_per_head,
        r.threads,
        r.vs_threads
    );
    for l in &r.layers {
        s.push_str(&format!(
            "| {} | {:.3} | {:.4} | {:.4} | {} |\n",
            l.layer,
            l.chunk_to_chunk_jaccard,
            l.run_to_run_jaccard_mean,
            l.run_to_run_jaccard_min,
            l.heads_keeping_first_token
        ));
    }
    s.push_str(&format!(
        "| all | {:.3} | {:.4} | {:.4} | |\n",
        r.chunk_to_chunk_jaccard, r.run_to_run_jaccard_mean, r.run_to_run_jaccard_min
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::jaccard;

    #[test]
    fn jaccard_counts_the_overlap() {
        assert_eq!(jaccard(&[1, 2, 3], &[1, 2, 3]), 1.0);
        assert_eq!(jaccard(&[1, 2], &[3, 4]), 0.0);
        assert_eq!(jaccard(&[1, 2, 3], &[2, 3, 4]), 0.5);
        assert_eq!(jaccard(&[], &[]), 1.0);
    }
}
