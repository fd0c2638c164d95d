//! The engine's source files (`engine/`) add to the pinned pristine llama.cpp without replacing
//! any of its files, the hook series then applies in order, and the tree the engine was built
//! from is exactly pristine + engine files + series (nothing patched in place, no drift).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const PRISTINE: &str = env!("H2O_LLAMA_PRISTINE_DIR");
const BUILT: &str = env!("H2O_LLAMA_TREE_DIR");

fn files(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n == ".git") {
                    continue;
                }
                walk(root, &p, out);
            } else {
                out.insert(
                    p.strip_prefix(root).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn copy(from: &Path, to: &Path) {
    for (rel, data) in files(from) {
        let dst = to.join(rel);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::write(dst, data).unwrap();
    }
}

fn series() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(root.join("patches/series"))
        .unwrap()
        .lines()
        .map(|l| l.split('#').next().unwrap().trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn pristine_tree_matches_the_pinned_checksum() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lock = std::fs::read_to_string(root.join("vendor/pin/Cargo.lock")).unwrap();
    let block = lock
        .split("[[package]]")
        .find(|b| b.contains("name = \"llama-cpp-sys-2\""))
        .unwrap();
    let pinned = block
        .lines()
        .find_map(|l| l.strip_prefix("checksum = "))
        .unwrap()
        .trim_matches('"');
    let recorded = std::fs::read_to_string(
        Path::new(PRISTINE)
            .parent()
            .unwrap()
            .join(".cargo-checksum.json"),
    )
    .unwrap();
    assert!(
        recorded.contains(&format!("\"package\":\"{pinned}\"")),
        "vendored crate does not match the pin {pinned}"
    );
    assert!(block.contains(&format!("version = \"{}\"", h2o_llama::UPSTREAM_VERSION)));
}

#[test]
fn series_applies_in_order_and_equals_the_built_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = std::env::temp_dir().join(format!("h2o-llama-series-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    copy(Path::new(PRISTINE), &work);
    let engine = files(&root.join("engine"));
    assert!(!engine.is_empty(), "engine/ holds no source files");
    for (rel, data) in engine {
        let dst = work.join(&rel);
        assert!(
            !dst.exists(),
            "engine/{} replaces upstream's file; it belongs in a hook patch",
            rel.display()
        );
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::write(dst, data).unwrap();
    }
    for name in series() {
        let out = Command::new("git")
            .args(["apply", "--whitespace=nowarn", "-p1"])
            .arg(root.join("patches").join(&name))
            .current_dir(&work)
            .env("GIT_CEILING_DIRECTORIES", work.parent().unwrap())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "patch {name} does not apply: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let expected = files(&work);
    let built = files(Path::new(BUILT));
    let _ = std::fs::remove_dir_all(&work);
    let differing: Vec<_> = expected
        .keys()
        .chain(built.keys())
        .filter(|k| expected.get(*k) != built.get(*k))
        .collect();
    assert!(
        differing.is_empty(),
        "built tree differs from pristine + engine/ + series in {differing:?}"
    );
    // And the pristine tree itself was not modified in place.
    if !series().is_empty() {
        assert_ne!(
            files(Path::new(PRISTINE)),
            built,
            "the pristine tree was patched in place"
        );
    }
}
