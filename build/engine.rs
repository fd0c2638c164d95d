//! The engine's translation units and compiler flags, following upstream's CMake lists
//! (ggml/src/CMakeLists.txt, ggml-cpu/CMakeLists.txt, src/CMakeLists.txt): the table of sources
//! in `UNITS`, the unity batches of the model builders, and the flags (native code, AMX off,
//! sanitizers, defines, include paths). What they compile into is `cpu`'s business.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use crate::fail;
use crate::version::write_if_changed;

pub struct Unit {
    /// File handed to the compiler.
    pub source: PathBuf,
    /// Extra files whose content the object depends on (the members of a unity file).
    pub members: Vec<PathBuf>,
    pub cpp: bool,
    /// Which header set (by name in `header_digests`) the object depends on.
    pub headers: &'static str,
}

/// Which sources of a directory a row of `UNITS` compiles.
enum Sources {
    /// These files, in this order.
    Listed(&'static [&'static str]),
    /// Every `.cpp` file of the directory, sorted by name.
    AllCpp,
    /// Every `.cpp` file of the directory, sorted, compiled in unity batches of this size.
    Unity(usize),
    /// Every `.cpp` file that `engine/` adds to the directory, sorted by name: an engine file
    /// is compiled by being there, with no list to keep.
    Engine,
}

/// One row of `UNITS`.
struct Group {
    /// The directory, relative to the tree.
    dir: &'static str,
    /// The target architectures the row is for (empty: all).
    arch: &'static [&'static str],
    sources: Sources,
    /// Which header set (by name in `header_digests`) the objects depend on.
    headers: &'static str,
    /// Only in the patched tree (a file a patch adds): left out of the `stock` build.
    patched_only: bool,
}

/// The units of common/ that llama-server's JSON schema conversion and chat templates need: the
/// converter, the Jinja engine, the chat templates with their tool call parsers, their JSON
/// library and logging, the C entry points (engine/common/*-c.cpp), and the helpers of
/// common.cpp they use (engine/common/common-standalone.cpp), in place of common.cpp itself.
pub const COMMON_SOURCES: &[&str] = &[
    "json.cpp",
    "json-schema.cpp",
    "json-schema-to-grammar.cpp",
    "json-schema-to-grammar-c.cpp",
    "trie.cpp",
    "unicode.cpp",
    "log.cpp",
    "common-standalone.cpp",
    "peg-parser.cpp",
    "chat.cpp",
    "chat-c.cpp",
    "chat-auto-parser-generator.cpp",
    "chat-auto-parser-helpers.cpp",
    "chat-diff-analyzer.cpp",
    "chat-peg-parser.cpp",
    "jinja/caps.cpp",
    "jinja/lexer.cpp",
    "jinja/parser.cpp",
    "jinja/runtime.cpp",
    "jinja/string.cpp",
    "jinja/value.cpp",
    "parsers/parsers.cpp",
    "parsers/cohere2moe.cpp",
    "parsers/deepseek.cpp",
    "parsers/functionary-v3-2.cpp",
    "parsers/gemma4.cpp",
    "parsers/gigachat-v3.cpp",
    "parsers/gpt-oss.cpp",
    "parsers/kimi-k2.cpp",
    "parsers/kimi-k3.cpp",
    "parsers/lfm2.cpp",
    "parsers/ling3.cpp",
    "parsers/llm-jp-harmony.cpp",
    "parsers/minicpm5.cpp",
    "parsers/minimax-m3.cpp",
    "parsers/ministral3.cpp",
    "parsers/muse-glimmer.cpp",
    "parsers/qwen3-coder.cpp",
];

/// The engine's translation units, in compile (and archive) order.
const UNITS: &[Group] = &[
    // ggml/src/CMakeLists.txt: ggml-base and ggml
    Group {
        dir: "ggml/src",
        arch: &[],
        sources: Sources::Listed(&[
            "ggml.c",
            "ggml.cpp",
            "ggml-alloc.c",
            "ggml-backend.cpp",
            "ggml-backend-meta.cpp",
            "ggml-opt.cpp",
            "ggml-threading.cpp",
            "ggml-quants.c",
            "gguf.cpp",
            "ggml-backend-dl.cpp",
            "ggml-backend-reg.cpp",
        ]),
        headers: "ggml",
        patched_only: false,
    },
    // ggml/src/ggml-rpc/CMakeLists.txt (TCP only): layers on other machines' ggml backends
    // (`--rpc`), and the server side of h2o-rpc-server
    Group {
        dir: "ggml/src/ggml-rpc",
        arch: &[],
        sources: Sources::Listed(&["ggml-rpc.cpp", "transport.cpp"]),
        headers: "ggml",
        patched_only: false,
    },
    // ggml/src/ggml-cpu/CMakeLists.txt
    Group {
        dir: "ggml/src/ggml-cpu",
        arch: &[],
        sources: Sources::Listed(&[
            "ggml-cpu.c",
            "ggml-cpu.cpp",
            "repack.cpp",
            "hbm.cpp",
            "quants.c",
            "traits.cpp",
            "amx/amx.cpp",
            "amx/mmq.cpp",
            "tiled/tiled.cpp",
            "tiled/tiled-kernel.cpp",
            "binary-ops.cpp",
            "unary-ops.cpp",
            "vec.cpp",
            "ops.cpp",
            "llamafile/sgemm.cpp",
        ]),
        headers: "ggml",
        patched_only: false,
    },
    // the H2O units (engine/): the seed rule's memory set in ggml-base, the ops' CPU kernels
    Group {
        dir: "ggml/src",
        arch: &[],
        sources: Sources::Engine,
        headers: "ggml",
        patched_only: true,
    },
    Group {
        dir: "ggml/src/ggml-cpu",
        arch: &[],
        sources: Sources::Engine,
        headers: "ggml",
        patched_only: true,
    },
    // ggml-cpu's architecture-specific kernels
    Group {
        dir: "ggml/src/ggml-cpu",
        arch: &["x86_64", "x86"],
        sources: Sources::Listed(&["arch/x86/quants.c", "arch/x86/repack.cpp"]),
        headers: "ggml",
        patched_only: false,
    },
    Group {
        dir: "ggml/src/ggml-cpu",
        arch: &["aarch64", "arm"],
        sources: Sources::Listed(&["arch/arm/quants.c", "arch/arm/repack.cpp"]),
        headers: "ggml",
        patched_only: false,
    },
    // src/CMakeLists.txt: llama
    Group {
        dir: "src",
        arch: &[],
        sources: Sources::AllCpp,
        headers: "llama",
        patched_only: false,
    },
    // Model builders: unity batches of 16, as upstream's CMake does (UNITY_BUILD_BATCH_SIZE 16);
    // compiling 150+ small files one by one costs minutes of header parsing.
    Group {
        dir: "src/models",
        arch: &[],
        sources: Sources::Unity(16),
        headers: "llama",
        patched_only: false,
    },
    // common/: only what the server's json_schema, response_format, Jinja chat templates and
    // tool calls need (`COMMON_SOURCES`); the rest of common/ (sampling, speculative decoding,
    // argument parsing, downloads) is not linked.
    Group {
        dir: "common",
        arch: &[],
        sources: Sources::Listed(COMMON_SOURCES),
        headers: "common",
        patched_only: true,
    },
];

pub fn sorted_files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| fail(format!("read {}: {e}", dir.display())))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    v.sort();
    v
}

/// The translation units of `UNITS` for `target_arch`; unity files are written to
/// `<out_dir>/unity`.
pub fn units(tree: &Path, out_dir: &Path, target_arch: &str) -> Vec<Unit> {
    let mut units: Vec<Unit> = Vec::new();
    let stock = env::var_os("CARGO_FEATURE_STOCK").is_some();
    for g in UNITS {
        if !g.arch.is_empty() && !g.arch.contains(&target_arch) || g.patched_only && stock {
            continue;
        }
        let dir = tree.join(g.dir);
        match g.sources {
            Sources::Listed(files) => {
                units.extend(files.iter().map(|f| unit(dir.join(f), g.headers)));
            }
            Sources::AllCpp => {
                units.extend(
                    sorted_files(&dir, "cpp")
                        .into_iter()
                        .map(|f| unit(f, g.headers)),
                );
            }
            Sources::Unity(batch) => units.extend(unity_units(&dir, batch, g.headers, out_dir)),
            Sources::Engine => {
                let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
                let engine_dir = manifest_dir.join("engine").join(g.dir);
                units.extend(sorted_files(&engine_dir, "cpp").into_iter().map(|f| {
                    let name = f.file_name().expect("a file");
                    unit(dir.join(name), g.headers)
                }));
            }
        }
    }
    units
}

fn unit(path: PathBuf, headers: &'static str) -> Unit {
    let cpp = path.extension().is_some_and(|x| x == "cpp");
    Unit {
        source: path,
        members: vec![],
        cpp,
        headers,
    }
}

/// The sorted `.cpp` files of `dir` in batches of `batch`, each batch one unity file that
/// `#include`s its members.
fn unity_units(dir: &Path, batch: usize, headers: &'static str, out_dir: &Path) -> Vec<Unit> {
    let models = sorted_files(dir, "cpp");
    let unity_dir = out_dir.join("unity");
    fs::create_dir_all(&unity_dir).unwrap();
    let mut units = Vec::new();
    for (i, batch) in models.chunks(batch).enumerate() {
        let path = unity_dir.join(format!("models_{i:02}.cpp"));
        let mut text = String::new();
        for m in batch {
            writeln!(text, "#include \"{}\"", m.display()).unwrap();
        }
        write_if_changed(&path, &text);
        units.push(Unit {
            source: path,
            members: batch.to_vec(),
            cpp: true,
            headers,
        });
    }
    units
}

/// The engine's compiler flags.
pub struct Flags {
    pub c: Vec<String>,
    pub cxx: Vec<String>,
    /// `cxx` for the units of common/ (header set "common"): its own and the vendored headers,
    /// and the converter built without common.cpp. Kept apart so that the engine's other
    /// objects keep their flags, and so their cached builds.
    pub cxx_common: Vec<String>,
    /// `H2O_LLAMA_SANITIZE`: the `-fsanitize=` list, also needed when linking.
    pub sanitize: Option<String>,
}

pub fn flags(tree: &Path, gen_dir: &Path, target_arch: &str) -> Flags {
    let sanitize = env::var("H2O_LLAMA_SANITIZE")
        .ok()
        .filter(|s| !s.is_empty());
    let common = common_flags(tree, gen_dir, target_arch, sanitize.as_deref());
    let c_flags: Vec<String> = ["-std=gnu11".to_string()]
        .into_iter()
        .chain(common.iter().cloned())
        .collect();
    let cxx_flags: Vec<String> = ["-std=gnu++17".to_string()]
        .into_iter()
        .chain(common.iter().cloned())
        .collect();
    // common/'s own directory comes first: its jinja/ sources include common/unicode.h as
    // "unicode.h", which src/ (llama's internals) also has
    let cxx_common: Vec<String> = ["-std=gnu++17".to_string()]
        .into_iter()
        .chain([
            format!("-I{}", tree.join("common").display()),
            format!("-I{}", tree.join("vendor").display()),
            // common.cpp is not linked: common-standalone.cpp brings the helpers of it that the
            // C entry points and their sources use
            "-DLLAMA_COMMON_STANDALONE".to_string(),
        ])
        .chain(common.iter().cloned())
        .collect();
    Flags {
        c: c_flags,
        cxx: cxx_flags,
        cxx_common,
        sanitize,
    }
}

/// The flags C and C++ share, in this order: optimisation and threads, target CPU, sanitizers,
/// defines, include paths.
fn common_flags(
    tree: &Path,
    gen_dir: &Path,
    target_arch: &str,
    sanitize: Option<&str>,
) -> Vec<String> {
    let ggml_src = tree.join("ggml/src");
    let cpu_src = ggml_src.join("ggml-cpu");
    let llama_src = tree.join("src");
    let native = env::var("H2O_LLAMA_NATIVE")
        .map(|v| v != "0")
        .unwrap_or(true);
    // a CPU to build for other than this one (`x86-64-v3`: AVX2 machines), so that a build here
    // runs there and the vector paths of another CPU can be tested here
    let march = env::var("H2O_LLAMA_MARCH").ok().filter(|m| !m.is_empty());
    let debug_asserts = env::var("H2O_LLAMA_DEBUG_ASSERTS").is_ok_and(|v| v != "0");
    let mut common: Vec<String> = vec![
        "-O3".into(),
        "-fPIC".into(),
        "-fopenmp".into(),
        "-pthread".into(),
    ];
    if matches!(target_arch, "x86_64" | "x86") {
        if let Some(m) = &march {
            common.push(format!("-march={m}"));
        } else if native {
            common.push("-march=native".into());
        }
        // AMX is advertised by some VMs whose hypervisor faults on its instructions (SIGILL in
        // ggml's AMX matmul); the gain for this workload is small, so never emit it.
        common.extend(["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"].map(String::from));
    } else if let Some(m) = &march {
        common.push(format!("-mcpu={m}"));
    } else if native {
        common.push("-mcpu=native".into());
    }
    if let Some(s) = sanitize {
        common.push(format!("-fsanitize={s}"));
        common.push("-fno-omit-frame-pointer".into());
        common.push("-g".into());
    }
    for d in [
        "GGML_USE_CPU",
        "GGML_USE_CPU_REPACK",
        "GGML_USE_LLAMAFILE",
        "GGML_USE_OPENMP",
        "GGML_USE_RPC",
        "GGML_SCHED_MAX_COPIES=4",
        "_GNU_SOURCE",
        "_XOPEN_SOURCE=600",
    ] {
        common.push(format!("-D{d}"));
    }
    if !debug_asserts {
        common.push("-DNDEBUG".into());
    }
    for inc in [
        tree.join("ggml/include"),
        ggml_src,
        cpu_src,
        tree.join("include"),
        llama_src,
        gen_dir.to_path_buf(),
    ] {
        common.push(format!("-I{}", inc.display()));
    }
    common
}
