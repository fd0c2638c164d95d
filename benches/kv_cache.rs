//! Seed 001's three benchmarks of the H2O state in `llama_kv_cache` (allocation time, memory-set
//! build per layer, score update per call), plus random score reads, for the default model's
//! shapes. Prints figures; asserts nothing (timings on shared machines are noisy).
//!
//! `cargo bench --bench kv_cache [-- KV_SIZE]` (KV_SIZE: cache cells, default 8192).

use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let Some(dir) = option_env!("H2O_LLAMA_CPP_TESTS_DIR") else {
        eprintln!("kv_cache bench: this build has no C++ test programs (the `stock` and `cuda` builds do not make them)");
        return ExitCode::FAILURE;
    };
    // cargo bench passes `--bench`; anything else that looks like a number is the cache size
    let kv_size = std::env::args()
        .skip(1)
        .find(|a| a.parse::<u32>().is_ok())
        .unwrap_or_else(|| "8192".into());
    let model = match h2o_llama::default_model::ensure(|m| eprintln!("{m}")) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kv_cache bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let exe = std::path::Path::new(dir).join("test-h2o-kv-cache");
    match Command::new(&exe)
        .arg(&model)
        .arg("--bench")
        .arg(&kv_size)
        .status()
    {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("kv_cache bench: {} exited with {s}", exe.display());
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("kv_cache bench: cannot run {}: {e}", exe.display());
            ExitCode::FAILURE
        }
    }
}
