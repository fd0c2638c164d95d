//! `h2o-cli heavy-hitters`: which tokens H2O keeps, and how stable that choice is.
//!
//! The prompt is prefilled one chunk per `llama_decode` call (which gives the same memory sets
//! as one call: `tests/h2o_state.rs`), and after every chunk each (layer, query head)'s memory
//! set is read back. Its heavy hitters are the positions outside the local window (with a
//! query-aware policy: the memory the chunk read, chosen by its queries; the dense tail is off,
//! since every one of these calls ends a prompt). Reported:
//! - how much the heavy hitters of consecutive chunks overlap (Jaccard), per layer: H2O's premise
//!   is that a token that drew attention keeps drawing it;
//! - how much the final heavy hitters of two runs overlap: this run and a second one that
//!   prefills the prompt in one call on another thread count (`--vs-threads`), where the only
//!   differences are summation order and BF16 ties;
//! - how many heads keep the first token (the "attention sink");
//! - with `--png`, a map of the positions each head kept, shaded by how many chunks kept them.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use h2o_llama::{demo, H2oConfig, Selection, Session, SessionConfig, Token};

#[derive(clap::Args, Debug)]
pub struct HeavyHittersArgs {
    /// Prompt file (UTF-8) [default: the built-in demo prompt]
    #[arg(short = 'f', long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// Use only the first N tokens of the prompt
    #[arg(short = 'n', long = "n-tokens", value_name = "N")]
    n_tokens: Option<usize>,
    /// Model file (GGUF) [default: the default model]
    #[arg(short = 'm', long, value_name = "FILE")]
    model: Option<PathBuf>,
    #[command(flatten)]
    shape: crate::H2oShape,
    /// CPU threads of the chunk-by-chunk run
    #[arg(short = 't', long, default_value_t = 2)]
    threads: u32,
    /// CPU threads of the second, one-call run compared with the first
    #[arg(long, value_name = "N", default_value_t = 1)]
    vs_threads: u32,
    /// Draw the positions each (layer, head) kept as heavy hitters into this PNG file
    #[arg(long, value_name = "FILE")]
    png: Option<PathBuf>,
    /// Print one JSON record instead of the table
    #[arg(long)]
    json: bool,
}

/// Overlap of two sets of positions: |A ∩ B| / |A ∪ B| (1 for two empty sets).
fn jaccard(a: &[usize], b: &[usize]) -> f64 {
    // both ascending
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

#[derive(Debug, serde::Serialize)]
struct LayerStats {
    layer: u32,
    /// mean Jaccard of consecutive chunks' heavy hitters, over heads and chunk pairs
    chunk_to_chunk_jaccard: f64,
    /// mean and lowest Jaccard of the two runs' final heavy hitters, over heads
    run_to_run_jaccard_mean: f64,
    run_to_run_jaccard_min: f64,
    /// heads whose final heavy hitters include position 0
    heads_keeping_first_token: u32,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    model: String,
    prompt: String,
    prompt_tokens: usize,
    n_ubatch: u32,
    h2o: H2oConfig,
    threads: u32,
    vs_threads: u32,
    /// memory sets read per (layer, head): one after each complete chunk
    sets_per_head: u32,
    layers: Vec<LayerStats>,
    chunk_to_chunk_jaccard: f64,
    run_to_run_jaccard_mean: f64,
    run_to_run_jaccard_min: f64,
    /// final heavy hitters, `[layer][head]` → positions
    final_heavy: Vec<Vec<Vec<usize>>>,
}

/// The heavy part of every (layer, head)'s memory after the chunks done so far: the positions
/// outside its local window. The seed rule holds `M_c`, built after the last complete chunk c,
/// whose window ends where that chunk ends; the query-aware policies hold the memory chunk c
/// read, whose window ends where chunk c starts.
fn heavy_sets(session: &Session<'_>, h2o: &H2oConfig) -> Result<Vec<Vec<Vec<usize>>>> {
    let st = session.h2o_state().expect("an H2O session has H2O state");
    let mut end = (st.chunks_done * st.chunk_size) as usize;
    if h2o.select != Selection::H2o {
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

pub fn run(args: &HeavyHittersArgs, interrupt: Arc<AtomicBool>) -> Result<()> {
    // no dense tail: every chunk-by-chunk call below ends a prompt, and its tail would make the two
    // runs differ in more than batching
    let h2o = H2oConfig {
        dense_tail: 0,
        ..args.shape.config()
    };
    if h2o.heavy == 0 {
        bail!("--h2o-heavy 0 keeps no heavy hitters: there is nothing to show");
    }
    if args.threads == 0 || args.vs_threads == 0 {
        bail!("-t and --vs-threads must be at least 1");
    }
    let text = match &args.file {
        Some(f) => crate::read_text_file(f, "prompt file")?,
        None => demo::prompt(demo::DEFAULT_ENTRIES),
    };
    if let Some(png) = &args.png {
        h2o_llama::chart::check_writable(png).context("--png")?;
    }
    let config = |n_batch: u32, threads: u32, n_ctx: u32| SessionConfig {
        n_ctx,
        n_batch,
        n_ubatch: args.shape.ubatch_size,
        n_threads: threads,
        h2o: Some(h2o),
        ..SessionConfig::default()
    };
    // bad -ub/L/H fail here, before any download or model load
    config(args.shape.ubatch_size, args.threads, 0).validate()?;
    let model = crate::load_model(args.model.as_deref(), 0, args.json, &interrupt)?;
    let mut tokens: Vec<Token> = model.tokenize(&text, true, true)?;
    if let Some(n) = args.n_tokens {
        tokens.truncate(n);
    }
    let s = args.shape.ubatch_size as usize;
    if tokens.len() < 2 * s {
        bail!(
            "the prompt has {} tokens: heavy hitters need at least two chunks of -ub {s} (use a longer \
             prompt or a smaller --ubatch-size)",
            tokens.len()
        );
    }
    let n_ctx = u32::try_from(tokens.len().next_multiple_of(256))?;
    let show_progress = !args.json && std::io::stderr().is_terminal();

    // Run A: one chunk per call, every memory set read after every chunk.
    let mut a = Session::new(&model, config(args.shape.ubatch_size, args.threads, n_ctx))?;
    a.set_interrupt_flag(interrupt.clone());
    // the layers with H2O state: all of a dense model's, the global ones of a sliding-window model
    let n_layer = a.h2o_layers().len();
    let n_head = model.n_head() as usize;
    let bin = tokens.len().div_ceil(1000).max(1);
    let n_bins = tokens.len().div_ceil(bin);
    let mut counts = vec![vec![0u32; n_bins]; n_layer * n_head];
    let mut jaccard_sum = vec![0.0f64; n_layer];
    let mut previous: Option<Vec<Vec<Vec<usize>>>> = None;
    let mut pairs = 0u32;
    let mut sets_per_head = 0u32;
    let n_chunks = tokens.len().div_ceil(s);
    for (c, chunk) in tokens.chunks(s).enumerate() {
        if show_progress {
            eprint!("\r\x1b[Kheavy-hitters: chunk {}/{n_chunks}", c + 1);
        }
        a.evaluate(chunk)?;
        if chunk.len() < s {
            break; // a partial last chunk builds no memory set
        }
        let sets = heavy_sets(&a, &h2o)?;
        sets_per_head += 1;
        for (l, heads) in sets.iter().enumerate() {
            for (h, set) in heads.iter().enumerate() {
                for &p in set {
                    counts[l * n_head + h][p / bin] += 1;
                }
            }
        }
        if let Some(prev) = &previous {
            pairs += 1;
            for l in 0..n_layer {
                jaccard_sum[l] += (0..n_head)
                    .map(|h| jaccard(&prev[l][h], &sets[l][h]))
                    .sum::<f64>()
                    / n_head as f64;
            }
        }
        previous = Some(sets);
    }
    // a partial last chunk builds no set: the sets read after the last complete chunk are final
    let Some(final_a) = previous else {
        bail!("no complete chunk was prefilled");
    };
    drop(a);

    // Run B: the complete chunks in one call, on another thread count (a query-aware policy would
    // otherwise hold the memory the partial last chunk read, which run A never reads).
    let complete = &tokens[..tokens.len() / s * s];
    if show_progress {
        eprint!(
            "\r\x1b[Kheavy-hitters: second run, one call, -t {}",
            args.vs_threads
        );
    }
    let whole = u32::try_from(complete.len())?;
    let mut b = Session::new(&model, config(whole, args.vs_threads, n_ctx))?;
    b.set_interrupt_flag(interrupt);
    b.evaluate(complete)?;
    let final_b = heavy_sets(&b, &h2o)?;
    drop(b);
    if show_progress {
        eprint!("\r\x1b[K");
    }

    let layers: Vec<LayerStats> = (0..n_layer)
        .map(|l| {
            let runs: Vec<f64> = (0..n_head)
                .map(|h| jaccard(&final_a[l][h], &final_b[l][h]))
                .collect();
            LayerStats {
                layer: l as u32,
                chunk_to_chunk_jaccard: if pairs > 0 {
                    jaccard_sum[l] / f64::from(pairs)
                } else {
                    f64::NAN
                },
                run_to_run_jaccard_mean: runs.iter().sum::<f64>() / n_head as f64,
                run_to_run_jaccard_min: runs.iter().copied().fold(1.0, f64::min),
                heads_keeping_first_token: final_a[l]
                    .iter()
                    .filter(|s| s.first() == Some(&0))
                    .count() as u32,
            }
        })
        .collect();
    let mean = |f: fn(&LayerStats) -> f64| layers.iter().map(f).sum::<f64>() / n_layer as f64;
    let report = Report {
        model: model.path().display().to_string(),
        prompt: args
            .file
            .as_ref()
            .map_or_else(|| "demo".into(), |f| f.display().to_string()),
        prompt_tokens: tokens.len(),
        n_ubatch: args.shape.ubatch_size,
        h2o,
        threads: args.threads,
        vs_threads: args.vs_threads,
        sets_per_head,
        chunk_to_chunk_jaccard: mean(|l| l.chunk_to_chunk_jaccard),
        run_to_run_jaccard_mean: mean(|l| l.run_to_run_jaccard_mean),
        run_to_run_jaccard_min: layers
            .iter()
            .map(|l| l.run_to_run_jaccard_min)
            .fold(1.0, f64::min),
        layers,
        final_heavy: final_a,
    };

    if let Some(png) = &args.png {
        let title = format!(
            "heavy hitters kept, {} tokens, S={} L={} H={}: darker = kept by more of the {} memory sets",
            report.prompt_tokens, report.n_ubatch, h2o.local, h2o.heavy, sets_per_head
        );
        h2o_llama::chart::selection_map(
            png,
            &h2o_llama::chart::SelectionMap {
                title: &title,
                n_layer,
                n_head,
                n_positions: tokens.len(),
                bin,
                counts: &counts,
                n_sets: sets_per_head,
            },
        )?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", markdown(&report));
        if let Some(png) = &args.png {
            eprintln!("h2o-cli heavy-hitters: map written to {}", png.display());
        }
    }
    Ok(())
}

fn markdown(r: &Report) -> String {
    let mut s = format!(
        "model: {} | prompt: {} ({} tokens) | S = {} L = {} H = {} | {} memory sets per head | \
         run-to-run: -t {} chunk by chunk vs -t {} in one call\n\n\
         | layer | Jaccard, consecutive chunks | Jaccard, run to run (mean) | (lowest head) | heads keeping token 0 |\n\
         |---:|---:|---:|---:|---:|\n",
        r.model,
        r.prompt,
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
