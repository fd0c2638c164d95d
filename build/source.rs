//! The pinned pristine source: which `llama-cpp-sys-2` version `vendor/pin/Cargo.lock` pins,
//! obtaining its `llama.cpp/` tree with `cargo vendor --locked` (or `H2O_LLAMA_UPSTREAM_DIR`), and
//! the fresh copy of it in `OUT_DIR` that the patches are applied to.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fail;

const UPSTREAM_CRATE: &str = "llama-cpp-sys-2";

/// (version, sha256) of the upstream crate as pinned in vendor/pin/Cargo.lock.
pub fn pinned_package(manifest_dir: &Path) -> (String, String) {
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
pub fn obtain_pristine(manifest_dir: &Path, out_dir: &Path) -> PathBuf {
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

pub fn prepare_tree(pristine: &Path, tree: &Path) {
    if tree.exists() {
        fs::remove_dir_all(tree)
            .unwrap_or_else(|e| fail(format!("cannot clear {}: {e}", tree.display())));
    }
    copy_dir(pristine, tree);
}

/// Makes `tree` hold what `staging` holds, writing only the files whose bytes differ and
/// removing those `staging` lacks: files that did not change keep their modification times,
/// so that the CUDA build (upstream's CMake, which goes by them) recompiles only what a change
/// of the patches touched instead of the whole backend.
pub fn sync_tree(staging: &Path, tree: &Path) {
    fs::create_dir_all(tree).unwrap_or_else(|e| fail(format!("mkdir {}: {e}", tree.display())));
    let read = |dir: &Path| {
        fs::read_dir(dir)
            .unwrap_or_else(|e| fail(format!("read {}: {e}", dir.display())))
            .map(|e| e.unwrap())
            .collect::<Vec<_>>()
    };
    for entry in read(staging) {
        let ty = entry.file_type().unwrap();
        let dst = tree.join(entry.file_name());
        if ty.is_dir() {
            if dst.is_file() {
                let _ = fs::remove_file(&dst);
            }
            sync_tree(&entry.path(), &dst);
        } else if ty.is_file() {
            let bytes = fs::read(entry.path())
                .unwrap_or_else(|e| fail(format!("read {}: {e}", entry.path().display())));
            if fs::read(&dst).ok().as_deref() != Some(bytes.as_slice()) {
                if dst.is_dir() {
                    let _ = fs::remove_dir_all(&dst);
                }
                fs::write(&dst, &bytes)
                    .unwrap_or_else(|e| fail(format!("write {}: {e}", dst.display())));
            }
        }
    }
    for entry in read(tree) {
        if !staging.join(entry.file_name()).exists() {
            let path = entry.path();
            let _ = if entry.file_type().unwrap().is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
        }
    }
}
