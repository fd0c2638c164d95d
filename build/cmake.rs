//! The `cuda` feature's build: upstream's CMake with ggml's CUDA backend (nvcc machines have
//! cmake), linked as upstream's static libraries plus the CUDA runtime.
//!
//! By default it builds for the GPU and CPU of this machine. A machine without a GPU can build
//! for one that has it (a GPU machine without Rust): `H2O_LLAMA_CUDA_ARCHS` names the GPUs
//! (`90-real`: H100/H200 machine code) and `H2O_LLAMA_MARCH` the CPU (`x86-64-v3`), as for the
//! CPU build; `CUDA_PATH` is the toolkit (`scripts/cuda-cross-build.sh` does all three). The
//! CUDA runtime is linked statically, so the program needs only the driver and cuBLAS there.

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
    let cuda_root = env::var("CUDA_PATH").unwrap_or_else(|_| "/usr/local/cuda".into());
    let mut target = Vec::new();
    match env::var("H2O_LLAMA_MARCH").ok().filter(|m| !m.is_empty()) {
        Some(march) => target.extend([
            "-DGGML_NATIVE=OFF".to_string(),
            format!("-DCMAKE_C_FLAGS=-march={march}"),
            format!("-DCMAKE_CXX_FLAGS=-march={march}"),
        ]),
        None => target.push("-DGGML_NATIVE=ON".into()),
    }
    if let Some(archs) = env::var("H2O_LLAMA_CUDA_ARCHS")
        .ok()
        .filter(|a| !a.is_empty())
    {
        target.push(format!("-DCMAKE_CUDA_ARCHITECTURES={archs}"));
    }
    if env::var_os("CUDA_PATH").is_some() {
        target.push(format!("-DCUDAToolkit_ROOT={cuda_root}"));
        target.push(format!("-DCMAKE_CUDA_COMPILER={cuda_root}/bin/nvcc"));
    }
    run(
        Command::new("cmake")
            .arg("-S")
            .arg(tree)
            .arg("-B")
            .arg(&build)
            .args(&target)
            .args([
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DGGML_CUDA=ON",
                // layers on other machines (`--rpc`), over TCP only (RDMA would need its
                // library linked here too)
                "-DGGML_RPC=ON",
                "-DGGML_RPC_RDMA=OFF",
                "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF",
                "-DGGML_AMX_BF16=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_TOOLS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                // the pinned tree has no app/ (upstream's CMake adds it unconditionally)
                "-DLLAMA_BUILD_APP=OFF",
                // one GPU; NCCL, found where it is installed, would need linking here too
                "-DGGML_CUDA_NCCL=OFF",
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
    for dir in ["src", "ggml/src", "ggml/src/ggml-cuda", "ggml/src/ggml-rpc"] {
        println!(
            "cargo:rustc-link-search=native={}",
            build.join(dir).display()
        );
    }
    for lib in [
        "llama",
        "ggml",
        "ggml-cpu",
        "ggml-cuda",
        "ggml-rpc",
        "ggml-base",
    ] {
        println!("cargo:rustc-link-lib=static={lib}");
    }
    if env::var_os("CARGO_FEATURE_STOCK").is_none() {
        build_common(tree);
    }
    for dir in ["lib64", "lib64/stubs", "lib", "lib/stubs"] {
        println!("cargo:rustc-link-search=native={cuda_root}/{dir}");
    }
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["cublas", "cublasLt", "cuda", "rt", "dl"] {
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
