//! The safe API on the real default model: loading, tokenizer round trips, deterministic
//! greedy generation across sessions and after reset, and clear errors for bad input.

mod common;

use h2o_llama::{
    CacheType, Error, H2oConfig, Model, ModelParams, Sampler, SamplerConfig, Session, SessionConfig,
};

fn small_config() -> SessionConfig {
    SessionConfig {
        n_ctx: 2048,
        n_batch: 512,
        n_ubatch: 256,
        n_threads: 2,
        ..SessionConfig::default()
    }
}

fn greedy(session: &mut Session<'_>, prompt: &str, n: usize) -> Vec<i32> {
    let tokens = session.model().tokenize(prompt, true, true).unwrap();
    let mut sampler = Sampler::new(&SamplerConfig::greedy()).unwrap();
    session
        .generate(&tokens, &mut sampler, n, |_| true)
        .unwrap()
        .tokens
}

#[test]
fn default_model_loads_with_expected_shape() {
    let m = common::model();
    // SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, 49152-token vocabulary, 8K context.
    assert_eq!(m.n_layer(), 30);
    assert_eq!(m.n_head(), 9);
    assert_eq!(m.n_head_kv(), 3);
    assert_eq!(m.n_vocab(), 49152);
    assert_eq!(m.n_ctx_train(), 8192);
    assert!(m.description().contains("Q4_1"), "{}", m.description());
    assert_eq!(m.meta("general.architecture").as_deref(), Some("llama"));
    assert_eq!(m.meta("llama.no_such_key"), None);
    // llama.cpp's own log for -c 4096: "K (f16): 45.00 MiB, V (f16): 45.00 MiB"; a q8_0 row of
    // 3 KV heads × 64 is 6 blocks of 34 bytes
    assert_eq!(
        m.kv_cache_bytes(4096, CacheType::F16, CacheType::F16),
        90 * 1024 * 1024
    );
    assert_eq!(
        m.kv_cache_bytes(4096, CacheType::Q8_0, CacheType::Q8_0),
        2 * 30 * 4096 * 6 * 34
    );
}

#[test]
fn tokenize_detokenize_round_trips() {
    let m = common::model();
    for text in [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.\nSecond line\twith a tab.",
        "Unicode: naïve café, 東京, emoji 🎉, math ∑ x²",
        "   leading spaces and trailing   ",
        &h2o_llama::demo::prompt(5),
    ] {
        let tokens = m.tokenize(text, false, false).unwrap();
        assert!(!tokens.is_empty());
        assert_eq!(
            m.detokenize(&tokens, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
        // Piece by piece, too (the streaming path).
        let bytes: Vec<u8> = tokens
            .iter()
            .flat_map(|&t| m.token_bytes(t, false).unwrap())
            .collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), text);
    }
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused_not_aborted_on() {
    let m = common::model();
    let n_vocab = m.n_vocab();
    for bad in [-1, n_vocab as i32, i32::MAX] {
        assert!(
            matches!(m.detokenize(&[1, bad], false), Err(Error::InvalidToken { token, .. }) if token == bad),
            "detokenize {bad}"
        );
        assert!(matches!(
            m.token_bytes(bad, false),
            Err(Error::InvalidToken { .. })
        ));
    }
    assert_eq!(m.detokenize(&[], false).unwrap(), "");
}

#[test]
fn text_with_nul_is_a_clear_error() {
    let err = common::model().tokenize("a\0b", false, false).unwrap_err();
    assert!(matches!(err, Error::NulInText(1)), "{err}");
}

#[test]
fn greedy_generation_is_deterministic_across_sessions_and_after_reset() {
    let m = common::model();
    let prompt = "The three primary colours are";
    let mut a = Session::new(m, small_config()).unwrap();
    let first = greedy(&mut a, prompt, 24);
    assert_eq!(
        first.len(),
        24,
        "greedy run stopped early: {:?}",
        m.detokenize(&first, false)
    );
    let mut b = Session::new(m, small_config()).unwrap();
    assert_eq!(
        greedy(&mut b, prompt, 24),
        first,
        "a second session differs"
    );
    // Reusing a session after reset gives the same tokens again, also after other work.
    a.reset();
    let _ = greedy(&mut a, "Something else entirely: a list of rivers", 8);
    a.reset();
    assert_eq!(a.n_past(), 0);
    assert_eq!(
        greedy(&mut a, prompt, 24),
        first,
        "the session differs after reset"
    );
}

#[test]
fn logits_are_available_after_evaluate_and_identical_across_sessions() {
    let m = common::model();
    let tokens = m
        .tokenize(&h2o_llama::demo::prompt(12), true, true)
        .unwrap();
    assert!(tokens.len() > 300);
    let run = |cfg: &SessionConfig, split: &[usize]| {
        let mut s = Session::new(m, cfg.clone()).unwrap();
        assert!(s.logits().is_none());
        let mut start = 0;
        for &end in split.iter().chain(std::iter::once(&tokens.len())) {
            s.evaluate(&tokens[start..end]).unwrap();
            start = end;
        }
        s.logits().unwrap().to_vec()
    };
    let cfg = small_config();
    let whole = run(&cfg, &[]);
    assert_eq!(whole.len(), m.n_vocab());
    assert!(whole.iter().all(|x| x.is_finite()));
    assert_eq!(run(&cfg, &[]), whole, "a second session differs");
    // Split on a ubatch boundary: the same ubatches run, bit for bit.
    assert_eq!(
        run(&cfg, &[256]),
        whole,
        "split at the ubatch boundary differs"
    );
    // Without flash attention, any split is bit-identical. (llama.cpp's CPU flash attention
    // takes different F16 accumulation paths for different ubatch shapes, so there a
    // misaligned split moves logits by up to ~0.5: measured, not asserted.)
    let no_fa = SessionConfig {
        flash_attn: h2o_llama::FlashAttention::Off,
        ..small_config()
    };
    let whole_no_fa = run(&no_fa, &[]);
    assert_eq!(
        run(&no_fa, &[100, 300]),
        whole_no_fa,
        "misaligned split differs without flash attention"
    );
}

#[test]
fn seeded_sampling_is_reproducible() {
    let m = common::model();
    let cfg = SamplerConfig {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
        ..SamplerConfig::default()
    };
    let tokens = m.tokenize("Once upon a time", true, true).unwrap();
    let run = || {
        let mut s = Session::new(m, small_config()).unwrap();
        let mut sampler = Sampler::new(&cfg).unwrap();
        s.generate(&tokens, &mut sampler, 16, |_| true)
            .unwrap()
            .tokens
    };
    assert_eq!(run(), run());
}

#[test]
fn bad_session_parameters_are_clear_errors() {
    let m = common::model();
    let cases: Vec<(SessionConfig, &str)> = vec![
        (
            SessionConfig {
                n_batch: 0,
                ..small_config()
            },
            "-b",
        ),
        (
            SessionConfig {
                n_ubatch: 0,
                ..small_config()
            },
            "-ub",
        ),
        (
            SessionConfig {
                n_batch: 256,
                n_ubatch: 512,
                ..small_config()
            },
            "-ub <= -b",
        ),
        (
            SessionConfig {
                n_threads: 0,
                ..small_config()
            },
            "-t",
        ),
        (
            SessionConfig {
                h2o: Some(H2oConfig::seed(128, 128)),
                ..small_config()
            },
            "must be smaller than the chunk size",
        ),
    ];
    for (cfg, needle) in cases {
        let err = Session::new(m, cfg.clone()).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{cfg:?}: {err}");
        assert!(err.to_string().contains(needle), "{cfg:?}: {err}");
    }
    // L = H = 0 is H2O off: accepted.
    Session::new(
        m,
        SessionConfig {
            h2o: Some(H2oConfig::default()),
            ..small_config()
        },
    )
    .unwrap();
}

#[test]
fn empty_and_too_long_prompts_are_clear_errors() {
    let m = common::model();
    let mut s = Session::new(
        m,
        SessionConfig {
            n_ctx: 256,
            n_batch: 256,
            n_ubatch: 256,
            ..small_config()
        },
    )
    .unwrap();
    assert!(matches!(s.evaluate(&[]), Err(Error::EmptyPrompt)));
    let long = m
        .tokenize(&h2o_llama::demo::prompt(40), true, true)
        .unwrap();
    assert!(long.len() > 256);
    match s.evaluate(&long) {
        Err(Error::PromptTooLong {
            n_past,
            n_prompt,
            n_ctx,
            ..
        }) => {
            assert_eq!((n_past, n_prompt), (0, long.len()));
            assert_eq!(n_ctx, 256);
        }
        other => panic!("expected PromptTooLong, got {other:?}"),
    }
    // Nothing was evaluated, the session still works.
    assert_eq!(s.n_past(), 0);
    s.evaluate(&long[..100]).unwrap();
    assert!(matches!(
        s.evaluate(&[-1]),
        Err(Error::InvalidToken { token: -1, .. })
    ));
}

#[test]
fn bad_model_files_are_clear_errors_not_crashes() {
    let dir = common::scratch("bad-models");
    let p = ModelParams::default();

    let missing = dir.join("missing.gguf");
    assert!(matches!(
        Model::load(&missing, &p),
        Err(Error::ModelNotFound { .. })
    ));

    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = Model::load(&empty, &p).unwrap_err();
    assert!(
        matches!(e, Error::NotGguf { .. }) && e.to_string().contains("empty"),
        "{e}"
    );

    let text = dir.join("notes.txt");
    std::fs::write(&text, "this is not a model\n").unwrap();
    assert!(matches!(Model::load(&text, &p), Err(Error::NotGguf { .. })));

    assert!(matches!(Model::load(&dir, &p), Err(Error::NotGguf { .. })));

    // A real GGUF cut short: the header parses but tensor data is missing.
    let full = std::fs::read(common::model_path()).unwrap();
    for cut in [8usize, 4096, full.len() / 2, full.len() - 1] {
        let truncated = dir.join(format!("truncated-{cut}.gguf"));
        std::fs::write(&truncated, &full[..cut]).unwrap();
        let e = Model::load(&truncated, &p).unwrap_err();
        assert!(matches!(e, Error::ModelLoad { .. }), "cut at {cut}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_grammar_and_a_logit_bias_shape_what_is_sampled_and_bad_ones_are_refused() {
    let m = common::model();
    let prompt = m.tokenize("The capital of France is", true, true).unwrap();
    let greedy = |config: &SamplerConfig| {
        let mut s = Session::new(m, small_config()).unwrap();
        let mut sampler = Sampler::for_model(m, config).unwrap();
        s.generate(&prompt, &mut sampler, 6, |_| true).unwrap()
    };
    let plain = greedy(&SamplerConfig::greedy());
    let first = plain.tokens[0];
    let banned = greedy(&SamplerConfig {
        logit_bias: vec![(first, f32::NEG_INFINITY)],
        ..SamplerConfig::greedy()
    });
    assert_ne!(banned.tokens[0], first, "a banned token was sampled");
    let digits = greedy(&SamplerConfig {
        grammar: Some("root ::= [0-9]+".into()),
        ..SamplerConfig::greedy()
    });
    assert!(
        !digits.text.is_empty() && digits.text.chars().all(|c| c.is_ascii_digit()),
        "{:?}",
        digits.text
    );

    let refused = |config: SamplerConfig, what: &str| {
        let e = Sampler::for_model(m, &config).expect_err(what);
        assert!(
            matches!(e, h2o_llama::Error::InvalidConfig(_)),
            "{what}: {e}"
        );
    };
    refused(
        SamplerConfig {
            logit_bias: vec![(m.n_vocab() as i32, 1.0)],
            ..SamplerConfig::greedy()
        },
        "a token outside the vocabulary",
    );
    refused(
        SamplerConfig {
            grammar: Some("root ::= (".into()),
            ..SamplerConfig::greedy()
        },
        "a grammar that does not parse",
    );
    assert!(
        Sampler::new(&SamplerConfig {
            grammar: Some("root ::= \"a\"".into()),
            ..SamplerConfig::greedy()
        })
        .is_err(),
        "a grammar needs the vocabulary: Sampler::for_model"
    );
}
