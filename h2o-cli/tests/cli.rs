//! `h2o-cli` end to end: text and summary, the JSON record, and a clear error with a distinct
//! exit code for each class of bad input.

// The root package's shared test helpers (the default model, scratch directories).
#[path = "../../tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};

/// h2o-cli with `args` on the default model and 2 threads; a subcommand, if any, goes first
/// (every command takes the same engine flags).
fn cli(args: &[&str]) -> Output {
    let model = common::model_path();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_h2o-cli"));
    let subcommands = ["bench", "perplexity", "eval", "coverage", "heavy-hitters"];
    let args = match args.split_first() {
        Some((first, rest)) if subcommands.contains(first) => {
            cmd.arg(first);
            rest
        }
        _ => args,
    };
    if !args.contains(&"-m") {
        cmd.arg("-m").arg(&model);
    }
    cmd.args(["-t", "2"]).args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn generates_text_and_prints_a_summary() {
    let _engine = common::one_engine_at_a_time();
    let o = cli(&["-p", "The capital of France is", "-n", "8", "--temp", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout.clone()).unwrap();
    assert!(!text.trim().is_empty());
    let err = stderr(&o);
    for needle in [
        "prompt tokens",
        "chunks",
        "time to first token",
        "prefill",
        "decode",
    ] {
        assert!(err.contains(needle), "summary lacks {needle}: {err}");
    }
}

#[test]
fn json_record_describes_the_run_and_greedy_is_repeatable() {
    let _engine = common::one_engine_at_a_time();
    let args = [
        "-p",
        "List three fruits:",
        "-n",
        "12",
        "--temp",
        "0",
        "--json",
        "-b",
        "64",
        "-ub",
        "32",
    ];
    let o = cli(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let prompt_tokens = v["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 3);
    assert_eq!(v["chunks"].as_u64().unwrap(), prompt_tokens.div_ceil(32));
    assert_eq!(v["n_ubatch"], 32);
    assert!(v["prefill_tokens_per_second"].as_f64().unwrap() > 0.0);
    assert!(v["h2o"].is_null());
    // --json keeps stderr quiet.
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let again: serde_json::Value = serde_json::from_slice(&cli(&args).stdout).unwrap();
    assert_eq!(v["text"], again["text"]);
}

#[test]
fn the_demo_prompt_turns_h2o_on_by_itself() {
    let _engine = common::one_engine_at_a_time();
    // no H2O flags: the demo prompt is long enough for the recommended configuration
    let o = cli(&["-n", "2", "--temp", "0", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let auto = u64::from(h2o_llama::H2oConfig::AUTO_FROM_TOKENS);
    assert!(v["prompt_tokens"].as_u64().unwrap() >= auto, "{v}");
    let h2o = &v["h2o"];
    assert_eq!(
        (
            &h2o["local"],
            &h2o["heavy"],
            &h2o["select"],
            &h2o["decode_budget"]
        ),
        (&256.into(), &256.into(), &"coverage".into(), &1024.into()),
        "{v}"
    );
    assert_eq!(
        (&v["n_batch"], &v["n_ubatch"]),
        (&4096.into(), &1024.into())
    );
    // every chunk after the first attended to a memory, and decode read a subset of the cache
    let chunks = v["chunks"].as_u64().unwrap();
    assert!(chunks >= 5, "{v}");
    assert_eq!(v["sparse_chunks"].as_u64().unwrap(), chunks - 1, "{v}");
    assert!(v["decode_keys_per_step"].as_f64().unwrap() < 2000.0, "{v}");
}

#[test]
fn h2o_by_itself_leaves_everyday_micro_batches_to_full_attention() {
    let _engine = common::one_engine_at_a_time();
    // llama.cpp's default -ub and a smaller one, on a prompt long enough for H2O to turn on by
    // itself: chunks that do not hold its memory run full attention, never a refusal of what
    // full attention runs (-b 32 and -ub 32 are h2o-flags' unit tests and h2o-server's)
    let n = (h2o_llama::H2oConfig::AUTO_FROM_TOKENS + 4).to_string();
    let args = [
        "--synthetic-prompt",
        &n,
        "-c",
        "4608",
        "-ub",
        "512",
        "-n",
        "1",
        "--temp",
        "0",
        "--json",
    ];
    let o = cli(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["h2o_auto"]["outcome"], "full_attention", "{v}");
    let note = v["h2o_auto"]["note"].as_str().unwrap();
    assert!(note.contains("chunks of -ub 512 "), "{v}");
    assert_eq!(
        (&v["n_ubatch"], &v["sparse_chunks"]),
        (&512.into(), &0.into()),
        "{v}"
    );
    assert!(v["h2o"].is_null(), "{v}");
    // what came of it said on stderr, with the way out
    let o = cli(&[
        "--synthetic-prompt",
        &n,
        "-c",
        "4608",
        "-ub",
        "256",
        "-n",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("chunks of -ub 256 (-ub capped by -b and -c)"),
        "{err}"
    );
    assert!(
        err.contains("--h2o on") && err.contains("full attention"),
        "{err}"
    );
}

#[test]
fn h2o_on_and_off_override_the_prompts_length() {
    let _engine = common::one_engine_at_a_time();
    // a short prompt: full attention unless --h2o on
    for (args, on) in [(&[][..], false), (&["--h2o", "on"][..], true)] {
        let mut a = vec!["-p", "Hello there", "-n", "1", "--temp", "0", "--json"];
        a.extend_from_slice(args);
        let o = cli(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(!v["h2o"].is_null(), on, "{args:?}: {v}");
    }
    // without --json the summary says why
    let o = cli(&["-p", "Hello there", "-n", "1", "--temp", "0"]);
    assert!(
        stderr(&o).contains("full attention: the prompt has"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn bad_input_gives_a_clear_error_and_exit_code() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("cli-bad");
    let latin1 = dir.join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let not_gguf = dir.join("model.bin");
    std::fs::write(&not_gguf, b"PK\x03\x04 definitely not gguf").unwrap();
    let missing_prompt = dir.join("nope.txt");
    let zero_bytes = dir.join("zero.gguf");
    std::fs::write(&zero_bytes, b"").unwrap();
    // a real GGUF cut short: the header parses, the tensor data is missing
    let truncated = dir.join("truncated.gguf");
    let model = std::fs::read(common::model_path()).unwrap();
    std::fs::write(&truncated, &model[..4096]).unwrap();
    let (latin1, not_gguf, missing_prompt, zero_bytes, truncated) = (
        latin1.to_str().unwrap(),
        not_gguf.to_str().unwrap(),
        missing_prompt.to_str().unwrap(),
        zero_bytes.to_str().unwrap(),
        truncated.to_str().unwrap(),
    );
    // ~540 tokens: more than -c 256 holds
    let long_prompt = "the quick brown fox jumps over the lazy dog ".repeat(60);
    let cases: &[(&[&str], i32, &str)] = &[
        (&["-p", "x", "-ub", "0"], 3, "-ub"),
        (&["-p", "x", "-b", "0"], 3, "-b"),
        (&["-p", "x", "-b", "256", "-ub", "512"], 3, "-ub <= -b"),
        (
            &[
                "-p",
                "x",
                "-ub",
                "512",
                "--h2o-local",
                "256",
                "--h2o-heavy",
                "256",
            ],
            3,
            "smaller than the chunk size",
        ),
        (
            &["-p", "x", "--h2o-local", "-5"],
            3,
            "--h2o-local must be between 0",
        ),
        (
            &["-p", "x", "--h2o-heavy", "99999999999"],
            3,
            "--h2o-heavy must be between 0",
        ),
        (&["-p", ""], 3, "prompt is empty"),
        (
            &["-p", "x", "--h2o", "off", "--h2o-local", "8"],
            3,
            "--h2o off is full attention",
        ),
        // H2O asked for: its L + H = 512 do not fit chunks of 512 (left to decide, they run
        // full attention)
        (
            &["-ub", "512", "--h2o", "on", "-n", "0"],
            3,
            "must be smaller than the chunk size -ub 512",
        ),
        (&["bench", "--h2o", "off"], 3, "leave out --h2o"),
        // a command that sets a flag itself refuses it by name rather than ignoring it
        (&["bench", "-c", "4096"], 3, "h2o-cli bench takes no -c"),
        (&["eval", "-c", "4096"], 3, "h2o-cli eval takes no -c"),
        (&["heavy-hitters", "-b", "512"], 3, "h2o-cli heavy-hitters takes no -b"),
        (&["-f", missing_prompt], 3, "cannot read prompt file"),
        (&["-f", latin1], 3, "not UTF-8"),
        (&["-m", not_gguf, "-p", "x"], 4, "not a GGUF"),
        (&["-m", zero_bytes, "-p", "x"], 4, "empty"),
        (&["-m", truncated, "-p", "x"], 4, "could not load the model"),
        (&["-c", "256", "-p", &long_prompt], 3, "use a larger -c"),
        (
            &[
                "-p",
                "x",
                "-c",
                "64",
                "--h2o-local",
                "32",
                "--h2o-heavy",
                "32",
            ],
            3,
            "which the context -c 64 caps at 64 (-ub 1024): raise -c",
        ),
        (
            &["-m", "/nonexistent/model.gguf", "-p", "x"],
            4,
            "not found",
        ),
        (&["-p", "x", "--no-such-flag"], 2, "--no-such-flag"),
        (
            &["-p", "x", "-ctk", "q9_0"],
            2,
            "unknown KV cache type \"q9_0\": use one of f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1",
        ),
        (
            &["-p", "x", "-ctv", "q8_0", "-fa", "off"],
            3,
            "a quantized V cache (-ctv q8_0) needs flash attention",
        ),
        (
            &["-p", "x", "--h2o-select", "nope"],
            2,
            "unknown H2O selection policy \"nope\": use one of seed, hybrid, coverage",
        ),
        (
            &["-p", "x", "--h2o-select", "query-mean"],
            2,
            "the H2O selection policy \"query-mean\" was retired: it lost to hybrid on every text \
             measured; use hybrid",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-sink",
                "65",
            ],
            3,
            "is larger than the heavy budget --h2o-heavy 64",
        ),
        (
            &[
                "-p",
                "x",
                "-c",
                "512",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-dense-tail",
                "600",
            ],
            3,
            "is longer than the context -c 512",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-select",
                "coverage",
                "--h2o-coverage",
                "0",
            ],
            3,
            "H2O coverage --h2o-coverage 0 must be in (0, 1]",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-coverage",
                "1.5",
            ],
            3,
            "H2O coverage --h2o-coverage 1.5 must be in (0, 1]",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-tile-samples",
                "3",
            ],
            3,
            "--h2o-tile-samples 3 must divide the tile of 64 queries",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-tile-sketch",
                "3",
            ],
            3,
            "--h2o-tile-sketch 3 must be 1, 2, 4 or 8",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-tile-pool",
                "100",
            ],
            3,
            "--h2o-tile-pool 100 must be 0 (off) or, with --h2o-select coverage, at least 4 × --h2o-heavy = 256",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-select",
                "hybrid",
                "--h2o-tile-pool",
                "256",
            ],
            3,
            "--h2o-tile-pool 256 must be 0 (off) or, with --h2o-select coverage",
        ),
        (
            &[
                "-p",
                "x",
                "-c",
                "1024",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-decode",
                "sparse",
                "--h2o-decode-budget",
                "2048",
            ],
            3,
            "--h2o-decode-budget 2048 is larger than the context -c 1024",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-decode",
                "sparse",
                "--h2o-decode-coverage",
                "1.5",
            ],
            3,
            "--h2o-decode-coverage 1.5 must be in (0, 1]",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-decode-coverage",
                "0.9",
            ],
            3,
            "--h2o-decode-coverage 0.9 needs sparse decode",
        ),
        (
            &["-p", "x", "--h2o-decode", "sparse"],
            3,
            "--h2o-decode sparse and --h2o-decode-coverage need H2O on",
        ),
        (
            &[
                "-p",
                "x",
                "--h2o-local",
                "64",
                "--h2o-heavy",
                "64",
                "--h2o-decode",
                "sometimes",
            ],
            2,
            "sometimes",
        ),
    ];
    for (args, code, needle) in cases {
        let o = cli(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(*code), "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: expected {needle:?} in {err}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// llama.cpp caps -b at -c (and -ub at -b) and rounds the context up to 256 cells: a prompt
/// that fits the rounded context runs, in batches no larger than the cap.
#[test]
fn a_context_smaller_than_the_batch_caps_the_batch() {
    let _engine = common::one_engine_at_a_time();
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(20); // ~180 tokens
    for extra in [
        &[][..],
        &["-ub", "64", "--h2o-local", "16", "--h2o-heavy", "16"][..],
    ] {
        let o = cli(&[&["-c", "64", "-p", &prompt, "-n", "2", "--json"][..], extra].concat());
        let err = stderr(&o);
        assert!(o.status.success(), "{extra:?}: {err}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["n_batch"], 64, "{v}");
        assert!(v["prompt_tokens"].as_u64().unwrap() > 64, "{v}");
    }
}

#[test]
fn h2o_prefill_runs_end_to_end() {
    let _engine = common::one_engine_at_a_time();
    // 600-token demo prompt in chunks of 256: chunks 1 and 2 attend to a memory of 64 + 64 tokens
    let o = cli(&[
        "-p",
        &h2o_llama::demo::prompt(20),
        "-n",
        "4",
        "--temp",
        "0",
        "-b",
        "1024",
        "-ub",
        "256",
        "--h2o-local",
        "64",
        "--h2o-heavy",
        "64",
        "--json",
        "-v",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    // llama.cpp checked that the scheduler runs each layer's H2O op where its state lives, and
    // says where that is (all 30 layers on the CPU here; on a GPU build with -ngl 99, CUDA0 30)
    assert!(
        err.contains("H2O attention ops: 30, each on the backend holding its state (CPU 30)"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let chunks = v["chunks"].as_u64().unwrap();
    assert!(chunks >= 2, "{v}");
    assert_eq!(v["sparse_chunks"].as_u64(), Some(chunks - 1), "{v}");
    assert!(v["h2o_state_bytes"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["h2o"]["local"].as_u64(), Some(64));
    assert_eq!(v["generated_tokens"].as_u64(), Some(4), "{v}");
}

#[test]
fn prompt_cache_continues_exactly_as_a_fresh_run() {
    let _engine = common::one_engine_at_a_time();
    // The case that used to differ: the default policy with its dense tail, a first prompt that
    // ends inside a chunk, then a longer prompt beginning with it. The cache holds the first
    // prompt up to the chunk boundary before its dense tail, and the longer prompt's text and
    // next-token logits equal a fresh run of it.
    let dir = common::scratch("cli-prompt-cache");
    let cache = dir.join("prompt.cache");
    let cache_arg = cache.to_str().unwrap();
    let first = h2o_llama::demo::prompt(10);
    let second = format!("{first} The ledger was then closed, and the clerk wrote that");
    let run_with = |local: &str, prompt: &str, logits: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "-p",
            prompt,
            "-n",
            "8",
            "--temp",
            "0",
            "--json",
            "-c",
            "1024",
            "-b",
            "256",
            "-ub",
            "64",
            "--h2o-local",
            local,
            "--h2o-heavy",
            "16",
            "--logits-out",
            logits.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = cli(&args);
        (
            o.status.code(),
            serde_json::from_slice::<serde_json::Value>(&o.stdout).ok(),
            stderr(&o),
        )
    };
    let run = |prompt: &str, logits: &std::path::Path, extra: &[&str]| {
        run_with("16", prompt, logits, extra)
    };
    let logits = |name: &str| dir.join(name);

    let (code, v1, err) = run(&first, &logits("1"), &["--prompt-cache", cache_arg]);
    assert_eq!(code, Some(0), "{err}");
    let v1 = v1.unwrap();
    assert_eq!(v1["cached_prompt_tokens"], 0, "{v1}");
    let n_first = v1["prompt_tokens"].as_u64().unwrap();
    // mid-chunk, with a dense tail of 64 that reaches back into the chunk before
    assert!(n_first % 64 != 0 && n_first > 256, "{v1}");
    assert_eq!(v1["dense_tail_tokens"].as_u64(), Some(64), "{v1}");
    assert!(cache.exists(), "no prompt cache written: {err}");
    // saved at the chunk boundary before the tail
    let boundary = (n_first - 64) / 64 * 64;

    let (code, v2, err) = run(&second, &logits("2"), &["--prompt-cache", cache_arg]);
    assert_eq!(code, Some(0), "{err}");
    let v2 = v2.unwrap();
    assert_eq!(v2["cached_prompt_tokens"].as_u64(), Some(boundary), "{v2}");

    let (code, v3, err) = run(&second, &logits("3"), &[]);
    assert_eq!(code, Some(0), "{err}");
    let v3 = v3.unwrap();
    assert_eq!(
        v2["prompt_tokens"].as_u64().unwrap() + boundary,
        v3["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(v2["text"], v3["text"], "cached run {v2}\nfresh run {v3}");
    assert!(
        std::fs::read(logits("2")).unwrap() == std::fs::read(logits("3")).unwrap(),
        "the next-token logits after the cached run differ from a fresh run's"
    );
    // the engine's counts: every chunk after the first that starts before the dense tail (the
    // last 64 tokens) ran sparse, in the fresh run and in the part the cached run evaluated
    let n_second = v3["prompt_tokens"].as_u64().unwrap();
    let sparse_from = |first: u64| {
        (first / 64..)
            .take_while(|c| c * 64 < n_second - 64)
            .filter(|&c| c >= 1)
            .count() as u64
    };
    assert_eq!(v3["sparse_chunks"].as_u64(), Some(sparse_from(0)), "{v3}");
    assert_eq!(
        v2["sparse_chunks"].as_u64(),
        Some(sparse_from(boundary)),
        "{v2}"
    );
    assert_eq!(v2["dense_tail_tokens"].as_u64(), Some(64), "{v2}");

    // a cache saved with other H2O settings is refused, not overwritten
    let before = std::fs::read(&cache).unwrap();
    let (code, _, err) = run_with("32", &second, &logits("4"), &["--prompt-cache", cache_arg]);
    assert_eq!(code, Some(3), "{err}");
    assert!(
        err.contains("h2o_local = 16") && err.contains(cache_arg),
        "{err}"
    );
    assert!(
        std::fs::read(&cache).unwrap() == before,
        "the cache was changed"
    );

    // a damaged or cut cache is refused naming the file and what is wrong with it, exit 3,
    // and left as it is; nothing is generated from it
    let mut damaged = before.clone();
    damaged[before.len() / 2] ^= 0x40;
    let cut = before.len() / 2;
    for (bytes, needle) in [
        (damaged, "damaged".to_string()),
        (
            before[..cut].to_vec(),
            format!("truncated ({cut} of {} bytes)", before.len()),
        ),
    ] {
        std::fs::write(&cache, &bytes).unwrap();
        let (code, v, err) = run(&second, &logits("5"), &["--prompt-cache", cache_arg]);
        assert_eq!(code, Some(3), "{err}");
        assert!(v.is_none(), "a damaged cache produced output");
        assert!(err.contains(&needle) && err.contains(cache_arg), "{err}");
        assert!(
            std::fs::read(&cache).unwrap() == bytes,
            "the cache was changed"
        );
    }
    // a cache saved before checked state files (llama.cpp's session file alone) is used with a
    // warning, and saved again with its checksum
    std::fs::write(&cache, &before[32..]).unwrap();
    let (code, v, err) = run(&second, &logits("6"), &["--prompt-cache", cache_arg]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("has no checksum"), "{err}");
    assert_eq!(v.unwrap()["text"], v3["text"]);
}

#[test]
fn the_engine_counts_sparse_chunks_and_dense_tail_tokens() {
    let _engine = common::one_engine_at_a_time();
    let run = |tail: &str| {
        let o = cli(&[
            "-p",
            &h2o_llama::demo::prompt(20),
            "-n",
            "1",
            "--temp",
            "0",
            "-b",
            "1024",
            "-ub",
            "128",
            "--h2o-local",
            "32",
            "--h2o-heavy",
            "32",
            "--h2o-dense-tail",
            tail,
            "--json",
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let v = run("0");
    let chunks = v["chunks"].as_u64().unwrap();
    assert!(chunks >= 4, "{v}");
    assert_eq!(v["sparse_chunks"].as_u64(), Some(chunks - 1), "{v}");
    assert_eq!(v["dense_tail_tokens"].as_u64(), Some(0), "{v}");
    // a tail covering the whole prompt: full attention for every token, no chunk sparse
    let n = v["prompt_tokens"].as_u64().unwrap();
    let v = run("1024");
    assert_eq!(v["sparse_chunks"].as_u64(), Some(0), "{v}");
    assert_eq!(v["dense_tail_tokens"].as_u64(), Some(n), "{v}");
    // a tail of 200: the chunks it covers whole run dense
    let v = run("200");
    let dense_from = (n - 200) as usize;
    let sparse = (1..chunks as usize)
        .filter(|c| c * 128 < dense_from)
        .count() as u64;
    assert_eq!(v["sparse_chunks"].as_u64(), Some(sparse), "{v}");
    assert_eq!(v["dense_tail_tokens"].as_u64(), Some(200), "{v}");
}

#[test]
fn bench_measures_both_engines_and_reports_the_ratio() {
    let _engine = common::one_engine_at_a_time();
    let model = common::model_path();
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
            .arg("bench")
            .arg("-m")
            .arg(&model)
            .args(["-p", "300,600", "-r", "1", "--ubatch-size", "256"])
            .args(["--h2o-local", "32", "--h2o-heavy", "32"])
            .args(extra)
            .output()
            .unwrap()
    };
    let dir = common::scratch("bench-png");
    let png = dir.join("bench.png");
    let o = bench(&["--json", "--png", png.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    // with --json the record is on stdout and the progress, a line per run in a log, on stderr
    for run in 1..=4 {
        assert!(
            stderr(&o).contains(&format!("h2o-cli bench: run {run}/4: N = ")),
            "{}",
            stderr(&o)
        );
    }
    assert_png(&png, 960, 600);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(report["baseline"].as_str().unwrap().contains("not stock"));
    // the sketch left out is named as the runs chose it for the model's 64-channel key heads
    assert_eq!(report["h2o"]["tile_sketch"], 4, "{}", report["h2o"]);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, n) in rows.iter().zip([300, 600]) {
        assert_eq!(row["n_prompt"], n);
        let tps = |side: &str| row[side]["tokens_per_second"][0].as_f64().unwrap();
        assert!(tps("baseline") > 0.0 && tps("h2o") > 0.0);
        let ratio = row["speedup"].as_f64().unwrap();
        assert!((ratio - tps("h2o") / tps("baseline")).abs() < 1e-9);
        assert_eq!(row["baseline"]["h2o_state_bytes"], 0);
        assert!(row["h2o"]["h2o_state_bytes"].as_u64().unwrap() > 0);
        assert!(row["h2o"]["kv_cache_bytes"].as_u64().unwrap() > 0);
        assert!(row["h2o"]["peak_rss_bytes"][0].as_u64().unwrap() > 0);
    }

    // a stock build that is not there is named, with how to build it
    let o = bench(&["--stock-cli", "/nonexistent/h2o-cli"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(stderr(&o).contains("--features stock"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A PNG file of the given size, with something drawn in it (not one flat colour).
fn assert_png(path: &std::path::Path, width: u32, height: u32) {
    let bytes = std::fs::read(path).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
    // IHDR: width and height, big-endian, right after the signature and the chunk header
    let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    assert_eq!((be(16), be(20)), (width, height));
    // a blank image of this size compresses to well under 10 KB
    assert!(
        bytes.len() > 10_000,
        "{} looks empty ({} bytes)",
        path.display(),
        bytes.len()
    );
}

#[test]
fn heavy_hitters_reports_selections_and_their_stability() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("heavy-hitters");
    let png = dir.join("map.png");
    let o = Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("heavy-hitters")
        .arg("-m")
        .arg(common::model_path())
        .args([
            "-n",
            "600",
            "--ubatch-size",
            "128",
            "--h2o-local",
            "16",
            "--h2o-heavy",
            "24",
            "--json",
            "--png",
            png.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_png(&png, 1100, 860);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["prompt_tokens"], 600);
    // chunks 0..3 are complete: a memory set after each
    assert_eq!(r["sets_per_head"], 4);
    let model = common::model();
    let layers = r["final_heavy"].as_array().unwrap();
    assert_eq!(layers.len(), model.n_layer() as usize);
    for heads in layers {
        let heads = heads.as_array().unwrap();
        assert_eq!(heads.len(), model.n_head() as usize);
        for set in heads {
            let p: Vec<u64> = set
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            // H heavy hitters, ascending, before the local window of the last complete chunk
            assert_eq!(p.len(), 24, "{p:?}");
            assert!(p.windows(2).all(|w| w[0] < w[1]), "{p:?}");
            assert!(*p.last().unwrap() < 4 * 128 - 16, "{p:?}");
        }
    }
    for key in [
        "chunk_to_chunk_jaccard",
        "run_to_run_jaccard_mean",
        "run_to_run_jaccard_min",
    ] {
        let j = r[key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&j), "{key} = {j}");
    }
    // the second run differs only in batching and thread count
    assert!(r["run_to_run_jaccard_min"].as_f64().unwrap() > 0.9, "{r}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `h2o-cli coverage`: on a real model's attention, the oracles rank as they must (a set per
/// query covers at least what a set per tile does, and that at least what one per chunk does, at
/// the same budget), budgets that follow coverage keep the average, and estimators report a cost.
#[test]
fn coverage_study_orders_the_oracles_and_keeps_the_average_budget() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("coverage");
    let text = dir.join("text.txt");
    std::fs::write(&text, h2o_llama::demo::prompt(30)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("coverage")
        .arg("-m")
        .arg(common::model_path())
        .arg("-f")
        .arg(&text)
        .args(["-c", "768", "--ubatch-size", "256", "--h2o-local", "32"])
        .args(["--h2o-heavy", "96", "--layers", "3,17", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["n_tokens"], 768);
    assert_eq!(r["layers"].as_array().unwrap().len(), 2);
    let rows = r["rows"].as_array().unwrap();
    let find = |strategy: &str, budget: &str| -> &serde_json::Value {
        rows.iter()
            .find(|x| x["strategy"] == strategy && x["budget"] == budget)
            .unwrap_or_else(|| panic!("no row {strategy} / {budget} in {r}"))
    };
    let mean =
        |strategy: &str, budget: &str| find(strategy, budget)["coverage_mean"].as_f64().unwrap();
    let (chunk, tile, query) = (
        mean("oracle: per chunk", "fixed"),
        mean("oracle: per tile", "fixed"),
        mean("oracle: per query", "fixed"),
    );
    assert!(
        chunk <= tile + 1e-6 && tile <= query + 1e-6,
        "{chunk} {tile} {query}"
    );
    assert!(query <= 1.0 + 1e-6 && chunk > 0.5, "{r}");
    for row in rows {
        let m = row["coverage_mean"].as_f64().unwrap();
        assert!((0.0..=1.0 + 1e-6).contains(&m), "{row}");
        assert!(m <= query + 1e-6 || row["granularity"] != "query", "{row}");
    }
    // budgets that follow coverage spread around the average, which stays M = 128
    let moved = find("sampled queries (1 in 16) per tile", "across heads");
    let spread: Vec<u64> = moved["budget_spread"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(spread[0] <= 128 && spread[2] >= 128, "{moved}");
    assert!(moved["cost_share"].as_f64().unwrap() > 0.0, "{moved}");
    assert_eq!(find("oracle: per chunk", "fixed")["cost_share"], 0.0);
    // a proposal shared by two tiles costs less than each tile's own
    let two_stages = |proposal: &str| {
        find(
            &format!("two stages: sampled queries (1 in 4){proposal} + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile"),
            "across heads",
        )["cost_share"]
            .as_f64()
            .unwrap()
    };
    assert!(two_stages(" of 1 tile in 2") < two_stages(""));
    // with --json the progress still goes to stderr
    assert!(
        stderr(&o).contains("h2o-cli coverage: 18/18 heads studied"), // 9 heads in 2 layers
        "{}",
        stderr(&o)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn perplexity_scores_h2o_against_full_attention() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("perplexity");
    let text_file = dir.join("ledger.txt");
    let text = h2o_llama::demo::prompt(40);
    std::fs::write(&text_file, &text).unwrap();
    let perplexity = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
            .arg("perplexity")
            .arg("-m")
            .arg(common::model_path())
            .arg("-f")
            .arg(&text_file)
            .args(["-c", "512", "-b", "256", "--ubatch-size", "128"])
            .args(["--h2o-local", "32", "--h2o-heavy", "32", "--chunks", "1"])
            .args(["-t", "2", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = perplexity(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    // progress on stderr with --json too; not a terminal here, so a log line
    assert!(
        stderr(&o).contains("h2o-cli perplexity: window 1/1"),
        "{}",
        stderr(&o)
    );
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["windows"], 1);
    assert_eq!(r["whole"]["positions"], 511);
    assert_eq!(r["second_half"]["positions"], 255);
    for part in ["whole", "second_half"] {
        let p = &r[part];
        assert!(p["ppl_h2o"].as_f64().unwrap() > 1.0);
        assert!(p["kld_mean"].as_f64().unwrap() >= 0.0);
        let top1 = p["top1_agreement_percent"].as_f64().unwrap();
        assert!((0.0..=100.0).contains(&top1));
    }

    // full attention's perplexity, recomputed here from the library's logits
    let m = common::model();
    let tokens = m.tokenize(&text, true, false).unwrap();
    let mut s = h2o_llama::Session::new(
        m,
        h2o_llama::SessionConfig {
            n_ctx: 512,
            n_batch: 256,
            n_ubatch: 128,
            n_threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let mut nll = 0.0f64;
    s.evaluate_with_logits(&tokens[..512], |i, logits| {
        if i + 1 < 512 {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
            nll += sum.ln() - f64::from(logits[tokens[i + 1] as usize] - max);
        }
    })
    .unwrap();
    let ppl = (nll / 511.0).exp();
    let reported = r["whole"]["ppl_full"].as_f64().unwrap();
    assert!(
        (ppl - reported).abs() / ppl < 1e-4,
        "perplexity {reported}, recomputed {ppl}"
    );

    // ablation: local-only, heavy-only at the same M, and the main shape again, against the
    // same full attention; the main shape's figures are the same as without the ablation
    let o = perplexity(&["--ablate", "64:0,0:64,32:32"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let a: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let shapes = a["shapes"].as_array().unwrap();
    let lh: Vec<(u64, u64)> = shapes
        .iter()
        .map(|s| {
            (
                s["h2o"]["local"].as_u64().unwrap(),
                s["h2o"]["heavy"].as_u64().unwrap(),
            )
        })
        .collect();
    // the main shape once, first, even when the ablation names it again
    assert_eq!(lh, [(32, 32), (64, 0), (0, 64)]);
    assert_eq!(shapes[0]["second_half"], r["second_half"]);
    assert_ne!(
        shapes[1]["second_half"]["ppl_h2o"],
        shapes[2]["second_half"]["ppl_h2o"]
    );
    let o = perplexity(&["--ablate", "64"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("write an H2O shape as L:H"),
        "{}",
        stderr(&o)
    );

    // the speed of each configuration on the first window, and the chart of Δ ppl against it;
    // the seventh ablation field is coverage selection's target
    let png = dir.join("tradeoff.png");
    let o = perplexity(&[
        "--ablate",
        "32:32:coverage:4:64:4:0.9",
        "--speed",
        "1",
        "--png",
        png.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(t["shapes"][1]["h2o"]["coverage"].as_f64(), Some(0.9));
    let prefill = &t["prefill"];
    assert_eq!(prefill["tokens"], 512);
    assert!(prefill["full_attention_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(prefill["shape_seconds"].as_array().unwrap().len(), 2);
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));

    // --decode-tail: the window's last 40 tokens through sparse and full-attention decode
    let o = perplexity(&[
        "--h2o-decode",
        "sparse",
        "--h2o-decode-budget",
        "64",
        "--decode-tail",
        "40",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(d["tail"], 40);
    assert_eq!(d["summary"]["positions"], 39, "{d}");
    assert!(d["summary"]["kld_mean"].as_f64().unwrap() > 0.0, "{d}");
    // a step at position p reads 16 sinks, 64 chosen and the window from a block boundary
    let keys = d["sparse_keys_per_step"].as_f64().unwrap();
    assert!(keys < 16.0 + 64.0 + 32.0 + 16.0, "{d}");
    assert!(d["full_keys_per_step"].as_f64().unwrap() > 470.0, "{d}");
    assert!(d["sparse_steps_per_second"].as_f64().unwrap() > 0.0);
    // without sparse decode there is nothing to compare
    let o = perplexity(&["--decode-tail", "40"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("--h2o-decode sparse"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ctrl-C during a long prefill: llama.cpp's abort callback stops the graph between nodes, so
/// the process ends soon after the signal, with exit code 130 and a one-line message.
#[test]
fn ctrl_c_stops_a_long_prefill_promptly() {
    let _engine = common::one_engine_at_a_time();
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("-m")
        .arg(common::model_path())
        .args(["-t", "2", "-c", "8192", "-b", "4096", "-ub", "1024"])
        .args(["--h2o-local", "256", "--h2o-heavy", "256"])
        .args(["--synthetic-prompt", "8000", "-n", "4", "--temp", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The signal goes once h2o-cli has printed its H2O state line: the model is loaded, the
    // context made, and the prefill (tens of seconds for 8000 tokens on two cores) comes next.
    // Waiting for that line, not for a fixed time, keeps the test right on a loaded machine.
    let stderr_pipe = child.stderr.take().unwrap();
    let (header_tx, header_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stderr_pipe)
            .lines()
            .map_while(Result::ok)
        {
            if line.starts_with("h2o-cli: H2O state:") {
                let _ = header_tx.send(());
            }
            lines.push(line);
        }
        lines.join("\n")
    });
    if header_rx.recv_timeout(Duration::from_secs(300)).is_err() {
        let _ = child.kill();
        panic!(
            "h2o-cli printed no H2O state line within 300 s:\n{}",
            reader.join().unwrap()
        );
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "h2o-cli ended before the interrupt"
    );
    let sent = Instant::now();
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = sent + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("h2o-cli still running 60 s after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stopped_after = sent.elapsed();
    let o = child.wait_with_output().unwrap();
    let err = reader.join().unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted by Ctrl-C"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        o.stdout.is_empty(),
        "nothing generated after an interrupted prefill"
    );
    eprintln!("stopped {stopped_after:?} after SIGINT");
}

/// `h2o-cli eval`: the same generated prompts answered by full attention and two H2O policies,
/// as a JSON record and one heatmap per contender.
#[test]
fn eval_scores_full_attention_and_each_policy_on_the_same_prompts() {
    let _engine = common::one_engine_at_a_time();
    let dir = common::scratch("eval");
    let o = Command::new(env!("CARGO_BIN_EXE_h2o-cli"))
        .arg("eval")
        .arg("-m")
        .arg(common::model_path())
        .args([
            "--tasks",
            "passkey,kv-lookup",
            "--lengths",
            "400",
            "--depths",
            "50",
            "--ubatch-size",
            "128",
            "--h2o-local",
            "32",
            "--h2o-heavy",
            "32",
            "--json",
            "--png-dir",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = r["contenders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "full attention",
            "seed sink 0 tail 0",
            "coverage sink 4 tail 64"
        ]
    );
    let prompts = r["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 2, "one prompt per task, length and depth");
    let mut correct = [0u64; 3];
    for p in prompts {
        let tokens = p["answers"][0]["prompt_tokens"].as_u64().unwrap();
        assert!((390..=528).contains(&tokens), "{tokens} prompt tokens");
        let answers = p["answers"].as_array().unwrap();
        assert_eq!(answers.len(), 3, "an answer from every contender");
        for (c, a) in answers.iter().enumerate() {
            // every contender read the same prompt
            assert_eq!(a["prompt_tokens"].as_u64(), Some(tokens));
            correct[c] += u64::from(a["correct"].as_bool().unwrap());
        }
    }
    let totals: Vec<u64> = r["correct"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(totals, correct, "totals are the answers' sum");
    for name in &names {
        assert_png(
            &dir.join(format!("eval-{}.png", name.replace(' ', "-"))),
            560,
            150 + 56,
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
