//! The C++ test programs, built by build.rs against the patched tree's internal headers: the H2O
//! state in `llama_kv_cache` (seed 001's 11 metrics, the GQA gathers, reset, and the C API's
//! validation and introspection) on the default model, the H2O attention op on GPU backends
//! against the CPU, and the whole H2O prefill with the layers offloaded against the CPU.
// The stock engine has no H2O, and the CUDA (cmake) build does not make the C++ test programs.
#![cfg(not(any(feature = "stock", feature = "cuda")))]

mod common;

use std::process::Command;

#[test]
fn kv_cache_h2o_state_cpp_tests() {
    let dir = env!("H2O_LLAMA_CPP_TESTS_DIR");
    let exe = std::path::Path::new(dir).join("test-h2o-kv-cache");
    let out = Command::new(&exe)
        .arg(common::model_path())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "C++ tests failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // every test reported, none failed
    assert!(stdout.contains("15 tests, 0 failed"), "{stdout}");
}

/// GGML_OP_H2O_ATTN on every GPU backend against the CPU backend (tests/cpp/test-h2o-backends.cpp).
/// A CPU-only build has no GPU backend: the program runs its cases on a 3-thread CPU backend
/// against the 1-thread reference instead (bit-identical), and says the GPU comparison skipped; on
/// a GPU machine it is run by `scripts/gpu-test.sh`.
#[test]
fn h2o_attention_backends_agree() {
    let dir = env!("H2O_LLAMA_CPP_TESTS_DIR");
    let exe = std::path::Path::new(dir).join("test-h2o-backends");
    let out = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{} failed ({}):\n{stdout}\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(", 0 failed"), "{stdout}");
    // it skips exactly when the build has no GPU backend
    let skipped = stdout.contains("skipped: no GPU backend");
    assert_eq!(skipped, stdout.contains("\n0 GPU backend(s)"), "{stdout}");
    // every case compared on every backend (the stand-in CPU one included): 7 comparisons each
    let n_compared = stdout.matches(" memory slots differ").count();
    assert!(n_compared >= 7 && n_compared.is_multiple_of(7), "{stdout}");
    if skipped {
        assert!(stdout.contains("CPU, 3 threads"), "{stdout}");
        assert_eq!(n_compared, 7, "{stdout}");
    }
}

/// The H2O prefill end to end with the layers offloaded against the CPU (tests/cpp/test-h2o-offload.cpp):
/// placement of the H2O ops, logits and memory sets, and N <= S against full attention. A CPU-only
/// build runs the offloaded side on the CPU with another thread count, bit-identical; on a GPU
/// machine `scripts/gpu-test.sh` runs it with the model.
#[test]
fn h2o_prefill_offloaded_agrees_with_the_cpu() {
    let dir = env!("H2O_LLAMA_CPP_TESTS_DIR");
    let exe = std::path::Path::new(dir).join("test-h2o-offload");
    let out = Command::new(&exe)
        .arg(common::model_path())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{} failed ({}):\n{stdout}\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(", 0 failed"), "{stdout}");
    // every check reported: placement of both runs, the distributions, the memory sets and N <= S
    // on both placements
    assert_eq!(
        stdout
            .matches("each on the backend holding its state")
            .count(),
        2,
        "{stdout}"
    );
    assert!(
        stdout.contains("memory sets, offloaded vs CPU: 270 of 270 identical"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("N <= S on ").count(), 2, "{stdout}");
}
