//! `h2o-cli heavy-hitters`: which tokens H2O keeps, and how stable that choice is. The study is
//! `h2o_research::heavy_hitters` (the method is described there); this command reads the prompt,
//! prints the report as a table or JSON and, with `--png`, draws a map of the positions each
//! head kept, shaded by how many chunks kept them.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{Context, Result};
use h2o_flags::{EngineFlag, EngineFlags, H2oFlags};
use h2o_llama::{demo, Token};
use h2o_research::heavy_hitters::{self, Progress, Report, StudyConfig};

#[derive(clap::Args, Debug)]
pub struct HeavyHittersArgs {
    /// Prompt file (UTF-8) [default: the built-in demo prompt]
    #[arg(short = 'f', long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// Use only the first N tokens of the prompt
    #[arg(short = 'n', long = "n-tokens", value_name = "N")]
    n_tokens: Option<usize>,
    /// The model, the chunk size S (-ub) and the threads of the chunk-by-chunk run (-t); the
    /// study sizes its context and batches itself
    #[command(flatten)]
    engine: EngineFlags,
    /// The memory and policy studied (L = H = 256 where left out)
    #[command(flatten)]
    h2o: H2oFlags,
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

/// The JSON record: the study's report with the model and prompt it ran on.
#[derive(serde::Serialize)]
struct Record<'a> {
    model: String,
    prompt: String,
    #[serde(flatten)]
    report: &'a Report,
}

pub fn run(args: &HeavyHittersArgs, interrupt: Arc<AtomicBool>) -> Result<()> {
    args.engine.refuse(
        "h2o-cli heavy-hitters",
        &[
            EngineFlag::CtxSize,
            EngineFlag::BatchSize,
            EngineFlag::GpuLayers,
            EngineFlag::FlashAttn,
            EngineFlag::CacheTypes,
        ],
        "the study sizes its context and batches itself and runs on the CPU with llama.cpp's defaults",
    )?;
    let cfg = StudyConfig {
        h2o: args.h2o.compared()?,
        n_ubatch: args.engine.ubatch_size(true),
        threads: args.engine.threads(),
        vs_threads: args.vs_threads,
    };
    // bad -ub/L/H/-t fail here, before any download or model load
    cfg.validate()?;
    let text = match &args.file {
        Some(f) => crate::read_text_file(f, "prompt file")?,
        None => demo::prompt(demo::DEFAULT_ENTRIES),
    };
    if let Some(png) = &args.png {
        h2o_research::chart::check_writable(png).context("--png")?;
    }
    let model = crate::load_model(&args.engine, args.json, &interrupt)?;
    let mut tokens: Vec<Token> = model.tokenize(&text, true, true)?;
    if let Some(n) = args.n_tokens {
        tokens.truncate(n);
    }
    let show_progress = !args.json && std::io::stderr().is_terminal();
    let (report, kept) = heavy_hitters::study(&model, &tokens, &cfg, Some(&interrupt), |p| {
        if show_progress {
            match p {
                Progress::Chunk { chunk, of } => {
                    eprint!("\r\x1b[Kheavy-hitters: chunk {chunk}/{of}");
                }
                Progress::OneCall { threads } => {
                    eprint!("\r\x1b[Kheavy-hitters: second run, one call, -t {threads}");
                }
            }
        }
    })?;
    if show_progress {
        eprint!("\r\x1b[K");
    }
    let record = Record {
        model: model.path().display().to_string(),
        prompt: args
            .file
            .as_ref()
            .map_or_else(|| "demo".into(), |f| f.display().to_string()),
        report: &report,
    };

    if let Some(png) = &args.png {
        let title = format!(
            "heavy hitters kept, {} tokens, S={} L={} H={}: darker = kept by more of the {} memory sets",
            report.prompt_tokens, report.n_ubatch, report.h2o.local, report.h2o.heavy, report.sets_per_head
        );
        h2o_research::chart::selection_map(
            png,
            &h2o_research::chart::SelectionMap {
                title: &title,
                layers: &kept.layers,
                n_head: kept.n_head,
                n_positions: kept.n_positions,
                bin: kept.bin,
                counts: &kept.counts,
                n_sets: report.sets_per_head,
            },
        )?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&record)?);
    } else {
        print!(
            "{}",
            heavy_hitters::markdown(&record.model, &record.prompt, &report)
        );
        if let Some(png) = &args.png {
            eprintln!("h2o-cli heavy-hitters: map written to {}", png.display());
        }
    }
    Ok(())
}
