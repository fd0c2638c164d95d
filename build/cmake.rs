//! The `cuda` feature's build: upstream's CMake with ggml's CUDA backend (nvcc machines have
//! cmake), linked as upstream's static libraries plus the CUDA runtime.

use std::env;
use std::fs;
use std::path::Path;
use std::process::Command;

use crate::cpu::link_runtime;
use crate::engine::COMMON_SOURCES;
use crate::fail;

pub fn build_with_cmake(tree: &Path, out_dir: &Path) {
    let build = out_dir.join("cmake-build");
    fs::create_dir_all(&build).unwrap();
    let run = |cmd: &mut Command, what: &str| {
        let status = cmd.status().unwrap_or_else(|e| {
            fail(format!(
                "cannot run cmake for {what}: {e} (the `cuda` feature needs cmake and nvcc)"
            ))
        });
        if !status.success() {
            fail(format!("cmake {what} failed"));
        }
    };
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
    run(
        Command::new("cmake")
            .arg("-S")
            .arg(tree)
            .arg("-B")
            .arg(&build)
            .args([
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DGGML_CUDA=ON",
                "-DGGML_NATIVE=ON",
                "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_TOOLS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_COMMON=OFF",
                "-DLLAMA_CURL=OFF",
                "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
            ]),
        "configure",
    );
    run(
        Command::new("cmake")
            .arg("--build")
            .arg(&build)
            .args(["--config", "Release", "-j", &jobs]),
        "build",
    );
    for dir in ["src", "ggml/src", "ggml/src/ggml-cuda"] {
        println!(
            "cargo:rustc-link-search=native={}",
            build.join(dir).display()
        );
    }
    for lib in ["llama", "ggml", "ggml-cpu", "ggml-cuda", "ggml-base"] {
        println!("cargo:rustc-link-lib=static={lib}");
    }
    if env::var_os("CARGO_FEATURE_STOCK").is_none() {
        build_common(tree);
    }
    let cuda_root = env::var("CUDA_PATH").unwrap_or_else(|_| "/usr/local/cuda".into());
    println!("cargo:rustc-link-search=native={cuda_root}/lib64");
    println!("cargo:rustc-link-search=native={cuda_root}/lib64/stubs");
    for lib in ["cudart", "cublas", "cublasLt", "cuda"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    link_runtime(None);
}

/// The units of common/ that the server's schemas, chat templates and tool calls need (the CPU
/// build's "common" units, `engine::COMMON_SOURCES`), which upstream's CMake builds only with
/// all of common/.
fn build_common(tree: &Path) {
    let common = tree.join("common");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .opt_level(3)
        .files(COMMON_SOURCES.iter().map(|f| common.join(f)))
        .includes([
            common.clone(),
            tree.join("vendor"),
            tree.join("include"),
            tree.join("ggml/include"),
        ])
        .define("LLAMA_COMMON_STANDALONE", None)
        .define("NDEBUG", None)
        .warnings(false)
        .compile("h2o_llama_common");
}
