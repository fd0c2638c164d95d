//! The build script: pristine llama.cpp (pinned in `vendor/pin`) + our patch series, compiled
//! into one static library, plus the FFI bindings. This file owns the order of the steps
//! (`main`) and `fail`; each step lives in its module:
//! 1. `source`: obtain the pristine tree with `cargo vendor` (checksum-pinned by
//!    `vendor/pin/Cargo.lock`) and copy it into `OUT_DIR`;
//! 2. `patches`: add the H2O source files of `engine/`, then apply the hooks of `patches/series`
//!    in order (the `stock` feature skips both); `version` writes the version headers upstream's
//!    CMake would generate;
//! 3. `cpu`: compile the CPU build with the system C/C++ compiler — no cmake needed — always
//!    optimised, from the units and flags of `engine`, through the content-addressed object cache
//!    of `objcache` shared by every profile and flavour; plus the C++ test programs of `tests/cpp`;
//! 4. `bindings`: provide the bindings: the committed file, checked against the headers it was
//!    made from, or freshly generated with bindgen (`generate-bindings` feature, needs libclang).
//!
//! The `cuda` feature builds with upstream's CMake instead (`cmake`; nvcc machines have it),
//! because ggml's CUDA backend is hundreds of template-instance translation units that CMake
//! already knows.

mod bindings;
mod cmake;
mod cpu;
mod engine;
mod objcache;
mod patches;
mod source;
mod version;

use std::env;
use std::path::PathBuf;

use bindings::provide_bindings;
use cmake::build_with_cmake;
use cpu::build_cpu;
use objcache::object_cache_dir;
use patches::{add_engine_files, apply_patches};
use source::{obtain_pristine, pinned_package, prepare_tree, sync_tree};
use version::write_version_headers;

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let stock = env::var_os("CARGO_FEATURE_STOCK").is_some();
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();

    for p in [
        "build",
        "vendor/pin/Cargo.toml",
        "vendor/pin/Cargo.lock",
        "engine",
        "patches",
        "src/sys",
        "tests/cpp",
    ] {
        println!("cargo:rerun-if-changed={}", manifest_dir.join(p).display());
    }
    for v in [
        "H2O_LLAMA_UPSTREAM_DIR",
        "H2O_LLAMA_OBJ_CACHE",
        "H2O_LLAMA_NATIVE",
        "H2O_LLAMA_MARCH",
        "H2O_LLAMA_CUDA_ARCHS",
        "CUDA_PATH",
        "H2O_LLAMA_SANITIZE",
        "H2O_LLAMA_DEBUG_ASSERTS",
        "CC",
        "CXX",
        "AR",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }

    let pristine = obtain_pristine(&manifest_dir, &out_dir);
    // the patched tree is made afresh beside the one the build reads, then synchronised into
    // it file by file (see sync_tree)
    let tree = out_dir.join("llama.cpp");
    let staging = out_dir.join("llama.cpp.next");
    prepare_tree(&pristine, &staging);
    if stock {
        println!(
            "cargo:warning=h2o-llama: `stock` feature: building pristine llama.cpp without patches"
        );
    } else {
        add_engine_files(&manifest_dir, &staging);
        apply_patches(&manifest_dir, &staging);
    }
    sync_tree(&staging, &tree);
    let _ = std::fs::remove_dir_all(&staging);
    let gen_dir = out_dir.join("gen");
    write_version_headers(&tree, &gen_dir);

    if cuda {
        build_with_cmake(&tree, &out_dir);
    } else {
        build_cpu(&tree, &gen_dir, &out_dir);
    }

    provide_bindings(&manifest_dir, &tree, &out_dir, stock);
    println!(
        "cargo:rustc-env=H2O_LLAMA_UPSTREAM_VERSION={}",
        pinned_package(&manifest_dir).0
    );
    // For the tests that check the series against the pristine tree and the built tree.
    println!(
        "cargo:rustc-env=H2O_LLAMA_PRISTINE_DIR={}",
        pristine.display()
    );
    println!("cargo:rustc-env=H2O_LLAMA_TREE_DIR={}", tree.display());
    println!(
        "cargo:rustc-env=H2O_LLAMA_OBJ_CACHE_DIR={}",
        object_cache_dir(&out_dir).display()
    );
}

fn fail(msg: impl AsRef<str>) -> ! {
    // A build-script panic prints this message in cargo's error output.
    panic!("\n\nh2o-llama build: {}\n\n", msg.as_ref());
}
