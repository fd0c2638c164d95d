//! Issue 31, "Models people run, never an abort": a matrix of model architectures, each a tiny
//! random-weight GGUF that the test writes itself (`tests/common/tiny_models.rs`, with the
//! default model's tokenizer), run through `h2o-cli` in a child process:
//!
//! a. with full attention every model loads and evaluates a 1,500-token prompt (`-c 4096 -ub
//!    512`) and gives finite logits;
//! b. with H2O (`--h2o-local 128 --h2o-heavy 128`, `-ub 512`) each model does what [`MATRIX`]
//!    says: it runs (finite logits and an H2O state), or llama.cpp refuses the context (exit 5)
//!    with a message that names the reason. A signal (llama.cpp's `GGML_ASSERT` aborts) is
//!    always a failure, with the child's stderr in the message; the child process keeps the
//!    abort from taking the test binary down with it.
//!
//! The table holds the targets. Run it with
//! `cargo test --release -p h2o-cli --test architectures` (add `-- --nocapture` for a line per
//! model: what its GGUF holds and what happened; set `H2O_LLAMA_ARCH_DIR=DIR` to keep the GGUFs
//! in DIR).
#![cfg(not(feature = "stock"))]

// The root package's shared test helpers (the default model, scratch directories, the GGUF
// writer and the tiny models).
#[path = "../../tests/common/mod.rs"]
mod common;

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::gguf::{self, TensorType, Type, Value, Writer};
use common::tiny_models::{self, TinyModel};

/// What a model does with H2O on.
#[derive(Clone, Copy, Debug)]
enum H2o {
    /// The prefill runs sparse: exit 0, finite logits, an H2O state.
    Runs,
    /// llama.cpp refuses the context (exit 5) with a message containing this.
    Refused(&'static str),
}
use H2o::{Refused, Runs};

/// The one table: every row a test of its own name, and [`MATRIX`] for reading.
macro_rules! matrix {
    ($($(#[$doc:meta])* $name:ident => $expect:expr,)*) => {
        /// (name, builder, what H2O does)
        const MATRIX: &[(&str, fn() -> TinyModel, H2o)] =
            &[$((stringify!($name), tiny_models::$name, $expect)),*];
        $(
            $(#[$doc])*
            #[test]
            fn $name() {
                check(stringify!($name));
            }
        )*
    };
}

matrix! {
    llama_gqa => Runs,
    llama_mha => Runs,
    qwen2 => Runs,
    qwen3 => Runs,
    phi3 => Runs,
    /// Attention logit soft-capping, in the op (`ggml_h2o_attn_set_logits`).
    gemma2 => Runs,
    /// H2O on the global layer (5); the window layers keep llama.cpp's windowed cache.
    gemma3 => Runs,
    mistral3 => Runs,
    granite => Runs,
    olmo2 => Runs,
    olmo2_swa => Runs,
    /// Learned attention sinks, in the op (before, llama.cpp aborted in
    /// `build_attn` with SIGABRT).
    gpt_oss => Runs,
    /// The MLA cache holds one compressed latent per token (a single "KV head" of kv_lora_rank +
    /// rope dims, V a view of it), not the plain per-head K/V that the H2O op reads: refused in
    /// `llama_model::create_memory`.
    deepseek2_mla => Refused("uses multi-head latent attention"),
    /// The old layout caches per-head K and V as any MHA model (K 64 and V 32 dims).
    deepseek2 => Runs,
}

/// Prompt length: three chunks of `-ub 512`, so that two of them run sparse.
const PROMPT_TOKENS: usize = 1500;
/// The documented exit code for "llama.cpp refused or failed while running".
const EXIT_RUNTIME: i32 = 5;
/// Set to a directory to keep the tiny GGUFs there (e.g. to run one by hand with `h2o-cli -v`).
const KEEP_DIR: &str = "H2O_LLAMA_ARCH_DIR";
/// Longest a child may take (a few seconds is normal): a hang fails instead of blocking CI.
const CHILD_TIMEOUT: Duration = Duration::from_secs(120);

/// What one `h2o-cli` run did.
struct Run {
    /// exit code, or None when a signal ended it
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
    seconds: f64,
}

impl Run {
    fn describe(&self) -> String {
        let how = match (self.code, self.signal) {
            (Some(c), _) => format!("exit {c}"),
            (None, Some(s)) => format!("killed by signal {s}{}", signal_name(s)),
            (None, None) => "ended without a status".into(),
        };
        // the assertion that aborted, if any (gdb's backtrace, when it runs, can push it out of
        // the tail), then the end of stderr
        let tail = tail(&self.stderr);
        let assert = self
            .stderr
            .lines()
            .find(|l| l.contains("GGML_ASSERT") || l.contains("GGML_ABORT"))
            .filter(|l| !tail.contains(l))
            .map(|l| format!("\n{l}"))
            .unwrap_or_default();
        format!("{how} after {:.1} s{assert}\nstderr:\n{tail}", self.seconds)
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        6 => " (SIGABRT: llama.cpp aborted, e.g. a GGML_ASSERT)",
        9 => " (SIGKILL: timed out or out of memory)",
        11 => " (SIGSEGV)",
        4 => " (SIGILL)",
        _ => "",
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Runs `h2o-cli` on `model` with the matrix's settings and `extra` flags, writing the
/// next-token logits to `logits`; kills it past [`CHILD_TIMEOUT`].
fn h2o_cli(model: &Path, logits: &Path, extra: &[&str]) -> Run {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("-m")
        .arg(model)
        .args(["--synthetic-prompt", &PROMPT_TOKENS.to_string()])
        .args([
            "-n", "1", "--temp", "0", "-c", "4096", "-ub", "512", "-t", "1",
        ])
        .args(["--json", "--logits-out"])
        .arg(logits)
        .args(extra)
        // an abort prints its message, not a gdb backtrace
        .env("GGML_NO_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("h2o-cli starts");
    // drain both pipes on threads so that a chatty child never blocks on a full pipe
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > CHILD_TIMEOUT {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        code: status.code(),
        signal: status.signal(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        seconds: start.elapsed().as_secs_f64(),
    }
}

/// The logits file: n_vocab little-endian f32.
fn read_logits(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("no logits at {}: {e}", path.display()))
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Checks a run that should have evaluated the prompt: exit 0, the JSON record, finite logits
/// of the vocabulary's size. Returns the record, or what went wrong.
fn evaluated(run: &Run, logits: &Path) -> Result<serde_json::Value, String> {
    if run.code != Some(0) {
        return Err(run.describe());
    }
    let record: serde_json::Value = serde_json::from_str(run.stdout.trim())
        .map_err(|e| format!("no JSON record ({e}): {}", run.stdout))?;
    if record["prompt_tokens"] != PROMPT_TOKENS {
        return Err(format!("prompt_tokens is not {PROMPT_TOKENS}: {record}"));
    }
    let l = read_logits(logits);
    let n_vocab = tiny_models::tokenizer()
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .and_then(|(_, v)| v.len())
        .unwrap();
    if l.len() != n_vocab {
        return Err(format!("{} logits, expected {n_vocab}", l.len()));
    }
    if let Some(i) = l.iter().position(|x| !x.is_finite()) {
        return Err(format!("logit {i} is {}", l[i]));
    }
    if l.iter().all(|&x| x == l[0]) {
        return Err(format!("every logit is {}", l[0]));
    }
    Ok(record)
}

fn check(name: &str) {
    let &(_, build, expect) = MATRIX.iter().find(|(n, ..)| *n == name).unwrap();
    let dir = common::scratch(&format!("arch-{name}"));
    let tiny = build();
    let model = match std::env::var_os(KEEP_DIR) {
        // keep the GGUF where asked, to try the model by hand
        Some(keep) => {
            std::fs::create_dir_all(&keep).unwrap();
            PathBuf::from(keep).join(format!("{name}.gguf"))
        }
        None => dir.join(format!("{name}.gguf")),
    };
    tiny.gguf.write(&model).unwrap();
    let mib = std::fs::metadata(&model).unwrap().len() as f64 / (1 << 20) as f64;
    eprintln!("{name}: {} ({mib:.1} MiB)", tiny.describe);

    // a. full attention
    let full_logits = dir.join("full.f32");
    let run = h2o_cli(&model, &full_logits, &[]);
    let record =
        evaluated(&run, &full_logits).unwrap_or_else(|e| panic!("{name}, full attention: {e}"));
    assert!(record["h2o"].is_null(), "{record}");
    eprintln!("{name}: full attention ok ({:.1} s)", run.seconds);

    // b. H2O
    let h2o_logits = dir.join("h2o.f32");
    let run = h2o_cli(
        &model,
        &h2o_logits,
        &["--h2o-local", "128", "--h2o-heavy", "128"],
    );
    let outcome = if run.code == Some(0) {
        evaluated(&run, &h2o_logits).and_then(|record| {
            let state = record["h2o_state_bytes"].as_u64().unwrap_or(0);
            if state == 0 || record["h2o"].is_null() {
                return Err(format!("it ran without an H2O state: {record}"));
            }
            // with a random model and M = 256 of up to 1,024 earlier keys, the sparse chunks
            // cannot give full attention's logits to the last bit (the models' global layers
            // are never their last, whose effect on the last, dense-tail token would be nil)
            let full = read_logits(&full_logits);
            let delta = common::max_abs_diff(&full, &read_logits(&h2o_logits));
            if delta == 0.0 {
                return Err(format!(
                    "its logits equal full attention's: did the prefill run sparse? {record}"
                ));
            }
            Ok(format!(
                "runs: H2O state {state} bytes, max |logit - full attention's| {delta:.2e}"
            ))
        })
    } else {
        Err(run.describe())
    };
    match (expect, &outcome) {
        (Runs, Ok(what)) => eprintln!("{name}: H2O {what} ({:.1} s)", run.seconds),
        (Runs, Err(e)) => panic!("{name}, H2O: expected to run, but {e}"),
        (Refused(reason), _) => {
            assert!(
                run.code == Some(EXIT_RUNTIME) && run.stderr.contains(reason),
                "{name}, H2O: expected a refusal (exit {EXIT_RUNTIME}) naming \"{reason}\", \
                 but {}",
                match &outcome {
                    Ok(what) => format!("it {what}"),
                    Err(e) => e.clone(),
                }
            );
            let msg = run.stderr.lines().last().unwrap_or_default();
            eprintln!("{name}: H2O refused as expected: {msg}");
        }
    }
}

/// The writer's own check: every metadata type, arrays (of strings, numbers, arrays, and an
/// empty one) and both tensor types survive a round trip, and the tensor data starts aligned.
#[test]
fn gguf_writer_round_trips_metadata_and_aligns_tensors() {
    let dir = common::scratch("arch-gguf-writer");
    let path = dir.join("t.gguf");
    let mut w = Writer::new("llama");
    let kv = [
        ("t.u8", Value::U8(250)),
        ("t.i8", Value::I8(-5)),
        ("t.u16", Value::U16(65000)),
        ("t.i16", Value::I16(-300)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-7)),
        ("t.f32", Value::F32(0.25)),
        ("t.bool", Value::Bool(true)),
        ("t.str", Value::from("héllo")),
        ("t.u64", Value::U64(1 << 40)),
        ("t.i64", Value::I64(-(1 << 40))),
        ("t.f64", Value::F64(-1.5)),
        ("t.strs", Value::strs(["a", "", "ç"])),
        ("t.u32s", Value::u32s([1, 2, 3])),
        ("t.empty", Value::Array(Type::F32, vec![])),
        (
            "t.nested",
            Value::Array(Type::Array, vec![Value::u32s([4]), Value::u32s([5, 6])]),
        ),
    ];
    for (k, v) in &kv {
        w.set(k, v.clone());
    }
    w.tensor("a", &[3], TensorType::F32, vec![1.0, 2.0, 3.0]);
    w.tensor("b", &[2, 2], TensorType::F16, vec![1.0, -2.0, 0.5, 65504.0]);
    w.write(&path).unwrap();
    let back = gguf::read_metadata(&path).unwrap();
    assert_eq!(
        back[0],
        ("general.architecture".into(), Value::from("llama"))
    );
    for ((k, v), (bk, bv)) in kv.iter().zip(&back[1..]) {
        assert_eq!((*k, v), (bk.as_str(), bv));
    }
    // the file ends with the aligned data: F32 [1, 2, 3] padded to 32 bytes, then the F16 bits
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len() % 32, 0);
    let data = &bytes[bytes.len() - 64..];
    assert_eq!(
        &data[..12],
        [1.0f32, 2.0, 3.0].map(f32::to_le_bytes).concat()
    );
    assert_eq!(
        &data[32..40],
        [0x3c00u16, 0xc000, 0x3800, 0x7bff]
            .map(u16::to_le_bytes)
            .concat()
    );
    for (x, h) in [
        (0.1f32, 0x2e66u16),
        (6.103_515_6e-5, 0x0400),
        (5.960_464_5e-8, 0x0001),
    ] {
        assert_eq!(gguf::f32_to_f16(x), h, "{x}");
    }
}
