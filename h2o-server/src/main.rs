//! `h2o-server`: an OpenAI-compatible HTTP server (a llama-server look-alike) whose every slot
//! prefills with H2O chunked sparse attention. This file is the shell: flags, model, engine,
//! listener, signals. The endpoints are in `http`, the request and response shapes in `openai`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use h2o_flags::{
    llama_spellings, AutoDecision, AutoFit, EngineFlags, H2oChoice, H2oFlags, SamplingFlags,
};
use h2o_llama::{
    default_model, models, Error, ErrorKind, FlashAttention, H2oConfig, SessionConfig,
};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

mod body;
mod engine;
mod error;
mod http;
mod jinja;
mod log;
mod metrics;
mod openai;
mod response;
mod run;
mod sse;
mod state;

use engine::{EngineConfig, EngineHandle, RequestDefaults};
use jinja::JinjaMode;

/// Exit codes, as h2o-cli's (docs/cli.md): distinct per failure class.
mod exit {
    #[allow(dead_code)] // clap exits with it itself; listed so the table is complete
    pub const USAGE: u8 = 2;
    pub const INPUT: u8 = 3; // bad parameters, address in use
    pub const MODEL: u8 = 4; // model missing, unreadable, not GGUF, rejected; default-model fetch
    pub const RUNTIME: u8 = 5; // llama.cpp refused the context, the server failed
    pub const INTERRUPTED: u8 = 130; // signal during the model download
}

const EXAMPLES: &str = "\
Examples:
  h2o-server                                        # default model, http://127.0.0.1:8080
  h2o-server -m model.gguf -c 32768 -np 4 --h2o-local 256 --h2o-heavy 256 -ub 1024 -b 4096
  h2o-server --port 0                               # any free port, printed on stderr
  curl http://127.0.0.1:8080/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}'

Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /completion (llama-server),
POST /tokenize, POST /detokenize, GET /v1/models, GET /health, GET /metrics (Prometheus),
GET /props.
Per request, the body fields h2o_select, h2o_sink and h2o_dense_tail override --h2o-select,
--h2o-sink and --h2o-dense-tail.

Exit codes: 0 ok (also after SIGTERM or Ctrl-C), 2 bad flags, 3 bad parameters or address in
use, 4 model problem, 5 llama.cpp or server failure, 130 interrupted during the model download.";

/// OpenAI-compatible HTTP server with H2O chunked sparse prefill, in the manner of llama-server.
#[derive(Parser, Debug)]
#[command(name = "h2o-server", version, about, after_help = EXAMPLES)]
struct Cli {
    /// The engine of every slot; -c is shared by the slots (each gets -c / -np, or the model's
    /// training context where -c is left out), and -fa auto is off with more than one slot
    #[command(flatten)]
    engine: EngineFlags,
    /// Slots: requests served at the same time (-np)
    #[arg(long = "parallel", value_name = "N", default_value_t = 4)]
    parallel: u32,
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 = any free port; the one chosen is printed)
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health
    #[arg(
        long,
        value_name = "KEY",
        env = "H2O_SERVER_API_KEY",
        hide_env_values = true
    )]
    api_key: Option<String>,
    /// Requests that may wait for a slot; more are answered 503 with Retry-After
    #[arg(long, value_name = "N", default_value_t = 64)]
    queue: usize,
    /// Largest request body in bytes; larger ones are answered 413
    #[arg(long, value_name = "BYTES", default_value_t = 8 * 1024 * 1024)]
    max_body: usize,
    #[command(flatten)]
    h2o: H2oFlags,
    /// The model's name in /v1/models and in answers; several, comma-separated, are aliases
    /// [default: the model's file name]
    #[arg(short = 'a', long, value_name = "NAME")]
    alias: Option<String>,
    /// Tags listed with the model in /v1/models, comma-separated
    #[arg(long, value_name = "TAGS")]
    tags: Option<String>,
    #[command(flatten)]
    sampling: SamplingFlags,
    /// Chat template in place of the model's: one of llama.cpp's built-in templates by name
    /// (chatml, llama3, gemma, command-r, …) or a template's text (Jinja text also serves the
    /// Jinja templates)
    #[arg(long = "chat-template", value_name = "NAME")]
    chat_template: Option<String>,
    /// A Jinja chat template file in place of the model's, for --jinja and requests with tools
    /// (examples/templates/chatml-tools.jinja gives SmolLM2 tool calls)
    #[arg(long = "chat-template-file", value_name = "FILE")]
    chat_template_file: Option<PathBuf>,
    /// Render every chat request with the Jinja template (llama.cpp's common/); without it only
    /// requests with tools are, the others with llama.cpp's built-in templates
    #[arg(long, overrides_with = "no_jinja")]
    jinja: bool,
    /// No Jinja templates: built-in templates only, and requests with tools are refused
    #[arg(long = "no-jinja")]
    no_jinja: bool,
    /// When a generation fills its slot, drop half of what follows the request's n_keep tokens
    /// and go on (llama-server's; full attention only: H2O keeps its memory sets by position)
    #[arg(long = "context-shift", overrides_with = "no_context_shift")]
    context_shift: bool,
    /// A generation that fills its slot ends there (finish_reason "length", truncated)
    #[arg(long = "no-context-shift")]
    no_context_shift: bool,
    /// One KV cache of -c cells shared by all slots (llama-server's): a slot may use what the
    /// others leave, and a step that finds the cache full fails its requests (full attention
    /// only: H2O keeps each slot's state with its own stream)
    #[arg(long = "kv-unified")]
    kv_unified: bool,
    /// How a reply's reasoning (thinking) is returned when a chat request leaves
    /// `reasoning_format` out: none (left in the content), deepseek (in reasoning_content),
    /// deepseek-legacy, auto [default: common/'s, auto]
    #[arg(long = "reasoning-format", value_name = "FORMAT",
          value_parser = ["none", "deepseek", "deepseek-legacy", "auto"])]
    reasoning_format: Option<String>,
    /// GET /slots (on by default)
    #[arg(long, overrides_with = "no_slots")]
    slots: bool,
    /// Answer GET /slots with 501
    #[arg(long = "no-slots")]
    no_slots: bool,
    /// Accepted for llama-server's command lines: /metrics is always on
    #[arg(long)]
    metrics: bool,
    /// Directory of slot files: POST /slots/{id}?action=save|restore keep them there
    #[arg(long = "slot-save-path", value_name = "DIR")]
    slot_save_path: Option<PathBuf>,
    /// No web page at / (404)
    #[arg(long = "no-webui")]
    no_webui: bool,
}

/// The llama-server multi-letter flags h2o-server takes (clap cannot declare them).
const LLAMA_FLAGS: &[&str] = &["-np", "-ub", "-fa", "-ngl", "-ctk", "-ctv", "-hf"];

fn main() -> ExitCode {
    let cli = Cli::parse_from(llama_spellings::expand(std::env::args(), LLAMA_FLAGS));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("h2o-server: error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::RUNTIME);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match e.downcast_ref::<Error>() {
                Some(Error::Interrupted) => eprintln!("h2o-server: interrupted"),
                _ => eprintln!("h2o-server: error: {e:#}"),
            }
            ExitCode::from(exit_code(&e))
        }
    }
}

/// Errors of the listener, told apart from the library's for the exit code.
#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("cannot listen on {addr}: {source}: pick another --host/--port (--port 0 takes any free port)")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the HTTP server failed: {0}")]
    Serve(std::io::Error),
}

fn exit_code(e: &anyhow::Error) -> u8 {
    if let Some(e) = e.downcast_ref::<ServeError>() {
        return match e {
            ServeError::Bind { .. } => exit::INPUT,
            ServeError::Serve(_) => exit::RUNTIME,
        };
    }
    match e.downcast_ref::<Error>().map(Error::kind) {
        Some(ErrorKind::Interrupted) => exit::INTERRUPTED,
        Some(ErrorKind::Model) => exit::MODEL,
        Some(ErrorKind::Runtime) | None => exit::RUNTIME,
        Some(ErrorKind::Input) => exit::INPUT,
    }
}

/// What the engine is started with, checked before any download or model load.
fn engine_config(cli: &Cli, model_path: PathBuf) -> Result<EngineConfig> {
    let s = &cli.sampling;
    let ctx_size = cli.engine.ctx_size();
    let per_slot = if cli.kv_unified {
        ctx_size
    } else {
        ctx_size / cli.parallel.max(1)
    };
    // Left to decide, the server turns H2O on unless no slot could hold a prompt long enough
    // for it, a full-attention feature is asked for, or the layers run on a GPU (where, as
    // `H2oChoice::by_itself` says for h2o-cli, it does not pay). Unlike h2o-cli it cannot give shorter
    // prompts full attention: a sequence's H2O settings are kept with its cache, and a prompt
    // under other settings (a dense tail of the whole prompt) reuses none of a conversation's
    // cached prefix. Prompts of one chunk are full attention anyway.
    // Chunks that do not hold the memory run full attention (`AutoFit`): never a refusal of
    // flags full attention runs.
    let (h2o, auto) = match cli.h2o.choice()? {
        H2oChoice::Off => (None, None),
        H2oChoice::On(h2o) => (
            Some(cli.h2o.on_backend(h2o, cli.engine.layers_on_gpu())),
            None,
        ),
        H2oChoice::Auto { h2o, .. } => {
            let why_not = if ctx_size > 0 && !H2oConfig::automatic_for(per_slot as usize) {
                Some(format!(
                    "no slot holds a prompt long enough for it ({per_slot} tokens each, H2O turns \
                     on by itself from {})",
                    H2oConfig::AUTO_FROM_TOKENS
                ))
            } else if cli.engine.layers_on_gpu() {
                Some("the layers run on the GPU or RPC servers (-ngl)".into())
            } else if cli.context_shift || cli.kv_unified {
                Some(
                    "a full-attention feature was asked for (--context-shift, --kv-unified)".into(),
                )
            } else {
                None
            };
            match why_not {
                Some(why) => (None, Some(AutoDecision::left_off(&why))),
                None => {
                    let fit = AutoFit::of(h2o, &cli.engine, per_slot);
                    let decision = match fit {
                        AutoFit::Fits(_) => AutoDecision {
                            outcome: fit.outcome(),
                            note: "on by itself; --h2o off for full attention".into(),
                        },
                        AutoFit::FullAttention { .. } => AutoDecision::left_off(&fit.note()),
                    };
                    (fit.h2o(), Some(decision))
                }
            }
        }
    };
    let h2o_auto = h2o.is_some() && auto.is_some();
    let jinja_template = match (&cli.chat_template_file, &cli.chat_template) {
        (Some(path), _) => Some(std::fs::read_to_string(path).map_err(|e| {
            Error::InvalidConfig(format!(
                "--chat-template-file {}: {e} (give a readable Jinja template file)",
                path.display()
            ))
        })?),
        // Jinja text given inline serves both paths; a built-in name only llama.cpp's own
        (None, Some(t)) if t.contains("{%") || t.contains("{{") => Some(t.clone()),
        (None, _) => None,
    };
    if cli.context_shift && h2o.is_some() {
        return Err(Error::InvalidConfig(
            "--context-shift moves cached positions, and H2O keeps its memory sets and scores by \
             position: use full attention (no --h2o-local/--h2o-heavy) or leave out \
             --context-shift"
                .into(),
        )
        .into());
    }
    if cli.kv_unified && h2o.is_some() {
        return Err(Error::InvalidConfig(
            "--kv-unified holds every slot in one KV stream, and H2O keeps each slot's scores \
             and memory sets with its own stream: use full attention (no \
             --h2o-local/--h2o-heavy) or leave out --kv-unified"
                .into(),
        )
        .into());
    }
    if cli.no_jinja && cli.chat_template_file.is_some() {
        return Err(Error::InvalidConfig(
            "--chat-template-file is a Jinja template, and --no-jinja turns those off: drop one"
                .into(),
        )
        .into());
    }

    if cli.parallel == 0 {
        return Err(Error::InvalidConfig("the slot count -np must be at least 1".into()).into());
    }
    if ctx_size > 0 && per_slot == 0 {
        return Err(Error::InvalidConfig(format!(
            "-c {} is smaller than -np {}: each slot gets -c / -np tokens; raise -c (or 0 for the \
             model's context per slot) or lower -np",
            ctx_size, cli.parallel
        ))
        .into());
    }
    if let Some(dir) = &cli.slot_save_path {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::InvalidConfig(format!(
                "--slot-save-path {}: cannot make the directory: {e}",
                dir.display()
            ))
        })?;
    }
    if cli.max_body == 0 {
        return Err(Error::InvalidConfig("--max-body must be at least 1 byte".into()).into());
    }
    if cli.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(Error::InvalidConfig(
            "--api-key is empty: give a key, or leave the flag out".into(),
        )
        .into());
    }
    // Each slot is a context of -c / -np tokens: check the flags as a session of that size, the
    // way h2o-cli checks them, so that a bad -ub or L/H fails now and not after the download.
    let slot = SessionConfig {
        n_ctx: per_slot,
        ..cli.engine.session_config(h2o)
    };
    let checked = slot.validate().map_err(|e| {
        if h2o_auto {
            let why = format!(
                "H2O turns on by itself (L = H = {}, chunks of -ub)",
                H2oConfig::RECOMMENDED_MEMORY
            );
            H2oChoice::refused_by_itself(e, &why)
        } else {
            e
        }
    });
    if ctx_size > 0 {
        checked.with_context(|| {
            format!(
                "each of the -np {} slots has -c {ctx_size} / {} = {per_slot} tokens",
                cli.parallel, cli.parallel
            )
        })?;
    } else {
        checked?;
    }
    // -c 0: each slot gets the model's training context, which only the loaded model tells;
    // where it is too short for H2O to pay, the engine takes this full-attention session instead
    let session_if_short = (h2o_auto && ctx_size == 0).then(|| SessionConfig {
        n_ctx: per_slot,
        ..cli.engine.session_config(None)
    });
    Ok(EngineConfig {
        model_path,
        n_ctx: ctx_size,
        n_parallel: cli.parallel,
        session: slot,
        session_if_short,
        h2o_auto: auto,
        model_params: cli.engine.model_params(),
        queue_capacity: cli.queue,
        chat_template: cli.chat_template.clone(),
        jinja: if cli.no_jinja {
            JinjaMode::Off
        } else if cli.jinja {
            JinjaMode::All
        } else {
            JinjaMode::Tools
        },
        jinja_template,
        context_shift: cli.context_shift,
        kv_unified: cli.kv_unified,
        reasoning_format: cli.reasoning_format.clone(),
        aliases: comma_list(cli.alias.as_deref()),
        tags: comma_list(cli.tags.as_deref()),
        defaults: RequestDefaults {
            temperature: f64::from(s.temp),
            top_k: s.top_k,
            top_p: f64::from(s.top_p),
            seed: s.seed()?.map_or(-1, i64::from),
            n_predict: s
                .n_predict(-1)?
                .map_or(-1, |n| i64::try_from(n).unwrap_or(i64::MAX)),
        },
    })
}

/// The names of a comma-separated flag (`--alias a,b`), blanks dropped.
fn comma_list(flag: Option<&str>) -> Vec<String> {
    flag.into_iter()
        .flat_map(|a| a.split(','))
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect()
}

/// Set by the first SIGINT or SIGTERM: the model download gives up, the server stops taking
/// connections and the engine cancels its jobs. A second signal exits at once.
struct Stop {
    flag: Arc<AtomicBool>,
    rx: watch::Receiver<bool>,
}

impl Stop {
    fn install() -> Result<Self> {
        let mut int =
            signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
        let mut term =
            signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
        let flag = Arc::new(AtomicBool::new(false));
        let (tx, rx) = watch::channel(false);
        let set = flag.clone();
        tokio::spawn(async move {
            tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
            set.store(true, Ordering::SeqCst);
            let _ = tx.send(true);
            tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
            eprintln!("h2o-server: second signal: exiting without waiting for the requests");
            std::process::exit(i32::from(exit::INTERRUPTED));
        });
        Ok(Self { flag, rx })
    }

    async fn wait(mut rx: watch::Receiver<bool>) {
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

async fn run(cli: Cli) -> Result<()> {
    h2o_llama::set_log_echo(cli.sampling.verbose);
    let stop = Stop::install()?;
    // every check that needs no model first: a typo costs no download
    let mut config = engine_config(&cli, PathBuf::new())?;
    // the port too: better to learn it is taken before a long model load
    let addr = (cli.host.as_str(), cli.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: format!("{}:{}", cli.host, cli.port),
            source,
        })?;

    let model_arg = cli.engine.model.clone();
    let interrupt = stop.flag.clone();
    config.model_path = tokio::task::spawn_blocking(move || {
        let log = |msg: &str| eprintln!("h2o-server: {msg}");
        match model_arg {
            Some(p) => models::resolve(&p, log, &interrupt),
            None => default_model::ensure_interruptible(log, &interrupt),
        }
    })
    .await
    .context("the model download task failed")??;

    let engine = tokio::task::spawn_blocking(move || engine::start(config))
        .await
        .context("the engine start task failed")??;
    if stop.flag.load(Ordering::SeqCst) {
        eprintln!("h2o-server: stopped by a signal before serving");
        shutdown_engine(engine).await;
        return Ok(());
    }
    print_setup(&engine, &cli);
    if engine.info().flash_attn == FlashAttention::On && engine.info().n_parallel > 1 {
        eprintln!(
            "h2o-server: note: -fa on with -np > 1: a slot's decode steps among other slots' get \
             slightly other logits than alone (llama.cpp's CPU flash-attention kernel), so a \
             greedy answer may depend on the requests beside it; -fa auto avoids it"
        );
    }

    let options = http::Options {
        slots: !cli.no_slots,
        webui: !cli.no_webui,
        slot_save_path: cli.slot_save_path.clone(),
        verbose: cli.sampling.verbose,
        ..http::Options::new(cli.api_key.clone(), cli.max_body)
    };
    let state = Arc::new(http::AppState::new(Arc::new(engine.clone()), options));
    let app = http::router(state);
    let local = listener
        .local_addr()
        .context("cannot read the bound address")?;
    // the one line scripts and tests wait for: the server is ready, on this (real) port
    eprintln!("h2o-server: listening on http://{local}");
    let mut server = tokio::spawn(http::serve(listener, app, Stop::wait(stop.rx.clone())));

    let served = tokio::select! {
        r = &mut server => Some(r),
        () = Stop::wait(stop.rx.clone()) => None,
    };
    if let Some(r) = served {
        // the server ended without a signal: an accept loop failure
        shutdown_engine(engine).await;
        return r
            .context("the HTTP server task failed")?
            .map_err(|e| ServeError::Serve(e).into());
    }
    eprintln!("h2o-server: stopping: no new connections; cancelling the requests in progress");
    // Cancelling the jobs ends their streams and answers, so the open connections close and the
    // graceful shutdown completes; without it, it would wait for every generation to finish.
    shutdown_engine(engine).await;
    match tokio::time::timeout(Duration::from_secs(10), server).await {
        Ok(r) => r
            .context("the HTTP server task failed")?
            .map_err(ServeError::Serve)?,
        Err(_) => eprintln!("h2o-server: connections still open after 10 s: closing them"),
    }
    eprintln!("h2o-server: stopped");
    Ok(())
}

/// [`EngineHandle::shutdown`] blocks until the engine thread has stopped: off the async threads.
async fn shutdown_engine(engine: EngineHandle) {
    let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
}

/// One line on what serves: model, slots, batches, attention, queue.
fn print_setup(engine: &EngineHandle, cli: &Cli) {
    let info = engine.info();
    let mut attention = match info.h2o {
        Some(h) if h.is_enabled() => format!(
            "H2O L={} H={} select={} sink={} dense-tail={} decode={}",
            h.local,
            h.heavy,
            h.select,
            h.sink,
            h.dense_tail,
            if h.decode_budget > 0 {
                "sparse"
            } else {
                "full"
            }
        ),
        _ => "full attention".into(),
    };
    if let Some(auto) = &info.h2o_auto {
        attention += &format!(" ({})", auto.note);
    }
    eprintln!(
        "h2o-server: {} | {} slot{} {} {} tokens | -b {} -ub {} -fa {} | {attention} | queue {}{}",
        info.model_id,
        info.n_parallel,
        if info.n_parallel == 1 { "" } else { "s" },
        if cli.kv_unified { "sharing" } else { "x" },
        info.n_ctx_slot,
        cli.engine
            .batch_size(info.h2o.is_some_and(|h| h.is_enabled())),
        info.n_ubatch,
        info.flash_attn,
        cli.queue,
        if cli.api_key.is_some() {
            " | API key required"
        } else {
            ""
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use h2o_llama::Selection;

    fn cli(args: &[&str]) -> Cli {
        let argv = std::iter::once("h2o-server")
            .chain(args.iter().copied())
            .map(String::from);
        Cli::try_parse_from(llama_spellings::expand(argv, LLAMA_FLAGS)).unwrap()
    }

    #[test]
    fn the_flags_are_declared_without_clashes() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn sampling_flags_are_llama_servers_and_out_of_range_ones_are_refused() {
        let c = engine_config(
            &cli(&["-s", "42", "-n", "16", "--temp", "0.5"]),
            PathBuf::new(),
        )
        .unwrap();
        let d = c.defaults;
        assert_eq!((d.seed, d.n_predict, d.temperature), (42, 16, 0.5));
        let d = engine_config(&cli(&[]), PathBuf::new()).unwrap().defaults;
        assert_eq!((d.seed, d.n_predict, d.top_k), (-1, -1, 40));
        for (args, flag) in [
            (&["-s", "-7"][..], "--seed"),
            (&["-n", "-2"], "--n-predict"),
        ] {
            let err = engine_config(&cli(args), PathBuf::new()).unwrap_err();
            assert!(format!("{err:#}").contains(flag), "{args:?}: {err:#}");
        }
    }

    #[test]
    fn llama_server_spellings_parse() {
        let c = cli(&[
            "-np",
            "2",
            "-ub=64",
            "-b",
            "256",
            "-ngl",
            "99",
            "-c",
            "1024",
            "--h2o-local",
            "16",
            "--h2o-heavy",
            "16",
        ]);
        assert_eq!(
            (
                c.parallel,
                c.engine.ubatch_size,
                c.engine.batch_size,
                c.engine.n_gpu_layers,
                c.engine.ctx_size
            ),
            (2, Some(64), Some(256), 99, Some(1024))
        );
        let config = engine_config(&c, PathBuf::from("m.gguf")).unwrap();
        let h2o = config.session.h2o.unwrap();
        assert_eq!(
            (h2o.local, h2o.heavy, h2o.select, h2o.sink, h2o.dense_tail),
            (16, 16, Selection::Coverage, 4, 64)
        );
    }

    #[test]
    fn h2o_turns_on_by_itself_where_a_slot_holds_a_long_prompt() {
        let config = |args: &[&str]| engine_config(&cli(args), PathBuf::new()).unwrap();
        // the model's context per slot, or 4 slots of 8,192
        for args in [&[][..], &["-c", "32768", "-np", "4"]] {
            let c = config(args);
            assert_eq!(c.session.h2o, Some(H2oConfig::automatic()), "{args:?}");
            assert_eq!((c.session.n_batch, c.session.n_ubatch), (4096, 1024));
        }
        // with the model's context (-c 0), full attention ready for a model trained on less
        let short = config(&[]).session_if_short.unwrap();
        assert_eq!(short.h2o, None);
        assert_eq!((short.n_batch, short.n_ubatch), (2048, 512));
        // an -ub for H2O's chunks raises the full-attention batch left out, -b given stays
        let short = config(&["-ub", "4096"]).session_if_short.unwrap();
        assert_eq!((short.n_batch, short.n_ubatch), (4096, 4096));
        assert!(short.validate().is_ok());
        let short = config(&["-b", "8192", "-ub", "2048"])
            .session_if_short
            .unwrap();
        assert_eq!((short.n_batch, short.n_ubatch), (8192, 2048));
        assert!(config(&["-c", "32768", "-np", "4"])
            .session_if_short
            .is_none());
        // slots shorter than a prompt H2O pays on, full-attention features, or --h2o off
        for args in [
            &["-c", "8192", "-np", "4"][..],
            &["--context-shift"],
            &["--kv-unified"],
            &["--h2o", "off"],
        ] {
            let c = config(args);
            assert_eq!(c.session.h2o, None, "{args:?}");
        }
    }

    #[test]
    fn h2o_by_itself_leaves_chunks_that_do_not_hold_its_memory_to_full_attention() {
        let config = |args: &[&str]| engine_config(&cli(args), PathBuf::new()).unwrap();
        // llama.cpp's server tests' command line, llama.cpp's default -ub and smaller chunks:
        // full attention, and said
        for args in [
            &[
                "--batch-size",
                "32",
                "--ctx-size",
                "4096",
                "--parallel",
                "1",
            ][..],
            &["-ub", "512"],
            &["-c", "8192", "-np", "1", "-b", "300"],
        ] {
            let c = config(args);
            assert_eq!(c.session.h2o, None, "{args:?}");
            assert!(c.session.validate().is_ok(), "{args:?}");
            let auto = c.h2o_auto.unwrap();
            assert_eq!(auto.outcome, "full_attention", "{args:?}");
            assert!(
                auto.note.contains("do not hold H2O's memory"),
                "{args:?}: {auto:?}"
            );
        }
        let c = config(&["-b", "32"]);
        assert_eq!((c.session.n_batch, c.session.n_ubatch), (32, 32));
        // the recommended memory where it fits, and nothing said with --h2o on or off
        assert_eq!(config(&[]).h2o_auto.unwrap().outcome, "on");
        assert!(config(&["--h2o", "off"]).h2o_auto.is_none());
        // asked for explicitly, a memory the chunk cannot hold is still refused
        for args in [
            &["-ub", "512", "--h2o", "on"][..],
            &["-ub", "512", "--h2o-local", "256", "--h2o-heavy", "256"],
        ] {
            let err = engine_config(&cli(args), PathBuf::new()).unwrap_err();
            let err = format!("{err:#}");
            assert!(
                err.contains("must be smaller than the chunk size -ub 512"),
                "{err}"
            );
        }
    }

    #[test]
    fn the_default_micro_batch_is_clamped_to_the_batch_as_llama_server_does() {
        let ubatch =
            |args: &[&str]| engine_config(&cli(args), PathBuf::new()).map(|c| c.session.n_ubatch);
        assert_eq!(ubatch(&["-b", "32", "-c", "512"]).unwrap(), 32);
        assert_eq!(ubatch(&["-b", "4096", "--h2o", "off"]).unwrap(), 512);
        // with H2O on, the chunk of 1,024 the design uses, under the default -b of 4096
        let h2o = ["--h2o-local", "256", "--h2o-heavy", "256"];
        assert_eq!(ubatch(&h2o).unwrap(), 1024);
        let config = engine_config(&cli(&h2o), PathBuf::new()).unwrap();
        assert_eq!(config.session.n_batch, 4096);
        // an explicit -ub above -b is a mistake worth naming, not a value to change behind the flag
        let err = ubatch(&["-b", "32", "-ub", "64", "-c", "512"]).unwrap_err();
        assert!(format!("{err:#}").contains("-ub <= -b"), "{err:#}");
    }

    #[test]
    fn bad_parameters_name_the_flag() {
        let message = |args: &[&str]| {
            format!(
                "{:#}",
                engine_config(&cli(args), PathBuf::new()).unwrap_err()
            )
        };
        assert!(message(&["-np", "0"]).contains("-np must be at least 1"));
        assert!(message(&["-c", "3", "-np", "4"]).contains("-c 3 is smaller than -np 4"));
        assert!(message(&["--h2o-local", "-5"]).contains("--h2o-local must be between 0"));
        let m = message(&["-ub", "64", "--h2o-local", "32", "--h2o-heavy", "32"]);
        assert!(
            m.contains("must be smaller than the chunk size -ub 64"),
            "{m}"
        );
        let m = message(&[
            "-c",
            "256",
            "-np",
            "4",
            "-ub",
            "128",
            "--h2o-local",
            "32",
            "--h2o-heavy",
            "32",
        ]);
        assert!(
            m.contains("each of the -np 4 slots has -c 256 / 4 = 64 tokens"),
            "{m}"
        );
        assert!(message(&["--api-key", " "]).contains("--api-key is empty"));
    }
}
