//! Saved sessions (with their H2O state): a state saved after prompt A and loaded into a
//! fresh session continues with B exactly as a session that ran A then B — logits, generated
//! tokens and the whole H2O state, for the seed rule and the default policy, from a file and from
//! bytes — and every state that does not fit is refused with a message naming the problem, leaving
//! the session usable.
#![cfg(not(feature = "stock"))]

mod common;

use std::path::Path;

use h2o_llama::{
    CacheType, Error, H2oConfig, Integrity, PromptCache, Sampler, SamplerConfig, Selection,
    Session, SessionConfig, Token,
};

fn config(h2o: Option<H2oConfig>) -> SessionConfig {
    SessionConfig {
        n_ctx: 1024,
        n_batch: 512,
        n_ubatch: 128,
        n_threads: 2,
        h2o,
        ..SessionConfig::default()
    }
}

/// Prompt A (two chunks and part of a third, so column sums of a chunk in progress are saved)
/// and its continuation B.
fn prompts() -> (Vec<Token>, Vec<Token>) {
    let tokens = common::model()
        .tokenize(&h2o_llama::demo::prompt(40), true, true)
        .unwrap();
    assert!(
        tokens.len() >= 520,
        "demo prompt too short: {}",
        tokens.len()
    );
    (tokens[..300].to_vec(), tokens[300..520].to_vec())
}

fn greedy(s: &mut Session<'_>, n: usize) -> Vec<Token> {
    let mut sampler = Sampler::new(&SamplerConfig::greedy()).unwrap();
    s.generate(&[], &mut sampler, n, |_| true).unwrap().tokens
}

/// What a session that ran A then B holds, and the tokens it generates next.
struct Expected {
    logits: Vec<f32>,
    h2o: common::H2oSnapshot,
    generated: Vec<Token>,
}

fn run_through(h2o: H2oConfig, a: &[Token], b: &[Token]) -> Expected {
    let mut s = Session::new(common::model(), config(Some(h2o))).unwrap();
    s.evaluate(a).unwrap();
    s.evaluate(b).unwrap();
    let logits = s.logits().unwrap().to_vec();
    let h2o = common::h2o_snapshot(&s);
    let generated = greedy(&mut s, 8);
    Expected {
        logits,
        h2o,
        generated,
    }
}

fn assert_continues(what: &str, s: &mut Session<'_>, b: &[Token], want: &Expected) {
    s.evaluate(b).unwrap();
    assert!(
        s.logits().unwrap() == want.logits.as_slice(),
        "{what}: logits after B differ from a session that never saved (max |Δ| {})",
        common::max_abs_diff(s.logits().unwrap(), &want.logits)
    );
    let h2o = common::h2o_snapshot(s);
    assert_eq!(h2o.progress, want.h2o.progress, "{what}: H2O progress");
    assert!(
        h2o.memory_sets == want.h2o.memory_sets,
        "{what}: memory sets differ"
    );
    assert!(h2o.scores == want.h2o.scores, "{what}: scores differ");
    assert_eq!(greedy(s, 8), want.generated, "{what}: generated tokens");
}

#[test]
fn a_saved_state_continues_exactly_as_if_never_saved() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    let (a, b) = prompts();
    let dir = common::scratch("saved-state");
    let policies = [
        ("seed rule", H2oConfig::seed(32, 32)),
        (
            "default (hybrid, sinks, dense tail)",
            H2oConfig::new(32, 32),
        ),
    ];
    for (name, h2o) in policies {
        let want = run_through(h2o, &a, &b);

        let mut first = Session::new(m, config(Some(h2o))).unwrap();
        first.evaluate(&a).unwrap();
        let after_a = common::h2o_snapshot(&first);
        assert_eq!(
            after_a.progress, "chunks 2 tokens 256 memory true",
            "{name}"
        );
        let path = dir.join(format!("{}.session", name.len()));
        first.save_state(&path).unwrap();
        let bytes = first.state_bytes().unwrap();
        // the file is llama.cpp's session state behind the 32-byte checked header
        let file = std::fs::read(&path).unwrap();
        assert_eq!(&file[..8], b"H2OSTATE", "{name}");
        assert_eq!(bytes, file[32..], "{name}: bytes and file differ");

        let mut loaded = Session::new(m, config(Some(h2o))).unwrap();
        assert_eq!(loaded.load_state(&path).unwrap(), Integrity::Verified);
        assert_eq!(loaded.tokens(), a.as_slice(), "{name}");
        assert_eq!(loaded.n_past() as usize, a.len(), "{name}");
        assert!(loaded.logits().is_none(), "{name}: a state holds no logits");
        assert!(
            common::h2o_snapshot(&loaded) == after_a,
            "{name}: H2O state after load"
        );
        assert_continues(&format!("{name}, from a file"), &mut loaded, &b, &want);

        // into a session that already held something: the load replaces it
        let mut reused = Session::new(m, config(Some(h2o))).unwrap();
        reused.evaluate(&b[..50]).unwrap();
        assert_eq!(
            reused.load_state_bytes(&bytes).unwrap(),
            Integrity::Unverified
        );
        assert_continues(&format!("{name}, from bytes"), &mut reused, &b, &want);

        // a file saved before checked state files (llama.cpp's session file alone) is still
        // read, unverified, and continues as well
        let older = dir.join(format!("{}.older", name.len()));
        std::fs::write(&older, &bytes).unwrap();
        let mut loaded = Session::new(m, config(Some(h2o))).unwrap();
        assert_eq!(loaded.load_state(&older).unwrap(), Integrity::Unverified);
        assert_continues(&format!("{name}, an older file"), &mut loaded, &b, &want);

        // a state of version 4, from before sparse decode's key sketches were saved, is still
        // read and continues as well
        let mut loaded = Session::new(m, config(Some(h2o))).unwrap();
        assert_eq!(
            loaded.load_state_bytes(&version_4(&bytes)).unwrap(),
            Integrity::Unverified
        );
        assert_continues(&format!("{name}, version 4"), &mut loaded, &b, &want);
    }
}

/// Where the H2O section's header (its magic, then this build's version) starts in `state`.
fn h2o_header(state: &[u8]) -> usize {
    state
        .windows(8)
        .position(|w| w[..4] == *b"H2OS" && w[4..] == 5u32.to_le_bytes())
        .expect("the H2O section's magic and version")
}

/// `state` (llama.cpp's state of one sequence, saved without sparse decode) as version 4 of
/// the H2O section wrote it: that version in its header, and without the count of sketched
/// layers (none here) that ends the sequence's H2O part, and so the state, since version 5.
fn version_4(state: &[u8]) -> Vec<u8> {
    let header = h2o_header(state);
    let (body, sketched_layers) = state.split_at(state.len() - 4);
    assert_eq!(
        sketched_layers,
        0u32.to_le_bytes(),
        "no sparse decode, no sketches"
    );
    let mut v4 = body.to_vec();
    v4[header + 4..header + 8].copy_from_slice(&4u32.to_le_bytes());
    v4
}

fn load_error(s: &mut Session<'_>, path: &Path) -> String {
    match s.load_state(path) {
        Err(e @ Error::StateLoad { .. }) => e.to_string(),
        other => panic!(
            "expected a StateLoad error for {}, got {other:?}",
            path.display()
        ),
    }
}

#[test]
fn states_that_do_not_fit_are_refused_and_the_session_stays_usable() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    let (a, b) = prompts();
    let dir = common::scratch("refused-state");
    let save = |h2o: Option<H2oConfig>, name: &str| {
        let mut s = Session::new(m, config(h2o)).unwrap();
        s.evaluate(&a).unwrap();
        let path = dir.join(name);
        s.save_state(&path).unwrap();
        path
    };
    let seed = H2oConfig::seed(32, 32);
    let h2o_state = save(Some(seed), "h2o.session");
    let full_state = save(None, "full.session");

    // each refusal happens before the session changes: it keeps B and continues as before
    let cases: Vec<(Option<H2oConfig>, &Path, &str)> = vec![
        (Some(H2oConfig::seed(32, 64)), &h2o_state, "h2o_heavy"),
        (
            Some(H2oConfig {
                select: Selection::Hybrid,
                ..seed
            }),
            &h2o_state,
            "h2o_select",
        ),
        (Some(seed), &full_state, "holds no H2O state"),
        (None, &h2o_state, "saved with H2O on"),
    ];
    for (h2o, path, needle) in cases {
        let mut s = Session::new(m, config(h2o)).unwrap();
        s.evaluate(&b[..100]).unwrap();
        let before = s.logits().unwrap().to_vec();
        let msg = load_error(&mut s, path);
        assert!(msg.contains(needle), "{msg}");
        assert!(msg.contains("the session is unchanged"), "{msg}");
        assert_eq!(s.tokens(), &b[..100]);
        assert!(s.logits().unwrap() == before.as_slice());
        s.evaluate(&b[100..110]).unwrap();
    }

    // damaged files: checked whole before any of it is used, so refused with the session
    // unchanged; an older file without a checksum that llama.cpp finds damaged part-way
    // leaves the session emptied, never half loaded
    let bytes = std::fs::read(&h2o_state).unwrap();
    let mut s = Session::new(m, config(Some(seed))).unwrap();
    s.evaluate(&b[..100]).unwrap();
    let msg = s
        .load_state_bytes(&[bytes.as_slice(), b"trailing"].concat())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("damaged: 8 bytes follow"), "{msg}");
    assert!(msg.contains("the session is unchanged"), "{msg}");
    assert_eq!(s.n_past(), 100);
    let state = &bytes[32..];
    let msg = s
        .load_state_bytes(&[state, b"trailing"].concat())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("8 bytes follow the state"), "{msg}");
    assert!(msg.contains("the session was emptied"), "{msg}");
    assert_eq!(s.n_past(), 0);
    // a state saved under a policy since retired (h2o_select 1, whole blocks by the chunk's own
    // queries): its H2O header names the policy by number, and this build refuses it by name
    let magic = h2o_header(state);
    let mut retired = state.to_vec();
    let select_at = magic + 4 + 4 * 4; // magic, then version, L, H, S, select
    assert_eq!(retired[select_at..select_at + 4], 0u32.to_le_bytes());
    retired[select_at..select_at + 4].copy_from_slice(&1u32.to_le_bytes());
    let mut s = Session::new(m, config(Some(seed))).unwrap();
    s.evaluate(&b[..100]).unwrap();
    let msg = s.load_state_bytes(&retired).unwrap_err().to_string();
    assert!(
        msg.contains("h2o_select = 1, a policy this build no longer runs"),
        "{msg}"
    );
    s.evaluate(&b[..10]).unwrap();
    let truncated = dir.join("truncated.session");
    std::fs::write(&truncated, &bytes[..bytes.len() - 1000]).unwrap();
    let older_truncated = dir.join("older-truncated.session");
    std::fs::write(&older_truncated, &state[..state.len() - 1000]).unwrap();
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 1;
    let damaged_file = dir.join("damaged.session");
    std::fs::write(&damaged_file, &flipped).unwrap();
    let foreign = dir.join("foreign.session");
    std::fs::write(
        &foreign,
        "This is a text file, not a saved session.\n".repeat(20),
    )
    .unwrap();
    let extended = dir.join("extended.session");
    std::fs::write(&extended, [bytes.as_slice(), b"trailing"].concat()).unwrap();
    let missing = dir.join("missing.session");
    let cut = format!(
        "truncated ({} of {} bytes)",
        bytes.len() - 1000,
        bytes.len()
    );
    let damaged: Vec<(&Path, &str)> = vec![
        (&truncated, &cut),
        (
            &damaged_file,
            "damaged: its content does not match its checksum",
        ),
        (&older_truncated, "the session was emptied"),
        (&extended, "damaged: 8 bytes follow"),
        (&foreign, "not a llama.cpp session state"),
        (&missing, "missing.session"),
    ];
    for (path, needle) in damaged {
        let mut s = Session::new(m, config(Some(seed))).unwrap();
        s.evaluate(&b[..100]).unwrap();
        let msg = load_error(&mut s, path);
        assert!(msg.contains(needle), "{}: {msg}", path.display());
        // usable: whatever it kept, it continues as a session with those tokens would
        let kept = s.tokens().to_vec();
        let next = &a[..40];
        s.evaluate(next).unwrap();
        let mut fresh = Session::new(m, config(Some(seed))).unwrap();
        fresh
            .evaluate(&[kept.as_slice(), next].concat())
            .unwrap_or_else(|e| panic!("{e}"));
        let d = common::max_abs_diff(s.logits().unwrap(), fresh.logits().unwrap());
        // one call and two give the same logits up to float rounding (tests/h2o_state.rs)
        assert!(
            d == 0.0 || (!kept.is_empty() && d < 1e-2),
            "{}: max |Δ| {d} against a fresh session",
            path.display()
        );
    }
}

#[test]
fn the_prompt_cache_is_used_only_for_a_prompt_it_begins() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    let (a, b) = prompts();
    let ab = [a.as_slice(), b.as_slice()].concat();
    let dir = common::scratch("prompt-cache");
    let path = dir.join("prompt.cache");
    let h2o = Some(H2oConfig::new(32, 32));

    // A's 300 tokens in chunks of 128 with a dense tail of 64 from 236: the cache holds the
    // chunk boundary before the tail
    let mut s = Session::new(m, config(h2o)).unwrap();
    assert_eq!(
        s.load_prompt_cache(&path, &a).unwrap(),
        PromptCache::Missing
    );
    assert_eq!(
        s.evaluate_saving_prompt_cache(&a, &path, |_, _| {})
            .unwrap(),
        Some(128)
    );
    let a_logits = s.logits().unwrap().to_vec();
    let mut fresh = Session::new(m, config(h2o)).unwrap();
    fresh.evaluate(&a).unwrap();
    assert_eq!(
        a_logits,
        fresh.logits().unwrap(),
        "the save changed the prefill"
    );

    // A then B from the cache: exactly a fresh session's prefill of A + B, state and all
    let mut s = Session::new(m, config(h2o)).unwrap();
    assert_eq!(
        s.load_prompt_cache(&path, &ab).unwrap(),
        PromptCache::Reused {
            tokens: 128,
            integrity: Integrity::Verified
        }
    );
    assert_eq!(s.tokens(), &a[..128]);
    // A + B is 520 tokens in calls of 512: the last call holds 8, and the dense tail is that
    // call, so the boundary before it is 512
    assert_eq!(
        s.evaluate_saving_prompt_cache(&ab[128..], &dir.join("ab.cache"), |_, _| {})
            .unwrap(),
        Some(512)
    );
    let mut fresh = Session::new(m, config(h2o)).unwrap();
    fresh.evaluate(&ab).unwrap();
    assert_eq!(s.logits().unwrap(), fresh.logits().unwrap());
    assert!(
        common::h2o_snapshot(&s) == common::h2o_snapshot(&fresh),
        "the H2O state after the cached prompt differs from a fresh prefill's"
    );

    // a state saved after a whole prompt (its dense tail ran) begins the prompt but is not what a
    // fresh prefill leaves: not loaded
    let stale = dir.join("stale.cache");
    fresh.save_state(&stale).unwrap();
    let longer = [ab.as_slice(), &a[..20]].concat();
    let mut s = Session::new(m, config(h2o)).unwrap();
    assert_eq!(
        s.load_prompt_cache(&stale, &longer).unwrap(),
        PromptCache::NotFresh { cached: ab.len() }
    );
    assert_eq!(s.n_past(), 0);

    // a cache that runs past where a shorter prompt's dense tail starts: the first 400 tokens
    // of A + B (one call, tail from 336) save 256 tokens; a fresh run of the first 300 attends
    // densely from 236, where the state scored a sparse chunk: not loaded, and the run and its
    // new cache (128 tokens) are a fresh run's
    let p400 = dir.join("400.cache");
    let mut s = Session::new(m, config(h2o)).unwrap();
    assert_eq!(
        s.evaluate_saving_prompt_cache(&ab[..400], &p400, |_, _| {})
            .unwrap(),
        Some(256)
    );
    let mut s = Session::new(m, config(h2o)).unwrap();
    assert_eq!(
        s.load_prompt_cache(&p400, &ab[..300]).unwrap(),
        PromptCache::EndsInTail { cached: 256 }
    );
    assert_eq!(s.n_past(), 0);
    assert_eq!(
        s.evaluate_saving_prompt_cache(&ab[..300], &p400, |_, _| {})
            .unwrap(),
        Some(128)
    );
    let mut fresh = Session::new(m, config(h2o)).unwrap();
    fresh.evaluate(&ab[..300]).unwrap();
    assert_eq!(s.logits().unwrap(), fresh.logits().unwrap());

    // the cache of A holds its first 128 tokens
    let a = a[..128].to_vec();

    // the whole prompt (a state has no logits to sample from) or another prompt: not loaded
    let mut s = Session::new(m, config(h2o)).unwrap();
    assert_eq!(
        s.load_prompt_cache(&path, &a).unwrap(),
        PromptCache::Unused {
            common: a.len(),
            cached: a.len()
        }
    );
    let other = [
        &a[..10],
        &b[..].iter().rev().copied().collect::<Vec<_>>()[..],
    ]
    .concat();
    assert_eq!(
        s.load_prompt_cache(&path, &other).unwrap(),
        PromptCache::Unused {
            common: 10,
            cached: a.len()
        }
    );
    assert_eq!(s.n_past(), 0);

    // a cache made with other settings is an error, not silently replaced
    let mut s = Session::new(m, config(Some(H2oConfig::new(64, 32)))).unwrap();
    let err = s.load_prompt_cache(&path, &ab).unwrap_err().to_string();
    assert!(err.contains("h2o_local"), "{err}");
}

/// A quantized KV cache (`-ctk q8_0 -ctv q8_0`) saves and reuses its state as an F16 one does:
/// a prompt cache continues exactly as a fresh session; a state saved with other cache types is
/// refused with a message naming the flag.
#[test]
fn a_quantized_cache_saves_reuses_and_refuses_other_types() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    let (a, b) = prompts();
    let ab = [a.as_slice(), b.as_slice()].concat();
    let dir = common::scratch("quantized-state");
    let path = dir.join("q8.cache");
    let q8 = SessionConfig {
        cache_type_k: CacheType::Q8_0,
        cache_type_v: CacheType::Q8_0,
        ..config(Some(H2oConfig::new(32, 32)))
    };

    let mut s = Session::new(m, q8.clone()).unwrap();
    s.evaluate_saving_prompt_cache(&a, &path, |_, _| {})
        .unwrap();
    let mut s = Session::new(m, q8.clone()).unwrap();
    assert_eq!(
        s.load_prompt_cache(&path, &ab).unwrap(),
        PromptCache::Reused {
            tokens: 128,
            integrity: Integrity::Verified
        }
    );
    s.evaluate_saving_prompt_cache(&ab[128..], &dir.join("ab.cache"), |_, _| {})
        .unwrap();
    let mut fresh = Session::new(m, q8.clone()).unwrap();
    fresh.evaluate(&ab).unwrap();
    assert_eq!(s.logits().unwrap(), fresh.logits().unwrap());

    for (k, v, flag) in [
        (CacheType::F16, CacheType::Q8_0, "-ctk"),
        (CacheType::Q8_0, CacheType::Q4_0, "-ctv"),
    ] {
        let mut other = Session::new(
            m,
            SessionConfig {
                cache_type_k: k,
                cache_type_v: v,
                ..q8.clone()
            },
        )
        .unwrap();
        other.evaluate(&b[..10]).unwrap();
        let err = other.load_state(&path).unwrap_err().to_string();
        assert!(err.contains(flag), "-ctk {k} -ctv {v}: {err}");
        // llama.cpp finds the mismatch while reading the cache: the error says the session was
        // emptied, and it was
        assert!(err.contains("emptied"), "-ctk {k} -ctv {v}: {err}");
        assert_eq!(other.n_past(), 0, "-ctk {k} -ctv {v}");
    }
}
