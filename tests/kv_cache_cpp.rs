//! The C++ test programs, built by build/cpu.rs against the patched tree's internal headers: the
//! H2O state in `llama_kv_cache` (the state's 11 checks, random cases, reset, and the C API's
//! validation and introspection) on the default model, the H2O attention op on GPU backends
//! against the CPU, and the whole H2O prefill with the layers offloaded against the CPU.
// The stock engine has no H2O, and the CUDA (cmake) build does not make the C++ test programs.
#![cfg(not(any(feature = "stock", feature = "cuda")))]

mod common;

use std::process::Command;

/// The path of the C++ program `name` built by build/cpu.rs.
fn cpp_program(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("H2O_LLAMA_CPP_TESTS_DIR")).join(name)
}

/// Runs the C++ program `name` with `args`, echoes its output, asserts that it succeeded, and
/// returns its stdout.
fn run_cpp_program<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S]) -> String {
    let exe = cpp_program(name);
    let out = Command::new(&exe)
        .args(args)
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

/// Runs the C++ test program `name` (with the default model as its argument when `with_model`).
fn run_cpp_test(name: &str, with_model: bool) -> String {
    let model = [common::model_path()];
    run_cpp_program(name, if with_model { &model[..] } else { &[] })
}

#[test]
fn kv_cache_h2o_state_cpp_tests() {
    let _engine = common::one_engine_at_a_time();
    let stdout = run_cpp_test("test-h2o-kv-cache", true);
    // every test reported, none failed
    assert!(stdout.contains("18 tests, 0 failed"), "{stdout}");
}

/// GGML_OP_H2O_ATTN and GGML_OP_H2O_DECODE on every GPU backend against the CPU backend
/// (tests/cpp/test-h2o-backends.cpp).
/// A CPU-only build has no GPU backend: the program runs its cases on a 3-thread CPU backend
/// against the 1-thread reference instead (bit-identical), and says the GPU comparison skipped; on
/// a GPU machine it is run by `scripts/gpu-test.sh`.
#[test]
fn h2o_attention_backends_agree() {
    let _engine = common::one_engine_at_a_time();
    let stdout = run_cpp_test("test-h2o-backends", false);
    assert!(stdout.contains(", 0 failed"), "{stdout}");
    // it skips exactly when the build has no GPU backend
    let skipped = stdout.contains("skipped: no GPU backend");
    assert_eq!(skipped, stdout.contains("\n0 GPU backend(s)"), "{stdout}");
    // every case compared on every backend (the stand-in CPU one included): 25 comparisons of the
    // prefill op each (7 of the seed rule, 6 of sinks, query-aware and hybrid selection and the
    // dense tail, 6 of coverage selection, one on Gemma 3's 256-channel heads, 6 of soft-capping,
    // learned sinks and BF16 or quantized K/V) and 10 of the sparse decode op
    let n_compared = stdout.matches(" memory slots differ").count();
    let n_decode = stdout.matches(" channels or counts differ").count();
    let n_backends = if skipped {
        1
    } else {
        stdout.matches("coverage selection with H = ").count()
    };
    assert_eq!(n_compared, 25 * n_backends, "{stdout}");
    assert_eq!(n_decode, 10 * n_backends, "{stdout}");
    if skipped {
        assert!(stdout.contains("CPU, 3 threads"), "{stdout}");
    }
}

/// The H2O prefill end to end with the layers offloaded against the CPU (tests/cpp/test-h2o-offload.cpp):
/// placement of the H2O ops, logits and memory sets (unforced, and forced equal after each chunk with
/// the near-tie bound on every difference), and N <= S against full attention. A CPU-only
/// build runs the offloaded side on the CPU with another thread count, bit-identical; on a GPU
/// machine `scripts/gpu-test.sh` runs it with the model.
#[test]
fn h2o_prefill_offloaded_agrees_with_the_cpu() {
    let _engine = common::one_engine_at_a_time();
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
    // the chunk-by-chunk prefill with the offloaded memory sets forced to the CPU's after each of its 4
    // calls: on the CPU stand-in nothing differs, so forcing is a no-op and no slot is swapped
    assert!(
        stdout.contains(
            "memory sets, offloaded vs CPU (forced after each call): 0 of 1080 differ (4 calls), \
             0 slots swapped, max score delta 0, near-tie bound held"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("Local slots equal, top-H rule held on both"),
        "{stdout}"
    );
    assert!(
        stdout.contains("next-token KL offloaded vs CPU: H2O unforced 0, H2O forced 0 (bound "),
        "{stdout}"
    );
    assert_eq!(stdout.matches("N <= S on ").count(), 2, "{stdout}");
}

/// The prefill speed harness for GPU machines (tests/cpp/bench-h2o-prefill.cpp), smoke-tested on the
/// CPU: one short length, one repetition; its JSON has one row with both medians positive, and bad
/// input exits with code 2.
#[test]
fn bench_h2o_prefill_runs_on_the_cpu() {
    let _engine = common::one_engine_at_a_time();
    let scratch = common::scratch("bench-h2o-prefill");
    let json = scratch.join("bench.json");
    let mut args: Vec<std::ffi::OsString> = vec![common::model_path().into()];
    args.extend(
        "-p 512 -r 1 -b 1024 -ub 256 --h2o-local 64 --h2o-heavy 64 -t 2 -ngl 0 --json"
            .split(' ')
            .map(Into::into),
    );
    args.push(json.clone().into());
    let stdout = run_cpp_program("bench-h2o-prefill", &args);
    assert!(stdout.contains("\n| 512 | "), "{stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["device"], "CPU", "{v}");
    assert_eq!(v["h2o_local"], 64, "{v}");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v}");
    assert_eq!(rows[0]["n"], 512, "{v}");
    for key in ["stock_median", "h2o_median", "ratio"] {
        assert!(rows[0][key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    assert_eq!(rows[0]["h2o_tps"].as_array().unwrap().len(), 1, "{v}");

    // bad input: exit code 2 with a message, no crash
    let model = common::model_path().display().to_string();
    for args in [
        vec!["/nonexistent/model.gguf".to_string()],
        vec![model.clone(), "-p".into(), "12x".into()],
        vec![model.clone(), "-p".into(), "100000000".into()],
    ] {
        let out = Command::new(cpp_program("bench-h2o-prefill"))
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(!out.stderr.is_empty(), "{args:?}");
    }
}
