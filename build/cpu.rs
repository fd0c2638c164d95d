//! Building the CPU engine without cmake: the units of `engine` compiled in parallel (cargo's
//! NUM_JOBS) through `objcache`, archived into `libh2o_llama_engine.a` (with `engine-build.txt`
//! saying what was compiled), the link directives and runtime libraries, and the C++ test
//! programs of `tests/cpp`, built with the engine's flags.

use std::collections::BTreeMap;
use std::env;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::engine::{self, sorted_files, Flags, Unit};
use crate::fail;
use crate::objcache::{
    compile_cached, compiler_identity, header_digests, object_cache_dir, CompileJob,
};

/// What every compile of this build shares.
struct Toolchain<'a> {
    tree: &'a Path,
    out_dir: &'a Path,
    c_compiler: PathBuf,
    cxx_compiler: PathBuf,
    c_id: String,
    cxx_id: String,
    flags: Flags,
    header_digests: BTreeMap<&'static str, Vec<u8>>,
    cache: PathBuf,
}

pub fn build_cpu(tree: &Path, gen_dir: &Path, out_dir: &Path) {
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let units = engine::units(tree, out_dir, &target_arch);
    let flags = engine::flags(tree, gen_dir, &target_arch);
    let t = toolchain(tree, gen_dir, out_dir, flags);

    let (objects, compiled) = compile_all(&t, &units);
    let lib = archive(&t, &objects);
    write_log(&t, units.len(), compiled);
    build_cpp_tests(&t, &lib);

    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=h2o_llama_engine");
    link_runtime(t.flags.sanitize.as_deref());
}

/// The compilers (as `cc` finds them), their identities, the header digests and the cache.
fn toolchain<'a>(tree: &'a Path, gen_dir: &Path, out_dir: &'a Path, flags: Flags) -> Toolchain<'a> {
    let c_compiler = cc::Build::new().get_compiler().path().to_path_buf();
    let cxx_compiler = cc::Build::new()
        .cpp(true)
        .get_compiler()
        .path()
        .to_path_buf();
    let header_digests = header_digests(tree, gen_dir);
    let cache = object_cache_dir(out_dir);
    fs::create_dir_all(&cache).unwrap_or_else(|e| fail(format!("mkdir {}: {e}", cache.display())));
    let c_id = compiler_identity(&c_compiler);
    let cxx_id = compiler_identity(&cxx_compiler);
    Toolchain {
        tree,
        out_dir,
        c_compiler,
        cxx_compiler,
        c_id,
        cxx_id,
        flags,
        header_digests,
        cache,
    }
}

/// Compiles the units in parallel (cargo's NUM_JOBS), reusing cached objects; returns the
/// objects in unit order and how many were compiled now.
fn compile_all(t: &Toolchain, units: &[Unit]) -> (Vec<(usize, PathBuf)>, usize) {
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
                let obj = match compile_unit(t, &units[i]) {
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
    (objects, compiled.load(Ordering::SeqCst))
}

/// One unit through the cache; its key name is its path in the tree (a unity file's: its name).
fn compile_unit(t: &Toolchain, u: &Unit) -> Result<(PathBuf, bool), String> {
    let (tree, out_dir) = (t.tree, t.out_dir);
    let (compiler, flags, id) = if u.headers == "common" {
        (&t.cxx_compiler, &t.flags.cxx_common, &t.cxx_id)
    } else if u.cpp {
        (&t.cxx_compiler, &t.flags.cxx, &t.cxx_id)
    } else {
        (&t.c_compiler, &t.flags.c, &t.c_id)
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
        header_digest: &t.header_digests[u.headers],
        key_name: &rel.to_string_lossy(),
        source: &u.source,
        members: &u.members,
        tree,
    };
    compile_cached(&job, &t.cache)
}

/// Archives the objects into `<out_dir>/libh2o_llama_engine.a`.
fn archive(t: &Toolchain, objects: &[(usize, PathBuf)]) -> PathBuf {
    let lib = t.out_dir.join("libh2o_llama_engine.a");
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
    lib
}

/// `<out_dir>/engine-build.txt`: how many units, how many compiled now, the C++ command line.
fn write_log(t: &Toolchain, units: usize, compiled: usize) {
    let mut log = fs::File::create(t.out_dir.join("engine-build.txt")).unwrap();
    writeln!(
        log,
        "units {} compiled {} cache {}",
        units,
        compiled,
        t.cache.display()
    )
    .unwrap();
    writeln!(
        log,
        "c++ {} {}",
        t.cxx_compiler.display(),
        t.flags.cxx.join(" ")
    )
    .unwrap();
}

/// The C++ test programs (tests/cpp/*.cpp): they use the patched tree's internal headers, so
/// they are built here, with the engine's flags, and run by the Rust tests and benches.
fn build_cpp_tests(t: &Toolchain, lib: &Path) {
    let test_sources = env::var("CARGO_MANIFEST_DIR")
        .map(|d| Path::new(&d).join("tests/cpp"))
        .ok()
        .filter(|d| d.is_dir());
    if let (None, Some(test_sources)) = (env::var_os("CARGO_FEATURE_STOCK"), test_sources) {
        let test_dir = t.out_dir.join("cpp-tests");
        fs::create_dir_all(&test_dir).unwrap();
        for src in sorted_files(&test_sources, "cpp") {
            let name = format!("tests/cpp/{}", src.file_name().unwrap().to_string_lossy());
            let job = CompileJob {
                compiler: &t.cxx_compiler,
                compiler_id: &t.cxx_id,
                flags: &t.flags.cxx,
                header_digest: &t.header_digests["llama"],
                key_name: &name,
                source: &src,
                members: &[],
                tree: t.tree,
            };
            let (obj, _) = compile_cached(&job, &t.cache).unwrap_or_else(|e| fail(e));
            let exe = test_dir.join(src.file_stem().unwrap());
            link_cpp_test(t, &obj, lib, &exe);
        }
        println!(
            "cargo:rustc-env=H2O_LLAMA_CPP_TESTS_DIR={}",
            test_dir.display()
        );
    }
}

fn link_cpp_test(t: &Toolchain, obj: &Path, lib: &Path, exe: &Path) {
    let cxx_compiler = &t.cxx_compiler;
    let mut link = Command::new(cxx_compiler);
    link.arg(obj)
        .arg(lib)
        .arg("-o")
        .arg(exe)
        .args(["-fopenmp", "-pthread", "-lm"]);
    if let Some(s) = &t.flags.sanitize {
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

pub fn link_runtime(sanitize: Option<&str>) {
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
