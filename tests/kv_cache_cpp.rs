//! The C++ test programs, built by build.rs against the patched tree's internal headers: the H2O
//! state in `llama_kv_cache` (seed 001's 11 metrics, the GQA gathers, reset, and the C API's
//! validation and introspection) on the default model, the H2O attention op on GPU backends
//! against the CPU, and the whole H2O prefill with the layers offloaded against the CPU.
// The stock engine has no H2O, and the CUDA (cmake) build does not make the C++ test programs.
#![cfg(not(any(feature = "stock", feature = "cuda")))]

mod common;

use std::process::Command;

/// Runs the C++ test program `name` (with the default model as its argument when `with_model`),
/// echoes its output, asserts that it succeeded, and returns its stdout.
fn run_cpp_test(name: &str, with_model: bool) -> String {
    let exe = std::path::Path::new(env!("H2O_LLAMA_CPP_TESTS_DIR")).join(name);
    let mut cmd = Command::new(&exe);
    if with_model {
        cmd.arg(common::model_path());
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{} failed ({}):\n{stdout}\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn kv_cache_h2o_state_cpp_tests() {
    let stdout = run_cpp_test("test-h2o-kv-cache", true);
    // every test reported, none failed
    assert!(stdout.contains("15 tests, 0 failed"), "{stdout}");
}

/// GGML_OP_H2O_ATTN on every GPU backend against the CPU backend (tests/cpp/test-h2o-backends.cpp).
/// A CPU-only build has no GPU backend: the program runs its cases on a 3-thread CPU backend
/// against the 1-thread reference instead (bit-identical), and says the GPU comparison skipped; on
/// a GPU machine it is run by `scripts/gpu-test.sh`.
#[test]
fn h2o_attention_backends_agree() {
    let stdout = run_cpp_test("test-h2o-backends", false);
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
    let stdout = run_cpp_test("test-h2o-offload", true);
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
