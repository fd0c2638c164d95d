//! The patch series: the ordered list in `patches/series`, applied to the copied tree with
//! `git apply` (a patch that does not apply fails the build and names the patch).

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
