//! Our changes to the copied pristine tree, in two steps: the H2O source files of `engine/`
//! copied in at the same paths (they add files, never replace upstream's), then the hook series,
//! the ordered list in `patches/series`, applied with `git apply` (a patch that does not apply
//! fails the build and names the patch).

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::fail;

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

/// Copies every file under `engine/` into `tree` at the same relative path. A file that
/// upstream already has fails the build: the engine only adds translation units and headers,
/// and what it changes in upstream's files goes through a hook patch.
pub fn add_engine_files(manifest_dir: &Path, tree: &Path) {
    fn walk(from: &Path, rel: &Path, tree: &Path) {
        let entries =
            fs::read_dir(from).unwrap_or_else(|e| fail(format!("read {}: {e}", from.display())));
        for entry in entries {
            let entry = entry.unwrap_or_else(|e| fail(format!("read {}: {e}", from.display())));
            let rel = rel.join(entry.file_name());
            let ty = entry.file_type().unwrap();
            if ty.is_dir() {
                walk(&entry.path(), &rel, tree);
            } else if ty.is_file() {
                let dst = tree.join(&rel);
                if dst.exists() {
                    fail(format!(
                        "engine/{} would replace upstream's file; change upstream files through a \
                         hook patch instead (patches/README.md)",
                        rel.display()
                    ));
                }
                fs::create_dir_all(dst.parent().unwrap())
                    .unwrap_or_else(|e| fail(format!("mkdir {}: {e}", dst.display())));
                fs::copy(entry.path(), &dst)
                    .unwrap_or_else(|e| fail(format!("copy {}: {e}", dst.display())));
            }
        }
    }
    walk(&manifest_dir.join("engine"), Path::new(""), tree);
}

pub fn apply_patches(manifest_dir: &Path, tree: &Path) {
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
