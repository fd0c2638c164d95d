//! Builds the engine: pristine llama.cpp (pinned in `vendor/pin`) + our patch series, compiled
//! into one static library, plus the FFI bindings.
//!
//! Steps, each explained where it happens:
//! 1. obtain the pristine tree with `cargo vendor` (checksum-pinned by `vendor/pin/Cargo.lock`);
//! 2. copy it into `OUT_DIR` and apply `patches/series` in order (the `stock` feature skips this);
//! 3. compile the CPU build with the system C/C++ compiler — no cmake needed — always optimised,
//!    through a content-addressed object cache shared by every profile and flavour;
//! 4. provide the bindings: the committed file, checked against the headers it was made from,
//!    or freshly generated with bindgen (`generate-bindings` feature, needs libclang).
//!
//! The `cuda` feature builds with upstream's CMake instead (nvcc machines have it), because ggml's
//! CUDA backend is hundreds of template-instance translation units that CMake already knows.

use std::collections::BTreeMap;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

const UPSTREAM_CRATE: &str = "llama-cpp-sys-2";

/// Headers whose content the committed bindings were generated from (relative to the tree).
const BINDING_HEADERS: &[&str] = &[
    "include/llama.h",
    "ggml/include/ggml.h",
    "ggml/include/ggml-backend.h",
    "ggml/include/ggml-cpu.h",
    "ggml/include/ggml-opt.h",
    "ggml/include/ggml-alloc.h",
];

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let stock = env::var_os("CARGO_FEATURE_STOCK").is_some();
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();

    for p in [
        "build.rs",
        "vendor/pin/Cargo.toml",
        "vendor/pin/Cargo.lock",
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
        "H2O_LLAMA_SANITIZE",
        "H2O_LLAMA_DEBUG_ASSERTS",
        "CC",
        "CXX",
        "AR",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }

    let pristine = obtain_pristine(&manifest_dir, &out_dir);
    let tree = out_dir.join("llama.cpp");
    prepare_tree(&pristine, &tree);
    if stock {
        println!(
            "cargo:warning=h2o-llama: `stock` feature: building pristine llama.cpp without patches"
        );
    } else {
        apply_patches(&manifest_dir, &tree);
    }
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

// ---------------------------------------------------------------------------------------------
// 1. pristine source
// ---------------------------------------------------------------------------------------------

/// (version, sha256) of the upstream crate as pinned in vendor/pin/Cargo.lock.
fn pinned_package(manifest_dir: &Path) -> (String, String) {
    let lock = fs::read_to_string(manifest_dir.join("vendor/pin/Cargo.lock"))
        .unwrap_or_else(|e| fail(format!("cannot read vendor/pin/Cargo.lock: {e}")));
    for block in lock.split("[[package]]") {
        let field = |k: &str| {
            block.lines().find_map(|l| {
                let l = l.trim();
                l.strip_prefix(k)
                    .and_then(|r| r.trim_start().strip_prefix('='))
                    .map(|r| r.trim().trim_matches('"').to_string())
            })
        };
        if field("name").as_deref() == Some(UPSTREAM_CRATE) {
            let version =
                field("version").unwrap_or_else(|| fail("pinned upstream has no version"));
            let checksum =
                field("checksum").unwrap_or_else(|| fail("pinned upstream has no checksum"));
            return (version, checksum);
        }
    }
    fail(format!(
        "vendor/pin/Cargo.lock does not pin {UPSTREAM_CRATE}"
    ))
}

/// Returns the pristine `llama.cpp/` directory of the pinned crate.
fn obtain_pristine(manifest_dir: &Path, out_dir: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("H2O_LLAMA_UPSTREAM_DIR") {
        let dir = PathBuf::from(dir);
        if !dir.join("include/llama.h").is_file() {
            fail(format!(
                "H2O_LLAMA_UPSTREAM_DIR={} is not a llama.cpp tree (no include/llama.h)",
                dir.display()
            ));
        }
        println!(
            "cargo:warning=h2o-llama: using H2O_LLAMA_UPSTREAM_DIR={} (checksum not verified)",
            dir.display()
        );
        return dir;
    }

    let (version, checksum) = pinned_package(manifest_dir);
    let vendor_dir = out_dir.join("upstream");
    let crate_dir = vendor_dir.join(format!("{UPSTREAM_CRATE}-{version}"));
    let verified = |dir: &Path| -> Result<(), String> {
        let json =
            fs::read_to_string(dir.join(".cargo-checksum.json")).map_err(|e| e.to_string())?;
        let found = json
            .split("\"package\":\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .ok_or("no package checksum recorded")?;
        if found != checksum {
            return Err(format!("checksum {found}, pinned {checksum}"));
        }
        Ok(())
    };

    if verified(&crate_dir).is_err() {
        let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let _ = fs::remove_dir_all(&vendor_dir);
        // `--locked` makes cargo verify the downloaded crate against Cargo.lock's checksum.
        let output = Command::new(&cargo)
            .args([
                "vendor",
                "--locked",
                "--versioned-dirs",
                "--quiet",
                "--manifest-path",
            ])
            .arg(manifest_dir.join("vendor/pin/Cargo.toml"))
            .arg(&vendor_dir)
            .env_remove("CARGO_TARGET_DIR")
            .output()
            .unwrap_or_else(|e| fail(format!("cannot run `{cargo} vendor`: {e}")));
        if !output.status.success() {
            fail(format!(
                "`cargo vendor` of the pinned {UPSTREAM_CRATE} {version} failed (network needed on the first build; \
                 or set H2O_LLAMA_UPSTREAM_DIR to a pristine llama.cpp tree):\n{}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        if let Err(e) = verified(&crate_dir) {
            fail(format!(
                "vendored {UPSTREAM_CRATE} {version} does not match the pin: {e}"
            ));
        }
    }
    let dir = crate_dir.join("llama.cpp");
    if !dir.join("include/llama.h").is_file() {
        fail(format!(
            "{} has no llama.cpp/include/llama.h",
            crate_dir.display()
        ));
    }
    dir
}

// ---------------------------------------------------------------------------------------------
// 2. patched copy
// ---------------------------------------------------------------------------------------------

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap_or_else(|e| fail(format!("mkdir {}: {e}", to.display())));
    for entry in
        fs::read_dir(from).unwrap_or_else(|e| fail(format!("read {}: {e}", from.display())))
    {
        let entry = entry.unwrap();
        let ty = entry.file_type().unwrap();
        let dst = to.join(entry.file_name());
        if ty.is_dir() {
            copy_dir(&entry.path(), &dst);
        } else if ty.is_file() {
            fs::copy(entry.path(), &dst)
                .unwrap_or_else(|e| fail(format!("copy {}: {e}", dst.display())));
        }
    }
}

fn prepare_tree(pristine: &Path, tree: &Path) {
    if tree.exists() {
        fs::remove_dir_all(tree)
            .unwrap_or_else(|e| fail(format!("cannot clear {}: {e}", tree.display())));
    }
    copy_dir(pristine, tree);
}

/// The ordered patch list from patches/series (blank lines and `#` comments ignored).
fn patch_series(manifest_dir: &Path) -> Vec<String> {
    let series = fs::read_to_string(manifest_dir.join("patches/series"))
        .unwrap_or_else(|e| fail(format!("cannot read patches/series: {e}")));
    series
        .lines()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

fn apply_patches(manifest_dir: &Path, tree: &Path) {
    for name in patch_series(manifest_dir) {
        let patch = manifest_dir.join("patches").join(&name);
        println!("cargo:rerun-if-changed={}", patch.display());
        if !patch.is_file() {
            fail(format!("patches/series names {name}, which does not exist"));
        }
        // GIT_CEILING_DIRECTORIES keeps git from discovering an enclosing repository (OUT_DIR is
        // usually inside ours), which would make `git apply` resolve paths against that repo.
        let output = Command::new("git")
            .args(["apply", "--whitespace=nowarn", "-p1"])
            .arg(&patch)
            .current_dir(tree)
            .env("GIT_CEILING_DIRECTORIES", tree.parent().unwrap())
            .output()
            .unwrap_or_else(|e| fail(format!("cannot run git to apply patches: {e}")));
        if !output.status.success() {
            fail(format!(
                "patch {name} does not apply to the pinned llama.cpp:\n{}\n\
                 Rebase it with `scripts/patches.sh apply <dir>`, fix, then `scripts/patches.sh regenerate <dir>`.",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
}

fn cmake_var(file: &Path, name: &str) -> String {
    let text = fs::read_to_string(file).unwrap_or_default();
    let key = format!("set({name} ");
    text.lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix(&key)
                .map(|r| r.trim_end_matches(')').trim().to_string())
        })
        .unwrap_or_else(|| "0".into())
}

fn write_version_headers(tree: &Path, gen_dir: &Path) {
    fs::create_dir_all(gen_dir).unwrap();
    let llama = tree.join("CMakeLists.txt");
    let ggml = tree.join("ggml/CMakeLists.txt");
    let llama_version = format!(
        "{}.{}.{}",
        cmake_var(&llama, "LLAMA_VERSION_MAJOR"),
        cmake_var(&llama, "LLAMA_VERSION_MINOR"),
        cmake_var(&llama, "LLAMA_VERSION_PATCH")
    );
    let ggml_version = format!(
        "{}.{}.{}",
        cmake_var(&ggml, "GGML_VERSION_MAJOR"),
        cmake_var(&ggml, "GGML_VERSION_MINOR"),
        cmake_var(&ggml, "GGML_VERSION_PATCH")
    );
    let commit = "h2o-llama";
    write_if_changed(
        &gen_dir.join("llama-version.h"),
        &format!("#pragma once\n\n#define LLAMA_VERSION \"{llama_version}\"\n#define LLAMA_COMMIT  \"{commit}\"\n"),
    );
    write_if_changed(
        &gen_dir.join("ggml-version.h"),
        &format!("#pragma once\n\n#define GGML_VERSION \"{ggml_version}\"\n#define GGML_COMMIT  \"{commit}\"\n"),
    );
}

fn write_if_changed(path: &Path, content: &str) {
    if fs::read_to_string(path).ok().as_deref() != Some(content) {
        fs::write(path, content).unwrap_or_else(|e| fail(format!("write {}: {e}", path.display())));
    }
}

// ---------------------------------------------------------------------------------------------
// 3. CPU build without cmake
// ---------------------------------------------------------------------------------------------

struct Unit {
    /// File handed to the compiler.
    source: PathBuf,
    /// Extra files whose content the object depends on (the members of a unity file).
    members: Vec<PathBuf>,
    cpp: bool,
    /// Which header set (by name in `header_digests`) the object depends on.
    headers: &'static str,
}

fn sorted_files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| fail(format!("read {}: {e}", dir.display())))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    v.sort();
    v
}

/// Hashes the names (relative to `root`, so that every OUT_DIR agrees) and contents of the
/// headers in `dirs`.
fn digest_headers(root: &Path, dirs: &[PathBuf], recursive: bool, hasher: &mut Sha256) {
    for dir in dirs {
        let mut entries: Vec<PathBuf> = match fs::read_dir(dir) {
            Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
            Err(_) => continue,
        };
        entries.sort();
        for p in entries {
            if p.is_dir() {
                if recursive {
                    digest_headers(root, &[p], true, hasher);
                }
            } else if p
                .extension()
                .is_some_and(|x| x == "h" || x == "hpp" || x == "inc")
            {
                hasher.update(
                    p.strip_prefix(root)
                        .unwrap_or(&p)
                        .to_string_lossy()
                        .as_bytes(),
                );
                hasher.update(fs::read(&p).unwrap());
            }
        }
    }
}

/// Locates the object cache: `<target dir>/h2o-llama-objcache`, shared by debug, release and
/// the `stock` flavour so that only translation units whose inputs differ are compiled twice.
fn object_cache_dir(out_dir: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("H2O_LLAMA_OBJ_CACHE") {
        return PathBuf::from(dir);
    }
    // OUT_DIR = <target>/[<triple>/]<profile>/build/<pkg>-<hash>/out
    let build = out_dir
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "build"));
    match build.and_then(|b| b.parent()).and_then(|p| p.parent()) {
        Some(target) => target.join("h2o-llama-objcache"),
        None => out_dir.join("objcache"),
    }
}

fn compiler_identity(compiler: &Path) -> String {
    Command::new(compiler)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

fn build_cpu(tree: &Path, gen_dir: &Path, out_dir: &Path) {
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let ggml_src = tree.join("ggml/src");
    let cpu_src = ggml_src.join("ggml-cpu");
    let llama_src = tree.join("src");

    // ---- translation units, following ggml/src/CMakeLists.txt, ggml-cpu/CMakeLists.txt, src/CMakeLists.txt
    let mut units: Vec<Unit> = Vec::new();
    let mut add = |path: PathBuf, headers: &'static str| {
        let cpp = path.extension().is_some_and(|x| x == "cpp");
        units.push(Unit {
            source: path,
            members: vec![],
            cpp,
            headers,
        });
    };
    for f in [
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
    ] {
        add(ggml_src.join(f), "ggml");
    }
    for f in [
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
    ] {
        add(cpu_src.join(f), "ggml");
    }
    match target_arch.as_str() {
        "x86_64" | "x86" => {
            add(cpu_src.join("arch/x86/quants.c"), "ggml");
            add(cpu_src.join("arch/x86/repack.cpp"), "ggml");
        }
        "aarch64" | "arm" => {
            add(cpu_src.join("arch/arm/quants.c"), "ggml");
            add(cpu_src.join("arch/arm/repack.cpp"), "ggml");
        }
        _ => {}
    }
    for f in sorted_files(&llama_src, "cpp") {
        add(f, "llama");
    }
    // Model builders: unity batches of 16, as upstream's CMake does (UNITY_BUILD_BATCH_SIZE 16);
    // compiling 150+ small files one by one costs minutes of header parsing.
    let models = sorted_files(&llama_src.join("models"), "cpp");
    let unity_dir = out_dir.join("unity");
    fs::create_dir_all(&unity_dir).unwrap();
    for (i, batch) in models.chunks(16).enumerate() {
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
            headers: "llama",
        });
    }

    // ---- flags
    let native = env::var("H2O_LLAMA_NATIVE")
        .map(|v| v != "0")
        .unwrap_or(true);
    let debug_asserts = env::var("H2O_LLAMA_DEBUG_ASSERTS").is_ok_and(|v| v != "0");
    let sanitize = env::var("H2O_LLAMA_SANITIZE")
        .ok()
        .filter(|s| !s.is_empty());
    let mut common: Vec<String> = vec![
        "-O3".into(),
        "-fPIC".into(),
        "-fopenmp".into(),
        "-pthread".into(),
    ];
    if matches!(target_arch.as_str(), "x86_64" | "x86") {
        if native {
            common.push("-march=native".into());
        }
        // AMX is advertised by some VMs whose hypervisor faults on its instructions (SIGILL in
        // ggml's AMX matmul); the gain for this workload is small, so never emit it.
        common.extend(["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"].map(String::from));
    } else if native {
        common.push("-mcpu=native".into());
    }
    if let Some(s) = &sanitize {
        common.push(format!("-fsanitize={s}"));
        common.push("-fno-omit-frame-pointer".into());
        common.push("-g".into());
    }
    for d in [
        "GGML_USE_CPU",
        "GGML_USE_CPU_REPACK",
        "GGML_USE_LLAMAFILE",
        "GGML_USE_OPENMP",
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
        ggml_src.clone(),
        cpu_src.clone(),
        tree.join("include"),
        llama_src.clone(),
        gen_dir.to_path_buf(),
    ] {
        common.push(format!("-I{}", inc.display()));
    }

    let c_compiler = cc::Build::new().get_compiler().path().to_path_buf();
    let cxx_compiler = cc::Build::new()
        .cpp(true)
        .get_compiler()
        .path()
        .to_path_buf();
    let c_flags: Vec<String> = ["-std=gnu11".to_string()]
        .into_iter()
        .chain(common.iter().cloned())
        .collect();
    let cxx_flags: Vec<String> = ["-std=gnu++17".to_string()]
        .into_iter()
        .chain(common.iter().cloned())
        .collect();

    let mut header_digests: BTreeMap<&str, Vec<u8>> = BTreeMap::new();
    let mut h = Sha256::new();
    digest_headers(
        tree,
        &[tree.join("ggml/include"), ggml_src.clone()],
        false,
        &mut h,
    );
    digest_headers(tree, std::slice::from_ref(&cpu_src), true, &mut h);
    digest_headers(gen_dir, &[gen_dir.to_path_buf()], false, &mut h);
    let ggml_digest = h.clone().finalize().to_vec();
    digest_headers(
        tree,
        &[tree.join("include"), llama_src.clone()],
        true,
        &mut h,
    );
    header_digests.insert("ggml", ggml_digest);
    header_digests.insert("llama", h.finalize().to_vec());

    let cache = object_cache_dir(out_dir);
    fs::create_dir_all(&cache).unwrap_or_else(|e| fail(format!("mkdir {}: {e}", cache.display())));
    let c_id = compiler_identity(&c_compiler);
    let cxx_id = compiler_identity(&cxx_compiler);

    // ---- compile in parallel (cargo's NUM_JOBS), reusing cached objects
    let jobs: usize = env::var("NUM_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2)
        .max(1);
    let next = AtomicUsize::new(0);
    let objects: Mutex<Vec<(usize, PathBuf)>> = Mutex::new(Vec::new());
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let compiled = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= units.len() || !errors.lock().unwrap().is_empty() {
                    break;
                }
                let u = &units[i];
                let (compiler, flags, id) = if u.cpp {
                    (&cxx_compiler, &cxx_flags, &cxx_id)
                } else {
                    (&c_compiler, &c_flags, &c_id)
                };
                let rel = u.source.strip_prefix(tree).unwrap_or(&u.source);
                let rel = if rel.starts_with(out_dir) {
                    Path::new(rel.file_name().unwrap())
                } else {
                    rel
                };
                let job = CompileJob {
                    compiler,
                    compiler_id: id,
                    flags,
                    header_digest: &header_digests[u.headers],
                    key_name: &rel.to_string_lossy(),
                    source: &u.source,
                    members: &u.members,
                    tree,
                };
                let obj = match compile_cached(&job, &cache) {
                    Ok((obj, fresh)) => {
                        if fresh {
                            compiled.fetch_add(1, Ordering::SeqCst);
                        }
                        obj
                    }
                    Err(e) => {
                        errors.lock().unwrap().push(e);
                        continue;
                    }
                };
                objects.lock().unwrap().push((i, obj));
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    if !errors.is_empty() {
        fail(errors.join("\n"));
    }
    let mut objects = objects.into_inner().unwrap();
    objects.sort();

    // ---- archive
    let lib = out_dir.join("libh2o_llama_engine.a");
    let _ = fs::remove_file(&lib);
    let ar = env::var("AR").unwrap_or_else(|_| "ar".into());
    let status = Command::new(&ar)
        .arg("crs")
        .arg(&lib)
        .args(objects.iter().map(|(_, o)| o))
        .status()
        .unwrap_or_else(|e| fail(format!("cannot run {ar}: {e}")));
    if !status.success() {
        fail(format!("{ar} failed to create {}", lib.display()));
    }
    let mut log = fs::File::create(out_dir.join("engine-build.txt")).unwrap();
    writeln!(
        log,
        "units {} compiled {} cache {}",
        units.len(),
        compiled.load(Ordering::SeqCst),
        cache.display()
    )
    .unwrap();
    writeln!(
        log,
        "c++ {} {}",
        cxx_compiler.display(),
        cxx_flags.join(" ")
    )
    .unwrap();

    // ---- C++ test programs (tests/cpp/*.cpp): they use the patched tree's internal headers, so
    // they are built here, with the engine's flags, and run by the Rust tests and benches
    let test_sources = env::var("CARGO_MANIFEST_DIR")
        .map(|d| Path::new(&d).join("tests/cpp"))
        .ok()
        .filter(|d| d.is_dir());
    if let (None, Some(test_sources)) = (env::var_os("CARGO_FEATURE_STOCK"), test_sources) {
        let test_dir = out_dir.join("cpp-tests");
        fs::create_dir_all(&test_dir).unwrap();
        for src in sorted_files(&test_sources, "cpp") {
            let name = format!("tests/cpp/{}", src.file_name().unwrap().to_string_lossy());
            let job = CompileJob {
                compiler: &cxx_compiler,
                compiler_id: &cxx_id,
                flags: &cxx_flags,
                header_digest: &header_digests["llama"],
                key_name: &name,
                source: &src,
                members: &[],
                tree,
            };
            let (obj, _) = compile_cached(&job, &cache).unwrap_or_else(|e| fail(e));
            let exe = test_dir.join(src.file_stem().unwrap());
            let mut link = Command::new(&cxx_compiler);
            link.arg(&obj)
                .arg(&lib)
                .arg("-o")
                .arg(&exe)
                .args(["-fopenmp", "-pthread", "-lm"]);
            if let Some(s) = &sanitize {
                link.arg(format!("-fsanitize={s}"));
            }
            let out = link
                .output()
                .unwrap_or_else(|e| fail(format!("cannot run {}: {e}", cxx_compiler.display())));
            if !out.status.success() {
                fail(format!(
                    "linking {} failed:\n{}",
                    exe.display(),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        println!(
            "cargo:rustc-env=H2O_LLAMA_CPP_TESTS_DIR={}",
            test_dir.display()
        );
    }

    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=h2o_llama_engine");
    link_runtime(sanitize.as_deref());
}

/// One translation unit for `compile_cached`.
struct CompileJob<'a> {
    compiler: &'a Path,
    compiler_id: &'a str,
    flags: &'a [String],
    /// Digest of the headers the unit can include.
    header_digest: &'a [u8],
    /// Stable name of the source (relative to its tree), part of the cache key.
    key_name: &'a str,
    source: &'a Path,
    /// Files whose content the object depends on instead of `source`'s (a unity file's members).
    members: &'a [PathBuf],
    tree: &'a Path,
}

/// Compiles a unit into the content-addressed object cache unless an object with the same key
/// (compiler, flags without include paths, headers, source content) is there already.
/// Returns the object and whether it was compiled now.
fn compile_cached(job: &CompileJob, cache: &Path) -> Result<(PathBuf, bool), String> {
    let mut key = Sha256::new();
    key.update(job.compiler_id.as_bytes());
    key.update(job.compiler.to_string_lossy().as_bytes());
    for f in job.flags {
        // Include paths differ between OUT_DIRs but not in meaning; the header digest covers
        // what they point to.
        if !f.starts_with("-I") {
            key.update(f.as_bytes());
        }
    }
    key.update(job.header_digest);
    key.update(job.key_name.as_bytes());
    if job.members.is_empty() {
        key.update(
            job.source
                .strip_prefix(job.tree)
                .unwrap_or(job.source)
                .to_string_lossy()
                .as_bytes(),
        );
        key.update(fs::read(job.source).unwrap_or_default());
    }
    for f in job.members {
        // a unity file's text holds absolute paths; its members are hashed instead
        key.update(
            f.strip_prefix(job.tree)
                .unwrap_or(f)
                .to_string_lossy()
                .as_bytes(),
        );
        key.update(fs::read(f).unwrap_or_default());
    }
    let stem = job
        .source
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let hex: String = key
        .finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    let obj = cache.join(format!("{stem}-{hex}.o"));
    if obj.is_file() {
        return Ok((obj, false));
    }
    let tmp = cache.join(format!("{stem}-{hex}.o.tmp{}", std::process::id()));
    let out = Command::new(job.compiler)
        .args(job.flags)
        .arg("-c")
        .arg(job.source)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", job.compiler.display()))?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "compiling {} failed:\n{}",
            job.source.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    fs::rename(&tmp, &obj).map_err(|e| format!("rename {}: {e}", tmp.display()))?;
    Ok((obj, true))
}

fn link_runtime(sanitize: Option<&str>) {
    if let Some(s) = sanitize {
        for part in s.split(',') {
            match part {
                "address" => println!("cargo:rustc-link-lib=dylib=asan"),
                "undefined" => println!("cargo:rustc-link-lib=dylib=ubsan"),
                _ => {}
            }
        }
    }
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo:rustc-link-lib=dylib=gomp");
    println!("cargo:rustc-link-lib=dylib=m");
}

// ---------------------------------------------------------------------------------------------
// 3b. CUDA build with upstream's CMake
// ---------------------------------------------------------------------------------------------

fn build_with_cmake(tree: &Path, out_dir: &Path) {
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
    let cuda_root = env::var("CUDA_PATH").unwrap_or_else(|_| "/usr/local/cuda".into());
    println!("cargo:rustc-link-search=native={cuda_root}/lib64");
    println!("cargo:rustc-link-search=native={cuda_root}/lib64/stubs");
    for lib in ["cudart", "cublas", "cublasLt", "cuda"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    link_runtime(None);
}

// ---------------------------------------------------------------------------------------------
// 4. bindings
// ---------------------------------------------------------------------------------------------

fn headers_digest(tree: &Path) -> String {
    let mut h = Sha256::new();
    for rel in BINDING_HEADERS {
        h.update(rel.as_bytes());
        h.update(fs::read(tree.join(rel)).unwrap_or_else(|e| fail(format!("read {rel}: {e}"))));
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn provide_bindings(manifest_dir: &Path, tree: &Path, out_dir: &Path, stock: bool) {
    let digest = headers_digest(tree);
    let flavour = if stock { "stock" } else { "h2o" };
    let committed = manifest_dir.join(format!("src/sys/bindings_{flavour}.rs"));
    let out = out_dir.join("bindings.rs");

    if cfg!(feature = "generate-bindings") {
        #[cfg(feature = "generate-bindings")]
        write_if_changed(&out, &generate_bindings(tree, &digest));
    } else {
        let text = fs::read_to_string(&committed).unwrap_or_else(|e| {
            fail(format!(
                "missing {}: {e}\nGenerate it with `scripts/update-bindings.sh` (needs libclang).",
                committed.display()
            ))
        });
        let recorded = text
            .lines()
            .find_map(|l| l.strip_prefix("// headers-sha256: "))
            .unwrap_or("")
            .trim()
            .to_string();
        if recorded != digest {
            fail(format!(
                "{} was generated from other headers than the ones this build compiles \
                 (recorded {recorded}, now {digest}). A patch changed a public header: run \
                 `scripts/update-bindings.sh` (needs libclang) and commit the result.",
                committed.display()
            ));
        }
        write_if_changed(&out, &text);
    }
}

#[cfg(feature = "generate-bindings")]
fn generate_bindings(tree: &Path, digest: &str) -> String {
    let bindings = bindgen::Builder::default()
        .header(tree.join("include/llama.h").to_string_lossy())
        .clang_arg(format!("-I{}", tree.join("ggml/include").display()))
        .clang_arg(format!("-I{}", tree.join("include").display()))
        .allowlist_function("llama_.*")
        .allowlist_type("llama_.*")
        .allowlist_var("LLAMA_.*")
        .allowlist_function("ggml_.*")
        .allowlist_type("ggml_.*")
        .allowlist_var("GGML_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .unwrap_or_else(|e| fail(format!("bindgen failed: {e}")));
    format!(
        "// @generated by bindgen from the {} llama.cpp headers; do not edit.\n\
         // Regenerate with scripts/update-bindings.sh.\n\
         // headers-sha256: {digest}\n\n{}",
        if env::var_os("CARGO_FEATURE_STOCK").is_some() {
            "pristine"
        } else {
            "patched"
        },
        bindings
    )
}
