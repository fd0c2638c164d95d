//! Process-wide llama.cpp state: backend initialisation and the log sink.
//!
//! llama.cpp logs through one global callback. We keep its recent warnings and errors so that a
//! failed call (model load, context creation) can tell the user *why*, and we only echo the log
//! to stderr when asked (`H2O_LLAMA_LOG=1` or [`set_log_echo`]) — by default a tool built on this
//! library prints its own messages, not llama.cpp's.

use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::sys;

static INIT: OnceLock<()> = OnceLock::new();
static ECHO: AtomicBool = AtomicBool::new(false);
/// Recent warnings and errors, each with whether it was an error.
static RECENT: Mutex<VecDeque<(bool, String)>> = Mutex::new(VecDeque::new());
const RECENT_MAX: usize = 16;

/// Initialises llama.cpp's backends and installs the log sink; idempotent and thread-safe.
/// Every constructor of the safe layer calls it, so users never need to.
pub fn init() {
    INIT.get_or_init(|| {
        if std::env::var("H2O_LLAMA_LOG").is_ok_and(|v| !v.is_empty() && v != "0") {
            ECHO.store(true, Ordering::Relaxed);
        }
        // SAFETY: plain C initialisers; the callback is a 'static function with no state
        // beyond the statics above.
        unsafe {
            sys::llama_log_set(Some(log_sink), std::ptr::null_mut());
            sys::llama_backend_init();
        }
    });
}

/// Whether this build of llama.cpp can run layers on a local GPU (a CUDA build that found a
/// device): where it cannot, `-ngl` (`ModelParams::n_gpu_layers`) leaves every layer on the CPU
/// unless RPC servers take them (`ModelParams::rpc_servers`). llama.cpp's
/// `llama_supports_gpu_offload` also says yes for any build with the RPC backend, which every
/// build here has.
pub fn gpu_offload_supported() -> bool {
    !crate::rpc::local_gpu_devices().is_empty()
}

/// Echo llama.cpp's own log lines to stderr (default off unless `H2O_LLAMA_LOG=1`).
pub fn set_log_echo(on: bool) {
    ECHO.store(on, Ordering::Relaxed);
}

/// Drops remembered log lines; called before an operation whose failure we want to explain.
pub(crate) fn clear_recent_log() {
    RECENT.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// The errors llama.cpp logged since the last [`clear_recent_log`], joined — or its warnings
/// when it logged no error (a warning next to an error is usually beside the point), or a
/// generic text when it logged neither.
pub(crate) fn recent_log_reason() -> String {
    let recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    let any_error = recent.iter().any(|(is_error, _)| *is_error);
    let lines: Vec<&str> = recent
        .iter()
        .filter(|(is_error, _)| *is_error || !any_error)
        .map(|(_, s)| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    if lines.is_empty() {
        "no reason given by llama.cpp".to_string()
    } else {
        lines.join("; ")
    }
}

unsafe extern "C" fn log_sink(level: sys::ggml_log_level, text: *const c_char, _user: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for the duration of the call.
    let msg = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    if ECHO.load(Ordering::Relaxed) {
        eprint!("{msg}");
    }
    if level == sys::GGML_LOG_LEVEL_WARN || level == sys::GGML_LOG_LEVEL_ERROR {
        let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() == RECENT_MAX {
            recent.pop_front();
        }
        recent.push_back((level == sys::GGML_LOG_LEVEL_ERROR, msg.into_owned()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// h2o-cli and h2o-server turn H2O on by themselves only with the layers on the CPU; a build
    /// without CUDA must say that it has no GPU, so that `-ngl` there changes nothing.
    #[test]
    fn a_build_without_cuda_cannot_offload() {
        if !cfg!(feature = "cuda") {
            assert!(!gpu_offload_supported());
        }
    }
}
