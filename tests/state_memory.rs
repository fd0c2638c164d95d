//! Saving and loading a state streams it: neither holds a second copy. A session of the default
//! model holding a state of over 128 MiB (F32 K/V) saves it and loads it back, and the process's
//! peak resident memory during each stays within 64 MiB of its memory before it (Linux:
//! `/proc/self/status` VmHWM, reset through `/proc/self/clear_refs`). A save or load that held
//! the state once more would exceed the bound by the state's own size.
//!
//! One test in its own binary, so that no other test allocates while it measures.
#![cfg(target_os = "linux")]

mod common;

use std::fs;

use h2o_llama::{CacheType, Integrity, Session, SessionConfig, Token};

const BOUND_MIB: u64 = 64;

/// A field of /proc/self/status, in KiB.
fn status_kib(field: &str) -> u64 {
    let status = fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// Runs `f`; returns its result and its peak resident memory above the memory before it, KiB.
fn peak_above<T>(f: impl FnOnce() -> T) -> (T, u64) {
    fs::write("/proc/self/clear_refs", "5")
        .expect("resetting the peak (/proc/self/clear_refs) is what this test measures with");
    let before = status_kib("VmRSS:");
    assert!(
        status_kib("VmHWM:") <= before + 1024,
        "the peak was not reset"
    );
    let out = f();
    (out, status_kib("VmHWM:").saturating_sub(before))
}

#[test]
fn saving_and_loading_a_state_hold_no_second_copy_of_it() {
    let model = common::model();
    let config = SessionConfig {
        n_ctx: 4096,
        n_batch: 1024,
        n_ubatch: 512,
        n_threads: 2,
        cache_type_k: CacheType::F32,
        cache_type_v: CacheType::F32,
        ..SessionConfig::default()
    };
    let tokens: Vec<Token> = h2o_llama::demo::prompt_tokens(model, 3200).unwrap();
    let tokens = &tokens[..];
    let mut session = Session::new(model, config.clone()).unwrap();
    session.evaluate(tokens).unwrap();

    let dir = common::scratch("state-memory");
    let path = dir.join("big.state");
    let (saved, save_kib) = peak_above(|| session.save_state(&path));
    saved.unwrap();
    let state_mib = fs::metadata(&path).unwrap().len() >> 20;
    assert!(
        state_mib >= 2 * BOUND_MIB,
        "the state ({state_mib} MiB) must be large enough for a second copy to break the bound"
    );

    let mut fresh = Session::new(model, config).unwrap();
    let (loaded, load_kib) = peak_above(|| fresh.load_state(&path));
    assert_eq!(loaded.unwrap(), Integrity::Verified);
    eprintln!(
        "state of {state_mib} MiB: save peak +{:.1} MiB, load peak +{:.1} MiB",
        save_kib as f64 / 1024.0,
        load_kib as f64 / 1024.0
    );
    assert!(
        save_kib <= BOUND_MIB << 10,
        "a save of {state_mib} MiB took {save_kib} KiB above the memory before it"
    );
    assert!(
        load_kib <= BOUND_MIB << 10,
        "a load of {state_mib} MiB took {load_kib} KiB above the memory before it"
    );
    // what was loaded is what was saved: one more token gives the saved session's logits
    session.evaluate(&[42]).unwrap();
    fresh.evaluate(&[42]).unwrap();
    assert_eq!(fresh.logits().unwrap(), session.logits().unwrap());
}
