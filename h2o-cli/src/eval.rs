//! `h2o-cli eval`: the long-context task suite of `h2o_research::eval` (needles, multi-key,
//! multi-value, variable tracking, key-value lookup) at several lengths and depths, answered by
//! full attention and by each H2O policy on the same prompts in one run.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Result};
use h2o_flags::{EngineFlag, EngineFlags, H2oFlags};
use h2o_llama::{H2oConfig, SessionConfig};
use h2o_research::eval::{self, Contender, Task};

/// Context beyond a prompt's nominal length: its last sentence may run over, and the answer
/// follows it.
const ANSWER_ROOM: usize = 128;

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// The engine of every contender; -c is each prompt's length and room for the answer
    #[command(flatten)]
    engine: EngineFlags,
    /// The H2O memory of every policy scored (L = H = 256 where left out) and the policy scored
    /// when --policies is left out
    #[command(flatten)]
    h2o: H2oFlags,
    /// Tasks, comma-separated: passkey, number, word, multi-key, multi-value,
    /// variable-tracking, kv-lookup [default: all]
    #[arg(long, value_name = "TASK,..", value_delimiter = ',')]
    tasks: Vec<Task>,
    /// Prompt lengths in tokens, comma-separated
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_values_t = [1024, 2048])]
    lengths: Vec<usize>,
    /// Needle depths in percent of the text, comma-separated
    #[arg(long, value_name = "D,..", value_delimiter = ',', default_values_t = [0, 25, 50, 75, 100])]
    depths: Vec<u32>,
    /// Prompts per task, length and depth
    #[arg(long, value_name = "N", default_value_t = 1)]
    samples: usize,
    /// Seed of the generated prompts
    #[arg(long, default_value_t = 1)]
    seed: u64,
    // (help as an attribute: rustdoc would read the brackets as links)
    #[arg(
        long,
        value_name = "P[:S[:T]],..",
        value_delimiter = ',',
        help = "H2O policies to score besides full attention, comma-separated, each \
                POLICY[:SINK[:TAIL]] (the seed rule is h2o:0:0) [default: h2o:0:0 and the --h2o-* flags]"
    )]
    policies: Vec<String>,
    /// Print one JSON record instead of the table
    #[arg(long)]
    json: bool,
    /// Draw one heatmap per configuration (depth × length) into this folder
    #[arg(long, value_name = "DIR")]
    png_dir: Option<PathBuf>,
}

fn parse_policy(shape: &H2oConfig, spec: &str) -> Result<H2oConfig> {
    let parts: Vec<&str> = spec.split(':').collect();
    if parts.len() > 3 || parts[0].is_empty() {
        bail!("--policies {spec:?}: write a policy as POLICY[:SINK[:TAIL]], e.g. query:4:64");
    }
    let mut h2o = *shape;
    h2o.select = parts[0].parse()?;
    let n = |v: &str| {
        v.parse::<u32>()
            .map_err(|e| anyhow::anyhow!("--policies {spec:?}: {v:?} is not a token count ({e})"))
    };
    if let Some(v) = parts.get(1) {
        h2o.sink = n(v)?;
    }
    if let Some(v) = parts.get(2) {
        h2o.dense_tail = n(v)?;
    }
    Ok(h2o)
}

fn contender_name(h: &H2oConfig) -> String {
    format!("{} sink {} tail {}", h.select, h.sink, h.dense_tail)
}

/// Full attention, then the H2O policies of `--policies` (or the seed rule and the `--h2o-*`
/// flags), each once.
fn contenders(args: &EvalArgs) -> Result<Vec<Contender>> {
    let mut contenders = vec![Contender {
        name: "full attention".into(),
        h2o: None,
    }];
    let shape = args.h2o.compared()?;
    let specs: Vec<H2oConfig> = if args.policies.is_empty() {
        vec![H2oConfig::seed(shape.local, shape.heavy), shape]
    } else {
        args.policies
            .iter()
            .map(|p| parse_policy(&shape, p))
            .collect::<Result<_>>()?
    };
    for h2o in specs {
        let name = contender_name(&h2o);
        if !contenders.iter().any(|c| c.name == name) {
            contenders.push(Contender {
                name,
                h2o: Some(h2o),
            });
        }
    }
    Ok(contenders)
}

/// The session every contender runs in, but for its H2O settings; each contender's is validated.
fn base_config(args: &EvalArgs, contenders: &[Contender]) -> Result<SessionConfig> {
    let max_len = *args.lengths.iter().max().unwrap_or(&0);
    args.engine.refuse(
        "h2o-cli eval",
        &[EngineFlag::CtxSize],
        "each prompt's context is its --lengths and room for the answer",
    )?;
    let base = SessionConfig {
        n_ctx: u32::try_from(max_len + ANSWER_ROOM).unwrap_or(u32::MAX),
        ..args.engine.compared_session_config()
    };
    for c in contenders {
        SessionConfig {
            h2o: c.h2o,
            ..base.clone()
        }
        .validate()?;
    }
    Ok(base)
}

pub fn run(args: &EvalArgs, interrupt: Arc<AtomicBool>) -> Result<()> {
    let tasks = if args.tasks.is_empty() {
        Task::ALL.to_vec()
    } else {
        args.tasks.clone()
    };
    if args.lengths.is_empty() || args.depths.is_empty() || args.samples == 0 {
        bail!("nothing to run: give at least one --lengths, one --depths and --samples 1 or more");
    }
    let contenders = contenders(args)?;
    let base = base_config(args, &contenders)?;
    if let Some(dir) = &args.png_dir {
        std::fs::create_dir_all(dir)?;
    }
    let model = crate::load_model(&args.engine, args.json, &interrupt)?;
    // what the policies leave to the model (the sketch), chosen now so that the record names it
    let contenders: Vec<Contender> = contenders
        .into_iter()
        .map(|c| Contender {
            h2o: c.h2o.map(|h2o| h2o.for_model(&model)),
            ..c
        })
        .collect();
    let max_len = *args.lengths.iter().max().unwrap_or(&0);
    let n_train = model.n_ctx_train() as usize;
    if max_len + ANSWER_ROOM > n_train {
        bail!(
            "--lengths up to {max_len}: a prompt and its answer need {} tokens of context, more than \
             the {n_train} the model was trained on; use lengths up to {}",
            max_len + ANSWER_ROOM,
            n_train.saturating_sub(ANSWER_ROOM)
        );
    }
    let prompts = eval::suite(
        &model,
        &tasks,
        &args.lengths,
        &args.depths,
        args.samples,
        args.seed,
    )?;
    let show_progress = !args.json && std::io::stderr().is_terminal();
    let answers = eval::run(
        &model,
        &base,
        &contenders,
        &prompts,
        Some(&interrupt),
        |done, total, name| {
            if show_progress {
                eprint!("\r\x1b[Keval: {done}/{total} ({name})");
            }
        },
    )?;
    if show_progress {
        eprint!("\r\x1b[K");
    }
    if args.json {
        let report = eval::Report::new(
            model.path().display().to_string(),
            args.seed,
            args.engine.ubatch_size(true),
            &contenders,
            &prompts,
            &answers,
        );
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", eval::markdown(&prompts, &contenders, &answers));
    }
    if let Some(dir) = &args.png_dir {
        draw_heatmaps(args, dir, &contenders, &prompts, &answers)?;
    }
    Ok(())
}

/// One accuracy heatmap (depth × length) per contender, into `dir`.
fn draw_heatmaps(
    args: &EvalArgs,
    dir: &std::path::Path,
    contenders: &[Contender],
    prompts: &[eval::Prompt],
    answers: &[Vec<eval::Answer>],
) -> Result<()> {
    for (c, a) in contenders.iter().zip(answers) {
        let file = dir.join(format!("eval-{}.png", c.name.replace(' ', "-")));
        let cells = eval::grid(prompts, a, &args.depths, &args.lengths);
        let (ok, n) = eval::score(a, 0..prompts.len());
        let title = format!(
            "{}: {ok}/{n} answered (-ub {})",
            c.name,
            args.engine.ubatch_size(true)
        );
        h2o_research::chart::accuracy_heatmap(&file, &title, &args.depths, &args.lengths, &cells)?;
        if !args.json {
            eprintln!("h2o-cli eval: heatmap written to {}", file.display());
        }
    }
    Ok(())
}
