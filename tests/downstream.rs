//! The crate builds and links when used as a path dependency of another workspace: its build
//! script must not assume it is the top-level crate (paths, OUT_DIR, the vendored pin).
//! The object cache is shared so that this costs a link, not a second engine build.
//!
//! Such an app gets the library only: no front end's dependencies (CLI parsing, charts, HTTP)
//! in its normal dependency tree.

use std::process::Command;

#[test]
fn builds_as_a_path_dependency_of_another_workspace() {
    let dir = std::env::temp_dir().join(format!("h2o-llama-downstream-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"downstream-app\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n\
             [dependencies]\nh2o-llama = {{ path = {:?} }}\n\n[workspace]\n",
            env!("CARGO_MANIFEST_DIR")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("src/main.rs"),
        "fn main() {\n    \
             let cfg = h2o_llama::SessionConfig::default();\n    \
             cfg.validate().unwrap();\n    \
             println!(\"upstream {} patched {}\", h2o_llama::UPSTREAM_VERSION, h2o_llama::PATCHED);\n\
         }\n",
    )
    .unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(["run", "--release", "--quiet", "--offline"])
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env("H2O_LLAMA_OBJ_CACHE", env!("H2O_LLAMA_OBJ_CACHE_DIR"))
        .env_remove("RUSTFLAGS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "downstream build failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.trim(),
        format!("upstream {} patched true", h2o_llama::UPSTREAM_VERSION)
    );

    let tree = Command::new(&cargo)
        .args(["tree", "-e", "normal", "--offline", "--prefix", "none"])
        .args(["--format", "{p}"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(
        tree.status.success(),
        "cargo tree failed:\n{}",
        String::from_utf8_lossy(&tree.stderr)
    );
    let tree = String::from_utf8_lossy(&tree.stdout);
    let crates: Vec<&str> = tree.lines().filter_map(|l| l.split(' ').next()).collect();
    assert!(crates.contains(&"h2o-llama"), "{tree}");
    for front_end_only in [
        "clap", "anyhow", "ctrlc", "plotters", "dejavu", "tokio", "axum", "hyper",
    ] {
        assert!(
            !crates.contains(&front_end_only),
            "`cargo add h2o-llama` pulls {front_end_only}:\n{tree}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
