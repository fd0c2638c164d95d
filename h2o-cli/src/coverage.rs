//! `h2o-cli coverage`: the headroom study of memory selection (`h2o_research::coverage`). It
//! captures queries and keys of a full-attention prefill of the text, then prints how much of
//! each query's attention every way of choosing the memory covers, at the same average budget.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{Context, Result};
use h2o_flags::{EngineFlag, EngineFlags, H2oMemory};
use h2o_llama::{H2oConfig, Token};
use h2o_research::coverage::{self, Report, StudyConfig};

#[derive(clap::Args, Debug)]
pub struct CoverageArgs {
    /// Text to study (UTF-8)
    #[arg(short = 'f', long, value_name = "FILE")]
    file: PathBuf,
    /// The model, the tokens of the text to use from its start (-c; left out: the model's
    /// training context), the chunk size S (-ub) and the threads (-t); the capture sizes its
    /// batches itself
    #[command(flatten)]
    engine: EngineFlags,
    /// Model layers to study, comma-separated [default: every layer with an H2O op]
    #[arg(long, value_delimiter = ',', value_name = "L,..")]
    layers: Option<Vec<u32>>,
    /// The memory M = L + H, the average budget (L = H = 256 where left out), and the sinks the
    /// estimators and today's query and hybrid policies keep
    #[command(flatten)]
    memory: H2oMemory,
    /// Queries per tile for per-tile choices
    #[arg(long, value_name = "N", default_value_t = 64)]
    tile: usize,
    /// Positions per block for block-wise choices
    #[arg(long, value_name = "N", default_value_t = 16)]
    block: usize,
    /// Measure the queries of chunks from this one on
    #[arg(long, value_name = "C", default_value_t = 1)]
    first_chunk: usize,
    /// Measure only the ways of choosing whose name contains this text (today's policies always)
    #[arg(long, value_name = "TEXT")]
    only: Option<String>,
    /// Print one JSON record instead of the tables
    #[arg(long)]
    json: bool,
    /// Instead of coverage: each query's attention-output error against full attention, for a
    /// tile memory with the rest dropped or stood in for by block summaries
    #[arg(long)]
    output_error: bool,
}

#[derive(serde::Serialize)]
struct Record<'a> {
    model: String,
    text: String,
    #[serde(flatten)]
    report: &'a Report,
}

pub fn run(args: &CoverageArgs, interrupt: Arc<AtomicBool>) -> Result<()> {
    args.engine.refuse(
        "h2o-cli coverage",
        &[
            EngineFlag::BatchSize,
            EngineFlag::GpuLayers,
            EngineFlag::FlashAttn,
            EngineFlag::CacheTypes,
        ],
        "the study captures full attention on the CPU in batches of its own",
    )?;
    let (local, heavy) = args.memory.local_heavy(H2oMemory::COMPARED)?;
    let threads = args.engine.threads();
    let config = StudyConfig {
        chunk: args.engine.ubatch_size(true) as usize,
        local: local as usize,
        heavy: heavy as usize,
        sink: args
            .memory
            .sink
            .unwrap_or(H2oConfig::new(local, heavy).sink) as usize,
        tile: args.tile,
        block: args.block,
        first_chunk: args.first_chunk,
        only: args.only.clone(),
    };
    // bad parameters fail here, before any download or model load
    config.validate()?;
    let text = crate::read_text_file(&args.file, "text file")?;
    let model = crate::load_model(&args.engine, args.json, &interrupt)?;
    let mut tokens: Vec<Token> = model.tokenize(&text, true, false)?;
    let n_tokens = match args.engine.ctx_size() {
        0 => model.n_ctx_train() as usize,
        n => n as usize,
    };
    if tokens.len() < n_tokens {
        anyhow::bail!(
            "{} has {} tokens, fewer than -c {n_tokens}: use a longer text or a smaller -c",
            args.file.display(),
            tokens.len(),
        );
    }
    tokens.truncate(n_tokens);
    // progress goes to stderr, with --json too: the record is on stdout
    eprintln!(
        "h2o-cli coverage: full-attention prefill of {} tokens, capturing Q and K",
        tokens.len()
    );
    let layers = coverage::capture_dense(&model, &tokens, args.layers.as_deref(), threads)
        .context("capturing the attention")?;
    if args.output_error {
        let rows = coverage::remainder::output_errors(&layers, &config, threads as usize);
        println!("| memory | far positions left out | output error, mean | p90 | extra keys per query |\n|---|---|---:|---:|---:|");
        for r in rows {
            println!(
                "| {} | {} | {:.4} | {:.4} | {:.0} |",
                r.choice, r.remainder, r.error_mean, r.error_p90, r.extra_keys
            );
        }
        return Ok(());
    }
    let show = std::io::stderr().is_terminal();
    let report = coverage::run(&layers, &config, threads as usize, |done, total| {
        if show {
            eprint!("\r\x1b[Kcoverage: {done}/{total} heads");
        } else if done * 4 / total != (done - 1) * 4 / total {
            // a log gets a line at every quarter
            eprintln!("h2o-cli coverage: {done}/{total} heads studied");
        }
    })?;
    if show {
        eprint!("\r\x1b[K");
    }
    let record = Record {
        model: model.path().display().to_string(),
        text: args.file.display().to_string(),
        report: &report,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&record)?);
    } else {
        println!(
            "model {}, text {}, layers {:?}\n",
            record.model,
            record.text,
            layers.iter().map(|l| l.layer).collect::<Vec<_>>()
        );
        print!("{}", report.markdown());
    }
    Ok(())
}
